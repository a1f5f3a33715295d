"""NeMo-RL's worker contract, as its Ray layer drives it, without NeMo-RL installed.

``configure_worker`` is compared with an independent re-implementation of NeMo-RL's
(``BaseVllmGenerationWorker.configure_worker``, NeMo-RL commit 7ea279ab); the worker itself
runs on the fake engine, and once on a local Ray the way ``RayWorkerBuilder`` creates it.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import base_config
from helpers import right_padded as batch
from hypothesis import given
from hypothesis import strategies as st

from genworker.core import lifecycle
from genworker.core.refit_protocol import DEFAULT_TIMEOUT_S
from genworker.shell import host
from genworker.shell.errors import (
    BadArgumentError,
    BadConfigError,
    EngineStateError,
    RefitError,
)
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.nemo_rl import NemoRlGenerationWorker, VllmGenerationWorker

CLASS_PATH = "genworker.shell.nemo_rl.VllmGenerationWorker"


@pytest.fixture(autouse=True)
def _clean_env() -> Iterator[None]:
    """Each test starts without the variables a worker exports; all are restored after."""
    saved = dict(os.environ)
    for name in (
        "CUDA_VISIBLE_DEVICES",
        "VLLM_RAY_BUNDLE_INDICES",
        "VLLM_RAY_PER_WORKER_GPUS",
        "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY",
        "VLLM_CACHE_ROOT",
        "MY_FLAG",
    ):
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _config(tp: int = 1, pp: int = 1, **vllm_cfg: Any) -> dict[str, Any]:
    return base_config(
        vllm_cfg={"tensor_parallel_size": tp, "pipeline_parallel_size": pp, **vllm_cfg}
    )


def _owner(
    config: dict[str, Any] | None = None, **kwargs: Any
) -> tuple[NemoRlGenerationWorker, FakeEngine, FakeEngineFactory]:
    factory = FakeEngineFactory(max_model_len=32)
    worker = NemoRlGenerationWorker(
        config or _config(), kwargs.pop("bundle_indices", [0]), engine_factory=factory, **kwargs
    )
    return worker, factory.started[-1][1], factory


# --- configure_worker ------------------------------------------------------------------------


def _nemo_rl_configure_worker(
    num_gpus: float,
    bundle_indices: tuple[int, list[int]] | None,
    num_gpus_per_node: int | None,
    cache_root: str,
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any], dict[str, Any]]:
    """NeMo-RL's rules, re-implemented from its source (no nsight patterns set)."""
    resources: dict[str, Any] = {"num_gpus": num_gpus}
    env: dict[str, str] = {}
    init: dict[str, Any] = {}
    ids = None
    if bundle_indices is not None:
        node, ids = bundle_indices
        init["bundle_indices"] = ids
        size = len(ids)
        seed = node * 1024 + (ids[0] if size == 1 else ids[0] // size)
        init["seed"] = seed
        env["VLLM_CACHE_ROOT"] = f"{cache_root}_{seed}"
        if num_gpus_per_node is None:
            slot = ids[0] if size == 1 else ids[0] // size
        elif size > num_gpus_per_node:
            slot = 0
        else:
            slot = (ids[0] % num_gpus_per_node) // size
        env["VLLM_PORT"] = str(7000 + slot * 100)
    if ids is None or len(ids) > 1:
        resources["num_gpus"] = 0
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        init["fraction_of_gpus"] = num_gpus
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_SKIP_P2P_CHECK"] = "1"
    return resources, env, init, {}


# (tp * pp, gpus per node or None, node, first id)
LAYOUTS = [
    pytest.param(1, 8, 0, 0, id="tp1"),
    pytest.param(1, 8, 1, 5, id="tp1-node1"),
    pytest.param(2, 8, 0, 2, id="tp2"),
    pytest.param(4, 8, 1, 4, id="tp4"),
    pytest.param(2, 8, 0, 6, id="pp2"),
    pytest.param(4, None, 0, 4, id="tp4-unknown-gpus-per-node"),
    pytest.param(16, 8, 0, 16, id="tp16-across-nodes"),
]


@pytest.mark.parametrize(("size", "per_node", "node", "first"), LAYOUTS)
def test_configure_worker_returns_nemo_rls_four_values_for_every_member(
    size: int, per_node: int | None, node: int, first: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/scratch/vllm")
    ids = list(range(first, first + size))
    owner = VllmGenerationWorker.configure_worker(
        num_gpus=1, bundle_indices=(node, ids), num_gpus_per_node=per_node
    )
    assert owner == _nemo_rl_configure_worker(1, (node, ids), per_node, "/scratch/vllm")
    assert len(owner) == 4
    for _ in range(size - 1):  # the tied group's other members
        inert = VllmGenerationWorker.configure_worker(
            num_gpus=1, bundle_indices=None, num_gpus_per_node=per_node
        )
        assert inert == _nemo_rl_configure_worker(1, None, per_node, "/scratch/vllm")


@pytest.mark.parametrize(("size", "first"), [(1, 0), (1, 3), (2, 2), (4, 4)])
def test_configure_worker_on_a_gpu_less_cluster_is_nemo_rls_answer(
    size: int, first: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RayVirtualCluster(use_gpus=False)`` asks with ``num_gpus=0`` (issue 43, item 2)."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/scratch/vllm")
    ids = list(range(first, first + size))
    for bundle_indices in ((0, ids), None):
        ours = VllmGenerationWorker.configure_worker(
            num_gpus=0, bundle_indices=bundle_indices, num_gpus_per_node=8
        )
        assert ours == _nemo_rl_configure_worker(0, bundle_indices, 8, "/scratch/vllm")
        assert ours[0] == {"num_gpus": 0}


@given(
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([None, 8]),
    st.integers(0, 3),
    st.integers(0, 7),
    st.sampled_from([1, 0.5]),
)
def test_configure_worker_agrees_with_nemo_rl_on_aligned_groups(
    size: int, per_node: int | None, node: int, slot: int, num_gpus: float
) -> None:
    ids = [i for i in range(slot * size, (slot + 1) * size)]
    if per_node is not None and ids[-1] >= per_node:
        return
    ours = VllmGenerationWorker.configure_worker(num_gpus, (node, ids), per_node)
    root = host.vllm_cache_root()
    assert ours == _nemo_rl_configure_worker(num_gpus, (node, ids), per_node, root)


def test_cache_root_defaults_to_vllms_home_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    _, env, _, _ = VllmGenerationWorker.configure_worker(1, (0, [3]))
    assert env["VLLM_CACHE_ROOT"] == os.path.expanduser("~/.cache/vllm") + "_3"


def test_vllm_port_stays_below_the_hosts_ephemeral_range_or_fails_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(host, "PORT_RANGE_FILE", str(ports))
    ports.write_text("9000\t65535\n")  # a DGX/GB200 floor
    _, env, _, _ = VllmGenerationWorker.configure_worker(1, (0, [7]), 8)
    assert env["VLLM_PORT"] == "7700"
    ports.write_text("7500\t65535\n")
    with pytest.raises(BadConfigError, match="ephemeral port range 7500-65535"):
        VllmGenerationWorker.configure_worker(1, (0, [0]), 8)
    ports.write_text("nonsense\n")
    with pytest.raises(BadConfigError, match="ip_local_port_range"):
        VllmGenerationWorker.configure_worker(1, (0, [0]), 8)
    monkeypatch.setattr(host, "PORT_RANGE_FILE", str(tmp_path / "absent"))
    assert host.ephemeral_ports() == (32768, 60999)


# --- tied groups: the owner builds, the others stay inert --------------------------------------


def test_inert_members_load_nothing_and_refuse_engine_calls() -> None:
    factory = FakeEngineFactory()
    worker = NemoRlGenerationWorker(_config(tp=2), None, 1.0, engine_factory=factory)
    assert factory.started == []
    assert not worker.is_model_owner
    assert worker.llm() is None
    assert worker.is_alive()
    assert worker._get_raw_spec_counters() == {}
    with pytest.raises(EngineStateError, match="inert member"):
        worker.generate(batch([[1, 2]]))
    with pytest.raises(EngineStateError, match="inert member"):
        worker.post_init()
    assert worker.update_weights_via_ipc_zmq() is False  # a refit says False, keeps the error
    assert isinstance(worker.last_refit_error, EngineStateError)
    assert "inert member" in str(worker.last_refit_error)
    # NeMo-RL's VllmGeneration profiles every worker: nothing to profile here, no error.
    worker.start_gpu_profiling()
    worker.stop_gpu_profiling()
    assert worker.shutdown() is True
    with pytest.raises(EngineStateError, match="shut down"):
        worker.start_gpu_profiling()
    assert not worker.is_alive()
    assert repr(worker) == "NemoRlGenerationWorker"


def test_an_inert_member_still_refuses_a_bad_config() -> None:
    with pytest.raises(BadConfigError, match="quant_cfg"):
        NemoRlGenerationWorker({**_config(), "quant_cfg": "nvfp4"}, None)


@pytest.mark.parametrize(
    ("tp", "pp", "ids", "fraction", "per_worker"),
    [(2, 1, [0, 1], 1.0, "0.5"), (4, 1, [4, 5, 6, 7], 1.0, "0.25"), (1, 2, [2, 3], 0.5, "0.25")],
)
def test_a_tp_or_pp_owner_sets_up_vllms_ray_executor_before_loading(
    tp: int,
    pp: int,
    ids: list[int],
    fraction: float,
    per_worker: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    worker, _, factory = _owner(
        _config(tp=tp, pp=pp), bundle_indices=ids, fraction_of_gpus=fraction
    )
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert os.environ["VLLM_RAY_BUNDLE_INDICES"] == ",".join(map(str, ids))
    assert os.environ["VLLM_RAY_PER_WORKER_GPUS"] == per_worker
    kwargs, _ = factory.started[-1]
    assert kwargs["distributed_executor_backend"] == "ray"
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (tp, pp)
    assert worker.is_model_owner


def test_a_one_gpu_owner_keeps_its_visible_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    _owner(bundle_indices=[3])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert "VLLM_RAY_BUNDLE_INDICES" not in os.environ


def test_a_deferred_owner_loads_on_load_model() -> None:
    factory = FakeEngineFactory()
    worker = NemoRlGenerationWorker(_config(), [0], defer_model_load=True, engine_factory=factory)
    assert factory.started == []
    assert worker.llm() is None
    assert worker.is_alive()
    worker.load_model()
    assert isinstance(worker.llm(), FakeEngine)


def test_async_engine_is_refused_naming_the_async_worker() -> None:
    with pytest.raises(BadConfigError, match=r"async_engine.*VllmAsyncGenerationWorker"):
        NemoRlGenerationWorker(_config(async_engine=True), [0])


# --- environment forwarding ------------------------------------------------------------------


def test_extra_env_vars_and_config_env_vars_reach_vllms_ray_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", "KEEP_ME")
    _owner(
        _config(tp=2, env_vars={"MY_FLAG": 7}),
        bundle_indices=[0, 1],
        extra_env_vars=["QUANT_CFG_PATH", "HF_TOKEN"],
    )
    assert os.environ["MY_FLAG"] == "7"
    assert (
        os.environ["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"] == "HF_TOKEN,KEEP_ME,MY_FLAG,QUANT_CFG_PATH"
    )


@pytest.mark.parametrize("names", [{"A": "1"}, "AB", ["A=1"], ["1A"], [3]])
def test_extra_env_vars_must_be_a_list_of_names(names: Any) -> None:
    with pytest.raises(BadArgumentError, match="extra_env_vars"):
        NemoRlGenerationWorker(_config(), None, extra_env_vars=names)


# --- the calls NeMo-RL's VllmGeneration makes ----------------------------------------------------


def test_post_init_records_device_ids_and_llm_is_a_method() -> None:
    worker, engine, _ = _owner()
    worker.post_init()
    assert worker.vllm_device_ids == ["fake-cpu"]
    assert worker.llm() is engine
    assert worker.report_device_id() == ["fake-cpu"]


def test_generate_and_generate_text_keep_the_output_contract() -> None:
    worker, _, _ = _owner()
    out = worker.generate(batch([[3, 4], [5]]), greedy=True)
    assert set(out) == {
        "output_ids",
        "logprobs",
        "generation_lengths",
        "unpadded_sequence_lengths",
        "truncated",
    }
    assert out["output_ids"].dtype == torch.long
    assert worker.generate_text({"prompts": ["abc"]})["texts"][0]


def test_raw_spec_counters_are_keyed_by_metric_name() -> None:
    worker, _, _ = _owner()
    out = worker.generate(batch([[3, 4, 5], [6]]))
    counters = worker._get_raw_spec_counters()
    assert counters == {
        "vllm:generation_tokens": float(out["generation_lengths"].sum()),
        "vllm:prompt_tokens": 4.0,
    }


def test_sleep_takes_no_level_and_wake_up_takes_nemo_rls_tags_keyword() -> None:
    worker, engine, _ = _owner(_config(sleep_level=2))
    worker.sleep()
    assert "sleep(2)" in engine.calls
    worker.wake_up(tags=["weights"])
    worker.wake_up()
    assert engine.awake_tags == {"weights", "kv_cache"}
    with pytest.raises(BadArgumentError, match="only tags"):
        worker.wake_up(tags=["kv_cache"], level=1)
    with pytest.raises(BadArgumentError, match="tags"):
        worker.wake_up(tags=3)
    worker.reset_prefix_cache()


def test_prepare_refit_info_returns_none_and_keeps_the_summaries() -> None:
    worker, engine, _ = _owner()
    seen: list[object] = []

    def prepare(info: dict[str, object]) -> dict[str, object]:
        seen.append(info)
        return {"tensors": len(info)}

    engine.rpc_handlers["prepare_refit_info"] = prepare
    info = {"w": ((2, 3), torch.bfloat16)}
    assert worker.prepare_refit_info(info) is None
    assert seen == [{"w": [[2, 3], "bfloat16"]}]
    assert worker.refit_info == [{"tensors": 1}]


def test_a_failed_refit_returns_false_and_keeps_the_typed_error() -> None:
    worker, engine, _ = _owner()
    timeouts: list[float] = []

    def failing(timeout_s: float) -> None:
        timeouts.append(timeout_s)
        raise TimeoutError(f"no bucket within {timeout_s} s")

    engine.rpc_handlers["nemo_rl_update_weights_from_collective"] = failing
    engine.rpc_handlers["nemo_rl_init_collective"] = lambda *args: {"rank": 1}
    assert worker.update_weights_from_collective(refit_timeout_s=5) is False  # no group yet
    assert isinstance(worker.last_refit_error, EngineStateError)
    assert "init_collective first" in str(worker.last_refit_error)
    worker.prepare_refit_info({"w": ((2,), torch.float32)})
    worker.init_collective(0, "127.0.0.1", 29500, 2, 1)
    assert worker.update_weights_from_collective(refit_timeout_s=5) is False
    assert isinstance(worker.last_refit_error, RefitError)
    assert "no bucket within 5.0 s" in str(worker.last_refit_error)
    assert worker.get_last_refit_error() is worker.last_refit_error
    with pytest.raises(EngineStateError, match="refit again"):
        worker.generate(batch([[1]]))

    def succeeding(timeout_s: float) -> None:
        timeouts.append(timeout_s)
        engine.load_new_weights()

    engine.rpc_handlers["nemo_rl_update_weights_from_collective"] = succeeding
    engine.rpc_handlers["nemo_rl_update_weights_via_ipc_zmq"] = succeeding
    engine.rpc_handlers["nemo_rl_ipc_socket_dir"] = lambda d: f"ipc://{d}/cpu.sock"
    assert worker.update_weights_from_collective() is True
    assert worker.get_last_refit_error() is None
    assert worker.update_weights_via_ipc_zmq(refit_timeout_s=2.5) is True
    assert timeouts == [5.0, DEFAULT_TIMEOUT_S, 2.5]  # None: the refit default
    assert worker.generate(batch([[1]]))["output_ids"].shape[0] == 1


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, math.inf, "5", True])
def test_a_bad_refit_timeout_returns_false_and_changes_nothing(timeout: object) -> None:
    worker, engine, _ = _owner()
    assert worker.update_weights_via_ipc_zmq(refit_timeout_s=timeout) is False  # type: ignore[arg-type]
    assert isinstance(worker.last_refit_error, BadArgumentError)
    assert "timeout_s" in str(worker.last_refit_error)
    assert not any(c.startswith("rpc:") for c in engine.calls)
    assert worker.generate(batch([[1]]))["output_ids"].shape[0] == 1


def test_a_refit_the_lifecycle_refuses_returns_false() -> None:
    worker, engine, _ = _owner()
    engine.rpc_handlers["nemo_rl_update_weights_via_ipc_zmq"] = lambda timeout_s: None
    engine.rpc_handlers["nemo_rl_ipc_socket_dir"] = lambda d: f"ipc://{d}/cpu.sock"
    worker.prepare_refit_info({"w": ((2,), torch.float32)})
    worker.sleep()
    assert worker.update_weights_via_ipc_zmq() is False
    assert isinstance(worker.last_refit_error, EngineStateError)
    assert "prepare_refit_info" not in str(worker.last_refit_error)  # the lifecycle's refusal
    assert worker._worker is not None
    assert worker._worker.state == lifecycle.ASLEEP_L1


def test_shutdown_is_idempotent() -> None:
    worker, engine, _ = _owner()
    assert worker.shutdown() is True
    assert worker.shutdown() is True
    assert engine.shut_down
    assert not worker.is_alive()
    with pytest.raises(EngineStateError, match="shut down"):
        worker.generate(batch([[1]]))


# --- on a local Ray, as RayWorkerBuilder creates it ---------------------------------------------


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _build(
    bundle_indices: tuple[int, list[int]] | None, config: dict[str, Any], num_gpus: float = 1
) -> tuple[Any, dict[str, Any]]:
    """RayWorkerBuilder.create_worker's steps: import by class path, configure, .options().remote()."""
    module_name, class_name = CLASS_PATH.rsplit(".", 1)
    worker_class = getattr(importlib.import_module(module_name), class_name)
    assert hasattr(worker_class, "configure_worker")
    resources, env_vars, init_kwargs, runtime_env = worker_class.configure_worker(
        num_gpus=num_gpus, bundle_indices=bundle_indices, num_gpus_per_node=None
    )
    options: dict[str, Any] = {"runtime_env": {"env_vars": env_vars, **runtime_env}}
    options["num_gpus"] = 0  # no GPU on this host; resources["num_gpus"] is what NeMo-RL asks
    actor = worker_class.options(**options).remote(
        config, **init_kwargs, engine_factory=FakeEngineFactory(max_model_len=32)
    )
    return actor, {"resources": resources, "env_vars": env_vars, "init_kwargs": init_kwargs}


@pytest.mark.ray
def test_nemo_rls_ray_layer_can_build_and_drive_the_worker(ray_session: None) -> None:
    import ray

    config = _config(tp=2)
    owner, placed = _build((0, [0, 1]), config)
    inert, _ = _build(None, config)
    assert placed["resources"] == {"num_gpus": 0}
    assert placed["init_kwargs"] == {"bundle_indices": [0, 1], "seed": 0, "fraction_of_gpus": 1}
    assert ray.get(owner.post_init.remote(), timeout=120) is None
    out = ray.get(owner.generate.remote(batch([[3, 4], [5]]), greedy=True), timeout=60)
    assert out["output_ids"].shape[0] == 2
    counters = ray.get(owner._get_raw_spec_counters.remote(), timeout=60)
    assert counters["vllm:prompt_tokens"] == 3.0
    info = {"w": ((2,), torch.float32)}
    assert ray.get(owner.prepare_refit_info.remote(info), timeout=60) is None
    assert ray.get(owner.update_weights_via_ipc_zmq.remote(), timeout=60) is False
    error = ray.get(owner.get_last_refit_error.remote(), timeout=60)
    assert isinstance(error, RefitError)
    env = ray.get(owner.__ray_call__.remote(lambda self: dict(os.environ)), timeout=60)
    assert env["VLLM_RAY_BUNDLE_INDICES"] == "0,1"
    assert env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert ray.get(inert.is_alive.remote(), timeout=60) is True
    assert ray.get(inert.llm.remote(), timeout=60) is None
    assert ray.get([owner.shutdown.remote(), inert.shutdown.remote()], timeout=60) == [True, True]
    for actor in (owner, inert):
        ray.kill(actor)


@pytest.mark.ray
def test_a_gpu_less_nemo_rl_cluster_builds_and_drives_the_worker(ray_session: None) -> None:
    """What ``RayVirtualCluster(use_gpus=False)`` does: configure with ``num_gpus=0`` and
    start the actor with the resources the hook answered."""
    import ray

    owner, placed = _build((0, [0]), _config(), num_gpus=0)
    assert placed["resources"] == {"num_gpus": 0}
    assert placed["init_kwargs"] == {"bundle_indices": [0], "seed": 0}
    out = ray.get(owner.generate.remote(batch([[3, 4]]), greedy=True), timeout=120)
    assert out["output_ids"].shape[0] == 1
    assert ray.get(owner.shutdown.remote(), timeout=60) is True
    ray.kill(owner)


def test_the_class_path_names_a_ray_actor_class() -> None:
    import ray

    assert isinstance(VllmGenerationWorker, ray.actor.ActorClass)
    assert callable(VllmGenerationWorker.options)


def test_the_module_imports_without_ray_and_makes_the_actor_class_on_first_use() -> None:
    code = (
        "import sys\n"
        "import genworker.shell.nemo_rl as m\n"
        "assert 'ray' not in sys.modules, 'imported ray'\n"
        "actor = m.VllmGenerationWorker\n"
        "assert 'ray' in sys.modules and actor is m.VllmGenerationWorker\n"
        "assert actor.configure_worker is m.NemoRlGenerationWorker.configure_worker\n"
        "try:\n"
        "    m.NoSuchName\n"
        "except AttributeError as e:\n"
        "    assert 'NoSuchName' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
