"""One contract for both workers: {sync, async} x {fake engine, real CPU engine}.

Both workers are drive loops over one spine (``shell.spine``) and one request plan
(``core.requests``); these tests hold them to the same contract, on the fakes and on vLLM:
generate / generate_text outputs, sleep and wake with their cache resets, a refit and a
failed refit, typed errors for bad batches and RPCs; and the two workers give equal rows
for equal seeds on the same model.

Real-engine cases share the session's sync engine (``cpu_engine``) and ONE ``AsyncLLM``
started for this module (the host has 2 cores); each case gets a fresh worker on them.
On CPU vLLM has no sleep mode: there the contract is the typed refusal, nothing changed.
The fakes generate differently from each other (``fake_engine`` draws a row at once,
``fake_async_engine`` token by token), so "equal rows for equal seeds" across the two
fronts is checked on the real engine, where both run the same model.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs
import pytest
import torch
from async_helpers import collect, own_prometheus_metrics, run_soon, sending
from helpers import cpu_engine_config, right_padded
from safetensors.torch import load_file

from genworker.core import lifecycle
from genworker.core.batch import BatchError
from genworker.core.stops import StopMode
from genworker.shell.async_worker import AsyncVllmGenerationWorker, ExistingAsyncEngine
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    EngineRpcError,
    EngineStateError,
    GenworkerError,
    RefitError,
    UnsupportedError,
)
from genworker.shell.fake_async_engine import FakeAsyncEngine, FakeAsyncEngineFactory
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

_T = TypeVar("_T")
Worker = VllmGenerationWorker | AsyncVllmGenerationWorker

PAD = 2  # the tiny model's <pad>; the fakes take any pad
VOCAB = 512
MAX_MODEL_LEN = 64


def config(*, async_engine: bool, model: str = "fake-model", **top: Any) -> dict[str, Any]:
    return cpu_engine_config(
        async_engine=async_engine,
        model=model,
        max_model_len=MAX_MODEL_LEN,
        max_new_tokens=8,
        pad=PAD,
        **top,
    )


@attrs.define
class Harness:
    """One worker of the contract and how to drive it: ``call`` runs a method to its end
    on either front; ``refit(ok)`` runs a refit that succeeds or fails."""

    worker: Worker
    loop: asyncio.AbstractEventLoop
    refit: Callable[[bool], object]
    real: bool
    fake: FakeEngine | FakeAsyncEngine | None = None

    def call(self, name: str, *args: object, **kwargs: object) -> Any:
        result = getattr(self.worker, name)(*args, **kwargs)
        return self.run(result) if inspect.isawaitable(result) else result

    def run(self, awaitable: Awaitable[_T]) -> _T:
        return run_soon(self.loop, awaitable)


# -- the four workers ---------------------------------------------------------------------
def _fake_refits(engine: FakeEngine | FakeAsyncEngine, ok: bool) -> None:
    def update(timeout_s: float) -> dict[str, object]:
        if not ok:
            raise TimeoutError("the trainer vanished")
        engine.load_new_weights()
        return {"tensors": 1}

    async def update_async(timeout_s: float) -> dict[str, object]:
        return update(timeout_s)

    handler = update_async if isinstance(engine, FakeAsyncEngine) else update
    engine.rpc_handlers["update_weights_via_ipc_zmq"] = handler


def _fake(
    front: str, loop: asyncio.AbstractEventLoop, top: dict[str, Any] | None = None, **engine: Any
) -> Harness:
    """A worker of ``front`` on its fake engine; ``top``: config keys over the contract's."""
    if front == "sync":
        factory = FakeEngineFactory(max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, **engine)
        worker: Worker = VllmGenerationWorker(
            config(async_engine=False, **(top or {})), engine_factory=factory
        )
    else:
        async_factory = FakeAsyncEngineFactory(
            max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, **engine
        )
        worker = AsyncVllmGenerationWorker(
            config(async_engine=True, **(top or {})), engine_factory=async_factory
        )
        factory = async_factory  # type: ignore[assignment]
    fake = factory.started[-1][1]
    harness = Harness(worker, loop, lambda ok: None, real=False, fake=fake)

    def refit(ok: bool) -> object:
        _fake_refits(fake, ok)
        return harness.call("update_weights_via_ipc_zmq", 5.0)

    harness.refit = refit
    harness.call("prepare_refit_info", {"w": ([2], "float32")})
    return harness


@pytest.fixture(scope="module")
def weights(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    """The tiny model's own weights: a refit with them leaves the shared engine as it was."""
    return load_file(tiny_model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def async_engine(
    tiny_model_dir: Path, loop: asyncio.AbstractEventLoop, cpu_engine: object
) -> Iterator[AsyncVllmGenerationWorker]:
    """The module's one AsyncLLM (started after the session's sync engine), held by a
    worker that stops it at the end."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with own_prometheus_metrics():
        owner = AsyncVllmGenerationWorker(config(async_engine=True, model=str(tiny_model_dir)))
        try:
            yield owner
        finally:
            run_soon(loop, owner.shutdown())


def _real(
    front: str,
    loop: asyncio.AbstractEventLoop,
    request: pytest.FixtureRequest,
    weights: dict[str, torch.Tensor],
) -> Harness:
    if front == "sync":
        engine = request.getfixturevalue("cpu_engine")
        worker: Worker = VllmGenerationWorker(
            config(async_engine=False), engine_factory=ExistingEngine(engine)
        )
    else:
        owner = request.getfixturevalue("async_engine")
        worker = AsyncVllmGenerationWorker(
            config(async_engine=True), engine_factory=ExistingAsyncEngine(owner.engine)
        )
    harness = Harness(worker, loop, lambda ok: None, real=True)

    def refit(ok: bool) -> object:
        (address,) = harness.call("refit_address")
        sent = weights if ok else dict(list(weights.items())[1:])  # one tensor short
        with sending(str(address), sent):
            return harness.call("update_weights_via_ipc_zmq", 60.0)

    harness.refit = refit
    harness.call("prepare_refit_info", {n: (list(t.shape), t.dtype) for n, t in weights.items()})
    return harness


@pytest.fixture(params=["sync", "async"])
def front(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(
    params=["fake", pytest.param("real", marks=[pytest.mark.engine, pytest.mark.session_engine])]
)
def harness(
    request: pytest.FixtureRequest, front: str, loop: asyncio.AbstractEventLoop
) -> Iterator[Harness]:
    if request.param == "fake":
        h = _fake(front, loop)
    else:
        h = _real(front, loop, request, request.getfixturevalue("weights"))
    yield h
    if h.real:
        h.call("reset_prefix_cache")  # the shared engines, as the next case expects them
    else:
        h.call("shutdown")


def batch(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    return right_padded(rows, pad=PAD)


# -- the contract -------------------------------------------------------------------------
def test_generate_returns_the_output_contract(harness: Harness) -> None:
    data = batch([3, 7, 5])
    out = harness.call("generate", data, greedy=True)
    assert set(out) >= {
        "output_ids",
        "logprobs",
        "generation_lengths",
        "unpadded_sequence_lengths",
        "truncated",
        "weight_versions",
    }
    assert out["output_ids"].dtype == data["input_ids"].dtype
    for i, n in enumerate(data["input_lengths"].tolist()):
        g = int(out["generation_lengths"][i])
        assert g == 8, "ignore_eos: every row generates max_new_tokens"
        assert out["output_ids"][i, :n].tolist() == data["input_ids"][i, :n].tolist()
        assert int(out["unpadded_sequence_lengths"][i]) == n + g
        assert (out["output_ids"][i, n + g :] == PAD).all()
        assert (out["logprobs"][i, :n] == 0).all()
        assert set(out["weight_versions"][i, n : n + g].tolist()) == {0}
    assert harness.worker.last_refused_rows == ()
    assert harness.worker.state == lifecycle.AWAKE


def test_generate_text_returns_one_text_per_prompt(harness: Harness) -> None:
    out = harness.call("generate_text", {"prompts": ["hello there", "a b c"]}, greedy=True)
    assert list(out) == ["texts"]
    assert len(out["texts"]) == 2
    assert all(isinstance(t, str) and t for t in out["texts"])
    assert harness.call("generate_text", {"prompts": []}) == {"texts": []}


def test_equal_seeds_give_equal_rows(harness: Harness) -> None:
    """Seeded sampling: a row is the same alone and in a batch, and twice."""
    rows = batch([4, 6, 4], seed=3)
    data = {**rows, "seeds": [11, 12, 11]}
    first = harness.call("generate", data)
    again = harness.call("generate", data)
    assert torch.equal(first["output_ids"], again["output_ids"])
    alone = harness.call(
        "generate", {**right_padded([rows["input_ids"][1, :6].tolist()], pad=PAD), "seeds": [12]}
    )
    g = int(alone["generation_lengths"][0])
    assert first["output_ids"][1, : 6 + g].tolist() == alone["output_ids"][0, : 6 + g].tolist()


def test_sleep_and_wake_reset_the_caches(harness: Harness) -> None:
    worker = harness.worker
    harness.call("generate", batch([4]))
    before = dict(worker.cache_resets)
    if harness.real:  # vLLM on CPU has no sleep mode: refused, typed, nothing changed
        with pytest.raises(UnsupportedError, match="sleep"):
            harness.call("sleep", 1)
        assert worker.state == lifecycle.AWAKE
        harness.call("reset_prefix_cache")
        assert worker.cache_resets["prefix"] == before["prefix"] + 1
        return
    assert harness.fake is not None
    engine_resets = harness.fake.prefix_cache_resets
    harness.call("sleep", 1)
    assert worker.state == lifecycle.ASLEEP_L1
    assert worker.cache_resets["prefix"] == before["prefix"] + 1
    assert harness.fake.prefix_cache_resets == engine_resets + 1
    harness.call("wake_up", ["weights"])
    harness.call("wake_up")
    assert worker.state == lifecycle.AWAKE
    harness.call("sleep", 1)  # no request since the last reset: the caches are known empty
    assert worker.cache_resets["prefix"] == before["prefix"] + 1
    harness.call("wake_up")
    counters = harness.call("get_counters")
    assert counters['genworker:cache_resets{cache="prefix"}'] == before["prefix"] + 1


@pytest.mark.parametrize("front_name", ["sync", "async"])
def test_sleep_resets_the_media_caches_on_a_multimodal_engine(
    front_name: str, loop: asyncio.AbstractEventLoop
) -> None:
    """The difference the spine settled: the async sleep resets what the sync one does."""
    harness = _fake(front_name, loop, image_token_id=7)
    harness.call("generate", batch([4]))
    harness.call("sleep", 2)
    assert harness.worker.cache_resets == {"prefix": 1, "mm": 1, "encoder": 1}
    assert harness.fake is not None
    assert (harness.fake.mm_cache_resets, harness.fake.encoder_cache_resets) == (1, 1)
    harness.call("shutdown")


def test_a_refit_and_a_failed_refit(harness: Harness) -> None:
    worker = harness.worker
    assert harness.refit(True) is True
    assert worker.weight_version == 1
    assert worker.state == lifecycle.AWAKE
    assert "engine_workers" in worker.last_refit
    with pytest.raises(RefitError):
        harness.refit(False)
    assert worker.weight_version == 1, "a failed refit leaves the version alone"
    assert worker.state == lifecycle.AWAKE_INCONSISTENT
    with pytest.raises(EngineStateError):
        harness.call("generate", batch([4]))
    assert harness.refit(True) is True
    out = harness.call("generate", batch([4]))
    assert set(out["weight_versions"][0, 4:12].tolist()) == {2}


def test_bad_batches_get_typed_errors(harness: Harness) -> None:
    good = batch([3, 4])
    with pytest.raises(BadBatchError, match=r"data\['input_ids'\] is missing"):
        harness.call("generate", {"input_lengths": good["input_lengths"]})
    with pytest.raises(BadArgumentError, match="greedy must be a bool"):
        harness.call("generate", good, greedy="yes")
    with pytest.raises(BadBatchError, match="seeds") as seeds:
        harness.call("generate", {**good, "seeds": [1]})
    assert isinstance(seeds.value.detail, BatchError)
    with pytest.raises(BadBatchError, match="stop_strings"):
        harness.call("generate", {**good, "stop_strings": [["a"]]})
    with pytest.raises(BadBatchError, match="not right-padded"):
        harness.call("generate", {**good, "input_ids": good["input_ids"] + 5})
    with pytest.raises(BadBatchError, match="must be a list of str"):
        harness.call("generate_text", {"prompts": "one prompt"})
    with pytest.raises(BadBatchError, match="empty string"):
        harness.call("generate_text", {"prompts": ["a", ""]})
    with pytest.raises(BadArgumentError, match="wake_up tags"):
        harness.call("wake_up", ["gpu"])
    with pytest.raises(BadArgumentError, match="sleep level"):
        harness.call("sleep", 3)
    assert harness.worker.state == lifecycle.AWAKE, "a refused call changes nothing"


def test_rpc_failures_are_refit_errors_only_for_refit_methods(front: str, loop: Any) -> None:
    harness = _fake(front, loop)
    assert harness.fake is not None

    def broken(*args: object) -> object:
        raise OSError("the socket went away")

    for method in ("report_weights_crc", "refit_address"):
        harness.fake.rpc_handlers[method] = broken
    with pytest.raises(EngineRpcError, match="report_weights_crc failed") as plain:
        harness.call("call_engine_workers", "report_weights_crc")
    assert not isinstance(plain.value, RefitError)
    with pytest.raises(RefitError, match="refit_address failed"):
        harness.call("refit_address")
    assert isinstance(plain.value, GenworkerError)
    assert isinstance(plain.value.__cause__, OSError)
    harness.call("shutdown")


def test_the_config_s_stop_mode_and_accepted_unknown_keys_reach_both_workers(
    front: str, loop: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``stop_strings_mode`` and ``unknown_keys: warn`` are honoured by the workers
    themselves, not only by the NeMo-RL drop-ins that build them (issue 43)."""
    top = {"stop_strings_mode": "batch_union", "unknown_keys": "warn", "a_future_key": 1}
    with caplog.at_level(logging.WARNING, logger="genworker"):
        harness = _fake(front, loop, top)
    assert harness.worker.stop_mode is StopMode.BATCH_UNION
    assert "a_future_key" in caplog.text
    assert _fake(front, loop).worker.stop_mode is StopMode.PER_SAMPLE
    harness.call("shutdown")


def test_a_batch_s_stop_strings_are_refused_where_the_engine_cannot_detokenize(
    front: str, loop: Any
) -> None:
    """vLLM skips stop strings silently on an engine started without a tokenizer: the
    batch is refused naming the rows, and a batch without them is served."""
    vllm_cfg = {**config(async_engine=front == "async")["vllm_cfg"], "skip_tokenizer_init": True}
    harness = _fake(front, loop, {"vllm_cfg": vllm_cfg})
    data = {**batch([3, 4]), "stop_strings": [None, ["end"]]}
    with pytest.raises(BadBatchError, match=r"stop_strings of rows \[1\].*skip_tokenizer_init"):
        harness.call("generate", data)
    out = harness.call("generate", {**batch([3, 4]), "stop_strings": [None, []]})
    assert out["output_ids"].shape[0] == 2
    harness.call("shutdown")


@pytest.mark.engine
@pytest.mark.session_engine
def test_the_two_workers_give_equal_rows_for_equal_seeds(
    loop: asyncio.AbstractEventLoop,
    request: pytest.FixtureRequest,
    weights: dict[str, torch.Tensor],
) -> None:
    """Same model, same seeds: the batch drive loop and the streaming one agree row by
    row (tokens exactly; logprobs up to float32 rounding across batch shapes)."""
    sync, streaming = (_real(front, loop, request, weights) for front in ("sync", "async"))
    data = {**batch([5, 9, 5, 12], seed=7), "seeds": [1, 2, 1, 3]}
    for greedy in (True, False):
        a = sync.call("generate", data, greedy=greedy)
        b = streaming.call("generate", data, greedy=greedy)
        for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths"):
            assert torch.equal(a[key], b[key]), key
        torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=1e-4, atol=1e-4)
    texts = {"prompts": ["the cat", "a dog ran"], "seeds": [5, 6]}
    assert sync.call("generate_text", texts) == streaming.call("generate_text", texts)
    rows = streaming.run(collect(streaming.worker.generate_async(data)))  # type: ignore[union-attr]
    assert sorted(r for r, _ in rows) == [0, 1, 2, 3]
    sync.call("reset_prefix_cache")
    streaming.call("reset_prefix_cache")
