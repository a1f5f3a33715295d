"""NeMo-RL's IPC refit wire, the half that needs no transport: safe unpickling and parsing.

Theory of operation
-------------------
NeMo-RL's trainer streams weights over ZMQ with pyzmq's ``send_pyobj`` (pickles;
``stream_weights_via_ipc_zmq_impl`` in ``nemo_rl/models/policy/utils.py``, NeMo-RL commit
7ea279ab), waiting for ``b"ack"`` after each message:

* one message per packed bucket: ``(cuda_ipc_handle, param_names, used_bytes)``, where
  ``cuda_ipc_handle = torch.multiprocessing.reductions.reduce_tensor(buffer)[1:]``, i.e. a
  1-tuple holding the 15 arguments of torch's ``rebuild_cuda_tensor`` (tensor class, size,
  stride, offset, storage class, dtype, device, IPC handle bytes, storage size and offset,
  requires_grad, ref-counter handle and offset, event handle, event-sync flag); a sender
  that keeps the whole ``reduce_tensor`` result sends ``(rebuild_cuda_tensor, args)``;
* then ``IPCProtocol.COMPLETE`` (an ``Enum`` member of ``nemo_rl.models.policy.utils``).

A pickle can call any importable callable while it loads, so :func:`loads` admits exactly
the globals that wire carries (:data:`NEMO_RL_IPC_GLOBALS`) and the opcodes that build plain
values, and checks the whole pickle before building anything:

1. :func:`scan_pickle` walks the opcodes (``pickletools.genops``) without executing them.
   Every global (``GLOBAL``, or ``STACK_GLOBAL`` whose module and name are the two strings
   pushed just before it, directly or from the memo) must be on the allowlist; opcodes
   that construct or mutate arbitrary objects (``BUILD``, ``INST``, ``OBJ``, ``NEWOBJ*``),
   the extension registry (``EXT*``), persistent ids and out-of-band buffers are refused.
   A refusal is a :class:`WireProblem` with ``unsafe`` set, naming the opcode or the
   callable; nothing has been built.
2. The restricted :class:`WireUnpickler` then loads it; its ``find_class`` gives only the
   allowlist's objects. Class and function globals the wire carries as *data* (the tensor
   and storage classes, ``rebuild_cuda_tensor``) load as inert :class:`WireName` markers, so
   a ``REDUCE`` on one fails instead of calling it; the only callables a pickle can reach
   are ``torch.Size`` (a tuple of ints) and the protocol ``Enum`` (genworker's own copy).
3. :func:`read_message` checks the loaded value's shape and returns an :class:`IpcBucket`
   (its handle as it loaded, for :func:`cuda_ipc_handle` or another reader a test
   configuration passes with its own allowlist) or :data:`IPC_COMPLETE`.

Protocol 3 or newer (pyzmq sends ``pickle.DEFAULT_PROTOCOL``): protocol 2 pickles bytes
through ``_codecs.encode``, which is not on the allowlist. Every refusal is a
:class:`WireProblem` value (the shell raises ``UnsafePickleError`` or ``RefitWireError``).
"""

from __future__ import annotations

import enum
import io
import pickle
import pickletools
from collections.abc import Iterator, Mapping
from typing import Final, Generic, TypeVar

import attrs
import torch
from returns.result import Failure, Result, Success, safe

from genworker.core.errors import CoreError

__all__ = [
    "IPC_COMPLETE",
    "NEMO_RL_IPC_GLOBALS",
    "CudaIpcHandle",
    "IpcBucket",
    "IpcComplete",
    "IpcProtocol",
    "WireName",
    "WireProblem",
    "WireUnpickler",
    "cuda_ipc_handle",
    "loads",
    "read_message",
    "scan_pickle",
]


@attrs.frozen
class WireProblem(CoreError):
    """A NeMo-RL IPC message refused: ``unsafe`` when the pickle reaches for what the wire
    never carries (nothing was built), else malformed or of the wrong shape."""

    unsafe: bool = False


class _Refused(Exception):
    """Raised inside loading and parsing; every public function returns its problem."""

    def __init__(self, message: str, *, unsafe: bool = False) -> None:
        super().__init__(message)
        self.problem = WireProblem(message, unsafe)


class IpcProtocol(enum.Enum):
    """NeMo-RL's ``IPCProtocol`` (``nemo_rl/models/policy/utils.py``), by value."""

    COMPLETE = "complete"
    ACK = "ack"


class WireName(enum.Enum):
    """Globals the wire carries as data, never to be called: they load as these markers,
    and a pickle that calls one (``REDUCE``) is refused."""

    TENSOR_CLASS = "torch.Tensor"
    STORAGE_CLASS = "torch.storage.TypedStorage"
    UNTYPED_STORAGE_CLASS = "torch.UntypedStorage"
    REBUILD_CUDA_TENSOR = "torch.multiprocessing.reductions.rebuild_cuda_tensor"

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise _Refused(
            f"refit message refused: it calls {self.value}, which NeMo-RL's IPC wire carries "
            "only as data",
            unsafe=True,
        )


def _dtypes() -> dict[tuple[str, str], object]:
    return {
        ("torch", name): value
        for name, value in vars(torch).items()
        if isinstance(value, torch.dtype)
    }


NEMO_RL_IPC_GLOBALS: Final[Mapping[tuple[str, str], object]] = {
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): WireName.TENSOR_CLASS,
    ("torch._tensor", "Tensor"): WireName.TENSOR_CLASS,
    ("torch.storage", "TypedStorage"): WireName.STORAGE_CLASS,
    ("torch", "UntypedStorage"): WireName.UNTYPED_STORAGE_CLASS,
    ("torch.storage", "UntypedStorage"): WireName.UNTYPED_STORAGE_CLASS,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): WireName.REBUILD_CUDA_TENSOR,
    ("nemo_rl.models.policy.utils", "IPCProtocol"): IpcProtocol,
    **_dtypes(),
}
"""What ``find_class`` gives for each ``(module, name)`` NeMo-RL's IPC wire carries."""

# Opcodes that build plain values (numbers, strings, bytes, None/bools, tuples, lists,
# dicts), move them around, or frame the stream; REDUCE calls only allowlisted callables.
_SAFE_OPCODES: Final = frozenset(
    {
        "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
        "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
        "NONE", "NEWTRUE", "NEWFALSE",
        "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
        "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
        "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
        "EMPTY_LIST", "APPEND", "APPENDS", "LIST",
        "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
        "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
        "GLOBAL", "STACK_GLOBAL", "REDUCE",
    }
)  # fmt: skip
_STRING_PUSHES: Final = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_MEMO_GETS: Final = frozenset({"GET", "BINGET", "LONG_BINGET"})
_MEMO_PUTS: Final = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _refuse(what: str) -> _Refused:
    return _Refused(
        f"refit message refused before loading: it {what}; NeMo-RL's IPC wire carries only "
        "torch's CUDA IPC handle arguments (sizes, dtypes, bytes), parameter names, sizes "
        "and the COMPLETE marker",
        unsafe=True,
    )


def _ops(data: bytes) -> Iterator[tuple[str, object]]:
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            yield opcode.name, arg
    except Exception as e:  # any parse failure is a malformed message
        raise _Refused(f"refit message is not a well-formed pickle: {e}") from e


def _scan(data: bytes, allowlist: Mapping[tuple[str, str], object]) -> tuple[tuple[str, str], ...]:
    names: list[tuple[str, str]] = []
    memo: dict[int, str | None] = {}
    pushed: list[str | None] = []  # what the last stack-pushing opcodes pushed (str or not)
    for op, arg in _ops(data):
        if op not in _SAFE_OPCODES:
            raise _refuse(f"uses the pickle opcode {op}")
        if op in _STRING_PUSHES:
            pushed.append(str(arg))
        elif op in _MEMO_GETS:
            pushed.append(memo.get(arg) if isinstance(arg, int) else None)
        elif op == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op in _MEMO_PUTS and isinstance(arg, int):
            memo[arg] = pushed[-1] if pushed else None
        elif op in ("GLOBAL", "STACK_GLOBAL"):
            if op == "GLOBAL":
                module, _, name = str(arg).partition(" ")
            elif len(pushed) >= 2 and pushed[-2] is not None and pushed[-1] is not None:
                module, name = pushed[-2], pushed[-1]
            else:
                raise _refuse("names a global whose module and name are not plain strings")
            if (module, name) not in allowlist:
                raise _refuse(f"names the callable {module}.{name}")
            names.append((module, name))
            pushed.append(None)
        elif op not in ("PROTO", "FRAME", "STOP"):
            pushed.append(None)  # any other value, or a container / call result
    return tuple(names)


def scan_pickle(
    data: bytes, allowlist: Mapping[tuple[str, str], object] = NEMO_RL_IPC_GLOBALS
) -> Result[tuple[tuple[str, str], ...], WireProblem]:
    """The globals ``data`` names, in order, after checking every opcode and global (see
    the module docstring)."""
    try:
        return Success(_scan(data, allowlist))
    except _Refused as e:
        return Failure(e.problem)


class WireUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` whose ``find_class`` gives only the allowlist's objects."""

    def __init__(
        self, file: io.BytesIO, allowlist: Mapping[tuple[str, str], object] = NEMO_RL_IPC_GLOBALS
    ) -> None:
        super().__init__(file)
        self._allowlist = allowlist

    def find_class(self, module: str, name: str) -> object:
        try:
            return self._allowlist[(module, name)]
        except KeyError:
            raise _refuse(f"names the callable {module}.{name}") from None

    def persistent_load(self, pid: object) -> object:
        raise _refuse("uses a persistent id")


def loads(
    data: object, allowlist: Mapping[tuple[str, str], object] = NEMO_RL_IPC_GLOBALS
) -> Result[object, WireProblem]:
    """One refit message unpickled: scanned first, then loaded through
    :class:`WireUnpickler`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        return Failure(WireProblem(f"refit message must be bytes, got {type(data).__name__}"))
    raw = bytes(data)
    return scan_pickle(raw, allowlist).bind(
        lambda _: safe(WireUnpickler(io.BytesIO(raw), allowlist).load)().alt(_load_problem)
    )


def _load_problem(error: Exception) -> WireProblem:
    """Whatever broke while loading: a refusal's own problem, else a malformed message."""
    if isinstance(error, _Refused):
        return error.problem
    return WireProblem(f"refit message is not a well-formed pickle: {error}")


@attrs.frozen
class CudaIpcHandle:
    """The arguments of torch's ``rebuild_cuda_tensor`` a sender's ``reduce_tensor`` gave,
    as plain values (the device is the sender's; the receiver maps onto its own)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    requires_grad: bool
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def rebuild_args(self, device: int) -> tuple[object, ...]:
        """The 15 arguments for ``rebuild_cuda_tensor`` on ``device`` (as NeMo-RL's
        ``rebuild_cuda_tensor_from_ipc`` replaces the sender's device index)."""
        return (
            torch.Tensor,
            torch.Size(self.size),
            self.stride,
            self.offset,
            torch.storage.TypedStorage,
            self.dtype,
            device,
            self.handle,
            self.storage_size_bytes,
            self.storage_offset_bytes,
            self.requires_grad,
            self.ref_counter_handle,
            self.ref_counter_offset,
            self.event_handle,
            self.event_sync_required,
        )

    def bucket_bytes(self) -> Result[int, WireProblem]:
        """The bytes of the buffer the handle maps: a NeMo-RL IPC bucket is a 1-D uint8
        buffer (``get_handle_from_tensor`` of its packed staging buffer)."""
        if self.dtype is not torch.uint8 or len(self.size) != 1 or self.stride != (1,):
            return Failure(
                WireProblem(
                    "a NeMo-RL IPC bucket is a 1-D uint8 buffer, got "
                    f"{self.dtype} of size {self.size} and stride {self.stride}"
                )
            )
        return Success(self.size[0])


H_co = TypeVar("H_co", covariant=True)


@attrs.frozen
class IpcBucket(Generic[H_co]):
    """One packed bucket: its handle (a :class:`CudaIpcHandle` on NeMo-RL's wire), the
    parameters in it and the bytes used."""

    handle: H_co
    names: tuple[str, ...]
    used_bytes: int


@attrs.frozen
class IpcComplete:
    """The end of a refit stream."""


IPC_COMPLETE: Final = IpcComplete()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(_is_int(v) and v >= 0 for v in value):
        raise _Refused(f"IPC handle {what} must be a tuple of ints >= 0, got {value!r}")
    return tuple(value)


def _handle(value: object) -> CudaIpcHandle:
    if isinstance(value, tuple) and len(value) == 2 and value[0] is WireName.REBUILD_CUDA_TENSOR:
        value = (value[1],)  # (rebuild_cuda_tensor, args): the whole reduce_tensor result
    if not isinstance(value, tuple) or len(value) != 1 or not isinstance(value[0], tuple):
        raise _Refused(
            "IPC handle must be reduce_tensor(buffer)[1:], a 1-tuple of rebuild_cuda_tensor's "
            f"arguments, got {type(value).__name__}"
        )
    args = value[0]
    if len(args) != 15:
        raise _Refused(f"IPC handle must carry 15 arguments, got {len(args)}")
    (cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size,
     storage_offset, requires_grad, ref_handle, ref_offset, event, event_sync) = args  # fmt: skip
    if cls is not WireName.TENSOR_CLASS:
        raise _Refused(f"IPC handle tensor class must be torch.Tensor, got {cls!r}")
    if storage_cls not in (WireName.STORAGE_CLASS, WireName.UNTYPED_STORAGE_CLASS):
        raise _Refused(f"IPC handle storage class is not a torch storage: {storage_cls!r}")
    if not isinstance(dtype, torch.dtype):
        raise _Refused(f"IPC handle dtype must be a torch dtype, got {dtype!r}")
    scalars = {
        "offset": offset,
        "device": device,
        "storage size": storage_size,
        "storage offset": storage_offset,
        "ref-counter offset": ref_offset,
    }
    if bad := [f"{k}={v!r}" for k, v in scalars.items() if not _is_int(v) or v < 0]:
        raise _Refused(f"IPC handle fields must be ints >= 0: {', '.join(bad)}")
    blobs = {"handle": handle, "ref-counter handle": ref_handle, "event handle": event}
    if wrong := [k for k, v in blobs.items() if not isinstance(v, bytes)]:
        raise _Refused(f"IPC handle fields must be bytes: {wrong}")
    flags = {"requires_grad": requires_grad, "event_sync_required": event_sync}
    if wrong := [k for k, v in flags.items() if not isinstance(v, bool)]:
        raise _Refused(f"IPC handle fields must be bools: {wrong}")
    if not isinstance(size, torch.Size):
        raise _Refused(f"IPC handle size must be a torch.Size, got {size!r}")
    return CudaIpcHandle(
        size=_ints(tuple(size), "size"),
        stride=_ints(stride, "stride"),
        offset=offset,
        dtype=dtype,
        device=device,
        handle=handle,
        storage_size_bytes=storage_size,
        storage_offset_bytes=storage_offset,
        requires_grad=requires_grad,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event,
        event_sync_required=event_sync,
    )


def cuda_ipc_handle(value: object) -> Result[CudaIpcHandle, WireProblem]:
    """A bucket's handle as NeMo-RL sends it, checked field by field."""
    try:
        return Success(_handle(value))
    except _Refused as e:
        return Failure(e.problem)


def read_message(message: object) -> Result[IpcBucket[object] | IpcComplete, WireProblem]:
    """A loaded message as a value: a bucket (its handle as it loaded: the caller's
    reader, :func:`cuda_ipc_handle` on NeMo-RL's wire, checks it), or the end of the
    stream."""
    if message is IpcProtocol.COMPLETE:
        return Success(IPC_COMPLETE)
    if not isinstance(message, tuple) or len(message) != 3:
        return Failure(
            WireProblem(
                "refit message must be (cuda_ipc_handle, param_names, used_bytes) or "
                f"IPCProtocol.COMPLETE, got {type(message).__name__}"
            )
        )
    handle, names, used = message
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return Failure(
            WireProblem(f"refit message param_names must be a non-empty list of str, got {names!r}")
        )
    if not _is_int(used) or used < 0:
        return Failure(WireProblem(f"refit message used_bytes must be an int >= 0, got {used!r}"))
    return Success(IpcBucket(handle=handle, names=tuple(names), used_bytes=used))
