"""Memory both processes map: staging buffers, a trainer's own storages, their handles.

CPU: a staging buffer is a file (0600) in the sender's private directory (``mkdtemp``:
0700, random name) under /dev/shm; a trainer's own tensor moves, in place and once, into
an unlinked shared-memory file (``_share_fd_cpu_``, torch's ``share_memory_``) whose
handle is ``/proc/<pid>/fd/<fd>`` (openable only by processes allowed to inspect the
trainer's). The receiver opens a path with ``O_NOFOLLOW`` (a ``/proc`` link excepted),
checks it is a regular file of its own user, of the handle's inode, in a directory no one
else can enter, and maps the very file it opened. CUDA: ``_share_cuda_()``'s fields,
rebuilt with ``UntypedStorage._new_shared_cuda`` on the receiver's own device after a
check that the handle names the same physical GPU (UUID, as NeMo-RL keys its handles); a
runtime without CUDA IPC fails there, and the error says so and what to change
(``core.refit_protocol.explain_cuda_ipc_failure``, failure-modes R8).

A storage is exported once and recognised by a weak reference (``StorageWeakRef``: it
never keeps the trainer's memory alive, but no other storage can take its place while it
is held), so a refit sending the same storages sends the same handles and the engine
keeps its mappings (:class:`Mappings`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final, cast

import msgspec
import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from genworker.core import refit_protocol as p
from genworker.core.refit_wire import CpuHandle, CudaHandle, Handle
from genworker.shell.errors import RefitError

__all__ = [
    "Exporter",
    "Mappings",
    "StagingBuffer",
    "copy_into",
    "device_id",
    "open_handle",
    "private_directory",
    "reclaim_dead",
    "sync",
]

_PROC_FD: Final = re.compile(r"/proc/\d+/fd/\d+")
_COPIER = ThreadPoolExecutor(1, thread_name_prefix="genworker-copy")  # a fork makes its own:
os.register_at_fork(after_in_child=lambda: globals().update(_COPIER=ThreadPoolExecutor(1)))


def device_id(device: torch.device) -> str:
    """A name for the physical device: ``GPU-<uuid>`` for CUDA, ``cpu@<host>`` otherwise."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return f"GPU-{uuid}" if uuid is not None else f"cuda:{index}@{socket.gethostname()}"
    return f"{device.type}@{socket.gethostname()}"


def sync(device: torch.device | None) -> None:
    """Wait for what ``device``'s current stream holds (nothing to wait for off CUDA)."""
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _parent(parent: str | Path | None) -> str | Path | None:
    if parent is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return parent


def private_directory(prefix: str, parent: str | Path | None = None) -> Path:
    """A fresh 0700 directory with a random name in ``parent`` (default: /dev/shm)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=_parent(parent)))
    path.chmod(0o700)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def reclaim_dead(prefix: str, parent: str | Path | None = None) -> list[Path]:
    """Remove this user's ``<prefix><pid>-*`` directories in ``parent`` (default:
    /dev/shm) whose process ``pid`` is gone: the staging of a killed sender, which no
    finalizer ran for. The ones removed."""
    where = Path(_parent(parent) or tempfile.gettempdir())
    removed = []
    for path in where.glob(f"{prefix}*-*"):
        pid = path.name[len(prefix) :].partition("-")[0]
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours: left alone
            if pid.isdigit() and path.stat().st_uid == os.getuid() and not _alive(int(pid)):
                shutil.rmtree(path)
                removed.append(path)
    return removed


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; between contiguous CPU tensors plain memcpys (numpy), a large
    one's first half on a thread of its own: torch's parallel copy of many mid-sized
    tensors stalls on a busy host's OpenMP threads (2-4x slower on a shared 2-core
    machine), one memcpy uses one core (half the copy rate of a quiet one; numpy's copy
    releases the GIL)."""
    cpu = dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype
    if cpu and dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel() > 0:
        d, s = dst.view(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy()
        half = d.size // 2 if d.size >= 4 << 20 else 0  # from 4 MiB, half on another thread
        other = _COPIER.submit(np.copyto, d[:half], s[:half]) if half else None
        np.copyto(d[half:], s[half:])
        return other.result() if other is not None else None
    dst.copy_(src, non_blocking=True)


def _export_cuda(storage: torch.UntypedStorage, device: torch.device) -> CudaHandle:
    (_, handle, size, offset, ref, ref_offset, event, sync) = storage._share_cuda_()  # type: ignore[no-untyped-call]
    event = bytes(event) if event else b""
    return CudaHandle(
        device_id(device), bytes(handle), size, offset, bytes(ref), ref_offset, event, sync
    )


class StagingBuffer:
    """A uint8 buffer of ``capacity`` bytes the sender packs and the receiver maps."""

    def __init__(self, capacity: int, device: torch.device, directory: Path) -> None:
        self.device, self._path = device, directory / f"buf-{secrets.token_hex(8)}"
        if device.type == "cuda":
            self.tensor = torch.empty(capacity, dtype=torch.uint8, device=device)
            self.handle: Handle = _export_cuda(self.tensor.untyped_storage(), device)
            return
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, capacity)
            inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        self.tensor = torch.from_file(
            str(self._path), shared=True, size=capacity, dtype=torch.uint8
        )
        self.handle = CpuHandle(str(self._path), capacity, inode, device_id(device))

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()
        self.tensor = torch.empty(0, dtype=torch.uint8)


class Exporter:
    """The sender's handles of its tensors' storages, made once per storage."""

    def __init__(self) -> None:
        self._last: dict[StorageWeakRef, tuple[int, int]] = {}  # seen last refit: (ptr, bytes)
        self._seen: dict[StorageWeakRef, tuple[int, int]] = {}
        self._handles: dict[StorageWeakRef, tuple[int, int, Handle]] = {}

    def recognised(self, tensor: torch.Tensor) -> tuple[StorageWeakRef, bool]:
        """Its storage's reference, and whether the last refit saw it (the same memory)."""
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        place = self._seen[ref] = (storage.data_ptr(), storage.nbytes())
        exported = self._handles.get(ref)  # this refit or the last (a CPU storage moves)
        return ref, self._last.get(ref) == place or (exported is not None and exported[:2] == place)

    def handle(self, ref: StorageWeakRef, tensor: torch.Tensor) -> Handle:
        """The handle of ``tensor``'s storage; ``RuntimeError`` when it cannot be shared."""
        storage = tensor.untyped_storage()
        cached = self._handles.get(ref)
        if cached is not None and cached[:2] == (storage.data_ptr(), storage.nbytes()):
            return cached[2]
        if tensor.device.type == "cuda":
            handle: Handle = _export_cuda(storage, tensor.device)
        else:
            fd, size = storage._share_fd_cpu_()
            inode = os.fstat(fd).st_ino
            handle = CpuHandle(
                f"/proc/{os.getpid()}/fd/{fd}", size, inode, device_id(tensor.device)
            )
        place = self._seen[ref] = (storage.data_ptr(), storage.nbytes())  # a CPU one moved
        self._handles[ref] = (*place, handle)
        return handle

    def saw(self, sent: Iterable[p.Sent[StorageWeakRef]]) -> None:
        """This refit sent these storages again (:class:`~.ipc.IpcSenderPort`'s replay:
        each tensor's place holds its storage's pointer and bytes)."""
        for tensor in sent:
            self._seen[tensor.ref] = cast(tuple[int, int], tensor.place[2:4])

    def forget(self, ref: StorageWeakRef) -> None:
        """``ref`` could not be shared: never recognise it (it travels packed)."""
        self._seen.pop(ref, None)

    def settle(self, used: set[StorageWeakRef]) -> None:
        """A refit ended: the next recognises what it saw; handles it did not send go."""
        self._last, self._seen = self._seen, {}
        self._handles = {r: h for r, h in self._handles.items() if r in used}

    def clear(self) -> None:
        self._last, self._seen, self._handles = {}, {}, {}


def open_handle(handle: Handle, device: torch.device) -> torch.Tensor:
    """Map a sender's storage as a uint8 tensor; :class:`RefitError` when it is not usable."""
    own = device_id(device if isinstance(handle, CudaHandle) else torch.device("cpu"))
    if handle.device_id != own:
        raise RefitError(
            f"the refit storage lives on {handle.device_id}, this engine worker on {own}"
        )
    if isinstance(handle, CpuHandle):
        return _open_cpu(handle)
    index = device.index if device.index is not None else torch.cuda.current_device()
    _, *shared, event, sync = msgspec.structs.astuple(handle)  # _share_cuda_()'s, in order
    try:
        storage = torch.UntypedStorage._new_shared_cuda(index, *shared, event or None, sync)
    except RuntimeError as e:  # a runtime without CUDA IPC says so here, in torch's words
        advice = p.explain_cuda_ipc_failure(str(e))
        message = f"could not open a CUDA IPC refit storage on {own}: {str(e).strip()}"
        raise RefitError(f"{message}\n{advice}" if advice else message) from e
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (handle.size,), (1,))


def _open_cpu(handle: CpuHandle) -> torch.Tensor:
    path, magic = Path(handle.path), _PROC_FD.fullmatch(handle.path) is not None
    try:
        fd = os.open(path, os.O_RDWR | (0 if magic else os.O_NOFOLLOW))
    except OSError as e:
        raise RefitError(f"could not open the refit storage {path}: {e}") from e
    try:
        st, parent = os.fstat(fd), os.stat(path.parent, follow_symlinks=False)
        facts = p.FileFacts(
            path.is_absolute(),
            stat.S_ISREG(st.st_mode),
            st.st_uid,
            parent.st_uid,
            stat.S_ISDIR(parent.st_mode),
            parent.st_mode,
            st.st_ino,
            st.st_size,
        )
        problem = p.file_problem(facts, uid=os.getuid(), inode=handle.inode, size=handle.size)
        if problem is not None:
            raise RefitError(f"refusing the refit storage {path}: {problem}")
        source = f"/proc/self/fd/{fd}"
        return torch.from_file(source, shared=True, size=handle.size, dtype=torch.uint8)
    finally:
        os.close(fd)


class Mappings:
    """The engine's mappings of sender storages, kept by handle across refits
    (:class:`~genworker.core.refit_protocol.Kept`: released by the first refit that does
    not use them), and the views of the last chunks listed over them."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._maps: dict[Handle, torch.Tensor] = {}
        self._ledger: p.Kept[Handle] = p.Kept()
        self._views: dict[int, tuple[object, list[torch.Tensor]]] = {}
        self.opened = 0  # storages mapped since the last settle

    def __len__(self) -> int:
        return len(self._maps)

    def views(self, chunk: p.Chunk, handles: Sequence[Handle]) -> list[torch.Tensor]:
        """Each listed tensor viewed in place in its (mapped) storage."""
        kept = [h for h, kind in zip(handles, chunk.kinds, strict=True) if kind.kept]
        self._ledger = self._ledger.use(kept)
        key = (handles, chunk.tensors)
        cached = self._views.get(chunk.index)
        if cached is not None and cached[0] == key:
            return cached[1]
        buffers = [self._map(h) for h in handles]
        out = []
        for ref in chunk.tensors:
            raw = buffers[ref.storage][ref.offset : ref.offset + ref.nbytes]
            out.append(raw.view(getattr(torch, ref.dtype)).view(ref.shape))
        if len(kept) == len(handles):
            self._views[chunk.index] = (key, out)
        return out

    def _map(self, handle: Handle) -> torch.Tensor:
        mapped = self._maps.get(handle)
        if mapped is None:
            mapped = self._maps[handle] = open_handle(handle, self._device)
            self.opened += 1
        return mapped

    def drop_temporary(self, chunk: p.Chunk, handles: Sequence[Handle]) -> None:
        for handle, kind in zip(handles, chunk.kinds, strict=True):
            if not kind.kept:
                self._maps.pop(handle, None)

    def settle(self, *, failed: bool) -> int:
        """A refit ended: release what it did not use (all when it failed); how many."""
        settled = self._ledger.clear() if failed else self._ledger.settle()
        self._ledger, self.opened = settled.kept, 0
        if settled.released and self._device.type == "cuda":  # no copy out of one in flight
            torch.cuda.synchronize(self._device)
        for handle in settled.released:
            self._maps.pop(handle, None)
        if settled.released or failed:
            self._views.clear()
        return len(settled.released)
