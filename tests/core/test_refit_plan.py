"""Laws of the refit packing plan and of the receiver's manifest checks."""

from __future__ import annotations

import itertools
import zlib

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import refit_budgets, refit_shapes, refit_specs

from genworker.core.refit_plan import (
    ALIGNMENT,
    DTYPE_ITEMSIZE,
    Bucket,
    Deviation,
    Manifest,
    ManifestError,
    ReceiveProgress,
    Slot,
    TensorSpec,
    align_up,
    broadcast_groups,
    bucket_budget,
    bucket_checksum,
    check_bucket,
    check_complete,
    dtype_name,
    plan_buckets,
)


def _receive_all(manifest: Manifest, buckets: list[Bucket]) -> ReceiveProgress:
    progress = ReceiveProgress()
    for bucket in buckets:
        progress = check_bucket(manifest, progress, bucket).unwrap()
    return check_complete(manifest, progress).unwrap()


def _error(result: object) -> ManifestError:
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, ManifestError)
    return error


# -- the packing plan -----------------------------------------------------------------


@given(refit_specs(), refit_budgets)
def test_every_spec_travels_once_in_input_order(specs: list[TensorSpec], budget: int) -> None:
    buckets = list(plan_buckets(specs, budget))
    assert [s.spec for b in buckets for s in b.slots] == specs
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert all(b.slots for b in buckets)


@given(refit_specs(), refit_budgets)
def test_slots_are_aligned_disjoint_and_fill_used_bytes(
    specs: list[TensorSpec], budget: int
) -> None:
    for bucket in plan_buckets(specs, budget):
        ends = 0
        for slot in bucket.slots:
            assert slot.offset % ALIGNMENT == 0
            assert slot.offset >= ends  # never overlaps the previous slot
            assert slot.nbytes == slot.spec.nbytes
            ends = slot.end
        assert bucket.used_bytes == sum(align_up(s.nbytes) for s in bucket.slots)
        assert bucket.used_bytes >= bucket.payload_bytes


@given(refit_specs(), refit_budgets)
def test_buckets_respect_the_budget_unless_one_oversized_tensor(
    specs: list[TensorSpec], budget: int
) -> None:
    for bucket in plan_buckets(specs, budget):
        if bucket.used_bytes > budget:
            assert len(bucket.slots) == 1
            assert bucket.used_bytes == align_up(bucket.slots[0].nbytes)


@given(refit_specs(), refit_budgets)
def test_buckets_alternate_between_two_buffers(specs: list[TensorSpec], budget: int) -> None:
    buffers = [b.buffer for b in plan_buckets(specs, budget)]
    assert buffers == [i % 2 for i in range(len(buffers))]


@given(refit_specs(min_size=1), refit_budgets)
def test_a_bucket_closes_only_when_the_next_spec_does_not_fit(
    specs: list[TensorSpec], budget: int
) -> None:
    buckets = list(plan_buckets(specs, budget))
    for bucket, following in itertools.pairwise(buckets):
        first = align_up(following.slots[0].nbytes)
        assert bucket.used_bytes == budget or bucket.used_bytes + first > budget or (first > budget)


@given(refit_specs(min_size=1), refit_budgets)
def test_the_planner_is_lazy(specs: list[TensorSpec], budget: int) -> None:
    consumed = 0

    def stream() -> object:
        nonlocal consumed
        for spec in specs:
            consumed += 1
            yield spec

    seen = 0
    for bucket in plan_buckets(stream(), budget):  # type: ignore[arg-type]
        seen += len(bucket.slots)
        # the planner never reads more than one spec past the bucket it yields
        assert consumed <= seen + 1
    assert seen == len(specs)


def test_oversized_tensor_travels_alone_between_its_neighbours() -> None:
    small = TensorSpec("a", (10,), "float32")
    big = TensorSpec("big", (1000,), "float32")  # 4000 bytes > 1024
    tail = TensorSpec("b", (3,), "int8")
    buckets = list(plan_buckets([small, big, tail], 1024))
    assert [b.names for b in buckets] == [("a",), ("big",), ("b",)]
    assert buckets[1].used_bytes == 4096
    assert [b.buffer for b in buckets] == [0, 1, 0]


def test_exactly_full_bucket_closes_before_reading_on() -> None:
    specs = [TensorSpec("a", (128,), "float32"), TensorSpec("b", (128,), "float32")]
    it = plan_buckets(iter(specs), 512)
    first = next(it)
    assert first.names == ("a",)
    assert first.used_bytes == 512


def test_invalid_budget_is_refused() -> None:
    for bad in (0, -512, 100, 513, 1.5, True, "512"):
        result = bucket_budget(bad)
        assert isinstance(result, Failure)
        assert repr(bad) in str(result.failure())
        assert result.failure().budget_bytes == bad
    assert bucket_budget(1024) == Success(1024)
    with pytest.raises(ValueError, match="invalid refit bucket budget"):
        list(plan_buckets([], 100))


# -- values ---------------------------------------------------------------------------


@given(refit_shapes, st.sampled_from(sorted(DTYPE_ITEMSIZE)))
def test_spec_of_a_tensor_matches_its_bytes(shape: tuple[int, ...], dtype: str) -> None:
    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
    spec = TensorSpec.of("w", tensor)
    assert spec.nbytes == tensor.numel() * tensor.element_size()
    assert DTYPE_ITEMSIZE[dtype] == tensor.element_size()
    assert spec.describe() == f"{list(shape)} {dtype}"


def test_dtype_names_are_normalised() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name("torch.float32") == "float32"
    assert dtype_name("int8") == "int8"


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", ""), ("shape", (-1,)), ("shape", [2]), ("shape", (True,)), ("dtype", "float128")],
)
def test_spec_invariants(field: str, value: object) -> None:
    good = {"name": "w", "shape": (2,), "dtype": "float32"}
    with pytest.raises(ValueError, match=field if field != "name" else "name"):
        TensorSpec(**{**good, field: value})  # type: ignore[arg-type]


def test_slot_and_bucket_invariants() -> None:
    with pytest.raises(ValueError, match="offset"):
        Slot("w", -1, 4, (1,), "float32")
    with pytest.raises(ValueError, match="buffer index"):
        Bucket(0, 2, (), 0)
    with pytest.raises(ValueError, match="unique"):
        Manifest(())


# -- the manifest ---------------------------------------------------------------------


@given(refit_specs(min_size=1))
def test_info_round_trips(specs: list[TensorSpec]) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    again = Manifest.from_info(manifest.to_info()).unwrap()
    assert again == manifest
    assert again.digest() == manifest.digest()
    assert len(again) == len(specs)
    assert again.names == tuple(s.name for s in specs)
    assert again.total_bytes == sum(s.nbytes for s in specs)
    assert all(s.name in again for s in specs)


@given(refit_specs(min_size=2), st.randoms())
def test_digest_ignores_order_but_not_content(specs: list[TensorSpec], rng: object) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    shuffled = list(specs)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    assert Manifest.from_specs(shuffled).unwrap().digest() == manifest.digest()
    changed = [attrs.evolve(specs[0], shape=(*specs[0].shape, 1)), *specs[1:]]
    assert Manifest.from_specs(changed).unwrap().digest() != manifest.digest()


def test_info_accepts_torch_dtypes_and_sizes() -> None:
    info: dict[object, object] = {
        "a": (torch.Size([2, 3]), torch.bfloat16),
        "b": ([4], "torch.float32"),
    }
    manifest = Manifest.from_info(info).unwrap()
    assert manifest.get("a") == TensorSpec("a", (2, 3), "bfloat16")
    assert manifest.get("b") == TensorSpec("b", (4,), "float32")
    assert manifest.get("c") is None


def test_invalid_info_names_every_bad_entry() -> None:
    info: dict[object, object] = {
        "ok": ([1], "float32"),
        "neg": ([2, -1], "float32"),
        "float_dim": ([2.0], "float32"),
        "bad_dtype": ([2], "float128"),
        "not_a_dtype": ([2], 7),
        "not_a_pair": [2],
        "": ([1], "float32"),
        3: ([1], "float32"),
    }
    error = _error(Manifest.from_info(info))
    bad = {p.name for p in error.problems}
    assert bad == {"neg", "float_dim", "bad_dtype", "not_a_dtype", "not_a_pair", "", "3"}
    assert all(p.kind is Deviation.INVALID for p in error.problems)
    for name in ("neg", "float_dim", "bad_dtype", "not_a_pair"):
        assert repr(name) in str(error)


def test_empty_manifest_is_refused() -> None:
    assert "no tensors" in str(_error(Manifest.from_info({})))
    assert "no tensors" in str(_error(Manifest.from_specs([])))


def test_duplicate_specs_are_refused() -> None:
    spec = TensorSpec("w", (1,), "float32")
    error = _error(Manifest.from_specs([spec, spec]))
    assert error.duplicated == ("w",)


# -- receiver checks: the manifest accepts exactly the plan of its own specs -----------


@given(refit_specs(min_size=1), refit_budgets)
def test_manifest_accepts_its_own_plan(specs: list[TensorSpec], budget: int) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    buckets = list(plan_buckets(specs, budget))
    progress = _receive_all(manifest, buckets)
    assert progress.received == frozenset(manifest.names)
    assert progress.buckets == len(buckets)
    assert progress.nbytes == manifest.total_bytes


@given(refit_specs(min_size=2), refit_budgets, st.data())
def test_missing_tensors_are_named(
    specs: list[TensorSpec], budget: int, data: st.DataObject
) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    dropped = data.draw(st.sets(st.sampled_from([s.name for s in specs]), min_size=1))
    sent = [s for s in specs if s.name not in dropped]
    progress = ReceiveProgress()
    for bucket in plan_buckets(sent, budget):
        progress = check_bucket(manifest, progress, bucket).unwrap()
    error = _error(check_complete(manifest, progress))
    assert set(error.missing) == dropped
    assert "incomplete" in str(error)


@given(refit_specs(min_size=1), refit_specs(min_size=1, max_size=3), refit_budgets)
def test_unexpected_tensors_are_named(
    specs: list[TensorSpec], extra: list[TensorSpec], budget: int
) -> None:
    known = {s.name for s in specs}
    extra = [attrs.evolve(s, name=f"extra/{s.name}") for s in extra if s.name not in known]
    if not extra:
        return
    manifest = Manifest.from_specs(specs).unwrap()
    named: set[str] = set()
    progress = ReceiveProgress()
    for bucket in plan_buckets([*specs, *extra], budget):
        result = check_bucket(manifest, progress, bucket)
        if isinstance(result, Failure):
            error = _error(result)
            assert error.bucket_index == bucket.index
            named |= set(error.unexpected)
            assert set(error.unexpected) <= set(bucket.names)
        else:
            progress = result.unwrap()
    assert named == {s.name for s in extra}


@given(refit_specs(min_size=1), refit_budgets, st.data())
def test_wrong_shape_or_dtype_is_named_with_both_layouts(
    specs: list[TensorSpec], budget: int, data: st.DataObject
) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    victim = data.draw(st.sampled_from(specs))
    if data.draw(st.booleans()):
        wrong = attrs.evolve(victim, shape=(*victim.shape, 2))
    else:
        other = [d for d in DTYPE_ITEMSIZE if d != victim.dtype]
        wrong = attrs.evolve(victim, dtype=data.draw(st.sampled_from(other)))
    sent = [wrong if s is victim else s for s in specs]
    failures = []
    progress = ReceiveProgress()
    for bucket in plan_buckets(sent, budget):
        result = check_bucket(manifest, progress, bucket)
        if isinstance(result, Failure):
            failures.append(_error(result))
        else:
            progress = result.unwrap()
    (error,) = failures
    assert error.mismatched == (victim.name,)
    assert victim.describe() in str(error)
    assert wrong.describe() in str(error)


@given(refit_specs(min_size=1), refit_budgets, st.data())
def test_duplicates_across_buckets_are_named(
    specs: list[TensorSpec], budget: int, data: st.DataObject
) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    again = data.draw(st.sampled_from(specs))
    progress = _receive_all(manifest, list(plan_buckets(specs, budget)))
    (bucket,) = plan_buckets([again], budget)
    error = _error(check_bucket(manifest, progress, bucket))
    assert error.duplicated == (again.name,)


def test_duplicates_within_a_bucket_are_named() -> None:
    spec = TensorSpec("w", (4,), "float32")
    manifest = Manifest.from_specs([spec]).unwrap()
    slots = (Slot("w", 0, 16, (4,), "float32"), Slot("w", 512, 16, (4,), "float32"))
    error = _error(check_bucket(manifest, ReceiveProgress(), Bucket(0, 0, slots, 1024)))
    assert error.duplicated == ("w",)


def test_tampered_layout_is_named() -> None:
    specs = [TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32")]
    manifest = Manifest.from_specs(specs).unwrap()
    (bucket,) = plan_buckets(specs, 4096)
    moved = attrs.evolve(bucket, slots=(bucket.slots[0], attrs.evolve(bucket.slots[1], offset=16)))
    error = _error(check_bucket(manifest, ReceiveProgress(), moved))
    assert error.names(Deviation.MISPLACED) == ("b",)
    assert "offset 16, expected 512" in str(error)

    short = attrs.evolve(bucket, used_bytes=600)
    error = _error(check_bucket(manifest, ReceiveProgress(), short))
    assert error.used_bytes == (600, 1024)
    assert error.problems == ()
    assert "used_bytes is 600" in str(error)

    lying = attrs.evolve(bucket, slots=(attrs.evolve(bucket.slots[0], nbytes=8), bucket.slots[1]))
    error = _error(check_bucket(manifest, ReceiveProgress(), lying))
    assert error.mismatched == ("a",)
    assert "(8 bytes)" in str(error)


def test_long_problem_lists_are_summarised_but_complete() -> None:
    specs = [TensorSpec(f"t{i}", (1,), "int8") for i in range(40)]
    manifest = Manifest.from_specs(specs).unwrap()
    error = _error(check_complete(manifest, ReceiveProgress()))
    assert len(error.missing) == 40
    assert "and 28 more" in str(error)


# -- checksums ------------------------------------------------------------------------


@given(st.binary(max_size=4096))
def test_checksum_is_adler32_of_the_bytes(data: bytes) -> None:
    assert bucket_checksum(data) == zlib.adler32(data)
    assert bucket_checksum(memoryview(data)) == bucket_checksum(bytearray(data))


def test_checksum_notices_a_flipped_byte() -> None:
    data = bytearray(range(256)) * 4
    before = bucket_checksum(data)
    data[100] ^= 1
    assert bucket_checksum(data) != before


# -- grouped direct broadcasts ----------------------------------------------------------
_sizes = st.lists(st.integers(min_value=0, max_value=1 << 12), max_size=40)
_limits = st.integers(min_value=-1, max_value=1 << 13)


@given(_sizes, _limits)
def test_broadcast_groups_cover_every_nonempty_tensor_once_in_order(
    sizes: list[int], limit: int
) -> None:
    groups = broadcast_groups(sizes, limit)
    flat = [i for group in groups for i in group]
    assert flat == [i for i, size in enumerate(sizes) if size > 0]
    assert all(groups)


@given(_sizes, _limits)
def test_broadcast_groups_respect_the_limit_unless_one_tensor_exceeds_it(
    sizes: list[int], limit: int
) -> None:
    for group in broadcast_groups(sizes, limit):
        if limit <= 0:
            assert len(group) == 1
        elif len(group) > 1:
            assert sum(sizes[i] for i in group) <= limit


@given(_sizes, st.integers(min_value=1, max_value=1 << 13))
def test_broadcast_groups_are_greedy(sizes: list[int], limit: int) -> None:
    """A group closes only when the next tensor would not fit in it."""
    groups = broadcast_groups(sizes, limit)
    for group, following in itertools.pairwise(groups):
        assert sum(sizes[i] for i in group) + sizes[following[0]] > limit


def test_broadcast_groups_example() -> None:
    assert broadcast_groups([4, 0, 4, 9, 1, 1], 8) == ((0, 2), (3,), (4, 5))
    assert broadcast_groups([4, 4], 0) == ((0,), (1,))
    assert broadcast_groups([], 8) == ()
