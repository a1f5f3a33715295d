"""The demo's LoRA trainer side: a minimal LoRA in torch (``peft`` is not a dependency).

:func:`add_adapter` wraps each target ``nn.Linear`` of the policy in a
:class:`LoraLinear`, which adds ``(alpha / r) * B @ A`` to the frozen weight: PEFT's plain
LoRA (no dropout, no DoRA, no rsLoRA), initialised as PEFT does (``A`` Kaiming-uniform,
``B`` zero, so the adapted policy starts as the base model). Only ``A`` and ``B`` train.

The default targets are ``q_proj``, ``v_proj`` and ``lm_head`` (vLLM 0.32 adapts a
Llama's ``lm_head`` too: ``LogitsProcessorWithLoRA``). The output layer is needed for the
demo's task on its random tiny model: the final norm fixes the hidden state's size and
``lm_head``'s random rows are small (std 0.02), so no hidden state lifts one token's logit
much above the others'; measured on this CPU (4 prompts x 8 samples, 10 steps), adapters
on ``q_proj`` and ``v_proj`` alone left the reward at 0.05 for any learning rate from
2e-2 to 2e-1, on all seven linear layers of each block it reached 0.07 at most, while
``q_proj``, ``v_proj`` and ``lm_head`` took it to 0.99 at 5e-2. :func:`adapter_state` names them as PEFT saves them in
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` of shape
``(r, in)``, ``...lora_B.weight`` of ``(out, r)``) and :meth:`LoraSpec.peft_config` is the
``adapter_config`` beside them: the two things the worker's ``prepare_lora`` checks
(docs/lora.md) before an adapter refit moves them into vLLM's LoRA manager.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from genworker.core.lora import VLLM_MAX_LORA_RANKS

__all__ = [
    "PEFT_PREFIX",
    "LoraLinear",
    "LoraSpec",
    "adapter_state",
    "add_adapter",
    "tensor_bytes",
]

#: what PEFT puts before a module's path in an adapter's tensor names
PEFT_PREFIX = "base_model.model."


def _targets(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _rank(_: object, __: attrs.Attribute[Any], value: int) -> None:
    if value not in VLLM_MAX_LORA_RANKS:
        raise ValueError(f"the rank must be one of vLLM's {VLLM_MAX_LORA_RANKS}, got {value}")


@attrs.frozen
class LoraSpec:
    """The adapter: its rank, its alpha (the update is scaled by ``alpha / rank``) and the
    module names it adapts (the last part of a module's path)."""

    rank: int = attrs.field(default=8, validator=_rank)
    alpha: float = attrs.field(default=16.0)
    targets: tuple[str, ...] = attrs.field(
        default=("q_proj", "v_proj", "lm_head"), converter=_targets
    )

    @alpha.validator
    def _check_alpha(self, _: attrs.Attribute[Any], value: float) -> None:
        if not value > 0:
            raise ValueError(f"alpha must be positive, got {value!r}")

    @targets.validator
    def _check_targets(self, _: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
        if not value or not all(isinstance(t, str) and t for t in value):
            raise ValueError(f"targets must be non-empty module names, got {value!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self) -> dict[str, object]:
        """PEFT's ``adapter_config`` keys the worker reads."""
        return {"r": self.rank, "lora_alpha": self.alpha, "target_modules": list(self.targets)}


class LoraLinear(torch.nn.Module):
    """``base(x) + scaling * (x @ A.T) @ B.T``, the base layer frozen."""

    def __init__(self, base: torch.nn.Linear, rank: int, scaling: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scaling = scaling
        self.lora_A = torch.nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank))
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's init of A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        return out + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


def add_adapter(model: torch.nn.Module, spec: LoraSpec) -> dict[str, LoraLinear]:
    """Freeze ``model`` and wrap every ``nn.Linear`` named in ``spec.targets`` in a
    :class:`LoraLinear`; the wrapped modules by path (``model.layers.0.self_attn.q_proj``)."""
    model.requires_grad_(False)
    found = [
        (path, module)
        for path, module in model.named_modules()
        if path.rpartition(".")[2] in spec.targets and isinstance(module, torch.nn.Linear)
    ]
    if missing := set(spec.targets) - {path.rpartition(".")[2] for path, _ in found}:
        raise ValueError(f"the model has no linear layer named {sorted(missing)}")
    wrapped = {}
    for path, module in found:
        parent, _, name = path.rpartition(".")
        assert isinstance(module, torch.nn.Linear)
        layer = LoraLinear(module, spec.rank, spec.scaling)
        setattr(model.get_submodule(parent), name, layer)
        wrapped[path] = layer
    return wrapped


def adapter_state(modules: dict[str, LoraLinear]) -> dict[str, torch.Tensor]:
    """The adapter's tensors in PEFT's names (detached: the trainer's own storage)."""
    state = {}
    for path, layer in modules.items():
        state[f"{PEFT_PREFIX}{path}.lora_A.weight"] = layer.lora_A.detach()
        state[f"{PEFT_PREFIX}{path}.lora_B.weight"] = layer.lora_B.detach()
    return state


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """How many bytes the tensors hold."""
    return sum(t.numel() * t.element_size() for t in tensors)
