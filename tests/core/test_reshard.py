"""Laws of the reshard plan: engine shards covered exactly once, trainer ranks send only
what they hold, engine ranks receive exactly their shard, replicas share the reading, and
typed errors naming the parameter and ranks for anything the layouts cannot honour."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import msgspec
import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import ReshardModel, dtensor_trainers, megatron_trainers, reshard_models

from genworker.core.reshard import (
    Box,
    EngineShard,
    LayerKind,
    Problem,
    Replicate,
    ReshardError,
    ReshardPlan,
    Shard,
    ShardPiece,
    SourceShard,
    TrainerLayout,
    VllmLayer,
    VllmParamFacts,
    box_numel,
    bytes_of,
    check_ranks,
    dtensor_layout,
    engine_shards,
    fit_group,
    header_problem,
    intersect,
    megatron_layout,
    outgoing,
    p2p_tags,
    packed_sources,
    parse_refit_info,
    parse_shards,
    plan_digest,
    plan_engine,
    plan_reshard,
    plan_stage,
    prepared_params,
    rank_problems,
    read_header,
    ready_to_receive,
    refit_info,
    refit_info_of,
    sender_problems,
    start_header,
    trainer_header_problem,
    vllm_facts,
    vllm_shard,
)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _engine(model: ReshardModel) -> list[EngineShard]:
    shards = []
    for rank in range(model.engine_tp):
        for facts in model.facts(rank):
            result = vllm_shard(facts)
            assert isinstance(result, Success), result
            shards.append(result.unwrap())
    return shards


def _plan(trainer: list[TrainerLayout], engine: list[EngineShard]) -> ReshardPlan:
    result = plan_reshard(trainer, engine)
    assert isinstance(result, Success), result
    plan: ReshardPlan = result.unwrap()
    return plan


def _error(result: object) -> ReshardError:
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, ReshardError)
    return error


def _sources(model: ReshardModel) -> dict[str, np.ndarray]:
    """Every trainer tensor with distinct values (its flat index + a per-name offset)."""
    out, offset = {}, 0
    for name, shape in model.shapes().items():
        n = int(np.prod(shape))
        out[name] = (np.arange(n, dtype=np.int64) + offset).reshape(shape)
        offset += n
    return out


def _execute(
    plan: ReshardPlan,
    trainer: list[TrainerLayout],
    engine: list[EngineShard],
    full: dict[str, np.ndarray],
) -> tuple[dict[tuple[str, int], np.ndarray], dict[tuple[str, int], np.ndarray]]:
    """Run the copies from each trainer rank's local shard; count writes per element."""
    local = {
        (layout.name, s.rank): full[layout.name][_slices(s.box)]
        for layout in trainer
        for s in layout.shards
    }
    out = {(e.param, e.rank): np.full(e.shape, -1, dtype=np.int64) for e in engine}
    writes = {(e.param, e.rank): np.zeros(e.shape, dtype=np.int64) for e in engine}
    for c in plan.copies:
        src = local[(c.source, c.src_rank)]
        assert all(0 <= a <= b <= d for (a, b), d in zip(c.src_box, src.shape, strict=True))
        out[(c.param, c.dst_rank)][_slices(c.dest_box)] = src[_slices(c.src_box)]
        writes[(c.param, c.dst_rank)][_slices(c.dest_box)] += 1
    return out, writes


def _vllm_reference(
    model: ReshardModel, facts: VllmParamFacts, full: dict[str, np.ndarray]
) -> np.ndarray:
    """The shard vLLM's weight loaders build, written the way they do it (narrow, cat)."""
    tp, r = facts.tp_size, facts.tp_rank
    t = {n: torch.from_numpy(a) for n, a in full.items()}
    if facts.kind is LayerKind.REPLICATED:
        return t[facts.sources[0][0]].numpy()
    if facts.kind is LayerKind.ROW:
        w = t[facts.sources[0][0]]
        size = w.shape[1] // tp
        return w.narrow(1, r * size, size).numpy()
    if facts.kind is LayerKind.MERGED:
        parts = [
            t[n].narrow(0, r * (t[n].shape[0] // tp), t[n].shape[0] // tp) for n, _ in facts.sources
        ]
        return torch.cat(parts).numpy()
    if facts.kind is LayerKind.VOCAB:
        w = t[facts.sources[0][0]]
        padded = -(-w.shape[0] // facts.padding_size) * facts.padding_size
        size = padded // tp
        full_padded = torch.cat(
            [w, torch.full((padded - w.shape[0], *w.shape[1:]), -1, dtype=w.dtype)]
        )
        return full_padded.narrow(0, r * size, size).numpy()
    # QKV, as QKVParallelLinear.weight_loader
    num_heads = facts.num_heads // tp
    if tp >= facts.num_kv_heads:
        num_kv, replicas = 1, tp // facts.num_kv_heads
    else:
        num_kv, replicas = facts.num_kv_heads // tp, 1
    hs = facts.head_size
    q = t["q"].narrow(0, r * num_heads * hs, num_heads * hs)
    kv_rank = r // replicas
    k = t["k"].narrow(0, kv_rank * num_kv * hs, num_kv * hs)
    v = t["v"].narrow(0, kv_rank * num_kv * hs, num_kv * hs)
    return torch.cat([q, k, v]).numpy()


def _check_laws(model: ReshardModel, trainer: list[TrainerLayout]) -> ReshardPlan:
    engine = _engine(model)
    plan = _plan(trainer, engine)
    full = _sources(model)
    out, writes = _execute(plan, trainer, engine, full)
    by_param = {(f.param, f.tp_rank): f for r in range(model.engine_tp) for f in model.facts(r)}
    held = {(t.name, s.rank): s.box for t in trainer for s in t.shards}
    for shard in engine:
        key = (shard.param, shard.rank)
        pad = np.zeros(shard.shape, dtype=bool)
        for box in shard.padding:
            pad[_slices(box)] = True
        # every element written exactly once; padding never written
        assert (writes[key][~pad] == 1).all(), key
        assert (writes[key][pad] == 0).all(), key
        # the values are vLLM's
        expected = _vllm_reference(model, by_param[key], full)
        assert np.array_equal(np.where(pad, -1, out[key]), expected), key
        # an engine rank receives exactly its shard's bytes (less padding)
    for rank in range(model.engine_tp):
        need = sum(
            s.nbytes - sum(box_numel(b) for b in s.padding) * 2 for s in engine if s.rank == rank
        )
        assert plan.bytes_to(rank) == need
    for c in plan.copies:
        # a trainer rank sends only elements it holds
        box = held[(c.source, c.src_rank)]
        assert intersect(c.global_box, box) == c.global_box
        assert box_numel(c.global_box) == box_numel(c.dest_box) > 0
    assert sum(len(v) for v in plan.pairs().values()) == len(plan.copies)
    assert sum(plan.bytes_from(r) for r in {c.src_rank for c in plan.copies}) == sum(
        plan.bytes_to(r) for r in range(model.engine_tp)
    )
    return plan


@given(reshard_models(), st.data())
def test_megatron_trainers_reshard_to_vllm_shards(model: ReshardModel, data: st.DataObject) -> None:
    _check_laws(model, data.draw(megatron_trainers(model)))


@given(reshard_models(), st.data())
def test_dtensor_trainers_reshard_to_vllm_shards(model: ReshardModel, data: st.DataObject) -> None:
    _check_laws(model, data.draw(dtensor_trainers(model)))


@given(st.integers(1, 6), st.integers(1, 6), st.lists(st.integers(1, 9), min_size=1, max_size=3))
def test_a_replicated_tensor_is_read_once_and_shared_across_its_replicas(
    replicas: int, engine_tp: int, dims: list[int]
) -> None:
    shape = (engine_tp * dims[0], *dims[1:])
    layout = megatron_layout("w", shape, "float32", None, [list(range(replicas))]).unwrap()
    engine = [
        vllm_shard(
            VllmParamFacts("w", LayerKind.COLUMN, "float32", r, engine_tp, (("w", shape),))
        ).unwrap()
        for r in range(engine_tp)
    ]
    plan = _plan([layout], engine)
    loads = [plan.bytes_from(r) for r in range(replicas)]
    biggest = max(c.nbytes for c in plan.copies)
    assert max(loads) - min(loads) <= biggest  # greedy: replicas share the reading
    assert sum(loads) == 4 * int(np.prod(shape))  # and read it exactly once in all
    assert len({c.src_rank for c in plan.copies}) == min(replicas, engine_tp)


def test_tp2_reshard_moves_half_of_each_sharded_tensor() -> None:
    model = ReshardModel(
        vocab=32, hidden=8, heads=2, kv_heads=2, head_size=4, intermediate=8, engine_tp=2
    )
    groups = [[0], [1]]
    split = {
        "q": 0,
        "k": 0,
        "v": 0,
        "gate": 0,
        "up": 0,
        "o": 1,
        "down": 1,
        "embed": 0,
        "lm_head": 0,
    }
    trainer = [
        megatron_layout(n, s, "bfloat16", split.get(n), groups).unwrap()
        for n, s in model.shapes().items()
    ]
    plan = _check_laws(model, trainer)
    total = sum(int(np.prod(s)) * 2 for s in model.shapes().values())
    norm = 8 * 2
    assert plan.bytes_to(0) == plan.bytes_to(1) == (total - norm) // 2 + norm
    # trainer and engine split alike: each engine rank reads only from its own trainer rank,
    # except the replicated norm, read once per engine rank
    assert {(c.src_rank, c.dst_rank) for c in plan.copies if c.source != "norm"} == {(0, 0), (1, 1)}


# -- errors ---------------------------------------------------------------------------


@given(reshard_models(), st.data())
def test_a_missing_shard_names_the_parameter_and_the_engine_ranks(
    model: ReshardModel, data: st.DataObject
) -> None:
    trainer = data.draw(megatron_trainers(model))
    victim = data.draw(st.sampled_from(trainer))
    dropped = data.draw(st.sampled_from(victim.shards))
    kept = tuple(s for s in victim.shards if s.rank != dropped.rank)
    damaged = [TrainerLayout(t.name, t.shape, t.dtype, kept) if t is victim else t for t in trainer]
    engine = _engine(model)
    result = plan_reshard(damaged, engine)
    # expected: the engine shards whose pieces need an element no remaining rank holds
    held = np.zeros(victim.shape, dtype=bool)
    for s in kept:
        held[_slices(s.box)] = True
    hurt = {
        (e.param, e.rank)
        for e in engine
        for p in e.pieces
        if p.source == victim.name and not held[_slices(p.source_box)].all()
    }
    if not hurt:
        assert isinstance(result, Success)
        return
    error = _error(result)
    assert {(p.param, p.ranks[0]) for p in error.problems} == hurt
    assert all(p.kind is Problem.MISSING for p in error.problems)
    assert f"{victim.name!r}" in str(error)


def test_a_misshaped_shard_names_the_parameter_and_its_rank() -> None:
    bad = TrainerLayout(
        "w", (4, 4), "float32", (SourceShard(0, ((0, 2), (0, 4))), SourceShard(3, ((2, 5), (0, 4))))
    )
    engine = [
        EngineShard(
            "w", 0, (4, 4), "float32", (ShardPiece("w", ((0, 4), (0, 4)), ((0, 4), (0, 4))),)
        )
    ]
    error = _error(plan_reshard([bad], engine))
    assert error.params(Problem.MISSHAPED) == ("w",)
    assert error.problems[0].ranks == (3,)
    assert "rank 3 holds [(2, 5), (0, 4)], outside the shape [4, 4]" in str(error)
    assert "'w' (misshaped; ranks [3])" in str(error)
    wrong_rank = TrainerLayout("w", (4, 4), "float32", (SourceShard(1, ((0, 4),)),))
    assert _error(plan_reshard([wrong_rank], engine)).problems[0].ranks == (1,)


def test_unknown_sources_mismatched_dtypes_and_bad_engine_shards_are_named() -> None:
    layout = megatron_layout("w", (4, 4), "float32", 0, [[0], [1]]).unwrap()
    piece = ShardPiece("w", ((0, 4), (0, 4)), ((0, 4), (0, 4)))
    cases = [
        (
            EngineShard(
                "p", 5, (4, 4), "float32", (ShardPiece("x", piece.source_box, piece.dest_box),)
            ),
            Problem.UNKNOWN,
            "needs 'x'",
        ),
        (
            EngineShard("p", 5, (4, 4), "bfloat16", (piece,)),
            Problem.MISMATCHED,
            "is float32, the engine shard bfloat16",
        ),
        (
            EngineShard(
                "p", 5, (4, 4), "float32", (ShardPiece("w", ((1, 5), (0, 4)), ((0, 4), (0, 4))),)
            ),
            Problem.MISSHAPED,
            "whose shape is [4, 4]",
        ),
        (EngineShard("p", 5, (4, 4), "float32", (piece, piece)), Problem.MISSHAPED, "overlap"),
        (EngineShard("p", 5, (4, 5), "float32", (piece,)), Problem.MISSHAPED, "cover 16 of its 20"),
        (
            EngineShard(
                "p", 5, (4, 4), "float32", (ShardPiece("w", piece.source_box, ((0, 4), (0, 5))),)
            ),
            Problem.MISSHAPED,
            "outside the shard's shape",
        ),
        (
            EngineShard(
                "p",
                5,
                (2, 8),
                "float32",
                (
                    ShardPiece("w", ((0, 2), (0, 4)), ((0, 2), (0, 4))),
                    ShardPiece("w", ((2, 4), (0, 4)), ((0, 2), (4, 8))),
                ),
            ),
            None,
            "",
        ),
        (
            EngineShard(
                "p", 5, (4, 4), "float32", (ShardPiece("w", ((0, 2), (0, 4)), ((0, 4), (0, 2))),)
            ),
            Problem.MISSHAPED,
            "changes extents",
        ),
    ]
    for shard, kind, needle in cases:
        result = plan_reshard([layout], [shard])
        if kind is None:
            assert isinstance(result, Success)
            continue
        error = _error(result)
        assert kind in {p.kind for p in error.problems}, (needle, error)
        assert needle in str(error)
        assert all(p.param == "p" and p.ranks == (5,) for p in error.problems)


def test_many_problems_are_all_named_and_the_message_cut() -> None:
    engine = [
        EngineShard(f"p{i}", 0, (1,), "float32", (ShardPiece("nowhere", ((0, 1),), ((0, 1),)),))
        for i in range(15)
    ]
    error = _error(plan_reshard([], engine))
    assert error.params(Problem.UNKNOWN) == tuple(f"p{i}" for i in range(15))
    assert "and 3 more" in str(error)


# -- trainer layout builders ----------------------------------------------------------


def test_megatron_layout_refuses_uneven_splits_and_empty_groups() -> None:
    error = _error(megatron_layout("w", (5, 4), "float32", 0, [[0], [1]]))
    assert error.problems[0].kind is Problem.MISSHAPED
    assert error.problems[0].ranks == (0, 1)
    assert "dim 0 of [5, 4] does not split evenly 2 ways" in str(error)
    assert (
        _error(megatron_layout("w", (4,), "float32", 1, [[0]])).problems[0].kind
        is Problem.MISSHAPED
    )
    assert "every TP shard needs a rank" in str(
        _error(megatron_layout("w", (4,), "float32", 0, [[0], []]))
    )
    assert "needs a rank" in str(_error(megatron_layout("w", (4,), "float32", 0, [])))
    assert (
        _error(megatron_layout("w", (4,), "float33", None, [[0]])).problems[0].kind
        is Problem.INVALID
    )


def test_dtensor_layout_follows_torch_chunk_and_nests_shards() -> None:
    layout = dtensor_layout(
        "w", (5, 6), "float32", (2, 2), [3, 1, 0, 2], [Shard(0), Shard(0)]
    ).unwrap()
    boxes = {s.rank: s.box for s in layout.shards}
    # Shard(0) on mesh dim 0: rows [0, 3) and [3, 5); then Shard(0) again inside each
    assert boxes == {
        3: ((0, 2), (0, 6)),
        1: ((2, 3), (0, 6)),
        0: ((3, 4), (0, 6)),
        2: ((4, 5), (0, 6)),
    }
    for rank, box in boxes.items():  # the same as torch.chunk applied twice
        first = torch.arange(5).chunk(2)[[3, 1, 0, 2].index(rank) // 2]
        second = first.chunk(2)[[3, 1, 0, 2].index(rank) % 2]
        assert (box[0][0], box[0][1]) == (int(second[0]), int(second[-1]) + 1)
    empty = dtensor_layout("w", (1,), "float32", (3,), [0, 1, 2], [Shard(0)]).unwrap()
    assert [box_numel(s.box) for s in empty.shards] == [1, 0, 0]
    mixed = dtensor_layout(
        "w", (4, 6), "float32", (2, 3), list(range(6)), [Replicate(), Shard(1)]
    ).unwrap()
    assert {s.rank: s.box for s in mixed.shards}[4] == ((0, 4), (2, 4))


def test_dtensor_layout_refuses_a_bad_mesh_or_placement() -> None:
    for mesh, ranks, places, needle in [
        ((2,), [0], [Shard(0)], "a mesh of shape [2] with 1 ranks"),
        ((2,), [0, 1], [Shard(0), Shard(0)], "2 placements"),
        ((0,), [], [Shard(0)], "a mesh of shape [0]"),
        ((2,), [0, 1], [Shard(2)], "Shard(2) of a 2-d tensor"),
    ]:
        error = _error(dtensor_layout("w", (4, 4), "float32", mesh, ranks, places))
        assert error.problems[0].kind is Problem.INVALID
        assert needle in str(error)


# -- vLLM's split, from plain facts ---------------------------------------------------


def _facts(
    kind: LayerKind,
    sources: tuple[tuple[str, tuple[int, ...]], ...],
    rank: int = 0,
    tp: int = 2,
    **kw: int,
) -> VllmParamFacts:
    return VllmParamFacts("p", kind, "float32", rank, tp, sources, **kw)


def test_vllm_facts_that_no_layer_could_have_are_refused() -> None:
    w = ("w", (4, 4))
    for facts, needle in [
        (_facts(LayerKind.COLUMN, (w,), rank=2), "tp rank 2 of tp size 2"),
        (_facts(LayerKind.COLUMN, (w,), tp=0), "tp rank 0 of tp size 0"),
        (_facts(LayerKind.COLUMN, ()), "made of 0 sources"),
        (_facts(LayerKind.QKV, (w, w)), "made of 2 sources"),
        (_facts(LayerKind.MERGED, (w, ("u", (4,)))), "sources of different ranks"),
        (_facts(LayerKind.COLUMN, (("w", (3, 4)),)), "does not split 2 ways"),
        (_facts(LayerKind.COLUMN, (w,), output_dim=2), "split dim 2"),
        (_facts(LayerKind.ROW, (w,), input_dim=None), "split dim None"),  # type: ignore[arg-type]
        (_facts(LayerKind.MERGED, (w, ("u", (4, 6)))), "does not stack"),
        (_facts(LayerKind.VOCAB, (w,), padding_size=0), "padding size 0"),
        (_facts(LayerKind.VOCAB, (("w", (3, 4)),), tp=2, padding_size=3), "padded vocabulary 3"),
        (_facts(LayerKind.QKV, (w, w, w), head_size=0, num_heads=2, num_kv_heads=2), "heads"),
        (
            _facts(LayerKind.QKV, (w, w, w), tp=4, head_size=2, num_heads=4, num_kv_heads=3),
            "3 kv heads",
        ),
        (
            _facts(LayerKind.QKV, (w, w, w), tp=2, head_size=2, num_heads=2, num_kv_heads=1),
            "q, k, v of 4, 4, 4 rows",
        ),
    ]:
        error = _error(vllm_shard(facts))
        assert error.problems[0].kind is Problem.INVALID
        assert error.problems[0].param == "p"
        assert needle in str(error), (needle, error)


def test_gqa_with_fewer_kv_heads_than_tp_replicates_the_kv_head() -> None:
    q, k, v = ("q", (8 * 2, 4)), ("k", (2 * 2, 4)), ("v", (2 * 2, 4))
    shards = [
        vllm_shard(
            _facts(LayerKind.QKV, (q, k, v), rank=r, tp=4, head_size=2, num_heads=8, num_kv_heads=2)
        ).unwrap()
        for r in range(4)
    ]
    assert all(s.shape == (2 * 2 + 2 + 2, 4) for s in shards)
    k_rows = [next(p.source_box[0] for p in s.pieces if p.source == "k") for s in shards]
    assert k_rows == [(0, 2), (0, 2), (2, 4), (2, 4)]  # ranks 0,1 share kv head 0; 2,3 head 1


def test_vocab_padding_past_the_real_rows_is_padding() -> None:
    shards = [
        vllm_shard(
            _facts(LayerKind.VOCAB, (("e", (10, 3)),), rank=r, tp=4, padding_size=8)
        ).unwrap()
        for r in range(4)
    ]
    assert [s.shape for s in shards] == [(4, 3)] * 4  # 10 rows padded to 16
    assert [s.padding for s in shards] == [(), (), (((2, 4), (0, 3)),), (((0, 4), (0, 3)),)]
    assert [len(s.pieces) for s in shards] == [1, 1, 1, 0]


# --- the rounds of a refit ----------------------------------------------------------


def test_engine_shards_name_what_this_rank_cannot_take_and_unused_sources() -> None:
    column = VllmParamFacts("w", LayerKind.COLUMN, "float32", 0, 1, (("w", (4, 2)),))
    uneven = VllmParamFacts("v", LayerKind.COLUMN, "float32", 0, 1, (("v", (3, 2)),))
    shards, problems = engine_shards([column, uneven], {"w", "v", "x"}, 2, 1)
    assert {(s.param, s.rank) for s in shards} == {("w", 0), ("w", 1)}
    assert len(problems) == 2
    assert "'v'" in problems[0]
    assert problems[1] == "no engine parameter is made of ['v', 'x'] (engine rank 1)"
    assert bytes_of(shards, 1) == 2 * 2 * 4
    assert engine_shards([column], {"w"}, 2, 0)[1] == []


def test_the_header_round_holds_when_the_trainer_planned_this_engines_digest() -> None:
    assert header_problem(3, 0, "abc", {0: "abc"}, 0) == ""
    problem = header_problem(3, 1, "abc", {0: "abd"}, 0)
    assert problem.startswith("engine rank 3 (stage 1) planned another reshard refit")
    assert "digest abc vs None" in header_problem(3, 1, "abc", {}, 2)
    assert trainer_header_problem(1, {0: "abc"}, {0: "abc"}) == ""
    mismatch = trainer_header_problem(1, {0: "abc", 2: "d"}, {0: "abc"})
    assert mismatch.startswith("trainer rank 1 planned another reshard refit than trainer rank 0")


def test_a_trainer_rank_checks_its_shards_against_the_layouts() -> None:
    layouts = [
        megatron_layout(n, (4, 4), "float32", 0, [[0], [1]]).unwrap() for n in ("w", "v", "u")
    ]
    shard = VllmParamFacts("w", LayerKind.COLUMN, "float32", 0, 1, (("w", (4, 4)),))
    plan = plan_reshard(layouts[:1], [vllm_shard(shard).unwrap()]).unwrap()
    local = {"w": ((2, 4), "float32"), "v": ((4, 4), "float32"), "z": ((1,), "float32")}
    problems = sender_problems(1, 2, {0: plan}, layouts, local)
    assert problems == [
        "trainer rank 1's shard of 'v' (for engine ranks []) is [4, 4] float32, the layout "
        "gives [2, 4] float32",
        "trainer rank 1's shard of 'u' (for engine ranks []) is missing",
        "trainer rank 1 sent tensors no layout describes: ['z']",
    ]
    assert "for engine ranks [2]" in sender_problems(1, 2, {0: plan}, layouts, {})[0]
    assert [(peer, c.source) for peer, c in outgoing({0: plan, 3: plan}, 1, 2)] == [
        (2, "w"),
        (5, "w"),
    ]
    assert outgoing({0: plan}, 5, 2) == []  # holds no shard
    assert sender_problems(5, 2, {0: plan}, layouts, {}) == []  # holds no shard


@given(
    ranks=st.lists(st.integers(-3, 9), min_size=1, max_size=4),
    train_ranks=st.integers(1, 6),
)
def test_a_layout_naming_a_rank_outside_the_group_is_named_with_its_ranks(
    ranks: list[int], train_ranks: int
) -> None:
    """Law (issue 44 item 5): a layout is named exactly when one of its shards names a
    trainer rank outside ``0 .. train_ranks - 1``, with those ranks, once."""
    layout = TrainerLayout("w", (4,), "float32", tuple(SourceShard(r, ((0, 4),)) for r in ranks))
    inside = TrainerLayout("v", (4,), "float32", (SourceShard(0, ((0, 4),)),))
    problems = rank_problems([layout, inside], train_ranks)
    outside = sorted({r for r in ranks if not 0 <= r < train_ranks})
    if not outside:
        assert problems == []
        return
    (problem,) = problems
    assert problem.param == "w"
    assert problem.kind is Problem.INVALID
    assert list(problem.ranks) == outside
    assert f"{train_ranks} trainer rank(s)" in problem.describe()


def test_check_ranks_refuses_every_stage_naming_a_rank_outside_the_group() -> None:
    inside = TrainerLayout("v", (4,), "float32", (SourceShard(0, ((0, 4),)),))
    outside = TrainerLayout("w", (4,), "float32", (SourceShard(2, ((0, 4),)),))
    assert check_ranks([[inside], [outside]], 3) == Success(None)
    refused = check_ranks([[inside], [outside]], 2)
    assert isinstance(refused, Failure)
    assert str(refused.failure()) == "reshard refit_info: " + "; ".join(
        pp.describe() for pp in rank_problems([outside], 2)
    )
    assert refused.failure().problems == tuple(rank_problems([outside], 2))


@given(peers=st.lists(st.integers(0, 3), max_size=12))
def test_p2p_tags_number_each_peers_messages_in_order(peers: list[int]) -> None:
    """Law: a message's tag is how many messages to its peer came before it."""
    tagged = p2p_tags([(peer, index) for index, peer in enumerate(peers)])
    assert [(peer, index) for peer, index, _ in tagged] == [(p, i) for i, p in enumerate(peers)]
    assert [tag for *_, tag in tagged] == [peers[:i].count(p) for i, p in enumerate(peers)]


def test_packed_sources_name_a_fused_layers_checkpoint_tensors() -> None:
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert packed_sources("model.layers.0.self_attn.qkv_proj", "weight", packed) == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    assert packed_sources("lm_head", "weight", packed) == ["lm_head.weight"]
    assert packed_sources("qkv_proj", "bias", packed) == [
        "q_proj.bias",
        "k_proj.bias",
        "v_proj.bias",
    ]
    assert packed_sources("", "scale", packed) == [".scale"]


# -- the engine's plans and the refit's wire ------------------------------------------


@given(reshard_models(), st.data())
def test_every_engine_rank_plans_what_the_trainer_plans_from_the_answers(
    model: ReshardModel, data: st.DataObject
) -> None:
    trainer = data.draw(megatron_trainers(model))
    info = refit_info(trainer)
    stages = parse_refit_info(msgspec.json.decode(msgspec.json.encode(info)))
    assert isinstance(stages, Success)
    assert stages.unwrap() == [trainer]
    answers = []
    for rank in range(model.engine_tp):
        planned = plan_engine(model.facts(rank), stages.unwrap(), model.engine_tp, rank)
        assert isinstance(planned, Success), planned
        engine = planned.unwrap()
        assert all(s.rank == rank for s in engine.shards)
        assert engine.manifest.names == tuple(s.param for s in engine.shards)
        assert engine.dtype(engine.shards[0].param) == "bfloat16"
        answers.append({"shards": msgspec.to_builtins(list(engine.shards))})
        # the trainer plans from every rank's answer what each rank planned alone
        shards = parse_shards(answers)
        assert isinstance(shards, Success)
        trainer_plan = plan_stage(trainer, shards.unwrap())
        assert isinstance(trainer_plan, Success)
        if rank == model.engine_tp - 1:
            assert engine.digests == (plan_digest(trainer_plan.unwrap()),)
    digests = {
        plan_engine(model.facts(r), [trainer], model.engine_tp, r).unwrap().digests
        for r in range(model.engine_tp)
    }
    assert len(digests) == 1


def test_a_stage_plans_only_the_shards_its_tensors_start() -> None:
    a = megatron_layout("a", (4,), "float32", None, [[0]]).unwrap()
    b = megatron_layout("b", (4,), "float32", None, [[1]]).unwrap()
    facts = [
        VllmParamFacts("pa", LayerKind.REPLICATED, "float32", 0, 1, (("a", (4,)),)),
        VllmParamFacts("pb", LayerKind.REPLICATED, "float32", 0, 1, (("b", (4,)),)),
    ]
    engine = plan_engine(facts, [[a], [b]], 1, 0).unwrap()
    assert [[c.param for c in plan.copies] for plan in engine.plans] == [["pa"], ["pb"]]
    assert [[c.src_rank for c in plan.copies] for plan in engine.plans] == [[0], [1]]
    assert engine.digests[0] != engine.digests[1]
    # facts of parameters made of nothing described are left out
    other = VllmParamFacts("pc", LayerKind.REPLICATED, "float32", 0, 1, (("c", (4,)),))
    assert plan_engine([*facts, other], [[a], [b]], 1, 0).unwrap() == engine


def test_an_engine_that_cannot_take_the_layouts_is_refused_by_name() -> None:
    a = megatron_layout("a", (4,), "float32", None, [[0]]).unwrap()
    pa = VllmParamFacts("pa", LayerKind.REPLICATED, "float32", 0, 1, (("a", (4,)),))
    unused = plan_engine([pa], [[a, attrs.evolve(a, name="z")]], 1, 0)
    assert isinstance(unused, Failure)
    assert str(unused.failure()).startswith("reshard refit_info: no engine parameter is made")
    bf16 = plan_engine([attrs.evolve(pa, dtype="bfloat16")], [[a]], 1, 0)
    assert isinstance(bf16, Failure)
    assert str(bf16.failure()).startswith("reshard refit: cannot plan the reshard refit")
    assert _error(bf16).params(Problem.MISMATCHED) == ("pa",)
    twice = plan_engine([pa, pa], [[a]], 1, 0)
    assert isinstance(twice, Failure)
    assert "'pa' listed twice" in str(twice.failure())


def test_an_engine_ranks_plan_fits_the_group_or_is_refused_by_its_ranks() -> None:
    a = megatron_layout("a", (4,), "float32", None, [[0]]).unwrap()
    pa = VllmParamFacts("pa", LayerKind.REPLICATED, "float32", 0, 2, (("a", (4,)),))
    pb = attrs.evolve(pa, tp_rank=1)
    shards = [vllm_shard(pa).unwrap(), vllm_shard(pb).unwrap()]
    plan = plan_stage([a], shards).unwrap()
    assert fit_group(plan, 1, 0, 3) == Success(plan)
    too_small = fit_group(plan, 1, 1, 3)
    assert isinstance(too_small, Failure)
    assert str(too_small.failure()) == (
        "engine ranks up to 3 with rank_prefix 1 do not fit a group of 3"
    )
    empty = attrs.evolve(plan, copies=())
    assert fit_group(empty, 1, 2, 3) == Success(empty)


def test_an_engine_ranks_answer_and_readiness_to_receive() -> None:
    a = megatron_layout("a", (4,), "float32", None, [[0]]).unwrap()
    pa = VllmParamFacts("pa", LayerKind.REPLICATED, "float32", 0, 1, (("a", (4,)),))
    engine = plan_engine([pa], [[a]], 1, 0).unwrap()
    assert engine.bytes_to(0) == 16
    assert engine.answer(0, 1) == {
        "tp_rank": 0,
        "digests": list(engine.digests),
        "shards": msgspec.to_builtins(list(engine.shards)),
        "params": 1,
        "bytes": 16,
        "direct": 1,
    }
    assert engine.received(0, 16, 1, 0, 0.5) == {
        "tensors": 1,
        "nbytes": 16,
        "received_bytes": 16,
        "expected_bytes": 16,
        "direct": 1,
        "loaded": 0,
        "seconds": 0.5,
    }
    assert ready_to_receive(1, engine) == Success(engine)
    refusals = {
        (0, engine): "nccl_reshard_refit before init_nccl_reshard_comm_group",
        (1, None): "nccl_reshard_refit before prepare_nccl_reshard_refit_info",
        (2, engine): "2 reshard group(s) for a refit_info of 1 stage(s)",
    }
    for (groups, prepared), message in refusals.items():
        refused = ready_to_receive(groups, prepared)
        assert isinstance(refused, Failure)
        assert str(refused.failure()) == message


def test_stages_map_to_the_sequence_form_and_back() -> None:
    a = megatron_layout("a", (4,), "float32", None, [[0]]).unwrap()
    assert refit_info({1: [a]}) == {"version": 1, "stages": [[], msgspec.to_builtins([a])[0:1]]}
    assert parse_refit_info(refit_info({1: [a]})) == Success([[], [a]])


def test_a_malformed_or_invalid_refit_info_is_refused_by_name() -> None:
    a = megatron_layout("a", (4,), "float32", None, [[0]]).unwrap()
    cases = {
        "malformed reshard refit_info": {"version": 1},
        "reshard refit_info version 9, not 1": {"version": 9, "stages": []},
        "is described twice (stages 0 and 1)": refit_info({0: [a], 1: [a]}),
        "invalid reshard refit_info: 'a' (invalid": refit_info([attrs.evolve(a, dtype="x")]),
    }
    for message, info in cases.items():
        parsed = parse_refit_info(info)
        assert isinstance(parsed, Failure)
        assert message in str(parsed.failure())


def test_answers_that_are_not_shards_are_refused() -> None:
    for answers in ([{"shards": [{"param": 1}]}], [None], [{"params": 3}]):
        parsed = parse_shards(answers)
        assert isinstance(parsed, Failure)
        assert "not an answer of prepare_nccl_reshard_refit_info" in str(parsed.failure())


@given(st.text(max_size=16), st.dictionaries(st.integers(0, 64), st.text(max_size=32)))
def test_the_start_header_reads_back_its_digests(refit_id: str, digests: dict[int, str]) -> None:
    assert read_header(start_header(refit_id, digests)) == Success(digests)


def test_a_malformed_start_header_is_refused() -> None:
    for data in (b"\xc1", msgspec.msgpack.encode({"refit": "x"}), msgspec.msgpack.encode([1])):
        header = read_header(data)
        assert isinstance(header, Failure)
        assert str(header.failure()).startswith("malformed reshard refit header: ")


# -- the facts read off vLLM's layers -------------------------------------------------

_NONE = object()


def _layer(
    layer: str, classes: str, sizes: Mapping[str, object], fused: tuple[int, ...] = ()
) -> VllmLayer:
    def size_of(attr: str, default: int | None) -> int | None:
        value = sizes.get(attr, default)
        return None if value is None or value is _NONE else int(str(value))

    return VllmLayer(layer, frozenset(classes.split()), size_of, fused)


@given(reshard_models(), st.data())
def test_the_facts_read_off_vllms_layers_are_vllms_split(
    model: ReshardModel, data: st.DataObject
) -> None:
    """Layers with vLLM's class names and sizes give the facts of each fused parameter."""
    rank, s = data.draw(st.integers(0, model.engine_tp - 1)), model.shapes()
    tp = {"tp_rank": rank, "tp_size": model.engine_tp}
    h, linear = model.hidden, "LinearBase"
    layers = {
        "embed_tokens": _layer(
            "VocabParallelEmbedding",
            "VocabParallelEmbedding",
            {**tp, "org_vocab_size": model.vocab, "embedding_dim": h, "padding_size": 8},
        ),
        "qkv_proj": _layer(
            "QKVParallelLinear",
            f"QKVParallelLinear ColumnParallelLinear {linear}",
            {
                **tp,
                "input_size": h,
                "head_size": model.head_size,
                "total_num_heads": model.heads,
                "total_num_kv_heads": model.kv_heads,
            },
        ),
        "o_proj": _layer(
            "RowParallelLinear",
            f"RowParallelLinear {linear}",
            {**tp, "input_size": s["o"][1], "output_size": h},
        ),
        "gate_up_proj": _layer(
            "MergedColumnParallelLinear",
            f"MergedColumnParallelLinear {linear}",
            {**tp, "input_size": h},
            (model.intermediate, model.intermediate),
        ),
        "down_proj": _layer(
            "RowParallelLinear",
            f"RowParallelLinear {linear}",
            {**tp, "input_size": model.intermediate, "output_size": h},
        ),
        "norm": _layer("RMSNorm", "RMSNorm CustomOp", {}),
    }
    subs = {
        "embed_tokens": ["embed"],
        "qkv_proj": ["q", "k", "v"],
        "o_proj": ["o"],
        "gate_up_proj": ["gate", "up"],
        "down_proj": ["down"],
        "norm": ["norm"],
    }
    expected = {f.param: f for f in model.facts(rank)}
    for param, layer in layers.items():
        shape = s["norm"] if param == "norm" else (0,)  # a repacked weight: read from sizes
        found = vllm_facts(layer, param, "weight", (shape, "bfloat16", None, None), subs[param])
        want = expected[param]
        if param == "norm":  # replicated: the parameter itself, on every rank at tp 1
            want = attrs.evolve(want, sources=(("norm", s["norm"]),), tp_rank=0, tp_size=1)
        if param == "embed_tokens":  # the checkpoint names an embedding as the model does
            want = attrs.evolve(want, sources=((param, s["embed"]),))
        assert found == Success(want)


def test_a_linear_layers_bias_and_a_plain_linear_layer_are_split_as_vllm_does() -> None:
    sizes = {"tp_rank": 1, "tp_size": 2, "input_size": 8, "output_size": 6}
    param = ((3,), "float32", 0, None)
    row = vllm_facts(
        _layer("R", "RowParallelLinear LinearBase", sizes), "o.bias", "bias", param, ["o.bias"]
    )
    assert row.unwrap().kind is LayerKind.REPLICATED  # a row-parallel bias is whole
    assert row.unwrap().sources == (("o.bias", (6,)),)
    column = vllm_facts(
        _layer("C", "ColumnParallelLinear LinearBase", sizes),
        "c.weight",
        "weight",
        ((3, 8), "float32", 0, 1),
        ["c.weight"],
    )
    assert column.unwrap().kind is LayerKind.COLUMN
    assert column.unwrap().sources == (("c.weight", (6, 8)),)
    plain = vllm_facts(
        _layer("L", "ReplicatedLinear LinearBase", sizes),
        "l.weight",
        "weight",
        ((6, 8), "float32", 1, 0),
        ["l.weight"],
    )
    assert plain.unwrap().kind is LayerKind.REPLICATED
    assert (plain.unwrap().output_dim, plain.unwrap().input_dim) == (1, 0)


def test_a_layer_without_a_size_its_split_needs_is_named() -> None:
    param = ((4, 4), "bfloat16", None, None)
    missing = vllm_facts(
        _layer("Odd", "ColumnParallelLinear LinearBase", {"output_size": 4}),
        "x.weight",
        "weight",
        param,
        ["x.weight"],
    )
    assert missing == Failure(ReshardError("Odd has no 'input_size': no reshard layout"))
    unset = vllm_facts(
        _layer(
            "V",
            "VocabParallelEmbedding",
            {"org_vocab_size": 4, "embedding_dim": 4, "tp_rank": _NONE},
        ),
        "e.weight",
        "weight",
        param,
        ["e.weight"],
    )
    assert unset == Failure(ReshardError("V has no 'tp_rank': no reshard layout"))


def test_the_reshard_plans_parameters_are_the_most_any_engine_worker_planned() -> None:
    assert prepared_params([{"params": 3}, {"params": 5}, {}, "noise"]) == 5
    assert prepared_params([{}]) == 0
    assert prepared_params([]) == 0


def test_a_reshard_refit_info_is_a_mapping() -> None:
    """``refit_info_of``: the trainer's mapping is taken as it is; anything else refused
    naming it."""
    info: dict[str, object] = {"layouts": []}
    assert refit_info_of(info) == Success(info)
    refused = refit_info_of(["layouts"])
    assert isinstance(refused, Failure)
    assert refused.failure().message.endswith("returns), got ['layouts']")
