"""A local model on this machine, as genworker's CLI and its demo drive it: a NeMo-RL
generation config sized for the device, the model's tokenizer and pad id, prompts
right-padded into the worker's input tensors, and each row's completion decoded."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["completions", "device", "load_tokenizer", "pad_id", "pad_rows", "worker_config"]


def worker_config(
    model: str,
    *,
    pad_token_id: int,
    max_new_tokens: int,
    temperature: float,
    device: str,
    load_progress: bool = True,
) -> dict[str, object]:
    """A NeMo-RL generation config for ``model`` on this machine (``load_progress``:
    vLLM's bar while it loads the checkpoint)."""
    on_cpu = device == "cpu"
    kwargs: dict[str, object] = {"use_tqdm_on_load": False} if not load_progress else {}
    if on_cpu:
        # vLLM sizes the CPU KV cache from the NUMA node's memory minus the process's,
        # which can go negative on a small machine: ask for a fixed 32 MiB instead.
        kwargs["kv_cache_memory_bytes"] = 32 << 20
    return {
        "backend": "vllm",
        "model_name": model,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "_pad_token_id": pad_token_id,
        "seed": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.05 if on_cpu else 0.6,
            "max_model_len": 256 if on_cpu else 4096,
            "precision": "float32" if on_cpu else "bfloat16",
            "enforce_eager": on_cpu,
            "cap_max_tokens_to_context": True,
        },
        "vllm_kwargs": kwargs,
    }


def pad_rows(rows: Sequence[Sequence[int]], pad: int) -> dict[str, torch.Tensor]:
    """``{"input_ids", "input_lengths"}``: ``rows`` right-padded with ``pad``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows])}


def device() -> str:
    """``cuda`` where torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(model: str):  # type: ignore[no-untyped-def]
    """``model``'s Hugging Face tokenizer (after the torchvision check that transformers needs)."""
    from genworker.shell.install import check_torchvision

    check_torchvision()  # before transformers imports it (docs/install.md)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def pad_id(tokenizer: object) -> int:
    """The tokenizer's pad id, else its eos id; SystemExit when it has neither."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise SystemExit("the tokenizer has neither a pad nor an eos token: cannot pad a batch")
    return int(pad)


def completions(
    out: dict[str, torch.Tensor], lengths: torch.Tensor, tokenizer: object
) -> list[str]:
    """Each row's generated tokens of a worker's ``out``, decoded (special tokens skipped)."""
    decode = tokenizer.decode  # type: ignore[attr-defined]
    texts = []
    for i in range(out["output_ids"].shape[0]):
        start = int(lengths[i])
        stop = start + int(out["generation_lengths"][i])
        texts.append(
            str(decode(out["output_ids"][i, start:stop].tolist(), skip_special_tokens=True))
        )
    return texts
