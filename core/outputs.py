"""Checks on what the engine returned, before any of it reaches the trainer.

Theory of operation
-------------------
Non-finite logprobs (failure-modes.md G11). vLLM returns, for each generated token, the
value its sampler saw for that token in the engine's ``logprobs_mode``
(``vllm/config/model.py``, 0.32): ``raw_logprobs`` (vLLM's default) and ``raw_logits`` are
taken before temperature, penalties and top-k/top-p; ``processed_logprobs`` and
``processed_logits`` (vLLM's ``PROCESSED_LOGPROBS_MODES``) after them, where a masked
token holds -inf. A NaN or a +inf means garbage logits (trl#6693: raise, never mask) in
every mode; a -inf is legal only in a processed mode. :func:`check_logprobs` applies that
policy to a batch's flat logprob array (rows laid out as in
:class:`~genworker.core.assembly.FlatGenerations`) in one vectorised pass when every value
is finite, the generate hot path; only a batch that holds a non-finite value pays for
finding its rows. Its success value counts the non-finite values it let through (the
legal -inf), its failure names the rows, how many bad values each holds, and every
non-finite value seen.

Aborted rows (G14). vLLM ends a request it aborted with finish reason ``"abort"`` and the
tokens sampled so far. ``FlatGenerations.aborted`` carries that, and
:func:`check_finished` refuses a batch that holds such a row, naming the rows: a partial
rollout must not pass for a natural stop (its ``truncated`` flag is false).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt
import torch
from returns.result import Failure, Result, Success

from genworker.core.assembly import FlatGenerations, Generation, GenerationOutputs
from genworker.core.errors import CoreError
from genworker.core.routing import RoutesRefused, check_routes

__all__ = [
    "PROCESSED_LOGPROBS_MODES",
    "AbortedRows",
    "NonFiniteCounts",
    "NonFiniteLogprobs",
    "PastContext",
    "check_context",
    "check_finished",
    "check_generation_logprobs",
    "check_generation_routes",
    "check_logprobs",
    "check_routed_experts",
    "nonfinite_seen",
]

PROCESSED_LOGPROBS_MODES: Final = frozenset({"processed_logprobs", "processed_logits"})
"""vLLM's logprobs modes taken after the logits processors: a masked token is -inf."""


@attrs.frozen
class NonFiniteCounts:
    """How many NaN, +inf and -inf values a logprob array holds."""

    nan: int = 0
    posinf: int = 0
    neginf: int = 0

    @property
    def total(self) -> int:
        return self.nan + self.posinf + self.neginf

    def by_kind(self) -> dict[str, int]:
        """The counts keyed as the worker's counter labels them (``kind``)."""
        return {"nan": self.nan, "+inf": self.posinf, "-inf": self.neginf}

    def __str__(self) -> str:
        return f"{self.nan} NaN, {self.posinf} +inf, {self.neginf} -inf"


_NONE_SEEN: Final = NonFiniteCounts()


def nonfinite_seen(checked: Result[NonFiniteCounts, NonFiniteLogprobs]) -> NonFiniteCounts:
    """The non-finite logprobs a check of logprobs saw, refused or not."""
    return checked.failure().seen if isinstance(checked, Failure) else checked.unwrap()


@attrs.frozen
class NonFiniteLogprobs(CoreError):
    """Generated tokens whose logprobs the policy refuses (see the module docstring).

    ``rows`` (ascending) hold at least one refused value each, ``counts[i]`` of them in
    ``rows[i]``; ``seen`` counts every non-finite value of the batch, refused or not.
    """

    rows: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    seen: NonFiniteCounts = _NONE_SEEN
    logprobs_mode: str = "raw_logprobs"


@attrs.frozen
class AbortedRows(CoreError):
    """Rows the engine aborted (finish reason ``"abort"``): ``rows`` ascending, and how
    many tokens each had when it was aborted."""

    rows: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()


def _row_names(rows: Sequence[int] | None, count: int) -> npt.NDArray[np.int64]:
    if rows is None:
        return np.arange(count, dtype=np.int64)
    names = np.asarray(rows, dtype=np.int64).reshape(-1)
    if names.shape[0] != count:
        raise ValueError(f"{names.shape[0]} row names for {count} rows")
    return names


def check_logprobs(
    logprobs: npt.NDArray[np.float32] | npt.NDArray[np.float64],
    lengths: npt.NDArray[np.int64],
    logprobs_mode: str,
    *,
    rows: Sequence[int] | None = None,
) -> Result[NonFiniteCounts, NonFiniteLogprobs]:
    """The batch's non-finite logprobs, or the rows the policy refuses.

    ``logprobs`` is the flat array of every generated token's logprob, row after row, row
    i owning ``lengths[i]`` values; ``rows`` names the rows in messages (default: their
    positions). A mode outside :data:`PROCESSED_LOGPROBS_MODES` (vLLM's default included)
    refuses -inf too. Arrays that do not fit together are a programming error
    (``ValueError``).
    """
    if logprobs.ndim != 1 or lengths.ndim != 1 or bool((lengths < 0).any()):
        raise ValueError(
            f"check_logprobs needs 1-D logprobs and non-negative 1-D lengths; got shapes "
            f"{logprobs.shape} and {lengths.shape}"
        )
    if int(lengths.sum()) != logprobs.shape[0]:
        raise ValueError(
            f"check_logprobs: {logprobs.shape[0]} logprobs for lengths summing to "
            f"{int(lengths.sum())}"
        )
    names = _row_names(rows, lengths.shape[0])
    if bool(np.isfinite(logprobs).all()):  # the hot path: one pass, nothing else
        return Success(_NONE_SEEN)
    nan = np.isnan(logprobs)
    posinf = logprobs == np.inf
    neginf = logprobs == -np.inf
    seen = NonFiniteCounts(int(nan.sum()), int(posinf.sum()), int(neginf.sum()))
    refused = nan | posinf
    if logprobs_mode not in PROCESSED_LOGPROBS_MODES:
        refused |= neginf
    if not bool(refused.any()):
        return Success(seen)
    row_of = np.repeat(np.arange(lengths.shape[0]), lengths)
    per_row = np.bincount(row_of[refused], minlength=lengths.shape[0])
    bad = np.flatnonzero(per_row)
    named = tuple(int(r) for r in names[bad])
    counts = tuple(int(c) for c in per_row[bad])
    legal = (
        f"-inf only under {' or '.join(sorted(PROCESSED_LOGPROBS_MODES))}"
        if logprobs_mode not in PROCESSED_LOGPROBS_MODES
        else "-inf is legal here"
    )
    return Failure(
        NonFiniteLogprobs(
            message=(
                f"rows {list(named)} came back with non-finite logprobs ({list(counts)} "
                f"values; the batch holds {seen}) under logprobs_mode {logprobs_mode!r}: "
                f"NaN and +inf are never valid, {legal}"
            ),
            rows=named,
            counts=counts,
            seen=seen,
            logprobs_mode=logprobs_mode,
        )
    )


def check_generation_logprobs(
    generation: Generation, logprobs_mode: str, *, row: int = 0
) -> Result[NonFiniteCounts, NonFiniteLogprobs]:
    """:func:`check_logprobs` of one generation (named ``row``); one without logprobs has
    nothing to refuse."""
    if generation.logprobs is None:
        return Success(_NONE_SEEN)
    lengths = np.array([generation.num_tokens], dtype=np.int64)
    return check_logprobs(generation.logprobs, lengths, logprobs_mode, rows=(row,))


def check_finished(
    flat: FlatGenerations, *, rows: Sequence[int] | None = None
) -> Result[FlatGenerations, AbortedRows]:
    """``flat`` when no row was aborted, else the aborted rows (named by ``rows``, default
    their positions)."""
    if not bool(flat.aborted.any()):
        return Success(flat)
    bad = np.flatnonzero(flat.aborted)
    named = tuple(int(r) for r in _row_names(rows, flat.batch_size)[bad])
    tokens = tuple(int(n) for n in flat.lengths[bad])
    return Failure(
        AbortedRows(
            message=(
                f"rows {list(named)} were aborted by the engine (finish reason 'abort') "
                f"after {list(tokens)} tokens: partial rollouts, not natural stops"
            ),
            rows=named,
            tokens=tokens,
        )
    )


def check_routed_experts(
    flat: FlatGenerations,
    prompt_lengths: npt.NDArray[np.int64],
    *,
    rows: Sequence[int] | None = None,
) -> Result[FlatGenerations, RoutesRefused]:
    """``flat`` when it carries no routes or every row's routes fit its prompt and
    generation (``genworker.core.routing.check_routes``), else the rows that do not."""
    if flat.routed_experts is None:
        return Success(flat)
    checked = check_routes(flat.routed_experts, prompt_lengths, flat.lengths, rows=rows)
    return checked.map(lambda _shape: flat)


def check_generation_routes(
    generation: Generation, prompt_length: int, *, row: int = 0
) -> Result[Generation, RoutesRefused]:
    """:func:`check_routed_experts` of one generation (named ``row``)."""
    if generation.routed_experts is None:
        return Success(generation)
    checked = check_routes(
        (generation.routed_experts,),
        np.array([prompt_length], dtype=np.int64),
        np.array([generation.num_tokens], dtype=np.int64),
        rows=(row,),
    )
    return checked.map(lambda _shape: generation)


@attrs.frozen
class PastContext(CoreError):
    """Rows that came back holding more than ``max_model_len`` tokens in the context: each
    row (ascending) and what it held."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...]


def check_context(
    out: GenerationOutputs, max_model_len: int, expanded: Sequence[int] | None = None
) -> Result[GenerationOutputs, PastContext]:
    """``out`` when every row's context (its prompt, ``expanded`` per row when images
    expanded it, plus its generation) fits ``max_model_len``, else the rows past it."""
    held = out.unpadded_sequence_lengths
    if expanded is not None:
        held = torch.tensor(list(expanded), dtype=held.dtype) + out.generation_lengths.to(
            held.dtype
        )
    over = torch.nonzero(held > max_model_len).flatten()
    if not over.numel():
        return Success(out)
    rows, lengths = over.tolist(), held[over].tolist()
    return Failure(
        PastContext(
            f"rows {rows} came back longer than max_model_len={max_model_len}: "
            f"context lengths {lengths}",
            rows=tuple(rows),
            lengths=tuple(lengths),
        )
    )
