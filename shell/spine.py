"""The worker spine: what the sync and the async worker do alike, written once.

Theory of operation
-------------------
vLLM's ``LLMEngine`` and ``AsyncLLM`` are two drive loops over the same
``InputProcessor`` / ``OutputProcessor``; httpcore generates ``_sync/`` from ``_async/``.
Here :class:`WorkerSpine` is the shared body and the two workers are its drive loops:
``shell.worker.VllmGenerationWorker`` runs a batch through one blocking engine call,
``shell.async_worker.AsyncVllmGenerationWorker`` runs each row as its own request and
refits while they run.

Each operation both workers offer (sleep, wake_up, reset_prefix_cache, the refits and
their setup calls, prepare_lora, the RPCs, the counters) is written once here as a
sans-I/O body, as h11 and h2 are: a generator method (``_sleep``, ``_refit``, ...) that
takes every decision and yields the engine calls it needs as :class:`EngineCall` values;
the drive loop makes each call on its port (``shell.ports``: the sync port returns values,
the async port awaitables, under the same names) and sends the result back, or throws in
what the call raised. A refit given an :class:`Inflight` value (the async worker's) also
yields the in-flight steps: pause, settle, label the weights, resume. Each worker has one
drive loop (``_drive``) and makes its public methods from the bodies (``_door``: the sync
one under the worker's lock, the async one a coroutine; :func:`door_of` names and
documents them as the body).

The spine also holds what the workers' own paths share: the config and constructor
arguments; engine start (:meth:`_start`, :class:`ExistingEngineFactory`) and death
(:meth:`_died`: a dead engine refuses every later call); lifecycle moves over
``core.lifecycle.TABLE`` (:meth:`_move` checks, :meth:`_commit` commits); the request plan
(:meth:`_token_batch`, :meth:`_text_batch`: the checks, media, then ``core.requests``);
the refit preamble (:meth:`_refit_bounds`), its failure (:meth:`_refit_failed`),
``last_refit`` and the weight version; and the RPC error map (:meth:`_rpc_steps`:
``RefitError`` only for refit methods, ``EngineRpcError`` for the rest). What is kept
apart on purpose, and where the two workers differed before the spine: ``docs/workers.md``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Generic, Literal, NoReturn, TypeVar

import attrs
import torch
from returns.result import Failure, Result

from genworker.core import lifecycle
from genworker.core.batch import batch_tensors
from genworker.core.config import WorkerConfig
from genworker.core.counters import MetricSample, encode_snapshot, worker_counters
from genworker.core.engine_calls import Cache, RpcCall, is_refit_method
from genworker.core.engine_plan import plan_engine_kwargs
from genworker.core.groups import DECLARED_GROUPS, GroupPlan, batch_groups
from genworker.core.joins import GroupJoin, JoinError, group_join
from genworker.core.lifecycle import InflightMode
from genworker.core.lora import lora_update, served_adapter_id
from genworker.core.outputs import NonFiniteCounts, NonFiniteLogprobs, nonfinite_seen
from genworker.core.placement import RAY_EXTRA_ENV_VARS, env_names, forwarded_env_names
from genworker.core.refit_plan import Manifest
from genworker.core.refit_protocol import (
    Transport,
    inflight_seconds,
    refit_report,
    refit_waits,
    rpc_bound,
    wait_bound,
)
from genworker.core.requests import (
    PlanError,
    RequestPlan,
    check_greedy,
    check_text_prompts,
    plan_batch,
    text_refusals,
)
from genworker.core.routing import CapturePlatform
from genworker.core.rows import check_prompts
from genworker.core.sampling import check_stop_token_ids
from genworker.core.scoring import ScorePlan, plan_scores
from genworker.core.stops import StopMode
from genworker.shell.errors import (
    ENGINE_RPC,
    REFIT_RPC,
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineContractError,
    EngineDeadError,
    EngineStateError,
    GenworkerError,
    RefitError,
    RefitManifestError,
    RefitTimeoutError,
    RequestAbortedError,
    UnsupportedError,
    translated,
    unwrap,
)
from genworker.shell.media import RowMedia, media_rows, row_media
from genworker.shell.ports import EngineBasePort, EngineCapabilities, EngineFactoryBase
from genworker.shell.refit.wire import raise_failures

__all__ = [
    "EXTENSION_CLS",
    "BatchPlan",
    "Drive",
    "EngineCall",
    "ExistingEngineFactory",
    "Inflight",
    "Steps",
    "WorkerSpine",
    "checked_env_names",
    "checked_join",
    "door_of",
    "forward_env",
    "start_engine",
    "tally_nonfinite",
    "wake_event",
]

log = logging.getLogger("genworker.shell.worker")

EXTENSION_CLS = "genworker.shell.extension.WorkerExtension"

_E = TypeVar("_E", bound=EngineBasePort)
_T = TypeVar("_T")
_X = TypeVar("_X")
_F = TypeVar("_F", bound=Callable[..., object])
_Started_co = TypeVar("_Started_co", covariant=True)
#: What an engine's sleep or wake raises only before it touched its memory (EnginePort.sleep).
_REFUSALS = (BadArgumentError, EngineStateError, UnsupportedError)


class ExistingEngineFactory(Generic[_E]):
    """An engine factory that hands the worker an engine already running (both workers'
    ``ExistingEngine`` / ``ExistingAsyncEngine``: benchmarks and tests that compare the
    worker with raw calls on the same engine)."""

    def __init__(self, engine: _E) -> None:
        self.engine = engine

    def arg_names(self) -> frozenset[str] | None:
        return None

    def gpu_capability(self) -> tuple[int, int] | None:
        return None

    def capture_platform(self) -> CapturePlatform:
        return CapturePlatform(vllm_version=None, triton=False)  # the engine is already built

    def start(self, kwargs: Mapping[str, object]) -> _E:
        return self.engine


#: The engine-port methods a spine body asks for (both ports name them alike,
#: ``shell.ports``; the async port's return awaitables, but ``metrics``); the in-flight
#: refit's (``pause``, ``resume``, ``label_weights``, ``abort``) are the async port's only,
#: and ``settle`` is the async worker's own wait for the tokens sampled before a pause.
EngineMethod = Literal[
    "sleep",
    "wake_up",
    "reset_cache",
    "collective_rpc",
    "device_ids",
    "metrics",
    "pause",
    "resume",
    "label_weights",
    "abort",
    "settle",
]


@attrs.frozen
class EngineCall:
    """One engine-port call a spine body yields to its drive loop (sans-I/O, as h11's
    events): the port method's name and its arguments. The drive loop makes it and sends
    the result back into the body, or throws in what the call raised; ``bound``: the
    seconds the drive loop waits for an awaited call (TimeoutError past them)."""

    method: EngineMethod
    args: tuple[object, ...] = ()
    bound: float | None = None

    def on(self, engine: object) -> object:
        """The call made on ``engine`` (the async port's result is to await)."""
        method: Callable[..., object] = getattr(engine, self.method)
        return method(*self.args)


#: A spine body: the engine calls it needs, each answered by the drive loop, and its value.
Steps = Generator[EngineCall, object, _T]

#: each cache's reset (the names :meth:`WorkerSpine._reset_caches` resets)
_RESETS = {cache.value: EngineCall("reset_cache", (cache,)) for cache in Cache}


@attrs.frozen
class Inflight:
    """How a refit runs while requests do (the async worker's; the sync worker refits
    between batches): paused in ``mode``, the pause clearing the caches or not, unless
    the caller ``held`` the engine paused itself."""

    mode: InflightMode
    clear_cache: bool
    held: bool = False

    @classmethod
    def of(cls, mode: object, clear_cache: object, held: bool = False) -> Inflight:
        """``mode`` and ``clear_cache`` checked (BadArgumentError)."""
        return cls(*unwrap(lifecycle.pause_args(mode, clear_cache), BadArgumentError, ""), held)


class Drive(Generic[_T]):
    """A spine body run by a drive loop: :meth:`send` and :meth:`throw` answer the last
    engine call and return the next one, or None once the body returned :attr:`result`."""

    result: _T

    def __init__(self, steps: Steps[_T]) -> None:
        self._steps = self._run(steps)

    def _run(self, steps: Steps[_T]) -> Generator[EngineCall, object, None]:
        self.result = yield from steps

    def send(self, value: object) -> EngineCall | None:
        try:
            return self._steps.send(value)
        except StopIteration:
            return None

    def throw(self, error: BaseException) -> EngineCall | None:
        try:
            return self._steps.throw(error)
        except StopIteration:
            return None


def door_of(door: _F, body: Callable[..., object]) -> _F:
    """``door``, a worker's public method that drives the spine's ``body``, named and
    documented as ``body`` without its underscore (``WorkerSpine._sleep``: ``sleep``), with
    its signature. Not ``__wrapped__``: Ray unwraps an actor's methods and would take a
    door onto a generator body for a streaming method (``ray/actor.py``, 2.x)."""
    functools.update_wrapper(door, body)
    del door.__wrapped__  # type: ignore[attr-defined]
    door.__signature__ = inspect.signature(body)  # type: ignore[attr-defined]
    door.__name__ = body.__name__.removeprefix("_")
    return door


def forward_env(names: Iterable[str]) -> None:
    """Have vLLM's Ray executor copy these variables into its engine workers
    (``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY``); an in-process engine inherits them anyway."""
    names = list(names)
    if names:
        existing = os.environ.get(RAY_EXTRA_ENV_VARS, "")
        os.environ[RAY_EXTRA_ENV_VARS] = forwarded_env_names(existing, names)


def start_engine(
    factory: EngineFactoryBase[_Started_co],
    cfg: WorkerConfig,
    seed: int,
    extra_env_vars: Sequence[str],
) -> _Started_co:
    """Plan the engine's arguments for this GPU and the installed vLLM (a dropped one is
    logged), export the environment they need, and start the engine."""
    capability = factory.gpu_capability()
    plan = unwrap(
        plan_engine_kwargs(
            cfg,
            seed=seed,
            gpu_capability=capability,
            known_args=factory.arg_names(),
            extension_cls=EXTENSION_CLS,
            enable_sleep_mode=capability is not None,
            telemetry={k: v for k, v in os.environ.items() if k.startswith("OTEL_")},
            capture=factory.capture_platform(),
        ),
        BadConfigError,
        "engine arguments",
    )
    if plan.dropped:
        log.warning("engine arguments the installed vLLM lacks, dropped: %s", plan.dropped)
    os.environ.update(plan.env)  # e.g. the OTLP traces protocol, which vLLM reads from env
    forward_env([*cfg.vllm.env_vars, *extra_env_vars])
    return factory.start(plan.llm_kwargs())


def checked_env_names(names: Sequence[str] | None) -> tuple[str, ...]:
    """``extra_env_vars`` as a tuple of variable names, or BadArgumentError."""
    return unwrap(env_names(names), BadArgumentError, "")


def wake_event(tags: Sequence[str] | None) -> lifecycle.Event:
    """The lifecycle event of ``wake_up(tags)``, or BadArgumentError naming the tags."""
    return unwrap(lifecycle.wake_event(tags), BadArgumentError, "")


def tally_nonfinite(
    tally: dict[str, int], checked: Result[NonFiniteCounts, NonFiniteLogprobs]
) -> None:
    """Add the non-finite logprobs ``check_logprobs`` saw, refused or not."""
    for kind, count in nonfinite_seen(checked).by_kind().items():
        tally[kind] += count


def checked_join(join: Result[GroupJoin, JoinError]) -> GroupJoin:
    """A public ``init_collective``'s join (``core.joins.group_join`` of its arguments),
    or the BadArgumentError that names the bad one."""
    return unwrap(join, BadArgumentError, "init_collective")


@attrs.frozen
class BatchPlan:
    """A checked batch of ``batch_size`` rows: the engine prompt of each row that passed
    the checks (a prompt text's ids where NeMo-RL's ``vllm_content`` gave one), what it
    holds in the context, the rows' images, the request plan of those rows, and why each
    other row cannot generate (empty when the batch is refused whole)."""

    batch_size: int
    prompts: Mapping[int, Sequence[int]]
    context: Mapping[int, int]
    media: Mapping[int, RowMedia]
    requests: RequestPlan
    errors: tuple[tuple[int, GenworkerError], ...] = ()


class WorkerSpine(Generic[_E]):
    """The state and decisions both workers share (see the module docstring); ``_E`` is
    the engine port (``EnginePort`` or ``AsyncEnginePort``)."""

    #: vllm_cfg.async_engine this worker runs, and what to say when the config disagrees
    _ASYNC_ENGINE: bool
    _WRONG_ENGINE: str

    def __init__(
        self,
        config: Mapping[str, object],
        bundle_indices: Sequence[int] | None,
        fraction_of_gpus: float,
        seed: int | None,
        extra_env_vars: Sequence[str] | None,
        stop_mode: StopMode | None,
    ) -> None:
        self.cfg: WorkerConfig = unwrap(
            WorkerConfig.from_mapping(config), BadConfigError, "worker config"
        )
        if self.cfg.vllm.async_engine is not self._ASYNC_ENGINE:
            raise BadConfigError(self._WRONG_ENGINE)
        for warning in self.cfg.warnings:  # keys accepted under unknown_keys: warn
            log.warning("genworker ignores generation-config key %s", warning)
        self.bundle_indices = None if bundle_indices is None else tuple(bundle_indices)
        self.fraction_of_gpus = fraction_of_gpus
        self.seed = seed if seed is not None else (self.cfg.seed or 0)
        #: how a batch's stop strings spread over its rows: the argument, else the config's
        #: ``stop_strings_mode``
        self.stop_mode = self.cfg.stop_mode if stop_mode is None else stop_mode
        #: variables (names) vLLM's Ray workers inherit from this process, as NeMo-RL's
        #: ``extra_env_vars``; ``vllm_cfg.env_vars`` are exported and forwarded as well
        self.extra_env_vars = checked_env_names(extra_env_vars)
        self._engine: _E | None = None
        self._state = lifecycle.NOT_LOADED
        self._dead: str | None = None
        self._version = 0  # good refits so far (weight_version)
        self._manifest: Manifest | None = None  # from prepare_refit_info
        self._collective = False  # init_collective succeeded
        self._finite_check_off = False  # refit_configure told the engine workers
        self._caches = lifecycle.CacheLedger()  # known empty: resets skipped
        #: the last successful refit: each engine worker's report and the seconds of its
        #: steps (the sync worker: the RPC and each cache reset; the async worker: the
        #: pause, the RPC and the resume, its mode and version)
        self.last_refit: dict[str, object] = {}
        #: how many times each engine cache was reset (``get_counters`` reports them)
        self.cache_resets: dict[str, int] = {"prefix": 0, "mm": 0, "encoder": 0}
        #: non-finite logprobs seen in generated tokens, by kind (``get_counters``)
        self.nonfinite_logprobs: dict[str, int] = dict(NonFiniteCounts().by_kind())
        #: rows of the last plan refused for want of room (they come back unchanged)
        self.last_refused_rows: tuple[int, ...] = ()
        #: the LoRA adapters served (name -> lora_int_id; ``update_lora``) and the
        #: adapter manifest of ``prepare_lora``
        self.lora_adapters: dict[str, int] = {}
        self._lora_manifest: Manifest | None = None

    # -- engine start and death -------------------------------------------------------
    def _start(self, factory: EngineFactoryBase[_E], discard: Callable[[_E], None]) -> _E:
        """Start the engine and check the config against it (stop ids against its
        vocabulary, G6; the encoder-reset key against a multimodal engine); a refused one
        is handed to ``discard``. Commits nothing: :meth:`_loaded` does."""
        self._move(lifecycle.Event.LOAD)
        engine = start_engine(factory, self.cfg, self.seed, self.extra_env_vars)
        caps = engine.capabilities
        problem = self.cfg.vllm.encoder_reset_problem(multimodal=caps.multimodal)
        stops = check_stop_token_ids(self.cfg.stop_token_ids, caps.vocab_size)
        if problem is not None or isinstance(stops, Failure):
            discard(engine)
            if problem is not None:
                raise BadConfigError(problem)
            unwrap(stops, BadConfigError, "worker config")
        return engine

    def _loaded(self, engine: _E) -> None:
        self._engine = engine
        self._commit(lifecycle.Event.LOAD, "load_model")

    @property
    def engine(self) -> _E:
        if self._dead is not None:
            raise EngineDeadError(f"the engine died earlier ({self._dead}); re-create the worker")
        if self._engine is None:
            if self._shut_down:
                raise EngineStateError("the worker was shut down; create a new worker")
            raise EngineStateError("no engine: call load_model() first (defer_model_load=True)")
        return self._engine

    @property
    def caps(self) -> EngineCapabilities:
        """The running engine's capabilities."""
        return self.engine.capabilities

    @property
    def llm(self) -> object:
        """The underlying ``vllm.LLM`` / ``AsyncLLM`` (or the fake engine)."""
        engine = self.engine
        return getattr(engine, "llm", engine)

    def _died(self, error: EngineDeadError) -> None:
        """The engine is dead: every later call is refused with ``error``."""
        if self._dead is None:
            self._dead = str(error)
            log.error("the engine died: %s", error)

    def is_alive(self) -> bool:
        return self._engine is not None and self._dead is None and not self._shut_down

    @property
    def _shut_down(self) -> bool:
        return self._state.phase is lifecycle.Phase.SHUT_DOWN

    def _detach(self) -> _E | None:
        """Shutdown's first step (idempotent): the engine, let go, and the state moved."""
        engine, self._engine = self._engine, None
        self._commit(lifecycle.Event.SHUTDOWN, "shutdown")
        return engine

    # -- state --------------------------------------------------------------------------
    @property
    def state(self) -> lifecycle.State:
        return self._state

    @property
    def weight_version(self) -> int:
        """Good refits so far (0: the weights loaded): every ``generate`` output carries
        it as ``weight_versions``; a refit that fails leaves it alone."""
        return self._version

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={self.cfg.model_name!r}, seed={self.seed}, "
            f"state={self._state}, version={self._version}, alive={self.is_alive()})"
        )

    def _move(self, event: lifecycle.Event) -> lifecycle.State:
        """The state ``event`` leads to, or EngineStateError; does not commit it."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine died earlier ({self._dead}); re-create the worker")
        self._caches = self._caches.after(event)
        return unwrap(
            lifecycle.transition(self._state, event), EngineStateError, event.name.lower()
        )

    def _commit(self, event: lifecycle.Event, call: str) -> None:
        """Move the state by ``event`` from where it is now (EngineStateError if the table
        refuses it)."""
        self._state = unwrap(lifecycle.transition(self._state, event), EngineStateError, call)

    # -- the request plan ---------------------------------------------------------------
    def _token_batch(
        self, data: Mapping[str, object], greedy: bool, *, whole: bool
    ) -> tuple[torch.Tensor, torch.Tensor, BatchPlan]:
        """A right-padded batch checked and planned; ``whole``: a bad row refuses the
        batch (else it is set aside with its error, ``core.rows.check_rows``)."""
        unwrap(check_greedy(greedy), BadArgumentError, "")
        input_ids, input_lengths = unwrap(batch_tensors(data), BadBatchError, "generate")
        caps = self.caps
        checked = unwrap(
            check_prompts(
                input_ids,
                input_lengths,
                whole=whole,
                pad_token_id=self.cfg.pad_token_id,
                vocab_size=caps.vocab_size,
                max_model_len=caps.max_model_len,
            ),
            BadBatchError,
            "generate batch",
        )
        errors = tuple(
            (row, BadBatchError(f"row {row} cannot generate: {error}", detail=error))
            for row, error in checked.errors
        )
        batch_size = int(input_ids.shape[0])
        media = row_media(data, batch_size, "generate")
        plan = self._planned(data, batch_size, dict(checked.prompts), greedy, "generate", media)
        return input_ids, input_lengths, attrs.evolve(plan, errors=errors)

    def _text_batch(self, data: Mapping[str, object], greedy: bool, *, whole: bool) -> BatchPlan:
        """``generate_text``'s prompts checked, tokenized once (no second BOS) and
        planned; ``whole``: a bad prompt refuses the batch naming every such prompt."""
        unwrap(check_greedy(greedy), BadArgumentError, "")
        if not isinstance(data, Mapping):
            raise BadBatchError(f"generate_text: data must be a mapping, got {type(data).__name__}")
        checked = check_text_prompts(data.get("prompts"))
        if isinstance(checked, Failure):
            raise _batch_error(checked.failure())
        prompts = checked.unwrap()
        if not prompts:
            return BatchPlan(0, {}, {}, {}, RequestPlan((), ()))
        refused = text_refusals(prompts, None, 0)
        if whole and refused:
            raise BadBatchError(refused[0].message, detail=refused[0])
        media = row_media(data, len(prompts), "generate_text", texts=False)
        texts = [row for row, p in enumerate(prompts) if p]
        tokens = self.engine.tokenize([prompts[r] for r in texts]) if texts else []
        ids = dict(zip(texts, tokens, strict=True))
        limit = self.caps.max_model_len
        refused = text_refusals(prompts, {r: len(p) for r, p in ids.items()}, limit)
        if whole and refused:
            raise BadBatchError(refused[0].message, detail=refused[0])
        errors = {
            row: BadBatchError(refusal.row_message(row), detail=refusal)
            for refusal in refused
            for row in refusal.rows
        }
        kept: dict[int, Sequence[int]] = {r: p for r, p in ids.items() if r not in errors}
        plan = self._planned(data, len(prompts), kept, greedy, "generate_text", media, True)
        return attrs.evolve(plan, errors=tuple(sorted(errors.items())))

    def _planned(
        self,
        data: Mapping[str, object],
        batch_size: int,
        prompts: Mapping[int, Sequence[int]],
        greedy: bool,
        call: str,
        media: list[RowMedia | None] | None,
        text: bool = False,
    ) -> BatchPlan:
        """The media checks and the request plan of the rows in ``prompts``
        (``core.requests.plan_batch``; its rows without room noted and logged); a batch's
        own stop strings refused on an engine without a detokenizer (vLLM would skip them)."""
        if (problem := self.cfg.detokenizer_problem(data.get("stop_strings"))) is not None:
            raise BadBatchError(problem)
        engine = self.engine
        starts, context, images = media_rows(
            self.caps, batch_size, prompts, media, engine.tokenize, engine.expanded_lengths, call
        )
        rows = [(row, context[row]) for row in starts]
        served = self.lora_adapters
        planned = plan_batch(
            self.cfg, self.caps, data, batch_size, rows, greedy, text, self.stop_mode, served
        )
        if isinstance(planned, Failure):
            raise _batch_error(planned.failure())
        requests = planned.unwrap()
        self.last_refused_rows = requests.no_room
        if requests.refused is not None:
            log.warning("generating without the rows that have no room left: %s", requests.refused)
        return BatchPlan(batch_size, starts, context, images, requests)

    # -- groups and scoring (core.groups, core.scoring; docs/groups.md) -----------------
    def _groups(self, data: Mapping[str, object], plan: BatchPlan) -> GroupPlan:
        """The generating rows as groups: declared by ``data["num_generations_per_prompt"]``
        (NeMo-RL's layout) or recognised (equal prompts and specs but for the seed); a
        batch with media goes row by row."""
        requests = plan.requests.requests()
        rows = [row for row, _ in requests]
        groups = unwrap(
            batch_groups(
                rows,
                [plan.prompts[row] for row in rows],
                [spec for _, spec in requests],
                declared=data.get(DECLARED_GROUPS),
                batch_size=plan.batch_size,
                media=bool(plan.media),
            ),
            BadBatchError,
            "generate",
        )
        if groups.grouped and not self.caps.prefix_caching:
            log.info(
                "a batch of groups on an engine without prefix caching: each sample's prompt "
                "is prefilled again (set vllm_cfg.enable_prefix_caching: true, docs/groups.md)"
            )
        return groups

    def _score_plan(self, data: Mapping[str, object], top_k: object) -> ScorePlan:
        """``compute_logprobs``' call checked: a malformed one refused whole, bad rows
        refused naming each with its reason (``core.scoring.plan_scores``)."""
        if not isinstance(data, Mapping):
            raise BadBatchError(
                f"compute_logprobs: data must be a mapping, got {type(data).__name__}"
            )
        caps = self.caps
        plan, refused = unwrap(
            plan_scores(
                data.get("input_ids"),
                data.get("input_lengths"),
                data.get("prompt_lengths"),
                top_k,
                max_logprobs=caps.max_logprobs,
                max_model_len=caps.max_model_len,
                vocab_size=caps.vocab_size,
            ),
            BadArgumentError,
            "compute_logprobs",
        )
        if refused is not None:
            raise BadBatchError(refused.message, detail=refused)
        return plan

    # -- memory -------------------------------------------------------------------------
    def _require_sleep_mode(self, call: str) -> None:
        caps = self.caps
        if not caps.sleep_mode:
            raise UnsupportedError(
                f"{call}: sleep mode is unsupported on this platform ({caps.device})"
            )

    def _sleep(self, level: int | None = None) -> Steps[None]:
        """Free engine memory (refused while streams run): level 1 offloads the weights to
        host memory, level 2 discards them; the caches are reset first."""
        level = self.cfg.vllm.sleep_level if level is None else level
        next_state = self._move(unwrap(lifecycle.sleep_event(level), BadArgumentError, ""))
        self._require_sleep_mode("sleep")
        if next_state == self._state:  # already there
            return
        before, self._state = self._state, next_state  # new streams are refused from now
        try:
            yield from self._reset_caches()
            yield from self._memory_call(f"sleep(level={level})", EngineCall("sleep", (level,)))
        except BaseException:
            self._state = before  # the state moves only once the engine slept
            raise

    def _wake_up(self, tags: Sequence[str] | None = None) -> Steps[None]:
        """Wake ``weights``, ``kv_cache`` or both (``None``); waking an awake tag is a no-op."""
        event = wake_event(tags)
        next_state = self._move(event)
        self._require_sleep_mode("wake_up")
        # vLLM drops a whole wake_up(tags) when one tag is already awake: only the asleep ones
        if asleep := tuple(lifecycle.wake_tags(self._state, event)):
            call = f"wake_up(tags={list(asleep)})"
            fully = yield from self._memory_call(call, EngineCall("wake_up", (list(asleep),)))
            if (problem := lifecycle.wake_incomplete(call, fully, next_state)) is not None:
                dead = EngineDeadError(problem)
                self._died(dead)
                raise dead
        self._state = next_state

    def _memory_call(self, call: str, engine_call: EngineCall) -> Steps[object]:
        """The engine's sleep or wake ``call``. A typed refusal changed nothing (raised as
        it is); anything else leaves the memory part-mapped and the scheduler paused
        (S1/S2): the engine is dead, and the error is raised as EngineDeadError (an
        interrupt as itself)."""
        try:
            return (yield engine_call)
        except _REFUSALS:
            raise
        except EngineDeadError as e:
            self._died(e)
            raise
        except BaseException as e:
            dead = EngineDeadError(
                f"{call} failed: {type(e).__name__}: {e}; the engine's memory is left in an "
                "unknown state (part-mapped, its scheduler paused), so the engine is dead"
            )
            self._died(dead)
            if not isinstance(e, Exception):
                raise
            raise dead from e

    def _reset_prefix_cache(self) -> Steps[None]:
        """Drop the prefix cache (refused while streams run)."""
        self._state = self._move(lifecycle.Event.RESET_PREFIX_CACHE)
        yield _RESETS["prefix"]
        self.cache_resets["prefix"] += 1

    def _reset_caches(self, refit: str | None = None) -> Steps[dict[str, float]]:
        """The cache resets before a sleep or after the refit ``refit``; the seconds of each.

        The prefix cache and, on a multimodal engine, the processed-media and encoder
        caches (stale after a refit); none when they are known empty (``CacheLedger``: no
        request since the last reset, as the engine counts them in vLLM's
        ``LLM.request_counter``; without one, ``AsyncLLM``, the ledger alone). A reset the
        engine refuses raises its error; after a refit a RefitError (that cache may still
        serve what the old weights computed)."""
        counter = getattr(getattr(self.llm, "request_counter", None), "counter", None)
        requests = counter if isinstance(counter, int) else None
        seconds = {}
        if self._caches.needs_reset(requests):
            for name in ["prefix", "mm", "encoder"] if self.caps.multimodal else ["prefix"]:
                started = time.monotonic()
                try:
                    yield _RESETS[name]
                except EngineStateError as e:
                    if refit is None:
                        raise
                    raise RefitError(
                        f"{refit}: the new weights are in, but resetting the {Cache(name).label} "
                        f"failed ({e}), so it may still serve what the old weights computed; "
                        "the weights count as inconsistent until a refit succeeds"
                    ) from e
                seconds[name] = time.monotonic() - started
                self.cache_resets[name] += 1
        self._caches = self._caches.reset(requests)
        return seconds

    # -- refit --------------------------------------------------------------------------
    # Per refit, every wait (engine side and trainer side) is bounded by ``timeout_s``
    # (None: core.refit_protocol.DEFAULT_TIMEOUT_S); the engine call's own bound is
    # derived from it (core.refit_protocol.rpc_bound), so only a wedged call ever exceeds
    # it. A refit refused before it starts (no prepare_refit_info, a bad timeout_s, no
    # init_collective) changes nothing; one that fails, times out or is interrupted
    # leaves the weights inconsistent (generate refused) until a refit succeeds.
    def _refit_bounds(
        self, method: str, timeout_s: object, transport: Transport, own: Manifest | None = None
    ) -> tuple[float, float]:
        """The refit preamble: ``timeout_s`` checked (the one check of it), then what the
        refit needs; the per-wait bound and the RPC's outer bound. ``own``: the manifest
        of a wire that announces each refit (its backend checks its own group)."""
        bound = unwrap(wait_bound(timeout_s), BadArgumentError, method)
        if own is not None:
            return bound, rpc_bound(refit_waits(len(own), transport), bound)
        if transport is Transport.COLLECTIVE and not self._collective:
            raise EngineStateError(f"{method} needs init_collective first")
        if self._manifest is None:
            raise EngineStateError(f"{method} needs prepare_refit_info first")
        return bound, rpc_bound(refit_waits(len(self._manifest), transport), bound)

    @staticmethod
    def _manifest_of(state_dict_info: Mapping[str, tuple[Sequence[int], object]]) -> Manifest:
        return unwrap(Manifest.from_info(state_dict_info), RefitManifestError, "refit info")

    def _mark_refit_failed(self) -> None:
        """A refit that began failed: the weights are inconsistent (generation refused
        until a refit succeeds)."""
        self._state = lifecycle.transition(self._state, lifecycle.Event.REFIT_FAILED).value_or(
            self._state
        )

    def _refit_failed(self, method: str, error: BaseException) -> NoReturn:
        """:meth:`_mark_refit_failed`, and ``error`` raised typed (a foreign one as
        RefitError, an interrupt as itself)."""
        self._mark_refit_failed()
        if isinstance(error, GenworkerError) or not isinstance(error, Exception):
            raise error
        raise RefitError(f"{method} failed: {error}; weights are inconsistent") from error

    def _refit(
        self,
        method: str,
        timeout_s: object,
        transport: Transport,
        inflight: Inflight | None = None,
        *,
        args: tuple[object, ...] = (),
        manifest: Manifest | None = None,
    ) -> Steps[bool]:
        """A refit through the extension receiver ``method(*args, timeout_s=)`` of
        ``transport``: the preamble (a refit it refuses changes nothing), then
        :meth:`_run_refit`; ``manifest``: the refit's own (a wire that announces each)."""
        if inflight is not None and not inflight.clear_cache and self.caps.multimodal:
            raise BadArgumentError(
                f"{method}: clear_cache=False on a multimodal engine: after such a refit "
                "vLLM 0.32's engine core died at the next image request ('Encoder cache "
                "miss'); keep clear_cache=True"
            )
        bound, outer = self._refit_bounds(method, timeout_s, transport, manifest)
        yield from self._configure_finite_check()
        return (yield from self._run_refit(method, {"timeout_s": bound}, outer, inflight, args))

    def _configure_finite_check(self) -> Steps[None]:
        """``vllm_cfg.refit_finite_check: false`` told the engine workers once (they check
        unless told)."""
        if not self.cfg.vllm.refit_finite_check and not self._finite_check_off:
            yield from self._rpc_steps("refit_configure", False)
            self._finite_check_off = True

    def _run_refit(
        self,
        method: str,
        kwargs: Mapping[str, float],
        outer: float,
        inflight: Inflight | None = None,
        args: tuple[object, ...] = (),
    ) -> Steps[bool]:
        """The refit RPC ``method(*args, **kwargs)`` on every engine worker (bounded by
        ``outer``) through the lifecycle's refit states; the weights count as valid, one
        version newer, only when all succeeded. Between batches (the sync worker) the
        caches are reset after it (they would serve what the old weights computed). In
        flight (the async worker's module docstring) the engine pauses around it
        (:meth:`_pause`, within ``kwargs["timeout_s"]``), the tokens sampled before the
        pause are counted (``settle``) where the engine does not label them, and the new
        weights are labelled (:meth:`_relabel`) before it resumes."""
        self._state = self._move(lifecycle.Event.REFIT_BEGIN)
        paused_at = resumed_at = rpc_done = started = time.monotonic()
        try:
            if inflight is not None:
                yield from self._pause(method, inflight, kwargs["timeout_s"], "an in-flight refit")
            paused_at = time.monotonic()
            if inflight is not None and not self.caps.weight_versions:
                yield EngineCall("settle")
            results = yield EngineCall("collective_rpc", (RpcCall(method, args, kwargs, outer),))
            reports = raise_failures(_list_of(results, object, "collective_rpc"), method)
            rpc_done = time.monotonic()
            resets = (yield from self._reset_caches(method)) if inflight is None else {}
        except BaseException as e:  # noqa: BLE001 - re-raised typed by _refit_failed
            yield from self._after_failed_refit(method, e, inflight)
            self._refit_failed(method, e)
        self._version += 1
        yield from self._relabel()
        self._commit(lifecycle.Event.REFIT_OK, "refit")
        if inflight is not None and not inflight.held:
            yield EngineCall("resume")
        resumed_at = time.monotonic()
        fields: dict[str, object] = {"rpc_seconds": rpc_done - paused_at}
        if inflight is not None:
            fields |= {"mode": inflight.mode.value, "version": self._version}
            fields |= inflight_seconds(started, paused_at, rpc_done, resumed_at)
        self.last_refit = refit_report(reports, resets, **fields)
        return True

    def _pause(self, method: str, inflight: Inflight, bound: float, by: str) -> Steps[None]:
        """An in-flight refit's pause: mode ``abort`` ends every row in flight (aborted
        ``by`` it), then the engine pauses within ``bound`` unless the caller holds it."""
        self._abort_in_flight(inflight.mode, by)
        try:
            if not inflight.held:
                yield EngineCall("pause", (inflight.mode, inflight.clear_cache), bound)
        except TimeoutError as e:
            raise RefitTimeoutError(
                f"{method}: pausing the engine (mode {inflight.mode.value!r}) took over {bound:g} s"
            ) from e

    def _after_failed_refit(
        self, method: str, error: BaseException, inflight: Inflight | None = None
    ) -> Steps[None]:
        """A refused or failed refit: the weights inconsistent, and nothing computed under
        them reused (issue 44): the prefix cache reset, and the KV cache memory
        (``refit_reset_kv``) while it is awake; nothing on a dead engine. A reset that
        fails is noted on ``error`` (raised by the caller). In flight, every request in
        flight is aborted first with the refit's error as its row's reason, and the engine
        resumed after (unless its caller holds it paused); a dead engine ends that."""
        self._mark_refit_failed()
        if inflight is not None and isinstance(error, EngineDeadError):
            self._died(error)
        if self._dead is not None or isinstance(error, EngineDeadError):
            return
        why = (
            f"aborted: the in-flight refit ({method}) failed ({error}); the weights are "
            "inconsistent until a refit succeeds"
        )
        ids = self._mark_in_flight(lambda row: RefitError(f"row {row}: {why}"), why)
        passing = () if inflight is None else (EngineDeadError,)
        try:
            if ids:
                yield EngineCall("abort", (ids,))
            try:  # paused or between batches: nothing runs on the caches
                yield _RESETS["prefix"]
                self.cache_resets["prefix"] += 1
                if self._state.kv_cache_awake:
                    yield from self._rpc_steps("refit_reset_kv")
            except passing:
                raise
            except Exception as e:  # noqa: BLE001 - noted on the refit's own error
                error.add_note(f"resetting the caches after the failed refit failed too: {e}")
            if inflight is not None and not inflight.held:
                yield EngineCall("resume")
        except EngineDeadError as e:
            self._died(e)

    # What the async worker's rows in flight add to a refit (the sync worker has none).
    def _mark_in_flight(
        self, why: Callable[[int], GenworkerError], server: str | None = None
    ) -> list[str]:
        """Every row in flight ends with ``why`` (the HTTP server's requests with
        ``server``); the ids to abort."""
        return []

    def _abort_in_flight(self, inflight: InflightMode, by: str) -> None:
        """Mode ``abort``: every row in flight ends as aborted ``by`` the pause."""
        if inflight is InflightMode.ABORT:
            self._mark_in_flight(
                lambda row: RequestAbortedError(f"row {row}: aborted by {by} (mode 'abort')")
            )

    def _relabel(self) -> Steps[None]:
        """The weight version changed under the rows in flight."""
        yield from ()

    def _prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[Sequence[int], object]]
    ) -> Steps[list[object]]:
        """Tell the engine workers which tensors every refit carries (names, shapes, dtypes).

        Returns each engine worker's summary (manifest digest, how many tensors go straight
        into parameter memory, how many through the loader)."""
        manifest = self._manifest_of(state_dict_info)
        summaries = yield from self._rpc_steps("prepare_refit_info", manifest.to_info())
        self._manifest = manifest
        return summaries

    def _init_collective(
        self,
        rank_prefix: int,
        ip: str,
        port: int,
        world_size: int,
        train_world_size: int,
        timeout_s: float | None = None,
    ) -> Steps[None]:
        """Join the trainer's standalone weight-update group (ranks after the trainer's);
        returns once every rank joined, every rendezvous wait bounded by ``timeout_s``."""
        join = checked_join(
            group_join(rank_prefix, ip, port, world_size, train_world_size, timeout_s)
        )
        yield from self._init_collective_via("init_collective", join)

    def _init_collective_via(self, method: str, join: GroupJoin) -> Steps[None]:
        """:meth:`init_collective` through another extension method (``method(join)``,
        e.g. the receiver of NeMo-RL's weight-update group, ``nemo_rl_init_collective``)."""
        self._collective = False
        yield from self._rpc_steps(method, join.to_wire(), timeout=join.rpc_bound())
        self._collective = True

    def _engine_param_layout(self) -> Steps[list[object]]:
        """Each engine worker's parameters a refit can write straight into memory:
        ``{name: [shape, dtype]}`` (send in this layout for the fast refits)."""
        return (yield from self._rpc_steps("engine_param_layout"))

    def _refit_address(self) -> Steps[list[object]]:
        """Where each engine worker listens for IPC refits (one entry per worker), for
        ``genworker.shell.refit.RefitSender.ipc``."""
        return (yield from self._rpc_steps("refit_address"))

    def _release_refit_buffers(self) -> Steps[list[object]]:
        """Give the trainer its memory back: each engine worker lets go of the trainer
        storages and staging buffers it keeps mapped between IPC refits (memory mapped
        stays allocated even after the trainer frees it). How many each let go. The next
        refit maps again what it sends."""
        return (yield from self._rpc_steps("release_refit_buffers"))

    def _call_engine_workers(self, method: str, *args: object) -> Steps[list[object]]:
        """Every engine worker's answer to its ``WorkerExtension.method(*args)`` (plain
        values); a failure raised typed, naming the worker."""
        return (yield from self._rpc_steps(method, *args))

    # -- adapter refits (core.lora, shell.refit.lora) ------------------------------------
    # The base weights are never touched: a failed adapter refit leaves the lifecycle, the
    # version and the adapter that served before (the engine puts it back) as they were.
    def _lora_bounds(
        self, name: object, timeout_s: object, transport: object
    ) -> tuple[float, float, dict[str, object]]:
        """``update_lora``'s preamble: the name, ``timeout_s``, the transport (``ipc``,
        or ``collective`` after ``init_collective``), ``prepare_lora`` first and the
        weights resident; the per-wait bound, the RPC's outer bound and its kwargs."""
        checked = lora_update(name, timeout_s, transport)
        bound, over = unwrap(checked, BadArgumentError, "update_lora")
        if over is Transport.COLLECTIVE and not self._collective:
            raise EngineStateError("update_lora over the collective needs init_collective first")
        if self._lora_manifest is None:
            raise EngineStateError("update_lora needs prepare_lora first")
        self._move(lifecycle.Event.REFIT_BEGIN)  # checked only: the weights must be resident
        waits = refit_waits(len(self._lora_manifest), over)
        kwargs: dict[str, object] = {"timeout_s": bound, "transport": transport}
        return bound, rpc_bound(waits, bound), kwargs

    def _prepare_lora(
        self,
        adapter_info: Mapping[str, tuple[Sequence[int], object]],
        peft_config: Mapping[str, object],
    ) -> Steps[list[object]]:
        """Check the adapter of every later ``update_lora`` (its tensors ``{name: (shape,
        dtype)}`` in PEFT's names and its ``adapter_config``) against what the engine
        holds; each engine worker's address for ``RefitSender.ipc(address,
        manifest=adapter_info)``. A refused adapter moves nothing."""
        manifest = self._manifest_of(adapter_info)
        alpha = self.cfg.lora.alpha
        addresses = yield from self._rpc_steps(
            "refit_init", "lora", manifest.to_info(), dict(peft_config), alpha
        )
        self._lora_manifest = manifest
        return addresses

    def _update_lora(
        self, name: str, timeout_s: object, transport: object, inflight: Inflight | None = None
    ) -> Steps[bool]:
        """Receive one adapter refit and serve it as ``name`` (generate with
        ``data["lora"]`` or ``data["lora_names"]``); the weight version counts it. A
        failure leaves the previous adapter serving and the version alone.
        ``transport``: ``ipc`` (``RefitSender.ipc`` to ``prepare_lora``'s addresses) or
        ``collective`` (``RefitSender.collective`` to the group of ``init_collective``).
        In flight, paused as :meth:`_run_refit` is and resumed after, a failure too (rows
        of mode ``abort`` stay aborted); between batches, the caches reset after it."""
        bound, outer, kwargs = self._lora_bounds(name, timeout_s, transport)
        if inflight is not None:
            yield from self._pause("update_lora", inflight, bound, "an in-flight adapter refit")
        try:
            reports = yield from self._rpc_steps(
                "refit_receive", "lora", name, kwargs=kwargs, timeout=outer, label="update_lora"
            )
            try:
                resets = (yield from self._reset_caches("update_lora")) if inflight is None else {}
            except BaseException as e:  # noqa: BLE001 - re-raised typed by _refit_failed
                self._refit_failed("update_lora", e)
            self._lora_ok(name, reports, resets)
            yield from self._relabel()
        finally:
            if inflight is not None and self._dead is None:
                yield EngineCall("resume")
        if inflight is not None:
            self.last_refit["mode"] = inflight.mode.value
        return True

    def _lora_ok(self, name: str, reports: list[object], resets: Mapping[str, float]) -> None:
        """An adapter refit succeeded on every engine worker: ``name`` serves its
        ``lora_int_id`` and the weights are one version newer."""
        if (lora_id := served_adapter_id(reports)) is None:
            raise RefitError(f"update_lora: the engine workers disagree on adapter ids: {reports}")
        self.lora_adapters[name] = lora_id
        self._version += 1
        self.last_refit = refit_report(reports, resets, adapter=name)

    def _rpc_steps(
        self,
        method: str,
        *args: object,
        kwargs: Mapping[str, object] | None = None,
        timeout: float | None = 120.0,
        label: str | None = None,
    ) -> Steps[list[object]]:
        """``method(*args, **kwargs)`` on every engine worker, bounded by ``timeout``;
        failures typed by the error map of ``label`` (default ``method``): a refit
        method's failure is a RefitError, any other's an EngineRpcError (``shell.errors``)."""
        label = label or method
        if self._shut_down:
            raise EngineStateError(f"{label}: the worker was shut down")
        with translated(REFIT_RPC if is_refit_method(label) else ENGINE_RPC, label):
            results = yield EngineCall("collective_rpc", (RpcCall(method, args, kwargs, timeout),))
        return raise_failures(_list_of(results, object, "collective_rpc"), label)

    # -- observability ------------------------------------------------------------------
    def _report_device_id(self) -> Steps[list[str]]:
        """Each engine worker's device id."""
        return _list_of((yield EngineCall("device_ids")), str, "device_ids")

    def _get_counters(self) -> Steps[dict[str, float | list[float]]]:
        """The engine's Prometheus snapshot, the worker's cache resets
        (``genworker:cache_resets{cache=...}``) and the non-finite logprobs it saw
        (``genworker:nonfinite_logprobs{kind=...}``), encoded as flat keys (see
        core.counters)."""
        metrics = _list_of((yield EngineCall("metrics")), object, "metrics")
        samples = [s for s in metrics if isinstance(s, MetricSample)]
        if len(samples) != len(metrics):
            raise EngineContractError(f"metrics returned {metrics!r}, not only samples")
        own = worker_counters(self.cache_resets, self.nonfinite_logprobs)
        return encode_snapshot([*samples, *own])

    def multimodal_info(self) -> dict[str, int | None]:
        """The engine's image placeholder id and per-prompt image limit (the group checks
        a batch's media against them before splitting it)."""
        caps = self.caps
        return {"image_token_id": caps.image_token_id, "max_images": caps.max_images}


def _list_of(value: object, kind: type[_X], call: str) -> list[_X]:
    """An engine call's list answer, each item a ``kind`` (else EngineContractError)."""
    items = value if isinstance(value, list) else []
    checked = [item for item in items if isinstance(item, kind)]
    if not isinstance(value, list) or len(checked) != len(items):
        raise EngineContractError(f"{call} returned {value!r}, not a list of {kind.__name__}")
    return checked


def _batch_error(problem: PlanError) -> BadBatchError:
    """A whole batch refused by the plan: the core error, named by its input."""
    if problem.cause is None:
        return BadBatchError(problem.message, detail=problem)
    error = BadBatchError.from_core(problem.cause, problem.field)
    assert isinstance(error, BadBatchError)
    return error
