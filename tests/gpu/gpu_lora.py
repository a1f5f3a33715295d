"""What the LoRA GPU test runs in its spawned processes (imported as ``gpu.gpu_lora``):
one CUDA engine per process (``gpu.gpu_fixtures``), each returning plain tensors.

:func:`merged_engine_main` starts the worker on the merged checkpoint (the tiny Llama with
adapter seed 1 merged in, ``shell.test_worker_lora_engine.merged_model``) and returns its
greedy outputs. :func:`lora_engine_main` starts the worker on the base checkpoint with
``enable_lora`` and drives the CPU test's sequence (``tests/shell/test_worker_lora_engine.py``,
whose helpers it calls): adapter 1 refit, adapter 2 refit, adapter 1 again, then a refit
whose stream fails half way; the outputs after each step, the weight versions and the
served adapters. The adapter goes from a thread of the engine's process over shared-memory
files (the CPU test's ``refit``): CUDA IPC cannot open a storage in the process that
exported it, and vLLM keeps adapters on the host anyway (``shell/refit/lora.py``).

Precision: float16. float32, the CPU test's dtype, is refused on CUDA by vLLM's Triton
LoRA kernel (``_lora_shrink`` asserts float16 or bfloat16 inputs,
vllm/lora/ops/triton_ops/lora_shrink_op.py). float16 rounds the merged weights to 11
significant bits where bfloat16 keeps 8: measured on CPU with transformers (both paths,
this adapter and these prompts, 12 greedy tokens), the logprobs of the two differ by at
most 1.0e-3 in float16 and 4.0e-3 in bfloat16, and the tightest top-2 logit gap of the
merged model's greedy path is 2.5e-3, which bfloat16 could flip.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from gpu.gpu_fixtures import gpu_config
from safetensors.torch import load_file
from shell.test_worker_lora_engine import (
    RANK,
    adapter,
    broken,
    greedy,
    info_of,
    refit,
)

from genworker.shell.errors import RefitError

__all__ = ["LORA_NEW_TOKENS", "Greedy", "LoraRun", "lora_config", "lora_engine_main",
           "merged_engine_main"]  # fmt: skip

LORA_NEW_TOKENS = 12  # the CPU test's


@dataclass(frozen=True)
class Greedy:
    """A greedy batch's ``output_ids`` and ``logprobs`` (on the host)."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    @classmethod
    def of(cls, out: tuple[torch.Tensor, torch.Tensor]) -> Greedy:
        ids, logprobs = out
        return cls(ids.cpu(), logprobs.cpu())


@dataclass(frozen=True)
class LoraRun:
    """What :func:`lora_engine_main` saw, step by step (see the module docstring)."""

    base: Greedy  # no adapter yet
    first: Greedy  # under adapter 1
    base_again: Greedy  # no adapter named, after the refit
    mixed_ids: torch.Tensor  # rows under adapter 1, the base model, adapter 1
    second: Greedy  # under adapter 2, which replaced adapter 1
    back: Greedy  # under adapter 1 again
    after_failure: Greedy  # under the name, after the failed refit
    sender_errors: list[str]  # of the three good refits
    failure: str  # the failed refit's RefitError ('' if none was raised)
    versions: dict[str, int]  # weight_version: before, first, back, after_failure
    adapters: dict[str, dict[str, int]]  # lora_adapters: first, back


def lora_config(model: Path, pad: int, *, lora: bool) -> dict[str, object]:
    """The GPU suite's config (``gpu_config``) in float16, 12 tokens past EOS (the CPU
    test's), and with ``lora``, vLLM's LoRA layers as the CPU test starts them."""
    cfg = gpu_config(model, pad)
    vllm_cfg = cfg["vllm_cfg"]
    assert isinstance(vllm_cfg, dict)
    cfg = {**cfg, "max_new_tokens": LORA_NEW_TOKENS, "ignore_eos": True,
           "vllm_cfg": {**vllm_cfg, "precision": "float16"}}  # fmt: skip
    if lora:
        cfg["vllm_kwargs"] = {"enable_lora": True, "max_lora_rank": RANK, "max_cpu_loras": 2}
    return cfg


def merged_engine_main(*, model: str, pad: int) -> Greedy:
    """A fresh engine on the merged checkpoint ``model``: its greedy outputs."""
    from genworker.shell.worker import VllmGenerationWorker

    worker = VllmGenerationWorker(lora_config(Path(model), pad, lora=False))
    try:
        return Greedy.of(greedy(worker))
    finally:
        worker.shutdown()


def lora_engine_main(*, model: str, pad: int) -> LoraRun:
    """The LoRA engine on the base checkpoint ``model``, through the adapter refits of the
    CPU test (see the module docstring)."""
    from genworker.shell.worker import VllmGenerationWorker

    weights = load_file(str(Path(model) / "model.safetensors"))
    first, second = adapter(weights, 1), adapter(weights, 2)
    worker = VllmGenerationWorker(lora_config(Path(model), pad, lora=True))
    try:
        versions = {"before": worker.weight_version}
        base = Greedy.of(greedy(worker))
        errors = refit(worker, "policy", first.items(), info_of(first))
        versions["first"] = worker.weight_version
        adapters = {"first": dict(worker.lora_adapters)}
        on_first = Greedy.of(greedy(worker, lora="policy"))
        base_again = Greedy.of(greedy(worker))
        mixed_ids, _ = greedy(worker, lora_names=["policy", None, "policy"])
        errors += refit(worker, "policy", second.items(), info_of(second))
        on_second = Greedy.of(greedy(worker, lora="policy"))
        errors += refit(worker, "policy", first.items(), info_of(first))
        versions["back"] = worker.weight_version
        adapters["back"] = dict(worker.lora_adapters)
        back = Greedy.of(greedy(worker, lora="policy"))
        failure = ""
        try:
            refit(worker, "policy", broken(second), info_of(second))
        except RefitError as e:
            failure = f"{type(e).__name__}: {e}"
        versions["after_failure"] = worker.weight_version
        return LoraRun(
            base=base,
            first=on_first,
            base_again=base_again,
            mixed_ids=mixed_ids.cpu(),
            second=on_second,
            back=back,
            after_failure=Greedy.of(greedy(worker, lora="policy")),
            sender_errors=[repr(e) for e in errors],
            failure=failure,
            versions=versions,
            adapters=adapters,
        )
    finally:
        worker.shutdown()
