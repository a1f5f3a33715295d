"""The fake engines' made-up model: the pure rules ``shell.fake_engine`` and
``shell.fake_async_engine`` follow, so that the fakes hold only their state and calls.

Their module docstrings say which part of vLLM's contract each rule mirrors; here:

- the tokenizer: one letter per token id (:func:`detokenize`, :func:`tokenize`);
- the model: a token and its logprob from a deterministic uniform draw (:func:`draw`,
  :func:`sample_token`), vLLM's stop rule and the length rule (:func:`finish_reason`),
  scores deterministic in the prefix (:func:`score_row`), routed experts
  (:func:`fake_routes`), and a row as vLLM returns it with garbage logits or aborted
  (:func:`faulted`);
- the engine: what a fake with these options can do (:func:`fake_capabilities`), what
  ``wake_up(tags)`` wakes (:func:`waking`, vLLM's ``Executor.wake_up``,
  vllm/v1/executor/abstract.py, 0.32), a media row's context length (:func:`expanded_length`),
  why it cannot serve (:func:`unservable`), its metrics (:func:`fake_metrics`), each
  image as its tokens see it (:func:`image_digest`), the routes and the draft tokens of an
  engine started with these kwargs (:func:`routes_option`, :func:`speculative_tokens`)
  and the weight labels of a request's tokens as spans (:func:`weight_spans`).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence, Set
from typing import Final, TypedDict

import numpy as np
import numpy.typing as npt
from returns.result import Failure, Result, Success

from genworker.core.assembly import Generation
from genworker.core.counters import CounterSample, GaugeSample, MetricSample
from genworker.core.engine_calls import EngineCapabilities
from genworker.core.errors import CoreError
from genworker.core.lifecycle import InflightMode
from genworker.core.routing import MoeShape, RoutedExperts
from genworker.core.sampling import SamplingSpec
from genworker.core.scoring import ScoredRow

__all__ = [
    "LETTERS",
    "MEMORY_TAGS",
    "METRIC_LABELS",
    "FakeEngineOptions",
    "detokenize",
    "draw",
    "expanded_length",
    "fake_capabilities",
    "fake_metrics",
    "fake_routes",
    "faulted",
    "finish_reason",
    "image_digest",
    "request_routes",
    "routes_option",
    "sample_token",
    "score_row",
    "speculative_tokens",
    "steppable",
    "tokenize",
    "unservable",
    "waking",
    "weight_spans",
]

#: the fakes' vocabulary as text: token id ``t`` is ``LETTERS[t % 26]``
LETTERS: Final = "abcdefghijklmnopqrstuvwxyz"
#: the memory tags of a sleep-mode engine (all of them awake: the engine serves)
MEMORY_TAGS: Final = frozenset({"weights", "kv_cache"})
#: the labels of the fakes' metrics (one engine, as vLLM labels its own)
METRIC_LABELS: Final = (("engine", "0"), ("model_name", "fake"))


class FakeEngineOptions(TypedDict, total=False):
    """The options both fakes take (:func:`fake_capabilities` and ``FakeEngineBase`` hold
    their defaults)."""

    vocab_size: int
    max_model_len: int
    eos_token_id: int
    seed: int
    sleep_mode: bool
    device: str
    image_token_id: int | None
    image_prompt_ids: int
    max_images: int | None
    num_speculative_tokens: int
    logprobs_mode: str
    prefix_caching: bool
    routes: MoeShape | None


def fake_capabilities(options: FakeEngineOptions) -> EngineCapabilities:
    """What a fake with these ``options`` can do: by default a 64-id vocabulary, 128
    positions, sleep mode, text only, on "cpu". An option no fake takes is a ``TypeError``."""
    if unknown := sorted(options.keys() - FakeEngineOptions.__optional_keys__):
        raise TypeError(f"the fake engines take no options {unknown}")
    image_token_id = options.get("image_token_id")
    return EngineCapabilities(
        sleep_mode=options.get("sleep_mode", True),
        flat_logprobs=True,
        vocab_size=options.get("vocab_size", 64),
        max_model_len=options.get("max_model_len", 128),
        device=options.get("device", "cpu"),
        multimodal=image_token_id is not None,
        image_token_id=image_token_id,
        max_images=options.get("max_images"),
        num_speculative_tokens=options.get("num_speculative_tokens", 0),
        logprobs_mode=options.get("logprobs_mode", "raw_logprobs"),
        prefix_caching=options.get("prefix_caching", False),
        routes=options.get("routes"),
    )


def unservable(call: str, awake: Set[str], weights_discarded: bool) -> str | None:
    """Why ``call`` would silently go wrong on a real engine (None: it would not): running
    with memory asleep, or on the garbage a level-2 sleep leaves without new weights."""
    if awake != MEMORY_TAGS:
        return f"{call} with only {sorted(awake)} awake"
    if weights_discarded:
        return f"{call} after a level-2 sleep without new weights"
    return None


def fake_metrics(
    prompt_tokens: int, generation_tokens: int, running: int | None = None
) -> list[MetricSample]:
    """A fake's metrics, named as vLLM's: its token counters and (an async fake's) the
    requests running."""
    samples: list[MetricSample] = [
        CounterSample(name="vllm:prompt_tokens", labels=METRIC_LABELS, value=prompt_tokens),
        CounterSample(name="vllm:generation_tokens", labels=METRIC_LABELS, value=generation_tokens),
    ]
    if running is not None:
        samples.append(GaugeSample("vllm:num_requests_running", METRIC_LABELS, running))
    return samples


def image_digest(pixels: bytes, size: tuple[int, int]) -> str:
    """What a fake's tokens see of an image: a digest of its bytes, and its size."""
    return f"{hashlib.blake2b(pixels, digest_size=8).hexdigest()}{size}"


def detokenize(token_ids: Sequence[int] | npt.NDArray[np.int64]) -> str:
    return "".join(LETTERS[int(t) % 26] for t in token_ids)


def tokenize(prompt: str) -> list[int]:
    """One id per letter, 0 for anything else."""
    return [LETTERS.index(c) if c in LETTERS else 0 for c in prompt]


def draw(*parts: object) -> float:
    """A deterministic uniform number in [0, 1) from the parts."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    (value,) = struct.unpack("<Q", digest)
    return int(value) / 2**64


def sample_token(u: float, vocab_size: int, greedy: bool) -> tuple[int, float]:
    """The token the draw ``u`` picks from ``vocab_size`` ids, and its logprob (a sampled
    token's half a nat below a greedy one's)."""
    return int(u * vocab_size), math.log(max(1e-6, 1.0 - u)) - (0.0 if greedy else 0.5)


def finish_reason(
    spec: SamplingSpec, token: int, text: str, generated: int, room: int, eos_token_id: int
) -> str | None:
    """Why a request ends after sampling ``token`` (its ``generated``-th; ``text`` the
    output so far, ``room`` what the context leaves it): vLLM's stop rule (a stop token id,
    the EOS id unless ``ignore_eos``, the text ending with a stop string), else
    ``max_tokens`` or the context's end; None: it goes on."""
    eos = token == eos_token_id and not spec.ignore_eos
    if eos or token in spec.stop_token_ids or any(text.endswith(s) for s in spec.stop):
        return "stop"
    return "length" if generated >= min(spec.max_tokens, room) else None


def score_row(
    sequence: Sequence[int], start: int, top_k: int, *, seed: int, weights: int, vocab_size: int
) -> ScoredRow:
    """The given tokens' logprobs from ``start`` on and ``top_k`` others, ranked, at each
    of those positions (vLLM's ``prompt_logprobs``), deterministic in the prefix under
    (``seed``, the ``weights`` version)."""
    logprobs, top_ids, top_logprobs = [], [], []
    for position in range(start, len(sequence)):
        u = draw(seed, weights, tuple(sequence[:position]), position)
        logprobs.append(math.log(max(1e-6, 1.0 - u)) - 1.0)
        top_ids.append(tuple((int(u * vocab_size) + j) % vocab_size for j in range(top_k)))
        top_logprobs.append(tuple(-0.1 - j for j in range(top_k)))
    return ScoredRow(tuple(logprobs), tuple(top_ids), tuple(top_logprobs))


def fake_routes(
    shape: MoeShape, seed: int, sequence: Sequence[int], versions: Sequence[int]
) -> RoutedExperts:
    """The fake's routes for a finished sequence (prompt then generated tokens): position p
    < len - 1 routes to ``top_k`` distinct experts per layer, drawn from (seed, the weight
    version that forwarded it, token, p); the last token is never forwarded."""
    rows = np.empty((max(len(sequence) - 1, 0), shape.num_layers, shape.top_k), dtype=np.int32)
    for p in range(rows.shape[0]):
        rng = np.random.default_rng([seed % 2**32, versions[p], int(sequence[p]), p])
        rows[p] = np.argsort(rng.random((shape.num_layers, shape.num_experts)), axis=1)[
            :, : shape.top_k
        ]
    return RoutedExperts(shape, rows)


def request_routes(
    shape: MoeShape,
    seed: int,
    prompt: Sequence[int],
    tokens: Sequence[int],
    versions: Sequence[int],
    now: int,
) -> RoutedExperts:
    """A finished request's routes (:func:`fake_routes`): its ``prompt`` under the weights
    of its first generated token (``now``, the weights version, when it generated none),
    each of its ``tokens`` under the weights that sampled it (``versions``)."""
    first = list(versions[:1]) or [now]
    return fake_routes(shape, seed, [*prompt, *tokens], first * len(prompt) + list(versions))


def faulted(generation: Generation, logprob: float | None, finish: str | None) -> Generation:
    """``generation`` as vLLM returns it with garbage logits (every sampled logprob
    ``logprob``) or aborted (``finish`` "abort": the first half of its tokens)."""
    if logprob is None and finish is None:
        return generation
    tokens, logprobs = generation.token_ids, generation.logprobs
    if finish == "abort":
        tokens = tokens[: len(tokens) // 2]
    if logprob is not None:
        logprobs = np.full(len(tokens), logprob, dtype=np.float32)
    elif logprobs is not None:
        logprobs = logprobs[: len(tokens)]
    return Generation(tokens, logprobs, finish or generation.finish_reason)


def waking(awake: Set[str], tags: Sequence[str] | None) -> frozenset[str]:
    """The tags ``wake_up(tags)`` (None: all) wakes when ``awake`` are: none when nothing
    sleeps, and none when a tag it names is awake (vLLM drops the WHOLE call, vllm#31618)."""
    if awake == MEMORY_TAGS:
        return frozenset()  # vLLM: "Executor is not sleeping."
    if tags and any(t in awake for t in tags):
        return frozenset()  # vLLM: "Tag ... is not in sleeping tags"
    return MEMORY_TAGS if not tags else frozenset(tags)


def expanded_length(
    prompt: Sequence[int], images: int, placeholder_id: int, image_prompt_ids: int
) -> Result[int, CoreError]:
    """A media row's context length: each of its ``images``' placeholder ids stands for
    ``image_prompt_ids`` ids; refused when images and placeholders differ in number."""
    placeholders = list(prompt).count(placeholder_id)
    if placeholders != images:
        return Failure(
            CoreError(f"the fake engine got {images} images for {placeholders} placeholders")
        )
    return Success(len(prompt) + placeholders * (image_prompt_ids - 1))


def routes_option(kwargs: Mapping[str, object], moe: object) -> Result[MoeShape | None, CoreError]:
    """The fake engines' ``routes`` for these engine kwargs and the factory's ``moe``
    option; the capture without an MoE model fails to start (vLLM 0.32:
    "AuxOutput Connector only supports MoE models")."""
    if not kwargs.get("enable_return_routed_experts"):
        return Success(None)
    if not isinstance(moe, MoeShape):
        return Failure(
            CoreError(
                "the fake engine failed to start: enable_return_routed_experts needs an MoE "
                "model (give the factory moe=MoeShape(...))"
            )
        )
    return Success(moe)


def speculative_tokens(
    kwargs: Mapping[str, object], draft_tokens: int | None
) -> Result[int | None, CoreError]:
    """The draft tokens per step of an engine started with these kwargs (None: no
    ``speculative_config``): the config's ``num_speculative_tokens``, else what the drafter
    lets vLLM infer (``draft_tokens``; None: vLLM's start error)."""
    spec = kwargs.get("speculative_config")
    if not isinstance(spec, Mapping):
        return Success(None)
    k = spec.get("num_speculative_tokens", draft_tokens)
    if not isinstance(k, int):
        return Failure(
            CoreError(
                "the fake engine failed to start: `num_speculative_tokens` was not "
                "provided and the drafter does not say"
            )
        )
    return Success(k)


def steppable(pause: InflightMode | None, budget: int | None, waiting: int, running: int) -> bool:
    """Whether the async fake's scheduler takes a step: none while paused with ``keep``
    (running requests frozen) or with no step left of its ``budget`` (None: no limit);
    else one that admits the ``waiting`` requests (never while paused: a paused scheduler
    queues them, as vLLM's ``pause_scheduler``) or steps the ``running`` ones."""
    if pause is InflightMode.KEEP or budget == 0:
        return False
    return (pause is None and waiting > 0) or running > 0


def weight_spans(
    labels: Sequence[tuple[str, int]], generated: int
) -> tuple[tuple[str, int, int], ...]:
    """A request's weight labels (label, first position), as (label, start, end) spans
    over its ``generated`` tokens."""
    ends = [start for _, start in labels[1:]] + ([generated] if labels else [])
    return tuple((label, start, end) for (label, start), end in zip(labels, ends, strict=True))
