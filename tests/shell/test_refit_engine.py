"""Refit into the real vLLM CPU engine through ``WorkerExtension``, from a trainer process.

The engine here is this module's own (refits change its weights; the session engine of
``engine_fixtures`` must stay pristine). Every refit is checked the strong way: greedy
tokens afterwards equal those of a fresh engine started on the same saved weights, and
differ before. The first tests drive the extension's routing with a plain ``nn.Module``
standing in for the worker's model (no engine).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import pytest
import torch
from refit_helpers import (
    PROMPTS,
    REFIT_TIMEOUT,
    Engine,
    Trainer,
    Weights,
    free_port,
    greedy,
    info,
    start_engine,
    stop_engine,
)
from safetensors.torch import load_file
from torch import nn

from genworker.core.refit_plan import Bucket, Manifest, TensorSpec, plan_buckets
from genworker.shell.errors import EngineStateError, RefitError, RefitManifestError
from genworker.shell.extension import (
    EngineSink,
    WorkerExtension,
    _routed,
    _routes,
    direct_routes,
)
from genworker.shell.refit.session import bucket_views
from genworker.shell.tiny_model import build_tiny_model

if TYPE_CHECKING:
    pass

pytestmark = pytest.mark.timeout(600)

# On CPU, vLLM keeps these parameters as they are; linear weights become packed handles.
DIRECT = {
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.1.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
}


# -- routing, with a plain module standing in for vLLM's model ------------------------


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class Packed(nn.Module):
    """Like vLLM's CPU linear: the weight was swapped for an empty placeholder."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0))
        self.quant_method = type("UnquantizedLinearMethod", (), {})()


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 2))
        self.quant_method = type("Fp8LinearMethod", (), {})()


class Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, 4))
        self.bias = nn.Parameter(torch.zeros(3))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = Norm()
        self.packed = Packed()
        self.quantized = Quantized()
        self.proj = Projection()


def specs(**shapes: tuple[int, ...]) -> Manifest:
    return Manifest.from_specs(
        TensorSpec(name.replace("__", "."), shape, "float32") for name, shape in shapes.items()
    ).unwrap()


def test_direct_routes_need_an_exact_match_for_every_parameter_of_a_module() -> None:
    manifest = specs(
        norm__weight=(4,),
        packed__weight=(2, 2),  # the checkpoint's shape; the parameter is a placeholder
        quantized__weight=(2, 2),
        proj__weight=(3, 4),  # proj.bias goes to the loader, so proj.weight must too
    )
    routes = direct_routes(Toy(), manifest, sharded_ok=True)
    assert routes.direct == frozenset({"norm.weight"})
    assert routes.modules == frozenset({"norm"})
    both = specs(proj__weight=(3, 4), proj__bias=(3,))
    assert direct_routes(Toy(), both, sharded_ok=True).direct == {"proj.weight", "proj.bias"}


class Bare:
    """Where the extension keeps its state, and nothing else: enough for the routes."""


def test_routes_are_kept_until_a_parameter_moves_or_changes_shape() -> None:
    model, worker = Toy(), Bare()
    manifest = specs(proj__weight=(3, 4), proj__bias=(3,))
    first = _routes(worker, model, manifest, True)
    assert _routes(worker, model, manifest, True) is first
    model.proj.weight.data = torch.ones(3, 4)  # new memory: computed again, same answer
    again = _routes(worker, model, manifest, True)
    assert again is not first
    assert again == first
    model.proj.bias.data = torch.zeros(5)  # the bias no longer matches: nothing goes direct
    assert _routes(worker, model, manifest, True).direct == frozenset()


def test_routes_are_computed_again_when_a_parameter_is_replaced_in_place() -> None:
    """A new Parameter object over the same memory (as a reload may register) is seen."""

    model, worker = Toy(), Bare()
    manifest = specs(proj__weight=(3, 4), proj__bias=(3,))
    first = _routed(worker, model, manifest, True)
    assert _routed(worker, model, manifest, True) is first
    model.proj.weight = nn.Parameter(model.proj.weight.data)  # same pointer, new object
    again = _routed(worker, model, manifest, True)
    assert again is not first
    assert again.direct["proj.weight"] is model.proj.weight
    assert _routed(worker, model, specs(norm__weight=(4,)), True) is not again  # new manifest
    assert _routed(worker, Toy(), specs(norm__weight=(4,)), True).model is not model


class CountingParameter(nn.Parameter):
    """Like vLLM's parameters: a Python ``__torch_function__`` (counted here)."""

    calls = 0

    @classmethod
    def __torch_function__(
        cls,
        func: object,
        types: object,
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        CountingParameter.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]


def test_checking_cached_routes_does_not_go_through_torch_function() -> None:
    model, worker = Toy(), Bare()
    model.proj.weight = CountingParameter(torch.ones(3, 4))
    model.proj.bias = CountingParameter(torch.zeros(3))
    manifest = specs(proj__weight=(3, 4), proj__bias=(3,))
    first = _routed(worker, model, manifest, True)
    CountingParameter.calls = 0
    for _ in range(3):
        assert _routed(worker, model, manifest, True) is first
    assert CountingParameter.calls == 0
    model.proj.bias.data = torch.zeros(3)  # still seen: new memory
    assert _routed(worker, model, manifest, True) is not first


def test_engine_sink_runs_the_post_load_processing_of_the_modules_written() -> None:
    processed: list[str] = []

    class Method:
        def __init__(self, name: str) -> None:
            self.name = name

        def process_weights_after_loading(self, module: nn.Module) -> None:
            processed.append(self.name)

    Method.__name__ = "UnquantizedLinearMethod"
    model = Toy()
    vars(model.norm)["quant_method"] = Method("norm")
    vars(model.proj)["quant_method"] = Method("proj")
    manifest = specs(norm__weight=(4,), proj__weight=(3, 4), proj__bias=(3,))
    routed = _routed(Bare(), model, manifest, True)
    assert routed.targets is not None
    assert set(routed.targets) == {"norm.weight", "proj.weight", "proj.bias"}
    sink = EngineSink(model, routed.routes, torch.device("cpu"), routed=routed)
    assert sink.direct_targets(manifest) is routed.targets
    sink.written(["proj.bias", "norm.weight", "proj.weight"])  # all of them
    sink.finalize()
    assert processed == ["norm", "proj"]
    processed.clear()
    sink = EngineSink(model, routed.routes, torch.device("cpu"), routed=routed)
    sink.written(["proj.weight"])
    sink.finalize()
    assert processed == ["proj"]


def test_sharded_parameters_never_go_direct_over_a_collective() -> None:
    model = Toy()
    model.norm.weight.output_dim = 0  # type: ignore[attr-defined]
    manifest = specs(norm__weight=(4,))
    assert direct_routes(model, manifest, sharded_ok=False).direct == frozenset()
    assert direct_routes(model, manifest, sharded_ok=True).direct == {"norm.weight"}


def test_engine_sink_copies_direct_and_defers_owned_copies() -> None:
    model = Toy()
    manifest = specs(norm__weight=(4,), packed__weight=(2, 2))
    sink = EngineSink(model, direct_routes(model, manifest, sharded_ok=True), torch.device("cpu"))
    buffer = torch.zeros(1024, dtype=torch.uint8)
    slots = [s for b in _plan(manifest) for s in b.slots]
    views = bucket_views(buffer, slots)
    views[0][1].copy_(torch.full((4,), 2.0))
    views[1][1].copy_(torch.full((2, 2), 3.0))
    deferred = sink.store(views)
    sink.finalize()
    assert torch.equal(model.norm.weight.data, torch.full((4,), 2.0))
    ((name, tensor),) = deferred
    assert name == "packed.weight"
    buffer.zero_()  # the transport reuses its buffer: the deferred copy must not change
    assert torch.equal(tensor, torch.full((2, 2), 3.0))


def _plan(manifest: Manifest) -> list[Bucket]:
    return list(plan_buckets(manifest.specs, 1024))


@attrs.define(slots=False)
class FakeWorker(WorkerExtension):
    """What the extension reads from a vLLM worker: a model, a device, a rank."""

    model: nn.Module = attrs.field(factory=Toy)
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    rank: int = 0

    def get_model(self) -> nn.Module:
        return self.model


def test_extension_refuses_refits_before_their_setup() -> None:
    worker = FakeWorker()
    with pytest.raises(EngineStateError, match="prepare_refit_info first"):
        worker.update_weights_via_ipc_zmq(timeout_s=0.1)
    with pytest.raises(EngineStateError, match="before init_collective"):
        worker.update_weights_from_collective(timeout_s=0.1)
    with pytest.raises(RefitManifestError, match="'w' has shape"):
        worker.prepare_refit_info({"w": ([-1], "float32")})
    summary = worker.prepare_refit_info({"norm.weight": ([4], "float32")})
    assert summary == {
        "manifest_digest": specs(norm__weight=(4,)).digest(),
        "tensors": 1,
        "direct": 1,
        "loaded": 0,
    }
    assert worker.engine_param_layout() == {
        "norm.weight": [[4], "float32"],
        "proj.weight": [[3, 4], "float32"],
        "proj.bias": [[3], "float32"],
    }
    worker.cleanup()


# -- the real CPU engine --------------------------------------------------------------


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Weights:
    b_dir = build_tiny_model(tmp_path_factory.mktemp("refit") / "tiny-llama-b", seed=1)
    return Weights(tiny_model_dir / "model.safetensors", b_dir / "model.safetensors", b_dir)


@pytest.fixture(scope="module")
def reference_b(weights: Weights) -> list[list[int]]:
    """Greedy tokens of a fresh engine started on the saved weights B."""
    llm = start_engine(weights.b_dir, extension=False)
    try:
        return greedy(llm)
    finally:
        stop_engine(llm)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, reference_b: list[list[int]]) -> Iterator[Engine]:
    llm = start_engine(tiny_model_dir, extension=True)
    try:
        yield Engine(llm, greedy(llm))
    finally:
        llm.collective_rpc("cleanup")
        stop_engine(llm)


@pytest.fixture(scope="module")
def trainer() -> Iterator[Trainer]:
    t = Trainer()
    yield t
    t.stop()


def refit_ipc(engine: Engine, trainer: Trainer, path: Path, **edits: object) -> dict[str, object]:
    address = engine.rpc("ipc_address")
    trainer.submit("ipc", address=address, path=str(path), **edits)
    try:
        report = engine.rpc("update_weights_via_ipc_zmq", timeout_s=REFIT_TIMEOUT)
    finally:
        sent = trainer.result()
    assert sent.ok, sent
    assert isinstance(report, dict)
    return report


@pytest.fixture(scope="module")
def group(engine: Engine, trainer: Trainer) -> None:
    """The engine and the trainer joined in one weight-update group (gloo)."""
    port = free_port()
    trainer.submit("join", port=port, world_size=2)
    engine.rpc("init_collective", 0, "127.0.0.1", port, 2, 1)
    joined = trainer.result()
    assert joined.ok, joined


@pytest.mark.engine
def test_worker_extension_reports_its_device_and_layout(engine: Engine, weights: Weights) -> None:
    assert engine.rpc("report_device_id") == f"cpu@{socket.gethostname()}"
    layout = engine.rpc("engine_param_layout")
    assert isinstance(layout, dict)
    assert set(layout) == DIRECT
    assert layout["lm_head.weight"] == [
        list(load_file(weights.b)["lm_head.weight"].shape),
        "float32",
    ]
    summary = engine.rpc("prepare_refit_info", info(weights.b))
    checkpoint = info(weights.b)
    assert summary == {
        "manifest_digest": Manifest.from_info(checkpoint).unwrap().digest(),
        "tensors": len(checkpoint),
        "direct": len(DIRECT),
        "loaded": len(checkpoint) - len(DIRECT),
    }


@pytest.mark.engine
def test_ipc_refit_from_a_trainer_process_matches_a_fresh_engine(
    engine: Engine, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    assert engine.baseline_a != reference_b  # or a refit that changed nothing would pass
    engine.rpc("prepare_refit_info", info(weights.b))
    report = refit_ipc(engine, trainer, weights.b, manifest_path=str(weights.b))
    assert engine.tokens() == reference_b
    assert report["tensors"] == len(info(weights.b))
    assert (report["direct"], report["loaded"]) == (len(DIRECT), len(info(weights.b)) - len(DIRECT))
    refit_ipc(engine, trainer, weights.a)
    assert engine.tokens() == engine.baseline_a


@pytest.mark.engine
@pytest.mark.usefixtures("group")
def test_collective_refits_twice_in_a_row_match_fresh_engines(
    engine: Engine, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    engine.rpc("prepare_refit_info", info(weights.b))
    for path, expected in ((weights.b, reference_b), (weights.a, engine.baseline_a)):
        trainer.submit("collective", path=str(path))
        report = engine.rpc("update_weights_from_collective", timeout_s=REFIT_TIMEOUT)
        sent = trainer.result()
        assert sent.ok, sent
        assert isinstance(report, dict)
        assert report["bytes"] == sent.detail["bytes"]
        assert engine.tokens() == expected


@pytest.mark.engine
@pytest.mark.usefixtures("group")
def test_a_refit_in_the_engine_layout_goes_straight_into_parameter_memory(
    engine: Engine, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    engine.rpc("prepare_refit_info", info(weights.b))
    trainer.submit("collective", path=str(weights.b))
    engine.rpc("update_weights_from_collective", timeout_s=REFIT_TIMEOUT)
    assert trainer.result().ok
    assert engine.tokens() == reference_b
    # Only the parameters vLLM keeps as they are, from A: every one is copied directly.
    summary = engine.rpc("prepare_refit_info", info(weights.a, keep=DIRECT))
    assert summary["direct"] == len(DIRECT)  # type: ignore[index]
    trainer.submit("collective", path=str(weights.a), keep=sorted(DIRECT))
    report = engine.rpc("update_weights_from_collective", timeout_s=REFIT_TIMEOUT)
    sent = trainer.result()
    assert sent.ok
    assert isinstance(report, dict)
    assert (report["direct"], report["loaded"]) == (len(DIRECT), 0)
    assert report["mode"] == sent.detail["mode"] == "direct-receive"
    mixed = engine.tokens()
    assert mixed != reference_b
    # The bucket path writes the same weights.
    trainer.submit("collective", path=str(weights.b), keep=sorted(DIRECT))
    engine.rpc("update_weights_from_collective", timeout_s=REFIT_TIMEOUT)
    assert trainer.result().ok
    trainer.submit("collective", path=str(weights.a), keep=sorted(DIRECT), direct=False)
    report = engine.rpc("update_weights_from_collective", timeout_s=REFIT_TIMEOUT)
    assert trainer.result().ok
    assert report["mode"] == "buckets"  # type: ignore[index]
    assert engine.tokens() == mixed
    trainer.submit("collective", path=str(weights.b), keep=sorted(DIRECT))
    engine.rpc("update_weights_from_collective", timeout_s=REFIT_TIMEOUT)
    assert trainer.result().ok
    assert engine.tokens() == reference_b


@pytest.mark.engine
def test_ipc_engine_handles_write_the_same_weights_as_buckets(
    engine: Engine, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    engine.rpc("prepare_refit_info", info(weights.b))
    report = refit_ipc(engine, trainer, weights.b)
    assert report["mode"] == "buckets"  # the linear weights need the loader on CPU
    assert engine.tokens() == reference_b
    engine.rpc("prepare_refit_info", info(weights.a, keep=DIRECT))
    report = refit_ipc(engine, trainer, weights.a, keep=sorted(DIRECT))
    assert report["mode"] == "engine-handles"
    assert (report["direct"], report["loaded"], report["buckets"]) == (len(DIRECT), 0, 0)
    mixed = engine.tokens()
    assert mixed != reference_b
    refit_ipc(engine, trainer, weights.b, keep=sorted(DIRECT))
    assert engine.tokens() == reference_b
    report = refit_ipc(engine, trainer, weights.a, keep=sorted(DIRECT), direct=False)
    assert report["mode"] == "buckets"
    assert engine.tokens() == mixed
    # A wrong shape is refused before anything is written, naming the tensor.
    trainer.submit(
        "ipc",
        address=engine.rpc("ipc_address"),
        path=str(weights.b),
        keep=sorted(DIRECT),
        reshape={"model.norm.weight": [64]},
    )
    with pytest.raises(RefitManifestError, match=r"model\.norm\.weight"):
        engine.rpc("update_weights_via_ipc_zmq", timeout_s=REFIT_TIMEOUT)
    assert not trainer.result().ok
    assert engine.tokens() == mixed
    refit_ipc(engine, trainer, weights.b, keep=sorted(DIRECT))
    assert engine.tokens() == reference_b


@pytest.mark.engine
def test_ipc_sender_handles_read_the_trainers_tensors_and_keep_mapped_keeps_them(
    engine: Engine, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    """An engine that offers none of its memory reads the trainer's tensors (the mode of
    a sleep-mode GPU engine); with ``keep_mapped`` it keeps them mapped until released."""
    engine.rpc("prepare_refit_info", info(weights.b))
    refit_ipc(engine, trainer, weights.b)
    engine.rpc("prepare_refit_info", info(weights.a, keep=DIRECT))
    assert refit_ipc(engine, trainer, weights.a, keep=sorted(DIRECT))["mode"] == "engine-handles"
    mixed = engine.tokens()
    assert mixed != reference_b
    default = engine.rpc("ipc_address")
    try:
        address = engine.rpc("ipc_address", None, False)  # a new socket, with these options
        assert address != default
        assert engine.rpc("ipc_address", None, False) == address
        for path, expected, keep_mapped in [
            (weights.b, reference_b, True),
            (weights.a, mixed, True),
            (weights.b, reference_b, False),
        ]:
            trainer.submit(
                "ipc", address=address, path=str(path), keep=sorted(DIRECT), keep_mapped=keep_mapped
            )
            report = engine.rpc("update_weights_via_ipc_zmq", timeout_s=REFIT_TIMEOUT)
            assert trainer.result().ok
            assert isinstance(report, dict)
            assert report["mode"] == "sender-handles"
            assert (report["direct"], report["buckets"]) == (len(DIRECT), 0)
            assert engine.tokens() == expected
            kept = engine.rpc("release_kept_buffers")
            assert (kept > 0) if keep_mapped else (kept == 0), kept  # type: ignore[operator]
            assert engine.rpc("release_kept_buffers") == 0
    finally:
        engine.rpc("ipc_address")  # the default socket again, for the other tests


FAULTS = [
    (
        {"drop": ["model.layers.1.mlp.down_proj.weight"]},
        "model.layers.1.mlp.down_proj.weight",
        "never arrived",
    ),
    (
        {"add": {"model.layers.7.bogus.weight": [2, 2]}},
        "model.layers.7.bogus.weight",
        "not in the manifest",
    ),
    ({"reshape": {"model.norm.weight": [64]}}, "model.norm.weight", "expected [128] float32"),
    ({"retype": {"lm_head.weight": "float64"}}, "lm_head.weight", "got [512, 128] float64"),
]


@pytest.mark.engine
@pytest.mark.parametrize(
    ("edits", "name", "detail"), FAULTS, ids=["missing", "extra", "shape", "dtype"]
)
def test_ipc_stream_that_breaks_the_manifest_raises_typed_errors_naming_the_tensor(
    engine: Engine,
    trainer: Trainer,
    weights: Weights,
    reference_b: list[list[int]],
    edits: dict[str, object],
    name: str,
    detail: str,
) -> None:
    engine.rpc("prepare_refit_info", info(weights.b))
    address = engine.rpc("ipc_address")
    trainer.submit("ipc", address=address, path=str(weights.b), **edits)
    with pytest.raises(RefitManifestError) as raised:
        engine.rpc("update_weights_via_ipc_zmq", timeout_s=REFIT_TIMEOUT)
    sent = trainer.result()
    assert name in str(raised.value)
    assert detail in str(raised.value)
    assert not sent.ok
    assert sent.error == "RefitManifestError"
    assert name in sent.message
    # The weights are inconsistent now; the next complete refit restores them exactly.
    refit_ipc(engine, trainer, weights.b)
    assert engine.tokens() == reference_b


@pytest.mark.engine
@pytest.mark.usefixtures("group")
def test_collective_stream_missing_a_tensor_fails_on_both_sides_then_recovers(
    engine: Engine, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    engine.rpc("prepare_refit_info", info(weights.b))
    missing = "model.layers.0.self_attn.q_proj.weight"
    trainer.submit("collective", path=str(weights.b), drop=[missing])
    started = time.monotonic()
    with pytest.raises(RefitManifestError, match=missing.replace(".", r"\.")):
        engine.rpc("update_weights_from_collective", timeout_s=REFIT_TIMEOUT)
    sent = trainer.result()
    assert time.monotonic() - started < REFIT_TIMEOUT / 2
    assert sent.error == "RefitManifestError"
    assert missing in sent.message
    trainer.submit("collective", path=str(weights.b))
    engine.rpc("update_weights_from_collective", timeout_s=REFIT_TIMEOUT)
    assert trainer.result().ok
    assert engine.tokens() == reference_b


@pytest.mark.engine
def test_refit_errors_are_refit_errors(engine: Engine, weights: Weights) -> None:
    # No trainer at all: the engine gives up within its bound, with a typed error.
    engine.rpc("prepare_refit_info", info(weights.b))
    started = time.monotonic()
    with pytest.raises(RefitError, match=r"no refit message from .* within 1\.0s"):
        engine.rpc("update_weights_via_ipc_zmq", timeout_s=1.0)
    assert time.monotonic() - started < 5.0


# -- the same, through VllmGenerationWorker: the lifecycle around a refit ---------------


@pytest.mark.engine
def test_worker_refuses_to_generate_after_a_bad_refit_until_a_good_one(
    engine: Engine, trainer: Trainer, weights: Weights, reference_b: list[list[int]]
) -> None:
    from helpers import right_padded

    from genworker.shell.vllm_engine import VllmEngine
    from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

    config = {
        "model_name": "tiny", "max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0,
        "top_k": None, "stop_token_ids": None, "stop_strings": None, "_pad_token_id": 2,
        "vllm_cfg": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                     "gpu_memory_utilization": 0.05, "max_model_len": 256,
                     "precision": "float32"},
    }  # fmt: skip
    worker = VllmGenerationWorker(config, engine_factory=ExistingEngine(VllmEngine(engine.llm)))
    data = right_padded(PROMPTS, pad=2)

    def tokens() -> list[list[int]]:
        out = worker.generate(data, greedy=True)
        starts, ends = data["input_lengths"], out["unpadded_sequence_lengths"]
        return [out["output_ids"][i, starts[i] : ends[i]].tolist() for i in range(len(PROMPTS))]

    state_dict = load_file(weights.b)
    worker.prepare_refit_info({n: (t.shape, t.dtype) for n, t in state_dict.items()})
    (address,) = worker.refit_address()
    missing = "model.norm.weight"
    trainer.submit("ipc", address=address, path=str(weights.b), drop=[missing])
    with pytest.raises(RefitManifestError, match=missing.replace(".", r"\.")):
        worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT)
    assert not trainer.result().ok
    with pytest.raises(EngineStateError, match="refit"):
        worker.generate(data, greedy=True)

    (address,) = worker.refit_address()
    trainer.submit("ipc", address=address, path=str(weights.b))
    assert worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT) is True
    assert trainer.result().ok
    assert tokens() == reference_b
    reports = worker.last_refit["engine_workers"]
    assert isinstance(reports, list)
    report = reports[0]
    assert isinstance(report, dict)
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in state_dict.values())
    assert {"routes", "begin", "finalize", "answer"} <= set(report["phases"])
    rpc_seconds = worker.last_refit["rpc_seconds"]
    assert isinstance(rpc_seconds, float)
    assert rpc_seconds >= report["seconds"]
    (layout,) = worker.engine_param_layout()
    assert layout == engine.rpc("engine_param_layout")
    assert worker.release_refit_buffers() == [0]  # the engine offered its own memory
