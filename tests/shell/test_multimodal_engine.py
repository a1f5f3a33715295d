"""The worker's multimodal path on the real vLLM CPU engine, with the tiny Idefics3.

One VLM engine for the module (with the worker extension, so the refit tests can write
into it), started after a short-lived engine on weights B gave the reference tokens of a
fresh engine (in-process engines must not overlap: see ``engine_fixtures``). The module
runs before the first test that starts the session's text engine (file order).

- Differential: a batch mixing text-only rows and image rows equals raw ``LLM.generate``
  on the same engine, row by row (tokens and logprobs).
- BOS: the prompts vLLM sees hold one BOS, from a text prompt that starts with ``<s>``
  (vLLM's own text path makes it two) and from token ids (passed verbatim).
- Bad media: typed errors naming the row, each vLLM behaviour it guards against shown
  first, and the engine serves the next batch.
- The context: caps count the expanded prompt.
- A refit resets the prefix, processed-media and encoder caches: the next image request
  equals a fresh engine on the new weights (on vLLM 0.32 without the encoder-cache reset
  it fails with "Encoder cache miss"; on 0.25 it reuses the old weights' encoder outputs),
  vLLM's own mm-cache counters show the miss, and the worker's counters the resets.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import base_config, right_padded, sampled
from PIL import Image
from refit_helpers import REFIT_TIMEOUT, Trainer
from safetensors.torch import load_file
from vllm import LLM, SamplingParams
from vllm.inputs import TextPrompt, TokensPrompt
from vlm_helpers import BLUE, BOS, IMAGE, MAX_MODEL_LEN, MAX_NEW, PAD, RED, TEXT

from genworker.core.counters import CACHE_RESETS
from genworker.core.engine_calls import Cache
from genworker.demo.tiny_model import VLM_IMAGE_PROMPT_IDS, build_tiny_vlm
from genworker.shell.errors import BadBatchError
from genworker.shell.vllm_engine import VllmEngine
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def engine_kwargs(model: Path, *, extension: bool) -> dict[str, object]:
    from engine_fixtures import cpu_engine_kwargs

    kwargs = cpu_engine_kwargs(model)
    if not extension:
        kwargs.pop("worker_extension_cls", None)
    return {**kwargs, "limit_mm_per_prompt": {"image": 2}, "max_num_seqs": 4}


def start(model: Path, *, extension: bool) -> LLM:
    kwargs = engine_kwargs(model, extension=extension)
    return LLM(str(kwargs.pop("model")), **kwargs)


def ids(llm: LLM, text: str) -> list[int]:
    """``text``'s ids without special tokens (the caller adds the BOS)."""
    tokenizer: Any = llm.renderer.get_tokenizer()
    return list(tokenizer.encode(text, add_special_tokens=False))


def image_rows(llm: LLM) -> list[tuple[list[int], dict[str, Any] | None]]:
    """Text-only rows and image rows (one image, two images side by side), mixed."""
    return [
        ([BOS, *ids(llm, "Describe the image.")], None),
        ([BOS, *ids(llm, TEXT)], {"image": RED}),
        ([BOS, IMAGE, *ids(llm, TEXT)], {"image": [RED, BLUE]}),
        ([BOS, *ids(llm, "Hello")], None),
    ]


def as_batch(rows: Sequence[tuple[list[int], dict[str, Any] | None]]) -> dict[str, object]:
    data: dict[str, object] = dict(right_padded([p for p, _ in rows], pad=PAD))
    data["multi_modal_data"] = [m for _, m in rows]
    return data


def raw(
    llm: LLM, rows: Sequence[tuple[list[int], dict[str, Any] | None]], **params: Any
) -> list[tuple[list[int], list[float]]]:
    """Each row's tokens and sampled-token logprobs from raw ``LLM.generate``."""
    prompts = [
        TokensPrompt(prompt_token_ids=p, multi_modal_data=m)
        if m is not None
        else TokensPrompt(prompt_token_ids=p)
        for p, m in rows
    ]
    llm.reset_prefix_cache()
    outs = llm.generate(
        prompts, params.pop("per_row", None) or SamplingParams(**params), use_tqdm=False
    )
    return [sampled(out.outputs[0]) for out in outs]


def rows_of(
    out: dict[str, torch.Tensor], lengths: Sequence[int]
) -> list[tuple[list[int], list[float]]]:
    result = []
    for i, n in enumerate(lengths):
        g = int(out["generation_lengths"][i])
        result.append(
            (out["output_ids"][i, n : n + g].tolist(), out["logprobs"][i, n : n + g].tolist())
        )
    return result


def greedy_image_tokens(generate: Any, llm: LLM) -> list[list[int]]:
    """Greedy tokens of a text row and a red-image row (through ``generate``: the worker's
    or raw vLLM's)."""
    rows = image_rows(llm)[:2]
    if generate is None:
        return [t for t, _ in raw(llm, rows, max_tokens=MAX_NEW, temperature=0.0, logprobs=0)]
    out = generate(as_batch(rows), greedy=True)
    return [t for t, _ in rows_of(out, [len(p) for p, _ in rows])]


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-idefics3-b", seed=1)


@pytest.fixture(scope="module")
def reference_b(weights_b: Path) -> list[list[int]]:
    """Greedy image tokens of a fresh engine on weights B."""
    llm = start(weights_b, extension=False)
    try:
        return greedy_image_tokens(None, llm)
    finally:
        VllmEngine(llm).shutdown()


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir: Path, reference_b: list[list[int]]) -> Iterator[VllmEngine]:
    engine = VllmEngine(start(tiny_vlm_dir, extension=True))
    yield engine
    engine.shutdown()


def vlm_config(**changes: Any) -> dict[str, Any]:
    vllm_cfg = {"gpu_memory_utilization": 0.05, "max_model_len": MAX_MODEL_LEN}
    vllm_cfg.update(changes.pop("vllm_cfg", {}))
    top = {"model_name": "tiny-vlm", "max_new_tokens": MAX_NEW, "_pad_token_id": PAD, **changes}
    return base_config(vllm_cfg=vllm_cfg, **top)


@pytest.fixture
def worker(vlm: VllmEngine) -> Iterator[VllmGenerationWorker]:
    w = VllmGenerationWorker(vlm_config(), engine_factory=ExistingEngine(vlm))
    yield w
    vlm.reset_cache(Cache.PREFIX)


# -- the engine's multimodal capabilities ----------------------------------------------


def test_the_adapter_finds_the_placeholder_the_limit_and_the_expansion(vlm: VllmEngine) -> None:
    caps = vlm.capabilities
    assert (caps.multimodal, caps.image_token_id, caps.max_images) == (True, IMAGE, 2)
    rows = image_rows(vlm.llm)
    from genworker.shell.media import row_media

    media = row_media(as_batch(rows), len(rows), "test")
    assert media is not None
    lengths = vlm.expanded_lengths([p for p, _ in rows], media)
    extra = VLM_IMAGE_PROMPT_IDS - 1
    assert lengths == [
        len(rows[0][0]),
        len(rows[1][0]) + extra,
        len(rows[2][0]) + 2 * extra,
        len(rows[3][0]),
    ]


# -- differential ------------------------------------------------------------------------


def test_a_mixed_batch_equals_raw_vllm_row_by_row(
    worker: VllmGenerationWorker, vlm: VllmEngine
) -> None:
    rows = image_rows(vlm.llm)
    seeds = [11, 12, 13, 14]
    expected = raw(
        vlm.llm,
        rows,
        per_row=[
            SamplingParams(max_tokens=MAX_NEW, logprobs=0, temperature=1.0, seed=s) for s in seeds
        ],
    )
    vlm.reset_cache(Cache.PREFIX)
    data = as_batch(rows)
    out = worker.generate({**data, "seeds": seeds})
    lengths = [len(p) for p, _ in rows]
    assert rows_of(out, lengths) == expected
    # The caller's own ids come back, one placeholder per image, not vLLM's expansion.
    for i, (prompt, _) in enumerate(rows):
        assert out["output_ids"][i, : len(prompt)].tolist() == prompt
        assert int(out["unpadded_sequence_lengths"][i]) == len(prompt) + len(expected[i][0])


def test_the_context_cap_counts_the_expanded_prompt(vlm: VllmEngine) -> None:
    cfg = vlm_config(
        max_new_tokens=64, ignore_eos=True, vllm_cfg={"cap_max_tokens_to_context": True}
    )
    w = VllmGenerationWorker(cfg, engine_factory=ExistingEngine(vlm))
    prompt = [BOS, IMAGE] + [263] * 238  # 240 ids; the image makes it 246 in the context
    out = w.generate(as_batch([(prompt, {"image": RED}), ([BOS, 263], None)]), greedy=True)
    room = MAX_MODEL_LEN - (240 + VLM_IMAGE_PROMPT_IDS - 1)
    assert out["generation_lengths"].tolist() == [room, 64]
    assert int(out["unpadded_sequence_lengths"][0]) == 240 + room


# -- NeMo-RL's side channels -------------------------------------------------------------


def test_nemo_rl_side_channels_equal_vllm_on_the_prompts_nemo_rl_sends(
    worker: VllmGenerationWorker, vlm: VllmEngine
) -> None:
    """NeMo-RL's VLM batch (``vllm_content``, ``vllm_images``, its processor's expanded
    ``input_ids``) equals raw vLLM on what NeMo-RL sends it (``{"prompt": text,
    "multi_modal_data": ...}`` for a first turn, the ids of a text row), row by row, and
    the output keeps the caller's ids."""
    llm = vlm.llm
    two = "<image><image> Describe the image."
    rows: list[tuple[str, list[Image.Image]]] = [
        ("Describe the image.", []),  # a text row: its ids, as NeMo-RL
        (TEXT, [RED]),
        (two, [RED, BLUE]),
    ]
    # What NeMo-RL's processor hands over as input_ids: the expanded prompt.
    rendered = llm.generate(
        [
            TokensPrompt(prompt_token_ids=[BOS, *ids(llm, text)], multi_modal_data={"image": im})
            if im
            else TokensPrompt(prompt_token_ids=[BOS, *ids(llm, text)])
            for text, im in rows
        ],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
    )
    expanded = [list(out.prompt_token_ids or []) for out in rendered]
    assert [e.count(IMAGE) for e in expanded] == [
        0,
        VLM_IMAGE_PROMPT_IDS - 3,
        2 * (VLM_IMAGE_PROMPT_IDS - 3),
    ]
    seeds = [21, 22, 23]
    llm.reset_prefix_cache()
    reference = llm.generate(
        [
            TextPrompt(prompt=text, multi_modal_data={"image": im})
            if im
            else TokensPrompt(prompt_token_ids=expanded[0])
            for text, im in rows
        ],
        [SamplingParams(max_tokens=MAX_NEW, logprobs=0, temperature=1.0, seed=s) for s in seeds],
        use_tqdm=False,
    )
    expected = [sampled(answer.outputs[0]) for answer in reference]
    vlm.reset_cache(Cache.PREFIX)
    data: dict[str, object] = dict(right_padded(expanded, pad=PAD))
    data["vllm_content"] = [text for text, _ in rows]
    data["vllm_images"] = [im for _, im in rows]
    out = worker.generate({**data, "seeds": seeds})
    assert rows_of(out, [len(e) for e in expanded]) == expected
    for i, prompt in enumerate(expanded):
        assert out["output_ids"][i, : len(prompt)].tolist() == prompt
        assert int(out["unpadded_sequence_lengths"][i]) == len(prompt) + len(expected[i][0])
    # A later turn's shape (expanded ids, images, no text) vLLM would expand again: refused.
    with pytest.raises(BadBatchError, match=r"already expanded.*row 1"):
        worker.generate({**data, "vllm_content": [None] * 3})
    assert worker.generate({**data, "seeds": seeds})["output_ids"].shape[0] == 3


# -- BOS ---------------------------------------------------------------------------------


def test_one_bos_in_what_vllm_sees_from_text_and_from_token_ids(
    worker: VllmGenerationWorker, vlm: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = vlm.llm
    original = llm.generate
    seen: list[list[int]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        outs = original(*args, **kwargs)
        seen.extend(list(o.prompt_token_ids or []) for o in outs)
        return outs

    monkeypatch.setattr(llm, "generate", recording)
    media = [{"image": RED}, {"image": RED}]
    texts = worker.generate_text(
        {"prompts": [TEXT, "<s>" + TEXT], "multi_modal_data": media}, greedy=True
    )
    worker.generate(as_batch([([BOS, *ids(llm, TEXT)], {"image": RED})]), greedy=True)
    assert len(seen) == 3
    for prompt in seen:
        assert prompt[0] == BOS, prompt
        assert prompt[1] != BOS, prompt
        assert prompt.count(IMAGE) == VLM_IMAGE_PROMPT_IDS - 3  # expanded once, by vLLM
    assert seen[0] == seen[1] == seen[2]
    assert texts["texts"][0] == texts["texts"][1]
    # What the worker guards against: vLLM's own text path doubles an explicit BOS.
    monkeypatch.undo()
    (doubled,) = llm.generate(
        [TextPrompt(prompt="<s>" + TEXT, multi_modal_data={"image": RED})],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
    )
    assert (doubled.prompt_token_ids or [])[:2] == [BOS, BOS]
    assert vlm.tokenize(["<s>" + TEXT, TEXT]) == [[BOS, *ids(llm, TEXT)]] * 2


# -- bad media -------------------------------------------------------------------------


def test_what_vllm_does_with_bad_media_unchecked(vlm: VllmEngine) -> None:
    """The behaviours the worker's checks stand in front of (vLLM 0.32)."""
    llm = vlm.llm
    one = SamplingParams(max_tokens=1)
    prompt = [BOS, *ids(llm, TEXT)]
    with pytest.raises(AssertionError, match="prompt replacement"):
        llm.generate(
            [TokensPrompt(prompt_token_ids=prompt, multi_modal_data={"image": [RED, RED]})],
            one,
            use_tqdm=False,
        )
    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt, multi_modal_data={"image": RED})],
        one,
        use_tqdm=False,
    )
    expanded = list(out.prompt_token_ids or [])
    assert len(expanded) == len(prompt) + VLM_IMAGE_PROMPT_IDS - 1
    (again,) = llm.generate(
        [TokensPrompt(prompt_token_ids=expanded, multi_modal_data={"image": RED})],
        one,
        use_tqdm=False,
    )
    assert (
        len(again.prompt_token_ids or []) == len(expanded) + VLM_IMAGE_PROMPT_IDS - 1
    )  # expanded twice
    extra = [*prompt, IMAGE]
    (silent,) = llm.generate(
        [TokensPrompt(prompt_token_ids=extra, multi_modal_data={"image": RED})], one, use_tqdm=False
    )
    assert (silent.prompt_token_ids or []).count(
        IMAGE
    ) == VLM_IMAGE_PROMPT_IDS - 3 + 1  # one left as text


def truncated_png() -> Image.Image:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (0, 255, 0)).save(buf, format="PNG")
    data = buf.getvalue()
    return Image.open(io.BytesIO(data[: len(data) // 2]))


def test_bad_media_gets_typed_errors_naming_the_row_and_the_engine_serves_the_next_batch(
    worker: VllmGenerationWorker, vlm: VllmEngine
) -> None:
    llm = vlm.llm
    good = [BOS, *ids(llm, TEXT)]
    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=good, multi_modal_data={"image": RED})],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
    )
    expanded = list(out.prompt_token_ids or [])
    text_row: tuple[list[int], dict[str, Any] | None] = ([BOS, 263], None)
    cases: list[tuple[list[tuple[list[int], dict[str, Any] | None]], str]] = [
        (
            [text_row, (good, {"image": [RED, BLUE]})],
            r"more images than placeholder.*row 1 \(2 images, 1 placeholders\)",
        ),
        (
            [text_row, ([*good, IMAGE], {"image": RED})],
            r"more placeholder ids 4 than images.*row 1",
        ),
        (
            [text_row, (expanded, {"image": RED})],
            r"already expanded.*row 1 \(4 placeholders, 1 images\)",
        ),
        (
            [text_row, (good, {"image": truncated_png()})],
            r"multi_modal_data\[1\]\['image'\]\[0\] cannot be read",
        ),
        (
            [([BOS, IMAGE, IMAGE, IMAGE, 263], {"image": [RED, RED, RED]})],
            r"limit_mm_per_prompt image=2.*row 0",
        ),
    ]
    for rows, match in cases:
        with pytest.raises(BadBatchError, match=match):
            worker.generate(as_batch(rows))
    rows = image_rows(llm)
    expected = raw(llm, rows, max_tokens=MAX_NEW, temperature=0.0, logprobs=0)
    vlm.reset_cache(Cache.PREFIX)
    served = worker.generate(as_batch(rows), greedy=True)
    assert rows_of(served, [len(p) for p, _ in rows]) == expected


# -- caches around a refit ---------------------------------------------------------------


def refit(worker: VllmGenerationWorker, trainer: Trainer, weights: Path) -> None:
    """One IPC refit: the trainer process sends the checkpoint with ``RefitSender.ipc``
    (``refit_helpers.Trainer``) while the worker receives it."""
    state = load_file(weights / "model.safetensors")
    worker.prepare_refit_info({n: (t.shape, t.dtype) for n, t in state.items()})
    (address,) = worker.refit_address()
    trainer.submit("ipc", address=address, path=str(weights / "model.safetensors"))
    try:
        assert worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT) is True
    finally:
        sent = trainer.result()
    assert sent.ok, sent


def mm_cache_hits(worker: VllmGenerationWorker) -> float:
    return sum(
        v
        for k, v in worker.get_counters().items()
        if k.startswith("vllm:mm_cache_hits{") and isinstance(v, float)
    )


def test_a_refit_resets_the_caches_and_images_then_see_the_new_weights(
    worker: VllmGenerationWorker,
    vlm: VllmEngine,
    tiny_vlm_dir: Path,
    weights_b: Path,
    reference_b: list[list[int]],
) -> None:
    llm = vlm.llm
    on_a = greedy_image_tokens(worker.generate, llm)
    hits = mm_cache_hits(worker)
    assert greedy_image_tokens(worker.generate, llm) == on_a
    assert mm_cache_hits(worker) == hits + 1  # the red image came from vLLM's mm cache
    trainer = Trainer()
    try:
        refit(worker, trainer, weights_b)
        hits = mm_cache_hits(worker)
        on_b = greedy_image_tokens(worker.generate, llm)
        assert on_b == reference_b  # a fresh engine on B: no stale encoder output
        assert on_b != on_a
        assert mm_cache_hits(worker) == hits  # processed anew: the mm cache was reset
        counters = worker.get_counters()
        for cache in ("prefix", "mm", "encoder"):
            assert counters[f'{CACHE_RESETS}{{cache="{cache}"}}'] == 1.0
        assert worker.last_refit["reset_encoder_cache_seconds"] >= 0.0  # type: ignore[operator]
        refit(worker, trainer, tiny_vlm_dir)
        assert greedy_image_tokens(worker.generate, llm) == on_a
    finally:
        trainer.stop()
