"""The async worker over vLLM's ``AsyncLLM`` on CUDA: streams, an in-flight refit with
``keep``, per-token weight versions, cancellation, sleep while streaming.

One ``AsyncLLM`` for the module (its engine core, with its own sleep-mode allocator, is a
process of its own, so it lives beside the session's sync engine). Checkpoint B travels
from a trainer process over CUDA IPC, as in ``test_gpu_refit.py``; every test leaves the
module's worker awake and on checkpoint A.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gpu.gpu_fixtures import (
    GPU_MARKS,
    MAX_MODEL_LEN,
    PROMPTS,
    REFIT_TIMEOUT_S,
    Checkpoints,
    Trainer,
    batch,
    gpu_config,
    ipc_trainer_main,
    manifest,
    run,
)

from genworker.core import lifecycle
from genworker.core.engine_calls import RpcCall
from genworker.shell.async_engine import AsyncVllmEngine
from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import EngineStateError, GenworkerError

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS


@pytest.fixture(scope="module")
def aworker(
    checkpoints: Checkpoints, loop: asyncio.AbstractEventLoop
) -> Iterator[AsyncVllmGenerationWorker]:
    config = gpu_config(checkpoints.a, checkpoints.pad)
    config["max_new_tokens"] = 64
    config["vllm_cfg"] = {
        **config["vllm_cfg"],  # type: ignore[dict-item]
        "async_engine": True,
        "cap_max_tokens_to_context": True,
    }
    worker = AsyncVllmGenerationWorker(config)
    yield worker
    run(loop, worker.shutdown())


@pytest.fixture(scope="module")
def trainer(
    aworker: AsyncVllmGenerationWorker, loop: asyncio.AbstractEventLoop
) -> Iterator[Trainer]:
    (address,) = run(loop, aworker.refit_address())
    t = Trainer(ipc_trainer_main, {"address": str(address)})
    yield t
    t.stop()


async def ready_refit(worker: AsyncVllmGenerationWorker, trainer: Trainer, checkpoint: Any) -> None:
    """The refit's slow start: the manifest, and the trainer process loading ``checkpoint``
    and sending (it waits for the engine to receive)."""
    await worker.prepare_refit_info(manifest(checkpoint))
    trainer.send("send", (str(checkpoint), False))
    await asyncio.get_running_loop().run_in_executor(None, trainer.expect, "sending")


async def finish_refit(worker: AsyncVllmGenerationWorker, trainer: Trainer) -> None:
    """Receive the weights the trainer is sending, while whatever runs keeps running."""
    assert await worker.update_weights_via_ipc_zmq(timeout_s=REFIT_TIMEOUT_S)
    await asyncio.get_running_loop().run_in_executor(None, trainer.expect, "sent")


async def refit(worker: AsyncVllmGenerationWorker, trainer: Trainer, checkpoint: Any) -> None:
    """Push ``checkpoint`` from the trainer process while whatever runs keeps running."""
    await ready_refit(worker, trainer, checkpoint)
    await finish_refit(worker, trainer)


async def collect(stream: Any) -> list[Any]:
    return [item async for item in stream]


def rows_of(items: list[Any]) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for row, item in items:
        assert not isinstance(item, GenworkerError), (row, item)
        out[row] = item
    return out


def tokens_and_versions(out: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    g = int(out["generation_lengths"][0])
    start = int(out["unpadded_sequence_lengths"][0]) - g
    return (
        out["output_ids"][0, start : start + g].tolist(),
        out["weight_versions"][0, start : start + g].tolist(),
    )


def long_tail(pad: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Rows with room for 8, 24 or 64 tokens (the context cap), prompts from PROMPTS."""
    rooms = [8, 24, 64] * 8
    prompts = []
    for i, room in enumerate(rooms):
        base = list(PROMPTS[i % len(PROMPTS)])
        n = MAX_MODEL_LEN - room if room < 64 else len(base)
        prompts.append((base * (n // len(base) + 1))[:n])
    return batch(prompts, pad), rooms


def test_rows_stream_as_they_finish_and_equal_the_batch(
    aworker: AsyncVllmGenerationWorker, checkpoints: Checkpoints, loop: asyncio.AbstractEventLoop
) -> None:
    data, rooms = long_tail(checkpoints.pad)
    items = run(loop, collect(aworker.generate_async(data, greedy=True)))
    got = rows_of(items)
    assert sorted(got) == list(range(len(rooms)))
    arrived = [int(got[r]["generation_lengths"][0]) for r, _ in items]
    assert arrived == sorted(arrived), arrived
    whole = run(loop, aworker.generate(data, greedy=True))
    for i, out in got.items():
        end = int(whole["unpadded_sequence_lengths"][i])
        assert torch.equal(out["output_ids"][0], whole["output_ids"][i, :end]), i
        assert set(tokens_and_versions(out)[1]) == {0}


def test_an_in_flight_refit_with_keep_marks_each_token_s_version(
    aworker: AsyncVllmGenerationWorker,
    checkpoints: Checkpoints,
    trainer: Trainer,
    loop: asyncio.AbstractEventLoop,
) -> None:
    data, _ = long_tail(checkpoints.pad)
    baseline = rows_of(run(loop, collect(aworker.generate_async(data, greedy=True))))
    version = aworker.weight_version

    async def with_refit() -> list[Any]:
        # The trainer is sending before the batch starts: on the H200 (206e9b2) a refit
        # begun after the first row came back (the trainer then loading B) landed after
        # the long rows had finished.
        await ready_refit(aworker, trainer, checkpoints.b)
        items = []
        async with contextlib.aclosing(aworker.generate_async(data, greedy=True)) as stream:
            async for item in stream:
                items.append(item)
                if len(items) == 1:  # a short row is back: the long ones are mid-stream
                    await finish_refit(aworker, trainer)
        return items

    got = rows_of(run(loop, with_refit()))
    assert aworker.weight_version == version + 1
    assert aworker.last_refit["mode"] == "keep"
    straddling = []
    for i, out in got.items():
        tokens, versions = tokens_and_versions(out)
        assert versions == sorted(versions)
        assert set(versions) <= {version, version + 1}
        cut = versions.index(version + 1) if version + 1 in versions else len(versions)
        before, _ = tokens_and_versions(baseline[i])
        assert tokens[:cut] == before[:cut], i
        if 0 < cut < len(tokens):
            straddling.append((i, tokens, cut))
    assert straddling, "some rows straddle the refit"
    # The tokens after the boundary: what B continues from the prompt plus the tokens
    # before it (the same engine, now on B, from scratch: prefix caching is off).
    for i, tokens, cut in straddling:
        n = int(data["input_lengths"][i])
        prompt = data["input_ids"][i, :n].tolist()
        cont = run(
            loop,
            collect(
                aworker.generate_async(batch([prompt + tokens[:cut]], checkpoints.pad), greedy=True)
            ),
        )
        (out,) = rows_of(cont).values()
        assert tokens_and_versions(out)[0][: len(tokens) - cut] == tokens[cut:], i
    run(loop, refit(aworker, trainer, checkpoints.a))
    again = rows_of(run(loop, collect(aworker.generate_async(data, greedy=True))))
    for i, out in again.items():
        assert tokens_and_versions(out)[0] == tokens_and_versions(baseline[i])[0], i


def test_a_consumer_that_stops_aborts_its_requests(
    aworker: AsyncVllmGenerationWorker, checkpoints: Checkpoints, loop: asyncio.AbstractEventLoop
) -> None:
    data, _ = long_tail(checkpoints.pad)

    async def main() -> None:
        async with contextlib.aclosing(aworker.generate_async(data)) as stream:
            async for _ in stream:
                break
        assert aworker.num_unfinished() == 0

    run(loop, main())
    assert aworker.state == lifecycle.AWAKE


def test_sleep_waits_for_the_streams_and_then_frees_memory(
    aworker: AsyncVllmGenerationWorker, checkpoints: Checkpoints, loop: asyncio.AbstractEventLoop
) -> None:
    data, _ = long_tail(checkpoints.pad)

    async def main() -> None:
        task = asyncio.ensure_future(collect(aworker.generate_async(data)))
        while aworker.num_unfinished() == 0:
            await asyncio.sleep(0.001)
        with pytest.raises(EngineStateError, match="requests are in flight"):
            await aworker.sleep(1)
        await task
        await aworker.sleep(1)
        assert aworker.state == lifecycle.ASLEEP_L1
        # the first sleep installed the wake in the engine core (genworker.shell.cumem_wake)
        engine = aworker.engine
        assert isinstance(engine, AsyncVllmEngine)
        assert engine._wake_installed
        assert await engine.collective_rpc(RpcCall("install_wake", timeout=60.0)) == [True]
        await aworker.wake_up()
        again = rows_of(await collect(aworker.generate_async(batch(PROMPTS, checkpoints.pad))))
        assert len(again) == len(PROMPTS)

    run(loop, main())
