"""Laws of NeMo-RL's refit wire as protocol events: what its trainer packs, the receiver
machine takes, and any deviation is refused naming the tensor."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import refit_specs

from genworker.core import nemo_rl_refit as n
from genworker.core import refit_protocol as p
from genworker.core.refit_plan import Deviation, Manifest, TensorSpec, align_up


def _trainer_buckets(specs: list[TensorSpec], budget: int) -> list[tuple[list[str], int]]:
    """Buckets as ``stream_weights_via_ipc_zmq_impl`` fills them (its packing loop, with
    the oversized-parameter case: a bucket of its own)."""
    buckets: list[tuple[list[str], int]] = []
    names: list[str] = []
    used = 0
    for spec in specs:
        size = align_up(spec.nbytes, n.IPC_ALIGN)
        if size > budget:
            if names:
                buckets.append((names, used))
                names, used = [], 0
            buckets.append(([spec.name], size))
            continue
        if used + size > budget:
            buckets.append((names, used))
            names, used = [], 0
        names.append(spec.name)
        used += size
    if names:
        buckets.append((names, used))
    return buckets


def _receive(manifest: Manifest, chunks: list[p.Chunk]) -> p.Receiver:
    step = p.Receiver(manifest).handle(p.Begin("r", ""))
    assert isinstance(step, Success)
    receiver: p.Receiver = step.unwrap().receiver
    for chunk in chunks:
        got = receiver.handle(chunk)
        assert isinstance(got, Success), got
        receiver = got.unwrap().receiver
    return receiver


@given(refit_specs(min_size=1), st.integers(1, 8).map(lambda k: k * n.IPC_ALIGN))
def test_ipc_buckets_as_the_trainer_packs_them_are_a_complete_refit(
    specs: list[TensorSpec], budget: int
) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    chunks = []
    for index, (names, used) in enumerate(_trainer_buckets(specs, budget)):
        chunk = n.ipc_chunk(manifest, "r", index, names, used, max(used, budget))
        assert isinstance(chunk, Success), chunk
        assert chunk.unwrap().kinds == (p.StorageKind.TEMPORARY,)
        assert all(r.offset % n.IPC_ALIGN == 0 for r in chunk.unwrap().tensors)
        chunks.append(chunk.unwrap())
    receiver = _receive(manifest, chunks)
    end = receiver.handle(p.End(receiver.refit_id, receiver.chunks, len(receiver.received)))
    assert isinstance(end, Success)
    assert isinstance(end.unwrap().decision, p.Finished)


def test_a_bucket_naming_a_tensor_outside_the_manifest_is_refused_by_name() -> None:
    manifest = Manifest.from_specs([TensorSpec("a", (4,), "float32")]).unwrap()
    got = n.ipc_chunk(manifest, "r", 0, ["a", "zz"], 512, 1024)
    assert isinstance(got, Failure)
    assert got.failure().unexpected == ("zz",)


def test_a_bucket_whose_bytes_do_not_add_up_is_refused_naming_its_tensors() -> None:
    manifest = Manifest.from_specs([TensorSpec("a", (4,), "float32")]).unwrap()
    got = n.ipc_chunk(manifest, "r", 3, ["a"], 1024, 1024)
    assert isinstance(got, Failure)
    assert got.failure().names(Deviation.MISPLACED) == ("a",)
    assert "512 bytes" in str(got.failure())
    assert "1024" in str(got.failure())


def test_a_bucket_overrunning_its_storage_is_refused_by_the_receiver() -> None:
    manifest = Manifest.from_specs([TensorSpec("a", (256,), "float32")]).unwrap()
    chunk = n.ipc_chunk(manifest, "r", 0, ["a"], 1024, 512)
    assert isinstance(chunk, Success)
    begun = p.Receiver(manifest).handle(p.Begin("r", "")).unwrap().receiver
    refused = begun.handle(chunk.unwrap())
    assert isinstance(refused, Failure)
    assert refused.failure().kind is p.RefusalKind.MANIFEST


def test_a_refit_that_stops_early_is_refused_naming_what_never_arrived() -> None:
    specs = [TensorSpec("a", (4,), "float32"), TensorSpec("b", (2,), "int64")]
    manifest = Manifest.from_specs(specs).unwrap()
    receiver = _receive(manifest, [n.ipc_chunk(manifest, "r", 0, ["a"], 512, 512).unwrap()])
    end = receiver.handle(p.End(receiver.refit_id, receiver.chunks, len(receiver.received)))
    assert isinstance(end, Failure)
    assert end.failure().detail is not None
    assert end.failure().detail.missing == ("b",)


@given(refit_specs(min_size=1), st.integers(0, 4096))
def test_packed_groups_are_the_manifest_in_order_each_closing_once_over_target(
    specs: list[TensorSpec], target: int
) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    groups = n.packed_groups(manifest, target)
    assert [s for g in groups for s in g] == specs
    for group in groups[:-1]:
        sizes = [s.nbytes for s in group]
        assert sum(sizes) > target >= sum(sizes[:-1])
    assert all(groups)
    assert sum(s.nbytes for s in groups[-1][:-1]) <= target
    chunks = [n.packed_chunk("r", i, g) for i, g in enumerate(groups)]
    assert all(c.storages is None for c in chunks)
    receiver = _receive(manifest, chunks)
    assert receiver.received == frozenset(manifest.names)
    assert receiver.chunks == len(groups)


@given(st.floats(1e-9, 1.0), st.integers(0, 1 << 44))
def test_the_packed_target_is_the_memory_share_capped_at_5_gib(share: float, total: int) -> None:
    target = n.packed_target(repr(share), total)
    assert isinstance(target, Success)
    assert target.unwrap() == min(int(total * share), 5 << 30) == min(target.unwrap(), n.MAX_PACKED)


@given(st.sampled_from(["0", "-0.1", "1.5", "nan", "inf", "lots", ""]))
def test_a_packed_target_ratio_off_its_range_is_refused_naming_it(ratio: str) -> None:
    target = n.packed_target(ratio, 1 << 30)
    assert isinstance(target, Failure)
    assert "NRL_REFIT_BUFFER_MEMORY_RATIO" in str(target.failure())
    assert repr(ratio) in str(target.failure())


@given(st.one_of(st.none(), st.integers()))
def test_a_packing_target_given_is_taken_as_is(value: int | None) -> None:
    assert n.packed_bytes(value) == Success(value)


@given(st.one_of(st.booleans(), st.floats(), st.text(), st.lists(st.integers())))
def test_a_packing_target_that_is_no_int_is_refused_naming_it(value: object) -> None:
    refused = n.packed_bytes(value)
    assert isinstance(refused, Failure)
    assert str(refused.failure()) == f"packed_bytes must be an int, got {value!r}"


def test_the_socket_dir_must_be_an_absolute_path() -> None:
    assert n.socket_dir("/tmp") == Success("/tmp")
    assert n.socket_dir("/run/user/1000/") == Success("/run/user/1000/")
    for bad in ("tmp", "", "./tmp", None, 3, b"/tmp"):
        refused = n.socket_dir(bad)
        assert isinstance(refused, Failure)
        assert repr(bad) in str(refused.failure())


@given(st.one_of(st.binary(min_size=128, max_size=128), st.binary(max_size=300)))
def test_only_a_128_byte_nccl_unique_id_is_taken(raw: bytes) -> None:
    taken = n.unique_id(raw)
    if len(raw) == n.UNIQUE_ID_BYTES:
        assert taken == Success(raw)
    else:
        assert isinstance(taken, Failure)
        assert f"holds {len(raw)} bytes" in str(taken.failure())
        assert n.UNIQUE_ID_KEY in str(taken.failure())


@given(refit_specs(min_size=1), st.integers(0, 4096))
def test_packed_events_are_a_whole_refit_the_receiver_finishes(
    specs: list[TensorSpec], target: int
) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    groups = n.packed_groups(manifest, target)
    events = n.packed_events("r", groups, len(manifest))
    assert events[0] == p.Begin("r", "")
    assert events[1:-1] == tuple(n.packed_chunk("r", i, g) for i, g in enumerate(groups))
    assert events[-1] == p.End("r", len(groups), len(manifest))
    receiver = p.Receiver(manifest)
    for event in events:
        step = receiver.handle(event)
        assert isinstance(step, Success), step
        receiver = step.unwrap().receiver
    assert isinstance(step.unwrap().decision, p.Finished)


@given(refit_specs(min_size=1), st.integers(1, 8).map(lambda k: k * n.IPC_ALIGN))
def test_an_ipc_stream_synthesizes_the_begin_and_counts_what_came_for_the_end(
    specs: list[TensorSpec], budget: int
) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    stream, begin = n.IpcStream(manifest, "r").begin()
    assert begin == p.Begin("r", "")
    assert stream.begun
    receiver = p.Receiver(manifest)
    events: list[p.Event] = [begin]
    for names, used in _trainer_buckets(specs, budget):
        step = stream.bucket(names, used, max(used, budget))
        assert isinstance(step, Success), step
        stream, chunk = step.unwrap()
        events.append(chunk)
    assert stream.end() == p.End("r", len(events) - 1, len(specs))
    for event in [*events, stream.end()]:
        got = receiver.handle(event)
        assert isinstance(got, Success), got
        receiver = got.unwrap().receiver
    assert isinstance(got.unwrap().decision, p.Finished)


def test_an_ipc_stream_refuses_a_bucket_off_the_manifest_and_counts_nothing() -> None:
    manifest = Manifest.from_specs([TensorSpec("a", (2,), "float32")]).unwrap()
    stream, _ = n.IpcStream(manifest, "r").begin()
    refused = stream.bucket(["z"], n.IPC_ALIGN, n.IPC_ALIGN)
    assert isinstance(refused, Failure)
    assert "IPC bucket 0 does not match the manifest" in str(refused.failure())
    assert stream.end() == p.End("r", 0, 0)
