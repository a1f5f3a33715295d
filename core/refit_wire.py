"""The refit wire: :mod:`genworker.core.refit_protocol`'s events as msgpack, never pickle.

A frame is ``[kind, event, handles]``, decoded against the event's own schema (a
malformed frame is a refusal, never an object). Storages travel as handles of bytes
and ints (:class:`CpuHandle`, a shared-memory file; :class:`CudaHandle`, the fields of
``UntypedStorage._share_cuda_()``), as failure-modes §3.1 recommends instead of vLLM's
pickled ``rebuild_cuda_tensor``. A chunk's listing (its tensors, kinds and handles) is
encoded apart from its refit id and index, so a refit sending the same storages and
tensors again sends, and the receiver decodes, the very same bytes once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Final

import msgspec
from returns.result import Failure, Result, Success

from genworker.core import refit_protocol as p
from genworker.core.errors import CoreError

__all__ = [
    "CpuHandle",
    "CudaHandle",
    "Handle",
    "Listing",
    "Reply",
    "decode",
    "decode_reply",
    "encode",
    "encode_chunk",
    "listing",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class CpuHandle(msgspec.Struct, tag="cpu", frozen=True, array_like=True):
    """A file in shared memory (a private staging file, or ``/proc/<pid>/fd/<fd>`` of a
    trainer's tensor); ``inode`` tells two files at one path apart."""

    path: str
    size: NonNegative
    inode: int
    device_id: str


class CudaHandle(msgspec.Struct, tag="cuda", frozen=True, array_like=True):
    """The fields of ``UntypedStorage._share_cuda_()`` in its order, which is
    ``_new_shared_cuda``'s (``memory.open_handle`` passes them on as they are); the device
    index is the receiver's."""

    device_id: str
    handle: bytes
    size: NonNegative
    offset: NonNegative
    ref_counter_handle: bytes
    ref_counter_offset: NonNegative
    event_handle: bytes
    event_sync_required: bool


Handle = CpuHandle | CudaHandle


class Reply(msgspec.Struct, frozen=True):
    """The receiver's answer to every message: ok, or an error's kind and text."""

    ok: bool
    kind: str = ""
    message: str = ""


_KIND: Final = {p.Begin: "begin", p.Chunk: "chunk", p.End: "end", p.Abort: "abort"}
_BODY: Final[dict[str, msgspec.msgpack.Decoder[p.Event]]] = {
    kind: msgspec.msgpack.Decoder(cls) for cls, kind in _KIND.items()
}
_FRAME: Final = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw, msgspec.Raw])
_LISTING: Final = msgspec.msgpack.Decoder(
    tuple[tuple[p.TensorRef, ...], tuple[p.StorageKind, ...], list[Handle] | None]
)
_encoder: Final = msgspec.msgpack.Encoder()
#: A chunk's listing (tensors, kinds, handles), encoded, and decoded: a receiver's memo.
Listing = tuple[bytes, tuple[p.TensorRef, ...], tuple[p.StorageKind, ...], list[Handle] | None]


def listing(chunk: p.Chunk, handles: Sequence[Handle] | None) -> bytes:
    """What a chunk lists, encoded apart from its refit id and index, so a later refit
    sending the same storages and tensors sends these very bytes (:func:`encode_chunk`)."""
    return _encoder.encode((chunk.tensors, chunk.kinds, handles))


def encode_chunk(refit_id: str, index: int, listed: bytes) -> bytes:
    """The frame of chunk ``index`` of a refit that lists ``listed`` (:func:`listing`)."""
    return _encoder.encode(("chunk", p.Chunk(refit_id, index, ()), msgspec.Raw(listed)))


def encode(event: object, handles: Sequence[Handle] | None = None) -> bytes:
    """An event's frame ``[kind, event, listing]`` (a chunk's storage sizes travel in its
    handles), or any other value msgspec encodes (a reply, a group claim)."""
    if type(event) not in _KIND:
        return _encoder.encode(event)
    if isinstance(event, p.Chunk):
        return encode_chunk(event.refit_id, event.index, listing(event, handles))
    return _encoder.encode((_KIND[type(event)], event, None))


def decode(
    data: bytes | memoryview, memo: Mapping[int, Listing]
) -> Result[tuple[p.Event, Listing | None], CoreError]:
    """The event and, for a chunk, its listing (its handles last); refused off the
    schema. A chunk whose listing is byte for byte the one in ``memo`` at its index reuses
    that decoding (the very objects, which later steps compare cheaply); the caller's
    memo takes every listing returned."""
    try:
        kind, body, listed = _FRAME.decode(data)
        event = _BODY[kind].decode(body)
        if not isinstance(event, p.Chunk):
            return Success((event, None))
        raw, known = bytes(listed), memo.get(event.index)
        if known is None or known[0] != raw:
            known = (raw, *_LISTING.decode(raw))
    except (msgspec.DecodeError, KeyError) as error:
        return Failure(CoreError(f"malformed refit message ({len(data)} bytes): {error!r}"))
    _, tensors, kinds, handles = known
    sizes = None if handles is None else tuple(h.size for h in handles)
    return Success((p.Chunk(event.refit_id, event.index, tensors, sizes, kinds), known))


def decode_reply(data: bytes, peer: str) -> Result[Reply, CoreError]:
    """The receiver's answer from ``peer``; refused off its schema."""
    try:
        return Success(msgspec.msgpack.decode(data, type=Reply))
    except msgspec.DecodeError as error:
        return Failure(CoreError(f"malformed refit reply from {peer}: {error}"))
