"""The worker against the fake engine: contract, bad inputs, lifecycle, refit moves."""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch
from helpers import PAD, base_config
from helpers import right_padded as batch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core import lifecycle
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineContractError,
    EngineDeadError,
    EngineStateError,
    GenworkerError,
    RefitError,
    UnsupportedError,
)
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.spine import wake_event
from genworker.shell.worker import VllmGenerationWorker


def make_worker(**kw: Any) -> tuple[VllmGenerationWorker, FakeEngine]:
    engine_opts = kw.pop("engine", {})
    factory = FakeEngineFactory(max_model_len=32, **engine_opts)
    worker = VllmGenerationWorker(kw.pop("config", base_config()), engine_factory=factory, **kw)
    engine = factory.started[-1][1]
    return worker, engine


def _refused(worker: VllmGenerationWorker) -> tuple[int, ...]:
    return worker.last_refused_rows


@pytest.fixture
def worker_engine() -> Iterator[tuple[VllmGenerationWorker, FakeEngine]]:
    worker, engine = make_worker()
    yield worker, engine
    worker.shutdown()


def test_generate_returns_the_contract(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, engine = worker_engine
    data = batch([[5, 6, 7], [8], [9, 10]], width=5)
    out = worker.generate(data, greedy=True)
    gens = engine.requests
    assert out["output_ids"].shape[0] == 3
    for i, (prompt, _) in enumerate(gens):
        length = len(prompt)
        g = int(out["generation_lengths"][i])
        assert out["output_ids"][i, :length].tolist() == prompt
        assert int(out["unpadded_sequence_lengths"][i]) == length + g
        assert (out["output_ids"][i, length + g :] == PAD).all()
        assert (out["logprobs"][i, :length] == 0).all()
    assert out["output_ids"].shape[1] == 5 + int(out["generation_lengths"].max())
    assert all(spec.temperature == 0.0 and spec.top_k == 1 for _, spec in gens)


def test_generate_is_deterministic_per_row(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, _ = worker_engine
    alone = worker.generate(batch([[3, 4]]), greedy=True)
    together = worker.generate(batch([[9, 9, 9, 9], [3, 4]]), greedy=True)
    g = int(alone["generation_lengths"][0])
    assert together["output_ids"][1, : 2 + g].tolist() == alone["output_ids"][0, : 2 + g].tolist()


def test_per_sample_stop_strings_stop_only_their_own_row() -> None:
    worker, engine = make_worker()
    worker.generate({**batch([[1, 2], [1, 2]]), "stop_strings": [["zz"], None]}, greedy=False)
    (_, first), (_, second) = engine.requests
    assert first.stop == ("zz",)
    assert second.stop == ()


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({}, "input_ids"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long)}, "input_lengths"),
        ({"input_ids": [[1, 2]], "input_lengths": torch.tensor([2])}, "input_ids"),
        ({**batch([[1, 2]]), "input_lengths": torch.tensor([0])}, "0"),
        ({**batch([[1, 2]]), "input_lengths": torch.tensor([3])}, "3"),
        ({"input_ids": torch.tensor([[PAD, 4, 5]]), "input_lengths": torch.tensor([2])}, "pad"),
        ({**batch([[1, 64]])}, "64"),
        ({**batch([list(range(1, 33))])}, "32"),
        ({**batch([[1, 2]]), "stop_strings": [[""]]}, "stop"),
        ({**batch([[1, 2]]), "stop_strings": ["ab"]}, "stop"),
    ],
)
def test_bad_batches_are_typed_and_leave_the_worker_usable(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine], data: dict[str, Any], fragment: str
) -> None:
    worker, engine = worker_engine
    with pytest.raises(BadBatchError) as info:
        worker.generate(data)
    assert fragment.lower() in str(info.value).lower()
    assert "generate" not in engine.calls
    assert worker.generate(batch([[1, 2]]))["output_ids"].shape[0] == 1


def test_empty_batch_gives_empty_tensors_without_calling_the_engine(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, engine = worker_engine
    out = worker.generate(
        {
            "input_ids": torch.zeros((0, 0), dtype=torch.long),
            "input_lengths": torch.zeros(0, dtype=torch.long),
        }
    )
    assert out["output_ids"].shape == (0, 0)
    assert out["logprobs"].shape == (0, 0)
    assert out["truncated"].shape == (0,)
    assert "generate" not in engine.calls


def test_greedy_must_be_a_bool(worker_engine: tuple[VllmGenerationWorker, FakeEngine]) -> None:
    worker, _ = worker_engine
    with pytest.raises(BadArgumentError, match="greedy"):
        worker.generate(batch([[1]]), greedy="yes")  # type: ignore[arg-type]


def test_context_cap_and_spec_decode_clamp_reach_the_engine() -> None:
    cfg = base_config(max_new_tokens=30)
    cfg["vllm_cfg"] = {**cfg["vllm_cfg"], "cap_max_tokens_to_context": True}
    worker, engine = make_worker(config=cfg)
    worker.generate(batch([[1] * 10, [2] * 28]))
    assert [spec.max_tokens for _, spec in engine.requests] == [22, 4]
    cfg["vllm_cfg"] = {**cfg["vllm_cfg"], "speculative_config": {"num_speculative_tokens": 3}}
    worker, engine = make_worker(config=cfg)
    worker.generate(batch([[1] * 10]))
    assert [spec.max_tokens for _, spec in engine.requests] == [18]


def test_a_row_without_room_is_refused_alone_and_comes_back_unchanged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = base_config(
        max_new_tokens=30, vllm_cfg={"speculative_config": {"num_speculative_tokens": 3}}
    )
    # The worker's own logger at WARNING: an earlier test may leave the root logger higher.
    caplog.set_level(logging.WARNING, logger="genworker.shell.worker")
    worker, engine = make_worker(config=cfg)
    alone = worker.generate(batch([[5, 6]]), greedy=True)
    assert not worker.last_refused_rows
    data = batch([[2] * 28, [5, 6], [3] * 29])
    out = worker.generate(data, greedy=True)
    # Rows 0 and 2 leave fewer than k + 1 = 4 slots: only row 1 reaches the engine.
    assert [prompt for prompt, _ in engine.requests[1:]] == [[5, 6]]
    assert _refused(worker) == (0, 2)
    assert "row" in caplog.text
    assert "28" in caplog.text
    assert out["generation_lengths"].tolist()[0::2] == [0, 0]
    assert out["unpadded_sequence_lengths"].tolist()[0::2] == [28, 29]
    assert out["truncated"].tolist()[0::2] == [False, False]
    width = out["output_ids"].shape[1]
    for row, length in ((0, 28), (2, 29)):
        assert torch.equal(out["output_ids"][row, :length], data["input_ids"][row, :length])
        assert (out["output_ids"][row, length:] == PAD).all()
        assert (out["logprobs"][row] == 0).all()
    g = int(alone["generation_lengths"][0])
    assert out["output_ids"][1, : 2 + g].tolist() == alone["output_ids"][0, : 2 + g].tolist()
    assert width == 29 + int(out["generation_lengths"][1])
    # Every row refused: nothing reaches the engine, the batch still comes back.
    calls = engine.calls.count("generate")
    out = worker.generate(batch([[2] * 29]))
    assert engine.calls.count("generate") == calls
    assert out["generation_lengths"].tolist() == [0]
    assert _refused(worker) == (0,)


def test_the_engines_inferred_draft_count_drives_the_clamp() -> None:
    """A speculative_config without num_speculative_tokens: vLLM infers k from the drafter,
    and the worker clamps with the engine's k."""
    cfg = base_config(max_new_tokens=30, vllm_cfg={"speculative_config": {"method": "mtp"}})
    factory = FakeEngineFactory(max_model_len=32, draft_tokens=2)
    worker = VllmGenerationWorker(cfg, engine_factory=factory)
    engine = factory.started[-1][1]
    assert factory.started[-1][0]["speculative_config"] == {"method": "mtp"}
    worker.generate(batch([[1] * 10]))
    assert [spec.max_tokens for _, spec in engine.requests] == [32 - 10 - 3]
    with pytest.raises(BadConfigError, match="num_speculative_tokens"):
        VllmGenerationWorker(cfg, engine_factory=FakeEngineFactory(max_model_len=32))


def test_generate_text_caps_each_row_by_its_token_count() -> None:
    cfg = base_config(
        max_new_tokens=30, vllm_cfg={"speculative_config": {"num_speculative_tokens": 3}}
    )
    worker, engine = make_worker(config=cfg)
    prompts = ["abcdefghij", "a" * 28, "abc"]
    out = worker.generate_text({"prompts": prompts}, greedy=True)
    # The fake tokenizes one token per letter: 10 and 3 tokens; 28 leaves no room.
    assert [spec.max_tokens for _, spec in engine.requests] == [32 - 10 - 4, 32 - 3 - 4]
    assert [len(prompt) for prompt, _ in engine.requests] == [10, 3]
    assert _refused(worker) == (1,)
    assert out["texts"][1] == ""
    assert len(out["texts"]) == 3
    assert "generate_text" in engine.calls


@pytest.mark.parametrize("cap", [False, True])
def test_generate_text_refuses_a_prompt_that_leaves_no_room_before_the_engine(cap: bool) -> None:
    """A prompt of max_model_len tokens or more is refused naming the row and its length
    before anything is submitted (vLLM would refuse it inside the batch), with or without
    the context cap, as ``generate`` refuses such a row; one token shorter generates."""
    worker, engine = make_worker(
        config=base_config(max_new_tokens=8, vllm_cfg={"cap_max_tokens_to_context": cap})
    )
    for length in (32, 33):
        with pytest.raises(BadBatchError, match=rf"prompts \[1\] leave no room.*\[{length}\]"):
            worker.generate_text({"prompts": ["abc", "a" * length]})
        assert "generate_text" not in engine.calls
    out = worker.generate_text({"prompts": ["a" * 31]})
    assert [len(prompt) for prompt, _ in engine.requests] == [31]
    assert len(out["texts"][0]) == 1


def test_nemo_rl_media_side_channels_are_checked_and_text_rows_pass(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, engine = worker_engine
    data = batch([[1, 2], [3]])
    with pytest.raises(BadBatchError, match=r"vllm_images\[1\]\[0\] must be a PIL image"):
        worker.generate({**data, "vllm_images": [[], ["<image>"]]})
    with pytest.raises(BadBatchError, match="vllm_videos"):
        worker.generate({**data, "vllm_videos": torch.zeros(2)})
    assert "generate" not in engine.calls
    out = worker.generate({**data, "vllm_images": [[], []], "vllm_audios": None})
    assert out["output_ids"].shape[0] == 2


def test_engine_returning_past_the_context_is_a_contract_error(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, engine = worker_engine
    original = engine.generate

    def overlong(batch: Any, **options: Any) -> Any:
        gens = original(batch, **options)
        from genworker.core.assembly import Generation, flatten_generations

        return flatten_generations(
            [
                Generation(token_ids=[2] * 40, logprobs=[-1.0] * 40, finish_reason="length")
                for _ in range(gens.batch_size)
            ]
        )

    monkeypatch.setattr(engine, "generate", overlong)
    with pytest.raises(EngineContractError, match="max_model_len"):
        worker.generate(batch([[1, 2]]))


def test_bad_config_names_every_problem() -> None:
    cfg = base_config(temperature=-1.0, top_p=2.0)
    with pytest.raises(BadConfigError) as info:
        make_worker(config=cfg)
    assert "temperature" in str(info.value)
    assert "top_p" in str(info.value)


def test_sleep_wake_follow_the_lifecycle(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, engine = worker_engine
    worker.sleep(level=2)
    assert engine.prefix_cache_resets == 1
    with pytest.raises(EngineStateError, match=r"(?i)asleep|wake"):
        worker.generate(batch([[1]]))
    worker.wake_up()
    with pytest.raises(EngineStateError, match=r"(?i)refit|discard"):
        worker.generate(batch([[1]]))
    assert "generate" not in engine.calls


def test_wake_up_rejects_bad_tags(worker_engine: tuple[VllmGenerationWorker, FakeEngine]) -> None:
    worker, _ = worker_engine
    for tags in ("weights", ["weights", "gpu"], [], [1]):
        with pytest.raises(BadArgumentError, match="tags"):
            worker.wake_up(tags)  # type: ignore[arg-type]
    with pytest.raises(BadArgumentError, match="level"):
        worker.sleep(level=3)


_TAG_EVENTS = {
    frozenset({"weights"}): lifecycle.Event.WAKE_WEIGHTS,
    frozenset({"kv_cache"}): lifecycle.Event.WAKE_KV_CACHE,
    frozenset({"weights", "kv_cache"}): lifecycle.Event.WAKE_ALL,
}


@given(
    tags=st.none()
    | st.text(max_size=8)
    | st.lists(st.sampled_from(["weights", "kv_cache", "gpu", ""]) | st.integers(), max_size=4)
)
def test_wake_event_is_the_tags_event_for_every_non_empty_subset_and_refuses_the_rest(
    tags: object,
) -> None:
    """Both workers' ``wake_up`` (``shell.spine.wake_event``): None wakes all; a list of
    the two tag names (repeats allowed) wakes those; anything else is refused naming it."""
    wanted = (
        frozenset({"weights", "kv_cache"})
        if tags is None
        else frozenset(tags)
        if isinstance(tags, list) and all(isinstance(t, str) for t in tags)
        else None
    )
    if wanted in _TAG_EVENTS:
        assert wake_event(tags) == _TAG_EVENTS[wanted]  # type: ignore[arg-type]
    else:
        with pytest.raises(BadArgumentError, match=re.escape(repr(tags))):
            wake_event(tags)  # type: ignore[arg-type]


def test_sleep_on_a_platform_without_sleep_mode_is_unsupported() -> None:
    worker, engine = make_worker(engine={"sleep_mode": False})
    with pytest.raises(UnsupportedError, match="sleep"):
        worker.sleep()
    assert worker.generate(batch([[1, 2]]))["output_ids"].shape[0] == 1
    assert engine.calls.count("sleep(1)") == 0


def test_refit_failure_makes_weights_inconsistent_until_a_good_refit(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, engine = worker_engine
    before = worker.generate(batch([[4, 5]]), greedy=True)

    def failing(timeout_s: float) -> None:
        raise TimeoutError(f"no bucket within {timeout_s} s")

    engine.rpc_handlers["update_weights_from_collective"] = failing
    engine.rpc_handlers["init_collective"] = lambda *args: {"rank": 1}
    with pytest.raises(EngineStateError, match="init_collective first"):
        worker.update_weights_from_collective(timeout_s=1.0)  # refused: nothing changes
    with pytest.raises(EngineStateError, match="prepare_refit_info first"):
        worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    worker.generate(batch([[4, 5]]), greedy=True)
    worker.prepare_refit_info({"w": ((2,), "float32")})
    worker.init_collective(0, "127.0.0.1", 29500, 2, 1)
    with pytest.raises(RefitError, match="inconsistent"):
        worker.update_weights_from_collective(timeout_s=1.0)
    with pytest.raises(EngineStateError, match=r"(?i)refit"):
        worker.generate(batch([[4, 5]]))

    def succeeding(timeout_s: float) -> None:
        engine.load_new_weights()

    engine.rpc_handlers["update_weights_from_collective"] = succeeding
    resets = engine.prefix_cache_resets
    assert worker.update_weights_from_collective(timeout_s=1.0) is True
    assert engine.prefix_cache_resets == resets + 1
    after = worker.generate(batch([[4, 5]]), greedy=True)
    assert not torch.equal(before["output_ids"], after["output_ids"])


def test_weight_versions_count_good_refits_and_sit_on_the_generated_tokens(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    """Failure mode R11: the sync worker's outputs carry its weight version, the async
    worker's layout: the version at each generated token, -1 on prompt and padding."""
    worker, engine = worker_engine
    rows = [[4, 5], [6], [7, 8, 9]]

    def versions(expected: int) -> None:
        data = batch(rows)
        out = worker.generate(data)
        lengths, generated = data["input_lengths"], out["generation_lengths"]
        assert isinstance(lengths, torch.Tensor)
        assert out["weight_versions"].dtype == torch.int64
        assert out["weight_versions"].shape == out["output_ids"].shape
        for i, row in enumerate(out["weight_versions"].tolist()):
            n, g = int(lengths[i]), int(generated[i])
            assert row[n : n + g] == [expected] * g
            assert set(row[:n] + row[n + g :]) <= {-1}
        assert worker.weight_version == expected

    versions(0)
    worker.prepare_refit_info({"w": ((2,), "float32")})
    engine.rpc_handlers["update_weights_via_ipc_zmq"] = lambda timeout_s: engine.load_new_weights()
    worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    versions(2)

    def failing(timeout_s: float) -> None:
        raise TimeoutError("no chunk")

    engine.rpc_handlers["update_weights_via_ipc_zmq"] = failing
    with pytest.raises(RefitError):
        worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    assert worker.weight_version == 2  # a failed refit leaves the count alone
    engine.rpc_handlers["update_weights_via_ipc_zmq"] = lambda timeout_s: engine.load_new_weights()
    worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    versions(3)
    empty = worker.generate(
        {
            "input_ids": torch.zeros((0, 0), dtype=torch.long),
            "input_lengths": torch.zeros(0, dtype=torch.long),
        }
    )
    assert tuple(empty["weight_versions"].shape) == (0, 0)


def test_caches_known_empty_are_not_reset_again(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    """A refit or a sleep resets the caches only when a request may have filled them
    since the last reset: through the worker, or past it (the engine's request count)."""
    worker, engine = worker_engine
    engine.rpc_handlers["update_weights_via_ipc_zmq"] = lambda timeout_s: engine.load_new_weights()
    worker.prepare_refit_info({"w": ((2,), "float32")})
    counter = SimpleNamespace(counter=0)  # as vllm.LLM's request_counter
    engine.request_counter = counter  # type: ignore[attr-defined]
    worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    assert engine.prefix_cache_resets == 1  # a fresh worker resets once
    worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    worker.sleep(level=2)
    worker.wake_up(["weights"])
    worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    assert engine.prefix_cache_resets == 1
    assert "reset_prefix_cache_seconds" not in worker.last_refit
    worker.wake_up(["kv_cache"])
    worker.generate(batch([[4, 5]]))
    worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    assert engine.prefix_cache_resets == 2
    counter.counter += 1  # a request run on worker.llm itself
    worker.sleep(level=1)
    assert engine.prefix_cache_resets == 3
    worker.wake_up()
    worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    assert engine.prefix_cache_resets == 3


@pytest.mark.parametrize("timeout", [0, -5.0, float("nan"), float("inf"), "60", True])
def test_a_bad_refit_timeout_is_refused_before_the_refit_starts(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine], timeout: object
) -> None:
    worker, engine = worker_engine
    with pytest.raises(BadArgumentError, match="timeout_s"):
        worker.update_weights_from_collective(timeout_s=timeout)  # type: ignore[arg-type]
    assert worker.state == lifecycle.AWAKE
    assert not any(c.startswith("rpc:") for c in engine.calls)


def test_level2_refit_sequence_serves_new_weights(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, engine = worker_engine
    engine.rpc_handlers["update_weights_via_ipc_zmq"] = lambda timeout_s: engine.load_new_weights()
    worker.prepare_refit_info({"w": ((2,), "float32")})
    worker.sleep(level=2)
    with pytest.raises(EngineStateError):
        worker.update_weights_via_ipc_zmq()
    worker.wake_up(["weights"])
    assert worker.update_weights_via_ipc_zmq()
    worker.wake_up(["kv_cache"])
    assert worker.generate(batch([[1, 2]]))["output_ids"].shape[0] == 1


def test_dead_engine_marks_the_worker_unusable(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, engine = worker_engine
    engine.fail_next = EngineDeadError("engine core died")
    with pytest.raises(EngineDeadError):
        worker.generate(batch([[1]]))
    assert not worker.is_alive()
    with pytest.raises(EngineDeadError, match="re-create"):
        worker.generate(batch([[1]]))
    assert worker.shutdown() is True


def test_request_error_from_the_engine_keeps_the_worker(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, engine = worker_engine
    engine.fail_next = BadBatchError("rejected by the engine")
    with pytest.raises(BadBatchError):
        worker.generate(batch([[1]]))
    assert worker.is_alive()
    assert worker.generate(batch([[1]]))["output_ids"].shape[0] == 1


def test_shutdown_is_idempotent_and_final(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, engine = worker_engine
    assert worker.shutdown()
    assert worker.shutdown()
    assert engine.shut_down
    with pytest.raises(GenworkerError):
        worker.generate(batch([[1]]))
    assert not worker.is_alive()
    assert "alive=False" in repr(worker)


def test_deferred_load(monkeypatch: pytest.MonkeyPatch) -> None:
    factory = FakeEngineFactory()
    worker = VllmGenerationWorker(base_config(), defer_model_load=True, engine_factory=factory)
    assert not factory.started
    with pytest.raises(EngineStateError):
        worker.generate(batch([[1]]))
    worker.load_model()
    kwargs, _ = factory.started[0]
    assert kwargs["worker_extension_cls"] == "genworker.shell.extension.WorkerExtension"
    assert kwargs["model"] == "fake-model"
    with pytest.raises(EngineStateError):
        worker.load_model()


def test_counters_show_token_totals(worker_engine: tuple[VllmGenerationWorker, FakeEngine]) -> None:
    worker, _ = worker_engine
    out = worker.generate(batch([[1, 2, 3], [4]]))
    counters = worker.get_counters()
    prompt = [v for k, v in counters.items() if k.startswith("vllm:prompt_tokens")]
    gen = [v for k, v in counters.items() if k.startswith("vllm:generation_tokens")]
    assert prompt == [4.0]
    assert gen == [float(out["generation_lengths"].sum())]


def test_configure_worker_matches_nemo_rl_shape() -> None:
    resources, env, init_kwargs, runtime_env = VllmGenerationWorker.configure_worker(
        2, (1, [2, 3]), 8, cache_root="/cache/vllm"
    )
    assert resources["num_gpus"] == 0
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CACHE_ROOT"] == "/cache/vllm_1025"
    assert init_kwargs["seed"] == 1 * 1024 + 1
    assert runtime_env == {}
    with pytest.raises(BadConfigError, match="num_gpus_per_node"):
        VllmGenerationWorker.configure_worker(1, (0, [0]), 0)


def test_config_is_not_mutated() -> None:
    cfg = base_config()
    snapshot = copy.deepcopy(cfg)
    worker, _ = make_worker(config=cfg)
    worker.generate(batch([[1]]))
    assert cfg == snapshot


def test_lifecycle_state_is_exposed(worker_engine: tuple[VllmGenerationWorker, FakeEngine]) -> None:
    worker, _ = worker_engine
    assert worker.state == lifecycle.AWAKE
    assert isinstance(lifecycle.check_can_generate(worker.state), Success)
    worker.sleep(level=1)
    assert worker.state == lifecycle.ASLEEP_L1
    assert isinstance(lifecycle.check_can_generate(worker.state), Failure)
    worker.wake_up(["weights"])
    assert worker.state.weights_awake
    assert not worker.state.kv_cache_awake
    worker.shutdown()
    assert worker.state == lifecycle.SHUT_DOWN


def test_waking_after_a_partial_wake_names_only_the_asleep_tag(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    """The fake drops a wake_up(tags) naming an awake tag, as vLLM does; the worker must
    pass only the asleep ones, or the KV cache would stay asleep."""
    worker, engine = worker_engine
    worker.sleep(level=1)
    worker.wake_up(["weights"])
    worker.wake_up()
    assert engine.calls[-2:] == ["wake_up(['weights'])", "wake_up(['kv_cache'])"]
    assert engine.awake_tags == {"weights", "kv_cache"}
    assert worker.generate(batch([[1, 2]]))["output_ids"].shape[0] == 1


def test_the_fake_engine_follows_vllms_sleep_and_wake_rules() -> None:
    engine = FakeEngine()
    engine.wake_up(["weights"])  # nothing sleeps: a no-op
    assert engine.awake_tags == {"weights", "kv_cache"}
    engine.sleep(1)
    engine.sleep(2)  # the weights already sleep: vLLM returns early, level 1 stays
    assert engine.sleep_level == 1
    engine.wake_up(["weights"])
    engine.wake_up(["weights", "kv_cache"])  # names an awake tag: the whole call is dropped
    assert engine.awake_tags == {"weights"}
    engine.wake_up(["kv_cache"])
    assert engine.awake_tags == {"weights", "kv_cache"}
    engine.sleep(2)
    assert (engine.weights_discarded, engine.awake_tags) == (True, set())


def test_a_failed_prefix_cache_reset_after_a_refit_leaves_the_weights_inconsistent(
    worker_engine: tuple[VllmGenerationWorker, FakeEngine],
) -> None:
    worker, engine = worker_engine

    def refit_then_busy_cache(timeout_s: float) -> None:
        engine.load_new_weights()
        engine.fail_next = EngineStateError("reset_prefix_cache: vLLM kept the cache")

    engine.rpc_handlers["update_weights_via_ipc_zmq"] = refit_then_busy_cache
    worker.prepare_refit_info({"w": ((2,), "float32")})
    with pytest.raises(RefitError, match="prefix cache") as info:
        worker.update_weights_via_ipc_zmq(timeout_s=1.0)
    assert isinstance(info.value.__cause__, EngineStateError)
    assert worker.state.weights is lifecycle.WeightsStatus.INCONSISTENT
    with pytest.raises(EngineStateError, match="refit again"):
        worker.generate(batch([[4, 5]]))
    engine.rpc_handlers["update_weights_via_ipc_zmq"] = lambda timeout_s: None
    assert worker.update_weights_via_ipc_zmq(timeout_s=1.0) is True
    assert worker.state == lifecycle.AWAKE
    assert worker.generate(batch([[4, 5]]))["output_ids"].shape[0] == 1


def test_tracing_plan_reaches_the_engine_and_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    cfg = base_config(telemetry={"enabled": True, "otlp_endpoint": "http://127.0.0.1:4318"})
    factory = FakeEngineFactory()
    VllmGenerationWorker(cfg, engine_factory=factory)
    kwargs, _ = factory.started[0]
    assert kwargs["otlp_traces_endpoint"] == "http://127.0.0.1:4318"
    assert type(kwargs) is dict
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" in os.environ


# -- a failed sleep or wake is fatal for the engine (S1/S2 in failure-modes.md) ------------

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


@pytest.mark.parametrize("call", ["sleep", "wake_up"])
def test_a_failed_sleep_or_wake_is_fatal_and_every_later_call_is_refused(call: str) -> None:
    """vLLM 0.32 leaves a sleep or wake that raised part-way (some allocations mapped,
    the scheduler paused; the fake leaves its KV cache asleep): the worker raises
    EngineDeadError with the engine's error as its cause, refuses every later call
    without touching the engine, and still shuts down."""
    worker, engine = make_worker()
    if call == "wake_up":
        worker.sleep(level=1)
    engine.fail_call, engine.fail_next = call, RuntimeError(CUDA_OOM)
    with pytest.raises(EngineDeadError, match="out of memory") as info:
        worker.sleep(level=1) if call == "sleep" else worker.wake_up()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert engine.calls[-1].startswith(call), "the engine's own call failed"
    assert not worker.is_alive()
    seen = list(engine.calls)
    later: list[Any] = [
        lambda: worker.generate(batch([[1, 2]])),
        lambda: worker.generate_text({"prompts": ["ab"]}),
        lambda: worker.sleep(level=2),
        lambda: worker.wake_up(),
        lambda: worker.reset_prefix_cache(),
        lambda: worker.get_counters(),
        lambda: worker.report_device_id(),
    ]
    for refused in later:
        with pytest.raises(EngineDeadError, match="re-create the worker"):
            refused()
    assert engine.calls == seen, "no later call reached the engine"
    assert "generate" not in engine.calls
    assert worker.shutdown() is True
    assert engine.shut_down
    assert worker.state == lifecycle.SHUT_DOWN


def test_an_interrupted_sleep_propagates_as_itself_and_the_engine_is_dead() -> None:
    worker, engine = make_worker()
    engine.fail_call, engine.fail_next = "sleep", KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        worker.sleep(level=1)
    assert not worker.is_alive()
    with pytest.raises(EngineDeadError, match="re-create the worker"):
        worker.generate(batch([[1, 2]]))
    assert "generate" not in engine.calls


def test_a_wake_after_which_the_engine_is_not_fully_awake_is_fatal() -> None:
    """vLLM resumes its scheduler only once every tag is resident (``EngineCore.wake_up``,
    0.32, returns whether it is): a wake the worker counts as complete and the engine does
    not would leave every later generate waiting. Here the KV cache was woken behind the
    worker's back, so its wake_up() names it and the engine drops the call (vllm#31618)."""
    worker, engine = make_worker()
    worker.sleep(level=1)
    engine.wake_up(["kv_cache"])  # behind the worker's back (on worker.llm)
    with pytest.raises(EngineDeadError, match="not fully awake"):
        worker.wake_up()
    assert engine.awake_tags == {"kv_cache"}
    assert not worker.is_alive()
    with pytest.raises(EngineDeadError, match="re-create the worker"):
        worker.generate(batch([[1, 2]]))
    assert "generate" not in engine.calls
    assert worker.shutdown() is True


@pytest.mark.parametrize(
    "refusal",
    [
        UnsupportedError("sleep: sleep mode is unavailable"),
        EngineStateError("sleep: not now"),
        BadArgumentError("sleep: level"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_refusals_before_the_engine_slept_are_not_fatal(refusal: GenworkerError) -> None:
    """The worker's own refusals (bad level or tags, a state that cannot sleep) and the
    engine's typed refusals (raised before it touched its memory) change nothing."""
    worker, engine = make_worker()
    with pytest.raises(BadArgumentError, match="level"):
        worker.sleep(level=3)
    with pytest.raises(BadArgumentError, match="tags"):
        worker.wake_up(["gpu"])
    worker.sleep(level=1)
    worker.wake_up(["kv_cache"])
    with pytest.raises(EngineStateError, match="call wake_up"):
        worker.sleep(level=1)  # only the KV cache is resident
    worker.wake_up(["weights"])
    engine.fail_call, engine.fail_next = "sleep", refusal
    with pytest.raises(type(refusal)):
        worker.sleep(level=1)
    assert worker.is_alive()
    assert worker.state == lifecycle.AWAKE
    assert worker.generate(batch([[1, 2]]))["output_ids"].shape[0] == 1


def test_the_fake_refuses_a_text_batch_vllm_would_answer_wrongly() -> None:
    """vLLM returns empty texts for a spec without ``detokenize``, and the adapter reads one
    completion per prompt: the fake refuses both rather than answer."""
    from helpers import batch as engine_batch

    from genworker.core.sampling import SamplingSpec
    from genworker.shell.fake_engine import FakeEngineMisuse

    engine = FakeEngine(max_model_len=32)
    text = SamplingSpec(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=2, detokenize=True)
    assert len(engine.generate_text(engine_batch([[5, 6]], [text]))) == 1
    with pytest.raises(FakeEngineMisuse, match="have detokenize=False"):
        engine.generate_text(engine_batch([[5, 6]], [attrs.evolve(text, detokenize=False)]))
    with pytest.raises(FakeEngineMisuse, match="sample counts"):
        engine.generate_text(engine_batch([[5, 6]], [text], samples=[2]))
