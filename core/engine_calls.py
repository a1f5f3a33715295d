"""The values the engine ports take and give (``shell.ports``): one batch, one request,
one RPC; what an engine can do, and one finished async request.

Every engine (the vLLM adapters and the fakes, sync and async) takes these instead of
parallel argument lists, so a batch's rows agree in one place: :class:`EngineBatch` holds
one spec (and, when given, one media entry and one sample count >= 1) per prompt, or
cannot be built (:func:`engine_batch` says why, as a :class:`BatchShapeError`). ``M`` is
the shell's media type (``shell.media.RowMedia``): core never looks inside it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

import attrs
from returns.result import Failure, Result, Success

from genworker.core.assembly import Generation
from genworker.core.errors import CoreError
from genworker.core.routing import MoeShape
from genworker.core.sampling import SamplingSpec

__all__ = [
    "REFIT_METHODS",
    "BatchShapeError",
    "Cache",
    "EngineBatch",
    "EngineCapabilities",
    "RowRequest",
    "RpcCall",
    "StreamedGeneration",
    "batch_shape_error",
    "engine_batch",
    "is_refit_method",
    "text_refusal",
]

M = TypeVar("M")


@attrs.frozen
class BatchShapeError(CoreError):
    """An engine batch whose rows disagree: ``field`` (``specs``, ``media``, ``samples``)
    holds ``count`` entries for ``prompts`` prompts, or (``samples``) a count below 1."""

    field: str
    count: int
    prompts: int


def batch_shape_error(
    prompts: int, specs: int, media: int | None, samples: Sequence[int] | None
) -> BatchShapeError | None:
    """Why a batch of ``prompts`` prompts with these many specs, media entries and these
    sample counts cannot be one engine batch (None: it can)."""
    counts = {"specs": specs, "media": media, "samples": None if samples is None else len(samples)}
    for field, count in counts.items():
        if count is not None and count != prompts:
            return BatchShapeError(
                f"{prompts} prompts but {count} {field}", field=field, count=count, prompts=prompts
            )
    if samples is not None and (low := [n for n in samples if n < 1]):
        return BatchShapeError(
            f"sample counts {low} are below 1", field="samples", count=len(low), prompts=prompts
        )
    return None


@attrs.frozen
class EngineBatch(Generic[M]):
    """One engine batch: ``specs[i]`` applies to ``prompts[i]``, ``media[i]`` (when given)
    holds its images, and ``samples[i]`` (default 1) is how many times it is sampled in
    one request (vLLM's ``n``). Building a batch whose rows disagree raises ``ValueError``
    (:func:`engine_batch` returns the reason instead)."""

    prompts: tuple[Sequence[int], ...]
    specs: tuple[SamplingSpec, ...]
    media: tuple[M | None, ...] | None = None
    samples: tuple[int, ...] | None = None

    def __attrs_post_init__(self) -> None:
        media = None if self.media is None else len(self.media)
        problem = batch_shape_error(len(self.prompts), len(self.specs), media, self.samples)
        if problem is not None:
            raise ValueError(f"EngineBatch: {problem}")

    @property
    def completions(self) -> int:
        """How many rows the engine returns for the batch (every prompt's samples)."""
        return len(self.prompts) if self.samples is None else sum(self.samples)

    def row_media(self) -> tuple[M | None, ...]:
        """Each prompt's media (None for every row of a batch without)."""
        return (None,) * len(self.prompts) if self.media is None else self.media


def engine_batch(
    prompts: Sequence[Sequence[int]],
    specs: Sequence[SamplingSpec],
    media: Sequence[M | None] | None = None,
    samples: Sequence[int] | None = None,
) -> Result[EngineBatch[M], BatchShapeError]:
    """The engine batch of these rows, or why they cannot be one."""
    counts = None if media is None else len(media)
    if (problem := batch_shape_error(len(prompts), len(specs), counts, samples)) is not None:
        return Failure(problem)
    return Success(
        EngineBatch(
            tuple(prompts),
            tuple(specs),
            None if media is None else tuple(media),
            None if samples is None else tuple(samples),
        )
    )


def text_refusal(specs: Sequence[SamplingSpec], samples: Sequence[int] | None) -> str | None:
    """Why rows under ``specs`` (``samples``: their sample counts) cannot be a
    ``generate_text`` call, whose caller reads one text a prompt: a spec that does not
    detokenize (vLLM would return empty texts), or sample counts; None: they can."""
    if untexted := [row for row, spec in enumerate(specs) if not spec.detokenize]:
        return (
            f"generate_text: the specs of rows {untexted} have detokenize=False "
            "(vLLM would return empty texts); build them with sampling_spec(text=True)"
        )
    if samples is not None:
        return f"generate_text: sample counts {tuple(samples)}: one text a prompt"
    return None


@attrs.frozen
class RowRequest(Generic[M]):
    """One request to an async engine: ``prompt`` sampled under ``spec`` as request
    ``request_id``; ``media``: its images, one placeholder id each in ``prompt``."""

    request_id: str
    prompt: Sequence[int]
    spec: SamplingSpec
    media: M | None = None


class Cache(enum.StrEnum):
    """An engine cache the worker resets by name (``EnginePort.reset_cache``): the prefix
    cache, the processed media (front end and engine core), the encoder outputs. The value
    is the worker's name of it (``genworker:cache_resets{cache=...}``)."""

    PREFIX = "prefix"
    MM = "mm"
    ENCODER = "encoder"

    @property
    def call(self) -> str:
        """The engine call that resets it (``reset_prefix_cache``...), as vLLM names it."""
        return f"reset_{self.value}_cache"

    @property
    def label(self) -> str:
        """Its name in a sentence (``prefix cache``, ``multimodal cache``...)."""
        return "multimodal cache" if self is Cache.MM else f"{self.value} cache"

    @property
    def kept(self) -> str:
        """The refusal of a reset the engine answered by keeping it (vLLM keeps a prefix
        cache while requests run): what the vLLM adapters and the fakes say."""
        return f"{self.call}: vLLM kept the cache (requests running)"


@attrs.frozen
class RpcCall:
    """A call of ``method`` of the worker extension on every engine worker (vLLM's
    ``collective_rpc``): its positional and keyword arguments, and its bound in seconds
    (None: unbounded)."""

    method: str
    args: tuple[object, ...] = ()
    kwargs: Mapping[str, object] | None = None
    timeout: float | None = None


#: The engine-side RPC targets of a refit (genworker's, the sparse relay's, the reshard's);
#: NeMo-RL's wire receivers are the ``nemo_rl_`` ones (:func:`is_refit_method`).
REFIT_METHODS = frozenset(
    {
        "prepare_refit_info",
        "prepare_lora",
        "update_lora",
        "init_collective",
        "update_weights_via_ipc_zmq",
        "update_weights_from_collective",
        "refit_address",
        "engine_param_layout",
        "release_refit_buffers",
        "start_sparse_relay",
        "configure_sparse_relay",
        "stop_sparse_relay",
        "sparse_relay_status",
        "refit_hold",
        "refit_reset_kv",
        "init_nccl_reshard_comm_group",
        "prepare_nccl_reshard_refit_info",
        "nccl_reshard_refit",
    }
)


def is_refit_method(method: str) -> bool:
    """Whether an RPC to ``method`` is part of a refit (its failure says the weights may be
    inconsistent: the shell raises it as a ``RefitError``)."""
    return method in REFIT_METHODS or method.startswith("nemo_rl_")


@attrs.frozen
class EngineCapabilities:
    """What the running engine can do, found by capability checks, never by version."""

    sleep_mode: bool
    flat_logprobs: bool
    vocab_size: int | None
    max_model_len: int
    device: str
    sampling_args: frozenset[str] | None = None
    #: the engine labels every token with the weights that sampled it (vLLM 0.32's
    #: ``CompletionOutput.weight_versions``); async engines only
    weight_versions: bool = False
    #: the engine takes media (it has multimodal caches to reset)
    multimodal: bool = False
    #: the prompt id that stands for one image (None: the model takes no images)
    image_token_id: int | None = None
    #: the engine's ``limit_mm_per_prompt`` for images (None: not known)
    max_images: int | None = None
    #: draft tokens per step of the engine's speculative decoding (0: none); the per-row
    #: caps reserve k + 1 slots for it
    num_speculative_tokens: int = 0
    #: what the engine's logprobs hold (vLLM's ``logprobs_mode``): a -inf sampled logprob
    #: is legal only in a processed mode (``genworker.core.outputs.check_logprobs``)
    logprobs_mode: str = "raw_logprobs"
    #: the engine shares computed prompt blocks between requests (vLLM's
    #: ``enable_prefix_caching``): a group's prompt is prefilled once only then
    #: (``genworker.core.groups``)
    prefix_caching: bool = False
    #: the most top logprobs a request may ask for (vLLM's ``max_logprobs``)
    max_logprobs: int = 20
    #: the MoE routing the engine returns with each generation (``enable_return_routed_experts``;
    #: None: it returns none)
    routes: MoeShape | None = None


@attrs.frozen
class StreamedGeneration:
    """One finished request of an async engine: its generation and, when the engine labels
    tokens (``EngineCapabilities.weight_versions``), the ``(label, start, end)`` spans of
    the weights that sampled them."""

    generation: Generation
    version_spans: tuple[tuple[str, int, int], ...] | None = None
