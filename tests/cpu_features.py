"""CPU features that tests on vLLM's CPU backend need, decided as vLLM decides them.

vLLM 0.32's CPU block-fp8 linear kernels (``CPUFp8W8A8BlockScaledMMKernel`` and the W8A16
one beside it, ``vllm/model_executor/kernels/linear/scaled_mm/cpu.py``) refuse to run
without AMX tiles: their ``is_supported`` asks ``torch.cpu._is_amx_tile_supported()``, and
an fp8 engine then fails to start ("requires AMX tile support (Sapphire Rapids or
newer)"). Tests that start such an engine carry :data:`needs_amx_tiles`, which asks the
same function; ``bench/bench_fp8.py`` prints the same reason.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

AMX_TILES_REASON = (
    "needs AMX tiles (vLLM's CPU block-fp8 kernel CPUFp8W8A8BlockScaledMMKernel requires "
    "them: Intel Sapphire Rapids or newer), this CPU has none"
)


def amx_tiles(probe: Callable[[], bool] = torch.cpu._is_amx_tile_supported) -> bool:
    """Whether this CPU has AMX tiles, by the function vLLM's CPU kernels ask."""
    return bool(probe())


def block_fp8_skip_reason(
    probe: Callable[[], bool] = torch.cpu._is_amx_tile_supported,
) -> str | None:
    """Why a block-fp8 engine cannot start on vLLM's CPU backend here, or ``None``."""
    return None if amx_tiles(probe) else AMX_TILES_REASON


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The feature flags of the first processor in a ``/proc/cpuinfo`` text."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


needs_amx_tiles = pytest.mark.skipif(block_fp8_skip_reason() is not None, reason=AMX_TILES_REASON)
