"""Refits into a tensor-parallel engine: TP=2 on CPU (vLLM's multiprocess executor, gloo).

Each engine worker holds half of every sharded parameter. Over IPC every worker has its
own address and the trainer sends each the whole checkpoint; over a collective the
trainer (rank 0) broadcasts once to both workers (ranks 1 and 2). Either way every rank
must load its own half: new weights change the tokens, and sending the engine's first
weights back gives exactly its first tokens again (a rank that loaded the wrong half, or
nothing, would not).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from refit_helpers import (
    REFIT_TIMEOUT,
    Engine,
    Trainer,
    free_port,
    greedy,
    info,
    start_tp_engine,
    stop_tp_engine,
)
from safetensors.torch import load_file

from genworker.core.joins import group_join
from genworker.demo.tiny_model import build_tiny_model
from genworker.shell.refit import RefitSender

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tp") / "tiny-llama-b", seed=1)


@pytest.fixture(scope="module")
def tp_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    llm = start_tp_engine(tiny_model_dir, 2)
    try:
        yield Engine(llm, greedy(llm))
    finally:
        stop_tp_engine(llm)


def send_to_every_rank(addresses: list[object], path: Path) -> list[int]:
    """The whole checkpoint to each engine worker's address, at once (one thread each)."""
    tensors = load_file(path / "model.safetensors")
    manifest = {n: (t.shape, t.dtype) for n, t in tensors.items()}
    sent: dict[int, int] = {}
    errors: list[BaseException] = []

    def send(rank: int, address: str) -> None:
        try:
            with RefitSender.ipc(address, manifest=manifest, timeout_s=REFIT_TIMEOUT) as sender:
                sent[rank] = sender.send(tensors.items()).tensors
        except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(e)

    threads = [
        threading.Thread(target=send, args=(rank, str(address)), daemon=True)
        for rank, address in enumerate(addresses)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REFIT_TIMEOUT + 30)
        assert not thread.is_alive(), "HUNG: a sender did not finish"
    if errors:
        raise errors[0]
    return [sent[rank] for rank in range(len(addresses))]


def test_an_ipc_refit_reaches_both_tensor_parallel_ranks(
    tp_engine: Engine, tiny_model_dir: Path, checkpoint_b: Path
) -> None:
    summaries = tp_engine.rpc_all("prepare_refit_info", info(checkpoint_b / "model.safetensors"))
    assert len(summaries) == 2
    addresses = tp_engine.rpc_all("refit_address")
    assert len(set(map(str, addresses))) == 2  # one socket per engine worker
    for path, expect_baseline in ((checkpoint_b, False), (tiny_model_dir, True)):
        with ThreadPoolExecutor(1) as pool:
            engine_side = pool.submit(
                tp_engine.rpc_all, "update_weights_via_ipc_zmq", timeout_s=REFIT_TIMEOUT
            )
            sent = send_to_every_rank(addresses, path)
            reports = engine_side.result(timeout=REFIT_TIMEOUT + 30)
        tensors = len(load_file(path / "model.safetensors"))
        assert sent == [tensors, tensors]
        for report in reports:
            assert isinstance(report, dict)
            assert report["tensors"] == tensors
            assert report["loaded"] > 0  # sharded tensors go through each rank's loader
        tokens = tp_engine.tokens()
        assert (tokens == tp_engine.baseline_a) == expect_baseline, tokens


def test_a_collective_refit_reaches_both_tensor_parallel_ranks(
    tp_engine: Engine, tiny_model_dir: Path, checkpoint_b: Path
) -> None:
    trainer = Trainer()
    try:
        port = free_port()
        trainer.submit("join", port=port, world_size=3)  # trainer 0, engine workers 1 and 2
        join = group_join(0, "127.0.0.1", port, 3, 1).unwrap()
        tp_engine.rpc_all("init_collective", join.to_wire())
        joined = trainer.result()
        assert joined.ok, joined
        tp_engine.rpc_all("prepare_refit_info", info(checkpoint_b / "model.safetensors"))
        for path, expect_baseline in ((checkpoint_b, False), (tiny_model_dir, True)):
            trainer.submit("collective", path=str(path / "model.safetensors"))
            reports = tp_engine.rpc_all("update_weights_from_collective", timeout_s=REFIT_TIMEOUT)
            sent = trainer.result()
            assert sent.ok, sent
            for report in reports:
                assert isinstance(report, dict)
                assert report["loaded"] > 0  # sharded parameters never go direct here
                assert report["direct"] > 0  # the replicated ones (norms) still do
            tokens = tp_engine.tokens()
            assert (tokens == tp_engine.baseline_a) == expect_baseline, tokens
    finally:
        trainer.stop()
