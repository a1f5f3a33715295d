"""The worker's configuration: NeMo-RL's generation config dict, validated into frozen values.

Theory of operation
-------------------
:meth:`WorkerConfig.from_mapping` takes the ``policy.generation`` dict NeMo-RL hands its
``VllmGenerationWorker`` *unchanged* and either returns a :class:`WorkerConfig` or a
:class:`ConfigError` that lists **every** problem at once (a user fixing a YAML file should
not have to run the job once per typo). Each :class:`ConfigProblem` names the offending key
as a dotted path (``vllm_cfg.gpu_memory_utilization``); a list entry is named by the list's
key and the message lists the offending indices.

Rules, with the vLLM behaviour they mirror (vLLM 0.32, ``vllm/sampling_params.py``
``SamplingParams._verify_args``; NeMo-RL ``vllm_generation.py`` for top_k/top_p):

* ``temperature`` finite and in ``[0, 2]``; ``top_p`` in ``(0, 1]`` (NaN rejected);
  ``top_k`` is ``None`` or absent (stored as ``-1``), ``-1`` or ``>= 1``;
  ``max_new_tokens >= 1``.
* Booleans are read as vLLM reads them (pydantic's lax bools, ``config_keys.parse_bool``):
  ``enforce_eager: "False"`` is false.
* ``stop_token_ids`` non-negative ints, ``stop_strings`` / ``bad_words`` non-empty strings;
  ``None`` or absent means none.
* ``_pad_token_id`` is required (NeMo-RL's ``configure_generation_config`` writes it; the
  padded output contract cannot be built without it).
* ``vllm_cfg``: sizes ``>= 1``, ``expert_parallel_size <= tensor_parallel_size`` (NeMo-RL
  runs vLLM's internal data parallel for EP > TP; genworker does not),
  ``gpu_memory_utilization`` in ``(0, 1]``, ``max_model_len >= 1``, ``precision`` one of
  :data:`PRECISIONS` or an alias of :data:`PRECISION_ALIASES` (stored canonical),
  ``sleep_level`` 1 or 2 (default 1), ``use_tqdm`` (default false), ``env_vars`` a mapping
  of variable names to scalars (stored as strings, as NeMo-RL's ``str(v)``),
  ``enable_return_routed_experts`` (default false; ``vllm_kwargs.enable_return_routed_experts``,
  NeMo-RL's place for it, turns it on too and is not passed on as it is:
  ``core.routing.plan_capture`` decides what vLLM gets).
* Every key has a fate in :data:`genworker.core.config_keys.KEYS`: keys of other layers
  (``colocated``, ``val_temperature``, ``expose_http_server``...) are
  kept in :attr:`WorkerConfig.extras` / :attr:`VllmConfig.extras` for their readers; keys
  genworker cannot honour (``quant_cfg``, ``use_deep_gemm: true``, ``vllm_cfg.video``...)
  and unknown keys are problems naming the key and what to use instead.
* ``speculative_config`` may sit in ``vllm_cfg`` (our place) or in ``vllm_kwargs``
  (NeMo-RL's place); it is moved into :attr:`VllmConfig.speculative_config`. Its
  ``num_speculative_tokens``, when given, is an integer ``>= 0`` (0 switches the drafter
  off, NeMo-RL's way); when absent vLLM infers it from the drafter or refuses at engine
  start, and the worker reads the engine's value for its per-request clamp. Both places at
  once is a problem, and so is an MTP drafter under ``load_format: dummy`` (NeMo-RL then
  loads the drafter's weights from disk after start; genworker does not).
  ``logprobs_mode`` likewise may be top-level or in ``vllm_cfg``.
* ``vllm_cfg.async_engine`` (a bool, default false) picks the worker: false is the
  synchronous ``vllm.LLM`` (``genworker.shell.worker.VllmGenerationWorker``), true vLLM's
  ``AsyncLLM`` (``genworker.shell.async_worker.AsyncVllmGenerationWorker``); each worker
  refuses the other's value, and ``GenerationGroup`` starts the one it names.
* ``vllm_cfg.nvfp4_per_token: true`` asks for vLLM's online per-token NVFP4 MoE
  quantization (see :mod:`genworker.core.engine_plan`); it needs 16-bit weights
  (``precision`` bfloat16 or float16).
* Multimodal keys (see :mod:`genworker.core.multimodal`): ``vllm_cfg.limit_mm_per_prompt``
  (modality -> max items per prompt, an int >= 0 or vLLM's per-modality options mapping
  with an int ``count``) and ``vllm_cfg.mm_processor_kwargs`` (a mapping: overrides for
  the model's Hugging Face processor) are honoured: both become engine arguments, and the
  worker checks each row's images against the engine's limit before submitting. NeMo-RL's
  ``vllm_cfg.video`` (its TorchCodec video contract) is refused by the key table
  (:mod:`genworker.core.config_keys`): only images are taken.
  ``vllm_cfg.reset_encoder_cache_after_weight_update``: ``true`` (the default) is what the
  worker does, resetting the encoder and multimodal caches after every refit; ``false``
  (NeMo-RL's stock value) is vacuous on a text-only model, which has no encoder cache, and
  refused when the engine turns out multimodal (:meth:`VllmConfig.encoder_reset_problem`,
  checked once the engine is up): encoder outputs of the old weights would be stale.
* ``telemetry`` (our own block, unknown keys rejected)::

      telemetry:
        enabled: false                 # turn on vLLM's native OpenTelemetry tracing
        otlp_endpoint: null            # full traces endpoint URL, passed verbatim to vLLM
        otlp_protocol: null            # generic OTLP protocol: grpc | http/protobuf
        otlp_traces_protocol: null     # traces-only protocol, wins over otlp_protocol
        collect_detailed_traces: []    # vLLM modules: model | worker | all

  Missing values may come from the process environment, resolved by
  :func:`genworker.core.engine_plan.plan_engine_kwargs`.
* ``backend``, when present, must be ``"vllm"``.
* ``stop_strings_mode`` (genworker's own key): ``per_sample`` (the default) or
  ``batch_union`` (NeMo-RL's sync ``generate``), :class:`~genworker.core.stops.StopMode`.
* ``unknown_keys`` (genworker's own key): ``refuse`` (the default) or ``warn``; under
  ``warn`` a key in no table of :mod:`genworker.core.config_keys` is kept in ``extras`` and
  listed in :attr:`WorkerConfig.warnings` instead of being a problem.
* Keys NeMo-RL's unit-test config carries (``basic_vllm_test_config``): ``dtype`` must name
  the same precision as ``vllm_cfg.precision`` (an alias of it, or ``bfloat16`` under
  ``fp8``, which computes in bfloat16); ``tokenizer`` is a mapping whose ``name``, when
  given, is ``model_name`` (the engine loads that model's tokenizer). Both are otherwise
  inert and kept in ``extras``.
* Stop strings and bad words need the engine's tokenizer: vLLM matches stop strings on
  detokenized text and turns bad words into token ids with its tokenizer, and with
  ``vllm_cfg.skip_tokenizer_init: true`` it skips both without a word
  (``vllm/v1/engine/input_processor.py``: ``update_from_tokenizer`` runs only with a
  tokenizer; no detokenizer, no stop-string match). A config that has both is refused;
  per-batch ``stop_strings`` on such an engine are refused at generate
  (:meth:`WorkerConfig.detokenizer_problem`). NeMo-RL's ``configure_generation_config``
  sets ``skip_tokenizer_init: true`` exactly when the config's ``stop_strings`` is null.
* ``vllm_cfg.reset_mm_cache_after_refit`` (NeMo-RL #3648) is read as
  ``reset_encoder_cache_after_weight_update`` is: false is refused on a multimodal engine.

Every mapping is stored as a :class:`FrozenMap` (an immutable, hashable mapping, values
frozen deeply: lists become tuples); :meth:`WorkerConfig.to_mapping` thaws them back, and
``from_mapping(to_mapping(c)) == c`` holds for every config.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final, TypeGuard, TypeVar

import attrs
from returns.result import Failure, Result, Success

from genworker.core.config_keys import UNKNOWN_KEY_POLICIES, check_keys, parse_bool
from genworker.core.errors import CoreError
from genworker.core.lora import LoraPlan, plan_lora
from genworker.core.stops import StopMode

__all__ = [
    "DETAILED_TRACE_MODULES",
    "LOGPROBS_MODES",
    "OTLP_PROTOCOLS",
    "PRECISIONS",
    "PRECISION_ALIASES",
    "ConfigError",
    "ConfigProblem",
    "FrozenMap",
    "TelemetryConfig",
    "VllmConfig",
    "WorkerConfig",
    "executor_backend",
    "freeze",
    "thaw",
]

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")

PRECISIONS: Final = frozenset({"auto", "bfloat16", "float16", "float32", "fp8"})
"""Accepted ``vllm_cfg.precision`` values (``fp8`` = bfloat16 compute + fp8 weights)."""

PRECISION_ALIASES: Final = {
    "half": "float16",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
}
"""Other spellings of :data:`PRECISIONS`: vLLM's dtype aliases (``half``, ``float``,
``vllm/config/model.py`` ``ModelDType``) and NeMo-RL's / Megatron's (``bf16``, ...)."""

LOGPROBS_MODES: Final = frozenset(
    {"raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"}
)
"""vLLM's ``LogprobsMode`` values (``vllm/config/model.py``)."""

OTLP_PROTOCOLS: Final = frozenset({"grpc", "http/protobuf"})
"""The OTLP protocols vLLM's span exporter supports (``vllm/tracing/otel.py``)."""


def executor_backend(tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """vLLM's ``distributed_executor_backend`` genworker starts an engine with: ``ray``
    when the engine spans GPUs (NeMo-RL's ``resolve_distributed_executor_backend``), else
    ``uni`` (the engine in the worker's process)."""
    return "ray" if tensor_parallel_size * pipeline_parallel_size > 1 else "uni"


DETAILED_TRACE_MODULES: Final = frozenset({"model", "worker", "all"})
"""vLLM's ``DetailedTraceModules`` (``vllm/config/observability.py``)."""

_NVFP4_PRECISIONS: Final = frozenset({"bfloat16", "float16"})


# --- frozen mappings -------------------------------------------------------------------


@attrs.frozen(eq=False)
class FrozenMap(Mapping[K, V]):
    """An immutable mapping that keeps insertion order, compares equal to any mapping with
    the same items, and hashes when its values do."""

    pairs: tuple[tuple[K, V], ...] = ()
    _index: dict[K, V] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        index = dict(self.pairs)
        if len(index) != len(self.pairs):
            raise ValueError(f"FrozenMap keys must be unique, got {[k for k, _ in self.pairs]}")
        object.__setattr__(self, "_index", index)

    @classmethod
    def of(cls, mapping: Mapping[K, V]) -> FrozenMap[K, V]:
        """A shallow frozen copy of ``mapping``."""
        return cls(tuple(mapping.items()))

    def __getitem__(self, key: K) -> V:
        return self._index[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self.pairs)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return self._index == dict(other.items())

    def __hash__(self) -> int:
        return hash(frozenset(self.pairs))


def _empty() -> FrozenMap[str, object]:
    return FrozenMap()


def freeze(value: object) -> object:
    """Deeply freeze a config value: mappings become :class:`FrozenMap`, lists and tuples
    become tuples, sets become frozensets; everything else is kept as is."""
    if isinstance(value, Mapping):
        return FrozenMap(tuple((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    if isinstance(value, set | frozenset):
        return frozenset(freeze(v) for v in value)
    return value


def thaw(value: object) -> object:
    """The inverse of :func:`freeze`, giving plain ``dict``/``list``/``set`` values (what
    vLLM and YAML expect)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    if isinstance(value, frozenset):
        return {thaw(v) for v in value}
    return value


def _freeze_str_map(mapping: Mapping[str, object]) -> FrozenMap[str, object]:
    return FrozenMap(tuple((k, freeze(v)) for k, v in mapping.items()))


def _thaw_str_map(mapping: Mapping[str, object]) -> dict[str, object]:
    return {k: thaw(v) for k, v in mapping.items()}


# --- errors ----------------------------------------------------------------------------


@attrs.frozen
class ConfigProblem:
    """One thing wrong with a config: the dotted key and what was wrong with its value."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


@attrs.frozen
class ConfigError(CoreError):
    """The config was rejected; ``problems`` lists every problem found, in input order."""

    problems: tuple[ConfigProblem, ...] = ()

    @classmethod
    def from_problems(cls, problems: Sequence[ConfigProblem]) -> ConfigError:
        n = len(problems)
        listing = "; ".join(str(p) for p in problems)
        noun = "problem" if n == 1 else "problems"
        return cls(
            message=f"invalid generation config ({n} {noun}): {listing}", problems=tuple(problems)
        )

    @property
    def keys(self) -> tuple[str, ...]:
        """The dotted keys of all problems, in order."""
        return tuple(p.key for p in self.problems)


# --- values ----------------------------------------------------------------------------


def _at_least_one(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value!r}")


def _fraction(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value!r}")


@attrs.frozen
class TelemetryConfig:
    """OpenTelemetry tracing settings (the ``telemetry`` block; see the module docstring)."""

    enabled: bool = False
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(OTLP_PROTOCOLS))
    )
    otlp_traces_protocol: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(OTLP_PROTOCOLS))
    )
    collect_detailed_traces: tuple[str, ...] = ()

    def to_mapping(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "otlp_endpoint": self.otlp_endpoint,
            "otlp_protocol": self.otlp_protocol,
            "otlp_traces_protocol": self.otlp_traces_protocol,
            "collect_detailed_traces": list(self.collect_detailed_traces),
        }


@attrs.frozen
class VllmConfig:
    """The ``vllm_cfg`` block. ``extras`` keeps every key this library does not interpret."""

    tensor_parallel_size: int = attrs.field(validator=_at_least_one)
    pipeline_parallel_size: int = attrs.field(validator=_at_least_one)
    expert_parallel_size: int = attrs.field(validator=_at_least_one)
    gpu_memory_utilization: float = attrs.field(validator=_fraction)
    max_model_len: int = attrs.field(validator=_at_least_one)
    precision: str = attrs.field(default="bfloat16", validator=attrs.validators.in_(PRECISIONS))
    enforce_eager: bool = False
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    #: vLLM's AsyncLLM (the async worker) instead of the synchronous vllm.LLM
    async_engine: bool = False
    enable_prefix_caching: bool | None = None
    cap_max_tokens_to_context: bool = False
    speculative_config: FrozenMap[str, object] | None = None
    kv_cache_dtype: str = "auto"
    sleep_level: int = attrs.field(default=1, validator=attrs.validators.in_((1, 2)))
    nvfp4_per_token: bool = False
    limit_mm_per_prompt: FrozenMap[str, object] | None = None
    mm_processor_kwargs: FrozenMap[str, object] | None = None
    use_tqdm: bool = False
    #: MoE routing replay: return the experts each token was routed to (``core.routing``)
    enable_return_routed_experts: bool = False
    env_vars: FrozenMap[str, str] = attrs.field(factory=FrozenMap)
    extras: FrozenMap[str, object] = attrs.field(factory=_empty)
    reset_encoder_cache_after_weight_update: bool = True
    #: NeMo-RL's name for the same switch (#3648); false is refused on a multimodal engine
    reset_mm_cache_after_refit: bool = True
    #: refuse a refit holding NaN or inf on the engine side (docs/refit.md); false skips it
    refit_finite_check: bool = True

    def __attrs_post_init__(self) -> None:
        if self.nvfp4_per_token and self.precision not in _NVFP4_PRECISIONS:
            raise ValueError(
                f"nvfp4_per_token needs precision bfloat16 or float16, got {self.precision!r}"
            )
        if self.expert_parallel_size > self.tensor_parallel_size:
            raise ValueError(
                f"expert_parallel_size {self.expert_parallel_size} exceeds "
                f"tensor_parallel_size {self.tensor_parallel_size}"
            )
        if self.speculative_config is not None:
            k = self.speculative_config.get("num_speculative_tokens")
            if k is not None and (not _is_int(k) or int(k) < 0):
                raise ValueError(f"speculative_config needs num_speculative_tokens >= 0, got {k!r}")

    @property
    def num_speculative_tokens(self) -> int | None:
        """Draft tokens per step: 0 when speculative decoding is off, ``None`` when the
        config leaves the count to vLLM (the running engine knows it)."""
        if self.speculative_config is None:
            return 0
        k = self.speculative_config.get("num_speculative_tokens")
        if k is None:
            return None
        assert isinstance(k, numbers.Integral)
        return int(k)

    def encoder_reset_problem(self, *, multimodal: bool) -> str | None:
        """Why this config cannot drive an engine (``multimodal`` or not), or None:
        ``reset_encoder_cache_after_weight_update: false`` asks a multimodal engine to keep
        encoder outputs of the old weights after a refit, which the worker never does."""
        if not multimodal:
            return None
        for key, resets in (
            (
                "reset_encoder_cache_after_weight_update",
                self.reset_encoder_cache_after_weight_update,
            ),
            ("reset_mm_cache_after_refit", self.reset_mm_cache_after_refit),
        ):
            if not resets:
                return (
                    f"vllm_cfg.{key}: false is refused on a multimodal model: the worker "
                    "resets the encoder and multimodal caches after every refit (encoder "
                    "outputs of the old weights would be stale); set it to true or remove it"
                )
        return None

    def to_mapping(self) -> dict[str, object]:
        out = _thaw_str_map(self.extras)
        out.update(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_len,
            precision=self.precision,
            enforce_eager=self.enforce_eager,
            load_format=self.load_format,
            skip_tokenizer_init=self.skip_tokenizer_init,
            async_engine=self.async_engine,
            enable_prefix_caching=self.enable_prefix_caching,
            cap_max_tokens_to_context=self.cap_max_tokens_to_context,
            speculative_config=None
            if self.speculative_config is None
            else thaw(self.speculative_config),
            kv_cache_dtype=self.kv_cache_dtype,
            sleep_level=self.sleep_level,
            nvfp4_per_token=self.nvfp4_per_token,
            limit_mm_per_prompt=None
            if self.limit_mm_per_prompt is None
            else thaw(self.limit_mm_per_prompt),
            mm_processor_kwargs=None
            if self.mm_processor_kwargs is None
            else thaw(self.mm_processor_kwargs),
            use_tqdm=self.use_tqdm,
            enable_return_routed_experts=self.enable_return_routed_experts,
            env_vars=dict(self.env_vars),
            reset_encoder_cache_after_weight_update=self.reset_encoder_cache_after_weight_update,
            reset_mm_cache_after_refit=self.reset_mm_cache_after_refit,
            refit_finite_check=self.refit_finite_check,
        )
        return out


@attrs.frozen
class WorkerConfig:
    """A validated NeMo-RL generation config. Build it with :meth:`from_mapping`."""

    model_name: str
    max_new_tokens: int = attrs.field(validator=_at_least_one)
    temperature: float
    top_p: float
    top_k: int
    pad_token_id: int
    vllm: VllmConfig
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs_mode: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(LOGPROBS_MODES))
    )
    vllm_kwargs: FrozenMap[str, object] = attrs.field(factory=_empty)
    telemetry: TelemetryConfig = attrs.field(factory=TelemetryConfig)
    extras: FrozenMap[str, object] = attrs.field(factory=_empty)
    #: ``stop_strings_mode``: how per-row stop strings spread over a batch
    stop_mode: StopMode = StopMode.PER_SAMPLE
    #: ``unknown_keys``: ``refuse`` or ``warn`` (see :mod:`genworker.core.config_keys`)
    unknown_keys: str = attrs.field(
        default=UNKNOWN_KEY_POLICIES[0], validator=attrs.validators.in_(UNKNOWN_KEY_POLICIES)
    )
    #: keys in no table accepted under ``unknown_keys: warn``, each with its message; the
    #: worker logs them when it starts
    warnings: tuple[ConfigProblem, ...] = ()

    def detokenizer_problem(self, per_sample_stop_strings: object) -> str | None:
        """Why a batch's own ``stop_strings`` cannot be honoured, or None: an engine
        started with ``vllm_cfg.skip_tokenizer_init: true`` has no detokenizer, and vLLM
        skips stop strings there without a word. Only a batch that carries at least one
        string is refused (``None`` rows and empty lists ask for nothing)."""
        if not self.vllm.skip_tokenizer_init or not _is_list(per_sample_stop_strings):
            return None
        assert isinstance(per_sample_stop_strings, Sequence)
        rows = [
            i
            for i, row in enumerate(per_sample_stop_strings)
            if row is not None and (not _is_list(row) or len(row) > 0)
        ]
        if not rows:
            return None
        return (
            f"stop_strings of rows {rows} cannot be honoured: the engine was started with "
            "vllm_cfg.skip_tokenizer_init: true and has no detokenizer, where vLLM skips stop "
            "strings silently; set vllm_cfg.skip_tokenizer_init: false (NeMo-RL sets it true "
            "when the config's stop_strings is null), or send no per-row stop_strings"
        )

    @property
    def num_speculative_tokens(self) -> int | None:
        """Draft tokens per step (0: off; ``None``: the engine infers it)."""
        return self.vllm.num_speculative_tokens

    @property
    def lora(self) -> LoraPlan:
        """The LoRA plan (``core.lora``) of ``vllm_kwargs`` and ``lora_refit_mode``."""
        return plan_lora(self.vllm_kwargs, self.extras.get("lora_refit_mode")).value_or(LoraPlan())

    @property
    def is_colocated(self) -> bool:
        """NeMo-RL's ``colocated.enabled`` (training and generation share GPUs)."""
        colocated = self.extras.get("colocated")
        return isinstance(colocated, Mapping) and parse_bool(colocated.get("enabled")) is True

    @classmethod
    def from_mapping(cls, m: Mapping[str, object]) -> Result[WorkerConfig, ConfigError]:
        """Validate NeMo-RL's generation config dict; every problem is reported at once."""
        raw: object = m
        if not isinstance(raw, Mapping):
            return Failure(
                ConfigError.from_problems(
                    [ConfigProblem("(config)", f"must be a mapping, got {_show(raw)}")]
                )
            )
        return _parse(raw)

    def to_mapping(self) -> dict[str, object]:
        """A NeMo-RL-shaped dict (plain ``dict``/``list`` values) that parses back to ``self``."""
        out = _thaw_str_map(self.extras)
        vllm_cfg = self.vllm.to_mapping()
        if self.logprobs_mode is not None:
            vllm_cfg["logprobs_mode"] = self.logprobs_mode
        out.update(
            backend="vllm",
            model_name=self.model_name,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=list(self.stop_token_ids),
            stop_strings=list(self.stop_strings),
            bad_words=list(self.bad_words),
            ignore_eos=self.ignore_eos,
            _pad_token_id=self.pad_token_id,
            seed=self.seed,
            vllm_cfg=vllm_cfg,
            vllm_kwargs=_thaw_str_map(self.vllm_kwargs),
            telemetry=self.telemetry.to_mapping(),
            stop_strings_mode=self.stop_mode.value,
            unknown_keys=self.unknown_keys,
        )
        return out


# --- parsing ---------------------------------------------------------------------------


class _Bad(Exception):
    """Raised by a converter; the reader turns it into a :class:`ConfigProblem`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Required:
    pass


_REQUIRED: Final = _Required()
_NO_INTS: Final[tuple[int, ...]] = ()
_NO_STRS: Final[tuple[str, ...]] = ()


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: object) -> TypeGuard[numbers.Integral]:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def _is_list(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


def _as_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _Bad(f"must be an integer, got {_show(value)}")
    return int(value)


def _int_at_least(minimum: int) -> Callable[[object], int]:
    def conv(value: object) -> int:
        out = _as_int(value)
        if out < minimum:
            raise _Bad(f"must be >= {minimum}, got {out}")
        return out

    return conv


def _as_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _Bad(f"must be a number, got {_show(value)}")
    return float(value)


def _as_bool(value: object) -> bool:
    parsed = parse_bool(value)
    if parsed is None:
        raise _Bad(f"must be true or false (or a spelling vLLM accepts), got {_show(value)}")
    return parsed


def _precision(value: object) -> str:
    if isinstance(value, str) and value in PRECISION_ALIASES:
        return PRECISION_ALIASES[value]
    if not isinstance(value, str) or value not in PRECISIONS:
        allowed = sorted(PRECISIONS | PRECISION_ALIASES.keys())
        raise _Bad(f"must be one of {allowed}, got {_show(value)}")
    return value


def _env_value(value: object) -> str:
    if isinstance(value, str | int | float):  # bools too: NeMo-RL exports str(v)
        return str(value)
    raise _Bad("")


def _env_vars(value: object) -> FrozenMap[str, str]:
    if value is None:
        return FrozenMap()
    mapping = _str_mapping(value)
    bad = [k for k in mapping if not k or "=" in k or "\0" in k]
    if bad:
        raise _Bad(f"variable names must be non-empty and hold no '=', got {bad}")
    out: list[tuple[str, str]] = []
    wrong: list[str] = []
    for k, v in mapping.items():
        try:
            out.append((k, _env_value(v)))
        except _Bad:
            wrong.append(f"{k}={_show(v)}")
    if wrong:
        raise _Bad(f"values must be strings or numbers; bad entries: {', '.join(wrong)}")
    return FrozenMap(tuple(out))


def _as_str(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise _Bad(f"must be a non-empty string, got {_show(value)}")
    return value


def _choice(allowed: frozenset[str]) -> Callable[[object], str]:
    def conv(value: object) -> str:
        if not isinstance(value, str) or value not in allowed:
            raise _Bad(f"must be one of {sorted(allowed)}, got {_show(value)}")
        return value

    return conv


def _optional(conv: Callable[[object], T]) -> Callable[[object], T | None]:
    def wrapped(value: object) -> T | None:
        return None if value is None else conv(value)

    return wrapped


def _list_of(item: Callable[[object], T], what: str) -> Callable[[object], tuple[T, ...]]:
    """A list (``None`` = empty) whose every entry passes ``item``; bad indices are listed."""

    def conv(value: object) -> tuple[T, ...]:
        if value is None:
            return ()
        if not _is_list(value):
            raise _Bad(f"must be a list of {what}, got {_show(value)}")
        assert isinstance(value, Sequence)
        out: list[T] = []
        bad: list[str] = []
        for i, entry in enumerate(value):
            try:
                out.append(item(entry))
            except _Bad:
                bad.append(f"[{i}]={_show(entry)}")
        if bad:
            raise _Bad(f"must be a list of {what}; bad entries: {', '.join(bad)}")
        return tuple(out)

    return conv


def _non_negative_int_item(value: object) -> int:
    if not _is_int(value) or int(value) < 0:
        raise _Bad("")
    return int(value)


def _str_mapping(value: object) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise _Bad(f"must be a mapping, got {_show(value)}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise _Bad(f"keys must be strings, got {', '.join(_show(k) for k in bad)}")
    return value


def _top_k(value: object) -> int:
    if value is None:
        return -1
    out = _as_int(value)
    if out != -1 and out < 1:
        raise _Bad(f"must be null, -1 (disabled) or >= 1, got {out}")
    return out


def _temperature(value: object) -> float:
    out = _as_float(value)
    if not (math.isfinite(out) and 0.0 <= out <= 2.0):
        raise _Bad(f"must be a finite number in [0, 2], got {out!r}")
    return out


def _top_p(value: object) -> float:
    out = _as_float(value)
    if not 0.0 < out <= 1.0:
        raise _Bad(f"must be in (0, 1], got {out!r}")
    return out


def _memory_fraction(value: object) -> float:
    out = _as_float(value)
    if not 0.0 < out <= 1.0:
        raise _Bad(f"must be a fraction in (0, 1], got {out!r}")
    return out


def _sleep_level(value: object) -> int:
    if not _is_int(value) or int(value) not in (1, 2):
        raise _Bad(f"must be 1 or 2, got {_show(value)}")
    return int(value)


def _backend(value: object) -> str:
    if value != "vllm":
        raise _Bad(f"must be 'vllm' for this worker, got {_show(value)}")
    return "vllm"


def _mm_limit(value: object) -> object:
    if _is_int(value) and int(value) >= 0:
        return int(value)
    if isinstance(value, Mapping):
        count = value.get("count")
        if _is_int(count) and int(count) >= 0 and all(isinstance(k, str) for k in value):
            return value
    raise _Bad("")


def _mm_limits(value: object) -> Mapping[str, object]:
    """``limit_mm_per_prompt``: modality -> an int >= 0, or vLLM's options with a ``count``."""
    limits = _str_mapping(value)
    out: dict[str, object] = {}
    bad: list[str] = []
    for modality, limit in limits.items():
        try:
            out[modality] = _mm_limit(limit)
        except _Bad:
            bad.append(f"{modality}={_show(limit)}")
    if bad:
        raise _Bad(
            "must map each modality to an int >= 0 or to options with an int count >= 0; "
            f"bad entries: {', '.join(bad)}"
        )
    return out


class _Reader:
    """Collects problems while reading; a failed read yields a typed fallback that is never
    used, because any problem turns the whole parse into a ``Failure``."""

    def __init__(self) -> None:
        self.problems: list[ConfigProblem] = []

    def add(self, key: str, message: str) -> None:
        self.problems.append(ConfigProblem(key, message))

    def failed(self, key: str) -> bool:
        return any(p.key == key for p in self.problems)

    def take(
        self,
        m: Mapping[str, object],
        key: str,
        conv: Callable[[object], T],
        fallback: T,
        *,
        prefix: str = "",
        default: T | _Required = _REQUIRED,
    ) -> T:
        path = prefix + key
        if key not in m:
            if isinstance(default, _Required):
                self.add(path, "is required")
                return fallback
            return default
        try:
            return conv(m[key])
        except _Bad as bad:
            self.add(path, bad.message)
            return fallback


_TOP_KEYS: Final = frozenset(
    {
        "backend",
        "model_name",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_token_ids",
        "stop_strings",
        "bad_words",
        "ignore_eos",
        "_pad_token_id",
        "seed",
        "logprobs_mode",
        "telemetry",
        "vllm_cfg",
        "vllm_kwargs",
        "stop_strings_mode",
        "unknown_keys",
    }
)

_VLLM_KEYS: Final = frozenset(
    {
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "expert_parallel_size",
        "gpu_memory_utilization",
        "max_model_len",
        "precision",
        "enforce_eager",
        "load_format",
        "skip_tokenizer_init",
        "async_engine",
        "enable_prefix_caching",
        "cap_max_tokens_to_context",
        "speculative_config",
        "kv_cache_dtype",
        "sleep_level",
        "logprobs_mode",
        "nvfp4_per_token",
        "limit_mm_per_prompt",
        "mm_processor_kwargs",
        "reset_encoder_cache_after_weight_update",
        "reset_mm_cache_after_refit",
        "refit_finite_check",
        "use_tqdm",
        "enable_return_routed_experts",
        "env_vars",
    }
)

_TELEMETRY_KEYS: Final = (
    "enabled",
    "otlp_endpoint",
    "otlp_protocol",
    "otlp_traces_protocol",
    "collect_detailed_traces",
)

_DEFAULT_VLLM: Final = VllmConfig(1, 1, 1, 1.0, 1)
_UNKNOWN_ACCEPTED: Final = (
    "unknown key (a typo, or a NeMo-RL key newer than genworker's table): accepted under "
    "unknown_keys: warn and has no effect in genworker"
)
_MTP_METHODS: Final = frozenset({"mtp", "deepseek_mtp"})


def _parse(m: Mapping[object, object]) -> Result[WorkerConfig, ConfigError]:
    r = _Reader()
    bad_keys = [k for k in m if not isinstance(k, str)]
    if bad_keys:
        r.add("(config)", f"keys must be strings, got {', '.join(_show(k) for k in bad_keys)}")
    top: dict[str, object] = {k: v for k, v in m.items() if isinstance(k, str)}
    unknown_keys = r.take(
        top,
        "unknown_keys",
        _choice(frozenset(UNKNOWN_KEY_POLICIES)),
        UNKNOWN_KEY_POLICIES[0],
        default=UNKNOWN_KEY_POLICIES[0],
    )
    warnings: list[ConfigProblem] = []
    for verdict in check_keys(top):
        if verdict.unknown and unknown_keys == "warn":
            warnings.append(ConfigProblem(verdict.key, _UNKNOWN_ACCEPTED))
        else:
            r.add(verdict.key, verdict.message)
    stop_mode = r.take(
        top, "stop_strings_mode", _stop_mode, StopMode.PER_SAMPLE, default=StopMode.PER_SAMPLE
    )

    r.take(top, "backend", _backend, "vllm", default="vllm")
    model_name = r.take(top, "model_name", _as_str, "")
    max_new_tokens = r.take(top, "max_new_tokens", _int_at_least(1), 1)
    temperature = r.take(top, "temperature", _temperature, 1.0)
    top_p = r.take(top, "top_p", _top_p, 1.0)
    top_k = r.take(top, "top_k", _top_k, -1, default=-1)
    stop_token_ids = r.take(
        top,
        "stop_token_ids",
        _list_of(_non_negative_int_item, "non-negative integers"),
        _NO_INTS,
        default=_NO_INTS,
    )
    stop_strings = r.take(
        top, "stop_strings", _list_of(_as_str, "non-empty strings"), _NO_STRS, default=_NO_STRS
    )
    bad_words = r.take(
        top, "bad_words", _list_of(_as_str, "non-empty strings"), _NO_STRS, default=_NO_STRS
    )
    ignore_eos = r.take(top, "ignore_eos", _as_bool, False, default=False)
    pad_token_id = r.take(top, "_pad_token_id", _int_at_least(0), 0)
    seed = r.take(top, "seed", _optional(_int_at_least(0)), None, default=None)
    top_logprobs_mode = r.take(
        top, "logprobs_mode", _optional(_choice(LOGPROBS_MODES)), None, default=None
    )
    telemetry = _parse_telemetry(r, top)

    user_kwargs = r.take(top, "vllm_kwargs", _optional(_str_mapping), None, default=None) or {}
    kwargs_spec = r.take(
        user_kwargs,
        "speculative_config",
        _optional(_str_mapping),
        None,
        prefix="vllm_kwargs.",
        default=None,
    )
    kwargs_routes = r.take(
        user_kwargs,
        "enable_return_routed_experts",
        _as_bool,
        False,
        prefix="vllm_kwargs.",
        default=False,
    )
    vllm_kwargs = _freeze_str_map(
        {
            k: v
            for k, v in user_kwargs.items()
            if k not in ("speculative_config", "enable_return_routed_experts")
        }
    )

    vllm = _DEFAULT_VLLM
    vllm_logprobs_mode: str | None = None
    vllm_raw = r.take(top, "vllm_cfg", _str_mapping, None)
    if vllm_raw is not None:
        vllm, vllm_logprobs_mode = _parse_vllm(r, vllm_raw, kwargs_spec)

    logprobs_mode = top_logprobs_mode or vllm_logprobs_mode
    if top_logprobs_mode and vllm_logprobs_mode and top_logprobs_mode != vllm_logprobs_mode:
        r.add(
            "logprobs_mode",
            f"given as {top_logprobs_mode!r} here and as {vllm_logprobs_mode!r} in "
            "vllm_cfg.logprobs_mode; keep one",
        )

    parsed_precision = None if vllm is _DEFAULT_VLLM else vllm.precision
    _check_test_config_keys(r, top, model_name, parsed_precision)
    if vllm.skip_tokenizer_init:
        for key, given in (("stop_strings", stop_strings), ("bad_words", bad_words)):
            if given:
                r.add(
                    key,
                    f"{list(given)} cannot be honoured with vllm_cfg.skip_tokenizer_init: true "
                    "(no tokenizer in the engine: vLLM skips stop strings and bad words "
                    "silently); set vllm_cfg.skip_tokenizer_init: false",
                )

    colocated = top.get("colocated")
    if colocated is not None:
        colocated_map = r.take(top, "colocated", _str_mapping, None)
        if colocated_map is not None:
            r.take(colocated_map, "enabled", _as_bool, False, prefix="colocated.", default=False)

    lora = plan_lora(user_kwargs, top.get("lora_refit_mode"))
    for problem in lora.failure() if isinstance(lora, Failure) else ():
        r.add(problem.key, problem.message)
    if r.problems:
        return Failure(ConfigError.from_problems(r.problems))
    extras = _freeze_str_map({k: v for k, v in top.items() if k not in _TOP_KEYS})
    if kwargs_routes:  # NeMo-RL's place for the switch (PR #2590); vllm_cfg's is genworker's
        vllm = attrs.evolve(vllm, enable_return_routed_experts=True)
    return Success(
        WorkerConfig(
            model_name=model_name,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            pad_token_id=pad_token_id,
            vllm=vllm,
            stop_token_ids=stop_token_ids,
            stop_strings=stop_strings,
            bad_words=bad_words,
            ignore_eos=ignore_eos,
            seed=seed,
            logprobs_mode=logprobs_mode,
            vllm_kwargs=vllm_kwargs,
            telemetry=telemetry,
            extras=extras,
            stop_mode=stop_mode,
            unknown_keys=unknown_keys,
            warnings=tuple(warnings),
        )
    )


def _stop_mode(value: object) -> StopMode:
    modes = {mode.value: mode for mode in StopMode}
    if not isinstance(value, str) or value not in modes:
        raise _Bad(f"must be one of {sorted(modes)}, got {_show(value)}")
    return modes[value]


def _check_test_config_keys(
    r: _Reader, top: Mapping[str, object], model_name: str, precision: str | None
) -> None:
    """``dtype`` and ``tokenizer`` (NeMo-RL's unit-test config): inert when they agree with
    ``vllm_cfg.precision`` and ``model_name``, refused naming the conflict otherwise."""
    if "dtype" in top:
        dtype = r.take(top, "dtype", _precision, "", default="")
        agrees = dtype in (precision, "bfloat16" if precision == "fp8" else precision)
        if dtype and precision is not None and not agrees:
            r.add(
                "dtype",
                f"{top['dtype']!r} disagrees with vllm_cfg.precision {precision!r}, the "
                "engine's dtype (NeMo-RL's worker reads vllm_cfg.precision, not dtype); make "
                "them agree or remove dtype",
            )
    tokenizer = r.take(top, "tokenizer", _optional(_str_mapping), None, default=None)
    if tokenizer is not None and "name" in tokenizer:
        name = tokenizer["name"]
        if name != model_name and not r.failed("model_name"):
            r.add(
                "tokenizer.name",
                f"{name!r} is not model_name {model_name!r}: the engine loads and detokenizes "
                "with model_name's tokenizer (as NeMo-RL's worker does); make them the same, "
                "or pass another tokenizer to vLLM as vllm_kwargs.tokenizer and remove "
                "tokenizer.name",
            )


def _parse_vllm(
    r: _Reader, v: Mapping[str, object], kwargs_spec: Mapping[str, object] | None
) -> tuple[VllmConfig, str | None]:
    p = "vllm_cfg."
    size = _int_at_least(1)
    tp = r.take(v, "tensor_parallel_size", size, 1, prefix=p)
    pp = r.take(v, "pipeline_parallel_size", size, 1, prefix=p)
    ep = r.take(v, "expert_parallel_size", size, 1, prefix=p, default=1)
    memory = r.take(v, "gpu_memory_utilization", _memory_fraction, 1.0, prefix=p)
    max_model_len = r.take(v, "max_model_len", size, 1, prefix=p)
    precision = r.take(v, "precision", _precision, "bfloat16", prefix=p, default="bfloat16")
    enforce_eager = r.take(v, "enforce_eager", _as_bool, False, prefix=p, default=False)
    load_format = r.take(v, "load_format", _as_str, "auto", prefix=p, default="auto")
    skip_tokenizer_init = r.take(v, "skip_tokenizer_init", _as_bool, False, prefix=p, default=False)
    async_engine = r.take(v, "async_engine", _as_bool, False, prefix=p, default=False)
    prefix_caching = r.take(
        v, "enable_prefix_caching", _optional(_as_bool), None, prefix=p, default=None
    )
    cap = r.take(v, "cap_max_tokens_to_context", _as_bool, False, prefix=p, default=False)
    kv_cache_dtype = r.take(v, "kv_cache_dtype", _as_str, "auto", prefix=p, default="auto")
    sleep_level = r.take(v, "sleep_level", _sleep_level, 1, prefix=p, default=1)
    nvfp4 = r.take(v, "nvfp4_per_token", _as_bool, False, prefix=p, default=False)
    use_tqdm = r.take(v, "use_tqdm", _as_bool, False, prefix=p, default=False)
    routes = r.take(v, "enable_return_routed_experts", _as_bool, False, prefix=p, default=False)
    no_env: FrozenMap[str, str] = FrozenMap()
    env_vars = r.take(v, "env_vars", _env_vars, no_env, prefix=p, default=no_env)
    logprobs_mode = r.take(
        v, "logprobs_mode", _optional(_choice(LOGPROBS_MODES)), None, prefix=p, default=None
    )
    mm_limits = r.take(
        v, "limit_mm_per_prompt", _optional(_mm_limits), None, prefix=p, default=None
    )
    mm_kwargs = r.take(
        v, "mm_processor_kwargs", _optional(_str_mapping), None, prefix=p, default=None
    )
    encoder_reset = r.take(
        v, "reset_encoder_cache_after_weight_update", _as_bool, True, prefix=p, default=True
    )
    mm_reset = r.take(v, "reset_mm_cache_after_refit", _as_bool, True, prefix=p, default=True)
    finite = r.take(v, "refit_finite_check", _as_bool, True, prefix=p, default=True)

    spec_raw = r.take(
        v, "speculative_config", _optional(_str_mapping), None, prefix=p, default=None
    )
    spec_prefix = p
    if kwargs_spec is not None:
        if spec_raw is not None:
            r.add(
                "vllm_kwargs.speculative_config",
                "also given as vllm_cfg.speculative_config; keep one",
            )
        spec_raw, spec_prefix = kwargs_spec, "vllm_kwargs."
    speculative_config: FrozenMap[str, object] | None = None
    if spec_raw is not None:
        r.take(
            spec_raw,
            "num_speculative_tokens",
            _optional(_int_at_least(0)),
            0,
            prefix=f"{spec_prefix}speculative_config.",
            default=None,
        )
        speculative_config = _freeze_str_map(spec_raw)
        if load_format == "dummy" and spec_raw.get("method") in _MTP_METHODS:
            r.add(
                f"{spec_prefix}speculative_config.method",
                f"an MTP drafter ({spec_raw.get('method')!r}) under vllm_cfg.load_format "
                "'dummy' keeps random drafter weights: NeMo-RL loads them from disk after "
                "start, genworker does not; use load_format 'auto'",
            )

    # NeMo-RL derives both from the sizes and ignores the keys; a value that agrees is
    # accepted (it stays in extras), one that asks for something else is refused
    wants_ep = r.take(
        v, "enable_expert_parallel", _optional(_as_bool), None, prefix=p, default=None
    )
    backend = r.take(
        v, "distributed_executor_backend", _optional(_as_str), None, prefix=p, default=None
    )
    sizes_ok = not r.failed(p + "tensor_parallel_size") and not r.failed(p + "expert_parallel_size")
    if sizes_ok and wants_ep is not None and wants_ep != (ep > 1):
        r.add(
            p + "enable_expert_parallel",
            f"{wants_ep} contradicts expert_parallel_size {ep}: genworker enables expert "
            "parallelism exactly when expert_parallel_size > 1 (as NeMo-RL does); set "
            "expert_parallel_size or remove the key",
        )
    if backend is not None and not r.failed(p + "pipeline_parallel_size") and sizes_ok:
        planned = executor_backend(tp, pp)
        if backend != planned:
            r.add(
                p + "distributed_executor_backend",
                f"{backend!r} is not the executor genworker starts for tensor_parallel_size "
                f"{tp} x pipeline_parallel_size {pp} ({planned!r}: 'ray' when their product "
                "is > 1, else 'uni'); leave it null",
            )
    if sizes_ok and ep > tp:
        r.add(
            p + "expert_parallel_size",
            f"{ep} exceeds tensor_parallel_size {tp}: expert parallelism beyond the "
            "tensor-parallel group needs vLLM's internal data parallel, which genworker "
            "does not set up; use expert_parallel_size <= tensor_parallel_size and "
            "data-parallel shards (GenerationGroup) instead",
        )

    if nvfp4 and not r.failed(p + "precision") and precision not in _NVFP4_PRECISIONS:
        r.add(
            p + "nvfp4_per_token",
            f"needs 16-bit weights (precision bfloat16 or float16), got precision {precision!r}",
        )
    if r.problems:
        return _DEFAULT_VLLM, logprobs_mode
    extras = _freeze_str_map({k: val for k, val in v.items() if k not in _VLLM_KEYS})
    config = VllmConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        expert_parallel_size=ep,
        gpu_memory_utilization=memory,
        max_model_len=max_model_len,
        precision=precision,
        enforce_eager=enforce_eager,
        load_format=load_format,
        skip_tokenizer_init=skip_tokenizer_init,
        async_engine=async_engine,
        enable_prefix_caching=prefix_caching,
        cap_max_tokens_to_context=cap,
        speculative_config=speculative_config,
        kv_cache_dtype=kv_cache_dtype,
        sleep_level=sleep_level,
        nvfp4_per_token=nvfp4,
        limit_mm_per_prompt=None if mm_limits is None else _freeze_str_map(mm_limits),
        mm_processor_kwargs=None if mm_kwargs is None else _freeze_str_map(mm_kwargs),
        use_tqdm=use_tqdm,
        enable_return_routed_experts=routes,
        env_vars=env_vars,
        extras=extras,
        reset_encoder_cache_after_weight_update=encoder_reset,
        reset_mm_cache_after_refit=mm_reset,
        refit_finite_check=finite,
    )
    return config, logprobs_mode


def _parse_telemetry(r: _Reader, top: Mapping[str, object]) -> TelemetryConfig:
    t = r.take(top, "telemetry", _optional(_str_mapping), None, default=None)
    if t is None:
        return TelemetryConfig()
    p = "telemetry."
    for key in t:
        if key not in _TELEMETRY_KEYS:
            r.add(p + key, f"unknown key; known keys are {', '.join(_TELEMETRY_KEYS)}")
    protocol = _optional(_choice(OTLP_PROTOCOLS))
    enabled = r.take(t, "enabled", _as_bool, False, prefix=p, default=False)
    endpoint = r.take(t, "otlp_endpoint", _optional(_as_str), None, prefix=p, default=None)
    otlp_protocol = r.take(t, "otlp_protocol", protocol, None, prefix=p, default=None)
    traces_protocol = r.take(t, "otlp_traces_protocol", protocol, None, prefix=p, default=None)
    detailed = r.take(
        t,
        "collect_detailed_traces",
        _list_of(_choice(DETAILED_TRACE_MODULES), f"one of {sorted(DETAILED_TRACE_MODULES)}"),
        _NO_STRS,
        prefix=p,
        default=_NO_STRS,
    )
    if r.problems:
        return TelemetryConfig()
    return TelemetryConfig(
        enabled=enabled,
        otlp_endpoint=endpoint,
        otlp_protocol=otlp_protocol,
        otlp_traces_protocol=traces_protocol,
        collect_detailed_traces=detailed,
    )
