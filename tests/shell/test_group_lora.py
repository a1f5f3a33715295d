"""Adapter refits and generation under adapters through the generation group, on a local
Ray with fake engines (two shards): ``prepare_lora`` / ``update_lora`` reach every shard,
each row runs under its own adapter and comes back in the batch's order, bad input is
refused in the driver naming it, and a refit that fails on one shard is typed and leaves
the group usable with one weight version per refit.

The fake engine samples a row under its adapter's name; :class:`AdapterFake` also under
what the shard holds under that name: a row's tokens are a function of the adapter's
last refit too. The
trainer's side is a folder: ``send`` writes an adapter's payload there and the shards'
``lora`` backend (the fake's ``refit_receive``) reads it, as the real one reads the
sender's tensors; a file ``fail-<seed>`` there makes that shard's next refits fail, and
``refuse-<seed>`` its ``prepare_lora``. Every engine samples with seed 0, so a row's
tokens do not depend on the shard it lands on and one worker in this process (the same
fakes) is the reference.
"""

from __future__ import annotations

import asyncio
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from async_helpers import async_config, collect, outputs
from helpers import base_config, right_padded

from genworker.core.assembly import Generation
from genworker.core.counters import PROMPT_TOKENS, CounterSample
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    EngineStateError,
    RefitError,
    RefitManifestError,
)
from genworker.shell.fake_async_engine import FakeAsyncEngine, FakeAsyncEngineFactory
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory, FakeRequest
from genworker.shell.group import ClusterSpec, GenerationGroup, ShardFailure
from genworker.shell.media import RowMedia
from genworker.shell.refit.wire import failure
from genworker.shell.worker import VllmGenerationWorker

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
# The fakes below go to the actors by value: Ray's workers cannot import this module (nor
# the ``helpers`` it imports, which lives on pytest's path only).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MAX_MODEL_LEN = 64
INFO = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ((8, 16), torch.float32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": ((16, 8), torch.float32),
}
PEFT = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
PROMPTS = [[3 + r, 4, 5 + r, 6 + 2 * r] for r in range(8)]  # eight different prompts


class AdapterFake(FakeEngine):
    """A fake engine that samples a row under its adapter: the payload this engine holds
    under the row's adapter name joins what the row's tokens are a function of."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        #: adapter name -> the payload of its last good refit here
        self.adapters: dict[str, str] = {}

    def _sample(self, request: FakeRequest, media: RowMedia | None, child: int) -> Generation:
        if (adapter := request.spec.adapter) is not None:
            payload = self.adapters[adapter.name]
            mark = 3 + zlib.crc32(payload.encode()) % 50
            request = attrs.evolve(request, prompt=(*request.prompt, mark))
        return super()._sample(request, media, child)


class AdapterFakes(FakeEngineFactory):
    """Starts :class:`AdapterFake` engines whose ``lora`` backend reads what the trainer
    wrote to ``trainer`` (the module docstring). Each answers ``report_device_id`` with
    the seed its shard was given, which names its files there."""

    def __init__(self, trainer: Path) -> None:
        super().__init__()
        self.trainer = str(trainer)

    def start(self, kwargs: Any) -> FakeEngine:
        seed = kwargs.get("seed", 0)
        engine = AdapterFake(max_model_len=MAX_MODEL_LEN)  # seed 0 on every shard
        ids: dict[str, int] = {}

        def init(backend: str, *args: object) -> object:
            if os.path.exists(os.path.join(self.trainer, f"refuse-{seed}")):
                return failure(RefitManifestError("adapter: q_proj is not a module here"))
            return f"ipc:///tmp/fake-lora-{seed}.sock"

        def receive(backend: str, name: str, timeout_s: float, transport: str = "ipc") -> object:
            if os.path.exists(os.path.join(self.trainer, f"fail-{seed}")):
                return failure(RefitError(f"adapter {name!r}: the trainer's sender went away"))
            engine.adapters[name] = Path(self.trainer, f"{name}.adapter").read_text()
            return {"adapter": name, "lora_int_id": ids.setdefault(name, len(ids) + 1)}

        engine.rpc_handlers.update(
            refit_init=init, refit_receive=receive, report_device_id=lambda: f"seed-{seed}"
        )
        self.started.append((dict(kwargs), engine))
        return engine


class AsyncAdapterFakes(FakeAsyncEngineFactory):
    """Fake async engines whose ``lora`` backend takes every adapter refit at once,
    except while ``trainer`` holds ``fail-<seed>`` for the engine's shard."""

    def __init__(self, trainer: Path) -> None:
        super().__init__(max_model_len=MAX_MODEL_LEN)
        self.trainer = str(trainer)

    def start(self, kwargs: Any) -> FakeAsyncEngine:
        engine = super().start(kwargs)
        seed = engine.seed

        def receive(backend: str, name: str, timeout_s: float, transport: str = "ipc") -> object:
            if os.path.exists(os.path.join(self.trainer, f"fail-{seed}")):
                return failure(RefitError(f"adapter {name!r}: the trainer's sender went away"))
            return {"adapter": name, "lora_int_id": 1}

        engine.rpc_handlers.update(
            refit_init=lambda backend, *args: f"ipc:///tmp/fake-lora-{seed}.sock",
            refit_receive=receive,
            report_device_id=lambda: f"seed-{seed}",
        )
        return engine


def send(trainer: Path, name: str, payload: str) -> None:
    """What the trainer sends next under ``name`` (the shards read it as they refit)."""
    (trainer / f"{name}.adapter").write_text(payload)


def shard_seeds(group: GenerationGroup) -> list[str]:
    return [str(ids[0]).removeprefix("seed-") for ids in group.report_device_id()]


def prompt_tokens(group: GenerationGroup) -> list[float]:
    return [
        sum(
            s.value
            for s in snapshot.samples
            if isinstance(s, CounterSample) and s.name == PROMPT_TOKENS
        )
        for snapshot in group.get_counters().shards
    ]


def batch(**extra: object) -> dict[str, object]:
    return {**right_padded(PROMPTS), **extra}


def collected(group: GenerationGroup, futures: list[Any]) -> list[object]:
    return group.collect(futures, timeout_s=60)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        # two CPUs per group: the module's sync group and the async test's
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def group(ray_session: None, trainer: Path) -> Iterator[GenerationGroup]:
    g = GenerationGroup(
        base_config(vllm_cfg={"max_model_len": MAX_MODEL_LEN}),
        ClusterSpec(num_shards=2, cpus_per_node=2, start_timeout_s=120, call_timeout_s=60),
        worker_options={"engine_factory": AdapterFakes(trainer)},
    )
    yield g
    g.shutdown()


@pytest.fixture
def reference(trainer: Path) -> Iterator[VllmGenerationWorker]:
    worker = VllmGenerationWorker(
        base_config(vllm_cfg={"max_model_len": MAX_MODEL_LEN}),
        engine_factory=AdapterFakes(trainer),
    )
    worker.prepare_lora(INFO, PEFT)
    yield worker
    worker.shutdown()


def test_update_lora_before_prepare_or_under_a_bad_name_starts_nothing(
    group: GenerationGroup, trainer: Path
) -> None:
    with pytest.raises(EngineStateError, match="needs a prepare_lora"):
        group.update_lora("policy")
    addresses = group.prepare_lora(INFO, PEFT)
    seeds = shard_seeds(group)
    assert addresses == [[f"ipc:///tmp/fake-lora-{s}.sock"] for s in seeds]
    assert len(set(seeds)) == 2  # one engine (and one socket) per shard
    with pytest.raises(BadArgumentError, match=r"adapter name.*'bad name'"):
        group.update_lora("bad name")
    # a bound the shards refuse: typed, naming both shards; nothing landed anywhere
    with pytest.raises(BadArgumentError, match=r"shard 0: .*timeout_s.*shard 1: "):
        collected(group, group.update_lora("policy", timeout_s=-1))
    # the transport goes to every shard (none joined a weight-update group here)
    with pytest.raises(EngineStateError, match=r"shard 0: .*needs init_collective.*shard 1"):
        collected(group, group.update_lora("policy", transport="collective"))
    with pytest.raises(BadBatchError, match="no adapter 'policy' is served"):
        group.generate(batch(lora="policy"))
    out = group.generate(batch(), greedy=True)
    assert set(out["weight_versions"].flatten().tolist()) <= {-1, 0}


def test_rows_run_under_their_own_adapters_and_come_back_in_order(
    group: GenerationGroup, trainer: Path, reference: VllmGenerationWorker
) -> None:
    group.prepare_lora(INFO, PEFT)
    for name, payload in (("a", "a-1"), ("b", "b-1")):
        send(trainer, name, payload)
        assert collected(group, group.update_lora(name)) == [True, True]
        assert reference.update_lora(name) is True
    names = ["a", None, "b", "a", None, "b", "b", "a"]
    before = prompt_tokens(group)
    out = group.generate(batch(lora_names=names), greedy=True)
    plan = group.last_shard_plan
    assert plan is not None
    assert all(plan.sizes), plan.shards  # the rows (and their names) went to both shards
    want = reference.generate(batch(lora_names=names), greedy=True)
    assert set(out) == set(want)
    for key in sorted(want):
        assert torch.equal(out[key], want[key]), key
    # each row's adapter mattered: the base model and the other adapter sample otherwise
    base = reference.generate(batch(), greedy=True)["output_ids"]
    other = reference.generate(
        batch(lora_names=["b" if n == "a" else "a" for n in names]), greedy=True
    )["output_ids"]
    for row, adapter in enumerate(names):
        assert torch.equal(out["output_ids"][row], base[row]) == (adapter is None), row
        assert not torch.equal(out["output_ids"][row], other[row]) or adapter is None, row
    assert sum(prompt_tokens(group)) - sum(before) == sum(len(p) for p in PROMPTS)
    # one adapter for the batch goes to every shard
    whole = group.generate(batch(lora="b"), greedy=True)
    want_b = reference.generate(batch(lora="b"), greedy=True)["output_ids"]
    assert torch.equal(whole["output_ids"], want_b)
    # text prompts take them too
    texts = group.generate_text({"prompts": ["abc", "de"], "lora_names": ["a", None]})
    assert texts == reference.generate_text({"prompts": ["abc", "de"], "lora_names": ["a", None]})


def test_a_bad_adapter_input_is_refused_in_the_driver_naming_it(group: GenerationGroup) -> None:
    before = prompt_tokens(group)
    cases: list[tuple[dict[str, object], str]] = [
        ({"lora_names": ["a", "nope", *[None] * 6]}, r"generate: lora_names: no adapter 'nope'"),
        ({"lora_names": ["a", None]}, r"lora_names must be a list of 8 names"),
        ({"lora_names": "a"}, r"lora_names must be a list of 8 names"),
        ({"lora": "a", "lora_names": ["a"] * 8}, r"not both"),
        ({"lora": "bad name"}, r"lora: no adapter 'bad name'"),
    ]
    for extra, match in cases:
        with pytest.raises(BadBatchError, match=match):
            group.generate(batch(**extra))
    with pytest.raises(BadBatchError, match="generate_text: lora_names"):
        group.generate_text({"prompts": ["abc"], "lora_names": ["nope"]})
    assert prompt_tokens(group) == before  # no shard saw any of them


def test_a_refit_that_fails_on_one_shard_is_typed_and_one_version_names_one_adapter(
    group: GenerationGroup, trainer: Path, reference: VllmGenerationWorker
) -> None:
    group.prepare_lora(INFO, PEFT)
    send(trainer, "policy", "p-1")
    assert collected(group, group.update_lora("policy")) == [True, True]
    start = int(group.generate(batch(lora="policy"))["weight_versions"].max())

    failing = trainer / f"fail-{shard_seeds(group)[1]}"
    failing.touch()
    send(trainer, "policy", "p-2")
    with pytest.raises(RefitError, match=r"shard 1: .*'policy': the trainer's sender") as info:
        collected(group, group.update_lora("policy"))
    cause = info.value.__cause__
    assert isinstance(cause, ShardFailure)
    assert (sorted(cause.errors), cause.results) == ([1], {0: True})
    # usable: shard 0 serves p-2 (the next version), shard 1 still p-1 (its version)
    out = group.generate(batch(lora="policy"), greedy=True)
    plan = group.last_shard_plan
    assert plan is not None
    for shard, version in ((0, start + 1), (1, start)):
        for row in plan.shards[shard]:
            generated = out["weight_versions"][row][out["weight_versions"][row] >= 0]
            assert generated.tolist() == [version] * len(generated), (shard, row)

    # an adapter new to the group that lands on shard 0 only is not served by the group
    send(trainer, "fresh", "f-1")
    with pytest.raises(RefitError, match="shard 1"):
        collected(group, group.update_lora("fresh"))
    with pytest.raises(BadBatchError, match="no adapter 'fresh' is served"):
        group.generate(batch(lora="fresh"))

    # the next refit lands everywhere: every row under it has one version again, and the
    # tokens of a worker that took the same adapters
    failing.unlink()
    send(trainer, "policy", "p-3")
    assert collected(group, group.update_lora("policy")) == [True, True]
    out = group.generate(batch(lora="policy"), greedy=True)
    generated = out["weight_versions"][out["weight_versions"] >= 0]
    assert set(generated.tolist()) == {start + 3}
    assert reference.update_lora("policy") is True  # p-3
    want = reference.generate(batch(lora="policy"), greedy=True)
    assert torch.equal(out["output_ids"], want["output_ids"])
    assert group.is_alive()

    # shard 1 lags two refits behind the group's count: a generate that fails on shard 0
    # gives shard 1's rows in the failure under the group's versions, as a good one would
    bad = right_padded([[5, 999, 7], [6, 8, 9]])
    with pytest.raises(BadBatchError, match=r"^shard 0: .*row 0 position 1 \(id 999\)") as refused:
        group.generate({**bad, "lora": "policy"})
    plan = group.last_shard_plan
    assert plan is not None
    assert plan.shards == ((0,), (1,)), plan.shards
    failure_ = refused.value.__cause__
    assert isinstance(failure_, ShardFailure)
    assert sorted(failure_.errors) == [0]
    kept = failure_.results[1]
    assert isinstance(kept, dict)
    versions = kept["weight_versions"]
    assert set(versions[versions >= 0].tolist()) == {start + 3}
    # a shard's error names its own rows: which of the batch's they are follows
    flipped = right_padded([[6, 8, 9], [5, 999, 7]])
    with pytest.raises(BadBatchError, match=r"^shard 1 \(its row 0 is the batch's row 1\): "):
        group.generate(flipped)


def test_a_prepare_lora_refused_by_one_shard_refuses_updates_until_one_succeeds(
    group: GenerationGroup, trainer: Path
) -> None:
    refusing = trainer / f"refuse-{shard_seeds(group)[0]}"
    refusing.touch()
    with pytest.raises(RefitManifestError, match=r"shard 0: .*not a module here") as info:
        group.prepare_lora(INFO, PEFT)
    assert isinstance(info.value.__cause__, ShardFailure)
    with pytest.raises(EngineStateError, match="needs a prepare_lora"):
        group.update_lora("policy")
    refusing.unlink()
    group.prepare_lora(INFO, PEFT)
    send(trainer, "policy", "p-4")
    assert collected(group, group.update_lora("policy")) == [True, True]


def test_async_shards_refit_in_flight_and_stream_rows_under_the_groups_versions(
    ray_session: None, tmp_path: Path
) -> None:
    config = async_config(max_new_tokens=8, vllm_cfg={"max_model_len": MAX_MODEL_LEN})
    with GenerationGroup(
        config,
        ClusterSpec(num_shards=2, cpus_per_node=2, start_timeout_s=120, call_timeout_s=60),
        worker_options={"engine_factory": AsyncAdapterFakes(tmp_path)},
    ) as group:
        group.prepare_lora(INFO, PEFT)
        assert collected(group, group.update_lora("policy", mode="wait")) == [True, True]
        (tmp_path / f"fail-{shard_seeds(group)[1]}").touch()
        with pytest.raises(RefitError, match="shard 1: "):
            collected(group, group.update_lora("policy", mode="keep", clear_cache=False))
        (tmp_path / f"fail-{shard_seeds(group)[1]}").unlink()
        assert collected(group, group.update_lora("policy", mode="keep")) == [True, True]

        data = batch(lora="policy")
        rows = outputs(asyncio.run(collect(group.generate_async(data, greedy=True))))
        assert sorted(rows) == list(range(len(PROMPTS)))
        for row, out in rows.items():
            assert out["output_ids"][0, : len(PROMPTS[row])].tolist() == PROMPTS[row]
            generated = out["weight_versions"][out["weight_versions"] >= 0]
            assert set(generated.tolist()) == {3}, row  # shard 1 counts 2 refits of 3
        whole = group.generate(data, greedy=True)["weight_versions"]
        assert set(whole[whole >= 0].tolist()) == {3}
        plan = group.last_shard_plan
        assert plan is not None
        assert all(plan.sizes), plan.shards  # both shards' rows were relabelled
