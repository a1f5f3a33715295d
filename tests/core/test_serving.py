"""Laws of the OpenAI server's decisions: options, on-policy guard, token budget,
multi-turn prefix, versions (``genworker.core.serving``)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from returns.result import Failure, Result, Success
from strategies import (
    SERVING_VOCAB,
    json_nesting,
    json_values,
    maybe_token_ids,
    nested_json_texts,
    serving_decode,
    serving_segmentations,
    serving_texts,
)

from genworker.core.caps import CapError, CapFailure
from genworker.core.config import ConfigError, WorkerConfig
from genworker.core.serving import (
    CHARS_PER_TOKEN_AT_MOST,
    DEV_MODE_VARIABLE,
    MAX_JSON_DEPTH,
    ROUTES_CHOICE_FIELD,
    ROUTES_FIELD,
    BadRequest,
    BudgetError,
    ChatReference,
    HttpLimits,
    MalformedBody,
    OffPolicy,
    PrefixMismatch,
    SamplingPolicy,
    ServerOptions,
    Turn,
    chat_reference,
    check_body_length,
    check_chat_text,
    check_completion_prompt,
    check_dev_mode,
    check_nesting,
    check_on_policy,
    check_routes_request,
    check_template_stable,
    check_token_ids,
    check_turns,
    drop_routes,
    error_body,
    http_limits,
    http_max_tokens,
    json_depth,
    late_body,
    metrics_logger_interval,
    parse_body,
    prompt_tokens_at_most,
    request_budget,
    rollout_fills,
    server_options,
    splice_prefix,
    split_events,
    tag_events,
    template_source,
    tokenize_answer,
    training_policy,
    versions_between,
    vllm_server_argv,
)

BOS, EOS, COLON = SERVING_VOCAB.index("<s>"), SERVING_VOCAB.index("</s>"), SERVING_VOCAB.index(":")


def worker_config(**vllm_cfg: Any) -> WorkerConfig:
    cfg = {
        "model_name": "m",
        "max_new_tokens": 8,
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 20,
        "bad_words": ["zz"],
        "_pad_token_id": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.5,
            "max_model_len": 64,
            **vllm_cfg,
        },
    }
    parsed = WorkerConfig.from_mapping(cfg)
    assert isinstance(parsed, Success)
    config: WorkerConfig = parsed.unwrap()
    return config


# --- options ---------------------------------------------------------------------------


def test_no_server_unless_exposed() -> None:
    assert server_options(worker_config()) == Success(None)
    assert server_options(worker_config(expose_http_server=False)) == Success(None)
    assert server_options(worker_config(expose_http_server=None)) == Success(None)


def test_exposed_defaults_to_loopback_any_port_guard_on() -> None:
    got = server_options(worker_config(expose_http_server=True))
    assert isinstance(got, Success)
    options = got.unwrap()
    assert options == ServerOptions("127.0.0.1", 0, True, None)
    assert options is not None
    assert options.loopback


def test_options_given() -> None:
    got = server_options(
        worker_config(
            expose_http_server=True,
            http_server_host="0.0.0.0",
            http_server_port=8011,
            http_server_on_policy_guard=False,
            http_server_serving_chat_kwargs={"chat_template": "{{ x }}"},
            http_server_rl_routes=True,
            http_server_weight_transfer_timeout_s=7,
        )
    )
    assert got == Success(ServerOptions("0.0.0.0", 8011, False, "{{ x }}", True, 7.0))
    options = got.unwrap()
    assert options is not None
    assert not options.loopback


def test_none_values_mean_defaults() -> None:
    got = server_options(
        worker_config(
            expose_http_server=True,
            http_server_host=None,
            http_server_port=None,
            http_server_on_policy_guard=None,
            http_server_serving_chat_kwargs=None,
            http_server_rl_routes=None,
            http_server_weight_transfer_timeout_s=None,
        )
    )
    assert got == Success(ServerOptions())


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("expose_http_server", "maybe"),
        ("http_server_host", ""),
        ("http_server_host", 7),
        ("http_server_port", 70000),
        ("http_server_port", True),
        ("http_server_port", "80"),
        ("http_server_on_policy_guard", "sometimes"),
        ("http_server_rl_routes", "yes please"),
        ("http_server_weight_transfer_timeout_s", 0),
        ("http_server_weight_transfer_timeout_s", True),
        ("http_server_weight_transfer_timeout_s", "5"),
        ("http_server_serving_chat_kwargs", ["chat_template"]),
        ("http_server_serving_chat_kwargs", {"response_role": "bot"}),
        ("http_server_serving_chat_kwargs", {"chat_template": 3}),
        ("tool_parser_plugin", "hermes"),
        ("reasoning_parser_plugin", "r1"),
    ],
)
def test_bad_options_name_the_key(key: str, value: object) -> None:
    extra = {} if key == "expose_http_server" else {"expose_http_server": True}
    got = server_options(worker_config(**extra, **{key: value}))
    assert isinstance(got, Failure)
    error = got.failure()
    assert isinstance(error, ConfigError)
    assert error.keys == (f"vllm_cfg.{key}",)


def test_server_keys_without_the_server_are_refused() -> None:
    got = server_options(worker_config(http_server_port=8000))
    assert isinstance(got, Failure)
    assert got.failure().keys == ("vllm_cfg.http_server_port",)


# --- on-policy guard -------------------------------------------------------------------

POLICY = training_policy(worker_config())
TRAINING = dict(POLICY.values)


@given(st.sets(st.sampled_from([name for name, _ in POLICY.values])))
def test_the_training_values_pass_and_left_out_ones_are_filled(given_names: set[str]) -> None:
    body = {name: TRAINING[name] for name in given_names}
    got = check_on_policy(body, POLICY)
    assert isinstance(got, Success)
    fills = got.unwrap()
    assert fills == {
        name: value
        for name, value in POLICY.values
        if name not in given_names and value is not None
    }
    again = check_on_policy({**body, **fills}, POLICY)
    assert again == Success({})


NUMERIC = [
    name for name, v in POLICY.values if isinstance(v, int | float) and not isinstance(v, bool)
]


@given(
    st.sampled_from(NUMERIC),
    st.floats(-5, 5, allow_nan=False).filter(lambda x: x not in (0.0, 1.0, 0.8, 0.95, 20.0)),
)
def test_an_off_policy_number_is_refused_naming_it(name: str, value: float) -> None:
    got = check_on_policy({name: value}, POLICY)
    assert isinstance(got, Failure)
    problem = got.failure()
    assert isinstance(problem, OffPolicy)
    assert problem.parameter == name
    assert name in str(problem)
    assert problem.requested == value
    assert problem.training == TRAINING[name]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("logit_bias", {"5": 10}),
        ("allowed_token_ids", [1, 2]),
        ("use_beam_search", True),
        ("bad_words", ["other"]),
        ("temperature", "hot"),
        ("structured_outputs", {"json": {}}),
        ("response_format", {"type": "json_object"}),
        ("response_format", "text"),
    ],
)
def test_other_off_policy_fields_are_refused(name: str, value: object) -> None:
    got = check_on_policy({name: value}, POLICY)
    assert isinstance(got, Failure)
    assert got.failure().parameter == name


def test_neutral_values_pass() -> None:
    open_k = training_policy(worker_config())  # top_k 20 here; -1 and 0 both mean off
    assert isinstance(check_on_policy({"response_format": {"type": "text"}}, open_k), Success)
    assert isinstance(
        check_on_policy({"logit_bias": {}, "use_beam_search": False}, open_k), Success
    )
    cfg = WorkerConfig.from_mapping(
        {**worker_config().to_mapping(), "top_k": None, "bad_words": None}
    ).unwrap()
    off = training_policy(cfg)
    for k in (0, -1):
        assert isinstance(check_on_policy({"top_k": k}, off), Success)
    assert isinstance(check_on_policy({"bad_words": []}, off), Success)


# --- token budget ----------------------------------------------------------------------


@given(
    requested=st.one_of(st.none(), st.integers(1, 300)),
    prompt=st.integers(0, 300),
    max_new=st.integers(1, 300),
    max_len=st.integers(1, 300),
    cap=st.booleans(),
    spec=st.integers(0, 3),
)
@example(requested=None, prompt=9, max_new=4, max_len=10, cap=True, spec=1)  # room, no slots
@example(requested=20, prompt=5, max_new=4, max_len=10, cap=False, spec=0)  # past the context
def test_the_budget_never_passes_the_context(
    requested: int | None, prompt: int, max_new: int, max_len: int, cap: bool, spec: int
) -> None:
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new,
        "max_model_len": max_len,
        "cap_to_context": cap,
        "num_speculative_tokens": spec,
    }
    got = http_max_tokens(requested, prompt, **kwargs)
    wanted = max_new if requested is None else requested
    reserve = spec + 1 if spec else 0
    if prompt >= max_len or (prompt >= max_len - reserve and (spec or cap)):
        assert isinstance(got, Failure)
        assert isinstance(got.failure(), CapError)
        return
    if requested is not None and not cap and not spec and prompt + requested > max_len:
        assert isinstance(got, Failure)
        problem = got.failure()
        assert isinstance(problem, BudgetError)
        assert "max_tokens" in str(problem)
        assert problem.room == max_len - prompt
        return
    assert isinstance(got, Success)
    tokens = got.unwrap()
    assert 1 <= tokens <= min(wanted, max_len - prompt - reserve)
    if cap or spec:
        assert tokens == min(wanted, max_len - prompt - reserve)
    assert http_max_tokens(tokens, prompt, **kwargs) == Success(tokens)  # idempotent


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8", True])
def test_a_bad_max_tokens_is_refused(bad: object) -> None:
    got = http_max_tokens(
        bad, 3, max_new_tokens=4, max_model_len=64, cap_to_context=True, num_speculative_tokens=0
    )
    assert isinstance(got, Failure)
    assert isinstance(got.failure(), BudgetError)
    assert "max_tokens" in str(got.failure())


@given(
    requested=st.one_of(st.none(), st.integers(1, 300)),
    num_bytes=st.integers(0, 200),
    exact=st.data(),
    cap=st.booleans(),
    spec=st.integers(0, 3),
)
def test_a_budget_that_fits_the_bound_fits_the_exact_prompt(
    requested: int | None, num_bytes: int, exact: st.DataObject, cap: bool, spec: int
) -> None:
    bound = prompt_tokens_at_most(num_bytes)
    assert bound > num_bytes  # every token covers a byte, plus the added special tokens
    kwargs: dict[str, Any] = {
        "max_new_tokens": 16,
        "max_model_len": 512,
        "cap_to_context": cap,
        "num_speculative_tokens": spec,
    }
    with_bound = http_max_tokens(requested, bound, **kwargs)
    wanted = 16 if requested is None else requested
    if with_bound != Success(wanted):
        return
    length = exact.draw(st.integers(0, bound))
    assert http_max_tokens(requested, length, **kwargs) == Success(wanted)


# --- multi-turn prefix -----------------------------------------------------------------


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """(reference, template, tail): the reference ids of a history, another tokenization
    of the same text followed by the template's tail, and that tail."""
    text = draw(serving_texts())
    reference = [BOS, COLON, *draw(serving_segmentations(text))]
    retokenized = [BOS, COLON, *draw(serving_segmentations(text))]
    tail = [EOS, BOS, *draw(serving_segmentations(draw(serving_texts(min_size=0)))), COLON]
    return reference, retokenized + tail, tail


@given(conversations())
def test_the_reference_is_kept_verbatim_and_the_text_unchanged(
    case: tuple[list[int], list[int], list[int]],
) -> None:
    reference, template, tail = case
    got = splice_prefix(reference, template, serving_decode, message=1)
    assert isinstance(got, Success)
    ids = got.unwrap()
    assert list(ids[: len(reference)]) == reference
    assert list(ids) == reference + tail
    assert serving_decode(ids) == serving_decode(template)


@given(conversations())
def test_a_template_that_starts_with_the_reference_is_unchanged(
    case: tuple[list[int], list[int], list[int]],
) -> None:
    reference, _, tail = case
    template = reference + tail
    assert splice_prefix(reference, template, serving_decode, message=1) == Success(tuple(template))


@given(conversations(), st.sampled_from(["a", "b"]))
def test_an_edited_history_is_refused_naming_the_message(
    case: tuple[list[int], list[int], list[int]], letter: str
) -> None:
    reference, template, _ = case
    edited = [BOS, COLON, SERVING_VOCAB.index(letter), *template[2:]]
    if serving_decode(edited).startswith(serving_decode(reference)):
        return  # the edit kept the reference's text
    got = splice_prefix(reference, edited, serving_decode, message=3)
    assert isinstance(got, Failure)
    assert got.failure().message_index == 3
    assert "messages[3]" in str(got.failure())


def test_a_reference_ending_inside_a_template_token_is_refused() -> None:
    a, ab = SERVING_VOCAB.index("a"), SERVING_VOCAB.index("ab")
    got = splice_prefix([BOS, a], [BOS, ab, EOS], serving_decode, message=2)
    assert isinstance(got, Failure)
    assert "inside a token" in str(got.failure())


def test_a_longer_first_guess_shrinks() -> None:
    a, b, ab = (SERVING_VOCAB.index(x) for x in ("a", "b", "ab"))
    # the reference [a, b, a] is "aba"; the template [ab, a, b, </s>] has "aba" in 2 tokens
    got = splice_prefix([a, b, a], [ab, a, b, EOS], serving_decode, message=1)
    assert got == Success((a, b, a, b, EOS))


@st.composite
def turn_chains(draw: st.DrawFn) -> list[Turn]:
    turns: list[Turn] = []
    prefix: list[int] = [BOS]
    for k in range(draw(st.integers(1, 4))):
        prompt = prefix + draw(serving_segmentations(draw(serving_texts()))) + [COLON]
        generation = draw(serving_segmentations(draw(serving_texts())))
        turns.append(Turn(2 * k + 1, serving_decode(generation), prompt, generation))
        prefix = prompt + generation + [EOS]
    return turns


@given(turn_chains())
def test_a_consistent_chain_gives_the_last_reference(turns: list[Turn]) -> None:
    got = check_turns(turns, serving_decode)
    assert got == Success(turns[-1].prompt_ids + turns[-1].generation_ids)


@given(turn_chains(), st.data())
def test_an_edited_turn_is_named(turns: list[Turn], data: st.DataObject) -> None:
    k = data.draw(st.integers(0, len(turns) - 1))
    edited = list(turns)
    edited[k] = Turn(
        turns[k].message, turns[k].content + "!", turns[k].prompt_ids, turns[k].generation_ids
    )
    got = check_turns(edited, serving_decode)
    assert isinstance(got, Failure)
    problem = got.failure()
    assert isinstance(problem, PrefixMismatch)
    assert problem.message_index == turns[k].message


@given(turn_chains().filter(lambda t: len(t) > 1), st.data())
def test_a_broken_chain_is_named(turns: list[Turn], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(turns) - 1))
    broken = list(turns)
    broken[k] = Turn(
        turns[k].message, turns[k].content, (COLON, *turns[k].prompt_ids), turns[k].generation_ids
    )
    got = check_turns(broken, serving_decode)
    assert isinstance(got, Failure)
    assert got.failure().message_index == turns[k].message


def byte_decode(ids: Sequence[int]) -> str:
    """A byte-level tokenizer's whole decode: id = byte, partial characters U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def returned_text(ids: Sequence[int]) -> str:
    """What vLLM's incremental detokenizer returns for a generation of these bytes: a
    character still incomplete when the generation ends is dropped."""
    return codecs.getincrementaldecoder("utf-8")("replace").decode(bytes(ids), final=False)


@given(st.text(min_size=1, max_size=12), st.data())
def test_a_turn_that_ends_inside_a_character_is_taken_and_kept_verbatim(
    text: str, data: st.DataObject
) -> None:
    """Issue 48: vLLM drops a trailing partial character from the returned text; the
    next turn sends that text back with the ids, and the server takes its own answer."""
    raw = list(text.encode())
    cut = data.draw(st.integers(1, len(raw)))
    prompt, generation = list(b"<s>user:hi</s><s>assistant:"), raw[:cut]
    content = returned_text(generation)
    got = check_turns([Turn(1, content, prompt, generation)], byte_decode)
    assert got == Success(tuple(prompt + generation))
    tail = list(b"</s><s>user:more</s><s>assistant:")
    template = prompt + list(content.encode()) + tail
    spliced = splice_prefix(prompt + generation, template, byte_decode, message=1)
    assert spliced == Success(tuple(prompt + generation + tail))
    # the next turn's prompt keeps those bytes before its own tokens; it ends inside a
    # character too, and the template renders both texts as they came back
    prompt2, generation2 = prompt + generation + tail, raw[:cut]
    content2 = returned_text(generation2)
    assert check_turns(
        [Turn(1, content, prompt, generation), Turn(3, content2, prompt2, generation2)],
        byte_decode,
    ) == Success(tuple(prompt2 + generation2))
    template2 = [*template, *content2.encode(), *tail]
    spliced2 = splice_prefix(prompt2 + generation2, template2, byte_decode, message=3)
    assert spliced2 == Success(tuple(prompt2 + generation2 + tail))


def test_a_turn_whose_text_differs_before_the_dropped_character_is_refused() -> None:
    generation = list("xy\u00e9".encode())[:-1]  # ends inside the é
    got = check_turns([Turn(1, "xz", [1], generation)], byte_decode)
    assert isinstance(got, Failure)
    assert "messages[1]" in str(got.failure())


def test_an_unstable_template_is_named_and_a_stable_one_blames_the_history() -> None:
    alone = list(b"<s>user*:hi</s><s>assistant:ok</s>")
    whole = list(b"<s>user:hi</s><s>assistant:ok</s><s>user*:more</s>")
    got = check_template_stable(alone, whole, byte_decode, message=1, template="T.jinja")
    assert isinstance(got, Failure)
    problem = got.failure()
    assert problem.message_index == 1
    assert "chat template (T.jinja) is not prefix-stable" in str(problem)
    assert "edited" not in str(problem)
    stable = list(b"<s>user:hi</s><s>assistant:ok</s>")
    assert check_template_stable(stable, whole, byte_decode, message=1, template="T") == Success(
        None
    )


def test_no_turns_no_reference() -> None:
    assert check_turns([], serving_decode) == Success(())


# --- versions --------------------------------------------------------------------------


@given(st.integers(0, 50), st.integers(0, 5))
def test_versions_between_are_every_version_in_between(first: int, more: int) -> None:
    got = versions_between(first, first + more)
    assert got == tuple(range(first, first + more + 1))
    assert got[0] == first
    assert got[-1] == first + more


def test_versions_never_go_down() -> None:
    with pytest.raises(ValueError, match="only go up"):
        versions_between(3, 2)


# --- request bodies and prompts ------------------------------------------------------

VOCAB = 41


def limits(*, depth: int = MAX_JSON_DEPTH, body: int = 1 << 20, chars: int = 64) -> HttpLimits:
    return HttpLimits(
        max_body_bytes=body, max_depth=depth, max_prompt_chars=chars, vocab_size=VOCAB
    )


def refusal(result: object) -> BadRequest:
    assert isinstance(result, Failure), result
    problem = result.failure()
    assert isinstance(problem, BadRequest), problem
    assert 400 <= problem.status < 500
    return problem


@given(json_values, st.integers(1, 5))
def test_a_body_parses_iff_it_nests_within_the_limit(value: object, depth: int) -> None:
    raw = json.dumps(value).encode()
    got = parse_body(raw, limits(depth=depth))
    if json_nesting(value) <= depth:
        assert got == Success(json.loads(raw))
    else:
        problem = refusal(got)
        assert problem.param is None
        assert f"deeper than {depth} levels" in problem.message


@given(st.data(), st.integers(1, 6))
def test_nesting_is_counted_by_brackets_outside_strings(data: st.DataObject, depth: int) -> None:
    for levels in (depth, depth + 1):
        raw = data.draw(nested_json_texts(levels)).encode()
        got = parse_body(raw, limits(depth=depth))
        assert isinstance(got, Success) == (levels <= depth), (raw, got)


@given(json_values, st.integers(0, 6))
def test_json_depth_is_the_nesting_counted_up_to_one_past_the_limit(
    value: object, limit: int
) -> None:
    assert json_depth(value, limit) == min(json_nesting(value), limit + 1)


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 1_000, 100_000])
@pytest.mark.parametrize(("opening", "closing"), [("[", "]"), ('{"a":', "}")])
def test_any_nesting_past_the_limit_is_refused_not_a_recursion_error(
    levels: int, opening: str, closing: str
) -> None:
    raw = (opening * levels + "1" + closing * levels).encode()
    problem = refusal(parse_body(raw, http_limits(256, VOCAB)))
    assert problem.status == 400
    within = (opening * MAX_JSON_DEPTH + "1" + closing * MAX_JSON_DEPTH).encode()
    assert isinstance(parse_body(within, http_limits(256, VOCAB)), Success)


@given(st.integers(0, 64), st.integers(1, 64))
def test_a_body_past_the_byte_limit_is_413(size: int, limit: int) -> None:
    raw = b" " * (size - 1) + b"1" if size else b"1"
    got = parse_body(raw, limits(body=limit))
    if len(raw) > limit:
        problem = refusal(got)
        assert problem.status == 413
        assert str(limit) in problem.message
        assert check_body_length(len(raw), limits(body=limit)) == got
    else:
        assert got == Success(1)
        assert check_body_length(len(raw), limits(body=limit)) == Success(len(raw))


def test_a_body_that_arrives_late_is_408_saying_how_much_came() -> None:
    problem = late_body(60.0, 1234)
    assert (problem.status, problem.param) == (408, None)
    assert "within 60 s (1234 bytes came)" in problem.message


@pytest.mark.parametrize("raw", [b"{oops", b"", b"\xff\xfe{", b'{"a": 1'])
def test_malformed_json_is_left_to_vllm(raw: bytes) -> None:
    got = parse_body(raw, limits())
    assert isinstance(got, Failure)
    assert isinstance(got.failure(), MalformedBody)


@given(st.integers(1, 1 << 22))
def test_a_text_at_the_character_bound_fits_the_body_bound(max_model_len: int) -> None:
    bounds = http_limits(max_model_len, VOCAB)
    assert bounds.max_prompt_chars == CHARS_PER_TOKEN_AT_MOST * max_model_len
    escaped = len(json.dumps("\U0001f600")) - 2  # an astral character, \\u-escaped
    assert escaped == 12
    assert len(b'{"prompt": ""}') + escaped * bounds.max_prompt_chars <= bounds.max_body_bytes
    assert bounds.max_depth == MAX_JSON_DEPTH


@given(maybe_token_ids, st.integers(1, 2**64))
def test_ids_are_ints_inside_the_vocabulary_and_a_bad_one_is_named_by_index(
    ids: list[object], vocab: int
) -> None:
    got = check_token_ids(
        ids, "messages[3].generation_token_ids", param="messages", vocab_size=vocab
    )
    bad = [
        i
        for i, t in enumerate(ids)
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
    ]
    if not bad:
        assert got == Success(tuple(ids))
        return
    problem = refusal(got)
    assert problem.param == "messages"
    assert problem.message.startswith(f"messages[3].generation_token_ids[{bad[0]}]: ")
    if isinstance(ids[bad[0]], bool):
        assert "is not a token id" in problem.message


def test_ids_must_be_a_list_and_may_have_to_be_non_empty() -> None:
    assert check_token_ids([], "x", param="x", vocab_size=2) == Success(())
    assert (
        "must not be empty"
        in refusal(check_token_ids([], "x", param="x", vocab_size=2, allow_empty=False)).message
    )
    problem = refusal(check_token_ids("12", "required_prefix_token_ids", param="r", vocab_size=2))
    assert problem.message == 'required_prefix_token_ids must be a list of token ids, got "12"'
    assert problem.param == "r"


@given(
    st.one_of(
        st.text(max_size=80),
        st.lists(st.text(max_size=80), max_size=3),
        maybe_token_ids,
        st.lists(maybe_token_ids, max_size=3),
        st.none(),
        st.integers(),
        st.lists(st.one_of(st.text(max_size=2), maybe_token_ids), max_size=3),
    )
)
def test_a_completion_prompt_is_non_empty_texts_or_ids(prompt: object) -> None:
    bounds = limits()
    got = check_completion_prompt(prompt, bounds)

    def text_ok(t: object) -> bool:
        return isinstance(t, str) and 0 < len(t) <= bounds.max_prompt_chars

    def ids_ok(ids: object) -> bool:
        return (
            isinstance(ids, list)
            and len(ids) > 0
            and all(type(t) is int and 0 <= t < VOCAB for t in ids)
        )

    if isinstance(prompt, str):
        expected: object = (prompt,) if text_ok(prompt) else None
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        expected = tuple(prompt) if all(text_ok(p) for p in prompt) else None
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        expected = tuple(map(tuple, prompt)) if all(ids_ok(p) for p in prompt) else None
    else:
        expected = (tuple(prompt),) if ids_ok(prompt) else None  # type: ignore[arg-type]
    if expected is None:
        assert refusal(got).param == "prompt"
    else:
        assert got == Success(expected)


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ([], "prompt must not be empty"),
        ("", "prompt must not be empty"),
        ([[]], "prompt[0] must not be empty"),
        (["a", ""], "prompt[1] must not be empty"),
        ([True, False], "prompt[0]: true is not a token id"),
        ([[1], [2, True]], "prompt[1][1]: true is not a token id"),
        ([1, 2**63], f"prompt[1]: token id {2**63} is outside the vocabulary [0, {VOCAB})"),
        ([-1], f"prompt[0]: token id -1 is outside the vocabulary [0, {VOCAB})"),
        (["a", [1]], "prompt[1] must be a str like prompt[0]"),
        ([[1], "a"], 'prompt[1] must be a list of token ids, got "a"'),
        (None, "prompt must be a str, a list of str, token ids or a list of token id lists"),
        ("x" * 65, "prompt has 65 characters, more than the 64"),
        (["x", "x" * 65], "prompt[1] has 65 characters, more than the 64"),
    ],
)
def test_a_refused_prompt_says_which(prompt: object, says: str) -> None:
    problem = refusal(check_completion_prompt(prompt, limits()))
    assert problem.param == "prompt"
    assert problem.status == 400
    assert problem.message.startswith(says), problem.message


@given(
    st.lists(
        st.one_of(
            st.builds(dict, role=st.just("user"), content=st.text(max_size=30)),
            st.builds(
                dict,
                role=st.just("user"),
                content=st.lists(
                    st.one_of(
                        st.builds(dict, type=st.just("text"), text=st.text(max_size=30)),
                        st.builds(dict, type=st.just("image_url"), image_url=st.just({})),
                        st.just("loose"),
                    ),
                    max_size=3,
                ),
            ),
            st.builds(dict, role=st.just("assistant"), content=st.none()),
            st.just("not a message"),
        ),
        max_size=5,
    )
)
@example([{"role": "user", "content": "x" * 20}, {"content": [{"type": "text", "text": "y"}]}])
def test_chat_text_is_counted_and_refused_past_the_bound(messages: list[object]) -> None:
    def chars(m: object) -> int:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            return len(content)
        if isinstance(content, list):
            return sum(len(p["text"]) for p in content if isinstance(p, dict) and "text" in p)
        return 0

    total = sum(map(chars, messages))
    got = check_chat_text(messages, limits(chars=20))
    if total <= 20:
        assert got == Success(total)
    else:
        problem = refusal(got)
        assert problem.param == "messages"
        assert "more than the 20" in problem.message
        assert "refused before tokenizing" in problem.message


@given(st.data(), st.integers(1, 6))
def test_a_body_for_another_route_is_kept_unless_nested_past_the_limit(
    data: st.DataObject, depth: int
) -> None:
    for levels in (depth, depth + 1):
        raw = data.draw(nested_json_texts(levels)).encode()
        got = check_nesting(raw, limits(depth=depth))
        if levels <= depth:
            assert got == Success(raw)
        else:
            assert refusal(got).message.startswith(f"the request body nests deeper than {depth}")


@pytest.mark.parametrize("raw", [b"[[[[[[[[", b'{"a": [[[[[[[[', b"[" * 100_000])
def test_nesting_of_a_malformed_body_is_left_to_its_route_unless_past_the_parser(
    raw: bytes,
) -> None:
    got = check_nesting(raw, limits(depth=4))
    if len(raw) > 1000:  # Python's parser gives up (RecursionError): refused as too deep
        assert refusal(got).status == 400
    else:
        assert got == Success(raw)


@pytest.mark.parametrize("top_k", [None, -1, 0])
def test_trls_explicit_defaults_are_the_training_values(top_k: int | None) -> None:
    """TRL 1.16's ``VLLMClient.generate`` sends these explicitly (``top_k`` 0: off)."""
    policy = SamplingPolicy(
        (
            ("temperature", 1.0),
            ("top_p", 1.0),
            ("top_k", -1),
            ("min_p", 0.0),
            ("repetition_penalty", 1.0),
        )
    )
    trl = {"n": 4, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "min_p": 0.0}
    filled = {} if top_k is not None else {"top_k": -1}
    assert check_on_policy({**trl, "top_k": top_k}, policy) == Success(filled)
    for name, value in (("min_p", 0.05), ("repetition_penalty", 1.2), ("top_k", 7)):
        got = check_on_policy({**trl, name: value}, policy)
        assert isinstance(got, Failure)
        assert got.failure().parameter == name


# --- routed experts ---

_choices = st.lists(
    st.dictionaries(st.sampled_from(["index", "text", ROUTES_CHOICE_FIELD]), json_values)
    | json_values,
    max_size=4,
)


@given(
    st.dictionaries(st.sampled_from(["id", "usage", "model"]), json_values), _choices, st.booleans()
)
def test_drop_routes_removes_exactly_the_choices_routes(
    rest: dict[str, object], choices: list[object], indent: bool
) -> None:
    response = {**rest, "choices": choices}
    raw = json.dumps(response, indent=1 if indent else None).encode()
    out = drop_routes(raw)
    expected = [
        {k: v for k, v in c.items() if k != ROUTES_CHOICE_FIELD} if isinstance(c, dict) else c
        for c in choices
    ]
    assert json.loads(out) == {**rest, "choices": expected}
    if not any(isinstance(c, dict) and ROUTES_CHOICE_FIELD in c for c in choices):
        assert out == raw  # nothing to drop: vLLM's own bytes


@given(st.binary(max_size=40) | json_values.map(lambda v: json.dumps(v).encode()))
def test_drop_routes_leaves_bytes_without_choices_as_they_are(raw: bytes) -> None:
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("choices"), list):
        return  # the law above
    assert drop_routes(raw) == raw


@given(
    st.one_of(
        st.just({}),
        st.fixed_dictionaries({ROUTES_FIELD: st.sampled_from([True, False])}),
        st.fixed_dictionaries({ROUTES_FIELD: json_values}),
    ),
    st.sampled_from([None, True, False, "yes"]),
    st.booleans(),
)
def test_routes_are_given_only_when_asked_by_a_bool_of_a_capturing_unstreamed_request(
    field: dict[str, object], stream: object, captures: bool
) -> None:
    body = {**field, **({} if stream is None else {"stream": stream})}
    checked = check_routes_request(body, captures=captures)
    wanted = body.get(ROUTES_FIELD, False)
    if wanted is False:
        assert checked == Success(False)
    elif wanted is True and captures and stream is not True:
        assert checked == Success(True)
    else:
        assert isinstance(checked, Failure)
        problem = checked.failure()
        assert (problem.status, problem.param) == (400, ROUTES_FIELD)
        if type(wanted) is not bool:
            assert "true or false" in str(problem)
        elif not captures:
            assert "does not capture" in str(problem)
        else:
            assert "non-streamed" in str(problem)


# --- the layer's fills, turns, events and refusals -------------------------------------


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "return_token_ids": st.one_of(st.booleans(), st.none()),
            "logprobs": st.one_of(st.none(), st.booleans(), st.integers(0, 3)),
        },
    ),
    st.booleans(),
    st.booleans(),
)
def test_rollout_fills_ask_for_ids_and_sampled_logprobs_and_the_training_values(
    body: dict[str, object], chat: bool, guarded: bool
) -> None:
    policy = training_policy(worker_config()) if guarded else None
    fills = rollout_fills(body, policy, chat=chat).unwrap()
    filled = {**body, **fills}
    assert filled["return_token_ids"] is True
    if chat:
        assert filled["logprobs"]
    else:
        assert filled["logprobs"] is not None
    assert all(filled[k] == body[k] for k in body if k not in fills)  # nothing given changes
    assert all(body.get(k) is None or k in ("return_token_ids", "logprobs") for k in fills)
    if policy is not None:
        assert {k: filled[k] for k in check_on_policy(body, policy).unwrap()} == (
            check_on_policy(body, policy).unwrap()
        )


def test_rollout_fills_refuse_an_off_policy_request_naming_the_parameter() -> None:
    refused = rollout_fills({"temperature": 0.3}, training_policy(worker_config()), chat=True)
    assert refused.swap().unwrap().parameter == "temperature"
    assert rollout_fills({"temperature": 0.3}, None, chat=False).unwrap() == {
        "return_token_ids": True,
        "logprobs": 0,
    }


def _text(ids: Sequence[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


def test_the_chat_reference_is_the_last_turn_s_ids_or_the_required_prefix() -> None:
    messages: list[dict[str, object]] = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "c", "prompt_token_ids": [1], "generation_token_ids": [2]},
        {"role": "user", "content": "r"},
        {"role": "assistant", "content": "b"},
    ]
    assert chat_reference(messages, None, 10, _text) == Success(ChatReference((1, 2), 1))
    assert chat_reference(messages, [1, 2, 5], 10, _text) == Success(ChatReference((1, 2, 5), 3))
    assert chat_reference(messages[:1], None, 10, _text) == Success(ChatReference((), -1))
    required = chat_reference(messages[:1], [10], 10, _text).swap().unwrap()
    assert (required.param, required.status) == ("required_prefix_token_ids", 400)
    assert required.message.startswith("required_prefix_token_ids[0]: token id 10 is outside")


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ({"content": None, "prompt_token_ids": [1]}, "messages[1]: a turn with token ids needs"),
        ({"content": "a", "prompt_token_ids": [1, 99]}, "messages[1].prompt_token_ids[1]: "),
        ({"content": "a", "prompt_token_ids": [1]}, "messages[1].generation_token_ids must be"),
        ({"content": "a", "generation_token_ids": True}, "messages[1].prompt_token_ids must be"),
        (
            {"content": "x", "prompt_token_ids": [1], "generation_token_ids": [2]},
            "messages[1]: the content ('x') is not the text of its generation_token_ids",
        ),
    ],
)
def test_a_bad_turn_is_refused_naming_the_message(message: dict[str, object], why: str) -> None:
    refused = chat_reference([{"role": "user", "content": "q"}, message], None, 10, _text)
    problem = refused.swap().unwrap()
    assert problem.message.startswith(why)
    assert (problem.status, problem.param) == (400, "messages")


def test_the_template_source_names_whose_template_rendered() -> None:
    assert template_source({"chat_template": "t"}, "s") == "the request's chat_template"
    assert template_source({}, "s") == "vllm_cfg.http_server_serving_chat_kwargs.chat_template"
    assert template_source({"chat_template_kwargs": {"x": 1}}, None) == (
        "the model's own, from its tokenizer config, with chat_template_kwargs {'x': 1}"
    )


def test_error_bodies_are_openai_shaped() -> None:
    assert error_body(400, "m", "p") == {
        "error": {"message": "m", "type": "BadRequestError", "param": "p", "code": 400}
    }
    assert error_body(503, "m", None)["error"] == {
        "message": "m",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }


@given(st.lists(st.sampled_from([b"data: {}\n\n", b"data: ", b"{}\n\n", b"x"]), max_size=12))
def test_split_events_sends_whole_events_and_loses_nothing(parts: list[bytes]) -> None:
    """Law: the bytes sent, in order, are the body; every send but the last ends an event,
    and a held rest holds no whole event."""
    sent: list[bytes] = []
    rest = b""
    for k, part in enumerate(parts):
        more = k < len(parts) - 1
        events, rest = split_events(rest + part, more)
        if events is None:
            assert more
            assert b"\n\n" not in rest
            continue
        sent.append(events)
        assert not more or events.endswith(b"\n\n")
    assert b"".join(sent) + rest == b"".join(parts)
    assert rest == b"" or not parts


def test_split_events_holds_a_partial_event_and_flushes_at_the_end() -> None:
    assert split_events(b"data: {}\n\ndata: {", True) == (b"data: {}\n\n", b"data: {")
    assert split_events(b"data: {", True) == (None, b"data: {")
    assert split_events(b"data: {}", False) == (b"data: {}", b"")
    assert split_events(b"a\n\nb", False) == (b"a\n\nb", b"")


def test_tagged_events_carry_the_versions_and_keep_everything_else() -> None:
    events = b'data: {"a": "data: {x"}\n\ndata: [DONE]\n\ndata: {bad\n\ndata: {"k": 1}\n\n'
    tagged = tag_events(events, (2, 3)).split(b"\n\n")
    assert json.loads(tagged[0][len(b"data: ") :]) == {"weight_versions": [2, 3], "a": "data: {x"}
    assert tagged[1:3] == [b"data: [DONE]", b"data: {bad"]
    assert json.loads(tagged[3][len(b"data: ") :]) == {"weight_versions": [2, 3], "k": 1}
    assert tag_events(b'data: {"k": [1]}', ()) != b'data: {"k": [1]}'
    assert tag_events(b"data: {1: 2}\n\n", (1,)) == b"data: {1: 2}\n\n"


@pytest.mark.parametrize("raw", ["1", "true", " yes "])
def test_vllm_dev_mode_is_refused_naming_the_variable(raw: str) -> None:
    refused = check_dev_mode(raw).swap().unwrap()
    assert refused.message.startswith(f"{DEV_MODE_VARIABLE}={raw!r} is set")
    assert isinstance(check_dev_mode("", dev_mode=True), Failure)
    assert check_dev_mode(" 0 ") == check_dev_mode("") == Success(None)


def test_vllm_server_argv_names_the_model_its_names_and_template() -> None:
    base = ["--model", "m", "--max-model-len", "64"]
    assert vllm_server_argv("m", 64, None, None) == base
    assert vllm_server_argv("m", 64, "s", "t") == [
        *base,
        "--served-model-name",
        "s",
        "--chat-template",
        "t",
    ]
    assert vllm_server_argv("m", 64, ["a", "b"], None) == [*base, "--served-model-name", "a", "b"]


def _budget(requested: object, length: int) -> Result[int, BudgetError | CapFailure]:
    return http_max_tokens(
        requested,
        length,
        max_new_tokens=8,
        max_model_len=32,
        cap_to_context=True,
        num_speculative_tokens=0,
    )


@given(st.one_of(st.none(), st.integers(1, 40)), st.lists(st.integers(0, 31), min_size=1))
def test_a_request_runs_with_the_least_budget_of_its_prompts(
    requested: int | None, lengths: list[int]
) -> None:
    budget = request_budget(requested, lengths, _budget, key="max_tokens", prompt_param="prompt")
    assert budget == Success(min(_budget(requested, n).unwrap() for n in lengths))


def test_a_request_budget_refusal_names_the_prompt_or_the_field() -> None:
    full = request_budget(None, [3, 32], _budget, key="max_tokens", prompt_param="messages")
    assert full.swap().unwrap().param == "messages"
    assert full.swap().unwrap().message.startswith("messages: ")
    bad = request_budget(0, [3], _budget, key="max_completion_tokens", prompt_param="prompt")
    assert (bad.swap().unwrap().param, bad.swap().unwrap().status) == ("max_completion_tokens", 400)


def test_tokenize_answers_give_the_ids_or_vllm_s_message() -> None:
    assert tokenize_answer(200, {"tokens": [1, 2], "count": 2}) == Success([1, 2])
    error = {"error": {"message": "no template", "code": 400}}
    assert tokenize_answer(400, error) == Failure(BadRequest("no template", status=400, param=None))
    assert tokenize_answer(422, {"detail": "x"}).swap().unwrap().message == "{'detail': 'x'}"
    assert tokenize_answer(500, "boom") == Failure(BadRequest("boom", status=500, param=None))
    assert tokenize_answer(200, "text").swap().unwrap().status == 500


def test_the_metrics_logger_is_off_unless_enabled_and_runs_at_its_interval() -> None:
    assert metrics_logger_interval(worker_config()) == Success(None)
    assert metrics_logger_interval(worker_config(vllm_metrics_logger_interval=2)) == Success(None)
    on = worker_config(enable_vllm_metrics_logger=True)
    assert metrics_logger_interval(on) == Success(0.5)  # NeMo-RL's default
    every = worker_config(enable_vllm_metrics_logger=True, vllm_metrics_logger_interval=2)
    assert metrics_logger_interval(every) == Success(2.0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("enable_vllm_metrics_logger", "sometimes"),
        ("vllm_metrics_logger_interval", 0),
        ("vllm_metrics_logger_interval", -1.0),
        ("vllm_metrics_logger_interval", True),
        ("vllm_metrics_logger_interval", float("nan")),
        ("vllm_metrics_logger_interval", "1s"),
    ],
)
def test_bad_metrics_logger_settings_are_refused_naming_the_key_and_value(
    key: str, value: object
) -> None:
    cfg = worker_config(**{"enable_vllm_metrics_logger": True, key: value})
    refused = metrics_logger_interval(cfg)
    assert isinstance(refused, Failure)
    assert refused.failure().message.startswith(f"vllm_cfg.{key} must be ")
    assert refused.failure().message.endswith(f"got {value!r}")
    assert refused.failure().keys == (f"vllm_cfg.{key}",)
