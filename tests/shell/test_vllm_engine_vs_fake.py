"""The fake engine against the real CPU engine: the same checks pass on both (named to run
after the refit modules, whose own in-process engines must stop before the session engine
starts; see engine_fixtures.py).

Only what ``FakeEngine`` promises (its module docstring) is compared, as laws both engines
must satisfy on the same requests, since their tokens differ: why a row stopped (the cap,
the context end, a stop token or EOS unless ``ignore_eos``, a stop string kept in the
text), one logprob per token, greedy results independent of the other rows and of
repetition, token counts of text prompts, the refusals of empty and over-long prompts, and
the token counters. Sleep and wake cannot run on the CPU engine (no sleep mode); the fake's
Executor rules are checked against vLLM's code in ``test_worker_fake.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import pytest
from helpers import batch, flat_rows

from genworker.core.assembly import FlatGenerations
from genworker.core.counters import GENERATION_TOKENS, PROMPT_TOKENS, values_by_name
from genworker.core.engine_calls import Cache
from genworker.core.sampling import SamplingSpec
from genworker.shell.errors import BadBatchError
from genworker.shell.fake_engine import FakeEngine
from genworker.shell.ports import EnginePort
from genworker.shell.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine

EOS = 1  # </s> in the tiny tokenizer, and the fake's default


@attrs.frozen
class Subject:
    name: str
    engine: EnginePort


@pytest.fixture(
    params=["fake", pytest.param("vllm", marks=pytest.mark.session_engine)], scope="module"
)
def subject(request: pytest.FixtureRequest) -> Iterator[Subject]:
    if request.param == "fake":
        fake = FakeEngine(vocab_size=512, max_model_len=256, eos_token_id=EOS)
        yield Subject("fake", fake)
        return
    engine: VllmEngine = request.getfixturevalue("cpu_engine")
    yield Subject("vllm", engine)
    engine.reset_cache(Cache.PREFIX)


def _spec(subject: Subject, **changes: object) -> SamplingSpec:
    base = SamplingSpec(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        max_tokens=8,
        flat_logprobs=subject.engine.capabilities.flat_logprobs,
    )
    return attrs.evolve(base, **changes)  # type: ignore[arg-type]


PROMPTS = [[5, 17, 99, 240, 7], [300, 12], [45, 46, 47, 48, 49], [88]]


@attrs.frozen
class Row:
    """One row of a flat batch; not ``truncated``: it stopped (a stop token or string)."""

    token_ids: list[int]
    logprobs: list[float]
    truncated: bool


def _rows(flat: FlatGenerations) -> list[Row]:
    return [Row(*row) for row in flat_rows(flat)]


def _generate(
    subject: Subject, prompts: Sequence[Sequence[int]], specs: Sequence[SamplingSpec]
) -> list[Row]:
    return _rows(subject.engine.generate(batch(prompts, specs)))


def _check_stopped_for_its_reason(
    subject: Subject, prompt: Sequence[int], spec: SamplingSpec, g: Row
) -> None:
    n = len(g.token_ids)
    assert len(g.logprobs) == n
    assert all(lp <= 0 for lp in g.logprobs)
    max_len = subject.engine.capabilities.max_model_len
    assert n <= spec.max_tokens
    assert len(prompt) + n <= max_len
    tokens = g.token_ids
    if g.truncated:
        assert n == spec.max_tokens or len(prompt) + n == max_len
        return
    stop_ids = set(spec.stop_token_ids) | (set() if spec.ignore_eos else {EOS})
    # A stop string is matched on the detokenized text (checked on texts below).
    assert tokens[-1] in stop_ids or spec.stop, tokens


def test_rows_stop_at_their_cap_a_stop_token_or_a_stop_string(subject: Subject) -> None:
    free = _generate(subject, PROMPTS, [_spec(subject, ignore_eos=True)] * len(PROMPTS))
    for prompt, g in zip(PROMPTS, free, strict=True):
        assert g.truncated  # ignore_eos and no stops: the cap
        _check_stopped_for_its_reason(subject, prompt, _spec(subject, ignore_eos=True), g)
    # Stop at the third token each row would generate, as a stop token id.
    by_id = [_spec(subject, stop_token_ids=(int(g.token_ids[2]),), ignore_eos=True) for g in free]
    for prompt, spec, g in zip(PROMPTS, by_id, _generate(subject, PROMPTS, by_id), strict=True):
        assert not g.truncated
        assert len(g.token_ids) <= 3
        _check_stopped_for_its_reason(subject, prompt, spec, g)
    # EOS stops a row unless ignore_eos: ask for long rows and check every reason.
    long = [_spec(subject, max_tokens=64)] * len(PROMPTS)
    for prompt, spec, g in zip(PROMPTS, long, _generate(subject, PROMPTS, long), strict=True):
        _check_stopped_for_its_reason(subject, prompt, spec, g)


TEXTS = ["Once upon a time", "The quick brown fox", "Hello world! How are", "Numbers: 0 1 2"]


def test_a_stop_string_ends_the_text_at_its_first_match_and_is_kept(subject: Subject) -> None:
    engine = subject.engine
    free_spec = _spec(subject, max_tokens=24, ignore_eos=True, detokenize=True)
    ids = engine.tokenize(TEXTS)
    free = engine.generate_text(batch(ids, [free_spec] * len(TEXTS)))
    tried = 0
    for prompt, text in zip(ids, free, strict=True):
        windows = [text[i : i + 2] for i in range(2, len(text) - 1)]
        stops = [w for w in windows if w.isascii() and w.isprintable() and w.strip()]
        if not stops:
            continue
        stop = stops[0]
        spec = attrs.evolve(free_spec, stop=(stop,))
        (stopped,) = engine.generate_text(batch([prompt], [spec]))
        assert stopped == text[: text.index(stop) + len(stop)], (text, stop)
        tried += 1
    assert tried >= 2, free


def test_a_row_stops_at_the_context_end(subject: Subject) -> None:
    max_len = subject.engine.capabilities.max_model_len
    prompt = [7] * (max_len - 3)
    (g,) = _generate(subject, [prompt], [_spec(subject, max_tokens=50, ignore_eos=True)])
    assert g.truncated
    assert len(g.token_ids) == 3


def test_greedy_rows_do_not_depend_on_the_batch_or_on_repetition(subject: Subject) -> None:
    spec = _spec(subject)
    alone = [_generate(subject, [p], [spec])[0] for p in PROMPTS]
    together = _generate(subject, list(reversed(PROMPTS)), [spec] * len(PROMPTS))
    assert [g.token_ids for g in alone] == [g.token_ids for g in reversed(together)]
    assert [g.truncated for g in alone] == [g.truncated for g in reversed(together)]


def test_empty_and_over_long_prompts_are_bad_batches(subject: Subject) -> None:
    max_len = subject.engine.capabilities.max_model_len
    for prompt in ([], [5] * (max_len + 1)):
        with pytest.raises(BadBatchError):
            subject.engine.generate(batch([[5, 6], prompt], [_spec(subject)] * 2))
    assert subject.engine.generate(batch([[5, 6]], [_spec(subject)])).batch_size == 1


def test_a_greedy_prompt_sampled_more_than_once_is_a_bad_batch(subject: Subject) -> None:
    # vLLM refuses n > 1 at temperature 0; genworker's groups send such rows one by one
    with pytest.raises(BadBatchError, match="greedy"):
        subject.engine.generate(batch([[5, 6]], [_spec(subject)], samples=[2]))
    sampled = _spec(subject, temperature=1.0, top_k=-1)
    assert subject.engine.generate(batch([[5, 6]], [sampled], samples=[2])).batch_size == 2


def test_text_prompts_are_tokenized_into_the_ids_generate_text_takes(subject: Subject) -> None:
    prompts = ["once upon a time", "abc", "x"]
    ids = subject.engine.tokenize(prompts)
    counts = [len(row) for row in ids]
    assert all(n >= 1 for n in counts)
    assert counts[0] > counts[2]
    spec = _spec(subject, max_tokens=1, ignore_eos=True, detokenize=True)
    texts = subject.engine.generate_text(batch(ids, [spec] * len(prompts)))
    assert len(texts) == len(prompts)
    assert all(isinstance(t, str) for t in texts)


def test_the_token_counters_grow_by_the_batch(subject: Subject) -> None:
    engine = subject.engine
    before = values_by_name(engine.metrics())
    out = engine.generate(batch(PROMPTS, [_spec(subject)] * len(PROMPTS)))
    after = values_by_name(engine.metrics())
    prompt_grew = float(after[PROMPT_TOKENS]) - float(before.get(PROMPT_TOKENS, 0.0))  # type: ignore[arg-type]
    gen_grew = float(after[GENERATION_TOKENS]) - float(before.get(GENERATION_TOKENS, 0.0))  # type: ignore[arg-type]
    assert prompt_grew == sum(len(p) for p in PROMPTS)
    assert gen_grew == int(out.lengths.sum())
