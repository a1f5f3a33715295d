"""The sparse-delta refit on one GPU (importable as ``gpu.gpu_sparse``, also in spawned
children): the trainer process of ``test_gpu_sparse.py``.

It keeps fp32 master weights of a bf16 checkpoint under AdamW on its GPU and sends their
bf16 cast (the engine's dtype, so the bits travel as they are) through a
:class:`~genworker.shell.refit.sparse.SparseSender` to the relay receivers of the session
worker's engine, the way ``tests/shell/test_sparse_engine.py``'s trainer does on the CPU
(there in float32, the CPU engine's dtype).
"""

from __future__ import annotations

import shutil
import traceback
from pathlib import Path
from typing import Any

import torch
import zstandard
from gpu.gpu_fixtures import load_checkpoint

from genworker.core.refit_plan import Manifest, TensorSpec, dtype_name
from genworker.core.sparse_protocol import frame_message, read_frame
from genworker.shell.refit.sparse import SparseRefitError, SparseSender

__all__ = ["LR", "CorruptingSender", "save_checkpoint", "sparse_trainer_main"]

HOP_S = 30.0
# One AdamW step at this rate (bench_sparse's) moves the bf16 value of about 2% of the
# tiny model's elements (measured on the CPU: 3% of its bytes on the wire): a sparse delta.
LR = 1e-6


class CorruptingSender(SparseSender):
    """At step ``corrupt_step``, flips a bit in the first piece's new bits *before*
    compression: the frame's CRC matches what travels, only the per-tensor checksum can
    tell (``test_sparse_engine.py``'s ``CorruptingSender``)."""

    corrupt_step = 2

    def _encode(self, index: int, frame: object, bits: object, full: bool, step: int) -> object:  # type: ignore[override]
        parts, deltas = super()._encode(index, frame, bits, full, step)  # type: ignore[arg-type]
        if step != self.corrupt_step or index != 0:
            return parts, deltas
        header = read_frame(parts[1]).unwrap()
        raw = bytearray(zstandard.ZstdDecompressor().decompress(parts[2]))
        raw[header.pieces[0].nbytes - 1] ^= 0x01  # the piece's last bits
        payload = zstandard.ZstdCompressor(level=1).compress(bytes(raw))
        return frame_message(step, index, header.pieces, len(raw), payload), deltas


def save_checkpoint(like: Path, tensors: dict[str, torch.Tensor], where: Path) -> Path:
    """``tensors`` as a model directory beside ``like``'s config and tokenizer files."""
    from safetensors.torch import save_file

    where.mkdir(parents=True)
    for path in like.iterdir():
        if path.is_file() and path.name != "model.safetensors":
            shutil.copy(path, where / path.name)
    save_file(
        {n: t.detach().cpu().contiguous() for n, t in tensors.items()},
        where / "model.safetensors",
        metadata={"format": "pt"},
    )
    return where


class _Master:
    """fp32 master weights of a checkpoint under AdamW (random gradients, seeded)."""

    def __init__(self, checkpoint: Path, device: str) -> None:
        loaded = load_checkpoint(checkpoint, device)
        self.dtype = next(iter(loaded.values())).dtype  # the checkpoint's: what is sent
        self.params = {n: torch.nn.Parameter(t.float().clone()) for n, t in loaded.items()}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=LR, weight_decay=0.01)
        self.generator = torch.Generator(device).manual_seed(0)

    def step(self) -> None:
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.generator, device=p.device)
        self.optimizer.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(self.dtype) for n, p in self.params.items()}

    def manifest(self) -> Manifest:
        name = dtype_name(self.dtype)
        return Manifest.from_specs(
            TensorSpec(n, tuple(p.shape), name) for n, p in self.params.items()
        ).unwrap()


def _changed(before: dict[str, torch.Tensor] | None, after: dict[str, torch.Tensor]) -> int:
    """Elements whose bits differ from the last step sent (all, before the first)."""
    if before is None:
        return sum(t.numel() for t in after.values())
    return sum(int((before[n] != t).sum()) for n, t in after.items())


def sparse_trainer_main(
    *, addresses: list[str], checkpoint: str, corrupt: bool, commands: Any, replies: Any
) -> None:
    """The trainer on the engine's GPU (the CPU without one). Commands: ``("send", save)``
    sends the current weights (the first step, and the first after a failed one, full)
    and, with ``save``, writes them as a model directory there after the step succeeded;
    ``("step", None)`` one AdamW step; ``("load", path)`` restarts the master weights
    (and the optimizer) from a checkpoint; ``("stop", None)``. A send answers ``sent``
    (its report) or ``failed`` (the ``SparseRefitError``'s message and the receivers it
    names); with ``corrupt``, the second step's first frame carries a flipped bit."""
    try:
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
        path = Path(checkpoint)
        master = _Master(path, device)
        last: dict[str, torch.Tensor] | None = None
        kind = CorruptingSender if corrupt else SparseSender
        with kind(addresses, master.manifest(), fanout=2, hop_s=HOP_S) as sender:
            replies.put(("ready", None))
            while True:
                command, arg = commands.get()
                if command == "stop":
                    break
                if command == "step":
                    master.step()
                    replies.put(("stepped", None))
                elif command == "load":
                    path = Path(str(arg))
                    master = _Master(path, device)
                    replies.put(("loaded", None))
                else:
                    weights = master.weights()
                    try:
                        report = sender.send(weights)
                    except SparseRefitError as e:
                        names = getattr(e.detail, "names", ())
                        replies.put(("failed", {"message": str(e), "names": list(names)}))
                        last = None
                        continue
                    changed = _changed(last, weights)
                    last = {n: t.clone() for n, t in weights.items()}
                    if arg is not None:
                        save_checkpoint(path, weights, Path(str(arg)))
                    replies.put(
                        (
                            "sent",
                            {
                                "full": report.full,
                                "model_bytes": report.model_bytes,
                                "wire_bytes": report.wire_bytes,
                                "changed": changed,
                                "elements": sum(t.numel() for t in weights.values()),
                            },
                        )
                    )
    except BaseException:  # noqa: BLE001 - the test raises it with this traceback
        replies.put(("error", traceback.format_exc()))
