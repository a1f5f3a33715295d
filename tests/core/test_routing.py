"""Laws of the routed-experts layout (MoE routing replay) and its capture plan."""

from __future__ import annotations

import types

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from returns.result import Failure, Success
from strategies import RoutedCase, routed_cases, st

from genworker.core.assembly import (
    Generation,
    assemble_outputs,
    flatten_generations,
    place_rows,
)
from genworker.core.outputs import check_generation_routes, check_routed_experts
from genworker.core.routing import (
    FILL,
    MOE_FIELDS,
    V2_RUNNER_ENV,
    CapturePlatform,
    MoeShape,
    NotMoe,
    RoutedExperts,
    RoutesRefused,
    check_routes,
    layout_routes,
    moe_shape,
    nemo_rl_routes,
    plan_capture,
    routes_dtype,
    routes_of,
)
from genworker.core.sharding import ShardPlan, merge_shard_outputs


def _routes(case: RoutedCase) -> torch.Tensor:
    b = case.batch
    out = assemble_outputs(b.input_ids, b.input_lengths, case.generations, b.pad_token_id)
    assert out.routed_experts is not None
    assert out.as_dict()["routed_experts"] is out.routed_experts
    return out.routed_experts


def _raw(generation: Generation) -> np.ndarray:
    assert generation.routed_experts is not None
    return generation.routed_experts.experts


@given(routed_cases())
def test_positions_line_up_with_output_ids_and_padding_is_filled(case: RoutedCase) -> None:
    b = case.batch
    out = assemble_outputs(b.input_ids, b.input_lengths, case.generations, b.pad_token_id)
    routes = out.routed_experts
    assert routes is not None
    shape = case.shape
    width = out.output_ids.shape[1]
    assert tuple(routes.shape) == (len(case.generations), width, shape.num_layers, shape.top_k)
    assert routes.dtype == torch.from_numpy(np.empty(0, routes_dtype(shape.num_experts))).dtype
    for row, generation in enumerate(case.generations):
        held = int(out.unpadded_sequence_lengths[row])
        routed = max(held - 1, 0)
        # the token at output_ids[row, p] was routed as routes[row, p], for every forwarded p
        assert np.array_equal(routes[row, :routed].numpy(), _raw(generation).astype(np.int64))
        assert bool((routes[row, routed:] == FILL).all())
    wide = routes.to(torch.int64)
    assert bool(((wide == FILL) | ((wide >= 0) & (wide < shape.num_experts))).all())


@given(routed_cases(), st.randoms(use_true_random=False))
def test_a_rows_experts_survive_reordering(case: RoutedCase, rnd: object) -> None:
    order = list(range(len(case.generations)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    b = case.batch
    index = torch.tensor(order, dtype=torch.long)
    shuffled = assemble_outputs(
        b.input_ids[index], b.input_lengths[index], [case.generations[i] for i in order], 0
    )
    assert shuffled.routed_experts is not None
    assert torch.equal(shuffled.routed_experts, _routes(case)[index])


@given(routed_cases(), st.data())
def test_a_rows_experts_survive_sharding_and_the_merge(
    case: RoutedCase, data: st.DataObject
) -> None:
    b = case.batch
    rows = len(case.generations)
    shards_n = data.draw(st.integers(1, 3))
    owner = data.draw(st.lists(st.integers(0, shards_n - 1), min_size=rows, max_size=rows))
    shards = tuple(tuple(r for r in range(rows) if owner[r] == s) for s in range(shards_n))
    plan = ShardPlan(num_rows=rows, shards=shards, costs=tuple(len(s) for s in shards))
    outputs: list[dict[str, torch.Tensor]] = []
    for shard in shards:
        if not shard:
            outputs.append({})
            continue
        index = torch.tensor(shard, dtype=torch.long)
        part = assemble_outputs(
            b.input_ids[index], b.input_lengths[index], [case.generations[r] for r in shard], 0
        )
        assert part.routed_experts is not None
        outputs.append({"routed_experts": part.routed_experts})
    merged = merge_shard_outputs(plan, outputs, 0, pad_values={"routed_experts": FILL})
    whole = _routes(case)
    got = merged["routed_experts"]
    # shards may be narrower than the batch; the merge pads them with FILL
    assert torch.equal(got[:, : whole.shape[1]], whole)
    assert bool((got[:, whole.shape[1] :] == FILL).all())


@given(routed_cases(), st.data())
def test_wrong_shapes_are_refused_by_row(case: RoutedCase, data: st.DataObject) -> None:
    b = case.batch
    rows = len(case.generations)
    broken = sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1)))
    how = data.draw(st.sampled_from(["extra", "layers", "range", "float"]))
    gens = list(case.generations)
    for row in broken:
        raw = _raw(gens[row]).astype(np.int64)
        if how == "extra":
            raw = np.concatenate([raw, np.zeros((1, *raw.shape[1:]), dtype=raw.dtype)])
        elif how == "layers":
            raw = np.zeros((raw.shape[0], raw.shape[1] + 1, raw.shape[2]), dtype=raw.dtype)
        elif how == "range":
            raw = np.full((max(raw.shape[0], 1), *raw.shape[1:]), case.shape.num_experts)
            gens[row] = attrs.evolve(gens[row], token_ids=np.arange(max(1, gens[row].num_tokens)))
            raw = raw[: max(int(b.input_lengths[row]) + gens[row].num_tokens - 1, 0)]
            if raw.shape[0] == 0:
                raw = np.zeros((1, case.shape.num_layers, case.shape.top_k), dtype=np.int64)
        else:
            raw = raw.astype(np.float32)
        gens[row] = attrs.evolve(gens[row], routed_experts=RoutedExperts(case.shape, raw))
    flat = flatten_generations(gens)
    names = [10 + r for r in range(rows)]
    result = check_routed_experts(flat, b.input_lengths.numpy().astype(np.int64), rows=names)
    assert isinstance(result, Failure)
    refused = result.failure()
    assert isinstance(refused, RoutesRefused)
    assert refused.rows == tuple(10 + r for r in broken)
    assert all(f"row {10 + r}" in refused.message for r in broken)
    with pytest.raises(ValueError, match="checked routes"):
        layout_routes(flat.routed_experts or (), b.input_lengths.numpy(), flat.lengths, 99)


@given(routed_cases())
def test_checked_batches_pass_unchanged(case: RoutedCase) -> None:
    flat = flatten_generations(case.generations)
    lengths = case.batch.input_lengths.numpy().astype(np.int64)
    assert check_routed_experts(flat, lengths) == Success(flat)
    for row, generation in enumerate(case.generations):
        assert check_generation_routes(generation, int(lengths[row]), row=row) == Success(
            generation
        )


@given(routed_cases())
def test_nemo_rl_layout_fills_unrouted_positions_with_the_default_route(case: RoutedCase) -> None:
    ours = _routes(case).numpy()
    theirs = nemo_rl_routes(ours)
    assert theirs.dtype == ours.dtype
    empty = (ours == FILL).all(axis=(2, 3))
    assert np.array_equal(theirs[~empty], ours[~empty])
    assert bool((theirs[empty] == np.arange(case.shape.top_k)).all())


def test_rows_without_routes_and_without_tokens_are_fill() -> None:
    shape = MoeShape(num_layers=2, top_k=2, num_experts=4)
    routed = Generation([5, 6], None, "stop", RoutedExperts(shape, np.zeros((3, 2, 2), np.uint8)))
    flat = place_rows(flatten_generations([routed]), [1], 3)
    assert flat.routed_experts == (None, routed.routed_experts, None)
    assert check_routed_experts(flat, np.array([2, 2, 2])) == Success(flat)
    ids = torch.zeros((3, 2), dtype=torch.long)
    from genworker.core.assembly import assemble_flat_outputs

    out = assemble_flat_outputs(ids, torch.tensor([2, 2, 2]), flat, 0)
    assert out.routed_experts is not None
    assert out.routed_experts.dtype == torch.int8
    assert bool((out.routed_experts[[0, 2]] == FILL).all())
    assert bool((out.routed_experts[1, :3] == 0).all())
    assert bool((out.routed_experts[1, 3:] == FILL).all())


def test_a_row_with_tokens_and_no_routes_is_refused() -> None:
    shape = MoeShape(num_layers=1, top_k=1, num_experts=2)
    routed = Generation([1], None, "stop", RoutedExperts(shape, np.zeros((1, 1, 1), np.int32)))
    bare = Generation([1], None, "stop")
    refused = check_routed_experts(flatten_generations([routed, bare]), np.array([1, 1]))
    assert isinstance(refused, Failure)
    assert refused.failure().rows == (1,)
    assert "no routes" in refused.failure().message


def test_rows_of_two_shapes_are_refused() -> None:
    a = MoeShape(num_layers=1, top_k=1, num_experts=2)
    b = MoeShape(num_layers=1, top_k=1, num_experts=3)
    gens = [
        Generation([1], None, "stop", RoutedExperts(a, np.zeros((1, 1, 1), np.int32))),
        Generation([1], None, "stop", RoutedExperts(b, np.zeros((1, 1, 1), np.int32))),
    ]
    refused = check_routed_experts(flatten_generations(gens), np.array([1, 1]))
    assert isinstance(refused, Failure)
    assert refused.failure().rows == (1,)


def test_a_batch_without_routes_passes_and_has_no_routes_key() -> None:
    flat = flatten_generations([Generation([1], None, "stop")])
    assert flat.routed_experts is None
    assert check_routed_experts(flat, np.array([1])) == Success(flat)
    generation = Generation([1], None, "stop")
    assert check_generation_routes(generation, 1) == Success(generation)
    assert check_routes((), np.zeros(0, np.int64), np.zeros(0, np.int64)) == Success(None)


@pytest.mark.parametrize(
    ("experts", "dtype"),
    [(1, np.int8), (128, np.int8), (129, np.int16), (32768, np.int16), (32769, np.int32)],
)
def test_the_dtype_is_the_smallest_holding_the_experts_and_the_fill(
    experts: int, dtype: type
) -> None:
    assert routes_dtype(experts) == np.dtype(dtype)
    assert MoeShape(1, 1, experts).dtype == np.dtype(dtype)


def test_programming_errors_raise() -> None:
    with pytest.raises(ValueError, match="int32"):
        routes_dtype(2**32)
    with pytest.raises(ValueError, match="positive"):
        MoeShape(0, 1, 1)
    with pytest.raises(ValueError, match="top_k"):
        MoeShape(1, 3, 2)
    with pytest.raises(ValueError, match="2 routes"):
        check_routes((None, None), np.zeros(1, np.int64), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="checked routes"):
        layout_routes((None,), np.array([1]), np.array([0]), 4)
    shape = MoeShape(1, 1, 2)
    wide = (RoutedExperts(shape, np.zeros((4, 1, 1), np.int32)),)
    with pytest.raises(ValueError, match="width"):
        layout_routes(wide, np.array([3]), np.array([2]), 3)
    with pytest.raises(ValueError, match="B, W"):
        nemo_rl_routes(np.zeros((2, 2), np.int8))
    with pytest.raises(ValueError, match="routed-experts rows"):
        attrs.evolve(flatten_generations([Generation([1], None, "stop")]), routed_experts=())
    flat = flatten_generations([Generation([1], None, "stop")])
    ids, lengths = torch.zeros((1, 1), dtype=torch.long), torch.tensor([1])
    out = assemble_outputs(ids, lengths, [Generation([1], None, "stop")], 0)
    with pytest.raises(ValueError, match="routed_experts must be"):
        attrs.evolve(out, routed_experts=torch.zeros((1, 2), dtype=torch.int8))
    assert flat.routed_experts is None


def test_outputs_compare_their_routes() -> None:
    shape = MoeShape(1, 1, 2)
    gen = Generation([1], None, "stop", RoutedExperts(shape, np.zeros((1, 1, 1), np.int32)))
    ids, lengths = torch.zeros((1, 1), dtype=torch.long), torch.tensor([1])
    with_routes = assemble_outputs(ids, lengths, [gen], 0)
    without = assemble_outputs(ids, lengths, [attrs.evolve(gen, routed_experts=None)], 0)
    assert with_routes == assemble_outputs(ids, lengths, [gen], 0)
    assert with_routes != without
    assert "routed_experts" not in without.as_dict()


_V032 = CapturePlatform(vllm_version=(0, 32), triton=True)


@pytest.mark.parametrize(
    ("platform", "prefix", "kwargs", "env"),
    [
        (CapturePlatform(None, triton=False), None, {}, {}),
        (CapturePlatform((0, 25), triton=False), False, {}, {}),
        (_V032, None, {"enable_prefix_caching": True}, {V2_RUNNER_ENV: "1"}),
        (_V032, True, {"enable_prefix_caching": True}, {V2_RUNNER_ENV: "1"}),
    ],
)
def test_capture_plans_per_vllm_version(
    platform: CapturePlatform, prefix: bool | None, kwargs: dict[str, object], env: dict[str, str]
) -> None:
    plan = plan_capture(platform, prefix)
    assert isinstance(plan, Success)
    assert dict(plan.unwrap().kwargs) == {"enable_return_routed_experts": True, **kwargs}
    assert dict(plan.unwrap().env) == env


@pytest.mark.parametrize(
    ("platform", "prefix", "reason"),
    [
        (CapturePlatform((0, 32), triton=False), None, "needs Triton"),
        (_V032, False, "requires prefix caching"),
        (CapturePlatform((0, 24), triton=True), None, "predates 0.25"),
    ],
)
def test_capture_is_refused_with_the_reason(
    platform: CapturePlatform, prefix: bool | None, reason: str
) -> None:
    plan = plan_capture(platform, prefix)
    assert isinstance(plan, Failure)
    assert reason in plan.failure()


@pytest.mark.parametrize(
    ("expert_field", "experts"),
    [("num_experts", 8), ("n_routed_experts", 6), ("num_local_experts", 4)],
)
def test_the_routing_shape_is_read_from_each_model_familys_expert_count(
    expert_field: str, experts: int
) -> None:
    fields: dict[str, object] = dict.fromkeys(MOE_FIELDS)
    fields.update({"num_hidden_layers": 3, "num_experts_per_tok": 2, expert_field: experts})
    assert moe_shape(fields, "Cfg") == Success(MoeShape(num_layers=3, top_k=2, num_experts=experts))
    fields["num_experts"] = 0  # a dense family's zero is no count: the next name is read
    if expert_field != "num_experts":
        assert moe_shape(fields, "Cfg") == Success(MoeShape(3, 2, experts))


@pytest.mark.parametrize(
    "missing", [{"num_hidden_layers": None}, {"num_experts_per_tok": "2"}, {"num_experts": 0}]
)
def test_a_config_that_does_not_size_routes_is_no_moe_model(missing: dict[str, object]) -> None:
    fields: dict[str, object] = {"num_hidden_layers": 3, "num_experts_per_tok": 2, "num_experts": 8}
    fields.update(missing)
    refused = moe_shape(fields, "LlamaConfig")
    assert isinstance(refused, Failure)
    assert refused.failure() == NotMoe(refused.failure().message, config="LlamaConfig")
    assert "needs an MoE model" in str(refused.failure())
    assert str(refused.failure()).endswith("got LlamaConfig")


def test_a_completions_routes_are_read_only_where_the_engine_returns_them() -> None:
    shape = MoeShape(num_layers=2, top_k=1, num_experts=4)
    raw = [[[0], [3]], [[1], [2]]]  # vLLM's array, as any array-like
    routed = routes_of(types.SimpleNamespace(routed_experts=raw), shape)
    assert routed == RoutedExperts(shape, np.asarray(raw))
    assert routes_of(types.SimpleNamespace(routed_experts=None), shape) is None  # none came
    assert routes_of(types.SimpleNamespace(routed_experts=raw), None) is None  # none asked
