"""core.server_prompts: the machine that prepares one generation request, driven against a
byte-level fake of vLLM's ``/tokenize`` (one token per UTF-8 byte; a chat message renders
as ``role: content\\n``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Result, Success

from genworker.core.server_prompts import Prepared, PromptRules, Steps, Tokenized
from genworker.core.serving import (
    BadRequest,
    SamplingPolicy,
    http_limits,
    http_max_tokens,
)

MAX_MODEL_LEN = 256
MAX_NEW_TOKENS = 16
Answer = Callable[[Mapping[str, object]], Tokenized]


def decode(ids: Sequence[int], skip_special: bool) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def render(payload: Mapping[str, object]) -> str:
    messages = payload["messages"]
    assert isinstance(messages, list)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    if payload.get("chat_template") == "unstable" and len(messages) > 2:
        text = "#" + text  # renders the first messages differently once more follow
    return text + ("assistant: " if payload.get("add_generation_prompt", True) else "")


def tokenize(payload: Mapping[str, object]) -> Tokenized:
    prompt = payload.get("prompt")
    text = prompt if isinstance(prompt, str) else render(payload)
    return 200, {"tokens": list(text.encode())}


def refusing(status: int, after: int = 0) -> Answer:
    """A ``/tokenize`` that answers ``after`` payloads, then refuses with ``status``."""
    asked = [0]

    def answer(payload: Mapping[str, object]) -> Tokenized:
        asked[0] += 1
        if asked[0] > after:
            return status, {"error": {"message": "no tokenizer today"}}
        return tokenize(payload)

    return answer


def rules(**changes: object) -> PromptRules:
    settings: dict[str, object] = {
        "policy": None,
        "max_new_tokens": MAX_NEW_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
        "cap_to_context": False,
        "num_speculative_tokens": 0,
        "limits": http_limits(MAX_MODEL_LEN, 256),
        "reuses_prompt_ids": True,
    } | changes
    return PromptRules(**settings)  # type: ignore[arg-type]


def drive(
    body: Mapping[str, object],
    *,
    chat: bool = False,
    answer: Answer = tokenize,
    server: PromptRules | None = None,
) -> tuple[Result[Prepared, BadRequest], list[dict[str, object]]]:
    """The machine run to its decision, and the payloads it asked to tokenize."""
    steps: Steps = (server or rules()).prepare(body, chat=chat, decode=decode)
    asked: list[dict[str, object]] = []
    try:
        payload = next(steps)
        while True:
            asked.append(payload)
            payload = steps.send(answer(payload))
    except StopIteration as done:
        return done.value, asked


def refusal(result: Result[Prepared, BadRequest]) -> BadRequest:
    assert isinstance(result, Failure), result
    problem: BadRequest = result.failure()
    return problem


def prepared(result: Result[Prepared, BadRequest]) -> Prepared:
    assert isinstance(result, Success), result
    value: Prepared = result.unwrap()
    return value


# --- completions -------------------------------------------------------------------------


@given(
    text=st.text(alphabet="ab é", min_size=1, max_size=200),
    requested=st.one_of(st.none(), st.integers(1, MAX_MODEL_LEN)),
    cap=st.booleans(),
)
def test_a_text_prompt_gets_the_budget_of_its_exact_length_tokenized_or_not(
    text: str, requested: int | None, cap: bool
) -> None:
    """The fast path (no tokenization) decides what the exact token count decides."""
    body = {"prompt": text} if requested is None else {"prompt": text, "max_tokens": requested}
    got, _ = drive(body, server=rules(cap_to_context=cap))
    exact = http_max_tokens(
        requested,
        len(text.encode()),
        max_new_tokens=MAX_NEW_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        cap_to_context=cap,
        num_speculative_tokens=0,
    )
    if isinstance(exact, Failure):
        assert refusal(got).param in ("prompt", "max_tokens")
    else:
        assert prepared(got).body["max_tokens"] == exact.unwrap()


def test_a_short_text_prompt_and_an_id_prompt_are_not_tokenized() -> None:
    body = {"prompt": ["hello", "hi"], "max_tokens": 4, "return_token_ids": True, "logprobs": 0}
    got, asked = drive(body)
    assert asked == []
    assert prepared(got) == Prepared(dict(body), changed=False)
    got, asked = drive({"prompt": [1, 2, 3], "model": "m"})
    assert asked == []
    assert prepared(got).body == {
        "prompt": [1, 2, 3],
        "model": "m",
        "return_token_ids": True,
        "logprobs": 0,
        "max_tokens": MAX_NEW_TOKENS,
    }
    assert prepared(got).changed


def test_a_long_text_prompt_is_tokenized_with_its_model_and_refused_past_the_context() -> None:
    text = "x" * 200
    got, asked = drive({"prompt": text, "model": "m", "max_tokens": 60, "seed": 1})
    assert asked == [{"model": "m", "prompt": text}]
    assert refusal(got).param == "max_tokens"
    got, _ = drive({"prompt": text, "max_tokens": 60}, server=rules(cap_to_context=True))
    assert prepared(got).body["max_tokens"] == MAX_MODEL_LEN - 200


def test_a_refused_tokenization_or_prompt_refuses_the_request() -> None:
    got, _ = drive({"prompt": "x" * 200}, answer=refusing(400))
    assert refusal(got) == BadRequest("no tokenizer today", status=400, param=None)
    assert refusal(drive({"prompt": ""})[0]).param == "prompt"


def test_an_unusual_max_tokens_is_judged_unmemoized() -> None:
    assert refusal(drive({"prompt": "hi", "max_tokens": True})[0]).param == "max_tokens"
    assert refusal(drive({"prompt": "hi", "max_tokens": "9"})[0]).param == "max_tokens"


def test_the_policy_fills_its_values_and_refuses_others() -> None:
    server = rules(policy=SamplingPolicy((("temperature", 1.0),)))
    assert prepared(drive({"prompt": [1]}, server=server)[0]).body["temperature"] == 1.0
    problem = refusal(drive({"prompt": [1], "temperature": 0.5}, server=server)[0])
    assert (problem.status, problem.param) == (400, "temperature")


# --- chat ----------------------------------------------------------------------------------


def turn(content: str, prompt: Sequence[int]) -> dict[str, object]:
    """An assistant message as the agent sends it back, with the ids it came with."""
    return {
        "role": "assistant",
        "content": content,
        "prompt_token_ids": list(prompt),
        "generation_token_ids": list(content.encode()),
        "generation_log_probs": [0.0] * len(content.encode()),
    }


def history(template: str | None = None) -> tuple[dict[str, object], list[int]]:
    """A two-turn chat body and the reference ids its last turn carries."""
    first = {"role": "user", "content": "hi"}
    prompt = list(b"user: hi\nassistant: ")
    body: dict[str, object] = {
        "messages": [first, turn("yo", prompt), {"role": "user", "content": "more"}],
        "max_completion_tokens": 8,
    }
    if template is not None:
        body["chat_template"] = template
    return body, prompt + list(b"yo")


def test_a_chat_prompt_is_tokenized_and_its_turn_fields_leave_the_body() -> None:
    body, _ = history()
    for m in body["messages"]:  # type: ignore[attr-defined]
        m.pop("prompt_token_ids", None)
        m.pop("generation_token_ids", None)
    got, asked = drive(body | {"tools": [], "seed": 3}, chat=True)
    rendered = render(asked[0])
    assert asked == [{"tools": [], "messages": prepared(got).body["messages"]}]
    assert prepared(got).body["max_completion_tokens"] == 8
    assert prepared(got).body["logprobs"] is True
    assert prepared(got).changed
    assert all("generation_log_probs" not in m for m in asked[0]["messages"])  # type: ignore[attr-defined]
    assert "kv_transfer_params" not in prepared(got).body
    assert len(rendered) < MAX_MODEL_LEN


def test_earlier_ids_are_spliced_verbatim_into_the_prompt() -> None:
    body, reference = history()
    got, _ = drive(body | {"kv_transfer_params": {"kept": 1}}, chat=True)
    kv = prepared(got).body["kv_transfer_params"]
    assert isinstance(kv, dict)
    assert kv["kept"] == 1
    ids = kv["prompt_token_ids"]
    assert ids[: len(reference)] == reference
    assert decode(ids, False).endswith("user: more\nassistant: ")


def test_a_required_prefix_is_the_reference_and_a_bad_one_is_refused() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "required_prefix_token_ids": list(b"user")}
    got, _ = drive(body, chat=True)
    assert prepared(got).body["kv_transfer_params"] == {"prompt_token_ids": list(b"user: hi\n") + list(b"assistant: ")}  # fmt: skip
    assert "required_prefix_token_ids" not in prepared(got).body
    bad = drive({"messages": messages, "required_prefix_token_ids": [True]}, chat=True)[0]
    assert refusal(bad).param == "required_prefix_token_ids"


def test_a_vllm_that_cannot_take_ids_refuses_a_reference_with_501() -> None:
    body, _ = history()
    problem = refusal(drive(body, chat=True, server=rules(reuses_prompt_ids=False))[0])
    assert (problem.status, problem.param) == (501, "messages")


def test_a_broken_prefix_names_the_template_when_it_is_unstable_else_the_history() -> None:
    body, _ = history("unstable")
    got, asked = drive(body, chat=True)
    assert "chat template (the request's chat_template) is not prefix-stable" in str(refusal(got))
    assert asked[1]["messages"] == prepared_messages(body)[:2]
    assert asked[1]["add_generation_prompt"] is False
    body, _ = history()
    body["messages"][0]["content"] = "edited"  # type: ignore[index]
    got, asked = drive(body, chat=True)
    assert "does not render to the text of the ids" in str(refusal(got))
    assert refusal(got).param == "messages"
    got, _ = drive(history("unstable")[0], chat=True, answer=refusing(500, after=1))
    assert refusal(got).status == 500


def prepared_messages(body: Mapping[str, object]) -> list[dict[str, object]]:
    messages = body["messages"]
    assert isinstance(messages, list)
    fields = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
    return [{k: v for k, v in m.items() if k not in fields} for m in messages]


def test_bad_chat_bodies_are_refused_before_tokenizing() -> None:
    for messages in ("hi", [1], None):
        got, asked = drive({"messages": messages}, chat=True)
        assert (refusal(got).param, asked) == ("messages", [])
    huge = [{"role": "user", "content": "x" * (33 * MAX_MODEL_LEN)}]
    assert refusal(drive({"messages": huge}, chat=True)[0]).param == "messages"
    edited = [{"role": "assistant", "content": "no", "generation_token_ids": [1]}]
    assert refusal(drive({"messages": edited}, chat=True)[0]).param == "messages"
    got, _ = drive(
        {"messages": [{"role": "user", "content": "a"}]}, chat=True, answer=refusing(404)
    )
    assert refusal(got) == BadRequest("no tokenizer today", status=400, param=None)
    long = [{"role": "user", "content": "x" * MAX_MODEL_LEN}]
    assert refusal(drive({"messages": long}, chat=True)[0]).param == "messages"
