"""Laws of output assembly (NeMo-RL's ``GenerationOutputSpec``) and its documented cases."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from hypothesis import given
from strategies import AssemblyCase, assembly_cases, generations, st

from genworker.core.assembly import (
    FINISH_REASONS,
    FlatGenerations,
    Generation,
    GenerationOutputs,
    assemble_flat_outputs,
    assemble_outputs,
    flatten_generations,
    generated_ids,
    place_rows,
)

_NEMO_RL_KEYS = {
    "output_ids",
    "logprobs",
    "generation_lengths",
    "unpadded_sequence_lengths",
    "truncated",
}


def _load_bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "bench_assembly.py"
    spec = importlib.util.spec_from_file_location("bench_assembly", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_assembly", module)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _assemble(case: AssemblyCase) -> GenerationOutputs:
    batch = case.batch
    return assemble_outputs(
        batch.input_ids, batch.input_lengths, case.generations, batch.pad_token_id
    )


@given(assembly_cases())
def test_generated_ids_read_back_each_rows_generation(case: AssemblyCase) -> None:
    out = _assemble(case)
    got = generated_ids(out.as_dict(), case.batch.input_lengths)
    assert got == [g.token_ids.tolist() for g in case.generations]


@given(assembly_cases())
def test_shapes_and_dtypes_follow_the_contract(case: AssemblyCase) -> None:
    out = _assemble(case)
    rows, width = case.batch.input_ids.shape
    longest = max((g.num_tokens for g in case.generations), default=0)
    expected_shape = (rows, width + longest) if rows else (0, 0)
    assert tuple(out.output_ids.shape) == expected_shape
    assert out.output_ids.dtype == case.batch.input_ids.dtype
    assert tuple(out.logprobs.shape) == expected_shape
    assert out.logprobs.dtype == torch.float32
    for vector, dtype in (
        (out.generation_lengths, torch.int64),
        (out.unpadded_sequence_lengths, torch.int64),
        (out.truncated, torch.bool),
    ):
        assert tuple(vector.shape) == (rows,)
        assert vector.dtype == dtype
    assert set(out.as_dict()) == _NEMO_RL_KEYS


@given(assembly_cases())
def test_each_row_is_prompt_then_generation_then_padding(case: AssemblyCase) -> None:
    out = _assemble(case)
    pad = case.batch.pad_token_id
    ids: list[list[int]] = out.output_ids.tolist()
    for row, prompt, generation in zip(ids, case.batch.prompts, case.generations, strict=True):
        tokens = [int(t) for t in generation.token_ids]
        end = len(prompt) + len(tokens)
        assert row[: len(prompt)] == prompt
        assert row[len(prompt) : end] == tokens
        assert row[end:] == [pad] * (len(row) - end)


@given(assembly_cases())
def test_logprobs_sit_on_the_generated_span_and_are_zero_elsewhere(case: AssemblyCase) -> None:
    out = _assemble(case)
    for i, (prompt, generation) in enumerate(
        zip(case.batch.prompts, case.generations, strict=True)
    ):
        start, end = len(prompt), len(prompt) + generation.num_tokens
        row = out.logprobs[i].numpy()
        expected = (
            np.zeros(generation.num_tokens, dtype=np.float32)
            if generation.logprobs is None
            else generation.logprobs.astype(np.float32)
        )
        assert np.array_equal(row[start:end], expected)
        assert not row[:start].any()
        assert not row[end:].any()


@given(assembly_cases())
def test_lengths_and_truncation_per_row(case: AssemblyCase) -> None:
    out = _assemble(case)
    generated = [g.num_tokens for g in case.generations]
    assert out.generation_lengths.tolist() == generated
    assert out.unpadded_sequence_lengths.tolist() == [
        len(p) + g for p, g in zip(case.batch.prompts, generated, strict=True)
    ]
    assert out.truncated.tolist() == [g.finish_reason == "length" for g in case.generations]


@given(assembly_cases(), st.randoms(use_true_random=False))
def test_row_order_is_preserved(case: AssemblyCase, rnd: random.Random) -> None:
    batch = case.batch
    order = list(range(batch.input_ids.shape[0]))
    rnd.shuffle(order)
    index = torch.tensor(order, dtype=torch.long)
    shuffled = assemble_outputs(
        batch.input_ids[index],
        batch.input_lengths[index],
        [case.generations[i] for i in order],
        batch.pad_token_id,
    )
    original = _assemble(case).as_dict()
    for key, tensor in shuffled.as_dict().items():
        assert torch.equal(tensor, original[key][index] if len(order) else original[key])


@given(assembly_cases())
def test_list_and_numpy_generations_assemble_alike(case: AssemblyCase) -> None:
    as_lists = [
        Generation(
            g.token_ids.tolist(),
            None if g.logprobs is None else g.logprobs.tolist(),
            g.finish_reason,
        )
        for g in case.generations
    ]
    batch = case.batch
    assert _assemble(case) == assemble_outputs(
        batch.input_ids, batch.input_lengths, as_lists, batch.pad_token_id
    )
    assert _assemble(case) == assemble_flat_outputs(
        batch.input_ids,
        batch.input_lengths,
        flatten_generations(case.generations),
        batch.pad_token_id,
    )


@given(assembly_cases().filter(lambda c: c.batch.input_ids.shape[0] > 0))
def test_matches_nemo_rl_per_token_loop(case: AssemblyCase) -> None:
    outputs = [
        bench.RequestOutput(
            [
                bench.Completion(
                    g.token_ids.tolist(),
                    None
                    if g.logprobs is None
                    else [
                        {t: bench.Logprob(lp)}
                        for t, lp in zip(g.token_ids.tolist(), g.logprobs.tolist(), strict=True)
                    ],
                    g.finish_reason,
                )
            ]
        )
        for g in case.generations
    ]
    batch = case.batch
    expected = bench.baseline_assemble(
        batch.input_ids, batch.input_lengths, outputs, batch.pad_token_id
    )
    got = _assemble(case).as_dict()
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype
        assert torch.equal(got[key], tensor), key


def test_benchmark_instance_matches_the_baseline() -> None:
    inputs = bench.make_inputs(batch=6, width=8, max_generation=10, seed=3)
    expected = bench.baseline_assemble(
        inputs.input_ids, inputs.input_lengths, inputs.outputs, bench.PAD
    )
    got = bench.ours_assemble(inputs)
    assert set(got) == set(expected) == _NEMO_RL_KEYS
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype
        assert torch.equal(got[key], tensor), key


@pytest.mark.parametrize("width", [0, 5])
def test_empty_batch_gives_empty_tensors_of_the_documented_dtypes(width: int) -> None:
    out = assemble_outputs(
        torch.zeros((0, width), dtype=torch.int32), torch.zeros(0, dtype=torch.long), [], 0
    )
    assert out.output_ids.shape == (0, 0)
    assert out.output_ids.dtype == torch.int32
    assert out.logprobs.shape == (0, 0)
    assert out.logprobs.dtype == torch.float32
    assert out.generation_lengths.dtype == out.unpadded_sequence_lengths.dtype == torch.long
    assert out.truncated.dtype == torch.bool
    assert out.truncated.shape == (0,)


def test_generated_tokens_overwrite_the_input_padding() -> None:
    ids = torch.tensor([[7, 0, 0], [7, 8, 9]])
    out = assemble_outputs(
        ids,
        torch.tensor([1, 3]),
        [Generation([5, 6], [-0.5, -1.5], "length"), Generation([4], None, "stop")],
        pad_token_id=0,
    )
    assert out.output_ids.tolist() == [[7, 5, 6, 0, 0], [7, 8, 9, 4, 0]]
    assert out.logprobs.tolist() == [[0.0, -0.5, -1.5, 0.0, 0.0], [0.0] * 5]
    assert out.unpadded_sequence_lengths.tolist() == [3, 4]
    assert out.truncated.tolist() == [True, False]


def test_garbage_after_the_length_becomes_padding() -> None:
    out = assemble_outputs(
        torch.tensor([[7, 3, 3]]), torch.tensor([1]), [Generation([], None, "abort")], 0
    )
    assert out.output_ids.tolist() == [[7, 0, 0]]


# --- Generation ---


@given(generations())
def test_generation_holds_one_dimensional_arrays(generation: Generation) -> None:
    assert generation.token_ids.ndim == 1
    assert generation.token_ids.dtype.kind == "i"
    assert generation.num_tokens == generation.token_ids.shape[0]
    if generation.logprobs is not None:
        assert generation.logprobs.shape == generation.token_ids.shape
        assert generation.logprobs.dtype.kind == "f"
    assert generation.finish_reason in FINISH_REASONS


def test_generation_keeps_numpy_arrays_without_copying() -> None:
    tokens = np.array([1, 2], dtype=np.int64)
    logprobs = np.array([-1.0, -2.0], dtype=np.float32)
    generation = Generation(tokens, logprobs, "stop")
    assert generation.token_ids is tokens
    assert generation.logprobs is logprobs
    narrow = Generation(np.array([1, 2], dtype=np.int32), np.array([-1.0, 0.0]), "stop")
    assert narrow.token_ids.dtype == np.int64
    assert narrow.logprobs is not None
    assert narrow.logprobs.dtype == np.float32


def test_generation_equality_compares_values() -> None:
    assert Generation([1, 2], [-1.0, 0], "stop") == Generation(
        np.array([1, 2]), np.array([-1.0, 0.0]), "stop"
    )
    assert Generation([0], [0], "stop") == Generation([0], [0.0], "stop")
    assert Generation([], [], "stop") == Generation(
        np.array([], dtype=np.int64), np.array([], dtype=np.float32), "stop"
    )
    assert Generation([], [], "stop") != Generation([], None, "stop")
    assert Generation([], None, "stop") == Generation([], None, "stop")
    assert Generation([1], None, "stop") != Generation([1], [-1.0], "stop")
    assert Generation([1], None, "stop") != Generation([1], None, "length")


@pytest.mark.parametrize(
    ("token_ids", "logprobs", "reason", "match"),
    [
        ([1, 2], [-1.0], "stop", "2 token ids but 1 logprobs"),
        ([1], None, "eos", "finish_reason must be one of"),
        ([1], None, None, "finish_reason must be one of"),
        ([1.5], None, "stop", "sequence of ints"),
        ([True], None, "stop", "sequence of ints"),
        (np.zeros((1, 2), dtype=np.int64), None, "stop", "shape \\(1, 2\\)"),
        ([1], ["a"], "stop", "sequence of floats"),
        ([1], np.array([-1], dtype=np.int64), "stop", "sequence of floats"),
    ],
)
def test_broken_engine_contracts_raise_at_construction(
    token_ids: object, logprobs: object, reason: object, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        Generation(token_ids, logprobs, reason)  # type: ignore[arg-type]


# --- FlatGenerations and GenerationOutputs invariants ---


def _flat(**changes: object) -> FlatGenerations:
    fields: dict[str, object] = {
        "token_ids": np.array([1, 2, 3], dtype=np.int64),
        "logprobs": np.zeros(3, dtype=np.float32),
        "lengths": np.array([2, 1], dtype=np.int64),
        "truncated": np.array([False, True]),
    }
    fields.update(changes)
    return FlatGenerations(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"token_ids": np.array([1, 2, 3], dtype=np.int32)}, "token_ids must be 1-D int64"),
        ({"logprobs": np.zeros((3, 1), dtype=np.float32)}, "logprobs must be 1-D float32"),
        ({"lengths": np.array([3, 1], dtype=np.int64)}, "lengths summing to 4"),
        ({"truncated": np.array([True])}, "1 truncated and 2 aborted flags for 2 rows"),
        ({"aborted": np.array([True])}, "2 truncated and 1 aborted flags for 2 rows"),
        ({"aborted": np.array([0, 1], dtype=np.int64)}, "aborted must be 1-D bool"),
        ({"lengths": np.array([4, -1], dtype=np.int64)}, "inconsistent"),
    ],
)
def test_flat_generations_refuse_inconsistent_arrays(
    changes: dict[str, object], match: str
) -> None:
    assert _flat().batch_size == 2
    with pytest.raises(ValueError, match=match):
        _flat(**changes)


_EMPTY_ROW = Generation((), (), "stop")  # a row never sent: neither truncated nor aborted


@given(st.lists(st.tuples(st.booleans(), generations(with_logprobs=True)), max_size=8))
def test_placed_rows_equal_the_batch_with_empty_rows_flattened(
    rows: list[tuple[bool, Generation]],
) -> None:
    # Law: placing the kept rows' flat batch at their positions gives what flattening the
    # whole batch (every other row empty, not truncated) gives.
    kept = [i for i, (keep, _) in enumerate(rows) if keep]
    made = flatten_generations([rows[i][1] for i in kept])
    placed = place_rows(made, kept, len(rows))
    assert placed == flatten_generations([g if keep else _EMPTY_ROW for keep, g in rows])
    assert placed.token_ids is made.token_ids  # shared, not copied


@given(assembly_cases(non_finite=True))
def test_non_finite_logprobs_pass_through_flattening_and_assembly_bit_for_bit(
    case: AssemblyCase,
) -> None:
    # Law: assembly neither hides nor invents a non-finite value: the checks in
    # genworker.core.outputs see exactly what the trainer would.
    flat = flatten_generations(case.generations)
    assert flat == flatten_generations(case.generations)  # NaN equals NaN in a value
    out = _assemble(case)
    generated = out.logprobs.numpy()
    spans = [
        generated[i, len(p) : len(p) + g.num_tokens]
        for i, (p, g) in enumerate(zip(case.batch.prompts, case.generations, strict=True))
    ]
    joined = np.concatenate(spans) if spans else np.empty(0, dtype=np.float32)
    assert joined.view(np.uint32).tolist() == flat.logprobs.view(np.uint32).tolist()
    assert np.isfinite(out.logprobs.numpy()).sum() == out.logprobs.numel() - int(
        (~np.isfinite(flat.logprobs)).sum()
    )


@pytest.mark.parametrize(
    ("rows", "batch"),
    [([0], 2), ([0, 1, 2], 3), ([1, 1], 3), ([2, 1], 3), ([-1, 0], 2), ([0, 2], 2)],
    ids=["too-few", "too-many", "repeated", "decreasing", "negative", "past-the-end"],
)
def test_place_rows_refuses_positions_that_do_not_fit(rows: list[int], batch: int) -> None:
    with pytest.raises(ValueError, match=r"place_rows needs 2 strictly increasing rows"):
        place_rows(_flat(), rows, batch)


def test_outputs_refuse_mismatched_tensors() -> None:
    good = assemble_outputs(
        torch.tensor([[1]]), torch.tensor([1]), [Generation([2], None, "stop")], 0
    )
    with pytest.raises(ValueError, match="GenerationOutputs needs"):
        GenerationOutputs(
            output_ids=good.output_ids,
            logprobs=good.logprobs.double(),
            generation_lengths=good.generation_lengths,
            unpadded_sequence_lengths=good.unpadded_sequence_lengths,
            truncated=good.truncated,
        )
    with pytest.raises(ValueError, match="GenerationOutputs needs"):
        GenerationOutputs(
            output_ids=good.output_ids.flatten(),
            logprobs=good.logprobs,
            generation_lengths=good.generation_lengths,
            unpadded_sequence_lengths=good.unpadded_sequence_lengths,
            truncated=good.truncated,
        )


@pytest.mark.parametrize(
    ("input_ids", "input_lengths", "count", "match"),
    [
        (torch.tensor([1, 2]), torch.tensor([2]), 1, "input_ids \\(B, P\\)"),
        (torch.tensor([[1, 2]]), torch.tensor([[2]]), 1, "input_ids \\(B, P\\)"),
        (torch.tensor([[1, 2]]), torch.tensor([2]), 2, "2 generations for a batch of 1"),
        (torch.tensor([[1, 2]]), torch.tensor([3]), 1, "outside \\[0, 2\\]"),
        (torch.tensor([[1, 2]]), torch.tensor([-1]), 1, "run check_batch first"),
    ],
)
def test_assembly_refuses_inputs_it_cannot_place(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, count: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        assemble_outputs(input_ids, input_lengths, [Generation([5], None, "stop")] * count, 0)
