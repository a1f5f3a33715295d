"""Sampling specs: what one request asks vLLM's ``SamplingParams`` for, as a plain value.

Theory of operation
-------------------
A :class:`SamplingSpec` is built from the worker config and the call (NeMo-RL
``_build_sampling_params``): temperature, top_p, top_k, stop_token_ids, bad_words and
ignore_eos come from the config; ``greedy`` overrides them with temperature 0, top_k 1 and
top_p 1 (vLLM itself treats temperature below 1e-5 as greedy and resets top_p/top_k, see
``SamplingParams.__post_init__`` in ``vllm/sampling_params.py``, 0.32); ``max_tokens`` comes
from :mod:`genworker.core.caps` and ``stop`` from :mod:`genworker.core.stops`. ``logprobs=0``
asks for the sampled token's logprob only, and ``include_stop_str_in_output=True`` keeps the
matched stop string in the text (as NeMo-RL does; with False vLLM holds output back by the
longest stop string, vllm#11089).

Only rows that need text ask vLLM to detokenize. By default vLLM turns every sampled
token, and every logprob entry, into text on the engine's host thread (the incremental
detokenizer and ``LogprobsProcessor`` of vllm/v1/engine/output_processor.py and
vllm/v1/engine/logprobs.py, 0.32); an RL rollout reads token ids and logprobs only.
``detokenize`` defaults to "the row has stop strings" (vLLM matches stop strings on the
text, and ``SamplingParams._verify_args`` refuses stop strings without detokenization);
:func:`sampling_spec` turns it on for every row when ``text`` is asked for
(``generate_text``). Stop token ids, EOS and ``max_tokens`` are checked on token ids in
the engine core (``check_stop`` in vllm/v1/core/sched/utils.py), so a row without stop
strings generates the same tokens and logprobs either way.

Stop token ids index vLLM's logits (failure-modes.md G6: vllm#54195, an id past the vocab
crashes the engine or writes out of bounds on some backends), and the vocabulary is known
only once the engine runs: :func:`check_stop_token_ids` refuses the config's ids at or past
the engine's ``vocab_size`` when the worker loads, before any request.

The invariants vLLM checks in ``SamplingParams._verify_args`` are checked here at construction
(older pinned versions lack some of them), so a bad spec is a programming error raised where
it is built, not a request error deep in the engine.

Rows whose specs are equal share one ``SamplingParams``: :func:`group_specs` groups a batch's
specs in first-seen order. :meth:`SamplingSpec.as_kwargs` gives the keyword arguments; the
shell passes the installed vLLM's field names as ``known`` so newer fields (``flat_logprobs``)
are dropped on versions without them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs
from returns.result import Failure, Result, Success

from genworker.core.config import ConfigError, ConfigProblem
from genworker.core.lora import LoraRef

__all__ = [
    "GREEDY_BELOW",
    "SamplingDefaults",
    "SamplingSpec",
    "SpecGroup",
    "check_stop_token_ids",
    "group_specs",
    "sampling_spec",
]

#: vLLM samples a request greedily below this temperature (``_SAMPLING_EPS`` of
#: vllm/sampling_params.py, 0.32)
GREEDY_BELOW = 1e-5


class SamplingDefaults(Protocol):
    """The part of the worker config a sampling spec is built from
    (``genworker.core.config.WorkerConfig`` satisfies it)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def stop_token_ids(self) -> Sequence[int]: ...
    @property
    def bad_words(self) -> Sequence[str] | None: ...
    @property
    def ignore_eos(self) -> bool: ...


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError(f"expected a sequence of strings, got the bare string {value!r}")
    return tuple(value)


def _optional_str_tuple(value: Iterable[str] | None) -> tuple[str, ...] | None:
    return None if value is None else _str_tuple(value)


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _check_temperature(_: object, __: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"temperature must be finite and non-negative, got {value}")


def _check_top_p(_: object, __: attrs.Attribute[float], value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value}")


def _check_top_k(_: object, __: attrs.Attribute[int], value: int) -> None:
    if value < -1:
        raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {value}")


def _check_max_tokens(_: object, __: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"max_tokens must be at least 1, got {value}")


def _check_logprobs(_: object, __: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"logprobs must be non-negative, got {value}")


def _check_nonempty_strings(name: str, value: tuple[str, ...] | None) -> None:
    if value is not None and not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"{name} must hold non-empty strings, got {value!r}")


def _check_stop(_: object, __: object, value: tuple[str, ...]) -> None:
    _check_nonempty_strings("stop", value)


def _check_bad_words(_: object, __: object, value: tuple[str, ...] | None) -> None:
    _check_nonempty_strings("bad_words", value)


def _check_detokenize(instance: SamplingSpec, _: object, value: bool) -> None:
    if instance.stop and not value:
        raise ValueError(
            f"stop strings {instance.stop!r} need detokenize=True: vLLM matches them on the text"
        )


def _has_stop_strings(instance: SamplingSpec) -> bool:
    return bool(instance.stop)


def _check_token_ids(_: object, __: object, value: tuple[int, ...]) -> None:
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError(f"stop_token_ids must hold non-negative ints, got {value!r}")


@attrs.frozen(kw_only=True, cache_hash=True)
class SamplingSpec:
    """The sampling parameters of one request (a hashable value; equal specs share one
    ``SamplingParams``). The hash is computed once: a batch groups its rows' specs by it."""

    temperature: float = attrs.field(validator=_check_temperature)
    top_p: float = attrs.field(validator=_check_top_p)
    top_k: int = attrs.field(validator=_check_top_k)
    max_tokens: int = attrs.field(validator=_check_max_tokens)
    logprobs: int = attrs.field(default=0, validator=_check_logprobs)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple, validator=_check_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_int_tuple, validator=_check_token_ids
    )
    include_stop_str_in_output: bool = True
    bad_words: tuple[str, ...] | None = attrs.field(
        default=None, converter=_optional_str_tuple, validator=_check_bad_words
    )
    ignore_eos: bool = False
    seed: int | None = None
    flat_logprobs: bool = False
    detokenize: bool = attrs.field(
        default=attrs.Factory(_has_stop_strings, takes_self=True), validator=_check_detokenize
    )
    #: the LoRA adapter the request runs under (``core.lora``); not a SamplingParams field
    adapter: LoraRef | None = None

    @property
    def greedy(self) -> bool:
        """Whether vLLM samples this spec greedily: a temperature below
        :data:`GREEDY_BELOW` (``SamplingParams.sampling_type``; such a request may not ask
        for ``n`` > 1, ``SamplingParams._verify_greedy_sampling``)."""
        return self.temperature < GREEDY_BELOW

    def as_kwargs(self, known: frozenset[str] | None = None) -> dict[str, object]:
        """Keyword arguments for vLLM ``SamplingParams`` (tuples as lists).

        ``bad_words`` and ``seed`` are left out when ``None``, ``flat_logprobs`` unless True;
        with ``known``, keys outside it are dropped (fields the installed vLLM lacks).
        """
        kwargs: dict[str, object] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "logprobs": self.logprobs,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "ignore_eos": self.ignore_eos,
            "detokenize": self.detokenize,
        }
        if self.bad_words is not None:
            kwargs["bad_words"] = list(self.bad_words)
        if self.seed is not None:
            kwargs["seed"] = self.seed
        if self.flat_logprobs:
            kwargs["flat_logprobs"] = True
        if known is None:
            return kwargs
        return {key: value for key, value in kwargs.items() if key in known}


def sampling_spec(
    config: SamplingDefaults,
    *,
    greedy: bool,
    max_tokens: int,
    stop: Sequence[str],
    seed: int | None = None,
    flat_logprobs: bool = False,
    text: bool = False,
) -> SamplingSpec:
    """The spec for one request: the config's sampling settings, or greedy decoding
    (temperature 0, top_k 1, top_p 1) when ``greedy``. vLLM detokenizes the row only when
    it has stop strings or ``text`` (the caller reads the completion's text)."""
    return SamplingSpec(
        temperature=0.0 if greedy else config.temperature,
        top_p=1.0 if greedy else config.top_p,
        top_k=1 if greedy else config.top_k,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=config.stop_token_ids,
        bad_words=config.bad_words,
        ignore_eos=config.ignore_eos,
        seed=seed,
        flat_logprobs=flat_logprobs,
        detokenize=text or bool(stop),
    )


@attrs.frozen
class SpecGroup:
    """One distinct spec and the batch rows (ascending) that use it."""

    spec: SamplingSpec
    rows: tuple[int, ...]


def group_specs(specs: Iterable[SamplingSpec]) -> tuple[SpecGroup, ...]:
    """Group a batch's per-row specs by equality, groups in first-seen order; every row
    index appears in exactly one group."""
    groups: dict[SamplingSpec, list[int]] = {}
    for row, spec in enumerate(specs):
        groups.setdefault(spec, []).append(row)
    return tuple(SpecGroup(spec, tuple(rows)) for spec, rows in groups.items())


def check_stop_token_ids(
    stop_token_ids: Sequence[int], vocab_size: int | None
) -> Result[tuple[int, ...], ConfigError]:
    """The config's ``stop_token_ids`` when every one is below the engine's ``vocab_size``
    (``None``: the engine does not say, nothing to check), else a ``ConfigError`` naming
    the key and the ids outside the vocabulary."""
    ids = tuple(stop_token_ids)
    if vocab_size is None:
        return Success(ids)
    outside = sorted({t for t in ids if t >= vocab_size})
    if not outside:
        return Success(ids)
    return Failure(
        ConfigError.from_problems(
            [
                ConfigProblem(
                    "stop_token_ids",
                    f"ids {outside} are outside the model's vocabulary (vocab_size "
                    f"{vocab_size}: ids must be below it)",
                )
            ]
        )
    )
