"""Adapter-only refits: a LoRA adapter's tensors over IPC into vLLM's LoRA manager, under
a name, without touching the base weights (the refit backend ``lora``).

Theory of operation
-------------------
``init(info, peft)`` takes the adapter's manifest (``{name: (shape, dtype)}`` in PEFT's
names) and ``adapter_config``, checks them against what this engine's LoRA layers hold
(``core.lora.check_adapter`` over :meth:`LoraBackend.holds`) and binds an
:class:`~genworker.shell.refit.ipc.IpcReceiver` of its own: the trainer sends with
``RefitSender.ipc(address, manifest=info)``, the refit protocol of every other refit.
``receive(name)`` runs that protocol with no direct routes (every tensor to a loader that
copies it to CPU, as vLLM keeps adapters there), then installs the adapter:
``LoRAModel.from_lora_tensors`` (vllm/lora/lora_model.py, 0.32) under the name's
``lora_int_id`` (one per name, kept across refits, so requests in flight keep it), the
old model removed from the manager (``LRUCacheLoRAModelManager``) and the new one added
and activated; if adding or activating fails (a shape vLLM's layer refuses), the old
model is added and activated again, so the previous adapter serves on and the refit is
raised typed. A failed transfer never reaches the manager.

Requests name the adapter as ``LoRARequest(name, lora_int_id, path)`` with
:func:`genworker.core.lora.adapter_path` as the path: vLLM's worker finds the id registered and never reads
the path, and the prefix cache keys blocks by name and path (``_gen_lora_extra_hash_keys``,
vllm/v1/core/kv_cache_utils.py), which the worker resets after every adapter refit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import torch

from genworker.core import refit_protocol as p
from genworker.core.lora import (
    Adapter,
    EngineLora,
    adapter_capacity,
    adapter_id,
    adapter_transport,
    check_adapter,
    check_adapter_name,
)
from genworker.core.refit_plan import Manifest
from genworker.core.refit_transport import message_cap
from genworker.shell.errors import (
    BadArgumentError,
    EngineStateError,
    RefitError,
    RefitManifestError,
    unwrap,
)
from genworker.shell.refit.engine import EngineContext
from genworker.shell.refit.ipc import IpcHolder, IpcReceiver
from genworker.shell.refit.receiver import ParameterSink, receive

if TYPE_CHECKING:
    from vllm.model_executor.models.utils import WeightsMapper

    from genworker.shell.ports import RefitPort

__all__ = ["LoraBackend"]

log = logging.getLogger(__name__)


def _names_only(mapper: object) -> WeightsMapper | None:
    """The model's HF-to-vLLM mapper without its stacked maps (q/k/v into qkv), as vLLM's
    own adapter loader passes it: ``get_rename_mapper`` from 0.29, ``get_unstacked_mapper``
    in 0.25-0.28; ``None`` for a model without one."""
    for method in ("get_rename_mapper", "get_unstacked_mapper"):
        unstack = getattr(mapper, method, None)
        if unstack is not None:
            return cast("WeightsMapper", unstack())
    return None


class LoraBackend(IpcHolder):
    """The ``lora`` refit backend (see the module docstring)."""

    def __init__(self, engine: EngineContext) -> None:
        self.engine = engine
        self.adapter: Adapter | None = None
        self.ids: dict[str, int] = {}  # adapter name -> lora_int_id
        self.refits = 0

    def _manager(self, *, required: bool = True) -> object:
        """vLLM's worker LoRA manager; on an engine without LoRA an ``EngineStateError``,
        or None where not ``required``."""
        manager = getattr(getattr(self.engine.worker, "model_runner", None), "lora_manager", None)
        if manager is None and required:
            raise EngineStateError(
                "this engine was started without LoRA: set vllm_kwargs.enable_lora: true "
                "(or lora_refit_mode: native) for adapter refits"
            )
        return manager

    def holds(self) -> EngineLora:
        """What this engine's LoRA layers hold: rank limit, module names and paths."""
        manager = self._manager()
        adapters = manager._adapter_manager  # type: ignore[attr-defined]
        rank = int(manager.lora_config.max_lora_rank)  # type: ignore[attr-defined]
        supported, paths = adapters.supported_lora_modules, adapters.modules
        return EngineLora.of(rank, supported, paths, adapters.packed_modules_mapping)

    def init(
        self,
        info: Mapping[str, object] | None = None,
        peft: Mapping[str, object] | None = None,
        alpha: float | None = None,
        tcp_host: str | None = None,
    ) -> str:
        """Check and record the adapter of every later refit (``info``: its manifest,
        ``peft``: its ``adapter_config``; ``alpha`` the default ``lora_alpha``); the
        address a ``RefitSender.ipc`` connects to (bound once)."""
        if info is not None:
            manifest = unwrap(Manifest.from_info(info), RefitManifestError, "adapter manifest")
            checked = check_adapter(manifest, dict(peft or {}), self.holds(), alpha=alpha)
            self.adapter = unwrap(checked, RefitManifestError, "adapter")
        if self.held is None:
            self.held = IpcReceiver(self.engine.device, tcp_host=tcp_host)
        if self.adapter is not None:
            self.held.limit(message_cap(self.adapter.manifest))
        return self.held.address

    def receive(
        self, name: str, timeout_s: float | None = None, transport: str = "ipc"
    ) -> dict[str, object]:
        """Receive one adapter refit over ``transport`` (``ipc``: this backend's socket;
        ``collective``: the weight-update group of ``init_collective``) and serve it as
        ``name``; the previous adapter of that name keeps serving when anything fails,
        a NaN or an infinity among its tensors included."""
        if (problem := check_adapter_name(name)) is not None:
            raise BadArgumentError(problem)
        bound = unwrap(p.wait_bound(timeout_s), BadArgumentError, "timeout_s")
        if self.adapter is None or self.held is None:
            raise EngineStateError("an adapter refit needs refit_init('lora', info, peft) first")
        port = self._port(transport)
        manager = self._manager()
        config = manager.lora_config  # type: ignore[attr-defined]
        cpu = self.engine.device.type == "cpu"
        capacity = adapter_capacity(config.max_loras, config.max_cpu_loras, cpu=cpu)
        lora_id = unwrap(adapter_id(name, self.ids, capacity), BadArgumentError, "")
        tensors: dict[str, torch.Tensor] = {}

        def collect(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for tensor_name, tensor in weights:
                tensors[tensor_name] = tensor.to("cpu", copy=True)

        def check(chunk: Sequence[tuple[str, torch.Tensor]], what: str) -> None:
            self.engine.check_finite(chunk, what, kept=f"adapter {name!r} serves as before")

        report = receive(
            port,
            self.adapter.manifest,
            ParameterSink({}),  # no direct routes: every tensor to the loader
            routes=p.Routes(),
            timeout_s=bound,
            loader=collect,
            check=check,
        )
        self._install(manager, name, lora_id, tensors)
        self.ids[name], self.refits = lora_id, self.refits + 1
        log.info(
            "adapter %r (id %d): %d tensors in %.3fs", name, lora_id, report.tensors, report.seconds
        )
        return {**report.as_dict(), "adapter": name, "lora_int_id": lora_id, "refits": self.refits}

    def _port(self, transport: str) -> RefitPort:
        """The port an adapter refit over ``transport`` arrives on."""
        assert self.held is not None
        if unwrap(adapter_transport(transport), BadArgumentError, "") is p.Transport.IPC:
            return self.held
        if self.engine.group_port is None:
            raise EngineStateError("an adapter refit over the collective needs init_collective")
        return cast("RefitPort", self.engine.group_port)

    def _install(
        self, manager: object, name: str, lora_id: int, tensors: dict[str, torch.Tensor]
    ) -> None:
        """Replace adapter ``lora_id`` by ``tensors``; the old one back on failure."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        assert self.adapter is not None
        config = manager.lora_config  # type: ignore[attr-defined]
        adapters = manager._adapter_manager  # type: ignore[attr-defined]
        mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
        try:
            helper = PEFTHelper.from_dict(self.adapter.peft_config())
            helper.validate_legal(config)
            new = LoRAModel.from_lora_tensors(
                lora_model_id=lora_id,
                tensors=tensors,
                peft_helper=helper,
                device="cpu",
                dtype=config.lora_dtype,
                model_vocab_size=manager.vocab_size,  # type: ignore[attr-defined]
                weights_mapper=_names_only(mapper),
                skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None),
            )
        except Exception as e:
            raise RefitError(f"adapter {name!r}: vLLM refused its tensors: {e}") from e
        old = adapters.get_adapter(lora_id)
        adapters.remove_adapter(lora_id)
        try:
            adapters.add_adapter(new)
            adapters.activate_adapter(lora_id)
        except Exception as e:
            adapters.remove_adapter(lora_id)
            if old is not None:
                adapters.add_adapter(old)
                adapters.activate_adapter(lora_id)
            kept = "the previous one serves on" if old is not None else "none was served"
            raise RefitError(f"adapter {name!r} could not be installed ({kept}): {e}") from e

    def status(self) -> dict[str, object]:
        """The address, the adapters served (name -> ``lora_int_id``), adapter refits so
        far, and what the engine holds (``None`` without LoRA)."""
        lora = self._manager(required=False) is not None
        holds = self.holds().as_dict() if lora else None
        address = None if self.held is None else self.held.address
        return {
            "address": address,
            "adapters": dict(self.ids),
            "refits": self.refits,
            "holds": holds,
        }
