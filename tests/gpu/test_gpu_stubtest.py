"""``typings/vllm`` against the vLLM installed on the GPU runner (0.25), via mypy's stubtest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu.gpu_fixtures import GPU_MARKS

pytestmark = GPU_MARKS

REPO = Path(__file__).resolve().parents[2]


def test_typings_match_the_installed_vllm() -> None:
    pytest.importorskip(
        "mypy.stubtest", reason="mypy is not installed (the runner bundle lacks it)"
    )
    pytest.importorskip("returns", reason="mypy's config loads the returns plugin")
    cmd = [
        sys.executable,
        "-m",
        "mypy.stubtest",
        "vllm",
        "--mypy-config-file",
        str(REPO / "pyproject.toml"),
        "--ignore-missing-stub",
    ]
    cmd += ["--allowlist", str(REPO / "typings" / "stubtest-allowlist.txt")]
    env = {**os.environ, "MYPYPATH": str(REPO / "typings")}
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode == 0, "\n".join(errors) or proc.stdout[-6000:] + proc.stderr[-3000:]
