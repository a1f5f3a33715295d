"""NeMo-RL's own configs parse; genworker's keys for NeMo-RL's behaviours; the unknown-key policy.

``BASIC_VLLM_TEST_CONFIG`` is the shape of NeMo-RL's ``basic_vllm_test_config``
(``tests/unit/models/generation/test_vllm_generation.py`` at NeMo-RL 7ea279ab), with the
keys ``configure_generation_config`` writes before a worker sees it (``_pad_token_id``,
``stop_token_ids`` from the tokenizer, ``load_format: dummy``, ``_mtp_weights_from_refit``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core.config import PRECISION_ALIASES, PRECISIONS, WorkerConfig
from genworker.core.config_keys import UNKNOWN_KEY_POLICIES, rule_for
from genworker.core.stops import StopMode

MODEL = "Qwen/Qwen3-0.6B"

BASIC_VLLM_TEST_CONFIG: dict[str, Any] = {
    "backend": "vllm",
    "model_name": MODEL,
    "tokenizer": {"name": MODEL},
    "dtype": "bfloat16",
    "max_new_tokens": 5,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "val_temperature": 1.0,
    "val_top_p": 1.0,
    "val_top_k": None,
    "stop_token_ids": None,
    "stop_strings": None,
    "vllm_cfg": {
        "precision": "bfloat16",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel_size": 1,
        "gpu_memory_utilization": 0.7,
        "max_model_len": 1024,
        "async_engine": False,
        "skip_tokenizer_init": False,
        "load_format": "auto",
        "enforce_eager": "False",
        "kv_cache_dtype": "auto",
    },
    "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
    "vllm_kwargs": {},
}


def configured(config: dict[str, Any]) -> dict[str, Any]:
    """What NeMo-RL's ``configure_generation_config(config, tokenizer)`` hands the worker."""
    out = copy.deepcopy(config)
    out["_pad_token_id"] = 151643
    if out["stop_token_ids"] is None:
        out["stop_token_ids"] = [151645]
    out["vllm_cfg"]["load_format"] = "dummy"
    out["_mtp_weights_from_refit"] = False
    return out


def _at(config: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    out = copy.deepcopy(config)
    *parents, leaf = path.split(".")
    target = out
    for parent in parents:
        target = target.setdefault(parent, {})
    target[leaf] = value
    return out


def _problems(result: object) -> dict[str, str]:
    assert isinstance(result, Failure), result
    return {p.key: p.message for p in result.failure().problems}


CONFIG = configured(BASIC_VLLM_TEST_CONFIG)


# --- item 1: NeMo-RL's unit-test config -----------------------------------------------------


def test_nemo_rls_basic_vllm_test_config_parses_unchanged() -> None:
    result = WorkerConfig.from_mapping(CONFIG)
    assert isinstance(result, Success), result
    c = result.unwrap()
    assert c.model_name == MODEL
    assert c.vllm.precision == "bfloat16"
    assert c.vllm.enforce_eager is False  # "False", read as vLLM reads it
    assert c.extras["tokenizer"] == {"name": MODEL}
    assert c.extras["dtype"] == "bfloat16"
    assert c.warnings == ()
    assert WorkerConfig.from_mapping(c.to_mapping()) == Success(c)


def test_the_raw_test_config_lacks_only_what_configure_generation_config_writes() -> None:
    assert tuple(_problems(WorkerConfig.from_mapping(BASIC_VLLM_TEST_CONFIG))) == ("_pad_token_id",)


@pytest.mark.parametrize("key", ["dtype", "tokenizer"])
def test_dtype_and_tokenizer_are_inert_with_a_reason(key: str) -> None:
    rule = rule_for(key)
    assert rule is not None
    assert rule.fate.value == "accepted as inert"
    assert rule.note


@given(
    st.sampled_from(sorted(PRECISIONS)),
    st.sampled_from(sorted(PRECISIONS | PRECISION_ALIASES.keys())),
)
def test_dtype_is_accepted_exactly_when_it_names_vllm_cfg_precision(
    precision: str, dtype: str
) -> None:
    config = _at(_at(CONFIG, "vllm_cfg.precision", precision), "dtype", dtype)
    result = WorkerConfig.from_mapping(config)
    canonical = PRECISION_ALIASES.get(dtype, dtype)
    if canonical == precision or (precision == "fp8" and canonical == "bfloat16"):
        assert isinstance(result, Success), result
    else:
        problems = _problems(result)
        assert tuple(problems) == ("dtype",)
        assert repr(precision) in problems["dtype"]
        assert "vllm_cfg.precision" in problems["dtype"]


def test_a_dtype_that_is_no_precision_is_refused_by_name() -> None:
    problems = _problems(WorkerConfig.from_mapping(_at(CONFIG, "dtype", "int4")))
    assert tuple(problems) == ("dtype",)
    assert "int4" in problems["dtype"]


def test_dtype_is_not_compared_with_a_precision_that_did_not_parse() -> None:
    config = _at(CONFIG, "vllm_cfg.precision", "fp4")
    assert tuple(_problems(WorkerConfig.from_mapping(config))) == ("vllm_cfg.precision",)


def test_a_tokenizer_of_another_model_is_refused_naming_both() -> None:
    problems = _problems(WorkerConfig.from_mapping(_at(CONFIG, "tokenizer.name", "gpt2")))
    assert tuple(problems) == ("tokenizer.name",)
    assert "'gpt2'" in problems["tokenizer.name"]
    assert repr(MODEL) in problems["tokenizer.name"]


@pytest.mark.parametrize(
    "tokenizer", [{}, {"chat_template": None}, {"name": MODEL, "use_fastokens": True}]
)
def test_a_tokenizer_block_without_another_name_is_accepted(tokenizer: dict[str, Any]) -> None:
    assert isinstance(WorkerConfig.from_mapping(_at(CONFIG, "tokenizer", tokenizer)), Success)


def test_a_tokenizer_that_is_no_mapping_is_refused() -> None:
    assert tuple(_problems(WorkerConfig.from_mapping(_at(CONFIG, "tokenizer", MODEL)))) == (
        "tokenizer",
    )


def test_a_bad_model_name_is_not_blamed_on_the_tokenizer() -> None:
    config = _at(CONFIG, "model_name", 3)
    assert tuple(_problems(WorkerConfig.from_mapping(config))) == ("model_name",)


# --- item 3: the stop-string mode -------------------------------------------------------------


@pytest.mark.parametrize(("value", "mode"), [(m.value, m) for m in StopMode])
def test_stop_strings_mode_selects_the_core_stop_mode(value: str, mode: StopMode) -> None:
    c = WorkerConfig.from_mapping(_at(CONFIG, "stop_strings_mode", value)).unwrap()
    assert c.stop_mode is mode
    assert WorkerConfig.from_mapping(c.to_mapping()) == Success(c)


def test_the_default_stop_mode_is_per_sample() -> None:
    assert WorkerConfig.from_mapping(CONFIG).unwrap().stop_mode is StopMode.PER_SAMPLE


@pytest.mark.parametrize("value", ["union", "BATCH_UNION", StopMode.BATCH_UNION, None, 1])
def test_a_stop_strings_mode_that_is_no_mode_is_refused_naming_the_modes(value: object) -> None:
    problems = _problems(WorkerConfig.from_mapping(_at(CONFIG, "stop_strings_mode", value)))
    assert tuple(problems) == ("stop_strings_mode",)
    assert "batch_union" in problems["stop_strings_mode"]


# --- item 4: stop strings and bad words need the engine's tokenizer --------------------------


@pytest.mark.parametrize("key", ["stop_strings", "bad_words"])
def test_config_stop_strings_or_bad_words_without_a_tokenizer_are_refused(key: str) -> None:
    config = _at(_at(CONFIG, "vllm_cfg.skip_tokenizer_init", True), key, ["</answer>"])
    problems = _problems(WorkerConfig.from_mapping(config))
    assert tuple(problems) == (key,)
    assert "skip_tokenizer_init" in problems[key]


def test_nemo_rls_default_skip_tokenizer_init_without_stop_strings_parses() -> None:
    config = _at(CONFIG, "vllm_cfg.skip_tokenizer_init", True)
    assert isinstance(WorkerConfig.from_mapping(config), Success)


@pytest.mark.parametrize(
    ("rows", "refused"),
    [
        (None, None),
        ([None, None], None),
        ([[], None], None),
        ([None, ["</a>"]], [1]),
        ([["x"], ["y"], None], [0, 1]),
        ("x", None),  # not a per-row list: the stop-string merge names it
        ([None, "x"], [1]),  # a bare string row asks for something: refused here too
    ],
)
def test_per_row_stop_strings_on_an_engine_without_a_detokenizer_are_refused(
    rows: object, refused: list[int] | None
) -> None:
    skipping = WorkerConfig.from_mapping(_at(CONFIG, "vllm_cfg.skip_tokenizer_init", True))
    problem = skipping.unwrap().detokenizer_problem(rows)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None
        assert f"rows {refused}" in problem
        assert "skip_tokenizer_init" in problem
    assert WorkerConfig.from_mapping(CONFIG).unwrap().detokenizer_problem(rows) is None


# --- vllm_cfg.reset_mm_cache_after_refit (NeMo-RL #3648) -----------------------------------------


@pytest.mark.parametrize("value", [True, False, "false"])
def test_reset_mm_cache_after_refit_false_is_refused_only_on_a_multimodal_engine(
    value: object,
) -> None:
    c = WorkerConfig.from_mapping(_at(CONFIG, "vllm_cfg.reset_mm_cache_after_refit", value))
    vllm = c.unwrap().vllm
    assert vllm.encoder_reset_problem(multimodal=False) is None
    problem = vllm.encoder_reset_problem(multimodal=True)
    if value is True:
        assert problem is None
    else:
        assert problem is not None
        assert "vllm_cfg.reset_mm_cache_after_refit" in problem
    assert WorkerConfig.from_mapping(c.unwrap().to_mapping()) == c


# --- item 8: keys in no table --------------------------------------------------------------------


@given(
    st.text("abcxyz_", min_size=1, max_size=8).map("zz_".__add__),
    st.sampled_from(["", "vllm_cfg."]),
)
def test_under_warn_an_unknown_key_is_a_named_warning_and_has_no_effect(
    name: str, where: str
) -> None:
    path = where + name
    refused = WorkerConfig.from_mapping(_at(CONFIG, path, 1))
    assert tuple(_problems(refused)) == (path,)
    assert "unknown_keys: warn" in _problems(refused)[path]
    warned = WorkerConfig.from_mapping(_at(_at(CONFIG, path, 1), "unknown_keys", "warn"))
    assert isinstance(warned, Success), warned
    c = warned.unwrap()
    assert [w.key for w in c.warnings] == [path]
    assert "unknown key" in c.warnings[0].message
    assert "has no effect" in c.warnings[0].message
    plain = WorkerConfig.from_mapping(_at(CONFIG, "unknown_keys", "warn")).unwrap()
    # the key is kept for round trips and changes nothing else
    assert c.to_mapping() == _at(plain.to_mapping(), path, 1)
    assert WorkerConfig.from_mapping(c.to_mapping()) == Success(c)


def test_warn_does_not_accept_a_key_the_table_refuses() -> None:
    config = _at(_at(CONFIG, "router_url", "http://router:8000"), "unknown_keys", "warn")
    problems = _problems(WorkerConfig.from_mapping(config))
    assert tuple(problems) == ("router_url",)
    assert "refused" in problems["router_url"]


def test_refuse_is_the_default_and_the_only_other_value_is_warn() -> None:
    assert UNKNOWN_KEY_POLICIES == ("refuse", "warn")
    assert WorkerConfig.from_mapping(CONFIG).unwrap().unknown_keys == "refuse"
    problems = _problems(WorkerConfig.from_mapping(_at(CONFIG, "unknown_keys", "ignore")))
    assert tuple(problems) == ("unknown_keys",)
    assert "'warn'" in problems["unknown_keys"]


def test_a_bad_unknown_keys_value_still_refuses_the_unknown_keys() -> None:
    config = _at(_at(CONFIG, "unknown_keys", "loud"), "zz_new", 1)
    assert set(_problems(WorkerConfig.from_mapping(config))) == {"unknown_keys", "zz_new"}
