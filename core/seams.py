"""A seam's map from foreign exceptions to the library's own: an explicit table, in order.

Each edge of the shell that calls a foreign library (vLLM, Ray, ZMQ, NCCL) declares a
:class:`Seam` (httpcore's ``map_exceptions``): rules from foreign exception types to a
function that builds our error from the call's name and the foreign error. Deciding which
error a foreign one becomes is a lookup over types and values, so it lives here;
``shell.errors.translated`` raises the result, chained, around the calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import attrs

__all__ = ["Seam", "Translation"]

_E = TypeVar("_E", bound=Exception)

#: Builds our error for a foreign one raised by the named call.
Translation = Callable[[str, Exception], _E]


@attrs.frozen
class Seam(Generic[_E]):
    """One edge's map of foreign errors: ``rules`` in order, the first whose type matches
    wins; any other ``Exception`` becomes ``other`` (None: it propagates unchanged)."""

    name: str
    rules: tuple[tuple[type[Exception] | tuple[type[Exception], ...], Translation[_E]], ...] = ()
    other: Translation[_E] | None = None

    def extended(
        self,
        name: str,
        *rules: tuple[type[Exception] | tuple[type[Exception], ...], Translation[_E]],
    ) -> Seam[_E]:
        """This seam with ``rules`` tried after its own (and the same ``other``)."""
        return Seam(name, (*self.rules, *rules), self.other)

    def translate(self, call: str, error: Exception) -> _E | None:
        """Our error for ``error`` raised by ``call``, or None to let it through."""
        for kind, make in self.rules:
            if isinstance(error, kind):
                return make(call, error)
        return None if self.other is None else self.other(call, error)
