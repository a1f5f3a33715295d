"""Which of vLLM's completeness alarms during a refit the refit's direct routes explain.

``shell/vllm_logs.py`` holds vLLM 0.32's two loader alarms back while a refit runs (its
docstring cites them); this decides, once the refit is done, which to let out. A refit
writes whole unquantized modules straight into parameter memory and hands the rest to
vLLM's loader, which then reports as unloaded what the direct routes wrote:

* a "not loaded" alarm (vLLM's set of parameter names) is explained by the names written
  directly; one that names anything else is narrowed to the rest and let out;
* a "failed to load" alarm names a layer's class: each directly written module of that
  class explains one, and so does each module with no parameter of its own (vLLM's
  ``RotaryEmbedding``: a ``cos_sin_cache`` buffer, which no refit or checkpoint carries).

An alarm that is not in vLLM's shape is never explained.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Iterable, Mapping, Sequence, Set

import attrs

__all__ = ["Alarm", "Verdict", "explain_alarms"]


@attrs.frozen
class Alarm:
    """One held alarm: ``not_loaded`` (else "failed to load") and its first argument."""

    not_loaded: bool
    arg: object


@attrs.frozen
class Verdict:
    """Whether an alarm is wholly explained; ``rest``: the names a "not loaded" alarm is
    narrowed to (None: as it was)."""

    explained: bool
    rest: frozenset[str] | None = None


def explain_alarms(
    alarms: Sequence[Alarm],
    written: Set[str],
    classes: Mapping[str, str],
    without_parameters: Iterable[str],
) -> list[Verdict]:
    """One verdict per alarm, in order: ``written`` are the parameter names the refit
    wrote directly, ``classes`` each module's class name by module name,
    ``without_parameters`` the class name of each module with no parameter of its own."""
    budget = collections.Counter(
        classes[m] for m in {n.rpartition(".")[0] for n in written} if m in classes
    )
    budget.update(without_parameters)
    verdicts = []
    for alarm in alarms:
        arg = alarm.arg
        if alarm.not_loaded:
            if not isinstance(arg, Collection) or isinstance(arg, str):
                verdicts.append(Verdict(False))  # not vLLM's shape: nothing to explain away
                continue
            rest = frozenset(str(n) for n in arg) - written
            verdicts.append(Verdict(not rest, rest or None))
        elif isinstance(arg, str) and budget[arg] > 0:
            budget[arg] -= 1
            verdicts.append(Verdict(True))
        else:
            verdicts.append(Verdict(False))
    return verdicts
