"""How a group's call on its shards ends: which failures mean what, and what answers join.

Theory of operation
-------------------
The Ray group (``shell/group.py``) runs one worker method on its shards and waits for them
all within one bound. A shard that does not answer ends one of four ways (:class:`Fault`),
each said in one line that names the shard (:data:`FAULTS`, a literal table):

* ``LATE``: no answer within the bound (the actor may still be running the call);
* ``DIED``: its actor died; the shard stays dead, and every later call is refused
  (:func:`unusable`) until the group is re-created;
* ``WORKER``: the worker raised one of genworker's own errors, which keeps its type and
  names the shard's rows as the batch's (``core.sharding.describe_shard_rows``);
* ``FOREIGN``: anything else the call raised.

A failed call raises the first shard's error, typed as the worker's, only where every
failed shard's was a worker's own (its message: :func:`list_faults`); otherwise the
group's ``ShardFailure`` (:func:`failed_on`). Either way every failed shard is listed.
What a shard answers crosses Ray as ``object``: it is checked here before the group
joins it (:func:`shard_lists`, :func:`shard_tensors`, :func:`shard_texts`).

The group's refits are one value, :class:`GroupRefits`: its weight versions
(``core.versions.GroupVersions``: every shard's ``weight_versions`` relabelled with the
count of refits, full or adapter, that landed on at least one shard, where a shard that
answered ``True`` to ``collect`` took it and one that did not answer within ``collect``'s
bound failed), the adapters that landed on every shard (the only ones a batch may name),
and whether the last ``prepare_lora`` succeeded on every shard (an adapter refit needs it).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence

import attrs
import torch
from returns.result import Failure, Result, Success

from genworker.core.assembly import assemble_outputs
from genworker.core.errors import CoreError
from genworker.core.lora import LoraRef, RowAdapterError, row_adapters
from genworker.core.routing import FILL
from genworker.core.sharding import (
    ShardError,
    ShardPlan,
    describe_shard_rows,
    merge_shard_outputs,
    merge_shard_texts,
)
from genworker.core.versions import NO_VERSION, GroupVersions

__all__ = [
    "FAULTS",
    "JOINS",
    "Fault",
    "GroupCallError",
    "GroupRefits",
    "Refit",
    "check_futures",
    "check_in_flight",
    "check_world_size",
    "empty_outputs",
    "failed_on",
    "failed_to_start",
    "fault_message",
    "list_faults",
    "merge_outputs",
    "merge_texts",
    "ray_reason",
    "shard_lists",
    "shard_mapping",
    "shard_tensors",
    "shard_texts",
    "stream_pair",
    "unusable",
]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@attrs.frozen
class GroupCallError(CoreError):
    """A group call refused, or a shard's answer its contract forbids; ``call`` names it."""

    call: str


class Fault(enum.Enum):
    """How a shard's call failed (the module docstring)."""

    LATE = "late"
    DIED = "died"
    WORKER = "worker"
    FOREIGN = "foreign"


#: Each fault's line: ``detail`` is the worker's message, the dead actor's reason or the
#: foreign error (``Type: text``); ``rows`` what the shard's rows are in the batch.
FAULTS: Mapping[Fault, str] = {
    Fault.LATE: "shard {rank}: {call} did not finish within {bound:g} s "
    "(the actor may still be running it)",
    Fault.DIED: "shard {rank}: the actor died during {call}: {detail}",
    Fault.WORKER: "shard {rank}{rows}: {detail}",
    Fault.FOREIGN: "shard {rank}: {call} raised {detail}",
}


def fault_message(
    fault: Fault,
    call: str,
    rank: int,
    *,
    detail: str = "",
    bound: float = 0.0,
    rows: tuple[int, ...] = (),
) -> str:
    """Shard ``rank``'s ``fault`` during ``call``, in one line (:data:`FAULTS`)."""
    described = describe_shard_rows(rows)
    return FAULTS[fault].format(rank=rank, call=call, detail=detail, bound=bound, rows=described)


def list_faults(messages: Mapping[int, str]) -> str:
    """The failed shards' lines, by rank: the message of a failure raised as a worker's."""
    return "; ".join(messages[rank] for rank in sorted(messages))


def failed_on(call: str, messages: Mapping[int, str], num_shards: int) -> str:
    """A failed call's message: how many shards failed, and each one's line, by rank."""
    return f"{call} failed on {len(messages)} of {num_shards} shard(s): {list_faults(messages)}"


def failed_to_start(
    answers: Mapping[int, object], reasons: Mapping[int, str | None], num_shards: int, bound: float
) -> str | None:
    """Why engines failed to start, by shard (``None`` when every one started): each
    shard's ``is_alive`` answer, or why it gave none (``None``: not within ``bound``)."""
    problems = {
        rank: f"no answer within {bound:g} s (engine still loading?)" if why is None else why
        for rank, why in reasons.items()
    }
    for rank, alive in answers.items():
        if alive is not True:
            problems[rank] = "the worker reports its engine is not alive"
    if not problems:
        return None
    listed = "; ".join(f"shard {rank}: {why}" for rank, why in sorted(problems.items()))
    return f"{len(problems)} of {num_shards} engine(s) failed to start: {listed}"


def unusable(call: str, *, closed: bool, dead: Mapping[int, str]) -> str | None:
    """Why ``call`` is refused before it starts: the group shut down, or a shard died
    earlier (``dead``: each dead shard's reason); ``None`` when it may run."""
    if closed:
        return f"{call}: the group was shut down"
    if not dead:
        return None
    listed = "; ".join(f"shard {rank}: {why}" for rank, why in sorted(dead.items()))
    return (
        f"{call}: shard(s) {sorted(dead)} died earlier ({listed}); shut the group down and "
        "create a new one"
    )


def ray_reason(text: str, type_name: str, *, init_failed: bool) -> str:
    """One line from Ray's account of an error (colours dropped): its only line, or its
    first and last; for a failed actor ``__init__``, the exception it raised (last line)."""
    plain = _ANSI.sub("", text)
    lines = [" ".join(line.split()) for line in plain.splitlines() if line.strip()]
    if not lines:
        return type_name
    if init_failed:
        return f"the worker's __init__ raised {lines[-1]}"
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


#: Each weight-update group join's size argument, and how its message names the trainer's
#: ranks (``{}``: their count).
JOINS: Mapping[str, tuple[str, str]] = {
    "init_collective": ("world_size", "the trainer's {} rank(s)"),
    "init_nccl_reshard_comm_group": ("sub_world_size", "{} trainer rank(s) per stage"),
}


def check_world_size(
    call: str, given: int, trainer_ranks: int, engine_workers: int
) -> Result[None, GroupCallError]:
    """The size of the weight-update group ``call`` joins (:data:`JOINS`) is the trainer's
    ranks and the group's engine workers."""
    field, trainer = JOINS[call]
    expected = trainer_ranks + engine_workers
    if given == expected:
        return Success(None)
    return Failure(
        GroupCallError(
            f"{call}: {field}={given} but {trainer.format(trainer_ranks)} and this group's "
            f"{engine_workers} engine worker(s) make {expected}",
            call=call,
        )
    )


def check_in_flight(
    call: str, mode: str | None, clear_cache: bool | None, *, async_shards: bool
) -> Result[dict[str, object], GroupCallError]:
    """A refit's in-flight options that were given, as keywords: only async shards take them."""
    given: dict[str, object] = {
        k: v for k, v in (("mode", mode), ("clear_cache", clear_cache)) if v is not None
    }
    if given and not async_shards:
        return Failure(
            GroupCallError(
                f"{call}: {sorted(given)} apply to in-flight refits of async shards "
                "(vllm_cfg.async_engine: true)",
                call=call,
            )
        )
    return Success(given)


def check_futures(count: int, num_shards: int) -> Result[None, GroupCallError]:
    """``collect``'s futures: one per shard."""
    if count == num_shards:
        return Success(None)
    message = f"collect: {count} future(s) for {num_shards} shard(s)"
    return Failure(GroupCallError(message, "collect"))


def shard_mapping(
    call: str, rank: int, value: object
) -> Result[Mapping[str, object], GroupCallError]:
    """Shard ``rank``'s answer to a call that answers a mapping (``multimodal_info``)."""
    if isinstance(value, Mapping):
        return Success(value)
    return Failure(GroupCallError(f"shard {rank}: {call} returned {value!r:.200}", call))


def shard_lists(call: str, answers: Sequence[object]) -> Result[list[list[object]], GroupCallError]:
    """Every shard's answer to a call that answers a list (one item per engine worker)."""
    lists = [list(a) for a in answers if isinstance(a, list)]
    if len(lists) < len(answers):
        bad = next(a for a in answers if not isinstance(a, list))
        return Failure(GroupCallError(f"{call} returned {type(bad).__name__}, not a list", call))
    return Success(lists)


def shard_tensors(
    call: str, rank: int, value: object
) -> Result[dict[str, torch.Tensor], GroupCallError]:
    """Shard ``rank``'s output: tensors by name."""
    if isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    ):
        return Success(dict(value))
    return Failure(GroupCallError(f"shard {rank}: {call} returned {value!r:.200}", call))


def shard_texts(rank: int, value: object) -> Result[list[str], GroupCallError]:
    """Shard ``rank``'s ``generate_text`` answer: its ``texts``."""
    texts = value.get("texts") if isinstance(value, Mapping) else None
    if isinstance(texts, list) and all(isinstance(t, str) for t in texts):
        return Success(texts)
    message = f"shard {rank}: generate_text returned {value!r:.200}"
    return Failure(GroupCallError(message, "generate_text"))


def merge_outputs(
    plan: ShardPlan, results: Mapping[int, Mapping[str, torch.Tensor]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """``generate``'s shard outputs by rank (a shard without rows is absent) as one batch in
    input row order (``core.sharding.merge_shard_outputs``): output ids padded with
    ``pad_token_id``, weight versions with ``NO_VERSION``, routed experts with ``FILL``."""
    outputs = [results.get(rank, {}) for rank in range(plan.num_shards)]
    pads = {"weight_versions": NO_VERSION, "routed_experts": FILL}
    return merge_shard_outputs(plan, outputs, pad_token_id, pad_values=pads)


def merge_texts(
    plan: ShardPlan, results: Mapping[int, object]
) -> Result[list[str], GroupCallError | ShardError]:
    """``generate_text``'s shard answers by rank (a shard without rows is absent), each
    checked (:func:`shard_texts`), as one list in input row order."""
    texts: list[list[str]] = []
    for rank in range(plan.num_shards):
        checked = shard_texts(rank, results.get(rank, {"texts": []}))
        if isinstance(checked, Failure):
            return checked
        texts.append(checked.unwrap())
    return merge_shard_texts(plan, texts)


def stream_pair(rank: int, value: object) -> Result[tuple[int, object], GroupCallError]:
    """One item of shard ``rank``'s ``generate_async`` stream: ``(its row, its output)``."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], int):
        return Success((value[0], value[1]))
    message = f"shard {rank}: generate_async yielded {value!r:.200}, not (row, output)"
    return Failure(GroupCallError(message, "generate_async"))


def empty_outputs(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """A ``generate`` of a batch without rows: the shards' keys, no version anywhere."""
    empty = assemble_outputs(input_ids, input_lengths, [], pad_token_id)
    versions = torch.full(empty.output_ids.shape, NO_VERSION, dtype=torch.int64)
    return {**empty.as_dict(), "weight_versions": versions}


@attrs.frozen
class Refit:
    """A refit started on every shard and not collected yet: its call, and for an adapter
    refit the adapter's name."""

    call: str
    adapter: str | None = None


@attrs.frozen
class GroupRefits:
    """What a group's refits left (the module docstring)."""

    versions: GroupVersions
    adapters: frozenset[str] = frozenset()
    lora_prepared: bool = False

    @classmethod
    def start(cls, num_shards: int) -> GroupRefits:
        """Every shard on the weights it loaded, no adapter, no ``prepare_lora``."""
        return cls(GroupVersions.start(num_shards))

    def landed(self, refit: Refit | None, results: Mapping[int, object]) -> GroupRefits:
        """After ``collect`` of ``refit`` (``None``: no refit of this group): the shards
        that answered ``True`` in ``results`` took it."""
        if refit is None:
            return self
        took = [rank for rank, ok in results.items() if ok is True]
        adapters = self.adapters
        if refit.adapter is not None and len(took) == len(self.versions.shards):
            adapters = adapters | {refit.adapter}
        return attrs.evolve(self, versions=self.versions.landed(took), adapters=adapters)

    def check_adapters(
        self, data: Mapping[str, object], batch_size: int
    ) -> Result[tuple[LoraRef | None, ...], RowAdapterError]:
        """A batch's ``lora`` / ``lora_names`` checked as each shard checks them
        (``core.lora.row_adapters``), against the adapters that landed on every shard (the
        ids are each shard's: names only here), so the error names the batch's input."""
        served = dict.fromkeys(self.adapters, 0)
        return row_adapters(data.get("lora"), data.get("lora_names"), batch_size, served)

    def relabelled(self, rank: int, output: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Shard ``rank``'s output with its ``weight_versions`` (where it has them) as the
        group's (``GroupVersions.relabel``)."""
        versions = output.get("weight_versions")
        if versions is None:
            return dict(output)
        return {**output, "weight_versions": self.versions.relabel(rank, versions)}
