"""NeMo-RL's async worker contract (``VllmAsyncGenerationWorker``) over genworker's async
worker, on the fake async engine, and once on a local Ray the way NeMo-RL's Ray layer
builds and drives it, without NeMo-RL installed.

The method table is read from NeMo-RL's ``vllm_worker_async.py`` and ``vllm_generation.py``
(commit 7ea279ab): the names ``VllmGeneration`` calls when ``vllm_cfg.async_engine`` is
true, their arguments, and whether each is a coroutine, an async generator or plain.
The real engine and NeMo-RL's own trainer wire are in ``test_nemo_rl_async_engine.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import torch
from async_helpers import async_config, until
from helpers import right_padded
from hypothesis import event, given
from hypothesis import strategies as st
from strategies import WildBatch, wild_batches

from genworker.core import lifecycle, nemo_rl_front
from genworker.core.lifecycle import InflightMode
from genworker.core.refit_protocol import DEFAULT_TIMEOUT_S
from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineDeadError,
    EngineStateError,
    GenworkerError,
    RefitError,
    RequestAbortedError,
    UnsupportedError,
)
from genworker.shell.fake_async_engine import FakeAsyncEngine, FakeAsyncEngineFactory
from genworker.shell.host import node_ip
from genworker.shell.nemo_rl import NEMO_RL_OUTPUT_KEYS, NemoRlGenerationWorker, NemoRlMember
from genworker.shell.nemo_rl_async import NemoRlAsyncGenerationWorker

CLASS_PATH = "genworker.shell.nemo_rl.VllmAsyncGenerationWorker"
MAX_MODEL_LEN = 64


@pytest.fixture(autouse=True)
def _clean_env() -> Iterator[None]:
    """Each test starts without the variables a worker exports; all are restored after."""
    saved = dict(os.environ)
    for name in (
        "CUDA_VISIBLE_DEVICES",
        "VLLM_RAY_BUNDLE_INDICES",
        "VLLM_RAY_PER_WORKER_GPUS",
        "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY",
    ):
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _config(tp: int = 1, pp: int = 1, max_new_tokens: int = 12, **vllm_cfg: Any) -> dict[str, Any]:
    return async_config(
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        vllm_cfg={
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "max_model_len": MAX_MODEL_LEN,
            "cap_max_tokens_to_context": True,
            **vllm_cfg,
        },
    )


def _owner(
    config: dict[str, Any] | None = None, **kwargs: Any
) -> tuple[NemoRlAsyncGenerationWorker, FakeAsyncEngine]:
    factory = FakeAsyncEngineFactory(max_model_len=MAX_MODEL_LEN, **kwargs.pop("engine", {}))
    worker = NemoRlAsyncGenerationWorker(
        config or _config(), kwargs.pop("bundle_indices", [0]), engine_factory=factory, **kwargs
    )
    return worker, factory.started[-1][1]


def _native(worker: NemoRlAsyncGenerationWorker) -> AsyncVllmGenerationWorker:
    assert worker._worker is not None
    return worker._worker


def rows(n: int, width: int = 4, start: int = 3) -> dict[str, torch.Tensor]:
    """``n`` distinct prompts of ``width`` tokens."""
    return right_padded([[start + i, *range(10, 10 + width - 1)] for i in range(n)])


async def drain(stream: AsyncIterator[tuple[int, Any]]) -> list[tuple[int, Any]]:
    return [item async for item in stream]


def with_socket_dir(engine: FakeAsyncEngine) -> list[str]:
    """The extension's ``nemo_rl_ipc_socket_dir`` on the fake; the directories it got."""
    got: list[str] = []

    def socket_dir(d: str) -> str:
        got.append(d)
        return f"ipc://{d}/fake-cpu.sock"

    engine.rpc_handlers["nemo_rl_ipc_socket_dir"] = socket_dir
    return got


def nemo_rl_receiver(
    engine: FakeAsyncEngine, gate: asyncio.Event | None = None, fail: bool = False
) -> Callable[..., Any]:
    """The extension's ``nemo_rl_update_weights_*`` on the fake: waits for ``gate`` (the
    trainer's stream), then loads the new weights or fails as a silent trainer does."""

    async def receive(timeout_s: float) -> dict[str, object]:
        if gate is not None:
            await gate.wait()
        if fail:
            raise TimeoutError(f"the trainer sent nothing within {timeout_s:g}s")
        engine.load_new_weights()
        return {"tensors": 1}

    return receive


# -- NeMo-RL's method table ---------------------------------------------------------------

COROUTINE, ASYNC_GEN, PLAIN = "coroutine", "async generator", "plain"

# What VllmGeneration calls on the async worker (vllm_generation.py), and what NeMo-RL's
# VllmAsyncGenerationWorker inherits or defines besides (vllm_worker_async.py,
# vllm_worker.py BaseVllmGenerationWorker, checkpoint_engine.py): name -> (kind, the
# parameters NeMo-RL's method takes). ``**`` marks a **kwargs method.
NEMO_RL_ASYNC_METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "load_model": (PLAIN, ()),
    "post_init_async": (COROUTINE, ()),
    "get_reserved_url": (COROUTINE, ()),
    "report_dp_openai_server_base_url": (COROUTINE, ()),
    "report_device_id_async": (COROUTINE, ()),
    "init_collective_async": (
        COROUTINE,
        ("rank_prefix", "ip", "port", "world_size", "train_world_size"),
    ),
    "generate_async": (ASYNC_GEN, ("data", "greedy")),
    "generate_text_async": (ASYNC_GEN, ("data", "greedy")),
    "prepare_refit_info_async": (COROUTINE, ("state_dict_info",)),
    "update_weights_via_ipc_zmq_async": (COROUTINE, ()),
    "update_weights_from_collective_async": (COROUTINE, ()),
    "init_nccl_reshard_comm_group_async": (
        COROUTINE,
        (
            "rank_prefix",
            "pp_ips",
            "pp_ports",
            "pp_size",
            "train_ranks_per_stage",
            "sub_world_size",
        ),
    ),
    "prepare_nccl_reshard_refit_info_async": (COROUTINE, ("refit_info",)),
    "nccl_reshard_refit_async": (COROUTINE, ()),
    "checkpoint_engine_rpc_async": (COROUTINE, ("checkpoint_method", "method_args")),
    "reset_prefix_cache_async": (COROUTINE, ()),
    "sleep_async": (COROUTINE, ()),
    "wake_up_async": (COROUTINE, ("**",)),
    "shutdown": (COROUTINE, ()),
    "get_vllm_logger_metrics": (PLAIN, ()),
    "clear_vllm_logger_metrics": (PLAIN, ()),
    "_get_raw_spec_counters": (PLAIN, ()),  # through ray.get: ours may be a coroutine
    "is_alive": (PLAIN, ()),
    "llm": (PLAIN, ()),
    "start_gpu_profiling": (PLAIN, ()),
    "stop_gpu_profiling": (PLAIN, ()),
    "report_refit_server_base_url": (PLAIN, ()),
    "start_zmq_sparse_refit_relay": (PLAIN, ()),
    "configure_zmq_sparse_refit_relay": (PLAIN, ("relay_addresses",)),
    "stop_zmq_sparse_refit_relay": (PLAIN, ()),
}


def _kind(fn: object) -> str:
    if inspect.isasyncgenfunction(fn):
        return ASYNC_GEN
    return COROUTINE if inspect.iscoroutinefunction(fn) else PLAIN


@pytest.mark.parametrize("name", sorted(NEMO_RL_ASYNC_METHODS))
def test_every_method_of_nemo_rls_async_worker_is_here_with_its_arguments(name: str) -> None:
    kind, params = NEMO_RL_ASYNC_METHODS[name]
    fn = getattr(NemoRlAsyncGenerationWorker, name)
    if name == "_get_raw_spec_counters":
        assert _kind(fn) in (PLAIN, COROUTINE)
    elif kind == ASYNC_GEN:
        assert _kind(fn) == ASYNC_GEN, "Ray streams only an async generator function"
    else:
        assert _kind(fn) == kind
    sig = inspect.signature(fn)
    ours = [p for p in sig.parameters.values() if p.name != "self"]
    if params == ("**",):
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours)
        return
    positional = [p.name for p in ours if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional[: len(params)] == list(params), "NeMo-RL's names, in its order"
    extra = [p for p in ours if p.name not in params]
    assert all(p.default is not inspect.Parameter.empty for p in extra), (
        "anything NeMo-RL does not pass has a default"
    )


def test_construction_takes_nemo_rls_arguments_and_configure_worker_is_the_sync_drop_ins() -> None:
    params = list(inspect.signature(NemoRlAsyncGenerationWorker).parameters)
    assert params[:6] == [
        "config",
        "bundle_indices",
        "fraction_of_gpus",
        "seed",
        "extra_env_vars",
        "defer_model_load",
    ]
    args = (1, (1, [4, 5]), 8)
    assert NemoRlAsyncGenerationWorker.configure_worker(*args) == (
        NemoRlGenerationWorker.configure_worker(*args)
    )
    assert NemoRlAsyncGenerationWorker.configure_worker is NemoRlMember.configure_worker


def test_each_drop_in_refuses_the_other_ones_config_naming_it() -> None:
    with pytest.raises(BadConfigError, match=r"async_engine is false.*VllmGenerationWorker"):
        NemoRlAsyncGenerationWorker(_config(async_engine=False), [0])
    with pytest.raises(BadConfigError, match=r"async_engine is false"):
        NemoRlAsyncGenerationWorker(_config(async_engine=False), None)  # inert: checked too
    with pytest.raises(BadConfigError, match=r"async_engine.*VllmAsyncGenerationWorker"):
        NemoRlGenerationWorker(_config(), [0])


# -- tied groups -----------------------------------------------------------------------------


def test_inert_members_load_nothing_and_refuse_engine_calls() -> None:
    async def main() -> None:
        factory = FakeAsyncEngineFactory()
        worker = NemoRlAsyncGenerationWorker(
            _config(tp=2, expose_http_server=True), None, engine_factory=factory
        )
        assert factory.started == []
        assert not worker.is_model_owner
        assert worker.llm() is None
        assert worker.is_alive()
        assert await worker._get_raw_spec_counters() == {}
        assert await worker.get_reserved_url() is None, "no server on an inert member"
        assert await worker.report_dp_openai_server_base_url() is None
        with pytest.raises(EngineStateError, match="inert member"):
            await drain(worker.generate_async(rows(1)))
        with pytest.raises(EngineStateError, match="inert member"):
            await drain(worker.generate_text_async({"prompts": ["ab"]}))
        for call in (
            worker.post_init_async(),
            worker.sleep_async(),
            worker.wake_up_async(),
            worker.reset_prefix_cache_async(),
            worker.prepare_refit_info_async({"w": ([2], "float32")}),
            worker.init_collective_async(0, "127.0.0.1", 1, 2, 1),
            worker.report_device_id_async(),
        ):
            with pytest.raises(EngineStateError, match="inert member"):
                await call
        with pytest.raises(EngineStateError, match="inert member"):
            worker.load_model()
        with pytest.raises(EngineStateError, match="inert member"):
            worker.get_vllm_logger_metrics()
        assert await worker.update_weights_via_ipc_zmq_async() is False
        assert isinstance(worker.last_refit_error, EngineStateError)
        assert "inert member" in str(worker.last_refit_error)
        assert await worker.shutdown() is True
        assert not worker.is_alive()
        assert repr(worker) == "NemoRlAsyncGenerationWorker"

    asyncio.run(main())


def test_an_inert_member_still_refuses_a_bad_config() -> None:
    with pytest.raises(BadConfigError, match="quant_cfg"):
        NemoRlAsyncGenerationWorker({**_config(), "quant_cfg": "nvfp4"}, None)


def test_a_pp_owner_sets_up_vllms_ray_executor_before_loading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pipeline parallelism is why NeMo-RL needs its async worker: the owner of a tied
    TP x PP group exports what vLLM's Ray executor reads, as the sync drop-in does."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    factory = FakeAsyncEngineFactory()
    worker = NemoRlAsyncGenerationWorker(
        _config(tp=2, pp=2), [0, 1, 2, 3], extra_env_vars=["HF_TOKEN"], engine_factory=factory
    )
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert os.environ["VLLM_RAY_BUNDLE_INDICES"] == "0,1,2,3"
    assert os.environ["VLLM_RAY_PER_WORKER_GPUS"] == "0.25"
    assert os.environ["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"] == "HF_TOKEN"
    kwargs, _ = factory.started[-1]
    assert kwargs["distributed_executor_backend"] == "ray"
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (2, 2)
    assert worker.is_model_owner


def test_a_deferred_owner_reserves_its_url_and_loads_on_load_model() -> None:
    async def main() -> None:
        factory = FakeAsyncEngineFactory(max_model_len=MAX_MODEL_LEN)
        worker = NemoRlAsyncGenerationWorker(
            _config(expose_http_server=True),
            [0],
            defer_model_load=True,
            engine_factory=factory,
        )
        assert factory.started == []
        assert worker.llm() is None
        assert worker.is_alive()
        url = await worker.get_reserved_url()
        assert url is not None
        assert url.startswith("http://127.0.0.1:")
        assert url.endswith("/v1")
        port = int(url.rsplit(":", 1)[1].removesuffix("/v1"))
        assert port > 0, "a socket bound now, before the model loads"
        worker.load_model()
        assert isinstance(worker.llm(), FakeAsyncEngine)
        assert await worker.get_reserved_url() == url, "the same socket after loading"
        await worker.shutdown()

        plain, _ = _owner()
        assert await plain.get_reserved_url() is None
        assert await plain.report_dp_openai_server_base_url() is None
        await plain.shutdown()

    asyncio.run(main())


def test_the_drop_in_reports_a_wildcard_server_at_this_nodes_ip() -> None:
    async def main() -> None:
        worker, _ = _owner(_config(expose_http_server=True, http_server_host="0.0.0.0"))
        url = await worker.get_reserved_url()
        assert url is not None
        assert url.startswith(f"http://{node_ip()}:")
        assert not url.startswith("http://0.0.0.0")
        await worker.shutdown()

    asyncio.run(main())


# -- generation --------------------------------------------------------------------------------


def test_post_init_async_records_the_engine_workers_device_ids() -> None:
    async def main() -> None:
        worker, engine = _owner()
        await worker.post_init_async()
        assert worker.vllm_device_ids == ["fake-cpu"]
        assert await worker.report_device_id_async() == ["fake-cpu"]
        assert worker.llm() is engine

    asyncio.run(main())


def test_generate_async_yields_nemo_rls_per_sample_shape_in_completion_order() -> None:
    async def main() -> None:
        worker, _ = _owner(_config(max_new_tokens=40))
        # Context caps: a longer prompt has less room, so it finishes sooner.
        data = right_padded([[3] * 10, [4] * 55, [5] * 40])
        items = await drain(worker.generate_async(data, greedy=True))
        assert [row for row, _ in items] == [1, 2, 0]
        for row, out in items:
            assert isinstance(out, dict)
            assert tuple(out) == NEMO_RL_OUTPUT_KEYS, "NeMo-RL's keys, nothing else"
            n = int(data["input_lengths"][row])
            g = min(40, MAX_MODEL_LEN - n)
            assert tuple(out["output_ids"].shape) == (1, n + g)
            assert out["output_ids"][0, :n].tolist() == data["input_ids"][row, :n].tolist()
            assert tuple(out["logprobs"].shape) == (1, n + g)
            assert out["generation_lengths"].tolist() == [g]
            assert out["unpadded_sequence_lengths"].tolist() == [n + g]
            assert out["truncated"].tolist() == [True]
        assert _native(worker).state == lifecycle.AWAKE

    asyncio.run(main())


def test_generate_async_takes_nemo_rls_vlm_sample() -> None:
    """One VLM sample as NeMo-RL's async rollout sends it: its processor's expanded ids,
    the conversation's text, its images; the engine starts from the text's ids."""
    from PIL import Image

    async def main() -> None:
        image, per_image = 5, 7  # the fake's placeholder id ("f") and its expansion
        engine_options = {"image_token_id": image, "image_prompt_ids": per_image}
        worker, engine = _owner(_config(max_new_tokens=8), engine=engine_options)
        expanded = [0, 1, *[image] * per_image, 2]
        data: dict[str, object] = dict(right_padded([expanded]))
        data["vllm_content"] = ["abfc"]
        data["vllm_images"] = [[Image.new("RGB", (8, 6), (255, 0, 0))]]
        ((row, out),) = await drain(worker.generate_async(data, greedy=True))
        assert row == 0
        assert tuple(out) == NEMO_RL_OUTPUT_KEYS
        assert out["output_ids"][0, : len(expanded)].tolist() == expanded
        assert set(engine.finished) == {(0, 1, image, 2)}

    asyncio.run(main())


def _stream_of(
    make: Callable[[FakeAsyncEngineFactory], Any], data: dict[str, torch.Tensor]
) -> tuple[list[tuple[int, Any]], BaseException | None]:
    """What a worker's ``generate_async(data)`` gives on a fresh fake: its items and the
    exception that ended it (None)."""

    async def main() -> tuple[list[tuple[int, Any]], BaseException | None]:
        worker = make(FakeAsyncEngineFactory(max_model_len=MAX_MODEL_LEN))
        items: list[tuple[int, Any]] = []
        try:
            items.extend([item async for item in worker.generate_async(data)])
        except GenworkerError as e:
            return items, e
        finally:
            await worker.shutdown()
        return items, None

    return asyncio.run(main())


@given(wild_batches(vocab_size=64), st.booleans())
def test_the_drop_in_is_genworkers_stream_with_errors_raised_and_nemo_rls_keys(
    batch: WildBatch, one_length_short: bool
) -> None:
    """Law: on the same engine, the drop-in yields what genworker's async worker yields, in
    the same order, minus ``weight_versions``, up to the first row that failed, whose error
    it raises (same type and message); a batch wrong as a whole (here: one length short)
    raises in both."""
    if batch.width == 0:
        return
    data = {
        "input_ids": torch.tensor(batch.ids, dtype=torch.int64).reshape(-1, batch.width),
        "input_lengths": torch.tensor(
            batch.lengths[:-1] if one_length_short else batch.lengths, dtype=torch.int64
        ),
    }
    cfg = {**_config(max_new_tokens=6), "_pad_token_id": batch.pad_token_id}
    theirs, raised = _stream_of(lambda f: AsyncVllmGenerationWorker(cfg, engine_factory=f), data)
    ours, ours_raised = _stream_of(
        lambda f: NemoRlAsyncGenerationWorker(cfg, [0], engine_factory=f), data
    )
    first_error = next(
        (i for i, (_, item) in enumerate(theirs) if isinstance(item, GenworkerError)), None
    )
    event("refused whole" if raised else "all rows" if first_error is None else "row error")
    if raised is not None:  # refused as a whole, before any row
        assert theirs == []
        assert ours == []
        assert type(ours_raised) is type(raised)
        assert str(ours_raised) == str(raised)
        return
    expected = theirs if first_error is None else theirs[:first_error]
    if first_error is None:
        assert ours_raised is None
    else:
        error = theirs[first_error][1]
        assert type(ours_raised) is type(error)
        assert str(ours_raised) == str(error)
    assert [row for row, _ in ours] == [row for row, _ in expected]
    for (_, got), (_, want) in zip(ours, expected, strict=True):
        assert tuple(got) == NEMO_RL_OUTPUT_KEYS
        for key in NEMO_RL_OUTPUT_KEYS:
            assert torch.equal(got[key], want[key]), key


def test_a_rows_typed_error_is_raised_and_the_rows_still_running_are_aborted() -> None:
    async def main() -> None:
        worker, engine = _owner(_config(max_new_tokens=60, cap_max_tokens_to_context=False))
        with pytest.raises(BadBatchError, match=r"row 1 cannot generate.*id 999"):
            await drain(worker.generate_async(right_padded([[3, 4], [5, 999]])))
        assert engine.finished == {}, "the good row never reached the engine"
        with pytest.raises(BadBatchError, match="prompt 0 is an empty string"):
            await drain(worker.generate_text_async({"prompts": ["", "ab"]}))

        stream = worker.generate_async(rows(3))
        pending = asyncio.ensure_future(drain(stream))
        await until(lambda: engine.generation_tokens >= 3)
        engine.kill()
        with pytest.raises(EngineDeadError, match=r"row .: the fake engine core died"):
            await pending
        assert not worker.is_alive()

    asyncio.run(main())


def test_cancelling_the_consumer_aborts_the_vllm_request() -> None:
    """``VllmGeneration._generate_on_shard`` cancels the Ray call when its consumer is
    cancelled; the actor's task is cancelled while it awaits the row."""

    async def main() -> None:
        worker, engine = _owner(_config(max_new_tokens=60, cap_max_tokens_to_context=False))
        stream = worker.generate_async(rows(1))
        first = asyncio.ensure_future(stream.__anext__())
        await until(lambda: engine.generation_tokens >= 2)
        assert engine.num_unfinished() == 1
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert engine.num_unfinished() == 0
        assert "abort" in engine.calls
        assert _native(worker).state == lifecycle.AWAKE, "the stream ended"
        await worker.sleep_async()  # nothing in flight any more

    asyncio.run(main())


def test_generate_text_async_yields_texts_as_they_finish() -> None:
    async def main() -> None:
        worker, _ = _owner(_config(max_new_tokens=5))
        items = await drain(worker.generate_text_async({"prompts": ["abc", "d"]}))
        assert sorted(row for row, _ in items) == [0, 1]
        for _, out in items:
            assert set(out) == {"texts"}
            assert len(out["texts"]) == 1
            assert len(out["texts"][0]) == 5

    asyncio.run(main())


# -- memory --------------------------------------------------------------------------------


def test_sleep_async_takes_no_level_and_wake_up_async_takes_nemo_rls_tags_keyword() -> None:
    async def main() -> None:
        worker, engine = _owner(_config(sleep_level=2))
        await worker.sleep_async()
        assert "sleep(2)" in engine.calls
        await worker.wake_up_async(tags=["weights"])
        assert engine.awake_tags == {"weights"}
        await worker.wake_up_async()
        assert engine.awake_tags == {"weights", "kv_cache"}
        with pytest.raises(BadArgumentError, match="wake_up_async takes only tags"):
            await worker.wake_up_async(tags=["kv_cache"], level=1)
        with pytest.raises(BadArgumentError, match="tags"):
            await worker.wake_up_async(tags=3)
        await worker.reset_prefix_cache_async()
        assert engine.prefix_cache_resets == 2  # the sleep's and this one

        worker, engine = _owner(_config(max_new_tokens=60, cap_max_tokens_to_context=False))
        pending = asyncio.ensure_future(drain(worker.generate_async(rows(1))))
        await until(lambda: engine.num_unfinished() == 1)
        for call in (worker.sleep_async(), worker.reset_prefix_cache_async()):
            with pytest.raises(EngineStateError, match="requests are in flight"):
                await call
        await pending

    asyncio.run(main())


# -- refits in flight over NeMo-RL's wire ----------------------------------------------------


def test_prepare_refit_info_async_returns_none_and_keeps_the_summaries() -> None:
    async def main() -> None:
        worker, engine = _owner()
        info = {"w": (torch.Size([2, 3]), torch.bfloat16)}
        answer: Awaitable[object] = worker.prepare_refit_info_async(info)  # NeMo-RL's None
        assert await answer is None
        assert worker.refit_info == [{"tensors": 1}]
        assert engine.calls == ["rpc:prepare_refit_info"]

    asyncio.run(main())


def test_an_in_flight_refit_runs_through_nemo_rls_receivers_with_pause_and_resume() -> None:
    async def main() -> None:
        worker, engine = _owner(
            _config(max_new_tokens=50, cap_max_tokens_to_context=False), ipc_socket_dir="/run/nrl"
        )
        dirs = with_socket_dir(engine)
        gate = asyncio.Event()
        engine.rpc_handlers["nemo_rl_update_weights_via_ipc_zmq"] = nemo_rl_receiver(engine, gate)
        await worker.prepare_refit_info_async({"w": ([2], "float32")})
        data = rows(4)
        pending = asyncio.ensure_future(drain(worker.generate_async(data, greedy=True)))
        await until(lambda: engine.generation_tokens >= 4 * 10)
        refit = asyncio.ensure_future(worker.update_weights_via_ipc_zmq_async())
        await until(lambda: engine.pause_mode is InflightMode.KEEP)
        frozen = engine.generation_tokens
        await asyncio.sleep(0.02)
        assert engine.generation_tokens == frozen, "keep: nothing steps while refitting"
        gate.set()
        assert await refit is True
        assert worker.last_refit_error is None
        items = await pending
        assert sorted(row for row, _ in items) == [0, 1, 2, 3]
        calls = [c for c in engine.calls if c not in ("generate", "abort", "metrics")]
        assert calls == [
            "rpc:prepare_refit_info",
            "label_weights(0)",
            "rpc:nemo_rl_ipc_socket_dir",
            "pause(keep)",
            "rpc:nemo_rl_update_weights_via_ipc_zmq",
            "label_weights(1)",
            "resume",
        ], "NeMo-RL's receiver inside genworker's pause and resume, never genworker's wire"
        assert dirs == ["/run/nrl"]
        assert _native(worker).weight_version == 1
        for row, out in items:
            prompt = data["input_ids"][row].tolist()
            versions = engine.finished[tuple(prompt)]
            boundary = versions.index(1)
            assert 0 < boundary < 50
            assert set(versions[boundary:]) == {1}
            # Greedy after the refit = a fresh engine on the new weights continuing the
            # prompt plus the tokens sampled before it.
            tokens = out["output_ids"][0, len(prompt) :].tolist()
            fresh, fresh_engine = _owner(
                _config(max_new_tokens=50 - boundary, cap_max_tokens_to_context=False)
            )
            fresh_engine.weight_version = 1
            ((_, cont),) = await drain(
                fresh.generate_async(right_padded([prompt + tokens[:boundary]]), greedy=True)
            )
            assert cont["output_ids"][0, len(prompt) + boundary :].tolist() == tokens[boundary:]
        # The socket directory is told once; the next refit goes straight in.
        engine.rpc_handlers["nemo_rl_update_weights_via_ipc_zmq"] = nemo_rl_receiver(engine)
        assert await worker.update_weights_via_ipc_zmq_async(mode="wait") is True
        assert dirs == ["/run/nrl"]
        assert "pause(wait)" in engine.calls
        assert engine.misuse is None

    asyncio.run(main())


def test_a_failed_refit_returns_false_keeps_the_typed_error_and_fails_the_rows_in_flight() -> None:
    async def main() -> None:
        worker, engine = _owner(_config(max_new_tokens=60, cap_max_tokens_to_context=False))
        with_socket_dir(engine)
        engine.rpc_handlers["nemo_rl_update_weights_via_ipc_zmq"] = nemo_rl_receiver(
            engine, fail=True
        )
        assert await worker.update_weights_via_ipc_zmq_async() is False
        assert isinstance(worker.last_refit_error, EngineStateError)
        assert "prepare_refit_info first" in str(worker.last_refit_error)
        assert engine.calls == ["rpc:nemo_rl_ipc_socket_dir"], "refused before the pause"
        await worker.prepare_refit_info_async({"w": ([2], "float32")})
        pending = asyncio.ensure_future(drain(worker.generate_async(rows(2))))
        await until(lambda: engine.generation_tokens >= 2)
        assert await worker.update_weights_via_ipc_zmq_async(refit_timeout_s=5) is False
        error = worker.last_refit_error
        assert isinstance(error, RefitError)
        assert "sent nothing within 5s" in str(error)
        assert worker.get_last_refit_error() is error
        with pytest.raises(RefitError, match=r"in-flight refit .* failed"):
            await pending
        with pytest.raises(EngineStateError, match="refit again"):
            await drain(worker.generate_async(rows(1)))
        assert engine.pause_mode is None, "resumed"

        engine.rpc_handlers["nemo_rl_update_weights_via_ipc_zmq"] = nemo_rl_receiver(engine)
        assert await worker.update_weights_via_ipc_zmq_async() is True
        assert worker.get_last_refit_error() is None
        items = await drain(worker.generate_async(rows(1)))
        assert [row for row, _ in items] == [0]

    asyncio.run(main())


def test_abort_mode_drops_the_rows_in_flight_which_raise() -> None:
    async def main() -> None:
        worker, engine = _owner(_config(max_new_tokens=60, cap_max_tokens_to_context=False))
        with_socket_dir(engine)
        engine.rpc_handlers["nemo_rl_update_weights_via_ipc_zmq"] = nemo_rl_receiver(engine)
        await worker.prepare_refit_info_async({"w": ([2], "float32")})
        pending = asyncio.ensure_future(drain(worker.generate_async(rows(2))))
        await until(lambda: engine.generation_tokens >= 2)
        assert await worker.update_weights_via_ipc_zmq_async(mode=InflightMode.ABORT) is True
        with pytest.raises(RequestAbortedError, match="mode 'abort'"):
            await pending
        assert await worker.update_weights_via_ipc_zmq_async(mode="later") is False
        assert isinstance(worker.last_refit_error, BadArgumentError)

    asyncio.run(main())


def test_a_collective_refit_needs_init_collective_async_which_joins_nemo_rls_group() -> None:
    async def main() -> None:
        worker, engine = _owner()
        joined: list[tuple[object, ...]] = []
        engine.rpc_handlers["nemo_rl_init_collective"] = lambda *args: joined.append(args)
        timeouts: list[float] = []

        def receive(timeout_s: float) -> None:
            timeouts.append(timeout_s)
            engine.load_new_weights()

        engine.rpc_handlers["nemo_rl_update_weights_from_collective"] = receive
        await worker.prepare_refit_info_async({"w": ([2], "float32")})
        assert await worker.update_weights_from_collective_async() is False
        assert isinstance(worker.last_refit_error, EngineStateError)
        assert "init_collective first" in str(worker.last_refit_error)
        await worker.init_collective_async(0, "10.0.0.1", 29500, 3, 2)
        where = {"rank_prefix": 0, "ip": "10.0.0.1", "port": 29500, "world_size": 3}
        assert joined == [({**where, "train_world_size": 2, "timeout_s": DEFAULT_TIMEOUT_S},)]
        assert await worker.update_weights_from_collective_async() is True
        assert await worker.update_weights_from_collective_async(refit_timeout_s=2.5) is True
        assert timeouts == [DEFAULT_TIMEOUT_S, 2.5]
        assert "rpc:nemo_rl_ipc_socket_dir" not in engine.calls, "collective: no socket"
        assert _native(worker).weight_version == 2

    asyncio.run(main())


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_a_bad_refit_timeout_returns_false_and_changes_nothing(timeout: object) -> None:
    async def main() -> None:
        worker, engine = _owner()
        await worker.prepare_refit_info_async({"w": ([2], "float32")})
        ok = await worker.update_weights_via_ipc_zmq_async(refit_timeout_s=timeout)  # type: ignore[arg-type]
        assert ok is False
        assert isinstance(worker.last_refit_error, BadArgumentError)
        assert "timeout_s" in str(worker.last_refit_error)
        assert engine.calls == ["rpc:prepare_refit_info"]
        assert _native(worker).state == lifecycle.AWAKE

    asyncio.run(main())


# -- observability, refusals, shutdown ---------------------------------------------------------


def test_raw_spec_counters_are_keyed_by_metric_name() -> None:
    async def main() -> None:
        worker, engine = _owner()
        items = await drain(worker.generate_async(rows(2)))
        generated = sum(int(out["generation_lengths"][0]) for _, out in items)
        counters = await worker._get_raw_spec_counters()
        assert counters == {
            "vllm:prompt_tokens": 8.0,
            "vllm:generation_tokens": float(generated),
            "vllm:num_requests_running": 0.0,
        }
        assert engine.generation_tokens == generated

    asyncio.run(main())


def test_the_metrics_logger_answers_through_the_drop_in() -> None:
    async def main() -> None:
        worker, _ = _owner(
            _config(enable_vllm_metrics_logger=True, vllm_metrics_logger_interval=0.005)
        )
        await drain(worker.generate_async(rows(2)))
        await until(lambda: worker.get_vllm_logger_metrics()["generation_tokens"][-1:] == [24])
        worker.clear_vllm_logger_metrics()
        assert len(worker.get_vllm_logger_metrics()["generation_tokens"]) <= 1
        await worker.shutdown()

        off, _ = _owner()
        with pytest.raises(UnsupportedError, match="metrics logger is off"):
            off.get_vllm_logger_metrics()

    asyncio.run(main())


REFUSED: list[tuple[str, tuple[object, ...], str]] = [
    ("init_nccl_reshard_comm_group_async", (0, ["h"], [1], 1, 1, 2), "nccl_reshard"),
    ("prepare_nccl_reshard_refit_info_async", ({},), "nccl_reshard"),
    ("nccl_reshard_refit_async", (), "nccl_reshard"),
    ("checkpoint_engine_rpc_async", ("init_checkpoint_engine",), "checkpoint engine"),
    ("start_zmq_sparse_refit_relay", (), "sparse refit relay"),
    ("configure_zmq_sparse_refit_relay", (["tcp://h:1"],), "sparse refit relay"),
    ("stop_zmq_sparse_refit_relay", (), "sparse refit relay"),
    ("start_gpu_profiling", (), "nsight profiling"),
    ("stop_gpu_profiling", (), "nsight profiling"),
]


@pytest.mark.parametrize(("method", "args", "what"), REFUSED, ids=[r[0] for r in REFUSED])
def test_what_genworker_cannot_do_is_refused_naming_the_method_and_what_to_use(
    method: str, args: tuple[object, ...], what: str
) -> None:
    async def main() -> None:
        worker, engine = _owner()

        async def call() -> None:
            result = getattr(worker, method)(*args)
            if inspect.isawaitable(result):
                await result

        with pytest.raises(UnsupportedError) as refused:
            await call()
        message = str(refused.value)
        assert message.startswith(f"{method}: ")
        assert what in message
        assert "update_weights_" in message or "async_engine: false" in message
        assert engine.calls == []

    asyncio.run(main())


def test_every_refusal_core_holds_is_a_method_of_the_drop_in() -> None:
    assert all(
        callable(getattr(NemoRlAsyncGenerationWorker, m, None)) for m in nemo_rl_front.REFUSED
    )


def test_there_is_no_sparse_refit_server() -> None:
    worker, _ = _owner()
    assert worker.report_refit_server_base_url() is None


def test_shutdown_ends_the_streams_is_idempotent_and_refuses_later_calls() -> None:
    async def main() -> None:
        worker, engine = _owner(_config(max_new_tokens=60, cap_max_tokens_to_context=False))
        pending = asyncio.ensure_future(drain(worker.generate_async(rows(2))))
        await until(lambda: engine.generation_tokens >= 2)
        assert await worker.shutdown() is True
        with pytest.raises(EngineStateError, match="shut down"):
            await pending
        assert await worker.shutdown() is True
        assert engine.shut_down
        assert not worker.is_alive()
        with pytest.raises(EngineStateError, match="shut down"):
            await drain(worker.generate_async(rows(1)))

    asyncio.run(main())


# -- on a local Ray, as NeMo-RL's Ray layer builds and drives it --------------------------------


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _build(
    bundle_indices: tuple[int, list[int]] | None, config: dict[str, Any], **engine: Any
) -> tuple[Any, dict[str, Any]]:
    """RayWorkerBuilder.create_worker's steps (import by class path, configure_worker,
    ``.options(...).remote(config, **init_kwargs)``); VllmGeneration's builder passes
    ``defer_model_load`` for the async worker."""
    module_name, class_name = CLASS_PATH.rsplit(".", 1)
    worker_class = getattr(importlib.import_module(module_name), class_name)
    resources, env_vars, init_kwargs, runtime_env = worker_class.configure_worker(
        num_gpus=1, bundle_indices=bundle_indices, num_gpus_per_node=None
    )
    options: dict[str, Any] = {"runtime_env": {"env_vars": env_vars, **runtime_env}}
    options["num_gpus"] = 0  # no GPU on this host; resources["num_gpus"] is what NeMo-RL asks
    factory = FakeAsyncEngineFactory(max_model_len=MAX_MODEL_LEN, accept_refits=True, **engine)
    actor = worker_class.options(**options).remote(
        config, defer_model_load=False, **init_kwargs, engine_factory=factory
    )
    return actor, {"resources": resources, "init_kwargs": init_kwargs}


async def _generate_on_shard(
    actor: Any, method: str, data: dict[str, Any], greedy: bool = False
) -> tuple[int, dict[str, Any]]:
    """VllmGeneration._generate_on_shard's Ray steps: ``run_single_worker_single_data``
    (``getattr(worker, method).remote(**kwargs)``, a streaming ``ObjectRefGenerator`` for an
    async generator method), the first item's ``ObjectRef``, its value under a timeout, the
    leader index added; ``ray.cancel`` of the call when this consumer is cancelled."""
    import ray

    gen = getattr(actor, method).remote(data=data, greedy=greedy)
    assert isinstance(gen, ray.ObjectRefGenerator), "Ray streams an async generator method"
    try:
        try:
            ref = await anext(gen)
        except StopAsyncIteration:
            raise RuntimeError(f"Worker produced no output for the given sample {data}") from None
        pair = await asyncio.wait_for(ref, timeout=60)
        assert isinstance(pair, tuple), pair
        original_idx, result = pair
        result["gen_leader_worker_idx"] = [0]
        return original_idx, result
    except (asyncio.CancelledError, GeneratorExit):
        ray.cancel(gen)
        raise


def _engine_state(actor: Any) -> dict[str, Any]:
    import ray

    def read(self: Any) -> dict[str, Any]:
        engine = self._worker.engine
        return {
            "calls": list(engine.calls),
            "unfinished": engine.num_unfinished(),
            "finished": dict(engine.finished),
            "version": self._worker.weight_version,
            "generated": engine.generation_tokens,
        }

    return dict(ray.get(actor.__ray_call__.remote(read), timeout=60))


@pytest.mark.ray
def test_nemo_rls_ray_layer_can_build_and_drive_the_async_worker(ray_session: None) -> None:
    import ray

    config = _config(tp=2, max_new_tokens=30, cap_max_tokens_to_context=False)
    owner, placed = _build((0, [0, 1]), config, step_s=0.05)
    inert, _ = _build(None, config)
    assert placed["resources"] == {"num_gpus": 0}
    assert placed["init_kwargs"] == {"bundle_indices": [0, 1], "seed": 0, "fraction_of_gpus": 1}
    assert ray.get(owner.get_reserved_url.remote(), timeout=120) is None
    assert ray.get(owner.post_init_async.remote(), timeout=60) is None
    assert ray.get(owner.report_dp_openai_server_base_url.remote(), timeout=60) is None
    assert ray.get(owner.report_device_id_async.remote(), timeout=60) == ["fake-cpu"]
    info = {"w": (torch.Size([2]), torch.float32)}
    assert ray.get(owner.prepare_refit_info_async.remote(state_dict_info=info), timeout=60) is None
    data = rows(1)

    async def drive() -> None:
        # One row through Ray's streaming generator, a refit arriving while it runs.
        row = asyncio.ensure_future(_generate_on_shard(owner, "generate_async", data))
        await until(lambda: _engine_state(owner)["generated"] >= 3, timeout_s=60)
        assert await owner.update_weights_via_ipc_zmq_async.remote() is True
        idx, out = await row
        assert idx == 0
        assert set(out) == {*NEMO_RL_OUTPUT_KEYS, "gen_leader_worker_idx"}
        assert out["generation_lengths"].tolist() == [30]
        # A row's typed error reaches NeMo-RL raised, as the ObjectRef's value.
        with pytest.raises(BadBatchError, match="id 999"):
            await _generate_on_shard(owner, "generate_async", right_padded([[3, 999]]))
        idx, texts = await _generate_on_shard(owner, "generate_text_async", {"prompts": ["ab"]})
        assert idx == 0
        assert len(texts["texts"][0]) == 30
        # A cancelled consumer cancels the Ray call, which aborts the vLLM request.
        row = asyncio.ensure_future(_generate_on_shard(owner, "generate_async", rows(1, start=9)))
        await until(lambda: _engine_state(owner)["unfinished"] == 1, timeout_s=60)
        row.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await row
        await until(lambda: _engine_state(owner)["unfinished"] == 0, timeout_s=60)

    asyncio.run(drive())
    state = _engine_state(owner)
    assert "abort" in state["calls"]
    versions = state["finished"][tuple(data["input_ids"][0].tolist())]
    assert (versions[0], versions[-1]) == (0, 1), "the refit landed while the row ran"
    assert state["version"] == 1
    assert state["calls"].count("rpc:nemo_rl_update_weights_via_ipc_zmq") == 1
    assert ray.get(owner.update_weights_from_collective_async.remote(), timeout=60) is False
    error = ray.get(owner.get_last_refit_error.remote(), timeout=60)
    assert isinstance(error, EngineStateError)
    assert "init_collective first" in str(error)
    assert ray.get(owner.init_collective_async.remote(0, "127.0.0.1", 1, 2, 1), timeout=60) is None
    assert ray.get(owner.update_weights_from_collective_async.remote(), timeout=60) is True
    counters = ray.get(owner._get_raw_spec_counters.remote(), timeout=60)
    assert counters["vllm:prompt_tokens"] == 4 + 2 + 4  # the bad row never reached it
    assert ray.get(owner.wake_up_async.remote(tags=["weights"]), timeout=60) is None
    assert ray.get(owner.sleep_async.remote(), timeout=60) is None
    assert ray.get(owner.wake_up_async.remote(), timeout=60) is None
    assert ray.get(owner.reset_prefix_cache_async.remote(), timeout=60) is None
    env = ray.get(owner.__ray_call__.remote(lambda self: dict(os.environ)), timeout=60)
    assert env["VLLM_RAY_BUNDLE_INDICES"] == "0,1"
    assert env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert ray.get(inert.is_alive.remote(), timeout=60) is True
    with pytest.raises(EngineStateError, match="inert member"):
        asyncio.run(_generate_on_shard(inert, "generate_async", data))
    assert ray.get([owner.shutdown.remote(), inert.shutdown.remote()], timeout=60) == [True, True]
    assert ray.get(owner.is_alive.remote(), timeout=60) is False
    for actor in (owner, inert):
        ray.kill(actor)


def test_the_class_path_is_made_on_first_use_without_importing_ray_before() -> None:
    code = (
        "import sys\n"
        "import genworker.shell.nemo_rl as m\n"
        "import genworker.shell.nemo_rl_async as a\n"
        "assert 'ray' not in sys.modules, 'imported ray'\n"
        "actor = m.VllmAsyncGenerationWorker\n"
        "assert 'ray' in sys.modules and actor is m.VllmAsyncGenerationWorker\n"
        "import ray\n"
        "assert isinstance(actor, ray.actor.ActorClass)\n"
        "assert actor.configure_worker is a.NemoRlAsyncGenerationWorker.configure_worker\n"
        "assert m.VllmGenerationWorker is not actor\n"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
