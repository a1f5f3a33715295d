"""Counter keys: the key grammar, round trips, step deltas, merges and spec-decode metrics."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import (
    metric_samples,
    metric_snapshots,
    snapshot_histories,
    spec_decode_histories,
)

from genworker.core.counters import (
    CACHE_RESETS,
    GENERATION_TOKENS,
    LOGGER_METRICS,
    NONFINITE_LOGPROBS,
    PROMPT_TOKENS,
    SPEC_DECODE_NUM_ACCEPTED_TOKENS,
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
    SPEC_DECODE_NUM_DRAFT_TOKENS,
    SPEC_DECODE_NUM_DRAFTS,
    CounterError,
    CounterSample,
    EncodedSnapshot,
    GaugeSample,
    GroupCounters,
    HistogramSample,
    Sample,
    Snapshot,
    SpecDecodeMetrics,
    StepDeltas,
    VectorSample,
    decode_snapshot,
    encode_snapshot,
    group_counters,
    logger_sample,
    merge_snapshots,
    series_id,
    spec_decode_metrics,
    step_deltas,
    values_by_name,
    worker_counters,
)

ENGINE0 = {"engine": "0", "model_name": "m"}
ENGINE1 = {"engine": "1", "model_name": "m"}

# The grammar of the module docstring, written out independently.
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_KEY = re.compile(
    rf"[a-zA-Z_:][a-zA-Z0-9_:]*\{{(?:{_LABEL}(?:,{_LABEL})*)?\}}(?:\|(?:gauge|count|sum|le=.+))?",
    re.DOTALL,
)


def _spec(labels: dict[str, str], drafts: int, per_pos: list[int], k: int) -> list[Sample]:
    return [
        CounterSample(SPEC_DECODE_NUM_DRAFTS, labels, drafts),
        CounterSample(SPEC_DECODE_NUM_DRAFT_TOKENS, labels, drafts * k),
        CounterSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS, labels, sum(per_pos)),
        VectorSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, labels, per_pos),
    ]


def _non_gauge_values(encoded: EncodedSnapshot) -> list[float]:
    out: list[float] = []
    for key, value in encoded.items():
        if key.endswith("|gauge"):
            continue
        out.extend(value if isinstance(value, list) else [value])
    return out


def _add_encoded(a: EncodedSnapshot, b: EncodedSnapshot) -> EncodedSnapshot:
    """Sum two delta dicts over the same keys (gauges: the later one)."""
    assert a.keys() == b.keys()
    out: EncodedSnapshot = {}
    for key, x in a.items():
        y = b[key]
        if key.endswith("|gauge"):
            out[key] = y
        elif isinstance(x, list):
            assert isinstance(y, list)
            out[key] = [p + q for p, q in zip(x, y, strict=True)]
        else:
            assert not isinstance(y, list)
            out[key] = x + y
    return out


# --- the key grammar -----------------------------------------------------------------------


def test_keys_spell_prometheus_series_with_their_part() -> None:
    snap = Snapshot(
        [
            CounterSample.from_counter(PROMPT_TOKENS, {"model_name": "m", "engine": "0"}, 12),
            GaugeSample.from_gauge("vllm:kv_cache_usage_perc", ENGINE0, 0.25),
            HistogramSample.from_histogram(
                "vllm:e2e_request_latency_seconds",
                ENGINE0,
                3,
                1.5,
                {"0.5": 2, "+Inf": 3, "1.0": 2},
            ),
            VectorSample.from_vector(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, ENGINE0, [5, 2]),
        ]
    )
    labels = 'engine="0",model_name="m"'
    assert encode_snapshot(snap) == {
        f"vllm:e2e_request_latency_seconds{{{labels}}}|count": 3.0,
        f"vllm:e2e_request_latency_seconds{{{labels}}}|le=+Inf": 3.0,
        f"vllm:e2e_request_latency_seconds{{{labels}}}|le=0.5": 2.0,
        f"vllm:e2e_request_latency_seconds{{{labels}}}|le=1.0": 2.0,
        f"vllm:e2e_request_latency_seconds{{{labels}}}|sum": 1.5,
        f"vllm:kv_cache_usage_perc{{{labels}}}|gauge": 0.25,
        f"vllm:prompt_tokens{{{labels}}}": 12.0,
        f"vllm:spec_decode_num_accepted_tokens_per_pos{{{labels}}}": [5.0, 2.0],
    }


def test_histogram_buckets_are_ordered_by_bound_not_by_spelling() -> None:
    h = HistogramSample("h", {}, 3, 1.0, {"+Inf": 3, "10": 3, "2.5": 1, "0.5": 0})
    assert [b for b, _ in h.buckets] == ["0.5", "2.5", "10", "+Inf"]


def test_label_values_with_separators_and_quotes_are_escaped() -> None:
    sample = CounterSample("vllm:x", {"a": 'q"|,}=\\\nz'}, 1)
    (key,) = encode_snapshot([sample])
    assert key == 'vllm:x{a="q\\"|,}=\\\\\\nz"}'
    assert decode_snapshot({key: 1.0}) == Success(Snapshot([sample]))


def test_series_without_labels_keep_empty_braces() -> None:
    assert encode_snapshot([CounterSample("vllm:x", {}, 2)]) == {"vllm:x{}": 2.0}
    assert series_id("vllm:x", ()) == "vllm:x{}"


def test_several_engines_under_one_name_stay_distinct() -> None:
    """M2: keyed by name AND labels, one engine's count never overwrites another's."""
    encoded = encode_snapshot(
        [CounterSample(PROMPT_TOKENS, ENGINE0, 5), CounterSample(PROMPT_TOKENS, ENGINE1, 7)]
    )
    assert encoded == {
        'vllm:prompt_tokens{engine="0",model_name="m"}': 5.0,
        'vllm:prompt_tokens{engine="1",model_name="m"}': 7.0,
    }


@given(metric_snapshots())
def test_every_key_follows_the_documented_grammar(snap: Snapshot) -> None:
    for key in encode_snapshot(snap):
        assert _KEY.fullmatch(key), key


@given(metric_snapshots())
def test_decode_round_trips_encode_exactly(snap: Snapshot) -> None:
    assert decode_snapshot(encode_snapshot(snap)) == Success(snap)


@given(metric_snapshots())
def test_encode_then_decode_then_encode_is_the_same_dict(snap: Snapshot) -> None:
    encoded = encode_snapshot(snap)
    assert encode_snapshot(decode_snapshot(encoded).unwrap()) == encoded


@given(st.lists(metric_samples(), max_size=8, unique_by=lambda s: (s.name, s.labels)), st.randoms())
def test_encoding_is_sorted_and_independent_of_sample_order(
    samples: list[Sample], rnd: random.Random
) -> None:
    shuffled = list(samples)
    rnd.shuffle(shuffled)
    encoded = encode_snapshot(samples)
    assert list(encoded) == sorted(encoded)
    assert list(encode_snapshot(shuffled).items()) == list(encoded.items())


@given(metric_snapshots())
def test_decode_accepts_the_keys_in_any_order(snap: Snapshot) -> None:
    encoded = encode_snapshot(snap)
    assert decode_snapshot(dict(reversed(encoded.items()))) == Success(snap)


def test_decode_reads_integers_as_counts() -> None:
    assert decode_snapshot({"vllm:x{}": 3}) == Success(Snapshot([CounterSample("vllm:x", {}, 3)]))


@pytest.mark.parametrize(
    ("encoded", "key", "words"),
    [
        ({"vllm:x": 1.0}, "vllm:x", "grammar"),
        ({"1x{}": 1.0}, "1x{}", "grammar"),
        ({'x{a="1",}': 1.0}, 'x{a="1",}', "grammar"),
        ({'x{a="\\t"}': 1.0}, 'x{a="\\t"}', "grammar"),
        ({'x{a="1"}|': 1.0}, 'x{a="1"}|', "unknown part"),
        ({'x{b="1",a="2"}': 1.0}, 'x{b="1",a="2"}', "grammar"),
        ({'x{a="1",a="2"}': 1.0}, 'x{a="1",a="2"}', "grammar"),
        ({"x{}|max": 1.0}, "x{}|max", "unknown part"),
        ({"x{}": "12"}, "x{}", "not a number"),
        ({"x{}": True}, "x{}", "not a number"),
        ({"x{}": None}, "x{}", "not a number"),
        ({"x{}|count": [1.0]}, "x{}|count", "not a number"),
        ({"x{}": [1.0, "2"]}, "x{}", "non-number"),
        ({"x{}": -1.0}, "x{}", "finite count >= 0"),
        ({"x{}": float("nan")}, "x{}", "finite count >= 0"),
        ({"x{}|gauge": float("inf")}, "x{}", "must be finite"),
        ({"x{}": [1.0, -2.0]}, "x{}", "finite counts >= 0"),
        ({"x{}|count": 1.0}, "x{}", "mixes parts"),
        ({"x{}|count": 1.0, "x{}|le=+Inf": 1.0}, "x{}", "mixes parts"),
        ({"x{}": 1.0, "x{}|gauge": 1.0}, "x{}", "mixes parts"),
        ({"x{}|gauge": 1.0, "x{}|sum": 1.0, "x{}|count": 1.0}, "x{}", "mixes parts"),
        ({"x{}|count": 1.0, "x{}|sum": 1.0, "x{}|le=abc": 1.0}, "x{}", "could not convert"),
        ({"x{}|count": 1.0, "x{}|sum": 1.0, "x{}|le=nan": 1.0}, "x{}", "not a number"),
        ({"x{}|count": 1.0, "x{}|sum": -1.0}, "x{}", "sum must be a finite count"),
    ],
)
def test_decode_names_the_key_it_cannot_read(
    encoded: dict[str, object], key: str, words: str
) -> None:
    result = decode_snapshot(encoded)
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, CounterError)
    assert error.key == key
    assert words in str(error)
    assert key in str(error) or repr(key) in str(error)


# --- sample and snapshot invariants ----------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: CounterSample("prompt-tokens", {}, 1),
        lambda: CounterSample("", {}, 1),
        lambda: CounterSample("x", {"bad-label": "v"}, 1),
        lambda: CounterSample("x", [("a", "1"), ("a", "2")], 1),
        lambda: CounterSample("x", {}, -1),
        lambda: GaugeSample("x", {}, float("nan")),
        lambda: VectorSample("x", {}, [1, float("inf")]),
        lambda: HistogramSample("x", {}, 1, 1, [("1", 1), ("1", 1)]),
        lambda: HistogramSample("x", {}, 1, 1, {"1": -1}),
        lambda: HistogramSample("x", {}, 1, 1, {"nan": 1}),
    ],
)
def test_samples_refuse_values_that_break_the_grammar_or_counts(
    build: Callable[[], object],
) -> None:
    with pytest.raises(ValueError):
        build()


def test_a_snapshot_refuses_one_series_twice() -> None:
    with pytest.raises(ValueError, match="merge_snapshots"):
        Snapshot([CounterSample("x", {"a": "1"}, 1), GaugeSample("x", {"a": "1"}, 2)])


def test_labels_are_sorted_whatever_order_vllm_gives() -> None:
    a = CounterSample("x", {"z": "1", "a": "2"}, 1)
    assert a.labels == (("a", "2"), ("z", "1"))
    assert a == CounterSample("x", [("a", "2"), ("z", "1")], 1.0)


# --- step deltas ---------------------------------------------------------------------------


def test_step_deltas_subtract_counts_and_keep_gauges() -> None:
    before = Snapshot(
        [
            CounterSample(GENERATION_TOKENS, ENGINE0, 100),
            GaugeSample("vllm:num_requests_running", ENGINE0, 8),
            HistogramSample("h", ENGINE0, 4, 2.0, {"1.0": 3, "+Inf": 4}),
            VectorSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, ENGINE0, [3, 1]),
        ]
    )
    after = Snapshot(
        [
            CounterSample(GENERATION_TOKENS, ENGINE0, 160),
            GaugeSample("vllm:num_requests_running", ENGINE0, 2),
            HistogramSample("h", ENGINE0, 6, 5.5, {"1.0": 4, "+Inf": 6}),
            VectorSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, ENGINE0, [7, 2]),
        ]
    )
    d = step_deltas(before, after)
    assert d.resets == ()
    assert d.deltas == Snapshot(
        [
            CounterSample(GENERATION_TOKENS, ENGINE0, 60),
            GaugeSample("vllm:num_requests_running", ENGINE0, 2),
            HistogramSample("h", ENGINE0, 2, 3.5, {"1.0": 1, "+Inf": 2}),
            VectorSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, ENGINE0, [4, 1]),
        ]
    )
    assert d.as_dict() == encode_snapshot(d.deltas)


def test_a_restarted_engine_is_rebased_and_reported_not_negative() -> None:
    """M1: nemo-rl#4052 logged -800 prompt tokens after a shard restarted."""
    before = Snapshot(
        [CounterSample(PROMPT_TOKENS, ENGINE0, 1000), CounterSample(PROMPT_TOKENS, ENGINE1, 900)]
    )
    after = Snapshot(
        [CounterSample(PROMPT_TOKENS, ENGINE0, 200), CounterSample(PROMPT_TOKENS, ENGINE1, 950)]
    )
    d = step_deltas(before, after)
    assert d.resets == ('vllm:prompt_tokens{engine="0",model_name="m"}',)
    assert d.deltas == Snapshot(
        [CounterSample(PROMPT_TOKENS, ENGINE0, 200), CounterSample(PROMPT_TOKENS, ENGINE1, 50)]
    )


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (
            HistogramSample("h", {}, 5, 9.0, {"1.0": 2, "+Inf": 5}),
            HistogramSample("h", {}, 4, 9.5, {"1.0": 3, "+Inf": 4}),
        ),
        (
            HistogramSample("h", {}, 5, 9.0, {"1.0": 2, "+Inf": 5}),
            HistogramSample("h", {}, 6, 8.0, {"1.0": 3, "+Inf": 6}),
        ),
        (
            HistogramSample("h", {}, 5, 9.0, {"1.0": 2, "+Inf": 5}),
            HistogramSample("h", {}, 6, 9.5, {"1.0": 1, "+Inf": 6}),
        ),
        (
            HistogramSample("h", {}, 5, 9.0, {"0.5": 1, "+Inf": 5}),
            HistogramSample("h", {}, 6, 9.5, {"+Inf": 6}),
        ),
        (VectorSample("v", {}, [4, 2]), VectorSample("v", {}, [5, 1])),
        (VectorSample("v", {}, [4, 2]), VectorSample("v", {}, [5])),
        (CounterSample("c", {}, 4), GaugeSample("c", {}, 5)),
        (GaugeSample("c", {}, 4), CounterSample("c", {}, 5)),
    ],
)
def test_any_part_going_down_rebases_the_whole_series(before: Sample, after: Sample) -> None:
    d = step_deltas(Snapshot([before]), Snapshot([after]))
    assert d.deltas == Snapshot([after])
    assert d.resets == (series_id(after.name, after.labels),)


def test_vectors_and_buckets_of_different_shapes_subtract_what_is_there() -> None:
    d = step_deltas(
        Snapshot(
            [
                VectorSample("v", {}, [4, 2]),
                HistogramSample("h", {}, 5, 9.0, {"0.5": 0, "+Inf": 5}),
            ]
        ),
        Snapshot(
            [
                VectorSample("v", {}, [5, 2, 1]),
                HistogramSample("h", {}, 6, 9.5, {"1.0": 1, "+Inf": 6}),
            ]
        ),
    )
    assert d.resets == ()
    assert d.deltas == Snapshot(
        [
            VectorSample("v", {}, [1, 0, 1]),
            HistogramSample("h", {}, 1, 0.5, {"1.0": 1, "+Inf": 1}),
        ]
    )


def test_absent_series_are_omitted_and_new_series_count_from_zero() -> None:
    before = Snapshot([CounterSample(PROMPT_TOKENS, ENGINE0, 10)])
    after = Snapshot([CounterSample(PROMPT_TOKENS, ENGINE1, 4)])
    d = step_deltas(before, after)
    assert d == StepDeltas(Snapshot([CounterSample(PROMPT_TOKENS, ENGINE1, 4)]), ())


@given(metric_snapshots())
def test_deltas_of_a_snapshot_with_itself_are_zero(snap: Snapshot) -> None:
    d = step_deltas(snap, snap)
    assert d.resets == ()
    assert set(_non_gauge_values(d.as_dict())) <= {0.0}
    gauges = [s for s in snap.samples if isinstance(s, GaugeSample)]
    assert [s for s in d.deltas.samples if isinstance(s, GaugeSample)] == gauges
    assert encode_snapshot(d.deltas).keys() == encode_snapshot(snap).keys()


@given(metric_snapshots(), metric_snapshots())
def test_deltas_are_never_negative_and_cover_exactly_the_series_after(
    before: Snapshot, after: Snapshot
) -> None:
    """Including series of one name in both, restarts and kinds that changed."""
    d = step_deltas(before, after)
    assert all(v >= 0 for v in _non_gauge_values(d.as_dict()))
    assert [(s.name, s.labels) for s in d.deltas.samples] == [
        (s.name, s.labels) for s in after.samples
    ]
    old = before.by_series()
    for s in after.samples:
        if series_id(s.name, s.labels) in d.resets:
            assert (s.name, s.labels) in old
            assert d.deltas.by_series()[(s.name, s.labels)] == s


@given(snapshot_histories(length=3))
def test_deltas_add_up_over_consecutive_steps(history: list[Snapshot]) -> None:
    a, b, c = history
    ab, bc, ac = step_deltas(a, b), step_deltas(b, c), step_deltas(a, c)
    assert ab.resets == bc.resets == ac.resets == ()
    assert _add_encoded(ab.as_dict(), bc.as_dict()) == ac.as_dict()


@given(snapshot_histories(length=2), st.integers(1, 10**9), st.data())
def test_lowering_one_series_reports_exactly_that_series(
    history: list[Snapshot], old_value: int, data: st.DataObject
) -> None:
    """A restarted engine among healthy ones: only its series is re-based."""
    key = ("vllm:restarted", (("engine", "restarted"),))
    before, after = (
        Snapshot([s for s in snap.samples if (s.name, s.labels) != key]) for snap in history
    )
    new_value = data.draw(st.integers(0, old_value - 1))
    old = CounterSample(key[0], key[1], old_value)
    new = CounterSample(key[0], key[1], new_value)
    d = step_deltas(Snapshot([*before.samples, old]), Snapshot([*after.samples, new]))
    assert d.resets == ('vllm:restarted{engine="restarted"}',)
    assert d.deltas.by_series()[key] == new
    assert d.deltas == Snapshot([*step_deltas(before, after).deltas.samples, new])


# --- merging shards ------------------------------------------------------------------------


def test_merge_sums_the_same_series_and_keeps_engines_apart() -> None:
    shard_a = Snapshot(
        [
            CounterSample(PROMPT_TOKENS, ENGINE0, 10),
            GaugeSample("vllm:num_requests_running", ENGINE0, 2),
            HistogramSample("h", ENGINE0, 2, 1.0, {"1.0": 1, "+Inf": 2}),
            VectorSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, ENGINE0, [3]),
        ]
    )
    shard_b = Snapshot(
        [
            CounterSample(PROMPT_TOKENS, ENGINE0, 5),
            CounterSample(PROMPT_TOKENS, ENGINE1, 7),
            GaugeSample("vllm:num_requests_running", ENGINE0, 3),
            HistogramSample("h", ENGINE0, 1, 4.0, {"5.0": 1, "+Inf": 1}),
            VectorSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, ENGINE0, [1, 1]),
        ]
    )
    assert merge_snapshots([shard_a, shard_b]) == Snapshot(
        [
            CounterSample(PROMPT_TOKENS, ENGINE0, 15),
            CounterSample(PROMPT_TOKENS, ENGINE1, 7),
            GaugeSample("vllm:num_requests_running", ENGINE0, 5),
            HistogramSample("h", ENGINE0, 3, 5.0, {"1.0": 1, "5.0": 1, "+Inf": 3}),
            VectorSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, ENGINE0, [4, 1]),
        ]
    )


def test_merge_with_a_shard_label_keeps_every_shard_apart() -> None:
    shards = [Snapshot([GaugeSample("vllm:kv_cache_usage_perc", ENGINE0, u)]) for u in (0.5, 0.25)]
    merged = merge_snapshots(shards, shard_label="shard")
    assert merged == Snapshot(
        [
            GaugeSample("vllm:kv_cache_usage_perc", {**ENGINE0, "shard": "0"}, 0.5),
            GaugeSample("vllm:kv_cache_usage_perc", {**ENGINE0, "shard": "1"}, 0.25),
        ]
    )


def test_merge_refuses_a_shard_label_the_series_already_has() -> None:
    with pytest.raises(ValueError, match="engine"):
        merge_snapshots([Snapshot([CounterSample("x", ENGINE0, 1)])], shard_label="engine")


def test_merge_refuses_one_series_of_two_kinds() -> None:
    snaps = [Snapshot([CounterSample("x", {}, 1)]), Snapshot([GaugeSample("x", {}, 1)])]
    with pytest.raises(ValueError, match=r"CounterSample.*GaugeSample"):
        merge_snapshots(snaps)


@given(metric_snapshots())
def test_merging_one_snapshot_changes_nothing(snap: Snapshot) -> None:
    assert merge_snapshots([snap]) == snap
    assert merge_snapshots([]) == Snapshot()


@given(st.lists(metric_snapshots(max_size=4), max_size=3))
def test_a_shard_label_keeps_every_sample_of_every_shard(snaps: list[Snapshot]) -> None:
    assume(all("shard" not in dict(s.labels) for snap in snaps for s in snap.samples))
    merged = merge_snapshots(snaps, shard_label="shard")
    assert len(merged.samples) == sum(len(snap.samples) for snap in snaps)
    for i, snap in enumerate(snaps):
        mine = [s for s in merged.samples if ("shard", str(i)) in s.labels]
        unlabelled = [
            attrs.evolve(s, labels=[p for p in s.labels if p[0] != "shard"]) for s in mine
        ]
        assert Snapshot(unlabelled) == snap


@given(snapshot_histories(length=2, max_size=5), snapshot_histories(length=2, max_size=5))
def test_deltas_of_merged_shards_are_merged_deltas(
    shard_a: list[Snapshot], shard_b: list[Snapshot]
) -> None:
    """Summing shards before or after taking deltas gives the same step (no restarts)."""
    kinds_a = {(s.name, s.labels): type(s) for s in shard_a[0].samples}
    clash = any(kinds_a.get((s.name, s.labels), type(s)) is not type(s) for s in shard_b[0].samples)
    assume(not clash)
    merged_then_delta = step_deltas(
        merge_snapshots([shard_a[0], shard_b[0]]), merge_snapshots([shard_a[1], shard_b[1]])
    )
    delta_then_merged = merge_snapshots(
        [step_deltas(*shard_a).deltas, step_deltas(*shard_b).deltas]
    )
    assert merged_then_delta.resets == ()
    gauges_agree = {
        (s.name, s.labels)
        for s in merged_then_delta.deltas.samples
        if not isinstance(s, GaugeSample)
    }
    assert {k: v for k, v in merged_then_delta.deltas.by_series().items() if k in gauges_agree} == {
        k: v for k, v in delta_then_merged.by_series().items() if k in gauges_agree
    }


# --- speculative decoding ------------------------------------------------------------------


def test_spec_decode_metrics_follow_vllm_definitions() -> None:
    before = Snapshot(_spec(ENGINE0, 10, [6, 3], k=2) + _spec(ENGINE1, 0, [0, 0], k=2))
    after = Snapshot(_spec(ENGINE0, 30, [16, 8], k=2) + _spec(ENGINE1, 20, [14, 7], k=2))
    metrics = spec_decode_metrics(step_deltas(before, after)).unwrap()
    # drafts 20 + 20, draft tokens 80, accepted (10 + 5) + (14 + 7) = 36
    assert metrics == SpecDecodeMetrics(
        num_drafts=40.0,
        num_draft_tokens=80.0,
        num_accepted_tokens=36.0,
        acceptance_rate=36 / 80,
        mean_acceptance_length=1 + 36 / 40,
        per_position_acceptance_rates=(24 / 40, 12 / 40),
        per_position_accepted_tokens=(24.0, 12.0),
    )
    # NeMo-RL's names (compute_spec_decode_metrics): positions numbered from 1.
    assert metrics.as_dict() == {
        "vllm/spec_num_drafts": 40.0,
        "vllm/spec_num_draft_tokens": 80.0,
        "vllm/spec_num_accepted_tokens": 36.0,
        "vllm/spec_acceptance_rate": 0.45,
        "vllm/spec_acceptance_length": 1.9,
        "vllm/vllm:spec_decode_num_accepted_tokens_per_pos-1": 24.0,
        "vllm/vllm:spec_decode_num_accepted_tokens_per_pos-2": 12.0,
        "vllm/spec_acceptance_rate-pos-1": 0.6,
        "vllm/spec_acceptance_rate-pos-2": 0.3,
    }


def test_spec_decode_metrics_are_none_without_drafts() -> None:
    assert spec_decode_metrics(Snapshot()) == Success(None)
    idle = Snapshot(_spec(ENGINE0, 5, [2], k=1))
    assert spec_decode_metrics(step_deltas(idle, idle)) == Success(None)
    no_spec = Snapshot([CounterSample(PROMPT_TOKENS, ENGINE0, 100)])
    assert spec_decode_metrics(no_spec) == Success(None)


def test_spec_decode_metrics_ignore_same_named_series_of_other_kinds() -> None:
    snap = Snapshot(
        [
            *_spec(ENGINE0, 4, [2], k=1),
            GaugeSample(SPEC_DECODE_NUM_DRAFTS, ENGINE1, 100),
            CounterSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, ENGINE1, 100),
        ]
    )
    assert spec_decode_metrics(snap).unwrap() == SpecDecodeMetrics(
        4.0, 4.0, 2.0, 0.5, 1.5, (0.5,), (2.0,)
    )


@pytest.mark.parametrize(
    ("samples", "key"),
    [
        (
            [
                CounterSample(SPEC_DECODE_NUM_DRAFTS, {}, 4),
                CounterSample(SPEC_DECODE_NUM_DRAFT_TOKENS, {}, 3),
            ],
            SPEC_DECODE_NUM_DRAFT_TOKENS,
        ),
        ([CounterSample(SPEC_DECODE_NUM_DRAFT_TOKENS, {}, 3)], SPEC_DECODE_NUM_DRAFT_TOKENS),
        (
            [
                CounterSample(SPEC_DECODE_NUM_DRAFTS, {}, 2),
                CounterSample(SPEC_DECODE_NUM_DRAFT_TOKENS, {}, 4),
                CounterSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS, {}, 5),
            ],
            SPEC_DECODE_NUM_ACCEPTED_TOKENS,
        ),
        (
            [
                CounterSample(SPEC_DECODE_NUM_DRAFTS, {}, 2),
                CounterSample(SPEC_DECODE_NUM_DRAFT_TOKENS, {}, 4),
                CounterSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS, {}, 3),
                VectorSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, {}, [3, 0]),
            ],
            SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
        ),
    ],
)
def test_contradictory_spec_decode_counters_are_reported(samples: list[Sample], key: str) -> None:
    result = spec_decode_metrics(Snapshot(samples))
    assert isinstance(result, Failure)
    assert result.failure().key == key
    assert "inconsistent" in str(result.failure())


@given(spec_decode_histories())
def test_spec_decode_rates_are_fractions_on_real_counters(history: list[Snapshot]) -> None:
    for before, after in itertools.pairwise(history):
        metrics = spec_decode_metrics(step_deltas(before, after)).unwrap()
        if metrics is None:
            continue
        assert 0.0 <= metrics.acceptance_rate <= 1.0
        assert all(0.0 <= r <= 1.0 for r in metrics.per_position_acceptance_rates)
        assert (
            1.0
            <= metrics.mean_acceptance_length
            <= 1.0 + len(metrics.per_position_acceptance_rates)
        )


@given(spec_decode_histories())
def test_spec_decode_over_engines_is_the_sum_of_their_counters(history: list[Snapshot]) -> None:
    """Merging engines' series (or not) gives the same acceptance: drafts are summed."""
    before, after = history[0], history[-1]
    per_engine = spec_decode_metrics(step_deltas(before, after)).unwrap()
    one_engine = [
        merge_snapshots([Snapshot([attrs.evolve(s, labels={})]) for s in snap.samples])
        for snap in (before, after)
    ]
    assert spec_decode_metrics(step_deltas(*one_engine)).unwrap() == per_engine


# --- NeMo-RL's view: metric names alone ------------------------------------------------------


def _nemo_rl_aggregate(reports: list[dict[str, float | list[float]]]) -> dict[object, float]:
    """An independent re-implementation of NeMo-RL's ``aggregate_spec_decode_counters``."""
    out: dict[object, float] = {}
    for report in reports:
        for name, value in report.items():
            if "spec_decode" not in name:
                continue
            if isinstance(value, list):
                for position, v in enumerate(value, 1):
                    out[(name, position)] = out.get((name, position), 0.0) + v
            else:
                out[name] = out.get(name, 0.0) + value
    return out


def _nemo_rl_metrics(start: dict[object, float], end: dict[object, float]) -> dict[str, float]:
    """An independent re-implementation of NeMo-RL's ``compute_spec_decode_metrics``."""
    delta = {k: end.get(k, 0.0) - start.get(k, 0.0) for k in set(start) | set(end)}
    drafts = delta.get(SPEC_DECODE_NUM_DRAFTS, 0.0)
    draft_tokens = delta.get(SPEC_DECODE_NUM_DRAFT_TOKENS, 0.0)
    accepted = delta.get(SPEC_DECODE_NUM_ACCEPTED_TOKENS, 0.0)
    out = {
        "vllm/spec_num_drafts": drafts,
        "vllm/spec_num_draft_tokens": draft_tokens,
        "vllm/spec_num_accepted_tokens": accepted,
        "vllm/spec_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else 1.0,
        "vllm/spec_acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else 0.0,
    }
    for key, value in delta.items():
        if isinstance(key, tuple):
            name, position = key
            out[f"vllm/{name}-{position}"] = value
            if drafts > 0:
                out[f"vllm/spec_acceptance_rate-pos-{position}"] = value / drafts
    return out


@st.composite
def _spec_steps(draw: st.DrawFn) -> tuple[list[Snapshot], list[Snapshot]]:
    """Per-worker snapshots before and after a step (one or two engines each)."""
    k = draw(st.integers(1, 3))
    befores, afters = [], []
    for _ in range(draw(st.integers(1, 3))):
        engines = draw(st.sampled_from([[ENGINE0], [ENGINE0, ENGINE1]]))
        before: list[Sample] = []
        after: list[Sample] = []
        for labels in engines:
            drafts = draw(st.integers(0, 50))
            extra = draw(st.integers(1, 50))
            accepted = [draw(st.integers(0, drafts)) for _ in range(k)]
            more = [a + draw(st.integers(0, extra)) for a in accepted]
            before += _spec(labels, drafts, accepted, k=k)
            after += _spec(labels, drafts + extra, more, k=k)
            before.append(CounterSample(PROMPT_TOKENS, labels, 3.0))
            after.append(CounterSample(PROMPT_TOKENS, labels, 9.0))
        befores.append(Snapshot(before))
        afters.append(Snapshot(after))
    return befores, afters


@given(_spec_steps())
def test_values_by_name_feed_nemo_rls_own_spec_decode_metrics_to_our_numbers(
    step: tuple[list[Snapshot], list[Snapshot]],
) -> None:
    """What ``_get_raw_spec_counters`` returns, through NeMo-RL's aggregation and step
    metrics, gives exactly ``spec_decode_metrics(...).as_dict()``: same names, positions from 1."""
    befores, afters = step
    start = _nemo_rl_aggregate([values_by_name(s) for s in befores])
    end = _nemo_rl_aggregate([values_by_name(s) for s in afters])
    theirs = _nemo_rl_metrics(start, end)
    ours = spec_decode_metrics(step_deltas(merge_snapshots(befores), merge_snapshots(afters)))
    metrics = ours.unwrap()
    assert metrics is not None
    assert metrics.as_dict() == pytest.approx(theirs)


def test_values_by_name_sum_series_and_leave_histograms_out() -> None:
    snap = Snapshot(
        [
            CounterSample(PROMPT_TOKENS, ENGINE0, 3.0),
            CounterSample(PROMPT_TOKENS, ENGINE1, 4.0),
            GaugeSample("vllm:num_requests_running", ENGINE0, 2.0),
            VectorSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, ENGINE0, [1.0, 2.0]),
            VectorSample(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, ENGINE1, [3.0]),
            HistogramSample("vllm:e2e_request_latency_seconds", ENGINE0, 1.0, 0.5, [("+Inf", 1.0)]),
        ]
    )
    assert values_by_name(snap) == {
        PROMPT_TOKENS: 7.0,
        "vllm:num_requests_running": 2.0,
        SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS: [4.0, 2.0],
    }


@given(st.lists(metric_snapshots(), max_size=4))
def test_group_counters_decode_every_shard_and_sum_them(shards: list[Snapshot]) -> None:
    try:
        merged = merge_snapshots(shards)
    except ValueError:  # one series of two kinds: a programming error, raised as it was
        assume(False)
    spec = spec_decode_metrics(merged)
    assume(isinstance(spec, Success))
    counters = group_counters([encode_snapshot(s) for s in shards]).unwrap()
    assert counters == GroupCounters(shards=tuple(shards), merged=merged, spec_decode=spec.unwrap())
    assert counters.as_dict() == encode_snapshot(merged)


def test_group_counters_name_the_shard_or_the_spec_decode_counters_that_fail() -> None:
    good = encode_snapshot([CounterSample(PROMPT_TOKENS, ENGINE0, 1)])
    not_dict = group_counters([good, ["x"]])
    assert not_dict == Failure(CounterError("shard 1: get_counters returned list, not a dict"))
    bad_key = group_counters([good, {"no key": 1.0}]).swap().unwrap()
    assert bad_key.message.startswith("shard 1 counters: metric key 'no key' ")
    assert bad_key.key == "no key"
    drafts = [
        CounterSample(SPEC_DECODE_NUM_DRAFTS, {}, 4),
        CounterSample(SPEC_DECODE_NUM_DRAFT_TOKENS, {}, 3),
    ]
    spec = group_counters([encode_snapshot(drafts)]).swap().unwrap()
    assert spec.message.startswith("spec-decode counters: ")
    assert spec.key == SPEC_DECODE_NUM_DRAFT_TOKENS


def test_worker_counters_are_one_series_per_cache_and_per_kind() -> None:
    samples = worker_counters({"prefix": 2, "mm": 0}, {"nan": 1, "+inf": 0})
    assert [(s.name, dict(s.labels), s.value) for s in samples] == [
        (CACHE_RESETS, {"cache": "prefix"}, 2),
        (CACHE_RESETS, {"cache": "mm"}, 0),
        (NONFINITE_LOGPROBS, {"kind": "nan"}, 1),
        (NONFINITE_LOGPROBS, {"kind": "+inf"}, 0),
    ]


def test_a_logger_sample_keeps_the_logged_counters_and_gauges_under_their_lists() -> None:
    metrics: list[Sample] = [
        GaugeSample("vllm:num_requests_running", {}, 3.0),
        CounterSample("vllm:generation_tokens", {}, 40.0),
        GaugeSample("vllm:other", {}, 1.0),
        HistogramSample("vllm:kv_cache_usage_perc", {}, 1, 1.0, {"+Inf": 1}),
    ]
    assert logger_sample(metrics) == {"inflight_batch_sizes": 3.0, "generation_tokens": 40.0}
    assert set(LOGGER_METRICS.values()) == {
        "inflight_batch_sizes",
        "num_pending_samples",
        "kv_cache_usage_perc",
        "generation_tokens",
    }
