"""A stand-in for NeMo-RL's trainer on CPU, and the test configuration of its receiver.

The trainer process speaks NeMo-RL's own wire (commit 7ea279ab), re-implemented here
without NeMo-RL installed:

* IPC: ``stream_weights_via_ipc_zmq_impl`` (``nemo_rl/models/policy/utils.py``): a REQ
  socket *bound* at the address, two ping-pong staging buffers of half the budget (an
  oversized tensor in a buffer of its own), tensors at 512-byte alignment, one
  ``pickle.dumps((handle, names, used_bytes))`` per buffer and an ``IPCProtocol.COMPLETE``,
  each answered. On CPU the CUDA IPC handle is replaced by torch's CPU shared-memory
  storage rebuild, ``(rebuild_storage_filename, (UntypedStorage, manager, handle, size))``
  (``_share_filename_cpu_``), which only :data:`CPU_ALLOWLIST` admits.
* Collective: ``StatelessProcessGroup`` (a ``TCPStore`` master on ``world_size``) and
  ``packed_broadcast_producer`` (``nemo_rl/utils/packed_tensor.py``) over the gloo stand-in
  of :mod:`genworker.shell.refit.nemo_rl` (``nemo-rl-gloo/`` on the same store), warm-up
  ``ones(1)`` first, groups closing once over the target NeMo-RL computes.

:class:`CpuShmCodec` is the engine side's CPU stand-in for the CUDA handle codec: tests put
it into ``genworker.shell.refit.nemo_rl.CODECS`` (``install_cpu_codec``).
"""

from __future__ import annotations

import datetime as dt
import enum
import os
import pickle
import sys
import types
from collections.abc import Mapping
from typing import Any

import attrs
import pytest
import torch
from refit_helpers import REFIT_TIMEOUT, CommandedProcess, edited, serve_commands
from safetensors.torch import load_file

from genworker.core.nemo_rl_wire import NEMO_RL_IPC_GLOBALS, WireName
from genworker.shell.errors import RefitWireError

ALIGN = 512


class CpuShm(enum.Enum):
    """The CPU stand-in's rebuild function, loaded as a marker (never called)."""

    REBUILD = "torch.multiprocessing.reductions.rebuild_storage_filename"


CPU_ALLOWLIST: Mapping[tuple[str, str], object] = {
    **NEMO_RL_IPC_GLOBALS,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): CpuShm.REBUILD,
}


@attrs.frozen
class CpuShmHandle:
    manager: bytes
    handle: bytes
    size: int


class CpuShmCodec:
    """Maps the stand-in handle: torch's CPU shared-memory storage, by file name."""

    allowlist = CPU_ALLOWLIST

    def read(self, value: object) -> CpuShmHandle:
        if not (isinstance(value, tuple) and len(value) == 2 and value[0] is CpuShm.REBUILD):
            raise RefitWireError(f"not a CPU shared-memory handle: {value!r}")
        args = value[1]
        if not (isinstance(args, tuple) and len(args) == 4):
            raise RefitWireError(f"CPU shared-memory handle arguments: {args!r}")
        cls, manager, handle, size = args
        if cls is not WireName.UNTYPED_STORAGE_CLASS:
            raise RefitWireError(f"CPU shared-memory handle storage class: {cls!r}")
        if not (isinstance(manager, bytes) and isinstance(handle, bytes) and isinstance(size, int)):
            raise RefitWireError(f"CPU shared-memory handle fields: {args!r}")
        return CpuShmHandle(manager, handle, size)

    def storage_bytes(self, handle: CpuShmHandle) -> int:
        return handle.size

    def open(self, handle: CpuShmHandle, device: torch.device) -> torch.Tensor:
        storage = torch.UntypedStorage._new_shared_filename_cpu(
            handle.manager, handle.handle, handle.size
        )
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (handle.size,), (1,))


def install_cpu_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    from genworker.shell.refit.nemo_rl import CODECS

    monkeypatch.setitem(CODECS, "cpu", CpuShmCodec())


# -- the trainer process --------------------------------------------------------------------


def _nemo_rl_ipc_protocol() -> Any:
    """``nemo_rl.models.policy.utils.IPCProtocol``, importable under NeMo-RL's name so the
    pickle names it as NeMo-RL's trainer does."""
    name = "nemo_rl.models.policy.utils"
    if name not in sys.modules:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        module = sys.modules[name]

        class IPCProtocol(enum.Enum):
            COMPLETE = "complete"
            ACK = "ack"

        IPCProtocol.__module__, IPCProtocol.__qualname__ = name, "IPCProtocol"
        module.IPCProtocol = IPCProtocol  # type: ignore[attr-defined]
    return sys.modules[name].IPCProtocol


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Buffer:
    """A staging buffer and its handle: NeMo-RL's ``get_handle_from_tensor`` on CUDA
    (``reduce_tensor(buffer)[1:]``, taken at each send after a sync), the shared-memory
    stand-in on CPU."""

    def __init__(self, nbytes: int, device: str) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._cpu: tuple[object, ...] | None = None
        if device == "cpu":
            from torch.multiprocessing.reductions import rebuild_storage_filename

            storage = self.tensor.untyped_storage()
            manager, handle, size = storage._share_filename_cpu_()
            self._cpu = (rebuild_storage_filename, (torch.UntypedStorage, manager, handle, size))

    def handle(self) -> tuple[object, ...]:
        if self._cpu is not None:
            return self._cpu
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream().synchronize()
        return tuple(reduce_tensor(self.tensor.detach())[1:])  # type: ignore[no-untyped-call]

    def pack(self, offset: int, tensor: torch.Tensor) -> None:
        flat = tensor.reshape(-1).view(torch.uint8)
        self.tensor[offset : offset + tensor.nbytes].copy_(flat)


def packed_target_bytes() -> int:
    """``get_target_packed_tensor_size`` with the host's memory for the GPU's."""
    ratio = float(os.environ.get("NRL_REFIT_BUFFER_MEMORY_RATIO", "0.02"))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(int(total * ratio), 5 << 30)


class _Trainer:
    def __init__(self) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sockets: dict[str, Any] = {}
        self.store: Any = None
        self.pg: Any = None

    def _socket(self, address: str, timeout_s: float) -> Any:
        sock = self.sockets.get(address)
        if sock is None:
            zmq = self.zmq
            sock = self.ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
            sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            self.sockets[address] = sock
        return sock

    def step(self, command: dict[str, Any]) -> dict[str, object]:
        op = command.pop("op")
        timeout_s = float(command.pop("timeout_s", REFIT_TIMEOUT))
        if op == "join":
            return self.join(int(command["port"]), int(command["world_size"]), timeout_s)
        path = str(command.pop("path"))
        evil = command.pop("evil", None)
        tensors = edited(load_file(path), **command.pop("edits", {}))
        if op == "ipc":
            sock = self._socket(str(command.pop("address")), timeout_s)
            return self.ipc(sock, tensors, int(command.pop("buffer_bytes", 384 << 10)), evil)
        return self.collective(tensors)

    def ipc(
        self,
        sock: Any,
        tensors: Mapping[str, torch.Tensor],
        budget: int,
        evil: str | None,
        device: str = "cpu",
    ) -> dict[str, object]:
        """``stream_weights_via_ipc_zmq_impl``, its loop and answers as NeMo-RL has them."""
        half = budget // 2
        buffers = [_Buffer(_aligned(half), device) for _ in range(2)]
        current, used, names, groups, pending = 0, 0, list[str](), 0, False

        def send(buffer: _Buffer, names: list[str], used: int) -> None:
            handle = buffer.handle()
            if pending:
                sock.recv()
            sock.send(pickle.dumps((handle, names, used)))

        if evil is not None:  # a message carrying another callable, before the buckets
            sock.send(evil_pickle(evil))
            pending = True
        for name, tensor in tensors.items():
            size = _aligned(tensor.nbytes)
            if size > half:  # a bucket of its own, answered before it is freed
                if names:
                    send(buffers[current], names, used)
                    pending, groups, current, used, names = True, groups + 1, 1 - current, 0, []
                alone = _Buffer(size, device)
                alone.pack(0, tensor)
                send(alone, [name], size)
                sock.recv()
                pending, groups = False, groups + 1
                del alone
                continue
            if used + size > half:
                send(buffers[current], names, used)
                pending, groups, current, used, names = True, groups + 1, 1 - current, 0, []
            buffers[current].pack(used, tensor)
            names.append(name)
            used += size
        if names:
            send(buffers[current], names, used)
            pending, groups = True, groups + 1
        if pending:
            sock.recv()
        del buffers
        sock.send(pickle.dumps(_nemo_rl_ipc_protocol().COMPLETE))
        answer = sock.recv()
        return {"groups": groups, "answer": answer.decode()}

    def join(self, port: int, world_size: int, timeout_s: float) -> dict[str, object]:
        from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

        timeout = dt.timedelta(seconds=timeout_s)
        self.store = TCPStore("127.0.0.1", port, world_size, True, timeout=timeout)
        self.pg = ProcessGroupGloo(PrefixStore("nemo-rl-gloo/", self.store), 0, world_size, timeout)
        self._broadcast(torch.ones(1))
        return {}

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([tensor], options).wait()

    def collective(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, object]:
        """``packed_broadcast_producer``: groups closing once over the target."""
        target, group, size, groups = packed_target_bytes(), list[torch.Tensor](), 0, 0
        for tensor in tensors.values():
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            group.append(flat)
            size += flat.numel()
            if size > target:
                self._broadcast(torch.cat(group))
                group, size, groups = [], 0, groups + 1
        if group:
            self._broadcast(torch.cat(group))
            groups += 1
        return {"groups": groups}

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class _Evil:
    def __init__(self, call: str) -> None:
        self.call = call

    def __reduce__(self) -> tuple[object, ...]:
        if self.call == "os.system":
            return (os.system, ("echo owned > /dev/null",))
        return (eval, ("1 + 1",))


def evil_pickle(call: str) -> bytes:
    """A message carrying another callable where a bucket would be."""
    return pickle.dumps((_Evil(call), ["x"], 0))


def run_trainer(commands: Any, results: Any) -> None:
    trainer = _Trainer()
    serve_commands(commands, results, trainer.step)
    trainer.close()


class NemoRlTrainer(CommandedProcess):
    """The trainer process, driven by commands: ``ipc`` (``address``, ``path``,
    ``buffer_bytes``, ``evil``, ``edits``), ``join`` (``port``, ``world_size``),
    ``collective`` (``path``, ``edits``)."""

    def __init__(self) -> None:
        super().__init__(run_trainer, defaults={"timeout_s": REFIT_TIMEOUT})
