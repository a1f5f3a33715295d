"""GRPO groups and compute_logprobs on the async worker over the fake engine: a group's
siblings are sent after their leader's prefill, rows still stream one by one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from async_helpers import async_config, collect, outputs
from helpers import right_padded

from genworker.core.engine_calls import RowRequest
from genworker.core.scoring import ScoreRefusal
from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import BadArgumentError, BadBatchError
from genworker.shell.fake_async_engine import FakeAsyncEngine, FakeAsyncEngineFactory
from genworker.shell.media import RowMedia
from genworker.shell.ports import StreamedGeneration

A, B = [3, 4, 5], [6, 7]


def make_worker(
    **engine: Any,
) -> tuple[AsyncVllmGenerationWorker, FakeAsyncEngine, list[list[int]]]:
    factory = FakeAsyncEngineFactory(max_model_len=64, **engine)
    cfg = async_config(max_new_tokens=6, ignore_eos=True, vllm_cfg={"max_model_len": 64})
    worker = AsyncVllmGenerationWorker(cfg, engine_factory=factory)
    fake = factory.started[0][1]
    sent: list[list[int]] = []
    inner = fake.generate

    async def recording(request: RowRequest[RowMedia], *args: Any) -> StreamedGeneration:
        sent.append(list(request.prompt))
        return await inner(request, *args)

    fake.generate = recording  # type: ignore[method-assign,assignment]
    return worker, fake, sent


@pytest.mark.parametrize("labels", [True, False])
def test_siblings_are_sent_after_their_leader_and_rows_stream_one_by_one(labels: bool) -> None:
    asyncio.run(_siblings_after_leaders(labels))


async def _siblings_after_leaders(labels: bool) -> None:
    worker, _, sent = make_worker(weight_versions=labels, prefix_caching=True)
    data = {**right_padded([A, A, B, B]), "seeds": [1, 2, 3, 4]}
    items = await collect(worker.generate_async(data))
    assert sent == [A, B, A, B]  # the leaders first, each sibling after its leader's prefill
    assert sorted(row for row, _ in items) == [0, 1, 2, 3]  # one item per row
    rows = outputs(items)
    alone = [
        await worker.generate({**right_padded([p]), "seeds": [s]})
        for p, s in zip([A, A, B, B], [1, 2, 3, 4], strict=True)
    ]
    for row, single in enumerate(alone):
        assert torch.equal(rows[row]["output_ids"], single["output_ids"])
        assert torch.equal(rows[row]["logprobs"], single["logprobs"])


def test_compute_logprobs_on_the_async_worker_matches_the_sync_layout() -> None:
    asyncio.run(_scores())


async def _scores() -> None:
    worker, _, _ = make_worker()
    data = {**right_padded([A, [3, 4, 5, 6, 7]]), "prompt_lengths": torch.tensor([1, 3])}
    out = await worker.compute_logprobs(data, top_k=2)
    assert out["logprobs"].shape == (2, 5)
    assert out["logprobs"][1, :3].eq(0).all()
    assert out["logprobs"][1, 3:].ne(0).all()
    assert out["top_ids"].shape == (2, 5, 2)
    with pytest.raises(BadBatchError) as raised:
        await worker.compute_logprobs({**right_padded([A]), "prompt_lengths": torch.tensor([3])})
    assert isinstance(raised.value.detail, ScoreRefusal)
    with pytest.raises(BadArgumentError, match="top_k"):
        await worker.compute_logprobs(data, top_k=-1)
    assert (await worker.compute_logprobs(data))["logprobs"].shape == (2, 5)
