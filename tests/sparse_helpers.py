"""Receiver processes for the sparse-refit tests (importable as ``sparse_helpers``).

Each process runs one :class:`SparseReceiver` over a :class:`CountingTarget`, reports
its address, and on command dumps what its target holds (every tensor's bits) with its
counters. A process told to die at a step calls ``os._exit`` from the target's first
``apply`` of that step: killed mid-step, after forwarding and before answering.
"""

from __future__ import annotations

import os
from multiprocessing.queues import Queue
from pathlib import Path

import torch

from genworker.shell.refit.sparse import DictTarget, SparseReceiver


class CountingTarget(DictTarget):
    """A dict of tensors that counts the applies of each name (and can die on one)."""

    def __init__(self, tensors_per_step: int, die_at_step: int | None = None) -> None:
        super().__init__()
        self.applies: dict[str, int] = {}
        self._calls = 0
        self._per_step = tensors_per_step
        self._die_at = die_at_step

    def apply(self, name: str, tensor: torch.Tensor) -> None:
        self._calls += 1
        if self._die_at is not None and self._calls > (self._die_at - 1) * self._per_step:
            os._exit(17)
        super().apply(name, tensor)
        self.applies[name] = self.applies.get(name, 0) + 1


def run_receiver(
    results: Queue[object],
    commands: Queue[object],
    tensors_per_step: int,
    die_at_step: int | None = None,
) -> None:
    torch.set_num_threads(1)
    target = CountingTarget(tensors_per_step, die_at_step)
    receiver = SparseReceiver(target).start()
    results.put(("address", receiver.address))
    try:
        while True:
            command = commands.get()
            if command == "dump":
                bits = {
                    n: t.view(torch.uint8).clone()
                    if t.dim()
                    else t.reshape(1).view(torch.uint8).clone()
                    for n, t in target.tensors.items()
                }
                results.put(("dump", bits, dict(target.applies), dict(receiver.frames_received)))
            else:
                return
    finally:
        receiver.close()


# -- a generation worker over a real CPU engine, with its relay receiver ---------------

WORKER_CONFIG = {
    "model_name": "tiny", "max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0,
    "top_k": None, "stop_token_ids": None, "stop_strings": None, "_pad_token_id": 2,
    "vllm_cfg": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                 "gpu_memory_utilization": 0.05, "max_model_len": 256,
                 "precision": "float32"},
}  # fmt: skip
PROMPTS = [[1, 5, 9, 33, 70], [1, 100, 200], [2, 17, 300, 41]]


def _direct_params(worker: object) -> dict[str, torch.Tensor]:
    """On the engine worker: the parameters a refit writes straight into, as they are."""
    from genworker.shell.extension import door_of

    layout = worker.engine_param_layout()  # type: ignore[attr-defined]
    params = door_of(worker).engine.params()
    return {n: params[n].detach().clone() for n in layout}


def run_engine_worker(
    model_dir: str, results: Queue[object], commands: Queue[object], relay: bool = True
) -> None:
    """A ``VllmGenerationWorker`` over a CPU engine on ``model_dir``; answers commands
    ``(name, *args)``: ``tokens`` (greedy, through ``generate``; an error as its class
    name and message), ``version``, ``configure``, ``status``, ``checksums``, ``direct``,
    ``stop``."""
    from engine_fixtures import cpu_engine_kwargs
    from helpers import right_padded

    from genworker.shell.vllm_engine import VllmEngine
    from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

    engine = VllmEngine.start(cpu_engine_kwargs(Path(model_dir)))
    worker = VllmGenerationWorker(WORKER_CONFIG, engine_factory=ExistingEngine(engine))
    urls = worker.start_zmq_sparse_refit_relay() if relay else []
    results.put(("ready", urls, worker.report_refit_server_base_url()))
    try:
        while True:
            command = commands.get()
            assert isinstance(command, tuple)
            name, args = command[0], command[1:]
            try:
                if name == "tokens":
                    data = right_padded(PROMPTS, pad=2)
                    out = worker.generate(data, greedy=True)
                    starts, ends = data["input_lengths"], out["unpadded_sequence_lengths"]
                    got: object = [
                        out["output_ids"][i, starts[i] : ends[i]].tolist()
                        for i in range(len(PROMPTS))
                    ]
                elif name == "version":
                    got = worker.weight_version
                elif name == "configure":
                    worker.configure_zmq_sparse_refit_relay(*args)
                    got = None
                elif name in ("status", "checksums", "direct"):
                    with worker._lock.hold(name):  # as the worker's own calls do
                        if name == "direct":
                            got = worker.llm.collective_rpc(_direct_params)  # type: ignore[attr-defined]
                        else:
                            got = worker._rpc(f"sparse_relay_{name}")
                else:
                    worker.stop_zmq_sparse_refit_relay()
                    return
            except Exception as e:  # noqa: BLE001 - the test asserts on it
                results.put(("error", type(e).__name__, str(e)))
            else:
                results.put(("ok", got))
    finally:
        worker.shutdown()
