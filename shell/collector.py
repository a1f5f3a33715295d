"""Cyclic GC kept out of a generate call (and why vLLM's outputs are freed as they are read).

Theory of operation
-------------------
A generate call allocates objects per request and per engine step on the host thread
(vLLM's request states, outputs, logprob lists, detokenizer state; the worker's checks
and tensors), and CPython runs a young-generation collection every 700 net container
allocations, each walking every object allocated since the last one, and an older one
every 10 of those: pauses spread all through the call (66-69 ms per 512 x 256 batch on
the H200 host, issue 20). :func:`defer_cyclic_gc` disables the collector for the block and
runs one young collection at its end, so the call's own cyclic garbage is reclaimed there
(and not inside whatever the caller runs next); older generations are collected later by
the collector's own schedule, as ever. The collector's enabled state is restored whatever
the block raises; a collector that was off stays off and is not run. Nested blocks are
cheap: an inner one finds the collector off and leaves it so.

The long-lived heap is not frozen here: vLLM's ``EngineCore`` already calls ``gc.freeze()``
after start-up (``freeze_gc_heap`` in vllm/utils/gc_utils.py, 0.32), and freezing the
embedding program's heap from a library would keep its later cyclic garbage forever.
The collector is process-wide: other threads run without it during the block too.

Freeing what ``LLM.generate`` returned is the other cost at the end of a call (a
512 x 256 batch holds about 400,000 Python objects with vLLM's flat logprobs, about
130,000 with the worker's sampled arrays, :mod:`genworker.shell.sampled_logprobs`). The
vLLM adapter frees each row as it converts it, while the row's objects are in the cache
(``genworker.shell.vllm_engine``), so nothing of them is left for the young collection
here to walk. (A releaser thread that freed them later, as this module had, either left
them alive for that collection, which then read every token object again, or took the
interpreter lock whenever the caller released it, for up to the 5 ms switch interval each
time, issue 20.)
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["defer_cyclic_gc"]


@contextmanager
def defer_cyclic_gc() -> Iterator[None]:
    """No cyclic collection inside the block, one young collection at its end (a context
    manager, or a decorator: ``@defer_cyclic_gc()``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect(0)
