"""vLLM's sleep-mode wake without a refused fabric create per allocation (issue 11).

Theory of operation
-------------------
vLLM's ``CuMemAllocator.wake_up`` re-creates every allocation that slept through the C
extension's ``create_and_map``, which on CUDA asks, per allocation, for a
GPUDirect-RDMA-capable allocation with a *fabric* shareable handle wherever the device
reports fabric support, and when the driver refuses that (no IMEX domain, as on a single
H200 host) creates it again with a POSIX file-descriptor handle. The refused attempt is
the cost: on the H200 the 8B engine's 33 KV-cache allocations (39 GiB) take 146-173 ms
to wake that way, and 5-6 ms when created directly as the allocation vLLM ends up with
(RDMA-capable, POSIX handle; ``bench/cumem_probe.py --kv-cycles 5 --rdma --posix``
against ``--as-vllm``). :func:`install` replaces the module-level ``create_and_map`` that
``wake_up`` calls by :func:`create_and_map` here, which makes the same allocation with the
same properties and stops asking for a fabric handle on a device once the driver has
refused one in this process (``core.cumem.handle_types``). The first allocation vLLM
makes (``my_malloc``) and every release stay vLLM's own; the handle is written where
vLLM's C code reads it back.

The replacement must happen in the process whose allocator sleeps: the worker's own for
an in-process engine, the engine core's for ``AsyncLLM`` (a process of its own), each
worker's for a multiprocess executor. So it is a ``collective_rpc`` target,
``WorkerExtension.install_wake`` (``genworker.shell.extension``), in vLLM's workers;
the engines call it once before their first sleep (``VllmEngine`` at start, the async
engine at its first ``sleep``).
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from collections.abc import Sequence

from genworker.core.cumem import FABRIC, REFUSED, handle_types

__all__ = ["create_and_map", "install"]

_PINNED, _LOCATION_DEVICE, _READWRITE = 1, 1, 3
_RDMA_WITH_VMM = 110  # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
_FABRIC_SUPPORTED = 128  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Driver:
    """libcuda's calls ``create_and_map`` makes, and what it learnt per device."""

    def __init__(self) -> None:
        cu = ctypes.CDLL("libcuda.so.1")
        u64, size = ctypes.c_uint64, ctypes.c_size_t
        cu.cuMemCreate.argtypes = [ctypes.POINTER(u64), size, ctypes.POINTER(_Prop), u64]
        cu.cuMemMap.argtypes = [u64, size, size, u64, u64]
        cu.cuMemSetAccess.argtypes = [u64, size, ctypes.POINTER(_Access), size]
        cu.cuMemRelease.argtypes = [u64]
        self.cu = cu
        self.lock = threading.Lock()
        self.attributes: dict[int, tuple[bool, bool]] = {}  # device: (rdma, fabric)
        self.fabric_refused: set[int] = set()

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(name))
            text = name.value.decode() if name.value else "unknown error"
            raise RuntimeError(f"CUDA Error: {text} (code {rc}) in {what}")

    def ensure_context(self, device: int) -> None:
        """The device's primary context current on this thread, as vLLM's C code has it."""
        current = ctypes.c_void_p()
        self.check(self.cu.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value:
            return
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.check(
            self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain"
        )
        self.check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def device_attributes(self, device: int) -> tuple[bool, bool]:
        known = self.attributes.get(device)
        if known is None:
            values = []
            for which in (_RDMA_WITH_VMM, _FABRIC_SUPPORTED):
                flag = ctypes.c_int()
                self.check(
                    self.cu.cuDeviceGetAttribute(ctypes.byref(flag), which, device),
                    "cuDeviceGetAttribute",
                )
                values.append(bool(flag.value))
            known = self.attributes[device] = (values[0], values[1])
        return known


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def _the_driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def create_and_map(allocation_handle: Sequence[int]) -> None:
    """vLLM's ``create_and_map`` for a CUDA allocation handle ``(device, size, d_mem,
    p_memHandle)``: physical memory created with vLLM's properties, its handle written
    to ``*p_memHandle``, mapped at ``d_mem`` and made read-write for the device.
    A driver error raises RuntimeError, as vLLM's does; nothing is left created then."""
    device, size, d_mem, p_handle = (int(x) for x in allocation_handle)
    drv = _the_driver()
    drv.ensure_context(device)
    rdma, fabric = drv.device_attributes(device)
    prop = _Prop()
    prop.type = _PINNED
    prop.location.type = _LOCATION_DEVICE
    prop.location.id = device
    prop.allocFlags.gpuDirectRDMACapable = 1 if rdma else 0
    handle = ctypes.c_uint64.from_address(p_handle)
    with drv.lock:
        kinds = handle_types(fabric, device in drv.fabric_refused)
    rc = 0
    for kind in kinds:
        prop.requestedHandleTypes = kind
        rc = drv.cu.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0)
        if rc in REFUSED and kind == FABRIC:
            with drv.lock:
                drv.fabric_refused.add(device)
            continue
        break
    drv.check(rc, "cuMemCreate")
    try:
        drv.check(drv.cu.cuMemMap(d_mem, size, 0, handle.value, 0), "cuMemMap")
        access = _Access()
        access.location.type = _LOCATION_DEVICE
        access.location.id = device
        access.flags = _READWRITE
        rc = drv.cu.cuMemSetAccess(d_mem, size, ctypes.byref(access), 1)
        if rc != 0:
            drv.cu.cuMemUnmap(ctypes.c_uint64(d_mem), ctypes.c_size_t(size))
        drv.check(rc, "cuMemSetAccess")
    except RuntimeError:
        drv.cu.cuMemRelease(handle.value)
        raise


def install() -> bool:
    """Make vLLM's CuMem allocator wake through :func:`create_and_map` (CUDA only; not on
    ROCm, whose allocations vLLM splits in chunks). True when installed, now or before."""
    import torch

    if torch.version.cuda is None or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    cumem = importlib.import_module("vllm.device_allocator.cumem")
    if not getattr(cumem, "cumem_available", False):
        return False
    setattr(cumem, "create_and_map", create_and_map)  # noqa: B010 - the module has no stub
    return True
