"""The refit wire format: fixed msgpack schemas, no pickle anywhere.

Every refit, over either transport, is the same sequence of messages from the trainer:
``Begin`` (refit id, manifest digest), one ``BucketMsg`` per bucket, then ``Complete``;
``Abort`` replaces the rest when the trainer itself fails. Messages are msgspec structs
tagged by ``kind`` and decoded against this schema only (a malformed frame is an error
answer, never an object). Buffers travel as handles made of bytes and ints
(:class:`CpuHandle` for a shared-memory file, :class:`CudaHandle` for a CUDA IPC handle),
the way failure-modes §3.1 recommends instead of vLLM's pickled ``rebuild_cuda_tensor``.

A trainer that can send every tensor straight into the engine's memory lists its tensors
in ``Begin.direct`` (:class:`TensorRef` values: name, shape, dtype). The engine checks the
list against the manifest before anything moves; when every tensor is a direct route it
agrees (IPC: the ``Begin`` answer carries an :class:`Offer`; collective: a vote in the
``Begin`` status round), and one :class:`DirectMsg` replaces the buckets and ``Complete``
(see ``refit.ipc`` and ``refit.collective`` for what each transport moves).

Answers are :class:`Reply` values: ``ok`` or an error with its ``kind`` (``manifest``,
``timeout``, ``aborted``, ``error``) and the receiver's message, so the sender raises the
matching typed error with the receiver's own words.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from genworker.core.refit_plan import Bucket, Slot
from genworker.shell.errors import RefitError, RefitManifestError, RefitTimeoutError

__all__ = [
    "PROTOCOL",
    "Abort",
    "Begin",
    "BucketMsg",
    "Complete",
    "CpuHandle",
    "CudaHandle",
    "DirectMsg",
    "Hello",
    "Message",
    "Offer",
    "Reply",
    "TensorRef",
    "WireSlot",
    "bucket_from_wire",
    "bucket_to_wire",
    "decode_message",
    "decode_reply",
    "encode",
    "error_from_reply",
    "error_kind",
]

PROTOCOL: Final = 1

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class WireSlot(msgspec.Struct, array_like=True, frozen=True):
    name: str
    offset: NonNegative
    nbytes: NonNegative
    shape: list[NonNegative]
    dtype: str


class CpuHandle(msgspec.Struct, tag="cpu", frozen=True):
    """A file in a private shared-memory directory, mapped by both sides."""

    path: str
    size: NonNegative
    device_id: str


class CudaHandle(msgspec.Struct, tag="cuda", frozen=True):
    """The fields of ``UntypedStorage._share_cuda_()``; the device index is the receiver's."""

    device_id: str
    handle: bytes
    size: NonNegative
    offset: NonNegative
    ref_counter_handle: bytes
    ref_counter_offset: NonNegative
    event_handle: bytes
    event_sync_required: bool


class TensorRef(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of a direct refit; ``storage``/``offset`` place it in a frame's handles."""

    name: str
    shape: list[NonNegative]
    dtype: str
    storage: NonNegative = 0  # index into the frame's storages
    offset: NonNegative = 0  # byte offset in that storage


class Begin(msgspec.Struct, tag="begin", frozen=True):
    refit_id: str
    manifest_digest: str  # "" when the sender does not know the manifest
    protocol: int = PROTOCOL
    direct: list[TensorRef] | None = None  # the whole stream, when the sender can go direct
    # collective direct refits: broadcasts are issued in NCCL group calls of at most this
    # many bytes (core.refit_plan.broadcast_groups); 0: one call per tensor
    group_bytes: NonNegative = 0


class Offer(msgspec.Struct, frozen=True):
    """The engine's answer to a direct ``Begin`` over IPC.

    ``engine-handles``: ``storages`` map the engine's own parameters, ``tensors`` place
    each manifest tensor in them; the sender writes, then sends a :class:`DirectMsg`
    without storages. ``sender-handles``: the engine cannot export its memory (CUDA
    virtual-memory allocations, as vLLM's sleep mode makes); the sender exports its own
    tensors in the :class:`DirectMsg` and the engine copies from them.
    """

    mode: str
    storages: list[CpuHandle | CudaHandle] = []
    tensors: list[TensorRef] = []


class DirectMsg(msgspec.Struct, tag="direct", frozen=True):
    """Every tensor of a direct refit, in order; ends the refit like ``Complete``."""

    refit_id: str
    tensors: list[TensorRef]
    storages: list[CpuHandle | CudaHandle] = []
    # the sender keeps these storages for later refits: the engine may keep them mapped
    # (until a refit lists other ones or none, or it is told to release them)
    keep: bool = False


class BucketMsg(msgspec.Struct, tag="bucket", frozen=True):
    refit_id: str
    index: NonNegative
    buffer: Annotated[int, msgspec.Meta(ge=0, le=1)]
    used_bytes: NonNegative
    slots: list[WireSlot]
    checksum: int | None = None
    handle: CpuHandle | CudaHandle | None = None  # None on the collective path


class Complete(msgspec.Struct, tag="complete", frozen=True):
    refit_id: str
    buckets: NonNegative
    tensors: NonNegative


class Abort(msgspec.Struct, tag="abort", frozen=True):
    refit_id: str
    message: str


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """One rank's view of the weight-update group, compared by rank 0 at rendezvous."""

    rank: int
    world_size: int
    train_world_size: int
    backend: str
    role: str
    protocol: int = PROTOCOL


class Reply(msgspec.Struct, frozen=True):
    ok: bool
    refit_id: str = ""
    kind: str = "ack"
    message: str = ""
    offer: Offer | None = None


Message = Begin | BucketMsg | Complete | Abort | DirectMsg

_message_decoder: Final = msgspec.msgpack.Decoder(Message)
_reply_decoder: Final = msgspec.msgpack.Decoder(Reply)
_encoder: Final = msgspec.msgpack.Encoder()


def encode(value: msgspec.Struct) -> bytes:
    return _encoder.encode(value)


def decode_message(data: bytes | memoryview) -> Message:
    """Decode a trainer message; :class:`RefitError` on anything off the schema."""
    try:
        return _message_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise RefitError(f"malformed refit message ({len(data)} bytes): {e}") from e


def decode_reply(data: bytes | memoryview, peer: str) -> Reply:
    try:
        return _reply_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise RefitError(f"malformed refit reply from {peer}: {e}") from e


def bucket_to_wire(
    bucket: Bucket,
    refit_id: str,
    *,
    checksum: int | None = None,
    handle: CpuHandle | CudaHandle | None = None,
) -> BucketMsg:
    return BucketMsg(
        refit_id=refit_id,
        index=bucket.index,
        buffer=bucket.buffer,
        used_bytes=bucket.used_bytes,
        slots=[WireSlot(s.name, s.offset, s.nbytes, list(s.shape), s.dtype) for s in bucket.slots],
        checksum=checksum,
        handle=handle,
    )


def bucket_from_wire(msg: BucketMsg) -> Bucket:
    """The core bucket of a message; :class:`RefitError` when a slot is not a valid value."""
    try:
        slots = tuple(Slot(s.name, s.offset, s.nbytes, tuple(s.shape), s.dtype) for s in msg.slots)
        return Bucket(msg.index, msg.buffer, slots, msg.used_bytes)
    except ValueError as e:
        raise RefitError(f"refit bucket {msg.index} has an invalid slot: {e}") from e


def error_kind(error: BaseException) -> str:
    if isinstance(error, RefitManifestError):
        return "manifest"
    if isinstance(error, RefitTimeoutError):
        return "timeout"
    return "error"


def error_from_reply(reply: Reply, context: str) -> RefitError:
    """The typed error a sender raises for a receiver's error answer."""
    cls: type[RefitError] = {
        "manifest": RefitManifestError,
        "timeout": RefitTimeoutError,
    }.get(reply.kind, RefitError)
    return cls(f"{context}: {reply.message}")
