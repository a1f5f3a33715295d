"""``core.reshard.vllm_shard`` against the real CPU engine: the facts read from vLLM's
layers (class, ``output_dim`` / ``input_dim``, TP rank and size, fused sub-sizes, head
counts, vocabulary padding) give every parameter's local shape and, for fused layers,
vLLM's own per-source partition sizes.

vLLM's CPU backend repacks linear weights after loading (the ``weight`` parameter is left
empty and without ``output_dim``/``input_dim``), so for linear layers the local shape is
read from the layer (``output_partition_sizes``, ``input_size_per_partition``) and the
dims default to vLLM's unquantized layout (output 0, input 1)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from returns.result import Success

from genworker.core.reshard import LayerKind, VllmParamFacts, vllm_shard

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = pytest.mark.engine


Facts = tuple[VllmParamFacts, tuple[int, ...], tuple[int, ...] | None]


def engine_facts(model: torch.nn.Module) -> list[Facts]:
    """Every parameter's facts, its local shape, and a fused layer's partition sizes."""
    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    out = []
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}"
            shape = tuple(int(d) for d in param.shape)
            dtype = str(param.dtype).removeprefix("torch.")
            tp = (getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1))
            out_dim, in_dim = getattr(param, "output_dim", 0), getattr(param, "input_dim", 1)
            parts: tuple[int, ...] | None = None
            if isinstance(module, linear.LinearBase):
                layer = vars(module)  # plain attributes (nn.Module types them as modules)
                parts = tuple(int(n) for n in layer["output_partition_sizes"])
                shape = (sum(parts), int(layer["input_size_per_partition"]))
            facts: VllmParamFacts
            src: tuple[tuple[str, tuple[int, ...]], ...]
            if isinstance(module, vocab_parallel_embedding.VocabParallelEmbedding):
                src = ((name, (module.org_vocab_size, module.embedding_dim)),)
                facts = VllmParamFacts(
                    name,
                    LayerKind.VOCAB,
                    dtype,
                    *tp,
                    src,
                    output_dim=out_dim,
                    padding_size=module.padding_size,
                )
            elif isinstance(module, linear.QKVParallelLinear):
                hs, h, kv = module.head_size, module.total_num_heads, module.total_num_kv_heads
                src = tuple(
                    (f"{name}:{p}", (n * hs, module.input_size))
                    for p, n in (("q", h), ("k", kv), ("v", kv))
                )
                facts = VllmParamFacts(
                    name,
                    LayerKind.QKV,
                    dtype,
                    *tp,
                    src,
                    output_dim=out_dim,
                    head_size=hs,
                    num_heads=h,
                    num_kv_heads=kv,
                )
            elif isinstance(module, linear.MergedColumnParallelLinear):
                src = tuple(
                    (f"{name}:{i}", (size, module.input_size))
                    for i, size in enumerate(module.output_sizes)
                )
                facts = VllmParamFacts(name, LayerKind.MERGED, dtype, *tp, src, output_dim=out_dim)
            elif isinstance(module, linear.ColumnParallelLinear):
                src = ((name, (module.output_size, module.input_size)),)
                facts = VllmParamFacts(name, LayerKind.COLUMN, dtype, *tp, src, output_dim=out_dim)
            elif isinstance(module, linear.RowParallelLinear):
                src = ((name, (module.output_size, module.input_size)),)
                facts = VllmParamFacts(name, LayerKind.ROW, dtype, *tp, src, input_dim=in_dim)
            else:
                facts = VllmParamFacts(name, LayerKind.REPLICATED, dtype, *tp, ((name, shape),))
            out.append((facts, shape, parts))
    return out


def test_the_facts_of_the_real_engine_give_its_parameter_shapes(cpu_llm: LLM) -> None:
    (facts,) = cpu_llm.apply_model(engine_facts)
    kinds = {f.kind for f, _, _ in facts}
    assert {LayerKind.QKV, LayerKind.MERGED, LayerKind.ROW, LayerKind.VOCAB} <= kinds
    assert LayerKind.REPLICATED in kinds
    for f, shape, parts in facts:
        result = vllm_shard(f)
        assert isinstance(result, Success), (f.param, result)
        shard = result.unwrap()
        assert shard.shape == shape, f.param
        if parts is not None and len(parts) > 1:  # fused: vLLM's own per-source sizes
            assert tuple(p.dest_box[0][1] - p.dest_box[0][0] for p in shard.pieces) == parts


def _shell_facts(model: torch.nn.Module) -> list[tuple[VllmParamFacts, tuple[int, ...]]]:
    from genworker.shell.refit.reshard import engine_facts

    shapes = {n: tuple(int(d) for d in p.shape) for n, p in model.named_parameters()}
    return [(f, shapes[f.param]) for f in engine_facts(model)]


def test_the_shell_reads_the_same_facts_with_the_checkpoint_s_names(
    cpu_llm: LLM, tiny_model_dir: Path
) -> None:
    """``shell.reshard.engine_facts`` names every source as the checkpoint does (fused
    layers through ``packed_modules_mapping``) and its shards have the shapes vLLM gave
    the parameters (a CPU-repacked linear weight is empty: its layer's shape, as above)."""
    from safetensors.torch import load_file

    (pairs,) = cpu_llm.apply_model(_shell_facts)
    (expected,) = cpu_llm.apply_model(engine_facts)
    local = {f.param: shape for f, shape, _ in expected}
    checkpoint = {
        n: tuple(t.shape) for n, t in load_file(tiny_model_dir / "model.safetensors").items()
    }
    sources = {name: shape for f, _ in pairs for name, shape in f.sources}
    assert sources == checkpoint  # every checkpoint tensor, by its name and full shape
    kinds = {f.param: f.kind for f, _ in pairs}
    assert kinds["model.layers.0.self_attn.qkv_proj.weight"] is LayerKind.QKV
    assert kinds["model.layers.0.mlp.gate_up_proj.weight"] is LayerKind.MERGED
    for f, _ in pairs:
        result = vllm_shard(f)
        assert isinstance(result, Success), (f.param, result)
        assert result.unwrap().shape == local[f.param], f.param
