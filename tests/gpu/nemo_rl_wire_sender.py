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


def nemo_rl_trainer_main(*, address: str, commands: Any, replies: Any) -> None:
    """NeMo-RL's trainer on this GPU (``tests/nemo_rl_trainer.py`` on CUDA): binds its REQ
    socket at ``address`` and, per ``("send", (checkpoint, evil))``, streams the checkpoint
    as ``stream_weights_via_ipc_zmq_impl`` does (CUDA staging buffers, their
    ``reduce_tensor`` handles), ``evil`` first sending a pickle that calls ``os.system``."""
    import traceback
    from pathlib import Path

    from gpu.gpu_fixtures import REFIT_TIMEOUT_S, load_checkpoint
    from nemo_rl_trainer import _Trainer

    try:
        trainer = _Trainer()
        sock = trainer._socket(address, REFIT_TIMEOUT_S)
        while True:
            command, arg = commands.get()
            if command == "stop":
                break
            path, evil = arg
            tensors = load_checkpoint(Path(path), "cpu")
            replies.put(("sent", trainer.ipc(sock, tensors, 8 << 20, evil, device="cuda")))
        trainer.close()
    except BaseException:  # noqa: BLE001 - the engine side raises it with this traceback
        replies.put(("error", traceback.format_exc()))


def nemo_rl_collective_trainer_main(*, checkpoint: str, port: int) -> int:
    """NeMo-RL's trainer rank 0 on its pinned GPU, as ``StatelessProcessGroup`` (peer
    ``"nemo"``) and ``packed_broadcast_producer`` do it, NCCL through vLLM's library (NeMo-RL
    uses nccl4py): a ``TCPStore`` master, the raw unique id under ``nccl_unique_id``, the
    ``ones(1)`` warm-up, then one broadcast per packed group; the bytes it sent."""
    import ctypes
    import datetime as dt
    import os
    from pathlib import Path

    from gpu.gpu_fixtures import CHILD_TIMEOUT_S, load_checkpoint
    from torch._C._distributed_c10d import TCPStore
    from vllm.distributed.device_communicators.pynccl_wrapper import (
        NCCLLibrary,
        buffer_type,
        cudaStream_t,
        ncclDataTypeEnum,
    )

    store = TCPStore("127.0.0.1", port, 2, True, timeout=dt.timedelta(seconds=CHILD_TIMEOUT_S))
    lib = NCCLLibrary()
    uid = lib.ncclGetUniqueId()
    store.set("nccl_unique_id", ctypes.string_at(ctypes.addressof(uid), 128))  # type: ignore[arg-type]
    with torch.cuda.device(0):
        comm = lib.ncclCommInitRank(2, uid, 0)

    def broadcast(t: torch.Tensor) -> None:
        stream = torch.cuda.current_stream()
        ptr = buffer_type(t.data_ptr())
        kind = ncclDataTypeEnum.from_torch(t.dtype)
        lib.ncclBroadcast(ptr, ptr, t.numel(), kind, 0, comm, cudaStream_t(stream.cuda_stream))
        stream.synchronize()

    broadcast(torch.ones(1, device="cuda:0"))
    ratio = float(os.environ.get("NRL_REFIT_BUFFER_MEMORY_RATIO", "0.02"))
    total = torch.cuda.get_device_properties(0).total_memory
    target = min(int(total * ratio), 5 << 30)
    sent, group, size = 0, list[torch.Tensor](), 0
    for tensor in load_checkpoint(Path(checkpoint), "cuda:0").values():
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        group.append(flat)
        size += flat.numel()
        if size > target:
            broadcast(torch.cat(group))
            sent, group, size = sent + size, [], 0
    if group:
        broadcast(torch.cat(group))
        sent += size
    lib.ncclCommDestroy(comm)
    return sent


def nemo_rl_collective_engine_main(
    *, config: dict[str, object], checkpoint: str, pad: int, port: int
) -> dict[str, list[list[int]]]:
    """The NeMo-RL-facing worker on its pinned GPU (on checkpoint A): greedy tokens, then
    ``checkpoint`` from NeMo-RL's trainer over its packed broadcasts, greedy tokens again."""
    from pathlib import Path

    from gpu.gpu_fixtures import PROMPTS, REFIT_TIMEOUT_S, batch, generated, manifest

    from genworker.shell.nemo_rl import NemoRlGenerationWorker

    worker = NemoRlGenerationWorker(config, [0])
    data = batch(PROMPTS, pad)
    try:
        before = generated(worker.generate(data, greedy=True), data)
        assert worker.prepare_refit_info(manifest(Path(checkpoint))) is None
        worker.init_collective(0, "127.0.0.1", port, 2, 1)  # engine rank 1, after the trainer
        ok = worker.update_weights_from_collective(refit_timeout_s=REFIT_TIMEOUT_S)
        assert ok is True, worker.last_refit_error
        return {"before": before, "after": generated(worker.generate(data, greedy=True), data)}
    finally:
        worker.shutdown()
