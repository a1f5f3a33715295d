"""Reshard refit bytes for the tiny Llama at TP=2, from the plan alone (no transport).

The trainer is Megatron-style TP=2 (q, k, v, gate, up split on rows; o, down on
columns; the embedding and lm_head vocab-parallel when the vocabulary splits evenly;
norms replicated); the engine is vLLM at TP=2 with its fused ``qkv_proj`` and
``gate_up_proj``. ``core.reshard.plan_reshard`` gives the copies.

- ``reshard_bytes_vs_broadcast``: bytes the most-loaded engine rank receives through the
  plan over the bytes each rank receives from today's collective refit, which broadcasts
  every full tensor to every engine rank;
- ``reshard_sharded_bytes_vs_broadcast``: the same over the TP-sharded parameters only
  (exactly 1/TP by the plan's laws).

Then both refits of the same checkpoint run side by side on one TP=2 CPU engine (vLLM's
multiprocess executor, gloo), alternating, after one warm-up each: the reshard refit from
two trainer processes (``shell.reshard``: each sends only its slices, point to point) and
today's collective refit from one trainer (every full tensor broadcast to both ranks).

- ``reshard_time_vs_broadcast``: the median engine-side refit time (the RPC until every
  engine rank loaded) of the reshard over the broadcast's;
- ``reshard_measured_bytes_vs_broadcast``: the bytes the most-loaded engine rank counted
  receiving over those each rank received from the broadcast (equals the plan's);
- ``reshard_rank{r}_received_mb`` / ``broadcast_rank_received_mb``: per engine rank.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from genworker.core.joins import group_join, reshard_join
from genworker.core.refit_plan import DTYPE_ITEMSIZE
from genworker.core.reshard import (
    EngineShard,
    LayerKind,
    TrainerLayout,
    VllmParamFacts,
    megatron_layout,
    plan_reshard,
    vllm_shard,
)

__all__ = ["measure"]

TP = 2
DTYPE = "float32"


REPS = 5
TIMEOUT_S = 120.0


def tiny_model() -> Path:
    from genworker.demo.tiny_model import build_tiny_model

    cache = Path(os.environ.get("GENWORKER_MODEL_CACHE", tempfile.gettempdir()))
    return build_tiny_model(cache / "genworker-bench-tiny-llama")


def tiny_config() -> dict[str, int]:
    config: dict[str, int] = json.loads((tiny_model() / "config.json").read_text())
    return config


def layouts(config: dict[str, int]) -> tuple[list[TrainerLayout], list[EngineShard], set[str]]:
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    inter, heads = config["intermediate_size"], config["num_attention_heads"]
    kv_heads, head = config["num_key_value_heads"], config["head_dim"]
    groups = [[r] for r in range(TP)]
    trainer: list[TrainerLayout] = []
    engine: list[EngineShard] = []
    replicated: set[str] = set()

    def source(name: str, shape: tuple[int, ...], dim: int | None) -> tuple[str, tuple[int, ...]]:
        if dim is not None and shape[dim] % TP:
            dim = None  # Megatron would pad; a vocabulary that does not split is replicated
        trainer.append(megatron_layout(name, shape, DTYPE, dim, groups).unwrap())
        return name, shape

    def param(name: str, kind: LayerKind, *sources: tuple[str, tuple[int, ...]], **kw: int) -> None:
        if kind is LayerKind.REPLICATED:
            replicated.add(name)
        for rank in range(TP):
            facts = VllmParamFacts(name, kind, DTYPE, rank, TP, sources, **kw)
            engine.append(vllm_shard(facts).unwrap())

    embed = source("model.embed_tokens.weight", (vocab, hidden), 0)
    param("model.embed_tokens.weight", LayerKind.VOCAB, embed)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q = source(p + "self_attn.q_proj.weight", (heads * head, hidden), 0)
        k = source(p + "self_attn.k_proj.weight", (kv_heads * head, hidden), 0)
        v = source(p + "self_attn.v_proj.weight", (kv_heads * head, hidden), 0)
        param(
            p + "self_attn.qkv_proj.weight",
            LayerKind.QKV,
            q,
            k,
            v,
            head_size=head,
            num_heads=heads,
            num_kv_heads=kv_heads,
        )
        o = source(p + "self_attn.o_proj.weight", (hidden, heads * head), 1)
        param(p + "self_attn.o_proj.weight", LayerKind.ROW, o)
        gate = source(p + "mlp.gate_proj.weight", (inter, hidden), 0)
        up = source(p + "mlp.up_proj.weight", (inter, hidden), 0)
        param(p + "mlp.gate_up_proj.weight", LayerKind.MERGED, gate, up)
        down = source(p + "mlp.down_proj.weight", (hidden, inter), 1)
        param(p + "mlp.down_proj.weight", LayerKind.ROW, down)
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            param(p + norm, LayerKind.REPLICATED, source(p + norm, (hidden,), None))
    param("model.norm.weight", LayerKind.REPLICATED, source("model.norm.weight", (hidden,), None))
    head_w = source("lm_head.weight", (vocab, hidden), 0)
    param("lm_head.weight", LayerKind.VOCAB, head_w)
    return trainer, engine, replicated


def plan_figures() -> list[tuple[str, float]]:
    trainer, engine, replicated = layouts(tiny_config())
    plan = plan_reshard(trainer, engine).unwrap()
    broadcast = sum(_bytes(t) for t in trainer)  # every full tensor, to every rank
    received = max(plan.bytes_to(r) for r in range(TP))
    sharded = [c for c in plan.copies if c.param not in replicated]
    sharded_sources = {c.source for c in sharded}
    sharded_broadcast = sum(_bytes(t) for t in trainer if t.name in sharded_sources)
    sharded_received = max(sum(c.nbytes for c in sharded if c.dst_rank == r) for r in range(TP))
    return [
        ("reshard_bytes_vs_broadcast", received / broadcast),
        ("reshard_sharded_bytes_vs_broadcast", sharded_received / sharded_broadcast),
        ("reshard_copies", float(len(plan.copies))),
        ("reshard_broadcast_mb_per_rank", broadcast / 1e6),
    ]


def _bytes(layout: TrainerLayout) -> int:
    return math.prod(layout.shape) * DTYPE_ITEMSIZE[layout.dtype]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _trainer(commands: Any, results: Any, rank: int, port: int, path: str) -> None:
    """Reshard trainer rank ``rank``: its Megatron TP=2 slices of the checkpoint, sent
    once per command."""
    from safetensors.torch import load_file

    from genworker.shell.refit.reshard import ReshardSender, shards_of

    trainer, _, _ = layouts(tiny_config())
    tensors = load_file(path)
    local = {
        lt.name: tensors[lt.name][tuple(slice(a, b) for a, b in s.box)].clone()
        for lt in trainer
        for s in lt.shards
        if s.rank == rank
    }
    with ReshardSender(
        "127.0.0.1",
        port,
        2 * TP,
        rank=rank,
        train_world_size=TP,
        layouts=trainer,
        timeout_s=TIMEOUT_S,
    ) as sender:
        results.put("joined")
        sender.plan(shards_of(commands.get()))
        results.put("planned")
        while commands.get() is not None:
            results.put(sender.send(local).nbytes)


@contextlib.contextmanager
def _tp_engine(model: Path) -> Iterator[Any]:
    import vllm.envs
    from vllm import LLM

    from genworker.shell.vllm_engine import VllmEngine, engine_arg_names

    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    vllm.envs.disable_envs_cache()
    kwargs: dict[str, object] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 256,
        "seed": 0,
        "gpu_memory_utilization": 0.05,
        "worker_extension_cls": "genworker.shell.extension.WorkerExtension",
        "tensor_parallel_size": TP,
        "distributed_executor_backend": "mp",
    }
    if "kv_cache_memory_bytes" in engine_arg_names():
        kwargs["kv_cache_memory_bytes"] = 32 << 20
    try:
        llm = LLM(**kwargs)  # type: ignore[arg-type]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        vllm.envs.disable_envs_cache()
    try:
        yield llm
    finally:
        llm.collective_rpc("cleanup")
        VllmEngine(llm).shutdown()


def _rpc(llm: Any, method: str, *args: object, **kwargs: object) -> list[Any]:
    from genworker.shell.refit import raise_failures

    return raise_failures(llm.collective_rpc(method, args=args, kwargs=kwargs or None), method)


def transport_figures() -> list[tuple[str, float]]:
    """Both refits side by side on one TP=2 engine (see the module docstring)."""
    from safetensors.torch import load_file

    from genworker.shell.refit import RefitSender
    from genworker.shell.refit.reshard import refit_info

    model = tiny_model()
    path = str(model / "model.safetensors")
    tensors = load_file(path)
    manifest = {n: (t.shape, t.dtype) for n, t in tensors.items()}
    trainer, _, _ = layouts(tiny_config())
    ctx = multiprocessing.get_context("spawn")
    port, bport = _free_port(), _free_port()
    pipes = [(ctx.Queue(), ctx.Queue()) for _ in range(TP)]
    procs = [
        ctx.Process(target=_trainer, args=(*pipes[r], r, port, path), daemon=True)
        for r in range(TP)
    ]
    with _tp_engine(model) as llm:
        for proc in procs:
            proc.start()
        try:
            stages = reshard_join(0, ["127.0.0.1"], [port], 1, TP, 2 * TP, TIMEOUT_S).unwrap()
            _rpc(llm, "init_nccl_reshard_comm_group", stages.to_wire())
            assert all(results.get(timeout=TIMEOUT_S) == "joined" for _, results in pipes)
            summaries = _rpc(llm, "prepare_nccl_reshard_refit_info", refit_info(trainer))
            for commands, results in pipes:
                commands.put(summaries)
                assert results.get(timeout=TIMEOUT_S) == "planned"
            holder: list[RefitSender] = []
            join = threading.Thread(
                target=lambda: holder.append(
                    RefitSender.collective(
                        "127.0.0.1", bport, TP + 1, manifest=manifest, timeout_s=TIMEOUT_S
                    )
                )
            )
            join.start()
            group = group_join(0, "127.0.0.1", bport, TP + 1, 1, TIMEOUT_S).unwrap()
            _rpc(llm, "init_collective", group.to_wire())
            join.join(TIMEOUT_S)
            (broadcaster,) = holder
            _rpc(
                llm,
                "prepare_refit_info",
                {n: [list(t.shape), "float32"] for n, t in tensors.items()},
            )

            def reshard() -> tuple[float, list[int]]:
                for commands, _ in pipes:
                    commands.put("send")
                started = time.perf_counter()
                reports = _rpc(llm, "nccl_reshard_refit", refit_timeout_s=TIMEOUT_S)
                seconds = time.perf_counter() - started
                for _, results in pipes:
                    results.get(timeout=TIMEOUT_S)
                return seconds, [int(r["received_bytes"]) for r in reports]

            def broadcast() -> tuple[float, list[int]]:
                sent = threading.Thread(target=lambda: broadcaster.send(tensors.items()))
                sent.start()
                started = time.perf_counter()
                reports = _rpc(llm, "update_weights_from_collective", timeout_s=TIMEOUT_S)
                seconds = time.perf_counter() - started
                sent.join(TIMEOUT_S)
                return seconds, [int(r["nbytes"]) for r in reports]

            reshard(), broadcast()  # warm-up
            times: dict[str, list[float]] = {"reshard": [], "broadcast": []}
            for _ in range(REPS):
                for name, run in (("reshard", reshard), ("broadcast", broadcast)):
                    seconds, received = run()
                    times[name].append(seconds)
                    if name == "reshard":
                        reshard_bytes = received
                    else:
                        broadcast_bytes = received
            broadcaster.close()
        finally:
            for commands, _ in pipes:
                commands.put(None)
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    reshard_s, broadcast_s = (statistics.median(times[k]) for k in ("reshard", "broadcast"))
    return [
        ("reshard_time_vs_broadcast", reshard_s / broadcast_s),
        ("reshard_measured_bytes_vs_broadcast", max(reshard_bytes) / max(broadcast_bytes)),
        *((f"reshard_rank{r}_received_mb", b / 1e6) for r, b in enumerate(reshard_bytes)),
        ("broadcast_rank_received_mb", max(broadcast_bytes) / 1e6),
        ("reshard_refit_ms", reshard_s * 1e3),
        ("broadcast_refit_ms", broadcast_s * 1e3),
    ]


def measure() -> list[tuple[str, float]]:
    return plan_figures() + transport_figures()


if __name__ == "__main__":
    started = time.perf_counter()
    for key, value in measure():
        print(f"{key}={value:.4g}", flush=True)
    print(f"# bench_reshard took {time.perf_counter() - started:.1f} s")
