"""Laws and documented cases of genworker.core.placement."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Result, Success
from strategies import Topology, placement_bundle_indices, placement_num_gpus, topologies

from genworker.core.placement import (
    MAX_PORT,
    ClusterPlan,
    ClusterSpec,
    PlacementError,
    PlacementPlan,
    PortWindow,
    ShardActor,
    bundle_group_size,
    check_bundle_nodes,
    check_inherited_env,
    configure_worker,
    env_names,
    forwarded_env_names,
    local_cluster_spec,
    parse_port_range,
    placement_not_ready,
    plan_cluster,
    plan_engine_env,
    plan_shard_actor,
    plan_shard_actors,
)

CACHE = "/cache/genworker/vllm"


def _plan(result: Result[PlacementPlan, PlacementError]) -> PlacementPlan:
    plan = result.value_or(None)
    assert plan is not None, result
    return plan


def _error(result: Result[object, PlacementError]) -> PlacementError:
    error = result.swap().value_or(None)
    assert error is not None, result
    return error


def _cluster(topology: Topology) -> ClusterPlan:
    cluster = plan_cluster(*topology).value_or(None)
    assert cluster is not None, topology
    return cluster


def _owners(topology: Topology) -> list[tuple[int, PlacementPlan]]:
    """(node the engine starts on, its owner's plan) for every engine of the topology."""
    cluster = _cluster(topology)
    return [
        (
            shard.host_node,
            _plan(
                configure_worker(
                    1.0,
                    shard.bundle_indices,
                    topology.gpus_per_node,
                    cache_root=CACHE,
                    tensor_parallel_size=topology.tensor_parallel_size,
                    pipeline_parallel_size=topology.pipeline_parallel_size,
                )
            ),
        )
        for shard in cluster.shards
    ]


# --- configure_worker: the NeMo-RL cases ---


def test_single_gpu_engine_keeps_its_gpu_and_gets_seed_port_and_cache() -> None:
    plan = _plan(configure_worker(1, (1, [3]), 8, cache_root="/c/vllm"))
    assert plan.resources == {"num_gpus": 1.0}
    assert plan.seed == 1 * 1024 + 3
    assert plan.slot == 3
    assert plan.port_window == (7000 + 3 * 100, 7000 + 4 * 100 - 1)
    assert plan.init_kwargs == {"bundle_indices": [3], "seed": 1027}
    assert plan.env_vars == {
        "VLLM_CACHE_ROOT": "/c/vllm_1027",
        "VLLM_PORT": "7300",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_SKIP_P2P_CHECK": "1",
    }
    assert plan.runtime_env == {"env_vars": plan.env_vars}


def test_tensor_parallel_owner_asks_ray_for_no_gpu_and_passes_its_fraction() -> None:
    plan = _plan(
        configure_worker(0.5, (0, [4, 5, 6, 7]), 8, cache_root="/c/vllm/", tensor_parallel_size=4)
    )
    assert plan.resources == {"num_gpus": 0.0}
    assert plan.seed == 1
    assert plan.init_kwargs == {"bundle_indices": [4, 5, 6, 7], "seed": 1, "fraction_of_gpus": 0.5}
    env = plan.env_vars
    assert env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert env["VLLM_CACHE_ROOT"] == "/c/vllm_1"
    assert env["VLLM_PORT"] == str(7000 + 100)


def test_inert_group_member_gets_only_the_fraction_and_fixed_env() -> None:
    plan = _plan(configure_worker(1.0, None, 8, cache_root=CACHE, tensor_parallel_size=2))
    assert plan.resources == {"num_gpus": 0.0}
    assert plan.init_kwargs == {"fraction_of_gpus": 1.0}
    assert plan.env_vars == {
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_SKIP_P2P_CHECK": "1",
    }
    assert (plan.seed, plan.slot, plan.port_window) == (None, None, None)


@pytest.mark.parametrize("zero", [0, 0.0])
def test_a_gpu_less_cluster_gets_nemo_rls_answer_for_zero_gpus(zero: float) -> None:
    """``RayVirtualCluster(use_gpus=False)`` passes ``num_gpus=0``; NeMo-RL's own hook
    answers ``{"num_gpus": 0}`` with the usual seed, port and cache (and hands a tied
    group's members their fraction, 0)."""
    plan = _plan(configure_worker(zero, (0, [1]), 8, cache_root=CACHE))
    assert plan.resources == {"num_gpus": 0.0}
    assert plan.init_kwargs == {"bundle_indices": [1], "seed": 1}
    assert plan.env_vars == {
        "VLLM_CACHE_ROOT": f"{CACHE}_1",
        "VLLM_PORT": "7100",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_SKIP_P2P_CHECK": "1",
    }
    inert = _plan(configure_worker(zero, None, 8, cache_root=CACHE, tensor_parallel_size=2))
    assert inert.resources == {"num_gpus": 0.0}
    assert inert.init_kwargs == {"fraction_of_gpus": 0.0}


def test_a_tp_engine_without_gpus_is_refused_naming_the_sizes() -> None:
    error = _error(plan_engine_env([0, 1], 0.0, tensor_parallel_size=2, pipeline_parallel_size=1))
    assert error.name == "fraction_of_gpus"
    assert "GPU-less" in str(error)
    assert "tensor_parallel_size" in str(error)


def test_cross_node_engine_uses_global_ids_and_port_slot_zero() -> None:
    plan = _plan(
        configure_worker(1.0, (0, range(8, 16)), 4, cache_root=CACHE, tensor_parallel_size=8)
    )
    assert plan.seed == 1
    assert plan.slot == 0
    assert plan.env_vars["VLLM_PORT"] == "7000"


def test_cache_root_is_nemo_rls_inherited_root_with_the_seed_and_is_not_expanded() -> None:
    plan = _plan(configure_worker(1.0, (0, [2]), 4, cache_root="~/.cache/vllm"))
    assert plan.env_vars["VLLM_CACHE_ROOT"] == "~/.cache/vllm_2"
    plan = _plan(configure_worker(1.0, (1, [0]), 4, cache_root="/scratch/vllm"))
    assert plan.env_vars["VLLM_CACHE_ROOT"] == "/scratch/vllm_1024"


@pytest.mark.parametrize(
    ("ids", "tp", "slot", "seed"),
    [([3], 1, 3, 3), ([2, 3], 2, 1, 1), ([4, 5, 6, 7], 4, 1, 1), ([12], 1, 12, 12)],
)
def test_unknown_gpus_per_node_takes_nemo_rls_slot(
    ids: list[int], tp: int, slot: int, seed: int
) -> None:
    """NeMo-RL passes num_gpus_per_node=None when it does not know the topology: the slot is
    the first id over the group size, as its configure_worker computes it."""
    plan = _plan(configure_worker(1.0, (0, ids), None, cache_root=CACHE, tensor_parallel_size=tp))
    assert (plan.slot, plan.seed) == (slot, seed)
    assert plan.env_vars["VLLM_PORT"] == str(7000 + slot * 100)
    inert = _plan(configure_worker(1.0, None, None, cache_root=CACHE, tensor_parallel_size=tp))
    assert inert.ports is None


def test_unknown_gpus_per_node_still_checks_this_engines_window() -> None:
    error = _error(
        configure_worker(1.0, (0, [20]), None, cache_root=CACHE, ephemeral_ports=(9000, 65535))
    )
    assert "9000-65535" in error.message
    assert "engine slot 20" in error.message


def test_port_window_membership() -> None:
    window = PortWindow(100, 163)
    assert window.size == 64
    assert 100 in window
    assert 163 in window
    assert 164 not in window
    assert "100" not in window
    assert window.overlaps(PortWindow(163, 170))
    assert not window.overlaps(PortWindow(164, 170))
    with pytest.raises(ValueError, match="empty"):
        PortWindow(10, 9)
    with pytest.raises(ValueError, match="outside"):
        PortWindow(0, 9)


# --- configure_worker: refusals (failure-modes §2.4, P2, P3) ---


@pytest.mark.parametrize(
    ("kwargs", "name", "why"),
    [
        ({"num_gpus": -1.0}, "num_gpus", ">= 0"),
        ({"num_gpus": -0.5}, "num_gpus", ">= 0"),
        ({"num_gpus": math.nan}, "num_gpus", "finite"),
        ({"num_gpus": math.inf}, "num_gpus", "finite"),
        ({"num_gpus": "1"}, "num_gpus", "finite"),
        ({"num_gpus": True}, "num_gpus", "finite"),
        ({"num_gpus_per_node": 0}, "num_gpus_per_node", ">= 1"),
        ({"num_gpus_per_node": 2.0}, "num_gpus_per_node", ">= 1"),
        ({"ephemeral_ports": (9000, 8000)}, "ephemeral_ports", "low <= high"),
        ({"ephemeral_ports": (0, 8000)}, "ephemeral_ports", "low <= high"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size", ">= 1"),
        ({"pipeline_parallel_size": -1}, "pipeline_parallel_size", ">= 1"),
        ({"cache_root": ""}, "cache_root", "directory"),
        ({"cache_root": "/"}, "cache_root", "directory"),
        ({"port_window": 0}, "port_window", "at least 1"),
        ({"port_base": 0}, "port_base", ">= 1"),
        ({"bundle_indices": (-1, [0])}, "bundle_indices", "node index is negative"),
        ({"bundle_indices": (0, [])}, "bundle_indices", "empty"),
        ({"bundle_indices": (0, [-1])}, "bundle_indices", "negative"),
        ({"bundle_indices": (0, [1, 1])}, "bundle_indices", "twice"),
        ({"bundle_indices": [0]}, "bundle_indices", "(node_idx, [bundle ids])"),
        ({"bundle_indices": (0, "01")}, "bundle_indices", "(node_idx, [bundle ids])"),
        ({"bundle_indices": ("0", [0])}, "bundle_indices", "(node_idx, [bundle ids])"),
        ({"bundle_indices": (0, [0.0])}, "bundle_indices", "(node_idx, [bundle ids])"),
        ({"bundle_indices": (0, [0, 1])}, "bundle_indices", "tensor_parallel_size=1"),
        ({"bundle_indices": (0, [8])}, "bundle_indices", "local ids below 8"),
    ],
)
def test_refusals_name_the_input(kwargs: dict[str, object], name: str, why: str) -> None:
    call: dict[str, object] = {
        "num_gpus": 1.0,
        "bundle_indices": (0, [0]),
        "num_gpus_per_node": 8,
        "cache_root": CACHE,
        **kwargs,
    }
    error = _error(configure_worker(**call))  # type: ignore[arg-type]
    assert error.name == name
    assert why in str(error)
    assert str(error).startswith(f"{name}=")


@pytest.mark.parametrize(
    ("ids", "tp"),
    [([1, 2], 2), ([0, 2], 2), ([3, 2], 2), ([0, 1, 3], 3), ([3, 4, 5, 6, 7, 8], 6)],
)
def test_group_must_be_consecutive_and_aligned(ids: list[int], tp: int) -> None:
    error = _error(configure_worker(1.0, (0, ids), 4, cache_root=CACHE, tensor_parallel_size=tp))
    assert "consecutive ascending" in error.message


def test_group_split_over_two_nodes_is_refused_when_it_fits_on_one() -> None:
    # open-instruct#949: TP traffic crossed nodes. ids 2,3 of a 2-GPU node do not exist.
    error = _error(configure_worker(1.0, (0, [2, 3]), 2, cache_root=CACHE, tensor_parallel_size=2))
    assert "local ids below 2" in error.message


def test_engine_slot_past_the_seed_stride_is_refused() -> None:
    error = _error(configure_worker(1.0, (0, [1024]), 2048, cache_root=CACHE, port_window=1))
    assert "reuse the seeds of node 1" in error.message


@pytest.mark.parametrize(
    ("port_base", "port_window", "per_node", "ephemeral"),
    [
        (32000, 64, 16, (32768, 60999)),  # last slot's window runs into the ephemeral range
        (32705, 64, 1, (32768, 60999)),  # one window ending exactly on the range's start
        (7000, 100, 8, (7500, 65535)),  # NeMo-RL's layout on a host whose range starts lower
        (65500, 64, 1, (65535, 65535)),  # above 65535
    ],
)
def test_windows_reaching_the_ephemeral_range_or_past_65535_are_refused(
    port_base: int, port_window: int, per_node: int, ephemeral: tuple[int, int]
) -> None:
    # The refusal covers every slot of the node, so slot 0 fails as the last one would.
    error = _error(
        configure_worker(
            1.0,
            (0, [0]),
            per_node,
            cache_root=CACHE,
            port_base=port_base,
            port_window=port_window,
            ephemeral_ports=ephemeral,
        )
    )
    assert error.name == "port_window"
    assert "past" in error.message
    assert f"ephemeral port range {ephemeral[0]}-{ephemeral[1]}" in error.message


def test_nemo_rls_layout_fits_below_a_9000_ephemeral_floor() -> None:
    """Some DGX/GB200 hosts start their ephemeral range at 9000 (NeMo-RL's port layout)."""
    plans = [
        _plan(configure_worker(1.0, (0, [i]), 8, cache_root=CACHE, ephemeral_ports=(9000, 65535)))
        for i in range(8)
    ]
    assert [p.port_window for p in plans][-1] == (7700, 7799)


def test_window_ending_just_below_the_ephemeral_range_is_accepted() -> None:
    plan = _plan(
        configure_worker(1.0, (0, [0]), 1, cache_root=CACHE, port_base=32704, port_window=64)
    )
    assert plan.port_window == (32704, 32767)


@given(num_gpus=placement_num_gpus(), bundle_indices=placement_bundle_indices())
def test_configure_worker_is_total(num_gpus: object, bundle_indices: object) -> None:
    """Any input gives a plan or a PlacementError, never an exception."""
    result = configure_worker(
        num_gpus,  # type: ignore[arg-type]
        bundle_indices,  # type: ignore[arg-type]
        8,
        cache_root=CACHE,
    )
    if isinstance(result, Failure):
        assert result.failure().name in {"num_gpus", "bundle_indices"}
    else:
        plan = result.unwrap()
        assert plan.resources["num_gpus"] >= 0
        assert plan.env_vars["VLLM_SKIP_P2P_CHECK"] == "1"


# --- configure_worker: laws over topologies ---


@given(topologies())
def test_engines_on_one_node_never_share_a_port_window(topology: Topology) -> None:
    owners = _owners(topology)
    for i, (node_a, plan_a) in enumerate(owners):
        for node_b, plan_b in owners[i + 1 :]:
            if node_a == node_b:
                assert plan_a.ports is not None
                assert plan_b.ports is not None
                assert not plan_a.ports.overlaps(plan_b.ports)


@st.composite
def _port_ranges(draw: st.DrawFn) -> tuple[int, int]:
    low = draw(st.sampled_from([9000, 32768, 49152]) | st.integers(1, 65535))
    return low, draw(st.integers(low, 65535))


@given(topologies(), st.integers(1, 30000), st.integers(1, 256), _port_ranges())
def test_ports_are_below_the_hosts_ephemeral_range_or_the_range_is_named(
    topology: Topology, port_base: int, port_window: int, ephemeral: tuple[int, int]
) -> None:
    for shard in _cluster(topology).shards:
        result = configure_worker(
            1.0,
            shard.bundle_indices,
            topology.gpus_per_node,
            cache_root=CACHE,
            tensor_parallel_size=topology.tensor_parallel_size,
            pipeline_parallel_size=topology.pipeline_parallel_size,
            port_base=port_base,
            port_window=port_window,
            ephemeral_ports=ephemeral,
        )
        size = topology.tensor_parallel_size * topology.pipeline_parallel_size
        slots = max(1, topology.gpus_per_node // size)
        fits = port_base + slots * port_window - 1 < ephemeral[0]
        if isinstance(result, Failure):
            error = result.failure()
            assert error.name == "port_window"
            assert f"{ephemeral[0]}-{ephemeral[1]}" in error.message
            assert not fits
            continue
        assert fits
        plan = result.unwrap()
        port = plan.env_vars["VLLM_PORT"]
        assert port.isdecimal()
        assert int(port) == port_base + (plan.slot or 0) * port_window
        assert plan.ports is not None
        assert int(port) in plan.ports
        assert plan.ports.last < ephemeral[0]
        assert plan.ports.last <= MAX_PORT


@given(_port_ranges(), st.sampled_from([" ", "\t", "  \t"]), st.sampled_from(["", "\n"]))
def test_the_hosts_port_range_parses_as_the_kernel_writes_it(
    ephemeral: tuple[int, int], sep: str, end: str
) -> None:
    assert parse_port_range(f"{ephemeral[0]}{sep}{ephemeral[1]}{end}") == Success(ephemeral)


@pytest.mark.parametrize("text", ["", "9000", "9000 8000", "0 100", "1 70000", "a b", "1 2 3"])
def test_a_malformed_port_range_is_refused(text: str) -> None:
    error = _error(parse_port_range(text))
    assert error.name == "ip_local_port_range"


@given(topologies())
def test_seeds_and_cache_roots_are_unique_across_engines(topology: Topology) -> None:
    owners = [plan for _, plan in _owners(topology)]
    seeds = [plan.seed for plan in owners]
    roots = [plan.env_vars["VLLM_CACHE_ROOT"] for plan in owners]
    assert len(set(seeds)) == len(seeds)
    assert len(set(roots)) == len(roots)
    assert all(root.startswith(CACHE + "_") for root in roots)


@given(topologies())
def test_returned_dicts_are_fresh(topology: Topology) -> None:
    shard = _cluster(topology).shards[0]

    def call() -> PlacementPlan:
        return _plan(
            configure_worker(
                1.0,
                shard.bundle_indices,
                topology.gpus_per_node,
                cache_root=CACHE,
                tensor_parallel_size=topology.tensor_parallel_size,
                pipeline_parallel_size=topology.pipeline_parallel_size,
            )
        )

    first, second = call(), call()
    env, kwargs, resources, runtime = (
        first.env_vars,
        first.init_kwargs,
        first.resources,
        first.runtime_env,
    )
    env["VLLM_PORT"] = "1"
    kwargs["seed"] = -1
    bundle_ids = kwargs["bundle_indices"]
    assert isinstance(bundle_ids, list)
    bundle_ids.append(99)
    resources["num_gpus"] = 42.0
    runtime["env_vars"]["VLLM_CACHE_ROOT"] = "/elsewhere"
    for plan in (first, second):
        assert plan.env_vars["VLLM_PORT"] != "1"
        assert plan.init_kwargs["seed"] != -1
        assert plan.init_kwargs["bundle_indices"] == list(shard.bundle_ids)
        assert plan.resources["num_gpus"] != 42.0
        assert plan.runtime_env["env_vars"]["VLLM_CACHE_ROOT"] != "/elsewhere"
    assert first == second


# --- plan_cluster ---


def test_cluster_packs_tensor_parallel_engines_node_by_node() -> None:
    cluster = _cluster(Topology(2, 4, 2, 1, 4))
    assert cluster.strategy == "PACK"
    assert cluster.bundles == [{"GPU": 1, "CPU": 1}] * 8
    assert [shard.bundle_indices for shard in cluster.shards] == [
        (0, (0, 1)),
        (0, (2, 3)),
        (1, (0, 1)),
        (1, (2, 3)),
    ]
    assert [shard.ray_bundle_indices for shard in cluster.shards] == ["0,1", "2,3", "4,5", "6,7"]
    assert cluster.engine_env_vars(3) == {
        "VLLM_RAY_BUNDLE_INDICES": "6,7",
        "VLLM_RAY_PER_WORKER_GPUS": "0.5",
    }
    assert cluster.model_parallel_size == 2
    assert cluster.data_parallel_size == 4
    assert not cluster.spans_nodes


def test_cluster_with_engines_larger_than_a_node_uses_one_unified_group() -> None:
    # NeMo-RL's unified placement group: (0, range(8)), (0, range(8, 16)) on 4-GPU nodes.
    cluster = _cluster(Topology(4, 4, 4, 2, 2))
    assert cluster.spans_nodes
    assert [shard.bundle_indices for shard in cluster.shards] == [
        (0, tuple(range(8))),
        (0, tuple(range(8, 16))),
    ]
    assert [shard.host_node for shard in cluster.shards] == [0, 2]
    assert cluster.num_bundles == 16


def test_single_gpu_engines_need_no_ray_executor_env() -> None:
    cluster = _cluster(Topology(1, 2, 1, 1, 2))
    assert cluster.engine_env_vars(0) == {}
    assert [shard.bundle_indices for shard in cluster.shards] == [(0, (0,)), (0, (1,))]


def test_cpu_only_cluster_gets_cpu_bundles_and_no_gpus() -> None:
    result = plan_cluster(1, 0, 1, 1, 2, cpus_per_node=4)
    cluster = result.unwrap()
    assert cluster.bundles == [{"CPU": 1}, {"CPU": 1}]
    assert not cluster.uses_gpus
    assert cluster.worker_num_gpus == 0.0
    assert cluster.ray_per_worker_gpus == 0.0


def test_cluster_bundle_list_is_fresh() -> None:
    cluster = _cluster(Topology(1, 2, 1, 1, 2))
    cluster.bundles[0]["GPU"] = 0
    assert cluster.bundles[0] == {"GPU": 1, "CPU": 1}


def test_gpu_fraction_is_shared_among_vllm_ray_workers() -> None:
    cluster = plan_cluster(1, 4, 2, 2, 1, gpu_fraction=0.5).unwrap()
    assert cluster.worker_num_gpus == 0.5
    assert cluster.ray_per_worker_gpus == 0.125


@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [
        ((0, 8, 1, 1, 1), {}, "num_nodes"),
        ((1, 8, 0, 1, 1), {}, "tensor_parallel_size"),
        ((1, 8, 1, 0, 1), {}, "pipeline_parallel_size"),
        ((1, 8, 1, 1, 0), {}, "data_parallel_size"),
        ((1, -1, 1, 1, 1), {}, "gpus_per_node"),
        ((1, 0, 1, 1, 1), {}, "cpus_per_node"),
        ((1, 8, 1, 1, 1), {"gpu_fraction": 0.0}, "gpu_fraction"),
        ((1, 8, 1, 1, 1), {"gpu_fraction": 1.5}, "gpu_fraction"),
        ((1, 8, 1, 1, 1), {"gpu_fraction": math.nan}, "gpu_fraction"),
        ((2, 8, 3, 1, 5), {}, "data_parallel_size"),  # 2 engines of 3 per 8-GPU node
        ((3, 4, 6, 1, 3), {}, "data_parallel_size"),  # 12 GPUs hold two engines of 6
    ],
)
def test_cluster_refusals_name_the_input(
    args: Sequence[int], kwargs: dict[str, float], name: str
) -> None:
    error = _error(plan_cluster(*args, **kwargs))  # type: ignore[arg-type]
    assert error.name == name
    assert str(error).startswith(f"{name}=")


@given(topologies())
def test_every_engine_gets_its_own_bundles_inside_the_group(topology: Topology) -> None:
    cluster = _cluster(topology)
    used = [i for shard in cluster.shards for i in shard.global_bundle_ids]
    assert len(used) == len(set(used)) == topology.data_parallel_size * cluster.model_parallel_size
    assert max(used) < len(cluster.bundles) <= topology.num_nodes * topology.gpus_per_node
    for shard in cluster.shards:
        nodes = {i // topology.gpus_per_node for i in shard.global_bundle_ids}
        if not cluster.spans_nodes:
            assert nodes == {shard.node}  # a group that fits on a node stays on it
        assert shard.ray_bundle_indices == ",".join(map(str, shard.global_bundle_ids))


# --- inherited environment ---


@pytest.mark.parametrize(
    "env",
    [{}, {"VLLM_PORT": "20000"}, {"VLLM_HOST_IP": "10.0.0.1"}, {"VLLM_HOST_IP": "::1"}],
)
def test_well_formed_inherited_env_passes(env: dict[str, str]) -> None:
    assert check_inherited_env(env) == Success(None)


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"VLLM_PORT": "tcp://10.0.0.1:8000"}, "VLLM_PORT"),  # Kubernetes service injection
        ({"VLLM_PORT": "0"}, "VLLM_PORT"),
        ({"VLLM_PORT": "70000"}, "VLLM_PORT"),
        ({"VLLM_PORT": "٣٠٠٠"}, "VLLM_PORT"),
        ({"VLLM_HOST_IP": "node-1"}, "VLLM_HOST_IP"),
    ],
)
def test_malformed_inherited_env_is_refused_by_name(env: dict[str, str], name: str) -> None:
    error = _error(check_inherited_env(env))
    assert error.name == name
    assert name in str(error)


def test_placement_error_is_a_frozen_value() -> None:
    error = _error(configure_worker(-1, None, 8, cache_root=CACHE))
    assert error.value == "-1"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        error.name = "x"  # type: ignore[misc]


# --- the engine environment of a NeMo-RL model owner ---


@pytest.mark.parametrize(
    ("ids", "tp", "pp", "fraction", "per_worker"),
    [([0, 1], 2, 1, 1.0, "0.5"), ([4, 5, 6, 7], 4, 1, 1.0, "0.25"), ([2, 3], 1, 2, 0.5, "0.25")],
)
def test_a_tp_or_pp_owner_places_vllms_ray_workers_on_its_bundles(
    ids: list[int], tp: int, pp: int, fraction: float, per_worker: str
) -> None:
    env = plan_engine_env(
        ids, fraction, tensor_parallel_size=tp, pipeline_parallel_size=pp
    ).unwrap()
    assert dict(env.set) == {
        "VLLM_RAY_PER_WORKER_GPUS": per_worker,
        "VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, ids)),
    }
    assert env.unset == ("CUDA_VISIBLE_DEVICES",)


def test_a_one_gpu_engine_changes_no_environment() -> None:
    env = plan_engine_env([3], 1.0, tensor_parallel_size=1, pipeline_parallel_size=1).unwrap()
    assert (dict(env.set), env.unset) == ({}, ())


@pytest.mark.parametrize(
    ("ids", "fraction", "name"),
    [
        (None, 1.0, "bundle_indices"),
        ([0], 1.0, "bundle_indices"),
        ([0, 1], 0.0, "fraction"),
        ([0, 1], 1.5, "fraction"),
        ([0, 1], -0.5, "fraction"),
    ],
)
def test_engine_env_refusals_name_the_input(
    ids: list[int] | None, fraction: float, name: str
) -> None:
    error = _error(plan_engine_env(ids, fraction, tensor_parallel_size=2, pipeline_parallel_size=1))
    assert error.name.startswith(name)


@given(
    st.lists(st.sampled_from(["A", "B_1", "HF_X", " C "]), max_size=4),
    st.lists(st.sampled_from(["A", "NEW", "B_1"]), max_size=3),
)
def test_forwarded_names_keep_every_name_once_in_order(
    existing: list[str], names: list[str]
) -> None:
    merged = forwarded_env_names(",".join(existing), names)
    parts = merged.split(",") if merged else []
    assert parts == sorted(set(parts))
    assert set(parts) == {n.strip() for n in [*existing, *names]}


@given(topologies())
def test_a_bundle_table_that_follows_the_plan_is_accepted(topology: Topology) -> None:
    cluster = _cluster(topology)
    table = {b: f"ray-{b // cluster.bundles_per_node}" for b in range(cluster.num_bundles)}
    assert isinstance(check_bundle_nodes(cluster, table), Success)


@given(topologies(), st.data())
def test_a_bundle_table_that_breaks_the_plan_is_refused_naming_how(
    topology: Topology, data: st.DataObject
) -> None:
    cluster = _cluster(topology)
    per_node = cluster.bundles_per_node
    table = {b: f"ray-{b // per_node}" for b in range(cluster.num_bundles)}
    bundle = data.draw(st.integers(0, cluster.num_bundles - 1))
    missing = _error(check_bundle_nodes(cluster, {k: v for k, v in table.items() if k != bundle}))
    assert missing.message == f"Ray reports no node for bundle {bundle}"
    assert missing.name == "bundles_to_node_id"
    planned_nodes = sorted({b // per_node for b in table})
    if len(planned_nodes) > 1:
        shared = _error(check_bundle_nodes(cluster, dict.fromkeys(table, "ray-0")))
        assert shared.message == f"planned nodes {[planned_nodes]} share one Ray node"
    if per_node > 1 and cluster.num_bundles > 1:
        split = _error(check_bundle_nodes(cluster, {**table, 1: "elsewhere"}))
        assert split.message == (
            "bundles planned on one node landed on several Ray nodes: {0: ['elsewhere', 'ray-0']}"
        )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ClusterSpec(1, call_timeout_s=0.0), "call_timeout_s=0.0 must be a number of"),
        (lambda: ClusterSpec(1, placement_timeout_s=-1.0), "placement_timeout_s=-1.0 must be"),
        (lambda: ClusterSpec(1, actor_num_cpus=0.0), "actor_num_cpus=0.0 must be in (0, 1]"),
        (lambda: ClusterSpec(1, actor_num_cpus=1.5), "actor_num_cpus=1.5 must be in (0, 1]"),
    ],
)
def test_a_cluster_spec_refuses_a_bound_or_cpu_share_naming_the_field(
    make: Callable[[], ClusterSpec], message: str
) -> None:
    spec = ClusterSpec(num_shards=1, actor_num_cpus=1.0, call_timeout_s=0.5)
    assert spec.call_timeout_s == 0.5
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


@given(topologies())
def test_a_shard_actor_is_its_worker_plan_with_the_engine_env(topology: Topology) -> None:
    cluster = _cluster(topology)
    spec = ClusterSpec(num_shards=topology.data_parallel_size, actor_num_cpus=0.5)
    for shard in cluster.shards:
        actor = plan_shard_actor(spec, cluster, shard, cache_root=CACHE).unwrap()
        worker = _plan(
            configure_worker(
                cluster.worker_num_gpus,
                shard.bundle_indices,
                cluster.bundles_per_node,
                cache_root=CACHE,
                tensor_parallel_size=cluster.tensor_parallel_size,
                pipeline_parallel_size=cluster.pipeline_parallel_size,
            )
        )
        assert actor == ShardActor(
            worker,
            tuple(cluster.engine_env_vars(shard.rank).items()),
            True,
            0.5,
            shard.global_bundle_ids[0],
        )
        assert actor.options == {
            "num_cpus": 0.5,
            "num_gpus": worker.num_gpus,
            "runtime_env": {"env_vars": worker.env_vars | cluster.engine_env_vars(shard.rank)},
            "max_restarts": 0,
        }
        assert actor.init_kwargs == worker.init_kwargs


def test_a_cpu_shard_actor_asks_for_no_gpu_and_keeps_seed_ports_and_cache() -> None:
    cluster = plan_cluster(1, 0, 1, 1, 2, cpus_per_node=2).unwrap()
    spec = ClusterSpec(num_shards=2, cpus_per_node=2, port_base=9000, port_window=10)
    actor = plan_shard_actor(spec, cluster, cluster.shards[1], cache_root=CACHE).unwrap()
    assert actor.options["num_gpus"] == 0
    assert actor.init_kwargs == {"bundle_indices": [1], "seed": 1}
    env = actor.options["runtime_env"]
    assert env == {"env_vars": actor.worker.env_vars}
    assert actor.worker.env_vars["VLLM_PORT"] == "9010"
    refused = plan_shard_actor(
        spec, cluster, cluster.shards[1], cache_root=CACHE, ephemeral_ports=(9005, 60999)
    )
    assert isinstance(refused, Failure)


@given(st.lists(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True), max_size=4))
def test_env_names_keeps_a_list_of_variable_names(names: list[str]) -> None:
    assert env_names(names) == Success(tuple(names))
    assert env_names(None) == Success(())


@pytest.mark.parametrize(
    ("names", "named"),
    [
        ("HF_TOKEN", "'HF_TOKEN'"),
        ({"A": "1"}, "{'A': '1'}"),
        (5, "5"),
        (["OK", "1BAD", "A-B", 3], "['1BAD', 'A-B', 3]"),
    ],
)
def test_env_names_refuses_what_is_not_a_list_of_names_naming_it(names: object, named: str) -> None:
    """NeMo-RL passes a list of names; a mapping or a str (whose characters would be
    taken as names) is refused, as are entries that are not variable names."""
    result = env_names(names)
    assert isinstance(result, Failure)
    assert result.failure().name == "extra_env_vars"
    assert result.failure().message.endswith(named)


@pytest.mark.parametrize(
    ("bundle_indices", "size"),
    [(None, 1), ((0, [0, 1, 2, 3]), 4), ([1, (4, 5)], 2), ((0, []), 1), ((0, 3), 1), ((0,), 1)],
)
def test_the_tied_group_is_the_bundle_count(bundle_indices: object, size: int) -> None:
    """NeMo-RL's hook infers the engine's GPUs from the bundles its first worker owns."""
    assert bundle_group_size(bundle_indices) == size


@given(topologies())
def test_a_spec_plans_its_cluster_and_every_shards_actor(topology: Topology) -> None:
    nodes, gpus, tp, pp, shards = topology
    spec = ClusterSpec(num_shards=shards, num_nodes=nodes, gpus_per_node=gpus)
    cluster = spec.plan(tp, pp).unwrap()
    assert cluster == _cluster(topology)
    actors = plan_shard_actors(spec, cluster, default_cache_root=CACHE).unwrap()
    assert actors == tuple(
        plan_shard_actor(spec, cluster, shard, cache_root=CACHE).unwrap()
        for shard in cluster.shards
    )
    assert [a.bundle_index for a in actors] == [s.global_bundle_ids[0] for s in cluster.shards]


def test_shard_actors_live_under_the_specs_cache_base_and_a_failure_names_its_shard() -> None:
    cluster = plan_cluster(1, 0, 1, 1, 2, cpus_per_node=2).unwrap()
    spec = ClusterSpec(num_shards=2, cpus_per_node=2, cache_base_dir="/base/", port_base=9000)
    actors = plan_shard_actors(spec, cluster, default_cache_root=CACHE).unwrap()
    expected = plan_shard_actor(spec, cluster, cluster.shards[0], cache_root="/base/vllm")
    assert actors[0] == expected.unwrap()
    windows = attrs.evolve(spec, port_window=10)
    refused = plan_shard_actors(
        windows, cluster, default_cache_root=CACHE, ephemeral_ports=(9015, 60999)
    )
    error = _error(refused)
    assert error.message.startswith("placement of shard 0: port_window=10: ")


def test_a_placement_group_not_ready_names_its_bundles_and_the_clusters_resources() -> None:
    cluster = plan_cluster(1, 0, 1, 1, 3, cpus_per_node=3).unwrap()
    assert placement_not_ready(cluster, 1.0, {"CPU": 1.0}, {"CPU": 2.0}) == (
        "the placement group of 3 bundle(s) {'CPU': 1} (PACK) was not ready after 1 s; the "
        "cluster has {'CPU': 1.0} available of {'CPU': 2.0}"
    )


def test_ray_starts_on_the_named_cluster_or_locally_with_the_specs_cpus() -> None:
    assert ClusterSpec(1, ray_address="ray://h:1").ray_init_kwargs == {"address": "ray://h:1"}
    assert ClusterSpec(1, ray_num_cpus=3).ray_init_kwargs == {"num_cpus": 3}


def test_a_local_cluster_takes_the_machines_gpus_or_enough_cpus_for_its_shards() -> None:
    gpus = local_cluster_spec(2, 1, gpus=8, cpu_count=64, options={"call_timeout_s": 5.0})
    assert gpus == ClusterSpec(num_shards=2, gpus_per_node=8, call_timeout_s=5.0)
    cpus = local_cluster_spec(3, 2, gpus=0, cpu_count=4, options={})
    assert cpus == ClusterSpec(num_shards=3, cpus_per_node=6, ray_num_cpus=6)
    unknown = local_cluster_spec(1, 1, gpus=0, cpu_count=None, options={"ray_num_cpus": 9})
    assert unknown == ClusterSpec(num_shards=1, cpus_per_node=1, ray_num_cpus=9)
    with pytest.raises(TypeError, match=r"'gpus_per_node' \(this machine has 8 GPUs\)"):
        local_cluster_spec(1, 1, gpus=8, cpu_count=64, options={"gpus_per_node": 2})
