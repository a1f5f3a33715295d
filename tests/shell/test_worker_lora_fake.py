"""The workers' adapter-refit rules on the fake engine (its extension answering the
``lora`` backend's verbs as the real one does): preconditions, the version, the adapters
served and each row's adapter in its request; a failure leaves all of it alone. The
real engine's side: tests/shell/test_worker_lora_engine.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import base_config, right_padded

from genworker.core import lifecycle
from genworker.core.lora import LoraRef
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    EngineStateError,
    RefitError,
)
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.refit.wire import failure
from genworker.shell.worker import VllmGenerationWorker

INFO = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ((8, 16), torch.float32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": ((16, 8), torch.float32),
}
PEFT = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}


def lora_worker(fail: list[bool]) -> tuple[VllmGenerationWorker, FakeEngine, list[Any]]:
    factory = FakeEngineFactory(max_model_len=32)
    worker = VllmGenerationWorker(base_config(), engine_factory=factory)
    engine = factory.started[-1][1]
    calls: list[Any] = []

    def init(backend: str, *args: object) -> object:
        calls.append(("init", backend, args))
        return "ipc:///tmp/fake-lora.sock"

    def receive(backend: str, name: str, timeout_s: float, transport: str) -> object:
        calls.append(("receive", backend, name, timeout_s, transport))
        if fail and fail.pop(0):
            return failure(RefitError("the trainer aborted the refit"))
        return {"adapter": name, "lora_int_id": 1, "refits": len(calls)}

    engine.rpc_handlers["refit_init"] = init
    engine.rpc_handlers["refit_receive"] = receive
    return worker, engine, calls


def test_update_lora_needs_prepare_lora_and_a_good_name() -> None:
    worker, _, calls = lora_worker([])
    with pytest.raises(EngineStateError, match="needs prepare_lora first"):
        worker.update_lora("policy")
    worker.prepare_lora(INFO, PEFT)
    with pytest.raises(BadArgumentError, match="adapter name"):
        worker.update_lora("bad name")
    with pytest.raises(BadArgumentError):
        worker.update_lora("policy", timeout_s=-1)
    assert [c[0] for c in calls] == ["init"]
    assert calls[0][1] == "lora"
    assert worker.weight_version == 0


def test_a_refit_counts_a_version_and_serves_the_name_a_failed_one_changes_nothing() -> None:
    worker, engine, _ = lora_worker([False, True])
    worker.prepare_lora(INFO, PEFT)
    assert worker.update_lora("policy", timeout_s=5.0) is True
    assert worker.weight_version == 1
    assert worker.lora_adapters == {"policy": 1}
    assert worker.last_refit["adapter"] == "policy"
    with pytest.raises(RefitError, match="the trainer aborted"):
        worker.update_lora("policy", timeout_s=5.0)
    assert worker.weight_version == 1
    assert worker.state is lifecycle.AWAKE  # the base weights were never touched
    out = worker.generate({**right_padded([[1, 2, 3], [4, 5]]), "lora_names": ["policy", None]})
    assert int(out["weight_versions"].max()) == 1
    adapters = [spec.adapter for _, spec in engine.requests[-2:]]
    assert adapters == [LoraRef("policy", 1), None]
    base = worker.generate(right_padded([[1, 2, 3], [4, 5]]))
    assert not torch.equal(out["output_ids"][0], base["output_ids"][0])  # under the adapter
    assert torch.equal(out["output_ids"][1], base["output_ids"][1])


def test_an_adapter_refit_over_the_collective_needs_the_group_and_names_its_transport() -> None:
    worker, engine, calls = lora_worker([])
    worker.prepare_lora(INFO, PEFT)
    with pytest.raises(BadArgumentError, match="transport must be one of"):
        worker.update_lora("policy", timeout_s=5.0, transport="nccl")
    with pytest.raises(EngineStateError, match="needs init_collective first"):
        worker.update_lora("policy", timeout_s=5.0, transport="collective")
    assert [c[0] for c in calls] == ["init"]
    assert worker.weight_version == 0
    engine.rpc_handlers["init_collective"] = lambda *args: {"rank": 1}
    worker.init_collective(0, "127.0.0.1", 29500, 2, 1, timeout_s=5.0)
    assert worker.update_lora("policy", timeout_s=5.0, transport="collective") is True
    assert calls[-1] == ("receive", "lora", "policy", 5.0, "collective")
    assert worker.weight_version == 1


def test_a_batch_naming_an_adapter_not_served_is_refused() -> None:
    worker, _, _ = lora_worker([])
    with pytest.raises(BadBatchError, match="no adapter 'policy' is served here"):
        worker.generate({**right_padded([[1, 2, 3]]), "lora": "policy"})
    with pytest.raises(BadBatchError, match="not both"):
        worker.generate({**right_padded([[1, 2, 3]]), "lora": "a", "lora_names": ["a"]})
