"""A weight update through the server's RL routes against the same update through the
Python API, side by side on ONE worker and ONE weight-transfer group (vLLM's wire over
gloo, ``shell.refit.vllm_wire``).

- routes: ``POST /start_weight_update``, ``POST /update_weights`` (the trainer's
  ``send`` on a thread meanwhile), ``POST /finish_weight_update``, one httpx client;
- Python: ``AsyncVllmGenerationWorker.update_weights_from_wire`` (the trainer's ``send``
  on a thread meanwhile).

Both refit the whole tiny model, alternating its weights A and B so every update changes
them, the two paths alternating which goes first in a round; ``ROUNDS`` rounds.
``server_refit_vs_python``: the median of the rounds' route time over Python time (bar
<= 1.10); the absolute medians in milliseconds for context.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROUNDS = 12


def _config(model: Path) -> dict[str, object]:
    return {
        "model_name": str(model),
        "max_new_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "_pad_token_id": 2,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.05,
            "max_model_len": 256,
            "precision": "float32",
            "enforce_eager": True,
            "async_engine": True,
            "expose_http_server": True,
            "http_server_rl_routes": True,
            "http_server_weight_transfer_timeout_s": 60.0,
        },
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20, "max_num_batched_tokens": 8192},
    }


async def _run(model: Path, model_b: Path) -> list[tuple[str, float]]:
    import httpx
    from safetensors.torch import load_file

    from genworker.shell.async_worker import AsyncVllmGenerationWorker
    from genworker.shell.refit.vllm_wire import send, trainer_group, update_info

    weights = [load_file(model / "model.safetensors"), load_file(model_b / "model.safetensors")]
    worker = AsyncVllmGenerationWorker(_config(model))
    try:
        url = (await worker.start_http_server()).removesuffix("/v1")
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init = {"master_address": "127.0.0.1", "master_port": port}
            init |= {"rank_offset": 1, "world_size": 2, "packed": True}
            joined, group = await asyncio.gather(
                client.post("/init_weight_transfer_engine", json={"init_info": init}),
                asyncio.to_thread(trainer_group, init, 60.0),
            )
            assert joined.status_code == 200, joined.text

            async def routes(tensors: dict[str, Any]) -> float:
                started = time.perf_counter()
                r = await client.post("/start_weight_update", json={})
                assert r.status_code == 200, r.text
                r, _ = await asyncio.gather(
                    client.post(
                        "/update_weights", json={"update_info": update_info(tensors.items())}
                    ),
                    asyncio.to_thread(send, group, tensors.items(), 60.0),
                )
                assert r.status_code == 200, r.text
                r = await client.post("/finish_weight_update", json={})
                assert r.status_code == 200, r.text
                return time.perf_counter() - started

            async def python(tensors: dict[str, Any]) -> float:
                started = time.perf_counter()
                await asyncio.gather(
                    worker.update_weights_from_wire(update_info(tensors.items()), 60.0),
                    asyncio.to_thread(send, group, tensors.items(), 60.0),
                )
                return time.perf_counter() - started

            for i in range(4):  # warm-up
                await (routes if i % 2 else python)(weights[i % 2])
            ratios, took = [], {"routes": [], "python": []}
            for r in range(ROUNDS):
                order = (("routes", routes), ("python", python))
                times = {}
                for k, (name, fn) in enumerate(order if r % 2 else order[::-1]):
                    times[name] = await fn(weights[(r + k) % 2])
                    took[name].append(times[name])
                ratios.append(times["routes"] / times["python"])
            group.close()
            return [
                ("server_refit_vs_python", statistics.median(ratios)),
                ("server_refit_ms", 1e3 * statistics.median(took["routes"])),
                ("python_refit_ms", 1e3 * statistics.median(took["python"])),
            ]
    finally:
        await worker.shutdown()


def measure() -> list[tuple[str, float]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from genworker.demo.tiny_model import build_tiny_model

    cache = Path(os.environ.get("GENWORKER_MODEL_CACHE", tempfile.gettempdir()))
    model = build_tiny_model(cache / "genworker-bench-tiny-llama")
    model_b = build_tiny_model(cache / "genworker-bench-tiny-llama-b", seed=1)
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_run(model, model_b))
    finally:
        loop.close()


if __name__ == "__main__":
    for key, value in measure():
        print(f"{key}={value:.4g}")
