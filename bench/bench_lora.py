"""LoRA adapter refits on CPU: what an adapter-only refit costs next to a full refit of the
same model, and what generating under an adapter costs next to the merged weights.

Two workers, side by side in this process: ``full`` (no LoRA) and ``lora``
(``enable_lora``, rank 8). The adapter is PEFT's layout on every layer's q_proj and v_proj
(rank 8, alpha 16). Once on the tiny Llama (2 layers, hidden 128: 1.8 MB, where a refit's
fixed costs dominate), once on a small one (8 layers, hidden 1024: about 100M parameters,
420 MB in float32, where the bytes begin to count, as they do at a real model's size); the
small model's figures carry the suffix ``_small``.

- ``lora_refit_vs_full``: one adapter refit (``prepare_lora`` once, then ``update_lora``
  while a thread sends the adapter over IPC) into ``lora`` over one full IPC refit of the
  same model's weights, merged with that adapter, into ``full``: the median of adjacent
  pairs, the two alternating. (The full refit goes into the engine without LoRA: an
  engine started with ``enable_lora`` renames its adapted weights, docs/lora.md.)
- ``lora_generate_overhead``: a greedy batch under the adapter on ``lora`` over the same
  batch on ``full``, which then serves the merged weights: the median of adjacent pairs.
  (The two produce the same tokens: tests/shell/test_worker_lora_engine.py.)
- ``lora_refit_ms``, ``full_refit_ms``, ``adapter_mb``, ``model_mb``: for context.

The small model only refits (no generation figure: its batch costs seconds on 2 cores).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPEATS = 7
PAD = 2
RANK, ALPHA = 8, 16
PEFT = {"r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj"]}
PROMPTS = [[5, 17, 99, 240, 7, 31], [300, 12, 8, 41, 77, 6, 90], [45, 46, 47, 48, 49, 50, 51]]
TIMEOUT_S = 120.0


def _config(model: Path, lora: bool) -> dict[str, object]:
    kwargs: dict[str, object] = {"kv_cache_memory_bytes": 32 << 20, "max_num_batched_tokens": 8192}
    if lora:
        kwargs.update(enable_lora=True, max_lora_rank=RANK)
    return {
        "model_name": str(model),
        "max_new_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "ignore_eos": True,
        "_pad_token_id": PAD,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.05,
            "max_model_len": 128,
            "precision": "float32",
            "enforce_eager": True,
        },
        "vllm_kwargs": kwargs,
    }


def _adapter(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    out = {}
    for name, weight in sorted(base.items()):
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] in ("q_proj", "v_proj"):
            out[f"base_model.model.{module}.lora_A.weight"] = (
                torch.randn(RANK, weight.shape[1], generator=gen) * 0.3
            )
            out[f"base_model.model.{module}.lora_B.weight"] = (
                torch.randn(weight.shape[0], RANK, generator=gen) * 0.3
            )
    return out


def _merged(
    base: dict[str, torch.Tensor], lora: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    out = dict(base)
    for name, a in lora.items():
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = lora[name.replace("lora_A", "lora_B")]
            out[f"{module}.weight"] = base[f"{module}.weight"] + ALPHA / RANK * (b @ a)
    return out


@contextmanager
def _adapter_channel(worker: Any, lora: dict[str, torch.Tensor]) -> Iterator[Callable[[], float]]:
    """``push() -> seconds``: one adapter refit, sent from a thread."""
    from genworker.shell.refit import RefitSender

    info = {n: (t.shape, t.dtype) for n, t in lora.items()}
    (address,) = worker.prepare_lora(info, PEFT)
    with (
        RefitSender.ipc(str(address), manifest=info, timeout_s=TIMEOUT_S) as sender,
        ThreadPoolExecutor(1) as pool,
    ):

        def push() -> float:
            started = time.perf_counter()
            sent = pool.submit(sender.send, list(lora.items()))
            worker.update_lora("policy", timeout_s=TIMEOUT_S)
            sent.result(TIMEOUT_S)
            return time.perf_counter() - started

        yield push


def _mb(tensors: dict[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6


def _batch() -> dict[str, torch.Tensor]:
    data = {
        "input_ids": torch.full((len(PROMPTS), max(map(len, PROMPTS))), PAD),
        "input_lengths": torch.tensor([len(p) for p in PROMPTS]),
    }
    for i, p in enumerate(PROMPTS):
        data["input_ids"][i, : len(p)] = torch.tensor(p)
    return data


def _alternate(a: Callable[[], float], b: Callable[[], float]) -> tuple[list[float], list[float]]:
    """``REPEATS`` adjacent pairs (after one warm-up pair), the order alternating."""
    first: list[float] = []
    second: list[float] = []
    for k in range(REPEATS + 1):
        pair = [(a, first), (b, second)]
        for run, out in pair if k % 2 else pair[::-1]:
            took = run()
            if k:
                out.append(took)
    return first, second


SIZES = {"": {}, "_small": {"hidden": 1024, "layers": 8}}


def measure() -> list[tuple[str, float]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from genworker.demo.tiny_model import build_tiny_model

    cache = Path(os.environ.get("GENWORKER_MODEL_CACHE", tempfile.gettempdir()))
    out: list[tuple[str, float]] = []
    for suffix, size in SIZES.items():
        name = "genworker-bench-tiny-llama" + (
            f"-{size['hidden']}x{size['layers']}" if size else ""
        )
        model = build_tiny_model(cache / name, **size)
        out += [(key + suffix, v) for key, v in _measure(model, generate=not suffix)]
    return out


def _measure(model: Path, *, generate: bool) -> list[tuple[str, float]]:
    from safetensors.torch import load_file

    from genworker.demo.rl import refit_channel
    from genworker.shell.worker import VllmGenerationWorker

    base = load_file(model / "model.safetensors")
    lora = _adapter(base)
    merged = _merged(base, lora)
    workers = {
        "full": VllmGenerationWorker(_config(model, False)),
        "lora": VllmGenerationWorker(_config(model, True)),
    }
    batch = _batch()
    under: list[float] = []
    plain: list[float] = []
    try:
        with (
            refit_channel(workers["full"], merged) as full,
            _adapter_channel(workers["lora"], lora) as adapter,
        ):
            lora_s, full_s = _alternate(adapter, lambda: full(merged))

        def timed(worker: Any, **extra: object) -> Callable[[], float]:
            def run() -> float:
                started = time.perf_counter()
                worker.generate({**batch, **extra}, greedy=True)
                return time.perf_counter() - started

            return run

        if generate:
            under, plain = _alternate(timed(workers["lora"], lora="policy"), timed(workers["full"]))
    finally:
        for worker in workers.values():
            worker.shutdown()
    figures = [
        (
            "lora_refit_vs_full",
            statistics.median(a / b for a, b in zip(lora_s, full_s, strict=True)),
        )
    ]
    if generate:
        overhead = statistics.median(a / b for a, b in zip(under, plain, strict=True))
        figures.append(("lora_generate_overhead", overhead))
    return [
        *figures,
        ("lora_refit_ms", statistics.median(lora_s) * 1e3),
        ("full_refit_ms", statistics.median(full_s) * 1e3),
        ("adapter_mb", _mb(lora)),
        ("model_mb", _mb(merged)),
    ]


if __name__ == "__main__":
    for key, value in measure():
        print(f"{key}={value:.4g}")
