"""Ports: what the shell needs from the outside world, as Protocols.

Each port has one adapter per runtime (``vllm_engine.VllmEngine`` for vLLM) and a fake
beside it (``fake_engine.FakeEngine``) that tests and users' own tests use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeVar

from returns.result import Failure

from genworker.core.assembly import FlatGenerations, Generation
from genworker.core.counters import MetricSample
from genworker.core.engine_calls import (
    Cache,
    EngineBatch,
    EngineCapabilities,
    RowRequest,
    RpcCall,
    StreamedGeneration,
)
from genworker.core.lifecycle import InflightMode
from genworker.core.outputs import check_finished, check_generation_logprobs, check_logprobs
from genworker.core.routing import CapturePlatform
from genworker.core.scoring import ScoredRow
from genworker.shell.errors import EngineContractError, RequestAbortedError, unwrap
from genworker.shell.media import RowMedia

if TYPE_CHECKING:
    import torch

    from genworker.core import refit_protocol as p
    from genworker.core.refit_wire import Handle
    from genworker.shell.errors import RefitError
    from genworker.shell.refit.receiver import Sink, Wait

__all__ = [
    "AsyncEngineFactory",
    "AsyncEnginePort",
    "EngineBasePort",
    "EngineCapabilities",
    "EngineFactory",
    "EngineFactoryBase",
    "EnginePort",
    "RefitPort",
    "StreamedGeneration",
    "check_text_request",
    "check_text_rows",
]

_Engine_co = TypeVar("_Engine_co", covariant=True)


class EngineBasePort(Protocol):
    """What both engine ports declare alike, synchronous on both: what the engine can do,
    its tokenizer, its expansion of media rows and its metrics."""

    @property
    def capabilities(self) -> EngineCapabilities: ...

    def tokenize(self, prompts: Sequence[str]) -> list[list[int]]:
        """Each text prompt's token ids as the engine tokenizes it, except that a prompt
        starting with the tokenizer's BOS string gets no second BOS (the ids
        ``generate_text`` takes; their lengths are the rows' token counts);
        ``BadBatchError`` for a prompt it refuses, ``UnsupportedError`` without a
        tokenizer."""
        ...

    def expanded_lengths(
        self, prompts: Sequence[Sequence[int]], media: Sequence[RowMedia | None]
    ) -> list[int]:
        """How many ids each prompt holds in the context once the engine expanded its
        images' placeholders (a row without media: its own length)."""
        ...

    def metrics(self) -> list[MetricSample]: ...


class EnginePort(EngineBasePort, Protocol):
    """A generation engine: token-id and text generation, sleep/wake, metrics, RPC."""

    def generate(self, batch: EngineBatch[RowMedia], *, use_tqdm: bool = False) -> FlatGenerations:
        """The batch's generations as flat arrays, rows in prompt order (a prompt's
        ``samples`` completions in a run of rows, in vLLM's index order); media rows hold
        one placeholder id per image. ``use_tqdm`` shows the engine's progress bar. Rows
        come back as the engine made them (aborted rows flagged, logprobs as sampled,
        non-finite ones included): the worker checks them."""
        ...

    def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], top_k: int
    ) -> list[ScoredRow]:
        """The logprob of each token of ``sequences[i]`` from position ``prompt_lengths[i]``
        on, and the ``top_k`` logprobs with their ids there (one forward pass, vLLM's
        ``prompt_logprobs``; ``core.scoring``). The caller checked the sequences."""
        ...

    def generate_text(self, batch: EngineBatch[RowMedia], *, use_tqdm: bool = False) -> list[str]:
        """One completion text per token prompt (from :meth:`tokenize`), in prompt order;
        every spec has ``detokenize=True`` (``sampling_spec(text=True)``). The caller sees
        no tokens, so the engine checks them: ``RequestAbortedError`` for rows it aborted,
        ``EngineContractError`` for sampled logprobs that ``check_logprobs`` refuses."""
        ...

    def sleep(self, level: int) -> None:
        """Put both memory tags to sleep (level 2 discards the weights). It raises
        ``BadArgumentError``, ``EngineStateError`` or ``UnsupportedError`` only before it
        touched the engine; any other failure may have left the memory part-way (the
        workers declare the engine dead)."""
        ...

    def wake_up(self, tags: Sequence[str] | None) -> bool | None:
        """Wake these tags (None: all), with :meth:`sleep`'s rule for failures; whether
        the engine is fully awake afterwards (None: the engine does not say)."""
        ...

    def reset_cache(self, cache: Cache) -> None:
        """Drop what the engine keeps in ``cache``: its prefix cache (``EngineStateError``
        while requests run: vLLM keeps it then), the processed media (front end and engine
        core), the encoder outputs (they depend on the weights)."""
        ...

    def collective_rpc(self, call: RpcCall) -> list[object]:
        """Call ``call.method`` of the worker extension on every engine worker, within
        ``call.timeout``; one result each."""
        ...

    def device_ids(self) -> list[str]: ...

    def start_profile(self) -> None: ...

    def stop_profile(self) -> None: ...

    def shutdown(self) -> None: ...


def check_text_rows(flat: FlatGenerations, logprobs_mode: str) -> None:
    """The checks :meth:`EnginePort.generate_text` owes its caller, who sees no tokens."""
    checked = check_logprobs(flat.logprobs, flat.lengths, logprobs_mode)
    unwrap(checked, EngineContractError, "generate_text")
    unwrap(check_finished(flat), RequestAbortedError, "generate_text")


def check_text_request(generation: Generation, logprobs_mode: str, request_id: str) -> None:
    """:func:`check_text_rows` of one async request, the errors naming the request (the
    async worker names the row)."""
    if generation.finish_reason == "abort":
        raise RequestAbortedError(f"generate_text: request {request_id} was aborted")
    checked = check_generation_logprobs(generation, logprobs_mode)
    if isinstance(checked, Failure):
        problem = checked.failure()
        raise EngineContractError(
            f"generate_text: request {request_id}: {problem.counts[0]} non-finite logprobs "
            f"({problem.seen}) under logprobs_mode {logprobs_mode!r}: NaN and +inf are never "
            "valid, -inf only in a processed mode",
            detail=problem,
        )


class AsyncEnginePort(EngineBasePort, Protocol):
    """An engine that runs many requests at once (vLLM's ``AsyncLLM``): one coroutine per
    request, pause/resume around weight changes, and the rest of :class:`EnginePort`: a
    method not documented here is that port's of the same name, its rules included."""

    async def generate(
        self, request: RowRequest[RowMedia], progress: Callable[[int], None] | None = None
    ) -> StreamedGeneration:
        """Run one request to its end (``request.media``: its images, one placeholder id
        each in its prompt). ``progress(n)`` is called with the request's token count each
        time the engine hands over new tokens (the worker then counts weight versions
        itself). Cancelling the coroutine aborts the request."""
        ...

    async def compute_logprobs(
        self, request_id: str, sequence: Sequence[int], prompt_length: int, top_k: int
    ) -> ScoredRow:
        """One checked sequence, as request ``request_id``."""
        ...

    async def generate_text(self, request: RowRequest[RowMedia]) -> str:
        """One request from prompt ids (:meth:`tokenize`'s) to its text; cancelling aborts."""
        ...

    async def abort(self, request_ids: Sequence[str]) -> None:
        """End these requests now (their ``generate`` returns with finish reason abort)."""
        ...

    async def pause(self, mode: InflightMode, clear_cache: bool) -> None:
        """Stop scheduling; requests added meanwhile queue until :meth:`resume`."""
        ...

    async def resume(self) -> None: ...

    async def label_weights(self, label: str) -> None:
        """Label the tokens sampled from now on (``capabilities.weight_versions`` only)."""
        ...

    async def sleep(self, level: int) -> None: ...

    async def wake_up(self, tags: Sequence[str] | None) -> bool | None: ...

    async def reset_cache(self, cache: Cache) -> None: ...

    async def collective_rpc(self, call: RpcCall) -> list[object]: ...

    async def device_ids(self) -> list[str]: ...

    def num_unfinished(self) -> int:
        """Requests the engine has not finished (running, waiting or paused)."""
        ...

    async def shutdown(self) -> None: ...


class EngineFactoryBase(Protocol[_Engine_co]):
    """Starts engines: what the worker needs to plan and build one
    (:data:`EngineFactory` of :class:`EnginePort`, :data:`AsyncEngineFactory` of
    :class:`AsyncEnginePort`)."""

    def arg_names(self) -> frozenset[str] | None:
        """The installed engine's argument names (None: accept every planned argument)."""
        ...

    def gpu_capability(self) -> tuple[int, int] | None:
        """The local GPU's compute capability, None without a GPU."""
        ...

    def capture_platform(self) -> CapturePlatform:
        """What the engine's platform can do for routed-experts capture (``core.routing``)."""
        ...

    def start(self, kwargs: Mapping[str, object]) -> _Engine_co: ...


EngineFactory = EngineFactoryBase[EnginePort]
AsyncEngineFactory = EngineFactoryBase[AsyncEnginePort]


class RefitPort(Protocol):
    """One transport's engine-side end of a refit, as
    :func:`genworker.shell.refit.receiver.receive` drives it: genworker's IPC and
    collective receivers (``shell.refit``) and NeMo-RL's wire ports (``shell.refit.nemo_rl``).
    ``memo`` is what the last refit left for the next one (``receive`` sets it)."""

    peer: str
    memo: p.Memo

    def next(self, wait: Wait) -> tuple[p.Event, list[Handle] | None]:
        """The next event (and a chunk's storages), within ``wait``'s bound."""
        ...

    def answer(self, event: p.Event, problem: RefitError | None) -> None: ...

    def write(
        self, writes: p.Writes, handles: list[Handle] | None, sink: Sink
    ) -> list[tuple[str, torch.Tensor]]:
        """Do a chunk's direct writes into ``sink``; the tensors for the loader."""
        ...

    def fail(self, problem: RefitError, *, late: Wait | None) -> NoReturn: ...

    def finish(self, problem: RefitError | None) -> None: ...

    def release(self, *, failed: bool) -> int:
        """Settle the mappings after the refit; how many it opened."""
        ...
