"""The sparse relay's step rules as two pure machines (``shell/refit/sparse.py`` moves the
bytes and feeds them).

A step is ``Begin``, ``Frame``s and ``End``. :class:`StepSender` decides full or delta:
the first step, and every step after one not every receiver applied, is *full*; the
others are deltas against the last step every receiver applied (``synced_step``), which
the sender holds only after the verdict. :class:`StepReceiver` is one relay node:

- ``begin``: the step is taken (its frames forwarded to the children) when the node is in
  the step's relay; it is *refused* (kept, so its frames are still forwarded, but nothing
  applied) when the relay is not the one configured, the manifest is invalid, a delta
  finds no full step before it or another base or manifest, or the pieces carry another
  checksum. A full step resets the node's bits. A step still open when the next begins
  was replaced: the node diverges.
- ``frame``: a frame of another step is ignored; a corrupted one refuses the step and is
  not forwarded; the others are forwarded, and applied unless the step was refused.
- ``end``: the step commits (the verified bits go to the engine) only when nothing
  refused it, every frame arrived, every frame applied and checked, every tensor is
  covered piece by piece exactly once, and the end names this step; else the node
  diverges. ``committed`` takes the engine's answer; a failure there diverges too.
- ``idle``: a step open and quiet longer than its relay's bound (``hop_s`` x depth)
  diverges.

A node that diverged holds bits nobody can vouch for: it refuses every delta until a
full step (``needs_full``). Every divergence is returned as its reason, for the shell to
log and tell the engine.

*Frames.* :func:`encode_frame` turns a frame's pieces into the payload's wire forms with
each piece's hash of its bits after the step; :func:`apply_frame` applies a decompressed
payload's pieces into a receiver's bits and checks each against that hash (the codec's
loops come in as arguments, compiled or not).

*The wire.* Each message is a tag, a msgpack body against a fixed schema (no pickle) and,
for a frame, its compressed payload; :func:`read_begin`, :func:`read_frame`,
:func:`read_end` and :func:`read_report` take a body (or a report's parts) to a value or
a :class:`WireError`, the ``*_message`` functions build the parts.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Final

import attrs
import msgspec
import numpy as np
from returns.result import Failure, Result, Success

from genworker.core.delta import (
    MAX_CHUNK_ELEMENTS,
    Bits,
    DeltaError,
    Frame,
    FramePiece,
    NodeResult,
    Outcome,
    RelayFailure,
    RelayPlan,
    RelayReport,
    bits_dtype,
    encode_full,
    plan_relay,
    report_subtree,
)
from genworker.core.errors import CoreError
from genworker.core.refit_plan import DTYPE_ITEMSIZE, Manifest, TensorSpec

__all__ = [
    "CHECKSUM",
    "TAG_BEGIN",
    "TAG_END",
    "TAG_FRAME",
    "TAG_REPORT",
    "BeginMsg",
    "FrameAction",
    "FrameMsg",
    "FrameResult",
    "RelayArgumentError",
    "SparseDiverged",
    "SparseEngineState",
    "Started",
    "StepBegin",
    "StepFailed",
    "StepReceiver",
    "StepReport",
    "StepSender",
    "TokenBucket",
    "WireError",
    "WirePiece",
    "apply_frame",
    "baseline_bits",
    "baseline_layout",
    "begin_message",
    "check_relay_addresses",
    "check_relay_start",
    "check_tensors",
    "encode_frame",
    "end_message",
    "expected_relay",
    "frame_message",
    "fresh_bits",
    "node_answer",
    "read_begin",
    "read_end",
    "read_frame",
    "read_report",
    "relay_statuses",
    "report_message",
    "root_answer",
    "sender_settings",
    "sparse_steps",
    "step_manifest",
    "tiles",
    "token_bucket",
]

#: A manifest as a step's ``Begin`` carries it: (name, shape, dtype) in order.
StepManifest = tuple[tuple[str, tuple[int, ...], str], ...]


@attrs.frozen
class StepBegin:
    """A step's start as the receiver read it."""

    step: int
    base_step: int  # the step a delta applies to; -1 for a full step
    receivers: tuple[str, ...]
    fanout: int
    hop_s: float
    frames: int
    manifest: StepManifest
    checksum: str

    @property
    def full(self) -> bool:
        return self.base_step < 0


@attrs.frozen
class Started:
    """What the shell does with a ``Begin``: forward it (and the step's frames) to the
    node's children in ``plan``, start fresh bits for ``specs`` when ``full``;
    ``problem``: the step is refused."""

    plan: RelayPlan | None  # None: this node is not in the step's relay (no children)
    node: int
    full: bool
    specs: tuple[TensorSpec, ...]
    problem: str

    @property
    def children(self) -> dict[int, str]:
        """The node's children in the step's relay, their addresses by index (none outside
        it)."""
        if self.plan is None:
            return {}
        return {child: self.plan.receivers[child] for child in self.plan.children(self.node)}

    def deadlines(self, since: float, hop_s: float) -> dict[int, float]:
        """When each child's report is due: its own answer bound after ``since``."""
        if self.plan is None:
            return {}
        plan = self.plan
        return {child: since + plan.answer_bound_s(child, hop_s) for child in self.children}


class FrameAction(enum.Enum):
    IGNORE = "ignore"  # not this step's
    DROP = "drop"  # corrupted: not forwarded, the step refused
    FORWARD = "forward"  # forwarded only: the step was refused
    APPLY = "apply"  # forwarded and applied


@attrs.frozen
class FrameResult:
    """One applied frame: a problem, or the element ranges verified."""

    problem: str
    pieces: tuple[tuple[str, int, int], ...]


def tiles(ranges: Sequence[tuple[int, int]], numel: int) -> bool:
    """True when ``ranges`` cover ``[0, numel)`` back to back, each element once."""
    at = 0
    for start, stop in sorted(ranges):
        if start != at:
            return False
        at = stop
    return at == numel and (numel > 0 or len(ranges) == 1)


@attrs.define
class _Step:
    begin: StepBegin
    plan: RelayPlan | None
    specs: dict[str, TensorSpec]
    frames: set[int] = attrs.Factory(set)
    problem: str = ""


@attrs.define
class StepSender:
    """The trainer's end: which step comes next and what it applies to."""

    synced_step: int | None = None  # the step every receiver holds; None: full next
    step: int = 0

    def start(self) -> tuple[int, int]:
        """The next step's number and base (-1: full); nothing is synced until
        :meth:`conclude`."""
        self.step += 1
        base = -1 if self.synced_step is None else self.synced_step
        self.synced_step = None
        return self.step, base

    def conclude(self, applied: bool) -> None:
        """Every receiver applied the step (``applied``), or not: the next is full."""
        self.synced_step = self.step if applied else None

    def begin(
        self, plan: RelayPlan, hop_s: float, frames: int, manifest: Manifest, checksum: str
    ) -> StepBegin:
        """The next step's ``Begin`` (:meth:`start`) over ``plan``, in ``frames`` frames
        whose pieces carry ``checksum``."""
        step, base = self.start()
        fields = (step, base, plan.receivers, plan.fanout, hop_s, frames)
        return StepBegin(*fields, step_manifest(manifest), checksum)

    def finish(
        self,
        begin: StepBegin,
        verdict: Result[RelayReport, RelayFailure],
        model_bytes: int,
        wire_bytes: int,
        seconds: float,
    ) -> Result[StepReport, StepFailed]:
        """The step ``begin`` started, concluded (:meth:`conclude`) on the relay's
        ``verdict`` after ``seconds``: what it moved, or the receivers that did not apply
        it."""
        self.conclude(isinstance(verdict, Success))
        if isinstance(verdict, Failure):
            failure = verdict.failure()
            return Failure(
                StepFailed(
                    f"sparse refit step {begin.step} ({'full' if begin.full else 'delta'}) "
                    f"failed after {seconds:.2f} s: {failure}",
                    relay=failure,
                )
            )
        fields = (begin.step, begin.full, model_bytes, wire_bytes, begin.frames, seconds)
        return Success(StepReport(*fields, report=verdict.unwrap()))


@attrs.define
class StepReceiver:
    """One relay node's rules (see the module docstring)."""

    address: str
    checksum: str  # the pieces' checksum this node checks
    synced_step: int | None = None  # None: needs a full step before any delta
    relay: tuple[str, ...] | None = None  # the configured relay; None: any naming it
    last_problem: str = ""
    frames_taken: dict[int, int] = attrs.Factory(dict)  # step -> frames forwarded
    _manifest: StepManifest = ()
    _step: _Step | None = None

    @property
    def needs_full(self) -> bool:
        return self.synced_step is None

    @property
    def open_step(self) -> int | None:
        return None if self._step is None else self._step.begin.step

    def _diverge(self, why: str) -> str:
        self.synced_step, self.last_problem = None, why
        return why

    def replace(self) -> str:
        """A ``Begin`` came (readable or not): why the open step it replaced diverged."""
        current, self._step = self._step, None
        if current is None:
            return ""
        return self._diverge(f"step {current.begin.step} was replaced before its end")

    def begin(self, begin: StepBegin) -> tuple[Started, str]:
        """Take a ``Begin``: what to do, and why a step it replaced diverged ('')."""
        replaced = self.replace()
        planned = plan_relay(begin.receivers, begin.fanout)
        plan = planned.value_or(None)
        node = begin.receivers.index(self.address) if self.address in begin.receivers else -1
        step = self._step = _Step(begin, plan if node >= 0 else None, {})
        if step.plan is None:
            step.problem = f"is not in the step's relay ({planned})"
            return Started(None, node, False, (), step.problem), replaced
        if self.relay is not None and begin.receivers != self.relay:
            step.problem = (
                f"was configured into the relay {list(self.relay)!r}, but the step is planned "
                f"over {list(begin.receivers)!r}"
            )
        info = {name: (list(shape), dtype) for name, shape, dtype in begin.manifest}
        manifest = Manifest.from_info(info)
        if isinstance(manifest, Failure):
            step.problem = f"the step's manifest is invalid: {manifest.failure()}"
            return Started(step.plan, node, False, (), step.problem), replaced
        step.specs = {s.name: s for s in manifest.unwrap().specs}
        full = begin.full
        step.problem = step.problem or self._delta_problem(begin, full)
        if full:
            self._manifest, self.synced_step = begin.manifest, None
        if begin.checksum != self.checksum:
            step.problem = step.problem or (
                f"the step's pieces carry {begin.checksum!r} checksums, this receiver checks "
                f"{self.checksum!r} (the sender and the receivers run different versions)"
            )
        specs = tuple(step.specs.values())
        return Started(step.plan, node, full, specs, step.problem), replaced

    def _delta_problem(self, begin: StepBegin, full: bool) -> str:
        if full:
            return ""
        if self.synced_step is None:
            return f"needs a full refit before a delta ({self.last_problem})"
        if self.synced_step != begin.base_step:
            return f"holds step {self.synced_step}, but the delta applies to step {begin.base_step}"
        if begin.manifest != self._manifest:
            return "the delta's manifest differs from the one of the last full step"
        return ""

    def refuse(self, problem: str) -> None:
        """Refuse the open step (a malformed message, say); its first problem stays."""
        if self._step is not None:
            self._step.problem = self._step.problem or problem

    def frame(self, step: int, index: int, intact: bool) -> FrameAction:
        """A frame of ``step`` (``intact``: its payload passed its CRC)."""
        current = self._step
        if current is None or step != current.begin.step:
            return FrameAction.IGNORE
        if not intact:
            self.refuse(
                f"frame {index} of step {step} failed its CRC: the payload was corrupted on "
                "the way (not forwarded, nothing applied)"
            )
            return FrameAction.DROP
        current.frames.add(index)
        return FrameAction.FORWARD if current.problem else FrameAction.APPLY

    def take_frame(self, header: FrameMsg, payload: bytes | memoryview) -> FrameAction:
        """A ``Frame`` message (its read ``header``, its compressed ``payload``): what to do
        with it (:meth:`frame`, the payload checked against its CRC-32), the frames
        forwarded counted per step in ``frames_taken``."""
        action = self.frame(header.step, header.index, zlib.crc32(payload) == header.crc)
        if action in (FrameAction.FORWARD, FrameAction.APPLY):
            self.frames_taken[header.step] = self.frames_taken.get(header.step, 0) + 1
        return action

    def end(self, step: int, results: Sequence[FrameResult]) -> tuple[str, str]:
        """The open step's end (naming ``step``) with its frames' results: its problem
        ('' to commit: hand the verified bits to the engine, then :meth:`committed`) and
        the reason the node diverged ('')."""
        current, self._step = self._step, None
        assert current is not None, "end without an open step"
        problem = current.problem
        for result in results:
            problem = problem or result.problem
        if not problem and step != current.begin.step:
            problem = "its end named another step"
        if not problem and len(current.frames) != current.begin.frames:
            problem = f"took {len(current.frames)} of the step's {current.begin.frames} frames"
        covered: dict[str, list[tuple[int, int]]] = {name: [] for name in current.specs}
        for result in results:
            for name, start, stop in result.pieces:
                covered[name].append((start, stop))
        unverified = [n for n, s in current.specs.items() if not tiles(covered[n], s.numel)]
        if not problem and unverified:
            problem = f"has no verified bits for all of {unverified[:12]}"
        if problem:
            return problem, self._diverge(f"step {current.begin.step} refused: {problem}")
        return "", ""

    def take_end(self, body: bytes, results: Sequence[FrameResult]) -> tuple[str, str]:
        """An ``End`` message of the open step, with its frames' results: as :meth:`end`
        (a malformed one refuses the step, taken as naming it)."""
        named = read_end(body)
        if isinstance(named, Failure):
            self.refuse(str(named.failure()))
        assert self._step is not None, "end without an open step"
        return self.end(named.value_or(self._step.begin.step), results)

    def committed(self, step: int, problem: str = "") -> str:
        """The engine took step ``step`` ('') or failed (``problem``): why the node
        diverged, or ''."""
        if problem:
            return self._diverge(f"step {step} refused: {problem}")
        self.synced_step = step
        return ""

    def idle(self, seconds: float) -> str:
        """``seconds`` without a message: why the open step diverged, or ''."""
        current = self._step
        if current is None:
            return ""
        bound = current.begin.hop_s * (current.plan.depth if current.plan else 1)
        if seconds <= bound:
            return ""
        self._step = None
        return self._diverge(f"step {current.begin.step} stopped mid-way for {bound:g} s")


def sender_settings(
    hop_s: float, frame_bytes: int, workers: int, chunk_elements: int
) -> Result[None, CoreError]:
    """A sender's settings checked: ``hop_s``, ``frame_bytes`` and ``workers`` positive,
    ``chunk_elements`` in ``[1, MAX_CHUNK_ELEMENTS]``; refused naming them."""
    if not hop_s > 0 or frame_bytes < 1 or workers < 1:
        return Failure(
            CoreError(
                f"hop_s, frame_bytes and workers must be positive, got {hop_s!r}, "
                f"{frame_bytes!r}, {workers!r}"
            )
        )
    if not 1 <= chunk_elements <= MAX_CHUNK_ELEMENTS:
        return Failure(
            CoreError(
                f"chunk_elements must be in [1, {MAX_CHUNK_ELEMENTS}], got {chunk_elements!r}"
            )
        )
    return Success(None)


def baseline_layout(specs: Sequence[TensorSpec], align: int = 64) -> tuple[dict[str, int], int]:
    """Where each tensor's bits start in a baseline's one buffer (each at a multiple of
    ``align`` bytes), and the buffer's size."""
    offsets: dict[str, int] = {}
    total = 0
    for spec in specs:
        offsets[spec.name] = total
        total += -(-spec.nbytes // align) * align
    return offsets, total


def baseline_bits(specs: Sequence[TensorSpec], storage: Bits) -> dict[str, Bits]:
    """Each tensor's bits as a 1-D view of ``storage`` (bytes, :func:`baseline_layout`'s
    size) at its offset, of its element width."""
    offsets, _ = baseline_layout(specs)
    return {
        s.name: storage[offsets[s.name] : offsets[s.name] + s.nbytes].view(
            bits_dtype(DTYPE_ITEMSIZE[s.dtype])
        )
        for s in specs
    }


@attrs.frozen
class StepFailed(CoreError):
    """A step not every receiver applied; ``relay`` names each one."""

    relay: RelayFailure


@attrs.frozen
class StepReport:
    """What one step moved: its kind, the model's bytes, the bytes on the wire, the time."""

    step: int
    full: bool
    model_bytes: int
    wire_bytes: int
    frames: int
    seconds: float
    report: RelayReport

    @property
    def wire_fraction(self) -> float:
        return self.wire_bytes / self.model_bytes if self.model_bytes else 0.0


def node_answer(
    name: str,
    problem: str,
    started: Started,
    children: Mapping[int, RelayReport],
    hop_s: float,
) -> RelayReport:
    """Node ``name``'s answer to its parent at a step's end: its own result (refused with
    ``problem``, applied when that is '') and, in the step's relay, its children's reports
    (a child absent from ``children`` was silent)."""
    own = NodeResult(name, Outcome.REFUSED, problem) if problem else None
    own = own or NodeResult(name, Outcome.APPLIED)
    if started.plan is None:
        return RelayReport((own,))
    return report_subtree(started.plan, started.node, own, children, hop_s)


def expected_relay(
    receivers: Sequence[str] | None, address: str
) -> Result[tuple[str, ...] | None, CoreError]:
    """The relay a receiver at ``address`` is configured into (``None``: any plan naming
    it); refused when ``receivers`` are not distinct non-empty names including it."""
    if receivers is None:
        return Success(None)
    names = plan_relay(receivers, 1)
    if isinstance(names, Failure):
        return Failure(CoreError(f"relay_addresses: {names.failure()}"))
    if address not in names.unwrap().receivers:
        return Failure(
            CoreError(
                f"relay_addresses {list(receivers)!r} do not include this receiver's "
                f"address {address!r}"
            )
        )
    return Success(names.unwrap().receivers)


def fresh_bits(specs: Sequence[TensorSpec]) -> dict[str, Bits]:
    """A full step's starting bits: zeros, one 1-D bit array per tensor of ``specs``."""
    return {s.name: np.zeros(s.numel, dtype=bits_dtype(DTYPE_ITEMSIZE[s.dtype])) for s in specs}


@attrs.define
class SparseEngineState:
    """What an engine's sparse backend tells its worker: the steps ``applied`` into the
    engine, the sender's number of the last one (``step``), and why the weights
    ``diverged`` ('' when they can be vouched for) at the engine's IPC/collective refit
    count ``diverged_at``."""

    applied: int = 0
    step: int | None = None
    diverged: str = ""
    diverged_at: int = -1

    def took(self, step: int) -> None:
        self.applied, self.step, self.diverged = self.applied + 1, step, ""

    def diverge(self, why: str, version: int) -> None:
        self.diverged, self.diverged_at = why, version

    def status(
        self, version: int, address: str | None, frames: Mapping[int, int]
    ) -> dict[str, object]:
        """The backend's status at the engine's refit count ``version``: a divergence is
        forgotten once an IPC/collective refit replaced every weight since."""
        if self.diverged and version != self.diverged_at:
            self.diverged = ""
        return {
            "address": address,
            "applied": self.applied,
            "step": self.step,
            "diverged": self.diverged,
            "frames": dict(frames),
        }


@attrs.define
class TokenBucket:
    """A token bucket: ``rate`` bytes a second, at most ``burst`` bytes saved up
    (``tokens`` at time ``at``)."""

    rate: float
    burst: float
    tokens: float
    at: float

    def take(self, now: float, nbytes: int) -> float:
        """Spend ``nbytes`` at time ``now``: the seconds to wait before they may go."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= nbytes
        return max(0.0, -self.tokens / self.rate)


def token_bucket(bits_per_s: float, burst_bytes: int, now: float) -> Result[TokenBucket, CoreError]:
    """A full bucket of ``bits_per_s`` with a burst of ``burst_bytes``, from ``now``."""
    if not bits_per_s > 0 or burst_bytes < 1:
        return Failure(
            CoreError(
                f"a link throttle needs bits_per_s > 0 and burst_bytes >= 1, got "
                f"{bits_per_s!r} and {burst_bytes!r}"
            )
        )
    return Success(TokenBucket(bits_per_s / 8, float(burst_bytes), float(burst_bytes), now))


def step_manifest(manifest: Manifest) -> StepManifest:
    """``manifest`` as a step's ``Begin`` carries it."""
    return tuple((s.name, s.shape, s.dtype) for s in manifest.specs)


def check_tensors(
    manifest: Manifest, specs: Mapping[str, TensorSpec | None]
) -> Result[None, CoreError]:
    """A step's tensors checked against ``manifest``: refused naming each missing,
    misshaped or unknown one (the first 12; ``specs``: each given tensor's spec by name,
    ``None`` for a name outside the manifest)."""
    problems = []
    for spec in manifest.specs:
        got = specs.get(spec.name)
        if got is None:
            problems.append(f"{spec.name!r} is missing")
        elif got != spec:
            problems.append(f"{spec.name!r} is {got.describe()}, expected {spec.describe()}")
    extra = sorted(set(specs) - set(manifest.names))
    problems.extend(f"{name!r} is not in the manifest" for name in extra)
    if problems:
        message = "sparse refit tensors do not match the manifest: " + "; ".join(problems[:12])
        return Failure(CoreError(message))
    return Success(None)


# --- the wire ------------------------------------------------------------------------

TAG_BEGIN: Final = b"begin"
TAG_FRAME: Final = b"frame"
TAG_END: Final = b"end"
TAG_REPORT: Final = b"report"

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class BeginMsg(msgspec.Struct, frozen=True):
    step: NonNegative
    base_step: int  # the step whose bits a delta applies to; -1 for a full step
    receivers: list[str]
    fanout: Annotated[int, msgspec.Meta(ge=1)]
    hop_s: Annotated[float, msgspec.Meta(gt=0)]
    frames: NonNegative
    manifest: dict[str, tuple[list[NonNegative], str]]
    chunk_elements: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_ELEMENTS)]
    # the pieces' checksum; a sender from before it was named sent CRC-32s
    checksum: str = "crc32"


class WirePiece(msgspec.Struct, array_like=True, frozen=True):
    name: str
    start: NonNegative
    stop: NonNegative
    nbytes: NonNegative  # of this piece's delta wire form in the decompressed payload
    checksum: NonNegative  # bits_hash of the piece's elements after the step


class FrameMsg(msgspec.Struct, frozen=True):
    step: NonNegative
    index: NonNegative
    crc: NonNegative  # of the compressed payload
    raw_bytes: NonNegative
    pieces: list[WirePiece]


class _EndMsg(msgspec.Struct, frozen=True):
    step: NonNegative


class _WireResult(msgspec.Struct, array_like=True, frozen=True):
    name: str
    outcome: str
    detail: str


class _ReportMsg(msgspec.Struct, frozen=True):
    step: NonNegative
    results: list[_WireResult]


_enc: Final = msgspec.msgpack.Encoder()
_begin_dec: Final = msgspec.msgpack.Decoder(BeginMsg)
_frame_dec: Final = msgspec.msgpack.Decoder(FrameMsg)
_end_dec: Final = msgspec.msgpack.Decoder(_EndMsg)
_report_dec: Final = msgspec.msgpack.Decoder(_ReportMsg)
_MALFORMED: Final = (msgspec.DecodeError, msgspec.ValidationError)


@attrs.frozen
class WireError(CoreError):
    """A message body that does not fit its schema."""


def begin_message(begin: StepBegin, chunk_elements: int) -> list[bytes]:
    """A step's ``Begin`` as parts (``chunk_elements``: the codec's, for the receivers)."""
    msg = BeginMsg(
        step=begin.step,
        base_step=begin.base_step,
        receivers=list(begin.receivers),
        fanout=begin.fanout,
        hop_s=begin.hop_s,
        frames=begin.frames,
        manifest={name: (list(shape), dtype) for name, shape, dtype in begin.manifest},
        chunk_elements=chunk_elements,
        checksum=begin.checksum,
    )
    return [TAG_BEGIN, _enc.encode(msg)]


def read_begin(body: bytes) -> Result[StepBegin, WireError]:
    try:
        msg = _begin_dec.decode(body)
    except _MALFORMED as e:
        return Failure(WireError(f"malformed begin: {e}"))
    manifest = tuple((n, tuple(shape), dtype) for n, (shape, dtype) in msg.manifest.items())
    fields = (msg.step, msg.base_step, tuple(msg.receivers), msg.fanout, msg.hop_s)
    return Success(StepBegin(*fields, msg.frames, manifest, msg.checksum))


def frame_message(
    step: int, index: int, pieces: list[WirePiece], raw_bytes: int, payload: bytes
) -> list[bytes]:
    """Frame ``index`` of ``step`` as parts: its header (``payload``'s CRC-32, the
    decompressed size ``raw_bytes``, the ``pieces``) and the compressed ``payload``."""
    header = FrameMsg(step, index, zlib.crc32(payload), raw_bytes, pieces)
    return [TAG_FRAME, _enc.encode(header), payload]


def read_frame(body: bytes) -> Result[FrameMsg, WireError]:
    try:
        return Success(_frame_dec.decode(body))
    except _MALFORMED as e:
        return Failure(WireError(f"a malformed frame header: {e}"))


def end_message(step: int) -> list[bytes]:
    return [TAG_END, _enc.encode(_EndMsg(step))]


def read_end(body: bytes) -> Result[int, WireError]:
    """The step an ``End`` names."""
    try:
        return Success(_end_dec.decode(body).step)
    except _MALFORMED as e:
        return Failure(WireError(f"a malformed end: {e}"))


def report_message(step: int, report: RelayReport) -> list[bytes]:
    results = [_WireResult(r.name, r.outcome.value, r.detail) for r in report.results]
    return [TAG_REPORT, _enc.encode(_ReportMsg(step, results))]


def read_report(parts: Sequence[bytes]) -> tuple[int, RelayReport] | None:
    """A ``[report, body]`` message as (step, report); ``None`` when it is not one."""
    if len(parts) != 2 or parts[0] != TAG_REPORT:
        return None
    try:
        msg = _report_dec.decode(parts[1])
        results = tuple(NodeResult(r.name, Outcome(r.outcome), r.detail) for r in msg.results)
    except (*_MALFORMED, ValueError):
        return None
    return msg.step, RelayReport(results)


def root_answer(parts: Sequence[bytes], step: int, root: str) -> RelayReport | None:
    """What the relay ``root``'s message ``parts`` tells the sender of ``step``: its
    report, the root refused when it is not a report, or ``None`` for a report of another
    step (an earlier one's, late)."""
    got = read_report(parts)
    if got is None:
        return RelayReport((NodeResult(root, Outcome.REFUSED, "sent a malformed report"),))
    return got[1] if got[0] == step else None


# --- frames ------------------------------------------------------------------------

#: The pieces' checksum this code computes and checks (``BeginMsg.checksum``).
CHECKSUM: Final = "gwh64"

EncodeWire = Callable[[Bits, Bits, int], bytes]
ApplyWire = Callable[[Bits, memoryview], Result[None, DeltaError]]
PieceHash = Callable[[Bits], int]


def encode_frame(
    frame: Frame,
    new: Mapping[str, Bits],
    old: Callable[[str], Bits] | None,
    chunk_elements: int,
    encode_wire: EncodeWire,
    piece_hash: PieceHash,
) -> tuple[bytes, list[WirePiece], tuple[tuple[FramePiece, bytes], ...]]:
    """A frame's raw payload, its pieces as ``Frame`` messages name them, and each piece's
    wire form: ``RAW`` chunks of ``new`` (``old`` is ``None``: a full step), else the
    delta from ``old(name)``'s bits (the sender's baseline)."""
    parts: list[bytes] = []
    pieces: list[WirePiece] = []
    for piece in frame:
        bits = new[piece.name][piece.start : piece.stop]
        if old is None:
            data = encode_full(bits, chunk_elements).to_bytes()
        else:
            data = encode_wire(old(piece.name)[piece.start : piece.stop], bits, chunk_elements)
        parts.append(data)
        checksum = piece_hash(bits)
        pieces.append(WirePiece(piece.name, piece.start, piece.stop, len(data), checksum))
    return b"".join(parts), pieces, tuple(zip(frame, parts, strict=True))


def apply_frame(
    header: FrameMsg,
    raw: bytes,
    specs: Mapping[str, TensorSpec],
    bits: Mapping[str, Bits],
    apply_wire: ApplyWire,
    piece_hash: PieceHash,
) -> FrameResult:
    """Apply a frame's decompressed payload ``raw`` into ``bits`` piece by piece, each
    checked against the trainer's hash; the first problem, or the ranges verified."""
    if len(raw) != header.raw_bytes:
        return FrameResult(
            f"frame {header.index} decompressed to {len(raw)} bytes, not {header.raw_bytes}", ()
        )
    at = 0
    view = memoryview(raw)
    done: list[tuple[str, int, int]] = []
    for piece in header.pieces:
        where = f"{piece.name!r}[{piece.start}:{piece.stop}]"
        spec = specs.get(piece.name)
        if spec is None or not 0 <= piece.start <= piece.stop <= spec.numel:
            return FrameResult(f"frame {header.index} names {where}, not in the manifest", ())
        target = bits[piece.name][piece.start : piece.stop]
        applied = apply_wire(target, view[at : at + piece.nbytes])
        at += piece.nbytes
        if isinstance(applied, Failure):
            return FrameResult(f"{where}: {applied.failure()}", ())
        got = piece_hash(target)
        if got != piece.checksum:
            return FrameResult(
                f"{where} failed its checksum: {CHECKSUM} {got:#018x}, the trainer's "
                f"{piece.checksum:#018x} (this receiver's bits diverged)",
                (),
            )
        done.append((piece.name, piece.start, piece.stop))
    if at != len(raw):
        return FrameResult(f"frame {header.index} has {len(raw) - at} bytes past its pieces", ())
    return FrameResult("", tuple(done))


@attrs.frozen
class RelayArgumentError(CoreError):
    """An argument of the sync worker's relay calls that it does not take."""


def check_relay_start(
    host: object, allow_remote: object
) -> Result[tuple[str, bool], RelayArgumentError]:
    """``start_zmq_sparse_refit_relay``'s ``host`` (a str) and ``allow_remote`` (a bool)."""
    if not isinstance(host, str) or not isinstance(allow_remote, bool):
        message = f"host must be a str and allow_remote a bool, got {host!r} and {allow_remote!r}"
        return Failure(RelayArgumentError(message))
    return Success((host, allow_remote))


def check_relay_addresses(addresses: object) -> Result[list[object], RelayArgumentError]:
    """``configure_zmq_sparse_refit_relay``'s relay, a list of addresses (the root first)."""
    if isinstance(addresses, str) or not isinstance(addresses, Sequence):
        message = f"relay_addresses must be a list of addresses, got {addresses!r}"
        return Failure(RelayArgumentError(message))
    return Success(list(addresses))


def relay_statuses(statuses: object) -> Result[list[dict[str, object]], CoreError]:
    """The engine workers' answers to ``sparse_relay_status``: a list of dicts, one each."""
    if not isinstance(statuses, list) or not all(isinstance(s, dict) for s in statuses):
        return Failure(CoreError(f"sparse_relay_status returned {statuses!r}"))
    return Success([dict(s) for s in statuses])


@attrs.frozen
class SparseDiverged(CoreError):
    """Engine workers whose sparse-refit weights nobody can vouch for: each ``problems``
    entry is one diverged worker, or the workers' different steps."""

    problems: tuple[str, ...]


def sparse_steps(
    statuses: Sequence[Mapping[str, object]], applied_before: Sequence[object]
) -> Result[int, SparseDiverged]:
    """The sparse steps the engine workers applied since ``applied_before`` (their
    statuses' ``applied`` counts when last seen; 0: none, and at least one when the counts
    changed), or why generating now is refused: a worker diverged, or the workers hold
    different steps (a full refit makes the weights valid again)."""
    problems = [
        f"engine worker {i}: {s['diverged']}" for i, s in enumerate(statuses) if s["diverged"]
    ]
    if not problems and len({str(s["step"]) for s in statuses}) > 1:
        steps = [s["step"] for s in statuses]
        problems = [f"the engine workers hold different sparse steps {steps}"]
    if problems:
        message = (
            "generate refused: the sparse refit left weights nobody can vouch for ("
            + "; ".join(problems)
            + "); a full refit (the sender's next step, or an IPC/collective refit) "
            "makes them valid again"
        )
        return Failure(SparseDiverged(message, problems=tuple(problems)))
    applied = [s["applied"] for s in statuses]
    if applied == list(applied_before):
        return Success(0)
    old, new = (applied_before[0] if applied_before else 0), (applied[0] if applied else 0)
    if isinstance(old, int) and isinstance(new, int) and new > old:
        return Success(new - old)
    return Success(1)
