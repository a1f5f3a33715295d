"""The compiled codec loops agree with the core's numpy codec on every input."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import BitsPair, delta_chunk_elements, delta_pairs

from genworker.core.delta import (
    MAX_CHUNK_ELEMENTS,
    Bits,
    DeltaError,
    apply_delta_into,
    bits_hash,
    decode_delta,
    encode_delta,
    encode_full,
)
from genworker.shell import delta_kernels
from genworker.shell.delta_kernels import (
    apply_wire_into,
    compiled,
    encode_wire,
    piece_hash,
    warm_up,
)


def test_the_loops_are_compiled_here() -> None:
    """numba comes with vLLM: the laws below are about the compiled loops, not the fallback."""
    assert compiled()


def _offset(bits: Bits, by: int) -> Bits:
    """The same values at another address (``by`` elements into a larger array)."""
    out = np.empty(len(bits) + by, dtype=bits.dtype)
    out[by:] = bits
    view: Bits = out[by:]
    return view


@given(delta_pairs(max_numel=600), delta_chunk_elements, st.integers(0, 7))
def test_encode_wire_is_the_core_wire_form_byte_for_byte(
    pair: BitsPair, chunk: int, by: int
) -> None:
    old, new = _offset(pair.old, by), _offset(pair.new, by % 3)
    assert encode_wire(old, new, chunk) == encode_delta(pair.old, pair.new, chunk).to_bytes()


@given(delta_pairs(max_numel=600), delta_chunk_elements, st.booleans())
def test_apply_wire_reproduces_the_new_bits(pair: BitsPair, chunk: int, full: bool) -> None:
    data = (
        encode_full(pair.new, chunk).to_bytes() if full else encode_wire(pair.old, pair.new, chunk)
    )
    target = pair.old.copy()
    result = apply_wire_into(target, data)
    assert isinstance(result, Success), result
    assert target.dtype == pair.new.dtype
    assert np.array_equal(target, pair.new)


def _core_apply(target: Bits, data: bytes) -> Failure[DeltaError] | None:
    decoded = decode_delta(data)
    if isinstance(decoded, Failure):
        return decoded
    applied = apply_delta_into(target, decoded.unwrap())
    return applied if isinstance(applied, Failure) else None


@given(delta_pairs(max_numel=200), st.sampled_from([1, 3, 8, 64]), st.data())
def test_a_damaged_buffer_gets_the_cores_verdict_and_leaves_the_target(
    pair: BitsPair, chunk: int, data: st.DataObject
) -> None:
    """Flipped, cut or extended bytes: refused exactly when the core refuses (same field,
    same message), the target untouched then; otherwise the core's result."""
    wire = bytearray(encode_wire(pair.old, pair.new, chunk))
    how = data.draw(st.sampled_from(["flip", "cut", "extend"]))
    if how == "flip" and wire:
        for _ in range(data.draw(st.integers(1, 3))):
            wire[data.draw(st.integers(0, len(wire) - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "cut":
        wire = wire[: data.draw(st.integers(0, len(wire)))]
    else:
        wire += data.draw(st.binary(min_size=1, max_size=6))
    ours, theirs = pair.old.copy(), pair.old.copy()
    result = apply_wire_into(ours, bytes(wire))
    expected = _core_apply(theirs, bytes(wire))
    if expected is None:
        assert isinstance(result, Success), result
    else:
        assert isinstance(result, Failure), result
        assert result.failure() == expected.failure()
        assert np.array_equal(ours, pair.old)
    assert np.array_equal(ours, theirs)


def test_a_target_of_another_width_or_length_is_refused_untouched() -> None:
    old = np.arange(10, dtype=np.uint16)
    data = encode_wire(old, old + 1, 4)
    for target in (np.zeros(9, dtype=np.uint16), np.zeros(10, dtype=np.uint32)):
        result = apply_wire_into(target, data)
        assert isinstance(result, Failure)
        assert result.failure().field == "target"
        assert not target.any()


def test_encode_wire_refuses_what_encode_delta_refuses() -> None:
    a = np.zeros(4, dtype=np.uint16)
    with pytest.raises(ValueError, match="alike"):
        encode_wire(a, np.zeros(5, dtype=np.uint16))
    with pytest.raises(ValueError, match="chunk_elements"):
        encode_wire(a, a, MAX_CHUNK_ELEMENTS + 1)


@given(st.integers(0, 40_000), st.integers(0, 7), st.sampled_from([1, 2, 4, 8]), st.integers())
def test_piece_hash_is_bits_hash(nbytes: int, by: int, itemsize: int, seed: int) -> None:
    """At any address and width, across block boundaries and with any tail."""
    nbytes -= nbytes % itemsize
    raw = np.random.default_rng(abs(seed)).integers(0, 256, nbytes + by, dtype=np.uint8)[by:]
    bits = raw.view(f"u{itemsize}") if by % itemsize == 0 else raw.copy().view(f"u{itemsize}")
    assert piece_hash(bits) == bits_hash(bits)


@given(delta_pairs(max_numel=300), delta_chunk_elements)
def test_without_numba_the_core_codec_gives_the_same(pair: BitsPair, chunk: int) -> None:
    """The fallback (no numba, or a big-endian host) is the core's numpy codec."""
    compiled = (encode_wire(pair.old, pair.new, chunk), piece_hash(pair.new))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(delta_kernels, "_kernels", lambda: None)
        data = encode_wire(pair.old, pair.new, chunk)
        assert (data, piece_hash(pair.new)) == compiled
        target = pair.old.copy()
        assert isinstance(apply_wire_into(target, data), Success)
        assert np.array_equal(target, pair.new)
        assert isinstance(apply_wire_into(target, data[:-1]), Failure)
        warm_up()  # nothing to load


def test_vllms_module_scan_survives_numba() -> None:
    """vLLM's CPU platform reads ``vars(v).get('kernel')`` of every module global with a
    ``__dict__`` when an engine starts; llvmlite's ``lib`` broke that (see
    ``_shield_llvmlite_lib``)."""
    assert compiled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated module attributes, read as vLLM does
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            for value in list((namespace or {}).values()):
                if hasattr(value, "__dict__"):
                    vars(value).get("kernel")
