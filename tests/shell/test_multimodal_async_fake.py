"""The async worker's images against the fake async engine: the sync worker's multimodal
rules (``test_multimodal_fake.py``) for streamed rows. What reaches the engine (the caller's
ids or a NeMo-RL prompt text's, the images beside them), the caps on the expanded prompt,
the caller's ids in the output, bad media refused before anything runs, and a refit in
flight. The same claims against ``AsyncLLM`` run in ``test_multimodal_async_engine.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from async_helpers import async_config, collect, outputs
from helpers import right_padded
from PIL import Image

from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import BadArgumentError, BadBatchError
from genworker.shell.fake_async_engine import FakeAsyncEngine, FakeAsyncEngineFactory

IMAGE = 5  # the fake VLM's placeholder id ("f": the fakes tokenise one letter per id)
EXPANSION = 7  # ids one placeholder stands for in the fake's context
MAX_MODEL_LEN = 48


def image(color: tuple[int, int, int] = (255, 0, 0)) -> Image.Image:
    return Image.new("RGB", (8, 6), color)


def vlm_worker(
    *, image_token_id: int | None = IMAGE, max_new_tokens: int = 40
) -> tuple[AsyncVllmGenerationWorker, FakeAsyncEngine]:
    factory = FakeAsyncEngineFactory(
        max_model_len=MAX_MODEL_LEN,
        image_token_id=image_token_id,
        image_prompt_ids=EXPANSION,
        max_images=2,
    )
    cfg = async_config(
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        vllm_cfg={"max_model_len": MAX_MODEL_LEN, "cap_max_tokens_to_context": True},
    )
    return AsyncVllmGenerationWorker(cfg, engine_factory=factory), factory.started[0][1]


def mixed(second: Image.Image | None = None) -> dict[str, object]:
    """Row 0 text only, row 1 one image, row 2 two images side by side."""
    data: dict[str, object] = dict(right_padded([[1, 2, 3], [1, IMAGE, 8, 9], [IMAGE, IMAGE, 4]]))
    data["multi_modal_data"] = [
        None,
        {"image": second or image()},
        {"image": [image(), image((0, 0, 9))]},
    ]
    return data


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_streamed_image_rows_keep_the_callers_ids_and_the_caps_count_the_expansion() -> None:
    async def main() -> None:
        worker, engine = vlm_worker()
        data = mixed()
        rows = outputs(await collect(worker.generate_async(data, greedy=True)))
        expanded = [3, 4 + EXPANSION - 1, 3 + 2 * (EXPANSION - 1)]
        lengths = data["input_lengths"]
        ids = data["input_ids"]
        assert isinstance(lengths, torch.Tensor)
        assert isinstance(ids, torch.Tensor)
        for row, out in rows.items():
            n, g = int(lengths[row]), int(out["generation_lengths"][0])
            assert out["output_ids"][0, :n].tolist() == ids[row, :n].tolist()
            assert g == min(40, MAX_MODEL_LEN - expanded[row])  # ignore_eos: the whole budget
            assert out["weight_versions"][0, n : n + g].tolist() == [0] * g
        # The engine ran each prompt as given, the images beside it.
        assert set(engine.finished) == {(1, 2, 3), (1, IMAGE, 8, 9), (IMAGE, IMAGE, 4)}
        assert engine.prompt_tokens == sum(expanded)
        whole = await worker.generate(data, greedy=True)  # the batch at once: the same rows
        for row, out in rows.items():
            width = out["output_ids"].shape[1]
            assert torch.equal(whole["output_ids"][row, :width], out["output_ids"][0])

    run(main())


def test_the_images_decide_the_tokens_of_their_row_only() -> None:
    async def main() -> None:
        worker, _ = vlm_worker()
        first = await worker.generate(mixed(), greedy=True)
        second = await worker.generate(mixed(image((1, 2, 3))), greedy=True)
        assert torch.equal(first["output_ids"][[0, 2]], second["output_ids"][[0, 2]])
        assert not torch.equal(first["output_ids"][1], second["output_ids"][1])

    run(main())


def test_nemo_rl_side_channels_start_a_row_from_its_text() -> None:
    async def main() -> None:
        worker, engine = vlm_worker()
        expanded = [0, 1, *[IMAGE] * EXPANSION, 2]  # "abfc" as NeMo-RL's processor gives it
        data: dict[str, object] = dict(right_padded([expanded, [3, 4]]))
        data["vllm_content"] = ["abfc", "ignored: no images"]
        data["vllm_images"] = [[image()], []]
        rows = outputs(await collect(worker.generate_async(data, greedy=True)))
        assert set(engine.finished) == {(0, 1, IMAGE, 2), (3, 4)}
        assert rows[0]["output_ids"][0, :10].tolist() == expanded
        # The same rows with the engine's prompts through multi_modal_data: the same tokens.
        same: dict[str, object] = dict(right_padded([[0, 1, IMAGE, 2], [3, 4]]))
        same["multi_modal_data"] = [{"image": image()}, None]
        again = outputs(await collect(worker.generate_async(same, greedy=True)))
        for row, start, other in ((0, 10, 4), (1, 2, 2)):
            g = int(rows[row]["generation_lengths"][0])
            assert g == int(again[row]["generation_lengths"][0])
            got = rows[row]["output_ids"][0, start : start + g]
            assert torch.equal(got, again[row]["output_ids"][0, other : other + g])

    run(main())


BAD = [
    pytest.param(
        {"multi_modal_data": [None, {"image": image()}]},
        r"more images than placeholder.*row 1 \(1 images, 0 placeholders\)",
        id="extra-image",
    ),
    pytest.param(
        {"multi_modal_data": [{"image": "red.png"}, None]},
        r"multi_modal_data\[0\]\['image'\]\[0\] must be a PIL",
        id="not-an-image",
    ),
    pytest.param(
        {"multi_modal_data": None, "vllm_images": [[image()], []], "vllm_content": ["abffc", None]},
        r"already expanded.*row 0",
        id="text-placeholders",
    ),
    pytest.param({"vllm_audios": [[], [b"wav"]]}, r"vllm_audios", id="audio"),
]


@pytest.mark.parametrize(("change", "match"), BAD)
def test_bad_media_refuses_the_batch_before_anything_runs(
    change: dict[str, object], match: str
) -> None:
    async def main() -> None:
        worker, engine = vlm_worker()
        data = {
            **right_padded([[1, IMAGE, 2], [3, 4]]),
            "multi_modal_data": [{"image": image()}, None],
        }
        data.update(change)
        with pytest.raises(BadBatchError, match=match):
            await collect(worker.generate_async(data))
        with pytest.raises(BadBatchError, match=match):
            await worker.generate(data)
        assert "generate" not in engine.calls
        good = {**right_padded([[1, IMAGE, 2]]), "multi_modal_data": [{"image": image()}]}
        assert (await worker.generate(good))["output_ids"].shape[0] == 1

    run(main())


def test_images_for_a_text_only_model_are_refused_naming_the_rows() -> None:
    async def main() -> None:
        worker, engine = vlm_worker(image_token_id=None)
        data = {**right_padded([[1, 2], [3]]), "vllm_images": [[], [image()]]}
        with pytest.raises(BadBatchError, match=r"takes no images.*row 1 \(1 images\)"):
            await worker.generate(data)
        assert "generate" not in engine.calls

    run(main())


def test_generate_text_takes_images_but_not_nemo_rl_prompt_text() -> None:
    async def main() -> None:
        worker, engine = vlm_worker()
        data = {"prompts": ["ab", "afc"], "multi_modal_data": [None, {"image": image()}]}
        texts = (await worker.generate_text(data, greedy=True))["texts"]
        assert [len(t) for t in texts] == [40, MAX_MODEL_LEN - (3 + EXPANSION - 1)]  # expanded
        assert (0, IMAGE, 2) in engine.finished
        with pytest.raises(BadBatchError, match=r"vllm_content.*data\['prompts'\]"):
            await worker.generate_text({**data, "vllm_content": [None, "afc"]})

    run(main())


def test_a_refit_that_keeps_the_caches_is_refused_on_a_multimodal_engine() -> None:
    async def main() -> None:
        worker, engine = vlm_worker()
        await worker.prepare_refit_info({"w": ([2], "float32")})
        with pytest.raises(BadArgumentError, match="clear_cache=False on a multimodal"):
            await worker.update_weights_via_ipc_zmq(1.0, clear_cache=False)
        assert not any(c.startswith("pause") for c in engine.calls)
        assert (await worker.generate(mixed()))["output_ids"].shape[0] == 3

    run(main())
