"""The reshard refit: over NCCL point to point (two GPUs: a TP=1 trainer on GPU 0, an
engine on GPU 1), and on ONE GPU from a two-rank (TP=2) trainer into the session's TP=1
engine. The engine then generates as a fresh engine on the weights sent, and counted every
byte of them once.

On one GPU the group is gloo over host memory (``init_nccl_reshard_comm_group(...,
device="cpu")``, ``ReshardSender(device="cpu")``): NCCL refuses two ranks of one
communicator on one device ("Duplicate GPU detected", ``ncclInvalidUsage``), and the
trainer ranks and the engine are three. The trainer ranks hold their shards on the GPU;
the sender copies each slice to the host, the engine receives into host scratch and copies
it into its CUDA parameters (or the loader's full tensors).
"""

from __future__ import annotations

from pathlib import Path

import torch
from gpu.gpu_fixtures import (
    GPU_MARKS,
    REFIT_TIMEOUT_S,
    Checkpoints,
    Child,
    GpuSession,
    free_port,
    gpu_config,
    greedy,
    load_checkpoint,
    refit_over_ipc,
    requires_two_gpus,
)
from gpu.gpu_reshard import reshard_engine_main, reshard_trainer_main
from reshard_helpers import ReshardTrainer

from genworker.core.engine_calls import RpcCall
from genworker.shell.refit.reshard import bytes_of, shards_of

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS


def test_a_reshard_refit_from_two_trainer_ranks_on_the_engines_gpu_equals_a_fresh_engine(
    gpu_session: GpuSession, checkpoints: Checkpoints, reference_b: list[list[int]]
) -> None:
    worker = gpu_session.worker
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # the trainer ranks' shards
    b = str(checkpoints.b / "model.safetensors")
    whole = sum(t.nbytes for t in load_checkpoint(checkpoints.b, "cpu").values())
    trainers = [ReshardTrainer(r, 2) for r in range(2)]
    try:
        for t in trainers:
            t.ready()
        port = free_port()
        for t in trainers:
            t.submit("join", path=b, port=port, world_size=3, device=device)
        worker.init_nccl_reshard_comm_group(
            0, ["127.0.0.1"], [port], 1, 2, 3, timeout_s=REFIT_TIMEOUT_S, device="cpu"
        )
        joined = [t.result() for t in trainers]
        assert all(o.ok for o in joined), joined
        summaries = worker.prepare_nccl_reshard_refit_info(joined[0].detail["info"])  # type: ignore[arg-type]
        assert bytes_of(shards_of(summaries), 0) == whole  # TP=1: every byte, once
        for t in trainers:
            t.submit("plan", summaries=summaries)
        assert all(t.result().ok for t in trainers)
        for t in trainers:
            t.submit("send", path=b)
        assert worker.nccl_reshard_refit(REFIT_TIMEOUT_S) is True  # the trainers run apart
        sent = [t.result() for t in trainers]
        assert all(o.ok for o in sent), sent
        reports = worker.last_refit["engine_workers"]
        assert isinstance(reports, list)
        assert [r["received_bytes"] for r in reports] == [whole]
        nbytes = [int(o.detail["nbytes"]) for o in sent]  # type: ignore[call-overload]
        assert sum(nbytes) == whole
        assert all(0 < n < whole for n in nbytes)  # each rank sent its own half
        assert greedy(worker, checkpoints.pad) == reference_b
    finally:
        worker.engine.collective_rpc(
            RpcCall("close_nccl_reshard_comm_group")
        )  # the session lives on
        for t in trainers:
            t.stop()
        refit_over_ipc(gpu_session, checkpoints.a)
        assert greedy(worker, checkpoints.pad) == gpu_session.baseline_a


@requires_two_gpus
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
