"""Hypothesis strategies for genworker's laws, one section per core module.

Each section is owned by the module it generates values for; add new strategies to the
section of that module.
"""

from __future__ import annotations

from hypothesis import strategies as st

__all__ = ["st"]


# --- placement ---
from typing import NamedTuple as _NamedTuple


class Topology(_NamedTuple):
    """A cluster and a data-parallel generation group that fits on it."""

    num_nodes: int
    gpus_per_node: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int


@st.composite
def topologies(draw: st.DrawFn, *, max_nodes: int = 4, max_gpus_per_node: int = 8) -> Topology:
    """Any valid topology: engines that fit on a node, and engines spanning nodes."""
    gpus_per_node = draw(st.integers(1, max_gpus_per_node))
    num_nodes = draw(st.integers(1, max_nodes))
    total = gpus_per_node * num_nodes
    tp = draw(st.integers(1, total))
    pp = draw(st.integers(1, total // tp))
    size = tp * pp
    capacity = total // size if size > gpus_per_node else num_nodes * (gpus_per_node // size)
    dp = draw(st.integers(1, capacity))
    return Topology(num_nodes, gpus_per_node, tp, pp, dp)


def placement_num_gpus() -> st.SearchStrategy[object]:
    """Anything a caller might pass as num_gpus, valid or not."""
    return st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-4, 8),
        st.booleans(),
        st.text(max_size=3),
        st.none(),
    )


def placement_bundle_indices() -> st.SearchStrategy[object]:
    """Anything a caller might pass as bundle_indices, valid or not."""
    ids = st.lists(st.integers(-2, 20), max_size=6)
    return st.one_of(
        st.none(),
        st.tuples(st.integers(-2, 5), ids),
        st.tuples(st.integers(-2, 5), ids.map(tuple)),
        st.lists(st.integers(0, 3), max_size=3),
        st.tuples(st.text(max_size=2), ids),
        st.tuples(st.integers(0, 3), st.text(max_size=3)),
        st.tuples(st.integers(0, 3), st.lists(st.one_of(st.integers(0, 3), st.floats()))),
    )


# --- sharding ---
from genworker.core.sharding import ShardPlan as _ShardPlan


def shard_lengths(max_rows: int = 40) -> st.SearchStrategy[list[int]]:
    """Unpadded input lengths of a batch (0 rows allowed; zero-length rows allowed)."""
    return st.lists(st.integers(0, 4096), max_size=max_rows)


def shard_counts() -> st.SearchStrategy[int]:
    return st.integers(1, 8)


@st.composite
def shard_plans(draw: st.DrawFn, *, max_rows: int = 24, max_shards: int = 6) -> _ShardPlan:
    """Any partition of the rows into shards (not only the balanced one)."""
    num_rows = draw(st.integers(0, max_rows))
    num_shards = draw(st.integers(1, max_shards))
    owner = draw(st.lists(st.integers(0, num_shards - 1), min_size=num_rows, max_size=num_rows))
    shards = tuple(
        tuple(row for row in range(num_rows) if owner[row] == shard) for shard in range(num_shards)
    )
    return _ShardPlan(num_rows=num_rows, shards=shards, costs=tuple(len(s) for s in shards))


@st.composite
def generated_rows(
    draw: st.DrawFn, *, max_rows: int = 24, max_len: int = 12
) -> list[tuple[list[int], list[float]]]:
    """Per-row (token ids, logprobs) of equal length, as one engine would produce them."""
    rows = []
    for _ in range(draw(st.integers(0, max_rows))):
        length = draw(st.integers(0, max_len))
        tokens = draw(st.lists(st.integers(0, 999), min_size=length, max_size=length))
        logprobs = draw(
            st.lists(st.floats(-30.0, -1e-3, allow_nan=False), min_size=length, max_size=length)
        )
        rows.append((tokens, logprobs))
    return rows


# --- caps ---
import attrs as _caps_attrs

from genworker.core.caps import MAX_SCALAR_ARGUMENT as _CAPS_MAX_SCALAR


@_caps_attrs.frozen
class CapCase:
    """Valid arguments for one ``request_max_tokens`` call."""

    max_new_tokens: int
    input_length: int
    max_model_len: int
    cap_to_context: bool
    num_speculative_tokens: int


@_caps_attrs.frozen
class BatchCapCase:
    """Valid arguments for one ``batch_max_tokens`` call (lengths as a list)."""

    max_new_tokens: int
    input_lengths: list[int]
    max_model_len: int
    cap_to_context: bool
    num_speculative_tokens: int


cap_max_model_lens = st.one_of(st.integers(1, 64), st.integers(1, 1 << 17))
cap_max_new_tokens = st.one_of(st.integers(1, 64), st.integers(1, 1 << 17))
cap_spec_tokens = st.one_of(st.just(0), st.integers(1, 8), st.integers(0, 64))
cap_large_scalars = st.integers(1, _CAPS_MAX_SCALAR)


def cap_input_lengths(max_model_len: int) -> st.SearchStrategy[int]:
    """Input lengths, biased to the context boundary (where the caps bite)."""
    near = st.integers(max(0, max_model_len - 80), max_model_len + 8)
    return st.one_of(near, st.integers(0, max_model_len + 8), st.integers(0, 1 << 18))


@st.composite
def cap_cases(draw: st.DrawFn) -> CapCase:
    """Any valid request: every combination of context capping and speculative decoding."""
    max_model_len = draw(cap_max_model_lens)
    return CapCase(
        max_new_tokens=draw(cap_max_new_tokens),
        input_length=draw(cap_input_lengths(max_model_len)),
        max_model_len=max_model_len,
        cap_to_context=draw(st.booleans()),
        num_speculative_tokens=draw(cap_spec_tokens),
    )


@st.composite
def batch_cap_cases(draw: st.DrawFn, *, max_size: int = 12) -> BatchCapCase:
    """Any valid batch (possibly empty) with non-negative input lengths."""
    max_model_len = draw(cap_max_model_lens)
    return BatchCapCase(
        max_new_tokens=draw(cap_max_new_tokens),
        input_lengths=draw(st.lists(cap_input_lengths(max_model_len), max_size=max_size)),
        max_model_len=max_model_len,
        cap_to_context=draw(st.booleans()),
        num_speculative_tokens=draw(cap_spec_tokens),
    )


# --- stops ---
from collections.abc import Sequence as _StopsSequence

import attrs as _stops_attrs


@_stops_attrs.frozen
class StopBatch:
    """Valid arguments for ``merge_stop_strings`` (mode apart)."""

    config_stops: tuple[str, ...]
    per_sample: list[_StopsSequence[str] | None] | None
    batch_size: int


# A small alphabet so strings repeat within and across rows (duplicates are the point).
stop_texts = st.text(alphabet="ab</>\n", min_size=1, max_size=3)
stop_lists = st.lists(stop_texts, max_size=5)
stop_entries: st.SearchStrategy[_StopsSequence[str] | None] = st.one_of(
    st.none(), stop_lists, stop_lists.map(tuple)
)


@st.composite
def stop_batches(draw: st.DrawFn, *, max_rows: int = 6) -> StopBatch:
    """Config strings plus, maybe, one per-sample entry for each row."""
    batch_size = draw(st.integers(0, max_rows))
    per_sample = draw(
        st.one_of(st.none(), st.lists(stop_entries, min_size=batch_size, max_size=batch_size))
    )
    return StopBatch(tuple(draw(stop_lists)), per_sample, batch_size)


# --- sampling ---
from collections.abc import Sequence as _SamplingSequence

import attrs as _sampling_attrs

from genworker.core.sampling import SamplingSpec as _SamplingSpec


@_sampling_attrs.frozen
class SamplingDefaultsValue:
    """A stand-in for the worker config's sampling settings (``SamplingDefaults``)."""

    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...]
    bad_words: tuple[str, ...] | None
    ignore_eos: bool


sampling_temperatures = st.one_of(
    st.sampled_from([0.0, 0.6, 1.0]), st.floats(0.0, 2.0, allow_nan=False)
)
sampling_top_ps = st.one_of(st.sampled_from([1.0, 0.9]), st.floats(0.0, 1.0, exclude_min=True))
sampling_top_ks = st.one_of(st.sampled_from([-1, 0, 1, 50]), st.integers(-1, 1000))
sampling_token_ids = st.lists(st.integers(0, 200_000), max_size=4).map(tuple)
sampling_words = st.lists(st.text(alphabet="xyz ", min_size=1, max_size=4), max_size=3)
sampling_bad_words = st.one_of(st.none(), sampling_words.map(tuple))
sampling_stops: st.SearchStrategy[_SamplingSequence[str]] = st.one_of(
    st.lists(st.text(alphabet="ab</>", min_size=1, max_size=3), max_size=3),
    st.lists(st.text(alphabet="ab</>", min_size=1, max_size=3), max_size=3).map(tuple),
)

sampling_defaults = st.builds(
    SamplingDefaultsValue,
    temperature=sampling_temperatures,
    top_p=sampling_top_ps,
    top_k=sampling_top_ks,
    stop_token_ids=sampling_token_ids,
    bad_words=sampling_bad_words,
    ignore_eos=st.booleans(),
)

sampling_specs = st.builds(
    _SamplingSpec,
    temperature=sampling_temperatures,
    top_p=sampling_top_ps,
    top_k=sampling_top_ks,
    max_tokens=st.integers(1, 1 << 16),
    logprobs=st.integers(0, 20),
    stop=sampling_stops,
    stop_token_ids=sampling_token_ids,
    include_stop_str_in_output=st.booleans(),
    bad_words=sampling_bad_words,
    ignore_eos=st.booleans(),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    flat_logprobs=st.booleans(),
)


@st.composite
def sampling_spec_batches(draw: st.DrawFn, *, max_rows: int = 16) -> list[_SamplingSpec]:
    """Per-row specs drawn from a small pool, so rows repeat specs (as real batches do)."""
    pool = draw(st.lists(sampling_specs, min_size=1, max_size=4))
    return draw(st.lists(st.sampled_from(pool), max_size=max_rows))


# --- batch ---
from typing import NamedTuple as _BatchNamedTuple

import torch as _batch_torch


class PaddedBatch(_BatchNamedTuple):
    """A right-padded batch and the prompts it was built from."""

    input_ids: _batch_torch.Tensor
    input_lengths: _batch_torch.Tensor
    pad_token_id: int
    vocab_size: int
    prompts: list[list[int]]


_BATCH_DTYPES = (_batch_torch.int64, _batch_torch.int32)


@st.composite
def right_padded_batches(
    draw: st.DrawFn, *, max_batch: int = 8, max_width: int = 16, vocab_size: int = 64
) -> PaddedBatch:
    """Valid batches: lengths in [1, width], right padding; the pad id may occur in prompts."""
    batch = draw(st.integers(0, max_batch))
    width = draw(st.integers(0 if batch == 0 else 1, max_width))
    pad = draw(st.integers(0, vocab_size - 1))
    tokens = st.integers(0, vocab_size - 1) | st.just(pad)
    prompts = [draw(st.lists(tokens, min_size=1, max_size=width)) for _ in range(batch)]
    rows = [p + [pad] * (width - len(p)) for p in prompts]
    dtype = draw(st.sampled_from(_BATCH_DTYPES))
    return PaddedBatch(
        input_ids=_batch_torch.tensor(rows, dtype=dtype).reshape(batch, width),
        input_lengths=_batch_torch.tensor([len(p) for p in prompts], dtype=_batch_torch.int64),
        pad_token_id=pad,
        vocab_size=vocab_size,
        prompts=prompts,
    )


class WildBatch(_BatchNamedTuple):
    """A batch that may break any data rule, with the limits it is checked against."""

    ids: list[list[int]]
    lengths: list[int]
    width: int
    pad_token_id: int
    vocab_size: int | None
    max_model_len: int | None


@st.composite
def wild_batches(
    draw: st.DrawFn, *, max_batch: int = 6, max_width: int = 10, vocab_size: int = 32
) -> WildBatch:
    """Right-padded batches with random damage: bad lengths, stray tokens, tight limits."""
    valid = draw(
        right_padded_batches(max_batch=max_batch, max_width=max_width, vocab_size=vocab_size)
    )
    batch, width = valid.input_ids.shape
    ids: list[list[int]] = valid.input_ids.tolist()
    lengths: list[int] = valid.input_lengths.tolist()
    if batch > 0:
        for _ in range(draw(st.integers(0, 2))):
            lengths[draw(st.integers(0, batch - 1))] = draw(st.integers(-2, width + 2))
        strays = st.sampled_from([-3, -1, vocab_size, vocab_size + 3]) | st.integers(0, vocab_size)
        for _ in range(draw(st.integers(0, 3))):
            row, col = draw(st.integers(0, batch - 1)), draw(st.integers(0, width - 1))
            ids[row][col] = draw(strays)
    return WildBatch(
        ids=ids,
        lengths=lengths,
        width=width,
        pad_token_id=valid.pad_token_id,
        vocab_size=draw(st.none() | st.just(vocab_size)),
        max_model_len=draw(st.none() | st.integers(1, width + 2)),
    )


# --- assembly ---
import numpy as _asm_np

from genworker.core.assembly import FINISH_REASONS as _ASM_FINISH_REASONS
from genworker.core.assembly import Generation as _AsmGeneration


@st.composite
def generations(
    draw: st.DrawFn,
    *,
    max_tokens: int = 12,
    vocab_size: int = 64,
    as_numpy: bool | None = None,
    with_logprobs: bool | None = None,
) -> _AsmGeneration:
    """One row's generation; tokens and logprobs as lists or numpy arrays of several dtypes."""
    tokens = draw(st.lists(st.integers(0, vocab_size - 1), max_size=max_tokens))
    logprobs = [draw(st.floats(-30.0, 0.0, allow_nan=False, allow_infinity=False)) for _ in tokens]
    numpy = draw(st.booleans()) if as_numpy is None else as_numpy
    keep = draw(st.booleans()) if with_logprobs is None else with_logprobs
    reason = draw(st.sampled_from(sorted(_ASM_FINISH_REASONS)))
    if numpy:
        token_dtype = draw(st.sampled_from([_asm_np.int64, _asm_np.int32]))
        float_dtype = draw(st.sampled_from([_asm_np.float64, _asm_np.float32]))
        return _AsmGeneration(
            _asm_np.asarray(tokens, dtype=token_dtype),
            _asm_np.asarray(logprobs, dtype=float_dtype) if keep else None,
            reason,
        )
    return _AsmGeneration(tokens, logprobs if keep else None, reason)


class AssemblyCase(_BatchNamedTuple):
    """A valid batch and one generation per row."""

    batch: PaddedBatch
    generations: list[_AsmGeneration]


@st.composite
def assembly_cases(
    draw: st.DrawFn, *, max_batch: int = 8, max_width: int = 16, max_tokens: int = 12
) -> AssemblyCase:
    batch = draw(right_padded_batches(max_batch=max_batch, max_width=max_width))
    rows = batch.input_ids.shape[0]
    gens = [
        draw(generations(max_tokens=max_tokens, vocab_size=batch.vocab_size)) for _ in range(rows)
    ]
    return AssemblyCase(batch=batch, generations=gens)


# --- counters ---
import attrs as _counters_attrs

from genworker.core import counters as _counters

COUNTER_METRIC_NAMES = (
    _counters.PROMPT_TOKENS,
    _counters.GENERATION_TOKENS,
    _counters.SPEC_DECODE_NUM_DRAFTS,
    _counters.SPEC_DECODE_NUM_DRAFT_TOKENS,
    _counters.SPEC_DECODE_NUM_ACCEPTED_TOKENS,
    _counters.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
    "vllm:kv_cache_usage_perc",
    "vllm:e2e_request_latency_seconds",
)
HISTOGRAM_BOUNDS = ("0.001", "0.5", "1.0", "2.5", "10", "100.0", "+Inf", "-1.5", "1e3")


def metric_names() -> st.SearchStrategy[str]:
    """vLLM's own names, and any other Prometheus metric name (':' included)."""
    first = st.sampled_from("abcxyzAZ_:")
    rest = st.text(alphabet="abcxyzAZ09_:", max_size=10)
    return st.one_of(
        st.sampled_from(COUNTER_METRIC_NAMES),
        st.tuples(first, rest).map("".join),
    )


def metric_label_values() -> st.SearchStrategy[str]:
    """Label values, heavy on the characters the key grammar uses or escapes."""
    awkward = st.sampled_from([*'"\\\n|,{}=: _ab0', "\\n", '\\"', "é"])
    return st.one_of(
        st.lists(awkward, max_size=6).map("".join),
        st.text(max_size=6),
    )


def metric_labels() -> st.SearchStrategy[dict[str, str]]:
    names = st.one_of(
        st.sampled_from(["engine", "model_name", "position", "le", "reason"]),
        st.tuples(st.sampled_from("abzAZ_"), st.text(alphabet="abzAZ09_", max_size=6)).map("".join),
    )
    return st.dictionaries(names, metric_label_values(), max_size=3)


def metric_counts() -> st.SearchStrategy[float]:
    """Integral counts (as vLLM reports them), so sums and differences are exact."""
    return st.integers(0, 10**9).map(float)


def metric_sums() -> st.SearchStrategy[float]:
    """Histogram sums: quarters, exact under addition and subtraction."""
    return st.integers(0, 4 * 10**9).map(lambda q: q / 4)


@st.composite
def histogram_buckets(draw: st.DrawFn) -> list[tuple[str, float]]:
    bounds = draw(st.lists(st.sampled_from(HISTOGRAM_BOUNDS), unique=True, max_size=5))
    return [(b, draw(metric_counts())) for b in bounds]


def counter_samples() -> st.SearchStrategy[_counters.CounterSample]:
    return st.builds(_counters.CounterSample, metric_names(), metric_labels(), metric_counts())


def gauge_samples() -> st.SearchStrategy[_counters.GaugeSample]:
    values = st.floats(
        -1e12, 1e12, allow_nan=False
    )  # gauges: finite, and sums of a few stay finite
    return st.builds(_counters.GaugeSample, metric_names(), metric_labels(), values)


def histogram_samples() -> st.SearchStrategy[_counters.HistogramSample]:
    return st.builds(
        _counters.HistogramSample,
        metric_names(),
        metric_labels(),
        metric_counts(),
        metric_sums(),
        histogram_buckets(),
    )


def vector_samples() -> st.SearchStrategy[_counters.VectorSample]:
    values = st.lists(metric_counts(), max_size=4)
    return st.builds(_counters.VectorSample, metric_names(), metric_labels(), values)


def metric_samples() -> st.SearchStrategy[_counters.Sample]:
    return st.one_of(counter_samples(), gauge_samples(), histogram_samples(), vector_samples())


def metric_snapshots(max_size: int = 6) -> st.SearchStrategy[_counters.Snapshot]:
    """Snapshots of every kind of series, several series per name allowed (M2)."""
    return st.lists(
        metric_samples(), max_size=max_size, unique_by=lambda s: (s.name, s.labels)
    ).map(_counters.Snapshot)


@st.composite
def grown_sample(draw: st.DrawFn, sample: _counters.Sample) -> _counters.Sample:
    """The same series later in the same engine's life: nothing goes down (gauges move)."""
    inc = metric_counts()
    first = draw(inc)
    if isinstance(sample, _counters.CounterSample):
        return _counters_attrs.evolve(sample, value=sample.value + first)
    if isinstance(sample, _counters.GaugeSample):
        return _counters_attrs.evolve(sample, value=draw(st.floats(-1e6, 1e6)))
    if isinstance(sample, _counters.VectorSample):
        return _counters_attrs.evolve(sample, values=[v + draw(inc) for v in sample.values])
    return _counters_attrs.evolve(
        sample,
        count=sample.count + draw(inc),
        sum=sample.sum + draw(metric_sums()),
        buckets=[(b, c + draw(inc)) for b, c in sample.buckets],
    )


@st.composite
def snapshot_histories(
    draw: st.DrawFn, *, length: int = 3, max_size: int = 5
) -> list[_counters.Snapshot]:
    """Snapshots of one engine over time, no restart: each grows from the one before."""
    history = [draw(metric_snapshots(max_size))]
    for _ in range(length - 1):
        history.append(_counters.Snapshot([draw(grown_sample(s)) for s in history[-1].samples]))
    return history


@st.composite
def spec_decode_increments(draw: st.DrawFn, *, engines: int, k: int) -> _counters.Snapshot:
    """One step of real speculative decoding on each engine: k draft tokens per draft,
    accepted tokens per position never more than the drafts, fewer at later positions."""
    samples: list[_counters.Sample] = []
    for e in range(engines):
        labels = {"engine": str(e), "model_name": "m"}
        drafts = draw(st.integers(0, 1000))
        per_pos: list[int] = []
        cap = drafts
        for _ in range(k):
            cap = draw(st.integers(0, cap))
            per_pos.append(cap)
        samples += [
            _counters.CounterSample(_counters.SPEC_DECODE_NUM_DRAFTS, labels, drafts),
            _counters.CounterSample(_counters.SPEC_DECODE_NUM_DRAFT_TOKENS, labels, drafts * k),
            _counters.CounterSample(
                _counters.SPEC_DECODE_NUM_ACCEPTED_TOKENS, labels, sum(per_pos)
            ),
            _counters.VectorSample(
                _counters.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, labels, per_pos
            ),
        ]
    return _counters.Snapshot(samples)


@st.composite
def spec_decode_histories(draw: st.DrawFn) -> list[_counters.Snapshot]:
    """Cumulative spec-decode counters of 1-3 engines at 2-4 points in time."""
    engines = draw(st.integers(1, 3))
    k = draw(st.integers(1, 4))
    n = draw(st.integers(2, 4))
    steps = [draw(spec_decode_increments(engines=engines, k=k)) for _ in range(n)]
    history = [steps[0]]
    for step in steps[1:]:
        history.append(_counters.merge_snapshots([history[-1], step]))
    return history


# --- lifecycle ---
from genworker.core import lifecycle as _lifecycle

# SHUTDOWN is absorbing; drawn rarely so that sequences explore the rest of the table.
_LIFECYCLE_EVENT_POOL: list[_lifecycle.Event] = [
    *[e for e in _lifecycle.Event if e is not _lifecycle.Event.SHUTDOWN] * 6,
    _lifecycle.Event.SHUTDOWN,
]


def lifecycle_states() -> st.SearchStrategy[_lifecycle.State]:
    return st.sampled_from(_lifecycle.ALL_STATES)


def lifecycle_events() -> st.SearchStrategy[_lifecycle.Event]:
    return st.sampled_from(_LIFECYCLE_EVENT_POOL)


def lifecycle_event_sequences(max_size: int = 40) -> st.SearchStrategy[list[_lifecycle.Event]]:
    """Event sequences, most of them starting with LOAD."""
    events = st.lists(lifecycle_events(), max_size=max_size)
    return st.tuples(st.integers(0, 4), events).map(
        lambda p: ([_lifecycle.Event.LOAD] if p[0] else []) + p[1]
    )


# --- config ---
from collections.abc import Callable as _CfgCallable
from typing import NamedTuple as _CfgNamedTuple

from genworker.core.config import WorkerConfig as _CfgWorkerConfig

_CFG_MODELS = st.sampled_from(["Qwen/Qwen3-0.6B", "facebook/opt-125m", "/models/tiny-llama"])
_CFG_NAMES = st.text("abcdefgh_", min_size=1, max_size=8)
# JSON-like values for keys the config keeps but does not interpret (no NaN: it is not
# equal to itself, which would break the round-trip law for reasons that are not ours).
cfg_json_values: st.SearchStrategy[object] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-1000, 1000)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=6),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_CFG_NAMES, kids, max_size=3),
    max_leaves=6,
)


def _cfg_maybe(
    draw: st.DrawFn, d: dict[str, object], key: str, values: st.SearchStrategy[object]
) -> None:
    if draw(st.booleans()):
        d[key] = draw(values)


@st.composite
def nemo_config_dicts(
    draw: st.DrawFn,
    *,
    max_model_len: st.SearchStrategy[int] | None = None,
    num_speculative_tokens: st.SearchStrategy[int] | None = None,
    precision: st.SearchStrategy[str] | None = None,
) -> dict[str, object]:
    """Valid NeMo-RL ``policy.generation`` dicts, as NeMo-RL writes them: optional keys present
    or absent, ``None`` where NeMo-RL allows it, unknown extras at the top level and in
    ``vllm_cfg``, ``speculative_config``/``logprobs_mode`` in either of their places.

    Every dict parses (``WorkerConfig.from_mapping`` succeeds) and plans
    (``plan_engine_kwargs`` succeeds given a Blackwell capability when
    ``vllm_cfg.nvfp4_per_token`` is set): no reserved ``vllm_kwargs`` keys, no quantization
    override, telemetry enabled only with an endpoint.
    """
    mml = draw(max_model_len if max_model_len is not None else st.integers(1, 8192))
    tp = draw(st.sampled_from([1, 1, 2, 4]))
    pp = draw(st.sampled_from([1, 1, 2]))
    vllm_cfg: dict[str, object] = {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "expert_parallel_size": draw(st.sampled_from([1, tp])),
        "gpu_memory_utilization": draw(st.sampled_from([0.5, 1.0]) | st.floats(0.01, 1.0)),
        "max_model_len": mml,
    }
    if precision is not None:
        vllm_cfg["precision"] = draw(precision)
    else:
        _cfg_maybe(
            draw,
            vllm_cfg,
            "precision",
            st.sampled_from(["auto", "bfloat16", "float16", "float32", "fp8"]),
        )
    for key in (
        "enforce_eager",
        "skip_tokenizer_init",
        "async_engine",
        "cap_max_tokens_to_context",
    ):
        _cfg_maybe(draw, vllm_cfg, key, st.booleans())
    _cfg_maybe(draw, vllm_cfg, "enable_prefix_caching", st.none() | st.booleans())
    _cfg_maybe(draw, vllm_cfg, "load_format", st.sampled_from(["auto", "dummy", "safetensors"]))
    _cfg_maybe(draw, vllm_cfg, "kv_cache_dtype", st.sampled_from(["auto", "fp8", "fp8_e4m3"]))
    _cfg_maybe(draw, vllm_cfg, "sleep_level", st.sampled_from([1, 2]))
    if vllm_cfg.get("precision", "bfloat16") in ("bfloat16", "float16"):
        _cfg_maybe(draw, vllm_cfg, "nvfp4_per_token", st.booleans())
    _cfg_maybe(draw, vllm_cfg, "use_deep_gemm", st.booleans())
    _cfg_maybe(draw, vllm_cfg, "num_first_layers_in_bf16", st.integers(0, 2))
    for name in draw(st.lists(_CFG_NAMES, max_size=2, unique=True)):
        vllm_cfg["x_" + name] = draw(cfg_json_values)

    d: dict[str, object] = {
        "model_name": draw(_CFG_MODELS),
        "max_new_tokens": draw(st.integers(1, 4096)),
        "temperature": draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0, 2.0)),
        "top_p": draw(st.sampled_from([1.0]) | st.floats(0.0, 1.0, exclude_min=True)),
        "top_k": draw(st.sampled_from([None, -1, 1, 50]) | st.integers(1, 1000)),
        "stop_token_ids": draw(st.none() | st.lists(st.integers(0, 200_000), max_size=3)),
        "stop_strings": draw(st.none() | st.lists(st.text(min_size=1, max_size=6), max_size=3)),
        "_pad_token_id": draw(st.integers(0, 200_000)),
        "vllm_cfg": vllm_cfg,
    }
    _cfg_maybe(draw, d, "backend", st.just("vllm"))
    _cfg_maybe(
        draw, d, "bad_words", st.none() | st.lists(st.text(min_size=1, max_size=6), max_size=2)
    )
    _cfg_maybe(draw, d, "ignore_eos", st.booleans())
    _cfg_maybe(draw, d, "seed", st.none() | st.integers(0, 2**31))
    _cfg_maybe(
        draw,
        d,
        "colocated",
        st.fixed_dictionaries(
            {"enabled": st.booleans()},
            optional={
                "resources": st.fixed_dictionaries(
                    {"gpus_per_node": st.none(), "num_nodes": st.none()}
                )
            },
        ),
    )
    _cfg_maybe(draw, d, "val_temperature", st.floats(0.0, 2.0))
    _cfg_maybe(draw, d, "port_range_low", st.integers(1024, 60000))

    kwargs: dict[str, object] = {}
    _cfg_maybe(draw, kwargs, "max_num_seqs", st.integers(1, 512))
    _cfg_maybe(draw, kwargs, "tokenizer_mode", st.sampled_from(["auto", "slow"]))
    _cfg_maybe(draw, kwargs, "trust_remote_code", st.booleans())
    _cfg_maybe(
        draw, kwargs, "compilation_config", st.fixed_dictionaries({"level": st.integers(0, 3)})
    )
    _cfg_maybe(
        draw,
        kwargs,
        "hf_overrides",
        st.fixed_dictionaries(
            {},
            optional={
                "max_position_embeddings": st.integers(1, 1 << 16),
                "quantization_config": st.fixed_dictionaries(
                    {},
                    optional={
                        "ignored_layers": st.lists(
                            st.sampled_from(["lm_head", "model.embed_tokens", "mlp.gate"]),
                            max_size=2,
                        ),
                        "modules_to_not_convert": st.lists(
                            st.sampled_from(["lm_head", "visual"]), max_size=2
                        ),
                        "weight_block_size": st.just([64, 64]),
                    },
                ),
            },
        ),
    )

    k = draw(num_speculative_tokens if num_speculative_tokens is not None else st.integers(0, 4))
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
    place = draw(st.sampled_from(["none", "none_explicit", "vllm_cfg", "vllm_kwargs"]))
    if num_speculative_tokens is not None and place.startswith("none"):
        place = "vllm_cfg"
    if place == "none_explicit":
        vllm_cfg["speculative_config"] = None
    elif place == "vllm_cfg":
        vllm_cfg["speculative_config"] = spec
    elif place == "vllm_kwargs":
        kwargs["speculative_config"] = spec

    mode = st.sampled_from(["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"])
    where = draw(st.sampled_from(["none", "top", "vllm_cfg"]))
    if where == "top":
        d["logprobs_mode"] = draw(mode)
    elif where == "vllm_cfg":
        vllm_cfg["logprobs_mode"] = draw(mode)

    keep_empty_kwargs = draw(st.booleans())
    if kwargs or keep_empty_kwargs:
        d["vllm_kwargs"] = kwargs
    protocols = st.none() | st.sampled_from(["grpc", "http/protobuf"])
    _cfg_maybe(
        draw,
        d,
        "telemetry",
        st.none()
        | st.fixed_dictionaries({"enabled": st.just(False)})
        | st.fixed_dictionaries(
            {"enabled": st.just(True), "otlp_endpoint": st.just("http://collector:4317")},
            optional={
                "otlp_protocol": protocols,
                "otlp_traces_protocol": protocols,
                "collect_detailed_traces": st.lists(
                    st.sampled_from(["model", "worker", "all"]), max_size=2
                ),
            },
        ),
    )
    return d


def worker_configs(
    *,
    max_model_len: st.SearchStrategy[int] | None = None,
    num_speculative_tokens: st.SearchStrategy[int] | None = None,
    precision: st.SearchStrategy[str] | None = None,
) -> st.SearchStrategy[_CfgWorkerConfig]:
    """Valid :class:`WorkerConfig` values (parsed from :func:`nemo_config_dicts`)."""
    dicts = nemo_config_dicts(
        max_model_len=max_model_len,
        num_speculative_tokens=num_speculative_tokens,
        precision=precision,
    )
    return dicts.map(lambda d: _CfgWorkerConfig.from_mapping(d).unwrap())


class BrokenConfig(_CfgNamedTuple):
    """A NeMo-RL dict with known faults, and the dotted keys its problems must name."""

    mapping: dict[object, object]
    keys: frozenset[str]


def _cfg_vllm(d: dict[object, object]) -> dict[str, object]:
    v = d["vllm_cfg"]
    assert isinstance(v, dict)
    return v


def _cfg_set(
    path: str, values: st.SearchStrategy[object]
) -> _CfgCallable[[st.DrawFn, dict[object, object]], None]:
    def apply(draw: st.DrawFn, d: dict[object, object]) -> None:
        *parents, leaf = path.split(".")
        target = d
        for parent in parents:
            child = target.get(parent)
            if not isinstance(child, dict):
                child = {}
            target[parent] = child = dict(child)
            target = child
        value = draw(values)
        if value is _CFG_DELETE:
            target.pop(leaf, None)
        else:
            target[leaf] = value

    return apply


_CFG_DELETE = object()
_cfg_nan = st.just(float("nan"))
_cfg_inf = st.sampled_from([float("inf"), float("-inf")])
_cfg_delete = st.just(_CFG_DELETE)


def _cfg_both_spec(draw: st.DrawFn, d: dict[object, object]) -> None:
    _cfg_vllm(d)["speculative_config"] = {"num_speculative_tokens": 1}
    kwargs = d.get("vllm_kwargs")
    d["vllm_kwargs"] = {
        **(kwargs if isinstance(kwargs, dict) else {}),
        "speculative_config": {"num_speculative_tokens": 2},
    }


def _cfg_bad_spec(draw: st.DrawFn, d: dict[object, object]) -> None:
    kwargs = d.get("vllm_kwargs")
    if isinstance(kwargs, dict):
        d["vllm_kwargs"] = {k: v for k, v in kwargs.items() if k != "speculative_config"}
    _cfg_vllm(d)["speculative_config"] = {
        "method": "ngram",
        "num_speculative_tokens": draw(st.sampled_from([-1, 1.5, "3", None, _CFG_DELETE])),
    }
    spec = _cfg_vllm(d)["speculative_config"]
    assert isinstance(spec, dict)
    if spec["num_speculative_tokens"] is _CFG_DELETE:
        del spec["num_speculative_tokens"]


def _cfg_nvfp4_fp8(draw: st.DrawFn, d: dict[object, object]) -> None:
    _cfg_vllm(d).update(
        nvfp4_per_token=True, precision=draw(st.sampled_from(["fp8", "float32", "auto"]))
    )


def _cfg_logprobs_conflict(draw: st.DrawFn, d: dict[object, object]) -> None:
    d["logprobs_mode"] = "raw_logprobs"
    _cfg_vllm(d)["logprobs_mode"] = "processed_logprobs"


def _cfg_non_str_key(draw: st.DrawFn, d: dict[object, object]) -> None:
    d[draw(st.sampled_from([3, None, ("a",)]))] = 1


# (expected problem key, slots it touches, mutation). Mutations with disjoint slots are
# independent: applying several yields exactly the union of their keys.
_CFG_BREAKERS: list[
    tuple[str, frozenset[str], _CfgCallable[[st.DrawFn, dict[object, object]], None]]
] = [
    (
        "model_name",
        frozenset({"model_name"}),
        _cfg_set("model_name", st.sampled_from(["", 3, None]) | _cfg_delete),
    ),
    (
        "max_new_tokens",
        frozenset({"max_new_tokens"}),
        _cfg_set("max_new_tokens", st.sampled_from([0, -5, 1.5, True, "8"]) | _cfg_delete),
    ),
    (
        "temperature",
        frozenset({"temperature"}),
        _cfg_set(
            "temperature",
            st.sampled_from([-0.1, 2.5, "hot", None]) | _cfg_nan | _cfg_inf | _cfg_delete,
        ),
    ),
    (
        "top_p",
        frozenset({"top_p"}),
        _cfg_set("top_p", st.sampled_from([0, 0.0, -1, 1.5, False]) | _cfg_nan | _cfg_delete),
    ),
    (
        "top_k",
        frozenset({"top_k"}),
        _cfg_set("top_k", st.sampled_from([0, -2, 2.5, "5"]) | _cfg_delete),
    ),
    (
        "stop_token_ids",
        frozenset({"stop_token_ids"}),
        _cfg_set("stop_token_ids", st.sampled_from([[-1], [1, -3], "1,2", [1.5], [True], 7])),
    ),
    (
        "stop_strings",
        frozenset({"stop_strings"}),
        _cfg_set("stop_strings", st.sampled_from([[""], "stop", [3], ["a", ""]])),
    ),
    (
        "bad_words",
        frozenset({"bad_words"}),
        _cfg_set("bad_words", st.sampled_from([[""], "bad", [None]])),
    ),
    (
        "ignore_eos",
        frozenset({"ignore_eos"}),
        _cfg_set("ignore_eos", st.sampled_from(["yes", 1, None])),
    ),
    (
        "_pad_token_id",
        frozenset({"_pad_token_id"}),
        _cfg_set("_pad_token_id", st.sampled_from([-1, None, "0", 0.5]) | _cfg_delete),
    ),
    ("seed", frozenset({"seed"}), _cfg_set("seed", st.sampled_from([-1, "x", 1.0]))),
    (
        "backend",
        frozenset({"backend"}),
        _cfg_set("backend", st.sampled_from(["megatron", "sglang", None])),
    ),
    (
        "vllm_cfg.tensor_parallel_size",
        frozenset({"vllm_cfg.tensor_parallel_size"}),
        _cfg_set(
            "vllm_cfg.tensor_parallel_size", st.sampled_from([0, -1, "2", True, 1.0]) | _cfg_delete
        ),
    ),
    (
        "vllm_cfg.pipeline_parallel_size",
        frozenset({"vllm_cfg.pipeline_parallel_size"}),
        _cfg_set("vllm_cfg.pipeline_parallel_size", st.sampled_from([0, None]) | _cfg_delete),
    ),
    (
        "vllm_cfg.expert_parallel_size",
        frozenset({"vllm_cfg.expert_parallel_size"}),
        _cfg_set("vllm_cfg.expert_parallel_size", st.sampled_from([0, -1])),
    ),
    (
        "vllm_cfg.gpu_memory_utilization",
        frozenset({"vllm_cfg.gpu_memory_utilization"}),
        _cfg_set(
            "vllm_cfg.gpu_memory_utilization",
            st.sampled_from([0, 0.0, 1.01, -0.5, "0.5", True]) | _cfg_nan | _cfg_delete,
        ),
    ),
    (
        "vllm_cfg.max_model_len",
        frozenset({"vllm_cfg.max_model_len"}),
        _cfg_set("vllm_cfg.max_model_len", st.sampled_from([0, -1, 8.5]) | _cfg_delete),
    ),
    (
        "vllm_cfg.precision",
        frozenset({"vllm_cfg.precision"}),
        _cfg_set("vllm_cfg.precision", st.sampled_from(["fp9", "int4", 16, None, ""])),
    ),
    (
        "vllm_cfg.sleep_level",
        frozenset({"vllm_cfg.sleep_level"}),
        _cfg_set("vllm_cfg.sleep_level", st.sampled_from([0, 3, "1", True, 1.0])),
    ),
    (
        "vllm_cfg.enforce_eager",
        frozenset({"vllm_cfg.enforce_eager"}),
        _cfg_set("vllm_cfg.enforce_eager", st.sampled_from(["no", 0])),
    ),
    (
        "vllm_cfg.enable_prefix_caching",
        frozenset({"vllm_cfg.enable_prefix_caching"}),
        _cfg_set("vllm_cfg.enable_prefix_caching", st.sampled_from(["auto", 1])),
    ),
    (
        "vllm_cfg.kv_cache_dtype",
        frozenset({"vllm_cfg.kv_cache_dtype"}),
        _cfg_set("vllm_cfg.kv_cache_dtype", st.sampled_from(["", 8, None])),
    ),
    (
        "vllm_cfg.load_format",
        frozenset({"vllm_cfg.load_format"}),
        _cfg_set("vllm_cfg.load_format", st.sampled_from(["", 0])),
    ),
    (
        "vllm_cfg.nvfp4_per_token",
        frozenset({"vllm_cfg.nvfp4_per_token", "vllm_cfg.precision"}),
        _cfg_nvfp4_fp8,
    ),
    (
        "vllm_cfg.speculative_config.num_speculative_tokens",
        frozenset({"vllm_cfg.speculative_config", "vllm_kwargs"}),
        _cfg_bad_spec,
    ),
    (
        "vllm_kwargs.speculative_config",
        frozenset({"vllm_cfg.speculative_config", "vllm_kwargs"}),
        _cfg_both_spec,
    ),
    (
        "vllm_kwargs",
        frozenset({"vllm_kwargs"}),
        _cfg_set("vllm_kwargs", st.sampled_from([["a"], "x", 3])),
    ),
    (
        "logprobs_mode",
        frozenset({"logprobs_mode", "vllm_cfg.logprobs_mode"}),
        _cfg_logprobs_conflict,
    ),
    (
        "vllm_cfg.logprobs_mode",
        frozenset({"logprobs_mode", "vllm_cfg.logprobs_mode"}),
        _cfg_set("vllm_cfg.logprobs_mode", st.sampled_from(["raw", "logprobs", 1])),
    ),
    (
        "telemetry.enabled",
        frozenset({"telemetry", "telemetry.enabled"}),
        _cfg_set("telemetry.enabled", st.sampled_from(["yes", 1, None])),
    ),
    (
        "telemetry.otlp_protocol",
        frozenset({"telemetry", "telemetry.otlp_protocol"}),
        _cfg_set("telemetry.otlp_protocol", st.sampled_from(["http/json", "GRPC", 1])),
    ),
    (
        "telemetry.otlp_endpoint",
        frozenset({"telemetry", "telemetry.otlp_endpoint"}),
        _cfg_set("telemetry.otlp_endpoint", st.sampled_from(["", 4317])),
    ),
    (
        "telemetry.collect_detailed_traces",
        frozenset({"telemetry", "telemetry.collect_detailed_traces"}),
        _cfg_set("telemetry.collect_detailed_traces", st.sampled_from([["everything"], "all"])),
    ),
    (
        "telemetry.endpoint",
        frozenset({"telemetry", "telemetry.endpoint"}),
        _cfg_set("telemetry.endpoint", st.just("http://x")),
    ),
    (
        "colocated.enabled",
        frozenset({"colocated"}),
        _cfg_set("colocated.enabled", st.sampled_from(["yes", 1])),
    ),
    ("(config)", frozenset({"(config)"}), _cfg_non_str_key),
]
# Replacing a whole block breaks everything inside it, so it claims every slot inside.
_CFG_BREAKERS += [
    (
        "vllm_cfg",
        frozenset({"vllm_cfg"}).union(
            *(s for _, s, _ in _CFG_BREAKERS if any(x.startswith("vllm_cfg") for x in s))
        ),
        _cfg_set("vllm_cfg", st.sampled_from([None, "tp=1", [1]]) | _cfg_delete),
    ),
    (
        "telemetry",
        frozenset({"telemetry"}),
        _cfg_set("telemetry", st.sampled_from(["on", True, ["enabled"]])),
    ),
]


@st.composite
def broken_nemo_config_dicts(draw: st.DrawFn) -> BrokenConfig:
    """A valid dict with one or more independent faults, and exactly the keys they break."""
    d: dict[object, object] = {k: v for k, v in draw(nemo_config_dicts()).items()}
    d["vllm_cfg"] = dict(_cfg_vllm(d))
    chosen = draw(
        st.lists(st.sampled_from(range(len(_CFG_BREAKERS))), min_size=1, max_size=6, unique=True)
    )
    used: set[str] = set()
    keys: set[str] = set()
    for index in chosen:
        key, slots, apply = _CFG_BREAKERS[index]
        if slots & used:
            continue
        used |= slots
        keys.add(key)
        apply(draw, d)
    return BrokenConfig(d, frozenset(keys))


_CFG_TOP_KEYS = [
    "model_name",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "stop_strings",
    "bad_words",
    "ignore_eos",
    "_pad_token_id",
    "seed",
    "logprobs_mode",
    "backend",
    "telemetry",
    "colocated",
    "vllm_kwargs",
]
_CFG_VLLM_KEYS = [
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "expert_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "precision",
    "sleep_level",
    "speculative_config",
    "nvfp4_per_token",
    "enable_prefix_caching",
    "logprobs_mode",
]
_cfg_wild_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=4)
    | st.sampled_from(["vllm", "fp8", "grpc", "raw_logprobs", ""])
)


def _cfg_wild_extend(kids: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    keys = st.sampled_from(["enabled", "num_speculative_tokens", "otlp_endpoint", "x"])
    return st.lists(kids, max_size=3) | st.dictionaries(keys | st.integers(), kids, max_size=3)


cfg_wild_values: st.SearchStrategy[object] = st.recursive(
    _cfg_wild_leaf, _cfg_wild_extend, max_leaves=8
)


@st.composite
def wild_nemo_config_dicts(draw: st.DrawFn) -> dict[object, object]:
    """Anything shaped roughly like a config: known keys with arbitrary values (NaN, inf,
    wrong types, nested junk), and ``vllm_cfg`` with the same. For totality laws."""
    d: dict[object, object] = draw(
        st.dictionaries(
            st.sampled_from(_CFG_TOP_KEYS) | st.integers(), cfg_wild_values, max_size=10
        )
    )
    if draw(st.booleans()):
        d["vllm_cfg"] = draw(
            st.dictionaries(st.sampled_from(_CFG_VLLM_KEYS), cfg_wild_values, max_size=8)
        )
    return d


# --- refit_plan ---
from genworker.core import refit_plan as _refit

refit_dtypes = st.sampled_from(sorted(_refit.DTYPE_ITEMSIZE))
refit_shapes = st.lists(st.integers(0, 40), max_size=3).map(tuple) | st.sampled_from(
    [(), (0,), (1,), (128,), (300, 7), (1024, 3)]
)


def refit_specs(
    *, min_size: int = 0, max_size: int = 12
) -> st.SearchStrategy[list[_refit.TensorSpec]]:
    """Specs with unique names, sizes from empty to a few KiB (padding and oversize cases)."""
    names = st.lists(
        st.text(alphabet="abcdefgh.0123456789", min_size=1, max_size=12),
        min_size=min_size,
        max_size=max_size,
        unique=True,
    )
    return names.flatmap(
        lambda ns: st.tuples(
            *[st.builds(_refit.TensorSpec, st.just(n), refit_shapes, refit_dtypes) for n in ns]
        ).map(list)
    )


refit_budgets = st.integers(1, 16).map(lambda k: k * _refit.ALIGNMENT)


# --- engine_plan ---
gpu_capabilities: st.SearchStrategy[tuple[int, int] | None] = st.none() | st.tuples(
    st.integers(5, 12), st.integers(0, 9)
)
_PLAN_MODULE_NAMES = st.sampled_from(
    ["lm_head", "model.embed_tokens", "model.layers.0.mlp", "visual", "mlp.gate"]
)
plan_module_lists: st.SearchStrategy[list[str]] = st.lists(_PLAN_MODULE_NAMES, max_size=4)


@st.composite
def user_hf_overrides(draw: st.DrawFn) -> dict[str, object]:
    """A user's ``vllm_kwargs.hf_overrides``: HF config keys, and sometimes a
    ``quantization_config`` with skip lists and keys that shadow the fp8 defaults."""
    hf: dict[str, object] = draw(
        st.dictionaries(
            st.sampled_from(["max_position_embeddings", "rope_scaling", "num_hidden_layers"]),
            cfg_json_values,
            max_size=2,
        )
    )
    if draw(st.booleans()):
        hf["quantization_config"] = draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "ignored_layers": plan_module_lists,
                    "modules_to_not_convert": plan_module_lists,
                    "weight_block_size": st.just([64, 64]),
                    "activation_scheme": st.sampled_from(["dynamic", "static"]),
                    "extra_field": cfg_json_values,
                },
            )
        )
    return hf


# --- versions ---
@st.composite
def version_sequences(draw: st.DrawFn, *, max_size: int = 40) -> list[int]:
    """One row's per-token versions: non-negative and never going down."""
    start = draw(st.integers(0, 5))
    steps = draw(st.lists(st.sampled_from([0, 0, 0, 1, 2]), max_size=max_size))
    out: list[int] = []
    version = start
    for step in steps:
        version += step
        out.append(version)
    return out


def version_batches(
    max_rows: int = 6,
) -> st.SearchStrategy[list[tuple[int, list[int]]]]:
    """Rows of (input length, per-token versions)."""
    return st.lists(st.tuples(st.integers(0, 8), version_sequences(max_size=12)), max_size=max_rows)


# --- serving ---
SERVING_VOCAB = ("a", "b", "ab", "ba", "aa", "bb", "<s>", "</s>", ":", " ")
"""A toy tokenizer for the prefix laws: token id = index, decode = concatenation."""

_SERVING_PIECES = {piece: i for i, piece in enumerate(SERVING_VOCAB)}


def serving_decode(ids: object) -> str:
    """The toy tokenizer's decode."""
    assert isinstance(ids, list | tuple)
    return "".join(SERVING_VOCAB[i] for i in ids)


def serving_texts(min_size: int = 1) -> st.SearchStrategy[str]:
    """Text over the toy tokenizer's letters."""
    return st.text(alphabet="ab", min_size=min_size, max_size=12)


@st.composite
def serving_segmentations(draw: st.DrawFn, text: str) -> list[int]:
    """One tokenization of ``text``: pieces of one or two letters."""
    ids: list[int] = []
    i = 0
    while i < len(text):
        n = 2 if i + 1 < len(text) and draw(st.booleans()) else 1
        ids.append(_SERVING_PIECES[text[i : i + n]])
        i += n
    return ids
