"""A tiny random Llama with a locally trained byte-level BPE tokenizer.

Tests, the demo and the benchmarks need a model vLLM can load without downloading
anything. ``build_tiny_model`` writes one (random weights from ``seed``, head_dim 64, the
smallest head size vLLM's CPU attention accepts) into ``path`` once: it builds into a
sibling temporary directory and renames it into place, so concurrent builders never see
or leave a half-written model; the loser of a rename race discards its copy.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

__all__ = ["CORPUS", "build_tiny_model"]

CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "To be or not to be, that is the question.",
    "All that glitters is not gold.",
    "The early bird catches the worm, but the second mouse gets the cheese.",
    "Once upon a time there was a small model that learned to count: one, two, three, four.",
    "Hello world! How are you today? I am fine, thank you.",
    "Reinforcement learning trains a policy from rewards collected during rollouts.",
    "The worker generates tokens, reports log probabilities and sleeps between steps.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
    "She sells sea shells by the sea shore.",
    "It was the best of times, it was the worst of times.",
    "Water boils at one hundred degrees and freezes at zero.",
    "Please answer the question in one short sentence.",
)

_VOCAB_SIZE = 512
_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")


def build_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Write the tiny model and tokenizer into ``path`` unless it already holds them."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _write_model(staging, seed=seed)
        try:
            staging.rename(path)
        except OSError:
            # Another builder won the race (or ``path`` exists but is not a model).
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _write_model(out: Path, *, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(CORPUS), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    vocab_size = bpe.get_vocab_size()

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]  # float32 by default
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
