"""The sync worker runs one call at a time (``shell/engine_lock.py``), against a fake engine
whose ``generate`` can be held open: waiting callers run after it, a bounded wait refuses
with ``EngineStateError`` and changes nothing, and the engine never sees two calls at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import base_config
from helpers import right_padded as batch

from genworker.core import lifecycle
from genworker.core.assembly import FlatGenerations
from genworker.core.engine_calls import Cache, EngineBatch
from genworker.shell.engine_lock import EngineLock
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    EngineStateError,
    GenerationAbortedError,
)
from genworker.shell.fake_engine import FakeEngine
from genworker.shell.media import RowMedia
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 20.0


class GatedEngine(FakeEngine):
    """A fake whose calls record overlap, and whose ``generate`` can be held open."""

    def __init__(self) -> None:
        super().__init__(max_model_len=32)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self.log: list[str] = []
        self._count = threading.Lock()
        self.rpc_handlers["update_weights_via_ipc_zmq"] = lambda timeout_s: self._note("refit")
        self.on_generate: Callable[[], object] | None = None

    def _note(self, what: str) -> None:
        self.log.append(what)

    def _around(self, what: str, fn: Callable[[], Any]) -> Any:
        with self._count:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            self.log.append(f"{what} start")
            result = fn()
            self.log.append(f"{what} end")
            return result
        finally:
            with self._count:
                self.inside -= 1

    def generate(self, batch: EngineBatch[RowMedia], *, use_tqdm: bool = False) -> FlatGenerations:
        def run() -> FlatGenerations:
            self.entered.set()
            assert self.gate.wait(DEADLINE_S), "the test never released generate"
            if self.on_generate is not None:
                self.on_generate()
            time.sleep(0.001)  # give a racing caller the chance to overlap
            return super(GatedEngine, self).generate(batch, use_tqdm=use_tqdm)

        result: FlatGenerations = self._around("generate", run)
        return result

    def metrics(self) -> Any:
        return self._around("metrics", super().metrics)

    def reset_cache(self, cache: Cache) -> None:
        self._around(cache.call, lambda: super(GatedEngine, self).reset_cache(cache))


@pytest.fixture
def gated() -> Iterator[tuple[VllmGenerationWorker, GatedEngine]]:
    engine = GatedEngine()
    worker = VllmGenerationWorker(
        base_config(), engine_factory=ExistingEngine(engine), busy_wait_s=DEADLINE_S
    )
    worker.prepare_refit_info({"w": ((2,), "float32")})  # what a refit needs first
    yield worker, engine
    engine.gate.set()


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``fn`` on a thread; its result or exception lands in the list."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            box.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def joined(thread: threading.Thread) -> None:
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "HUNG: the call did not return within the deadline"


DATA = batch([[5, 6, 7], [8, 9]])


@pytest.mark.parametrize("wait_s", [float("nan"), float("inf"), -1.0, "5", True, None])
def test_the_wait_bound_is_a_finite_non_negative_number(wait_s: Any) -> None:
    with pytest.raises(BadArgumentError, match="busy_wait_s"):
        EngineLock(wait_s)
    with pytest.raises(BadArgumentError, match="busy_wait_s"):
        VllmGenerationWorker(
            base_config(), engine_factory=ExistingEngine(FakeEngine()), busy_wait_s=wait_s
        )


def test_concurrent_generates_each_get_their_serial_result(
    gated: tuple[VllmGenerationWorker, GatedEngine],
) -> None:
    worker, engine = gated
    expected = worker.generate(DATA, greedy=True)
    threads = [in_thread(lambda: worker.generate(DATA, greedy=True)) for _ in range(6)]
    for thread, _ in threads:
        joined(thread)
    for _, (out,) in threads:
        assert isinstance(out, dict)
        for key, value in expected.items():
            assert torch.equal(out[key], value), key
    assert engine.most_inside == 1


def test_a_refit_during_a_generate_waits_for_it_and_runs_after(
    gated: tuple[VllmGenerationWorker, GatedEngine],
) -> None:
    worker, engine = gated
    engine.gate.clear()
    gen, gen_box = in_thread(lambda: worker.generate(DATA))
    assert engine.entered.wait(DEADLINE_S)
    refit, refit_box = in_thread(lambda: worker.update_weights_via_ipc_zmq(timeout_s=5.0))
    time.sleep(0.2)
    assert refit.is_alive()  # waiting for the lock, not running under the forward
    assert "refit" not in engine.log
    engine.gate.set()
    joined(gen)
    joined(refit)
    assert isinstance(gen_box[0], dict)
    assert refit_box == [True]
    assert engine.log.index("generate end") < engine.log.index("refit")
    assert worker.state == lifecycle.AWAKE


@pytest.mark.parametrize(
    "call",
    ["generate", "get_counters", "reset_prefix_cache", "refit", "sleep", "shutdown"],
)
def test_a_call_that_waits_too_long_is_refused_and_changes_nothing(call: str) -> None:
    engine = GatedEngine()
    worker = VllmGenerationWorker(
        base_config(), engine_factory=ExistingEngine(engine), busy_wait_s=0.2
    )
    worker.prepare_refit_info({"w": ((2,), "float32")})
    calls: dict[str, Callable[[], object]] = {
        "generate": lambda: worker.generate(DATA),
        "get_counters": worker.get_counters,
        "reset_prefix_cache": worker.reset_prefix_cache,
        "refit": lambda: worker.update_weights_via_ipc_zmq(timeout_s=5.0),
        "sleep": lambda: worker.sleep(1),
        "shutdown": worker.shutdown,
    }
    engine.gate.clear()
    gen, gen_box = in_thread(lambda: worker.generate(DATA, greedy=True))
    assert engine.entered.wait(DEADLINE_S)
    before = list(engine.log)
    started = time.monotonic()
    with pytest.raises(EngineStateError, match=r"busy with generate\(\) \(running for") as info:
        calls[call]()
    assert 0.2 <= time.monotonic() - started < DEADLINE_S
    assert "waited 0.2 s (busy_wait_s)" in str(info.value)
    assert engine.log == before  # the refused call reached nothing
    assert worker.state == lifecycle.AWAKE
    assert worker.is_alive()
    engine.gate.set()
    joined(gen)
    assert isinstance(gen_box[0], dict)
    serial = worker.generate(DATA, greedy=True)
    assert torch.equal(serial["output_ids"], gen_box[0]["output_ids"])


def test_wait_zero_refuses_at_once() -> None:
    engine = GatedEngine()
    worker = VllmGenerationWorker(
        base_config(), engine_factory=ExistingEngine(engine), busy_wait_s=0
    )
    engine.gate.clear()
    gen, _ = in_thread(lambda: worker.generate(DATA))
    assert engine.entered.wait(DEADLINE_S)
    started = time.monotonic()
    with pytest.raises(EngineStateError, match="waited 0 s"):
        worker.get_counters()
    assert time.monotonic() - started < 1.0
    engine.gate.set()
    joined(gen)
    assert worker.get_counters()


def test_a_call_from_inside_a_call_on_the_same_thread_is_refused_at_once(
    gated: tuple[VllmGenerationWorker, GatedEngine],
) -> None:
    worker, engine = gated
    inner: list[BaseException] = []

    def reenter() -> None:
        try:
            worker.get_counters()
        except EngineStateError as e:
            inner.append(e)

    engine.on_generate = reenter
    started = time.monotonic()
    worker.generate(DATA)
    assert time.monotonic() - started < DEADLINE_S / 2
    assert len(inner) == 1
    assert "get_counters: called from inside generate() on the same thread" in str(inner[0])


def test_an_engine_call_without_the_lock_is_a_bug(
    gated: tuple[VllmGenerationWorker, GatedEngine],
) -> None:
    worker, _ = gated
    with pytest.raises(RuntimeError, match="without the worker's lock"):
        worker._call(lambda e: e.metrics())


def test_an_aborted_batch_leaves_the_worker_serving(
    gated: tuple[VllmGenerationWorker, GatedEngine],
) -> None:
    worker, engine = gated
    expected = worker.generate(DATA, greedy=True)
    engine.fail_next = GenerationAbortedError("generate: the engine raised; requests aborted")
    with pytest.raises(GenerationAbortedError):
        worker.generate(DATA)
    assert worker.is_alive()
    assert worker.state == lifecycle.AWAKE
    assert torch.equal(worker.generate(DATA, greedy=True)["output_ids"], expected["output_ids"])


@pytest.mark.parametrize("data", [None, "prompts", ["a", "b"], 3, b"x"])
def test_non_mapping_data_is_a_typed_error_naming_the_input(
    data: Any, gated: tuple[VllmGenerationWorker, GatedEngine]
) -> None:
    worker, engine = gated
    with pytest.raises(BadBatchError, match=r"generate_text: data must be a mapping, got "):
        worker.generate_text(data)
    with pytest.raises(BadBatchError, match=r"generate: data must be a mapping, got "):
        worker.generate(data)
    assert engine.log == []
    assert worker.generate(DATA)["output_ids"].shape[0] == 2
