"""The group's rules over its shards' calls (genworker.core.group_calls)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core.group_calls import (
    FAULTS,
    Fault,
    GroupCallError,
    GroupRefits,
    Refit,
    check_futures,
    check_in_flight,
    check_world_size,
    empty_outputs,
    failed_on,
    failed_to_start,
    fault_message,
    list_faults,
    merge_outputs,
    merge_texts,
    ray_reason,
    shard_lists,
    shard_mapping,
    shard_tensors,
    shard_texts,
    stream_pair,
    unusable,
)
from genworker.core.sharding import ShardPlan
from genworker.core.versions import NO_VERSION


def test_every_fault_has_a_line_that_names_its_shard() -> None:
    assert set(FAULTS) == set(Fault)
    for fault in Fault:
        assert fault_message(fault, "sleep", 3, detail="x").startswith("shard 3")


def test_each_fault_says_what_happened() -> None:
    assert fault_message(Fault.LATE, "sleep", 1, bound=2.5) == (
        "shard 1: sleep did not finish within 2.5 s (the actor may still be running it)"
    )
    assert fault_message(Fault.DIED, "generate", 0, detail="oom") == (
        "shard 0: the actor died during generate: oom"
    )
    assert fault_message(Fault.WORKER, "generate", 1, detail="bad row", rows=(4,)) == (
        "shard 1 (its row 0 is the batch's row 4): bad row"
    )
    assert fault_message(Fault.FOREIGN, "sleep", 2, detail="KeyError: 'a'") == (
        "shard 2: sleep raised KeyError: 'a'"
    )


@given(st.dictionaries(st.integers(0, 7), st.text(max_size=5), min_size=1), st.integers(8, 9))
def test_a_failure_lists_every_failed_shard_by_rank(lines: dict[int, str], shards: int) -> None:
    listed = list_faults(lines)
    assert listed == "; ".join(lines[r] for r in sorted(lines))
    assert failed_on("sleep", lines, shards) == (
        f"sleep failed on {len(lines)} of {shards} shard(s): {listed}"
    )


def test_start_problems_are_named_by_shard_and_none_means_started() -> None:
    assert failed_to_start({0: True, 1: True}, {}, 2, 1.0) is None
    assert failed_to_start({}, {1: "b", 0: "a"}, 2, 1.0) == (
        "2 of 2 engine(s) failed to start: shard 0: a; shard 1: b"
    )
    assert failed_to_start({0: False}, {1: None}, 2, 0.5) == (
        "2 of 2 engine(s) failed to start: shard 0: the worker reports its engine is not "
        "alive; shard 1: no answer within 0.5 s (engine still loading?)"
    )


def test_a_shut_down_or_broken_group_refuses_and_a_sound_one_runs() -> None:
    assert unusable("sleep", closed=False, dead={}) is None
    assert unusable("sleep", closed=True, dead={1: "x"}) == "sleep: the group was shut down"
    assert unusable("sleep", closed=False, dead={1: "gone", 0: "oom"}) == (
        "sleep: shard(s) [0, 1] died earlier (shard 0: oom; shard 1: gone); shut the group "
        "down and create a new one"
    )


@pytest.mark.parametrize(
    ("text", "init_failed", "want"),
    [
        ("", False, "RayActorError"),
        ("\x1b[31mone   line\x1b[0m", False, "one line"),
        ("first\n\n  middle\nlast  ", False, "first ... last"),
        (
            "Traceback\nTypeError: no_such_option",
            True,
            "the worker's __init__ raised TypeError: no_such_option",
        ),
    ],
)
def test_rays_account_comes_down_to_one_line(text: str, init_failed: bool, want: str) -> None:
    assert ray_reason(text, "RayActorError", init_failed=init_failed) == want


def test_a_world_size_must_be_the_trainers_ranks_and_the_engine_workers() -> None:
    assert check_world_size("init_collective", 6, 4, 2) == Success(None)
    failed = check_world_size("init_collective", 5, 4, 2)
    assert failed == Failure(
        GroupCallError(
            "init_collective: world_size=5 but the trainer's 4 rank(s) and this group's 2 "
            "engine worker(s) make 6",
            call="init_collective",
        )
    )
    reshard = check_world_size("init_nccl_reshard_comm_group", 3, 2, 2)
    assert reshard.failure().message == (
        "init_nccl_reshard_comm_group: sub_world_size=3 but 2 trainer rank(s) per stage and "
        "this group's 2 engine worker(s) make 4"
    )


def test_in_flight_options_are_for_async_shards_only() -> None:
    assert check_in_flight("r", None, None, async_shards=False) == Success({})
    assert check_in_flight("r", "abort", None, async_shards=True) == Success({"mode": "abort"})
    refused = check_in_flight("r", None, True, async_shards=False)
    assert isinstance(refused, Failure)
    assert "['clear_cache'] apply to in-flight refits of async shards" in str(refused.failure())


def test_answers_are_checked_before_they_join() -> None:
    assert shard_lists("c", [[1], (2,)]) == Failure(
        GroupCallError("c returned tuple, not a list", call="c")
    )
    assert shard_lists("c", [[1], [2, 3]]) == Success([[1], [2, 3]])
    ids = torch.ones(1)
    assert shard_tensors("generate", 0, {"ids": ids}) == Success({"ids": ids})
    assert isinstance(shard_tensors("generate", 1, {"ids": 1}), Failure)
    assert isinstance(shard_tensors("generate", 1, [ids]), Failure)
    assert shard_texts(0, {"texts": ["a"]}) == Success(["a"])
    assert isinstance(shard_texts(0, {"texts": [1]}), Failure)
    assert str(shard_texts(2, "x").failure()) == "shard 2: generate_text returned 'x'"


def test_a_stream_item_is_a_row_and_its_output() -> None:
    assert stream_pair(0, (2, "out")) == Success((2, "out"))
    for bad in [(2,), ("a", 1), [2, 1], 5]:
        assert isinstance(stream_pair(1, bad), Failure)
    assert str(stream_pair(1, 5).failure()) == (
        "shard 1: generate_async yielded 5, not (row, output)"
    )


def test_an_empty_batch_gives_the_shards_keys_and_no_version() -> None:
    out = empty_outputs(torch.zeros((0, 3), dtype=torch.int64), torch.zeros(0), 0)
    assert out["weight_versions"].shape == out["output_ids"].shape
    assert out["weight_versions"].dtype == torch.int64
    assert {"output_ids", "generation_lengths", "unpadded_sequence_lengths"} <= set(out)


def test_a_refit_lands_on_the_shards_that_took_it_and_an_adapter_only_on_all() -> None:
    start = GroupRefits.start(2)
    assert start.landed(None, {0: True, 1: True}) is start
    assert start.landed(Refit("update_weights_via_ipc_zmq"), {0: False, 1: "x"}) == start
    partial = start.landed(Refit("update_lora", "a"), {0: True, 1: False})
    assert partial.versions.version == 1
    assert partial.versions.shards == ((0, 1), (0,))
    assert isinstance(partial.check_adapters({"lora": "a"}, 1), Failure)
    every = partial.landed(Refit("update_lora", "b"), {0: True, 1: True})
    assert isinstance(every.check_adapters({"lora_names": ["b", None]}, 2), Success)
    assert every.check_adapters({}, 2) == Success(())
    assert every.versions.shards == ((0, 1, 2), (0, 2))
    full = every.landed(Refit("update_weights_from_collective"), {0: True, 1: True})
    assert full.adapters == frozenset({"b"})
    assert not full.lora_prepared


def test_a_shards_versions_are_relabelled_as_the_groups_and_other_outputs_kept() -> None:
    refits = GroupRefits.start(2).landed(Refit("update_weights_via_ipc_zmq"), {1: True})
    ids = torch.tensor([[1, 2]])
    assert refits.relabelled(0, {"output_ids": ids}) == {"output_ids": ids}
    # shard 0 took no refit; its own version 1 is the group's second refit
    relabelled = refits.relabelled(0, {"weight_versions": torch.tensor([[-1, 0, 1]])})
    assert relabelled["weight_versions"].tolist() == [[-1, 0, 2]]


def test_generates_outputs_merge_in_row_order_each_key_padded_with_its_no_value() -> None:
    plan = ShardPlan(num_rows=2, shards=((1,), (0,), ()), costs=(1, 1, 0))
    one = {"output_ids": torch.tensor([[7, 8]]), "weight_versions": torch.tensor([[-1, 0]])}
    two = {"output_ids": torch.tensor([[5]]), "weight_versions": torch.tensor([[0]])}
    merged = merge_outputs(plan, {0: one, 1: two}, pad_token_id=9)
    assert merged["output_ids"].tolist() == [[5, 9], [7, 8]]
    assert merged["weight_versions"].tolist() == [[0, NO_VERSION], [-1, 0]]


def test_generate_texts_merge_in_row_order_and_a_bad_answer_names_its_shard() -> None:
    plan = ShardPlan(num_rows=3, shards=((2,), (0, 1), ()), costs=(1, 2, 0))
    merged = merge_texts(plan, {0: {"texts": ["c"]}, 1: {"texts": ["a", "b"]}})
    assert merged == Success(["a", "b", "c"])
    bad = merge_texts(plan, {0: {"texts": ["c"]}, 1: "oops"})
    assert bad.failure().message == "shard 1: generate_text returned 'oops'"
    short = merge_texts(plan, {0: {"texts": []}, 1: {"texts": ["a", "b"]}})
    assert isinstance(short, Failure)


def test_collect_takes_one_future_per_shard() -> None:
    assert check_futures(2, 2) == Success(None)
    refused = check_futures(1, 2)
    assert isinstance(refused, Failure)
    assert refused.failure() == GroupCallError("collect: 1 future(s) for 2 shard(s)", "collect")


def test_a_shard_answer_that_is_no_mapping_is_named() -> None:
    info = {"image_token_id": 5}
    assert shard_mapping("multimodal_info", 0, info) == Success(info)
    refused = shard_mapping("multimodal_info", 0, [5])
    assert isinstance(refused, Failure)
    assert refused.failure().message == "shard 0: multimodal_info returned [5]"
