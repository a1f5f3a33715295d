"""Laws and documented cases of batch checking and prompt extraction."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given
from returns.result import Failure, Success
from strategies import (
    DtypeCase,
    PaddedBatch,
    WildBatch,
    dtype_cases,
    right_padded_batches,
    seed_values,
    st,
    wild_batches,
)

from genworker.core.assembly import Generation, assemble_outputs
from genworker.core.batch import (
    MAX_TOKEN_ID,
    SEED_LIMIT,
    BatchError,
    BatchErrorKind,
    BatchFieldError,
    CheckedBatch,
    batch_tensors,
    check_batch,
    check_seeds,
    extract_prompts,
    pad_rows,
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


@given(right_padded_batches())
def test_padded_rows_give_back_their_prompts_padded_to_the_longest(batch: PaddedBatch) -> None:
    if not batch.prompts:
        return
    padded = pad_rows(batch.prompts, batch.pad_token_id)
    ids, lengths = padded["input_ids"], padded["input_lengths"]
    assert extract_prompts(ids, lengths) == batch.prompts
    assert ids.shape == (len(batch.prompts), max(len(p) for p in batch.prompts))
    assert ids.dtype == lengths.dtype == torch.long
    for row, prompt in zip(ids.tolist(), batch.prompts, strict=True):
        assert row[len(prompt) :] == [batch.pad_token_id] * (len(row) - len(prompt))


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
def test_narrow_integer_dtypes_are_accepted_when_they_hold_the_vocabulary(
    dtype: torch.dtype,
) -> None:
    ids = torch.tensor([[1, 2, 0]], dtype=dtype)
    checked = check_batch(ids, torch.tensor([2], dtype=dtype), pad_token_id=0, vocab_size=3)
    assert checked.unwrap().prompts == ([1, 2],)


def _holds(dtype: torch.dtype, case: DtypeCase) -> bool:
    info = torch.iinfo(dtype)
    largest = MAX_TOKEN_ID if case.vocab_size is None else case.vocab_size - 1
    return info.min <= case.pad_token_id <= info.max and largest <= info.max


@given(dtype_cases())
def test_a_dtype_is_refused_exactly_when_it_cannot_hold_the_outputs_and_never_wraps(
    case: DtypeCase,
) -> None:
    """Law: check_batch accepts a dtype iff it holds the pad id and every id the engine can
    generate; accepted, the assembled output_ids (in that dtype) hold the generated ids
    exactly, and the pad id exactly."""
    dtype = case.input_ids.dtype
    result = check_batch(
        case.input_ids,
        case.input_lengths,
        pad_token_id=case.pad_token_id,
        vocab_size=case.vocab_size,
    )
    if not _holds(dtype, case):
        assert isinstance(result, Failure)
        error = result.failure()
        assert error.kind is BatchErrorKind.INPUT_IDS
        assert str(error).startswith(f"input_ids dtype {dtype} cannot hold")
        return
    assert isinstance(result, Success)
    generations = [
        Generation(np.asarray(g, dtype=np.int64), None, "length") for g in case.generated
    ]
    out = assemble_outputs(case.input_ids, case.input_lengths, generations, case.pad_token_id)
    assert out.output_ids.dtype == dtype
    wide = out.output_ids.to(torch.int64)
    for i, (n, g) in enumerate(zip(case.input_lengths.tolist(), case.generated, strict=True)):
        assert wide[i, n : n + len(g)].tolist() == g
        assert (wide[i, n + len(g) :] == case.pad_token_id).all()


def test_int8_cannot_carry_a_512_token_vocabulary() -> None:
    error = check_batch(
        torch.tensor([[5, 6, 2]], dtype=torch.int8),
        torch.tensor([2]),
        pad_token_id=2,
        vocab_size=512,
    ).failure()
    assert str(error) == (
        "input_ids dtype torch.int8 cannot hold the output ids (output_ids keeps the input "
        "dtype): torch.int8 holds [-128, 127], not the largest token id (vocab_size - 1) "
        "511; send int32 or int64"
    )


def test_without_a_vocabulary_the_dtype_must_hold_every_id_vllm_emits() -> None:
    ids = torch.tensor([[5, 6]], dtype=torch.int16)
    error = check_batch(ids, torch.tensor([2]), pad_token_id=0).failure()
    assert "not the largest id vLLM emits 2147483647" in str(error)
    assert check_batch(ids.to(torch.int32), torch.tensor([2]), pad_token_id=0).unwrap()


def test_a_pad_id_the_dtype_cannot_hold_is_refused() -> None:
    ids = torch.tensor([[5, 6]], dtype=torch.uint8)
    error = check_batch(ids, torch.tensor([2]), pad_token_id=-1, vocab_size=8).failure()
    assert "torch.uint8 holds [0, 255], not the pad id -1" in str(error)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_wide_unsigned_dtypes_are_refused_naming_the_dtypes_taken(dtype: torch.dtype) -> None:
    error = check_batch(torch.ones(1, 2, dtype=dtype), torch.tensor([2]), pad_token_id=0).failure()
    assert error.kind is BatchErrorKind.INPUT_IDS
    assert "(int8 to int64, or uint8)" in str(error)
    assert f"dtype {dtype}" in str(error)


def _masked(t: torch.Tensor) -> torch.Tensor:
    from torch.masked import masked_tensor

    return masked_tensor(t, torch.ones_like(t, dtype=torch.bool))


def _fake(t: torch.Tensor) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode().from_tensor(t)


def _nested(t: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor(list(t), layout=torch.jagged)


_EXOTIC: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "meta": (lambda t: t.to("meta"), "a meta tensor (it holds no data)"),
    "sparse_coo": (lambda t: t.to_sparse(), "a torch.sparse_coo tensor (not dense)"),
    "sparse_csr": (lambda t: t.to_sparse_csr(), "a torch.sparse_csr tensor (not dense)"),
    "nested": (_nested, "a nested tensor"),
    "fake": (_fake, "a FakeTensor (a tensor subclass that dispatches its own ops)"),
    "masked": (_masked, "a MaskedTensor (a tensor subclass that dispatches its own ops)"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    ("subject", "exotic"),
    [("input_ids", name) for name in sorted(_EXOTIC)]
    # 1-D: CSR and nested tensors need two dimensions
    + [("input_lengths", name) for name in ("fake", "masked", "meta", "sparse_coo")],
)
def test_exotic_tensors_are_refused_naming_the_input(subject: str, exotic: str) -> None:
    make, named = _EXOTIC[exotic]
    ids, lengths = torch.tensor([[5, 6, 0], [7, 0, 0]]), torch.tensor([2, 1])
    args = (make(ids), lengths) if subject == "input_ids" else (ids, make(lengths))
    error = check_batch(*args, pad_token_id=0, vocab_size=8).failure()
    kind = BatchErrorKind.INPUT_IDS if subject == "input_ids" else BatchErrorKind.INPUT_LENGTHS
    assert error.kind is kind
    assert str(error).startswith(f"{subject} must be a dense tensor holding data; got {named}")


def test_a_strided_view_is_a_plain_tensor() -> None:
    wide = torch.tensor([[5, 9, 6, 9, 0, 9], [7, 9, 0, 9, 0, 9]])
    checked = check_batch(wide[:, ::2], torch.tensor([2, 1]), pad_token_id=0, vocab_size=16)
    assert checked.unwrap().prompts == ([5, 6], [7])


# -- seeds ---------------------------------------------------------------------------------
@given(st.lists(seed_values, max_size=6))
def test_seeds_are_refused_exactly_outside_the_generator_range_naming_every_row(
    seeds: list[object],
) -> None:
    result = check_seeds(seeds, len(seeds))
    bad = tuple(
        i
        for i, v in enumerate(seeds)
        if v is not None and not (type(v) is int and 0 <= v < SEED_LIMIT)
    )
    if not bad:
        assert result == Success(tuple(seeds))
        return
    assert isinstance(result, Failure)
    error = result.failure()
    assert (error.kind, error.rows) == (BatchErrorKind.SEEDS, bad)
    assert str(error).startswith("data['seeds'] must be ints in [0, 2**63)")
    for i in bad:
        assert f"row {i} (seed {seeds[i]!r})" in str(error)


def test_no_seeds_leave_every_row_unseeded() -> None:
    assert check_seeds(None, 3) == Success((None, None, None))


@pytest.mark.parametrize(
    "tensor",
    [torch.tensor([1, 2**63 - 1]), torch.tensor([0, 2**62], dtype=torch.uint64)],
)
def test_a_seed_tensor_gives_its_ints(tensor: torch.Tensor) -> None:
    assert check_seeds(tensor, 2) == Success(tuple(tensor.tolist()))


def test_a_uint64_seed_past_int64_is_refused_naming_its_row() -> None:
    result = check_seeds(torch.tensor([0, 2**64 - 1], dtype=torch.uint64), 2)
    assert isinstance(result, Failure)
    assert result.failure().rows == (1,)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (torch.tensor([[1, 2]]), "must be a 1-D integer tensor (batch,) (int or uint)"),
        (torch.tensor([1.0, 2.0]), "dtype torch.float32"),
        (torch.tensor([1, 2]).to("meta"), "a meta tensor"),
        (torch.tensor([1, 2]).to_sparse(), "not dense"),
        ([1, 2, 3], "one seed per row (2); got a list of 3"),
        ((1,), "one seed per row (2); got a tuple of 1"),
        ("12", "one seed per row (2); got a str"),
        ({0: 1, 1: 2}, "one seed per row (2); got a dict"),
    ],
)
def test_malformed_seeds_are_refused_naming_the_input(value: object, named: str) -> None:
    error = check_seeds(value, 2).failure()
    assert error.kind is BatchErrorKind.SEEDS
    assert str(error).startswith("data['seeds'] ")
    assert named in str(error)


def test_extract_prompts_refuses_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 entries for 1 rows"):
        extract_prompts(torch.tensor([[1, 2]]), torch.tensor([1, 1]))


def test_checked_batch_refuses_prompts_that_disagree_with_lengths() -> None:
    with pytest.raises(ValueError, match="1 prompts but 2 lengths"):
        CheckedBatch(prompts=([1],), lengths=(1, 1))
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        CheckedBatch(prompts=([1], [1, 2]), lengths=(1, 1))


def test_batch_tensors_are_the_two_tensors_or_the_key_that_is_wrong() -> None:
    ids, lengths = torch.tensor([[1, 2]]), torch.tensor([2])
    assert batch_tensors({"input_ids": ids, "input_lengths": lengths}) == Success((ids, lengths))
    assert batch_tensors([ids]) == Failure(BatchFieldError("data must be a mapping, got list"))
    assert batch_tensors({"input_ids": ids}) == Failure(
        BatchFieldError("data['input_lengths'] is missing", key="input_lengths")
    )
    assert batch_tensors({"input_ids": [[1, 2]], "input_lengths": lengths}) == Failure(
        BatchFieldError("data['input_ids'] must be a torch.Tensor, got list", key="input_ids")
    )
