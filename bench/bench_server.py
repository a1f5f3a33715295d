"""genworker's OpenAI server against vLLM's stock one, side by side on ONE engine.

Both are vLLM's own app (``build_app`` + ``init_app_state``) around the same ``AsyncLLM``
of one async worker, each on its own socket: the worker's (genworker's layer in front:
guard, prompt tokenization for the context budget, weight versions, in-flight accounting)
and a stock one (``genworker.shell.server.build_vllm_app``, nothing in front). The same
completion requests go to both (16 tokens, ``ignore_eos``, token ids and logprobs asked
for), with 1, 16 and 64 concurrent clients (httpx, one connection each), ``ROUNDS``
rounds of ``REQUESTS[n]`` requests per server and client count:

- ``server_rps_vs_stock_<n>``: genworker's requests per second over stock's in the same
  round (the two back to back), the median over the rounds (bar >= 0.95): a pair's ratio
  cancels what moves the whole host, the median drops an outlier round, where a best
  round of each decided the ratio by one outlier (as on the H200, run U);
- ``server_p50_vs_stock_<n>`` / ``server_p99_vs_stock_<n>``: latency, genworker over
  stock (bar <= 1.05), each server's percentile over the latencies of all its rounds
  pooled: ``server_latencies_<n>`` of them per server (at least ``MIN_LATENCIES``, so a
  p99 is the third-largest latency or beyond, not one round's maximum); plus the absolute
  figures for context;
- ``server_cpu_per_request_vs_stock_<n>``: this process's CPU time per request (median over
  the rounds; the clients' share is the same for both), genworker over stock: what the
  layer costs, less sensitive to the other load on a shared host than requests/s;
- ``server_layer_cpu_us_per_request``: the layer's own CPU per request (microseconds),
  in front of an app that answers at once, with the worker's own hooks (no HTTP, no
  engine): the part of the figures above that genworker's code can change.

Fairness (both servers share one process and event loop, so whatever the process does
between and during rounds falls on whichever round is running):

- **Rounds alternate their order** (stock first in even rounds, genworker first in odd
  ones): neither server always runs right after the other's round.
- **The garbage collector**: the process tracks ~700k objects after startup (vLLM, torch,
  transformers), so one full collection takes ~0.7 s on this host, a quarter of a
  64-client round; where one lands decided the round. As vLLM's own ``vllm serve`` does
  after startup (``freeze_gc_heap``, in its lifespan, which ``serve_on`` leaves off), the
  startup heap is frozen after the warm-up, and every round starts from a collection, so
  no round pays for the garbage of the round before.
- **HTTP metrics**: vLLM's ``build_app`` registers its HTTP Prometheus metrics in vLLM's
  process-wide registry; the second app built in one process hits "Duplicated timeseries"
  and silently records none. The stock app gets a registry of its own, so both record the
  same metrics per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CLIENTS = (1, 16, 64)
ROUNDS = 4
MIN_LATENCIES = 240  # per server and client count, pooled over the rounds
REQUESTS = {n: max(2 * n, -(-MIN_LATENCIES // ROUNDS)) for n in CLIENTS}  # per round
WARMUP = {1: 4, 16: 32, 64: 128}  # requests per server and client count, before the rounds
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


def request_body(model: str, i: int, tokens: int) -> dict[str, object]:
    """Completion request ``i`` of the benchmark: ``tokens`` sampled tokens with their ids
    and logprobs, on policy (temperature 1, top_p 1), seeded by ``i``."""
    return {
        "model": model,
        "prompt": f"request {i} of the benchmark says",
        "max_tokens": tokens,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 0,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": i,
    }


async def _round(
    url: str, model: str, clients: int, total: int | None = None, tokens: int = TOKENS
) -> tuple[float, list[float]]:
    """``total`` completions of ``tokens`` tokens (default: ``REQUESTS[clients]``) from
    ``clients`` concurrent clients, one connection each: requests/s and each latency."""
    import httpx

    total = REQUESTS[clients] if total is None else total
    todo = iter(range(total))
    latencies: list[float] = []

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            for i in todo:
                body = request_body(model, i, tokens)
                t = time.perf_counter()
                r = await c.post("/v1/completions", json=body)
                latencies.append(time.perf_counter() - t)
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return total / (time.perf_counter() - started), latencies


@contextlib.contextmanager
def _own_http_metrics() -> Iterator[None]:
    """vLLM's HTTP metrics of the app built inside go to a registry of its own."""
    import importlib

    from prometheus_client import CollectorRegistry

    module: Any = None
    with contextlib.suppress(ImportError):
        module = importlib.import_module("vllm.entrypoints.serve.instrumentator.metrics")
    if module is None or not hasattr(module, "get_prometheus_registry"):
        yield
        return
    shared = module.get_prometheus_registry
    module.get_prometheus_registry = CollectorRegistry
    try:
        yield
    finally:
        module.get_prometheus_registry = shared


async def _measured(url: str, model: str, clients: int) -> tuple[float, list[float], float]:
    """One round from a clean heap (see the module docstring): requests/s, latencies and
    this process's CPU seconds per request (clients, server and engine client together)."""
    await asyncio.sleep(0.05)  # the previous round's connections close
    gc.collect()
    cpu = time.process_time()
    rps, latencies = await _round(url, model, clients)
    return rps, latencies, (time.process_time() - cpu) / REQUESTS[clients]


async def _layer_cost(worker: Any) -> tuple[float, float]:
    """CPU microseconds per request of the bench's request through genworker's layer (as
    the worker configured it, the worker's own hooks) in front of an app that answers at
    once, and of that app alone: the layer's own cost, without HTTP or the engine."""
    from genworker.shell.server import RolloutLayer

    live = worker._http._layer
    assert live is not None

    async def answer(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    layer = RolloutLayer(
        answer,
        worker,
        rules=live.rules,
        decode=live.decode,
    )
    bodies = [json.dumps(request_body("m", i, TOKENS)).encode() for i in range(64)]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}

    async def one(app: Any, body: bytes) -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: Any) -> None:
            pass

        await app(dict(scope), receive, send)

    best: dict[str, float] = {}
    for _ in range(5):
        for name, app in (("alone", answer), ("layer", layer)):
            cpu = time.process_time()
            for _ in range(20):
                await asyncio.gather(*(one(app, b) for b in bodies))
            per = (time.process_time() - cpu) / (20 * len(bodies)) * 1e6
            best[name] = min(best.get(name, per), per)
    return best["layer"] - best["alone"], best["alone"]


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
        with _own_http_metrics():
            app = await build_vllm_app(worker.llm)
        server, task = await serve_on(app, sock)
        try:
            for n in CLIENTS:  # warm-up, both, every client count
                await _round(ours, str(model), n, WARMUP[n])
                await _round(stock, str(model), n, WARMUP[n])
            gc.collect()
            gc.freeze()
            figures: list[tuple[str, float]] = []
            pair = (("stock", stock), ("genworker", ours))
            for n in CLIENTS:
                cpu: dict[str, list[float]] = {"stock": [], "genworker": []}
                rates: dict[str, list[float]] = {"stock": [], "genworker": []}
                pooled: dict[str, list[float]] = {"stock": [], "genworker": []}
                for r in range(ROUNDS):
                    for name, url in pair if r % 2 == 0 else pair[::-1]:
                        rps, lat, per_request = await _measured(url, str(model), n)
                        cpu[name].append(per_request)
                        rates[name].append(rps)
                        pooled[name].extend(lat)
                best = {
                    name: (max(rates[name]), statistics.median(lat), _p(lat, 0.99))
                    for name, lat in pooled.items()
                }
                g, s = best["genworker"], best["stock"]
                paired = zip(rates["genworker"], rates["stock"], strict=True)
                figures += [
                    (f"server_rps_vs_stock_{n}", statistics.median(a / b for a, b in paired)),
                    (f"server_p50_vs_stock_{n}", g[1] / s[1]),
                    (f"server_p99_vs_stock_{n}", g[2] / s[2]),
                    (f"server_rps_genworker_{n}", g[0]),
                    (f"server_rps_stock_{n}", s[0]),
                    (f"server_p99_ms_genworker_{n}", 1e3 * g[2]),
                    (f"server_p99_ms_stock_{n}", 1e3 * s[2]),
                    (f"server_latencies_{n}", float(len(pooled["genworker"]))),
                    (
                        f"server_cpu_per_request_vs_stock_{n}",
                        statistics.median(cpu["genworker"]) / statistics.median(cpu["stock"]),
                    ),
                ]
            layer_us, _ = await _layer_cost(worker)
            figures.append(("server_layer_cpu_us_per_request", layer_us))
            return figures
        finally:
            gc.unfreeze()
            await stop_serving(server, task)
            sock.close()
    finally:
        await worker.shutdown()


def measure() -> list[tuple[str, float]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from genworker.demo.tiny_model import build_tiny_model

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
