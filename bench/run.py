"""`make bench`: every benchmark's ratios, each measured side by side in one run.

Prints one `name=value` line per figure. Ratios are what we claim (this machine is shared
and noisy); absolute times are printed for context only.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SUITES = (
    "bench_assembly",
    "bench_worker",
    "bench_groups",
    "bench_multimodal",
    "bench_refit",
    "bench_refit_host",
    "bench_fp8",
    "bench_sparse",
    "bench_reshard",
    "bench_async",
    "bench_server",
    "bench_control",
    "bench_lora",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", default=list(SUITES), choices=SUITES)
    args = parser.parse_args()
    failed = []
    for name in args.only:
        started = time.perf_counter()
        try:
            figures = importlib.import_module(name).measure()
        except Exception as e:  # noqa: BLE001 -- report it and go on: one failing suite must not hide the rest
            print(f"{name}: FAILED: {type(e).__name__}: {e}", flush=True)
            failed.append(name)
            continue
        for key, value in figures:
            print(f"{key}={value:.4g}", flush=True)
        print(f"# {name} took {time.perf_counter() - started:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
