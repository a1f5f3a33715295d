"""``WeightsGate`` (issue 44 item 3): a refit never writes under a held batch; it waits
for the batch at most its bound, then is refused naming the wait, having run nothing."""

from __future__ import annotations

import threading
import time

import pytest

from genworker.shell.errors import EngineStateError, RefitError
from genworker.shell.refit.engine import WeightsGate


def test_a_write_waits_for_the_held_batch_then_runs() -> None:
    gate, order = WeightsGate(), []
    gate.hold(True, 1.0)

    def write() -> None:
        with gate.writing("sparse step 3", 10.0):
            order.append("write")

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.3)
    order.append("batch done")
    gate.hold(False, 0.0)
    writer.join(10)
    assert order == ["batch done", "write"]


def test_a_write_that_waited_past_its_bound_is_refused_naming_the_wait() -> None:
    gate, ran = WeightsGate(), []
    gate.hold(True, 1.0)
    started = time.monotonic()
    with (
        pytest.raises(RefitError, match=r"sparse step 4: refused, a batch held .* over 0.2 s"),
        gate.writing("sparse step 4", 0.2),
    ):
        ran.append(True)
    assert ran == []
    assert time.monotonic() - started < 5.0
    gate.hold(False, 0.0)
    with gate.writing("sparse step 5", 0.2):
        ran.append(True)
    assert ran == [True]


def test_a_batch_waits_for_a_write_in_progress_at_most_its_bound() -> None:
    gate = WeightsGate()
    busy = pytest.raises(EngineStateError, match="a refit is writing the weights")
    with gate.writing("a refit", 1.0), busy:
        gate.hold(True, 0.1)
    gate.hold(True, 0.1)  # free now
    gate.hold(False, 0.0)
