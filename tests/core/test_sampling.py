"""Laws of sampling specs: the greedy rule, config fields carried, kwargs, grouping."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import (
    SamplingDefaultsValue,
    nemo_config_dicts,
    sampling_defaults,
    sampling_spec_batches,
    sampling_specs,
    sampling_stops,
)

from genworker.core.config import WorkerConfig
from genworker.core.sampling import (
    SamplingDefaults,
    SamplingSpec,
    SpecGroup,
    check_stop_token_ids,
    group_specs,
    sampling_spec,
)

ALWAYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "logprobs",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "detokenize",
    }
)
OPTIONAL = frozenset({"bad_words", "seed", "flat_logprobs"})

max_tokens_values = st.integers(1, 1 << 16)
seeds = st.none() | st.integers(-(2**63), 2**63 - 1)


# --- sampling_spec ---


@given(sampling_defaults, max_tokens_values, sampling_stops, seeds, st.booleans())
def test_greedy_overrides_only_the_sampling_knobs(
    config: SamplingDefaultsValue,
    max_tokens: int,
    stop: Sequence[str],
    seed: int | None,
    flat: bool,
) -> None:
    spec = sampling_spec(
        config, greedy=True, max_tokens=max_tokens, stop=stop, seed=seed, flat_logprobs=flat
    )
    assert (spec.temperature, spec.top_k, spec.top_p) == (0.0, 1, 1.0)
    assert spec == sampling_spec(
        attrs.evolve(config, temperature=0.0, top_k=1, top_p=1.0),
        greedy=False,
        max_tokens=max_tokens,
        stop=stop,
        seed=seed,
        flat_logprobs=flat,
    )


@given(sampling_defaults, max_tokens_values, sampling_stops, seeds, st.booleans())
def test_sampling_carries_config_and_call(
    config: SamplingDefaultsValue,
    max_tokens: int,
    stop: Sequence[str],
    seed: int | None,
    flat: bool,
) -> None:
    spec = sampling_spec(
        config, greedy=False, max_tokens=max_tokens, stop=stop, seed=seed, flat_logprobs=flat
    )
    assert spec == SamplingSpec(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_tokens=max_tokens,
        logprobs=0,
        stop=tuple(stop),
        stop_token_ids=config.stop_token_ids,
        include_stop_str_in_output=True,
        bad_words=config.bad_words,
        ignore_eos=config.ignore_eos,
        seed=seed,
        flat_logprobs=flat,
    )  # detokenize left to its default: "has stop strings", the rule sampling_spec applies
    assert spec.stop == tuple(stop)
    assert isinstance(spec.stop, tuple)


def test_defaults_of_a_request() -> None:
    config = SamplingDefaultsValue(0.7, 0.95, 50, (2, 7), None, False)
    spec = sampling_spec(config, greedy=False, max_tokens=16, stop=["</answer>"])
    assert spec.as_kwargs() == {
        "temperature": 0.7,
        "top_p": 0.95,
        "top_k": 50,
        "max_tokens": 16,
        "logprobs": 0,
        "stop": ["</answer>"],
        "stop_token_ids": [2, 7],
        "include_stop_str_in_output": True,
        "ignore_eos": False,
        "detokenize": True,
    }


@given(nemo_config_dicts(), st.booleans(), max_tokens_values)
def test_every_valid_worker_config_builds_specs(
    d: dict[str, object], greedy: bool, max_tokens: int
) -> None:
    """Whatever the config accepts, a spec accepts: no request fails on config values."""
    config = WorkerConfig.from_mapping(d).unwrap()
    defaults: SamplingDefaults = config  # WorkerConfig satisfies the protocol (mypy checks)
    spec = sampling_spec(defaults, greedy=greedy, max_tokens=max_tokens, stop=config.stop_strings)
    assert spec.stop == config.stop_strings
    assert spec.stop_token_ids == config.stop_token_ids
    assert spec.bad_words == config.bad_words
    assert spec.temperature == (0.0 if greedy else config.temperature)


# --- detokenize ---


@given(sampling_defaults, st.booleans(), max_tokens_values, sampling_stops, st.booleans())
def test_only_rows_that_need_text_detokenize(
    config: SamplingDefaultsValue,
    greedy: bool,
    max_tokens: int,
    stop: Sequence[str],
    text: bool,
) -> None:
    """Stop strings or a text request turn detokenization on; nothing else does."""
    spec = sampling_spec(config, greedy=greedy, max_tokens=max_tokens, stop=stop, text=text)
    assert spec.detokenize == (text or bool(stop))
    assert spec.as_kwargs()["detokenize"] is spec.detokenize


def test_a_token_only_request_skips_detokenization() -> None:
    config = SamplingDefaultsValue(1.0, 1.0, -1, (), ("zz",), True)
    spec = sampling_spec(config, greedy=False, max_tokens=4, stop=[])
    assert spec.as_kwargs()["detokenize"] is False
    # bad_words are tokenized when the request is added, not detokenized: no text needed.
    assert spec.bad_words == ("zz",)
    assert sampling_spec(config, greedy=False, max_tokens=4, stop=[], text=True).detokenize


@given(sampling_specs)
def test_stop_strings_always_come_with_detokenization(spec: SamplingSpec) -> None:
    assert spec.detokenize or not spec.stop


def test_stop_strings_without_detokenization_are_refused() -> None:
    with pytest.raises(ValueError, match="detokenize"):
        SamplingSpec(**GOOD, stop=["</a>"], detokenize=False)  # type: ignore[arg-type]
    spec = SamplingSpec(**GOOD)  # type: ignore[arg-type]
    assert spec.detokenize is False
    with pytest.raises(ValueError, match="detokenize"):
        attrs.evolve(spec, stop=("x",))
    assert attrs.evolve(spec, stop=("x",), detokenize=True).stop == ("x",)


# --- as_kwargs ---


@given(sampling_specs)
def test_kwargs_round_trip(spec: SamplingSpec) -> None:
    """The kwargs say everything about the spec: rebuilding from them gives it back."""
    assert SamplingSpec(**spec.as_kwargs()) == spec  # type: ignore[arg-type]


@given(sampling_specs)
def test_kwargs_keys_and_plain_values(spec: SamplingSpec) -> None:
    kwargs = spec.as_kwargs()
    assert ALWAYS <= kwargs.keys() <= ALWAYS | OPTIONAL
    assert ("bad_words" in kwargs) == (spec.bad_words is not None)
    assert ("seed" in kwargs) == (spec.seed is not None)
    assert ("flat_logprobs" in kwargs) == spec.flat_logprobs
    if spec.flat_logprobs:
        assert kwargs["flat_logprobs"] is True
    assert not any(isinstance(v, tuple) for v in kwargs.values())
    assert kwargs["stop"] == list(spec.stop)
    assert kwargs["stop_token_ids"] == list(spec.stop_token_ids)


@given(sampling_specs, st.sets(st.sampled_from(sorted(ALWAYS | OPTIONAL | {"n", "min_p"}))))
def test_kwargs_keep_only_known_fields(spec: SamplingSpec, known: set[str]) -> None:
    full = spec.as_kwargs()
    assert spec.as_kwargs(frozenset(known)) == {k: v for k, v in full.items() if k in known}
    assert spec.as_kwargs(None) == full


@given(sampling_specs)
def test_kwargs_are_fresh_lists(spec: SamplingSpec) -> None:
    """Mutating the kwargs (vLLM's ``__post_init__`` does) never touches the spec."""
    kwargs = spec.as_kwargs()
    stop = kwargs["stop"]
    assert isinstance(stop, list)
    stop.append("zzz")
    assert "zzz" not in spec.stop
    assert spec.as_kwargs()["stop"] == list(spec.stop)


# --- the value ---


@given(sampling_specs)
def test_specs_are_hashable_values(spec: SamplingSpec) -> None:
    assert spec == attrs.evolve(spec)
    assert hash(spec) == hash(attrs.evolve(spec))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.max_tokens = 3  # type: ignore[misc]


def test_sequences_become_tuples() -> None:
    spec = SamplingSpec(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_tokens=8,
        stop=["a", "b"],
        stop_token_ids=[1, 2],
        bad_words=["x"],
    )
    assert (spec.stop, spec.stop_token_ids, spec.bad_words) == (("a", "b"), (1, 2), ("x",))
    assert spec == attrs.evolve(spec, stop=("a", "b"), stop_token_ids=(1, 2), bad_words=("x",))


GOOD = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8}


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("temperature", -0.1, ValueError),
        ("temperature", math.nan, ValueError),
        ("temperature", math.inf, ValueError),
        ("top_p", 0.0, ValueError),
        ("top_p", 1.5, ValueError),
        ("top_p", math.nan, ValueError),
        ("top_k", -2, ValueError),
        ("max_tokens", 0, ValueError),
        ("logprobs", -1, ValueError),
        ("stop", ["a", ""], ValueError),
        ("stop", [3], ValueError),
        ("stop", "</s>", TypeError),
        ("stop_token_ids", [1, -1], ValueError),
        ("stop_token_ids", [True], ValueError),
        ("bad_words", [""], ValueError),
        ("bad_words", "bad", TypeError),
    ],
)
def test_broken_invariants_raise(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=field if error is ValueError else "bare string"):
        SamplingSpec(**{**GOOD, field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_disabled_or_positive_is_fine(top_k: int) -> None:
    assert SamplingSpec(**{**GOOD, "top_k": top_k}).top_k == top_k  # type: ignore[arg-type]


# --- group_specs ---


@given(sampling_spec_batches())
def test_every_row_in_exactly_one_group(specs: list[SamplingSpec]) -> None:
    groups = group_specs(specs)
    rows = sorted(r for g in groups for r in g.rows)
    assert rows == list(range(len(specs)))


@given(sampling_spec_batches())
def test_groups_hold_equal_specs_and_distinct_groups_differ(specs: list[SamplingSpec]) -> None:
    groups = group_specs(specs)
    for group in groups:
        assert all(specs[r] == group.spec for r in group.rows)
        assert list(group.rows) == sorted(group.rows)
    assert len({g.spec for g in groups}) == len(groups) == len(set(specs))


@given(sampling_spec_batches())
def test_groups_in_first_seen_order(specs: list[SamplingSpec]) -> None:
    groups = group_specs(specs)
    firsts = [g.rows[0] for g in groups]
    assert firsts == sorted(firsts)
    assert [g.spec for g in groups] == list(dict.fromkeys(specs))


def test_grouping_example_and_iterables() -> None:
    a = SamplingSpec(**GOOD)  # type: ignore[arg-type]
    b = attrs.evolve(a, max_tokens=4)
    assert group_specs(iter([b, a, b, b, a])) == (
        SpecGroup(b, (0, 2, 3)),
        SpecGroup(a, (1, 4)),
    )
    assert group_specs([]) == ()


# --- stop token ids against the vocabulary (G6) ---


@given(st.lists(st.integers(0, 300), max_size=8), st.none() | st.integers(1, 260))
def test_stop_token_ids_pass_exactly_when_every_id_is_in_the_vocabulary(
    ids: list[int], vocab_size: int | None
) -> None:
    # Law: an id at or past vocab_size is refused, by key and id, every such id named
    # once; an engine that does not say its vocab_size refuses nothing.
    result = check_stop_token_ids(ids, vocab_size)
    outside = sorted({t for t in ids if vocab_size is not None and t >= vocab_size})
    if not outside:
        assert result == Success(tuple(ids))
        return
    assert isinstance(result, Failure)
    error = result.failure()
    assert error.keys == ("stop_token_ids",)
    assert f"ids {outside} are outside" in error.message
    assert f"vocab_size {vocab_size}" in error.message
