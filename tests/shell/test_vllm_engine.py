"""The vLLM adapter against the raw ``vllm.LLM`` it wraps (one CPU engine per session)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from helpers import batch, flat_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import LLM
from vllm.inputs import TokensPrompt

from genworker.core.counters import GENERATION_TOKENS, PROMPT_TOKENS, CounterSample
from genworker.core.engine_calls import Cache, EngineBatch, RpcCall
from genworker.core.sampling import SamplingSpec
from genworker.shell import vllm_engine
from genworker.shell.errors import (
    BadBatchError,
    BadConfigError,
    EngineDeadError,
    GenworkerError,
    UnsupportedError,
)
from genworker.shell.vllm_engine import (
    VllmEngine,
    VllmEngineFactory,
    engine_arg_names,
    sampling_params,
)

pytestmark = pytest.mark.engine

VOCAB = 512
FIRST_ORDINARY_TOKEN = 3  # after <s>, </s>, <pad>


def greedy(max_tokens: int, **kw: object) -> SamplingSpec:
    return SamplingSpec(temperature=0.0, top_p=1.0, top_k=1, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


Row = tuple[list[int], list[float], bool]  # token ids, sampled logprobs, truncated


def raw_generate(
    llm: LLM, prompts: Sequence[Sequence[int]], specs: Sequence[SamplingSpec]
) -> list[Row]:
    """Tokens, sampled-token logprobs (read through the per-position dicts: the specs ask
    for no flat logprobs) and "finished on length", from ``llm.generate``, one params per
    row."""
    params = [sampling_params(s) for s in specs]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    rows: list[Row] = []
    for out in outs:
        c = out.outputs[0]
        assert isinstance(c.logprobs, list)
        logprobs = [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs, strict=True)]
        rows.append((list(c.token_ids), logprobs, c.finish_reason == "length"))
    return rows


def adapter_rows(
    engine: VllmEngine, prompts: Sequence[Sequence[int]], specs: Sequence[SamplingSpec]
) -> list[Row]:
    return flat_rows(engine.generate(batch(prompts, specs)))


def as_float32(rows: list[Row]) -> list[object]:
    return [(t, np.asarray(lp, dtype=np.float32).tolist(), r) for t, lp, r in rows]


prompt_st = st.lists(st.integers(FIRST_ORDINARY_TOKEN, VOCAB - 1), min_size=1, max_size=24)
greedy_st = st.builds(greedy, st.integers(1, 8))
seeded_st = st.builds(
    SamplingSpec,
    temperature=st.sampled_from([0.5, 1.0, 1.5]),
    top_p=st.sampled_from([0.8, 1.0]),
    top_k=st.sampled_from([-1, 5, 50]),
    max_tokens=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)


def check_differential(
    engine: VllmEngine, llm: LLM, prompts: list[list[int]], specs: list[SamplingSpec]
) -> None:
    engine.reset_cache(Cache.PREFIX)  # the same prefill work on both sides
    ours = adapter_rows(engine, prompts, specs)
    engine.reset_cache(Cache.PREFIX)
    theirs = raw_generate(llm, prompts, specs)
    assert ours == as_float32(theirs)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_greedy_matches_raw_vllm(cpu_engine: VllmEngine, cpu_llm: LLM, data: st.DataObject) -> None:
    prompts = data.draw(st.lists(prompt_st, min_size=1, max_size=4))
    specs = data.draw(st.lists(greedy_st, min_size=len(prompts), max_size=len(prompts)))
    check_differential(cpu_engine, cpu_llm, prompts, specs)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_seeded_sampling_matches_raw_vllm(
    cpu_engine: VllmEngine, cpu_llm: LLM, data: st.DataObject
) -> None:
    prompts = data.draw(st.lists(prompt_st, min_size=1, max_size=4))
    # Rows may share a spec object (one SamplingParams) or differ; mixed with greedy rows.
    specs = data.draw(st.lists(seeded_st | greedy_st, min_size=len(prompts), max_size=len(prompts)))
    check_differential(cpu_engine, cpu_llm, prompts, specs)


def test_capabilities_describe_the_cpu_engine(cpu_engine: VllmEngine) -> None:
    caps = cpu_engine.capabilities
    assert caps.device == "cpu"
    assert caps.sleep_mode is False
    assert caps.vocab_size == VOCAB
    assert caps.max_model_len == 256
    assert caps.flat_logprobs is True
    assert caps.sampling_args is not None
    assert {"temperature", "max_tokens", "flat_logprobs"} <= caps.sampling_args


def test_engine_arg_names_are_engine_args_fields() -> None:
    names = engine_arg_names()
    assert {"model", "max_model_len", "gpu_memory_utilization", "seed"} <= names


def test_finish_reasons(cpu_engine: VllmEngine) -> None:
    prompt = [10, 11, 12, 13]
    ((first, _, first_truncated),) = adapter_rows(cpu_engine, [prompt], [greedy(4)])
    assert first_truncated
    assert len(first) == 4
    stop_at = first[1]
    ((stopped, _, truncated),) = adapter_rows(
        cpu_engine, [prompt], [greedy(4, stop_token_ids=(stop_at,))]
    )
    assert not truncated
    assert stopped == first[: len(stopped)]
    assert stopped[-1] == stop_at


def test_generate_text_matches_raw_vllm(cpu_engine: VllmEngine, cpu_llm: LLM) -> None:
    prompts = ["The quick brown fox", "Hello world!"]
    specs = [greedy(6, detokenize=True), greedy(3, detokenize=True)]
    ours = cpu_engine.generate_text(batch(cpu_engine.tokenize(prompts), specs))
    raw = cpu_llm.generate(prompts, [sampling_params(s) for s in specs], use_tqdm=False)
    assert ours == [o.outputs[0].text for o in raw]


def test_generate_text_refuses_specs_that_do_not_detokenize(cpu_engine: VllmEngine) -> None:
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        cpu_engine.generate_text(batch([[5], [6]], [greedy(2, detokenize=True), greedy(2)]))
    texted = greedy(2, detokenize=True)
    with pytest.raises(ValueError, match=r"sample counts \(2,\)"):  # never read as one each
        cpu_engine.generate_text(EngineBatch(([5],), (texted,), None, (2,)))


# --- what vLLM is asked for, and the collector around the call ---


def _spy(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, then: Callable[[list[object]], list[object]]
) -> list[tuple[object, bool]]:
    """Wrap this ``llm``'s ``generate`` (an instance attribute): record the params it gets
    and whether the collector was on, then pass vLLM's outputs through ``then``."""
    seen: list[tuple[object, bool]] = []
    original = llm.generate

    def generate(prompts: object, params: object, **kwargs: object) -> list[object]:
        seen.append((params, gc.isenabled()))
        return then(original(prompts, params, **kwargs))  # type: ignore[arg-type]

    monkeypatch.setattr(llm, "generate", generate)
    return seen


def test_only_rows_with_stop_strings_are_detokenized(
    cpu_engine: VllmEngine, cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _spy(cpu_llm, monkeypatch, lambda outs: outs)
    specs = [greedy(3), greedy(3, stop=("zz",)), greedy(3), greedy(3, detokenize=True)]
    flat = cpu_engine.generate(batch([[5, 6], [7, 8], [9, 10], [11]], specs))
    assert flat.batch_size == 4
    ((params, _),) = seen
    assert isinstance(params, list)
    assert [p.detokenize for p in params] == [False, True, False, True]
    assert [p.stop for p in params] == [[], ["zz"], [], []]
    assert all(p.flat_logprobs for p in params)
    assert params[0] is params[2]  # equal specs share one SamplingParams


def test_the_collector_is_off_inside_llm_generate_and_on_after(
    cpu_engine: VllmEngine, cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _spy(cpu_llm, monkeypatch, lambda outs: outs)
    assert gc.isenabled()
    threshold = gc.get_threshold()
    assert cpu_engine.generate(batch([[5, 6]], [greedy(2)])).lengths.tolist() == [2]
    assert [enabled for _, enabled in seen] == [False]
    assert gc.isenabled()
    assert gc.get_threshold() == threshold


def test_vllms_outputs_are_freed_as_they_are_read(
    cpu_engine: VllmEngine, cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each row's completion is dropped once converted: nothing of vLLM's outputs is left
    alive when generate returns (no collection needed: the refs die with the row)."""
    refs: list[weakref.ref[object]] = []

    def watch(outs: list[object]) -> list[object]:
        refs.extend(weakref.ref(o.outputs[0]) for o in outs)  # type: ignore[attr-defined]
        refs.extend(weakref.ref(o) for o in outs)
        return outs

    _spy(cpu_llm, monkeypatch, watch)
    gc.disable()  # the refs must die by reference counting alone
    try:
        flat = cpu_engine.generate(batch([[5, 6], [7, 8, 9]], [greedy(3), greedy(2)]))
        assert len(refs) == 4
        assert [r() for r in refs] == [None] * 4
    finally:
        gc.enable()
    assert flat.lengths.tolist() == [3, 2]  # the arrays own their data
    assert len(flat.token_ids) == 5


def _unfinished(outs: list[object]) -> list[object]:
    outs[-1].outputs[0].finish_reason = None  # type: ignore[attr-defined]
    return outs


def _raising(outs: list[object]) -> list[object]:
    raise RuntimeError("the engine step failed")


@pytest.mark.parametrize("enabled", [True, False], ids=["gc-on", "gc-off"])
@pytest.mark.parametrize(
    ("then", "prompt", "error"),
    [
        (lambda outs: outs, [5, VOCAB + 1], BadBatchError),  # vLLM rejects the request
        (_raising, [5], Exception),  # an error out of the engine call
        (_unfinished, [5], GenworkerError),  # the conversion refuses the outputs
    ],
    ids=["rejected", "engine-error", "conversion-error"],
)
def test_the_collector_state_is_restored_when_generate_raises(
    cpu_engine: VllmEngine,
    cpu_llm: LLM,
    monkeypatch: pytest.MonkeyPatch,
    then: Callable[[list[object]], list[object]],
    prompt: list[int],
    error: type[Exception],
    enabled: bool,
) -> None:
    seen = _spy(cpu_llm, monkeypatch, then)
    if not enabled:
        gc.disable()
    try:
        with pytest.raises(error):
            cpu_engine.generate(batch([[7, 8], prompt], [greedy(2), greedy(2)]))
        assert gc.isenabled() is enabled
        assert [on for _, on in seen] == [False]
    finally:
        gc.enable()
    monkeypatch.undo()
    assert cpu_engine.generate(batch([[7, 8]], [greedy(2)])).lengths.tolist() == [2]


def _counter(samples: Sequence[object], name: str) -> float:
    return sum(s.value for s in samples if isinstance(s, CounterSample) and s.name == name)


def test_metrics_count_a_batch_tokens(cpu_engine: VllmEngine) -> None:
    prompts = [[20, 21, 22], [30, 31, 32, 33, 34]]
    before = cpu_engine.metrics()
    gens = cpu_engine.generate(batch(prompts, [greedy(5), greedy(2)]))
    after = cpu_engine.metrics()
    assert _counter(after, PROMPT_TOKENS) - _counter(before, PROMPT_TOKENS) == 8
    generated = int(gens.lengths.sum())
    assert _counter(after, GENERATION_TOKENS) - _counter(before, GENERATION_TOKENS) == generated


@pytest.mark.parametrize(
    ("prompt", "why"),
    [([5, VOCAB + 100, 6], "token id out of vocabulary"), ([5] * 300, "prompt over max_model_len")],
)
def test_bad_request_is_bad_batch_and_engine_keeps_serving(
    cpu_engine: VllmEngine, prompt: list[int], why: str
) -> None:
    good = [7, 8, 9]
    with pytest.raises(BadBatchError) as info:
        cpu_engine.generate(batch([good, prompt], [greedy(3), greedy(3)]))
    assert info.value.__cause__ is not None, why
    assert cpu_engine.generate(batch([good], [greedy(3)])).lengths.tolist() == [3]


def test_sleep_is_unsupported_on_cpu(cpu_engine: VllmEngine) -> None:
    with pytest.raises(UnsupportedError):
        cpu_engine.sleep(1)
    with pytest.raises(UnsupportedError):
        cpu_engine.wake_up(None)


def test_collective_rpc_answers_from_every_worker(cpu_engine: VllmEngine) -> None:
    assert cpu_engine.collective_rpc(RpcCall("check_health", timeout=60)) == [None]
    (inspection,) = cpu_engine.collective_rpc(RpcCall("get_model_inspection"))
    assert isinstance(inspection, str)
    assert "LlamaForCausalLM" in inspection


def test_profiling_without_a_profiler_is_unsupported(cpu_engine: VllmEngine) -> None:
    with pytest.raises(UnsupportedError, match="profil"):
        cpu_engine.start_profile()
    with pytest.raises(UnsupportedError, match="profil"):
        cpu_engine.stop_profile()


def test_the_workers_answer_the_wake_installer_which_installs_nothing_without_cuda(
    cpu_engine: VllmEngine,
) -> None:
    # genworker.shell.cumem_wake: the extension's target; CUDA's allocator only
    assert cpu_engine.collective_rpc(RpcCall("install_wake", timeout=60)) == [False]


def test_a_subclass_whose_overrides_need_its_own_state_starts_on_a_sleep_mode_engine(
    cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sleep-mode engine installs the wake in its workers at start: not through a method
    # a subclass may override before its own __init__ has run (the GPU suite's adapters).
    from vllm.platforms import current_platform  # the object vllm_engine reads

    monkeypatch.setattr(current_platform, "is_sleep_mode_available", lambda: True)
    monkeypatch.setattr(cpu_llm.llm_engine.vllm_config.model_config, "enable_sleep_mode", True)

    class Recording(VllmEngine):
        def __init__(self, llm: LLM) -> None:
            super().__init__(llm)
            self.calls: list[str] = []

        def collective_rpc(self, call: RpcCall) -> list[object]:
            self.calls.append(call.method)
            return super().collective_rpc(call)

    engine = Recording(cpu_llm)
    assert engine.capabilities.sleep_mode
    assert engine.collective_rpc(RpcCall("install_wake", timeout=60)) == [False]
    assert engine.calls == ["install_wake"]


# -- engines this module may kill: adapters of their own over the session's engine ------

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


def within(seconds: float, fn: Callable[[], object]) -> BaseException | None:
    """What ``fn()`` raised (None: it returned), run on a daemon thread; fails the test
    when it does not return within ``seconds``."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"HUNG: no answer within {seconds} s"
    return raised[0] if raised else None


@pytest.fixture
def stops(cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The engine's stop, recorded and not done: the session's engine stays up."""
    assert cpu_llm.llm_engine.vllm_config.parallel_config.worker_extension_cls, "cleanup runs"
    assert getattr(cpu_llm, "shutdown", None) is None  # LLM has none in 0.32: its core's
    done: list[str] = []
    core = cpu_llm.llm_engine.engine_core  # type: ignore[attr-defined]
    monkeypatch.setattr(core, "shutdown", lambda: done.append("stop"))
    return done


def sleep_mode_on(cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine as a CUDA engine with sleep mode looks to the adapter."""
    from vllm.platforms import current_platform  # the object vllm_engine reads

    monkeypatch.setattr(current_platform, "is_sleep_mode_available", lambda: True)
    monkeypatch.setattr(cpu_llm.llm_engine.vllm_config.model_config, "enable_sleep_mode", True)


class Wedged:
    """``LLM.collective_rpc`` that never answers the named methods (until released)."""

    def __init__(self, llm: LLM, methods: set[str] | None = None) -> None:
        self.real = llm.collective_rpc
        self.methods = methods
        self.called: list[str] = []
        self.release = threading.Event()

    def __call__(
        self,
        method: str | Callable[..., object],
        timeout: float | None = None,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> list[object]:
        name = method if isinstance(method, str) else method.__name__
        self.called.append(name)
        if self.methods is None or name in self.methods:
            self.release.wait(60)
            return []
        if isinstance(method, str):
            return self.real(method, timeout, args, kwargs)
        return list(self.real(method, timeout, args, kwargs))


def test_collective_rpc_expiry_is_engine_dead(
    cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch, stops: list[str]
) -> None:
    engine = VllmEngine(cpu_llm)
    wedged = Wedged(cpu_llm)
    monkeypatch.setattr(cpu_llm, "collective_rpc", wedged)
    try:
        with pytest.raises(EngineDeadError, match="update_weights"):
            engine.collective_rpc(RpcCall("update_weights", timeout=0.2))
        with pytest.raises(EngineDeadError, match="died earlier"):
            engine.collective_rpc(RpcCall("check_health", timeout=60))
        with pytest.raises(EngineDeadError, match="died earlier"):
            engine.generate(batch([[5, 6]], [greedy(2)]))
    finally:
        wedged.release.set()
    assert wedged.called == ["update_weights"]


def test_shutdown_after_an_expired_call_skips_cleanup_and_stops_the_engine(
    cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch, stops: list[str]
) -> None:
    """The expired call still occupies the engine and ``cleanup`` would queue behind it
    (E4/E5 in failure-modes.md): shutdown skips it and reaches the engine's stop."""
    engine = VllmEngine(cpu_llm)
    wedged = Wedged(cpu_llm)
    monkeypatch.setattr(cpu_llm, "collective_rpc", wedged)
    try:
        with pytest.raises(EngineDeadError, match=r"did not answer within 0\.2 s"):
            engine.collective_rpc(RpcCall("update_weights", timeout=0.2))
        assert within(5, engine.shutdown) is None
        assert within(5, engine.shutdown) is None, "idempotent"
    finally:
        wedged.release.set()
    assert stops == ["stop"]
    assert wedged.called == ["update_weights"], "no cleanup behind the wedged call"


def test_a_cleanup_that_does_not_answer_is_bounded_and_the_engine_still_stops(
    cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch, stops: list[str]
) -> None:
    engine = VllmEngine(cpu_llm)
    wedged = Wedged(cpu_llm, {"cleanup"})
    monkeypatch.setattr(cpu_llm, "collective_rpc", wedged)
    monkeypatch.setattr(vllm_engine, "CALL_BOUND_S", 0.2)
    try:
        error = within(5, engine.shutdown)
    finally:
        wedged.release.set()
    assert isinstance(error, EngineDeadError)
    assert "collective_rpc('cleanup') did not answer within 0.2 s" in str(error)
    assert stops == ["stop"]
    assert wedged.called == ["cleanup"]


def test_the_engines_own_rpcs_are_bounded(
    cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch, stops: list[str]
) -> None:
    """report_device_id, and install_wake at the start of a sleep-mode engine."""
    monkeypatch.setattr(vllm_engine, "CALL_BOUND_S", 0.2)
    engine = VllmEngine(cpu_llm)
    wedged = Wedged(cpu_llm, {"report_device_id", "install_wake"})
    monkeypatch.setattr(cpu_llm, "collective_rpc", wedged)
    try:
        error = within(5, engine.device_ids)
        assert isinstance(error, EngineDeadError)
        assert "'report_device_id') did not answer within 0.2 s" in str(error)
        sleep_mode_on(cpu_llm, monkeypatch)
        error = within(5, lambda: VllmEngine(cpu_llm))
        assert isinstance(error, EngineDeadError)
        assert "'install_wake') did not answer within 0.2 s" in str(error)
    finally:
        wedged.release.set()
    assert wedged.called == ["report_device_id", "install_wake"]


@pytest.mark.parametrize("call", ["sleep", "wake_up"])
def test_a_failed_sleep_or_wake_kills_the_engine_and_shutdown_still_stops_it(
    cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch, stops: list[str], call: str
) -> None:
    """A sleep or wake that raised left vLLM part-way (S1/S2): EngineDeadError with the
    cause, every later call refused before vLLM, no cleanup, the engine stopped."""
    sleep_mode_on(cpu_llm, monkeypatch)
    engine = VllmEngine(cpu_llm)

    def oom(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(CUDA_OOM)

    monkeypatch.setattr(cpu_llm, call, oom)
    with pytest.raises(EngineDeadError, match="out of memory") as info:
        engine.sleep(1) if call == "sleep" else engine.wake_up(["weights"])
    assert isinstance(info.value.__cause__, RuntimeError)
    wedged = Wedged(cpu_llm, set())
    monkeypatch.setattr(cpu_llm, "collective_rpc", wedged)
    reached: list[str] = []
    for name in ("generate", "reset_prefix_cache"):
        monkeypatch.setattr(cpu_llm, name, lambda *_a, name=name, **_k: reached.append(name))
    later: list[Callable[[], object]] = [
        lambda: engine.generate(batch([[5, 6]], [greedy(2)])),
        lambda: engine.collective_rpc(RpcCall("check_health", timeout=60)),
        lambda: engine.wake_up(None),
        lambda: engine.reset_cache(Cache.PREFIX),
    ]
    for refused in later:
        with pytest.raises(EngineDeadError, match="died earlier"):
            refused()
    assert reached == [], "nothing reached vLLM"
    assert within(5, engine.shutdown) is None
    assert stops == ["stop"]
    assert wedged.called == [], "no cleanup on a dead engine"


def test_wake_up_says_whether_vllm_is_fully_awake(
    cpu_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    sleep_mode_on(cpu_llm, monkeypatch)
    engine = VllmEngine(cpu_llm)
    for fully in (False, True):
        monkeypatch.setattr(cpu_llm, "wake_up", lambda tags=None, fully=fully: fully)
        assert engine.wake_up(["weights"]) is fully


def test_device_ids_name_the_device(cpu_engine: VllmEngine) -> None:
    ids = cpu_engine.device_ids()
    assert len(ids) == 1
    assert all(isinstance(i, str) and i for i in ids)


def test_start_failure_is_bad_config(tiny_model_dir: Path) -> None:
    with pytest.raises(BadConfigError, match="model"):
        VllmEngine.start({"model": 3})
    with pytest.raises(BadConfigError) as info:
        VllmEngine.start({"model": str(tiny_model_dir), "max_model_len": 100_000})
    assert info.value.__cause__ is not None


def test_factory_reports_no_gpu_and_the_engine_args() -> None:
    factory = VllmEngineFactory()
    assert factory.gpu_capability() is None
    assert factory.arg_names() == engine_arg_names()
