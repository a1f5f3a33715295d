"""fp8 rollouts: which weights an fp8 engine must be given quantized, and as what.

Theory of operation
-------------------
``vllm_cfg.precision: fp8`` starts vLLM with NeMo-RL's block-fp8 config
(``core.engine_plan``: ``quantization="fp8"`` and ``quant_method: fp8`` with
``weight_block_size`` 128 x 128, a *serialized* fp8 checkpoint to vLLM). vLLM's
``Fp8LinearMethod`` (``model_executor/layers/quantization/fp8.py``, 0.25 and 0.32) then
holds each linear layer's weight as ``float8_e4m3fn`` with one float32 scale per block
(``weight_scale_inv``: weight = fp8 value x scale), and its loader copies whatever arrives
into them. A bf16 weight (a bf16 checkpoint, a trainer's refit) would be cast to fp8 with
no scale while the scales keep their initial value, and the engine computes garbage (NaN
logprobs on vLLM 0.32's CPU build). NeMo-RL patches vLLM to quantize in its loader;
genworker quantizes every such weight on its way to vLLM's loader instead, as NeMo-RL's
``cast_tensor_to_fp8_blockwise`` does (scale = the block's largest magnitude / 448, the
largest e4m3 value; the weight divided by it, cast), and sends the scales after it under
the loader's name (``<module>.weight_scale_inv``). A tensor already in fp8 (a serialized
checkpoint) passes as it is, its scales being in the stream too.

:func:`fp8_route` decides for one name from a plain description of the engine
(:class:`Fp8Layers`): the module a name belongs to is its own, or the packed module whose
shard it is (vLLM's ``packed_modules_mapping``: ``q_proj`` of ``qkv_proj``). fp8 layers
this path cannot feed (per-tensor scales, static activation scales, fused MoE experts)
are listed as unsupported: a tensor on its way into one is refused by name
(:class:`Fp8Refused`), and the synchronous engine refuses itself when it starts
(:func:`unsupported_problem`), before any weight arrives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import attrs
from returns.result import Failure, Result, Success

from genworker.core.config import FrozenMap
from genworker.core.errors import CoreError

__all__ = [
    "FP8_E4M3_MAX",
    "Fp8Layers",
    "Fp8Refused",
    "Fp8Target",
    "block_scale_shape",
    "fp8_layers",
    "fp8_route",
    "unsupported_problem",
]

FP8_E4M3_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value: a block's scale maps its largest magnitude
onto it."""


def _is_block(value: object) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)
    )


def _block(_: object, attribute: attrs.Attribute[tuple[int, int]], value: object) -> None:
    if not _is_block(value):
        raise ValueError(f"{attribute.name} must be two positive ints, got {value!r}")


@attrs.frozen
class Fp8Layers:
    """The engine's fp8 layers: block-quantized linear modules by name with their block
    (rows, columns); vLLM's packed modules (packed name -> its shards' names); and the fp8
    modules this path cannot feed, each with why."""

    blocks: FrozenMap[str, tuple[int, int]] = attrs.field(factory=FrozenMap)
    packed: FrozenMap[str, tuple[str, ...]] = attrs.field(factory=FrozenMap)
    unsupported: FrozenMap[str, str] = attrs.field(factory=FrozenMap)

    def __attrs_post_init__(self) -> None:
        for module, block in self.blocks.items():
            if not _is_block(block):
                raise ValueError(f"the block of {module} must be two positive ints, got {block!r}")

    @classmethod
    def of(
        cls,
        blocks: Mapping[str, tuple[int, int]],
        packed: Mapping[str, Sequence[str]] | None = None,
        unsupported: Mapping[str, str] | None = None,
    ) -> Fp8Layers:
        return cls(
            FrozenMap.of(dict(blocks)),
            FrozenMap.of({k: tuple(v) for k, v in (packed or {}).items()}),
            FrozenMap.of(dict(unsupported or {})),
        )

    @property
    def quantizes(self) -> bool:
        """Whether any weight must be quantized on its way in."""
        return bool(self.blocks)


#: The vLLM method whose layers genworker feeds, and fp8 methods that hold no weights.
FEEDS: Final = "Fp8LinearMethod"
IGNORED: Final = frozenset({"Fp8KVCacheMethod"})  # fp8 KV cache scales: not weights


def fp8_layers(
    methods: Iterable[tuple[str, str, Sequence[int] | None, object]],
    packed: Mapping[str, Sequence[str]],
) -> Fp8Layers:
    """The fp8 layers of a model from each module's quantization method as vLLM built it
    (module name, method class name, ``weight_block_size``, its config's
    ``activation_scheme``) and its ``packed_modules_mapping``: block-quantized linear
    modules, and any other fp8 method (per-tensor or static scales, fused MoE experts)
    as unsupported, saying why."""
    blocks: dict[str, tuple[int, int]] = {}
    unsupported: dict[str, str] = {}
    for name, kind, block, scheme in methods:
        if not kind.startswith("Fp8") or kind in IGNORED:
            continue
        if kind != FEEDS:
            unsupported[name] = f"vLLM's {kind}"
        elif block is None:
            unsupported[name] = "per-tensor fp8 scales (weight_block_size null)"
        elif scheme != "dynamic":
            unsupported[name] = f"activation_scheme {scheme!r} needs calibrated input scales"
        else:
            blocks[name] = (int(block[0]), int(block[1]))
    return Fp8Layers.of(blocks, packed, unsupported)


@attrs.frozen
class Fp8Target:
    """A weight to quantize: its name, its scales' name, and the block."""

    name: str
    scale_name: str
    block: tuple[int, int] = attrs.field(validator=_block)


@attrs.frozen
class Fp8Refused(CoreError):
    """A tensor bound for an fp8 module this path cannot feed."""

    tensor: str
    module: str


def _shards(module: str, layers: Fp8Layers) -> list[str]:
    """``module`` and, when it is a packed module's shard, that packed module."""
    parent, _, leaf = module.rpartition(".")
    return [module] + [
        f"{parent}.{packed}" if parent else packed
        for packed, shards in layers.packed.items()
        if leaf in shards
    ]


def fp8_route(name: str, layers: Fp8Layers) -> Result[Fp8Target | None, Fp8Refused]:
    """How tensor ``name`` (a checkpoint or engine name) goes in: quantized (an
    :class:`Fp8Target`), as it is (``None``: not the weight of a block-fp8 module), or
    refused when it belongs to (a module inside) an unsupported fp8 module."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".")
    for prefix in (".".join(parts[:n]) for n in range(len(parts), 0, -1)):
        for owner in _shards(prefix, layers):
            why = layers.unsupported.get(owner)
            if why is not None:
                return Failure(
                    Fp8Refused(
                        f"tensor {name}: its module {owner} is an fp8 layer genworker "
                        f"cannot feed ({why}); use vllm_cfg.precision bfloat16",
                        tensor=name,
                        module=owner,
                    )
                )
    if leaf != "weight":
        return Success(None)
    for owner in _shards(module, layers):
        if owner in layers.blocks:
            return Success(Fp8Target(name, f"{module}.weight_scale_inv", layers.blocks[owner]))
    return Success(None)


def block_scale_shape(shape: Sequence[int], block: tuple[int, int]) -> tuple[int, int]:
    """The scales of a ``shape`` (rows, columns) weight: one per block, partial blocks at
    the edges included (vLLM's ``BlockQuantScaleParameter`` shape)."""
    if len(shape) != 2:
        raise ValueError(f"a block-quantized weight is 2-D, got shape {tuple(shape)}")
    rows, cols = shape
    return (-(-rows // block[0]), -(-cols // block[1]))


def unsupported_problem(layers: Fp8Layers) -> str | None:
    """Why an engine with these layers cannot take genworker's weights, or ``None``."""
    if not layers.unsupported:
        return None
    listed = "; ".join(f"{m}: {why}" for m, why in sorted(layers.unsupported.items())[:4])
    more = len(layers.unsupported) - 4
    return (
        "vllm_cfg.precision fp8: genworker quantizes weights for vLLM's block-fp8 linear "
        "layers only, and this engine has fp8 layers it cannot feed ("
        + listed
        + (f"; and {more} more" if more > 0 else "")
        + "); use precision bfloat16"
    )
