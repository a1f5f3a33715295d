"""Trainer TP=2 to engine TP=1 through the worker's three reshard methods, on the
session's CPU engine: two trainer processes each send half of every sharded tensor; the
single engine rank receives every byte of the checkpoint once. Greedy tokens follow the
weights sent (another checkpoint changes them; the engine's own restores exactly those of
the fresh engine)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import base_config
from refit_helpers import PROMPTS, REFIT_TIMEOUT, free_port
from reshard_helpers import ReshardTrainer
from safetensors.torch import load_file, save_file
from vllm import LLM

from genworker.core.engine_calls import Cache
from genworker.demo.tiny_model import build_tiny_model
from genworker.shell.errors import BadArgumentError, RefitError, RefitManifestError
from genworker.shell.refit.reshard import bytes_of, shards_of
from genworker.shell.vllm_engine import VllmEngine
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


@pytest.fixture
def worker(cpu_engine: VllmEngine) -> Iterator[VllmGenerationWorker]:
    cfg = base_config(
        model_name="tiny", vllm_cfg={"gpu_memory_utilization": 0.05, "max_model_len": 64}
    )
    yield VllmGenerationWorker(cfg, engine_factory=ExistingEngine(cpu_engine))
    cpu_engine.reset_cache(Cache.PREFIX)


def tokens(llm: LLM) -> list[list[int]]:
    from refit_helpers import greedy

    llm.reset_prefix_cache()
    return greedy(llm)


def test_two_trainer_ranks_refit_a_single_rank_engine_through_the_worker(
    worker: VllmGenerationWorker, cpu_llm: LLM, tiny_model_dir: Path, tmp_path: Path
) -> None:
    baseline = tokens(cpu_llm)
    other = build_tiny_model(tmp_path / "tiny-llama-b", seed=1)
    trainers = [ReshardTrainer(r, 2) for r in range(2)]
    try:
        for t in trainers:
            t.ready()
        port = free_port()
        for t in trainers:
            t.submit(
                "join", path=str(tiny_model_dir / "model.safetensors"), port=port, world_size=3
            )
        worker.init_nccl_reshard_comm_group(
            0, ["127.0.0.1"], [port], 1, 2, 3, timeout_s=REFIT_TIMEOUT
        )
        joined = [t.result() for t in trainers]
        assert all(o.ok for o in joined), joined
        summaries = worker.prepare_nccl_reshard_refit_info(joined[0].detail["info"])  # type: ignore[arg-type]
        shards = shards_of(summaries)
        for t in trainers:
            t.submit("plan", summaries=summaries)
        assert all(t.result().ok for t in trainers)
        whole = sum(t.nbytes for t in load_file(tiny_model_dir / "model.safetensors").values())
        assert bytes_of(shards, 0) == whole  # TP=1: every byte, once
        for path, expect_baseline in ((other, False), (tiny_model_dir, True)):
            for t in trainers:
                t.submit("send", path=str(path / "model.safetensors"))
            assert worker.nccl_reshard_refit(REFIT_TIMEOUT) is True  # the trainers run apart
            sent = [t.result() for t in trainers]
            assert all(o.ok for o in sent), sent
            reports = worker.last_refit["engine_workers"]
            assert isinstance(reports, list)
            assert [r["received_bytes"] for r in reports] == [whole]
            assert sum(int(o.detail["nbytes"]) for o in sent) == whole  # type: ignore[call-overload]
            assert all(0 < int(o.detail["nbytes"]) < whole for o in sent)  # type: ignore[call-overload]
            assert (tokens(cpu_llm) == baseline) == expect_baseline
            assert len(baseline) == len(PROMPTS)
    finally:
        cpu_llm.collective_rpc("close_nccl_reshard_comm_group")  # the session engine lives on
        for t in trainers:
            t.stop()


def test_a_bad_refit_info_is_refused_at_prepare_naming_it_then_a_good_refit(
    worker: VllmGenerationWorker, cpu_llm: LLM, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 44 item 5: a list is a BadArgumentError naming refit_info; a layout naming
    trainer rank 5 of a 2-rank group is refused at prepare naming the layout (it used to
    pass, and the refit waited its whole bound); then a good refit serves."""
    baseline = tokens(cpu_llm)
    other = build_tiny_model(tmp_path / "tiny-llama-b", seed=1)
    trainers = [ReshardTrainer(r, 2) for r in range(2)]
    try:
        for t in trainers:
            t.ready()
        port = free_port()
        for t in trainers:
            t.submit(
                "join", path=str(tiny_model_dir / "model.safetensors"), port=port, world_size=3
            )
        worker.init_nccl_reshard_comm_group(
            0, ["127.0.0.1"], [port], 1, 2, 3, timeout_s=REFIT_TIMEOUT
        )
        joined = [t.result() for t in trainers]
        assert all(o.ok for o in joined), joined
        with pytest.raises(BadArgumentError, match=r"refit_info must be a mapping.*\[1, 2, 3\]"):
            worker.prepare_nccl_reshard_refit_info([1, 2, 3])  # type: ignore[arg-type]
        info = joined[0].detail["info"]
        assert isinstance(info, dict)
        bad = copy.deepcopy(info)
        layout = bad["stages"][0][0]
        layout["shards"][-1]["rank"] = 5
        with pytest.raises(RefitManifestError) as refused:
            worker.prepare_nccl_reshard_refit_info(bad)
        assert repr(layout["name"]) in str(refused.value)
        assert "trainer rank(s) [5]" in str(refused.value)
        assert "2 trainer rank(s)" in str(refused.value)
        assert tokens(cpu_llm) == baseline  # nothing changed, still served
        summaries = worker.prepare_nccl_reshard_refit_info(info)
        for t in trainers:
            t.submit("plan", summaries=summaries)
        assert all(t.result().ok for t in trainers)
        # Issue 44 item 1 on this wire too: a NaN refit is refused, every rank told.
        state = load_file(tiny_model_dir / "model.safetensors")
        state["model.norm.weight"] = state["model.norm.weight"].clone()
        state["model.norm.weight"][0] = float("nan")
        save_file(state, tmp_path / "nan.safetensors")
        for t in trainers:
            t.submit("send", path=str(tmp_path / "nan.safetensors"))
        with pytest.raises(RefitError, match=r"non-finite values .*'model\.norm\.weight'"):
            worker.nccl_reshard_refit(REFIT_TIMEOUT)
        assert not any(t.result().ok for t in trainers)
        for path, expect_baseline in ((other, False), (tiny_model_dir, True)):
            for t in trainers:
                t.submit("send", path=str(path / "model.safetensors"))
            assert worker.nccl_reshard_refit(REFIT_TIMEOUT) is True
            assert all(t.result().ok for t in trainers)
            assert (tokens(cpu_llm) == baseline) == expect_baseline
    finally:
        cpu_llm.collective_rpc("close_nccl_reshard_comm_group")  # the session engine lives on
        for t in trainers:
            t.stop()
