"""The worker's requests keep their sampled logprobs as arrays (real CPU engine): what
vLLM's own flat logprobs hold, bit for bit, with no object per token; every other request
on the same engine is vLLM's own."""

from __future__ import annotations

import gc
from array import array
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.logprobs import FlatLogprobs

from genworker.core.engine_calls import Cache
from genworker.core.sampling import SamplingSpec
from genworker.shell.sampled_logprobs import MARKER, SampledLogprobs, _keep_ids_as_array, install
from genworker.shell.vllm_engine import VllmEngine, sampling_params

pytestmark = pytest.mark.engine

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _outputs(llm: LLM, params: SamplingParams) -> list[Any]:
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _seeded(**kw: Any) -> SamplingParams:
    args: dict[str, Any] = {"temperature": 1.0, "max_tokens": 6, "seed": 7, "detokenize": False}
    return SamplingParams(**{**args, "logprobs": 0, "flat_logprobs": True, **kw})


def test_the_engine_keeps_the_hook(cpu_engine: VllmEngine) -> None:
    assert cpu_engine.sampled_logprob_arrays


def test_marked_requests_hold_what_vllms_flat_logprobs_hold(
    cpu_engine: VllmEngine, cpu_llm: LLM
) -> None:
    """The same seeded batch, marked and not: the same tokens, each position's sampled
    logprob bit for bit (float32), the same cumulative logprob (summed in vLLM's order)."""
    cpu_engine.reset_cache(Cache.PREFIX)
    theirs = _outputs(cpu_llm, _seeded())
    cpu_engine.reset_cache(Cache.PREFIX)
    ours = _outputs(cpu_llm, _seeded(extra_args={MARKER: True}))
    for mine, vllms in zip(ours, theirs, strict=True):
        assert isinstance(vllms.logprobs, FlatLogprobs)
        assert isinstance(mine.logprobs, SampledLogprobs)
        assert type(vllms.token_ids) is list
        assert type(mine.token_ids) is array
        assert mine.token_ids.typecode == "q"
        assert mine.token_ids.tolist() == vllms.token_ids
        assert mine.logprobs.token_ids.tolist() == list(vllms.token_ids)
        expected = np.asarray(vllms.logprobs.logprobs, dtype=np.float32)
        got = np.frombuffer(mine.logprobs.logprobs, dtype=np.float32)
        assert got.view(np.uint32).tolist() == expected.view(np.uint32).tolist()
        assert mine.cumulative_logprob == vllms.cumulative_logprob


@pytest.mark.parametrize(
    "params",
    [
        _seeded(logprobs=1, extra_args={MARKER: True}),  # the top 1 as well
        _seeded(detokenize=True, extra_args={MARKER: True}),  # text, with decoded tokens
        _seeded(extra_args={MARKER: "yes"}),  # not the marker's value
        _seeded(extra_args={"another": True}),
    ],
    ids=["top-1", "detokenized", "not-true", "unmarked"],
)
def test_other_requests_on_the_engine_are_vllms_own(cpu_llm: LLM, params: SamplingParams) -> None:
    assert all(isinstance(out.logprobs, FlatLogprobs) for out in _outputs(cpu_llm, params))


def test_the_workers_params_are_marked_unless_the_row_needs_text(cpu_engine: VllmEngine) -> None:
    specs = [
        SamplingSpec(temperature=0.0, top_p=1.0, top_k=1, max_tokens=3),
        SamplingSpec(temperature=0.0, top_p=1.0, top_k=1, max_tokens=3, stop=("zz",)),
        SamplingSpec(temperature=0.0, top_p=1.0, top_k=1, max_tokens=3, logprobs=2),
    ]
    params = [cpu_engine.request_params(spec) for spec in specs]
    assert [p.extra_args for p in params] == [{MARKER: True}, None, None]
    assert sampling_params(specs[0], None).extra_args is None  # not asked for


def _objects_kept(llm: LLM, tokens: int, **kw: Any) -> int:
    """The objects a batch of ``tokens`` new tokens a row's completions reach (types and
    modules left out)."""
    outs = _outputs(llm, _seeded(max_tokens=tokens, ignore_eos=True, **kw))
    assert [len(out.token_ids) for out in outs] == [tokens] * len(PROMPTS)
    seen: set[int] = set()
    stack: list[object] = list(outs)
    while stack:
        obj = stack.pop()
        if id(obj) not in seen and not isinstance(obj, (type, ModuleType)):
            seen.add(id(obj))
            stack.extend(gc.get_referents(obj))
    return len(seen)


def test_a_marked_batch_keeps_no_object_per_token(cpu_llm: LLM) -> None:
    """Flat logprobs keep a float per position (and an int for each token id past the
    cached small ones, in the logprobs and in the token ids); the arrays keep none: a
    marked batch's completions reach as many objects with 64 tokens a row as with 16,
    an unmarked one's at least one more per added position."""
    marked = [_objects_kept(cpu_llm, n, extra_args={MARKER: True}) for n in (16, 64)]
    unmarked = [_objects_kept(cpu_llm, n) for n in (16, 64)]
    assert marked[1] == marked[0], marked
    assert unmarked[1] - unmarked[0] >= 48 * len(PROMPTS), unmarked


def test_install_changes_nothing_on_an_engine_of_another_shape() -> None:
    assert not install(SimpleNamespace())
    assert not install(SimpleNamespace(output_processor=SimpleNamespace(request_states=[])))
    assert not install(SimpleNamespace(output_processor=SimpleNamespace(request_states={})))


def test_install_wraps_an_output_processor_once() -> None:
    calls: list[object] = []
    processor = SimpleNamespace(request_states={}, add_request=calls.append)
    engine = SimpleNamespace(output_processor=processor)
    assert install(engine)
    wrapped = processor.add_request
    assert install(engine)
    assert processor.add_request is wrapped
    request = SimpleNamespace(request_id="r", sampling_params=None)
    processor.add_request(request)  # no state: passed on, nothing else
    assert calls == [request]


def test_only_an_empty_no_tokenizer_detokenizer_gets_an_id_array() -> None:
    from vllm.v1.engine import detokenizer as module

    base: Any = module.IncrementalDetokenizer
    detokenizing: Any = type("Detokenizing", (base,), {})
    empty, started, other = base(), base(), detokenizing()
    started.token_ids.append(5)
    for detokenizer in (empty, started, other):
        _keep_ids_as_array(SimpleNamespace(detokenizer=detokenizer))
    _keep_ids_as_array(SimpleNamespace(detokenizer=None))  # a pooling request's state
    assert type(empty.token_ids) is array
    assert empty.token_ids.typecode == "q"
    assert started.token_ids == [5]
    assert type(other.token_ids) is list
