"""GRPO groups and compute_logprobs on the sync worker over the fake engine (the plan's
wiring; the claims about vLLM are in test_groups_engine.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import PAD, base_config
from helpers import right_padded as batch

from genworker.core.groups import GroupError
from genworker.core.scoring import ScoreRefusal
from genworker.shell.errors import BadArgumentError, BadBatchError
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.worker import VllmGenerationWorker

A, B, C = [3, 4, 5], [6, 7], [8, 9, 10, 11]


def make_worker(**engine: Any) -> tuple[VllmGenerationWorker, FakeEngine]:
    factory = FakeEngineFactory(max_model_len=32, **engine)
    worker = VllmGenerationWorker(base_config(), engine_factory=factory)
    fake = worker.engine
    assert isinstance(fake, FakeEngine)
    return worker, fake


def _rows(out: dict[str, torch.Tensor]) -> list[list[int]]:
    ends = out["unpadded_sequence_lengths"].tolist()
    return [out["output_ids"][i, :end].tolist() for i, end in enumerate(ends)]


def test_a_group_without_seeds_is_one_request_with_n_and_rows_keep_their_places() -> None:
    worker, fake = make_worker()
    prompts = [A, B, A, C, B, A]
    out = worker.generate(batch(prompts))
    assert fake.last_samples == [3, 2, 1]
    rows = _rows(out)
    for row, prompt in enumerate(prompts):
        assert rows[row][: len(prompt)] == prompt
    # the children of one request sample on their own (vLLM's n), so siblings differ
    assert len({tuple(rows[i]) for i in (0, 2, 5)}) == 3
    assert len(fake.requests) == 6  # one child per row


def test_per_sample_seeds_send_each_group_leader_first_and_match_the_per_row_path() -> None:
    worker, fake = make_worker()
    prompts = [A, B, A, B]
    seeds = [11, 12, 13, 14]
    grouped = worker.generate({**batch(prompts), "seeds": seeds})
    assert fake.last_samples is None
    assert [p for p, _ in fake.requests[-4:]] == [A, A, B, B]
    alone = [
        worker.generate({**batch([p]), "seeds": [s]}) for p, s in zip(prompts, seeds, strict=True)
    ]
    for row, single in enumerate(alone):
        assert _rows(grouped)[row] == _rows(single)[0]
        width = int(single["generation_lengths"][0])
        start = len(prompts[row])
        assert torch.equal(
            grouped["logprobs"][row, start : start + width],
            single["logprobs"][0, start : start + width],
        )


def test_declared_groups_follow_num_generations_per_prompt() -> None:
    worker, fake = make_worker()
    worker.generate({**batch([A, A, A, A]), "num_generations_per_prompt": 2})
    assert fake.last_samples == [2, 2]


def test_a_declared_group_that_does_not_fit_is_refused_naming_its_rows() -> None:
    worker, _ = make_worker()
    with pytest.raises(BadBatchError, match=r"rows \[2, 3\]") as raised:
        worker.generate({**batch([A, A, A, B]), "num_generations_per_prompt": 2})
    assert isinstance(raised.value.detail, GroupError)
    with pytest.raises(BadBatchError, match="must be an int"):
        worker.generate({**batch([A, A]), "num_generations_per_prompt": "2"})
    assert worker.generate(batch([A, A]))["output_ids"].shape[0] == 2  # still usable


def _scoring(rows: list[list[int]], prompts: list[int]) -> dict[str, torch.Tensor]:
    return {**batch(rows), "prompt_lengths": torch.tensor(prompts)}


def test_compute_logprobs_lays_out_the_given_tokens_like_generate() -> None:
    worker, fake = make_worker()
    out = worker.compute_logprobs(_scoring([A, C], [1, 2]), top_k=3)
    expected = fake.compute_logprobs([A, C], [1, 2], 3)
    assert out["logprobs"].shape == (2, 4)
    assert out["logprobs"][0, :1].eq(0).all()
    assert out["logprobs"][0, 3:].eq(0).all()
    assert out["logprobs"][0, 1:3].tolist() == pytest.approx(list(expected[0].logprobs))
    assert out["logprobs"][1, 2:].tolist() == pytest.approx(list(expected[1].logprobs))
    assert out["top_ids"].shape == (2, 4, 3)
    assert out["top_ids"][1, 2:].tolist() == [list(ids) for ids in expected[1].top_ids]
    assert out["top_ids"][1, :2].eq(PAD).all()
    assert "top_ids" not in worker.compute_logprobs(_scoring([A], [1]))


def test_compute_logprobs_refuses_bad_rows_by_row_and_stays_usable() -> None:
    worker, _ = make_worker()
    with pytest.raises(BadBatchError) as raised:
        worker.compute_logprobs(_scoring([A, [3], C], [1, 1, 4]))
    refusal = raised.value.detail
    assert isinstance(refusal, ScoreRefusal)
    assert refusal.rows == (1, 2)
    assert "row 1: prompt_length=1 is out of range" in str(raised.value)
    with pytest.raises(BadArgumentError, match="max_logprobs=20"):
        worker.compute_logprobs(_scoring([A], [1]), top_k=21)
    with pytest.raises(BadBatchError, match="must be a mapping"):
        worker.compute_logprobs([A], top_k=1)  # type: ignore[arg-type]
    assert worker.compute_logprobs(_scoring([A], [1]))["logprobs"].shape == (1, 3)
