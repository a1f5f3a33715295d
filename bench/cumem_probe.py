"""What vLLM's sleep/wake pays the CUDA driver for, and whether threads cut it (issue 11).

vLLM's ``CuMemAllocator`` wakes by calling ``create_and_map`` (``cuMemCreate``,
``cuMemMap``, ``cuMemSetAccess``) once per allocation, in order, and sleeps with
``unmap_and_release`` (``cuMemUnmap``, ``cuMemRelease``). On the H200 that is 195 ms of
the 8B train-to-generate switch (bench/RESULTS-gpu.md). This probe makes the same calls
through ctypes (which releases the interpreter lock around each) on the allocation shapes
of that switch, one call at a time and from a thread pool, and prints what each costs.
Standard library only: it needs the driver (``libcuda.so.1``), no torch, no vLLM.

    python3 bench/cumem_probe.py [--device 0] [--scale 1.0] [--threads]
    python3 bench/cumem_probe.py --switch      # the switch's sequence, device mostly held
    python3 bench/cumem_probe.py --kv-cycles 5 # the KV cache's release/create, as JSON

What it showed on the H200 (bench/RESULTS-gpu.md): from a thread pool the calls get
slower, not faster (the driver serialises them); the first cycles on memory new to the
process are fast (33 creates of 1.2 GiB in 3-4 ms) and later ones slow (45-90 ms), with
or without the rest of the device held.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

GIB = 1 << 30


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


PINNED, LOCATION_DEVICE, READWRITE = 1, 1, 3
RDMA_WITH_VMM = 110  # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
FABRIC_SUPPORTED = 128  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
POSIX_FD, FABRIC = 0x1, 0x8  # CU_MEM_HANDLE_TYPE_*
NOT_PERMITTED, NOT_SUPPORTED = 800, 801


class Driver:
    def __init__(self, device: int) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.check(self.cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(self.cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.device = dev.value
        ctx = ctypes.c_void_p()
        self.check(
            self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain"
        )
        self.ctx = ctx
        self.bind()
        self.rdma_supported = self.attribute(RDMA_WITH_VMM)
        self.fabric_supported = self.attribute(FABRIC_SUPPORTED)
        self.cu.cuMemMap.argtypes = [
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_uint64,
            ctypes.c_uint64,
        ]
        self.cu.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
        self.cu.cuMemRelease.argtypes = [ctypes.c_uint64]
        self.cu.cuMemSetAccess.argtypes = [
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
        ]
        self.cu.cuMemAddressFree.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
        self.cu.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
        self.cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: CUDA driver error {rc} ({name.value!r})")

    def bind(self) -> None:
        self.check(self.cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def attribute(self, which: int) -> bool:
        flag = ctypes.c_int()
        self.check(
            self.cu.cuDeviceGetAttribute(ctypes.byref(flag), which, self.device),
            "cuDeviceGetAttribute",
        )
        return bool(flag.value)

    def prop(self, rdma: bool, handle: int = 0) -> AllocationProp:
        p = AllocationProp()
        p.type = PINNED
        p.requestedHandleTypes = handle
        p.location.type = LOCATION_DEVICE
        p.location.id = self.device
        p.allocFlags.gpuDirectRDMACapable = 1 if rdma else 0
        return p

    def granularity(self, prop: AllocationProp) -> int:
        g = ctypes.c_size_t()
        self.check(
            self.cu.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), 0),
            "cuMemGetAllocationGranularity",
        )
        return g.value

    def reserve(self, size: int, align: int) -> int:
        ptr = ctypes.c_uint64()
        self.check(
            self.cu.cuMemAddressReserve(
                ctypes.byref(ptr),
                ctypes.c_size_t(size),
                ctypes.c_size_t(align),
                ctypes.c_uint64(0),
                ctypes.c_uint64(0),
            ),
            "cuMemAddressReserve",
        )
        return ptr.value


class Timed:
    """Per-call seconds of each driver call, summed (over threads too)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, fn: Callable[[], int], drv: Driver) -> None:
        t0 = time.perf_counter()
        rc = fn()
        took = time.perf_counter() - t0
        with self._lock:
            self.sums[name] = self.sums.get(name, 0.0) + took
        drv.check(rc, name)


def run_case(
    drv: Driver,
    count: int,
    size: int,
    threads: int,
    rdma: bool,
    touch: bool = False,
    gap_s: float = 0.0,
) -> dict[str, float]:
    """Create and map ``count`` allocations of ``size`` bytes, then unmap and release
    them: the seconds of each half and the per-call sums. ``touch``: write every byte
    after mapping (the engine's memory has been used when it sleeps); ``gap_s``: wait that
    long between release and the next case (the switch does other work in between)."""
    prop = drv.prop(rdma)
    gran = drv.granularity(prop)
    size = -(-size // gran) * gran
    base = drv.reserve(count * size, gran)
    desc = AccessDesc()
    desc.location.type = LOCATION_DEVICE
    desc.location.id = drv.device
    desc.flags = READWRITE
    handles = [0] * count
    timed = Timed()

    def create(i: int) -> None:
        drv.bind()
        h = ctypes.c_uint64()
        timed(
            "create",
            lambda: drv.cu.cuMemCreate(
                ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0)
            ),
            drv,
        )
        handles[i] = h.value
        addr = base + i * size
        timed("map", lambda: drv.cu.cuMemMap(addr, size, 0, h.value, 0), drv)
        timed("access", lambda: drv.cu.cuMemSetAccess(addr, size, ctypes.byref(desc), 1), drv)

    def release(i: int) -> None:
        drv.bind()
        addr = base + i * size
        timed("unmap", lambda: drv.cu.cuMemUnmap(addr, size), drv)
        timed("release", lambda: drv.cu.cuMemRelease(handles[i]), drv)

    def each(fn: Callable[[int], None]) -> float:
        t0 = time.perf_counter()
        if threads == 1:
            for i in range(count):
                fn(i)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(fn, range(count)))
        return time.perf_counter() - t0

    wake = each(create)
    if touch:
        for i in range(count):
            drv.check(drv.cu.cuMemsetD8_v2(base + i * size, 1, size), "cuMemsetD8")
    drv.check(drv.cu.cuCtxSynchronize(), "cuCtxSynchronize")
    sleep = each(release)
    drv.check(drv.cu.cuMemAddressFree(base, count * size), "cuMemAddressFree")
    time.sleep(gap_s)
    return {"wake": wake, "sleep": sleep, **timed.sums}


class Set:
    """``count`` allocations of ``size`` bytes at reserved addresses, created and
    released as vLLM's allocator does (one call sequence per allocation)."""

    def __init__(
        self,
        drv: Driver,
        count: int,
        size: int,
        rdma: bool = False,
        as_vllm: bool = False,
        handle: int = 0,
    ) -> None:
        """``as_vllm``: each create made as vLLM's ``create_and_map`` makes it: both
        device attributes queried, RDMA-capable where supported, a fabric handle tried
        first where supported and a POSIX one when the driver refuses it. ``handle``:
        the requested shareable handle types otherwise (0: none)."""
        self.as_vllm = as_vllm
        self.drv, self.prop = drv, drv.prop(rdma or (as_vllm and drv.rdma_supported), handle)
        gran = drv.granularity(self.prop)
        self.count, self.size = count, -(-size // gran) * gran
        self.base = drv.reserve(count * self.size, gran)
        self.handles = [0] * count
        self.desc = AccessDesc()
        self.desc.location.type = LOCATION_DEVICE
        self.desc.location.id = drv.device
        self.desc.flags = READWRITE

    def create(self, touch: bool) -> float:
        cu, t0 = self.drv.cu, time.perf_counter()
        for i in range(self.count):
            h, addr = ctypes.c_uint64(), self.base + i * self.size
            if self.as_vllm:
                self.drv.attribute(RDMA_WITH_VMM)
                fabric = self.drv.attribute(FABRIC_SUPPORTED)
                self.prop.requestedHandleTypes = FABRIC if fabric else 0
                rc = cu.cuMemCreate(
                    ctypes.byref(h),
                    ctypes.c_size_t(self.size),
                    ctypes.byref(self.prop),
                    ctypes.c_uint64(0),
                )
                if fabric and rc in (NOT_PERMITTED, NOT_SUPPORTED):
                    self.prop.requestedHandleTypes = POSIX_FD
                    rc = cu.cuMemCreate(
                        ctypes.byref(h),
                        ctypes.c_size_t(self.size),
                        ctypes.byref(self.prop),
                        ctypes.c_uint64(0),
                    )
                self.drv.check(rc, "cuMemCreate")
            else:
                self.drv.check(
                    cu.cuMemCreate(
                        ctypes.byref(h),
                        ctypes.c_size_t(self.size),
                        ctypes.byref(self.prop),
                        ctypes.c_uint64(0),
                    ),
                    "cuMemCreate",
                )
            try:
                self.drv.check(cu.cuMemMap(addr, self.size, 0, h.value, 0), "cuMemMap")
            except RuntimeError:
                cu.cuMemRelease(h.value)
                raise
            self.handles[i] = h.value
            self.drv.check(
                cu.cuMemSetAccess(addr, self.size, ctypes.byref(self.desc), 1), "cuMemSetAccess"
            )
        took = time.perf_counter() - t0
        if touch:
            for i in range(self.count):
                self.drv.check(
                    cu.cuMemsetD8_v2(self.base + i * self.size, 1, self.size), "cuMemsetD8"
                )
            self.drv.check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        return took

    def release(self) -> float:
        """Unmap and release every allocation created (all of them, or those a failed
        ``create`` made before it failed)."""
        cu, t0 = self.drv.cu, time.perf_counter()
        for i in range(self.count):
            if self.handles[i] == 0:
                continue
            self.drv.check(cu.cuMemUnmap(self.base + i * self.size, self.size), "cuMemUnmap")
            self.drv.check(cu.cuMemRelease(self.handles[i]), "cuMemRelease")
            self.handles[i] = 0
        return time.perf_counter() - t0


def free_bytes(drv: Driver) -> int:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    drv.check(drv.cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
    return free.value


def switch_cycles(drv: Driver, leave_gib: float | None, reps: int = 4) -> None:
    """The 8B switch's sequence on its shapes: sleep (release all), wake weights, 12 ms
    (the refit), wake KV, with the rest of the device held by a filler so that
    ``leave_gib`` GiB stay free while the engine's 54.6 GiB are asleep (None: no filler)."""
    kv, weights = Set(drv, 33, int(39.06 * GIB / 33)), Set(drv, 136, int(15.51 * GIB / 136))
    kv.create(True)
    weights.create(True)
    filler = ctypes.c_uint64()
    held = 0
    if leave_gib is not None:
        held = free_bytes(drv) - int(leave_gib * GIB)
        if held > 0:
            drv.check(
                drv.cu.cuMemAlloc_v2(ctypes.byref(filler), ctypes.c_size_t(held)), "cuMemAlloc"
            )
            drv.check(drv.cu.cuMemsetD8_v2(filler.value, 1, held), "cuMemsetD8")
            drv.check(drv.cu.cuCtxSynchronize(), "cuCtxSynchronize")
    for rep in range(reps):
        t0 = time.perf_counter()
        asleep = weights.release() + kv.release()
        free = free_bytes(drv)
        woke_w = weights.create(False)
        time.sleep(0.012)
        woke_kv = kv.create(False)
        total = time.perf_counter() - t0
        print(
            f"switch | leave {leave_gib} GiB (filler {held / GIB:.1f} GiB, {free / GIB:.1f} GiB "
            f"free asleep) | rep {rep} | sleep {asleep * 1e3:.1f} | wake weights "
            f"{woke_w * 1e3:.1f} | wake kv {woke_kv * 1e3:.1f} | total {total * 1e3:.1f} ms",
            flush=True,
        )
        for s in (weights, kv):  # the engine generates between switches: its memory is used
            for i in range(s.count):
                drv.check(drv.cu.cuMemsetD8_v2(s.base + i * s.size, 2, s.size), "cuMemsetD8")
        drv.check(drv.cu.cuCtxSynchronize(), "cuCtxSynchronize")
    weights.release()
    kv.release()
    if held > 0:
        drv.check(drv.cu.cuMemFree_v2(filler.value), "cuMemFree")


def kv_cycles(
    drv: Driver, cycles: int = 5, rdma: bool = False, as_vllm: bool = False, handle: int = 0
) -> dict[str, list[float]]:
    """The 8B switch's KV cache (33 allocations, 39.06 GiB) released and created again
    ``cycles`` times, written between cycles (as generation writes it): the seconds of
    each release and each create. The first cycle's memory is new to the process.
    ``rdma``: the allocations GPUDirect-RDMA capable, as vLLM's allocator makes them
    where the device supports it; ``as_vllm``: made as vLLM makes them (``Set``)."""
    kv = Set(drv, 33, int(39.06 * GIB / 33), rdma, as_vllm, handle)
    out: dict[str, list[float]] = {"release_s": [], "create_s": []}
    try:
        kv.create(True)
        for _ in range(cycles):
            out["release_s"].append(kv.release())
            out["create_s"].append(kv.create(True))
    finally:
        kv.release()
        drv.check(drv.cu.cuMemAddressFree(kv.base, kv.count * kv.size), "cuMemAddressFree")
    return out


def report(name: str, threads: int, rdma: bool, extra: str, r: dict[str, float]) -> None:
    sums = "/".join(
        f"{r.get(k, 0.0) * 1e3:.1f}" for k in ("create", "map", "access", "unmap", "release")
    )
    print(
        f"{name} | {threads} | {int(rdma)} | {extra} | {r['wake'] * 1e3:.1f} | "
        f"{r['sleep'] * 1e3:.1f} | {sums}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every size")
    ap.add_argument("--threads", action="store_true", help="also from thread pools")
    ap.add_argument("--switch", action="store_true", help="only the switch sequences")
    ap.add_argument("--kv-cycles", type=int, default=0, help="only kv_cycles, as JSON")
    ap.add_argument("--rdma", action="store_true", help="kv_cycles' allocations RDMA-capable")
    ap.add_argument("--as-vllm", action="store_true", help="kv_cycles' creates as vLLM's")
    ap.add_argument("--posix", action="store_true", help="kv_cycles' handles POSIX-FD shareable")
    args = ap.parse_args()
    drv = Driver(args.device)
    if args.kv_cycles:
        print(
            json.dumps(
                kv_cycles(
                    drv,
                    args.kv_cycles,
                    args.rdma and drv.rdma_supported,
                    args.as_vllm,
                    POSIX_FD if args.posix else 0,
                )
            )
        )
        return 0
    if args.switch:
        for leave in (None, 60.0, 20.0, 8.0, 2.0, None):
            switch_cycles(drv, leave)
        return 0
    kv = int(1.2 * GIB * args.scale)
    weights = int(118 * (1 << 20) * args.scale)
    print(
        f"device {drv.device}, RDMA-with-VMM supported: {drv.rdma_supported}, "
        f"fabric handles supported: {drv.fabric_supported}"
    )
    run_case(drv, 4, kv, 1, False)  # first-touch costs, not reported
    print(
        "case | threads | rdma | touched, gap | wake ms | sleep ms | "
        "per-call sums ms (create/map/access/unmap/release)"
    )
    for name, count, size in (("kv 33 x 1.2 GiB", 33, kv), ("weights 136 x 118 MiB", 136, weights)):
        for touch in (False, True):
            for gap in (0.0, 0.1, 1.0):
                # every repetition's wake follows the previous one's release (and gap)
                for rep in range(3):
                    r = run_case(drv, count, size, 1, False, touch=touch, gap_s=gap)
                    report(name, 1, False, f"{int(touch)}, {gap:.1f} s, rep {rep}", r)
        if args.threads:
            for threads in (2, 4, 8):
                r = run_case(drv, count, size, threads, False, touch=True)
                report(name, threads, False, "1, 0.0 s", r)
    r = run_case(drv, 1, 33 * kv, 1, False, touch=True)
    report("one 39.6 GiB", 1, False, "1, 0.0 s", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
