"""The sparse-delta refit on one GPU, the "cluster" being two processes: a trainer process
(``gpu.gpu_sparse``) sends through the relay receiver of the session worker's CUDA engine.

A full step (checkpoint B) and then a delta (one AdamW step on B's fp32 master weights,
sent as their bf16 cast): afterwards the engine holds exactly the parameters of a fresh
engine started on the saved result and generates as it does, and the delta's wire bytes
are a small part of the checkpoint's. A corrupted delta is refused by its checksum: the
worker refuses to serve, typed, until a full step, and then serves the weights sent.
Every test leaves the session worker awake, on checkpoint A, with the relay stopped
(``tests/shell/test_sparse_engine.py`` is the CPU engine's version, three receivers).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from gpu.gpu_fixtures import (
    GPU_MARKS,
    GpuSession,
    Trainer,
    engine_tensors,
    gpu_config,
    greedy,
    reference_greedy_main,
    refit_over_ipc,
    run_in_child,
)
from gpu.gpu_sparse import sparse_trainer_main

from genworker.shell.refit.sparse import SparseRefitError

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS

# A delta step's bytes on the wire (frame headers, zstd payloads) over the model's.
MAX_DELTA_WIRE_FRACTION = 0.1


def sent(trainer: Trainer, save: Path | None = None) -> dict[str, int]:
    trainer.send("send", None if save is None else str(save))
    report = trainer.expect("sent")
    assert isinstance(report, dict)
    return report


@contextmanager
def sparse_trainer(session: GpuSession, *, corrupt: bool = False) -> Iterator[Trainer]:
    """A trainer process on this GPU on checkpoint B, sending to the session engine's
    relay receiver; afterwards the relay is stopped and checkpoint A is back (by IPC)."""
    worker, ckpt = session.worker, session.checkpoints
    addresses = worker.start_zmq_sparse_refit_relay()
    assert len(addresses) == 1  # TP=1: one engine worker, one receiver
    trainer = None
    try:
        worker.configure_zmq_sparse_refit_relay(addresses)
        assert worker.report_refit_server_base_url() == addresses[0]
        trainer = Trainer(
            sparse_trainer_main,
            {"addresses": addresses, "checkpoint": str(ckpt.b), "corrupt": corrupt},
        )
        trainer.expect("ready")
        yield trainer
    finally:
        if trainer is not None:
            trainer.stop()
        worker.stop_zmq_sparse_refit_relay()
        refit_over_ipc(session, ckpt.a)
        assert greedy(worker, ckpt.pad) == session.baseline_a


def test_a_full_step_then_an_adamw_delta_match_a_fresh_engine_and_the_delta_is_small(
    gpu_session: GpuSession, reference_b: list[list[int]], tmp_path: Path
) -> None:
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    with sparse_trainer(gpu_session) as trainer:
        full = sent(trainer)
        assert full["full"]
        assert greedy(worker, ckpt.pad) == reference_b
        trainer.send("step")
        trainer.expect("stepped")
        stepped = tmp_path / "b-stepped"
        delta = sent(trainer, save=stepped)
        assert not delta["full"]
        assert 0 < delta["changed"] < delta["elements"]  # bits moved, not all of them
        assert delta["model_bytes"] == full["model_bytes"]
        assert delta["wire_bytes"] < MAX_DELTA_WIRE_FRACTION * delta["model_bytes"], delta
        assert delta["wire_bytes"] < MAX_DELTA_WIRE_FRACTION * full["wire_bytes"], (delta, full)
        got = greedy(worker, ckpt.pad)
        mine = engine_tensors(gpu_session.worker)
        fresh_params = tmp_path / "fresh-params.pt"
        fresh = run_in_child(
            reference_greedy_main,
            config=gpu_config(stepped, ckpt.pad),
            pad=ckpt.pad,
            params_path=str(fresh_params),
        )
        expected = torch.load(fresh_params)
        assert sorted(mine) == sorted(expected)
        different = [n for n, t in expected.items() if not torch.equal(mine[n], t)]
        assert not different, (
            f"parameters unlike a fresh engine's on the stepped weights: {different}"
        )
        assert got == fresh


def test_a_corrupted_delta_is_refused_typed_and_a_full_step_makes_the_worker_serve_again(
    gpu_session: GpuSession, reference_b: list[list[int]]
) -> None:
    worker, ckpt = gpu_session.worker, gpu_session.checkpoints
    with sparse_trainer(gpu_session, corrupt=True) as trainer:
        assert sent(trainer)["full"]
        assert greedy(worker, ckpt.pad) == reference_b
        trainer.send("step")
        trainer.expect("stepped")
        trainer.send("send")
        failed = trainer.expect("failed")
        assert isinstance(failed, dict)
        assert "failed its checksum" in failed["message"]
        assert failed["names"] == [worker.report_refit_server_base_url()]  # the one receiver
        for _ in range(2):  # refused until a full refit, every time
            with pytest.raises(SparseRefitError, match="failed its checksum") as caught:
                greedy(worker, ckpt.pad)
            assert "full refit" in str(caught.value)
        trainer.send("load", str(ckpt.a))
        trainer.expect("loaded")
        recovery = sent(trainer)
        assert recovery["full"]  # the sender's next step after a failed one
        assert greedy(worker, ckpt.pad) == gpu_session.baseline_a
