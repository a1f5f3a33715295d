"""Receivers for NeMo-RL's own trainer-side refit wire: the ``nemo_rl_ipc`` and
``nemo_rl_collective`` refit backends (``shell.refit.door``).

Theory of operation
-------------------
NeMo-RL's trainer (commit 7ea279ab) refits its vLLM workers over two wires, neither of
which carries a start, a count or tensor specs (see :mod:`genworker.core.nemo_rl_refit`):

* IPC (``stream_weights_via_ipc_zmq_impl``, ``nemo_rl/models/policy/utils.py``): each
  trainer rank *binds* a ZMQ REQ socket at ``ipc:///tmp/<GPU UUID>.sock`` (its
  ``get_zmq_address``); each engine worker *connects* a REP socket to the socket of its own
  GPU and answers every message with ``b"ack"``. A message is a pickle (``send_pyobj``) of
  ``(cuda_ipc_handle, param_names, used_bytes)`` for one packed staging buffer, then
  ``IPCProtocol.COMPLETE``, answered after post-load processing. The sender never reads
  the answer's text, so a failure is the engine's to report: this receiver keeps
  answering until ``COMPLETE`` (as NeMo-RL's ``update_weights_via_ipc_zmq`` does), so the
  trainer finishes its stream instead of waiting out its 120 s socket timeout, and the
  worker returns ``False``.
* Collective (``packed_broadcast_producer``, ``nemo_rl/utils/packed_tensor.py``;
  ``StatelessProcessGroup``, ``nemo_rl/distributed/stateless_process_group.py``): trainer
  rank 0 hosts a ``TCPStore`` at ``ip:port`` and publishes NCCL's 128-byte unique id under
  ``nccl_unique_id`` (its default ``peer="nemo"`` protocol); each rank joins the NCCL
  communicator, and rank 0 broadcasts ``ones(1)`` as a warm-up. A refit is one broadcast
  per group of the manifest's tensors (:func:`~genworker.core.nemo_rl_refit.packed_groups`,
  target ``min(total GPU memory * NRL_REFIT_BUFFER_MEMORY_RATIO (0.02), 5 GiB)`` as both
  ends compute it), nothing else. Here NCCL is driven through vLLM's ``NCCLLibrary``
  (``vllm/distributed/device_communicators/pynccl_wrapper.py``), each broadcast bounded by
  polling a CUDA event (on expiry the communicator is aborted). NeMo-RL has no CPU
  collective; on CPU a gloo group on the same store under ``nemo-rl-gloo/`` stands in,
  with the same warm-up and broadcasts.

Both are ports of :func:`genworker.shell.refit.receiver.receive`, so messages become the
protocol's events and pass the same manifest checks and routes
(``EngineContext.receive``).
NeMo-RL's trainer sends checkpoint-layout tensors, whole on every tensor-parallel rank,
so sharded parameters always go through the weight loader. Pickles are read only through
:func:`read_frame` (``core.nemo_rl_wire``) with the allowlist of the engine's device's
:class:`HandleCodec` (:data:`CODECS`): CUDA only in production; a test configuration adds
a CPU stand-in with its own allowlist.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Final, Generic, NoReturn, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
import zmq
from returns.result import Failure, Result
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from genworker.core import nemo_rl_refit as n
from genworker.core import refit_protocol as p
from genworker.core import refit_transport as rt
from genworker.core.joins import GroupJoin, GroupJoinWire, group_join
from genworker.core.nemo_rl_wire import (
    NEMO_RL_IPC_GLOBALS,
    CudaIpcHandle,
    IpcBucket,
    IpcComplete,
    WireProblem,
    cuda_ipc_handle,
    loads,
    read_message,
)
from genworker.core.refit_plan import DTYPE_ITEMSIZE, Manifest, TensorSpec
from genworker.shell.errors import (
    BadArgumentError,
    BadConfigError,
    EngineStateError,
    RefitError,
    RefitManifestError,
    RefitTimeoutError,
    RefitTransportError,
    RefitWireError,
    UnsafePickleError,
    unwrap,
)
from genworker.shell.refit.collective import c10d_backend, foreign_errors, gloo_wait, spin_until
from genworker.shell.refit.door import Holding
from genworker.shell.refit.engine import EngineContext
from genworker.shell.refit.ipc import arrived, end_zmq, zmq_socket
from genworker.shell.refit.memory import copy_into, device_id, sync
from genworker.shell.refit.receiver import Sink, Wait

if TYPE_CHECKING:
    from vllm.distributed.utils import StatelessProcessGroup

__all__ = [
    "CODECS",
    "DEFAULT_SOCKET_DIR",
    "BroadcastGroup",
    "CudaIpcCodec",
    "HandleCodec",
    "NemoRlCollectiveBackend",
    "NemoRlGroup",
    "NemoRlIpcBackend",
    "packed_target_bytes",
    "read_frame",
    "stateless_comm",
]

H = TypeVar("H")
T = TypeVar("T")

#: Where NeMo-RL's trainer binds its IPC sockets (``get_zmq_address``).
DEFAULT_SOCKET_DIR: Final = "/tmp"
_ACK: Final = b"ack"


def _wire(result: Result[T, WireProblem]) -> T:
    """The value, or the refusal raised: ``UnsafePickleError`` when the pickle reached
    for what the wire never carries, else ``RefitWireError``."""
    if isinstance(result, Failure):
        problem = result.failure()
        raise (UnsafePickleError if problem.unsafe else RefitWireError)(str(problem))
    return result.unwrap()


def read_frame(
    frame: bytes, allowlist: Mapping[tuple[str, str], object], read: Callable[[object], H]
) -> IpcBucket[H] | IpcComplete:
    """One message off NeMo-RL's IPC wire (``core.nemo_rl_wire``): unpickled with
    ``allowlist``, a bucket's handle read by ``read``."""
    message = _wire(loads(frame, allowlist).bind(read_message))
    if isinstance(message, IpcComplete):
        return message
    return IpcBucket(read(message.handle), message.names, message.used_bytes)


class HandleCodec(Protocol[H]):
    """How a bucket's handle is read and mapped on one device type: the pickle globals it
    needs (the whole allowlist), its reader, its storage's bytes, and the mapping."""

    @property
    def allowlist(self) -> Mapping[tuple[str, str], object]: ...

    def read(self, value: object) -> H: ...

    def storage_bytes(self, handle: H) -> int: ...

    def open(self, handle: H, device: torch.device) -> torch.Tensor: ...


class CudaIpcCodec:
    """NeMo-RL's handle: ``reduce_tensor(buffer)[1:]`` of a 1-D uint8 CUDA buffer, mapped
    with torch's ``rebuild_cuda_tensor`` on this worker's device (as NeMo-RL's
    ``rebuild_cuda_tensor_from_ipc`` does)."""

    allowlist: Mapping[tuple[str, str], object] = NEMO_RL_IPC_GLOBALS

    def read(self, value: object) -> CudaIpcHandle:
        return _wire(cuda_ipc_handle(value))

    def storage_bytes(self, handle: CudaIpcHandle) -> int:
        return _wire(handle.bucket_bytes())

    def open(self, handle: CudaIpcHandle, device: torch.device) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            tensor = rebuild_cuda_tensor(*handle.rebuild_args(index))  # type: ignore[no-untyped-call]
        except RuntimeError as e:  # a runtime without CUDA IPC says so (failure-modes R8)
            message = f"could not open NeMo-RL's CUDA IPC buffer on cuda:{index}: {e}"
            advice = p.explain_cuda_ipc_failure(str(e))
            raise RefitError(f"{message}\n{advice}" if advice else message) from e
        assert isinstance(tensor, torch.Tensor)
        return tensor


# Each codec has a handle type of its own: the registry cannot name them (Python has no
# existential types); a port is generic in its codec's (NemoRlIpcPort).
CODECS: dict[str, HandleCodec[Any]] = {"cuda": CudaIpcCodec()}
"""The handle codec of each engine device type. NeMo-RL's trainer sends CUDA IPC handles
only; tests add a CPU stand-in here (with its own allowlist), never production code."""


def _view(buffer: torch.Tensor, ref: p.TensorRef, offset: int) -> torch.Tensor:
    raw = buffer[offset : offset + ref.nbytes]
    if raw.storage_offset() % DTYPE_ITEMSIZE[ref.dtype]:
        raw = raw.clone()  # packed broadcasts are unpadded: a misaligned slice moves
    return raw.view(getattr(torch, ref.dtype)).view(ref.shape)


def _scatter(
    buffer: torch.Tensor, writes: p.Writes, offsets: Iterable[int], sink: Sink, *, borrowed: bool
) -> list[tuple[str, torch.Tensor]]:
    """A chunk's tensors out of ``buffer`` (each at its offset): direct ones copied into
    their targets, the loader's as views, cloned where the write asks and the buffer is
    ``borrowed`` (the trainer's, reused once answered)."""
    loader = []
    with torch.no_grad():
        for write, offset in zip(writes.writes, offsets, strict=False):
            view = _view(buffer, write.ref, offset)
            if write.route is p.Route.LOADER:
                loader.append((write.ref.name, view.clone() if borrowed and write.copy else view))
            elif view.numel():
                copy_into(sink.target(write.ref.name), view)
    sync(sink.device)
    return loader


# -- IPC ---------------------------------------------------------------------------------


class NemoRlIpcPort(Generic[H]):
    """An engine worker's REP socket connected to NeMo-RL's trainer (a ``receive`` port),
    its buckets' handles read and mapped by ``codec``."""

    def __init__(self, address: str, device: torch.device, codec: HandleCodec[H]) -> None:
        self.address, self.device, self._codec = address, device, codec
        self.peer = f"NeMo-RL's trainer bound at {address}"
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._open: list[zmq.Socket[bytes]] = []  # the socket, for the finalizer (end_zmq)
        self._finalizer = weakref.finalize(self, end_zmq, self._ctx, self._open)
        self._sock: zmq.Socket[bytes] | None = None
        self._cap, self._refits = -1, 0
        self._stream: n.IpcStream | None = None
        self.memo = p.Memo()  # the receiver's remembered decisions (refit_protocol.Memo)
        self._start()

    def _start(self) -> None:
        self._pending = self._over = False
        self.opened = 0
        self._bound = p.DEFAULT_TIMEOUT_S

    def begin(self, manifest: Manifest) -> None:
        """Ready for one refit of ``manifest`` (inbound messages capped by its size); a
        socket left owing an answer (a refit cut short) is replaced."""
        stale = self._pending
        self._refits += 1
        self._start()
        self._stream = n.IpcStream(manifest, f"nemo-rl-ipc-{self._refits}")
        cap = p.max_message_bytes(manifest)
        if self._sock is None or cap > self._cap or stale:
            if self._sock is not None:
                self._sock.close(linger=0)
            self._cap, self._sock = cap, zmq_socket(self._ctx, zmq.REP, self._open, cap)
            self._sock.connect(self.address)

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            raise EngineStateError("the NeMo-RL IPC port was closed")
        return self._sock

    def _recv(self, wait: Wait) -> IpcBucket[H] | IpcComplete:
        sock = self._socket()
        if not arrived(sock, wait):
            raise wait.expired(self.peer)
        frames = sock.recv_multipart(zmq.NOBLOCK)
        self._pending = True
        if len(frames) != 1:
            raise RefitWireError(f"a NeMo-RL refit message is one frame, got {len(frames)}")
        return read_frame(frames[0], self._codec.allowlist, self._codec.read)

    def next(self, wait: Wait) -> tuple[p.Event, list[object] | None]:
        self._bound = wait.bound_s
        assert self._stream is not None, "next before begin"
        if not self._stream.begun:  # NeMo-RL's trainer sends no start: the first wait is for data
            self._stream, begin = self._stream.begin()
            return begin, None
        message = self._recv(wait)
        if isinstance(message, IpcComplete):
            self._over = True
            return self._stream.end(), None
        storage = self._codec.storage_bytes(message.handle)
        step = self._stream.bucket(message.names, message.used_bytes, storage)
        self._stream, chunk = unwrap(step, RefitManifestError, f"the refit from {self.peer}")
        return chunk, [message.handle]

    def answer(self, event: p.Event, problem: RefitError | None) -> None:
        if isinstance(event, p.Chunk):
            self._ack()

    def write(
        self, writes: p.Writes, handles: list[object] | None, sink: Sink
    ) -> list[tuple[str, torch.Tensor]]:
        if not handles:
            raise RefitError(f"chunk {writes.chunk.index} carries no buffer")
        buffer = self._codec.open(cast(H, handles[0]), self.device)  # what next gave
        self.opened += 1
        offsets = (w.ref.offset for w in writes.writes)
        loader = _scatter(buffer, writes, offsets, sink, borrowed=True)
        del buffer  # the trainer reuses it once answered: no view of it outlives the chunk
        return loader

    def fail(self, problem: RefitError, *, late: Wait | None) -> NoReturn:
        """Answer what is pending, then (unless the trainer went quiet) take and answer the
        rest of its stream up to ``COMPLETE``, unread, so it ends without a timeout."""
        if self._pending:
            self._ack()
        drain = not isinstance(problem, RefitTimeoutError)
        while drain and not self._over:
            wait = Wait.of("the rest of a failed refit, up to COMPLETE", self._bound)
            try:
                self._over = isinstance(self._recv(wait), IpcComplete)
            except RefitTimeoutError:
                break
            except RefitError:
                pass  # an unreadable message still gets its answer
            if self._pending:
                self._ack()
        raise problem

    def finish(self, problem: RefitError | None) -> None:
        if self._pending:
            self._ack()
        if problem is not None:
            raise problem

    def release(self, *, failed: bool) -> int:
        opened, self.opened = self.opened, 0
        return opened

    def _ack(self) -> None:
        self._pending = False
        try:
            self._socket().send(_ACK, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise RefitTransportError(f"could not answer {self.peer}: {e}") from e

    def close(self) -> None:
        self._sock = None  # closed by the finalizer (the one socket in self._open)
        self._finalizer()


# -- collective ----------------------------------------------------------------------------


def packed_target_bytes(device: torch.device, environ: Mapping[str, str]) -> int:
    """NeMo-RL's ``get_target_packed_tensor_size`` on this device: the device's total
    memory (the host's on CPU) times ``NRL_REFIT_BUFFER_MEMORY_RATIO`` (0.02), at most 5 GiB."""
    ratio = environ.get("NRL_REFIT_BUFFER_MEMORY_RATIO", "0.02")
    if device.type == "cuda":
        total = int(torch.cuda.get_device_properties(device).total_memory)
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return unwrap(n.packed_target(ratio, total), BadConfigError, "")


def _until_done(stream: torch.cuda.Stream, deadline: float) -> None:
    """Wait for what ``stream`` holds so far, until ``deadline`` (NCCL has no timeout)."""
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record(stream)
    spin_until(done.query, deadline, "the broadcast")


class _PyNccl:
    """vLLM's ``PyNcclCommunicator`` over its ``StatelessProcessGroup`` (the group of
    vLLM's weight-transfer engine and of the trainer's ``trainer_init``)."""

    def __init__(self, group: StatelessProcessGroup, device: torch.device) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        self.device = device
        self.comm: PyNcclCommunicator | None = PyNcclCommunicator(group, device=device)

    def broadcast(self, tensor: torch.Tensor, deadline: float) -> None:
        assert self.comm is not None, "broadcast on a closed communicator"
        stream = torch.cuda.current_stream(self.device)
        self.comm.broadcast(tensor, src=0, stream=stream)
        _until_done(stream, deadline)

    def close(self) -> None:
        self.comm = None


class _Nccl:
    """One NCCL communicator through vLLM's ``NCCLLibrary`` (broadcasts from rank 0)."""

    def __init__(self, unique_id: bytes, rank: int, world_size: int, device: torch.device):
        from vllm.distributed.device_communicators.pynccl_wrapper import (
            NCCLLibrary,
            ncclUniqueId,
        )

        self.lib, self.device = NCCLLibrary(), device
        uid = ncclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, n.UNIQUE_ID_BYTES)
        with torch.cuda.device(device):
            self.comm = self.lib.ncclCommInitRank(world_size, uid, rank)

    def broadcast(self, tensor: torch.Tensor, deadline: float) -> None:
        from vllm.distributed.device_communicators.pynccl_wrapper import (
            buffer_type,
            cudaStream_t,
            ncclDataTypeEnum,
        )

        stream = torch.cuda.current_stream(self.device)
        ptr = buffer_type(tensor.data_ptr())
        kind = ncclDataTypeEnum.from_torch(tensor.dtype)
        self.lib.ncclBroadcast(
            ptr, ptr, tensor.numel(), kind, 0, self.comm, cudaStream_t(stream.cuda_stream)
        )
        _until_done(stream, deadline)

    def close(self) -> None:
        abort = getattr(self.lib, "ncclCommAbort", None)
        (abort if callable(abort) else self.lib.ncclCommDestroy)(self.comm)


class _Gloo:
    """The CPU stand-in: a gloo group on the same store."""

    def __init__(
        self, store: Store, rank: int, world_size: int, timeout_s: float, prefix: str = "nemo-rl"
    ) -> None:
        timeout = dt.timedelta(seconds=timeout_s)
        self.pg = c10d_backend(
            ProcessGroupGloo(PrefixStore(f"{prefix}-gloo/", store), rank, world_size, timeout)
        )

    def broadcast(self, tensor: torch.Tensor, deadline: float) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        gloo_wait(self.pg.broadcast([tensor], options), deadline)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, AttributeError):
            self.pg.shutdown()


def stateless_comm(
    group: StatelessProcessGroup, rank: int, world_size: int, device: torch.device, timeout_s: float
) -> _PyNccl | _Gloo:
    """The data plane of vLLM's ``StatelessProcessGroup`` ``group``: vLLM's
    ``PyNcclCommunicator`` on CUDA, a gloo group on its store on CPU."""
    if device.type == "cuda":
        return _PyNccl(group, device)
    return _Gloo(group.store, rank, world_size, timeout_s, "genworker")


class BroadcastGroup:
    """A weight-update group whose rank 0 broadcasts packed buffers (NeMo-RL's, vLLM's):
    every broadcast bounded, foreign errors typed in one place; a failure breaks it."""

    def __init__(self, peer: str, device: torch.device) -> None:
        self.peer, self.device, self.broken = peer, device, False
        self._comm: _Nccl | _Gloo | _PyNccl | None = None

    def _foreign(self, what: str, bound_s: float) -> contextlib.AbstractContextManager[None]:
        return foreign_errors(what, self.peer, bound_s, self.close)

    def broadcast(self, tensor: torch.Tensor, what: str, bound_s: float) -> None:
        """Receive rank 0's broadcast into ``tensor``, bounded by ``bound_s``."""
        if self.broken or self._comm is None:
            raise RefitError(
                f"{self.peer} is unusable after a failed collective; join the group again"
            )
        comm = self._comm
        with self._foreign(f"receiving {what}", bound_s):
            comm.broadcast(tensor, time.monotonic() + bound_s)

    def close(self) -> None:
        self.broken = True
        comm, self._comm = self._comm, None
        if comm is not None:
            with contextlib.suppress(Exception):
                comm.close()


class NemoRlGroup(BroadcastGroup):
    """An engine worker's place in NeMo-RL's weight-update group (see the module docstring)."""

    def __init__(self, join: GroupJoin, rank: int, device: torch.device) -> None:
        """Rank ``rank`` of the group ``join`` names, each wait bounded by its timeout."""
        ip, port, world_size, timeout_s = join.ip, join.port, join.world_size, join.timeout_s
        sizes = (world_size, join.train_world_size)
        claim = rt.group_claim(ip, port, rank, sizes, "engine", device.type)
        backend = unwrap(claim, BadConfigError, "invalid NeMo-RL weight-update group").backend
        where = f"{ip}:{port} (rank {rank} of {world_size})"
        super().__init__(f"NeMo-RL's weight-update group at {where}", device)
        timeout = dt.timedelta(seconds=timeout_s)
        with self._foreign("joining the group", timeout_s):
            self._store = TCPStore(ip, port, world_size, False, timeout=timeout)
            if backend == "nccl":
                self._store.wait([n.UNIQUE_ID_KEY], timeout)
                raw = bytes(self._store.get(n.UNIQUE_ID_KEY))
                unique_id = unwrap(n.unique_id(raw), RefitWireError, self.peer)
                self._comm = _Nccl(unique_id, rank, world_size, device)
            else:
                self._comm = _Gloo(self._store, rank, world_size, timeout_s)
        warmup = torch.zeros(1, dtype=torch.float32, device=device)
        self.broadcast(warmup, "the warm-up broadcast", timeout_s)
        if warmup.item() != 1.0:
            self.close()
            raise RefitTransportError(
                f"{self.peer}: the warm-up broadcast gave {warmup.item()}, NeMo-RL sends 1.0"
            )


class NemoRlCollectivePort:
    """One refit over a :class:`BroadcastGroup` (a ``receive`` port): ``groups``, the
    manifest's tensors of each broadcast, in order (NeMo-RL's packed groups; vLLM's,
    packed or one tensor each)."""

    def __init__(
        self,
        group: BroadcastGroup,
        manifest: Manifest,
        groups: tuple[tuple[TensorSpec, ...], ...],
        refit_id: str,
    ) -> None:
        self.group, self.peer = group, f"trainer rank 0 of {group.peer}"
        self.groups = groups
        self._events = iter(n.packed_events(refit_id, groups, len(manifest)))
        self._received = 0
        self._bound = p.DEFAULT_TIMEOUT_S
        self.memo = p.Memo()  # one refit per port: nothing to remember across refits

    def next(self, wait: Wait) -> tuple[p.Event, list[object] | None]:
        self._bound = wait.bound_s
        return next(self._events), None

    def answer(self, event: p.Event, problem: RefitError | None) -> None:
        return None  # NeMo-RL's collective carries no answers

    def _take(self, index: int) -> torch.Tensor:
        group = self.groups[index]
        buffer = torch.empty(
            sum(s.nbytes for s in group), dtype=torch.uint8, device=self.group.device
        )
        self.group.broadcast(buffer, f"packed group {index}", self._bound)
        self._received = index + 1
        return buffer

    def write(
        self, writes: p.Writes, handles: list[object] | None, sink: Sink
    ) -> list[tuple[str, torch.Tensor]]:
        buffer = self._take(writes.chunk.index)
        offsets = accumulate((w.ref.nbytes for w in writes.writes), initial=0)
        return _scatter(buffer, writes, offsets, sink, borrowed=False)

    def fail(self, problem: RefitError, *, late: Wait | None) -> NoReturn:
        """Stay in step: the trainer broadcasts every group whatever happened here."""
        while not self.group.broken and self._received < len(self.groups):
            try:
                self._take(self._received)
            except RefitError:
                break
        raise problem

    def finish(self, problem: RefitError | None) -> None:
        if problem is not None:
            raise problem

    def release(self, *, failed: bool) -> int:
        return 0


# -- the backends --------------------------------------------------------------------------


class NemoRlIpcBackend(Holding[NemoRlIpcPort[object]]):
    """``nemo_rl_ipc``: a REP socket connected to NeMo-RL's trainer's socket for this
    worker's GPU, ``ipc://<socket dir>/<GPU UUID>.sock``."""

    def __init__(self, engine: EngineContext) -> None:
        self.engine, self.socket_dir = engine, DEFAULT_SOCKET_DIR

    @property
    def address(self) -> str:
        return f"ipc://{self.socket_dir}/{device_id(self.engine.device)}.sock"

    def init(self, socket_dir: str = DEFAULT_SOCKET_DIR) -> str:
        """Where NeMo-RL's trainer binds its sockets (``/tmp`` unless set); the address
        this worker connects to."""
        unwrap(n.socket_dir(socket_dir), BadArgumentError, "")
        if socket_dir != self.socket_dir:
            self.close()
        self.socket_dir = socket_dir
        return self.address

    def receive(self, timeout_s: float | None = None) -> dict[str, object]:
        """Receive one refit from NeMo-RL's trainer over its IPC wire."""
        manifest = self.engine.prepared("update_weights_via_ipc_zmq")
        device = self.engine.device
        codec = CODECS.get(device.type)
        if codec is None:
            raise RefitError(
                f"NeMo-RL's IPC wire carries CUDA IPC handles; this engine worker runs "
                f"on {device.type}, which has no handle codec"
            )
        if self.held is None:
            self.held = NemoRlIpcPort(self.address, device, codec)
        self.held.begin(manifest)
        return self.engine.receive(self.held, timeout_s, sharded_ok=False)

    def status(self) -> dict[str, object]:
        return {"address": self.address, "connected": self.held is not None}


class NemoRlCollectiveBackend(Holding[NemoRlGroup]):
    """``nemo_rl_collective``: this worker's place in NeMo-RL's weight-update group."""

    def __init__(self, engine: EngineContext) -> None:
        self.engine, self.target_bytes, self.refits = engine, 0, 0

    def init(self, join: GroupJoinWire, packed_bytes: int | None = None) -> dict[str, object]:
        """Join NeMo-RL's group as ``join`` (``GroupJoin.to_wire``) says; ``packed_bytes``:
        the packing target (None: NeMo-RL's own rule)."""
        where = unwrap(group_join(**join), BadArgumentError, "init_collective")
        device = self.engine.device
        target = unwrap(n.packed_bytes(packed_bytes), BadArgumentError, "")
        if target is None:
            target = packed_target_bytes(device, os.environ)
        self.close()
        rank = where.rank(self.engine.rank)
        self.held = NemoRlGroup(where, rank, device)
        self.target_bytes = target
        return {"rank": rank, "packed_bytes": target}

    def receive(self, timeout_s: float | None = None) -> dict[str, object]:
        """Receive one refit from NeMo-RL's trainer over its packed broadcasts."""
        manifest = self.engine.prepared("update_weights_from_collective")
        if self.held is None:
            raise EngineStateError("update_weights_from_collective before init_collective")
        self.refits += 1
        refit_id = f"nemo-rl-collective-{self.refits}"
        groups = n.packed_groups(manifest, self.target_bytes)
        port = NemoRlCollectivePort(self.held, manifest, groups, refit_id)
        return self.engine.receive(port, timeout_s, sharded_ok=False)

    def status(self) -> dict[str, object]:
        return {"joined": self.held is not None, "packed_bytes": self.target_bytes}
