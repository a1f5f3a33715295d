"""The vLLM adapter for :class:`genworker.shell.ports.EnginePort`, over ``vllm.LLM``.

Theory of operation
-------------------
- Capabilities are found by looking, never by version: sleep mode is
  ``current_platform.is_sleep_mode_available()`` and the engine's ``enable_sleep_mode``;
  flat logprobs are available when ``SamplingParams`` has a ``flat_logprobs`` field
  (vllm/sampling_params.py, 0.32); engine arguments are ``EngineArgs``' dataclass fields.
- ``generate`` hands vLLM a per-prompt list of ``SamplingParams``, each made once per
  (spec, sample count) and shared by the rows that ask for it (``request_params``);
  ``LLM.generate`` returns outputs in prompt order.
- The sampled logprobs as arrays: the engine installs the hook of
  :mod:`genworker.shell.sampled_logprobs` at start and marks the specs that qualify
  (``logprobs=0``, no text); every other row, and every engine without the hook, gets
  flat logprobs.
- vLLM's outputs become :class:`~genworker.core.assembly.FlatGenerations` in one pass
  (:mod:`genworker.core.completions`); a completion it cannot read is an
  ``EngineContractError``. ``generate`` hands back the rows as vLLM made them and the
  worker checks them (``genworker.core.outputs``); ``generate_text``, whose caller sees no
  tokens, checks its own, and refuses a spec that does not detokenize.
- Cyclic GC stays out of a generate call, and vLLM's outputs are freed as they are read
  (:mod:`genworker.shell.collector` tells why): with the hook's arrays a row is a handful
  of objects (``worker_outside_free_ms`` 1.5 ms for 512 x 256 on this host, against 4.6
  with a list of token ids and 11.7 with flat logprobs); otherwise each row's completion
  goes once it is packed, the ``RequestOutput`` list dropped first (issue 20).
- Errors are translated in one place (the seam :data:`VLLM_CALLS`, through
  ``shell.errors.translated``): vLLM's ``EngineDeadError`` becomes ours. A generate call
  runs under :func:`_batch_call` as well: ``LLM.generate`` aborts the requests it already
  added when one is rejected (``_render_and_add_requests`` in
  vllm/entrypoints/common/offline.py, 0.32), but an error out of ``LLMEngine.step`` (e.g.
  a seed ``torch.Generator.manual_seed`` cannot take) leaves the admitted requests
  unfinished, and the next ``generate`` steps them forever. So after ANY error
  :func:`abort_unfinished` aborts the requests still unfinished
  (``LLMEngine.abort_request(ids, internal=True)``, as vLLM does) and drops the writes the
  V2 GPU runner staged for them (``LLM.collective_rpc(drop_staged_writes)``, issue 18:
  :mod:`genworker.shell.staged_writes`); if either fails, or requests are left, the
  engine is dead. Only an error of request validation (``ValueError`` /
  ``VLLMValidationError``, not a ``ValueError`` in 0.32) that left nothing admitted is a
  ``BadBatchError``; any other is ``GenerationAbortedError`` (the engine serves the next
  call).
- Media (vLLM 0.32 ``vllm/renderers/base.py``, the same in 0.25): ``tokenize`` runs the
  renderer's own tokenization (what ``LLM.generate`` does to a text prompt) but gives a
  prompt that starts with the BOS string no second one; every text prompt is then
  submitted as token ids, so ``generate_text``'s per-row caps count what the engine sees;
  an engine started with ``skip_tokenizer_init`` takes no text prompts
  (``UnsupportedError``). ``expanded_lengths`` renders each media row as ``LLM.generate``
  would, with ``skip_mm_cache=True``, the tokenize endpoint's path, which leaves the
  sender-side multimodal cache alone (an item that cache records as sent but never
  reaches the engine core would later be missing there). The image placeholder id is the
  HF config's ``image_token_id`` (or ``image_token_index``); the per-prompt image limit is
  ``multimodal_config.get_limit_per_prompt("image")``. After a refit, vLLM 0.32's
  ``reload_weights`` clears the model runner's encoder cache but not the scheduler's
  record of it, so the next request with an image seen before fails with "Encoder cache
  miss"; 0.25 keeps both, so the encoder outputs of the old weights are reused. Hence the
  worker calls ``LLMEngine.reset_encoder_cache`` (both halves) and ``LLM.reset_mm_cache``
  (front end and engine core) after every refit and before sleep.
- ``num_speculative_tokens`` in the capabilities is what vLLM resolved at start
  (``vllm_config.speculative_config``: inferred from the drafter when the config left it
  out).
- ``use_tqdm`` (the worker passes ``vllm_cfg.use_tqdm``) goes to ``LLM.generate``.
- ``collective_rpc`` with a timeout waits on a daemon thread for at most that long: the
  in-process executor ignores vLLM's own ``timeout`` (vllm/v1/executor/uniproc_executor.py,
  0.32). Expiry (or vLLM's own RPC ``TimeoutError``) means the engine is wedged:
  ``EngineDeadError``, and the engine is dead from then on (every later call refused
  with it); the call stays recorded as running. A typed error the call raised (a refit's
  own timeout) stays itself. A call the caller stopped waiting for (an interrupt) is
  waited for, up to its bound, before the next one starts, so two never run at once. The
  adapter's own RPCs (``install_wake``, ``report_device_id``, the recovery's
  ``drop_staged_writes``, ``cleanup``) wait on nothing outside the engine: their bound is
  :data:`CALL_BOUND_S` (``core.refit_protocol.rpc_bound`` of no waits, the engine's own
  work).
- A sleep or wake that raises is fatal for the engine. vLLM 0.32's ``CuMemAllocator``
  (vllm/device_allocator/cumem.py) unmaps or maps allocation after allocation and stops at
  the first that fails, and ``EngineCore.sleep`` (vllm/v1/engine/core.py) pauses the
  scheduler before the executor sleeps and does not resume it when that raises: the
  engine is left part-mapped and paused, while nothing says so. Any error out of
  ``LLM.sleep`` / ``LLM.wake_up`` (CUDA out of memory among them) is ``EngineDeadError``
  with it as the cause, and the engine is dead from then on. ``wake_up`` returns vLLM's
  answer, whether the engine is fully awake (``EngineCore.wake_up`` resumes scheduling
  only then; None from a vLLM that does not say).
- ``shutdown`` closes the extension's sockets and groups (``cleanup``, bounded) only when
  the engine is alive and no call still runs in it (``cleanup`` would queue behind that
  call, vllm#29390-style); it always reaches the engine's stop.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, ClassVar, Final, Generic, TypeVar, cast

import attrs

from genworker.shell.install import check_torchvision

check_torchvision()  # before vLLM or transformers load a model (docs/install.md)

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.logprobs import FlatLogprobs
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
from vllm.renderers import BaseRenderer
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Metric, Vector, get_metrics_snapshot

from genworker.core import completions
from genworker.core.assembly import FlatGenerations, Generation
from genworker.core.completions import Completion, flat_generations
from genworker.core.counters import (
    CounterSample,
    GaugeSample,
    HistogramSample,
    MetricSample,
    VectorSample,
)
from genworker.core.engine_calls import Cache, EngineBatch, RpcCall, text_refusal
from genworker.core.engine_plan import fp8_start
from genworker.core.lora import LoraRef, adapter_path
from genworker.core.multimodal import IMAGE_TOKEN_FIELDS, expanded_length, image_token_id
from genworker.core.refit_protocol import DEFAULT_TIMEOUT_S, rpc_bound
from genworker.core.requests import bos_rows
from genworker.core.routing import MOE_FIELDS, CapturePlatform, MoeShape, moe_shape, routes_of
from genworker.core.sampling import SamplingSpec
from genworker.core.scoring import ScoredRow, read_scored_row, scoring_kwargs
from genworker.shell.collector import defer_cyclic_gc
from genworker.shell.cumem_wake import install as install_wake
from genworker.shell.errors import (
    BadBatchError,
    BadConfigError,
    EngineContractError,
    EngineDeadError,
    EngineStateError,
    GenerationAbortedError,
    GenworkerError,
    Seam,
    UnsupportedError,
    fatal,
    translated,
    unwrap,
)
from genworker.shell.media import RowMedia
from genworker.shell.ports import EngineCapabilities, check_text_rows
from genworker.shell.sampled_logprobs import MARKER, install
from genworker.shell.staged_writes import drop_staged_writes
from genworker.shell.startup import checked_model

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

__all__ = [
    "VllmEngine",
    "VllmEngineBase",
    "VllmEngineFactory",
    "VllmPlatform",
    "abort_unfinished",
    "engine_arg_names",
    "engine_capabilities",
    "lora_request",
    "lora_requests",
    "sampling_params",
    "token_prompt",
]

_T = TypeVar("_T")
_Llm = TypeVar("_Llm")  # vllm.LLM or AsyncLLM
log = logging.getLogger(__name__)

#: The bound of an RPC that waits on nothing outside the engine (``install_wake``,
#: ``report_device_id``, ``drop_staged_writes``, ``cleanup``): the engine's own work.
CALL_BOUND_S: Final = rpc_bound(0, DEFAULT_TIMEOUT_S)
#: The bound of an fp8 engine's second read of its checkpoint (``prepare_fp8``): a model
#: load, which vLLM's own start does not bound either.
_LOAD_BOUND_S: Final = 1800.0
_Inflight = list[tuple[threading.Event, float]]

# Request validation raises ValueError or VLLMValidationError (a ValueError in 0.25 but
# not in 0.32, vllm/exceptions.py).
REQUEST_ERRORS = (ValueError, VLLMValidationError)


def engine_arg_names() -> frozenset[str]:
    """The installed vLLM's ``EngineArgs`` field names (``known_args`` for the engine plan)."""
    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


class VllmPlatform:
    """What both vLLM factories tell of the platform: the local GPU's compute capability
    and what the installed vLLM can do for routed-experts capture."""

    def gpu_capability(self) -> tuple[int, int] | None:
        capability = current_platform.get_device_capability()
        return None if capability is None else (capability.major, capability.minor)

    def capture_platform(self) -> CapturePlatform:
        """The installed vLLM's version and whether Triton is there (vLLM's own
        ``HAS_TRITON``, which decides whether Model Runner V2 can run)."""
        import vllm
        from vllm.triton_utils import HAS_TRITON

        major, minor = (int(part) for part in vllm.__version__.split(".")[:2])
        return CapturePlatform(vllm_version=(major, minor), triton=bool(HAS_TRITON))


class VllmEngineFactory(VllmPlatform):
    """:class:`~genworker.shell.ports.EngineFactory` for the installed vLLM."""

    def arg_names(self) -> frozenset[str] | None:
        return engine_arg_names()

    def start(self, kwargs: Mapping[str, object]) -> VllmEngine:
        return VllmEngine.start(kwargs)


def routes_shape(config: object) -> MoeShape | None:
    """The routing each output carries when the engine was started with
    ``enable_return_routed_experts`` (vLLM 0.25: ``ModelConfig``; 0.32: ``AuxOutputConfig``),
    read from the model's config as vLLM sizes its capture buffer; None otherwise."""
    model = getattr(config, "model_config", None)
    aux = getattr(config, "aux_output_config", None)
    if not (
        getattr(model, "enable_return_routed_experts", False)
        or getattr(aux, "enable_return_routed_experts", False)
    ):
        return None
    hf = getattr(model, "hf_text_config", None)
    fields = {name: getattr(hf, name, None) for name in MOE_FIELDS}
    return unwrap(moe_shape(fields, type(hf).__name__), BadConfigError, "")


def sampling_params(
    spec: SamplingSpec,
    known: frozenset[str] | None = None,
    *,
    sampled_arrays: bool = False,
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
) -> SamplingParams:
    """vLLM's ``SamplingParams`` for a spec; ``known`` (field names) drops what vLLM lacks;
    ``sampled_arrays``: marked for ``SampledLogprobs`` when the spec asks for the
    sampled logprob only and no text (an engine :func:`install` ran on keeps them so);
    ``kind``: the outputs' kind (``LLM.generate`` sets ``FINAL_ONLY`` on what it is given)."""
    # as_kwargs yields SamplingParams fields only, each typed as vLLM expects.
    kwargs = spec.as_kwargs(known)
    if sampled_arrays and spec.logprobs == 0 and not spec.detokenize:
        kwargs["extra_args"] = {MARKER: True}
    return SamplingParams(**kwargs, output_kind=kind)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=1024)
def _cached_params(
    spec: SamplingSpec,
    known: frozenset[str] | None,
    flat: bool,
    sampled_arrays: bool,
    kind: RequestOutputKind,
    n: int,
) -> SamplingParams:
    """:func:`sampling_params` made once per spec (vLLM clones them per request: the input
    processor's ``params.clone()``, 0.32), for both adapters: vLLM's flat logprobs where
    ``flat``, vLLM's ``n`` = ``n``."""
    if flat and not spec.flat_logprobs:
        spec = attrs.evolve(spec, flat_logprobs=True)
    params = sampling_params(spec, known, sampled_arrays=sampled_arrays, kind=kind)
    if n != 1:
        params.n = n
    return params


def scoring_params(top_k: int) -> SamplingParams:
    """The request that scores a sequence (``core.scoring.scoring_kwargs``), its final
    output only."""
    kwargs = scoring_kwargs(top_k)
    return SamplingParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)  # type: ignore[arg-type]


def scored_row(
    sequence: Sequence[int],
    prompt_length: int,
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
    top_k: int,
) -> ScoredRow:
    """One row of vLLM's prompt logprobs (``core.scoring.read_scored_row``); an engine
    contract error names what is missing."""
    scored = read_scored_row(sequence, prompt_length, prompt_logprobs, top_k)
    return unwrap(scored, EngineContractError, "")


def engine_capabilities(config: VllmConfig, *, weight_versions: bool = False) -> EngineCapabilities:
    """What a started engine can do, found by looking (the module docstring):
    ``weight_versions`` says whether it labels tokens with their weights (async only)."""
    model = config.model_config
    spec = config.speculative_config
    params = inspect.signature(SamplingParams).parameters
    sampling_args = frozenset(name for name in params if not name.startswith("_"))
    media = model.multimodal_config
    image_fields = {name: getattr(model.hf_config, name, None) for name in IMAGE_TOKEN_FIELDS}
    return EngineCapabilities(
        sleep_mode=current_platform.is_sleep_mode_available() and model.enable_sleep_mode,
        flat_logprobs="flat_logprobs" in sampling_args,
        vocab_size=model.get_vocab_size(),
        max_model_len=model.max_model_len,
        device=current_platform.device_type,
        sampling_args=sampling_args,
        multimodal=media is not None,
        image_token_id=None if media is None else image_token_id(image_fields),
        max_images=None if media is None else media.get_limit_per_prompt("image"),
        weight_versions=weight_versions,
        num_speculative_tokens=0 if spec is None else int(spec.num_speculative_tokens or 0),
        logprobs_mode=model.logprobs_mode,
        prefix_caching=bool(config.cache_config.enable_prefix_caching),
        max_logprobs=model.max_logprobs,
        routes=routes_shape(config),
    )


VLLM_CALLS = Seam(
    "vllm",
    (
        (
            VllmEngineDeadError,
            lambda call, e: EngineDeadError(f"{call}: the vLLM engine died: {e}"),
        ),
    ),
)
"""The one place vLLM's errors become ours (see the module docstring): every adapter call."""

# The worker's profile() raises RuntimeError when no profiler is configured
# (vllm/v1/worker/gpu_worker.py, 0.32).
VLLM_PROFILING = VLLM_CALLS.extended(
    "vllm profiling",
    (
        RuntimeError,
        lambda call, e: UnsupportedError(f"{call}: profiling is not enabled in this engine: {e}"),
    ),
)
"""``start_profile`` / ``stop_profile``: :data:`VLLM_CALLS`, and no profiler is unsupported."""


@contextmanager
def _batch_call(llm: LLM, call: str, inflight: _Inflight) -> Iterator[None]:
    """A generate call: errors translated, and the engine left with no unfinished request
    after any error (see the module docstring)."""
    try:
        with translated(VLLM_CALLS, call):
            yield
    except EngineDeadError:
        raise
    except BaseException as e:
        aborted = abort_unfinished(llm, call, e, inflight=inflight)
        if not isinstance(e, Exception) or isinstance(e, GenworkerError):
            raise
        if not aborted and isinstance(e, REQUEST_ERRORS):
            raise BadBatchError(f"{call}: vLLM rejected the request: {e}") from e
        raise GenerationAbortedError(
            f"{call}: the engine raised {type(e).__name__} while running the batch ({e}); "
            f"its {len(aborted)} unfinished requests were aborted and the engine serves "
            "the next call"
        ) from e


def abort_unfinished(
    llm: LLM, call: str, cause: BaseException, *, inflight: _Inflight | None = None
) -> list[str]:
    """The recovery of the module docstring: the ids aborted, or EngineDeadError (a drop
    past :data:`CALL_BOUND_S` stays in ``inflight``)."""
    engine = llm.llm_engine
    running = [] if inflight is None else inflight
    try:
        if not engine.has_unfinished_requests():
            return []
        ids = list(engine.output_processor.request_states)
        engine.abort_request(ids, internal=True)
        left = engine.has_unfinished_requests()
        what = "collective_rpc(drop_staged_writes)"
        drops = _bounded(
            lambda: llm.collective_rpc(drop_staged_writes),
            CALL_BOUND_S,
            what=what,
            inflight=running,
        )
        dropped = sum(drops)
    except Exception as e:
        raise EngineDeadError(
            f"{call}: the engine raised {type(cause).__name__} ({cause}) and its unfinished "
            f"requests could not be aborted: {type(e).__name__}: {e}"
        ) from e
    if left:
        raise EngineDeadError(
            f"{call}: the engine raised {type(cause).__name__} ({cause}) and still holds "
            f"unfinished requests after aborting {ids}"
        ) from cause
    if dropped:
        log.warning(
            "%s: dropped %d writes the model runner had staged for the %d aborted requests",
            call,
            dropped,
            len(ids),
        )
    return ids


class VllmEngineBase(Generic[_Llm]):
    """What both vLLM adapters share: the engine until it is shut down, its death (every
    later call refused), its capabilities, each request's ``SamplingParams``, the
    sleep-mode check, the metrics, and the renderer's tokenization and expansion of media
    rows."""

    #: where the adapter's vLLM errors become ours
    seam: ClassVar[Seam]

    def __init__(
        self, llm: _Llm, config: VllmConfig, log_stats: bool, *, weight_versions: bool = False
    ) -> None:
        self._llm: _Llm | None = llm
        self._log_stats = log_stats
        self._dead: str | None = None  # why the engine is dead (every later call refused)
        self._extension = bool(config.parallel_config.worker_extension_cls)
        self._caps = engine_capabilities(config, weight_versions=weight_versions)
        self._skip_tokenizer = config.model_config.skip_tokenizer_init
        self._sampled_arrays = False  # the sync engine's hook (sampled_logprob_arrays)

    @property
    def llm(self) -> _Llm:
        """The vLLM engine (``vllm.LLM``, or ``AsyncLLM``: vLLM's engine client, e.g. for its
        OpenAI server); EngineDeadError once it was shut down or died."""
        if self._llm is None:
            raise EngineDeadError("the vLLM engine was shut down")
        if self._dead is not None:
            raise EngineDeadError(f"the engine died earlier ({self._dead}); start a new one")
        return self._llm

    def _died(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = str(error)
            log.error("the engine died: %s", error)

    @contextmanager
    def _mortal(self) -> Iterator[None]:
        """An EngineDeadError out of the block (an RPC past its bound) kills the engine:
        every later call is refused."""
        try:
            yield
        except EngineDeadError as e:
            self._died(e)
            raise

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._caps

    @property
    def sampled_logprob_arrays(self) -> bool:
        """Whether this engine keeps the sampled logprobs of the worker's requests as arrays
        (:mod:`genworker.shell.sampled_logprobs`); False: as vLLM's flat logprobs."""
        return self._sampled_arrays

    def request_params(
        self,
        spec: SamplingSpec,
        n: int = 1,
        kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    ) -> SamplingParams:
        """A row's ``SamplingParams`` (:func:`sampling_params`, made once per spec and
        ``n``, vLLM's sample count): vLLM's flat logprobs wherever this engine has them,
        marked where it keeps arrays; ``kind``: as ``LLM.generate`` sets it."""
        caps = self._caps
        return _cached_params(
            spec, caps.sampling_args, caps.flat_logprobs, self._sampled_arrays, kind, n
        )

    @contextmanager
    def _memory(self, call: str) -> Iterator[_Llm]:
        """The engine for a sleep or wake (UnsupportedError without sleep mode), any
        failure of which kills it (the module docstring)."""
        if not self._caps.sleep_mode:
            raise UnsupportedError(
                f"{call.split('(')[0]}: sleep mode is unavailable (platform "
                f"{self._caps.device}, or the engine was started without enable_sleep_mode)"
            )
        llm = self.llm
        with fatal(call, self.seam, self._died):
            yield llm

    @staticmethod
    def _reset(cache: Cache, done: object) -> None:
        """vLLM's answer to a reset of ``cache``: a prefix cache it kept is refused."""
        if done is False:
            raise EngineStateError(cache.kept)

    def metrics(self) -> list[MetricSample]:
        """vLLM's metrics snapshot (``LLM.get_metrics`` reads it as ``AsyncLLM`` does)."""
        if not self._log_stats:
            raise UnsupportedError("metrics: the engine was started with disable_log_stats")
        self.llm  # noqa: B018 - a shut-down engine has no metrics
        with translated(self.seam, "metrics"):
            return [metric_sample(m) for m in get_metrics_snapshot()]

    def _renderer(self, call: str) -> BaseRenderer:
        """The engine's renderer (``LLM.renderer`` and ``AsyncLLM.renderer``: 0.25 and 0.32
        have it); UnsupportedError for a vLLM without one."""
        renderer = getattr(self.llm, "renderer", None)
        if not isinstance(renderer, BaseRenderer):
            name = type(self.llm).__name__
            raise UnsupportedError(f"{call}: this vLLM's {name} has no renderer to tokenize with")
        return renderer

    def tokenize(self, prompts: Sequence[str]) -> list[list[int]]:
        if self._skip_tokenizer:
            raise UnsupportedError(
                "tokenize: text prompts need a tokenizer: the engine was started with "
                "skip_tokenizer_init=True"
            )
        renderer = self._renderer("tokenize")
        try:
            with translated(VLLM_CALLS, "tokenize"):
                bos = getattr(renderer.get_tokenizer(), "bos_token", None)
                params = renderer.default_cmpl_tok_params
                plain = params.with_kwargs(add_special_tokens=False)
                ids: list[list[int]] = [[] for _ in prompts]
                for rows, row_params in zip(bos_rows(prompts, bos), (params, plain), strict=True):
                    if not rows:
                        continue
                    texts = [TextPrompt(prompt=prompts[row]) for row in rows]
                    tokenized = renderer.tokenize_prompts(texts, row_params)
                    for row, prompt in zip(rows, tokenized, strict=True):
                        ids[row] = list(prompt["prompt_token_ids"])
        except REQUEST_ERRORS as e:
            raise BadBatchError(f"tokenize: vLLM refused a prompt: {e}") from e
        return ids

    def expanded_lengths(
        self, prompts: Sequence[Sequence[int]], media: Sequence[RowMedia | None]
    ) -> list[int]:
        """How many ids each prompt holds once vLLM's processor expanded its images'
        placeholders (``render_cmpl``, as ``LLM.generate`` renders a request; a row without
        media: its own length); a row the processor refuses is a ``BadBatchError``."""
        renderer = self._renderer("expanded_lengths")
        params = renderer.default_cmpl_tok_params
        lengths = []
        for row, (prompt, row_media) in enumerate(zip(prompts, media, strict=True)):
            if row_media is None:
                lengths.append(len(prompt))
                continue
            request = token_prompt(prompt, row_media)
            try:
                (rendered,) = renderer.render_cmpl([request], params, skip_mm_cache=True)
            except (AssertionError, OSError, *REQUEST_ERRORS) as e:
                raise BadBatchError(
                    f"multi_modal_data[{row}]: vLLM's processor refused the row: "
                    f"{type(e).__name__}: {e}"
                ) from e
            expanded = expanded_length(row, len(prompt), rendered.get("prompt_token_ids"))
            lengths.append(unwrap(expanded, EngineContractError, ""))
        return lengths


class VllmEngine(VllmEngineBase[LLM]):
    """:class:`~genworker.shell.ports.EnginePort` over one ``vllm.LLM``."""

    seam = VLLM_CALLS

    def __init__(self, llm: LLM) -> None:
        super().__init__(llm, llm.llm_engine.vllm_config, llm.llm_engine.log_stats)
        self._inflight: _Inflight = []  # a call left running
        sampling_args = self._caps.sampling_args or frozenset()
        self._sampled_arrays = "extra_args" in sampling_args and install(llm.llm_engine)
        # the wake without a refused fabric create per allocation (CUDA), where it sleeps
        if self._caps.sleep_mode and self._extension:  # in each engine worker's process
            self._rpc(llm, RpcCall("install_wake", timeout=CALL_BOUND_S))
        elif self._caps.sleep_mode:
            install_wake()

    @classmethod
    def start(cls, kwargs: Mapping[str, object]) -> VllmEngine:
        """Start a ``vllm.LLM`` with these keyword arguments; failures are BadConfigError."""
        rest = dict(kwargs)
        model = checked_model(rest.pop("model", None))
        start = fp8_start(rest)
        try:
            llm = LLM(model, **start.kwargs)
        except Exception as e:
            raise BadConfigError(f"vLLM failed to start on {model!r}: {e}") from e
        engine = cls(llm)
        try:
            if llm.llm_engine.vllm_config.model_config.quantization == "fp8":
                engine._prepare_fp8(start.checkpoint_format)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _prepare_fp8(self, checkpoint_format: str | None) -> None:
        """An fp8 engine's weights as vLLM's fp8 layers take them (``shell.fp8.prepare`` in
        each engine worker): its checkpoint read in ``checkpoint_format``, quantized (the
        engine started on dummy weights: ``core.engine_plan.fp8_start``); a BadConfigError
        when it has fp8 layers genworker cannot feed."""
        if not self._extension:
            raise BadConfigError(
                "precision fp8 needs genworker's worker extension, which quantizes the weights"
            )
        prepare = RpcCall("prepare_fp8", (checkpoint_format,), timeout=_LOAD_BOUND_S)
        problems = self._rpc(self.llm, prepare)
        if problem := next((p for p in problems if p), None):
            raise BadConfigError(str(problem))

    def _call(self, call: str, act: Callable[[LLM], _T], seam: Seam = VLLM_CALLS) -> _T:
        """``act`` on the live engine (a dead one refused first), its errors mapped
        through ``seam``: every call into vLLM that needs no more than that."""
        llm = self.llm
        with translated(seam, call):
            return act(llm)

    # -- generation -----------------------------------------------------------------
    def _run(self, call: str, batch: EngineBatch[RowMedia], use_tqdm: bool) -> list[RequestOutput]:
        """The batch through ``LLM.generate`` under :func:`_batch_call` (its sample counts
        as vLLM's ``n``, its rows' adapters as LoRA requests)."""
        llm = self.llm
        with _batch_call(llm, call, self._inflight):
            counts = batch.samples or (1,) * len(batch.specs)
            made: dict[tuple[SamplingSpec, int], SamplingParams] = {}  # one lookup a distinct row
            rows_n = zip(batch.specs, counts, strict=True)
            params = [made.get(r) or made.setdefault(r, self.request_params(*r)) for r in rows_n]
            rows = zip(batch.prompts, batch.row_media(), strict=True)
            prompts = [token_prompt(prompt, media) for prompt, media in rows]
            loras = lora_requests(batch.specs)
            return llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=loras)

    @defer_cyclic_gc()
    def generate(self, batch: EngineBatch[RowMedia], *, use_tqdm: bool = False) -> FlatGenerations:
        outputs = self._run("generate", batch, use_tqdm)
        rows = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        del outputs  # the completions are now the only references to vLLM's outputs
        shape = self._caps.routes
        routes = None if shape is None else tuple(routes_of(c, shape) for c in rows)
        completions: list[CompletionOutput | None] = list(rows)
        del rows
        flat = _generations(completions, consume=True)  # each row freed once read
        return flat if routes is None else attrs.evolve(flat, routed_experts=routes)

    def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], top_k: int
    ) -> list[ScoredRow]:
        llm = self.llm
        with _batch_call(llm, "compute_logprobs", self._inflight):
            prompts = [token_prompt(s, None) for s in sequences]
            outputs = llm.generate(prompts, scoring_params(top_k), use_tqdm=False)
        return [
            scored_row(seq, start, out.prompt_logprobs, top_k)
            for seq, start, out in zip(sequences, prompt_lengths, outputs, strict=True)
        ]

    def generate_text(self, batch: EngineBatch[RowMedia], *, use_tqdm: bool = False) -> list[str]:
        if problem := text_refusal(batch.specs, batch.samples):  # one completion a prompt read
            raise ValueError(problem)
        outputs = self._run("generate_text", batch, use_tqdm)
        completions: list[CompletionOutput | None] = [out.outputs[0] for out in outputs]
        texts = [out.outputs[0].text for out in outputs]
        # The caller sees no tokens: the rows are checked here (EnginePort.generate_text).
        check_text_rows(_generations(completions, call="generate_text"), self._caps.logprobs_mode)
        return texts

    # -- memory ---------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        with self._memory(f"sleep(level={level})") as llm:
            llm.sleep(level=level)

    def wake_up(self, tags: Sequence[str] | None) -> bool | None:
        names = None if tags is None else list(tags)
        with self._memory(f"wake_up(tags={names})") as llm:
            return llm.wake_up(tags=names)

    def reset_cache(self, cache: Cache) -> None:
        self._reset(cache, self._call(cache.call, _RESETS[cache]))

    # -- observability --------------------------------------------------------------
    def start_profile(self) -> None:
        self._call("start_profile", lambda llm: llm.start_profile(), VLLM_PROFILING)

    def stop_profile(self) -> None:
        self._call("stop_profile", lambda llm: llm.stop_profile(), VLLM_PROFILING)

    # -- workers --------------------------------------------------------------------
    def collective_rpc(self, call: RpcCall) -> list[object]:
        llm = self.llm
        with self._mortal():
            _settle(self._inflight, f"collective_rpc({call.method!r})")
            return self._rpc(llm, call)

    def _rpc(self, llm: LLM, call: RpcCall) -> list[object]:
        """``LLM.collective_rpc`` of ``call``, its errors translated, waited for at most
        ``call.timeout`` (:func:`_bounded`); the adapter's own RPCs call this, not the
        :meth:`collective_rpc` a subclass may override."""
        what = f"collective_rpc({call.method!r})"
        kwargs = None if call.kwargs is None else dict(call.kwargs)
        run = functools.partial(
            llm.collective_rpc, call.method, timeout=call.timeout, args=call.args, kwargs=kwargs
        )
        with translated(VLLM_CALLS, what):
            if call.timeout is None:
                return run()
            return _bounded(run, call.timeout, what=what, inflight=self._inflight)

    def device_ids(self) -> list[str]:
        if not self._extension:
            return [self._caps.device]
        report = RpcCall("report_device_id", timeout=CALL_BOUND_S)
        return [str(d) for d in self.collective_rpc(report)]

    def shutdown(self) -> None:
        """Stop the engine and drop it; safe to call twice. The stop is always reached;
        ``cleanup`` first only on a live engine with no call running in it (see the
        module docstring), and an error of it is raised after the stop."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        # LLM has no shutdown in 0.32; its engine-core client does.
        stop = getattr(llm, "shutdown", None) or getattr(
            getattr(llm.llm_engine, "engine_core", None), "shutdown", None
        )
        try:
            if self._extension:  # close the refit sockets and groups (their private dirs)
                self._cleanup(llm)
        finally:
            try:
                if callable(stop):
                    stop()
            finally:
                del llm
                gc.collect()

    def _cleanup(self, llm: LLM) -> None:
        """The extension's ``cleanup`` in every engine worker, bounded; skipped (and
        logged) on a dead engine and behind a call still running."""
        running = sum(not done.is_set() for done, _ in self._inflight)
        if self._dead is not None or running:
            why = f"the engine died ({self._dead})" if self._dead else "a call still runs in it"
            log.warning(
                "shutdown: the refit sockets and groups are left to the engine's stop: %s", why
            )
            return
        self._rpc(llm, RpcCall("cleanup", timeout=CALL_BOUND_S))


#: vLLM's reset of each cache (``LLM`` has no encoder reset; its engine resets both halves)
_RESETS: Final[Mapping[Cache, Callable[[LLM], object]]] = {
    Cache.PREFIX: LLM.reset_prefix_cache,
    Cache.MM: LLM.reset_mm_cache,
    Cache.ENCODER: lambda llm: llm.llm_engine.reset_encoder_cache(),
}


def token_prompt(prompt: Sequence[int], media: RowMedia | None) -> TokensPrompt:
    """vLLM's request for ``prompt`` (with ``media``'s images when given)."""
    request = TokensPrompt(prompt_token_ids=list(prompt))
    if media is not None:
        request["multi_modal_data"] = media.vllm_data()
    return request


def lora_request(ref: LoraRef | None) -> LoRARequest | None:
    """vLLM's request for adapter ``ref`` (``core.lora``; None: the base model)."""
    if ref is None:
        return None
    return LoRARequest(ref.name, ref.lora_int_id, adapter_path(ref.name))


def lora_requests(specs: Sequence[SamplingSpec]) -> list[LoRARequest | None] | None:
    """Each row's adapter request; None when no row names an adapter."""
    if all(spec.adapter is None for spec in specs):
        return None
    return [lora_request(spec.adapter) for spec in specs]


def _settle(inflight: _Inflight, what: str) -> None:
    """Wait for a call left running (up to its bound) before ``what`` starts. (An event,
    not ``Thread.join``: a join interrupted by a signal can mark a running thread as
    stopped, cpython#90882.)"""
    for done, deadline in inflight:
        if not done.wait(max(deadline - time.monotonic(), 0.0)):
            raise EngineDeadError(f"{what}: an earlier engine call still runs past its bound")
    inflight.clear()


def _bounded(
    fn: Callable[[], _T],
    timeout: float,
    *,
    what: str,
    inflight: _Inflight,
) -> _T:
    """``fn()`` on a daemon thread, waited for at most ``timeout`` seconds; past it the
    call stays in ``inflight`` (it still occupies the engine)."""
    result: list[_T] = []
    error: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the waiting thread
            error.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=run, name=f"genworker {what}", daemon=True)
    inflight.append((done, time.monotonic() + timeout))
    thread.start()
    if not done.wait(timeout):  # an interrupt here leaves the call in ``inflight`` too
        raise EngineDeadError(f"{what} did not answer within {timeout:g} s")
    inflight.clear()  # answered: nothing to wait for
    if error:
        if isinstance(error[0], TimeoutError) and not isinstance(error[0], GenworkerError):
            raise EngineDeadError(f"{what} did not answer within {timeout:g} s") from error[0]
        raise error[0]
    return result[0]


def _generations(
    outs: list[CompletionOutput | None], *, consume: bool = False, call: str = "generate"
) -> FlatGenerations:
    """Every row's generation as flat arrays (``core.completions.flat_generations``), an
    engine contract error naming what vLLM got wrong."""
    flat = flat_generations(
        cast(list[Completion | None], outs), FlatLogprobs, consume=consume, call=call
    )
    return unwrap(flat, EngineContractError, "")


def generation_of(row: int, out: CompletionOutput) -> Generation:
    """One completion as a ``Generation`` (``core.completions.generation_of``)."""
    return unwrap(completions.generation_of(row, out, FlatLogprobs), EngineContractError, "")


def metric_sample(metric: Metric) -> MetricSample:
    if isinstance(metric, Counter):
        return CounterSample.from_counter(metric.name, metric.labels, metric.value)
    if isinstance(metric, Gauge):
        return GaugeSample.from_gauge(metric.name, metric.labels, metric.value)
    if isinstance(metric, Histogram):
        return HistogramSample.from_histogram(
            metric.name, metric.labels, metric.count, metric.sum, metric.buckets
        )
    if isinstance(metric, Vector):
        return VectorSample.from_vector(metric.name, metric.labels, metric.values)
    raise GenworkerError(f"metrics: unknown vLLM metric type {type(metric).__name__}")
