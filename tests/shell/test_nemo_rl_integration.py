"""genworker's NeMo-RL drop-ins driven by NeMo-RL's own code (issue 43's integration test).

From NeMo-RL's source (``GENWORKER_NEMO_RL_SRC``, a tree holding ``nemo_rl/``; tested at
7ea279ab), run as a NeMo-RL user would (``nemo_rl_integration_driver.py``, in a process of
its own): ``ray.init(num_cpus=2)``, NeMo-RL's ``RayVirtualCluster(use_gpus=False)``, its
``configure_generation_config`` and ``get_tokenizer``, its ``VllmGeneration`` with the worker
class pointed at genworker's drop-ins as docs/nemo-rl.md says (its ``RayWorkerBuilder`` and
``RayWorkerGroup`` build them), grpo.py's ``refit_policy_generation`` for every refit, and
rollouts.py's ``generate_responses`` / ``generate_responses_async`` for every generation.
The model is the tiny Llama (``build_tiny_model``: A, and B with seed 1). Scenarios:

* **sync** (``stop_strings_mode: per_sample``): IPC refits A then B (colocated), NeMo-RL's
  collective set up as grpo.py does, collective refits A, B, A; per-row stop strings;
  ``generate_text``.
* **sync_batch_union** (``stop_strings_mode: batch_union``): an IPC refit to A, the same
  stop strings and ``generate_text``.
* **async**: an IPC refit to A, then an IPC refit to B started while rows stream (an
  in-flight async refit), then per-row stop strings.

A refit is checked the strong way: the engine's logprobs of its own sampled tokens equal
the trainer's (a Hugging Face forward of the same weights) to 1e-4, and differ from the
other checkpoint's. Every sample sent comes back with all its tokens; no refit logs a
failure (genworker's, or vLLM's "weights were not loaded" / "Failed to load weights").

**Not NeMo-RL's code** (each named, nothing else):

* The trainer: ``nemo_rl_policy.StandInPolicy`` stands in for NeMo-RL's ``lm_policy.Policy``
  (its DTensor and Megatron workers need CUDA). It speaks NeMo-RL's wire as re-implemented
  in ``nemo_rl_trainer`` (CPU shared memory for CUDA IPC handles, gloo for NCCL), and the
  engine side reads the CPU handles through the test codec that ``sitecustomize`` installs.
* The test's own environment, ``nemo_rl_site/sitecustomize.py`` (loaded only in this
  test's processes, by ``GENWORKER_NEMO_RL_SITE=1``):

  - NeMo-RL's ``nemo_rl/models/policy/__init__.py`` runs with its one
    ``assert transformers < 5.12`` left out (vLLM 0.32 needs transformers >= 5.16.1);
  - NeMo-RL's modules run with ``typing.TypedDict`` as Python 3.12+ has it
    (``typing_extensions.TypedDict``): NeMo-RL needs Python 3.13, this venv has 3.11;
  - stubs for modules unrelated to generation this venv lacks, each a module whose every
    attribute raises when used: ``wandb``, ``mlflow``, ``swanlab``,
    ``torch.utils.tensorboard`` (loggers), ``torchdata``, ``datasets``, ``pandas`` (data
    loading), ``pynvml`` (NVIDIA's GPU monitor), ``tensordict`` (NeMo-RL's data plane),
    ``absl``, ``scipy``, ``soundfile`` (audio datasets), ``hydra`` (the DTensor
    trainer's class loader).

``test_nemo_rl_site`` checks that environment without NeMo-RL.

Without ``GENWORKER_NEMO_RL_SRC`` every test here is skipped, saying so. ``make
test-nemo-rl NEMO_RL=<NeMo-RL checkout or bare git mirror>`` extracts the source and runs
this module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from genworker.demo.tiny_model import build_tiny_model

NEMO_RL_SRC = os.environ.get("GENWORKER_NEMO_RL_SRC")
TESTS = Path(__file__).resolve().parent.parent
SITE = TESTS / "nemo_rl_site"
DRIVER = TESTS / "nemo_rl_integration_driver.py"
PACKED_BYTES = 64 << 10  # NeMo-RL's packed broadcasts: several for the tiny model
CLOSE = 1e-4  # engine and trainer logprobs on the same weights (float32)
APART = 0.1  # ... on different weights

pytestmark = [
    pytest.mark.skipif(
        not NEMO_RL_SRC,
        reason=(
            "GENWORKER_NEMO_RL_SRC is not set: point it at a NeMo-RL source tree (the folder "
            "holding nemo_rl/, e.g. a checkout of github.com/NVIDIA-NeMo/RL at 7ea279ab), or "
            "run `make test-nemo-rl NEMO_RL=<checkout or bare git mirror>`"
        ),
    ),
    pytest.mark.timeout(1800),
    pytest.mark.engine,
]


@attrs.frozen
class Run:
    report: dict[str, Any]
    log: str
    returncode: int

    def seen(self, scenario: str) -> dict[str, Any]:
        seen = self.report.get(scenario)
        assert isinstance(seen, dict), f"{scenario} did not run: {self.log[-3000:]}"
        return seen


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    source = Path(str(NEMO_RL_SRC))
    assert (source / "nemo_rl" / "__init__.py").is_file(), (
        f"GENWORKER_NEMO_RL_SRC={source} holds no nemo_rl/ package"
    )
    work = tmp_path_factory.mktemp("nemo-rl")
    model_b = build_tiny_model(work / "tiny-llama-b", seed=1)
    report = work / "report.json"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    env = {
        **os.environ,
        "GENWORKER_NEMO_RL_SITE": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(SITE), str(source), str(TESTS), os.environ.get("PYTHONPATH", "")]
        ),
        "NRL_REFIT_BUFFER_MEMORY_RATIO": repr(PACKED_BYTES / total),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "RAY_DEDUP_LOGS": "0",
    }
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(tiny_model_dir), str(model_b), str(report)],
        capture_output=True,
        text=True,
        timeout=1700,
        env=env,
        check=False,
    )
    log = done.stdout + done.stderr
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith("[driver]")))
    assert report.is_file(), f"the driver wrote no report (rc {done.returncode}): {log[-5000:]}"
    return Run(json.loads(report.read_text()), log, done.returncode)


SCENARIOS = ("sync", "sync_batch_union", "async")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_scenario_runs_to_its_end(run: Run, scenario: str) -> None:
    seen = run.seen(scenario)
    assert seen["error"] is None, seen["error"]
    assert run.returncode == 0, run.log[-3000:]


@pytest.mark.parametrize(
    ("scenario", "module"),
    [
        ("sync", "genworker.shell.nemo_rl"),
        ("sync_batch_union", "genworker.shell.nemo_rl"),
        ("async", "genworker.shell.nemo_rl_async"),
    ],
)
def test_nemo_rls_vllm_generation_builds_genworkers_drop_in_on_a_cpu_cluster(
    run: Run, scenario: str, module: str
) -> None:
    seen = run.seen(scenario)
    assert seen["worker_class"] == module
    assert seen["device_uuids"] == [[run.report["device_id"]]]


def _refits_land(seen: dict[str, Any], kind: str, labels: list[str]) -> None:
    for label in labels:
        assert seen[f"gap_after_{kind}_{label}"] < CLOSE, (label, seen)


def test_sync_ipc_refits_through_grpos_refit_function_land(run: Run) -> None:
    seen = run.seen("sync")
    assert [r["metrics"] for r in seen["ipc_refits"]] == [{}, {}]
    _refits_land(seen, "ipc", ["a", "b"])
    assert seen["gap_b_engine_vs_a_trainer"] > APART  # what a refit that did not land gives
    assert seen["policy_calls"] == 2 * [
        "offload_before_refit",
        "stream_weights_via_ipc_zmq",
        "offload_after_refit",
    ]


def test_sync_collective_refits_through_grpos_refit_function_land(run: Run) -> None:
    seen = run.seen("sync")
    assert [r["metrics"] for r in seen["collective_refits"]] == [{}, {}, {}]
    _refits_land(seen, "collective", ["a", "b"])
    assert seen["rows"] == 4


def test_async_ipc_refit_in_flight_loses_no_sample(run: Run) -> None:
    seen = run.seen("async")
    _refits_land(seen, "ipc", ["a"])
    assert seen["in_flight_refit"]["metrics"] == {}
    assert seen["in_flight_rows_back"] == seen["in_flight_rows_sent"] > 0
    # Each row runs to max_new_tokens, or ends on one of NeMo-RL's stop_token_ids (the
    # tokenizer's EOS, which configure_generation_config adds and ignore_eos does not cover).
    full = seen["max_new_tokens"]
    assert full > 100
    for tokens in seen["in_flight_tokens"]:
        assert len(tokens) == full or (
            len(tokens) < full and tokens[-1] in seen["stop_token_ids"]
        ), (len(tokens), tokens[-3:], seen["stop_token_ids"])
    assert seen["in_flight_spanning"] >= 1, seen  # a row was generating across the refit
    _refits_land(seen, "in_flight", ["b"])


def test_per_sample_stop_strings_stop_each_row_on_its_own(run: Run) -> None:
    seen = run.seen("sync")
    assert seen["stop_lengths"] == seen["expected_per_sample"] != seen["expected_batch_union"]


def test_batch_union_stop_strings_stop_every_row_on_every_rows_strings(run: Run) -> None:
    per_sample, union = run.seen("sync"), run.seen("sync_batch_union")
    assert union["unstopped_tokens"] == per_sample["unstopped_tokens"]  # the same batch on A
    assert union["stop_strings"] == per_sample["stop_strings"]
    assert union["stop_lengths"] == union["expected_batch_union"] != per_sample["stop_lengths"]


def test_async_stop_strings_stop_each_sample(run: Run) -> None:
    seen = run.seen("async")
    assert seen["stop_lengths"] == seen["expected_per_sample"]
    assert any(s for s in seen["stop_strings"])


@pytest.mark.parametrize("scenario", ["sync", "sync_batch_union"])
def test_generate_text_gives_the_tokenizers_text_of_the_tokens(run: Run, scenario: str) -> None:
    seen = run.seen(scenario)
    assert len(seen["texts"]) == 4
    assert all(seen["texts"])
    assert seen["texts"] == seen["texts_of_tokens"]


FAILURE_LOGS = re.compile(
    r"weights were not loaded|Failed to load weights|update_weights\S* failed"
    r"|Error: Updating weights|Traceback"
)


def test_no_refit_logs_a_failure(run: Run) -> None:
    refits = sum(len(run.seen(s).get("ipc_refits", [])) for s in SCENARIOS)
    refits += len(run.seen("sync").get("collective_refits", []))
    # sync: 2 IPC and 3 collective; batch union: 1 IPC; async: 1 IPC (+ the in-flight one)
    assert refits == 2 + 3 + 1 + 1
    assert FAILURE_LOGS.search(run.log) is None, FAILURE_LOGS.findall(run.log)


def _site() -> Any:
    spec = importlib.util.spec_from_file_location("nemo_rl_site_doc", SITE / "sitecustomize.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_stub_is_listed_here_and_only_missing_modules_are_stubbed(run: Run) -> None:
    stubs = _site().STUBS
    for name in stubs:
        assert f"``{name}``" in str(__doc__), name
    loaded = run.report["stubs_loaded"]
    for name in loaded:
        assert any(name == s or name.startswith(f"{s}.") for s in stubs), name
    for name in stubs:  # each listed stub was needed, or the real module is installed
        assert name in loaded or importlib.util.find_spec(name) is not None, name
