"""Errors across processes, and the refit wire's typed edge: an engine worker's failure
crosses vLLM's ``collective_rpc`` as a kind and a message (:func:`failure`,
:func:`raise_failures`; vLLM's multiprocess executor and ``AsyncLLM`` turn a raised error
into text), and a message off the wire (``core.refit_wire``: events as msgpack, never
pickle) that does not decode is a :class:`RefitError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from genworker.core import refit_protocol as p
from genworker.core import refit_wire as w
from genworker.shell.errors import (
    BadArgumentError,
    BadConfigError,
    EngineStateError,
    GenworkerError,
    RefitError,
    RefitManifestError,
    RefitTimeoutError,
    RefitTransportError,
    unwrap,
)

__all__ = ["KINDS", "decode", "decode_reply", "error_of", "failure", "kind_of", "raise_failures"]


def decode(
    data: bytes | memoryview, memo: dict[int, w.Listing]
) -> tuple[p.Event, list[w.Handle] | None]:
    """The event and a chunk's handles (``core.refit_wire.decode``), ``memo`` taking a
    chunk's listing; a :class:`RefitError` off the schema."""
    event, known = unwrap(w.decode(data, memo), RefitError, "")
    if known is None or not isinstance(event, p.Chunk):
        return event, None
    memo[event.index] = known
    return event, known[3]


def decode_reply(data: bytes, peer: str) -> w.Reply:
    return unwrap(w.decode_reply(data, peer), RefitError, "")


_KINDS: Final[tuple[tuple[str, type[GenworkerError]], ...]] = (
    ("manifest", RefitManifestError),
    ("timeout", RefitTimeoutError),
    ("transport", RefitTransportError),
    ("refit", RefitError),
    ("state", EngineStateError),
    ("argument", BadArgumentError),
    ("config", BadConfigError),
)
KINDS: Final = tuple(kind for kind, _ in _KINDS)


def kind_of(error: BaseException) -> str:
    """The wire name of an error's type (``refit`` for anything untyped)."""
    return next((kind for kind, cls in _KINDS if isinstance(error, cls)), "refit")


def error_of(kind: str, message: str) -> GenworkerError:
    """The typed error for a kind from :func:`kind_of`."""
    return dict(_KINDS).get(kind, RefitError)(message)


def failure(error: BaseException) -> dict[str, object]:
    """An engine worker's failed call as a plain value (see :func:`raise_failures`)."""
    return {"error": kind_of(error), "message": str(error)}


def raise_failures(results: Sequence[object], call: str) -> list[object]:
    """``results`` of a ``collective_rpc``, or the typed error of the first engine worker
    that failed (a :func:`failure` value), naming the worker."""
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "error" in result:
            message = f"{call} failed on engine worker {rank}: {result.get('message', '')}"
            raise error_of(str(result["error"]), message)
    return list(results)
