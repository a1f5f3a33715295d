"""The worker's reshard methods over the fake engine: what they forward to the engine
workers, the bounds they derive, and the refit lifecycle (refused before it starts, weights
inconsistent after a failure until a good refit)."""

from __future__ import annotations

import pytest
from helpers import base_config
from helpers import right_padded as batch

from genworker.core.engine_calls import RpcCall
from genworker.core.joins import reshard_join
from genworker.core.refit_protocol import RENDEZVOUS_WAITS, Transport, refit_waits, rpc_bound
from genworker.shell.errors import BadArgumentError, EngineStateError, RefitError
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.worker import VllmGenerationWorker


def make_worker() -> tuple[VllmGenerationWorker, FakeEngine]:
    factory = FakeEngineFactory(max_model_len=32)
    worker = VllmGenerationWorker(base_config(), engine_factory=factory)
    return worker, factory.started[-1][1]


def test_the_three_methods_reach_the_engine_workers_with_derived_bounds() -> None:
    worker, engine = make_worker()
    calls: list[object] = []
    timeouts: list[float | None] = []
    original = engine.collective_rpc

    def spy(call: RpcCall) -> list[object]:
        timeouts.append(call.timeout)
        return original(call)

    engine.collective_rpc = spy  # type: ignore[method-assign]
    for name in (
        "init_nccl_reshard_comm_group",
        "prepare_nccl_reshard_refit_info",
        "nccl_reshard_refit",
    ):

        def handler(*a: object, _n: str = name, **k: object) -> dict[str, object]:
            calls.append((_n, a, k))
            return {"params": 3}

        engine.rpc_handlers[name] = handler

    worker.init_nccl_reshard_comm_group(
        0, ["10.0.0.1", "10.0.0.2"], [1234, 1235], 2, 4, 6, timeout_s=7
    )
    assert calls.pop() == (
        "init_nccl_reshard_comm_group",
        (
            {
                "rank_prefix": 0,
                "pp_ips": ["10.0.0.1", "10.0.0.2"],
                "pp_ports": [1234, 1235],
                "pp_size": 2,
                "train_ranks_per_stage": 4,
                "sub_world_size": 6,
                "timeout_s": 7.0,
                "device": None,
            },
        ),
        {},
    )
    assert timeouts[-1] == rpc_bound(2 * RENDEZVOUS_WAITS, 7.0)
    assert worker.prepare_nccl_reshard_refit_info({"version": 1, "stages": []}) == [{"params": 3}]
    assert calls.pop() == ("prepare_nccl_reshard_refit_info", ({"version": 1, "stages": []},), {})
    assert worker.nccl_reshard_refit(refit_timeout_s=5) is True
    assert calls.pop() == ("nccl_reshard_refit", (), {"refit_timeout_s": 5.0})
    assert timeouts[-1] == rpc_bound(2 * refit_waits(1, Transport.COLLECTIVE), 5.0)
    assert worker.last_refit["engine_workers"] == [{"params": 3}]
    assert worker.nccl_reshard_refit() is True  # None: the protocol's default bound
    assert calls.pop() == ("nccl_reshard_refit", (), {"refit_timeout_s": 300.0})
    # gloo over host memory on any engine (trainer ranks on the engine's own GPU)
    worker.init_nccl_reshard_comm_group(0, ["h"], [1], 1, 2, 3, timeout_s=7, device="cpu")
    wire = reshard_join(0, ["h"], [1], 1, 2, 3, 7.0, "cpu").unwrap().to_wire()
    assert calls.pop() == ("init_nccl_reshard_comm_group", (wire,), {})
    with pytest.raises(BadArgumentError, match=r"device must be None .* got 'cuda'"):
        worker.init_nccl_reshard_comm_group(0, ["h"], [1], 1, 2, 3, device="cuda")
    with pytest.raises(BadArgumentError, match=r"pp_size=1 with 1 ip\(s\) and 2 port\(s\)"):
        worker.init_nccl_reshard_comm_group(0, ["h"], [1, 2], 1, 2, 3)
    assert not calls  # refused before the engine workers


def test_a_reshard_refit_is_refused_before_its_setup_and_a_failure_leaves_the_weights_inconsistent() -> (
    None
):
    worker, engine = make_worker()
    engine.rpc_handlers["init_nccl_reshard_comm_group"] = lambda *a: {"rank": 2, "stages": 1}
    engine.rpc_handlers["prepare_nccl_reshard_refit_info"] = lambda info: {"params": 1}
    engine.rpc_handlers["nccl_reshard_refit"] = lambda refit_timeout_s: {
        "error": "manifest",
        "message": "trainer rank 1's shard of 'w' is missing",
    }
    with pytest.raises(EngineStateError, match="init_nccl_reshard_comm_group first"):
        worker.nccl_reshard_refit()
    with pytest.raises(BadArgumentError, match="timeout_s"):
        worker.init_nccl_reshard_comm_group(0, ["h"], [1], 1, 2, 3, timeout_s=-1)
    worker.init_nccl_reshard_comm_group(0, ["h"], [1], 1, 2, 3)
    with pytest.raises(EngineStateError, match="prepare_nccl_reshard_refit_info first"):
        worker.nccl_reshard_refit()
    worker.prepare_nccl_reshard_refit_info({"version": 1, "stages": []})
    with pytest.raises(BadArgumentError, match="timeout_s"):
        worker.nccl_reshard_refit(refit_timeout_s=float("nan"))
    worker.generate(batch([[4, 5]]))  # refused refits change nothing
    with pytest.raises(RefitError, match="shard of 'w' is missing"):
        worker.nccl_reshard_refit()
    with pytest.raises(EngineStateError, match=r"(?i)refit"):
        worker.generate(batch([[4, 5]]))
    engine.rpc_handlers["nccl_reshard_refit"] = lambda refit_timeout_s: engine.load_new_weights()
    resets = engine.prefix_cache_resets
    assert worker.nccl_reshard_refit() is True
    assert engine.prefix_cache_resets == resets + 1
    worker.generate(batch([[4, 5]]))


def test_an_engine_failure_of_init_is_raised_and_the_refit_still_refused() -> None:
    worker, engine = make_worker()
    engine.rpc_handlers["init_nccl_reshard_comm_group"] = lambda *a: {
        "error": "timeout",
        "message": "ranks [0] never joined within 1s",
    }
    engine.rpc_handlers["prepare_nccl_reshard_refit_info"] = lambda info: {"params": 1}
    with pytest.raises(RefitError, match="never joined"):
        worker.init_nccl_reshard_comm_group(0, ["h"], [1], 1, 1, 2, timeout_s=1)
    worker.prepare_nccl_reshard_refit_info({"version": 1, "stages": []})
    with pytest.raises(EngineStateError, match="init_nccl_reshard_comm_group first"):
        worker.nccl_reshard_refit()
