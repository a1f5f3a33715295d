"""``AsyncVllmGenerationWorker``: rows streamed as they finish, weights updated while
requests run, a weight version on every token; over vLLM's own ``AsyncLLM``.

Theory of operation
-------------------
The streaming drive loop over :class:`~genworker.shell.spine.WorkerSpine`, the body it
shares with :class:`~genworker.shell.worker.VllmGenerationWorker` (config, checks, the
request plan of ``core.requests``, lifecycle, sleep and wake with their cache resets, the
refit preamble, counters, the RPC error map); the difference is that every row is its own
engine request, so rows finish, fail and change weights apart. What a caller sees (rows
as they finish, typed row errors, ending a stream, the refit's modes and its failure, one
event loop): ``docs/async.md``; how it is done:

- ``generate_async(data)`` checks the batch row by row (``core.rows.check_rows``) and
  runs every row that can generate as its own request and task; each comes back as
  ``generate``'s contract for that one row cut to its own length
  (``core.rows.assemble_row``) plus ``weight_versions``. A row without room for a token
  once speculative decoding holds its slots back (``core.caps.cap_rows``) comes back
  unchanged with no tokens, as the sync worker's does.
- Images come as the sync worker takes them (``multi_modal_data``, or NeMo-RL's
  ``vllm_images`` / ``vllm_content``; ``genworker.shell.media``): checked against the
  placeholders, the caps on the expanded prompt, a row with prompt text started from its
  ids; a bad image refuses the whole batch before anything runs. An in-flight refit on a
  multimodal engine must clear the caches (``clear_cache=False`` is refused: vLLM 0.32's
  engine core dies at the next image, "Encoder cache miss").
- Ending a stream cancels its unfinished requests, which aborts them in vLLM
  (``AsyncLLM.generate`` aborts on ``CancelledError``), and aborts them again by id.
- The lifecycle (``core.lifecycle.TABLE``): a stream opens with ``STREAM_OPEN`` and the
  last one to end fires ``STREAMS_DONE``; sleeping and resetting the prefix cache are
  refused while streams run. Sleep and wake are the sync worker's (``shell.spine``).
- In-flight refit: the lifecycle enters refitting at once (a second refit is refused),
  the engine is paused as by ``AsyncLLM.pause_generation(mode, clear_cache)`` (without its
  20 ms sleep, ``AsyncVllmEngine.pause``), the engine workers receive the weights over the
  refit transports (the same extension RPCs as the sync worker), and the engine resumes;
  ``keep`` with ``clear_cache=True`` re-prefills the running requests on the new weights
  (``Scheduler.reset_prefix_cache(reset_running_requests=True)``). A refit that fails
  ends every row in flight as ``RefitError``. ``refit_via`` (and ``init_collective_via``)
  run the same in-flight refit through another extension receiver: NeMo-RL's trainer
  wire, ``nemo_rl_*`` (``shell.nemo_rl_async``).
- Weight versions (``core.versions``): version 0 is the weights loaded, each good refit
  adds one. Where vLLM labels tokens (``EngineCapabilities.weight_versions``, 0.32) the
  worker labels the engine's weights ``str(version)`` while paused and reads each row's
  spans when it finishes. Elsewhere the worker counts each row's tokens as they stream,
  under the version it runs; after a pause returns it waits until the tokens sampled
  before it have all come through (vLLM sends every output of the steps before a
  ``keep``/``wait`` pause before the pause's answer, ``EngineCoreProc.pause_scheduler``),
  so the count is exact there too.
- One event loop: the engine's output handler runs on the loop of the first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import threading
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Mapping,
    Sequence,
)
from typing import Concatenate, ParamSpec, TypeVar

import attrs
import torch
from returns.result import Failure

from genworker.core import control_plane, lifecycle
from genworker.core.assembly import Generation
from genworker.core.counters import LOGGER_METRICS, logger_sample
from genworker.core.engine_calls import RowRequest
from genworker.core.groups import GroupPlan, admission_runs
from genworker.core.lifecycle import InflightMode
from genworker.core.outputs import NonFiniteLogprobs, check_generation_logprobs
from genworker.core.refit_protocol import Transport, rendezvous_bounds
from genworker.core.rows import finished_row, versioned_outputs, versioned_row
from genworker.core.scoring import ScoredRow, assemble_scores
from genworker.core.serving import metrics_logger_interval, server_options, training_policy
from genworker.core.stops import StopMode
from genworker.core.versions import Counted, VersionRuns, extend_runs
from genworker.shell.errors import (
    BadArgumentError,
    BadConfigError,
    EngineContractError,
    EngineDeadError,
    EngineStateError,
    GenworkerError,
    RefitManifestError,
    RequestAbortedError,
    UnsupportedError,
    unwrap,
)
from genworker.shell.media import RowMedia
from genworker.shell.ports import (
    AsyncEngineFactory,
    AsyncEnginePort,
    EngineCapabilities,
    StreamedGeneration,
)
from genworker.shell.server import OpenAIServer
from genworker.shell.spine import (
    BatchPlan,
    Drive,
    EngineCall,
    ExistingEngineFactory,
    Inflight,
    Steps,
    WorkerSpine,
    door_of,
    tally_nonfinite,
)

__all__ = [
    "AsyncVllmGenerationWorker",
    "ExistingAsyncEngine",
    "RowResult",
    "StreamItem",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_P = ParamSpec("_P")
#: A row's engine call: the engine, the request, its call, its context length, and the
#: event a group's leader sets at its first token.
_RowWork = Callable[
    [AsyncEnginePort, "_Request", RowRequest[RowMedia], int, asyncio.Event | None], Awaitable[_T]
]
_SETTLE_ROUNDS = 3
_SETTLE_BOUND_S = 5.0

StreamItem = tuple[int, dict[str, torch.Tensor] | GenworkerError]
"""What ``generate_async`` yields: a row index and its output, or why it failed."""


#: An :class:`AsyncEngineFactory` that hands the worker an engine already running.
ExistingAsyncEngine = ExistingEngineFactory[AsyncEnginePort]


def _default_factory() -> AsyncEngineFactory:
    from genworker.shell.async_engine import AsyncVllmEngineFactory

    return AsyncVllmEngineFactory()


@attrs.frozen
class RowResult:
    """One finished row: its generation and the version of each of its tokens."""

    generation: Generation
    versions: VersionRuns


@attrs.define(eq=False)
class _Request:
    """One engine request of a stream."""

    row: int
    request_id: str
    #: why the worker ended it early (the row's error instead of "aborted by the engine")
    abort_reason: GenworkerError | None = None
    #: the versions of the tokens seen up to the last refit (engines without labels)
    runs: VersionRuns = attrs.Factory(lambda: VersionRuns((), (), 0))
    #: how many tokens the engine reported so far (engines without labels)
    seen: int = 0


# What a row without room gets: its prompt back, no tokens (as the sync worker's rows).
_NO_ROOM = RowResult(Generation((), (), "abort"), VersionRuns((), (), 0))


def _prefilled(
    ready: asyncio.Event, progress: Callable[[int], None] | None
) -> Callable[[int], None]:
    """``progress``, which also sets ``ready`` at the leader's first token (its prompt is
    in the prefix cache from then on)."""

    def seen(count: int) -> None:
        if count:
            ready.set()
        if progress is not None:
            progress(count)

    return seen


def _for_row(error: GenworkerError, row: int) -> GenworkerError:
    """``error`` with the row named (same type and detail, chained)."""
    try:
        named = type(error)(f"row {row}: {error}", detail=error.detail)
    except TypeError:  # a subclass with its own constructor
        named = GenworkerError(f"row {row}: {error}", detail=error.detail)
    named.__cause__ = error
    return named


async def _every_row(stream: AsyncGenerator[tuple[int, _T | GenworkerError], None]) -> list[_T]:
    """Every row of ``stream`` in row order; the first row that failed raises."""
    results: dict[int, _T] = {}
    async with contextlib.aclosing(stream) as rows:
        async for row, item in rows:
            if isinstance(item, GenworkerError):
                raise item
            results[row] = item
    return [results[row] for row in range(len(results))]


def _door(
    body: Callable[Concatenate[WorkerSpine[AsyncEnginePort], _P], Steps[_T]],
) -> Callable[Concatenate[AsyncVllmGenerationWorker, _P], Coroutine[object, object, _T]]:
    """The public coroutine method that drives the spine's ``body`` (its name and
    docstring ``body``'s, ``shell.spine.door_of``)."""

    async def door(self: AsyncVllmGenerationWorker, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return await self._drive(body(self, *args, **kwargs))

    return door_of(door, body)


class _MetricsLogger:
    """A daemon thread sampling :data:`LOGGER_METRICS` from the engine every ``interval``
    seconds (NeMo-RL's metrics logger); it stops at shutdown or at the first failed read
    (logged and kept in ``error``)."""

    def __init__(self, engine: AsyncEnginePort, interval: float) -> None:
        self._engine, self._interval = engine, interval
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = {v: [] for v in LOGGER_METRICS.values()}
        self._stop = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(
            target=self._run, name="genworker vllm metrics logger", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                metrics = self._engine.metrics()
            except Exception as e:  # noqa: BLE001 - the thread ends; the error is kept
                self.error = f"{type(e).__name__}: {e}"
                log.warning("the vLLM metrics logger stopped: %s", self.error)
                return
            sampled = logger_sample(metrics)
            with self._lock:
                for key, value in sampled.items():
                    self._samples[key].append(value)

    def samples(self) -> dict[str, list[float]]:
        with self._lock:
            return {k: list(v) for k, v in self._samples.items()}

    def clear(self) -> None:
        with self._lock:
            for v in self._samples.values():
                v.clear()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(max(self._interval, 1.0) + 5.0)


class AsyncVllmGenerationWorker(WorkerSpine[AsyncEnginePort]):
    """One ``AsyncLLM`` serving streamed rollouts, refit while it generates.

    The constructor is the sync worker's (``VllmGenerationWorker``); the config must say
    ``vllm_cfg.async_engine: true``.
    """

    _ASYNC_ENGINE = True
    _WRONG_ENGINE = (
        "vllm_cfg.async_engine is false: AsyncVllmGenerationWorker runs vLLM's "
        "AsyncLLM; set vllm_cfg.async_engine: true, or use VllmGenerationWorker"
    )

    def __init__(
        self,
        config: Mapping[str, object],
        bundle_indices: Sequence[int] | None = None,
        fraction_of_gpus: float = 1.0,
        seed: int | None = None,
        extra_env_vars: Sequence[str] | None = None,
        defer_model_load: bool = False,
        *,
        engine_factory: AsyncEngineFactory | None = None,
        stop_mode: StopMode | None = None,
    ) -> None:
        super().__init__(config, bundle_indices, fraction_of_gpus, seed, extra_env_vars, stop_mode)
        interval = metrics_logger_interval(self.cfg)
        self._logger_interval = unwrap(interval, BadConfigError, "")
        self._logger: _MetricsLogger | None = None
        self._factory = engine_factory
        self._label = 0  # the version counted rows' new tokens get (unlabelled engines)
        self._labelled = False  # the engine labels its weights with our version
        self._streams = 0
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._id_prefix = f"gw-{secrets.token_hex(4)}"
        self._activity = 0  # tokens counted; the settle after a pause watches it
        #: vLLM's OpenAI server (vllm_cfg.expose_http_server); its socket is bound now,
        #: before the engine loads
        self._http: OpenAIServer | None = self._bind_http_server()
        if not defer_model_load:
            self.load_model()

    # -- construction -----------------------------------------------------------------
    def load_model(self) -> None:
        """Start the engine (the deferred half of ``__init__``); needs no event loop. A
        refused engine is dropped (``AsyncLLM.__del__`` shuts it down: nothing here may
        await)."""
        engine = self._start(self._factory or _default_factory(), lambda e: None)
        self._loaded(engine)
        if self._logger_interval is not None:
            self._logger = _MetricsLogger(engine, self._logger_interval)

    def num_unfinished(self) -> int:
        """Requests the engine has not finished (running, waiting or paused)."""
        return self.engine.num_unfinished()

    # -- streams ----------------------------------------------------------------------
    def _open_stream(self) -> None:
        self._state = self._move(lifecycle.Event.STREAM_OPEN)
        self._streams += 1

    def _close_stream(self) -> None:
        self._streams -= 1
        if self._streams == 0 and self._state.streaming:
            self._commit(lifecycle.Event.STREAMS_DONE, "streams_done")

    @contextlib.asynccontextmanager
    async def in_flight(self) -> AsyncIterator[AsyncEnginePort]:
        """Requests the caller submits to the engine itself (e.g. an HTTP server around
        ``worker.llm``) count as a stream while inside: sleeping and prefix-cache resets are
        refused meanwhile, and the engine's weights are labelled with this worker's
        version. A refit that fails aborts only the worker's own requests: abort yours
        when ``update_weights_*`` raises."""
        self._open_stream()
        try:
            engine = self.engine
            await self._ensure_labelled(engine)
            yield engine
        finally:
            self._close_stream()

    def _new_request(self, row: int) -> _Request:
        request = _Request(row, f"{self._id_prefix}-{next(self._ids)}")
        self._requests[request.request_id] = request
        return request

    def _progress(
        self, caps: EngineCapabilities, request: _Request
    ) -> Callable[[int], None] | None:
        """Counts a row's tokens (engines without labels): once per engine step and
        row, so it only stores the count; a refit gives the tokens seen before it the
        old version (:meth:`_close_runs`), the row's end the rest the running one."""
        if caps.weight_versions:
            return None

        def seen(count: int) -> None:
            if count > request.seen:
                request.seen = count
                self._activity += 1

        return seen

    def _close_runs(self) -> None:
        """Before the running version changes (the engine paused, its tokens counted):
        every row's tokens seen so far were sampled under the old version."""
        for request in self._requests.values():
            request.runs = unwrap(
                extend_runs(request.runs, self._label, request.seen - request.runs.length),
                EngineContractError,
                f"row {request.row} versions",
            )

    async def _ensure_labelled(self, engine: AsyncEnginePort) -> None:
        """Label the engine's weights with our version before the first request."""
        if engine.capabilities.weight_versions and not self._labelled:
            await engine.label_weights(str(self._version))
            self._labelled = True

    async def _row_task(
        self,
        request: _Request,
        work: Callable[[], Awaitable[_T]],
        results: asyncio.Queue[tuple[int, _T | GenworkerError]],
        group: tuple[asyncio.Event | None, asyncio.Event | None] = (None, None),
    ) -> None:
        """One row's request (``work``: the engine call), its result or typed error put on
        ``results``; ``group``: (the leader's prefill to wait for, a sibling; the event to
        set once this leader's prefill is done, a leader of a group)."""
        item: _T | GenworkerError
        after, ready = group
        try:
            if after is not None:  # a sibling: admitted after its leader's prefill
                await after.wait()
            item = await work()
        except Exception as e:  # noqa: BLE001 - typed for the row, a foreign error too
            item = request.abort_reason or self._row_error(e, request.row)
        finally:
            if ready is not None:
                ready.set()  # the leader ended (or failed): its siblings go anyway
        results.put_nowait((request.row, item))

    def _row_error(self, error: Exception, row: int) -> GenworkerError:
        """What a row's engine call raised, typed and naming the row (a foreign error the
        adapter let through as the row's ``GenworkerError``); a dead engine noted."""
        if isinstance(error, EngineDeadError):
            self._died(error)
        if isinstance(error, EngineContractError) and isinstance(error.detail, NonFiniteLogprobs):
            tally_nonfinite(self.nonfinite_logprobs, Failure(error.detail))  # the engine checked
        if isinstance(error, GenworkerError):
            return _for_row(error, row)
        typed = GenworkerError(f"{type(error).__name__}: {error}")
        typed.__cause__ = error
        return _for_row(typed, row)

    async def _generated(
        self,
        engine: AsyncEnginePort,
        request: _Request,
        call: RowRequest[RowMedia],
        context: int,
        ready: asyncio.Event | None,
    ) -> RowResult | GenworkerError:
        """One row generated (``ready``: set at a leader's first token) and checked."""
        progress = self._progress(engine.capabilities, request)
        if ready is not None:
            progress = _prefilled(ready, progress)
        streamed = await engine.generate(call, progress)
        return self._finished(engine.capabilities, request, (len(call.prompt), context), streamed)

    def _finished(
        self,
        caps: EngineCapabilities,
        request: _Request,
        lengths: tuple[int, int],
        streamed: StreamedGeneration,
    ) -> RowResult | GenworkerError:
        """A finished row checked (``lengths``: its prompt's, and what it holds in the
        context): aborted, non-finite logprobs (G11, as the sync worker), past the
        context, its weight versions (``core.versions.finished_runs``), its routes."""
        generation, row = streamed.generation, request.row
        if generation.finish_reason == "abort":
            aborted = RequestAbortedError(f"row {row}: the engine aborted the request")
            return request.abort_reason or aborted
        checked = check_generation_logprobs(generation, caps.logprobs_mode, row=row)
        tally_nonfinite(self.nonfinite_logprobs, checked)
        counted = None if caps.weight_versions else Counted(request.runs, request.seen, self._label)
        runs = finished_row(
            generation,
            checked,
            lengths,
            row=row,
            max_model_len=caps.max_model_len,
            spans=streamed.version_spans,
            counted=counted,
        )
        if isinstance(runs, Failure):
            return EngineContractError(runs.failure().message, detail=runs.failure().cause)
        return RowResult(generation, runs.unwrap())

    async def _stream(
        self, plan: BatchPlan, groups: GroupPlan | None, no_room: _T, work: _RowWork[_T]
    ) -> AsyncGenerator[tuple[int, _T | GenworkerError], None]:
        """The plan's refused rows, those without room (``no_room``), then each request's
        result as it finishes (``work``: the row's engine call, :meth:`_generated` or
        :meth:`_text_row`). With ``groups`` (token rows) the engine's weights are labelled
        first and a group's siblings are sent once their leader's prefill is done
        (``core.groups``: PREFIX)."""
        self._open_stream()
        requests: list[_Request] = []
        tasks: list[asyncio.Task[None]] = []
        try:
            for row, error in plan.errors:
                yield row, error
            for row in plan.requests.no_room:
                yield row, no_room
            if not (rows := plan.requests.requests()):
                return
            engine = self.engine
            if groups is not None:
                await self._ensure_labelled(engine)
            results: asyncio.Queue[tuple[int, _T | GenworkerError]] = asyncio.Queue()
            spec_of = dict(rows)
            prefix_caching = engine.capabilities.prefix_caching
            for run in admission_runs(list(spec_of), groups, prefix_caching):
                prefilled = asyncio.Event() if len(run) > 1 else None
                for i, row in enumerate(run):
                    request = self._new_request(row)
                    requests.append(request)
                    prompt, media = plan.prompts[row], plan.media.get(row)
                    call = RowRequest(request.request_id, prompt, spec_of[row], media)
                    ready = prefilled if i == 0 else None
                    gate = (None, prefilled) if i == 0 else (prefilled, None)
                    args = (engine, request, call, plan.context[row], ready)
                    task = self._row_task(request, functools.partial(work, *args), results, gate)
                    tasks.append(asyncio.ensure_future(task))
            for _ in tasks:
                yield await results.get()
        finally:
            await self._drop(requests, tasks)
            self._close_stream()

    async def _text_row(
        self,
        engine: AsyncEnginePort,
        request: _Request,
        call: RowRequest[RowMedia],
        context: int,
        ready: asyncio.Event | None,
    ) -> str:
        return await engine.generate_text(call)

    async def _drop(
        self, requests: Sequence[_Request], tasks: Sequence[asyncio.Task[object]]
    ) -> None:
        """End a stream: cancel what runs (vLLM aborts those requests), abort them by id."""
        live = [(r, t) for r, t in zip(requests, tasks, strict=True) if not t.done()]
        for _, task in live:
            task.cancel()
        try:
            if live:
                await asyncio.gather(*(t for _, t in live), return_exceptions=True)
                if self._engine is not None and self._dead is None:
                    await self._engine.abort([r.request_id for r, _ in live])
        except EngineDeadError as e:
            self._died(e)
        finally:
            for request in requests:
                self._requests.pop(request.request_id, None)

    # -- generation -------------------------------------------------------------------
    def _token_plan(
        self, data: Mapping[str, object], greedy: bool, *, whole: bool
    ) -> tuple[torch.Tensor, torch.Tensor, BatchPlan, GroupPlan]:
        """Check the lifecycle, then the spine's plan and groups; ``whole``: a bad row
        refuses the batch."""
        self._move(lifecycle.Event.STREAM_OPEN)
        input_ids, input_lengths, plan = self._token_batch(data, greedy, whole=whole)
        return input_ids, input_lengths, plan, self._groups(data, plan)

    async def generate_async(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> AsyncGenerator[StreamItem, None]:
        """Rows as they finish: ``(row, output)``, or ``(row, error)`` for a row that
        cannot generate or failed (see the module docstring)."""
        input_ids, input_lengths, plan, groups = self._token_plan(data, greedy, whole=False)
        pad = self.cfg.pad_token_id
        async with contextlib.aclosing(
            self._stream(plan, groups, _NO_ROOM, self._generated)
        ) as rows:
            async for row, item in rows:
                if isinstance(item, GenworkerError):
                    yield row, item
                    continue
                out = versioned_row(
                    input_ids, input_lengths, row, item.generation, item.versions, pad
                )
                yield row, out

    async def generate(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> dict[str, torch.Tensor]:
        """The whole batch at once, in ``VllmGenerationWorker.generate``'s contract plus
        ``weight_versions`` (B, W) int64 (the version of each generated token at its
        position, -1 elsewhere). A bad row refuses the batch; a row that fails raises."""
        input_ids, input_lengths, plan, groups = self._token_plan(data, greedy, whole=True)
        ordered = await _every_row(self._stream(plan, groups, _NO_ROOM, self._generated))
        made, versions = [r.generation for r in ordered], [r.versions for r in ordered]
        return versioned_outputs(input_ids, input_lengths, made, versions, self.cfg.pad_token_id)

    async def compute_logprobs(
        self, data: Mapping[str, object], top_k: int = 0
    ) -> dict[str, torch.Tensor]:
        """``VllmGenerationWorker.compute_logprobs``: the logprobs of given sequences, one
        request per row, all at once (bad rows refused, each named with its reason)."""
        self._move(lifecycle.Event.STREAM_OPEN)
        plan = self._score_plan(data, top_k)
        self._open_stream()
        requests: list[_Request] = []
        tasks: list[asyncio.Task[ScoredRow]] = []
        try:
            engine = self.engine
            for row, (sequence, start) in enumerate(
                zip(plan.sequences, plan.prompt_lengths, strict=True)
            ):
                request = self._new_request(row)
                requests.append(request)
                call = engine.compute_logprobs(request.request_id, sequence, start, plan.top_k)
                tasks.append(asyncio.ensure_future(call))
            scored = list(await asyncio.gather(*tasks))
        except EngineDeadError as e:
            self._died(e)
            raise
        finally:
            await self._drop(requests, tasks)
            self._close_stream()
        return assemble_scores(plan, scored, self.cfg.pad_token_id)

    def _text_plan(self, data: Mapping[str, object], greedy: bool) -> BatchPlan:
        """Check the lifecycle, then the spine's plan; a bad prompt is refused alone."""
        self._move(lifecycle.Event.STREAM_OPEN)
        return self._text_batch(data, greedy, whole=False)

    async def generate_text_async(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> AsyncGenerator[tuple[int, dict[str, list[str]] | GenworkerError], None]:
        """Texts as they finish: ``(row, {"texts": [text]})`` or ``(row, error)``."""
        plan = self._text_plan(data, greedy)
        async with contextlib.aclosing(self._stream(plan, None, "", self._text_row)) as rows:
            async for row, item in rows:
                yield row, item if isinstance(item, GenworkerError) else {"texts": [item]}

    async def generate_text(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> dict[str, list[str]]:
        """Every text at once, in prompt order (``{"texts": [...]}``); a failed row raises."""
        plan = self._text_plan(data, greedy)
        if plan.errors:
            raise plan.errors[0][1]
        return {"texts": await _every_row(self._stream(plan, None, "", self._text_row))}

    # -- the operations both workers share (their bodies: WorkerSpine, shell.spine) -----
    sleep = _door(WorkerSpine._sleep)
    wake_up = _door(WorkerSpine._wake_up)
    reset_prefix_cache = _door(WorkerSpine._reset_prefix_cache)
    prepare_refit_info = _door(WorkerSpine._prepare_refit_info)
    init_collective = _door(WorkerSpine._init_collective)
    init_collective_via = _door(WorkerSpine._init_collective_via)
    engine_param_layout = _door(WorkerSpine._engine_param_layout)
    refit_address = _door(WorkerSpine._refit_address)
    release_refit_buffers = _door(WorkerSpine._release_refit_buffers)
    prepare_lora = _door(WorkerSpine._prepare_lora)
    call_engine_workers = _door(WorkerSpine._call_engine_workers)
    report_device_id = _door(WorkerSpine._report_device_id)
    get_counters = _door(WorkerSpine._get_counters)

    async def _drive(self, steps: Steps[_T]) -> _T:
        """Make the engine calls a spine body yields (awaiting what the port returns to
        await): the result sent back into the body, a failure thrown in (a dead engine
        noted first); the body's value."""
        drive = Drive(steps)
        call = drive.send(None)
        while call is not None:
            try:
                result = self._settle() if call.method == "settle" else call.on(self.engine)
                if isinstance(result, Awaitable):
                    result = await asyncio.wait_for(result, call.bound)
            except BaseException as e:  # noqa: BLE001 - the body raises it (or its own)
                if isinstance(e, EngineDeadError):
                    self._died(e)
                call = drive.throw(e)
            else:
                call = drive.send(result)
        return drive.result

    async def _rpc(self, method: str, *args: object, timeout: float | None = 120.0) -> list[object]:
        """``method(*args)`` on every engine worker (``WorkerSpine._rpc_steps``)."""
        return await self._drive(self._rpc_steps(method, *args, timeout=timeout))

    # -- refit ------------------------------------------------------------------------
    # The refit's body is the spine's (WorkerSpine._refit), its in-flight steps among them.
    async def update_weights_via_ipc_zmq(
        self,
        timeout_s: float | None = None,
        *,
        mode: InflightMode | str = InflightMode.KEEP,
        clear_cache: bool = True,
    ) -> bool:
        """Receive a refit over IPC while requests run (see the module docstring)."""
        return await self.refit_via(
            "update_weights_via_ipc_zmq",
            timeout_s,
            Transport.IPC,
            mode=mode,
            clear_cache=clear_cache,
        )

    async def update_weights_from_collective(
        self,
        timeout_s: float | None = None,
        *,
        mode: InflightMode | str = InflightMode.KEEP,
        clear_cache: bool = True,
    ) -> bool:
        """Receive a refit over the weight-update group while requests run."""
        method = "update_weights_from_collective"
        return await self.refit_via(
            method, timeout_s, Transport.COLLECTIVE, mode=mode, clear_cache=clear_cache
        )

    async def refit_via(
        self,
        method: str,
        timeout_s: float | None,
        transport: Transport,
        *,
        mode: InflightMode | str = InflightMode.KEEP,
        clear_cache: bool = True,
    ) -> bool:
        """An in-flight refit through another extension receiver ``method(timeout_s=)`` of
        ``transport`` (e.g. NeMo-RL's wire, ``nemo_rl_update_weights_via_ipc_zmq``): the
        built-in refits' checks, bounds, pause, version bump and resume around it."""
        refit = self._refit(method, timeout_s, transport, Inflight.of(mode, clear_cache))
        return await self._drive(refit)

    # -- vLLM's weight-transfer wire and pause (the server's RL routes, docs/server.md) ----
    async def pause_generation(self, mode: InflightMode | str, clear_cache: bool = True) -> None:
        """Pause generation as vLLM's ``/pause`` does (``abort``: the rows in flight end
        typed; ``wait``: they finish, nothing new starts; ``keep``: they freeze) until
        :meth:`resume_generation`."""
        pause = Inflight.of(mode, clear_cache)
        self._abort_in_flight(pause.mode, "a pause")
        await self.engine.pause(pause.mode, pause.clear_cache)

    async def resume_generation(self) -> None:
        """Resume what :meth:`pause_generation` paused."""
        await self.engine.resume()

    def sleeping(self) -> bool:
        """Whether any engine memory is asleep."""
        return not (self.state.weights_awake and self.state.kv_cache_awake)

    async def abort_requests(self, request_ids: Sequence[str]) -> int:
        """End HTTP generation requests in flight, as vLLM's ``/abort_requests``: no ids,
        every one (each answers typed); else the engine requests of those ids (vLLM's
        external ids: ``cmpl-<X-Request-Id>-<prompt index>`` for a completion,
        ``chatcmpl-<X-Request-Id>`` for a chat; an id not running is ignored, as vLLM
        does), which finish with reason ``abort`` and the tokens so far. The worker's
        own rows are not the server's to abort (refused, naming them). How many were
        aborted, or asked for by id."""
        if not request_ids:
            return 0 if self._http is None else self._http.abort_all("aborted by /abort_requests")
        if own := sorted(set(request_ids) & set(self._requests)):
            raise BadArgumentError(
                f"request_ids {own} are rows of the worker's own generate calls, not the "
                "server's: abort them through the worker"
            )
        await self.engine.abort(list(request_ids))
        return len(request_ids)

    async def init_weight_transfer(
        self, init_info: Mapping[str, object], timeout_s: float | None = None
    ) -> list[object]:
        """Join the trainer's group of vLLM's weight-transfer wire (``init_info`` as vLLM's
        ``/init_weight_transfer_engine`` takes it; the refit backend ``vllm_wire``); returns
        once every engine worker joined, each one's rank."""
        bounds = rendezvous_bounds(timeout_s)
        bound, outer = unwrap(bounds, BadArgumentError, "init_weight_transfer")
        return await self._rpc("refit_init", "vllm_wire", dict(init_info), bound, timeout=outer)

    async def update_weights_from_wire(
        self,
        update_info: Mapping[str, object],
        timeout_s: float | None = None,
        *,
        held: bool = False,
        mode: InflightMode | str = InflightMode.KEEP,
        clear_cache: bool = True,
    ) -> bool:
        """One update over vLLM's weight-transfer wire (``update_info``: names, dtype
        names, shapes, the tensors in broadcast order): a refit like every other, paused
        in ``mode`` around it unless the caller ``held`` the engine paused itself."""
        info = {"update_info": dict(update_info)}
        update = unwrap(control_plane.update_of(info), RefitManifestError, "update_info")
        refit = self._refit(
            "refit_receive",
            timeout_s,
            Transport.COLLECTIVE,
            Inflight.of(mode, clear_cache, held),
            args=("vllm_wire", dict(update_info)),
            manifest=update.manifest,
        )
        return await self._drive(refit)

    # -- adapter refits (docs/lora.md; the rules in the spine, as the sync worker's) ------
    async def update_lora(
        self,
        name: str,
        timeout_s: float | None = None,
        *,
        mode: InflightMode | str = InflightMode.KEEP,
        clear_cache: bool = True,
        transport: str = "ipc",
    ) -> bool:
        """An adapter refit while requests run (``WorkerSpine._update_lora``), paused as a
        full in-flight refit is (``mode``, ``clear_cache``)."""
        inflight = Inflight.of(mode, clear_cache)
        return await self._drive(self._update_lora(name, timeout_s, transport, inflight))

    def _lora_ok(self, name: str, reports: list[object], resets: Mapping[str, float]) -> None:
        super()._lora_ok(name, reports, resets)
        if self._http is not None:
            self._http.serve_adapter(name, self.lora_adapters[name])

    def _relabel(self) -> Steps[None]:
        """The weight version changed: the engine's weights labelled with it (where it
        labels tokens), the tokens counted so far closed under the old one."""
        if self.caps.weight_versions:
            yield EngineCall("label_weights", (str(self._version),))
            self._labelled = True
        self._close_runs()
        self._label = self._version

    def _mark_in_flight(
        self, why: Callable[[int], GenworkerError], server: str | None = None
    ) -> list[str]:
        for request in self._requests.values():
            if request.abort_reason is None:
                request.abort_reason = why(request.row)
        if server is not None and self._http is not None:
            self._http.abort_all(server)
        return list(self._requests)

    async def _settle(self) -> None:
        """Wait until the tokens sampled before the pause have all been counted (engines
        that do not label tokens): a few loop turns in which no row saw new tokens."""
        quiet, last = 0, self._activity
        bound = time.monotonic() + _SETTLE_BOUND_S
        while quiet < _SETTLE_ROUNDS and time.monotonic() < bound:
            await asyncio.sleep(0.002)
            if self._activity == last:
                quiet += 1
            else:
                quiet, last = 0, self._activity

    # -- observability ----------------------------------------------------------------
    def get_vllm_logger_metrics(self) -> dict[str, list[float]]:
        """What the metrics logger (``vllm_cfg.enable_vllm_metrics_logger: true``) sampled
        every ``vllm_metrics_logger_interval`` seconds since the last clear, as NeMo-RL's
        async worker returns it: ``inflight_batch_sizes`` (running requests),
        ``num_pending_samples`` (waiting), ``kv_cache_usage_perc``, ``generation_tokens``
        (the running total). A logger that stopped on a failed read raises its error."""
        if self._logger is None:
            raise UnsupportedError(
                "get_vllm_logger_metrics: the metrics logger is off "
                "(vllm_cfg.enable_vllm_metrics_logger: true starts it)"
            )
        if self._logger.error is not None:
            raise EngineStateError(f"the vLLM metrics logger stopped: {self._logger.error}")
        return self._logger.samples()

    def clear_vllm_logger_metrics(self) -> None:
        """Drop what the metrics logger sampled so far (it keeps sampling)."""
        if self._logger is not None:
            self._logger.clear()

    async def shutdown(self) -> bool:
        """Abort what runs (each row comes back as EngineStateError), stop the engine;
        idempotent. The worker is unusable afterwards."""
        if self._http is not None:
            await self._http.stop()
        logger, self._logger = self._logger, None
        if logger is not None:
            logger.stop()
        engine = self._detach()
        if engine is None:
            return True
        ids = self._mark_in_flight(
            lambda row: EngineStateError(f"row {row}: the worker was shut down")
        )
        try:
            if ids and self._dead is None:
                await engine.abort(ids)
        except EngineDeadError as e:
            self._died(e)
        finally:
            await engine.shutdown()
        return True

    # -- the OpenAI server (vllm_cfg.expose_http_server; genworker.shell.server) -------
    def _bind_http_server(self) -> OpenAIServer | None:
        options = unwrap(server_options(self.cfg), BadConfigError, "HTTP server options")
        return None if options is None else OpenAIServer(options)

    @property
    def base_url(self) -> str | None:
        """Where vLLM's OpenAI server listens (``http://host:port/v1``); ``None`` when
        ``expose_http_server`` is off. Known from construction on (the socket is bound)."""
        return None if self._http is None else self._http.base_url

    async def start_http_server(self) -> str:
        """Serve vLLM's OpenAI app around this worker's engine on the running loop (the
        worker's loop); idempotent. Returns ``base_url``."""
        if self._http is None:
            raise EngineStateError(
                "start_http_server: vllm_cfg.expose_http_server is not true in the config"
            )
        if not self._http.serving:
            self._move(lifecycle.Event.STREAM_OPEN)
            await self._http.start(
                self.llm,
                self,
                policy=training_policy(self.cfg) if self._http.options.on_policy_guard else None,
                max_new_tokens=self.cfg.max_new_tokens,
                cap_to_context=self.cfg.vllm.cap_max_tokens_to_context,
                num_speculative_tokens=self.engine.capabilities.num_speculative_tokens,
                captures_routes=self.engine.capabilities.routes is not None,
                control=self,
            )
        return self._http.base_url

    async def post_init_async(self) -> None:
        """NeMo-RL's post-init hook for async workers: starts the HTTP server when the
        config exposes one."""
        if self._http is not None:
            await self.start_http_server()

    async def report_dp_openai_server_base_url(self) -> str | None:
        """NeMo-RL's name for ``base_url``; starts the server first when it is not yet."""
        if self._http is None:
            return None
        return await self.start_http_server()
