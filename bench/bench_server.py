"""genworker's OpenAI server against vLLM's stock one, side by side on ONE engine.

Both are vLLM's own app (``build_app`` + ``init_app_state``) around the same ``AsyncLLM``
of one async worker, each on its own socket: the worker's (genworker's layer in front:
guard, prompt tokenization for the context budget, weight versions, in-flight accounting)
and a stock one (``genworker.shell.server.build_vllm_app``, nothing in front). The same
completion requests go to both (16 tokens, ``ignore_eos``, token ids and logprobs asked
for), with 1, 16 and 64 concurrent clients (httpx, one connection each), alternating
stock / genworker rounds; per client count the best round of each is compared:

- ``server_rps_vs_stock_<n>``: requests per second, genworker over stock (bar >= 0.95);
- ``server_p50_vs_stock_<n>`` / ``server_p99_vs_stock_<n>``: latency, genworker over
  stock (bar <= 1.05); plus the absolute figures for context.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

CLIENTS = (1, 16, 64)
REQUESTS = {1: 4, 16: 32, 64: 128}
ROUNDS = 3
TOKENS = 16


def _config(model: Path) -> dict[str, object]:
    return {
        "model_name": str(model),
        "max_new_tokens": TOKENS,
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
            "cap_max_tokens_to_context": True,
            "expose_http_server": True,
        },
        "vllm_kwargs": {"kv_cache_memory_bytes": 64 << 20, "max_num_batched_tokens": 8192},
    }


async def _round(url: str, model: str, clients: int) -> tuple[float, list[float]]:
    import httpx

    total = REQUESTS[clients]
    todo = iter(range(total))
    latencies: list[float] = []

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            for i in todo:
                body = {
                    "model": model,
                    "prompt": f"request {i} of the benchmark says",
                    "max_tokens": TOKENS,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "logprobs": 0,
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "seed": i,
                }
                t = time.perf_counter()
                r = await c.post("/v1/completions", json=body)
                latencies.append(time.perf_counter() - t)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return total / (time.perf_counter() - started), latencies


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _run(model: Path) -> list[tuple[str, float]]:
    from genworker.shell.async_worker import AsyncVllmGenerationWorker
    from genworker.shell.server import bind_socket, build_vllm_app, serve_on, stop_serving

    worker = AsyncVllmGenerationWorker(_config(model))
    try:
        ours = (await worker.start_http_server()).removesuffix("/v1")
        sock = bind_socket("127.0.0.1", 0)
        stock = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server, task = await serve_on(await build_vllm_app(worker.llm), sock)
        try:
            await _round(ours, str(model), 16)  # warm-up, both
            await _round(stock, str(model), 16)
            figures: list[tuple[str, float]] = []
            for n in CLIENTS:
                best: dict[str, tuple[float, float, float]] = {}
                for _ in range(ROUNDS):
                    for name, url in (("stock", stock), ("genworker", ours)):
                        rps, lat = await _round(url, str(model), n)
                        p50, p99 = statistics.median(lat), _p(lat, 0.99)
                        if name not in best or rps > best[name][0]:
                            best[name] = (rps, p50, p99)
                g, s = best["genworker"], best["stock"]
                figures += [
                    (f"server_rps_vs_stock_{n}", g[0] / s[0]),
                    (f"server_p50_vs_stock_{n}", g[1] / s[1]),
                    (f"server_p99_vs_stock_{n}", g[2] / s[2]),
                    (f"server_rps_genworker_{n}", g[0]),
                    (f"server_rps_stock_{n}", s[0]),
                    (f"server_p99_ms_genworker_{n}", 1e3 * g[2]),
                    (f"server_p99_ms_stock_{n}", 1e3 * s[2]),
                ]
            return figures
        finally:
            await stop_serving(server, task)
            sock.close()
    finally:
        await worker.shutdown()


def measure() -> list[tuple[str, float]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from genworker.shell.tiny_model import build_tiny_model

    cache = Path(os.environ.get("GENWORKER_MODEL_CACHE", tempfile.gettempdir()))
    model = build_tiny_model(cache / "genworker-bench-tiny-llama")
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_run(model))
    finally:
        loop.close()


if __name__ == "__main__":
    for key, value in measure():
        print(f"{key}={value:.4g}")
