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

_sampling_specs_by_default = st.builds(
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
# ``detokenize`` defaults to "has stop strings"; a spec may also ask for text without them.
sampling_specs = st.tuples(_sampling_specs_by_default, st.booleans()).map(
    lambda drawn: _sampling_attrs.evolve(drawn[0], detokenize=True) if drawn[1] else drawn[0]
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


_ALL_INTEGER_DTYPES = (
    _batch_torch.uint8,
    _batch_torch.int8,
    _batch_torch.int16,
    _batch_torch.int32,
    _batch_torch.int64,
)


class DtypeCase(_BatchNamedTuple):
    """A valid batch in some integer dtype, the limits it is checked against, and ids an
    engine could generate for it (every id below the vocabulary)."""

    input_ids: _batch_torch.Tensor
    input_lengths: _batch_torch.Tensor
    pad_token_id: int
    vocab_size: int | None
    generated: list[list[int]]


@st.composite
def dtype_cases(draw: st.DrawFn, *, max_batch: int = 4, max_width: int = 6) -> DtypeCase:
    """Batches in every integer dtype, with vocabularies and pad ids on both sides of what
    the dtype holds (prompt tokens always fit it: the caller built the tensor)."""
    dtype = draw(st.sampled_from(_ALL_INTEGER_DTYPES))
    vocab_size = draw(
        st.none()
        | st.sampled_from([1, 100, 127, 128, 129, 255, 256, 257, 32_767, 32_768, 32_769])
        | st.integers(1, 1 << 20)
        | st.sampled_from([2**31 - 1, 2**31, 2**31 + 1])
    )
    top = 100 if vocab_size is None else min(vocab_size, 100)
    pad = draw(st.integers(-2, top + 1) | st.sampled_from([-129, 127, 128, 255, 256, 32_768]))
    batch = draw(st.integers(1, max_batch))
    width = draw(st.integers(1, max_width))
    prompts = [
        draw(st.lists(st.integers(0, top - 1), min_size=1, max_size=width)) for _ in range(batch)
    ]
    rows = [p + [0] * (width - len(p)) for p in prompts]
    ids = _batch_torch.tensor(rows, dtype=_batch_torch.int64)
    for i, p in enumerate(prompts):
        ids[i, len(p) :] = pad
    bound = 2**31 - 1 if vocab_size is None else vocab_size - 1
    generated = [
        draw(st.lists(st.integers(0, bound) | st.just(bound), max_size=4)) for _ in range(batch)
    ]
    # The caller's tensor: padding that the dtype cannot hold wraps, as torch converts it.
    return DtypeCase(
        input_ids=ids.to(dtype),
        input_lengths=_batch_torch.tensor([len(p) for p in prompts]),
        pad_token_id=pad,
        vocab_size=vocab_size,
        generated=generated,
    )


# Seeds a caller might send in data["seeds"]: in range, on both edges, and not ints at all.
seed_values = (
    st.none()
    | st.integers(0, 2**64 - 1)
    | st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**65, -1, -(2**63)])
    | st.integers(-(2**70), 2**70)
    | st.booleans()
    | st.floats(allow_nan=True)
    | st.text(max_size=2)
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
    non_finite: bool = False,
) -> _AsmGeneration:
    """One row's generation; tokens and logprobs as lists or numpy arrays of several dtypes;
    ``non_finite``: logprobs may be NaN, +inf or -inf too (what vLLM returns for garbage
    logits or a masked token)."""
    tokens = draw(st.lists(st.integers(0, vocab_size - 1), max_size=max_tokens))
    value = st.floats(-30.0, 0.0, allow_nan=False, allow_infinity=False)
    if non_finite:
        value = value | st.sampled_from([float("nan"), float("inf"), float("-inf")])
    logprobs = [draw(value) for _ in tokens]
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
    draw: st.DrawFn,
    *,
    max_batch: int = 8,
    max_width: int = 16,
    max_tokens: int = 12,
    non_finite: bool = False,
) -> AssemblyCase:
    batch = draw(right_padded_batches(max_batch=max_batch, max_width=max_width))
    rows = batch.input_ids.shape[0]
    gens = [
        draw(generations(max_tokens=max_tokens, vocab_size=batch.vocab_size, non_finite=non_finite))
        for _ in range(rows)
    ]
    return AssemblyCase(batch=batch, generations=gens)


# --- outputs ---
from genworker.core.config import LOGPROBS_MODES as _OUT_LOGPROBS_MODES


class LogprobBatch(_BatchNamedTuple):
    """A batch's flat logprobs (float32, NaN/+inf/-inf among them or not), its row
    lengths, the engine's logprobs mode and names for its rows."""

    logprobs: _asm_np.ndarray
    lengths: _asm_np.ndarray
    mode: str
    rows: list[int]


_OUT_SPECIALS = (float("nan"), float("inf"), float("-inf"))


@st.composite
def logprob_batches(draw: st.DrawFn, *, max_rows: int = 8, max_tokens: int = 10) -> LogprobBatch:
    """Mostly finite batches (every value finite in about a third), with the non-finite
    values vLLM can return anywhere, empty rows and an empty batch included."""
    lengths = draw(st.lists(st.integers(0, max_tokens), max_size=max_rows))
    finite_only = draw(st.integers(0, 2)) == 0
    value = st.floats(-1e4, 1e4, width=32)
    if not finite_only:
        value = value | st.sampled_from(_OUT_SPECIALS)
    values = draw(st.lists(value, min_size=sum(lengths), max_size=sum(lengths)))
    start = draw(st.integers(0, 1000))
    return LogprobBatch(
        logprobs=_asm_np.asarray(values, dtype=_asm_np.float32),
        lengths=_asm_np.asarray(lengths, dtype=_asm_np.int64),
        mode=draw(st.sampled_from(sorted(_OUT_LOGPROBS_MODES))),
        rows=list(range(start, start + 3 * len(lengths), 3)),
    )


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
    or absent, ``None`` where NeMo-RL allows it, keys of other layers (and refused keys at
    the values that ask for nothing) at the top level and in ``vllm_cfg``,
    ``speculative_config``/``logprobs_mode`` in either of their places.

    Every dict parses (``WorkerConfig.from_mapping`` succeeds) and plans
    (``plan_engine_kwargs`` succeeds given a Blackwell capability when
    ``vllm_cfg.nvfp4_per_token`` is set): no reserved ``vllm_kwargs`` keys, no quantization
    override, telemetry enabled only with an endpoint, an async fp8 engine on ``dummy``
    weights.
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
    if vllm_cfg.get("precision") == "fp8" and vllm_cfg.get("async_engine") is True:
        vllm_cfg["load_format"] = "dummy"  # the async fp8 engine's weights come by refit
    _cfg_maybe(draw, vllm_cfg, "kv_cache_dtype", st.sampled_from(["auto", "fp8", "fp8_e4m3"]))
    _cfg_maybe(draw, vllm_cfg, "sleep_level", st.sampled_from([1, 2]))
    if vllm_cfg.get("precision", "bfloat16") in ("bfloat16", "float16"):
        _cfg_maybe(draw, vllm_cfg, "nvfp4_per_token", st.booleans())
    _cfg_maybe(
        draw,
        vllm_cfg,
        "limit_mm_per_prompt",
        st.none()
        | st.dictionaries(
            st.sampled_from(["image", "video", "audio"]),
            st.integers(0, 8)
            | st.fixed_dictionaries(
                {"count": st.integers(0, 8)}, optional={"width": st.integers(1, 512)}
            ),
            max_size=2,
        ),
    )
    _cfg_maybe(
        draw,
        vllm_cfg,
        "mm_processor_kwargs",
        st.none() | st.fixed_dictionaries({}, optional={"do_image_splitting": st.booleans()}),
    )
    _cfg_maybe(
        draw,
        vllm_cfg,
        "reset_encoder_cache_after_weight_update",
        st.sampled_from([True, "true", False, "no"]),
    )
    _cfg_maybe(draw, vllm_cfg, "use_deep_gemm", st.sampled_from([False, "false", 0]))
    _cfg_maybe(draw, vllm_cfg, "num_first_layers_in_bf16", st.just(0))
    _cfg_maybe(draw, vllm_cfg, "use_tqdm", st.booleans())
    _cfg_maybe(
        draw,
        vllm_cfg,
        "env_vars",
        st.dictionaries(
            st.sampled_from(["NCCL_DEBUG", "VLLM_X", "MY_VAR"]), st.text("ab1", max_size=3)
        ),
    )
    for key in ("expose_http_server", "enable_vllm_metrics_logger", "tool_parser_plugin"):
        _cfg_maybe(draw, vllm_cfg, key, cfg_json_values)

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
    if vllm_cfg.get("skip_tokenizer_init") is True:  # without a tokenizer both are refused
        d["stop_strings"] = None
        d.pop("bad_words", None)
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
    _cfg_maybe(draw, d, "mcore_generation_config", cfg_json_values)
    _cfg_maybe(draw, d, "refit_transport", st.none())
    _cfg_maybe(draw, d, "quant_cfg", st.none())

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
    spec: dict[str, object] = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 4,
    }
    if num_speculative_tokens is None and draw(st.booleans()):
        del spec["num_speculative_tokens"]  # vLLM infers it (an MTP drafter) or refuses
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
        "num_speculative_tokens": draw(st.sampled_from([-1, 1.5, "3", True])),
    }


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
        _cfg_set("top_k", st.sampled_from([0, -2, 2.5, "5"])),
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
        _cfg_set("ignore_eos", st.sampled_from(["maybe", 2, None])),
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
        _cfg_set("vllm_cfg.enforce_eager", st.sampled_from(["nope", 2, "False "])),
    ),
    (
        "vllm_cfg.enable_prefix_caching",
        frozenset({"vllm_cfg.enable_prefix_caching"}),
        _cfg_set("vllm_cfg.enable_prefix_caching", st.sampled_from(["auto", 2])),
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
        _cfg_set("telemetry.enabled", st.sampled_from(["maybe", 2, None])),
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
        _cfg_set("colocated.enabled", st.sampled_from(["maybe", 2])),
    ),
    (
        "vllm_cfg.limit_mm_per_prompt",
        frozenset({"vllm_cfg.limit_mm_per_prompt"}),
        _cfg_set(
            "vllm_cfg.limit_mm_per_prompt",
            st.sampled_from([{"image": -1}, {"image": {"width": 2}}, {"image": True}, 3, {1: 2}]),
        ),
    ),
    (
        "vllm_cfg.mm_processor_kwargs",
        frozenset({"vllm_cfg.mm_processor_kwargs"}),
        _cfg_set("vllm_cfg.mm_processor_kwargs", st.sampled_from(["split", [1], {2: 3}])),
    ),
    (
        "vllm_cfg.reset_encoder_cache_after_weight_update",
        frozenset({"vllm_cfg.reset_encoder_cache_after_weight_update"}),
        _cfg_set(
            "vllm_cfg.reset_encoder_cache_after_weight_update",
            st.sampled_from(["maybe", 2, [True]]),
        ),
    ),
    ("(config)", frozenset({"(config)"}), _cfg_non_str_key),
    (
        "quant_cfg",
        frozenset({"quant_cfg"}),
        _cfg_set("quant_cfg", st.sampled_from(["fp8_default", {"algo": "nvfp4"}])),
    ),
    (
        "vllm_cfg.use_deep_gemm",
        frozenset({"vllm_cfg.use_deep_gemm"}),
        _cfg_set("vllm_cfg.use_deep_gemm", st.sampled_from([True, "true", 1])),
    ),
    (
        "vllm_cfg.video",
        frozenset({"vllm_cfg.video"}),
        _cfg_set(
            "vllm_cfg.video",
            st.sampled_from(
                [None, {"num_frames": 8}, {"sampling_style": "nemotron_vl", "num_frames": 8}]
            ),
        ),
    ),
    (
        "vllm_cfg.x_typo",
        frozenset({"vllm_cfg.x_typo"}),
        _cfg_set("vllm_cfg.x_typo", cfg_json_values),
    ),
    (
        "vllm_cfg.use_tqdm",
        frozenset({"vllm_cfg.use_tqdm"}),
        _cfg_set("vllm_cfg.use_tqdm", st.sampled_from(["sometimes", [1]])),
    ),
    (
        "vllm_cfg.env_vars",
        frozenset({"vllm_cfg.env_vars"}),
        _cfg_set("vllm_cfg.env_vars", st.sampled_from(["A=1", {"A": [1]}, {"": "1"}])),
    ),
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
    "limit_mm_per_prompt",
    "mm_processor_kwargs",
    "video",
    "reset_encoder_cache_after_weight_update",
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


# --- serving: request bodies ---
#: JSON values (what ``json.loads`` gives): scalars, lists and objects, nested a few levels.
json_values: st.SearchStrategy[object] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet='ab[]{}"\\', max_size=6),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(alphabet="ab[{", max_size=3), children, max_size=3)
    ),
    max_leaves=24,
)


def json_nesting(value: object) -> int:
    """The nesting depth of a JSON value by its definition (a scalar: 0), recursively:
    the reference the core's iterative count is checked against."""
    if isinstance(value, dict):
        return 1 + max((json_nesting(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((json_nesting(v) for v in value), default=0)
    return 0


@st.composite
def nested_json_texts(draw: st.DrawFn, depth: int) -> str:
    """A JSON text nested exactly ``depth`` levels, arrays and objects in any order, with
    siblings at any level and brackets inside strings (which nest nothing)."""
    text = draw(st.sampled_from(["1", '"[{x"', "null"]))
    for _ in range(depth):
        if draw(st.booleans()):
            text = "[" + text + draw(st.sampled_from(["", ", 2", ', "]]"'])) + "]"
        else:
            text = '{"k": ' + text + draw(st.sampled_from(["", ', "s": 0', ', "}{": "{"'])) + "}"
    return text


#: Token ids and values that are not: bools, floats, negatives, ids past any vocabulary.
maybe_token_ids: st.SearchStrategy[list[object]] = st.lists(
    st.one_of(
        st.integers(0, 40),
        st.integers(0, 40),
        st.integers(-5, -1),
        st.integers(2**63 - 2, 2**70),
        st.booleans(),
        st.just(1.0),
        st.none(),
    ),
    max_size=8,
)


# --- delta ---
import numpy as _np

from genworker.core.delta import Bits as _Bits
from genworker.core.refit_plan import TensorSpec as _DeltaSpec

#: The dtypes a refit carries, by name: their bit patterns are what the codec sees.
DELTA_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")
delta_chunk_elements = st.one_of(st.integers(1, 40), st.sampled_from([64, 256, 1 << 16]))


@_caps_attrs.frozen
class BitsPair:
    """Old and new bit patterns of one tensor, alike in width and length."""

    old: _Bits
    new: _Bits


@st.composite
def delta_pairs(draw: st.DrawFn, *, max_numel: int = 300) -> BitsPair:
    """Random old bits and new bits that differ on a random mask: none, few, many or all."""
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    numel = draw(st.integers(0, max_numel))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = _np.random.default_rng(seed)
    dtype = _np.dtype(f"u{itemsize}")
    old = rng.integers(0, 2 ** (8 * itemsize), size=numel, dtype=dtype, endpoint=False)
    density = draw(st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.6, 1.0]))
    mask = rng.random(numel) < density
    flips = rng.integers(1, 2 ** (8 * itemsize), size=numel, dtype=dtype, endpoint=False)
    new = _np.where(mask, old ^ flips, old).astype(dtype)
    return BitsPair(old, new)


def delta_specs(max_tensors: int = 5) -> st.SearchStrategy[list[_DeltaSpec]]:
    spec = st.builds(
        _DeltaSpec,
        name=st.text("abcdef.", min_size=1, max_size=6),
        shape=st.lists(st.integers(0, 50), max_size=3).map(tuple),
        dtype=st.sampled_from(DELTA_DTYPES),
    )
    return st.lists(spec, max_size=max_tensors, unique_by=lambda s: s.name)


@st.composite
def relay_receivers(draw: st.DrawFn, *, max_receivers: int = 40) -> tuple[list[str], int]:
    """Distinct receiver names and a fanout."""
    count = draw(st.integers(1, max_receivers))
    fanout = draw(st.integers(1, 6))
    return [f"r{i}" for i in range(count)], fanout


# --- reshard ---
from genworker.core import reshard as _rs


@_caps_attrs.frozen
class ReshardModel:
    """A Llama-like layer's tensors with the sizes vLLM's TP split needs."""

    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_size: int
    intermediate: int
    engine_tp: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, hs = self.hidden, self.head_size
        return {
            "embed": (self.vocab, h),
            "q": (self.heads * hs, h),
            "k": (self.kv_heads * hs, h),
            "v": (self.kv_heads * hs, h),
            "o": (h, self.heads * hs),
            "gate": (self.intermediate, h),
            "up": (self.intermediate, h),
            "down": (h, self.intermediate),
            "norm": (h,),
            "lm_head": (self.vocab, h),
        }

    def facts(self, rank: int, dtype: str = "bfloat16") -> list[_rs.VllmParamFacts]:
        """vLLM's facts for every engine parameter on TP rank ``rank``."""
        s, kind = self.shapes(), _rs.LayerKind

        def one(param: str, k: _rs.LayerKind, names: str, **extra: int) -> _rs.VllmParamFacts:
            sources = tuple((n, s[n]) for n in names.split())
            return _rs.VllmParamFacts(param, k, dtype, rank, self.engine_tp, sources, **extra)

        heads = {
            "head_size": self.head_size,
            "num_heads": self.heads,
            "num_kv_heads": self.kv_heads,
        }
        return [
            one("embed_tokens", kind.VOCAB, "embed", padding_size=8),
            one("qkv_proj", kind.QKV, "q k v", **heads),
            one("o_proj", kind.ROW, "o"),
            one("gate_up_proj", kind.MERGED, "gate up"),
            one("down_proj", kind.ROW, "down"),
            one("norm", kind.REPLICATED, "norm"),
            one("lm_head", kind.VOCAB, "lm_head", padding_size=8),
        ]


@st.composite
def reshard_models(draw: st.DrawFn) -> ReshardModel:
    """Sizes every engine TP in the draw can split (vLLM's ``divide`` rules, GQA included)."""
    tp = draw(st.sampled_from([1, 2, 4]))
    heads = tp * draw(st.integers(1, 2))
    kv_heads = draw(
        st.sampled_from([d for d in (1, 2, 4) if heads % d == 0 and (tp % d == 0 or d % tp == 0)])
    )
    head_size = draw(st.sampled_from([4, 8]))
    hidden = 4 * draw(st.integers(1, 3))
    intermediate = tp * draw(st.integers(1, 3)) * 2
    vocab = draw(st.integers(1, 40))
    return ReshardModel(vocab, hidden, heads, kv_heads, head_size, intermediate, tp)


@st.composite
def megatron_trainers(draw: st.DrawFn, model: ReshardModel) -> list[_rs.TrainerLayout]:
    """Megatron-style: TP (dividing every split size), PP stages, DP replicas."""
    shapes = model.shapes()
    candidates = [
        t
        for t in (1, 2, 4)
        if all(
            shapes[n][d] % t == 0
            for n, d in [("q", 0), ("k", 0), ("gate", 0), ("o", 1), ("down", 1)]
        )
    ]
    tp = draw(st.sampled_from(candidates))
    pp = draw(st.integers(1, 2))
    dp = draw(st.integers(1, 2))
    split = {"q": 0, "k": 0, "v": 0, "gate": 0, "up": 0, "o": 1, "down": 1, "norm": None}
    layouts = []
    for name, shape in shapes.items():
        stage = draw(st.integers(0, pp - 1))
        dim = split.get(name, 0 if shape[0] % tp == 0 else None)
        groups = [[(stage * tp + t) * dp + d for d in range(dp)] for t in range(tp)]
        layouts.append(_rs.megatron_layout(name, shape, "bfloat16", dim, groups).unwrap())
    return layouts


placements: st.SearchStrategy[_rs.Shard | _rs.Replicate] = st.sampled_from(
    [_rs.Replicate(), _rs.Shard(0), _rs.Shard(1)]
)


@st.composite
def dtensor_trainers(draw: st.DrawFn, model: ReshardModel) -> list[_rs.TrainerLayout]:
    """DTensor over a (dp, tp) mesh: any Shard/Replicate per mesh dim, uneven chunks too."""
    mesh = (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    ranks = draw(st.permutations(list(range(mesh[0] * mesh[1]))))
    layouts = []
    for name, shape in model.shapes().items():
        chosen = [draw(placements) for _ in mesh]
        chosen = [
            p if not isinstance(p, _rs.Shard) or p.dim < len(shape) else _rs.Replicate()
            for p in chosen
        ]
        layouts.append(_rs.dtensor_layout(name, shape, "bfloat16", mesh, ranks, chosen).unwrap())
    return layouts


# --- worker: the generate fuzz (tests/shell/test_worker_fuzz.py) ---
from collections.abc import Callable as _FuzzCallable


class FuzzCall(_BatchNamedTuple):
    """One call a hostile caller makes: ``generate(data, greedy)``, or ``generate_text``
    when ``text``; ``broken`` names the one input it broke (None: a valid call, which must
    succeed), and a refusal must name it; ``damage`` says how (for the outcome counts)."""

    data: object
    greedy: object
    text: bool
    broken: str | None
    damage: str


class _FuzzBatch(_BatchNamedTuple):
    """A valid batch and what a damage needs to know about it."""

    data: dict[str, object]
    ids: _batch_torch.Tensor
    lengths: _batch_torch.Tensor
    row: int
    vocab_size: int
    pad: int
    max_model_len: int


_FUZZ_STOP_TEXTS = st.text(alphabet="ae </>\n", min_size=1, max_size=3)


@st.composite
def _fuzz_valid(
    draw: st.DrawFn, vocab_size: int, pad: int, max_model_len: int, *, min_batch: int = 0
) -> dict[str, object]:
    """A valid batch: right-padded (sometimes a strided view), in a dtype that holds the
    vocabulary, with optional seeds and per-row stop strings; sometimes a row near the
    context end, sometimes no rows at all."""
    batch = draw(st.integers(min_batch, 5))
    tokens = st.integers(0, vocab_size - 1) | st.just(pad)
    prompts = [draw(st.lists(tokens, min_size=1, max_size=12)) for _ in range(batch)]
    if batch and draw(st.integers(0, 9)) == 0:  # room for only a few generated tokens
        room = draw(st.integers(1, 6))
        prompts[0] = prompts[0] + [7] * (max_model_len - room - len(prompts[0]))
    longest = max((len(p) for p in prompts), default=draw(st.integers(0, 3)))
    width = longest + draw(st.integers(0, 3))
    dtype = draw(st.sampled_from([_batch_torch.int64, _batch_torch.int32, _batch_torch.int16]))
    stride = draw(st.sampled_from([1, 1, 2]))
    ids = _batch_torch.full((batch, width * stride), pad, dtype=dtype)
    for i, p in enumerate(prompts):
        ids[i, : len(p) * stride : stride] = _batch_torch.tensor(p, dtype=dtype)
    lengths_dtype = draw(st.sampled_from([_batch_torch.int64, _batch_torch.int32]))
    data: dict[str, object] = {
        "input_ids": ids[:, ::stride],
        "input_lengths": _batch_torch.tensor([len(p) for p in prompts], dtype=lengths_dtype),
    }
    seeds = st.none() | st.integers(0, 2**63 - 1) | st.sampled_from([0, 2**63 - 1])
    choice = draw(st.sampled_from(["none", "list", "tensor"]))
    if choice == "list":
        data["seeds"] = draw(st.lists(seeds, min_size=batch, max_size=batch))
    elif choice == "tensor":
        values = draw(st.lists(st.integers(0, 2**63 - 1), min_size=batch, max_size=batch))
        data["seeds"] = _batch_torch.tensor(values, dtype=_batch_torch.int64)
    if draw(st.booleans()):
        per_row = st.none() | st.lists(_FUZZ_STOP_TEXTS, max_size=2)
        data["stop_strings"] = draw(st.lists(per_row, min_size=batch, max_size=batch))
    return data


def _with(b: _FuzzBatch, key: str, value: object) -> dict[str, object]:
    return {**b.data, key: value}


def _without(b: _FuzzBatch, key: str) -> dict[str, object]:
    return {k: v for k, v in b.data.items() if k != key}


def _put(t: _batch_torch.Tensor, index: tuple[int, ...], value: int) -> _batch_torch.Tensor:
    out = t.clone()
    out[index] = value
    return out


def _not_right_padded(draw: st.DrawFn, b: _FuzzBatch) -> dict[str, object]:
    """A real token after the row's length (one more column, so there is one)."""
    wide = _batch_torch.cat([b.ids, _batch_torch.full((b.ids.shape[0], 1), b.pad)], dim=1)
    pos = draw(st.integers(int(b.lengths[b.row]), wide.shape[1] - 1))
    return _with(b, "input_ids", _put(wide, (b.row, pos), (b.pad + 1) % b.vocab_size))


def _fills_context(draw: st.DrawFn, b: _FuzzBatch) -> dict[str, object]:
    """A row of max_model_len tokens or more: no room to generate."""
    n = b.max_model_len + draw(st.integers(0, 3))
    ids = _batch_torch.full((b.ids.shape[0], n), b.pad)
    ids[:, : b.ids.shape[1]] = b.ids
    ids[b.row, :n] = 7
    lengths = _put(b.lengths.to(_batch_torch.int64), (b.row,), n)
    return {**b.data, "input_ids": ids, "input_lengths": lengths}


_Damage = _FuzzCallable[[st.DrawFn, _FuzzBatch], tuple[object, str]]


def _row_list(b: _FuzzBatch, value: object, other: object) -> list[object]:
    return [value if i == b.row else other for i in range(b.ids.shape[0])]


_FUZZ_DAMAGES: dict[str, _Damage] = {
    "data not a mapping": lambda d, b: (d(st.sampled_from([None, [], "ids", 3, (1,)])), "data"),
    "input_ids missing": lambda d, b: (_without(b, "input_ids"), "input_ids"),
    "input_ids a list": lambda d, b: (_with(b, "input_ids", b.ids.tolist()), "input_ids"),
    "input_ids float": lambda d, b: (_with(b, "input_ids", b.ids.float()), "input_ids"),
    "input_ids bool": lambda d, b: (_with(b, "input_ids", b.ids != b.pad), "input_ids"),
    "input_ids 1-D": lambda d, b: (_with(b, "input_ids", b.ids.reshape(-1)), "input_ids"),
    "input_ids 3-D": lambda d, b: (_with(b, "input_ids", b.ids.unsqueeze(0)), "input_ids"),
    "input_ids int8/uint8": lambda d, b: (
        _with(
            b, "input_ids", b.ids.to(d(st.sampled_from([_batch_torch.int8, _batch_torch.uint8])))
        ),
        "input_ids",
    ),
    "input_ids meta": lambda d, b: (_with(b, "input_ids", b.ids.to("meta")), "input_ids"),
    "input_ids sparse": lambda d, b: (_with(b, "input_ids", b.ids.to_sparse()), "input_ids"),
    "token out of vocabulary": lambda d, b: (
        _with(
            b,
            "input_ids",
            _put(
                b.ids.to(_batch_torch.int64),
                (b.row, d(st.integers(0, int(b.lengths[b.row]) - 1))),
                d(st.sampled_from([-1, -7, b.vocab_size, b.vocab_size + 100, 2**31])),
            ),
        ),
        "input_ids",
    ),
    "not right-padded": lambda d, b: (_not_right_padded(d, b), "input_ids"),
    "input_lengths missing": lambda d, b: (_without(b, "input_lengths"), "input_lengths"),
    "input_lengths a list": lambda d, b: (
        _with(b, "input_lengths", b.lengths.tolist()),
        "input_lengths",
    ),
    "input_lengths float": lambda d, b: (
        _with(b, "input_lengths", b.lengths.float()),
        "input_lengths",
    ),
    "input_lengths (B, 1)": lambda d, b: (
        _with(b, "input_lengths", b.lengths.unsqueeze(1)),
        "input_lengths",
    ),
    "input_lengths meta": lambda d, b: (
        _with(b, "input_lengths", b.lengths.to("meta")),
        "input_lengths",
    ),
    "input_lengths sparse": lambda d, b: (
        _with(b, "input_lengths", b.lengths.to_sparse()),
        "input_lengths",
    ),
    "length outside [1, width]": lambda d, b: (
        _with(
            b,
            "input_lengths",
            _put(
                b.lengths,
                (b.row,),
                d(st.sampled_from([0, -1, -5, b.ids.shape[1] + 1, b.ids.shape[1] + 9])),
            ),
        ),
        "input_lengths",
    ),
    "batch sizes differ": lambda d, b: (
        _with(b, "input_lengths", _batch_torch.cat([b.lengths, b.lengths[:1]])),
        "input_lengths",
    ),
    "fills the context": lambda d, b: (_fills_context(d, b), "input_lengths"),
    "seed out of range": lambda d, b: (
        _with(
            b,
            "seeds",
            _row_list(b, d(st.sampled_from([2**63, 2**64 - 1, 2**64, 2**80, -1, -(2**63)])), None),
        ),
        "seeds",
    ),
    "seed not an int": lambda d, b: (
        _with(b, "seeds", _row_list(b, d(st.sampled_from([1.0, True, "3", b"3", [1]])), 0)),
        "seeds",
    ),
    "seeds miscounted": lambda d, b: (
        _with(b, "seeds", [0] * (b.ids.shape[0] + d(st.sampled_from([-1, 1, 2])))),
        "seeds",
    ),
    "seeds a bad tensor": lambda d, b: (
        _with(
            b,
            "seeds",
            d(
                st.sampled_from(
                    [
                        _batch_torch.zeros(b.ids.shape[0], 1, dtype=_batch_torch.int64),
                        _batch_torch.zeros(b.ids.shape[0]),
                        _batch_torch.zeros(b.ids.shape[0], dtype=_batch_torch.int64).to("meta"),
                    ]
                )
            ),
        ),
        "seeds",
    ),
    "empty stop string": lambda d, b: (
        _with(b, "stop_strings", _row_list(b, [""], None)),
        "stop_strings",
    ),
    "stop strings not a list": lambda d, b: (
        _with(b, "stop_strings", d(st.sampled_from(["</a>", 3, {"a": 1}]))),
        "stop_strings",
    ),
    "stop strings miscounted": lambda d, b: (
        _with(b, "stop_strings", [None] * (b.ids.shape[0] + 1)),
        "stop_strings",
    ),
    "stop string not a str": lambda d, b: (
        _with(b, "stop_strings", _row_list(b, [3], None)),
        "stop_strings",
    ),
}


_FUZZ_TEXTS = st.text(alphabet="abcdefghij ,.", min_size=1, max_size=12)
_FUZZ_TEXT_DAMAGES: dict[str, tuple[object, str]] = {
    "text data not a mapping": (None, "data"),
    "text data a list": (["Once upon a time"], "data"),
    "prompts missing": ({}, "prompts"),
    "prompts not a list": ({"prompts": "Once"}, "prompts"),
    "prompt not a str": ({"prompts": ["Once", 3]}, "prompts"),
    "empty prompt": ({"prompts": ["Once", ""]}, "prompts"),
}


FUZZ_KINDS: tuple[str, ...] = (
    "valid",
    "valid text",
    "greedy not a bool",
    *sorted(_FUZZ_DAMAGES),
    *sorted(_FUZZ_TEXT_DAMAGES),
)
"""Every kind of call :func:`generate_calls` makes: valid ones, and one per damage."""


@st.composite
def generate_calls(
    draw: st.DrawFn, kind: str, *, vocab_size: int, pad: int, max_model_len: int
) -> FuzzCall:
    """A call of one of :data:`FUZZ_KINDS`: valid, or breaking exactly one input."""
    greedy = draw(st.booleans())
    if kind == "valid text":
        prompts = draw(st.lists(_FUZZ_TEXTS, max_size=4))
        return FuzzCall({"prompts": prompts}, greedy, True, None, kind)
    if kind in _FUZZ_TEXT_DAMAGES:
        data, key = _FUZZ_TEXT_DAMAGES[kind]
        return FuzzCall(data, greedy, True, key, kind)
    if kind == "valid":
        return FuzzCall(
            draw(_fuzz_valid(vocab_size, pad, max_model_len)), greedy, False, None, kind
        )
    if kind == "greedy not a bool":
        bad = draw(st.sampled_from([1, 0, "yes", None, 1.0]))
        return FuzzCall(
            draw(_fuzz_valid(vocab_size, pad, max_model_len)), bad, False, "greedy", kind
        )
    data = draw(_fuzz_valid(vocab_size, pad, max_model_len, min_batch=1))
    ids, lengths = data["input_ids"], data["input_lengths"]
    assert isinstance(ids, _batch_torch.Tensor)
    assert isinstance(lengths, _batch_torch.Tensor)
    batch = _FuzzBatch(
        data=data,
        ids=ids,
        lengths=lengths,
        row=draw(st.integers(0, ids.shape[0] - 1)),
        vocab_size=vocab_size,
        pad=pad,
        max_model_len=max_model_len,
    )
    broken, key = _FUZZ_DAMAGES[kind](draw, batch)
    return FuzzCall(broken, greedy, False, key, kind)


# --- multimodal ---
class MediaBatch(_NamedTuple):
    """Token prompts, each row's image count, the placeholder id (None: a text-only
    model) and the per-prompt image limit (None: unknown)."""

    prompts: list[list[int]]
    image_counts: list[int]
    placeholder_id: int | None
    max_images: int | None


@st.composite
def media_batches(draw: st.DrawFn, *, max_rows: int = 6, max_len: int = 10) -> MediaBatch:
    """Rows over a tiny vocabulary so placeholder ids occur often (runs of them too), with
    image counts that match, miss or exceed them."""
    placeholder = draw(st.none() | st.integers(0, 3))
    token = st.integers(0, 3)
    prompts = [
        draw(st.lists(token, min_size=1, max_size=max_len))
        for _ in range(draw(st.integers(0, max_rows)))
    ]
    counts = []
    for prompt in prompts:
        matching = prompt.count(placeholder) if placeholder is not None else 0
        counts.append(draw(st.sampled_from([matching, 0, matching + 1, max(matching - 1, 0)])))
    return MediaBatch(prompts, counts, placeholder, draw(st.none() | st.integers(0, 3)))


# --- refit_protocol ---
import attrs as _protocol_attrs

from genworker.core import refit_protocol as _protocol


@_protocol_attrs.frozen
class RefitSendCase:
    """A manifest and how a trainer sends it: per tensor, whether its storage is one the
    engine mapped last refit, its storage's extra bytes, whether it is contiguous and on
    the transport's device, and the seconds its stream took to produce it."""

    specs: tuple[_refit.TensorSpec, ...]
    budget: int
    flush_after_s: float
    recognised: tuple[bool, ...]
    extra: tuple[int, ...]
    contiguous: tuple[bool, ...]
    local: tuple[bool, ...]
    delays: tuple[float, ...]


@st.composite
def refit_send_cases(draw: st.DrawFn, *, max_size: int = 12) -> RefitSendCase:
    specs = tuple(draw(refit_specs(min_size=1, max_size=max_size)))
    n = len(specs)

    def flags() -> tuple[bool, ...]:
        return tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))

    return RefitSendCase(
        specs=specs,
        budget=draw(refit_budgets),
        flush_after_s=draw(st.sampled_from([0.5, 1.0, 1e9])),
        recognised=flags(),
        extra=tuple(draw(st.lists(st.sampled_from([0, 1 << 16]), min_size=n, max_size=n))),
        contiguous=flags(),
        local=flags(),
        delays=tuple(draw(st.lists(st.sampled_from([0.0, 0.3, 0.6]), min_size=n, max_size=n))),
    )


_refit_ids = st.sampled_from(["r1", "r2"])
_refit_refs = st.builds(
    _protocol.TensorRef,
    st.sampled_from(["a", "b", "c"]),
    st.sampled_from([(2,), (3,)]),
    st.sampled_from(["float32", "int8"]),
    st.integers(0, 2),
    st.sampled_from([0, 1, 8, 600]),
)
refit_events: st.SearchStrategy[_protocol.Event] = st.one_of(
    st.builds(_protocol.Begin, _refit_ids, st.sampled_from(["", "wrong"]), st.integers(1, 3)),
    st.builds(
        _protocol.Chunk,
        _refit_ids,
        st.integers(0, 3),
        st.lists(_refit_refs, max_size=3).map(tuple),
        st.none() | st.lists(st.sampled_from([0, 16, 1024]), max_size=3).map(tuple),
        st.lists(st.sampled_from(list(_protocol.StorageKind)), max_size=3).map(tuple),
    ),
    st.builds(_protocol.End, _refit_ids, st.integers(0, 3), st.integers(0, 4)),
    st.builds(_protocol.Abort, _refit_ids, st.just("stop")),
)


# --- requests ---
import attrs as _requests_attrs

from genworker.core.requests import RequestLimits as _RequestLimits
from genworker.core.stops import StopMode as _StopMode


@_requests_attrs.frozen
class RequestCase:
    """Arguments of ``plan_requests``: the batch's per-sample data as ``data``, the limits,
    and each planned row's ``(batch row, context length)``; rows repeat lengths, stops and
    seeds so that alike rows occur."""

    defaults: SamplingDefaultsValue
    limits: _RequestLimits
    data: dict[str, object]
    batch_size: int
    rows: tuple[tuple[int, int], ...]
    greedy: bool
    text: bool
    mode: _StopMode


@st.composite
def request_cases(draw: st.DrawFn, *, max_rows: int = 8) -> RequestCase:
    """A valid batch to plan; its rows are a subset of the batch, in any order."""
    max_model_len = draw(st.integers(2, 64))
    limits = _RequestLimits(
        max_new_tokens=draw(st.integers(1, 80)),
        max_model_len=max_model_len,
        cap_to_context=draw(st.booleans()),
        num_speculative_tokens=draw(st.sampled_from([0, 0, 1, 3])),
        flat_logprobs=draw(st.booleans()),
    )
    batch_size = draw(st.integers(0, max_rows))
    lengths = st.sampled_from([1, max_model_len // 2, max_model_len - 2, max_model_len - 1])
    data: dict[str, object] = {}
    if draw(st.booleans()):
        data["seeds"] = draw(
            st.lists(st.sampled_from([None, 0, 7]), min_size=batch_size, max_size=batch_size)
        )
    if draw(st.booleans()):
        data["stop_strings"] = draw(
            st.lists(
                st.sampled_from([None, ["</s>"], ["a", "b"]]),
                min_size=batch_size,
                max_size=batch_size,
            )
        )
    chosen = draw(st.permutations(range(batch_size)))
    kept = chosen[: draw(st.integers(0, batch_size))]
    return RequestCase(
        defaults=draw(sampling_defaults),
        limits=limits,
        data=data,
        batch_size=batch_size,
        rows=tuple((row, max(1, draw(lengths))) for row in kept),
        greedy=draw(st.booleans()),
        text=draw(st.booleans()),
        mode=draw(st.sampled_from(list(_StopMode))),
    )


# --- groups (core.groups) and group-aware sharding ---
@st.composite
def group_batches(
    draw: st.DrawFn, *, max_rows: int = 16
) -> tuple[list[int], list[list[int]], list[_SamplingSpec]]:
    """Generating rows (ascending batch rows), their prompts and specs, drawn from small
    pools so that prompts and specs repeat (GRPO groups), seeds sometimes per row."""
    prompt_pool = draw(st.lists(st.lists(st.integers(0, 9), max_size=3), min_size=1, max_size=3))
    spec_pool = draw(st.lists(_sampling_specs_by_default, min_size=1, max_size=2))
    count = draw(st.integers(0, max_rows))
    rows = sorted(draw(st.sets(st.integers(0, 2 * max_rows), min_size=count, max_size=count)))
    prompts = [draw(st.sampled_from(prompt_pool)) for _ in rows]
    specs = []
    for _ in rows:
        spec = draw(st.sampled_from(spec_pool))
        seed = draw(st.one_of(st.none(), st.integers(0, 3)))
        specs.append(_sampling_attrs.evolve(spec, seed=seed))
    return rows, prompts, specs


@st.composite
def shard_groups(draw: st.DrawFn, num_rows: int) -> list[list[int]]:
    """Disjoint groups of rows ``0..num_rows-1`` (some rows in none)."""
    owner = draw(st.lists(st.integers(-1, 5), min_size=num_rows, max_size=num_rows))
    groups = [[row for row in range(num_rows) if owner[row] == g] for g in range(6)]
    return [g for g in groups if g]


# --- routing ---

from genworker.core.assembly import Generation as _RouteGeneration
from genworker.core.routing import MoeShape as _MoeShape
from genworker.core.routing import RoutedExperts as _RoutedExperts


@st.composite
def moe_shapes(draw: st.DrawFn) -> _MoeShape:
    """A small MoE: 1-3 layers, 1-300 experts (past int8), top-k up to 4."""
    experts = draw(st.one_of(st.integers(1, 8), st.integers(120, 300)))
    top_k = draw(st.integers(1, min(4, experts)))
    return _MoeShape(num_layers=draw(st.integers(1, 3)), top_k=top_k, num_experts=experts)


class RoutedCase(_BatchNamedTuple):
    """A valid batch, its MoE shape and one generation per row carrying the routes an
    engine returns (``prompt + generated - 1`` rows, any integer dtype)."""

    batch: PaddedBatch
    shape: _MoeShape
    generations: list[_RouteGeneration]


@st.composite
def routed_cases(draw: st.DrawFn, *, max_batch: int = 6, max_width: int = 10) -> RoutedCase:
    batch = draw(
        right_padded_batches(max_batch=max_batch, max_width=max_width).filter(
            lambda b: b.input_ids.shape[0] > 0
        )
    )
    shape = draw(moe_shapes())
    dtypes = [_np.int32, _np.int64, _np.uint16] + ([_np.uint8] if shape.num_experts <= 256 else [])
    dtype = draw(st.sampled_from(dtypes))
    gens = []
    for row in range(batch.input_ids.shape[0]):
        generated = draw(st.integers(0, 6))
        count = max(int(batch.input_lengths[row]) + generated - 1, 0)
        seed = draw(st.integers(0, 2**32 - 1))
        ids = _np.random.default_rng(seed).integers(
            0, shape.num_experts, size=(count, shape.num_layers, shape.top_k)
        )
        gens.append(
            _RouteGeneration(
                token_ids=_np.arange(generated, dtype=_np.int64) % batch.vocab_size,
                logprobs=None,
                finish_reason="length",
                routed_experts=_RoutedExperts(shape, ids.astype(dtype)),
            )
        )
    return RoutedCase(batch, shape, gens)
