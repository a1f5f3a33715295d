"""Laws of the request plan (``genworker.core.requests``), which both workers follow."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import RequestCase, request_cases

from genworker.core.batch import BatchError
from genworker.core.caps import CapArgumentError, reserved_tokens
from genworker.core.config import WorkerConfig
from genworker.core.engine_calls import EngineBatch, EngineCapabilities
from genworker.core.groups import EngineRequest
from genworker.core.lora import NEMO_RL_ADAPTER_NAME
from genworker.core.requests import (
    PlanError,
    RequestLimits,
    RequestPlan,
    SampleData,
    bos_rows,
    check_greedy,
    check_text_prompts,
    parse_sample_data,
    plan_batch,
    plan_requests,
    text_refusals,
)
from genworker.core.stops import StopError, StopMode


def plan(case: RequestCase, rows: tuple[tuple[int, int], ...] | None = None) -> RequestPlan:
    samples = parse_sample_data(case.data, case.batch_size, config_stops=("<eos>",), mode=case.mode)
    assert isinstance(samples, Success)
    planned = plan_requests(
        case.defaults,
        case.limits,
        samples.unwrap(),
        case.rows if rows is None else rows,
        greedy=case.greedy,
        text=case.text,
    )
    assert isinstance(planned, Success)
    value = planned.unwrap()
    assert isinstance(value, RequestPlan)
    return value


def has_room(case: RequestCase, length: int) -> bool:
    limits = case.limits
    reserve = reserved_tokens(num_speculative_tokens=limits.num_speculative_tokens)
    return limits.max_model_len - reserve - length >= 1


@given(request_cases())
def test_a_row_without_room_comes_back_unchanged(case: RequestCase) -> None:
    """A row without room gets no request (the workers return it unchanged) and is named,
    by its batch row, in ``no_room``; every other row gets a spec within its room."""
    planned = plan(case)
    assert planned.rows == tuple(row for row, _ in case.rows)
    for (row, length), spec in zip(case.rows, planned.specs, strict=True):
        room = has_room(case, length) or not (
            case.limits.cap_to_context or case.limits.num_speculative_tokens
        )
        assert (spec is not None) == room
        assert (row in planned.no_room) == (not room)
        if spec is not None and (case.limits.cap_to_context or case.limits.num_speculative_tokens):
            reserve = reserved_tokens(num_speculative_tokens=case.limits.num_speculative_tokens)
            assert length + spec.max_tokens + reserve <= case.limits.max_model_len
    assert planned.requests() == tuple(
        (row, spec)
        for (row, _), spec in zip(case.rows, planned.specs, strict=True)
        if spec is not None
    )
    assert [planned.rows[i] for i in planned.kept] == [row for row, _ in planned.requests()]


@given(request_cases())
def test_rows_alike_share_one_spec(case: RequestCase) -> None:
    """Two rows with equal specs hold the same spec object (one ``SamplingParams``)."""
    specs = [s for s in plan(case).specs if s is not None]
    for a in specs:
        for b in specs:
            assert (a == b) == (a is b)


@given(request_cases())
def test_the_plan_of_a_batch_equals_the_plans_of_its_rows(case: RequestCase) -> None:
    """Row by row, the batch's plan is each row's own plan (the per-sample data stays the
    batch's: see the module docstring for what is batch-level)."""
    planned = plan(case)
    for i, one in enumerate(case.rows):
        alone = plan(case, (one,))
        assert alone.specs == (planned.specs[i],)
        assert alone.no_room == ((one[0],) if planned.specs[i] is None else ())


@given(request_cases())
def test_specs_carry_the_row_data(case: RequestCase) -> None:
    samples = parse_sample_data(
        case.data, case.batch_size, config_stops=("<eos>",), mode=case.mode
    ).unwrap()
    for row, spec in plan(case).requests():
        assert spec.seed == samples.seeds[row]
        assert spec.stop == samples.stops[row]
        assert spec.detokenize == (case.text or bool(spec.stop))
        assert spec.flat_logprobs == case.limits.flat_logprobs
        assert (spec.temperature == 0.0) if case.greedy else True


def test_batch_level_inputs_refuse_the_batch() -> None:
    seeds = parse_sample_data({"seeds": [1]}, 2, config_stops=(), mode=StopMode.PER_SAMPLE)
    assert isinstance(seeds, Failure)
    assert seeds.failure().field == "seeds"
    assert isinstance(seeds.failure().cause, BatchError)
    stops = parse_sample_data(
        {"stop_strings": [[""], None]}, 2, config_stops=(), mode=StopMode.PER_SAMPLE
    )
    assert isinstance(stops, Failure)
    assert stops.failure().field == "stop_strings"
    assert isinstance(stops.failure().cause, StopError)
    samples = SampleData((None,), ((),))
    bad = plan_requests(_Defaults(), RequestLimits(0, 8), samples, [(0, 1)], greedy=False)
    assert isinstance(bad, Failure)
    assert bad.failure().field == "max tokens"
    assert isinstance(bad.failure().cause, CapArgumentError)
    with pytest.raises(ValueError, match=r"rows \[1\] are outside a batch of 1"):
        plan_requests(_Defaults(), RequestLimits(4, 8), samples, [(1, 1)], greedy=False)
    with pytest.raises(ValueError, match="1 seeds but 0 stop lists"):
        SampleData((None,), ())


def test_union_stops_are_batch_level() -> None:
    """Under BATCH_UNION a row stops on every row's strings: the one batch-level datum."""
    samples = parse_sample_data(
        {"stop_strings": [["a"], ["b"]]}, 2, config_stops=(), mode=StopMode.BATCH_UNION
    ).unwrap()
    planned = plan_requests(
        _Defaults(), RequestLimits(4, 8), samples, [(0, 1)], greedy=True
    ).unwrap()
    spec = planned.specs[0]
    assert spec is not None
    assert spec.stop == ("a", "b")


def test_no_room_names_batch_rows() -> None:
    samples = SampleData((None,) * 4, ((),) * 4)
    limits = RequestLimits(4, 8, num_speculative_tokens=2)
    planned = plan_requests(
        _Defaults(), limits, samples, [(3, 7), (1, 2), (0, 5)], greedy=False
    ).unwrap()
    assert planned.no_room == (3, 0)
    assert planned.refused is not None
    assert "rows 3 (input length 7), 0 (input length 5)" in planned.refused.message
    assert planned.kept == (1,)


def test_text_prompts() -> None:
    assert check_text_prompts(["a", ""]) == Success(("a", ""))
    for bad in ("a", ["a", 1], None):
        refused = check_text_prompts(bad)
        assert isinstance(refused, Failure)
        assert refused.failure().message == "generate_text: data['prompts'] must be a list of str"
    assert text_refusals(["a", "b"], {0: 3, 1: 4}, 8) == ()
    empty, long = text_refusals(["", "abc", "", "d"], {1: 8, 3: 9}, 8)
    assert empty.rows == (0, 2)
    assert empty.message == "generate_text: prompts [0, 2] are empty strings"
    assert empty.row_message(2) == "generate_text: prompt 2 is an empty string"
    assert long.rows == (1, 3)
    assert long.message.startswith(
        "generate_text: prompts [1, 3] leave no room to generate: [8, 9]"
    )
    assert long.row_message(3) == (
        "generate_text: prompt 3 leaves no room to generate: 9 tokens, max_model_len=8 "
        "(a prompt must be shorter)"
    )
    assert text_refusals([""], None, 8)[0].rows == (0,)


@attrs.frozen
class _Defaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] | None = None
    ignore_eos: bool = False


def test_plan_error_is_a_core_error() -> None:
    assert str(PlanError("x", field="seeds")) == "x"


@given(request_cases(), st.booleans(), st.integers(1, 3))
def test_the_plan_hands_the_engine_its_generating_rows(
    case: RequestCase, with_media: bool, n: int
) -> None:
    """The engine batch holds each generating row's prompt and spec, in plan order, or in
    the order and sample counts of the requests sent (counts only where one is above 1)."""
    planned = plan(case)
    prompts = {row: [row + 1] * length for row, length in case.rows}
    media = {row: f"image {row}" for row, _ in case.rows[:1]} if with_media else {}
    requests = planned.requests()
    batch = planned.engine_batch(prompts, media)
    assert batch.prompts == tuple(prompts[row] for row, _ in requests)
    assert batch.specs == tuple(spec for _, spec in requests)
    assert batch.media == (tuple(media.get(row) for row, _ in requests) if media else None)
    assert batch.samples is None
    sent = [EngineRequest(row, n) for row, _ in reversed(requests)]
    grouped: EngineBatch[str] = planned.engine_batch(prompts, None, sent)
    assert grouped.prompts == tuple(reversed(batch.prompts))
    assert grouped.specs == tuple(reversed(batch.specs))
    assert grouped.samples == (None if n == 1 or not sent else (n,) * len(sent))


def test_greedy_is_a_bool_and_nothing_merely_truthy() -> None:
    assert check_greedy(True) == Success(True)
    assert check_greedy(False) == Success(False)
    for bad, name in ((1, "int"), (None, "NoneType"), ("yes", "str")):
        refused = check_greedy(bad)
        assert isinstance(refused, Failure)
        assert refused.failure() == PlanError(f"greedy must be a bool, got {name}", field="greedy")


@given(st.lists(st.sampled_from(["<s>hi", "hi", "<s>", "", "x<s>"]), max_size=8))
def test_every_text_prompt_is_tokenized_once_and_only_a_bos_start_without_special_tokens(
    prompts: list[str],
) -> None:
    special, bare = bos_rows(prompts, "<s>")
    assert sorted(special + bare) == list(range(len(prompts)))  # each row once
    assert special == sorted(special)  # in row order
    assert bare == sorted(bare)
    assert bare == [row for row, p in enumerate(prompts) if p.startswith("<s>")]
    for no_bos in (None, "", 1):  # a tokenizer without a BOS text: every row as it is
        assert bos_rows(prompts, no_bos) == (list(range(len(prompts))), [])


def _config(**extra: object) -> WorkerConfig:
    """A worker config: max_new_tokens 7, max_model_len 32 capped to the context, and
    ``extra`` top-level keys."""
    vllm_cfg = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "gpu_memory_utilization": 0.5,
        "max_model_len": 32,
        "precision": "float32",
        "cap_max_tokens_to_context": True,
    }
    raw = {"backend": "vllm", "model_name": "m", "max_new_tokens": 7, "vllm_cfg": vllm_cfg}
    return WorkerConfig.from_mapping(
        {**raw, "temperature": 1.0, "top_p": 1.0, "top_k": None, "_pad_token_id": 0, **extra}
    ).unwrap()


def test_the_request_limits_are_the_configs_caps_and_the_running_engines() -> None:
    """``RequestLimits.of``: the new-token cap and the context cap from the config, the
    context, speculative slots and logprob layout from the engine."""
    config = _config()
    caps = EngineCapabilities(
        sleep_mode=False,
        flat_logprobs=True,
        vocab_size=None,
        max_model_len=48,
        device="cpu",
        num_speculative_tokens=2,
    )
    assert RequestLimits.of(config, caps) == RequestLimits(
        max_new_tokens=7,
        max_model_len=48,
        cap_to_context=True,
        num_speculative_tokens=2,
        flat_logprobs=True,
    )


@pytest.mark.parametrize("native", [False, True])
def test_a_workers_batch_plan_parses_its_data_then_plans_within_the_limits(native: bool) -> None:
    """``plan_batch``: ``parse_sample_data`` (the config's stops, NeMo-RL's adapter by
    default under native LoRA) bound to ``plan_requests`` within ``RequestLimits.of``;
    a bad per-sample input refuses the batch, as ``parse_sample_data`` does."""
    config = _config(lora_refit_mode="native") if native else _config()
    caps = EngineCapabilities(
        sleep_mode=False, flat_logprobs=False, vocab_size=None, max_model_len=16, device="cpu"
    )
    served = {NEMO_RL_ADAPTER_NAME: 3}
    data: dict[str, object] = {"seeds": [1, None]}
    rows = [(1, 4), (0, 9)]
    plan = plan_batch(config, caps, data, 2, rows, False, False, StopMode.PER_SAMPLE, served)
    samples = parse_sample_data(
        data,
        2,
        config_stops=config.stop_strings,
        mode=StopMode.PER_SAMPLE,
        served=served,
        default_adapter=NEMO_RL_ADAPTER_NAME if native else None,
    ).unwrap()
    limits = RequestLimits.of(config, caps)
    assert plan == plan_requests(config, limits, samples, rows, greedy=False, text=False)
    bad = plan_batch(config, caps, {"seeds": [1]}, 2, rows, False, False, StopMode.PER_SAMPLE, {})
    assert isinstance(bad, Failure)
    assert bad.failure().field == "seeds"
