"""Refit through shared buffers (CUDA IPC / shared memory) with ZMQ REQ/REP metadata.

Rendezvous
----------
The engine worker owns the endpoint. ``WorkerExtension.ipc_address()`` (reached with
``collective_rpc("ipc_address")``, one address per engine worker) creates an
:class:`IpcReceiver`: a private directory (``mkdtemp``: mode 0700, random name) holding a
REP socket ``ipc://<dir>/refit.sock``, and returns that address. The socket lives until
``cleanup()``; the address stays valid across refits. The trainer then, for each refit::

    addresses = engine.collective_rpc("ipc_address")            # once
    future = start(engine.collective_rpc, "update_weights_via_ipc_zmq", timeout_s)
    IpcSender(addresses[rank], manifest=info).send(named_tensors)  # blocks until done
    future.result()

(``start`` is a thread or a Ray call: the engine call blocks until the refit ends.)
TCP is available for hosts where the trainer cannot reach the ipc path
(``IpcReceiver(tcp_host=...)``); it binds loopback only unless ``allow_remote=True``.

Protocol
--------
Strict REQ/REP lockstep, one msgpack frame each way (``wire``): ``Begin`` → ok,
``BucketMsg`` → ok once the bucket is copied out and the device synced, ``Complete`` → ok
once post-load processing finished. The receiver ALWAYS answers a request it took, with
an error frame carrying its message when anything failed (failure-modes R1, R3). The
sender packs bucket *k+1* into the other buffer while the receiver reads bucket *k*, and
reuses a buffer only after the answer to the bucket it carried (R5).

Direct refits (the sender's ``direct=True``, the default; see ``refit.direct``): the
sender lists its tensors in ``Begin``; an engine worker whose parameters take every
manifest tensor directly answers with an :class:`~genworker.shell.refit.wire.Offer`:

- ``engine-handles``: handles of its own parameter storages (CPU: moved into shared
  memory in place once; CUDA: ``_share_cuda_``), exported once and offered again as the
  same bytes while the storages stay (``direct.export_refs``'s cache). The sender
  checks each tensor against that layout (refusing a mismatch, named, before any
  write), maps the storages (kept across refits while the handles stay the same), copies
  every tensor straight into them on one stream, synchronizes, and sends one
  ``DirectMsg``; the engine re-checks its list, runs post-load processing and answers.
- ``sender-handles``: CUDA memory the engine cannot export (vLLM's sleep mode allocates
  weights through CUDA virtual memory, which has no legacy IPC handle), or a receiver
  made with ``offer_params=False``. The sender exports its own tensors' storages in the
  ``DirectMsg``; the engine maps them, copies from them straight into its parameters,
  and unmaps them, so the trainer may free that memory afterwards. Mapping costs time
  in proportion to the allocation (on an H200 about as long as copying it), so a sender
  made with ``keep_mapped=True`` (for tensors it keeps for every refit, such as a
  ``RefitArena``) sends its tensors' own storages, exported once, with
  ``DirectMsg.keep``: the engine keeps them mapped, and the next refit that sends the
  same storages maps nothing. Storages a later refit does not send are unmapped at its
  end (all of them after a refit that sends none kept, in buckets say);
  ``drop_kept()`` (the worker's ``release_refit_buffers``), a failed refit and
  ``close()`` unmap them all. While mapped, the trainer's memory is not returned to the
  device even when the trainer frees it.

Either way one device copy per byte and two small round trips (``Begin``, ``DirectMsg``).
Without an offer, or when the sender cannot map the engine's handles, the refit goes on
in buckets; ``SendReport.mode`` and the engine's report say which mode ran.

Every wait is bounded (``poll`` with the refit timeout, ``LINGER=0``). A sender whose
wait expired closes its REQ socket and makes a fresh one for the next refit (R2); the
receiver answers stray requests of a finished refit with an error, so a late trainer
never blocks a new refit.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import torch
import zmq

from genworker.core.refit_plan import Bucket, Manifest, TensorSpec, bucket_checksum, dtype_name
from genworker.shell.errors import (
    BadConfigError,
    RefitError,
    RefitManifestError,
    RefitTimeoutError,
)
from genworker.shell.refit.buffers import StagingBuffer, open_handle, private_directory
from genworker.shell.refit.direct import (
    ExportCache,
    ListingMemo,
    MappedStorages,
    collect_direct,
    copy_all,
    export_refs,
    open_refs,
    spec_of,
)
from genworker.shell.refit.packing import (
    DEFAULT_BUCKET_BYTES,
    Laps,
    SendReport,
    as_manifest,
    checked_budget,
    pack,
    stream_buckets,
)
from genworker.shell.refit.wire import (
    Abort,
    Begin,
    BucketMsg,
    Complete,
    CpuHandle,
    CudaHandle,
    DirectMsg,
    Message,
    Offer,
    Reply,
    TensorRef,
    bucket_to_wire,
    decode_message,
    decode_reply,
    encode,
    error_from_reply,
    error_kind,
)

__all__ = ["IpcReceiver", "IpcSender"]

log = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class IpcReceiver:
    """The engine worker's end: a bound REP socket plus the buffers it maps."""

    def __init__(
        self,
        device: torch.device,
        *,
        tcp_host: str | None = None,
        allow_remote: bool = False,
        directory: str | Path | None = None,
        offer_params: bool = True,
    ) -> None:
        """``directory``: where the private socket directory is made (default: the
        temporary directory); ignored for TCP. ``offer_params=False``: never hand the
        sender handles of this engine's parameters (it gets no access to the engine's
        memory); direct refits then read from the sender's tensors (``sender-handles``)."""
        if tcp_host is not None and not allow_remote and not _is_loopback(tcp_host):
            raise BadConfigError(
                f"refusing to bind the refit socket on {tcp_host}: not a loopback address "
                "(pass allow_remote=True to expose it)"
            )
        self._device = device
        self.tcp_host = tcp_host
        self.offer_params = offer_params
        self._ctx = zmq.Context()
        self._dir: Path | None = None
        if tcp_host is None:
            self._dir = Path(tempfile.mkdtemp(prefix="genworker-refit-", dir=directory))
            self._endpoint = f"ipc://{self._dir / 'refit.sock'}"
        else:
            self._endpoint = f"tcp://{tcp_host}:0"
        self._cleanup = weakref.finalize(self, _close_resources, self._ctx, self._dir)
        self._sock = self._bind()
        self._pending = False
        self._refit_id = ""
        self._awaiting_begin = True
        self._maps: dict[int, tuple[CpuHandle | CudaHandle, torch.Tensor]] = {}
        self._exports: ExportCache = {}  # this engine's parameters, exported once
        # storages of a sender that keeps them (DirectMsg.keep), mapped across refits
        self._kept = MappedStorages()
        self._kept_used = False  # this refit read from kept storages
        # the targets and layout of the last offer, and the offer
        self._last_offer: tuple[Mapping[str, torch.Tensor], tuple[object, ...], Offer] | None = None
        self._offered = ""

    @property
    def address(self) -> str:
        return self._endpoint

    @property
    def peer(self) -> str:
        return f"the trainer connected to {self._endpoint}"

    def _bind(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        if self._dir is not None:
            (self._dir / "refit.sock").unlink(missing_ok=True)
        try:
            sock.bind(self._endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise RefitError(f"could not bind the refit socket {self._endpoint}: {e}") from e
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock

    def reset(self) -> None:
        """Close and rebind the socket at the same address (drops queued stray requests
        and the kept sender storages: the refit failed)."""
        self.drop_kept()
        self._sock.close(linger=0)
        self._sock = self._bind()
        self._pending = False

    def next_message(self, timeout_s: float) -> Message:
        if self._pending:
            self._reply(RefitError("the receiver moved on without answering this request"))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                raise RefitTimeoutError(
                    f"no refit message from {self.peer} within {timeout_s:.1f}s"
                    + (f" (refit {self._refit_id})" if self._refit_id else "")
                )
            data = self._sock.recv(zmq.NOBLOCK)
            self._pending = True
            try:
                msg = decode_message(data)
            except RefitError as e:
                self._reply(e)
                raise
            if isinstance(msg, Begin):
                self._awaiting_begin = False
                self._refit_id = msg.refit_id
            elif self._awaiting_begin:
                self._reply(
                    RefitError(
                        f"stray {type(msg).__name__} of refit {msg.refit_id!r}: "
                        "no refit is in progress on this engine worker"
                    )
                )
                continue
            return msg

    def precheck(self, problem: RefitError | None, timeout_s: float) -> None:
        if problem is not None:
            self._reply(problem)
            raise problem

    def answer(self, problem: RefitError | None, timeout_s: float) -> None:
        self._reply(problem)
        if problem is not None:
            raise problem

    def acknowledge_abort(self, timeout_s: float) -> None:
        self._reply(None)

    def answer_begin(
        self,
        problem: RefitError | None,
        targets: Mapping[str, torch.Tensor] | None,
        timeout_s: float,
    ) -> bool:
        if problem is not None or targets is None:
            self.answer(problem, timeout_s)
            return False
        offer = self._offer(targets)
        self._reply(None, offer)
        return offer is not None

    def _offer(self, targets: Mapping[str, torch.Tensor]) -> Offer | None:
        last = self._last_offer
        if last is not None and last[0] is targets:
            # the sink's cached targets, which it checked still lie where they lay
            self._offered = last[2].mode
            return last[2]
        key = tuple((n, t.data_ptr(), t.numel(), t.dtype) for n, t in targets.items())
        if last is not None and last[1] == key:
            self._offered = last[2].mode
            self._last_offer = (targets, key, last[2])
            return last[2]  # the same parameters in the same places
        self._last_offer = None
        if not self.offer_params:
            offer = Offer("sender-handles")
        else:
            try:
                storages, refs = export_refs(targets, self._exports)
            except RuntimeError as e:
                self._exports.clear()
                if self._device.type != "cuda":
                    log.warning("refit %s: cannot export the parameters (%s)", self._refit_id, e)
                    return None
                log.info("refit %s: parameters not exportable (%s)", self._refit_id, e)
                offer = Offer("sender-handles")
            else:
                offer = Offer("engine-handles", storages, refs)
        self._offered = offer.mode
        self._last_offer = (targets, key, offer)
        return offer

    def fill_direct(
        self, msg: DirectMsg, targets: Mapping[str, torch.Tensor], timeout_s: float
    ) -> str:
        if not msg.storages:
            if self._offered != "engine-handles":
                raise RefitError(
                    "the direct refit carries no storages, but this engine worker offered "
                    "none of its own"
                )
            return "engine-handles"  # the sender wrote into our parameters already
        if not msg.keep:
            self.drop_kept()
            views = open_refs(msg.storages, msg.tensors, self._device)
            copy_all((targets[name], view) for name, view in views.items())
        else:
            views = self._kept.views(msg.storages, msg.tensors, self._device)
            copy_all((targets[name], view) for name, view in views.items())
            self._kept_used = True
        _sync(self._device)
        return "sender-handles"

    def drop_kept(self) -> int:
        """Let go of the sender storages kept mapped (``IpcSender(keep_mapped=True)``), so
        the trainer's memory returns to the device once it frees it; how many there were."""
        return self._kept.clear()

    def payload(self, msg: BucketMsg, timeout_s: float) -> torch.Tensor:
        if msg.handle is None:
            raise RefitError(f"refit bucket {msg.index} carries no buffer handle")
        cached = self._maps.get(msg.buffer)
        if cached is None or cached[0] != msg.handle:
            self._maps[msg.buffer] = (msg.handle, open_handle(msg.handle, self._device))
        return self._maps[msg.buffer][1]

    def release(self) -> None:
        if self._pending:
            self._reply(RefitError("the refit ended on the engine worker without an answer"))
        # Shared-memory maps stay (re-mapping costs a page fault per page on the next
        # refit, and the sender keeps its buffers); CUDA IPC handles are closed at once so
        # the sender can free its memory.
        self._maps = {k: v for k, v in self._maps.items() if isinstance(v[0], CpuHandle)}
        if not self._kept_used:
            self.drop_kept()  # this refit did not send them: the sender moved on
        self._kept_used = False
        self._awaiting_begin = True
        self._refit_id = ""
        self._offered = ""

    def _reply(self, problem: RefitError | None, offer: Offer | None = None) -> None:
        reply = Reply(
            ok=problem is None,
            refit_id=self._refit_id,
            kind="ack" if problem is None else error_kind(problem),
            message="" if problem is None else str(problem),
            offer=offer,
        )
        self._pending = False
        try:
            self._sock.send(encode(reply), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.reset()
            raise RefitTimeoutError(f"could not answer {self.peer}: {e}") from e

    def close(self) -> None:
        self._maps.clear()
        self.drop_kept()
        self._exports.clear()
        self._last_offer = None
        self._sock.close(linger=0)
        self._cleanup()


def _close_resources(ctx: zmq.Context[zmq.Socket[bytes]], directory: Path | None) -> None:
    ctx.destroy(linger=0)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class IpcSender:
    """The trainer's end: packs tensors into two shared buffers and drives the protocol.

    ``manifest`` (a :class:`Manifest` or the ``{name: (shape, dtype)}`` given to
    ``prepare_refit_info``) lets the receiver refuse a refit meant for another manifest
    before any buffer is read. Staging buffers live on ``device`` (default: the device of
    the first tensor sent): CUDA IPC for a GPU, shared memory for the CPU, in a private
    directory made inside ``staging_dir`` (default: /dev/shm). ``direct``: go straight
    into the engine's memory when it agrees (see the module docstring); the stream is
    materialized first, so pass ``False`` for a stream that creates its tensors lazily.
    ``keep_mapped``: the tensors sent live on for later refits (a ``RefitArena``), so an
    engine that reads from them may keep them mapped (see ``sender-handles`` above);
    tensors not contiguous on the device are then refused, named.
    """

    def __init__(
        self,
        address: str,
        *,
        manifest: Manifest | object | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
        checksum: bool = False,
        device: torch.device | str | None = None,
        staging_dir: str | Path | None = None,
        direct: bool = True,
        keep_mapped: bool = False,
    ) -> None:
        if not address.startswith(("ipc://", "tcp://")):
            raise BadConfigError(f"a refit address is ipc://... or tcp://..., got {address!r}")
        if timeout_s <= 0:
            raise BadConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        self.address = address
        self._manifest = as_manifest(manifest)
        self._budget = checked_budget(bucket_bytes)
        self._timeout = timeout_s
        self._checksum = checksum
        self._device = torch.device(device) if device is not None else None
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._buffers: dict[int, StagingBuffer] = {}
        self._dir: Path | None = None
        self._staging_parent = staging_dir
        self.direct = direct
        self.keep_mapped = keep_mapped
        self._exports: ExportCache = {}  # our storages, exported once (keep_mapped)
        self._listing = ListingMemo()
        # keep_mapped: where the tensors of the last export lay, and what it gave
        self._last_export: (
            tuple[list[tuple[object, ...]], list[CpuHandle | CudaHandle], list[TensorRef]] | None
        ) = None
        self._engine = MappedStorages()  # the engine's parameter storages, mapped here
        self._finalizer = weakref.finalize(self, _close_resources, self._ctx, None)

    # -- public ---------------------------------------------------------------------
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendReport:
        """Send one refit; raises a typed :class:`RefitError` on any failure."""
        refit_id = secrets.token_hex(8)
        started = time.monotonic()
        laps = Laps()
        digest = self._manifest.digest() if self._manifest is not None else ""
        items: list[tuple[str, torch.Tensor]] | None = None
        listing = None
        failure: Exception | None = None
        if self.direct:
            items, listing, failure = collect_direct(named_tensors, self._listing)
            named_tensors = items
        laps.lap("collect")
        begin = Begin(refit_id, digest, direct=listing)
        reply = self._exchange(begin, "the start of the refit", refit_id, started)
        laps.lap("begin")
        if failure is not None:
            self._abort(refit_id, failure, None, started)
        if reply.offer is not None and items is not None:
            report = self._send_direct(items, reply.offer, refit_id, started, laps)
            if report is not None:
                return report
        outstanding: tuple[str, StagingBuffer | None] | None = None
        tensors = nbytes = buckets = 0
        source = stream_buckets(named_tensors, self._budget)
        while True:
            try:
                item = next(source, None)
                if item is None:
                    break
                bucket, chunk = item
                buffer, temporary = self._staging(bucket, chunk)
                pack(bucket, chunk, buffer.tensor)
                _sync(buffer.device)
                checksum = (
                    bucket_checksum(buffer.tensor[: bucket.used_bytes].cpu().numpy().data)
                    if self._checksum
                    else None
                )
            except Exception as e:  # noqa: BLE001 - our own failure; the receiver is told
                self._abort(refit_id, e, outstanding, started)
            if outstanding is not None:
                self._await(outstanding[0], refit_id, started)
                _close(outstanding[1])
            what = f"bucket {bucket.index}"
            msg = bucket_to_wire(bucket, refit_id, checksum=checksum, handle=buffer.handle)
            self._send(msg, what, refit_id, started)
            outstanding = (what, temporary)
            tensors += len(bucket.slots)
            nbytes += bucket.payload_bytes
            buckets += 1
        if outstanding is not None:
            self._await(outstanding[0], refit_id, started)
            _close(outstanding[1])
        laps.lap("buckets")
        self._exchange(
            Complete(refit_id, buckets, tensors), "the end of the refit", refit_id, started
        )
        laps.lap("complete")
        return SendReport(tensors, nbytes, buckets, time.monotonic() - started, phases=laps.seconds)

    def _send_direct(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        offer: Offer,
        refit_id: str,
        started: float,
        laps: Laps,
    ) -> SendReport | None:
        """One direct refit; None when the engine's handles cannot be mapped here (the
        caller goes on in buckets: nothing was written)."""
        keep: dict[str, torch.Tensor] = {}
        try:
            if offer.mode == "engine-handles":
                refs = self._write_engine(items, offer, refit_id, started, laps)
                if refs is None:
                    return None
                msg = DirectMsg(refit_id, refs)
            elif self.keep_mapped:
                storages, refs = self._export_in_place(items)
                msg = DirectMsg(refit_id, refs, storages, keep=True)
                laps.lap("export")
            else:
                device = self._source_device(items)
                keep = {n: t.to(device).contiguous() for n, t in items}
                storages, refs = export_refs(keep)
                _sync(device)
                msg = DirectMsg(refit_id, refs, storages)
                laps.lap("export")
        except Exception as e:  # noqa: BLE001 - our own failure; the receiver is told
            self._abort(refit_id, e, None, started)
        self._exchange(msg, "the direct refit", refit_id, started)
        laps.lap("direct")
        keep.clear()
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        return SendReport(
            len(items), nbytes, 0, time.monotonic() - started, offer.mode, laps.seconds
        )

    def _export_in_place(
        self, items: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[list[CpuHandle | CudaHandle], list[TensorRef]]:
        """Handles of the tensors' own storages (exported once while they stay), for an
        engine that keeps them mapped; :class:`RefitError` naming tensors that would need
        a copy first (a copy would be freed after the refit, and stay mapped)."""
        device = self._source_device(items)
        last = self._last_export
        if last is not None and last[0] == _places(items):
            _sync(device)  # the same tensors in the same places: the same handles
            return last[1], last[2]
        self._last_export = None
        moved = [n for n, t in items if t.device != device or not t.is_contiguous()]
        if moved:
            raise RefitError(
                f"keep_mapped sends tensors where they lie, but {_names(moved)} "
                f"{'is' if len(moved) == 1 else 'are'} not contiguous on {device}"
            )
        storages, refs = export_refs(dict(items), self._exports)
        _sync(device)
        # after the export: a CPU tensor's first export moves it into shared memory
        self._last_export = (_places(items), storages, refs)
        return storages, refs

    def _write_engine(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        offer: Offer,
        refit_id: str,
        started: float,
        laps: Laps,
    ) -> list[TensorRef] | None:
        """Check every tensor against the engine's layout, then copy them all into it."""
        where = {r.name: r for r in offer.tensors}
        if len(items) != len(where) or not all(
            name in where
            and tuple(t.shape) == tuple(where[name].shape)
            and dtype_name(t.dtype) == where[name].dtype
            for name, t in items
        ):
            wrong = [
                f"{name!r} ({TensorSpec.of(name, t).describe()}, the engine holds "
                + (spec_of(where[name]).describe() if name in where else "no such tensor")
                + ")"
                for name, t in items
                if name not in where or spec_of(where[name]) != TensorSpec.of(name, t)
            ]
            raise RefitManifestError(
                "the refit does not match the engine's parameters: "
                + ("; ".join(wrong[:8]) or f"{len(items)} tensors for {len(where)} parameters")
            )
        cuda = any(isinstance(h, CudaHandle) for h in offer.storages)
        device = self._cuda_device(items) if cuda else torch.device("cpu")
        try:
            views = self._engine.views(offer.storages, offer.tensors, device)
        except RefitError as e:
            log.warning("refit %s: cannot map the engine's parameters (%s)", refit_id, e)
            return None
        laps.lap("map")
        copy_all((views[name], tensor) for name, tensor in items)
        laps.lap("copy")
        for d in {device, *(t.device for _, t in items)}:
            _sync(d)
        laps.lap("sync")
        return [where[name] for name, _ in items]

    def _cuda_device(self, items: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
        if self._device is not None and self._device.type == "cuda":
            return self._device
        for _, tensor in items:
            if tensor.device.type == "cuda":
                return tensor.device
        return torch.device("cuda", torch.cuda.current_device())

    def _source_device(self, items: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
        """Where the engine reads our tensors from: the GPU when any lies on one (or
        ``device`` says so), else shared memory on the CPU."""
        cuda = (self._device is not None and self._device.type == "cuda") or any(
            t.device.type == "cuda" for _, t in items
        )
        return self._cuda_device(items) if cuda else torch.device("cpu")

    def close(self) -> None:
        """Free the staging buffers and the socket; the sender is unusable afterwards."""
        self._engine.clear()
        self._exports.clear()
        self._last_export = None
        self._drop_socket()
        for buffer in self._buffers.values():
            buffer.close()
        cuda = any(b.device.type == "cuda" for b in self._buffers.values())
        self._buffers.clear()
        if cuda:
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._finalizer()

    def __enter__(self) -> IpcSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- buffers --------------------------------------------------------------------
    def _staging(
        self, bucket: Bucket, chunk: list[torch.Tensor]
    ) -> tuple[StagingBuffer, StagingBuffer | None]:
        device = self._device or chunk[0].device
        if bucket.used_bytes > self._budget:
            temporary = self._new_buffer(bucket.used_bytes, device)
            return temporary, temporary
        current = self._buffers.get(bucket.buffer)
        if current is None or current.device != device:
            if current is not None:
                current.close()
            current = self._buffers[bucket.buffer] = self._new_buffer(self._budget, device)
        return current, None

    def _new_buffer(self, capacity: int, device: torch.device) -> StagingBuffer:
        if device.type != "cuda" and self._dir is None:
            self._dir = private_directory("genworker-refit-send-", self._staging_parent)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _close_resources, self._ctx, self._dir)
        return StagingBuffer(capacity, device, self._dir)

    # -- the socket -----------------------------------------------------------------
    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock: zmq.Socket[bytes] = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _timeout_error(self, what: str, refit_id: str, started: float) -> RefitTimeoutError:
        self._drop_socket()
        return RefitTimeoutError(
            f"the engine worker at {self.address} did not answer {what} within "
            f"{self._timeout:.1f}s (refit {refit_id}, {time.monotonic() - started:.1f}s in)"
        )

    def _send(self, msg: Message, what: str, refit_id: str, started: float) -> None:
        sock = self._socket()
        if not sock.poll(int(self._timeout * 1000), zmq.POLLOUT):
            raise self._timeout_error(what, refit_id, started)
        sock.send(encode(msg), zmq.NOBLOCK)

    def _await(self, what: str, refit_id: str, started: float) -> Reply:
        sock = self._socket()
        if not sock.poll(int(self._timeout * 1000), zmq.POLLIN):
            raise self._timeout_error(what, refit_id, started)
        reply = decode_reply(sock.recv(zmq.NOBLOCK), self.address)
        if not reply.ok:
            raise error_from_reply(reply, f"the engine worker at {self.address} refused {what}")
        return reply

    def _exchange(self, msg: Message, what: str, refit_id: str, started: float) -> Reply:
        self._send(msg, what, refit_id, started)
        return self._await(what, refit_id, started)

    def _abort(
        self,
        refit_id: str,
        error: BaseException,
        outstanding: tuple[str, StagingBuffer | None] | None,
        started: float,
    ) -> NoReturn:
        """Our own side failed: settle the request in flight, tell the receiver, raise."""
        local = (
            error
            if isinstance(error, RefitError)
            else RefitError(f"the trainer's tensor stream failed: {type(error).__name__}: {error}")
        )
        if outstanding is not None:
            self._await(outstanding[0], refit_id, started)
            _close(outstanding[1])
        try:
            self._exchange(Abort(refit_id, str(local)), "the abort", refit_id, started)
        except RefitError as e:
            log.warning("refit %s: the receiver did not acknowledge the abort: %s", refit_id, e)
        if local is error:
            raise local
        raise local from error


def _places(items: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[object, ...]]:
    """Where each tensor lies and how: what an export's handles and offsets depend on."""
    return [(n, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device) for n, t in items]


def _names(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _close(buffer: StagingBuffer | None) -> None:
    if buffer is not None:
        buffer.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
