"""The seeded generate fuzz: a few hundred valid and broken calls on ONE real CPU engine.

Every call ends in a typed error (``BadArgumentError``, which ``BadBatchError`` is) that
names the input it broke, or, for a valid call, in outputs that obey NeMo-RL's contract:
shapes and dtypes, the prompt kept, pads after the generated span, logprobs zero outside
it and finite (<= 0) inside it, lengths within ``max_new_tokens`` and ``max_model_len``,
``truncated`` only where a row used its whole budget. Then the same worker serves the
baseline greedy tokens. Hypothesis, derandomized (one fixed sequence of calls whatever
the profile), run once per kind of call (``strategies.FUZZ_KINDS``: valid calls, and one
kind per broken input) so every kind is tried; the outcome counts are printed (and
recorded as a JUnit property).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from helpers import base_config, right_padded
from hypothesis import HealthCheck, given, settings
from strategies import FUZZ_KINDS, FuzzCall, generate_calls
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from genworker.shell.errors import BadArgumentError, GenworkerError
from genworker.shell.nemo_rl import NEMO_RL_OUTPUT_KEYS
from genworker.shell.vllm_engine import VllmEngine
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

PAD = 2  # the tiny model's <pad>
MAX_MODEL_LEN = 256
MAX_NEW = 4
# Examples per kind: valid batches reach the engine (tens of ms each on an idle host),
# refused ones do not (well under a millisecond).
EXAMPLES = {"valid": 100, "valid text": 8}
BROKEN_EXAMPLES = 6
PROMPTS = [[5, 17, 99, 240, 7], [300, 12], [45, 46, 47, 48, 49, 50, 51, 52, 53], [88]]
OUTPUT_KEYS = {*NEMO_RL_OUTPUT_KEYS, "weight_versions"}


def check_contract(data: dict[str, Any], out: dict[str, torch.Tensor], vocab_size: int) -> None:
    """NeMo-RL's output contract for a valid batch (tests/shell/test_worker_engine.py has
    the differential check against raw vLLM)."""
    ids, lengths = data["input_ids"], data["input_lengths"].to(torch.int64)
    assert set(out) == OUTPUT_KEYS
    batch, width = ids.shape
    gen = out["generation_lengths"]
    assert gen.dtype == torch.int64
    assert gen.shape == (batch,)
    assert out["unpadded_sequence_lengths"].dtype == torch.int64
    assert torch.equal(out["unpadded_sequence_lengths"], lengths + gen)
    assert out["truncated"].dtype == torch.bool
    assert out["truncated"].shape == (batch,)
    assert out["output_ids"].dtype == ids.dtype
    assert out["logprobs"].dtype == torch.float32
    assert out["weight_versions"].dtype == torch.int64
    assert out["weight_versions"].shape == out["output_ids"].shape
    if batch == 0:
        assert out["output_ids"].shape == (0, 0)
        assert out["logprobs"].shape == (0, 0)
        return
    total = width + int(gen.max())
    assert out["output_ids"].shape == (batch, total)
    assert out["logprobs"].shape == (batch, total)
    for i in range(batch):
        n, g = int(lengths[i]), int(gen[i])
        budget = min(MAX_NEW, MAX_MODEL_LEN - n)
        assert 1 <= g <= budget, (i, n, g)
        assert n + g <= MAX_MODEL_LEN
        row, lp = out["output_ids"][i], out["logprobs"][i]
        assert torch.equal(row[:n], ids[i, :n])
        assert bool((row[n + g :] == PAD).all())
        assert bool((row[n : n + g] >= 0).all())
        assert bool((row[n : n + g] < vocab_size).all())
        assert bool((lp[:n] == 0).all())
        assert bool((lp[n + g :] == 0).all())
        assert bool(torch.isfinite(lp[n : n + g]).all())
        assert bool((lp[n : n + g] <= 0).all())
        versions = out["weight_versions"][i]
        assert versions[n : n + g].tolist() == [0] * g  # no refit in the fuzz
        assert bool((versions[:n] == -1).all())
        assert bool((versions[n + g :] == -1).all())
        if bool(out["truncated"][i]):
            assert g == budget, (i, n, g)


def run_call(worker: VllmGenerationWorker, call: FuzzCall) -> Any:
    """The call's outputs, or the GenworkerError it raised (any other error propagates)."""
    try:
        if call.text:
            return worker.generate_text(call.data, greedy=call.greedy)  # type: ignore[arg-type]
        return worker.generate(call.data, greedy=call.greedy)  # type: ignore[arg-type]
    except GenworkerError as e:
        return e


def check_call(worker: VllmGenerationWorker, call: FuzzCall, vocab_size: int) -> str:
    """Run one call; the outcome label for the counts. Fails the test on any breach."""
    out = run_call(worker, call)
    if isinstance(out, GenworkerError):
        assert call.broken is not None, f"a valid call was refused: {out!r} ({call.damage})"
        assert isinstance(out, BadArgumentError), f"{call.damage}: {out!r}"
        assert call.broken in str(out), f"{call.damage}: does not name {call.broken}: {out}"
        return f"refused {type(out).__name__}: {call.damage}"
    assert call.broken is None, f"{call.damage}: accepted a broken {call.broken}"
    if call.text:
        assert isinstance(call.data, dict)
        assert isinstance(out["texts"], list)
        assert len(out["texts"]) == len(call.data["prompts"])
        assert all(isinstance(t, str) for t in out["texts"])
        return "ok: generate_text"
    assert isinstance(call.data, dict)
    check_contract(call.data, out, vocab_size)
    rows = int(out["generation_lengths"].shape[0])
    return "ok: generate, empty batch" if rows == 0 else "ok: generate"


@pytest.fixture(scope="module")
def baseline(cpu_llm: LLM) -> list[list[int]]:
    cpu_llm.reset_prefix_cache()
    outs = cpu_llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def test_generate_fuzz_every_call_is_a_typed_refusal_or_a_contract_output(
    cpu_engine: VllmEngine,
    cpu_llm: LLM,
    baseline: list[list[int]],
    capsys: pytest.CaptureFixture[str],
    record_property: Any,
) -> None:
    cfg = base_config(
        model_name="tiny",
        max_new_tokens=MAX_NEW,
        _pad_token_id=PAD,
        vllm_cfg={"gpu_memory_utilization": 0.05, "max_model_len": MAX_MODEL_LEN},
    )
    worker = VllmGenerationWorker(cfg, engine_factory=ExistingEngine(cpu_engine))
    vocab_size = cpu_engine.capabilities.vocab_size
    assert vocab_size is not None
    outcomes: Counter[str] = Counter()

    for kind in FUZZ_KINDS:

        @settings(
            max_examples=EXAMPLES.get(kind, BROKEN_EXAMPLES),
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(generate_calls(kind, vocab_size=vocab_size, pad=PAD, max_model_len=MAX_MODEL_LEN))
        def one(call: FuzzCall) -> None:
            outcomes[check_call(worker, call, vocab_size)] += 1

        one()
    assert not cpu_llm.llm_engine.has_unfinished_requests()
    ok = sum(v for k, v in outcomes.items() if k.startswith("ok"))
    refused = sum(v for k, v in outcomes.items() if k.startswith("refused"))
    record_property("fuzz_outcomes", dict(sorted(outcomes.items())))
    with capsys.disabled():
        print(f"\ngenerate fuzz: {ok + refused} calls, {ok} valid outputs, {refused} refusals")
        for label, count in sorted(outcomes.items()):
            print(f"  {count:4d}  {label}")
    assert ok >= 90
    assert refused >= 150
    assert {label.split(": ", 1)[1] for label in outcomes if label.startswith("refused")} == (
        set(FUZZ_KINDS) - set(EXAMPLES)
    )
    out = worker.generate(right_padded(PROMPTS, pad=PAD), greedy=True)
    got = [
        out["output_ids"][i, len(p) : len(p) + int(out["generation_lengths"][i])].tolist()
        for i, p in enumerate(PROMPTS)
    ]
    assert got == baseline
