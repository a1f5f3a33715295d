"""``VllmGenerationWorker``: NeMo-RL's worker surface over an engine port.

The worker is a thin shell: every decision is a core function (config, batch checks, caps,
stop strings, sampling specs, output assembly, lifecycle), the only effects are calls on
the engine port. Each call first asks core's lifecycle table whether it is allowed, so a
refused call touches nothing; an engine that dies marks the worker unusable. So does a
sleep or wake that fails on the engine (anything but a typed refusal, ``EnginePort.sleep``;
S1/S2 in failure-modes.md): vLLM 0.32 leaves it part-mapped with its scheduler paused
(``vllm_engine``'s module docstring), so the call raises ``EngineDeadError`` (the engine's
error as its cause; an interrupt as itself) and every later call is refused with it; and
so does a wake after which every tag should be resident but the engine says it is not
fully awake (vLLM resumes scheduling only then: every later request would wait).

Calls are serialised: every public method that touches the engine or the lifecycle state
holds the worker's :class:`~genworker.shell.engine_lock.EngineLock` from its lifecycle
check to its commit. A call that finds another running waits for it, at most
``busy_wait_s`` seconds, then is refused with ``EngineStateError`` (so a refit that arrives
during a long ``generate`` runs after it, never under its forward). ``llm`` and ``engine``
hand out the raw engine outside that rule.

A row without room left in the context (``core.caps.cap_rows``: with speculative decoding
the drafter's k + 1 slots count too; a media row counts with its expanded prompt) is
refused alone: it comes back unchanged with generation length 0 (``generate_text``: an
empty text), it is named in a warning and in ``last_refused_rows``, and the other rows
generate. Images come in ``data["multi_modal_data"]`` or NeMo-RL's ``vllm_images`` /
``vllm_content`` side channels (:mod:`genworker.shell.media`); a row whose prompt text
came with its images starts from that text's ids, and its output keeps the caller's ids.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch
from returns.result import Failure, Result, Success

from genworker.core import lifecycle
from genworker.core.assembly import (
    GenerationOutputs,
    assemble_flat_outputs,
    assemble_outputs,
    flatten_generations,
    place_rows,
)
from genworker.core.batch import check_batch, check_seeds
from genworker.core.caps import cap_rows
from genworker.core.config import WorkerConfig
from genworker.core.counters import (
    CACHE_RESETS,
    NONFINITE_LOGPROBS,
    CounterSample,
    encode_snapshot,
)
from genworker.core.engine_plan import plan_engine_kwargs
from genworker.core.outputs import (
    NonFiniteCounts,
    NonFiniteLogprobs,
    check_finished,
    check_logprobs,
)
from genworker.core.placement import RAY_EXTRA_ENV_VARS, forwarded_env_names
from genworker.core.placement import configure_worker as plan_placement
from genworker.core.refit_plan import Manifest
from genworker.core.refit_protocol import (
    RENDEZVOUS_WAITS,
    Transport,
    refit_waits,
    rpc_bound,
    wait_bound,
)
from genworker.core.sampling import SamplingSpec, check_stop_token_ids, sampling_spec
from genworker.core.stops import StopMode, merge_stop_strings
from genworker.core.versions import uniform_versions
from genworker.shell.collector import defer_cyclic_gc
from genworker.shell.engine_lock import EngineLock
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineContractError,
    EngineDeadError,
    EngineStateError,
    GenworkerError,
    RefitError,
    RefitManifestError,
    RequestAbortedError,
    UnsupportedError,
    unwrap,
)
from genworker.shell.host import ephemeral_ports, vllm_cache_root
from genworker.shell.media import RowMedia, context_lengths, engine_prompts, row_media
from genworker.shell.ports import EngineFactory, EnginePort
from genworker.shell.refit.wire import raise_failures
from genworker.shell.sparse import SparseRefitError

__all__ = ["EXTENSION_CLS", "ExistingEngine", "VllmGenerationWorker"]

log = logging.getLogger(__name__)

EXTENSION_CLS = "genworker.shell.extension.WorkerExtension"
_T = TypeVar("_T")
_P = ParamSpec("_P")
_WAKE_EVENTS = {
    frozenset({"weights"}): lifecycle.Event.WAKE_WEIGHTS,
    frozenset({"kv_cache"}): lifecycle.Event.WAKE_KV_CACHE,
    frozenset({"weights", "kv_cache"}): lifecycle.Event.WAKE_ALL,
}
_Started_co = TypeVar("_Started_co", covariant=True)


class _StartsEngines(Protocol[_Started_co]):
    """What both workers' engine factories offer (:class:`EngineFactory`,
    ``AsyncEngineFactory``)."""

    def arg_names(self) -> frozenset[str] | None: ...

    def gpu_capability(self) -> tuple[int, int] | None: ...

    def start(self, kwargs: Mapping[str, object]) -> _Started_co: ...


def start_engine(
    factory: _StartsEngines[_Started_co],
    cfg: WorkerConfig,
    seed: int,
    extra_env_vars: Sequence[str],
) -> _Started_co:
    """Plan the engine's arguments for this GPU and the installed vLLM (a dropped one is
    logged), export the environment they need, and start the engine (both workers)."""
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
        ),
        BadConfigError,
        "engine arguments",
    )
    if plan.dropped:
        log.warning("engine arguments the installed vLLM lacks, dropped: %s", plan.dropped)
    os.environ.update(plan.env)  # e.g. the OTLP traces protocol, which vLLM reads from env
    VllmGenerationWorker.forward_env([*cfg.vllm.env_vars, *extra_env_vars])
    return factory.start(plan.llm_kwargs())


#: What an engine's sleep or wake raises only before it touched its memory (EnginePort.sleep).
_REFUSALS = (BadArgumentError, EngineStateError, UnsupportedError)


def failed_sleep_or_wake(call: str, error: BaseException) -> EngineDeadError | None:
    """What the engine's sleep or wake ``call`` raising ``error`` means (both workers):
    None for a typed refusal (nothing changed: raise ``error``); otherwise the engine is
    dead: ``error`` itself when it says so, else an EngineDeadError naming it."""
    if isinstance(error, _REFUSALS):
        return None
    if isinstance(error, EngineDeadError):
        return error
    return EngineDeadError(
        f"{call} failed: {type(error).__name__}: {error}; the engine's memory is left in an "
        "unknown state (part-mapped, its scheduler paused), so the engine is dead"
    )


def not_fully_awake(
    call: str, after: lifecycle.State, fully_awake: bool | None
) -> EngineDeadError | None:
    """EngineDeadError when the wake ``call`` leaves every tag resident by the lifecycle
    table but the engine says it is not fully awake (both workers; None: they agree)."""
    if fully_awake is not False or not (after.weights_awake and after.kv_cache_awake):
        return None
    return EngineDeadError(
        f"{call}: the engine is not fully awake after it, though every tag should be "
        "resident; vLLM resumes scheduling only once it is (EngineCore.wake_up, "
        "vllm/v1/engine/core.py, 0.32), so every request would wait: the engine is dead"
    )


def tally_nonfinite(
    tally: dict[str, int], checked: Result[NonFiniteCounts, NonFiniteLogprobs]
) -> None:
    """Add the non-finite logprobs ``check_logprobs`` saw, refused or not (both workers)."""
    match checked:
        case Success(NonFiniteCounts() as seen):
            pass
        case Failure(NonFiniteLogprobs() as problem):
            seen = problem.seen
    if seen.total:
        for kind, count in seen.by_kind().items():
            tally[kind] += count


def nonfinite_samples(tally: Mapping[str, int]) -> list[CounterSample]:
    """``genworker:nonfinite_logprobs{kind=...}``, one series per kind (both workers)."""
    return [
        CounterSample.from_counter(NONFINITE_LOGPROBS, {"kind": kind}, count)
        for kind, count in tally.items()
    ]


def wake_event(tags: Sequence[str] | None) -> lifecycle.Event:
    """The lifecycle event of ``wake_up(tags)`` (both workers); a typed error naming the
    tags when they are not a non-empty subset of ``weights`` and ``kv_cache``."""
    if tags is not None and (isinstance(tags, str) or not all(isinstance(t, str) for t in tags)):
        raise BadArgumentError(f"wake_up tags must be a list of str or None, got {tags!r}")
    wanted = frozenset(tags) if tags is not None else frozenset({"weights", "kv_cache"})
    event = _WAKE_EVENTS.get(wanted)
    if event is None:
        raise BadArgumentError(
            f"wake_up tags must be a non-empty subset of ['kv_cache', 'weights'], got {tags!r}"
        )
    return event


class ExistingEngine:
    """An :class:`EngineFactory` that hands the worker an engine already running.

    For benchmarks and tests that compare the worker with raw calls on the same engine.
    """

    def __init__(self, engine: EnginePort) -> None:
        self.engine = engine

    def arg_names(self) -> frozenset[str] | None:
        return None

    def gpu_capability(self) -> tuple[int, int] | None:
        return None

    def start(self, kwargs: Mapping[str, object]) -> EnginePort:
        return self.engine


def _default_factory() -> EngineFactory:
    from genworker.shell.vllm_engine import VllmEngineFactory

    return VllmEngineFactory()


def _serialized(
    method: Callable[Concatenate[VllmGenerationWorker, _P], _T],
) -> Callable[Concatenate[VllmGenerationWorker, _P], _T]:
    """Run ``method`` holding the worker's lock (see the module docstring)."""

    @functools.wraps(method)
    def serialized(self: VllmGenerationWorker, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        with self._lock.hold(method.__name__):
            return method(self, *args, **kwargs)

    return serialized


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def checked_env_names(names: Sequence[str] | None) -> tuple[str, ...]:
    """``extra_env_vars`` as a tuple of variable names, or BadArgumentError."""
    if names is None:
        return ()
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise BadArgumentError(
            f"extra_env_vars must be a list of environment variable names, got {names!r}"
        )
    bad = [n for n in names if not isinstance(n, str) or not _ENV_NAME.fullmatch(n)]
    if bad:
        raise BadArgumentError(f"extra_env_vars: not environment variable names: {bad!r}")
    return tuple(names)


_NO_ROWS = flatten_generations([])
_CACHES = {"prefix": "prefix cache", "mm": "multimodal cache", "encoder": "encoder cache"}


class VllmGenerationWorker:
    """One vLLM engine serving rollouts, with NeMo-RL's ``VllmGenerationWorker`` surface.

    ``busy_wait_s``: how long a call waits for another one to finish before it is refused
    with ``EngineStateError`` (0: refuse at once).
    """

    def __init__(
        self,
        config: Mapping[str, object],
        bundle_indices: Sequence[int] | None = None,
        fraction_of_gpus: float = 1.0,
        seed: int | None = None,
        extra_env_vars: Sequence[str] | None = None,
        defer_model_load: bool = False,
        *,
        engine_factory: EngineFactory | None = None,
        stop_mode: StopMode = StopMode.PER_SAMPLE,
        busy_wait_s: float = 600.0,
    ) -> None:
        self._lock = EngineLock(busy_wait_s)
        self.cfg: WorkerConfig = unwrap(
            WorkerConfig.from_mapping(config), BadConfigError, "worker config"
        )
        if self.cfg.vllm.async_engine:
            raise BadConfigError(
                "vllm_cfg.async_engine is true: VllmGenerationWorker runs the synchronous "
                "vllm.LLM; use genworker.shell.async_worker.AsyncVllmGenerationWorker, or set "
                "vllm_cfg.async_engine: false"
            )
        self.bundle_indices = None if bundle_indices is None else tuple(bundle_indices)
        self.fraction_of_gpus = fraction_of_gpus
        self.seed = seed if seed is not None else (self.cfg.seed or 0)
        self.stop_mode = stop_mode
        #: variables (names) vLLM's Ray workers inherit from this process, as NeMo-RL's
        #: ``extra_env_vars``; ``vllm_cfg.env_vars`` are exported and forwarded as well
        self.extra_env_vars = checked_env_names(extra_env_vars)
        self._factory = engine_factory
        self._engine: EnginePort | None = None
        self._state = lifecycle.NOT_LOADED
        self._dead: str | None = None
        self._manifest: Manifest | None = None  # from prepare_refit_info
        self._collective = False  # init_collective succeeded
        self._caches = lifecycle.CacheLedger()  # known empty: resets skipped
        #: the last successful refit: each engine worker's report (tensors, bytes, mode,
        #: seconds and ``phases``), the RPC's seconds, and each cache reset's
        #: (``reset_{prefix,mm,encoder}_cache_seconds``; mm and encoder on multimodal engines)
        self.last_refit: dict[str, object] = {}
        #: how many times each engine cache was reset (``get_counters`` reports them)
        self.cache_resets: dict[str, int] = {"prefix": 0, "mm": 0, "encoder": 0}
        #: non-finite logprobs seen in generated tokens, by kind (``get_counters``)
        self.nonfinite_logprobs: dict[str, int] = dict(NonFiniteCounts().by_kind())
        #: rows of the last generate / generate_text refused for want of room (see above)
        self.last_refused_rows: tuple[int, ...] = ()
        self._sparse_urls: list[str] | None = None  # the engine workers' relay receivers
        self._sparse_applied: list[object] = []  # their applied counts as last seen
        self._version = 0  # good refits so far (weight_version)
        if not defer_model_load:
            self.load_model()

    # -- placement and construction -------------------------------------------------
    @staticmethod
    def configure_worker(
        num_gpus: float,
        bundle_indices: tuple[int, Sequence[int]] | None = None,
        num_gpus_per_node: int | None = None,
        *,
        cache_root: str | None = None,
    ) -> tuple[dict[str, object], dict[str, str], dict[str, object], dict[str, object]]:
        """NeMo-RL's static placement hook: ``(resources, env_vars, init_kwargs,
        runtime_env)`` (``runtime_env`` is empty: no nsight profiling).

        ``VLLM_CACHE_ROOT`` is ``<cache_root>_<seed>``, ``cache_root`` defaulting to the
        inherited ``VLLM_CACHE_ROOT`` or ``~/.cache/vllm``; ``VLLM_PORT`` stays below this
        host's ephemeral port range or the call fails naming the range."""
        size = 1
        if isinstance(bundle_indices, tuple | list) and len(bundle_indices) == 2:
            ids = bundle_indices[1]
            size = len(ids) if isinstance(ids, Sequence) and ids else 1
        plan = unwrap(
            plan_placement(
                num_gpus,
                bundle_indices,
                num_gpus_per_node,
                cache_root=cache_root or vllm_cache_root(),
                # NeMo-RL's hook infers the tied group from the bundle count.
                tensor_parallel_size=size,
                ephemeral_ports=ephemeral_ports(),
            ),
            BadConfigError,
            "configure_worker",
        )
        return dict(plan.resources), dict(plan.env_vars), dict(plan.init_kwargs), {}

    @_serialized
    def load_model(self) -> None:
        """Start the engine (the deferred half of ``__init__``)."""
        self._move(lifecycle.Event.LOAD)
        factory = self._factory or _default_factory()
        self._engine = start_engine(factory, self.cfg, self.seed, self.extra_env_vars)
        caps = self._engine.capabilities
        problem = self.cfg.vllm.encoder_reset_problem(multimodal=caps.multimodal)
        # Stop ids index the logits: refused against the vocabulary known now (G6).
        stops = check_stop_token_ids(self.cfg.stop_token_ids, caps.vocab_size)
        if problem is not None or isinstance(stops, Failure):
            engine, self._engine = self._engine, None
            engine.shutdown()
            if problem is not None:
                raise BadConfigError(problem)
            unwrap(stops, BadConfigError, "worker config")
        self._state = unwrap(
            lifecycle.transition(self._state, lifecycle.Event.LOAD),
            EngineStateError,
            "load_model",
        )

    @staticmethod
    def forward_env(names: Iterable[str]) -> None:
        """Have vLLM's Ray executor copy these variables into its engine workers
        (``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY``); an in-process engine inherits them anyway."""
        names = list(names)
        if names:
            existing = os.environ.get(RAY_EXTRA_ENV_VARS, "")
            os.environ[RAY_EXTRA_ENV_VARS] = forwarded_env_names(existing, names)

    # -- state ----------------------------------------------------------------------
    @property
    def state(self) -> lifecycle.State:
        return self._state

    @property
    def weight_version(self) -> int:
        """Good refits so far (0: the weights loaded), the async worker's count: every
        ``generate`` output carries it as ``weight_versions``, and a refit that fails
        leaves it alone (generation is refused until a good one)."""
        return self._version

    @property
    def engine(self) -> EnginePort:
        if self._dead is not None:
            raise EngineDeadError(f"the engine died earlier ({self._dead}); re-create the worker")
        if self._engine is None:
            raise EngineStateError("no engine: call load_model() first (defer_model_load=True)")
        return self._engine

    @property
    def llm(self) -> object:
        """The underlying ``vllm.LLM`` (or the fake engine) for callers that need it."""
        engine = self.engine
        return getattr(engine, "llm", engine)

    def is_alive(self) -> bool:
        return self._engine is not None and self._dead is None and not self._shut_down

    @property
    def _shut_down(self) -> bool:
        return self._state.phase is lifecycle.Phase.SHUT_DOWN

    def __repr__(self) -> str:
        return (
            f"VllmGenerationWorker(model={self.cfg.model_name!r}, seed={self.seed}, "
            f"state={self._state}, alive={self.is_alive()})"
        )

    def _move(self, event: lifecycle.Event) -> lifecycle.State:
        """The state ``event`` leads to, or EngineStateError; does not commit it."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine died earlier ({self._dead}); re-create the worker")
        self._caches = self._caches.after(event)
        return unwrap(
            lifecycle.transition(self._state, event), EngineStateError, event.name.lower()
        )

    def _call(self, fn: Callable[[EnginePort], _T]) -> _T:
        if not self._lock.held():
            raise RuntimeError("genworker bug: an engine call without the worker's lock")
        try:
            return fn(self.engine)
        except EngineDeadError as e:
            self._dead = str(e)
            raise
        except EngineContractError as e:  # generate_text: the engine checked its rows
            if isinstance(e.detail, NonFiniteLogprobs):
                tally_nonfinite(self.nonfinite_logprobs, Failure(e.detail))
            raise

    # -- generation -----------------------------------------------------------------
    def _specs(
        self,
        lengths: Sequence[int],
        data: Mapping[str, object],
        greedy: bool,
        text: bool = False,
    ) -> list[SamplingSpec | None]:
        """One spec per row; ``None`` for a row without room (refused alone, named in
        ``last_refused_rows`` and a warning). ``text``: the caller reads the completions'
        text (vLLM detokenizes every row; otherwise only rows with stop strings)."""
        caps = self.engine.capabilities
        per_sample_stops = data.get("stop_strings")
        seeds = unwrap(check_seeds(data.get("seeds"), len(lengths)), BadBatchError, "seeds")
        stops = unwrap(
            merge_stop_strings(
                self.cfg.stop_strings,
                per_sample_stops,  # type: ignore[arg-type]
                len(lengths),
                self.stop_mode,
            ),
            BadBatchError,
            "stop_strings",
        )
        rows = unwrap(
            cap_rows(
                self.cfg.max_new_tokens,
                lengths,
                caps.max_model_len,
                cap_to_context=self.cfg.vllm.cap_max_tokens_to_context,
                num_speculative_tokens=caps.num_speculative_tokens,
            ),
            BadBatchError,
            "max tokens",
        )
        self.last_refused_rows = rows.refused_rows
        if rows.refused is not None:
            log.warning("generating without the rows that have no room left: %s", rows.refused)
        made: dict[tuple[int, tuple[str, ...], int | None], SamplingSpec] = {}
        specs: list[SamplingSpec | None] = []
        for m, s, seed in zip(rows.max_tokens, stops, seeds, strict=True):
            if m == 0:
                specs.append(None)
                continue
            key = (m, tuple(s), seed)
            spec = made.get(key)
            if spec is None:  # rows alike share one (immutable) spec
                spec = made[key] = sampling_spec(
                    self.cfg,
                    greedy=greedy,
                    max_tokens=m,
                    stop=s,
                    seed=seed,
                    flat_logprobs=caps.flat_logprobs,
                    text=text,
                )
            specs.append(spec)
        return specs

    @_serialized
    @defer_cyclic_gc()
    def generate(self, data: Mapping[str, object], greedy: bool = False) -> dict[str, torch.Tensor]:
        """Generate for a right-padded batch; returns NeMo-RL's output contract. Cyclic GC
        waits for the end of the call (``genworker.shell.collector``)."""
        self._check_sparse()
        next_state = self._move(lifecycle.Event.GENERATE)
        if not isinstance(greedy, bool):
            raise BadArgumentError(f"greedy must be a bool, got {type(greedy).__name__}")
        input_ids, input_lengths = (_tensor_field(data, k) for k in ("input_ids", "input_lengths"))
        caps = self.engine.capabilities
        batch = unwrap(
            check_batch(
                input_ids,
                input_lengths,
                pad_token_id=self.cfg.pad_token_id,
                vocab_size=caps.vocab_size,
                max_model_len=caps.max_model_len,
            ),
            BadBatchError,
            "generate batch",
        )
        media = row_media(data, batch.batch_size, "generate")
        if not batch.prompts:
            self.last_refused_rows = ()
            empty = assemble_outputs(input_ids, input_lengths, [], self.cfg.pad_token_id)
            return self._versioned(empty)
        starts = self._engine_prompts(batch.prompts, media)  # a prompt text's ids, or the row's
        lengths = batch.lengths if starts is batch.prompts else list(map(len, starts))
        context = self._context_lengths(starts, lengths, media)
        specs = self._specs(context, data, greedy)
        kept = [i for i, spec in enumerate(specs) if spec is not None]
        progress = self.cfg.vllm.use_tqdm
        made = _NO_ROWS
        if kept:
            prompts = [starts[i] for i in kept]
            kept_specs = [spec for spec in specs if spec is not None]
            kept_media = None if media is None else [media[i] for i in kept]
            made = self._call(
                lambda e: e.generate(prompts, kept_specs, kept_media, use_tqdm=progress)
            )
        # Rows without room come back empty, as if never sent.
        generations = made if len(kept) == len(specs) else place_rows(made, kept, len(specs))
        self._state = next_state
        # The engine's rows, before any reaches the trainer: non-finite logprobs (G11; one
        # vectorised pass when all are finite) and aborted rows (G14), named by batch row.
        checked = check_logprobs(generations.logprobs, generations.lengths, caps.logprobs_mode)
        tally_nonfinite(self.nonfinite_logprobs, checked)
        unwrap(checked, EngineContractError, "generate")
        unwrap(check_finished(generations), RequestAbortedError, "generate")
        out = assemble_flat_outputs(input_ids, input_lengths, generations, self.cfg.pad_token_id)
        # What the context held: the prompt (expanded, for media rows) plus the generation.
        held = out.unpadded_sequence_lengths
        if media is not None:
            held = torch.tensor(context, dtype=held.dtype) + out.generation_lengths.to(held.dtype)
        over = torch.nonzero(held > caps.max_model_len).flatten()
        if over.numel():
            raise EngineContractError(
                f"rows {over.tolist()} came back longer than max_model_len="
                f"{caps.max_model_len}: context lengths {held[over].tolist()}"
            )
        return self._versioned(out)

    def _versioned(self, out: GenerationOutputs) -> dict[str, torch.Tensor]:
        """The output contract plus ``weight_versions`` (B, W) int64: this worker's
        version at every generated token's position, -1 elsewhere (the async worker's
        layout; no refit runs inside a generate)."""
        versions = uniform_versions(
            out.unpadded_sequence_lengths - out.generation_lengths,
            out.generation_lengths,
            int(out.output_ids.shape[1]),
            self._version,
        )
        return {**out.as_dict(), "weight_versions": versions}

    def _engine_prompts(
        self, prompts: Sequence[Sequence[int]], media: Sequence[RowMedia | None] | None
    ) -> Sequence[Sequence[int]]:
        """What the engine starts each row from (:func:`~genworker.shell.media.engine_prompts`)."""
        limit = self.engine.capabilities.max_model_len

        def tokenize(texts: list[str]) -> list[list[int]]:
            return self._call(lambda e: e.tokenize(texts))

        return engine_prompts(prompts, media, tokenize, limit, "generate")

    def _context_lengths(
        self,
        prompts: Sequence[Sequence[int]],
        lengths: Sequence[int],
        media: Sequence[RowMedia | None] | None,
    ) -> list[int]:
        """What each prompt holds in the context
        (:func:`~genworker.shell.media.context_lengths`)."""
        return context_lengths(
            self.engine.capabilities,
            prompts,
            lengths,
            media,
            lambda p, m: self._call(lambda e: e.expanded_lengths(p, m)),
        )

    @_serialized
    def generate_text(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> dict[str, list[str]]:
        """Generate from text prompts (``data["prompts"]``); returns ``{"texts": [...]}``."""
        self._check_sparse()
        next_state = self._move(lifecycle.Event.GENERATE)
        if not isinstance(greedy, bool):
            raise BadArgumentError(f"greedy must be a bool, got {type(greedy).__name__}")
        if not isinstance(data, Mapping):
            raise BadBatchError(f"generate_text: data must be a mapping, got {type(data).__name__}")
        prompts = data.get("prompts")
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise BadBatchError("generate_text: data['prompts'] must be a list of str")
        if not prompts:
            return {"texts": []}
        if empty := [i for i, p in enumerate(prompts) if not p]:
            raise BadBatchError(f"generate_text: prompts {empty} are empty strings")
        media = row_media(data, len(prompts), "generate_text", texts=False)
        # Tokenised once, here (no second BOS), so caps and media checks see the real ids.
        ids = self._call(lambda e: e.tokenize(prompts))
        caps = self.engine.capabilities
        if too_long := [i for i, p in enumerate(ids) if len(p) >= caps.max_model_len]:
            raise BadBatchError(
                f"generate_text: prompts {too_long} leave no room to generate: "
                f"{[len(ids[i]) for i in too_long]} tokens, max_model_len="
                f"{caps.max_model_len} (a prompt must be shorter)"
            )
        context = self._context_lengths(ids, [len(p) for p in ids], media)
        specs = self._specs(context, data, greedy, text=True)
        kept = [i for i, spec in enumerate(specs) if spec is not None]
        texts = [""] * len(prompts)
        if kept:
            kept_ids = [ids[i] for i in kept]
            kept_specs = [spec for spec in specs if spec is not None]
            kept_media = None if media is None else [media[i] for i in kept]
            progress = self.cfg.vllm.use_tqdm
            made = self._call(
                lambda e: e.generate_text(kept_ids, kept_specs, kept_media, use_tqdm=progress)
            )
            for i, text in zip(kept, made, strict=True):
                texts[i] = text
        self._state = next_state
        return {"texts": texts}

    # -- memory ---------------------------------------------------------------------
    def _require_sleep_mode(self, call: str) -> None:
        if not self.engine.capabilities.sleep_mode:
            raise UnsupportedError(
                f"{call}: sleep mode is unsupported on this platform "
                f"({self.engine.capabilities.device})"
            )

    @_serialized
    def sleep(self, level: int | None = None) -> None:
        """Free engine memory: level 1 offloads weights to host, level 2 discards them."""
        level = self.cfg.vllm.sleep_level if level is None else level
        if level not in (1, 2) or isinstance(level, bool):
            raise BadArgumentError(f"sleep level must be 1 or 2, got {level!r}")
        event = lifecycle.Event.SLEEP_L1 if level == 1 else lifecycle.Event.SLEEP_L2
        next_state = self._move(event)
        self._require_sleep_mode("sleep")
        if next_state == self._state:
            return
        self._reset_caches()
        self._memory_call(f"sleep(level={level})", lambda e: e.sleep(level))
        self._state = next_state

    @_serialized
    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake ``weights``, ``kv_cache`` or both (``None``); waking an awake tag is a no-op."""
        event = wake_event(tags)
        next_state = self._move(event)
        self._require_sleep_mode("wake_up")
        # vLLM drops a whole wake_up(tags) when one tag is already awake: pass only the
        # asleep ones (core.lifecycle.wake_tags), and nothing when all are awake.
        asleep = lifecycle.wake_tags(self._state, event)
        if asleep:
            call = f"wake_up(tags={list(asleep)})"
            fully = self._memory_call(call, lambda e: e.wake_up(list(asleep)))
            dead = not_fully_awake(call, next_state, fully)
            if dead is not None:
                self._dead = str(dead)
                raise dead
        self._state = next_state

    def _memory_call(self, call: str, fn: Callable[[EnginePort], _T]) -> _T:
        """The engine's sleep or wake: a failure other than a typed refusal kills the
        engine (see the module docstring)."""
        try:
            return self._call(fn)
        except BaseException as e:
            dead = failed_sleep_or_wake(call, e)
            if dead is None:
                raise
            if self._dead is None:
                self._dead = str(dead)
            if dead is e or not isinstance(e, Exception):
                raise
            raise dead from e

    @_serialized
    def reset_prefix_cache(self) -> None:
        self._state = self._move(lifecycle.Event.RESET_PREFIX_CACHE)
        self._call(lambda e: e.reset_prefix_cache())
        self.cache_resets["prefix"] += 1

    def _reset_caches(self, refit: str | None = None) -> dict[str, float]:
        """Reset the prefix cache and, on a multimodal engine, the processed-media and
        encoder caches (stale after a refit); seconds per reset. After the refit ``refit``,
        a reset the engine refuses (``EngineStateError``) is a ``RefitError``: that cache
        may still serve what the old weights computed. Caches known empty (core.lifecycle's
        ``CacheLedger``: no request ran since the last reset) are not reset again."""
        counter = getattr(getattr(self.llm, "request_counter", None), "counter", None)
        requests = counter if isinstance(counter, int) else None
        if not self._caches.needs_reset(requests):
            return {}
        resets: list[tuple[str, Callable[[EnginePort], None]]] = [
            ("prefix", lambda e: e.reset_prefix_cache())
        ]
        if self.engine.capabilities.multimodal:
            resets += [
                ("mm", lambda e: e.reset_mm_cache()),
                ("encoder", lambda e: e.reset_encoder_cache()),
            ]
        seconds = {}
        for name, reset in resets:
            started = time.monotonic()
            try:
                self._call(reset)
            except EngineStateError as e:
                if refit is None:
                    raise
                raise RefitError(
                    f"{refit}: the new weights are in, but resetting the {_CACHES[name]} "
                    f"failed ({e}), so it may still serve what the old weights computed; the "
                    "weights count as inconsistent until a refit succeeds"
                ) from e
            seconds[name] = time.monotonic() - started
            self.cache_resets[name] += 1
        self._caches = self._caches.reset(requests)
        return seconds

    # -- refit ----------------------------------------------------------------------
    # Per refit, every wait (engine side and trainer side) is bounded by ``timeout_s``
    # (None: core.refit_protocol.DEFAULT_TIMEOUT_S); the engine call's own bound is
    # derived from it (core.refit_protocol.rpc_bound), so only a wedged call ever exceeds
    # it. A refit refused before it starts (no prepare_refit_info, a bad timeout_s, no
    # init_collective) changes nothing; one that fails, times out or is interrupted
    # leaves the weights inconsistent (generate refused) until a refit succeeds.
    @_serialized
    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[Sequence[int], object]]
    ) -> list[object]:
        """Tell the engine workers which tensors every refit carries (names, shapes, dtypes).

        Returns each engine worker's summary (manifest digest, how many tensors go straight
        into parameter memory, how many through the loader)."""
        manifest = unwrap(Manifest.from_info(state_dict_info), RefitManifestError, "refit info")
        summaries = self._rpc("prepare_refit_info", manifest.to_info())
        self._manifest = manifest
        return summaries

    @_serialized
    def init_collective(
        self,
        rank_prefix: int,
        ip: str,
        port: int,
        world_size: int,
        train_world_size: int,
        timeout_s: float | None = None,
    ) -> None:
        """Join the trainer's standalone weight-update group (ranks after the trainer's);
        every rendezvous wait is bounded by ``timeout_s``."""
        bound = unwrap(wait_bound(timeout_s), BadArgumentError, "init_collective")
        self._collective = False
        self._rpc(
            "init_collective",
            rank_prefix,
            ip,
            port,
            world_size,
            train_world_size,
            bound,
            timeout=rpc_bound(RENDEZVOUS_WAITS, bound),
        )
        self._collective = True

    @_serialized
    def update_weights_from_collective(self, timeout_s: float | None = None) -> bool:
        return self._refit("update_weights_from_collective", timeout_s, Transport.COLLECTIVE)

    @_serialized
    def update_weights_via_ipc_zmq(self, timeout_s: float | None = None) -> bool:
        return self._refit("update_weights_via_ipc_zmq", timeout_s, Transport.IPC)

    @_serialized
    def engine_param_layout(self) -> list[object]:
        """Each engine worker's parameters a refit can write straight into memory:
        ``{name: [shape, dtype]}`` (send in this layout for the fast refits)."""
        return self._rpc("engine_param_layout")

    @_serialized
    def refit_address(self) -> list[object]:
        """Where each engine worker listens for IPC refits (one entry per worker), for
        ``genworker.shell.refit.RefitSender.ipc``."""
        return self._rpc("refit_address")

    @_serialized
    def release_refit_buffers(self) -> list[object]:
        """Give the trainer its memory back: each engine worker lets go of the trainer
        storages and staging buffers it keeps mapped between IPC refits (memory mapped
        stays allocated even after the trainer frees it). How many each let go. The next
        refit maps again what it sends."""
        return self._rpc("release_refit_buffers")

    def _rpc(self, method: str, *args: object, timeout: float | None = 120.0) -> list[object]:
        if self._shut_down:
            raise EngineStateError(f"{method}: the worker was shut down")
        try:
            results = self._call(lambda e: e.collective_rpc(method, args=args, timeout=timeout))
        except GenworkerError:
            raise
        except Exception as e:
            raise RefitError(f"{method} failed on the engine workers: {e}") from e
        return raise_failures(results, method)

    def _refit(self, method: str, timeout_s: float | None, transport: Transport) -> bool:
        """The refit RPC, then the cache resets; the weights count as valid only when all
        succeeded (a cache still holding KV or encoder outputs of the old weights would
        serve them). ``timeout_s`` is checked first (the one check of it), then what the
        refit needs (init_collective for a collective one, prepare_refit_info), then the
        lifecycle: a refit refused by any of them changes nothing."""
        bound = unwrap(wait_bound(timeout_s), BadArgumentError, method)
        if transport is Transport.COLLECTIVE and not self._collective:
            raise EngineStateError(f"{method} needs init_collective first")
        if self._manifest is None:
            raise EngineStateError(f"{method} needs prepare_refit_info first")
        outer = rpc_bound(refit_waits(len(self._manifest), transport), bound)
        return self._run_refit(method, {"timeout_s": bound}, outer)

    def _run_refit(self, method: str, kwargs: dict[str, object], outer: float) -> bool:
        """The refit RPC ``method(**kwargs)`` on every engine worker (bounded by ``outer``),
        then the cache resets, through the lifecycle's refit states; the checks are done."""
        self._state = self._move(lifecycle.Event.REFIT_BEGIN)
        try:
            started = time.monotonic()
            reports = self._call(lambda e: e.collective_rpc(method, kwargs=kwargs, timeout=outer))
            raise_failures(reports, method)
            rpc_s = time.monotonic() - started
            resets = self._reset_caches(method)
        except BaseException as e:
            event = lifecycle.Event.REFIT_FAILED
            self._state = unwrap(lifecycle.transition(self._state, event), EngineStateError, method)
            if isinstance(e, GenworkerError) or not isinstance(e, Exception):
                raise  # typed, or an interrupt (KeyboardInterrupt, SystemExit) as itself
            raise RefitError(f"{method} failed: {e}; weights are inconsistent") from e
        event = lifecycle.Event.REFIT_OK
        self._state = unwrap(lifecycle.transition(self._state, event), EngineStateError, method)
        self._version += 1
        self.last_refit = {
            "engine_workers": reports,
            "rpc_seconds": rpc_s,
            **{f"reset_{name}_cache_seconds": s for name, s in resets.items()},
        }
        return True

    # -- observability --------------------------------------------------------------
    @_serialized
    def report_device_id(self) -> list[str]:
        return self._call(lambda e: e.device_ids())

    @_serialized
    def get_counters(self) -> dict[str, float | list[float]]:
        """The engine's Prometheus snapshot, the worker's cache resets
        (``genworker:cache_resets{cache=...}``) and the non-finite logprobs it saw
        (``genworker:nonfinite_logprobs{kind=...}``), encoded as flat keys (see
        core.counters)."""
        resets = [
            CounterSample.from_counter(CACHE_RESETS, {"cache": name}, count)
            for name, count in self.cache_resets.items()
        ]
        own = [*resets, *nonfinite_samples(self.nonfinite_logprobs)]
        return encode_snapshot([*self._call(lambda e: e.metrics()), *own])

    def multimodal_info(self) -> dict[str, int | None]:
        """The engine's image placeholder id and per-prompt image limit (the group checks
        a batch's media against them before splitting it)."""
        caps = self.engine.capabilities
        return {"image_token_id": caps.image_token_id, "max_images": caps.max_images}

    @_serialized
    def start_gpu_profiling(self) -> None:
        if self.engine.capabilities.device != "cuda":
            log.info(
                "start_gpu_profiling: no-op, the engine runs on %s", self.engine.capabilities.device
            )
            return
        self._call(lambda e: e.start_profile())

    @_serialized
    def stop_gpu_profiling(self) -> None:
        if self.engine.capabilities.device != "cuda":
            log.info(
                "stop_gpu_profiling: no-op, the engine runs on %s", self.engine.capabilities.device
            )
            return
        self._call(lambda e: e.stop_profile())

    @_serialized
    def shutdown(self) -> bool:
        """Free the engine; idempotent. The worker is unusable afterwards."""
        engine, self._engine = self._engine, None
        self._state = unwrap(
            lifecycle.transition(self._state, lifecycle.Event.SHUTDOWN),
            EngineStateError,
            "shutdown",
        )
        if engine is not None:
            engine.shutdown()
        return True

    # -- sparse-delta refit (issue 16; the engine side is shell/sparse_engine.py) -------
    # The trainer's SparseSender pushes steps to the relay receivers in the engine
    # workers; each generate first asks them where they stand: a diverged one (or engine
    # workers on different steps) is refused with SparseRefitError until a full refit,
    # and new weights reset the caches and count as a refit.
    @_serialized
    def start_zmq_sparse_refit_relay(
        self, host: str = "127.0.0.1", allow_remote: bool = False
    ) -> list[str]:
        """Start a sparse-refit relay receiver in every engine worker (idempotent); their
        addresses, for ``SparseSender`` or :meth:`configure_zmq_sparse_refit_relay`.
        ``host`` other than loopback needs ``allow_remote=True`` (the relay is
        unauthenticated)."""
        if not isinstance(host, str) or not isinstance(allow_remote, bool):
            raise BadArgumentError(
                f"start_zmq_sparse_refit_relay: host must be a str and allow_remote a bool, "
                f"got {host!r} and {allow_remote!r}"
            )
        urls = [str(u) for u in self._rpc("start_sparse_relay", host, allow_remote)]
        if self._sparse_urls is None:
            self._sparse_applied = [s["applied"] for s in self._sparse_status()]
        self._sparse_urls = urls
        return urls

    @_serialized
    def configure_zmq_sparse_refit_relay(self, relay_addresses: Sequence[str]) -> None:
        """The whole relay, in order (the root first): every engine worker takes only
        steps planned over exactly these receivers, which must include its own."""
        if self._sparse_urls is None:
            raise EngineStateError(
                "configure_zmq_sparse_refit_relay needs start_zmq_sparse_refit_relay first"
            )
        if isinstance(relay_addresses, str) or not isinstance(relay_addresses, Sequence):
            raise BadArgumentError(
                f"relay_addresses must be a list of addresses, got {relay_addresses!r}"
            )
        self._rpc("configure_sparse_relay", list(relay_addresses))

    @_serialized
    def report_refit_server_base_url(self) -> str | None:
        """Where the first engine worker's relay receiver listens; ``None`` when the
        sparse relay is off (every engine worker's: :meth:`start_zmq_sparse_refit_relay`)."""
        return None if not self._sparse_urls else self._sparse_urls[0]

    @_serialized
    def stop_zmq_sparse_refit_relay(self) -> None:
        """Close every engine worker's relay receiver; idempotent."""
        if self._sparse_urls is not None and not self._shut_down:
            self._rpc("stop_sparse_relay")
        self._sparse_urls = None

    def _sparse_status(self) -> list[dict[str, object]]:
        statuses = self._rpc("sparse_relay_status")
        if not all(isinstance(s, dict) for s in statuses):
            raise EngineContractError(f"sparse_relay_status returned {statuses!r}")
        return [dict(s) for s in statuses]  # type: ignore[call-overload]

    def _check_sparse(self) -> None:
        """Before serving: refuse diverged weights; take in new ones (see above)."""
        if self._sparse_urls is None:
            return
        statuses = self._sparse_status()
        applied = [s["applied"] for s in statuses]
        problems = [
            f"engine worker {i}: {s['diverged']}" for i, s in enumerate(statuses) if s["diverged"]
        ]
        if not problems and len({str(s["step"]) for s in statuses}) > 1:
            steps = [s["step"] for s in statuses]
            problems = [f"the engine workers hold different sparse steps {steps}"]
        if problems:
            if lifecycle.transition(self._state, lifecycle.Event.REFIT_BEGIN).value_or(None):
                self._state = self._move(lifecycle.Event.REFIT_BEGIN)
                self._state = self._move(lifecycle.Event.REFIT_FAILED)
            raise SparseRefitError(
                "generate refused: the sparse refit left weights nobody can vouch for ("
                + "; ".join(problems)
                + "); a full refit (the sender's next step, or an IPC/collective refit) "
                "makes them valid again"
            )
        if applied == self._sparse_applied:
            return
        self._state = self._move(lifecycle.Event.REFIT_BEGIN)
        try:
            resets = self._reset_caches("sparse refit")
        except BaseException:
            self._state = self._move(lifecycle.Event.REFIT_FAILED)
            raise
        self._state = self._move(lifecycle.Event.REFIT_OK)
        self._version += _steps_between(self._sparse_applied, applied)
        self._sparse_applied = applied
        self.last_refit = {
            "engine_workers": statuses,
            **{f"reset_{name}_cache_seconds": sec for name, sec in resets.items()},
        }

    # -- receivers of other refit wires (genworker.shell.nemo_rl) ---------------------
    @_serialized
    def call_engine_workers(self, method: str, *args: object) -> list[object]:
        """Every engine worker's answer to its ``WorkerExtension.method(*args)`` (plain
        values); a failure raised typed, naming the worker."""
        return self._rpc(method, *args)

    @_serialized
    def init_collective_via(
        self, method: str, *args: object, timeout_s: float | None = None
    ) -> None:
        """:meth:`init_collective` through another extension method (``method(*args,
        bound)``, e.g. the receiver of NeMo-RL's weight-update group)."""
        bound = unwrap(wait_bound(timeout_s), BadArgumentError, method)
        self._collective = False
        self._rpc(method, *args, bound, timeout=rpc_bound(RENDEZVOUS_WAITS, bound))
        self._collective = True

    @_serialized
    def refit_via(self, method: str, timeout_s: float | None, transport: Transport) -> bool:
        """A refit through another extension receiver ``method(timeout_s=)`` of
        ``transport``, with the built-in refits' checks, bounds, lifecycle and resets."""
        return self._refit(method, timeout_s, transport)

    # -- shard-to-shard refit (issue 17; genworker.shell.reshard) -------------------
    _reshard_stages = 0  # init_nccl_reshard_comm_group succeeded: its stage groups
    _reshard_params: int | None = None  # prepare_nccl_reshard_refit_info: parameters

    @_serialized
    def init_nccl_reshard_comm_group(
        self,
        rank_prefix: int,
        pp_ips: Sequence[str],
        pp_ports: Sequence[int],
        pp_size: int,
        train_ranks_per_stage: int,
        sub_world_size: int,
        timeout_s: float | None = None,
        *,
        device: str | None = None,
    ) -> None:
        """Join each trainer PP stage's reshard group (``pp_ips[s]:pp_ports[s]``) as rank
        ``train_ranks_per_stage + rank_prefix + engine worker rank`` of ``sub_world_size``;
        every rendezvous wait bounded by ``timeout_s``. ``device="cpu"``: gloo over host
        memory even on a CUDA engine (trainer ranks on the engine's own GPU, where NCCL
        refuses a second rank; they send with ``ReshardSender(device="cpu")``)."""
        bound = unwrap(wait_bound(timeout_s), BadArgumentError, "init_nccl_reshard_comm_group")
        if device not in (None, "cpu"):
            raise BadArgumentError(
                f"init_nccl_reshard_comm_group: device must be None (the engine's) or 'cpu', "
                f"got {device!r}"
            )
        self._reshard_stages = 0
        args = (rank_prefix, list(pp_ips), list(pp_ports), pp_size, train_ranks_per_stage)
        self._rpc(
            "init_nccl_reshard_comm_group",
            *args,
            sub_world_size,
            bound,
            device,
            timeout=rpc_bound(RENDEZVOUS_WAITS * max(1, len(pp_ips)), bound),
        )
        self._reshard_stages = len(pp_ips)

    @_serialized
    def prepare_nccl_reshard_refit_info(self, refit_info: Mapping[str, object]) -> list[object]:
        """Plan every later reshard refit from the trainer's layouts
        (``genworker.shell.reshard.refit_info``); each engine worker's shards, digests
        and bytes, for the trainer's ``ReshardSender.plan(shards_of(...))``."""
        self._reshard_params = None
        summaries = self._rpc("prepare_nccl_reshard_refit_info", dict(refit_info))
        self._reshard_params = max(
            (int(s.get("params", 0)) for s in summaries if isinstance(s, dict)), default=0
        )
        return summaries

    @_serialized
    def nccl_reshard_refit(self, refit_timeout_s: float | None = None) -> bool:
        """Receive one reshard refit (every wait bounded by ``refit_timeout_s``); as the
        other refits: refused before it starts, or the weights count as valid only once
        it and the cache resets succeeded."""
        method = "nccl_reshard_refit"
        bound = unwrap(wait_bound(refit_timeout_s), BadArgumentError, method)
        if not self._reshard_stages:
            raise EngineStateError(f"{method} needs init_nccl_reshard_comm_group first")
        if self._reshard_params is None:
            raise EngineStateError(f"{method} needs prepare_nccl_reshard_refit_info first")
        outer = rpc_bound(self._reshard_stages * refit_waits(1, Transport.COLLECTIVE), bound)
        return self._run_refit(method, {"refit_timeout_s": bound}, outer)


def _steps_between(before: Sequence[object], after: Sequence[object]) -> int:
    """Sparse steps the engine workers applied between two statuses (their ``applied``
    counts; every worker holds the same step): at least one, as the counts changed."""
    old, new = (before[0] if before else 0), (after[0] if after else 0)
    if isinstance(old, int) and isinstance(new, int) and new > old:
        return new - old
    return 1


def _tensor_field(data: Mapping[str, object], key: str) -> torch.Tensor:
    if not isinstance(data, Mapping):
        raise BadBatchError(f"generate: data must be a mapping, got {type(data).__name__}")
    value = data.get(key)
    if value is None:
        raise BadBatchError(f"generate: data[{key!r}] is missing")
    if not isinstance(value, torch.Tensor):
        raise BadBatchError(
            f"generate: data[{key!r}] must be a torch.Tensor, got {type(value).__name__}"
        )
    return value
