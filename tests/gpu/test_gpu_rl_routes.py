"""vLLM's RL routes on genworker's server over vLLM's NCCL weight-transfer wire, driven by
TRL's own server-mode client (``trl.generation.vllm_client.VLLMClient``: ``/server_info``,
``/get_world_size``, ``init_communicator`` through ``/init_weight_transfer_engine``,
``update_model_params`` through start / update / finish with vLLM's packed NCCL
producer). NCCL needs the trainer and the engine on different GPUs: two GPUs (the engine
on GPU 0 in this process, the trainer in a child on GPU 1). After the update, greedy
tokens over HTTP equal a fresh engine's on checkpoint B.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from gpu.gpu_fixtures import (
    GPU_MARKS,
    MAX_NEW_TOKENS,
    PROMPTS,
    Checkpoints,
    Child,
    free_port,
    gpu_config,
    load_checkpoint,
    requires_two_gpus,
    run,
)
from gpu.gpu_trl import trl_trainer_main

from genworker.shell.async_worker import AsyncVllmGenerationWorker

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = [*GPU_MARKS, requires_two_gpus]


@pytest.fixture(scope="module")
def rworker(
    checkpoints: Checkpoints, loop: asyncio.AbstractEventLoop, reference_b: list[list[int]]
) -> Iterator[AsyncVllmGenerationWorker]:
    config = gpu_config(checkpoints.a, checkpoints.pad)
    config["vllm_cfg"] = {
        **config["vllm_cfg"],  # type: ignore[dict-item]
        "async_engine": True,
        "expose_http_server": True,
        "http_server_host": "0.0.0.0",  # TRL's client advertises this host's address
        "http_server_on_policy_guard": False,
        "http_server_rl_routes": True,
        "http_server_weight_transfer_timeout_s": 120.0,
    }
    worker = AsyncVllmGenerationWorker(config)
    run(loop, worker.post_init_async())
    yield worker
    run(loop, worker.shutdown())


def test_trls_server_mode_client_updates_the_weights_over_nccl(
    rworker: AsyncVllmGenerationWorker,
    checkpoints: Checkpoints,
    loop: asyncio.AbstractEventLoop,
    reference_b: list[list[int]],
) -> None:
    assert rworker.base_url is not None
    url = rworker.base_url.removesuffix("/v1")
    port = free_port()

    async def body() -> list[list[int]]:
        child = Child(trl_trainer_main, gpu=1, url=url, checkpoint=str(checkpoints.b), port=port)
        done = await asyncio.to_thread(child.result)
        assert done == {"world_size": 1, "tensors": len(load_checkpoint(checkpoints.b, "cpu"))}
        rows = []
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            for prompt in PROMPTS:
                r = await c.post(
                    "/v1/completions",
                    json={"prompt": list(prompt), "max_tokens": MAX_NEW_TOKENS, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                rows.append(r.json()["choices"][0]["token_ids"])
        return rows

    before = rworker.weight_version
    assert run(loop, body()) == reference_b
    assert rworker.weight_version == before + 1
