"""``genworker.core.seams``: a seam's rules are tried in order, the first matching type
wins, anything else becomes ``other`` or passes through unchanged."""

from __future__ import annotations

from collections.abc import Callable

from genworker.core.seams import Seam


class Ours(Exception):
    pass


def _ours(label: str) -> Callable[[str, Exception], Ours]:
    return lambda call, e: Ours(f"{label}: {call}: {e}")


def test_the_first_matching_rule_wins_and_other_takes_the_rest() -> None:
    seam: Seam[Ours] = Seam(
        "edge",
        ((KeyError, _ours("key")), ((LookupError, OSError), _ours("lookup or os"))),
        other=_ours("other"),
    )
    assert str(seam.translate("get", KeyError("k"))) == "key: get: 'k'"
    assert str(seam.translate("get", IndexError("i"))) == "lookup or os: get: i"
    assert str(seam.translate("get", ValueError("v"))) == "other: get: v"


def test_without_other_an_unmapped_error_passes_and_extended_rules_come_last() -> None:
    seam: Seam[Ours] = Seam("edge", ((LookupError, lambda call, e: Ours("lookup")),))
    assert seam.translate("get", ValueError("v")) is None
    wider = seam.extended(
        "wider",
        (ValueError, lambda call, e: Ours("value")),
        (KeyError, lambda call, e: Ours("key")),
    )
    assert (wider.name, wider.other) == ("wider", None)
    assert str(wider.translate("get", ValueError("v"))) == "value"
    assert str(wider.translate("get", KeyError("k"))) == "lookup", "the seam's own rules first"
