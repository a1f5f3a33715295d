"""Laws of the per-request token caps (context cap, speculative-decoding clamp, batch form)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Result, Success
from strategies import (
    BatchCapCase,
    CapCase,
    batch_cap_cases,
    cap_cases,
    cap_large_scalars,
    cap_max_model_lens,
    cap_max_new_tokens,
    cap_spec_tokens,
)

from genworker.core.caps import (
    MAX_INPUT_LENGTH,
    MAX_SCALAR_ARGUMENT,
    CapArgumentError,
    CapError,
    CapFailure,
    RowCaps,
    batch_max_tokens,
    cap_rows,
    context_cap,
    request_max_tokens,
    reserved_tokens,
    spec_decode_cap,
)


def request(case: CapCase, **changes: int) -> Result[int, CapFailure]:
    args = {
        "max_new_tokens": case.max_new_tokens,
        "input_length": case.input_length,
        "max_model_len": case.max_model_len,
        "num_speculative_tokens": case.num_speculative_tokens,
    }
    args.update(changes)
    return request_max_tokens(
        args["max_new_tokens"],
        args["input_length"],
        args["max_model_len"],
        cap_to_context=case.cap_to_context,
        num_speculative_tokens=args["num_speculative_tokens"],
    )


def capping_applies(case: CapCase) -> bool:
    return case.cap_to_context or case.num_speculative_tokens > 0


def reserve_of(case: CapCase) -> int:
    k = case.num_speculative_tokens
    return k + 1 if k > 0 else 0


def batch(
    case: BatchCapCase, lengths: Sequence[int] | torch.Tensor
) -> Result[tuple[int, ...], CapFailure]:
    return batch_max_tokens(
        case.max_new_tokens,
        lengths,
        case.max_model_len,
        cap_to_context=case.cap_to_context,
        num_speculative_tokens=case.num_speculative_tokens,
    )


def scalar_rows(case: BatchCapCase) -> list[Result[int, CapFailure]]:
    return [
        request_max_tokens(
            case.max_new_tokens,
            length,
            case.max_model_len,
            cap_to_context=case.cap_to_context,
            num_speculative_tokens=case.num_speculative_tokens,
        )
        for length in case.input_lengths
    ]


LENGTH_CONTAINERS: list[Callable[[list[int]], Sequence[int] | torch.Tensor]] = [
    list,
    tuple,
    lambda xs: torch.tensor(xs, dtype=torch.int64),
    lambda xs: torch.tensor(xs, dtype=torch.int32),
]


# --- scalar laws ---


@given(cap_cases())
def test_never_above_the_configured_cap(case: CapCase) -> None:
    result = request(case)
    if isinstance(result, Success):
        assert 1 <= result.unwrap() <= case.max_new_tokens


@given(cap_cases())
def test_generation_fits_the_context_when_capping(case: CapCase) -> None:
    result = request(case)
    if capping_applies(case) and isinstance(result, Success):
        assert case.input_length + result.unwrap() + reserve_of(case) <= case.max_model_len


@given(cap_cases())
def test_refused_exactly_when_no_room_is_left(case: CapCase) -> None:
    result = request(case)
    no_room = case.input_length + reserve_of(case) >= case.max_model_len
    if capping_applies(case) and no_room:
        error = result.failure()
        assert isinstance(error, CapError)
        assert (error.rows, error.input_lengths, error.max_model_len, error.reserve) == (
            (0,),
            (case.input_length,),
            case.max_model_len,
            reserve_of(case),
        )
    else:
        assert isinstance(result, Success)


@given(cap_cases())
def test_cap_wastes_no_room(case: CapCase) -> None:
    """The result is either the configured cap or exactly the room left."""
    result = request(case)
    if capping_applies(case) and isinstance(result, Success):
        room = case.max_model_len - reserve_of(case) - case.input_length
        assert result.unwrap() in {case.max_new_tokens, room}


@given(cap_cases())
def test_unchanged_without_capping_or_spec_decode(case: CapCase) -> None:
    if not capping_applies(case):
        assert request(case) == Success(case.max_new_tokens)


@given(cap_cases())
def test_idempotent(case: CapCase) -> None:
    result = request(case)
    if isinstance(result, Success):
        assert request(case, max_new_tokens=result.unwrap()) == result


@given(cap_cases(), st.integers(0, 1 << 16), st.integers(0, 1 << 16))
def test_monotone_in_the_limits(case: CapCase, more_context: int, more_tokens: int) -> None:
    """Raising max_model_len or max_new_tokens never lowers the result nor adds a refusal."""
    before = request(case)
    after = request(
        case,
        max_model_len=case.max_model_len + more_context,
        max_new_tokens=case.max_new_tokens + more_tokens,
    )
    if isinstance(before, Success):
        assert isinstance(after, Success)
        assert after.unwrap() >= before.unwrap()


@given(cap_cases(), st.integers(0, 1 << 10), st.integers(0, 16))
def test_antitone_in_the_demand(case: CapCase, longer: int, more_spec: int) -> None:
    """A longer prompt or more speculative tokens never raises the result."""
    after = request(
        case,
        input_length=case.input_length + longer,
        num_speculative_tokens=case.num_speculative_tokens + more_spec,
    )
    before = request(case)
    if isinstance(after, Success):
        assert isinstance(before, Success)
        assert after.unwrap() <= before.unwrap()


@given(cap_cases())
def test_named_caps_are_the_request_rules(case: CapCase) -> None:
    k = case.num_speculative_tokens
    if k > 0:
        assert request(case) == spec_decode_cap(
            case.max_new_tokens, case.input_length, case.max_model_len, k
        )
    elif case.cap_to_context:
        assert request(case) == context_cap(
            case.max_new_tokens, case.input_length, case.max_model_len
        )


def test_context_cap_is_the_room_left() -> None:
    assert context_cap(512, 100, 4096) == Success(512)
    assert context_cap(512, 3800, 4096) == Success(296)
    assert context_cap(512, 4095, 4096) == Success(1)
    refused = context_cap(512, 4096, 4096).failure()
    assert isinstance(refused, CapError)
    assert (refused.rows, refused.input_lengths, refused.reserve) == ((0,), (4096,), 0)


def test_spec_decode_clamp_leaves_k_plus_one_slots() -> None:
    # k = 3: generation must end 4 slots before max_model_len.
    assert spec_decode_cap(512, 3800, 4096, 3) == Success(292)
    assert spec_decode_cap(512, 4091, 4096, 3) == Success(1)
    assert reserved_tokens(num_speculative_tokens=3) == 4
    assert reserved_tokens(num_speculative_tokens=0) == 0


@pytest.mark.parametrize("input_length", [4092, 4095, 4096, 5000])
def test_no_floor_of_one_past_the_context(input_length: int) -> None:
    """NeMo-RL floors the spec clamp at 1 token, stepping past the context end; we refuse."""
    result = request_max_tokens(
        512, input_length, 4096, cap_to_context=False, num_speculative_tokens=3
    )
    error = result.failure()
    assert isinstance(error, CapError)
    assert error.reserve == 4
    assert (
        str(error)
        == error.message
        == (
            f"row 0 (input length {input_length}) leaves no room to generate; input length must "
            "be below 4092 (max_model_len 4096 minus 4 slots reserved for speculative decoding "
            "(k + 1))"
        )
    )


def test_spec_clamp_applies_without_context_capping() -> None:
    assert request_max_tokens(
        512, 3800, 4096, cap_to_context=False, num_speculative_tokens=3
    ) == Success(292)
    assert request_max_tokens(
        512, 3800, 4096, cap_to_context=True, num_speculative_tokens=3
    ) == Success(292)


def test_without_capping_a_too_long_prompt_is_left_to_vllm() -> None:
    assert request_max_tokens(
        512, 9000, 4096, cap_to_context=False, num_speculative_tokens=0
    ) == Success(512)


def test_a_huge_configured_cap_is_clamped_to_the_room() -> None:
    assert request_max_tokens(
        2**80, 96, 4096, cap_to_context=True, num_speculative_tokens=0
    ) == Success(4000)
    assert batch_max_tokens(
        2**80, [96, 0], 4096, cap_to_context=True, num_speculative_tokens=0
    ) == Success((4000, 4096))


# --- bad arguments ---

BAD_SCALARS = [
    pytest.param({"max_new_tokens": 0}, "max_new_tokens", id="max_new_tokens=0"),
    pytest.param({"max_new_tokens": -5}, "max_new_tokens", id="max_new_tokens<0"),
    pytest.param({"max_model_len": 0}, "max_model_len", id="max_model_len=0"),
    pytest.param({"max_model_len": -1}, "max_model_len", id="max_model_len<0"),
    pytest.param(
        {"max_model_len": MAX_SCALAR_ARGUMENT + 1}, "max_model_len", id="max_model_len-huge"
    ),
    pytest.param({"k": -1}, "num_speculative_tokens", id="k<0"),
    pytest.param({"k": MAX_SCALAR_ARGUMENT + 1}, "num_speculative_tokens", id="k-huge"),
]


@pytest.mark.parametrize(("changes", "argument"), BAD_SCALARS)
@pytest.mark.parametrize("cap_to_context", [False, True])
def test_bad_scalar_arguments_are_refused_everywhere(
    changes: dict[str, int], argument: str, cap_to_context: bool
) -> None:
    m = changes.get("max_new_tokens", 64)
    mml = changes.get("max_model_len", 4096)
    k = changes.get("k", 0)
    value = changes.get("max_new_tokens", changes.get("max_model_len", k))
    results: list[Result[object, CapFailure]] = [
        request_max_tokens(m, 10, mml, cap_to_context=cap_to_context, num_speculative_tokens=k),
        batch_max_tokens(m, [10, 20], mml, cap_to_context=cap_to_context, num_speculative_tokens=k),
        spec_decode_cap(m, 10, mml, k),
    ]
    if "k" not in changes:
        results.append(context_cap(m, 10, mml))
    for result in results:
        error = result.failure()
        assert isinstance(error, CapArgumentError)
        assert (error.argument, error.values, error.rows) == (argument, (value,), ())
        assert argument in str(error)
        assert str(value) in str(error)


@pytest.mark.parametrize("cap_to_context", [False, True])
@pytest.mark.parametrize("k", [0, 2])
def test_negative_length_is_refused(cap_to_context: bool, k: int) -> None:
    for result in (
        request_max_tokens(64, -3, 4096, cap_to_context=cap_to_context, num_speculative_tokens=k),
        context_cap(64, -3, 4096),
        spec_decode_cap(64, -3, 4096, k),
    ):
        error = result.failure()
        assert isinstance(error, CapArgumentError)
        assert (error.argument, error.values, error.rows) == ("input_lengths", (-3,), (0,))
        assert "-3" in str(error)


# --- batch laws ---


@given(batch_cap_cases(), st.sampled_from(LENGTH_CONTAINERS))
def test_batch_is_the_scalar_row_by_row(
    case: BatchCapCase, container: Callable[[list[int]], Sequence[int] | torch.Tensor]
) -> None:
    got = batch(case, container(case.input_lengths))
    rows = scalar_rows(case)
    rejected = [i for i, r in enumerate(rows) if isinstance(r, Failure)]
    if rejected:
        error = got.failure()
        assert isinstance(error, CapError)
        assert error.rows == tuple(rejected)
        assert error.input_lengths == tuple(case.input_lengths[i] for i in rejected)
        assert error.max_model_len == case.max_model_len
        assert {error.reserve} == {r.failure().reserve for r in rows if isinstance(r, Failure)}
    else:
        assert got == Success(tuple(r.unwrap() for r in rows))


@given(batch_cap_cases(), st.sampled_from(LENGTH_CONTAINERS))
def test_rows_without_room_are_refused_alone_and_the_rest_keep_their_caps(
    case: BatchCapCase, container: Callable[[list[int]], Sequence[int] | torch.Tensor]
) -> None:
    got = cap_rows(
        case.max_new_tokens,
        container(case.input_lengths),
        case.max_model_len,
        cap_to_context=case.cap_to_context,
        num_speculative_tokens=case.num_speculative_tokens,
    )
    assert isinstance(got, Success)
    caps = got.unwrap()
    rows = scalar_rows(case)
    refused = tuple(i for i, r in enumerate(rows) if isinstance(r, Failure))
    assert caps.refused_rows == refused
    assert caps.max_tokens == tuple(0 if isinstance(r, Failure) else r.unwrap() for r in rows)
    whole = batch(case, case.input_lengths)
    if refused:
        assert caps.refused == whole.failure()
    else:
        assert caps == RowCaps(whole.unwrap())


def test_cap_rows_still_refuses_bad_arguments() -> None:
    result = cap_rows(8, [3, -1], 16, cap_to_context=True, num_speculative_tokens=0)
    assert isinstance(result, Failure)
    assert result.failure().argument == "input_lengths"
    every = cap_rows(8, [16, 20], 16, cap_to_context=True, num_speculative_tokens=0)
    assert isinstance(every, Success)
    assert every.unwrap().max_tokens == (0, 0)
    assert every.unwrap().refused_rows == (0, 1)


@given(batch_cap_cases(max_size=40))
def test_batch_error_sentence_names_every_offending_row(case: BatchCapCase) -> None:
    result = batch(case, case.input_lengths)
    if isinstance(result, Failure):
        error = result.failure()
        assert isinstance(error, CapError)
        assert str(error) == error.message
        for row, length in zip(error.rows, error.input_lengths, strict=True):
            assert f"{row} (input length {length})" in str(error)


@given(
    batch_cap_cases(),
    st.lists(st.tuples(st.integers(0, 11), st.integers(-(1 << 20), -1)), min_size=1),
)
def test_batch_names_every_negative_length(
    case: BatchCapCase, negatives: list[tuple[int, int]]
) -> None:
    lengths = list(case.input_lengths) or [0]
    for row, value in negatives:
        lengths[row % len(lengths)] = value
    error = batch(case, torch.tensor(lengths)).failure()
    assert isinstance(error, CapArgumentError)
    expected_rows = tuple(i for i, n in enumerate(lengths) if n < 0)
    assert error.argument == "input_lengths"
    assert error.rows == expected_rows
    assert error.values == tuple(lengths[i] for i in expected_rows)
    # ...and these are exactly the rows the scalar refuses as bad arguments.
    scalar = [
        request_max_tokens(
            case.max_new_tokens,
            n,
            case.max_model_len,
            cap_to_context=case.cap_to_context,
            num_speculative_tokens=case.num_speculative_tokens,
        )
        for n in lengths
    ]
    assert expected_rows == tuple(
        i
        for i, r in enumerate(scalar)
        if isinstance(r, Failure) and isinstance(r.failure(), CapArgumentError)
    )


@given(cap_max_new_tokens, cap_max_model_lens, st.booleans(), cap_spec_tokens)
def test_empty_batch(m: int, mml: int, cap: bool, k: int) -> None:
    empties: list[Sequence[int] | torch.Tensor] = [[], (), torch.zeros(0, dtype=torch.int64)]
    for lengths in empties:
        assert batch_max_tokens(
            m, lengths, mml, cap_to_context=cap, num_speculative_tokens=k
        ) == Success(())


@given(cap_max_new_tokens, cap_large_scalars, cap_spec_tokens, st.booleans())
def test_batch_arithmetic_does_not_overflow(m: int, mml: int, k: int, cap: bool) -> None:
    """The extreme lengths and the largest accepted max_model_len agree with the scalar."""
    last = max(mml - reserved_tokens(num_speculative_tokens=k) - 1, 0)
    for lengths in ([MAX_INPUT_LENGTH, 2**62, 0, last], [0, last]):
        case = BatchCapCase(m, lengths, mml, cap, k)
        rows = scalar_rows(case)
        refused = tuple(i for i, r in enumerate(rows) if isinstance(r, Failure))
        got = batch(case, torch.tensor(lengths))
        if refused:
            error = got.failure()
            assert isinstance(error, CapError)
            assert error.rows == refused
        else:
            assert got == Success(tuple(r.unwrap() for r in rows))


@pytest.mark.parametrize(
    ("lengths", "rows"),
    [([2**63 + 5], (0,)), ([2**64 - 1], (0,)), ([0, 2**63], ())],
)
def test_lengths_beyond_int64_are_refused(lengths: list[int], rows: tuple[int, ...]) -> None:
    for cap in (False, True):
        error = batch_max_tokens(
            64, lengths, 4096, cap_to_context=cap, num_speculative_tokens=0
        ).failure()
        assert isinstance(error, CapArgumentError)
        assert (error.argument, error.rows) == ("input_lengths", rows)
        assert error.values == tuple(lengths[i] for i in rows)
    scalar = request_max_tokens(64, 2**63, 4096, cap_to_context=False, num_speculative_tokens=0)
    assert isinstance(scalar.failure(), CapArgumentError)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_batch_accepts_narrow_integer_dtypes(dtype: torch.dtype) -> None:
    lengths = torch.tensor([0, 100, 126], dtype=dtype)
    assert batch_max_tokens(
        64, lengths, 128, cap_to_context=True, num_speculative_tokens=0
    ) == Success((64, 28, 2))
    assert batch_max_tokens(
        64, lengths, 1 << 40, cap_to_context=True, num_speculative_tokens=0
    ) == Success((64, 64, 64))


def test_batch_accepts_numpy_integers_in_a_list() -> None:
    lengths = list(np.array([0, 100, 126], dtype=np.uint8))
    assert batch_max_tokens(
        64, lengths, 128, cap_to_context=True, num_speculative_tokens=0
    ) == Success((64, 28, 2))


BAD_CONTAINERS = [
    pytest.param(torch.tensor([1.0, 2.0]), id="float-tensor"),
    pytest.param(torch.tensor([True, False]), id="bool-tensor"),
    pytest.param(torch.tensor([[1, 2]]), id="2d-tensor"),
    pytest.param(torch.tensor(3), id="0d-tensor"),
    pytest.param(torch.tensor([1 + 2j]), id="complex-tensor"),
    pytest.param([1.5, 2.0], id="float-list"),
    pytest.param([True, False], id="bool-list"),
    pytest.param([[1, 2], [3, 4]], id="nested-list"),
    pytest.param([1, "2"], id="mixed-list"),
    pytest.param([2**70], id="beyond-uint64"),
    pytest.param([2**63, -1], id="mixed-beyond-int64"),
    pytest.param("12", id="str"),
    pytest.param(b"12", id="bytes"),
]


@pytest.mark.parametrize("lengths", BAD_CONTAINERS)
def test_batch_refuses_lengths_that_are_not_a_row_of_ints(lengths: object) -> None:
    result = batch_max_tokens(
        64,
        lengths,  # type: ignore[arg-type]
        4096,
        cap_to_context=True,
        num_speculative_tokens=0,
    )
    error = result.failure()
    assert isinstance(error, CapArgumentError)
    assert error.argument == "input_lengths"
    assert "input_lengths" in str(error)


def test_batch_error_sentence() -> None:
    error = batch_max_tokens(
        64, [10, 4094, 3, 5000], 4096, cap_to_context=False, num_speculative_tokens=1
    ).failure()
    assert str(error) == (
        "2 rows leave no room to generate: rows 1 (input length 4094), 3 (input length 5000); "
        "input length must be below 4094 (max_model_len 4096 minus 2 slots reserved for "
        "speculative decoding (k + 1))"
    )
