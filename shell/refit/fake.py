"""Refit peers for tests: a fake receiver (a dict of tensors) and a scripted sender.

Each ``run_*`` function is a process entry point (``multiprocessing`` spawn) that puts
plain tuples on a queue: the receiver's address when it has one, then an
:class:`Outcome`. They exercise the real transports end to end without an engine:
``ParameterSink`` stands in for the engine's parameters, and the sender can be told to
drop, add or change a tensor, to fail in its own stream, or to die mid-refit
(``die_direct``: once a direct refit was agreed, before it ends).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import attrs
import torch

from genworker.core.refit_plan import Slot
from genworker.shell.refit.collective import CollectiveGroup, CollectiveSender
from genworker.shell.refit.ipc import IpcReceiver, IpcSender
from genworker.shell.refit.packing import SendReport
from genworker.shell.refit.session import ParameterSink, manifest_of, receive_refit
from genworker.shell.refit.wire import DirectMsg, Message, Reply

__all__ = [
    "FailingSink",
    "Outcome",
    "outcome_of",
    "random_state_dict",
    "run_collective_sender",
    "run_ipc_receiver",
    "run_ipc_sender",
    "scripted_stream",
]


class _Queue(Protocol):
    def put(self, item: object) -> None: ...


@attrs.frozen
class Outcome:
    """How one side of a refit ended: ok, or the exception's class name and message."""

    ok: bool
    error: str = ""
    message: str = ""
    seconds: float = 0.0
    detail: Mapping[str, object] = attrs.field(factory=dict)


def outcome_of(fn: Callable[[], Mapping[str, object]]) -> Outcome:
    started = time.monotonic()
    try:
        detail = fn()
    except Exception as e:  # noqa: BLE001 - the outcome records any failure
        return Outcome(False, type(e).__name__, str(e), time.monotonic() - started)
    return Outcome(True, seconds=time.monotonic() - started, detail=dict(detail))


def random_state_dict(seed: int, *, scale: int = 1) -> dict[str, torch.Tensor]:
    """Deterministic tensors of several dtypes and shapes, one non-contiguous, one empty."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "embed.weight": torch.randn(64 * scale, 48, generator=g),
        "layer.0.norm": torch.randn(48, generator=g).to(torch.bfloat16),
        "layer.0.proj": torch.randn(96, 48 * scale, generator=g).t(),  # non-contiguous
        "layer.0.bias": torch.randn(7, generator=g).to(torch.float16),
        "layer.0.mask": torch.rand(5, 3, generator=g) > 0.5,
        "layer.0.count": torch.randint(0, 1000, (3,), generator=g),
        "layer.0.empty": torch.empty(0, 4),
        "head.weight": torch.randn(40, 48, generator=g),
    }
    return out


def engine_group(
    port: int,
    *,
    timeout_s: float,
    device: torch.device | None = None,
    rank: int = 1,
    world_size: int = 2,
    train_world_size: int = 1,
) -> CollectiveGroup:
    """An engine's end of a weight-update group on this host's ``port`` (default: rank 1
    of 2, after one trainer rank; on the CPU, over gloo)."""
    return CollectiveGroup(
        ip="127.0.0.1",
        port=port,
        rank=rank,
        world_size=world_size,
        train_world_size=train_world_size,
        role="engine",
        device=device or torch.device("cpu"),
        timeout_s=timeout_s,
    )


def zeros_like_all(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in tensors.items()}


def scripted_stream(
    tensors: Mapping[str, torch.Tensor],
    *,
    mutate: str | None = None,
    die_after: int | None = None,
    raise_after: int | None = None,
    delay_s: float = 0.0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` as a sender streams them, with an optional fault.

    ``mutate``: ``missing`` drops the last tensor, ``extra`` adds one, ``shape`` and
    ``dtype`` change the first. ``die_after=k`` kills the process after k tensors,
    ``raise_after=k`` makes the stream raise there.
    """
    items = list(tensors.items())
    if mutate == "missing":
        items = items[:-1]
    elif mutate == "extra":
        items.append(("surprise.weight", torch.ones(3)))
    elif mutate == "shape":
        name, t = items[0]
        items[0] = (name, torch.zeros(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype))
    elif mutate == "dtype":
        name, t = items[0]
        items[0] = (name, t.to(torch.float64))
    for i, item in enumerate(items):
        if die_after is not None and i == die_after:
            os._exit(17)
        if raise_after is not None and i == raise_after:
            raise ValueError(f"the trainer's stream broke at tensor {i}")
        if delay_s:
            time.sleep(delay_s)
        yield item


class FailingSink(ParameterSink):
    """A parameter sink that raises (or kills its process) while storing bucket ``fail_at``."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], fail_at: int, *, die: bool = False
    ) -> None:
        super().__init__(params)
        self._fail_at = fail_at
        self._die = die
        self._seen = 0

    def store(self, items: Sequence[tuple[Slot, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        self._maybe_fail()
        return super().store(items)

    def written(self, names: Sequence[str]) -> None:
        """A direct refit counts as bucket 0."""
        self._maybe_fail()

    def _maybe_fail(self) -> None:
        if self._seen == self._fail_at:
            if self._die:
                os._exit(17)
            raise RuntimeError(f"the fake engine broke while storing bucket {self._seen}")
        self._seen += 1


def _received(params: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> bool:
    return all(torch.equal(params[n], t) for n, t in expected.items())


def run_ipc_receiver(
    queue: _Queue,
    seed: int,
    *,
    timeout_s: float,
    fail_at: int | None = None,
    die_at: int | None = None,
    tcp_host: str | None = None,
    refits: int = 1,
    directory: str | None = None,
) -> None:
    """Bind, publish the address, receive ``refits`` refits of ``random_state_dict(seed)``."""
    expected = random_state_dict(seed)
    receiver = IpcReceiver(torch.device("cpu"), tcp_host=tcp_host, directory=directory)
    queue.put(("address", receiver.address))
    try:
        for _ in range(refits):
            params = zeros_like_all(expected)
            sink: ParameterSink = ParameterSink(params)
            if fail_at is not None or die_at is not None:
                at = die_at if die_at is not None else fail_at
                sink = FailingSink(params, at or 0, die=die_at is not None)
            receive = functools.partial(_receive_ipc, receiver, expected, params, sink, timeout_s)
            queue.put(("outcome", outcome_of(receive)))
    finally:
        receiver.close()


def _receive_ipc(
    receiver: IpcReceiver,
    expected: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    sink: ParameterSink,
    timeout_s: float,
) -> dict[str, object]:
    report = receive_refit(receiver, manifest_of(expected), sink, timeout_s=timeout_s)
    return {**report.as_dict(), "equal": _received(params, expected)}


class _DyingIpcSender(IpcSender):
    """Dies after writing a direct refit, before telling the engine."""

    def _exchange(self, msg: Message, what: str, refit_id: str, started: float) -> Reply:
        if isinstance(msg, DirectMsg):
            os._exit(17)
        return super()._exchange(msg, what, refit_id, started)


class _DyingCollectiveSender(CollectiveSender):
    """Dies once every rank agreed to a direct refit, before broadcasting anything."""

    def _send_direct(
        self, items: Sequence[tuple[str, torch.Tensor]], group: int, started: float
    ) -> SendReport:
        os._exit(17)


def run_ipc_sender(
    queue: _Queue,
    address: str,
    seed: int,
    *,
    timeout_s: float,
    bucket_bytes: int = 4096,
    manifest_seed: int | None = None,
    staging_dir: str | None = None,
    direct: bool = True,
    die_direct: bool = False,
    **faults: object,
) -> None:
    tensors = random_state_dict(seed)
    manifest = manifest_of(random_state_dict(manifest_seed if manifest_seed is not None else seed))

    def send() -> dict[str, object]:
        with (_DyingIpcSender if die_direct else IpcSender)(
            address,
            manifest=manifest,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            staging_dir=staging_dir,
            direct=direct,
        ) as sender:
            report = sender.send(scripted_stream(tensors, **faults))  # type: ignore[arg-type]
        return _sent(report)

    queue.put(("ready", None))
    queue.put(("outcome", outcome_of(send)))


def run_collective_sender(
    queue: _Queue,
    port: int,
    seed: int,
    *,
    world_size: int = 2,
    rank: int = 0,
    train_world_size: int = 1,
    timeout_s: float,
    bucket_bytes: int = 4096,
    direct: bool = True,
    die_direct: bool = False,
    **faults: object,
) -> None:
    tensors = random_state_dict(seed)

    def send() -> dict[str, object]:
        with (_DyingCollectiveSender if die_direct else CollectiveSender)(
            "127.0.0.1",
            port,
            world_size,
            rank=rank,
            train_world_size=train_world_size,
            manifest=manifest_of(tensors),
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            direct=direct,
        ) as sender:
            report = sender.send(scripted_stream(tensors, **faults))  # type: ignore[arg-type]
        return _sent(report)

    queue.put(("outcome", outcome_of(send)))


def _sent(report: SendReport) -> dict[str, object]:
    return {
        "tensors": report.tensors,
        "bytes": report.nbytes,
        "buckets": report.buckets,
        "mode": report.mode,
    }


class _Inbox(Protocol):
    def get(self) -> object: ...


def edited(
    tensors: Mapping[str, torch.Tensor],
    *,
    keep: Sequence[str] | None = None,
    drop: Sequence[str] = (),
    add: Mapping[str, Sequence[int]] | None = None,
    reshape: Mapping[str, Sequence[int]] | None = None,
    retype: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` with names kept or dropped, added, reshaped or retyped."""
    out = {n: t for n, t in tensors.items() if (keep is None or n in keep) and n not in drop}
    for name, shape in (reshape or {}).items():
        out[name] = torch.zeros(tuple(shape), dtype=out[name].dtype)
    for name, dtype in (retype or {}).items():
        out[name] = out[name].to(getattr(torch, dtype))
    for name, shape in (add or {}).items():
        out[name] = torch.ones(tuple(shape))
    return out


class _Trainer:
    """The state of :func:`run_trainer`: at most one collective sender."""

    def __init__(self) -> None:
        self.sender: CollectiveSender | None = None

    def step(self, command: dict[str, object]) -> dict[str, object]:
        from safetensors.torch import load_file

        op = command.pop("op")
        timeout_s = float(command.pop("timeout_s", 60.0))  # type: ignore[arg-type]
        bucket_bytes = int(command.pop("bucket_bytes", 1 << 16))  # type: ignore[call-overload]
        if op == "join":
            self.sender = CollectiveSender(
                "127.0.0.1",
                int(command["port"]),  # type: ignore[call-overload]
                int(command["world_size"]),  # type: ignore[call-overload]
                timeout_s=timeout_s,
                bucket_bytes=bucket_bytes,
            )
            return {}
        path = str(command.pop("path"))
        manifest_path = command.pop("manifest_path", None)
        address = command.pop("address", None)
        direct = bool(command.pop("direct", True))
        keep_mapped = bool(command.pop("keep_mapped", False))
        tensors = edited(load_file(path), **command)  # type: ignore[arg-type]
        if op == "ipc":
            manifest = manifest_of(load_file(str(manifest_path))) if manifest_path else None
            with IpcSender(
                str(address),
                manifest=manifest,
                bucket_bytes=bucket_bytes,
                timeout_s=timeout_s,
                direct=direct,
                keep_mapped=keep_mapped,
            ) as ipc:
                report = ipc.send(tensors.items())
        else:
            assert self.sender is not None, "join the group first"
            self.sender.direct = direct
            report = self.sender.send(tensors.items())
        return _sent(report)


def run_trainer(commands: _Inbox, results: _Queue) -> None:
    """A trainer process driven by commands (dicts) until ``None``; one outcome each.

    ``{"op": "join", "port": p, "world_size": n}`` builds a :class:`CollectiveSender`;
    ``{"op": "collective", "path": f, ...}`` and ``{"op": "ipc", "address": a, "path": f,
    ...}`` send the safetensors file ``f``, edited by the remaining keys (see
    :func:`edited`; ``manifest_path`` names the file whose layout is the IPC manifest,
    ``direct`` (default True) lets the sender go direct, ``keep_mapped`` (IPC, default
    False) lets the engine keep the sent tensors mapped).
    """
    trainer = _Trainer()
    results.put(("ready", None))
    while True:
        command = commands.get()
        if command is None:
            break
        assert isinstance(command, dict)
        results.put(("outcome", outcome_of(functools.partial(trainer.step, dict(command)))))
    if trainer.sender is not None:
        trainer.sender.close()
