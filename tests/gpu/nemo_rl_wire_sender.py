"""A stand-in for NeMo-RL's trainer on CUDA: it packs tensors into one CUDA buffer and sends
``pickle.dumps((reduce_tensor(buffer)[1:], names, used_bytes))`` as its
``stream_weights_via_ipc_zmq_impl`` does (over a queue here; the ZMQ transport is not part
of this test). It keeps the buffer alive until told to stop."""

from __future__ import annotations

import pickle
from typing import Any

import torch

ALIGN = 512
TENSORS = {"a.weight": (64, 32), "b.bias": (48,)}


def expected_tensors(device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        name: torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)
        for name, shape in TENSORS.items()
    }


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def sender_main(*, commands: Any, replies: Any) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    tensors = expected_tensors("cuda:0")
    total = sum(_aligned(t.nbytes) for t in tensors.values())
    buffer = torch.empty(total, dtype=torch.uint8, device="cuda:0")
    used = 0
    for t in tensors.values():
        buffer[used : used + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
        used += _aligned(t.nbytes)
    torch.cuda.current_stream().synchronize()
    handle = reduce_tensor(buffer)[1:]  # type: ignore[no-untyped-call]
    replies.put(("message", pickle.dumps((handle, list(tensors), used), protocol=4)))
    while True:
        command, _ = commands.get()
        if command == "stop":
            return
