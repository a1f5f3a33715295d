"""The vLLM adapter for :class:`genworker.shell.ports.EnginePort`, over ``vllm.LLM``.

Theory of operation
-------------------
- Capabilities are found by looking, never by version: sleep mode is
  ``current_platform.is_sleep_mode_available()`` and the engine's ``enable_sleep_mode``;
  flat logprobs are available when ``SamplingParams`` has a ``flat_logprobs`` field
  (vllm/sampling_params.py, 0.32); engine arguments are ``EngineArgs``' dataclass fields.
- ``generate`` builds one ``SamplingParams`` per distinct spec (``group_specs``) and hands
  vLLM a per-prompt list of them; ``LLM.generate`` returns outputs in prompt order.
- The sampled token's logprob: with ``logprobs=k`` vLLM records, per position, the sampled
  token first and then the top k (``append_logprobs_for_next_position`` in
  vllm/logprobs.py, 0.32). ``FlatLogprobs`` keeps those in flat lists with a start index
  per position, so the sampled tokens' logprobs are one fancy-index away; their token ids
  must equal the output ids (a mismatch is an engine contract error). Without flat
  logprobs each position is a dict looked up by the sampled token id; a missing entry is
  an error, never 0.0.
- One pass from vLLM's outputs to :class:`~genworker.core.assembly.FlatGenerations`: in
  the common case (``logprobs=0``, flat logprobs holding exactly the sampled token at each
  position, checked per row with two list comparisons) every row's token ids and
  logprobs are packed straight into two flat numpy arrays (``struct``, one C loop per
  row and array); no per-row ``Generation`` is built. Anything else goes row by row (:func:`_generation`),
  which names what is wrong.
- vLLM detokenizes only the rows whose spec asks for it (``SamplingSpec.detokenize``:
  stop strings, text requests); ``generate_text`` refuses a spec that does not.
- Cyclic GC stays out of a generate call (:func:`~genworker.shell.collector.defer_cyclic_gc`):
  vLLM allocates per request and per step on the host thread all through the call. Once
  converted, vLLM's outputs are freed on a background thread
  (:func:`~genworker.shell.collector.release_later`), not on the caller's path.
- Errors are translated in one place (:func:`_translated`): vLLM's ``EngineDeadError``
  becomes ours; during a request, ``ValueError`` and ``VLLMValidationError`` (request
  validation; not a ``ValueError`` in 0.32) become ``BadBatchError``. ``LLM.generate``
  aborts the requests it already added when one is rejected (``_render_and_add_requests``
  in vllm/entrypoints/common/offline.py, 0.32), so the engine keeps serving.
- ``collective_rpc`` with a timeout waits on a daemon thread for at most that long: the
  in-process executor ignores vLLM's own ``timeout`` (vllm/v1/executor/uniproc_executor.py,
  0.32). Expiry means the engine is wedged: ``EngineDeadError``.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.logprobs import FlatLogprobs
from vllm.platforms import current_platform
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Metric, Vector

from genworker.core.assembly import FlatGenerations, Generation, flatten_generations
from genworker.core.counters import (
    CounterSample,
    GaugeSample,
    HistogramSample,
    MetricSample,
    VectorSample,
)
from genworker.core.sampling import SamplingSpec, group_specs
from genworker.shell.collector import defer_cyclic_gc, release_later
from genworker.shell.errors import (
    BadBatchError,
    BadConfigError,
    EngineDeadError,
    EngineStateError,
    GenworkerError,
    UnsupportedError,
)
from genworker.shell.ports import EngineCapabilities

if TYPE_CHECKING:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

__all__ = ["VllmEngine", "VllmEngineFactory", "engine_arg_names", "sampling_params"]

_T = TypeVar("_T")

# vLLM's finish reasons (vllm/v1/engine/__init__.py FINISH_REASON_STRINGS, 0.32) as ours;
# "repetition" is a stop condition. Anything else ("error", None) is not a finished row.
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}


# Request validation raises ValueError or VLLMValidationError (a ValueError in 0.25 but
# not in 0.32, vllm/exceptions.py).
_REQUEST_ERRORS = (ValueError, VLLMValidationError)


def engine_arg_names() -> frozenset[str]:
    """The installed vLLM's ``EngineArgs`` field names (``known_args`` for the engine plan)."""
    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


class VllmEngineFactory:
    """:class:`~genworker.shell.ports.EngineFactory` for the installed vLLM."""

    def arg_names(self) -> frozenset[str] | None:
        return engine_arg_names()

    def gpu_capability(self) -> tuple[int, int] | None:
        capability = current_platform.get_device_capability()
        return None if capability is None else (capability.major, capability.minor)

    def start(self, kwargs: Mapping[str, object]) -> VllmEngine:
        return VllmEngine.start(kwargs)


def sampling_params(spec: SamplingSpec, known: frozenset[str] | None = None) -> SamplingParams:
    """vLLM's ``SamplingParams`` for a spec; ``known`` (field names) drops what vLLM lacks."""
    # as_kwargs yields SamplingParams fields only, each typed as vLLM expects.
    return SamplingParams(**spec.as_kwargs(known))  # type: ignore[arg-type]


def _sampling_arg_names() -> frozenset[str]:
    params = inspect.signature(SamplingParams).parameters
    return frozenset(name for name in params if not name.startswith("_"))


@contextmanager
def _translated(call: str, *, request: bool = False, profiling: bool = False) -> Iterator[None]:
    """The one place vLLM's errors become ours (see the module docstring)."""
    try:
        yield
    except GenworkerError:
        raise
    except VllmEngineDeadError as e:
        raise EngineDeadError(f"{call}: the vLLM engine died: {e}") from e
    except _REQUEST_ERRORS as e:
        if not request:
            raise
        raise BadBatchError(f"{call}: vLLM rejected the request: {e}") from e
    except RuntimeError as e:
        # The worker's profile() raises RuntimeError when no profiler is configured
        # (vllm/v1/worker/gpu_worker.py, 0.32).
        if not profiling:
            raise
        raise UnsupportedError(f"{call}: profiling is not enabled in this engine: {e}") from e


class VllmEngine:
    """:class:`~genworker.shell.ports.EnginePort` over one ``vllm.LLM``."""

    def __init__(self, llm: LLM) -> None:
        self._llm: LLM | None = llm
        config = llm.llm_engine.vllm_config
        model = config.model_config
        self._extension = bool(config.parallel_config.worker_extension_cls)
        self._log_stats = llm.llm_engine.log_stats
        sampling_args = _sampling_arg_names()
        self._caps = EngineCapabilities(
            sleep_mode=current_platform.is_sleep_mode_available() and model.enable_sleep_mode,
            flat_logprobs="flat_logprobs" in sampling_args,
            vocab_size=model.get_vocab_size(),
            max_model_len=model.max_model_len,
            device=current_platform.device_type,
            sampling_args=sampling_args,
        )

    @classmethod
    def start(cls, kwargs: Mapping[str, object]) -> VllmEngine:
        """Start a ``vllm.LLM`` with these keyword arguments; failures are BadConfigError."""
        rest = dict(kwargs)
        model = rest.pop("model", None)
        if not isinstance(model, str):
            raise BadConfigError(f"engine kwargs need 'model' as a str, got {model!r}")
        try:
            llm = LLM(model, **rest)
        except Exception as e:
            raise BadConfigError(f"vLLM failed to start on {model!r}: {e}") from e
        return cls(llm)

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            raise EngineDeadError("the vLLM engine was shut down")
        return self._llm

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._caps

    # -- generation -----------------------------------------------------------------
    def _params(self, specs: Sequence[SamplingSpec]) -> SamplingParams | list[SamplingParams]:
        """One SamplingParams per distinct spec; a lone one is passed as is (vLLM applies
        it to every prompt without a per-request list)."""
        groups = group_specs(specs)
        per_row: list[SamplingParams | None] = [None] * len(specs)
        for group in groups:
            spec = group.spec
            if self._caps.flat_logprobs and not spec.flat_logprobs:
                spec = attrs.evolve(spec, flat_logprobs=True)
            params = sampling_params(spec, self._caps.sampling_args)
            if len(groups) == 1:
                return params
            for row in group.rows:
                per_row[row] = params
        return [p for p in per_row if p is not None]

    @defer_cyclic_gc()
    def generate(
        self, prompts: Sequence[Sequence[int]], specs: Sequence[SamplingSpec]
    ) -> FlatGenerations:
        if len(prompts) != len(specs):
            raise BadBatchError(f"generate: {len(prompts)} prompts but {len(specs)} specs")
        llm = self.llm
        with _translated("generate", request=True):
            params = self._params(specs)
            token_prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
            outputs = llm.generate(token_prompts, params, use_tqdm=False)
        flat = _generations([out.outputs[0] for out in outputs])
        release_later(outputs)  # freed off the caller's path
        return flat

    def generate_text(self, prompts: Sequence[str], specs: Sequence[SamplingSpec]) -> list[str]:
        if len(prompts) != len(specs):
            raise BadBatchError(f"generate_text: {len(prompts)} prompts but {len(specs)} specs")
        if untexted := [row for row, spec in enumerate(specs) if not spec.detokenize]:
            raise ValueError(
                f"generate_text: the specs of rows {untexted} have detokenize=False "
                "(vLLM would return empty texts); build them with sampling_spec(text=True)"
            )
        llm = self.llm
        with _translated("generate_text", request=True):
            outputs = llm.generate(list(prompts), self._params(specs), use_tqdm=False)
        return [out.outputs[0].text for out in outputs]

    # -- memory ---------------------------------------------------------------------
    def _require_sleep_mode(self, call: str) -> None:
        if not self._caps.sleep_mode:
            raise UnsupportedError(
                f"{call}: sleep mode is unavailable (platform {self._caps.device}, or the "
                "engine was started without enable_sleep_mode)"
            )

    def sleep(self, level: int) -> None:
        self._require_sleep_mode("sleep")
        llm = self.llm
        with _translated("sleep"):
            llm.sleep(level=level)

    def wake_up(self, tags: Sequence[str] | None) -> None:
        self._require_sleep_mode("wake_up")
        llm = self.llm
        with _translated("wake_up"):
            llm.wake_up(tags=None if tags is None else list(tags))

    def reset_prefix_cache(self) -> None:
        llm = self.llm
        with _translated("reset_prefix_cache"):
            reset = llm.reset_prefix_cache()
        if not reset:
            raise EngineStateError("reset_prefix_cache: vLLM kept the cache (requests running)")

    # -- observability --------------------------------------------------------------
    def metrics(self) -> list[MetricSample]:
        if not self._log_stats:
            raise UnsupportedError("metrics: the engine was started with disable_log_stats")
        llm = self.llm
        with _translated("metrics"):
            return [_sample(m) for m in llm.get_metrics()]

    def start_profile(self) -> None:
        llm = self.llm
        with _translated("start_profile", profiling=True):
            llm.start_profile()

    def stop_profile(self) -> None:
        llm = self.llm
        with _translated("stop_profile", profiling=True):
            llm.stop_profile()

    # -- workers --------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
        timeout: float | None = None,
    ) -> list[object]:
        llm = self.llm

        def call() -> list[object]:
            return llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

        with _translated(f"collective_rpc({method!r})"):
            if timeout is None:
                return call()
            return _bounded(call, timeout, what=f"collective_rpc({method!r})")

    def device_ids(self) -> list[str]:
        if not self._extension:
            return [self._caps.device]
        return [str(d) for d in self.collective_rpc("report_device_id")]

    def shutdown(self) -> None:
        """Stop the engine and drop it; safe to call twice."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        # LLM has no shutdown in 0.32; its engine-core client does.
        stop = getattr(llm, "shutdown", None) or getattr(
            getattr(llm.llm_engine, "engine_core", None), "shutdown", None
        )
        try:
            if self._extension:  # close the refit sockets and groups (their private dirs)
                with _translated("cleanup"):
                    llm.collective_rpc("cleanup")
        finally:
            try:
                if callable(stop):
                    stop()
            finally:
                del llm
                gc.collect()


def _bounded(fn: Callable[[], _T], timeout: float, *, what: str) -> _T:
    """``fn()`` on a daemon thread, waited for at most ``timeout`` seconds."""
    result: list[_T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the waiting thread
            error.append(e)

    thread = threading.Thread(target=run, name=f"genworker {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise EngineDeadError(f"{what} did not answer within {timeout:g} s")
    if error:
        if isinstance(error[0], TimeoutError):
            raise EngineDeadError(f"{what} did not answer within {timeout:g} s") from error[0]
        raise error[0]
    return result[0]


def _generations(outs: Sequence[CompletionOutput]) -> FlatGenerations:
    """Every row's generation as flat arrays, in one pass where the layout allows it (see
    the module docstring); otherwise row by row."""
    total = sum(len(out.token_ids) for out in outs)
    token_ids = bytearray(8 * total)  # int64, then wrapped by numpy without a copy
    logprobs = bytearray(4 * total)  # float32
    lengths: list[int] = []
    reasons: list[str | None] = []
    # Per row length n: [0, n) (the start indices of one entry per position) and the
    # packers of n native int64 / float32 values. struct packs a list's values straight
    # into the buffers in one C loop each, about twice as fast as array.array or numpy's
    # list conversion; float32 is rounded from vLLM's doubles as numpy's cast rounds it.
    layouts: dict[int, tuple[list[int], struct.Struct, struct.Struct]] = {}
    offset = 0
    for out in outs:
        ids = out.token_ids
        flat = out.logprobs
        n = len(ids)
        layout = layouts.get(n)
        if layout is None:
            layout = layouts[n] = (list(range(n)), struct.Struct(f"{n}q"), struct.Struct(f"{n}f"))
        one_per_position, pack_ids, pack_logprobs = layout
        if not (
            isinstance(flat, FlatLogprobs)
            and len(flat.logprobs) == n
            and flat.token_ids == ids
            and flat.start_indices == one_per_position
        ):
            return flatten_generations([_generation(row, o) for row, o in enumerate(outs)])
        pack_ids.pack_into(token_ids, 8 * offset, *ids)
        pack_logprobs.pack_into(logprobs, 4 * offset, *flat.logprobs)
        offset += n
        lengths.append(n)
        reasons.append(out.finish_reason)
    if not _FINISH_REASONS.keys() >= set(reasons):
        for row, out in enumerate(outs):
            _finish_reason(row, out)  # raises, naming the first row that did not finish
    return FlatGenerations(
        token_ids=np.frombuffer(token_ids, dtype=np.int64),
        logprobs=np.frombuffer(logprobs, dtype=np.float32),
        lengths=np.array(lengths, dtype=np.int64),
        truncated=np.array([r == "length" for r in reasons], dtype=np.bool_),
    )


def _finish_reason(row: int, out: CompletionOutput) -> str:
    reason = _FINISH_REASONS.get(out.finish_reason or "")
    if reason is None:
        raise GenworkerError(f"generate: row {row} did not finish (reason {out.finish_reason!r})")
    return reason


def _generation(row: int, out: CompletionOutput) -> Generation:
    reason = _finish_reason(row, out)
    token_ids = np.asarray(out.token_ids, dtype=np.int64)
    return Generation(token_ids, _sampled_logprobs(row, token_ids, out), reason)


def _sampled_logprobs(
    row: int, token_ids: npt.NDArray[np.int64], out: CompletionOutput
) -> npt.NDArray[np.float32]:
    logprobs = out.logprobs
    if logprobs is None:
        raise GenworkerError(f"generate: row {row} came back without logprobs")
    if isinstance(logprobs, FlatLogprobs):
        starts = np.asarray(logprobs.start_indices, dtype=np.int64)
        ends = np.asarray(logprobs.end_indices, dtype=np.int64)
        if starts.shape != token_ids.shape or bool((ends <= starts).any()):
            raise GenworkerError(
                f"generate: row {row} has {len(token_ids)} tokens but flat logprobs for "
                f"{int((ends > starts).sum())} positions"
            )
        sampled = np.asarray(logprobs.token_ids, dtype=np.int64)[starts]
        if not np.array_equal(sampled, token_ids):
            raise GenworkerError(
                f"generate: row {row}'s flat logprobs are for tokens {sampled.tolist()}, "
                f"not the generated {token_ids.tolist()}"
            )
        return np.asarray(logprobs.logprobs, dtype=np.float32)[starts]
    if not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
        raise GenworkerError(
            f"generate: row {row} has {len(token_ids)} tokens but logprobs "
            f"{type(logprobs).__name__} of length {len(logprobs)}"
        )
    values = np.empty(len(token_ids), dtype=np.float32)
    for i, (token, position) in enumerate(zip(token_ids.tolist(), logprobs, strict=True)):
        entry: Logprob | None = position.get(token)
        if entry is None:
            raise GenworkerError(
                f"generate: row {row} position {i}: no logprob for the sampled token {token}"
            )
        values[i] = entry.logprob
    return values


def _sample(metric: Metric) -> MetricSample:
    if isinstance(metric, Counter):
        return CounterSample.from_counter(metric.name, metric.labels, metric.value)
    if isinstance(metric, Gauge):
        return GaugeSample.from_gauge(metric.name, metric.labels, metric.value)
    if isinstance(metric, Histogram):
        return HistogramSample.from_histogram(
            metric.name, metric.labels, metric.count, metric.sum, metric.buckets
        )
    if isinstance(metric, Vector):
        return VectorSample.from_vector(metric.name, metric.labels, metric.values)
    raise GenworkerError(f"metrics: unknown vLLM metric type {type(metric).__name__}")
