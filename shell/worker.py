"""``VllmGenerationWorker``: NeMo-RL's worker surface over an engine port.

The worker is a thin shell: every decision is a core function (config, batch checks, caps,
stop strings, sampling specs, output assembly, lifecycle), the only effects are calls on
the engine port. Each call first asks core's lifecycle table whether it is allowed, so a
refused call touches nothing; an engine that dies marks the worker unusable.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

from genworker.core import lifecycle
from genworker.core.assembly import assemble_flat_outputs, assemble_outputs
from genworker.core.batch import check_batch
from genworker.core.caps import batch_max_tokens
from genworker.core.config import WorkerConfig
from genworker.core.counters import encode_snapshot
from genworker.core.engine_plan import plan_engine_kwargs
from genworker.core.placement import configure_worker as plan_placement
from genworker.core.sampling import SamplingSpec, sampling_spec
from genworker.core.stops import StopMode, merge_stop_strings
from genworker.shell.collector import defer_cyclic_gc
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineContractError,
    EngineDeadError,
    EngineStateError,
    GenworkerError,
    RefitError,
    UnsupportedError,
    unwrap,
)
from genworker.shell.ports import EngineFactory, EnginePort

__all__ = ["EXTENSION_CLS", "ExistingEngine", "VllmGenerationWorker"]

log = logging.getLogger(__name__)

EXTENSION_CLS = "genworker.shell.extension.WorkerExtension"
_T = TypeVar("_T")
_WAKE_EVENTS = {
    frozenset({"weights"}): lifecycle.Event.WAKE_WEIGHTS,
    frozenset({"kv_cache"}): lifecycle.Event.WAKE_KV_CACHE,
    frozenset({"weights", "kv_cache"}): lifecycle.Event.WAKE_ALL,
}


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


class VllmGenerationWorker:
    """One vLLM engine serving rollouts, with NeMo-RL's ``VllmGenerationWorker`` surface."""

    def __init__(
        self,
        config: Mapping[str, object],
        bundle_indices: Sequence[int] | None = None,
        fraction_of_gpus: float = 1.0,
        seed: int | None = None,
        extra_env_vars: Mapping[str, str] | None = None,
        defer_model_load: bool = False,
        *,
        engine_factory: EngineFactory | None = None,
        stop_mode: StopMode = StopMode.PER_SAMPLE,
    ) -> None:
        self.cfg: WorkerConfig = unwrap(
            WorkerConfig.from_mapping(config), BadConfigError, "worker config"
        )
        self.bundle_indices = None if bundle_indices is None else tuple(bundle_indices)
        self.fraction_of_gpus = fraction_of_gpus
        self.seed = seed if seed is not None else (self.cfg.seed or 0)
        self.stop_mode = stop_mode
        if extra_env_vars:
            os.environ.update(extra_env_vars)
        self._factory = engine_factory
        self._engine: EnginePort | None = None
        self._state = lifecycle.NOT_LOADED
        self._dead: str | None = None
        #: the last successful refit: each engine worker's report (tensors, bytes, mode,
        #: seconds and ``phases``), the RPC's seconds, and the prefix-cache reset's
        self.last_refit: dict[str, object] = {}
        if not defer_model_load:
            self.load_model()

    # -- placement and construction -------------------------------------------------
    @staticmethod
    def configure_worker(
        num_gpus: float,
        bundle_indices: tuple[int, Sequence[int]] | None = None,
        num_gpus_per_node: int = 8,
        cache_base_dir: str | None = None,
    ) -> tuple[dict[str, object], dict[str, str], dict[str, object]]:
        """NeMo-RL's static placement hook: ``(resources, env_vars, init_kwargs)``."""
        base = cache_base_dir or os.path.join(os.path.expanduser("~"), ".cache")
        plan = unwrap(
            plan_placement(
                num_gpus,
                bundle_indices,
                num_gpus_per_node,
                cache_base_dir=base,
                # NeMo-RL's hook infers the tied group from the bundle count.
                tensor_parallel_size=1 if bundle_indices is None else len(bundle_indices[1]),
            ),
            BadConfigError,
            "configure_worker",
        )
        return dict(plan.resources), dict(plan.env_vars), dict(plan.init_kwargs)

    def load_model(self) -> None:
        """Start the engine (the deferred half of ``__init__``)."""
        self._move(lifecycle.Event.LOAD)
        factory = self._factory or _default_factory()
        capability = factory.gpu_capability()
        plan = unwrap(
            plan_engine_kwargs(
                self.cfg,
                seed=self.seed,
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
        self._engine = factory.start(plan.llm_kwargs())
        self._state = unwrap(
            lifecycle.transition(self._state, lifecycle.Event.LOAD),
            EngineStateError,
            "load_model",
        )

    # -- state ----------------------------------------------------------------------
    @property
    def state(self) -> lifecycle.State:
        return self._state

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
        return unwrap(
            lifecycle.transition(self._state, event), EngineStateError, event.name.lower()
        )

    def _call(self, fn: Callable[[EnginePort], _T]) -> _T:
        try:
            return fn(self.engine)
        except EngineDeadError as e:
            self._dead = str(e)
            raise

    # -- generation -----------------------------------------------------------------
    def _specs(
        self, lengths: Sequence[int], data: Mapping[str, object], greedy: bool, text: bool = False
    ) -> list[SamplingSpec]:
        caps = self.engine.capabilities
        per_sample_stops = data.get("stop_strings")
        seeds = _seeds(data.get("seeds"), len(lengths))
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
        max_tokens = unwrap(
            batch_max_tokens(
                self.cfg.max_new_tokens,
                lengths,
                caps.max_model_len,
                cap_to_context=self.cfg.vllm.cap_max_tokens_to_context,
                num_speculative_tokens=self.cfg.num_speculative_tokens,
            ),
            BadBatchError,
            "max tokens",
        )
        made: dict[tuple[int, tuple[str, ...], int | None], SamplingSpec] = {}
        specs = []
        for m, s, seed in zip(max_tokens, stops, seeds, strict=True):
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

    @defer_cyclic_gc()
    def generate(self, data: Mapping[str, object], greedy: bool = False) -> dict[str, torch.Tensor]:
        """Generate for a right-padded batch; returns NeMo-RL's output contract. Cyclic GC
        waits for the end of the call (``genworker.shell.collector``)."""
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
        if not batch.prompts:
            return assemble_outputs(input_ids, input_lengths, [], self.cfg.pad_token_id).as_dict()
        specs = self._specs(batch.lengths, data, greedy)
        generations = self._call(lambda e: e.generate(batch.prompts, specs))
        self._state = next_state
        out = assemble_flat_outputs(input_ids, input_lengths, generations, self.cfg.pad_token_id)
        over = torch.nonzero(out.unpadded_sequence_lengths > caps.max_model_len).flatten()
        if over.numel():
            raise EngineContractError(
                f"rows {over.tolist()} came back longer than max_model_len="
                f"{caps.max_model_len}: lengths "
                f"{out.unpadded_sequence_lengths[over].tolist()}"
            )
        return out.as_dict()

    def generate_text(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> dict[str, list[str]]:
        """Generate from text prompts (``data["prompts"]``); returns ``{"texts": [...]}``."""
        next_state = self._move(lifecycle.Event.GENERATE)
        if not isinstance(greedy, bool):
            raise BadArgumentError(f"greedy must be a bool, got {type(greedy).__name__}")
        prompts = data.get("prompts")
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise BadBatchError("generate_text: data['prompts'] must be a list of str")
        if not prompts:
            return {"texts": []}
        if empty := [i for i, p in enumerate(prompts) if not p]:
            raise BadBatchError(f"generate_text: prompts {empty} are empty strings")
        # Text prompts have no known token length here: cap against the shortest prompt.
        specs = self._specs([1] * len(prompts), data, greedy, text=True)
        texts = self._call(lambda e: e.generate_text(prompts, specs))
        self._state = next_state
        return {"texts": texts}

    # -- memory ---------------------------------------------------------------------
    def _require_sleep_mode(self, call: str) -> None:
        if not self.engine.capabilities.sleep_mode:
            raise UnsupportedError(
                f"{call}: sleep mode is unsupported on this platform "
                f"({self.engine.capabilities.device})"
            )

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
        self._call(lambda e: e.reset_prefix_cache())
        self._call(lambda e: e.sleep(level))
        self._state = next_state

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake ``weights``, ``kv_cache`` or both (``None``); waking an awake tag is a no-op."""
        if tags is not None and (
            isinstance(tags, str) or not all(isinstance(t, str) for t in tags)
        ):
            raise BadArgumentError(f"wake_up tags must be a list of str or None, got {tags!r}")
        wanted = frozenset(tags) if tags is not None else frozenset({"weights", "kv_cache"})
        event = _WAKE_EVENTS.get(wanted)
        if event is None:
            raise BadArgumentError(
                f"wake_up tags must be a non-empty subset of ['kv_cache', 'weights'], got {tags!r}"
            )
        next_state = self._move(event)
        self._require_sleep_mode("wake_up")
        # vLLM drops a whole wake_up(tags) when one tag is already awake: pass only the
        # asleep ones (core.lifecycle.wake_tags), and nothing when all are awake.
        asleep = lifecycle.wake_tags(self._state, event)
        if asleep:
            self._call(lambda e: e.wake_up(list(asleep)))
        self._state = next_state

    def reset_prefix_cache(self) -> None:
        self._state = self._move(lifecycle.Event.RESET_PREFIX_CACHE)
        self._call(lambda e: e.reset_prefix_cache())

    # -- refit ----------------------------------------------------------------------
    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[Sequence[int], object]]
    ) -> list[object]:
        """Tell the engine workers which tensors every refit carries (names, shapes, dtypes).

        Returns each engine worker's summary (manifest digest, how many tensors go straight
        into parameter memory, how many through the loader)."""
        info = {
            str(name): [list(int(d) for d in shape), str(dtype).removeprefix("torch.")]
            for name, (shape, dtype) in state_dict_info.items()
        }
        return self._rpc("prepare_refit_info", info)

    def init_collective(
        self, rank_prefix: int, ip: str, port: int, world_size: int, train_world_size: int
    ) -> None:
        """Join the trainer's standalone weight-update group (ranks after the trainer's)."""
        self._rpc("init_collective", rank_prefix, ip, port, world_size, train_world_size)

    def update_weights_from_collective(self, timeout_s: float = 600.0) -> bool:
        return self._refit("update_weights_from_collective", timeout_s)

    def update_weights_via_ipc_zmq(self, timeout_s: float = 600.0) -> bool:
        return self._refit("update_weights_via_ipc_zmq", timeout_s)

    def engine_param_layout(self) -> list[object]:
        """Each engine worker's parameters a refit can write straight into memory:
        ``{name: [shape, dtype]}`` (send in this layout for the fast refits)."""
        return self._rpc("engine_param_layout")

    def refit_address(self, *, offer_params: bool = True) -> list[object]:
        """Where each engine worker listens for IPC refits (one entry per worker).

        ``offer_params=False``: the engine workers never give the trainer handles of their
        parameters; direct refits read from the trainer's tensors instead (the mode a
        sleep-mode GPU engine always takes). Fixed by the first call."""
        return self._rpc("ipc_address", None, offer_params)

    def release_refit_buffers(self) -> list[object]:
        """Let go of the trainer memory the engine workers keep mapped between IPC refits
        (``IpcSender(keep_mapped=True)``): call it before the trainer frees that memory,
        which stays allocated while mapped. How many storages each engine worker let go."""
        return self._rpc("release_kept_buffers")

    def _rpc(self, method: str, *args: object, timeout: float | None = 120.0) -> list[object]:
        if self._shut_down:
            raise EngineStateError(f"{method}: the worker was shut down")
        try:
            return self._call(lambda e: e.collective_rpc(method, args=args, timeout=timeout))
        except GenworkerError:
            raise
        except Exception as e:
            raise RefitError(f"{method} failed on the engine workers: {e}") from e

    def _refit(self, method: str, timeout_s: float) -> bool:
        self._state = self._move(lifecycle.Event.REFIT_BEGIN)
        try:
            started = time.monotonic()
            reports = self._call(
                lambda e: e.collective_rpc(
                    method, kwargs={"timeout_s": timeout_s}, timeout=timeout_s + 30.0
                )
            )
            rpc_s = time.monotonic() - started
        except BaseException as e:
            self._state = unwrap(
                lifecycle.transition(self._state, lifecycle.Event.REFIT_FAILED),
                EngineStateError,
                "refit",
            )
            if isinstance(e, GenworkerError):
                raise
            raise RefitError(f"{method} failed: {e}; weights are inconsistent") from e
        self._state = unwrap(
            lifecycle.transition(self._state, lifecycle.Event.REFIT_OK),
            EngineStateError,
            "refit",
        )
        started = time.monotonic()
        self._call(lambda e: e.reset_prefix_cache())
        self.last_refit = {
            "engine_workers": reports,
            "rpc_seconds": rpc_s,
            "reset_prefix_cache_seconds": time.monotonic() - started,
        }
        return True

    # -- observability --------------------------------------------------------------
    def report_device_id(self) -> list[str]:
        return self._call(lambda e: e.device_ids())

    def get_counters(self) -> dict[str, float | list[float]]:
        """The engine's Prometheus snapshot, encoded as flat keys (see core.counters)."""
        return encode_snapshot(self._call(lambda e: e.metrics()))

    def start_gpu_profiling(self) -> None:
        if self.engine.capabilities.device != "cuda":
            log.info(
                "start_gpu_profiling: no-op, the engine runs on %s", self.engine.capabilities.device
            )
            return
        self._call(lambda e: e.start_profile())

    def stop_gpu_profiling(self) -> None:
        if self.engine.capabilities.device != "cuda":
            log.info(
                "stop_gpu_profiling: no-op, the engine runs on %s", self.engine.capabilities.device
            )
            return
        self._call(lambda e: e.stop_profile())

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


def _seeds(value: object, batch_size: int) -> list[int | None]:
    """Optional per-sample sampling seeds (``data["seeds"]``: a list or 1-D tensor of ints)."""
    if value is None:
        return [None] * batch_size
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise BadBatchError(f"data['seeds'] must be a 1-D integer tensor, got {value.dtype}")
        value = value.tolist()
    if not isinstance(value, list | tuple) or len(value) != batch_size:
        raise BadBatchError(f"data['seeds'] must hold one int per row ({batch_size})")
    bad = [
        i
        for i, v in enumerate(value)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0)
    ]
    if bad:
        raise BadBatchError(f"data['seeds'] rows {bad} are not non-negative ints")
    return list(value)
