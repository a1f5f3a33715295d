"""``genworker.core.nemo_rl_front``: NeMo-RL's output keys and routes layout, the counters
keyed by name without genworker's own, ``wake_up``'s one keyword, the URL NeMo-RL is
told, and the refusals of what the async drop-in cannot do."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from returns.result import Failure, Success

from genworker.core.config import WorkerConfig
from genworker.core.counters import (
    CACHE_RESETS,
    NONFINITE_LOGPROBS,
    PROMPT_TOKENS,
    CounterSample,
    encode_snapshot,
)
from genworker.core.nemo_rl_front import (
    NEMO_RL_OUTPUT_KEYS,
    REFUSED,
    ROUTED_EXPERTS,
    SAMPLING_KEYS,
    WakeUpError,
    nemo_rl_outputs,
    raw_spec_counters,
    refusal,
    reported_url,
    sampling_params,
    wake_up_tags,
    with_sampling,
)


def _out(**extra: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {key: torch.zeros(2, 3) for key in NEMO_RL_OUTPUT_KEYS}
    return {**out, "weight_versions": torch.zeros(2, 3), **extra}


def test_outputs_keep_nemo_rls_keys_and_drop_weight_versions() -> None:
    assert list(nemo_rl_outputs(_out())) == list(NEMO_RL_OUTPUT_KEYS)


def test_routes_come_in_nemo_rls_layout() -> None:
    routes = np.full((1, 2, 1, 2), -1, dtype=np.int16)
    routes[0, 0, 0] = [3, 1]
    spec = nemo_rl_outputs(_out(**{ROUTED_EXPERTS: torch.from_numpy(routes)}))
    assert spec[ROUTED_EXPERTS].tolist() == [[[[3, 1]], [[0, 1]]]]


def test_counters_are_keyed_by_name_without_genworkers_own() -> None:
    encoded = encode_snapshot(
        [
            CounterSample(PROMPT_TOKENS, (("engine", "0"),), 3.0),
            CounterSample(PROMPT_TOKENS, (("engine", "1"),), 4.0),
            CounterSample(CACHE_RESETS, (("cache", "prefix"),), 1.0),
            CounterSample(NONFINITE_LOGPROBS, (("kind", "nan"),), 2.0),
        ]
    )
    assert raw_spec_counters(encoded) == Success({PROMPT_TOKENS: 7.0})
    assert isinstance(raw_spec_counters({"not a key{": 1.0}), Failure)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({}, None), ({"tags": None}, None), ({"tags": ["weights"]}, ["weights"])],
)
def test_wake_up_takes_tags(kwargs: dict[str, object], expected: list[str] | None) -> None:
    assert wake_up_tags("wake_up", kwargs) == Success(expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tags": ["kv_cache"], "level": 1}, "wake_up takes only tags=, got ['level']"),
        ({"tags": 3}, "wake_up tags must be a list of str or None, got 3"),
    ],
)
def test_wake_up_refuses_anything_else_by_name(kwargs: dict[str, object], message: str) -> None:
    assert wake_up_tags("wake_up", kwargs) == Failure(WakeUpError(message))


@pytest.mark.parametrize(
    ("bound", "node", "reported"),
    [
        (None, "10.1.2.3", None),
        ("http://127.0.0.1:5001/v1", "10.1.2.3", "http://127.0.0.1:5001/v1"),
        ("http://10.9.9.9:5001/v1", "10.1.2.3", "http://10.9.9.9:5001/v1"),
        ("http://0.0.0.0:5001/v1", "10.1.2.3", "http://10.1.2.3:5001/v1"),
        ("http://[::]:5001/v1", "fd00::7", "http://[fd00::7]:5001/v1"),
    ],
)
def test_a_server_on_every_interface_is_reported_at_the_nodes_address(
    bound: str | None, node: str, reported: str | None
) -> None:
    assert reported_url(bound, lambda: node) == reported


_CONFIG = {
    "backend": "vllm",
    "model_name": "m",
    "max_new_tokens": 8,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "stop_token_ids": None,
    "stop_strings": None,
    "_pad_token_id": 0,
    "vllm_cfg": {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "gpu_memory_utilization": 0.5,
        "max_model_len": 32,
    },
}


def test_update_sampling_params_takes_the_sampling_keys_only() -> None:
    params = {"temperature": 0.5, "top_k": 3}
    assert sampling_params(params) == Success(params)
    refused = sampling_params({"temperature": 0.5, "model_name": "x", "seed": 1})
    assert isinstance(refused, Failure)
    assert str(refused.failure()) == (
        f"update_sampling_params takes only {list(SAMPLING_KEYS)}, got ['model_name', 'seed']"
    )


def test_new_sampling_values_replace_the_configs_and_are_checked_as_it_is() -> None:
    cfg = WorkerConfig.from_mapping(_CONFIG).unwrap()
    updated = with_sampling(cfg, {"temperature": 0.5, "max_new_tokens": 4})
    assert isinstance(updated, Success)
    assert (updated.unwrap().temperature, updated.unwrap().max_new_tokens) == (0.5, 4)
    assert updated.unwrap().model_name == cfg.model_name
    assert isinstance(with_sampling(cfg, {"max_new_tokens": 0}), Failure)


@pytest.mark.parametrize("method", sorted(REFUSED))
def test_a_refusal_names_the_method_what_it_asks_for_and_what_to_do_instead(method: str) -> None:
    what, instead = REFUSED[method]
    message = refusal(method, "init_checkpoint_engine")
    assert message == (
        f"{method}: {what.format('init_checkpoint_engine')} is not supported by genworker's "
        f"drop-in; {instead}"
    )
    assert instead.startswith(("refit with", "set ", "leave ", "unset "))


def test_the_checkpoint_engines_refusal_names_the_method_asked_for() -> None:
    assert refusal("checkpoint_engine_rpc_async", "init_checkpoint_engine") == (
        "checkpoint_engine_rpc_async: the checkpoint engine (init_checkpoint_engine) is not "
        "supported by genworker's drop-in; leave checkpoint_engine unset and refit with "
        "update_weights_via_ipc_zmq_async or update_weights_from_collective_async"
    )
    assert refusal("set_rollout_weight_version").endswith(
        "weight_versions; genworker counts weight versions itself (one per good refit)"
    )
