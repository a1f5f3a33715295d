"""The reshard transport on gloo without vLLM: ``ReshardEngine`` mixed into a stand-in
worker over a plain torch model (one rank, every parameter written straight into its
memory), two trainer ranks in threads. Rows split go point to point into the parameter
itself; columns split through scratch; every problem is typed on every rank."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from refit_helpers import free_port

from genworker.core.joins import reshard_join
from genworker.core.reshard import TrainerLayout, megatron_layout
from genworker.shell.errors import RefitError
from genworker.shell.extension import WorkerExtension
from genworker.shell.refit.reshard import ReshardSender, refit_info, shards_of

TIMEOUT = 20.0


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = torch.nn.Linear(6, 8, bias=False)  # split by rows on the trainer
        self.cols = torch.nn.Linear(6, 4, bias=False)  # split by columns
        self.norm = torch.nn.Parameter(torch.zeros(5))  # replicated


class StandIn(WorkerExtension):
    """What the ``reshard`` backend needs of a vLLM worker: a rank and ``get_model``."""

    def __init__(self) -> None:
        self.rank, self.model = 0, Model()

    def get_model(self) -> torch.nn.Module:
        return self.model


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "rows.weight": torch.randn(8, 6, generator=g),
        "cols.weight": torch.randn(4, 6, generator=g),
        "norm": torch.randn(5, generator=g),
    }


def layouts() -> list[TrainerLayout]:
    dims = {"rows.weight": ((8, 6), 0), "cols.weight": ((4, 6), 1), "norm": ((5,), None)}
    return [
        megatron_layout(n, shape, "float32", dim, [[0], [1]]).unwrap()
        for n, (shape, dim) in dims.items()
    ]


def local(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for layout in layouts():
        (box,) = [s.box for s in layout.shards if s.rank == rank]
        out[layout.name] = tensors[layout.name][tuple(slice(a, b) for a, b in box)].clone()
    return out


class Setup:
    def __init__(self, engine: StandIn, senders: list[ReshardSender], answers: object) -> None:
        self.engine, self.senders, self.answers = engine, senders, answers

    def refit(
        self, send: Callable[[int, ReshardSender], object]
    ) -> tuple[dict[str, object], list[object]]:
        outcomes: list[object] = [None, None]

        def run(rank: int) -> None:
            try:
                outcomes[rank] = send(rank, self.senders[rank])
            except RefitError as e:
                outcomes[rank] = e

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        report = self.engine.nccl_reshard_refit(TIMEOUT)
        for t in threads:
            t.join(TIMEOUT * 3)
        return report, outcomes


@pytest.fixture
def setup() -> Iterator[Setup]:
    engine, port = StandIn(), free_port()
    senders: list[ReshardSender | None] = [None, None]

    def join(rank: int) -> None:
        senders[rank] = ReshardSender(
            "127.0.0.1",
            port,
            3,
            rank=rank,
            train_world_size=2,
            layouts=layouts(),
            timeout_s=TIMEOUT,
        )

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    stages = reshard_join(0, ["127.0.0.1"], [port], 1, 2, 3, TIMEOUT).unwrap()
    joined = engine.init_nccl_reshard_comm_group(stages.to_wire())
    for t in threads:
        t.join(TIMEOUT)
    assert joined == {"rank": 2, "stages": 1}
    answer = engine.prepare_nccl_reshard_refit_info(refit_info(layouts()))
    assert "error" not in answer, answer
    ready = [s for s in senders if s is not None]
    assert len(ready) == 2
    try:
        yield Setup(engine, ready, [answer])
    finally:
        for s in ready:
            s.close()
        started = time.monotonic()
        assert engine.close_nccl_reshard_comm_group() == 1
        # closing waits for no peer, nor for a receive left pending by a timed-out refit
        assert time.monotonic() - started < TIMEOUT / 4


def test_rows_land_in_the_parameter_itself_and_columns_through_scratch(setup: Setup) -> None:
    for sender in setup.senders:
        sender.plan(shards_of(setup.answers))  # type: ignore[arg-type]
    memory = setup.engine.model.rows.weight.data_ptr()
    for seed in (1, 2):
        weights = new_weights(seed)

        def send(rank: int, s: ReshardSender, w: dict[str, torch.Tensor] = weights) -> int:
            return s.send(local(w, rank)).nbytes

        report, sent = setup.refit(send)
        assert "error" not in report, report
        params = dict(setup.engine.model.named_parameters())
        for name, tensor in weights.items():
            assert torch.equal(params[name].detach(), tensor), name
        assert setup.engine.model.rows.weight.data_ptr() == memory  # received in place
        whole = sum(t.nbytes for t in weights.values())
        assert report["received_bytes"] == whole
        assert sum(sent) == whole  # type: ignore[arg-type]
        assert report["direct"] == 3


def test_ranks_that_planned_differently_are_refused_before_anything_moves(setup: Setup) -> None:
    shards = shards_of(setup.answers)  # type: ignore[arg-type]
    setup.senders[0].plan(shards)
    setup.senders[1].plan([s for s in shards if s.param != "norm"])
    before = setup.engine.model.rows.weight.detach().clone()
    weights = new_weights(3)
    report, sent = setup.refit(lambda rank, s: s.send(local(weights, rank)))
    assert report["error"] == "manifest"
    assert "trainer rank 1 planned another reshard refit" in str(report["message"])
    assert all(isinstance(o, RefitError) for o in sent), sent
    assert torch.equal(setup.engine.model.rows.weight.detach(), before)
    # the group is still usable
    setup.senders[1].plan(shards)
    report, _ = setup.refit(lambda rank, s: s.send(local(weights, rank)))
    assert "error" not in report, report


def test_a_failure_after_the_shards_landed_fails_the_refit_on_every_rank(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Post-load processing that raises is the refit's failure: the engine reports it and
    every trainer rank is told (it was once swallowed, and every rank saw success)."""
    from genworker.shell.refit import engine

    shards = shards_of(setup.answers)  # type: ignore[arg-type]
    for sender in setup.senders:
        sender.plan(shards)
    weights = new_weights(5)

    def broken(self: object, names: object) -> None:
        raise RuntimeError("post-load processing broke")

    with monkeypatch.context() as m:
        m.setattr(engine.EngineSink, "finish", broken)
        report, sent = setup.refit(lambda rank, s: s.send(local(weights, rank)))
    assert "error" in report, report
    assert "post-load processing broke" in str(report["message"])
    assert all(isinstance(o, RefitError) for o in sent), sent
    assert all("post-load processing broke" in str(o) for o in sent), sent
    report, sent = setup.refit(lambda rank, s: s.send(local(weights, rank)))  # usable again
    assert "error" not in report, report


def test_an_engine_whose_plan_differs_names_itself(setup: Setup) -> None:
    shards = [s for s in shards_of(setup.answers) if s.param != "cols.weight"]  # type: ignore[arg-type]
    for sender in setup.senders:
        sender.plan(shards)
    weights = new_weights(4)
    report, sent = setup.refit(lambda rank, s: s.send(local(weights, rank)))
    assert report["error"] == "manifest"
    assert "engine rank 2 (stage 0) planned another reshard refit" in str(report["message"])
    assert all(isinstance(o, RefitError) and "rank 2" in str(o) for o in sent), sent


def test_a_trainer_that_never_sends_is_a_timeout_and_a_refit_needs_its_setup(
    setup: Setup,
) -> None:
    fresh = StandIn()
    assert fresh.nccl_reshard_refit(1.0)["error"] == "state"
    one_stage = reshard_join(0, ["h"], [1], 1, 1, 2).unwrap().to_wire()
    wire = {**one_stage, "pp_ports": [1, 2]}  # two ports for one stage
    assert fresh.init_nccl_reshard_comm_group(wire)["error"] == "argument"
    assert (
        fresh.prepare_nccl_reshard_refit_info({"version": 9, "stages": []})["error"] == "manifest"
    )
    for sender in setup.senders:
        sender.plan(shards_of(setup.answers))  # type: ignore[arg-type]
    report = setup.engine.nccl_reshard_refit(1.0)
    assert report["error"] == "timeout", report
