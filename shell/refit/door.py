"""The one door every refit family goes through on the engine side: the
:class:`RefitBackend` interface, the registry of backends, and :class:`Door`, the one
state an engine worker keeps for all of them. Modelled on vLLM's weight transfer
(``vllm/distributed/weight_transfer/``: ``WeightTransferEngine`` with
``init_transfer_engine`` / ``receive_weights`` / ``shutdown``, and
``WeightTransferEngineFactory.register_engine(name, module, class)``, which imports a
backend's module only when a worker first asks for it). How a backend is built and
raises, and how to add one: docs/design.md, "The refit path" and "Where things go".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from genworker.shell.errors import BadArgumentError, GenworkerError
from genworker.shell.refit.engine import EngineContext
from genworker.shell.refit.wire import failure

__all__ = ["BACKENDS", "Door", "Holding", "RefitBackend", "register_backend"]


class RefitBackend(Protocol):
    """One refit family's engine end, answering five verbs, each a plain-valued call:
    ``init`` sets up or re-sets up the transport (join a group, bind or connect a socket,
    take a plan; idempotent where its transport is), ``receive`` takes one refit into the
    engine (every wait bounded), ``status`` says what a caller checks (addresses, counts,
    why weights diverged), ``release`` gives the trainer's memory back (how many mappings
    it let go), ``close`` lets go of everything (how many transports it closed;
    idempotent). Each backend takes its own arguments for ``init``, ``receive`` and
    ``status``."""

    @property
    def init(self) -> Callable[..., object]: ...

    @property
    def receive(self) -> Callable[..., object]: ...

    @property
    def status(self) -> Callable[..., object]: ...

    def release(self) -> int: ...

    def close(self) -> int: ...


class Closable(Protocol):
    def close(self) -> object: ...


T = TypeVar("T", bound=Closable)


class Holding(Generic[T]):
    """A backend whose transport is one object it holds (a port, a group) in ``held``:
    nothing of the trainer's stays mapped between refits, and ``close`` closes it."""

    held: T | None = None

    def release(self) -> int:
        return 0  # each refit's buffers are the receiver's own, or let go once answered

    def close(self) -> int:
        held, self.held = self.held, None
        if held is not None:
            held.close()
        return int(held is not None)


Factory = Callable[[EngineContext], RefitBackend]

#: Every backend's name and how to build it (imported on first use).
BACKENDS: dict[str, Callable[[], Factory]] = {}


def register_backend(name: str, module_or_factory: str | Factory, cls: str = "") -> None:
    """Register backend ``name``: ``(module path, class name)``, imported on first use,
    or a factory itself; a name registered twice is a ``BadArgumentError``."""
    if name in BACKENDS:
        raise BadArgumentError(f"refit backend {name!r} is already registered")
    if isinstance(module_or_factory, str):
        path = module_or_factory
        BACKENDS[name] = lambda: getattr(importlib.import_module(path), cls)
    else:
        factory = module_or_factory
        BACKENDS[name] = lambda: factory


register_backend("ipc", "genworker.shell.refit.ipc", "IpcBackend")
register_backend("collective", "genworker.shell.refit.collective", "CollectiveBackend")
register_backend("nemo_rl_ipc", "genworker.shell.refit.nemo_rl", "NemoRlIpcBackend")
register_backend("nemo_rl_collective", "genworker.shell.refit.nemo_rl", "NemoRlCollectiveBackend")
register_backend("sparse", "genworker.shell.refit.sparse", "SparseBackend")
register_backend("reshard", "genworker.shell.refit.reshard", "ReshardBackend")
register_backend("lora", "genworker.shell.refit.lora", "LoraBackend")
register_backend("vllm_wire", "genworker.shell.refit.vllm_wire", "VllmWireBackend")


class Door:
    """An engine worker's one refit state: its context and the backends it opened."""

    def __init__(self, worker: object) -> None:
        self.engine = EngineContext(worker)
        self.backends: dict[str, RefitBackend] = {}

    def backend(self, name: str) -> RefitBackend:
        """Backend ``name``, built on first use."""
        if name not in self.backends:
            if name not in BACKENDS:
                raise BadArgumentError(f"no refit backend {name!r}; registered: {sorted(BACKENDS)}")
            self.backends[name] = BACKENDS[name]()(self.engine)
        return self.backends[name]

    def call(self, verb: str, name: str, *args: object, **kwargs: object) -> object:
        """``verb`` of backend ``name``, a typed error returned as a failure value."""
        try:
            method: Callable[..., object] = getattr(self.backend(name), verb)
            return method(*args, **kwargs)
        except GenworkerError as e:
            return failure(e)

    def close(self, names: tuple[str, ...]) -> int:
        """Close backends ``names`` (every open one when empty); how many transports
        they closed. Each one closes what it can before raising."""
        if unknown := sorted(set(names) - set(BACKENDS)):
            raise BadArgumentError(f"no refit backends {unknown} to close")
        opened = [self.backends.pop(n) for n in names or tuple(self.backends) if n in self.backends]
        return sum(backend.close() for backend in opened)
