"""The trainer-side refit arena: one allocation, a view per manifest tensor."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import refit_specs

from genworker.core.refit_plan import ALIGNMENT, Manifest, TensorSpec
from genworker.shell.errors import BadConfigError, RefitError, RefitManifestError
from genworker.shell.refit import buffers, direct, fake, ipc
from genworker.shell.refit.arena import RefitArena
from genworker.shell.refit.direct import ExportCache, ListingMemo, refs_of
from genworker.shell.refit.ipc import IpcReceiver, IpcSender
from genworker.shell.refit.packing import SendReport
from genworker.shell.refit.session import ParameterSink, RefitReport, manifest_of, receive_refit
from genworker.shell.refit.wire import CpuHandle, CudaHandle


@given(refit_specs(min_size=1))
def test_arena_views_are_disjoint_aligned_slices_of_one_allocation(
    specs: list[TensorSpec],
) -> None:
    arena = RefitArena(Manifest.from_specs(specs).unwrap(), "cpu")
    base = arena.buffer.data_ptr()
    spans = []
    assert list(arena.tensors) == [s.name for s in specs]
    for spec in specs:
        view = arena.tensors[spec.name]
        assert TensorSpec.of(spec.name, view) == spec
        assert view.is_contiguous()
        if spec.nbytes:
            assert view.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
            start = view.data_ptr() - base
            assert start % ALIGNMENT == 0
            assert start + spec.nbytes <= arena.nbytes
            spans.append((start, start + spec.nbytes))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))


def test_arena_load_copies_and_refuses_what_does_not_fit() -> None:
    tensors = fake.random_state_dict(3)
    arena = RefitArena(manifest_of(tensors), "cpu")
    arena.load_(tensors.items())
    for name, tensor in tensors.items():
        assert torch.equal(arena.tensors[name], tensor), name
    first = next(iter(tensors))
    before = {n: t.clone() for n, t in arena.items()}
    with pytest.raises(RefitManifestError, match=r"'nope'.*not in the arena") as err:
        arena.load_([(first, torch.zeros_like(tensors[first])), ("nope", torch.zeros(2))])
    assert repr(first) not in str(err.value)
    with pytest.raises(RefitManifestError, match=f"{first!r}.*the arena holds"):
        arena.load_([(first, torch.zeros(tensors[first].numel() + 1))])
    for name, tensor in arena.items():
        assert torch.equal(tensor, before[name]), "a refused load wrote"


def test_arena_takes_info_dicts_and_names_a_bad_one() -> None:
    arena = RefitArena({"w": ([2, 3], "bfloat16"), "b": ([3], "torch.float32")}, "cpu")
    assert arena.tensors["w"].dtype == torch.bfloat16
    assert arena.tensors["b"].shape == (3,)
    with pytest.raises(BadConfigError, match="w"):
        RefitArena({"w": ([2, -1], "bfloat16")}, "cpu")
    with pytest.raises(BadConfigError):
        RefitArena({}, "cpu")


def test_an_arena_refits_over_ipc_directly_and_the_engine_memory_stays_mapped() -> None:
    tensors = fake.random_state_dict(5)
    arena = RefitArena(manifest_of(tensors), "cpu")
    receiver = IpcReceiver(torch.device("cpu"))
    params = fake.zeros_like_all(tensors)
    reports: list[RefitReport] = []

    def receive() -> None:
        reports.append(
            receive_refit(receiver, manifest_of(tensors), ParameterSink(params), timeout_s=30.0)
        )

    maps = []
    try:
        with IpcSender(receiver.address, manifest=manifest_of(tensors), timeout_s=30.0) as sender:
            for flip in (False, True):
                sent_now = {n: t.flip(-1) if flip and t.dim() else t for n, t in tensors.items()}
                arena.load_(sent_now.items())
                thread = threading.Thread(target=receive, daemon=True)
                thread.start()
                sent = sender.send(arena.items())
                thread.join(30)
                assert sent.mode == "engine-handles"
                assert {"collect", "begin", "map", "copy", "sync", "direct"} <= set(sent.phases)
                for name, tensor in sent_now.items():
                    assert torch.equal(params[name], tensor), name
                maps.append(dict(sender._engine.mapped))
    finally:
        receiver.close()
    assert [r.mode for r in reports] == ["engine-handles"] * 2
    assert {"begin", "wait", "finalize", "answer"} <= set(reports[1].phases)
    # The engine offered the same handles again; the sender mapped nothing anew.
    assert maps[0].keys() == maps[1].keys()
    assert all(maps[0][h] is maps[1][h] for h in maps[0])


# -- an engine that reads from the sender's memory (sender-handles), kept mapped ---------


class Engine:
    """An IPC receiver that never offers its parameters, so direct refits read from the
    sender's tensors (as a sleep-mode GPU engine does), and a refit runner for it."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.manifest = manifest_of(tensors)
        self.receiver = IpcReceiver(torch.device("cpu"), offer_params=False)
        self.params = fake.zeros_like_all(tensors)
        self.reports: list[RefitReport] = []
        self.errors: list[BaseException] = []

    def refit(self, send: Callable[[], SendReport]) -> SendReport:
        def receive() -> None:
            try:
                self.reports.append(
                    receive_refit(
                        self.receiver, self.manifest, ParameterSink(self.params), timeout_s=30.0
                    )
                )
            except BaseException as e:  # noqa: BLE001 - the test reads it
                self.errors.append(e)

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        try:
            return send()
        finally:
            thread.join(30)
            assert not thread.is_alive(), "HUNG: the receiver did not finish"


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every handle the direct path maps, in order."""
    calls: list[object] = []
    real = buffers.open_handle

    def counting(handle: CpuHandle | CudaHandle, device: torch.device) -> torch.Tensor:
        calls.append(handle)
        return real(handle, device)

    monkeypatch.setattr(direct, "open_handle", counting)
    return calls


def test_kept_mappings_are_opened_once_and_read_the_senders_new_values(
    opened: list[object],
) -> None:
    tensors = fake.random_state_dict(5)
    arena = RefitArena(manifest_of(tensors), "cpu")
    engine = Engine(tensors)
    try:
        with IpcSender(engine.receiver.address, timeout_s=30.0, keep_mapped=True) as sender:
            for flip in (False, True, True):
                sent_now = {n: t.flip(-1) if flip and t.dim() else t for n, t in tensors.items()}
                arena.load_(sent_now.items())
                sent = engine.refit(lambda: sender.send(arena.items()))
                assert sent.mode == "sender-handles"
                for name, tensor in sent_now.items():
                    assert torch.equal(engine.params[name], tensor), name
                assert len(opened) == 1  # the arena's one storage, mapped by the first refit
            assert engine.receiver.drop_kept() == 1
            engine.refit(lambda: sender.send(arena.items()))  # maps it again
            assert len(opened) == 2
    finally:
        engine.receiver.close()
    assert not engine.errors
    assert [r.mode for r in engine.reports] == ["sender-handles"] * 4


def test_without_keep_mapped_every_refit_maps_the_sender_tensors_and_keeps_nothing(
    opened: list[object],
) -> None:
    tensors = {n: t.contiguous() for n, t in fake.random_state_dict(6).items()}
    engine = Engine(tensors)
    storages = sum(1 for t in tensors.values() if t.numel())
    try:
        with IpcSender(engine.receiver.address, timeout_s=30.0) as sender:
            for _ in range(2):
                assert engine.refit(lambda: sender.send(tensors.items())).mode == "sender-handles"
                assert engine.receiver.drop_kept() == 0
    finally:
        engine.receiver.close()
    assert len(opened) == 2 * storages
    assert not engine.errors
    for name, tensor in tensors.items():
        assert torch.equal(engine.params[name], tensor), name


def test_a_new_arena_replaces_the_kept_mapping(opened: list[object]) -> None:
    tensors = fake.random_state_dict(7)
    first, second = (RefitArena(manifest_of(tensors), "cpu") for _ in range(2))
    second.load_((n, t + 1 if t.is_floating_point() else t) for n, t in tensors.items())
    engine = Engine(tensors)
    try:
        with IpcSender(engine.receiver.address, timeout_s=30.0, keep_mapped=True) as sender:
            first.load_(tensors.items())
            engine.refit(lambda: sender.send(first.items()))
            engine.refit(lambda: sender.send(second.items()))
            kept = list(engine.receiver._kept.mapped)
    finally:
        engine.receiver.close()
    assert len(opened) == 2
    assert kept == [opened[1]]  # the first arena was let go
    for name, tensor in second.tensors.items():
        assert torch.equal(engine.params[name], tensor), name


def test_keep_mapped_refuses_a_tensor_it_would_have_to_copy_and_stays_usable() -> None:
    tensors = fake.random_state_dict(8)  # layer.0.proj is not contiguous
    engine = Engine(tensors)
    try:
        with IpcSender(engine.receiver.address, timeout_s=30.0, keep_mapped=True) as sender:
            with pytest.raises(RefitError, match=r"'layer\.0\.proj' is not contiguous on cpu"):
                engine.refit(lambda: sender.send(tensors.items()))
            assert engine.errors
            assert "layer.0.proj" in str(engine.errors[-1])
            for tensor in engine.params.values():
                assert not tensor.any()
            fixed = {n: t.contiguous() for n, t in tensors.items()}
            assert engine.refit(lambda: sender.send(fixed.items())).mode == "sender-handles"
    finally:
        engine.receiver.close()
    for name, tensor in tensors.items():
        assert torch.equal(engine.params[name], tensor), name


def test_a_refit_that_sends_nothing_kept_lets_the_kept_mapping_go(opened: list[object]) -> None:
    tensors = fake.random_state_dict(9)
    arena = RefitArena(manifest_of(tensors), "cpu")
    arena.load_(tensors.items())
    engine = Engine(tensors)
    try:
        with IpcSender(engine.receiver.address, timeout_s=30.0, keep_mapped=True) as kept:
            engine.refit(lambda: kept.send(arena.items()))
            assert len(engine.receiver._kept.mapped) == 1
            with IpcSender(engine.receiver.address, timeout_s=30.0, direct=False) as plain:
                assert engine.refit(lambda: plain.send(tensors.items())).mode == "buckets"
            assert engine.receiver.drop_kept() == 0  # the bucket refit let it go
    finally:
        engine.receiver.close()
    assert not engine.errors


def tensors_of(specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    return [(s.name, torch.zeros(s.shape, dtype=getattr(torch, s.dtype))) for s in specs]


@given(st.lists(refit_specs(max_size=4), min_size=1, max_size=6))
def test_a_listing_memo_always_lists_the_stream_it_is_given(
    streams: list[list[TensorSpec]],
) -> None:
    memo = ListingMemo()
    for specs in streams:  # streams that repeat, change a shape, a dtype or a name
        items = tensors_of(specs)
        assert memo.refs(items) == refs_of(items)


def test_keep_mapped_exports_the_same_tensors_once_and_sees_a_new_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    square = {"w": torch.arange(16.0).reshape(4, 4), "b": torch.ones(4)}
    engine = Engine(square)
    exports: list[int] = []
    real = direct.export_refs

    def counting(targets: Mapping[str, torch.Tensor], cache: ExportCache | None = None) -> object:
        exports.append(len(targets))
        return real(targets, cache)

    monkeypatch.setattr(ipc, "export_refs", counting)
    try:
        with IpcSender(engine.receiver.address, timeout_s=30.0, keep_mapped=True) as sender:
            for _ in range(2):
                engine.refit(lambda: sender.send(square.items()))
            assert exports == [2]
            square["w"].mul_(2)  # written in place: the engine reads the new values
            engine.refit(lambda: sender.send(square.items()))
            assert torch.equal(engine.params["w"], square["w"])
            # The same memory and shape in another layout is not the same export.
            transposed = {"w": square["w"].t(), "b": square["b"]}
            with pytest.raises(RefitError, match="'w' is not contiguous"):
                engine.refit(lambda: sender.send(transposed.items()))
            moved = {"w": square["w"].t().contiguous(), "b": square["b"]}
            engine.refit(lambda: sender.send(moved.items()))
            assert exports == [2, 2]
    finally:
        engine.receiver.close()
    assert torch.equal(engine.params["w"], square["w"].t())
