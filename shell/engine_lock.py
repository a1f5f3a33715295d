"""One engine call at a time: the sync worker's lock.

Theory of operation
-------------------
vLLM's offline ``LLM`` is not thread-safe: two threads inside ``LLM.generate`` step the
same engine and steal each other's outputs (an untyped ``KeyError`` on a request id in one,
a hang in the other), and a refit that runs under a running forward swaps the weights'
tensors beneath it. So every call of the sync worker that touches the engine, or reads and
then commits the lifecycle state, runs while holding this lock: the check against the
lifecycle table and the commit of the next state are atomic with the engine call between.

A call that finds the lock held WAITS for it, at most ``wait_s`` seconds, then is refused
with :class:`~genworker.shell.errors.EngineStateError` naming the call in progress and how
long it has run; ``wait_s=0`` refuses at once. A refused call changed nothing. A call made
from inside the holding call on the same thread is refused at once (it could never get the
lock). The async worker allows refits during generation on purpose, through vLLM's
pause/resume; this lock is the sync worker's rule.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from genworker.core.lifecycle import busy_wait
from genworker.shell.errors import BadArgumentError, EngineStateError, unwrap

__all__ = ["EngineLock"]


class EngineLock:
    """A lock that names its holder and waits a bounded time (see the module docstring)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = unwrap(busy_wait(wait_s), BadArgumentError, "")
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._holder: tuple[str, float] | None = None

    def held(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()

    @contextmanager
    def hold(self, call: str) -> Iterator[None]:
        """Hold the lock for ``call``, or raise EngineStateError (see the module docstring)."""
        if self.held():
            raise EngineStateError(
                f"{call}: called from inside {self._holder_name()} on the same thread; "
                "the worker runs one call at a time"
            )
        if not self._lock.acquire(timeout=self.wait_s):  # 0: a single try
            holder = self._holder
            running = "" if holder is None else f" for {time.monotonic() - holder[1]:.1f} s"
            raise EngineStateError(
                f"{call}: the worker is busy with {self._holder_name(holder)} (running{running}); "
                f"waited {self.wait_s:g} s (busy_wait_s). The worker runs one engine call "
                "at a time; this call changed nothing"
            )
        self._owner = threading.get_ident()
        self._holder = (call, time.monotonic())
        try:
            yield
        finally:
            self._owner = None
            self._holder = None
            self._lock.release()

    def _holder_name(self, holder: tuple[str, float] | None = None) -> str:
        holder = holder or self._holder
        return "another call" if holder is None else f"{holder[0]}()"
