"""Laws and documented cases of genworker.core.fake_model (the fake engines' made-up model)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import moe_shapes

from genworker.core.assembly import Generation
from genworker.core.counters import CounterSample, GaugeSample
from genworker.core.fake_model import (
    LETTERS,
    MEMORY_TAGS,
    detokenize,
    draw,
    expanded_length,
    fake_capabilities,
    fake_metrics,
    fake_routes,
    faulted,
    finish_reason,
    image_digest,
    request_routes,
    routes_option,
    sample_token,
    score_row,
    speculative_tokens,
    steppable,
    tokenize,
    unservable,
    waking,
    weight_spans,
)
from genworker.core.lifecycle import InflightMode
from genworker.core.routing import MoeShape
from genworker.core.sampling import SamplingSpec

LETTER_TEXT = st.text(alphabet=LETTERS, max_size=20)


def spec(**changes: object) -> SamplingSpec:
    fields: dict[str, object] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8}
    return SamplingSpec(**(fields | changes))  # type: ignore[arg-type]


@given(LETTER_TEXT)
def test_letters_round_trip_through_the_tokenizer(text: str) -> None:
    assert detokenize(tokenize(text)) == text


@given(st.lists(st.integers(0, 10_000), max_size=20))
def test_detokenize_gives_one_letter_per_id_modulo_26(ids: list[int]) -> None:
    text = detokenize(ids)
    assert len(text) == len(ids)
    assert tokenize(text) == [i % 26 for i in ids]


def test_anything_but_a_letter_tokenizes_to_zero() -> None:
    assert tokenize("a B?") == [0, 0, 0, 0]
    assert tokenize("cab") == [2, 0, 1]


@given(st.lists(st.integers() | st.text(max_size=3), max_size=4))
def test_draw_is_uniform_in_the_unit_interval_and_deterministic(parts: list[object]) -> None:
    u = draw(*parts)
    assert 0.0 <= u < 1.0
    assert draw(*parts) == u


def test_draw_depends_on_every_part() -> None:
    assert draw(1, 2) != draw(2, 1)
    assert draw(1, 2) != draw(1, 2, 3)


@given(st.floats(0.0, 1.0, exclude_max=True), st.integers(1, 1000))
def test_a_draw_picks_a_token_in_the_vocabulary_and_sampling_costs_half_a_nat(
    u: float, vocab: int
) -> None:
    greedy_token, greedy_logprob = sample_token(u, vocab, greedy=True)
    token, logprob = sample_token(u, vocab, greedy=False)
    assert 0 <= token == greedy_token < vocab
    assert greedy_logprob <= 0.0
    assert logprob == greedy_logprob - 0.5


@pytest.mark.parametrize(
    ("changes", "token", "text", "generated", "room", "expected"),
    [
        ({}, 1, "b", 1, 10, "stop"),  # EOS
        ({"ignore_eos": True}, 1, "b", 1, 10, None),
        ({"stop_token_ids": (5,)}, 5, "f", 1, 10, "stop"),
        ({"stop": ("ab",)}, 1, "cab", 3, 10, "stop"),
        ({"stop": ("ab",), "ignore_eos": True}, 0, "ba", 2, 10, None),
        ({"max_tokens": 3}, 4, "eee", 3, 10, "length"),
        ({}, 4, "ee", 2, 2, "length"),  # the context's end
        ({}, 4, "ee", 2, 3, None),
    ],
)
def test_finish_reason_is_vllm_s_stop_rule_then_the_length_rule(
    changes: dict[str, object],
    token: int,
    text: str,
    generated: int,
    room: int,
    expected: str | None,
) -> None:
    assert finish_reason(spec(**changes), token, text, generated, room, 1) == expected


@given(
    st.lists(st.integers(0, 63), min_size=1, max_size=12),
    st.data(),
    st.integers(0, 5),
    st.integers(0, 3),
)
def test_scores_cover_the_scored_span_ranked_and_depend_on_the_prefix_only(
    sequence: list[int], data: st.DataObject, top_k: int, weights: int
) -> None:
    start = data.draw(st.integers(0, len(sequence)))
    row = score_row(sequence, start, top_k, seed=7, weights=weights, vocab_size=64)
    assert len(row.logprobs) == len(row.top_ids) == len(row.top_logprobs) == len(sequence) - start
    assert all(lp < 0.0 for lp in row.logprobs)
    assert all(len(ids) == top_k and all(0 <= i < 64 for i in ids) for ids in row.top_ids)
    assert all(list(lps) == sorted(lps, reverse=True) for lps in row.top_logprobs)
    longer = score_row([*sequence, 9], start, top_k, seed=7, weights=weights, vocab_size=64)
    assert longer.logprobs[: len(row.logprobs)] == row.logprobs


@given(moe_shapes(), st.lists(st.integers(0, 63), max_size=8), st.integers(0, 2**40))
def test_routes_name_distinct_experts_for_every_forwarded_token(
    shape: MoeShape, sequence: list[int], seed: int
) -> None:
    versions = [p % 2 for p in range(len(sequence))]
    routes = fake_routes(shape, seed, sequence, versions)
    assert routes.shape == shape
    assert routes.experts.shape == (max(len(sequence) - 1, 0), shape.num_layers, shape.top_k)
    for position in routes.experts:
        for layer in position:
            assert len(set(layer.tolist())) == shape.top_k
            assert all(0 <= e < shape.num_experts for e in layer)
    again = fake_routes(shape, seed, sequence, versions)
    assert np.array_equal(again.experts, routes.experts)


@given(
    moe_shapes(),
    st.lists(st.integers(0, 63), min_size=1, max_size=5),
    st.lists(st.integers(0, 3), max_size=5),
    st.integers(0, 3),
)
def test_a_request_routes_its_prompt_under_its_first_tokens_weights(
    shape: MoeShape, prompt: list[int], versions: list[int], now: int
) -> None:
    tokens = [7] * len(versions)
    routes = request_routes(shape, 5, prompt, tokens, versions, now)
    first = versions[0] if versions else now
    expected = fake_routes(shape, 5, prompt + tokens, [first] * len(prompt) + versions)
    assert np.array_equal(routes.experts, expected.experts)


def _generation(logprobs: bool) -> Generation:
    values = np.array([-0.5, -1.0, -1.5, -2.0], dtype=np.float32) if logprobs else None
    return Generation([3, 4, 5, 6], values, "length")


def test_a_row_without_faults_comes_back_as_it_was() -> None:
    generation = _generation(logprobs=True)
    assert faulted(generation, None, None) is generation


@pytest.mark.parametrize("logprobs", [True, False])
def test_an_aborted_row_keeps_the_first_half_of_its_tokens(logprobs: bool) -> None:
    row = faulted(_generation(logprobs), None, "abort")
    assert row.token_ids.tolist() == [3, 4]
    assert row.finish_reason == "abort"
    assert (row.logprobs is None) == (not logprobs)
    if row.logprobs is not None:
        assert row.logprobs.tolist() == [-0.5, -1.0]


def test_garbage_logits_make_every_sampled_logprob_the_value() -> None:
    row = faulted(_generation(logprobs=False), float("nan"), None)
    assert row.logprobs is not None
    assert np.isnan(row.logprobs).all()
    assert row.token_ids.tolist() == [3, 4, 5, 6]
    assert row.finish_reason == "length"
    aborted = faulted(_generation(logprobs=True), float("-inf"), "abort")
    assert aborted.logprobs is not None
    assert aborted.logprobs.tolist() == [float("-inf")] * 2


TAGS = st.sets(st.sampled_from(sorted(MEMORY_TAGS)))


@given(TAGS, st.none() | st.lists(st.sampled_from(sorted(MEMORY_TAGS)), min_size=1, max_size=2))
def test_wake_up_wakes_sleeping_tags_only_when_none_it_names_is_awake(
    awake: set[str], tags: list[str] | None
) -> None:
    woken = waking(awake, tags)
    if awake == MEMORY_TAGS or (tags and set(tags) & awake):
        assert woken == frozenset()
    else:
        assert woken == (MEMORY_TAGS if tags is None else set(tags))


def test_wake_up_with_no_tags_wakes_everything() -> None:
    assert waking(set(), []) == MEMORY_TAGS
    assert waking({"weights"}, None) == MEMORY_TAGS
    assert waking({"weights"}, ["weights"]) == frozenset()  # vllm#31618: the call is dropped


@given(st.lists(st.integers(0, 9), max_size=12), st.integers(0, 4), st.integers(1, 9))
def test_each_placeholder_of_a_media_row_stands_for_image_prompt_ids(
    prompt: list[int], images: int, image_prompt_ids: int
) -> None:
    placeholders = prompt.count(9)
    match expanded_length(prompt, images, 9, image_prompt_ids):
        case Success(length):
            assert placeholders == images
            assert length == len(prompt) - placeholders + placeholders * image_prompt_ids
        case Failure(problem):
            assert placeholders != images
            assert f"{images} images for {placeholders} placeholders" in str(problem)


def test_routes_are_captured_only_when_asked_and_only_for_an_moe_model() -> None:
    shape = MoeShape(num_layers=2, top_k=1, num_experts=2)
    assert routes_option({}, shape) == Success(None)
    assert routes_option({"enable_return_routed_experts": False}, None) == Success(None)
    assert routes_option({"enable_return_routed_experts": True}, shape) == Success(shape)
    refused = routes_option({"enable_return_routed_experts": True}, "dense")
    assert isinstance(refused, Failure)
    assert "needs an MoE model" in str(refused.failure())


def test_weight_labels_become_spans_over_the_generated_tokens() -> None:
    assert weight_spans([], 0) == ()
    assert weight_spans([("a", 0)], 3) == (("a", 0, 3),)
    assert weight_spans([("a", 0), ("b", 2), ("a", 5)], 6) == (
        ("a", 0, 2),
        ("b", 2, 5),
        ("a", 5, 6),
    )


def test_a_fake_s_capabilities_follow_its_options_with_the_documented_defaults() -> None:
    caps = fake_capabilities({})
    assert (caps.vocab_size, caps.max_model_len, caps.device) == (64, 128, "cpu")
    assert caps.sleep_mode
    assert not caps.multimodal
    assert caps.image_token_id is None
    media = fake_capabilities({"image_token_id": 9, "max_images": 2, "logprobs_mode": "x"})
    assert (media.multimodal, media.image_token_id, media.max_images) == (True, 9, 2)
    assert media.logprobs_mode == "x"


def test_an_option_no_fake_takes_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"no options \['colour'\]"):
        fake_capabilities({"colour": 1})  # type: ignore[typeddict-unknown-key]


def test_draft_tokens_come_from_the_speculative_config_else_from_the_drafter() -> None:
    assert speculative_tokens({}, 3) == Success(None)
    assert speculative_tokens({"speculative_config": "eagle"}, 3) == Success(None)
    config = {"speculative_config": {"num_speculative_tokens": 2}}
    assert speculative_tokens(config, 3) == Success(2)
    assert speculative_tokens({"speculative_config": {}}, 3) == Success(3)
    refused = speculative_tokens({"speculative_config": {}}, None)
    assert isinstance(refused, Failure)
    assert "was not provided" in str(refused.failure())


def test_a_fake_serves_only_fully_awake_and_with_weights() -> None:
    assert unservable("generate", MEMORY_TAGS, weights_discarded=False) is None
    assert unservable("generate", {"weights"}, weights_discarded=False) == (
        "generate with only ['weights'] awake"
    )
    assert unservable("a step", MEMORY_TAGS, weights_discarded=True) == (
        "a step after a level-2 sleep without new weights"
    )


def test_a_fake_s_metrics_are_vllm_s_token_counters_and_running_gauge() -> None:
    labels = {"engine": "0", "model_name": "fake"}
    counters = fake_metrics(5, 3)
    assert counters == [
        CounterSample("vllm:prompt_tokens", labels, 5),
        CounterSample("vllm:generation_tokens", labels, 3),
    ]
    running = fake_metrics(5, 3, running=2)
    assert running[:2] == counters
    assert running[2] == GaugeSample("vllm:num_requests_running", labels, 2)


def test_an_image_is_seen_by_its_bytes_and_its_size() -> None:
    digest = image_digest(b"\x00\x01", (2, 1))
    assert digest.endswith("(2, 1)")
    assert digest == image_digest(b"\x00\x01", (2, 1))
    assert digest != image_digest(b"\x00\x02", (2, 1))
    assert digest != image_digest(b"\x00\x01", (1, 2))


@given(
    st.none() | st.sampled_from(InflightMode),
    st.none() | st.integers(0, 3),
    st.integers(0, 3),
    st.integers(0, 3),
)
def test_the_async_fake_steps_only_what_a_paused_scheduler_would(
    pause: InflightMode | None, budget: int | None, waiting: int, running: int
) -> None:
    step = steppable(pause, budget, waiting, running)
    if pause is InflightMode.KEEP or budget == 0:
        assert not step  # frozen, or out of steps
    elif running:
        assert step  # running requests always move on
    else:
        assert step == (pause is None and waiting > 0)  # a paused scheduler admits nothing
