"""A batch as rows that succeed or fail alone: the per-row checks and one-row outputs of
streamed generation.

Theory of operation. :func:`genworker.core.batch.check_batch` refuses a whole batch for
one bad row; a stream (the async worker's ``generate_async``) instead gives every row its
own outcome. :func:`check_rows` runs the same checks, so the same rules apply in the same
order and read the same: a problem with the batch as a whole (not a 2-D integer tensor,
lengths of another batch size) still refuses it, but a row that breaks a row rule (its
length, its padding, its token ids, no room under ``max_model_len``) is set aside with the
rule's :class:`~genworker.core.batch.BatchError` and the others are checked again. A row
set aside is replaced by a one-token filler row (token 0, then padding) so that row
indices keep their meaning in the next pass's messages; at most one pass per row rule.

:func:`assemble_row` is one row's output in the contract of ``generate``
(``genworker.core.assembly``), for a batch of that single row cut to its own length:
``output_ids`` (1, l + g) holds its prompt and then its generated tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from returns.result import Failure, Result, Success

from genworker.core.assembly import Generation, GenerationOutputs, assemble_outputs
from genworker.core.batch import BatchError, check_batch
from genworker.core.errors import CoreError
from genworker.core.outputs import NonFiniteCounts, NonFiniteLogprobs, check_generation_routes
from genworker.core.versions import (
    Counted,
    VersionRuns,
    finished_runs,
    place_versions,
    uniform_versions,
)

__all__ = [
    "RowChecks",
    "RowRefusal",
    "assemble_row",
    "check_prompts",
    "check_rows",
    "finished_row",
    "uniform_versioned",
    "versioned_outputs",
    "versioned_row",
]


@attrs.frozen
class RowChecks:
    """The rows that can generate, with their prompts, and why each other row cannot.

    ``prompts`` and ``errors`` are ``(row, ...)`` pairs in ascending row order; every row
    of the batch is in exactly one of them.
    """

    prompts: tuple[tuple[int, list[int]], ...]
    errors: tuple[tuple[int, BatchError], ...]

    @property
    def rows(self) -> tuple[int, ...]:
        """The rows that can generate."""
        return tuple(row for row, _ in self.prompts)


def _with_fillers(
    ids: torch.Tensor, lengths: torch.Tensor, rows: list[int], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    ids, lengths = ids.clone(), lengths.clone()
    ids[rows] = pad_token_id
    ids[rows, 0] = 0
    lengths[rows] = 1
    return ids, lengths


def check_rows(
    input_ids: object,
    input_lengths: object,
    *,
    pad_token_id: int,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> Result[RowChecks, BatchError]:
    """Check a right-padded batch row by row (see the module docstring).

    ``Failure`` only for a batch that is wrong as a whole (its shapes and dtypes); every
    row problem comes back inside :class:`RowChecks`.
    """
    failed: dict[int, BatchError] = {}
    ids, lengths = input_ids, input_lengths
    while True:
        result = check_batch(
            ids,
            lengths,
            pad_token_id=pad_token_id,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
        )
        if isinstance(result, Success):
            prompts = result.unwrap().prompts
            return Success(
                RowChecks(
                    prompts=tuple((r, p) for r, p in enumerate(prompts) if r not in failed),
                    errors=tuple(sorted(failed.items())),
                )
            )
        error = result.failure()
        if not error.rows:
            return Failure(error)
        new = [row for row in error.rows if row not in failed]
        failed.update((row, error) for row in new)
        assert isinstance(ids, torch.Tensor)
        assert isinstance(lengths, torch.Tensor)
        if not new or len(failed) == ids.shape[0]:
            # Every row failed (only fillers would be left to check).
            return Success(RowChecks(prompts=(), errors=tuple(sorted(failed.items()))))
        ids, lengths = _with_fillers(ids, lengths, new, pad_token_id)


def check_prompts(
    input_ids: object,
    input_lengths: object,
    *,
    whole: bool,
    pad_token_id: int,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> Result[RowChecks, BatchError]:
    """A right-padded batch checked ``whole`` (:func:`check_batch`: a bad row refuses the
    batch, every row comes back with its prompt) or row by row (:func:`check_rows`)."""
    limits = {"vocab_size": vocab_size, "max_model_len": max_model_len}
    if not whole:
        return check_rows(input_ids, input_lengths, pad_token_id=pad_token_id, **limits)
    checked = check_batch(input_ids, input_lengths, pad_token_id=pad_token_id, **limits)
    return checked.map(lambda batch: RowChecks(tuple(enumerate(batch.prompts)), ()))


@attrs.frozen
class RowRefusal(CoreError):
    """A finished streamed row that breaks the engine's contract, in the words of
    ``generate``'s refusal; ``cause``: the core check that refused it (None for a row
    past the context)."""

    cause: CoreError | None = None


def finished_row(
    generation: Generation,
    logprobs: Result[NonFiniteCounts, NonFiniteLogprobs],
    lengths: tuple[int, int],
    *,
    row: int,
    max_model_len: int,
    spans: Sequence[tuple[str, int, int]] | None,
    counted: Counted | None,
) -> Result[VersionRuns, RowRefusal]:
    """A finished streamed row checked in order, as ``generate`` checks its rows: its
    logprobs (``check_generation_logprobs``, given), its context (``lengths``: its
    prompt's, and what it holds in the context), its weight versions
    (:func:`~genworker.core.versions.finished_runs`), its routes; its versions, or the
    first refusal."""
    prompt, context = lengths
    if isinstance(logprobs, Failure):
        return Failure(RowRefusal(f"generate: {logprobs.failure()}", logprobs.failure()))
    if context + generation.num_tokens > max_model_len:
        return Failure(
            RowRefusal(
                f"row {row} came back longer than max_model_len={max_model_len}: "
                f"{context} + {generation.num_tokens} tokens"
            )
        )
    runs = finished_runs(generation.num_tokens, row, spans=spans, counted=counted)
    if isinstance(runs, Failure):
        return Failure(RowRefusal(str(runs.failure()), runs.failure()))
    routed = check_generation_routes(generation, prompt, row=row)
    if isinstance(routed, Failure):
        return Failure(RowRefusal(f"generate: {routed.failure()}", routed.failure()))
    return Success(runs.unwrap())


def assemble_row(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    row: int,
    generation: Generation,
    pad_token_id: int,
) -> GenerationOutputs:
    """Row ``row``'s output as a batch of one, cut to its own length (checked rows only)."""
    length = int(input_lengths[row])
    return assemble_outputs(
        input_ids[row : row + 1, :length],
        input_lengths[row : row + 1],
        [generation],
        pad_token_id,
    )


def versioned_outputs(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    generations: Sequence[Generation],
    versions: Sequence[VersionRuns],
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """``generate``'s contract of these rows plus ``weight_versions`` (B, W) int64: the
    version of each generated token at its position, -1 elsewhere."""
    out = assemble_outputs(input_ids, input_lengths, list(generations), pad_token_id).as_dict()
    width = int(out["output_ids"].shape[1])
    out["weight_versions"] = place_versions(input_lengths.tolist(), versions, width)
    return out


def uniform_versioned(out: GenerationOutputs, version: int) -> dict[str, torch.Tensor]:
    """``out`` as ``generate``'s contract plus ``weight_versions`` (B, W) int64 for a batch
    sampled under one ``version`` (the sync worker's: no refit runs inside its
    ``generate``): ``version`` at every generated token's position, -1 elsewhere."""
    versions = uniform_versions(
        out.unpadded_sequence_lengths - out.generation_lengths,
        out.generation_lengths,
        int(out.output_ids.shape[1]),
        version,
    )
    return {**out.as_dict(), "weight_versions": versions}


def versioned_row(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    row: int,
    generation: Generation,
    versions: VersionRuns,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """:func:`assemble_row` of row ``row`` plus its ``weight_versions`` (1, l + g)."""
    out = assemble_row(input_ids, input_lengths, row, generation, pad_token_id).as_dict()
    width = int(out["output_ids"].shape[1])
    out["weight_versions"] = place_versions([int(input_lengths[row])], [versions], width)
    return out
