"""Laws of the stop-string merge: nothing lost, no duplicates, first-seen order, no leaks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Success
from strategies import StopBatch, stop_batches, stop_lists, stop_texts

from genworker.core.stops import StopError, StopMode, StopProblem, merge_stop_strings

MODES = st.sampled_from(StopMode)


def merged(batch: StopBatch, mode: StopMode) -> tuple[tuple[str, ...], ...]:
    result = merge_stop_strings(batch.config_stops, batch.per_sample, batch.batch_size, mode)
    return result.unwrap()


def row_strings(batch: StopBatch, row: int) -> Sequence[str]:
    return () if batch.per_sample is None else (batch.per_sample[row] or ())


def first_seen(*streams: Iterable[str]) -> tuple[str, ...]:
    seen: list[str] = []
    for stream in streams:
        for string in stream:
            if string not in seen:
                seen.append(string)
    return tuple(seen)


def error_of(
    config: object, per_sample: object, batch_size: int, mode: StopMode = StopMode.PER_SAMPLE
) -> StopError:
    result = merge_stop_strings(config, per_sample, batch_size, mode)  # type: ignore[arg-type]
    error = result.failure()
    assert str(error) == error.message
    return error


# --- laws ---


@given(stop_batches(), MODES)
def test_one_tuple_per_row(batch: StopBatch, mode: StopMode) -> None:
    assert len(merged(batch, mode)) == batch.batch_size


@given(stop_batches(), MODES)
def test_nothing_lost(batch: StopBatch, mode: StopMode) -> None:
    rows = merged(batch, mode)
    everyone = {s for r in range(batch.batch_size) for s in row_strings(batch, r)}
    for r, got in enumerate(rows):
        assert set(batch.config_stops) <= set(got)
        assert set(row_strings(batch, r)) <= set(got)
        if mode is StopMode.BATCH_UNION:
            assert everyone <= set(got)


@given(stop_batches(), MODES)
def test_no_duplicates(batch: StopBatch, mode: StopMode) -> None:
    for got in merged(batch, mode):
        assert len(got) == len(set(got))


@given(stop_batches())
def test_per_sample_order_is_first_seen_config_first(batch: StopBatch) -> None:
    for r, got in enumerate(merged(batch, StopMode.PER_SAMPLE)):
        assert got == first_seen(batch.config_stops, row_strings(batch, r))


@given(stop_batches())
def test_union_order_is_first_seen_over_the_batch(batch: StopBatch) -> None:
    expected = first_seen(
        batch.config_stops, *(row_strings(batch, r) for r in range(batch.batch_size))
    )
    assert merged(batch, StopMode.BATCH_UNION) == (expected,) * batch.batch_size


@given(stop_batches())
def test_per_sample_rows_never_get_another_rows_strings(batch: StopBatch) -> None:
    for r, got in enumerate(merged(batch, StopMode.PER_SAMPLE)):
        assert set(got) <= set(batch.config_stops) | set(row_strings(batch, r))


@given(stop_batches(), MODES)
def test_deterministic_and_container_blind(batch: StopBatch, mode: StopMode) -> None:
    """Same inputs, same output; lists and tuples are interchangeable."""
    as_tuples = StopBatch(
        tuple(batch.config_stops),
        None
        if batch.per_sample is None
        else [None if e is None else tuple(e) for e in batch.per_sample],
        batch.batch_size,
    )
    assert merged(batch, mode) == merged(batch, mode) == merged(as_tuples, mode)


@given(stop_batches(), MODES)
def test_default_mode_is_per_sample(batch: StopBatch, mode: StopMode) -> None:
    assert merge_stop_strings(
        batch.config_stops, batch.per_sample, batch.batch_size
    ) == merge_stop_strings(
        batch.config_stops, batch.per_sample, batch.batch_size, StopMode.PER_SAMPLE
    )


@given(stop_lists, st.integers(0, 6), MODES)
def test_no_per_sample_strings_gives_every_row_the_config(
    config: list[str], batch_size: int, mode: StopMode
) -> None:
    expected = (first_seen(config),) * batch_size
    assert merge_stop_strings(config, None, batch_size, mode) == Success(expected)
    assert merge_stop_strings(config, [None] * batch_size, batch_size, mode) == Success(expected)


def test_nemo_rl_union_versus_per_sample() -> None:
    per_sample = [["</answer>"], None, ["\n\n", "</answer>"]]
    config = ["<|im_end|>"]
    assert merge_stop_strings(config, per_sample, 3) == Success(
        (("<|im_end|>", "</answer>"), ("<|im_end|>",), ("<|im_end|>", "\n\n", "</answer>"))
    )
    assert merge_stop_strings(config, per_sample, 3, StopMode.BATCH_UNION) == Success(
        (("<|im_end|>", "</answer>", "\n\n"),) * 3
    )
    assert merge_stop_strings(None, [], 0) == Success(())
    assert merge_stop_strings((), None, 2) == Success(((), ()))


# --- refusals ---


@given(
    stop_batches(max_rows=5),
    st.lists(st.tuples(st.integers(-1, 4), st.integers(0, 6)), min_size=1, max_size=4),
    MODES,
)
def test_every_empty_string_is_named(
    batch: StopBatch, holes: list[tuple[int, int]], mode: StopMode
) -> None:
    """Empty strings anywhere are all reported, each with its row (or config) and position."""
    config = list(batch.config_stops)
    per_sample = [list(row_strings(batch, r)) for r in range(batch.batch_size)]
    for row, position in holes:
        target = config if row < 0 or row >= batch.batch_size else per_sample[row]
        target.insert(min(position, len(target)), "")
    error = error_of(config, per_sample, batch.batch_size, mode)
    expected = [("config", p) for p, s in enumerate(config) if s == ""] + [
        (r, p) for r, strings in enumerate(per_sample) for p, s in enumerate(strings) if s == ""
    ]
    assert [(p.source, p.position) for p in error.problems] == expected
    for problem in error.problems:
        assert "empty string" in str(problem)
        assert str(problem) in str(error)


def test_problem_sentences_name_the_place() -> None:
    error = error_of(["", "a"], [["b", ""], None], 2)
    assert str(error) == (
        "config stop_strings[0] is an empty string; stop_strings of row 0[1] is an empty string"
    )


@pytest.mark.parametrize("mode", list(StopMode))
def test_bare_string_entry_is_refused(mode: StopMode) -> None:
    """A bare string would be iterated character by character: refused, naming the row."""
    error = error_of(["x"], [["a"], "</answer>", None], 3, mode)
    assert error.problems == (StopProblem(1, None, error.problems[0].message),)
    assert "row 1" in str(error)
    assert "'</answer>'" in str(error)


@pytest.mark.parametrize("bad", ["</s>", b"</s>"])
def test_bare_string_config_is_refused(bad: object) -> None:
    error = error_of(bad, None, 1)
    assert [(p.source, p.position) for p in error.problems] == [("config", None)]
    assert "config" in str(error)


@pytest.mark.parametrize("bad", ["ab", b"ab", {"a": 1}, 7])
def test_per_sample_must_be_a_list(bad: object) -> None:
    error = error_of([], bad, 2)
    assert [(p.source, p.position) for p in error.problems] == [(None, None)]
    assert "one entry per row" in str(error)


@given(stop_lists, st.integers(0, 6), st.integers(0, 6))
def test_per_sample_length_must_match_the_batch(
    config: list[str], batch_size: int, entries: int
) -> None:
    per_sample: list[Sequence[str] | None] = [None] * entries
    result = merge_stop_strings(config, per_sample, batch_size)
    if entries == batch_size:
        assert isinstance(result, Success)
    else:
        error = result.failure()
        assert [(p.source, p.position) for p in error.problems] == [(None, None)]
        assert f"{entries} entries for a batch of {batch_size} rows" in str(error)


def test_non_string_items_and_non_list_entries_are_refused() -> None:
    error = error_of([3], [["a", None], {"x"}, ["ok"]], 3)
    assert [(p.source, p.position) for p in error.problems] == [
        ("config", 0),
        (0, 1),
        (1, None),
    ]
    assert "config stop_strings[0] must be a string, got int 3" in str(error)
    assert "stop_strings of row 0[1] must be a string, got NoneType None" in str(error)
    assert "stop_strings of row 1 must be a list of strings, got set" in str(error)


def test_all_problems_at_once() -> None:
    error = error_of([""], "abc", 3)
    assert [(p.source, p.position) for p in error.problems] == [("config", 0), (None, None)]


@given(stop_texts)
def test_negative_batch_size_is_a_programming_error(text: str) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        merge_stop_strings([text], None, -1)
