"""Sparse-delta refit over ZMQ with a relay tree: the trainer's sender, the receivers,
and the engine's end (the ``sparse`` refit backend).

Theory of operation (the pure rules are in ``core/delta.py`` and ``core/sparse_protocol.py``)
-------------------------------------------------------------------------------------------
The sender keeps a *baseline*: the bits every receiver holds, in host memory or in a
memory-mapped file. A step is a ``Begin``, ``Frame`` messages and an ``End``, sent once,
to the relay's root. The first step, and every step after a failed one, is *full* (every
element ``RAW``); the others are *deltas* against the baseline (``SPARSE``/``XOR`` chunks).
Each frame's payload is the concatenated wire forms of its pieces, compressed with zstd
(level 1: the sparse payloads compress about as well at level 3, ten times slower), and
carries a CRC-32 of the compressed bytes. The baseline takes the step's bits while the
sender waits for the receivers, but holds the receivers' bits (``synced_step``) only
after the root's report says every receiver applied them; any other outcome raises
:class:`SparseRefitError` naming the receivers and makes the next step full (which does
not read the baseline).

A receiver (:class:`SparseReceiver`, a ZMQ ROUTER on a background thread) takes the plan
from ``Begin`` (receivers, fanout, hop bound), so re-planning is the sender's business.
For each frame it checks the payload's CRC (a corrupted frame is refused and not
forwarded), forwards the verified message to its children *before* applying it, then
decompresses and applies it into its own baseline copy (frames on a small thread pool:
pieces are disjoint element ranges) and checks each piece's result against the trainer's
hash of the same elements (``core.delta.bits_hash``: 64 bits, by a compiled loop at
memory speed, where CRC-32 cost as much as the rest of a delta step; ``Begin`` names it,
:data:`CHECKSUM`, and a receiver refuses a step that names another); a tensor is
verified when pieces covering all of it matched (per-piece hashes let both ends hash in
parallel). The codec's hot loops (diff and wire form, checked apply, the hash) are
``core/delta_loops.py``'s, compiled by ``shell/delta_kernels.py``.
At ``End`` it commits: only when every tensor is verified does it hand the
tensors to its :class:`ApplyTarget`, so bits that failed the
check never reach the engine, which keeps serving its previous, consistent weights. Then
it waits for each child's report within the child's bound and answers its parent with
the subtree's report. A receiver that refused or missed a step holds bits nobody can
vouch for: it refuses every delta until a full step (``needs_full``).

Security: messages are msgpack structs and raw bytes against a fixed schema (no pickle);
a message larger than twice the frame budget is dropped by ZMQ (``MAXMSGSIZE``); the
receiver binds loopback unless ``allow_remote=True`` (failure-modes 3.2: NeMo-RL's relay
binds ``0.0.0.0`` with a warning). There is no authentication: keep remote relays on a
trusted network.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final, Protocol

import attrs
import numpy as np
import torch
import zmq
import zstandard
from returns.result import Failure

from genworker.core.delta import (
    MAX_CHUNK_ELEMENTS,
    Bits,
    Frame,
    FramePiece,
    RelayPlan,
    RelayReport,
    bit_pattern,
    conclude_relay,
    plan_frames,
    plan_relay,
    tensor_checksum,
)
from genworker.core.refit_plan import DTYPE_ITEMSIZE, Manifest, TensorSpec
from genworker.core.refit_transport import bind_refusal
from genworker.core.sparse_protocol import (
    CHECKSUM,
    TAG_BEGIN,
    TAG_END,
    TAG_FRAME,
    FrameAction,
    FrameMsg,
    FrameResult,
    SparseEngineState,
    Started,
    StepReceiver,
    StepReport,
    StepSender,
    apply_frame,
    baseline_bits,
    baseline_layout,
    begin_message,
    check_tensors,
    encode_frame,
    end_message,
    expected_relay,
    frame_message,
    fresh_bits,
    node_answer,
    read_begin,
    read_frame,
    read_report,
    report_message,
    root_answer,
    sender_settings,
    token_bucket,
)
from genworker.shell.delta_kernels import apply_wire_into, encode_wire, piece_hash, warm_up
from genworker.shell.errors import (
    BadArgumentError,
    BadConfigError,
    EngineStateError,
    RefitError,
    unwrap,
)
from genworker.shell.refit.engine import EngineContext, EngineSink
from genworker.shell.refit.ipc import end_zmq, zmq_socket

__all__ = [
    "CHECKSUM",
    "ApplyTarget",
    "Baseline",
    "DictTarget",
    "EngineTarget",
    "LinkThrottle",
    "SparseBackend",
    "SparseReceiver",
    "SparseRefitError",
    "SparseSender",
    "StepReport",
    "default_workers",
    "write_verified",
]

log = logging.getLogger(__name__)

FRAME_BYTES: Final = 8 << 20
ZSTD_LEVEL: Final = 1
_POLL_MS: Final = 50


class SparseRefitError(RefitError):
    """A sparse step that not every receiver applied; ``detail`` names each one."""


# --- the link throttle ---------------------------------------------------------------


class LinkThrottle:
    """A token bucket on the sender's writes: ``bits_per_s`` with a burst of ``burst_bytes``.

    ``wait(n)`` sleeps until ``n`` bytes may go; large messages are paid for in full
    before they are handed to ZMQ, so the link's rate bounds the step's wire time.
    """

    def __init__(self, bits_per_s: float, burst_bytes: int = 64 << 10) -> None:
        bucket = token_bucket(bits_per_s, burst_bytes, time.monotonic())
        self.bucket = unwrap(bucket, BadArgumentError, "")

    def wait(self, nbytes: int) -> None:
        if seconds := self.bucket.take(time.monotonic(), nbytes):
            time.sleep(seconds)


# --- the baseline --------------------------------------------------------------------


class Baseline:
    """The bits every receiver holds, one 1-D bit array per tensor of ``manifest``.

    In host memory, or in a file mapped with ``mmap`` (``path``: created or truncated to
    the manifest's size) so a trainer can keep a large baseline out of its heap.
    """

    def __init__(self, manifest: Manifest, path: Path | None = None) -> None:
        self.manifest = manifest
        total = baseline_layout(manifest.specs)[1]
        self.path = path
        self._map: mmap.mmap | None = None
        if path is None:
            storage = np.zeros(total, dtype=np.uint8)
        else:
            with open(path, "w+b") as f:
                f.truncate(max(total, 1))
                self._map = mmap.mmap(f.fileno(), max(total, 1))
            storage = np.frombuffer(self._map, dtype=np.uint8, count=total)
        self._bits = baseline_bits(manifest.specs, storage)

    def bits(self, name: str) -> Bits:
        return self._bits[name]

    def close(self) -> None:
        self._bits.clear()
        if self._map is not None:
            self._map.close()
            self._map = None


# --- the apply target ----------------------------------------------------------------


class ApplyTarget(Protocol):
    """Where a receiver puts a verified step: one call per tensor, after every check.

    ``tensor`` has the manifest's shape and dtype and is borrowed: it is the receiver's
    own baseline, changed by the next step, so copy it before returning.
    """

    def begin(self, step: int, specs: Sequence[TensorSpec], bound_s: float = 0.0) -> None:
        """Verified step ``step``'s tensors are about to be applied (``specs``: all);
        ``bound_s``: how long the target may wait for the weights to be free."""

    def apply(self, name: str, tensor: torch.Tensor) -> None: ...

    def finish(self) -> None:
        """Every tensor of the step was applied (the step counts as applied on return)."""


class DictTarget:
    """An :class:`ApplyTarget` over a dict of CPU tensors (copied into, or created)."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = {} if tensors is None else tensors

    def begin(self, step: int, specs: Sequence[TensorSpec], bound_s: float = 0.0) -> None:
        pass

    def finish(self) -> None:
        pass

    def apply(self, name: str, tensor: torch.Tensor) -> None:
        mine = self.tensors.get(name)
        if mine is None or mine.shape != tensor.shape or mine.dtype != tensor.dtype:
            self.tensors[name] = tensor.clone()
        else:
            mine.copy_(tensor)


def _as_tensor(bits: Bits, spec: TensorSpec) -> torch.Tensor:
    raw = torch.from_numpy(bits.view(np.uint8))
    dtype = getattr(torch, spec.dtype)
    return (raw.view(dtype) if spec.numel else torch.empty(0, dtype=dtype)).reshape(spec.shape)


# --- the sender ----------------------------------------------------------------------


_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    """One compressor per thread (a ``ZstdCompressor`` is not safe to share)."""
    c: zstandard.ZstdCompressor | None = getattr(_local, "zstd", None)
    if c is None:
        c = _local.zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


#: A frame's message parts, and each of its pieces' wire form (for the baseline).
_Encoded = tuple[list[bytes], tuple[tuple[FramePiece, bytes], ...]]


def default_workers() -> int:
    """The encode (sender) or apply (receiver) threads of a sparse refit when not given:
    half the cores this process may run on (the other half left to the other end, the
    trainer and the engine often sharing a host), at least 2 and at most 8. A delta step's
    time is these threads' (the link carries a few percent of the model's bytes)."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return max(2, min(8, cores // 2))


class SparseSender:
    """The trainer's end: baseline, encoding, one copy to the relay root, the verdict.

    ``receivers`` are the receivers' addresses (:attr:`SparseReceiver.address`) in relay
    order: the first is the root. ``hop_s`` bounds each relay level's answer after the
    step's end (``RelayPlan.answer_bound_s``): the sender waits ``hop_s * depth`` for the
    root, and as long for the root to take a message. ``baseline_path``: keep the baseline
    in that memory-mapped file instead of the heap. ``throttle``: pace the writes to the
    root (a slow link, or a benchmark's). ``workers``: threads that encode frames ahead of
    the link (the compiled loops, zlib and zstd release the GIL); ``None``:
    :func:`default_workers`.
    """

    def __init__(
        self,
        receivers: Sequence[str],
        manifest: Manifest,
        *,
        fanout: int = 2,
        hop_s: float = 30.0,
        baseline_path: Path | None = None,
        throttle: LinkThrottle | None = None,
        frame_bytes: int = FRAME_BYTES,
        chunk_elements: int = MAX_CHUNK_ELEMENTS,
        workers: int | None = None,
    ) -> None:
        self.plan: RelayPlan = unwrap(
            plan_relay(receivers, fanout), BadArgumentError, "sparse refit relay"
        )
        workers = default_workers() if workers is None else workers
        unwrap(sender_settings(hop_s, frame_bytes, workers, chunk_elements), BadArgumentError, "")
        self.manifest = manifest
        self.hop_s = hop_s
        self.throttle = throttle
        self.chunk_elements = chunk_elements
        self.frames = plan_frames(manifest.specs, frame_bytes, chunk_elements)
        warm_up({DTYPE_ITEMSIZE[s.dtype] for s in manifest.specs})
        self.baseline = Baseline(manifest, baseline_path)
        self.steps = StepSender()  # full or delta, and the step the baseline holds
        self.checksum = CHECKSUM  # what ``Begin`` says the pieces carry
        self.workers = workers
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "genworker-sparse")
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = zmq_socket(self._ctx, zmq.DEALER)
        self._sock.setsockopt(zmq.SNDTIMEO, int(self.plan.answer_bound_s(0, hop_s) * 1000))
        self._sock.connect(self.plan.receivers[0])

    def send(self, tensors: Mapping[str, torch.Tensor]) -> StepReport:
        """Refit every receiver to ``tensors`` (the manifest's names, shapes and dtypes).

        Full when no step has succeeded yet (or the last one failed), a delta otherwise.
        Raises :class:`BadArgumentError` for tensors that do not match the manifest
        (nothing sent) and :class:`SparseRefitError` naming the receivers that did not
        apply the step (the next step is then full).
        """
        bits = self._bits_of(tensors)
        started = time.monotonic()
        frames = len(self.frames)
        begin = self.steps.begin(self.plan, self.hop_s, frames, self.manifest, self.checksum)
        step = begin.step
        while self._sock.poll(0):
            self._sock.recv_multipart()  # a late report of an earlier, failed step
        kept: list[tuple[FramePiece, bytes]] = []
        wire = self._write(begin_message(begin, self.chunk_elements), step)
        for parts, deltas in self._encode_ahead(bits, begin.full, step):
            wire += self._write(parts, step)
            kept.extend(deltas)
        wire += self._write(end_message(step), step)
        # The baseline takes the step's bits while the receivers apply and commit it (the
        # pool's threads, pieces being disjoint element ranges); it counts as the
        # receivers' bits only after the verdict (``synced_step``): a failed step makes
        # the next one full, which does not read it.
        advancing = [self._pool.submit(self._advance, piece) for piece in kept]
        try:
            verdict = conclude_relay(self.plan, self._await_root(step), self.hop_s)
        finally:
            concurrent.futures.wait(advancing)  # nothing writes the baseline after send
        for future in advancing:
            future.result()  # a baseline that could not take its bits: a RefitError
        seconds = time.monotonic() - started
        report = self.steps.finish(begin, verdict, self.manifest.total_bytes, wire, seconds)
        if isinstance(report, Failure):
            raise SparseRefitError(str(report.failure()), detail=report.failure().relay)
        return report.unwrap()

    @property
    def synced_step(self) -> int | None:
        """The step every receiver holds (the baseline's); ``None``: the next is full."""
        return self.steps.synced_step

    @synced_step.setter
    def synced_step(self, step: int | None) -> None:
        self.steps.synced_step = step

    def _advance(self, kept: tuple[FramePiece, bytes]) -> None:
        piece, data = kept
        target = self.baseline.bits(piece.name)[piece.start : piece.stop]
        unwrap(apply_wire_into(target, data), RefitError, f"the baseline of {piece.name!r}")

    def _bits_of(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Bits]:
        given = {n: TensorSpec.of(n, t) if n in self.manifest else None for n, t in tensors.items()}
        unwrap(check_tensors(self.manifest, given), BadArgumentError, "")
        return {
            s.name: bit_pattern(tensors[s.name].detach().cpu().contiguous())
            for s in self.manifest.specs
        }

    def _encode_ahead(self, bits: Mapping[str, Bits], full: bool, step: int) -> Iterator[_Encoded]:
        """Encoded frames in order, ``2 * workers`` of them in flight ahead of the link."""
        frames = iter(enumerate(self.frames))
        encode = functools.partial(self._encode, bits=bits, full=full, step=step)
        pending: collections.deque[concurrent.futures.Future[_Encoded]] = collections.deque()
        try:
            for index, frame in itertools.islice(frames, 2 * self.workers):
                pending.append(self._pool.submit(encode, index, frame))
            while pending:
                encoded = pending.popleft().result()
                for index, frame in itertools.islice(frames, 1):
                    pending.append(self._pool.submit(encode, index, frame))
                yield encoded
        finally:
            for future in pending:
                future.cancel()

    def _encode(
        self, index: int, frame: Frame, bits: Mapping[str, Bits], full: bool, step: int
    ) -> _Encoded:
        old = None if full else self.baseline.bits
        chunk = self.chunk_elements
        raw, pieces, deltas = encode_frame(frame, bits, old, chunk, encode_wire, piece_hash)
        return frame_message(step, index, pieces, len(raw), _compressor().compress(raw)), deltas

    def _write(self, parts: list[bytes], step: int) -> int:
        nbytes = sum(len(p) for p in parts)
        if self.throttle is not None:
            self.throttle.wait(nbytes)
        try:
            self._sock.send_multipart(parts, copy=False)
        except zmq.Again as e:
            bound = self.plan.answer_bound_s(0, self.hop_s)
            raise SparseRefitError(
                f"sparse refit step {step}: the relay root {self.plan.receivers[0]!r} took "
                f"no message within {bound:g} s"
            ) from e
        return nbytes

    def _await_root(self, step: int) -> RelayReport | None:
        """The root's report of ``step``, or ``None`` when none came within its bound."""
        deadline = time.monotonic() + self.plan.answer_bound_s(0, self.hop_s)
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(max(1, int(left * 1000))):
                continue
            report = root_answer(self._sock.recv_multipart(), step, self.plan.receivers[0])
            if report is not None:
                return report
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        end_zmq(self._ctx, [self._sock])
        self.baseline.close()

    def __enter__(self) -> SparseSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the receiver --------------------------------------------------------------------


@attrs.define
class _Step:
    """A step in progress at one receiver: the machine's decision and the shell's own."""

    number: int
    parent: bytes  # the ROUTER identity to answer
    hop_s: float
    started: Started
    specs: dict[str, TensorSpec]
    applying: list[concurrent.futures.Future[FrameResult]] = attrs.Factory(list)


class SparseReceiver:
    """A relay node: takes a step, forwards it, applies and verifies it, reports.

    Its name in a relay is its bound :attr:`address` (what the sender lists). ``target``
    gets each verified tensor at the end of a good step. ``workers``: threads that
    decompress, check and apply frames (``None``: :func:`default_workers`). ``start()``
    serves on a daemon thread; ``close()`` stops it.
    """

    def __init__(
        self,
        target: ApplyTarget,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        allow_remote: bool = False,
        max_frame_bytes: int = FRAME_BYTES,
        workers: int | None = None,
        on_diverge: Callable[[str], None] | None = None,
    ) -> None:
        note = "; the relay is unauthenticated"
        refusal = bind_refusal("the sparse refit relay", host, allow_remote=allow_remote, note=note)
        if refusal is not None:
            raise BadConfigError(refusal)
        workers = default_workers() if workers is None else workers
        if workers < 1:
            raise BadArgumentError(f"workers must be positive, got {workers!r}")
        self.workers = workers
        self.target = target
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = zmq_socket(self._ctx, zmq.ROUTER, cap=2 * max_frame_bytes + (1 << 20))
        self._sock.bind(f"tcp://{host}:{port}")
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._children: dict[str, zmq.Socket[bytes]] = {}
        self._bits: dict[str, Bits] = {}
        self.machine = StepReceiver(self.address, CHECKSUM)  # the step rules
        self.frames_received = self.machine.frames_taken  # step -> frames taken
        self._on_diverge = on_diverge
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "genworker-sparse-apply")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def verified_bits(self) -> dict[str, Bits]:
        """The bits of the last committed step, by tensor name (this receiver's own)."""
        return dict(self._bits)

    @property
    def needs_full(self) -> bool:
        """True until a full step succeeds, and again after any refused or missed step."""
        return self.machine.needs_full

    def expect_relay(self, receivers: Sequence[str] | None) -> None:
        """Take only steps planned over exactly ``receivers`` (in that order), or any
        plan naming this receiver (``None``). Refused (``BadArgumentError``) when they are
        not distinct non-empty names or do not include :attr:`address`."""
        relay = expected_relay(receivers, self.address)
        self.machine.relay = unwrap(relay, BadArgumentError, "")

    def start(self) -> SparseReceiver:
        warm_up()  # the codec's loops, before any step waits on them
        self._thread = threading.Thread(
            target=self.serve, name="genworker-sparse-relay", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._pool.shutdown(wait=True)
        end_zmq(self._ctx, [*self._children.values(), self._sock])

    def serve(self) -> None:
        """Serve steps until :meth:`close` (on the calling thread)."""
        step: _Step | None = None
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                if self._diverged(self.machine.idle(time.monotonic() - quiet_since)):
                    step = None  # the open step (the machine's) stopped mid-way
                continue
            quiet_since = time.monotonic()
            frames = self._sock.recv_multipart(copy=False)
            parts = [f.bytes if i < 3 else f.buffer for i, f in enumerate(frames)]
            step = self._on_message(step, parts)

    # -- messages (the machine decides, these move the bytes)

    def _on_message(self, step: _Step | None, parts: list[bytes | memoryview]) -> _Step | None:
        identity, tag = bytes(parts[0]), bytes(parts[1]) if len(parts) > 1 else b""
        if tag == TAG_BEGIN and len(parts) == 3:
            return self._on_begin(identity, bytes(parts[2]))
        if step is None or identity != step.parent:
            return step
        if tag == TAG_FRAME and len(parts) == 4:
            self._on_frame(step, bytes(parts[2]), parts[3])
            return step
        if tag == TAG_END and len(parts) == 3:
            self._on_end(step, bytes(parts[2]))
            return None
        return step

    def _on_begin(self, identity: bytes, body: bytes) -> _Step | None:
        read = read_begin(body)
        if isinstance(read, Failure):
            log.warning("sparse relay %s: %s", self.address, read.failure())
            self._diverged(self.machine.replace())
            return None
        begin = read.unwrap()
        started, replaced = self.machine.begin(begin)
        self._diverged(replaced)
        self._forward(started, [TAG_BEGIN, body])
        if started.full:  # fresh bits for the whole manifest
            self._bits = fresh_bits(started.specs)
        specs = {spec.name: spec for spec in started.specs}
        return _Step(begin.step, identity, begin.hop_s, started, specs)

    def _on_frame(self, step: _Step, body: bytes, payload: bytes | memoryview) -> None:
        read = read_frame(body)
        if isinstance(read, Failure):
            self.machine.refuse(str(read.failure()))
            return
        header = read.unwrap()
        action = self.machine.take_frame(header, payload)
        if action in (FrameAction.FORWARD, FrameAction.APPLY):
            self._forward(step.started, [TAG_FRAME, body, payload])
        if action is FrameAction.APPLY:
            step.applying.append(self._pool.submit(self._apply_frame, step, header, payload))

    def _apply_frame(
        self, step: _Step, header: FrameMsg, payload: bytes | memoryview
    ) -> FrameResult:
        """Decompress, decode, apply and check one frame (on a pool thread)."""
        try:
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=header.raw_bytes)
        except zstandard.ZstdError as e:
            return FrameResult(f"frame {header.index} does not decompress: {e}", ())
        return apply_frame(header, raw, step.specs, self._bits, apply_wire_into, piece_hash)

    def _on_end(self, step: _Step, body: bytes) -> None:
        forwarded = time.monotonic()
        self._forward(step.started, [TAG_END, body])
        results = [future.result() for future in step.applying]
        own, why = self.machine.take_end(body, results)
        if not self._diverged(why):
            own = self._commit(step)
        children = self._collect(step, forwarded)  # none outside the step's relay
        report = node_answer(self.address, own, step.started, children, step.hop_s)
        self._sock.send_multipart([step.parent, *report_message(step.number, report)])

    def _commit(self, step: _Step) -> str:
        """Hand every verified tensor to the target; the reason it did not, or ''."""
        problem = ""
        try:
            # A running batch is waited for at most half this node's answer bound.
            self.target.begin(step.number, list(step.started.specs), step.hop_s / 2)
            for spec in step.started.specs:
                self.target.apply(spec.name, _as_tensor(self._bits[spec.name], spec))
            self.target.finish()
        except Exception as e:  # noqa: BLE001 -- the target's failure is this node's answer
            problem = f"the apply target failed: {type(e).__name__}: {e}"
        self._diverged(self.machine.committed(step.number, problem))
        return problem

    def _diverged(self, why: str) -> str:
        """Log and tell a divergence the machine reported (none when ``why`` is '')."""
        if why:
            log.warning("sparse relay %s: %s; a full refit is needed", self.address, why)
            if self._on_diverge is not None:
                self._on_diverge(why)
        return why

    def _child(self, address: str) -> zmq.Socket[bytes]:
        sock = self._children.get(address)
        if sock is None:
            sock = zmq_socket(self._ctx, zmq.DEALER)
            sock.connect(address)
            self._children[address] = sock
        return sock

    def _forward(self, step: Started, parts: list[bytes | memoryview]) -> None:
        """Send ``parts`` on to this node's children (never blocks: a full queue is a
        child that stopped taking messages, which its parent reports as silent)."""
        for child, address in step.children.items():  # none outside the step's relay
            try:
                self._child(address).send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                log.warning("sparse relay %s: child %s takes no messages", self.address, child)

    def _collect(self, step: _Step, forwarded: float) -> dict[int, RelayReport]:
        """Each child's report of this step, waited for within the child's own bound (a
        child absent from the answer was silent)."""
        waiting = step.started.deadlines(forwarded, step.hop_s)
        socks = {child: self._child(address) for child, address in step.started.children.items()}
        reports: dict[int, RelayReport] = {}
        poller = zmq.Poller()
        for sock in socks.values():
            poller.register(sock, zmq.POLLIN)
        while waiting := {c: at for c, at in waiting.items() if at > time.monotonic()}:
            left = max(waiting.values()) - time.monotonic()
            ready = dict(poller.poll(max(1, int(min(left, _POLL_MS / 1000) * 1000))))
            for child in list(waiting):
                sock = socks[child]
                if ready.get(sock):
                    got = read_report(sock.recv_multipart())
                    if got is not None and got[0] == step.number:
                        reports[child] = got[1]
                        del waiting[child]
        return reports


# --- the engine's end: the ``sparse`` refit backend ----------------------------------
#
# Each engine worker runs a SparseReceiver on a daemon thread. Only a step verified in
# full reaches the engine, through EngineTarget: tensors whose layout equals a
# parameter's (the refit protocol's routes, as the IPC path keeps them) are copied
# straight into parameter memory, followed by their modules' post-load processing, and
# the parameter's bytes are compared with the verified bits, so a write that did not
# land is caught; the others go through the engine's weight loader, one call per step (a
# loader may fuse, cast or re-pack: their checksum is that of the bits handed to it). Any
# step refused or failed here marks the engine *diverged*: ``status`` says so and the
# generation worker refuses to serve (``SparseRefitError``) until a full refit succeeds
# (a full sparse step, or an IPC/collective refit: ``EngineContext.version`` moved).
# Steps arrive when the trainer sends them, between generations (the worker resets its
# caches and counts the refit at its next call, from ``applied``).


def _checksum(tensor: torch.Tensor) -> int:
    return tensor_checksum(bit_pattern(tensor.detach().cpu().contiguous()))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


class EngineTarget:
    """A verified sparse step into the engine's parameters (see above); ``applied(step)``
    is called once a step is in. The step's tensors are staged by :meth:`apply` (the
    receiver's bits stay put until its next step) and written by :meth:`finish`: all of
    them checked for NaN and inf first (``EngineContext.check_finite``), then written
    under the engine's :class:`~genworker.shell.refit.engine.WeightsGate` (never under a
    running batch: it waits for one at most ``bound_s``, then refuses the step)."""

    def __init__(self, engine: EngineContext, applied: Callable[[int], None]) -> None:
        self._engine, self._applied = engine, applied
        self._staged: list[tuple[str, torch.Tensor]] = []
        self._step, self._bound_s = -1, 0.0
        self._manifest: Manifest | None = None

    def begin(self, step: int, specs: Sequence[TensorSpec], bound_s: float = 0.0) -> None:
        self._step, self._bound_s, self._staged = step, bound_s, []
        self._manifest = Manifest.from_specs(specs).unwrap()  # the receiver checked it
        self._engine.check_dtypes(self._manifest, f"sparse step {step}")

    def apply(self, name: str, tensor: torch.Tensor) -> None:
        self._staged.append((name, tensor))  # borrowed until finish()

    def finish(self) -> None:
        engine, staged, what = self._engine, self._staged, f"sparse step {self._step}"
        self._staged = []
        engine.check_finite(staged, what)
        assert self._manifest is not None
        with engine.gate.writing(what, self._bound_s):
            routed = engine.routed(self._manifest, engine.tp_size == 1)
            sink, direct = EngineSink(routed, engine.device), routed.routes.direct
            for name, tensor in staged:
                if name in direct:
                    write_verified(sink.target(name), name, tensor)
            if loaded := [(n, t) for n, t in staged if n not in direct]:
                engine.loader()(iter(loaded))
            sink.finish([n for n, _ in staged if n in direct])
        self._applied(self._step)


def write_verified(target: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    """Write verified ``tensor`` into parameter memory ``target``; refused naming the
    tensor when the bits that landed are not those."""
    staged = tensor.to(target.device)  # the verified bits on the parameter's device
    target.copy_(staged.reshape(target.shape))
    # Compared where the parameter lives: a GPU engine reads nothing back to the host.
    if not torch.equal(_bytes(target), _bytes(staged)):
        raise RefitError(
            f"{name!r} in parameter memory differs from the verified bits after the write "
            f"(CRC-32 {_checksum(target):#010x}, verified {_checksum(tensor):#010x})"
        )


class SparseBackend:
    """``sparse``: this engine worker's relay receiver (one, started by ``init``)."""

    def __init__(self, engine: EngineContext) -> None:
        self.engine = engine
        self.receiver: SparseReceiver | None = None
        self.state = SparseEngineState()
        self.lock = threading.Lock()

    def init(
        self,
        host: str = "127.0.0.1",
        allow_remote: bool = False,
        relay_addresses: Sequence[str] | bool | None = False,
    ) -> str:
        """Start the receiver (once; later calls return the same address): the address a
        sender or a parent relay node sends to. ``relay_addresses=[...]`` instead: take
        only steps planned over exactly those receivers (``None``: any plan naming it)."""
        if relay_addresses is not False:
            return self._configure(relay_addresses)
        with self.lock:
            if self.receiver is None:
                target = EngineTarget(self.engine, self._applied)
                try:
                    receiver = SparseReceiver(
                        target, host=str(host), allow_remote=bool(allow_remote),
                        on_diverge=self._diverged,
                    )  # fmt: skip
                except zmq.ZMQError as e:  # e.g. a port in use, told as a typed error
                    raise RefitError(f"the sparse relay could not bind {host}: {e}") from e
                self.receiver = receiver.start()
            return self.receiver.address

    def _configure(self, addresses: Sequence[str] | bool | None) -> str:
        if self.receiver is None:
            raise EngineStateError("configure the sparse relay after starting it")
        if isinstance(addresses, bool):
            raise BadArgumentError(f"relay_addresses must be a list or None, got {addresses!r}")
        self.receiver.expect_relay(None if addresses is None else list(addresses))
        return self.receiver.address

    def receive(self, timeout_s: float | None = None) -> dict[str, object]:
        raise EngineStateError("sparse steps arrive on the relay's thread: read status")

    def status(self, detail: str = "") -> Mapping[str, object]:
        """What the worker checks before serving: the receiver's address, the sparse
        steps applied, the last one's number, frames taken per step, and why the weights
        diverged ('' when they did not, or a full refit came after). ``"checksums"``:
        CRC-32 of each tensor of the last applied step as this engine holds it instead."""
        if detail == "checksums":
            return self._checksums()
        if detail:
            raise BadArgumentError(f"sparse status takes '' or 'checksums', got {detail!r}")
        receiver = self.receiver
        address = None if receiver is None else receiver.address
        with self.lock:
            frames = {} if receiver is None else receiver.frames_received
            return self.state.status(self.engine.version, address, frames)

    def _checksums(self) -> dict[str, int]:
        if self.receiver is None:
            return {}
        params = self.engine.params()
        routed = self.engine.routed_last
        direct = routed.routes.direct if routed is not None else frozenset()
        return {
            name: _checksum(params[name]) if name in direct else tensor_checksum(bits)
            for name, bits in self.receiver.verified_bits().items()
        }

    def release(self) -> int:
        return 0  # the receiver's bits are its own copy

    def close(self) -> int:
        with self.lock:
            receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()
        return int(receiver is not None)

    def _applied(self, step: int) -> None:
        with self.lock:
            self.state.took(step)

    def _diverged(self, why: str) -> None:
        with self.lock:
            self.state.diverge(why, self.engine.version)
