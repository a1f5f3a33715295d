"""genworker's exception family.

Core returns frozen error values; the shell raises them as one of these exceptions, with
the core value in ``.detail`` when there is one. Foreign errors (vLLM, Ray, ZMQ, NCCL) are
translated at the edge and chained (``raise ... from e``).
"""

from __future__ import annotations

from typing import TypeVar

from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

_T = TypeVar("_T")
_E = TypeVar("_E", bound=CoreError)

__all__ = [
    "BadArgumentError",
    "BadBatchError",
    "BadConfigError",
    "EngineContractError",
    "EngineDeadError",
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
    "UnsafePickleError",
    "UnsupportedError",
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
    match result:
        case Success(value):
            return value  # type: ignore[no-any-return]
        case Failure(problem):
            raise error.from_core(problem, context)
    raise AssertionError("unreachable")


class RefitWireError(RefitError, ValueError):
    """A refit message is not what its wire carries (malformed, or of the wrong shape)."""


class UnsafePickleError(RefitWireError):
    """A pickled refit message names a callable outside the wire's allowlist; it was refused
    before any object was built."""
