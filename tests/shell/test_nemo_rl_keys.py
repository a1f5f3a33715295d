"""Every honoured key does something: two values of it make the worker behave differently.

The table below names, for each key ``config_keys.KEYS`` calls honoured, two values and
what the worker does differently with them (the engine's arguments, its requests, the
output tensors, the environment or the engine calls), on the fake engine. A key that
parsed and then did nothing would give the same observation twice and fail here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from helpers import base_config, right_padded

from genworker.core.config_keys import KEYS, Fate
from genworker.core.routing import MoeShape
from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import BadConfigError, GenworkerError
from genworker.shell.fake_async_engine import FakeAsyncEngineFactory
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.worker import VllmGenerationWorker


@attrs.define
class Run:
    """What one config did: the engine's kwargs, its requests, the outputs, the env."""

    kwargs: dict[str, object]
    engine: FakeEngine
    out: dict[str, Any]
    texts: list[str]
    env: dict[str, str]
    worker: VllmGenerationWorker


def _run(config: dict[str, Any], pad: int) -> Run | str:
    """Start a worker on the fake engine, generate (sampled) and sleep; or the error text."""
    factory = FakeEngineFactory(max_model_len=64, moe=_MOE)  # moe: used only for R3
    try:
        worker = VllmGenerationWorker(config, engine_factory=factory)
    except GenworkerError as e:
        return f"{type(e).__name__}: {e}"
    kwargs, engine = factory.started[-1]
    out = worker.generate(right_padded([[1, 2, 3, 4, 5] * 4, [6, 7]], width=24, pad=pad))
    texts = worker.generate_text({"prompts": ["abc"]})["texts"]
    env = dict(os.environ)
    worker.sleep()
    return Run(kwargs, engine, out, texts, env, worker)


_MOE = MoeShape(num_layers=2, top_k=2, num_experts=4)


def _routes(run: Run) -> object:
    return run.kwargs.get("enable_return_routed_experts"), "routed_experts" in run.out


def _spec(attribute: str) -> Callable[[Run], object]:
    return lambda run: [getattr(spec, attribute) for _, spec in run.engine.requests]


def _kwarg(name: str) -> Callable[[Run], object]:
    return lambda run: run.kwargs.get(name)


def _pad_values(run: Run) -> object:
    out = run.out
    lengths = out["unpadded_sequence_lengths"].tolist()
    return sorted({int(v) for i, n in enumerate(lengths) for v in out["output_ids"][i, n:]})


_LORA = {"vllm_kwargs.enable_lora": True}

# key: (value a, value b, what differs, extra config for both runs)
EFFECTS: dict[str, tuple[object, object, Callable[[Run], object], dict[str, Any]]] = {
    "model_name": ("m1", "m2", _kwarg("model"), {}),
    "max_new_tokens": (3, 9, _spec("max_tokens"), {}),
    "temperature": (0.5, 1.5, _spec("temperature"), {}),
    "top_p": (0.5, 1.0, _spec("top_p"), {}),
    "top_k": (None, 5, _spec("top_k"), {}),
    "stop_token_ids": (None, [7], _spec("stop_token_ids"), {}),
    "stop_strings": (None, ["zz"], _spec("stop"), {}),
    "bad_words": (None, ["ab"], _spec("bad_words"), {}),
    "ignore_eos": (False, "true", _spec("ignore_eos"), {}),
    "_pad_token_id": (0, 9, _pad_values, {}),
    "vllm_kwargs": ({}, {"max_num_seqs": 4}, _kwarg("max_num_seqs"), {}),
    "seed": (None, 77, _kwarg("seed"), {}),
    "logprobs_mode": (None, "raw_logprobs", _kwarg("logprobs_mode"), {}),
    "telemetry.*": (
        None,
        {"enabled": True, "otlp_endpoint": "http://collector:4317"},
        _kwarg("otlp_traces_endpoint"),
        {},
    ),
    "vllm_cfg.tensor_parallel_size": (1, 2, _kwarg("tensor_parallel_size"), {}),
    "vllm_cfg.pipeline_parallel_size": (1, 2, _kwarg("pipeline_parallel_size"), {}),
    "vllm_cfg.expert_parallel_size": (
        1,
        2,
        _kwarg("enable_expert_parallel"),
        {"vllm_cfg.tensor_parallel_size": 2},
    ),
    "vllm_cfg.gpu_memory_utilization": (0.5, 0.9, _kwarg("gpu_memory_utilization"), {}),
    "vllm_cfg.max_model_len": (32, 48, _kwarg("max_model_len"), {}),
    "vllm_cfg.skip_tokenizer_init": (False, True, _kwarg("skip_tokenizer_init"), {}),
    "vllm_cfg.load_format": ("auto", "dummy", _kwarg("load_format"), {}),
    "vllm_cfg.precision": ("float32", "bf16", _kwarg("dtype"), {}),
    "vllm_cfg.logprobs_mode": ("processed_logprobs", "raw_logits", _kwarg("logprobs_mode"), {}),
    "vllm_cfg.cap_max_tokens_to_context": (
        False,
        True,
        _spec("max_tokens"),
        {"max_new_tokens": 60},
    ),
    "vllm_cfg.kv_cache_dtype": ("auto", "fp8", _kwarg("kv_cache_dtype"), {}),
    "vllm_cfg.enforce_eager": ("False", "True", _kwarg("enforce_eager"), {}),
    "vllm_cfg.enable_prefix_caching": (None, True, _kwarg("enable_prefix_caching"), {}),
    "vllm_cfg.use_tqdm": (False, True, lambda run: run.engine.progress_bars, {}),
    "vllm_cfg.env_vars.*": (
        None,
        {"GENWORKER_TEST_FLAG": "on"},
        lambda run: (
            run.env.get("GENWORKER_TEST_FLAG"),
            run.env.get("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"),
        ),
        {},
    ),
    "vllm_cfg.speculative_config.*": (
        None,
        {"method": "ngram", "num_speculative_tokens": 3},
        lambda run: (run.kwargs.get("speculative_config"), _spec("max_tokens")(run)),
        {"max_new_tokens": 60},
    ),
    "vllm_cfg.sleep_level": (1, 2, lambda run: run.engine.calls[-1], {}),
    "vllm_cfg.nvfp4_per_token": (False, True, lambda run: run.kwargs.get("quantization"), {}),
    "vllm_cfg.limit_mm_per_prompt.*": (None, {"image": 2}, _kwarg("limit_mm_per_prompt"), {}),
    "vllm_cfg.mm_processor_kwargs.*": (
        None,
        {"do_image_splitting": False},
        _kwarg("mm_processor_kwargs"),
        {},
    ),
    "vllm_kwargs.limit_mm_per_prompt": (None, {"image": 1}, _kwarg("limit_mm_per_prompt"), {}),
    "vllm_kwargs.mm_processor_kwargs": (
        None,
        {"max_pixels": 1024},
        _kwarg("mm_processor_kwargs"),
        {},
    ),
    "vllm_kwargs.mm_processor_cache_gb": (None, 4, _kwarg("mm_processor_cache_gb"), {}),
    "vllm_kwargs.skip_mm_profiling": (None, True, _kwarg("skip_mm_profiling"), {}),
    # LoRA (core.lora): planned into vLLM's options
    "lora_refit_mode": (None, "native", _kwarg("enable_lora"), {}),
    "vllm_kwargs.enable_lora": (None, True, _kwarg("enable_lora"), {}),
    "vllm_kwargs.max_lora_rank": (8, 16, _kwarg("max_lora_rank"), _LORA),
    "vllm_kwargs.max_loras": (1, 2, _kwarg("max_loras"), _LORA),
    "vllm_kwargs.max_cpu_loras": (2, 4, _kwarg("max_cpu_loras"), _LORA),
    "vllm_kwargs.lora_dtype": ("auto", "bfloat16", _kwarg("lora_dtype"), _LORA),
    "vllm_kwargs.additional_config.*": (
        None,
        {"nemo_rl_native_lora": {"rank": 32, "alpha": 64}},
        _kwarg("max_lora_rank"),
        {},
    ),
    "vllm_cfg.enable_return_routed_experts": (False, True, _routes, {}),
    "vllm_kwargs.enable_return_routed_experts": (None, True, _routes, {}),
}

# Keys whose only honoured value is fixed: any other is refused (the effect is the refusal).
ONE_VALUE = {
    "backend": ("vllm", "megatron"),
    # The sync worker's one value; true is AsyncVllmGenerationWorker's (the test below).
    "vllm_cfg.async_engine": (False, True),
    # Derived from the sizes (tensor, pipeline, expert parallel 1 here): the value that
    # agrees is taken, the other refused.
    "vllm_cfg.enable_expert_parallel": (False, True),
    "vllm_cfg.distributed_executor_backend": ("uni", "ray"),
}
# Keys whose effect depends on the engine: tested on their own below.
ENGINE_DEPENDENT = {
    "vllm_cfg.reset_encoder_cache_after_weight_update",
    "vllm_cfg.reset_mm_cache_after_refit",
}
# Keys whose effect is checked on the NeMo-RL drop-ins (tests/shell/test_nemo_rl_drift.py:
# the batch under both stop modes; a key in no table refused, or logged under warn).
DROP_IN = {"stop_strings_mode", "unknown_keys"}
# Blocks whose keys are the table's other rows.
BLOCKS = {"vllm_cfg"}
# Keys whose effect is on the engine workers, which the fake has not: tested on the real
# engine in the named file.
REAL_ENGINE = {
    # a NaN refit refused with the check on, applied with it off
    "vllm_cfg.refit_finite_check": "tests/shell/test_refit_safety_engine.py",
}


@pytest.fixture(autouse=True)
def _restore_env() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_every_honoured_key_has_an_effect_row() -> None:
    honoured = {r.key for r in KEYS if r.fate is Fate.HONOURED}
    tables = set(EFFECTS) | set(ONE_VALUE) | BLOCKS | ENGINE_DEPENDENT | DROP_IN
    assert honoured == tables | set(REAL_ENGINE)


@pytest.mark.parametrize("path", sorted(REAL_ENGINE))
def test_a_key_tested_on_the_real_engine_is_named_in_its_test_file(path: str) -> None:
    tests = Path(__file__).parents[2] / REAL_ENGINE[path]
    assert path.removeprefix("vllm_cfg.") in tests.read_text(), (path, REAL_ENGINE[path])


def _with(path: str, value: object, extra: dict[str, Any]) -> dict[str, Any]:
    config = base_config(vllm_cfg={"max_model_len": 64})
    for key, v in [*extra.items(), (path.removesuffix(".*"), value)]:
        *parents, leaf = key.split(".")
        target = config
        for parent in parents:
            target = target.setdefault(parent, {})
        if v is None:
            target.pop(leaf, None)
        else:
            target[leaf] = v
    return config


@pytest.mark.parametrize("path", sorted(EFFECTS))
def test_an_honoured_key_changes_what_the_worker_does(path: str) -> None:
    a, b, observe, extra = EFFECTS[path]
    seen: list[object] = []
    for value in (a, b):
        config = _with(path, value, extra)
        run = _run(config, pad=int(config["_pad_token_id"]))
        if isinstance(run, str):  # only the Blackwell-only key may refuse this host
            assert (path, value) == ("vllm_cfg.nvfp4_per_token", True), run
            seen.append(run)
        else:
            seen.append(observe(run))
    assert seen[0] != seen[1], f"{path}: {a!r} and {b!r} did the same: {seen[0]!r}"


def test_nvfp4_per_token_is_honoured_by_refusing_a_host_without_blackwell() -> None:
    """On the fake (no GPU) the key's effect is the planner's refusal, naming the GPU."""
    run = _run(_with("vllm_cfg.nvfp4_per_token", True, {"vllm_cfg.precision": "bfloat16"}), 0)
    assert isinstance(run, str)
    assert "BadConfigError" in run
    assert "Blackwell" in run


@pytest.mark.parametrize("path", sorted(ONE_VALUE))
def test_a_one_value_key_refuses_every_other_value(path: str) -> None:
    good, bad = ONE_VALUE[path]
    assert not isinstance(_run(_with(path, good, {}), 0), str)
    with pytest.raises(BadConfigError, match=path):
        VllmGenerationWorker(_with(path, bad, {}), engine_factory=FakeEngineFactory())


def test_async_engine_true_is_the_async_worker_s_and_the_sync_worker_names_it() -> None:
    """``vllm_cfg.async_engine`` picks the worker: the sync one refuses true naming the
    async class, which starts its engine on true and refuses false naming the sync one."""
    config = _with("vllm_cfg.async_engine", True, {})
    with pytest.raises(BadConfigError, match=r"vllm_cfg\.async_engine.*AsyncVllmGenerationWorker"):
        VllmGenerationWorker(config, engine_factory=FakeEngineFactory())
    factory = FakeAsyncEngineFactory(max_model_len=64)
    worker = AsyncVllmGenerationWorker(config, engine_factory=factory)
    assert worker.cfg.vllm.async_engine is True
    assert len(factory.started) == 1, "the async worker started its engine"
    with pytest.raises(
        BadConfigError, match=r"vllm_cfg\.async_engine is false.*VllmGenerationWorker"
    ):
        AsyncVllmGenerationWorker(
            _with("vllm_cfg.async_engine", False, {}), engine_factory=FakeAsyncEngineFactory()
        )


@pytest.mark.parametrize("value", [False, "false", 0])
@pytest.mark.parametrize(
    "path",
    ["vllm_cfg.reset_encoder_cache_after_weight_update", "vllm_cfg.reset_mm_cache_after_refit"],
)
def test_keeping_the_encoder_cache_is_vacuous_on_text_and_refused_on_a_multimodal_engine(
    value: object, path: str
) -> None:
    """NeMo-RL's stock ``reset_encoder_cache_after_weight_update: false``: a text-only
    engine has no encoder cache (the worker runs); a multimodal one would keep encoder
    outputs of the old weights, so the worker refuses it naming the key, and the engine it
    started for the check is shut down (NeMo-RL #3648's reset_mm_cache_after_refit alike)."""
    text = _run(_with(path, value, {}), 0)
    assert isinstance(text, Run)
    factory = FakeEngineFactory(image_token_id=5, max_images=1)
    with pytest.raises(BadConfigError, match=path):
        VllmGenerationWorker(_with(path, value, {}), engine_factory=factory)
    assert factory.started
    assert factory.started[-1][1].shut_down
    kept = VllmGenerationWorker(
        _with(path, True, {}), engine_factory=FakeEngineFactory(image_token_id=5, max_images=1)
    )
    assert kept.is_alive()
