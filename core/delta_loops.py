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
  (no repeat, nothing past its chunk's end), before :func:`apply_loop` writes anything.

Kinds are numbered as :class:`~genworker.core.delta.ChunkKind`: 0 ``SPARSE``, 1 ``XOR``,
2 ``RAW``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from genworker.core.delta import Bits, ChunkKind

__all__ = ["EncodeLoop", "apply_loop", "check_loop", "encode_loop", "tables_loop"]

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
