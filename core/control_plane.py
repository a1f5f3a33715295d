"""The RL control plane of genworker's server: vLLM's pause, sleep and weight-transfer
routes (``vllm/entrypoints/rl/online/api_router.py`` and ``serve/dev/``, 0.32; the same
names and bodies in 0.25), their requests checked here and their states as one machine.

Theory of operation
-------------------
A trainer that drives vLLM as a server (TRL's ``VLLMClient`` and AsyncGRPO's
``WeightTransferClient``, SkyRL, prime-rl) pauses generation, opens a weight-transfer
group once (``/init_weight_transfer_engine``), then per step brackets one or more
``/update_weights`` between ``/start_weight_update`` and ``/finish_weight_update`` and
resumes. :func:`parse` turns a route's query and JSON body into one of the request
values below or a :class:`~genworker.core.serving.BadRequest` naming the field (400);
:func:`step` moves :class:`ControlState` by one request or refuses it with a
:class:`Conflict` (409) that names the state and the route to call. The shell executes
what the machine allowed, answers with vLLM's body for the route (:func:`answer`) and
reports how an update ended (:func:`updated`, :func:`update_failed`).

The wire of an update (:func:`broadcasts`) is vLLM's: the ``update_info`` tensors in
order, either packed (``packed_nccl_broadcast_producer``,
``vllm/distributed/weight_transfer/packed_tensor.py``: a buffer closing once its bytes
exceed ``packed_buffer_size_bytes``, one broadcast each; NeMo-RL's rule,
:func:`genworker.core.nemo_rl_refit.packed_groups`) or unpacked (one broadcast per
tensor). Which one is vLLM's rule for both versions: 0.25 says it per update
(``update_info.packed`` and its buffer size), 0.32 once at init (``init_info.packed``);
both default to unpacked when the trainer says nothing (TRL says ``packed: true`` in both).

Versions: every update that lands is one refit of the worker (its weight version goes up
by one, tokens are labelled with it); ``/finish_weight_update``'s ``weight_version`` is
the trainer's own label, reported by ``/weight_info`` beside the worker's count. After a
failed update the engine holds inconsistent weights: generation is refused (409) until an
update lands.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Final, TypeGuard

import attrs
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError
from genworker.core.nemo_rl_refit import packed_groups
from genworker.core.refit_plan import DTYPE_ITEMSIZE, Manifest, TensorSpec
from genworker.core.serving import BadRequest

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "ROUTES",
    "AbortRequests",
    "Conflict",
    "ControlState",
    "FinishUpdate",
    "Generate",
    "InitTransfer",
    "Pause",
    "PauseMode",
    "Query",
    "Request",
    "ResetPrefixCache",
    "Resume",
    "Sleep",
    "StartUpdate",
    "Transfer",
    "Update",
    "WakeUp",
    "admit",
    "answer",
    "init_transfer",
    "parse",
    "parse_raw",
    "step",
    "update_failed",
    "update_of",
    "updated",
]

#: vLLM's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES`` (both ends must agree on it).
DEFAULT_BUFFER_BYTES: Final = 1024 * 1024 * 1024
#: (method, path) -> the route's name, as vLLM serves them with ``VLLM_SERVER_DEV_MODE``.
ROUTES: Final[Mapping[tuple[str, str], str]] = {
    ("GET", "/get_world_size"): "get_world_size",
    ("GET", "/server_info"): "server_info",
    ("GET", "/is_paused"): "is_paused",
    ("GET", "/is_sleeping"): "is_sleeping",
    ("GET", "/weight_info"): "weight_info",
    ("POST", "/pause"): "pause",
    ("POST", "/resume"): "resume",
    ("POST", "/abort_requests"): "abort_requests",
    ("POST", "/sleep"): "sleep",
    ("POST", "/wake_up"): "wake_up",
    ("POST", "/reset_prefix_cache"): "reset_prefix_cache",
    ("POST", "/init_weight_transfer_engine"): "init_weight_transfer_engine",
    ("POST", "/start_weight_update"): "start_weight_update",
    ("POST", "/update_weights"): "update_weights",
    ("POST", "/finish_weight_update"): "finish_weight_update",
}


class PauseMode(enum.Enum):
    """vLLM's ``PauseMode``: what a pause does to the requests in flight."""

    ABORT = "abort"  # end them now
    WAIT = "wait"  # let them finish, admit nothing new
    KEEP = "keep"  # freeze them; they go on after /resume


class Transfer(enum.Enum):
    """Where the weight-transfer group stands."""

    NONE = "none"  # no group: /init_weight_transfer_engine first
    READY = "ready"  # joined, no update open
    UPDATING = "updating"  # between /start_weight_update and /finish_weight_update


@attrs.frozen
class Conflict(CoreError):
    """A route called in a state that does not take it (409): the message names the
    state and what to call."""


# --- the requests ----------------------------------------------------------------------


@attrs.frozen
class Query:
    """A read-only route (world size, server info, pause, sleep and weight state)."""

    route: str


@attrs.frozen
class Pause:
    mode: PauseMode
    clear_cache: bool


@attrs.frozen
class Resume:
    pass


@attrs.frozen
class AbortRequests:
    request_ids: tuple[str, ...]  # empty: every request in flight


@attrs.frozen
class Sleep:
    level: int


@attrs.frozen
class WakeUp:
    tags: tuple[str, ...] | None


@attrs.frozen
class ResetPrefixCache:
    pass


@attrs.frozen
class InitTransfer:
    """vLLM's ``NCCLWeightTransferInitInfo`` (TCP rendezvous): the engine workers join
    as ranks ``rank_offset + worker rank`` of ``world_size``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    #: vLLM 0.32's wire for every update (``init_info.packed``; its engine's default is
    #: unpacked); an update that says its own (0.25) overrides it
    packed: bool = False

    def as_dict(self) -> dict[str, object]:
        """As vLLM's ``init_info`` (what a trainer sends, and what :func:`parse` reads)."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "packed": self.packed,
            "packed_buffer_size_bytes": self.buffer_bytes,
        }


@attrs.frozen
class StartUpdate:
    checkpoint_format: bool


@attrs.frozen
class Update:
    """One update: its tensors, in the order they are broadcast; the wire where the
    update says it (vLLM 0.25's ``packed`` and ``packed_buffer_size_bytes``; ``None``:
    as the init said)."""

    manifest: Manifest
    packed: bool | None = None
    buffer_bytes: int | None = None

    def as_vllm_info(self) -> dict[str, object]:
        """As vLLM's ``update_info`` (what a trainer sends, and what :func:`parse` reads)."""
        specs = self.manifest.specs
        wire = {"packed": self.packed, "packed_buffer_size_bytes": self.buffer_bytes}
        return {
            "names": [s.name for s in specs],
            "dtype_names": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs],
            **{k: v for k, v in wire.items() if v is not None},
        }


def broadcasts(init: InitTransfer, update: Update) -> tuple[tuple[TensorSpec, ...], ...]:
    """The tensors of each broadcast of ``update`` over the group ``init`` opened, as
    vLLM's producer sends them: packed (the update's own say where it has one, else the
    init's) into buffers of the update's or else the init's size; unpacked, one tensor
    each (an empty tensor too: vLLM broadcasts it)."""
    packed = init.packed if update.packed is None else update.packed
    if not packed:
        return tuple((spec,) for spec in update.manifest.specs)
    size = init.buffer_bytes if update.buffer_bytes is None else update.buffer_bytes
    return packed_groups(update.manifest, size)


@attrs.frozen
class FinishUpdate:
    weight_version: str | None


@attrs.frozen
class Generate:
    """A generation request (``/v1/completions``, ``/v1/chat/completions``): not a route
    of this plane, but one its state may refuse."""


Request = (
    Query
    | Pause
    | Resume
    | AbortRequests
    | Sleep
    | WakeUp
    | ResetPrefixCache
    | InitTransfer
    | StartUpdate
    | Update
    | FinishUpdate
    | Generate
)


def _bad(route: str, field: str | None, message: str) -> Failure[BadRequest]:
    where = f"{route}: {field}" if field else route
    return Failure(BadRequest(f"{where} {message}", status=400, param=field))


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _body(
    route: str, body: object, fields: frozenset[str]
) -> Result[dict[str, object], BadRequest]:
    if body is None:
        return Success({})
    if not isinstance(body, dict):
        return _bad(route, None, f"takes a JSON object body, got {type(body).__name__}")
    if unknown := sorted(str(k) for k in body if k not in fields):
        known = ", ".join(sorted(fields)) or "none"
        return _bad(route, unknown[0], f"is not a field of this route (fields: {known})")
    return Success(dict(body))


def _query_bool(route: str, name: str, raw: str | None, default: bool) -> bool | BadRequest:
    if raw is None:
        return default
    if raw.lower() in ("true", "1"):
        return True
    if raw.lower() in ("false", "0"):
        return False
    return BadRequest(f"{route}: {name} must be true or false, got {raw!r}", status=400, param=name)


def _pause(query: Mapping[str, str]) -> Result[Request, BadRequest]:
    if unknown := sorted(set(query) - {"mode", "clear_cache"}):
        return _bad("/pause", unknown[0], "is not a query parameter of /pause (mode, clear_cache)")
    raw = query.get("mode", "abort")
    try:
        mode = PauseMode(raw)
    except ValueError:
        return _bad("/pause", "mode", f"must be one of abort, wait, keep; got {raw!r}")
    clear = _query_bool("/pause", "clear_cache", query.get("clear_cache"), True)
    if isinstance(clear, BadRequest):
        return Failure(clear)
    return Success(Pause(mode, clear))


def _sleep(query: Mapping[str, str], body: dict[str, object]) -> Result[Request, BadRequest]:
    raw: object = body.get("level", query.get("level", 1))
    if isinstance(raw, str) and raw.isdigit():
        raw = int(raw)
    if not _int(raw) or raw not in (1, 2):
        return _bad("/sleep", "level", f"must be 1 or 2, got {raw!r}")
    assert isinstance(raw, int)
    return Success(Sleep(raw))


def _wake(query: Mapping[str, str], body: dict[str, object]) -> Result[Request, BadRequest]:
    raw: object = body.get("tags")
    if raw is None and "tags" in query:
        raw = [t for t in query["tags"].split(",") if t]
    if raw is None:
        return Success(WakeUp(None))
    if not isinstance(raw, list) or not all(t in ("weights", "kv_cache") for t in raw):
        return _bad("/wake_up", "tags", f"must be a list of 'weights' / 'kv_cache', got {raw!r}")
    return Success(WakeUp(tuple(str(t) for t in raw)))


def init_transfer(body: Mapping[str, object]) -> Result[InitTransfer, BadRequest]:
    """The ``init_info`` of an ``/init_weight_transfer_engine`` body, checked field by field
    (the server's route and the ``vllm_wire`` backend's ``init`` alike)."""
    route, info = "/init_weight_transfer_engine", body.get("init_info")
    if not isinstance(info, dict):
        return _bad(route, "init_info", f"must be an object, got {info!r}")
    allowed = {"master_address", "master_port", "rank_offset", "world_size", "packed"}
    allowed |= {"packed_buffer_size_bytes", "packed_num_buffers", "nccl_unique_id_b64"}
    if unknown := sorted(str(k) for k in info if k not in allowed):
        return _bad(route, f"init_info.{unknown[0]}", "is not a field of vLLM's init info")
    if info.get("nccl_unique_id_b64") is not None:
        return _bad(
            route,
            "init_info.nccl_unique_id_b64",
            "(the torch-free rendezvous) is not supported: give master_address and master_port",
        )
    address, port = info.get("master_address"), info.get("master_port")
    if not isinstance(address, str) or not address:
        return _bad(route, "init_info.master_address", f"must be a host name, got {address!r}")
    if not _int(port) or not 0 < port <= 65535:
        return _bad(route, "init_info.master_port", f"must be an int in [1, 65535], got {port!r}")
    offset, world = info.get("rank_offset"), info.get("world_size")
    if not _int(offset) or offset < 1:
        return _bad(
            route,
            "init_info.rank_offset",
            f"must be an int >= 1 (the trainer is rank 0), got {offset!r}",
        )
    if not _int(world) or world <= offset:
        return _bad(
            route, "init_info.world_size", f"must be an int > rank_offset ({offset}), got {world!r}"
        )
    wire = _wire(route, "init_info", info)
    if isinstance(wire, Failure):
        return wire
    packed, size = wire
    return Success(
        InitTransfer(
            address, port, offset, world, size or DEFAULT_BUFFER_BYTES, packed=bool(packed)
        )
    )


def _wire(
    route: str, field: str, info: Mapping[object, object]
) -> tuple[bool | None, int | None] | Failure[BadRequest]:
    """``packed`` and ``packed_buffer_size_bytes`` of an init or update info (``None``
    where absent), ``packed_num_buffers`` checked (the sender's number of streams: what
    is broadcast does not change with it)."""
    packed = info.get("packed")
    if packed is not None and not isinstance(packed, bool):
        return _bad(route, f"{field}.packed", f"must be a bool, got {packed!r}")
    for key in ("packed_buffer_size_bytes", "packed_num_buffers"):
        value = info.get(key)
        if value is not None and (not _int(value) or value < 1):
            return _bad(route, f"{field}.{key}", f"must be a positive int, got {value!r}")
    size = info.get("packed_buffer_size_bytes")
    return packed, size if _int(size) else None


def _start(body: dict[str, object]) -> Result[Request, BadRequest]:
    raw = body.get("is_checkpoint_format", True)
    if not isinstance(raw, bool):
        return _bad("/start_weight_update", "is_checkpoint_format", f"must be a bool, got {raw!r}")
    return Success(StartUpdate(raw))


def update_of(body: Mapping[str, object]) -> Result[Update, BadRequest]:
    """The ``update_info`` of an ``/update_weights`` body as the update it announces."""
    route, info = "/update_weights", body.get("update_info")
    if not isinstance(info, dict):
        return _bad(route, "update_info", f"must be an object, got {info!r}")
    allowed = {"names", "dtype_names", "shapes", "packed", "is_checkpoint_format"}
    allowed |= {"packed_buffer_size_bytes", "packed_num_buffers"}
    if unknown := sorted(str(k) for k in info if k not in allowed):
        return _bad(route, f"update_info.{unknown[0]}", "is not a field of vLLM's update info")
    wire = _wire(route, "update_info", info)
    if isinstance(wire, Failure):
        return wire
    columns: dict[str, list[object]] = {}
    for key in ("names", "dtype_names", "shapes"):
        value = info.get(key)
        if not isinstance(value, list) or not value:
            return _bad(route, f"update_info.{key}", f"must be a non-empty list, got {value!r}")
        columns[key] = value
    lengths = {k: len(v) for k, v in columns.items()}
    if len(set(lengths.values())) != 1:
        return _bad(
            route, "update_info", f"names, dtype_names and shapes differ in length: {lengths}"
        )
    specs: list[TensorSpec] = []
    for i, (name, dtype, shape) in enumerate(zip(*columns.values(), strict=True)):
        if not isinstance(name, str) or not name:
            return _bad(route, f"update_info.names[{i}]", f"must be a non-empty str, got {name!r}")
        if not isinstance(dtype, str) or dtype.removeprefix("torch.") not in DTYPE_ITEMSIZE:
            known = ", ".join(DTYPE_ITEMSIZE)
            return _bad(
                route, f"update_info.dtype_names[{i}]", f"must be one of {known}; got {dtype!r}"
            )
        if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
            return _bad(
                route, f"update_info.shapes[{i}]", f"must be a list of ints >= 0, got {shape!r}"
            )
        specs.append(TensorSpec(name, tuple(shape), dtype.removeprefix("torch.")))
    manifest = Manifest.from_specs(specs)
    if isinstance(manifest, Failure):
        return _bad(route, "update_info.names", str(manifest.failure()))
    return Success(Update(manifest.unwrap(), *wire))


def _finish(body: dict[str, object]) -> Result[Request, BadRequest]:
    raw = body.get("weight_version")
    if raw is not None and (not isinstance(raw, str | int) or isinstance(raw, bool)):
        return _bad("/finish_weight_update", "weight_version", f"must be a str, got {raw!r}")
    return Success(FinishUpdate(None if raw is None else str(raw)))


def _abort(body: dict[str, object]) -> Result[Request, BadRequest]:
    ids = body.get("request_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return _bad("/abort_requests", "request_ids", f"must be a list of str, got {ids!r}")
    return Success(AbortRequests(tuple(ids)))


_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    "sleep": frozenset({"level"}),
    "wake_up": frozenset({"tags"}),
    "abort_requests": frozenset({"request_ids"}),
    "init_weight_transfer_engine": frozenset({"init_info"}),
    "start_weight_update": frozenset({"is_checkpoint_format"}),
    "update_weights": frozenset({"update_info"}),
    "finish_weight_update": frozenset({"weight_version"}),
}


def parse(route: str, query: Mapping[str, str], body: object) -> Result[Request, BadRequest]:
    """The request of route ``route`` (a value of :data:`ROUTES`) from its query
    parameters and JSON body (``None``: no body), or a 400 naming the field."""
    if route in ("get_world_size", "server_info", "is_paused", "is_sleeping", "weight_info"):
        return Success(Query(route))
    if route == "pause":
        return _pause(query)
    parsed = _body("/" + route, body, _FIELDS.get(route, frozenset()))
    if isinstance(parsed, Failure):
        return parsed
    fields = parsed.unwrap()
    match route:
        case "resume":
            return Success(Resume())
        case "reset_prefix_cache":
            return Success(ResetPrefixCache())
        case "abort_requests":
            return _abort(fields)
        case "sleep":
            return _sleep(query, fields)
        case "wake_up":
            return _wake(query, fields)
        case "init_weight_transfer_engine":
            return init_transfer(fields)
        case "start_weight_update":
            return _start(fields)
        case "update_weights":
            return update_of(fields)
        case "finish_weight_update":
            return _finish(fields)
    return _bad("/" + route, None, "is not a route of the control plane")


def parse_raw(route: str, query: Mapping[str, str], raw: bytes) -> Result[Request, BadRequest]:
    """:func:`parse` of a raw body (blank: no body), or a 400 when it is not JSON."""
    try:
        body: object = json.loads(raw) if raw.strip() else None
    except ValueError as e:  # UnicodeDecodeError included
        return Failure(BadRequest(f"/{route}: the body is not JSON ({e})", status=400, param=None))
    return parse(route, query, body)


# --- the machine -----------------------------------------------------------------------


@attrs.frozen
class ControlState:
    """The plane's state: the trainer's pause, the transfer group, the last update's
    failure (generation refused until an update lands) and the trainer's label."""

    paused: PauseMode | None = None
    transfer: Transfer = Transfer.NONE
    failed: str | None = None
    label: str | None = None

    def describe(self) -> str:
        parts = [f"paused (mode {self.paused.value})" if self.paused else "not paused"]
        parts.append(f"weight transfer {self.transfer.value}")
        if self.failed:
            parts.append(f"the last weight update failed ({self.failed})")
        return ", ".join(parts)


def _conflict(state: ControlState, problem: str, call: str) -> Failure[Conflict]:
    return Failure(Conflict(f"{problem} (state: {state.describe()}); {call}"))


#: Why a transfer state refuses a request, and what to call first.
_WHY: Final[Mapping[Transfer, tuple[str, str]]] = {
    Transfer.NONE: ("no weight-transfer group", "POST /init_weight_transfer_engine first"),
    Transfer.READY: ("no weight update is open", "POST /start_weight_update first"),
    Transfer.UPDATING: ("a weight update is open", "POST /finish_weight_update first"),
}
#: The transfer states each request is refused in (the rest take it).
_REFUSED_IN: Final[Mapping[type, frozenset[Transfer]]] = {
    Sleep: frozenset({Transfer.UPDATING}),
    WakeUp: frozenset({Transfer.UPDATING}),
    InitTransfer: frozenset({Transfer.UPDATING}),
    StartUpdate: frozenset({Transfer.NONE, Transfer.UPDATING}),
    Update: frozenset({Transfer.NONE, Transfer.READY}),
    FinishUpdate: frozenset({Transfer.NONE, Transfer.READY}),
}


def step(state: ControlState, request: Request) -> Result[ControlState, Conflict]:
    """``state`` after ``request``, or why it is refused now (409). An update's outcome
    comes later, from :func:`updated` or :func:`update_failed`."""
    if state.transfer in _REFUSED_IN.get(type(request), frozenset()):
        return _conflict(state, *_WHY[state.transfer])
    match request:
        case Generate():
            if state.paused is PauseMode.ABORT:
                return _conflict(state, "generation is paused", "POST /resume first")
            if state.failed is not None:
                return _conflict(
                    state,
                    "the weights are inconsistent after a failed update",
                    "send a good update: POST /start_weight_update, /update_weights, /finish_weight_update",
                )
        case Pause(mode=mode):
            if state.paused is not None and state.paused is not mode:
                return _conflict(
                    state, f"already paused in mode {state.paused.value}", "POST /resume first"
                )
            return Success(attrs.evolve(state, paused=mode))
        case Resume():
            return Success(attrs.evolve(state, paused=None))
        case InitTransfer():
            return Success(attrs.evolve(state, transfer=Transfer.READY))
        case StartUpdate():
            return Success(attrs.evolve(state, transfer=Transfer.UPDATING))
        case FinishUpdate(weight_version=label):
            kept = state.label if label is None or state.failed else label
            return Success(attrs.evolve(state, transfer=Transfer.READY, label=kept))
    return Success(state)


def admit(state: ControlState, request: Request) -> Result[ControlState, BadRequest]:
    """:func:`step` as a route answers it: its conflict is a 409."""
    return step(state, request).alt(lambda e: BadRequest(str(e), status=409, param=None))


def updated(state: ControlState) -> ControlState:
    """An update landed: the weights are consistent again."""
    return attrs.evolve(state, failed=None)


def update_failed(state: ControlState, reason: str, *, group_broken: bool) -> ControlState:
    """An update failed: generation refused until one lands; a broken group must be
    joined again (the open update closes with it)."""
    transfer = Transfer.NONE if group_broken else state.transfer
    return attrs.evolve(state, failed=reason, transfer=transfer)


# --- the answers -----------------------------------------------------------------------


def answer(
    request: Request, state: ControlState, outcome: object, weight_version: int
) -> dict[str, object]:
    """The body vLLM's route answers ``request`` with once the worker did its part:
    ``outcome`` is what that part found (the world size, whether any memory sleeps, the
    config tree, the requests aborted, an init's ranks; else ``None``), ``state`` the
    plane's as the request came and ``weight_version`` the worker's after its part."""
    match request:
        case Query(route="get_world_size"):
            return {"world_size": outcome}
        case Query(route="is_paused"):
            return {"is_paused": state.paused is not None}
        case Query(route="is_sleeping"):
            return {"is_sleeping": outcome}
        case Query(route="weight_info"):
            return {
                "weight_version": state.label or str(weight_version),
                "genworker_weight_version": weight_version,
            }
        case Query():
            return {"vllm_config": outcome}
        case Pause():
            return {"status": "paused"}
        case Resume():
            return {"status": "resumed"}
        case AbortRequests():
            return {"status": "aborted", "aborted": outcome}
        case Sleep(level=level):
            return {"status": "sleeping", "level": level}
        case WakeUp():
            return {"status": "awake"}
        case ResetPrefixCache():
            return {"success": True}
        case InitTransfer():
            return {"message": "Weight transfer initialized", "ranks": outcome}
        case StartUpdate():
            return {"message": "Weight update started"}
        case Update():
            return {"message": "Weights updated", "weight_version": weight_version}
        case FinishUpdate():
            return {"message": "Weight update finished", "weight_version": weight_version}
    raise ValueError(f"{request!r} is not a route of the control plane")
