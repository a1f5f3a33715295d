"""The sparse-delta refit into real CPU engines: the trainer here, two generation workers
over vLLM CPU engines in their own processes, one fake receiver process (issue 16).

The CPU engine runs float32, so the trainer keeps fp32 master weights under AdamW, casts
them to bf16 each step (what a bf16 refit would carry) and sends that bf16 value in
float32: the engines' parameters must hold exactly the trainer's bf16-cast values, and
only elements whose bf16 value moved change between steps (bf16 bit equality through the
codec itself is ``test_sparse.py``'s). The relay is ``[engine 0, engine 1, fake]`` with
fanout 2: engine 0 is the root and forwards to the other two.
"""

from __future__ import annotations

import multiprocessing
import queue
import shutil
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path

import attrs
import pytest
import torch
import zstandard
from safetensors.torch import load_file, save_file
from sparse_helpers import run_engine_worker, run_receiver

from genworker.core.delta import Outcome, RelayFailure, bit_pattern, tensor_checksum
from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.core.sparse_protocol import frame_message, read_frame
from genworker.shell.refit.sparse import SparseRefitError, SparseSender

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

HOP_S = 8.0
SLACK = 15.0  # what a bounded wait may take beyond its bound on this shared machine
CTX = multiprocessing.get_context("spawn")


@attrs.define
class Proc:
    process: BaseProcess
    commands: Queue[object]
    results: Queue[object]

    def ask(self, *command: object, timeout: float = 300) -> object:
        self.commands.put(command)
        item = self.results.get(timeout=timeout)
        assert isinstance(item, tuple)
        if item[0] == "error":
            raise AssertionError(f"{command[0]} failed: {item[1]}: {item[2]}")
        assert item[0] == "ok"
        return item[1]

    def error(self, *command: object) -> tuple[str, str]:
        self.commands.put(command)
        item = self.results.get(timeout=300)
        assert isinstance(item, tuple), item
        assert item[0] == "error", item
        return item[1], item[2]

    def stop(self) -> None:
        if self.process.is_alive():
            self.commands.put(("stop",))
            self.process.join(60)
        if self.process.is_alive():
            self.process.kill()


def spawn(target: Callable[..., object], before: tuple[object, ...], *after: object) -> Proc:
    """``target(*before, results, commands, *after)`` in a spawned process."""
    commands: Queue[object] = CTX.Queue()
    results: Queue[object] = CTX.Queue()
    process = CTX.Process(target=target, args=(*before, results, commands, *after))
    process.daemon = True
    process.start()
    return Proc(process, commands, results)


def first(proc: Proc, timeout: float = 600) -> object:
    """The first message of a child process (failing fast when it died before it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return proc.results.get(timeout=1)
        except queue.Empty:
            if not proc.process.is_alive():
                raise AssertionError(f"the child died first: {proc.process.exitcode}") from None
    raise AssertionError(f"no message within {timeout:g} s")


def ready(proc: Proc) -> str:
    item = first(proc)
    assert isinstance(item, tuple), item
    assert item[0] == "ready", item
    _, urls, base_url = item
    assert isinstance(urls, list)
    assert len(urls) == 1
    assert base_url == urls[0]
    return str(urls[0])


@attrs.define
class Engines:
    procs: list[Proc]
    addresses: list[str]
    model_dir: Path


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[Engines]:
    procs = [spawn(run_engine_worker, (str(tiny_model_dir),)) for _ in range(2)]
    try:
        addresses = [ready(p) for p in procs]
        yield Engines(procs, addresses, tiny_model_dir)
    finally:
        for p in procs:
            p.stop()


def fake(engines: Engines, die_at_step: int | None = None) -> tuple[Proc, str]:
    """The third receiver: a plain dict of tensors (``die_at_step``: killed mid-step)."""
    tensors = len(load_file(engines.model_dir / "model.safetensors"))
    proc = spawn(run_receiver, (), tensors, die_at_step)
    item = proc.results.get(timeout=120)
    assert isinstance(item, tuple), item
    assert item[0] == "address", item
    return proc, str(item[1])


@attrs.define
class Trainer:
    """fp32 master weights from the checkpoint under AdamW; the refit carries their bf16
    cast, in float32."""

    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    generator: torch.Generator

    @classmethod
    def make(cls, checkpoint: Path, lr: float) -> Trainer:
        params = {
            n: torch.nn.Parameter(t.float().clone()) for n, t in load_file(checkpoint).items()
        }
        optimizer = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.01)
        return cls(params, optimizer, torch.Generator().manual_seed(0))

    def step(self) -> None:
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.generator)
        self.optimizer.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16).float() for n, p in self.params.items()}

    def manifest(self) -> Manifest:
        return Manifest.from_specs(
            TensorSpec(n, tuple(p.shape), "float32") for n, p in self.params.items()
        ).unwrap()


def checksums(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: tensor_checksum(bit_pattern(t.contiguous())) for n, t in weights.items()}


def fresh_tokens(model_dir: Path, weights: dict[str, torch.Tensor], where: Path) -> object:
    """Greedy tokens of a fresh engine started on ``weights`` saved as a checkpoint."""
    where.mkdir()
    for path in model_dir.iterdir():
        if path.name != "model.safetensors" and path.is_file():
            shutil.copy(path, where / path.name)
    save_file({n: t.contiguous() for n, t in weights.items()}, where / "model.safetensors")
    proc = spawn(run_engine_worker, (str(where),), False)
    try:
        item = first(proc)
        assert isinstance(item, tuple), item
        assert item[0] == "ready", item
        return proc.ask("tokens")
    finally:
        proc.stop()


def relay(engines: Engines, fake_address: str) -> list[str]:
    addresses = [*engines.addresses, fake_address]
    for proc in engines.procs:
        proc.ask("configure", addresses)
    return addresses


def test_adamw_steps_leave_the_engines_bit_equal_and_greedy_equal_to_a_fresh_engine(
    engines: Engines, tmp_path: Path
) -> None:
    trainer = Trainer.make(engines.model_dir / "model.safetensors", lr=1e-3)
    before = engines.procs[0].ask("tokens")
    fake_proc, fake_address = fake(engines)
    try:
        addresses = relay(engines, fake_address)
        with SparseSender(addresses, trainer.manifest(), fanout=2, hop_s=HOP_S) as sender:
            frames = len(sender.frames)
            reports = [sender.send(trainer.weights())]  # full: the way every sparse refit starts
            for _ in range(3):
                trainer.step()
                reports.append(sender.send(trainer.weights()))
        assert [r.full for r in reports] == [True, False, False, False]
        assert all(r.wire_bytes < r.model_bytes for r in reports[1:])
        weights = trainer.weights()
        expected = checksums(weights)
        for proc in engines.procs:
            assert proc.ask("checksums") == [expected]
            direct = proc.ask("direct")
            assert isinstance(direct, list)
            (params,) = direct
            assert isinstance(params, dict)
            assert params
            for name, param in params.items():
                assert torch.equal(param.view(torch.int32), weights[name].view(torch.int32)), name
            statuses = proc.ask("status")
            assert isinstance(statuses, list)
            (status,) = statuses
            assert status["applied"] >= 4
            assert status["step"] == 4
            assert not status["diverged"]
            # each payload once: every frame of every step, no more
            assert all(status["frames"][step] == frames for step in range(1, 5)), status
        fake_proc.commands.put("dump")
        item = fake_proc.results.get(timeout=60)
        assert isinstance(item, tuple)
        _, bits, applies, fake_frames = item
        assert fake_frames == {step: frames for step in range(1, 5)}
        assert set(applies.values()) == {4}
        for name, weight in weights.items():
            assert torch.equal(bits[name].reshape(-1), weight.reshape(-1).view(torch.uint8)), name
        tokens = [proc.ask("tokens") for proc in engines.procs]
        assert tokens[0] != before  # the steps changed what the engines generate
        # Each applied step is a good refit: the worker's weight version counts them.
        assert [proc.ask("version") for proc in engines.procs] == [status["applied"]] * 2
        assert tokens == [tokens[0]] * 2
        assert tokens[0] == fresh_tokens(engines.model_dir, weights, tmp_path / "fresh")
    finally:
        fake_proc.commands.put("stop")
        fake_proc.process.join(30)


def test_a_receiver_killed_mid_step_fails_the_step_naming_it_within_the_bound(
    engines: Engines,
) -> None:
    trainer = Trainer.make(engines.model_dir / "model.safetensors", lr=1e-3)
    fake_proc, fake_address = fake(engines, die_at_step=2)
    try:
        addresses = relay(engines, fake_address)
        with SparseSender(addresses, trainer.manifest(), fanout=2, hop_s=HOP_S) as sender:
            sender.send(trainer.weights())
            trainer.step()
            started = time.monotonic()
            with pytest.raises(SparseRefitError) as caught:
                sender.send(trainer.weights())
            took = time.monotonic() - started
            bound = sender.plan.answer_bound_s(0, HOP_S)
        assert took < bound + SLACK
        failure = caught.value.detail
        assert isinstance(failure, RelayFailure)
        assert failure.names == (fake_address,)
        assert failure.named(Outcome.SILENT) == (fake_address,)
        assert fake_address in str(caught.value)
        expected = checksums(trainer.weights())
        for proc in engines.procs:  # the live engines took the step
            assert proc.ask("checksums") == [expected]
            assert isinstance(proc.ask("tokens"), list)
    finally:
        fake_proc.process.join(30)
        if fake_proc.process.is_alive():
            fake_proc.process.kill()


class CorruptingSender(SparseSender):
    """At step 2, flips a bit in the first piece's new bits *before* compression: the
    frame's CRC matches what travels, only the per-tensor checksum can tell."""

    def _encode(self, index: int, frame: object, bits: object, full: bool, step: int) -> object:  # type: ignore[override]
        parts, deltas = super()._encode(index, frame, bits, full, step)  # type: ignore[arg-type]
        if step != 2 or index != 0:
            return parts, deltas
        header = read_frame(parts[1]).unwrap()
        raw = bytearray(zstandard.ZstdDecompressor().decompress(parts[2]))
        raw[header.pieces[0].nbytes - 1] ^= 0x01  # the piece's last bits
        payload = zstandard.ZstdCompressor(level=1).compress(bytes(raw))
        return frame_message(step, index, header.pieces, len(raw), payload), deltas


def test_a_corrupted_payload_fails_the_checksum_and_the_engines_refuse_to_serve(
    engines: Engines,
) -> None:
    trainer = Trainer.make(engines.model_dir / "model.safetensors", lr=1e-3)
    fake_proc, fake_address = fake(engines)
    try:
        addresses = relay(engines, fake_address)
        with CorruptingSender(addresses, trainer.manifest(), fanout=2, hop_s=HOP_S) as sender:
            sender.send(trainer.weights())
            trainer.step()
            with pytest.raises(SparseRefitError, match="failed its checksum") as caught:
                sender.send(trainer.weights())
            failure = caught.value.detail
            assert isinstance(failure, RelayFailure)
            assert set(failure.named(Outcome.REFUSED)) == set(addresses)  # all got the bits
            for proc in engines.procs:
                kind, message = proc.error("tokens")
                assert kind == "SparseRefitError"
                assert "failed its checksum" in message
                assert "full refit" in message
                kind, _ = proc.error("tokens")  # and again: until a full refit
                assert kind == "SparseRefitError"
            trainer.step()
            report = sender.send(trainer.weights())  # the recovery: a full step
            assert report.full
        expected = checksums(trainer.weights())
        for proc in engines.procs:
            assert proc.ask("checksums") == [expected]
            assert isinstance(proc.ask("tokens"), list)  # serving again
    finally:
        fake_proc.commands.put("stop")
        fake_proc.process.join(30)
