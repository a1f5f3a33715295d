"""Memory management kept out of a generate call: cyclic GC, and freeing vLLM's outputs.

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

Freeing what ``LLM.generate`` returned is the other cost at the end of a call: a
512 x 256 batch holds about 400,000 Python objects (each token id twice, each logprob,
the lists around them), scattered over the heap, and dropping them took 10-13 ms of CPU
on the 2-core CPU host, as long as reading them into arrays. Once the worker has read
them, :func:`release_later` hands the list to a daemon thread that empties it one item at
a time (one request's output per step, so the thread gives the interpreter lock back
between steps): the caller returns at once and the objects are freed while it, or the
engine's next forward pass, runs without the lock. :func:`wait_released` waits until
every list handed over is empty. A forked child starts its own thread when it needs one.
"""

from __future__ import annotations

import gc
import os
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["defer_cyclic_gc", "release_later", "wait_released"]

_T = TypeVar("_T")


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


class _Releaser:
    """The daemon thread that empties the lists handed to :func:`release_later`."""

    def __init__(self) -> None:
        self.pending: queue.Queue[list[Any]] = queue.Queue()  # any element type
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def release(self, items: list[_T]) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="genworker-release", daemon=True
                )
                self.thread.start()
        self.pending.put(items)

    def _run(self) -> None:
        while True:
            items = self.pending.get()
            try:
                while items:
                    items.pop()
            finally:
                del items
                self.pending.task_done()


_releaser = _Releaser()


def _after_fork_in_child() -> None:
    global _releaser
    _releaser = _Releaser()  # the parent's thread does not exist here


os.register_at_fork(after_in_child=_after_fork_in_child)


def release_later(items: list[_T]) -> None:
    """Free ``items``' elements on the releaser thread (the list is emptied there); the
    caller must hold no other reference to them."""
    _releaser.release(items)


def wait_released() -> None:
    """Wait until every list handed to :func:`release_later` is empty."""
    _releaser.pending.join()
