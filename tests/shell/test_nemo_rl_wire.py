"""NeMo-RL's IPC wire at the receiver: :func:`read_frame` raises ``core.nemo_rl_wire``'s
refusals typed (``UnsafePickleError`` for a pickle that reaches for what the wire never
carries, ``RefitWireError`` for a malformed message), and the CUDA codec maps a handle or
says why it cannot (``tests/core/test_nemo_rl_wire.py`` holds the wire's own laws)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from genworker.core.nemo_rl_wire import NEMO_RL_IPC_GLOBALS, CudaIpcHandle, IpcBucket
from genworker.shell.errors import RefitError, RefitWireError, UnsafePickleError
from genworker.shell.refit.nemo_rl import CudaIpcCodec, read_frame

H = CudaIpcHandle((4,), (1,), 0, torch.uint8, 0, b"h", 4, 0, False, b"r", 0, b"e", True)


class _Calls:
    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return os.system, ("echo pwned",)


def _frame(message: object) -> bytes:
    return pickle.dumps(message, protocol=4)


def _read(frame: bytes) -> object:
    return read_frame(frame, NEMO_RL_IPC_GLOBALS, CudaIpcCodec().read)


def test_a_bucket_reads_with_its_cuda_handle() -> None:
    args = H.rebuild_args(H.device)
    assert args[0] is torch.Tensor
    frame = _frame(((args,), ["w"], 4))
    assert _read(frame) == IpcBucket(H, ("w",), 4)
    whole = _frame(((rebuild_cuda_tensor, args), ["w"], 4))  # the whole reduce_tensor result
    assert _read(whole) == IpcBucket(H, ("w",), 4)


def test_a_hostile_pickle_is_refused_as_unsafe_naming_the_callable() -> None:
    with pytest.raises(UnsafePickleError, match=r"names the callable (posix|os|nt)\.system"):
        _read(_frame((_Calls(), ["w"], 4)))


@pytest.mark.parametrize(
    ("message", "what"),
    [
        ("complete", "COMPLETE"),
        (((H.rebuild_args(0),), [], 4), "param_names"),
        (((H.rebuild_args(0)[:14],), ["w"], 4), "15 arguments"),
    ],
)
def test_a_malformed_message_is_a_wire_error_naming_the_field(message: object, what: str) -> None:
    with pytest.raises(RefitWireError, match=what) as info:
        _read(_frame(message))
    assert not isinstance(info.value, UnsafePickleError)


def test_a_frame_that_is_not_a_pickle_is_a_wire_error() -> None:
    with pytest.raises(RefitWireError, match="well-formed pickle") as info:
        _read(b"not a pickle")
    assert not isinstance(info.value, UnsafePickleError)


def test_the_cuda_codec_takes_one_dimensional_byte_buffers_only() -> None:
    flat = CudaIpcHandle((4, 2), (2, 1), 0, torch.uint8, 0, b"h", 8, 0, False, b"r", 0, b"e", True)
    with pytest.raises(RefitWireError, match="1-D uint8 buffer"):
        CudaIpcCodec().storage_bytes(flat)
    assert CudaIpcCodec().storage_bytes(H) == 4


@pytest.mark.parametrize(
    ("raised", "advice"),
    [
        ("CUDA error: invalid resource handle", True),
        ("pidfd_open syscall failed: Operation not permitted", True),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ],
)
def test_a_runtime_without_cuda_ipc_says_so_on_nemo_rls_wire(
    raised: str, advice: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failure mode R8 on NeMo-RL's wire: torch's error as it came, and what to change
    when it is a sign that this runtime has no CUDA IPC (not for any other error)."""
    import torch.multiprocessing.reductions as reductions

    def failing(*args: object) -> torch.Tensor:
        raise RuntimeError(raised)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", failing)
    with pytest.raises(RefitError) as info:
        CudaIpcCodec().open(H, torch.device("cuda", 0))
    text = str(info.value)
    assert f"could not open NeMo-RL's CUDA IPC buffer on cuda:0: {raised}" in text
    assert ("CUDA IPC is unavailable in this runtime" in text) is advice
    assert ("--ipc=host" in text) is advice
    assert isinstance(info.value.__cause__, RuntimeError)
