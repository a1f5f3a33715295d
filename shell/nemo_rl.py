"""NeMo-RL's vLLM generation worker contract, over genworker's worker: a Ray actor class.

Theory of operation
-------------------
NeMo-RL's generation layer builds its workers by class path
(``nemo_rl/distributed/worker_groups.py`` ``RayWorkerBuilder``, NeMo-RL commit 7ea279ab):
it imports the class, calls its static ``configure_worker(num_gpus=, bundle_indices=,
num_gpus_per_node=)`` for ``(resources, env_vars, init_kwargs, runtime_env)``, then
``worker_class.options(**options).remote(config, **init_kwargs)``. Pointing it at
``genworker.shell.nemo_rl.VllmGenerationWorker`` gives it this module's
:class:`NemoRlGenerationWorker` as a Ray actor class, with NeMo-RL's method names,
arguments and return values (``nemo_rl/models/generation/vllm/vllm_worker.py``):

* A tied TP/PP group is ``tp * pp`` actors; only the first (``bundle_indices`` given, the
  *model owner*) builds an engine. The others are inert: they validate the config, load
  nothing and answer ``is_alive`` / ``shutdown``; engine calls on them are refused.
* Before building a TP/PP engine the owner drops ``CUDA_VISIBLE_DEVICES`` and sets
  ``VLLM_RAY_PER_WORKER_GPUS`` / ``VLLM_RAY_BUNDLE_INDICES`` for vLLM's Ray executor
  (:func:`genworker.core.placement.plan_engine_env`), as NeMo-RL's ``_load_model`` does.
* ``extra_env_vars`` names variables vLLM's Ray workers must inherit
  (``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY``, NeMo-RL's ``_patch_vllm_init_workers_ray``).
* The refit methods return ``bool``: ``False`` on a failed refit, whose typed error is kept
  in :attr:`NemoRlGenerationWorker.last_refit_error` (and logged with its traceback);
  genworker's own worker raises instead. ``prepare_refit_info`` returns ``None``: the engine
  never asks the trainer to pre-quantize tensors.
* ``_get_raw_spec_counters`` is the engine's metric snapshot keyed by metric name, as
  NeMo-RL's ``aggregate_spec_decode_counters`` reads it.
* ``vllm_cfg.async_engine: true`` is refused: NeMo-RL starts its async worker for it,
  ``genworker.shell.nemo_rl.VllmAsyncGenerationWorker``
  (:class:`genworker.shell.nemo_rl_async.NemoRlAsyncGenerationWorker`, the same rules over
  genworker's async worker). :class:`NemoRlMember` is what the two share: the config
  check, ``configure_worker``, inert members, the engine's environment, the refits'
  ``bool`` answers with ``last_refit_error``, the spec-decode counters.

* ``stop_strings_mode`` (genworker's config key, :mod:`genworker.core.config_keys`) picks
  the stop-string semantics: ``per_sample`` (the default: a row stops on the config's
  strings and its own) or ``batch_union`` (NeMo-RL's sync ``generate``: every row stops on
  every row's strings); the drop-in passes it to the worker it builds.
* Stop strings need the engine's tokenizer: with ``vllm_cfg.skip_tokenizer_init: true``
  (NeMo-RL's choice when the config's ``stop_strings`` is null) vLLM would skip them
  silently, so a batch that carries ``stop_strings`` is refused by name with
  ``BadBatchError`` before any engine call (``WorkerConfig.detokenizer_problem``).
* Keys in no table of :mod:`genworker.core.config_keys` are refused; with
  ``unknown_keys: warn`` each is accepted without effect and logged here by name, once,
  when the worker is built.
* Sleep and wake on a platform without vLLM's sleep mode (no CUDA: the CPU engine) are a
  documented **no-op**: the first ``sleep`` / ``wake_up`` logs one warning saying so and
  every later call does nothing; the engine keeps its memory (there is no GPU memory to
  share with a colocated trainer there) and the worker stays usable, so NeMo-RL's
  colocated loop runs unchanged. On a GPU, sleep and wake are the worker's own.
* NeMo-RL sends its batches as ``BatchedDataDict[GenerationDatumSpec](...)``: the pickled
  generic alias makes Ray's argument unpickling on this actor import
  ``nemo_rl.distributed.batched_data_dict`` and ``nemo_rl.models.generation.interfaces``
  before any method runs, so a venv where that import fails would lose the call (NeMo-RL
  keeps such a sample with 0 turns). The drop-in cannot read the argument itself (Ray
  unpickles it first); it imports those modules when it is built and fails there, loudly,
  naming the module and its error (:mod:`genworker.shell.nemo_rl_batches`).
* ``update_sampling_params(**params) -> bool`` (NeMo-RL #2538) replaces the config's
  sampling keys (``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``,
  ``stop_token_ids``, ``stop_strings``, ``bad_words``, ``ignore_eos``) for every later
  call, validated as the config is; any other name is refused.

* The refit methods speak NeMo-RL's own trainer wire (:mod:`genworker.shell.nemo_rl_refit`,
  the extension's ``nemo_rl_*`` methods): ``update_weights_via_ipc_zmq`` connects to the
  socket NeMo-RL's policy worker binds at ``ipc://<ipc_socket_dir>/<GPU UUID>.sock``
  (``/tmp``, as NeMo-RL's ``get_zmq_address``) and reads its pickled CUDA IPC handles
  through an allowlist; ``init_collective`` / ``update_weights_from_collective`` join its
  ``StatelessProcessGroup`` store and receive its packed NCCL broadcasts. genworker's own
  worker (:class:`genworker.shell.worker.VllmGenerationWorker`) keeps genworker's wire.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Final, Generic, Protocol, TypeVar

import torch

from genworker.core import lifecycle
from genworker.core.config import WorkerConfig
from genworker.core.counters import (
    CACHE_RESETS,
    NONFINITE_LOGPROBS,
    decode_snapshot,
    values_by_name,
)
from genworker.core.placement import plan_engine_env
from genworker.core.refit_protocol import Transport, wait_bound
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineContractError,
    EngineStateError,
    GenworkerError,
    unwrap,
)
from genworker.shell.nemo_rl_batches import require_batch_modules
from genworker.shell.nemo_rl_refit import DEFAULT_SOCKET_DIR
from genworker.shell.worker import VllmGenerationWorker as NativeWorker
from genworker.shell.worker import checked_env_names

__all__ = [
    "NEMO_RL_OUTPUT_KEYS",
    "SAMPLING_KEYS",
    "NemoRlGenerationWorker",
    "NemoRlMember",
    "VllmAsyncGenerationWorker",
    "VllmGenerationWorker",
    "raw_spec_counters",
    "wake_up_tags",
]

#: NeMo-RL's ``GenerationOutputSpec``: the keys of every ``generate`` result (genworker's
#: ``weight_versions`` is left out: NeMo-RL merges the workers' outputs with
#: ``BatchedDataDict.from_batches``, which would pad it with 0, a version)
NEMO_RL_OUTPUT_KEYS: Final = (
    "output_ids",
    "logprobs",
    "generation_lengths",
    "unpadded_sequence_lengths",
    "truncated",
)

#: the config keys ``update_sampling_params`` may replace
SAMPLING_KEYS: Final = (
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "stop_token_ids",
    "stop_strings",
    "bad_words",
    "ignore_eos",
)

# Made on first use by the module __getattr__ below (Ray imported then).
VllmGenerationWorker: Any
VllmAsyncGenerationWorker: Any

log = logging.getLogger(__name__)


class _Capabilities(Protocol):
    @property
    def sleep_mode(self) -> bool: ...

    @property
    def device(self) -> str: ...


class _Engine(Protocol):
    @property
    def capabilities(self) -> _Capabilities: ...


class _Native(Protocol):
    """What :class:`NemoRlMember` needs of the genworker worker it wraps (both have it)."""

    cfg: WorkerConfig

    @property
    def state(self) -> lifecycle.State: ...

    @property
    def engine(self) -> _Engine: ...

    @property
    def llm(self) -> object: ...

    def is_alive(self) -> bool: ...

    def load_model(self) -> None: ...


_W = TypeVar("_W", bound=_Native)


def raw_spec_counters(encoded: Mapping[str, float | list[float]]) -> dict[str, float | list[float]]:
    """A worker's ``get_counters()`` as NeMo-RL's ``_get_raw_spec_counters`` returns them:
    keyed by metric name. The worker's own counters (``genworker:cache_resets``, one series
    per cache; ``genworker:nonfinite_logprobs``, one per kind) are left out: summed by name
    they would mean nothing."""
    snapshot = unwrap(decode_snapshot(encoded), EngineContractError, "engine metrics")
    own = {CACHE_RESETS, NONFINITE_LOGPROBS}
    return values_by_name(s for s in snapshot.samples if s.name not in own)


def wake_up_tags(call: str, kwargs: Mapping[str, object]) -> Sequence[str] | None:
    """NeMo-RL's ``wake_up(**kwargs)`` takes ``tags=`` only; any other keyword is refused
    by name (the worker checks the entries)."""
    unknown = sorted(set(kwargs) - {"tags"})
    if unknown:
        raise BadArgumentError(f"{call} takes only tags=, got {unknown}")
    tags = kwargs.get("tags")
    if tags is not None and not isinstance(tags, Sequence):
        raise BadArgumentError(f"{call} tags must be a list of str or None, got {tags!r}")
    return tags


class NemoRlMember(Generic[_W]):
    """What NeMo-RL's synchronous and async worker classes share, over the genworker
    worker ``_W`` they wrap (built by the subclass, for the model owner only): the config
    check, NeMo-RL's placement hook, inert tied-group members, the engine's environment,
    and the refits' ``bool`` answers with the typed error kept."""

    #: the ``vllm_cfg.async_engine`` this class serves, and what to say to any other
    ASYNC_ENGINE: ClassVar[bool]
    OTHER_ENGINE: ClassVar[str]

    def __init__(
        self,
        config: Mapping[str, object],
        bundle_indices: Sequence[int] | None = None,
        fraction_of_gpus: float = 1.0,
        seed: int | None = None,
        extra_env_vars: Sequence[str] | None = None,
        defer_model_load: bool = False,
        *,
        engine_factory: object | None = None,
        ipc_socket_dir: str = DEFAULT_SOCKET_DIR,
    ) -> None:
        """NeMo-RL's constructor (``RayWorkerBuilder`` passes these); ``engine_factory``
        (the wrapped worker's kind: tests) and ``ipc_socket_dir`` are genworker's."""
        self.cfg: WorkerConfig = unwrap(
            WorkerConfig.from_mapping(config), BadConfigError, "worker config"
        )
        if self.cfg.vllm.async_engine != self.ASYNC_ENGINE:
            raise BadConfigError(self.OTHER_ENGINE)
        require_batch_modules()
        for warning in self.cfg.warnings:
            log.warning("genworker ignores generation-config key %s", warning)
        self.extra_env_vars = checked_env_names(extra_env_vars)
        self.bundle_indices = None if bundle_indices is None else tuple(bundle_indices)
        self.fraction_of_gpus = fraction_of_gpus
        self.is_model_owner = self.bundle_indices is not None
        #: the device ids the post-init hook found (one per engine worker)
        self.vllm_device_ids: list[str] | None = None
        #: the typed error of the last refit that returned False (None after a good one)
        self.last_refit_error: GenworkerError | None = None
        #: each engine worker's manifest summary from the last ``prepare_refit_info``
        self.refit_info: list[object] = []
        #: where NeMo-RL's trainer binds its IPC refit sockets (its ``/tmp``)
        self.ipc_socket_dir = ipc_socket_dir
        self._socket_dir_sent = False
        self._shut_down = False
        self._no_sleep_mode_said = False
        self._worker: _W | None = None
        if self.bundle_indices is None:
            return
        self._worker = self._native()(
            config,
            self.bundle_indices,
            fraction_of_gpus,
            seed,
            extra_env_vars=self.extra_env_vars,
            defer_model_load=True,
            engine_factory=engine_factory,
            stop_mode=self.cfg.stop_mode,
        )
        if not defer_model_load:
            self.load_model()

    @staticmethod
    def _native() -> Callable[..., _W]:
        """The genworker worker this drop-in wraps (its constructor)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        # NeMo-RL: the class name alone is the actor's prefix in Ray's logs.
        return type(self).__name__

    @staticmethod
    def configure_worker(
        num_gpus: float,
        bundle_indices: tuple[int, Sequence[int]] | None = None,
        num_gpus_per_node: int | None = None,
    ) -> tuple[dict[str, object], dict[str, str], dict[str, object], dict[str, object]]:
        """NeMo-RL's placement hook: ``(resources, env_vars, init_kwargs, runtime_env)``."""
        return NativeWorker.configure_worker(num_gpus, bundle_indices, num_gpus_per_node)

    # -- engine ---------------------------------------------------------------------
    def _owner(self, call: str) -> _W:
        if self._shut_down:
            raise EngineStateError(f"{call}: the worker was shut down")
        if self._worker is None:
            raise EngineStateError(
                f"{call}: this worker is an inert member of a tied tensor/pipeline-parallel "
                "group (bundle_indices=None) and holds no engine; call the group's first worker"
            )
        return self._worker

    def load_model(self) -> None:
        """Build the engine (the deferred half of ``__init__``): the owner only. A TP/PP
        owner first sets up vLLM's Ray executor (``core.placement.plan_engine_env``)."""
        worker = self._owner("load_model")
        v = self.cfg.vllm
        env = unwrap(
            plan_engine_env(
                self.bundle_indices,
                self.fraction_of_gpus,
                tensor_parallel_size=v.tensor_parallel_size,
                pipeline_parallel_size=v.pipeline_parallel_size,
            ),
            BadConfigError,
            "engine placement",
        )
        for name in env.unset:
            os.environ.pop(name, None)
        os.environ.update(env.set)
        worker.load_model()

    def llm(self) -> object | None:
        """The owner's vLLM engine (``vllm.LLM`` or ``AsyncLLM``); ``None`` on an inert
        member or before loading."""
        if self._worker is None or self._worker.state.phase is not lifecycle.Phase.RUNNING:
            return None
        return self._worker.llm

    def _check_stop_strings(self, data: Mapping[str, object]) -> None:
        """Refuse a batch's ``stop_strings`` on an engine without a detokenizer (vLLM
        would skip them silently; ``WorkerConfig.detokenizer_problem``)."""
        problem = self.cfg.detokenizer_problem(data.get("stop_strings"))
        if problem is not None:
            raise BadBatchError(problem)

    def _sleep_is_a_no_op(self, worker: _W, call: str) -> bool:
        """Whether ``call`` (sleep or wake) is the documented no-op of a platform without
        vLLM's sleep mode; the first such call logs one warning (module docstring)."""
        caps = worker.engine.capabilities
        if caps.sleep_mode:
            return False
        if not self._no_sleep_mode_said:
            self._no_sleep_mode_said = True
            log.warning(
                "%s: vLLM has no sleep mode on this platform (%s): sleep and wake_up are "
                "no-ops here and the engine keeps its memory (said once)",
                call,
                caps.device,
            )
        return True

    def is_alive(self) -> bool:
        """False once shut down or when the engine died; an inert member is alive."""
        if self._shut_down:
            return False
        worker = self._worker
        return worker is None or worker.state == lifecycle.NOT_LOADED or worker.is_alive()

    # -- refit ----------------------------------------------------------------------
    def get_last_refit_error(self) -> GenworkerError | None:
        """:attr:`last_refit_error`, for callers that hold only the actor handle."""
        return self.last_refit_error

    def _refit_owner(self, method: str, refit_timeout_s: float | None) -> _W:
        """The owner for a refit through ``method``; a bad bound is refused before any
        engine call (None: the refit default, core.refit_protocol.DEFAULT_TIMEOUT_S)."""
        unwrap(wait_bound(refit_timeout_s), BadArgumentError, method.removeprefix("nemo_rl_"))
        return self._owner(method)

    def _socket_dir_due(self, transport: Transport) -> bool:
        """Whether an IPC refit must first tell the engine workers ``ipc_socket_dir``."""
        return transport is Transport.IPC and not self._socket_dir_sent

    def _refit_failed(self, method: str, error: GenworkerError) -> bool:
        self.last_refit_error = error
        log.warning("%s failed (%s: %s)", method, type(error).__name__, error, exc_info=error)
        return False

    def _refit_succeeded(self, method: str, ok: object) -> bool:
        if ok is not True:
            raise EngineContractError(f"{method} returned {ok!r} instead of True or an error")
        self.last_refit_error = None
        return True


class NemoRlGenerationWorker(NemoRlMember[NativeWorker]):
    """One member of a NeMo-RL generation worker group (see the module docstring)."""

    ASYNC_ENGINE = False
    OTHER_ENGINE = (
        "vllm_cfg.async_engine: true asks for NeMo-RL's async worker "
        "(VllmAsyncGenerationWorker); this is the synchronous one: set it to false"
    )

    @staticmethod
    def _native() -> Callable[..., NativeWorker]:
        return NativeWorker

    def post_init(self) -> None:
        """NeMo-RL calls it once the group is up: records the engine workers' device ids."""
        self.vllm_device_ids = self.report_device_id()

    # -- generation -----------------------------------------------------------------
    def generate(self, data: Mapping[str, object], greedy: bool = False) -> dict[str, torch.Tensor]:
        worker = self._owner("generate")
        self._check_stop_strings(data)
        out = worker.generate(data, greedy)
        return {key: out[key] for key in NEMO_RL_OUTPUT_KEYS}

    def generate_text(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> dict[str, list[str]]:
        worker = self._owner("generate_text")
        self._check_stop_strings(data)
        return worker.generate_text(data, greedy)

    def update_sampling_params(self, **params: object) -> bool:
        """NeMo-RL's ``update_sampling_params`` (#2538): the config's sampling keys
        (:data:`SAMPLING_KEYS`) take these values for every later call; True once done.
        Other names and bad values are refused naming them, and change nothing."""
        unknown = sorted(set(params) - set(SAMPLING_KEYS))
        if unknown:
            raise BadArgumentError(
                f"update_sampling_params takes only {list(SAMPLING_KEYS)}, got {unknown}"
            )
        if self._shut_down:
            raise EngineStateError("update_sampling_params: the worker was shut down")
        merged = self.cfg.to_mapping()
        merged.update(params)
        cfg = unwrap(WorkerConfig.from_mapping(merged), BadArgumentError, "update_sampling_params")
        self.cfg = cfg
        if self._worker is not None:
            self._worker.cfg = cfg
        return True

    # -- memory ---------------------------------------------------------------------
    def sleep(self) -> None:
        """Sleep at ``vllm_cfg.sleep_level`` (NeMo-RL's ``sleep()`` takes no level); a
        no-op with one warning on a platform without sleep mode (module docstring)."""
        worker = self._owner("sleep")
        if self._sleep_is_a_no_op(worker, "sleep"):
            return
        worker.sleep()

    def wake_up(self, **kwargs: object) -> None:
        """NeMo-RL's ``wake_up(tags=...)``; any other keyword is refused by name. A no-op
        on a platform without sleep mode, as :meth:`sleep`."""
        worker = self._owner("wake_up")
        tags = wake_up_tags("wake_up", kwargs)
        if self._sleep_is_a_no_op(worker, "wake_up"):
            return
        worker.wake_up(tags)

    def reset_prefix_cache(self) -> None:
        self._owner("reset_prefix_cache").reset_prefix_cache()

    # -- refit ----------------------------------------------------------------------
    def prepare_refit_info(
        self, state_dict_info: Mapping[str, tuple[Sequence[int], object]]
    ) -> list[str] | None:
        """Tell the engine workers every refit's tensors; returns the names the engine wants
        the trainer to pre-quantize: none (``None``). The summaries are in ``refit_info``."""
        worker = self._owner("prepare_refit_info")
        self.refit_info = worker.prepare_refit_info(state_dict_info)
        return None

    def init_collective(
        self, rank_prefix: int, ip: str, port: int, world_size: int, train_world_size: int
    ) -> None:
        """Join NeMo-RL's weight-update group (its trainer rank 0 hosts the store)."""
        self._owner("init_collective").init_collective_via(
            "nemo_rl_init_collective", rank_prefix, ip, port, world_size, train_world_size
        )

    def update_weights_via_ipc_zmq(self, refit_timeout_s: float | None = None) -> bool:
        """One refit from NeMo-RL's trainer over its IPC wire; False on failure."""
        return self._refit("nemo_rl_update_weights_via_ipc_zmq", refit_timeout_s, Transport.IPC)

    def update_weights_from_collective(self, refit_timeout_s: float | None = None) -> bool:
        """One refit from NeMo-RL's trainer over its packed broadcasts; False on failure."""
        return self._refit(
            "nemo_rl_update_weights_from_collective", refit_timeout_s, Transport.COLLECTIVE
        )

    def _refit(self, method: str, refit_timeout_s: float | None, transport: Transport) -> bool:
        try:
            worker = self._refit_owner(method, refit_timeout_s)
            if self._socket_dir_due(transport):
                worker.call_engine_workers("nemo_rl_ipc_socket_dir", self.ipc_socket_dir)
                self._socket_dir_sent = True
            ok = worker.refit_via(method, refit_timeout_s, transport)
        except GenworkerError as e:
            return self._refit_failed(method, e)
        return self._refit_succeeded(method, ok)

    # -- observability --------------------------------------------------------------
    def report_device_id(self) -> list[str]:
        return self._owner("report_device_id").report_device_id()

    def _get_raw_spec_counters(self) -> dict[str, float | list[float]]:
        """The engine's metrics keyed by name (NeMo-RL's form, :func:`raw_spec_counters`);
        ``{}`` on an inert member, which has no engine."""
        if self._worker is None:
            return {}
        return raw_spec_counters(self._owner("_get_raw_spec_counters").get_counters())

    def start_gpu_profiling(self) -> None:
        """The engine's profiler on the owner; a no-op on an inert member (NeMo-RL's
        ``VllmGeneration`` calls every worker, and an inert one runs nothing to profile)."""
        if self._inert("start_gpu_profiling"):
            return
        self._owner("start_gpu_profiling").start_gpu_profiling()

    def stop_gpu_profiling(self) -> None:
        """See :meth:`start_gpu_profiling`."""
        if self._inert("stop_gpu_profiling"):
            return
        self._owner("stop_gpu_profiling").stop_gpu_profiling()

    def _inert(self, call: str) -> bool:
        """Whether this is a live inert member (logged as a no-op for ``call``)."""
        if self._worker is None and not self._shut_down:
            log.info("%s: no-op on an inert member of a tied group (no engine here)", call)
            return True
        return False

    def shutdown(self) -> bool:
        """Free the engine (none on an inert member); idempotent."""
        self._shut_down = True
        if self._worker is not None:
            return self._worker.shutdown()
        return True


def __getattr__(name: str) -> Any:
    """``VllmGenerationWorker`` and ``VllmAsyncGenerationWorker``: the Ray actor classes
    NeMo-RL's ``RayWorkerBuilder`` instantiates by class path (the second when
    ``vllm_cfg.async_engine`` is true), made on first use, so Ray is imported only then
    (a host without Ray, such as the GPU runner, drives :class:`NemoRlGenerationWorker`
    or ``NemoRlAsyncGenerationWorker`` directly). Typed ``Any``: Ray's ActorClass type
    hides the class's static methods, which its runtime subclass keeps (NeMo-RL calls
    ``<class>.configure_worker(...)`` on it)."""
    cls: type[object]
    if name == "VllmGenerationWorker":
        cls = NemoRlGenerationWorker
    elif name == "VllmAsyncGenerationWorker":
        from genworker.shell.nemo_rl_async import NemoRlAsyncGenerationWorker

        cls = NemoRlAsyncGenerationWorker
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import ray

    actor: Any = ray.remote(cls)
    globals()[name] = actor
    return actor
