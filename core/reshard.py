"""Shard-to-shard refit plans: which trainer rank copies which slice into which engine
shard (pure values).

Theory of operation
-------------------
*Boxes.* A region of a tensor is a :data:`Box`: one half-open ``(start, stop)`` range per
dimension. Every layout is a set of boxes in the *global* (unsharded) coordinates of a
named tensor.

*Trainer side.* A :class:`TrainerLayout` says which ranks hold which box of a trainer
tensor; boxes may overlap (replicas). Two builders cover the usual trainers:

- :func:`megatron_layout`: a PP stage's TP ranks split ``tp_dim`` evenly (Megatron
  asserts divisibility), or all hold it (``tp_dim=None``); each TP shard may be held by
  several ranks (data-parallel replicas);
- :func:`dtensor_layout`: a device mesh (shape and rank ids, row-major) and one placement
  per mesh dimension, :class:`Shard` ``(dim)`` or :class:`Replicate` ``()``, as torch's
  ``DTensor`` places them: mesh dimensions are applied in order, and a ``Shard(d)`` cuts
  the range the earlier ones left on ``d`` the way ``torch.chunk`` does (chunks of
  ``ceil(n / k)``, the last ones shorter or empty).

*Engine side.* An :class:`EngineShard` is one engine rank's parameter: its local shape
and its :class:`ShardPiece` s, each a box of a trainer tensor and where it lands in the local
shard (a box of the same extents), plus padding boxes that no trainer tensor fills
(vLLM's vocabulary padding). :func:`vllm_shard` derives it from the facts vLLM's layers
use (``vllm/model_executor/layers/linear.py`` and ``vocab_parallel_embedding.py``,
0.32):

- ``REPLICATED``: the whole tensor on every rank (``ReplicatedLinear``, norms, and a
  row-parallel layer's bias);
- ``COLUMN`` / ``ROW``: ``output_dim`` / ``input_dim`` split evenly by TP (``divide``);
- ``VOCAB``: rows padded to a multiple of ``padding_size`` (64), then split evenly;
  rows past the real vocabulary are padding;
- ``MERGED`` (``gate_up_proj``): each source split evenly by TP on ``output_dim`` and the
  local parts stacked in source order;
- ``QKV`` (``qkv_proj``): q, k, v each split by TP on ``output_dim`` and stacked; with
  fewer kv heads than TP ranks each rank keeps one kv head, ``tp // kv_heads`` ranks
  sharing it (``shard_rank = tp_rank // num_kv_head_replicas``).

*The plan.* :func:`plan_reshard` cuts each piece's trainer box along every boundary of
the trainer boxes that meet it (elementary cells, each wholly inside or outside every
trainer box), and reads each cell from exactly one holder: the least loaded so far (bytes
sent), ties to the lower rank, so replicas share the reading. Its laws: every element of
every engine shard is written exactly once (by a copy, or as padding); a trainer rank
sends only elements it holds; an engine rank receives exactly its shard's bytes, less
padding. Anything the plan cannot honour is a :class:`ReshardError` naming every
offending parameter and the ranks involved, never a partial plan.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final, TypeVar

import attrs
import msgspec
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError
from genworker.core.refit_plan import DTYPE_ITEMSIZE, Manifest, TensorSpec

__all__ = [
    "Box",
    "Copy",
    "EnginePlans",
    "EngineShard",
    "LayerKind",
    "Problem",
    "Replicate",
    "ReshardError",
    "ReshardPlan",
    "Shard",
    "ShardPiece",
    "SourceShard",
    "TrainerLayout",
    "VllmLayer",
    "VllmParamFacts",
    "box_numel",
    "bytes_of",
    "check_ranks",
    "dtensor_layout",
    "engine_shards",
    "fit_group",
    "header_problem",
    "intersect",
    "megatron_layout",
    "outgoing",
    "p2p_tags",
    "packed_sources",
    "parse_refit_info",
    "parse_shards",
    "plan_digest",
    "plan_engine",
    "plan_reshard",
    "plan_stage",
    "prepared_params",
    "rank_problems",
    "read_header",
    "ready_to_receive",
    "refit_info",
    "refit_info_of",
    "sender_problems",
    "start_header",
    "trainer_header_problem",
    "vllm_facts",
    "vllm_shard",
]

_T = TypeVar("_T")
Box = tuple[tuple[int, int], ...]
_MAX_NAMED: Final = 12


def box_numel(box: Box) -> int:
    return math.prod(max(0, b - a) for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or ``None`` when they share no element."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, d) for d in shape)


def _shift(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of a tensor whose global box is ``origin``."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


# --- errors ------------------------------------------------------------------------


class Problem(enum.Enum):
    MISSING = "missing"  # an engine shard needs elements no trainer rank holds
    MISSHAPED = "misshaped"  # a shard's box or shape does not fit its tensor
    UNKNOWN = "unknown"  # an engine piece names a trainer tensor nobody described
    MISMATCHED = "mismatched"  # dtypes differ between a piece's source and its shard
    INVALID = "invalid"  # facts that no vLLM layer could have


@attrs.frozen
class ParamProblem:
    """One parameter's problem, with the ranks involved (trainer or engine, per kind)."""

    param: str
    kind: Problem
    ranks: tuple[int, ...]
    detail: str

    def describe(self) -> str:
        return f"{self.param!r} ({self.kind.value}; ranks {list(self.ranks)}): {self.detail}"


@attrs.frozen
class ReshardError(CoreError):
    """The layouts cannot make a reshard plan; ``problems`` names every parameter."""

    problems: tuple[ParamProblem, ...] = ()

    def params(self, kind: Problem) -> tuple[str, ...]:
        return tuple(p.param for p in self.problems if p.kind is kind)


def _error(context: str, problems: Sequence[ParamProblem]) -> ReshardError:
    shown = [p.describe() for p in problems[:_MAX_NAMED]]
    if len(problems) > _MAX_NAMED:
        shown.append(f"and {len(problems) - _MAX_NAMED} more")
    return ReshardError(f"{context}: " + "; ".join(shown), problems=tuple(problems))


# --- the trainer side --------------------------------------------------------------


@attrs.frozen
class SourceShard:
    """Trainer rank ``rank`` holds ``box`` of the tensor (global coordinates)."""

    rank: int
    box: Box


@attrs.frozen
class TrainerLayout:
    """Where a trainer tensor lives: its global shape, dtype and every rank's box."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    shards: tuple[SourceShard, ...]

    def check(self) -> list[ParamProblem]:
        """Every shard's box must lie inside the shape, one range per dimension."""
        problems = []
        if self.dtype not in DTYPE_ITEMSIZE:
            problems.append(
                ParamProblem(self.name, Problem.INVALID, (), f"has unknown dtype {self.dtype!r}")
            )
        for shard in self.shards:
            box = shard.box
            fits = len(box) == len(self.shape) and all(
                0 <= a <= b <= d for (a, b), d in zip(box, self.shape, strict=True)
            )
            if not fits:
                problems.append(
                    ParamProblem(
                        self.name,
                        Problem.MISSHAPED,
                        (shard.rank,),
                        f"rank {shard.rank} holds {list(box)}, outside the shape {list(self.shape)}",
                    )
                )
        return problems


def rank_problems(layouts: Iterable[TrainerLayout], train_ranks: int) -> list[ParamProblem]:
    """Every layout that names a trainer rank outside the group's ``train_ranks`` trainer
    ranks (``0 .. train_ranks - 1``): no rank would ever send it, so a refit would wait
    its whole bound for it. Each layout named once, with its ranks."""
    problems = []
    for layout in layouts:
        outside = sorted({s.rank for s in layout.shards if not 0 <= s.rank < train_ranks})
        if outside:
            problems.append(
                ParamProblem(
                    layout.name,
                    Problem.INVALID,
                    tuple(outside),
                    f"the layout names trainer rank(s) {outside}, outside the group's "
                    f"{train_ranks} trainer rank(s) 0..{train_ranks - 1}",
                )
            )
    return problems


def check_ranks(
    stages: Sequence[Sequence[TrainerLayout]], train_ranks: int
) -> Result[None, ReshardError]:
    """Layouts naming a trainer rank the joined groups do not have (:func:`rank_problems`),
    refused naming every one."""
    if problems := rank_problems([lay for layouts in stages for lay in layouts], train_ranks):
        detail = "; ".join(pp.describe() for pp in problems)
        return Failure(ReshardError(f"reshard refit_info: {detail}", problems=tuple(problems)))
    return Success(None)


def megatron_layout(
    name: str,
    shape: Sequence[int],
    dtype: str,
    tp_dim: int | None,
    tp_ranks: Sequence[Sequence[int]],
) -> Result[TrainerLayout, ReshardError]:
    """A Megatron-style tensor of one PP stage: ``tp_ranks[i]`` hold TP shard ``i``.

    ``tp_dim=None``: every TP shard is the whole tensor (norms, replicated biases).
    The split must be even, as Megatron's ``divide`` asserts.
    """
    shape = tuple(shape)
    tp = len(tp_ranks)
    everyone = tuple(r for group in tp_ranks for r in group)
    if tp == 0 or any(not group for group in tp_ranks):
        return Failure(
            _error(
                "invalid Megatron layout",
                [ParamProblem(name, Problem.INVALID, everyone, "every TP shard needs a rank")],
            )
        )
    if tp_dim is not None and (not 0 <= tp_dim < len(shape) or shape[tp_dim] % tp):
        return Failure(
            _error(
                "invalid Megatron layout",
                [
                    ParamProblem(
                        name,
                        Problem.MISSHAPED,
                        everyone,
                        f"dim {tp_dim} of {list(shape)} does not split evenly {tp} ways",
                    )
                ],
            )
        )
    shards: list[SourceShard] = []
    for index, group in enumerate(tp_ranks):
        box = list(_full(shape))
        if tp_dim is not None:
            size = shape[tp_dim] // tp
            box[tp_dim] = (index * size, (index + 1) * size)
        shards.extend(SourceShard(rank, tuple(box)) for rank in group)
    return _checked_layout(TrainerLayout(name, shape, dtype, tuple(shards)))


@attrs.frozen
class Shard:
    """DTensor's ``Shard(dim)``: the mesh dimension cuts tensor dimension ``dim``."""

    dim: int


@attrs.frozen
class Replicate:
    """DTensor's ``Replicate()``: every coordinate of the mesh dimension holds it all."""


def _chunk(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s ``index``-th of ``parts`` chunks of ``[lo, hi)`` (maybe empty)."""
    size = -(-(hi - lo) // parts)
    return min(hi, lo + index * size), min(hi, lo + (index + 1) * size)


def dtensor_layout(
    name: str,
    shape: Sequence[int],
    dtype: str,
    mesh_shape: Sequence[int],
    mesh_ranks: Sequence[int],
    placements: Sequence[Shard | Replicate],
) -> Result[TrainerLayout, ReshardError]:
    """A ``DTensor`` over a device mesh (``mesh_ranks`` row-major over ``mesh_shape``)."""
    shape, mesh_shape = tuple(shape), tuple(mesh_shape)
    ranks = tuple(mesh_ranks)
    bad = []
    if (
        len(placements) != len(mesh_shape)
        or math.prod(mesh_shape) != len(ranks)
        or any(d < 1 for d in mesh_shape)
    ):
        bad.append(
            f"a mesh of shape {list(mesh_shape)} with {len(ranks)} ranks and "
            f"{len(placements)} placements"
        )
    bad.extend(
        f"Shard({p.dim}) of a {len(shape)}-d tensor"
        for p in placements
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape)
    )
    if bad:
        return Failure(
            _error(
                "invalid DTensor layout",
                [ParamProblem(name, Problem.INVALID, ranks, "; ".join(bad))],
            )
        )
    shards = []
    for flat, rank in enumerate(ranks):
        coords = []
        for size in reversed(mesh_shape):
            coords.append(flat % size)
            flat //= size
        coords.reverse()
        box = list(_full(shape))
        for coord, size, placement in zip(coords, mesh_shape, placements, strict=True):
            if isinstance(placement, Shard):
                lo, hi = box[placement.dim]
                box[placement.dim] = _chunk(lo, hi, size, coord)
        shards.append(SourceShard(rank, tuple(box)))
    return _checked_layout(TrainerLayout(name, shape, dtype, tuple(shards)))


def _checked_layout(layout: TrainerLayout) -> Result[TrainerLayout, ReshardError]:
    problems = layout.check()
    if problems:
        return Failure(_error("invalid trainer layout", problems))
    return Success(layout)


# --- the engine side ---------------------------------------------------------------


@attrs.frozen
class ShardPiece:
    """``source``'s global ``source_box`` lands at ``dest_box`` of the engine shard."""

    source: str
    source_box: Box
    dest_box: Box


@attrs.frozen
class EngineShard:
    """Engine rank ``rank``'s part of parameter ``param``: its local shape and contents."""

    param: str
    rank: int
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[ShardPiece, ...]
    padding: tuple[Box, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE[self.dtype]


class LayerKind(enum.Enum):
    """How vLLM splits a parameter across its TP ranks."""

    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    MERGED = "merged"
    QKV = "qkv"


@attrs.frozen
class VllmParamFacts:
    """What vLLM knows about one parameter on one TP rank, as plain values.

    ``sources``: the trainer tensors it is made of, with their global shapes, in fused
    order (one for every kind but ``MERGED`` (gate, up) and ``QKV`` (q, k, v)).
    ``output_dim`` / ``input_dim``: the parameter's attributes of those names (``None``
    when absent). ``QKV`` also needs ``head_size``, ``num_heads`` and ``num_kv_heads``
    (the totals); ``VOCAB`` uses ``padding_size``.
    """

    param: str
    kind: LayerKind
    dtype: str
    tp_rank: int
    tp_size: int
    sources: tuple[tuple[str, tuple[int, ...]], ...]
    output_dim: int | None = 0
    input_dim: int | None = 1
    head_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    padding_size: int = 64


#: A layer's size attribute as an int: ``(name, default)`` -> the attribute's value,
#: ``default`` when the layer has no such attribute, ``None`` when it is ``None`` there.
SizeOf = Callable[[str, "int | None"], "int | None"]


@attrs.frozen
class VllmLayer:
    """One vLLM layer as :func:`vllm_facts` reads it: its class's name, the class names
    along its MRO, its sizes (read when needed) and ``output_sizes`` (a fused layer's)."""

    layer: str
    classes: frozenset[str]
    size_of: SizeOf = attrs.field(eq=False)
    output_sizes: tuple[int, ...] = ()


class _NoSize(Exception):
    """A size the layer does not have (:func:`vllm_facts` answers it as a ReshardError)."""


def vllm_facts(
    layer: VllmLayer,
    name: str,
    local: str,
    param: tuple[tuple[int, ...], str, int | None, int | None],
    subs: Sequence[str],
) -> Result[VllmParamFacts, ReshardError]:
    """The facts of parameter ``name`` (``local`` in its layer; ``param``: its shape,
    dtype, ``output_dim`` and ``input_dim`` attributes) from its layer's class names and
    sizes, its sources named ``subs`` (a fused layer's, in fused order)."""

    def size(attr: str, default: int | None = None) -> int:
        value = layer.size_of(attr, default)
        if value is None:
            raise _NoSize(f"{layer.layer} has no {attr!r}: no reshard layout")
        return value

    classes, bias = layer.classes, local == "bias"
    param_shape, dtype, out_dim, in_dim = param
    common = {
        "output_dim": 0 if out_dim is None else out_dim,
        "input_dim": 1 if in_dim is None else in_dim,
    }

    def shape(rows: int) -> tuple[int, ...]:
        return (rows,) if bias else (rows, size("input_size"))

    def facts(
        kind: LayerKind, sources: Iterable[tuple[str, tuple[int, ...]]], **kw: int
    ) -> VllmParamFacts:
        rank, tp = size("tp_rank", 0), size("tp_size", 1)
        return VllmParamFacts(name, kind, dtype, rank, tp, tuple(sources), **common, **kw)

    try:
        if "VocabParallelEmbedding" in classes:
            full = (size("org_vocab_size"), size("embedding_dim"))
            padding = size("padding_size", 64)
            return Success(facts(LayerKind.VOCAB, [(name, full)], padding_size=padding))
        if "QKVParallelLinear" in classes:
            hs, heads, kv = size("head_size"), size("total_num_heads"), size("total_num_kv_heads")
            rows = (heads * hs, kv * hs, kv * hs)
            sources = zip(subs, map(shape, rows), strict=False)
            heads_of = {"head_size": hs, "num_heads": heads, "num_kv_heads": kv}
            return Success(facts(LayerKind.QKV, sources, **heads_of))
        if "MergedColumnParallelLinear" in classes:
            sources = zip(subs, map(shape, layer.output_sizes), strict=False)
            return Success(facts(LayerKind.MERGED, sources))
        if "LinearBase" in classes:
            kind = LayerKind.REPLICATED
            if "ColumnParallelLinear" in classes:
                kind = LayerKind.COLUMN
            elif "RowParallelLinear" in classes and not bias:
                kind = LayerKind.ROW
            return Success(facts(kind, [(subs[0], shape(size("output_size")))]))
        return Success(facts(LayerKind.REPLICATED, [(name, param_shape)]))
    except _NoSize as e:
        return Failure(ReshardError(str(e)))


def _invalid(facts: VllmParamFacts, detail: str) -> Failure[ReshardError]:
    return Failure(
        _error(
            f"invalid vLLM facts for {facts.param!r}",
            [ParamProblem(facts.param, Problem.INVALID, (facts.tp_rank,), detail)],
        )
    )


def vllm_shard(facts: VllmParamFacts) -> Result[EngineShard, ReshardError]:
    """The engine shard vLLM builds for ``facts`` (see the module docstring)."""
    tp, rank = facts.tp_size, facts.tp_rank
    if tp < 1 or not 0 <= rank < tp:
        return _invalid(facts, f"tp rank {rank} of tp size {tp}")
    expected = {LayerKind.MERGED: None, LayerKind.QKV: 3}.get(facts.kind, 1)
    if not facts.sources or (expected is not None and len(facts.sources) != expected):
        return _invalid(
            facts, f"a {facts.kind.value} parameter made of {len(facts.sources)} sources"
        )
    first = facts.sources[0][1]
    if any(len(s) != len(first) for _, s in facts.sources):
        return _invalid(facts, "sources of different ranks")
    if facts.kind is LayerKind.REPLICATED:
        name, shape = facts.sources[0]
        box = _full(shape)
        return Success(
            EngineShard(facts.param, rank, shape, facts.dtype, (ShardPiece(name, box, box),))
        )
    split = facts.input_dim if facts.kind is LayerKind.ROW else facts.output_dim
    if split is None or not 0 <= split < len(first):
        return _invalid(facts, f"split dim {split} of a {len(first)}-d parameter")
    if facts.kind is LayerKind.VOCAB:
        return _vocab(facts, split)
    if facts.kind is LayerKind.QKV:
        return _qkv(facts, split)
    uneven = [name for name, shape in facts.sources if shape[split] % tp]
    if uneven:
        return _invalid(facts, f"dim {split} of {uneven} does not split {tp} ways")
    return _even_split(facts, split, [(s, s[1][split] // tp, rank) for s in facts.sources])


def _even_split(
    facts: VllmParamFacts,
    split: int,
    parts: Sequence[tuple[tuple[str, tuple[int, ...]], int, int]],
) -> Result[EngineShard, ReshardError]:
    """Stack along ``split`` rows ``[r * size, (r + 1) * size)`` of each (source, size, r)."""
    pieces = []
    offset = 0
    base = parts[0][0][1]
    for (name, shape), size, shard_rank in parts:
        if any(a != b for i, (a, b) in enumerate(zip(shape, base, strict=True)) if i != split):
            return _invalid(facts, f"{name!r} of {list(shape)} does not stack with {list(base)}")
        source = list(_full(shape))
        source[split] = (shard_rank * size, (shard_rank + 1) * size)
        dest = list(_full(shape))
        dest[split] = (offset, offset + size)
        pieces.append(ShardPiece(name, tuple(source), tuple(dest)))
        offset += size
    local = list(base)
    local[split] = offset
    return Success(
        EngineShard(facts.param, facts.tp_rank, tuple(local), facts.dtype, tuple(pieces))
    )


def _vocab(facts: VllmParamFacts, split: int) -> Result[EngineShard, ReshardError]:
    name, shape = facts.sources[0]
    if facts.padding_size < 1:
        return _invalid(facts, f"padding size {facts.padding_size}")
    padded = -(-shape[split] // facts.padding_size) * facts.padding_size
    if padded % facts.tp_size:
        return _invalid(facts, f"padded vocabulary {padded} does not split {facts.tp_size} ways")
    size = padded // facts.tp_size
    lo, hi = facts.tp_rank * size, (facts.tp_rank + 1) * size
    real = min(hi, shape[split])
    local = list(shape)
    local[split] = size
    pieces, padding = [], []
    if real > lo:
        source, dest = list(_full(shape)), list(_full(local))
        source[split], dest[split] = (lo, real), (0, real - lo)
        pieces.append(ShardPiece(name, tuple(source), tuple(dest)))
    if hi > max(lo, real):
        pad = list(_full(local))
        pad[split] = (max(lo, real) - lo, size)
        padding.append(tuple(pad))
    return Success(
        EngineShard(
            facts.param, facts.tp_rank, tuple(local), facts.dtype, tuple(pieces), tuple(padding)
        )
    )


def _qkv(facts: VllmParamFacts, split: int) -> Result[EngineShard, ReshardError]:
    tp, hs = facts.tp_size, facts.head_size
    heads, kv = facts.num_heads, facts.num_kv_heads
    if hs < 1 or heads < 1 or kv < 1 or heads % tp or (tp % kv if tp >= kv else kv % tp):
        return _invalid(facts, f"{heads} heads, {kv} kv heads of size {hs} over tp {tp}")
    q, k, v = facts.sources
    if (q[1][split], k[1][split], v[1][split]) != (heads * hs, kv * hs, kv * hs):
        return _invalid(
            facts,
            f"q, k, v of {q[1][split]}, {k[1][split]}, {v[1][split]} rows for {heads} heads "
            f"and {kv} kv heads of size {hs}",
        )
    local_kv, replicas = (1, tp // kv) if tp >= kv else (kv // tp, 1)
    kv_rank = facts.tp_rank // replicas
    return _even_split(
        facts,
        split,
        [
            (q, heads // tp * hs, facts.tp_rank),
            (k, local_kv * hs, kv_rank),
            (v, local_kv * hs, kv_rank),
        ],
    )


# --- the plan ----------------------------------------------------------------------


@attrs.frozen
class Copy:
    """Trainer rank ``src_rank`` copies ``src_box`` of its local shard of ``source`` into
    ``dest_box`` of engine rank ``dst_rank``'s shard of ``param`` (same extents)."""

    src_rank: int
    dst_rank: int
    source: str
    param: str
    src_box: Box  # in the trainer rank's local coordinates
    dest_box: Box  # in the engine shard's local coordinates
    global_box: Box  # the same elements in the source's global coordinates
    itemsize: int

    @property
    def nbytes(self) -> int:
        return box_numel(self.dest_box) * self.itemsize


@attrs.frozen
class ReshardPlan:
    """Every copy of a reshard refit, in a deterministic order."""

    copies: tuple[Copy, ...]

    def pairs(self) -> dict[tuple[int, int], tuple[Copy, ...]]:
        """The copies of each (trainer rank, engine rank) pair that has any."""
        out: dict[tuple[int, int], list[Copy]] = {}
        for c in self.copies:
            out.setdefault((c.src_rank, c.dst_rank), []).append(c)
        return {k: tuple(v) for k, v in out.items()}

    def bytes_to(self, engine_rank: int) -> int:
        return sum(c.nbytes for c in self.copies if c.dst_rank == engine_rank)

    def bytes_from(self, trainer_rank: int) -> int:
        return sum(c.nbytes for c in self.copies if c.src_rank == trainer_rank)


def _cells(box: Box, holders: Sequence[SourceShard]) -> list[Box]:
    """``box`` cut at every boundary of ``holders`` inside it: each cell lies wholly
    inside or outside each holder's box."""
    cuts: list[list[int]] = []
    for dim, (lo, hi) in enumerate(box):
        points = {lo, hi}
        for h in holders:
            points.update(p for p in h.box[dim] if lo < p < hi)
        cuts.append(sorted(points))
    cells: list[Box] = [()]
    for cut in cuts:
        cells = [(*c, (a, b)) for c in cells for a, b in itertools.pairwise(cut)]
    return [c for c in cells if box_numel(c) > 0]


def plan_reshard(
    trainer: Iterable[TrainerLayout], engine: Iterable[EngineShard]
) -> Result[ReshardPlan, ReshardError]:
    """The copies that fill every engine shard from the trainer shards, or every reason
    it cannot (missing elements, misshaped shards, unknown tensors, dtype mismatches)."""
    layouts = {layout.name: layout for layout in trainer}
    problems: list[ParamProblem] = []
    broken: set[str] = set()  # layouts already named as misshaped: nothing to plan from
    for described in layouts.values():
        found = described.check()
        problems.extend(found)
        if found:
            broken.add(described.name)
    loads: dict[int, int] = {}
    copies: list[Copy] = []
    for shard in engine:
        shard_problems = _check_engine_shard(shard)
        problems.extend(shard_problems)
        for piece in () if shard_problems else shard.pieces:
            layout = layouts.get(piece.source)
            if piece.source in broken:
                continue
            if layout is None:
                problems.append(
                    ParamProblem(
                        shard.param,
                        Problem.UNKNOWN,
                        (shard.rank,),
                        f"engine rank {shard.rank} needs {piece.source!r}, which no trainer "
                        "layout describes",
                    )
                )
                continue
            if layout.dtype != shard.dtype:
                problems.append(
                    ParamProblem(
                        shard.param,
                        Problem.MISMATCHED,
                        (shard.rank,),
                        f"{piece.source!r} is {layout.dtype}, the engine shard {shard.dtype}",
                    )
                )
                continue
            if (
                len(piece.source_box) != len(layout.shape)
                or intersect(piece.source_box, _full(layout.shape)) != piece.source_box
            ):
                problems.append(
                    ParamProblem(
                        shard.param,
                        Problem.MISSHAPED,
                        (shard.rank,),
                        f"engine rank {shard.rank} needs {list(piece.source_box)} of "
                        f"{piece.source!r}, whose shape is {list(layout.shape)}",
                    )
                )
                continue
            problems.extend(_plan_piece(shard, piece, layout, loads, copies))
    if problems:
        return Failure(_error("cannot plan the reshard refit", problems))
    return Success(ReshardPlan(tuple(copies)))


def _check_engine_shard(shard: EngineShard) -> list[ParamProblem]:
    """The pieces and padding must tile the local shape exactly (no overlap, no hole)."""
    boxes = [p.dest_box for p in shard.pieces] + list(shard.padding)
    problems = []
    full = _full(shard.shape)
    covered = 0
    for i, box in enumerate(boxes):
        if len(box) != len(shard.shape) or intersect(box, full) != box:
            problems.append(f"box {list(box)} lies outside the shard's shape {list(shard.shape)}")
            continue
        covered += box_numel(box)
        problems.extend(
            f"boxes {list(box)} and {list(other)} overlap"
            for other in boxes[i + 1 :]
            if len(other) == len(box) and intersect(box, other) is not None
        )
    if not problems and covered != shard.numel:
        problems.append(f"its pieces cover {covered} of its {shard.numel} elements")
    for piece in shard.pieces:
        extents = [b - a for a, b in piece.dest_box]
        if extents != [b - a for a, b in piece.source_box]:
            problems.append(
                f"piece of {piece.source!r} changes extents {list(piece.source_box)} -> {list(piece.dest_box)}"
            )
    return [
        ParamProblem(
            shard.param, Problem.MISSHAPED, (shard.rank,), f"engine rank {shard.rank}: {p}"
        )
        for p in problems
    ]


def _plan_piece(
    shard: EngineShard,
    piece: ShardPiece,
    layout: TrainerLayout,
    loads: dict[int, int],
    copies: list[Copy],
) -> list[ParamProblem]:
    holders = [h for h in layout.shards if intersect(h.box, piece.source_box) is not None]
    itemsize = DTYPE_ITEMSIZE[layout.dtype]
    missing = 0
    for cell in _cells(piece.source_box, holders):
        able = [h for h in holders if intersect(h.box, cell) == cell]
        if not able:
            missing += box_numel(cell)
            continue
        chosen = min(able, key=lambda h: (loads.get(h.rank, 0), h.rank))
        nbytes = box_numel(cell) * itemsize
        loads[chosen.rank] = loads.get(chosen.rank, 0) + nbytes
        origin = piece.source_box
        dest = tuple(
            (d0 + a - o0, d0 + b - o0)
            for (a, b), (o0, _), (d0, _) in zip(cell, origin, piece.dest_box, strict=True)
        )
        copies.append(
            Copy(
                src_rank=chosen.rank,
                dst_rank=shard.rank,
                source=layout.name,
                param=shard.param,
                src_box=_shift(cell, chosen.box),
                dest_box=dest,
                global_box=cell,
                itemsize=itemsize,
            )
        )
    if missing:
        return [
            ParamProblem(
                shard.param,
                Problem.MISSING,
                (shard.rank,),
                f"engine rank {shard.rank} needs {missing} elements of {layout.name!r} in "
                f"{list(piece.source_box)} that no trainer rank holds "
                f"(held: {sorted({h.rank for h in layout.shards})})",
            )
        ]
    return []


# --- the rounds of a refit ----------------------------------------------------------


def bytes_of(shards: Iterable[EngineShard], rank: int) -> int:
    """The bytes engine rank ``rank``'s shards hold, less padding (what it receives)."""
    return sum(
        (s.numel - sum(box_numel(b) for b in s.padding)) * DTYPE_ITEMSIZE[s.dtype]
        for s in shards
        if s.rank == rank
    )


def engine_shards(
    facts: Sequence[VllmParamFacts], names: set[str], tp: int, rank: int
) -> tuple[list[EngineShard], list[str]]:
    """Every tensor-parallel rank's shards of the parameters made of ``names``, and
    what engine rank ``rank`` cannot take (its own shards' problems, and any described
    tensor no parameter is made of)."""
    shards, problems = [], []
    for r in range(tp):
        for f in facts:
            result = vllm_shard(attrs.evolve(f, tp_rank=r, tp_size=tp))
            if isinstance(result, Success):
                shards.append(result.unwrap())
            elif r == rank:
                problems.append(str(result.failure()))
    used = {piece.source for s in shards for piece in s.pieces}
    if unused := sorted(names - used):
        problems.append(f"no engine parameter is made of {unused[:12]} (engine rank {rank})")
    return shards, problems


def header_problem(rank: int, stage: int, own: str, digests: Mapping[int, str], prefix: int) -> str:
    """The header round, at engine rank ``rank``: the trainer's plan digest for this
    engine (``rank_prefix`` ``prefix``) must be this rank's own; '' when it is."""
    if digests.get(prefix) == own:
        return ""
    return (
        f"engine rank {rank} (stage {stage}) planned another reshard refit than the trainer: "
        f"digest {own} vs {digests.get(prefix)} (refit_info or shards differ)"
    )


def trainer_header_problem(rank: int, own: Mapping[int, str], digests: Mapping[int, str]) -> str:
    """The header round, at trainer rank ``rank``: trainer rank 0's plan digests (per
    engine ``rank_prefix``) must be this rank's own; '' when they are."""
    if digests == own:
        return ""
    return (
        f"trainer rank {rank} planned another reshard refit than trainer rank 0 "
        "(its layouts or the engines' shards differ)"
    )


def outgoing(plans: Mapping[int, ReshardPlan], rank: int, train: int) -> list[tuple[int, Copy]]:
    """What trainer rank ``rank`` sends in a refit, in order: every copy of its own in
    ``plans`` (per engine ``rank_prefix``) with its engine rank in the group."""
    return [
        (train + prefix + c.dst_rank, c)
        for prefix, plan in plans.items()
        for c in plan.copies
        if c.src_rank == rank
    ]


def sender_problems(
    rank: int,
    train: int,
    plans: Mapping[int, ReshardPlan],
    layouts: Sequence[TrainerLayout],
    local: Mapping[str, tuple[tuple[int, ...], str]],
) -> list[str]:
    """Trainer rank ``rank``'s tensors (``local``: shape and dtype of its shard of each)
    against the layouts: each shard it holds present in its shape and dtype, nothing
    else (``plans``: per engine ``rank_prefix``, to name the engine ranks waiting)."""
    problems = []
    needs: dict[str, set[int]] = {}
    for peer, c in outgoing(plans, rank, train):
        needs.setdefault(c.source, set()).add(peer)
    for layout in layouts:
        boxes = [s.box for s in layout.shards if s.rank == rank]
        if not boxes:
            continue
        engines = sorted(needs.get(layout.name, ()))
        where = f"trainer rank {rank}'s shard of {layout.name!r} (for engine ranks {engines})"
        want, got = (tuple(b - a for a, b in boxes[0]), layout.dtype), local.get(layout.name)
        if got is None:
            problems.append(f"{where} is missing")
        elif got != want:
            problems.append(
                f"{where} is {list(got[0])} {got[1]}, the layout gives {list(want[0])} {want[1]}"
            )
    if extra := sorted(set(local) - {layout.name for layout in layouts}):
        problems.append(f"trainer rank {rank} sent tensors no layout describes: {extra[:8]}")
    return problems


def plan_stage(
    layouts: Sequence[TrainerLayout], shards: Sequence[EngineShard]
) -> Result[ReshardPlan, ReshardError]:
    """The plan of one PP stage: the engine shards made of its tensors (a shard belongs
    to the stage of its first piece's source; a piece of another stage is named)."""
    names = {layout.name for layout in layouts}
    return plan_reshard(layouts, [s for s in shards if s.pieces and s.pieces[0].source in names])


def fit_group(
    plan: ReshardPlan, train: int, prefix: int, world_size: int
) -> Result[ReshardPlan, CoreError]:
    """``plan`` for the engine whose ranks start at ``train + prefix`` in a group of
    ``world_size``; refused when its engine ranks do not fit."""
    top = train + prefix + max((c.dst_rank for c in plan.copies), default=-1)
    if top >= world_size:
        return Failure(
            CoreError(
                f"engine ranks up to {top} with rank_prefix {prefix} do not fit a group "
                f"of {world_size}"
            )
        )
    return Success(plan)


def p2p_tags(messages: Sequence[tuple[int, _T]]) -> list[tuple[int, _T, int]]:
    """Point-to-point ``(peer, message)`` pairs with their tags, where messages to one
    peer are matched by tag (gloo): each one's place among those to the same peer."""
    seen: dict[int, int] = {}
    tagged = []
    for peer, message in messages:
        seen[peer] = seen.get(peer, -1) + 1
        tagged.append((peer, message, seen[peer]))
    return tagged


def plan_digest(plan: ReshardPlan) -> str:
    """What every rank of a refit compares before a byte moves: a hash of the copies."""
    return hashlib.sha256(msgspec.msgpack.encode(plan.copies)).hexdigest()[:32]


@attrs.frozen
class EnginePlans:
    """One engine rank's view of the refit: its own shards (as a manifest of local
    tensors, for the routes) and each stage's plan, with its digest."""

    stages: tuple[tuple[TrainerLayout, ...], ...]
    shards: tuple[EngineShard, ...]  # this rank's own
    plans: tuple[ReshardPlan, ...]  # per stage, every rank of the engine
    digests: tuple[str, ...]
    manifest: Manifest

    def dtype(self, param: str) -> str:
        return next(s.dtype for s in self.shards if s.param == param)

    def bytes_to(self, rank: int) -> int:
        """The bytes every stage's plan sends to engine rank ``rank``."""
        return sum(plan.bytes_to(rank) for plan in self.plans)

    def answer(self, rank: int, direct: int) -> dict[str, object]:
        """Engine rank ``rank``'s answer to ``prepare_nccl_reshard_refit_info`` (``direct``:
        how many of its parameters the engine's routes write directly)."""
        return {
            "tp_rank": rank,
            "digests": list(self.digests),
            "shards": msgspec.to_builtins(list(self.shards)),
            "params": len(self.shards),
            "bytes": self.bytes_to(rank),
            "direct": direct,
        }

    def received(
        self, rank: int, nbytes: int, direct: int, loaded: int, seconds: float
    ) -> dict[str, object]:
        """Engine rank ``rank``'s report of a refit: ``nbytes`` received, ``direct``
        parameters written in place, ``loaded`` trainer tensors through vLLM's loader."""
        return {
            "tensors": len(self.shards),
            "nbytes": nbytes,
            "received_bytes": nbytes,
            "expected_bytes": self.bytes_to(rank),
            "direct": direct,
            "loaded": loaded,
            "seconds": seconds,
        }


def ready_to_receive(groups: int, prepared: EnginePlans | None) -> Result[EnginePlans, CoreError]:
    """An engine rank's plans for a refit over its ``groups`` joined stage groups; refused
    when it joined none, has no plans yet, or has another count of stages."""
    if not groups:
        return Failure(CoreError("nccl_reshard_refit before init_nccl_reshard_comm_group"))
    if prepared is None:
        return Failure(CoreError("nccl_reshard_refit before prepare_nccl_reshard_refit_info"))
    if groups != len(prepared.plans):
        return Failure(
            CoreError(
                f"{groups} reshard group(s) for a refit_info of {len(prepared.plans)} stage(s)"
            )
        )
    return Success(prepared)


def packed_sources(module: str, local: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """The checkpoint names of parameter ``local`` of module ``module``: a fused layer's
    (its leaf a key of the model's ``packed_modules_mapping``) one per packed module."""
    prefix, _, leaf = module.rpartition(".")
    return [f"{prefix}.{s}.{local}" if prefix else f"{s}.{local}" for s in packed.get(leaf, [leaf])]


def plan_engine(
    facts: Sequence[VllmParamFacts],
    stages: Sequence[Sequence[TrainerLayout]],
    tp: int,
    rank: int,
) -> Result[EnginePlans, ReshardError]:
    """Engine rank ``rank``'s plans from its parameters' ``facts`` (those made of none of
    the described tensors are left out: they keep their weights) and the trainer's
    ``stages``; refused naming each parameter it cannot take, or a described tensor no
    parameter is made of."""
    names = {layout.name for layouts in stages for layout in layouts}
    used = [f for f in facts if any(n in names for n, _ in f.sources)]
    shards, problems = engine_shards(used, names, tp, rank)
    if problems:
        return Failure(ReshardError("reshard refit_info: " + "; ".join(problems)))
    plans = []
    for layouts in stages:
        plan = plan_stage(layouts, shards)
        if isinstance(plan, Failure):
            return Failure(attrs.evolve(plan.failure(), message=f"reshard refit: {plan.failure()}"))
        plans.append(plan.unwrap())
    own = tuple(s for s in shards if s.rank == rank)
    manifest = Manifest.from_specs(TensorSpec(s.param, s.shape, s.dtype) for s in own)
    if isinstance(manifest, Failure):
        return Failure(ReshardError(f"reshard refit: {manifest.failure()}"))
    return Success(
        EnginePlans(
            tuple(tuple(layouts) for layouts in stages),
            own,
            tuple(plans),
            tuple(plan_digest(p) for p in plans),
            manifest.unwrap(),
        )
    )


# --- the wire of a reshard refit -----------------------------------------------------

_INFO_VERSION: Final = 1


class _Info(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    stages: list[list[TrainerLayout]]


def refit_info(
    layouts: Sequence[TrainerLayout] | Mapping[int, Sequence[TrainerLayout]],
) -> dict[str, object]:
    """The plain ``refit_info`` of ``prepare_nccl_reshard_refit_info``: every trainer
    tensor's layout, per PP stage (a sequence: one stage)."""
    stages = layouts if isinstance(layouts, Mapping) else {0: layouts}
    count = max(stages, default=-1) + 1
    return {
        "version": _INFO_VERSION,
        "stages": [msgspec.to_builtins(list(stages.get(s, ()))) for s in range(count)],
    }


def parse_refit_info(info: object) -> Result[list[list[TrainerLayout]], ReshardError]:
    """Every stage's layouts from a ``refit_info``, each layout valid and described once."""
    try:
        parsed = msgspec.convert(info, _Info)
    except msgspec.ValidationError as e:
        return Failure(ReshardError(f"malformed reshard refit_info: {e}"))
    if parsed.version != _INFO_VERSION:
        return Failure(
            ReshardError(f"reshard refit_info version {parsed.version}, not {_INFO_VERSION}")
        )
    seen: dict[str, int] = {}
    problems = []
    for stage, layouts in enumerate(parsed.stages):
        for layout in layouts:
            problems += [pp.describe() for pp in layout.check()]
            if layout.name in seen:
                problems.append(
                    f"{layout.name!r} is described twice (stages {seen[layout.name]} and {stage})"
                )
            seen[layout.name] = stage
    if problems:
        return Failure(ReshardError("invalid reshard refit_info: " + "; ".join(problems)))
    return Success(parsed.stages)


def parse_shards(summaries: Iterable[object]) -> Result[list[EngineShard], ReshardError]:
    """Every engine shard, in engine-rank order, from the workers' answers to
    ``prepare_nccl_reshard_refit_info`` (their ``"shards"``)."""
    out: list[EngineShard] = []
    for summary in summaries:
        shards = summary.get("shards") if isinstance(summary, Mapping) else None
        try:
            out += msgspec.convert(shards, list[EngineShard])
        except msgspec.ValidationError as e:
            return Failure(ReshardError(f"not an answer of prepare_nccl_reshard_refit_info: {e}"))
    return Success(out)


def refit_info_of(refit_info: object) -> Result[Mapping[object, object], CoreError]:
    """``prepare_nccl_reshard_refit_info``'s argument: the mapping the trainer's
    ``genworker.shell.reshard.refit_info`` returns (anything else refused, named)."""
    if not isinstance(refit_info, Mapping):
        return Failure(
            CoreError(
                "refit_info must be a mapping (what genworker.shell.reshard.refit_info "
                f"returns), got {refit_info!r}"
            )
        )
    return Success(refit_info)


def prepared_params(summaries: Iterable[object]) -> int:
    """The most parameters an engine worker planned, from the workers' answers to
    ``prepare_nccl_reshard_refit_info`` (their ``"params"``; 0 without any)."""
    counts = (int(s.get("params", 0)) for s in summaries if isinstance(s, dict))
    return max(counts, default=0)


def start_header(refit_id: str, digests: Mapping[int, str]) -> bytes:
    """Trainer rank 0's first message of a refit: its plan digest per engine prefix."""
    return msgspec.msgpack.encode({"refit": refit_id, "digests": dict(digests)})


def read_header(data: bytes) -> Result[dict[int, str], ReshardError]:
    try:
        header = msgspec.msgpack.decode(data, type=dict[str, object])
        return Success(msgspec.convert(header["digests"], dict[int, str], strict=False))
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError) as e:
        return Failure(ReshardError(f"malformed reshard refit header: {e!r}"))
