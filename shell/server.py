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
  vLLM's answer. Those two it checks and completes with ``core.server_prompts``' machine
  (its docstring: the prompt checks, the on-policy guard, ids and logprobs asked for,
  the context budget, the multi-turn prefix), answering each tokenization it asks for
  through vLLM's own ``/tokenize`` route (an in-process ASGI call). Refusals are
  OpenAI-style error bodies. A request the machine finds complete goes to vLLM as its
  own bytes; one it completes is re-serialised.
- **Routed experts**: where the engine captures them, vLLM adds every choice's routes
  to a non-streamed response; the layer passes them to a request that asks
  (``return_routed_experts``, removed before vLLM sees the body) and drops them otherwise
  (``core.serving.check_routes_request``; ``core.server_responses``).
- **Weight versions**: each request runs inside ``AsyncVllmGenerationWorker.in_flight()``
  (a stream for the lifecycle: sleep and prefix-cache resets wait, in-flight refits pause
  and resume it like the worker's own rows; a refit that fails ends them: 500 naming the
  failure, or the stream ends). Its response carries every version from the request's
  arrival on (``core.server_responses``: the header ``x-genworker-weight-versions``, and
  a ``weight_versions`` field in every streamed event).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Protocol, SupportsInt, TypeVar, runtime_checkable

import attrs
from returns.result import Failure, Result

from genworker.core.asgi_messages import (
    Message,
    content_length,
    field_of,
    generation_route,
    inner_request,
    json_answer,
    json_response,
    refusal_response,
    routed,
)
from genworker.core.control_plane import ROUTES as CONTROL_ROUTES
from genworker.core.refit_transport import collective_backend
from genworker.core.server_prompts import Prepared, PromptRules, Tokenized
from genworker.core.server_responses import VERSIONS_HEADER, Reply
from genworker.core.serving import (
    DEV_MODE_VARIABLE,
    ROUTES_FIELD,
    BadRequest,
    SamplingPolicy,
    ServerOptions,
    check_body_length,
    check_dev_mode,
    check_nesting,
    check_routes_request,
    http_limits,
    late_body,
    parse_body,
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
]

log = logging.getLogger(__name__)

#: Seconds a request's whole body may take to arrive (then 408, connection closed). A
#: constant, not a config key: rollout clients are on the cluster's network, where the
#: largest body the limits allow (``core.serving.http_limits``) takes well under a second.
BODY_READ_TIMEOUT_S = 60.0
# ASGI's shapes as Starlette names them (starlette/types.py; ``core.asgi_messages``).
Scope = MutableMapping[str, object]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
_T = TypeVar("_T")


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


@attrs.define(kw_only=True, eq=False)
class RolloutLayer:
    """The ASGI layer in front of vLLM's app (see the module docstring)."""

    app: ASGIApp = attrs.field(kw_only=False)
    hooks: RolloutHooks = attrs.field(kw_only=False)
    rules: PromptRules
    decode: Callable[[Sequence[int], bool], str]
    body_timeout_s: float = BODY_READ_TIMEOUT_S
    captures_routes: bool = False
    control: ControlRoutes | None = None
    #: The generation requests in flight, each with the reason it was aborted (or None).
    _running: dict[asyncio.Task[object], str | None] = attrs.field(init=False, factory=dict)

    def abort_all(self, reason: str) -> int:
        """End every generation request in flight (vLLM aborts it: ``AsyncLLM.generate``
        on cancellation); each answers 500 with ``reason``, or its stream ends there."""
        for task, aborted in self._running.items():
            self._running[task] = aborted or reason
            task.cancel()
        return len(self._running)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = await self._read_body(scope, receive, send)
        if raw is None:  # answered, or the client is gone
            return
        chat = generation_route(scope)
        if chat is None:
            nested = check_nesting(raw, self.rules.limits)  # vLLM's json.loads recurses
            if isinstance(nested, Failure):
                await _refuse(send, nested.failure())
                return
            if self.control is not None and (found := routed(scope, CONTROL_ROUTES)) is not None:
                answer = await self.control.handle(*found, raw)
                await _send_all(send, json_response(*answer))
                return
            await self.app(scope, _replay(raw, receive), send)
            return
        parsed = parse_body(raw, self.rules.limits)
        if isinstance(parsed, Failure):
            problem = parsed.failure()
            if isinstance(problem, BadRequest):
                await _refuse(send, problem)
                return
        body = parsed.value_or(None)
        if not isinstance(body, dict):  # vLLM answers malformed requests itself
            await self.app(scope, _replay(raw, receive), send)
            return
        if self.control is not None and (held := self.control.refuses_generation()):
            await _refuse(send, held)
            return
        routes = check_routes_request(body, captures=self.captures_routes)
        asked = body.pop(ROUTES_FIELD, None) is not None  # genworker's, not vLLM's
        prepared = routes if isinstance(routes, Failure) else await self._prepare(scope, body, chat)
        if isinstance(prepared, Failure):
            await _refuse(send, prepared.failure())
            return
        ready = prepared.unwrap()
        if ready.changed or asked:
            raw = json.dumps(ready.body).encode()
        try:
            async with self.hooks.in_flight():
                strip = self.captures_routes and not routes.unwrap()
                await self._generate(scope, raw, receive, send, strip_routes=strip)
        except EngineStateError as e:
            await _refuse(send, BadRequest(str(e), status=503, param=None))

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The request's body, read within the byte limit and :attr:`body_timeout_s`;
        ``None`` once the client got its 413 or 408 (the connection closed after it) or
        went away."""
        declared = content_length(scope)
        if declared is not None:
            checked = check_body_length(declared, self.rules.limits)
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
                    chunk = field_of(message, "body", bytes, b"")
                    size += len(chunk)
                    checked = check_body_length(size, self.rules.limits)
                    if isinstance(checked, Failure):
                        await _refuse(send, checked.failure())
                        return None
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            await _refuse(send, late_body(self.body_timeout_s, size))
            return None

    async def _generate(
        self, scope: Scope, raw: bytes, receive: Receive, send: Send, *, strip_routes: bool
    ) -> None:
        """vLLM's answer, the task tracked for :meth:`abort_all`: once aborted, what vLLM
        sends is dropped, and the request ends with ours (500 naming the reason where the
        response has not started, else the stream's end)."""
        task = asyncio.current_task()
        assert task is not None
        forward = self._sender(send, self.hooks.weight_version, strip_routes)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            reason = self._running[task]
            if reason is None:
                started = started or message["type"] == "http.response.start"
                await forward(message)
            elif not started:  # vLLM answered the cancellation itself: ours instead
                started = True
                await _refuse(send, BadRequest(reason, status=500, param=None))

        self._running[task] = None
        try:
            await self.app(scope, _replay(raw, receive), tracked)
        except asyncio.CancelledError:
            if (reason := self._running[task]) is None:
                raise
            task.uncancel()
            if not started:
                await _refuse(send, BadRequest(reason, status=500, param=None))
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            if self._running[task] is not None:  # vLLM took the cancellation as a disconnect
                task.uncancel()
        finally:
            del self._running[task]

    # -- the request -------------------------------------------------------------------
    async def _prepare(
        self, scope: Scope, body: Mapping[str, object], chat: bool
    ) -> Result[Prepared, BadRequest]:
        """``core.server_prompts``' machine for ``body``, its tokenizations answered by
        vLLM's own ``/tokenize`` route."""
        steps = self.rules.prepare(body, chat=chat, decode=self.decode)
        try:
            payload = next(steps)
            while True:
                payload = steps.send(await _call_json(self.app, scope, "/tokenize", payload))
        except StopIteration as done:
            decided: Result[Prepared, BadRequest] = done.value
            return decided

    # -- the response ------------------------------------------------------------------
    def _sender(self, send: Send, first: int, strip_routes: bool = False) -> Send:
        """``send`` of vLLM's response as ``core.server_responses.Reply`` reshapes it: the
        versions added (a header; each streamed event's field) and, with ``strip_routes``,
        a non-streamed body without its choices' routed experts."""
        reply = Reply(first, strip_routes)

        async def wrapped(message: Message) -> None:
            nonlocal reply
            reply, messages = reply.take(message, self.hooks.weight_version)
            await _send_all(send, messages)

        return wrapped


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


async def _send_all(send: Send, messages: Sequence[Message]) -> None:
    for message in messages:
        await send(message)


async def _refuse(send: Send, problem: BadRequest) -> None:
    await _send_all(send, refusal_response(problem))


async def _call_json(
    app: ASGIApp, scope: Scope, path: str, payload: Mapping[str, object]
) -> Tokenized:
    """One in-process request to ``app`` (vLLM's own route), JSON in and out (text where
    the answer is not JSON): the request's own scope with the path and body replaced, no
    socket and no HTTP client (one would build its own request and response objects
    around the same call, and is not among the engine's dependencies)."""
    sub, data = inner_request(scope, path, payload)
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await app(sub, _replay(data), send)
    return json_answer(sent)


# --- vLLM's app, found by looking ------------------------------------------------------


# vLLM 0.32 moved its server from ``vllm.entrypoints.openai`` to ``.launchers``.
_LAUNCHERS, _OPENAI = "vllm.entrypoints.launchers.", "vllm.entrypoints.openai."
# The pieces of vLLM's app, each where 0.32 has it, then where 0.25 has it.
_APP_PARTS = (
    ("build_app", (_LAUNCHERS + "app", _OPENAI + "api_server")),
    ("init_app_state", (_LAUNCHERS + "api_server.app_state", _OPENAI + "api_server")),
    ("make_arg_parser", (_LAUNCHERS + "cli_args", _OPENAI + "cli_args")),
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


def _expect(value: object, kind: type[_T], what: str) -> _T:
    """``value``, found by looking in vLLM, when it is the ``kind`` read here."""
    if not isinstance(value, kind):
        raise BadConfigError(
            f"the installed vLLM's {what} is a {type(value).__name__}, not a {kind.__name__}"
        )
    return value


async def _vllm_call(
    fn: Callable[..., object], kind: type[_T], what: str, /, *args: object, **available: object
) -> _T:
    """vLLM's ``fn`` (found by looking) called with ``args`` and those of ``available``
    its signature names (they differ between versions), awaited where vLLM's is a
    coroutine function, its value checked to be the ``kind`` read here."""
    params = inspect.signature(fn).parameters
    value = fn(*args, **{k: v for k, v in available.items() if k in params})
    return _expect(await value if inspect.isawaitable(value) else value, kind, what)


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
        get_tokenizer = getattr(llm, "get_tokenizer")  # noqa: B009 - llm: any engine client
        tokenizer = await _vllm_call(get_tokenizer, object, "get_tokenizer")
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
    parser = await _vllm_call(
        make_arg_parser, argparse.ArgumentParser, "make_arg_parser", parser_cls()
    )
    args = parser.parse_args(argv)
    get_tasks = getattr(llm, "get_supported_tasks", None)
    tasks = await _vllm_call(get_tasks, object, "tasks") if callable(get_tasks) else None
    app = await _vllm_call(
        build_app, FastAPI, "build_app", args=args, supported_tasks=tasks, model_config=model_config
    )
    await _vllm_call(
        init_app_state,
        object,
        "init_app_state",
        engine_client=llm,
        vllm_config=getattr(llm, "vllm_config", None),
        state=app.state,
        args=args,
        supported_tasks=tasks,
    )
    return app


async def serve_on(
    app: Callable[..., Awaitable[None]], sock: socket.socket
) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """Serve the ASGI ``app`` on the bound ``sock`` from this loop with a uvicorn server
    that leaves the process's signals alone; returns once it accepts connections."""
    import uvicorn

    server_cls = _first_attr([(_LAUNCHERS + "launcher", "NoSignalServer"), ("uvicorn", "Server")])
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = await _vllm_call(server_cls, uvicorn.Server, "HTTP server", config)
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

        max_model_len = int(model_config.max_model_len)
        rules = PromptRules(
            policy=policy,
            max_new_tokens=max_new_tokens,
            max_model_len=max_model_len,
            cap_to_context=cap_to_context,
            num_speculative_tokens=num_speculative_tokens,
            limits=http_limits(max_model_len, _vocab_size(model_config, tokenizer)),
            reuses_prompt_ids=chat_takes_prompt_ids(),
            chat_template=self.options.chat_template,
        )
        layer = RolloutLayer(
            app,
            hooks,
            rules=rules,
            decode=decode,
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
        backend = collective_backend(device)
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
