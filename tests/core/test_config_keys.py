"""The key table: every NeMo-RL generation-config key has a fate, and the parser keeps it.

The inventory below is NeMo-RL's (``GenerationConfig``, ``VllmConfig``,
``VllmSpecificArgs`` and the keys its vLLM worker and ``VllmGeneration`` read, at NeMo-RL
commit 7ea279ab). What each honoured key does to the engine, its requests and its outputs
is checked against the worker in ``tests/shell/test_nemo_rl_keys.py``.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core.config import WorkerConfig, executor_backend
from genworker.core.config_keys import (
    FALSE_STRINGS,
    KEYS,
    TRUE_STRINGS,
    Fate,
    KeyRule,
    check_keys,
    parse_bool,
    rule_for,
)

NEMO_RL_TOP_KEYS = (
    "backend", "max_new_tokens", "temperature", "top_p", "top_k", "val_temperature",
    "val_top_p", "val_top_k", "model_name", "stop_token_ids", "stop_strings", "bad_words",
    "ignore_eos", "colocated", "port_range_low", "port_range_high", "use_async_rollouts",
    "_pad_token_id", "_mtp_weights_from_refit", "_debug_payload_metrics",
    "mcore_generation_config", "vllm_cfg", "vllm_kwargs", "refit_transport", "refit_cfg",
    "quant_cfg", "real_quant", "real_quant_export_cpu_offload", "real_quant_ignore",
    "checkpoint_engine", "nvfp4_pertoken_rollout",
    "num_prompts_per_step",  # nemo_rl/evals/eval.py: its generation config, to VllmGeneration
    "tokenizer", "dtype",  # tests/unit/models/generation/test_vllm_generation.py's config
)  # fmt: skip

# Keys NeMo-RL added after 7ea279ab (issue 43, item 8), where they sit in the config.
NEMO_RL_DRIFT_KEYS = (
    "vllm_cfg.refit_with_reload_api", "vllm_cfg.quantization_ignore_patterns",
    "truncate_prompt_tokens", "_validation_generation", "vllm_cfg.reset_mm_cache_after_refit",
    "deduplicate_multimodal_data", "vllm_cfg.use_torch_logprobs", "router_url",
    "router_request_id_header", "server_groups", "real_quant_calibration_path",
    "_modelopt_quantization_config", "refit_prequantize", "refit_cache_loader_routes",
)  # fmt: skip
NEMO_RL_VLLM_CFG_KEYS = (
    "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size",
    "gpu_memory_utilization", "max_model_len", "skip_tokenizer_init", "async_engine", "video",
    "load_format", "precision", "logprobs_mode", "cap_max_tokens_to_context", "is_mx",
    "kv_cache_dtype", "enforce_eager", "enable_return_routed_experts", "use_tqdm",
    "expose_http_server", "http_refit_api_key_env_var", "reset_encoder_cache_after_weight_update",
    "http_refit_server_port", "zmq_refit_server_port", "http_server_serving_chat_kwargs",
    "tool_parser_plugin", "env_vars", "reasoning_parser_plugin", "enable_prefix_caching",
    "use_deep_gemm", "num_first_layers_in_bf16", "num_last_layers_in_bf16",
    "pow2_weight_scaling_factors", "pow2_activation_scaling_factors",
    "quantization_ignored_layer_kws", "enable_vllm_metrics_logger",
    "vllm_metrics_logger_interval", "refit_prequantize",
    # in NeMo-RL's example configs (distillation_math*.yaml; two MoE recipes), never read
    "distributed_executor_backend", "enable_expert_parallel",
)  # fmt: skip

# A value that asks for what genworker cannot do, for every refused key.
ASKING: dict[str, object] = {
    "_mtp_weights_from_refit": True,
    "refit_transport": "nccl_reshard",
    "checkpoint_engine": {"backend": "nixl"},
    "quant_cfg": "nvfp4_default",
    "real_quant": True,
    "nvfp4_pertoken_rollout": {"enabled": True},
    "vllm_cfg.use_deep_gemm": True,
    "vllm_cfg.num_first_layers_in_bf16": 2,
    "vllm_cfg.num_last_layers_in_bf16": 1,
    "vllm_cfg.pow2_weight_scaling_factors": "true",
    "vllm_cfg.pow2_activation_scaling_factors": True,
    "vllm_cfg.quantization_ignored_layer_kws": ["mlp.gate"],
    "vllm_cfg.is_mx": True,
    "vllm_cfg.refit_prequantize": True,
    "vllm_cfg.http_refit_api_key_env_var": "REFIT_KEY",
    "vllm_cfg.http_refit_server_port": 9100,
    "vllm_cfg.zmq_refit_server_port": 9200,
    "vllm_cfg.video": {"sampling_style": "nemotron_vl", "num_frames": 8, "temporal_patch_size": 2},
    "vllm_kwargs.media_io_kwargs": {"video": {"num_frames": 8}},
    "vllm_cfg.refit_with_reload_api": True,
    "vllm_cfg.quantization_ignore_patterns": ["re:.*mixer.gate.*"],
    "truncate_prompt_tokens": 1024,
    "_validation_generation": True,
    "deduplicate_multimodal_data": True,
    "vllm_cfg.use_torch_logprobs": True,
    "router_url": "http://router:8000",
    "router_request_id_header": "x-session-id",
    "server_groups": [{"name": "a", "workers": 2}],
    "real_quant_calibration_path": "/ckpt/calib",
    "_modelopt_quantization_config": {"quant_algo": "NVFP4"},
    "refit_prequantize": True,
    "refit_cache_loader_routes": {"qkv": "fused"},
}

# The image keys multimodal generation honours, each with a value it takes.
IMAGE_KEYS: dict[str, object] = {
    "vllm_cfg.limit_mm_per_prompt": {"image": 2},
    "vllm_cfg.mm_processor_kwargs": {"do_image_splitting": False},
    "vllm_cfg.reset_encoder_cache_after_weight_update": True,
    "vllm_kwargs.limit_mm_per_prompt": {"image": 1},
    "vllm_kwargs.mm_processor_kwargs": {"max_pixels": 1024},
    "vllm_kwargs.mm_processor_cache_gb": 4,
    "vllm_kwargs.skip_mm_profiling": True,
}

# NeMo-RL's examples/configs/grpo_math_1B.yaml policy.generation block, interpolated, less
# its vllm_cfg.reset_encoder_cache_after_weight_update: false (see the test below).
GRPO_MATH_1B: dict[str, object] = {
    "port_range_low": 3000,
    "port_range_high": 4999,
    "backend": "vllm",
    "max_new_tokens": 512,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "val_temperature": 1.0,
    "val_top_p": 1.0,
    "val_top_k": None,
    "stop_token_ids": None,
    "stop_strings": None,
    "refit_transport": None,
    "real_quant_export_cpu_offload": True,
    "refit_cfg": {
        "nixl": {
            "update_weights_bucket_memory_ratio": 0.05,
            "device": "cuda",
            "backend_name": "UCX",
            "backend_init_params": None,
            "release_after_refit": False,
            "shard_expert_weights": False,
        }
    },
    "mcore_generation_config": {
        "max_model_len": 512,
        "cuda_graph_impl": "local",
        "buffer_size_gb": 10,
        "num_speculative_tokens": 0,
        "expose_http_server": False,
    },
    "vllm_cfg": {
        "async_engine": False,
        "precision": "bfloat16",
        "kv_cache_dtype": "auto",
        "logprobs_mode": "processed_logprobs",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel_size": 1,
        "gpu_memory_utilization": 0.6,
        "max_model_len": 512,
        "enforce_eager": False,
        "use_tqdm": True,
        "use_deep_gemm": False,
        "num_last_layers_in_bf16": 0,
        "num_first_layers_in_bf16": 0,
        "enable_vllm_metrics_logger": True,
        "vllm_metrics_logger_interval": 0.5,
        "http_refit_api_key_env_var": None,
        "http_refit_server_port": None,
        "zmq_refit_server_port": None,
        "skip_tokenizer_init": True,
        "load_format": "dummy",
    },
    "vllm_kwargs": {},
    "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
    # written by NeMo-RL's configure_generation_config
    "model_name": "Qwen/Qwen2.5-1.5B",
    "_pad_token_id": 151643,
}


def _at(config: dict[str, object], path: str, value: object) -> dict[str, object]:
    out = copy.deepcopy(config)
    *parents, leaf = path.split(".")
    target = out
    for parent in parents:
        child = target.setdefault(parent, {})
        assert isinstance(child, dict)
        target = child
    target[leaf] = value
    return out


def _keys(result: object) -> tuple[str, ...]:
    assert isinstance(result, Failure), result
    return tuple(result.failure().keys)


# --- the inventory -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [*NEMO_RL_TOP_KEYS, *(f"vllm_cfg.{k}" for k in NEMO_RL_VLLM_CFG_KEYS), *NEMO_RL_DRIFT_KEYS],
)
def test_every_nemo_rl_key_has_a_fate(path: str) -> None:
    rule = rule_for(path)
    assert rule is not None, f"{path} is missing from config_keys.KEYS"
    assert rule.note


def test_every_refused_key_has_a_value_that_asks_and_every_rule_is_reachable() -> None:
    refusing = {r.key for r in KEYS if r.fate is Fate.REFUSED}
    assert refusing == set(ASKING)
    assert len({r.key for r in KEYS}) == len(KEYS), "one rule per key"
    for rule in KEYS:
        assert rule_for(rule.key.removesuffix(".*")) == rule


def test_a_nemo_rl_grpo_config_parses_as_nemo_rl_writes_it() -> None:
    result = WorkerConfig.from_mapping(GRPO_MATH_1B)
    assert isinstance(result, Success), result
    c = result.unwrap()
    assert c.vllm.use_tqdm is True
    assert c.top_k == -1
    assert c.is_colocated
    assert c.extras["refit_transport"] is None
    assert c.vllm.extras["enable_vllm_metrics_logger"] is True
    assert WorkerConfig.from_mapping(c.to_mapping()) == Success(c)


def test_nemo_rl_s_stock_config_with_reset_encoder_cache_false_parses_unchanged() -> None:
    """NeMo-RL's example configs carry ``reset_encoder_cache_after_weight_update: false``:
    it parses (vacuous on a text-only model); only a multimodal engine refuses it, naming
    the key, once the worker knows the engine is multimodal."""
    for value in (False, "false", True, "true"):
        written = _at(GRPO_MATH_1B, "vllm_cfg.reset_encoder_cache_after_weight_update", value)
        result = WorkerConfig.from_mapping(written)
        assert isinstance(result, Success), result
        vllm = result.unwrap().vllm
        keeps = value in (False, "false")
        assert vllm.reset_encoder_cache_after_weight_update is not keeps
        assert vllm.encoder_reset_problem(multimodal=False) is None
        problem = vllm.encoder_reset_problem(multimodal=True)
        assert (problem is not None) is keeps
    bad = _at(GRPO_MATH_1B, "vllm_cfg.reset_encoder_cache_after_weight_update", "sometimes")
    assert _keys(WorkerConfig.from_mapping(bad)) == (
        "vllm_cfg.reset_encoder_cache_after_weight_update",
    )


# NeMo-RL's examples/configs/evals/eval.yaml generation block, interpolated as its
# eval.py hands it to VllmGeneration (model_name and _pad_token_id written by then).
EVAL: dict[str, object] = {
    "backend": "vllm",
    "max_new_tokens": 2048,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "val_temperature": 0.0,
    "val_top_p": 1.0,
    "val_top_k": -1,
    "num_prompts_per_step": -1,
    "model_name": "Qwen/Qwen2.5-Math-1.5B-Instruct",
    "stop_token_ids": None,
    "stop_strings": None,
    "vllm_cfg": {
        "async_engine": False,
        "precision": "bfloat16",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel_size": 1,
        "gpu_memory_utilization": 0.9,
        "max_model_len": 2048,
        "enforce_eager": False,
    },
    "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
    "_pad_token_id": 151643,
}


def test_nemo_rl_s_eval_config_parses_with_its_batch_size() -> None:
    result = WorkerConfig.from_mapping(EVAL)
    assert isinstance(result, Success), result
    assert result.unwrap().extras["num_prompts_per_step"] == -1


def _sized(tp: int, pp: int, ep: int, key: str, value: object) -> dict[str, object]:
    d = GRPO_MATH_1B
    for name, size in (("tensor", tp), ("pipeline", pp), ("expert", ep)):
        d = _at(d, f"vllm_cfg.{name}_parallel_size", size)
    return _at(d, f"vllm_cfg.{key}", value)


@given(
    st.integers(1, 8),
    st.integers(1, 8),
    st.sampled_from([None, True, False, "true", "False", 1, 0]),
)
def test_enable_expert_parallel_is_taken_when_it_agrees_with_the_size(
    tp: int, ep_wanted: int, value: object
) -> None:
    ep = min(ep_wanted, tp)
    result = WorkerConfig.from_mapping(_sized(tp, 1, ep, "enable_expert_parallel", value))
    if value is None or parse_bool(value) == (ep > 1):
        assert isinstance(result, Success), result
    else:
        assert _keys(result) == ("vllm_cfg.enable_expert_parallel",)
        assert f"expert_parallel_size {ep}" in result.failure().message


@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from([None, "ray", "uni", "mp", "external_launcher"]),
)
def test_distributed_executor_backend_is_taken_when_it_is_the_one_started(
    tp: int, pp: int, value: str | None
) -> None:
    result = WorkerConfig.from_mapping(_sized(tp, pp, 1, "distributed_executor_backend", value))
    if value is None or value == executor_backend(tp, pp):
        assert isinstance(result, Success), result
    else:
        assert _keys(result) == ("vllm_cfg.distributed_executor_backend",)
        assert repr(executor_backend(tp, pp)) in result.failure().message


@pytest.mark.parametrize("path", sorted(IMAGE_KEYS))
def test_the_image_keys_are_honoured(path: str) -> None:
    rule = rule_for(path)
    assert rule is not None
    assert rule.fate is Fate.HONOURED
    result = WorkerConfig.from_mapping(_at(GRPO_MATH_1B, path, IMAGE_KEYS[path]))
    assert isinstance(result, Success), result


# --- refused keys: refused by name with what to use instead, or accepted when inert -----------


@pytest.mark.parametrize("path", sorted(ASKING))
def test_a_refused_key_is_named_with_what_to_use_instead(path: str) -> None:
    rule = rule_for(path)
    assert rule is not None
    result = WorkerConfig.from_mapping(_at(GRPO_MATH_1B, path, ASKING[path]))
    assert _keys(result) == (path,)
    message = result.failure().message
    assert rule.fate.value in message
    assert rule.note in message


@pytest.mark.parametrize(("path", "value"), [(r.key, v) for r in KEYS for v in r.inert], ids=str)
def test_a_refused_key_at_a_value_that_asks_for_nothing_is_accepted(
    path: str, value: object
) -> None:
    result = WorkerConfig.from_mapping(_at(GRPO_MATH_1B, path, value))
    assert isinstance(result, Success), result


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("vllm_cfg.use_deep_gemm", "False"),
        ("vllm_cfg.use_deep_gemm", 0),
        ("vllm_cfg.is_mx", "no"),
        ("vllm_cfg.quantization_ignored_layer_kws", ()),
        ("real_quant", "false"),
    ],
)
def test_inert_values_are_read_as_vllm_reads_them(path: str, value: object) -> None:
    assert isinstance(WorkerConfig.from_mapping(_at(GRPO_MATH_1B, path, value)), Success)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("vllm_cfg.num_first_layers_in_bf16", True),  # a bool is not the count 0 or 1
        ("vllm_cfg.num_first_layers_in_bf16", "0"),
        ("quant_cfg", "null"),
        ("vllm_cfg.quantization_ignored_layer_kws", "mlp"),
        ("vllm_cfg.video", {}),
    ],
)
def test_lookalikes_of_inert_values_are_refused(path: str, value: object) -> None:
    assert _keys(WorkerConfig.from_mapping(_at(GRPO_MATH_1B, path, value))) == (path,)


def test_every_refusal_is_reported_at_once() -> None:
    d = GRPO_MATH_1B
    for path in ("quant_cfg", "vllm_cfg.use_deep_gemm", "vllm_cfg.video", "vllm_kwargs.mm_x"):
        d = _at(d, path, ASKING.get(path, 1))
    d = _at(d, "typo_key", 1)
    # vllm_kwargs goes to vLLM: only the table's own vllm_kwargs entries are checked there.
    assert set(_keys(WorkerConfig.from_mapping(d))) == {
        "quant_cfg",
        "vllm_cfg.use_deep_gemm",
        "vllm_cfg.video",
        "typo_key",
    }


# --- unknown keys, blocks and the rule lookup ----------------------------------------------


@given(
    st.text("abcxyz_", min_size=1, max_size=8).map("zz_".__add__),
    st.sampled_from(["", "vllm_cfg."]),
)
def test_an_unknown_key_is_refused_by_its_dotted_name(name: str, where: str) -> None:
    path = where + name
    assert rule_for(path) is None
    result = WorkerConfig.from_mapping(_at(GRPO_MATH_1B, path, 1))
    assert _keys(result) == (path,)
    assert "unknown key" in result.failure().message


@pytest.mark.parametrize(
    ("path", "block"),
    [
        ("colocated", "colocated.*"),
        ("colocated.resources.num_nodes", "colocated.*"),
        ("refit_cfg.sparse.tuning", "refit_cfg.*"),
        ("vllm_cfg.env_vars", "vllm_cfg.env_vars.*"),
        ("vllm_cfg.speculative_config.method", "vllm_cfg.speculative_config.*"),
        ("telemetry.enabled", "telemetry.*"),
    ],
)
def test_a_block_rule_covers_everything_inside_it(path: str, block: str) -> None:
    rule = rule_for(path)
    assert rule is not None
    assert rule.key == block


def test_check_keys_skips_blocks_that_are_not_mappings_and_non_string_keys() -> None:
    assert check_keys({"vllm_cfg": "tp=1", "vllm_kwargs": None}) == ()
    assert check_keys({"vllm_cfg": {3: 1}, 4: "x"}) == ()
    (verdict,) = check_keys({"vllm_kwargs": {"media_io_kwargs": {"image": {}}}})
    assert verdict.key == "vllm_kwargs.media_io_kwargs"


def test_accepted_fates_accept_any_value() -> None:
    for fate in (Fate.HONOURED, Fate.INERT, Fate.NEMO_RL_SIDE, Fate.ASYNC_WORKER, Fate.HTTP_SERVER):
        assert KeyRule("k", fate, "n").accepts(object())
    assert not KeyRule("k", Fate.REFUSED, "n").accepts(None)
    assert KeyRule("k", Fate.REFUSED, "n", inert=("off",)).accepts("off")
    assert not KeyRule("k", Fate.REFUSED, "n", inert=("off",)).accepts("OFF")


# --- booleans as vLLM reads them ------------------------------------------------------------


@given(
    st.sampled_from(sorted(TRUE_STRINGS | FALSE_STRINGS)),
    st.sampled_from([str.upper, str.title, str]),
)
def test_pydantic_boolean_strings_in_any_case(text: str, case: object) -> None:
    assert callable(case)
    assert parse_bool(case(text)) is (text in TRUE_STRINGS)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), (1, True), (0, False), (1.0, True), (0.0, False),
     (2, None), (0.5, None), ("", None), (" true", None), (None, None), ([], None)],
)  # fmt: skip
def test_parse_bool_matches_pydantic(value: object, expected: bool | None) -> None:
    assert parse_bool(value) is expected
