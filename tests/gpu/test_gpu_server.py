"""vLLM's OpenAI server around the async worker on CUDA (vLLM 0.25 on the runner), through
httpx: token ids, logprobs and weight versions on completions and chat, the on-policy
guard, the multi-turn prefix (or, where this vLLM cannot take chat prompt ids, its 501),
an in-flight refit applying to an HTTP request, 64 concurrent clients, and the port free
after shutdown.

One worker (one ``AsyncLLM``, one server) for the module; checkpoint B travels from a
trainer process over CUDA IPC as in ``test_gpu_async.py``; the shutdown test runs last.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gpu.gpu_fixtures import (
    GPU_MARKS,
    REFIT_TIMEOUT_S,
    Checkpoints,
    Trainer,
    gpu_config,
    ipc_trainer_main,
    manifest,
    run,
)

from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.server import VERSIONS_HEADER, chat_takes_prompt_ids

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def sworker(
    checkpoints: Checkpoints, loop: asyncio.AbstractEventLoop
) -> Iterator[AsyncVllmGenerationWorker]:
    config = gpu_config(checkpoints.a, checkpoints.pad)
    config["max_new_tokens"] = 224  # room for the in-flight refit's long request
    config["vllm_cfg"] = {
        **config["vllm_cfg"],  # type: ignore[dict-item]
        "async_engine": True,
        "cap_max_tokens_to_context": True,
        "expose_http_server": True,
        "http_server_serving_chat_kwargs": {"chat_template": TEMPLATE},
    }
    worker = AsyncVllmGenerationWorker(config)
    run(loop, worker.post_init_async())
    yield worker
    run(loop, worker.shutdown())


@pytest.fixture(scope="module")
def trainer(
    sworker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> Iterator[Trainer]:
    (address,) = run(loop, sworker.refit_address())
    t = Trainer(ipc_trainer_main, {"address": str(address)})
    yield t
    t.stop()


def client(worker: AsyncVllmGenerationWorker) -> httpx.AsyncClient:
    assert worker.base_url is not None
    return httpx.AsyncClient(base_url=worker.base_url.removesuffix("/v1"), timeout=120)


def versions(r: httpx.Response) -> list[int]:
    return [int(v) for v in r.headers[VERSIONS_HEADER].split(",")]


def test_completion_and_chat_carry_ids_logprobs_versions(
    sworker: AsyncVllmGenerationWorker, checkpoints: Checkpoints, loop: asyncio.AbstractEventLoop
) -> None:
    model = str(checkpoints.a)

    async def body() -> None:
        async with client(sworker) as c:
            r = await c.post(
                "/v1/completions",
                json={"model": model, "prompt": "hello world", "max_tokens": 8, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["prompt_token_ids"]
            assert len(choice["token_ids"]) == 8
            assert len(choice["logprobs"]["token_logprobs"]) == 8
            assert versions(r) == [sworker.weight_version]
            r = await c.post(
                "/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "ignore_eos": True,
                },
            )
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["prompt_token_ids"]
            assert len(out["choices"][0]["token_ids"]) == 4
            assert len(out["choices"][0]["logprobs"]["content"]) == 4
            off = await c.post(
                "/v1/completions", json={"model": model, "prompt": "x", "temperature": 0.3}
            )
            assert off.status_code == 400
            assert off.json()["error"]["param"] == "temperature"

    run(loop, body())


def test_a_second_turn_keeps_the_first_turn_ids(
    sworker: AsyncVllmGenerationWorker, checkpoints: Checkpoints, loop: asyncio.AbstractEventLoop
) -> None:
    model = str(checkpoints.a)

    async def body() -> None:
        async with client(sworker) as c:
            messages: list[dict[str, Any]] = [{"role": "user", "content": "first"}]
            one: dict[str, Any] = {}
            for seed in range(200):
                r = await c.post(
                    "/v1/chat/completions",
                    json={"model": model, "messages": messages, "max_tokens": 2, "seed": seed},
                )
                one = r.json()
                text = one["choices"][0]["message"]["content"]
                if text and "\ufffd" not in text and text.isprintable() and text.strip() == text:
                    break
            choice = one["choices"][0]
            messages += [
                {
                    "role": "assistant",
                    "content": choice["message"]["content"],
                    "prompt_token_ids": one["prompt_token_ids"],
                    "generation_token_ids": choice["token_ids"],
                },
                {"role": "user", "content": "second"},
            ]
            r = await c.post(
                "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2}
            )
            if not chat_takes_prompt_ids():
                assert r.status_code == 501
                assert "token ids" in r.json()["error"]["message"]
                return
            assert r.status_code == 200, r.text
            first = one["prompt_token_ids"] + choice["token_ids"]
            assert r.json()["prompt_token_ids"][: len(first)] == first

    run(loop, body())


def test_an_in_flight_refit_applies_to_an_http_request(
    sworker: AsyncVllmGenerationWorker,
    checkpoints: Checkpoints,
    trainer: Trainer,
    loop: asyncio.AbstractEventLoop,
) -> None:
    model = str(checkpoints.a)

    async def body() -> None:
        before = sworker.weight_version
        async with client(sworker) as c:
            # The trainer is already sending when the request starts: on the H200 (206e9b2)
            # a refit begun once the request was in flight (the trainer then loading B)
            # landed after its 224 tokens.
            await sworker.prepare_refit_info(manifest(checkpoints.b))
            trainer.send("send", (str(checkpoints.b), False))
            ev = asyncio.get_running_loop()
            await ev.run_in_executor(None, trainer.expect, "sending")
            request = asyncio.ensure_future(
                c.post(
                    "/v1/completions",
                    json={"model": model, "prompt": "long", "max_tokens": 224, "ignore_eos": True},
                )
            )
            async with asyncio.timeout(60):
                while sworker.num_unfinished() == 0:
                    await asyncio.sleep(0.001)
            assert await sworker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT_S)
            await ev.run_in_executor(None, trainer.expect, "sent")
            r = await request
            assert r.status_code == 200, r.text
            assert versions(r)[-1] == before + 1
            # back to checkpoint A for the other tests
            await sworker.prepare_refit_info(manifest(checkpoints.a))
            trainer.send("send", (str(checkpoints.a), False))
            await ev.run_in_executor(None, trainer.expect, "sending")
            assert await sworker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT_S)
            await ev.run_in_executor(None, trainer.expect, "sent")

    run(loop, body())


def test_64_concurrent_clients(
    sworker: AsyncVllmGenerationWorker, checkpoints: Checkpoints, loop: asyncio.AbstractEventLoop
) -> None:
    model = str(checkpoints.a)

    async def one(i: int) -> httpx.Response:
        async with client(sworker) as c:
            return await c.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": f"client {i}",
                    "max_tokens": 16,
                    "ignore_eos": True,
                },
            )

    async def body() -> list[httpx.Response]:
        async with asyncio.timeout(300):
            return await asyncio.gather(*(one(i) for i in range(64)))

    responses = run(loop, body())
    assert [r.status_code for r in responses] == [200] * 64


def test_shutdown_frees_the_port(
    sworker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> None:
    assert sworker.base_url is not None
    port = int(sworker.base_url.removesuffix("/v1").rsplit(":", 1)[1])
    run(loop, sworker.shutdown())
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", port))
    finally:
        probe.close()
