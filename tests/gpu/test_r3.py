"""MoE routing replay (R3) on the GPU engine (vLLM 0.25): the experts the worker returns
for the tiny MoE (``helpers.build_tiny_moe``, float32, routers scaled so that no top-k is
a near tie) equal, position by position, the router top-k of a transformers forward pass
of the same weights over the same tokens (the prompt and the generated tokens but the
last, which vLLM never forwards), before and after an IPC refit to other weights. The
engine runs in a spawned child (``gpu.gpu_r3``). Without a GPU the module skips; its
reference pass and the layout are dry-run on CPU by ``tests/shell/test_routes_engine.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu.gpu_fixtures import GPU_MARKS, Child, pad_token_id
from gpu.gpu_r3 import R3_PROMPTS, assert_routes_match, r3_engine_main, r3_server_main
from helpers import TINY_MOE_LAYERS, TINY_MOE_TOP_K, build_tiny_moe

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


def test_the_server_returns_the_experts_the_worker_returns_to_a_request_that_asks(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Over vLLM's app on CUDA: a completion asked with ``return_routed_experts`` carries
    (prompt + generated - 1) x layers x top_k ids equal to the worker's own rows, position
    by position (the same greedy tokens); one that does not ask carries none."""
    a = build_tiny_moe(tmp_path_factory.mktemp("r3-server") / "moe-a", seed=0)
    outs = Child(r3_server_main, gpu=0, a=str(a), pad=pad_token_id(a)).result()
    assert isinstance(outs, dict)
    for prompt, mine, (tokens, routes) in zip(
        R3_PROMPTS, outs["worker"], outs["asked"], strict=True
    ):
        end = int(mine["unpadded_sequence_lengths"])
        assert mine["output_ids"][len(prompt) : end].tolist() == tokens, prompt
        assert routes.shape == (end - 1, TINY_MOE_LAYERS, TINY_MOE_TOP_K), (prompt, routes.shape)
        want = np.sort(mine["routed_experts"][: end - 1].numpy().astype(np.int64), axis=-1)
        assert (np.sort(routes.astype(np.int64), axis=-1) == want).all(), prompt
    assert all("routed_experts" not in keys for keys in outs["plain"])
