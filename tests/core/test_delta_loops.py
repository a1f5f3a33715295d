"""The codec's loops run uncompiled against the core's numpy codec: the encode loop writes
the columns of ``encode_delta``'s wire form, the tables and gap checks refuse what
``decode_delta`` refuses, and the apply loop makes the new bits of the old."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import BitsPair, delta_chunk_elements, delta_pairs

from genworker.core.delta import Bits, chunk_count, decode_tables, encode_delta, encode_full
from genworker.core.delta_loops import apply_loop, check_loop, encode_loop, tables_loop

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
