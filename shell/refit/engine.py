"""The engine worker as every refit backend sees it: :class:`EngineContext`, the port the
extension hands each backend instead of its own private helpers.

It answers what the worker knows (model, device, rank, tensor-parallel size, vLLM's
config), holds what every backend shares (the manifest of ``prepare_refit_info``, the
count of refits received through :meth:`EngineContext.receive`, the routes), and does the
one thing they all end in: a refit through :func:`~genworker.shell.refit.receiver.receive`
into the engine's memory.

Where each tensor goes is ``core.refit_protocol.plan_routes`` over a plain description
of the parameters (:func:`engine_params`): straight into a contiguous parameter of an
unquantized module when every writable parameter of that module arrives so, followed by
the module's ``process_weights_after_loading`` (on CPU it re-packs the oneDNN handle of an
embedding or LM head, ``dispatch_cpu_unquantized_gemm``, vllm/model_executor/layers/
utils.py, 0.32); else through vLLM's loader (:meth:`EngineContext.loader`: the fp8 hook,
the experts' re-lay), one call per refit. Over a collective with tensor parallelism every
rank receives the same bytes, so sharded parameters never go direct. The routes are kept
while every parameter stays where it was (:func:`_unchanged`).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, cast

import attrs
import torch

from genworker.core import refit_protocol as p
from genworker.core.refit_plan import Manifest, TensorSpec, dtype_name
from genworker.shell.errors import (
    BadArgumentError,
    EngineStateError,
    RefitError,
    RefitManifestError,
    unwrap,
)
from genworker.shell.fp8 import fp8_loading
from genworker.shell.refit.receiver import Loader, receive
from genworker.shell.vllm_logs import refit_loader_alarms

if TYPE_CHECKING:
    from torch import nn

    from genworker.shell.ports import RefitPort

    #: One parameter as the routes saw it: its module, its local name, the parameter,
    #: and what the routes depend on (data pointer, element count, dtype, contiguity).
    Entry = tuple[nn.Module, str, torch.Tensor, int, int, torch.dtype, bool]

__all__ = [
    "EngineContext",
    "EngineSink",
    "Routed",
    "WeightsGate",
    "engine_params",
    "experts_repacked",
    "nonfinite",
    "parameters",
    "repacking_experts",
    "takes_weights_iterator",
]

log = logging.getLogger(__name__)


def parameters(model: nn.Module) -> tuple[dict[str, torch.Tensor], tuple[Entry, ...]]:
    """Every parameter by name, as ``model.named_parameters()`` lists them (a shared one
    once), and each one's entry: one walk of the module tree."""
    params: dict[str, torch.Tensor] = {}
    entries: list[Entry] = []
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


def _unchanged(entries: Sequence[Entry]) -> bool:
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


def nonfinite(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point ``tensors`` holding a NaN or an infinity: one
    fused reduction over them all (``torch._foreach_norm`` of order 2, a multi-tensor
    kernel on CUDA and vectorised on the CPU, 2-8x faster there than order inf or
    ``isfinite``), one read back. A NaN or an inf makes a norm non-finite; a finite tensor
    whose norm overflows is told apart by an exact ``isfinite`` of that tensor alone, so
    nothing finite is refused. 1-byte floats (fp8) are skipped: the kernel takes no fp8,
    and no refit writes fp8 from the wire. The tensors may lie on two devices (a reshard
    over gloo checks the engine's own and the group's host scratch together): the norms
    are gathered on the first one's."""
    floats = [(n, t) for n, t in tensors if t.is_floating_point() and t.element_size() > 1]
    floats = [(n, t) for n, t in floats if t.numel()]
    if not floats:
        return []
    with torch.no_grad():
        norms = torch._foreach_norm([t for _, t in floats], 2)
        here = norms[0].device  # a refit over gloo holds GPU tensors and host scratch
        if bool(torch.stack([x.float().to(here) for x in norms]).isfinite().all()):
            return []
        suspects = [(n, t) for (n, t), x in zip(floats, norms, strict=True) if not x.isfinite()]
        return [n for n, t in suspects if not bool(torch.isfinite(t).all())]


def engine_params(model: nn.Module, params: Mapping[str, torch.Tensor]) -> list[p.EngineParam]:
    """The plain description of ``model``'s parameters that routing decides on."""
    modules = dict(model.named_modules())
    out = []
    for name, param in params.items():
        module = modules[name.rpartition(".")[0]]
        method = getattr(module, "quant_method", None)
        own = [q for q in module._parameters.values() if q is not None]
        filled = all(q.numel() for q in own) and param.is_contiguous()
        sharded = any(getattr(param, a, None) is not None for a in ("output_dim", "input_dim"))
        quantized_by = None if method is None else type(method).__name__
        out.append(p.EngineParam.of(TensorSpec.of(name, param), quantized_by, filled, sharded))
    return out


@attrs.frozen(eq=False)
class Routed:
    """The routes of a manifest on one parameter layout, and what a refit needs of it."""

    model: nn.Module
    key: tuple[object, ...]  # the manifest digest and whether sharded parameters may go direct
    entries: tuple[Entry, ...]
    routes: p.Routes
    targets: Mapping[str, torch.Tensor]  # the direct parameters' memory (``param.data``)
    modules: Mapping[str, nn.Module]


class EngineSink:
    """The engine's side of the direct route: parameter memory and post-load processing."""

    def __init__(self, routed: Routed, device: torch.device) -> None:
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


def takes_weights_iterator(reload_weights: object) -> bool:
    """Whether a model runner's ``reload_weights`` takes ``weights_iterator`` (vLLM's
    layerwise reload): by name (0.32's runners, 0.25's V1 GPU runner) or through
    ``**kwargs`` (0.25's V2 GPU runner, ``vllm/v1/worker/gpu/model_runner.py``, forwards
    every argument to the V1 runner's, which names it). Without it an fp8 engine cannot
    take weights at all: vLLM replaced its fp8 parameters after the first load, so
    ``model.load_weights`` finds no loader on them. False for anything not callable."""
    if not callable(reload_weights):
        return False
    parameters = inspect.signature(reload_weights).parameters.values()
    return any(p.name == "weights_iterator" or p.kind is p.VAR_KEYWORD for p in parameters)


class MoeMethod(Protocol):
    """A MoE layer's ``quant_method`` as :func:`experts_repacked` sees it."""

    process_weights_after_loading: Callable[[nn.Module], object]


def repacking_experts(model: nn.Module) -> dict[str, tuple[MoeMethod, Callable[..., object]]]:
    """The unquantized MoE layers whose experts kernel re-lays its weights after a load, by
    module name: each layer's ``quant_method`` and that kernel's ``process_weights_after_loading``
    (a subclass override of vLLM's no-op default; on CPU the VNNI prepack of
    ``fused_moe/experts/cpu_moe.py``, 0.32)."""
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
    except ImportError:  # a vLLM without it: nothing known to skip the re-lay
        return {}
    out: dict[str, tuple[MoeMethod, Callable[..., object]]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod):
            continue  # only its _setup_kernel is known to skip the re-lay on an update
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        hook = "process_weights_after_loading"
        if experts is None or sum(hook in vars(c) for c in type(experts).__mro__) < 2:
            continue
        out[name] = (cast("MoeMethod", method), getattr(experts, hook))
    return out


@contextmanager
def experts_repacked(
    layers: Mapping[str, tuple[MoeMethod, Callable[..., object]]],
) -> Iterator[None]:
    """While a refit loads: each of ``layers`` (:func:`repacking_experts`) re-lays its
    experts after vLLM processes it.

    vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts kernel's
    ``process_weights_after_loading`` on the first load only: on a weight update it copies
    the checkpoint-layout experts into the kernel's tensors and skips the re-lay, so an MoE
    engine on CPU generates from unpacked weights read as packed ones, silently wrong. The
    layerwise reload calls the layer's ``quant_method.process_weights_after_loading`` once
    per layer it wrote, on the fresh tensors it then copies into the kernel's: the re-lay
    goes right after it, on exactly the layers written."""
    patched: list[MoeMethod] = []
    try:
        for method, relay in layers.values():
            process = method.process_weights_after_loading

            def process_and_relay(
                layer: nn.Module,
                process: Callable[..., object] = process,
                relay: Callable[..., object] = relay,
            ) -> None:
                process(layer)
                relay(layer)

            method.process_weights_after_loading = process_and_relay
            patched.append(method)
        yield
    finally:
        for method in patched:
            del method.process_weights_after_loading


class WeightsGate:
    """Who touches the weights: a batch or a refit, never both (issue 44 item 3).

    The sync worker holds the gate around each batch when a refit can arrive on a thread
    of its own (the sparse relay): :meth:`hold` from an RPC before the batch, released by
    one after it. A refit writes under :meth:`writing`: it waits for a held batch at most
    its bound, then is refused naming the wait, having changed nothing; a batch waits for
    a write in progress the same way. Refits that arrive by RPC (IPC, collective, NeMo-RL)
    already run between batches (the worker's lock); they take the gate too, so a sparse
    step never writes under them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._batch: float | None = None  # when the held batch began (time.monotonic)
        self._writer = ""  # the write in progress ('' when none)

    def hold(self, held: bool, wait_s: float) -> None:
        with self._cond:
            if not held:
                self._batch = None
                self._cond.notify_all()
                return
            if not self._cond.wait_for(lambda: not self._writer, wait_s):
                raise EngineStateError(
                    f"generate: {self._writer} is writing the weights; waited {wait_s:g} s"
                )
            self._batch = time.monotonic()

    @contextmanager
    def writing(self, what: str, wait_s: float) -> Iterator[None]:
        with self._cond:
            if not self._cond.wait_for(lambda: self._batch is None and not self._writer, wait_s):
                busy = "another refit" if self._writer else "a batch"
                raise RefitError(
                    f"{what}: refused, {busy} held the weights for over {wait_s:g} s; nothing "
                    "was written (a refit never applies weights under a running batch)"
                )
            self._writer = what
        try:
            yield
        finally:
            with self._cond:
                self._writer = ""
                self._cond.notify_all()


def on_device(device: torch.device, load: Loader) -> Loader:
    """``load`` fed every tensor on ``device``, where the parameters live: the fp8
    quantizer and vLLM's layerwise reload then see a checkpoint read on the host (the fp8
    start), a gloo transport's tensors (reshard on CPU) and a CUDA refit alike. Measured on
    the H100: quantized on the host, every fp8 scale came out one ulp away from the same
    weights' scale quantized on the GPU (CUDA divides by a scalar through its reciprocal),
    and the layerwise reload's ``torch.cat`` refused host tensors."""
    if device.type == "cpu":
        return load

    def moved(weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        return load((n, t if t.device == device else t.to(device)) for n, t in weights)

    return moved


class EngineContext:
    """One vLLM engine worker, for the refit backends (capability checks, never versions)."""

    def __init__(self, worker: object) -> None:
        self.worker = worker
        self.manifest: Manifest | None = None
        self.version = 0  # refits received through :meth:`receive`
        self.routed_last: Routed | None = None
        #: the weight-update group this worker joined (``init_collective``; a
        #: ``RefitPort``), for other backends' refits over it (adapters)
        self.group_port: object | None = None
        #: refuse a refit holding NaN or inf (``vllm_cfg.refit_finite_check``; the worker
        #: sets it at load through ``refit_configure``)
        self.finite_check = True
        self.gate = WeightsGate()
        self._watchers: dict[str, Callable[[Manifest], None]] = {}

    @property
    def rank(self) -> int:
        return int(getattr(self.worker, "rank", 0))

    @property
    def device(self) -> torch.device:
        device = getattr(self.worker, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    @property
    def config(self) -> object:
        """vLLM's config of this worker (``None`` on a stand-in)."""
        return getattr(self.worker, "vllm_config", None)

    @property
    def tp_size(self) -> int:
        parallel = getattr(self.config, "parallel_config", None)
        return int(getattr(parallel, "tensor_parallel_size", 1) or 1)

    def model(self) -> nn.Module:
        get_model = getattr(self.worker, "get_model", None)
        if callable(get_model):
            return get_model()  # type: ignore[no-any-return]
        return self.worker.model_runner.model  # type: ignore[attr-defined,no-any-return]

    def params(self) -> dict[str, torch.Tensor]:
        return parameters(self.model())[0]

    def loader(self) -> Loader:
        """vLLM's weight loader, quantizing on the way in on an fp8 engine (shell.fp8) and
        re-packing the experts it wrote (:func:`experts_repacked`); a ``RefitError`` when
        the engine worker has none."""
        model = self.model()
        load = on_device(self.device, fp8_loading(model, self._vllm_loader()))
        layers = repacking_experts(model)
        if not layers:
            return load
        if self._layerwise_reload() is None:
            raise RefitError(
                f"the MoE layer {min(layers)!r} re-lays its experts after loading and this "
                "vLLM's model runner has no layerwise reload (reload_weights(weights_iterator="
                "...)): a refit would leave its experts half re-laid, so it is refused"
            )

        def load_and_relay(weights: Iterable[tuple[str, torch.Tensor]]) -> object:
            with experts_repacked(layers):
                return load(weights)

        return load_and_relay

    def _layerwise_reload(self) -> Callable[..., object] | None:
        runner = getattr(self.worker, "model_runner", None)
        reload_worker: object = getattr(self.worker, "reload_weights", None)
        if callable(reload_worker) and takes_weights_iterator(getattr(runner, "reload_weights", 0)):
            return reload_worker
        return None

    def _vllm_loader(self) -> Loader:
        reload_worker = self._layerwise_reload()
        if reload_worker is not None:
            return lambda weights: reload_worker(weights_iterator=weights)
        model = self.model()
        load_weights = getattr(model, "load_weights", None)
        if not callable(load_weights):
            raise RefitError(
                "this engine worker has no weight loader for checkpoint-layout tensors"
            )

        def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            load_weights(weights)
            try:
                from vllm.model_executor.model_loader.utils import process_weights_after_loading
            except ImportError:
                return
            process_weights_after_loading(model, self.config.model_config, self.device)  # type: ignore[attr-defined]

        return load

    def check_finite(
        self,
        tensors: Sequence[tuple[str, torch.Tensor]],
        what: str,
        *,
        kept: str = "the weights are inconsistent until a refit succeeds",
    ) -> None:
        """Refuse ``tensors`` (a chunk of a refit, a sparse step, an adapter) when any
        holds a NaN or an infinity (:func:`nonfinite`), unless :attr:`finite_check` is
        off: a ``RefitError`` naming them and what holds now (``kept``), before the refit
        counts as good."""
        if not self.finite_check:
            return
        if bad := nonfinite(tensors):
            raise RefitError(p.nonfinite_refusal(what, bad, kept))

    def reset_kv(self) -> int:
        """Zero this worker's KV cache memory (after a refused or failed refit, with no
        request running and the KV cache awake: a block written under bad weights must
        not leak into a later attention through padding); how many tensors."""
        caches = getattr(getattr(self.worker, "model_runner", None), "kv_caches", None) or []
        count = 0
        with torch.no_grad():
            for cache in caches:
                for t in cache if isinstance(cache, list | tuple) else (cache,):
                    if isinstance(t, torch.Tensor):
                        t.zero_()
                        count += 1
        return count

    def routed(self, manifest: Manifest, sharded_ok: bool) -> Routed:
        """The routes of ``manifest`` here (kept while the parameters stay put)."""
        model, key = self.model(), (manifest.digest(), sharded_ok)
        cached = self.routed_last
        if cached and (cached.model, cached.key) == (model, key) and _unchanged(cached.entries):
            return cached
        params, entries = parameters(model)
        routes = p.plan_routes(manifest, engine_params(model, params), sharded_ok=sharded_ok)
        targets = {n: params[n].data for n in routes.direct}
        modules = dict(model.named_modules())
        self.routed_last = Routed(model, key, entries, routes, targets, modules)
        return self.routed_last

    def watch(self, name: str, callback: Callable[[Manifest], None]) -> None:
        """Call ``callback`` with every manifest :meth:`prepare` records from now on
        (backend ``name``'s: a backend built again replaces its own)."""
        self._watchers[name] = callback

    def check_dtypes(self, manifest: Manifest, what: str) -> None:
        """Refuse ``manifest`` when it declares a non-float dtype for a tensor that loads
        into a floating-point parameter (``core.refit_protocol.dtype_problems``)."""
        model = self.model()
        dtypes = {n: dtype_name(t.dtype) for n, t in parameters(model)[0].items()}
        packed = getattr(model, "packed_modules_mapping", None) or {}
        unwrap(p.dtype_problems(manifest, dtypes, packed), RefitManifestError, what)

    def prepare(self, info: Mapping[str, object]) -> dict[str, object]:
        """Record the manifest of every later refit: ``{name: (shape, dtype)}``, its
        dtypes checked against the engine's parameters first."""
        manifest = unwrap(Manifest.from_info(info), RefitManifestError, "refit")
        self.check_dtypes(manifest, "prepare_refit_info")
        self.manifest = manifest
        for callback in self._watchers.values():
            callback(manifest)
        return self.routed(manifest, self.tp_size == 1).routes.answer(manifest)

    def prepared(self, call: str) -> Manifest:
        """The manifest of ``prepare_refit_info``; an ``EngineStateError`` before it."""
        if self.manifest is None:
            raise EngineStateError(f"{call} needs prepare_refit_info first")
        return self.manifest

    def receive(
        self,
        port: object,
        timeout_s: object,
        *,
        sharded_ok: bool,
        manifest: Manifest | None = None,
    ) -> dict[str, object]:
        """One refit from ``port`` (a ``RefitPort``; NeMo-RL's carry their own handle
        types) into the engine, each wait bounded by ``timeout_s``; its report and the
        engine's refit count, or a typed error. ``manifest``: this refit's own (a wire
        that announces it per update), else ``prepare_refit_info``'s."""
        bound = unwrap(p.wait_bound(timeout_s), BadArgumentError, "timeout_s")
        manifest = manifest or self.prepared("a weight update")
        routed = self.routed(manifest, sharded_ok or self.tp_size == 1)
        loader = self.loader() if len(routed.routes.direct) < len(manifest) else None
        # vLLM's loader calls every weight the direct routes wrote "not loaded": only the rest
        gate = self.gate.writing("a refit", bound)
        with gate, refit_loader_alarms(routed.routes.direct, routed.modules):
            report = receive(
                cast("RefitPort", port),
                manifest,
                EngineSink(routed, self.device),
                routes=routed.routes,
                timeout_s=bound,
                loader=loader,
                check=self.check_finite,
            )
        self.version += 1
        figures = (report.tensors, report.nbytes / 1e9, report.seconds)
        log.info("refit %d: %d tensors, %.3f GB in %.3fs", self.version, *figures)
        return {**report.as_dict(), "version": self.version}
