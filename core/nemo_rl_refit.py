"""NeMo-RL's trainer-side refit wire as events of :mod:`genworker.core.refit_protocol`.

Theory of operation
-------------------
NeMo-RL's trainer sends neither a start, an end count nor tensor specs: both its wires
lean on the manifest the engine got from ``prepare_refit_info`` (``state_dict_info``, in
its order), read at NeMo-RL commit 7ea279ab:

* IPC (``stream_weights_via_ipc_zmq_impl``, ``nemo_rl/models/policy/utils.py``): one
  message per packed staging buffer listing only parameter names and the bytes used; the
  tensors lie back to back in the buffer, each at a multiple of :data:`IPC_ALIGN` bytes
  (``calculate_aligned_size``), shapes and dtypes from the manifest. The buffers are
  reused (ping-pong), so each is a :attr:`~refit_protocol.StorageKind.TEMPORARY` storage
  here: its mapping goes after the chunk and the loader gets copies. Then ``COMPLETE``.
* Collective (``packed_broadcast_producer`` / ``_consumer``,
  ``nemo_rl/utils/packed_tensor.py``): the manifest's tensors in order, grouped so that
  a group closes as soon as its bytes exceed the target size, each group one broadcast of
  its tensors' bytes unpadded, and nothing else on the wire (:func:`packed_groups`).

The shell turns each message into a :class:`~refit_protocol.Chunk` with :func:`ipc_chunk`
or :func:`packed_chunk` and feeds the usual :class:`~refit_protocol.Receiver`, with a
synthesized :class:`~refit_protocol.Begin` first and an :class:`~refit_protocol.End`
counting what arrived last (:class:`IpcStream`, :func:`packed_events`), so the manifest
checks (missing, duplicated, misplaced tensors) are the same as on genworker's own wire.
The transports' own checks are here too: a packing target given (:func:`packed_bytes`),
the IPC socket directory (:func:`socket_dir`) and NCCL's unique id (:func:`unique_id`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Final

import attrs
from returns.result import Failure, Result, Success

from genworker.core import refit_protocol as p
from genworker.core.errors import CoreError
from genworker.core.refit_plan import (
    Deviation,
    Manifest,
    ManifestError,
    TensorProblem,
    TensorSpec,
    align_up,
    manifest_error,
)

__all__ = [
    "IPC_ALIGN",
    "MAX_PACKED",
    "UNIQUE_ID_BYTES",
    "UNIQUE_ID_KEY",
    "IpcStream",
    "ipc_chunk",
    "packed_bytes",
    "packed_chunk",
    "packed_events",
    "packed_groups",
    "packed_target",
    "socket_dir",
    "unique_id",
]

#: NeMo-RL's ``calculate_aligned_size`` default: each packed tensor starts at a multiple.
IPC_ALIGN: Final = 512
#: NeMo-RL's largest packed broadcast (``get_target_packed_tensor_size``).
MAX_PACKED: Final = 5 << 30
#: Where trainer rank 0 publishes NCCL's unique id in its store (``StatelessProcessGroup``).
UNIQUE_ID_KEY: Final = "nccl_unique_id"
#: The size of NCCL's unique id (``ncclUniqueId``).
UNIQUE_ID_BYTES: Final = 128


def ipc_chunk(
    manifest: Manifest,
    refit_id: str,
    index: int,
    names: Sequence[str],
    used_bytes: int,
    storage_bytes: int,
) -> Result[p.Chunk, ManifestError]:
    """The chunk of one IPC bucket: ``names`` back to back at aligned offsets in one
    storage of ``storage_bytes``; refused when a name is not in the manifest (no offset
    follows from it) or the offsets do not add up to ``used_bytes``."""
    refs: list[p.TensorRef] = []
    unknown: list[TensorProblem] = []
    offset = 0
    for name in names:
        spec = manifest.get(name)
        if spec is None:
            unknown.append(TensorProblem(name, Deviation.UNEXPECTED, "is not in the manifest"))
            continue
        refs.append(p.TensorRef(name, spec.shape, spec.dtype, 0, offset))
        offset += align_up(spec.nbytes, IPC_ALIGN)
    if unknown:
        return Failure(manifest_error(f"IPC bucket {index} does not match the manifest", unknown))
    if offset != used_bytes:
        why = (
            f"its tensors take {offset} bytes at {IPC_ALIGN}-byte alignment, the trainer says "
            f"{used_bytes} (names, shapes or dtypes differ from prepare_refit_info's)"
        )
        problems = [TensorProblem(n, Deviation.MISPLACED, why) for n in names]
        return Failure(manifest_error(f"IPC bucket {index} does not match the manifest", problems))
    kinds = (p.StorageKind.TEMPORARY,)
    return Success(p.Chunk(refit_id, index, tuple(refs), (storage_bytes,), kinds))


@attrs.frozen
class IpcStream:
    """One refit's progress on NeMo-RL's IPC wire, which carries no start and no counts:
    a Begin synthesized on the first wait (:meth:`begin`), each bucket's chunk in turn
    (:meth:`bucket`), then an End counting what arrived (:meth:`end`)."""

    manifest: Manifest
    refit_id: str
    begun: bool = False
    chunks: int = 0
    tensors: int = 0

    def begin(self) -> tuple[IpcStream, p.Begin]:
        return attrs.evolve(self, begun=True), p.Begin(self.refit_id, "")

    def bucket(
        self, names: Sequence[str], used_bytes: int, storage_bytes: int
    ) -> Result[tuple[IpcStream, p.Chunk], ManifestError]:
        """The next bucket's chunk (:func:`ipc_chunk`), counted."""
        args = (self.refit_id, self.chunks, names, used_bytes, storage_bytes)
        counted = attrs.evolve(self, chunks=self.chunks + 1, tensors=self.tensors + len(names))
        return ipc_chunk(self.manifest, *args).map(lambda chunk: (counted, chunk))

    def end(self) -> p.End:
        return p.End(self.refit_id, self.chunks, self.tensors)


def packed_target(ratio: str, total_bytes: int) -> Result[int, CoreError]:
    """NeMo-RL's ``get_target_packed_tensor_size``: ``total_bytes`` (the device's memory)
    times ``ratio`` (``NRL_REFIT_BUFFER_MEMORY_RATIO``'s text, in (0, 1]), at most
    :data:`MAX_PACKED`."""
    try:
        share = float(ratio)
    except ValueError:
        return Failure(CoreError(f"NRL_REFIT_BUFFER_MEMORY_RATIO must be a number, got {ratio!r}"))
    if not 0 < share <= 1:
        return Failure(CoreError(f"NRL_REFIT_BUFFER_MEMORY_RATIO must be in (0, 1], got {ratio!r}"))
    return Success(min(int(total_bytes * share), MAX_PACKED))


def packed_groups(manifest: Manifest, target_bytes: int) -> tuple[tuple[TensorSpec, ...], ...]:
    """The manifest's tensors as NeMo-RL's packed broadcasts group them: in order, a group
    closing once its bytes exceed ``target_bytes``."""
    groups: list[tuple[TensorSpec, ...]] = []
    group: list[TensorSpec] = []
    size = 0
    for spec in manifest.specs:
        group.append(spec)
        size += spec.nbytes
        if size > target_bytes:
            groups.append(tuple(group))
            group, size = [], 0
    if group:
        groups.append(tuple(group))
    return tuple(groups)


def packed_chunk(refit_id: str, index: int, group: Sequence[TensorSpec]) -> p.Chunk:
    """The chunk of one packed broadcast: its tensors arrive by broadcast, in order."""
    refs = tuple(p.TensorRef(s.name, s.shape, s.dtype) for s in group)
    return p.Chunk(refit_id, index, refs)


def packed_events(
    refit_id: str, groups: Sequence[Sequence[TensorSpec]], tensors: int
) -> tuple[p.Event, ...]:
    """One refit of packed broadcasts as the receiver machine takes it: a synthesized
    Begin (the wire carries none), the chunk of each group (:func:`packed_chunk`), then
    an End counting the groups and the manifest's ``tensors``."""
    chunks = (packed_chunk(refit_id, index, group) for index, group in enumerate(groups))
    return (p.Begin(refit_id, ""), *chunks, p.End(refit_id, len(groups), tensors))


def packed_bytes(value: object) -> Result[int | None, CoreError]:
    """The collective backend's ``packed_bytes``: a packing target in bytes, or None for
    NeMo-RL's own rule (:func:`packed_target`)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return Success(value)
    return Failure(CoreError(f"packed_bytes must be an int, got {value!r}"))


def socket_dir(value: object) -> Result[str, CoreError]:
    """The IPC backend's ``socket_dir`` (where NeMo-RL's trainer binds its sockets): an
    absolute path."""
    if not isinstance(value, str) or not posixpath.isabs(value):
        return Failure(CoreError(f"socket_dir must be an absolute path, got {value!r}"))
    return Success(value)


def unique_id(raw: bytes) -> Result[bytes, CoreError]:
    """What the store holds under :data:`UNIQUE_ID_KEY`, refused unless it is NCCL's
    unique id (:data:`UNIQUE_ID_BYTES` bytes)."""
    if len(raw) != UNIQUE_ID_BYTES:
        return Failure(
            CoreError(f"{UNIQUE_ID_KEY} holds {len(raw)} bytes, NCCL's unique id {UNIQUE_ID_BYTES}")
        )
    return Success(raw)
