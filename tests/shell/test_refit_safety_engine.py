"""Issue 44 on the real vLLM CPU engine: no silent corruption from a refit.

Non-finite refits are refused on the engine side (IPC, the collective and the sparse
path) and a good refit then serves the tokens of a fresh engine on the good weights; the
switch ``vllm_cfg.refit_finite_check: false`` lets them through; a manifest that declares
int32 for a float32 parameter (same byte size) is refused naming the tensor and both
dtypes; a sparse step sent while a batch runs waits for it. Each test ends with a good
batch. The engine is this module's own (``refit_engine_fixtures``): refits change it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import pytest
import torch
from helpers import right_padded
from refit_helpers import PROMPTS, REFIT_TIMEOUT, Engine, Trainer, Weights, edited, free_port
from safetensors.torch import load_file

from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.shell.errors import (
    EngineStateError,
    RefitError,
    RefitManifestError,
    RefitTimeoutError,
)
from genworker.shell.refit.sparse import SparseRefitError, SparseSender
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

pytest_plugins = ["refit_engine_fixtures"]

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

NORM = "model.norm.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def config(max_new_tokens: int = 12, **vllm: object) -> dict[str, object]:
    return {
        "model_name": "tiny", "max_new_tokens": max_new_tokens, "temperature": 1.0,
        "top_p": 1.0, "top_k": None, "stop_token_ids": None, "stop_strings": None,
        "_pad_token_id": 2, "ignore_eos": True,
        "vllm_cfg": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                     "gpu_memory_utilization": 0.05, "max_model_len": 256,
                     "precision": "float32", **vllm},
    }  # fmt: skip


@attrs.define
class Worker:
    worker: VllmGenerationWorker
    engine: Engine
    weights: Weights

    def rows(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[set[int]]]:
        """Greedy tokens of ``prompts`` and each row's weight versions."""
        data = right_padded(prompts, pad=2)
        out = self.worker.generate(data, greedy=True)
        starts, ends = data["input_lengths"], out["unpadded_sequence_lengths"]
        rows = range(len(prompts))
        tokens = [out["output_ids"][i, starts[i] : ends[i]].tolist() for i in rows]
        versions = [set(out["weight_versions"][i, starts[i] : ends[i]].tolist()) for i in rows]
        return tokens, versions

    def tokens(self) -> list[list[int]]:
        return self.rows(PROMPTS)[0]

    def prepare(self) -> None:
        state_dict = load_file(self.weights.b)
        self.worker.prepare_refit_info({n: (t.shape, t.dtype) for n, t in state_dict.items()})

    def ipc(self, trainer: Trainer, path: Path, **command: object) -> None:
        (address,) = self.worker.refit_address()
        trainer.submit("ipc", address=address, path=str(path), **command)
        try:
            assert self.worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT) is True
        finally:
            sent = trainer.result()
        assert sent.ok, sent

    def back_to_a(self, trainer: Trainer) -> None:
        self.ipc(trainer, self.weights.a)
        assert [row[:12] for row in self.tokens()] == self.engine.baseline_a


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    t = Trainer()
    yield t
    t.stop()


def make_worker(engine: Engine, weights: Weights, **cfg: object) -> Worker:
    from genworker.shell.vllm_engine import VllmEngine

    w = VllmGenerationWorker(config(**cfg), engine_factory=ExistingEngine(VllmEngine(engine.llm)))  # type: ignore[arg-type]
    return Worker(w, engine, weights)


@pytest.fixture
def worker(engine: Engine, weights: Weights) -> Iterator[Worker]:
    w = make_worker(engine, weights)
    yield w
    w.worker.stop_zmq_sparse_refit_relay()


def engine_rpc_zeroes_kv(engine: Engine) -> bool:
    """The engine worker zeroes its KV cache memory (``refit_reset_kv``): it finds
    the KV cache tensors (a count above 0), not an empty list."""
    zeroed = engine.rpc("refit_reset_kv")
    return isinstance(zeroed, int) and zeroed > 0


# -- 1. non-finite refits --------------------------------------------------------------


def test_a_nan_ipc_refit_is_refused_then_a_good_refit_serves_a_fresh_engines_tokens(
    worker: Worker, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    """The issue measured 4 failing generate calls after NaN-then-good before the fix."""
    worker.prepare()
    resets = worker.worker.cache_resets["prefix"]
    (address,) = worker.worker.refit_address()
    trainer.submit("ipc", address=address, path=str(weights.b), nan=[NORM])
    with pytest.raises(RefitError, match=rf"non-finite values .*'{NORM}'") as refused:
        worker.worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT)
    assert not trainer.result().ok
    assert worker.worker.cache_resets["prefix"] == resets + 1  # reset after the failure
    assert not getattr(refused.value, "__notes__", None)  # and the KV cache zeroed
    assert engine_rpc_zeroes_kv(worker.engine)
    with pytest.raises(EngineStateError, match="refit"):
        worker.tokens()  # never serves the half-written weights
    worker.ipc(trainer, weights.b)
    for _ in range(5):  # every batch after the good refit, not only the first
        assert worker.tokens() == reference_b
    worker.back_to_a(trainer)


def test_a_nan_collective_refit_is_refused_then_a_good_refit_serves_a_fresh_engines_tokens(
    worker: Worker, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    worker.prepare()
    port = free_port()
    trainer.submit("join", port=port, world_size=2)
    worker.worker.init_collective(0, "127.0.0.1", port, 2, 1, timeout_s=REFIT_TIMEOUT)
    assert trainer.result().ok
    trainer.submit("collective", path=str(weights.b), nan=[Q_PROJ])
    with pytest.raises(RefitError, match=rf"non-finite values .*'{Q_PROJ}'"):
        worker.worker.update_weights_from_collective(timeout_s=REFIT_TIMEOUT)
    assert not trainer.result().ok
    with pytest.raises(EngineStateError, match="refit"):
        worker.tokens()
    trainer.submit("collective", path=str(weights.b))
    assert worker.worker.update_weights_from_collective(timeout_s=REFIT_TIMEOUT) is True
    assert trainer.result().ok
    assert worker.tokens() == reference_b
    assert worker.tokens() == reference_b
    worker.back_to_a(trainer)


def sparse_sender(worker: Worker, tensors: dict[str, torch.Tensor], hop_s: float) -> SparseSender:
    urls = worker.worker.start_zmq_sparse_refit_relay()
    manifest = Manifest.from_specs(TensorSpec.of(n, t) for n, t in tensors.items()).unwrap()
    return SparseSender(urls, manifest, hop_s=hop_s)


def test_a_nan_sparse_step_is_refused_then_a_good_step_serves_a_fresh_engines_tokens(
    worker: Worker, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    b = load_file(weights.b)
    with sparse_sender(worker, b, hop_s=30.0) as sender:
        with pytest.raises(SparseRefitError, match=rf"non-finite values .*'{NORM}'"):
            sender.send(edited(b, nan=[NORM]))
        with pytest.raises(SparseRefitError, match="generate refused"):
            worker.tokens()  # refusing to generate until a full step
        sender.send(b)  # full again after a refused step
        assert worker.tokens() == reference_b
        assert worker.tokens() == reference_b
    worker.worker.stop_zmq_sparse_refit_relay()
    worker.prepare()
    worker.back_to_a(trainer)


def test_the_finite_check_switch_off_is_honoured(
    engine: Engine, trainer: Trainer, weights: Weights
) -> None:
    """``vllm_cfg.refit_finite_check: false``: the engine workers are told, and a NaN
    refit counts as good (nothing generated under it here)."""
    off = make_worker(engine, weights, refit_finite_check=False)
    try:
        off.prepare()
        off.ipc(trainer, weights.b, nan=[NORM])
        assert off.worker.last_refit["engine_workers"]
    finally:
        engine.rpc("refit_configure", True)  # the module's engine checks again
    on = make_worker(engine, weights)
    on.prepare()
    (address,) = on.worker.refit_address()
    trainer.submit("ipc", address=address, path=str(weights.b), nan=[NORM])
    with pytest.raises(RefitError, match="non-finite"):
        on.worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT)
    assert not trainer.result().ok
    on.back_to_a(trainer)


# -- 2. dtypes ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "into"), [(NORM, NORM), (Q_PROJ, "qkv_proj")])
def test_a_manifest_declaring_int32_for_a_float32_parameter_is_refused_naming_both(
    worker: Worker, trainer: Trainer, weights: Weights, name: str, into: str
) -> None:
    state_dict = load_file(weights.b)
    assert state_dict[name].dtype == torch.float32  # the same byte size as int32
    info: dict[str, tuple[Sequence[int], object]] = {
        n: (t.shape, t.dtype) for n, t in state_dict.items()
    }
    info[name] = (state_dict[name].shape, torch.int32)
    with pytest.raises(RefitManifestError) as refused:
        worker.worker.prepare_refit_info(info)
    message = str(refused.value)
    assert f"'{name}' is declared int32" in message
    assert "float32" in message
    assert into in message
    assert worker.tokens() == worker.engine.baseline_a  # nothing changed
    worker.prepare()
    worker.back_to_a(trainer)


def test_a_sparse_step_declaring_int32_for_a_float32_parameter_is_refused(
    worker: Worker, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    b = load_file(weights.b)
    retyped = edited(b, retype={NORM: "int32"})
    refused = pytest.raises(SparseRefitError, match=rf"'{NORM}' is declared int32.*float32")
    with sparse_sender(worker, retyped, hop_s=30.0) as sender, refused:
        sender.send(retyped)
    with pytest.raises(SparseRefitError, match="generate refused"):
        worker.tokens()  # refusing to generate until a full step
    with sparse_sender(worker, b, hop_s=30.0) as sender:
        sender.send(b)
        assert worker.tokens() == reference_b
    worker.worker.stop_zmq_sparse_refit_relay()
    worker.prepare()
    worker.back_to_a(trainer)


# -- 3. a sparse step never writes under a running batch --------------------------------


def test_a_sparse_step_sent_during_a_batch_waits_for_it_then_applies(
    engine: Engine, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    long = make_worker(engine, weights, max_new_tokens=240)
    prompts = PROMPTS * 16
    before, versions = long.rows(prompts)  # on A: the reference for the batch below
    version = long.worker.weight_version
    b = load_file(weights.b)
    during: list[tuple[list[list[int]], list[set[int]]]] = []
    ended_at: list[float] = []

    def batch() -> None:
        during.append(long.rows(prompts))
        ended_at.append(time.monotonic())

    with sparse_sender(long, b, hop_s=120.0) as sender:
        runner = threading.Thread(target=batch)
        runner.start()
        time.sleep(0.5)  # the batch is running (it takes several seconds here)
        sent_at = time.monotonic()
        sender.send(b)
        applied_at = time.monotonic()
        runner.join(300)
        assert during, "the batch did not finish"
        (ended,) = ended_at
        assert sent_at < ended, "the step did not arrive during the batch: make it longer"
        assert applied_at > sent_at
        ((tokens, labels),) = during
        assert tokens == before  # every row on the old weights
        assert all(row == {version} for row in labels)
        after, labels = long.rows(prompts)
        assert all(row == {version + 1} for row in labels)
        assert [row[:12] for row in after[: len(PROMPTS)]] == reference_b
    long.worker.stop_zmq_sparse_refit_relay()
    long.prepare()
    long.back_to_a(trainer)
    assert versions


# -- 7. a timeout with no trainer at all --------------------------------------------------


def test_a_refit_timeout_with_no_trainer_connected_says_so_then_a_good_refit(
    worker: Worker, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    worker.prepare()
    (address,) = worker.worker.refit_address()
    with pytest.raises(RefitTimeoutError) as timed:
        worker.worker.update_weights_via_ipc_zmq(timeout_s=2.0)
    assert f"no trainer connected to {address} within 2s" in str(timed.value)
    assert "sent nothing" not in str(timed.value)
    worker.ipc(trainer, weights.b)
    assert worker.tokens() == reference_b
    worker.back_to_a(trainer)
