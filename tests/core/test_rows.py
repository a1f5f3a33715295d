"""Per-row checks of a streamed batch: each row succeeds or fails alone, by the rules of
``check_batch``; one row's output in the contract of ``generate``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import AssemblyCase, WildBatch, assembly_cases, wild_batches

from genworker.core.assembly import Generation, assemble_outputs
from genworker.core.batch import BatchError, BatchErrorKind, check_batch
from genworker.core.outputs import NonFiniteLogprobs, check_generation_logprobs
from genworker.core.routing import MoeShape, RoutedExperts, RoutesRefused
from genworker.core.rows import (
    RowChecks,
    RowRefusal,
    assemble_row,
    check_prompts,
    check_rows,
    finished_row,
    uniform_versioned,
    versioned_outputs,
    versioned_row,
)
from genworker.core.versions import (
    NO_VERSION,
    Counted,
    VersionError,
    VersionRuns,
    runs_from_tokens,
)


def _tensors(case: WildBatch) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(case.ids, dtype=torch.int64).reshape(len(case.lengths), case.width)
    return ids, torch.tensor(case.lengths, dtype=torch.int64)


def _checks(case: WildBatch) -> RowChecks:
    ids, lengths = _tensors(case)
    result = check_rows(
        ids,
        lengths,
        pad_token_id=case.pad_token_id,
        vocab_size=case.vocab_size,
        max_model_len=case.max_model_len,
    )
    assert isinstance(result, Success), result
    checks = result.unwrap()
    assert isinstance(checks, RowChecks)
    return checks


@given(wild_batches())
def test_each_row_gets_the_outcome_it_gets_alone(case: WildBatch) -> None:
    ids, lengths = _tensors(case)
    checks = _checks(case)
    prompts = dict(checks.prompts)
    errors = dict(checks.errors)
    assert sorted([*prompts, *errors]) == list(range(len(case.lengths))), "each row once"
    assert list(checks.rows) == sorted(prompts)
    for row in range(len(case.lengths)):
        alone = check_batch(
            ids[row : row + 1],
            lengths[row : row + 1],
            pad_token_id=case.pad_token_id,
            vocab_size=case.vocab_size,
            max_model_len=case.max_model_len,
        )
        if isinstance(alone, Success):
            assert prompts[row] == alone.unwrap().prompts[0]
        else:
            assert errors[row].kind == alone.failure().kind
            assert row in errors[row].rows, "the error names the row by its batch index"


@given(wild_batches())
def test_a_batch_without_bad_rows_is_what_check_batch_says(case: WildBatch) -> None:
    ids, lengths = _tensors(case)
    whole = check_batch(
        ids,
        lengths,
        pad_token_id=case.pad_token_id,
        vocab_size=case.vocab_size,
        max_model_len=case.max_model_len,
    )
    checks = _checks(case)
    if isinstance(whole, Success):
        assert checks.errors == ()
        assert [p for _, p in checks.prompts] == list(whole.unwrap().prompts)
    else:
        assert checks.errors, "check_batch refused a row, so some row fails alone"


def test_rows_breaking_different_rules_are_named_by_their_own_rule() -> None:
    pad = 0
    ids = torch.tensor([[5, 6, 0], [7, 99, 0], [8, 0, 3], [9, 9, 9], [4, 0, 0]])
    lengths = torch.tensor([2, 2, 1, 3, 0])
    checks = check_rows(ids, lengths, pad_token_id=pad, vocab_size=50, max_model_len=3)
    assert isinstance(checks, Success)
    errors = dict(checks.unwrap().errors)
    assert checks.unwrap().prompts == ((0, [5, 6]),)
    assert errors[4].kind is BatchErrorKind.LENGTH
    assert errors[2].kind is BatchErrorKind.PADDING
    assert errors[1].kind is BatchErrorKind.TOKEN_ID
    assert errors[3].kind is BatchErrorKind.MAX_MODEL_LEN
    assert "row 1 position 1 (id 99)" in str(errors[1])
    assert "row 3 (length 3)" in str(errors[3])


def test_a_batch_of_only_bad_rows_has_no_prompts() -> None:
    checks = check_rows(
        torch.zeros((2, 0), dtype=torch.int64), torch.tensor([1, 2]), pad_token_id=0
    )
    assert isinstance(checks, Success)
    assert checks.unwrap().prompts == ()
    assert [r for r, _ in checks.unwrap().errors] == [0, 1]
    every = check_rows(torch.tensor([[1, 2]]), torch.tensor([2]), pad_token_id=0, max_model_len=1)
    assert isinstance(every, Success)
    assert every.unwrap().rows == ()


@pytest.mark.parametrize(
    ("ids", "lengths", "kind"),
    [
        (torch.zeros(3, dtype=torch.int64), torch.tensor([1, 1, 1]), BatchErrorKind.INPUT_IDS),
        (torch.zeros((2, 2), dtype=torch.int64), [1, 1], BatchErrorKind.INPUT_LENGTHS),
        (torch.ones((2, 2), dtype=torch.int64), torch.tensor([1]), BatchErrorKind.BATCH_SIZE),
    ],
)
def test_a_batch_wrong_as_a_whole_is_refused_as_a_whole(
    ids: object, lengths: object, kind: BatchErrorKind
) -> None:
    result = check_rows(ids, lengths, pad_token_id=0)
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, BatchError)
    assert error.kind is kind


@given(assembly_cases())
def test_one_row_output_is_that_row_of_the_batch_output_cut_to_its_length(
    case: AssemblyCase,
) -> None:
    b = case.batch
    whole = assemble_outputs(b.input_ids, b.input_lengths, case.generations, b.pad_token_id)
    for row, generation in enumerate(case.generations):
        one = assemble_row(b.input_ids, b.input_lengths, row, generation, b.pad_token_id)
        end = int(whole.unpadded_sequence_lengths[row])
        assert tuple(one.output_ids.shape) == (1, end)
        assert torch.equal(one.output_ids[0], whole.output_ids[row, :end])
        assert torch.equal(one.logprobs[0], whole.logprobs[row, :end])
        assert one.output_ids.dtype == b.input_ids.dtype
        assert int(one.generation_lengths[0]) == generation.num_tokens
        assert bool(one.truncated[0]) == bool(whole.truncated[row])


def test_one_row_output_of_an_empty_generation_is_its_prompt() -> None:
    ids, lengths = torch.tensor([[3, 4, 0], [5, 0, 0]]), torch.tensor([2, 1])
    one = assemble_row(ids, lengths, 1, Generation([], [], "abort"), 0)
    assert one.output_ids.tolist() == [[5]]
    assert one.unpadded_sequence_lengths.tolist() == [1]


@given(assembly_cases())
def test_versioned_outputs_label_exactly_the_generated_tokens(case: AssemblyCase) -> None:
    """Each generated token carries its version at its position (row ``i``'s ``k``-th
    token sampled under version ``i + k // 2``), every other position NO_VERSION; one
    row's output is that row of the batch's, cut to its length."""
    b = case.batch
    per_row = [[i + k // 2 for k in range(g.num_tokens)] for i, g in enumerate(case.generations)]
    runs = [runs_from_tokens(versions).unwrap() for versions in per_row]
    whole = versioned_outputs(b.input_ids, b.input_lengths, case.generations, runs, b.pad_token_id)
    for row, (generation, versions) in enumerate(zip(case.generations, per_row, strict=True)):
        start = int(b.input_lengths[row])
        labelled = whole["weight_versions"][row].tolist()
        expected = [NO_VERSION] * len(labelled)
        expected[start : start + len(versions)] = versions
        assert labelled == expected
        one = versioned_row(b.input_ids, b.input_lengths, row, generation, runs[row], 0)
        end = int(whole["unpadded_sequence_lengths"][row])
        assert one["weight_versions"].tolist() == [expected[:end]]
        assert torch.equal(one["output_ids"][0], whole["output_ids"][row, :end])


@given(wild_batches())
def test_a_batch_checked_whole_is_check_batch_and_row_by_row_is_check_rows(
    case: WildBatch,
) -> None:
    """``check_prompts``: whole, every row with its prompt and no errors, or check_batch's
    refusal; row by row, exactly check_rows."""
    ids, lengths = _tensors(case)
    limits = {"vocab_size": case.vocab_size, "max_model_len": case.max_model_len}
    pad = case.pad_token_id
    whole = check_prompts(ids, lengths, whole=True, pad_token_id=pad, **limits)
    batch = check_batch(ids, lengths, pad_token_id=pad, **limits)
    if isinstance(batch, Success):
        prompts = tuple(enumerate(batch.unwrap().prompts))
        assert whole == Success(RowChecks(prompts=prompts, errors=()))
    else:
        assert whole == batch
    rows = check_prompts(ids, lengths, whole=False, pad_token_id=pad, **limits)
    assert rows == check_rows(ids, lengths, pad_token_id=pad, **limits)


@given(assembly_cases(), st.integers(0, 7))
def test_uniform_versions_are_the_versioned_outputs_of_one_version(
    case: AssemblyCase, version: int
) -> None:
    """A batch sampled under one version: the contract of ``versioned_outputs`` with
    every row's tokens under that version."""
    b = case.batch
    out = assemble_outputs(b.input_ids, b.input_lengths, list(case.generations), b.pad_token_id)
    runs = [VersionRuns.uniform(version, g.num_tokens) for g in case.generations]
    expected = versioned_outputs(
        b.input_ids, b.input_lengths, case.generations, runs, b.pad_token_id
    )
    got = uniform_versioned(out, version)
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


_MAX_LEN = 8
_SHAPE = MoeShape(num_layers=1, top_k=1, num_experts=2)


def _finished(
    generation: Generation, lengths: tuple[int, int] = (2, 2), counted: Counted | None = None
) -> object:
    checked = check_generation_logprobs(generation, "raw_logprobs", row=3)
    spans = [("0", 0, generation.num_tokens)] if counted is None else None
    return finished_row(
        generation, checked, lengths, row=3, max_model_len=_MAX_LEN, spans=spans, counted=counted
    )


def test_a_finished_row_within_its_contract_comes_back_with_its_versions() -> None:
    """Labelled spans, or the worker's count closed under the version now."""
    generation = Generation([5, 6, 7], [-0.1, -0.2, -0.3], "stop")
    assert _finished(generation) == Success(VersionRuns((0,), (0,), 3))
    counted = Counted(VersionRuns((0,), (0,), 1), 2, 1)
    assert _finished(generation, counted=counted) == Success(VersionRuns((0, 1), (0, 1), 3))


def test_a_finished_row_is_refused_by_the_first_rule_it_breaks_in_generates_words() -> None:
    """Non-finite logprobs, then the context, then the versions, then the routes; the
    refusal reads as ``generate``'s and keeps the core check that refused it."""
    nan = _finished(Generation([5], [float("nan")], "stop"))
    assert isinstance(nan, Failure)
    assert nan.failure().message.startswith("generate: ")
    assert isinstance(nan.failure().cause, NonFiniteLogprobs)
    long = _finished(Generation([5, 6, 7], None, "stop"), lengths=(2, 6))
    assert long == Failure(RowRefusal("row 3 came back longer than max_model_len=8: 6 + 3 tokens"))
    miscounted = _finished(
        Generation([5], None, "stop"), counted=Counted(VersionRuns((), (), 0), 2, 0)
    )
    assert isinstance(miscounted, Failure)
    assert isinstance(miscounted.failure().cause, VersionError)
    assert miscounted.failure().message == str(miscounted.failure().cause)
    routes = RoutedExperts(_SHAPE, np.zeros((1, 1, 1), np.int32))
    misrouted = _finished(Generation([5, 6], None, "stop", routes))
    assert isinstance(misrouted, Failure)
    assert misrouted.failure().message.startswith("generate: ")
    assert isinstance(misrouted.failure().cause, RoutesRefused)
