"""A local model on this machine, as genworker's CLI and its demo drive it: a NeMo-RL
generation config sized for the device (``core.cli_inputs.worker_config``), the model's
tokenizer and pad id, prompts right-padded into the worker's input tensors
(``core.batch.pad_rows``), and each row's completion decoded."""

from __future__ import annotations

import torch

from genworker.core.assembly import generated_ids
from genworker.core.batch import pad_rows
from genworker.core.cli_inputs import worker_config

__all__ = ["completions", "device", "load_tokenizer", "pad_id", "pad_rows", "worker_config"]


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
    return [str(decode(ids, skip_special_tokens=True)) for ids in generated_ids(out, lengths)]
