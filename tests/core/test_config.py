"""Laws and documented cases for ``genworker.core.config``."""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Mapping

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.pipeline import is_successful
from returns.result import Success
from strategies import (
    broken_nemo_config_dicts,
    cfg_json_values,
    nemo_config_dicts,
    wild_nemo_config_dicts,
    worker_configs,
)

from genworker.core.config import (
    ConfigError,
    ConfigProblem,
    FrozenMap,
    TelemetryConfig,
    VllmConfig,
    WorkerConfig,
    freeze,
    thaw,
)
from genworker.core.errors import CoreError


def _minimal() -> dict[str, object]:
    return {
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
        },
    }


def _parse(d: Mapping[str, object]) -> WorkerConfig:
    return WorkerConfig.from_mapping(d).unwrap()


def _problems(d: object) -> ConfigError:
    result = WorkerConfig.from_mapping(d)  # type: ignore[arg-type]
    assert not is_successful(result), result
    return result.failure()


def _is_plain(value: object) -> bool:
    """True when no frozen container is left (what YAML and vLLM expect)."""
    if isinstance(value, FrozenMap | tuple | frozenset):
        return False
    if isinstance(value, dict):
        return all(_is_plain(v) for v in value.values())
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    return True


# --- laws ------------------------------------------------------------------------------


@given(nemo_config_dicts())
def test_every_valid_nemo_dict_parses_to_its_values(d: dict[str, object]) -> None:
    c = _parse(d)
    v = d["vllm_cfg"]
    assert isinstance(v, dict)
    assert c.model_name == d["model_name"]
    assert c.max_new_tokens == d["max_new_tokens"]
    assert c.temperature == d["temperature"]
    assert c.top_p == d["top_p"]
    assert c.top_k == (-1 if d["top_k"] is None else d["top_k"])
    assert c.stop_token_ids == tuple(d["stop_token_ids"] or ())  # type: ignore[arg-type]
    assert c.stop_strings == tuple(d["stop_strings"] or ())  # type: ignore[arg-type]
    assert c.bad_words == tuple(d.get("bad_words") or ())  # type: ignore[arg-type]
    assert c.pad_token_id == d["_pad_token_id"]
    assert c.seed == d.get("seed")
    assert c.vllm.tensor_parallel_size == v["tensor_parallel_size"]
    assert c.vllm.max_model_len == v["max_model_len"]
    assert c.vllm.gpu_memory_utilization == v["gpu_memory_utilization"]
    assert c.vllm.precision == v.get("precision", "bfloat16")
    assert c.vllm.sleep_level == v.get("sleep_level", 1)
    assert c.vllm.enable_prefix_caching == v.get("enable_prefix_caching")
    assert c.logprobs_mode == d.get("logprobs_mode", v.get("logprobs_mode"))
    assert c.is_colocated == bool(
        isinstance(d.get("colocated"), dict) and d["colocated"]["enabled"]  # type: ignore[index]
    )


@given(worker_configs())
def test_to_mapping_round_trips_and_is_plain(c: WorkerConfig) -> None:
    m = c.to_mapping()
    assert _is_plain(m)
    again = _parse(m)
    assert again == c
    assert hash(again) == hash(c)


@given(nemo_config_dicts())
def test_parsing_does_not_mutate_the_input(d: dict[str, object]) -> None:
    before = copy.deepcopy(d)
    WorkerConfig.from_mapping(d)
    assert d == before


@given(broken_nemo_config_dicts())
def test_every_problem_is_reported_at_once(
    broken: tuple[dict[object, object], frozenset[str]],
) -> None:
    mapping, expected = broken
    error = _problems(mapping)
    assert set(error.keys) == expected
    assert len(error.keys) == len(set(error.keys)), "one problem per key"
    for problem in error.problems:
        assert problem.message
        assert str(problem) in error.message
    assert str(error) == error.message


@given(
    nemo_config_dicts(),
    st.dictionaries(st.text("abc_", min_size=1).map("z_".__add__), cfg_json_values, max_size=4),
    st.sampled_from(["top", "vllm_cfg"]),
)
def test_unknown_keys_are_refused_by_name(
    d: dict[str, object], extra: dict[str, object], where: str
) -> None:
    target = d if where == "top" else d["vllm_cfg"]
    assert isinstance(target, dict)
    target.update(extra)
    if not extra:
        assert isinstance(WorkerConfig.from_mapping(d), Success)
        return
    error = _problems(d)
    prefix = "" if where == "top" else "vllm_cfg."
    assert set(error.keys) == {prefix + key for key in extra}
    assert "unknown key" in error.message


@given(nemo_config_dicts(), st.sampled_from(["val_top_p", "_debug_payload_metrics"]))
def test_keys_of_other_layers_are_kept_for_them(d: dict[str, object], key: str) -> None:
    d[key] = 0.5
    assert _parse(d).extras[key] == 0.5
    v = d["vllm_cfg"]
    assert isinstance(v, dict)
    v["expose_http_server"] = [1]
    assert thaw(_parse(d).vllm.extras["expose_http_server"]) == [1]


@given(wild_nemo_config_dicts())
def test_any_mapping_gives_a_config_or_a_config_error(d: dict[object, object]) -> None:
    result = WorkerConfig.from_mapping(d)  # type: ignore[arg-type]
    if isinstance(result, Success):
        c = result.unwrap()
        assert math.isfinite(c.temperature)
        assert 0.0 <= c.temperature <= 2.0
        assert 0.0 < c.top_p <= 1.0
        assert c.top_k == -1 or c.top_k >= 1
        k = c.num_speculative_tokens
        assert k is None or k >= 0
        assert 0.0 < c.vllm.gpu_memory_utilization <= 1.0
    else:
        error = result.failure()
        assert error.problems
        assert all(isinstance(p.key, str) and p.key and p.message for p in error.problems)


@given(st.floats() | st.integers(-5, 5) | st.none() | st.booleans())
def test_temperature_is_accepted_exactly_when_vllm_accepts_it(t: object) -> None:
    d = _minimal() | {"temperature": t}
    ok = (
        isinstance(t, int | float)
        and not isinstance(t, bool)
        and math.isfinite(t)
        and 0.0 <= t <= 2.0
    )
    result = WorkerConfig.from_mapping(d)
    assert isinstance(result, Success) == ok
    if not ok:
        assert result.failure().keys == ("temperature",)


@given(st.floats() | st.integers(-2, 2))
def test_top_p_is_accepted_exactly_in_the_half_open_unit_interval(p: float) -> None:
    result = WorkerConfig.from_mapping(_minimal() | {"top_p": p})
    assert isinstance(result, Success) == (0.0 < p <= 1.0)


@given(st.none() | st.integers(-1000, 1000))
def test_top_k_is_none_minus_one_or_positive(k: int | None) -> None:
    result = WorkerConfig.from_mapping(_minimal() | {"top_k": k})
    assert isinstance(result, Success) == (k is None or k == -1 or k >= 1)
    if k is None:
        assert result.unwrap().top_k == -1


@given(cfg_json_values)
def test_freeze_is_hashable_and_thaw_inverts_it(value: object) -> None:
    frozen = freeze(value)
    hash(frozen)
    assert thaw(frozen) == value
    assert freeze(thaw(frozen)) == frozen


# --- documented cases ------------------------------------------------------------------


def test_a_nemo_rl_grpo_generation_block_parses_unchanged() -> None:
    d = {
        "backend": "vllm",
        "max_new_tokens": 512,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "val_temperature": 1.0,
        "stop_token_ids": None,
        "stop_strings": None,
        "model_name": "Qwen/Qwen2.5-1.5B",
        "_pad_token_id": 151643,
        "vllm_cfg": {
            "async_engine": False,
            "precision": "bfloat16",
            "kv_cache_dtype": "auto",
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel_size": 1,
            "gpu_memory_utilization": 0.6,
            "max_model_len": 512,
            "enforce_eager": False,
            "use_deep_gemm": False,
            "num_last_layers_in_bf16": 0,
            "num_first_layers_in_bf16": 0,
            "expose_http_server": False,
            "skip_tokenizer_init": True,
            "load_format": "dummy",
        },
        "vllm_kwargs": {},
        "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
    }
    c = _parse(d)
    assert c.is_colocated
    assert c.vllm.load_format == "dummy"
    assert c.vllm.skip_tokenizer_init
    assert c.vllm.extras == {
        "use_deep_gemm": False,
        "num_last_layers_in_bf16": 0,
        "num_first_layers_in_bf16": 0,
        "expose_http_server": False,
    }
    assert c.extras["val_temperature"] == 1.0
    assert c.num_speculative_tokens == 0


def test_missing_block_is_one_problem_not_one_per_nested_key() -> None:
    d = _minimal()
    del d["vllm_cfg"]
    assert _problems(d).keys == ("vllm_cfg",)
    assert _problems(d).problems[0] == ConfigProblem("vllm_cfg", "is required")


def test_problem_keys_are_dotted_paths_and_the_message_names_values() -> None:
    d = _minimal()
    d["vllm_cfg"] = dict(d["vllm_cfg"], gpu_memory_utilization=1.5)  # type: ignore[call-overload]
    d["stop_token_ids"] = [3, -1, 7, -9]
    error = _problems(d)
    assert error.keys == ("stop_token_ids", "vllm_cfg.gpu_memory_utilization")
    assert "[1]=-1" in error.message
    assert "[3]=-9" in error.message
    assert "got 1.5" in error.message
    assert error.message.startswith("invalid generation config (2 problems): ")
    assert isinstance(error, CoreError)


def test_one_problem_is_singular() -> None:
    error = _problems(_minimal() | {"max_new_tokens": 0})
    assert (
        error.message
        == "invalid generation config (1 problem): max_new_tokens: must be >= 1, got 0"
    )


def test_a_non_mapping_is_rejected_as_a_whole() -> None:
    error = _problems(["not", "a", "mapping"])
    assert error.keys == ("(config)",)
    assert "must be a mapping" in error.message


def test_mapping_keys_must_be_strings_where_they_become_kwargs() -> None:
    error = _problems(_minimal() | {"vllm_kwargs": {1: "x"}})
    assert error.keys == ("vllm_kwargs",)
    assert "keys must be strings" in error.message


def test_speculative_config_in_vllm_kwargs_moves_to_vllm_cfg() -> None:
    spec = {"method": "eagle3", "model": "draft", "num_speculative_tokens": 3}
    c = _parse(_minimal() | {"vllm_kwargs": {"speculative_config": spec, "max_num_seqs": 8}})
    assert c.num_speculative_tokens == 3
    assert c.vllm.speculative_config == spec
    assert "speculative_config" not in c.vllm_kwargs
    assert c.vllm_kwargs == {"max_num_seqs": 8}
    assert c.to_mapping()["vllm_cfg"]["speculative_config"] == spec  # type: ignore[index]


def test_speculative_config_may_leave_its_token_count_to_vllm() -> None:
    """vLLM infers num_speculative_tokens from an MTP drafter (SpeculativeConfig): the
    config may leave it out, the worker then reads the engine's count."""
    d = _minimal()
    d["vllm_cfg"] = dict(d["vllm_cfg"], speculative_config={"method": "mtp"})  # type: ignore[call-overload]
    c = _parse(d)
    assert c.num_speculative_tokens is None
    assert c.vllm.speculative_config == {"method": "mtp"}
    assert _parse(c.to_mapping()) == c
    d["vllm_cfg"]["speculative_config"] = {"method": "mtp", "num_speculative_tokens": -1}  # type: ignore[index]
    error = _problems(d)
    assert error.keys == ("vllm_cfg.speculative_config.num_speculative_tokens",)
    assert ">= 0" in error.message


def test_an_mtp_drafter_under_a_dummy_load_is_refused() -> None:
    d = _minimal()
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 1}
    d["vllm_kwargs"] = {"speculative_config": spec}
    d["vllm_cfg"] = dict(d["vllm_cfg"], load_format="dummy")  # type: ignore[call-overload]
    error = _problems(d)
    assert error.keys == ("vllm_kwargs.speculative_config.method",)
    assert "load_format 'auto'" in error.message
    d["vllm_cfg"]["load_format"] = "auto"  # type: ignore[index]
    assert _parse(d).num_speculative_tokens == 1


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("bf16", "bfloat16"),
        ("half", "float16"),
        ("fp16", "float16"),
        ("float", "float32"),
        ("fp32", "float32"),
        ("bfloat16", "bfloat16"),
        ("fp8", "fp8"),
        ("auto", "auto"),
    ],
)
def test_precision_aliases_vllm_and_nemo_rl_accept_are_stored_canonical(
    given: str, stored: str
) -> None:
    d = _minimal()
    d["vllm_cfg"] = dict(d["vllm_cfg"], precision=given)  # type: ignore[call-overload]
    c = _parse(d)
    assert c.vllm.precision == stored
    assert c.to_mapping()["vllm_cfg"]["precision"] == stored  # type: ignore[index]


@pytest.mark.parametrize(
    ("given", "value"),
    [
        ("False", False),
        ("false", False),
        ("0", False),
        ("no", False),
        ("off", False),
        (0, False),
        ("True", True),
        ("yes", True),
        ("ON", True),
        (1, True),
        (True, True),
    ],
)
def test_booleans_are_read_as_vllm_reads_them(given: object, value: bool) -> None:
    d = _minimal() | {"ignore_eos": given}
    d["vllm_cfg"] = dict(d["vllm_cfg"], enforce_eager=given, use_tqdm=given)  # type: ignore[call-overload]
    c = _parse(d)
    assert (c.vllm.enforce_eager, c.vllm.use_tqdm, c.ignore_eos) == (value, value, value)


@pytest.mark.parametrize("given", ["Flase", "", 2, 0.5, None, [True]])
def test_other_boolean_spellings_are_refused(given: object) -> None:
    d = _minimal()
    d["vllm_cfg"] = dict(d["vllm_cfg"], enforce_eager=given)  # type: ignore[call-overload]
    assert _problems(d).keys == ("vllm_cfg.enforce_eager",)


def test_a_missing_top_k_is_off() -> None:
    d = _minimal()
    del d["top_k"]
    assert _parse(d).top_k == -1


def test_env_vars_are_kept_as_strings_as_nemo_rl_exports_them() -> None:
    d = _minimal()
    d["vllm_cfg"] = dict(d["vllm_cfg"], env_vars={"A": 1, "B_X": "x", "C": True, "D": 0.5})  # type: ignore[call-overload]
    c = _parse(d)
    assert dict(c.vllm.env_vars) == {"A": "1", "B_X": "x", "C": "True", "D": "0.5"}
    d["vllm_cfg"]["env_vars"] = None  # type: ignore[index]
    assert dict(_parse(d).vllm.env_vars) == {}
    d["vllm_cfg"]["env_vars"] = {"A=B": "1", "C": [1]}  # type: ignore[index]
    assert _problems(d).keys == ("vllm_cfg.env_vars",)
    d["vllm_cfg"]["env_vars"] = {"C": [1]}  # type: ignore[index]
    assert "C=[1]" in _problems(d).message


def test_expert_parallel_beyond_tensor_parallel_is_refused() -> None:
    d = _minimal()
    d["vllm_cfg"] = dict(d["vllm_cfg"], tensor_parallel_size=2, expert_parallel_size=4)  # type: ignore[call-overload]
    error = _problems(d)
    assert error.keys == ("vllm_cfg.expert_parallel_size",)
    assert "data parallel" in error.message


def test_logprobs_mode_may_be_given_in_both_places_when_equal() -> None:
    d = _minimal() | {"logprobs_mode": "processed_logprobs"}
    d["vllm_cfg"] = dict(d["vllm_cfg"], logprobs_mode="processed_logprobs")  # type: ignore[call-overload]
    c = _parse(d)
    assert c.logprobs_mode == "processed_logprobs"
    assert c.to_mapping()["vllm_cfg"]["logprobs_mode"] == "processed_logprobs"  # type: ignore[index]


def test_nvfp4_needs_sixteen_bit_weights() -> None:
    d = _minimal()
    d["vllm_cfg"] = dict(d["vllm_cfg"], nvfp4_per_token=True, precision="fp8")  # type: ignore[call-overload]
    error = _problems(d)
    assert error.keys == ("vllm_cfg.nvfp4_per_token",)
    assert "precision 'fp8'" in error.message
    d["vllm_cfg"]["precision"] = "float16"  # type: ignore[index]
    assert _parse(d).vllm.nvfp4_per_token


def test_telemetry_block_defaults_and_rejects_unknown_keys() -> None:
    assert _parse(_minimal()).telemetry == TelemetryConfig()
    assert _parse(_minimal() | {"telemetry": None}).telemetry == TelemetryConfig()
    t = {
        "enabled": True,
        "otlp_endpoint": "http://otel:4318/v1/traces",
        "otlp_protocol": "grpc",
        "otlp_traces_protocol": "http/protobuf",
        "collect_detailed_traces": ["model", "worker"],
    }
    c = _parse(_minimal() | {"telemetry": t})
    assert c.telemetry == TelemetryConfig(
        True, "http://otel:4318/v1/traces", "grpc", "http/protobuf", ("model", "worker")
    )
    error = _problems(_minimal() | {"telemetry": {"enable": True}})
    assert error.keys == ("telemetry.enable",)
    assert "unknown key" in error.message


def test_colocated_none_means_not_colocated() -> None:
    assert not _parse(_minimal() | {"colocated": None}).is_colocated
    assert not _parse(_minimal()).is_colocated


def test_config_values_are_frozen_and_hashable() -> None:
    c = _parse(_minimal() | {"vllm_kwargs": {"hf_overrides": {"rope_scaling": {"factor": 2.0}}}})
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.temperature = 0.5  # type: ignore[misc]
    assert isinstance(c.vllm_kwargs["hf_overrides"], FrozenMap)
    assert {c: 1}[_parse(c.to_mapping())] == 1


def test_direct_construction_enforces_the_same_invariants() -> None:
    ok = VllmConfig(1, 1, 1, 0.5, 128)
    assert ok.num_speculative_tokens == 0
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VllmConfig(0, 1, 1, 0.5, 128)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VllmConfig(1, 1, 1, 1.5, 128)
    with pytest.raises(ValueError, match="precision"):
        VllmConfig(1, 1, 1, 0.5, 128, precision="fp9")
    with pytest.raises(ValueError, match="nvfp4_per_token"):
        VllmConfig(1, 1, 1, 0.5, 128, precision="fp8", nvfp4_per_token=True)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        VllmConfig(
            1, 1, 1, 0.5, 128, speculative_config=FrozenMap((("num_speculative_tokens", -1),))
        )
    with pytest.raises(ValueError, match="expert_parallel_size"):
        VllmConfig(1, 1, 2, 0.5, 128)
    spec = VllmConfig(1, 1, 1, 0.5, 128, speculative_config=FrozenMap((("method", "mtp"),)))
    assert spec.num_speculative_tokens is None
    with pytest.raises(ValueError, match="logprobs_mode"):
        WorkerConfig("m", 1, 1.0, 1.0, -1, 0, ok, logprobs_mode="logits")
    with pytest.raises(ValueError, match="otlp_protocol"):
        TelemetryConfig(otlp_protocol="http/json")


def test_frozen_map_behaves_like_a_read_only_mapping() -> None:
    m = FrozenMap.of({"b": 1, "a": [2]})
    assert list(m) == ["b", "a"]
    assert len(m) == 2
    assert "a" in m
    assert "z" not in m
    assert m == {"a": [2], "b": 1}
    assert m != {"a": [2]}
    assert m != 3
    assert FrozenMap((("a", 1), ("b", 2))) == FrozenMap((("b", 2), ("a", 1)))
    assert hash(FrozenMap((("a", 1), ("b", 2)))) == hash(FrozenMap((("b", 2), ("a", 1))))
    with pytest.raises(ValueError, match="unique"):
        FrozenMap((("a", 1), ("a", 2)))
    with pytest.raises(KeyError):
        m["z"]


def test_freeze_turns_containers_into_frozen_ones() -> None:
    frozen = freeze({"a": [1, {"b": {2, 3}}], "c": (4,)})
    assert frozen == FrozenMap((("a", (1, FrozenMap((("b", frozenset({2, 3})),)))), ("c", (4,))))
    assert thaw(frozen) == {"a": [1, {"b": {2, 3}}], "c": [4]}


@given(worker_configs())
def test_configs_survive_pickling_as_ray_ships_them_to_actors(c: WorkerConfig) -> None:
    again = pickle.loads(pickle.dumps(c))
    assert again == c
    assert again.vllm.extras == c.vllm.extras
    assert again.num_speculative_tokens == c.num_speculative_tokens


def _vllm(**extra: object) -> dict[str, object]:
    v = _minimal()["vllm_cfg"]
    assert isinstance(v, dict)
    return {**v, **extra}


@pytest.mark.parametrize(
    ("changes", "keys"),
    [
        ({"backend": "megatron"}, ("backend",)),
        (
            {"logprobs_mode": "raw_logprobs", "vllm_cfg": _vllm(logprobs_mode="raw_logits")},
            ("logprobs_mode",),
        ),
        (
            {
                "vllm_cfg": _vllm(speculative_config={"num_speculative_tokens": 1}),
                "vllm_kwargs": {"speculative_config": {"num_speculative_tokens": 1}},
            },
            ("vllm_kwargs.speculative_config",),
        ),
        ({"colocated": {"enabled": "maybe"}}, ("colocated.enabled",)),
        ({"colocated": "yes"}, ("colocated",)),
        ({3: "three"}, ("(config)",)),
        (
            {"telemetry": {"enabled": 2, "otlp_protocol": "http/json"}},
            ("telemetry.enabled", "telemetry.otlp_protocol"),
        ),
        ({"vllm_cfg": _vllm(sleep_level=True)}, ("vllm_cfg.sleep_level",)),
        ({"stop_strings": "</answer>"}, ("stop_strings",)),
        ({"max_new_tokens": "8", "model_name": ""}, ("model_name", "max_new_tokens")),
        ({"top_k": 0, "top_p": 0.0}, ("top_p", "top_k")),
        ({"temperature": float("inf")}, ("temperature",)),
        ({"vllm_cfg": _vllm(gpu_memory_utilization="0.5")}, ("vllm_cfg.gpu_memory_utilization",)),
        ({"vllm_cfg": _vllm(gpu_memory_utilization=0.0)}, ("vllm_cfg.gpu_memory_utilization",)),
    ],
)
def test_documented_rejections(changes: dict[object, object], keys: tuple[str, ...]) -> None:
    d: dict[object, object] = {k: v for k, v in _minimal().items()}
    d.update(changes)
    assert _problems(d).keys == keys


def test_multimodal_keys_are_kept_as_frozen_values_and_round_trip() -> None:
    limits = {"image": 2, "video": {"count": 0, "num_frames": 8}}
    d = dict(_minimal())
    d["vllm_cfg"] = _vllm(
        limit_mm_per_prompt=limits,
        mm_processor_kwargs={"do_image_splitting": False},
        reset_encoder_cache_after_weight_update=True,
    )
    c = _parse(d)
    assert c.vllm.limit_mm_per_prompt == limits
    assert thaw(c.vllm.limit_mm_per_prompt) == limits
    assert c.vllm.mm_processor_kwargs == {"do_image_splitting": False}
    assert "reset_encoder_cache_after_weight_update" not in c.vllm.extras
    assert _parse(c.to_mapping()) == c


@pytest.mark.parametrize(
    ("vllm_cfg", "key", "says"),
    [
        ({"limit_mm_per_prompt": {"image": -1}}, "limit_mm_per_prompt", "image=-1"),
        ({"limit_mm_per_prompt": {"video": {"num_frames": 8}}}, "limit_mm_per_prompt", "count"),
        ({"limit_mm_per_prompt": 2}, "limit_mm_per_prompt", "mapping"),
        ({"mm_processor_kwargs": ["x"]}, "mm_processor_kwargs", "mapping"),
        ({"video": {"num_frames": 8}}, "video", "video inputs are not supported"),
        (
            {"reset_encoder_cache_after_weight_update": False},
            "reset_encoder_cache_after_weight_update",
            "resets the encoder and multimodal caches after every refit",
        ),
        (
            {"reset_encoder_cache_after_weight_update": "sometimes"},
            "reset_encoder_cache_after_weight_update",
            "true or false",
        ),
    ],
)
def test_multimodal_keys_it_cannot_honour_are_refused_naming_them(
    vllm_cfg: dict[str, object], key: str, says: str
) -> None:
    d = dict(_minimal())
    d["vllm_cfg"] = _vllm(**vllm_cfg)
    error = _problems(d)
    assert error.keys == (f"vllm_cfg.{key}",)
    assert says in error.problems[0].message
