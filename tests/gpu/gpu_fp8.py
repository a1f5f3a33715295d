"""fp8 rollouts on one GPU (importable as ``gpu.gpu_fp8``, also in spawned children): the
fp8 engine of ``test_gpu_fp8.py``, in a child process (one sleep-mode engine per process).

The child starts the worker with ``vllm_cfg.precision: fp8`` (NeMo-RL's block-fp8 config)
on checkpoint A: genworker quantizes the bf16 checkpoint into vLLM's fp8 layers once vLLM
has started. It then takes checkpoint B and A again by CUDA IPC from a trainer process it
spawns (``gpu.gpu_fixtures.ipc_trainer_main``), each quantized on its way in, and reports
its greedy tokens and the teacher-forced logprobs of the sequences it is given after each
step, for the parent to hold against the bf16 session worker's.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from gpu.gpu_fixtures import (
    REFIT_TIMEOUT_S,
    Trainer,
    engine_tensors,
    gpu_config,
    greedy,
    ipc_trainer_main,
    manifest,
)
from helpers import forced_logprobs

from genworker.shell.worker import VllmGenerationWorker

__all__ = ["fp8_engine_main"]


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """The tensors whose bytes differ, with their largest difference as numbers."""
    out = {}
    for name, old in before.items():
        new = after[name]
        if not torch.equal(old.reshape(-1).view(torch.uint8), new.reshape(-1).view(torch.uint8)):
            out[name] = float((old.float() - new.float()).abs().max())
    return out


def fp8_engine_main(
    *, a: str, b: str, pad: int, on_a: list[list[int]], on_b: list[list[int]]
) -> dict[str, object]:
    """The fp8 worker on checkpoint A, then refit to B and back to A (see the module
    docstring): each step's greedy tokens and the forced logprobs of ``on_a`` / ``on_b``."""
    config = gpu_config(Path(a), pad)
    config["vllm_cfg"] = {**config["vllm_cfg"], "precision": "fp8"}  # type: ignore[dict-item]
    worker = VllmGenerationWorker(config)
    trainer = None
    try:
        start, forced_a = greedy(worker, pad), forced_logprobs(worker.llm, on_a)
        out: dict[str, object] = {"start": start, "forced_a": forced_a}
        started = engine_tensors(worker, buffers=True)
        (address,) = worker.refit_address()
        trainer = Trainer(ipc_trainer_main, {"address": str(address)})
        forced_b: list[list[float]] = []
        for step, checkpoint in (("b", b), ("a_again", a)):
            worker.prepare_refit_info(manifest(Path(checkpoint)))
            trainer.send("send", (checkpoint, False))
            trainer.expect("sending")
            assert worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT_S)
            trainer.expect("sent")
            out[step] = greedy(worker, pad)
            if step == "b":
                forced_b = out["forced_b"] = forced_logprobs(worker.llm, on_b)
        out["changed"] = _changed(started, engine_tensors(worker, buffers=True))
        out["finite"] = all(math.isfinite(x) for row in forced_a + forced_b for x in row)
        return out
    finally:
        if trainer is not None:
            trainer.stop()
        worker.shutdown()
