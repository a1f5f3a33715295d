"""The shareable handle types vLLM's sleep-mode wake asks the CUDA driver for.

vLLM's ``create_and_map`` (``csrc/cumem_allocator.cpp``, 0.32) asks ``cuMemCreate`` for a
fabric shareable handle wherever the device reports fabric support and, when the driver
refuses it, for a POSIX file-descriptor handle; without fabric support it asks for none.
``genworker.shell.cumem_wake`` makes the same calls and stops asking for the fabric handle
on a device once the driver has refused one (its module docstring says why).
"""

from __future__ import annotations

from typing import Final

__all__ = ["FABRIC", "POSIX_FD", "REFUSED", "handle_types"]

POSIX_FD: Final = 0x1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
FABRIC: Final = 0x8  # CU_MEM_HANDLE_TYPE_FABRIC
REFUSED: Final = (800, 801)  # CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED


def handle_types(fabric_supported: bool, fabric_refused: bool) -> tuple[int, ...]:
    """The shareable handle types to ask ``cuMemCreate`` for, in order, the next one only
    when the driver refuses the one before: vLLM's choice (fabric where supported, POSIX
    when refused, none where fabric is unsupported), less the fabric attempt once the
    driver has refused it on the device."""
    if not fabric_supported:
        return (0,)
    if fabric_refused:
        return (POSIX_FD,)
    return (FABRIC, POSIX_FD)
