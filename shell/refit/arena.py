"""A trainer-side arena: every tensor of a refit as a view of one device allocation.

Why
---
A direct IPC refit into a sleep-mode engine maps the *trainer's* memory in the engine
(``sender-handles``: vLLM's sleep-mode weights cannot be exported). CUDA maps one IPC
handle per allocation, and opening one costs a driver call of a fraction of a
millisecond; a state dict of separately allocated tensors (195 for Llama-3-8B in the
engine's layout) spends much of a refit opening handles (17 to 28 ms of 42 on an H200).
Tensors that live in one allocation travel under one handle, so the refit is one device
copy per byte plus a single map. A trainer whose parameters already live in one
contiguous buffer sends views of it; a trainer that gathers full tensors for each refit
(FSDP) can gather them into an arena.

Layout
------
The arena is laid out like one refit bucket holding everything
(:mod:`genworker.core.refit_plan`): tensors back to back in the manifest's order, each at
an offset aligned to 512 bytes, so each view is contiguous and aligned for its dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from returns.result import Failure

from genworker.core.refit_plan import Manifest, align_up
from genworker.shell.errors import BadConfigError, RefitManifestError

__all__ = ["RefitArena"]


class RefitArena:
    """One allocation on ``device`` holding a view per manifest tensor.

    ``manifest``: a :class:`Manifest` or ``{name: (shape, dtype)}``, as given to
    ``prepare_refit_info``. Send ``arena.items()`` (every tensor, in manifest order).
    """

    def __init__(self, manifest: Manifest | Mapping[str, object], device: torch.device | str):
        if not isinstance(manifest, Manifest):
            parsed = Manifest.from_info(manifest)
            if isinstance(parsed, Failure):
                raise BadConfigError(str(parsed.failure()), detail=parsed.failure())
            manifest = parsed.unwrap()
        self.manifest = manifest
        offsets, total = [], 0
        for spec in manifest.specs:
            offsets.append(total)
            total += align_up(spec.nbytes)
        self.buffer = torch.empty(total, dtype=torch.uint8, device=device)
        self.tensors: dict[str, torch.Tensor] = {
            spec.name: self.buffer[offset : offset + spec.nbytes]
            .view(getattr(torch, spec.dtype))
            .view(spec.shape)
            for spec, offset in zip(manifest.specs, offsets, strict=True)
        }

    @property
    def nbytes(self) -> int:
        """The allocation's size (the tensors' bytes plus alignment padding)."""
        return int(self.buffer.numel())

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())

    def load_(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into their views (asynchronously on the current stream).

        Every name must be in the manifest with the same shape (any dtype converts);
        :class:`RefitManifestError` names every one that is not, before anything is
        copied."""
        items = list(named_tensors)
        wrong = [
            f"{name!r} {list(t.shape)}"
            + (
                f" (the arena holds {list(self.tensors[name].shape)})"
                if name in self.tensors
                else " (not in the arena)"
            )
            for name, t in items
            if name not in self.tensors or tuple(t.shape) != tuple(self.tensors[name].shape)
        ]
        if wrong:
            raise RefitManifestError("cannot load into the refit arena: " + "; ".join(wrong))
        with torch.no_grad():
            for name, tensor in items:
                self.tensors[name].copy_(tensor, non_blocking=True)
