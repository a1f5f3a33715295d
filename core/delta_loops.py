"""The sparse-delta codec's hot loops, one pass per tensor piece, written for numba.

``shell/delta_kernels.py`` compiles them (``numba.njit``: the loops are plain Python over
numpy arrays and scalars, so the same functions run uncompiled, as the core's tests run
them) and drives them; they agree with :mod:`genworker.core.delta`'s numpy codec byte
for byte:

- :func:`encode_loop` fills the wire form's columns of ``encode_delta(old, new)``: it
  compares 8 bytes at a time, looks at the elements of a word only when it changed, and
  writes gaps and new bits as it finds them (a chunk that turns out dense is rewound and
  written as its ``XOR`` block);
- :func:`tables_loop` checks a chunk table as :func:`~genworker.core.delta.decode_tables`
  does, :func:`check_loop` every gap as :func:`~genworker.core.delta.decode_delta` does
  (no repeat, nothing past its chunk's end), before :func:`apply_loop` writes anything;
- :func:`hash_loop` is :func:`~genworker.core.delta.bits_hash` over whole words (about
  20 GB/s compiled, CRC-32 about 4).

:func:`encode_wire`, :func:`apply_wire_into` and :func:`piece_hash` drive them (a :class:`Loops`, compiled or
:data:`PLAIN`): one allocation per column and the header around the encode loop; the
header and tables by a loop, any doubt left to ``decode_tables`` (its refusal is the
answer), then the gaps checked, then the writes, so a refused delta leaves the target
as it was. Given no loops (``None``: numba does not import, or a big-endian host), they
are the core's numpy codec, with the same results. :func:`warm_up` runs the loops once
on tiny inputs of each kind a step meets, so that numba has compiled them before then.

Kinds are numbered as :class:`~genworker.core.delta.ChunkKind`: 0 ``SPARSE``, 1 ``XOR``,
2 ``RAW``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Final, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
from returns.result import Failure, Result, Success

from genworker.core.delta import (
    HASH_BLOCK_WORDS,
    HASH_KEYS,
    HASH_MULTIPLIERS,
    HEADER_BYTES,
    MAX_CHUNK_ELEMENTS,
    WIRE_HEADER,
    WIRE_MAGIC,
    Bits,
    ChunkKind,
    DeltaError,
    apply_delta_into,
    bits_hash,
    chunk_count,
    decode_delta,
    decode_tables,
    encode_delta,
    encode_full,
)

__all__ = [
    "PLAIN",
    "Columns",
    "EncodeLoop",
    "Loops",
    "apply_loop",
    "apply_wire_into",
    "check_loop",
    "encode_loop",
    "encode_wire",
    "fixed",
    "hash_loop",
    "piece_hash",
    "tables_loop",
    "warm_up",
    "wire_columns",
]

_U64 = npt.NDArray[np.uint64]
#: (old, new, old_words, new_words, chunk_elements, kinds, counts, gaps, values, blocks)
EncodeLoop = Callable[
    [
        Bits,
        Bits,
        _U64,
        _U64,
        int,
        npt.NDArray[np.uint8],
        npt.NDArray[np.uint32],
        npt.NDArray[np.uint16],
        Bits,
        Bits,
    ],
    tuple[int, int],
]

assert (ChunkKind.SPARSE, ChunkKind.XOR, ChunkKind.RAW) == (0, 1, 2)  # the loops' numbers


def encode_loop(per: int) -> EncodeLoop:
    """The encode loop for ``per = 8 // itemsize`` lanes a word (a constant when compiled:
    the lane loop then has a constant trip count, which makes it half as costly)."""
    bits = 64 // per
    mask = (1 << bits) - 1 if per > 1 else 0

    def encode(
        old: Bits,
        new: Bits,
        old_words: npt.NDArray[np.uint64],
        new_words: npt.NDArray[np.uint64],
        chunk_elements: int,
        kinds: npt.NDArray[np.uint8],
        counts: npt.NDArray[np.uint32],
        gaps: npt.NDArray[np.uint16],
        values: Bits,
        blocks: Bits,
    ) -> tuple[int, int]:
        """Fill the columns; ``(sparse entries, dense elements)`` written.

        ``old_words``/``new_words``: the arrays' first ``len(old_words) * per`` elements
        as 64-bit words, or empty (no word compare) when they are not word-aligned.
        """
        numel = new.shape[0]
        itemsize = 8 // per
        n_words = old_words.shape[0] if per > 1 else 0
        entries = 0
        dense = 0
        for j in range(kinds.shape[0]):
            start = j * chunk_elements
            stop = min(start + chunk_elements, numel)
            first = entries
            prev = start
            # Whole words inside the chunk are compared first (most did not change),
            # then the lanes of a changed word; the chunk's ends one element at a time.
            w0 = min(-(-start // per), n_words)
            w1 = min(stop // per, n_words)
            if w1 <= w0:
                w0 = w1 = 0
            head = w0 * per if w1 > w0 else stop
            for i in range(start, head):
                if old[i] != new[i]:
                    gaps[entries] = i - prev
                    values[entries] = new[i]
                    entries += 1
                    prev = i
            for w in range(w0, w1):
                x = old_words[w] ^ new_words[w]
                if x != 0:
                    for k in range(per):
                        if (x >> np.uint64(bits * k)) & np.uint64(mask):
                            i = w * per + k
                            gaps[entries] = i - prev
                            values[entries] = new[i]
                            entries += 1
                            prev = i
            for i in range(max(head, w1 * per), stop):
                if old[i] != new[i]:
                    gaps[entries] = i - prev
                    values[entries] = new[i]
                    entries += 1
                    prev = i
            count = entries - first
            if count * (2 + itemsize) > (stop - start) * itemsize:  # XOR is smaller
                entries = first
                kinds[j] = 1
                counts[j] = 0
                for k in range(start, stop):
                    blocks[dense] = old[k] ^ new[k]
                    dense += 1
            else:
                kinds[j] = 0  # SPARSE
                counts[j] = count
        return entries, dense

    return encode


def tables_loop(
    kinds: npt.NDArray[np.uint8],
    counts: npt.NDArray[np.uint32],
    numel: int,
    chunk_elements: int,
) -> tuple[int, int, bool]:
    """``(sparse entries, dense elements, valid)`` of a chunk table (``decode_tables``'s
    rules: known kinds, a sparse count within its chunk, no count on a dense chunk)."""
    entries = 0
    dense = 0
    for j in range(kinds.shape[0]):
        start = j * chunk_elements
        length = min(start + chunk_elements, numel) - start
        if kinds[j] == 0:
            if counts[j] > length:
                return 0, 0, False
            entries += counts[j]
        elif kinds[j] <= 2 and counts[j] == 0:
            dense += length
        else:
            return 0, 0, False
    return entries, dense, True


def check_loop(
    kinds: npt.NDArray[np.uint8],
    counts: npt.NDArray[np.uint32],
    gaps: npt.NDArray[np.uint16],
    numel: int,
    chunk_elements: int,
) -> int:
    """0 when every sparse chunk's gaps are valid; 1: a position repeats; 2: past the end."""
    at = np.int64(0)
    for j in range(kinds.shape[0]):
        if kinds[j] != 0:
            continue
        start = j * chunk_elements
        length = min(start + chunk_elements, numel) - start
        offset = np.int64(-1)
        end = at + np.int64(counts[j])
        for e in range(at, end):
            gap = np.int64(gaps[e])
            if e > at and gap == 0:
                return 1
            offset = gap if e == at else offset + gap
            if offset >= length:
                return 2
        at = end
    return 0


def apply_loop(
    target: Bits,
    chunk_elements: int,
    kinds: npt.NDArray[np.uint8],
    counts: npt.NDArray[np.uint32],
    gaps: npt.NDArray[np.uint16],
    values: Bits,
    blocks: Bits,
) -> None:
    """Write checked columns into ``target`` (``check_loop`` returned 0)."""
    numel = target.shape[0]
    at = np.int64(0)
    dense = 0
    for j in range(kinds.shape[0]):
        start = j * chunk_elements
        stop = min(start + chunk_elements, numel)
        kind = kinds[j]
        if kind == 0:
            position = start
            end = at + np.int64(counts[j])
            for e in range(at, end):
                position = start + gaps[e] if e == at else position + gaps[e]
                target[position] = values[e]
            at = end
        elif kind == 1:
            for k in range(start, stop):
                target[k] ^= blocks[dense]
                dense += 1
        else:
            for k in range(start, stop):
                target[k] = blocks[dense]
                dense += 1


def hash_loop(
    words: npt.NDArray[np.uint64],
    tail: np.uint64,
    has_tail: int,
    nbytes: int,
    keys: npt.NDArray[np.uint64],
    mults: npt.NDArray[np.uint64],
) -> np.uint64:
    """``bits_hash`` over ``words`` and, when ``has_tail``, one last (zero-padded) word."""

    def mix(z: np.uint64) -> np.uint64:  # hash_mix of one word (inlined when compiled)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    m = words.shape[0]
    count = m + has_tail
    size = HASH_BLOCK_WORDS  # a constant when compiled
    total = np.uint64(0)
    for b in range((count + size - 1) // size):
        base = b * size
        end = min(base + size, count)
        s = np.uint64(0)
        if end <= m and end - base == size:  # a whole block: a loop of constant length
            for k in range(size):
                s += (words[base + k] ^ keys[k]) * mults[k]
        else:
            for k in range(base, min(end, m)):
                s += (words[k] ^ keys[k - base]) * mults[k - base]
        if end > m:
            s += (tail ^ keys[m - base]) * mults[m - base]
        total += mix(s + np.uint64(b) * np.uint64(0x9E3779B97F4A7C15))
    return mix(total ^ np.uint64(nbytes))


_U8 = npt.NDArray[np.uint8]
_U16 = npt.NDArray[np.uint16]
_U32 = npt.NDArray[np.uint32]
TablesLoop = Callable[[_U8, _U32, int, int], tuple[int, int, bool]]
CheckLoop = Callable[[_U8, _U32, _U16, int, int], int]
ApplyLoop = Callable[[Bits, int, _U8, _U32, _U16, Bits, Bits], None]
HashLoop = Callable[[_U64, np.uint64, int, int, _U64, _U64], np.uint64]


@attrs.frozen
class Loops:
    """The loops a codec runs: these functions, or numba's compiled forms of them."""

    encoders: Mapping[int, EncodeLoop]  # by itemsize
    tables: TablesLoop
    check: CheckLoop
    apply: ApplyLoop
    hash: HashLoop


#: The loops uncompiled (the reference the compiled ones must agree with).
PLAIN: Final = Loops(
    {size: encode_loop(8 // size) for size in (1, 2, 4, 8)},
    tables_loop,
    check_loop,
    apply_loop,
    hash_loop,
)

_NO_WORDS: Final = np.empty(0, dtype=np.uint64)


def _words(bits: Bits) -> _U64:
    per = 8 // bits.itemsize
    whole = len(bits) // per * per
    if per == 1 or bits.ctypes.data % 8 or not whole:
        return _NO_WORDS
    return bits[:whole].view(np.uint64)


def encode_wire(
    loops: Loops | None, old: Bits, new: Bits, chunk_elements: int = MAX_CHUNK_ELEMENTS
) -> bytes:
    """``encode_delta(old, new, chunk_elements).to_bytes()``, in one pass of the loop
    (``None``: by ``encode_delta``).

    Arrays of different dtypes or lengths, or ``chunk_elements`` outside
    ``[1, MAX_CHUNK_ELEMENTS]``, are programming errors (``ValueError``).
    """
    if loops is None:
        return encode_delta(old, new, chunk_elements).to_bytes()
    if old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1:
        return encode_delta(old, new, chunk_elements).to_bytes()  # its ValueError
    if not 1 <= chunk_elements <= MAX_CHUNK_ELEMENTS:
        return encode_delta(old, new, chunk_elements).to_bytes()  # its ValueError
    old, new = np.ascontiguousarray(old), np.ascontiguousarray(new)
    numel, itemsize = len(new), new.itemsize
    n_chunks = chunk_count(numel, chunk_elements)
    kinds = np.empty(n_chunks, dtype=np.uint8)
    counts = np.empty(n_chunks, dtype=np.uint32)
    gaps = np.empty(numel, dtype=np.uint16)
    values = np.empty(numel, dtype=new.dtype)
    blocks = np.empty(numel, dtype=new.dtype)
    old_words, new_words = _words(old), _words(new)
    if len(old_words) != len(new_words):
        old_words = new_words = _NO_WORDS
    entries, dense = loops.encoders[itemsize](
        old, new, old_words, new_words, chunk_elements, kinds, counts, gaps, values, blocks
    )
    head = WIRE_HEADER.pack(WIRE_MAGIC, itemsize, chunk_elements, numel, n_chunks)
    columns = (kinds, counts, gaps[:entries], values[:entries], blocks[:dense])
    return b"".join((head, *(column.data for column in columns)))


_A = TypeVar("_A", bound=Bits)


def fixed(array: _A, *, copy: bool = True) -> _A:
    """``array`` read-only and (when ``copy``) aligned, copied when it is not: numba
    compiles a loop per kind of array (layout, alignment, writability) it meets, and a
    column at an odd offset of the buffer is unaligned. The dense blocks (a full step's
    bits) are left where they are: their loop is compiled for both alignments."""
    if copy and not array.flags.aligned:
        array = array.copy()
    array.flags.writeable = False
    return array


@attrs.frozen
class Columns:
    """A wire form's checked header and columns (views of its buffer, :func:`fixed`)."""

    itemsize: int
    numel: int
    chunk_elements: int
    kinds: _U8 = attrs.field(eq=False)
    counts: _U32 = attrs.field(eq=False)
    gaps: _U16 = attrs.field(eq=False)
    values: Bits = attrs.field(eq=False)
    blocks: Bits = attrs.field(eq=False)


def wire_columns(loops: Loops, data: bytes | bytearray | memoryview) -> Result[Columns, DeltaError]:
    """The wire form's columns, checked by the tables loop; anything it does not find
    valid is left to ``decode_tables``, whose refusal is the answer."""
    buf = memoryview(data).cast("B")
    if len(buf) >= HEADER_BYTES:
        magic, itemsize, chunk_elements, numel, n_chunks = WIRE_HEADER.unpack_from(buf)
        tables = HEADER_BYTES + 5 * n_chunks
        if (
            magic == WIRE_MAGIC
            and itemsize in (1, 2, 4, 8)
            and 1 <= chunk_elements <= MAX_CHUNK_ELEMENTS
            and n_chunks == chunk_count(numel, chunk_elements)
            and len(buf) >= tables
        ):
            kinds = np.frombuffer(buf, dtype=np.uint8, count=n_chunks, offset=HEADER_BYTES)
            at = HEADER_BYTES + n_chunks
            counts = np.frombuffer(buf, dtype=np.uint32, count=n_chunks, offset=at)
            entries, dense, valid = loops.tables(kinds, counts, numel, chunk_elements)
            if valid and len(buf) == tables + entries * (2 + itemsize) + dense * itemsize:
                width = np.dtype(f"u{itemsize}")
                gaps = np.frombuffer(buf, dtype=np.uint16, count=entries, offset=tables)
                at = tables + 2 * entries
                values = np.frombuffer(buf, dtype=width, count=entries, offset=at)
                at += itemsize * entries
                blocks = np.frombuffer(buf, dtype=width, count=dense, offset=at)
                found = (fixed(kinds), fixed(counts), fixed(gaps), fixed(values))
                blocks = fixed(blocks, copy=False)
                return Success(Columns(itemsize, numel, chunk_elements, *found, blocks))
    refused = decode_tables(data)
    assert isinstance(refused, Failure), "the tables loop's rules are decode_tables'"
    return Failure(refused.failure())


_GAP_PROBLEMS: Final = {
    1: DeltaError("invalid delta: positions in a chunk repeat", field="positions"),
    2: DeltaError("invalid delta: a change lies past its chunk's end", field="positions"),
}


def apply_wire_into(
    loops: Loops | None, target: Bits, data: bytes | bytearray | memoryview
) -> Result[None, DeltaError]:
    """``decode_delta(data)`` applied into ``target`` (``apply_delta_into``), one pass
    (``None``: by those two).

    The same refusals, with the same :class:`DeltaError`: an invalid buffer, or a target
    whose width or length differs from the delta's; ``target`` is untouched by either.
    """
    if loops is None:
        return decode_delta(data).bind(lambda delta: apply_delta_into(target, delta))
    decoded = wire_columns(loops, data)
    if isinstance(decoded, Failure):
        return Failure(decoded.failure())
    c = decoded.unwrap()
    problem = loops.check(c.kinds, c.counts, c.gaps, c.numel, c.chunk_elements)
    if problem:
        return Failure(_GAP_PROBLEMS[problem])
    if target.ndim != 1 or target.itemsize != c.itemsize or len(target) != c.numel:
        return Failure(
            DeltaError(
                f"a delta of {c.numel} elements of {c.itemsize} bytes cannot apply "
                f"to an array of shape {target.shape} and {target.itemsize}-byte elements",
                field="target",
            )
        )
    values = c.values.astype(target.dtype, copy=False)
    blocks = c.blocks.astype(target.dtype, copy=False)
    loops.apply(target, c.chunk_elements, c.kinds, c.counts, c.gaps, values, blocks)
    return Success(None)


def piece_hash(loops: Loops | None, bits: Bits) -> int:
    """:func:`~genworker.core.delta.bits_hash` of ``bits``, in one pass of the loop
    (``None``: by ``bits_hash``)."""
    if loops is None:
        return bits_hash(bits)
    raw = np.ascontiguousarray(bits).view(np.uint8).reshape(-1)
    nbytes = len(raw)
    whole = nbytes // 8 * 8
    body = raw[:whole]
    if body.ctypes.data % 8:
        body = body.copy()  # the loop reads aligned words
    tail = np.zeros(8, dtype=np.uint8)
    tail[: nbytes - whole] = raw[whole:]
    words = body.view(np.uint64)
    has_tail = int(nbytes > whole)
    value = loops.hash(
        words, tail.view(np.uint64)[0], has_tail, nbytes, HASH_KEYS, HASH_MULTIPLIERS
    )
    return int(value)


def warm_up(loops: Loops | None, itemsizes: Iterable[int] = (1, 2, 4)) -> None:
    """Run ``loops`` for these element widths on tiny inputs, once per kind of array a
    step hands them (a delta and a full step's wire form, aligned and not, dense blocks
    in place and copied), so that numba compiles or loads each before a step waits on
    it; nothing without loops."""
    if loops is None:
        return
    for itemsize in sorted(set(itemsizes)):
        dtype = np.dtype(f"u{itemsize}")
        old = np.zeros(300, dtype=dtype)
        new = old.copy()
        new[::7] = 1
        new[200:] = 2  # one chunk dense
        for data in (encode_wire(loops, old, new, 64), encode_full(new, 64).to_bytes()):
            for shift in (0, 1):  # the blocks aligned and not
                buf = memoryview(bytes(shift) + data)[shift:]
                target = old.copy()
                apply_wire_into(loops, target, buf).unwrap()
                piece_hash(loops, target)
        blocks = np.frombuffer(bytes(itemsize + 1), dtype=dtype, count=1, offset=1)
        no = np.zeros(0, dtype=np.uint16)
        kinds, counts = np.full(1, 2, dtype=np.uint8), np.zeros(1, dtype=np.uint32)
        for column in (blocks, blocks.copy()):
            target = old[:1].copy()
            loops.apply(
                target,
                1,
                fixed(kinds),
                fixed(counts),
                fixed(no),
                fixed(new[:0]),
                fixed(column, copy=False),
            )
