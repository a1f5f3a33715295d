"""The sparse-delta refit across processes: bit-equal receivers after AdamW steps, one
copy of each payload per receiver, a killed relay node named within its bound, a
corrupted payload and a diverged receiver caught and refused (the target untouched)."""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
import zmq
from sparse_helpers import run_receiver

from genworker.core.delta import Outcome, RelayFailure, bit_pattern
from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.shell.errors import BadArgumentError, BadConfigError
from genworker.shell.refit.sparse import (
    CHECKSUM,
    DictTarget,
    LinkThrottle,
    SparseReceiver,
    SparseRefitError,
    SparseSender,
    default_workers,
)

SHAPES = {
    "embed.weight": (96, 64),
    "layers.0.qkv.weight": (192, 64),
    "layers.0.mlp.weight": (256, 64),
    "norm.weight": (64,),
    "scalar": (),
}
FRAME_BYTES = 24 << 10  # several frames per step, a tensor across frames


@attrs.define
class Trainer:
    """fp32 master weights under AdamW at lr 1e-6; the refit carries their bf16 cast."""

    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    generator: torch.Generator

    @classmethod
    def make(cls, seed: int = 0) -> Trainer:
        g = torch.Generator().manual_seed(seed)
        params = {
            n: torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
            for n, shape in SHAPES.items()
        }
        optimizer = torch.optim.AdamW(params.values(), lr=1e-6, weight_decay=0.01)
        return cls(params, optimizer, g)

    def step(self) -> None:
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.generator)
        self.optimizer.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in self.params.items()}


def manifest() -> Manifest:
    return Manifest.from_specs(TensorSpec(n, s, "bfloat16") for n, s in SHAPES.items()).unwrap()


def raw(t: torch.Tensor) -> torch.Tensor:
    return (t.reshape(1) if t.dim() == 0 else t).view(torch.uint8)


@attrs.define
class Receivers:
    processes: Sequence[BaseProcess]
    commands: Sequence[Queue[object]]
    results: Sequence[Queue[object]]
    addresses: list[str]

    def dump(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[int, int]]:
        self.commands[i].put("dump")
        item = self.results[i].get(timeout=30)
        assert isinstance(item, tuple)
        kind, bits, applies, frames = item
        assert kind == "dump"
        return bits, applies, frames


Spawn = Callable[..., Receivers]
Nodes = list[tuple[SparseReceiver, DictTarget]]


@pytest.fixture
def spawn_receivers() -> Iterator[Spawn]:
    started: list[Receivers] = []

    def spawn(count: int, die_at: dict[int, int] | None = None) -> Receivers:
        ctx = multiprocessing.get_context("spawn")
        procs: list[BaseProcess] = []
        commands: list[Queue[object]] = []
        results: list[Queue[object]] = []
        addresses: list[str] = []
        for i in range(count):
            cq: Queue[object] = ctx.Queue()
            rq: Queue[object] = ctx.Queue()
            dies = (die_at or {}).get(i)
            p = ctx.Process(target=run_receiver, args=(rq, cq, len(SHAPES), dies), daemon=True)
            p.start()
            procs.append(p)
            commands.append(cq)
            results.append(rq)
        for rq in results:
            item = rq.get(timeout=120)
            assert isinstance(item, tuple)
            kind, address = item
            assert kind == "address"
            addresses.append(address)
        group = Receivers(procs, commands, results, addresses)
        started.append(group)
        return group

    yield spawn
    for group in started:
        for p, cq in zip(group.processes, group.commands, strict=True):
            if p.is_alive():
                cq.put("stop")
        for p in group.processes:
            p.join(10)
            if p.is_alive():
                p.kill()


def test_adamw_steps_leave_every_receiver_bit_equal(spawn_receivers: Spawn, tmp_path: Path) -> None:
    relay = spawn_receivers(3)
    trainer = Trainer.make()
    steps = 5
    with SparseSender(
        relay.addresses,
        manifest(),
        fanout=2,
        hop_s=20.0,
        frame_bytes=FRAME_BYTES,
        baseline_path=tmp_path / "baseline.bin",
    ) as sender:
        reports = []
        for _ in range(steps):
            weights = trainer.weights()
            reports.append(sender.send(weights))
            for i in range(3):
                bits, _, _ = relay.dump(i)
                for name, t in weights.items():
                    assert torch.equal(bits[name], raw(t)), (i, name)
            trainer.step()
        sender_frames = len(sender.frames)
    assert reports[0].full
    assert not any(r.full for r in reports[1:])
    assert [r.step for r in reports] == list(range(1, steps + 1))
    # a delta at lr 1e-6 carries a small fraction of what a full step does
    assert all(r.wire_bytes < 0.25 * reports[0].wire_bytes for r in reports[1:])
    for i in range(3):
        _, applies, received = relay.dump(i)
        assert applies == dict.fromkeys(SHAPES, steps)  # each tensor applied once a step
        assert received == dict.fromkeys(range(1, steps + 1), sender_frames)  # each frame once
    assert sender_frames > len(SHAPES) // 2  # tensors span frames and share them


@pytest.mark.parametrize(
    ("fanout", "dies", "silent", "unconfirmed"),
    [(2, 2, "leaf", ()), (1, 1, "middle", (2,))],
)
def test_a_receiver_killed_mid_step_is_named_within_the_bound(
    spawn_receivers: Spawn, fanout: int, dies: int, silent: str, unconfirmed: tuple[int, ...]
) -> None:
    relay = spawn_receivers(3, die_at={dies: 2})
    trainer = Trainer.make()
    hop = 1.0
    with SparseSender(
        relay.addresses, manifest(), fanout=fanout, hop_s=hop, frame_bytes=FRAME_BYTES
    ) as sender:
        sender.send(trainer.weights())
        trainer.step()
        started = time.monotonic()
        with pytest.raises(SparseRefitError) as caught:
            sender.send(trainer.weights())
        elapsed = time.monotonic() - started
        bound = sender.plan.answer_bound_s(0, hop)
        assert sender.synced_step is None  # the next step is full
    assert elapsed < bound + 1.0
    failure = caught.value.detail
    assert isinstance(failure, RelayFailure)
    assert failure.named(Outcome.SILENT) == (relay.addresses[dies],)
    assert failure.named(Outcome.UNCONFIRMED) == tuple(relay.addresses[u] for u in unconfirmed)
    assert repr(relay.addresses[dies]) in str(caught.value)
    assert "did not answer within" in str(caught.value)


# -- in-process relays (threads): corruption, divergence, bad input -------------------


@pytest.fixture
def threads() -> Iterator[Nodes]:
    nodes: list[tuple[SparseReceiver, DictTarget]] = []
    for _ in range(3):
        target = DictTarget()
        nodes.append((SparseReceiver(target).start(), target))
    yield nodes
    for receiver, _ in nodes:
        receiver.close()


class CorruptingSender(SparseSender):
    """Flips one byte of step 2's second frame's compressed payload on its way to the root."""

    frames_written = 0

    def _write(self, parts: list[bytes], step: int) -> int:
        if parts[0] == b"frame" and step == 2:
            self.frames_written += 1
            if self.frames_written == 2:
                payload = bytearray(parts[2])
                payload[len(payload) // 2] ^= 0x40
                parts = [parts[0], parts[1], bytes(payload)]
        return super()._write(parts, step)


def _snapshot(target: DictTarget) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in target.tensors.items()}


def test_a_corrupted_payload_is_refused_and_nothing_is_applied(threads: Nodes) -> None:
    trainer = Trainer.make()
    addresses = [r.address for r, _ in threads]
    with CorruptingSender(
        addresses, manifest(), fanout=2, hop_s=5.0, frame_bytes=FRAME_BYTES
    ) as sender:
        first = trainer.weights()
        sender.send(first)
        before = [_snapshot(t) for _, t in threads]
        trainer.step()
        with pytest.raises(SparseRefitError) as caught:
            sender.send(trainer.weights())
        failure = caught.value.detail
        assert isinstance(failure, RelayFailure)
        assert failure.named(Outcome.REFUSED)[0] == addresses[0]  # the root saw it first
        assert "failed its CRC" in str(caught.value)
        for (receiver, target), old in zip(threads, before, strict=True):
            assert receiver.needs_full
            assert all(torch.equal(target.tensors[n], old[n]) for n in old)  # still serving step 1
        # recovery: the next step is full and every receiver holds the trainer's bits
        weights = trainer.weights()
        report = sender.send(weights)
        assert report.full
        for _, target in threads:
            assert all(torch.equal(raw(target.tensors[n]), raw(weights[n])) for n in weights)


def test_a_diverged_receiver_fails_its_checksum_and_keeps_its_weights(threads: Nodes) -> None:
    trainer = Trainer.make()
    addresses = [r.address for r, _ in threads]
    with SparseSender(
        addresses, manifest(), fanout=2, hop_s=5.0, frame_bytes=FRAME_BYTES
    ) as sender:
        sender.send(trainer.weights())
        receiver, target = threads[2]
        receiver._bits["layers.0.mlp.weight"][123] ^= 1  # its copy drifted from the trainer's
        before = _snapshot(target)
        trainer.step()
        with pytest.raises(SparseRefitError) as caught:
            sender.send(trainer.weights())
        failure = caught.value.detail
        assert isinstance(failure, RelayFailure)
        assert failure.names == (addresses[2],)
        assert failure.named(Outcome.REFUSED) == (addresses[2],)
        assert re.search(
            r"'layers\.0\.mlp\.weight'\[\d+:\d+\] failed its checksum", str(caught.value)
        )
        assert all(torch.equal(target.tensors[n], before[n]) for n in before)  # never served
        assert receiver.needs_full
        assert not threads[0][0].needs_full
        weights = trainer.weights()
        assert sender.send(weights).full
        assert all(torch.equal(raw(target.tensors[n]), raw(weights[n])) for n in weights)
        assert not sender.send(weights).full


def test_a_receiver_outside_the_plan_or_behind_refuses_the_delta(threads: Nodes) -> None:
    trainer = Trainer.make()
    (a, _), (b, _), _ = threads
    with SparseSender([a.address, b.address], manifest(), fanout=1, hop_s=5.0) as sender:
        sender.send(trainer.weights())
        b.machine.synced_step = None  # as after a missed step
        with pytest.raises(SparseRefitError, match="needs a full refit before a delta"):
            sender.send(trainer.weights())
        sender.send(trainer.weights())
        b.machine.synced_step = 0
        with pytest.raises(
            SparseRefitError, match=r"holds step 0, but the delta applies to step 3"
        ):
            sender.send(trainer.weights())


def test_a_receiver_configured_into_a_relay_refuses_steps_planned_over_others(
    threads: Nodes,
) -> None:
    (a, target), (b, _), (c, _) = threads
    with pytest.raises(BadArgumentError, match="do not include this receiver"):
        a.expect_relay([b.address, c.address])
    with pytest.raises(BadArgumentError, match="repeated"):
        a.expect_relay([a.address, a.address])
    a.expect_relay([a.address, b.address])
    weights = Trainer.make().weights()
    everyone = [a.address, b.address, c.address]
    with (
        SparseSender(everyone, manifest(), hop_s=5.0) as sender,
        pytest.raises(SparseRefitError) as caught,
    ):
        sender.send(weights)
    failure = caught.value.detail
    assert isinstance(failure, RelayFailure)
    assert failure.names == (a.address,)
    assert "was configured into the relay" in str(caught.value)
    assert target.tensors == {}  # never applied
    with SparseSender([a.address, b.address], manifest(), hop_s=5.0) as sender:
        assert sender.send(weights).full
    assert all(torch.equal(raw(target.tensors[n]), raw(weights[n])) for n in weights)
    a.expect_relay(None)  # any plan naming it again
    with SparseSender([a.address, c.address], manifest(), hop_s=5.0) as sender:
        assert sender.send(weights).full


def test_the_sender_refuses_tensors_off_the_manifest(threads: Nodes) -> None:
    addresses = [r.address for r, _ in threads]
    with SparseSender(addresses, manifest(), hop_s=5.0) as sender:
        weights = Trainer.make().weights()
        wrong = dict(weights, extra=torch.zeros(2, dtype=torch.bfloat16))
        wrong["norm.weight"] = torch.zeros(65, dtype=torch.bfloat16)
        del wrong["scalar"]
        with pytest.raises(BadArgumentError) as caught:
            sender.send(wrong)
        text = str(caught.value)
        assert "'scalar' is missing" in text
        assert "'norm.weight' is [65] bfloat16, expected [64] bfloat16" in text
        assert "'extra' is not in the manifest" in text
        assert all(r.frames_received == {} for r, _ in threads)  # nothing was sent


def test_bad_relay_settings_are_refused() -> None:
    with pytest.raises(BadArgumentError, match="repeated"):
        SparseSender(["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"], manifest())
    with pytest.raises(BadArgumentError, match="hop_s"):
        SparseSender(["tcp://127.0.0.1:1"], manifest(), hop_s=0)
    with pytest.raises(BadArgumentError, match="chunk_elements"):
        SparseSender(["tcp://127.0.0.1:1"], manifest(), chunk_elements=1 << 17)
    with pytest.raises(BadConfigError, match="not a loopback address"):
        SparseReceiver(DictTarget(), host="10.1.2.3")
    with pytest.raises(BadArgumentError, match="link throttle"):
        LinkThrottle(0)
    with pytest.raises(BadArgumentError, match="workers"):
        SparseSender(["tcp://127.0.0.1:1"], manifest(), workers=0)
    with pytest.raises(BadArgumentError, match="workers must be positive, got 0"):
        SparseReceiver(DictTarget(), workers=0)


@pytest.mark.parametrize(("cores", "expected"), [(1, 2), (2, 2), (5, 2), (6, 3), (16, 8), (64, 8)])
def test_the_default_workers_are_half_the_cores_from_2_to_8(
    monkeypatch: pytest.MonkeyPatch, cores: int, expected: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert default_workers() == expected
    receiver = SparseReceiver(DictTarget())
    try:
        assert receiver.workers == expected
    finally:
        receiver.close()
    with SparseSender(["tcp://127.0.0.1:1"], manifest()) as sender:
        assert sender.workers == expected
    with SparseSender(["tcp://127.0.0.1:1"], manifest(), workers=5) as sender:
        assert sender.workers == 5


def test_a_silent_root_fails_the_step_within_its_bound() -> None:
    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)  # takes every message, never answers
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    try:
        with SparseSender([f"tcp://127.0.0.1:{port}"], manifest(), hop_s=0.5) as sender:
            started = time.monotonic()
            with pytest.raises(SparseRefitError, match=r"silent: did not answer within 0\.5 s"):
                sender.send(Trainer.make().weights())
            assert time.monotonic() - started < 0.5 + 1.0
    finally:
        sink.close(0)
        ctx.term()


def test_the_throttle_paces_writes_to_its_rate() -> None:
    throttle = LinkThrottle(8e6, burst_bytes=1000)  # 1 MB/s
    started = time.monotonic()
    for _ in range(4):
        throttle.wait(50_000)
    assert 0.18 <= time.monotonic() - started < 1.0


def test_the_mapped_baseline_lives_in_its_file(tmp_path: Path) -> None:
    from genworker.shell.refit.sparse import Baseline

    path = tmp_path / "b.bin"
    base = Baseline(manifest(), path)
    base.bits("norm.weight")[:] = 7
    assert path.stat().st_size >= manifest().total_bytes
    data = np.fromfile(path, dtype=np.uint8)
    assert (data.view(np.uint16) == 7).sum() == 64
    base.close()
    assert bit_pattern(torch.zeros(2)).dtype == np.uint32


def test_a_step_naming_another_checksum_is_refused(threads: Nodes) -> None:
    """A sender of another version (its pieces carry CRC-32s) is refused by name."""
    trainer = Trainer.make()
    addresses = [r.address for r, _ in threads]
    with SparseSender(addresses, manifest(), fanout=2, hop_s=5.0) as sender:
        sender.checksum = "crc32"
        with pytest.raises(SparseRefitError, match="carry 'crc32' checksums") as caught:
            sender.send(trainer.weights())
        failure = caught.value.detail
        assert isinstance(failure, RelayFailure)
        assert set(failure.named(Outcome.REFUSED)) == set(addresses)
        assert all(receiver.needs_full for receiver, _ in threads)
        sender.checksum = CHECKSUM
        assert sender.send(trainer.weights()).full
