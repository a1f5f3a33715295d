"""The async worker against the fake async engine: streams, refits in flight, versions,
cancellation, engine death, bad rows, and the lifecycle as a state machine.

The fake (``shell/fake_async_engine.py``) steps requests the way ``AsyncLLM`` does and
raises ``FakeEngineMisuse`` when the worker lets through what would go wrong in vLLM
(weights changed while requests run unpaused, a step with memory asleep, sleeping with
requests in flight). What the real engine does is tested in ``test_worker_async_engine.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import torch
from async_helpers import async_config, collect, generated, outputs, until
from helpers import base_config, right_padded
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from genworker.core import lifecycle
from genworker.core.lifecycle import TABLE, Event, InflightMode, State
from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineDeadError,
    EngineStateError,
    GenworkerError,
    RefitError,
    RefitTimeoutError,
    RequestAbortedError,
    UnsupportedError,
)
from genworker.shell.fake_async_engine import FakeAsyncEngine, FakeAsyncEngineFactory
from genworker.shell.fake_engine import FakeEngineFactory
from genworker.shell.refit.wire import failure
from genworker.shell.worker import VllmGenerationWorker

MAX_MODEL_LEN = 64


def make_worker(
    *, max_new_tokens: int = 12, cap: bool = True, **engine: Any
) -> tuple[AsyncVllmGenerationWorker, FakeAsyncEngine]:
    factory = FakeAsyncEngineFactory(max_model_len=MAX_MODEL_LEN, **engine)
    cfg = async_config(
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        vllm_cfg={"max_model_len": MAX_MODEL_LEN, "cap_max_tokens_to_context": cap},
    )
    worker = AsyncVllmGenerationWorker(cfg, engine_factory=factory)
    return worker, factory.started[0][1]


def refit_handler(engine: FakeAsyncEngine, gate: asyncio.Event | None = None, fail: bool = False):  # type: ignore[no-untyped-def]
    async def update(timeout_s: float) -> dict[str, object]:
        if gate is not None:
            await gate.wait()
        if fail:
            raise TimeoutError("the trainer vanished")
        engine.load_new_weights()
        return {"tensors": 1}

    return update


async def prepared(worker: AsyncVllmGenerationWorker) -> None:
    """``prepare_refit_info`` (every refit needs it first): one tensor, the fake's."""
    assert await worker.prepare_refit_info({"w": ([2], "float32")}) == [{"tensors": 1}]


def rows(n: int, width: int = 4, start: int = 3) -> dict[str, torch.Tensor]:
    """``n`` distinct prompts of ``width`` tokens."""
    return right_padded([[start + i, *range(10, 10 + width - 1)] for i in range(n)])


def test_the_sync_worker_refuses_the_async_engine_and_the_async_worker_the_sync_one() -> None:
    with pytest.raises(BadConfigError, match="AsyncVllmGenerationWorker"):
        VllmGenerationWorker(async_config(), engine_factory=FakeEngineFactory())
    with pytest.raises(BadConfigError, match=r"vllm_cfg\.async_engine is false"):
        AsyncVllmGenerationWorker(base_config(), engine_factory=FakeAsyncEngineFactory())


def test_the_metrics_logger_samples_the_engine_while_it_runs_and_stops_at_shutdown() -> None:
    """``vllm_cfg.enable_vllm_metrics_logger: true``: NeMo-RL's metrics thread, every
    ``vllm_metrics_logger_interval`` seconds."""

    async def main() -> None:
        factory = FakeAsyncEngineFactory(max_model_len=MAX_MODEL_LEN, step_s=0.002)
        cfg = async_config(
            max_new_tokens=40,
            ignore_eos=True,
            vllm_cfg={
                "max_model_len": MAX_MODEL_LEN,
                "enable_vllm_metrics_logger": "true",
                "vllm_metrics_logger_interval": 0.005,
            },
        )
        worker = AsyncVllmGenerationWorker(cfg, engine_factory=factory)
        await collect(worker.generate_async(rows(4)))
        # Sampled until the thread sees the stream's last token (4 rows of 40).
        await until(lambda: worker.get_vllm_logger_metrics()["generation_tokens"][-1:] == [160])
        got = worker.get_vllm_logger_metrics()
        assert set(got) == {
            "inflight_batch_sizes",
            "num_pending_samples",
            "kv_cache_usage_perc",
            "generation_tokens",
        }
        assert got["generation_tokens"] == sorted(got["generation_tokens"])
        assert len(got["generation_tokens"]) > 1
        assert max(got["inflight_batch_sizes"]) <= 4
        assert got["num_pending_samples"] == [], "the fake has no waiting gauge"
        worker.clear_vllm_logger_metrics()
        assert len(worker.get_vllm_logger_metrics()["generation_tokens"]) <= 1
        await worker.shutdown()
        with pytest.raises(UnsupportedError, match="metrics logger is off"):
            worker.get_vllm_logger_metrics()

    asyncio.run(main())


def test_the_metrics_logger_is_off_by_default_and_bad_settings_are_refused_by_name() -> None:
    worker, engine = make_worker()
    with pytest.raises(UnsupportedError, match="enable_vllm_metrics_logger: true starts it"):
        worker.get_vllm_logger_metrics()
    worker.clear_vllm_logger_metrics()  # nothing to clear: no error
    assert "metrics" not in engine.calls
    for key, value in [
        ("enable_vllm_metrics_logger", "sometimes"),
        ("vllm_metrics_logger_interval", 0),
        ("vllm_metrics_logger_interval", True),
        ("vllm_metrics_logger_interval", float("nan")),
        ("vllm_metrics_logger_interval", "1s"),
    ]:
        cfg = async_config(vllm_cfg={"enable_vllm_metrics_logger": True, key: value})
        with pytest.raises(BadConfigError, match=f"vllm_cfg.{key}"):
            AsyncVllmGenerationWorker(cfg, engine_factory=FakeAsyncEngineFactory())


def test_a_metrics_logger_whose_read_fails_stops_and_says_why() -> None:
    factory = FakeAsyncEngineFactory(max_model_len=MAX_MODEL_LEN)
    cfg = async_config(
        vllm_cfg={"enable_vllm_metrics_logger": True, "vllm_metrics_logger_interval": 0.005}
    )
    worker = AsyncVllmGenerationWorker(cfg, engine_factory=factory)
    engine = factory.started[0][1]

    def broken() -> list[object]:
        raise EngineDeadError("the engine core died")

    engine.metrics = broken  # type: ignore[method-assign,assignment]
    asyncio.run(until(lambda: worker._logger is not None and worker._logger.error is not None))
    with pytest.raises(EngineStateError, match="metrics logger stopped: EngineDeadError"):
        worker.get_vllm_logger_metrics()


# -- streams ------------------------------------------------------------------------------


def test_rows_come_back_in_completion_order_each_as_its_own_contract() -> None:
    async def main() -> None:
        worker, _ = make_worker(max_new_tokens=40)
        # Context caps: a longer prompt has less room, so it finishes sooner.
        data = right_padded([[3] * 10, [4] * 55, [5] * 40, [6] * 60])
        items = await collect(worker.generate_async(data))
        assert [row for row, _ in items] == [3, 1, 2, 0]
        for row, out in outputs(items).items():
            n = int(data["input_lengths"][row])
            g = min(40, MAX_MODEL_LEN - n)
            assert tuple(out["output_ids"].shape) == (1, n + g)
            assert out["output_ids"][0, :n].tolist() == data["input_ids"][row, :n].tolist()
            assert out["generation_lengths"].tolist() == [g]
            assert out["unpadded_sequence_lengths"].tolist() == [n + g]
            assert out["truncated"].tolist() == [True]
            assert out["weight_versions"][0, n:].tolist() == [0] * g
            assert out["weight_versions"][0, :n].tolist() == [-1] * n
        batch = await worker.generate(data)
        for row, out in outputs(items).items():
            end = int(batch["unpadded_sequence_lengths"][row])
            assert torch.equal(batch["output_ids"][row, :end], out["output_ids"][0])
            assert torch.equal(batch["logprobs"][row, :end], out["logprobs"][0])
            assert torch.equal(batch["weight_versions"][row, :end], out["weight_versions"][0])
        assert worker.state == lifecycle.AWAKE

    asyncio.run(main())


def test_bad_rows_fail_alone_and_first() -> None:
    async def main() -> None:
        worker, engine = make_worker()
        data = right_padded([[3, 4], [5, 999], [6, 7], [8] * MAX_MODEL_LEN])
        items = await collect(worker.generate_async(data))
        assert [row for row, _ in items[:2]] == [1, 3]
        for _, error in items[:2]:
            assert isinstance(error, BadBatchError)
        assert "row 1 position 1 (id 999)" in str(items[0][1])
        assert "no room to generate" in str(items[1][1])
        assert sorted(outputs(items)) == [0, 2]
        assert len(engine.finished) == 2, "the bad rows never reached the engine"
        with pytest.raises(BadBatchError, match=r"outside \[0, 64\)"):
            await worker.generate(data)

    asyncio.run(main())


def test_rows_without_room_for_the_drafter_come_back_unchanged_as_in_the_sync_worker() -> None:
    async def main() -> None:
        # Speculative decoding holds k + 1 = 3 slots back: a prompt of 62 has no room.
        worker, engine = make_worker(num_speculative_tokens=2)
        data = right_padded([[3, 4], [5] * (MAX_MODEL_LEN - 2)])
        items = await collect(worker.generate_async(data))
        assert items[0][0] == 1, "the row without room comes back first"
        out = outputs(items)
        assert out[1]["generation_lengths"].tolist() == [0]
        assert out[1]["output_ids"][0].tolist() == [5] * (MAX_MODEL_LEN - 2)
        assert out[1]["truncated"].tolist() == [False]
        assert int(out[0]["generation_lengths"][0]) == 12
        assert len(engine.finished) == 1, "only the row with room reached the engine"
        whole = await worker.generate(data)
        assert whole["generation_lengths"].tolist() == [12, 0]
        texts = await worker.generate_text({"prompts": ["ab", "c"]})
        assert [len(t) for t in texts["texts"]] == [12, 12]

    asyncio.run(main())


def test_a_batch_wrong_as_a_whole_raises_before_anything_runs() -> None:
    async def main() -> None:
        worker, engine = make_worker()
        with pytest.raises(BadBatchError, match="input_ids must be a 2-D"):
            await collect(
                worker.generate_async({"input_ids": torch.zeros(3), "input_lengths": torch.ones(3)})
            )
        with pytest.raises(BadBatchError, match=r"input_ids.*missing"):
            await collect(worker.generate_async({"input_lengths": torch.ones(3)}))
        scalar = {"input_ids": torch.tensor(3), "input_lengths": torch.tensor(1)}
        with pytest.raises(BadBatchError, match="input_ids must be a 2-D"):
            await collect(worker.generate_async({**scalar, "multi_modal_data": [None]}))
        with pytest.raises(BadArgumentError, match="greedy"):
            await collect(worker.generate_async(rows(2), greedy=1))  # type: ignore[arg-type]
        with pytest.raises(BadBatchError, match="seeds"):
            await collect(worker.generate_async({**rows(2), "seeds": [1]}))
        assert engine.calls == []
        assert worker.state == lifecycle.AWAKE

    asyncio.run(main())


def test_an_empty_batch_streams_nothing_and_generates_empty_tensors() -> None:
    async def main() -> None:
        worker, _ = make_worker()
        empty = {
            "input_ids": torch.zeros((0, 3), dtype=torch.long),
            "input_lengths": torch.zeros(0, dtype=torch.long),
        }
        assert await collect(worker.generate_async(empty)) == []
        out = await worker.generate(empty)
        assert tuple(out["output_ids"].shape) == (0, 0)
        assert tuple(out["weight_versions"].shape) == (0, 0)

    asyncio.run(main())


def test_seeds_make_rows_reproducible_and_different() -> None:
    async def main() -> None:
        worker, _ = make_worker()
        data = {**rows(1), "seeds": [7]}
        first = generated(outputs(await collect(worker.generate_async(data)))[0])[0]
        again = generated(outputs(await collect(worker.generate_async(data)))[0])[0]
        other = generated(outputs(await collect(worker.generate_async({**data, "seeds": [8]})))[0])[
            0
        ]
        assert first == again
        assert first != other

    asyncio.run(main())


def test_text_rows_are_capped_by_their_own_token_counts() -> None:
    """Text prompts are tokenized once, by the engine, before their caps (the sync
    worker's way): a row's room is max_model_len less its ids, so a prompt one token short
    of the context generates one token, and one that fills the context or passes it fails
    alone, by name (vLLM refuses a prompt of max_model_len tokens: no room for one)."""

    async def main() -> None:
        worker, engine = make_worker(max_new_tokens=60, cap=True)
        L = MAX_MODEL_LEN
        prompts = ["abcdefghij", "a" * (L - 1), "a" * L, "a" * (L + 1), "abc"]
        items = dict(await collect(worker.generate_text_async({"prompts": prompts})))
        for row, length in ((2, L), (3, L + 1)):
            error = items.pop(row)
            assert isinstance(error, BadBatchError)
            assert (
                f"prompt {row} leaves no room to generate: {length} tokens, max_model_len={L}"
                in str(error)
            )
        texts = {row: item["texts"][0] for row, item in items.items() if isinstance(item, dict)}
        # the fake makes one letter per token and one token per prompt letter
        assert sorted(texts) == [0, 1, 4]
        assert [len(texts[0]), len(texts[1]), len(texts[4])] == [L - 10, 1, 60]
        assert sorted(len(p) for p in engine.finished) == [3, 10, L - 1]
        with pytest.raises(BadBatchError, match="prompt 2 leaves no room to generate"):
            await worker.generate_text({"prompts": prompts})
        whole = await worker.generate_text({"prompts": [prompts[0], prompts[4]]})
        assert [len(t) for t in whole["texts"]] == [L - 10, 60]

    asyncio.run(main())


def test_texts_stream_and_empty_prompts_fail_alone() -> None:
    async def main() -> None:
        worker, _ = make_worker()
        items = await collect(worker.generate_text_async({"prompts": ["abc", "", "xyz"]}))
        assert items[0][0] == 1
        assert isinstance(items[0][1], BadBatchError)
        texts = {row: item["texts"][0] for row, item in items[1:] if isinstance(item, dict)}
        assert sorted(texts) == [0, 2]
        assert all(len(t) == 12 for t in texts.values())
        with pytest.raises(BadBatchError, match="prompt 1 is an empty string"):
            await worker.generate_text({"prompts": ["abc", ""]})
        assert (await worker.generate_text({"prompts": ["abc", "xyz"]}))["texts"] == [
            texts[0],
            texts[2],
        ]
        with pytest.raises(BadBatchError, match="list of str"):
            await worker.generate_text({"prompts": "abc"})

    asyncio.run(main())


# -- cancellation, death, shutdown --------------------------------------------------------


def test_a_consumer_that_stops_aborts_its_requests() -> None:
    async def main() -> None:
        worker, engine = make_worker(max_new_tokens=60, cap=True)
        data = right_padded([[3] * 60, *([[4] * 4] * 7)])
        async with contextlib.aclosing(worker.generate_async(data)) as stream:
            async for row, _ in stream:
                assert row == 0
                assert engine.num_unfinished() == 7
                break
        assert engine.num_unfinished() == 0
        assert worker.state == lifecycle.AWAKE

        task = asyncio.ensure_future(collect(worker.generate_async(data)))
        await until(lambda: engine.num_unfinished() == 8)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.num_unfinished() == 0
        assert worker.state == lifecycle.AWAKE

    asyncio.run(main())


def test_abort_requests_by_id_leaves_the_workers_own_rows_alone() -> None:
    """The server's ``/abort_requests`` names engine requests by id; the worker's own
    rows are refused by name (and run on), other ids go to the engine."""

    async def main() -> None:
        worker, engine = make_worker(max_new_tokens=60, cap=True)
        data = right_padded([[4] * 4] * 2)
        task = asyncio.ensure_future(collect(worker.generate_async(data)))
        await until(lambda: engine.num_unfinished() == 2)
        own = sorted(worker._requests)
        with pytest.raises(BadArgumentError, match=r"rows of the worker's own generate"):
            await worker.abort_requests([own[0], "cmpl-x-0"])
        assert engine.num_unfinished() == 2
        assert await worker.abort_requests(["cmpl-x-0"]) == 1
        assert len(await task) == 2
        assert engine.num_unfinished() == 0

    asyncio.run(main())


def test_engine_death_reaches_every_pending_row_typed() -> None:
    async def main() -> None:
        worker, engine = make_worker(max_new_tokens=60, cap=False)
        assert len(outputs(await collect(worker.generate_async(rows(6))))) == 6
        stream = worker.generate_async(rows(6, start=20))
        pending = asyncio.ensure_future(collect(stream))
        await until(lambda: engine.generation_tokens > 6 * 60 + 12)
        engine.kill()
        died = await pending
        assert sorted(row for row, _ in died) == list(range(6))
        assert all(isinstance(e, EngineDeadError) for _, e in died)
        assert not worker.is_alive()
        with pytest.raises(EngineDeadError, match="re-create the worker"):
            await collect(worker.generate_async(rows(1)))

    asyncio.run(main())


def test_shutdown_ends_every_stream_with_a_typed_error() -> None:
    async def main() -> None:
        worker, engine = make_worker(max_new_tokens=60, cap=False)
        pending = asyncio.ensure_future(collect(worker.generate_async(rows(3))))
        await until(lambda: engine.generation_tokens > 3)
        assert await worker.shutdown()
        items = await pending
        assert all(isinstance(e, EngineStateError) and "shut down" in str(e) for _, e in items)
        assert len(items) == 3
        assert await worker.shutdown(), "idempotent"
        with pytest.raises(EngineStateError, match="shut down"):
            await collect(worker.generate_async(rows(1)))

    asyncio.run(main())


# -- lifecycle while streaming -----------------------------------------------------------


def test_sleeping_and_resetting_the_prefix_cache_are_refused_while_streams_run() -> None:
    async def main() -> None:
        worker, engine = make_worker(max_new_tokens=60, cap=False)
        pending = asyncio.ensure_future(collect(worker.generate_async(rows(2))))
        await until(lambda: engine.generation_tokens > 0)
        assert worker.state == lifecycle.STREAMING
        for call in (worker.sleep(1), worker.sleep(2), worker.reset_prefix_cache()):
            with pytest.raises(EngineStateError, match="requests are in flight"):
                await call
        await pending
        assert worker.state == lifecycle.AWAKE
        await worker.sleep(2)
        assert worker.state == lifecycle.ASLEEP_L2
        with pytest.raises(EngineStateError, match="call wake_up"):
            await collect(worker.generate_async(rows(1)))
        for tags in ("weights", ["weights", "gpu"], [], [1]):
            with pytest.raises(BadArgumentError, match="tags"):
                await worker.wake_up(tags)  # type: ignore[arg-type]
        assert worker.state == lifecycle.ASLEEP_L2, "a refused wake_up changes nothing"
        await worker.wake_up()
        with pytest.raises(EngineStateError, match="refit"):
            await collect(worker.generate_async(rows(1)))
        assert engine.misuse is None

    asyncio.run(main())


def test_requests_of_an_outside_caller_count_as_a_stream() -> None:
    async def main() -> None:
        worker, engine = make_worker()
        async with worker.in_flight() as inside:
            assert inside is engine
            assert worker.state == lifecycle.STREAMING
            assert engine.label == "0", "the engine's weights carry the worker's version"
            with pytest.raises(EngineStateError, match="requests are in flight"):
                await worker.sleep(1)
            async with worker.in_flight():
                pass
            assert worker.state == lifecycle.STREAMING, "until the outermost one ends"
        assert worker.state == lifecycle.AWAKE
        await worker.sleep(1)
        with pytest.raises(EngineStateError, match="call wake_up"):
            async with worker.in_flight():
                pass
        assert worker.state == lifecycle.ASLEEP_L1

    asyncio.run(main())


def test_sleep_is_unsupported_where_the_engine_has_no_sleep_mode() -> None:
    async def main() -> None:
        worker, _ = make_worker(sleep_mode=False)
        with pytest.raises(UnsupportedError, match="sleep mode"):
            await worker.sleep(1)
        assert worker.state == lifecycle.AWAKE
        with pytest.raises(BadArgumentError, match="sleep level"):
            await worker.sleep(3)
        with pytest.raises(BadArgumentError, match="tags"):
            await worker.wake_up(["memory"])

    asyncio.run(main())


# -- refits in flight ---------------------------------------------------------------------


@pytest.mark.parametrize("labels", [True, False], ids=["engine-labels", "worker-counts"])
def test_an_in_flight_refit_marks_the_version_boundary_exactly(labels: bool) -> None:
    async def main() -> None:
        worker, engine = make_worker(max_new_tokens=50, cap=False, weight_versions=labels)
        gate = asyncio.Event()
        await prepared(worker)
        engine.rpc_handlers["update_weights_via_ipc_zmq"] = refit_handler(engine, gate)
        data = rows(5)
        pending = asyncio.ensure_future(collect(worker.generate_async(data, greedy=True)))
        await until(lambda: engine.generation_tokens >= 5 * 10)
        refit = asyncio.ensure_future(worker.update_weights_via_ipc_zmq(60.0))
        await until(lambda: engine.pause_mode is InflightMode.KEEP)
        assert worker.state == lifecycle.REFITTING_STREAMING
        frozen = engine.generation_tokens
        await asyncio.sleep(0.02)
        assert engine.generation_tokens == frozen, "keep: nothing steps while refitting"
        gate.set()
        assert await refit
        assert worker.weight_version == 1
        items = await pending
        assert worker.state == lifecycle.AWAKE
        for row, out in outputs(items).items():
            tokens, versions = generated(out)
            prompt = data["input_ids"][row].tolist()
            assert tuple(versions) == engine.finished[tuple(prompt)], "versions are exact"
            boundary = versions.index(1)
            assert 0 < boundary < 50
            assert versions == [0] * boundary + [1] * (50 - boundary)
            # A fresh engine on the new weights continues the prompt plus the old tokens
            # exactly as the refit engine did (greedy).
            fresh, fresh_engine = make_worker(max_new_tokens=50 - boundary, cap=False)
            fresh_engine.weight_version = 1
            cont = await fresh.generate(right_padded([prompt + tokens[:boundary]]), greedy=True)
            assert generated_tokens(cont) == tokens[boundary:]
        assert engine.misuse is None
        assert worker.last_refit["mode"] == "keep"

    asyncio.run(main())


def generated_tokens(batch: dict[str, torch.Tensor]) -> list[int]:
    start = int(batch["unpadded_sequence_lengths"][0] - batch["generation_lengths"][0])
    return batch["output_ids"][0, start:].tolist()


def test_wait_finishes_the_rows_on_the_old_weights_and_abort_drops_them() -> None:
    async def main() -> None:
        worker, engine = make_worker(max_new_tokens=30, cap=False)
        await prepared(worker)
        engine.rpc_handlers["update_weights_via_ipc_zmq"] = refit_handler(engine)
        pending = asyncio.ensure_future(collect(worker.generate_async(rows(3))))
        await until(lambda: engine.generation_tokens >= 3)
        assert await worker.update_weights_via_ipc_zmq(mode="wait")
        for out in outputs(await pending).values():
            assert set(generated(out)[1]) == {0}, "wait: finished on the old weights"

        pending = asyncio.ensure_future(collect(worker.generate_async(rows(3, start=30))))
        await until(lambda: engine.generation_tokens >= 3 * 30 + 3)
        assert await worker.update_weights_via_ipc_zmq(mode=InflightMode.ABORT)
        dropped = await pending
        assert len(dropped) == 3
        assert all(
            isinstance(e, RequestAbortedError) and "mode 'abort'" in str(e) for _, e in dropped
        )
        after = outputs(await collect(worker.generate_async(rows(2, start=40))))
        assert all(set(generated(o)[1]) == {2} for o in after.values())
        with pytest.raises(BadArgumentError, match="mode must be one of"):
            await worker.update_weights_via_ipc_zmq(mode="later")
        with pytest.raises(BadArgumentError, match="timeout_s"):
            await worker.update_weights_via_ipc_zmq(0)
        assert engine.misuse is None

    asyncio.run(main())


def test_requests_submitted_during_a_refit_queue_and_run_on_the_new_weights() -> None:
    async def main() -> None:
        worker, engine = make_worker(max_new_tokens=10, cap=False)
        gate = asyncio.Event()
        await prepared(worker)
        engine.rpc_handlers["update_weights_via_ipc_zmq"] = refit_handler(engine, gate)
        refit = asyncio.ensure_future(worker.update_weights_via_ipc_zmq())
        await until(lambda: engine.pause_mode is InflightMode.KEEP)
        assert worker.state == lifecycle.REFITTING
        queued = asyncio.ensure_future(collect(worker.generate_async(rows(2))))
        await until(lambda: engine.num_unfinished() == 2)
        assert worker.state == lifecycle.REFITTING_STREAMING
        with pytest.raises(EngineStateError, match="refit is in progress"):
            await worker.update_weights_via_ipc_zmq()
        await asyncio.sleep(0.01)
        assert engine.generation_tokens == 0
        gate.set()
        await refit
        for out in outputs(await queued).values():
            assert set(generated(out)[1]) == {1}

    asyncio.run(main())


def test_a_failed_refit_aborts_the_rows_in_flight_and_blocks_new_work_until_a_good_one() -> None:
    async def main() -> None:
        worker, engine = make_worker(max_new_tokens=60, cap=False)
        await prepared(worker)
        engine.rpc_handlers["update_weights_via_ipc_zmq"] = refit_handler(engine, fail=True)
        pending = asyncio.ensure_future(collect(worker.generate_async(rows(3))))
        await until(lambda: engine.generation_tokens >= 3)
        with pytest.raises(RefitError, match="weights are inconsistent"):
            await worker.update_weights_via_ipc_zmq()
        items = await pending
        assert len(items) == 3
        assert all(isinstance(e, RefitError) and "trainer vanished" in str(e) for _, e in items)
        assert worker.weight_version == 0
        assert worker.state == lifecycle.AWAKE_INCONSISTENT
        assert engine.pause_mode is None, "resumed"
        with pytest.raises(EngineStateError, match="refit again"):
            await collect(worker.generate_async(rows(1)))
        engine.rpc_handlers["update_weights_via_ipc_zmq"] = refit_handler(engine)
        assert await worker.update_weights_via_ipc_zmq()
        assert worker.weight_version == 1
        out = outputs(await collect(worker.generate_async(rows(1))))
        assert set(generated(out[0])[1]) == {1}

    asyncio.run(main())


def test_a_refit_needs_prepare_refit_info_and_a_collective_one_init_collective() -> None:
    """Refused before anything starts: the state, the version and the engine unchanged."""

    async def main() -> None:
        worker, engine = make_worker(accept_refits=True)
        with pytest.raises(EngineStateError, match="needs prepare_refit_info first"):
            await worker.update_weights_via_ipc_zmq()
        await prepared(worker)
        with pytest.raises(EngineStateError, match="needs init_collective first"):
            await worker.update_weights_from_collective()
        with pytest.raises(BadArgumentError, match="timeout_s"):
            await worker.init_collective(0, "127.0.0.1", 1, 2, 1, timeout_s=float("inf"))
        assert worker.weight_version == 0
        assert worker.state == lifecycle.AWAKE
        assert engine.pause_mode is None
        assert engine.calls == ["rpc:prepare_refit_info"]
        engine.rpc_handlers["init_collective"] = lambda *args: None
        await worker.init_collective(0, "127.0.0.1", 1, 2, 1, timeout_s=5.0)
        assert await worker.update_weights_from_collective(5.0)
        assert await worker.update_weights_via_ipc_zmq(None)
        assert worker.weight_version == 2

    asyncio.run(main())


def test_engine_worker_failures_come_back_typed_naming_the_worker() -> None:
    """The extension answers a failure as a value (``refit.wire.failure``); the worker
    raises it as the typed error it names, as the sync worker does."""

    async def main() -> None:
        worker, engine = make_worker()
        await prepared(worker)
        engine.rpc_handlers["update_weights_via_ipc_zmq"] = lambda timeout_s: failure(
            RefitTimeoutError("waiting for the trainer's next chunk passed 5 s")
        )
        pending = asyncio.ensure_future(collect(worker.generate_async(rows(2))))
        await until(lambda: engine.generation_tokens >= 2)
        with pytest.raises(RefitTimeoutError, match="engine worker 0: waiting for the trainer"):
            await worker.update_weights_via_ipc_zmq(5.0)
        assert all(isinstance(e, RefitError) for _, e in await pending)
        assert worker.weight_version == 0
        assert worker.state == lifecycle.AWAKE_INCONSISTENT
        engine.rpc_handlers["release_refit_buffers"] = lambda: 3
        assert await worker.release_refit_buffers() == [3]
        engine.rpc_handlers["refit_address"] = lambda: failure(RefitError("no socket"))
        with pytest.raises(RefitError, match="refit_address failed on engine worker 0"):
            await worker.refit_address()

    asyncio.run(main())


# -- the lifecycle as a state machine, concurrent streams and refits -------------------------


class AsyncWorkerMachine(RuleBasedStateMachine):
    """Streams, refits (held open by a gate), sleeps and wakes interleave on one loop; the
    worker's state must be the literal table's (``core.lifecycle.TABLE``) after the events
    it accepted, every refused call must raise ``EngineStateError``, every row must come
    back once, and every version the worker reports must be the fake's truth."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.labels = True
        self.worker, self.engine = make_worker(max_new_tokens=20, cap=False, vocab_size=1 << 20)
        self.loop.run_until_complete(prepared(self.worker))
        self.engine.allow_steps(0)  # the engine steps only in let_it_run and finish_refit
        self.model: State = lifecycle.AWAKE
        self.streams: list[tuple[asyncio.Task[list[Any]], int, dict[str, torch.Tensor]]] = []
        self.refit: asyncio.Task[bool] | None = None
        self.gate = asyncio.Event()
        self.fail_next = False
        self.prompt_base = 100

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 10))

    def apply(self, event: Event) -> bool:
        after = TABLE[self.model].get(event)
        if after is None:
            return False
        self.model = after
        return True

    def settle_model(self) -> None:
        """Fold in what finished while the loop ran: the last stream ending, a refit."""
        if self.refit is not None and self.refit.done():
            failed = self.refit.exception() is not None
            assert self.apply(Event.REFIT_FAILED if failed else Event.REFIT_OK)
            self.refit = None
        open_streams = [s for s in self.streams if not s[0].done()]
        if not open_streams and self.model.streaming:
            assert self.apply(Event.STREAMS_DONE)
        for task, n, data in [s for s in self.streams if s[0].done()]:
            self.check_rows(task.result(), n, data)
        self.streams = open_streams

    def check_rows(self, items: list[Any], n: int, data: dict[str, torch.Tensor]) -> None:
        assert sorted(row for row, _ in items) == list(range(n)), "each row once"
        for row, out in outputs(items).items():
            _, versions = generated(out)
            prompt = tuple(data["input_ids"][row].tolist())
            assert tuple(versions) == self.engine.finished[prompt]
        for _, item in items:
            if isinstance(item, GenworkerError):
                assert isinstance(item, RefitError | RequestAbortedError), item

    @rule(n=st.integers(1, 4))
    def open_stream(self, n: int) -> None:
        data = rows(n, start=self.prompt_base)
        self.prompt_base += n
        stream = self.worker.generate_async(data)
        allowed = TABLE[self.model].get(Event.STREAM_OPEN) is not None
        if not allowed:
            with pytest.raises(EngineStateError):
                self.run(collect(stream))
            return
        task = self.loop.create_task(collect(stream))
        self.run(asyncio.sleep(0))
        assert self.apply(Event.STREAM_OPEN)
        self.streams.append((task, n, data))

    @rule(mode=st.sampled_from(list(InflightMode)), fail=st.booleans())
    def begin_refit(self, mode: InflightMode, fail: bool) -> None:
        if TABLE[self.model].get(Event.REFIT_BEGIN) is None:
            with pytest.raises(EngineStateError):
                self.run(self.worker.update_weights_via_ipc_zmq(60.0, mode=mode))
            return
        self.gate = asyncio.Event()
        self.engine.rpc_handlers["update_weights_via_ipc_zmq"] = refit_handler(
            self.engine, self.gate, fail=fail
        )
        call = self.worker.update_weights_via_ipc_zmq(60.0, mode=mode)
        self.refit = self.loop.create_task(call)
        self.run(asyncio.sleep(0))
        assert self.apply(Event.REFIT_BEGIN)

    @precondition(lambda self: self.refit is not None)
    @rule()
    def finish_refit(self) -> None:
        self.gate.set()
        assert self.refit is not None
        self.engine.allow_steps(None)  # a refit in mode wait lets the rows finish first
        with contextlib.suppress(RefitError):
            self.run(self.refit)
        self.engine.allow_steps(0)

    @rule(steps=st.integers(1, 25))
    def let_it_run(self, steps: int) -> None:
        self.engine.allow_steps(steps)
        self.run(asyncio.sleep(0.02))
        self.engine.allow_steps(0)
        self.run(asyncio.sleep(0.002))

    @precondition(lambda self: bool(self.streams))
    @rule(data=st.data())
    def cancel_a_stream(self, data: st.DataObject) -> None:
        task = data.draw(st.sampled_from([t for t, _, _ in self.streams]))
        task.cancel()
        self.run(settled([task]))
        self.streams = [s for s in self.streams if s[0] is not task]

    @rule(level=st.sampled_from([1, 2]))
    def sleep(self, level: int) -> None:
        event = Event.SLEEP_L1 if level == 1 else Event.SLEEP_L2
        if TABLE[self.model].get(event) is None:
            with pytest.raises(EngineStateError):
                self.run(self.worker.sleep(level))
            return
        self.run(self.worker.sleep(level))
        assert self.apply(event)

    @rule(tag=st.sampled_from([None, "weights", "kv_cache"]))
    def wake_up(self, tag: str | None) -> None:
        event = {None: Event.WAKE_ALL, "weights": Event.WAKE_WEIGHTS}.get(tag, Event.WAKE_KV_CACHE)
        tags = None if tag is None else [tag]
        if TABLE[self.model].get(event) is None:
            with pytest.raises(EngineStateError):
                self.run(self.worker.wake_up(tags))
            return
        self.run(self.worker.wake_up(tags))
        assert self.apply(event)

    @rule()
    def reset_prefix_cache(self) -> None:
        if TABLE[self.model].get(Event.RESET_PREFIX_CACHE) is None:
            with pytest.raises(EngineStateError):
                self.run(self.worker.reset_prefix_cache())
            return
        self.run(self.worker.reset_prefix_cache())

    @invariant()
    def the_worker_is_where_the_table_says(self) -> None:
        self.run(asyncio.sleep(0))
        self.settle_model()
        assert self.worker.state == self.model, (self.worker.state, self.model)
        assert self.engine.misuse is None

    def teardown(self) -> None:
        try:
            self.gate.set()
            self.engine.allow_steps(None)
            for task, _, _ in self.streams:
                task.cancel()
            tasks = [t for t, _, _ in self.streams]
            self.run(settled(tasks if self.refit is None else [*tasks, self.refit]))
            self.run(self.worker.shutdown())
        finally:
            self.loop.close()


async def settled(tasks: list[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


AsyncWorkerMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=20, deadline=None
)
test_the_lifecycle_with_concurrent_streams_and_refits = AsyncWorkerMachine.TestCase


@pytest.fixture(autouse=True)
def _no_leaked_loops() -> Iterator[None]:
    yield
    asyncio.set_event_loop(None)


# -- a failed sleep or wake is fatal for the engine (S1/S2), as in the sync worker --------

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


@pytest.mark.parametrize("call", ["sleep", "wake_up"])
def test_a_failed_sleep_or_wake_is_fatal_and_every_later_call_is_refused(call: str) -> None:
    """As ``VllmGenerationWorker``: EngineDeadError with the engine's error as its cause,
    every later call refused without touching the engine (the fake's KV cache is left
    asleep), and shutdown still stops it."""

    async def main() -> None:
        worker, engine = make_worker()
        if call == "wake_up":
            await worker.sleep(1)
        engine.fail_call, engine.fail_next = call, RuntimeError(CUDA_OOM)
        with pytest.raises(EngineDeadError, match="out of memory") as info:
            await (worker.sleep(1) if call == "sleep" else worker.wake_up())
        assert isinstance(info.value.__cause__, RuntimeError)
        assert engine.calls[-1].startswith(call), "the engine's own call failed"
        assert not worker.is_alive()
        seen = list(engine.calls)
        with pytest.raises(EngineDeadError, match="re-create the worker"):
            await collect(worker.generate_async(rows(1)))
        later: list[Callable[[], Awaitable[object]]] = [
            lambda: worker.generate(rows(1)),
            lambda: worker.generate_text({"prompts": ["ab"]}),
            lambda: worker.sleep(2),
            lambda: worker.wake_up(),
            lambda: worker.reset_prefix_cache(),
            lambda: worker.report_device_id(),
            lambda: worker.get_counters(),
        ]
        for refused in later:
            with pytest.raises(EngineDeadError, match="re-create the worker"):
                await refused()
        assert engine.calls == seen, "no later call reached the engine"
        assert "generate" not in engine.calls
        assert await worker.shutdown()
        assert engine.shut_down
        assert worker.state == lifecycle.SHUT_DOWN

    asyncio.run(main())


def test_a_failed_prefix_cache_reset_before_a_sleep_is_not_fatal() -> None:
    """Only the sleep itself touches the engine's memory: a refused reset before it leaves
    the worker where it was."""

    async def main() -> None:
        worker, engine = make_worker()
        engine.fail_call = "reset_prefix_cache"
        engine.fail_next = EngineStateError("reset_prefix_cache: vLLM kept the cache")
        with pytest.raises(EngineStateError, match="kept the cache"):
            await worker.sleep(1)
        assert worker.is_alive()
        assert worker.state == lifecycle.AWAKE
        assert "sleep(1)" not in engine.calls
        await worker.generate(rows(1))
        await worker.sleep(1)
        assert worker.state == lifecycle.ASLEEP_L1

    asyncio.run(main())


def test_a_wake_after_which_the_engine_is_not_fully_awake_is_fatal() -> None:
    """As the sync worker's: the KV cache woken behind the worker's back, its wake_up()
    names it, the engine drops the call (vllm#31618) and says it is not fully awake."""

    async def main() -> None:
        worker, engine = make_worker()
        await worker.sleep(1)
        await engine.wake_up(["kv_cache"])  # behind the worker's back
        with pytest.raises(EngineDeadError, match="not fully awake"):
            await worker.wake_up()
        assert engine.awake_tags == {"kv_cache"}
        assert not worker.is_alive()
        with pytest.raises(EngineDeadError, match="re-create the worker"):
            await collect(worker.generate_async(rows(1)))
        assert "generate" not in engine.calls
        assert await worker.shutdown()

    asyncio.run(main())


def test_refusals_of_a_sleep_or_wake_are_not_fatal() -> None:
    async def main() -> None:
        worker, engine = make_worker()
        with pytest.raises(BadArgumentError, match="sleep level"):
            await worker.sleep(3)
        with pytest.raises(BadArgumentError, match="tags"):
            await worker.wake_up(["gpu"])
        engine.fail_call, engine.fail_next = "sleep", UnsupportedError("sleep: not here")
        with pytest.raises(UnsupportedError, match="not here"):
            await worker.sleep(1)
        assert worker.is_alive()
        assert worker.state == lifecycle.AWAKE
        await worker.generate(rows(1))
        assert engine.misuse is None

    asyncio.run(main())
