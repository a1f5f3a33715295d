"""Compiled loops for the sparse-delta codec's hot paths: one pass per tensor piece.

The codec's rules and its reference implementation are pure numpy in ``core/delta.py``
(:func:`~genworker.core.delta.encode_delta`, :meth:`~genworker.core.delta.TensorDelta.to_bytes`,
:func:`~genworker.core.delta.decode_delta`, :func:`~genworker.core.delta.apply_delta_into`).
Those make several passes over a piece (compare, ``flatnonzero``, ``bincount``, gathers,
gap arithmetic, one copy per column): for a delta step of a 100M-parameter model, twice
the time of the step's CRC-32s, which themselves cost as much as the rest. Here the same
work is one loop, compiled with numba (a dependency of vLLM) when it imports, that writes
the wire form's columns directly:

- :func:`encode_wire`: ``encode_delta(old, new, chunk_elements).to_bytes()``, byte for
  byte (``core.delta_loops.encode_loop``);
- :func:`apply_wire_into`: ``decode_delta`` then ``apply_delta_into``, with the same
  checks and the same :class:`~genworker.core.delta.DeltaError`\\ s: the header and chunk
  tables by a loop (any doubt: :func:`~genworker.core.delta.decode_tables` decides and
  words the refusal), then every gap checked before anything is written, so a refused
  delta leaves ``target`` as it was;
- :func:`piece_hash`: :func:`~genworker.core.delta.bits_hash`, the 64-bit hash each
  piece's result is checked with (about 20 GB/s here, CRC-32 about 4).

Without numba (or on a big-endian host) all three fall back to the core's numpy
functions, with the same results. The loops release the GIL, so the sender's and the
receiver's thread pools run them in parallel. :func:`warm_up` loads them (from numba's
disk cache, under a second; compiling them the first time takes seconds), which the
sender and the receivers do when they start.
"""

from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Callable, Iterable
from typing import Final, TypeVar, cast

import numpy as np
import numpy.typing as npt
from returns.result import Failure, Result, Success

from genworker.core.delta import (
    HASH_BLOCK_WORDS,
    HASH_KEYS,
    HASH_MULTIPLIERS,
    HEADER_BYTES,
    MAX_CHUNK_ELEMENTS,
    Bits,
    DeltaError,
    apply_delta_into,
    bits_hash,
    chunk_count,
    decode_delta,
    decode_tables,
    encode_delta,
    encode_full,
)
from genworker.core.delta_loops import apply_loop, check_loop, encode_loop, tables_loop

__all__ = ["apply_wire_into", "compiled", "encode_wire", "piece_hash", "warm_up"]

_A = TypeVar("_A", bound=npt.NDArray[np.generic])
_HEADER: Final = struct.Struct("<4sBIQI")
_MAGIC: Final = b"GWD1"
assert _HEADER.size == HEADER_BYTES


def _hash_loop(
    words: npt.NDArray[np.uint64],
    tail: np.uint64,
    has_tail: int,
    nbytes: int,
    keys: npt.NDArray[np.uint64],
    mults: npt.NDArray[np.uint64],
) -> np.uint64:
    """``bits_hash`` over ``words`` and, when ``has_tail``, one last (zero-padded) word."""
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
        total += _mix(s + np.uint64(b) * np.uint64(0x9E3779B97F4A7C15))
    return _mix(total ^ np.uint64(nbytes))


def _mix(z: np.uint64) -> np.uint64:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


_Encode = Callable[..., tuple[int, int]]
_Encoders = dict[int, _Encode]
_Check = Callable[..., int]
_Tables = Callable[..., tuple[int, int, bool]]
_Apply = Callable[..., None]
_Hash = Callable[..., np.uint64]


def _shield_llvmlite_lib() -> None:
    """Give ``llvmlite.binding.ffi.lib`` an empty ``__dict__``.

    vLLM's CPU platform scans every module's globals when an engine starts
    (``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``: ``vars(value).get(...)``
    for any value with a ``__dict__``). llvmlite's ``lib`` has slots and a
    ``__getattr__`` that wraps whatever its ``CDLL`` answers, so ``lib.__dict__`` is a
    function wrapper and the scan dies (``'_lib_fn_wrapper' object has no attribute
    'get'``): no engine could start in a process that imported numba. Its ``__getattr__``
    serves names from a cache first; an empty dict there is what ``vars`` then sees.
    """
    from llvmlite.binding import ffi  # type: ignore[import-untyped]

    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict):
        table["__dict__"] = {}


def _compile() -> tuple[_Encoders, _Tables, _Check, _Apply, _Hash] | None:
    if sys.byteorder != "little":  # the wire form is little-endian; the loops write native
        return None
    try:
        import numba  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - numba comes with vLLM
        return None
    _shield_llvmlite_lib()
    jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    global _mix  # what the hash loop calls
    _mix = jit(_mix)
    return (
        {size: cast(_Encode, jit(encode_loop(8 // size))) for size in (1, 2, 4, 8)},
        cast(_Tables, jit(tables_loop)),
        cast(_Check, jit(check_loop)),
        cast(_Apply, jit(apply_loop)),
        cast(_Hash, jit(_hash_loop)),
    )


#: The loops, compiled on first use: numba (and llvmlite) are imported only by a process
#: that runs a sparse refit, not by every engine worker that imports the extension.
_kernels: Final = functools.cache(_compile)


def compiled() -> bool:
    """True when the loops are compiled (numba imports); False: the core's numpy path."""
    return _kernels() is not None


_NO_WORDS: Final = np.empty(0, dtype=np.uint64)


def _words(bits: Bits) -> npt.NDArray[np.uint64]:
    per = 8 // bits.itemsize
    whole = len(bits) // per * per
    if per == 1 or bits.ctypes.data % 8 or not whole:
        return _NO_WORDS
    return bits[:whole].view(np.uint64)


def encode_wire(old: Bits, new: Bits, chunk_elements: int = MAX_CHUNK_ELEMENTS) -> bytes:
    """``encode_delta(old, new, chunk_elements).to_bytes()``, in one compiled pass.

    Arrays of different dtypes or lengths, or ``chunk_elements`` outside
    ``[1, MAX_CHUNK_ELEMENTS]``, are programming errors (``ValueError``).
    """
    kernels = _kernels()
    if kernels is None or old.dtype != new.dtype or old.shape != new.shape or old.ndim != 1:
        return encode_delta(old, new, chunk_elements).to_bytes()  # or its ValueError
    if not 1 <= chunk_elements <= MAX_CHUNK_ELEMENTS:
        return encode_delta(old, new, chunk_elements).to_bytes()  # raises
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
    entries, dense = kernels[0][itemsize](
        old, new, old_words, new_words, chunk_elements, kinds, counts, gaps, values, blocks
    )
    head = _HEADER.pack(_MAGIC, itemsize, chunk_elements, numel, n_chunks)
    return b"".join(
        (
            head,
            kinds.data,
            counts.data,
            gaps[:entries].data,
            values[:entries].data,
            blocks[:dense].data,
        )
    )


_GAP_PROBLEMS: Final = {
    1: DeltaError("invalid delta: positions in a chunk repeat", field="positions"),
    2: DeltaError("invalid delta: a change lies past its chunk's end", field="positions"),
}


def _fixed(array: _A, *, copy: bool = True) -> _A:
    """``array`` read-only and (when ``copy``) aligned, copied when it is not: numba
    compiles a loop per kind of array (layout, alignment, writability) it meets, and a
    column at an odd offset of the buffer is unaligned. The dense blocks (a full step's
    bits) are left where they are: their loop is compiled for both alignments."""
    if copy and not array.flags.aligned:
        array = array.copy()
    array.flags.writeable = False
    return array


_Columns = tuple[
    int,  # itemsize
    int,  # numel
    int,  # chunk_elements
    npt.NDArray[np.uint8],  # kinds
    npt.NDArray[np.uint32],  # counts
    npt.NDArray[np.uint16],  # gaps
    Bits,  # values
    Bits,  # blocks
]


def _columns(data: bytes | bytearray | memoryview) -> Result[_Columns, DeltaError]:
    """The wire form's columns: checked by a compiled loop, or (when that loop finds it
    anything but valid) by ``decode_tables``, whose refusal is the answer."""
    kernels = _kernels()
    assert kernels is not None
    buf = memoryview(data).cast("B")
    if len(buf) >= HEADER_BYTES:
        magic, itemsize, chunk_elements, numel, n_chunks = _HEADER.unpack_from(buf)
        tables = HEADER_BYTES + 5 * n_chunks
        if (
            magic == _MAGIC
            and itemsize in (1, 2, 4, 8)
            and 1 <= chunk_elements <= MAX_CHUNK_ELEMENTS
            and n_chunks == chunk_count(numel, chunk_elements)
            and len(buf) >= tables
        ):
            kinds = np.frombuffer(buf, dtype=np.uint8, count=n_chunks, offset=HEADER_BYTES)
            at = HEADER_BYTES + n_chunks
            counts = np.frombuffer(buf, dtype=np.uint32, count=n_chunks, offset=at)
            entries, dense, valid = kernels[1](kinds, counts, numel, chunk_elements)
            if valid and len(buf) == tables + entries * (2 + itemsize) + dense * itemsize:
                width = np.dtype(f"u{itemsize}")
                gaps = np.frombuffer(buf, dtype=np.uint16, count=entries, offset=tables)
                at = tables + 2 * entries
                values = np.frombuffer(buf, dtype=width, count=entries, offset=at)
                at += itemsize * entries
                blocks = np.frombuffer(buf, dtype=width, count=dense, offset=at)
                found = (itemsize, numel, chunk_elements, kinds, counts, gaps, values, blocks)
                return Success(_fixed_columns(found))
    decoded = decode_tables(data)
    if isinstance(decoded, Failure):
        return Failure(decoded.failure())
    t = decoded.unwrap()  # pragma: no cover - the loop's rules are decode_tables'
    counts = t.counts.astype(np.uint32)  # pragma: no cover
    return Success(  # pragma: no cover
        _fixed_columns(
            (t.itemsize, t.numel, t.chunk_elements, t.kinds, counts, t.gaps, t.values, t.blocks)
        )
    )


def _fixed_columns(columns: _Columns) -> _Columns:
    """``columns`` with every array :func:`_fixed` (the dense blocks left where they are)."""
    itemsize, numel, chunk_elements, kinds, counts, gaps, values, blocks = columns
    return (
        itemsize,
        numel,
        chunk_elements,
        _fixed(kinds),
        _fixed(counts),
        _fixed(gaps),
        _fixed(values),
        _fixed(blocks, copy=False),
    )


def apply_wire_into(target: Bits, data: bytes | bytearray | memoryview) -> Result[None, DeltaError]:
    """``decode_delta(data)`` applied into ``target`` (``apply_delta_into``), one pass.

    The same refusals, with the same :class:`DeltaError`: an invalid buffer, or a target
    whose width or length differs from the delta's; ``target`` is untouched by either.
    """
    kernels = _kernels()
    if kernels is None:
        return decode_delta(data).bind(lambda delta: apply_delta_into(target, delta))
    decoded = _columns(data)
    if isinstance(decoded, Failure):
        return Failure(decoded.failure())
    itemsize, numel, chunk_elements, kinds, counts, gaps, values, blocks = decoded.unwrap()
    _, _, check, apply, _ = kernels
    problem = check(kinds, counts, gaps, numel, chunk_elements)  # decode_delta's last check
    if problem:
        return Failure(_GAP_PROBLEMS[problem])
    if target.ndim != 1 or target.itemsize != itemsize or len(target) != numel:
        return Failure(
            DeltaError(
                f"a delta of {numel} elements of {itemsize} bytes cannot apply "
                f"to an array of shape {target.shape} and {target.itemsize}-byte elements",
                field="target",
            )
        )
    values = values.astype(target.dtype, copy=False)
    blocks = blocks.astype(target.dtype, copy=False)
    apply(target, chunk_elements, kinds, counts, gaps, values, blocks)
    return Success(None)


def piece_hash(bits: Bits) -> int:
    """:func:`~genworker.core.delta.bits_hash` of ``bits``, in one compiled pass."""
    kernels = _kernels()
    if kernels is None:
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
    value = kernels[4](
        words, tail.view(np.uint64)[0], int(nbytes > whole), nbytes, HASH_KEYS, HASH_MULTIPLIERS
    )
    return int(value)


def warm_up(itemsizes: Iterable[int] = (1, 2, 4)) -> None:
    """Load (or compile) the loops for these element widths now, on tiny inputs, so that
    a step's first frame does not wait for numba (under a second a process from numba's
    disk cache, seconds the first time ever). A no-op without numba."""
    kernels = _kernels()
    if kernels is None:
        return
    for itemsize in sorted(set(itemsizes)):
        dtype = np.dtype(f"u{itemsize}")
        old = np.zeros(300, dtype=dtype)
        new = old.copy()
        new[::7] = 1
        new[200:] = 2  # one chunk dense
        for data in (encode_wire(old, new, 64), encode_full(new, 64).to_bytes()):
            for shift in (0, 1):  # the blocks aligned and not
                buf = memoryview(bytes(shift) + data)[shift:]
                target = old.copy()
                apply_wire_into(target, buf).unwrap()
                piece_hash(target)
        blocks = np.frombuffer(bytes(itemsize + 1), dtype=dtype, count=1, offset=1)
        no = np.zeros(0, dtype=np.uint16)
        kinds, counts = np.full(1, 2, dtype=np.uint8), np.zeros(1, dtype=np.uint32)
        for column in (blocks, blocks.copy()):
            target = old[:1].copy()
            kernels[3](
                target,
                1,
                _fixed(kinds),
                _fixed(counts),
                _fixed(no),
                _fixed(new[:0]),
                _fixed(column, copy=False),
            )
