"""``VllmGenerationWorker``: NeMo-RL's worker surface over an engine port, the batch drive
loop over :class:`~genworker.shell.spine.WorkerSpine`.

The worker is a thin shell: every decision is a core function or the spine's (config,
batch checks, the request plan of ``core.requests``, output assembly, lifecycle, the
cache-reset and error rules, when the engine counts as dead), the only effects are calls
on the engine port. Each call first asks core's lifecycle table whether it is allowed, so
a refused call touches nothing.

Calls are serialised: every public method that touches the engine or the lifecycle state
holds the worker's :class:`~genworker.shell.engine_lock.EngineLock` from its lifecycle
check to its commit. A call that finds another running waits for it, at most
``busy_wait_s`` seconds, then is refused with ``EngineStateError`` (so a refit that arrives
during a long ``generate`` runs after it, never under its forward). ``llm`` and ``engine``
hand out the raw engine outside that rule.

A row without room left in the context (``core.requests.plan_requests``: with speculative
decoding the drafter's k + 1 slots count too; a media row counts with its expanded prompt)
is refused alone: it comes back unchanged with generation length 0 (``generate_text``: an
empty text), it is named in a warning and in ``last_refused_rows``, and the other rows
generate. Images come in ``data["multi_modal_data"]`` or NeMo-RL's ``vllm_images`` /
``vllm_content`` side channels (:mod:`genworker.shell.media`); a row whose prompt text
came with its images starts from that text's ids, and its output keeps the caller's ids.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Concatenate, ParamSpec, TypeVar

import torch
from returns.result import Failure

from genworker.core import lifecycle
from genworker.core.assembly import (
    FlatGenerations,
    GenerationOutputs,
    assemble_flat_outputs,
    assemble_outputs,
    flatten_generations,
    place_rows,
)
from genworker.core.groups import order_rows
from genworker.core.joins import reshard_join
from genworker.core.outputs import (
    NonFiniteLogprobs,
    check_context,
    check_finished,
    check_logprobs,
    check_routed_experts,
)
from genworker.core.placement import bundle_group_size
from genworker.core.placement import configure_worker as plan_placement
from genworker.core.refit_protocol import (
    Transport,
    refit_report,
    refit_waits,
    rpc_bound,
    wait_bound,
)
from genworker.core.reshard import prepared_params, refit_info_of
from genworker.core.rows import uniform_versioned
from genworker.core.scoring import assemble_scores
from genworker.core.sparse_protocol import (
    check_relay_addresses,
    check_relay_start,
    relay_statuses,
    sparse_steps,
)
from genworker.core.stops import StopMode
from genworker.shell.collector import defer_cyclic_gc
from genworker.shell.engine_lock import EngineLock
from genworker.shell.errors import (
    BadArgumentError,
    BadConfigError,
    EngineContractError,
    EngineDeadError,
    EngineStateError,
    RequestAbortedError,
    unwrap,
)
from genworker.shell.host import ephemeral_ports, vllm_cache_root
from genworker.shell.ports import EngineFactory, EnginePort
from genworker.shell.refit.sparse import SparseRefitError
from genworker.shell.spine import (
    BatchPlan,
    Drive,
    ExistingEngineFactory,
    Steps,
    WorkerSpine,
    door_of,
    forward_env,
    tally_nonfinite,
)

__all__ = ["ExistingEngine", "VllmGenerationWorker"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_P = ParamSpec("_P")


#: An :class:`EngineFactory` that hands the worker an engine already running.
ExistingEngine = ExistingEngineFactory[EnginePort]


def _default_factory() -> EngineFactory:
    from genworker.shell.vllm_engine import VllmEngineFactory

    return VllmEngineFactory()


def _serialized(
    method: Callable[Concatenate[VllmGenerationWorker, _P], _T],
) -> Callable[Concatenate[VllmGenerationWorker, _P], _T]:
    """Run ``method`` holding the worker's lock (see the module docstring)."""

    @functools.wraps(method)
    def serialized(self: VllmGenerationWorker, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        with self._lock.hold(method.__name__):
            return method(self, *args, **kwargs)

    return serialized


def _serving(
    method: Callable[Concatenate[VllmGenerationWorker, _P], _T],
) -> Callable[Concatenate[VllmGenerationWorker, _P], _T]:
    """Run a batch holding the worker's lock, through the lifecycle's ``GENERATE`` (checked
    first, committed at the end) after the sparse relay's steps (:meth:`_check_sparse`).
    While the relay is on, whose steps arrive on a thread of their own, the batch holds
    the engine workers' weights (``refit_hold``): a step waits for it (bounded) or is
    refused; none is applied under it (issue 44 item 3)."""

    @functools.wraps(method)
    def serving(self: VllmGenerationWorker, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        with self._lock.hold(method.__name__):
            held = self._sparse_urls is not None
            if held:
                self._rpc("refit_hold", True, self._lock.wait_s)
            try:
                self._check_sparse()
                next_state = self._move(lifecycle.Event.GENERATE)
                out = method(self, *args, **kwargs)
                self._state = next_state
                return out
            finally:
                if held:
                    self._rpc("refit_hold", False, 0.0)

    return serving


def _door(
    body: Callable[Concatenate[WorkerSpine[EnginePort], _P], Steps[_T]],
) -> Callable[Concatenate[VllmGenerationWorker, _P], _T]:
    """The public method that drives the spine's ``body`` holding the worker's lock (its
    name and docstring ``body``'s, ``shell.spine.door_of``)."""

    def door(self: VllmGenerationWorker, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return self._drive(body(self, *args, **kwargs))

    return _serialized(door_of(door, body))


_NO_ROWS = flatten_generations([])


class VllmGenerationWorker(WorkerSpine[EnginePort]):
    """One vLLM engine serving rollouts, with NeMo-RL's ``VllmGenerationWorker`` surface.

    ``busy_wait_s``: how long a call waits for another one to finish before it is refused
    with ``EngineStateError`` (0: refuse at once).
    """

    _ASYNC_ENGINE = False
    _WRONG_ENGINE = (
        "vllm_cfg.async_engine is true: VllmGenerationWorker runs the synchronous "
        "vllm.LLM; use genworker.shell.async_worker.AsyncVllmGenerationWorker, or set "
        "vllm_cfg.async_engine: false"
    )

    def __init__(
        self,
        config: Mapping[str, object],
        bundle_indices: Sequence[int] | None = None,
        fraction_of_gpus: float = 1.0,
        seed: int | None = None,
        extra_env_vars: Sequence[str] | None = None,
        defer_model_load: bool = False,
        *,
        engine_factory: EngineFactory | None = None,
        stop_mode: StopMode | None = None,
        busy_wait_s: float = 600.0,
    ) -> None:
        self._lock = EngineLock(busy_wait_s)
        super().__init__(config, bundle_indices, fraction_of_gpus, seed, extra_env_vars, stop_mode)
        self._factory = engine_factory
        self._sparse_urls: list[str] | None = None  # the engine workers' relay receivers
        self._sparse_applied: list[object] = []  # their applied counts as last seen
        if not defer_model_load:
            self.load_model()

    # -- placement and construction -------------------------------------------------
    @staticmethod
    def configure_worker(
        num_gpus: float,
        bundle_indices: tuple[int, Sequence[int]] | None = None,
        num_gpus_per_node: int | None = None,
        *,
        cache_root: str | None = None,
    ) -> tuple[dict[str, object], dict[str, str], dict[str, object], dict[str, object]]:
        """NeMo-RL's static placement hook: ``(resources, env_vars, init_kwargs,
        runtime_env)`` (``runtime_env`` is empty: no nsight profiling).

        ``VLLM_CACHE_ROOT`` is ``<cache_root>_<seed>``, ``cache_root`` defaulting to the
        inherited ``VLLM_CACHE_ROOT`` or ``~/.cache/vllm``; ``VLLM_PORT`` stays below this
        host's ephemeral port range or the call fails naming the range."""
        plan = unwrap(
            plan_placement(
                num_gpus,
                bundle_indices,
                num_gpus_per_node,
                cache_root=cache_root or vllm_cache_root(),
                tensor_parallel_size=bundle_group_size(bundle_indices),
                ephemeral_ports=ephemeral_ports(),
            ),
            BadConfigError,
            "configure_worker",
        )
        return dict(plan.resources), dict(plan.env_vars), dict(plan.init_kwargs), {}

    @_serialized
    def load_model(self) -> None:
        """Start the engine (the deferred half of ``__init__``)."""
        self._loaded(self._start(self._factory or _default_factory(), lambda e: e.shutdown()))
        self._drive(self._configure_finite_check())

    forward_env = staticmethod(forward_env)

    def _call(self, fn: Callable[[EnginePort], _T]) -> _T:
        if not self._lock.held():
            raise RuntimeError("genworker bug: an engine call without the worker's lock")
        try:
            return fn(self.engine)
        except EngineDeadError as e:
            self._died(e)
            raise
        except EngineContractError as e:  # generate_text: the engine checked its rows
            if isinstance(e.detail, NonFiniteLogprobs):
                tally_nonfinite(self.nonfinite_logprobs, Failure(e.detail))
            raise

    # -- generation -----------------------------------------------------------------
    @_serving
    @defer_cyclic_gc()
    def generate(self, data: Mapping[str, object], greedy: bool = False) -> dict[str, torch.Tensor]:
        """Generate for a right-padded batch; returns NeMo-RL's output contract. Cyclic GC
        waits for the end of the call (``genworker.shell.collector``)."""
        input_ids, input_lengths, plan = self._token_batch(data, greedy, whole=True)
        if not plan.batch_size:
            empty = assemble_outputs(input_ids, input_lengths, [], self.cfg.pad_token_id)
            return uniform_versioned(empty, self._version)
        requests = plan.requests.requests()
        made = self._generate_groups(data, plan) if requests else _NO_ROWS
        # Rows without room come back empty, as if never sent.
        generations = place_rows(made, [row for row, _ in requests], plan.batch_size)
        checked = self._checked(input_ids, input_lengths, generations, plan)
        return uniform_versioned(checked, self._version)

    def _generate_groups(self, data: Mapping[str, object], plan: BatchPlan) -> FlatGenerations:
        """The plan's rows through one engine call, groups as the spine plans them
        (``core.groups``: vLLM's ``n``, or a group's rows one after another), the rows
        back in ascending batch order."""
        groups = self._groups(data, plan)
        batch = plan.requests.engine_batch(plan.prompts, plan.media, groups.requests())
        progress = self.cfg.vllm.use_tqdm
        made = self._call(lambda e: e.generate(batch, use_tqdm=progress))
        return order_rows(made, groups.output_rows())

    def _checked(
        self,
        input_ids: torch.Tensor,
        input_lengths: torch.Tensor,
        generations: FlatGenerations,
        plan: BatchPlan,
    ) -> GenerationOutputs:
        """The engine's rows, before any reaches the trainer: non-finite logprobs (G11; one
        vectorised pass when all are finite), aborted rows (G14) and rows past the context
        (with media, what ``plan`` holds in it), named by batch row."""
        caps = self.caps
        checked = check_logprobs(generations.logprobs, generations.lengths, caps.logprobs_mode)
        tally_nonfinite(self.nonfinite_logprobs, checked)
        unwrap(checked, EngineContractError, "generate")
        unwrap(check_finished(generations), RequestAbortedError, "generate")
        prompts = input_lengths.cpu().to(torch.int64).numpy()
        unwrap(check_routed_experts(generations, prompts), EngineContractError, "generate")
        out = assemble_flat_outputs(input_ids, input_lengths, generations, self.cfg.pad_token_id)
        expanded = [plan.context[row] for row in range(len(plan.context))] if plan.media else None
        return unwrap(check_context(out, caps.max_model_len, expanded), EngineContractError, "")

    @_serving
    def compute_logprobs(
        self, data: Mapping[str, object], top_k: int = 0
    ) -> dict[str, torch.Tensor]:
        """The logprobs of given sequences (one forward pass, vLLM's ``prompt_logprobs``):
        ``data`` holds right-padded ``input_ids``, ``input_lengths`` and
        ``prompt_lengths``; returns ``logprobs`` (B, W) float32, each token's logprob from
        its row's prompt length on (0 elsewhere), and with ``top_k`` > 0 ``top_ids`` and
        ``top_logprobs`` (B, W, k). Bad rows are refused, each named with its reason
        (``core.scoring``; docs/groups.md)."""
        plan = self._score_plan(data, top_k)
        rows = []
        if plan.sequences:
            rows = self._call(
                lambda e: e.compute_logprobs(plan.sequences, plan.prompt_lengths, plan.top_k)
            )
        return assemble_scores(plan, rows, self.cfg.pad_token_id)

    @_serving
    def generate_text(
        self, data: Mapping[str, object], greedy: bool = False
    ) -> dict[str, list[str]]:
        """Generate from text prompts (``data["prompts"]``); returns ``{"texts": [...]}``."""
        plan = self._text_batch(data, greedy, whole=True)
        texts = [""] * plan.batch_size
        if requests := plan.requests.requests():
            batch = plan.requests.engine_batch(plan.prompts, plan.media)
            progress = self.cfg.vllm.use_tqdm
            made = self._call(lambda e: e.generate_text(batch, use_tqdm=progress))
            for (row, _), text in zip(requests, made, strict=True):
                texts[row] = text
        return {"texts": texts}

    # -- the operations both workers share (their bodies: WorkerSpine, shell.spine) -----
    sleep = _door(WorkerSpine._sleep)
    wake_up = _door(WorkerSpine._wake_up)
    reset_prefix_cache = _door(WorkerSpine._reset_prefix_cache)
    prepare_refit_info = _door(WorkerSpine._prepare_refit_info)
    init_collective = _door(WorkerSpine._init_collective)
    init_collective_via = _door(WorkerSpine._init_collective_via)
    engine_param_layout = _door(WorkerSpine._engine_param_layout)
    refit_address = _door(WorkerSpine._refit_address)
    release_refit_buffers = _door(WorkerSpine._release_refit_buffers)
    prepare_lora = _door(WorkerSpine._prepare_lora)
    call_engine_workers = _door(WorkerSpine._call_engine_workers)
    report_device_id = _door(WorkerSpine._report_device_id)
    get_counters = _door(WorkerSpine._get_counters)

    def _drive(self, steps: Steps[_T]) -> _T:
        """Make the engine calls a spine body yields, each through :meth:`_call`: the
        result sent back into the body, a failure thrown in; the body's value."""
        drive = Drive(steps)
        call = drive.send(None)
        while call is not None:
            try:
                result = self._call(call.on)
            except BaseException as e:  # noqa: BLE001 - the body raises it (or its own)
                call = drive.throw(e)
            else:
                call = drive.send(result)
        return drive.result

    def _rpc(self, method: str, *args: object, timeout: float | None = 120.0) -> list[object]:
        """``method(*args)`` on every engine worker (``WorkerSpine._rpc_steps``)."""
        return self._drive(self._rpc_steps(method, *args, timeout=timeout))

    # -- refit (its preamble, body and commit: WorkerSpine._refit, shell.spine) --------
    @_serialized
    def update_weights_from_collective(self, timeout_s: float | None = None) -> bool:
        return self._drive(
            self._refit("update_weights_from_collective", timeout_s, Transport.COLLECTIVE)
        )

    @_serialized
    def update_weights_via_ipc_zmq(self, timeout_s: float | None = None) -> bool:
        return self._drive(self._refit("update_weights_via_ipc_zmq", timeout_s, Transport.IPC))

    @_serialized
    def update_lora(
        self, name: str, timeout_s: float | None = None, *, transport: str = "ipc"
    ) -> bool:
        """Receive one adapter refit and serve it as ``name`` (``WorkerSpine._update_lora``)."""
        return self._drive(self._update_lora(name, timeout_s, transport))

    # -- observability --------------------------------------------------------------
    @_serialized
    def start_gpu_profiling(self) -> None:
        self._profile("start_gpu_profiling", lambda e: e.start_profile())

    @_serialized
    def stop_gpu_profiling(self) -> None:
        self._profile("stop_gpu_profiling", lambda e: e.stop_profile())

    def _profile(self, call: str, fn: Callable[[EnginePort], None]) -> None:
        device = self.caps.device
        if device != "cuda":
            log.info("%s: no-op, the engine runs on %s", call, device)
            return
        self._call(fn)

    @_serialized
    def shutdown(self) -> bool:
        """Free the engine; idempotent. The worker is unusable afterwards."""
        engine = self._detach()
        if engine is not None:
            engine.shutdown()
        return True

    # -- sparse-delta refit (issue 16; the engine side is shell/sparse_engine.py) -------
    # The trainer's SparseSender pushes steps to the relay receivers in the engine
    # workers; each generate first asks them where they stand: a diverged one (or engine
    # workers on different steps) is refused with SparseRefitError until a full refit,
    # and new weights reset the caches and count as a refit.
    @_serialized
    def start_zmq_sparse_refit_relay(
        self, host: str = "127.0.0.1", allow_remote: bool = False
    ) -> list[str]:
        """Start a sparse-refit relay receiver in every engine worker (idempotent); their
        addresses, for ``SparseSender`` or :meth:`configure_zmq_sparse_refit_relay`.
        ``host`` other than loopback needs ``allow_remote=True`` (the relay is
        unauthenticated)."""
        args = unwrap(
            check_relay_start(host, allow_remote), BadArgumentError, "start_zmq_sparse_refit_relay"
        )
        urls = [str(u) for u in self._rpc("start_sparse_relay", *args)]
        if self._sparse_urls is None:
            self._sparse_applied = [s["applied"] for s in self._sparse_status()]
        self._sparse_urls = urls
        return urls

    @_serialized
    def configure_zmq_sparse_refit_relay(self, relay_addresses: Sequence[str]) -> None:
        """The whole relay, in order (the root first): every engine worker takes only
        steps planned over exactly these receivers, which must include its own."""
        if self._sparse_urls is None:
            raise EngineStateError(
                "configure_zmq_sparse_refit_relay needs start_zmq_sparse_refit_relay first"
            )
        relay = unwrap(check_relay_addresses(relay_addresses), BadArgumentError, "")
        self._rpc("configure_sparse_relay", relay)

    @_serialized
    def report_refit_server_base_url(self) -> str | None:
        """Where the first engine worker's relay receiver listens; ``None`` when the
        sparse relay is off (every engine worker's: :meth:`start_zmq_sparse_refit_relay`)."""
        return None if not self._sparse_urls else self._sparse_urls[0]

    @_serialized
    def stop_zmq_sparse_refit_relay(self) -> None:
        """Close every engine worker's relay receiver; idempotent."""
        if self._sparse_urls is not None and not self._shut_down:
            self._rpc("stop_sparse_relay")
        self._sparse_urls = None

    def _sparse_status(self) -> list[dict[str, object]]:
        return unwrap(relay_statuses(self._rpc("sparse_relay_status")), EngineContractError, "")

    def _check_sparse(self) -> None:
        """Before serving: refuse diverged weights; take in new ones (see above)."""
        if self._sparse_urls is None:
            return
        statuses = self._sparse_status()
        steps = sparse_steps(statuses, self._sparse_applied)
        if isinstance(steps, Failure):
            before = self._state.weights
            if lifecycle.transition(self._state, lifecycle.Event.REFIT_BEGIN).value_or(None):
                self._state = self._move(lifecycle.Event.REFIT_BEGIN)
                self._state = self._move(lifecycle.Event.REFIT_FAILED)
            error = SparseRefitError.from_core(steps.failure())
            if before is lifecycle.WeightsStatus.VALID:  # once, as they become inconsistent
                self._drive(self._after_failed_refit("sparse refit", error))
            raise error
        if not steps.unwrap():
            return
        self._state = self._move(lifecycle.Event.REFIT_BEGIN)
        try:
            resets = self._drive(self._reset_caches("sparse refit"))
        except BaseException:
            self._state = self._move(lifecycle.Event.REFIT_FAILED)
            raise
        self._state = self._move(lifecycle.Event.REFIT_OK)
        self._version += steps.unwrap()
        self._sparse_applied = [s["applied"] for s in statuses]
        self.last_refit = refit_report(statuses, resets)

    # -- receivers of other refit wires (genworker.shell.nemo_rl) ---------------------
    @_serialized
    def refit_via(self, method: str, timeout_s: float | None, transport: Transport) -> bool:
        """A refit through another extension receiver ``method(timeout_s=)`` of
        ``transport``, with the built-in refits' checks, bounds, lifecycle and resets."""
        return self._drive(self._refit(method, timeout_s, transport))

    # -- shard-to-shard refit (issue 17; genworker.shell.reshard) -------------------
    _reshard_stages = 0  # init_nccl_reshard_comm_group succeeded: its stage groups
    _reshard_params: int | None = None  # prepare_nccl_reshard_refit_info: parameters

    @_serialized
    def init_nccl_reshard_comm_group(
        self,
        rank_prefix: int,
        pp_ips: Sequence[str],
        pp_ports: Sequence[int],
        pp_size: int,
        train_ranks_per_stage: int,
        sub_world_size: int,
        timeout_s: float | None = None,
        *,
        device: str | None = None,
    ) -> None:
        """Join each trainer PP stage's reshard group (``pp_ips[s]:pp_ports[s]``) as rank
        ``train_ranks_per_stage + rank_prefix + engine worker rank`` of ``sub_world_size``;
        every rendezvous wait bounded by ``timeout_s``. ``device="cpu"``: gloo over host
        memory even on a CUDA engine (trainer ranks on the engine's own GPU, where NCCL
        refuses a second rank; they send with ``ReshardSender(device="cpu")``)."""
        args = (rank_prefix, pp_ips, pp_ports, pp_size, train_ranks_per_stage, sub_world_size)
        join = reshard_join(*args, timeout_s, device)
        stages = unwrap(join, BadArgumentError, "init_nccl_reshard_comm_group")
        self._reshard_stages = 0
        self._rpc("init_nccl_reshard_comm_group", stages.to_wire(), timeout=stages.rpc_bound())
        self._reshard_stages = len(stages.stages)

    @_serialized
    def prepare_nccl_reshard_refit_info(self, refit_info: Mapping[str, object]) -> list[object]:
        """Plan every later reshard refit from the trainer's layouts
        (``genworker.shell.reshard.refit_info``); each engine worker's shards, digests
        and bytes, for the trainer's ``ReshardSender.plan(shards_of(...))``."""
        method = "prepare_nccl_reshard_refit_info"
        info = unwrap(refit_info_of(refit_info), BadArgumentError, method)
        self._reshard_params = None
        summaries = self._rpc(method, dict(info))
        self._reshard_params = prepared_params(summaries)
        return summaries

    @_serialized
    def nccl_reshard_refit(self, refit_timeout_s: float | None = None) -> bool:
        """Receive one reshard refit (every wait bounded by ``refit_timeout_s``); as the
        other refits: refused before it starts, or the weights count as valid only once
        it and the cache resets succeeded."""
        method = "nccl_reshard_refit"
        bound = unwrap(wait_bound(refit_timeout_s), BadArgumentError, method)
        if not self._reshard_stages:
            raise EngineStateError(f"{method} needs init_nccl_reshard_comm_group first")
        if self._reshard_params is None:
            raise EngineStateError(f"{method} needs prepare_nccl_reshard_refit_info first")
        outer = rpc_bound(self._reshard_stages * refit_waits(1, Transport.COLLECTIVE), bound)
        return self._drive(self._run_refit(method, {"refit_timeout_s": bound}, outer))
