"""The sparse-delta codec over a tensor's raw bits, its chunking and framing plans, and the
relay tree that carries a step's payload from the trainer to every receiver (pure values).

Theory of operation
-------------------
*Bits.* The codec never looks at values: a tensor travels as its bit pattern, a 1-D array
of unsigned integers as wide as its dtype (``uint16`` for bf16 and fp16, ``uint32`` for
fp32, ``uint8`` for the fp8 formats; :func:`bit_pattern`). Equality is bit equality, so
``-0.0``/``+0.0`` and every NaN payload survive a refit unchanged.

*Chunks.* A tensor's elements are cut into chunks of ``chunk_elements`` (at most
:data:`MAX_CHUNK_ELEMENTS` = 65536, so a position inside a chunk fits in 16 bits): chunk
*j* covers ``[j*C, min((j+1)*C, numel))``. Each chunk is encoded on its own, as whichever
of two forms is smaller before compression:

- ``SPARSE``: the changed positions (16-bit gaps from the previous change, the first from
  the chunk's start) and the new bits at them: ``count * (2 + itemsize)`` bytes;
- ``XOR``: the chunk's ``old ^ new``, ``length * itemsize`` bytes (ties go to ``SPARSE``).

A full refit (the way to start, and to recover a receiver whose bits diverged) uses the
third form, ``RAW``: the new bits themselves (:func:`encode_full`). ``SPARSE`` and ``RAW``
set bits; ``XOR`` flips them, so it needs the exact previous bits (the per-tensor checksum
of the result catches a receiver whose bits were not the trainer's baseline).

*Wire form* (:meth:`TensorDelta.to_bytes`, little-endian): a :data:`HEADER_BYTES`-byte
header (magic ``GWD1``, itemsize, chunk_elements, numel, chunk count), then one kind byte
and one ``uint32`` count per chunk, then all gaps, all sparse values, and the ``XOR``/``RAW``
blocks in chunk order (like columns together, which compresses better). Since each chunk
costs at most its own bytes, **the encoded size is at most ``numel * itemsize +
header_bytes(n_chunks)``** with ``header_bytes(n) = HEADER_BYTES + 5 n``.
:func:`decode_delta` refuses any buffer that is not exactly such a layout, with a typed
:class:`DeltaError`.

*Frames.* A step's tensors travel in frames of about ``frame_bytes`` raw bytes
(:func:`plan_frames`): a frame holds pieces, each a chunk-aligned element range of one
tensor, so a large tensor spans frames and small ones share one, and a receiver applies
frame *i* while frame *i+1* is on the wire. The per-tensor checksum (CRC-32 of the
result's bits, :func:`tensor_checksum`, computed piece by piece) travels with the
tensor's last piece.

*Relay.* The sender sends one copy to the root receiver; receiver *i* forwards to its
children ``k*i+1 .. k*i+k`` (a complete k-ary tree in breadth-first order, fanout ``k``).
With ``n`` receivers the tree has ``relay_depth(n, k)`` levels: the smallest ``L`` with
``1 + k + ... + k**(L-1) >= n``, i.e. ``L = ceil(log_k((k-1)*n + 1))`` for ``k >= 2``
and ``L = n`` for ``k = 1``, so ``ceil(log_k n) <= L <= ceil(log_k n) + 1`` (the one
extra level is the root: the sender sends one copy, not ``k``). No tree of fanout ``k``
has fewer levels, since level ``l`` holds at most ``k**(l-1)`` receivers. A node answers its parent with a
:class:`RelayReport` for its whole subtree: its own outcome and its children's reports,
where a child that did not answer within its bound is ``SILENT`` and every receiver below
it ``UNCONFIRMED`` (it may have applied, but nobody can say). Bounds nest by one hop per
level (:meth:`RelayPlan.answer_bound_s`), so a parent always outlasts its children and a
dead node is named by its parent, never mistaken for its live ancestors.
:func:`conclude_relay` turns the root's report (or its silence) into success only when
every receiver applied, and otherwise a :class:`RelayFailure` naming each failed receiver.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt
import torch
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError
from genworker.core.refit_plan import DTYPE_ITEMSIZE, TensorSpec

__all__ = [
    "CHUNK_HEADER_BYTES",
    "HASH_BLOCK_WORDS",
    "HASH_KEYS",
    "HASH_MULTIPLIERS",
    "HEADER_BYTES",
    "MAX_CHUNK_ELEMENTS",
    "WIRE_HEADER",
    "WIRE_MAGIC",
    "Bits",
    "ChunkKind",
    "DeltaError",
    "DeltaTables",
    "Frame",
    "FramePiece",
    "NodeResult",
    "Outcome",
    "RelayFailure",
    "RelayPlan",
    "RelayPlanError",
    "RelayReport",
    "TensorDelta",
    "apply_delta",
    "apply_delta_into",
    "bit_pattern",
    "bits_dtype",
    "bits_hash",
    "chunk_count",
    "conclude_relay",
    "decode_delta",
    "decode_tables",
    "encode_delta",
    "encode_full",
    "hash_mix",
    "header_bytes",
    "plan_frames",
    "plan_relay",
    "relay_depth",
    "report_subtree",
    "tensor_checksum",
]

#: An array of bit patterns: 1-D, unsigned, as wide as the tensor's dtype.
_UInt = np.uint8 | np.uint16 | np.uint32 | np.uint64
Bits = npt.NDArray[_UInt]

MAX_CHUNK_ELEMENTS: Final = 1 << 16
#: The wire form's header: magic, itemsize, chunk_elements, numel, chunk count.
WIRE_MAGIC: Final = b"GWD1"
WIRE_HEADER: Final = struct.Struct("<4sBIQI")
HEADER_BYTES: Final = WIRE_HEADER.size
CHUNK_HEADER_BYTES: Final = 5  # one kind byte, one uint32 count
_WIDTHS: Final[Mapping[int, np.dtype[_UInt]]] = {
    1: np.dtype("u1"),
    2: np.dtype("u2"),
    4: np.dtype("u4"),
    8: np.dtype("u8"),
}
_GAP: Final = np.dtype("<u2")
_COUNT: Final = np.dtype("<u4")


class ChunkKind(enum.IntEnum):
    """How one chunk is encoded."""

    SPARSE = 0
    XOR = 1
    RAW = 2


@attrs.frozen
class DeltaError(CoreError):
    """A delta buffer or an apply target that does not fit the codec's rules."""

    field: str = ""


def bits_dtype(itemsize: int) -> np.dtype[_UInt]:
    """The unsigned numpy dtype of ``itemsize`` bytes (1, 2, 4 or 8)."""
    return _WIDTHS[itemsize]


def bit_pattern(tensor: torch.Tensor) -> Bits:
    """A zero-copy 1-D view of a contiguous CPU tensor's bits (writes go to the tensor).

    A non-contiguous tensor is a programming error (its bits are not one run of memory).
    """
    if not tensor.is_contiguous():
        raise ValueError("bit_pattern needs a contiguous tensor")
    flat = tensor.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return raw.numpy().view(bits_dtype(tensor.element_size()))


def tensor_checksum(bits: Bits, running: int = 0) -> int:
    """CRC-32 of ``bits``' bytes, continuing ``running`` (pieces checksum to the whole)."""
    return zlib.crc32(np.ascontiguousarray(bits).view(np.uint8).data, running) & 0xFFFFFFFF


#: The piece hash's block: 1024 64-bit words (8 KiB), each word position with its own key.
HASH_BLOCK_WORDS: Final = 1024
_PHI: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)


def hash_mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finalizer, element-wise (a bijection of 64-bit words)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    out: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
    return out


_POSITIONS: Final = np.arange(1, 2 * HASH_BLOCK_WORDS + 1, dtype=np.uint64)
#: Per word position in a block: the key it is XORed with and the odd multiplier.
HASH_KEYS: Final = hash_mix(_POSITIONS[:HASH_BLOCK_WORDS] * _PHI)
HASH_MULTIPLIERS: Final = hash_mix(_POSITIONS[HASH_BLOCK_WORDS:] * _PHI) | np.uint64(1)


def bits_hash(bits: Bits) -> int:
    """The 64-bit hash of ``bits``' bytes a sparse step checks each piece's result with.

    The bytes, zero-padded to whole little-endian 64-bit words ``w``, in blocks of
    :data:`HASH_BLOCK_WORDS`: block ``b``'s sum ``S_b = sum_k (w[bL+k] ^ K[k]) * M[k]``
    (mod 2**64, ``K``/``M`` = :data:`HASH_KEYS`/:data:`HASH_MULTIPLIERS`), then
    ``mix(sum_b mix(S_b + b * phi) ^ nbytes)`` with ``mix`` = :func:`hash_mix`.
    Any one changed word changes its block's sum (``M`` is odd), hence the hash (``mix``
    is a bijection); words moved between blocks or within one meet other keys. A
    compiled loop computes it at memory speed (``shell/delta_kernels.py``); this is the
    reference, in numpy.
    """
    raw = np.ascontiguousarray(bits).view(np.uint8).reshape(-1)
    nbytes = len(raw)
    if nbytes % 8:
        raw = np.concatenate([raw, np.zeros(8 - nbytes % 8, dtype=np.uint8)])
    words = raw.view("<u8").astype(np.uint64, copy=False)
    m = len(words)
    full = m // HASH_BLOCK_WORDS
    sums = np.zeros(chunk_count(m, HASH_BLOCK_WORDS), dtype=np.uint64)
    body = words[: full * HASH_BLOCK_WORDS].reshape(full, HASH_BLOCK_WORDS)
    sums[:full] = ((body ^ HASH_KEYS) * HASH_MULTIPLIERS).sum(axis=1, dtype=np.uint64)
    rest = words[full * HASH_BLOCK_WORDS :]
    if len(rest):
        keys, mults = HASH_KEYS[: len(rest)], HASH_MULTIPLIERS[: len(rest)]
        sums[full] = ((rest ^ keys) * mults).sum(dtype=np.uint64)
    blocks = np.arange(len(sums), dtype=np.uint64)
    total = hash_mix(sums + blocks * _PHI).sum(dtype=np.uint64)
    return int(hash_mix(np.array([total ^ np.uint64(nbytes)], dtype=np.uint64))[0])


def chunk_count(numel: int, chunk_elements: int) -> int:
    return -(-numel // chunk_elements)


def header_bytes(n_chunks: int) -> int:
    """The codec's overhead for a tensor of ``n_chunks`` chunks: the bound above its bits."""
    return HEADER_BYTES + CHUNK_HEADER_BYTES * n_chunks


_Array = Bits | npt.NDArray[np.uint8] | npt.NDArray[np.int64]


def _arrays_equal(a: _Array, b: _Array) -> bool:
    return a.dtype == b.dtype and bool(np.array_equal(a, b))


@attrs.frozen
class TensorDelta:
    """One tensor's (or one piece's) delta: per-chunk kinds, sparse changes, dense blocks.

    ``positions`` are element indices into the whole range (strictly increasing, only in
    ``SPARSE`` chunks), ``values`` the new bits there; ``blocks`` concatenates the ``XOR``
    and ``RAW`` chunks' payloads in chunk order.
    """

    itemsize: int
    numel: int
    chunk_elements: int
    kinds: npt.NDArray[np.uint8] = attrs.field(eq=attrs.cmp_using(eq=_arrays_equal))
    positions: npt.NDArray[np.int64] = attrs.field(eq=attrs.cmp_using(eq=_arrays_equal))
    values: Bits = attrs.field(eq=attrs.cmp_using(eq=_arrays_equal))
    blocks: Bits = attrs.field(eq=attrs.cmp_using(eq=_arrays_equal))

    @property
    def n_chunks(self) -> int:
        return len(self.kinds)

    def chunk_range(self, j: int) -> tuple[int, int]:
        start = j * self.chunk_elements
        return start, min(start + self.chunk_elements, self.numel)

    def counts(self) -> npt.NDArray[np.uint32]:
        """Per chunk: the sparse entry count (0 for a dense chunk)."""
        chunk_of = self.positions // self.chunk_elements
        return np.bincount(chunk_of, minlength=self.n_chunks).astype(np.uint32)

    def encoded_size(self) -> int:
        return (
            header_bytes(self.n_chunks)
            + len(self.positions) * (_GAP.itemsize + self.itemsize)
            + len(self.blocks) * self.itemsize
        )

    def to_bytes(self) -> bytes:
        """The wire form (see the module docstring)."""
        parts = [
            WIRE_HEADER.pack(
                WIRE_MAGIC, self.itemsize, self.chunk_elements, self.numel, self.n_chunks
            ),
            self.kinds.tobytes(),
            self.counts().astype(_COUNT).tobytes(),
            _gaps(self.positions, self.chunk_elements).tobytes(),
            self.values.astype(self.values.dtype.newbyteorder("<")).tobytes(),
            self.blocks.astype(self.blocks.dtype.newbyteorder("<")).tobytes(),
        ]
        return b"".join(parts)


def _gaps(positions: npt.NDArray[np.int64], chunk_elements: int) -> npt.NDArray[np.uint16]:
    if not len(positions):
        return np.empty(0, dtype=_GAP)
    gaps = np.diff(positions, prepend=0)
    chunk_of = positions // chunk_elements
    first = np.ones(len(positions), dtype=bool)
    first[1:] = chunk_of[1:] != chunk_of[:-1]
    gaps[first] = positions[first] - chunk_of[first] * chunk_elements
    return gaps.astype(_GAP)


def _check_chunk_elements(chunk_elements: int) -> None:
    if not 1 <= chunk_elements <= MAX_CHUNK_ELEMENTS:
        raise ValueError(
            f"chunk_elements must be in [1, {MAX_CHUNK_ELEMENTS}], got {chunk_elements}"
        )


def _lengths(numel: int, chunk_elements: int, n_chunks: int) -> npt.NDArray[np.int64]:
    lengths = np.full(n_chunks, chunk_elements, dtype=np.int64)
    if n_chunks:
        lengths[-1] = numel - (n_chunks - 1) * chunk_elements
    return lengths


def encode_delta(old: Bits, new: Bits, chunk_elements: int = MAX_CHUNK_ELEMENTS) -> TensorDelta:
    """The delta that turns ``old``'s bits into ``new``'s (same dtype and length).

    Arrays of different dtypes or lengths, or ``chunk_elements`` outside
    ``[1, MAX_CHUNK_ELEMENTS]``, are programming errors.
    """
    _check_chunk_elements(chunk_elements)
    if old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1:
        raise ValueError(
            f"encode_delta needs two 1-D arrays alike, got {old.dtype}{old.shape} and {new.dtype}{new.shape}"
        )
    numel, itemsize = len(new), new.itemsize
    n_chunks = chunk_count(numel, chunk_elements)
    changed = np.flatnonzero(old != new)
    chunk_of = changed // chunk_elements
    counts = np.bincount(chunk_of, minlength=n_chunks)
    lengths = _lengths(numel, chunk_elements, n_chunks)
    sparse = counts * (_GAP.itemsize + itemsize) <= lengths * itemsize
    kinds = np.where(sparse, ChunkKind.SPARSE, ChunkKind.XOR).astype(np.uint8)
    positions = changed[sparse[chunk_of]] if len(changed) else changed
    dense = np.flatnonzero(~sparse)
    blocks = [old[s:e] ^ new[s:e] for s, e in _ranges(dense, chunk_elements, numel)]
    return TensorDelta(
        itemsize=itemsize,
        numel=numel,
        chunk_elements=chunk_elements,
        kinds=kinds,
        positions=positions.astype(np.int64),
        values=new[positions],
        blocks=np.concatenate(blocks) if blocks else new[:0].copy(),
    )


def encode_full(new: Bits, chunk_elements: int = MAX_CHUNK_ELEMENTS) -> TensorDelta:
    """A delta that sets every element: ``RAW`` chunks of ``new``'s bits (a full refit)."""
    _check_chunk_elements(chunk_elements)
    numel = len(new)
    return TensorDelta(
        itemsize=new.itemsize,
        numel=numel,
        chunk_elements=chunk_elements,
        kinds=np.full(chunk_count(numel, chunk_elements), ChunkKind.RAW, dtype=np.uint8),
        positions=np.empty(0, dtype=np.int64),
        values=new[:0].copy(),
        blocks=new.copy(),
    )


def _ranges(
    chunks: npt.NDArray[np.int64], chunk_elements: int, numel: int
) -> list[tuple[int, int]]:
    return [(int(j) * chunk_elements, min((int(j) + 1) * chunk_elements, numel)) for j in chunks]


def apply_delta_into(target: Bits, delta: TensorDelta) -> Result[None, DeltaError]:
    """Write ``delta`` into ``target`` in place (the receiver's own baseline or parameter).

    Refused, with ``target`` untouched, when its width or length differs from the delta's.
    """
    if target.ndim != 1 or target.itemsize != delta.itemsize or len(target) != delta.numel:
        return Failure(
            DeltaError(
                f"a delta of {delta.numel} elements of {delta.itemsize} bytes cannot apply to "
                f"an array of shape {target.shape} and {target.itemsize}-byte elements",
                field="target",
            )
        )
    if len(delta.positions):
        target[delta.positions] = delta.values
    offset = 0
    for j in np.flatnonzero(delta.kinds != ChunkKind.SPARSE):
        start, stop = delta.chunk_range(int(j))
        block = delta.blocks[offset : offset + stop - start]
        offset += stop - start
        if delta.kinds[j] == ChunkKind.XOR:
            target[start:stop] ^= block
        else:
            target[start:stop] = block
    return Success(None)


def apply_delta(old: Bits, delta: TensorDelta) -> Result[Bits, DeltaError]:
    """The bits ``delta`` makes of ``old`` (a new array; ``old`` is left as it was)."""
    out = old.copy()
    return apply_delta_into(out, delta).map(lambda _: out)


def _bad(message: str, field: str) -> Failure[DeltaError]:
    return Failure(DeltaError(f"invalid delta: {message}", field=field))


@attrs.frozen
class DeltaTables:
    """A wire form's validated header and chunk tables, with views of its columns.

    ``gaps`` are the raw 16-bit gaps (not yet checked against the chunks' lengths: that
    is :func:`decode_delta`'s, or a kernel's, business), ``values`` the sparse entries'
    new bits and ``blocks`` the ``XOR``/``RAW`` chunks' payloads, all views of the buffer.
    """

    itemsize: int
    numel: int
    chunk_elements: int
    kinds: npt.NDArray[np.uint8] = attrs.field(eq=False)
    counts: npt.NDArray[np.int64] = attrs.field(eq=False)
    lengths: npt.NDArray[np.int64] = attrs.field(eq=False)
    gaps: npt.NDArray[np.uint16] = attrs.field(eq=False)
    values: Bits = attrs.field(eq=False)
    blocks: Bits = attrs.field(eq=False)


def decode_tables(data: bytes | bytearray | memoryview) -> Result[DeltaTables, DeltaError]:
    """Check a wire form's header, chunk tables and length; views of its columns.

    Everything :func:`decode_delta` checks but the gaps (which it turns into positions).
    """
    buf = memoryview(data).cast("B")
    if len(buf) < HEADER_BYTES:
        return _bad(f"{len(buf)} bytes is shorter than the {HEADER_BYTES}-byte header", "header")
    magic, itemsize, chunk_elements, numel, n_chunks = WIRE_HEADER.unpack_from(buf)
    if magic != WIRE_MAGIC:
        return _bad(f"magic {bytes(magic)!r} is not {WIRE_MAGIC!r}", "magic")
    if itemsize not in _WIDTHS:
        return _bad(f"itemsize {itemsize} is not one of {sorted(_WIDTHS)}", "itemsize")
    if not 1 <= chunk_elements <= MAX_CHUNK_ELEMENTS:
        return _bad(
            f"chunk_elements {chunk_elements} is outside [1, {MAX_CHUNK_ELEMENTS}]",
            "chunk_elements",
        )
    if n_chunks != chunk_count(numel, chunk_elements):
        return _bad(
            f"{n_chunks} chunks do not cover {numel} elements of {chunk_elements}", "n_chunks"
        )
    at = HEADER_BYTES
    tables = n_chunks * CHUNK_HEADER_BYTES
    if len(buf) < at + tables:
        return _bad(
            f"{len(buf)} bytes cannot hold the header and {n_chunks} chunk entries", "chunks"
        )
    kinds = np.frombuffer(buf, dtype=np.uint8, count=n_chunks, offset=at)
    counts = np.frombuffer(buf, dtype=_COUNT, count=n_chunks, offset=at + n_chunks).astype(np.int64)
    at += tables
    if np.any(kinds > ChunkKind.RAW):
        return _bad(f"chunk kind {int(kinds.max())} is unknown", "kinds")
    lengths = _lengths(numel, chunk_elements, n_chunks)
    is_sparse = kinds == ChunkKind.SPARSE
    if np.any(counts[is_sparse] > lengths[is_sparse]) or np.any(counts[~is_sparse] != 0):
        return _bad("a chunk's count exceeds its length, or a dense chunk has a count", "counts")
    entries = int(counts.sum())
    dense = int(lengths[~is_sparse].sum())
    expected = at + entries * (_GAP.itemsize + itemsize) + dense * itemsize
    if len(buf) != expected:
        return _bad(f"{len(buf)} bytes, but the chunk table describes {expected}", "length")
    width = bits_dtype(itemsize).newbyteorder("<")
    gaps = np.frombuffer(buf, dtype=_GAP, count=entries, offset=at)
    at += entries * _GAP.itemsize
    values = np.frombuffer(buf, dtype=width, count=entries, offset=at)
    at += entries * itemsize
    blocks = np.frombuffer(buf, dtype=width, count=dense, offset=at)
    return Success(
        DeltaTables(
            itemsize=itemsize,
            numel=numel,
            chunk_elements=chunk_elements,
            kinds=kinds,
            counts=counts,
            lengths=lengths,
            gaps=gaps.astype(np.uint16, copy=False),
            values=values.astype(bits_dtype(itemsize), copy=False),
            blocks=blocks.astype(bits_dtype(itemsize), copy=False),
        )
    )


def decode_delta(data: bytes | bytearray | memoryview) -> Result[TensorDelta, DeltaError]:
    """Parse the wire form back into a :class:`TensorDelta`, refusing any inconsistency.

    The arrays are views of ``data`` where the layout allows (no copy of the payload).
    """
    return decode_tables(data).bind(_delta_of)


def _delta_of(tables: DeltaTables) -> Result[TensorDelta, DeltaError]:
    positions = _positions(
        tables.gaps.astype(np.int64), tables.counts, tables.lengths, tables.chunk_elements
    )
    if isinstance(positions, DeltaError):
        return Failure(positions)
    return Success(
        TensorDelta(
            itemsize=tables.itemsize,
            numel=tables.numel,
            chunk_elements=tables.chunk_elements,
            kinds=tables.kinds,
            positions=positions,
            values=tables.values,
            blocks=tables.blocks,
        )
    )


def _positions(
    gaps: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    chunk_elements: int,
) -> npt.NDArray[np.int64] | DeltaError:
    """Global positions from per-chunk gaps: strictly increasing inside each chunk's length."""
    if not len(gaps):
        return gaps
    ends = np.cumsum(counts)
    firsts = (ends - counts)[counts > 0]
    later = np.ones(len(gaps), dtype=bool)
    later[firsts] = False
    if np.any(gaps[later] == 0):
        return DeltaError("invalid delta: positions in a chunk repeat", field="positions")
    running = np.cumsum(gaps)
    base = running[firsts] - gaps[firsts]
    chunk_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    offsets = running - np.repeat(base, counts[counts > 0])
    if np.any(offsets >= lengths[chunk_of]):
        return DeltaError("invalid delta: a change lies past its chunk's end", field="positions")
    positions: npt.NDArray[np.int64] = offsets + chunk_of * chunk_elements
    return positions


# --- frames ------------------------------------------------------------------------


@attrs.frozen
class FramePiece:
    """Elements ``[start, stop)`` of tensor ``name``; ``last`` marks the tensor's final piece."""

    name: str
    start: int
    stop: int
    last: bool


Frame = tuple[FramePiece, ...]


def plan_frames(
    specs: Sequence[TensorSpec], frame_bytes: int, chunk_elements: int = MAX_CHUNK_ELEMENTS
) -> tuple[Frame, ...]:
    """Cut the step's tensors into frames of at most ``frame_bytes`` raw bytes.

    Pieces are chunk-aligned element ranges taken in order; a frame closes when the next
    chunk would overflow it, so a frame exceeds ``frame_bytes`` only when it holds a single
    chunk larger than that. An empty tensor is one empty piece. ``frame_bytes < 1`` is a
    programming error.
    """
    _check_chunk_elements(chunk_elements)
    if frame_bytes < 1:
        raise ValueError(f"frame_bytes must be positive, got {frame_bytes}")
    frames: list[Frame] = []
    current: list[FramePiece] = []
    fill = 0
    for spec in specs:
        itemsize = DTYPE_ITEMSIZE[spec.dtype]
        numel = spec.numel
        if numel == 0:
            current.append(FramePiece(spec.name, 0, 0, True))
            continue
        start = 0
        while start < numel:
            take = ((frame_bytes - fill) // itemsize // chunk_elements) * chunk_elements
            if take <= 0 and current:
                frames.append(tuple(current))
                current, fill = [], 0
                continue
            stop = min(numel, start + max(take, chunk_elements))  # one oversized chunk alone
            current.append(FramePiece(spec.name, start, stop, stop == numel))
            fill += (stop - start) * itemsize
            start = stop
    if current:
        frames.append(tuple(current))
    return tuple(frames)


# --- the relay tree ----------------------------------------------------------------


def relay_depth(count: int, fanout: int) -> int:
    """Levels of the complete ``fanout``-ary tree over ``count`` receivers (0 for none)."""
    if fanout == 1:
        return count
    levels, capacity, width = 0, 0, 1
    while capacity < count:
        capacity += width
        width *= fanout
        levels += 1
    return levels


@attrs.frozen
class RelayPlanError(CoreError):
    """The receivers or the fanout cannot make a relay tree."""

    receivers: tuple[str, ...] = ()


@attrs.frozen
class RelayPlan:
    """A complete ``fanout``-ary tree over ``receivers`` in breadth-first order; 0 is the root."""

    receivers: tuple[str, ...]
    fanout: int

    def children(self, node: int) -> tuple[int, ...]:
        first = self.fanout * node + 1
        return tuple(range(first, min(first + self.fanout, len(self.receivers))))

    def parent(self, node: int) -> int | None:
        return None if node == 0 else (node - 1) // self.fanout

    def subtree(self, node: int) -> tuple[int, ...]:
        """``node`` and every receiver below it, breadth first."""
        out, frontier = [node], [node]
        while frontier:
            frontier = [c for n in frontier for c in self.children(n)]
            out.extend(frontier)
        return tuple(out)

    def height(self, node: int) -> int:
        """Levels from ``node`` down to its deepest descendant (1 for a leaf)."""
        below = self.children(node)
        return 1 + max((self.height(c) for c in below), default=0)

    @property
    def depth(self) -> int:
        return self.height(0)

    def answer_bound_s(self, node: int, hop_s: float) -> float:
        """How long after the step's end ``node`` may take to answer: one hop per level.

        The sender waits ``answer_bound_s(0)`` for the root; a node waits each child's own
        bound, which is at least one hop shorter than its own.
        """
        return hop_s * self.height(node)

    def index(self, name: str) -> int:
        return self.receivers.index(name)


def plan_relay(receivers: Sequence[str], fanout: int) -> Result[RelayPlan, RelayPlanError]:
    """The relay tree over ``receivers`` (distinct non-empty names), ``fanout >= 1``."""
    names = tuple(receivers)
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
        return Failure(
            RelayPlanError(f"the relay fanout must be an int >= 1, got {fanout!r}", names)
        )
    if not names:
        return Failure(RelayPlanError("a relay needs at least one receiver"))
    bad = [n for n in names if not isinstance(n, str) or not n]
    dup = sorted({n for n in names if names.count(n) > 1})
    if bad or dup:
        return Failure(
            RelayPlanError(
                f"relay receivers must be distinct non-empty names; invalid: {bad!r}, repeated: {dup!r}",
                names,
            )
        )
    return Success(RelayPlan(names, fanout))


class Outcome(enum.Enum):
    """What became of one receiver in one step."""

    APPLIED = "applied"
    REFUSED = "refused"  # answered, but did not take the step (bad payload, checksum)
    SILENT = "silent"  # did not answer within its bound
    UNCONFIRMED = "unconfirmed"  # below a silent receiver: nobody could report on it


@attrs.frozen
class NodeResult:
    """One receiver's outcome in a step, with a human detail."""

    name: str
    outcome: Outcome
    detail: str = ""

    def describe(self) -> str:
        return f"{self.name!r} {self.outcome.value}" + (f": {self.detail}" if self.detail else "")


@attrs.frozen
class RelayReport:
    """The outcomes of a subtree's receivers, the subtree's root first."""

    results: tuple[NodeResult, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.results)

    def failed(self) -> tuple[NodeResult, ...]:
        return tuple(r for r in self.results if r.outcome is not Outcome.APPLIED)


def _silent(plan: RelayPlan, node: int, detail: str) -> RelayReport:
    name = plan.receivers[node]
    below = [
        NodeResult(plan.receivers[n], Outcome.UNCONFIRMED, f"below silent {name!r}")
        for n in plan.subtree(node)[1:]
    ]
    return RelayReport((NodeResult(name, Outcome.SILENT, detail), *below))


def _checked(plan: RelayPlan, node: int, report: RelayReport | None, hop_s: float) -> RelayReport:
    """``node``'s report as its parent takes it: silence, or a report of the wrong receivers."""
    if report is None:
        bound = plan.answer_bound_s(node, hop_s)
        return _silent(plan, node, f"did not answer within {bound:g} s")
    expected = tuple(plan.receivers[n] for n in plan.subtree(node))
    if sorted(report.names) != sorted(expected) or report.names[0] != expected[0]:
        below = _silent(plan, node, "").results[1:]
        refused = NodeResult(expected[0], Outcome.REFUSED, f"answered for {list(report.names)}")
        return RelayReport((refused, *below))
    return report


def report_subtree(
    plan: RelayPlan,
    node: int,
    own: NodeResult,
    children: Mapping[int, RelayReport | None],
    hop_s: float,
) -> RelayReport:
    """``node``'s answer: its own result and each child's report (absent or ``None``: silent).

    A child's report that does not name exactly the child's subtree, the child first, is
    taken as that child's refusal (its descendants unconfirmed), so a confused receiver
    can neither hide nor invent others.
    """
    results = [own]
    for child in plan.children(node):
        results.extend(_checked(plan, child, children.get(child), hop_s).results)
    return RelayReport(tuple(results))


@attrs.frozen
class RelayFailure(CoreError):
    """A step that not every receiver applied; ``results`` names each that did not."""

    results: tuple[NodeResult, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.results)

    def named(self, outcome: Outcome) -> tuple[str, ...]:
        return tuple(r.name for r in self.results if r.outcome is outcome)


_MAX_NAMED: Final = 12


def conclude_relay(
    plan: RelayPlan, root_report: RelayReport | None, hop_s: float
) -> Result[RelayReport, RelayFailure]:
    """The sender's verdict on the root's answer (``None``: silent within its bound).

    Success only when every receiver applied the step; otherwise the failure names each
    receiver that refused or stayed silent, and those below a silent one as unconfirmed.
    """
    report = _checked(plan, 0, root_report, hop_s)
    failed = report.failed()
    if not failed:
        return Success(report)
    shown = [r.describe() for r in failed[:_MAX_NAMED]]
    if len(failed) > _MAX_NAMED:
        shown.append(f"and {len(failed) - _MAX_NAMED} more")
    total = len(plan.receivers)
    return Failure(
        RelayFailure(
            f"the step was applied by {total - len(failed)} of {total} receivers: "
            + "; ".join(shown),
            results=failed,
        )
    )
