"""vLLM's own weight-transfer wire, the one TRL's clients speak: the refit backend
``vllm_wire`` behind the server's ``/init_weight_transfer_engine`` and ``/update_weights``
(``core.control_plane``), and the trainer's end of its CPU stand-in.

Theory of operation
-------------------
vLLM's NCCL weight-transfer engine (``vllm/distributed/weight_transfer/nccl_engine.py``
and ``nccl_common.py``, 0.32; the same wire in 0.25) and its trainer (``trainer_init``,
``packed_nccl_broadcast_producer``; TRL's ``WeightTransferClient``) meet in vLLM's
``StatelessProcessGroup``: the trainer, rank 0, hosts a ``TCPStore`` at ``master_address:
master_port``; every engine worker joins as ``rank_offset`` + its rank, then
``PyNcclCommunicator`` hands NCCL's unique id round through the store and warms up with
one all-reduce. An update is announced over HTTP (``update_info``: names, dtype names,
shapes) and travels packed (buffers closing once their bytes exceed
``packed_buffer_size_bytes``: NeMo-RL's wire exactly) or one tensor per broadcast, as
the trainer said (``core.control_plane.broadcasts``), so the receiving port is
:class:`~genworker.shell.refit.nemo_rl.NemoRlCollectivePort` over a
:class:`~genworker.shell.refit.nemo_rl.BroadcastGroup`, through ``EngineContext.receive``
with ``update_info`` as the refit's manifest: the dtype check, the routes, the non-finite
check, the weights gate and the bounded waits of every other refit.

vLLM has no CPU weight-transfer engine. On CPU the same group carries a gloo group on the
same store instead of NCCL (:func:`trainer_group` and :func:`send` are the trainer's end:
the same rendezvous, the same packing), so CI runs the whole flow; on CUDA the trainer is
vLLM's (or TRL's) own code.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from genworker.core import control_plane as c
from genworker.core import refit_protocol as p
from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.shell.errors import (
    BadArgumentError,
    RefitManifestError,
    RefitTransportError,
    unwrap,
)
from genworker.shell.refit.door import Holding
from genworker.shell.refit.engine import EngineContext
from genworker.shell.refit.nemo_rl import BroadcastGroup, NemoRlCollectivePort, stateless_comm

__all__ = ["VllmWireBackend", "VllmWireGroup", "send", "trainer_group", "update_info"]


class VllmWireGroup(BroadcastGroup):
    """A place in the group of vLLM's weight-transfer wire (see the module docstring)."""

    def __init__(self, init: c.InitTransfer, rank: int, device: torch.device, timeout_s: float):
        where = f"{init.master_address}:{init.master_port} (rank {rank} of {init.world_size})"
        super().__init__(f"the weight-transfer group at {where}", device)
        self.init = init
        with self._foreign("joining the group", timeout_s):
            from vllm.distributed.utils import StatelessProcessGroup

            self.group = StatelessProcessGroup.create(
                init.master_address,
                init.master_port,
                rank,
                init.world_size,
                store_timeout=max(1, math.ceil(timeout_s)),
            )
            self._comm = stateless_comm(self.group, rank, init.world_size, device, timeout_s)

    def send(self, tensor: torch.Tensor, bound_s: float) -> None:
        """Rank 0's side of a broadcast (the trainer's, on CPU)."""
        self.broadcast(tensor, "a broadcast", bound_s)


def _init_of(init_info: Mapping[str, object]) -> c.InitTransfer:
    """``init_info`` (vLLM's ``/init_weight_transfer_engine`` body field) checked."""
    return unwrap(c.init_transfer({"init_info": dict(init_info)}), BadArgumentError, "init_info")


def trainer_group(init_info: Mapping[str, object], timeout_s: float = 300.0) -> VllmWireGroup:
    """The trainer's place (rank 0) in the group ``init_info`` describes, as vLLM's
    ``trainer_init`` takes it; returns once every engine worker joined. Call it while the
    server handles ``/init_weight_transfer_engine`` (both sides wait for each other)."""
    return VllmWireGroup(_init_of(init_info), 0, torch.device("cpu"), timeout_s)


def update_info(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """The ``update_info`` of ``/update_weights`` that announces ``tensors`` (names, dtype
    names, shapes, in the order :func:`send` broadcasts them)."""
    manifest = Manifest.from_specs(TensorSpec.of(n, t) for n, t in tensors).unwrap()
    return c.Update(manifest).as_vllm_info()


def send(
    group: VllmWireGroup, tensors: Iterable[tuple[str, torch.Tensor]], timeout_s: float = 300.0
) -> None:
    """Broadcast ``tensors`` as vLLM's producer does on the group's wire (packed: in
    order, a buffer closing once its bytes exceed ``packed_buffer_size_bytes``; else one
    tensor each, the same bytes); the server handles the ``/update_weights`` that
    announced them meanwhile."""
    named = list(tensors)
    manifest = Manifest.from_specs(TensorSpec.of(n, t) for n, t in named).unwrap()
    flat = {n: t.detach().contiguous().view(-1).view(torch.uint8) for n, t in named}
    for specs in c.broadcasts(group.init, c.Update(manifest)):
        group.send(torch.cat([flat[s.name] for s in specs]), timeout_s)


class VllmWireBackend(Holding[VllmWireGroup]):
    """``vllm_wire``: this engine worker's place in a trainer's weight-transfer group."""

    def __init__(self, engine: EngineContext) -> None:
        self.engine, self.updates = engine, 0

    def init(self, init_info: Mapping[str, object], timeout_s: float | None = None) -> int:
        """Join the group as ``rank_offset`` + this worker's rank (a group joined before
        is left first); the rank."""
        bound = unwrap(p.wait_bound(timeout_s), BadArgumentError, "timeout_s")
        init = _init_of(init_info)
        self.close()
        rank = init.rank_offset + self.engine.rank
        self.held = VllmWireGroup(init, rank, self.engine.device, bound)
        return rank

    def receive(
        self, update_info: Mapping[str, object], timeout_s: float | None = None
    ) -> dict[str, object]:
        """Receive one update (``update_info``'s tensors, in order) into the engine."""
        info = {"update_info": dict(update_info)}
        update = unwrap(c.update_of(info), RefitManifestError, "update_info")
        if self.held is None or self.held.broken:
            raise RefitTransportError(
                "no weight-transfer group (none joined, or the last one broke): "
                "POST /init_weight_transfer_engine first"
            )
        self.engine.check_dtypes(update.manifest, "update_weights")
        self.updates += 1
        groups = c.broadcasts(self.held.init, update)
        port = NemoRlCollectivePort(self.held, update.manifest, groups, f"vllm-wire-{self.updates}")
        return self.engine.receive(port, timeout_s, sharded_ok=False, manifest=update.manifest)

    def status(self) -> dict[str, object]:
        joined = self.held is not None and not self.held.broken
        return {"joined": joined, "updates": self.updates}
