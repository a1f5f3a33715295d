"""NeMo-RL's async vLLM generation worker contract, over genworker's async worker.

Theory of operation
-------------------
NeMo-RL builds ``nemo_rl/models/generation/vllm/vllm_worker_async.py``'s
``VllmAsyncGenerationWorker`` when ``vllm_cfg.async_engine`` is true (``VllmGeneration``,
NeMo-RL commit 7ea279ab): async GRPO, NeMo-Gym and any ``pipeline_parallel_size > 1`` need
it. Pointing its class path at ``genworker.shell.nemo_rl.VllmAsyncGenerationWorker`` gives
it :class:`NemoRlAsyncGenerationWorker` as a Ray actor class (an async actor: every
coroutine runs on the actor's one event loop, which genworker's
:class:`~genworker.shell.async_worker.AsyncVllmGenerationWorker` needs), with NeMo-RL's
method names, arguments and return values:

* Construction, ``configure_worker``, inert tied-group members, the engine's environment,
  the refits' ``bool`` answers with ``last_refit_error``, ``_get_raw_spec_counters``,
  ``stop_strings_mode``, the stop-string and unknown-key checks, the up-front import of
  NeMo-RL's batch modules and the sleep/wake no-op without sleep mode are the synchronous
  drop-in's (:class:`~genworker.shell.nemo_rl_member.NemoRlMember`, :mod:`genworker.shell.nemo_rl`).
* ``generate_async`` / ``generate_text_async`` are async generators of ``(row, result)``,
  rows in completion order, ``result`` in NeMo-RL's per-sample shape (its five
  ``GenerationOutputSpec`` tensors, ``core.nemo_rl_front.nemo_rl_outputs``, or
  ``{"texts": [text]}``). genworker's worker yields a row's typed error as a value; here
  it is raised, as NeMo-RL's worker raises (the stream ends, the other rows' requests are
  aborted). ``VllmGeneration._generate_on_shard`` reads them through Ray's streaming
  generator and ``ray.cancel``s the call when its own consumer is cancelled: the stream is
  closed and genworker's worker aborts the vLLM request.
* The refits are in flight: the engine pauses (``mode``, default ``keep``; with
  ``clear_cache=True``, the default, running requests are re-prefilled on the new
  weights), receives NeMo-RL's trainer wire, counts a weight version and resumes
  (``AsyncVllmGenerationWorker.refit_via``, docs/async.md). NeMo-RL calls them without
  arguments; its own worker loads between engine steps without a pause and keeps the
  running requests' KV cache of the old weights, which ``clear_cache=False`` reproduces.
* The OpenAI server (``vllm_cfg.expose_http_server``) binds its socket in the constructor,
  so ``get_reserved_url`` (before the model loads) and ``report_dp_openai_server_base_url``
  (serving) are the same URL; ``None`` without a server and on an inert member. A server
  on every interface (``0.0.0.0``, ``::``, as NeMo-RL's) is reported at this node's IP,
  the address NeMo-Gym on another node can reach.
* What NeMo-RL's async worker has and genworker cannot do is refused with
  ``UnsupportedError`` naming the method and what to use instead (never a silent no-op;
  ``core.nemo_rl_front.REFUSED``):
  the ``nccl_reshard`` refit, the checkpoint engine, the sparse refit relay, nsight's
  ``start_gpu_profiling`` / ``stop_gpu_profiling``, and NeMo-RL's token capture (#3837;
  genworker's rows carry their token ids and ``weight_versions`` themselves).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence

import torch

from genworker.core.joins import group_join
from genworker.core.lifecycle import InflightMode
from genworker.core.nemo_rl_front import nemo_rl_outputs, refusal, reported_url
from genworker.core.refit_protocol import Transport
from genworker.shell.async_worker import AsyncVllmGenerationWorker
from genworker.shell.errors import GenworkerError, UnsupportedError
from genworker.shell.host import node_ip
from genworker.shell.nemo_rl_member import NemoRlMember
from genworker.shell.spine import checked_join

__all__ = ["NemoRlAsyncGenerationWorker", "reported_url"]


class NemoRlAsyncGenerationWorker(NemoRlMember[AsyncVllmGenerationWorker]):
    """One member of a NeMo-RL async generation worker group (see the module docstring)."""

    ASYNC_ENGINE = True
    OTHER_ENGINE = (
        "vllm_cfg.async_engine is false: this is NeMo-RL's async worker "
        "(VllmAsyncGenerationWorker); NeMo-RL builds the synchronous one "
        "(genworker.shell.nemo_rl.VllmGenerationWorker) for that config, or set it to true"
    )

    @staticmethod
    def _native() -> Callable[..., AsyncVllmGenerationWorker]:
        return AsyncVllmGenerationWorker

    async def post_init_async(self) -> None:
        """NeMo-RL calls it once the group is up: starts the OpenAI server when the config
        exposes one, records the engine workers' device ids."""
        worker = self._owner("post_init_async")
        await worker.post_init_async()
        self.vllm_device_ids = await worker.report_device_id()

    # -- the OpenAI server ----------------------------------------------------------
    async def get_reserved_url(self) -> str | None:
        """The OpenAI server's ``http://host:port/v1``, known before the model loads (its
        socket is bound); ``None`` without ``expose_http_server`` and on an inert member."""
        return None if self._worker is None else reported_url(self._worker.base_url, node_ip)

    async def report_dp_openai_server_base_url(self) -> str | None:
        """The same URL, the server serving (started here if ``post_init_async`` did not)."""
        if self._worker is None:
            return None
        worker = self._owner("report_dp_openai_server_base_url")
        return reported_url(await worker.report_dp_openai_server_base_url(), node_ip)

    # -- generation -----------------------------------------------------------------
    async def generate_async(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> AsyncGenerator[tuple[int, dict[str, torch.Tensor]], None]:
        """``(row, NeMo-RL's per-sample output)`` as each row finishes (NeMo-RL sends one
        row; any batch is taken); a row's typed error is raised."""
        worker = self._owner("generate_async")
        async with contextlib.aclosing(worker.generate_async(data, greedy)) as rows:
            async for row, item in rows:
                if isinstance(item, GenworkerError):
                    raise item
                yield row, nemo_rl_outputs(item)

    async def generate_text_async(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> AsyncGenerator[tuple[int, dict[str, list[str]]], None]:
        """``(row, {"texts": [text]})`` as each prompt finishes; a row's typed error is
        raised."""
        worker = self._owner("generate_text_async")
        async with contextlib.aclosing(worker.generate_text_async(data, greedy)) as rows:
            async for row, item in rows:
                if isinstance(item, GenworkerError):
                    raise item
                yield row, item

    # -- memory ---------------------------------------------------------------------
    async def sleep_async(self) -> None:
        """Sleep at ``vllm_cfg.sleep_level`` (NeMo-RL's ``sleep_async()`` takes no level);
        refused while rows stream; a no-op with one warning without sleep mode."""
        worker = self._owner("sleep_async")
        if self._sleep_is_a_no_op(worker, "sleep_async"):
            return
        await worker.sleep()

    async def wake_up_async(self, **kwargs: object) -> None:
        """NeMo-RL's ``wake_up_async(tags=...)``; any other keyword is refused by name; a
        no-op without sleep mode, as :meth:`sleep_async`."""
        worker = self._owner("wake_up_async")
        tags = self._wake_up_tags("wake_up_async", kwargs)
        if self._sleep_is_a_no_op(worker, "wake_up_async"):
            return
        await worker.wake_up(tags)

    async def reset_prefix_cache_async(self) -> None:
        """Drop the prefix cache; refused while rows stream (vLLM would keep it)."""
        await self._owner("reset_prefix_cache_async").reset_prefix_cache()

    # -- refit ----------------------------------------------------------------------
    async def prepare_refit_info_async(
        self, state_dict_info: Mapping[str, tuple[Sequence[int], object]]
    ) -> None:
        """Tell the engine workers every refit's tensors (NeMo-RL's ``{name: (shape,
        dtype)}``); the summaries are in ``refit_info``."""
        worker = self._owner("prepare_refit_info_async")
        self.refit_info = await worker.prepare_refit_info(state_dict_info)

    async def init_collective_async(
        self, rank_prefix: int, ip: str, port: int, world_size: int, train_world_size: int
    ) -> None:
        """Join NeMo-RL's weight-update group (its trainer rank 0 hosts the store)."""
        join = checked_join(group_join(rank_prefix, ip, port, world_size, train_world_size))
        await self._owner("init_collective_async").init_collective_via(
            "nemo_rl_init_collective", join
        )

    async def update_weights_via_ipc_zmq_async(
        self,
        refit_timeout_s: float | None = None,
        *,
        mode: InflightMode | str = InflightMode.KEEP,
        clear_cache: bool = True,
    ) -> bool:
        """One in-flight refit from NeMo-RL's trainer over its IPC wire; False on failure
        (the typed error in ``last_refit_error``; rows in flight then fail with it)."""
        return await self._refit(
            "nemo_rl_update_weights_via_ipc_zmq", refit_timeout_s, Transport.IPC, mode, clear_cache
        )

    async def update_weights_from_collective_async(
        self,
        refit_timeout_s: float | None = None,
        *,
        mode: InflightMode | str = InflightMode.KEEP,
        clear_cache: bool = True,
    ) -> bool:
        """One in-flight refit from NeMo-RL's trainer over its packed broadcasts."""
        return await self._refit(
            "nemo_rl_update_weights_from_collective",
            refit_timeout_s,
            Transport.COLLECTIVE,
            mode,
            clear_cache,
        )

    async def _refit(
        self,
        method: str,
        refit_timeout_s: float | None,
        transport: Transport,
        mode: InflightMode | str,
        clear_cache: bool,
    ) -> bool:
        try:
            worker = self._refit_owner(method, refit_timeout_s)
            if self._socket_dir_due(transport):
                await worker.call_engine_workers("nemo_rl_ipc_socket_dir", self.ipc_socket_dir)
                self._socket_dir_sent = True
            ok = await worker.refit_via(
                method, refit_timeout_s, transport, mode=mode, clear_cache=clear_cache
            )
        except GenworkerError as e:
            return self._refit_failed(method, e)
        return self._refit_succeeded(method, ok)

    # -- observability --------------------------------------------------------------
    async def report_device_id_async(self) -> list[str]:
        return await self._owner("report_device_id_async").report_device_id()

    async def _get_raw_spec_counters(self) -> dict[str, float | list[float]]:
        """The engine's metrics keyed by name (NeMo-RL's form); ``{}`` on an inert member."""
        if self._worker is None:
            return {}
        return self._by_name(await self._owner("_get_raw_spec_counters").get_counters())

    def get_vllm_logger_metrics(self) -> dict[str, list[float]]:
        """What the metrics logger sampled (``vllm_cfg.enable_vllm_metrics_logger``)."""
        return self._owner("get_vllm_logger_metrics").get_vllm_logger_metrics()

    def clear_vllm_logger_metrics(self) -> None:
        self._owner("clear_vllm_logger_metrics").clear_vllm_logger_metrics()

    async def shutdown(self) -> bool:
        """Abort what streams, stop the engine and the server (none on an inert member);
        idempotent."""
        self._shut_down = True
        if self._worker is not None:
            return await self._worker.shutdown()
        return True

    # -- refused: NeMo-RL's async worker has them, genworker's drop-in does not -----------
    async def init_nccl_reshard_comm_group_async(
        self,
        rank_prefix: int,
        pp_ips: Sequence[str],
        pp_ports: Sequence[int],
        pp_size: int,
        train_ranks_per_stage: int,
        sub_world_size: int,
    ) -> None:
        raise UnsupportedError(refusal("init_nccl_reshard_comm_group_async"))

    async def prepare_nccl_reshard_refit_info_async(self, refit_info: Mapping[str, object]) -> None:
        raise UnsupportedError(refusal("prepare_nccl_reshard_refit_info_async"))

    async def nccl_reshard_refit_async(self) -> bool:
        raise UnsupportedError(refusal("nccl_reshard_refit_async"))

    async def checkpoint_engine_rpc_async(
        self, checkpoint_method: str, method_args: tuple[object, ...] = ()
    ) -> object:
        raise UnsupportedError(refusal("checkpoint_engine_rpc_async", checkpoint_method))

    def report_refit_server_base_url(self) -> str | None:
        """NeMo-RL's sparse refit server: none here (``refit_transport`` must be null)."""
        return None

    def start_zmq_sparse_refit_relay(self) -> str:
        raise UnsupportedError(refusal("start_zmq_sparse_refit_relay"))

    def configure_zmq_sparse_refit_relay(self, relay_addresses: Sequence[str]) -> None:
        raise UnsupportedError(refusal("configure_zmq_sparse_refit_relay"))

    def stop_zmq_sparse_refit_relay(self) -> None:
        raise UnsupportedError(refusal("stop_zmq_sparse_refit_relay"))

    def setup_token_capture(self, *args: object, **kwargs: object) -> bool:
        raise UnsupportedError(refusal("setup_token_capture"))

    def install_token_capture(self, *args: object, **kwargs: object) -> bool:
        raise UnsupportedError(refusal("install_token_capture"))

    def set_rollout_weight_version(self, *args: object, **kwargs: object) -> None:
        raise UnsupportedError(refusal("set_rollout_weight_version"))

    def start_gpu_profiling(self) -> None:
        raise UnsupportedError(refusal("start_gpu_profiling"))

    def stop_gpu_profiling(self) -> None:
        raise UnsupportedError(refusal("stop_gpu_profiling"))
