"""NeMo-RL's IPC refit wire, the pickles: what its trainer sends loads; nothing else does
(``core.nemo_rl_wire``; ``tests/shell/test_nemo_rl_wire.py``: the receiver raises its
refusals typed).

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
import re
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Result, Success
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from genworker.core.nemo_rl_wire import (
    IPC_COMPLETE,
    NEMO_RL_IPC_GLOBALS,
    CudaIpcHandle,
    IpcBucket,
    IpcComplete,
    WireName,
    WireProblem,
    WireUnpickler,
    cuda_ipc_handle,
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


def _refused(result: Result[object, WireProblem], match: str, *, unsafe: bool) -> str:
    """``result`` is a refusal whose text matches ``match``, ``unsafe`` as said; its text."""
    assert isinstance(result, Failure), result
    problem = result.failure()
    assert re.search(match, str(problem)), problem
    assert problem.unsafe is unsafe
    return str(problem)


def _read(message: object) -> Result[IpcBucket[CudaIpcHandle] | IpcComplete, WireProblem]:
    """A loaded message read as the CUDA codec reads it: its handle checked too."""

    def handle(
        bucket: IpcBucket[object] | IpcComplete,
    ) -> Result[IpcBucket[CudaIpcHandle] | IpcComplete, WireProblem]:
        if isinstance(bucket, IpcComplete):
            return Success(bucket)
        checked = cuda_ipc_handle(bucket.handle)
        return checked.map(lambda h: IpcBucket(h, bucket.names, bucket.used_bytes))

    return read_message(message).bind(handle)


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
    assert loads(data).bind(_read) == Success(IpcBucket(handle, tuple(names), used))


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
    assert loads(complete).bind(_read) == Success(IPC_COMPLETE)
    _refused(loads(ack).bind(_read), "COMPLETE", unsafe=False)


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
    text = _refused(loads(data), r"names the callable (\S+)\.(\w+);", unsafe=True)
    # The refusal names the first global the pickle reaches for (torch.empty pickles as
    # builtins.getattr on torch's function table, os.system as posix.system).
    named = text.split("names the callable ")[1].split(";")[0]
    module, _, name = named.rpartition(".")
    assert module.encode() in data
    assert name.encode() in data
    assert (module, name) not in NEMO_RL_IPC_GLOBALS
    assert _refused(scan_pickle(data), "names the callable", unsafe=True) == text


def test_the_scan_refuses_before_any_allowed_call_is_made() -> None:
    """With the recorder allowed, a pickle that calls it and then names os.system runs
    nothing: the whole pickle is checked before loading starts."""
    allow = {**NEMO_RL_IPC_GLOBALS, (__name__, "_record"): _record}
    ok = pickle.dumps([_Calls(_record, 1)])
    assert loads(ok, allow) == Success(["called"])
    assert CALLS == [(1,)]
    CALLS.clear()
    bad = pickle.dumps([_Calls(_record, 1), _Calls(os.system, "true")])
    _refused(loads(bad, allow), r"(posix|os|nt)\.system", unsafe=True)


def test_calling_a_global_the_wire_carries_as_data_is_refused() -> None:
    h = CudaIpcHandle((4,), (1,), 0, torch.uint8, 0, b"h", 4, 0, False, b"r", 0, b"e", True)
    (args,) = _sender_handle(h)
    assert isinstance(args, tuple)
    data = pickle.dumps(_Calls(rebuild_cuda_tensor, *args))  # would map the IPC handle
    _refused(loads(data), r"calls torch\.multiprocessing\.reductions", unsafe=True)
    _refused(
        loads(pickle.dumps(_Calls(torch.Tensor, 1 << 40))), r"calls torch\.Tensor", unsafe=True
    )


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
    _refused(loads(data), what, unsafe=True)


def test_protocol_two_bytes_go_through_a_refused_codec() -> None:
    h = CudaIpcHandle((4,), (1,), 0, torch.uint8, 0, b"h", 4, 0, False, b"r", 0, b"e", True)
    data = pickle.dumps((_sender_handle(h), ["w"], 4), protocol=2)
    _refused(loads(data), r"_codecs\.encode", unsafe=True)


def test_a_registered_extension_is_refused() -> None:
    copyreg.add_extension(__name__, "_record", 0xBEEF)
    try:
        data = pickle.dumps(_Calls(_record, 1), protocol=2)
    finally:
        copyreg.remove_extension(__name__, "_record", 0xBEEF)
    _refused(loads(data), "EXT", unsafe=True)


@given(st.binary(max_size=200))
def test_arbitrary_bytes_give_a_refusal_or_a_plain_value(data: bytes) -> None:
    loaded = loads(data)
    if isinstance(loaded, Success):
        _assert_plain(loaded.unwrap())


@given(handles(), st.data())
def test_corrupted_messages_give_refusals_as_values(
    handle: CudaIpcHandle, data: st.DataObject
) -> None:
    good = bytearray(pickle.dumps((_sender_handle(handle), ["w"], 4), protocol=4))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(good) - 1))
        good[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(good)))
    read = loads(bytes(good[:cut])).bind(_read)  # a value either way, never a raise
    assert isinstance(read, Success | Failure)


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
    _refused(loads("not bytes"), "bytes", unsafe=False)


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
    _refused(_read(message), what, unsafe=False)


def test_a_loaded_untyped_storage_handle_is_accepted() -> None:
    args = _good_args()
    args[4] = WireName.UNTYPED_STORAGE_CLASS
    read = _read(((tuple(args),), ["w"], 4))
    assert isinstance(read, Success)
    bucket = read.unwrap()
    assert isinstance(bucket, IpcBucket)
    assert bucket.names == ("w",)


def test_a_pickle_that_scans_clean_but_cannot_load_is_malformed() -> None:
    _refused(loads(b"\x80\x04t."), "not a well-formed pickle", unsafe=False)  # TUPLE, no MARK


@pytest.mark.parametrize(
    ("data", "what"),
    [(b"cos\nsystem\n.", r"names the callable os\.system"), (b"Pa\n.", "persistent id")],
)
def test_the_unpickler_alone_refuses_what_the_scan_refuses(data: bytes, what: str) -> None:
    """Defence in depth: the unpickler refuses by itself what the scan stops first."""
    with pytest.raises(Exception, match=what):
        WireUnpickler(io.BytesIO(data)).load()


@given(handles())
def test_a_1d_uint8_bucket_maps_its_size_in_bytes(handle: CudaIpcHandle) -> None:
    bucket = attrs.evolve(handle, dtype=torch.uint8)
    assert bucket.bucket_bytes() == Success(bucket.size[0])


@pytest.mark.parametrize(
    ("size", "stride", "dtype"),
    [((4,), (1,), torch.float32), ((2, 2), (2, 1), torch.uint8), ((4,), (2,), torch.uint8)],
)
def test_a_bucket_that_is_no_1d_uint8_buffer_is_refused_naming_it(
    size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> None:
    h = CudaIpcHandle(size, stride, 0, dtype, 0, b"h", 16, 0, False, b"r", 0, b"e", True)
    message = _refused(h.bucket_bytes(), "1-D uint8 buffer", unsafe=False)
    assert f"{dtype} of size {size} and stride {stride}" in message
