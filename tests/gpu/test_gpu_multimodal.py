"""The tiny Idefics3 through the worker on CUDA (the runner's vLLM): a batch mixing text
and image rows equals raw ``LLM.generate`` on the same engine (and NeMo-RL's side channels
equal raw vLLM on NeMo-RL's text prompts), one BOS, a bad row refused,
and the multimodal caches reset around a level-1 sleep (the images then give the same
greedy tokens). The engine runs in a child process (``gpu.gpu_multimodal``)."""

from __future__ import annotations

import pytest
from gpu.gpu_fixtures import GPU_MARKS, Child
from gpu.gpu_multimodal import BOS, IMAGE, vlm_main

from genworker.demo.tiny_model import VLM_IMAGE_PROMPT_IDS

pytestmark = GPU_MARKS


def test_images_through_the_worker_equal_raw_vllm_and_sleep_resets_the_caches(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    result = Child(vlm_main, gpu=0, model_dir=str(tmp_path_factory.mktemp("vlm"))).result()
    assert isinstance(result, dict)
    assert result["caps"] == [IMAGE, 2]
    assert result["ours"] == result["raw"]
    assert result["nemo_rl"] == result["nemo_rl_raw"]  # NeMo-RL's side channels
    rows, expanded = result["rows"], result["raw_prompt_ids"]
    red, blue = result["image_extra"]  # the ids each image adds, by the HF processor
    assert red > VLM_IMAGE_PROMPT_IDS - 1  # split into tiles: more than one tile's ids
    assert blue > VLM_IMAGE_PROMPT_IDS - 1
    assert [len(e) for e in expanded] == [
        len(rows[0]),
        len(rows[1]) + red,
        len(rows[2]) + red + blue,
    ]
    assert all(e[0] == BOS and e[1] != BOS for e in expanded)
    first, second = result["bos"]
    assert first == second
    assert first[0] == BOS
    assert first[1] != BOS
    assert "row 1 (2 images, 1 placeholders)" in result["refused"]
    assert result["resets"] == {"prefix": 1.0, "mm": 1.0, "encoder": 1.0}
    assert result["after_sleep"] == result["ours"]
