"""Laws of the checks on what the engine returned: non-finite logprobs (G11) and rows the
engine aborted (G14)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from returns.result import Failure, Success
from strategies import LogprobBatch, generations, logprob_batches, st

from genworker.core.assembly import Generation, assemble_outputs, flatten_generations, place_rows
from genworker.core.outputs import (
    PROCESSED_LOGPROBS_MODES,
    AbortedRows,
    NonFiniteCounts,
    NonFiniteLogprobs,
    PastContext,
    check_context,
    check_finished,
    check_generation_logprobs,
    check_logprobs,
    nonfinite_seen,
)


def _reference(batch: LogprobBatch) -> tuple[NonFiniteCounts, list[int], list[int]]:
    """Value by value: what the batch holds, and the rows (positions) the policy refuses
    with how many refused values each."""
    nan = posinf = neginf = 0
    rows: list[int] = []
    counts: list[int] = []
    offset = 0
    for row, n in enumerate(batch.lengths.tolist()):
        refused = 0
        for v in batch.logprobs[offset : offset + n].tolist():
            if math.isnan(v):
                nan += 1
                refused += 1
            elif v == math.inf:
                posinf += 1
                refused += 1
            elif v == -math.inf:
                neginf += 1
                refused += batch.mode not in PROCESSED_LOGPROBS_MODES
        if refused:
            rows.append(row)
            counts.append(refused)
        offset += n
    return NonFiniteCounts(nan, posinf, neginf), rows, counts


@given(logprob_batches())
def test_the_check_refuses_exactly_what_the_policy_refuses_value_by_value(
    batch: LogprobBatch,
) -> None:
    # Law: NaN and +inf are refused in every mode, -inf outside the processed modes; the
    # failure names every refused row with its count, and every non-finite value is
    # counted, whether the batch passes or not.
    seen, rows, counts = _reference(batch)
    result = check_logprobs(batch.logprobs, batch.lengths, batch.mode)
    if not rows:
        assert result == Success(seen)
        return
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, NonFiniteLogprobs)
    assert (list(error.rows), list(error.counts), error.seen) == (rows, counts, seen)
    assert error.logprobs_mode == batch.mode
    assert f"rows {rows}" in error.message
    assert repr(batch.mode) in error.message


@given(logprob_batches())
def test_rows_are_named_by_the_callers_names(batch: LogprobBatch) -> None:
    by_position = check_logprobs(batch.logprobs, batch.lengths, batch.mode)
    named = check_logprobs(batch.logprobs, batch.lengths, batch.mode, rows=batch.rows)
    if isinstance(by_position, Success):
        assert named == by_position
        return
    assert isinstance(named, Failure)
    assert named.failure().rows == tuple(batch.rows[r] for r in by_position.failure().rows)
    assert named.failure().counts == by_position.failure().counts


@given(logprob_batches())
def test_finite_values_never_change_the_verdict(batch: LogprobBatch) -> None:
    finite = np.isfinite(batch.logprobs)
    zeroed = np.where(finite, np.float32(0.0), batch.logprobs)
    assert check_logprobs(zeroed, batch.lengths, batch.mode) == check_logprobs(
        batch.logprobs, batch.lengths, batch.mode
    )


@given(logprob_batches())
def test_a_processed_mode_refuses_a_subset_of_what_a_raw_mode_refuses(
    batch: LogprobBatch,
) -> None:
    raw = check_logprobs(batch.logprobs, batch.lengths, "raw_logprobs")
    processed = check_logprobs(batch.logprobs, batch.lengths, "processed_logprobs")
    if isinstance(raw, Success):
        assert isinstance(processed, Success)
    if isinstance(processed, Failure):
        assert isinstance(raw, Failure)
        assert set(processed.failure().rows) <= set(raw.failure().rows)
        assert processed.failure().seen == raw.failure().seen


def test_minus_infinity_is_legal_only_in_the_processed_modes() -> None:
    logprobs = np.array([-1.0, -np.inf, -0.5], dtype=np.float32)
    lengths = np.array([1, 2], dtype=np.int64)
    for mode in ("processed_logprobs", "processed_logits"):
        assert check_logprobs(logprobs, lengths, mode) == Success(NonFiniteCounts(neginf=1))
    for mode in ("raw_logprobs", "raw_logits", "a future mode"):
        result = check_logprobs(logprobs, lengths, mode)
        assert isinstance(result, Failure)
        assert (result.failure().rows, result.failure().counts) == ((1,), (1,))


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_and_plus_infinity_are_refused_in_every_mode(mode: str, value: float) -> None:
    logprobs = np.array([-1.0, -2.0, value, value], dtype=np.float32)
    result = check_logprobs(logprobs, np.array([2, 0, 2], dtype=np.int64), mode, rows=[4, 5, 6])
    assert isinstance(result, Failure)
    assert (result.failure().rows, result.failure().counts) == ((6,), (2,))
    assert "rows [6]" in str(result.failure())


def test_a_finite_batch_passes_with_nothing_seen() -> None:
    logprobs = np.array([-3.4e38, 3.4e38, -0.0], dtype=np.float32)
    assert check_logprobs(logprobs, np.array([3]), "raw_logits") == Success(NonFiniteCounts())
    empty = np.empty(0, dtype=np.float32)
    assert check_logprobs(empty, np.empty(0, dtype=np.int64), "raw_logprobs") == Success(
        NonFiniteCounts()
    )


@pytest.mark.parametrize(
    ("logprobs", "lengths", "rows", "match"),
    [
        (np.zeros(3, np.float32), np.array([1, 1]), None, "3 logprobs for lengths summing to 2"),
        (np.zeros((1, 2), np.float32), np.array([2]), None, "1-D logprobs"),
        (np.zeros(1, np.float32), np.array([2, -1]), None, "non-negative 1-D lengths"),
        (np.zeros(2, np.float32), np.array([1, 1]), [0], "1 row names for 2 rows"),
    ],
)
def test_arrays_that_do_not_fit_are_a_programming_error(
    logprobs: np.ndarray, lengths: np.ndarray, rows: list[int] | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        check_logprobs(logprobs, lengths, "raw_logprobs", rows=rows)


def test_counts_read_as_the_counter_labels_them() -> None:
    counts = NonFiniteCounts(nan=2, posinf=1, neginf=3)
    assert counts.total == 6
    assert counts.by_kind() == {"nan": 2, "+inf": 1, "-inf": 3}
    assert str(counts) == "2 NaN, 1 +inf, 3 -inf"


# --- aborted rows ---


@given(st.lists(generations(non_finite=True), max_size=8))
def test_a_batch_passes_exactly_when_no_row_was_aborted(gens: list[Generation]) -> None:
    # Law: an aborted row is flagged, never truncated, and refused by name with its tokens.
    flat = flatten_generations(gens)
    aborted = [i for i, g in enumerate(gens) if g.finish_reason == "abort"]
    assert np.flatnonzero(flat.aborted).tolist() == aborted
    assert not (flat.aborted & flat.truncated).any()
    result = check_finished(flat)
    if not aborted:
        assert result == Success(flat)
        return
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, AbortedRows)
    assert list(error.rows) == aborted
    assert list(error.tokens) == [gens[i].num_tokens for i in aborted]
    assert f"rows {aborted}" in error.message


@given(st.lists(st.tuples(st.booleans(), generations()), max_size=8))
def test_aborted_rows_keep_their_batch_rows_when_placed(
    rows: list[tuple[bool, Generation]],
) -> None:
    kept = [i for i, (keep, _) in enumerate(rows) if keep]
    made = flatten_generations([rows[i][1] for i in kept])
    placed = place_rows(made, kept, len(rows))
    expected = [i for i in kept if rows[i][1].finish_reason == "abort"]
    result = check_finished(placed)
    named = check_finished(made, rows=kept)
    if expected:
        assert isinstance(result, Failure)
        assert isinstance(named, Failure)
        assert list(result.failure().rows) == expected
        assert named.failure() == result.failure()
    else:
        assert isinstance(result, Success)
        assert isinstance(named, Success)


@given(
    generations(non_finite=True),
    st.sampled_from(sorted(PROCESSED_LOGPROBS_MODES | {"raw_logprobs", "raw_logits"})),
    st.integers(0, 99),
)
def test_one_generation_is_checked_as_a_batch_of_that_one_row(
    g: Generation, mode: str, row: int
) -> None:
    got = check_generation_logprobs(g, mode, row=row)
    if g.logprobs is None:
        assert got == Success(NonFiniteCounts())
        return
    lengths = np.array([g.num_tokens], dtype=np.int64)
    assert got == check_logprobs(g.logprobs, lengths, mode, rows=(row,))


def test_nonfinite_seen_counts_refused_and_accepted_checks_alike() -> None:
    seen = NonFiniteCounts(nan=1, posinf=2, neginf=3)
    assert nonfinite_seen(Success(seen)) == seen
    refused = NonFiniteLogprobs("refused", rows=(0,), counts=(1,), seen=seen)
    assert nonfinite_seen(Failure(refused)) == seen


@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=5))
def test_check_context_refuses_exactly_the_rows_past_max_model_len(
    rows: list[tuple[int, int]],
) -> None:
    """A row holds its prompt and its generation (its expanded prompt when images
    expanded it); only rows holding more than max_model_len are named, with what they held."""
    width = max(p for p, _ in rows)
    ids = torch.tensor([[1] * p + [0] * (width - p) for p, _ in rows])
    lengths = torch.tensor([p for p, _ in rows])
    made = [Generation(tuple(range(2, 2 + g)), (0.0,) * g, "length") for _, g in rows]
    out = assemble_outputs(ids, lengths, made, 0)
    limit = 7
    for expanded in (None, [p + 3 for p, _ in rows]):
        prompts = expanded if expanded is not None else [p for p, _ in rows]
        held = [p + g for p, (_, g) in zip(prompts, rows, strict=True)]
        over = [row for row, h in enumerate(held) if h > limit]
        checked = check_context(out, limit, expanded)
        if not over:
            assert checked == Success(out)
            continue
        assert checked == Failure(
            PastContext(
                f"rows {over} came back longer than max_model_len={limit}: "
                f"context lengths {[held[r] for r in over]}",
                rows=tuple(over),
                lengths=tuple(held[r] for r in over),
            )
        )
