"""The base of genworker's expected-failure values.

Core functions return ``Result[T, E]``; every ``E`` is a frozen value derived from
:class:`CoreError`, carrying a human sentence in ``message`` plus the offending inputs in
its own fields. The shell turns them into exceptions of ``genworker.shell.errors``.
"""

from __future__ import annotations

import attrs

__all__ = ["CoreError"]


@attrs.frozen
class CoreError:
    """An expected, caller-actionable failure: what was wrong and with which input."""

    message: str

    def __str__(self) -> str:
        return self.message
