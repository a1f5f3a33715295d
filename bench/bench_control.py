"""A weight update through the server's RL routes against the same update through the
Python API, side by side on ONE worker and ONE weight-transfer group (vLLM's wire over
gloo, ``shell.refit.vllm_wire``), the trainer in a process of its own as it is deployed
(TRL's trainer is not the server's process): it holds rank 0 of the group and, for the
routes, the HTTP client.

- routes: ``POST /start_weight_update``, ``POST /update_weights`` with the trainer's
  broadcasts meanwhile (``vllm_wire.send`` on a thread), ``POST /finish_weight_update``,
  one keep-alive connection;
- Python: the trainer asks the worker's process over a pipe (standing in for a Ray call)
  to run ``AsyncVllmGenerationWorker.update_weights_from_wire``, broadcasts meanwhile,
  and waits for its answer.

Both are timed by the trainer, from its first request to the last answer.

Both refit the whole tiny model, alternating its weights A and B so every update changes
them, the two paths alternating which goes first in a round; ``ROUNDS`` rounds.
``server_refit_vs_python``: the median of the rounds' route time over Python time (bar
<= 1.10); the absolute medians in milliseconds for context. Until this bench moved the
trainer out (stop 53), client, broadcasts and server shared one process and one event
loop, and the client's own CPU (about 2 ms a request here) counted against the routes.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

ROUNDS = 30
TIMEOUT_S = 60.0


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
            "http_server_weight_transfer_timeout_s": TIMEOUT_S,
        },
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20, "max_num_batched_tokens": 8192},
    }


def _trainer(
    conn: Connection, rpc: Connection, url: str, init: dict[str, object], files: list[str]
) -> None:
    """The trainer process: rank 0 of the group, then one command per update (``routes``
    or ``python``, the weights' index) until ``stop``; answers each with its seconds.
    ``python`` asks the worker over ``rpc``."""
    import threading

    import httpx
    from safetensors.torch import load_file

    from genworker.shell.refit.vllm_wire import send, trainer_group, update_info

    weights = [load_file(f) for f in files]
    conn.send("loaded")
    group = trainer_group(init, TIMEOUT_S)
    with httpx.Client(base_url=url, timeout=120.0) as client:
        while (command := conn.recv()) != "stop":
            what, index = command
            tensors = weights[index]
            started = time.perf_counter()
            if what == "python":
                rpc.send(index)
                send(group, tensors.items(), TIMEOUT_S)
                assert rpc.recv() == "updated"
            else:
                assert client.post("/start_weight_update", json={}).status_code == 200
                sender = threading.Thread(target=send, args=(group, tensors.items(), TIMEOUT_S))
                sender.start()
                body = {"update_info": update_info(tensors.items())}
                r = client.post("/update_weights", json=body)
                sender.join()
                assert r.status_code == 200, r.text
                assert client.post("/finish_weight_update", json={}).status_code == 200
            conn.send(time.perf_counter() - started)
    group.close()


async def _run(model: Path, model_b: Path) -> list[tuple[str, float]]:
    import socket

    import httpx
    from safetensors.torch import load_file

    from genworker.shell.async_worker import AsyncVllmGenerationWorker
    from genworker.shell.refit.vllm_wire import update_info

    files = [str(model / "model.safetensors"), str(model_b / "model.safetensors")]
    infos = [update_info(load_file(f).items()) for f in files]
    worker = AsyncVllmGenerationWorker(_config(model))
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    rpc, their_rpc = ctx.Pipe()
    trainer: mp.process.BaseProcess | None = None
    try:
        url = (await worker.start_http_server()).removesuffix("/v1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init = {"master_address": "127.0.0.1", "master_port": port}
        init |= {"rank_offset": 1, "world_size": 2, "packed": True}
        args = (theirs, their_rpc, url, init, files)
        trainer = ctx.Process(target=_trainer, args=args, daemon=True)
        trainer.start()
        theirs.close()
        their_rpc.close()
        assert await asyncio.to_thread(ours.recv) == "loaded"
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
            joined = await client.post("/init_weight_transfer_engine", json={"init_info": init})
            assert joined.status_code == 200, joined.text

        # The worker's end of the trainer's "Ray call": the loop reads the pipe as it reads
        # the server's sockets (a reader on its descriptor, no thread hop in between).
        calls: asyncio.Queue[int] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.add_reader(rpc.fileno(), lambda: calls.put_nowait(rpc.recv()))

        async def serve_rpc() -> None:
            while True:
                index = await calls.get()
                await worker.update_weights_from_wire(infos[index], TIMEOUT_S)
                rpc.send("updated")

        served = asyncio.ensure_future(serve_rpc())

        async def run(what: str, index: int) -> float:
            ours.send((what, index))
            took: float = await asyncio.to_thread(ours.recv)
            return took

        async def routes(index: int) -> float:
            return await run("routes", index)

        async def python(index: int) -> float:
            return await run("python", index)

        for i in range(4):  # warm-up
            await (routes if i % 2 else python)(i % 2)
        ratios: list[float] = []
        took: dict[str, list[float]] = {"routes": [], "python": []}
        for r in range(ROUNDS):
            order = (("routes", routes), ("python", python))
            times = {}
            for k, (name, fn) in enumerate(order if r % 2 else order[::-1]):
                times[name] = await fn((r + k) % 2)
                took[name].append(times[name])
            ratios.append(times["routes"] / times["python"])
        ours.send("stop")
        served.cancel()
        loop.remove_reader(rpc.fileno())
        return [
            ("server_refit_vs_python", statistics.median(ratios)),
            ("server_refit_ms", 1e3 * statistics.median(took["routes"])),
            ("python_refit_ms", 1e3 * statistics.median(took["python"])),
        ]
    finally:
        if trainer is not None:
            trainer.join(30)
            if trainer.is_alive():
                trainer.kill()
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
