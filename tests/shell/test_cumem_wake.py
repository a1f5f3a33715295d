"""The sleep-mode wake's create_and_map (genworker.shell.cumem_wake): its control flow
over a scripted driver (the handle types it asks for: tests/core/test_cumem.py), and
its absence where there is no CUDA. The H200 measures it (bench/gpu.py, refit section)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, cast

import pytest

from genworker.shell import cumem_wake as cw

FABRIC, POSIX = 0x8, 0x1


def test_the_structs_have_the_cuda_driver_layouts() -> None:
    assert ctypes.sizeof(cw._Prop) == 32
    assert cw._Prop.win32HandleMetaData.offset == 16
    assert cw._Prop.allocFlags.offset == 24
    assert ctypes.sizeof(cw._Access) == 12


class _Cu:
    """A scripted libcuda: cuMemCreate answers ``creates`` in turn."""

    def __init__(self, creates: list[int], map_rc: int = 0, access_rc: int = 0) -> None:
        self.creates, self.map_rc, self.access_rc = creates, map_rc, access_rc
        self.asked: list[int] = []
        self.released: list[int] = []
        self.unmapped = 0

    def cuCtxGetCurrent(self, out: Any) -> int:
        out._obj.value = 1
        return 0

    def cuMemCreate(self, handle: Any, size: int, prop: Any, flags: int) -> int:
        self.asked.append(prop._obj.requestedHandleTypes)
        rc = self.creates.pop(0)
        if rc == 0:
            handle._obj.value = 4242
        return rc

    def cuMemMap(self, d_mem: int, size: int, offset: int, handle: int, flags: int) -> int:
        return self.map_rc

    def cuMemSetAccess(self, d_mem: int, size: int, desc: Any, count: int) -> int:
        return self.access_rc

    def cuMemUnmap(self, d_mem: Any, size: Any) -> int:
        self.unmapped += 1
        return 0

    def cuMemRelease(self, handle: int) -> int:
        self.released.append(handle)
        return 0

    def cuGetErrorString(self, rc: int, out: Any) -> int:
        out._obj.value = b"scripted"
        return 0


def _scripted(monkeypatch: pytest.MonkeyPatch, cu: _Cu, fabric: bool = True) -> cw._Driver:
    drv = cw._Driver.__new__(cw._Driver)
    drv.cu = cast(ctypes.CDLL, cu)
    drv.lock = threading.Lock()
    drv.attributes = {0: (True, fabric)}
    drv.fabric_refused = set()
    monkeypatch.setattr(cw, "_driver", drv)
    return drv


def _handle() -> tuple[ctypes.c_uint64, tuple[int, int, int, int]]:
    slot = ctypes.c_uint64(0)
    return slot, (0, 1 << 21, 0x7000_0000, ctypes.addressof(slot))


def test_a_refused_fabric_create_is_asked_once_then_posix_directly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cu = _Cu(creates=[801, 0, 0])
    drv = _scripted(monkeypatch, cu)
    slot, handle = _handle()
    cw.create_and_map(handle)
    assert slot.value == 4242  # where vLLM's C code reads the handle back
    assert cu.asked == [FABRIC, POSIX]
    assert drv.fabric_refused == {0}
    cw.create_and_map(_handle()[1])
    assert cu.asked == [FABRIC, POSIX, POSIX]  # the refusal is remembered


def test_a_granted_fabric_create_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    cu = _Cu(creates=[0])
    drv = _scripted(monkeypatch, cu)
    cw.create_and_map(_handle()[1])
    assert cu.asked == [FABRIC]
    assert drv.fabric_refused == set()


def test_without_fabric_support_no_shareable_handle_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cu = _Cu(creates=[0])
    _scripted(monkeypatch, cu, fabric=False)
    cw.create_and_map(_handle()[1])
    assert cu.asked == [0]


def test_a_failed_create_raises_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    cu = _Cu(creates=[801, 2])  # fabric refused, then out of memory
    _scripted(monkeypatch, cu)
    with pytest.raises(RuntimeError, match=r"code 2\) in cuMemCreate"):
        cw.create_and_map(_handle()[1])
    assert cu.released == []


@pytest.mark.parametrize(("map_rc", "access_rc", "unmapped"), [(1, 0, 0), (0, 1, 1)])
def test_a_failed_map_or_access_releases_the_created_memory(
    monkeypatch: pytest.MonkeyPatch, map_rc: int, access_rc: int, unmapped: int
) -> None:
    cu = _Cu(creates=[0], map_rc=map_rc, access_rc=access_rc)
    _scripted(monkeypatch, cu)
    with pytest.raises(RuntimeError, match="cuMemMap" if map_rc else "cuMemSetAccess"):
        cw.create_and_map(_handle()[1])
    assert cu.released == [4242]
    assert cu.unmapped == unmapped


def test_without_cuda_nothing_is_installed() -> None:
    from vllm.device_allocator import cumem

    before = cumem.create_and_map
    assert cw.install() is False
    assert cumem.create_and_map is before
