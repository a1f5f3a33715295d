"""genworker's exception family, and the one way foreign errors become it.

Core returns frozen error values; the shell raises them as one of these exceptions, with
the core value in ``.detail`` when there is one. Foreign errors (vLLM, Ray, ZMQ, NCCL) are
translated at the edge and chained (``raise ... from e``): each edge (a *seam*) declares a
:class:`Seam`, an explicit map from foreign exception types to ours (``core.seams``), and
wraps its calls in ``with translated(SEAM, call):`` (httpcore's ``map_exceptions``). Our own errors and
interrupts (``KeyboardInterrupt``, ``CancelledError``: not ``Exception``) pass unchanged.

The seams declared here are the workers' engine RPCs: :data:`REFIT_RPC` (a refit method's
failure is a :class:`RefitError`: the weights may be inconsistent) and :data:`ENGINE_RPC`
(any other method's is an :class:`EngineRpcError`: nothing about the weights follows).
The engine adapters declare theirs beside the foreign types they know (``vllm_engine``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeAlias, TypeVar

from returns.result import Failure, Result

from genworker.core import seams
from genworker.core.errors import CoreError

_T = TypeVar("_T")
_E = TypeVar("_E", bound=CoreError)

__all__ = [
    "ENGINE_RPC",
    "REFIT_RPC",
    "BadArgumentError",
    "BadBatchError",
    "BadConfigError",
    "EngineContractError",
    "EngineDeadError",
    "EngineRpcError",
    "EngineStateError",
    "GenerationAbortedError",
    "GenworkerError",
    "GroupError",
    "RefitError",
    "RefitManifestError",
    "RefitTimeoutError",
    "RefitTransportError",
    "RefitWireError",
    "RequestAbortedError",
    "Seam",
    "UnsafePickleError",
    "UnsupportedError",
    "fatal",
    "translated",
    "unwrap",
]


class GenworkerError(Exception):
    """Root of every error genworker raises."""

    def __init__(self, message: str, detail: CoreError | None = None) -> None:
        super().__init__(message)
        self.detail = detail

    @classmethod
    def from_core(cls, error: CoreError, context: str = "") -> GenworkerError:
        prefix = f"{context}: " if context else ""
        return cls(f"{prefix}{error}", detail=error)


class BadArgumentError(GenworkerError, ValueError):
    """An argument is invalid; the call changed nothing."""


class BadBatchError(BadArgumentError):
    """The generate/generate_text batch is invalid; nothing was submitted to the engine."""


class EngineContractError(GenworkerError, RuntimeError):
    """The engine returned something its contract forbids (e.g. a row past max_model_len)."""


class GenerationAbortedError(GenworkerError, RuntimeError):
    """The engine raised while running a batch it had admitted; the batch's requests were
    aborted and the engine serves the next call (a dead engine is EngineDeadError)."""


class BadConfigError(GenworkerError, ValueError):
    """The worker configuration is invalid."""


class EngineStateError(GenworkerError, RuntimeError):
    """The call is not allowed in the worker's current lifecycle state."""


class EngineDeadError(GenworkerError, RuntimeError):
    """The engine died; the worker is unusable and must be re-created."""


class EngineRpcError(GenworkerError, RuntimeError):
    """An RPC to the engine workers (not a refit's) failed: the message names the method."""


class UnsupportedError(GenworkerError, NotImplementedError):
    """The operation is not supported on this platform or vLLM version."""


class RefitError(GenworkerError, RuntimeError):
    """A weight refit failed; the worker's weights are inconsistent until a refit succeeds."""


class RefitManifestError(RefitError, ValueError):
    """The refit stream did not match the manifest (missing, extra, wrong shape or dtype)."""


class RefitTimeoutError(RefitError, TimeoutError):
    """A refit wait (named in the message) passed its bound."""


class RefitTransportError(RefitError):
    """A refit transport failed (a gloo/NCCL/ZMQ error, a lost peer): its text and peer."""


class RequestAbortedError(GenworkerError, RuntimeError):
    """A request ended before it finished (an in-flight refit in ``abort`` mode, or the
    engine aborted it); the message names the row and why."""


class GroupError(GenworkerError, RuntimeError):
    """A generation-group shard failed; the message names the shard."""


def unwrap(result: Result[_T, _E], error: type[GenworkerError], context: str) -> _T:
    """The value of a core ``Result``, or ``error`` raised with the core error as detail."""
    if isinstance(result, Failure):
        raise error.from_core(result.failure(), context)
    return result.unwrap()


class RefitWireError(RefitError, ValueError):
    """A refit message is not what its wire carries (malformed, or of the wrong shape)."""


class UnsafePickleError(RefitWireError):
    """A pickled refit message names a callable outside the wire's allowlist; it was refused
    before any object was built."""


#: One edge's map of foreign errors to ours (``core.seams``).
Seam: TypeAlias = seams.Seam[GenworkerError]


@contextmanager
def translated(seam: Seam, call: str) -> Iterator[None]:
    """Raise what ``seam`` maps a foreign ``Exception`` of the block to, chained; our own
    errors and interrupts pass unchanged."""
    try:
        yield
    except GenworkerError:
        raise
    except Exception as e:
        error = seam.translate(call, e)
        if error is None:
            raise
        raise error from e


REFIT_RPC = Seam(
    "refit rpc",
    other=lambda call, e: RefitError(f"{call} failed on the engine workers: {e}"),
)
"""A refit method's RPC (``prepare_refit_info``, ``update_weights_*``, the relay's...)."""

ENGINE_RPC = Seam(
    "engine rpc",
    other=lambda call, e: EngineRpcError(f"{call} failed on the engine workers: {e}"),
)
"""Any other RPC to the engine workers."""


@contextmanager
def fatal(call: str, seam: Seam, died: Callable[[EngineDeadError], None]) -> Iterator[None]:
    """A call whose failure leaves the engine dead (an adapter's sleep or wake: vLLM
    leaves its memory part-mapped, ``vllm_engine``'s module docstring): the block's error
    is mapped through ``seam``, then anything becomes EngineDeadError (the failure its
    cause), recorded by ``died``; an interrupt or a cancellation propagates as itself."""
    try:
        with translated(seam, call):
            yield
    except BaseException as e:
        error = (
            e
            if isinstance(e, EngineDeadError)
            else EngineDeadError(
                f"{call} failed: {type(e).__name__}: {e}; a failed sleep or wake leaves "
                "vLLM's memory part-mapped and its scheduler paused, so the engine is dead"
            )
        )
        died(error)
        if error is e or not isinstance(e, Exception):
            raise
        raise error from e
