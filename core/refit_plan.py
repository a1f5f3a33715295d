"""The refit packing plan and the receiver's manifest checks (pure values).

Theory of operation
-------------------
A refit moves a trainer's named tensors into a running engine. Tensors travel in
*buckets*: one contiguous byte buffer per bucket, each tensor in a *slot* whose offset is
a multiple of :data:`ALIGNMENT` (512 bytes, the alignment NeMo-RL's packed refit uses), so
every slot can be viewed in place as its dtype. The rules:

- Slots are laid out back to back: slot *i* starts where slot *i-1*'s aligned size ends,
  and ``used_bytes`` is the sum of the aligned sizes. The receiver recomputes this layout
  from the declared sizes, so a header that disagrees with its own slots is refused.
- A bucket fills up to a byte budget (a positive multiple of 512). A tensor whose aligned
  size exceeds the budget travels alone in a bucket of exactly its aligned size (a
  right-sized staging buffer; NeMo-RL ``test_refit_oversized_param.py``).
- Buckets alternate between buffer 0 and buffer 1 (ping-pong): the sender packs bucket
  *k+1* into one buffer while bucket *k* is still being read from the other, and reuses a
  buffer only after the receiver acknowledged the bucket it carried.
- :func:`plan_buckets` consumes its specs lazily and yields each bucket as soon as it is
  closed, so a trainer can stream a sharded model without materialising it: when a bucket
  is yielded the planner holds at most the one spec that did not fit.

The receiver knows what to expect from ``prepare_refit_info({name: (shape, dtype)})``:
a :class:`Manifest`. :func:`check_bucket` validates each arriving bucket against it and the
names received so far (a :class:`ReceiveProgress`), and :func:`check_complete` confirms at
the end that every expected tensor arrived exactly once. Both return a
:class:`ManifestError` naming every offending tensor, never a bare boolean (NeMo-RL's
``IPCWeightManifestError`` in ``vllm_backend.py`` is the model; vllm#53233 shows the bare
assert this replaces).
"""

from __future__ import annotations

import enum
import hashlib
import math
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Final, TypeVar

import attrs
import torch
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "ALIGNMENT",
    "DTYPE_ITEMSIZE",
    "Bucket",
    "Deviation",
    "Manifest",
    "ManifestError",
    "ReceiveProgress",
    "RefitPlanError",
    "Slot",
    "TensorProblem",
    "TensorSpec",
    "align_up",
    "broadcast_groups",
    "bucket_budget",
    "bucket_checksum",
    "check_bucket",
    "check_complete",
    "dtype_name",
    "plan_buckets",
]

ALIGNMENT: Final = 512

#: Element sizes of the dtypes a refit may carry, keyed by torch's name without "torch.".
DTYPE_ITEMSIZE: Final[Mapping[str, int]] = MappingProxyType(
    {
        "float64": 8,
        "float32": 4,
        "float16": 2,
        "bfloat16": 2,
        "float8_e4m3fn": 1,
        "float8_e4m3fnuz": 1,
        "float8_e5m2": 1,
        "float8_e5m2fnuz": 1,
        "complex128": 16,
        "complex64": 8,
        "int64": 8,
        "int32": 4,
        "int16": 2,
        "int8": 1,
        "uint8": 1,
        "bool": 1,
    }
)

_MAX_NAMED = 12
_K = TypeVar("_K")


def dtype_name(dtype: object) -> str:
    """``torch.float32``, ``"torch.float32"`` and ``"float32"`` all become ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """The smallest multiple of ``alignment`` that holds ``nbytes``."""
    return -(-nbytes // alignment) * alignment


def _is_dim(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_name(_inst: object, _attr: object, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"a tensor name must be a non-empty str, got {value!r}")


def _check_shape(_inst: object, _attr: object, value: tuple[int, ...]) -> None:
    if not isinstance(value, tuple) or not all(_is_dim(d) for d in value):
        raise ValueError(f"a shape must be a tuple of non-negative ints, got {value!r}")


def _check_dtype(_inst: object, _attr: object, value: str) -> None:
    if value not in DTYPE_ITEMSIZE:
        raise ValueError(f"unknown dtype {value!r}; known: {sorted(DTYPE_ITEMSIZE)}")


def _check_non_negative(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if not _is_dim(value):
        raise ValueError(f"{attr.name} must be a non-negative int, got {value!r}")


def _describe(shape: Sequence[int], dtype: str) -> str:
    return f"{list(shape)} {dtype}"


@attrs.frozen
class TensorSpec:
    """A tensor's name, shape and dtype: what the manifest promises and a slot carries."""

    name: str = attrs.field(validator=_check_name)
    shape: tuple[int, ...] = attrs.field(validator=_check_shape)
    dtype: str = attrs.field(validator=_check_dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE[self.dtype]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        """The spec of a tensor as it would travel (its logical shape, not its strides)."""
        return cls(name, tuple(int(d) for d in tensor.shape), dtype_name(tensor.dtype))

    def describe(self) -> str:
        return _describe(self.shape, self.dtype)


@attrs.frozen
class Slot:
    """Where one tensor lies in a bucket: ``nbytes`` bytes from ``offset``."""

    name: str = attrs.field(validator=_check_name)
    offset: int = attrs.field(validator=_check_non_negative)
    nbytes: int = attrs.field(validator=_check_non_negative)
    shape: tuple[int, ...] = attrs.field(validator=_check_shape)
    dtype: str = attrs.field(validator=_check_dtype)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.shape, self.dtype)


def _check_buffer(_inst: object, _attr: object, value: int) -> None:
    if value not in (0, 1):
        raise ValueError(f"a bucket's buffer index is 0 or 1, got {value!r}")


@attrs.frozen
class Bucket:
    """One packed transfer: its position, its buffer (0/1), its slots and its byte length."""

    index: int = attrs.field(validator=_check_non_negative)
    buffer: int = attrs.field(validator=_check_buffer)
    slots: tuple[Slot, ...]
    used_bytes: int = attrs.field(validator=_check_non_negative)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)

    @property
    def payload_bytes(self) -> int:
        """The tensors' own bytes, without alignment padding."""
        return sum(s.nbytes for s in self.slots)


def broadcast_groups(sizes: Sequence[int], limit_bytes: int) -> tuple[tuple[int, ...], ...]:
    """The direct refit's broadcasts, grouped: each group is issued as one NCCL group call.

    ``sizes`` are the byte sizes of the listed tensors, in order. Empty tensors travel in
    no group; the others are taken in order, greedily, into groups whose sizes sum to at
    most ``limit_bytes``; a tensor larger than the limit is a group of its own. A limit
    of 0 (or less) puts every tensor in its own group. Every rank computes the same
    groups from the same listing, so their group calls match.
    """
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    fill = 0
    for index, size in enumerate(sizes):
        if size <= 0:
            continue
        if current and (limit_bytes <= 0 or fill + size > limit_bytes):
            groups.append(tuple(current))
            current, fill = [], 0
        current.append(index)
        fill += size
    if current:
        groups.append(tuple(current))
    return tuple(groups)


@attrs.frozen
class RefitPlanError(CoreError):
    """The bucket budget cannot hold an aligned slot."""

    budget_bytes: object = None


def bucket_budget(budget_bytes: object) -> Result[int, RefitPlanError]:
    """Accept a budget that is a positive multiple of :data:`ALIGNMENT`."""
    if (
        isinstance(budget_bytes, int)
        and not isinstance(budget_bytes, bool)
        and budget_bytes > 0
        and budget_bytes % ALIGNMENT == 0
    ):
        return Success(budget_bytes)
    return Failure(
        RefitPlanError(
            f"the refit bucket budget must be a positive multiple of {ALIGNMENT} bytes, "
            f"got {budget_bytes!r}",
            budget_bytes=budget_bytes,
        )
    )


def plan_buckets(specs: Iterable[TensorSpec], budget_bytes: int) -> Iterator[Bucket]:
    """Pack ``specs`` in order into buckets of at most ``budget_bytes`` (lazily).

    ``budget_bytes`` must satisfy :func:`bucket_budget` (a programming error otherwise).
    """
    if bucket_budget(budget_bytes).value_or(0) == 0:
        raise ValueError(f"invalid refit bucket budget {budget_bytes!r}; see bucket_budget()")
    index = 0
    slots: list[Slot] = []
    fill = 0

    def close() -> Bucket:
        nonlocal index, slots, fill
        bucket = Bucket(index, index % 2, tuple(slots), fill)
        index, slots, fill = index + 1, [], 0
        return bucket

    for spec in specs:
        size = align_up(spec.nbytes)
        if size > budget_bytes:
            if slots:
                yield close()
            slots.append(Slot(spec.name, 0, spec.nbytes, spec.shape, spec.dtype))
            fill = size
            yield close()
            continue
        if fill + size > budget_bytes:
            yield close()
        slots.append(Slot(spec.name, fill, spec.nbytes, spec.shape, spec.dtype))
        fill += size
        if fill == budget_bytes:
            yield close()
    if slots:
        yield close()


class Deviation(enum.Enum):
    """How a tensor departs from the manifest."""

    INVALID = "invalid"
    UNEXPECTED = "unexpected"
    MISMATCHED = "mismatched"
    DUPLICATED = "duplicated"
    MISPLACED = "misplaced"
    MISSING = "missing"


@attrs.frozen
class TensorProblem:
    """One tensor's deviation, with a human detail such as "expected [4] float32"."""

    name: str
    kind: Deviation
    detail: str

    def describe(self) -> str:
        return f"{self.name!r} {self.detail}"


@attrs.frozen
class ManifestError(CoreError):
    """A refit manifest or stream problem; ``problems`` names every offending tensor."""

    problems: tuple[TensorProblem, ...] = ()
    bucket_index: int | None = None
    used_bytes: tuple[int, int] | None = None  # (declared, expected by the slots)

    def names(self, kind: Deviation) -> tuple[str, ...]:
        return tuple(p.name for p in self.problems if p.kind is kind)

    @property
    def missing(self) -> tuple[str, ...]:
        return self.names(Deviation.MISSING)

    @property
    def unexpected(self) -> tuple[str, ...]:
        return self.names(Deviation.UNEXPECTED)

    @property
    def mismatched(self) -> tuple[str, ...]:
        return self.names(Deviation.MISMATCHED)

    @property
    def duplicated(self) -> tuple[str, ...]:
        return self.names(Deviation.DUPLICATED)


def _manifest_error(
    context: str,
    problems: Sequence[TensorProblem],
    *,
    bucket_index: int | None = None,
    used_bytes: tuple[int, int] | None = None,
) -> ManifestError:
    parts = [p.describe() for p in problems[:_MAX_NAMED]]
    if len(problems) > _MAX_NAMED:
        parts.append(f"and {len(problems) - _MAX_NAMED} more")
    if used_bytes is not None:
        parts.append(
            f"used_bytes is {used_bytes[0]} but its slots' aligned sizes sum to {used_bytes[1]}"
        )
    return ManifestError(
        f"{context}: " + "; ".join(parts),
        problems=tuple(problems),
        bucket_index=bucket_index,
        used_bytes=used_bytes,
    )


def _check_unique(_inst: object, _attr: object, value: tuple[TensorSpec, ...]) -> None:
    names = [s.name for s in value]
    if not names or len(set(names)) != len(names):
        raise ValueError("a manifest needs at least one tensor and unique names")


def _index_specs(manifest: Manifest) -> Mapping[str, TensorSpec]:
    return MappingProxyType({s.name: s for s in manifest.specs})


def _digest_specs(manifest: Manifest) -> str:
    h = hashlib.sha256()
    for spec in sorted(manifest.specs, key=lambda s: s.name):
        h.update(f"{spec.name}\0{','.join(map(str, spec.shape))}\0{spec.dtype}\n".encode())
    return h.hexdigest()


@attrs.frozen
class Manifest:
    """Every tensor a refit carries, each exactly once (from ``prepare_refit_info``)."""

    specs: tuple[TensorSpec, ...] = attrs.field(validator=_check_unique)
    _index: Mapping[str, TensorSpec] = attrs.field(
        init=False,
        repr=False,
        eq=False,
        default=attrs.Factory(_index_specs, takes_self=True),
    )
    _digest: str = attrs.field(
        init=False,
        repr=False,
        eq=False,
        default=attrs.Factory(_digest_specs, takes_self=True),
    )

    @classmethod
    def from_specs(cls, specs: Iterable[TensorSpec]) -> Result[Manifest, ManifestError]:
        specs = tuple(specs)
        if not specs:
            return Failure(_empty_manifest())
        seen: set[str] = set()
        problems: list[TensorProblem] = []
        for spec in specs:
            if spec.name in seen:
                problems.append(TensorProblem(spec.name, Deviation.DUPLICATED, "listed twice"))
            seen.add(spec.name)
        if problems:
            return Failure(_manifest_error("invalid refit manifest", problems))
        return Success(cls(specs))

    @classmethod
    def from_info(cls, info: Mapping[_K, object]) -> Result[Manifest, ManifestError]:
        """Build from ``{name: (shape, dtype)}``, naming every invalid entry at once.

        Shapes are sequences of non-negative ints; dtypes are torch dtypes or their names
        (``"bfloat16"`` or ``"torch.bfloat16"``).
        """
        if not info:
            return Failure(_empty_manifest())
        specs: list[TensorSpec] = []
        problems: list[TensorProblem] = []
        for name, entry in info.items():
            spec = _parse_entry(name, entry)
            if isinstance(spec, TensorProblem):
                problems.append(spec)
            else:
                specs.append(spec)
        if problems:
            return Failure(_manifest_error("invalid refit manifest", problems))
        return Success(cls(tuple(specs)))

    def get(self, name: str) -> TensorSpec | None:
        return self._index.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def to_info(self) -> dict[str, list[object]]:
        """``{name: [shape as a list, dtype name]}``: the msgpack-able form of the manifest."""
        return {s.name: [list(s.shape), s.dtype] for s in self.specs}

    def digest(self) -> str:
        """A hash of the names, shapes and dtypes, independent of their order."""
        return self._digest


def _empty_manifest() -> ManifestError:
    return ManifestError("invalid refit manifest: it names no tensors")


def _parse_entry(name: object, entry: object) -> TensorSpec | TensorProblem:
    label = name if isinstance(name, str) else repr(name)
    if not isinstance(name, str) or not name:
        return TensorProblem(label, Deviation.INVALID, "is not a non-empty str name")
    if not isinstance(entry, list | tuple) or len(entry) != 2:
        return TensorProblem(name, Deviation.INVALID, f"needs (shape, dtype), got {entry!r}")
    shape, dtype = entry
    if not isinstance(shape, list | tuple | torch.Size) or not all(_is_dim(d) for d in shape):
        return TensorProblem(
            name, Deviation.INVALID, f"has shape {shape!r}; dims must be non-negative ints"
        )
    if not isinstance(dtype, str | torch.dtype) or dtype_name(dtype) not in DTYPE_ITEMSIZE:
        return TensorProblem(name, Deviation.INVALID, f"has unknown dtype {dtype!r}")
    return TensorSpec(name, tuple(shape), dtype_name(dtype))


@attrs.frozen
class ReceiveProgress:
    """What a receiver has taken in so far: names, buckets and payload bytes."""

    received: frozenset[str] = frozenset()
    buckets: int = 0
    nbytes: int = 0


def check_bucket(
    manifest: Manifest, progress: ReceiveProgress, bucket: Bucket
) -> Result[ReceiveProgress, ManifestError]:
    """Accept ``bucket`` if every slot is expected, intact, new and in its aligned place."""
    problems: list[TensorProblem] = []
    here: set[str] = set()
    position = 0
    for slot in bucket.slots:
        spec = manifest.get(slot.name)
        if spec is None:
            problems.append(
                TensorProblem(slot.name, Deviation.UNEXPECTED, "is not in the manifest")
            )
        elif (slot.shape, slot.dtype) != (spec.shape, spec.dtype) or slot.nbytes != spec.nbytes:
            problems.append(
                TensorProblem(
                    slot.name,
                    Deviation.MISMATCHED,
                    f"expected {spec.describe()} ({spec.nbytes} bytes), got "
                    f"{_describe(slot.shape, slot.dtype)} ({slot.nbytes} bytes)",
                )
            )
        if slot.name in progress.received or slot.name in here:
            problems.append(TensorProblem(slot.name, Deviation.DUPLICATED, "arrived twice"))
        here.add(slot.name)
        if slot.offset != position:
            problems.append(
                TensorProblem(
                    slot.name,
                    Deviation.MISPLACED,
                    f"lies at offset {slot.offset}, expected {position} "
                    f"({ALIGNMENT}-byte aligned, right after the previous slot)",
                )
            )
        position += align_up(slot.nbytes)
    used = None if bucket.used_bytes == position else (bucket.used_bytes, position)
    if problems or used is not None:
        return Failure(
            _manifest_error(
                f"refit bucket {bucket.index} does not match the manifest",
                problems,
                bucket_index=bucket.index,
                used_bytes=used,
            )
        )
    return Success(
        ReceiveProgress(
            received=progress.received | here,
            buckets=progress.buckets + 1,
            nbytes=progress.nbytes + bucket.payload_bytes,
        )
    )


def check_complete(
    manifest: Manifest, progress: ReceiveProgress
) -> Result[ReceiveProgress, ManifestError]:
    """Accept the end of a refit only if every expected tensor arrived."""
    missing = [
        TensorProblem(s.name, Deviation.MISSING, "never arrived")
        for s in manifest.specs
        if s.name not in progress.received
    ]
    if missing:
        return Failure(_manifest_error("the refit ended incomplete", missing))
    return Success(progress)


def bucket_checksum(data: bytes | bytearray | memoryview) -> int:
    """Adler-32 of a bucket's used bytes: a cheap end-to-end check of the copy."""
    return zlib.adler32(data) & 0xFFFFFFFF
