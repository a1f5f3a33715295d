"""The worker survives what a training loop throws at it (issue 21), on the real CPU engine.

Each test has a deadline (pytest-timeout, and an explicit thread deadline around every
call that used to hang) and ends by checking that the SAME worker object serves the next
valid batch with the baseline greedy tokens of raw vLLM.

- seeds past ``torch.Generator``'s range are refused up front, naming the rows; an error
  inside the engine's step (the same seed let through) aborts the batch's requests and the
  engine serves on; if the abort is impossible the worker is declared dead;
- calls are serialised: concurrent generates get their serial results, a refit during a
  generate waits for it or is refused (never runs under the forward), and a stress of
  threads mixing generate, counters, prefix-cache resets and refits ends consistent;
- ``input_ids`` dtypes that cannot hold ``vocab_size - 1`` are refused naming the dtype;
- meta, sparse and other exotic tensors, and non-mapping data, are typed errors.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import base_config, batch, right_padded
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from genworker.core import batch as core_batch
from genworker.core import lifecycle
from genworker.core.assembly import FlatGenerations
from genworker.core.counters import GENERATION_TOKENS, PROMPT_TOKENS
from genworker.core.engine_calls import Cache, EngineBatch, RpcCall
from genworker.core.sampling import SamplingSpec
from genworker.shell import vllm_engine
from genworker.shell.errors import (
    BadBatchError,
    EngineDeadError,
    EngineStateError,
    GenerationAbortedError,
)
from genworker.shell.media import RowMedia
from genworker.shell.staged_writes import pending_staged_writes
from genworker.shell.vllm_engine import VllmEngine, abort_unfinished
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

PAD = 2  # the tiny model's <pad>
MAX_MODEL_LEN = 256
MAX_NEW = 12
DEADLINE_S = 60.0
STRESS_S = 8.0
MIN_OPS = 6
PROMPTS = [[5, 17, 99, 240, 7], [300, 12], [45, 46, 47, 48, 49, 50, 51, 52, 53], [88]]


def config(**overrides: Any) -> dict[str, Any]:
    return base_config(
        model_name="tiny",
        max_new_tokens=MAX_NEW,
        _pad_token_id=PAD,
        vllm_cfg={"gpu_memory_utilization": 0.05, "max_model_len": MAX_MODEL_LEN},
        **overrides,
    )


class WatchedEngine(VllmEngine):
    """The session's engine through a second adapter that records overlapping engine
    calls, and whose ``generate`` can be held open (before it reaches vLLM)."""

    def __init__(self, llm: LLM) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.log: list[str] = []
        self._inside = 0
        self.most_inside = 0
        self._count = threading.Lock()
        super().__init__(llm)

    def _around(self, what: str, fn: Callable[[], Any]) -> Any:
        with self._count:
            self._inside += 1
            self.most_inside = max(self.most_inside, self._inside)
        self.log.append(f"{what} start")
        try:
            return fn()
        finally:
            self.log.append(f"{what} end")
            with self._count:
                self._inside -= 1

    def generate(self, batch: EngineBatch[RowMedia], *, use_tqdm: bool = False) -> FlatGenerations:
        def run() -> FlatGenerations:
            self.entered.set()
            assert self.gate.wait(DEADLINE_S), "the test never released generate"
            return super(WatchedEngine, self).generate(batch, use_tqdm=use_tqdm)

        result: FlatGenerations = self._around("generate", run)
        return result

    def metrics(self) -> Any:
        return self._around("metrics", super().metrics)

    def reset_cache(self, cache: Cache) -> None:
        self._around(cache.call, lambda: super(WatchedEngine, self).reset_cache(cache))

    def collective_rpc(self, call: RpcCall) -> list[object]:
        result: list[object] = self._around(
            f"rpc:{call.method}", lambda: super(WatchedEngine, self).collective_rpc(call)
        )
        return result


@pytest.fixture(scope="module")
def baseline(cpu_llm: LLM) -> list[list[int]]:
    """Raw vLLM's greedy tokens for PROMPTS."""
    cpu_llm.reset_prefix_cache()
    outs = cpu_llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture
def watched(cpu_llm: LLM) -> Iterator[WatchedEngine]:
    engine = WatchedEngine(cpu_llm)
    yield engine
    engine.gate.set()
    assert not cpu_llm.llm_engine.has_unfinished_requests()
    assert cpu_llm.collective_rpc(pending_staged_writes) == [0]
    cpu_llm.reset_prefix_cache()


def make_worker(engine: VllmEngine, **options: Any) -> VllmGenerationWorker:
    return VllmGenerationWorker(
        config(), engine_factory=ExistingEngine(engine), **{"busy_wait_s": DEADLINE_S, **options}
    )


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()`` on a daemon thread, failing the test if it does not return in time."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            box.append(("error", e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"HUNG: no answer within {seconds} s"
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def generated(out: dict[str, torch.Tensor], prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    rows = []
    for i, p in enumerate(prompts):
        g = int(out["generation_lengths"][i])
        rows.append(out["output_ids"][i, len(p) : len(p) + g].tolist())
    return rows


def assert_serves_baseline(worker: VllmGenerationWorker, baseline: list[list[int]]) -> None:
    """The worker answers the next valid batch, within the deadline, with raw vLLM's
    greedy tokens."""
    out = within(DEADLINE_S, lambda: worker.generate(right_padded(PROMPTS, pad=PAD), greedy=True))
    assert generated(out, PROMPTS) == baseline
    assert worker.state == lifecycle.AWAKE
    assert worker.is_alive()


# -- the refit: the IPC sender (RefitSender.ipc), in one place -----------------------------
def refit_with_own_weights(
    worker: VllmGenerationWorker, model_dir: Path, timeout_s: float = DEADLINE_S
) -> None:
    """One IPC refit that sends the model's own weights (outputs must not change)."""
    from safetensors.torch import load_file

    from genworker.shell.refit import RefitSender

    weights = load_file(str(model_dir / "model.safetensors"))
    info = {n: (t.shape, t.dtype) for n, t in weights.items()}
    worker.prepare_refit_info(info)
    (address,) = worker.refit_address()
    sent: list[int] = []
    failed: list[BaseException] = []

    def send() -> None:
        try:
            with RefitSender.ipc(str(address), manifest=info, timeout_s=timeout_s) as sender:
                sent.append(sender.send(weights.items()).tensors)
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        assert worker.update_weights_via_ipc_zmq(timeout_s=timeout_s) is True
    finally:
        thread.join(timeout_s)
    assert not failed, failed
    assert sent == [len(weights)]


# -- item 2: seeds, and errors inside the engine's step ------------------------------------
@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, 2**64, 2**70, -1])
def test_a_seed_out_of_the_generator_range_is_refused_naming_the_row(
    seed: int, watched: WatchedEngine, baseline: list[list[int]]
) -> None:
    worker = make_worker(watched)
    data = {**right_padded(PROMPTS, pad=PAD), "seeds": [1, seed, None, 3]}
    with pytest.raises(BadBatchError, match=rf"row 1 \(seed {seed}\)") as info:
        within(DEADLINE_S, lambda: worker.generate(data))
    assert "2**63" in str(info.value)
    assert "generate start" not in watched.log  # refused before the engine
    assert_serves_baseline(worker, baseline)


def test_the_largest_seed_samples(watched: WatchedEngine, baseline: list[list[int]]) -> None:
    worker = make_worker(watched)
    data = {**right_padded(PROMPTS, pad=PAD), "seeds": [2**63 - 1, 0, 2**62, None]}
    first = within(DEADLINE_S, lambda: worker.generate(data))
    again = within(DEADLINE_S, lambda: worker.generate(data))
    assert generated(first, PROMPTS)[:3] == generated(again, PROMPTS)[:3]
    assert_serves_baseline(worker, baseline)


def test_the_seed_that_hung_the_engine_now_aborts_its_batch_and_the_worker_serves_on(
    watched: WatchedEngine,
    cpu_llm: LLM,
    baseline: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Let 2**64 through the worker's own bound: vLLM raises in execute_model after it
    admitted the batch. The requests are aborted; the error is not a bad batch."""
    worker = make_worker(watched)
    monkeypatch.setattr(core_batch, "SEED_LIMIT", 2**65)
    data = {**right_padded(PROMPTS, pad=PAD), "seeds": [1, 2**64, None, 2**64]}
    with pytest.raises(GenerationAbortedError) as info:
        within(DEADLINE_S, lambda: worker.generate(data))
    assert not isinstance(info.value, BadBatchError)
    assert "unfinished requests were aborted" in str(info.value)
    assert "Overflow" in str(info.value)
    assert not cpu_llm.llm_engine.has_unfinished_requests()
    assert cpu_llm.collective_rpc(pending_staged_writes) == [0]  # issue 18
    assert_serves_baseline(worker, baseline)


def _runner_module(worker: object) -> str:
    return type(getattr(worker, "model_runner", None)).__module__


def test_a_step_that_raised_while_adding_its_requests_leaves_no_staged_writes(
    cpu_engine: VllmEngine, cpu_llm: LLM, baseline: list[list[int]]
) -> None:
    """Issue 18: vLLM's V2 GPU model runner (0.25's default on CUDA) keeps the writes it
    staged for the requests of a step that raised while adding them, and lays them over
    the next request to take the slot (row 0 of the next batch, a race). The recovery
    drops them. The CPU engine's V1 runner stages none: there this checks raw vLLM's
    error, the recovery and the next batch."""
    (module,) = cpu_llm.collective_rpc(_runner_module)
    staging = module.startswith("vllm.v1.worker.gpu.")
    request = [TokensPrompt(prompt_token_ids=[5, 6])]
    params = SamplingParams(temperature=1.0, seed=2**64, max_tokens=4)
    with pytest.raises((OverflowError, RuntimeError, ValueError), match=r"[Oo]verflow|too large"):
        within(DEADLINE_S, lambda: cpu_llm.generate(request, params, use_tqdm=False))
    assert cpu_llm.llm_engine.has_unfinished_requests()
    (staged,) = cpu_llm.collective_rpc(pending_staged_writes)
    assert (staged > 0) == staging, (module, staged)
    assert len(abort_unfinished(cpu_llm, "generate", OverflowError("seed 2**64"))) == 1
    assert not cpu_llm.llm_engine.has_unfinished_requests()
    assert cpu_llm.collective_rpc(pending_staged_writes) == [0]
    assert_serves_baseline(make_worker(cpu_engine), baseline)


def test_an_engine_that_cannot_abort_is_declared_dead(
    cpu_engine: VllmEngine,
    cpu_llm: LLM,
    baseline: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = make_worker(cpu_engine)
    engine = cpu_llm.llm_engine

    def broken(request_ids: list[str], internal: bool = False) -> None:
        raise RuntimeError("abort is broken here")

    monkeypatch.setattr(core_batch, "SEED_LIMIT", 2**65)
    monkeypatch.setattr(engine, "abort_request", broken)
    try:
        with pytest.raises(EngineDeadError, match="could not be aborted: RuntimeError"):
            within(
                DEADLINE_S, lambda: worker.generate({**right_padded([[5, 6]]), "seeds": [2**64]})
            )
        assert not worker.is_alive()
        with pytest.raises(EngineDeadError, match="re-create the worker"):
            worker.generate(right_padded(PROMPTS, pad=PAD), greedy=True)
    finally:
        monkeypatch.undo()
        # The recovery a working abort gets (abort, then drop the runner's staged writes:
        # issue 18), for the new worker below.
        abort_unfinished(cpu_llm, "generate", RuntimeError("abort is broken here"))
    assert not engine.has_unfinished_requests()
    assert cpu_llm.collective_rpc(pending_staged_writes) == [0]
    assert_serves_baseline(make_worker(cpu_engine), baseline)  # a new worker, same engine


def test_a_drop_of_staged_writes_that_does_not_answer_is_bounded_and_dead(
    cpu_engine: VllmEngine,
    cpu_llm: LLM,
    baseline: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The recovery's RPC has a bound too (E5): past it the engine is dead, and the call
    stays recorded as running (a later call, and shutdown's cleanup, would queue behind
    it)."""
    request = [TokensPrompt(prompt_token_ids=[5, 6])]
    params = SamplingParams(temperature=1.0, seed=2**64, max_tokens=4)
    with pytest.raises((OverflowError, RuntimeError, ValueError), match=r"[Oo]verflow|too large"):
        within(DEADLINE_S, lambda: cpu_llm.generate(request, params, use_tqdm=False))
    assert cpu_llm.llm_engine.has_unfinished_requests()
    release = threading.Event()
    real = cpu_llm.collective_rpc

    def wedged(method: Any, *args: Any, **kwargs: Any) -> list[Any]:
        release.wait(DEADLINE_S)
        return real(method, *args, **kwargs)

    monkeypatch.setattr(cpu_llm, "collective_rpc", wedged)
    monkeypatch.setattr(vllm_engine, "CALL_BOUND_S", 0.2)
    inflight: list[tuple[threading.Event, float]] = []
    cause = OverflowError("seed 2**64")
    try:
        with pytest.raises(EngineDeadError, match=r"drop_staged_writes.*did not answer within"):
            within(
                DEADLINE_S, lambda: abort_unfinished(cpu_llm, "generate", cause, inflight=inflight)
            )
        ((done, _),) = inflight
        assert not done.is_set(), "the call is still recorded as running"
    finally:
        release.set()
    assert done.wait(DEADLINE_S)
    monkeypatch.undo()
    assert not cpu_llm.llm_engine.has_unfinished_requests()
    assert cpu_llm.collective_rpc(pending_staged_writes) == [0]
    assert_serves_baseline(make_worker(cpu_engine), baseline)


def test_a_request_vllm_rejects_at_admission_stays_a_bad_batch(
    watched: WatchedEngine, baseline: list[list[int]]
) -> None:
    """A request error before anything ran: BadBatchError, nothing left in the engine."""
    prompts = [[5, 6], [7] * (MAX_MODEL_LEN + 4)]
    spec = SamplingSpec(temperature=0.0, top_p=1.0, top_k=1, max_tokens=4)
    with pytest.raises(BadBatchError, match="vLLM rejected the request"):
        within(DEADLINE_S, lambda: watched.generate(batch(prompts, [spec, spec])))
    assert_serves_baseline(make_worker(watched), baseline)


# -- item 3: one call at a time ------------------------------------------------------------
def test_concurrent_generates_get_their_serial_results(
    watched: WatchedEngine, baseline: list[list[int]]
) -> None:
    worker = make_worker(watched)
    data = right_padded(PROMPTS, pad=PAD)
    results: list[Any] = [None] * 4

    def run(i: int) -> None:
        results[i] = worker.generate(data, greedy=True)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive(), "HUNG"
    assert [generated(r, PROMPTS) for r in results] == [baseline] * 4
    assert watched.most_inside == 1
    assert_serves_baseline(worker, baseline)


def test_a_refit_during_a_generate_is_refused_and_never_runs_under_it(
    watched: WatchedEngine, baseline: list[list[int]], tiny_model_dir: Path
) -> None:
    worker = make_worker(watched, busy_wait_s=0.5)
    watched.gate.clear()
    gen = threading.Thread(
        target=lambda: results.append(worker.generate(right_padded(PROMPTS, pad=PAD), greedy=True)),
        daemon=True,
    )
    results: list[dict[str, torch.Tensor]] = []
    gen.start()
    assert watched.entered.wait(DEADLINE_S)
    with pytest.raises(EngineStateError, match=r"busy with generate\(\)"):
        worker.update_weights_via_ipc_zmq(timeout_s=5.0)
    assert worker.state == lifecycle.AWAKE  # not refitting, weights not inconsistent
    assert not any(e.startswith("rpc:") for e in watched.log)
    watched.gate.set()
    gen.join(DEADLINE_S)
    assert not gen.is_alive(), "HUNG"
    assert generated(results[0], PROMPTS) == baseline
    refit_with_own_weights(worker, tiny_model_dir)
    assert_serves_baseline(worker, baseline)


def test_a_refit_during_a_generate_waits_and_runs_after_it(
    watched: WatchedEngine, baseline: list[list[int]], tiny_model_dir: Path
) -> None:
    worker = make_worker(watched)
    watched.gate.clear()
    gen = threading.Thread(
        target=lambda: worker.generate(right_padded(PROMPTS, pad=PAD), greedy=True), daemon=True
    )
    gen.start()
    assert watched.entered.wait(DEADLINE_S)
    refit_error: list[BaseException] = []

    def refit() -> None:
        try:
            refit_with_own_weights(worker, tiny_model_dir)
        except BaseException as e:  # noqa: BLE001 - asserted below
            refit_error.append(e)

    refitting = threading.Thread(target=refit, daemon=True)
    refitting.start()
    time.sleep(0.5)
    assert refitting.is_alive()
    watched.gate.set()
    gen.join(DEADLINE_S)
    refitting.join(DEADLINE_S)
    assert not gen.is_alive()
    assert not refitting.is_alive(), "HUNG"
    assert not refit_error, refit_error
    refit_start = watched.log.index("rpc:update_weights_via_ipc_zmq start")
    assert watched.log.index("generate end") < refit_start
    assert_serves_baseline(worker, baseline)


def _token_totals(worker: VllmGenerationWorker) -> tuple[float, float]:
    counters = worker.get_counters()

    def total(name: str) -> float:
        return sum(
            v for k, v in counters.items() if k.startswith(name + "{") and isinstance(v, float)
        )

    return total(PROMPT_TOKENS), total(GENERATION_TOKENS)


def test_threads_mixing_generate_counters_resets_and_refits_leave_a_consistent_worker(
    watched: WatchedEngine, baseline: list[list[int]], tiny_model_dir: Path, cpu_llm: LLM
) -> None:
    """Four threads for a bounded time: greedy and seeded generates, counters, prefix-cache
    resets, and refits of the model's own weights. Every call succeeds (the lock makes
    them wait; no refusal within DEADLINE_S), none overlaps in the engine, greedy rows
    always equal the baseline, and the token counters add up to what the calls got."""
    worker = make_worker(watched)
    assert_serves_baseline(worker, baseline)  # warm: the first generate pays one-off costs
    prompts_before, generated_before = _token_totals(worker)
    # Each thread runs for STRESS_S and at least MIN_OPS calls (thread 0: one refit among
    # its first three), and stops at the hard deadline whatever the machine's load.
    stop, hard_stop = time.monotonic() + STRESS_S, time.monotonic() + STRESS_S + DEADLINE_S
    outcomes: Counter[str] = Counter()
    errors: list[tuple[str, BaseException]] = []
    tokens = {"prompt": 0, "generated": 0}
    tally = threading.Lock()

    def count(rows: Sequence[Sequence[int]], out: dict[str, torch.Tensor]) -> None:
        with tally:
            tokens["prompt"] += sum(len(r) for r in rows)
            tokens["generated"] += int(out["generation_lengths"].sum())

    def greedy_baseline(rng: random.Random) -> None:
        out = worker.generate(right_padded(PROMPTS, pad=PAD), greedy=True)
        assert generated(out, PROMPTS) == baseline
        count(PROMPTS, out)

    def sampled(rng: random.Random) -> None:
        rows = rng.sample(PROMPTS, rng.randint(1, len(PROMPTS)))
        seeds = [rng.choice([None, rng.randrange(2**63)]) for _ in rows]
        out = worker.generate({**right_padded(rows, pad=PAD), "seeds": seeds})
        count(rows, out)

    def counters(rng: random.Random) -> None:
        assert any(k.startswith(PROMPT_TOKENS) for k in worker.get_counters())

    def reset_prefix_cache(rng: random.Random) -> None:
        worker.reset_prefix_cache()

    def refit(rng: random.Random) -> None:
        refit_with_own_weights(worker, tiny_model_dir)

    def run(index: int) -> None:
        rng = random.Random(index)
        ops = [greedy_baseline, sampled, sampled, counters, reset_prefix_cache]
        refits = done = 0
        while (time.monotonic() < stop or done < MIN_OPS) and time.monotonic() < hard_stop:
            op = rng.choice(ops)
            if index == 0 and refits < 3 and (done == 2 or rng.random() < 0.25):
                op, refits = refit, refits + 1
            done += 1
            try:
                op(rng)
            except BaseException as e:  # noqa: BLE001 - every error fails the test below
                errors.append((op.__name__, e))
                return
            with tally:
                outcomes[op.__name__] += 1

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S + 10.0)
    assert not any(t.is_alive() for t in threads), f"HUNG after {dict(outcomes)}"
    assert not errors, errors
    assert sum(outcomes.values()) >= 4 * MIN_OPS, dict(outcomes)
    assert outcomes["refit"] >= 1, dict(outcomes)
    assert watched.most_inside == 1
    # State consistent at the end: awake with valid weights, nothing left in the engine,
    # and the counters saw exactly the tokens the calls got back.
    assert worker.state == lifecycle.AWAKE
    assert not cpu_llm.llm_engine.has_unfinished_requests()
    prompts_after, generated_after = _token_totals(worker)
    assert prompts_after - prompts_before == tokens["prompt"]
    assert generated_after - generated_before == tokens["generated"]
    print(f"stress outcomes: {dict(outcomes)}")
    assert_serves_baseline(worker, baseline)


# -- item 4: dtypes that cannot hold the vocabulary ----------------------------------------
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_a_dtype_that_cannot_hold_the_vocabulary_is_refused_naming_it(
    dtype: torch.dtype, watched: WatchedEngine, baseline: list[list[int]]
) -> None:
    worker = make_worker(watched)
    small = [[5, 17, 99], [12]]
    data = right_padded(small, pad=PAD)
    data["input_ids"] = data["input_ids"].to(dtype)
    with pytest.raises(BadBatchError, match=rf"input_ids dtype {dtype} cannot hold") as info:
        within(DEADLINE_S, lambda: worker.generate(data, greedy=True))
    assert "vocab_size - 1" in str(info.value)
    assert "generate start" not in watched.log
    assert_serves_baseline(worker, baseline)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32])
def test_a_dtype_that_holds_the_vocabulary_gives_the_same_tokens_in_that_dtype(
    dtype: torch.dtype, watched: WatchedEngine, baseline: list[list[int]]
) -> None:
    worker = make_worker(watched)
    data = right_padded(PROMPTS, pad=PAD)
    data["input_ids"] = data["input_ids"].to(dtype)
    out = within(DEADLINE_S, lambda: worker.generate(data, greedy=True))
    assert out["output_ids"].dtype == dtype
    assert generated(out, PROMPTS) == baseline
    assert_serves_baseline(worker, baseline)


# -- item 8: exotic tensors and non-mapping data -------------------------------------------
def _exotic(kind: str, t: torch.Tensor) -> torch.Tensor:
    if kind == "meta":
        return t.to("meta")
    if kind == "sparse":
        return t.to_sparse()
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode().from_tensor(t)


@pytest.mark.parametrize("kind", ["meta", "sparse", "fake"])
@pytest.mark.parametrize("key", ["input_ids", "input_lengths"])
def test_exotic_tensors_are_typed_errors_naming_the_input(
    kind: str, key: str, watched: WatchedEngine, baseline: list[list[int]]
) -> None:
    worker = make_worker(watched)
    data = right_padded(PROMPTS, pad=PAD)
    data[key] = _exotic(kind, data[key])
    with pytest.raises(BadBatchError, match=rf"{key} must be a dense tensor holding data"):
        within(DEADLINE_S, lambda: worker.generate(data))
    assert_serves_baseline(worker, baseline)


@pytest.mark.parametrize("data", [None, [], "Once upon a time", 7])
def test_non_mapping_data_is_a_typed_error(
    data: Any, watched: WatchedEngine, baseline: list[list[int]]
) -> None:
    worker = make_worker(watched)
    with pytest.raises(BadBatchError, match="generate_text: data must be a mapping"):
        within(DEADLINE_S, lambda: worker.generate_text(data))
    with pytest.raises(BadBatchError, match="generate: data must be a mapping"):
        within(DEADLINE_S, lambda: worker.generate(data))
    for bad in ({"prompts": None}, {"prompts": [None]}, {"prompts": ["ok", 3]}):
        with pytest.raises(BadBatchError, match=r"data\['prompts'\]"):
            worker.generate_text(bad)
    assert isinstance(within(DEADLINE_S, lambda: worker.generate_text({"prompts": ["Once"]})), dict)
    assert_serves_baseline(worker, baseline)
