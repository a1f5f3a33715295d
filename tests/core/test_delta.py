"""Laws of the sparse-delta codec, its framing plan and the relay tree."""

from __future__ import annotations

import itertools
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import (
    DELTA_DTYPES,
    BitsPair,
    delta_chunk_elements,
    delta_pairs,
    delta_specs,
    relay_receivers,
)

from genworker.core.delta import (
    CHUNK_HEADER_BYTES,
    HASH_BLOCK_WORDS,
    HASH_KEYS,
    HASH_MULTIPLIERS,
    HEADER_BYTES,
    MAX_CHUNK_ELEMENTS,
    Bits,
    ChunkKind,
    DeltaError,
    NodeResult,
    Outcome,
    RelayFailure,
    RelayPlan,
    RelayReport,
    TensorDelta,
    apply_delta,
    apply_delta_into,
    bit_pattern,
    bits_dtype,
    bits_hash,
    chunk_count,
    conclude_relay,
    decode_delta,
    decode_tables,
    encode_delta,
    encode_full,
    hash_mix,
    header_bytes,
    plan_frames,
    plan_relay,
    relay_depth,
    report_subtree,
    tensor_checksum,
)
from genworker.core.refit_plan import DTYPE_ITEMSIZE, TensorSpec


def _applied(old: Bits, delta: TensorDelta) -> Bits:
    result = apply_delta(old, delta)
    assert isinstance(result, Success), result
    out: Bits = result.unwrap()
    return out


def _decoded(data: bytes) -> TensorDelta:
    result = decode_delta(data)
    assert isinstance(result, Success), result
    delta: TensorDelta = result.unwrap()
    return delta


def _refused(result: object, field: str) -> DeltaError:
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, DeltaError)
    assert error.field == field, error
    return error


# -- the codec ------------------------------------------------------------------------


@given(delta_pairs(), delta_chunk_elements)
def test_apply_of_encode_gives_the_new_bits(pair: BitsPair, chunk: int) -> None:
    old_before = pair.old.copy()
    delta = encode_delta(pair.old, pair.new, chunk)
    out = _applied(pair.old, delta)
    assert out.dtype == pair.new.dtype
    assert np.array_equal(out, pair.new)
    assert np.array_equal(pair.old, old_before)  # apply_delta leaves its input alone


@given(delta_pairs(), delta_chunk_elements)
def test_the_wire_form_round_trips_and_applies(pair: BitsPair, chunk: int) -> None:
    delta = encode_delta(pair.old, pair.new, chunk)
    data = delta.to_bytes()
    back = _decoded(data)
    assert back == delta
    assert np.array_equal(_applied(pair.old, back), pair.new)


@given(delta_pairs(), delta_chunk_elements)
def test_encoded_size_is_at_most_the_tensor_plus_the_header(pair: BitsPair, chunk: int) -> None:
    delta = encode_delta(pair.old, pair.new, chunk)
    n_chunks = chunk_count(len(pair.new), chunk)
    assert len(delta.to_bytes()) == delta.encoded_size()
    assert delta.encoded_size() <= pair.new.nbytes + header_bytes(n_chunks)
    assert header_bytes(n_chunks) == HEADER_BYTES + CHUNK_HEADER_BYTES * n_chunks


@given(delta_pairs(), delta_chunk_elements)
def test_each_chunk_takes_the_smaller_form(pair: BitsPair, chunk: int) -> None:
    delta = encode_delta(pair.old, pair.new, chunk)
    counts = delta.counts()
    for j in range(delta.n_chunks):
        start, stop = delta.chunk_range(j)
        changed = int(np.count_nonzero(pair.old[start:stop] != pair.new[start:stop]))
        sparse_cost = changed * (2 + pair.new.itemsize)
        dense_cost = (stop - start) * pair.new.itemsize
        if sparse_cost <= dense_cost:
            assert delta.kinds[j] == ChunkKind.SPARSE
            assert counts[j] == changed
        else:
            assert delta.kinds[j] == ChunkKind.XOR
            assert counts[j] == 0


@given(delta_pairs(), delta_chunk_elements)
def test_a_full_delta_sets_every_bit_over_any_baseline(pair: BitsPair, chunk: int) -> None:
    delta = encode_full(pair.new, chunk)
    assert set(delta.kinds.tolist()) <= {ChunkKind.RAW}
    assert np.array_equal(_applied(pair.old, _decoded(delta.to_bytes())), pair.new)
    assert delta.encoded_size() == pair.new.nbytes + header_bytes(delta.n_chunks)


def test_an_unchanged_tensor_costs_only_its_header() -> None:
    bits = np.arange(1000, dtype=np.uint16)
    delta = encode_delta(bits, bits.copy(), 256)
    assert delta.encoded_size() == header_bytes(4)
    assert (delta.kinds == ChunkKind.SPARSE).all()


@given(
    st.sampled_from(DELTA_DTYPES),
    st.lists(st.integers(1, 12), min_size=0, max_size=3),
    st.integers(0, 2**31),
    st.floats(0.0, 1.0),
)
def test_torch_tensors_of_every_refit_dtype_round_trip_bit_for_bit(
    dtype_name: str, shape: list[int], seed: int, density: float
) -> None:
    """From real torch tensors (NaN payloads and signed zeros included) through the bits."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    raw = torch.randint(
        0, 256, (numel * DTYPE_ITEMSIZE[dtype_name],), dtype=torch.uint8, generator=g
    )
    old = raw.view(dtype).reshape(shape)
    mask = (torch.rand(numel, generator=g) < density).numpy()
    fresh = torch.randn(numel, generator=g).to(dtype)  # real values of the dtype
    new_bits = np.where(mask, bit_pattern(fresh), bit_pattern(old.contiguous()))
    new = torch.from_numpy(new_bits.view(np.uint8).copy()).view(dtype).reshape(shape)
    target = old.clone()
    bits = bit_pattern(target)
    assert bits.itemsize == DTYPE_ITEMSIZE[dtype_name]
    delta = _decoded(encode_delta(bit_pattern(old), bit_pattern(new), 7).to_bytes())
    assert isinstance(apply_delta_into(bits, delta), Success)
    assert np.array_equal(bit_pattern(target), new_bits)  # written through the view
    assert tensor_checksum(bit_pattern(target)) == tensor_checksum(bit_pattern(new))


def test_bit_pattern_refuses_a_non_contiguous_tensor() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        bit_pattern(torch.zeros(4, 4).t())


def test_bit_pattern_of_an_empty_tensor_is_empty() -> None:
    bits = bit_pattern(torch.zeros(0, 3, dtype=torch.bfloat16))
    assert bits.dtype == np.uint16
    assert len(bits) == 0


@given(delta_pairs(), st.integers(1, 5))
def test_the_checksum_of_pieces_runs_to_the_whole(pair: BitsPair, parts: int) -> None:
    cuts = np.array_split(pair.new, parts)
    running = 0
    for part in cuts:
        running = tensor_checksum(part, running)
    assert running == tensor_checksum(pair.new)


def test_the_checksum_sees_a_single_flipped_bit() -> None:
    bits = np.zeros(1 << 12, dtype=np.uint16)
    flipped = bits.copy()
    flipped[1000] ^= 1 << 3
    assert tensor_checksum(bits) != tensor_checksum(flipped)


def test_encode_refuses_unlike_arrays_and_bad_chunk_sizes() -> None:
    a = np.zeros(4, dtype=np.uint16)
    with pytest.raises(ValueError, match="alike"):
        encode_delta(a, np.zeros(5, dtype=np.uint16))
    with pytest.raises(ValueError, match="alike"):
        encode_delta(a, np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match="chunk_elements"):
        encode_delta(a, a, MAX_CHUNK_ELEMENTS + 1)
    with pytest.raises(ValueError, match="chunk_elements"):
        encode_full(a, 0)


def test_apply_refuses_a_target_of_the_wrong_shape_and_leaves_it_alone() -> None:
    old = np.arange(10, dtype=np.uint16)
    delta = encode_delta(old, old + 1, 4)
    for target in (
        np.zeros(9, dtype=np.uint16),
        np.zeros(10, dtype=np.uint32),
        np.zeros((10, 1), dtype=np.uint16),
    ):
        before = target.copy()
        error = _refused(apply_delta_into(target, delta), "target")
        assert "cannot apply" in str(error)
        assert np.array_equal(target, before)


def test_bits_dtype_has_the_width_asked_for() -> None:
    for itemsize in (1, 2, 4, 8):
        assert bits_dtype(itemsize).itemsize == itemsize
        assert bits_dtype(itemsize).kind == "u"


# -- decoding refuses every malformed buffer ------------------------------------------


def _sample() -> bytes:
    old = np.zeros(20, dtype=np.uint16)
    new = old.copy()
    new[[1, 5, 6]] = 7  # chunks 0 and 1 sparse
    new[8:12] = 9  # chunk 2 dense (4 changes of 4 elements)
    return encode_delta(old, new, 4).to_bytes()


def _header(data: bytes, **fields: int | bytes) -> bytes:
    magic, itemsize, chunk, numel, n_chunks = struct.unpack_from("<4sBIQI", data)
    values = {
        "magic": magic,
        "itemsize": itemsize,
        "chunk": chunk,
        "numel": numel,
        "n_chunks": n_chunks,
    }
    values.update(fields)
    head = struct.pack("<4sBIQI", *values.values())
    return head + data[HEADER_BYTES:]


def test_the_sample_decodes() -> None:
    delta = _decoded(_sample())
    assert delta.kinds.tolist() == [0, 0, 1, 0, 0]
    assert delta.positions.tolist() == [1, 5, 6]


@given(st.data())
def test_any_truncation_or_extension_is_refused(data: st.DataObject) -> None:
    sample = _sample()
    cut = data.draw(st.integers(0, len(sample) - 1))
    assert isinstance(decode_delta(sample[:cut]), Failure)
    extra = data.draw(st.binary(min_size=1, max_size=8))
    _refused(decode_delta(sample + extra), "length")


def test_header_fields_are_checked() -> None:
    sample = _sample()
    _refused(decode_delta(_header(sample, magic=b"XXXX")), "magic")
    _refused(decode_delta(_header(sample, itemsize=3)), "itemsize")
    _refused(decode_delta(_header(sample, chunk=0)), "chunk_elements")
    _refused(decode_delta(_header(sample, chunk=MAX_CHUNK_ELEMENTS + 1)), "chunk_elements")
    _refused(decode_delta(_header(sample, n_chunks=4)), "n_chunks")
    _refused(decode_delta(sample[: HEADER_BYTES + 3]), "chunks")
    _refused(decode_delta(sample[:5]), "header")


def _tables(data: bytes, kinds: list[int], counts: list[int]) -> bytes:
    n = len(kinds)
    return (
        data[:HEADER_BYTES]
        + bytes(kinds)
        + np.array(counts, dtype="<u4").tobytes()
        + data[HEADER_BYTES + CHUNK_HEADER_BYTES * n :]
    )


def test_chunk_tables_are_checked() -> None:
    sample = _sample()
    assert _decoded(_tables(sample, [0, 0, 1, 0, 0], [1, 2, 0, 0, 0])) == _decoded(sample)
    _refused(decode_delta(_tables(sample, [0, 0, 7, 0, 0], [1, 2, 0, 0, 0])), "kinds")
    _refused(decode_delta(_tables(sample, [0, 0, 1, 0, 0], [1, 2, 1, 0, 0])), "counts")
    _refused(decode_delta(_tables(sample, [0, 0, 1, 0, 0], [5, 2, 0, 0, 0])), "counts")
    _refused(decode_delta(_tables(sample, [0, 0, 1, 0, 0], [1, 2, 0, 1, 0])), "length")


def _gaps(data: bytes, gaps: list[int]) -> bytes:
    at = HEADER_BYTES + CHUNK_HEADER_BYTES * 5
    return data[:at] + np.array(gaps, dtype="<u2").tobytes() + data[at + 2 * len(gaps) :]


def test_positions_are_checked() -> None:
    sample = _sample()
    assert _decoded(_gaps(sample, [1, 1, 1])).positions.tolist() == [1, 5, 6]
    assert _decoded(_gaps(sample, [3, 0, 3])).positions.tolist() == [3, 4, 7]
    _refused(decode_delta(_gaps(sample, [1, 1, 0])), "positions")  # a repeat
    _refused(decode_delta(_gaps(sample, [1, 1, 3])), "positions")  # past its chunk
    _refused(decode_delta(_gaps(sample, [4, 1, 1])), "positions")


# -- frames ---------------------------------------------------------------------------


@given(delta_specs(), st.integers(1, 400), delta_chunk_elements)
def test_frames_cut_every_tensor_into_ordered_chunk_aligned_pieces(
    specs: list[TensorSpec], frame_bytes: int, chunk: int
) -> None:
    frames = plan_frames(specs, frame_bytes, chunk)
    pieces = [p for f in frames for p in f]
    assert all(frames)
    for spec in specs:
        mine = [p for p in pieces if p.name == spec.name]
        assert mine[0].start == 0
        assert mine[-1].stop == spec.numel
        assert [p.last for p in mine] == [False] * (len(mine) - 1) + [True]
        for a, b in itertools.pairwise(mine):
            assert a.stop == b.start
        assert all(p.start % chunk == 0 for p in mine)
        assert all(p.stop > p.start for p in mine) or spec.numel == 0
    assert [p.name for p in pieces if p.last] == [s.name for s in specs]
    itemsize = {s.name: DTYPE_ITEMSIZE[s.dtype] for s in specs}
    for frame in frames:
        size = sum((p.stop - p.start) * itemsize[p.name] for p in frame)
        nonempty = [p for p in frame if p.stop > p.start]
        single_chunk = len(nonempty) == 1 and nonempty[0].stop - nonempty[0].start <= chunk
        assert size <= frame_bytes or single_chunk


def test_frame_planning_refuses_a_non_positive_budget() -> None:
    with pytest.raises(ValueError, match="frame_bytes"):
        plan_frames([], 0)


def test_pieces_encode_and_apply_to_the_whole() -> None:
    rng = np.random.default_rng(0)
    old = rng.integers(0, 1 << 16, 1000, dtype=np.uint16)
    new = old.copy()
    new[rng.random(1000) < 0.2] += 1
    spec = TensorSpec("w", (1000,), "bfloat16")
    target = old.copy()
    frames = plan_frames([spec], 300, 16)
    assert len(frames) > 1
    for frame in frames:
        for piece in frame:
            part = slice(piece.start, piece.stop)
            delta = _decoded(encode_delta(old[part], new[part], 16).to_bytes())
            assert isinstance(apply_delta_into(target[part], delta), Success)
    assert np.array_equal(target, new)


# -- the relay tree -------------------------------------------------------------------


def _plan(names: list[str], fanout: int) -> RelayPlan:
    result = plan_relay(names, fanout)
    assert isinstance(result, Success), result
    plan: RelayPlan = result.unwrap()
    return plan


@given(relay_receivers())
def test_every_receiver_gets_every_payload_exactly_once(case: tuple[list[str], int]) -> None:
    names, fanout = case
    plan = _plan(names, fanout)
    deliveries = [0] * len(names)
    deliveries[0] += 1  # the sender's one copy goes to the root
    frontier = [0]
    while frontier:
        node = frontier.pop()
        for child in plan.children(node):
            deliveries[child] += 1
            frontier.append(child)
    assert deliveries == [1] * len(names)
    assert all(len(plan.children(n)) <= fanout for n in range(len(names)))
    assert all(plan.parent(c) == n for n in range(len(names)) for c in plan.children(n))
    assert plan.parent(0) is None
    assert sorted(plan.subtree(0)) == list(range(len(names)))


@given(relay_receivers(max_receivers=400))
def test_depth_is_the_closed_form_and_minimal(case: tuple[list[str], int]) -> None:
    names, k = case
    n = len(names)
    plan = _plan(names, k)
    assert plan.depth == relay_depth(n, k)
    if k == 1:
        assert plan.depth == n
    else:
        # L = ceil(log_k((k-1)n + 1)), exactly: the least L with k**L >= (k-1)n + 1
        exact = next(levels for levels in range(n + 1) if k**levels >= (k - 1) * n + 1)
        assert plan.depth == exact
        ceil_log = next(c for c in range(n + 1) if k**c >= n)  # ceil(log_k n)
        assert ceil_log <= plan.depth <= ceil_log + 1
    # minimal: depth-1 levels of fanout k hold fewer than n receivers
    assert sum(k**i for i in range(plan.depth - 1)) < n


@given(relay_receivers(), st.floats(0.01, 100))
def test_bounds_nest_by_one_hop_per_level(case: tuple[list[str], int], hop: float) -> None:
    plan = _plan(*case)
    for node in range(len(plan.receivers)):
        for child in plan.children(node):
            outer = plan.answer_bound_s(node, hop)
            assert outer >= plan.answer_bound_s(child, hop) + hop * (1 - 1e-9)
    assert plan.answer_bound_s(0, hop) == pytest.approx(hop * plan.depth)


def _simulate(
    plan: RelayPlan, dead: set[int], refusing: set[int], hop: float
) -> RelayReport | None:
    def answer(node: int) -> RelayReport | None:
        if node in dead:
            return None
        name = plan.receivers[node]
        own = (
            NodeResult(name, Outcome.REFUSED, "checksum")
            if node in refusing
            else NodeResult(name, Outcome.APPLIED)
        )
        return report_subtree(plan, node, own, {c: answer(c) for c in plan.children(node)}, hop)

    return answer(0)


@given(relay_receivers(), st.data())
def test_a_failure_names_every_failed_receiver_and_only_those(
    case: tuple[list[str], int], data: st.DataObject
) -> None:
    plan = _plan(*case)
    n = len(plan.receivers)
    dead = set(data.draw(st.lists(st.integers(0, n - 1), max_size=3)))
    refusing = set(data.draw(st.lists(st.integers(0, n - 1), max_size=3))) - dead
    verdict = conclude_relay(plan, _simulate(plan, dead, refusing, 2.0), 2.0)

    def hidden(node: int) -> bool:  # below a silent receiver: nobody can report on it
        parent = plan.parent(node)
        return parent is not None and (parent in dead or hidden(parent))

    if not dead and not refusing:
        assert isinstance(verdict, Success)
        names = verdict.unwrap().names
        assert names[0] == plan.receivers[0]
        assert sorted(names) == sorted(plan.receivers)
        return
    assert isinstance(verdict, Failure)
    failure = verdict.failure()
    assert isinstance(failure, RelayFailure)
    expect_silent = {plan.receivers[i] for i in dead if not hidden(i)}
    expect_refused = {plan.receivers[i] for i in refusing if not hidden(i)}
    expect_unconfirmed = {plan.receivers[i] for i in range(n) if hidden(i)}
    assert set(failure.named(Outcome.SILENT)) == expect_silent
    assert set(failure.named(Outcome.REFUSED)) == expect_refused
    assert set(failure.named(Outcome.UNCONFIRMED)) == expect_unconfirmed
    assert len(failure.names) == len(set(failure.names))
    assert all(r.outcome is not Outcome.APPLIED for r in failure.results)


def test_a_silent_child_is_named_with_its_bound() -> None:
    plan = _plan(["a", "b", "c", "d"], 2)
    failure = conclude_relay(plan, _simulate(plan, {1}, set(), 1.5), 1.5).failure()
    assert isinstance(failure, RelayFailure)
    assert failure.named(Outcome.SILENT) == ("b",)
    assert failure.named(Outcome.UNCONFIRMED) == ("d",)
    assert "'b' silent: did not answer within 3 s" in str(failure)  # b's height is 2
    root_silent = conclude_relay(plan, None, 1.5).failure()
    assert isinstance(root_silent, RelayFailure)
    assert "'a' silent: did not answer within 4.5 s" in str(root_silent)
    assert set(root_silent.named(Outcome.UNCONFIRMED)) == {"b", "c", "d"}


def test_a_report_for_the_wrong_receivers_counts_as_a_refusal() -> None:
    plan = _plan(["a", "b", "c"], 1)
    liar = RelayReport((NodeResult("b", Outcome.APPLIED), NodeResult("x", Outcome.APPLIED)))
    report = report_subtree(plan, 0, NodeResult("a", Outcome.APPLIED), {1: liar}, 1.0)
    failure = conclude_relay(plan, report, 1.0).failure()
    assert isinstance(failure, RelayFailure)
    assert failure.named(Outcome.REFUSED) == ("b",)
    assert failure.named(Outcome.UNCONFIRMED) == ("c",)
    assert "answered for ['b', 'x']" in str(failure)
    wrong_root = RelayReport(tuple(NodeResult(x, Outcome.APPLIED) for x in ("b", "a", "c")))
    refused = conclude_relay(plan, wrong_root, 1.0).failure()
    assert isinstance(refused, RelayFailure)
    assert refused.named(Outcome.REFUSED) == ("a",)


def test_a_long_failure_message_is_cut() -> None:
    plan = _plan([f"r{i}" for i in range(30)], 30)
    report = report_subtree(plan, 0, NodeResult("r0", Outcome.APPLIED), {}, 1.0)
    failure = conclude_relay(plan, report, 1.0).failure()
    assert isinstance(failure, RelayFailure)
    assert len(failure.results) == 29
    assert "and 17 more" in str(failure)
    assert "applied by 1 of 30 receivers" in str(failure)


def test_relay_plans_refuse_bad_input() -> None:
    cases: list[tuple[list[str], object, str]] = [
        ([], 2, "at least one"),
        (["a", "a"], 2, "repeated: ['a']"),
        (["a", ""], 2, "invalid: ['']"),
        (["a"], 0, "fanout"),
        (["a"], True, "fanout"),
    ]
    for names, fanout, needle in cases:
        result = plan_relay(names, fanout)  # type: ignore[arg-type]
        assert isinstance(result, Failure), names
        assert needle in str(result.failure())
    assert relay_depth(0, 3) == 0
    assert _plan(["a", "b"], 1).index("b") == 1
    assert NodeResult("a", Outcome.APPLIED).describe() == "'a' applied"


# -- the pieces' hash -----------------------------------------------------------------


def test_the_hash_is_pinned() -> None:
    """Known answers: the sender's and the receivers' hash must never drift apart."""
    assert bits_hash(np.arange(3000, dtype=np.uint16)) == 0x2624416FAEED8953
    assert bits_hash(np.frombuffer(b"genworker", dtype=np.uint8)) == 0x2944C6731ED9AD40
    assert bits_hash(np.zeros(0, dtype=np.uint8)) == 0


def test_the_hash_covers_the_bytes_not_the_dtype() -> None:
    raw = np.random.default_rng(3).integers(0, 256, 4 * 2500, dtype=np.uint8)
    assert bits_hash(raw) == bits_hash(raw.view(np.uint16)) == bits_hash(raw.view(np.uint32))


def test_zero_padding_does_not_alias() -> None:
    """The length is hashed: trailing zero bytes, padded or not, give other hashes."""
    hashes = {bits_hash(np.zeros(n, dtype=np.uint8)) for n in range(0, 20)}
    assert len(hashes) == 20


@given(
    st.integers(1, 3 * HASH_BLOCK_WORDS * 8 + 17),
    st.integers(0, 2**32 - 1),
    st.data(),
)
def test_any_one_changed_element_changes_the_hash(
    nbytes: int, seed: int, data: st.DataObject
) -> None:
    """A changed word changes its block's sum (odd multipliers) and mixing is a bijection."""
    raw = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    at = data.draw(st.integers(0, nbytes - 1))
    flip = data.draw(st.integers(1, 255))
    changed = raw.copy()
    changed[at] ^= flip
    assert bits_hash(changed) != bits_hash(raw)


@given(st.integers(2, 3 * HASH_BLOCK_WORDS), st.integers(0, 2**32 - 1), st.data())
def test_moving_words_changes_the_hash(words: int, seed: int, data: st.DataObject) -> None:
    """Two different words swapped (within a block or across, a block apart included)."""
    raw = np.random.default_rng(seed).integers(0, 2**63, words, dtype=np.uint64)
    i = data.draw(st.integers(0, words - 1))
    j = data.draw(st.integers(0, words - 1).filter(lambda j: raw[j] != raw[i]))
    swapped = raw.copy()
    swapped[[i, j]] = raw[[j, i]]
    assert bits_hash(swapped) != bits_hash(raw)


def test_the_hash_keys_are_fixed_and_the_multipliers_odd() -> None:
    assert len(HASH_KEYS) == len(HASH_MULTIPLIERS) == HASH_BLOCK_WORDS
    assert bool(np.all(HASH_MULTIPLIERS & np.uint64(1)))
    assert len(set(HASH_KEYS.tolist())) == HASH_BLOCK_WORDS
    z = np.arange(1000, dtype=np.uint64)
    assert len(set(hash_mix(z).tolist())) == 1000  # a bijection: no collisions


@given(delta_pairs(), delta_chunk_elements)
def test_the_tables_are_the_deltas_columns(pair: BitsPair, chunk: int) -> None:
    delta = encode_delta(pair.old, pair.new, chunk)
    decoded = decode_tables(delta.to_bytes())
    assert isinstance(decoded, Success), decoded
    tables = decoded.unwrap()
    assert (tables.itemsize, tables.numel, tables.chunk_elements) == (
        delta.itemsize,
        delta.numel,
        chunk,
    )
    assert np.array_equal(tables.kinds, delta.kinds)
    assert np.array_equal(tables.counts, delta.counts())
    assert np.array_equal(tables.values, delta.values)
    assert np.array_equal(tables.blocks, delta.blocks)
    assert len(tables.gaps) == len(delta.positions)
