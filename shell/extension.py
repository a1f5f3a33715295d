"""The class vLLM mixes into its workers: weight refit, device id, the wake, cleanup.

vLLM appends ``worker_extension_cls`` to its worker's bases and refuses attributes that
clash (``vllm/v1/worker/worker_base.py``, 0.32); every method is a ``collective_rpc``
target with plain msgpack-able arguments and results (no
``VLLM_ALLOW_INSECURE_SERIALIZATION``), all state on the instance under one attribute, so
any caller (the worker, ``AsyncLLM``) drives a refit the same way, in vLLM's
weight-transfer shape: ``prepare_refit_info`` and ``refit_address`` or
``init_collective`` once; ``update_weights_via_ipc_zmq`` / ``update_weights_from_collective``
per refit (each wait bounded by ``timeout_s``; ``init_collective`` and these return a
failure as a plain value, ``refit.wire.failure``, for ``refit.wire.raise_failures``);
``release_refit_buffers`` gives the trainer its memory back; ``cleanup`` closes all.

Where each tensor goes is ``core.refit_protocol.plan_routes`` over a plain description
of the parameters (:func:`engine_params`): straight into a contiguous parameter of an
unquantized module when every writable parameter of that module arrives so, followed by
the module's ``process_weights_after_loading`` (on CPU it re-packs the oneDNN handle of an
embedding or LM head, ``dispatch_cpu_unquantized_gemm``, vllm/model_executor/layers/
utils.py, 0.32); else through ``reload_weights(weights_iterator=...)`` where the model
runner has it (vLLM's layerwise reload), or ``model.load_weights`` and
``process_weights_after_loading``, one loader call per refit. Over a collective with
tensor parallelism every rank receives the same bytes, so sharded parameters never go
direct. The routes are kept while every parameter stays registered where it was, in the
same memory, size and dtype (checked without walking the modules or vLLM's parameter
``__torch_function__``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final

import attrs
import torch

from genworker.core import refit_protocol as p
from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.shell.cumem_wake import WakeInstaller
from genworker.shell.errors import (
    BadArgumentError,
    EngineStateError,
    GenworkerError,
    RefitError,
    RefitManifestError,
    unwrap,
)
from genworker.shell.fp8 import Fp8Preparer, fp8_loading
from genworker.shell.nemo_rl_refit import NemoRlRefit
from genworker.shell.refit.collective import CollectiveGroup, CollectiveReceiver
from genworker.shell.refit.ipc import IpcReceiver
from genworker.shell.refit.memory import device_id
from genworker.shell.refit.receiver import Loader, receive
from genworker.shell.refit.wire import failure
from genworker.shell.reshard import ReshardEngine
from genworker.shell.sparse_engine import SparseRefitMixin

if TYPE_CHECKING:
    from torch import nn

    from genworker.shell.ports import RefitPort

    #: One parameter as the routes saw it: its module, its local name, the parameter,
    #: and what the routes depend on (data pointer, element count, dtype, contiguity).
    _Entry = tuple[nn.Module, str, torch.Tensor, int, int, torch.dtype, bool]

__all__ = ["EngineSink", "WorkerExtension", "engine_params"]

log = logging.getLogger(__name__)

_STATE: Final = "_genworker_refit_state"
_MIN_CAP: Final = 1 << 20  # the inbound message cap at least (and before prepare_refit_info)


@attrs.define
class _RefitState:
    manifest: Manifest | None = None
    ipc: IpcReceiver | None = None
    collective: CollectiveReceiver | None = None
    version: int = 0
    routed: _Routed | None = None


def _state(worker: object) -> _RefitState:
    state = worker.__dict__.setdefault(_STATE, _RefitState())
    assert isinstance(state, _RefitState)
    return state


class WorkerExtension(SparseRefitMixin, NemoRlRefit, ReshardEngine, WakeInstaller, Fp8Preparer):
    """Mixed into each vLLM worker; every method is a ``collective_rpc`` target."""

    def prepare_refit_info(self, info: Mapping[str, object]) -> dict[str, object]:
        """Record the manifest of every later refit: ``{name: (shape, dtype)}``."""
        state = _state(self)
        manifest = state.manifest = unwrap(Manifest.from_info(info), RefitManifestError, "refit")
        if state.ipc is not None:
            state.ipc.limit(p.max_message_bytes(manifest))
        direct = len(_routed(self, manifest, _tp_size(self) == 1).routes.direct)
        return {
            "manifest_digest": manifest.digest(),
            "tensors": len(manifest),
            "direct": direct,
            "loaded": len(manifest) - direct,
        }

    def engine_param_layout(self) -> dict[str, list[object]]:
        """``{name: [shape, dtype]}`` of the parameters a refit can write directly."""
        params = engine_params(_model(self), _entries(_model(self))[0])
        return {e.name: [list(e.spec.shape), e.spec.dtype] for e in params if e.writable}

    def init_collective(
        self,
        rank_prefix: int,
        ip: str,
        port: int,
        world_size: int,
        train_world_size: int,
        timeout_s: float | None = None,
    ) -> dict[str, object]:
        """Join the trainer's weight-update group as rank ``train_world_size +
        rank_prefix + worker rank``, every rendezvous wait bounded by ``timeout_s``."""
        state = _state(self)
        try:
            bound = unwrap(p.wait_bound(timeout_s), BadArgumentError, "init_collective")
            if state.collective is not None:
                state.collective.group.close()
                state.collective = None
            rank = int(train_world_size) + int(rank_prefix) + int(getattr(self, "rank", 0))
            where, device = (str(ip), int(port)), _device(self)
            group = CollectiveGroup(
                *where, rank, int(world_size), int(train_world_size), "engine", device, bound
            )
        except GenworkerError as e:
            return failure(e)
        state.collective = CollectiveReceiver(group)
        return {"rank": rank}

    def update_weights_from_collective(self, timeout_s: float | None = None) -> dict[str, object]:
        """Receive one refit over the weight-update group into the engine."""
        state = _state(self)
        if state.collective is None:
            return failure(
                EngineStateError("update_weights_from_collective before init_collective")
            )
        return _refit(self, state.collective, timeout_s, sharded_ok=False)

    def refit_address(self, tcp_host: str | None = None) -> str:
        """The address a ``RefitSender.ipc`` connects to (bound once, kept until cleanup)."""
        state = _state(self)
        if state.ipc is None:
            state.ipc = IpcReceiver(_device(self), tcp_host=tcp_host)
            manifest = state.manifest
            state.ipc.limit(max(_MIN_CAP, p.max_message_bytes(manifest) if manifest else 0))
        return state.ipc.address

    def update_weights_via_ipc_zmq(self, timeout_s: float | None = None) -> dict[str, object]:
        """Receive one refit through shared memory at ``refit_address()``."""
        state = _state(self)
        self.refit_address()
        assert state.ipc is not None
        return _refit(self, state.ipc, timeout_s, sharded_ok=True)

    def release_refit_buffers(self) -> int:
        """Let go of the trainer's memory mapped here between IPC refits (its storages
        and staging buffers), so the trainer gets it back once it frees it; how many."""
        ipc = _state(self).ipc
        return ipc.mappings.settle(failed=True) if ipc is not None else 0

    def report_device_id(self) -> str:
        """``GPU-<uuid>`` of this worker's GPU (``cpu@<host>`` on CPU)."""
        return device_id(_device(self))

    def cleanup(self) -> None:
        """Close the refit socket and group; idempotent."""
        state = _state(self)
        if state.ipc is not None:
            state.ipc.close()
            state.ipc = None
        if state.collective is not None:
            state.collective.group.close()
            state.collective = None


# -- worker access (capability checks, never versions) ---------------------------------


def _model(worker: object) -> nn.Module:
    get_model = getattr(worker, "get_model", None)
    model = get_model() if callable(get_model) else getattr(worker.model_runner, "model")  # type: ignore[attr-defined]  # noqa: B009
    return model  # type: ignore[no-any-return]


def _device(worker: object) -> torch.device:
    device = getattr(worker, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def _tp_size(worker: object) -> int:
    parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def _loader(worker: object) -> Loader:
    """vLLM's weight loader, quantizing on the way in on an fp8 engine (shell.fp8); a
    ``RefitError`` when the engine worker has none."""
    return fp8_loading(_model(worker), _vllm_loader(worker))


def _vllm_loader(worker: object) -> Loader:
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
        raise RefitError("this engine worker has no weight loader for checkpoint-layout tensors")

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


def _entries(model: nn.Module) -> tuple[dict[str, torch.Tensor], tuple[_Entry, ...]]:
    """Every parameter by name, as ``model.named_parameters()`` lists them (a shared one
    once), and each one's entry: one walk of the module tree."""
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
    dtype. vLLM's parameter classes define a Python ``__torch_function__`` through which
    every ``data_ptr()`` would pass (milliseconds per refit on an 8B model): skipped."""
    with torch._C.DisableTorchFunctionSubclass():
        return all(
            module._parameters.get(local) is param
            and param.data_ptr() == ptr
            and param.numel() == numel
            and param.dtype == dtype
            and param.is_contiguous() == contiguous
            for module, local, param, ptr, numel, dtype, contiguous in entries
        )


def engine_params(model: nn.Module, params: Mapping[str, torch.Tensor]) -> list[p.EngineParam]:
    """The plain description of ``model``'s parameters that routing decides on."""
    modules = dict(model.named_modules())
    out = []
    for name, param in params.items():
        module_name = name.rpartition(".")[0]
        module = modules[module_name]
        method = getattr(module, "quant_method", None)
        own = [q for q in module._parameters.values() if q is not None]
        writable = (
            (method is None or type(method).__name__.startswith("Unquantized"))
            and all(q.numel() for q in own)
            and param.is_contiguous()
        )
        sharded = any(getattr(param, a, None) is not None for a in ("output_dim", "input_dim"))
        out.append(p.EngineParam(name, module_name, TensorSpec.of(name, param), writable, sharded))
    return out


@attrs.frozen(eq=False)
class _Routed:
    """The routes of a manifest on one parameter layout, and what a refit needs of it."""

    model: nn.Module
    key: tuple[object, ...]  # the manifest digest and whether sharded parameters may go direct
    entries: tuple[_Entry, ...]
    routes: p.Routes
    targets: Mapping[str, torch.Tensor]  # the direct parameters' memory (``param.data``)
    modules: Mapping[str, nn.Module]


def _routed(worker: object, manifest: Manifest, sharded_ok: bool) -> _Routed:
    state, model, key = _state(worker), _model(worker), (manifest.digest(), sharded_ok)
    cached = state.routed
    if cached and (cached.model, cached.key) == (model, key) and _unchanged(cached.entries):
        return cached
    params, entries = _entries(model)
    routes = p.plan_routes(manifest, engine_params(model, params), sharded_ok=sharded_ok)
    targets = {n: params[n].data for n in routes.direct}
    state.routed = _Routed(model, key, entries, routes, targets, dict(model.named_modules()))
    return state.routed


class EngineSink:
    """The engine's side of the direct route: parameter memory and post-load processing."""

    def __init__(self, routed: _Routed, device: torch.device) -> None:
        self._routed, self.device = routed, device

    def target(self, name: str) -> torch.Tensor:
        return self._routed.targets[name]

    def finish(self, names: Iterable[str]) -> None:
        for module in map(self._routed.modules.get, sorted({n.rpartition(".")[0] for n in names})):
            method = getattr(module, "quant_method", None)
            process = getattr(method, "process_weights_after_loading", None)
            if callable(process):
                process(module)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _refit(
    worker: object, port: RefitPort, timeout_s: object, *, sharded_ok: bool
) -> dict[str, object]:
    state = _state(worker)
    try:
        bound = unwrap(p.wait_bound(timeout_s), BadArgumentError, "timeout_s")
        if (manifest := state.manifest) is None:
            raise EngineStateError("a weight update needs prepare_refit_info first")
        routed = _routed(worker, manifest, sharded_ok or _tp_size(worker) == 1)
        loader = _loader(worker) if len(routed.routes.direct) < len(manifest) else None
        sink = EngineSink(routed, _device(worker))
        report = receive(port, manifest, sink, routes=routed.routes, timeout_s=bound, loader=loader)
    except GenworkerError as e:
        return failure(e)
    state.version += 1
    figures = (report.tensors, report.nbytes / 1e9, report.seconds)
    log.info("refit %d: %d tensors, %.3f GB in %.3fs", state.version, *figures)
    return {**report.as_dict(), "version": state.version}
