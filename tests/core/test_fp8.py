"""The fp8 engine's weight routes: which tensors go in quantized, and their scales."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core.fp8 import (
    Fp8Layers,
    Fp8Target,
    block_scale_shape,
    fp8_layers,
    fp8_route,
    unsupported_problem,
)

PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
SHARDS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
BLOCKS = st.tuples(st.integers(1, 256), st.integers(1, 256))


def _layer(i: int, module: str) -> str:
    group = "self_attn" if module in ("qkv_proj", "o_proj", *SHARDS[:3]) else "mlp"
    return f"model.layers.{i}.{group}.{module}"


@st.composite
def engines(draw: st.DrawFn) -> tuple[Fp8Layers, dict[str, tuple[int, int]], set[str]]:
    """An engine of 1-3 layers: each linear module block-fp8, plain, or unsupported."""
    blocks: dict[str, tuple[int, int]] = {}
    unsupported: dict[str, str] = {}
    for i in range(draw(st.integers(1, 3))):
        for module in LINEAR:
            kind = draw(st.sampled_from(["block", "block", "plain", "unsupported"]))
            if kind == "block":
                blocks[_layer(i, module)] = draw(BLOCKS)
            elif kind == "unsupported":
                unsupported[_layer(i, module)] = "per-tensor fp8 scales"
        if draw(st.booleans()):  # fused MoE experts: their own sub-modules inside
            unsupported[f"model.layers.{i}.mlp.experts"] = "vLLM's Fp8MoEMethod"
    layers = Fp8Layers.of(blocks, PACKED, unsupported)
    return layers, blocks, set(unsupported)


names = st.tuples(
    st.integers(0, 3),
    st.sampled_from([*LINEAR, *SHARDS, "experts.3.gate_proj", "experts.0.down_proj"]),
    st.sampled_from(["weight", "bias", "weight_scale_inv"]),
).map(
    lambda t: (
        f"model.layers.{t[0]}.mlp.{t[1]}.{t[2]}"
        if t[1].startswith("experts")
        else f"{_layer(t[0], t[1])}.{t[2]}"
    )
)


def _owners(name: str) -> list[str]:
    """Every module a tensor name lies in, and the packed module of a shard among them."""
    module = name.rpartition(".")[0]
    parts = module.split(".")
    out = []
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        out.append(prefix)
        parent, _, leaf = prefix.rpartition(".")
        out += [f"{parent}.{p}" for p, shards in PACKED.items() if leaf in shards]
    return out


@given(engines(), names)
def test_a_tensor_is_refused_exactly_when_it_lies_in_an_unsupported_fp8_module(
    engine: tuple[Fp8Layers, dict[str, tuple[int, int]], set[str]], name: str
) -> None:
    layers, _, unsupported = engine
    route = fp8_route(name, layers)
    hit = [m for m in _owners(name) if m in unsupported]
    assert isinstance(route, Failure) is bool(hit)
    if hit:
        refused = route.failure()
        assert refused.tensor == name
        assert refused.module == hit[0]
        assert name in str(refused)
        assert "precision bfloat16" in str(refused)


@given(engines(), names)
def test_only_the_weight_of_a_block_fp8_module_or_its_shard_is_quantized(
    engine: tuple[Fp8Layers, dict[str, tuple[int, int]], set[str]], name: str
) -> None:
    layers, blocks, _ = engine
    route = fp8_route(name, layers)
    if isinstance(route, Failure):
        return
    module, _, leaf = name.rpartition(".")
    owner = next((m for m in _owners(name)[:2] if m in blocks), None)
    if leaf != "weight" or owner is None or "experts" in name:
        assert route == Success(None)
        return
    # the scales travel under the tensor's own module (vLLM's loader maps a shard's too)
    assert route == Success(Fp8Target(name, f"{module}.weight_scale_inv", blocks[owner]))


def test_a_shard_takes_its_packed_module_s_block() -> None:
    layers = Fp8Layers.of({"m.qkv_proj": (128, 64)}, PACKED)
    assert fp8_route("m.k_proj.weight", layers) == Success(
        Fp8Target("m.k_proj.weight", "m.k_proj.weight_scale_inv", (128, 64))
    )
    assert fp8_route("m.o_proj.weight", layers) == Success(None)
    top = Fp8Layers.of({"qkv_proj": (2, 2)}, PACKED)  # a module at the top of the tree
    assert fp8_route("v_proj.weight", top) == Success(
        Fp8Target("v_proj.weight", "v_proj.weight_scale_inv", (2, 2))
    )
    assert not Fp8Layers.of({}, PACKED).quantizes
    assert top.quantizes


@given(st.integers(1, 1000), st.integers(1, 1000), BLOCKS)
def test_a_block_scale_shape_covers_the_weight_with_partial_edge_blocks(
    rows: int, cols: int, block: tuple[int, int]
) -> None:
    scale_rows, scale_cols = block_scale_shape((rows, cols), block)
    for n, count, size in ((rows, scale_rows, block[0]), (cols, scale_cols, block[1])):
        assert (count - 1) * size < n <= count * size


def test_values_that_are_no_block_or_weight_are_refused() -> None:
    with pytest.raises(ValueError, match="2-D"):
        block_scale_shape((4, 4, 4), (2, 2))
    for bad in ((0, 128), (128,), (1.5, 2), (True, 4)):
        with pytest.raises(ValueError, match="two positive ints"):
            Fp8Target("w", "s", bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="two positive ints"):
            Fp8Layers.of({"m": bad})  # type: ignore[dict-item]


@given(st.lists(st.sampled_from([f"layer{i}" for i in range(9)]), unique=True))
def test_an_engine_with_unsupported_fp8_layers_is_refused_naming_them(modules: list[str]) -> None:
    layers = Fp8Layers.of({"ok": (128, 128)}, {}, {m: f"why {m}" for m in modules})
    problem = unsupported_problem(layers)
    if not modules:
        assert problem is None
        return
    assert problem is not None
    listed = sorted(modules)[:4]
    assert all(f"{m}: why {m}" in problem for m in listed)
    assert all(m not in problem for m in sorted(modules)[4:])
    assert (f"and {len(modules) - 4} more" in problem) is (len(modules) > 4)
    assert "precision bfloat16" in problem


def test_the_fp8_layers_are_read_off_vllm_s_methods() -> None:
    layers = fp8_layers(
        [
            ("qkv_proj", "Fp8LinearMethod", [128, 64], "dynamic"),  # vLLM keeps a list
            ("o_proj", "Fp8LinearMethod", None, "dynamic"),
            ("down_proj", "Fp8LinearMethod", (128, 128), "static"),
            ("experts", "Fp8MoEMethod", None, "dynamic"),
            ("attn", "Fp8KVCacheMethod", None, "dynamic"),
            ("lm_head", "UnquantizedLinearMethod", None, "dynamic"),
            ("", "NoneType", None, "dynamic"),
        ],
        {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
    )
    assert dict(layers.blocks) == {"qkv_proj": (128, 64)}
    assert dict(layers.packed) == {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    assert dict(layers.unsupported) == {
        "o_proj": "per-tensor fp8 scales (weight_block_size null)",
        "down_proj": "activation_scheme 'static' needs calibrated input scales",
        "experts": "vLLM's Fp8MoEMethod",
    }
    assert fp8_layers([], {}) == Fp8Layers()
