"""Direct refits: every tensor straight into the engine's parameter memory, no buckets.

Shared by both transports. A sender that can go direct materializes its stream (the
tensors themselves are only referenced, but a stream that creates tensors lazily holds
them all at once: pass ``direct=False`` to a sender for such a stream) and lists it in
``Begin.direct``. The receiver checks that list against the manifest
(:func:`listing_problem`: every expected name exactly once, shapes and dtypes equal)
before anything is written, and goes direct only when its sink offers a contiguous
target for every manifest tensor (``RefitSink.direct_targets``); otherwise the refit
continues in buckets, so the choice is automatic on both sides. The report's ``mode``
says which one ran: ``engine-handles``, ``sender-handles`` (IPC), ``direct-receive``
(collective) or ``buckets``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from returns.result import Failure

from genworker.core.refit_plan import (
    Bucket,
    Manifest,
    ReceiveProgress,
    Slot,
    TensorSpec,
    align_up,
    check_bucket,
    check_complete,
)
from genworker.shell.errors import RefitError, RefitManifestError
from genworker.shell.refit.buffers import export_storage, open_handle
from genworker.shell.refit.wire import CpuHandle, CudaHandle, TensorRef

__all__ = [
    "ExportCache",
    "ListingMemo",
    "MappedStorages",
    "collect_direct",
    "copy_all",
    "export_refs",
    "listing_problem",
    "open_refs",
    "refs_of",
    "spec_of",
]


def spec_of(ref: TensorRef) -> TensorSpec:
    try:
        return TensorSpec(ref.name, tuple(ref.shape), ref.dtype)
    except ValueError as e:
        raise RefitError(f"the direct refit lists an invalid tensor {ref.name!r}: {e}") from e


class ListingMemo:
    """A sender's last listing, reused while its stream keeps the same names, shapes and
    dtypes (compared as they are, without building a spec per tensor)."""

    def __init__(self) -> None:
        self._meta: list[tuple[str, torch.Size, torch.dtype]] | None = None
        self._refs: list[TensorRef] = []

    def refs(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[TensorRef]:
        meta = [(name, tensor.shape, tensor.dtype) for name, tensor in items]
        if meta != self._meta:
            self._meta = None
            self._refs = refs_of(items)
            self._meta = meta
        return self._refs


def collect_direct(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    memo: ListingMemo | None = None,
) -> tuple[list[tuple[str, torch.Tensor]], list[TensorRef] | None, Exception | None]:
    """A sender's stream for a direct refit: ``(items, listing, failure)``.

    The stream is materialised and listed for ``Begin.direct`` (through ``memo`` when
    given). A failure while doing so (the trainer's own iterator raising, an invalid
    tensor) is returned, not raised, so the sender can still tell its peers before
    raising it; the listing is then None.
    """
    items: list[tuple[str, torch.Tensor]] = []
    try:
        items = list(named_tensors)
        return items, (memo.refs(items) if memo is not None else refs_of(items)), None
    except Exception as e:  # noqa: BLE001 - our own failure; the caller tells the peers
        return items, None, e


def refs_of(items: Sequence[tuple[str, torch.Tensor]]) -> list[TensorRef]:
    """The ``Begin.direct`` list of a stream; :class:`RefitError` naming an invalid tensor."""
    refs = []
    for name, tensor in items:
        try:
            spec = TensorSpec.of(name, tensor)
        except ValueError as e:
            raise RefitError(f"tensor {name!r} cannot travel in a refit: {e}") from e
        refs.append(TensorRef(spec.name, list(spec.shape), spec.dtype))
    return refs


def listing_problem(manifest: Manifest, refs: Iterable[TensorRef]) -> RefitError | None:
    """Why the direct list does not match ``manifest`` (naming every tensor), or None."""
    refs = list(refs)
    if _matches(manifest, refs):
        return None
    slots, position = [], 0
    try:
        for ref in refs:
            spec = spec_of(ref)
            slots.append(Slot(spec.name, position, spec.nbytes, spec.shape, spec.dtype))
            position += align_up(spec.nbytes)
    except RefitError as e:
        return e
    checked = check_bucket(manifest, ReceiveProgress(), Bucket(0, 0, tuple(slots), position))
    checked = checked.bind(lambda progress: check_complete(manifest, progress))
    if isinstance(checked, Failure):
        error = checked.failure()
        problems = "; ".join(p.describe() for p in error.problems[:8])
        more = f" and {len(error.problems) - 8} more" if len(error.problems) > 8 else ""
        return RefitManifestError(
            f"the direct refit's tensors do not match the manifest: {problems}{more}",
            detail=error,
        )
    return None


#: Exported storages, kept across refits: (device, data pointer) -> (storage, handle).
ExportCache = dict[tuple[str, int], tuple[torch.UntypedStorage, CpuHandle | CudaHandle]]


def copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every non-empty pair, asynchronously.

    One ``copy_`` per tensor, not ``torch._foreach_copy_``: on an H200 the foreach kernel
    moved the 195 tensors of an 8B model (16 GB) in 11.6 ms where single copies took
    8.1 ms (bench/RESULTS-gpu.md)."""
    with torch.no_grad():
        for dst, src in pairs:
            if dst.numel():
                dst.copy_(src, non_blocking=True)


def _matches(manifest: Manifest, refs: Sequence[TensorRef]) -> bool:
    """The common case, checked cheaply: every manifest tensor exactly once, as declared."""
    if len(refs) != len(manifest):
        return False
    seen: set[str] = set()
    for ref in refs:
        spec = manifest.get(ref.name)
        if spec is None or ref.name in seen or ref.dtype != spec.dtype:
            return False
        if tuple(ref.shape) != spec.shape:
            return False
        seen.add(ref.name)
    return True


def export_refs(
    targets: Mapping[str, torch.Tensor], cache: ExportCache | None = None
) -> tuple[list[CpuHandle | CudaHandle], list[TensorRef]]:
    """Handles of the storages under ``targets`` (each once) and where each tensor lies.

    With ``cache``, a storage exported before is not exported again: its handle is the
    same bytes, so a peer that keeps its mappings by handle maps nothing anew. The cache
    holds each storage, so a cached address cannot be reused by another allocation while
    its handle is out; storages no longer under ``targets`` are dropped from it.
    Raises ``RuntimeError`` when a storage cannot be exported."""
    storages: list[CpuHandle | CudaHandle] = []
    index: dict[tuple[str, int], int] = {}
    refs = []
    for name, tensor in targets.items():
        spec = TensorSpec.of(name, tensor)
        if tensor.numel() == 0:
            refs.append(TensorRef(name, list(spec.shape), spec.dtype))
            continue
        if not tensor.is_contiguous():
            raise RuntimeError(f"tensor {name!r} is not contiguous")
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in index:
            index[key] = len(storages)
            cached = cache.get(key) if cache is not None else None
            if cached is not None and cached[0].nbytes() == storage.nbytes():
                storages.append(cached[1])
            else:
                handle = export_storage(tensor)
                if cache is not None:
                    cache[key] = (storage, handle)
                storages.append(handle)
        offset = int(tensor.storage_offset()) * tensor.element_size()
        refs.append(TensorRef(name, list(spec.shape), spec.dtype, index[key], offset))
    if cache is not None:
        for stale in set(cache) - set(index):
            del cache[stale]
    return storages, refs


class MappedStorages:
    """Another process's storages mapped here and kept across refits, by handle, with the
    views of the last listing over them.

    ``views`` maps only handles not mapped yet, lets go of those the listing no longer
    names, and returns the same views for the same listing; ``clear`` lets go of all."""

    def __init__(self) -> None:
        self.mapped: dict[CpuHandle | CudaHandle, torch.Tensor] = {}
        self._last: tuple[tuple[object, ...], dict[str, torch.Tensor]] | None = None

    def views(
        self,
        storages: Sequence[CpuHandle | CudaHandle],
        refs: Sequence[TensorRef],
        device: torch.device,
    ) -> dict[str, torch.Tensor]:
        """:func:`open_refs` through the kept mappings; :class:`RefitError` as it raises."""
        key = (tuple(storages), tuple(refs), device)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        live = set(storages)
        self.mapped = {h: m for h, m in self.mapped.items() if h in live}
        self._last = None
        views = open_refs(storages, refs, device, cache=self.mapped)
        self._last = (key, views)
        return views

    def clear(self) -> int:
        """Let go of every mapping; how many there were."""
        count = len(self.mapped)
        self.mapped = {}
        self._last = None
        return count


def open_refs(
    storages: Sequence[CpuHandle | CudaHandle],
    refs: Sequence[TensorRef],
    device: torch.device,
    cache: dict[CpuHandle | CudaHandle, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Each listed tensor viewed in place in the mapped storages (empty ones as empties).

    ``cache`` keeps mapped storages by handle across calls."""
    maps = cache if cache is not None else {}
    out = {}
    for ref in refs:
        spec = spec_of(ref)
        dtype = getattr(torch, spec.dtype)
        if spec.nbytes == 0:
            out[ref.name] = torch.empty(spec.shape, dtype=dtype)
            continue
        if ref.storage >= len(storages):
            raise RefitError(f"tensor {ref.name!r} names storage {ref.storage}, which is absent")
        handle = storages[ref.storage]
        if handle not in maps:
            maps[handle] = open_handle(handle, device)
        buffer = maps[handle]
        if ref.offset + spec.nbytes > buffer.numel():
            raise RefitError(
                f"tensor {ref.name!r} ({spec.nbytes} bytes at {ref.offset}) overruns its "
                f"storage of {buffer.numel()} bytes"
            )
        view = buffer[ref.offset : ref.offset + spec.nbytes]
        out[ref.name] = view.view(dtype).view(spec.shape)
    return out
