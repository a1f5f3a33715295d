"""GRPO groups and compute_logprobs on the real CPU engine: what the issue claims about
vLLM (per-sample seeds bit-identical to the per-row path; scored logprobs equal a
transformers forward pass and generate's own logprobs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import base_config, batch, flat_rows, right_padded

from genworker.core.engine_calls import Cache
from genworker.core.sampling import sampling_spec
from genworker.shell.vllm_engine import VllmEngine
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

pytestmark = pytest.mark.engine

PAD = 0
MAX_NEW = 8


def config() -> dict[str, Any]:
    return base_config(
        model_name="tiny",
        max_new_tokens=MAX_NEW,
        _pad_token_id=PAD,
        ignore_eos=True,
        vllm_cfg={"gpu_memory_utilization": 0.05, "max_model_len": 256},
    )


@pytest.fixture
def worker(cpu_engine: VllmEngine) -> Iterator[VllmGenerationWorker]:
    w = VllmGenerationWorker(config(), engine_factory=ExistingEngine(cpu_engine))
    cpu_engine.reset_cache(Cache.PREFIX)
    yield w
    cpu_engine.reset_cache(Cache.PREFIX)  # the engine outlives the worker: leave no shared state


def _prompt(start: int, length: int = 140) -> list[int]:
    return [(start + 7 * i) % 400 + 3 for i in range(length)]


def _hits(engine: VllmEngine) -> float:
    return sum(
        float(getattr(m, "value", 0))
        for m in engine.llm.get_metrics()
        if m.name == "vllm:prefix_cache_hits"
    )


def _generated(out: dict[str, torch.Tensor], row: int, start: int) -> tuple[list[int], list[float]]:
    n = int(out["generation_lengths"][row])
    return (
        out["output_ids"][row, start : start + n].tolist(),
        out["logprobs"][row, start : start + n].tolist(),
    )


def test_a_seeded_group_is_bit_identical_to_the_per_row_path(
    worker: VllmGenerationWorker, cpu_engine: VllmEngine
) -> None:
    a, b = _prompt(1), _prompt(5)
    prompts = [a, b, a, b, a, b]
    seeds = [101, 102, 103, 104, 105, 106]
    assert cpu_engine.capabilities.prefix_caching  # vLLM's default for this engine
    before = _hits(cpu_engine)
    grouped = worker.generate({**right_padded(prompts), "seeds": seeds})
    assert _hits(cpu_engine) > before  # the siblings read their leader's blocks
    # the per-row path: the same rows, the same specs, in the caller's order, one call
    cpu_engine.reset_cache(Cache.PREFIX)
    caps = cpu_engine.capabilities
    specs = [
        sampling_spec(
            worker.cfg,
            greedy=False,
            max_tokens=MAX_NEW,
            stop=(),
            seed=seed,
            flat_logprobs=caps.flat_logprobs,
        )
        for seed in seeds
    ]
    per_row = flat_rows(cpu_engine.generate(batch(prompts, specs)))
    for row, prompt in enumerate(prompts):
        tokens, logprobs = _generated(grouped, row, len(prompt))
        assert tokens == per_row[row][0]
        assert logprobs == per_row[row][1]  # bit for bit


def test_a_group_without_seeds_is_sampled_with_n_in_row_order(
    worker: VllmGenerationWorker,
) -> None:
    a, b = _prompt(1, 40), _prompt(9, 30)
    prompts = [a, b, a, a, b]
    out = worker.generate(right_padded(prompts))
    assert out["generation_lengths"].tolist() == [MAX_NEW] * 5
    for row, prompt in enumerate(prompts):
        assert out["output_ids"][row, : len(prompt)].tolist() == prompt
    # n's children sample on their own: the three samples of a differ
    assert len({tuple(_generated(out, r, len(a))[0]) for r in (0, 2, 3)}) == 3


def _transformers_logprobs(model: Path, sequence: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([sequence])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # position t predicts token t + 1


def test_scored_logprobs_equal_transformers_and_generates_own(
    worker: VllmGenerationWorker, tiny_model_dir: Path
) -> None:
    prompts = [_prompt(3, 20), _prompt(11, 9)]
    out = worker.generate({**right_padded(prompts), "seeds": [1, 2]})
    sequences = [
        out["output_ids"][r, : int(out["unpadded_sequence_lengths"][r])].tolist() for r in (0, 1)
    ]
    data = {
        **right_padded(sequences),
        "prompt_lengths": torch.tensor([len(p) for p in prompts]),
    }
    scored = worker.compute_logprobs(data, top_k=5)
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences, strict=True)):
        span = slice(len(prompt), len(sequence))
        # generate's own logprobs of the sampled tokens
        assert torch.allclose(scored["logprobs"][row, span], out["logprobs"][row, span], atol=1e-4)
        # a transformers forward pass of the same model, float32
        reference = _transformers_logprobs(tiny_model_dir, sequence)
        positions = torch.arange(len(prompt), len(sequence))
        expected = reference[positions - 1, torch.tensor(sequence)[positions]]
        assert torch.allclose(scored["logprobs"][row, span], expected, atol=1e-4)
        top = torch.topk(reference[positions - 1], 5)
        assert torch.allclose(scored["top_logprobs"][row, span], top.values, atol=1e-4)
        assert scored["top_ids"][row, span].tolist() == top.indices.tolist()
        assert scored["logprobs"][row, : len(prompt)].eq(0).all()
