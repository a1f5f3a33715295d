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

* ``stop_strings_mode`` picks the stop-string semantics (``per_sample`` or NeMo-RL's
  ``batch_union``, :mod:`genworker.core.config_keys`); the worker reads it from the config.
* With ``vllm_cfg.skip_tokenizer_init: true`` vLLM would skip stop strings silently, so a
  batch that carries ``stop_strings`` is refused by name with ``BadBatchError`` before any
  engine call (``WorkerConfig.detokenizer_problem``).
* With ``unknown_keys: warn``, each key in no table is logged here by name, once.
* Sleep and wake on a platform without vLLM's sleep mode (no CUDA: the CPU engine) are a
  documented **no-op**: the first logs one warning, the engine keeps its memory (there is
  no GPU memory to share with a colocated trainer there) and NeMo-RL's colocated loop runs
  unchanged. On a GPU, sleep and wake are the worker's own.
* Ray unpickles NeMo-RL's ``BatchedDataDict[GenerationDatumSpec]`` batches on this actor
  before any method runs, through NeMo-RL's modules: the drop-in imports them when it is
  built and fails there, loudly (:mod:`genworker.shell.nemo_rl_batches` says why).
* ``update_sampling_params(**params) -> bool`` (NeMo-RL #2538) replaces the config's
  sampling keys (``core.nemo_rl_front.SAMPLING_KEYS``) for every later call, validated as
  the config is; any other name is refused.
* The refit methods speak NeMo-RL's own trainer wire (:mod:`genworker.shell.refit.nemo_rl`,
  docs/nemo-rl.md): its pickled CUDA IPC handles at ``ipc://<ipc_socket_dir>/<GPU
  UUID>.sock`` (``/tmp``, NeMo-RL's ``get_zmq_address``) read through an allowlist, or its
  ``StatelessProcessGroup`` and packed NCCL broadcasts. genworker's own worker keeps
  genworker's wire.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from genworker.core.joins import group_join
from genworker.core.nemo_rl_front import (
    NEMO_RL_OUTPUT_KEYS,
    SAMPLING_KEYS,
    nemo_rl_outputs,
    sampling_params,
    with_sampling,
)
from genworker.core.refit_protocol import Transport
from genworker.shell.errors import (
    BadArgumentError,
    EngineStateError,
    GenworkerError,
    unwrap,
)
from genworker.shell.nemo_rl_member import NemoRlMember
from genworker.shell.spine import checked_join
from genworker.shell.worker import VllmGenerationWorker as NativeWorker

if TYPE_CHECKING:  # typings/ray
    from ray.actor import ActorClass, ActorHandle

__all__ = [
    "NEMO_RL_OUTPUT_KEYS",
    "SAMPLING_KEYS",
    "NemoRlActorClass",
    "NemoRlGenerationWorker",
    "NemoRlMember",
    "VllmAsyncGenerationWorker",
    "VllmGenerationWorker",
]


@runtime_checkable
class NemoRlActorClass(Protocol):
    """What NeMo-RL builds its workers from: Ray's actor class of a NeMo-RL worker class
    (``ray.remote(cls)``, an ``ActorClass`` that subclasses ``cls`` and so keeps its static
    methods). NeMo-RL calls ``configure_worker`` on it, then ``options(...).remote(...)``."""

    @staticmethod
    def configure_worker(
        num_gpus: float,
        bundle_indices: tuple[int, Sequence[int]] | None = None,
        num_gpus_per_node: int | None = None,
    ) -> tuple[dict[str, object], dict[str, str], dict[str, object], dict[str, object]]: ...

    def options(self, **actor_options: object) -> ActorClass: ...

    def remote(self, *args: object, **kwargs: object) -> ActorHandle: ...


# Made on first use by the module __getattr__ below (Ray imported then).
VllmGenerationWorker: NemoRlActorClass
VllmAsyncGenerationWorker: NemoRlActorClass

log = logging.getLogger(__name__)


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
        return nemo_rl_outputs(worker.generate(data, greedy))

    def generate_text(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> dict[str, list[str]]:
        worker = self._owner("generate_text")
        return worker.generate_text(data, greedy)

    def update_sampling_params(self, **params: object) -> bool:
        """NeMo-RL's ``update_sampling_params`` (#2538): the config's sampling keys
        (:data:`SAMPLING_KEYS`) take these values for every later call; True once done.
        Other names and bad values are refused naming them, and change nothing."""
        unwrap(sampling_params(params), BadArgumentError, "")
        if self._shut_down:
            raise EngineStateError("update_sampling_params: the worker was shut down")
        cfg = unwrap(with_sampling(self.cfg, params), BadArgumentError, "update_sampling_params")
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
        tags = self._wake_up_tags("wake_up", kwargs)
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
        join = checked_join(group_join(rank_prefix, ip, port, world_size, train_world_size))
        self._owner("init_collective").init_collective_via("nemo_rl_init_collective", join)

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
        """The engine's metrics keyed by name (NeMo-RL's form); ``{}`` on an inert member,
        which has no engine."""
        if self._worker is None:
            return {}
        return self._by_name(self._owner("_get_raw_spec_counters").get_counters())

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


def __getattr__(name: str) -> NemoRlActorClass:
    """``VllmGenerationWorker`` and ``VllmAsyncGenerationWorker``: the Ray actor classes
    NeMo-RL's ``RayWorkerBuilder`` instantiates by class path (the second when
    ``vllm_cfg.async_engine`` is true), made on first use, so Ray is imported only then
    (a host without Ray, such as the GPU runner, drives :class:`NemoRlGenerationWorker`
    or ``NemoRlAsyncGenerationWorker`` directly). Each is a :class:`NemoRlActorClass`:
    Ray's ``ActorClass`` type alone hides the class's static methods, which its runtime
    subclass keeps (NeMo-RL calls ``<class>.configure_worker(...)`` on it)."""
    cls: type[object]
    if name == "VllmGenerationWorker":
        cls = NemoRlGenerationWorker
    elif name == "VllmAsyncGenerationWorker":
        from genworker.shell.nemo_rl_async import NemoRlAsyncGenerationWorker

        cls = NemoRlAsyncGenerationWorker
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import ray

    actor = ray.remote(cls)
    if not isinstance(actor, NemoRlActorClass):
        raise TypeError(f"Ray's actor class of {cls.__name__} lacks its configure_worker")
    globals()[name] = actor
    return actor
