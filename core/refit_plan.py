"""The refit manifest and its checks, and the staging layout's alignment (pure values).

Theory of operation
-------------------
The receiver knows what to expect from ``prepare_refit_info({name: (shape, dtype)})``:
a :class:`Manifest` (every tensor exactly once, digested independently of order, so a
sender can prove it means the same one). A stream that departs from it is described by a
:class:`ManifestError` naming every offending tensor and how (:class:`Deviation`), never
a bare boolean (NeMo-RL's ``IPCWeightManifestError`` in ``vllm_backend.py`` is the model;
vllm#53233 shows the bare assert this replaces). The protocol that checks a refit against
its manifest is :mod:`genworker.core.refit_protocol`.

Packed tensors lie in a staging buffer at offsets that are multiples of
:data:`ALIGNMENT` (512 bytes, the alignment NeMo-RL's packed refit uses), so every one can
be viewed in place as its dtype; a staging budget is a positive multiple of it
(:func:`bucket_budget`).
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Final, TypeVar

import attrs
import torch
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "ALIGNMENT",
    "DTYPE_ITEMSIZE",
    "Deviation",
    "Manifest",
    "ManifestError",
    "RefitPlanError",
    "TensorProblem",
    "TensorSpec",
    "align_up",
    "bucket_budget",
    "dtype_name",
    "manifest_error",
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


def manifest_error(context: str, problems: Sequence[TensorProblem]) -> ManifestError:
    """A :class:`ManifestError` naming every problem (the first few in its message)."""
    parts = [p.describe() for p in problems[:_MAX_NAMED]]
    if len(problems) > _MAX_NAMED:
        parts.append(f"and {len(problems) - _MAX_NAMED} more")
    return ManifestError(f"{context}: " + "; ".join(parts), problems=tuple(problems))


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
            return Failure(manifest_error("invalid refit manifest", problems))
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
            return Failure(manifest_error("invalid refit manifest", problems))
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
