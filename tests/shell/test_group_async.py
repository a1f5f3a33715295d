"""The generation group with async shards on a local Ray: the shards' streams merged.

The shards run ``AsyncVllmGenerationWorker`` over the fake async engine (each shard's
engine gets its own seed from the placement plan, so rows are compared by what the
group promises: the batch's row index, the row's own prompt, its length under the
context cap, bad rows refused in the driver, one item per row). What the real engine does
is in ``test_worker_async_engine.py``. The test that kills a shard runs last.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from async_helpers import async_config, collect, outputs, sending
from helpers import base_config, right_padded
from safetensors.torch import load_file

from genworker.shell.errors import BadBatchError, GenworkerError, GroupError, UnsupportedError
from genworker.shell.fake_async_engine import FakeAsyncEngineFactory
from genworker.shell.fake_engine import FakeEngineFactory
from genworker.shell.group import ClusterSpec, GenerationGroup

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def group_config(**top: Any) -> dict[str, Any]:
    return async_config(
        max_new_tokens=30,
        ignore_eos=True,
        vllm_cfg={"max_model_len": MAX_MODEL_LEN, "cap_max_tokens_to_context": True},
        **top,
    )


# -- before the module's group (it holds both CPUs) --


def test_a_sync_group_has_no_stream_and_no_in_flight_refit_options(ray_session: None) -> None:
    with GenerationGroup(
        base_config(),
        ClusterSpec(
            num_shards=1,
            cpus_per_node=2,
            actor_num_cpus=0.5,
            start_timeout_s=300,
            placement_timeout_s=60,
        ),
        worker_options={"engine_factory": FakeEngineFactory()},
    ) as sync_group:
        with pytest.raises(UnsupportedError, match="async_engine"):
            asyncio.run(collect(sync_group.generate_async(right_padded([[3]]))))
        with pytest.raises(UnsupportedError, match="in-flight refits"):
            sync_group.update_weights_via_ipc_zmq(mode="keep")


@pytest.mark.engine
def test_a_real_async_shard_streams_and_refits_in_flight(
    ray_session: None, tiny_model_dir: Path
) -> None:
    """One shard on vLLM's AsyncLLM inside a Ray async actor (the engine core is the
    actor's child process): rows stream back, and a refit of the same weights lands while
    they run (mode keep), bumping every later token's version."""
    config = {
        **group_config(model_name=str(tiny_model_dir), _pad_token_id=2),
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20},
    }
    config["vllm_cfg"] = {
        **config["vllm_cfg"],
        "max_model_len": 256,
        "gpu_memory_utilization": 0.05,
    }
    # Room for 200 tokens a row: the rows are still running when the refit lands, even on
    # a quiet host (on an AMD EPYC host all 200 came back within one second: the refit
    # starts after a quarter of one).
    config["max_new_tokens"] = 200
    weights = load_file(tiny_model_dir / "model.safetensors")
    with GenerationGroup(
        config,
        ClusterSpec(num_shards=1, cpus_per_node=2, start_timeout_s=600, placement_timeout_s=60),
    ) as real:
        real.prepare_refit_info({n: (list(t.shape), t.dtype) for n, t in weights.items()})
        ((address,),) = real.refit_address()
        data = right_padded([[5, 6, 7], [8, 9], [10, 11, 12, 13]], pad=2)

        async def main() -> list[Any]:
            stream = real.generate_async(data, greedy=True)
            first = asyncio.ensure_future(stream.__anext__())
            # Soon: a fast host finishes 200 tokens a row within a few tenths of a second.
            # Should the refit land before the first token, every token says 1: still sorted.
            await asyncio.sleep(0.05)
            with sending(str(address), weights):
                futures = real.update_weights_via_ipc_zmq(60.0, mode="keep")
                loop = asyncio.get_running_loop()
                assert await loop.run_in_executor(None, real.collect, futures) == [True]
            items = [await first]
            items += [item async for item in stream]
            return items

        got = outputs(asyncio.run(main()))
        assert sorted(got) == [0, 1, 2]
        for row, out in got.items():
            n = int(data["input_lengths"][row])
            versions = out["weight_versions"][0, n:].tolist()
            assert versions == sorted(versions)
            assert set(versions) <= {0, 1}
        assert any(1 in o["weight_versions"][0].tolist() for o in got.values())


@pytest.fixture(scope="module")
def group(ray_session: None) -> Iterator[GenerationGroup]:
    g = GenerationGroup(
        group_config(),
        ClusterSpec(num_shards=2, cpus_per_node=2, actor_num_cpus=0.5, start_timeout_s=300),
        worker_options={
            "engine_factory": FakeAsyncEngineFactory(
                max_model_len=MAX_MODEL_LEN, step_s=0.05, accept_refits=True
            )
        },
    )
    yield g
    g.shutdown()


def test_the_shards_streams_merge_under_the_batch_row_index(group: GenerationGroup) -> None:
    prompts = [[3 + i] * n for i, n in enumerate([4, 50, 9, 60, 2, 40, 33, 7])]
    data = right_padded([*prompts[:3], [5, 999], *prompts[3:], [6] * MAX_MODEL_LEN])
    items = asyncio.run(collect(group.generate_async(data)))
    assert sorted(r for r, _ in items) == list(range(10)), "each row once"
    errors = {r: e for r, e in items if isinstance(e, GenworkerError)}
    assert items[0][0] == 9, "a row the driver refuses (no room) comes first"
    assert sorted(errors) == [3, 9]
    assert all(isinstance(errors[r], BadBatchError) for r in (3, 9))
    assert "no room to generate" in str(errors[9])
    # The driver does not know the vocabulary: the shard refuses row 3 and names it.
    assert "batch row 3" in str(errors[3])
    assert "outside [0, 64)" in str(errors[3])
    got = outputs(items)
    for row, out in got.items():
        prompt = data["input_ids"][row, : int(data["input_lengths"][row])].tolist()
        g = min(30, MAX_MODEL_LEN - len(prompt))
        assert out["output_ids"][0, : len(prompt)].tolist() == prompt
        assert out["generation_lengths"].tolist() == [g]
        assert set(out["weight_versions"][0, len(prompt) :].tolist()) == {0}


def test_generate_on_async_shards_merges_weight_versions(group: GenerationGroup) -> None:
    data = right_padded([[3] * 4, [4] * 50, [5] * 9])
    out = group.generate(data)
    assert out["weight_versions"].shape == out["output_ids"].shape
    assert (out["weight_versions"] >= 0).sum().item() == int(out["generation_lengths"].sum())


def test_an_in_flight_refit_through_the_group_reaches_every_shard(group: GenerationGroup) -> None:
    data = right_padded([[3 + i] * (4 + i) for i in range(4)])
    group.prepare_refit_info({"w": ([2], "float32")})

    async def main() -> list[Any]:
        stream = group.generate_async(data)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.5)
        assert group.collect(group.update_weights_via_ipc_zmq(30.0, mode="keep")) == [True, True]
        items = [await first]
        items += [item async for item in stream]
        return items

    got = outputs(asyncio.run(main()))
    assert sorted(got) == [0, 1, 2, 3]
    for row, out in got.items():
        versions = out["weight_versions"][0, 4 + row :].tolist()
        assert versions[0] == 0, "the refit came after the first tokens"
        assert versions[-1] == 1, "and before the last"
        assert versions == sorted(versions)


def test_a_killed_shard_fails_its_pending_rows_and_the_other_shard_keeps_its_own(
    group: GenerationGroup,
) -> None:
    data = right_padded([[3 + i] * (4 + i) for i in range(6)])

    async def main() -> list[Any]:
        stream = group.generate_async(data)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.5)
        ray.kill(group.actors[1], no_restart=True)
        items = [await first]
        items += [item async for item in stream]
        return items

    items = asyncio.run(main())
    assert sorted(r for r, _ in items) == list(range(6))
    failed = {r: e for r, e in items if isinstance(e, GroupError)}
    assert failed, [(r, type(e).__name__, str(e)[:200]) for r, e in items]
    assert all("shard 1" in str(e) for e in failed.values())
    assert len(outputs(items)) + len(failed) == 6
    assert outputs(items), "the other shard's rows come back"
