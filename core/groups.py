"""GRPO groups: rows of a batch that sample the same prompt, sent so the prompt is
prefilled once, and their outputs put back in the caller's row order.

Theory of operation
-------------------
GRPO, RLOO and DAPO sample G completions of one prompt. A *group* is a set of rows with
equal prompts and equal sampling specs but for the seed: recognised by
:func:`plan_groups` (rows ``i < j`` with equal prompt ids and specs), or declared by the
caller (``group_size``: NeMo-RL's ``num_generations_per_prompt`` layout, rows
``[k * G, (k + 1) * G)``; a declared group whose rows differ is refused naming them).

Each group takes one of two paths (:class:`GroupPath`):

- ``SAMPLES``: no row of the group has a seed and the group samples (it is not greedy:
  vLLM refuses ``n`` > 1 for a greedy request): one request with vLLM's ``n`` = G
  (``SamplingParams.n``); vLLM returns the G completions in ``RequestOutput.outputs``
  (vllm/v1/engine/parallel_sampling.py, 0.32: ``ParentRequest`` fans ``n`` out into G
  child requests, ``output_aggregator[index]``). vLLM derives a seeded child's seed as
  ``seed + index``, so ``n`` cannot carry per-sample seeds.
- ``PREFIX``: some row has a seed, or the group is greedy: one request per row, the
  group's rows sent one after another, the first (the *leader*) first, so the siblings are
  admitted after it and read its prompt's blocks from the prefix cache. The specs are the per-row path's own, so the
  outputs are the per-row path's, bit for bit.

Either way the prompt is computed once only where prefix caching is on: vLLM 0.32's child
requests are separate requests of the engine core, and ``KVCacheManager.allocate_slots``
caches a prompt's full blocks when they are allocated, so a sibling scheduled after its
leader (even in the same step) reads them; with prefix caching off every child and every
sibling is prefilled again. When the worker's engine has it on is the engine plan's
rule (``core.engine_plan.resolve_prefix_caching``; docs/groups.md).

The engine returns the requests' completions flat, in request order, ``n`` per request:
:meth:`GroupPlan.output_rows` is the batch row of each, and :func:`order_rows` puts them
back in ascending batch order (a permutation of ``FlatGenerations``' rows).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
from returns.result import Failure, Result, Success

from genworker.core.assembly import FlatGenerations
from genworker.core.errors import CoreError
from genworker.core.sampling import SamplingSpec

__all__ = [
    "DECLARED_GROUPS",
    "EngineRequest",
    "Group",
    "GroupError",
    "GroupPath",
    "GroupPlan",
    "admission_runs",
    "batch_groups",
    "check_declared_groups",
    "drop_declared_groups",
    "order_rows",
    "plan_groups",
    "prompt_groups",
]


class GroupPath(enum.Enum):
    """How a group reaches the engine (see the module docstring)."""

    SAMPLES = "n"
    PREFIX = "prefix"


@attrs.frozen
class GroupError(CoreError):
    """A declared group layout the batch does not fit: ``rows`` are the batch rows of the
    offending group (all of the batch when its size is not a multiple of the group);
    ``group_size`` is 0 where the declared size is not an int."""

    rows: tuple[int, ...]
    group_size: int


def _check_rows(instance: Group, attribute: object, rows: tuple[int, ...]) -> None:
    if not rows or list(rows) != sorted(set(rows)):
        raise ValueError(f"a group's rows must be strictly increasing and non-empty: {rows}")


@attrs.frozen
class Group:
    """Batch rows (ascending; the first is the leader) that sample one prompt."""

    rows: tuple[int, ...] = attrs.field(validator=_check_rows)
    path: GroupPath

    @property
    def leader(self) -> int:
        return self.rows[0]


@attrs.frozen
class EngineRequest:
    """One engine request: the prompt and spec of batch row ``row``, sampled ``n`` times."""

    row: int
    n: int


@attrs.frozen
class GroupPlan:
    """The groups of a batch's generating rows, in the order of their leaders."""

    groups: tuple[Group, ...]

    def __attrs_post_init__(self) -> None:
        rows = [row for group in self.groups for row in group.rows]
        if len(rows) != len(set(rows)):
            raise ValueError(f"groups {self.groups} share rows")

    @property
    def grouped(self) -> bool:
        """Whether any group holds more than one row (else the plan is the per-row path)."""
        return any(len(group.rows) > 1 for group in self.groups)

    def requests(self) -> tuple[EngineRequest, ...]:
        """The engine requests, in the order to send them: a ``SAMPLES`` group as one
        request with ``n`` = its size, a ``PREFIX`` group as one per row, leader first."""
        out: list[EngineRequest] = []
        for group in self.groups:
            if group.path is GroupPath.SAMPLES:
                out.append(EngineRequest(group.leader, len(group.rows)))
            else:
                out.extend(EngineRequest(row, 1) for row in group.rows)
        return tuple(out)

    def output_rows(self) -> tuple[int, ...]:
        """The batch row of each completion the engine returns for :meth:`requests`
        (request order, ``n`` completions per request in vLLM's index order)."""
        return tuple(row for group in self.groups for row in group.rows)


def prompt_groups(prompts: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Positions of equal prompts, grouped, in order of first appearance."""
    seen: dict[tuple[int, ...], list[int]] = {}
    for position, prompt in enumerate(prompts):
        seen.setdefault(tuple(prompt), []).append(position)
    return tuple(tuple(rows) for rows in seen.values())


def check_declared_groups(
    size: object, prompts: Sequence[Sequence[int]]
) -> Result[int | None, GroupError]:
    """A batch's declared group size (NeMo-RL's ``num_generations_per_prompt``; ``None``:
    undeclared), once each run of ``size`` rows holds one prompt."""
    if size is None:
        return Success(None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or len(prompts) % size:
        return Failure(
            GroupError(
                f"data['num_generations_per_prompt']={size!r} must be an int dividing the "
                f"batch of {len(prompts)} rows",
                rows=tuple(range(len(prompts))),
                group_size=size if type(size) is int else 0,
            )
        )
    for start in range(0, len(prompts), size):
        if len(prompt_groups(prompts[start : start + size])) > 1:
            rows = tuple(range(start, start + size))
            return Failure(
                GroupError(
                    f"declared group of rows {list(rows)} (num_generations_per_prompt={size}) "
                    "holds different prompts",
                    rows=rows,
                    group_size=size,
                )
            )
    return Success(size)


#: The batch key that declares its group size (NeMo-RL's layout, :func:`check_declared_groups`).
DECLARED_GROUPS = "num_generations_per_prompt"


def drop_declared_groups(
    data: Mapping[str, object], prompts: Sequence[Sequence[int]]
) -> Result[Mapping[str, object], GroupError]:
    """A batch's ``data`` once its declared group size (:data:`DECLARED_GROUPS`) is
    checked (:func:`check_declared_groups`), without it: the Ray group checks the layout
    on the whole batch, and its shards then recognise the groups by their prompts, whatever
    cut the sharder made of one larger than a shard's share."""
    checked = check_declared_groups(data.get(DECLARED_GROUPS), prompts)
    if isinstance(checked, Failure):
        return checked
    if checked.unwrap() is None:
        return Success(data)
    return Success({k: v for k, v in data.items() if k != DECLARED_GROUPS})


def plan_groups(
    rows: Sequence[int],
    prompts: Sequence[Sequence[int]],
    specs: Sequence[SamplingSpec],
    *,
    group_size: int | None = None,
    batch_size: int | None = None,
) -> Result[GroupPlan, GroupError]:
    """The groups of the generating rows ``rows`` (batch rows, ascending), each with its
    prompt ids and spec. ``group_size`` declares the layout (rows ``[k * G, (k + 1) *
    G)`` of a batch of ``batch_size``); otherwise rows whose prompts and specs but for the
    seed are equal are recognised as one group."""
    if not len(rows) == len(prompts) == len(specs):
        raise ValueError(f"{len(rows)} rows, {len(prompts)} prompts and {len(specs)} specs")
    if list(rows) != sorted(set(rows)):
        raise ValueError(f"rows must be strictly increasing: {list(rows)}")
    # a spec without a seed is its own key: no copy per row (a 512-row batch, ~6 ms)
    unseeded = [s if s.seed is None else attrs.evolve(s, seed=None) for s in specs]
    keys = [(tuple(p), s) for p, s in zip(prompts, unseeded, strict=True)]
    members: dict[object, list[int]] = {}
    if group_size is None:
        for position, key in enumerate(keys):
            members.setdefault(key, []).append(position)
    else:
        if group_size < 1 or batch_size is None or batch_size % group_size:
            every = tuple(range(batch_size or 0))
            return Failure(
                GroupError(
                    f"group_size={group_size} does not divide the batch of {batch_size} rows "
                    "(declared groups are rows [k * G, (k + 1) * G))",
                    rows=every,
                    group_size=group_size,
                )
            )
        for position, row in enumerate(rows):
            members.setdefault(row // group_size, []).append(position)
        for positions in members.values():
            if len({keys[p] for p in positions}) > 1:
                bad = tuple(rows[p] for p in positions)
                return Failure(
                    GroupError(
                        f"declared group of rows {list(bad)} (group_size={group_size}) holds "
                        "different prompts or sampling settings",
                        rows=bad,
                        group_size=group_size,
                    )
                )
    groups = []
    for positions in members.values():
        # equal specs but for the seed: the leader's temperature is the group's
        per_row = specs[positions[0]].greedy or any(specs[p].seed is not None for p in positions)
        path = GroupPath.PREFIX if per_row else GroupPath.SAMPLES
        groups.append(Group(tuple(rows[p] for p in positions), path))
    return Success(GroupPlan(tuple(groups)))


def batch_groups(
    rows: Sequence[int],
    prompts: Sequence[Sequence[int]],
    specs: Sequence[SamplingSpec],
    *,
    declared: object,
    batch_size: int,
    media: bool,
) -> Result[GroupPlan, GroupError]:
    """A worker's groups of a batch's generating rows (:func:`plan_groups`): ``declared``,
    NeMo-RL's ``num_generations_per_prompt`` (an int, or None to recognise them); a batch
    with media goes row by row."""
    if declared is not None and (isinstance(declared, bool) or not isinstance(declared, int)):
        message = f"data['num_generations_per_prompt'] must be an int, got {declared!r}"
        return Failure(GroupError(message, rows=tuple(range(batch_size)), group_size=0))
    if media:
        return Success(GroupPlan(tuple(Group((row,), GroupPath.PREFIX) for row in rows)))
    return plan_groups(rows, prompts, specs, group_size=declared, batch_size=batch_size)


def admission_runs(
    rows: Sequence[int], groups: GroupPlan | None, prefix_caching: bool
) -> list[tuple[int, ...]]:
    """The runs a stream sends its rows in, each run's siblings once its leader's prefill
    is done: a group's rows where the engine shares that prefill (prefix caching), else
    every row alone."""
    if groups is None or not prefix_caching:
        return [(row,) for row in rows]
    return [group.rows for group in groups.groups]


def order_rows(flat: FlatGenerations, rows: Sequence[int]) -> FlatGenerations:
    """``flat``'s rows, the batch rows ``rows`` (distinct, one per row of ``flat``), in
    ascending order of those rows; the flat arrays are copied once (not at all when the
    rows are in order already)."""
    if len(rows) != flat.batch_size or len(set(rows)) != len(rows):
        raise ValueError(f"order_rows needs {flat.batch_size} distinct rows, got {list(rows)}")
    if list(rows) == sorted(rows):
        return flat  # already in order: nothing copied
    order = np.argsort(np.asarray(rows, dtype=np.int64), kind="stable")
    starts = np.concatenate([[0], np.cumsum(flat.lengths)[:-1]]).astype(np.int64)
    index = np.concatenate(
        [np.arange(starts[i], starts[i] + flat.lengths[i], dtype=np.int64) for i in order]
    )
    return FlatGenerations(
        token_ids=flat.token_ids[index],
        logprobs=flat.logprobs[index],
        lengths=flat.lengths[order],
        truncated=flat.truncated[order],
        aborted=flat.aborted[order],
    )
