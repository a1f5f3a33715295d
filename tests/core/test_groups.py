"""Laws and documented cases of genworker.core.groups."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import group_batches

from genworker.core.assembly import FlatGenerations, Generation, flatten_generations
from genworker.core.groups import (
    EngineRequest,
    Group,
    GroupError,
    GroupPath,
    GroupPlan,
    admission_runs,
    batch_groups,
    check_declared_groups,
    drop_declared_groups,
    order_rows,
    plan_groups,
    prompt_groups,
)
from genworker.core.sampling import SamplingSpec

Batch = tuple[list[int], list[list[int]], list[SamplingSpec]]
SPEC = SamplingSpec(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4)


def _plan(batch: Batch) -> GroupPlan:
    rows, prompts, specs = batch
    planned = plan_groups(rows, prompts, specs)
    assert isinstance(planned, Success), planned
    plan = planned.unwrap()
    assert isinstance(plan, GroupPlan)
    return plan


@given(group_batches())
def test_recognised_groups_partition_the_rows_by_prompt_and_spec_but_seed(batch: Batch) -> None:
    rows, prompts, specs = batch
    plan = _plan(batch)
    assert sorted(plan.output_rows()) == rows
    at = {row: i for i, row in enumerate(rows)}

    def key(row: int) -> object:
        return tuple(prompts[at[row]]), attrs.evolve(specs[at[row]], seed=None)

    for group in plan.groups:
        assert list(group.rows) == sorted(group.rows)
        assert len({key(row) for row in group.rows}) == 1
    assert len({key(group.leader) for group in plan.groups}) == len(plan.groups)
    assert plan.grouped == any(len(g.rows) > 1 for g in plan.groups)


@given(group_batches())
def test_path_is_n_exactly_when_the_group_samples_and_no_row_has_a_seed(batch: Batch) -> None:
    rows, _, specs = batch
    spec = dict(zip(rows, specs, strict=True))
    for group in _plan(batch).groups:
        unseeded = all(spec[row].seed is None for row in group.rows)
        sampled = all(spec[row].temperature >= 1e-5 for row in group.rows)  # vLLM's greedy
        assert (group.path is GroupPath.SAMPLES) == (unseeded and sampled)


@given(group_batches())
def test_requests_cover_every_row_once_leader_first(batch: Batch) -> None:
    plan = _plan(batch)
    requests = plan.requests()
    assert sum(r.n for r in requests) == len(batch[0])
    expanded = []
    for group in plan.groups:
        if group.path is GroupPath.SAMPLES:
            expanded.append(EngineRequest(group.leader, len(group.rows)))
        else:
            expanded += [EngineRequest(row, 1) for row in group.rows]
    assert requests == tuple(expanded)
    # the completions of each request come back in request order: a group's rows in a run
    assert plan.output_rows() == tuple(row for g in plan.groups for row in g.rows)


@given(group_batches(), st.randoms(use_true_random=False))
def test_order_rows_puts_engine_order_back_in_row_order(batch: Batch, rnd: object) -> None:
    plan = _plan(batch)
    out_rows = plan.output_rows()
    by_row = {
        row: Generation(
            token_ids=np.arange(row % 4, dtype=np.int64) + 10 * row,
            logprobs=-np.arange(row % 4, dtype=np.float32) - row,
            finish_reason="length" if row % 2 else "stop",
        )
        for row in out_rows
    }
    engine = flatten_generations([by_row[row] for row in out_rows])
    expected = flatten_generations([by_row[row] for row in sorted(out_rows)])
    assert order_rows(engine, out_rows) == expected


def test_declared_groups_are_consecutive_runs() -> None:
    prompts = [[1, 2]] * 4 + [[3]] * 4
    specs = [attrs.evolve(SPEC, seed=s) for s in range(8)]
    planned = plan_groups(list(range(8)), prompts, specs, group_size=4, batch_size=8)
    assert planned == Success(
        GroupPlan((Group((0, 1, 2, 3), GroupPath.PREFIX), Group((4, 5, 6, 7), GroupPath.PREFIX)))
    )
    assert planned.unwrap().requests()[0] == EngineRequest(0, 1)


def test_declared_groups_may_split_equal_prompts() -> None:
    planned = plan_groups([0, 1, 2, 3], [[1]] * 4, [SPEC] * 4, group_size=2, batch_size=4)
    assert planned == Success(
        GroupPlan((Group((0, 1), GroupPath.SAMPLES), Group((2, 3), GroupPath.SAMPLES)))
    )
    assert planned.unwrap().requests() == (EngineRequest(0, 2), EngineRequest(2, 2))


def test_a_declared_group_with_different_prompts_is_refused_naming_its_rows() -> None:
    planned = plan_groups(
        [0, 1, 2, 3], [[1], [1], [1], [2]], [SPEC] * 4, group_size=2, batch_size=4
    )
    assert isinstance(planned, Failure)
    problem = planned.failure()
    assert isinstance(problem, GroupError)
    assert problem.rows == (2, 3)
    assert "[2, 3]" in problem.message


@pytest.mark.parametrize(("size", "batch"), [(3, 4), (0, 4), (2, None)])
def test_a_group_size_that_does_not_divide_the_batch_is_refused(
    size: int, batch: int | None
) -> None:
    planned = plan_groups([0, 1], [[1], [1]], [SPEC] * 2, group_size=size, batch_size=batch)
    assert isinstance(planned, Failure)
    assert f"group_size={size}" in planned.failure().message


def test_prompt_groups_by_first_appearance() -> None:
    assert prompt_groups([[1], [2], [1], [], [2], []]) == ((0, 2), (1, 4), (3, 5))


def test_programming_errors_raise() -> None:
    with pytest.raises(ValueError, match="rows, 1 prompts"):
        plan_groups([0, 1], [[1]], [SPEC])
    with pytest.raises(ValueError, match="strictly increasing"):
        plan_groups([1, 0], [[1], [1]], [SPEC] * 2)
    with pytest.raises(ValueError, match="strictly increasing"):
        Group((2, 1), GroupPath.PREFIX)
    with pytest.raises(ValueError, match="share rows"):
        GroupPlan((Group((1,), GroupPath.SAMPLES), Group((1, 2), GroupPath.SAMPLES)))
    flat = flatten_generations([])
    with pytest.raises(ValueError, match="distinct rows"):
        order_rows(flat, [0])


def test_order_rows_of_nothing() -> None:
    flat = flatten_generations([])
    assert order_rows(flat, []) == flat
    assert isinstance(flat, FlatGenerations)


def test_a_greedy_group_goes_row_by_row_for_vllm_refuses_n_above_one_when_greedy() -> None:
    greedy = attrs.evolve(SPEC, temperature=0.0)
    planned = plan_groups([0, 1, 2], [[5, 6]] * 3, [greedy] * 3)
    assert planned == Success(GroupPlan((Group((0, 1, 2), GroupPath.PREFIX),)))
    assert planned.unwrap().requests() == tuple(EngineRequest(row, 1) for row in (0, 1, 2))


@given(st.integers(1, 4), st.integers(0, 5))
def test_a_declared_layout_of_equal_prompts_is_its_size(size: int, groups: int) -> None:
    prompts = [[g, g + 1] for g in range(groups) for _ in range(size)]
    assert check_declared_groups(size, prompts) == Success(size)
    assert check_declared_groups(None, prompts) == Success(None)


@pytest.mark.parametrize("size", [0, -2, 3, "2", True, 2.0])
def test_a_declared_size_that_is_no_divisor_is_refused_naming_it(size: object) -> None:
    problem = check_declared_groups(size, [[1], [1], [2], [2]]).swap().unwrap()
    assert problem.message == (
        f"data['num_generations_per_prompt']={size!r} must be an int dividing the batch of 4 rows"
    )
    assert problem.rows == (0, 1, 2, 3)
    assert problem.group_size == (size if type(size) is int else 0)


def test_a_declared_group_of_different_prompts_is_refused_naming_its_rows() -> None:
    problem = check_declared_groups(2, [[1], [1], [1], [2]]).swap().unwrap()
    assert problem == GroupError(
        "declared group of rows [2, 3] (num_generations_per_prompt=2) holds different prompts",
        rows=(2, 3),
        group_size=2,
    )


def test_a_declared_layout_is_checked_and_dropped_and_other_keys_kept() -> None:
    data = {"input_ids": "ids", "num_generations_per_prompt": 2}
    assert drop_declared_groups(data, [[1], [1], [2], [2]]) == Success({"input_ids": "ids"})
    undeclared = {"input_ids": "ids"}
    kept = drop_declared_groups(undeclared, [[1], [2]])
    assert isinstance(kept, Success)
    assert kept.unwrap() is undeclared
    refused = drop_declared_groups(data, [[1], [1], [1], [2]])
    assert refused == check_declared_groups(2, [[1], [1], [1], [2]])
    assert isinstance(refused, Failure)


@given(group_batches(), st.none() | st.integers(1, 4))
def test_a_workers_groups_are_plan_groups_and_a_batch_with_media_goes_row_by_row(
    batch: Batch, declared: int | None
) -> None:
    """Without media a worker's groups are ``plan_groups``' of the declared size; with
    media every row is its own group, whatever was declared."""
    rows, prompts, specs = batch
    size = max(rows, default=-1) + 1
    planned = batch_groups(rows, prompts, specs, declared=declared, batch_size=size, media=False)
    assert planned == plan_groups(rows, prompts, specs, group_size=declared, batch_size=size)
    alone = batch_groups(rows, prompts, specs, declared=declared, batch_size=size, media=True)
    assert alone == Success(GroupPlan(tuple(Group((row,), GroupPath.PREFIX) for row in rows)))


@pytest.mark.parametrize("declared", [True, 2.0, "2"])
def test_a_declared_size_that_is_not_an_int_refuses_the_batch_naming_it(declared: object) -> None:
    refused = batch_groups(
        [0, 1], [[1], [1]], [SPEC, SPEC], declared=declared, batch_size=2, media=True
    )
    assert refused == Failure(
        GroupError(
            f"data['num_generations_per_prompt'] must be an int, got {declared!r}",
            rows=(0, 1),
            group_size=0,
        )
    )


def test_a_streams_rows_go_alone_unless_the_engine_shares_a_leaders_prefill() -> None:
    groups = GroupPlan((Group((0, 2), GroupPath.PREFIX), Group((1,), GroupPath.SAMPLES)))
    assert admission_runs([0, 1, 2], groups, True) == [(0, 2), (1,)]
    assert admission_runs([0, 1, 2], groups, False) == [(0,), (1,), (2,)]
    assert admission_runs([0, 1, 2], None, True) == [(0,), (1,), (2,)]
