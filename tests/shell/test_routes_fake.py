"""MoE routing replay (R3) through every front, on the fake engines' capture: the sync
worker, the async worker (whole batch and streamed rows), NeMo-RL's drop-ins and the Ray
group's merged output all return the same ``routed_experts`` from one output assembly."""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from async_helpers import async_config, collect, outputs
from helpers import base_config, right_padded

from genworker.core.assembly import FlatGenerations
from genworker.core.fake_model import fake_routes
from genworker.core.routing import FILL, MoeShape, RoutedExperts
from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import BadConfigError, EngineContractError
from genworker.shell.fake_async_engine import FakeAsyncEngineFactory
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.nemo_rl import NemoRlGenerationWorker
from genworker.shell.worker import VllmGenerationWorker

MOE = MoeShape(num_layers=2, top_k=2, num_experts=4)
ROUTES = {"enable_return_routed_experts": True}
ROWS = [[3, 4, 5], [6], [7, 8, 9, 10, 11]]


def _sync(routes: bool = True, **engine: Any) -> tuple[VllmGenerationWorker, FakeEngine]:
    factory = FakeEngineFactory(max_model_len=32, moe=MOE, **engine)
    cfg = base_config(vllm_cfg=ROUTES if routes else {})
    worker = VllmGenerationWorker(cfg, engine_factory=factory)
    return worker, factory.started[0][1]


def _expected(out: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    """What the fake routed, laid out as the contract says (by hand, row by row)."""
    ids = out["output_ids"]
    dense = torch.full((*ids.shape, MOE.num_layers, MOE.top_k), FILL, dtype=torch.int8)
    for row in range(ids.shape[0]):
        end = int(out["unpadded_sequence_lengths"][row])
        prompt = end - int(out["generation_lengths"][row])
        sequence = ids[row, :end].tolist()
        assert prompt <= end
        routes = fake_routes(MOE, seed, sequence, [0] * end).experts
        dense[row, : end - 1] = torch.from_numpy(routes.astype(np.int8))
    return dense


def test_the_sync_worker_returns_routes_aligned_with_output_ids() -> None:
    worker, engine = _sync()
    out = worker.generate(right_padded(ROWS))
    routes = out["routed_experts"]
    assert routes.dtype == torch.int8
    assert tuple(routes.shape) == (*out["output_ids"].shape, 2, 2)
    assert torch.equal(routes, _expected(out, engine.seed))
    # every forwarded position holds distinct experts in range; the rest is FILL
    assert bool((routes[:, :, :, 0] != routes[:, :, :, 1]).logical_or(routes[..., 0] == FILL).all())
    worker.shutdown()


def test_without_the_switch_there_are_no_routes_and_the_engine_is_not_asked() -> None:
    worker, engine = _sync(routes=False)
    assert engine.capabilities.routes is None
    assert "routed_experts" not in worker.generate(right_padded(ROWS))
    worker.shutdown()


def test_the_switch_without_an_moe_model_fails_to_start() -> None:
    factory = FakeEngineFactory(max_model_len=32)
    with pytest.raises(BadConfigError, match="needs an MoE model"):
        VllmGenerationWorker(base_config(vllm_cfg=ROUTES), engine_factory=factory)


def test_nemo_rl_s_switch_in_vllm_kwargs_turns_it_on() -> None:
    factory = FakeEngineFactory(max_model_len=32, moe=MOE)
    cfg = base_config(vllm_kwargs={"enable_return_routed_experts": True})
    worker = VllmGenerationWorker(cfg, engine_factory=factory)
    kwargs = factory.started[0][0]
    assert kwargs["enable_return_routed_experts"] is True
    assert "routed_experts" in worker.generate(right_padded(ROWS))
    worker.shutdown()


@pytest.mark.parametrize("broken", [0, 2])
def test_engine_routes_of_the_wrong_shape_are_refused_by_row(broken: int) -> None:
    worker, engine = _sync()
    real = engine.generate

    def short(*args: Any, **kwargs: Any) -> FlatGenerations:
        flat = real(*args, **kwargs)
        assert flat.routed_experts is not None
        routes = list(flat.routed_experts)
        bad = routes[broken]
        assert bad is not None
        routes[broken] = RoutedExperts(MOE, bad.experts[:-1])  # one position missing
        return attrs.evolve(flat, routed_experts=tuple(routes))

    engine.generate = short  # type: ignore[method-assign]
    with pytest.raises(EngineContractError, match=f"row {broken}:") as raised:
        worker.generate(right_padded(ROWS))
    assert "prompt + generated - 1" in str(raised.value)
    engine.generate = real  # type: ignore[method-assign]
    assert "routed_experts" in worker.generate(right_padded(ROWS))  # the worker is usable
    worker.shutdown()


def test_nemo_rl_s_drop_in_returns_routes_in_nemo_rl_s_layout() -> None:
    factory = FakeEngineFactory(max_model_len=32, moe=MOE)
    member = NemoRlGenerationWorker(base_config(vllm_cfg=ROUTES), [0], engine_factory=factory)
    out = member.generate(right_padded(ROWS))
    ours = _expected(out, factory.started[0][1].seed)
    theirs = out["routed_experts"]
    assert theirs.dtype == torch.int8
    unrouted = (ours == FILL).all(dim=3).all(dim=2)
    assert torch.equal(theirs[~unrouted], ours[~unrouted])
    assert bool((theirs[unrouted] == torch.arange(2, dtype=torch.int8)).all())
    member.shutdown()


def test_the_async_worker_returns_routes_for_the_batch_and_each_streamed_row() -> None:
    async def main() -> None:
        factory = FakeAsyncEngineFactory(max_model_len=32, moe=MOE)
        cfg = async_config(max_new_tokens=6, vllm_cfg={"max_model_len": 32, **ROUTES})
        worker = AsyncVllmGenerationWorker(cfg, engine_factory=factory)
        seed = factory.started[0][1].seed
        data = right_padded(ROWS)
        batch = await worker.generate(data)
        assert torch.equal(batch["routed_experts"], _expected(batch, seed))
        items = await collect(worker.generate_async(data))
        for row, out in outputs(items).items():
            end = int(out["unpadded_sequence_lengths"][0])
            assert tuple(out["routed_experts"].shape) == (1, end, 2, 2)
            assert torch.equal(out["routed_experts"], _expected(out, seed))
            assert torch.equal(batch["routed_experts"][row, :end], out["routed_experts"][0])
        await worker.shutdown()

    asyncio.run(main())


@pytest.mark.ray
def test_the_group_merges_each_shard_s_routes_with_its_rows() -> None:
    ray = pytest.importorskip("ray")
    from genworker.shell.group import ClusterSpec, GenerationGroup

    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    cfg = base_config(vllm_cfg=ROUTES)
    group = GenerationGroup(
        cfg,
        ClusterSpec(num_shards=2, cpus_per_node=2, start_timeout_s=300, call_timeout_s=120),
        worker_options={"engine_factory": FakeEngineFactory(max_model_len=32, moe=MOE)},
    )
    try:
        rows = [[3, 4, 5], [6], [7, 8, 9, 10, 11], [12, 13]]
        merged = group.generate(right_padded(rows), greedy=True)
        assert tuple(merged["routed_experts"].shape) == (*merged["output_ids"].shape, 2, 2)
        # each shard's engine has its own seed (core.placement); every row's routes are
        # the fake's for that row's own tokens under one of them, FILL past them
        by_seed = {seed: _expected(merged, seed) for seed in range(4)}
        for row in range(len(rows)):
            assert any(torch.equal(merged["routed_experts"][row], e[row]) for e in by_seed.values())
    finally:
        group.shutdown()
        ray.shutdown()
