"""Laws of the engine ports' values (``genworker.core.engine_calls``): a batch's rows agree,
or it is refused naming the input that disagrees."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import sampling_specs

from genworker.core.engine_calls import (
    REFIT_METHODS,
    BatchShapeError,
    Cache,
    EngineBatch,
    RowRequest,
    RpcCall,
    batch_shape_error,
    engine_batch,
    is_refit_method,
    text_refusal,
)
from genworker.core.sampling import SamplingSpec

prompts_st = st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=4), max_size=6)
counts_st = st.integers(1, 4)


@st.composite
def aligned(
    draw: st.DrawFn,
) -> tuple[list[list[int]], list[SamplingSpec], list[str | None] | None, list[int] | None]:
    prompts = draw(prompts_st)
    n = len(prompts)
    spec = draw(sampling_specs)
    media = draw(st.none() | st.lists(st.none() | st.just("img"), min_size=n, max_size=n))
    samples = draw(st.none() | st.lists(counts_st, min_size=n, max_size=n))
    return prompts, [spec] * n, media, samples


@given(aligned())
def test_aligned_rows_make_a_batch_that_keeps_them(
    case: tuple[list[list[int]], list[SamplingSpec], list[str | None] | None, list[int] | None],
) -> None:
    prompts, specs, media, samples = case
    made = engine_batch(prompts, specs, media, samples)
    assert isinstance(made, Success)
    batch = made.unwrap()
    assert list(batch.prompts) == prompts
    assert list(batch.specs) == specs
    assert batch.media == (None if media is None else tuple(media))
    assert batch.row_media() == (tuple(media) if media is not None else (None,) * len(prompts))
    assert batch.samples == (None if samples is None else tuple(samples))
    assert batch.completions == (len(prompts) if samples is None else sum(samples))
    assert batch == EngineBatch(batch.prompts, batch.specs, batch.media, batch.samples)


@given(
    aligned(),
    st.sampled_from(["specs", "media", "samples"]),
    st.integers(-3, 3).filter(bool),
    sampling_specs,
)
def test_a_row_count_that_disagrees_is_refused_naming_the_input(
    case: tuple[list[list[int]], list[SamplingSpec], list[str | None] | None, list[int] | None],
    field: str,
    delta: int,
    spec: SamplingSpec,
) -> None:
    prompts, specs, media, samples = case
    n = len(prompts)
    count = max(0, n + delta)
    if count == n:
        count = n + 1
    if field == "specs":
        specs = [spec] * count
    elif field == "media":
        media = [None] * count
    else:
        samples = [1] * count
    refused = engine_batch(prompts, specs, media, samples)
    assert isinstance(refused, Failure)
    problem = refused.failure()
    assert isinstance(problem, BatchShapeError)
    assert (problem.field, problem.count, problem.prompts) == (field, count, n)
    assert problem.message == f"{n} prompts but {count} {field}"
    with pytest.raises(ValueError, match=f"EngineBatch: {n} prompts but {count} {field}"):
        EngineBatch(
            tuple(prompts),
            tuple(specs),
            None if media is None else tuple(media),
            None if samples is None else tuple(samples),
        )


@given(st.lists(st.integers(-3, 3), min_size=1, max_size=6))
def test_a_sample_count_below_one_is_refused(samples: list[int]) -> None:
    n = len(samples)
    problem = batch_shape_error(n, n, None, samples)
    low = [s for s in samples if s < 1]
    if not low:
        assert problem is None
        return
    assert problem is not None
    assert (problem.field, problem.count, problem.prompts) == ("samples", len(low), n)
    assert problem.message == f"sample counts {low} are below 1"


@given(st.text(max_size=8), st.lists(st.integers(0, 50), max_size=4), sampling_specs)
def test_a_request_and_an_rpc_keep_what_they_were_given(
    request_id: str, prompt: list[int], spec: SamplingSpec
) -> None:
    request: RowRequest[str] = RowRequest(request_id, prompt, spec)
    assert (request.request_id, request.prompt, request.spec, request.media) == (
        request_id,
        prompt,
        spec,
        None,
    )
    call = RpcCall("report_device_id", timeout=5.0)
    assert (call.method, call.args, call.kwargs, call.timeout) == (
        "report_device_id",
        (),
        None,
        5.0,
    )


def test_refit_methods_are_the_table_and_nemo_rls_wire() -> None:
    """A failed RPC to one of these says the weights may be inconsistent; to any other
    method (``report_device_id``, ``refit_configure``) it says nothing about them."""
    assert all(is_refit_method(m) for m in REFIT_METHODS)
    assert is_refit_method("nemo_rl_update_weights_via_ipc_zmq")
    assert not is_refit_method("report_device_id")
    assert not is_refit_method("refit_configure")


def test_a_cache_is_named_as_the_worker_counts_it_and_reset_as_vllm_names_the_call() -> None:
    assert [str(c) for c in Cache] == ["prefix", "mm", "encoder"]
    assert Cache("mm") is Cache.MM  # the spine's names are the values
    assert [c.call for c in Cache] == [
        "reset_prefix_cache",
        "reset_mm_cache",
        "reset_encoder_cache",
    ]
    assert [c.label for c in Cache] == ["prefix cache", "multimodal cache", "encoder cache"]
    assert Cache.PREFIX.kept == "reset_prefix_cache: vLLM kept the cache (requests running)"


@given(st.lists(sampling_specs, max_size=5), st.none() | st.lists(counts_st, max_size=5))
def test_a_text_call_takes_detokenizing_specs_one_sample_each(
    specs: list[SamplingSpec], samples: list[int] | None
) -> None:
    problem = text_refusal(specs, samples)
    untexted = [row for row, spec in enumerate(specs) if not spec.detokenize]
    if untexted:
        assert problem is not None
        assert f"rows {untexted} have detokenize=False" in problem
    elif samples is not None:
        assert problem == f"generate_text: sample counts {tuple(samples)}: one text a prompt"
    else:
        assert problem is None
