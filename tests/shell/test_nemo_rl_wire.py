"""NeMo-RL's IPC refit wire, the pickles: what its trainer sends loads; nothing else does.

The sender stand-in builds NeMo-RL's messages exactly as its trainer does
(``(reduce_tensor(buffer)[1:], names, used_bytes)`` and ``IPCProtocol.COMPLETE``), with
made-up CUDA IPC bytes; ``tests/gpu/test_gpu_nemo_rl_wire.py`` sends real CUDA handles.
"""

from __future__ import annotations

import contextlib
import copyreg
import enum
import inspect
import io
import os
import pickle
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from genworker.shell.errors import RefitWireError, UnsafePickleError
from genworker.shell.nemo_rl_wire import (
    IPC_COMPLETE,
    NEMO_RL_IPC_GLOBALS,
    CudaIpcHandle,
    IpcBucket,
    WireName,
    loads,
    read_message,
    scan_pickle,
)

PROTOCOLS = st.sampled_from([3, 4, 5])
DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.float16, torch.int64]
CALLS: list[tuple[object, ...]] = []


def _record(*args: object) -> str:
    """A callable a hostile pickle names; a test fails if it ever runs."""
    CALLS.append(args)
    return "called"


class _Calls:
    """Pickles as a call of ``fn(*args)`` (what an attacker's ``__reduce__`` does)."""

    def __init__(self, fn: Callable[..., object], *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return self.fn, self.args


@pytest.fixture(autouse=True)
def _no_calls() -> Iterator[None]:
    CALLS.clear()
    yield
    assert CALLS == [], "a refused pickle ran a callable"


@st.composite
def handles(draw: st.DrawFn) -> CudaIpcHandle:
    size = draw(st.integers(0, 1 << 40))
    return CudaIpcHandle(
        size=(size,),
        stride=(1,),
        offset=draw(st.integers(0, 1 << 20)),
        dtype=draw(st.sampled_from(DTYPES)),
        device=draw(st.integers(0, 7)),
        handle=draw(st.binary(min_size=0, max_size=64)),
        storage_size_bytes=draw(st.integers(0, 1 << 40)),
        storage_offset_bytes=draw(st.integers(0, 1 << 30)),
        requires_grad=draw(st.booleans()),
        ref_counter_handle=draw(st.binary(max_size=32)),
        ref_counter_offset=draw(st.integers(0, 1 << 16)),
        event_handle=draw(st.binary(max_size=64)),
        event_sync_required=draw(st.booleans()),
    )


def _sender_handle(h: CudaIpcHandle, *, whole: bool = False) -> tuple[object, ...]:
    """What NeMo-RL's ``get_handle_from_tensor`` sends: ``reduce_tensor(buffer)[1:]``."""
    args = (
        torch.Tensor,
        torch.Size(h.size),
        h.stride,
        h.offset,
        torch.storage.TypedStorage,
        h.dtype,
        h.device,
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        h.requires_grad,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )
    return (rebuild_cuda_tensor, args) if whole else (args,)


# --- what NeMo-RL's trainer sends -------------------------------------------------------------


@given(
    handles(),
    st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=8),
    st.integers(0, 1 << 40),
    PROTOCOLS,
    st.booleans(),
)
def test_a_bucket_message_loads_to_its_values(
    handle: CudaIpcHandle, names: list[str], used: int, protocol: int, whole: bool
) -> None:
    data = pickle.dumps((_sender_handle(handle, whole=whole), names, used), protocol=protocol)
    assert read_message(loads(data)) == IpcBucket(handle, tuple(names), used)


_NEMO_RL_MODULES = (
    "nemo_rl",
    "nemo_rl.models",
    "nemo_rl.models.policy",
    "nemo_rl.models.policy.utils",
)


@contextlib.contextmanager
def _nemo_rl_ipc_protocol() -> Iterator[Any]:
    """NeMo-RL's ``IPCProtocol`` enum, importable where its trainer pickles it from."""

    class IPCProtocol(enum.Enum):
        COMPLETE = "complete"
        ACK = "ack"

    modules = {name: types.ModuleType(name) for name in _NEMO_RL_MODULES}
    IPCProtocol.__module__ = _NEMO_RL_MODULES[-1]
    IPCProtocol.__qualname__ = "IPCProtocol"
    modules[_NEMO_RL_MODULES[-1]].IPCProtocol = IPCProtocol  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in _NEMO_RL_MODULES}
    sys.modules.update(modules)
    try:
        yield IPCProtocol
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@given(PROTOCOLS)
def test_the_complete_marker_loads(protocol: int) -> None:
    with _nemo_rl_ipc_protocol() as ipc:
        complete = pickle.dumps(ipc.COMPLETE, protocol=protocol)
        ack = pickle.dumps(ipc.ACK, protocol=protocol)
    assert read_message(loads(complete)) is IPC_COMPLETE
    with pytest.raises(RefitWireError, match="COMPLETE"):
        read_message(loads(ack))


def test_the_handle_carries_exactly_torchs_rebuild_arguments() -> None:
    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert len(params) == 15
    h = CudaIpcHandle((4,), (1,), 0, torch.uint8, 3, b"h", 4, 0, False, b"r", 0, b"e", True)
    args = h.rebuild_args(device=5)
    assert len(args) == len(params)
    named = dict(zip(params, args, strict=True))
    assert named["tensor_cls"] is torch.Tensor
    assert named["storage_cls"] is torch.storage.TypedStorage
    assert named["storage_device"] == 5  # the receiver's device, as NeMo-RL rebuilds
    assert named["tensor_size"] == torch.Size([4])
    assert named["storage_handle"] == b"h"


def test_the_allowlist_is_the_wires_globals_and_dtypes() -> None:
    non_dtypes = {k for k, v in NEMO_RL_IPC_GLOBALS.items() if not isinstance(v, torch.dtype)}
    assert non_dtypes == {
        ("torch", "Size"),
        ("torch", "Tensor"),
        ("torch._tensor", "Tensor"),
        ("torch.storage", "TypedStorage"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("nemo_rl.models.policy.utils", "IPCProtocol"),
    }
    callables = {k for k, v in NEMO_RL_IPC_GLOBALS.items() if callable(v)}
    # markers are callable only to refuse the call
    assert {k for k in callables if not isinstance(NEMO_RL_IPC_GLOBALS[k], WireName)} == {
        ("torch", "Size"),
        ("nemo_rl.models.policy.utils", "IPCProtocol"),
    }


# --- anything else is refused, before anything is built -----------------------------------------

HOSTILE: list[Callable[..., object]] = [
    os.system,
    eval,
    exec,
    getattr,
    __import__,
    subprocess.Popen,
    torch.load,
    torch.empty,
    io.open,
    _record,
]


@given(st.sampled_from(HOSTILE), st.sampled_from(["names", "used", "handle", "top"]), PROTOCOLS)
def test_a_pickle_naming_any_other_callable_is_refused_naming_it(
    fn: Callable[..., object], where: str, protocol: int
) -> None:
    evil = _Calls(fn, "echo pwned")
    h = CudaIpcHandle((4,), (1,), 0, torch.uint8, 0, b"h", 4, 0, False, b"r", 0, b"e", True)
    message: object = {
        "names": (_sender_handle(h), ["w", evil], 4),
        "used": (_sender_handle(h), ["w"], evil),
        "handle": ((evil,), ["w"], 4),
        "top": evil,
    }[where]
    data = pickle.dumps(message, protocol=protocol)
    with pytest.raises(UnsafePickleError, match=r"names the callable (\S+)\.(\w+);") as info:
        loads(data)
    # The refusal names the first global the pickle reaches for (torch.empty pickles as
    # builtins.getattr on torch's function table, os.system as posix.system).
    named = str(info.value).split("names the callable ")[1].split(";")[0]
    module, _, name = named.rpartition(".")
    assert module.encode() in data
    assert name.encode() in data
    assert (module, name) not in NEMO_RL_IPC_GLOBALS
    with pytest.raises(UnsafePickleError):
        scan_pickle(data)


def test_the_scan_refuses_before_any_allowed_call_is_made() -> None:
    """With the recorder allowed, a pickle that calls it and then names os.system runs
    nothing: the whole pickle is checked before loading starts."""
    allow = {**NEMO_RL_IPC_GLOBALS, (__name__, "_record"): _record}
    ok = pickle.dumps([_Calls(_record, 1)])
    assert loads(ok, allow) == ["called"]
    assert CALLS == [(1,)]
    CALLS.clear()
    bad = pickle.dumps([_Calls(_record, 1), _Calls(os.system, "true")])
    with pytest.raises(UnsafePickleError, match=r"(posix|os|nt)\.system"):
        loads(bad, allow)


def test_calling_a_global_the_wire_carries_as_data_is_refused() -> None:
    h = CudaIpcHandle((4,), (1,), 0, torch.uint8, 0, b"h", 4, 0, False, b"r", 0, b"e", True)
    (args,) = _sender_handle(h)
    assert isinstance(args, tuple)
    data = pickle.dumps(_Calls(rebuild_cuda_tensor, *args))  # would map the IPC handle
    with pytest.raises(UnsafePickleError, match=r"calls torch\.multiprocessing\.reductions"):
        loads(data)
    with pytest.raises(UnsafePickleError, match=r"calls torch\.Tensor"):
        loads(pickle.dumps(_Calls(torch.Tensor, 1 << 40)))


class _Stateful:
    def __init__(self) -> None:
        self.x = 1


@pytest.mark.parametrize(
    ("data", "what"),
    [
        (pickle.dumps(_Stateful(), protocol=4), "NEWOBJ|BUILD|callable"),
        (b"\x80\x04NN\x93.", "not plain strings"),  # STACK_GLOBAL of two Nones
        (b"(i__main__\n_Stateful\n.", "opcode INST"),
        (b"\x80\x02\x82\x01.", "opcode EXT1"),
        (b"\x80\x04\x8c\x01x\x94Q.", "opcode BINPERSID"),
        (b"\x80\x05\x97.", "opcode NEXT_BUFFER"),
        (b"\x80\x04\x8f\x94.", "opcode EMPTY_SET"),
        (b"cos\nsystem\n(S'true'\ntR.", "callable os.system"),  # protocol 0 GLOBAL
    ],
)
def test_opcodes_that_build_other_objects_are_refused(data: bytes, what: str) -> None:
    with pytest.raises(UnsafePickleError, match=what):
        loads(data)


def test_protocol_two_bytes_go_through_a_refused_codec() -> None:
    h = CudaIpcHandle((4,), (1,), 0, torch.uint8, 0, b"h", 4, 0, False, b"r", 0, b"e", True)
    with pytest.raises(UnsafePickleError, match=r"_codecs\.encode"):
        loads(pickle.dumps((_sender_handle(h), ["w"], 4), protocol=2))


def test_a_registered_extension_is_refused() -> None:
    copyreg.add_extension(__name__, "_record", 0xBEEF)
    try:
        data = pickle.dumps(_Calls(_record, 1), protocol=2)
    finally:
        copyreg.remove_extension(__name__, "_record", 0xBEEF)
    with pytest.raises(UnsafePickleError, match="EXT"):
        loads(data)


@given(st.binary(max_size=200))
def test_arbitrary_bytes_give_a_typed_error_or_a_plain_value(data: bytes) -> None:
    try:
        value = loads(data)
    except RefitWireError:
        return
    _assert_plain(value)


@given(handles(), st.data())
def test_corrupted_messages_give_typed_errors(handle: CudaIpcHandle, data: st.DataObject) -> None:
    good = bytearray(pickle.dumps((_sender_handle(handle), ["w"], 4), protocol=4))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(good) - 1))
        good[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(good)))
    try:
        value = loads(bytes(good[:cut]))
        read_message(value)
    except RefitWireError:
        pass


def _assert_plain(value: object) -> None:
    """Only values the wire's allowlist can make."""
    plain = (int, float, str, bytes, bool, type(None), torch.Size, torch.dtype, WireName)
    if isinstance(value, tuple | list):
        for v in value:
            _assert_plain(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _assert_plain(k)
            _assert_plain(v)
    else:
        assert isinstance(value, plain) or type(value).__name__ == "IpcProtocol", type(value)


def test_loads_takes_bytes_only() -> None:
    with pytest.raises(RefitWireError, match="bytes"):
        loads("not bytes")  # type: ignore[arg-type]


# --- what a loaded message must look like ------------------------------------------------------


def _good_args() -> list[object]:
    h = CudaIpcHandle((4,), (1,), 0, torch.uint8, 0, b"h", 4, 0, False, b"r", 0, b"e", True)
    (args,) = _sender_handle(h)
    assert isinstance(args, tuple)
    return [
        WireName.TENSOR_CLASS if a is torch.Tensor
        else WireName.STORAGE_CLASS if a is torch.storage.TypedStorage
        else a
        for a in args
    ]  # fmt: skip


def _with_arg(index: int, value: object) -> object:
    args = _good_args()
    args[index] = value
    return ((tuple(args),), ["w"], 4)


@pytest.mark.parametrize(
    ("message", "what"),
    [
        ("complete", "COMPLETE"),
        ((1, 2), "COMPLETE"),
        (((tuple(_good_args()),), "w", 4), "param_names"),
        (((tuple(_good_args()),), [], 4), "param_names"),
        (((tuple(_good_args()),), [3], 4), "param_names"),
        (((tuple(_good_args()),), ["w"], -1), "used_bytes"),
        (((tuple(_good_args()),), ["w"], True), "used_bytes"),
        ((tuple(_good_args()), ["w"], 4), "1-tuple"),
        (((tuple(_good_args()[:14]),), ["w"], 4), "15 arguments"),
        (_with_arg(0, WireName.STORAGE_CLASS), "tensor class"),
        (_with_arg(4, WireName.TENSOR_CLASS), "storage class"),
        (_with_arg(5, "uint8"), "dtype"),
        (_with_arg(3, -1), "offset"),
        (_with_arg(6, True), "device"),
        (_with_arg(7, "handle"), "bytes"),
        (_with_arg(10, 0), "bools"),
        (_with_arg(1, (4,)), "torch.Size"),
        (_with_arg(2, (-1,)), "stride"),
        (_with_arg(1, torch.Size([-1])), "size"),
    ],
)
def test_a_message_of_the_wrong_shape_is_refused_naming_the_field(message: Any, what: str) -> None:
    with pytest.raises(RefitWireError, match=what):
        read_message(message)


def test_a_loaded_untyped_storage_handle_is_accepted() -> None:
    args = _good_args()
    args[4] = WireName.UNTYPED_STORAGE_CLASS
    bucket = read_message(((tuple(args),), ["w"], 4))
    assert isinstance(bucket, IpcBucket)
    assert bucket.names == ("w",)


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

    from genworker.shell.errors import RefitError
    from genworker.shell.refit.nemo_rl import CudaIpcCodec

    def failing(*args: object) -> torch.Tensor:
        raise RuntimeError(raised)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", failing)
    h = CudaIpcHandle((4,), (1,), 0, torch.uint8, 0, b"h", 4, 0, False, b"r", 0, b"e", True)
    with pytest.raises(RefitError) as info:
        CudaIpcCodec().open(h, torch.device("cuda", 0))
    text = str(info.value)
    assert f"could not open NeMo-RL's CUDA IPC buffer on cuda:0: {raised}" in text
    assert ("CUDA IPC is unavailable in this runtime" in text) is advice
    assert ("--ipc=host" in text) is advice
    assert isinstance(info.value.__cause__, RuntimeError)
