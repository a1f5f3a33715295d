"""The worker's multimodal path against the fake engine: what reaches the engine (the
expanded lengths in the caps, the media beside the caller's ids), the call order of the
cache resets around a refit and before sleep, the counters, and bad media refused before
anything is submitted. The same claims about vLLM itself run in
``test_multimodal_engine.py``."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from helpers import base_config
from helpers import right_padded as batch
from PIL import Image

from genworker.core import lifecycle
from genworker.core.counters import CACHE_RESETS
from genworker.core.engine_calls import Cache
from genworker.shell.errors import BadBatchError, EngineStateError, RefitError
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.worker import VllmGenerationWorker

IMAGE = 5  # the fake VLM's placeholder id
EXPANSION = 7  # ids one placeholder stands for in the fake's context
MAX_MODEL_LEN = 48


def image(color: tuple[int, int, int] = (255, 0, 0), size: tuple[int, int] = (8, 6)) -> Image.Image:
    return Image.new("RGB", size, color)


def truncated_png() -> Image.Image:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (0, 255, 0)).save(buf, format="PNG")
    data = buf.getvalue()
    return Image.open(io.BytesIO(data[: len(data) // 2]))  # opens lazily, fails on load


def vlm_worker(
    *, image_token_id: int | None = IMAGE, **config: Any
) -> tuple[VllmGenerationWorker, FakeEngine]:
    factory = FakeEngineFactory(
        max_model_len=MAX_MODEL_LEN,
        image_token_id=image_token_id,
        image_prompt_ids=EXPANSION,
        max_images=2,
    )
    vllm_cfg = {"max_model_len": MAX_MODEL_LEN, **config.pop("vllm_cfg", {})}
    worker = VllmGenerationWorker(base_config(vllm_cfg=vllm_cfg, **config), engine_factory=factory)
    return worker, factory.started[-1][1]


def mixed() -> dict[str, object]:
    """Row 0 text only, row 1 one image, row 2 two images placed side by side."""
    data: dict[str, object] = dict(batch([[1, 2, 3], [1, IMAGE, 8, 9], [IMAGE, IMAGE, 4]]))
    data["multi_modal_data"] = [None, {"image": image()}, {"image": [image(), image((0, 0, 9))]}]
    return data


def test_caps_use_the_expanded_length_and_the_output_keeps_the_callers_ids() -> None:
    worker, engine = vlm_worker(vllm_cfg={"cap_max_tokens_to_context": True}, max_new_tokens=40)
    data = mixed()
    out = worker.generate(data, greedy=True)
    expanded = [3, 4 + (EXPANSION - 1), 3 + 2 * (EXPANSION - 1)]
    assert [spec.max_tokens for _, spec in engine.requests] == [
        min(40, MAX_MODEL_LEN - n) for n in expanded
    ]
    lengths = data["input_lengths"]
    assert isinstance(lengths, torch.Tensor)
    for row, (prompt, _) in enumerate(engine.requests):
        n, g = int(lengths[row]), int(out["generation_lengths"][row])
        assert out["output_ids"][row, :n].tolist() == prompt  # one placeholder per image
        assert int(out["unpadded_sequence_lengths"][row]) == n + g
        assert expanded[row] + g <= MAX_MODEL_LEN


def test_the_spec_decode_clamp_uses_the_expanded_length() -> None:
    k = 3
    worker, engine = vlm_worker(
        vllm_cfg={"speculative_config": {"method": "ngram", "num_speculative_tokens": k}},
        max_new_tokens=40,
    )
    worker.generate(mixed())
    expanded = [3, 4 + (EXPANSION - 1), 3 + 2 * (EXPANSION - 1)]
    assert [spec.max_tokens for _, spec in engine.requests] == [
        min(40, MAX_MODEL_LEN - n - (k + 1)) for n in expanded
    ]


def test_the_images_decide_the_tokens_of_their_row_only() -> None:
    worker, _ = vlm_worker()
    first = worker.generate(mixed(), greedy=True)
    other = mixed()
    media = other["multi_modal_data"]
    assert isinstance(media, list)
    media[1] = {"image": image((1, 2, 3))}
    second = worker.generate(other, greedy=True)
    assert torch.equal(first["output_ids"][[0, 2]], second["output_ids"][[0, 2]])
    assert not torch.equal(first["output_ids"][1], second["output_ids"][1])


def test_generate_text_carries_media_next_to_its_own_tokenization() -> None:
    worker, engine = vlm_worker()
    placeholder = "abcdefghijklmnopqrstuvwxyz"[IMAGE]  # the fake tokenises one letter per id
    texts = worker.generate_text(
        {"prompts": ["ab", f"a{placeholder}c"], "multi_modal_data": [None, {"image": image()}]},
        greedy=True,
    )["texts"]
    assert len(texts) == 2
    assert engine.calls[-4:] == ["tokenize", "expanded_lengths", "generate_text", "generate"]
    with pytest.raises(BadBatchError, match=r"row 0 \(1 images, 0 placeholders\)"):
        worker.generate_text({"prompts": ["ab"], "multi_modal_data": [{"image": image()}]})


def test_refit_resets_prefix_mm_and_encoder_caches_in_order_and_counters_show_them() -> None:
    worker, engine = vlm_worker()
    engine.rpc_handlers["update_weights_via_ipc_zmq"] = lambda timeout_s: engine.load_new_weights()
    worker.prepare_refit_info({"w": ((2,), "float32")})  # what a refit needs first
    assert worker.update_weights_via_ipc_zmq(timeout_s=1.0) is True
    assert engine.calls[-4:] == [
        "rpc:update_weights_via_ipc_zmq",
        "reset_prefix_cache",
        "reset_mm_cache",
        "reset_encoder_cache",
    ]
    assert {"reset_mm_cache_seconds", "reset_encoder_cache_seconds"} <= set(worker.last_refit)
    worker.generate(mixed())
    counters = worker.get_counters()
    for cache in ("prefix", "mm", "encoder"):
        assert counters[f'{CACHE_RESETS}{{cache="{cache}"}}'] == 1.0


def test_sleep_resets_the_multimodal_caches_before_it_sleeps() -> None:
    worker, engine = vlm_worker()
    worker.sleep(level=1)
    assert engine.calls[-4:] == [
        "reset_prefix_cache",
        "reset_mm_cache",
        "reset_encoder_cache",
        "sleep(1)",
    ]
    assert (engine.mm_cache_resets, engine.encoder_cache_resets) == (1, 1)


def test_a_text_only_engine_resets_only_its_prefix_cache() -> None:
    worker, engine = vlm_worker(image_token_id=None)
    engine.rpc_handlers["update_weights_via_ipc_zmq"] = lambda timeout_s: engine.load_new_weights()
    worker.prepare_refit_info({"w": ((2,), "float32")})  # what a refit needs first
    worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    worker.generate(batch([[4, 5]]))  # fills the caches again: the sleep resets them
    worker.sleep(level=1)
    assert (engine.prefix_cache_resets, engine.mm_cache_resets, engine.encoder_cache_resets) == (
        2,
        0,
        0,
    )
    assert set(worker.last_refit) == {"engine_workers", "rpc_seconds", "reset_prefix_cache_seconds"}


def with_media(rows: list[list[int]], media: object) -> dict[str, object]:
    data: dict[str, object] = dict(batch(rows))
    data["multi_modal_data"] = media
    return data


BAD = [
    pytest.param(
        with_media([[1, IMAGE]], [{"image": image()}] * 2), "2 entries for 1 rows", id="rows"
    ),
    pytest.param(with_media([[1, IMAGE]], {"image": image()}), "must be a list", id="not-a-list"),
    pytest.param(with_media([[1, IMAGE]], ["img"]), r"\[0\] must be None or a mapping", id="entry"),
    pytest.param(
        with_media([[1, IMAGE]], [{"video": [image()]}]), r"only 'image' is supported", id="video"
    ),
    pytest.param(
        with_media([[1, IMAGE]], [{"image": b"png"}]), r"\['image'\]\[0\] must be a PIL", id="bytes"
    ),
    pytest.param(
        with_media([[1], [1, IMAGE, 2, IMAGE]], [None, {"image": [image(), truncated_png()]}]),
        r"multi_modal_data\[1\]\['image'\]\[1\] cannot be read",
        id="unreadable",
    ),
    pytest.param(
        with_media([[1], [1, IMAGE]], [None, {"image": image(size=(0, 4))}]),
        r"\[1\]\['image'\]\[0\] is empty",
        id="empty-image",
    ),
    pytest.param(
        with_media([[1, IMAGE], [1, 2]], [{"image": image()}, {"image": image()}]),
        r"more images than placeholder.*row 1 \(1 images, 0 placeholders\)",
        id="extra-image",
    ),
    pytest.param(
        with_media([[1, IMAGE, IMAGE, 2]], [{"image": image()}]),
        r"already expanded.*row 0 \(2 placeholders, 1 images\)",
        id="expanded",
    ),
    pytest.param(
        with_media([[1, IMAGE, 2, IMAGE]], [{"image": image()}]),
        r"more placeholder ids 5 than images.*row 0",
        id="missing-image",
    ),
    pytest.param(
        with_media([[IMAGE, 2, IMAGE, 2, IMAGE]], [{"image": [image()] * 3}]),
        r"limit_mm_per_prompt image=2.*row 0 \(3 images\)",
        id="limit",
    ),
    pytest.param(
        with_media([[1, IMAGE] + [3] * 42], [{"image": image()}]),
        r"no room to generate under max_model_len 48: row 0 \(length 44, expanded 50\)",
        id="context",
    ),
    pytest.param(
        {**batch([[1]]), "vllm_images": [[image()]]},
        r"more images than placeholder.*row 0 \(1 images, 0 placeholders\)",
        id="nemo-rl-no-placeholder",
    ),
]


@pytest.mark.parametrize(("data", "match"), BAD)
def test_bad_media_is_refused_before_the_engine_and_the_next_batch_is_served(
    data: dict[str, object], match: str
) -> None:
    worker, engine = vlm_worker()
    with pytest.raises(BadBatchError, match=match):
        worker.generate(data)
    assert "generate" not in engine.calls
    assert worker.generate(mixed())["output_ids"].shape[0] == 3


def test_empty_nemo_rl_side_channels_are_ignored_as_nemo_rl_does() -> None:
    worker, engine = vlm_worker()
    data = {**batch([[1, 2], [3]]), "vllm_images": [[], []], "vllm_content": [None, None]}
    assert worker.generate(data)["output_ids"].shape[0] == 2
    # A row's text without images: NeMo-RL generates from the row's ids, and so does this.
    worker.generate({**data, "vllm_content": [None, "a hi"]})
    assert [p for p, _ in engine.requests[-2:]] == [[1, 2], [3]]


# -- NeMo-RL's side channels: vllm_images and vllm_content ---------------------------------

PLACEHOLDER = "abcdefghijklmnopqrstuvwxyz"[IMAGE]  # the fake tokenises one letter per id


def nemo_rl_batch() -> dict[str, object]:
    """NeMo-RL's shape: its processor's expanded ids, the conversation as text, the images.
    Row 0 text only; row 1 a first turn (text and image); row 2 a later turn (ids and
    image, vllm_content None)."""
    expanded = [0, 1, *[IMAGE] * EXPANSION, 2]  # "ab<image>c" as a processor expands it
    data: dict[str, object] = dict(batch([[1, 2, 3], expanded, [1, IMAGE, 8, 9]]))
    data["vllm_content"] = [None, f"ab{PLACEHOLDER}c", None]
    data["vllm_images"] = [[], [image()], [image((0, 0, 9))]]
    return data


def test_nemo_rl_side_channels_start_a_row_from_its_text_and_keep_the_callers_ids() -> None:
    worker, engine = vlm_worker(vllm_cfg={"cap_max_tokens_to_context": True}, max_new_tokens=40)
    data = nemo_rl_batch()
    out = worker.generate(data, greedy=True)
    sent = engine.requests[-3:]
    # What the engine started from: the ids, the text's ids (one placeholder), the ids.
    assert [p for p, _ in sent] == [[1, 2, 3], [0, 1, IMAGE, 2], [1, IMAGE, 8, 9]]
    # The caps count what the context holds: the text's ids expanded, not the caller's ids.
    expanded = [3, 4 + EXPANSION - 1, 4 + EXPANSION - 1]
    assert [spec.max_tokens for _, spec in sent] == [min(40, MAX_MODEL_LEN - n) for n in expanded]
    # The same rows through multi_modal_data with the engine's prompts: the same tokens.
    same = worker.generate(
        {
            **batch([p for p, _ in sent]),
            "multi_modal_data": [None, {"image": image()}, {"image": image((0, 0, 9))}],
        },
        greedy=True,
    )
    lengths = data["input_lengths"]
    assert isinstance(lengths, torch.Tensor)
    for row, (prompt, _) in enumerate(sent):
        n, g = int(lengths[row]), int(out["generation_lengths"][row])
        assert g == int(same["generation_lengths"][row])
        generated = same["output_ids"][row, len(prompt) : len(prompt) + g]
        assert torch.equal(out["output_ids"][row, n : n + g], generated)
        assert out["output_ids"][row, :n].tolist() == data["input_ids"][row, :n].tolist()  # type: ignore[index]
        assert int(out["unpadded_sequence_lengths"][row]) == n + g


NEMO_RL_BAD = [
    pytest.param({"vllm_audios": [[], [b"wav"], []]}, r"\['vllm_audios'\] carry audio", id="audio"),
    pytest.param({"vllm_videos": [[], [], [[image()]]]}, r"\['vllm_videos'\]", id="video"),
    pytest.param(
        {"multi_modal_data": [None, {"image": image()}, None]},
        r"both data\['multi_modal_data'\] and data\['vllm_images'\].*keep one",
        id="two-ways-in",
    ),
    pytest.param({"vllm_images": [[image()]]}, r"\['vllm_images'\] has 1 entries for 3", id="rows"),
    pytest.param(
        {"vllm_content": ["ab", "abfc"]}, r"\['vllm_content'\] has 2 entries for 3", id="text-rows"
    ),
    pytest.param(
        {"vllm_images": [[], image(), []]}, r"vllm_images\[1\] must be a list", id="entry"
    ),
    pytest.param(
        {"vllm_images": [[], ["red.png"], []]}, r"vllm_images\[1\]\[0\] must be a PIL", id="path"
    ),
    pytest.param(
        {"vllm_images": [[], [truncated_png()], []]},
        r"vllm_images\[1\]\[0\] cannot be read",
        id="unreadable",
    ),
    pytest.param(
        {"vllm_content": [None, b"abfc", None]}, r"vllm_content\[1\] must be None or a", id="bytes"
    ),
    pytest.param({"vllm_content": [None, "", None]}, r"vllm_content\[1\] must be", id="empty"),
    pytest.param(
        {"vllm_content": [None, "abffc", None]},
        r"already expanded.*row 1 \(2 placeholders, 1 images\)",
        id="text-placeholders",
    ),
    pytest.param(
        {"vllm_content": [None, "ab" + PLACEHOLDER + "c" * 50, None]},
        r"vllm_content of rows \[1\] leaves no room.*\[53\] tokens, max_model_len=48",
        id="text-too-long",
    ),
    pytest.param(
        {"vllm_content": [None, None, None]},
        r"already expanded.*row 1 \(7 placeholders, 1 images\)",
        id="expanded-ids-without-text",
    ),
]


@pytest.mark.parametrize(("change", "match"), NEMO_RL_BAD)
def test_bad_nemo_rl_side_channels_are_refused_by_name_and_the_next_batch_is_served(
    change: dict[str, object], match: str
) -> None:
    worker, engine = vlm_worker()
    with pytest.raises(BadBatchError, match=match):
        worker.generate({**nemo_rl_batch(), **change})
    assert "generate" not in engine.calls
    assert worker.generate(nemo_rl_batch())["output_ids"].shape[0] == 3


def test_generate_text_takes_nemo_rl_images_but_not_its_prompt_text() -> None:
    worker, engine = vlm_worker()
    data = {"prompts": ["ab", f"a{PLACEHOLDER}c"], "vllm_images": [[], [image()]]}
    assert len(worker.generate_text(data, greedy=True)["texts"]) == 2
    assert engine.calls[-4:] == ["tokenize", "expanded_lengths", "generate_text", "generate"]
    with pytest.raises(BadBatchError, match=r"vllm_content.*data\['prompts'\]"):
        worker.generate_text({**data, "vllm_content": [None, "abfc"]})


def test_a_placeholder_id_in_a_batch_without_media_is_refused() -> None:
    worker, engine = vlm_worker()
    with pytest.raises(BadBatchError, match=r"row 1 \(1 placeholders, 0 images\)"):
        worker.generate(batch([[1, 2], [IMAGE, 2]]))
    assert "generate" not in engine.calls
    assert worker.generate(batch([[1, 2]]))["output_ids"].shape[0] == 1


def test_images_for_a_text_only_model_are_refused_naming_the_rows() -> None:
    worker, engine = vlm_worker(image_token_id=None)
    data = with_media([[1, 2], [1, IMAGE]], [None, {"image": image()}])
    with pytest.raises(BadBatchError, match=r"takes no images.*row 1 \(1 images\)"):
        worker.generate(data)
    assert "generate" not in engine.calls
    out = worker.generate(with_media([[1, 2]], [None]))  # entries that are all None: no media
    assert out["output_ids"][0, :2].tolist() == [1, 2]


def test_an_image_row_without_room_is_refused_alone_by_its_expanded_length() -> None:
    """With k = 3 draft tokens a row needs k + 2 free slots; the image row's 32 ids leave
    them, its expanded 44 do not: it alone comes back unchanged, the others generate."""
    k = 3
    worker, engine = vlm_worker(
        vllm_cfg={"speculative_config": {"method": "ngram", "num_speculative_tokens": k}},
        max_new_tokens=40,
    )
    full = [1] * 30 + [IMAGE, IMAGE]  # 32 ids, expanded to 32 + 2 * (7 - 1) = 44
    fits = [1] * 29 + [IMAGE, IMAGE]  # expanded to 43: one token of room
    data = with_media(
        [[1, 2, 3], full, fits],
        [None, {"image": [image(), image()]}, {"image": [image(), image((0, 9, 0))]}],
    )
    out = worker.generate(data, greedy=True)
    assert worker.last_refused_rows == (1,)
    assert [prompt for prompt, _ in engine.requests] == [[1, 2, 3], fits]
    assert [spec.max_tokens for _, spec in engine.requests] == [40, 1]
    assert int(out["generation_lengths"][1]) == 0
    assert int(out["unpadded_sequence_lengths"][1]) == len(full)
    assert out["output_ids"][1, : len(full)].tolist() == full
    assert int(out["generation_lengths"][2]) == 1

    placeholder = "abcdefghijklmnopqrstuvwxyz"[IMAGE]
    texts = worker.generate_text(
        {
            "prompts": ["b" * 30 + placeholder * 2, "abc"],
            "multi_modal_data": [{"image": [image(), image()]}, None],
        },
        greedy=True,
    )["texts"]
    assert worker.last_refused_rows == (0,)
    assert texts[0] == ""
    assert texts[1]
    assert engine.requests[-1][0] == [0, 1, 2]


@pytest.mark.parametrize("cache", ["mm", "encoder"])
@pytest.mark.parametrize(
    "error",
    [EngineStateError("the engine kept it"), RuntimeError("reset broke")],
    ids=["refused", "raised"],
)
def test_a_failed_media_cache_reset_after_a_refit_leaves_the_weights_inconsistent(
    cache: str, error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, engine = vlm_worker()
    engine.rpc_handlers["update_weights_via_ipc_zmq"] = lambda timeout_s: engine.load_new_weights()
    worker.prepare_refit_info({"w": ((2,), "float32")})  # what a refit needs first

    reset = engine.reset_cache

    def failing(which: Cache) -> None:
        if which == cache:
            raise error
        reset(which)

    monkeypatch.setattr(engine, "reset_cache", failing)
    with pytest.raises(RefitError, match="inconsistent") as info:
        worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    assert info.value.__cause__ is error
    if isinstance(error, EngineStateError):
        assert {"mm": "multimodal cache", "encoder": "encoder cache"}[cache] in str(info.value)
    assert worker.state.weights is lifecycle.WeightsStatus.INCONSISTENT
    with pytest.raises(EngineStateError, match="refit again"):
        worker.generate(mixed())
    monkeypatch.undo()
    assert worker.update_weights_via_ipc_zmq(timeout_s=1.0) is True
    assert worker.state == lifecycle.AWAKE
    assert worker.generate(mixed())["output_ids"].shape[0] == 3
