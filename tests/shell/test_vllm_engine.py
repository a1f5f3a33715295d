"""The vLLM adapter against the raw ``vllm.LLM`` it wraps (one CPU engine per session)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import LLM
from vllm.inputs import TokensPrompt

from genworker.core.counters import GENERATION_TOKENS, PROMPT_TOKENS, CounterSample
from genworker.core.sampling import SamplingSpec
from genworker.shell.errors import BadBatchError, BadConfigError, EngineDeadError, UnsupportedError
from genworker.shell.vllm_engine import (
    VllmEngine,
    VllmEngineFactory,
    engine_arg_names,
    sampling_params,
)

pytestmark = pytest.mark.engine

VOCAB = 512
FIRST_ORDINARY_TOKEN = 3  # after <s>, </s>, <pad>


def greedy(max_tokens: int, **kw: object) -> SamplingSpec:
    return SamplingSpec(temperature=0.0, top_p=1.0, top_k=1, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


Row = tuple[list[int], list[float], str | None]


def raw_generate(
    llm: LLM, prompts: Sequence[Sequence[int]], specs: Sequence[SamplingSpec]
) -> list[Row]:
    """Tokens, sampled-token logprobs (read through the per-position dicts: the specs ask
    for no flat logprobs) and finish reasons, from ``llm.generate``, one params per row."""
    params = [sampling_params(s) for s in specs]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    rows: list[Row] = []
    for out in outs:
        c = out.outputs[0]
        assert isinstance(c.logprobs, list)
        logprobs = [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs, strict=True)]
        rows.append((list(c.token_ids), logprobs, c.finish_reason))
    return rows


def adapter_rows(
    engine: VllmEngine, prompts: Sequence[Sequence[int]], specs: Sequence[SamplingSpec]
) -> list[Row]:
    rows: list[Row] = []
    for g in engine.generate(prompts, specs):
        assert g.logprobs is not None
        rows.append((g.token_ids.tolist(), g.logprobs.tolist(), g.finish_reason))
    return rows


def as_float32(rows: list[Row]) -> list[object]:
    return [(t, np.asarray(lp, dtype=np.float32).tolist(), r) for t, lp, r in rows]


prompt_st = st.lists(st.integers(FIRST_ORDINARY_TOKEN, VOCAB - 1), min_size=1, max_size=24)
greedy_st = st.builds(greedy, st.integers(1, 8))
seeded_st = st.builds(
    SamplingSpec,
    temperature=st.sampled_from([0.5, 1.0, 1.5]),
    top_p=st.sampled_from([0.8, 1.0]),
    top_k=st.sampled_from([-1, 5, 50]),
    max_tokens=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)


def check_differential(
    engine: VllmEngine, llm: LLM, prompts: list[list[int]], specs: list[SamplingSpec]
) -> None:
    engine.reset_prefix_cache()  # the same prefill work on both sides
    ours = adapter_rows(engine, prompts, specs)
    engine.reset_prefix_cache()
    theirs = raw_generate(llm, prompts, specs)
    assert ours == as_float32(theirs)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_greedy_matches_raw_vllm(cpu_engine: VllmEngine, cpu_llm: LLM, data: st.DataObject) -> None:
    prompts = data.draw(st.lists(prompt_st, min_size=1, max_size=4))
    specs = data.draw(st.lists(greedy_st, min_size=len(prompts), max_size=len(prompts)))
    check_differential(cpu_engine, cpu_llm, prompts, specs)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_seeded_sampling_matches_raw_vllm(
    cpu_engine: VllmEngine, cpu_llm: LLM, data: st.DataObject
) -> None:
    prompts = data.draw(st.lists(prompt_st, min_size=1, max_size=4))
    # Rows may share a spec object (one SamplingParams) or differ; mixed with greedy rows.
    specs = data.draw(st.lists(seeded_st | greedy_st, min_size=len(prompts), max_size=len(prompts)))
    check_differential(cpu_engine, cpu_llm, prompts, specs)


def test_capabilities_describe_the_cpu_engine(cpu_engine: VllmEngine) -> None:
    caps = cpu_engine.capabilities
    assert caps.device == "cpu"
    assert caps.sleep_mode is False
    assert caps.vocab_size == VOCAB
    assert caps.max_model_len == 256
    assert caps.flat_logprobs is True
    assert caps.sampling_args is not None
    assert {"temperature", "max_tokens", "flat_logprobs"} <= caps.sampling_args


def test_engine_arg_names_are_engine_args_fields() -> None:
    names = engine_arg_names()
    assert {"model", "max_model_len", "gpu_memory_utilization", "seed"} <= names


def test_finish_reasons(cpu_engine: VllmEngine) -> None:
    prompt = [10, 11, 12, 13]
    (first,) = cpu_engine.generate([prompt], [greedy(4)])
    assert first.finish_reason == "length"
    assert len(first.token_ids) == 4
    stop_at = int(first.token_ids[1])
    (stopped,) = cpu_engine.generate([prompt], [greedy(4, stop_token_ids=(stop_at,))])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids.tolist() == first.token_ids[: len(stopped.token_ids)].tolist()
    assert int(stopped.token_ids[-1]) == stop_at


def test_generate_text_matches_raw_vllm(cpu_engine: VllmEngine, cpu_llm: LLM) -> None:
    prompts = ["The quick brown fox", "Hello world!"]
    specs = [greedy(6), greedy(3)]
    ours = cpu_engine.generate_text(cpu_engine.tokenize(prompts), specs)
    raw = cpu_llm.generate(prompts, [sampling_params(s) for s in specs], use_tqdm=False)
    assert ours == [o.outputs[0].text for o in raw]


def _counter(samples: Sequence[object], name: str) -> float:
    return sum(s.value for s in samples if isinstance(s, CounterSample) and s.name == name)


def test_metrics_count_a_batch_tokens(cpu_engine: VllmEngine) -> None:
    prompts = [[20, 21, 22], [30, 31, 32, 33, 34]]
    before = cpu_engine.metrics()
    gens = cpu_engine.generate(prompts, [greedy(5), greedy(2)])
    after = cpu_engine.metrics()
    assert _counter(after, PROMPT_TOKENS) - _counter(before, PROMPT_TOKENS) == 8
    generated = sum(len(g.token_ids) for g in gens)
    assert _counter(after, GENERATION_TOKENS) - _counter(before, GENERATION_TOKENS) == generated


@pytest.mark.parametrize(
    ("prompt", "why"),
    [([5, VOCAB + 100, 6], "token id out of vocabulary"), ([5] * 300, "prompt over max_model_len")],
)
def test_bad_request_is_bad_batch_and_engine_keeps_serving(
    cpu_engine: VllmEngine, prompt: list[int], why: str
) -> None:
    good = [7, 8, 9]
    with pytest.raises(BadBatchError) as info:
        cpu_engine.generate([good, prompt], [greedy(3), greedy(3)])
    assert info.value.__cause__ is not None, why
    (after,) = cpu_engine.generate([good], [greedy(3)])
    assert len(after.token_ids) == 3


def test_mismatched_specs_are_bad_batch(cpu_engine: VllmEngine) -> None:
    with pytest.raises(BadBatchError, match="2 prompts but 1 specs"):
        cpu_engine.generate([[5], [6]], [greedy(1)])


def test_sleep_is_unsupported_on_cpu(cpu_engine: VllmEngine) -> None:
    with pytest.raises(UnsupportedError):
        cpu_engine.sleep(1)
    with pytest.raises(UnsupportedError):
        cpu_engine.wake_up(None)


def test_collective_rpc_answers_from_every_worker(cpu_engine: VllmEngine) -> None:
    assert cpu_engine.collective_rpc("check_health", timeout=60) == [None]
    (inspection,) = cpu_engine.collective_rpc("get_model_inspection")
    assert isinstance(inspection, str)
    assert "LlamaForCausalLM" in inspection


def test_profiling_without_a_profiler_is_unsupported(cpu_engine: VllmEngine) -> None:
    with pytest.raises(UnsupportedError, match="profil"):
        cpu_engine.start_profile()
    with pytest.raises(UnsupportedError, match="profil"):
        cpu_engine.stop_profile()


def test_collective_rpc_expiry_is_engine_dead(
    cpu_engine: VllmEngine, cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    def wedged(*_args: object, **_kwargs: object) -> list[object]:
        time.sleep(2)
        return []

    monkeypatch.setattr(cpu_llm, "collective_rpc", wedged)
    with pytest.raises(EngineDeadError, match="update_weights"):
        cpu_engine.collective_rpc("update_weights", timeout=0.2)


def test_device_ids_name_the_device(cpu_engine: VllmEngine) -> None:
    ids = cpu_engine.device_ids()
    assert len(ids) == 1
    assert all(isinstance(i, str) and i for i in ids)


def test_start_failure_is_bad_config(tiny_model_dir: Path) -> None:
    with pytest.raises(BadConfigError, match="model"):
        VllmEngine.start({"model": 3})
    with pytest.raises(BadConfigError) as info:
        VllmEngine.start({"model": str(tiny_model_dir), "max_model_len": 100_000})
    assert info.value.__cause__ is not None


def test_factory_reports_no_gpu_and_the_engine_args() -> None:
    factory = VllmEngineFactory()
    assert factory.gpu_capability() is None
    assert factory.arg_names() == engine_arg_names()
