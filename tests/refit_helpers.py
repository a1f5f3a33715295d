"""Shared pieces of the refit tests (importable as ``refit_helpers``, also in spawned
children): scripted trainer streams and peer processes for the transports, saved
weights, greedy tokens, engine start and stop, and a trainer process that sends saved
weights on command."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import attrs
import torch
from safetensors.torch import load_file

from genworker.shell.refit import IpcReceiver, RefitReport, RefitSender, manifest_of, receive
from genworker.shell.refit.receiver import ParameterSink

if TYPE_CHECKING:
    from vllm import LLM

PROMPTS = [[1, 5, 9, 33, 70], [1, 100, 200], [2, 17, 300, 41]]
REFIT_TIMEOUT = 60.0


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
    """Deterministic tensors of several dtypes and shapes: six travel by handle once
    recognised, two always packed (one non-contiguous, one empty)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256 * scale, 128, generator=g),  # 128 KiB
        "layer.0.norm": torch.randn(48, generator=g).to(torch.bfloat16),
        "layer.0.proj": torch.randn(96, 48 * scale, generator=g).t(),  # non-contiguous
        "layer.0.bias": torch.randn(7, generator=g).to(torch.float16),
        "layer.0.mask": torch.rand(5, 3, generator=g) > 0.5,
        "layer.0.count": torch.randint(0, 1000, (3,), generator=g),
        "layer.0.empty": torch.empty(0, 4),
        "head.weight": torch.randn(160, 128, generator=g),  # 80 KiB
    }


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
    """``tensors`` as a trainer streams them, with an optional fault.

    ``mutate``: ``missing`` drops the last tensor, ``extra`` adds one, ``shape`` and
    ``dtype`` change the first. ``die_after=k`` kills the process after k tensors,
    ``raise_after=k`` makes the stream raise there; ``delay_s`` paces every tensor.
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
    """Raises (or kills its process) when asked for the memory of its ``fail_at``-th
    tensor."""

    def __init__(self, params: Mapping[str, torch.Tensor], fail_at: int, *, die: bool = False):
        super().__init__(params)
        self._fail_at, self._die, self._seen = fail_at, die, 0

    def target(self, name: str) -> torch.Tensor:
        self._seen += 1
        if self._seen == self._fail_at + 1:
            if self._die:
                os._exit(17)
            raise RuntimeError(f"the fake engine broke while storing {name!r}")
        return super().target(name)


def _sent(report: RefitReport) -> dict[str, object]:
    return {"tensors": report.tensors, "nbytes": report.nbytes, "chunks": report.chunks}


def run_ipc_receiver(
    queue: _Queue,
    seed: int,
    *,
    timeout_s: float,
    die_at: int | None = None,
    refits: int = 1,
    directory: str | None = None,
) -> None:
    """Bind, publish the address, receive ``refits`` refits of ``random_state_dict(seed)``."""
    expected = random_state_dict(seed)
    receiver = IpcReceiver(torch.device("cpu"), directory=directory)
    queue.put(("address", receiver.address))

    def receive_one() -> dict[str, object]:
        params = zeros_like_all(expected)
        sink = ParameterSink(params) if die_at is None else FailingSink(params, die_at, die=True)
        report = receive(
            receiver, manifest_of(expected), sink, routes=sink.routes, timeout_s=timeout_s
        )
        same = all(torch.equal(params[n], t) for n, t in expected.items())
        return {**report.as_dict(), "equal": same}

    try:
        for _ in range(refits):
            queue.put(("outcome", outcome_of(receive_one)))
    finally:
        receiver.close()


def run_ipc_sender(
    queue: _Queue,
    address: str,
    seed: int,
    *,
    timeout_s: float,
    staging_bytes: int = 4096,
    refits: int = 1,
    staging_dir: str | None = None,
    **faults: object,
) -> None:
    tensors = random_state_dict(seed)

    def send(sender: RefitSender) -> dict[str, object]:
        return _sent(sender.send(scripted_stream(tensors, **faults)))  # type: ignore[arg-type]

    with RefitSender.ipc(
        address,
        manifest=manifest_of(tensors),
        staging_bytes=staging_bytes,
        timeout_s=timeout_s,
        staging_dir=staging_dir,
    ) as sender:
        queue.put(("ready", None))
        for _ in range(refits):
            queue.put(("outcome", outcome_of(functools.partial(send, sender))))


def run_collective_sender(
    queue: _Queue,
    port: int,
    seed: int,
    *,
    world_size: int = 2,
    rank: int = 0,
    train_world_size: int = 1,
    timeout_s: float,
    chunk_bytes: int = 4096,
    **faults: object,
) -> None:
    tensors = random_state_dict(seed)

    def send() -> dict[str, object]:
        with RefitSender.collective(
            "127.0.0.1",
            port,
            world_size,
            rank=rank,
            train_world_size=train_world_size,
            manifest=manifest_of(tensors),
            chunk_bytes=chunk_bytes,
            timeout_s=timeout_s,
        ) as sender:
            return _sent(sender.send(scripted_stream(tensors, **faults)))  # type: ignore[arg-type]

    queue.put(("outcome", outcome_of(send)))


def run_dying_engine(queue: _Queue, port: int) -> None:
    """An engine that joins a weight-update group and dies on the first tensor it gets."""
    from genworker.shell.refit import CollectiveReceiver, fake

    def die(weights: object) -> None:
        for _ in weights:  # type: ignore[attr-defined]
            os._exit(17)

    group = fake.engine_group(port, timeout_s=60.0)
    params = zeros_like_all(random_state_dict(7))
    fake.receive_into(CollectiveReceiver(group), params, timeout_s=60.0, direct={}, loader=die)


def spawn(
    target: Callable[..., None], *args: object, **kwargs: object
) -> tuple[BaseProcess, object]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(queue, *args), kwargs=kwargs, daemon=True)
    process.start()
    return process, queue


def next_item(queue: object, timeout: float = 60.0) -> tuple[str, object]:
    item = queue.get(timeout=timeout)  # type: ignore[attr-defined]
    assert isinstance(item, tuple)
    return item


# -- engines and a trainer process that sends saved weights -------------------------------


@attrs.frozen
class Weights:
    """Two saved checkpoints of the tiny model: A (the engines start on it) and B."""

    a: Path
    b: Path
    b_dir: Path


def greedy(llm: LLM) -> list[list[int]]:
    """Greedy tokens of :data:`PROMPTS`, 12 each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=12),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@attrs.frozen
class Engine:
    """A CPU engine with the extension, and its greedy tokens on the weights it started on."""

    llm: LLM
    baseline_a: list[list[int]]

    def rpc(self, method: str, *args: object, **kwargs: object) -> object:
        """The one engine worker's answer (a failure raised typed)."""
        (result,) = self.rpc_all(method, *args, **kwargs)
        return result

    def rpc_all(self, method: str, *args: object, **kwargs: object) -> list[object]:
        """Every engine worker's answer, in rank order (a failure raised typed)."""
        from genworker.shell.refit import raise_failures

        results = self.llm.collective_rpc(method, args=args, kwargs=kwargs or None)
        return raise_failures(results, method)

    def tokens(self) -> list[list[int]]:
        self.llm.reset_prefix_cache()  # the worker does this after every refit
        return greedy(self.llm)


def start_engine(model: Path, *, extension: bool, **overrides: object) -> LLM:
    """A CPU engine on ``model`` (``overrides``: more ``vllm.LLM`` keyword arguments)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from engine_fixtures import EXTENSION_CLS, cpu_engine_kwargs
    from vllm import LLM

    kwargs = cpu_engine_kwargs(model)
    kwargs.pop("worker_extension_cls", None)
    if extension:
        kwargs["worker_extension_cls"] = EXTENSION_CLS
    return LLM(**{**kwargs, **overrides})  # type: ignore[arg-type]


def stop_engine(llm: LLM) -> None:
    from genworker.shell.vllm_engine import VllmEngine

    VllmEngine(llm).shutdown()


def start_tp_engine(model: Path, tp: int) -> LLM:
    """An engine with the worker extension over ``tp`` CPU workers. Without core binding:
    vLLM's automatic binding refuses two workers on one NUMA node. The engine core in its
    own process: shutting down a multiprocess executor in this one would tear down the
    parallel state the session's in-process engine runs on."""
    import vllm.envs

    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    vllm.envs.disable_envs_cache()  # an earlier in-process engine cached the environment
    try:
        return start_engine(
            model, extension=True, tensor_parallel_size=tp, distributed_executor_backend="mp"
        )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        vllm.envs.disable_envs_cache()


def stop_tp_engine(llm: LLM) -> None:
    """Close the extension's sockets and groups, then stop the engine (of
    :func:`start_tp_engine`)."""
    import psutil  # type: ignore[import-untyped]

    llm.collective_rpc("cleanup")
    # vLLM's kill_process_tree can race a worker that already exited (seen once in the
    # full suite): that process is gone, which is what the shutdown wants.
    with contextlib.suppress(psutil.NoSuchProcess):
        stop_engine(llm)


def edited(
    tensors: Mapping[str, torch.Tensor],
    *,
    keep: Sequence[str] | None = None,
    drop: Sequence[str] = (),
    add: Mapping[str, Sequence[int]] | None = None,
    reshape: Mapping[str, Sequence[int]] | None = None,
    retype: Mapping[str, str] | None = None,
    nan: Sequence[str] = (),
) -> dict[str, torch.Tensor]:
    """A copy of ``tensors`` with names kept or dropped, added, reshaped or retyped, or
    with a NaN and an inf written into those in ``nan``."""
    out = {n: t for n, t in tensors.items() if (keep is None or n in keep) and n not in drop}
    for name in nan:
        out[name] = out[name].clone()
        out[name].view(-1)[0], out[name].view(-1)[-1] = float("nan"), float("inf")
    for name, shape in (reshape or {}).items():
        out[name] = torch.zeros(tuple(shape), dtype=out[name].dtype)
    for name, dtype in (retype or {}).items():
        out[name] = out[name].to(getattr(torch, dtype))
    for name, shape in (add or {}).items():
        out[name] = torch.ones(tuple(shape))
    return out


class _Inbox(Protocol):
    def get(self) -> object: ...


class _Trainer:
    """The state of :func:`run_trainer`: one IPC sender per address (kept across refits,
    as a trainer keeps it), at most one collective sender, and the last tensors sent (so
    the next refit of the same file sends the same storages, as a trainer's own
    parameters would be)."""

    def __init__(self) -> None:
        self.collective: RefitSender | None = None
        self.ipc: dict[tuple[str, float], RefitSender] = {}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}

    def step(self, command: dict[str, object]) -> dict[str, object]:
        op = command.pop("op")
        timeout_s = float(command.pop("timeout_s", 60.0))  # type: ignore[arg-type]
        if op == "join":
            self.collective = RefitSender.collective(
                "127.0.0.1",
                int(command["port"]),  # type: ignore[call-overload]
                int(command["world_size"]),  # type: ignore[call-overload]
                timeout_s=timeout_s,
            )
            return {}
        path = str(command.pop("path"))
        address = command.pop("address", None)
        delay_s = float(command.pop("delay_s", 0.0))  # type: ignore[arg-type]
        die_after = command.pop("die_after", None)
        key = repr(sorted((k, str(v)) for k, v in command.items())) + path
        if key not in self.tensors:
            changed = edited(load_file(path), **command)  # type: ignore[arg-type]
            self.tensors = {key: {n: t.clone() for n, t in changed.items()}}
        stream = scripted_stream(self.tensors[key], delay_s=delay_s, die_after=die_after)  # type: ignore[arg-type]
        if op == "ipc":
            sender = self.ipc.get((str(address), timeout_s))
            if sender is None:
                sender = RefitSender.ipc(str(address), timeout_s=timeout_s)
                self.ipc[str(address), timeout_s] = sender
            return _sent(sender.send(stream))
        assert self.collective is not None, "join the group first"
        return _sent(self.collective.send(stream))

    def close(self) -> None:
        for sender in [*self.ipc.values(), *([self.collective] if self.collective else [])]:
            sender.close()


def run_trainer(commands: _Inbox, results: _Queue) -> None:
    """A trainer process driven by commands (dicts) until ``None``; one outcome each.

    ``{"op": "join", "port": p, "world_size": n}`` joins a weight-update group;
    ``{"op": "collective", "path": f, ...}`` and ``{"op": "ipc", "address": a, "path": f,
    ...}`` send the safetensors file ``f``, edited by the remaining keys (see
    :func:`edited`; ``delay_s`` paces every tensor, ``die_after`` kills the process)."""
    trainer = _Trainer()
    serve_commands(commands, results, trainer.step)
    trainer.close()


def serve_commands(
    commands: _Inbox, results: _Queue, step: Callable[[dict[str, object]], Mapping[str, object]]
) -> None:
    """The command loop of a :class:`CommandedProcess`: answer ``("ready", None)``, then
    one ``("outcome", Outcome)`` per command (a dict) until ``None``."""
    results.put(("ready", None))
    while True:
        command = commands.get()
        if command is None:
            return
        assert isinstance(command, dict)
        results.put(("outcome", outcome_of(functools.partial(step, dict(command)))))


class CommandedProcess:
    """A spawned process running ``target(commands, results, *args)`` (a
    :func:`serve_commands` loop): ``submit`` commands, read each one's ``result``, ``stop``.
    ``defaults`` are keys every command carries unless it names them itself."""

    def __init__(
        self,
        target: Callable[..., None],
        *args: object,
        defaults: Mapping[str, object] | None = None,
        wait_ready: bool = True,
        result_timeout: float = 120,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._commands, self._results = ctx.Queue(), ctx.Queue()
        self._defaults = dict(defaults or {})
        self._result_timeout = result_timeout
        self.process: BaseProcess = ctx.Process(
            target=target, args=(self._commands, self._results, *args), daemon=True
        )
        self.process.start()
        if wait_ready:
            self.ready()

    def ready(self) -> None:
        assert self._results.get(timeout=120) == ("ready", None)

    def submit(self, op: str, **command: object) -> None:
        self._commands.put({"op": op, **self._defaults, **command})

    def result(self, timeout: float | None = None) -> Outcome:
        kind, outcome = self._results.get(timeout=timeout or self._result_timeout)
        assert kind == "outcome"
        assert isinstance(outcome, Outcome)
        return outcome

    def stop(self) -> None:
        """Ask the process to leave; kill it after 30 s. Polled with ``is_alive`` (a
        ``waitpid``), not ``join``: ``join`` waits on the process's sentinel pipe, which a
        process started meanwhile by this one may hold open (seen: a NeMo-RL trainer
        reaped only after the 30 s, a zombie all along)."""
        self._commands.put(None)
        deadline = time.monotonic() + 30
        while self.process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.process.is_alive():
            self.process.kill()


class Trainer(CommandedProcess):
    """A trainer process (:func:`run_trainer`) sending saved weights on command."""

    def __init__(self) -> None:
        super().__init__(run_trainer, defaults={"timeout_s": REFIT_TIMEOUT})


def info(path: Path, keep: set[str] | None = None) -> dict[str, list[object]]:
    """The manifest of a saved checkpoint (``keep``: only these names)."""
    return {
        n: [list(t.shape), str(t.dtype).removeprefix("torch.")]
        for n, t in load_file(path).items()
        if keep is None or n in keep
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
