"""Receiver processes for the sparse-refit tests (importable as ``sparse_helpers``).

Each process runs one :class:`SparseReceiver` over a :class:`CountingTarget`, reports
its address, and on command dumps what its target holds (every tensor's bits) with its
counters. A process told to die at a step calls ``os._exit`` from the target's first
``apply`` of that step: killed mid-step, after forwarding and before answering.
"""

from __future__ import annotations

import os
from multiprocessing.queues import Queue

import torch

from genworker.shell.sparse import DictTarget, SparseReceiver


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
