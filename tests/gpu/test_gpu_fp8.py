"""fp8 rollouts on CUDA (``vllm_cfg.precision: fp8``): the fp8 engine (a child process,
``gpu.gpu_fp8``) quantizes its bf16 checkpoint at start and every refit on its way into
vLLM's block-fp8 layers; held against the bf16 session worker on the same weights."""

from __future__ import annotations

from gpu.gpu_fixtures import (
    GPU_MARKS,
    PROMPTS,
    GpuSession,
    refit_over_ipc,
    run_in_child,
)
from gpu.gpu_fp8 import fp8_engine_main
from helpers import forced_logprobs

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS

# bf16 against block-fp8 weights on the tiny random Llama (the CPU engine: under 0.05)
FORCED_TOLERANCE = 0.1


def _gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_an_fp8_engine_follows_the_bf16_one_from_its_checkpoint_and_through_refits(
    gpu_session: GpuSession, reference_b: list[list[int]]
) -> None:
    checkpoints = gpu_session.checkpoints
    on_a = [list(p) + t for p, t in zip(PROMPTS, gpu_session.baseline_a, strict=True)]
    on_b = [list(p) + t for p, t in zip(PROMPTS, reference_b, strict=True)]
    result = run_in_child(
        fp8_engine_main,
        a=str(checkpoints.a),
        b=str(checkpoints.b),
        pad=checkpoints.pad,
        on_a=on_a,
        on_b=on_b,
    )
    assert isinstance(result, dict)
    assert result["finite"] is True  # vLLM alone casts bf16 into fp8 with no scales: NaN
    worker = gpu_session.worker
    assert _gap(result["forced_a"], forced_logprobs(worker.llm, on_a)) < FORCED_TOLERANCE
    refit_over_ipc(gpu_session, checkpoints.b)
    try:
        assert _gap(result["forced_b"], forced_logprobs(worker.llm, on_b)) < FORCED_TOLERANCE
    finally:
        refit_over_ipc(gpu_session, checkpoints.a)  # the session worker holds A again
    assert result["b"] != result["start"]
    # the same bf16 checkpoint by refit quantizes as the start did: the same engine
    assert result["a_again"] == result["start"], result["changed"]
