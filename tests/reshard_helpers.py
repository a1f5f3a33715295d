"""Trainer processes for the reshard refit tests (importable as ``reshard_helpers``, also
in spawned children): Megatron-style TP layouts of a saved checkpoint, or ``DTensor``
``Shard(0)`` placements on a gloo mesh, each rank sending its own shards on command."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from refit_helpers import REFIT_TIMEOUT, CommandedProcess, serve_commands
from safetensors.torch import load_file

from genworker.core.refit_plan import dtype_name
from genworker.core.reshard import TrainerLayout, megatron_layout
from genworker.shell.refit.reshard import ReshardSender, layout_of_dtensor, refit_info, shards_of

#: Megatron's TP split of each Llama tensor (by its name's ending): rows or columns.
_ROWS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
_COLS = ("o_proj.weight", "down_proj.weight")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def megatron_layouts(tensors: Mapping[str, torch.Tensor], tp: int) -> list[TrainerLayout]:
    """Trainer ranks ``0..tp-1`` hold Megatron TP shards (norms replicated; a vocabulary
    that does not split evenly replicated too)."""
    out = []
    for name, t in tensors.items():
        dim = 0 if name.endswith(_ROWS + _VOCAB) else 1 if name.endswith(_COLS) else None
        if dim is not None and t.shape[dim] % tp:
            dim = None
        result = megatron_layout(
            name, tuple(t.shape), dtype_name(t.dtype), dim, [[r] for r in range(tp)]
        )
        out.append(result.unwrap())
    return out


def local_shards(
    tensors: Mapping[str, torch.Tensor], layouts: list[TrainerLayout], rank: int
) -> dict[str, torch.Tensor]:
    out = {}
    for layout in layouts:
        for shard in layout.shards:
            if shard.rank == rank:
                region = tuple(slice(a, b) for a, b in shard.box)
                out[layout.name] = tensors[layout.name][region].clone()
    return out


class _Queue(Protocol):
    def put(self, item: object) -> None: ...
    def get(self) -> object: ...


class _Rank:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.sender: ReshardSender | None = None
        self.dtensor = False
        self.device = "cpu"  # where this rank holds its shards (the sender moves them)
        self.layouts: list[TrainerLayout] = []

    def tensors(self, path: str, **fault: str) -> dict[str, torch.Tensor]:
        full = load_file(path)
        if self.dtensor:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (self.world,))
            out: dict[str, torch.Tensor] = {
                n: distribute_tensor(t, mesh, [Shard(0) if t.dim() == 2 else Replicate()])
                for n, t in full.items()
            }
        else:
            out = {
                n: t.to(self.device) for n, t in local_shards(full, self.layouts, self.rank).items()
            }
        if "drop" in fault:
            out.pop(fault["drop"])
        if "reshape" in fault:
            t = out[fault["reshape"]]
            out[fault["reshape"]] = torch.zeros(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)
        return out

    def step(self, command: dict[str, object]) -> dict[str, object]:
        op = command.pop("op")
        if op == "join":
            path = str(command["path"])
            self.device = str(command.get("device", "cpu"))
            if command.get("style") == "dtensor":
                import torch.distributed as dist

                self.dtensor = True
                dist.init_process_group(
                    "gloo",
                    init_method=f"tcp://127.0.0.1:{command['mesh_port']}",
                    rank=self.rank,
                    world_size=self.world,
                )
                self.layouts = [layout_of_dtensor(n, t) for n, t in self.tensors(path).items()]
            else:
                self.layouts = megatron_layouts(load_file(path), self.world)
            self.sender = ReshardSender(
                "127.0.0.1",
                int(command["port"]),  # type: ignore[call-overload]
                int(command["world_size"]),  # type: ignore[call-overload]
                rank=self.rank,
                train_world_size=self.world,
                layouts=self.layouts,
                timeout_s=REFIT_TIMEOUT,
            )
            return {"info": refit_info(self.layouts)}
        assert self.sender is not None, "join first"
        if op == "plan":
            plan = self.sender.plan(shards_of(command["summaries"]))  # type: ignore[arg-type]
            return {"copies": len(plan.copies), "bytes": plan.bytes_from(self.rank)}
        fault = {k: str(v) for k, v in command.items() if k in ("drop", "reshape")}
        report = self.sender.send(self.tensors(str(command["path"]), **fault))
        return {"tensors": report.tensors, "nbytes": report.nbytes, "seconds": report.seconds}


def run_rank(commands: _Queue, results: _Queue, rank: int, world: int) -> None:
    state = _Rank(rank, world)
    serve_commands(commands, results, state.step)
    if state.sender is not None:
        state.sender.close()


class ReshardTrainer(CommandedProcess):
    """Trainer rank ``rank`` of ``world`` in its own process (:func:`run_rank`); the
    caller waits for it with ``ready()``, after starting every rank."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(run_rank, rank, world, wait_ready=False, result_timeout=180)
