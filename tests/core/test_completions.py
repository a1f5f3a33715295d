"""Laws of reading vLLM's completions without vLLM: every layout (flat logprobs, per-position
mappings, the sampled arrays, token ids in a list, another sequence or an array) gives the
row-by-row answer in the one pass, finish reasons map as vLLM's, and every contract break
names its row. (``tests/shell/test_vllm_conversion.py`` runs the same on vLLM's own types.)"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core import completions as c
from genworker.core.assembly import FlatGenerations, flatten_generations


@attrs.define
class _Logprob:
    logprob: float


@attrs.define
class _Flat:
    """vLLM's ``FlatLogprobs``: position p owns ``[start_indices[p], end_indices[p])``."""

    start_indices: list[int] = attrs.Factory(list)
    end_indices: list[int] = attrs.Factory(list)
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)

    def append(self, entries: dict[int, _Logprob]) -> None:
        self.start_indices.append(len(self.token_ids))
        self.token_ids.extend(entries)
        self.logprobs.extend(e.logprob for e in entries.values())
        self.end_indices.append(len(self.token_ids))


@attrs.define
class _Out:
    token_ids: Sequence[int]
    logprobs: object
    finish_reason: str | None = "length"


def _out(
    tokens: list[int],
    logprobs: list[float],
    layout: str = "flat",
    *,
    extra: bool = False,
    finish_reason: str | None = "length",
) -> _Out:
    """A completion in ``layout``: flat, dicts, sampled (ids in a list), arrays (ids in an
    int64 array too) or tuple (flat, ids in a tuple); ``extra``: a second entry at 0."""
    positions = []
    for i, (token, value) in enumerate(zip(tokens, logprobs, strict=True)):
        entry = {token: _Logprob(value)}
        if extra and i == 0:
            entry[token + 1] = _Logprob(value - 1.0)
        positions.append(entry)
    container: object = positions
    if layout in ("sampled", "arrays"):
        sampled = c.SampledLogprobs()
        sampled.token_ids.extend(tokens)
        sampled.logprobs.extend(logprobs)
        container = sampled
    elif layout in ("flat", "tuple"):
        flat = _Flat()
        for entry in positions:
            flat.append(entry)
        container = flat
    ids: Sequence[int] = tokens
    if layout == "arrays":
        ids = array("q", tokens)
    elif layout == "tuple":
        ids = tuple(tokens)
    return _Out(ids, container, finish_reason)


Rows = list[c.Completion | None]
_REASONS = ("stop", "length", "abort", "repetition")
_LAYOUTS = ("flat", "dicts", "sampled", "arrays", "tuple")
_logprob = st.floats(-20.0, 0.0, width=32) | st.sampled_from([math.nan, math.inf, -math.inf])
_rows = st.lists(
    st.lists(st.tuples(st.integers(0, 1000), _logprob), max_size=6), min_size=1, max_size=5
)


def _row_by_row(outs: Rows) -> FlatGenerations:
    rows = []
    for i, out in enumerate(outs):
        assert out is not None
        row = c.generation_of(i, out, _Flat)
        assert isinstance(row, Success)
        rows.append(row.unwrap())
    return flatten_generations(rows)


def _refusal(outs: Rows, call: str = "generate") -> str:
    result = c.flat_generations(outs, _Flat, call=call)
    assert isinstance(result, Failure)
    return str(result.failure())


@given(
    _rows,
    st.lists(st.tuples(st.booleans(), st.sampled_from(_LAYOUTS), st.sampled_from(_REASONS))),
    st.booleans(),
)
def test_the_one_pass_equals_the_row_by_row_reading(
    rows: list[list[tuple[int, float]]], kinds: list[tuple[bool, str, str]], consume: bool
) -> None:
    """Whatever mix of layouts and finish reasons: the row-by-row answer, every flag as
    vLLM said, and with ``consume`` every row before the first read row by row dropped."""
    outs: Rows = []
    for i, row in enumerate(rows):
        extra, layout, reason = kinds[i] if i < len(kinds) else (False, "flat", "length")
        tokens, values = [t for t, _ in row], [v for _, v in row]
        outs.append(_out(tokens, values, layout, extra=extra and bool(row), finish_reason=reason))
    expected = _row_by_row(outs)
    given_outs = list(outs)
    slow = [
        i
        for i, o in enumerate(given_outs)
        if isinstance(o, _Out)
        and not isinstance(o.logprobs, c.SampledLogprobs)
        and (not isinstance(o.logprobs, _Flat) or len(o.logprobs.token_ids) != len(o.token_ids))
    ]
    first_slow = min(slow, default=len(outs))
    joined = all(isinstance(o, _Out) and isinstance(o.token_ids, array) for o in given_outs)
    bulk = c.flat_generations(outs, _Flat, consume=consume)
    assert bulk == Success(expected)  # NaN equal to NaN, -inf and +inf kept
    dropped = len(outs) if joined else first_slow
    kept: Rows = [*([None] * dropped), *given_outs[dropped:]]
    assert outs == (kept if consume else given_outs)
    reasons = [o.finish_reason for o in given_outs if o is not None]
    assert expected.aborted.tolist() == [r == "abort" for r in reasons]
    assert expected.truncated.tolist() == [r == "length" for r in reasons]


@given(_rows, st.booleans())
def test_a_batch_of_arrays_is_joined_in_one_pass(
    rows: list[list[tuple[int, float]]], consume: bool
) -> None:
    outs: Rows = [_out([t for t, _ in r], [v for _, v in r], "arrays") for r in rows]
    expected = _row_by_row(outs)
    assert c.joined_generations(outs) == Success(expected)
    given_outs = list(outs)
    assert c.flat_generations(outs, _Flat, consume=consume) == Success(expected)
    assert outs == ([None] * len(given_outs) if consume else given_outs)


def test_arrays_that_do_not_fit_together_are_not_joined() -> None:
    short = _out([5, 6], [-1.0, -2.0], "arrays")
    assert isinstance(short.logprobs, c.SampledLogprobs)
    short.logprobs.logprobs.pop()
    other = _out([5, 6], [-1.0, -2.0], "arrays")
    assert isinstance(other.logprobs, c.SampledLogprobs)
    other.logprobs.token_ids[1] = 7
    for bad in (short, other, _out([5], [-1.0], "sampled")):
        assert c.joined_generations([_out([1], [-1.0], "arrays"), bad]) == Success(None)


def test_rows_that_did_not_finish_are_named_in_every_pass() -> None:
    for layout in ("arrays", "flat", "dicts"):
        outs: Rows = [
            _out([5], [-1.0], layout, finish_reason=None),
            _out([6], [-1.0], layout, finish_reason="stop"),
            _out([7], [-1.0], layout, finish_reason="error"),
        ]
        message = _refusal(outs, call="generate_text")
        assert message.startswith("generate_text: rows [0, 2] did not finish")
        assert "[None, 'error']" in message
    joined = c.joined_generations([_out([5], [-1.0], "arrays", finish_reason=None)])
    assert isinstance(joined, Failure)
    assert joined.failure().rows == (0,)
    alone = c.generation_of(3, _out([5], [-1.0], finish_reason="error"), _Flat)
    assert isinstance(alone, Failure)
    assert alone.failure().message == "generate: row 3 did not finish (finish reason 'error')"


def test_consumed_rows_are_dropped_and_never_read_again() -> None:
    outs: Rows = [_out([5], [-1.0]), _out([6, 7], [-1.0, -2.0]), _out([8], [-0.5])]
    assert isinstance(c.flat_generations(outs, _Flat, consume=True), Success)
    assert outs == [None, None, None]
    with pytest.raises(ValueError, match="read after it was dropped"):
        c.flat_generations(outs, _Flat)


@pytest.mark.parametrize(
    ("out", "error"),
    [
        (_out([5, 9], [-1.0, -2.0], "dicts"), None),
        (_Out([5, 6], None), "row 0 came back without logprobs"),
        (_Out([5, 6], [{5: _Logprob(-1.0)}]), "row 0 has 2 tokens but logprobs list of length 1"),
        (_Out([5], {5: _Logprob(-1.0)}), "row 0 has 1 tokens but logprobs dict of length 1"),
        (_Out([5, 6], [{5: _Logprob(-1.0)}, {7: _Logprob(-1.0)}]), "position 1: no logprob"),
        (_Out([5, 6], _Flat([0], [1], [5], [-1.0])), "2 tokens but flat logprobs for 1 positions"),
        (_Out([5, 6], _Flat([0, 1], [1, 1], [5, 6, 8], [-1.0, -2.0, -3.0])), "for 1 positions"),
        (_Out([5, 6], _Flat([0, 1], [1, 2], [5, 7], [-1.0, -2.0])), "flat logprobs are for tokens"),
    ],
)
def test_a_row_that_breaks_the_contract_is_named(out: _Out, error: str | None) -> None:
    rows: Rows = [_out([1], [-0.5]), out]
    result = c.flat_generations(rows, _Flat)
    if error is None:
        assert isinstance(result, Success)
        return
    assert isinstance(result, Failure)
    assert error.replace("row 0", "row 1") in result.failure().message
    assert result.failure().rows == (1,)


@pytest.mark.parametrize(
    ("ids", "logprobs"), [([7, 9], [-1.0, -2.0]), ([7, 8, 9], [-1.0, -2.0]), ([7, 8], [-1.0])]
)
def test_sampled_arrays_for_other_tokens_are_named(ids: list[int], logprobs: list[float]) -> None:
    for layout in ("sampled", "arrays"):
        bad = _out([7, 8], [-1.0, -2.0], layout)
        kept = c.SampledLogprobs()
        kept.token_ids.extend(ids)
        kept.logprobs.extend(logprobs)
        bad.logprobs = kept
        message = _refusal([_out([5, 6], [-1.0, -2.0], layout), bad])
        assert f"row 1's sampled logprobs ({len(logprobs)}) are for tokens {ids}" in message


def test_a_shifted_flat_layout_is_not_taken_for_one_entry_per_position() -> None:
    # Position 0 holds nothing, position 1 two entries spelling the generated tokens.
    out = _Out([5, 6], _Flat([0, 0], [0, 2], [5, 6], [-1.0, -2.0]))
    assert "row 0 has 2 tokens but flat logprobs for 1 positions" in _refusal([out])


def test_sampled_logprobs_are_copied_out_and_say_their_size() -> None:
    row = c.generation_of(0, _out([5, 6], [-1.0, -2.5], "sampled"), _Flat).unwrap()
    assert row.logprobs is not None
    assert row.logprobs.flags.owndata
    assert row.logprobs.tolist() == [-1.0, -2.5]
    assert repr(c.SampledLogprobs()) == "SampledLogprobs(0 positions)"
    assert np.array_equal(row.token_ids, [5, 6])


@given(
    st.lists(
        st.lists(
            st.tuples(st.integers(0, 2**40), st.floats(-50.0, 0.0, width=32)),
            max_size=4,
        ),
        max_size=5,
    ),
    st.floats(-10.0, 0.0),
)
def test_steps_append_the_sampled_column_and_sum_as_vllm_does(
    steps: list[list[tuple[int, float]]], start: float
) -> None:
    # vLLM's step arrays hold the sampled token first, then the top logprobs (here -1 each).
    kept, cumulative, expected = c.SampledLogprobs(), start, start
    for step in steps:
        ids = np.array([[t, 0] for t, _ in step], dtype=np.int64).reshape(-1, 2)
        logprobs = np.array([[v, -1.0] for _, v in step], dtype=np.float32).reshape(-1, 2)
        cumulative = kept.append_step(ids, logprobs, cumulative)
        for _, value in step:
            expected += float(np.float32(value))
    pairs = [pair for step in steps for pair in step]
    assert list(kept.token_ids) == [t for t, _ in pairs]
    assert list(kept.logprobs) == [float(np.float32(v)) for _, v in pairs]
    assert cumulative == expected
    assert len(kept) == len(pairs)
