"""A deterministic async engine for tests (ours and users'): the fake of
:class:`genworker.shell.ports.AsyncEnginePort`.

``FakeAsyncEngine`` runs requests the way ``AsyncLLM`` does, on the running event loop: a
scheduler task admits waiting requests and gives every running request one token per step
(``step_s`` apart). It follows vLLM where the async worker relies on it:

- ``pause(mode)`` as ``EngineCoreProc.pause_scheduler`` (vllm/v1/engine/core.py, 0.32):
  every mode queues new requests; ``keep`` freezes running requests until ``resume``;
  ``wait`` lets them finish and returns when none runs; ``abort`` ends them all (finish
  reason ``"abort"``);
- ``abort(ids)`` ends those requests with finish reason ``"abort"`` and the tokens so far;
  cancelling a ``generate`` coroutine aborts its request;
- tokens are a function of (engine seed, weights version, prompt plus the tokens so far,
  greedy, request seed and position when sampling) only, so a greedy continuation after a
  weight change equals a fresh greedy run from the prompt plus the tokens before it;
- weight labels (``weight_versions=True``): every token carries the label set by
  ``label_weights`` when it was sampled, reported as spans when the request finishes;
  with ``weight_versions=False`` the engine labels nothing and calls ``progress`` after
  every step instead;
- ``next_logprobs`` (prompt -> value) makes the next request with that prompt come back
  with every sampled logprob that value (vLLM's garbage logits: NaN, +inf; or -inf);
- ``kill()`` is an engine core that died: every pending request and every later call
  raises ``EngineDeadError``;
- ``accept_refits=True`` makes every refit RPC succeed at once, genworker's wire and the
  extension's NeMo-RL one (``nemo_rl_*``), group joins included (for tests whose fake
  lives in another process, a Ray actor);
- ``FakeEngineMisuse`` where a real engine would silently go wrong: weights changed
  (``load_new_weights``) while requests run unpaused, generating with memory asleep,
  sleeping with requests in flight.

The rest is the sync fake's (``fake_engine``, the same ``FakeEngineBase``): images,
``generate_text``'s checks under the engine's ``logprobs_mode``, ``fail_next`` /
``fail_call`` and a sleep or wake that fails part-way, ``wake_up``'s tag rule, routed
experts (here the prompt under the weights of the first generated token, each generated
token under the weights that sampled it) and the letter tokenizer.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Unpack

import attrs

from genworker.core.counters import MetricSample
from genworker.core.engine_calls import Cache, RowRequest, RpcCall, text_refusal
from genworker.core.fake_model import (
    FakeEngineOptions,
    detokenize,
    draw,
    fake_metrics,
    faulted,
    steppable,
    weight_spans,
)
from genworker.core.joins import GroupJoin, GroupJoinWire
from genworker.core.lifecycle import InflightMode
from genworker.core.scoring import ScoredRow
from genworker.shell.errors import (
    BadBatchError,
    EngineDeadError,
)
from genworker.shell.fake_engine import (
    FakeEngineBase,
    FakeEngineFactoryBase,
    FakeEngineMisuse,
    FakeRequest,
    pixels,
)
from genworker.shell.media import RowMedia
from genworker.shell.ports import StreamedGeneration, check_text_request

__all__ = ["FakeAsyncEngine", "FakeAsyncEngineFactory"]


@attrs.define(eq=False, kw_only=True)
class _Request(FakeRequest):
    """A request the scheduler steps: its id, who counts its tokens, the future of its
    end, and the weight labels of its tokens (label, first position)."""

    request_id: str
    progress: Callable[[int], None] | None
    done: asyncio.Future[StreamedGeneration]
    labels: list[tuple[str, int]] = attrs.Factory(list)


class FakeAsyncEngine(FakeEngineBase):
    """Deterministic async engine; see the module docstring for its rules."""

    def __init__(
        self,
        *,
        weight_versions: bool = True,
        step_s: float = 0.0005,
        accept_refits: bool = False,
        **options: Unpack[FakeEngineOptions],
    ) -> None:
        super().__init__(**options)
        self._caps = attrs.evolve(self._caps, weight_versions=weight_versions)
        #: requests with these prompts come back with every sampled logprob this value,
        #: as vLLM's do when the logits are garbage (NaN, +inf) or the token was masked
        #: (-inf); each entry serves one request
        self.next_logprobs: dict[tuple[int, ...], float] = {}
        self.step_s = step_s
        #: steps left before the scheduler stops (None: no limit); see allow_steps
        self.step_budget: int | None = None
        self.label = "default"
        self.pause_mode: InflightMode | None = None
        if accept_refits:  # every refit succeeds at once (tests that cannot reach the fake)
            for method in (
                "update_weights_via_ipc_zmq",
                "update_weights_from_collective",
                "nemo_rl_update_weights_via_ipc_zmq",  # the extension's NeMo-RL wire
                "nemo_rl_update_weights_from_collective",
            ):
                self.rpc_handlers[method] = self._accept_refit
            for method in ("init_collective", "nemo_rl_init_collective"):
                self.rpc_handlers[method] = self._accept_group
            device = self._caps.device
            self.rpc_handlers["nemo_rl_ipc_socket_dir"] = lambda d: f"ipc://{d}/fake-{device}.sock"
        self.dead = False
        #: each finished request's prompt and the weights version of each of its tokens
        self.finished: dict[tuple[int, ...], tuple[int, ...]] = {}
        #: the first misuse a step ran into (the requests then in flight raised it)
        self.misuse: FakeEngineMisuse | None = None
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._scheduler: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # -- the scheduler ----------------------------------------------------------------
    def _refusal(self, call: str) -> str | None:
        if self.dead or self.shut_down:
            return f"{call}: the fake engine is {'dead' if self.dead else 'down'}"
        return None

    def _ensure_scheduler(self) -> None:
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    async def _schedule(self) -> None:
        while True:
            if not self._steppable():
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(self.step_s)
            if not self._steppable():
                continue
            try:
                self._step()
            except FakeEngineMisuse as e:  # the pending requests see it, and so does the test
                misuse = self.misuse = e
                self._fail_pending(lambda: misuse)  # noqa: B023 - called before the loop goes on

    def _fail_pending(self, error: Callable[[], BaseException]) -> None:
        """Every pending request raises what ``error`` makes (a misuse a step ran into, the
        core's death); none is left."""
        for request in [*self._running, *self._waiting]:
            if not request.done.done():
                request.done.set_exception(error())
        self._running, self._waiting = [], []

    def allow_steps(self, steps: int | None) -> None:
        """Let the scheduler take ``steps`` more steps, then hold (None: no limit); a test
        that decides what happens between two steps."""
        self.step_budget = steps
        self._wake.set()

    def _steppable(self) -> bool:
        waiting, running = len(self._waiting), len(self._running)
        return steppable(self.pause_mode, self.step_budget, waiting, running)

    def _step(self) -> None:
        if self.step_budget is not None:
            self.step_budget -= 1
        if self.pause_mode is None:
            self._running += self._waiting
            self._waiting = []
        for request in list(self._running):
            self._sample(request)
            if request.progress is not None:
                request.progress(len(request.tokens))
        self._wake.set()

    def _sample(self, request: _Request) -> None:
        """One step of ``request``: its token drawn from (seed, weights, the context so far,
        greedy, images) and, sampling, the request seed and the position."""
        self._check_servable("a step")
        spec = request.spec
        greedy = spec.temperature == 0.0
        position = len(request.tokens)
        context = (*request.prompt, *request.tokens)
        key = (self.seed, self.weight_version, context, greedy, *request.pixels)
        if not request.labels or request.labels[-1][0] != self.label:
            request.labels.append((self.label, position))
        finish = self._next_token(
            request, draw(*key) if greedy else draw(*key, spec.seed, position)
        )
        self.generation_tokens += 1
        if finish is not None:
            self._finish(request, finish)

    def _finish(self, request: _Request, reason: str) -> None:
        for queue in (self._running, self._waiting):
            if request in queue:
                queue.remove(request)
        self.finished[request.prompt] = tuple(request.versions)
        if request.done.done():
            return
        spans = None
        if self._caps.weight_versions:
            spans = weight_spans(request.labels, len(request.tokens))
        fault = self.next_logprobs.pop(request.prompt, None)
        generation = faulted(self._generation(request, reason), fault, None)
        request.done.set_result(StreamedGeneration(generation, spans))

    # -- generation -------------------------------------------------------------------
    async def generate(
        self, request: RowRequest[RowMedia], progress: Callable[[int], None] | None = None
    ) -> StreamedGeneration:
        self._enter("generate")
        request_id, prompt, media = request.request_id, request.prompt, request.media
        context = self._context(prompt, media)
        if any(r.request_id == request_id for r in (*self._waiting, *self._running)):
            raise BadBatchError(f"request id {request_id!r} is in use")
        self._ensure_scheduler()
        done: asyncio.Future[StreamedGeneration] = asyncio.get_running_loop().create_future()
        progress = None if self._caps.weight_versions else progress
        running = _Request(
            prompt=tuple(prompt),
            spec=request.spec,
            context=context,
            pixels=pixels(media),
            request_id=request_id,
            progress=progress,
            done=done,
        )
        self.prompt_tokens += context
        self._waiting.append(running)
        self._wake.set()
        try:
            return await done
        except asyncio.CancelledError:
            self._finish(running, "abort")
            raise

    async def compute_logprobs(
        self, request_id: str, sequence: Sequence[int], prompt_length: int, top_k: int
    ) -> ScoredRow:
        """The sync fake's made-up model (``FakeEngineBase._score``), one step later."""
        self._enter("compute_logprobs")
        await asyncio.sleep(0)
        return self._score(sequence, prompt_length, top_k)

    async def generate_text(self, request: RowRequest[RowMedia]) -> str:
        if problem := text_refusal((request.spec,), None):
            raise FakeEngineMisuse(problem)
        streamed = await self.generate(request)
        generation, request_id = streamed.generation, request.request_id
        check_text_request(generation, self._caps.logprobs_mode, request_id)
        return detokenize(generation.token_ids)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self._enter("abort")
        ids = set(request_ids)
        for request in [r for r in (*self._running, *self._waiting) if r.request_id in ids]:
            self._finish(request, "abort")
        self._wake.set()

    def num_unfinished(self) -> int:
        return len(self._waiting) + len(self._running)

    # -- pause and weights ------------------------------------------------------------
    async def pause(self, mode: InflightMode, clear_cache: bool) -> None:
        self._enter(f"pause({mode.value})")
        self.pause_mode = mode
        if mode is InflightMode.ABORT:
            for request in [*self._running, *self._waiting]:
                self._finish(request, "abort")
        if mode is InflightMode.WAIT:
            while self._running:
                self._ensure_scheduler()
                self._wake.set()
                await asyncio.sleep(self.step_s)
                if self.dead:
                    raise EngineDeadError("pause: the fake engine died")

    async def resume(self) -> None:
        self._enter("resume")
        self.pause_mode = None
        self._wake.set()

    async def label_weights(self, label: str) -> None:
        self._enter(f"label_weights({label})")
        if not self._caps.weight_versions:
            raise FakeEngineMisuse("label_weights on an engine without weight labels")
        self.label = label

    def _accept_refit(self, timeout_s: float = 600.0) -> dict[str, object]:
        self.load_new_weights()
        return {"tensors": 0, "version": self.weight_version}

    def _accept_group(self, join: GroupJoinWire) -> dict[str, object]:
        return {"rank": GroupJoin(**join).rank(0)}

    def load_new_weights(self) -> None:
        if self._running and self.pause_mode is None:
            raise FakeEngineMisuse("weights written while requests run unpaused")
        super().load_new_weights()

    def kill(self) -> None:
        """The engine core died: pending requests and later calls raise EngineDeadError."""
        self.dead = True
        self._fail_pending(lambda: EngineDeadError("the fake engine core died"))
        if self._scheduler is not None:
            self._scheduler.cancel()

    # -- memory -----------------------------------------------------------------------
    async def sleep(self, level: int) -> None:
        self._sleep(level, self.num_unfinished())

    async def wake_up(self, tags: Sequence[str] | None) -> bool:
        return self._wake_up(tags)

    async def reset_cache(self, cache: Cache) -> None:
        self._reset_cache(cache, len(self._running))

    # -- observability and RPC --------------------------------------------------------
    def metrics(self) -> list[MetricSample]:
        self._enter("metrics")
        return fake_metrics(self.prompt_tokens, self.generation_tokens, len(self._running))

    async def collective_rpc(self, call: RpcCall) -> list[object]:
        result = self._rpc(call)
        if inspect.isawaitable(result):
            result = await asyncio.wait_for(result, call.timeout)
        return [result]

    async def device_ids(self) -> list[str]:
        return [str(x) for x in await self.collective_rpc(RpcCall("report_device_id"))]

    async def shutdown(self) -> None:
        self.calls.append("shutdown")
        self.shut_down = True
        for request in [*self._running, *self._waiting]:
            self._finish(request, "abort")
        if self._scheduler is not None:
            self._scheduler.cancel()


class FakeAsyncEngineFactory(FakeEngineFactoryBase[FakeAsyncEngine]):
    """Starts ``FakeAsyncEngine``s for the async worker; records the kwargs it was given."""

    engine = FakeAsyncEngine
