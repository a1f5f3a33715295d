"""Issue 44 on CUDA (vLLM 0.25): no silent corruption from a refit, as
``tests/shell/test_refit_safety_engine.py`` checks it on the CPU engine, here on the
session worker (bfloat16, checkpoints A and B of ``gpu.gpu_fixtures``) with a trainer
process sending over CUDA IPC.

- A refit carrying a NaN and an inf is refused naming the tensor; the worker resets its
  prefix cache and zeroes its KV cache, refuses to generate, and the next good refit
  serves the greedy tokens of a fresh engine on the same weights, batch after batch.
- A manifest that declares int32 for a bfloat16 parameter is refused naming the tensor,
  both dtypes and the fused parameter it loads into (on CPU the parameter is float32, of
  int32's byte size; here the dtype check refuses before any size check would).

Each test leaves the session worker holding A (the fixture ``back_to_a``), checked
against its greedy tokens when fresh.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gpu.gpu_fixtures import (
    GPU_MARKS,
    REFIT_TIMEOUT_S,
    GpuSession,
    greedy,
    load_checkpoint,
    manifest,
    refit_over_ipc,
    session_engine,
)
from refit_helpers import Engine, edited
from shell.test_refit_safety_engine import NORM, Q_PROJ, engine_rpc_zeroes_kv

from genworker.shell.errors import EngineStateError, RefitError, RefitManifestError
from genworker.shell.refit.engine import nonfinite

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS


@pytest.fixture
def back_to_a(gpu_session: GpuSession) -> Iterator[None]:
    """After the test, however it ended: checkpoint A over IPC, and A's fresh tokens."""
    yield
    refit_over_ipc(gpu_session, gpu_session.checkpoints.a)
    assert greedy(gpu_session.worker, gpu_session.checkpoints.pad) == gpu_session.baseline_a


@pytest.mark.usefixtures("back_to_a")
def test_a_nan_ipc_refit_is_refused_then_a_good_refit_serves_a_fresh_engines_tokens(
    gpu_session: GpuSession, reference_b: list[list[int]], tmp_path: Path
) -> None:
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    nan_b = tmp_path / "b-nan.pt"
    torch.save(edited(load_checkpoint(ckpt.b, "cpu"), nan=[NORM]), nan_b)
    worker.prepare_refit_info(manifest(nan_b))
    resets = worker.cache_resets["prefix"]
    trainer = gpu_session.ipc_trainer()
    trainer.send("send", (str(nan_b), False))
    trainer.expect("sending")
    with pytest.raises(RefitError, match=rf"non-finite values .*'{NORM}'") as refused:
        worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT_S)
    with pytest.raises(RuntimeError, match="the trainer process failed"):
        trainer.expect("sent")  # the sender is told, and its process ends
    trainer.stop()  # the next refit starts another
    assert worker.cache_resets["prefix"] == resets + 1  # reset after the refusal
    assert not getattr(refused.value, "__notes__", None)  # and the KV cache zeroed
    assert engine_rpc_zeroes_kv(Engine(session_engine(gpu_session).llm, gpu_session.baseline_a))
    with pytest.raises(EngineStateError, match="refit"):
        greedy(worker, ckpt.pad)  # never serves the half-written weights
    refit_over_ipc(gpu_session, ckpt.b)
    for _ in range(3):  # every batch after the good refit, not only the first
        assert greedy(worker, ckpt.pad) == reference_b


@pytest.mark.usefixtures("back_to_a")
@pytest.mark.parametrize(("name", "into"), [(NORM, NORM), (Q_PROJ, "qkv_proj")])
def test_a_manifest_declaring_int32_for_a_bfloat16_parameter_is_refused_naming_both(
    gpu_session: GpuSession, name: str, into: str
) -> None:
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    info = manifest(ckpt.b)
    shape, dtype = info[name]
    assert dtype == torch.bfloat16
    info[name] = (shape, torch.int32)
    with pytest.raises(RefitManifestError) as refused:
        worker.prepare_refit_info(info)
    message = str(refused.value)
    assert f"'{name}' is declared int32" in message
    assert "bfloat16" in message
    assert into in message
    assert greedy(worker, ckpt.pad) == gpu_session.baseline_a  # nothing changed


def test_the_finite_check_takes_a_refit_held_on_the_gpu_and_on_the_host_at_once() -> None:
    """A reshard refit over gloo checks the engine's own tensors (on the GPU) and the
    group's host scratch together: the check groups them by device (run AG's failure was
    ``torch.stack`` over norms on both) and names the bad one on either."""
    gpu, host = torch.ones(4, device="cuda"), torch.ones(4)
    assert nonfinite([("gpu", gpu), ("host", host)]) == []
    bad_host = torch.tensor([1.0, float("nan")])
    bad_gpu = torch.tensor([float("inf")], device="cuda").bfloat16()
    assert nonfinite([("gpu", gpu), ("host", bad_host)]) == ["host"]
    assert sorted(nonfinite([("g", bad_gpu), ("h", bad_host), ("ok", host)])) == ["g", "h"]
