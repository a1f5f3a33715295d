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

``reshard_time_vs_broadcast`` needs the point-to-point transport on the new refit
protocol and is not measured here.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

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


def tiny_config() -> dict[str, int]:
    from genworker.shell.tiny_model import build_tiny_model

    cache = Path(os.environ.get("GENWORKER_MODEL_CACHE", tempfile.gettempdir()))
    model = build_tiny_model(cache / "genworker-bench-tiny-llama")
    config: dict[str, int] = json.loads((model / "config.json").read_text())
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


def measure() -> list[tuple[str, float]]:
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


if __name__ == "__main__":
    started = time.perf_counter()
    for key, value in measure():
        print(f"{key}={value:.4g}", flush=True)
    print(f"# bench_reshard took {time.perf_counter() - started:.1f} s")
