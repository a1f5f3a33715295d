"""Stop-string merge: the config's stop strings plus each sample's own.

Theory of operation
-------------------
NeMo-RL's sync ``generate`` merges the config's ``stop_strings`` with the *union* of every
sample's ``stop_strings`` and gives that one list to the whole batch, so a sample can stop on
another sample's stop string (its async path merges per sample). Here the default,
:attr:`StopMode.PER_SAMPLE`, gives each row the config's strings followed by its own;
:attr:`StopMode.BATCH_UNION` reproduces the sync path for callers that depend on it.

Order is first-seen (config, then the row's own, then, for the union, later rows) with
duplicates dropped: vLLM de-duplicates ``stop_token_ids`` but not stop strings
(``vllm/sampling_params.py``), and a stable order keeps identical rows identical so they can
share one ``SamplingParams``. vLLM rejects an empty stop string at request time; here it is
refused up front with its row and position. A bare ``str`` where a list is expected is refused
too: iterated, it would become one stop string per character.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Literal

import attrs
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "StopError",
    "StopMode",
    "StopProblem",
    "merge_stop_strings",
]


class StopMode(enum.Enum):
    """How per-sample stop strings are spread over a batch."""

    PER_SAMPLE = "per_sample"
    """Each row stops on the config's strings and its own (the default)."""
    BATCH_UNION = "batch_union"
    """Every row stops on the config's strings and every row's (NeMo-RL's sync path)."""


@attrs.frozen
class StopProblem:
    """One bad input: ``source`` is ``"config"`` or a row index, or ``None`` for the
    per-sample list as a whole; ``position`` indexes the string within it, if one is meant."""

    source: int | Literal["config"] | None
    position: int | None
    message: str

    def __str__(self) -> str:
        return self.message


@attrs.frozen
class StopError(CoreError):
    """The stop strings could not be merged; ``problems`` lists every bad input."""

    problems: tuple[StopProblem, ...]


def _where(source: int | Literal["config"], position: int | None) -> str:
    base = "config stop_strings" if source == "config" else f"stop_strings of row {source}"
    return base if position is None else f"{base}[{position}]"


def _check_strings(strings: object, source: int | Literal["config"]) -> list[StopProblem]:
    """Problems with one list of stop strings (``None`` is no strings)."""
    if strings is None:
        return []
    if isinstance(strings, str | bytes) or not isinstance(strings, Sequence):
        return [
            StopProblem(
                source,
                None,
                f"{_where(source, None)} must be a list of strings, got "
                f"{type(strings).__name__} {strings!r}",
            )
        ]
    problems = []
    for position, string in enumerate(strings):
        if not isinstance(string, str):
            problems.append(
                StopProblem(
                    source,
                    position,
                    f"{_where(source, position)} must be a string, got "
                    f"{type(string).__name__} {string!r}",
                )
            )
        elif not string:
            problems.append(
                StopProblem(source, position, f"{_where(source, position)} is an empty string")
            )
    return problems


def _error(problems: Sequence[StopProblem]) -> StopError:
    return StopError("; ".join(p.message for p in problems), problems=tuple(problems))


def merge_stop_strings(
    config_stops: Sequence[str] | None,
    per_sample: Sequence[Sequence[str] | None] | None,
    batch_size: int,
    mode: StopMode = StopMode.PER_SAMPLE,
) -> Result[tuple[tuple[str, ...], ...], StopError]:
    """Each row's stop strings: config first, then the row's own (or every row's, in union
    mode), first-seen order, no duplicates.

    ``per_sample`` is ``None`` (no per-sample strings) or holds one entry per row, each a list
    of strings or ``None``. Every problem is reported at once.
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be non-negative, got {batch_size}")
    problems = _check_strings(config_stops, "config")
    rows: Sequence[Sequence[str] | None]
    if per_sample is None:
        rows = (None,) * batch_size
    elif isinstance(per_sample, str | bytes) or not isinstance(per_sample, Sequence):
        problems.append(
            StopProblem(
                None,
                None,
                "per-sample stop_strings must be a list with one entry per row, got "
                f"{type(per_sample).__name__} {per_sample!r}",
            )
        )
        rows = ()
    elif len(per_sample) != batch_size:
        problems.append(
            StopProblem(
                None,
                None,
                f"per-sample stop_strings has {len(per_sample)} entries for a batch of "
                f"{batch_size} rows",
            )
        )
        rows = ()
    else:
        rows = per_sample
        for row, strings in enumerate(rows):
            problems.extend(_check_strings(strings, row))
    if problems:
        return Failure(_error(problems))

    base = tuple(dict.fromkeys(config_stops or ()))
    if per_sample is None:  # every row gets the config's strings, in either mode
        return Success((base,) * batch_size)
    if mode is StopMode.BATCH_UNION:
        union = dict.fromkeys(base)
        for strings in rows:
            union.update(dict.fromkeys(strings or ()))
        return Success((tuple(union),) * batch_size)
    return Success(tuple(tuple(dict.fromkeys((*base, *(strings or ())))) for strings in rows))
