"""vLLM's own OpenAI server around the async worker's ``AsyncLLM``, behind a thin ASGI layer
for what RL rollouts need: exact token ids, logprobs, weight versions, the on-policy
guard, the context budget and multi-turn prefix ids.

Theory of operation
-------------------
- **vLLM serves every route.** The app is vLLM's ``build_app`` + ``init_app_state`` around
  the worker's engine client (``vllm.entrypoints.launchers`` in 0.32, re-exported by
  ``vllm.entrypoints.openai.api_server``, where 0.25 has them), run by a uvicorn server
  that never installs signal handlers (vLLM's ``NoSignalServer`` where present) on the
  worker's event loop. Capabilities are found by looking (module paths, signatures).
- **The socket is bound first** (:class:`OpenAIServer`'s constructor, before the engine
  loads), and uvicorn serves on that socket: nothing can take the port in between (the
  port race of NeMo-RL #2380), and a connection made before the app is up waits in the
  listen backlog. Port 0 binds a free port; ``base_url`` reports the real one.
- **Every body is read by the layer first**, within :data:`BODY_READ_TIMEOUT_S` (a
  client that stalls gets 408 and the connection closed) and the byte limit of
  ``core.serving.http_limits`` (413, from a ``content-length`` past it before reading
  anything); a JSON body nested past ``core.serving.MAX_JSON_DEPTH`` gets 400 on every
  route (Python's ``json`` recurses: the stock server answers 500). Refusals are
  OpenAI-style error bodies naming the field (``core.serving.BadRequest``).
- **The layer** (:class:`RolloutLayer`, pure ASGI, no handler of its own) otherwise
  touches only ``POST /v1/completions`` and ``POST /v1/chat/completions`` with a JSON
  object body; anything else (malformed JSON included) goes to vLLM as it came and gets
  vLLM's answer. For those two it: checks the prompt (``core.serving``: never empty; ids
  are ints, never bools, inside the vocabulary, checked before anything decodes them;
  a text longer than the character bound is refused before it is tokenized); refuses
  off-policy sampling parameters (``core.serving``, when the guard is on) and fills the
  training values in; asks vLLM for ``return_token_ids`` and
  the sampled tokens' logprobs; tokenizes the prompt through vLLM's own ``/tokenize``
  route (an in-process ASGI call, same renderer, same chat template) to apply the
  context budget of ``core.serving.http_max_tokens`` (a completion prompt whose byte
  length bounds its tokens well inside the budget, ``core.serving.prompt_tokens_at_most``,
  is not tokenized: the common case costs nothing); for chat with earlier turns' ids,
  checks and splices the prefix (``core.serving.check_turns`` / ``splice_prefix``) and
  hands the final ids to vLLM as ``kv_transfer_params.prompt_token_ids``, which vLLM's
  renderer feeds to the engine verbatim instead of re-rendering the messages
  (``renderers/online_renderer.py`` ``_reused_prompt_token_ids``, 0.32; where it is
  absent such a request gets 501). Refusals are OpenAI-style error bodies (400 naming
  the parameter or the message). A request the layer finds complete (every training
  value, ids, logprobs and a ``max_tokens`` within budget already there) goes to vLLM as
  its own bytes; one it completes is re-serialised. The budget of a (``max_tokens``,
  prompt length) pair is memoized (``http_max_tokens`` is pure).
- **Routed experts**: where the engine captures them, vLLM adds every choice's routes
  to a non-streamed response; the layer passes them to a request that asks
  (``return_routed_experts``, removed before vLLM sees the body) and drops them otherwise
  (``core.serving.check_routes_request`` / ``drop_routes``).
- **Weight versions**: each request runs inside ``AsyncVllmGenerationWorker.in_flight()``
  (a stream for the lifecycle: sleep and prefix-cache resets wait, in-flight refits pause
  and resume it like the worker's own rows; a refit that fails ends them: 500 naming the
  failure, or the stream ends). Non-streaming responses carry the header
  ``x-genworker-weight-versions`` (comma-separated: every version from the request's
  arrival to its response, ``core.serving.versions_between``); every streamed event
  carries the same as a ``weight_versions`` list field (up to that event), and the
  header has the versions up to the stream's start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import inspect
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Protocol, SupportsInt, TypeVar, runtime_checkable

import attrs
from returns.result import Failure, Result

from genworker.core.caps import CapFailure
from genworker.core.control_plane import ROUTES as CONTROL_ROUTES
from genworker.core.serving import (
    DEV_MODE_VARIABLE,
    ROUTES_FIELD,
    TURN_FIELDS,
    BadRequest,
    BudgetError,
    HttpLimits,
    OffPolicy,
    SamplingPolicy,
    ServerOptions,
    chat_reference,
    check_body_length,
    check_chat_text,
    check_completion_prompt,
    check_dev_mode,
    check_nesting,
    check_routes_request,
    check_template_stable,
    drop_routes,
    error_body,
    http_limits,
    http_max_tokens,
    parse_body,
    prompt_tokens_at_most,
    request_budget,
    rollout_fills,
    splice_prefix,
    split_events,
    tag_events,
    template_source,
    tokenize_answer,
    versions_between,
    vllm_server_argv,
)
from genworker.shell.control import ControlHooks, ControlRoutes
from genworker.shell.errors import BadConfigError, EngineStateError, GenworkerError, unwrap

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI
    from vllm.config.model import ModelConfig
    from vllm.lora.request import LoRARequest

__all__ = [
    "BODY_READ_TIMEOUT_S",
    "DEV_MODE_VARIABLE",
    "VERSIONS_HEADER",
    "OpenAIServer",
    "RolloutHooks",
    "RolloutLayer",
    "bind_socket",
    "build_vllm_app",
    "chat_takes_prompt_ids",
    "refuse_dev_mode",
    "serve_on",
    "stop_serving",
    "tag_events",
]

log = logging.getLogger(__name__)

VERSIONS_HEADER = "x-genworker-weight-versions"
#: Seconds a request's whole body may take to arrive (then 408, connection closed). A
#: constant, not a config key: rollout clients are on the cluster's network, where the
#: largest body the limits allow (``core.serving.http_limits``) takes well under a second.
BODY_READ_TIMEOUT_S = 60.0
_VERSIONS_KEY = VERSIONS_HEADER.encode()
_GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_TOKENIZE_FIELDS = ("model", "add_special_tokens")
_TOKENIZE_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "add_special_tokens",
    "model",
)

# ASGI's shapes as Starlette names them (starlette/types.py). Values are read through
# :func:`_field` / :func:`_headers`, typed as the ASGI spec types them. The scope is
# mutable: the app writes its own (``app``, ``state``, ``router``) into the very dict the
# server made.
Scope = MutableMapping[str, object]
Message = MutableMapping[str, object]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
_Budget = Result[int, BudgetError | CapFailure]

_T = TypeVar("_T")
#: budgets of (``max_tokens``, prompt length, the server's settings), least recently used
#: dropped past 4096
_memo_max_tokens = functools.lru_cache(maxsize=4096)(http_max_tokens)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port), ready for uvicorn. Made
    with ``IPPROTO_TCP`` named: asyncio sets ``TCP_NODELAY`` on an accepted connection only
    when its protocol says TCP (``base_events._set_nodelay``); with the default 0, every
    response written as headers then body waited out the client's delayed ACK (44 ms per
    JSON response measured here, /health's empty body 2 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise BadConfigError(
            f"the HTTP server cannot listen on {host}:{port} "
            f"(vllm_cfg.http_server_host / http_server_port): {e}"
        ) from e
    return sock


class RolloutHooks(Protocol):
    """What the layer needs from the worker."""

    @property
    def weight_version(self) -> int: ...

    def in_flight(self) -> contextlib.AbstractAsyncContextManager[object]: ...


class _Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def _error_body(status: int, message: str, param: str | None) -> bytes:
    return json.dumps(error_body(status, message, param)).encode()


def _refused(problem: BadRequest) -> _Refused:
    return _Refused(problem.status, problem.message, problem.param)


@attrs.define(kw_only=True, eq=False)
class RolloutLayer:
    """The ASGI layer in front of vLLM's app (see the module docstring)."""

    app: ASGIApp = attrs.field(kw_only=False)
    hooks: RolloutHooks = attrs.field(kw_only=False)
    policy: SamplingPolicy | None
    max_new_tokens: int
    max_model_len: int
    cap_to_context: bool
    num_speculative_tokens: int
    decode: Callable[[Sequence[int], bool], str]
    reuses_prompt_ids: bool
    vocab_size: int
    body_timeout_s: float = BODY_READ_TIMEOUT_S
    chat_template: str | None = None
    captures_routes: bool = False
    control: ControlRoutes | None = None
    limits: HttpLimits = attrs.field(init=False)
    _running: set[asyncio.Task[object]] = attrs.field(init=False, factory=set)
    _aborted: dict[asyncio.Task[object], str] = attrs.field(init=False, factory=dict)

    @limits.default
    def _limits(self) -> HttpLimits:
        return http_limits(self.max_model_len, self.vocab_size)

    def abort_all(self, reason: str) -> int:
        """End every generation request in flight (vLLM aborts it: ``AsyncLLM.generate``
        on cancellation); each answers 500 with ``reason``, or its stream ends there."""
        for task in self._running:
            self._aborted.setdefault(task, reason)
            task.cancel()
        return len(self._running)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = await self._read_body(scope, receive, send)
        if raw is None:  # answered, or the client is gone
            return
        if scope.get("method") != "POST" or scope.get("path") not in _GENERATE_PATHS:
            nested = check_nesting(raw, self.limits)  # vLLM's json.loads recurses
            if isinstance(nested, Failure):
                await _refuse(send, nested.failure())
                return
            route = CONTROL_ROUTES.get(
                (_field(scope, "method", str, ""), _field(scope, "path", str, ""))
            )
            if self.control is not None and route is not None:
                status, answer = await self.control.handle(route, _query(scope), raw)
                await _respond(send, status, json.dumps(answer).encode())
                return
            await self.app(scope, _replay(raw, receive), send)
            return
        parsed = parse_body(raw, self.limits)
        if isinstance(parsed, Failure):
            problem = parsed.failure()
            if isinstance(problem, BadRequest):
                await _refuse(send, problem)
                return
        body = parsed.value_or(None)
        if not isinstance(body, dict):  # vLLM answers malformed requests itself
            await self.app(scope, _replay(raw, receive), send)
            return
        chat = scope["path"] == "/v1/chat/completions"
        try:
            if self.control is not None and (held := self.control.refuses_generation()):
                raise _refused(held)
            routes = check_routes_request(body, captures=self.captures_routes)
            if isinstance(routes, Failure):
                raise _refused(routes.failure())
            asked = body.pop(ROUTES_FIELD, None) is not None  # genworker's, not vLLM's
            if await self._prepare(scope, body, chat) or asked:
                raw = json.dumps(body).encode()
            strip = self.captures_routes and not routes.unwrap()
            async with self.hooks.in_flight():
                await self._generate(scope, raw, receive, send, strip_routes=strip)
        except _Refused as e:
            await _respond(send, e.status, _error_body(e.status, str(e), e.param))
        except EngineStateError as e:
            await _respond(send, 503, _error_body(503, str(e), None))

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The request's body, read within the byte limit and :attr:`body_timeout_s`;
        ``None`` once the client got its 413 or 408 (the connection closed after it) or
        went away."""
        declared = _content_length(scope)
        if declared is not None:
            checked = check_body_length(declared, self.limits)
            if isinstance(checked, Failure):
                await _refuse(send, checked.failure())
                return None
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = _field(message, "body", bytes, b"")
                    size += len(chunk)
                    checked = check_body_length(size, self.limits)
                    if isinstance(checked, Failure):
                        await _refuse(send, checked.failure())
                        return None
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            await _refuse(
                send,
                BadRequest(
                    f"the request body did not arrive within {self.body_timeout_s:g} s "
                    f"({size} bytes came)",
                    status=408,
                    param=None,
                ),
            )
            return None

    async def _generate(
        self, scope: Scope, raw: bytes, receive: Receive, send: Send, *, strip_routes: bool
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            reason = self._aborted.get(task)
            if reason is not None:  # vLLM answered the cancellation itself: ours instead
                if not started:
                    started = True
                    await _respond(send, 500, _error_body(500, reason, None))
                return
            started = started or message["type"] == "http.response.start"
            await forward(message)

        forward = self._sender(send, self.hooks.weight_version, strip_routes)
        self._running.add(task)
        try:
            await self.app(scope, _replay(raw, receive), tracked)
            if task in self._aborted:  # vLLM took the cancellation as a disconnect
                task.uncancel()
        except asyncio.CancelledError:
            reason = self._aborted.get(task)
            if reason is None:
                raise
            task.uncancel()
            if not started:
                await _respond(send, 500, _error_body(500, reason, None))
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._running.discard(task)
            self._aborted.pop(task, None)

    # -- the request -------------------------------------------------------------------
    async def _prepare(self, scope: Scope, body: dict[str, object], chat: bool) -> bool:
        """Checks and completes ``body`` in place; whether it changed (else the request's
        own bytes go to vLLM as they came)."""
        fills = rollout_fills(body, self.policy, chat=chat)
        if isinstance(fills, Failure):
            problem: OffPolicy = fills.failure()
            raise _Refused(400, str(problem), problem.parameter)
        body.update(fills.unwrap())
        # chat requests lose their turns' ids, may gain prompt ids
        changed = chat or bool(fills.unwrap())
        if chat:
            lengths = [await self._chat_prompt(scope, body)]
        else:
            lengths = await self._completion_lengths(scope, body)
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        requested = body.get(key)
        prompt = "messages" if chat else "prompt"
        budget = request_budget(requested, lengths, self._budget, key=key, prompt_param=prompt)
        if isinstance(budget, Failure):
            raise _refused(budget.failure())
        if type(requested) is not int or requested != budget.unwrap():
            body[key] = budget.unwrap()
            changed = True
        return changed

    def _budget(self, requested: object, prompt_length: int) -> _Budget:
        """``core.serving.http_max_tokens`` for this server, memoized for the usual
        ``max_tokens`` (an int or left out): it is pure, and the fast path asks it twice."""
        usual = requested is None or type(requested) is int  # never a bool: True == 1
        return (_memo_max_tokens if usual else http_max_tokens)(
            requested,
            prompt_length,
            max_new_tokens=self.max_new_tokens,
            max_model_len=self.max_model_len,
            cap_to_context=self.cap_to_context,
            num_speculative_tokens=self.num_speculative_tokens,
        )

    def _fits_untokenized(self, requested: object, prompt: str) -> int | None:
        """The prompt-length bound when ``requested`` fits with it unchanged
        (``core.serving.prompt_tokens_at_most``), else None: tokenize."""
        bound = prompt_tokens_at_most(len(prompt.encode()))
        wanted = self.max_new_tokens if requested is None else requested
        budget = self._budget(requested, bound)
        if isinstance(budget, Failure) or budget.unwrap() != wanted:
            return None
        return bound

    async def _tokenize(self, scope: Scope, payload: Mapping[str, object]) -> list[int]:
        tokens = tokenize_answer(*await _call_json(self.app, scope, "/tokenize", payload))
        if isinstance(tokens, Failure):
            raise _refused(tokens.failure())
        return tokens.unwrap()

    async def _completion_lengths(self, scope: Scope, body: Mapping[str, object]) -> list[int]:
        checked = check_completion_prompt(body.get("prompt"), self.limits)
        if isinstance(checked, Failure):
            raise _refused(checked.failure())
        lengths = []
        for p in checked.unwrap():
            if isinstance(p, tuple):
                lengths.append(len(p))
            else:
                bound = self._fits_untokenized(body.get("max_tokens"), p)
                if bound is not None:
                    lengths.append(bound)
                    continue
                payload = {k: body[k] for k in _TOKENIZE_FIELDS if k in body} | {"prompt": p}
                lengths.append(len(await self._tokenize(scope, payload)))
        return lengths

    async def _chat_prompt(self, scope: Scope, body: dict[str, object]) -> int:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise _Refused(400, "messages must be a list of objects", "messages")
        text = check_chat_text(messages, self.limits)
        if isinstance(text, Failure):
            raise _refused(text.failure())
        required = body.pop("required_prefix_token_ids", None)
        read = chat_reference(messages, required, self.vocab_size, lambda i: self.decode(i, True))
        if isinstance(read, Failure):
            raise _refused(read.failure())
        reference, message = read.unwrap().ids, read.unwrap().message
        for m in messages:  # genworker's, not vLLM's
            for field in TURN_FIELDS:
                m.pop(field, None)
        payload = {k: body[k] for k in _TOKENIZE_CHAT_FIELDS if k in body}
        payload["messages"] = messages
        template = await self._tokenize(scope, payload)
        if not reference:
            return len(template)
        if not self.reuses_prompt_ids:
            raise _Refused(
                501,
                "this vLLM cannot take a chat prompt as token ids "
                "(no kv_transfer_params.prompt_token_ids reuse); send the ids to /v1/completions",
                "messages",
            )
        spliced = splice_prefix(
            reference, template, lambda ids: self.decode(ids, False), message=message
        )
        if isinstance(spliced, Failure):
            await self._check_template(scope, payload, messages, template, message)
            raise _Refused(400, str(spliced.failure()), "messages")
        ids = list(spliced.unwrap())
        kv = body.get("kv_transfer_params")
        body["kv_transfer_params"] = {
            **(kv if isinstance(kv, dict) else {}),
            "prompt_token_ids": ids,
        }
        return len(ids)

    async def _check_template(
        self,
        scope: Scope,
        payload: Mapping[str, object],
        messages: Sequence[object],
        whole: Sequence[int],
        message: int,
    ) -> None:
        """Refuses naming the chat template when it is what broke the prefix
        (``core.serving.check_template_stable``); returns when the history is to blame.
        ``messages``: the payload's own."""
        alone = {
            **payload,
            "messages": messages[: message + 1],
            "add_generation_prompt": False,
            "continue_final_message": False,
        }
        checked = check_template_stable(
            await self._tokenize(scope, alone),
            whole,
            lambda ids: self.decode(ids, False),
            message=message,
            template=template_source(payload, self.chat_template),
        )
        if isinstance(checked, Failure):
            raise _Refused(400, str(checked.failure()), "messages")

    # -- the response ------------------------------------------------------------------
    def _sender(self, send: Send, first: int, strip_routes: bool = False) -> Send:
        """``send`` with the versions added (a header; each streamed event's field) and,
        with ``strip_routes``, a non-streamed body without its choices' routed experts:
        its start is held until the body is whole (a JSON response's start and body come
        back to back, with no await between them here: no cancellation lands between)."""
        stream = False
        pending = b""
        held: Message | None = None

        def versions() -> list[int]:
            return list(versions_between(first, self.hooks.weight_version))

        async def wrapped(message: Message) -> None:
            nonlocal stream, pending, held
            if message["type"] == "http.response.start":
                headers = _headers(message)
                stream = any(
                    v.startswith(b"text/event-stream") and k.lower() == b"content-type"
                    for k, v in headers
                )
                headers.append((_VERSIONS_KEY, ",".join(map(str, versions())).encode()))
                message = {**message, "headers": headers}
                if strip_routes and not stream:
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                pending += _field(message, "body", bytes, b"")
                if message.get("more_body", False):
                    return
                body, pending = drop_routes(pending), b""
                length = (b"content-length", str(len(body)).encode())
                kept = [(k, v) for k, v in _headers(held) if k.lower() != b"content-length"]
                await send({**held, "headers": [*kept, length]})
                held = None
                message = {**message, "body": body}
            elif message["type"] == "http.response.body" and stream:
                buffer = pending + _field(message, "body", bytes, b"")
                events, pending = split_events(buffer, bool(message.get("more_body", False)))
                if events is None:
                    return
                message = {**message, "body": tag_events(events, versions())}
            await send(message)

        return wrapped


def _query(scope: Scope) -> dict[str, str]:
    """The request's query parameters (the last of a repeated name)."""
    from fastapi.datastructures import QueryParams

    return dict(QueryParams(_field(scope, "query_string", bytes, b"")))


def _content_length(scope: Scope) -> int | None:
    # A loop, not Starlette's Headers: this runs on every request, and building Headers
    # cost 1.2 us against 0.2 us (measured on this CPU; server_layer_cpu_us_per_request).
    for key, value in _headers(scope):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses it before the app runs
                return None
    return None


def _field(
    message: Mapping[str, object], key: str, kind: type[_T], default: _T | None = None
) -> _T:
    """An ASGI message's (or scope's) ``key``, of the type the ASGI spec gives it; ``default``
    when it is absent (without one: required)."""
    value = message[key] if default is None else message.get(key, default)
    if not isinstance(value, kind):
        raise TypeError(
            f"ASGI {message.get('type')!r}: {key} is a {type(value).__name__}, not {kind.__name__}"
        )
    return value


def _headers(message: Mapping[str, object]) -> list[tuple[bytes, bytes]]:
    """An ASGI message's (or scope's) headers: ``(name, value)`` byte strings."""
    raw = message.get("headers", ())
    if not isinstance(raw, Iterable):
        raise TypeError(f"ASGI {message.get('type')!r}: headers is a {type(raw).__name__}")
    headers = []
    for name, value in raw:
        if not (isinstance(name, bytes) and isinstance(value, bytes)):
            raise TypeError(f"ASGI {message.get('type')!r}: a header is not two byte strings")
        headers.append((name, value))
    return headers


def _replay(body: bytes, then: Receive | None = None) -> Receive:
    """``body`` as the request's one message; afterwards what ``then`` (the connection's
    own ``receive``, its body already read) answers: the client's disconnect, which vLLM
    listens for to abort the request (``with_cancellation``), as on the stock server.
    Without ``then`` (an in-process call) no disconnect ever comes."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if then is not None:
            return await then()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")  # pragma: no cover

    return receive


async def _respond(send: Send, status: int, body: bytes, *, close: bool = False) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:  # the body was not read to its end: this connection cannot carry another
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _refuse(send: Send, problem: BadRequest) -> None:
    body = _error_body(problem.status, problem.message, problem.param)
    await _respond(send, problem.status, body, close=problem.status in (408, 413))


async def _call_json(
    app: ASGIApp, scope: Scope, path: str, payload: Mapping[str, object]
) -> tuple[int, object]:
    """One in-process request to ``app`` (vLLM's own route), JSON in and out."""
    data = json.dumps(payload).encode()
    sub = {
        **scope,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ],
    }
    status = 500
    chunks: list[bytes] = []

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(_field(message, "status", int))
        elif message["type"] == "http.response.body":
            chunks.append(_field(message, "body", bytes, b""))

    await app(sub, _replay(data), send)
    try:
        return status, json.loads(b"".join(chunks))
    except ValueError:
        return status, b"".join(chunks).decode(errors="replace")


# --- vLLM's app, found by looking ------------------------------------------------------


# The pieces of vLLM's app, each where 0.32 has it, then where 0.25 has it.
_APP_PARTS = (
    ("build_app", ("vllm.entrypoints.launchers.app", "vllm.entrypoints.openai.api_server")),
    (
        "init_app_state",
        (
            "vllm.entrypoints.launchers.api_server.app_state",
            "vllm.entrypoints.openai.api_server",
        ),
    ),
    (
        "make_arg_parser",
        ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"),
    ),
    ("FlexibleArgumentParser", ("vllm.utils.argparse_utils", "vllm.utils")),
)


class _ServedModels(Protocol):
    """vLLM's ``OpenAIServingModels`` (``vllm/entrypoints/openai/models/serving.py``, 0.32),
    as far as the server writes it."""

    lora_requests: dict[str, LoRARequest]


@runtime_checkable
class _Tokenizer(Protocol):
    """vLLM's tokenizer (``TokenizerLike``, ``vllm/tokenizers/protocol.py``, 0.32), as far
    as the server reads it (``max_token_id`` where it has one)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def __len__(self) -> int: ...


def _first_attr(names: Sequence[tuple[str, str]]) -> Callable[..., object]:
    for module, attr in names:
        try:
            found: object = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            continue
        if callable(found):
            return found
    raise BadConfigError(
        f"the installed vLLM has none of {[f'{m}.{a}' for m, a in names]}: cannot build its "
        "OpenAI app"
    )


def _call_by_signature(fn: Callable[..., _T], /, **available: object) -> _T:
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in available.items() if k in params})


def _expect(value: object, kind: type[_T], what: str) -> _T:
    """``value``, found by looking in vLLM, when it is the ``kind`` read here."""
    if not isinstance(value, kind):
        raise BadConfigError(
            f"the installed vLLM's {what} is a {type(value).__name__}, not a {kind.__name__}"
        )
    return value


async def _awaited(value: object) -> object:
    """``await value`` (a coroutine function of vLLM's, found by looking)."""
    if not inspect.isawaitable(value):
        raise TypeError(f"object {type(value).__name__} can't be used in 'await' expression")
    return await value


def _model_config(llm: object) -> ModelConfig:
    from vllm.config.model import ModelConfig

    return _expect(getattr(llm, "model_config", None), ModelConfig, "engine client's model_config")


def chat_takes_prompt_ids() -> bool:
    """Whether the installed vLLM's chat route takes the prompt as token ids
    (``kv_transfer_params.prompt_token_ids``, ``vllm/renderers/online_renderer.py``)."""
    try:
        renderer = importlib.import_module("vllm.renderers.online_renderer")
    except ImportError:
        return False
    return callable(getattr(renderer, "_reused_prompt_token_ids", None))


async def _tokenizer(llm: object) -> _Tokenizer:
    tokenizer: object = getattr(llm, "tokenizer", None)
    if tokenizer is None or (callable(tokenizer) and not hasattr(tokenizer, "decode")):
        got: object = getattr(llm, "get_tokenizer")()  # noqa: B009 - llm: any engine client
        tokenizer = await got if inspect.isawaitable(got) else got
    if tokenizer is None:
        raise BadConfigError("the engine has no tokenizer (skip_tokenizer_init): no HTTP server")
    if not isinstance(tokenizer, _Tokenizer):
        raise BadConfigError(f"the engine's tokenizer {type(tokenizer).__name__} cannot decode")
    return tokenizer


def _vocab_size(model_config: ModelConfig, tokenizer: _Tokenizer) -> int:
    """The ids vLLM takes: the larger of the model's and the tokenizer's vocabulary
    (``BaseRenderer.validate_token_ids``, vLLM 0.32)."""
    top: object = getattr(tokenizer, "max_token_id", None)
    if top is not None and not isinstance(top, SupportsInt):
        raise BadConfigError(f"the engine's tokenizer has max_token_id {top!r}, not an int")
    tokenizer_size = len(tokenizer) if top is None else int(top) + 1
    return max(int(model_config.get_vocab_size()), tokenizer_size)


def refuse_dev_mode(environ: Mapping[str, str], dev_mode: bool = False) -> None:
    """Refuses to serve with vLLM's development routes on (``core.serving.check_dev_mode``);
    ``dev_mode`` is vLLM's own reading of it (``vllm.envs``, which may have been read
    before ``environ`` changed)."""
    unwrap(check_dev_mode(environ.get(DEV_MODE_VARIABLE, ""), dev_mode), BadConfigError, "")


async def build_vllm_app(llm: object, chat_template: str | None = None) -> FastAPI:
    """vLLM's own OpenAI app around the engine client ``llm`` (stock, no layer); refused
    with vLLM's development routes on (:func:`refuse_dev_mode`)."""
    import vllm.envs
    from fastapi import FastAPI

    refuse_dev_mode(os.environ)  # first: vLLM's reading raises on a value like "true"
    refuse_dev_mode(os.environ, bool(vllm.envs.VLLM_SERVER_DEV_MODE))
    build_app, init_app_state, make_arg_parser, parser_cls = (
        _first_attr([(module, name) for module in modules]) for name, modules in _APP_PARTS
    )
    model_config = _model_config(llm)
    argv = vllm_server_argv(
        str(model_config.model),
        int(model_config.max_model_len),
        model_config.served_model_name,
        chat_template,
    )
    parser = _expect(make_arg_parser(parser_cls()), argparse.ArgumentParser, "make_arg_parser")
    args = parser.parse_args(argv)
    tasks = None
    get_tasks = getattr(llm, "get_supported_tasks", None)
    if callable(get_tasks):
        tasks = await _awaited(get_tasks())
    app = _expect(
        _call_by_signature(build_app, args=args, supported_tasks=tasks, model_config=model_config),
        FastAPI,
        "build_app",
    )
    await _awaited(
        _call_by_signature(
            init_app_state,
            engine_client=llm,
            vllm_config=getattr(llm, "vllm_config", None),
            state=app.state,
            args=args,
            supported_tasks=tasks,
        )
    )
    return app


async def serve_on(
    app: Callable[..., Awaitable[None]], sock: socket.socket
) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """Serve the ASGI ``app`` on the bound ``sock`` from this loop with a uvicorn server
    that leaves the process's signals alone; returns once it accepts connections."""
    import uvicorn

    server_cls = _first_attr(
        [("vllm.entrypoints.launchers.launcher", "NoSignalServer"), ("uvicorn", "Server")]
    )
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = _expect(server_cls(config), uvicorn.Server, "HTTP server")
    if server_cls is uvicorn.Server:  # never take the process's signals (vLLM 0.25)
        setattr(server, "capture_signals", contextlib.nullcontext)  # noqa: B010 - uvicorn >= 0.29
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    async with asyncio.timeout(60):
        while not server.started:
            if task.done():
                task.result()
                raise GenworkerError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
    return server, task


SHUTDOWN_GRACE_S = 1
"""How long a stopping server lets requests still running finish before uvicorn cancels
them (:meth:`OpenAIServer.stop` has ended the generations by then). Without a bound,
uvicorn's graceful shutdown waits for every open stream to end by itself."""


async def stop_serving(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    """Stop a server of :func:`serve_on`: uvicorn closes idle connections at once and
    cancels requests still running after :data:`SHUTDOWN_GRACE_S`; forced a second later
    (uvicorn looks at ``should_exit`` every 0.1 s)."""
    server.should_exit = True
    try:
        async with asyncio.timeout(SHUTDOWN_GRACE_S + 1.0):
            await task
    except TimeoutError:
        server.force_exit = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class OpenAIServer:
    """vLLM's OpenAI app on a socket bound at construction (see the module docstring)."""

    def __init__(self, options: ServerOptions) -> None:
        refuse_dev_mode(os.environ)  # before the port is bound and the engine loads
        self.options = options
        self._socket: socket.socket | None = bind_socket(options.host, options.port)
        host, port = self._socket.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{shown}:{port}/v1"
        self.port = int(port)
        if not options.loopback:
            log.warning(
                "the OpenAI server listens on %s (vllm_cfg.http_server_host), reachable "
                "from other hosts",
                self.base_url,
            )
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._layer: RolloutLayer | None = None
        self._models: _ServedModels | None = None  # the app's, once built
        self._adapters: dict[str, int] = {}

    def serve_adapter(self, name: str, lora_int_id: int) -> None:
        """Serve adapter ``name`` (its engine id) as a model name, vLLM's convention: a
        request with ``"model": name`` generates under it, ``/v1/models`` lists it. Kept
        for a server not started yet."""
        self._adapters[name] = lora_int_id
        if self._models is not None:
            from genworker.core.lora import LoraRef
            from genworker.shell.vllm_engine import lora_request

            request = lora_request(LoraRef(name, lora_int_id))
            assert request is not None  # a ref always makes one
            self._models.lora_requests[name] = request

    def abort_all(self, reason: str) -> int:
        """End every HTTP generation request in flight (see ``RolloutLayer.abort_all``)."""
        return 0 if self._layer is None else self._layer.abort_all(reason)

    @property
    def serving(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(
        self,
        llm: object,
        hooks: RolloutHooks,
        *,
        policy: SamplingPolicy | None,
        max_new_tokens: int,
        cap_to_context: bool,
        num_speculative_tokens: int,
        captures_routes: bool = False,
        control: ControlHooks | None = None,
    ) -> None:
        """Build vLLM's app around ``llm`` and serve it on this loop; idempotent.
        ``captures_routes``: the engine returns routed experts (``return_routed_experts``
        is then a request's to ask for); ``control``: the worker behind vLLM's RL routes
        (served when the options ask for them)."""
        if self._task is not None:
            return
        if self._socket is None:
            raise EngineStateError("the HTTP server was stopped; create a new worker")
        model_config = _model_config(llm)
        app = await build_vllm_app(llm, self.options.chat_template)
        self._models = getattr(app.state, "openai_serving_models", None)
        for name, lora_int_id in self._adapters.items():
            self.serve_adapter(name, lora_int_id)
        tokenizer = await _tokenizer(llm)

        def decode(ids: Sequence[int], skip_special: bool) -> str:
            return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special))

        layer = RolloutLayer(
            app,
            hooks,
            policy=policy,
            max_new_tokens=max_new_tokens,
            max_model_len=int(model_config.max_model_len),
            cap_to_context=cap_to_context,
            num_speculative_tokens=num_speculative_tokens,
            decode=decode,
            reuses_prompt_ids=chat_takes_prompt_ids(),
            vocab_size=_vocab_size(model_config, tokenizer),
            chat_template=self.options.chat_template,
            captures_routes=captures_routes,
            control=self._control(llm, control),
        )
        self._layer = layer
        self._server, self._task = await serve_on(layer, self._socket)
        log.info("vLLM's OpenAI server listens on %s", self.base_url)

    def _control(self, llm: object, hooks: ControlHooks | None) -> ControlRoutes | None:
        if not self.options.rl_routes:
            return None
        if hooks is None:
            raise BadConfigError("http_server_rl_routes: this server has no worker behind it")
        config = getattr(llm, "vllm_config", None)
        device = str(getattr(getattr(config, "device_config", None), "device_type", "cpu"))
        backend = "nccl" if device == "cuda" else "gloo"
        return ControlRoutes(hooks, config, backend, self.options.weight_transfer_timeout_s)

    async def stop(self) -> None:
        """End the generations in flight (a stream ends, a response not yet started
        answers 500), stop serving and close the socket (the port is free afterwards);
        idempotent."""
        task, self._task = self._task, None
        server, self._server = self._server, None
        self.abort_all("the server is shutting down")
        try:
            if task is not None and server is not None:
                await stop_serving(server, task)
        finally:
            sock, self._socket = self._socket, None
            if sock is not None:
                sock.close()
