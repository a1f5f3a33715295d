"""Refit on CUDA: from a trainer process over CUDA IPC, after a level-2 sleep, and over NCCL.

Every refit is checked the strong way: greedy tokens afterwards equal those of a fresh
engine started on the same saved weights (see gpu_fixtures).
"""

from __future__ import annotations

import pytest
from gpu.gpu_fixtures import (
    GPU_MARKS,
    Checkpoints,
    Child,
    GpuSession,
    collective_engine_main,
    collective_trainer_main,
    free_port,
    gpu_config,
    greedy,
    load_checkpoint,
    refit_over_ipc,
    requires_two_gpus,
)

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS


def test_the_two_checkpoints_generate_differently(
    gpu_session: GpuSession, reference_b: list[list[int]]
) -> None:
    # Otherwise a refit that changed nothing would pass the tests below.
    assert gpu_session.baseline_a != reference_b


def test_ipc_refit_from_a_trainer_process_matches_a_fresh_engine(
    gpu_session: GpuSession, reference_b: list[list[int]]
) -> None:
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    refit_over_ipc(gpu_session, ckpt.b)
    assert greedy(worker, ckpt.pad) == reference_b
    refit_over_ipc(gpu_session, ckpt.a)
    assert greedy(worker, ckpt.pad) == gpu_session.baseline_a


@pytest.mark.parametrize("arena", [False, True], ids=["per-tensor", "arena"])
def test_ipc_refit_in_the_engine_layout_goes_direct_and_matches_a_fresh_engine(
    gpu_session: GpuSession, reference_b: list[list[int]], arena: bool
) -> None:
    """Engine-layout tensors (fused qkv / gate_up, as a fresh engine on B holds them) take
    the direct path: sender-handles, the sleep-mode engine copying from the trainer's
    memory, from one allocation per tensor or from one RefitArena."""
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    mode = refit_over_ipc(gpu_session, ckpt.b_engine, arena=arena)
    assert mode == "sender-handles"
    assert greedy(worker, ckpt.pad) == reference_b
    refit_over_ipc(gpu_session, ckpt.a)
    assert greedy(worker, ckpt.pad) == gpu_session.baseline_a


def test_ipc_refit_from_a_kept_arena_keeps_one_mapping_and_matches_a_fresh_engine(
    gpu_session: GpuSession, reference_b: list[list[int]]
) -> None:
    """``keep_mapped``: the sleep-mode engine keeps the trainer's arena mapped between
    refits (one storage) until released, or until a refit sends something else."""
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    for _ in range(2):
        mode = refit_over_ipc(gpu_session, ckpt.b_engine, arena=True, keep_mapped=True)
        assert mode == "sender-handles"
        assert greedy(worker, ckpt.pad) == reference_b
    assert worker.release_refit_buffers() == [1]
    assert worker.release_refit_buffers() == [0]
    worker.sleep(2)  # the kept mapping is the trainer's memory: the engine's sleep keeps it
    worker.wake_up(["weights"])
    refit_over_ipc(gpu_session, ckpt.b_engine, arena=True, keep_mapped=True)
    worker.wake_up(["kv_cache"])
    assert greedy(worker, ckpt.pad) == reference_b
    refit_over_ipc(gpu_session, ckpt.a)  # checkpoint layout, in buckets: lets the arena go
    assert worker.release_refit_buffers() == [0]
    assert greedy(worker, ckpt.pad) == gpu_session.baseline_a


def test_level2_sleep_wake_weights_refit_wake_kv_cache_matches_a_fresh_engine(
    gpu_session: GpuSession, reference_b: list[list[int]]
) -> None:
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    worker.sleep(2)
    worker.wake_up(["weights"])
    refit_over_ipc(gpu_session, ckpt.b)
    worker.wake_up(["kv_cache"])
    assert greedy(worker, ckpt.pad) == reference_b
    refit_over_ipc(gpu_session, ckpt.a)
    assert greedy(worker, ckpt.pad) == gpu_session.baseline_a


@requires_two_gpus
def test_nccl_refit_from_a_trainer_on_gpu0_to_an_engine_on_gpu1(
    gpu_session: GpuSession, checkpoints: Checkpoints, reference_b: list[list[int]]
) -> None:
    port = free_port()
    config = gpu_config(checkpoints.a, checkpoints.pad)
    engine = Child(collective_engine_main, gpu=1, config=config, checkpoints=checkpoints, port=port)
    trainer = Child(collective_trainer_main, checkpoint=str(checkpoints.b), port=port, gpu=0)
    sent = trainer.result()
    got = engine.result()
    assert isinstance(got, dict)
    expected_bytes = sum(
        t.numel() * t.element_size() for t in load_checkpoint(checkpoints.b, "cpu").values()
    )
    assert sent == expected_bytes
    # A fresh engine on A agrees across GPUs; after the broadcast it generates as one on B.
    assert got["before"] == gpu_session.baseline_a
    assert got["after"] == reference_b


@pytest.mark.parametrize("tags", [["weights"], ["kv_cache"], ["weights", "kv_cache"]])
def test_waking_a_resident_tag_is_a_no_op_that_keeps_the_weights(
    gpu_session: GpuSession, tags: list[str]
) -> None:
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    worker.wake_up(tags)
    assert greedy(worker, ckpt.pad) == gpu_session.baseline_a
