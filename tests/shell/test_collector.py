"""``defer_cyclic_gc``: no cyclic collection inside a generate call, one young collection
at its end, the collector's state restored whatever happens; the worker's generate
running under it (fake engine)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import base_config, right_padded

from genworker.shell.collector import defer_cyclic_gc
from genworker.shell.errors import BadBatchError, EngineDeadError
from genworker.shell.fake_engine import FakeEngine
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generation of every cyclic collection that starts while the test runs."""
    started: list[int] = []

    def hook(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(hook)
    try:
        yield started
    finally:
        gc.callbacks.remove(hook)


class _Node:
    """A weak-referenceable object to put in a reference cycle."""

    def __init__(self) -> None:
        self.me = self


def test_no_collection_inside_one_young_collection_at_the_end(collections: list[int]) -> None:
    assert gc.isenabled()
    with defer_cyclic_gc():
        collections.clear()  # whatever ran before the block
        assert not gc.isenabled()
        garbage = [_Node() for _ in range(20_000)]  # far past the young threshold
        ref = weakref.ref(garbage[0])
        del garbage
        inside = list(collections)
        assert ref() is not None  # cyclic garbage waits: no collection ran
    after = list(collections)
    assert inside == []
    assert after == [0]
    assert gc.isenabled()
    assert ref() is None  # the call's cyclic garbage was reclaimed at its end


def test_gc_state_is_restored_when_the_block_raises(collections: list[int]) -> None:
    def fail() -> None:
        collections.clear()  # whatever ran before the block
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), defer_cyclic_gc():
        fail()
    assert gc.isenabled()
    assert collections == [0]


def test_a_disabled_collector_stays_disabled_and_is_not_run(collections: list[int]) -> None:
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="boom"), defer_cyclic_gc():
            raise RuntimeError("boom")
        with defer_cyclic_gc():
            pass
        assert not gc.isenabled()
        assert collections == []
    finally:
        gc.enable()


# --- the worker's generate ---


def _spied_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[VllmGenerationWorker, FakeEngine, list[bool]]:
    """A worker over a fake engine whose generate records whether the collector is on."""
    engine = FakeEngine(max_model_len=32)
    worker = VllmGenerationWorker(base_config(), engine_factory=ExistingEngine(engine))
    seen: list[bool] = []
    original = engine.generate

    def generate(batch: Any, **options: Any) -> Any:
        seen.append(gc.isenabled())
        return original(batch, **options)

    monkeypatch.setattr(engine, "generate", generate)
    return worker, engine, seen


def test_the_worker_generates_with_the_collector_off(
    monkeypatch: pytest.MonkeyPatch, collections: list[int]
) -> None:
    worker, _, seen = _spied_worker(monkeypatch)
    data = right_padded([[3, 4], [5]])
    gc.collect(0)  # the young count starts from zero: nothing runs before the call's
    collections.clear()
    out = worker.generate(data, greedy=True)
    assert seen == [False]
    assert gc.isenabled()
    assert collections == [0]  # only the deferred young collection, at the end
    assert out["output_ids"].shape[0] == 2


@pytest.mark.parametrize("enabled", [True, False], ids=["gc-on", "gc-off"])
@pytest.mark.parametrize("failure", ["bad-batch", "engine-dies"])
def test_the_worker_restores_the_collector_when_generate_raises(
    monkeypatch: pytest.MonkeyPatch, enabled: bool, failure: str
) -> None:
    worker, engine, seen = _spied_worker(monkeypatch)
    data = right_padded([[3, 4]])
    error: type[Exception] = BadBatchError
    if failure == "bad-batch":
        data["input_lengths"][0] = 7  # past the width: refused before the engine call
    else:
        engine.fail_next = EngineDeadError("the fake engine died")
        error = EngineDeadError
    if not enabled:
        gc.disable()
    try:
        with pytest.raises(error):
            worker.generate(data)
        assert gc.isenabled() is enabled
        assert seen == ([] if failure == "bad-batch" else [False])
    finally:
        gc.enable()
