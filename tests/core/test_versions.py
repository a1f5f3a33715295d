"""Weight versions: the run-length form, its dense form, vLLM's labelled spans, and the
per-token layout beside the output contract's logprobs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import version_batches, version_sequences

from genworker.core.versions import (
    NO_VERSION,
    Counted,
    GroupVersions,
    VersionError,
    VersionRuns,
    extend_runs,
    finished_runs,
    place_versions,
    runs_from_spans,
    runs_from_tokens,
    staleness,
    uniform_versions,
    weight_spans,
)


def _runs(per_token: list[int]) -> VersionRuns:
    result = runs_from_tokens(per_token)
    assert isinstance(result, Success), result
    runs = result.unwrap()
    assert isinstance(runs, VersionRuns)
    return runs


def _error(result: object) -> VersionError:
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, VersionError)
    return error


def _spans(runs: VersionRuns) -> list[tuple[str, int, int]]:
    return [(str(v), s, e) for v, s, e in zip(runs.versions, runs.starts, runs.ends, strict=True)]


# --- laws ------------------------------------------------------------------------------------


@given(version_sequences())
def test_runs_round_trip_through_the_dense_form(per_token: list[int]) -> None:
    runs = _runs(per_token)
    assert runs.per_token().tolist() == per_token
    assert runs.per_token().dtype == np.int64
    assert runs.length == len(per_token)
    assert _runs(runs.per_token().tolist()) == runs


@given(version_sequences())
def test_runs_are_maximal_and_increasing(per_token: list[int]) -> None:
    runs = _runs(per_token)
    assert list(runs.versions) == sorted(set(per_token))
    assert len(runs.versions) == len(runs.starts) == len(runs.ends)
    for v, s, e in zip(runs.versions, runs.starts, runs.ends, strict=True):
        assert s < e
        assert set(per_token[s:e]) == {v}
    assert runs.latest == (per_token[-1] if per_token else None)


@given(version_sequences(), st.integers(0, 3), st.integers(0, 6))
def test_extending_is_appending_tokens(per_token: list[int], bump: int, count: int) -> None:
    runs = _runs(per_token)
    version = (runs.latest or 0) + bump
    extended = extend_runs(runs, version, count)
    assert isinstance(extended, Success)
    assert extended.unwrap().per_token().tolist() == per_token + [version] * count
    assert extended.unwrap() == _runs(per_token + [version] * count)


@given(version_sequences())
def test_runs_are_built_by_extending_token_by_token(per_token: list[int]) -> None:
    runs = VersionRuns((), (), 0)
    for v in per_token:
        runs = extend_runs(runs, v, 1).unwrap()
    assert runs == _runs(per_token)


@given(version_sequences())
def test_vllm_spans_convert_to_the_same_runs(per_token: list[int]) -> None:
    runs = _runs(per_token)
    result = runs_from_spans(_spans(runs), runs.length)
    assert result == Success(runs)


@dataclasses.dataclass(frozen=True)
class _VllmSpan:
    """vLLM 0.32's ``WeightVersionSpan`` (vllm/outputs.py), as the engine returns it."""

    version: str
    start: int
    end: int


@given(version_sequences())
def test_a_completions_labelled_spans_read_as_its_runs(per_token: list[int]) -> None:
    runs = _runs(per_token)
    spans = [_VllmSpan(*span) for span in _spans(runs)]
    assert weight_spans(spans) == tuple(_spans(runs))
    assert runs_from_spans(weight_spans(spans) or (), runs.length) == Success(runs)
    assert weight_spans(None) is None  # an engine that does not label its tokens


@given(version_sequences(), st.data())
def test_split_spans_of_one_version_merge(per_token: list[int], data: st.DataObject) -> None:
    runs = _runs(per_token)
    spans: list[tuple[str, int, int]] = []
    for label, s, e in _spans(runs):
        cut = data.draw(st.integers(s, e - 1))
        spans += [(label, s, cut), (label, cut, e)] if cut > s else [(label, s, e)]
    assert runs_from_spans(spans, runs.length) == Success(runs)


@given(version_sequences(), st.integers(0, 4))
def test_staleness_counts_refits_behind_and_never_grows_along_a_row(
    per_token: list[int], ahead: int
) -> None:
    runs = _runs(per_token)
    current = (runs.latest or 0) + ahead
    lag = staleness(runs, current)
    assert lag.tolist() == [current - v for v in per_token]
    assert bool((lag >= 0).all())
    assert bool((np.diff(lag) <= 0).all())


@given(version_batches())
def test_placed_versions_sit_exactly_on_the_generated_span(
    rows: list[tuple[int, list[int]]],
) -> None:
    lengths = [n for n, _ in rows]
    runs = [_runs(v) for _, v in rows]
    width = max((n + r.length for n, r in zip(lengths, runs, strict=True)), default=0) + 1
    out = place_versions(lengths, runs, width)
    assert out.dtype == torch.int64
    assert tuple(out.shape) == (len(rows), width)
    for i, (n, per_token) in enumerate(rows):
        row = out[i].tolist()
        assert row[n : n + len(per_token)] == per_token
        assert set(row[:n] + row[n + len(per_token) :]) <= {NO_VERSION}


@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=6),
    st.integers(0, 3),
    st.integers(0, 9),
)
def test_uniform_versions_are_placed_versions_of_one_run(
    rows: list[tuple[int, int]], extra: int, version: int
) -> None:
    lengths = torch.tensor([n for n, _ in rows], dtype=torch.int64)
    generated = torch.tensor([g for _, g in rows], dtype=torch.int64)
    width = max((n + g for n, g in rows), default=0) + extra
    expected = place_versions(
        [n for n, _ in rows], [VersionRuns.uniform(version, g) for _, g in rows], width
    )
    assert torch.equal(uniform_versions(lengths, generated, width, version), expected)


# --- what is refused -------------------------------------------------------------------------


def test_uniform_runs_and_their_ends() -> None:
    assert VersionRuns.uniform(3, 4) == VersionRuns((3,), (0,), 4)
    assert VersionRuns.uniform(3, 0) == VersionRuns((), (), 0)
    runs = VersionRuns((0, 2), (0, 5), 9)
    assert runs.ends == (5, 9)
    assert runs.per_token().tolist() == [0] * 5 + [2] * 4


@pytest.mark.parametrize(
    ("versions", "starts", "length", "text"),
    [
        ((0,), (), 3, "1 versions but 0 starts"),
        ((), (), -1, "negative"),
        ((), (), 2, "0 runs for 2 tokens"),
        ((0,), (0,), 0, "1 runs for 0 tokens"),
        ((0,), (1,), 3, "starts at 1"),
        ((0, 1), (0, 0), 3, "not increasing"),
        ((0, 1), (0, 3), 3, "not increasing"),
        ((-1,), (0,), 3, "negative version"),
        ((2, 1), (0, 1), 3, "do not increase"),
        ((1, 1), (0, 1), 3, "do not increase"),
    ],
)
def test_runs_that_describe_no_row_cannot_be_built(
    versions: tuple[int, ...], starts: tuple[int, ...], length: int, text: str
) -> None:
    with pytest.raises(ValueError, match=text):
        VersionRuns(versions, starts, length)


def test_dense_versions_must_be_non_negative_and_never_go_down() -> None:
    assert runs_from_tokens([]) == Success(VersionRuns((), (), 0))
    assert "token 2 has the negative version -1" in str(_error(runs_from_tokens([0, 0, -1])))
    error = _error(runs_from_tokens([0, 2, 1]))
    assert error.detail == "decreasing"
    assert "token 2 has version 1 after version 2" in str(error)


def test_extending_refuses_what_no_row_can_hold() -> None:
    runs = VersionRuns.uniform(2, 3)
    assert _error(extend_runs(runs, 2, -1)).detail == "count"
    assert _error(extend_runs(runs, 1, 1)).detail == "decreasing"
    assert _error(extend_runs(VersionRuns((), (), 0), -1, 1)).detail == "negative"
    assert extend_runs(runs, 0, 0) == Success(runs), "no tokens: nothing to check"


@pytest.mark.parametrize(
    ("spans", "length", "detail", "text"),
    [
        ([("default", 0, 3)], 3, "label", "span 0 has the label 'default'"),
        ([("-1", 0, 3)], 3, "label", "not a version number"),
        ([("0", 0, 2), ("1", 3, 4)], 4, "tiling", "span 1 covers [3, 4)"),
        ([("0", 0, 2), ("1", 2, 2)], 2, "tiling", "at least one token"),
        ([("0", 0, 2)], 3, "tiling", "cover 2 tokens of 3"),
        ([], 1, "tiling", "cover 0 tokens of 1"),
        ([("2", 0, 2), ("1", 2, 3)], 3, "decreasing", "version 1 after version 2"),
    ],
)
def test_spans_that_do_not_tile_the_row_in_order_are_refused(
    spans: list[tuple[str, int, int]], length: int, detail: str, text: str
) -> None:
    error = _error(runs_from_spans(spans, length))
    assert error.detail == detail
    assert text in str(error)


def test_no_spans_for_no_tokens() -> None:
    assert runs_from_spans([], 0) == Success(VersionRuns((), (), 0))


def test_placing_rows_that_do_not_fit_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="2 version rows for 1 input lengths"):
        place_versions([1], [VersionRuns.uniform(0, 1)] * 2, 4)
    with pytest.raises(ValueError, match="row 0: 3 tokens after 2 input tokens"):
        place_versions([2], [VersionRuns.uniform(0, 3)], 4)
    with pytest.raises(ValueError, match="row 0"):
        place_versions([-1], [VersionRuns.uniform(0, 1)], 4)
    assert tuple(place_versions([], [], 0).shape) == (0, 0)
    one = torch.tensor([2])
    with pytest.raises(ValueError, match="2 generation lengths for 1 input lengths"):
        uniform_versions(one, torch.tensor([1, 1]), 4, 0)
    with pytest.raises(ValueError, match="3 generation lengths for 2 input lengths"):
        uniform_versions(torch.tensor([1, 1]), torch.tensor([1, 1, 1]), 4, 0)
    with pytest.raises(ValueError, match="do not fit in width 4"):
        uniform_versions(one, torch.tensor([3]), 4, 0)
    with pytest.raises(ValueError, match="do not fit"):
        uniform_versions(torch.tensor([-1]), torch.tensor([1]), 4, 0)
    empty = torch.zeros(0, dtype=torch.int64)
    assert tuple(uniform_versions(empty, empty, 0, 3).shape) == (0, 0)


@given(st.integers(1, 4), st.lists(st.lists(st.booleans(), min_size=4, max_size=4), max_size=6))
def test_group_versions_name_one_refit_s_weights_on_every_shard(
    num_shards: int, refits: list[list[bool]]
) -> None:
    """Law: shard ``r``'s own version ``c`` relabelled is the group version of the refit
    that gave it its ``c``-th weights; a count past them is the group's next ones."""
    versions = GroupVersions.start(num_shards)
    own = [[0] for _ in range(num_shards)]  # per shard, the group version of each own count
    for took in refits:
        ranks = [r for r in range(num_shards) if took[r]]
        versions = versions.landed(ranks)
        if ranks:
            for r in ranks:
                own[r].append(versions.version)
    for rank in range(num_shards):
        counts = torch.tensor([[NO_VERSION, *range(len(own[rank]) + 2)]])
        expected = [NO_VERSION, *own[rank], versions.version + 1, versions.version + 2]
        assert versions.relabel(rank, counts).tolist() == [expected]


def test_group_versions_start_at_zero_and_keep_a_full_shard_s_tensor() -> None:
    start = GroupVersions.start(2)
    assert start == GroupVersions(version=0, shards=((0,), (0,)))
    assert start.landed([]) is start
    both = start.landed([0, 1])
    counts = torch.tensor([1, 0, NO_VERSION])
    assert both.relabel(1, counts) is counts
    with pytest.raises(ValueError, match=r"shard 0's versions \(0, 2\) must rise from 0"):
        GroupVersions(version=1, shards=((0, 2),))


@given(version_sequences(), st.integers(0, 5), st.integers(0, 6))
def test_finished_runs_of_a_counted_row_end_under_the_version_now(
    before: list[int], more: int, now: int
) -> None:
    """Without labels: the tokens counted before the last refit keep their versions, the
    rest of the row's tokens get the version now (never below the last one)."""
    runs = runs_from_tokens(before).unwrap()
    version = max([now, *before])
    counted = Counted(runs, len(before), version)
    total = len(before) + more
    finished = finished_runs(total, 3, spans=None, counted=counted)
    assert finished == runs_from_tokens([*before, *[version] * more])


def test_finished_runs_of_a_labelled_row_are_its_spans() -> None:
    spans = [("0", 0, 2), ("1", 2, 3)]
    assert finished_runs(3, 0, spans=spans, counted=None) == runs_from_tokens([0, 0, 1])


@pytest.mark.parametrize(
    ("spans", "counted", "message"),
    [
        (None, None, "row 4: the engine did not label its tokens"),
        ([("0", 0, 2)], None, "row 4 weight versions: the spans cover 2 tokens of 3"),
        (None, Counted(VersionRuns((), (), 0), 5, 0), "row 4: 5 tokens streamed but 3 in"),
        (None, Counted(VersionRuns((2,), (0,), 1), 1, 1), "row 4 weight versions: version 1"),
    ],
)
def test_finished_runs_refuse_versions_that_cannot_describe_the_row_naming_it(
    spans: list[tuple[str, int, int]] | None, counted: Counted | None, message: str
) -> None:
    finished = finished_runs(3, 4, spans=spans, counted=counted)
    assert isinstance(finished, Failure)
    assert finished.failure().message.startswith(message)
