"""The trainer-side refit arena: one allocation, a view per manifest tensor."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from hypothesis import given
from strategies import refit_specs

from genworker.core.refit_plan import ALIGNMENT, Manifest, TensorSpec
from genworker.shell.errors import BadConfigError, RefitManifestError
from genworker.shell.refit import fake
from genworker.shell.refit.arena import RefitArena
from genworker.shell.refit.ipc import IpcReceiver, IpcSender
from genworker.shell.refit.session import ParameterSink, RefitReport, manifest_of, receive_refit


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
                maps.append(dict(sender._engine_maps))
    finally:
        receiver.close()
    assert [r.mode for r in reports] == ["engine-handles"] * 2
    assert {"begin", "wait", "finalize", "answer"} <= set(reports[1].phases)
    # The engine offered the same handles again; the sender mapped nothing anew.
    assert maps[0].keys() == maps[1].keys()
    assert all(maps[0][h] is maps[1][h] for h in maps[0])
