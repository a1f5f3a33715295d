"""The class vLLM mixes into its workers: the refit door, the manifest, device id, the
wake, the fp8 start.

vLLM appends ``worker_extension_cls`` to its worker's bases and refuses attributes that
clash (``vllm/v1/worker/worker_base.py``, 0.32); every method is a ``collective_rpc``
target with plain msgpack-able arguments and results (no
``VLLM_ALLOW_INSECURE_SERIALIZATION``), all state on the instance under one attribute (a
:class:`~genworker.shell.refit.door.Door`), so any caller (the worker, ``AsyncLLM``)
drives a refit the same way: the five verbs of docs/design.md's "The refit path", a
failure coming back as a plain value (``refit.wire.failure``). fp8 is not a backend but
a hook on the engine's weight loader (:mod:`genworker.shell.fp8`) plus a once-per-engine
start (:meth:`prepare_fp8`). Today's target names stay for one release, each one line
onto the door (the table at the end of :class:`WorkerExtension`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from genworker.shell import cumem_wake, fp8
from genworker.shell.refit.door import Door
from genworker.shell.refit.engine import engine_params
from genworker.shell.refit.memory import device_id
from genworker.shell.refit.wire import failure

__all__ = ["WorkerExtension", "door_of"]

_SLOT: Final = "_genworker_refit_door"


def door_of(worker: object) -> Door:
    """The worker's one refit state (made on first use)."""
    door = worker.__dict__.get(_SLOT)
    if door is None:
        door = worker.__dict__[_SLOT] = Door(worker)
    assert isinstance(door, Door)
    return door


def _alias(verb: str, *fixed: str, first: str = "", returns: object = ...) -> Callable[..., Any]:
    """A legacy target: ``refit_<verb>(*fixed, *args)``, the first argument passed as
    keyword ``first`` where given, the answer replaced by ``returns`` where given."""

    def call(self: WorkerExtension, *args: object, **kwargs: object) -> object:
        if first and args:
            kwargs, args = {first: args[0], **kwargs}, args[1:]
        answer = getattr(self, f"refit_{verb}")(*fixed, *args, **kwargs)
        return answer if returns is ... or isinstance(answer, dict) else returns

    return call


class WorkerExtension:
    """Mixed into each vLLM worker; every method is a ``collective_rpc`` target."""

    # -- the door ------------------------------------------------------------------

    def refit_init(self, backend: str, *args: object, **kwargs: object) -> object:
        """Set up ``backend``'s transport (see ``shell/refit/door.py``)."""
        return door_of(self).call("init", backend, *args, **kwargs)

    def refit_receive(self, backend: str, *args: object, **kwargs: object) -> object:
        """Receive one refit through ``backend`` into the engine."""
        return door_of(self).call("receive", backend, *args, **kwargs)

    def refit_status(self, backend: str, *args: object) -> object:
        """What ``backend`` reports (addresses, counts, divergence)."""
        return door_of(self).call("status", backend, *args)

    def refit_release(self, backend: str) -> object:
        """Let go of the trainer's memory ``backend`` maps; how many mappings."""
        return door_of(self).call("release", backend)

    def refit_close(self, *backends: str) -> object:
        """Close ``backends`` (every open one when none is named); idempotent."""
        try:
            return door_of(self).close(backends)
        except Exception as e:  # noqa: BLE001 -- a close that failed, told as a value
            return failure(e)

    # -- engine-wide -----------------------------------------------------------------

    def prepare_refit_info(self, info: Mapping[str, object]) -> dict[str, object]:
        """Record the manifest of every later refit: ``{name: (shape, dtype)}``."""
        return door_of(self).engine.prepare(info)

    def refit_configure(self, finite_check: bool) -> bool:
        """Whether refits are checked for NaN and inf (``vllm_cfg.refit_finite_check``)."""
        door_of(self).engine.finite_check = bool(finite_check)
        return door_of(self).engine.finite_check

    def refit_hold(self, held: bool, wait_s: float) -> object:
        """Hold the weights for a batch (``held``) or let them go (``WeightsGate``)."""
        try:
            door_of(self).engine.gate.hold(bool(held), float(wait_s))
        except Exception as e:  # noqa: BLE001 -- told as a value, raised typed by the worker
            return failure(e)
        return True

    def refit_reset_kv(self) -> int:
        """Zero the KV cache memory after a refused or failed refit; how many tensors."""
        return door_of(self).engine.reset_kv()

    def engine_param_layout(self) -> dict[str, list[object]]:
        """``{name: [shape, dtype]}`` of the parameters a refit can write directly."""
        engine = door_of(self).engine
        params = engine_params(engine.model(), engine.params())
        return {e.name: [list(e.spec.shape), e.spec.dtype] for e in params if e.writable}

    def report_device_id(self) -> str:
        """``GPU-<uuid>`` of this worker's GPU (``cpu@<host>`` on CPU)."""
        return device_id(door_of(self).engine.device)

    def install_wake(self) -> bool:
        """:func:`cumem_wake.install` in this worker's process: True when the wake is
        genworker's."""
        return cumem_wake.install()

    def prepare_fp8(self, checkpoint_format: str | None) -> str | None:
        """:func:`fp8.prepare` in this engine worker (its model and its loader): the
        checkpoint read in ``checkpoint_format`` (``core.engine_plan.fp8_start``; ``None``:
        the weights come by refit)."""
        engine = door_of(self).engine
        return fp8.prepare(engine.model(), engine.loader, self, checkpoint_format)

    # -- today's targets, one line each onto the door: remove next release -------------

    refit_address = _alias("init", "ipc")
    update_weights_via_ipc_zmq = _alias("receive", "ipc")
    release_refit_buffers = _alias("release", "ipc")
    init_collective = _alias("init", "collective")
    update_weights_from_collective = _alias("receive", "collective")
    cleanup = _alias("close", returns=None)
    nemo_rl_ipc_socket_dir = _alias("init", "nemo_rl_ipc")
    nemo_rl_update_weights_via_ipc_zmq = _alias("receive", "nemo_rl_ipc")
    nemo_rl_init_collective = _alias("init", "nemo_rl_collective")
    nemo_rl_update_weights_from_collective = _alias("receive", "nemo_rl_collective")
    nemo_rl_cleanup = _alias("close", "nemo_rl_ipc", "nemo_rl_collective", returns=None)
    start_sparse_relay = _alias("init", "sparse")
    configure_sparse_relay = _alias("init", "sparse", first="relay_addresses")
    sparse_relay_status = _alias("status", "sparse")
    sparse_relay_checksums = _alias("status", "sparse", "checksums")
    stop_sparse_relay = _alias("close", "sparse", returns=True)
    init_nccl_reshard_comm_group = _alias("init", "reshard")
    prepare_nccl_reshard_refit_info = _alias("init", "reshard", first="refit_info")
    nccl_reshard_refit = _alias("receive", "reshard")
    close_nccl_reshard_comm_group = _alias("close", "reshard")
