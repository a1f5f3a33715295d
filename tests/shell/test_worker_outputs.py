"""What the workers do with the engine's bad outputs (failure-modes.md G11, G14) and with
stop ids outside the vocabulary (G6), against the fake engines.

The fakes return what vLLM returns: NaN, +inf or -inf sampled logprobs (garbage logits, a
masked token) and rows aborted part-way; the workers must refuse them with a typed error
naming the rows and serve the next call as if nothing happened. What vLLM's own output
objects convert to is tested in ``test_vllm_conversion.py`` and on the real CPU engine in
``test_vllm_engine.py``.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch
from async_helpers import async_config, collect
from helpers import base_config
from helpers import right_padded as batch

from genworker.core.counters import NONFINITE_LOGPROBS
from genworker.core.outputs import AbortedRows, NonFiniteLogprobs
from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import (
    BadConfigError,
    EngineContractError,
    GenworkerError,
    RequestAbortedError,
)
from genworker.shell.fake_async_engine import FakeAsyncEngine, FakeAsyncEngineFactory
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.worker import VllmGenerationWorker

NAN, INF = math.nan, math.inf
ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def make_worker(**config: Any) -> tuple[VllmGenerationWorker, FakeEngine]:
    factory = FakeEngineFactory(max_model_len=32)
    worker = VllmGenerationWorker(base_config(ignore_eos=True, **config), engine_factory=factory)
    return worker, factory.started[-1][1]


def reference(data: dict[str, torch.Tensor], **config: Any) -> dict[str, torch.Tensor]:
    """What a fresh worker (same seed) makes of ``data``: the outputs of a healthy call."""
    worker, _ = make_worker(**config)
    try:
        return worker.generate(data, greedy=True)
    finally:
        worker.shutdown()


def assert_same(out: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert out.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(out[key], tensor), key


def nonfinite_counters(counters: dict[str, float | list[float]]) -> dict[str, float]:
    prefix = NONFINITE_LOGPROBS + '{kind="'
    return {
        k[len(prefix) : -2]: float(v)  # type: ignore[arg-type]
        for k, v in counters.items()
        if k.startswith(prefix)
    }


# --- the sync worker --------------------------------------------------------------------


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
def test_a_row_with_non_finite_logprobs_is_refused_by_name_and_the_next_call_generates(
    value: float,
) -> None:
    worker, engine = make_worker()
    data = batch(ROWS)
    engine.next_logprobs = {1: value}
    with pytest.raises(EngineContractError, match=r"generate: rows \[1\] came back") as info:
        worker.generate(data, greedy=True)
    detail = info.value.detail
    assert isinstance(detail, NonFiniteLogprobs)
    assert detail.rows == (1,)
    assert detail.counts == (12,)  # every token of the row: max_new_tokens, ignore_eos
    assert "logprobs_mode 'raw_logprobs'" in str(info.value)
    assert_same(worker.generate(data, greedy=True), reference(data))
    worker.shutdown()


def test_minus_infinity_passes_under_processed_logprobs_and_is_counted() -> None:
    worker, engine = make_worker(logprobs_mode="processed_logprobs")
    assert engine.capabilities.logprobs_mode == "processed_logprobs"
    engine.next_logprobs = {0: -INF}
    out = worker.generate(batch(ROWS), greedy=True)
    n = int(out["generation_lengths"][0])
    assert torch.isneginf(out["logprobs"][0, 3 : 3 + n]).all()
    assert torch.isfinite(out["logprobs"][1:]).all()
    assert nonfinite_counters(worker.get_counters()) == {"nan": 0.0, "+inf": 0.0, "-inf": n}
    # NaN stays an error in a processed mode; it is counted too.
    engine.next_logprobs = {2: NAN}
    with pytest.raises(EngineContractError, match=r"rows \[2\]"):
        worker.generate(batch(ROWS), greedy=True)
    assert nonfinite_counters(worker.get_counters()) == {"nan": 12.0, "+inf": 0.0, "-inf": n}
    worker.shutdown()


def test_rows_are_named_by_their_batch_row_when_rows_before_them_were_refused() -> None:
    config = {
        "max_new_tokens": 30,
        "vllm_cfg": {"speculative_config": {"num_speculative_tokens": 3}},
    }
    worker, engine = make_worker(**config)
    data = batch([[2] * 29, [5, 6], [7, 8]])  # row 0 has no room: rows 1, 2 reach the engine
    engine.next_logprobs = {0: NAN}  # the engine's first row: batch row 1
    with pytest.raises(EngineContractError, match=r"rows \[1\] came back"):
        worker.generate(data, greedy=True)
    engine.next_finish = {1: "abort"}  # the engine's second row: batch row 2
    with pytest.raises(RequestAbortedError, match=r"rows \[2\] were aborted"):
        worker.generate(data, greedy=True)
    assert worker.last_refused_rows == (0,)
    worker.shutdown()


def test_an_aborted_row_is_refused_by_name_not_passed_as_a_natural_stop() -> None:
    worker, engine = make_worker()
    data = batch(ROWS)
    engine.next_finish = {0: "abort", 2: "abort"}
    with pytest.raises(RequestAbortedError, match=r"generate: rows \[0, 2\] were aborted") as e:
        worker.generate(data, greedy=True)
    assert isinstance(e.value.detail, AbortedRows)
    assert e.value.detail.tokens == (6, 6)  # the fake aborts a row after half its tokens
    assert_same(worker.generate(data, greedy=True), reference(data))
    worker.shutdown()


def test_generate_text_refuses_non_finite_logprobs_and_aborted_rows_then_serves() -> None:
    worker, engine = make_worker()
    data = {"prompts": ["abc", "de", "fgh"]}
    expected = worker.generate_text(data, greedy=True)
    engine.next_logprobs = {2: INF}
    with pytest.raises(EngineContractError, match=r"generate_text: rows \[2\] came back"):
        worker.generate_text(data, greedy=True)
    engine.next_finish = {1: "abort"}
    with pytest.raises(RequestAbortedError, match=r"generate_text: rows \[1\] were aborted"):
        worker.generate_text(data, greedy=True)
    assert worker.generate_text(data, greedy=True) == expected
    assert nonfinite_counters(worker.get_counters())["+inf"] == 12.0
    worker.shutdown()


def test_counters_start_at_zero_for_every_kind() -> None:
    worker, _ = make_worker()
    worker.generate(batch(ROWS), greedy=True)
    assert nonfinite_counters(worker.get_counters()) == {"nan": 0.0, "+inf": 0.0, "-inf": 0.0}
    worker.shutdown()


def test_stop_token_ids_outside_the_vocabulary_are_refused_at_load() -> None:
    factory = FakeEngineFactory(max_model_len=32, vocab_size=64)
    with pytest.raises(BadConfigError, match=r"stop_token_ids: ids \[64, 99\] are outside"):
        VllmGenerationWorker(base_config(stop_token_ids=[3, 99, 64]), engine_factory=factory)
    assert factory.started[-1][1].shut_down  # the engine it started is stopped
    worker = VllmGenerationWorker(base_config(stop_token_ids=[3, 63]), engine_factory=factory)
    assert worker.generate(batch(ROWS))["output_ids"].shape[0] == 3
    worker.shutdown()


# --- the async worker -------------------------------------------------------------------


def make_async_worker(**config: Any) -> tuple[AsyncVllmGenerationWorker, FakeAsyncEngine]:
    factory = FakeAsyncEngineFactory(max_model_len=64)
    cfg = async_config(ignore_eos=True, vllm_cfg={"max_model_len": 64}, **config)
    worker = AsyncVllmGenerationWorker(cfg, engine_factory=factory)
    return worker, factory.started[-1][1]


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
def test_the_async_worker_refuses_the_row_with_non_finite_logprobs_alone(value: float) -> None:
    async def main() -> None:
        worker, engine = make_async_worker()
        data = batch(ROWS)
        engine.next_logprobs = {tuple(ROWS[1]): value}
        items = dict(await collect(worker.generate_async(data, greedy=True)))
        error = items[1]
        assert isinstance(error, EngineContractError)
        assert isinstance(error.detail, NonFiniteLogprobs)
        assert "rows [1] came back with non-finite logprobs" in str(error)
        for row in (0, 2):
            out = items[row]
            assert not isinstance(out, GenworkerError)
            assert torch.isfinite(out["logprobs"]).all()
        # The whole-batch call raises for the row; the next call serves every row.
        engine.next_logprobs = {tuple(ROWS[2]): value}
        with pytest.raises(EngineContractError, match=r"rows \[2\]"):
            await worker.generate(data, greedy=True)
        out = await worker.generate(data, greedy=True)
        assert torch.isfinite(out["logprobs"]).all()
        assert out["generation_lengths"].tolist() == [12, 12, 12]
        await worker.shutdown()

    asyncio.run(main())


def test_the_async_worker_passes_minus_infinity_under_processed_logits_and_counts() -> None:
    async def main() -> None:
        worker, engine = make_async_worker(logprobs_mode="processed_logits")
        engine.next_logprobs = {tuple(ROWS[0]): -INF}
        out = await worker.generate(batch(ROWS), greedy=True)
        assert torch.isneginf(out["logprobs"][0, 3:15]).all()
        counters = await worker.get_counters()
        assert nonfinite_counters(counters) == {"nan": 0.0, "+inf": 0.0, "-inf": 12.0}
        engine.next_logprobs = {tuple(ROWS[0]): NAN}
        with pytest.raises(EngineContractError):
            await worker.generate(batch(ROWS), greedy=True)
        counters = await worker.get_counters()
        assert nonfinite_counters(counters) == {"nan": 12.0, "+inf": 0.0, "-inf": 12.0}
        await worker.shutdown()

    asyncio.run(main())


def test_the_async_text_path_refuses_non_finite_logprobs_for_the_row() -> None:
    async def main() -> None:
        worker, engine = make_async_worker()
        data = {"prompts": ["abc", "de"]}
        expected = await worker.generate_text(data, greedy=True)
        engine.next_logprobs = {(3, 4): NAN}  # "de"
        items = dict(await collect(worker.generate_text_async(data, greedy=True)))
        assert items[0] == {"texts": [expected["texts"][0]]}
        error = items[1]
        assert isinstance(error, EngineContractError)
        assert str(error).startswith("row 1: generate_text: request ")
        assert "12 non-finite logprobs (12 NaN, 0 +inf, 0 -inf)" in str(error)
        assert await worker.generate_text(data, greedy=True) == expected
        await worker.shutdown()

    asyncio.run(main())


def test_the_async_worker_refuses_stop_token_ids_outside_the_vocabulary_at_load() -> None:
    factory = FakeAsyncEngineFactory(max_model_len=64, vocab_size=64)
    cfg = async_config(stop_token_ids=[64], vllm_cfg={"max_model_len": 64})
    with pytest.raises(BadConfigError, match=r"stop_token_ids: ids \[64\] are outside"):
        AsyncVllmGenerationWorker(cfg, engine_factory=factory)
