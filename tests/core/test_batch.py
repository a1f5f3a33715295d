"""Laws and documented cases of batch checking and prompt extraction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from returns.result import Failure, Success
from strategies import PaddedBatch, WildBatch, right_padded_batches, st, wild_batches

from genworker.core.batch import (
    BatchError,
    BatchErrorKind,
    CheckedBatch,
    check_batch,
    extract_prompts,
)

Verdict = tuple[BatchErrorKind, tuple[int, ...], tuple[tuple[int, int], ...]] | None


def reference_verdict(wild: WildBatch) -> Verdict:
    """The rules of ``genworker.core.batch``, one token at a time."""
    ids, lengths, width = wild.ids, wild.lengths, wild.width
    if not ids:
        return None
    bad = tuple(i for i, n in enumerate(lengths) if not 1 <= n <= width)
    if bad:
        return BatchErrorKind.LENGTH, bad, ()
    pad_cells: list[tuple[int, int]] = []
    for i, (row, n) in enumerate(zip(ids, lengths, strict=True)):
        for pos in range(n, width):
            if row[pos] != wild.pad_token_id:
                pad_cells.append((i, pos))
                break
    if pad_cells:
        return BatchErrorKind.PADDING, tuple(r for r, _ in pad_cells), tuple(pad_cells)
    token_cells = [
        (i, pos)
        for i, (row, n) in enumerate(zip(ids, lengths, strict=True))
        for pos in range(n)
        if row[pos] < 0 or (wild.vocab_size is not None and row[pos] >= wild.vocab_size)
    ]
    if token_cells:
        rows = tuple(sorted({r for r, _ in token_cells}))
        return BatchErrorKind.TOKEN_ID, rows, tuple(token_cells)
    if wild.max_model_len is not None:
        bad = tuple(i for i, n in enumerate(lengths) if n >= wild.max_model_len)
        if bad:
            return BatchErrorKind.MAX_MODEL_LEN, bad, ()
    return None


def _check_wild(wild: WildBatch) -> Success[CheckedBatch] | Failure[BatchError]:
    result = check_batch(
        torch.tensor(wild.ids, dtype=torch.int64).reshape(len(wild.ids), wild.width),
        torch.tensor(wild.lengths, dtype=torch.int64),
        pad_token_id=wild.pad_token_id,
        vocab_size=wild.vocab_size,
        max_model_len=wild.max_model_len,
    )
    assert isinstance(result, Success | Failure)
    return result


@given(right_padded_batches())
def test_valid_batches_give_back_their_prompts(batch: PaddedBatch) -> None:
    result = check_batch(
        batch.input_ids,
        batch.input_lengths,
        pad_token_id=batch.pad_token_id,
        vocab_size=batch.vocab_size,
        max_model_len=batch.input_ids.shape[1] + 1,
    )
    checked = result.unwrap()
    assert list(checked.prompts) == batch.prompts
    assert checked.lengths == tuple(len(p) for p in batch.prompts)
    assert checked.batch_size == len(batch.prompts)
    assert extract_prompts(batch.input_ids, batch.input_lengths) == batch.prompts


@given(wild_batches())
def test_check_fails_exactly_when_a_rule_is_broken_and_names_every_offender(
    wild: WildBatch,
) -> None:
    expected = reference_verdict(wild)
    result = _check_wild(wild)
    if expected is None:
        checked = result.unwrap()
        assert list(checked.prompts) == [
            row[:n] for row, n in zip(wild.ids, wild.lengths, strict=True)
        ]
        return
    assert isinstance(result, Failure)
    error = result.failure()
    kind, rows, cells = expected
    assert (error.kind, error.rows, error.cells) == (kind, rows, cells)
    for row in rows:
        assert f"row {row} " in str(error)
    for _row, pos in cells:
        assert f"position {pos}" in str(error)


@given(right_padded_batches(max_batch=4).filter(lambda b: b.input_ids.shape[0] > 0), st.data())
def test_stray_token_in_the_padding_is_reported_at_its_first_position(
    batch: PaddedBatch, data: st.DataObject
) -> None:
    batch_size, width = batch.input_ids.shape
    row = data.draw(st.integers(0, batch_size - 1))
    length = len(batch.prompts[row])
    if length == width:
        return
    pos = data.draw(st.integers(length, width - 1))
    ids = batch.input_ids.clone()
    ids[row, pos] = batch.pad_token_id + 1
    error = check_batch(ids, batch.input_lengths, pad_token_id=batch.pad_token_id).failure()
    assert error.kind is BatchErrorKind.PADDING
    assert error.cells == ((row, pos),)
    assert f"token {batch.pad_token_id + 1} at position {pos}" in str(error)


_IDS = torch.ones(1, 2, dtype=torch.long)
_K = BatchErrorKind


@pytest.mark.parametrize(
    ("input_ids", "input_lengths", "kind", "named"),
    [
        ([[1, 2]], torch.tensor([2]), _K.INPUT_IDS, "a list"),
        (torch.tensor([1, 2]), torch.tensor([2]), _K.INPUT_IDS, "shape (2,)"),
        (torch.ones(1, 2), torch.tensor([2]), _K.INPUT_IDS, "torch.float32"),
        (torch.ones(1, 2, dtype=torch.bool), torch.tensor([2]), _K.INPUT_IDS, "torch.bool"),
        (_IDS, (2,), _K.INPUT_LENGTHS, "a tuple"),
        (_IDS, torch.tensor([[2]]), _K.INPUT_LENGTHS, "shape (1, 1)"),
        (_IDS, torch.tensor([2.0]), _K.INPUT_LENGTHS, "torch.float32"),
        (_IDS, torch.tensor([True]), _K.INPUT_LENGTHS, "torch.bool"),
        (_IDS.repeat(2, 1), torch.tensor([2]), _K.BATCH_SIZE, "2 rows"),
    ],
)
def test_malformed_tensors_are_refused_naming_the_input(
    input_ids: object, input_lengths: object, kind: BatchErrorKind, named: str
) -> None:
    error = check_batch(input_ids, input_lengths, pad_token_id=0).failure()
    assert error.kind is kind
    subject = "input_lengths" if kind is BatchErrorKind.INPUT_LENGTHS else "input_ids"
    assert str(error).startswith(subject)
    assert named in str(error)
    assert error.rows == ()


@pytest.mark.parametrize("width", [0, 3])
def test_empty_batch_is_valid_whatever_its_width(width: int) -> None:
    checked = check_batch(
        torch.zeros((0, width), dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        pad_token_id=0,
        vocab_size=8,
        max_model_len=1,
    ).unwrap()
    assert checked == CheckedBatch(prompts=(), lengths=())


def test_zero_width_rows_are_refused_as_empty_prompts() -> None:
    error = check_batch(
        torch.zeros((2, 0), dtype=torch.long), torch.tensor([0, 0]), pad_token_id=0
    ).failure()
    assert error.kind is BatchErrorKind.LENGTH
    assert error.rows == (0, 1)
    assert "row 0 (length 0), row 1 (length 0)" in str(error)


def test_negative_and_too_long_lengths_are_all_named() -> None:
    ids = torch.tensor([[5, 0, 0], [5, 6, 0], [5, 6, 7]])
    error = check_batch(ids, torch.tensor([-1, 2, 4]), pad_token_id=0).failure()
    assert error.rows == (0, 2)
    assert str(error) == (
        "input_lengths has 2 rows outside [1, 3] (the padded width of input_ids): "
        "row 0 (length -1), row 2 (length 4)"
    )


def test_negative_ids_are_refused_without_a_vocabulary_but_large_ones_pass() -> None:
    ids = torch.tensor([[10_000, -4, 0]])
    error = check_batch(ids, torch.tensor([2]), pad_token_id=0).failure()
    assert error.kind is BatchErrorKind.TOKEN_ID
    assert str(error) == (
        "input_ids holds 1 token id negative inside the prompts: row 0 position 1 (id -4)"
    )
    assert check_batch(torch.tensor([[10_000, 4, 0]]), torch.tensor([2]), pad_token_id=0)


def test_a_pad_id_outside_the_vocabulary_is_fine_in_the_padding() -> None:
    ids = torch.tensor([[3, -1, -1], [3, 4, 5]])
    checked = check_batch(ids, torch.tensor([1, 3]), pad_token_id=-1, vocab_size=6).unwrap()
    assert checked.prompts == ([3], [3, 4, 5])


def test_a_row_that_fills_the_context_leaves_no_room_to_generate() -> None:
    ids = torch.tensor([[1, 2, 3], [1, 2, 0]])
    lengths = torch.tensor([3, 2])
    error = check_batch(ids, lengths, pad_token_id=0, max_model_len=3).failure()
    assert error.kind is BatchErrorKind.MAX_MODEL_LEN
    assert error.rows == (0,)
    assert "max_model_len 3 in 1 row: row 0 (length 3)" in str(error)
    assert check_batch(ids, lengths, pad_token_id=0, max_model_len=4).unwrap().lengths == (3, 2)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_narrow_integer_dtypes_are_accepted(dtype: torch.dtype) -> None:
    ids = torch.tensor([[1, 2, 0]], dtype=dtype)
    checked = check_batch(ids, torch.tensor([2], dtype=dtype), pad_token_id=0, vocab_size=3)
    assert checked.unwrap().prompts == ([1, 2],)


def test_extract_prompts_refuses_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 entries for 1 rows"):
        extract_prompts(torch.tensor([[1, 2]]), torch.tensor([1, 1]))


def test_checked_batch_refuses_prompts_that_disagree_with_lengths() -> None:
    with pytest.raises(ValueError, match="1 prompts but 2 lengths"):
        CheckedBatch(prompts=([1],), lengths=(1, 1))
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        CheckedBatch(prompts=([1], [1, 2]), lengths=(1, 1))
