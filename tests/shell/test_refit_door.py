"""The refit door: a backend registered from a test (one line) is driven through the
extension's generic ``collective_rpc`` targets with no change to the extension; typed
errors come back as values; one close closes all; today's target names are aliases onto
the door; backends never import the extension, and nothing here imports a private name."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from torch import nn

from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.shell.errors import RefitError
from genworker.shell.extension import WorkerExtension, door_of
from genworker.shell.refit.door import BACKENDS, register_backend
from genworker.shell.refit.engine import EngineContext, EngineSink

REPO = Path(__file__).resolve().parents[2]


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.zeros(4))
        self.proj = nn.Linear(4, 3)


@attrs.define(slots=False)
class FakeWorker(WorkerExtension):
    """What the door reads from a vLLM worker: a model, a device, a rank."""

    model: Toy = attrs.field(factory=Toy)
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    rank: int = 0

    def get_model(self) -> nn.Module:
        return self.model


class QueueBackend:
    """A test-only transport: ``init`` opens a queue, ``receive`` takes the next batch of
    tensors in it into the engine's parameters through the context's routes and sink."""

    def __init__(self, engine: EngineContext) -> None:
        self.engine, self.closed, self.received = engine, 0, 0
        self.queue: list[dict[str, list[float]]] | None = None

    def init(self, batches: list[dict[str, list[float]]]) -> str:
        self.queue = list(batches)
        return f"queue of {len(batches)}"

    def receive(self, strict: bool = True) -> dict[str, object]:
        if not self.queue:
            raise RefitError("the queue is empty")
        batch = {n: torch.tensor(v) for n, v in self.queue.pop(0).items()}
        manifest = Manifest.from_specs(TensorSpec.of(n, t) for n, t in batch.items()).unwrap()
        routed = self.engine.routed(manifest, True)
        sink = EngineSink(routed, self.engine.device)
        for name, tensor in batch.items():
            sink.target(name).copy_(tensor)
        sink.finish(batch)
        self.received += 1
        return {"tensors": len(batch), "direct": len(routed.routes.direct)}

    def status(self) -> dict[str, object]:
        return {"left": len(self.queue or ()), "received": self.received}

    def release(self) -> int:
        return 0

    def close(self) -> int:
        self.closed += 1
        return 1


def answer(value: object) -> dict[str, object]:
    """A door call's plain-valued answer, as a dict."""
    assert isinstance(value, dict)
    return value


@pytest.fixture
def queue_backend() -> Iterator[str]:
    register_backend("queue", QueueBackend)  # the one registry line a new backend adds
    yield "queue"
    del BACKENDS["queue"]


def test_a_registered_backend_is_driven_through_the_generic_targets(queue_backend: str) -> None:
    worker = FakeWorker()
    norm = [1.0, 2.0, 3.0, 4.0]
    assert worker.refit_init(queue_backend, [{"norm": norm}, {"norm": [0.0] * 4}]) == "queue of 2"
    assert worker.refit_receive(queue_backend) == {"tensors": 1, "direct": 1}
    assert worker.model.norm.detach().tolist() == norm
    assert worker.refit_status(queue_backend) == {"left": 1, "received": 1}
    assert worker.refit_release(queue_backend) == 0
    worker.refit_receive(queue_backend)
    # a typed error comes back as a value naming its kind, for raise_failures
    failed = worker.refit_receive(queue_backend)
    assert failed == {"error": "refit", "message": "the queue is empty"}
    backend = door_of(worker).backends[queue_backend]
    assert worker.refit_close() == 1  # every open backend
    assert isinstance(backend, QueueBackend)
    assert backend.closed == 1
    assert queue_backend not in door_of(worker).backends
    assert worker.refit_close(queue_backend) == 0  # idempotent


def test_a_bad_call_through_the_door_is_a_typed_value(queue_backend: str) -> None:
    worker = FakeWorker()
    unknown = answer(worker.refit_init("nope"))
    assert unknown["error"] == "argument"
    assert "no refit backend 'nope'" in str(unknown["message"])
    assert answer(worker.refit_close("nope"))["error"] == "argument"
    with pytest.raises(TypeError):  # a wrong signature is a bug in the caller, not a value
        worker.refit_init(queue_backend, 1, 2, 3)
    with pytest.raises(ValueError, match="already registered"):
        register_backend(queue_backend, QueueBackend)


def test_todays_target_names_are_aliases_onto_the_door() -> None:
    worker = FakeWorker()
    address = worker.refit_address()
    assert address == worker.refit_init("ipc")
    assert answer(worker.refit_status("ipc"))["address"] == address
    assert worker.release_refit_buffers() == 0
    assert worker.update_weights_from_collective(timeout_s=1.0)["error"] == "state"
    assert worker.configure_sparse_relay(["tcp://x"])["error"] == "state"
    assert worker.nccl_reshard_refit(1.0)["error"] == "state"
    assert answer(worker.refit_init("reshard")) == {
        "error": "argument",
        "message": "the reshard init takes a join or a refit_info",
    }
    assert worker.cleanup() is None
    assert door_of(worker).backends == {}


def test_backends_reach_the_engine_only_through_the_context_and_import_no_private_name() -> None:
    files = [*sorted((REPO / "shell" / "refit").glob("*.py")), REPO / "shell" / "extension.py"]
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module != "genworker.shell.extension", path
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert node.module == "__future__" or not private, (path, private)
            if isinstance(node, ast.Import):
                assert all(a.name != "genworker.shell.extension" for a in node.names), path
    bases = [base.__name__ for base in WorkerExtension.__mro__]
    assert bases == ["WorkerExtension", "object"]  # no mixin stack
