"""Refit on CUDA: from a trainer process over CUDA IPC, after a level-2 sleep, and over NCCL.

Every refit is checked the strong way: greedy tokens afterwards equal those of a fresh
engine started on the same saved weights (see gpu_fixtures).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from genworker.shell.worker import VllmGenerationWorker

pytest_plugins = ["gpu.gpu_fixtures"]


def engine_report(worker: VllmGenerationWorker) -> dict[str, int]:
    """The last refit's report of the (one) engine worker."""
    reports = worker.last_refit["engine_workers"]
    assert isinstance(reports, list)
    (report,) = reports
    assert isinstance(report, dict)
    return report


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


@pytest.mark.parametrize("one", [False, True], ids=["separate-allocations", "one-allocation"])
def test_ipc_refit_in_the_engine_layout_keeps_the_trainers_storages_and_matches_a_fresh_engine(
    gpu_session: GpuSession, reference_b: list[list[int]], one: bool
) -> None:
    """Engine-layout tensors (fused qkv / gate_up, as a fresh engine on B holds them) go
    straight into the sleep-mode engine's parameters: packed on the first refit, then by
    the handles of the trainer's own storages, which the engine keeps mapped until a refit
    sends others or the trainer asks for its memory back."""
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    first = refit_over_ipc(gpu_session, ckpt.b_engine, one_allocation=one)
    assert first["handles"] == 0  # the sender had not seen these storages
    assert greedy(worker, ckpt.pad) == reference_b
    again = refit_over_ipc(gpu_session, ckpt.b_engine, one_allocation=one)
    assert again["handles"] > 0
    assert greedy(worker, ckpt.pad) == reference_b
    assert engine_report(worker)["mapped"] > 0  # the trainer's storages, mapped once ...
    refit_over_ipc(gpu_session, ckpt.b_engine, one_allocation=one)
    assert engine_report(worker)["mapped"] == 0  # ... and kept
    worker.sleep(2)  # the kept mappings are the trainer's memory: the engine's sleep keeps them
    worker.wake_up(["weights"])
    refit_over_ipc(gpu_session, ckpt.b_engine, one_allocation=one)
    worker.wake_up(["kv_cache"])
    assert greedy(worker, ckpt.pad) == reference_b
    (released,) = worker.release_refit_buffers()
    assert released > 0  # type: ignore[operator]
    assert worker.release_refit_buffers() == [0]
    refit_over_ipc(gpu_session, ckpt.a)
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
