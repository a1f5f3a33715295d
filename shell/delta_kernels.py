"""Compiled loops for the sparse-delta codec's hot paths: one pass per tensor piece.

The codec's rules and its reference implementation are pure numpy in ``core/delta.py``
(:func:`~genworker.core.delta.encode_delta`, :meth:`~genworker.core.delta.TensorDelta.to_bytes`,
:func:`~genworker.core.delta.decode_delta`, :func:`~genworker.core.delta.apply_delta_into`).
Those make several passes over a piece (compare, ``flatnonzero``, ``bincount``, gathers,
gap arithmetic, one copy per column): for a delta step of a 100M-parameter model, twice
the time of the step's CRC-32s, which themselves cost as much as the rest. Here the same
work is one loop (``core/delta_loops.py``, which also drives them), compiled here with
numba (a dependency of vLLM) when it imports, that writes the wire form's columns directly:

- :func:`encode_wire`: ``encode_delta(old, new, chunk_elements).to_bytes()``, byte for
  byte;
- :func:`apply_wire_into`: ``decode_delta`` then ``apply_delta_into``, with the same
  checks and the same :class:`~genworker.core.delta.DeltaError`\\ s, a refused delta
  leaving ``target`` as it was;
- :func:`piece_hash`: :func:`~genworker.core.delta.bits_hash`, the 64-bit hash each
  piece's result is checked with.

Without numba (or on a big-endian host) all three fall back to the core's numpy
functions, with the same results. The loops release the GIL, so the sender's and the
receiver's thread pools run them in parallel. :func:`warm_up` loads them (from numba's
disk cache, under a second; compiling them the first time takes seconds), which the
sender and the receivers do when they start.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from typing import Final

from returns.result import Result

from genworker.core import delta_loops as loops
from genworker.core.delta import MAX_CHUNK_ELEMENTS, Bits, DeltaError
from genworker.core.delta_loops import Loops

__all__ = ["apply_wire_into", "compiled", "encode_wire", "piece_hash", "warm_up"]


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


def _compile() -> Loops | None:
    if sys.byteorder != "little":  # the wire form is little-endian; the loops write native
        return None
    try:
        import numba  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - numba comes with vLLM
        return None
    _shield_llvmlite_lib()
    jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    plain = loops.PLAIN
    encoders = {size: jit(loop) for size, loop in plain.encoders.items()}
    return Loops(encoders, *(jit(f) for f in (plain.tables, plain.check, plain.apply, plain.hash)))


#: The loops, compiled on first use: numba (and llvmlite) are imported only by a process
#: that runs a sparse refit, not by every engine worker that imports the extension.
_kernels: Final = functools.cache(_compile)


def compiled() -> bool:
    """True when the loops are compiled (numba imports); False: the core's numpy path."""
    return _kernels() is not None


def encode_wire(old: Bits, new: Bits, chunk_elements: int = MAX_CHUNK_ELEMENTS) -> bytes:
    """``encode_delta(old, new, chunk_elements).to_bytes()``, in one compiled pass
    (``ValueError`` for what ``encode_delta`` refuses)."""
    return loops.encode_wire(_kernels(), old, new, chunk_elements)


def apply_wire_into(target: Bits, data: bytes | bytearray | memoryview) -> Result[None, DeltaError]:
    """``decode_delta(data)`` applied into ``target`` (``apply_delta_into``), one pass,
    with the same refusals; ``target`` is untouched by any."""
    return loops.apply_wire_into(_kernels(), target, data)


def piece_hash(bits: Bits) -> int:
    """:func:`~genworker.core.delta.bits_hash` of ``bits``, in one compiled pass."""
    return loops.piece_hash(_kernels(), bits)


def warm_up(itemsizes: Iterable[int] = (1, 2, 4)) -> None:
    """Load (or compile) the loops for these element widths now, on tiny inputs, so that
    a step's first frame does not wait for numba (under a second a process from numba's
    disk cache, seconds the first time ever). A no-op without numba."""
    loops.warm_up(_kernels(), itemsizes)
