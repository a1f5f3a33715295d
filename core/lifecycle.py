"""The worker lifecycle as a table: states, events, and the allowed transitions.

Theory of operation
-------------------
A :class:`State` is a phase (not loaded, running, refitting, shut down), which of vLLM's
two sleep-mode memory tags is resident (``weights``, ``kv_cache``), and whether the weights
in that memory are the ones the trainer last sent (:class:`WeightsStatus`). The named
states of the design are points of that product: *awake* (both tags resident, weights
valid), *weights-only awake*, *asleep (level 1)* (nothing resident, weights valid in host
memory), *asleep (level 2)* (nothing resident, weights discarded), *refitting*, *weights
inconsistent*, *not loaded* and *shut down*.

:data:`TRANSITIONS` maps every allowed ``(state, event)`` pair to the next state. It is
generated once, at import, from the rules in ``_rule`` below; a pair missing from it is
refused by :func:`transition` with a :class:`LifecycleError` that names the state, the
event and what to do. The rules, and the vLLM 0.32 behaviour they mirror:

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
  inconsistent until a later refit succeeds) and ``SHUTDOWN`` are allowed.
- ``RESET_PREFIX_CACHE`` is allowed whenever running, and changes nothing here.
- ``SHUTDOWN`` from any state leads to shut down, and is idempotent; every other event
  after it is refused.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import attrs
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "ALL_STATES",
    "ASLEEP_L1",
    "ASLEEP_L2",
    "AWAKE",
    "KV_CACHE_TAG",
    "NOT_LOADED",
    "SHUT_DOWN",
    "TRANSITIONS",
    "WEIGHTS_TAG",
    "Event",
    "LifecycleError",
    "Phase",
    "State",
    "WeightsStatus",
    "allowed_events",
    "check_can_generate",
    "transition",
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


def _check_state(state: State) -> None:
    if state.phase in (Phase.NOT_LOADED, Phase.SHUT_DOWN):
        if (
            state.weights_awake
            or state.kv_cache_awake
            or state.weights is not WeightsStatus.DISCARDED
        ):
            raise ValueError(f"a {state.phase.value} state holds no memory and no weights")
    elif state.phase is Phase.REFITTING and (
        not state.weights_awake or state.weights is not WeightsStatus.INCONSISTENT
    ):
        raise ValueError("a refitting state has resident, inconsistent weights")


@attrs.frozen
class State:
    """Phase, which memory tags are resident, and whether the weights are valid."""

    phase: Phase
    weights: WeightsStatus
    weights_awake: bool
    kv_cache_awake: bool

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
        if self.phase is Phase.REFITTING:
            return f"refitting ({memory})"
        if self.phase is not Phase.RUNNING:
            return str(self.phase.value)
        if self.weights is WeightsStatus.INCONSISTENT:
            return f"{memory}, weights inconsistent"
        if self.weights is WeightsStatus.DISCARDED and self.sleep_level == 0:
            return f"{memory}, weights discarded"
        return memory


NOT_LOADED = State(Phase.NOT_LOADED, WeightsStatus.DISCARDED, False, False)
SHUT_DOWN = State(Phase.SHUT_DOWN, WeightsStatus.DISCARDED, False, False)
AWAKE = State(Phase.RUNNING, WeightsStatus.VALID, True, True)
ASLEEP_L1 = State(Phase.RUNNING, WeightsStatus.VALID, False, False)
ASLEEP_L2 = State(Phase.RUNNING, WeightsStatus.DISCARDED, False, False)

ALL_STATES: tuple[State, ...] = (
    NOT_LOADED,
    *(
        State(Phase.RUNNING, weights, w, kv)
        for weights in WeightsStatus
        for w in (True, False)
        for kv in (True, False)
    ),
    *(State(Phase.REFITTING, WeightsStatus.INCONSISTENT, True, kv) for kv in (True, False)),
    SHUT_DOWN,
)
"""Every valid state (16): the rows of the transition table."""


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


def _generate_refusal(state: State) -> str | None:
    """Why a running state cannot generate, or None if it can."""
    awake = state.weights_awake and state.kv_cache_awake
    if state.weights is WeightsStatus.DISCARDED:
        why = "weights were discarded by a level-2 sleep; refit before generating"
        then = ", then refit (weights were discarded by a level-2 sleep)"
    elif state.weights is WeightsStatus.INCONSISTENT:
        why = "a refit failed: weights are inconsistent; refit again"
        then = ", then refit again (a refit failed: weights are inconsistent)"
    elif awake:
        return None
    else:
        then = ""
    if awake:
        return why
    wake = {
        (True, False): "call wake_up(tags=['kv_cache']) first",
        (False, True): "call wake_up(tags=['weights']) first",
    }.get((state.weights_awake, state.kv_cache_awake), "call wake_up() first")
    return wake + then


def _rule(state: State, event: Event) -> State | str:
    """The next state, or why the event is refused (the remedy, for the error message)."""
    if event is Event.SHUTDOWN:
        return SHUT_DOWN
    if state.phase is Phase.SHUT_DOWN:
        return "the worker is shut down; create a new worker"
    if state.phase is Phase.NOT_LOADED:
        return AWAKE if event is Event.LOAD else "the model is not loaded; load it first"
    if event is Event.LOAD:
        return "the model is already loaded; shut down and create a new worker to load another"
    if state.phase is Phase.REFITTING:
        if event is Event.REFIT_OK:
            return attrs.evolve(state, phase=Phase.RUNNING, weights=WeightsStatus.VALID)
        if event is Event.REFIT_FAILED:
            return attrs.evolve(state, phase=Phase.RUNNING)
        return "a weight refit is in progress; wait for it to succeed or fail"
    if event is Event.GENERATE:
        refusal = _generate_refusal(state)
        return state if refusal is None else refusal
    if event in (Event.SLEEP_L1, Event.SLEEP_L2):
        if state.weights_awake:
            discard = event is Event.SLEEP_L2
            weights = WeightsStatus.DISCARDED if discard else state.weights
            return attrs.evolve(state, weights=weights, weights_awake=False, kv_cache_awake=False)
        if state.kv_cache_awake:
            return (
                "vLLM ignores sleep while the weights are asleep, so the KV cache would stay "
                "resident; call wake_up() first"
            )
        return state
    if event in _WAKE:
        tags = _WAKE[event]
        return attrs.evolve(
            state,
            weights_awake=state.weights_awake or WEIGHTS_TAG in tags,
            kv_cache_awake=state.kv_cache_awake or KV_CACHE_TAG in tags,
        )
    if event is Event.REFIT_BEGIN:
        if state.weights_awake:
            return attrs.evolve(state, phase=Phase.REFITTING, weights=WeightsStatus.INCONSISTENT)
        return "the weights are asleep; call wake_up(tags=['weights']) first"
    if event in (Event.REFIT_OK, Event.REFIT_FAILED):
        return "no refit is in progress"
    assert event is Event.RESET_PREFIX_CACHE
    return state


_OUTCOMES: dict[tuple[State, Event], State | str] = {
    (s, e): _rule(s, e) for s in ALL_STATES for e in Event
}

TRANSITIONS: Mapping[tuple[State, Event], State] = MappingProxyType(
    {k: v for k, v in _OUTCOMES.items() if isinstance(v, State)}
)
"""Every allowed (state, event) pair and the state it leads to; the rest are refused."""


def transition(state: State, event: Event) -> Result[State, LifecycleError]:
    """The state after ``event``, or why ``event`` is not allowed in ``state``."""
    outcome = _OUTCOMES[(state, event)]
    if isinstance(outcome, State):
        return Success(outcome)
    return Failure(
        LifecycleError(
            message=f"cannot {event.value} while {state}: {outcome}", state=state, event=event
        )
    )


def check_can_generate(state: State) -> Result[State, LifecycleError]:
    """``Success(state)`` if the worker may generate now, else why not and what to do."""
    return transition(state, Event.GENERATE)


def allowed_events(state: State) -> frozenset[Event]:
    """The events :data:`TRANSITIONS` allows in ``state``."""
    return frozenset(e for e in Event if (state, e) in TRANSITIONS)


def wake_tags(state: State, event: Event) -> tuple[str, ...]:
    """The tags the shell passes to vLLM's ``wake_up`` for ``event``: only asleep ones.

    Empty means "do not call ``wake_up``" (nothing to wake, or not a wake event). vLLM 0.32
    ignores a whole ``wake_up(tags)`` call when one of the tags is already awake.
    """
    resident = {WEIGHTS_TAG: state.weights_awake, KV_CACHE_TAG: state.kv_cache_awake}
    return tuple(t for t in _WAKE.get(event, ()) if not resident[t])
