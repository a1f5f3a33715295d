"""vLLM's completions as :class:`~genworker.core.assembly.FlatGenerations`: each row's
token ids, sampled logprobs and finish reason, in every layout vLLM keeps them, read
without vLLM (the vLLM adapters hand their ``CompletionOutput`` values in).

Theory of operation
-------------------
- The sampled token's logprob: with ``logprobs=k`` vLLM records, per position, the sampled
  token first and then the top k (``append_logprobs_for_next_position`` in
  vllm/logprobs.py, 0.32). ``FlatLogprobs`` keeps those in flat lists with a start index
  per position, so the sampled tokens' logprobs are one fancy-index away; their token ids
  must equal the output ids (a mismatch is an engine contract error). Without flat
  logprobs each position is a mapping looked up by the sampled token id; a missing entry
  is an error, never 0.0. The worker's own requests may keep the sampled ids and
  logprobs in two typed arrays instead (:class:`SampledLogprobs`, filled inside vLLM by
  ``genworker.shell.sampled_logprobs``), and their token ids in a third.
- One pass to :class:`FlatGenerations`. When every row's token ids and sampled logprobs
  are arrays, the batch's ids and logprobs are each joined into one buffer by one C copy
  (:func:`joined_generations`), and the ids are checked against the sampled ids as one
  byte string, no Python per token. Otherwise every row's token ids are packed straight
  into one flat numpy array (``struct``, one C loop per row) and its logprobs copied in:
  from the sampled arrays (their ids compared with the row's as bytes), or from flat
  logprobs holding exactly the sampled token at each position (checked with two list
  comparisons, packed by ``struct``); no per-row ``Generation`` is built. From the first
  row that does not fit either layout on, rows go one by one (:func:`generation_of`),
  which names what is wrong. ``consume`` drops each row's entry of the list once it is
  packed: a list that held the only references frees the row's objects while they are
  still in the cache (``genworker.shell.collector``).
- Finish reasons (vllm/v1/engine/__init__.py ``FINISH_REASON_STRINGS``, 0.32):
  ``length`` is truncated, ``stop`` and ``repetition`` are stops, ``abort`` (the engine
  ended the request, its tokens so far kept) is flagged in ``FlatGenerations.aborted``,
  never passed as a stop (the workers refuse it, G14). Anything else (``error``, a
  request-level failure; None, a row that did not finish) is an engine contract error
  naming every such row.

Every problem is an :class:`UnreadCompletion`; the rows come back as vLLM made them
(non-finite logprobs included): ``genworker.core.outputs`` checks those.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Mapping, Sequence, Sized
from typing import Final, Protocol, TypeVar, cast

import attrs
import numpy as np
import numpy.typing as npt
from returns.result import Failure, Result, Success

from genworker.core.assembly import FlatGenerations, Generation, flatten_generations
from genworker.core.errors import CoreError

__all__ = [
    "VLLM_FINISH_REASONS",
    "Completion",
    "FlatLayout",
    "SampledLogprobs",
    "StepMatrix",
    "UnreadCompletion",
    "flat_generations",
    "generation_of",
    "joined_generations",
]

VLLM_FINISH_REASONS: Final = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "repetition": "stop",
}
"""vLLM's finish reasons of a finished row, as ours (see the module docstring)."""


_Item = TypeVar("_Item", covariant=True)


class StepMatrix(Protocol[_Item]):
    """A step's numpy array in vLLM's ``LogprobsLists`` (``vllm/v1/outputs.py``): a row per
    new token, the sampled token's entry first."""

    def __len__(self) -> int: ...

    def item(self, row: int, column: int, /) -> _Item: ...


class SampledLogprobs:
    """The sampled token's id (int64) and logprob (float32) at each generated position:
    a buffer vLLM's output processor appends to, step by step, for the worker's requests."""

    __slots__ = ("logprobs", "token_ids")

    def __init__(self) -> None:
        self.token_ids = array("q")
        self.logprobs = array("f")

    def __len__(self) -> int:
        return len(self.logprobs)

    def __repr__(self) -> str:
        return f"SampledLogprobs({len(self)} positions)"

    def append_step(
        self, token_ids: StepMatrix[int], logprobs: StepMatrix[float], cumulative: float
    ) -> float:
        """Append a step's sampled ids and logprobs (the first column of each row);
        ``cumulative`` with each logprob added in turn, as vLLM sums it."""
        for position in range(len(logprobs)):
            value = logprobs.item(position, 0)
            self.token_ids.append(token_ids.item(position, 0))
            self.logprobs.append(value)
            cumulative += value
        return cumulative


class FlatLayout(Protocol):
    """vLLM's ``FlatLogprobs``: position p owns entries ``[start_indices[p],
    end_indices[p])``, the sampled token first."""

    @property
    def start_indices(self) -> list[int]: ...

    @property
    def end_indices(self) -> list[int]: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def logprobs(self) -> list[float]: ...


class Completion(Protocol):
    """What is read of vLLM's ``CompletionOutput``."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> object: ...

    @property
    def finish_reason(self) -> str | None: ...


class _Logprob(Protocol):
    @property
    def logprob(self) -> float: ...


@attrs.frozen
class UnreadCompletion(CoreError):
    """A completion the engine's contract forbids; ``rows`` names the rows."""

    rows: tuple[int, ...] = ()


class _Unread(Exception):
    """An :class:`UnreadCompletion` on its way out to a public function's Failure."""

    def __init__(self, error: UnreadCompletion) -> None:
        super().__init__(error.message)
        self.error = error


def _unread(message: str, *rows: int) -> _Unread:
    return _Unread(UnreadCompletion(message, rows=rows))


def flat_generations(
    outs: list[Completion | None],
    flat_type: type[FlatLayout],
    *,
    consume: bool = False,
    call: str = "generate",
) -> Result[FlatGenerations, UnreadCompletion]:
    """Every row's generation as flat arrays, in one pass where the layout allows it (see
    the module docstring), the rest row by row from the first row it does not;
    ``flat_type`` is vLLM's ``FlatLogprobs``. ``consume``: each row's entry of ``outs``
    is set to None once read. ``call`` names the call in the errors."""
    try:
        return Success(_generations(outs, flat_type, consume, call))
    except _Unread as e:
        return Failure(e.error)


def joined_generations(
    outs: Sequence[Completion | None], call: str = "generate"
) -> Result[FlatGenerations | None, UnreadCompletion]:
    """The batch when every row holds :class:`SampledLogprobs` and an int64 array of ids:
    each joined by one C copy, the ids compared with the sampled ids as one byte string,
    and each row's three lengths compared; None when any of that does not hold (the
    row-by-row pass then names the row)."""
    try:
        return Success(_joined(outs, call))
    except _Unread as e:
        return Failure(e.error)


def generation_of(
    row: int, out: Completion, flat_type: type[FlatLayout]
) -> Result[Generation, UnreadCompletion]:
    """One completion (named ``row``) as a :class:`Generation`."""
    try:
        return Success(_generation(row, out, flat_type))
    except _Unread as e:
        return Failure(e.error)


def _generations(
    outs: list[Completion | None], flat_type: type[FlatLayout], consume: bool, call: str
) -> FlatGenerations:
    joined = _joined(outs, call)
    if joined is not None:
        if consume:
            outs[:] = [None] * len(outs)
        return joined
    lengths = np.array([len(_present(out).token_ids) for out in outs], dtype=np.int64)
    total = int(lengths.sum())
    token_ids = bytearray(8 * total)  # int64, then wrapped by numpy without a copy
    logprobs = bytearray(4 * total)  # float32
    reasons: list[str | None] = []
    # Per row length n: [0, n) (the start indices of one entry per position) and the
    # packers of n native int64 / float32 values. struct packs a list's values straight
    # into the buffers in one C loop each, about twice as fast as array.array or numpy's
    # list conversion; float32 is rounded from vLLM's doubles as numpy's cast rounds it.
    layouts: dict[int, tuple[list[int], struct.Struct, struct.Struct]] = {}
    offset = 0
    for row in range(len(outs)):
        out = _present(outs[row])
        ids = out.token_ids  # a list in 0.32; any other sequence is compared as one
        if not isinstance(ids, list):
            ids = list(ids)
        flat: object = out.logprobs
        n = len(ids)
        layout = layouts.get(n)
        if layout is None:
            layout = layouts[n] = (list(range(n)), struct.Struct(f"{n}q"), struct.Struct(f"{n}f"))
        one_per_position, pack_ids, pack_logprobs = layout
        if isinstance(flat, SampledLogprobs) and len(flat) == n:
            pack_ids.pack_into(token_ids, 8 * offset, *ids)
            if token_ids[8 * offset : 8 * (offset + n)] != flat.token_ids:
                return _with_rest(
                    outs, row, flat_type, token_ids, logprobs, offset, lengths, reasons, call
                )
            memoryview(logprobs)[4 * offset : 4 * (offset + n)] = memoryview(flat.logprobs).cast(
                "B"
            )
        elif (
            isinstance(flat, flat_type)
            and len(flat.logprobs) == n
            and flat.token_ids == ids
            and flat.start_indices == one_per_position
        ):
            pack_ids.pack_into(token_ids, 8 * offset, *ids)
            pack_logprobs.pack_into(logprobs, 4 * offset, *flat.logprobs)
        else:
            return _with_rest(
                outs, row, flat_type, token_ids, logprobs, offset, lengths, reasons, call
            )
        offset += n
        reasons.append(out.finish_reason)
        if consume:
            del out, ids, flat
            outs[row] = None
    truncated, aborted = _finish_flags(reasons, call)
    return FlatGenerations(
        token_ids=np.frombuffer(token_ids, dtype=np.int64),
        logprobs=np.frombuffer(logprobs, dtype=np.float32),
        lengths=lengths,
        truncated=truncated,
        aborted=aborted,
    )


def _joined(outs: Sequence[Completion | None], call: str) -> FlatGenerations | None:
    present = [_present(out) for out in outs]
    ids: list[object] = [out.token_ids for out in present]
    sampled: list[object] = [out.logprobs for out in present]
    if not (
        all(type(row) is array and row.typecode == "q" for row in ids)
        and all(type(row) is SampledLogprobs for row in sampled)
    ):
        return None
    arrays = cast(list["array[int]"], ids)
    kept = cast(list[SampledLogprobs], sampled)
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    if not (
        np.array_equal(lengths, np.fromiter((len(k.token_ids) for k in kept), np.int64))
        and np.array_equal(lengths, np.fromiter((len(k.logprobs) for k in kept), np.int64))
    ):
        return None
    token_ids = bytearray().join(arrays)
    if token_ids != b"".join([k.token_ids for k in kept]):
        return None
    truncated, aborted = _finish_flags([out.finish_reason for out in present], call)
    return FlatGenerations(
        token_ids=np.frombuffer(token_ids, dtype=np.int64),
        logprobs=np.frombuffer(bytearray().join([k.logprobs for k in kept]), dtype=np.float32),
        lengths=lengths,
        truncated=truncated,
        aborted=aborted,
    )


def _present(out: Completion | None) -> Completion:
    if out is None:
        raise ValueError("genworker bug: a vLLM output read after it was dropped")
    return out


def _with_rest(
    outs: Sequence[Completion | None],
    first: int,
    flat_type: type[FlatLayout],
    token_ids: bytearray,
    logprobs: bytearray,
    offset: int,
    lengths: npt.NDArray[np.int64],
    reasons: list[str | None],
    call: str,
) -> FlatGenerations:
    """The rows before ``first`` as packed, the others converted row by row."""
    rest_outs = [_present(outs[row]) for row in range(first, len(outs))]
    truncated, aborted = _finish_flags([*reasons, *(o.finish_reason for o in rest_outs)], call)
    rest = flatten_generations(
        [_generation(first + i, out, flat_type) for i, out in enumerate(rest_outs)]
    )
    return FlatGenerations(
        token_ids=np.concatenate(
            [np.frombuffer(token_ids, dtype=np.int64, count=offset), rest.token_ids]
        ),
        logprobs=np.concatenate(
            [np.frombuffer(logprobs, dtype=np.float32, count=offset), rest.logprobs]
        ),
        lengths=lengths,
        truncated=truncated,
        aborted=aborted,
    )


def _finish_flags(
    reasons: Sequence[str | None], call: str
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Which of these rows ran out of tokens and which the engine aborted; an error naming
    every row that did not finish (one set operation when every row did, a second list
    pass only when one was aborted)."""
    seen = set(reasons)
    if not VLLM_FINISH_REASONS.keys() >= seen:
        rows = [row for row, r in enumerate(reasons) if r not in VLLM_FINISH_REASONS]
        raise _unread(
            f"{call}: rows {rows} did not finish (finish reasons "
            f"{[reasons[row] for row in rows]}; vLLM's finished ones are "
            f"{sorted(VLLM_FINISH_REASONS)})",
            *rows,
        )
    truncated = np.array([r == "length" for r in reasons], dtype=np.bool_)
    if "abort" not in seen:
        return truncated, np.zeros(len(reasons), dtype=np.bool_)
    return truncated, np.array([r == "abort" for r in reasons], dtype=np.bool_)


def _generation(row: int, out: Completion, flat_type: type[FlatLayout]) -> Generation:
    reason = VLLM_FINISH_REASONS.get(out.finish_reason or "")
    if reason is None:
        raise _unread(
            f"generate: row {row} did not finish (finish reason {out.finish_reason!r})", row
        )
    token_ids = np.asarray(out.token_ids, dtype=np.int64)
    return Generation(token_ids, _sampled_logprobs(row, token_ids, out, flat_type), reason)


def _sampled_logprobs(
    row: int, token_ids: npt.NDArray[np.int64], out: Completion, flat_type: type[FlatLayout]
) -> npt.NDArray[np.float32]:
    logprobs = out.logprobs
    if isinstance(logprobs, SampledLogprobs):
        sampled = np.frombuffer(logprobs.token_ids, dtype=np.int64, count=len(logprobs.token_ids))
        if len(logprobs) != len(sampled) or not np.array_equal(sampled, token_ids):
            raise _unread(
                f"generate: row {row}'s sampled logprobs ({len(logprobs)}) are for tokens "
                f"{sampled.tolist()}, not the generated {token_ids.tolist()}",
                row,
            )
        return np.frombuffer(logprobs.logprobs, dtype=np.float32, count=len(logprobs)).copy()
    if logprobs is None:
        raise _unread(f"generate: row {row} came back without logprobs", row)
    if isinstance(logprobs, flat_type):
        starts = np.asarray(logprobs.start_indices, dtype=np.int64)
        ends = np.asarray(logprobs.end_indices, dtype=np.int64)
        if starts.shape != token_ids.shape or bool((ends <= starts).any()):
            raise _unread(
                f"generate: row {row} has {len(token_ids)} tokens but flat logprobs for "
                f"{int((ends > starts).sum())} positions",
                row,
            )
        sampled = np.asarray(logprobs.token_ids, dtype=np.int64)[starts]
        if not np.array_equal(sampled, token_ids):
            raise _unread(
                f"generate: row {row}'s flat logprobs are for tokens {sampled.tolist()}, "
                f"not the generated {token_ids.tolist()}",
                row,
            )
        return np.asarray(logprobs.logprobs, dtype=np.float32)[starts]
    if not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
        raise _unread(
            f"generate: row {row} has {len(token_ids)} tokens but logprobs "
            f"{type(logprobs).__name__} of length {len(cast(Sized, logprobs))}",
            row,
        )
    positions = cast(list[Mapping[int, _Logprob]], logprobs)
    values = np.empty(len(token_ids), dtype=np.float32)
    for i, (token, position) in enumerate(zip(token_ids.tolist(), positions, strict=True)):
        entry = position.get(token)
        if entry is None:
            raise _unread(
                f"generate: row {row} position {i}: no logprob for the sampled token {token}",
                row,
            )
        values[i] = entry.logprob
    return values
