"""The ASGI layer of ``genworker.shell.server`` in front of a stand-in ASGI app (no
engine): what it sends on, what it refuses, how it tags streamed events across chunk
boundaries, and how ``abort_all`` ends requests in flight. The real app is
``test_server_engine``'s."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from genworker.core.config import WorkerConfig
from genworker.core.serving import http_max_tokens, training_policy
from genworker.shell.errors import EngineStateError
from genworker.shell.server import VERSIONS_HEADER, RolloutLayer


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
        self.events: list[bytes] | None = None
        self.hold: asyncio.Event | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw = (await receive())["body"]
        if scope["path"] == "/tokenize":
            payload = json.loads(raw)
            text = payload.get("prompt") or "".join(m["content"] for m in payload["messages"])
            await self._json(send, 200, {"tokens": list(range(len(text)))})
            return
        self.bodies.append(raw)
        if self.hold is not None:
            await self.hold.wait()
        if self.events is None:
            await self._json(send, 200, {"ok": True})
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
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(obj).encode()})


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


def layer(app: StandIn, hooks: Hooks) -> RolloutLayer:
    def decode(ids: Sequence[int], skip_special: bool) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    return RolloutLayer(
        app,
        hooks,
        policy=training_policy(config()),
        max_new_tokens=8,
        max_model_len=32,
        cap_to_context=True,
        num_speculative_tokens=0,
        decode=decode,
        reuses_prompt_ids=True,
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

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
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
        assert asgi._budget(requested, length) == expected


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

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
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
