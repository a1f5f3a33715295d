"""Staging buffers a receiver can map: shared-memory files on CPU, CUDA IPC on GPU.

CPU: the sender creates each buffer as a file (mode 0600) in its own private directory
(``mkdtemp``: mode 0700, random name) under ``/dev/shm`` when it exists, and maps it with
``torch.from_file(shared=True)``. The receiver opens the path with ``O_NOFOLLOW``, checks
that it is a regular file owned by its own user inside a directory nobody else can
enter, and maps the very file it opened (through ``/proc/self/fd``), so a path swapped
after the check is never mapped. The sender removes its directory on ``close`` (a SIGKILLed
sender leaves it behind; the names are random, so nothing collides with it).

Engine memory (the direct refit's ``engine-handles`` mode): a CPU parameter's storage is
moved, in place, into an unlinked shared-memory file once (``_share_fd_cpu_``, torch's
``share_memory_``); its handle is ``/proc/<pid>/fd/<fd>``, which only processes allowed to
inspect the engine's (same user, ptrace rules) can open. The receiver opens that path
following the ``/proc`` link (the one case without ``O_NOFOLLOW``) and makes the same
owner and size checks.

CUDA: ``UntypedStorage._share_cuda_()`` gives bytes and ints (the memory handle, the
reference-counter handle, the event handle); the receiver rebuilds the storage with
``UntypedStorage._new_shared_cuda`` on ITS OWN device index, after checking that the
handle names the same physical GPU (UUID), as NeMo-RL keys its handles by GPU UUID.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
import tempfile
from pathlib import Path
from typing import Final

import torch

from genworker.shell.errors import RefitError
from genworker.shell.refit.wire import CpuHandle, CudaHandle

__all__ = [
    "StagingBuffer",
    "device_id",
    "export_storage",
    "open_handle",
    "private_directory",
]


_PROC_FD: Final = re.compile(r"/proc/\d+/fd/\d+")


def device_id(device: torch.device) -> str:
    """A name for the physical device: ``GPU-<uuid>`` for CUDA, ``cpu@<host>`` otherwise."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return f"GPU-{uuid}" if uuid is not None else f"cuda:{index}@{socket.gethostname()}"
    return f"{device.type}@{socket.gethostname()}"


def private_directory(prefix: str, parent: str | Path | None = None) -> Path:
    """A fresh 0700 directory with a random name in ``parent`` (default: /dev/shm when
    there is one, else the temporary directory)."""
    if parent is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        parent = "/dev/shm"
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    path.chmod(0o700)
    return path


class StagingBuffer:
    """A uint8 buffer of ``capacity`` bytes the sender packs and the receiver maps."""

    def __init__(self, capacity: int, device: torch.device, directory: Path | None) -> None:
        self.capacity = capacity
        self.device = device
        self._path: Path | None = None
        if device.type == "cuda":
            self.tensor = torch.empty(capacity, dtype=torch.uint8, device=device)
            self.handle: CpuHandle | CudaHandle = _export_cuda(self.tensor)
        else:
            if directory is None:
                raise ValueError("a CPU staging buffer needs a private directory")
            self._path = directory / f"buf-{secrets.token_hex(8)}"
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, capacity)
            finally:
                os.close(fd)
            self.tensor = torch.from_file(
                str(self._path), shared=True, size=capacity, dtype=torch.uint8
            )
            self.handle = CpuHandle(str(self._path), capacity, device_id(device))

    def close(self) -> None:
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
            self._path = None
        self.tensor = torch.empty(0, dtype=torch.uint8)


def _export_cuda(tensor: torch.Tensor) -> CudaHandle:
    storage = tensor.untyped_storage()
    (_dev, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        storage._share_cuda_()  # type: ignore[no-untyped-call]
    )
    return CudaHandle(
        device_id=device_id(tensor.device),
        handle=bytes(handle),
        size=int(size),
        offset=int(offset),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle) if event_handle else b"",
        event_sync_required=bool(event_sync),
    )


def export_storage(tensor: torch.Tensor) -> CpuHandle | CudaHandle:
    """A handle of ``tensor``'s whole storage (CPU: moved into shared memory in place, once).

    Raises ``RuntimeError`` when the memory cannot be exported (CUDA virtual-memory
    allocations, such as vLLM's sleep-mode pool, have no legacy IPC handle)."""
    if tensor.device.type == "cuda":
        return _export_cuda(tensor)
    storage = tensor.untyped_storage()
    fd, size = storage._share_fd_cpu_()
    return CpuHandle(f"/proc/{os.getpid()}/fd/{int(fd)}", int(size), device_id(tensor.device))


def open_handle(handle: CpuHandle | CudaHandle, device: torch.device) -> torch.Tensor:
    """Map a sender's buffer as a uint8 tensor; :class:`RefitError` when it is not usable."""
    if isinstance(handle, CudaHandle):
        return _open_cuda(handle, device)
    return _open_cpu(handle)


def _open_cuda(handle: CudaHandle, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        raise RefitError(f"a CUDA IPC buffer cannot be mapped on {device}")
    own = device_id(device)
    if handle.device_id != own:
        raise RefitError(
            f"the refit buffer lives on {handle.device_id}, but this engine worker runs on {own}"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            handle.handle,
            handle.size,
            handle.offset,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle or None,
            handle.event_sync_required,
        )
    except RuntimeError as e:
        raise RefitError(f"could not open the CUDA IPC refit buffer on {own}: {e}") from e
    out = torch.empty(0, dtype=torch.uint8, device=device)
    out.set_(storage, 0, (handle.size,), (1,))
    return out


def _open_cpu(handle: CpuHandle) -> torch.Tensor:
    own = device_id(torch.device("cpu"))
    if handle.device_id != own:
        raise RefitError(
            f"the refit buffer lives on {handle.device_id}, but this engine worker runs on {own}"
        )
    path = Path(handle.path)
    magic = _PROC_FD.fullmatch(handle.path) is not None  # a /proc link: follow it
    try:
        fd = os.open(path, os.O_RDWR | (0 if magic else os.O_NOFOLLOW))
    except OSError as e:
        raise RefitError(f"could not open the refit buffer {path}: {e}") from e
    try:
        st = os.fstat(fd)
        parent = os.stat(path.parent, follow_symlinks=False)
        problem = None
        if not path.is_absolute():
            problem = "its path is not absolute"
        elif not stat.S_ISREG(st.st_mode):
            problem = "it is not a regular file"
        elif st.st_uid != os.getuid() or parent.st_uid != os.getuid():
            problem = "it belongs to another user"
        elif not stat.S_ISDIR(parent.st_mode) or parent.st_mode & 0o077:
            problem = "its directory is open to other users"
        elif st.st_size < handle.size:
            problem = f"it holds {st.st_size} bytes, fewer than the {handle.size} declared"
        if problem is not None:
            raise RefitError(f"refusing the refit buffer {path}: {problem}")
        proc = f"/proc/self/fd/{fd}"
        source = proc if os.path.exists(proc) else str(path)
        return torch.from_file(source, shared=True, size=handle.size, dtype=torch.uint8)
    finally:
        os.close(fd)
