"""Converting vLLM's request outputs into flat generations (no engine needed).

The typings stub only the attributes genworker reads; the constructors here come from
the installed vLLM, reached untyped."""

from __future__ import annotations

import gc
import math
import weakref
from array import array
from typing import Any

import numpy as np
import pytest
import vllm.logprobs
import vllm.outputs
from hypothesis import given
from hypothesis import strategies as st

from genworker.core import completions
from genworker.core.assembly import flatten_generations
from genworker.shell.errors import EngineContractError
from genworker.shell.sampled_logprobs import SampledLogprobs
from genworker.shell.vllm_engine import _generations, generation_of

_vllm_logprobs: Any = vllm.logprobs
_vllm_outputs: Any = vllm.outputs


def _completion(
    tokens: list[int],
    logprobs: list[float],
    *,
    extra: bool = False,
    flat: bool = True,
    sampled: bool = False,
    id_array: bool = False,
    finish_reason: str | None = "length",
) -> Any:
    """A completion as vLLM builds it: flat logprobs, or (``flat=False``) per-position
    dicts; ``extra`` adds a top-1 alternative at position 0; ``sampled``: the arrays the
    worker's own requests keep (``genworker.shell.sampled_logprobs``), ``id_array``: their
    token ids in an int64 array too."""
    positions = []
    logprob = _vllm_logprobs.Logprob
    for i, (token, value) in enumerate(zip(tokens, logprobs, strict=True)):
        entry = {token: logprob(logprob=value, rank=1, decoded_token=None)}
        if extra and i == 0:  # a top-1 alternative: two entries at this position
            entry[token + 1] = logprob(logprob=value - 1.0, rank=2, decoded_token=None)
        positions.append(entry)
    container: Any = positions
    if sampled:
        container = SampledLogprobs()
        container.token_ids.extend(tokens)
        container.logprobs.extend(logprobs)
    elif flat:
        container = _vllm_logprobs.FlatLogprobs()
        container.extend(positions)
    return _vllm_outputs.CompletionOutput(
        index=0,
        text="",
        token_ids=array("q", tokens) if id_array else tokens,
        cumulative_logprob=None,
        logprobs=container,
        finish_reason=finish_reason,
    )


_REASONS = ("stop", "length", "abort", "repetition")
# vLLM's sampled logprobs: finite, or NaN / +inf (garbage logits) / -inf (a masked token).
_logprob = st.floats(-20.0, 0.0, width=32) | st.sampled_from([math.nan, math.inf, -math.inf])
_rows = st.lists(
    st.lists(st.tuples(st.integers(0, 1000), _logprob), min_size=0, max_size=6),
    min_size=1,
    max_size=5,
)


_LAYOUTS = ("flat", "dicts", "sampled", "arrays")


@given(
    _rows,
    st.lists(st.tuples(st.booleans(), st.sampled_from(_LAYOUTS), st.sampled_from(_REASONS))),
    st.booleans(),
)
def test_bulk_conversion_equals_the_row_by_row_one(
    rows: list[list[tuple[int, float]]], kinds: list[tuple[bool, str, str]], consume: bool
) -> None:
    """Whatever mix of layouts (flat or dicts, with or without a top-1 alternative, or the
    sampled arrays, with the token ids in an array or a list) and finish reasons, the
    one-pass conversion gives what the row-by-row one does; with ``consume``, every row
    before the first that goes row by row is dropped from the list and the others are left
    as they were."""
    outs = []
    for i, row in enumerate(rows):
        extra, layout, reason = kinds[i] if i < len(kinds) else (False, "flat", "length")
        outs.append(
            _completion(
                [t for t, _ in row],
                [v for _, v in row],
                extra=extra and bool(row),
                flat=layout == "flat",
                sampled=layout in ("sampled", "arrays"),
                id_array=layout == "arrays",
                finish_reason=reason,
            )
        )
    expected = flatten_generations([generation_of(i, o) for i, o in enumerate(outs)])
    given_outs = list(outs)
    slow = [
        i
        for i, o in enumerate(outs)
        if not isinstance(o.logprobs, SampledLogprobs)
        and (
            not isinstance(o.logprobs, _vllm_logprobs.FlatLogprobs)
            or len(o.logprobs.token_ids) != len(o.token_ids)
        )
    ]
    first_slow = min(slow, default=len(outs))
    bulk = _generations(outs, consume=consume)
    assert bulk == expected  # NaN equal to NaN, -inf and +inf kept
    kept = given_outs[first_slow:]
    assert outs == ([None] * first_slow + kept if consume else given_outs)
    # What vLLM said of each row survives: aborted rows flagged (never truncated), every
    # non-finite logprob where it was, for the worker's checks to see.
    reasons = [o.finish_reason for o in given_outs]
    assert bulk.aborted.tolist() == [r == "abort" for r in reasons]
    assert bulk.truncated.tolist() == [r == "length" for r in reasons]
    values = [v for row in rows for _, v in row]
    assert np.isnan(bulk.logprobs).tolist() == [math.isnan(v) for v in values]
    assert np.isposinf(bulk.logprobs).tolist() == [v == math.inf for v in values]
    assert np.isneginf(bulk.logprobs).tolist() == [v == -math.inf for v in values]


def test_consumed_rows_are_freed_once_read() -> None:
    outs = [_completion([5, 6], [-1.0, -2.0]), _completion([7], [-0.5])]
    refs = [weakref.ref(o) for o in outs]
    gc.disable()  # freed by reference counting, as each row is read
    try:
        flat = _generations(outs, consume=True)
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()
    assert outs == [None, None]
    assert flat.token_ids.tolist() == [5, 6, 7]
    assert flat.logprobs.tolist() == [-1.0, -2.0, -0.5]


def test_rows_after_a_row_by_row_one_keep_their_place() -> None:
    outs = [
        _completion([5, 6], [-1.0, -2.0]),
        _completion([7], [-0.5], flat=False),
        _completion([8, 9, 10], [-0.25, -0.75, -1.25], finish_reason="stop"),
    ]
    flat = _generations(outs, consume=True)
    assert outs[0] is None
    assert outs[1] is not None
    assert outs[2] is not None
    assert flat.token_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert flat.logprobs.tolist() == [-1.0, -2.0, -0.5, -0.25, -0.75, -1.25]
    assert flat.lengths.tolist() == [2, 1, 3]
    assert flat.truncated.tolist() == [True, True, False]


def test_a_packed_row_that_did_not_finish_is_named_before_the_row_by_row_rest() -> None:
    outs = [_completion([6], [-1.0], finish_reason=None), _completion([5], [-1.0], flat=False)]
    with pytest.raises(EngineContractError, match=r"rows \[0\] did not finish"):
        _generations(outs)


@pytest.mark.parametrize("layouts", [("flat", "flat", "flat"), ("flat", "dicts", "sampled")])
@pytest.mark.parametrize("reason", ["error", None, "preempted"])
def test_every_row_with_a_finish_reason_vllm_does_not_finish_with_is_a_contract_error(
    layouts: tuple[str, str, str], reason: str | None
) -> None:
    """vLLM 0.32's reasons are stop, length, abort, error and repetition; "error" (a
    request-level failure) and anything else is not a finished row: an engine contract
    error naming every such row, in the one-pass and the row-by-row conversion alike."""
    outs = [
        _completion(
            [5 + i],
            [-1.0],
            flat=layout == "flat",
            sampled=layout == "sampled",
            finish_reason=reason if i != 1 else "stop",
        )
        for i, layout in enumerate(layouts)
    ]
    with pytest.raises(EngineContractError, match=r"rows \[0, 2\] did not finish") as info:
        _generations(outs)
    assert repr(reason) in str(info.value)


def test_an_aborted_row_is_flagged_not_truncated_in_every_layout() -> None:
    outs = [
        _completion([5, 6], [-1.0, -2.0], finish_reason="abort"),
        _completion([7], [-0.5], flat=False, finish_reason="length"),
        _completion([8, 9], [-0.25, -0.75], sampled=True, finish_reason="abort"),
    ]
    flat = _generations(outs)
    assert flat.aborted.tolist() == [True, False, True]
    assert flat.truncated.tolist() == [False, True, False]
    assert flat.lengths.tolist() == [2, 1, 2]  # the tokens vLLM kept: the worker refuses them


_any_logprob = st.floats(max_value=0.0, allow_nan=False) | st.sampled_from(
    [-3.4028235677973366e38, -3.4028235677973366e38 * (1 + 2**-30), -1e300, -1e-45, -0.0]
)


@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 2**40), _any_logprob), max_size=6),
        min_size=1,
        max_size=5,
    )
)
def test_the_one_pass_conversion_is_bit_identical_for_any_double(
    rows: list[list[tuple[int, float]]],
) -> None:
    """vLLM's logprobs are Python doubles: the one-pass packing rounds each to float32
    exactly as numpy's cast in the row-by-row path does (bit for bit, -inf and values past
    float32's range included), and token ids past 32 bits are kept."""
    outs = [_completion([t for t, _ in row], [v for _, v in row]) for row in rows]
    bulk = _generations(outs)
    expected = flatten_generations([generation_of(i, o) for i, o in enumerate(outs)])
    assert bulk.logprobs.view(np.uint32).tolist() == expected.logprobs.view(np.uint32).tolist()
    assert bulk.token_ids.tolist() == expected.token_ids.tolist()
    assert bulk == expected


def test_token_ids_in_another_sequence_type_take_the_one_pass_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outs = [_completion([5, 6, 7], [-0.5, -1.5, -2.5]), _completion([8], [-3.0])]
    expected = _generations(outs)
    for out in outs:
        out.token_ids = tuple(out.token_ids)

    def row_by_row(row: int, out: object, flat_type: object) -> None:
        raise AssertionError(f"row {row} went row by row")

    monkeypatch.setattr(completions, "_generation", row_by_row)
    assert _generations(outs) == expected


def test_conversion_gives_truncation_and_flat_arrays() -> None:
    outs = [
        _completion([5, 6, 7], [-0.5, -1.5, -2.5]),
        _completion([8], [-3.0], finish_reason="stop"),
        _completion([9, 10], [-0.25, -0.75], finish_reason="repetition"),
    ]
    flat = _generations(outs)
    assert flat.token_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert flat.logprobs.tolist() == [-0.5, -1.5, -2.5, -3.0, -0.25, -0.75]
    assert flat.lengths.tolist() == [3, 1, 2]
    assert flat.truncated.tolist() == [True, False, False]


@pytest.mark.parametrize("flat", [True, False])
def test_conversion_names_a_row_that_did_not_finish(flat: bool) -> None:
    outs = [_completion([5], [-1.0], flat=flat), _completion([6], [-1.0], finish_reason=None)]
    with pytest.raises(EngineContractError, match=r"rows \[1\] did not finish"):
        _generations(outs)


def test_conversion_names_a_row_whose_logprobs_are_for_other_tokens() -> None:
    good = _completion([5, 6], [-1.0, -2.0])
    bad = _completion([7, 8], [-1.0, -2.0])
    bad.logprobs.token_ids[1] = 9
    with pytest.raises(EngineContractError, match="row 1"):
        _generations([good, bad])


@pytest.mark.parametrize(
    ("ids", "logprobs", "error"),
    [
        ([7, 9], [-1.0, -2.0], r"row 1's sampled logprobs \(2\) are for tokens \[7, 9\], not"),
        ([7], [-1.0], r"row 1's sampled logprobs \(1\) are for tokens \[7\], not"),
        (
            [7, 8, 9],
            [-1.0, -2.0, -3.0],
            r"row 1's sampled logprobs \(3\) are for tokens \[7, 8, 9\]",
        ),
        ([7, 8], [-1.0], r"row 1's sampled logprobs \(1\) are for tokens \[7, 8\]"),
    ],
    ids=["other-token", "fewer", "more", "fewer-logprobs"],
)
@pytest.mark.parametrize("id_array", [False, True], ids=["id-list", "id-array"])
def test_conversion_names_a_row_whose_sampled_arrays_do_not_fit(
    ids: list[int], logprobs: list[float], error: str, id_array: bool
) -> None:
    good = _completion([5, 6], [-1.0, -2.0], sampled=True, id_array=id_array)
    bad = _completion([7, 8], [-1.0, -2.0], sampled=True, id_array=id_array)
    bad.logprobs.token_ids = SampledLogprobs().token_ids
    bad.logprobs.token_ids.extend(ids)
    bad.logprobs.logprobs = SampledLogprobs().logprobs
    bad.logprobs.logprobs.extend(logprobs)
    with pytest.raises(EngineContractError, match=error):
        _generations([good, bad])


@given(_rows, st.booleans())
def test_a_batch_of_arrays_is_joined_in_one_pass(
    rows: list[list[tuple[int, float]]], consume: bool
) -> None:
    """Every row's token ids and sampled logprobs in arrays: the joined pass gives what
    the row-by-row one does, and with ``consume`` drops every row."""
    outs = [
        _completion([t for t, _ in row], [v for _, v in row], sampled=True, id_array=True)
        for row in rows
    ]
    expected = flatten_generations([generation_of(i, o) for i, o in enumerate(outs)])
    assert completions.joined_generations(outs).unwrap() == expected
    given_outs = list(outs)
    assert _generations(outs, consume=consume) == expected
    assert outs == ([None] * len(given_outs) if consume else given_outs)


def test_the_joined_pass_names_a_row_whose_ids_differ_inside_or_that_did_not_finish() -> None:
    good = _completion([5, 6, 7], [-1.0, -2.0, -3.0], sampled=True, id_array=True)
    bad = _completion([5, 9, 7], [-1.0, -2.0, -3.0], sampled=True, id_array=True)
    bad.logprobs.token_ids[1] = 6  # the same length, first and last id, one id apart
    with pytest.raises(EngineContractError, match=r"row 1's sampled logprobs \(3\) are for tokens"):
        _generations([good, bad])
    running = _completion([5], [-1.0], sampled=True, id_array=True, finish_reason=None)
    with pytest.raises(EngineContractError, match=r"rows \[1\] did not finish"):
        _generations([good, running])


def test_sampled_arrays_are_copied_out_of_the_completion() -> None:
    out = _completion([5, 6], [-1.0, -2.5], sampled=True)
    flat = _generations([out], consume=True)
    assert flat.token_ids.tolist() == [5, 6]
    assert flat.logprobs.tolist() == [-1.0, -2.5]
    row = generation_of(0, _completion([5, 6], [-1.0, -2.5], sampled=True))
    assert row.logprobs is not None
    assert row.logprobs.flags.owndata  # not a view of the container's array
    assert repr(SampledLogprobs()) == "SampledLogprobs(0 positions)"


def test_a_shifted_flat_layout_is_not_taken_for_one_entry_per_position() -> None:
    # Position 0 holds nothing and position 1 holds two entries whose ids happen to
    # spell the generated tokens: as many entries as tokens, yet not one per position.
    flat = _vllm_logprobs.FlatLogprobs()
    logprob = _vllm_logprobs.Logprob
    flat.append(None)
    flat.append(
        {
            5: logprob(logprob=-1.0, rank=1, decoded_token=None),
            6: logprob(logprob=-2.0, rank=2, decoded_token=None),
        }
    )
    out = _vllm_outputs.CompletionOutput(
        index=0,
        text="",
        token_ids=[5, 6],
        cumulative_logprob=None,
        logprobs=flat,
        finish_reason="length",
    )
    with pytest.raises(EngineContractError, match="row 0"):
        _generations([out])
