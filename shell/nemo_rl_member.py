"""What NeMo-RL's two drop-ins share (:mod:`genworker.shell.nemo_rl` for the synchronous
worker, :mod:`genworker.shell.nemo_rl_async` for the async one): :class:`NemoRlMember`, one
member of a NeMo-RL worker group over a genworker worker (the tied-group rules, the config
checks, refit bookkeeping and errors, as :mod:`genworker.shell.nemo_rl`'s docstring
describes); what both translate (output keys, sampling keys, refusals) is in
``core.nemo_rl_front``. Its own module so that the two drop-ins import it and not each other."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Generic, TypeVar

from genworker.core import lifecycle
from genworker.core.config import WorkerConfig
from genworker.core.nemo_rl_front import raw_spec_counters, wake_up_tags
from genworker.core.placement import plan_engine_env
from genworker.core.refit_protocol import Transport, wait_bound
from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import (
    BadArgumentError,
    BadConfigError,
    EngineContractError,
    EngineStateError,
    GenworkerError,
    unwrap,
)
from genworker.shell.nemo_rl_batches import require_batch_modules
from genworker.shell.refit.nemo_rl import DEFAULT_SOCKET_DIR
from genworker.shell.spine import checked_env_names
from genworker.shell.worker import VllmGenerationWorker as NativeWorker

__all__ = ["NemoRlMember"]

log = logging.getLogger(__name__)


#: the genworker worker a drop-in wraps: what :class:`NemoRlMember` needs of it (the
#: spine's config, state, capabilities, engine and liveness, and ``load_model``) both have
_W = TypeVar("_W", NativeWorker, AsyncVllmGenerationWorker)


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

    def _sleep_is_a_no_op(self, worker: _W, call: str) -> bool:
        """Whether ``call`` (sleep or wake) is the documented no-op of a platform without
        vLLM's sleep mode; the first such call logs one warning (module docstring)."""
        caps = worker.caps
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

    @staticmethod
    def _wake_up_tags(call: str, kwargs: Mapping[str, object]) -> Sequence[str] | None:
        """NeMo-RL's ``wake_up(tags=...)``: any other keyword is refused by name."""
        return unwrap(wake_up_tags(call, kwargs), BadArgumentError, "")

    @staticmethod
    def _by_name(encoded: Mapping[str, float | list[float]]) -> dict[str, float | list[float]]:
        """The engine's metrics keyed by name (``core.nemo_rl_front.raw_spec_counters``)."""
        return unwrap(raw_spec_counters(encoded), EngineContractError, "engine metrics")

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
