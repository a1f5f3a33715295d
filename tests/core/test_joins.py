"""Laws of the group-join values: the rank after the trainer's, the wire round trip, the
bounds derived from the one checked ``timeout_s``, and each refusal naming its field."""

from __future__ import annotations

import pickle

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core import joins as j
from genworker.core import refit_protocol as p

_sizes = st.integers(0, 1 << 16)
_bounds = st.none() | st.floats(1e-3, 1e6, allow_nan=False)
_stages = st.lists(st.tuples(st.text(min_size=1), st.integers(1, 65535)), min_size=1, max_size=4)


@given(_sizes, st.text(), st.integers(1, 65535), _sizes, _sizes, _bounds, _sizes)
def test_a_join_ranks_the_engine_after_the_trainer_and_round_trips_the_wire(
    prefix: int, ip: str, port: int, world: int, train: int, timeout: float | None, worker: int
) -> None:
    result = j.group_join(prefix, ip, port, world, train, timeout)
    assert isinstance(result, Success)
    join = result.unwrap()
    assert join.rank(worker) == train + prefix + worker
    assert join.timeout_s == p.wait_bound(timeout).unwrap()
    assert join.rpc_bound() == p.rpc_bound(p.RENDEZVOUS_WAITS, join.timeout_s)
    assert j.group_join(**join.to_wire()) == Success(join)
    assert pickle.loads(pickle.dumps(join)) == join


@pytest.mark.parametrize("bad", [float("nan"), 0, -1.0, "5", True])
def test_a_bad_timeout_is_refused_naming_the_field(bad: object) -> None:
    for result in (
        j.group_join(0, "h", 1, 2, 1, bad),
        j.reshard_join(0, ["h"], [1], 1, 1, 2, bad, "bad device too"),
    ):
        assert isinstance(result, Failure)
        error = result.failure()
        assert (error.field, error.value) == ("timeout_s", bad)
        assert error.message == p.wait_bound(bad).failure().message


@given(st.integers(0, 64), _stages, _sizes, _sizes, _bounds, st.sampled_from([None, "cpu"]))
def test_a_reshard_join_is_one_join_per_stage_and_round_trips_the_wire(
    prefix: int,
    stages: list[tuple[str, int]],
    train: int,
    world: int,
    timeout: float | None,
    device: str | None,
) -> None:
    ips, ports = [ip for ip, _ in stages], [port for _, port in stages]
    result = j.reshard_join(prefix, ips, ports, len(stages), train, world, timeout, device)
    assert isinstance(result, Success)
    join = result.unwrap()
    bound = p.wait_bound(timeout).unwrap()
    assert join.stages == tuple(
        j.GroupJoin(prefix, ip, port, world, train, bound) for ip, port in stages
    )
    assert join.device == device
    assert join.rpc_bound() == p.rpc_bound(p.RENDEZVOUS_WAITS * len(stages), bound)
    assert j.reshard_join(**join.to_wire()) == Success(join)


@pytest.mark.parametrize(
    ("args", "field", "message"),
    [
        ((["h"], [1], 1, "cuda"), "device", "device must be None (the engine's) or 'cpu', got"),
        ((["h"], [1, 2], 1, None), "pp_size", "pp_size=1 with 1 ip(s) and 2 port(s)"),
        ((["h", "i"], [1], 2, None), "pp_size", "pp_size=2 with 2 ip(s) and 1 port(s)"),
        (([], [], 0, None), "pp_size", "pp_size=0 with 0 ip(s) and 0 port(s)"),
    ],
)
def test_a_bad_reshard_join_is_refused_naming_the_field(
    args: tuple[list[str], list[int], int, str | None], field: str, message: str
) -> None:
    ips, ports, size, device = args
    result = j.reshard_join(0, ips, ports, size, 1, 2, None, device)
    assert isinstance(result, Failure)
    assert result.failure().field == field
    assert message in str(result.failure())


def test_a_reshard_join_has_a_stage() -> None:
    with pytest.raises(ValueError, match="stages"):
        j.ReshardJoin(())
    join = j.group_join(0, "h", 1, 2, 1).unwrap()
    assert attrs.evolve(j.ReshardJoin((join,)), device="cpu").device == "cpu"


_not_integers: st.SearchStrategy[object] = st.sampled_from(["two", None, 1.5j, [], float("inf")])


@given(st.integers(0, 3), _not_integers)
def test_a_join_value_that_is_no_integer_is_refused_naming_it(at: int, bad: object) -> None:
    """Where ``int()`` fails (the engine always took these through ``int()``), the join is
    refused naming that argument, never a bare ``TypeError`` / ``ValueError``."""
    names = ("rank_prefix", "port", "world_size", "train_world_size")
    args: list[object] = [0, 29500, 2, 1]
    args[at] = bad
    result = j.group_join(args[0], "h", args[1], args[2], args[3])  # type: ignore[arg-type]
    assert isinstance(result, Failure)
    assert (result.failure().field, result.failure().value) == (names[at], bad)
    assert names[at] in result.failure().message
    stage_args: list[object] = [0, 1, 2, 29500]  # rank_prefix, train ranks, world, a port
    stage_args[at] = bad
    prefix, train, world, port = stage_args
    reshard = j.reshard_join(prefix, ["h"], [port], 1, train, world)  # type: ignore[arg-type,list-item]
    assert isinstance(reshard, Failure)
    public = ("rank_prefix", "train_ranks_per_stage", "sub_world_size", "pp_ports[0]")[at]
    assert reshard.failure().field == public
