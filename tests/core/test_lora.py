"""core.lora: the LoRA plan of a generation config, and an adapter checked against an
engine before anything moves."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core.config import WorkerConfig
from genworker.core.engine_plan import plan_engine_kwargs
from genworker.core.lora import (
    VLLM_MAX_LORA_RANKS,
    Adapter,
    AdapterError,
    EngineLora,
    LoraPlan,
    LoraRef,
    RowAdapterError,
    adapter_capacity,
    adapter_id,
    adapter_path,
    check_adapter,
    check_adapter_name,
    lora_update,
    plan_lora,
    rank_for,
    row_adapters,
    served_adapter_id,
)
from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.core.refit_protocol import DEFAULT_TIMEOUT_S, Transport

ENGINE = EngineLora(16, frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}))
PEFT = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def adapter_specs(
    modules: dict[str, tuple[int, int]], rank: int, dtype: str = "float32"
) -> list[TensorSpec]:
    specs = []
    for path, (n_in, n_out) in modules.items():
        specs.append(TensorSpec(f"base_model.model.{path}.lora_A.weight", (rank, n_in), dtype))
        specs.append(TensorSpec(f"base_model.model.{path}.lora_B.weight", (n_out, rank), dtype))
    return specs


def manifest(specs: list[TensorSpec]) -> Manifest:
    return Manifest.from_specs(specs).unwrap()


def base_config(**top: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "backend": "vllm",
        "model_name": "m",
        "max_new_tokens": 4,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "_pad_token_id": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.5,
            "max_model_len": 32,
            "precision": "float32",
        },
    }
    return {**cfg, **top}


TINY = {"model.layers.0.self_attn.q_proj": (64, 64), "model.layers.0.self_attn.v_proj": (64, 32)}


# -- the plan --------------------------------------------------------------------------


def test_lora_off_by_default_plans_no_engine_kwargs() -> None:
    plan = plan_lora({}, None).unwrap()
    assert plan == LoraPlan()
    assert plan.engine_kwargs() == {}


def test_native_mode_enables_lora_with_nemo_rl_rank_and_alpha() -> None:
    extra = {"additional_config": {"nemo_rl_native_lora": {"rank": 12, "alpha": 24}}}
    plan = plan_lora(extra, "native").unwrap()
    assert plan.enabled
    assert plan.native
    assert plan.max_rank == 16  # the smallest rank vLLM accepts that holds 12
    assert plan.alpha == 24.0
    assert plan.engine_kwargs() == {
        "enable_lora": True,
        "max_lora_rank": 16,
        "max_loras": 1,
        "max_cpu_loras": 1,
        "lora_dtype": "auto",
    }


def test_merged_mode_asks_for_nothing() -> None:
    assert plan_lora({}, "merged").unwrap() == LoraPlan()


@pytest.mark.parametrize(
    ("kwargs", "mode", "key"),
    [
        ({}, "adapters", "lora_refit_mode"),
        ({"enable_lora": "yes"}, None, "vllm_kwargs.enable_lora"),
        ({"enable_lora": False}, "native", "vllm_kwargs.enable_lora"),
        ({"enable_lora": True, "max_lora_rank": 12}, None, "vllm_kwargs.max_lora_rank"),
        ({"enable_lora": True, "max_lora_rank": 0}, None, "vllm_kwargs.max_lora_rank"),
        ({"enable_lora": True, "max_loras": True}, None, "vllm_kwargs.max_loras"),
        ({"max_loras": 2}, None, "vllm_kwargs.max_loras"),
        (
            {"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2},
            None,
            "vllm_kwargs.max_cpu_loras",
        ),
        ({"enable_lora": True, "lora_dtype": "float32"}, None, "vllm_kwargs.lora_dtype"),
        (
            {"additional_config": {"nemo_rl_native_lora": {"rank": 4}}},
            None,
            "vllm_kwargs.additional_config.nemo_rl_native_lora",
        ),
        (
            {
                "additional_config": {"nemo_rl_native_lora": {"rank": 32, "alpha": 1}},
                "max_lora_rank": 16,
            },
            None,
            "vllm_kwargs.max_lora_rank",
        ),
    ],
)
def test_each_bad_key_is_refused_by_name(
    kwargs: dict[str, Any], mode: str | None, key: str
) -> None:
    result = plan_lora(kwargs, mode)
    assert isinstance(result, Failure)
    assert key in [p.key for p in result.failure()]


def test_a_native_entry_that_is_not_a_mapping_is_refused() -> None:
    result = plan_lora({"additional_config": {"nemo_rl_native_lora": 8}}, None)
    assert isinstance(result, Failure)


def test_additional_config_without_the_native_entry_is_no_lora() -> None:
    assert plan_lora({"additional_config": {"other": 1}}, None).unwrap() == LoraPlan()


@given(
    rank=st.sampled_from(VLLM_MAX_LORA_RANKS),
    max_loras=st.integers(1, 8),
    spare=st.integers(0, 8),
    dtype=st.sampled_from(["auto", "float16", "bfloat16"]),
)
def test_law_a_plan_is_a_fixed_point_of_its_engine_kwargs(
    rank: int, max_loras: int, spare: int, dtype: str
) -> None:
    kwargs = {
        "enable_lora": True,
        "max_lora_rank": rank,
        "max_loras": max_loras,
        "max_cpu_loras": max_loras + spare,
        "lora_dtype": dtype,
    }
    plan = plan_lora(kwargs, None).unwrap()
    assert plan.engine_kwargs() == kwargs
    assert plan_lora(plan.engine_kwargs(), None).unwrap() == plan


@given(st.integers(1, 600))
def test_law_rank_for_is_the_smallest_vllm_rank_that_holds_it(rank: int) -> None:
    chosen = rank_for(rank)
    assert chosen in VLLM_MAX_LORA_RANKS
    if rank <= VLLM_MAX_LORA_RANKS[-1]:
        assert chosen >= rank
        assert all(r < rank for r in VLLM_MAX_LORA_RANKS if r < chosen)
    else:
        assert chosen == VLLM_MAX_LORA_RANKS[-1]


def test_the_worker_config_plans_lora_into_the_engine_kwargs() -> None:
    cfg = WorkerConfig.from_mapping(
        base_config(lora_refit_mode="native", vllm_kwargs={"max_loras": 2})
    ).unwrap()
    assert cfg.lora.enabled
    gpu = plan_engine_kwargs(cfg, seed=0, gpu_capability=(9, 0), extension_cls="x").unwrap()
    assert gpu.kwargs["enable_lora"] is True
    assert gpu.kwargs["max_loras"] == 2
    assert gpu.kwargs["max_cpu_loras"] == 2
    cpu = plan_engine_kwargs(cfg, seed=0, gpu_capability=None, extension_cls="x").unwrap()
    assert cpu.kwargs["max_loras"] == 3  # the spare slot vLLM's CPU kernels read for no adapter
    assert cpu.kwargs["max_cpu_loras"] == 3
    assert adapter_capacity(3, 3, cpu=True) == 2
    assert adapter_capacity(2, 4, cpu=False) == 4
    assert WorkerConfig.from_mapping(cfg.to_mapping()).unwrap() == cfg


def test_the_worker_config_refuses_a_bad_lora_key_by_name() -> None:
    result = WorkerConfig.from_mapping(
        base_config(vllm_kwargs={"enable_lora": True, "max_lora_rank": 7})
    )
    assert isinstance(result, Failure)
    assert "vllm_kwargs.max_lora_rank" in result.failure().keys


# -- the adapter -----------------------------------------------------------------------


def test_a_peft_adapter_is_checked_into_its_modules() -> None:
    result = check_adapter(manifest(adapter_specs(TINY, 8)), PEFT, ENGINE)
    assert isinstance(result, Success)
    adapter = result.unwrap()
    assert isinstance(adapter, Adapter)
    assert [(m.module, m.in_features, m.out_features) for m in adapter.modules] == [
        ("model.layers.0.self_attn.q_proj", 64, 64),
        ("model.layers.0.self_attn.v_proj", 64, 32),
    ]
    assert adapter.peft_config() == {
        "r": 8,
        "lora_alpha": 16.0,
        "target_modules": ["q_proj", "v_proj"],
        "use_rslora": False,
    }
    assert EngineLora.from_dict(ENGINE.as_dict()) == ENGINE


def test_a_module_the_engine_lacks_is_named_when_its_paths_are_known() -> None:
    engine = EngineLora(16, ENGINE.modules, frozenset(TINY))
    assert EngineLora.from_dict(engine.as_dict()) == engine
    assert check_adapter(manifest(adapter_specs(TINY, 8)), PEFT, engine).unwrap().rank == 8
    far = {"model.layers.9.self_attn.q_proj": (64, 64)}
    assert "not a module of this engine's model" in failure_of(adapter_specs(far, 8), PEFT, engine)


def test_alpha_defaults_to_the_plan_and_targets_may_be_one_string() -> None:
    peft = {"r": 8, "target_modules": "q_proj"}
    one = {k: v for k, v in TINY.items() if k.endswith("q_proj")}
    adapter = check_adapter(manifest(adapter_specs(one, 8)), peft, ENGINE, alpha=4).unwrap()
    assert adapter.alpha == 4.0
    assert adapter.targets == ("q_proj",)


def failure_of(
    specs: list[TensorSpec], peft: dict[str, object], engine: EngineLora = ENGINE
) -> str:
    result = check_adapter(manifest(specs), peft, engine)
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, AdapterError)
    assert error.problems
    return str(error)


@pytest.mark.parametrize(
    ("peft", "needle"),
    [
        ({**PEFT, "r": 32}, "exceeds the engine's max_lora_rank=16"),
        ({**PEFT, "r": 0}, "adapter_config.r must be"),
        ({**PEFT, "lora_alpha": -1}, "lora_alpha must be"),
        ({"r": 8, "target_modules": ["q_proj", "v_proj"]}, "lora_alpha must be"),
        ({**PEFT, "use_rslora": "no"}, "use_rslora must be a bool"),
        ({**PEFT, "target_modules": []}, "target_modules must be"),
        (
            {**PEFT, "target_modules": ["q_proj", "v_proj", "lm_head"]},
            "not modules this engine adapts",
        ),
        ({**PEFT, "target_modules": ["q_proj"]}, "is not in adapter_config.target_modules"),
        ({**PEFT, "use_dora": True}, "use_dora"),
        ({**PEFT, "modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({**PEFT, "bias": "all"}, "bias='all'"),
        ({**PEFT, "rank_r": 8}, "adapter_config.rank_r is not a PEFT LoRA key"),
    ],
)
def test_each_adapter_problem_is_named(peft: dict[str, object], needle: str) -> None:
    assert needle in failure_of(adapter_specs(TINY, 8), peft)


def test_tensors_that_are_not_lora_weights_or_not_float_are_named() -> None:
    specs = [
        *adapter_specs(TINY, 8, dtype="int8"),
        TensorSpec("model.embed_tokens.weight", (4, 4), "float32"),
    ]
    message = failure_of(specs, PEFT)
    assert "'model.embed_tokens.weight' is not a LoRA weight" in message
    assert "is int8" in message


def test_bad_shapes_are_named_by_module() -> None:
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    flat = [
        TensorSpec(f"{q}.lora_A.weight", (8,), "float32"),
        TensorSpec(f"{q}.lora_B.weight", (8, 8), "float32"),
    ]
    assert "must be 2-D" in failure_of(flat, PEFT)
    wrong = [
        TensorSpec(f"{q}.lora_A.weight", (4, 64), "float32"),
        TensorSpec(f"{q}.lora_B.weight", (64, 4), "float32"),
    ]
    assert "with r=8" in failure_of(wrong, PEFT)
    only_b = [TensorSpec(f"{q}.lora_B.weight", (64, 8), "float32")]
    assert "has lora_B.weight but no lora_A.weight" in failure_of(only_b, PEFT)
    only_a = [TensorSpec(f"{q}.lora_A.weight", (8, 64), "float32")]
    assert "has lora_A.weight but no lora_B.weight" in failure_of(only_a, PEFT)


@given(
    rank=st.integers(1, 16),
    layers=st.integers(1, 3),
    targets=st.sets(st.sampled_from(sorted(ENGINE.modules)), min_size=1),
    drop=st.integers(0, 100),
)
def test_law_a_complete_adapter_passes_and_any_missing_tensor_is_named(
    rank: int, layers: int, targets: set[str], drop: int
) -> None:
    modules = {f"model.layers.{i}.self_attn.{t}": (32, 16) for i in range(layers) for t in targets}
    peft = {"r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets)}
    specs = adapter_specs(modules, rank)
    adapter = check_adapter(manifest(specs), peft, ENGINE).unwrap()
    assert {m.module for m in adapter.modules} == set(modules)
    assert adapter.manifest.names == tuple(s.name for s in specs)
    missing = specs.pop(drop % len(specs))
    if specs:
        module = missing.name.removeprefix("base_model.model.").rsplit(".", 2)[0]
        assert repr(module) in failure_of(specs, peft)


@pytest.mark.parametrize("name", ["a", "nemo-rl-online", "org/adapter.v2", "x" * 128])
def test_adapter_names_that_serve(name: str) -> None:
    assert check_adapter_name(name) is None


@pytest.mark.parametrize("name", ["", "-a", "a b", "x" * 129, 3, None])
def test_adapter_names_refused(name: object) -> None:
    problem = check_adapter_name(name)
    assert problem is not None
    assert repr(name) in problem


# -- adapters per row, and the request plan -------------------------------------------
SERVED = {"a": 1, "b": 2}


def test_no_adapter_named_is_the_base_model() -> None:
    assert row_adapters(None, None, 3, SERVED).unwrap() == ()


def test_the_default_adapter_serves_unnamed_batches_once_it_is_served() -> None:
    assert row_adapters(None, None, 2, SERVED, "a").unwrap() == (LoraRef("a", 1),) * 2
    assert row_adapters(None, None, 2, SERVED, "nemo-rl-online").unwrap() == ()
    assert row_adapters(None, [None, "b"], 2, SERVED, "a").unwrap() == (None, LoraRef("b", 2))


def test_a_batch_adapter_and_per_row_names() -> None:
    assert row_adapters("a", None, 2, SERVED).unwrap() == (LoraRef("a", 1), LoraRef("a", 1))
    rows = row_adapters(None, ["b", None], 2, SERVED).unwrap()
    assert rows == (LoraRef("b", 2), None)
    assert adapter_path("a") == "genworker-lora://a"


@pytest.mark.parametrize(
    ("lora", "names", "field", "needle"),
    [
        ("a", ["a", "a"], "lora", "not both"),
        (None, ["a"], "lora_names", "a list of 2 names"),
        (None, "a", "lora_names", "a list of 2 names"),
        ("c", None, "lora", "no adapter 'c' is served here"),
        (None, ["a", 3], "lora_names", "no adapter 3"),
    ],
)
def test_bad_adapter_names_are_refused_by_input(
    lora: object, names: object, field: str, needle: str
) -> None:
    result = row_adapters(lora, names, 2, SERVED)
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, RowAdapterError)
    assert error.field == field
    assert needle in error.message


def test_the_request_plan_gives_each_row_its_adapter() -> None:
    from genworker.core.requests import RequestLimits, parse_sample_data, plan_requests
    from genworker.core.stops import StopMode

    cfg = WorkerConfig.from_mapping(base_config()).unwrap()
    data = {"lora_names": ["a", None, "a"]}
    samples = parse_sample_data(data, 3, config_stops=(), mode=StopMode.PER_SAMPLE, served=SERVED)
    limits = RequestLimits(
        max_new_tokens=4,
        max_model_len=32,
        cap_to_context=True,
        num_speculative_tokens=0,
        flat_logprobs=False,
    )
    rows = [(0, 5), (1, 5), (2, 5)]
    plan = plan_requests(cfg, limits, samples.unwrap(), rows, greedy=True).unwrap()
    specs = [spec for _, spec in plan.requests()]
    assert [s.adapter for s in specs] == [LoraRef("a", 1), None, LoraRef("a", 1)]
    assert specs[0] is specs[2]  # rows alike still share one spec
    assert "adapter" not in specs[0].as_kwargs()
    bad = parse_sample_data({"lora": "zz"}, 3, config_stops=(), mode=StopMode.PER_SAMPLE)
    assert isinstance(bad, Failure)
    assert bad.failure().field == "lora"


def test_what_the_engine_holds_names_a_packed_module_by_its_parts() -> None:
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    paths = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", "lm_head"]
    held = EngineLora.of(8, ["qkv_proj", "o_proj"], paths, packed)
    assert held == EngineLora(
        8,
        frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}),
        frozenset(
            {
                "model.layers.0.self_attn.q_proj",
                "model.layers.0.self_attn.k_proj",
                "model.layers.0.self_attn.v_proj",
                "model.layers.0.self_attn.o_proj",
                "lm_head",
            }
        ),
    )


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.integers(1, 64), max_size=6))
def test_an_adapter_keeps_its_id_and_a_new_one_takes_the_next_within_capacity(
    ids: dict[str, int],
) -> None:
    for name, own in ids.items():
        assert adapter_id(name, ids, 0) == Success(own)  # served: its id, whatever the room
    new = "new-adapter"
    assert adapter_id(new, ids, len(ids) + 1) == Success(max(ids.values(), default=0) + 1)
    refused = adapter_id(new, ids, len(ids))
    assert isinstance(refused, Failure)
    assert f"adapter {new!r} would be adapter {len(ids) + 1}" in str(refused.failure())
    assert f"serves {len(ids)} " in str(refused.failure())


def test_lora_update_takes_a_name_a_bound_and_a_transport() -> None:
    assert lora_update("math", None, "ipc") == Success((DEFAULT_TIMEOUT_S, Transport.IPC))
    assert lora_update("a/b", 2, "collective") == Success((2.0, Transport.COLLECTIVE))


@pytest.mark.parametrize(
    ("name", "timeout_s", "transport", "named"),
    [
        ("-x", 0, "nccl", "got '-x'"),  # the name first
        ("math", 0, "nccl", "timeout_s must be a finite number of seconds > 0"),  # the bound
        ("math", 1, "nccl", "transport must be one of ['collective', 'ipc'], got 'nccl'"),
        ("math", 1, None, "got None"),
    ],
)
def test_lora_update_refuses_the_first_bad_argument_naming_it(
    name: object, timeout_s: object, transport: object, named: str
) -> None:
    checked = lora_update(name, timeout_s, transport)
    assert isinstance(checked, Failure)
    assert named in checked.failure().message


def test_an_adapter_serves_under_the_id_every_engine_worker_reports() -> None:
    """One ``lora_int_id`` on every worker is the adapter's; workers that disagree, name
    none or name a non-int one serve no id the worker can trust."""
    assert served_adapter_id([{"lora_int_id": 3}, {"lora_int_id": 3}, "noise"]) == 3
    assert served_adapter_id([{"lora_int_id": 3}, {"lora_int_id": 4}]) is None
    assert served_adapter_id([{"lora_int_id": "3"}]) is None
    assert served_adapter_id([{}]) is None
    assert served_adapter_id([]) is None
