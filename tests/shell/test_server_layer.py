"""The ASGI layer of ``genworker.shell.server`` in front of a stand-in ASGI app (no
engine): what it sends on, what it refuses, how it tags streamed events across chunk
boundaries, and how ``abort_all`` ends requests in flight. The real app is
``test_server_engine``'s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from genworker.core.config import WorkerConfig
from genworker.core.server_prompts import PromptRules
from genworker.core.serving import ServerOptions, http_limits, http_max_tokens, training_policy
from genworker.shell.errors import BadConfigError, EngineStateError
from genworker.shell.server import (
    DEV_MODE_VARIABLE,
    VERSIONS_HEADER,
    OpenAIServer,
    RolloutLayer,
    bind_socket,
    build_vllm_app,
    refuse_dev_mode,
)


class Hooks:
    def __init__(self) -> None:
        self.weight_version = 0
        self.refuse = False
        self.opened = 0

    @contextlib.asynccontextmanager
    async def in_flight(self) -> AsyncIterator[object]:
        if self.refuse:
            raise EngineStateError("weights inconsistent: refit again")
        self.opened += 1
        yield None


class StandIn:
    """Answers /tokenize with one token per character; generation routes with the body
    it got, or with ``events`` as a stream split at ``cuts``."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []
        self.tokenized: list[Any] = []
        self.events: list[bytes] | None = None
        self.hold: asyncio.Event | None = None
        #: the JSON a generation route answers (without events)
        self.response: object = {"ok": True}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw = (await receive())["body"]
        if scope["path"] == "/tokenize":
            payload = json.loads(raw)
            self.tokenized.append(payload)
            text = payload.get("prompt") or "".join(m["content"] for m in payload["messages"])
            await self._json(send, 200, {"tokens": list(range(len(text)))})
            return
        self.bodies.append(raw)
        if self.hold is not None:
            await self.hold.wait()
        if self.events is None:
            await self._json(send, 200, self.response)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )
        for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _json(send: Any, status: int, obj: object) -> None:
        body = json.dumps(obj).encode()
        headers = [(b"content-length", str(len(body)).encode())]
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), *headers],
            }
        )
        await send({"type": "http.response.body", "body": body})


def config() -> WorkerConfig:
    parsed = WorkerConfig.from_mapping(
        {
            "model_name": "m",
            "max_new_tokens": 8,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": None,
            "_pad_token_id": 0,
            "vllm_cfg": {
                "tensor_parallel_size": 1,
                "pipeline_parallel_size": 1,
                "gpu_memory_utilization": 0.5,
                "max_model_len": 32,
            },
        }
    )
    cfg: WorkerConfig = parsed.unwrap()
    return cfg


VOCAB = 50


def decode(ids: Sequence[int], skip_special: bool) -> str:
    """Id i is chr(97 + i % 26); as a real tokenizer's ``decode``, an id past 64 bits
    overflows (an OverflowError was the 500 of issue 44), and an id past the vocabulary
    is a bug of the layer here."""
    if any(not 0 <= i < 2**63 for i in ids):
        raise OverflowError("out of range integral type conversion attempted")
    assert all(i < VOCAB for i in ids), ids
    return "".join(chr(97 + i % 26) for i in ids)


def layer(
    app: StandIn, hooks: Hooks, *, body_timeout_s: float = 10.0, captures_routes: bool = False
) -> RolloutLayer:
    return RolloutLayer(
        app,
        hooks,
        rules=PromptRules(
            policy=training_policy(config()),
            max_new_tokens=8,
            max_model_len=32,
            cap_to_context=True,
            num_speculative_tokens=0,
            limits=http_limits(32, VOCAB),
            reuses_prompt_ids=True,
        ),
        decode=decode,
        body_timeout_s=body_timeout_s,
        captures_routes=captures_routes,
    )


async def call(asgi: RolloutLayer, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    sent = False
    messages: list[Any] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError

    async def send(message: Any) -> None:
        messages.append(message)

    scope: dict[str, object] = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [],
        "query_string": b"",
    }
    await asyncio.wait_for(asyncio.ensure_future(asgi(scope, receive, send)), 10)
    start = messages[0]
    headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], headers, b"".join(m.get("body", b"") for m in messages[1:])


def test_a_request_gets_ids_logprobs_budget_and_versions() -> None:
    app, hooks = StandIn(), Hooks()
    hooks.weight_version = 3
    status, headers, _ = asyncio.run(
        call(layer(app, hooks), "/v1/completions", b'{"prompt": "hello"}')
    )
    assert status == 200
    assert headers[VERSIONS_HEADER] == "3"
    sent = json.loads(app.bodies[0])
    assert sent["return_token_ids"] is True
    assert sent["logprobs"] == 0
    assert sent["max_tokens"] == 8
    assert sent["temperature"] == 1.0
    assert sent["top_p"] == 1.0
    assert hooks.opened == 1


def test_a_request_that_needs_nothing_goes_as_its_own_bytes() -> None:
    app, hooks = StandIn(), Hooks()
    policy = dict(training_policy(config()).values)
    fields = {k: v for k, v in policy.items() if v is not None}
    raw = json.dumps(
        {"prompt": "hi", **fields, "return_token_ids": True, "logprobs": 0, "max_tokens": 8},
        indent=1,
    ).encode()
    status, headers, _ = asyncio.run(call(layer(app, hooks), "/v1/completions", raw))
    assert status == 200
    assert headers[VERSIONS_HEADER] == "0"
    assert app.bodies == [raw]
    assert hooks.opened == 1


@pytest.mark.parametrize(
    ("extra", "changed"),
    [
        ({"return_token_ids": False}, {"return_token_ids": True}),
        ({"logprobs": None}, {"logprobs": 0}),
        ({"max_tokens": 31}, {"max_tokens": 30}),  # clamped to the context
        ({"max_tokens": None}, {"max_tokens": 8}),
        ({"min_p": None}, {"min_p": 0.0}),
    ],
)
def test_a_request_the_layer_completes_is_sent_as_completed(
    extra: dict[str, Any], changed: dict[str, Any]
) -> None:
    app, hooks = StandIn(), Hooks()
    policy = dict(training_policy(config()).values)
    fields = {k: v for k, v in policy.items() if v is not None}
    body = {"prompt": "hi", **fields, "return_token_ids": True, "logprobs": 0, "max_tokens": 8}
    status, _, _ = asyncio.run(
        call(layer(app, hooks), "/v1/completions", json.dumps({**body, **extra}).encode())
    )
    assert status == 200
    assert json.loads(app.bodies[0]) == {**body, **changed}


@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(-2, 40), st.booleans(), st.just(4.0)),
            st.integers(0, 40),
        ),
        max_size=12,
    )
)
def test_the_memoized_budget_is_the_core_budget(cases: list[tuple[object, int]]) -> None:
    asgi = layer(StandIn(), Hooks())
    for requested, length in cases + cases:
        expected = http_max_tokens(
            requested,
            length,
            max_new_tokens=8,
            max_model_len=32,
            cap_to_context=True,
            num_speculative_tokens=0,
        )
        assert asgi.rules.budget(requested, length) == expected


class Listener(StandIn):
    """Reads the body, then listens for the client's disconnect as vLLM's routes do
    (``with_cancellation``), then answers."""

    def __init__(self) -> None:
        super().__init__()
        self.after_body: list[Any] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.bodies.append((await receive())["body"])
        self.after_body.append(await receive())
        await self._json(send, 200, {"ok": True})


@pytest.mark.parametrize("body", [b'{"prompt": "hi"}', b"{oops"])
def test_the_clients_disconnect_reaches_the_app(body: bytes) -> None:
    app, hooks = Listener(), Hooks()
    messages = iter(
        [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]
    )

    async def receive() -> Any:
        return next(messages)

    async def send(message: Any) -> None:
        pass

    scope: dict[str, object] = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [],
    }
    asyncio.run(asyncio.wait_for(layer(app, hooks)(scope, receive, send), 10))
    assert app.after_body == [{"type": "http.disconnect"}]
    assert len(app.bodies) == 1


def test_malformed_json_goes_to_the_app_untouched() -> None:
    app, hooks = StandIn(), Hooks()
    asyncio.run(call(layer(app, hooks), "/v1/completions", b"{oops"))
    assert app.bodies == [b"{oops"]
    assert hooks.opened == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": 0.2}, "temperature"),
        ({"prompt": "x" * 32}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": 5}, "prompt"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_refusals_name_the_parameter(body: dict[str, Any], param: str) -> None:
    app, hooks = StandIn(), Hooks()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, _, out = asyncio.run(call(layer(app, hooks), path, json.dumps(body).encode()))
    assert status == 400
    assert json.loads(out)["error"]["param"] == param
    assert app.bodies == []


def test_a_refused_stream_is_503() -> None:
    app, hooks = StandIn(), Hooks()
    hooks.refuse = True
    status, _, out = asyncio.run(call(layer(app, hooks), "/v1/completions", b'{"prompt": "x"}'))
    assert status == 503
    assert "refit again" in json.loads(out)["error"]["message"]


def test_every_streamed_event_is_tagged_across_chunk_boundaries() -> None:
    app, hooks = StandIn(), Hooks()
    events = [b'data: {"n": %d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]
    whole = b"".join(events)
    app.events = [whole[:5], whole[5:17], whole[17:40], whole[40:]]
    status, headers, out = asyncio.run(
        call(layer(app, hooks), "/v1/completions", b'{"prompt": "x", "stream": true}')
    )
    assert status == 200
    assert headers[VERSIONS_HEADER] == "0"
    lines = [e for e in out.decode().split("\n\n") if e]
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(e.removeprefix("data: ")) for e in lines[:-1]] == [
        {"weight_versions": [0], "n": i} for i in range(3)
    ]


@given(st.text(min_size=0, max_size=40), st.integers(min_value=1, max_value=200))
def test_a_streamed_text_that_contains_data_brace_still_parses(text: str, cut: int) -> None:
    """Issue 48: the versions were spliced in by a byte replace over the whole event, so
    a completion whose text contains ``data: {`` became invalid JSON."""
    app, hooks = StandIn(), Hooks()
    hooks.weight_version = 2
    texts = [f"x data: {{{text}", 'data: {"a": 1}', text]
    events = [b"data: " + json.dumps({"choices": [{"text": t}]}).encode() + b"\n\n" for t in texts]
    whole = b"".join(events) + b"data: [DONE]\n\n"
    cut = min(cut, len(whole) - 1)
    app.events = [whole[:cut], whole[cut:]]
    status, _, out = asyncio.run(
        call(layer(app, hooks), "/v1/completions", b'{"prompt": "x", "stream": true}')
    )
    assert status == 200
    lines = [e for e in out.decode().split("\n\n") if e]
    assert lines[-1] == "data: [DONE]"
    got = [json.loads(e.removeprefix("data: ")) for e in lines[:-1]]
    assert got == [{"weight_versions": [2], "choices": [{"text": t}]} for t in texts]


def test_chat_turns_are_spliced_and_the_ids_stripped() -> None:
    app, hooks = StandIn(), Hooks()
    # the stand-in tokenizes one id per character and decodes id i as chr(97 + i)
    body = {
        "messages": [
            {"role": "user", "content": "ab"},
            {
                "role": "assistant",
                "content": "c",
                "prompt_token_ids": [0, 1],
                "generation_token_ids": [2],
            },
            {"role": "user", "content": "d"},
        ]
    }
    status, _, _ = asyncio.run(
        call(layer(app, hooks), "/v1/chat/completions", json.dumps(body).encode())
    )
    assert status == 200
    sent = json.loads(app.bodies[0])
    assert sent["kv_transfer_params"]["prompt_token_ids"] == [0, 1, 2, 3]
    assert all("prompt_token_ids" not in m for m in sent["messages"])
    assert sent["logprobs"] is True
    assert sent["max_tokens"] == 8


def test_abort_all_answers_500_with_the_reason() -> None:
    app, hooks = StandIn(), Hooks()
    app.hold = asyncio.Event()
    asgi = layer(app, hooks)

    async def body() -> tuple[int, dict[str, str], bytes]:
        request = asyncio.ensure_future(call(asgi, "/v1/completions", b'{"prompt": "x"}'))
        while not app.bodies:
            await asyncio.sleep(0)
        assert asgi.abort_all("the refit failed") == 1
        return await request

    status, _, out = asyncio.run(body())
    assert status == 500
    assert json.loads(out)["error"]["message"] == "the refit failed"


# --- hostile requests (issue 44): a 4xx naming the field, and the server still serves ------

GOOD_COMPLETION = b'{"prompt": "still here", "max_tokens": 2}'
GOOD_CHAT = json.dumps(
    {
        "messages": [
            {"role": "user", "content": "ab"},
            {
                "role": "assistant",
                "content": "c",
                "prompt_token_ids": [0, 1],
                "generation_token_ids": [2],
            },
            {"role": "user", "content": "d"},
        ],
        "required_prefix_token_ids": [0, 1, 2],
    }
).encode()
MAX_CHARS = 32 * 32  # CHARS_PER_TOKEN_AT_MOST per token of max_model_len 32


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"messages": list(messages), **fields}


def turn(**ids: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "c", **ids}


HOSTILE: list[tuple[str, str, bytes, int, str | None, str]] = [
    # (name, path, body, status, param, message starts with)
    (
        "nested 100k deep",
        "/v1/completions",
        b"[" * 100_000 + b"]" * 100_000,
        400,
        None,
        "the request body nests deeper than 128",
    ),
    (
        "nested objects 100k deep",
        "/v1/chat/completions",
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        400,
        None,
        "the request body nests deeper",
    ),
    (
        "nested past the limit inside a field",
        "/v1/completions",
        b'{"prompt": "x", "logit_bias": ' + b"[" * 129 + b"]" * 129 + b"}",
        400,
        None,
        "the request body nests deeper",
    ),
    (
        "empty prompt ids",
        "/v1/completions",
        b'{"prompt": []}',
        400,
        "prompt",
        "prompt must not be empty",
    ),
    (
        "empty prompt text",
        "/v1/completions",
        b'{"prompt": ""}',
        400,
        "prompt",
        "prompt must not be empty",
    ),
    (
        "an empty prompt in a batch",
        "/v1/completions",
        b'{"prompt": [[1], []]}',
        400,
        "prompt",
        "prompt[1] must not be empty",
    ),
    (
        "bools as ids",
        "/v1/completions",
        b'{"prompt": [true, false]}',
        400,
        "prompt",
        "prompt[0]: true is not a token id",
    ),
    (
        "a bool in a batch of ids",
        "/v1/completions",
        b'{"prompt": [[1, 2], [3, false]]}',
        400,
        "prompt",
        "prompt[1][1]: false is not a token id",
    ),
    (
        "an id past 64 bits",
        "/v1/completions",
        b'{"prompt": [1, 9223372036854775808]}',
        400,
        "prompt",
        "prompt[1]: token id 9223372036854775808 is outside the vocabulary [0, 50)",
    ),
    (
        "an id at the vocabulary size",
        "/v1/completions",
        b'{"prompt": [50]}',
        400,
        "prompt",
        "prompt[0]: token id 50 is outside the vocabulary",
    ),
    (
        "a negative id",
        "/v1/completions",
        b'{"prompt": [[-1]]}',
        400,
        "prompt",
        "prompt[0][0]: token id -1 is outside",
    ),
    (
        "a prefix id past 64 bits",
        "/v1/chat/completions",
        json.dumps(
            chat({"role": "user", "content": "ab"}, required_prefix_token_ids=[0, 2**63])
        ).encode(),
        400,
        "required_prefix_token_ids",
        f"required_prefix_token_ids[1]: token id {2**63} is outside",
    ),
    (
        "a prefix of bools",
        "/v1/chat/completions",
        json.dumps(
            chat({"role": "user", "content": "ab"}, required_prefix_token_ids=[True])
        ).encode(),
        400,
        "required_prefix_token_ids",
        "required_prefix_token_ids[0]: true is not a token id",
    ),
    (
        "a generation id past 64 bits",
        "/v1/chat/completions",
        json.dumps(
            chat(
                {"role": "user", "content": "ab"},
                turn(prompt_token_ids=[0, 1], generation_token_ids=[2**63]),
            )
        ).encode(),
        400,
        "messages",
        f"messages[1].generation_token_ids[0]: token id {2**63} is outside",
    ),
    (
        "a generation id of a bool",
        "/v1/chat/completions",
        json.dumps(
            chat(
                {"role": "user", "content": "ab"},
                turn(prompt_token_ids=[0, 1], generation_token_ids=[True]),
            )
        ).encode(),
        400,
        "messages",
        "messages[1].generation_token_ids[0]: true is not a token id",
    ),
    (
        "a prompt id past the vocabulary",
        "/v1/chat/completions",
        json.dumps(
            chat(
                {"role": "user", "content": "ab"},
                turn(prompt_token_ids=[0, 50], generation_token_ids=[2]),
            )
        ).encode(),
        400,
        "messages",
        "messages[1].prompt_token_ids[1]: token id 50 is outside",
    ),
    (
        "a text prompt past the character bound",
        "/v1/completions",
        json.dumps({"prompt": "x" * (MAX_CHARS + 1)}).encode(),
        400,
        "prompt",
        f"prompt has {MAX_CHARS + 1} characters, more than the {MAX_CHARS}",
    ),
    (
        "a 10 MB text prompt",
        "/v1/completions",
        json.dumps({"prompt": "x" * 10_000_000}).encode(),
        400,
        "prompt",
        "prompt has 10000000 characters",
    ),
    (
        "chat text past the character bound",
        "/v1/chat/completions",
        json.dumps(
            chat(
                {"role": "user", "content": "x" * MAX_CHARS},
                {"role": "user", "content": [{"type": "text", "text": "y"}]},
            )
        ).encode(),
        400,
        "messages",
        f"the text of messages[0..1] has {MAX_CHARS + 1} characters",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "says"),
    [case[1:] for case in HOSTILE],
    ids=[case[0] for case in HOSTILE],
)
def test_a_hostile_request_gets_a_4xx_naming_the_field_and_then_a_good_one_succeeds(
    path: str, body: bytes, status: int, param: str | None, says: str
) -> None:
    app, hooks = StandIn(), Hooks()
    asgi = layer(app, hooks)
    got, _, out = asyncio.run(call(asgi, path, body))
    assert got == status, out[:300]
    error = json.loads(out)["error"]
    assert error["param"] == param
    assert error["code"] == status
    assert error["message"].startswith(says), error["message"]
    assert app.bodies == []
    assert app.tokenized == []  # refused before anything was tokenized
    assert hooks.opened == 0
    for good_path, good in (
        ("/v1/completions", GOOD_COMPLETION),
        ("/v1/chat/completions", GOOD_CHAT),
    ):
        got, _, out = asyncio.run(call(asgi, good_path, good))
        assert got == 200, out
    assert json.loads(app.bodies[-1])["kv_transfer_params"]["prompt_token_ids"] == [0, 1, 2, 3]


def test_ids_at_the_edges_of_the_vocabulary_are_taken() -> None:
    app, hooks = StandIn(), Hooks()
    status, _, out = asyncio.run(
        call(layer(app, hooks), "/v1/completions", b'{"prompt": [0, 49], "max_tokens": 2}')
    )
    assert status == 200, out
    assert json.loads(app.bodies[0])["prompt"] == [0, 49]


def test_a_text_prompt_at_the_character_bound_is_tokenized_and_judged_by_its_tokens() -> None:
    app, hooks = StandIn(), Hooks()
    status, _, out = asyncio.run(
        call(layer(app, hooks), "/v1/completions", json.dumps({"prompt": "x" * MAX_CHARS}).encode())
    )
    assert status == 400  # tokenized (one token per character here): no room in the context
    assert json.loads(out)["error"]["param"] == "prompt"
    assert [len(p["prompt"]) for p in app.tokenized] == [MAX_CHARS]


def test_a_deep_body_to_another_route_is_refused_before_vllm_parses_it() -> None:
    app, hooks = StandIn(), Hooks()
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, _, out = asyncio.run(call(layer(app, hooks), "/tokenize", deep))
    assert status == 400
    assert json.loads(out)["error"]["message"].startswith("the request body nests deeper")
    assert app.tokenized == []
    status, _, _ = asyncio.run(call(layer(app, hooks), "/tokenize", b'{"prompt": "[[["}'))
    assert status == 200
    assert app.tokenized == [{"prompt": "[[["}]


async def exchange(
    asgi: RolloutLayer,
    path: str,
    messages: list[dict[str, Any]],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> list[Any]:
    """``messages`` as the request's receive, then a client that sends nothing more."""
    pending = list(messages)
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        await asyncio.Event().wait()
        raise AssertionError

    async def send(message: Any) -> None:
        sent.append(message)

    scope: dict[str, object] = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": headers or [],
    }
    await asyncio.wait_for(asgi(scope, receive, send), 10)
    return sent


def answer(sent: list[Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    start, body = sent
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, json.loads(body["body"])["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_stalled_body_gets_408_and_the_connection_closed_within_the_bound(path: str) -> None:
    app, hooks = StandIn(), Hooks()
    asgi = layer(app, hooks, body_timeout_s=0.3)
    started = time.perf_counter()
    sent = asyncio.run(
        exchange(asgi, path, [{"type": "http.request", "body": b'{"pro', "more_body": True}])
    )
    status, headers, error = answer(sent)
    assert status == 408
    assert headers["connection"] == "close"
    assert "0.3 s" in error["message"]
    assert time.perf_counter() - started < 3.0
    assert app.bodies == app.tokenized == []
    assert asyncio.run(call(asgi, "/v1/completions", GOOD_COMPLETION))[0] == 200


def test_a_body_declared_past_the_limit_is_413_unread() -> None:
    app, hooks = StandIn(), Hooks()
    asgi = layer(app, hooks)
    limit = asgi.rules.limits.max_body_bytes
    sent = asyncio.run(
        exchange(asgi, "/v1/completions", [], [(b"content-length", str(limit + 1).encode())])
    )
    status, headers, error = answer(sent)
    assert status == 413
    assert headers["connection"] == "close"
    assert str(limit) in error["message"]
    assert asyncio.run(call(asgi, "/v1/completions", GOOD_COMPLETION))[0] == 200


def test_a_chunked_body_past_the_limit_is_413_once_it_passes() -> None:
    app, hooks = StandIn(), Hooks()
    asgi = layer(app, hooks)
    chunk = b" " * (1 << 20)
    chunks = asgi.rules.limits.max_body_bytes // len(chunk) + 1
    messages = [{"type": "http.request", "body": chunk, "more_body": True}] * (chunks + 5)
    sent = asyncio.run(exchange(asgi, "/v1/completions", messages))
    assert answer(sent)[0] == 413
    assert app.bodies == []


def test_a_client_gone_before_its_body_ends_gets_nothing() -> None:
    app, hooks = StandIn(), Hooks()
    sent = asyncio.run(
        exchange(
            layer(app, hooks),
            "/v1/completions",
            [
                {"type": "http.request", "body": b'{"prompt": "x"', "more_body": True},
                {"type": "http.disconnect"},
            ],
        )
    )
    assert sent == []
    assert app.bodies == []
    assert hooks.opened == 0


def test_a_stalled_client_on_a_real_socket_gets_408_or_a_closed_connection() -> None:
    """uvicorn in front of the layer (as vLLM's ``NoSignalServer``, which ``serve_on``
    runs, without importing vLLM: most of a minute here; the real server's case is
    ``test_server_engine``'s); a raw socket sends the headers and part of the body, then
    nothing."""
    import uvicorn

    class NoSignalServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    async def body() -> tuple[bytes, float, int]:
        app, hooks = StandIn(), Hooks()
        asgi = layer(app, hooks, body_timeout_s=0.5)
        sock = bind_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        config = uvicorn.Config(asgi, log_level="warning", access_log=False, lifespan="off")
        server = NoSignalServer(config)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 100\r\n\r\n" + b'{"prompt": '
            )
            await writer.drain()
            started = asyncio.get_running_loop().time()
            got = await asyncio.wait_for(reader.read(), 10)  # until the server closes
            waited = asyncio.get_running_loop().time() - started
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n"
                % len(GOOD_COMPLETION)
                + GOOD_COMPLETION
            )
            good = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return got, waited, int(good.split(b" ", 2)[1])
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)
            sock.close()

    got, waited, good = asyncio.run(body())
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert 0.4 < waited < 3.0, waited
    assert good == 200


@pytest.mark.parametrize("value", ["1", " 1", "true"])
def test_vllm_dev_mode_refuses_to_start_naming_the_variable(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48: with VLLM_SERVER_DEV_MODE vLLM's app builder adds its own pause, sleep
    and weight routes behind genworker's back; the server refuses before it binds."""
    monkeypatch.setenv(DEV_MODE_VARIABLE, value)
    with pytest.raises(BadConfigError, match=DEV_MODE_VARIABLE):
        OpenAIServer(ServerOptions(port=0))
    with pytest.raises(BadConfigError, match=DEV_MODE_VARIABLE):
        asyncio.run(build_vllm_app(object()))


def test_vllm_dev_mode_read_by_vllm_is_refused_too() -> None:
    with pytest.raises(BadConfigError, match="VLLM_SERVER_DEV_MODE"):
        refuse_dev_mode({}, dev_mode=True)
    refuse_dev_mode({DEV_MODE_VARIABLE: "0"})  # off: serves


# vLLM's answer when its engine captures: every choice carries its routes (base64 .npy)
ROUTED = {
    "id": "cmpl-1",
    "choices": [
        {"index": 0, "text": "ab", "token_ids": [1, 2], "routed_experts": "k05VTVBZ"},
        {"index": 1, "text": "c", "token_ids": [3], "routed_experts": None},
    ],
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_routed_experts_come_back_only_to_a_request_that_asks_for_them(path: str) -> None:
    app, hooks = StandIn(), Hooks()
    app.response = ROUTED
    asgi = layer(app, hooks, captures_routes=True)
    prompt: dict[str, object] = (
        {"prompt": "hi"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    status, headers, body = asyncio.run(call(asgi, path, json.dumps(prompt).encode()))
    assert status == 200
    assert int(headers["content-length"]) == len(body)
    assert headers[VERSIONS_HEADER] == "0"
    dropped = json.loads(body)
    assert [c.get("routed_experts", "gone") for c in dropped["choices"]] == ["gone", "gone"]
    assert [c["token_ids"] for c in dropped["choices"]] == [[1, 2], [3]]
    asked = json.dumps({**prompt, "return_routed_experts": True}).encode()
    status, headers, body = asyncio.run(call(asgi, path, asked))
    assert status == 200
    assert json.loads(body) == ROUTED
    assert int(headers["content-length"]) == len(body)
    assert "return_routed_experts" not in json.loads(app.bodies[-1])  # genworker's field
    # an engine that does not capture: vLLM's bytes as they come
    app.response = {"choices": [{"index": 0, "text": "x"}]}
    _, _, body = asyncio.run(call(layer(app, hooks), path, json.dumps(prompt).encode()))
    assert body == json.dumps(app.response).encode()


@pytest.mark.parametrize(
    ("captures", "extra", "named"),
    [
        (False, {"return_routed_experts": True}, "does not capture"),
        (True, {"return_routed_experts": "yes"}, "true or false"),
        (True, {"return_routed_experts": True, "stream": True}, "non-streamed"),
    ],
)
def test_asking_for_routed_experts_where_none_come_is_refused_by_name(
    captures: bool, extra: dict[str, object], named: str
) -> None:
    app, hooks = StandIn(), Hooks()
    raw = json.dumps({"prompt": "hi", **extra}).encode()
    status, _, body = asyncio.run(
        call(layer(app, hooks, captures_routes=captures), "/v1/completions", raw)
    )
    error = json.loads(body)["error"]
    assert (status, error["param"]) == (400, "return_routed_experts")
    assert named in error["message"]
    assert app.bodies == []  # nothing ran
    assert hooks.opened == 0


def test_a_json_response_is_not_held_back_by_nagle() -> None:
    """The listening socket says TCP, so asyncio sets TCP_NODELAY on each connection: a
    response written as headers then body (every JSON answer) went out 40 ms late, after
    the client's delayed ACK, when the socket was made with protocol 0."""
    import httpx

    from genworker.shell.server import bind_socket, serve_on, stop_serving

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})

    async def body() -> float:
        sock = bind_socket("127.0.0.1", 0)
        assert sock.proto == socket.IPPROTO_TCP
        server, task = await serve_on(app, sock)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            async with httpx.AsyncClient(base_url=url) as client:
                took = []
                for _ in range(9):
                    started = time.perf_counter()
                    assert (await client.get("/")).status_code == 200
                    took.append(time.perf_counter() - started)
            return sorted(took)[4]
        finally:
            await stop_serving(server, task)
            sock.close()

    assert asyncio.run(body()) < 0.025  # with Nagle: 44 ms each, measured


@pytest.mark.parametrize("vllm_has_it", [True, False])
def test_the_server_leaves_the_process_signals_alone(
    vllm_has_it: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Served from the main thread, with vLLM's ``NoSignalServer`` or (vLLM 0.25 has none)
    uvicorn's own ``Server``: SIGINT and SIGTERM keep the handlers they had (uvicorn >= 0.29
    takes them in ``capture_signals``, not ``install_signal_handlers``)."""
    import signal

    import genworker.shell.server as server_module

    if not vllm_has_it:
        import vllm.entrypoints.launchers.launcher as launcher

        monkeypatch.delattr(launcher, "NoSignalServer")

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def handlers() -> list[object]:
        return [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]

    async def body() -> None:
        before, sock = handlers(), bind_socket("127.0.0.1", 0)  # asyncio.run's own SIGINT
        server, task = await server_module.serve_on(app, sock)
        try:
            await asyncio.sleep(0.05)
            assert handlers() == before
        finally:
            await server_module.stop_serving(server, task)
            sock.close()

    asyncio.run(body())
