"""vLLM's RL routes on genworker's server, each mapped onto the async worker (the rules in
:mod:`genworker.core.control_plane`).

Theory of operation
-------------------
With ``vllm_cfg.http_server_rl_routes`` (``genworker serve --rl-routes``) the server's
layer hands every request for a route of :data:`~genworker.core.control_plane.ROUTES`
to :meth:`ControlRoutes.handle` instead of vLLM's app (whose own versions of these
routes exist only with ``VLLM_SERVER_DEV_MODE``, which genworker's server refuses). A
route's query and body are parsed (400 naming the field), the machine allows it or
answers 409 naming the state and what to call, then the worker does it (the table of
routes and worker calls: ``docs/server.md``). ``/update_weights`` is one refit through
the refit backend ``vllm_wire``, paused around it in mode ``keep`` unless the trainer
paused first; a failure is the worker's failed refit (generation refused until an
update lands), answered with the typed error.

Routes run one at a time (a lock): a second trainer call waits for the first, as the
engine could not do two weight operations at once anyway. Generation requests pass
through, except while the machine refuses them (paused in mode ``abort``; after a failed
update): 409.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Protocol, cast

from returns.result import Failure

from genworker.core import control_plane as c
from genworker.core.asgi_messages import Answer, refusal
from genworker.core.serving import BadRequest, error_body
from genworker.shell.errors import (
    BadArgumentError,
    EngineStateError,
    GenworkerError,
    RefitManifestError,
    RefitTimeoutError,
    RefitTransportError,
)

__all__ = ["ControlHooks", "ControlRoutes"]


class ControlHooks(Protocol):
    """What the routes need from the async worker."""

    @property
    def weight_version(self) -> int: ...

    async def pause_generation(self, mode: str, clear_cache: bool = True) -> None: ...

    async def resume_generation(self) -> None: ...

    async def sleep(self, level: int | None = None) -> None: ...

    async def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    async def reset_prefix_cache(self) -> None: ...

    async def init_weight_transfer(
        self, init_info: Mapping[str, object], timeout_s: float | None = None
    ) -> list[object]: ...

    async def update_weights_from_wire(
        self, update_info: Mapping[str, object], timeout_s: float | None = None, *, held: bool
    ) -> bool: ...

    def sleeping(self) -> bool: ...

    async def abort_requests(self, request_ids: Sequence[str]) -> int: ...


#: The HTTP status of a typed failure of a route's call: the first kind it is, else 500.
_STATUSES: tuple[tuple[type[GenworkerError], int], ...] = (
    (BadArgumentError, 400),
    (RefitManifestError, 400),
    (EngineStateError, 409),
    (RefitTimeoutError, 504),
)


class ControlRoutes:
    """The RL routes' state and handlers (see the module docstring)."""

    def __init__(
        self, hooks: ControlHooks, vllm_config: object, backend: str, timeout_s: float
    ) -> None:
        self.hooks, self.vllm_config, self.backend = hooks, vllm_config, backend
        self.timeout_s = timeout_s
        self.state = c.ControlState()
        self._lock = asyncio.Lock()

    def refuses_generation(self) -> BadRequest | None:
        """Why a generation request gets 409 now, or ``None``."""
        return c.admit(self.state, c.Generate()).swap().value_or(None)

    async def handle(self, route: str, query: Mapping[str, str], raw: bytes) -> Answer:
        """Route ``route`` with its query and raw body: the answer to send."""
        parsed = c.parse_raw(route, query, raw)
        if isinstance(parsed, Failure):
            return refusal(parsed.failure())
        request = parsed.unwrap()
        async with self._lock:
            allowed = c.admit(self.state, request)
            if isinstance(allowed, Failure):
                return refusal(allowed.failure())
            try:
                outcome = await self._run(request)
            except GenworkerError as e:
                if isinstance(request, c.Update) and not isinstance(e, EngineStateError):
                    # refused in the worker's state (asleep, say): nothing moved. A
                    # transport that failed (or none left) closed the group: join again
                    broken = isinstance(e, RefitTimeoutError | RefitTransportError)
                    self.state = c.update_failed(self.state, str(e), group_broken=broken)
                status = next((code for kind, code in _STATUSES if isinstance(e, kind)), 500)
                return status, error_body(status, f"/{route}: {type(e).__name__}: {e}", None)
            answer = c.answer(request, self.state, outcome, self.hooks.weight_version)
            self.state = allowed.unwrap()
            if isinstance(request, c.Update):  # it landed: the weights are consistent again
                self.state = c.updated(self.state)
            return 200, answer

    async def _run(self, request: c.Request) -> object:
        """The worker's part of ``request``: what its answer reports
        (``core.control_plane.answer``)."""
        hooks = self.hooks
        match request:
            case c.Query(route="get_world_size"):
                parallel = getattr(self.vllm_config, "parallel_config", None)
                size = getattr(parallel, "world_size_across_dp", None)
                return int(size or getattr(parallel, "world_size", 1) or 1)
            case c.Query(route="is_sleeping"):
                return hooks.sleeping()
            case c.Query(route="server_info"):
                return self._config_tree()
            case c.Pause(mode=mode, clear_cache=clear):
                await hooks.pause_generation(mode.value, clear)
            case c.Resume():
                await hooks.resume_generation()
            case c.AbortRequests(request_ids=ids):
                return await hooks.abort_requests(ids)
            case c.Sleep(level=level):
                await hooks.sleep(level)
            case c.WakeUp(tags=tags):
                await hooks.wake_up(tags)
            case c.ResetPrefixCache():
                await hooks.reset_prefix_cache()
            case c.InitTransfer():
                return await hooks.init_weight_transfer(request.as_dict(), self.timeout_s)
            case c.Update():
                held = self.state.paused is not None
                info = request.as_vllm_info()
                await hooks.update_weights_from_wire(info, self.timeout_s, held=held)
        return None

    def _config_tree(self) -> dict[str, object]:
        """vLLM's ``/server_info`` tree (``config_format=json``), with the weight transfer
        genworker serves."""
        import pydantic
        from vllm.config import VllmConfig

        config = cast("VllmConfig", self.vllm_config)
        dumped = pydantic.TypeAdapter(VllmConfig).dump_python(config, mode="json", fallback=str)
        tree: dict[str, object] = dict(dumped) if isinstance(dumped, dict) else {}
        tree["weight_transfer_config"] = {"backend": self.backend, "served_by": "genworker"}
        return tree
