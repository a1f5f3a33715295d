"""The RL routes' handlers (``shell.control.ControlRoutes``) over a stand-in worker: every
route's bad body a 400 naming the field, every wrong state a 409 naming what to call,
typed failures of the worker mapped to a status, and the stand-in left usable."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from genworker.core import control_plane as c
from genworker.shell.control import ControlRoutes
from genworker.shell.errors import (
    BadArgumentError,
    EngineStateError,
    GenworkerError,
    RefitError,
    RefitTimeoutError,
    RefitTransportError,
)

INIT = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}
UPDATE = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]]}


class StandIn:
    """The worker's side of the routes: records calls, fails on demand."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.fail: GenworkerError | None = None
        self.version = 0

    @property
    def weight_version(self) -> int:
        return self.version

    def _call(self, name: str, arg: object = None) -> None:
        self.calls.append((name, arg))
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error

    async def pause_generation(self, mode: str, clear_cache: bool = True) -> None:
        self._call("pause", (mode, clear_cache))

    async def resume_generation(self) -> None:
        self._call("resume")

    async def sleep(self, level: int | None = None) -> None:
        self._call("sleep", level)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._call("wake_up", tags)

    async def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")

    async def init_weight_transfer(
        self, init_info: Mapping[str, object], timeout_s: float | None = None
    ) -> list[object]:
        self._call("init", (dict(init_info), timeout_s))
        return [1]

    async def update_weights_from_wire(
        self, update_info: Mapping[str, object], timeout_s: float | None = None, *, held: bool
    ) -> bool:
        self._call("update", (dict(update_info), timeout_s, held))
        self.version += 1
        return True

    def sleeping(self) -> bool:
        return False

    async def abort_requests(self, request_ids: Sequence[str]) -> int:
        self._call("abort", tuple(request_ids))
        return 3


def call(
    routes: ControlRoutes, route: str, body: object = None, **query: str
) -> tuple[int, dict[str, Any]]:
    raw = b"" if body is None else json.dumps(body).encode()
    status, answer = asyncio.run(routes.handle(route, query, raw))
    return status, answer


def make() -> tuple[ControlRoutes, StandIn]:
    hooks = StandIn()
    return ControlRoutes(hooks, None, "gloo", 7.0), hooks


def test_a_trl_step_reaches_the_worker_with_the_timeout_and_the_pause_held() -> None:
    routes, hooks = make()
    assert call(routes, "init_weight_transfer_engine", {"init_info": INIT})[0] == 200
    assert call(routes, "pause", mode="keep")[0] == 200
    assert call(routes, "is_paused") == (200, {"is_paused": True})
    assert call(routes, "start_weight_update", {"is_checkpoint_format": True})[0] == 200
    status, answer = call(routes, "update_weights", {"update_info": UPDATE})
    assert (status, answer["weight_version"]) == (200, 1)
    assert call(routes, "finish_weight_update", {"weight_version": "step-1"})[0] == 200
    assert call(routes, "resume")[0] == 200
    assert call(routes, "weight_info")[1] == {
        "weight_version": "step-1",
        "genworker_weight_version": 1,
    }
    init = {**INIT, "packed": False, "packed_buffer_size_bytes": c.DEFAULT_BUFFER_BYTES}
    assert hooks.calls == [
        ("init", (init, 7.0)),
        ("pause", ("keep", True)),
        ("update", (UPDATE, 7.0, True)),
        ("resume", None),
    ]
    # unpaused, the worker pauses around the update itself
    call(routes, "start_weight_update")
    call(routes, "update_weights", {"update_info": UPDATE})
    assert hooks.calls[-1] == ("update", (UPDATE, 7.0, False))


@pytest.mark.parametrize(
    ("route", "body", "query", "status", "needle"),
    [
        ("start_weight_update", {}, {}, 409, "POST /init_weight_transfer_engine first"),
        (
            "update_weights",
            {"update_info": UPDATE},
            {},
            409,
            "POST /init_weight_transfer_engine first",
        ),
        ("finish_weight_update", {}, {}, 409, "POST /init_weight_transfer_engine first"),
        ("pause", None, {"mode": "stop"}, 400, "mode"),
        ("sleep", {"level": 3}, {}, 400, "level"),
        (
            "init_weight_transfer_engine",
            {"init_info": {**INIT, "world_size": 1}},
            {},
            400,
            "init_info.world_size",
        ),
        (
            "update_weights",
            {"update_info": {**UPDATE, "dtype_names": ["float7"]}},
            {},
            400,
            "dtype_names[0]",
        ),
        ("abort_requests", {"request_ids": "all"}, {}, 400, "request_ids"),
    ],
)
def test_a_bad_body_or_a_wrong_state_is_answered_and_nothing_reaches_the_worker(
    route: str, body: object, query: dict[str, str], status: int, needle: str
) -> None:
    routes, hooks = make()
    got, answer = call(routes, route, body, **query)
    assert got == status
    assert needle in answer["error"]["message"]
    assert hooks.calls == []
    assert call(routes, "is_paused") == (200, {"is_paused": False})  # still serving


def test_a_body_that_is_not_json_is_a_400() -> None:
    routes, _ = make()
    status, body = asyncio.run(routes.handle("sleep", {}, b"{level: 1"))
    answer: dict[str, Any] = body
    assert status == 400
    assert "not JSON" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("error", "status", "broken"),
    [
        (RefitTimeoutError("the trainer sent nothing within 7s"), 504, True),
        (RefitError("chunk 0: refused, non-finite values (NaN or inf) in 'w'"), 500, False),
        (RefitTransportError("no weight-transfer group"), 500, True),
        (BadArgumentError("timeout_s"), 400, False),
    ],
)
def test_a_failed_update_is_typed_refuses_generation_and_a_good_one_recovers(
    error: GenworkerError, status: int, broken: bool
) -> None:
    routes, hooks = make()
    call(routes, "init_weight_transfer_engine", {"init_info": INIT})
    call(routes, "start_weight_update")
    hooks.fail = error
    got, answer = call(routes, "update_weights", {"update_info": UPDATE})
    assert got == status
    assert type(error).__name__ in answer["error"]["message"]
    refusal = routes.refuses_generation()
    assert refusal is not None
    assert refusal.status == 409
    assert str(error) in refusal.message
    if broken:  # the group must be joined again
        assert (
            "init_weight_transfer_engine"
            in call(routes, "update_weights", {"update_info": UPDATE})[1]["error"]["message"]
        )
        call(routes, "init_weight_transfer_engine", {"init_info": INIT})
        call(routes, "start_weight_update")
    assert call(routes, "update_weights", {"update_info": UPDATE})[0] == 200
    assert routes.refuses_generation() is None


def test_generation_is_refused_while_paused_in_mode_abort_only() -> None:
    routes, hooks = make()
    call(routes, "pause", mode="wait")
    assert routes.refuses_generation() is None
    assert call(routes, "pause", mode="abort")[0] == 409  # already paused in another mode
    call(routes, "resume")
    call(routes, "pause", mode="abort", clear_cache="false")
    refusal = routes.refuses_generation()
    assert refusal is not None
    assert "POST /resume first" in refusal.message
    assert hooks.calls[-1] == ("pause", ("abort", False))


def test_the_read_only_routes_and_the_rest() -> None:
    routes, hooks = make()
    assert call(routes, "is_sleeping") == (200, {"is_sleeping": False})
    assert call(routes, "get_world_size") == (200, {"world_size": 1})
    assert call(routes, "abort_requests", {}) == (200, {"status": "aborted", "aborted": 3})
    assert call(routes, "sleep", {"level": 2})[0] == 200
    assert call(routes, "wake_up", None, tags="weights,kv_cache")[0] == 200
    assert call(routes, "reset_prefix_cache")[0] == 200
    assert hooks.calls == [
        ("abort", ()),
        ("sleep", 2),
        ("wake_up", ("weights", "kv_cache")),
        ("reset_prefix_cache", None),
    ]


def test_an_update_refused_in_the_workers_state_moves_nothing() -> None:
    """The worker refuses a refit while asleep (EngineStateError) before anything moves:
    a 409, the update still open, generation not refused."""
    routes, hooks = make()
    call(routes, "init_weight_transfer_engine", {"init_info": INIT})
    call(routes, "start_weight_update")
    hooks.fail = EngineStateError("the engine is asleep: wake_up first")
    assert call(routes, "update_weights", {"update_info": UPDATE})[0] == 409
    assert routes.refuses_generation() is None
    assert call(routes, "update_weights", {"update_info": UPDATE})[0] == 200
