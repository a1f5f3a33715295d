"""MoE routing replay (R3) on the GPU engine (vLLM 0.25): the experts the worker returns
for the tiny MoE (``helpers.build_tiny_moe``, float32, routers scaled so that no top-k is
a near tie) equal, position by position, the router top-k of a transformers forward pass
of the same weights over the same tokens (the prompt and the generated tokens but the
last, which vLLM never forwards), before and after an IPC refit to other weights. The
engine runs in a spawned child (``gpu.gpu_r3``). Without a GPU the module skips; its
reference pass and the layout are dry-run on CPU by ``tests/shell/test_routes_engine.py``.
"""

from __future__ import annotations

import pytest
import torch
from gpu.gpu_fixtures import GPU_MARKS, Child, pad_token_id
from gpu.gpu_r3 import R3_PROMPTS, assert_routes_match, r3_engine_main
from helpers import build_tiny_moe

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS


def test_returned_experts_equal_the_router_top_k_before_and_after_a_refit(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    base = tmp_path_factory.mktemp("r3")
    a, b = build_tiny_moe(base / "moe-a", seed=0), build_tiny_moe(base / "moe-b", seed=1)
    pad = pad_token_id(a)
    child = Child(r3_engine_main, gpu=0, a=str(a), b=str(b), pad=pad)
    outs = child.result()
    assert isinstance(outs, dict)
    for what, model in (("a", a), ("b", b)):
        out = outs[what]
        assert out["generation_lengths"].tolist() == [12] * len(R3_PROMPTS)
        assert_routes_match(out, model, f"checkpoint {what}", "cuda")
    assert not torch.equal(outs["a"]["routed_experts"], outs["b"]["routed_experts"])
