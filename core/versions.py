"""Weight versions: which weights sampled each generated token.

Theory of operation
-------------------
The async worker counts good refits: version 0 is the weights the engine loaded, version
``n`` the weights of the ``n``-th refit that succeeded; a refit that fails leaves the count
alone. A token's version is the version the engine ran when it sampled that token. vLLM
changes weights only while generation is paused (``AsyncLLM.pause_generation`` /
``resume_generation``), so a row's version changes only between two of its tokens and
never goes down along the row: a row is a few runs of equal versions.

:class:`VersionRuns` is that run-length form: ``versions[k]`` sampled the tokens from
``starts[k]`` up to the next start (or ``length``). :meth:`VersionRuns.per_token` is the
dense form, one version per generated token.

Two sources feed it:

- vLLM 0.32 reports the spans itself on a finished request
  (``CompletionOutput.weight_versions``, ``WeightVersionSpan(version, start, end)`` with
  string labels, ``vllm/outputs.py``); the engine core stamps every step's outputs with its
  current label (``EngineCore._attach_weight_version``, ``vllm/v1/engine/core.py``) and
  the output processor starts a span when the label changes
  (``RequestState.track_weight_version``, ``vllm/v1/engine/output_processor.py``). The
  worker labels version ``n`` as ``str(n)``; :func:`runs_from_spans` checks the spans and
  converts the labels.
- Where the engine has no labels, the worker counts each row's tokens as they stream and
  appends them under the version it runs (:func:`extend_runs`).

:func:`place_versions` lays the per-token versions of a batch out like the output
contract's ``logprobs`` (``genworker.core.assembly``): row ``i``'s generated token ``k``
sits at column ``l_i + k``; every other cell (prompt, padding) holds :data:`NO_VERSION`.
:func:`uniform_versions` is the same layout for a batch sampled under one version (the sync
worker's: no refit runs inside its ``generate``), in one vectorised pass.
:func:`staleness` says how many good refits behind the current weights each token is.

A data-parallel group (``genworker.shell.group``) relabels its shards' versions with its
own (:class:`GroupVersions`): version ``g`` is the ``g``-th refit that landed on at least
one shard. A shard counts only its own good refits, so after a refit that failed on some
shards (a failed shard keeps its previous weights or adapter) two shards would give one
count to different weights, and after the next good refit different counts to the same
weights; relabelled, one version names one refit's weights on every shard. Without a
partial failure the labels are the shards' own. A count past the refits collected is the
group's next ones, in order (a refit not yet collected: an async shard's rows sampled
before ``collect``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs
import numpy as np
import numpy.typing as npt
import torch
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "NO_VERSION",
    "Counted",
    "GroupVersions",
    "VersionError",
    "VersionRuns",
    "WeightSpan",
    "extend_runs",
    "finished_runs",
    "place_versions",
    "runs_from_spans",
    "runs_from_tokens",
    "staleness",
    "uniform_versions",
    "weight_spans",
]

NO_VERSION = -1
"""The version :func:`place_versions` writes where no generated token is."""

IntArray = npt.NDArray[np.int64]


@attrs.frozen
class VersionError(CoreError):
    """Versions that cannot describe one row's tokens; ``detail`` names what is wrong."""

    detail: str = ""


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _check_runs(runs: VersionRuns) -> None:
    versions, starts, length = runs.versions, runs.starts, runs.length
    problem = None
    if len(versions) != len(starts):
        problem = f"{len(versions)} versions but {len(starts)} starts"
    elif length < 0:
        problem = f"length {length} is negative"
    elif (length == 0) != (not starts):
        problem = f"{len(starts)} runs for {length} tokens"
    elif starts and starts[0] != 0:
        problem = f"the first run starts at {starts[0]}, not 0"
    elif any(b <= a for a, b in itertools.pairwise(starts)) or (starts and starts[-1] >= length):
        problem = f"starts {list(starts)} are not increasing inside [0, {length})"
    elif any(v < 0 for v in versions):
        problem = f"versions {list(versions)} hold a negative version"
    elif any(b <= a for a, b in itertools.pairwise(versions)):
        problem = f"versions {list(versions)} do not increase from run to run"
    if problem is not None:
        raise ValueError(f"VersionRuns: {problem}")


@attrs.frozen
class VersionRuns:
    """One row's versions as runs: ``versions[k]`` from ``starts[k]`` to the next start.

    Invariants: one start per version; the first run starts at 0; starts increase and stay
    below ``length``; versions are non-negative and increase from run to run (equal
    neighbours would be one run). A row without tokens has no runs.
    """

    versions: tuple[int, ...] = attrs.field(converter=_int_tuple)
    starts: tuple[int, ...] = attrs.field(converter=_int_tuple)
    length: int

    def __attrs_post_init__(self) -> None:
        _check_runs(self)

    @classmethod
    def uniform(cls, version: int, length: int) -> VersionRuns:
        """``length`` tokens, all sampled under ``version``."""
        return cls((version,), (0,), length) if length else cls((), (), 0)

    @property
    def ends(self) -> tuple[int, ...]:
        """Where each run stops (exclusive)."""
        return (*self.starts[1:], self.length) if self.starts else ()

    @property
    def latest(self) -> int | None:
        """The version of the last token (None without tokens)."""
        return self.versions[-1] if self.versions else None

    def per_token(self) -> IntArray:
        """One version per token (int64, ``length`` long)."""
        counts = np.diff(np.asarray((*self.starts, self.length), dtype=np.int64))
        return np.repeat(np.asarray(self.versions, dtype=np.int64), counts)


def runs_from_tokens(per_token: Sequence[int] | IntArray) -> Result[VersionRuns, VersionError]:
    """The runs of a per-token version sequence; versions must be >= 0 and never decrease."""
    values = np.asarray(per_token, dtype=np.int64).reshape(-1)
    if values.size == 0:
        return Success(VersionRuns((), (), 0))
    if bool((values < 0).any()):
        at = int(np.argmax(values < 0))
        return Failure(
            VersionError(
                message=f"token {at} has the negative version {int(values[at])}",
                detail="negative",
            )
        )
    steps = np.diff(values)
    if bool((steps < 0).any()):
        at = int(np.argmax(steps < 0)) + 1
        return Failure(
            VersionError(
                message=(
                    f"token {at} has version {int(values[at])} after version "
                    f"{int(values[at - 1])}: versions never go down along a row"
                ),
                detail="decreasing",
            )
        )
    starts = np.concatenate(([0], np.nonzero(steps)[0] + 1))
    return Success(VersionRuns(values[starts].tolist(), starts.tolist(), int(values.size)))


def extend_runs(runs: VersionRuns, version: int, count: int) -> Result[VersionRuns, VersionError]:
    """``runs`` followed by ``count`` more tokens sampled under ``version``."""
    if count < 0:
        return Failure(VersionError(message=f"cannot add {count} tokens to a row", detail="count"))
    if count == 0:
        return Success(runs)
    latest = runs.latest
    if latest is not None and version < latest:
        return Failure(
            VersionError(
                message=f"version {version} after version {latest}: versions never go down",
                detail="decreasing",
            )
        )
    if version < 0:
        return Failure(VersionError(message=f"negative version {version}", detail="negative"))
    if latest == version:
        return Success(attrs.evolve(runs, length=runs.length + count))
    return Success(
        VersionRuns((*runs.versions, version), (*runs.starts, runs.length), runs.length + count)
    )


class WeightSpan(Protocol):
    """One of vLLM's ``CompletionOutput.weight_versions`` entries (``WeightVersionSpan``:
    tokens ``[start, end)`` sampled by the weights labelled ``version``)."""

    @property
    def version(self) -> object: ...

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...


def weight_spans(spans: Iterable[WeightSpan] | None) -> tuple[tuple[str, int, int], ...] | None:
    """A completion's spans as ``(label, start, end)`` values, as :func:`runs_from_spans`
    reads them; None for a completion the engine did not label."""
    if spans is None:
        return None
    return tuple((str(s.version), int(s.start), int(s.end)) for s in spans)


def runs_from_spans(
    spans: Sequence[tuple[str, int, int]], length: int
) -> Result[VersionRuns, VersionError]:
    """The runs of vLLM's labelled spans ``(label, start, end)`` over ``length`` tokens.

    Labels are the worker's decimal version numbers; the spans must tile ``[0, length)`` in
    order. Neighbours with one version merge into one run.
    """
    parsed: list[tuple[int, int]] = []
    at = 0
    for k, (label, start, end) in enumerate(spans):
        if not (isinstance(label, str) and label.isdecimal() and label.isascii()):
            return Failure(
                VersionError(
                    message=f"span {k} has the label {label!r}, not a version number",
                    detail="label",
                )
            )
        if start != at or end <= start:
            return Failure(
                VersionError(
                    message=(
                        f"span {k} covers [{start}, {end}) where the next span must start at "
                        f"{at} and hold at least one token"
                    ),
                    detail="tiling",
                )
            )
        parsed.append((int(label), end - start))
        at = end
    if at != length:
        return Failure(
            VersionError(
                message=f"the spans cover {at} tokens of {length}",
                detail="tiling",
            )
        )
    runs = VersionRuns((), (), 0)
    for version, count in parsed:
        extended = extend_runs(runs, version, count)
        if isinstance(extended, Failure):
            return extended
        runs = extended.unwrap()
    return Success(runs)


@attrs.frozen
class Counted:
    """A row's tokens as the worker counted them while they streamed (an engine that does
    not label tokens): the runs closed at each refit, the tokens seen, the version now."""

    runs: VersionRuns
    seen: int
    version: int


def finished_runs(
    num_tokens: int,
    row: int,
    *,
    spans: Sequence[tuple[str, int, int]] | None,
    counted: Counted | None,
) -> Result[VersionRuns, VersionError]:
    """The versions of a finished row's ``num_tokens`` tokens: from the engine's labelled
    ``spans`` (``counted`` None: the engine labels tokens), else from what the worker
    ``counted``, its last tokens under the version now; errors name the row."""
    if counted is None:
        if spans is None:
            message = f"row {row}: the engine did not label its tokens"
            return Failure(VersionError(message=message, detail="unlabelled"))
        runs = runs_from_spans(spans, num_tokens)
    elif counted.seen > num_tokens:
        message = f"row {row}: {counted.seen} tokens streamed but {num_tokens} in the final output"
        return Failure(VersionError(message=message, detail="count"))
    else:
        runs = extend_runs(counted.runs, counted.version, num_tokens - counted.runs.length)
    return runs.alt(lambda e: attrs.evolve(e, message=f"row {row} weight versions: {e}"))


def staleness(runs: VersionRuns, current: int) -> IntArray:
    """How many good refits each token's weights are behind ``current`` (>= 0 for a
    ``current`` at or past the row's latest version)."""
    return current - runs.per_token()


def place_versions(
    input_lengths: Sequence[int], rows: Sequence[VersionRuns], width: int
) -> torch.Tensor:
    """A (B, ``width``) int64 tensor: row ``i``'s token ``k`` version at ``l_i + k``,
    :data:`NO_VERSION` everywhere else (the layout of the output contract's logprobs).

    A row that does not fit in ``width`` is a programming error (``ValueError``).
    """
    if len(input_lengths) != len(rows):
        raise ValueError(f"{len(rows)} version rows for {len(input_lengths)} input lengths")
    out = np.full((len(rows), width), NO_VERSION, dtype=np.int64)
    for i, (start, runs) in enumerate(zip(input_lengths, rows, strict=True)):
        if start < 0 or start + runs.length > width:
            raise ValueError(
                f"row {i}: {runs.length} tokens after {start} input tokens do not fit in "
                f"width {width}"
            )
        out[i, start : start + runs.length] = runs.per_token()
    return torch.from_numpy(out)


def uniform_versions(
    input_lengths: torch.Tensor, generation_lengths: torch.Tensor, width: int, version: int
) -> torch.Tensor:
    """:func:`place_versions` of rows whose every token ``version`` sampled: ``version`` at
    columns ``[l_i, l_i + g_i)`` of row ``i``, :data:`NO_VERSION` elsewhere; (B, ``width``)
    int64. A row that does not fit in ``width`` is a programming error (``ValueError``)."""
    if generation_lengths.numel() != input_lengths.numel():
        raise ValueError(
            f"{generation_lengths.numel()} generation lengths for {input_lengths.numel()} "
            "input lengths"
        )
    starts = input_lengths.to(torch.int64).reshape(-1, 1)
    ends = starts + generation_lengths.to(torch.int64).reshape(-1, 1)
    if bool((starts < 0).any()) or bool((ends > width).any()) or bool((ends < starts).any()):
        raise ValueError(f"rows that do not fit in width {width}: {torch.cat([starts, ends], 1)}")
    columns = torch.arange(width, dtype=torch.int64)
    inside = (columns >= starts) & (columns < ends)
    return torch.where(inside, version, NO_VERSION).to(torch.int64)


def _start_at_zero(instance: GroupVersions, attribute: object, value: object) -> None:
    for rank, own in enumerate(instance.shards):
        if not own or own[0] != 0 or list(own) != sorted(set(own)) or own[-1] > instance.version:
            raise ValueError(
                f"shard {rank}'s versions {own} must rise from 0 to at most {instance.version}"
            )


@attrs.frozen
class GroupVersions:
    """A group's weight versions (the module docstring): ``version`` is the group's count
    of refits that landed; ``shards[rank][c]`` the group version of shard ``rank``'s own
    version ``c``."""

    version: int
    shards: tuple[tuple[int, ...], ...] = attrs.field(validator=_start_at_zero)

    @classmethod
    def start(cls, num_shards: int) -> GroupVersions:
        """Every shard on the weights it loaded: version 0."""
        return cls(version=0, shards=((0,),) * num_shards)

    def landed(self, took: Iterable[int]) -> GroupVersions:
        """After a refit collected: the shards ``took`` (ranks) took it (none: unchanged)."""
        ranks = set(took)
        if not ranks:
            return self
        version = self.version + 1
        return GroupVersions(
            version=version,
            shards=tuple(
                (*own, version) if rank in ranks else own for rank, own in enumerate(self.shards)
            ),
        )

    def relabel(self, rank: int, versions: torch.Tensor) -> torch.Tensor:
        """Shard ``rank``'s per-token ``versions`` as the group's (:data:`NO_VERSION` cells
        kept); the tensor itself where the shard took every refit."""
        own = self.shards[rank]
        if len(own) == self.version + 1:
            return versions  # the shard took every refit: its count is the group's
        table = torch.tensor(own, dtype=versions.dtype, device=versions.device)
        taken = table[versions.clamp(0, len(own) - 1)]
        later = versions - (len(own) - 1) + self.version
        group = torch.where(versions < len(own), taken, later)
        return torch.where(versions >= 0, group, versions)
