"""Where a generation engine runs: Ray resources, environment, seed, ports and cache root.

Theory of operation
-------------------
Mirrors NeMo-RL's static ``BaseVllmGenerationWorker.configure_worker``
(``nemo_rl/models/generation/vllm/vllm_worker.py``) and vLLM's use of ``VLLM_PORT``
(vLLM 0.25 / 0.32, ``vllm/utils/network_utils.py``: ``_get_open_port`` binds ``VLLM_PORT``
and counts upward past ports in use; ``get_open_ports_list`` takes several in a row).

* A *bundle* is one GPU of the placement group (one CPU on a CPU-only cluster). An engine
  owns a *group* of ``tensor_parallel_size * pipeline_parallel_size`` bundles, passed to its
  first worker as ``(node_idx, ids)``. A group that fits on one node names that node's local
  ids; they must be consecutive and start at a multiple of the group size (``[0, 1]``,
  ``[2, 3]``, ...), so the engine's *slot* ``ids[0] // size`` differs between the engines of
  a node. A group larger than a node (cross-node model parallelism, NeMo-RL's unified
  placement group) names global ids, ``(0, [8, ..., 15])``, under the same alignment rule;
  its port slot is 0, because no two such engines start on the same node.
* Seed ``node_idx * 1024 + ids[0] // size`` (NeMo-RL's formula; ``node_idx * 1024 + id`` for
  one-GPU engines). ``VLLM_CACHE_ROOT`` is ``<cache_root>_<seed>`` (NeMo-RL's formula), where
  ``cache_root`` is the inherited ``VLLM_CACHE_ROOT`` or ``~/.cache/vllm``: engines never
  share a compile cache (vllm#18851). Core reads no environment and does not expand ``~``;
  the shell passes a real path.
* Ports: slot ``s`` owns ``[port_base + s * port_window, port_base + (s + 1) * port_window)``
  and ``VLLM_PORT`` is its first port, so vLLM's upward scan stays inside the window unless
  ``port_window`` ports are taken (nemo-rl#2380, vllm#43206). The defaults are NeMo-RL's
  layout (``DEFAULT_VLLM_PORT_RANGE_LOW = 7000``, 100 ports per engine,
  ``nemo_rl/distributed/virtual_cluster.py``), below the 9000 ephemeral floor of some
  DGX/GB200 hosts. Every window the node can need (one per slot) must end below the host's
  ephemeral range (``ephemeral_ports``: ``net.ipv4.ip_local_port_range``, which the shell
  reads and :func:`parse_port_range` parses), where the OS picks ports for outgoing
  connections, and at most at 65535; checking all slots makes every engine of a node fail
  alike, before any actor starts. With ``num_gpus_per_node=None`` (NeMo-RL's default when
  the topology is unknown) the slot is the group's first id over its size, as NeMo-RL
  computes it, and only this engine's own window can be checked.
* ``num_gpus=0`` comes from a GPU-less NeMo-RL cluster (``RayVirtualCluster(use_gpus=False)``):
  the plan is NeMo-RL's answer, ``{"num_gpus": 0}`` with the usual seed, port and cache. A
  TP/PP engine cannot start there (its Ray executor wants GPUs): :func:`plan_engine_env`
  refuses it naming the sizes.
* Workers of a TP/PP group (and the inert members of a tied group, ``bundle_indices=None``)
  ask Ray for 0 GPUs, stop Ray from setting ``CUDA_VISIBLE_DEVICES``
  (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``) and hand their GPU fraction to the
  engine, which places its own Ray workers on the bundles named by
  ``VLLM_RAY_BUNDLE_INDICES`` with ``VLLM_RAY_PER_WORKER_GPUS`` each (see :func:`plan_cluster`).
"""

from __future__ import annotations

import ipaddress
import math
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import TypedDict

import attrs
from returns.result import Failure, Result, Success

from genworker.core.config import FrozenMap
from genworker.core.errors import CoreError

__all__ = [
    "DEFAULT_EPHEMERAL_PORTS",
    "DEFAULT_PORT_BASE",
    "DEFAULT_PORT_WINDOW",
    "MAX_PORT",
    "RAY_EXTRA_ENV_VARS",
    "SEED_STRIDE",
    "ClusterOptions",
    "ClusterPlan",
    "ClusterSpec",
    "EngineEnv",
    "PlacementError",
    "PlacementPlan",
    "PortWindow",
    "RayInit",
    "ShardActor",
    "ShardPlacement",
    "bundle_group_size",
    "check_bundle_nodes",
    "check_inherited_env",
    "configure_worker",
    "env_names",
    "forwarded_env_names",
    "local_cluster_spec",
    "parse_port_range",
    "placement_not_ready",
    "plan_cluster",
    "plan_engine_env",
    "plan_shard_actor",
    "plan_shard_actors",
]

MAX_PORT = 65535
# NeMo-RL's seed layout: node_idx * 1024 + engine slot. A slot of 1024 or more would collide
# with the next node's seeds, so it is refused.
SEED_STRIDE = 1024
DEFAULT_PORT_BASE = 7000
DEFAULT_PORT_WINDOW = 100
DEFAULT_EPHEMERAL_PORTS = (32768, 60999)
"""Linux's default ``net.ipv4.ip_local_port_range``, for hosts where it cannot be read."""
RAY_EXTRA_ENV_VARS = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"
"""vLLM's list of extra variables its Ray executor copies into its workers (vLLM >= 0.25,
``vllm/ray/ray_env.py``), comma-separated."""


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@attrs.frozen
class PlacementError(CoreError):
    """A placement input that cannot work; ``name`` is the input, ``value`` its repr."""

    name: str
    value: str


def _error(name: str, value: object, why: str) -> Failure[PlacementError]:
    return Failure(PlacementError(f"{name}={value!r}: {why}", name=name, value=repr(value)))


def _check_port_range(instance: object, attribute: object, value: int) -> None:
    if not 1 <= value <= MAX_PORT:
        raise ValueError(f"port {value} is outside 1..{MAX_PORT}")


@attrs.frozen
class PortWindow:
    """The ports ``first..last`` (both included) one engine may bind on its node."""

    first: int = attrs.field(validator=_check_port_range)
    last: int = attrs.field(validator=_check_port_range)

    def __attrs_post_init__(self) -> None:
        if self.last < self.first:
            raise ValueError(f"port window {self.first}..{self.last} is empty")

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    def overlaps(self, other: PortWindow) -> bool:
        return self.first <= other.last and other.first <= self.last


@attrs.frozen
class PlacementPlan:
    """How to start one worker actor; the dict views are built afresh on every access.

    ``bundle_ids``, ``seed``, ``slot``, ``ports`` and ``cache_root`` are ``None`` for the
    inert members of a tied TP/PP group (those created with ``bundle_indices=None``).
    """

    num_gpus: float
    tied: bool
    fraction_of_gpus: float | None
    bundle_ids: tuple[int, ...] | None
    seed: int | None
    slot: int | None
    ports: PortWindow | None
    cache_root: str | None

    @property
    def port_window(self) -> tuple[int, int] | None:
        """``(first, last)`` port of this engine's window, both included."""
        return None if self.ports is None else (self.ports.first, self.ports.last)

    @property
    def resources(self) -> dict[str, float]:
        """Ray actor options: ``{"num_gpus": ...}``."""
        return {"num_gpus": self.num_gpus}

    @property
    def env_vars(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if self.cache_root is not None:
            env["VLLM_CACHE_ROOT"] = self.cache_root
        if self.ports is not None:
            env["VLLM_PORT"] = str(self.ports.first)
        if self.tied:
            env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["VLLM_SKIP_P2P_CHECK"] = "1"
        return env

    @property
    def init_kwargs(self) -> dict[str, object]:
        """Keyword arguments for the worker's ``__init__`` (NeMo-RL's names)."""
        kwargs: dict[str, object] = {}
        if self.bundle_ids is not None:
            kwargs["bundle_indices"] = list(self.bundle_ids)
            kwargs["seed"] = self.seed
        if self.fraction_of_gpus is not None:
            kwargs["fraction_of_gpus"] = self.fraction_of_gpus
        return kwargs

    @property
    def runtime_env(self) -> dict[str, dict[str, str]]:
        """Ray ``runtime_env``: ``{"env_vars": env_vars}`` (its own copy)."""
        return {"env_vars": self.env_vars}


def _number(value: object) -> float | None:
    """``value`` as a finite float, or ``None`` when it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    as_float = float(value)
    return as_float if math.isfinite(as_float) else None


def _count(value: object) -> int | None:
    """``value`` when it is an ``int`` (not a ``bool``), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _parse_bundle_indices(value: object) -> tuple[int, tuple[int, ...]] | None:
    if not isinstance(value, tuple | list) or len(value) != 2:
        return None
    node, ids = _count(value[0]), value[1]
    if node is None or isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        return None
    parsed = [_count(i) for i in ids]
    checked = [i for i in parsed if i is not None]
    return (node, tuple(checked)) if len(checked) == len(parsed) else None


def _slots_per_node(group_size: int, num_gpus_per_node: int) -> int:
    return max(1, num_gpus_per_node // group_size)


def _describe_ephemeral(ephemeral_ports: tuple[int, int]) -> str:
    low, high = ephemeral_ports
    return f"the host's ephemeral port range {low}-{high} (net.ipv4.ip_local_port_range)"


def bundle_group_size(bundle_indices: object) -> int:
    """The tied group NeMo-RL's placement hook infers from ``bundle_indices``: as many
    GPUs as ``(node_idx, ids)`` names bundles, else one."""
    if isinstance(bundle_indices, tuple | list) and len(bundle_indices) == 2:
        ids = bundle_indices[1]
        return len(ids) if isinstance(ids, Sequence) and ids else 1
    return 1


def configure_worker(
    num_gpus: float,
    bundle_indices: tuple[int, Sequence[int]] | None,
    num_gpus_per_node: int | None,
    *,
    cache_root: str,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    port_base: int = DEFAULT_PORT_BASE,
    port_window: int = DEFAULT_PORT_WINDOW,
    ephemeral_ports: tuple[int, int] = DEFAULT_EPHEMERAL_PORTS,
) -> Result[PlacementPlan, PlacementError]:
    """Plan one worker actor of a generation engine (see the module docstring for the rules).

    ``bundle_indices`` is ``(node_idx, ids)`` for the first worker of an engine (the one that
    builds it) and ``None`` for the other members of its tied TP/PP group.
    ``num_gpus_per_node=None`` means the topology is unknown (NeMo-RL's default).
    """
    gpus = _number(num_gpus)
    if gpus is None or gpus < 0:
        return _error("num_gpus", num_gpus, "must be a finite number >= 0")
    per_node = None if num_gpus_per_node is None else _count(num_gpus_per_node)
    if num_gpus_per_node is not None and (per_node is None or per_node <= 0):
        return _error("num_gpus_per_node", num_gpus_per_node, "must be None or an integer >= 1")
    for name, size in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
    ):
        if (_count(size) or 0) < 1:
            return _error(name, size, "must be an integer >= 1")
    root = cache_root.rstrip("/")
    if not root:
        return _error("cache_root", cache_root, "must name a directory")
    if port_window < 1:
        return _error("port_window", port_window, "must be at least 1 port")
    if port_base < 1:
        return _error("port_base", port_base, "must be a port number >= 1")
    if not 1 <= ephemeral_ports[0] <= ephemeral_ports[1] <= MAX_PORT:
        return _error("ephemeral_ports", ephemeral_ports, f"must be 1 <= low <= high <= {MAX_PORT}")

    group_size = tensor_parallel_size * pipeline_parallel_size
    limit = min(ephemeral_ports[0] - 1, MAX_PORT)
    if per_node is not None:
        slots = _slots_per_node(group_size, per_node)
        node_last_port = port_base + slots * port_window - 1
        if node_last_port > limit:
            return _port_error(
                port_base,
                port_window,
                f"{slots} engine slot(s) per node from port_base={port_base} need ports up to "
                f"{node_last_port}",
                ephemeral_ports,
            )

    tied = bundle_indices is None or group_size > 1
    fraction = gpus if tied else None
    if bundle_indices is None:
        return Success(
            PlacementPlan(
                num_gpus=0.0,
                tied=True,
                fraction_of_gpus=fraction,
                bundle_ids=None,
                seed=None,
                slot=None,
                ports=None,
                cache_root=None,
            )
        )

    parsed = _parse_bundle_indices(bundle_indices)
    if parsed is None:
        return _error("bundle_indices", bundle_indices, "must be (node_idx, [bundle ids])")
    node, ids = parsed
    if node < 0:
        return _error("bundle_indices", bundle_indices, "the node index is negative")
    if not ids:
        return _error("bundle_indices", bundle_indices, "the bundle id list is empty")
    if min(ids) < 0:
        return _error("bundle_indices", bundle_indices, "a bundle id is negative")
    if len(set(ids)) != len(ids):
        return _error("bundle_indices", bundle_indices, "a bundle id appears twice")
    if len(ids) != group_size:
        return _error(
            "bundle_indices",
            bundle_indices,
            f"{len(ids)} bundle id(s) for an engine of tensor_parallel_size="
            f"{tensor_parallel_size} x pipeline_parallel_size={pipeline_parallel_size} "
            f"= {group_size} GPU(s)",
        )
    spans_nodes = per_node is not None and group_size > per_node
    if per_node is not None and not spans_nodes and max(ids) >= per_node:
        return _error(
            "bundle_indices",
            bundle_indices,
            f"the group fits on one node of {per_node} GPU(s), so its ids must be local ids "
            f"below {per_node}",
        )
    first = ids[0]
    if first % group_size != 0 or ids != tuple(range(first, first + group_size)):
        return _error(
            "bundle_indices",
            bundle_indices,
            f"ids must be {group_size} consecutive ascending ids starting at a multiple of "
            f"{group_size}",
        )
    engine_slot = first // group_size
    if engine_slot >= SEED_STRIDE:
        return _error(
            "bundle_indices",
            bundle_indices,
            f"engine slot {engine_slot} would reuse the seeds of node {node + 1} "
            f"(at most {SEED_STRIDE} engines per node)",
        )
    seed = node * SEED_STRIDE + engine_slot
    port_slot = 0 if spans_nodes else engine_slot
    window_first = port_base + port_slot * port_window
    window_last = window_first + port_window - 1
    if window_last > limit:  # only reachable when the node's slot count is unknown
        return _port_error(
            port_base,
            port_window,
            f"engine slot {port_slot} from port_base={port_base} needs ports up to {window_last}",
            ephemeral_ports,
        )
    return Success(
        PlacementPlan(
            num_gpus=0.0 if tied else gpus,
            tied=tied,
            fraction_of_gpus=fraction,
            bundle_ids=ids,
            seed=seed,
            slot=port_slot,
            ports=PortWindow(window_first, window_last),
            cache_root=f"{root}_{seed}",
        )
    )


def _port_error(
    port_base: int, port_window: int, need: str, ephemeral_ports: tuple[int, int]
) -> Failure[PlacementError]:
    limit = min(ephemeral_ports[0] - 1, MAX_PORT)
    return _error(
        "port_window",
        port_window,
        f"{need}, past {limit}: ports from {ephemeral_ports[0]} are "
        f"{_describe_ephemeral(ephemeral_ports)}, where the OS picks ports for outgoing "
        f"connections, and {MAX_PORT} is the highest port; lower port_base below "
        f"{ephemeral_ports[0]} or narrow port_window",
    )


def parse_port_range(text: str) -> Result[tuple[int, int], PlacementError]:
    """``(low, high)`` from the text of ``/proc/sys/net/ipv4/ip_local_port_range``."""
    fields = text.split()
    if (
        len(fields) != 2
        or not all(f.isascii() and f.isdecimal() for f in fields)
        or not 1 <= int(fields[0]) <= int(fields[1]) <= MAX_PORT
    ):
        return _error(
            "ip_local_port_range", text, f"must be two port numbers low <= high <= {MAX_PORT}"
        )
    return Success((int(fields[0]), int(fields[1])))


@attrs.frozen
class EngineEnv:
    """Environment changes before a worker builds its engine: ``set`` these, ``unset`` those."""

    set: FrozenMap[str, str]
    unset: tuple[str, ...] = ()


def plan_engine_env(
    bundle_ids: Sequence[int] | None,
    fraction_of_gpus: float,
    *,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
) -> Result[EngineEnv, PlacementError]:
    """What a NeMo-RL model owner sets before starting a TP/PP engine on Ray's executor.

    NeMo-RL's ``_load_model``: for ``tp * pp > 1`` the worker drops ``CUDA_VISIBLE_DEVICES``
    (Ray set none, ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``; vLLM's Ray workers each
    get their own), gives each vLLM Ray worker ``fraction_of_gpus / (tp * pp)`` GPUs
    (``VLLM_RAY_PER_WORKER_GPUS``) and places them on its bundles
    (``VLLM_RAY_BUNDLE_INDICES``, one per worker). One-GPU engines change nothing.
    """
    size = tensor_parallel_size * pipeline_parallel_size
    if size == 1:
        return Success(EngineEnv(FrozenMap()))
    fraction = _number(fraction_of_gpus)
    if fraction == 0:
        return _error(
            "fraction_of_gpus",
            fraction_of_gpus,
            f"a GPU-less cluster (num_gpus=0) cannot hold an engine of tensor_parallel_size x "
            f"pipeline_parallel_size = {size}: vLLM's Ray executor places one worker per GPU; "
            "use tensor_parallel_size: 1 and pipeline_parallel_size: 1 there",
        )
    if fraction is None or not 0 < fraction <= 1:
        return _error("fraction_of_gpus", fraction_of_gpus, "must be a number in (0, 1]")
    if bundle_ids is None or len(bundle_ids) != size:
        return _error(
            "bundle_indices",
            bundle_ids,
            f"an engine of tensor_parallel_size x pipeline_parallel_size = {size} needs "
            f"{size} bundle ids",
        )
    env = FrozenMap(
        (
            ("VLLM_RAY_PER_WORKER_GPUS", repr(fraction / size)),
            ("VLLM_RAY_BUNDLE_INDICES", ",".join(str(int(i)) for i in bundle_ids)),
        )
    )
    return Success(EngineEnv(env, unset=("CUDA_VISIBLE_DEVICES",)))


def forwarded_env_names(existing: str, names: Sequence[str]) -> str:
    """The new value of :data:`RAY_EXTRA_ENV_VARS`: its ``existing`` names and ``names``,
    sorted and unique (NeMo-RL's ``_patch_vllm_init_workers_ray`` merges the same way)."""
    merged = {n.strip() for n in (*existing.split(","), *names) if n.strip()}
    return ",".join(sorted(merged))


def env_names(names: object) -> Result[tuple[str, ...], PlacementError]:
    """``extra_env_vars`` (NeMo-RL's list of variable names to forward; None: none) as a
    tuple, or why it is not a list of environment variable names."""
    if names is None:
        return Success(())
    if isinstance(names, str) or not isinstance(names, Sequence):
        message = f"extra_env_vars must be a list of environment variable names, got {names!r}"
        return Failure(PlacementError(message, name="extra_env_vars", value=repr(names)))
    bad = [n for n in names if not isinstance(n, str) or not _ENV_NAME.fullmatch(n)]
    if bad:
        message = f"extra_env_vars: not environment variable names: {bad!r}"
        return Failure(PlacementError(message, name="extra_env_vars", value=repr(bad)))
    return Success(tuple(names))


def check_inherited_env(env: Mapping[str, str]) -> Result[None, PlacementError]:
    """Refuse malformed ``VLLM_PORT`` / ``VLLM_HOST_IP`` inherited from the environment.

    Kubernetes injects ``VLLM_PORT=tcp://host:port`` for a service named ``vllm``; vLLM then
    fails deep inside engine start (vLLM ``envs.get_vllm_port``). The shell passes its
    environment here before starting engines.
    """
    port = env.get("VLLM_PORT")
    if port is not None and not (
        port.isascii() and port.isdecimal() and 1 <= int(port) <= MAX_PORT
    ):
        return _error("VLLM_PORT", port, f"must be a decimal port number 1..{MAX_PORT}")
    host = env.get("VLLM_HOST_IP")
    if host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return _error("VLLM_HOST_IP", host, "must be an IPv4 or IPv6 address")
    return Success(None)


@attrs.frozen
class ShardPlacement:
    """Where one data-parallel shard's engine lives.

    ``node`` and ``bundle_ids`` are what :func:`configure_worker` takes as
    ``bundle_indices``; ``global_bundle_ids`` index the placement group's bundle list.
    """

    rank: int
    node: int
    bundle_ids: tuple[int, ...]
    global_bundle_ids: tuple[int, ...]
    host_node: int

    @property
    def bundle_indices(self) -> tuple[int, tuple[int, ...]]:
        return (self.node, self.bundle_ids)

    @property
    def ray_bundle_indices(self) -> str:
        """The value of ``VLLM_RAY_BUNDLE_INDICES`` for this engine."""
        return ",".join(str(i) for i in self.global_bundle_ids)


@attrs.frozen
class ClusterPlan:
    """One PACK placement group for a data-parallel generation group, and each shard's place.

    Bundle ``g`` is planned on node ``g // bundles_per_node``; the shell checks Ray's actual
    bundle-to-node table against it before creating actors.
    """

    num_nodes: int
    bundles_per_node: int
    uses_gpus: bool
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_bundles: int
    shards: tuple[ShardPlacement, ...]
    worker_num_gpus: float
    ray_per_worker_gpus: float
    strategy: str = "PACK"

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return len(self.shards)

    @property
    def spans_nodes(self) -> bool:
        return self.model_parallel_size > self.bundles_per_node

    @property
    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundle list (fresh dicts on every access)."""
        if self.uses_gpus:
            return [{"GPU": 1, "CPU": 1} for _ in range(self.num_bundles)]
        return [{"CPU": 1} for _ in range(self.num_bundles)]

    def engine_env_vars(self, rank: int) -> dict[str, str]:
        """Environment the engine of shard ``rank`` needs for vLLM's Ray executor.

        Empty for one-bundle engines: they run vLLM's in-process executor.
        """
        shard = self.shards[rank]
        if self.model_parallel_size == 1:
            return {}
        return {
            "VLLM_RAY_BUNDLE_INDICES": shard.ray_bundle_indices,
            "VLLM_RAY_PER_WORKER_GPUS": repr(self.ray_per_worker_gpus),
        }


def plan_cluster(
    num_nodes: int,
    gpus_per_node: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    data_parallel_size: int,
    *,
    cpus_per_node: int = 0,
    gpu_fraction: float = 1.0,
) -> Result[ClusterPlan, PlacementError]:
    """Lay out ``data_parallel_size`` engines of ``tensor x pipeline`` bundles each.

    A cluster with ``gpus_per_node == 0`` is CPU-only: it has ``cpus_per_node`` bundles of
    ``{"CPU": 1}`` per node instead of one ``{"GPU": 1, "CPU": 1}`` bundle per GPU. Engines
    that fit on a node are packed node by node at aligned slots (NeMo-RL's tied worker
    groups); larger engines take consecutive global bundles of one unified group and are
    named ``(0, global ids)``. ``gpu_fraction`` is what each worker actor asks of its bundle's
    GPU; vLLM's Ray workers get ``gpu_fraction / (tensor x pipeline)`` each, as in NeMo-RL.
    """
    for name, value in (
        ("num_nodes", num_nodes),
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("data_parallel_size", data_parallel_size),
    ):
        if (_count(value) or 0) < 1:
            return _error(name, value, "must be an integer >= 1")
    if _count(gpus_per_node) is None or gpus_per_node < 0:
        return _error("gpus_per_node", gpus_per_node, "must be an integer >= 0")
    uses_gpus = gpus_per_node > 0
    if not uses_gpus and (_count(cpus_per_node) or 0) < 1:
        return _error(
            "cpus_per_node", cpus_per_node, "a cluster without GPUs needs at least 1 CPU per node"
        )
    fraction = _number(gpu_fraction)
    if fraction is None or not 0 < fraction <= 1:
        return _error("gpu_fraction", gpu_fraction, "must be a number in (0, 1]")

    per_node = gpus_per_node if uses_gpus else cpus_per_node
    size = tensor_parallel_size * pipeline_parallel_size
    spans_nodes = size > per_node
    capacity = (num_nodes * per_node) // size if spans_nodes else num_nodes * (per_node // size)
    if data_parallel_size > capacity:
        return _error(
            "data_parallel_size",
            data_parallel_size,
            f"{num_nodes} node(s) x {per_node} bundle(s) hold at most {capacity} engine(s) of "
            f"{size} bundle(s)"
            + ("" if spans_nodes else " (an engine that fits on a node never spans two)"),
        )

    shards: list[ShardPlacement] = []
    for rank in range(data_parallel_size):
        if spans_nodes:
            node, local_first = 0, rank * size
            global_first = local_first
        else:
            node, slot = divmod(rank, per_node // size)
            local_first = slot * size
            global_first = node * per_node + local_first
        shards.append(
            ShardPlacement(
                rank=rank,
                node=node,
                bundle_ids=tuple(range(local_first, local_first + size)),
                global_bundle_ids=tuple(range(global_first, global_first + size)),
                host_node=global_first // per_node,
            )
        )
    return Success(
        ClusterPlan(
            num_nodes=num_nodes,
            bundles_per_node=per_node,
            uses_gpus=uses_gpus,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            num_bundles=shards[-1].global_bundle_ids[-1] + 1,
            shards=tuple(shards),
            worker_num_gpus=fraction if uses_gpus else 0.0,
            ray_per_worker_gpus=fraction / size if uses_gpus else 0.0,
        )
    )


def check_bundle_nodes(
    plan: ClusterPlan, bundle_nodes: Mapping[int, str]
) -> Result[None, PlacementError]:
    """Whether Ray's bundle-to-node table matches the plan: the bundles planned on one
    node on one Ray node, different planned nodes on different Ray nodes."""
    planned: dict[int, set[str]] = {}
    for bundle in range(plan.num_bundles):
        node = bundle_nodes.get(bundle)
        if node is None:
            return _table_error(f"Ray reports no node for bundle {bundle}", bundle_nodes)
        planned.setdefault(bundle // plan.bundles_per_node, set()).add(node)
    split = {k: sorted(v) for k, v in planned.items() if len(v) > 1}
    if split:
        why = f"bundles planned on one node landed on several Ray nodes: {split}"
        return _table_error(why, bundle_nodes)
    owners: dict[str, list[int]] = {}
    for k, nodes in planned.items():
        owners.setdefault(next(iter(nodes)), []).append(k)
    shared = {node: ks for node, ks in owners.items() if len(ks) > 1}
    if shared:
        return _table_error(
            f"planned nodes {sorted(shared.values())} share one Ray node", bundle_nodes
        )
    return Success(None)


def _table_error(why: str, bundle_nodes: Mapping[int, str]) -> Failure[PlacementError]:
    return Failure(PlacementError(why, name="bundles_to_node_id", value=repr(dict(bundle_nodes))))


def placement_not_ready(
    plan: ClusterPlan, timeout_s: float, available: Mapping[str, float], total: Mapping[str, float]
) -> str:
    """Why the placement group of ``plan`` did not start: its bundles, and what the cluster
    had ``available`` of its ``total`` resources after ``timeout_s`` seconds."""
    bundles = plan.bundles
    return (
        f"the placement group of {len(bundles)} bundle(s) {bundles[0]} ({plan.strategy}) was "
        f"not ready after {timeout_s:g} s; the cluster has {available} available of {total}"
    )


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name}={value!r} must be a number of seconds above 0")


def _cpu_share(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{attribute.name}={value!r} must be in (0, 1]: a bundle holds 1 CPU")


class RayInit(TypedDict, total=False):
    """``ray.init``'s arguments of a :class:`ClusterSpec`."""

    address: str
    num_cpus: int | None


@attrs.frozen
class ClusterSpec:
    """Where a data-parallel generation group runs and how long it waits.

    ``num_shards`` engines (data-parallel size) on ``num_nodes`` nodes of ``gpus_per_node``
    GPUs each; ``gpus_per_node=0`` is a CPU-only cluster of ``cpus_per_node`` bundles per
    node. Tensor and pipeline parallel sizes come from the worker config. ``ray_address``
    is passed to ``ray.init`` when Ray is not running yet (``None``: a local Ray with
    ``ray_num_cpus`` CPUs); an initialised Ray is used as it is.
    """

    num_shards: int
    num_nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_node: int = 0
    gpu_fraction: float = 1.0
    actor_num_cpus: float = attrs.field(default=1.0, validator=_cpu_share)
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    placement_timeout_s: float = attrs.field(default=300.0, validator=_positive)
    start_timeout_s: float = attrs.field(default=900.0, validator=_positive)
    call_timeout_s: float = attrs.field(default=3600.0, validator=_positive)
    shutdown_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    cache_base_dir: str | None = None
    port_base: int = DEFAULT_PORT_BASE
    port_window: int = DEFAULT_PORT_WINDOW

    @property
    def ray_init_kwargs(self) -> RayInit:
        """``ray.init``'s arguments where Ray is not running yet: the cluster at
        ``ray_address``, else a local Ray of ``ray_num_cpus`` CPUs."""
        if self.ray_address is not None:
            return {"address": self.ray_address}
        return {"num_cpus": self.ray_num_cpus}

    def plan(
        self, tensor_parallel_size: int, pipeline_parallel_size: int
    ) -> Result[ClusterPlan, PlacementError]:
        """:func:`plan_cluster` of this cluster's engines of ``tensor x pipeline`` bundles."""
        return plan_cluster(
            self.num_nodes,
            self.gpus_per_node,
            tensor_parallel_size,
            pipeline_parallel_size,
            self.num_shards,
            cpus_per_node=self.cpus_per_node,
            gpu_fraction=self.gpu_fraction,
        )


class ClusterOptions(TypedDict, total=False):
    """:class:`ClusterSpec`'s fields after ``num_shards``, as keywords of
    ``genworker.shell.group.local_cluster``."""

    num_nodes: int
    gpus_per_node: int
    cpus_per_node: int
    gpu_fraction: float
    actor_num_cpus: float
    ray_address: str | None
    ray_num_cpus: int | None
    placement_timeout_s: float
    start_timeout_s: float
    call_timeout_s: float
    shutdown_timeout_s: float
    cache_base_dir: str | None
    port_base: int
    port_window: int


def local_cluster_spec(
    num_shards: int,
    model_parallel_size: int,
    *,
    gpus: int,
    cpu_count: int | None,
    options: ClusterOptions,
) -> ClusterSpec:
    """A :class:`ClusterSpec` for one machine of ``gpus`` GPUs, or without GPUs for
    ``num_shards`` CPU shards (``cpu_count``: the machine's, ``None`` where unknown).

    Without GPUs every bundle is one logical Ray CPU, so a local Ray is started with at
    least as many CPUs as the shards need (``options`` override any field). The GPU count
    of a machine with GPUs is never overridden: a ``gpus_per_node`` there is a
    ``TypeError``, as Python's own for a keyword given twice.
    """
    if gpus:
        if "gpus_per_node" in options:
            raise TypeError(
                "local_cluster() got multiple values for keyword argument 'gpus_per_node' "
                f"(this machine has {gpus} GPUs)"
            )
        fields: ClusterOptions = {"gpus_per_node": gpus}
    else:
        cpus = max(cpu_count or 1, num_shards * model_parallel_size)
        fields = {"cpus_per_node": cpus, "ray_num_cpus": cpus}
    return ClusterSpec(num_shards=num_shards, **(fields | options))


@attrs.frozen
class ShardActor:
    """How one shard's worker actor starts (:func:`plan_shard_actor`); the dict views are
    built afresh on every access. ``bundle_index``: the placement group bundle it sits on,
    its shard's first."""

    worker: PlacementPlan
    engine_env: tuple[tuple[str, str], ...]
    uses_gpus: bool
    num_cpus: float
    bundle_index: int

    @property
    def options(self) -> dict[str, object]:
        """Ray actor options, without the scheduling strategy."""
        return {
            "num_cpus": self.num_cpus,
            "num_gpus": self.worker.num_gpus if self.uses_gpus else 0,
            "runtime_env": {"env_vars": self.worker.env_vars | dict(self.engine_env)},
            "max_restarts": 0,
        }

    @property
    def init_kwargs(self) -> dict[str, object]:
        """The worker's init kwargs (no GPU fraction on a CPU bundle)."""
        kwargs = self.worker.init_kwargs
        if not self.uses_gpus:
            kwargs.pop("fraction_of_gpus", None)
        return kwargs


def plan_shard_actor(
    spec: ClusterSpec,
    plan: ClusterPlan,
    shard: ShardPlacement,
    *,
    cache_root: str,
    ephemeral_ports: tuple[int, int] = DEFAULT_EPHEMERAL_PORTS,
) -> Result[ShardActor, PlacementError]:
    """Shard ``shard``'s worker actor of ``plan`` on ``spec``: :func:`configure_worker`'s
    seed, ports and cache root, and the engine's environment
    (:meth:`ClusterPlan.engine_env_vars`)."""
    configured = configure_worker(
        # A CPU bundle has no GPU; the plan's seed, ports and cache root still apply.
        plan.worker_num_gpus if plan.uses_gpus else 1.0,
        shard.bundle_indices,
        plan.bundles_per_node,
        cache_root=cache_root,
        tensor_parallel_size=plan.tensor_parallel_size,
        pipeline_parallel_size=plan.pipeline_parallel_size,
        port_base=spec.port_base,
        port_window=spec.port_window,
        ephemeral_ports=ephemeral_ports,
    )
    return configured.map(
        lambda worker: ShardActor(
            worker=worker,
            engine_env=tuple(plan.engine_env_vars(shard.rank).items()),
            uses_gpus=plan.uses_gpus,
            num_cpus=spec.actor_num_cpus,
            bundle_index=shard.global_bundle_ids[0],
        )
    )


def plan_shard_actors(
    spec: ClusterSpec,
    plan: ClusterPlan,
    *,
    default_cache_root: str,
    ephemeral_ports: tuple[int, int] = DEFAULT_EPHEMERAL_PORTS,
) -> Result[tuple[ShardActor, ...], PlacementError]:
    """Every shard's :func:`plan_shard_actor`, in rank order, under ``spec.cache_base_dir``'s
    ``vllm`` (``None``: under ``default_cache_root``); a failure names its shard."""
    base = spec.cache_base_dir
    cache_root = default_cache_root if base is None else posixpath.join(base, "vllm")
    actors: list[ShardActor] = []
    for shard in plan.shards:
        planned = plan_shard_actor(
            spec, plan, shard, cache_root=cache_root, ephemeral_ports=ephemeral_ports
        )
        if isinstance(planned, Failure):
            error = planned.failure()
            return Failure(attrs.evolve(error, message=f"placement of shard {shard.rank}: {error}"))
        actors.append(planned.unwrap())
    return Success(tuple(actors))
