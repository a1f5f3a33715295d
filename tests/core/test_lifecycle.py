"""The worker lifecycle table: every (state, event) pair, and laws over event sequences."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import lifecycle_event_sequences, lifecycle_states

from genworker.core.lifecycle import (
    ALL_STATES,
    ASLEEP_L1,
    ASLEEP_L2,
    AWAKE,
    AWAKE_INCONSISTENT,
    FILLS_CACHES,
    KV_CACHE_TAG,
    NOT_LOADED,
    REFITTING_STREAMING,
    REFITTING_WEIGHTS_ONLY,
    SHUT_DOWN,
    STREAMING,
    STREAMING_INCONSISTENT,
    TABLE,
    TRANSITIONS,
    WEIGHTS_TAG,
    CacheLedger,
    CallError,
    Event,
    InflightMode,
    LifecycleError,
    Phase,
    State,
    WeightsStatus,
    allowed_events,
    busy_wait,
    check_can_generate,
    pause_args,
    sleep_event,
    transition,
    wake_event,
    wake_incomplete,
    wake_tags,
)

PAIRS = list(itertools.product(ALL_STATES, Event))
RUNNING = [s for s in ALL_STATES if s.phase is Phase.RUNNING]
REFITTING = [s for s in ALL_STATES if s.phase is Phase.REFITTING]
WAKES = {
    Event.WAKE_WEIGHTS: (True, False),
    Event.WAKE_KV_CACHE: (False, True),
    Event.WAKE_ALL: (True, True),
}
WEIGHTS_ONLY = State(Phase.RUNNING, WeightsStatus.VALID, True, False)
KV_ONLY = State(Phase.RUNNING, WeightsStatus.VALID, False, True)


def _ids(value: object) -> str:
    return str(value).replace(" ", "_")


# --- the table, written out ----------------------------------------------------------------
# Rows: every state. V/D/I = weights valid / discarded (level-2 sleep) / inconsistent (failed
# refit); the two digits say whether the weights and the KV cache are resident. R1/R0 =
# refitting with the KV cache resident or not. Each cell is the next state, "-" = refused.
# Columns are the events (_COLUMNS below). Written by hand from the rules in
# core/lifecycle.py's docstring, not from the code.
LITERAL_TABLE = """
state  LOAD  GEN   SL1  SL2  WW    WKV   WALL  RB   ROK   RFAIL  RPC  SHUT  SOPEN  SDONE
NL     V11   -     -    -    -     -     -     -    -     -      -    SD    -      -
SD     -     -     -    -    -     -     -     -    -     -      -    SD    -      -
V11    -     V11   V00  D00  V11   V11   V11   R1   -     -      V11  SD    V11s   -
V10    -     -     V00  D00  V10   V11   V11   R0   -     -      V10  SD    -      -
V01    -     -     -    -    V11   V01   V11   -    -     -      V01  SD    -      -
V00    -     -     V00  V00  V10   V01   V11   -    -     -      V00  SD    -      -
D11    -     -     D00  D00  D11   D11   D11   R1   -     -      D11  SD    -      -
D10    -     -     D00  D00  D10   D11   D11   R0   -     -      D10  SD    -      -
D01    -     -     -    -    D11   D01   D11   -    -     -      D01  SD    -      -
D00    -     -     D00  D00  D10   D01   D11   -    -     -      D00  SD    -      -
I11    -     -     I00  D00  I11   I11   I11   R1   -     -      I11  SD    -      -
I10    -     -     I00  D00  I10   I11   I11   R0   -     -      I10  SD    -      -
I01    -     -     -    -    I11   I01   I11   -    -     -      I01  SD    -      -
I00    -     -     I00  I00  I10   I01   I11   -    -     -      I00  SD    -      -
R1     -     -     -    -    -     -     -     -    V11   I11    -    SD    R1s    -
R0     -     -     -    -    -     -     -     -    V10   I10    -    SD    -      -
V11s   -     V11s  -    -    V11s  V11s  V11s  R1s  -     -      -    SD    V11s   V11
I11s   -     -     -    -    I11s  I11s  I11s  R1s  -     -      -    SD    -      I11
R1s    -     -     -    -    -     -     -     -    V11s  I11s   -    SD    R1s    R1
"""

_COLUMNS = {
    "LOAD": Event.LOAD,
    "GEN": Event.GENERATE,
    "SL1": Event.SLEEP_L1,
    "SL2": Event.SLEEP_L2,
    "WW": Event.WAKE_WEIGHTS,
    "WKV": Event.WAKE_KV_CACHE,
    "WALL": Event.WAKE_ALL,
    "RB": Event.REFIT_BEGIN,
    "ROK": Event.REFIT_OK,
    "RFAIL": Event.REFIT_FAILED,
    "RPC": Event.RESET_PREFIX_CACHE,
    "SHUT": Event.SHUTDOWN,
    "SOPEN": Event.STREAM_OPEN,
    "SDONE": Event.STREAMS_DONE,
}
_STATUS = {"V": WeightsStatus.VALID, "D": WeightsStatus.DISCARDED, "I": WeightsStatus.INCONSISTENT}


def _named(name: str) -> State:
    if name.endswith("s"):  # requests in flight (the async worker's streams)
        return attrs.evolve(_named(name[:-1]), streaming=True)
    if name == "NL":
        return State(Phase.NOT_LOADED, WeightsStatus.DISCARDED, False, False)
    if name == "SD":
        return State(Phase.SHUT_DOWN, WeightsStatus.DISCARDED, False, False)
    if name.startswith("R"):
        return State(Phase.REFITTING, WeightsStatus.INCONSISTENT, True, name[1] == "1")
    return State(Phase.RUNNING, _STATUS[name[0]], name[1] == "1", name[2] == "1")


def _literal() -> dict[tuple[State, Event], State | None]:
    header, *rows = (line.split() for line in LITERAL_TABLE.strip().splitlines())
    events = [_COLUMNS[column] for column in header[1:]]
    table: dict[tuple[State, Event], State | None] = {}
    for name, *cells in rows:
        for event, cell in zip(events, cells, strict=True):
            table[(_named(name), event)] = None if cell == "-" else _named(cell)
    return table


LITERAL = _literal()


def _refused(state: State, event: Event) -> LifecycleError:
    result = transition(state, event)
    assert isinstance(result, Failure), f"{event} should be refused in {state}"
    error = result.failure()
    assert isinstance(error, LifecycleError)
    return error


def _run(events: Sequence[Event], state: State = NOT_LOADED) -> State:
    for e in events:
        state = transition(state, e).unwrap()
    return state


# --- the table, rule by rule, over every state ---------------------------------------------


@pytest.mark.parametrize("state", ALL_STATES, ids=_ids)
def test_shutdown_from_any_state_shuts_down(state: State) -> None:
    assert transition(state, Event.SHUTDOWN) == Success(SHUT_DOWN)


@pytest.mark.parametrize("event", [e for e in Event if e is not Event.SHUTDOWN], ids=_ids)
def test_after_shutdown_every_event_but_shutdown_is_refused(event: Event) -> None:
    assert "shut down; create a new worker" in str(_refused(SHUT_DOWN, event))


@pytest.mark.parametrize("state", ALL_STATES, ids=_ids)
def test_load_only_from_not_loaded_and_it_wakes_everything(state: State) -> None:
    if state == NOT_LOADED:
        assert transition(state, Event.LOAD) == Success(AWAKE)
    else:
        _refused(state, Event.LOAD)


@pytest.mark.parametrize("event", [e for e in Event if e not in (Event.LOAD, Event.SHUTDOWN)])
def test_before_loading_only_load_and_shutdown_are_allowed(event: Event) -> None:
    assert "not loaded; load it first" in str(_refused(NOT_LOADED, event))


@pytest.mark.parametrize("state", ALL_STATES, ids=_ids)
def test_generate_only_when_fully_awake_with_valid_weights(state: State) -> None:
    ok = (
        state.phase is Phase.RUNNING
        and state.weights_awake
        and state.kv_cache_awake
        and state.weights is WeightsStatus.VALID
    )
    result = check_can_generate(state)
    assert result == transition(state, Event.GENERATE)
    assert (result == Success(state)) if ok else isinstance(result, Failure)


@pytest.mark.parametrize("event", [Event.SLEEP_L1, Event.SLEEP_L2], ids=_ids)
@pytest.mark.parametrize("state", ALL_STATES, ids=_ids)
def test_sleep_puts_both_tags_to_sleep_and_level_2_discards_weights(
    state: State, event: Event
) -> None:
    result = transition(state, event)
    if state.phase is not Phase.RUNNING:
        assert isinstance(result, Failure)
    elif state.streaming:
        assert "requests are in flight" in str(_refused(state, event))
    elif state.weights_awake:
        weights = WeightsStatus.DISCARDED if event is Event.SLEEP_L2 else state.weights
        assert result == Success(
            attrs.evolve(state, weights=weights, weights_awake=False, kv_cache_awake=False)
        )
    elif state.kv_cache_awake:
        assert "KV cache would stay resident" in str(_refused(state, event))
    else:
        assert result == Success(state), "sleeping while asleep is a no-op at any level"


def test_sleep_levels_compose_as_vllm_does() -> None:
    """vLLM's Executor.sleep returns early once the weights are asleep."""
    assert _run([Event.SLEEP_L2], ASLEEP_L1) == ASLEEP_L1
    assert _run([Event.SLEEP_L1], ASLEEP_L2) == ASLEEP_L2
    assert _run([Event.SLEEP_L1, Event.SLEEP_L1], AWAKE) == ASLEEP_L1
    assert _run([Event.SLEEP_L2, Event.SLEEP_L2], AWAKE) == ASLEEP_L2


@pytest.mark.parametrize("event", list(WAKES), ids=_ids)
@pytest.mark.parametrize("state", ALL_STATES, ids=_ids)
def test_wake_makes_its_tags_resident_and_never_repairs_weights(state: State, event: Event) -> None:
    result = transition(state, event)
    if state.phase is not Phase.RUNNING:
        assert isinstance(result, Failure)
        return
    w, kv = WAKES[event]
    woken = attrs.evolve(
        state, weights_awake=state.weights_awake or w, kv_cache_awake=state.kv_cache_awake or kv
    )
    assert result == Success(woken)
    assert transition(woken, event) == Success(woken), "waking an awake tag is a no-op"


@pytest.mark.parametrize("state", ALL_STATES, ids=_ids)
def test_refit_begins_only_with_the_weights_resident(state: State) -> None:
    result = transition(state, Event.REFIT_BEGIN)
    if state.phase is Phase.RUNNING and state.weights_awake:
        assert result == Success(
            State(
                Phase.REFITTING,
                WeightsStatus.INCONSISTENT,
                True,
                state.kv_cache_awake,
                streaming=state.streaming,
            )
        )
    else:
        assert isinstance(result, Failure)


@pytest.mark.parametrize("state", ALL_STATES, ids=_ids)
def test_refit_outcome_sets_weights_and_keeps_memory(state: State) -> None:
    ok, failed = transition(state, Event.REFIT_OK), transition(state, Event.REFIT_FAILED)
    if state.phase is Phase.REFITTING:
        running = attrs.evolve(state, phase=Phase.RUNNING)
        assert ok == Success(attrs.evolve(running, weights=WeightsStatus.VALID))
        assert failed == Success(running)
        assert failed.unwrap().weights is WeightsStatus.INCONSISTENT
    else:
        assert isinstance(ok, Failure)
        assert isinstance(failed, Failure)


@pytest.mark.parametrize(
    "event",
    [
        e
        for e in Event
        if e
        not in (
            Event.LOAD,
            Event.REFIT_OK,
            Event.REFIT_FAILED,
            Event.SHUTDOWN,
            Event.STREAM_OPEN,
            Event.STREAMS_DONE,
        )
    ],
    ids=_ids,
)
@pytest.mark.parametrize("state", REFITTING, ids=_ids)
def test_during_a_refit_only_its_outcome_or_shutdown_is_allowed(state: State, event: Event) -> None:
    assert "refit is in progress" in str(_refused(state, event))


@pytest.mark.parametrize("state", ALL_STATES, ids=_ids)
def test_reset_prefix_cache_is_allowed_whenever_running_and_changes_nothing(
    state: State,
) -> None:
    result = transition(state, Event.RESET_PREFIX_CACHE)
    if state.phase is Phase.RUNNING and not state.streaming:
        assert result == Success(state)
    else:
        assert isinstance(result, Failure)


def test_the_written_table_has_every_state_and_event_once() -> None:
    assert len(LITERAL) == 19 * len(Event)
    assert {s for s, _ in LITERAL} == set(ALL_STATES)


@pytest.mark.parametrize(("state", "event"), PAIRS, ids=_ids)
def test_transition_does_what_the_written_table_says(state: State, event: Event) -> None:
    expected = LITERAL[(state, event)]
    result = transition(state, event)
    if expected is not None:
        assert result == Success(expected)
        assert TRANSITIONS[(state, event)] == expected
        assert event in allowed_events(state)
    else:
        error = _refused(state, event)
        assert (state, event) not in TRANSITIONS
        assert event not in allowed_events(state)
        assert (error.state, error.event) == (state, event)
        assert str(error) == error.message
        assert str(state) in error.message
        assert event.value in error.message


def test_the_table_covers_only_valid_states_and_is_read_only() -> None:
    assert {s for s, _ in TRANSITIONS} <= set(ALL_STATES)
    assert set(TRANSITIONS.values()) <= set(ALL_STATES)
    assert len(ALL_STATES) == len(set(ALL_STATES)) == 19
    assert set(TABLE) == set(ALL_STATES)
    with pytest.raises(TypeError):
        TRANSITIONS[(AWAKE, Event.LOAD)] = AWAKE  # type: ignore[index]


def test_every_state_is_reachable_from_not_loaded() -> None:
    seen = {NOT_LOADED}
    frontier = [NOT_LOADED]
    while frontier:
        state = frontier.pop()
        for e in allowed_events(state):
            nxt = TRANSITIONS[(state, e)]
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(ALL_STATES)


def test_every_state_has_its_own_name() -> None:
    names = [str(s) for s in ALL_STATES]
    assert len(set(names)) == len(names)
    assert str(NOT_LOADED) == "not loaded"
    assert str(AWAKE) == "awake"
    assert str(ASLEEP_L1) == "asleep (level 1)"
    assert str(ASLEEP_L2) == "asleep (level 2)"
    assert str(WEIGHTS_ONLY) == "weights-only awake"
    assert str(SHUT_DOWN) == "shut down"
    assert str(_run([Event.REFIT_BEGIN], AWAKE)) == "refitting (awake)"
    assert str(_run([Event.REFIT_BEGIN, Event.REFIT_FAILED], AWAKE)) == (
        "awake, weights inconsistent"
    )
    assert [AWAKE.sleep_level, ASLEEP_L1.sleep_level, ASLEEP_L2.sleep_level] == [0, 1, 2]
    assert str(STREAMING) == "awake, streaming"
    assert str(REFITTING_STREAMING) == "refitting (awake, streaming)"
    assert str(STREAMING_INCONSISTENT) == "awake, weights inconsistent, streaming"


@pytest.mark.parametrize(
    "fields",
    [
        (Phase.NOT_LOADED, WeightsStatus.DISCARDED, True, False),
        (Phase.SHUT_DOWN, WeightsStatus.VALID, False, False),
        (Phase.SHUT_DOWN, WeightsStatus.DISCARDED, False, True),
        (Phase.REFITTING, WeightsStatus.INCONSISTENT, False, True),
        (Phase.REFITTING, WeightsStatus.VALID, True, True),
        (Phase.SHUT_DOWN, WeightsStatus.DISCARDED, False, False, True),
        (Phase.RUNNING, WeightsStatus.VALID, True, False, True),
        (Phase.RUNNING, WeightsStatus.VALID, False, True, True),
        (Phase.RUNNING, WeightsStatus.DISCARDED, True, True, True),
        (Phase.REFITTING, WeightsStatus.INCONSISTENT, True, False, True),
    ],
)
def test_states_outside_the_table_cannot_be_built(
    fields: tuple[Phase, WeightsStatus, bool, bool] | tuple[Phase, WeightsStatus, bool, bool, bool],
) -> None:
    with pytest.raises(ValueError):
        State(*fields)


# --- in flight: the async worker's streams -------------------------------------------------


@pytest.mark.parametrize("state", ALL_STATES, ids=_ids)
def test_streams_open_where_generate_is_allowed_and_queue_during_a_refit(state: State) -> None:
    result = transition(state, Event.STREAM_OPEN)
    queued = state.phase is Phase.REFITTING and state.kv_cache_awake
    if isinstance(check_can_generate(state), Success) or queued:
        assert result == Success(attrs.evolve(state, streaming=True))
    else:
        assert isinstance(result, Failure)


@pytest.mark.parametrize("state", ALL_STATES, ids=_ids)
def test_the_last_stream_ending_leaves_only_the_in_flight_dimension(state: State) -> None:
    result = transition(state, Event.STREAMS_DONE)
    if state.streaming:
        assert result == Success(attrs.evolve(state, streaming=False))
    elif state.phase in (Phase.RUNNING, Phase.REFITTING):
        assert "no stream is open" in str(_refused(state, Event.STREAMS_DONE))
    else:
        _refused(state, Event.STREAMS_DONE)


def test_an_in_flight_refit_keeps_the_streams_whatever_its_outcome() -> None:
    assert _run([Event.REFIT_BEGIN], STREAMING) == REFITTING_STREAMING
    assert _run([Event.REFIT_BEGIN, Event.REFIT_OK], STREAMING) == STREAMING
    failed = _run([Event.REFIT_BEGIN, Event.REFIT_FAILED], STREAMING)
    assert failed == STREAMING_INCONSISTENT
    assert isinstance(transition(failed, Event.STREAM_OPEN), Failure), "no new work"
    assert _run([Event.STREAMS_DONE], failed) == AWAKE_INCONSISTENT
    assert _run([Event.REFIT_BEGIN, Event.REFIT_OK, Event.STREAMS_DONE], failed) == AWAKE


def test_requests_submitted_during_a_refit_queue_and_outlive_it() -> None:
    state = _run([Event.LOAD, Event.REFIT_BEGIN, Event.STREAM_OPEN])
    assert state == REFITTING_STREAMING
    assert _run([Event.REFIT_OK], state) == STREAMING
    assert _run([Event.STREAMS_DONE, Event.REFIT_OK], state) == AWAKE


@pytest.mark.parametrize("state", [s for s in ALL_STATES if s.streaming], ids=_ids)
def test_nothing_that_would_strand_a_stream_is_allowed_while_streaming(state: State) -> None:
    for event in (Event.SLEEP_L1, Event.SLEEP_L2, Event.RESET_PREFIX_CACHE, Event.LOAD):
        _refused(state, event)
    assert transition(state, Event.SHUTDOWN) == Success(SHUT_DOWN)


# --- what the user reads ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "event", "text"),
    [
        (ASLEEP_L2, Event.GENERATE, "cannot generate while asleep (level 2): call wake_up() first"),
        (ASLEEP_L2, Event.GENERATE, "then refit (weights were discarded by a level-2 sleep)"),
        (ASLEEP_L1, Event.GENERATE, "cannot generate while asleep (level 1): call wake_up() first"),
        (WEIGHTS_ONLY, Event.GENERATE, "call wake_up(tags=['kv_cache']) first"),
        (KV_ONLY, Event.GENERATE, "call wake_up(tags=['weights']) first"),
        (
            attrs.evolve(AWAKE, weights=WeightsStatus.DISCARDED),
            Event.GENERATE,
            "weights were discarded by a level-2 sleep; refit before generating",
        ),
        (
            attrs.evolve(AWAKE, weights=WeightsStatus.INCONSISTENT),
            Event.GENERATE,
            "a refit failed: weights are inconsistent; refit again",
        ),
        (
            attrs.evolve(ASLEEP_L1, weights=WeightsStatus.INCONSISTENT),
            Event.GENERATE,
            "call wake_up() first, then refit again",
        ),
        (ASLEEP_L1, Event.REFIT_BEGIN, "refit while asleep (level 1)"),
        (ASLEEP_L1, Event.REFIT_BEGIN, "call wake_up(tags=['weights']) first"),
        (AWAKE, Event.REFIT_OK, "no refit is in progress"),
        (AWAKE, Event.LOAD, "already loaded"),
        (KV_ONLY, Event.SLEEP_L1, "call wake_up() first"),
        (STREAMING, Event.SLEEP_L1, "requests are in flight; wait for their streams to end"),
        (STREAMING, Event.RESET_PREFIX_CACHE, "vLLM keeps the prefix cache while requests run"),
        (AWAKE, Event.STREAMS_DONE, "no stream is open"),
        (REFITTING_WEIGHTS_ONLY, Event.STREAMS_DONE, "no stream is open"),
        (REFITTING_WEIGHTS_ONLY, Event.STREAM_OPEN, "in progress with the KV cache asleep"),
        (STREAMING_INCONSISTENT, Event.STREAM_OPEN, "a refit failed: weights are inconsistent"),
        (ASLEEP_L1, Event.STREAM_OPEN, "cannot start generating while asleep (level 1)"),
    ],
)
def test_refusals_say_what_to_do(state: State, event: Event, text: str) -> None:
    assert text in str(_refused(state, event))


# --- vLLM wake tags ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "event", "tags"),
    [
        (ASLEEP_L1, Event.WAKE_ALL, (WEIGHTS_TAG, KV_CACHE_TAG)),
        (ASLEEP_L2, Event.WAKE_WEIGHTS, (WEIGHTS_TAG,)),
        (WEIGHTS_ONLY, Event.WAKE_ALL, (KV_CACHE_TAG,)),
        (KV_ONLY, Event.WAKE_ALL, (WEIGHTS_TAG,)),
        (AWAKE, Event.WAKE_WEIGHTS, ()),
        (ASLEEP_L1, Event.GENERATE, ()),
    ],
)
def test_wake_tags_name_only_the_asleep_tags(
    state: State, event: Event, tags: tuple[str, ...]
) -> None:
    """vLLM drops a whole wake_up(tags) call if one tag is already awake (vllm#31618)."""
    assert wake_tags(state, event) == tags


@pytest.mark.parametrize("event", list(WAKES), ids=_ids)
@pytest.mark.parametrize("state", RUNNING, ids=_ids)
def test_wake_tags_are_empty_exactly_when_the_wake_is_a_no_op(state: State, event: Event) -> None:
    assert (wake_tags(state, event) == ()) == (transition(state, event) == Success(state))


# --- flows the trainer runs ------------------------------------------------------------------


def test_colocated_step_level_2_refit_then_generate() -> None:
    state = _run([Event.LOAD, Event.GENERATE, Event.SLEEP_L2, Event.WAKE_WEIGHTS])
    assert isinstance(check_can_generate(state), Failure)
    state = _run([Event.REFIT_BEGIN, Event.REFIT_OK, Event.RESET_PREFIX_CACHE], state)
    assert isinstance(check_can_generate(state), Failure), "KV cache still asleep"
    state = _run([Event.WAKE_KV_CACHE], state)
    assert check_can_generate(state) == Success(AWAKE)


def test_a_failed_refit_blocks_generation_until_a_refit_succeeds() -> None:
    state = _run([Event.LOAD, Event.REFIT_BEGIN, Event.REFIT_FAILED])
    assert "refit again" in str(check_can_generate(state).failure())
    state = _run([Event.SLEEP_L1, Event.WAKE_ALL], state)
    assert isinstance(check_can_generate(state), Failure), "a sleep does not repair weights"
    assert _run([Event.REFIT_BEGIN, Event.REFIT_OK], state) == AWAKE


# --- laws over random event sequences ----------------------------------------------------------


@attrs.define
class ReferenceWorker:
    """An independent, imperative model of the documented rules."""

    loaded: bool = False
    dead: bool = False
    refitting: bool = False
    weights_on_gpu: bool = False
    kv_on_gpu: bool = False
    weights: str = "discarded"
    streaming: bool = False

    def apply(self, event: Event) -> bool:
        """Apply ``event`` if allowed; return whether it was."""
        if event is Event.SHUTDOWN:
            self.dead, self.loaded, self.refitting = True, False, False
            self.weights_on_gpu = self.kv_on_gpu = self.streaming = False
            self.weights = "discarded"
            return True
        if self.dead or self.loaded == (event is Event.LOAD):
            return False
        if event is Event.LOAD:
            self.loaded = self.weights_on_gpu = self.kv_on_gpu = True
            self.weights = "valid"
            return True
        if event is Event.STREAMS_DONE:
            was, self.streaming = self.streaming, False
            return was
        if event is Event.STREAM_OPEN:
            awake = self.weights_on_gpu and self.kv_on_gpu
            if awake and (self.refitting or self.weights == "valid"):
                self.streaming = True
                return True
            return False
        if self.streaming and event in (
            Event.SLEEP_L1,
            Event.SLEEP_L2,
            Event.RESET_PREFIX_CACHE,
        ):
            return False
        if self.refitting:
            if event in (Event.REFIT_OK, Event.REFIT_FAILED):
                self.refitting = False
                self.weights = "valid" if event is Event.REFIT_OK else "inconsistent"
                return True
            return False
        if event is Event.GENERATE:
            return self.weights_on_gpu and self.kv_on_gpu and self.weights == "valid"
        if event in (Event.SLEEP_L1, Event.SLEEP_L2):
            if self.weights_on_gpu:
                self.weights_on_gpu = self.kv_on_gpu = False
                if event is Event.SLEEP_L2:
                    self.weights = "discarded"
                return True
            return not self.kv_on_gpu
        if event in (Event.WAKE_WEIGHTS, Event.WAKE_ALL):
            self.weights_on_gpu = True
        if event in (Event.WAKE_KV_CACHE, Event.WAKE_ALL):
            self.kv_on_gpu = True
        if event is Event.REFIT_BEGIN:
            if not self.weights_on_gpu:
                return False
            self.refitting = True
            self.weights = "inconsistent"
        return event not in (Event.REFIT_OK, Event.REFIT_FAILED)

    def observe(self) -> tuple[str, str, bool, bool, bool]:
        phase = (
            "shut down"
            if self.dead
            else "refitting"
            if self.refitting
            else "running"
            if self.loaded
            else "not loaded"
        )
        return (phase, self.weights, self.weights_on_gpu, self.kv_on_gpu, self.streaming)


def _observe(state: State) -> tuple[str, str, bool, bool, bool]:
    return (
        state.phase.value,
        state.weights.value,
        state.weights_awake,
        state.kv_cache_awake,
        state.streaming,
    )


@given(lifecycle_event_sequences())
def test_the_table_agrees_with_an_independent_reference_model(events: list[Event]) -> None:
    state, ref = NOT_LOADED, ReferenceWorker()
    for event in events:
        result = transition(state, event)
        assert isinstance(result, Success) == ref.apply(event), (state, event)
        state = result.value_or(state)
        assert _observe(state) == ref.observe()


def _may_generate_by_history(accepted: list[Event]) -> bool:
    """Generation is allowed iff, in the accepted history: loaded, not shut down, no refit
    pending, both tags woken since the last sleep, and the weights not discarded by a level-2
    sleep (one that found them resident) or broken by a failed refit since the last
    successful refit."""
    if Event.LOAD not in accepted or Event.SHUTDOWN in accepted:
        return False
    refit_events = [
        e for e in accepted if e in (Event.REFIT_BEGIN, Event.REFIT_OK, Event.REFIT_FAILED)
    ]
    if refit_events and refit_events[-1] is Event.REFIT_BEGIN:
        return False
    sleeps = [i for i, e in enumerate(accepted) if e in (Event.SLEEP_L1, Event.SLEEP_L2)]
    since = accepted[sleeps[-1] + 1 :] if sleeps else []
    woke_weights = not sleeps or any(e in (Event.WAKE_WEIGHTS, Event.WAKE_ALL) for e in since)
    woke_kv = not sleeps or any(e in (Event.WAKE_KV_CACHE, Event.WAKE_ALL) for e in since)
    last_damage_or_repair: Event | None = None
    resident = True
    for e in accepted:
        if e in (Event.SLEEP_L1, Event.SLEEP_L2):
            if resident and e is Event.SLEEP_L2:
                last_damage_or_repair = e
            resident = False
        elif e in (Event.WAKE_WEIGHTS, Event.WAKE_ALL):
            resident = True
        elif e in (Event.REFIT_OK, Event.REFIT_FAILED):
            last_damage_or_repair = e
    weights_ok = last_damage_or_repair in (None, Event.REFIT_OK)
    return woke_weights and woke_kv and weights_ok


@given(lifecycle_event_sequences())
def test_generate_succeeds_iff_history_woke_both_tags_and_repaired_weights(
    events: list[Event],
) -> None:
    state, accepted = NOT_LOADED, []
    for event in events:
        result = transition(state, event)
        if isinstance(result, Success):
            state = result.unwrap()
            accepted.append(event)
        can = isinstance(check_can_generate(state), Success)
        assert can == _may_generate_by_history(accepted), accepted


@given(lifecycle_states(), lifecycle_event_sequences(max_size=20))
def test_shutdown_is_absorbing(start: State, events: list[Event]) -> None:
    state = transition(start, Event.SHUTDOWN).unwrap()
    for event in events:
        result = transition(state, event)
        assert isinstance(result, Success) == (event is Event.SHUTDOWN)
        assert result.value_or(state) == SHUT_DOWN


@given(lifecycle_states(), lifecycle_event_sequences(max_size=20))
def test_every_walk_follows_the_written_table(start: State, events: list[Event]) -> None:
    """From any state, each step lands where the written table says (or is refused where it
    says "-"), so every reachable state is one of its rows."""
    state = start
    for event in events:
        expected = LITERAL[(state, event)]
        result = transition(state, event)
        if expected is None:
            assert isinstance(result, Failure), (state, event)
        else:
            assert result == Success(expected), (state, event)
            state = expected
        assert {e for e in Event if LITERAL[(state, e)] is not None} == allowed_events(state)


# --- the cache ledger ---------------------------------------------------------------------
COUNTS = st.none() | st.integers(0, 3)


@given(lifecycle_event_sequences(max_size=20), COUNTS, COUNTS)
def test_caches_count_as_empty_only_while_no_request_ran_since_the_last_reset(
    events: list[Event], then: int | None, now: int | None
) -> None:
    """After a reset, a reset is needed again exactly when an event that runs requests
    came, or the engine's own request count moved (a request run past the worker)."""
    ledger = CacheLedger().reset(then)
    for event in events:
        ledger = ledger.after(event)
    ran = any(e in FILLS_CACHES for e in events)
    assert ledger.needs_reset(now) == (ran or now != then)


@given(lifecycle_event_sequences(max_size=20), COUNTS)
def test_a_ledger_never_reset_always_needs_a_reset(events: list[Event], now: int | None) -> None:
    ledger = CacheLedger()
    for event in events:
        ledger = ledger.after(event)
    assert ledger.needs_reset(now)


@pytest.mark.parametrize(("state", "event"), list(TRANSITIONS))
def test_every_transition_that_can_run_requests_dirties_the_caches(
    state: State, event: Event
) -> None:
    """Generating, or entering a state with streams open, is an event of FILLS_CACHES."""
    runs = event is Event.GENERATE or (
        TRANSITIONS[(state, event)].streaming and not state.streaming
    )
    if runs or event is Event.STREAM_OPEN:
        assert CacheLedger().reset(0).after(event).needs_reset(0)


_TAG_EVENTS = {
    frozenset({"weights"}): Event.WAKE_WEIGHTS,
    frozenset({"kv_cache"}): Event.WAKE_KV_CACHE,
    frozenset({"weights", "kv_cache"}): Event.WAKE_ALL,
}


@given(
    st.none()
    | st.integers()
    | st.text(max_size=8)
    | st.lists(st.sampled_from(["weights", "kv_cache", "gpu", ""]) | st.integers(), max_size=4)
)
def test_wake_event_is_the_tags_event_for_every_non_empty_subset_and_refuses_the_rest(
    tags: object,
) -> None:
    """None wakes both tags; a list of the two tag names (repeats allowed) wakes those;
    anything else (a str, a non-iterable, other names, none) is refused naming it."""
    wanted = (
        frozenset({"weights", "kv_cache"})
        if tags is None
        else frozenset(tags)
        if isinstance(tags, list) and all(isinstance(t, str) for t in tags)
        else None
    )
    event = wake_event(tags)
    if wanted in _TAG_EVENTS:
        assert event == Success(_TAG_EVENTS[wanted])
    else:
        assert isinstance(event, Failure)
        assert isinstance(event.failure(), CallError)
        assert repr(tags) in event.failure().message


@given(st.integers(-2, 4) | st.booleans() | st.none() | st.text(max_size=2) | st.floats())
def test_sleep_event_takes_levels_one_and_two_only(level: object) -> None:
    event = sleep_event(level)
    if level in (1, 2) and not isinstance(level, bool):
        assert event == Success(Event.SLEEP_L1 if level == 1 else Event.SLEEP_L2)
    else:
        assert isinstance(event, Failure)
        assert event.failure().message == f"sleep level must be 1 or 2, got {level!r}"


@given(st.floats() | st.integers(-3, 10**6) | st.booleans() | st.none() | st.text(max_size=2))
def test_the_busy_wait_is_a_finite_number_of_seconds_not_below_zero(wait_s: object) -> None:
    checked = busy_wait(wait_s)
    if (
        isinstance(wait_s, int | float)
        and not isinstance(wait_s, bool)
        and math.isfinite(wait_s)
        and wait_s >= 0
    ):
        assert checked == Success(float(wait_s))
        assert type(checked.unwrap()) is float
    else:
        assert isinstance(checked, Failure)
        assert checked.failure() == CallError(
            f"busy_wait_s must be a finite number of seconds >= 0, got {wait_s!r}"
        )


@given(
    st.sampled_from(list(InflightMode))
    | st.sampled_from([m.value for m in InflightMode])
    | st.text(max_size=5)
    | st.integers()
    | st.none(),
    st.booleans() | st.integers() | st.none(),
)
def test_pause_args_take_a_mode_or_its_value_and_a_bool(mode: object, clear: object) -> None:
    """A mode is an InflightMode or its value; clear_cache a bool; else refused naming
    the bad argument."""
    values = {m.value: m for m in InflightMode}
    known = (
        mode
        if isinstance(mode, InflightMode)
        else values.get(mode)
        if isinstance(mode, str)
        else None
    )
    checked = pause_args(mode, clear)
    if known is None:
        assert isinstance(checked, Failure)
        assert checked.failure().message.startswith("mode must be one of 'keep', 'wait', 'abort'")
        assert repr(mode) in checked.failure().message
    elif not isinstance(clear, bool):
        assert checked == Failure(CallError(f"clear_cache must be a bool, got {clear!r}"))
    else:
        assert checked == Success((known, clear))


@pytest.mark.parametrize("state", ALL_STATES)
@pytest.mark.parametrize("fully", [True, False, None])
def test_a_wake_leaves_the_engine_dead_only_if_it_says_not_fully_awake_when_all_is(
    state: State, fully: object
) -> None:
    """``wake_incomplete``: the engine's answer False after a wake that leaves every tag
    resident is the dead engine's message naming the call; any other answer or state, None."""
    problem = wake_incomplete("wake_up(tags=['weights'])", fully, state)
    if fully is False and state.weights_awake and state.kv_cache_awake:
        assert problem is not None
        assert problem.startswith("wake_up(tags=['weights']): the engine is not fully awake")
    else:
        assert problem is None
