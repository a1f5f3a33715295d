"""Laws and documented cases of genworker.core.scoring."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core.scoring import (
    ScoreArgumentError,
    ScoredRow,
    ScorePlan,
    ScoreRefusal,
    UnreadScores,
    assemble_scores,
    plan_scores,
    read_scored_row,
    scoring_kwargs,
)

PAD = 0
LIMITS = {"max_logprobs": 5, "max_model_len": 32, "vocab_size": 50}


@st.composite
def score_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    rows = draw(st.integers(0, 6))
    lengths = [draw(st.integers(2, 12)) for _ in range(rows)]
    prompts = [draw(st.integers(1, length - 1)) for length in lengths]
    width = max(lengths, default=0) + draw(st.integers(0, 3))
    ids = torch.full((rows, width), PAD, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.tensor(
            draw(st.lists(st.integers(1, 49), min_size=length, max_size=length))
        )
    k = draw(st.integers(0, 5))
    return ids, torch.tensor(lengths, dtype=torch.long), torch.tensor(prompts, dtype=torch.long), k


def _planned(
    ids: object, lengths: object, prompts: object, k: object
) -> tuple[ScorePlan, ScoreRefusal | None]:
    result = plan_scores(ids, lengths, prompts, k, **LIMITS)
    assert isinstance(result, Success), result
    plan, refused = result.unwrap()
    assert isinstance(plan, ScorePlan)
    return plan, refused


@given(score_batches())
def test_scores_sit_at_the_given_tokens_and_zero_elsewhere(
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
) -> None:
    ids, lengths, prompts, k = batch
    plan, refused = _planned(ids, lengths, prompts, k)
    assert refused is None
    rows = []
    for i, (length, start) in enumerate(zip(lengths.tolist(), prompts.tolist(), strict=True)):
        span = range(start, length)
        rows.append(
            ScoredRow(
                logprobs=tuple(-float(t) - i for t in span),
                top_ids=tuple(tuple(range(t, t + k)) for t in span) if k else (),
                top_logprobs=tuple(tuple(-float(t + j) for j in range(k)) for t in span)
                if k
                else (),
            )
        )
    out = assemble_scores(plan, rows, PAD)
    assert out["logprobs"].shape == ids.shape
    assert out["logprobs"].dtype == torch.float32
    for i, (length, start) in enumerate(zip(lengths.tolist(), prompts.tolist(), strict=True)):
        row = out["logprobs"][i]
        assert row[:start].eq(0).all()
        assert row[length:].eq(0).all()
        assert row[start:length].tolist() == [-float(t) - i for t in range(start, length)]
        if k:
            assert out["top_ids"][i, start:length, 0].tolist() == list(range(start, length))
            assert out["top_ids"][i, :start].eq(PAD).all()
            assert out["top_logprobs"][i, length:].eq(0).all()
    assert ("top_ids" in out) == bool(k) == ("top_logprobs" in out)
    assert plan.sequences == tuple(
        tuple(ids[i, :length].tolist()) for i, length in enumerate(lengths.tolist())
    )


def test_bad_rows_are_refused_by_row_with_their_reasons() -> None:
    ids = torch.tensor(
        [[1, 2, 3, 0], [0, 0, 0, 0], [1, 2, 0, 0], [1, 2, 3, 4], [1, 99, 2, 0], [1, 2, 3, 4]]
    )
    lengths = torch.tensor([3, 0, 2, 4, 3, 5])
    prompts = torch.tensor([1, 1, 2, 0, 1, 1])
    plan, refused = _planned(ids, lengths, prompts, 2)
    assert isinstance(refused, ScoreRefusal)
    assert refused.rows == (1, 2, 3, 4, 5)
    assert "empty sequence" in refused.reasons[0]
    assert "prompt_length=2 is out of range [1, 1]" in refused.reasons[1]
    assert "prompt_length=0" in refused.reasons[2]
    assert "outside the vocabulary of 50" in refused.reasons[3]
    assert "wider than input_ids" in refused.reasons[4]
    assert "row 1: empty sequence" in refused.message
    assert len(plan.sequences) == 6


def test_a_sequence_with_no_room_for_the_pass_is_refused() -> None:
    ids = torch.ones((1, 32), dtype=torch.long)
    _, refused = _planned(ids, torch.tensor([32]), torch.tensor([1]), 0)
    assert refused is not None
    assert "max_model_len=32" in refused.reasons[0]


@pytest.mark.parametrize(
    ("ids", "lengths", "prompts", "k", "field", "text"),
    [
        (
            torch.ones((1, 2), dtype=torch.long),
            torch.tensor([2]),
            torch.tensor([1]),
            6,
            "top_k",
            "max_logprobs=5",
        ),
        (
            torch.ones((1, 2), dtype=torch.long),
            torch.tensor([2]),
            torch.tensor([1]),
            -1,
            "top_k",
            ">= 0",
        ),
        (
            torch.ones((1, 2), dtype=torch.long),
            torch.tensor([2]),
            torch.tensor([1]),
            True,
            "top_k",
            ">= 0",
        ),
        ([[1, 2]], torch.tensor([2]), torch.tensor([1]), 0, "input_ids", "2-D integer"),
        (torch.ones((1, 2)), torch.tensor([2]), torch.tensor([1]), 0, "input_ids", "2-D integer"),
        (torch.ones((1, 2), dtype=torch.long), [2], torch.tensor([1]), 0, "input_lengths", "1-D"),
        (
            torch.ones((1, 2), dtype=torch.long),
            torch.tensor([2, 2]),
            torch.tensor([1]),
            0,
            "input_lengths",
            "2 rows",
        ),
        (
            torch.ones((1, 2), dtype=torch.long),
            torch.tensor([2]),
            torch.tensor([1.0]),
            0,
            "prompt_lengths",
            "1-D",
        ),
    ],
)
def test_a_malformed_call_is_refused_whole_naming_the_input(
    ids: object, lengths: object, prompts: object, k: object, field: str, text: str
) -> None:
    result = plan_scores(ids, lengths, prompts, k, **LIMITS)
    assert isinstance(result, Failure)
    problem = result.failure()
    assert isinstance(problem, ScoreArgumentError)
    assert problem.field == field
    assert text in problem.message


def test_engine_rows_that_do_not_fit_the_plan_are_programming_errors() -> None:
    plan, _ = _planned(torch.tensor([[1, 2, 3]]), torch.tensor([3]), torch.tensor([1]), 1)
    with pytest.raises(ValueError, match="1 sequences"):
        assemble_scores(plan, [], PAD)
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        assemble_scores(plan, [ScoredRow((0.0,))], PAD)
    with pytest.raises(ValueError, match="top-1"):
        assemble_scores(plan, [ScoredRow((0.0, 0.0), ((1,),), ((0.0,),))], PAD)


@attrs.frozen
class _Logprob:
    logprob: float
    rank: int | None


@given(st.lists(st.integers(0, 40), min_size=2, max_size=8), st.data())
def test_the_given_tokens_and_the_ranked_top_k_are_read(
    ids: list[int], data: st.DataObject
) -> None:
    """vLLM's prompt logprobs (None at 0, the top k by rank and the given token at every
    other position): the given token's logprob from the prompt length on, the top k in
    rank order."""
    start = data.draw(st.integers(1, len(ids) - 1))
    top_k = data.draw(st.integers(0, 3))
    positions: list[dict[int, _Logprob] | None] = [None]
    for p in range(1, len(ids)):
        entries = {100 + r: _Logprob(-0.1 * r - p, r) for r in range(1, top_k + 1)}
        entries[ids[p]] = _Logprob(-float(p), data.draw(st.integers(1, 50)))
        positions.append(entries)
    result = read_scored_row(ids, start, positions, top_k)
    assert isinstance(result, Success)
    row = result.unwrap()
    assert row.logprobs == tuple(-float(p) for p in range(start, len(ids)))
    assert len(row.top_ids) == (len(ids) - start if top_k else 0)
    for p, (top, values) in enumerate(zip(row.top_ids, row.top_logprobs, strict=True), start):
        seen = positions[p]
        assert seen is not None
        ranks = [seen[t].rank for t in top]
        assert ranks == sorted(r for r in ranks if r is not None)
        assert values == tuple(seen[t].logprob for t in top)


def test_a_rank_vllm_did_not_give_sorts_last() -> None:
    positions = [None, {5: _Logprob(-0.5, None), 6: _Logprob(-2.0, 1)}]
    result = read_scored_row([1, 5], 1, positions, 2)
    assert result == Success(ScoredRow((-0.5,), ((6, 5),), ((-2.0, -0.5),)))


@pytest.mark.parametrize(
    ("positions", "top_k", "error", "position"),
    [
        (None, 0, "None prompt logprob positions for 3 tokens", None),
        ([None, None], 0, "2 prompt logprob positions for 3 tokens", None),
        ([None, None, {7: _Logprob(-1.0, 1)}], 0, "no logprob for token 6 at position 1", 1),
        ([None, {6: _Logprob(-1.0, 1)}, {8: _Logprob(-1.0, 1)}], 0, "token 7 at position 2", 2),
        ([None, {6: _Logprob(-1.0, 1)}, None], 2, "1 top logprobs at position 1, asked for 2", 1),
    ],
)
def test_prompt_logprobs_that_lack_a_position_are_named(
    positions: list[dict[int, _Logprob] | None] | None,
    top_k: int,
    error: str,
    position: int | None,
) -> None:
    result = read_scored_row([5, 6, 7], 1, positions, top_k)
    assert isinstance(result, Failure)
    problem = result.failure()
    assert isinstance(problem, UnreadScores)
    assert error in str(problem)
    assert problem.position == position


@given(st.integers(0, 20))
def test_the_scoring_request_is_one_greedy_undetokenized_token_after_the_prompt_logprobs(
    top_k: int,
) -> None:
    kwargs = scoring_kwargs(top_k)
    assert kwargs == {
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": top_k,
        "detokenize": False,
    }
