"""The receiving side of a refit, independent of the transport.

Theory of operation
-------------------
A :class:`ReceiveSession` turns one refit's messages into weights. Per message:

- ``Begin``: the manifest digest is compared, then **answered** (ok or an error).
- ``BucketMsg``: the header is **prechecked** against the manifest (``check_bucket``),
  then the payload is mapped or received, verified (length, optional checksum), and
  handed to the :class:`RefitSink`, which copies the tensors it can place directly and
  returns the rest (copies, never views of the transport's buffer) for the engine's
  weight loader. After a device sync the bucket is **answered**, so the sender may reuse
  its buffer, and only then are the deferred tensors yielded to the loader.
- ``Complete``: completeness is prechecked (every expected tensor arrived exactly once);
  the session stream ends; the caller's loader finishes, :meth:`ReceiveSession.conclude`
  runs post-load processing and a sync and answers last.
- ``Abort``: acknowledged; the session raises.

Direct refits (:mod:`~genworker.shell.refit.direct`): a ``Begin`` that lists the whole
stream is checked against the manifest at once; when the sink has a direct target for
every manifest tensor the transport agrees to go direct (:meth:`ReceiverTransport.
answer_begin`), and a single ``DirectMsg`` then ends the refit: its list is checked
again, the transport fills the targets (:meth:`ReceiverTransport.fill_direct`), the sink
marks them written, and ``conclude`` runs post-load processing and answers as for
``Complete``. The sender may still send buckets after an offer (it could not use it).

The transport decides what "precheck" and "answer" mean: over ZMQ an answer is the reply
to the pending request and a precheck replies only when it fails; over a collective both
are status rounds in which every rank reports. Either way the peer always learns the
outcome (failure-modes R1/C1), and every failure raises a typed
:class:`~genworker.shell.errors.RefitError` on this side too.

The stream never raises into the loader: on a failure it reports, records the error and
ends, so vLLM's layerwise reload (``vllm/model_executor/model_loader/reload``, 0.32) can
restore its layers before :meth:`ReceiveSession.conclude` raises. A loader failure that
happens while the stream is suspended is reported at the next message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

import attrs
import torch
from returns.result import Failure, Result

from genworker.core.refit_plan import (
    Manifest,
    ManifestError,
    ReceiveProgress,
    Slot,
    TensorSpec,
    bucket_checksum,
    check_bucket,
    check_complete,
)
from genworker.shell.errors import RefitError, RefitManifestError
from genworker.shell.refit.direct import listing_problem
from genworker.shell.refit.packing import Laps
from genworker.shell.refit.wire import (
    Abort,
    Begin,
    BucketMsg,
    Complete,
    DirectMsg,
    Message,
    bucket_from_wire,
)

__all__ = [
    "Loader",
    "ParameterSink",
    "ReceiveSession",
    "ReceiverTransport",
    "RefitReport",
    "RefitSink",
    "bucket_views",
    "manifest_of",
    "receive_refit",
]

Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


@attrs.frozen
class RefitReport:
    """What one refit moved, for logs and for the caller's return value."""

    tensors: int
    nbytes: int
    buckets: int
    seconds: float
    direct: int
    loaded: int
    mode: str = "buckets"
    #: seconds per step on this side: ``begin`` (the Begin checked and answered),
    #: ``wait`` (for the trainer's messages), ``copy`` / ``sync`` (a direct refit's
    #: fill and device sync), ``buckets`` (storing buckets, loading what they defer),
    #: ``load`` (the loader's tail), ``finalize`` (post-load processing), ``answer``
    #: (the last reply)
    phases: Mapping[str, float] = attrs.field(factory=dict)

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9

    def as_dict(self) -> dict[str, object]:
        return {
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "buckets": self.buckets,
            "seconds": self.seconds,
            "direct": self.direct,
            "loaded": self.loaded,
            "mode": self.mode,
            "phases": dict(self.phases),
        }


class RefitSink(Protocol):
    """Where received tensors go: straight into parameters, or back to a weight loader."""

    @property
    def device(self) -> torch.device: ...

    def store(self, items: Sequence[tuple[Slot, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Copy what can be placed directly; return owned copies of the rest, in order."""
        ...

    def synchronize(self) -> None:
        """Wait until every copy issued by :meth:`store` has finished."""
        ...

    def finalize(self) -> None:
        """Post-load processing once every tensor arrived, then a device sync."""
        ...

    def direct_targets(self, manifest: Manifest) -> Mapping[str, torch.Tensor] | None:
        """A contiguous tensor to write for every manifest tensor, or None (buckets)."""
        ...

    def written(self, names: Sequence[str]) -> None:
        """``names`` were written straight into their targets (for post-load processing)."""
        ...


class ReceiverTransport(Protocol):
    """One side of a refit channel, as :class:`ReceiveSession` drives it."""

    @property
    def peer(self) -> str: ...

    def next_message(self, timeout_s: float) -> Message: ...

    def precheck(self, problem: RefitError | None, timeout_s: float) -> None:
        """Report a header's verdict before its payload; raise if anyone failed."""
        ...

    def answer(self, problem: RefitError | None, timeout_s: float) -> None:
        """Report a message's final verdict; raise if anyone failed."""
        ...

    def acknowledge_abort(self, timeout_s: float) -> None: ...

    def answer_begin(
        self,
        problem: RefitError | None,
        targets: Mapping[str, torch.Tensor] | None,
        timeout_s: float,
    ) -> bool:
        """Answer a ``Begin``, offering a direct refit into ``targets`` when given; raise
        if anyone failed; True when a ``DirectMsg`` may follow."""
        ...

    def fill_direct(
        self, msg: DirectMsg, targets: Mapping[str, torch.Tensor], timeout_s: float
    ) -> str:
        """Make ``targets`` hold the tensors ``msg`` lists (already checked); the mode."""
        ...

    def payload(self, msg: BucketMsg, timeout_s: float) -> torch.Tensor:
        """The bucket's bytes as a uint8 tensor of at least ``used_bytes``."""
        ...

    def release(self) -> None:
        """Drop mapped or received buffers at the end of a refit."""
        ...


def bucket_views(buffer: torch.Tensor, slots: Iterable[Slot]) -> list[tuple[Slot, torch.Tensor]]:
    """Each slot's bytes viewed in place as its dtype and shape."""
    return [
        (s, buffer[s.offset : s.end].view(getattr(torch, s.dtype)).view(s.shape)) for s in slots
    ]


def manifest_of(tensors: Mapping[str, torch.Tensor]) -> Manifest:
    return Manifest.from_specs(TensorSpec.of(n, t) for n, t in tensors.items()).unwrap()


class ParameterSink:
    """Copies every tensor straight into a preallocated tensor of the same name."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._params = params
        first = next(iter(params.values()), None)
        self._device = first.device if first is not None else torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self._device

    def store(self, items: Sequence[tuple[Slot, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        for slot, view in items:
            target = self._params.get(slot.name)
            if target is None or TensorSpec.of(slot.name, target) != slot.spec:
                raise RefitManifestError(f"no parameter {slot.name!r} of {slot.spec.describe()}")
            target.copy_(view, non_blocking=True)
        return []

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def finalize(self) -> None:
        self.synchronize()

    def direct_targets(self, manifest: Manifest) -> Mapping[str, torch.Tensor] | None:
        targets = {s.name: self._params.get(s.name) for s in manifest.specs}
        for spec in manifest.specs:
            target = targets[spec.name]
            if target is None or TensorSpec.of(spec.name, target) != spec:
                return None
            if not target.is_contiguous():
                return None
        return targets  # type: ignore[return-value]

    def written(self, names: Sequence[str]) -> None:
        return None


def _as_refit_error(error: BaseException, context: str) -> RefitError:
    if isinstance(error, RefitError):
        return error
    wrapped = RefitError(f"{context}: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


class ReceiveSession:
    """One refit on the receiving side; see the module docstring for the protocol."""

    def __init__(
        self,
        transport: ReceiverTransport,
        manifest: Manifest,
        sink: RefitSink,
        *,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._t = transport
        self._manifest = manifest
        self._sink = sink
        self._timeout = timeout_s
        self._clock = clock
        self._started = clock()
        self._laps = Laps(clock)
        self._progress = ReceiveProgress()
        self._refit_id: str | None = None
        self._complete = False
        self._direct = 0
        self._loaded = 0
        self._mode = "buckets"
        self._targets: Mapping[str, torch.Tensor] | None = None
        self.error: RefitError | None = None

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive the refit; yield the tensors the sink left for the weight loader."""
        try:
            yield from self._run()
        except RefitError as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - a bug on our side still ends the refit typed
            self.error = _as_refit_error(e, f"receiving the refit from {self._t.peer} failed")

    def conclude(self, loader_error: BaseException | None = None) -> RefitReport:
        """Finish after the loader returned: finalize and answer, or report and raise."""
        try:
            if self.error is not None:
                raise self.error
            if loader_error is not None:
                self._report_late(
                    _as_refit_error(loader_error, "loading the received weights failed")
                )
            if not self._complete:
                self._report_late(RefitError("the weight loader stopped before the refit ended"))
            problem = None
            self._laps.lap("load")
            try:
                self._sink.finalize()
            except Exception as e:  # noqa: BLE001 - answered to the peer as a typed error
                problem = _as_refit_error(e, "post-load processing failed")
            self._laps.lap("finalize")
            self._t.answer(problem, self._timeout)
            self._laps.lap("answer")
            return RefitReport(
                tensors=len(self._progress.received),
                nbytes=self._progress.nbytes,
                buckets=self._progress.buckets,
                seconds=self._clock() - self._started,
                direct=self._direct,
                loaded=self._loaded,
                mode=self._mode,
                phases=dict(self._laps.seconds),
            )
        finally:
            self._t.release()

    def _report_late(self, error: RefitError) -> None:
        if self._complete:
            self._t.answer(error, self._timeout)
        else:
            msg = self._t.next_message(self._timeout)
            if isinstance(msg, Abort):
                self._t.acknowledge_abort(self._timeout)
            else:
                self._t.precheck(error, self._timeout)
        raise error

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._begin(self._t.next_message(self._timeout))
        while True:
            msg = self._t.next_message(self._timeout)
            self._laps.lap("wait")
            if isinstance(msg, Abort):
                self._t.acknowledge_abort(self._timeout)
                raise RefitError(f"the trainer at {self._t.peer} aborted the refit: {msg.message}")
            if isinstance(msg, DirectMsg):
                if (
                    self._targets is None
                    or msg.refit_id != self._refit_id
                    or self._progress.buckets
                ):
                    stray = RefitError(
                        f"a direct refit {msg.refit_id!r} from {self._t.peer} that this "
                        f"engine worker did not agree to (refit {self._refit_id!r})"
                    )
                    self._t.precheck(stray, self._timeout)
                    raise stray
                self._direct_refit(msg)
                return
            if isinstance(msg, Begin) and self._progress.buckets == 0:
                # The trainer gave up on its first Begin (a timeout) and started over.
                self._begin(msg)
                continue
            if msg.refit_id != self._refit_id or isinstance(msg, Begin):
                stray = RefitError(
                    f"a {type(msg).__name__} of refit {msg.refit_id!r} arrived during refit "
                    f"{self._refit_id!r} from {self._t.peer}"
                )
                self._t.precheck(stray, self._timeout)
                raise stray
            if isinstance(msg, Complete):
                incomplete = _manifest_problem(check_complete(self._manifest, self._progress))
                self._t.precheck(incomplete, self._timeout)
                if incomplete is not None:
                    raise incomplete
                self._complete = True
                return
            yield from self._bucket(msg)
            self._laps.lap("buckets")

    def _begin(self, begin: Message) -> None:
        self._started = self._clock()
        self._laps = Laps(self._clock)
        if not isinstance(begin, Begin):
            problem: RefitError | None = RefitError(
                f"expected the start of a refit from {self._t.peer}, got {type(begin).__name__}"
            )
        elif begin.manifest_digest not in ("", self._manifest.digest()):
            problem = RefitManifestError(
                f"the trainer at {self._t.peer} sends a different manifest than the one "
                "given to prepare_refit_info (names, shapes or dtypes differ)"
            )
        else:
            problem = None
            self._refit_id = begin.refit_id
        self._targets = None
        if not isinstance(begin, Begin) or begin.direct is None:
            self._t.answer(problem, self._timeout)
            if problem is not None:
                raise problem
            return
        problem = problem or listing_problem(self._manifest, begin.direct)
        targets = self._sink.direct_targets(self._manifest) if problem is None else None
        if self._t.answer_begin(problem, targets, self._timeout):
            self._targets = targets
        self._laps.lap("begin")

    def _direct_refit(self, msg: DirectMsg) -> None:
        assert self._targets is not None
        problem = listing_problem(self._manifest, msg.tensors)
        if problem is None:
            try:
                mode = self._t.fill_direct(msg, self._targets, self._timeout)
                self._laps.lap("copy")
                self._sink.written([t.name for t in msg.tensors])
                self._sink.synchronize()
                self._laps.lap("sync")
            except Exception as e:  # noqa: BLE001 - answered to the peer as a typed error
                problem = _as_refit_error(e, "the direct refit could not be stored")
        if problem is not None:
            self._t.precheck(problem, self._timeout)
            raise problem
        # the listing matched the manifest: every manifest tensor arrived, exactly once
        names = frozenset(self._manifest.names)
        self._progress = ReceiveProgress(received=names, nbytes=self._manifest.total_bytes)
        self._direct = len(names)
        self._mode = mode
        self._complete = True

    def _verified_payload(self, msg: BucketMsg) -> torch.Tensor:
        buffer = self._t.payload(msg, self._timeout)
        _check_payload(msg, buffer)
        return buffer

    def _bucket(self, msg: BucketMsg) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            bucket = bucket_from_wire(msg)
        except RefitError as e:
            self._t.precheck(e, self._timeout)
            raise
        checked = check_bucket(self._manifest, self._progress, bucket)
        rejected = _manifest_problem(checked)
        self._t.precheck(rejected, self._timeout)
        if rejected is not None:
            raise rejected
        deferred: list[tuple[str, torch.Tensor]] = []
        problem = None
        try:
            buffer = self._verified_payload(msg)
            deferred = self._sink.store(bucket_views(buffer, bucket.slots))
            self._sink.synchronize()
            del buffer
        except Exception as e:  # noqa: BLE001 - answered to the peer as a typed error
            problem = _as_refit_error(e, f"refit bucket {msg.index} could not be stored")
        self._t.answer(problem, self._timeout)
        if problem is not None:
            raise problem
        self._progress = checked.unwrap()
        self._loaded += len(deferred)
        self._direct += len(bucket.slots) - len(deferred)
        yield from deferred


def _check_payload(msg: BucketMsg, buffer: torch.Tensor) -> None:
    if buffer.numel() < msg.used_bytes:
        raise RefitError(
            f"refit bucket {msg.index} declares {msg.used_bytes} bytes but its buffer "
            f"holds {buffer.numel()}"
        )
    if msg.checksum is not None:
        used = buffer[: msg.used_bytes].cpu()
        if bucket_checksum(used.numpy().data) != msg.checksum:
            raise RefitError(f"refit bucket {msg.index} failed its checksum")


def _manifest_problem(result: Result[ReceiveProgress, ManifestError]) -> RefitError | None:
    if isinstance(result, Failure):
        error = result.failure()
        return RefitManifestError(str(error), detail=error)
    return None


def _no_loader(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    for name, _ in weights:
        raise RefitError(f"tensor {name!r} needs a weight loader, and none was given")


def receive_refit(
    transport: ReceiverTransport,
    manifest: Manifest,
    sink: RefitSink,
    *,
    timeout_s: float,
    loader: Loader | None = None,
) -> RefitReport:
    """Receive one refit into ``sink``; deferred tensors go to ``loader`` (when given)."""
    session = ReceiveSession(transport, manifest, sink, timeout_s=timeout_s)
    loader_error: BaseException | None = None
    try:
        (loader or _no_loader)(session.stream())
    except Exception as e:  # noqa: BLE001 - reported to the peer, raised by conclude()
        loader_error = e
    return session.conclude(loader_error)
