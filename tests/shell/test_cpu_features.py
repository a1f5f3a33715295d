"""The CPU-feature gate of the fp8 engine tests (``tests/cpu_features.py``): what it reads,
its reason, and the skip path taken for real by forcing the detection off in a child.

This machine may have AMX tiles: the child runs ``tests/shell/test_fp8.py``'s engine tests
and ``bench/bench_fp8.py`` with vLLM's own probe (``torch.cpu._is_amx_tile_supported``)
answering False, as it does on an AMD CPU, and checks they skip with the reason, start no
engine and exit 0.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_features import (
    AMX_TILES_REASON,
    amx_tiles,
    block_fp8_skip_reason,
    cpuinfo_flags,
)

ROOT = Path(__file__).resolve().parents[2]
NO_AMX = "import torch; torch.cpu._is_amx_tile_supported = lambda: False\n"

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu vme sse2 avx2 avx512f avx512_bf16 avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu amx_tile
"""


def test_the_reason_names_the_missing_feature_and_the_kernel() -> None:
    assert block_fp8_skip_reason(lambda: False) == AMX_TILES_REASON
    assert AMX_TILES_REASON.startswith("needs AMX tiles (")
    assert AMX_TILES_REASON.endswith("), this CPU has none")
    assert "CPUFp8W8A8BlockScaledMMKernel" in AMX_TILES_REASON
    assert block_fp8_skip_reason(lambda: True) is None
    assert amx_tiles(lambda: True) is True
    assert amx_tiles(lambda: False) is False


def test_cpuinfo_flags_are_the_first_processor_s() -> None:
    flags = cpuinfo_flags(CPUINFO)
    assert "avx512f" in flags
    assert "amx_tile" not in flags  # the second processor's flags are not read
    assert cpuinfo_flags("processor\t: 0\n") == frozenset()


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64",
    reason="needs /proc/cpuinfo of an x86-64 Linux",
)
def test_vllm_s_probe_agrees_with_the_kernel_s_cpu_flags() -> None:
    """The probe vLLM asks reads the CPU this runs on: it says AMX tiles exactly when the
    kernel lists ``amx_tile``."""
    flags = cpuinfo_flags(Path("/proc/cpuinfo").read_text())
    assert amx_tiles() is ("amx_tile" in flags)
    assert amx_tiles() is bool(torch.cpu._is_amx_tile_supported())


def _child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONSAFEPATH="1", VLLM_TARGET_DEVICE="cpu")
    return subprocess.run(
        [sys.executable, "-c", NO_AMX + code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_without_amx_the_fp8_engine_tests_skip_with_the_reason() -> None:
    done = _child(
        "import sys, pytest\nsys.exit(pytest.main(sys.argv[1:]))",
        "-q",
        "-rs",
        "-m",
        "engine",
        "tests/shell/test_fp8.py",
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    summary = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"2 skipped, \d+ deselected in .*", summary), out
    assert out.count(AMX_TILES_REASON) == 2, out


def test_without_amx_the_fp8_bench_prints_the_reason_and_measures_the_rest() -> None:
    done = _child(
        "import sys; sys.path.insert(0, 'bench'); import bench_fp8\n"
        "for key, value in bench_fp8.measure(): print(f'{key}={value:.4g}')\n"
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert f"bench_fp8: the engine figures skipped: {AMX_TILES_REASON}" in done.stdout, out
    figures = [line.partition("=")[0] for line in done.stdout.splitlines() if "=" in line]
    assert figures == ["fp8_quantize_gbps"], out
