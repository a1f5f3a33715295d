"""The sampled tokens' logprobs kept as two arrays, for the worker's own requests.

Theory of operation
-------------------
With ``logprobs=0`` and flat logprobs, vLLM's output processor turns every step's numpy
arrays (``LogprobsLists``: per new token the sampled token's id, logprob and rank) into
Python objects: three ``tolist`` calls and six list appends per token
(``LogprobsProcessor._update_sample_logprobs`` in vllm/v1/engine/logprobs.py and
``FlatLogprobs.append_fast`` in vllm/logprobs.py, 0.25 and 0.32 alike). A 512 x 256 batch
ends with two live objects per position in its outputs (the logprob float and the
logprob's token id; ranks and indices are cached small ints), about 262,000, and freeing
them was most of the worker's time outside ``LLM.generate`` (8-13 ms of 15-20 ms on the
2-core host, issue 20).

The generated token ids are the same story one level up: without detokenization vLLM's
``IncrementalDetokenizer`` (the base class, vllm/v1/engine/detokenizer.py) only extends a
list with each step's new ids, and that list, one int object per token, is the
``CompletionOutput.token_ids`` the worker reads and then frees.

A request whose ``SamplingParams.extra_args`` holds :data:`MARKER` and that asks for
nothing else (the sampled logprob only, no detokenization, final-only output, ``n=1``)
keeps instead its sampled ids and logprobs in a :class:`SampledLogprobs` (an int64 and a
float32 ``array.array``, no object per token), and its ``CompletionOutput.logprobs`` is
that container (:class:`genworker.core.completions.SampledLogprobs`, where the
conversion reads it). The cumulative logprob is summed as vLLM sums it. When its detokenizer is
that base class with nothing in it yet, its token ids are kept in an int64
``array.array`` as well (``extend`` and ``len`` are all vLLM calls on it for such a
request: the stop-string trimming that edits the list runs only for detokenized rows),
and its ``CompletionOutput.token_ids`` is that array.

The hook belongs to one engine: :func:`install` wraps the ``add_request`` of one
``LLMEngine``'s output processor (an instance attribute: the class and every other engine
are untouched); for a qualifying marked request it turns the request's
``LogprobsProcessor`` into the subclass :data:`_SampledProcessor`, whose only change is
``_update_sample_logprobs``, and replaces the detokenizer's empty list. Every other
request is vLLM's own. ``install`` returns False (and changes nothing) when vLLM does not
have the shape read above; the engine then leaves its requests unmarked and gets flat
logprobs as before. A vLLM whose no-tokenizer detokenizer is not that class keeps its
list of token ids.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from array import array
from collections.abc import Callable
from typing import Protocol

from genworker.core.completions import SampledLogprobs, StepMatrix

__all__ = ["MARKER", "SampledLogprobs", "install"]

#: the ``SamplingParams.extra_args`` key that asks for :class:`SampledLogprobs`
MARKER = "genworker_sampled_logprobs"

# What _update_sample_logprobs reads and writes on vLLM's LogprobsProcessor (a dataclass).
_FIELDS = frozenset({"tokenizer", "logprobs", "cumulative_logprob", "num_logprobs"})


class _Sampled(Protocol):
    """A :data:`_SampledProcessor`, as its ``_update_sample_logprobs`` reads and writes it."""

    logprobs: SampledLogprobs
    cumulative_logprob: float


def _update_sample_logprobs(
    self: _Sampled,
    logprobs_lists: tuple[StepMatrix[int], StepMatrix[float], *tuple[object, ...]],
) -> None:
    """``LogprobsProcessor._update_sample_logprobs`` for a :class:`SampledLogprobs`: the
    sampler puts the sampled token first in each row of the step's arrays."""
    token_ids, logprobs = logprobs_lists[0], logprobs_lists[1]
    self.cumulative_logprob = self.logprobs.append_step(
        token_ids, logprobs, self.cumulative_logprob
    )


def _vllm_class(module: str, name: str) -> type | None:
    """Class ``name`` of ``vllm.v1.engine.<module>``, if this vLLM has it."""
    try:
        found = getattr(importlib.import_module(f"vllm.v1.engine.{module}"), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def _processor_class() -> type | None:
    """vLLM's ``LogprobsProcessor`` class when it has the fields and method read here."""
    cls = _vllm_class("logprobs", "LogprobsProcessor")
    if not (
        dataclasses.is_dataclass(cls)
        and {f.name for f in dataclasses.fields(cls)} >= _FIELDS
        and callable(getattr(cls, "_update_sample_logprobs", None))
    ):
        return None
    return cls


_BASE = _processor_class()
_SampledProcessor: type | None = (
    None
    if _BASE is None
    else type(
        "SampledLogprobsProcessor",
        (_BASE,),
        {"_update_sample_logprobs": _update_sample_logprobs, "__slots__": ()},
    )
)
#: vLLM's ``IncrementalDetokenizer`` class (the one without a tokenizer), if any
_DETOKENIZER = _vllm_class("detokenizer", "IncrementalDetokenizer")


def _keep_ids_as_array(state: object) -> None:
    """The request's generated ids in an int64 array, when its detokenizer is vLLM's
    no-tokenizer one and has taken no id yet; left alone otherwise."""
    detokenizer: object = getattr(state, "detokenizer", None)
    if _DETOKENIZER is None or type(detokenizer) is not _DETOKENIZER:
        return
    token_ids: object = getattr(detokenizer, "token_ids", None)
    if type(token_ids) is list and not token_ids:
        setattr(detokenizer, "token_ids", array("q"))  # noqa: B010 - vLLM's list[int]


def _qualifies(request: object, state: object) -> bool:
    params: object = getattr(request, "sampling_params", None)
    extra: object = getattr(params, "extra_args", None)
    if not (isinstance(extra, dict) and extra.get(MARKER) is True):
        return False
    processor: object = getattr(state, "logprobs_processor", None)
    kind: object = getattr(state, "output_kind", None)
    return (
        type(processor) is _BASE
        and getattr(processor, "num_logprobs", None) == 0
        and getattr(processor, "tokenizer", None) is None
        and getattr(kind, "name", None) == "FINAL_ONLY"
        and getattr(params, "n", None) == 1
    )


def install(llm_engine: object) -> bool:
    """Keep the marked requests' sampled logprobs as arrays in this engine; False (nothing
    changed) when its output processor or vLLM's ``LogprobsProcessor`` is not as read."""
    processor: object = getattr(llm_engine, "output_processor", None)
    states: object = getattr(processor, "request_states", None)
    add: object = getattr(processor, "add_request", None)
    sampled = _SampledProcessor
    if sampled is None or not isinstance(states, dict) or not callable(add):
        return False
    if getattr(add, "_genworker_sampled", False):
        return True  # installed before (an engine handed over twice)
    by_id: dict[object, object] = states

    @functools.wraps(add)
    def add_request(request: object, *args: object, **kwargs: object) -> None:
        add(request, *args, **kwargs)
        state = by_id.get(getattr(request, "request_id", None))
        if _qualifies(request, state):
            kept: object = getattr(state, "logprobs_processor", None)
            kept.__class__ = sampled
            setattr(kept, "logprobs", SampledLogprobs())  # noqa: B010 - vLLM types it its own
            _keep_ids_as_array(state)

    marked: Callable[..., None] = add_request
    marked._genworker_sampled = True  # type: ignore[attr-defined]
    setattr(processor, "add_request", marked)  # noqa: B010 - this engine's alone
    return True
