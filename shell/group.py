"""``GenerationGroup``: data-parallel generation workers on Ray, one engine per shard.

Theory of operation
-------------------
* Placement is a core plan (:func:`genworker.core.placement.plan_cluster`): one PACK
  placement group of one bundle per GPU (``{"CPU": 1}`` bundles on a cluster without
  GPUs), and for each data-parallel shard the bundles its engine owns. One
  ``VllmGenerationWorker`` actor per shard sits on the shard's first bundle and builds the
  engine; a tensor/pipeline-parallel engine places vLLM's own Ray workers on the shard's
  bundles through ``VLLM_RAY_BUNDLE_INDICES`` and ``VLLM_RAY_PER_WORKER_GPUS`` (vLLM 0.32,
  ``vllm/v1/executor/ray_executor.py``), which find the placement group because the actor
  captures child tasks (``ray.util.get_current_placement_group``). Each actor's
  environment (cache root, port window, ...) is the plan's, passed as Ray
  ``runtime_env.env_vars``; its seed comes from the plan, so no two engines share one.
* Before any actor starts, Ray's bundle-to-node table is checked against the plan: the
  bundles the plan puts on one node must be on one Ray node (a TP group never crosses
  nodes by accident, port windows and seeds stay distinct), different planned nodes on
  different Ray nodes.
* Every wait is bounded (placement, engine start, each call, shutdown) and its error says
  what was waited for, how long, and on which shard. Every call on the shards goes through
  one door (``_submit``) and one wait (``_settle``, one bound for all the shards).
* ``generate``: the batch is checked in the driver first (core ``check_batch``; with media
  also ``row_media`` and core ``check_media`` against the placeholder id and image limit
  the first shard reports once, ``multimodal_info``), so a bad row submits nothing
  anywhere and errors name the batch's own rows (a row with NeMo-RL's ``vllm_content``
  text is checked by its shard, on the text's ids). Media (``multi_modal_data`` or
  NeMo-RL's side channels, one entry per row) travel with their rows: ``split_batch``
  splits per-row lists like tensors. A media row's cost counts its placeholders as one
  token each (the driver cannot expand them). Core splits it by token cost
  (``plan_shards``), the shards with rows run concurrently, a shard without rows never
  calls its actor, and core merges the outputs back into input order, padding each shard
  to the widest with the pad id.
* A failed fan-out call waits for every shard (within the bound) before it raises, so no
  result is lost and none lands in another row. A worker's own error comes back as its own
  type (``BadBatchError``, ``UnsupportedError``, ...), anything else as a
  :class:`ShardFailure` (a ``GroupError``); the faults, their lines and why a group with a
  dead shard refuses every later call: ``core.group_calls``. Either way the
  :class:`ShardFailure` (the exception or its ``__cause__``) holds each failed shard's
  error and the other shards' results (a ``generate``'s under the group's weight versions).
* ``vllm_cfg.async_engine: true`` starts ``AsyncVllmGenerationWorker`` actors (Ray async
  actors: many calls at once, so a refit can land while a shard streams). Their
  ``generate_async`` streams are merged by :meth:`GenerationGroup.generate_async`: rows
  that cannot generate come back first (checked in the driver, ``core.rows``), then every
  shard's rows as each finishes, under the batch's row index; a shard that fails gives each
  of its rows still pending the shard's error; a consumer that stops cancels the shards'
  streams (Ray cancels the actor tasks, whose requests the workers abort). ``generate``
  on async shards merges their ``weight_versions`` too.
* Adapter refits (``prepare_lora``, ``update_lora``, a batch's ``lora`` / ``lora_names``)
  and the group's weight versions (``core.group_calls.GroupRefits``): ``docs/lora.md``.
* Ray is started only when it is not running (``ray.init(address=...)`` for a cluster
  named in the spec), and only a Ray the group started is shut down with it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, Unpack

import attrs
import torch

from genworker.core.batch import batch_tensors, check_batch
from genworker.core.config import WorkerConfig
from genworker.core.counters import GroupCounters, group_counters
from genworker.core.group_calls import (
    Fault,
    GroupRefits,
    Refit,
    check_futures,
    check_in_flight,
    check_world_size,
    empty_outputs,
    failed_on,
    failed_to_start,
    fault_message,
    list_faults,
    merge_outputs,
    merge_texts,
    ray_reason,
    shard_lists,
    shard_mapping,
    shard_tensors,
    stream_pair,
    unusable,
)
from genworker.core.groups import drop_declared_groups
from genworker.core.lora import check_adapter_name
from genworker.core.multimodal import check_media_by_info
from genworker.core.placement import (
    ClusterOptions,
    ClusterPlan,
    ClusterSpec,
    check_bundle_nodes,
    check_inherited_env,
    local_cluster_spec,
    placement_not_ready,
    plan_shard_actors,
)
from genworker.core.requests import check_greedy, check_text_prompts
from genworker.core.rows import check_rows
from genworker.core.sharding import (
    ShardPlan,
    plan_prompt_rows,
    plan_prompt_shards,
    plan_text_shards,
    split_batch,
)
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineContractError,
    EngineStateError,
    GenworkerError,
    GroupError,
    UnsupportedError,
    unwrap,
)
from genworker.shell.host import ephemeral_ports, vllm_cache_root
from genworker.shell.media import image_counts, row_media

__all__ = [
    "ClusterOptions",
    "ClusterSpec",
    "GenerationGroup",
    "GroupCounters",
    "ShardFailure",
    "local_cluster",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_E = TypeVar("_E", bound=BaseException)

if TYPE_CHECKING:  # typings/ray: the Ray names used here, stubtest-checked
    from ray import ObjectRef, ObjectRefGenerator
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

# Actor handles and object refs never leave this module except as the opaque futures of
# the refit calls; what a ref resolves to is checked where it is read.


def local_cluster(
    num_shards: int = 1, *, model_parallel_size: int = 1, **options: Unpack[ClusterOptions]
) -> ClusterSpec:
    """A :class:`ClusterSpec` for this machine: its GPUs, or ``num_shards`` CPU shards
    (``core.placement.local_cluster_spec``: the fields, and what ``options`` override)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cpus = os.cpu_count()
    return local_cluster_spec(
        num_shards, model_parallel_size, gpus=gpus, cpu_count=cpus, options=options
    )


class ShardFailure(GroupError):
    """A fan-out call failed on one or more shards.

    ``errors`` maps each failed shard's rank to its error; ``results`` maps every other
    shard's rank to what it returned; ``rows`` gives each shard's input rows for
    ``generate`` and ``generate_text`` (empty otherwise).
    """

    def __init__(
        self,
        message: str,
        *,
        call: str = "",
        errors: Mapping[int, BaseException] | None = None,
        results: Mapping[int, object] | None = None,
        rows: Mapping[int, tuple[int, ...]] | None = None,
    ) -> None:
        super().__init__(message)
        self.call = call
        self.errors = dict(errors or {})
        self.results = dict(results or {})
        self.rows = dict(rows or {})


def _failure_of(error: BaseException) -> ShardFailure | None:
    """The :class:`ShardFailure` behind a failed fan-out call: the error itself, or the
    ``__cause__`` of a shard's own typed error (the module docstring)."""
    for candidate in (error, error.__cause__):
        if isinstance(candidate, ShardFailure):
            return candidate
    return None


class GenerationGroup:
    """Data-parallel ``VllmGenerationWorker`` actors on Ray behind one worker-like surface.

    ``config`` is the worker's NeMo-RL generation config (every shard gets it unchanged);
    ``worker_options`` are extra keyword arguments for each worker (e.g. ``engine_factory``
    or ``stop_mode``).
    """

    def __init__(
        self,
        config: Mapping[str, object],
        cluster: ClusterSpec,
        *,
        worker_options: Mapping[str, object] | None = None,
    ) -> None:
        self.cfg: WorkerConfig = unwrap(
            WorkerConfig.from_mapping(config), BadConfigError, "group config"
        )
        self.cluster = cluster
        sizes = (self.cfg.vllm.tensor_parallel_size, self.cfg.vllm.pipeline_parallel_size)
        self.plan: ClusterPlan = unwrap(cluster.plan(*sizes), BadConfigError, "cluster")
        unwrap(check_inherited_env(dict(os.environ)), BadConfigError, "environment")
        self._config = dict(config)
        self._worker_options = dict(worker_options or {})
        cache, ports = vllm_cache_root(), ephemeral_ports()
        actors = plan_shard_actors(
            cluster, self.plan, default_cache_root=cache, ephemeral_ports=ports
        )
        self._placements = unwrap(actors, BadConfigError, "")
        self._actors: list[ActorHandle] = []
        self._pg: PlacementGroup | None = None
        self._dead: dict[int, str] = {}
        self._closed = False
        #: the last ``generate``'s split of its rows over the shards (groups kept whole)
        self.last_shard_plan: ShardPlan | None = None
        self._multimodal: Mapping[str, object] | None = None
        #: each refit's futures (``_refit``) until ``collect`` settles them
        self._refits: dict[tuple[ObjectRef[object], ...], Refit] = {}
        #: the weight versions, adapters and ``prepare_lora`` the refits left (core value)
        self._records = GroupRefits.start(self.plan.data_parallel_size)
        self._owns_ray = _ensure_ray(cluster)
        try:
            self._start()
        except BaseException:
            self._teardown(graceful=False)
            raise

    # -- start ----------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return self.plan.data_parallel_size

    @property
    def num_engine_workers(self) -> int:
        """Engine worker processes over all shards (``num_shards x tensor x pipeline``)."""
        return self.plan.data_parallel_size * self.plan.model_parallel_size

    @property
    def actors(self) -> tuple[ActorHandle, ...]:
        """The shards' Ray actor handles, by rank (empty once shut down)."""
        return tuple(self._actors)

    @property
    def placement_group(self) -> PlacementGroup | None:
        """The group's Ray placement group (``None`` once shut down)."""
        return self._pg

    def _start(self) -> None:
        """Create the placement group and check Ray's bundle-to-node table against the
        plan, start one actor per shard on its bundle, and wait for every engine."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from genworker.shell.async_worker import AsyncVllmGenerationWorker
        from genworker.shell.worker import VllmGenerationWorker

        self._pg = pg = placement_group(self.plan.bundles, strategy=self.plan.strategy)
        timeout = self.cluster.placement_timeout_s
        if not ray.wait([pg.ready()], timeout=timeout)[0]:
            available, total = ray.available_resources(), ray.cluster_resources()
            raise GroupError(placement_not_ready(self.plan, timeout, available, total))
        table = placement_group_table(pg).get("bundles_to_node_id", {})
        nodes = {int(k): str(v) for k, v in table.items()}
        mismatch = "placement group does not match the plan"
        unwrap(check_bundle_nodes(self.plan, nodes), GroupError, mismatch)
        async_shards = self.cfg.vllm.async_engine
        actor_cls = ray.remote(AsyncVllmGenerationWorker if async_shards else VllmGenerationWorker)
        for placed in self._placements:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=placed.bundle_index,
                placement_group_capture_child_tasks=True,
            )
            actor = actor_cls.options(scheduling_strategy=strategy, **placed.options)
            self._actors.append(
                actor.remote(self._config, **placed.init_kwargs, **self._worker_options)
            )
        bound = self.cluster.start_timeout_s
        refs = self._submit("is_alive", dict.fromkeys(range(len(self._actors)), ()))
        results, errors = _settle(refs, bound)
        reasons = {rank: None if e is None else _reason(e) for rank, e in errors.items()}
        if (why := failed_to_start(results, reasons, self.num_shards, bound)) is not None:
            raise GroupError(why)

    # -- the one door: every call on the shards --------------------------------------
    def _require_usable(self, call: str) -> None:
        if (why := unusable(call, closed=self._closed, dead=self._dead)) is not None:
            raise GroupError(why)

    def _submit(
        self, call: str, args: Mapping[int, Sequence[object]], **kwargs: object
    ) -> dict[int, ObjectRef[object]]:
        """``call(*args[rank], **kwargs)`` on each shard ``args`` names; its futures."""
        self._require_usable(call)
        return {
            rank: getattr(self._actors[rank], call).remote(*shard_args, **kwargs)
            for rank, shard_args in args.items()
        }

    def _every(self, *args: object, prefixed: bool = False) -> dict[int, tuple[object, ...]]:
        """The same ``args`` for every shard; ``prefixed``: after its engine workers' rank
        prefix, their ranks after the trainer's and the earlier shards' (``s x tensor x
        pipeline``)."""
        size = self.plan.model_parallel_size
        return {rank: (rank * size, *args) if prefixed else args for rank in range(self.num_shards)}

    def _answers(self, call: str, *args: object, timeout_s: float | None = None) -> list[object]:
        """``call(*args)`` on every shard; their answers in shard order."""
        results = self._gather(call, self._submit(call, self._every(*args)), timeout_s, _as_is)
        return [results[rank] for rank in range(self.num_shards)]

    def _lists(
        self, call: str, *args: object, timeout_s: float | None = None
    ) -> list[list[object]]:
        """:meth:`_answers` of a call that answers a list on every shard."""
        answers = self._answers(call, *args, timeout_s=timeout_s)
        return unwrap(shard_lists(call, answers), EngineContractError, "")

    def _gather(
        self,
        call: str,
        refs: Mapping[int, ObjectRef[object]],
        timeout_s: float | None,
        each: Callable[[int, object], _T],
        rows: Mapping[int, tuple[int, ...]] | None = None,
    ) -> dict[int, _T]:
        """Every shard's result (``each(rank, result)``), by rank; raises once every shard
        answered or timed out."""
        bound = self.cluster.call_timeout_s if timeout_s is None else timeout_s
        answered, failed = _settle(refs, bound)
        results = {rank: each(rank, value) for rank, value in answered.items()}
        errors = {
            rank: self._translate(call, rank, error, (rows or {}).get(rank, ()), bound)
            for rank, error in failed.items()
        }
        if not errors:
            return results
        lines = {rank: str(e) for rank, e in errors.items()}
        failure = ShardFailure(
            failed_on(call, lines, self.num_shards),
            call=call,
            errors=errors,
            results=results,
            rows=rows,
        )
        if any(isinstance(e, GroupError) for e in errors.values()):
            raise failure
        raise _renamed(errors[min(errors)], list_faults(lines), failure)

    def _translate(
        self,
        call: str,
        rank: int,
        error: BaseException | None,
        rows: tuple[int, ...] = (),
        bound: float = 0.0,
    ) -> GenworkerError:
        """How a shard's call failed (``None``: no answer within ``bound``; the faults of
        ``core.group_calls``), as the worker's own type or a GroupError; a worker's error
        names the shard's own rows, so the batch's rows they are follow."""
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        cause = error.cause if isinstance(error, RayTaskError) else error
        if error is None:
            return GroupError(fault_message(Fault.LATE, call, rank, bound=bound))
        if isinstance(cause, GenworkerError) and cause is not error:  # a task's own error
            line = fault_message(Fault.WORKER, call, rank, detail=str(cause), rows=rows)
            return _renamed(cause, line, error)
        if isinstance(error, (RayActorError, ActorUnavailableError)):
            self._dead[rank] = _reason(error)
            line = fault_message(Fault.DIED, call, rank, detail=self._dead[rank])
        else:
            detail = f"{type(cause).__name__}: {cause}"
            line = fault_message(Fault.FOREIGN, call, rank, detail=detail)
        translated = GroupError(line)
        translated.__cause__ = error
        return translated

    def _run_shards(
        self,
        call: str,
        plan: ShardPlan,
        data: Mapping[str, object],
        greedy: bool,
        timeout_s: float | None,
        each: Callable[[int, object], _T],
    ) -> dict[int, _T]:
        """``call(rows, greedy)`` on every shard the plan gives rows, each its own."""
        parts = unwrap(split_batch(plan, data), BadBatchError, call)
        args = {r: (parts[r], greedy) for r in range(self.num_shards) if plan.sizes[r]}
        rows = {rank: plan.shards[rank] for rank in range(plan.num_shards)}
        return self._gather(call, self._submit(call, args), timeout_s, each, rows)

    # -- generation -----------------------------------------------------------------
    def generate(
        self,
        data: Mapping[str, object],
        greedy: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Generate for a right-padded batch across the shards; rows come back in order."""
        self._require_usable("generate")
        input_ids, input_lengths = _padded_batch(data, greedy)
        batch = unwrap(
            check_batch(
                input_ids,
                input_lengths,
                pad_token_id=self.cfg.pad_token_id,
                vocab_size=None,
                max_model_len=self.cfg.vllm.max_model_len,
            ),
            BadBatchError,
            "generate batch",
        )
        media = row_media(data, batch.batch_size, "generate")
        unwrap(self._records.check_adapters(data, batch.batch_size), BadBatchError, "generate")
        if not batch.lengths:
            return empty_outputs(input_ids, input_lengths, self.cfg.pad_token_id)
        # A row with prompt text (NeMo-RL's vllm_content) is checked by its shard.
        texts = {r for r, m in enumerate(media or ()) if m is not None and m.text is not None}
        counts = image_counts(media, batch.batch_size)
        info = self._multimodal_info(timeout_s)
        checked = check_media_by_info(batch.prompts, counts, info, text_rows=texts)
        unwrap(checked, BadBatchError, "multi_modal_data")
        data = unwrap(drop_declared_groups(data, batch.prompts), BadBatchError, "generate")
        new_tokens = self.cfg.max_new_tokens
        plan = plan_prompt_shards(batch.prompts, self.num_shards, max_new_tokens=new_tokens)
        self.last_shard_plan = plan
        results = self._run_shards("generate", plan, data, greedy, timeout_s, self._output)
        return merge_outputs(plan, results, self.cfg.pad_token_id)

    async def generate_async(
        self,
        data: Mapping[str, object],
        greedy: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[tuple[int, dict[str, torch.Tensor] | GenworkerError], None]:
        """The shards' ``generate_async`` streams merged: ``(row, output)`` or ``(row,
        error)`` under the batch's row index, as each row finishes (async shards only;
        ``timeout_s`` bounds the whole stream, default ``call_timeout_s``)."""
        self._require_usable("generate_async")
        if not self.cfg.vllm.async_engine:
            raise UnsupportedError(
                "generate_async needs async shards: set vllm_cfg.async_engine: true"
            )
        input_ids, input_lengths = _padded_batch(data, greedy)
        checks = unwrap(
            check_rows(
                input_ids,
                input_lengths,
                pad_token_id=self.cfg.pad_token_id,
                max_model_len=self.cfg.vllm.max_model_len,
            ),
            BadBatchError,
            "generate_async batch",
        )
        num_rows = len(checks.prompts) + len(checks.errors)
        unwrap(self._records.check_adapters(data, num_rows), BadBatchError, "generate_async")
        for row, problem in checks.errors:
            yield row, BadBatchError(f"row {row} cannot generate: {problem}", detail=problem)
        if not checks.prompts:
            return
        # The rows that cannot generate make the plan's last shard, which runs nowhere.
        plan = plan_prompt_rows(
            checks.prompts, num_rows, self.num_shards, max_new_tokens=self.cfg.max_new_tokens
        )
        parts = unwrap(split_batch(plan, data), BadBatchError, "generate_async")
        bound = self.cluster.call_timeout_s if timeout_s is None else timeout_s
        deadline = asyncio.get_running_loop().time() + bound
        queue: asyncio.Queue[tuple[int, dict[str, torch.Tensor] | GenworkerError]] = asyncio.Queue()
        streams: dict[int, ObjectRefGenerator] = {}
        tasks: list[asyncio.Task[None]] = []
        for rank in range(self.num_shards):
            if not plan.sizes[rank]:
                continue
            method = self._actors[rank].generate_async.options(num_returns="streaming")
            streams[rank] = stream = method.remote(parts[rank], greedy)
            drain = self._drain_shard(rank, stream, plan.shards[rank], deadline, bound, queue)
            tasks.append(asyncio.ensure_future(drain))
        try:
            for _ in range(len(checks.prompts)):
                yield await queue.get()
        finally:
            import ray

            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams.values():
                if not stream.is_finished():
                    ray.cancel(stream)

    async def _drain_shard(
        self,
        rank: int,
        stream: ObjectRefGenerator,
        rows: tuple[int, ...],
        deadline: float,
        bound: float,
        queue: asyncio.Queue[tuple[int, dict[str, torch.Tensor] | GenworkerError]],
    ) -> None:
        """Put each of a shard's rows on ``queue`` under its batch index; if the shard
        fails, each row it still owes gets the shard's error. One bound: the stream's
        ``deadline`` (loop time), over every wait of the shard."""
        pending = set(range(len(rows)))
        try:
            async with asyncio.timeout_at(deadline):
                async for ref in stream:
                    # a bad pair raises here, translated below with the rest
                    local, item = unwrap(stream_pair(rank, await ref), EngineContractError, "")
                    row = rows[local]
                    pending.discard(local)
                    if isinstance(item, GenworkerError):
                        item = _renamed(item, f"shard {rank}, batch row {row}: {item}", item)
                    elif isinstance(item, dict):
                        item = self._records.relabelled(rank, item)
                    else:
                        item = EngineContractError(
                            f"shard {rank}: generate_async yielded {item!r:.200}"
                        )
                    queue.put_nowait((row, item))
                    if not pending:
                        return
            error: GenworkerError = EngineContractError(
                f"shard {rank}: its stream ended with {len(pending)} row(s) missing"
            )
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            error = self._translate("generate_async", rank, None, bound=bound)
        except BaseException as e:  # noqa: BLE001 - every row the shard owes gets it
            error = self._translate("generate_async", rank, e)
        for local in sorted(pending):
            queue.put_nowait((rows[local], error))

    def generate_text(
        self,
        data: Mapping[str, object],
        greedy: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> dict[str, list[str]]:
        """Generate from text prompts across the shards, balanced by prompt characters."""
        self._require_usable("generate_text")
        unwrap(check_greedy(greedy), BadArgumentError, "")
        given = data.get("prompts") if isinstance(data, Mapping) else None
        prompts = unwrap(check_text_prompts(given), BadBatchError, "")
        # The media's shape here; their counts against the placeholders per shard.
        row_media(data, len(prompts), "generate_text", texts=False)
        unwrap(self._records.check_adapters(data, len(prompts)), BadBatchError, "generate_text")
        if not prompts:
            return {"texts": []}
        plan = plan_text_shards(prompts, self.num_shards, max_new_tokens=self.cfg.max_new_tokens)
        results = self._run_shards("generate_text", plan, data, greedy, timeout_s, _as_is)
        return {"texts": unwrap(merge_texts(plan, results), EngineContractError, "")}

    def _output(self, rank: int, value: object) -> dict[str, torch.Tensor]:
        """Shard ``rank``'s ``generate`` output, checked and relabelled."""
        output = unwrap(shard_tensors("generate", rank, value), EngineContractError, "")
        return self._records.relabelled(rank, output)

    def _multimodal_info(self, timeout_s: float | None) -> Mapping[str, object]:
        """The first shard's image placeholder id and image limit (asked once: every shard
        serves the same model)."""
        if self._multimodal is None:
            ref = self._submit("multimodal_info", {0: ()})
            info = self._gather("multimodal_info", ref, timeout_s, _as_is)[0]
            checked = shard_mapping("multimodal_info", 0, info)
            self._multimodal = unwrap(checked, EngineContractError, "")
        return self._multimodal

    # -- memory ---------------------------------------------------------------------
    def sleep(self, level: int | None = None, *, timeout_s: float | None = None) -> None:
        """Put every shard's engine to sleep (see ``VllmGenerationWorker.sleep``)."""
        self._answers("sleep", level, timeout_s=timeout_s)

    def wake_up(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None) -> None:
        """Wake ``tags`` (``weights``, ``kv_cache``; ``None``: both) on every shard."""
        self._answers("wake_up", None if tags is None else list(tags), timeout_s=timeout_s)

    def reset_prefix_cache(self, *, timeout_s: float | None = None) -> None:
        self._answers("reset_prefix_cache", timeout_s=timeout_s)

    # -- refit ----------------------------------------------------------------------
    def prepare_refit_info(
        self,
        state_dict_info: Mapping[str, tuple[Sequence[int], object]],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Give every shard the names, shapes and dtypes each refit carries."""
        self._answers("prepare_refit_info", dict(state_dict_info), timeout_s=timeout_s)

    def refit_address(self, *, timeout_s: float | None = None) -> list[list[object]]:
        """Each shard's IPC refit addresses (one per engine worker), in shard order."""
        return self._lists("refit_address", timeout_s=timeout_s)

    def release_refit_buffers(self, *, timeout_s: float | None = None) -> list[list[object]]:
        """Every shard's ``release_refit_buffers``: the trainer memory its engine workers
        keep mapped between IPC refits is let go (counts per engine worker, shard order)."""
        return self._lists("release_refit_buffers", timeout_s=timeout_s)

    def init_collective(
        self,
        ip: str,
        port: int,
        world_size: int,
        *,
        train_world_size: int,
        timeout_s: float | None = None,
    ) -> list[ObjectRef[object]]:
        """Join every engine worker to the trainer's weight-update group; returns futures.

        The trainer holds ranks ``0..train_world_size-1``; shard ``s`` gets rank prefix
        ``s x tensor x pipeline``, so its engine workers take the ranks after those of
        the shards before it. Pass the futures to :meth:`collect` once the trainer joined.
        """
        args = (ip, port, world_size, train_world_size, timeout_s)
        return self._join("init_collective", world_size, train_world_size, args)

    def init_nccl_reshard_comm_group(
        self,
        pp_ips: Sequence[str],
        pp_ports: Sequence[int],
        *,
        train_ranks_per_stage: int,
        sub_world_size: int,
        timeout_s: float | None = None,
    ) -> list[ObjectRef[object]]:
        """Join every engine worker to each trainer PP stage's reshard group; returns
        futures (pass them to :meth:`collect` once the trainer ranks joined).

        Shard ``s`` gets rank prefix ``s x tensor x pipeline``, as in
        :meth:`init_collective`; ``sub_world_size`` must be the stage's trainer ranks and
        this group's engine workers."""
        ips, ports = list(pp_ips), list(pp_ports)
        args = (ips, ports, len(ips), train_ranks_per_stage, sub_world_size, timeout_s)
        call = "init_nccl_reshard_comm_group"
        return self._join(call, sub_world_size, train_ranks_per_stage, args)

    def _join(
        self, call: str, size: int, trainer_ranks: int, args: tuple[object, ...]
    ) -> list[ObjectRef[object]]:
        """``call(rank_prefix, *args)`` on every shard once the group's ``size`` is the
        trainer's ranks and this group's engine workers (``core.group_calls.JOINS``)."""
        self._require_usable(call)
        checked = check_world_size(call, size, trainer_ranks, self.num_engine_workers)
        unwrap(checked, BadArgumentError, "")
        return list(self._submit(call, self._every(*args, prefixed=True)).values())

    def prepare_nccl_reshard_refit_info(
        self, refit_info: Mapping[str, object], *, timeout_s: float | None = None
    ) -> list[list[object]]:
        """Every shard's engine workers' answers (shard order): for the trainer's
        ``ReshardSender.plan(shards_of(answers[s]), rank_prefix=s x tensor x pipeline)``."""
        return self._lists("prepare_nccl_reshard_refit_info", dict(refit_info), timeout_s=timeout_s)

    def update_weights_from_collective(
        self,
        timeout_s: float | None = None,
        *,
        mode: str | None = None,
        clear_cache: bool | None = None,
    ) -> list[ObjectRef[object]]:
        """Start the collective refit on every shard; returns one future per shard
        (``mode`` / ``clear_cache``: what async shards do with requests in flight)."""
        return self._refit("update_weights_from_collective", timeout_s, mode, clear_cache)

    def update_weights_via_ipc_zmq(
        self,
        timeout_s: float | None = None,
        *,
        mode: str | None = None,
        clear_cache: bool | None = None,
    ) -> list[ObjectRef[object]]:
        """As :meth:`update_weights_from_collective`, for the IPC refit."""
        return self._refit("update_weights_via_ipc_zmq", timeout_s, mode, clear_cache)

    def nccl_reshard_refit(self, refit_timeout_s: float | None = None) -> list[ObjectRef[object]]:
        """Start the reshard refit on every shard; returns one future per shard."""
        return self._refit("nccl_reshard_refit", refit_timeout_s, None, None)

    def _refit(
        self,
        call: str,
        timeout_s: float | None,
        mode: str | None,
        clear_cache: bool | None,
        adapter: str | None = None,
        options: Mapping[str, object] | None = None,
    ) -> list[ObjectRef[object]]:
        """Every refit's start: ``call([adapter,] timeout_s, **options, ...)`` on every
        shard; the futures are kept until :meth:`collect` counts the refit's outcome."""
        self._require_usable(call)
        async_shards = self.cfg.vllm.async_engine
        checked = check_in_flight(call, mode, clear_cache, async_shards=async_shards)
        in_flight = unwrap(checked, UnsupportedError, "")
        lead = () if adapter is None else (adapter,)
        refs = self._submit(call, self._every(*lead, timeout_s), **(options or {}), **in_flight)
        futures = list(refs.values())
        self._refits[tuple(futures)] = Refit(call, adapter)
        return futures

    def collect(
        self,
        futures: Sequence[ObjectRef[object]],
        *,
        call: str | None = None,
        timeout_s: float | None = None,
    ) -> list[object]:
        """Wait for per-shard futures (from ``init_collective`` / ``update_weights_*`` /
        ``update_lora`` ...).

        Errors are translated as for every other call and name the shard (and ``call``:
        by default the refit's own name, else ``refit``). A refit counts here, failed or
        not: the shards it landed on take the group's next weight version
        (``docs/lora.md``), and an adapter that landed on every shard is served by the group.
        """
        unwrap(check_futures(len(futures), self.num_shards), BadArgumentError, "")
        refit = self._refits.pop(tuple(futures), None)
        name = call or (refit.call if refit is not None else "refit")
        try:
            results = self._gather(name, dict(enumerate(futures)), timeout_s, _as_is)
        except GenworkerError as e:
            failure = _failure_of(e)
            self._records = self._records.landed(refit, {} if failure is None else failure.results)
            raise
        self._records = self._records.landed(refit, results)
        return [results[rank] for rank in range(self.num_shards)]

    # -- adapter refits (docs/lora.md) ----------------------------------------------
    def prepare_lora(
        self,
        adapter_info: Mapping[str, tuple[Sequence[int], object]],
        peft_config: Mapping[str, object],
        *,
        timeout_s: float | None = None,
    ) -> list[list[object]]:
        """Every shard's ``prepare_lora``: the adapter (its tensors ``{name: (shape,
        dtype)}`` in PEFT's names, its ``adapter_config``) checked against each engine;
        each shard's IPC addresses (one per engine worker), in shard order, as
        :meth:`refit_address`, for ``RefitSender.ipc(address, manifest=adapter_info)``.
        Until it succeeds on every shard, :meth:`update_lora` is refused."""
        self._records = attrs.evolve(self._records, lora_prepared=False)
        answers = self._lists(
            "prepare_lora", dict(adapter_info), dict(peft_config), timeout_s=timeout_s
        )
        self._records = attrs.evolve(self._records, lora_prepared=True)
        return answers

    def update_lora(
        self,
        name: str,
        timeout_s: float | None = None,
        *,
        mode: str | None = None,
        clear_cache: bool | None = None,
        transport: str | None = None,
    ) -> list[ObjectRef[object]]:
        """Start an adapter refit served as ``name`` on every shard; returns one future
        per shard (send the adapter to every address of :meth:`prepare_lora`, or with
        ``transport="collective"`` broadcast it to the group of :meth:`init_collective`,
        then pass the futures to :meth:`collect`; ``mode`` / ``clear_cache``: what async
        shards do with requests in flight). A bad name, or no :meth:`prepare_lora` that
        succeeded on every shard, is refused here and starts nothing."""
        if (problem := check_adapter_name(name)) is not None:
            raise BadArgumentError(f"update_lora: {problem}")
        if not self._records.lora_prepared:
            raise EngineStateError(
                "update_lora needs a prepare_lora that succeeded on every shard first"
            )
        options = {} if transport is None else {"transport": transport}
        return self._refit("update_lora", timeout_s, mode, clear_cache, name, options)

    # -- observability --------------------------------------------------------------
    def report_device_id(self, *, timeout_s: float | None = None) -> list[list[str]]:
        answers = self._lists("report_device_id", timeout_s=timeout_s)
        return [[str(d) for d in devices] for devices in answers]

    def get_counters(self, *, timeout_s: float | None = None) -> GroupCounters:
        """Every shard's counter snapshot, their sum, and spec-decode acceptance."""
        answers = self._answers("get_counters", timeout_s=timeout_s)
        return unwrap(group_counters(answers), EngineContractError, "")

    def is_alive(self, *, timeout_s: float | None = None) -> bool:
        """Whether every shard's engine answers that it is alive (bounded)."""
        if self._closed or self._dead:
            return False
        try:
            return all(r is True for r in self._answers("is_alive", timeout_s=timeout_s))
        except GroupError as e:  # a health probe: a shard that cannot answer is not alive
            log.warning("is_alive: %s", e)
            return False

    # -- sparse-delta refit (issue 16): each shard's calls, in shard order ---------------
    def start_zmq_sparse_refit_relay(
        self, host: str = "127.0.0.1", allow_remote: bool = False, *, timeout_s: float | None = None
    ) -> list[list[object]]:
        """Start every shard's relay receivers; their addresses (per engine worker)."""
        return self._lists("start_zmq_sparse_refit_relay", host, allow_remote, timeout_s=timeout_s)

    def configure_zmq_sparse_refit_relay(
        self, relay_addresses: Sequence[str], *, timeout_s: float | None = None
    ) -> None:
        """Tell every shard's receivers the whole relay (the root first)."""
        call = "configure_zmq_sparse_refit_relay"
        self._answers(call, list(relay_addresses), timeout_s=timeout_s)

    def report_refit_server_base_url(self, *, timeout_s: float | None = None) -> list[object]:
        """Each shard's first relay receiver address (``None`` where the relay is off)."""
        return self._answers("report_refit_server_base_url", timeout_s=timeout_s)

    def stop_zmq_sparse_refit_relay(self, *, timeout_s: float | None = None) -> None:
        self._answers("stop_zmq_sparse_refit_relay", timeout_s=timeout_s)

    # -- shutdown -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every engine, kill the actors, remove the placement group; idempotent.

        Engines get ``shutdown_timeout_s`` to shut down cleanly; the actors are killed
        either way. A Ray this group started is shut down with it.
        """
        self._teardown(graceful=True)

    def _teardown(self, *, graceful: bool) -> None:
        if self._closed:
            return
        self._closed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        actors, self._actors = self._actors, []
        refs = {
            rank: actor.shutdown.remote()
            for rank, actor in enumerate(actors)
            if graceful and rank not in self._dead
        }
        bound = self.cluster.shutdown_timeout_s
        for rank, error in _settle(refs, bound)[1].items():
            why = f"did not finish within {bound:g} s" if error is None else f"failed ({error})"
            log.warning("shard %d: engine shutdown %s; killing it", rank, why)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        pg, self._pg = self._pg, None
        if pg is not None:
            remove_placement_group(pg)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> GenerationGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._closed else f"dead shards {sorted(self._dead)}"
        return (
            f"GenerationGroup(model={self.cfg.model_name!r}, shards={self.num_shards}, "
            f"tp={self.plan.tensor_parallel_size}, pp={self.plan.pipeline_parallel_size}, "
            f"{state if self._closed or self._dead else 'running'})"
        )


# -- Ray edge ---------------------------------------------------------------------------


def _ensure_ray(cluster: ClusterSpec) -> bool:
    """Start Ray unless it runs already; whether this call started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(**cluster.ray_init_kwargs)
    return True


def _settle(
    refs: Mapping[int, ObjectRef[object]], bound: float
) -> tuple[dict[int, object], dict[int, Exception | None]]:
    """The one wait under every group call: each ref's result by rank, or its Ray error
    (``None``: no answer within ``bound`` seconds, the whole wait's one bound)."""
    import ray
    from ray.exceptions import RayError

    ready = (
        set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=bound)[0])
        if refs
        else set()
    )
    results: dict[int, object] = {}
    errors: dict[int, Exception | None] = {}
    for rank, ref in refs.items():
        try:
            if ref not in ready:
                errors[rank] = None
            else:
                results[rank] = ray.get(ref)
        except RayError as e:
            errors[rank] = e
    return results, errors


def _reason(error: BaseException) -> str:
    """A one-line reason from a Ray error: the cause of a task error, else Ray's account
    (``core.group_calls.ray_reason``)."""
    from ray.exceptions import RayTaskError

    if isinstance(error, RayTaskError):
        return f"{type(error.cause).__name__}: {error.cause}"
    text = str(getattr(error, "error_msg", "") or error)
    init_failed = bool(getattr(error, "actor_init_failed", False))
    return ray_reason(text, type(error).__name__, init_failed=init_failed)


def _renamed(error: _E, message: str, cause: BaseException) -> _E:
    """A copy of ``error`` (its type and fields) that says ``message``, caused by ``cause``."""
    named = copy.copy(error)
    named.args = (message,)
    named.__cause__ = cause
    return named


# -- values at the edge -----------------------------------------------------------------


def _as_is(rank: int, value: object) -> object:
    return value


def _padded_batch(data: Mapping[str, object], greedy: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch's ``input_ids`` and ``input_lengths``, once ``greedy`` is a bool."""
    unwrap(check_greedy(greedy), BadArgumentError, "")
    return unwrap(batch_tensors(data), BadBatchError, "generate")
