"""vLLM's own ``CuMemAllocator`` sleep/wake on the 8B switch's allocation shapes, in a
torch process with no engine, next to the same calls made through ctypes
(``bench/cumem_probe.py``) in that process: tells whether the 3.3 ms per 1.2 GiB that
the engine's KV wake pays (bench/RESULTS-gpu.md) is the driver's, vLLM's, or the engine
process's (issue 11). Needs torch and vLLM (the GPU bundle).

    python bench/cumem_vllm_probe.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import vllm.device_allocator.cumem as cumem
from cumem_probe import Driver, report, run_case

GIB = 1 << 30
sums: dict[str, float] = {}


def wrapped(name: str) -> Any:
    original = getattr(cumem, name)

    def call(handle: Any) -> None:
        t0 = time.perf_counter()
        try:
            original(handle)
        finally:
            sums[name] = sums.get(name, 0.0) + time.perf_counter() - t0

    return call


def main() -> int:
    for name in ("create_and_map", "unmap_and_release"):
        setattr(cumem, name, wrapped(name))
    allocator = cumem.CuMemAllocator.get_instance()
    kv_bytes, weight_bytes = int(39.06 * GIB / 33), int(15.51 * GIB / 136)
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = [torch.zeros(kv_bytes, dtype=torch.int8, device="cuda") for _ in range(33)]
    with allocator.use_memory_pool(tag="weights"):
        weights = [torch.zeros(weight_bytes, dtype=torch.int8, device="cuda") for _ in range(136)]
    torch.cuda.synchronize()
    print(f"vLLM allocator: {len(allocator.pointer_to_data)} allocations", flush=True)
    print(
        "rep | touched before sleep | sleep ms (unmap sum) | wake weights ms | wake kv ms (create sum)"
    )
    for rep in range(6):
        touch = rep % 2 == 1
        if touch:
            for t in kv + weights:
                t.fill_(1)
            torch.cuda.synchronize()
        sums.clear()
        t0 = time.perf_counter()
        allocator.sleep(offload_tags=())
        t1 = time.perf_counter()
        unmapped = sums.get("unmap_and_release", 0.0)
        allocator.wake_up(["weights"])
        t2 = time.perf_counter()
        sums.clear()
        allocator.wake_up(["kv_cache"])
        t3 = time.perf_counter()
        print(
            f"{rep} | {int(touch)} | {(t1 - t0) * 1e3:.1f} ({unmapped * 1e3:.1f}) | "
            f"{(t2 - t1) * 1e3:.1f} | {(t3 - t2) * 1e3:.1f} "
            f"({sums.get('create_and_map', 0.0) * 1e3:.1f})",
            flush=True,
        )
    del kv, weights
    torch.cuda.empty_cache()
    drv = Driver(torch.cuda.current_device())
    print("ctypes, same process: case | threads | rdma | touched, gap | wake ms | sleep ms | sums")
    for touch in (False, True, False, True):
        report("kv 33", 1, False, f"{int(touch)}, 0", run_case(drv, 33, kv_bytes, 1, False, touch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
