"""Data-parallel sharding of a generation batch, and the merge of the shards' outputs.

Theory of operation
-------------------
NeMo-RL's ``VllmGeneration`` splits a batch across its data-parallel engines and concatenates
the results with the pad value (``BatchedDataDict.from_batches``). Here the split balances
work instead of row counts:

* A row costs ``input_length + max_new_tokens``: prefill plus the most decode it can need.
* Longest-processing-time greedy: rows by cost, largest first (ties: lower row index first),
  each onto the shard with the least cost so far (ties: fewer rows, then lower shard index,
  so zero-cost rows spread out too). This bounds the spread: the costliest shard exceeds the
  cheapest by at most the cost of one row.
* Groups (``groups``: rows that sample one prompt, ``core.groups``) are placed whole: the
  greedy places items, a group being one item of its rows' summed cost, so its prompt is
  prefilled on one shard only. A group costlier than a shard's share (the batch's cost
  over the shards, rounded up) is cut, in row order, into pieces of at most that share
  (at least one row each), and the pieces are items. Law: no group is split unless it
  costs more than a shard's share; the spread stays at most the costliest item.
* Each shard keeps its rows in ascending original order, so a shard is a sub-batch of the
  input; a shard may get no rows when the batch has fewer rows than shards (failure-modes
  G8: the shell still returns correctly typed empty outputs for it).
* The merge puts rows back in input order. Shards pad to their own longest sequence, so
  tensors of two or more dimensions are right-padded along dimension 1 to the widest shard:
  ``output_ids`` with the pad token id, everything else with 0 (NeMo-RL pads logprobs
  with 0.0). A 0-row shard contributes nothing, whatever its width or dtype.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import attrs
import torch
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError
from genworker.core.groups import prompt_groups

__all__ = [
    "ShardError",
    "ShardPlan",
    "describe_shard_rows",
    "merge_shard_outputs",
    "merge_shard_texts",
    "plan_prompt_rows",
    "plan_prompt_shards",
    "plan_shards",
    "plan_text_shards",
    "split_batch",
]


@attrs.frozen
class ShardError(CoreError):
    """A batch entry that cannot be split by rows; ``key`` names it."""

    key: str
    length: int
    num_rows: int


def _check_partition(instance: ShardPlan, attribute: object, value: object) -> None:
    seen = sorted(row for shard in instance.shards for row in shard)
    if seen != list(range(instance.num_rows)):
        raise ValueError(f"shards {instance.shards} do not hold rows 0..{instance.num_rows - 1}")
    for shard in instance.shards:
        if list(shard) != sorted(shard):
            raise ValueError(f"shard {shard} is not in ascending row order")
    if len(instance.costs) != len(instance.shards):
        raise ValueError("one cost per shard is required")


@attrs.frozen
class ShardPlan:
    """Which input rows each shard gets (ascending), and each shard's total cost."""

    num_rows: int
    shards: tuple[tuple[int, ...], ...] = attrs.field(validator=_check_partition)
    costs: tuple[int, ...]

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(shard) for shard in self.shards)

    @property
    def concat_order(self) -> tuple[int, ...]:
        """Input row of each row of the shards' outputs concatenated in shard order."""
        return tuple(row for shard in self.shards for row in shard)


def plan_shards(
    lengths: Sequence[int] | torch.Tensor,
    num_shards: int,
    *,
    max_new_tokens: int = 0,
    groups: Sequence[Sequence[int]] | None = None,
) -> ShardPlan:
    """Split rows ``0..len(lengths)-1`` over ``num_shards`` shards, balanced by token cost.

    ``lengths`` are the unpadded input lengths (a list or a 1-D tensor); ``groups``, rows
    kept on one shard (each row in at most one; rows in none are alone). Negative lengths,
    a negative ``max_new_tokens``, fewer than one shard or overlapping groups are
    programming errors.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be at least 1")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must not be negative")
    as_list = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    costs = [int(length) + max_new_tokens for length in as_list]
    if any(length < 0 for length in as_list):
        raise ValueError(f"lengths must not be negative: {as_list}")

    items = _items(costs, groups or (), num_shards)
    # (cost so far, rows so far, shard index): the heap's minimum is the shard to fill next.
    heap = [(0, 0, shard) for shard in range(num_shards)]
    rows: list[list[int]] = [[] for _ in range(num_shards)]
    for item_cost, item in sorted(items, key=lambda it: (-it[0], it[1][0])):
        load, count, shard = heapq.heappop(heap)
        rows[shard].extend(item)
        heapq.heappush(heap, (load + item_cost, count + len(item), shard))
    loads = [0] * num_shards
    for load, _, shard in heap:
        loads[shard] = load
    return ShardPlan(
        num_rows=len(costs),
        shards=tuple(tuple(sorted(shard_rows)) for shard_rows in rows),
        costs=tuple(loads),
    )


def plan_prompt_shards(
    prompts: Sequence[Sequence[int]], num_shards: int, *, max_new_tokens: int = 0
) -> ShardPlan:
    """:func:`plan_shards` of token prompts, the rows of one prompt
    (``core.groups.prompt_groups``) kept together: the prompt is prefilled on one shard."""
    lengths = [len(p) for p in prompts]
    groups = prompt_groups(prompts)
    return plan_shards(lengths, num_shards, max_new_tokens=max_new_tokens, groups=groups)


def plan_text_shards(
    prompts: Sequence[str], num_shards: int, *, max_new_tokens: int = 0
) -> ShardPlan:
    """:func:`plan_shards` of text prompts: text has no token count before the engine
    tokenises it, so each prompt's characters stand in for its length."""
    return plan_shards([len(p) for p in prompts], num_shards, max_new_tokens=max_new_tokens)


def plan_prompt_rows(
    prompts: Sequence[tuple[int, Sequence[int]]],
    num_rows: int,
    num_shards: int,
    *,
    max_new_tokens: int = 0,
) -> ShardPlan:
    """:func:`plan_prompt_shards` of some of a batch's rows (``(row, prompt)`` in ascending
    row order), each shard's rows named as the batch's; the rows left out make one more
    shard, last and of no cost, so one :func:`split_batch` serves the batch."""
    rows = [row for row, _ in prompts]
    plan = plan_prompt_shards([p for _, p in prompts], num_shards, max_new_tokens=max_new_tokens)
    placed = set(rows)
    left = tuple(row for row in range(num_rows) if row not in placed)
    shards = tuple(tuple(rows[k] for k in shard) for shard in plan.shards)
    return ShardPlan(num_rows=num_rows, shards=(*shards, left), costs=(*plan.costs, 0))


def _items(
    costs: Sequence[int], groups: Sequence[Sequence[int]], num_shards: int
) -> list[tuple[int, tuple[int, ...]]]:
    """The greedy's items ``(cost, rows)``: each group whole, or cut into pieces of at
    most a shard's share when it costs more; every other row alone."""
    share = -(-sum(costs) // num_shards)
    grouped = [row for group in groups for row in group]
    taken = set(grouped)
    if len(grouped) != len(taken) or not all(0 <= r < len(costs) for r in grouped):
        raise ValueError(f"groups {groups} overlap or name rows outside 0..{len(costs) - 1}")
    items: list[tuple[int, tuple[int, ...]]] = [
        (costs[row], (row,)) for row in range(len(costs)) if row not in taken
    ]
    for group in groups:
        piece: list[int] = []
        for row in sorted(group):
            if piece and sum(costs[r] for r in piece) + costs[row] > share:
                items.append((sum(costs[r] for r in piece), tuple(piece)))
                piece = []
            piece.append(row)
        if piece:
            items.append((sum(costs[r] for r in piece), tuple(piece)))
    return items


def split_batch(
    plan: ShardPlan, data: Mapping[str, object]
) -> Result[tuple[dict[str, object], ...], ShardError]:
    """Each shard's slice of ``data``.

    Tensors with a leading row dimension are indexed by the shard's rows, as are per-sample
    lists and tuples (``stop_strings``), which become lists. Strings, ``None``, 0-d tensors
    and other scalars are copied to every shard. A tensor or list whose length is not the
    batch size is an error naming its key.
    """
    for key, value in data.items():
        length = _row_length(value)
        if length is not None and length != plan.num_rows:
            return Failure(
                ShardError(
                    f"{key!r} has {length} rows but the batch has {plan.num_rows}",
                    key=key,
                    length=length,
                    num_rows=plan.num_rows,
                )
            )
    return Success(tuple(_take(data, rows) for rows in plan.shards))


def _row_length(value: object) -> int | None:
    if isinstance(value, torch.Tensor):
        return None if value.dim() == 0 else int(value.shape[0])
    if isinstance(value, list | tuple):
        return len(value)
    return None


def _take(data: Mapping[str, object], rows: tuple[int, ...]) -> dict[str, object]:
    index = torch.tensor(rows, dtype=torch.long)
    shard: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            shard[key] = value.index_select(0, index.to(value.device))
        elif isinstance(value, list | tuple):
            shard[key] = [value[row] for row in rows]
        else:
            shard[key] = value
    return shard


def describe_shard_rows(rows: tuple[int, ...], shown: int = 16) -> str:
    """What a shard's own row numbers are in the batch (nothing where they are the same)."""
    if rows == tuple(range(len(rows))):
        return ""
    if len(rows) == 1:
        return f" (its row 0 is the batch's row {rows[0]})"
    listed = ", ".join(map(str, rows[:shown])) + (", ..." if len(rows) > shown else "")
    return f" (its rows 0-{len(rows) - 1} are the batch's rows {listed})"


def merge_shard_texts(
    plan: ShardPlan, shard_texts: Sequence[Sequence[str]]
) -> Result[list[str], ShardError]:
    """The shards' ``generate_text`` texts (one list per shard) in input row order; a
    shard that returned another count than its rows is named."""
    ordered = [""] * plan.num_rows
    for rank, (rows, texts) in enumerate(zip(plan.shards, shard_texts, strict=True)):
        if len(texts) != len(rows):
            return Failure(
                ShardError(
                    f"shard {rank}: generate_text returned {len(texts)} texts for "
                    f"{len(rows)} prompts",
                    key="texts",
                    length=len(texts),
                    num_rows=len(rows),
                )
            )
        for row, text in zip(rows, texts, strict=True):
            ordered[row] = text
    return Success(ordered)


def merge_shard_outputs(
    plan: ShardPlan,
    shard_outputs: Sequence[Mapping[str, torch.Tensor]],
    pad_token_id: int,
    *,
    pad_values: Mapping[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """The shards' outputs as one batch in input row order.

    Every shard with rows must return the same keys, each tensor with one row per shard row.
    A shard without rows may return any subset of those keys (or none). ``pad_values``
    overrides the padding of other keys (default: 0; ``output_ids`` uses ``pad_token_id``).
    Mismatches are programming errors in the caller and raise ``ValueError``.
    """
    if len(shard_outputs) != plan.num_shards:
        raise ValueError(f"{len(shard_outputs)} shard outputs for {plan.num_shards} shards")
    pads: dict[str, float] = {"output_ids": pad_token_id, **(pad_values or {})}
    keys = _merged_keys(plan, shard_outputs)
    inverse = torch.empty(plan.num_rows, dtype=torch.long)
    inverse[torch.tensor(plan.concat_order, dtype=torch.long)] = torch.arange(
        plan.num_rows, dtype=torch.long
    )
    merged: dict[str, torch.Tensor] = {}
    for key in keys:
        parts: list[torch.Tensor] = []
        for shard, (output, size) in enumerate(zip(shard_outputs, plan.sizes, strict=True)):
            if key not in output:
                continue
            tensor = output[key]
            if tensor.dim() == 0 or tensor.shape[0] != size:
                raise ValueError(
                    f"{key!r} of shard {shard} has shape {tuple(tensor.shape)}, "
                    f"expected {size} rows"
                )
            parts.append(tensor)
        rows = _concat_rows(parts, pads.get(key, 0))
        merged[key] = rows.index_select(0, inverse.to(rows.device))
    return merged


def _merged_keys(plan: ShardPlan, shard_outputs: Sequence[Mapping[str, torch.Tensor]]) -> list[str]:
    filled = [set(out) for out, size in zip(shard_outputs, plan.sizes, strict=True) if size]
    keys = filled[0] if filled else set().union(*(set(out) for out in shard_outputs))
    for shard, (output, size) in enumerate(zip(shard_outputs, plan.sizes, strict=True)):
        extra, missing = set(output) - keys, (keys - set(output) if size else set())
        if extra or missing:
            raise ValueError(
                f"shard {shard} returned keys {sorted(output)}, expected {sorted(keys)}"
            )
    return sorted(keys)


def _concat_rows(tensors: list[torch.Tensor], pad: float) -> torch.Tensor:
    filled = [t for t in tensors if t.shape[0] > 0] or tensors[:1]
    if filled[0].dim() == 1:
        return torch.cat(filled)
    width = max(t.shape[1] for t in filled)
    padded = []
    for tensor in filled:
        if tensor.shape[1] == width:
            padded.append(tensor)
        else:
            wide = torch.full(
                (tensor.shape[0], width, *tensor.shape[2:]),
                pad,
                dtype=tensor.dtype,
                device=tensor.device,
            )
            wide[:, : tensor.shape[1]] = tensor
            padded.append(wide)
    return torch.cat(padded)
