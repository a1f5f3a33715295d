"""The refit protocol as pure state machines: one vocabulary for every transport.

Theory of operation
-------------------
A refit moves a trainer's named tensors into a running engine in vLLM's weight-transfer
shape (init once; start / update / finish per refit): :class:`Begin` (refit id, manifest
digest, protocol version), one or more :class:`Chunk` values, then :class:`End`;
:class:`Abort` replaces the rest when the trainer fails. A chunk lists *storages* (their
byte sizes here; the transport carries the handles: a CUDA IPC handle, a shared-memory
file) and :class:`TensorRef` values placing each tensor in one of them at a byte offset.
A staging buffer is a chunk with one storage; the trainer's own tensors are a chunk with
many. Over a collective the bytes arrive by broadcast in listing order instead
(``storages is None``).

The engine side feeds every event to a :class:`Receiver`, which answers with a
:class:`Step` (the next machine and a decision) or a typed :class:`Refusal` naming the
event and every offending tensor; it never raises on a peer's input. Decisions are plain
values the shell executes: where each tensor goes (:class:`Route`: straight into the
parameter's memory, or through vLLM's weight loader, from :func:`plan_routes` over a
plain description of the engine's parameters), whether the loader needs a copy (the
sender reuses that storage for a later chunk), and which mappings to keep
(:class:`Kept`: a mapping is released by the first refit that does not use it).

The trainer side asks :func:`send_route` whether a tensor travels by the handle of its
own storage (the same storage came back from the last refit: the engine still maps it)
or packed into a staging buffer (a fresh allocation, another device, not contiguous,
empty), and a :class:`ChunkPlan` where it lies and when a chunk is full or the
receiver has waited half its bound.

Bounds: every wait gets the same bound (:func:`wait_bound`; ``None`` means
:data:`DEFAULT_TIMEOUT_S`). A receiver refuses empty chunks, so a refit of ``n`` tensors
has at most ``n + 2`` messages; :func:`refit_waits` counts the waits they cost on each
transport and :func:`rpc_bound` derives the engine call's bound from them, so an outer
bound never expires while every inner wait is on time.

A runtime without CUDA IPC (a container without ``--ipc=host``, a seccomp profile that
blocks the pidfd calls of PyTorch's expandable segments, WSL2) fails deep inside torch
when the engine opens a trainer's handle; :func:`explain_cuda_ipc_failure` tells such a
failure's text from others and says what to change.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Generic, TypeVar

import attrs
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError
from genworker.core.refit_plan import (
    DTYPE_ITEMSIZE,
    Deviation,
    Manifest,
    ManifestError,
    TensorProblem,
    TensorSpec,
    align_up,
    manifest_error,
)

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_TIMEOUT_S",
    "GRACE_S",
    "PROTOCOL_VERSION",
    "RENDEZVOUS_WAITS",
    "Abort",
    "Aborted",
    "Accepted",
    "Begin",
    "BudgetError",
    "Chunk",
    "ChunkPlan",
    "End",
    "EngineParam",
    "Event",
    "FileFacts",
    "Finished",
    "GroupClaim",
    "Kept",
    "Memo",
    "Phase",
    "Placement",
    "Receiver",
    "RefitReport",
    "Refusal",
    "RefusalKind",
    "Route",
    "Routes",
    "SendRoute",
    "Settled",
    "Step",
    "StorageKind",
    "TensorRef",
    "Transport",
    "Write",
    "Writes",
    "claim_problems",
    "dtype_problems",
    "explain_cuda_ipc_failure",
    "file_problem",
    "inflight_seconds",
    "max_message_bytes",
    "nonfinite_refusal",
    "plan_routes",
    "refit_report",
    "refit_waits",
    "rendezvous_bounds",
    "rpc_bound",
    "send_route",
    "topology_problems",
    "wait_bound",
]

PROTOCOL_VERSION: Final = 2
#: The bound of each wait when the caller passes ``timeout_s=None``.
DEFAULT_TIMEOUT_S: Final = 300.0
#: The engine's own work around its waits (routes, post-load processing, answers).
GRACE_S: Final = 30.0
#: Waits of a collective rendezvous: the store, the handshake's hellos and verdict, the
#: group's first status round (all-reduce, and the all-gather of errors).
RENDEZVOUS_WAITS: Final = 5
#: One staging buffer's bytes (two alternate).
DEFAULT_STAGING_BYTES: Final = 512 << 20

K = TypeVar("K")


# -- the vocabulary -------------------------------------------------------------------


@attrs.frozen
class Begin:
    refit_id: str
    manifest_digest: str  # "" when the sender does not know the manifest
    protocol: int = PROTOCOL_VERSION


@attrs.frozen
class TensorRef:
    """One tensor of a chunk: its spec and where it lies (storage index, byte offset)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    storage: int = 0
    offset: int = 0

    @property
    def nbytes(self) -> int:
        """Its bytes; its dtype is one a refit carries (``DTYPE_ITEMSIZE``)."""
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


class StorageKind(enum.Enum):
    """What a chunk's storage is to the sender, which decides its mapping's life."""

    STAGING = "staging"  # a staging buffer: kept, and written again by later chunks
    OWN = "own"  # the trainer's own tensor: kept while later refits send it again
    TEMPORARY = "temporary"  # a copy made for this chunk: freed once it is answered

    @property
    def kept(self) -> bool:
        """The engine keeps its mapping after the chunk (by handle, see :class:`Kept`)."""
        return self is not StorageKind.TEMPORARY

    @property
    def stable(self) -> bool:
        """Its bytes stay as they are until the refit ends (no copy for the loader)."""
        return self is StorageKind.OWN


@attrs.frozen
class Chunk:
    """Tensors in storages of ``storages`` bytes each, of ``kinds`` (None: the bytes
    come by broadcast, in listing order)."""

    refit_id: str
    index: int
    tensors: tuple[TensorRef, ...]
    storages: tuple[int, ...] | None = None
    kinds: tuple[StorageKind, ...] = ()

    @property
    def stable(self) -> bool:
        """Every storage is the trainer's own (:attr:`StorageKind.stable`), so answering
        the chunk frees none for reuse: the answer need not wait for the engine's copies
        out of them (the End's answer, after post-load processing, still does)."""
        return self.storages is not None and all(k.stable for k in self.kinds)


@attrs.frozen
class End:
    refit_id: str
    chunks: int
    tensors: int


@attrs.frozen
class Abort:
    refit_id: str
    reason: str


Event = Begin | Chunk | End | Abort


class Route(enum.Enum):
    """Where a received tensor goes on the engine."""

    DIRECT = "direct"  # copied straight into the parameter's memory
    LOADER = "loader"  # handed to vLLM's weight loader


class SendRoute(enum.Enum):
    """How a trainer's tensor travels over shared memory."""

    HANDLE = "handle"  # the handle of its own storage, mapped (and kept) by the engine
    PACK = "pack"  # copied into a staging buffer


class Transport(enum.Enum):
    IPC = "ipc"
    COLLECTIVE = "collective"


# -- routing --------------------------------------------------------------------------


@attrs.frozen
class EngineParam:
    """One engine parameter as the shell saw it: ``writable`` when its module is
    unquantized, every parameter of the module holds data, and this one is contiguous;
    ``sharded`` when tensor parallelism split it."""

    name: str
    module: str
    spec: TensorSpec
    writable: bool
    sharded: bool = False

    @classmethod
    def of(cls, spec: TensorSpec, method: str | None, filled: bool, sharded: bool) -> EngineParam:
        """``spec``'s parameter, its module quantized by ``method`` (the class name of its
        ``quant_method``, None when it has none: vLLM's unquantized ones are
        ``Unquantized...``); ``filled``: every parameter of the module holds data and this
        one is contiguous."""
        unquantized = method is None or method.startswith("Unquantized")
        return cls(spec.name, spec.name.rpartition(".")[0], spec, unquantized and filled, sharded)


@attrs.frozen
class Routes:
    """The manifest tensors that go straight into parameter memory, and their modules."""

    direct: frozenset[str] = frozenset()
    modules: frozenset[str] = frozenset()

    def route(self, name: str) -> Route:
        return Route.DIRECT if name in self.direct else Route.LOADER

    def answer(self, manifest: Manifest) -> dict[str, object]:
        """``prepare_refit_info``'s answer for ``manifest`` routed so: its digest, its
        tensors, and how many go direct and how many through the loader."""
        direct = len(self.direct)
        return {
            "manifest_digest": manifest.digest(),
            "tensors": len(manifest),
            "direct": direct,
            "loaded": len(manifest) - direct,
        }


def plan_routes(manifest: Manifest, params: Iterable[EngineParam], *, sharded_ok: bool) -> Routes:
    """A tensor goes direct when it equals a writable parameter (name, shape, dtype; not
    sharded unless ``sharded_ok``) and so does every other writable parameter of that
    module: the module's post-load processing then sees all its weights new."""
    writable: dict[str, set[str]] = {}
    matching: dict[str, set[str]] = {}
    for p in params:
        if not p.writable:
            continue
        writable.setdefault(p.module, set()).add(p.name)
        if manifest.get(p.name) == p.spec and (sharded_ok or not p.sharded):
            matching.setdefault(p.module, set()).add(p.name)
    modules = frozenset(m for m, names in matching.items() if names == writable[m])
    direct = frozenset(n for m in modules for n in matching[m])
    return Routes(direct, modules)


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _engine_name(name: str, params: Mapping[str, str], packed: Mapping[str, Iterable[str]]) -> str:
    """The engine parameter a checkpoint tensor loads into: itself, or its module's packed
    one (vLLM's ``packed_modules_mapping``: ``q_proj`` into ``qkv_proj``); '' when none."""
    if name in params:
        return name
    parts = name.split(".")
    for i, part in enumerate(parts):
        for fused, shards in packed.items():
            if part in shards:
                candidate = ".".join([*parts[:i], fused, *parts[i + 1 :]])
                if candidate in params:
                    return candidate
    return ""


def dtype_problems(
    manifest: Manifest, params: Mapping[str, str], packed: Mapping[str, Iterable[str]]
) -> Result[Manifest, ManifestError]:
    """A manifest whose dtypes the engine can take: a tensor that loads into a
    floating-point parameter (``params``: the engine's ``{name: dtype}``; ``packed``: its
    fused modules' shards) must be declared floating point. vLLM's loader converts values,
    so an integer declared for a float parameter of the same byte size would pass every
    size check and load the bits as numbers (issue 44: every logprob 0.0 for the final
    norm, garbage for a projection). Floats of another width (bf16 for an fp8 or fp32
    parameter) convert faithfully and pass; non-float parameters (packed quantized
    weights) are the quantizer's to check. Refused naming each tensor and both dtypes."""
    problems = []
    for spec in manifest.specs:
        target = _engine_name(spec.name, params, packed)
        if target and _floating(params[target]) and not _floating(spec.dtype):
            into = "" if target == spec.name else f" {target!r}"
            problems.append(
                TensorProblem(
                    spec.name,
                    Deviation.MISMATCHED,
                    f"is declared {spec.dtype}, but the engine's parameter{into} is "
                    f"{params[target]}: its values would be converted as numbers; send it as "
                    "a floating-point tensor",
                )
            )
    if problems:
        return Failure(manifest_error("the refit manifest's dtypes", problems))
    return Success(manifest)


# -- the receiver ---------------------------------------------------------------------


class Phase(enum.Enum):
    IDLE = "idle"  # waiting for a Begin
    RECEIVING = "receiving"
    DONE = "done"
    FAILED = "failed"


class RefusalKind(enum.Enum):
    ORDER = "order"  # an event this phase does not take
    VERSION = "version"
    DIGEST = "digest"
    MANIFEST = "manifest"  # names every offending tensor (``detail``)
    STRAY = "stray"  # another refit's event


@attrs.frozen
class Refusal(CoreError):
    """An event the receiver refuses. Not ``fatal``: a stray event before any Begin,
    answered and ignored (the refit has not started)."""

    kind: RefusalKind = RefusalKind.ORDER
    event: str = ""
    fatal: bool = True
    detail: ManifestError | None = None


@attrs.frozen
class Write:
    """Where one received tensor goes; ``copy``: the loader gets a copy (its storage
    changes before the refit ends)."""

    ref: TensorRef
    route: Route
    copy: bool = False


@attrs.frozen
class Accepted:
    refit_id: str


@attrs.frozen
class Writes:
    """A chunk's writes, the names among them that go direct, and their bytes."""

    chunk: Chunk
    writes: tuple[Write, ...]
    direct: tuple[str, ...] = ()
    nbytes: int = 0


@attrs.frozen
class Finished:
    tensors: int
    chunks: int


@attrs.frozen
class Aborted:
    reason: str


Decision = Accepted | Writes | Finished | Aborted


@attrs.frozen
class Step:
    receiver: Receiver
    decision: Decision


def _name(event: Event) -> str:
    if isinstance(event, Chunk):
        return f"chunk {event.index} of refit {event.refit_id!r}"
    return f"{type(event).__name__} of refit {event.refit_id!r}"


@attrs.frozen
class Memo:
    """The decisions of a finished refit's chunks, in order, for the next refit against
    the same manifest and routes: each chunk listing (tensors, storage sizes, kinds) with
    its writes and the names received once it was taken.

    Why a remembered decision is the decision: ``Receiver._chunk`` is a function of the
    chunk's index, tensors, storages and kinds and of the receiver's manifest, routes,
    chunk count and received names (the refit id is checked before it and changes
    nothing). A chunk is taken from the memo only when every chunk before it in this
    refit was too (``hits``), so by induction the chunk count and the received names are
    the remembered refit's at that chunk; with the same manifest and routes and an equal
    listing, every input is the same, and so is the decision. Refusals are never
    remembered: a chunk that fails a check always meets the check again."""

    manifest: Manifest | None = None
    routes: Routes = Routes()
    chunks: tuple[tuple[Chunk, Writes, frozenset[str]], ...] = ()

    def recall(self, chunk: Chunk) -> tuple[Writes, frozenset[str]] | None:
        """The remembered writes and received names for ``chunk``, if its listing is the
        remembered one at its index."""
        if chunk.index >= len(self.chunks):
            return None
        known, writes, received = self.chunks[chunk.index]
        same = (known.tensors, known.storages, known.kinds) == (
            chunk.tensors,
            chunk.storages,
            chunk.kinds,
        )
        return (attrs.evolve(writes, chunk=chunk), received) if same else None


@attrs.frozen
class Receiver:
    """The engine side of one refit (a fresh one per refit; ``memo``: the last finished
    refit's, see :meth:`remembered`)."""

    manifest: Manifest
    routes: Routes = Routes()
    phase: Phase = Phase.IDLE
    refit_id: str = ""
    received: frozenset[str] = frozenset()
    chunks: int = 0
    memo: Memo = Memo()
    hits: int = 0  # chunks of this refit, from the first on, taken from the memo
    taken: tuple[tuple[Chunk, Writes, frozenset[str]], ...] = ()

    @property
    def awaiting(self) -> str:
        """What this machine waits for next, as a wait that expires names it."""
        if self.phase is Phase.IDLE:
            return "the start of a refit"
        return f"chunk {self.chunks} or the end of refit {self.refit_id}"

    def remembered(self) -> Memo:
        """The memo for the next refit: this one's decisions once it finished."""
        if self.phase is not Phase.DONE:
            return self.memo
        return Memo(self.manifest, self.routes, self.taken)

    def handle(self, event: Event) -> Result[Step, Refusal]:
        if self.phase is Phase.IDLE or (
            isinstance(event, Begin) and self.phase is Phase.RECEIVING and not self.chunks
        ):  # a trainer whose first Begin timed out starts over
            if isinstance(event, Begin):
                return self._begin(event)
            return self._refuse(RefusalKind.ORDER, event, "no refit is in progress", fatal=False)
        if self.phase is not Phase.RECEIVING or isinstance(event, Begin):
            return self._refuse(RefusalKind.ORDER, event, f"the refit is {self.phase.value}")
        if event.refit_id != self.refit_id:
            return self._refuse(RefusalKind.STRAY, event, f"refit {self.refit_id!r} is running")
        if isinstance(event, Abort):
            return Success(Step(attrs.evolve(self, phase=Phase.FAILED), Aborted(event.reason)))
        if isinstance(event, End):
            return self._end(event)
        return self._chunk(event)

    def _refuse(
        self,
        kind: RefusalKind,
        event: Event,
        why: str,
        *,
        fatal: bool = True,
        detail: ManifestError | None = None,
    ) -> Result[Step, Refusal]:
        return Failure(Refusal(f"refused {_name(event)}: {why}", kind, _name(event), fatal, detail))

    def _begin(self, event: Begin) -> Result[Step, Refusal]:
        if event.protocol != PROTOCOL_VERSION:
            why = f"it speaks refit protocol {event.protocol}, this engine {PROTOCOL_VERSION}"
            return self._refuse(RefusalKind.VERSION, event, why)
        if event.manifest_digest not in ("", self.manifest.digest()):
            why = (
                "the trainer sends a different manifest than the one given to "
                "prepare_refit_info (names, shapes or dtypes differ)"
            )
            return self._refuse(RefusalKind.DIGEST, event, why)
        memo = self.memo
        if (memo.manifest, memo.routes) != (self.manifest, self.routes):
            memo = Memo()
        started = attrs.evolve(
            self,
            phase=Phase.RECEIVING,
            refit_id=event.refit_id,
            received=frozenset(),
            chunks=0,
            memo=memo,
            hits=0,
            taken=(),
        )
        return Success(Step(started, Accepted(event.refit_id)))

    def _chunk(self, chunk: Chunk) -> Result[Step, Refusal]:
        if chunk.index != self.chunks:
            return self._refuse(RefusalKind.ORDER, chunk, f"chunk {self.chunks} was expected")
        recalled = self.memo.recall(chunk) if self.hits == chunk.index else None
        if recalled is not None:
            return self._take(chunk, *recalled, hits=self.hits + 1)
        if not chunk.tensors:
            return self._refuse(RefusalKind.ORDER, chunk, "it lists no tensors")
        if chunk.storages is not None and len(chunk.kinds) != len(chunk.storages):
            return self._refuse(RefusalKind.ORDER, chunk, "its storage kinds do not match")
        problems: list[TensorProblem] = []
        here: set[str] = set()
        writes = []
        for ref in chunk.tensors:
            problem = self._check(ref, chunk.storages, here)
            here.add(ref.name)
            if problem is not None:
                problems.append(problem)
                continue
            route = self.routes.route(ref.name)
            copy = (
                chunk.storages is not None
                and route is Route.LOADER
                and not chunk.kinds[ref.storage].stable
            )
            writes.append(Write(ref, route, copy))
        if problems:
            error = manifest_error(f"chunk {chunk.index} does not match the manifest", problems)
            return self._refuse(RefusalKind.MANIFEST, chunk, str(error), detail=error)
        direct = tuple(w.ref.name for w in writes if w.route is Route.DIRECT)
        nbytes = sum(math.prod(w.ref.shape) * DTYPE_ITEMSIZE[w.ref.dtype] for w in writes)
        decided = Writes(chunk, tuple(writes), direct, nbytes)
        return self._take(chunk, decided, self.received | here, hits=self.hits)

    def _take(
        self, chunk: Chunk, writes: Writes, received: frozenset[str], *, hits: int
    ) -> Result[Step, Refusal]:
        taken = (*self.taken, (chunk, writes, received))
        progressed = attrs.evolve(
            self, received=received, chunks=self.chunks + 1, hits=hits, taken=taken
        )
        return Success(Step(progressed, writes))

    def _check(
        self, ref: TensorRef, storages: tuple[int, ...] | None, here: set[str]
    ) -> TensorProblem | None:
        spec = self.manifest.get(ref.name)
        if spec is None:
            return TensorProblem(ref.name, Deviation.UNEXPECTED, "is not in the manifest")
        if ref.name in self.received or ref.name in here:
            return TensorProblem(ref.name, Deviation.DUPLICATED, "arrived twice")
        if (ref.shape, ref.dtype) != (spec.shape, spec.dtype):
            got = f"{list(ref.shape)} {ref.dtype}"
            return TensorProblem(
                ref.name, Deviation.MISMATCHED, f"expected {spec.describe()}, got {got}"
            )
        if storages is None:
            if (ref.storage, ref.offset) == (0, 0):
                return None
            where = "a broadcast chunk places no tensor in a storage"
        elif not 0 <= ref.storage < len(storages):
            where = f"storage {ref.storage} is not in the chunk"
        elif ref.offset < 0 or ref.offset + spec.nbytes > storages[ref.storage]:
            where = (
                f"{spec.nbytes} bytes at offset {ref.offset} overrun storage {ref.storage} "
                f"({storages[ref.storage]} bytes)"
            )
        elif ref.offset % DTYPE_ITEMSIZE[spec.dtype]:
            where = f"offset {ref.offset} is not aligned for {spec.dtype}"
        else:
            return None
        return TensorProblem(ref.name, Deviation.MISPLACED, where)

    def _end(self, end: End) -> Result[Step, Refusal]:
        missing = [
            TensorProblem(s.name, Deviation.MISSING, "never arrived")
            for s in self.manifest.specs
            if s.name not in self.received
        ]
        if missing:
            error = manifest_error("the refit ended incomplete", missing)
            return self._refuse(RefusalKind.MANIFEST, end, str(error), detail=error)
        if (end.chunks, end.tensors) != (self.chunks, len(self.received)):
            why = (
                f"it counts {end.chunks} chunks and {end.tensors} tensors, this engine "
                f"received {self.chunks} and {len(self.received)}"
            )
            return self._refuse(RefusalKind.ORDER, end, why)
        done = attrs.evolve(self, phase=Phase.DONE)
        return Success(Step(done, Finished(len(self.received), self.chunks)))


# -- the sender -----------------------------------------------------------------------


def send_route(*, storage_bytes: int, contiguous: bool, local: bool, recognised: bool) -> SendRoute:
    """By handle only a storage the engine mapped last refit (the same storage came back;
    recognised by the sender, never declared), not empty, contiguous and on the
    transport's device; anything else packed.

    However small: a chunk that packs anything is answered only after the engine's device
    sync (the sender reuses the staging buffer), which waits for every copy queued before
    it, where a chunk of handles only is answered once its copies are queued. On the H200
    an 8B refit with its 65 norm tensors packed took 14.6 ms, by handle like the rest
    10.7 ms (bench/RESULTS-gpu.md of 03e251a); the engine maps a small storage's whole
    allocation segment once, and keeps it while the storage comes back."""
    if recognised and contiguous and local and storage_bytes > 0:
        return SendRoute.HANDLE
    return SendRoute.PACK


@attrs.frozen
class Placement:
    """Where the sender puts a tensor: ``flush`` the open chunk first; a packed tensor
    at ``offset`` of the chunk's staging buffer, ``alone`` in a buffer of its own size
    when it exceeds the budget (its chunk then closes right after it)."""

    plan: ChunkPlan
    flush: bool
    offset: int = 0
    alone: bool = False


@attrs.frozen
class ChunkPlan:
    """The chunk being filled. ``budget``: bytes packed per chunk (one staging buffer, or
    one group of broadcasts); ``flush_after_s``: a chunk goes out once this long passed
    since the last message, so a slow trainer never lets the receiver's wait expire.
    ``staged``: chunks sent that packed into a staging buffer (they alternate).

    Chunk ``i`` holds at most ``budget * 2**i`` bytes, by handle or packed (``held``),
    unless one tensor exceeds it: the receiver starts copying once the first ``budget``
    of a refit by handle arrived, not once the trainer walked all of it, and a refit of
    ``n`` bytes still takes about ``log2(n / budget)`` chunks (on the H200 an 8B refit
    by handle: 9.7 ms, against 10.2 ms in one chunk, bench/RESULTS-gpu.md run S)."""

    budget: int
    flush_after_s: float
    opened_at: float
    index: int = 0
    fill: int = 0
    tensors: int = 0
    staged: int = 0
    held: int = 0

    @property
    def buffer(self) -> int:
        """The staging buffer this chunk packs into: the other one than the last chunk
        that packed, which may still be read."""
        return self.staged % 2

    def place(self, route: SendRoute, nbytes: int, now: float) -> Placement:
        # built with the constructor, not attrs.evolve: this runs once per tensor
        late = self.tensors > 0 and now - self.opened_at >= self.flush_after_s
        size = 0 if route is SendRoute.HANDLE else align_up(nbytes)
        alone = size > self.budget
        full = self.fill + size > self.budget or self.held + nbytes > self.budget << self.index
        flush = late or (self.tensors > 0 and (alone or full))
        plan = self.flushed(now) if flush else self
        fill = plan.fill if alone else plan.fill + size
        placed = ChunkPlan(
            plan.budget,
            plan.flush_after_s,
            plan.opened_at,
            plan.index,
            fill,
            plan.tensors + 1,
            plan.staged,
            plan.held + nbytes,
        )
        return Placement(placed, flush, 0 if alone else plan.fill, alone)

    def flushed(self, now: float) -> ChunkPlan:
        """The next chunk, once this one was sent at ``now``."""
        staged = self.staged + (self.fill > 0)
        return ChunkPlan(self.budget, self.flush_after_s, now, self.index + 1, 0, 0, staged)


@attrs.frozen
class Sent(Generic[K]):
    """One tensor a refit sent, for a replay: where it lay (``place``: name, spec, storage
    and place in it, compared whole), its storage's reference, and its (staging buffer,
    offset) when packed, None when it went by handle."""

    place: tuple[object, ...]
    ref: K
    packed: tuple[int, int] | None = None


@attrs.frozen
class SentChunk(Generic[K]):
    """One chunk a refit sent: its listing (the very bytes), its tensors and their bytes."""

    listing: bytes
    sent: tuple[Sent[K], ...]
    nbytes: int

    @property
    def by_handle(self) -> int:
        return sum(s.packed is None for s in self.sent)


@attrs.frozen
class Replay(Generic[K]):
    """A refit sent by handle and through the staging buffers, chunk by chunk. The next
    refit whose tensors come back in the same places, in order, sends these chunks'
    listings again (packing each packed tensor where the listing says) instead of routing
    and encoding them; a tensor in a place of its own (a temporary buffer) is never
    replayed, so a refit that sent one is not recorded."""

    chunks: tuple[SentChunk[K], ...] = ()

    def add(self, chunk: SentChunk[K]) -> Replay[K]:
        return Replay((*self.chunks, chunk))

    def expects(self, index: int, held: int, place: tuple[object, ...]) -> Sent[K] | None:
        """Chunk ``index``'s tensor after the ``held`` already taken, when it lay at
        ``place``; None past the last chunk or at another place."""
        if index < len(self.chunks) and (sent := self.chunks[index].sent[held]).place == place:
            return sent
        return None


@attrs.frozen
class Settled(Generic[K]):
    kept: Kept[K]
    released: frozenset[K]


@attrs.frozen
class Kept(Generic[K]):
    """Mappings kept across refits (by handle) and those this refit used."""

    kept: frozenset[K] = frozenset()
    used: frozenset[K] = frozenset()

    def use(self, keys: Iterable[K]) -> Kept[K]:
        keys = frozenset(keys)
        return Kept(self.kept | keys, self.used | keys)

    def settle(self) -> Settled[K]:
        """At a refit's end: keep what it used, release the rest."""
        return Settled(Kept(self.used), self.kept - self.used)

    def clear(self) -> Settled[K]:
        """Release everything (a failed refit, or the trainer asks for its memory)."""
        return Settled(Kept(), self.kept)


# -- trust: shared-memory files and weight-update groups --------------------------------


@attrs.frozen
class FileFacts:
    """What ``fstat`` says of a file a sender named, and of its directory."""

    absolute: bool
    regular: bool
    owner: int
    parent_owner: int
    parent_is_dir: bool
    parent_mode: int
    inode: int
    size: int


def file_problem(facts: FileFacts, *, uid: int, inode: int, size: int) -> str | None:
    """Why a receiver running as ``uid`` must not map this file as the sender's storage
    (``inode``, ``size`` bytes), or None: the file must be a regular file of ``uid``'s, in
    a directory of ``uid``'s that no one else can enter, the very file the handle names."""
    checks = (
        (facts.absolute, "its path is not absolute"),
        (facts.regular, "it is not a regular file"),
        (facts.owner == facts.parent_owner == uid, "it belongs to another user"),
        (
            facts.parent_is_dir and not facts.parent_mode & 0o077,
            "its directory is open to other users",
        ),
        (facts.inode == inode, "it is another file than the sender's"),
        (facts.size >= size, f"it holds {facts.size} bytes, fewer than the {size} declared"),
    )
    return next((why for ok, why in checks if not ok), None)


@attrs.frozen
class GroupClaim:
    """One rank's view of a weight-update group, compared by rank 0 at rendezvous."""

    rank: int
    world_size: int
    train_world_size: int
    backend: str
    role: str
    protocol: int = PROTOCOL_VERSION


def topology_problems(ip: str, port: int, claim: GroupClaim) -> tuple[str, ...]:
    """What makes a rank's place in a group impossible, before any socket opens."""
    rank, world, train = claim.rank, claim.world_size, claim.train_world_size
    problems = [
        *(["ip is empty"] if not ip else []),
        *([f"port {port} is not in 1..65535"] if not 0 < port < 65536 else []),
        *([f"world_size {world} leaves no one to send to"] if world < 2 else []),
        *(
            [f"train_world_size {train} must be in 1..{world - 1}"]
            if not 1 <= train < world
            else []
        ),
    ]
    if not 0 <= rank < world:
        problems.append(f"rank {rank} is outside 0..{world - 1}")
    elif (claim.role == "trainer") != (rank < train):
        role = "trainer" if rank < train else "engine"
        problems.append(f"rank {rank} would be a {role} rank, but this process is the {claim.role}")
    return tuple(problems)


def claim_problems(judge: GroupClaim, claims: Iterable[GroupClaim]) -> tuple[str, ...]:
    """Where the ranks' claims disagree with rank 0's (``judge``), naming each rank."""
    problems = []
    for claim in claims:
        role = "trainer" if claim.rank < judge.train_world_size else "engine"
        for field, want in (
            ("world_size", judge.world_size),
            ("train_world_size", judge.train_world_size),
            ("backend", judge.backend),
            ("protocol", judge.protocol),
            ("role", role),
        ):
            got = getattr(claim, field)
            if got != want:
                problems.append(f"rank {claim.rank} has {field}={got!r}, expected {want!r}")
    return tuple(problems)


# -- CUDA IPC in the runtime (failure-modes R8) ---------------------------------------------

#: What opening a trainer's CUDA IPC handle fails with when the runtime has no CUDA IPC
#: (torch's ``_new_shared_cuda`` / ``rebuild_cuda_tensor``: ``CUDA error: <the CUDA
#: runtime's text>`` or ``CUDA driver error: ...``; the pidfd calls of PyTorch's
#: expandable segments, ``c10/cuda/CUDACachingAllocator.cpp``, 2.5 and later), casefolded,
#: and why. The first row that matches decides: ``pidfd_open: Operation not permitted`` is
#: the pidfd row's.
_IPC_UNAVAILABLE: Final = (
    (
        ("pidfd",),
        "the trainer's memory comes from PyTorch's expandable segments, which the engine "
        "opens through pidfd_open and pidfd_getfd, and this runtime refused them",
    ),
    (
        ("operation not supported", "cudaerrornotsupported", "cuda_error_not_supported"),
        "this platform does not support CUDA IPC",
    ),
    (
        (
            "invalid resource handle",
            "cudaerrorinvalidresourcehandle",
            "cuda_error_invalid_handle",
            "invalid device context",
            "cudaerrorinvalidcontext",
            "cudaerrordeviceuninitialized",
            "cuda_error_invalid_context",
            "mapping of buffer object failed",
            "cudaerrormapbufferobjectfailed",
            "operation not permitted",
            "cudaerrornotpermitted",
            "cuda_error_not_permitted",
            "cudaipcopenmemhandle",
            "cumemimportfromshareablehandle",
            "failed to open cuda ipc handle",
        ),
        "the CUDA driver refused the trainer's handle in this process (the trainer and "
        "the engine do not share an IPC and PID namespace, or may not inspect each other)",
    ),
)


def nonfinite_refusal(what: str, names: Sequence[str], kept: str) -> str:
    """Why ``what`` (a chunk of a refit, a sparse step, an adapter) is refused: the first
    eight of the tensors ``names`` holding a NaN or an infinity, and what holds now
    (``kept``)."""
    shown = ", ".join(map(repr, names[:8])) + (
        f" and {len(names) - 8} more" if len(names) > 8 else ""
    )
    return (
        f"{what}: refused, non-finite values (NaN or inf) in {shown}; the refit does "
        f"not count and {kept} (vllm_cfg.refit_finite_check: false turns this check off)"
    )


def explain_cuda_ipc_failure(text: str) -> str | None:
    """What to do when opening a trainer's CUDA IPC handle failed with ``text`` (the
    exception's text), or None when ``text`` is no sign that this runtime lacks CUDA IPC
    (nemo-rl#2293: containers need ``--ipc=host``; openrlhf#957: expandable segments need
    ``pidfd_open``, which seccomp may block; WSL2 answers "invalid resource handle")."""
    folded = text.casefold()
    cause = next((why for signs, why in _IPC_UNAVAILABLE if any(s in folded for s in signs)), None)
    if cause is None:
        return None
    return (
        f"CUDA IPC is unavailable in this runtime: {cause}. To refit over CUDA IPC, run the "
        "trainer and the engine with --ipc=host in one PID namespace (--pid=host, or one "
        "container) with CAP_SYS_PTRACE; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
        "True the runtime must also allow pidfd_open and pidfd_getfd (its seccomp profile), "
        "or drop expandable_segments on the trainer; WSL2 has no CUDA IPC at all. Or refit "
        "over a collective, which needs none: RefitSender.collective on the trainer, "
        "init_collective and update_weights_from_collective on the engine."
    )


# -- reports ------------------------------------------------------------------------------


@attrs.frozen
class RefitReport:
    """What one refit moved (either side), and where the time went (``phases``)."""

    tensors: int
    nbytes: int
    chunks: int
    seconds: float
    direct: int = 0  # engine: tensors written straight into parameters; sender: by handle
    loaded: int = 0  # engine: tensors through the loader; sender: packed
    mapped: int = 0  # engine: storages mapped anew this refit
    phases: Mapping[str, float] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {**attrs.asdict(self, recurse=False), "phases": dict(self.phases)}


def refit_report(
    engine_workers: Sequence[object], resets: Mapping[str, float], **fields: object
) -> dict[str, object]:
    """A worker's ``last_refit`` after a refit that succeeded: each engine worker's
    report, what the refit adds (``fields``: the RPC's seconds, the adapter's name, the
    in-flight mode, version and timings), then the seconds of each cache reset."""
    seconds = {f"reset_{cache}_cache_seconds": s for cache, s in resets.items()}
    return {"engine_workers": engine_workers, **fields, **seconds}


def inflight_seconds(
    started: float, paused: float, rpc_done: float, resumed: float
) -> dict[str, float]:
    """An in-flight refit's timings from its clock readings (as it began, once paused,
    once its RPC returned, once resumed): the pause, the resume and the whole pause."""
    return {
        "pause_seconds": paused - started,
        "resume_seconds": resumed - rpc_done,
        "paused_seconds": resumed - started,
    }


# -- bounds ---------------------------------------------------------------------------


@attrs.frozen
class BudgetError(CoreError):
    timeout_s: object = None


def wait_bound(timeout_s: object) -> Result[float, BudgetError]:
    """The bound of each wait: ``timeout_s`` seconds (a finite number > 0), or
    :data:`DEFAULT_TIMEOUT_S` for ``None``; anything else is refused."""
    if timeout_s is None:
        return Success(DEFAULT_TIMEOUT_S)
    if (
        isinstance(timeout_s, int | float)
        and not isinstance(timeout_s, bool)
        and math.isfinite(timeout_s)
        and timeout_s > 0
    ):
        return Success(float(timeout_s))
    return Failure(
        BudgetError(
            f"timeout_s must be a finite number of seconds > 0 or None, got {timeout_s!r}",
            timeout_s,
        )
    )


def refit_waits(tensors: int, transport: Transport) -> int:
    """The most waits a receiver makes in a refit of ``tensors`` tensors: one per message
    over IPC (at most ``tensors`` chunks, each carrying one tensor or more, plus Begin
    and End); over a collective each message's header may take two broadcasts, each
    tensor one, and two status rounds two collectives each."""
    messages = tensors + 2
    if transport is Transport.IPC:
        return messages
    return 2 * messages + tensors + 4


def rpc_bound(waits: int, per_wait_s: float) -> float:
    """The engine call's bound: more than ``waits`` waits of ``per_wait_s`` each."""
    return waits * per_wait_s + GRACE_S


def rendezvous_bounds(timeout_s: object) -> Result[tuple[float, float], BudgetError]:
    """A group join's bound of each wait (``timeout_s``, :func:`wait_bound`) and its
    engine call's bound (:data:`RENDEZVOUS_WAITS` of them)."""
    return wait_bound(timeout_s).map(lambda bound: (bound, rpc_bound(RENDEZVOUS_WAITS, bound)))


def max_message_bytes(manifest: Manifest) -> int:
    """The largest refit message a receiver of ``manifest`` takes: every tensor listed
    once in its own storage, with room for encoding and handles (512 bytes each)."""
    per_tensor = sum(len(s.name.encode()) + 16 * len(s.shape) + 64 for s in manifest.specs)
    return 64 * 1024 + per_tensor + 512 * (len(manifest) + 2)
