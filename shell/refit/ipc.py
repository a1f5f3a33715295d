"""Refit over shared memory (CUDA IPC, shared-memory files) with ZMQ REQ/REP frames.

:class:`IpcReceiver` (the engine worker's) binds a REP socket ``ipc://<dir>/refit.sock``
in a private 0700 directory (or loopback TCP; another host only with ``allow_remote``)
and answers EVERY request, multipart and malformed ones included, strays of a finished
refit with an error (so a late trainer never blocks a new refit); inbound messages are
capped (``ZMQ_MAXMSGSIZE``: a larger one drops its connection unread). A chunk with a
staging buffer or a temporary copy is answered once its tensors are out of the mapped
storages and the device synced, so the sender may reuse or free them (R5); a chunk of the
trainer's own storages only (``Chunk.stable``) is answered once its copies are queued, so
the End travels while they run (its answer follows post-load processing and a sync, and
a mapping is released only after a sync: the trainer's memory stays readable, CUDA IPC
keeping a storage the engine maps from reuse). :class:`IpcSenderPort`
(the trainer's) packs into two alternating staging buffers and packs one again only
after the answer to its last chunk; the Begin's answer is awaited before the first
chunk goes out, so the first chunk is routed and packed while the engine answers. Every
wait is a ``poll`` with the per-wait bound and ``LINGER=0``; a sender whose wait expired
makes a fresh REQ socket (R2).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import NoReturn, cast

import torch
import zmq
from torch.multiprocessing.reductions import StorageWeakRef
from zmq.utils.monitor import recv_monitor_message

from genworker.core import refit_protocol as p
from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.core.refit_protocol import Replay
from genworker.core.refit_transport import bind_refusal, message_cap
from genworker.core.refit_wire import Handle, Listing, Reply, encode, encode_chunk, listing
from genworker.shell.errors import BadConfigError, RefitError, RefitTimeoutError
from genworker.shell.refit.door import Holding
from genworker.shell.refit.engine import EngineContext
from genworker.shell.refit.memory import (
    Exporter,
    Mappings,
    StagingBuffer,
    copy_into,
    private_directory,
    reclaim_dead,
    sync,
)
from genworker.shell.refit.receiver import Sink, Wait
from genworker.shell.refit.wire import decode, decode_reply, error_of, kind_of

__all__ = [
    "SEND_PREFIX",
    "IpcBackend",
    "IpcHolder",
    "IpcReceiver",
    "IpcSenderPort",
    "arrived",
    "end_zmq",
    "zmq_socket",
]

#: A sender's staging folder: ``<SEND_PREFIX><pid>-<random>`` (see ``memory.reclaim_dead``).
SEND_PREFIX = "genworker-refit-send-"

log = logging.getLogger(__name__)


def end_zmq(
    ctx: zmq.Context[zmq.Socket[bytes]],
    sockets: list[zmq.Socket[bytes]],
    directory: Path | None = None,
) -> None:
    """A ZMQ port's finalizer: its sockets closed, its context ended, its folder removed.
    The finalizer holds the sockets themselves: one collected in the same cycle as its
    port, which the context no longer tracks, would leave ``ctx.term()`` waiting forever
    (seen inside vLLM's ``gc.collect()`` in the full suite)."""
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def zmq_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    sockets: list[zmq.Socket[bytes]] | None = None,
    cap: int = -1,
) -> zmq.Socket[bytes]:
    """A fresh ``kind`` socket, ``LINGER=0``, its inbound messages capped at ``cap`` bytes
    (-1: none): the one ``sockets`` (its port's, for :func:`end_zmq`) holds now, if given."""
    sock: zmq.Socket[bytes] = ctx.socket(kind)
    if sockets is not None:
        sockets[:] = [sock]
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, cap)
    return sock


def arrived(sock: zmq.Socket[bytes], wait: Wait) -> bool:
    """Whether a message is there to take before ``wait`` expires."""
    remaining = wait.deadline - time.monotonic()
    return remaining > 0 and bool(sock.poll(int(remaining * 1000) + 1, zmq.POLLIN))


class IpcReceiver:
    """The engine worker's end, a port of :func:`~genworker.shell.refit.receiver.receive`."""

    def __init__(
        self,
        device: torch.device,
        *,
        tcp_host: str | None = None,
        allow_remote: bool = False,
        directory: str | Path | None = None,
    ) -> None:
        if refusal := bind_refusal("the refit socket", tcp_host, allow_remote=allow_remote):
            raise BadConfigError(refusal)
        self._ctx, self._cap, self._pending = zmq.Context(), -1, False
        self._dir = None if tcp_host else Path(tempfile.mkdtemp("", "genworker-refit-", directory))
        self._endpoint = f"tcp://{tcp_host}:0" if tcp_host else f"ipc://{self._dir}/refit.sock"
        self._open: list[zmq.Socket[bytes]] = []
        self._finalizer = weakref.finalize(self, end_zmq, self._ctx, self._open, self._dir)
        self._sock = self._bind()
        self.mappings, self.memo, self._listings = Mappings(device), p.Memo(), dict[int, Listing]()

    def _bind(self) -> zmq.Socket[bytes]:
        for monitor in self._open[1:]:  # the previous socket's
            monitor.close(linger=0)
        sock = zmq_socket(self._ctx, zmq.REP, self._open, self._cap)
        # Who connected, so a timeout can tell "no trainer" from "a trainer sent nothing".
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._open.append(self._monitor)
        self._peers, self._seen = 0, False
        if self._dir is not None:
            (self._dir / "refit.sock").unlink(missing_ok=True)
        try:
            sock.bind(self._endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise RefitError(f"could not bind the refit socket {self._endpoint}: {e}") from e
        self.address = self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peer = f"the trainer connected to {self.address}"
        return sock

    def limit(self, max_bytes: int) -> None:
        """Cap inbound messages at ``max_bytes`` or more: raised (rebinding at the same
        address, so earlier connections take it too; a request sent meanwhile is lost,
        so only between refits), never lowered."""
        if max_bytes > self._cap:
            self._cap = max_bytes
            self._sock.close(linger=0)
            self._sock, self._pending = self._bind(), False

    def next(self, wait: Wait) -> tuple[p.Event, list[Handle] | None]:
        if not arrived(self._sock, wait):
            raise self._expired(wait)
        frames = self._sock.recv_multipart(zmq.NOBLOCK)
        self._pending = True
        problem = RefitError(f"a refit message is one frame, got {len(frames)}")
        try:
            if len(frames) == 1:
                return decode(frames[0], self._listings)
        except RefitError as e:
            problem = e
        self._reply(problem)
        raise problem

    def _expired(self, wait: Wait) -> RefitError:
        """``wait`` expired: "the trainer connected to ... sent nothing" while one is
        connected, else "no trainer connected to ..." (saying when one went away)."""
        while self._monitor.poll(0):
            event = int(recv_monitor_message(self._monitor)["event"])
            self._peers += (event == zmq.EVENT_ACCEPTED) - (event == zmq.EVENT_DISCONNECTED)
            self._seen |= event == zmq.EVENT_ACCEPTED
        return (
            wait.expired(self.peer)
            if self._peers > 0
            else wait.unconnected(self.address, gone=self._seen)
        )

    def answer(self, event: p.Event, problem: RefitError | None) -> None:
        self._reply(problem)

    def write(
        self, writes: p.Writes, handles: list[Handle] | None, sink: Sink
    ) -> list[tuple[str, torch.Tensor]]:
        if handles is None:
            raise RefitError(f"chunk {writes.chunk.index} carries no storages")
        loader = []
        with torch.no_grad():
            views = self.mappings.views(writes.chunk, handles)
            for write, view in zip(writes.writes, views, strict=True):
                if write.route is p.Route.LOADER:
                    loader.append((write.ref.name, view.clone() if write.copy else view))
                elif view.numel():
                    copy_into(sink.target(write.ref.name), view)
        if not writes.chunk.stable:  # the sender may reuse a storage once answered
            sync(sink.device)
        self.mappings.drop_temporary(writes.chunk, handles)
        return loader

    def fail(self, problem: RefitError, *, late: Wait | None) -> NoReturn:
        if not self._pending and late is not None:
            try:
                self.next(late)
            except RefitError:
                raise problem from None
        if self._pending:
            self._reply(problem)
        raise problem

    def finish(self, problem: RefitError | None) -> None:
        self._reply(problem)
        if problem is not None:
            raise problem

    def release(self, *, failed: bool) -> int:
        opened = self.mappings.opened
        self.mappings.settle(failed=failed)
        return opened

    def _reply(self, problem: RefitError | None) -> None:
        reply = Reply(True) if problem is None else Reply(False, kind_of(problem), str(problem))
        self._pending = False
        try:
            self._sock.send(encode(reply), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise RefitError(f"could not answer {self.peer}: {e}") from e

    def close(self) -> None:
        self.mappings.settle(failed=True)
        self._finalizer()  # closes the socket (it is the one in self._open)


class IpcHolder(Holding[IpcReceiver]):
    """A backend that binds an :class:`IpcReceiver` (``ipc``, ``lora``) by its ``init``
    and keeps it until ``close``."""

    def release(self) -> int:
        """Let go of the trainer's memory mapped here between refits (its storages and
        staging buffers), so the trainer gets it back once it frees it; how many."""
        return 0 if self.held is None else self.held.mappings.settle(failed=True)


class IpcBackend(IpcHolder):
    """The ``ipc`` refit backend, its inbound cap raised with every manifest
    ``prepare_refit_info`` records (before the trainer's first message can arrive)."""

    def __init__(self, engine: EngineContext) -> None:
        self.engine = engine
        engine.watch("ipc", self._limit)

    def _limit(self, manifest: Manifest | None) -> None:
        if self.held is not None:
            self.held.limit(message_cap(manifest))

    def init(self, tcp_host: str | None = None) -> str:
        """The address a ``RefitSender.ipc`` connects to (bound once)."""
        if self.held is None:
            self.held = IpcReceiver(self.engine.device, tcp_host=tcp_host)
            self._limit(self.engine.manifest)
        return self.held.address

    def receive(self, timeout_s: float | None = None) -> dict[str, object]:
        """Receive one refit through shared memory at the ``init`` address."""
        self.init()
        assert self.held is not None
        return self.engine.receive(self.held, timeout_s, sharded_ok=True)

    def status(self) -> dict[str, object]:
        if self.held is None:
            return {"address": None, "mapped": 0}
        return {"address": self.held.address, "mapped": len(self.held.mappings)}


def _pack(buffer: StagingBuffer, offset: int, tensor: torch.Tensor) -> None:
    view = buffer.tensor[offset : offset + tensor.numel() * tensor.element_size()]
    copy_into(view.view(tensor.dtype).view(tensor.shape), tensor)


class _Chunk:
    """A chunk being filled: its storages (each handle once), its tensors, and what must
    live until its answer."""

    def __init__(self) -> None:
        self.handles: dict[Handle, int] = {}  # in order
        self.kinds: list[p.StorageKind] = []
        self.refs: list[p.TensorRef] = []
        self.devices: set[torch.device] = set()
        self.alive: list[torch.Tensor | StagingBuffer] = []
        self.sent: list[p.Sent[StorageWeakRef]] = []  # for the replay (core's Replay)
        self.nbytes = 0

    def storage(self, handle: Handle, kind: p.StorageKind) -> int:
        if handle not in self.handles:
            self.handles[handle] = len(self.kinds)
            self.kinds.append(kind)
        return self.handles[handle]

    def close(self) -> None:
        for item in self.alive:
            if isinstance(item, StagingBuffer):
                item.close()
        self.alive.clear()


def place_of(name: str, tensor: torch.Tensor) -> tuple[object, ...]:
    """A tensor's name, spec, storage (its ``_cdata``: unique while a ``StorageWeakRef``
    of it is held, as the sender's replay does) and place in it."""
    s = tensor.untyped_storage()
    return (name, s._cdata, s.data_ptr(), s.nbytes(), tensor.storage_offset(), tensor.shape,
            tensor.dtype, tensor.is_contiguous())  # fmt: skip


class IpcSenderPort:
    """The trainer's end of an :class:`IpcReceiver`, driven by ``RefitSender``. A refit
    whose tensors are, in order, the last one's (:meth:`replays`, one tuple compare per
    tensor) sends that refit's chunk listings again instead of routing and encoding."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float,
        staging_bytes: int,
        device: torch.device | None,
        staging_dir: str | Path | None,
    ) -> None:
        if not address.startswith(("ipc://", "tcp://")):
            raise BadConfigError(f"a refit address is ipc://... or tcp://..., got {address!r}")
        self.address, self.budget, self._timeout = address, staging_bytes, timeout_s
        self.peer = f"the engine worker at {address}"
        self._device, self._staging_parent = device, staging_dir
        self._ctx, self._sock = zmq.Context(), cast(zmq.Socket[bytes] | None, None)
        self._dir: Path | None = None
        self._open: list[zmq.Socket[bytes]] = []
        self._finalizer = weakref.finalize(self, end_zmq, self._ctx, self._open, None)
        self._buffers: dict[int, StagingBuffer] = {}
        self._exporter = Exporter()
        self._chunk, self._outstanding = _Chunk(), cast(_Chunk | None, None)
        self._chunks, self._what, self.refit_id = 0, "", ""
        self._used: set[StorageWeakRef] = set()
        #: the last refit, to send again (``core.refit_protocol.Replay``); this refit's
        #: record (None once it cannot be one: partly replayed, or a tensor sent alone)
        self.replay = self._replay = self._record = cast(Replay[StorageWeakRef] | None, None)
        self.held = list[tuple[str, torch.Tensor]]()

    def begin(self, event: p.Begin) -> None:
        self.refit_id, self._chunks, self._used = event.refit_id, 0, set()
        self._record, self._replay, self.replay = Replay(), self.replay, None  # back at end
        self.held = []
        self._send(encode(event), "the start of the refit")  # answered before chunk 0 goes
        self._outstanding, self._what = _Chunk(), "the start of the refit"

    def take(self, item: tuple[str, torch.Tensor] | None) -> tuple[int, int, int] | None:
        """The last refit's replay goes on with ``item``: None when it is None or not the
        replay's next tensor (:attr:`held` then holds those taken since the last chunk, and
        the chunk in flight is answered, so its staging buffer may be packed again), else the
        tensors, bytes and tensors by handle of the replayed chunk it completes, sent
        (zeros while none)."""
        replay, index, held = self._replay, self._chunks, self.held
        here = replay.expects(index, len(held), place_of(*item)) if replay and item else None
        if replay is None or item is None or here is None:
            self._settle()
            return None
        if here.packed is not None:  # into the same staging buffer, at the same offset
            buffer, offset = here.packed
            _pack(self._buffers[buffer], offset, item[1])
        held.append(item)
        done = replay.chunks[index]
        if len(held) < len(done.sent):
            return 0, 0, 0
        chunk, self.held = _Chunk(), []
        chunk.alive, chunk.devices = [t for _, t in held], {t.device for _, t in held}
        self._used.update(s.ref for s in done.sent)
        self._exporter.saw(done.sent)
        # a refit partly replayed is not recorded; one replayed whole is the replay (and more)
        self._record = replay if index == len(replay.chunks) - 1 else None
        self._out(chunk, done.listing)
        return len(done.sent), done.nbytes, done.by_handle

    def route(self, tensor: torch.Tensor) -> tuple[p.SendRoute, object]:
        """HANDLE with ``(storage ref, handle)``; PACK with ``(storage ref, None)`` when
        it packs for good, else (packed until its storage is recognised) with None."""
        device = self._device = self._device or tensor.device
        ref, recognised = self._exporter.recognised(tensor)
        best = p.send_route(
            storage_bytes=tensor.untyped_storage().nbytes(),
            contiguous=tensor.is_contiguous(),
            local=tensor.device == device,
            recognised=True,
        )
        if best is p.SendRoute.HANDLE and recognised:
            try:
                return best, (ref, self._exporter.handle(ref, tensor))
            except RuntimeError:  # memory that cannot be shared (e.g. a CUDA VMM pool)
                self._exporter.forget(ref)
        return p.SendRoute.PACK, ((ref, None) if recognised or best is p.SendRoute.PACK else None)

    def put(
        self,
        tensor: torch.Tensor,
        spec: TensorSpec,
        route: tuple[p.SendRoute, object],
        placed: p.Placement,
    ) -> None:
        chunk = self._chunk
        ref, handle = cast(tuple[StorageWeakRef, Handle | None], route[1] or (None, None))
        if route[1] is None or placed.alone:  # never replayed
            self._record = None
        pack: tuple[int, int] | None = None
        if handle is not None:
            self._used.add(ref)
            index = chunk.storage(handle, p.StorageKind.OWN)
            offset = int(tensor.storage_offset()) * tensor.element_size()
            chunk.alive.append(tensor)  # the engine reads it: keep it until the answer
            chunk.devices.add(tensor.device)
        elif placed.alone:
            offset = 0
            buffer = self._new_buffer(max(spec.nbytes, 1))
            chunk.alive.append(buffer)
            index = chunk.storage(buffer.handle, p.StorageKind.TEMPORARY)
            _pack(buffer, offset, tensor)
        else:
            kept = self._buffers.get(placed.plan.buffer)
            if kept is None or kept.device != self._device:
                kept = self._buffers[placed.plan.buffer] = self._new_buffer(self.budget)
            index = chunk.storage(kept.handle, p.StorageKind.STAGING)
            offset, pack = placed.offset, (placed.plan.buffer, placed.offset)
            _pack(kept, offset, tensor)
        chunk.sent.append(p.Sent(place_of(spec.name, tensor), ref, pack))  # after a CPU move
        chunk.nbytes += spec.nbytes
        chunk.refs.append(p.TensorRef(spec.name, spec.shape, spec.dtype, index, offset))

    def flush(self) -> None:
        """Send the open chunk (after the answer to the one before)."""
        chunk, self._chunk = self._chunk, _Chunk()
        event = p.Chunk(self.refit_id, self._chunks, tuple(chunk.refs), None, tuple(chunk.kinds))
        listed = listing(event, list(chunk.handles))
        if self._record is not None:
            self._record = self._record.add(p.SentChunk(listed, tuple(chunk.sent), chunk.nbytes))
        self._out(chunk, listed)

    def _out(self, chunk: _Chunk, listed: bytes) -> None:
        index, self._chunks = self._chunks, self._chunks + 1
        for device in {self._device, *chunk.devices}:
            sync(device)
        self._settle()
        self._send(encode_chunk(self.refit_id, index, listed), f"chunk {index}")
        self._outstanding, self._what = chunk, f"chunk {index}"

    def end(self, event: p.End) -> None:
        self._settle()
        self._exchange(encode(event), "the end of the refit")
        self.replay = self._record if self._record is not None and self._record.chunks else None
        self._exporter.settle(self._used)
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]

    def abort(self, event: p.Abort) -> None:
        """Our own side failed: settle the chunk in flight and tell the receiver."""
        self._chunk = _Chunk()
        try:
            self._settle()
            self._exchange(encode(event), "the abort")
        except RefitError as e:  # the receiver failed too, or is gone: ours is raised
            log.warning("refit %s: %s", self.refit_id, e)
        finally:
            self._exporter.settle(self._used)

    def _settle(self) -> None:
        chunk, self._outstanding = self._outstanding, None
        if chunk is not None:
            try:
                self._await(self._what)
            finally:
                chunk.close()

    def _new_buffer(self, capacity: int) -> StagingBuffer:
        assert self._device is not None
        if self._dir is None:
            # A killed sender's folder (its pid gone) is reclaimed at the next start.
            reclaim_dead(SEND_PREFIX, self._staging_parent)
            self._dir = private_directory(f"{SEND_PREFIX}{os.getpid()}-", self._staging_parent)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, end_zmq, self._ctx, self._open, self._dir)
        return StagingBuffer(capacity, self._device, self._dir)

    def _poll(self, flag: int, what: str) -> zmq.Socket[bytes]:
        if self._sock is None:
            self._sock = zmq_socket(self._ctx, zmq.REQ, self._open)
            self._sock.connect(self.address)
        if not self._sock.poll(int(self._timeout * 1000), flag):
            self.drop()
            message = f"{self.peer} did not answer {what} within {self._timeout:g}s"
            raise RefitTimeoutError(f"{message} (refit {self.refit_id})")
        return self._sock

    def _send(self, data: bytes, what: str) -> None:
        self._poll(zmq.POLLOUT, what).send(data, zmq.NOBLOCK)

    def _await(self, what: str) -> None:
        reply = decode_reply(self._poll(zmq.POLLIN, what).recv(zmq.NOBLOCK), self.address)
        if not reply.ok:
            raise error_of(reply.kind, f"{self.peer} refused {what}: {reply.message}")

    def _exchange(self, data: bytes, what: str) -> None:
        self._send(data, what)
        self._await(what)

    def drop(self) -> None:
        """Forget the refit in flight (a timeout, an interrupt): the socket may hold an
        unanswered request, so a fresh one serves the next refit."""
        if self._outstanding is not None:
            self._outstanding.close()
        self._chunk, self._outstanding = _Chunk(), None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        """Free the staging buffers, the handles and the socket."""
        self.drop()
        self._exporter.clear()
        for buffer in self._buffers.values():
            buffer.close()
        self._buffers.clear()
        if self._device is not None and self._device.type == "cuda":  # buffers, handles
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        self._finalizer()
