"""NeMo-RL's own trainer wire refits the real CPU engine through the NeMo-RL-facing worker.

A trainer process (``nemo_rl_trainer``) speaks NeMo-RL's IPC wire (a bound REQ socket,
pickled handles of ping-pong staging buffers, ``COMPLETE``; CPU shared memory standing in
for CUDA IPC, admitted only by this test configuration's allowlist) and its packed
broadcasts (gloo standing in for NCCL). Every refit is checked the strong way: greedy
tokens afterwards equal those of a fresh engine on the same saved weights. Failures
return ``False`` with the typed error kept, the trainer's stream still ends (the engine
answers up to ``COMPLETE``), and a good refit afterwards serves the new weights.

The engine is this module's own (refits change its weights): it sorts before the modules
that use the session engine.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import right_padded
from nemo_rl_trainer import NemoRlTrainer, install_cpu_codec
from refit_helpers import (
    PROMPTS,
    REFIT_TIMEOUT,
    Engine,
    Weights,
    free_port,
)
from safetensors.torch import load_file

from genworker.shell.errors import (
    BadArgumentError,
    EngineStateError,
    RefitError,
    RefitManifestError,
    RefitTimeoutError,
)
from genworker.shell.nemo_rl import NemoRlGenerationWorker
from genworker.shell.refit.nemo_rl import CODECS
from genworker.shell.worker import ExistingEngine

pytest_plugins = ["refit_engine_fixtures"]

pytestmark = [pytest.mark.timeout(600), pytest.mark.engine]

CONFIG = {
    "model_name": "tiny", "max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0,
    "top_k": None, "stop_token_ids": None, "stop_strings": None, "_pad_token_id": 2,
    "vllm_cfg": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                 "gpu_memory_utilization": 0.05, "max_model_len": 256,
                 "precision": "float32",
                 "reset_encoder_cache_after_weight_update": False},  # NeMo-RL's stock value
}  # fmt: skip
PACKED_BYTES = 64 << 10  # several packed broadcasts for the tiny model


@pytest.fixture(scope="module", autouse=True)
def test_configuration() -> Iterator[None]:
    """The CPU handle codec on the engine side, and NeMo-RL's packing ratio for a small
    target on both sides (set before the trainer process starts)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.MonkeyPatch.context() as mp:
        install_cpu_codec(mp)
        mp.setenv("NRL_REFIT_BUFFER_MEMORY_RATIO", repr(PACKED_BYTES / total))
        yield


@pytest.fixture(scope="module")
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="nrl-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def trainer(test_configuration: None) -> Iterator[NemoRlTrainer]:
    t = NemoRlTrainer()
    yield t
    t.stop()


@pytest.fixture
def worker(engine: Engine, socket_dir: str, weights: Weights) -> NemoRlGenerationWorker:
    from genworker.shell.vllm_engine import VllmEngine

    w = NemoRlGenerationWorker(
        CONFIG,
        [0],
        engine_factory=ExistingEngine(VllmEngine(engine.llm)),
        ipc_socket_dir=socket_dir,
    )
    # NeMo-RL's prepare_refit_info: {name: (torch.Size, torch.dtype)}, in the trainer's order
    assert (
        w.prepare_refit_info({n: (t.shape, t.dtype) for n, t in load_file(weights.b).items()})
        is None
    )
    return w


def tokens(worker: NemoRlGenerationWorker) -> list[list[int]]:
    data = right_padded(PROMPTS, pad=2)
    out = worker.generate(data, greedy=True)
    starts, ends = data["input_lengths"], out["unpadded_sequence_lengths"]
    return [out["output_ids"][i, starts[i] : ends[i]].tolist() for i in range(len(PROMPTS))]


def address(socket_dir: str) -> str:
    """Where NeMo-RL's policy worker binds: ``ipc:///tmp/<report_device_id()>.sock``."""
    return f"ipc://{socket_dir}/cpu@{socket.gethostname()}.sock"


def ipc_refit(
    worker: NemoRlGenerationWorker,
    trainer: NemoRlTrainer,
    socket_dir: str,
    path: Path,
    **command: object,
) -> tuple[bool, dict[str, object]]:
    trainer.submit("ipc", address=address(socket_dir), path=str(path), **command)
    ok = worker.update_weights_via_ipc_zmq(refit_timeout_s=REFIT_TIMEOUT)
    sent = trainer.result()
    assert sent.ok, sent  # the trainer's stream ended: every message was answered
    assert sent.detail["answer"] == "ack"
    return ok, dict(sent.detail)


def test_the_production_allowlist_has_no_cpu_codec() -> None:
    from genworker.core.nemo_rl_wire import NEMO_RL_IPC_GLOBALS

    assert (
        "torch.multiprocessing.reductions",
        "rebuild_storage_filename",
    ) not in NEMO_RL_IPC_GLOBALS
    assert CODECS["cpu"].allowlist is not NEMO_RL_IPC_GLOBALS  # this module's configuration


def test_nemo_rl_ipc_refits_match_fresh_engines(
    worker: NemoRlGenerationWorker,
    trainer: NemoRlTrainer,
    socket_dir: str,
    weights: Weights,
    engine: Engine,
    reference_b: list[list[int]],
) -> None:
    assert tokens(worker) == engine.baseline_a != reference_b
    for path, expected in ((weights.b, reference_b), (weights.a, engine.baseline_a)):
        ok, sent = ipc_refit(worker, trainer, socket_dir, path)
        assert ok is True, worker.last_refit_error
        assert worker.last_refit_error is None
        assert isinstance(sent["groups"], int)
        assert 2 < sent["groups"] < 21  # packed ping-pong buffers, oversized tensors alone
        assert tokens(worker) == expected


def test_a_silent_trainer_times_out_typed_and_the_worker_stays_usable(
    worker: NemoRlGenerationWorker,
    trainer: NemoRlTrainer,
    socket_dir: str,
    weights: Weights,
    reference_b: list[list[int]],
) -> None:
    assert worker.update_weights_via_ipc_zmq(refit_timeout_s=1.0) is False
    assert isinstance(worker.last_refit_error, RefitTimeoutError)
    assert "sent nothing within 1s" in str(worker.last_refit_error)
    ok, _ = ipc_refit(worker, trainer, socket_dir, weights.b)
    assert ok is True, worker.last_refit_error
    assert tokens(worker) == reference_b


@pytest.mark.parametrize("evil", ["os.system", "eval"])
def test_a_pickle_carrying_another_callable_is_refused_and_the_worker_stays_usable(
    worker: NemoRlGenerationWorker,
    trainer: NemoRlTrainer,
    socket_dir: str,
    weights: Weights,
    reference_b: list[list[int]],
    evil: str,
) -> None:
    ok, _ = ipc_refit(worker, trainer, socket_dir, weights.b, evil=evil)
    assert ok is False
    error = worker.last_refit_error
    assert isinstance(error, RefitError)
    assert "refused before loading" in str(error)
    assert ("posix.system" if evil == "os.system" else "builtins.eval") in str(error)
    with pytest.raises(EngineStateError, match="refit"):
        tokens(worker)
    ok, _ = ipc_refit(worker, trainer, socket_dir, weights.b)
    assert ok is True, worker.last_refit_error
    assert tokens(worker) == reference_b


@pytest.mark.parametrize(
    ("edits", "named"),
    [
        ({"drop": ["model.norm.weight"]}, "model.norm.weight"),
        # The wire carries names and bytes only: a dtype change shows in the bucket's size
        # (one within a tensor's 512-byte alignment would not, to NeMo-RL's receiver either).
        (
            {"retype": {"model.layers.0.mlp.down_proj.weight": "float16"}},
            "model.layers.0.mlp.down_proj.weight",
        ),
    ],
)
def test_a_stream_that_breaks_the_manifest_returns_false_naming_the_tensor(
    worker: NemoRlGenerationWorker,
    trainer: NemoRlTrainer,
    socket_dir: str,
    weights: Weights,
    reference_b: list[list[int]],
    edits: dict[str, object],
    named: str,
) -> None:
    ok, _ = ipc_refit(worker, trainer, socket_dir, weights.b, edits=edits)
    assert ok is False
    assert isinstance(worker.last_refit_error, RefitManifestError)
    assert named in str(worker.last_refit_error)
    ok, _ = ipc_refit(worker, trainer, socket_dir, weights.b)
    assert ok is True, worker.last_refit_error
    assert tokens(worker) == reference_b


def test_nemo_rl_collective_refits_match_fresh_engines(
    worker: NemoRlGenerationWorker,
    trainer: NemoRlTrainer,
    weights: Weights,
    engine: Engine,
    reference_b: list[list[int]],
) -> None:
    assert worker.update_weights_from_collective(refit_timeout_s=REFIT_TIMEOUT) is False
    assert isinstance(worker.last_refit_error, EngineStateError)  # no group yet
    port = free_port()
    trainer.submit("join", port=port, world_size=2)
    worker.init_collective(0, "127.0.0.1", port, 2, 1)
    joined = trainer.result()
    assert joined.ok, joined
    for path, expected in ((weights.b, reference_b), (weights.a, engine.baseline_a)):
        trainer.submit("collective", path=str(path))
        ok = worker.update_weights_from_collective(refit_timeout_s=REFIT_TIMEOUT)
        sent = trainer.result()
        assert sent.ok, sent
        assert ok is True, worker.last_refit_error
        assert isinstance(sent.detail["groups"], int)
        assert sent.detail["groups"] > 1
        assert tokens(worker) == expected


def test_a_relative_socket_dir_is_refused_by_name(engine: Engine) -> None:
    from genworker.shell.vllm_engine import VllmEngine

    w = NemoRlGenerationWorker(
        CONFIG, [0], engine_factory=ExistingEngine(VllmEngine(engine.llm)), ipc_socket_dir="tmp"
    )
    assert w.update_weights_via_ipc_zmq(refit_timeout_s=1.0) is False
    assert isinstance(w.last_refit_error, BadArgumentError)
    assert "socket_dir must be an absolute path" in str(w.last_refit_error)
