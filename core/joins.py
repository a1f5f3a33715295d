"""One engine's place in the trainer's weight-update group(s), as one value.

An engine worker joins the trainer's group (NeMo-RL's ``init_collective``) as rank
``train_world_size + rank_prefix + worker rank`` of ``world_size``, every rendezvous wait
bounded by ``timeout_s``; the shard-to-shard reshard (``init_nccl_reshard_comm_group``)
joins one such group per trainer PP stage. The worker builds the value once from its
public arguments (:func:`group_join`, :func:`reshard_join`); it crosses vLLM's
``collective_rpc`` as plain values (``to_wire``: msgpack, no pickle) and the engine
builds it again from them, so both ends check the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import attrs
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError
from genworker.core.refit_protocol import RENDEZVOUS_WAITS, rpc_bound, wait_bound

__all__ = [
    "GroupJoin",
    "GroupJoinWire",
    "JoinError",
    "ReshardJoin",
    "ReshardJoinWire",
    "group_join",
    "reshard_join",
]


@attrs.frozen
class JoinError(CoreError):
    """A group join refused before any socket opens: ``field`` and its ``value``."""

    field: str
    value: object = None


class GroupJoinWire(TypedDict):
    """:meth:`GroupJoin.to_wire`: the keywords of :func:`group_join`."""

    rank_prefix: int
    ip: str
    port: int
    world_size: int
    train_world_size: int
    timeout_s: float


class ReshardJoinWire(TypedDict):
    """:meth:`ReshardJoin.to_wire`: the keywords of :func:`reshard_join`."""

    rank_prefix: int
    pp_ips: list[str]
    pp_ports: list[int]
    pp_size: int
    train_ranks_per_stage: int
    sub_world_size: int
    timeout_s: float
    device: str | None


@attrs.frozen
class GroupJoin:
    """Where and as what an engine joins one weight-update group (``timeout_s``: the
    checked bound of each rendezvous wait)."""

    rank_prefix: int
    ip: str
    port: int
    world_size: int
    train_world_size: int
    timeout_s: float

    def rank(self, worker_rank: int) -> int:
        """Engine worker ``worker_rank``'s rank: after the trainer's and earlier engines'."""
        return self.train_world_size + self.rank_prefix + worker_rank

    def rpc_bound(self) -> float:
        """The join call's outer bound: more than its rendezvous waits."""
        return rpc_bound(RENDEZVOUS_WAITS, self.timeout_s)

    def to_wire(self) -> GroupJoinWire:
        """The keywords of :func:`group_join` (plain values for ``collective_rpc``)."""
        return GroupJoinWire(
            rank_prefix=self.rank_prefix,
            ip=self.ip,
            port=self.port,
            world_size=self.world_size,
            train_world_size=self.train_world_size,
            timeout_s=self.timeout_s,
        )


def group_join(
    rank_prefix: int,
    ip: str,
    port: int,
    world_size: int,
    train_world_size: int,
    timeout_s: object = None,
) -> Result[GroupJoin, JoinError]:
    """The join, ``timeout_s`` checked (:func:`wait_bound`; None: the default bound)."""

    named = {"rank_prefix": rank_prefix, "port": port, "world_size": world_size}
    ints = _integers(**named, train_world_size=train_world_size)
    problem = "timeout_s", timeout_s
    bound = wait_bound(timeout_s).alt(lambda e: JoinError(e.message, *problem))
    return ints.bind(lambda n: bound.map(lambda b: GroupJoin(ip=str(ip), timeout_s=b, **n)))


def _integers(**named: object) -> Result[dict[str, int], JoinError]:
    """``named`` as integers (``int()`` of each, as the engine always took them), or the
    first that is none, by name."""
    out: dict[str, int] = {}
    for name, value in named.items():
        try:
            out[name] = int(value)  # type: ignore[call-overload]
        except (TypeError, ValueError, OverflowError):
            return Failure(JoinError(f"{name} must be an integer, got {value!r}", name, value))
    return Success(out)


@attrs.frozen
class ReshardJoin:
    """The reshard's joins: stage ``s``'s group at ``stages[s]``, each as the same rank;
    ``device`` None: the engine's own, ``"cpu"``: gloo over host memory."""

    stages: tuple[GroupJoin, ...] = attrs.field(validator=attrs.validators.min_len(1))
    device: str | None = None

    def rpc_bound(self) -> float:
        """The join call's outer bound: more than every stage's rendezvous waits."""
        return rpc_bound(RENDEZVOUS_WAITS * len(self.stages), self.stages[0].timeout_s)

    def to_wire(self) -> ReshardJoinWire:
        """The keywords of :func:`reshard_join` (plain values for ``collective_rpc``)."""
        first = self.stages[0]
        return ReshardJoinWire(
            rank_prefix=first.rank_prefix,
            pp_ips=[s.ip for s in self.stages],
            pp_ports=[s.port for s in self.stages],
            pp_size=len(self.stages),
            train_ranks_per_stage=first.train_world_size,
            sub_world_size=first.world_size,
            timeout_s=first.timeout_s,
            device=self.device,
        )


def reshard_join(
    rank_prefix: int,
    pp_ips: Sequence[str],
    pp_ports: Sequence[int],
    pp_size: int,
    train_ranks_per_stage: int,
    sub_world_size: int,
    timeout_s: object = None,
    device: str | None = None,
) -> Result[ReshardJoin, JoinError]:
    """The joins of every trainer PP stage (``pp_ips[s]:pp_ports[s]``), each as rank
    ``train_ranks_per_stage + rank_prefix + worker rank`` of ``sub_world_size``;
    ``timeout_s``, ``device`` and ``pp_size`` checked, in that order."""
    bound = wait_bound(timeout_s)
    if isinstance(bound, Failure):
        return Failure(JoinError(bound.failure().message, "timeout_s", timeout_s))
    if device not in (None, "cpu"):
        why = f"device must be None (the engine's) or 'cpu', got {device!r}"
        return Failure(JoinError(why, "device", device))
    if not (pp_size >= 1 and len(pp_ips) == pp_size == len(pp_ports)):
        why = f"pp_size={pp_size} with {len(pp_ips)} ip(s) and {len(pp_ports)} port(s)"
        return Failure(JoinError(why, "pp_size", pp_size))
    sizes = _integers(
        rank_prefix=rank_prefix,
        sub_world_size=sub_world_size,
        train_ranks_per_stage=train_ranks_per_stage,
        **{f"pp_ports[{i}]": port for i, port in enumerate(pp_ports)},
    )

    def joins(n: dict[str, int]) -> ReshardJoin:
        rank_prefix, world, train = (n.pop(k) for k in tuple(n)[:3])
        stages = (
            GroupJoin(rank_prefix, str(ip), port, world, train, bound.unwrap())
            for ip, port in zip(pp_ips, n.values(), strict=True)
        )
        return ReshardJoin(tuple(stages), device)

    return sizes.map(joins)
