"""Laws and documented cases of genworker.core.sharding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Result
from strategies import generated_rows, shard_counts, shard_lengths, shard_plans

from genworker.core.groups import prompt_groups
from genworker.core.sharding import (
    ShardError,
    ShardPlan,
    describe_shard_rows,
    merge_shard_outputs,
    merge_shard_texts,
    plan_prompt_rows,
    plan_prompt_shards,
    plan_shards,
    plan_text_shards,
    split_batch,
)

PAD = 7


def _shards(
    result: Result[tuple[dict[str, object], ...], ShardError],
) -> tuple[dict[str, object], ...]:
    shards = result.value_or(None)
    assert shards is not None, result
    return shards


def _tensor(value: object) -> torch.Tensor:
    assert isinstance(value, torch.Tensor)
    return value


def _batch(lengths: list[int], width_extra: int = 1) -> dict[str, object]:
    width = max(lengths, default=0) + width_extra
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.arange(1, length + 1) + 100 * row
    return {
        "input_ids": ids,
        "input_lengths": torch.tensor(lengths, dtype=torch.long),
        "stop_strings": [[f"stop{row}"] for row in range(len(lengths))],
        "greedy_hint": "x",
        "nothing": None,
        "scale": torch.tensor(0.5),
    }


# --- plan_shards ---


@given(shard_lengths(), shard_counts(), st.integers(0, 512))
def test_every_row_lands_in_exactly_one_shard_in_ascending_order(
    lengths: list[int], num_shards: int, max_new_tokens: int
) -> None:
    plan = plan_shards(lengths, num_shards, max_new_tokens=max_new_tokens)
    rows = [row for shard in plan.shards for row in shard]
    assert sorted(rows) == list(range(len(lengths)))
    assert all(list(shard) == sorted(shard) for shard in plan.shards)
    assert plan.num_shards == num_shards
    assert sum(plan.sizes) == plan.num_rows == len(lengths)


@given(shard_lengths(), shard_counts(), st.integers(0, 512))
def test_costliest_shard_exceeds_cheapest_by_at_most_one_row(
    lengths: list[int], num_shards: int, max_new_tokens: int
) -> None:
    plan = plan_shards(lengths, num_shards, max_new_tokens=max_new_tokens)
    cost = [length + max_new_tokens for length in lengths]
    assert plan.costs == tuple(sum(cost[row] for row in shard) for shard in plan.shards)
    assert max(plan.costs) <= min(plan.costs) + max(cost, default=0)


@given(shard_lengths(max_rows=8), st.integers(8, 12))
def test_fewer_rows_than_shards_gives_one_row_at_most_per_shard(
    lengths: list[int], num_shards: int
) -> None:
    plan = plan_shards(lengths, num_shards)
    assert max(plan.sizes) <= 1
    assert plan.sizes.count(0) == num_shards - len(lengths)


@given(shard_lengths(), shard_counts(), st.integers(0, 64))
def test_plan_is_deterministic_and_takes_tensors(
    lengths: list[int], num_shards: int, max_new_tokens: int
) -> None:
    plan = plan_shards(lengths, num_shards, max_new_tokens=max_new_tokens)
    again = plan_shards(list(lengths), num_shards, max_new_tokens=max_new_tokens)
    from_tensor = plan_shards(
        torch.tensor(lengths, dtype=torch.long), num_shards, max_new_tokens=max_new_tokens
    )
    assert plan == again == from_tensor


def test_longest_rows_go_first_onto_the_least_loaded_shard() -> None:
    # Costs 10, 9, 8, 1, 1 on two shards: 10 -> s0, 9 -> s1, 8 -> s1, 1 -> s0, 1 -> s0.
    plan = plan_shards([1, 10, 8, 9, 1], 2)
    assert plan.shards == ((0, 1, 4), (2, 3))
    assert plan.costs == (12, 17)


def test_max_new_tokens_counts_toward_every_row() -> None:
    # Without the decode budget rows 0 and 1 (cost 6, 3) vs 2 and 3 (2, 1) would split
    # 6 | 3+2+1; with 100 new tokens each, rows weigh almost the same and split two and two.
    assert plan_shards([6, 3, 2, 1], 2).shards == ((0,), (1, 2, 3))
    assert plan_shards([6, 3, 2, 1], 2, max_new_tokens=100).shards == ((0, 3), (1, 2))


def test_zero_cost_rows_spread_over_shards() -> None:
    assert plan_shards([0, 0, 0, 0], 2).shards == ((0, 2), (1, 3))


def test_empty_batch_gives_empty_shards() -> None:
    plan = plan_shards([], 3)
    assert plan.shards == ((), (), ())
    assert plan.costs == (0, 0, 0)


@pytest.mark.parametrize(
    ("lengths", "num_shards", "max_new_tokens", "match"),
    [
        ([1], 0, 0, "num_shards"),
        ([1, -1], 2, 0, "negative"),
        ([1], 1, -1, "max_new_tokens"),
    ],
)
def test_programming_errors_raise(
    lengths: list[int], num_shards: int, max_new_tokens: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        plan_shards(lengths, num_shards, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize(
    ("shards", "costs", "match"),
    [
        (((0,), (0,)), (1, 1), "do not hold"),
        (((0,),), (1,), "do not hold"),
        (((1, 0),), (2,), "ascending"),
        (((0, 1),), (1, 1), "one cost per shard"),
    ],
)
def test_shard_plan_refuses_a_broken_partition(
    shards: tuple[tuple[int, ...], ...], costs: tuple[int, ...], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ShardPlan(num_rows=2, shards=shards, costs=costs)


# --- split_batch and merge ---


@given(shard_plans())
def test_merge_of_split_restores_order_and_content(plan: ShardPlan) -> None:
    lengths = [(row * 7) % 5 for row in range(plan.num_rows)]
    data = _batch(lengths)
    shards = _shards(split_batch(plan, data))
    assert len(shards) == plan.num_shards
    tensors = [
        {key: _tensor(shard[key]) for key in ("input_ids", "input_lengths")} for shard in shards
    ]
    merged = merge_shard_outputs(plan, tensors, pad_token_id=PAD)
    assert torch.equal(merged["input_ids"], _tensor(data["input_ids"]))
    assert torch.equal(merged["input_lengths"], _tensor(data["input_lengths"]))
    assert merged["input_ids"].dtype == torch.long
    stops: list[object] = []
    for shard in shards:
        per_sample = shard["stop_strings"]
        assert isinstance(per_sample, list)
        stops.extend(per_sample)
    restored: list[object] = [None] * plan.num_rows
    for position, row in enumerate(plan.concat_order):
        restored[row] = stops[position]
    assert restored == data["stop_strings"]


@given(shard_plans())
def test_split_copies_scalars_and_slices_per_sample_values(plan: ShardPlan) -> None:
    data = _batch([3] * plan.num_rows)
    data["as_tuple"] = tuple(range(plan.num_rows))
    for rows, shard in zip(plan.shards, _shards(split_batch(plan, data)), strict=True):
        assert shard["greedy_hint"] == "x"
        assert shard["nothing"] is None
        assert torch.equal(_tensor(shard["scale"]), torch.tensor(0.5))
        assert shard["as_tuple"] == list(rows)
        assert shard["stop_strings"] == [[f"stop{row}"] for row in rows]
        width = _tensor(data["input_ids"]).shape[1]
        assert _tensor(shard["input_ids"]).shape == (len(rows), width)


@given(shard_plans(), st.data())
def test_each_rows_adapter_name_travels_with_it_and_comes_back_in_order(
    plan: ShardPlan, draw: st.DataObject
) -> None:
    """The group's ``lora_names`` (one adapter name or None per row): every shard gets its
    rows' names, None kept; in the shards' order and back through ``concat_order`` they
    are the batch's; the batch's one ``lora`` goes to every shard."""
    names = draw.draw(
        st.lists(
            st.sampled_from([None, "policy", "ref/v2"]),
            min_size=plan.num_rows,
            max_size=plan.num_rows,
        )
    )
    shards = _shards(split_batch(plan, {"lora_names": tuple(names), "lora": "policy"}))
    concatenated: list[object] = []
    for rows, shard in zip(plan.shards, shards, strict=True):
        assert shard["lora_names"] == [names[row] for row in rows]
        assert shard["lora"] == "policy"
        assert isinstance(shard["lora_names"], list)
        concatenated.extend(shard["lora_names"])
    restored: list[object] = ["missing"] * plan.num_rows
    for position, row in enumerate(plan.concat_order):
        restored[row] = concatenated[position]
    assert restored == names


@pytest.mark.parametrize(
    ("key", "value", "length"),
    [
        ("stop_strings", [["a"]], 1),
        ("input_ids", torch.zeros((3, 2), dtype=torch.long), 3),
    ],
)
def test_split_refuses_entries_of_another_batch_size(key: str, value: object, length: int) -> None:
    plan = plan_shards([1, 2], 2)
    data = _batch([1, 2])
    data[key] = value
    error = split_batch(plan, data).swap().value_or(None)
    assert error is not None
    assert (error.key, error.length, error.num_rows) == (key, length, 2)
    assert repr(key) in str(error)


@given(generated_rows(), shard_counts(), st.integers(0, 3))
def test_merge_pads_every_shard_to_the_widest_and_restores_rows(
    rows: list[tuple[list[int], list[float]]], num_shards: int, extra: int
) -> None:
    """Shards pad to their own width (plus slack); merged rows equal the rows padded globally."""
    plan = plan_shards([len(tokens) for tokens, _ in rows], num_shards)
    outputs = []
    for shard_rows in plan.shards:
        width = max((len(rows[r][0]) for r in shard_rows), default=0) + extra
        ids = torch.full((len(shard_rows), width), PAD, dtype=torch.long)
        logprobs = torch.zeros((len(shard_rows), width), dtype=torch.float32)
        for i, r in enumerate(shard_rows):
            tokens, lps = rows[r]
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        lengths = torch.tensor([len(rows[r][0]) for r in shard_rows], dtype=torch.long)
        outputs.append({"output_ids": ids, "logprobs": logprobs, "generation_lengths": lengths})
    merged = merge_shard_outputs(plan, outputs, pad_token_id=PAD)
    width = max(out["output_ids"].shape[1] for out in outputs)
    assert merged["output_ids"].shape == (len(rows), width)
    for r, (tokens, lps) in enumerate(rows):
        assert merged["output_ids"][r].tolist() == tokens + [PAD] * (width - len(tokens))
        expected = torch.tensor(lps + [0.0] * (width - len(lps)), dtype=torch.float32)
        assert torch.equal(merged["logprobs"][r], expected)
        assert merged["generation_lengths"][r].item() == len(tokens)
    assert merged["logprobs"].dtype == torch.float32


def test_empty_shards_of_any_width_or_no_keys_are_ignored() -> None:
    plan = plan_shards([2, 3], 4)
    full = {
        "output_ids": torch.tensor([[1, 2, 3]]),
        "logprobs": torch.tensor([[-0.5, -0.5, -0.5]]),
        "generation_lengths": torch.tensor([3]),
    }
    half = {
        "output_ids": torch.tensor([[4, 5]]),
        "logprobs": torch.tensor([[-1.0, -1.0]]),
        "generation_lengths": torch.tensor([2]),
    }
    empty = {
        "output_ids": torch.zeros((0, 0), dtype=torch.long),
        "logprobs": torch.zeros((0, 0), dtype=torch.float),
        "generation_lengths": torch.zeros(0, dtype=torch.long),
    }
    outputs: list[dict[str, torch.Tensor]] = []
    for rows in plan.shards:
        if rows == (1,):
            outputs.append(full)
        elif rows == (0,):
            outputs.append(half)
        else:
            outputs.append(empty if not outputs else {})
    merged = merge_shard_outputs(plan, outputs, pad_token_id=PAD)
    assert merged["output_ids"].tolist() == [[4, 5, PAD], [1, 2, 3]]
    assert merged["logprobs"].tolist() == [[-1.0, -1.0, 0.0], [-0.5, -0.5, -0.5]]
    assert merged["generation_lengths"].tolist() == [2, 3]


def test_all_empty_shards_merge_to_typed_empty_outputs() -> None:
    plan = plan_shards([], 2)
    outputs = [
        {
            "output_ids": torch.zeros((0, 5), dtype=torch.long),
            "generation_lengths": torch.zeros(0, dtype=torch.long),
        },
        {},
    ]
    merged = merge_shard_outputs(plan, outputs, pad_token_id=PAD)
    assert merged["output_ids"].shape == (0, 5)
    assert merged["output_ids"].dtype == torch.long
    assert merged["generation_lengths"].shape == (0,)
    assert merge_shard_outputs(plan, [{}, {}], pad_token_id=PAD) == {}


def test_pad_values_override_per_key() -> None:
    plan = ShardPlan(num_rows=2, shards=((0,), (1,)), costs=(1, 1))
    outputs = [
        {"mask": torch.tensor([[True]]), "output_ids": torch.tensor([[1]])},
        {"mask": torch.tensor([[True, True]]), "output_ids": torch.tensor([[2, 3]])},
    ]
    merged = merge_shard_outputs(plan, outputs, pad_token_id=0, pad_values={"mask": True})
    assert merged["mask"].tolist() == [[True, True], [True, True]]
    assert merged["output_ids"].tolist() == [[1, 0], [2, 3]]


def test_three_dimensional_tensors_pad_along_the_sequence_dimension() -> None:
    plan = ShardPlan(num_rows=2, shards=((1,), (0,)), costs=(1, 1))
    outputs = [
        {"topk": torch.ones((1, 1, 2))},
        {"topk": torch.full((1, 2, 2), 2.0)},
    ]
    merged = merge_shard_outputs(plan, outputs, pad_token_id=PAD)
    assert merged["topk"].tolist() == [
        [[2.0, 2.0], [2.0, 2.0]],
        [[1.0, 1.0], [0.0, 0.0]],
    ]


@pytest.mark.parametrize(
    ("outputs", "match"),
    [
        ([{"x": torch.zeros(1)}], "1 shard outputs for 2 shards"),
        ([{"x": torch.zeros(1)}, {"x": torch.zeros(2)}], "shard 1 has shape"),
        ([{"x": torch.zeros(1)}, {"x": torch.tensor(1.0)}], "shard 1 has shape"),
        ([{"x": torch.zeros(1)}, {"y": torch.zeros(1)}], "shard 1 returned keys"),
        ([{"x": torch.zeros(1)}, {"x": torch.zeros(1), "y": torch.zeros(1)}], "shard 1"),
    ],
)
def test_merge_refuses_mismatched_outputs(
    outputs: list[dict[str, torch.Tensor]], match: str
) -> None:
    plan = ShardPlan(num_rows=2, shards=((0,), (1,)), costs=(1, 1))
    with pytest.raises(ValueError, match=match):
        merge_shard_outputs(plan, outputs, pad_token_id=PAD)


def test_empty_shard_may_not_invent_keys() -> None:
    plan = ShardPlan(num_rows=1, shards=((0,), ()), costs=(1, 0))
    with pytest.raises(ValueError, match="shard 1 returned keys"):
        merge_shard_outputs(
            plan,
            [{"x": torch.zeros(1)}, {"x": torch.zeros(0), "y": torch.zeros(0)}],
            pad_token_id=PAD,
        )


# --- groups kept whole (core.groups) ---
from strategies import shard_groups


@given(st.data(), shard_lengths(max_rows=24), shard_counts(), st.integers(0, 64))
def test_no_group_is_split_unless_it_costs_more_than_a_shards_share(
    data: st.DataObject, lengths: list[int], num_shards: int, max_new_tokens: int
) -> None:
    groups = data.draw(shard_groups(len(lengths)))
    plan = plan_shards(lengths, num_shards, max_new_tokens=max_new_tokens, groups=groups)
    cost = [length + max_new_tokens for length in lengths]
    share = -(-sum(cost) // num_shards)
    owner = {row: s for s, shard in enumerate(plan.shards) for row in shard}
    assert sorted(owner) == list(range(len(lengths)))
    for group in groups:
        if sum(cost[row] for row in group) <= share:
            assert len({owner[row] for row in group}) == 1, (group, plan.shards)
    # still balanced: the spread is at most the costliest item (a whole group or a piece)
    biggest = max([*cost, *(min(share, sum(cost[r] for r in g)) for g in groups)], default=0)
    assert max(plan.costs) <= min(plan.costs) + biggest


def test_eight_groups_of_eight_over_two_shards_keep_each_group_on_one_shard() -> None:
    lengths = [100 + g for g in range(8) for _ in range(8)]
    groups = [list(range(8 * g, 8 * g + 8)) for g in range(8)]
    plan = plan_shards(lengths, 2, max_new_tokens=16, groups=groups)
    for group in groups:
        assert any(set(group) <= set(shard) for shard in plan.shards)
    assert plan.sizes == (32, 32)


def test_a_group_larger_than_a_share_is_cut_into_pieces_of_at_most_a_share() -> None:
    plan = plan_shards([10] * 8, 2, groups=[list(range(8))])
    assert plan.shards == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_an_empty_group_changes_nothing() -> None:
    assert plan_shards([3, 1, 2], 2, groups=[[]]) == plan_shards([3, 1, 2], 2)


def test_overlapping_groups_are_a_programming_error() -> None:
    with pytest.raises(ValueError, match="overlap"):
        plan_shards([1, 2, 3], 2, groups=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="outside"):
        plan_shards([1, 2, 3], 2, groups=[[5]])


@given(shard_plans())
def test_merged_texts_are_each_row_s_own_text(plan: ShardPlan) -> None:
    texts = [[f"row {row}" for row in rows] for rows in plan.shards]
    assert merge_shard_texts(plan, texts).unwrap() == [f"row {r}" for r in range(plan.num_rows)]


def test_a_shard_with_another_count_of_texts_is_named() -> None:
    plan = ShardPlan(num_rows=3, shards=((0, 2), (1,)), costs=(2, 1))
    problem = merge_shard_texts(plan, [["a", "c"], []]).swap().unwrap()
    assert problem == ShardError(
        "shard 1: generate_text returned 0 texts for 1 prompts", key="texts", length=0, num_rows=1
    )


def test_a_shard_s_rows_are_described_as_the_batch_s() -> None:
    assert describe_shard_rows(()) == ""
    assert describe_shard_rows((0, 1, 2)) == ""
    assert describe_shard_rows((3,)) == " (its row 0 is the batch's row 3)"
    assert describe_shard_rows((1, 4)) == " (its rows 0-1 are the batch's rows 1, 4)"
    many = tuple(range(1, 19))
    assert describe_shard_rows(many, shown=2) == " (its rows 0-17 are the batch's rows 1, 2, ...)"


@given(
    st.lists(st.sampled_from([(1,), (1, 2), (3, 4, 5), ()]), max_size=12),
    shard_counts(),
    st.integers(0, 4),
)
def test_prompt_shards_keep_equal_prompts_together_when_they_fit(
    prompts: list[tuple[int, ...]], num_shards: int, max_new: int
) -> None:
    plan = plan_prompt_shards(prompts, num_shards, max_new_tokens=max_new)
    cost = [len(p) + max_new for p in prompts]
    share = -(-sum(cost) // num_shards)
    owner = {row: k for k, rows in enumerate(plan.shards) for row in rows}
    for group in prompt_groups(prompts):
        assert len({prompts[row] for row in group}) == 1
        if sum(cost[row] for row in group) <= share:
            assert len({owner[row] for row in group}) == 1, (group, plan)
    assert plan.costs == tuple(sum(cost[r] for r in rows) for rows in plan.shards)


@given(
    st.lists(st.lists(st.integers(3, 9), min_size=1, max_size=6), max_size=16),
    st.data(),
    shard_counts(),
)
def test_a_plan_of_some_rows_names_the_batchs_rows_and_leaves_the_rest_last(
    prompts: list[list[int]], data: st.DataObject, num_shards: int
) -> None:
    """plan_prompt_rows is plan_prompt_shards of the chosen rows, renamed to the batch's
    rows; the rows left out make one more shard of no cost, so the plan partitions them all."""
    chosen = sorted(
        data.draw(st.sets(st.integers(0, max(len(prompts) - 1, 0)))) & set(range(len(prompts)))
    )
    picked = [(row, prompts[row]) for row in chosen]
    plan = plan_prompt_rows(picked, len(prompts), num_shards, max_new_tokens=4)
    inner = plan_prompt_shards([p for _, p in picked], num_shards, max_new_tokens=4)
    assert plan.shards[:-1] == tuple(tuple(chosen[k] for k in s) for s in inner.shards)
    assert plan.shards[-1] == tuple(r for r in range(len(prompts)) if r not in chosen)
    assert plan.costs == (*inner.costs, 0)
    assert plan.num_rows == len(prompts)


@given(st.lists(st.text(max_size=12), max_size=12), shard_counts(), st.integers(0, 8))
def test_text_prompts_are_planned_by_their_characters(
    prompts: list[str], num_shards: int, new: int
) -> None:
    plan = plan_text_shards(prompts, num_shards, max_new_tokens=new)
    lengths = [len(p) for p in prompts]
    assert plan == plan_shards(lengths, num_shards, max_new_tokens=new)
