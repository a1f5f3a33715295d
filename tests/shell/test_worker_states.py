"""A Hypothesis state machine drives the worker through sleep/wake/generate/refit calls.

The fake engine raises ``FakeEngineMisuse`` whenever a call reaches it that a real engine
would turn into garbage or a crash, so the worker must refuse every such call itself. An
independent model of the rules (written here, not taken from core.lifecycle) predicts which
calls the worker refuses.
"""

from __future__ import annotations

import pytest
import torch
from helpers import base_config
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from genworker.shell.errors import EngineStateError, RefitError
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.worker import VllmGenerationWorker

DATA = {"input_ids": torch.tensor([[3, 4, 5], [6, 0, 0]]), "input_lengths": torch.tensor([3, 1])}


class WorkerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        factory = FakeEngineFactory(max_model_len=32)
        self.worker = VllmGenerationWorker(base_config(), engine_factory=factory)
        self.engine: FakeEngine = factory.started[0][1]
        self.engine.rpc_handlers["update_weights_via_ipc_zmq"] = self._refit_handler
        self.worker.prepare_refit_info({"w": ((2,), "float32")})
        self.refit_should_fail = False
        # The model: resident tags, weights validity, and shutdown.
        self.weights_awake = True
        self.kv_awake = True
        self.weights_ok = True  # False after a level-2 sleep or a failed refit
        self.down = False
        self.last_output: torch.Tensor | None = None
        self.version_at_last_output = -1

    def _refit_handler(self, timeout_s: float) -> None:
        if self.refit_should_fail:
            raise TimeoutError("trainer vanished")
        self.engine.load_new_weights()

    def _expect_refusal(self, allowed: bool, call: object) -> bool:
        if allowed:
            return True
        with pytest.raises(EngineStateError):
            call()  # type: ignore[operator]
        return False

    @rule(greedy=st.booleans())
    def generate(self, greedy: bool) -> None:
        allowed = not self.down and self.weights_awake and self.kv_awake and self.weights_ok
        if not allowed:
            calls = len(self.engine.calls)
            self._expect_refusal(False, lambda: self.worker.generate(DATA, greedy=greedy))
            assert len(self.engine.calls) == calls
            return
        out = self.worker.generate(DATA, greedy=True)
        if self.version_at_last_output == self.engine.weight_version:
            assert self.last_output is not None
            assert torch.equal(out["output_ids"], self.last_output)
        self.last_output = out["output_ids"]
        self.version_at_last_output = self.engine.weight_version

    @rule(level=st.sampled_from([1, 2]))
    def sleep(self, level: int) -> None:
        asleep = not self.weights_awake and not self.kv_awake
        # Sleeping with only the KV cache awake is refused (vLLM would keep it resident).
        allowed = not self.down and not (self.kv_awake and not self.weights_awake)
        if not self._expect_refusal(allowed, lambda: self.worker.sleep(level)):
            return
        self.worker.sleep(level)
        if not asleep:
            if level == 2:
                self.weights_ok = False
            self.weights_awake = self.kv_awake = False

    @rule(tags=st.sampled_from([None, ("weights",), ("kv_cache",), ("weights", "kv_cache")]))
    def wake(self, tags: tuple[str, ...] | None) -> None:
        if not self._expect_refusal(not self.down, lambda: self.worker.wake_up(tags)):
            return
        self.worker.wake_up(None if tags is None else list(tags))
        wanted = set(tags or ("weights", "kv_cache"))
        self.weights_awake |= "weights" in wanted
        self.kv_awake |= "kv_cache" in wanted

    @rule(fail=st.booleans())
    def refit(self, fail: bool) -> None:
        allowed = not self.down and self.weights_awake
        if not self._expect_refusal(allowed, lambda: self.worker.update_weights_via_ipc_zmq(1.0)):
            return
        self.refit_should_fail = fail
        if fail:
            with pytest.raises(RefitError):
                self.worker.update_weights_via_ipc_zmq(1.0)
            self.weights_ok = False
        else:
            assert self.worker.update_weights_via_ipc_zmq(1.0)
            self.weights_ok = True

    @rule()
    def reset_prefix_cache(self) -> None:
        if self._expect_refusal(not self.down, self.worker.reset_prefix_cache):
            self.worker.reset_prefix_cache()

    @precondition(lambda self: not self.down)
    @rule()
    def shutdown(self) -> None:
        assert self.worker.shutdown()
        self.down = True

    @invariant()
    def engine_agrees(self) -> None:
        if self.down:
            assert self.engine.shut_down
            assert not self.worker.is_alive()
            return
        expected = {
            t for t, on in (("weights", self.weights_awake), ("kv_cache", self.kv_awake)) if on
        }
        assert self.engine.awake_tags == expected
        assert self.worker.is_alive()


TestWorkerMachine = WorkerMachine.TestCase
