"""The fp8 engine's side of :mod:`genworker.core.fp8`, in each engine worker's process.

:func:`engine_fp8_layers` reads the fp8 layers off the model (vLLM's ``quant_method`` of
each module, ``packed_modules_mapping``); :func:`quantizing` turns a stream of weights into
what those layers take (each block-fp8 weight quantized block by block on its own device,
then its scales); the refit backends' loader (``shell.refit.engine.EngineContext.loader``)
runs every refit (IPC, collective, sparse, reshard, NeMo-RL's wires) through it: a hook
on the loader, not a transport of its own. :func:`prepare` is what an fp8 engine does once it
has started: refuse layers it cannot feed, and read a bf16 checkpoint again through
:func:`quantizing` (vLLM's own load cast it without scales).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from returns.result import Failure
from torch import nn

from genworker.core.fp8 import (
    FP8_E4M3_MAX,
    Fp8Layers,
    block_scale_shape,
    fp8_layers,
    fp8_route,
    unsupported_problem,
)
from genworker.shell.errors import RefitManifestError, UnsupportedError

__all__ = [
    "engine_fp8_layers",
    "fp8_loading",
    "prepare",
    "quantize_blockwise",
    "quantizing",
]

log = logging.getLogger(__name__)

Weights = Iterable[tuple[str, torch.Tensor]]
Loader = Callable[[Weights], object]  # vLLM's loaders return what they loaded, or None
FP8 = torch.float8_e4m3fn


_SEEN: weakref.WeakKeyDictionary[nn.Module, Fp8Layers] = weakref.WeakKeyDictionary()


def engine_fp8_layers(model: nn.Module) -> Fp8Layers:
    """The model's fp8 layers (``core.fp8.fp8_layers`` over each module's quantization
    method). Read once per model (a module's quantization method is fixed when vLLM
    builds it): every refit through the loader asks."""
    layers = _SEEN.get(model)
    if layers is None:
        layers = _SEEN[model] = _read_layers(model)
    return layers


def _read_layers(model: nn.Module) -> Fp8Layers:
    methods = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        block = getattr(method, "weight_block_size", None)
        scheme = getattr(getattr(method, "quant_config", None), "activation_scheme", "dynamic")
        methods.append((name, type(method).__name__, block, scheme))
    return fp8_layers(methods, getattr(model, "packed_modules_mapping", None) or {})


def quantize_blockwise(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-D) as ``float8_e4m3fn`` values and float32 scales, one per ``block``
    (partial blocks at the edges too): weight ~= value x scale, the block's largest
    magnitude mapped onto the largest e4m3 value."""
    rows, cols = weight.shape
    block_rows, block_cols = block_scale_shape(weight.shape, block)
    shape = (block_rows * block[0], block_cols * block[1])
    if shape == (rows, cols):
        whole = weight.contiguous()  # read as it is: no copy before the one division below
    else:  # partial blocks at the edges: zeros do not change a block's largest magnitude
        whole = weight.new_zeros(shape)
        whole[:rows, :cols] = weight
    blocks = whole.view(block_rows, block[0], block_cols, block[1])
    # the largest magnitude as max(max, -min): two reads, no |x| copy of the weight
    largest = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())
    scale = (largest.float() / FP8_E4M3_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    values = torch.div(blocks, scale[:, None, :, None])  # float32, a new tensor
    values = values.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8).view(shape)  # an all-zero block: 0
    if shape != (rows, cols):
        values = values[:rows, :cols].contiguous()
    return values, scale


def quantizing(weights: Weights, layers: Fp8Layers) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` as an fp8 engine's loader takes them (see the module docstring); a
    tensor bound for an fp8 layer this path cannot feed is a ``RefitManifestError``."""
    for name, tensor in weights:
        route = fp8_route(name, layers)
        if isinstance(route, Failure):
            raise RefitManifestError(str(route.failure()))
        target = route.unwrap()
        if target is None or tensor.dtype == FP8:  # a serialized checkpoint: scales follow
            yield name, tensor
            continue
        if tensor.dim() != 2:
            raise RefitManifestError(
                f"tensor {name}: an fp8 layer's weight is 2-D, got shape {tuple(tensor.shape)}"
            )
        values, scale = quantize_blockwise(tensor, target.block)
        yield name, values
        yield target.scale_name, scale


def fp8_loading(model: nn.Module, load: Loader) -> Loader:
    """``load`` (vLLM's weight loader), through :func:`quantizing` when ``model`` has
    block-fp8 layers."""
    layers = engine_fp8_layers(model)
    if not layers.quantizes:
        return load
    return lambda weights: load(quantizing(weights, layers))


def prepare(
    model: nn.Module, loader: Callable[[], Loader], worker: Any, checkpoint_format: str | None
) -> str | None:
    """Once an fp8 engine has started (on dummy weights: ``core.engine_plan.fp8_start``):
    why it cannot take genworker's weights, or ``None`` after reading its checkpoint in
    ``checkpoint_format`` through :func:`quantizing` (``None``: nothing to read, the
    weights come by refit)."""
    layers = engine_fp8_layers(model)
    problem = unsupported_problem(layers)
    config = worker.vllm_config
    if problem is not None or checkpoint_format is None:
        return problem
    import dataclasses

    from vllm.model_executor.model_loader import get_model_loader

    load_config = dataclasses.replace(config.load_config, load_format=checkpoint_format)
    checkpoint = get_model_loader(load_config)
    read = getattr(checkpoint, "get_all_weights", None)
    if not callable(read):
        raise UnsupportedError(
            f"precision fp8: vLLM's {type(checkpoint).__name__} cannot read the checkpoint "
            "again to quantize it"
        )
    loader()(read(config.model_config, model))
    log.info(
        "fp8: %s read again, %d layers quantized", config.model_config.model, len(layers.blocks)
    )
    return None
