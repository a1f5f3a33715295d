"""Shard-to-shard refit (issue 17): each trainer rank sends the slices it holds, each
engine rank receives only its own shard, over point-to-point sends on a standalone group.

The plan is :mod:`genworker.core.reshard`'s; this module moves its bytes.

Setup (NeMo-RL's names and order): the engine workers join one group per trainer PP stage
(``init_nccl_reshard_comm_group``: stage ``s`` at ``pp_ips[s]:pp_ports[s]``, its
``train_ranks_per_stage`` trainer ranks first, engine worker ``w`` of the engine with
``rank_prefix`` at ``train_ranks_per_stage + rank_prefix + w``, ``sub_world_size`` in
all) while the trainer ranks of the stage open a :class:`ReshardSender` on it. The
trainer describes where its tensors live (:func:`refit_info` over
:class:`~genworker.core.reshard.TrainerLayout` values: Megatron TP shards, or
:func:`layout_of_dtensor` for a ``DTensor``); ``prepare_nccl_reshard_refit_info`` gives
that to the engine workers, which read vLLM's split of every parameter from their layers
(:func:`engine_facts`: fused ``qkv_proj`` / ``gate_up_proj`` named by the model's
``packed_modules_mapping``) and answer their shards (:func:`shards_of`), from which every
trainer rank makes the same plan (:meth:`ReshardSender.plan`).

A refit (``nccl_reshard_refit`` on the engine, :meth:`ReshardSender.send` on every
trainer rank), per stage group: trainer rank 0 broadcasts the plan digests and every
rank checks them (the engine: its own plan; a trainer rank: its plan, and that it holds
each shard the layout says, in its shape and dtype); a status round (``CollectiveGroup
.settle``) makes any rank's problem every rank's typed error, naming the parameter and
the ranks, before a byte moves. Then one batched exchange: every copy of the plan is one
point-to-point message (one NCCL group call; on gloo all posted, then waited), received
straight into the parameter's memory where the engine's routes write it directly
(``core.refit_protocol.plan_routes``) and the destination is one contiguous region, else
into scratch, copied into the parameter, or placed into a tensor of the trainer tensor's
full shape for vLLM's weight loader (which reads only this rank's part of it: only those
bytes travel). A last status round reports post-load failures. Every wait is bounded
(``core.refit_protocol.wait_bound``; the worker derives the call's bound with
``rpc_bound`` and ``refit_waits``); a failed exchange breaks the group until
``init_nccl_reshard_comm_group`` runs again.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from genworker.core import refit_protocol as p
from genworker.core.joins import ReshardJoinWire, reshard_join
from genworker.core.refit_plan import dtype_name
from genworker.core.reshard import (
    Copy,
    EnginePlans,
    EngineShard,
    Replicate,
    ReshardPlan,
    Shard,
    SizeOf,
    TrainerLayout,
    VllmLayer,
    VllmParamFacts,
    bytes_of,
    check_ranks,
    dtensor_layout,
    fit_group,
    header_problem,
    outgoing,
    p2p_tags,
    packed_sources,
    parse_refit_info,
    parse_shards,
    plan_digest,
    plan_engine,
    plan_stage,
    read_header,
    ready_to_receive,
    refit_info,
    sender_problems,
    start_header,
    trainer_header_problem,
    vllm_facts,
)
from genworker.shell.errors import (
    BadArgumentError,
    BadConfigError,
    EngineStateError,
    GenworkerError,
    RefitError,
    RefitManifestError,
    UnsupportedError,
    unwrap,
)
from genworker.shell.refit.collective import CollectiveGroup
from genworker.shell.refit.engine import EngineContext, EngineSink
from genworker.shell.refit.receiver import typed_error

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ReshardBackend",
    "ReshardGroup",
    "ReshardSender",
    "bytes_of",
    "engine_facts",
    "layout_of_dtensor",
    "plan_digest",
    "refit_info",
    "shards_of",
]


class ReshardGroup(CollectiveGroup):
    """A weight-update group that also moves point-to-point messages."""

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        what: str,
        bound_s: float,
    ) -> None:
        """Send and receive ``(peer rank, tensor)`` messages, matched per peer in order;
        one NCCL group call, or every gloo message posted and then waited."""
        if not sends and not recvs:
            return
        pg = self._group()
        with self._foreign(f"exchanging {what}", bound_s):
            if self.backend == "nccl":
                pg._start_coalescing()
                for peer, tensor in sends:
                    pg.send([tensor], peer, 0)
                for peer, tensor in recvs:
                    pg.recv([tensor], peer, 0)
                works = [pg._end_coalescing()]
            else:
                works = [pg.send([t], peer, tag) for peer, t, tag in p2p_tags(sends)]
                works += [pg.recv([t], peer, tag) for peer, t, tag in p2p_tags(recvs)]
            deadline = time.monotonic() + bound_s
            for work in works:
                self._wait(work, deadline)


# -- descriptions ----------------------------------------------------------------------


def layout_of_dtensor(name: str, tensor: torch.Tensor) -> TrainerLayout:
    """The layout of a ``DTensor`` (``Shard`` / ``Replicate`` placements): its mesh's
    ranks are the trainer ranks of the reshard group."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    if not isinstance(tensor, DTensor):
        raise BadArgumentError(f"{name!r} is a {type(tensor).__name__}, not a DTensor")
    placements: list[Shard | Replicate] = []
    for placement in tensor.placements:
        if isinstance(placement, TorchShard):
            placements.append(Shard(int(placement.dim)))
        elif isinstance(placement, TorchReplicate):
            placements.append(Replicate())
        else:
            raise BadArgumentError(
                f"{name!r} has placement {placement!r}: only Shard and Replicate"
            )
    mesh = tensor.device_mesh.mesh
    result = dtensor_layout(
        name,
        tuple(int(d) for d in tensor.shape),
        dtype_name(tensor.dtype),
        tuple(int(d) for d in mesh.shape),
        [int(r) for r in mesh.flatten().tolist()],
        placements,
    )
    return unwrap(result, BadArgumentError, "layout_of_dtensor")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _region(tensor: torch.Tensor, box: Sequence[tuple[int, int]]) -> torch.Tensor:
    return tensor[tuple(slice(a, b) for a, b in box)]


def shards_of(summaries: Iterable[object]) -> list[EngineShard]:
    """Every engine shard, in engine-rank order, from the workers' answers to
    ``prepare_nccl_reshard_refit_info`` (one engine's: one answer per worker)."""
    return unwrap(parse_shards(summaries), BadArgumentError, "")


def _read_header(data: bytes) -> dict[int, str]:
    return unwrap(read_header(data), RefitError, "")


# -- the trainer side ------------------------------------------------------------------


class ReshardSender:
    """Trainer rank ``rank`` of one PP stage's reshard group at ``ip:port`` (rank 0
    hosts its store; this blocks until every rank joined: start the engines'
    ``init_nccl_reshard_comm_group`` alongside).

    ``layouts``: where every tensor of the stage lives, the same on every trainer rank
    (what :func:`refit_info` gave the engines). :meth:`plan` adds an engine (its shards
    from :func:`shards_of`, its ``rank_prefix``); :meth:`send` sends one refit of this
    rank's local tensors (a ``DTensor`` sends its local shard).
    """

    def __init__(
        self,
        ip: str,
        port: int,
        world_size: int,
        *,
        rank: int,
        train_world_size: int,
        layouts: Sequence[TrainerLayout],
        device: torch.device | str = "cpu",
        timeout_s: float | None = None,
    ) -> None:
        self._timeout = unwrap(p.wait_bound(timeout_s), BadConfigError, "ReshardSender")
        self.layouts = {layout.name: layout for layout in layouts}
        where = (ip, port, rank, world_size, train_world_size)
        self.group = ReshardGroup(*where, "trainer", torch.device(device), self._timeout)
        self.rank, self._train = rank, train_world_size
        self._plans: dict[int, ReshardPlan] = {}

    def __enter__(self) -> ReshardSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def plan(self, shards: Sequence[EngineShard], *, rank_prefix: int = 0) -> ReshardPlan:
        """The plan for the engine whose workers start at ``rank_prefix`` (kept)."""
        layouts = list(self.layouts.values())
        unwrap(check_ranks([layouts], self._train), RefitManifestError, "")
        plan = unwrap(plan_stage(layouts, shards), RefitManifestError, "reshard refit")
        fits = fit_group(plan, self._train, rank_prefix, self.group.world_size)
        self._plans[rank_prefix] = unwrap(fits, BadArgumentError, "")
        return plan

    def _problems(self, tensors: Mapping[str, torch.Tensor]) -> RefitManifestError | None:
        """This rank's shards against the layouts: present, in their shape and dtype."""
        local = {n: (tuple(int(d) for d in _local(t).shape), dtype_name(_local(t).dtype))
                 for n, t in tensors.items()}  # fmt: skip
        layouts = list(self.layouts.values())
        problems = sender_problems(self.rank, self._train, self._plans, layouts, local)
        return RefitManifestError("reshard refit: " + "; ".join(problems)) if problems else None

    def send(self, tensors: Mapping[str, torch.Tensor]) -> p.RefitReport:
        """Send this rank's slices of one refit; a typed :class:`RefitError` on any
        failure (this rank's, another rank's, or the transport's)."""
        if not self._plans:
            raise EngineStateError("ReshardSender.send before plan() (the engines' shards)")
        started, group, bound = time.monotonic(), self.group, self._timeout
        digests = {prefix: plan_digest(plan) for prefix, plan in self._plans.items()}
        problem = self._problems(tensors)
        what = "the start of the reshard refit"
        data = group.message(
            start_header(secrets.token_hex(8), digests) if self.rank == 0 else None, what, bound
        )
        if problem is None and self.rank:
            mismatch = trainer_header_problem(self.rank, digests, _read_header(data))
            problem = RefitManifestError(mismatch) if mismatch else None
        group.settle(problem, what, bound)
        sends = [
            (peer, _region(_local(tensors[c.source]), c.src_box).to(group.device).contiguous())
            for peer, c in outgoing(self._plans, self.rank, self._train)
        ]
        group.exchange(sends, [], "the shards", bound)
        group.settle(None, "the end of the reshard refit", bound)
        nbytes = sum(t.nbytes for _, t in sends)
        return p.RefitReport(len(sends), nbytes, 1, time.monotonic() - started)

    def close(self) -> None:
        self.group.close()


# -- the engine side -------------------------------------------------------------------


def _int_attr(obj: object, attr: str, default: int | None = None) -> int | None:
    """``obj``'s attribute ``attr`` as an int (``default`` when it has none), or None."""
    value = getattr(obj, attr, default)
    return None if value is None else int(value)


def _facts(
    module: nn.Module, name: str, local: str, param: torch.Tensor, subs: Sequence[str]
) -> VllmParamFacts:
    classes = frozenset(c.__name__ for c in type(module).__mro__)
    sizes = tuple(int(n) for n in getattr(module, "output_sizes", None) or ())
    size_of: SizeOf = functools.partial(_int_attr, module)
    layer = VllmLayer(type(module).__name__, classes, size_of, sizes)
    out_dim, in_dim = _int_attr(param, "output_dim"), _int_attr(param, "input_dim")
    found = (tuple(int(d) for d in param.shape), dtype_name(param.dtype), out_dim, in_dim)
    return unwrap(vllm_facts(layer, name, local, found, subs), UnsupportedError, "")


def engine_facts(model: nn.Module) -> list[VllmParamFacts]:
    """Every parameter's split as vLLM's layers make it (class names along the MRO, the
    parameter's ``output_dim`` / ``input_dim``, the layer's sizes: vLLM's CPU backend
    leaves a repacked linear weight empty), its sources named as the checkpoint names
    them (a fused layer's through the model's ``packed_modules_mapping``)."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    out = []
    for module_name, module in model.named_modules():
        for local, param in module._parameters.items():
            if param is not None:
                name = f"{module_name}.{local}" if module_name else local
                subs = packed_sources(module_name, local, packed)
                out.append(_facts(module, name, local, param, subs))
    return out


class ReshardBackend:
    """``reshard``: the engine's end of the reshard refit (one group per trainer PP
    stage, the plan of the trainer's layouts)."""

    def __init__(self, engine: EngineContext) -> None:
        self.engine = engine
        self.groups: list[ReshardGroup] = []
        self.rank_prefix = self.train = self.version = 0
        self.prepared: EnginePlans | None = None

    def init(
        self, join: ReshardJoinWire | None = None, refit_info: Mapping[str, object] | None = None
    ) -> dict[str, object]:
        """Join every stage's group (``join``: ``ReshardJoin.to_wire``), or, given
        ``refit_info``, plan every later refit from the trainer's layouts (:meth:`plan`)."""
        if refit_info is not None:
            if join is not None:
                raise BadArgumentError("the reshard refit_info comes alone")
            return self.plan(refit_info)
        if join is None:
            raise BadArgumentError("the reshard init takes a join or a refit_info")
        return self.join(join)

    def join(self, join: ReshardJoinWire) -> dict[str, object]:
        """Join every trainer PP stage's reshard group as ``join`` says (rank
        ``train_ranks_per_stage + rank_prefix + worker rank``); ``device`` ``"cpu"``: the
        group is gloo over host memory even on a CUDA engine (the shards arrive in host
        scratch and are copied into the parameters), for trainer ranks on this engine's
        GPU, which NCCL refuses to place in one communicator ("Duplicate GPU detected")."""
        call = "init_nccl_reshard_comm_group"
        stages = unwrap(reshard_join(**join), BadArgumentError, call)
        where = self.engine.device if stages.device is None else torch.device(stages.device)
        self.close()
        first = stages.stages[0]
        rank, sizes = first.rank(self.engine.rank), (first.world_size, first.train_world_size)
        try:
            for stage in stages.stages:
                group = ReshardGroup(
                    stage.ip, stage.port, rank, *sizes, "engine", where, stage.timeout_s
                )
                self.groups.append(group)
        except GenworkerError:
            self.close()
            raise
        self.rank_prefix, self.train = first.rank_prefix, first.train_world_size
        return {"rank": rank, "stages": len(self.groups)}

    def plan(self, refit_info: Mapping[str, object]) -> dict[str, object]:
        """This worker's shards (for :func:`shards_of`), its plan digests and byte count.
        Parameters made of none of the described tensors keep their weights; a described
        tensor that no parameter is made of is refused."""
        if not isinstance(refit_info, Mapping):
            raise BadArgumentError(
                f"prepare_nccl_reshard_refit_info: refit_info must be a mapping, got {refit_info!r}"
            )
        stages = unwrap(parse_refit_info(refit_info), RefitManifestError, "")
        parallel = getattr(self.engine.config, "parallel_config", None)
        if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
            raise UnsupportedError("the reshard refit takes engines without pipeline parallelism")
        engine, rank = self.engine, self.engine.rank
        facts = engine_facts(engine.model())
        prepared = unwrap(plan_engine(facts, stages, engine.tp_size, rank), RefitManifestError, "")
        if self.groups:
            unwrap(check_ranks(prepared.stages, self.train), RefitManifestError, "")
        routed = self.engine.routed(prepared.manifest, True)
        self.prepared = prepared
        return prepared.answer(rank, len(routed.routes.direct))

    def receive(self, refit_timeout_s: float | None = None) -> dict[str, object]:
        """Receive one reshard refit from every stage group into the engine."""
        bound = unwrap(p.wait_bound(refit_timeout_s), BadArgumentError, "refit_timeout_s")
        prepared = unwrap(ready_to_receive(len(self.groups), self.prepared), EngineStateError, "")
        ranks = check_ranks(prepared.stages, self.train)  # planned before the groups joined
        unwrap(ranks, RefitManifestError, "")
        report = _receive(self.engine, self, prepared, bound)
        self.version += 1
        return {**report, "version": self.version}

    def status(self) -> dict[str, object]:
        return {"stages": len(self.groups), "version": self.version}

    def release(self) -> int:
        return 0  # every shard is received into the engine's own memory

    def close(self) -> int:
        """Leave every reshard group (without waiting for the peers); how many."""
        groups, self.groups = self.groups, []
        for group in groups:
            group.close()
        return len(groups)


def _receive(
    engine: EngineContext, state: ReshardBackend, prepared: EnginePlans, bound: float
) -> dict[str, object]:
    started, rank = time.monotonic(), engine.rank
    routed = engine.routed(prepared.manifest, True)
    sink, direct = EngineSink(routed, engine.device), routed.routes.direct
    device = sink.device
    later: list[tuple[Copy, torch.Tensor]] = []  # received into scratch
    received = 0
    what = "the start of the reshard refit"
    for stage, (group, plan) in enumerate(zip(state.groups, prepared.plans, strict=True)):
        digests = _read_header(group.message(None, what, bound))
        own, prefix = prepared.digests[stage], state.rank_prefix
        problem = header_problem(group.rank, stage, own, digests, prefix)
        group.settle(RefitManifestError(problem) if problem else None, what, bound)
        recvs = []
        for c in (c for c in plan.copies if c.dst_rank == rank):
            dest = None
            if c.param in direct:
                view = _region(sink.target(c.param), c.dest_box)
                dest = view if view.is_contiguous() and view.device == group.device else None
            if dest is None:  # scratch where the group moves bytes (host memory on gloo)
                dest = torch.empty(
                    [b - a for a, b in c.dest_box],
                    dtype=getattr(torch, prepared.dtype(c.param)),
                    device=group.device,
                )
                later.append((c, dest))
            recvs.append((c.src_rank, dest))
            received += dest.nbytes
        group.exchange([], recvs, f"stage {stage}'s shards", bound)
    loader_copies: dict[str, list[tuple[Copy, torch.Tensor]]] = {}
    for c, scratch in later:
        if c.param in direct:
            _region(sink.target(c.param), c.dest_box).copy_(scratch)
        else:
            loader_copies.setdefault(c.source, []).append((c, scratch))
    failed: RefitError | None = None
    try:
        arrived = [(n, sink.target(n)) for n in sorted(direct)] + [(c.param, t) for c, t in later]
        engine.check_finite(arrived, "the reshard refit")
        if loader_copies:
            engine.loader()(_full_tensors(prepared, loader_copies, device))
        sink.finish(sorted(direct))
    except Exception as e:  # noqa: BLE001 - told to every rank by the last status round
        failed = typed_error(e, "loading the reshard refit failed")
    errors = []
    for group in state.groups:  # every stage's trainer ranks learn the outcome
        try:
            group.settle(failed, "the end of the reshard refit", bound)
        except RefitError as e:
            errors.append(e)
    if errors:
        raise errors[0]
    seconds = time.monotonic() - started
    return prepared.received(rank, received, len(direct), len(loader_copies), seconds)


def _full_tensors(
    prepared: EnginePlans,
    copies: Mapping[str, Sequence[tuple[Copy, torch.Tensor]]],
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each loaded trainer tensor in its full shape, this rank's elements placed where
    they belong (vLLM's loader narrows to exactly those), one at a time."""
    layouts = {layout.name: layout for layouts in prepared.stages for layout in layouts}
    for source, received in copies.items():
        layout = layouts[source]
        full = torch.empty(layout.shape, dtype=getattr(torch, layout.dtype), device=device)
        for c, scratch in received:
            _region(full, c.global_box).copy_(scratch)
        yield source, full
