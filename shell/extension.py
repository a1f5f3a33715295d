"""The class vLLM mixes into its workers: weight refit, device id, cleanup.

vLLM appends ``worker_extension_cls`` to its worker class's bases and refuses any
attribute that clashes with the worker's own (``vllm/v1/worker/worker_base.py``, 0.32);
the methods are reached through ``LLM.collective_rpc(name, args=..., kwargs=...)``, one
result per engine worker. Arguments and results are plain msgpack-able values (str, int,
float, lists, dicts): nothing here needs ``VLLM_ALLOW_INSECURE_SERIALIZATION``. The only
class attributes are the public methods below; all state lives on the instance under one
attribute, and the work is done by module-level functions.

Calls, in order (every failure raises a typed error of ``genworker.shell.errors``):

1. ``prepare_refit_info({name: (shape, dtype)})`` once: the manifest every refit must
   match; returns a summary with the manifest digest and how many tensors go direct.
2. Transport setup: ``init_collective(rank_prefix, ip, port, world_size,
   train_world_size)`` joins the trainer's weight-update group
   (``refit.collective``), or ``ipc_address()`` binds a private ZMQ socket and returns its
   address for an ``IpcSender`` (``refit.ipc``).
3. ``update_weights_from_collective(timeout_s)`` / ``update_weights_via_ipc_zmq(timeout_s)``
   per refit; each returns ``{"tensors", "bytes", "buckets", "seconds", "direct",
   "loaded", "mode", "version"}``.
4. ``release_kept_buffers()`` unmaps trainer memory kept mapped between IPC refits (a
   sender with ``keep_mapped=True``); ``cleanup()`` closes sockets and groups.

Where the weights go
--------------------
*Direct*: a tensor whose name, shape and dtype equal a vLLM parameter's, when every
parameter of its module arrives that way and the module is unquantized, is copied
straight into the parameter's memory (``param.data.copy_``), then the module's
``process_weights_after_loading`` runs again (on CPU that re-packs the oneDNN handle of an
embedding or LM head, ``dispatch_cpu_unquantized_gemm`` in vllm/model_executor/layers/
utils.py, 0.32). ``engine_param_layout()`` lists the parameters that can be written this
way, so a trainer can send in the engine's own layout: on GPU with unquantized weights
that is all of them; on CPU vLLM replaces linear weights by packed handles (their
parameters become empty), so those must travel in checkpoint layout. With tensor
parallelism a collective sends every rank the same bytes, so sharded parameters never go
direct over the collective.

*Fast paths*: when every manifest tensor is direct (and the parameter is contiguous),
the refit skips the staging buckets altogether (``refit.direct``): over IPC the trainer
writes into this worker's parameters through handles it exports (``mode``
``engine-handles``; CPU parameters move into shared memory in place on the first such
refit), or, where CUDA memory cannot be exported (sleep mode's virtual-memory pool) or
``ipc_address(offer_params=False)`` says so, this worker copies from handles of the
trainer's tensors (``sender-handles``); over a collective with tensor-parallel size 1
every broadcast lands in its parameter (``direct-receive``). Anything else travels in
buckets (``mode`` ``buckets``). The routes, the direct targets and the post-load
processing of a manifest are computed once and kept while every parameter stays
registered where it was, in the same memory, size and dtype (checked per refit
without walking the module tree).

*Loader*: everything else (checkpoint names such as ``q_proj``) streams through the
worker's ``reload_weights(weights_iterator=...)`` where the model runner's signature has
it (vLLM's layerwise reload processes each layer and copies it back into the live
tensors), else ``model.load_weights`` followed by vLLM's ``process_weights_after_loading``.
One loader call spans the whole refit, so a layer split across buckets is processed once
it is complete. A refit that fails leaves the weights inconsistent (the lead's lifecycle
records it) until a refit succeeds.
"""

from __future__ import annotations

import inspect
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final

import attrs
import torch

from genworker.core.refit_plan import Manifest, Slot, TensorSpec
from genworker.shell.errors import (
    EngineStateError,
    RefitError,
    RefitManifestError,
)
from genworker.shell.refit.buffers import device_id
from genworker.shell.refit.collective import CollectiveGroup, CollectiveReceiver
from genworker.shell.refit.ipc import IpcReceiver
from genworker.shell.refit.packing import Laps
from genworker.shell.refit.session import Loader, ReceiverTransport, RefitReport, receive_refit

if TYPE_CHECKING:
    from torch import nn

    #: One parameter as the routes saw it: its module, its local name, the parameter,
    #: and what the routes depend on (data pointer, element count, dtype, contiguity).
    _Entry = tuple[nn.Module, str, torch.Tensor, int, int, torch.dtype, bool]
    _Process = Callable[[nn.Module], object]

__all__ = ["DirectRoutes", "EngineSink", "WorkerExtension", "direct_routes"]

log = logging.getLogger(__name__)

_STATE: Final = "_genworker_refit_state"


@attrs.define
class _RefitState:
    manifest: Manifest | None = None
    ipc: IpcReceiver | None = None
    group: CollectiveGroup | None = None
    collective: CollectiveReceiver | None = None  # kept with the group: it keeps buffers
    version: int = 0
    # the routes of the manifest, and the parameters they were computed on
    routes: _Routed | None = None


def _state(worker: object) -> _RefitState:
    state = worker.__dict__.get(_STATE)
    if state is None:
        state = _RefitState()
        worker.__dict__[_STATE] = state
    assert isinstance(state, _RefitState)
    return state


class WorkerExtension:
    """Mixed into each vLLM worker; every method is a ``collective_rpc`` target."""

    def prepare_refit_info(self, info: Mapping[str, object]) -> dict[str, object]:
        """Record the manifest of every later refit: ``{name: (shape, dtype)}``."""
        result = Manifest.from_info(info)
        manifest = result.value_or(None)
        if manifest is None:
            error = result.failure()
            raise RefitManifestError(str(error), detail=error)
        _state(self).manifest = manifest
        routes = _routes(self, _model(self), manifest, _tp_size(self) == 1)
        return {
            "manifest_digest": manifest.digest(),
            "tensors": len(manifest),
            "direct": len(routes.direct),
            "loaded": len(manifest) - len(routes.direct),
        }

    def engine_param_layout(self) -> dict[str, list[object]]:
        """``{name: [shape, dtype]}`` of the parameters a refit can write directly."""
        return {
            name: [list(spec.shape), spec.dtype]
            for name, spec in _writable_params(_model(self)).items()
        }

    def init_collective(
        self,
        rank_prefix: int,
        ip: str,
        port: int,
        world_size: int,
        train_world_size: int,
        timeout_s: float = 300.0,
    ) -> None:
        """Join the trainer's weight-update group as rank ``train_world_size + rank_prefix
        + worker rank`` (blocks until every rank joined or ``timeout_s``)."""
        state = _state(self)
        if state.group is not None:
            state.group.close()
            state.group = state.collective = None
        rank = int(train_world_size) + int(rank_prefix) + int(getattr(self, "rank", 0))
        state.group = CollectiveGroup(
            ip=str(ip),
            port=int(port),
            rank=rank,
            world_size=int(world_size),
            train_world_size=int(train_world_size),
            role="engine",
            device=_device(self),
            timeout_s=float(timeout_s),
        )
        state.collective = CollectiveReceiver(state.group)

    def update_weights_from_collective(self, timeout_s: float = 600.0) -> dict[str, object]:
        """Receive one refit over the weight-update group into the engine."""
        state = _state(self)
        if state.collective is None:
            raise EngineStateError("update_weights_from_collective before init_collective")
        return _refit(self, state.collective, float(timeout_s), sharded_ok=False)

    def ipc_address(self, tcp_host: str | None = None, offer_params: bool = True) -> str:
        """The address an ``IpcSender`` connects to (bound once, kept until cleanup).

        ``offer_params=False``: never give the trainer handles of this worker's
        parameters; direct refits then read from the trainer's tensors. A call with other
        options than the bound socket's closes it and binds a new one (a new address)."""
        state = _state(self)
        offer_params = bool(offer_params)
        bound = state.ipc
        if bound is not None and (bound.tcp_host, bound.offer_params) != (tcp_host, offer_params):
            bound.close()
            state.ipc = None
        if state.ipc is None:
            state.ipc = IpcReceiver(_device(self), tcp_host=tcp_host, offer_params=offer_params)
        return state.ipc.address

    def update_weights_via_ipc_zmq(self, timeout_s: float = 600.0) -> dict[str, object]:
        """Receive one refit through shared buffers at ``ipc_address()``."""
        state = _state(self)
        if state.ipc is None:
            self.ipc_address()
        assert state.ipc is not None
        return _refit(self, state.ipc, float(timeout_s), sharded_ok=True)

    def release_kept_buffers(self) -> int:
        """Unmap the trainer memory kept mapped between IPC refits (a sender with
        ``keep_mapped=True``); how many storages were let go."""
        state = _state(self)
        return state.ipc.drop_kept() if state.ipc is not None else 0

    def report_device_id(self) -> str:
        """``GPU-<uuid>`` of this worker's GPU (``cpu@<host>`` on CPU)."""
        return device_id(_device(self))

    def cleanup(self) -> None:
        """Close the refit socket and group; idempotent."""
        state = _state(self)
        if state.ipc is not None:
            state.ipc.close()
            state.ipc = None
        if state.group is not None:
            state.group.close()
            state.group = state.collective = None


# -- worker access (capability checks, never versions) ---------------------------------


def _model(worker: object) -> nn.Module:
    get_model = getattr(worker, "get_model", None)
    model = get_model() if callable(get_model) else getattr(worker.model_runner, "model")  # type: ignore[attr-defined]  # noqa: B009
    return model  # type: ignore[no-any-return]


def _device(worker: object) -> torch.device:
    device = getattr(worker, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def _tp_size(worker: object) -> int:
    config = getattr(worker, "vllm_config", None)
    parallel = getattr(config, "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def _loader(worker: object) -> Loader | None:
    runner = getattr(worker, "model_runner", None)
    reload_runner = getattr(runner, "reload_weights", None)
    reload_worker = getattr(worker, "reload_weights", None)
    if (
        callable(reload_runner)
        and callable(reload_worker)
        and "weights_iterator" in inspect.signature(reload_runner).parameters
    ):
        return lambda weights: reload_worker(weights_iterator=weights)
    model = _model(worker)
    load_weights = getattr(model, "load_weights", None)
    if not callable(load_weights):
        return None

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(weights)
        try:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading
        except ImportError:
            return
        config = getattr(worker, "vllm_config", None)
        process_weights_after_loading(model, config.model_config, _device(worker))  # type: ignore[union-attr]

    return load


# -- routing ---------------------------------------------------------------------------


@attrs.frozen
class DirectRoutes:
    """Which manifest tensors go straight into parameter memory, and their modules."""

    direct: frozenset[str]
    modules: frozenset[str]


def _reprocessable(module: nn.Module) -> bool:
    method = getattr(module, "quant_method", None)
    return method is None or type(method).__name__.startswith("Unquantized")


def _is_sharded(param: torch.Tensor) -> bool:
    return any(getattr(param, a, None) is not None for a in ("output_dim", "input_dim"))


def _module_name(name: str) -> str:
    return name.rpartition(".")[0]


def _writable_params(model: nn.Module) -> dict[str, TensorSpec]:
    """Parameters of unquantized modules whose parameters all hold data."""
    out: dict[str, TensorSpec] = {}
    for mod_name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own or not _reprocessable(module) or any(p.numel() == 0 for _, p in own):
            continue
        for local, param in own:
            full = f"{mod_name}.{local}" if mod_name else local
            out[full] = TensorSpec.of(full, param)
    return out


def direct_routes(
    model: nn.Module,
    manifest: Manifest,
    *,
    sharded_ok: bool,
    params: Mapping[str, torch.Tensor] | None = None,
) -> DirectRoutes:
    """The tensors of ``manifest`` that can be copied straight into ``model``'s memory:
    an exact name/shape/dtype match, for every parameter of an unquantized module
    (``params``: the model's parameters by name, when the caller has them)."""
    writable = _writable_params(model)
    params = dict(model.named_parameters()) if params is None else params
    by_module: dict[str, set[str]] = defaultdict(set)
    for spec in manifest.specs:
        if writable.get(spec.name) == spec and (sharded_ok or not _is_sharded(params[spec.name])):
            by_module[_module_name(spec.name)].add(spec.name)
    writable_by_module: dict[str, set[str]] = defaultdict(set)
    for name in writable:
        writable_by_module[_module_name(name)].add(name)
    direct: set[str] = set()
    modules: set[str] = set()
    for mod_name, names in by_module.items():
        if writable_by_module[mod_name] <= names:
            direct |= names
            modules.add(mod_name)
    return DirectRoutes(frozenset(direct), frozenset(modules))


def _entries(model: nn.Module) -> tuple[dict[str, torch.Tensor], tuple[_Entry, ...]]:
    """Every parameter by name, as ``model.named_parameters()`` lists them (a parameter
    shared by two modules once), and each one's entry: one walk of the module tree."""
    params: dict[str, torch.Tensor] = {}
    entries: list[_Entry] = []
    seen: set[torch.Tensor] = set()
    with torch._C.DisableTorchFunctionSubclass():  # see _unchanged
        for mod_name, module in model.named_modules():
            for local, param in module._parameters.items():
                if param is None or param in seen:
                    continue
                seen.add(param)
                params[f"{mod_name}.{local}" if mod_name else local] = param
                facts = (param.data_ptr(), param.numel(), param.dtype, param.is_contiguous())
                entries.append((module, local, param, *facts))
    return params, tuple(entries)


def _unchanged(entries: Sequence[_Entry]) -> bool:
    """Every parameter is still registered where it was, in the same memory, size and
    dtype (checked without walking the module tree).

    vLLM's parameter classes define a Python ``__torch_function__``, through which every
    ``data_ptr()`` / ``numel()`` / ``dtype`` would pass (microseconds each, milliseconds
    per refit on an 8B model); the checks skip it: they read plain tensor attributes."""
    with torch._C.DisableTorchFunctionSubclass():
        for module, local, param, ptr, numel, dtype, contiguous in entries:
            if (
                module._parameters.get(local) is not param
                or param.data_ptr() != ptr
                or param.numel() != numel
                or param.dtype != dtype
                or param.is_contiguous() != contiguous
            ):
                return False
    return True


def _processors(
    modules: Mapping[str, nn.Module], names: Iterable[str]
) -> list[tuple[nn.Module, _Process]]:
    """The post-load processing of each named module that has one, in name order."""
    out = []
    for name in sorted(names):
        module = modules[name]
        process = getattr(
            getattr(module, "quant_method", None), "process_weights_after_loading", None
        )
        if callable(process):
            out.append((module, process))
    return out


@attrs.frozen(eq=False)
class _Routed:
    """The routes of a manifest on one parameter layout, and what a refit needs of it."""

    model: nn.Module
    key: tuple[object, ...]  # the manifest digest and whether sharded parameters may go direct
    entries: tuple[_Entry, ...]
    routes: DirectRoutes
    params: Mapping[str, torch.Tensor]  # every parameter by name
    direct: Mapping[str, torch.Tensor]  # the direct parameters by name
    modules: Mapping[str, nn.Module]
    # the direct parameters' memory (``param.data``), None when one is not contiguous
    targets: Mapping[str, torch.Tensor] | None
    processors: Sequence[tuple[nn.Module, _Process]]  # post-load processing, every direct module


def _routed(worker: object, model: nn.Module, manifest: Manifest, sharded_ok: bool) -> _Routed:
    """:func:`direct_routes` and the lookups a refit needs, computed again only when the
    model or the manifest changed, or a parameter was replaced, moved, or changed size
    or dtype; checking that costs no walk of the module tree."""
    state = _state(worker)
    key = (manifest.digest(), sharded_ok)
    cached = state.routes
    if (
        cached is not None
        and cached.model is model
        and cached.key == key
        and _unchanged(cached.entries)
    ):
        return cached
    params, entries = _entries(model)
    routes = direct_routes(model, manifest, sharded_ok=sharded_ok, params=params)
    modules = dict(model.named_modules())
    direct = {n: p for n, p in params.items() if n in routes.direct}
    targets = (
        {n: p.data for n, p in direct.items()}
        if all(p.is_contiguous() for p in direct.values())
        else None
    )
    routed = _Routed(
        model,
        key,
        entries,
        routes,
        params,
        direct,
        modules,
        targets,
        _processors(modules, routes.modules),
    )
    state.routes = routed
    return routed


def _routes(worker: object, model: nn.Module, manifest: Manifest, sharded_ok: bool) -> DirectRoutes:
    return _routed(worker, model, manifest, sharded_ok).routes


class EngineSink:
    """Direct copies into the engine's parameters; owned copies of the rest for the loader."""

    def __init__(
        self,
        model: nn.Module,
        routes: DirectRoutes,
        device: torch.device,
        *,
        routed: _Routed | None = None,
    ) -> None:
        """``routed``: the cached lookups of these routes on ``model``, when the caller has
        them (``_routed``)."""
        self._model = model
        self._routes = routes
        self._device = device
        self._routed = routed
        self._params: Mapping[str, torch.Tensor]
        if routed is None:
            named = dict(model.named_parameters())
            self._params = {n: p for n, p in named.items() if n in routes.direct}
        else:
            self._params = routed.direct
        self._touched: set[str] = set()

    @property
    def device(self) -> torch.device:
        return self._device

    def store(self, items: Sequence[tuple[Slot, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        deferred: list[tuple[str, torch.Tensor]] = []
        for slot, view in items:
            param = self._params.get(slot.name)
            if param is None:
                deferred.append((slot.name, view.to(self._device, copy=True)))
            else:
                param.data.copy_(view, non_blocking=True)
                self._touched.add(_module_name(slot.name))
        return deferred

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def direct_targets(self, manifest: Manifest) -> Mapping[str, torch.Tensor] | None:
        if len(self._params) != len(manifest):
            return None
        if self._routed is not None:
            return self._routed.targets
        if any(not p.data.is_contiguous() for p in self._params.values()):
            return None
        return {name: param.data for name, param in self._params.items()}

    def written(self, names: Sequence[str]) -> None:
        if len(names) == len(self._routes.direct) and set(names) == self._routes.direct:
            self._touched.update(self._routes.modules)  # all of them (a direct refit)
        else:
            self._touched.update(_module_name(n) for n in names)

    def finalize(self) -> None:
        if self._routed is not None and self._touched == self._routes.modules:
            processors = self._routed.processors  # every direct module: computed once
        else:
            modules = self._routed.modules if self._routed else dict(self._model.named_modules())
            processors = _processors(modules, self._touched)
        for module, process in processors:
            process(module)
        self.synchronize()


def _refit(
    worker: object, transport: ReceiverTransport, timeout_s: float, *, sharded_ok: bool
) -> dict[str, object]:
    state = _state(worker)
    if state.manifest is None:
        raise EngineStateError("a weight update needs prepare_refit_info first")
    laps = Laps()
    model = _model(worker)
    routed = _routed(worker, model, state.manifest, sharded_ok or _tp_size(worker) == 1)
    routes = routed.routes
    sink = EngineSink(model, routes, _device(worker), routed=routed)
    loader = _loader(worker) if len(routes.direct) < len(state.manifest) else None
    if loader is None and len(routes.direct) < len(state.manifest):
        raise RefitError("this engine worker has no weight loader for checkpoint-layout tensors")
    laps.lap("routes")
    try:
        report: RefitReport = receive_refit(
            transport, state.manifest, sink, timeout_s=timeout_s, loader=loader
        )
    except RefitError:
        if isinstance(transport, IpcReceiver):
            transport.reset()
        raise
    state.version += 1
    log.info(
        "refit %d (%s): %d tensors (%d direct), %.3f GB in %.2fs",
        state.version,
        report.mode,
        report.tensors,
        report.direct,
        report.nbytes / 1e9,
        report.seconds,
    )
    return {
        **report.as_dict(),
        "phases": {**laps.seconds, **report.phases},
        "version": state.version,
    }
