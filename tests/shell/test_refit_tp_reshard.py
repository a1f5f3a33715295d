"""The reshard refit into a TP=2 CPU engine (vLLM's multiprocess executor, gloo): two
trainer processes (Megatron TP=2 shards, or ``DTensor`` ``Shard(0)`` on a gloo mesh), or
one (TP=1), each send only the slices they hold, straight to the engine rank that keeps
them; the engine's fused ``qkv_proj`` / ``gate_up_proj`` split differs from both.

Greedy tokens after a refit of the engine's own checkpoint equal those of the fresh engine
loaded with it; a refit of another checkpoint changes them and equals that checkpoint sent
whole over IPC to every rank. Every engine rank counts the bytes it received: exactly its
shards' (1/TP of every sharded parameter). A missing or misshaped shard is a typed error
on every rank, naming the parameter and the ranks, and leaves the group usable.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from refit_helpers import (
    REFIT_TIMEOUT,
    Engine,
    Outcome,
    free_port,
    greedy,
    start_tp_engine,
    stop_tp_engine,
)
from reshard_helpers import ReshardTrainer
from safetensors.torch import load_file

from genworker.core.joins import reshard_join
from genworker.core.reshard import box_numel
from genworker.demo.tiny_model import build_tiny_model
from genworker.shell.errors import RefitManifestError
from genworker.shell.refit import RefitSender
from genworker.shell.refit.reshard import bytes_of, shards_of

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

TP = 2


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("reshard") / "tiny-llama-b", seed=1)


@pytest.fixture(scope="module")
def tp_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    llm = start_tp_engine(tiny_model_dir, TP)
    try:
        yield Engine(llm, greedy(llm))
    finally:
        stop_tp_engine(llm)


class Session:
    """Trainer processes joined to the engine's reshard group, with a plan."""

    def __init__(self, engine: Engine, world: int, path: Path, style: str) -> None:
        self.engine, self.trainers = engine, [ReshardTrainer(r, world) for r in range(world)]
        for t in self.trainers:
            t.ready()
        port, mesh_port = free_port(), free_port()
        for t in self.trainers:
            t.submit(
                "join",
                path=str(path),
                port=port,
                world_size=world + TP,
                style=style,
                mesh_port=mesh_port,
            )
        join = reshard_join(0, ["127.0.0.1"], [port], 1, world, world + TP, REFIT_TIMEOUT)
        joined = engine.rpc_all("init_nccl_reshard_comm_group", join.unwrap().to_wire())
        assert [j["rank"] for j in joined] == [world, world + 1]  # type: ignore[index]
        outcomes = [t.result() for t in self.trainers]
        assert all(o.ok for o in outcomes), outcomes
        self.info = outcomes[0].detail["info"]
        self.summaries = engine.rpc_all("prepare_nccl_reshard_refit_info", self.info)
        for t in self.trainers:
            t.submit("plan", summaries=self.summaries)
        planned = [t.result() for t in self.trainers]
        assert all(o.ok for o in planned), planned
        self.shards = shards_of(self.summaries)

    def refit(self, path: Path, **fault: object) -> tuple[list[object], list[Outcome]]:
        """Every trainer rank sends (rank 1 with ``fault``); the engine's and the
        trainers' outcomes."""
        for rank, t in enumerate(self.trainers):
            t.submit("send", path=str(path), **(fault if rank == 1 else {}))
        reports = self.engine.llm.collective_rpc(
            "nccl_reshard_refit", kwargs={"refit_timeout_s": REFIT_TIMEOUT}
        )
        return list(reports), [t.result() for t in self.trainers]

    def stop(self) -> None:
        assert self.engine.rpc_all("close_nccl_reshard_comm_group") == [1] * TP
        for t in self.trainers:
            t.stop()


def ipc_tokens(engine: Engine, path: Path) -> list[list[int]]:
    """The checkpoint sent whole to every engine rank over IPC (the proven path)."""
    tensors = load_file(path / "model.safetensors")
    engine.rpc_all(
        "prepare_refit_info", {n: [list(t.shape), "float32"] for n, t in tensors.items()}
    )
    addresses = engine.rpc_all("refit_address")

    def send(address: object) -> int:
        with RefitSender.ipc(str(address), timeout_s=REFIT_TIMEOUT) as sender:
            return sender.send(tensors.items()).tensors

    with ThreadPoolExecutor(1 + len(addresses)) as pool:
        side = pool.submit(engine.rpc_all, "update_weights_via_ipc_zmq", timeout_s=REFIT_TIMEOUT)
        sent = [pool.submit(send, a) for a in addresses]
        assert [s.result(timeout=REFIT_TIMEOUT + 30) for s in sent] == [len(tensors)] * TP
        side.result(timeout=REFIT_TIMEOUT + 30)
    return engine.tokens()


def shapes(info: object) -> dict[str, tuple[int, ...]]:
    return {str(lt["name"]): tuple(lt["shape"]) for lt in info["stages"][0]}  # type: ignore[index]


def split_bytes(session: Session, rank: int) -> tuple[int, int]:
    """Engine rank ``rank``'s bytes of the evenly split parameters (every piece a part of
    its source; the vocabulary's padded split aside), and the whole of their sources."""
    full = shapes(session.info)
    own, whole = 0, set()
    for s in session.shards:
        if any(box_numel(p.source_box) == math.prod(full[p.source]) for p in s.pieces):
            continue  # replicated
        if s.padding or s.param.endswith(("embed_tokens.weight", "lm_head.weight")):
            continue
        whole |= {p.source for p in s.pieces}
        own += s.nbytes if s.rank == rank else 0
    return own, sum(math.prod(full[n]) * 4 for n in whole)


@pytest.mark.parametrize(("world", "style"), [(2, "megatron"), (2, "dtensor"), (1, "megatron")])
def test_a_reshard_refit_sends_each_engine_rank_its_shard(
    tp_engine: Engine, tiny_model_dir: Path, checkpoint_b: Path, world: int, style: str
) -> None:
    session = Session(tp_engine, world, tiny_model_dir / "model.safetensors", style)
    try:
        full = sum(t.nbytes for t in load_file(checkpoint_b / "model.safetensors").values())
        for rank in range(TP):  # exactly 1/TP of every evenly split parameter
            own, whole = split_bytes(session, rank)
            assert own > 0
            assert own * TP == whole, (own, whole)
        for path, expect_baseline in ((checkpoint_b, False), (tiny_model_dir, True)):
            reports, sent = session.refit(path / "model.safetensors")
            assert all(o.ok for o in sent), sent
            for rank, report in enumerate(reports):
                assert isinstance(report, dict)
                assert "error" not in report, report
                assert report["received_bytes"] == bytes_of(session.shards, rank)
                assert report["received_bytes"] == report["expected_bytes"]
                assert report["received_bytes"] < full  # a broadcast would carry it all
                assert report["direct"] > 0  # norms and embeddings straight into memory
                assert report["loaded"] > 0  # CPU linear weights are repacked: the loader
            sent_bytes = sum(int(o.detail["nbytes"]) for o in sent)  # type: ignore[call-overload]
            assert sent_bytes == sum(int(r["received_bytes"]) for r in reports)  # type: ignore[index, misc]
            tokens = tp_engine.tokens()
            assert (tokens == tp_engine.baseline_a) == expect_baseline, tokens
            if not expect_baseline:
                b_tokens = tokens
        assert ipc_tokens(tp_engine, checkpoint_b) == b_tokens
        assert ipc_tokens(tp_engine, tiny_model_dir) == tp_engine.baseline_a
    finally:
        session.stop()


@pytest.mark.parametrize("fault", ["drop", "reshape"])
def test_a_missing_or_misshaped_shard_is_named_on_every_rank(
    tp_engine: Engine, tiny_model_dir: Path, fault: str
) -> None:
    session = Session(tp_engine, 2, tiny_model_dir / "model.safetensors", "megatron")
    name = "model.layers.0.self_attn.q_proj.weight"
    try:
        reports, sent = session.refit(tiny_model_dir / "model.safetensors", **{fault: name})
        assert not sent[1].ok
        assert sent[1].error == "RefitManifestError", sent[1]
        assert name in sent[1].message
        assert "trainer rank 1" in sent[1].message
        assert "engine ranks [3]" in sent[1].message  # its half of q: engine rank 1 only
        assert not sent[0].ok
        assert sent[0].error == "RefitManifestError"
        for report in reports:
            assert isinstance(report, dict)
            assert report.get("error") == "manifest", report
            assert name in str(report["message"])
            assert "rank 1" in str(report["message"])
        # the group stays usable: the next refit succeeds
        reports, sent = session.refit(tiny_model_dir / "model.safetensors")
        assert all(o.ok for o in sent), sent
        assert all("error" not in r for r in reports), reports  # type: ignore[operator]
        assert tp_engine.tokens() == tp_engine.baseline_a
    finally:
        session.stop()


def test_a_layout_that_leaves_part_of_a_shard_unheld_is_refused(
    tp_engine: Engine, tiny_model_dir: Path
) -> None:
    session = Session(tp_engine, 2, tiny_model_dir / "model.safetensors", "megatron")
    try:
        info = session.info
        name = "model.layers.1.mlp.up_proj.weight"
        for layout in info["stages"][0]:  # type: ignore[index]
            if layout["name"] == name:
                layout["shards"] = [s for s in layout["shards"] if s["rank"] == 0]
        bad = {"version": 1, "stages": [[{**info["stages"][0][0], "shape": "big"}]]}  # type: ignore[index]
        with pytest.raises(RefitManifestError, match=r"malformed .*\$\.stages\[0\]\[0\]\.shape"):
            tp_engine.rpc_all("prepare_nccl_reshard_refit_info", bad)
        with pytest.raises(RefitManifestError) as caught:
            tp_engine.rpc_all("prepare_nccl_reshard_refit_info", info)
        message = str(caught.value)
        assert "model.layers.1.mlp.gate_up_proj.weight" in message
        assert name in message
        assert "ranks [1]" in message
    finally:
        session.stop()
