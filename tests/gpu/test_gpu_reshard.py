"""The reshard refit over NCCL point to point (two GPUs): the engine then generates as a
fresh engine on the weights sent, and counted every byte of them once."""

from __future__ import annotations

from pathlib import Path

from gpu.gpu_fixtures import (
    GPU_MARKS,
    Checkpoints,
    Child,
    GpuSession,
    free_port,
    gpu_config,
    load_checkpoint,
    requires_two_gpus,
)
from gpu.gpu_reshard import reshard_engine_main, reshard_trainer_main

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = [*GPU_MARKS, requires_two_gpus]


def test_a_reshard_refit_over_nccl_equals_a_fresh_engine_on_the_weights(
    gpu_session: GpuSession, checkpoints: Checkpoints, reference_b: list[list[int]], tmp_path: Path
) -> None:
    port, answers = free_port(), str(tmp_path / "answers.json")
    config = gpu_config(checkpoints.a, checkpoints.pad)
    engine = Child(
        reshard_engine_main,
        gpu=1,
        config=config,
        checkpoints=checkpoints,
        port=port,
        answers=answers,
    )
    trainer = Child(
        reshard_trainer_main, gpu=0, checkpoint=str(checkpoints.b), port=port, answers=answers
    )
    sent = trainer.result()
    got = engine.result()
    assert isinstance(got, dict)
    whole = sum(
        t.numel() * t.element_size() for t in load_checkpoint(checkpoints.b, "cpu").values()
    )
    assert sent == whole
    assert got["report"]["received_bytes"] == whole
    assert got["report"]["direct"] > 0  # on CUDA the parameters receive in place
    assert got["before"] == gpu_session.baseline_a
    assert got["after"] == reference_b
