"""The engine side of the sparse-delta refit: one relay receiver per engine worker.

:class:`SparseRefitMixin` is a base of :class:`~genworker.shell.extension.WorkerExtension`;
its methods are ``collective_rpc`` targets with plain arguments and results. Each engine
worker runs a :class:`~genworker.shell.sparse.SparseReceiver` on a daemon thread: it takes
a step from its parent, forwards every verified message to its children *before*
applying it, rebuilds the step's bits in its own copy and checks them piece by piece
against the trainer's hashes (``core.delta.bits_hash``); only a step verified in full
reaches the engine, through :class:`EngineTarget`:

- tensors whose layout equals a parameter's (the refit protocol's routes,
  ``core.refit_protocol.plan_routes`` over ``extension.engine_params``, kept as the IPC
  path keeps them) are copied straight into parameter memory, followed by their modules'
  post-load processing (``extension.EngineSink``); the parameter's bytes are then
  compared with the verified bits, so a write that did not land is caught;
- the others go through the engine's weight loader (``extension._loader``: vLLM's
  layerwise reload, or ``load_weights``), one loader call per step. A loader may fuse,
  cast or re-pack what it is given, so for those the checksum is that of the bits handed
  to it.

The receiver answers its parent only after that. Any step the receiver refused or that
failed here (a corrupted frame, a checksum, a missing frame, a dead parent, the loader)
marks the engine *diverged*: ``sparse_relay_status`` says so and the generation worker
refuses to serve (``SparseRefitError``) until a full refit succeeds, a full sparse step
(the sender's next step after any failure is full) or an IPC/collective refit. The
receiver keeps its copy of the bits (host memory, the model's size in the refit's dtypes).

Steps arrive when the trainer sends them, on the receiver's thread: like NeMo-RL's relay,
the trainer sends between generations (the worker resets its caches and counts the
refit at its next call, from ``applied``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import attrs
import torch

from genworker.core import refit_protocol as p
from genworker.core.delta import bit_pattern, tensor_checksum
from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.shell.errors import EngineStateError, GenworkerError, RefitError
from genworker.shell.refit.wire import failure
from genworker.shell.sparse import SparseReceiver

if TYPE_CHECKING:
    from genworker.shell.extension import EngineSink
    from genworker.shell.refit.receiver import Loader

__all__ = ["EngineTarget", "SparseRefitMixin"]

log = logging.getLogger(__name__)

_STATE: Final = "_genworker_sparse_state"


@attrs.define
class _SparseState:
    receiver: SparseReceiver | None = None
    applied: int = 0  # sparse steps applied into the engine
    step: int | None = None  # the sender's number of the last one
    diverged: str = ""  # why the engine's weights cannot be vouched for; '' when they can
    diverged_at: int = -1  # the engine's IPC/collective refit count when it diverged
    lock: threading.Lock = attrs.Factory(threading.Lock)


def _sparse(worker: object) -> _SparseState:
    state = worker.__dict__.get(_STATE)
    if state is None:
        state = worker.__dict__[_STATE] = _SparseState()
    assert isinstance(state, _SparseState)
    return state


def _refit_version(worker: object) -> int:
    """How many IPC/collective refits the engine took (``extension._RefitState``)."""
    from genworker.shell.extension import _state

    return _state(worker).version


def _checksum(tensor: torch.Tensor) -> int:
    return tensor_checksum(bit_pattern(tensor.detach().cpu().contiguous()))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


class EngineTarget:
    """A verified sparse step into the engine's parameters (see the module docstring)."""

    def __init__(self, worker: object) -> None:
        self._worker = worker
        self._sink: EngineSink | None = None
        self._direct: list[str] = []
        self._loaded: list[tuple[str, torch.Tensor]] = []
        self._loader: Loader | None = None
        self._step = -1
        self._routes = p.Routes()

    def begin(self, step: int, specs: Sequence[TensorSpec]) -> None:
        from genworker.shell import extension as ext

        self._step = step
        worker = self._worker
        manifest = Manifest.from_specs(specs).unwrap()  # the receiver checked it
        routed = ext._routed(worker, manifest, ext._tp_size(worker) == 1)
        self._loader = ext._loader(worker) if len(routed.routes.direct) < len(manifest) else None
        self._sink, self._routes = ext.EngineSink(routed, ext._device(worker)), routed.routes
        self._direct, self._loaded = [], []

    def apply(self, name: str, tensor: torch.Tensor) -> None:
        assert self._sink is not None
        if name not in self._routes.direct:
            self._loaded.append((name, tensor))  # borrowed until finish(), which loads it
            return
        target = self._sink.target(name)
        staged = tensor.to(target.device)  # the verified bits on the parameter's device
        target.copy_(staged.reshape(target.shape))
        # Compared where the parameter lives: a GPU engine reads nothing back to the host.
        if not torch.equal(_bytes(target), _bytes(staged)):
            raise RefitError(
                f"{name!r} in parameter memory differs from the verified bits after the write "
                f"(CRC-32 {_checksum(target):#010x}, verified {_checksum(tensor):#010x})"
            )
        self._direct.append(name)

    def finish(self) -> None:
        assert self._sink is not None
        if self._loaded:
            assert self._loader is not None
            self._loader(iter(self._loaded))
        self._sink.finish(self._direct)
        self._loaded = []
        state = _sparse(self._worker)
        with state.lock:
            state.applied += 1
            state.step = self._step
            state.diverged = ""


class SparseRefitMixin:
    """The sparse relay's ``collective_rpc`` targets (one receiver per engine worker)."""

    def start_sparse_relay(self, host: str = "127.0.0.1", allow_remote: bool = False) -> object:
        """Start this engine worker's relay receiver (once; later calls return the same
        address): the address a sender or a parent relay node sends to."""
        state = _sparse(self)
        with state.lock:
            if state.receiver is None:
                try:
                    receiver = SparseReceiver(
                        EngineTarget(self),
                        host=str(host),
                        allow_remote=bool(allow_remote),
                        on_diverge=lambda why: self._sparse_diverged(why),
                    )
                except GenworkerError as e:
                    return failure(e)
                except Exception as e:  # noqa: BLE001 -- e.g. a port in use, told as a value
                    return failure(RefitError(f"the sparse relay could not bind {host}: {e}"))
                state.receiver = receiver.start()
            return state.receiver.address

    def configure_sparse_relay(self, relay_addresses: Sequence[str] | None) -> object:
        """Take only steps planned over exactly ``relay_addresses`` (``None``: any plan
        naming this receiver)."""
        receiver = _sparse(self).receiver
        if receiver is None:
            return failure(EngineStateError("configure the sparse relay after starting it"))
        try:
            receiver.expect_relay(None if relay_addresses is None else list(relay_addresses))
        except GenworkerError as e:
            return failure(e)
        return receiver.address

    def sparse_relay_status(self) -> dict[str, object]:
        """What the worker checks before serving: the receiver's address, the sparse
        steps applied, the last one's number, frames taken per step, and why the weights
        diverged ('' when they did not, or a full refit came after)."""
        state = _sparse(self)
        receiver = state.receiver
        with state.lock:
            if state.diverged and _refit_version(self) != state.diverged_at:
                state.diverged = ""  # an IPC/collective refit replaced every weight since
            return {
                "address": None if receiver is None else receiver.address,
                "applied": state.applied,
                "step": state.step,
                "diverged": state.diverged,
                "frames": {} if receiver is None else dict(receiver.frames_received),
            }

    def sparse_relay_checksums(self) -> dict[str, int]:
        """CRC-32 of each tensor of the last applied step as this engine holds it: its
        parameter memory where it went direct, the receiver's verified bits otherwise."""
        from genworker.shell import extension as ext

        receiver = _sparse(self).receiver
        if receiver is None:
            return {}
        params = ext._entries(ext._model(self))[0]
        routed = ext._state(self).routed
        direct = routed.routes.direct if routed is not None else frozenset()
        return {
            name: _checksum(params[name]) if name in direct else tensor_checksum(bits)
            for name, bits in receiver._bits.items()
        }

    def stop_sparse_relay(self) -> bool:
        """Close this engine worker's relay receiver; idempotent."""
        state = _sparse(self)
        with state.lock:
            receiver, state.receiver = state.receiver, None
        if receiver is not None:
            receiver.close()
        return True

    def _sparse_diverged(self, why: str) -> None:
        state = _sparse(self)
        with state.lock:
            state.diverged, state.diverged_at = why, _refit_version(self)
