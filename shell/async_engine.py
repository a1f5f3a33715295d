"""The vLLM adapter for :class:`genworker.shell.ports.AsyncEnginePort`, over ``AsyncLLM``.

Theory of operation
-------------------
- ``AsyncLLM`` always spawns its engine core process, whatever
  ``VLLM_ENABLE_V1_MULTIPROCESSING`` says (``EngineCoreClient.make_async_mp_client`` in
  ``vllm/v1/engine/async_llm.py``, 0.32): the program that starts one needs an
  ``if __name__ == "__main__"`` guard, and the worker extension must import in the child.
  It may be built outside an event loop; its output handler starts in the loop of the
  first request, and every later call must come from that same loop.
- ``generate`` runs one request with its own ``SamplingParams``: ``FINAL_ONLY`` outputs
  when nobody watches the tokens go by (no per-step work in this process), ``CUMULATIVE``
  when a ``progress`` callback counts them. Cancelling the coroutine aborts the request:
  ``AsyncLLM.generate`` aborts on ``CancelledError`` / ``GeneratorExit``.
- Weight labels are found by looking: ``AsyncLLM.update_weight_version`` and the
  ``weight_versions`` field of ``CompletionOutput`` (vLLM 0.32; the engine core stamps
  every step's outputs with the label, ``EngineCore._attach_weight_version`` in
  ``vllm/v1/engine/core.py``).
- Errors are translated in one place, as for the sync engine (``vllm_engine.VLLM_CALLS``; here :data:`ASYNC_CALLS`):
  ``EngineDeadError`` becomes ours, request validation errors become ``BadBatchError``;
  ``EngineGenerateError`` (an unexpected failure inside one request) becomes a
  ``GenworkerError`` naming it, the engine keeps serving.
- ``pause`` is ``AsyncLLM.pause_generation`` without its closing ``asyncio.sleep(0.02)``
  (``vllm/v1/engine/async_llm.py``, 0.25 and 0.32): the same calls (the renderer's
  multimodal cache cleared when ``clear_cache``, then ``pause_scheduler_async`` on the
  engine core client). The sleep only gives the output handler time to push the outputs
  that came in before the pause's answer into their streams, "not required for
  correctness" (vLLM's comment); nothing here needs that order: vLLM 0.32 labels each
  step's outputs in the engine core, and the worker that counts tokens (0.25) waits for
  them itself (``AsyncVllmGenerationWorker._settle``). Each step's outputs, the aborted
  requests' final ones included, reach the client before the pause's answer
  (``EngineCoreProc.pause_scheduler``, ``vllm/v1/engine/core.py``).
- ``collective_rpc`` is bounded by ``timeout`` here (the in-process executor inside the
  engine core ignores vLLM's own): past it the engine core is stuck in the RPC, so dead,
  and every later call is refused with ``EngineDeadError``. The adapter's own RPCs are
  bounded as the sync engine's (``vllm_engine.CALL_BOUND_S``).
- A sleep or wake that raises is fatal for the engine, as in the sync engine
  (``vllm_engine``'s module docstring: vLLM leaves it part-mapped with its scheduler
  paused); ``wake_up`` returns whether the engine is fully awake. ``shutdown`` skips the
  extension's ``cleanup`` on a dead engine (it would queue behind the stuck call) and
  always reaches ``AsyncLLM.shutdown``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final, TypeVar

import attrs

from genworker.shell.install import check_torchvision

check_torchvision()  # before vLLM or transformers load a model (docs/install.md)

import vllm.envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineGenerateError

from genworker.core.engine_calls import Cache, RowRequest, RpcCall
from genworker.core.lifecycle import InflightMode
from genworker.core.routing import routes_of
from genworker.core.scoring import ScoredRow
from genworker.core.versions import weight_spans
from genworker.shell.errors import (
    BadBatchError,
    BadConfigError,
    EngineDeadError,
    GenworkerError,
    UnsupportedError,
    translated,
)
from genworker.shell.media import RowMedia
from genworker.shell.ports import (
    StreamedGeneration,
    check_text_request,
)
from genworker.shell.startup import check_main_guard, checked_model
from genworker.shell.vllm_engine import (
    CALL_BOUND_S,
    REQUEST_ERRORS,
    VLLM_CALLS,
    VllmEngineBase,
    VllmPlatform,
    engine_arg_names,
    generation_of,
    lora_request,
    scored_row,
    scoring_params,
    token_prompt,
)

__all__ = ["AsyncVllmEngine", "AsyncVllmEngineFactory"]

_MP_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"
_STOP_CLEANUP_S = 1.0
"""The bound on the extension's ``cleanup`` at shutdown (a live engine answers in
milliseconds)."""

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class AsyncVllmEngineFactory(VllmPlatform):
    """:class:`~genworker.shell.ports.AsyncEngineFactory` for the installed vLLM."""

    def arg_names(self) -> frozenset[str] | None:
        """The installed vLLM's ``AsyncEngineArgs`` field names."""
        return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs)) | engine_arg_names()

    def start(self, kwargs: Mapping[str, object]) -> AsyncVllmEngine:
        return AsyncVllmEngine.start(kwargs)


ASYNC_CALLS = VLLM_CALLS.extended(
    "async vllm",
    (
        EngineGenerateError,
        lambda call, e: GenworkerError(
            f"{call}: the request failed inside vLLM: {type(e.__cause__).__name__}: {e.__cause__}"
        ),
    ),
)
"""The sync engine's seam, plus an unexpected failure inside one request of ``AsyncLLM``."""

ASYNC_REQUEST = ASYNC_CALLS.extended(
    "async vllm request",
    (REQUEST_ERRORS, lambda call, e: BadBatchError(f"{call}: vLLM rejected the request: {e}")),
)
"""One request: :data:`ASYNC_CALLS`, and vLLM's validation errors are a bad batch."""


def _spawn_on_cuda() -> None:
    """Make vLLM spawn the engine core on a CUDA platform.

    vLLM forks its engine core unless ``torch.cuda.is_initialized()``, and then asks for
    spawn through ``os.environ``. Both miss cases that kill the forked child with "Cannot
    re-initialize CUDA in forked subprocess" (vLLM 0.25 on the H200): a process that only
    counted its GPUs (``torch.cuda.device_count()`` starts CUDA's runtime, not torch's lazy
    init), and one where an in-process engine (a sync worker,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has turned on vLLM's environment cache, which
    never sees the override. On CUDA: spawn, always, and clear that cache.
    """
    if current_platform.device_type != "cuda" or os.environ.get(_MP_METHOD) == "spawn":
        return
    os.environ[_MP_METHOD] = "spawn"
    clear = getattr(vllm.envs.__getattr__, "cache_clear", None)
    if clear is not None:
        clear()


def _labels_tokens(llm: AsyncLLM) -> bool:
    fields = getattr(CompletionOutput, "__dataclass_fields__", {})
    return callable(getattr(llm, "update_weight_version", None)) and "weight_versions" in fields


#: ``AsyncLLM``'s reset of each cache
_RESETS: Final[Mapping[Cache, Callable[[AsyncLLM], Awaitable[object]]]] = {
    Cache.PREFIX: AsyncLLM.reset_prefix_cache,
    Cache.MM: AsyncLLM.reset_mm_cache,
    Cache.ENCODER: AsyncLLM.reset_encoder_cache,
}


class AsyncVllmEngine(VllmEngineBase[AsyncLLM]):
    """:class:`~genworker.shell.ports.AsyncEnginePort` over one ``AsyncLLM``."""

    seam = ASYNC_CALLS

    def __init__(self, llm: AsyncLLM) -> None:
        super().__init__(llm, llm.vllm_config, llm.log_stats, weight_versions=_labels_tokens(llm))
        self._wake_installed = False
        # AsyncLLM.pause_generation's own calls (vllm/v1/engine/async_llm.py: 0.25 and 0.32
        # have both); a vLLM without them pauses through pause_generation, sleep and all.
        self._direct_pause = callable(
            getattr(llm.engine_core, "pause_scheduler_async", None)
        ) and callable(getattr(llm.renderer, "clear_mm_cache_async", None))

    @classmethod
    def start(cls, kwargs: Mapping[str, object]) -> AsyncVllmEngine:
        """Start an ``AsyncLLM`` with these ``AsyncEngineArgs``; failures are BadConfigError."""
        model = checked_model(kwargs.get("model"))
        check_main_guard("AsyncVllmGenerationWorker's engine (vLLM's AsyncLLM)")
        _spawn_on_cuda()
        try:
            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        except Exception as e:
            raise BadConfigError(f"vLLM's AsyncLLM failed to start on {model!r}: {e}") from e
        return cls(llm)

    async def _call(self, call: str, act: Callable[[AsyncLLM], Awaitable[_T]]) -> _T:
        """``act`` on the live engine (a dead one refused first), awaited with its errors
        mapped through :data:`ASYNC_CALLS`: every call into vLLM that needs no more."""
        llm = self.llm
        with translated(self.seam, call):
            return await act(llm)

    # -- generation -----------------------------------------------------------------
    async def _final(
        self,
        call: str,
        request_id: str,
        prompt: TokensPrompt,
        params: SamplingParams,
        lora: LoRARequest | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> RequestOutput:
        """One request run to its final output (``progress``: its token count each time
        new tokens come)."""
        llm = self.llm
        final: RequestOutput | None = None
        with translated(ASYNC_REQUEST, call):
            async for out in llm.generate(prompt, params, request_id, lora_request=lora):
                final = out
                if progress is not None:
                    progress(len(out.outputs[0].token_ids))
        if final is None or not final.finished:
            raise GenworkerError(f"{call}: request {request_id} ended without a final output")
        return final

    async def _completion(
        self, call: str, request: RowRequest[RowMedia], progress: Callable[[int], None] | None
    ) -> CompletionOutput:
        """A row's one completion: its spec's params (``FINAL_ONLY`` outputs unless
        ``progress`` counts the tokens), its prompt with its media, its adapter."""
        kind = RequestOutputKind.FINAL_ONLY if progress is None else RequestOutputKind.CUMULATIVE
        params = self.request_params(request.spec, kind=kind)
        prompt = token_prompt(request.prompt, request.media)
        lora = lora_request(request.spec.adapter)
        final = await self._final(call, request.request_id, prompt, params, lora, progress)
        return final.outputs[0]

    async def generate(
        self, request: RowRequest[RowMedia], progress: Callable[[int], None] | None = None
    ) -> StreamedGeneration:
        completion = await self._completion("generate", request, progress)
        generation = generation_of(0, completion)
        routes = routes_of(completion, self._caps.routes)  # on the final output only (0.32)
        if routes is not None:
            generation = attrs.evolve(generation, routed_experts=routes)
        return StreamedGeneration(
            generation, weight_spans(getattr(completion, "weight_versions", None))
        )

    async def compute_logprobs(
        self, request_id: str, sequence: Sequence[int], prompt_length: int, top_k: int
    ) -> ScoredRow:
        prompt, params = token_prompt(sequence, None), scoring_params(top_k)
        final = await self._final("compute_logprobs", request_id, prompt, params)
        return scored_row(sequence, prompt_length, final.prompt_logprobs, top_k)

    async def generate_text(self, request: RowRequest[RowMedia]) -> str:
        completion = await self._completion("generate_text", request, None)
        generation = generation_of(0, completion)
        check_text_request(generation, self._caps.logprobs_mode, request.request_id)
        return completion.text

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._call("abort", lambda llm: llm.abort(list(request_ids)))

    # -- pause and weights ----------------------------------------------------------
    async def pause(self, mode: InflightMode, clear_cache: bool) -> None:
        llm = self.llm
        with translated(ASYNC_CALLS, "pause_generation"):
            if not self._direct_pause:
                await llm.pause_generation(mode=mode.value, clear_cache=clear_cache)
                return
            if clear_cache:
                await llm.renderer.clear_mm_cache_async()
            await llm.engine_core.pause_scheduler_async(mode=mode.value, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self._call("resume_generation", lambda llm: llm.resume_generation())

    async def label_weights(self, label: str) -> None:
        update = getattr(self.llm, "update_weight_version", None)
        if not callable(update):
            raise UnsupportedError("label_weights: this vLLM does not label weight versions")
        with translated(ASYNC_CALLS, "update_weight_version"):
            await update(label)

    # -- memory ---------------------------------------------------------------------
    async def sleep(self, level: int) -> None:
        if self._caps.sleep_mode and self._extension and not self._wake_installed:
            # in the engine core's process (cumem_wake)
            await self.collective_rpc(RpcCall("install_wake", timeout=CALL_BOUND_S))
            self._wake_installed = True
        with self._memory(f"sleep(level={level})") as llm:
            await llm.sleep(level=level)

    async def wake_up(self, tags: Sequence[str] | None) -> bool | None:
        names = None if tags is None else list(tags)
        with self._memory(f"wake_up(tags={names})") as llm:
            return await llm.wake_up(tags=names)

    async def reset_cache(self, cache: Cache) -> None:
        self._reset(cache, await self._call(cache.call, _RESETS[cache]))

    # -- observability --------------------------------------------------------------
    def num_unfinished(self) -> int:
        # The output processor's count: AsyncLLM itself has no such method before vLLM 0.32.
        return self.llm.output_processor.get_num_unfinished_requests()

    # -- workers --------------------------------------------------------------------
    async def collective_rpc(self, call: RpcCall) -> list[object]:
        llm = self.llm
        method, timeout = call.method, call.timeout
        kwargs = None if call.kwargs is None else dict(call.kwargs)
        running = llm.collective_rpc(method, timeout=timeout, args=call.args, kwargs=kwargs)
        with self._mortal(), translated(ASYNC_CALLS, f"collective_rpc({method!r})"):
            try:
                return await asyncio.wait_for(running, timeout)
            except TimeoutError as e:
                raise EngineDeadError(
                    f"collective_rpc({method!r}) did not answer within {timeout:g} s"
                ) from e

    async def device_ids(self) -> list[str]:
        if not self._extension:
            return [self._caps.device]
        ids = await self.collective_rpc(RpcCall("report_device_id", timeout=CALL_BOUND_S))
        return [str(d) for d in ids]

    async def shutdown(self) -> None:
        """Stop the engine and drop it; safe to call twice.

        As vLLM's own server stops (``serve_http``'s ``handle_shutdown``,
        ``vllm/entrypoints/launchers/launcher.py``, 0.32): the engine core process gets
        vLLM's ``shutdown_timeout`` (its engine argument; 0: requests in flight aborted,
        the process killed at once) instead of the 5 s vLLM waits by default. The
        extension's ``cleanup`` (refit sockets and groups) is bounded by
        :data:`_STOP_CLEANUP_S`: an engine core that does not answer is already stopping
        (a Ctrl-C reaches the whole process group), and its sockets go with it."""
        llm = self._llm
        if llm is None:
            return
        try:
            # close the refit sockets and groups; a dead engine's go with its stop
            if self._extension and not llm.errored and self._dead is None:
                try:
                    await self.collective_rpc(RpcCall("cleanup", timeout=_STOP_CLEANUP_S))
                except EngineDeadError as e:
                    log.warning("stopping the engine without the extension's cleanup: %s", e)
        finally:
            self._llm = None
            timeout = getattr(llm.vllm_config, "shutdown_timeout", None)
            if timeout is not None and "timeout" in inspect.signature(llm.shutdown).parameters:
                llm.shutdown(timeout=timeout)
            else:  # vLLM 0.25: no shutdown_timeout
                llm.shutdown()
