"""What genworker's refit transports decide besides the protocol: the small rules of
``shell/refit/``'s sockets and groups, as plain values.

- A receiver binds a TCP socket on a loopback address unless told otherwise
  (:func:`is_loopback`, :func:`bind_refusal`); its inbound messages are capped
  (:func:`message_cap`: ZMQ drops a larger one's connection unread).
- A foreign error inside a weight-update group (torch's, gloo's, NCCL's) is a timeout when
  it says so or came at its bound, else a transport failure with its text
  (:func:`foreign_failure`: an error at the bound is taken for its expiry).
- A weight-update group runs on NCCL on CUDA and on gloo elsewhere
  (:func:`collective_backend`); a rank's claim in one is checked before any socket opens
  (:func:`group_claim`).
- A sender's Begin carries its manifest's digest, or '' when it was given none
  (:func:`sender_digest`).
- A status round (``CollectiveGroup.settle``): every rank all-reduces one code (0: ok,
  else its error's kind, :func:`status_code`); when any rank failed, every rank
  all-gathers its message in a fixed-size frame (:func:`status_frame`), and the round's
  failure names each failed rank and its message, typed as the first one's kind
  (:func:`group_failure`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Final

import attrs
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError
from genworker.core.refit_plan import Manifest
from genworker.core.refit_protocol import GroupClaim, max_message_bytes, topology_problems

__all__ = [
    "MIN_MESSAGE_CAP",
    "STATUS_FRAME_BYTES",
    "ForeignFailure",
    "bind_refusal",
    "collective_backend",
    "foreign_failure",
    "group_claim",
    "group_failure",
    "is_loopback",
    "message_cap",
    "sender_digest",
    "status_code",
    "status_failures",
    "status_frame",
]

#: A receiver's inbound message cap at least (and before ``prepare_refit_info``).
MIN_MESSAGE_CAP: Final = 1 << 20
#: A rank's message in a failed status round, truncated or padded with NULs to this size.
STATUS_FRAME_BYTES: Final = 1024
#: A foreign error this close to its bound (a fraction of it) is taken for a timeout.
_AT_THE_BOUND: Final = 0.95


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback IP address."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_refusal(what: str, host: str | None, *, allow_remote: bool, note: str = "") -> str | None:
    """Why ``what`` may not listen on ``host`` (None: it may; ``host`` None: no TCP at
    all): another host than loopback only when ``allow_remote``; ``note`` adds to why."""
    if host is None or allow_remote or is_loopback(host):
        return None
    return (
        f"refusing to bind {what} on {host}: not a loopback address "
        f"(pass allow_remote=True to expose it{note})"
    )


def collective_backend(device_type: str) -> str:
    """The backend of a weight-update group on a ``device_type`` device: NCCL on CUDA, else gloo."""
    return "nccl" if device_type == "cuda" else "gloo"


def group_claim(
    ip: str, port: int, rank: int, sizes: tuple[int, int], role: str, device_type: str
) -> Result[GroupClaim, CoreError]:
    """Rank ``rank``'s claim, as ``role``, in the group at ``ip:port`` of ``sizes`` (its
    world size, its trainer ranks) on a ``device_type`` device, or what makes that place
    impossible (:func:`~genworker.core.refit_protocol.topology_problems`, joined)."""
    claim = GroupClaim(rank, *sizes, collective_backend(device_type), role)
    problems = topology_problems(ip, port, claim)
    return Failure(CoreError("; ".join(problems))) if problems else Success(claim)


def message_cap(manifest: Manifest | None) -> int:
    """The inbound message cap of a receiver of ``manifest`` (None: before one)."""
    return max(MIN_MESSAGE_CAP, max_message_bytes(manifest) if manifest else 0)


def sender_digest(manifest: object) -> Result[str, CoreError]:
    """The digest of the manifest a sender was given: a :class:`Manifest`, the
    ``{name: (shape, dtype)}`` of ``prepare_refit_info``, or None ('')."""
    if manifest is None:
        return Success("")
    if isinstance(manifest, Mapping):
        return Manifest.from_info(manifest).map(Manifest.digest)
    if isinstance(manifest, Manifest):
        return Success(manifest.digest())
    return Failure(CoreError(repr(manifest)))


@attrs.frozen
class ForeignFailure:
    """A foreign error as ours: a timeout (``timed_out``) or a transport failure."""

    timed_out: bool
    message: str


def foreign_failure(
    what: str, peer: str, bound_s: float, elapsed_s: float, error: tuple[str, str], *, timeout: bool
) -> ForeignFailure:
    """A foreign ``error`` (its type's name, its text) raised while ``what`` ran on ``peer``
    ``elapsed_s`` into its bound ``bound_s``; ``timeout``: the error is a timeout."""
    kind, text = error
    if timeout or elapsed_s >= _AT_THE_BOUND * bound_s:
        return ForeignFailure(True, f"{what} on {peer}: not done within {bound_s:g}s ({text})")
    return ForeignFailure(False, f"{what} on {peer} failed after {elapsed_s:.1f}s: {kind}: {text}")


def status_code(kind: str | None, kinds: Sequence[str]) -> int:
    """A rank's code in a status round: 0 when ``kind`` is None (ok), else its error's
    kind's place in ``kinds`` plus one."""
    return 0 if kind is None else kinds.index(kind) + 1


def status_failures(codes: Sequence[int], kinds: Sequence[str]) -> dict[int, str]:
    """The ranks that failed a status round (their codes, all-reduced), each one's kind."""
    return {rank: kinds[code - 1] for rank, code in enumerate(codes) if code}


def status_frame(message: str) -> bytes:
    """A rank's message in a failed status round, in :data:`STATUS_FRAME_BYTES` bytes."""
    return message.encode()[:STATUS_FRAME_BYTES].ljust(STATUS_FRAME_BYTES, b"\0")


def group_failure(what: str, failed: Mapping[int, str], frames: Sequence[bytes]) -> tuple[str, str]:
    """The kind and message of a status round after ``what`` that ``failed`` (rank: kind),
    from every rank's frame (:func:`status_frame`)."""
    said = (frames[rank].rstrip(b"\0").decode(errors="replace") for rank in failed)
    text = "; ".join(f"rank {r}: {m}" for r, m in zip(failed, said, strict=True))
    return next(iter(failed.values())), f"the weight-update group failed {what}: {text}"
