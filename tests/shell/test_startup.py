"""Checks before an engine starts: a model path that is no directory is refused naming
``model_name`` (no Hub lookup), and a script that would start the async engine again in
vLLM's spawned engine core (no ``__main__`` guard) is refused before anything spawns."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from genworker.core.model_source import ModelSource
from genworker.shell.errors import BadConfigError
from genworker.shell.startup import checked_model, checked_model_source

SCRIPT = """\
import sys
from genworker.shell.startup import check_main_guard

def start():
    check_main_guard("the test's engine")
    print("started")

{body}
"""


def test_a_directory_or_a_hub_id_is_a_model_and_anything_else_is_refused(tmp_path: Path) -> None:
    assert checked_model_source(str(tmp_path)) is ModelSource.LOCAL_DIRECTORY
    assert checked_model_source("Qwen/Qwen3-0.6B") is ModelSource.HUB_ID
    file = tmp_path / "config.json"
    file.write_text("{}", encoding="utf-8")
    for name, says in (
        (str(tmp_path / "missing"), "no such directory"),
        (str(file), "is a file, not a model directory"),
        ("~/surely-no-such-genworker-model", "no such directory"),
        ("models/llama/7b", "not a Hugging Face Hub id"),
    ):
        with pytest.raises(BadConfigError, match="model_name") as error:
            checked_model_source(name)
        assert says in str(error.value)
        assert repr(name) in str(error.value)


def test_an_engine_model_is_a_str_checked_as_a_model_name(tmp_path: Path) -> None:
    assert checked_model(str(tmp_path)) == str(tmp_path)
    for model in (None, 7, tmp_path):
        with pytest.raises(BadConfigError, match="engine kwargs need 'model' as a str"):
            checked_model(model)
    with pytest.raises(BadConfigError, match="model_name"):
        checked_model(str(tmp_path / "missing"))


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(body=textwrap.dedent(body)), encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )


def test_an_unguarded_script_is_told_to_guard_its_entry(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "start()\n")
    assert proc.returncode == 1
    assert "UnguardedMainError" in proc.stderr
    assert "line 8 starts it at the script's top level" in proc.stderr
    assert "Guard your script's entry with if __name__ == '__main__':" in proc.stderr
    assert "started" not in proc.stdout


def test_a_guarded_script_starts(tmp_path: Path) -> None:
    proc = run_script(tmp_path, 'if __name__ == "__main__":\n    start()\n')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "started\n"


UNGUARDED_WORKER = """\
import sys
from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.local import worker_config

config = worker_config(sys.argv[1], pad_token_id=0, max_new_tokens=4, temperature=1.0,
                       device="cpu")
config["vllm_cfg"]["async_engine"] = True
worker = AsyncVllmGenerationWorker(config)
"""


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_the_async_worker_refuses_an_unguarded_script_before_it_spawns(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The real async worker, started at a script's top level: the typed error names the
    guard (vLLM's own report is only 'Engine core initialization failed' in the parent),
    and no engine core was started."""
    path = tmp_path / "rollouts.py"
    path.write_text(UNGUARDED_WORKER, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(path), str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONSAFEPATH": "1", "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert proc.returncode == 1
    assert "genworker.shell.startup.UnguardedMainError" in proc.stderr
    assert "line 8 starts it at the script's top level" in proc.stderr
    assert "EngineCore" not in proc.stderr  # nothing spawned


@pytest.mark.engine
def test_the_async_worker_refuses_a_model_path_that_is_no_directory(tmp_path: Path) -> None:
    """A wrong local path is refused naming model_name at once, not after vLLM's Hub
    retries ('Repo id must be ...')."""
    from genworker.shell.async_worker import AsyncVllmGenerationWorker
    from genworker.shell.local import worker_config

    config = worker_config(
        str(tmp_path / "no-such-model"),
        pad_token_id=0,
        max_new_tokens=4,
        temperature=1.0,
        device="cpu",
    )
    vllm_cfg = config["vllm_cfg"]
    assert isinstance(vllm_cfg, dict)
    vllm_cfg["async_engine"] = True
    with pytest.raises(BadConfigError, match=r"model_name: .*no-such-model.*: no such directory"):
        AsyncVllmGenerationWorker(config)


@pytest.mark.engine
def test_the_sync_worker_refuses_a_model_path_that_is_no_directory(tmp_path: Path) -> None:
    from genworker.shell.local import worker_config
    from genworker.shell.worker import VllmGenerationWorker

    model = tmp_path / "model.safetensors"
    model.write_bytes(b"")
    config = worker_config(
        str(model), pad_token_id=0, max_new_tokens=4, temperature=1.0, device="cpu"
    )
    with pytest.raises(BadConfigError, match=r"model_name: .*: is a file, not a model directory"):
        VllmGenerationWorker(config)
