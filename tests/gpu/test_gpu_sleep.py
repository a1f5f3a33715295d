"""Sleep and wake on CUDA: the memory each level frees and regains, and what survives."""

from __future__ import annotations

import pytest
import vllm.device_allocator.cumem as cumem
from gpu.gpu_fixtures import (
    GPU_MARKS,
    PROMPTS,
    GpuSession,
    batch,
    free_bytes,
    greedy,
    refit_over_ipc,
)

from genworker.shell import cumem_wake
from genworker.shell.errors import EngineStateError

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS

# The KV cache and the weights are nearly all of an engine's memory; the rest (CUDA
# context aside, which is excluded) is the caching allocator's activations and workspaces.
FREED_FRACTION = 0.8


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def test_level1_frees_the_engine_memory_and_wake_regains_it_keeping_the_weights(
    gpu_session: GpuSession,
) -> None:
    worker, pad = gpu_session.worker, gpu_session.checkpoints.pad
    # the engine's workers (in this process) wake through genworker's create_and_map
    assert cumem.create_and_map is cumem_wake.create_and_map
    before_tokens = greedy(worker, pad)
    awake = free_bytes()
    worker.sleep(1)
    asleep = free_bytes()
    worker.wake_up()
    woken = free_bytes()
    freed, regained = asleep - awake, asleep - woken
    assert freed >= FREED_FRACTION * gpu_session.engine_bytes, (
        f"level 1 freed {_gib(freed)} of the engine's {_gib(gpu_session.engine_bytes)}"
    )
    assert regained >= 0.9 * freed, f"wake regained {_gib(regained)} of {_gib(freed)}"
    assert greedy(worker, pad) == before_tokens


def test_level2_frees_the_engine_memory_and_a_refit_restores_the_weights(
    gpu_session: GpuSession,
) -> None:
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    awake = free_bytes()
    worker.sleep(2)
    asleep = free_bytes()
    worker.wake_up(["weights"])
    with pytest.raises(EngineStateError):
        worker.generate(batch(PROMPTS, ckpt.pad), greedy=True)
    refit_over_ipc(gpu_session, ckpt.a)
    worker.wake_up(["kv_cache"])
    woken = free_bytes()
    freed, regained = asleep - awake, asleep - woken
    assert freed >= FREED_FRACTION * gpu_session.engine_bytes, (
        f"level 2 freed {_gib(freed)} of the engine's {_gib(gpu_session.engine_bytes)}"
    )
    assert regained >= 0.9 * freed, f"wake regained {_gib(regained)} of {_gib(freed)}"
    assert greedy(worker, ckpt.pad) == gpu_session.baseline_a


def test_generating_while_asleep_is_refused_and_leaves_the_engine_usable(
    gpu_session: GpuSession,
) -> None:
    worker, pad = gpu_session.worker, gpu_session.checkpoints.pad
    worker.sleep(1)
    with pytest.raises(EngineStateError):
        worker.generate(batch(PROMPTS, pad), greedy=True)
    worker.wake_up()
    assert greedy(worker, pad) == gpu_session.baseline_a
