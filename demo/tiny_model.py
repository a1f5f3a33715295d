"""Tiny random models with locally trained byte-level BPE tokenizers.

Tests, the demo and the benchmarks need models vLLM can load without downloading
anything. ``build_tiny_model`` writes a Llama (random weights from ``seed``, head_dim 64,
the smallest head size vLLM's CPU attention accepts) into ``path`` once;
``build_tiny_vlm`` writes an Idefics3 (the architecture SmolVLM uses, which vLLM serves on
CPU without torchvision): a SigLIP-like vision tower (hidden 64, 2 layers, 56 px images,
14 px patches), the pixel-shuffle connector and a Llama text model like the one above,
with a tokenizer that prepends ``<s>`` itself (so an explicit BOS in a text prompt would
double) and a processor without image splitting, so every image becomes the same
:data:`VLM_IMAGE_PROMPT_IDS` ids. Both build into a sibling temporary directory and rename
it into place, so concurrent builders never see or leave a half-written model; the loser
of a rename race discards its copy.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "CORPUS",
    "VLM_IMAGE_PROMPT_IDS",
    "VLM_IMAGE_SIZE",
    "build_tiny_model",
    "build_tiny_vlm",
]

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


_VLM_IMAGE_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
)
VLM_IMAGE_SIZE = 56
"""The tiny VLM's image side in pixels: every image is resized to fit it."""
_VLM_PATCH = 14
_VLM_SCALE = 2  # pixel shuffle: (56 / 14) ** 2 = 16 patches become 4 <image> ids
VLM_IMAGE_PROMPT_IDS = 3 + ((VLM_IMAGE_SIZE // _VLM_PATCH) ** 2) // _VLM_SCALE**2
"""How many prompt ids one ``<image>`` placeholder becomes in the tiny VLM:
``<fake_token_around_image><global-img><image>x4<fake_token_around_image>``."""


def build_tiny_model(path: Path, *, seed: int = 0, hidden: int = 128, layers: int = 2) -> Path:
    """Write the tiny model and tokenizer into ``path`` unless it already holds them.
    ``hidden`` (a multiple of 64: one head per 64) and ``layers`` scale it (the MLP is
    twice as wide as ``hidden``) for a benchmark that needs weights of some size; a path
    is built once, so give each size a path of its own."""
    if hidden < 64 or hidden % 64 or layers < 1:
        raise ValueError(f"hidden must be a multiple of 64 and layers >= 1: {hidden}, {layers}")
    return _build(
        Path(path), lambda out: _write_model(out, seed=seed, hidden=hidden, layers=layers)
    )


def build_tiny_vlm(path: Path, *, seed: int = 0, tiles: int = 1) -> Path:
    """Write the tiny Idefics3, its tokenizer and processor into ``path`` unless it
    already holds them. ``tiles=1``: every image is resized into one 56-pixel tile (no
    splitting). ``tiles=n > 1``: images are resized to ``n`` tiles on their longest edge and
    split (a grid of tiles plus the global image): vLLM 0.25 counts an image's patches with
    transformers' ``get_number_of_image_patches``, which says 0 for an image that fits one
    tile (measured on the H200, transformers 5.17), so a GPU test needs split images."""
    if tiles < 1:
        raise ValueError(f"tiles must be >= 1, got {tiles}")
    return _build(Path(path), lambda out: _write_vlm(out, seed=seed, tiles=tiles))


def _build(path: Path, write: Callable[[Path], None]) -> Path:
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(staging)
        try:
            staging.rename(path)
        except OSError:
            # Another builder won the race (or ``path`` exists but is not a model).
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _write_model(out: Path, *, seed: int, hidden: int, layers: int) -> None:
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
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
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


def _write_vlm(out: Path, *, seed: int, tiles: int) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )

    # transformers 5.x keeps a PIL-only image processor apart (no torchvision needed).
    image_processor = getattr(transformers, "Idefics3ImageProcessorPil", None)
    if image_processor is None:
        image_processor = transformers.Idefics3ImageProcessor

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[*_SPECIAL_TOKENS, *_VLM_IMAGE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([*CORPUS, "Describe the image in one short sentence."], trainer)
    bos_id = bpe.token_to_id("<s>")
    # Llama-style: the tokenizer prepends <s> itself when add_special_tokens=True.
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(_VLM_IMAGE_TOKENS)})
    images = image_processor(
        size={"longest_edge": VLM_IMAGE_SIZE * tiles},
        max_image_size={"longest_edge": VLM_IMAGE_SIZE},
        do_image_splitting=tiles > 1,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        do_pad=True,
    )
    processor = Idefics3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_len=VLM_IMAGE_PROMPT_IDS - 3,
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    tokenizer = processor.tokenizer
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=VLM_IMAGE_SIZE,
        patch_size=_VLM_PATCH,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
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
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=_VLM_SCALE,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)  # type: ignore[no-untyped-call]  # float32
    model.save_pretrained(out)
    processor.save_pretrained(out)
