"""Laws of the RL control plane (``genworker.core.control_plane``): every route's body
parsed or refused naming its field, and the machine of pause, transfer and update states."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import json_values

from genworker.core import control_plane as c
from genworker.core.nemo_rl_refit import packed_groups
from genworker.core.refit_plan import DTYPE_ITEMSIZE, Manifest, TensorSpec
from genworker.core.serving import BadRequest

ROUTE_NAMES = sorted(set(c.ROUTES.values()))
GOOD_INIT = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}

queries = st.dictionaries(
    st.sampled_from(["mode", "clear_cache", "level", "tags", "x"]),
    st.sampled_from(["abort", "wait", "keep", "true", "false", "1", "0", "2", "weights", "?"]),
    max_size=3,
)

specs = st.builds(
    TensorSpec,
    st.text("abcdefgh.", min_size=1, max_size=6),
    st.lists(st.integers(0, 5), max_size=3).map(tuple),
    st.sampled_from(sorted(DTYPE_ITEMSIZE)),
)


def update_info(tensors: list[TensorSpec]) -> dict[str, Any]:
    return {
        "names": [t.name for t in tensors],
        "dtype_names": [t.dtype for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
    }


@given(st.sampled_from(ROUTE_NAMES), queries, json_values)
def test_every_body_is_parsed_or_refused_with_a_400_naming_the_route(
    route: str, query: dict[str, str], body: object
) -> None:
    result = c.parse(route, query, body)
    if isinstance(result, Failure):
        problem = result.failure()
        assert isinstance(problem, BadRequest)
        assert problem.status == 400
        assert str(problem).startswith("/" + route)


@given(st.lists(specs, min_size=1, max_size=6, unique_by=lambda s: s.name))
def test_an_update_info_round_trips_into_its_manifest_in_order(tensors: list[TensorSpec]) -> None:
    info = update_info(tensors)
    info["dtype_names"] = [f"torch.{d}" for d in info["dtype_names"]]  # both spellings
    update = c.parse("update_weights", {}, {"update_info": info}).unwrap()
    assert isinstance(update, c.Update)
    assert update.manifest.specs == tuple(tensors)


BAD_ENTRIES: dict[str, list[object]] = {
    "names": [None, 3, "", True, [-1]],
    "dtype_names": [None, 3, "", "float7", "torch.int4", True],
    "shapes": [None, 3, "", [-1], [True], ["1"], True],
}


@given(
    st.lists(specs, min_size=1, max_size=6, unique_by=lambda s: s.name),
    st.sampled_from(sorted(BAD_ENTRIES)),
    st.integers(0, 5),
    st.data(),
)
def test_a_bad_entry_of_update_info_is_named_by_its_column_and_index(
    tensors: list[TensorSpec], column: str, index: int, data: st.DataObject
) -> None:
    info = update_info(tensors)
    index %= len(tensors)
    info[column][index] = data.draw(st.sampled_from(BAD_ENTRIES[column]))
    problem = c.parse("update_weights", {}, {"update_info": info}).failure()
    assert problem.param == f"update_info.{column}[{index}]", problem


@pytest.mark.parametrize(
    ("route", "query", "body", "param"),
    [
        ("pause", {"mode": "stop"}, None, "mode"),
        ("pause", {"clear_cache": "maybe"}, None, "clear_cache"),
        ("pause", {"modee": "keep"}, None, "modee"),
        ("sleep", {}, {"level": 3}, "level"),
        ("wake_up", {}, {"tags": ["all"]}, "tags"),
        ("abort_requests", {}, {"request_ids": [1]}, "request_ids"),
        ("init_weight_transfer_engine", {}, {}, "init_info"),
        (
            "init_weight_transfer_engine",
            {},
            {"init_info": {**GOOD_INIT, "master_port": 0}},
            "init_info.master_port",
        ),
        (
            "init_weight_transfer_engine",
            {},
            {"init_info": {**GOOD_INIT, "rank_offset": 0}},
            "init_info.rank_offset",
        ),
        (
            "init_weight_transfer_engine",
            {},
            {"init_info": {**GOOD_INIT, "world_size": 1}},
            "init_info.world_size",
        ),
        (
            "init_weight_transfer_engine",
            {},
            {"init_info": {**GOOD_INIT, "packed": "yes"}},
            "init_info.packed",
        ),
        (
            "init_weight_transfer_engine",
            {},
            {"init_info": {**GOOD_INIT, "nccl_unique_id_b64": "AA=="}},
            "init_info.nccl_unique_id_b64",
        ),
        (
            "init_weight_transfer_engine",
            {},
            {"init_info": {**GOOD_INIT, "colour": 1}},
            "init_info.colour",
        ),
        (
            "init_weight_transfer_engine",
            {},
            {"init_info": {**GOOD_INIT, "packed_buffer_size_bytes": 0}},
            "init_info.packed_buffer_size_bytes",
        ),
        (
            "init_weight_transfer_engine",
            {},
            {"init_info": {**GOOD_INIT, "packed_num_buffers": "2"}},
            "init_info.packed_num_buffers",
        ),
        (
            "init_weight_transfer_engine",
            {},
            {"init_info": {**GOOD_INIT, "master_address": ""}},
            "init_info.master_address",
        ),
        ("start_weight_update", {}, {"is_checkpoint_format": "yes"}, "is_checkpoint_format"),
        (
            "update_weights",
            {},
            {
                "update_info": {
                    "names": ["a"],
                    "dtype_names": ["float32"],
                    "shapes": [[1]],
                    "packed": 1,
                }
            },
            "update_info.packed",
        ),
        (
            "update_weights",
            {},
            {
                "update_info": {
                    "names": ["a"],
                    "dtype_names": ["float32"],
                    "shapes": [[1]],
                    "packed_buffer_size_bytes": 0,
                }
            },
            "update_info.packed_buffer_size_bytes",
        ),
        (
            "update_weights",
            {},
            {"update_info": {"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1]]}},
            "update_info",
        ),
        (
            "update_weights",
            {},
            {
                "update_info": {
                    "names": ["a", "a"],
                    "dtype_names": ["float32"] * 2,
                    "shapes": [[1]] * 2,
                }
            },
            "update_info.names",
        ),
        (
            "update_weights",
            {},
            {"update_info": {"names": [], "dtype_names": [], "shapes": []}},
            "update_info.names",
        ),
        (
            "update_weights",
            {},
            {
                "update_info": {
                    "names": ["a"],
                    "dtype_names": ["float32"],
                    "shapes": [[1]],
                    "extra": 1,
                }
            },
            "update_info.extra",
        ),
        ("update_weights", {}, {"update_info": [1]}, "update_info"),
        ("finish_weight_update", {}, {"weight_version": True}, "weight_version"),
        ("finish_weight_update", {}, {"version": "1"}, "version"),
        ("resume", {}, [1], None),
    ],
)
def test_each_bad_body_names_its_field(
    route: str, query: dict[str, str], body: object, param: str | None
) -> None:
    problem = c.parse(route, query, body).failure()
    assert problem.param == param, problem
    assert problem.status == 400


def test_the_good_bodies_of_trl_and_vllm_parse() -> None:
    assert c.parse("pause", {"mode": "keep"}, None).unwrap() == c.Pause(c.PauseMode.KEEP, True)
    assert c.parse("pause", {}, None).unwrap() == c.Pause(c.PauseMode.ABORT, True)
    assert c.parse("sleep", {"level": "2"}, None).unwrap() == c.Sleep(2)
    assert c.parse("wake_up", {"tags": "weights"}, None).unwrap() == c.WakeUp(("weights",))
    assert c.parse("wake_up", {}, {}).unwrap() == c.WakeUp(None)
    init = c.parse("init_weight_transfer_engine", {}, {"init_info": {**GOOD_INIT, "packed": True}})
    assert init.unwrap() == c.InitTransfer("127.0.0.1", 29500, 1, 2, packed=True)
    # vLLM's engine default: unpacked unless the trainer says packed
    init = c.parse("init_weight_transfer_engine", {}, {"init_info": GOOD_INIT})
    assert init.unwrap() == c.InitTransfer("127.0.0.1", 29500, 1, 2, packed=False)
    assert c.parse("start_weight_update", {}, {}).unwrap() == c.StartUpdate(True)
    assert c.parse("finish_weight_update", {}, None).unwrap() == c.FinishUpdate(None)
    assert c.parse("finish_weight_update", {}, {"weight_version": 7}).unwrap() == c.FinishUpdate(
        "7"
    )
    assert c.parse("abort_requests", {}, {}).unwrap() == c.AbortRequests(())
    assert c.parse("reset_prefix_cache", {}, None).unwrap() == c.ResetPrefixCache()
    assert c.parse("weight_info", {}, None).unwrap() == c.Query("weight_info")
    assert c.parse("no_such_route", {}, None).failure().status == 400
    assert c.parse("pause", {"mode": "wait", "clear_cache": "0"}, None).unwrap() == c.Pause(
        c.PauseMode.WAIT, False
    )
    assert c.parse("pause", {"clear_cache": "1"}, None).unwrap() == c.Pause(c.PauseMode.ABORT, True)
    assert c.parse("resume", {}, None).unwrap() == c.Resume()


@given(
    st.text(min_size=1, max_size=8),
    st.integers(1, 65535),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 2**40),
    st.booleans(),
)
def test_an_init_info_round_trips(
    address: str, port: int, offset: int, more: int, size: int, packed: bool
) -> None:
    init = c.InitTransfer(address, port, offset, offset + more, size, packed)
    assert (
        c.parse("init_weight_transfer_engine", {}, {"init_info": init.as_dict()}).unwrap() == init
    )


@given(
    st.lists(specs, min_size=1, max_size=6, unique_by=lambda s: s.name),
    st.none() | st.booleans(),
    st.none() | st.integers(1, 2**40),
)
def test_an_update_info_round_trips(
    tensors: list[TensorSpec], packed: bool | None, size: int | None
) -> None:
    wire = {"packed": packed, "packed_buffer_size_bytes": size}
    info = {**update_info(tensors), **{k: v for k, v in wire.items() if v is not None}}
    update = c.parse("update_weights", {}, {"update_info": info}).unwrap()
    assert update == c.Update(Manifest.from_specs(tensors).unwrap(), packed, size)
    assert c.parse("update_weights", {}, {"update_info": update.as_vllm_info()}).unwrap() == update


@given(
    st.lists(specs, min_size=1, max_size=8, unique_by=lambda s: s.name),
    st.booleans(),
    st.integers(1, 64),
    st.none() | st.booleans(),
    st.none() | st.integers(1, 64),
)
def test_an_update_is_broadcast_as_vllm_sends_it(
    tensors: list[TensorSpec],
    init_packed: bool,
    init_size: int,
    packed: bool | None,
    size: int | None,
) -> None:
    """vLLM 0.25 says packed or not per update (``update_info``), 0.32 at init; both
    default to unpacked. Packed: NeMo-RL's groups at the update's buffer size, else the
    init's; unpacked: one broadcast per tensor, in order."""
    manifest = Manifest.from_specs(tensors).unwrap()
    init = c.InitTransfer("h", 1, 1, 2, init_size, init_packed)
    groups = c.broadcasts(init, c.Update(manifest, packed, size))
    assert [s for g in groups for s in g] == list(manifest.specs)
    if packed is False or (packed is None and not init_packed):
        assert all(len(g) == 1 for g in groups)
    else:
        assert groups == packed_groups(manifest, init_size if size is None else size)


@pytest.mark.parametrize(
    "request_",
    [c.Sleep(1), c.WakeUp(None), c.InitTransfer("h", 1, 1, 2), c.StartUpdate(True)],
)
def test_an_open_update_must_finish_before_sleep_wake_init_or_another_start(
    request_: c.Request,
) -> None:
    state = c.step(c.ControlState(), c.InitTransfer("h", 1, 1, 2)).unwrap()
    state = c.step(state, c.StartUpdate(True)).unwrap()
    assert "POST /finish_weight_update first" in str(c.step(state, request_).failure())


# --- the machine -------------------------------------------------------------------------

MANIFEST = c.parse(
    "update_weights", {}, {"update_info": update_info([TensorSpec("w", (2,), "float32")])}
)
requests = st.one_of(
    st.builds(c.Pause, st.sampled_from(c.PauseMode), st.booleans()),
    st.just(c.Resume()),
    st.builds(c.Sleep, st.sampled_from([1, 2])),
    st.just(c.WakeUp(None)),
    st.just(c.InitTransfer("127.0.0.1", 29500, 1, 2)),
    st.builds(c.StartUpdate, st.booleans()),
    st.just(MANIFEST.unwrap()),
    st.builds(c.FinishUpdate, st.none() | st.sampled_from(["v1", "v2"])),
    st.just(c.Generate()),
    st.just(c.Query("is_paused")),
)
outcomes = st.sampled_from(["landed", "failed", "broken"])


@given(st.lists(st.tuples(requests, outcomes), max_size=25))
def test_the_machine_allows_or_refuses_naming_the_state_and_the_route_to_call(
    run: list[tuple[c.Request, str]],
) -> None:
    state = c.ControlState()
    for request, outcome in run:
        before = state
        result = c.step(state, request)
        if isinstance(result, Failure):
            message = str(result.failure())
            assert f"(state: {before.describe()})" in message
            assert "POST /" in message
            continue
        state = result.unwrap()
        if isinstance(request, c.Update):
            assert before.transfer is c.Transfer.UPDATING  # an update only inside start/finish
            if outcome == "landed":
                state = c.updated(state)
            else:
                state = c.update_failed(state, "boom", group_broken=outcome == "broken")
                assert state.failed == "boom"
                assert (state.transfer is c.Transfer.NONE) == (outcome == "broken")
        if isinstance(request, c.Generate):
            assert before.paused is not c.PauseMode.ABORT
            assert before.failed is None
        if isinstance(request, c.FinishUpdate):
            assert state.transfer is c.Transfer.READY
            expected = (
                before.label
                if request.weight_version is None or before.failed
                else request.weight_version
            )
            assert state.label == expected


@given(st.sampled_from(c.PauseMode), st.integers(1, 3))
def test_trls_async_grpo_sequence_goes_through_and_ends_ready_and_serving(
    mode: c.PauseMode, updates: int
) -> None:
    state = c.step(c.ControlState(), c.InitTransfer("h", 1, 1, 2)).unwrap()
    for _ in range(2):  # two steps of training
        state = c.step(state, c.Pause(mode, True)).unwrap()
        state = c.step(state, c.StartUpdate(True)).unwrap()
        for _ in range(updates):
            state = c.updated(c.step(state, MANIFEST.unwrap()).unwrap())
        state = c.step(state, c.FinishUpdate("v")).unwrap()
        state = c.step(state, c.Resume()).unwrap()
        assert isinstance(c.step(state, c.Generate()), Success)
    assert state == c.ControlState(None, c.Transfer.READY, None, "v")


def test_generation_is_refused_while_paused_in_mode_abort() -> None:
    state = c.step(c.ControlState(), c.Pause(c.PauseMode.ABORT, True)).unwrap()
    assert "POST /resume first" in str(c.step(state, c.Generate()).failure())
    assert isinstance(c.step(c.step(state, c.Resume()).unwrap(), c.Generate()), Success)


def test_a_pause_in_another_mode_is_refused_naming_the_mode_it_is_in() -> None:
    state = c.step(c.ControlState(), c.Pause(c.PauseMode.KEEP, True)).unwrap()
    refused = str(c.step(state, c.Pause(c.PauseMode.ABORT, True)).failure())
    assert "already paused in mode keep" in refused
    assert c.step(state, c.Pause(c.PauseMode.KEEP, True)) == Success(state)


def test_generation_is_refused_after_a_failed_update_until_one_lands() -> None:
    state = c.step(c.ControlState(), c.InitTransfer("h", 1, 1, 2)).unwrap()
    state = c.step(state, c.StartUpdate(True)).unwrap()
    state = c.update_failed(state, "NaN in w", group_broken=False)
    refused = str(c.step(state, c.Generate()).failure())
    assert "NaN in w" in refused
    assert "update_weights" in refused
    state = c.updated(c.step(state, MANIFEST.unwrap()).unwrap())
    assert isinstance(c.step(state, c.Generate()), Success)
    assert attrs.evolve(state, failed=None) == state


@given(st.lists(specs, min_size=1, max_size=8, unique_by=lambda s: s.name), st.integers(1, 64))
def test_vllms_packed_chunks_are_nemo_rls_groups(tensors: list[TensorSpec], target: int) -> None:
    """vLLM's ``pack_tensors`` (producer) and ``packed_nccl_broadcast_consumer`` close a
    buffer once its bytes exceed the target, as NeMo-RL's do: the engine side reuses
    ``packed_groups``. Here the producer's loop, written from vLLM's."""
    chunks: list[list[str]] = []
    current: list[str] = []
    total = 0
    for spec in tensors:
        current.append(spec.name)
        total += spec.nbytes
        if total > target:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    manifest = Manifest.from_specs(tensors).unwrap()
    assert [[s.name for s in g] for g in packed_groups(manifest, target)] == chunks


@given(st.sampled_from(ROUTE_NAMES), queries, json_values, st.sampled_from([b"", b" \n"]))
def test_a_raw_body_parses_as_its_json_and_a_blank_one_as_none(
    route: str, query: dict[str, str], body: object, blank: bytes
) -> None:
    assert c.parse_raw(route, query, json.dumps(body).encode()) == c.parse(route, query, body)
    assert c.parse_raw(route, query, blank) == c.parse(route, query, None)


@pytest.mark.parametrize("raw", [b"{level: 1", b"\xff"])
def test_a_body_that_is_not_json_is_a_400_naming_the_route(raw: bytes) -> None:
    problem = c.parse_raw("sleep", {}, raw).failure()
    assert (problem.status, problem.param) == (400, None)
    assert problem.message.startswith("/sleep: the body is not JSON (")


def test_admit_is_step_with_its_conflict_a_409() -> None:
    state = c.step(c.ControlState(), c.Pause(c.PauseMode.ABORT, True)).unwrap()
    assert c.admit(state, c.Resume()) == c.step(state, c.Resume())
    refused = c.admit(state, c.Generate()).failure()
    assert refused == BadRequest(str(c.step(state, c.Generate()).failure()), status=409, param=None)


PAUSED = c.ControlState(paused=c.PauseMode.KEEP, label="step-7")


@pytest.mark.parametrize(
    ("request_", "state", "outcome", "expected"),
    [
        (c.Query("get_world_size"), c.ControlState(), 4, {"world_size": 4}),
        (c.Query("is_paused"), PAUSED, None, {"is_paused": True}),
        (c.Query("is_paused"), c.ControlState(), None, {"is_paused": False}),
        (c.Query("is_sleeping"), c.ControlState(), True, {"is_sleeping": True}),
        (c.Query("weight_info"), PAUSED, None, {"weight_version": "step-7", "genworker_weight_version": 3}),
        (c.Query("weight_info"), c.ControlState(), None, {"weight_version": "3", "genworker_weight_version": 3}),
        (c.Query("server_info"), c.ControlState(), {"a": 1}, {"vllm_config": {"a": 1}}),
        (c.Pause(c.PauseMode.WAIT, True), c.ControlState(), None, {"status": "paused"}),
        (c.Resume(), PAUSED, None, {"status": "resumed"}),
        (c.AbortRequests(()), c.ControlState(), 2, {"status": "aborted", "aborted": 2}),
        (c.Sleep(1), c.ControlState(), None, {"status": "sleeping", "level": 1}),
        (c.WakeUp(None), c.ControlState(), None, {"status": "awake"}),
        (c.ResetPrefixCache(), c.ControlState(), None, {"success": True}),
        (c.InitTransfer("h", 1, 1, 2), c.ControlState(), [1], {"message": "Weight transfer initialized", "ranks": [1]}),
        (c.StartUpdate(True), c.ControlState(), None, {"message": "Weight update started"}),
        (c.Update(Manifest.from_specs([TensorSpec("w", (1,), "float32")]).unwrap()), c.ControlState(), True, {"message": "Weights updated", "weight_version": 3}),
        (c.FinishUpdate("x"), c.ControlState(), None, {"message": "Weight update finished", "weight_version": 3}),
    ],
)  # fmt: skip
def test_each_route_answers_with_vllms_body(
    request_: c.Request, state: c.ControlState, outcome: object, expected: dict[str, object]
) -> None:
    assert c.answer(request_, state, outcome, 3) == expected


def test_generation_is_no_route_to_answer() -> None:
    with pytest.raises(ValueError, match="is not a route of the control plane"):
        c.answer(c.Generate(), c.ControlState(), None, 0)
