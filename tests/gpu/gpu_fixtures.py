"""Fixtures of the GPU suite and the processes it spawns (imported as ``gpu.gpu_fixtures``).

Theory of operation
-------------------
- One sleep-mode engine per process: vLLM's ``CuMemAllocator`` refuses a second engine's
  weights pool while one is alive ("CuMem allocator can only be used for one instance per
  process", ``Worker._maybe_get_memory_pool_context`` in vllm/v1/worker/gpu_worker.py, 0.25),
  and the worker always starts vLLM with sleep mode on a GPU. So the suite holds ONE session
  worker in the pytest process (:func:`gpu_session`); every other engine (the fresh
  reference engine, the engine on the second GPU) runs in a spawned child process.
- Children are spawned (CUDA does not survive a fork). pytest imports test modules under
  names a child cannot import, so everything a child runs lives in this module, which the
  child imports as ``gpu.gpu_fixtures``: ``tests/`` is on ``sys.path`` (pyproject's pytest
  ``pythonpath``) and spawn hands the child its parent's ``sys.path``.
- Two bf16 checkpoints of the tiny Llama with different random weights: A, which the
  session worker loads, and B, the refit target. "Same weights" is checked the strong way:
  greedy tokens after a refit equal those of a fresh engine started on the saved checkpoint
  (for A: the session worker right after its start, before anything touched it). Every test
  leaves the session worker awake and holding A, so a refit that changed nothing fails.
- A trainer is a child process that loads a checkpoint onto its GPU and sends it through
  genworker's senders (CUDA IPC to the engine on the same GPU, NCCL to an engine on another;
  the sparse relay over ZMQ, ``gpu.gpu_sparse``; the one-GPU reshard over gloo, since NCCL
  refuses two ranks on one GPU, ``test_gpu_reshard.py``).
- A child meant for one GPU is pinned at its start (``CUDA_VISIBLE_DEVICES`` in the
  environment it inherits), because importing this module in the child already asks CUDA
  for its devices; inside, that GPU is ``cuda:0``.
- Prefix caching is off: a cache hit takes another attention path, and bf16 rounding there
  could flip a greedy near-tie against the reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import pickle
import queue
import random
import shutil
import socket
import tempfile
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from genworker.core.engine_calls import RpcCall
from genworker.demo.tiny_model import build_tiny_model

if TYPE_CHECKING:
    from genworker.shell.vllm_engine import VllmEngine
    from genworker.shell.worker import VllmGenerationWorker

__all__ = [
    "CHILD_TIMEOUT_S",
    "ENV",
    "FAKE_SEED",
    "GPU_MARKS",
    "GPU_MEMORY_UTILIZATION",
    "MAX_MODEL_LEN",
    "MAX_NEW_TOKENS",
    "PROMPTS",
    "REFIT_TIMEOUT_S",
    "Checkpoints",
    "Child",
    "GpuSession",
    "Trainer",
    "batch",
    "checkpoints",
    "collective_engine_main",
    "collective_fake_receiver_main",
    "collective_fake_sender_main",
    "collective_trainer_main",
    "engine_tensors",
    "fake_state_dict",
    "free_bytes",
    "free_port",
    "generated",
    "gpu_config",
    "gpu_session",
    "greedy",
    "ipc_fake_sender_main",
    "ipc_trainer_main",
    "load_checkpoint",
    "loop",
    "manifest",
    "pad_token_id",
    "reference_b",
    "reference_greedy_main",
    "refit_over_ipc",
    "requires_cuda",
    "requires_two_gpus",
    "run",
    "run_in_child",
    "session_engine",
    "write_checkpoint",
    "zeros_like",
]

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in-process (the runner needs it)
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # FlashInfer is not in the runner's bundle
    "NCCL_NVLS_ENABLE": "0",  # NVLink multicast off
    "TOKENIZERS_PARALLELISM": "false",
}
for _key, _value in ENV.items():
    os.environ.setdefault(_key, _value)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
GPU_MARKS = [pytest.mark.gpu, requires_cuda]

MAX_NEW_TOKENS = 24
MAX_MODEL_LEN = 256
GPU_MEMORY_UTILIZATION = 0.2  # two engines share one GPU (session + reference)
CHILD_TIMEOUT_S = 300.0
REFIT_TIMEOUT_S = 120.0
_FIRST_ID = 3  # <s>, </s>, <pad> are 0, 1, 2 in the tiny tokenizer


def _prompts() -> tuple[tuple[int, ...], ...]:
    rng = random.Random(0)
    return tuple(
        tuple(rng.randrange(_FIRST_ID, 500) for _ in range(n)) for n in (3, 7, 12, 5, 20, 9)
    )


PROMPTS = _prompts()


# -- checkpoints -----------------------------------------------------------------------------
def write_checkpoint(path: Path, *, seed: int) -> Path:
    """The tiny Llama with weights from ``seed``, saved in bf16 (config and tokenizer too).

    Built beside ``path`` and renamed into place, as ``build_tiny_model`` does.
    """
    from safetensors.torch import load_file, save_file

    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model = build_tiny_model(staging / "model", seed=seed)
        weights = model / "model.safetensors"
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}
        save_file(tensors, weights, metadata={"format": "pt"})
        config = json.loads((model / "config.json").read_text())
        config["torch_dtype"] = config["dtype"] = "bfloat16"
        (model / "config.json").write_text(json.dumps(config, indent=2))
        try:
            model.rename(path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def load_checkpoint(path: Path, device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors", device=device)


def manifest(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``prepare_refit_info``'s argument for a checkpoint (a model directory, or a ``.pt``
    of engine-layout tensors): name -> (shape, dtype)."""
    tensors = torch.load(path) if path.suffix == ".pt" else load_checkpoint(path, "cpu")
    return {n: (t.shape, t.dtype) for n, t in tensors.items()}


def pad_token_id(path: Path) -> int:
    value = json.loads((path / "config.json").read_text())["pad_token_id"]
    assert isinstance(value, int)
    return value


@dataclass(frozen=True)
class Checkpoints:
    a: Path
    b: Path
    pad: int

    @property
    def b_engine(self) -> Path:
        """Checkpoint B in the engine's own layout (written by the ``reference_b`` fixture)."""
        return self.b.parent / "b-engine.pt"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    base = tmp_path_factory.mktemp("gpu-models")
    a = write_checkpoint(base / "tiny-a", seed=100)
    b = write_checkpoint(base / "tiny-b", seed=101)
    return Checkpoints(a, b, pad_token_id(a))


# -- the worker and its batches ---------------------------------------------------------------
def gpu_config(model: Path, pad: int) -> dict[str, object]:
    """NeMo-RL's generation config for the tiny model on one GPU."""
    return {
        "backend": "vllm",
        "model_name": str(model),
        "max_new_tokens": MAX_NEW_TOKENS,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "_pad_token_id": pad,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel_size": 1,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "max_model_len": MAX_MODEL_LEN,
            "precision": "bfloat16",
            "enforce_eager": True,
            "enable_prefix_caching": False,  # see the module docstring
        },
    }


def batch(prompts: Sequence[Sequence[int]], pad: int) -> dict[str, torch.Tensor]:
    """A right-padded batch of token-id prompts."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts])}


def generated(out: Mapping[str, torch.Tensor], data: Mapping[str, torch.Tensor]) -> list[list[int]]:
    """Each row's generated tokens (they follow the unpadded input in ``output_ids``)."""
    starts = data["input_lengths"].tolist()
    lengths = out["generation_lengths"].tolist()
    rows = out["output_ids"].tolist()
    return [row[s : s + n] for row, s, n in zip(rows, starts, lengths, strict=True)]


def greedy(worker: VllmGenerationWorker, pad: int) -> list[list[int]]:
    data = batch(PROMPTS, pad)
    return generated(worker.generate(data, greedy=True), data)


def free_bytes() -> int:
    """Free memory of the current device (every process's use counted)."""
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


@dataclass
class GpuSession:
    """The session worker, on checkpoint A, and what it was like when fresh."""

    worker: VllmGenerationWorker
    checkpoints: Checkpoints
    baseline_a: list[list[int]]
    engine_bytes: int
    trainer: Trainer | None = None

    def ipc_trainer(self) -> Trainer:
        """A trainer process on this GPU, sending to this worker (started on first use)."""
        if self.trainer is None or not self.trainer.proc.is_alive():
            (address,) = self.worker.refit_address()
            self.trainer = Trainer(ipc_trainer_main, {"address": str(address)})
        return self.trainer


@pytest.fixture(scope="session")
def gpu_session(checkpoints: Checkpoints) -> Iterator[GpuSession]:
    from genworker.shell.worker import VllmGenerationWorker

    before = free_bytes()
    worker = VllmGenerationWorker(gpu_config(checkpoints.a, checkpoints.pad))
    session = GpuSession(
        worker, checkpoints, greedy(worker, checkpoints.pad), before - free_bytes()
    )
    yield session
    if session.trainer is not None:
        session.trainer.stop()
    worker.shutdown()


def session_engine(session: GpuSession) -> VllmEngine:
    """The session worker's CUDA engine adapter (what the CPU suite calls ``cpu_engine``)."""
    from genworker.shell.vllm_engine import VllmEngine

    engine = session.worker.engine
    assert isinstance(engine, VllmEngine)
    return engine


def refit_over_ipc(
    session: GpuSession, checkpoint: Path, *, one_allocation: bool = False
) -> dict[str, int]:
    """Push ``checkpoint`` (a safetensors model directory, or a ``.pt`` of engine-layout
    tensors) from the trainer process into the session worker over CUDA IPC, from tensors
    the trainer keeps (each in its own allocation, or with ``one_allocation`` all views
    of one), so sending the same checkpoint again sends the same storages; the sender's
    report: ``nbytes``, ``handles`` (tensors sent by the handle of their own storage),
    ``packed``."""
    worker, trainer = session.worker, session.ipc_trainer()
    expected = manifest(checkpoint)
    worker.prepare_refit_info(expected)
    trainer.send("send", (str(checkpoint), one_allocation))
    trainer.expect("sending")
    assert worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT_S)
    sent = trainer.expect("sent")
    assert isinstance(sent, dict)
    assert sent["nbytes"] == sum(math.prod(s) * d.itemsize for s, d in expected.values())
    return sent


# -- child processes ---------------------------------------------------------------------------
@contextlib.contextmanager
def _pinned(gpu: int | None) -> Iterator[None]:
    """Processes started inside see only physical GPU ``gpu``: a spawned child inherits the
    environment at its start, before anything in it (even an import) can initialise CUDA."""
    if gpu is None:
        yield
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _child_entry(target: Callable[..., object], kwargs: dict[str, Any], out: Any) -> None:
    """Runs ``target``; its value goes back as pickled bytes: a tensor put on the queue as
    itself travels as a file descriptor the child must still hold when the parent reads it
    (torch's sharing strategy), and a child that returned has exited by then (seen on the
    H100: ``ConnectionResetError`` in ``recvfds``)."""
    try:
        out.put(("ok", pickle.dumps(target(**kwargs))))
    except BaseException:  # noqa: BLE001 - the parent raises it with this traceback
        out.put(("error", traceback.format_exc()))


def _get(out: Any, proc: BaseProcess, timeout_s: float, what: str) -> tuple[str, object]:
    """The next message from a child, or a RuntimeError naming why none came."""
    waited = 0.0
    while True:
        try:
            kind, payload = out.get(timeout=1.0)
        except queue.Empty:
            waited += 1.0
            if not proc.is_alive():
                raise RuntimeError(f"{what} died (exit code {proc.exitcode})") from None
            if waited > timeout_s:
                raise RuntimeError(f"{what} sent nothing within {timeout_s:.0f} s") from None
            continue
        if kind == "error":
            raise RuntimeError(f"{what} failed:\n{payload}")
        return str(kind), payload


class Child:
    """``target(**kwargs)`` running in a spawned process (on physical GPU ``gpu`` alone, when
    given); :meth:`result` waits for it."""

    def __init__(
        self, target: Callable[..., object], *, gpu: int | None = None, **kwargs: object
    ) -> None:
        ctx = mp.get_context("spawn")
        self.name = f"child {target.__name__}"
        self.out = ctx.Queue()
        self.proc = ctx.Process(target=_child_entry, args=(target, kwargs, self.out))
        with _pinned(gpu):
            self.proc.start()

    def result(self, timeout_s: float = CHILD_TIMEOUT_S) -> object:
        """The target's return value, or a RuntimeError carrying the child's traceback."""
        try:
            _, value = _get(self.out, self.proc, timeout_s, self.name)
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        assert isinstance(value, bytes)
        return pickle.loads(value)


def run_in_child(target: Callable[..., object], **kwargs: object) -> object:
    """``target(**kwargs)`` in a spawned process; its result, or its traceback raised here."""
    return Child(target, gpu=None, **kwargs).result()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop per AsyncLLM module: the engine's output handler lives on the loop
    of its first request."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def run(loop: asyncio.AbstractEventLoop, coro: Any, timeout_s: float = 600.0) -> Any:
    """``coro`` to completion on ``loop``, bounded."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout_s))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Trainer:
    """A trainer process driven by commands; its failures are raised here with its traceback."""

    def __init__(self, target: Callable[..., None], kwargs: Mapping[str, object]) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=target, kwargs={**kwargs, "commands": self.commands, "replies": self.replies}
        )
        self.proc.start()

    def send(self, command: str, arg: object = None) -> None:
        self.commands.put((command, arg))

    def expect(self, kind: str, timeout_s: float = CHILD_TIMEOUT_S) -> object:
        got, payload = _get(self.replies, self.proc, timeout_s, "the trainer process")
        if got != kind:
            raise RuntimeError(f"the trainer answered {got!r} ({payload!r}), expected {kind!r}")
        return payload

    def stop(self) -> None:
        if self.proc.is_alive():
            self.send("stop")
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def one_allocation(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors as views of one allocation (each at a 512-byte aligned offset)."""
    sizes = [-(-t.numel() * t.element_size() // 512) * 512 for t in tensors.values()]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=next(iter(tensors.values())).device)
    out, offset = {}, 0
    for (name, tensor), size in zip(tensors.items(), sizes, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        view = flat[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        out[name] = view.copy_(tensor)
        offset += size
    return out


def ipc_trainer_main(*, address: str, commands: Any, replies: Any) -> None:
    """Trainer on the engine's GPU: ``("send", (checkpoint, one_allocation))`` pushes it
    over CUDA IPC, from tensors kept for the next send of the same checkpoint."""
    try:
        from genworker.shell.refit import RefitSender

        device = "cuda" if torch.cuda.is_available() else "cpu"  # shared memory on a CPU
        kept: dict[tuple[str, bool], dict[str, torch.Tensor]] = {}
        with RefitSender.ipc(address, timeout_s=REFIT_TIMEOUT_S) as sender:
            while True:
                command, arg = commands.get()
                if command == "stop":
                    break
                path, flat = arg
                tensors = kept.get((path, flat))
                if tensors is None:
                    checkpoint = Path(str(path))
                    loaded = (
                        {n: t.to(device) for n, t in torch.load(checkpoint).items()}
                        if checkpoint.suffix == ".pt"
                        else load_checkpoint(checkpoint, device)
                    )
                    tensors = kept[path, flat] = one_allocation(loaded) if flat else loaded
                replies.put(("sending", None))
                report = sender.send(tensors.items())
                replies.put(
                    (
                        "sent",
                        {
                            "nbytes": report.nbytes,
                            "handles": report.direct,
                            "packed": report.loaded,
                        },
                    )
                )
    except BaseException:  # noqa: BLE001 - the engine side raises it with this traceback
        replies.put(("error", traceback.format_exc()))


def engine_tensors(
    worker: VllmGenerationWorker, *, buffers: bool = False
) -> dict[str, torch.Tensor]:
    """The worker's engine's parameters (with ``buffers``, its buffers too, such as fp8
    block scales), in the engine's own layout, on the host."""

    def copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        named = [*model.named_parameters(), *(model.named_buffers() if buffers else ())]
        return {n: t.detach().cpu().clone() for n, t in named}

    (tensors,) = worker.engine.collective_rpc(RpcCall("apply_model", args=(copy,)))
    assert isinstance(tensors, dict)
    return tensors


def reference_greedy_main(
    config: dict[str, object], pad: int, params_path: str | None = None
) -> list[list[int]]:
    """A fresh engine with ``config`` in this (child) process: its greedy tokens; with
    ``params_path``, its parameters in the engine's own layout are saved there too."""
    from genworker.shell.worker import VllmGenerationWorker

    worker = VllmGenerationWorker(config)
    try:
        if params_path is not None:
            torch.save(engine_tensors(worker), params_path)
        return greedy(worker, pad)
    finally:
        worker.shutdown()


@pytest.fixture(scope="session")
def reference_b(checkpoints: Checkpoints) -> list[list[int]]:
    """Greedy tokens of a fresh engine on checkpoint B (started in a child process); its
    engine-layout parameters are saved to ``checkpoints.root / "b-engine.pt"``."""
    config = gpu_config(checkpoints.b, checkpoints.pad)
    result = run_in_child(
        reference_greedy_main,
        config=config,
        pad=checkpoints.pad,
        params_path=str(checkpoints.b_engine),
    )
    assert isinstance(result, list)
    return result


def collective_engine_main(
    *, config: dict[str, object], checkpoints: Checkpoints, port: int
) -> dict[str, list[list[int]]]:
    """The engine (on its pinned GPU) with ``config`` (on checkpoint A): greedy tokens, then
    B over NCCL, greedy tokens again."""
    from genworker.shell.worker import VllmGenerationWorker

    worker = VllmGenerationWorker(config)
    try:
        before = greedy(worker, checkpoints.pad)
        worker.prepare_refit_info(manifest(checkpoints.b))
        worker.init_collective(0, "127.0.0.1", port, 2, 1)  # engine rank 1, after the trainer
        assert worker.update_weights_from_collective(timeout_s=REFIT_TIMEOUT_S)
        return {"before": before, "after": greedy(worker, checkpoints.pad)}
    finally:
        worker.shutdown()


def collective_trainer_main(*, checkpoint: str, port: int) -> int:
    """The trainer (on its pinned GPU): rank 0 of the update group, broadcasts ``checkpoint``
    once; the bytes it sent."""
    from genworker.shell.refit import RefitSender

    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # gloo on a CPU
    tensors = load_checkpoint(Path(checkpoint), device)
    info = {n: (t.shape, t.dtype) for n, t in tensors.items()}
    with RefitSender.collective(
        "127.0.0.1",
        port,
        2,
        rank=0,
        train_world_size=1,
        device=device,
        manifest=info,
        timeout_s=CHILD_TIMEOUT_S,
    ) as sender:
        return sender.send(tensors.items()).nbytes


# -- transports alone (no engine): refit_helpers' state dict on CUDA -----------------------
FAKE_SEED = 7


def fake_state_dict(device: str) -> dict[str, torch.Tensor]:
    """Several dtypes and shapes, one non-contiguous, one empty, six to go by handle
    (``refit_helpers.random_state_dict``), on ``device`` with their strides."""
    from refit_helpers import random_state_dict

    return {n: t.to(device) for n, t in random_state_dict(FAKE_SEED).items()}


def zeros_like(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(t.shape, dtype=t.dtype, device=t.device) for n, t in tensors.items()}


def ipc_fake_sender_main(
    *,
    address: str,
    staging_bytes: int,
    refits: int = 1,
    die_after: int | None = None,
    ready: Any = None,
) -> list[dict[str, int]]:
    """Send the fake state dict from this GPU over CUDA IPC ``refits`` times (``die_after``:
    die mid-stream; ``ready``: an event set just before the first refit starts)."""
    from refit_helpers import scripted_stream

    from genworker.shell.refit import RefitSender, manifest_of

    tensors = fake_state_dict("cuda")
    torch.cuda.synchronize()
    if ready is not None:
        ready.set()
    reports = []
    with RefitSender.ipc(
        address, manifest=manifest_of(tensors), staging_bytes=staging_bytes, timeout_s=60.0
    ) as sender:
        for _ in range(refits):
            report = sender.send(scripted_stream(tensors, die_after=die_after))
            reports.append({"tensors": report.tensors, "handles": report.direct})
    return reports


def collective_fake_receiver_main(*, port: int) -> bool:
    """Rank 1 of a weight-update group on this GPU: receive the fake state dict, compare."""
    from genworker.shell.refit import CollectiveReceiver, fake

    expected = fake_state_dict("cuda:0")
    params = zeros_like(expected)
    group = fake.engine_group(port, timeout_s=CHILD_TIMEOUT_S, device=torch.device("cuda", 0))
    try:
        fake.receive_into(CollectiveReceiver(group), params, timeout_s=REFIT_TIMEOUT_S)
    finally:
        group.close()
    return all(torch.equal(params[n], t) for n, t in expected.items())


def collective_fake_sender_main(*, port: int, chunk_bytes: int) -> int:
    """Rank 0 on this GPU: broadcast the fake state dict; the bytes sent."""
    from genworker.shell.refit import RefitSender, manifest_of

    tensors = fake_state_dict("cuda:0")
    with RefitSender.collective(
        "127.0.0.1",
        port,
        2,
        device="cuda:0",
        manifest=manifest_of(tensors),
        chunk_bytes=chunk_bytes,
        timeout_s=CHILD_TIMEOUT_S,
    ) as sender:
        return sender.send(tensors.items()).nbytes
