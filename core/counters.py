"""Counter keys: vLLM metric snapshots as flat, self-describing dicts, and their step deltas.

Theory of operation
-------------------
``vllm.LLM.get_metrics()`` (``vllm/v1/metrics/reader.py``, vLLM 0.32) returns one value per
Prometheus series: ``Counter(name, labels, value)``, ``Gauge(name, labels, value)``,
``Histogram(name, labels, count, sum, buckets)`` (cumulative counts keyed by the ``le``
bound as vLLM spells it, ``"0.5"``, ``"+Inf"``) and ``Vector(name, labels, values)`` (only
``vllm:spec_decode_num_accepted_tokens_per_pos``: one counter per draft position). The
shell converts each with ``CounterSample.from_counter(m.name, m.labels, m.value)`` and its
siblings; core never sees a vLLM object.

Several series share a name and differ only in labels (``engine``, ``model_name``): engines
in one process share the Prometheus registry (M2 in failure-modes.md), so a series is keyed
by its name AND its labels, never by the name alone, and a :class:`Snapshot` holds at most
one sample per series.

Key grammar (what :func:`encode_snapshot` writes and :func:`decode_snapshot` reads)::

    key     = series [ "|" part ]
    series  = name "{" [ label *( "," label ) ] "}"     ; labels sorted by lname
    name    = [a-zA-Z_:][a-zA-Z0-9_:]*                  ; Prometheus metric name
    label   = lname "=" DQUOTE escaped DQUOTE
    lname   = [a-zA-Z_][a-zA-Z0-9_]*                    ; Prometheus label name
    escaped = the label value with  \\ -> \\\\,  DQUOTE -> \\",  newline -> \\n
    part    = "gauge" | "count" | "sum" | "le=" bound    ; bound as vLLM spells it

    counter    series              -> float
    vector     series              -> list[float]      (index i = draft position i)
    gauge      series "|gauge"     -> float
    histogram  series "|count", series "|sum", series "|le=" bound (one per bucket) -> float

``series`` is exactly the Prometheus text-format series id, e.g.
``vllm:prompt_tokens{engine="0",model_name="m"}``. Names and label names cannot contain
``{ } | = , "``, and label values are quoted and escaped, so every key has one parse even
though vLLM's names contain ``:``. Keys come out sorted, so equal snapshots encode to equal
dicts in the same order, and ``decode_snapshot(encode_snapshot(s)) == Success(s)``.

Step deltas (:func:`step_deltas`): counters, histogram parts and vector positions subtract;
gauges keep the value after. A series any of whose parts went DOWN was reset (the engine
restarted, M1): it is re-based (its delta is its value after) and named in
``StepDeltas.resets`` instead of giving a negative delta. A series absent after is omitted;
a series new after counts from 0. A restart whose counters have already climbed past their
old values cannot be seen in two snapshots; that delta is then too small.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeAlias

import attrs
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "CACHE_RESETS",
    "GENERATION_TOKENS",
    "LOGGER_METRICS",
    "NONFINITE_LOGPROBS",
    "PROMPT_TOKENS",
    "SPEC_DECODE_NUM_ACCEPTED_TOKENS",
    "SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS",
    "SPEC_DECODE_NUM_DRAFTS",
    "SPEC_DECODE_NUM_DRAFT_TOKENS",
    "CounterError",
    "CounterSample",
    "EncodedSnapshot",
    "GaugeSample",
    "GroupCounters",
    "HistogramSample",
    "Labels",
    "MetricSample",
    "Sample",
    "Snapshot",
    "SpecDecodeMetrics",
    "StepDeltas",
    "VectorSample",
    "decode_snapshot",
    "encode_snapshot",
    "group_counters",
    "logger_sample",
    "merge_snapshots",
    "series_id",
    "spec_decode_metrics",
    "step_deltas",
    "values_by_name",
    "worker_counters",
]

PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
CACHE_RESETS = "genworker:cache_resets"
"""The worker's own counter: engine cache resets, labelled ``cache`` = prefix | mm | encoder."""
NONFINITE_LOGPROBS = "genworker:nonfinite_logprobs"
"""The worker's own counter: non-finite logprobs of generated tokens it saw, refused or let
through (-inf under a processed ``logprobs_mode``), labelled ``kind`` = nan | +inf | -inf."""
SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

Labels: TypeAlias = tuple[tuple[str, str], ...]
EncodedSnapshot: TypeAlias = dict[str, float | list[float]]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LNAME = r"[a-zA-Z_][a-zA-Z0-9_]*"
_LABEL = rf'({_LNAME})="((?:[^"\\\n]|\\[\\"n])*)"'
_NAME_RE = re.compile(_NAME)
_LNAME_RE = re.compile(_LNAME)
_LABEL_RE = re.compile(_LABEL)
_KEY_RE = re.compile(rf"({_NAME})\{{((?:{_LABEL}(?:,{_LABEL})*)?)\}}(?:\|(.*))?", re.DOTALL)
_UNESCAPE_RE = re.compile(r"\\(.)")
_UNESCAPES = {"\\": "\\", '"': '"', "n": "\n"}

_GAUGE = "gauge"
_COUNT = "count"
_SUM = "sum"
_LE = "le="


@attrs.frozen
class CounterError(CoreError):
    """A snapshot dict that does not follow the key grammar, or counters that disagree.

    ``key`` is the offending key or series id ("" when the problem is not one key's).
    """

    key: str = ""


# --- sample values -------------------------------------------------------------------------


def _to_labels(value: Mapping[str, str] | Iterable[tuple[str, str]]) -> Labels:
    pairs = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), str(v)) for k, v in pairs))


def _to_float(value: float) -> float:
    return float(value)


def _to_floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _bound_order(bound: str) -> tuple[float, str]:
    return (float(bound), bound)


def _to_buckets(
    value: Mapping[str, float] | Iterable[tuple[str, float]],
) -> tuple[tuple[str, float], ...]:
    pairs = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted(((str(b), float(c)) for b, c in pairs), key=lambda p: _bound_order(p[0])))


def _check_name(_inst: object, _attr: attrs.Attribute[str], name: str) -> None:
    if _NAME_RE.fullmatch(name) is None:
        raise ValueError(f"metric name {name!r} is not a Prometheus name ({_NAME})")


def _check_labels(_inst: object, _attr: attrs.Attribute[Labels], labels: Labels) -> None:
    names = [k for k, _ in labels]
    for k in names:
        if _LNAME_RE.fullmatch(k) is None:
            raise ValueError(f"label name {k!r} is not a Prometheus label name ({_LNAME})")
    if len(set(names)) != len(names):
        raise ValueError(f"label names repeat in {labels!r}")


def _check_finite(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{attr.name} must be finite, got {value!r}")


def _check_count(inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attr.name} must be a finite count >= 0, got {value!r}")


def _check_counts(
    _inst: object, attr: attrs.Attribute[tuple[float, ...]], values: tuple[float, ...]
) -> None:
    for v in values:
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{attr.name} must hold finite counts >= 0, got {v!r}")


def _check_buckets(
    _inst: object,
    _attr: attrs.Attribute[tuple[tuple[str, float], ...]],
    buckets: tuple[tuple[str, float], ...],
) -> None:
    bounds = [b for b, _ in buckets]
    if len(set(bounds)) != len(bounds):
        raise ValueError(f"bucket bounds repeat in {bounds!r}")
    for b, c in buckets:
        if math.isnan(float(b)):
            raise ValueError(f"bucket bound {b!r} is not a number")
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"bucket le={b} must hold a finite count >= 0, got {c!r}")


@attrs.frozen
class CounterSample:
    """One counter series (vLLM ``Counter``): a total that only grows while the engine lives."""

    name: str = attrs.field(validator=_check_name)
    labels: Labels = attrs.field(converter=_to_labels, validator=_check_labels)
    value: float = attrs.field(converter=_to_float, validator=_check_count)

    @classmethod
    def from_counter(cls, name: str, labels: Mapping[str, str], value: float) -> CounterSample:
        """From the fields of a ``vllm.v1.metrics.reader.Counter``."""
        return cls(name, labels, value)


@attrs.frozen
class GaugeSample:
    """One gauge series (vLLM ``Gauge``): a level that goes up and down."""

    name: str = attrs.field(validator=_check_name)
    labels: Labels = attrs.field(converter=_to_labels, validator=_check_labels)
    value: float = attrs.field(converter=_to_float, validator=_check_finite)

    @classmethod
    def from_gauge(cls, name: str, labels: Mapping[str, str], value: float) -> GaugeSample:
        """From the fields of a ``vllm.v1.metrics.reader.Gauge``."""
        return cls(name, labels, value)


@attrs.frozen
class HistogramSample:
    """One histogram series (vLLM ``Histogram``); buckets are cumulative, sorted by bound."""

    name: str = attrs.field(validator=_check_name)
    labels: Labels = attrs.field(converter=_to_labels, validator=_check_labels)
    count: float = attrs.field(converter=_to_float, validator=_check_count)
    sum: float = attrs.field(converter=_to_float, validator=_check_count)
    buckets: tuple[tuple[str, float], ...] = attrs.field(
        default=(), converter=_to_buckets, validator=_check_buckets
    )

    @classmethod
    def from_histogram(
        cls,
        name: str,
        labels: Mapping[str, str],
        count: float,
        sum: float,
        buckets: Mapping[str, float],
    ) -> HistogramSample:
        """From the fields of a ``vllm.v1.metrics.reader.Histogram``."""
        return cls(name, labels, count, sum, buckets)


@attrs.frozen
class VectorSample:
    """One vector series (vLLM ``Vector``): a counter per draft position."""

    name: str = attrs.field(validator=_check_name)
    labels: Labels = attrs.field(converter=_to_labels, validator=_check_labels)
    values: tuple[float, ...] = attrs.field(converter=_to_floats, validator=_check_counts)

    @classmethod
    def from_vector(
        cls, name: str, labels: Mapping[str, str], values: Iterable[float]
    ) -> VectorSample:
        """From the fields of a ``vllm.v1.metrics.reader.Vector``."""
        return cls(name, labels, values)


Sample: TypeAlias = CounterSample | GaugeSample | HistogramSample | VectorSample
MetricSample: TypeAlias = Sample  # the name the engine port uses


def _series_key(sample: Sample) -> tuple[str, Labels]:
    return (sample.name, sample.labels)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def series_id(name: str, labels: Labels) -> str:
    """The Prometheus series id ``name{k="v",...}`` (labels in the given order, escaped)."""
    return name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _sorted_samples(samples: Iterable[Sample]) -> tuple[Sample, ...]:
    return tuple(sorted(samples, key=_series_key))


def _check_unique(
    _inst: object, _attr: attrs.Attribute[tuple[Sample, ...]], samples: tuple[Sample, ...]
) -> None:
    for a, b in itertools.pairwise(samples):
        if _series_key(a) == _series_key(b):
            raise ValueError(
                f"series {series_id(*_series_key(a))} appears twice in one snapshot; "
                "merge several engines' snapshots with merge_snapshots"
            )


@attrs.frozen
class Snapshot:
    """One sample per series, sorted by (name, labels): what one ``get_metrics()`` saw."""

    samples: tuple[Sample, ...] = attrs.field(
        default=(), converter=_sorted_samples, validator=_check_unique
    )

    def by_series(self) -> dict[tuple[str, Labels], Sample]:
        """The samples keyed by (name, labels)."""
        return {_series_key(s): s for s in self.samples}


def _as_snapshot(samples: Snapshot | Iterable[Sample]) -> Snapshot:
    return samples if isinstance(samples, Snapshot) else Snapshot(samples)


# --- encoding ------------------------------------------------------------------------------


def encode_snapshot(samples: Snapshot | Iterable[Sample]) -> EncodedSnapshot:
    """The snapshot as a flat dict in the key grammar above, keys sorted."""
    out: EncodedSnapshot = {}
    for s in _as_snapshot(samples).samples:
        sid = series_id(s.name, s.labels)
        if isinstance(s, CounterSample):
            out[sid] = s.value
        elif isinstance(s, VectorSample):
            out[sid] = list(s.values)
        elif isinstance(s, GaugeSample):
            out[f"{sid}|{_GAUGE}"] = s.value
        else:
            out[f"{sid}|{_COUNT}"] = s.count
            out[f"{sid}|{_SUM}"] = s.sum
            for bound, c in s.buckets:
                out[f"{sid}|{_LE}{bound}"] = c
    return dict(sorted(out.items()))


def values_by_name(samples: Snapshot | Iterable[Sample]) -> dict[str, float | list[float]]:
    """The snapshot keyed by metric name alone, as NeMo-RL's ``_get_raw_spec_counters``
    returns it: counters and gauges as floats, vectors as per-position lists, histograms
    left out (NeMo-RL keeps only metrics with a ``value`` or ``values``). Where several
    series share a name (engines of one process) they are summed, as NeMo-RL's
    ``aggregate_spec_decode_counters`` sums workers; NeMo-RL keeps the last series instead.
    Keys sorted."""
    merged: dict[str, Sample] = {}
    for s in _as_snapshot(samples).samples:
        if isinstance(s, HistogramSample):
            continue
        merged[s.name] = _add(merged[s.name], s) if s.name in merged else s
    out: dict[str, float | list[float]] = {}
    for name, sample in sorted(merged.items()):
        if isinstance(sample, VectorSample):
            out[name] = list(sample.values)
        else:
            assert isinstance(sample, CounterSample | GaugeSample)
            out[name] = sample.value
    return out


def _unescape(value: str) -> str:
    return _UNESCAPE_RE.sub(lambda m: _UNESCAPES[m.group(1)], value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _parse_key(key: str) -> tuple[str, Labels, str | None] | None:
    m = _KEY_RE.fullmatch(key)
    if m is None:
        return None
    labels = tuple((k, _unescape(v)) for k, v in _LABEL_RE.findall(m.group(2)))
    if list(labels) != sorted(labels) or len({k for k, _ in labels}) != len(labels):
        return None
    return m.group(1), labels, m.group(7)


def _fail(message: str, key: str) -> Failure[CounterError]:
    return Failure(CounterError(message=message, key=key))


def decode_snapshot(encoded: Mapping[str, object]) -> Result[Snapshot, CounterError]:
    """Read a dict written by :func:`encode_snapshot` back into a :class:`Snapshot`.

    Fails on the first key outside the grammar, a value of the wrong type, a histogram
    missing its ``|count`` or ``|sum``, or one series spelled as two kinds.
    """
    parts: dict[tuple[str, Labels], dict[str | None, object]] = {}
    for key, value in encoded.items():
        parsed = _parse_key(key)
        if parsed is None:
            return _fail(f"metric key {key!r} does not follow the counter key grammar", key)
        name, labels, part = parsed
        if part not in (None, _GAUGE, _COUNT, _SUM) and not part.startswith(_LE):
            return _fail(f"metric key {key!r} has an unknown part {part!r}", key)
        if part is None and isinstance(value, list | tuple):
            if not all(_is_number(v) for v in value):
                return _fail(f"metric key {key!r} holds a list with a non-number in it", key)
        elif not _is_number(value):
            return _fail(f"metric key {key!r} holds {value!r}, not a number", key)
        parts.setdefault((name, labels), {})[part] = value
    samples: list[Sample] = []
    for (name, labels), fields in parts.items():
        sid = series_id(name, labels)
        try:
            built = _build_sample(name, labels, fields)
        except ValueError as e:
            return _fail(f"metric series {sid}: {e}", sid)
        if built is None:
            return _fail(
                f"metric series {sid} mixes parts of different kinds: {sorted(map(str, fields))}",
                sid,
            )
        samples.append(built)
    return Success(Snapshot(samples))


def _build_sample(name: str, labels: Labels, fields: dict[str | None, object]) -> Sample | None:
    """The sample these parts spell, None if they mix kinds; ValueError on a bad value."""
    keys = set(fields)
    if keys == {None}:
        value = fields[None]
        if isinstance(value, list | tuple):
            return VectorSample(name, labels, value)
        return CounterSample(name, labels, _number(value))
    if keys == {_GAUGE}:
        return GaugeSample(name, labels, _number(fields[_GAUGE]))
    bucket_keys = {k for k in keys if k is not None and k.startswith(_LE)}
    if keys - bucket_keys != {_COUNT, _SUM}:
        return None
    buckets = [(k[len(_LE) :], _number(fields[k])) for k in bucket_keys]
    return HistogramSample(name, labels, _number(fields[_COUNT]), _number(fields[_SUM]), buckets)


def _number(value: object) -> float:
    assert isinstance(value, int | float)  # decode_snapshot checked every value
    return float(value)


# --- deltas --------------------------------------------------------------------------------


@attrs.frozen
class StepDeltas:
    """What happened between two snapshots, and which series were re-based (M1)."""

    deltas: Snapshot
    resets: tuple[str, ...] = ()

    def as_dict(self) -> EncodedSnapshot:
        """The deltas in the key grammar, ready to log."""
        return encode_snapshot(self.deltas)


def _padded(values: tuple[float, ...], n: int) -> tuple[float, ...]:
    return values + (0.0,) * (n - len(values))


def _delta(before: Sample | None, after: Sample) -> tuple[Sample, bool]:
    """The delta of one series and whether it was re-based."""
    if before is None:
        return after, False
    if type(before) is not type(after):
        return after, True
    if isinstance(after, GaugeSample):
        return after, False
    if isinstance(after, CounterSample):
        assert isinstance(before, CounterSample)
        if after.value < before.value:
            return after, True
        return attrs.evolve(after, value=after.value - before.value), False
    if isinstance(after, VectorSample):
        assert isinstance(before, VectorSample)
        n = max(len(before.values), len(after.values))
        b, a = _padded(before.values, n), _padded(after.values, n)
        if any(x < y for x, y in zip(a, b, strict=True)):
            return after, True
        return attrs.evolve(after, values=[x - y for x, y in zip(a, b, strict=True)]), False
    assert isinstance(before, HistogramSample)
    before_buckets = dict(before.buckets)
    after_buckets = dict(after.buckets)
    went_down = (
        after.count < before.count
        or after.sum < before.sum
        or any(after_buckets.get(k, 0.0) < v for k, v in before.buckets)
    )
    if went_down:
        return after, True
    return (
        attrs.evolve(
            after,
            count=after.count - before.count,
            sum=after.sum - before.sum,
            buckets=[(k, v - before_buckets.get(k, 0.0)) for k, v in after_buckets.items()],
        ),
        False,
    )


def step_deltas(before: Snapshot, after: Snapshot) -> StepDeltas:
    """What changed from ``before`` to ``after``: see the module docstring for the rules."""
    old = before.by_series()
    deltas: list[Sample] = []
    resets: list[str] = []
    for s in after.samples:
        d, reset = _delta(old.get(_series_key(s)), s)
        deltas.append(d)
        if reset:
            resets.append(series_id(s.name, s.labels))
    return StepDeltas(Snapshot(deltas), tuple(resets))


# --- merging -------------------------------------------------------------------------------


def _add(a: Sample, b: Sample) -> Sample:
    """``a + b`` for samples of one series (or one name); labels are ``a``'s."""
    if type(a) is not type(b):
        raise ValueError(
            f"series {series_id(a.name, a.labels)} is a {type(a).__name__} in one snapshot "
            f"and a {type(b).__name__} in another"
        )
    if isinstance(a, CounterSample | GaugeSample):
        assert isinstance(b, CounterSample | GaugeSample)
        return attrs.evolve(a, value=a.value + b.value)
    if isinstance(a, VectorSample):
        assert isinstance(b, VectorSample)
        n = max(len(a.values), len(b.values))
        summed = [x + y for x, y in zip(_padded(a.values, n), _padded(b.values, n), strict=True)]
        return attrs.evolve(a, values=summed)
    assert isinstance(b, HistogramSample)
    buckets = dict(a.buckets)
    for k, v in b.buckets:
        buckets[k] = buckets.get(k, 0.0) + v
    return attrs.evolve(a, count=a.count + b.count, sum=a.sum + b.sum, buckets=buckets)


def merge_snapshots(snapshots: Iterable[Snapshot], *, shard_label: str | None = None) -> Snapshot:
    """One snapshot for several shards (one per data-parallel worker process).

    Series that differ in any label stay distinct; samples of the same series are summed
    (counters, histogram parts, vector positions, and gauges: right for request counts). To
    keep every shard's series apart instead (e.g. for ratios such as
    ``vllm:kv_cache_usage_perc``), pass ``shard_label``: each sample of the i-th snapshot
    gets the label ``shard_label="i"``, which must not be one of its labels already.
    """
    merged: dict[tuple[str, Labels], Sample] = {}
    for i, snap in enumerate(snapshots):
        for sample in snap.samples:
            s = sample
            if shard_label is not None:
                if shard_label in dict(s.labels):
                    raise ValueError(
                        f"shard label {shard_label!r} is already a label of "
                        f"{series_id(s.name, s.labels)}"
                    )
                s = attrs.evolve(s, labels=(*s.labels, (shard_label, str(i))))
            key = _series_key(s)
            merged[key] = _add(merged[key], s) if key in merged else s
    return Snapshot(merged.values())


# --- speculative decoding ------------------------------------------------------------------


@attrs.frozen
class SpecDecodeMetrics:
    """Speculative-decoding acceptance over a step, summed over every engine's series.

    As vLLM defines them (``vllm/v1/spec_decode/metrics.py``): acceptance rate = accepted /
    draft tokens; mean acceptance length = 1 + accepted / drafts; the rate at position i =
    accepted at position i / drafts. Positions are 0-based here and 1-based in
    :meth:`as_dict`, as NeMo-RL names them.
    """

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    acceptance_rate: float
    mean_acceptance_length: float
    per_position_acceptance_rates: tuple[float, ...]
    per_position_accepted_tokens: tuple[float, ...]

    def as_dict(self, prefix: str = "vllm/") -> dict[str, float]:
        """Log-ready values under NeMo-RL's names (``compute_spec_decode_metrics`` in
        ``nemo_rl/models/generation/vllm/utils.py``): ``vllm/spec_acceptance_rate``, ...,
        ``vllm/spec_acceptance_rate-pos-1`` for the first draft position, and the position's
        accepted-token count under ``vllm/vllm:spec_decode_num_accepted_tokens_per_pos-1``."""
        out = {
            f"{prefix}spec_num_drafts": self.num_drafts,
            f"{prefix}spec_num_draft_tokens": self.num_draft_tokens,
            f"{prefix}spec_num_accepted_tokens": self.num_accepted_tokens,
            f"{prefix}spec_acceptance_rate": self.acceptance_rate,
            f"{prefix}spec_acceptance_length": self.mean_acceptance_length,
        }
        for i, count in enumerate(self.per_position_accepted_tokens, 1):
            out[f"{prefix}{SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS}-{i}"] = count
        for i, rate in enumerate(self.per_position_acceptance_rates, 1):
            out[f"{prefix}spec_acceptance_rate-pos-{i}"] = rate
        return out


def spec_decode_metrics(
    deltas: StepDeltas | Snapshot,
) -> Result[SpecDecodeMetrics | None, CounterError]:
    """Acceptance metrics from step deltas; ``Success(None)`` when nothing was drafted.

    Fails when the summed counters contradict each other (fewer draft tokens than drafts,
    more accepted tokens than draft tokens, more accepted at one position than drafts),
    which happens when an engine restarted between the snapshots without any counter going
    down. Acceptance rate and per-position rates of a success are therefore in [0, 1].
    """
    snap = deltas.deltas if isinstance(deltas, StepDeltas) else deltas
    totals = {SPEC_DECODE_NUM_DRAFTS: 0.0, SPEC_DECODE_NUM_DRAFT_TOKENS: 0.0}
    totals[SPEC_DECODE_NUM_ACCEPTED_TOKENS] = 0.0
    per_pos: tuple[float, ...] = ()
    for s in snap.samples:
        if isinstance(s, CounterSample) and s.name in totals:
            totals[s.name] += s.value
        elif isinstance(s, VectorSample) and s.name == SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS:
            n = max(len(per_pos), len(s.values))
            per_pos = tuple(
                x + y for x, y in zip(_padded(per_pos, n), _padded(s.values, n), strict=True)
            )
    drafts = totals[SPEC_DECODE_NUM_DRAFTS]
    draft_tokens = totals[SPEC_DECODE_NUM_DRAFT_TOKENS]
    accepted = totals[SPEC_DECODE_NUM_ACCEPTED_TOKENS]
    restart = "the counters are inconsistent (did an engine restart between the snapshots?)"
    if draft_tokens < drafts or drafts == 0 < draft_tokens:
        return _fail(
            f"{SPEC_DECODE_NUM_DRAFT_TOKENS} ({draft_tokens:g}) is below "
            f"{SPEC_DECODE_NUM_DRAFTS} ({drafts:g}) or drafts are missing: {restart}",
            SPEC_DECODE_NUM_DRAFT_TOKENS,
        )
    if accepted > draft_tokens:
        return _fail(
            f"{SPEC_DECODE_NUM_ACCEPTED_TOKENS} ({accepted:g}) exceeds "
            f"{SPEC_DECODE_NUM_DRAFT_TOKENS} ({draft_tokens:g}): {restart}",
            SPEC_DECODE_NUM_ACCEPTED_TOKENS,
        )
    over = [i for i, v in enumerate(per_pos) if v > drafts]
    if over:
        return _fail(
            f"{SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS} at positions {over} exceeds "
            f"{SPEC_DECODE_NUM_DRAFTS} ({drafts:g}): {restart}",
            SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
        )
    if drafts == 0:
        return Success(None)
    return Success(
        SpecDecodeMetrics(
            num_drafts=drafts,
            num_draft_tokens=draft_tokens,
            num_accepted_tokens=accepted,
            acceptance_rate=accepted / draft_tokens,
            mean_acceptance_length=1.0 + accepted / drafts,
            per_position_acceptance_rates=tuple(v / drafts for v in per_pos),
            per_position_accepted_tokens=per_pos,
        )
    )


# --- a data-parallel group's counters ------------------------------------------------------


@attrs.frozen
class GroupCounters:
    """Counter snapshots of every shard, their sum, and spec-decode acceptance over all."""

    shards: tuple[Snapshot, ...]
    merged: Snapshot
    spec_decode: SpecDecodeMetrics | None

    def as_dict(self) -> dict[str, float | list[float]]:
        """The merged snapshot as flat counter keys (:func:`encode_snapshot`)."""
        return encode_snapshot(self.merged)


def group_counters(answers: Sequence[object]) -> Result[GroupCounters, CounterError]:
    """Every shard's encoded snapshot (``answers`` in shard order), decoded, summed, and
    their spec-decode acceptance; an answer that is not a snapshot names its shard."""
    shards: list[Snapshot] = []
    for rank, encoded in enumerate(answers):
        if not isinstance(encoded, Mapping):
            kind = type(encoded).__name__
            return Failure(CounterError(f"shard {rank}: get_counters returned {kind}, not a dict"))
        decoded = decode_snapshot(encoded)
        if isinstance(decoded, Failure):
            problem = decoded.failure()
            return Failure(attrs.evolve(problem, message=f"shard {rank} counters: {problem}"))
        shards.append(decoded.unwrap())
    merged = merge_snapshots(shards)
    spec = spec_decode_metrics(merged)
    if isinstance(spec, Failure):
        problem = spec.failure()
        return Failure(attrs.evolve(problem, message=f"spec-decode counters: {problem}"))
    return Success(GroupCounters(shards=tuple(shards), merged=merged, spec_decode=spec.unwrap()))


def worker_counters(
    cache_resets: Mapping[str, int], nonfinite: Mapping[str, int]
) -> list[CounterSample]:
    """A worker's own counters: its cache resets (``genworker:cache_resets{cache=...}``) and
    the non-finite logprobs it saw (``genworker:nonfinite_logprobs{kind=...}``)."""
    resets = [
        CounterSample.from_counter(CACHE_RESETS, {"cache": name}, count)
        for name, count in cache_resets.items()
    ]
    return [
        *resets,
        *(
            CounterSample.from_counter(NONFINITE_LOGPROBS, {"kind": kind}, count)
            for kind, count in nonfinite.items()
        ),
    ]


#: What NeMo-RL's async worker's metrics thread samples (``_start_vllm_metrics_logger``):
#: vLLM metric -> the list it lands in (``get_vllm_logger_metrics``).
LOGGER_METRICS: Mapping[str, str] = {
    "vllm:num_requests_running": "inflight_batch_sizes",
    "vllm:num_requests_waiting": "num_pending_samples",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    "vllm:generation_tokens": "generation_tokens",
}


def logger_sample(metrics: Iterable[Sample]) -> dict[str, float]:
    """One read of the metrics logger: each :data:`LOGGER_METRICS` series the engine
    reported (a counter or gauge; one engine per worker), under its list's name."""
    return {
        LOGGER_METRICS[m.name]: m.value
        for m in metrics
        if m.name in LOGGER_METRICS and isinstance(m, GaugeSample | CounterSample)
    }
