"""The worker lifecycle as a table: states, events, and the allowed transitions.

Theory of operation
-------------------
A :class:`State` is a phase (not loaded, running, refitting, shut down), which of vLLM's
two sleep-mode memory tags is resident (``weights``, ``kv_cache``), whether the weights
in that memory are the ones the trainer last sent (:class:`WeightsStatus`), and whether
requests are in flight (``streaming``: the async worker's streams; the sync worker never
has any). The named states of the design are points of that product: *awake* (both tags
resident, weights valid), *weights-only awake*, *asleep (level 1)* (nothing resident,
weights valid in host memory), *asleep (level 2)* (nothing resident, weights discarded),
*refitting*, *weights inconsistent*, *not loaded*, *shut down*, and the in-flight states
*streaming*, *refitting while streaming* and *streaming on inconsistent weights*.

:data:`TABLE` is written out below, state by state: every allowed event and the state it
leads to. A pair missing from it is refused by :func:`transition` with a
:class:`LifecycleError` that names the state, the event and what to do (:func:`_refusal`).
The rules the table follows, and the vLLM 0.32 behaviour they mirror:

- ``LOAD`` only from not loaded; it leaves the worker awake with valid weights.
- ``GENERATE`` only while running with both tags resident and valid weights; it changes
  nothing. Generating on a partly-awake engine is an illegal memory access that kills it
  (S3 in failure-modes.md); on level-2-discarded weights it is plausible garbage (S5).
- ``SLEEP_L1`` / ``SLEEP_L2`` from a state whose weights are resident put both tags to
  sleep; level 1 keeps the weights (offloaded to host memory), level 2 discards them.
  Sleeping while the weights are already asleep is a no-op at either level, because vLLM's
  ``Executor.sleep`` (``vllm/v1/executor/abstract.py``) returns early when the ``weights``
  tag is asleep: a level-2 sleep after a level-1 sleep keeps the host copy (weights stay
  valid), and a level-1 sleep after a level-2 sleep keeps level 2 (weights stay discarded).
  For the same reason sleeping while only the KV cache is resident is refused: vLLM would
  leave the KV cache resident.
- ``WAKE_WEIGHTS`` / ``WAKE_KV_CACHE`` / ``WAKE_ALL`` make their tags resident; waking a
  resident tag is a no-op (S7). vLLM's ``Executor.wake_up`` drops the WHOLE call when one
  named tag is already awake (vllm#31618), so the shell passes only :func:`wake_tags`.
  Waking never repairs weights: after a level-2 sleep they stay discarded until a refit.
- ``REFIT_BEGIN`` needs the weights resident (awake or weights-only awake; the KV cache may
  sleep, which is how colocated training refits). While refitting the weights are
  inconsistent and only ``REFIT_OK`` (weights valid), ``REFIT_FAILED`` (weights
  inconsistent until a later refit succeeds) and ``SHUTDOWN`` are allowed, and, with
  both tags resident, ``STREAM_OPEN`` (below).
- ``RESET_PREFIX_CACHE`` is allowed whenever running without streams, and changes nothing
  here.
- In flight (the async worker over ``AsyncLLM``). ``STREAM_OPEN`` (requests submitted) is
  allowed wherever ``GENERATE`` is, and during a refit with both tags resident: the async
  worker pauses the engine for every refit (``AsyncLLM.pause_generation``), and vLLM
  queues requests added while paused (``EngineCoreProc.pause_scheduler``,
  ``vllm/v1/engine/core.py``), so they run on the new weights after resume (or are
  aborted if the refit fails). ``STREAMS_DONE`` (the last open stream ended) leaves the
  in-flight states. ``REFIT_BEGIN`` is allowed while streaming: that is the in-flight
  refit; its outcome keeps the streams (``REFIT_FAILED`` leaves them on inconsistent
  weights, which the shell aborts). While streaming, sleeping is refused (vLLM's
  ``sleep`` would abort or freeze the requests under the trainer's feet) and so is
  ``RESET_PREFIX_CACHE`` (vLLM keeps the prefix cache while requests run).
- ``SHUTDOWN`` from any state leads to shut down, and is idempotent; every other event
  after it is refused.

Apart from the table, :class:`CacheLedger` says when the engine's caches (prefix, processed
media, encoder outputs) are known to be empty, so a refit or a sleep may skip resetting
them (vLLM's prefix-cache reset walks every KV block: about 1 ms at 8B on the H200). Only
requests fill them, and only ``GENERATE`` and ``STREAM_OPEN`` run requests
(:data:`FILLS_CACHES`); the shell also passes the engine's own count of requests submitted
(``vllm.LLM.request_counter``), so a request run past the worker (on ``worker.llm``)
counts too.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "ALL_STATES",
    "ASLEEP_INCONSISTENT",
    "ASLEEP_L1",
    "ASLEEP_L2",
    "AWAKE",
    "AWAKE_DISCARDED",
    "AWAKE_INCONSISTENT",
    "FILLS_CACHES",
    "KV_CACHE_TAG",
    "KV_ONLY",
    "KV_ONLY_DISCARDED",
    "KV_ONLY_INCONSISTENT",
    "NOT_LOADED",
    "REFITTING",
    "REFITTING_STREAMING",
    "REFITTING_WEIGHTS_ONLY",
    "SHUT_DOWN",
    "STREAMING",
    "STREAMING_INCONSISTENT",
    "TABLE",
    "TRANSITIONS",
    "WEIGHTS_ONLY",
    "WEIGHTS_ONLY_DISCARDED",
    "WEIGHTS_ONLY_INCONSISTENT",
    "WEIGHTS_TAG",
    "CacheLedger",
    "CallError",
    "Event",
    "InflightMode",
    "LifecycleError",
    "Phase",
    "State",
    "WeightsStatus",
    "allowed_events",
    "busy_wait",
    "check_can_generate",
    "pause_args",
    "sleep_event",
    "transition",
    "wake_event",
    "wake_incomplete",
    "wake_tags",
]

WEIGHTS_TAG = "weights"
KV_CACHE_TAG = "kv_cache"


class Phase(enum.Enum):
    """Where the worker is in its life."""

    NOT_LOADED = "not loaded"
    RUNNING = "running"
    REFITTING = "refitting"
    SHUT_DOWN = "shut down"


class WeightsStatus(enum.Enum):
    """Whether the weights in the engine are the ones last loaded or refit."""

    VALID = "valid"
    DISCARDED = "discarded"
    INCONSISTENT = "inconsistent"


class Event(enum.Enum):
    """What the shell is about to do (or has just seen happen); the value reads in errors."""

    LOAD = "load the model"
    GENERATE = "generate"
    STREAM_OPEN = "start generating"
    STREAMS_DONE = "end the last stream"
    SLEEP_L1 = "sleep (level 1)"
    SLEEP_L2 = "sleep (level 2)"
    WAKE_WEIGHTS = "wake_up(tags=['weights'])"
    WAKE_KV_CACHE = "wake_up(tags=['kv_cache'])"
    WAKE_ALL = "wake_up()"
    REFIT_BEGIN = "refit"
    REFIT_OK = "finish a refit"
    REFIT_FAILED = "fail a refit"
    RESET_PREFIX_CACHE = "reset_prefix_cache()"
    SHUTDOWN = "shutdown()"


class InflightMode(enum.Enum):
    """What requests in flight do during an in-flight refit: vLLM's ``pause_generation``
    modes (``AsyncLLM.pause_generation``, ``vllm/v1/engine/async_llm.py``)."""

    KEEP = "keep"  # frozen while the weights change, then continue on the new weights
    WAIT = "wait"  # finish on the old weights before the refit starts
    ABORT = "abort"  # dropped when the refit starts


def _check_state(state: State) -> None:
    if state.phase in (Phase.NOT_LOADED, Phase.SHUT_DOWN):
        if (
            state.weights_awake
            or state.kv_cache_awake
            or state.streaming
            or state.weights is not WeightsStatus.DISCARDED
        ):
            raise ValueError(f"a {state.phase.value} state holds no memory, weights or streams")
    elif state.phase is Phase.REFITTING and (
        not state.weights_awake or state.weights is not WeightsStatus.INCONSISTENT
    ):
        raise ValueError("a refitting state has resident, inconsistent weights")
    if state.streaming and (
        not (state.weights_awake and state.kv_cache_awake)
        or state.weights is WeightsStatus.DISCARDED
    ):
        raise ValueError("a streaming state has both tags resident and weights not discarded")


@attrs.frozen
class State:
    """Phase, which memory tags are resident, whether the weights are valid, and whether
    requests are in flight."""

    phase: Phase
    weights: WeightsStatus
    weights_awake: bool
    kv_cache_awake: bool
    streaming: bool = False

    def __attrs_post_init__(self) -> None:
        _check_state(self)

    @property
    def sleep_level(self) -> int:
        """The effective sleep level: 0 with any tag resident, else 2 if weights discarded."""
        if self.weights_awake or self.kv_cache_awake:
            return 0
        return 2 if self.weights is WeightsStatus.DISCARDED else 1

    def __str__(self) -> str:
        memory = {
            (True, True): "awake",
            (True, False): "weights-only awake",
            (False, True): "KV-cache-only awake",
        }.get((self.weights_awake, self.kv_cache_awake), f"asleep (level {self.sleep_level})")
        streams = ", streaming" if self.streaming else ""
        if self.phase is Phase.REFITTING:
            return f"refitting ({memory}{streams})"
        if self.phase is not Phase.RUNNING:
            return str(self.phase.value)
        if self.weights is WeightsStatus.INCONSISTENT:
            return f"{memory}, weights inconsistent{streams}"
        if self.weights is WeightsStatus.DISCARDED and self.sleep_level == 0:
            return f"{memory}, weights discarded"
        return memory + streams


_R, _F = Phase.RUNNING, Phase.REFITTING
_VALID, _DISCARDED, _INCONSISTENT = WeightsStatus
NOT_LOADED = State(Phase.NOT_LOADED, _DISCARDED, False, False)
AWAKE = State(_R, _VALID, True, True)
WEIGHTS_ONLY = State(_R, _VALID, True, False)
KV_ONLY = State(_R, _VALID, False, True)
ASLEEP_L1 = State(_R, _VALID, False, False)
AWAKE_DISCARDED = State(_R, _DISCARDED, True, True)
WEIGHTS_ONLY_DISCARDED = State(_R, _DISCARDED, True, False)
KV_ONLY_DISCARDED = State(_R, _DISCARDED, False, True)
ASLEEP_L2 = State(_R, _DISCARDED, False, False)
AWAKE_INCONSISTENT = State(_R, _INCONSISTENT, True, True)
WEIGHTS_ONLY_INCONSISTENT = State(_R, _INCONSISTENT, True, False)
KV_ONLY_INCONSISTENT = State(_R, _INCONSISTENT, False, True)
ASLEEP_INCONSISTENT = State(_R, _INCONSISTENT, False, False)
REFITTING = State(_F, _INCONSISTENT, True, True)
REFITTING_WEIGHTS_ONLY = State(_F, _INCONSISTENT, True, False)
STREAMING = State(_R, _VALID, True, True, streaming=True)
STREAMING_INCONSISTENT = State(_R, _INCONSISTENT, True, True, streaming=True)
REFITTING_STREAMING = State(_F, _INCONSISTENT, True, True, streaming=True)
SHUT_DOWN = State(Phase.SHUT_DOWN, _DISCARDED, False, False)

_E = Event
_OFF = {_E.SHUTDOWN: SHUT_DOWN}

# fmt: off
TABLE: Mapping[State, Mapping[Event, State]] = MappingProxyType({
    NOT_LOADED: {_E.LOAD: AWAKE, **_OFF},

    # -- weights valid ---------------------------------------------------------------
    AWAKE: {
        _E.GENERATE: AWAKE, _E.STREAM_OPEN: STREAMING,
        _E.SLEEP_L1: ASLEEP_L1, _E.SLEEP_L2: ASLEEP_L2,
        _E.WAKE_WEIGHTS: AWAKE, _E.WAKE_KV_CACHE: AWAKE, _E.WAKE_ALL: AWAKE,
        _E.REFIT_BEGIN: REFITTING, _E.RESET_PREFIX_CACHE: AWAKE, **_OFF,
    },
    WEIGHTS_ONLY: {
        _E.SLEEP_L1: ASLEEP_L1, _E.SLEEP_L2: ASLEEP_L2,
        _E.WAKE_WEIGHTS: WEIGHTS_ONLY, _E.WAKE_KV_CACHE: AWAKE, _E.WAKE_ALL: AWAKE,
        _E.REFIT_BEGIN: REFITTING_WEIGHTS_ONLY, _E.RESET_PREFIX_CACHE: WEIGHTS_ONLY, **_OFF,
    },
    KV_ONLY: {
        _E.WAKE_WEIGHTS: AWAKE, _E.WAKE_KV_CACHE: KV_ONLY, _E.WAKE_ALL: AWAKE,
        _E.RESET_PREFIX_CACHE: KV_ONLY, **_OFF,
    },
    ASLEEP_L1: {
        _E.SLEEP_L1: ASLEEP_L1, _E.SLEEP_L2: ASLEEP_L1,
        _E.WAKE_WEIGHTS: WEIGHTS_ONLY, _E.WAKE_KV_CACHE: KV_ONLY, _E.WAKE_ALL: AWAKE,
        _E.RESET_PREFIX_CACHE: ASLEEP_L1, **_OFF,
    },

    # -- weights discarded by a level-2 sleep ------------------------------------------
    AWAKE_DISCARDED: {
        _E.SLEEP_L1: ASLEEP_L2, _E.SLEEP_L2: ASLEEP_L2,
        _E.WAKE_WEIGHTS: AWAKE_DISCARDED, _E.WAKE_KV_CACHE: AWAKE_DISCARDED,
        _E.WAKE_ALL: AWAKE_DISCARDED,
        _E.REFIT_BEGIN: REFITTING, _E.RESET_PREFIX_CACHE: AWAKE_DISCARDED, **_OFF,
    },
    WEIGHTS_ONLY_DISCARDED: {
        _E.SLEEP_L1: ASLEEP_L2, _E.SLEEP_L2: ASLEEP_L2,
        _E.WAKE_WEIGHTS: WEIGHTS_ONLY_DISCARDED, _E.WAKE_KV_CACHE: AWAKE_DISCARDED,
        _E.WAKE_ALL: AWAKE_DISCARDED,
        _E.REFIT_BEGIN: REFITTING_WEIGHTS_ONLY,
        _E.RESET_PREFIX_CACHE: WEIGHTS_ONLY_DISCARDED, **_OFF,
    },
    KV_ONLY_DISCARDED: {
        _E.WAKE_WEIGHTS: AWAKE_DISCARDED, _E.WAKE_KV_CACHE: KV_ONLY_DISCARDED,
        _E.WAKE_ALL: AWAKE_DISCARDED,
        _E.RESET_PREFIX_CACHE: KV_ONLY_DISCARDED, **_OFF,
    },
    ASLEEP_L2: {
        _E.SLEEP_L1: ASLEEP_L2, _E.SLEEP_L2: ASLEEP_L2,
        _E.WAKE_WEIGHTS: WEIGHTS_ONLY_DISCARDED, _E.WAKE_KV_CACHE: KV_ONLY_DISCARDED,
        _E.WAKE_ALL: AWAKE_DISCARDED,
        _E.RESET_PREFIX_CACHE: ASLEEP_L2, **_OFF,
    },

    # -- weights inconsistent after a failed refit --------------------------------------
    AWAKE_INCONSISTENT: {
        _E.SLEEP_L1: ASLEEP_INCONSISTENT, _E.SLEEP_L2: ASLEEP_L2,
        _E.WAKE_WEIGHTS: AWAKE_INCONSISTENT, _E.WAKE_KV_CACHE: AWAKE_INCONSISTENT,
        _E.WAKE_ALL: AWAKE_INCONSISTENT,
        _E.REFIT_BEGIN: REFITTING, _E.RESET_PREFIX_CACHE: AWAKE_INCONSISTENT, **_OFF,
    },
    WEIGHTS_ONLY_INCONSISTENT: {
        _E.SLEEP_L1: ASLEEP_INCONSISTENT, _E.SLEEP_L2: ASLEEP_L2,
        _E.WAKE_WEIGHTS: WEIGHTS_ONLY_INCONSISTENT, _E.WAKE_KV_CACHE: AWAKE_INCONSISTENT,
        _E.WAKE_ALL: AWAKE_INCONSISTENT,
        _E.REFIT_BEGIN: REFITTING_WEIGHTS_ONLY,
        _E.RESET_PREFIX_CACHE: WEIGHTS_ONLY_INCONSISTENT, **_OFF,
    },
    KV_ONLY_INCONSISTENT: {
        _E.WAKE_WEIGHTS: AWAKE_INCONSISTENT, _E.WAKE_KV_CACHE: KV_ONLY_INCONSISTENT,
        _E.WAKE_ALL: AWAKE_INCONSISTENT,
        _E.RESET_PREFIX_CACHE: KV_ONLY_INCONSISTENT, **_OFF,
    },
    ASLEEP_INCONSISTENT: {
        _E.SLEEP_L1: ASLEEP_INCONSISTENT, _E.SLEEP_L2: ASLEEP_INCONSISTENT,
        _E.WAKE_WEIGHTS: WEIGHTS_ONLY_INCONSISTENT, _E.WAKE_KV_CACHE: KV_ONLY_INCONSISTENT,
        _E.WAKE_ALL: AWAKE_INCONSISTENT,
        _E.RESET_PREFIX_CACHE: ASLEEP_INCONSISTENT, **_OFF,
    },

    # -- refitting --------------------------------------------------------------------
    REFITTING: {
        _E.REFIT_OK: AWAKE, _E.REFIT_FAILED: AWAKE_INCONSISTENT,
        _E.STREAM_OPEN: REFITTING_STREAMING, **_OFF,
    },
    REFITTING_WEIGHTS_ONLY: {
        _E.REFIT_OK: WEIGHTS_ONLY, _E.REFIT_FAILED: WEIGHTS_ONLY_INCONSISTENT, **_OFF,
    },

    # -- in flight (the async worker) --------------------------------------------------
    STREAMING: {
        _E.GENERATE: STREAMING, _E.STREAM_OPEN: STREAMING, _E.STREAMS_DONE: AWAKE,
        _E.WAKE_WEIGHTS: STREAMING, _E.WAKE_KV_CACHE: STREAMING, _E.WAKE_ALL: STREAMING,
        _E.REFIT_BEGIN: REFITTING_STREAMING, **_OFF,
    },
    REFITTING_STREAMING: {
        _E.REFIT_OK: STREAMING, _E.REFIT_FAILED: STREAMING_INCONSISTENT,
        _E.STREAM_OPEN: REFITTING_STREAMING, _E.STREAMS_DONE: REFITTING, **_OFF,
    },
    STREAMING_INCONSISTENT: {
        _E.STREAMS_DONE: AWAKE_INCONSISTENT,
        _E.WAKE_WEIGHTS: STREAMING_INCONSISTENT, _E.WAKE_KV_CACHE: STREAMING_INCONSISTENT,
        _E.WAKE_ALL: STREAMING_INCONSISTENT,
        _E.REFIT_BEGIN: REFITTING_STREAMING, **_OFF,
    },

    SHUT_DOWN: {**_OFF},
})
# fmt: on
"""Every state, and the events it allows with the state each leads to."""

ALL_STATES: tuple[State, ...] = tuple(TABLE)
"""Every valid state (19): the rows of the table."""

TRANSITIONS: Mapping[tuple[State, Event], State] = MappingProxyType(
    {(state, event): after for state, row in TABLE.items() for event, after in row.items()}
)
"""Every allowed (state, event) pair and the state it leads to; the rest are refused."""


@attrs.frozen
class LifecycleError(CoreError):
    """An operation the worker's current state does not allow; ``message`` says what to do."""

    state: State
    event: Event


_WAKE = {
    Event.WAKE_WEIGHTS: (WEIGHTS_TAG,),
    Event.WAKE_KV_CACHE: (KV_CACHE_TAG,),
    Event.WAKE_ALL: (WEIGHTS_TAG, KV_CACHE_TAG),
}

_STREAMS_RUN = "requests are in flight; wait for their streams to end or cancel them first"


def _generate_refusal(state: State) -> str:
    """Why a running state cannot generate (the table refuses it)."""
    awake = state.weights_awake and state.kv_cache_awake
    if state.weights is WeightsStatus.DISCARDED:
        why = "weights were discarded by a level-2 sleep; refit before generating"
        then = ", then refit (weights were discarded by a level-2 sleep)"
    elif state.weights is WeightsStatus.INCONSISTENT:
        why = "a refit failed: weights are inconsistent; refit again"
        then = ", then refit again (a refit failed: weights are inconsistent)"
    else:
        why = then = ""
    if awake:
        return why
    wake = {
        (True, False): "call wake_up(tags=['kv_cache']) first",
        (False, True): "call wake_up(tags=['weights']) first",
    }.get((state.weights_awake, state.kv_cache_awake), "call wake_up() first")
    return wake + then


def _refusal(state: State, event: Event) -> str:
    """Why the table refuses ``event`` in ``state``: the remedy, for the error message."""
    if state.phase is Phase.SHUT_DOWN:
        return "the worker is shut down; create a new worker"
    if state.phase is Phase.NOT_LOADED:
        return "the model is not loaded; load it first"
    if event is Event.LOAD:
        return "the model is already loaded; shut down and create a new worker to load another"
    if event is Event.STREAMS_DONE:
        return "no stream is open"
    if state.phase is Phase.REFITTING:
        if event is Event.STREAM_OPEN:
            return (
                "a weight refit is in progress with the KV cache asleep; wait for it, then "
                "call wake_up(tags=['kv_cache'])"
            )
        return "a weight refit is in progress; wait for it to succeed or fail"
    if event in (Event.GENERATE, Event.STREAM_OPEN):
        return _generate_refusal(state)
    if state.streaming:
        if event is Event.RESET_PREFIX_CACHE:
            return f"{_STREAMS_RUN} (vLLM keeps the prefix cache while requests run)"
        return _STREAMS_RUN
    if event in (Event.SLEEP_L1, Event.SLEEP_L2):
        return (
            "vLLM ignores sleep while the weights are asleep, so the KV cache would stay "
            "resident; call wake_up() first"
        )
    if event is Event.REFIT_BEGIN:
        return "the weights are asleep; call wake_up(tags=['weights']) first"
    assert event in (Event.REFIT_OK, Event.REFIT_FAILED), (state, event)
    return "no refit is in progress"


def transition(state: State, event: Event) -> Result[State, LifecycleError]:
    """The state after ``event``, or why ``event`` is not allowed in ``state``."""
    after = TABLE[state].get(event)
    if after is not None:
        return Success(after)
    return Failure(
        LifecycleError(
            message=f"cannot {event.value} while {state}: {_refusal(state, event)}",
            state=state,
            event=event,
        )
    )


def check_can_generate(state: State) -> Result[State, LifecycleError]:
    """``Success(state)`` if the worker may generate now, else why not and what to do."""
    return transition(state, Event.GENERATE)


def allowed_events(state: State) -> frozenset[Event]:
    """The events :data:`TABLE` allows in ``state``."""
    return frozenset(TABLE[state])


def wake_tags(state: State, event: Event) -> tuple[str, ...]:
    """The tags the shell passes to vLLM's ``wake_up`` for ``event``: only asleep ones.

    Empty means "do not call ``wake_up``" (nothing to wake, or not a wake event). vLLM 0.32
    ignores a whole ``wake_up(tags)`` call when one of the tags is already awake.
    """
    resident = {WEIGHTS_TAG: state.weights_awake, KV_CACHE_TAG: state.kv_cache_awake}
    return tuple(t for t in _WAKE.get(event, ()) if not resident[t])


#: The events that run requests on the engine, and so may fill its caches.
FILLS_CACHES: frozenset[Event] = frozenset({Event.GENERATE, Event.STREAM_OPEN})


@attrs.frozen
class CacheLedger:
    """Whether the engine's caches are known empty: ``clean`` while no event of
    :data:`FILLS_CACHES` came since the shell last reset them all, when the engine had
    submitted ``requests`` requests (``None``: an engine that counts none)."""

    clean: bool = False
    requests: int | None = None

    def after(self, event: Event) -> CacheLedger:
        """The ledger once ``event`` happened (or was about to: dirty early is safe)."""
        return CacheLedger(False) if event in FILLS_CACHES else self

    def reset(self, requests: int | None) -> CacheLedger:
        """Every cache was reset, the engine having submitted ``requests`` requests."""
        return CacheLedger(True, requests)

    def needs_reset(self, requests: int | None) -> bool:
        """Whether the caches may hold entries, the engine now counting ``requests``."""
        return not (self.clean and requests == self.requests)


@attrs.frozen
class CallError(CoreError):
    """An argument of a lifecycle call (``sleep``'s level, ``wake_up``'s tags, a pause's
    mode and ``clear_cache``) that it does not take; the message names the value."""


_WAKE_EVENTS = {
    frozenset({WEIGHTS_TAG}): Event.WAKE_WEIGHTS,
    frozenset({KV_CACHE_TAG}): Event.WAKE_KV_CACHE,
    frozenset({WEIGHTS_TAG, KV_CACHE_TAG}): Event.WAKE_ALL,
}


def wake_event(tags: object) -> Result[Event, CallError]:
    """The event of ``wake_up(tags)`` (None: both tags), or why ``tags`` are not a
    non-empty subset of ``weights`` and ``kv_cache``."""
    if tags is not None and (
        isinstance(tags, str)
        or not isinstance(tags, Iterable)
        or not all(isinstance(t, str) for t in tags)
    ):
        return Failure(CallError(f"wake_up tags must be a list of str or None, got {tags!r}"))
    wanted = frozenset(tags) if tags is not None else frozenset({WEIGHTS_TAG, KV_CACHE_TAG})
    event = _WAKE_EVENTS.get(wanted)
    if event is None:
        return Failure(
            CallError(
                f"wake_up tags must be a non-empty subset of ['kv_cache', 'weights'], got {tags!r}"
            )
        )
    return Success(event)


def wake_incomplete(call: str, fully_awake: object, after: State) -> str | None:
    """Why the engine is dead after the wake ``call``: it answered it is not fully awake
    (``fully_awake`` False), though every tag of the state ``after`` it is resident; vLLM
    resumes scheduling only once it is, so every request would wait. None otherwise."""
    if fully_awake is not False or not (after.weights_awake and after.kv_cache_awake):
        return None
    return (
        f"{call}: the engine is not fully awake after it, though every tag should "
        "be resident; vLLM resumes scheduling only once it is (EngineCore.wake_up, "
        "vllm/v1/engine/core.py, 0.32), so every request would wait: the engine "
        "is dead"
    )


def sleep_event(level: object) -> Result[Event, CallError]:
    """The event of ``sleep(level)``, or why ``level`` is not 1 or 2."""
    if level not in (1, 2) or isinstance(level, bool):
        return Failure(CallError(f"sleep level must be 1 or 2, got {level!r}"))
    return Success(Event.SLEEP_L1 if level == 1 else Event.SLEEP_L2)


def busy_wait(wait_s: object) -> Result[float, CallError]:
    """How long a sync worker's call waits for the one in progress (``busy_wait_s``), in
    seconds, or why ``wait_s`` is no finite number >= 0 (a bool is none)."""
    if (
        isinstance(wait_s, bool)
        or not isinstance(wait_s, int | float)
        or not math.isfinite(wait_s)
        or wait_s < 0
    ):
        return Failure(
            CallError(f"busy_wait_s must be a finite number of seconds >= 0, got {wait_s!r}")
        )
    return Success(float(wait_s))


def pause_args(mode: object, clear_cache: object) -> Result[tuple[InflightMode, bool], CallError]:
    """A pause's ``mode`` (an :class:`InflightMode` or its value) and ``clear_cache``,
    checked."""
    if not isinstance(mode, InflightMode):
        known = {m.value: m for m in InflightMode}
        if not isinstance(mode, str) or mode not in known:
            modes = ", ".join(repr(m.value) for m in InflightMode)
            return Failure(CallError(f"mode must be one of {modes}, got {mode!r}"))
        mode = known[mode]
    if not isinstance(clear_cache, bool):
        return Failure(CallError(f"clear_cache must be a bool, got {clear_cache!r}"))
    return Success((mode, clear_cache))
