"""The codec's loops run uncompiled against the core's numpy codec: the encode loop writes
the columns of ``encode_delta``'s wire form, the tables and gap checks refuse what
``decode_delta`` refuses, and the apply loop makes the new bits of the old; their drivers
(``encode_wire``, ``apply_wire_into`` over :data:`PLAIN`) agree with the codec byte for
byte and refusal for refusal, and are the numpy codec given no loops."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import BitsPair, delta_chunk_elements, delta_pairs

from genworker.core.delta import (
    HEADER_BYTES,
    MAX_CHUNK_ELEMENTS,
    Bits,
    DeltaError,
    apply_delta_into,
    bits_hash,
    chunk_count,
    decode_delta,
    decode_tables,
    encode_delta,
    encode_full,
)
from genworker.core.delta_loops import (
    PLAIN,
    Loops,
    apply_loop,
    apply_wire_into,
    check_loop,
    encode_loop,
    encode_wire,
    piece_hash,
    tables_loop,
    warm_up,
)

_NO_WORDS = np.empty(0, dtype=np.uint64)


def _words(bits: Bits) -> npt.NDArray[np.uint64]:
    """``bits``' whole 64-bit words, as the shell hands them to the loop (none for 8-byte
    elements or a buffer off an 8-byte boundary)."""
    per = 8 // bits.itemsize
    whole = len(bits) // per * per
    if per == 1 or bits.ctypes.data % 8 or not whole:
        return _NO_WORDS
    return bits[:whole].view(np.uint64)


@given(delta_pairs(), delta_chunk_elements, st.booleans())
def test_the_loops_agree_with_the_numpy_codec(pair: BitsPair, chunk: int, words: bool) -> None:
    old, new = pair.old, pair.new
    numel, n_chunks = len(new), chunk_count(len(new), chunk)
    kinds, counts = np.empty(n_chunks, dtype=np.uint8), np.empty(n_chunks, dtype=np.uint32)
    gaps = np.empty(numel, dtype=np.uint16)
    values, blocks = np.empty(numel, dtype=new.dtype), np.empty(numel, dtype=new.dtype)
    old_words, new_words = (_words(old), _words(new)) if words else (_NO_WORDS, _NO_WORDS)
    if len(old_words) != len(new_words):
        old_words = new_words = _NO_WORDS
    encode = encode_loop(8 // new.itemsize)
    columns = (kinds, counts, gaps, values, blocks)
    entries, dense = encode(old, new, old_words, new_words, chunk, *columns)
    expected = decode_tables(encode_delta(old, new, chunk).to_bytes()).unwrap()
    assert np.array_equal(kinds, expected.kinds)
    assert np.array_equal(counts, expected.counts)
    assert np.array_equal(gaps[:entries], expected.gaps)
    assert np.array_equal(values[:entries], expected.values)
    assert np.array_equal(blocks[:dense], expected.blocks)
    assert tables_loop(kinds, counts, numel, chunk) == (entries, dense, True)
    assert check_loop(kinds, counts, gaps, numel, chunk) == 0
    target = old.copy()
    apply_loop(target, chunk, kinds, counts, gaps, values[:entries], blocks[:dense])
    assert np.array_equal(target, new)


@given(delta_pairs(), delta_chunk_elements)
def test_a_full_steps_raw_chunks_set_every_element(pair: BitsPair, chunk: int) -> None:
    t = decode_tables(encode_full(pair.new, chunk).to_bytes()).unwrap()
    counts = t.counts.astype(np.uint32)
    assert tables_loop(t.kinds, counts, t.numel, chunk) == (0, t.numel, True)
    target = pair.old.copy()
    apply_loop(target, chunk, t.kinds, counts, t.gaps, t.values, t.blocks)
    assert np.array_equal(target, pair.new)


@pytest.mark.parametrize(
    ("kinds", "counts"),
    [([3], [0]), ([0], [5]), ([1], [1]), ([2], [2])],
    ids=["unknown kind", "count past the chunk", "count on XOR", "count on RAW"],
)
def test_the_tables_loop_refuses_what_decode_tables_refuses(
    kinds: list[int], counts: list[int]
) -> None:
    k, c = np.array(kinds, dtype=np.uint8), np.array(counts, dtype=np.uint32)
    assert tables_loop(k, c, 4, 4) == (0, 0, False)


@pytest.mark.parametrize(("gaps", "problem"), [([1, 0], 1), ([1, 3], 2), ([4], 2), ([0, 1, 2], 0)])
def test_the_gap_check_finds_repeats_and_changes_past_the_chunk(
    gaps: list[int], problem: int
) -> None:
    kinds = np.array([0, 1], dtype=np.uint8)  # a sparse chunk of 4, then a dense one
    counts = np.array([len(gaps), 0], dtype=np.uint32)
    assert check_loop(kinds, counts, np.array(gaps, dtype=np.uint16), 6, 4) == problem


def _offset(bits: Bits, by: int) -> Bits:
    """The same values at another address (``by`` elements into a larger array)."""
    out = np.empty(len(bits) + by, dtype=bits.dtype)
    out[by:] = bits
    view: Bits = out[by:]
    return view


_RAMP = np.arange(64, dtype=np.uint16)


@given(delta_pairs(), delta_chunk_elements, st.integers(0, 7), st.booleans())
@example(BitsPair(_RAMP, _RAMP ^ np.uint16(1)), 16, 4, False)  # old on words, new off them
def test_the_drivers_are_the_codec_byte_for_byte(
    pair: BitsPair, chunk: int, by: int, full: bool
) -> None:
    old, new = _offset(pair.old, by), _offset(pair.new, by % 3)
    wire = encode_wire(PLAIN, old, new, chunk)
    assert wire == encode_delta(pair.old, pair.new, chunk).to_bytes()
    data = encode_full(pair.new, chunk).to_bytes() if full else wire
    for shift in (0, 1):  # the columns at an odd offset of the buffer: copied aligned
        target = pair.old.copy()
        result = apply_wire_into(PLAIN, target, memoryview(bytes(shift) + data)[shift:])
        assert isinstance(result, Success), result
        assert np.array_equal(target, pair.new)


def _core_apply(target: Bits, data: bytes) -> Failure[DeltaError] | None:
    decoded = decode_delta(data)
    if isinstance(decoded, Failure):
        return decoded
    applied = apply_delta_into(target, decoded.unwrap())
    return applied if isinstance(applied, Failure) else None


@given(delta_pairs(max_numel=100), st.sampled_from([1, 3, 8, 64]), st.data())
def test_a_damaged_buffer_gets_the_codecs_verdict_and_leaves_the_target(
    pair: BitsPair, chunk: int, data: st.DataObject
) -> None:
    wire = bytearray(encode_wire(PLAIN, pair.old, pair.new, chunk))
    how = data.draw(st.sampled_from(["flip", "cut", "extend"]))
    if how == "flip" and wire:
        for _ in range(data.draw(st.integers(1, 3))):
            wire[data.draw(st.integers(0, len(wire) - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "cut":
        wire = wire[: data.draw(st.integers(0, len(wire)))]
    else:
        wire += data.draw(st.binary(min_size=1, max_size=6))
    ours, theirs = pair.old.copy(), pair.old.copy()
    result = apply_wire_into(PLAIN, ours, bytes(wire))
    expected = _core_apply(theirs, bytes(wire))
    if expected is None:
        assert isinstance(result, Success), result
    else:
        assert isinstance(result, Failure), result
        assert result.failure() == expected.failure()
        assert np.array_equal(ours, pair.old)
    assert np.array_equal(ours, theirs)


def _damaged(how: str) -> bytes:
    new = np.zeros(40, np.uint16)
    new[::9] = 1
    wire = bytearray(encode_wire(PLAIN, np.zeros(40, np.uint16), new, 16))
    if how == "short":
        return bytes(wire[:10])
    if how == "magic":
        wire[0] ^= 1
    elif how == "kind":
        wire[HEADER_BYTES] = 7
    else:
        wire += b"\0"
    return bytes(wire)


@pytest.mark.parametrize("how", ["short", "magic", "kind", "longer"])
def test_each_damage_the_tables_loop_doubts_gets_the_codecs_refusal(how: str) -> None:
    data = _damaged(how)
    result = apply_wire_into(PLAIN, np.zeros(40, np.uint16), data)
    expected = decode_delta(data)
    assert isinstance(result, Failure)
    assert isinstance(expected, Failure)
    assert result.failure() == expected.failure()


@pytest.mark.parametrize(
    ("gaps", "message"),
    [([1, 0], "positions in a chunk repeat"), ([1, 3], "a change lies past its chunk's end")],
)
def test_bad_gaps_are_the_codecs_refusal(gaps: list[int], message: str) -> None:
    new = np.zeros(4, np.uint32)
    new[1:3] = 1
    wire = bytearray(encode_wire(PLAIN, np.zeros(4, np.uint32), new))  # one sparse chunk
    at = len(wire) - 2 * (2 + 4)  # its two gaps, then its two values
    wire[at : at + 4] = np.array(gaps, dtype="<u2").tobytes()
    result = apply_wire_into(PLAIN, np.zeros(4, np.uint32), bytes(wire))
    assert isinstance(result, Failure)
    assert result.failure() == DeltaError(f"invalid delta: {message}", field="positions")


def test_a_target_of_another_width_or_length_is_refused_untouched() -> None:
    old = np.arange(10, dtype=np.uint16)
    data = encode_wire(PLAIN, old, old + 1, 4)
    for target in (np.zeros(9, dtype=np.uint16), np.zeros(10, dtype=np.uint32)):
        result = apply_wire_into(PLAIN, target, data)
        assert isinstance(result, Failure)
        assert result.failure().field == "target"
        assert not target.any()


def test_encode_wire_refuses_what_encode_delta_refuses() -> None:
    a = np.zeros(4, dtype=np.uint16)
    with pytest.raises(ValueError, match="alike"):
        encode_wire(PLAIN, a, np.zeros(5, dtype=np.uint16))
    with pytest.raises(ValueError, match="chunk_elements"):
        encode_wire(PLAIN, a, a, MAX_CHUNK_ELEMENTS + 1)


@given(st.integers(0, 9000), st.integers(0, 7), st.sampled_from([1, 2, 4, 8]), st.integers(0, 9))
@example(8192, 0, 8, 0)  # exactly one whole block
@example(2 * 8192 + 5, 3, 1, 1)  # two whole blocks and a tail, off the boundary
def test_the_hash_loop_is_bits_hash(nbytes: int, by: int, itemsize: int, seed: int) -> None:
    """Whole blocks of 1024 words and a short last one, a tail of fewer than 8 bytes, and
    words off an 8-byte boundary (copied aligned for the loop)."""
    raw = np.random.default_rng(seed).integers(0, 256, nbytes + by + 8, dtype=np.uint8)
    bits = raw[by : by + nbytes // itemsize * itemsize].view(f"u{itemsize}")
    with np.errstate(over="ignore"):  # the loop's arithmetic is mod 2**64 on purpose
        assert piece_hash(PLAIN, bits) == bits_hash(bits)


@given(delta_pairs(max_numel=300), delta_chunk_elements)
def test_without_loops_the_drivers_are_the_numpy_codec(pair: BitsPair, chunk: int) -> None:
    """No numba (or a big-endian host): the same bytes, hash, result and refusals."""
    data = encode_wire(None, pair.old, pair.new, chunk)
    assert data == encode_delta(pair.old, pair.new, chunk).to_bytes()
    assert piece_hash(None, pair.new) == bits_hash(pair.new)
    target = pair.old.copy()
    assert isinstance(apply_wire_into(None, target, data), Success)
    assert np.array_equal(target, pair.new)
    refused = apply_wire_into(None, target, data[:-1])
    assert isinstance(refused, Failure)
    assert refused == decode_delta(data[:-1])


def test_warm_up_runs_each_width_and_both_alignments_of_the_blocks() -> None:
    encoded: list[int] = []
    blocks: list[bool] = []

    def apply(target: Bits, chunk: int, *columns: Bits) -> None:
        blocks.append(bool(columns[-1].flags.aligned))
        PLAIN.apply(target, chunk, *columns)  # type: ignore[arg-type]

    def encoder(size: int) -> object:
        def encode(*args: object) -> tuple[int, int]:
            encoded.append(size)
            return PLAIN.encoders[size](*args)  # type: ignore[arg-type]

        return encode

    encoders = {size: encoder(size) for size in PLAIN.encoders}
    counting = Loops(encoders, PLAIN.tables, PLAIN.check, apply, PLAIN.hash)  # type: ignore[arg-type]
    with np.errstate(over="ignore"):  # the hash loop's arithmetic is mod 2**64 on purpose
        warm_up(counting, [4, 1, 1])
    assert encoded == [1, 4]
    assert set(blocks) == {False, True}  # the dense blocks aligned and not
    warm_up(None)  # nothing to run
