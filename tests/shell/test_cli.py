"""``genworker`` on the command line: ``generate``'s stdout is JSON records only (vLLM's log
lines go to stderr), and each demo mode refuses the other's options."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from genworker.shell.cli import main

PROMPTS = ["Hello", "Once upon a time", "The quick brown fox", "Numbers: 1 2", "To be", "A"]


def run_cli(args: list[str], *, code: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("VLLM_LOGGING_LEVEL", None)
    script = code or "from genworker.shell.cli import main; raise SystemExit(main())"
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS), encoding="utf-8")
    return path


# Stands in for any other writer to stdout while the command runs (a library's print, a
# C++ warning on file descriptor 1): the worker prints when it starts.
NOISY = """
import os
from genworker.shell import worker
start = worker.VllmGenerationWorker.__init__
def noisy(self, *args, **kwargs):
    print("noise from print")
    os.write(1, b"noise on fd 1\\n")
    start(self, *args, **kwargs)
worker.VllmGenerationWorker.__init__ = noisy
from genworker.shell.cli import main
code = main()
print("after the command: stdout is back")
raise SystemExit(code)
"""


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_generate_writes_only_json_records_to_stdout(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = run_cli(
        ["generate", "--model", str(tiny_model_dir), "--prompts", str(prompts_file(tmp_path)),
         "--max-new-tokens", "6", "--chunk", "2", "--log-level", "info"],
        code=NOISY,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    *lines, tail = proc.stdout.splitlines()
    assert tail == "after the command: stdout is back"
    records = [json.loads(line) for line in lines]  # every other line is a JSON record
    assert [r["prompt"] for r in records] == PROMPTS
    assert all(0 < r["generated_tokens"] <= 6 for r in records)
    assert "INFO" in proc.stderr  # vLLM's log lines went to stderr, not away
    assert "noise from print" in proc.stderr
    assert "noise on fd 1" in proc.stderr
    assert "generating" in proc.stderr  # the progress bar: 6 prompts in chunks of 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--table", "--steps", "3"], "--steps is an option of the RL loop"),
        (["demo", "--shards", "2", "--out", "x"], "--out is an option of the RL loop"),
        (["demo", "--batch", "3"], "--batch is an option of the table"),
        (["demo", "--greedy"], "--greedy is an option of the table"),
        (["demo", "--steps", "0"], "--steps must be at least 1"),
        (["demo", "--samples", "1"], "--samples must be at least 2"),
        (["demo", "--learning-rate", "0"], "--learning-rate must be positive"),
        (["generate", "--model", "m", "--prompts", "p", "--chunk", "0"], "--chunk must be"),
        (["generate", "--model", "m", "--prompts", "p", "--log-level", "loud"], "invalid choice"),
        (["generate", "--model", "m", "--prompts", "p", "-q", "--log-level", "info"], "-q or"),
    ],
)
def test_options_that_would_do_nothing_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = dict(os.environ)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert {k: v for k, v in os.environ.items() if k.startswith("VLLM_LOGGING")} == {
        k: v for k, v in before.items() if k.startswith("VLLM_LOGGING")
    }


CONFIGURED = (
    "VLLM_LOGGING_LEVEL",
    "VLLM_LOGGING_STREAM",
    "TRANSFORMERS_VERBOSITY",
    "HF_HUB_DISABLE_PROGRESS_BARS",
)


@pytest.mark.parametrize(
    ("level", "env", "quiet", "expected"),
    [(None, None, False, "WARNING"), ("info", "DEBUG", False, "INFO"),
     (None, "debug", False, "DEBUG"), (None, None, True, "ERROR")],
)  # fmt: skip
def test_the_log_level_goes_to_vllm_before_it_is_imported(
    monkeypatch: pytest.MonkeyPatch, level: str | None, env: str | None, quiet: bool, expected: str
) -> None:
    """vLLM reads its logging settings when first imported: the CLI sets them first."""
    from genworker.shell import cli

    for name in CONFIGURED:  # set first, so that monkeypatch removes them again afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    if env is not None:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", env)
    monkeypatch.setattr(logging, "captureWarnings", lambda capture: None)
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", vllm_logger.level)
    cli._configure_logs(level, "warning", quiet)
    assert os.environ["VLLM_LOGGING_LEVEL"] == expected
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"
    assert os.environ["TRANSFORMERS_VERBOSITY"] == expected.lower()
    assert ("HF_HUB_DISABLE_PROGRESS_BARS" in os.environ) is (expected in ("WARNING", "ERROR"))


def test_an_unknown_vllm_logging_level_in_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from genworker.shell import cli

    for name in CONFIGURED:
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "LOUD")
    with pytest.raises(SystemExit, match="VLLM_LOGGING_LEVEL='loud'"):
        cli._configure_logs(None, "warning", False)
