"""The trainer side of the NeMo-RL integration test (``test_nemo_rl_integration``): a
stand-in for NeMo-RL's ``lm_policy.Policy`` with the methods grpo.py's
``refit_policy_generation`` calls, over a Ray actor running the CPU re-implementation of
NeMo-RL's trainer wire (:class:`nemo_rl_trainer.NemoRlTrainer`).

NeMo-RL's DTensor and Megatron policy workers need CUDA (their IPC path sends CUDA IPC
handles, their collective path NCCL), so the test cannot run them on a CPU; this is the one
part of NeMo-RL the test replaces with its own code, and it is on the trainer's side of the
wire. Its "training step" is :meth:`StandInPolicy.train_to` (the trainer's weights become
another saved checkpoint) and its ``get_logprobs`` is a Hugging Face forward of those
weights, as NeMo-RL's policy computes the logprobs its GRPO loss compares.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from nemo_rl_trainer import NemoRlTrainer
from safetensors.torch import load_file

#: The IPC buffer the stand-in asks grpo.py for: it reports as free memory what makes
#: grpo.py's ``NRL_REFIT_BUFFER_MEMORY_RATIO`` share of it this size, so the tiny model goes
#: in several buckets.
IPC_BUFFER_BYTES = 384 << 10


class TrainerActor:
    """NeMo-RL's policy worker's wire, on a Ray actor (:data:`TRAINER_ACTOR`): one command
    at a time."""

    def __init__(self) -> None:
        self.trainer = NemoRlTrainer()

    def run(self, op: str, **command: object) -> dict[str, object]:
        self.trainer.submit(op, **command)
        outcome = self.trainer.result(timeout=300)
        if not outcome.ok:
            raise RuntimeError(f"trainer {op}: {outcome.error}: {outcome.message}")
        return dict(outcome.detail)

    def stop(self) -> None:
        self.trainer.stop()


TRAINER_ACTOR = ray.remote(TrainerActor)


def cpu_device_id() -> str:
    """The device id a CPU engine worker reports (genworker's ``report_device_id``): the
    colocated trainer shares the device, so it binds at the same name."""
    return f"cpu@{socket.gethostname()}"


class StandInPolicy:
    """The methods of NeMo-RL's ``ColocatablePolicyInterface`` that
    ``refit_policy_generation`` and grpo.py's collective setup call."""

    def __init__(self, weights_dir: Path) -> None:
        self.actor = TRAINER_ACTOR.options(num_cpus=0).remote()
        self.weights_dir = weights_dir
        self.calls: list[str] = []
        self._models: dict[Path, Any] = {}

    # -- training ----------------------------------------------------------------------
    def train_to(self, weights_dir: Path) -> None:
        self.weights_dir = weights_dir

    @property
    def weights_file(self) -> str:
        return str(self.weights_dir / "model.safetensors")

    def prepare_refit_info(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return {n: (t.shape, t.dtype) for n, t in load_file(self.weights_file).items()}

    def get_logprobs(
        self, sequences: Sequence[Sequence[int]], starts: Sequence[int]
    ) -> list[list[float]]:
        """Each sequence's token logprobs from ``starts[i]`` on, under the trainer's weights."""
        from transformers import AutoModelForCausalLM

        model = self._models.get(self.weights_dir)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(self.weights_dir, dtype=torch.float32)
            model.eval()  # type: ignore[no-untyped-call]
            self._models[self.weights_dir] = model
        out = []
        with torch.no_grad():
            for seq, start in zip(sequences, starts, strict=True):
                ids = torch.tensor([list(seq)])
                logits = model(ids).logits[0, :-1].float()
                lps = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
                out.append(lps[start - 1 :].tolist())
        return out

    # -- NeMo-RL's refit calls -----------------------------------------------------------
    def offload_before_refit(self) -> None:
        self.calls.append("offload_before_refit")

    def offload_after_refit(self) -> None:
        self.calls.append("offload_after_refit")

    def get_free_memory_bytes(self) -> int:
        return int(IPC_BUFFER_BYTES / float(os.environ.get("NRL_REFIT_BUFFER_MEMORY_RATIO", "0.3")))

    def stream_weights_via_ipc_zmq(
        self, buffer_size_bytes: int, kv_scales: dict[str, float] | None = None
    ) -> list[Any]:
        self.calls.append("stream_weights_via_ipc_zmq")
        address = f"ipc:///tmp/{cpu_device_id()}.sock"
        return [
            self.actor.run.remote(
                "ipc", address=address, path=self.weights_file, buffer_bytes=buffer_size_bytes
            )
        ]

    def broadcast_weights_for_collective(
        self, kv_scales: dict[str, float] | None = None
    ) -> list[Any]:
        self.calls.append("broadcast_weights_for_collective")
        return [self.actor.run.remote("collective", path=self.weights_file)]

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int
    ) -> list[Any]:
        self.calls.append("init_collective")
        return [self.actor.run.remote("join", port=port, world_size=world_size)]

    def shutdown(self) -> None:
        ray.get(self.actor.stop.remote())
