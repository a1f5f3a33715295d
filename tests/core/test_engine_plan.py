"""Laws and documented cases for ``genworker.core.engine_plan``."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.pipeline import is_successful
from strategies import (
    cfg_json_values,
    gpu_capabilities,
    plan_module_lists,
    user_hf_overrides,
    worker_configs,
)

from genworker.core.config import (
    ConfigError,
    FrozenMap,
    TelemetryConfig,
    WorkerConfig,
    freeze,
    thaw,
)
from genworker.core.engine_plan import (
    FP8_BASE_QUANTIZATION_CONFIG,
    FP8_CHECKPOINT_FORMATS,
    FP8_IGNORE_LIST_KEYS,
    FP8_REQUIRED_IGNORES,
    OTEL_ENDPOINT,
    OTEL_PROTOCOL,
    OTEL_TRACES_ENDPOINT,
    OTEL_TRACES_PROTOCOL,
    RESERVED_KEYS,
    UNSUPPORTED_KEYS,
    EngineKwargsPlan,
    fp8_start,
    plan_engine_kwargs,
    resolve_prefix_caching,
)

EXT = "genworker.shell.extension.WorkerExtension"
BLACKWELL = (10, 0)
seeds = st.integers(0, 2**31)


def _config(**vllm_cfg: object) -> WorkerConfig:
    d: dict[str, object] = {
        "model_name": "Qwen/Qwen3-0.6B",
        "max_new_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "_pad_token_id": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel_size": 1,
            "gpu_memory_utilization": 0.6,
            "max_model_len": 1024,
            **vllm_cfg,
        },
    }
    return WorkerConfig.from_mapping(d).unwrap()


def _with_kwargs(c: WorkerConfig, extra: Mapping[str, object]) -> WorkerConfig:
    merged = {**c.vllm_kwargs, **{k: freeze(v) for k, v in extra.items()}}
    return attrs.evolve(c, vllm_kwargs=FrozenMap.of(merged))


def _with_telemetry(
    c: WorkerConfig,
    *,
    enabled: bool,
    otlp_endpoint: str | None = None,
    otlp_protocol: str | None = None,
    otlp_traces_protocol: str | None = None,
    collect_detailed_traces: tuple[str, ...] = (),
) -> WorkerConfig:
    t = TelemetryConfig(
        enabled, otlp_endpoint, otlp_protocol, otlp_traces_protocol, collect_detailed_traces
    )
    return attrs.evolve(c, telemetry=t)


def _capability_for(c: WorkerConfig, cap: tuple[int, int] | None) -> tuple[int, int] | None:
    return BLACKWELL if c.vllm.nvfp4_per_token else cap


def _plan(
    c: WorkerConfig,
    *,
    seed: int = 7,
    cap: tuple[int, int] | None = (9, 0),
    known_args: frozenset[str] | None = None,
    sleep: bool = True,
    telemetry: Mapping[str, str] | None = None,
) -> EngineKwargsPlan:
    result = plan_engine_kwargs(
        c,
        seed=seed,
        gpu_capability=_capability_for(c, cap),
        extension_cls=EXT,
        known_args=known_args,
        enable_sleep_mode=sleep,
        telemetry=telemetry,
    )
    assert is_successful(result), result
    return result.unwrap()


def _failure(
    c: WorkerConfig,
    *,
    gpu_capability: tuple[int, int] | None = (9, 0),
    telemetry: Mapping[str, str] | None = None,
) -> ConfigError:
    result = plan_engine_kwargs(
        c, seed=1, gpu_capability=gpu_capability, extension_cls=EXT, telemetry=telemetry
    )
    assert not is_successful(result), result
    return result.failure()


def _quantization_config(plan: EngineKwargsPlan) -> Mapping[str, object]:
    hf = plan.kwargs["hf_overrides"]
    assert isinstance(hf, Mapping)
    qc = hf["quantization_config"]
    assert isinstance(qc, Mapping)
    return qc


# --- laws ------------------------------------------------------------------------------


@given(worker_configs(), seeds, gpu_capabilities, st.booleans(), st.sampled_from([EXT, "my.Ext"]))
def test_reserved_keys_always_equal_the_plan_s_own_values(
    c: WorkerConfig, seed: int, cap: tuple[int, int] | None, sleep: bool, ext: str
) -> None:
    result = plan_engine_kwargs(
        c,
        seed=seed,
        gpu_capability=_capability_for(c, cap),
        extension_cls=ext,
        enable_sleep_mode=sleep,
    )
    kwargs = result.unwrap().kwargs
    assert kwargs["worker_extension_cls"] == ext
    assert kwargs["enable_sleep_mode"] is sleep
    assert kwargs["seed"] == seed
    assert kwargs["model"] == c.model_name
    assert kwargs["max_model_len"] == c.vllm.max_model_len
    assert kwargs["tensor_parallel_size"] == c.vllm.tensor_parallel_size
    assert kwargs["pipeline_parallel_size"] == c.vllm.pipeline_parallel_size
    assert set(RESERVED_KEYS) <= set(kwargs)


@given(
    worker_configs(),
    st.dictionaries(st.sampled_from(sorted(RESERVED_KEYS)), cfg_json_values, min_size=1),
)
def test_a_user_value_for_a_reserved_key_is_an_error_naming_it(
    c: WorkerConfig, reserved: dict[str, object]
) -> None:
    error = _failure(_with_kwargs(c, reserved), gpu_capability=_capability_for(c, (9, 0)))
    assert set(error.keys) == {f"vllm_kwargs.{key}" for key in reserved}
    for key in reserved:
        assert RESERVED_KEYS[key] in error.message


@given(worker_configs(precision=st.just("fp8")), user_hf_overrides())
def test_fp8_required_ignores_are_always_present_and_user_entries_are_kept(
    c: WorkerConfig, hf: dict[str, object]
) -> None:
    qc = _quantization_config(_plan(_with_kwargs(c, {"hf_overrides": hf})))
    user_qc = hf.get("quantization_config") or {}
    assert isinstance(user_qc, dict)
    user_names = set(user_qc.get("ignored_layers", [])) | set(
        user_qc.get("modules_to_not_convert", [])
    )
    for list_key in FP8_IGNORE_LIST_KEYS:
        names = qc[list_key]
        assert isinstance(names, tuple)
        assert names[: len(FP8_REQUIRED_IGNORES)] == FP8_REQUIRED_IGNORES
        assert set(names) == set(FP8_REQUIRED_IGNORES) | user_names
        assert len(names) == len(set(names)), "no duplicates"


@given(worker_configs(precision=st.just("fp8")), user_hf_overrides())
def test_user_hf_override_keys_win_over_the_fp8_defaults(
    c: WorkerConfig, hf: dict[str, object]
) -> None:
    plan = _plan(_with_kwargs(c, {"hf_overrides": hf}))
    planned_hf = plan.kwargs["hf_overrides"]
    assert isinstance(planned_hf, Mapping)
    assert set(planned_hf) == set(hf) | {"quantization_config"}
    for key, value in hf.items():
        if key != "quantization_config":
            assert planned_hf[key] == freeze(value)
    qc = _quantization_config(plan)
    user_qc = hf.get("quantization_config") or {}
    assert isinstance(user_qc, dict)
    for key, value in FP8_BASE_QUANTIZATION_CONFIG.items():
        assert qc[key] == freeze(user_qc.get(key, value))
    for key, value in user_qc.items():
        if key not in FP8_IGNORE_LIST_KEYS:
            assert qc[key] == freeze(value)
    assert plan.kwargs["quantization"] == "fp8"
    assert plan.kwargs["dtype"] == "bfloat16"


_OVERRIDABLE = [
    "dtype",
    "enforce_eager",
    "trust_remote_code",
    "distributed_executor_backend",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "tokenizer",
    "disable_log_stats",
    "kv_cache_dtype",
    "max_num_seqs",
    "compilation_config",
]


@given(
    worker_configs(),
    st.dictionaries(st.sampled_from(_OVERRIDABLE), cfg_json_values, min_size=1),
    gpu_capabilities,
)
def test_user_vllm_kwargs_win_over_everything_not_reserved(
    c: WorkerConfig, user: dict[str, object], cap: tuple[int, int] | None
) -> None:
    kwargs = _plan(_with_kwargs(c, user), cap=cap).kwargs
    for key, value in user.items():
        assert kwargs[key] == freeze(value)


@given(
    worker_configs(),
    gpu_capabilities,
    st.sets(st.sampled_from([*RESERVED_KEYS, *_OVERRIDABLE, "quantization", "hf_overrides"]))
    | st.none(),
    st.sets(st.text("xyz_", min_size=1, max_size=5)),
)
def test_known_args_filter_never_leaves_an_unknown_key_and_loses_nothing(
    c: WorkerConfig,
    cap: tuple[int, int] | None,
    known: set[str] | None,
    unrelated: set[str],
) -> None:
    full = _plan(c, cap=cap)
    known_args = None if known is None else frozenset(known | unrelated)
    plan = _plan(c, cap=cap, known_args=known_args)
    assert full.dropped == ()
    if known_args is None:
        assert plan == full
        return
    assert set(plan.kwargs) <= known_args
    assert set(plan.kwargs) | set(plan.dropped) == set(full.kwargs)
    assert not set(plan.kwargs) & set(plan.dropped)
    assert list(plan.dropped) == sorted(plan.dropped)
    for key, value in plan.kwargs.items():
        assert full.kwargs[key] == value


@given(worker_configs(), gpu_capabilities)
def test_plan_decisions_follow_the_config(c: WorkerConfig, cap: tuple[int, int] | None) -> None:
    c = attrs.evolve(c, vllm_kwargs=FrozenMap[str, object]())
    cap = _capability_for(c, cap)
    kwargs = _plan(c, cap=cap).kwargs
    v = c.vllm
    assert kwargs["enable_prefix_caching"] == resolve_prefix_caching(v.enable_prefix_caching, cap)
    parallel = v.tensor_parallel_size * v.pipeline_parallel_size
    assert kwargs["distributed_executor_backend"] == ("ray" if parallel > 1 else "uni")
    assert kwargs["enable_expert_parallel"] == (v.expert_parallel_size > 1)
    # Dropped only when the config switches the drafter off (k == 0); kept when vLLM infers k.
    spec_on = v.speculative_config is not None and c.num_speculative_tokens != 0
    assert ("speculative_config" in kwargs) == spec_on
    if spec_on:
        assert kwargs["speculative_config"] == v.speculative_config
    env = _plan(c, cap=cap).env
    assert {k: env[k] for k in v.env_vars} == v.env_vars
    assert kwargs["dtype"] == ("bfloat16" if v.precision == "fp8" else v.precision)
    expected_quantization = (
        "fp8" if v.precision == "fp8" else "nvfp4_per_token" if v.nvfp4_per_token else None
    )
    assert kwargs.get("quantization") == expected_quantization
    assert kwargs.get("logprobs_mode") == c.logprobs_mode
    assert kwargs["trust_remote_code"] is False
    assert kwargs["disable_log_stats"] is False
    assert kwargs["tokenizer"] == c.model_name
    assert kwargs["kv_cache_dtype"] == v.kv_cache_dtype
    assert ("otlp_traces_endpoint" in kwargs) == c.telemetry.enabled


@given(st.none() | st.booleans(), gpu_capabilities)
def test_prefix_caching_explicit_wins_else_ampere_and_newer(
    explicit: bool | None, cap: tuple[int, int] | None
) -> None:
    got = resolve_prefix_caching(explicit, cap)
    if explicit is not None:
        assert got is explicit
    elif cap is None:
        assert got is False
    else:
        assert got is (cap[0] >= 8)


@given(worker_configs(), gpu_capabilities)
def test_llm_kwargs_are_plain_values_equal_to_the_plan(
    c: WorkerConfig, cap: tuple[int, int] | None
) -> None:
    plan = _plan(c, cap=cap)
    plain = plan.llm_kwargs()
    assert freeze(plain) == plan.kwargs
    assert thaw(plan.kwargs) == plain
    hash(plan)


protocols = st.none() | st.sampled_from(["grpc", "http/protobuf"])


@given(worker_configs(), protocols, protocols, protocols | st.just(""), protocols | st.just(""))
def test_traces_protocol_is_resolved_config_first_and_specific_before_generic(
    c: WorkerConfig,
    cfg_traces: str | None,
    cfg_generic: str | None,
    env_traces: str | None,
    env_generic: str | None,
) -> None:
    c = _with_telemetry(
        c,
        enabled=True,
        otlp_endpoint="http://collector:4317",
        otlp_traces_protocol=cfg_traces,
        otlp_protocol=cfg_generic,
    )
    environ = {
        var: value
        for var, value in ((OTEL_TRACES_PROTOCOL, env_traces), (OTEL_PROTOCOL, env_generic))
        if value is not None
    }
    plan = _plan(c, telemetry=environ)
    expected = next(p for p in (cfg_traces, cfg_generic, env_traces, env_generic, "grpc") if p)
    assert plan.env == {**c.vllm.env_vars, OTEL_TRACES_PROTOCOL: expected}
    assert plan.kwargs["otlp_traces_endpoint"] == "http://collector:4317"


@given(
    worker_configs(),
    st.dictionaries(st.sampled_from([OTEL_ENDPOINT, OTEL_PROTOCOL]), st.just("grpc")),
)
def test_tracing_off_adds_nothing_whatever_the_environment(
    c: WorkerConfig, environ: dict[str, str]
) -> None:
    c = _with_telemetry(c, enabled=False)
    plan = _plan(c, telemetry=environ)
    assert plan.env == c.vllm.env_vars
    assert "otlp_traces_endpoint" not in plan.kwargs
    assert "collect_detailed_traces" not in plan.kwargs


# --- documented cases ------------------------------------------------------------------


def test_the_plan_for_a_minimal_config() -> None:
    plan = _plan(_config(), seed=1024, cap=(9, 0))
    assert plan.llm_kwargs() == {
        "model": "Qwen/Qwen3-0.6B",
        "tokenizer": "Qwen/Qwen3-0.6B",
        "skip_tokenizer_init": False,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "enable_expert_parallel": False,
        "gpu_memory_utilization": 0.6,
        "max_model_len": 1024,
        "dtype": "bfloat16",
        "seed": 1024,
        "enforce_eager": False,
        "load_format": "auto",
        "kv_cache_dtype": "auto",
        "enable_prefix_caching": True,
        "enable_sleep_mode": True,
        "worker_extension_cls": EXT,
        "disable_log_stats": False,
        "trust_remote_code": False,
        "distributed_executor_backend": "uni",
    }
    assert plan.dropped == ()
    assert plan.env == {}


def test_fp8_plan_matches_nemo_rl_block_quantization() -> None:
    plan = _plan(_config(precision="fp8", kv_cache_dtype="fp8"))
    kwargs = plan.llm_kwargs()
    assert kwargs["quantization"] == "fp8"
    assert kwargs["kv_cache_dtype"] == "fp8"
    assert kwargs["hf_overrides"] == {
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "ignored_layers": ["lm_head"],
            "modules_to_not_convert": ["lm_head"],
        }
    }


def test_a_user_cannot_remove_lm_head_from_the_fp8_skip_list() -> None:
    hf = {
        "quantization_config": {
            "ignored_layers": ["lm_head"],
            "modules_to_not_convert": ["visual", "lm_head", "visual"],
        }
    }
    qc = _quantization_config(_plan(_with_kwargs(_config(precision="fp8"), {"hf_overrides": hf})))
    assert qc["ignored_layers"] == ("lm_head", "visual")
    assert qc["modules_to_not_convert"] == ("lm_head", "visual")


@pytest.mark.parametrize(
    ("hf", "key"),
    [
        ("rope", "vllm_kwargs.hf_overrides"),
        ({"quantization_config": 3}, "vllm_kwargs.hf_overrides.quantization_config"),
        (
            {"quantization_config": {"ignored_layers": "lm_head"}},
            "vllm_kwargs.hf_overrides.quantization_config.ignored_layers",
        ),
        (
            {"quantization_config": {"modules_to_not_convert": ["visual", 3]}},
            "vllm_kwargs.hf_overrides.quantization_config.modules_to_not_convert",
        ),
    ],
)
def test_fp8_needs_mergeable_hf_overrides(hf: object, key: str) -> None:
    error = _failure(_with_kwargs(_config(precision="fp8"), {"hf_overrides": hf}))
    assert error.keys == (key,)


def test_hf_overrides_pass_through_untouched_without_fp8() -> None:
    hf = {"max_position_embeddings": 4096}
    kwargs = _plan(_with_kwargs(_config(), {"hf_overrides": hf})).llm_kwargs()
    assert kwargs["hf_overrides"] == hf
    assert "quantization" not in kwargs


@given(plan_module_lists)
def test_user_quantization_must_agree_with_the_precision(names: list[str]) -> None:
    c = _config(precision="fp8")
    assert _plan(_with_kwargs(c, {"quantization": "fp8"})).kwargs["quantization"] == "fp8"
    error = _failure(_with_kwargs(c, {"quantization": "awq"}))
    assert error.keys == ("vllm_kwargs.quantization",)
    assert "precision fp8" in error.message


def test_nvfp4_per_token_uses_vllm_online_quantization_on_blackwell() -> None:
    c = _config(nvfp4_per_token=True)
    kwargs = _plan(c, cap=BLACKWELL).kwargs
    assert kwargs["quantization"] == "nvfp4_per_token"
    assert kwargs["dtype"] == "bfloat16"
    error = _failure(c, gpu_capability=(9, 0))
    assert error.keys == ("vllm_cfg.nvfp4_per_token",)
    assert "(9, 0)" in error.message
    assert "no GPU" in _failure(c, gpu_capability=None).message
    conflict = _failure(_with_kwargs(c, {"quantization": "fp8"}), gpu_capability=BLACKWELL)
    assert conflict.keys == ("vllm_kwargs.quantization",)
    assert "nvfp4_per_token" in conflict.message


def test_speculative_config_with_zero_tokens_is_dropped() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 0}
    assert "speculative_config" not in _plan(_config(speculative_config=spec)).kwargs
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    assert _plan(_config(speculative_config=spec)).llm_kwargs()["speculative_config"] == spec
    spec = {"method": "mtp"}  # vLLM infers the count from the drafter
    assert _plan(_config(speculative_config=spec)).llm_kwargs()["speculative_config"] == spec


def test_env_vars_are_exported_before_the_engine_starts() -> None:
    plan = _plan(_config(env_vars={"NCCL_DEBUG": "INFO", "MY_FLAG": 1}))
    assert dict(plan.env) == {"NCCL_DEBUG": "INFO", "MY_FLAG": "1"}


def test_tracing_from_config_with_detailed_traces() -> None:
    c = _with_telemetry(
        _config(),
        enabled=True,
        otlp_endpoint="http://otel:4318/v1/traces",
        otlp_protocol="http/protobuf",
        collect_detailed_traces=("model", "worker"),
    )
    environ = {OTEL_ENDPOINT: "http://ignored:4318", OTEL_TRACES_PROTOCOL: "grpc"}
    plan = _plan(c, telemetry=environ)
    assert plan.llm_kwargs()["otlp_traces_endpoint"] == "http://otel:4318/v1/traces"
    assert plan.llm_kwargs()["collect_detailed_traces"] == ["model", "worker"]
    assert plan.env == {OTEL_TRACES_PROTOCOL: "http/protobuf"}


@pytest.mark.parametrize(
    ("environ", "endpoint", "protocol"),
    [
        (
            {OTEL_TRACES_ENDPOINT: "http://t:4318/x", OTEL_ENDPOINT: "http://g"},
            "http://t:4318/x",
            "grpc",
        ),
        ({OTEL_ENDPOINT: "http://g:4317"}, "http://g:4317", "grpc"),
        (
            {OTEL_ENDPOINT: "http://g:4318/", OTEL_PROTOCOL: "http/protobuf"},
            "http://g:4318/v1/traces",
            "http/protobuf",
        ),
        (
            {OTEL_ENDPOINT: "http://g:4318", OTEL_TRACES_PROTOCOL: "http/protobuf"},
            "http://g:4318/v1/traces",
            "http/protobuf",
        ),
    ],
)
def test_tracing_endpoint_from_the_environment(
    environ: dict[str, str], endpoint: str, protocol: str
) -> None:
    c = _with_telemetry(_config(), enabled=True)
    plan = _plan(c, telemetry=environ)
    assert plan.kwargs["otlp_traces_endpoint"] == endpoint
    assert plan.env == {OTEL_TRACES_PROTOCOL: protocol}
    assert "collect_detailed_traces" not in plan.kwargs


def test_tracing_without_an_endpoint_or_with_an_unsupported_protocol_is_an_error() -> None:
    c = _with_telemetry(_config(), enabled=True)
    error = _failure(c)
    assert error.keys == ("telemetry.otlp_endpoint",)
    assert OTEL_ENDPOINT in error.message
    error = _failure(c, telemetry={OTEL_ENDPOINT: "http://g", OTEL_PROTOCOL: "http/json"})
    assert error.keys == (OTEL_PROTOCOL,)
    assert "http/json" in error.message


def test_every_problem_of_the_plan_is_reported_at_once() -> None:
    c = _with_telemetry(
        _with_kwargs(_config(nvfp4_per_token=True), {"seed": 3, "worker_extension_cls": "x.Y"}),
        enabled=True,
    )
    error = _failure(c, gpu_capability=None)
    assert error.keys == (
        "vllm_kwargs.seed",
        "vllm_kwargs.worker_extension_cls",
        "vllm_cfg.nvfp4_per_token",
        "telemetry.otlp_endpoint",
    )


def test_plans_are_frozen_values() -> None:
    plan = _plan(_config())
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.dropped = ("x",)  # type: ignore[misc]
    assert plan == _plan(_config())


def test_known_args_drop_what_the_installed_vllm_lacks() -> None:
    full = _plan(_config())
    older = frozenset(full.kwargs) - {"enable_expert_parallel", "kv_cache_dtype"}
    plan = _plan(_config(), known_args=older)
    assert plan.dropped == ("enable_expert_parallel", "kv_cache_dtype")
    assert set(plan.kwargs) == older


def test_explicit_prefix_caching_and_logprobs_mode_reach_the_engine() -> None:
    c = _config(enable_prefix_caching=False, logprobs_mode="processed_logprobs")
    kwargs = _plan(c, cap=(9, 0)).kwargs
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert _plan(_config(), cap=None).kwargs["enable_prefix_caching"] is False
    assert _plan(_config(), cap=(7, 5)).kwargs["enable_prefix_caching"] is False


def test_multimodal_config_keys_reach_the_engine() -> None:
    c = _config(
        limit_mm_per_prompt={"image": 2, "video": 0},
        mm_processor_kwargs={"do_image_splitting": False},
    )
    kwargs = _plan(c).llm_kwargs()
    assert kwargs["limit_mm_per_prompt"] == {"image": 2, "video": 0}
    assert kwargs["mm_processor_kwargs"] == {"do_image_splitting": False}
    assert "limit_mm_per_prompt" not in _plan(_config()).kwargs
    through_kwargs = _plan(_with_kwargs(_config(), {"limit_mm_per_prompt": {"image": 1}}))
    assert through_kwargs.llm_kwargs()["limit_mm_per_prompt"] == {"image": 1}


def test_multimodal_keys_in_both_places_or_unsupported_are_problems_naming_them() -> None:
    c = _with_kwargs(
        _config(limit_mm_per_prompt={"image": 2}),
        {"limit_mm_per_prompt": {"image": 1}, "media_io_kwargs": {"video": {"num_frames": 8}}},
    )
    error = _failure(c)
    assert error.keys == ("vllm_kwargs.media_io_kwargs", "vllm_kwargs.limit_mm_per_prompt")
    assert UNSUPPORTED_KEYS["media_io_kwargs"] in error.problems[0].message
    assert "keep one" in error.problems[1].message


@pytest.mark.parametrize("async_engine", [False, True])
@pytest.mark.parametrize("load_format", ["auto", "safetensors", "pt", "dummy", "npcache", "gguf"])
def test_an_fp8_engine_reads_its_checkpoint_in_a_format_it_can_quantize(
    async_engine: bool, load_format: str
) -> None:
    """The synchronous fp8 engine reads its checkpoint again, quantized (a format vLLM's
    loader iterates); the async one starts on dummy weights and takes them by refit."""
    c = _config(precision="fp8", load_format=load_format, async_engine=async_engine)
    readable = load_format in FP8_CHECKPOINT_FORMATS
    if load_format == "dummy" or (readable and not async_engine):
        assert _plan(c).kwargs["load_format"] == load_format
        return
    error = _failure(c)
    assert error.keys == ("vllm_cfg.load_format",)
    assert repr(load_format) in error.message
    assert ("dummy" in error.message) is async_engine
    bf16 = attrs.evolve(c, vllm=attrs.evolve(c.vllm, precision="bfloat16"))
    assert _plan(bf16).kwargs["load_format"] == load_format  # the rule is fp8's alone


@given(
    quantization=st.sampled_from([None, "fp8", "nvfp4_per_token"]),
    load_format=st.sampled_from(["auto", "safetensors", "pt", "dummy", "npcache", "gguf"]),
)
def test_an_fp8_engine_with_a_checkpoint_starts_on_dummy_weights_and_reads_it_after(
    quantization: str | None, load_format: str
) -> None:
    """vLLM's own load of a bf16 checkpoint into block-fp8 layers leaves the scales unwritten
    (NaN on CPU, a device-side assert on CUDA): the checkpoint is read after the start."""
    kwargs: dict[str, object] = {"model": "m", "load_format": load_format, "seed": 3}
    if quantization is not None:
        kwargs["quantization"] = quantization
    start = fp8_start(kwargs)
    if quantization == "fp8" and load_format in FP8_CHECKPOINT_FORMATS:
        assert start.checkpoint_format == load_format
        assert start.kwargs == {**kwargs, "load_format": "dummy"}
    else:
        assert start.checkpoint_format is None
        assert start.kwargs == kwargs
    assert kwargs["load_format"] == load_format  # the caller's mapping is not changed


# --- MoE routing replay (core.routing.plan_capture) ---
from genworker.core.routing import V2_RUNNER_ENV, CapturePlatform

_GPU_032 = CapturePlatform(vllm_version=(0, 32), triton=True)


def _routes_config(where: str, **vllm_cfg: object) -> WorkerConfig:
    if where == "vllm_cfg":
        return _config(enable_return_routed_experts=True, **vllm_cfg)
    d = _config(**vllm_cfg).to_mapping()
    d["vllm_kwargs"] = {"enable_return_routed_experts": "true"}
    return WorkerConfig.from_mapping(d).unwrap()


@pytest.mark.parametrize("where", ["vllm_cfg", "vllm_kwargs"])
def test_routes_need_the_v2_runner_and_prefix_caching_on_vllm_032(where: str) -> None:
    config = _routes_config(where)
    assert config.vllm.enable_return_routed_experts
    assert "enable_return_routed_experts" not in config.vllm_kwargs
    plan = plan_engine_kwargs(
        config, seed=1, gpu_capability=(9, 0), extension_cls=EXT, capture=_GPU_032
    ).unwrap()
    assert plan.kwargs["enable_return_routed_experts"] is True
    assert plan.kwargs["enable_prefix_caching"] is True
    assert dict(plan.env) == {V2_RUNNER_ENV: "1"}


def test_routes_on_vllm_025_take_the_flag_alone() -> None:
    config = _routes_config("vllm_cfg", enable_prefix_caching=False)
    platform = CapturePlatform(vllm_version=(0, 25), triton=True)
    plan = plan_engine_kwargs(
        config, seed=1, gpu_capability=(9, 0), extension_cls=EXT, capture=platform
    ).unwrap()
    assert plan.kwargs["enable_return_routed_experts"] is True
    assert plan.kwargs["enable_prefix_caching"] is False
    assert dict(plan.env) == {}


@pytest.mark.parametrize(
    ("platform", "reason"),
    [
        (CapturePlatform(vllm_version=(0, 32), triton=False), "needs Triton"),
        (None, "did not say"),
    ],
)
def test_routes_are_refused_where_the_platform_cannot_capture(
    platform: CapturePlatform | None, reason: str
) -> None:
    result = plan_engine_kwargs(
        _routes_config("vllm_cfg"), seed=1, gpu_capability=None, extension_cls=EXT, capture=platform
    )
    assert not is_successful(result)
    error = result.failure()
    assert [p.key for p in error.problems] == ["vllm_cfg.enable_return_routed_experts"]
    assert reason in str(error)


def test_without_routes_the_plan_has_no_capture_kwargs() -> None:
    plan = plan_engine_kwargs(
        _config(), seed=1, gpu_capability=(9, 0), extension_cls=EXT, capture=_GPU_032
    ).unwrap()
    assert "enable_return_routed_experts" not in plan.kwargs
    assert V2_RUNNER_ENV not in plan.env


def test_a_non_bool_routes_switch_is_refused_by_name() -> None:
    d = _config().to_mapping()
    d["vllm_kwargs"] = {"enable_return_routed_experts": "maybe"}
    result = WorkerConfig.from_mapping(d)
    assert not is_successful(result)
    assert "vllm_kwargs.enable_return_routed_experts" in str(result.failure())
