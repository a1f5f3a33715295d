"""The reshard refit across two GPUs (importable as ``gpu.gpu_reshard``, also in spawned
children): a TP=1 trainer on GPU 0 and a TP=1 engine on GPU 1 in one NCCL reshard group;
the engine's answers to ``prepare_nccl_reshard_refit_info`` reach the trainer through a
file (the two are separate children)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from gpu.gpu_fixtures import (
    CHILD_TIMEOUT_S,
    REFIT_TIMEOUT_S,
    Checkpoints,
    greedy,
    load_checkpoint,
)

from genworker.core.refit_plan import dtype_name
from genworker.core.reshard import TrainerLayout, megatron_layout


def tp1_layouts(tensors: dict[str, torch.Tensor]) -> list[TrainerLayout]:
    """Trainer rank 0 holds every tensor whole."""
    return [
        megatron_layout(n, tuple(t.shape), dtype_name(t.dtype), None, [[0]]).unwrap()
        for n, t in tensors.items()
    ]


def reshard_engine_main(
    *, config: dict[str, object], checkpoints: Checkpoints, port: int, answers: str
) -> dict[str, object]:
    """The engine (GPU 1, on checkpoint A): greedy tokens, then B by the reshard refit,
    greedy tokens again, and its report."""
    from genworker.shell.refit.reshard import refit_info
    from genworker.shell.worker import VllmGenerationWorker

    worker = VllmGenerationWorker(config)
    try:
        before = greedy(worker, checkpoints.pad)
        worker.init_nccl_reshard_comm_group(
            0, ["127.0.0.1"], [port], 1, 1, 2, timeout_s=REFIT_TIMEOUT_S
        )
        layouts = tp1_layouts(load_checkpoint(checkpoints.b, "cpu"))
        summaries = worker.prepare_nccl_reshard_refit_info(refit_info(layouts))
        tmp = Path(answers + ".tmp")
        tmp.write_text(json.dumps(summaries))
        tmp.rename(answers)
        assert worker.nccl_reshard_refit(REFIT_TIMEOUT_S)
        reports = worker.last_refit["engine_workers"]
        assert isinstance(reports, list)
        (report,) = reports
        return {"before": before, "after": greedy(worker, checkpoints.pad), "report": report}
    finally:
        worker.shutdown()


def reshard_trainer_main(*, checkpoint: str, port: int, answers: str) -> int:
    """The trainer (GPU 0): rank 0 of the reshard group; sends ``checkpoint`` once, point
    to point; the bytes it sent."""
    from genworker.shell.refit.reshard import ReshardSender, shards_of

    tensors = load_checkpoint(Path(checkpoint), "cuda:0")
    layouts = tp1_layouts(tensors)
    with ReshardSender(
        "127.0.0.1",
        port,
        2,
        rank=0,
        train_world_size=1,
        layouts=layouts,
        device="cuda:0",
        timeout_s=CHILD_TIMEOUT_S,
    ) as sender:
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not Path(answers).exists():
            assert time.monotonic() < deadline, "the engine never answered"
            time.sleep(0.05)
        sender.plan(shards_of(json.loads(Path(answers).read_text())))
        return sender.send(tensors).nbytes
