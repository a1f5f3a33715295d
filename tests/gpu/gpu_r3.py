"""What the R3 GPU test runs in its own spawned process (imported as ``gpu.gpu_r3``): an
engine on the tiny MoE with ``enable_return_routed_experts`` cannot share the session's
process (one sleep-mode engine per process, ``gpu.gpu_fixtures``).

:func:`r3_engine_main` starts the worker on MoE checkpoint A with the capture (vLLM 0.25:
the ``ModelConfig`` flag, ``core.routing.plan_capture``), generates greedily, refits
checkpoint B over CUDA IPC from a trainer process it spawns, and generates again; it
returns both outputs' tensors (on the host) for the test to hold against transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from gpu.gpu_fixtures import (
    GPU_MEMORY_UTILIZATION,
    MAX_MODEL_LEN,
    REFIT_TIMEOUT_S,
    Trainer,
    batch,
    ipc_trainer_main,
    manifest,
)
from helpers import TINY_MOE_LAYERS, TINY_MOE_TOP_K, router_topk

from genworker.core.routing import FILL

__all__ = [
    "R3_KEYS",
    "R3_PROMPTS",
    "assert_routes_match",
    "r3_config",
    "r3_engine_main",
    "r3_server_main",
]

R3_PROMPTS = ((3, 17, 42, 99, 7), (5, 6), (11, 200, 300, 12, 13, 14, 15, 400, 8), (250,))
R3_KEYS = ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "routed_experts")
R3_NEW_TOKENS = 12


def r3_config(model: Path, pad: int) -> dict[str, object]:
    """NeMo-RL's generation config for the tiny MoE, float32 (the reference pass is float32
    too), routed experts on."""
    return {
        "backend": "vllm",
        "model_name": str(model),
        "max_new_tokens": R3_NEW_TOKENS,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "ignore_eos": True,
        "_pad_token_id": pad,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel_size": 1,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "max_model_len": MAX_MODEL_LEN,
            "precision": "float32",
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "enable_return_routed_experts": True,
        },
    }


def r3_engine_main(*, a: str, b: str, pad: int) -> dict[str, dict[str, torch.Tensor]]:
    """Greedy outputs on A, then on B after an IPC refit (see the module docstring)."""
    from genworker.shell.worker import VllmGenerationWorker

    worker = VllmGenerationWorker(r3_config(Path(a), pad))
    trainer: Trainer | None = None
    try:
        data = batch(R3_PROMPTS, pad)
        before = worker.generate(data, greedy=True)
        (address,) = worker.refit_address()
        trainer = Trainer(ipc_trainer_main, {"address": str(address)})
        worker.prepare_refit_info(manifest(Path(b)))
        trainer.send("send", (b, False))
        trainer.expect("sending")
        assert worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT_S)
        trainer.expect("sent")
        after = worker.generate(data, greedy=True)
        return {
            "a": {key: before[key].cpu() for key in R3_KEYS},
            "b": {key: after[key].cpu() for key in R3_KEYS},
        }
    finally:
        if trainer is not None:
            trainer.stop()
        worker.shutdown()


def assert_routes_match(
    out: Mapping[str, torch.Tensor], model: Path, what: str, device: str
) -> None:
    """``out``'s routes equal, at every forwarded position of every row, the router top-k
    of transformers' forward pass of ``model`` over the row's tokens; -1 after them."""
    routes = out["routed_experts"]
    ids = out["output_ids"]
    assert routes.dtype == torch.int8
    assert tuple(routes.shape) == (*ids.shape, TINY_MOE_LAYERS, TINY_MOE_TOP_K)
    ends = out["unpadded_sequence_lengths"].tolist()
    sequences = [ids[row, :end].tolist() for row, end in enumerate(ends)]
    reference = router_topk(model, sequences, device)
    for row, end in enumerate(ends):
        got = np.sort(routes[row, : end - 1].numpy().astype(np.int64), axis=-1)
        want = reference[row][: end - 1]
        bad = np.argwhere((got != want).any(axis=(1, 2))).ravel().tolist()
        assert not bad, f"{what}, row {row}: positions {bad} differ from the reference"
        assert bool((routes[row, end - 1 :] == FILL).all()), f"{what}, row {row}: padding"


def r3_server_main(*, a: str, pad: int) -> dict[str, object]:
    """The async worker's server on MoE checkpoint A with the capture: the worker's own
    greedy outputs, and per prompt the same greedy completion over HTTP asked with
    ``return_routed_experts`` (vLLM's base64 ``.npy``, decoded here) and without it."""
    import asyncio
    import base64
    import io

    import httpx

    from genworker.shell.async_worker import AsyncVllmGenerationWorker

    config = r3_config(Path(a), pad)
    vllm_cfg = dict(config["vllm_cfg"])  # type: ignore[call-overload]
    config["vllm_cfg"] = {
        **vllm_cfg,
        "async_engine": True,
        "expose_http_server": True,
        "http_server_on_policy_guard": False,  # greedy requests below
    }

    async def main() -> dict[str, object]:
        worker = AsyncVllmGenerationWorker(config)
        try:
            await worker.post_init_async()
            # row by row, as the HTTP requests run (the same batch shape, the same kernels)
            rows = [await worker.generate(batch((p,), pad), greedy=True) for p in R3_PROMPTS]
            assert worker.base_url is not None
            asked, plain = [], []
            async with httpx.AsyncClient(base_url=worker.base_url, timeout=120) as client:
                for prompt in R3_PROMPTS:
                    body = {
                        "prompt": list(prompt),
                        "max_tokens": R3_NEW_TOKENS,
                        "temperature": 0.0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    }
                    r = await client.post(
                        "/completions", json={**body, "return_routed_experts": True}
                    )
                    assert r.status_code == 200, r.text
                    choice = r.json()["choices"][0]
                    raw = base64.b64decode(choice["routed_experts"])
                    routes = np.load(io.BytesIO(raw), allow_pickle=False)
                    asked.append((choice["token_ids"], routes))
                    r = await client.post("/completions", json=body)
                    assert r.status_code == 200, r.text
                    plain.append(sorted(r.json()["choices"][0]))
            return {
                "worker": [{key: out[key][0].cpu() for key in R3_KEYS} for out in rows],
                "asked": asked,
                "plain": plain,
            }
        finally:
            await worker.shutdown()

    return asyncio.run(main())
