"""Refit over a standalone collective group: NCCL on CUDA, gloo on CPU, one code path.

Rendezvous
----------
The trainer picks a free ``ip:port``; trainer rank 0 hosts a fresh ``TCPStore`` there.
Every trainer rank builds a :class:`CollectiveSender`, and every engine worker joins
through ``WorkerExtension.init_collective(rank_prefix, ip, port, world_size,
train_world_size)`` (``collective_rpc``, started concurrently: construction blocks until
all ranks arrived). Engine ranks follow the trainer's: ``train_world_size + rank_prefix +
worker rank``, as NeMo-RL's ``init_collective`` places them. The group is a bare
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on its own store: it never touches vLLM's
process groups or the default group.

Before the group exists, each rank writes a :class:`~genworker.shell.refit.wire.Hello`
(rank, world size, train world size, backend, role) into the store and rank 0 compares
them and publishes a verdict, so a mismatched world size, rank offset or backend fails
at once with a message naming the ranks instead of hanging in NCCL (failure-modes C3).

Protocol
--------
Trainer rank 0 broadcasts each message of a refit (``wire``: length, then msgpack
bytes); other trainer ranks take part with their own identical stream and check it
matches rank 0's. After a message every rank joins a *status round*: an all-reduce of
one error code per rank and, only when something failed, an all-gather of the failing
ranks' messages, so every rank raises a typed error naming who failed and why (C1):

- ``Begin`` (refit id, manifest digest): one round.
- a bucket: header, payload broadcast (received even when the header is refused: its
  size is in the header), and one status round (header checked, payload stored), which
  comes *after the next message* (header and payload): rank 0 packs bucket *k+1* while
  bucket *k* is on the wire, and the engines store bucket *k* while bucket *k+1* is on
  the wire. No host sync is needed (the collective's stream waits for the packing one).
- ``Complete``: after the last bucket's round, a round (every tensor arrived), then a
  round after post-load processing.
- ``Abort`` (the trainer's own stream failed): the last bucket's round, then every rank
  raises.

Direct receive (the sender's ``direct=True``, the default; see ``refit.direct``): the
``Begin`` lists the whole stream, and its status round is also a vote: a rank votes yes
when it checked the list (every manifest tensor exactly once, shapes and dtypes) and,
for an engine, has a contiguous parameter for every tensor (tensor-parallel size 1:
sharded parameters are never direct targets). When every rank voted yes, rank 0
broadcasts each tensor in list order straight into the engines' parameters (other
trainer ranks receive into scratch), with no headers and no rounds in between, and one
status round after post-load processing ends the refit (ok or every rank's error).
On NCCL the broadcasts are issued in group calls of up to ``group_bytes`` (1 GiB by
default; the sender's value travels in ``Begin`` so every rank groups alike): one launch
per group rather than one per tensor.
Otherwise the refit goes on in buckets. A failure while receiving is reported in that
last round, after the remaining broadcasts were received into scratch so every rank
stays in step.

A header is one broadcast of a 16 KiB frame (length + msgpack), plus a second one only
for a longer header. On NCCL the waits spin on the work's completion event rather than
``Work.wait(timeout)``, whose blocking wait sleeps in coarse steps (it halved the
throughput on H200s).

Every wait is bounded by the refit timeout; a failed or timed-out collective marks the
group broken (it is aborted where the backend supports it), and later refits refuse it
until ``init_collective`` is called again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, NoReturn, Protocol, cast

import msgspec
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from genworker.core.refit_plan import Manifest, broadcast_groups, bucket_checksum
from genworker.shell.errors import BadConfigError, RefitError, RefitManifestError, RefitTimeoutError
from genworker.shell.refit.direct import ListingMemo, collect_direct, spec_of
from genworker.shell.refit.packing import (
    DEFAULT_BUCKET_BYTES,
    Laps,
    SendReport,
    as_manifest,
    checked_budget,
    pack,
    stream_buckets,
)
from genworker.shell.refit.wire import (
    PROTOCOL,
    Abort,
    Begin,
    BucketMsg,
    Complete,
    DirectMsg,
    Hello,
    Message,
    Reply,
    bucket_to_wire,
    decode_message,
    encode,
    error_kind,
)

__all__ = [
    "CollectiveGroup",
    "CollectiveReceiver",
    "CollectiveSender",
    "Failure",
    "failure_error",
    "post_payload",
]

_CODES: Final = {"manifest": 1, "error": 2, "timeout": 3}
_KINDS: Final = {v: k for k, v in _CODES.items()}
_MESSAGE_BYTES: Final = 1024
_FRAME_BYTES: Final = 16 << 10
DEFAULT_GROUP_BYTES: Final = 1 << 30
_hello_decoder: Final = msgspec.msgpack.Decoder(Hello)
_reply_decoder: Final = msgspec.msgpack.Decoder(Reply)

Failure = tuple[int, str, str]  # (rank, kind, message)


class _Backend(Protocol):
    """The collectives a gloo or NCCL backend object offers (missing from torch's stubs)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]
    ) -> dist.Work: ...


class _Coalescing(Protocol):
    """A backend that groups collectives (``Backend._start_coalescing``, torch 2.x)."""

    def _start_coalescing(self) -> None: ...

    def _end_coalescing(self) -> dist.Work: ...


def _backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class CollectiveGroup:
    """A weight-update group on its own TCPStore; every wait bounded, failures typed."""

    def __init__(
        self,
        *,
        ip: str,
        port: int,
        rank: int,
        world_size: int,
        train_world_size: int,
        role: str,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        _check_topology(ip, port, rank, world_size, train_world_size, role)
        self.rank = rank
        self.world_size = world_size
        self.train_world_size = train_world_size
        self.device = device
        self.backend = _backend_for(device)
        self.where = f"{ip}:{port}"
        self.broken = False
        self._timeout = timeout_s
        started = time.monotonic()
        try:
            store = TCPStore(
                ip,
                port,
                None,
                rank == 0,
                timeout=dt.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except Exception as e:
            raise RefitTimeoutError(
                f"rank {rank} could not {'host' if rank == 0 else 'reach'} the weight-update "
                f"store at {self.where} within {timeout_s:.1f}s "
                f"({time.monotonic() - started:.1f}s): {e}"
            ) from e
        self._store = store
        self._handshake(role)
        self._pg = self._make_group(PrefixStore("genworker-refit/pg/", store))
        self.round(None, timeout_s, "the group's first status round")

    @property
    def peer(self) -> str:
        return f"the weight-update group at {self.where} (rank {self.rank} of {self.world_size})"

    # -- rendezvous -----------------------------------------------------------------
    def _handshake(self, role: str) -> None:
        mine = Hello(self.rank, self.world_size, self.train_world_size, self.backend, role)
        try:
            verdict = self._exchange_hellos(mine)
        except RefitError:
            raise
        except Exception as e:
            raise RefitTimeoutError(
                f"rank {self.rank} lost the weight-update store at {self.where} during the "
                f"handshake: {e}"
            ) from e
        if not verdict.ok:
            raise RefitError(
                f"the weight-update group at {self.where} is inconsistent: {verdict.message}"
            )

    def _exchange_hellos(self, mine: Hello) -> Reply:
        claims = self._store.add(f"hello/{self.rank}/claims", 1)
        if claims > 1:
            raise RefitError(
                f"rank {self.rank} of the weight-update group at {self.where} is already "
                "taken: two processes computed the same rank (check rank_prefix)"
            )
        self._store.set(f"hello/{self.rank}", encode(mine))  # type: ignore[arg-type]
        if self.rank == 0:
            return self._judge()
        try:
            self._store.wait(["verdict"], dt.timedelta(seconds=self._timeout))
        except Exception as e:
            raise RefitTimeoutError(
                f"rank {self.rank} waited {self._timeout:.1f}s for the trainer's verdict on "
                f"the weight-update group at {self.where}: {e}"
            ) from e
        verdict = _reply_decoder.decode(self._store.get("verdict"))
        self._store.add("verdict/read", 1)
        return verdict

    def _judge(self) -> Reply:
        keys = [f"hello/{r}" for r in range(self.world_size)]
        try:
            self._store.wait(keys, dt.timedelta(seconds=self._timeout))
        except Exception as e:
            absent = [r for r, k in enumerate(keys) if not self._store.check([k])]
            message = f"ranks {absent} never joined within {self._timeout:.1f}s"
            self._publish(
                Reply(ok=False, kind="timeout", message=message), len(keys) - 1 - len(absent)
            )
            raise RefitTimeoutError(f"the weight-update group at {self.where}: {message}") from e
        problems = []
        for r, key in enumerate(keys):
            hello = _hello_decoder.decode(self._store.get(key))
            expected = "trainer" if r < self.train_world_size else "engine"
            for field, want, got in (
                ("world_size", self.world_size, hello.world_size),
                ("train_world_size", self.train_world_size, hello.train_world_size),
                ("backend", self.backend, hello.backend),
                ("protocol", PROTOCOL, hello.protocol),
                ("role", expected, hello.role),
            ):
                if want != got:
                    problems.append(f"rank {r} has {field}={got!r}, expected {want!r}")
        verdict = Reply(ok=not problems, kind="error", message="; ".join(problems))
        self._publish(verdict, len(keys) - 1)
        return verdict

    def _publish(self, verdict: Reply, readers: int) -> None:
        """Set the verdict; when it is a refusal, keep the store up until it was read."""
        self._store.set("verdict", encode(verdict))  # type: ignore[arg-type]
        if verdict.ok:
            return  # everyone goes on to build the group; the store stays up
        deadline = time.monotonic() + min(self._timeout, 5.0)
        while self._store.add("verdict/read", 0) < readers and time.monotonic() < deadline:
            time.sleep(0.01)

    def _make_group(self, store: Store) -> _Backend:
        timeout = dt.timedelta(seconds=self._timeout)
        if self.backend == "gloo":
            return cast(_Backend, ProcessGroupGloo(store, self.rank, self.world_size, timeout))
        nccl = dist.ProcessGroupNCCL
        options = nccl.Options()
        options._timeout = timeout
        return cast(_Backend, nccl(store, self.rank, self.world_size, options))

    # -- collectives ----------------------------------------------------------------
    def _usable(self) -> None:
        if self.broken:
            raise RefitError(
                f"{self.peer} is unusable after a failed collective; call init_collective again"
            )

    def wait(self, work: dist.Work, what: str, timeout_s: float) -> None:
        started = time.monotonic()
        try:
            if self.backend == "gloo":
                work.wait(dt.timedelta(seconds=timeout_s))
            else:
                _poll(work, started + timeout_s)
        except Exception as e:
            self._break()
            raise RefitTimeoutError(
                f"{what} on {self.peer} failed after {time.monotonic() - started:.1f}s "
                f"(bound {timeout_s:.1f}s): {e}"
            ) from e

    def broadcast(self, tensor: torch.Tensor, what: str, timeout_s: float) -> None:
        self.wait(self.broadcast_async(tensor), what, timeout_s)

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        self._usable()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self._pg.broadcast([tensor], options)

    def broadcast_bytes(self, data: bytes | None, what: str, timeout_s: float) -> bytes:
        """Rank 0's ``data`` on every rank (other ranks pass ``None``): one broadcast of
        a fixed-size frame (8-byte length, then the bytes), a second one for the rest of
        a message longer than the frame."""
        root = data is not None and self.rank == 0
        frame = torch.zeros(_FRAME_BYTES, dtype=torch.uint8)
        if root:
            assert data is not None
            head = len(data).to_bytes(8, "little") + data[: _FRAME_BYTES - 8]
            frame[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        frame = frame.to(self.device)
        self.broadcast(frame, what, timeout_s)
        if root:
            assert data is not None
            rest_len = max(len(data) - (_FRAME_BYTES - 8), 0)
            if rest_len:
                rest = torch.frombuffer(bytearray(data[_FRAME_BYTES - 8 :]), dtype=torch.uint8)
                self.broadcast(rest.to(self.device), what, timeout_s)
            return data
        host = frame.cpu().numpy().tobytes()
        length = int.from_bytes(host[:8], "little")
        body = host[8 : 8 + min(length, _FRAME_BYTES - 8)]
        if length > _FRAME_BYTES - 8:
            rest = torch.empty(length - (_FRAME_BYTES - 8), dtype=torch.uint8, device=self.device)
            self.broadcast(rest, what, timeout_s)
            body += rest.cpu().numpy().tobytes()
        return body

    def round(self, problem: RefitError | None, timeout_s: float, what: str) -> list[Failure]:
        """Every rank reports ok or its error; everyone learns who failed and why."""
        return self._status(problem, None, timeout_s, what)[0]

    def vote(
        self, problem: RefitError | None, yes: bool, timeout_s: float, what: str
    ) -> tuple[list[Failure], bool]:
        """A status round that also asks every rank a question: the failures, and
        whether every rank answered yes."""
        return self._status(problem, yes, timeout_s, what)

    def _status(
        self, problem: RefitError | None, yes: bool | None, timeout_s: float, what: str
    ) -> tuple[list[Failure], bool]:
        self._usable()
        n = self.world_size
        flags = torch.zeros(n * (1 if yes is None else 2), dtype=torch.int32, device=self.device)
        if problem is not None:
            flags[self.rank] = _CODES[error_kind(problem)]
        if yes:
            flags[n + self.rank] = 1
        self.wait(self._pg.allreduce([flags]), f"the status round after {what}", timeout_s)
        everything = flags.cpu().tolist()
        codes, unanimous = everything[:n], yes is not None and all(everything[n:])
        if not any(codes):
            return [], unanimous
        text = (str(problem) if problem is not None else "").encode()[:_MESSAGE_BYTES]
        mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        if text:
            mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        outs = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.wait(self._pg.allgather([outs], [mine]), f"the error report after {what}", timeout_s)
        failures = [
            (r, _KINDS.get(code, "error"), _text(outs[r])) for r, code in enumerate(codes) if code
        ]
        return failures, False

    @property
    def coalescing(self) -> bool:
        """Whether the backend issues several collectives as one group call (NCCL)."""
        return bool(getattr(self._pg, "supports_coalescing", False))

    def receive_direct(
        self,
        buffers: Sequence[torch.Tensor | None],
        nbytes: Sequence[int],
        timeout_s: float,
        group_bytes: int = 0,
    ) -> RefitError | None:
        """Broadcast (or receive) each buffer in order, straight: a ``None`` buffer, or one
        that cannot be viewed as bytes, travels through scratch and is reported.

        With ``group_bytes`` and a backend that coalesces, the broadcasts go in group
        calls (:func:`~genworker.core.refit_plan.broadcast_groups`: one NCCL launch per
        group instead of one per tensor); every rank must pass the same value."""
        self._usable()
        deadline = time.monotonic() + timeout_s
        problem: RefitError | None = None
        raws: list[torch.Tensor] = []
        for buffer, size in zip(buffers, nbytes, strict=True):
            if size == 0:  # in no group (broadcast_groups skips it)
                raws.append(torch.empty(0, dtype=torch.uint8))
                continue
            try:
                assert buffer is not None, "no target"
                raw = buffer.view(-1).view(torch.uint8)
            except Exception as e:  # noqa: BLE001 - reported in the last status round
                problem = problem or RefitError(f"a direct tensor has no usable buffer: {e}")
                raw = torch.empty(size, dtype=torch.uint8, device=self.device)
            raws.append(raw)
        limit = group_bytes if self.coalescing else 0
        works = [
            self._broadcast_group([raws[i] for i in group])
            for group in broadcast_groups(nbytes, limit)
        ]
        for i, work in enumerate(works):
            remaining = max(deadline - time.monotonic(), 1e-3)
            self.wait(work, f"direct broadcast {i + 1} of {len(works)}", remaining)
        return problem

    def _broadcast_group(self, tensors: Sequence[torch.Tensor]) -> dist.Work:
        """One broadcast, or several issued as one group call (one work for all)."""
        if len(tensors) == 1:
            return self.broadcast_async(tensors[0])
        options = dist.BroadcastOptions()
        options.rootRank = 0
        backend = cast(_Coalescing, self._pg)
        backend._start_coalescing()
        try:
            for tensor in tensors:
                self._pg.broadcast([tensor], options)
        finally:
            work = backend._end_coalescing()
        return work

    def _break(self) -> None:
        self.broken = True
        abort = getattr(self._pg, "abort", None)
        if abort is not None:
            with contextlib.suppress(RuntimeError):
                abort()

    def close(self) -> None:
        """Tear the group down without waiting for the peers (NCCL's graceful shutdown
        would block until every rank shut down too)."""
        self.broken = True
        name = "shutdown" if self.backend == "gloo" else "abort"
        teardown = getattr(self._pg, name, None)
        if teardown is not None:
            with contextlib.suppress(RuntimeError):
                teardown()


def _poll(work: dist.Work, deadline: float) -> None:
    """Wait for NCCL work without its blocking wait, which sleeps in coarse steps: spin
    on the completion event, then order the current stream after it."""
    spins = 0
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError("the collective did not complete in time")
        spins += 1
        time.sleep(0 if spins < 2000 else 1e-4)
    work.wait()


def _text(message: torch.Tensor) -> str:
    return message.cpu().numpy().tobytes().rstrip(b"\0").decode(errors="replace")


def _check_topology(
    ip: str, port: int, rank: int, world_size: int, train_world_size: int, role: str
) -> None:
    problems = []
    if not ip:
        problems.append("ip is empty")
    if not 0 < port < 65536:
        problems.append(f"port {port} is not in 1..65535")
    if world_size < 2:
        problems.append(f"world_size {world_size} leaves no one to send to")
    if not 1 <= train_world_size < world_size:
        problems.append(f"train_world_size {train_world_size} must be in 1..{world_size - 1}")
    if not 0 <= rank < world_size:
        problems.append(f"rank {rank} is outside 0..{world_size - 1}")
    elif (role == "trainer") != (rank < train_world_size):
        problems.append(
            f"rank {rank} would be a {'trainer' if rank < train_world_size else 'engine'} "
            f"rank, but this process is the {role}"
        )
    if problems:
        raise BadConfigError("invalid weight-update group: " + "; ".join(problems))


def failure_error(failures: list[Failure], what: str) -> RefitError:
    """One typed error for the ranks that failed a status round."""
    text = "; ".join(f"rank {r}: {message}" for r, _, message in failures)
    kinds = {kind for _, kind, _ in failures}
    cls: type[RefitError] = (
        RefitManifestError
        if kinds == {"manifest"}
        else RefitTimeoutError
        if "timeout" in kinds
        else RefitError
    )
    return cls(f"the weight-update group failed {what}: {text}")


class CollectiveReceiver:
    """An engine worker's view of the group, as a :class:`ReceiveSession` transport.

    It reads one message ahead: once a bucket's payload arrived it takes the next header
    and posts that payload's receive into the other buffer, so the transfer of bucket
    *k+1* overlaps the storing of bucket *k*. A header the manifest refuses is still
    received (its size is in the header) and refused in the bucket's status round.
    """

    def __init__(self, group: CollectiveGroup) -> None:
        self._group = group
        self._buffers: dict[int, torch.Tensor] = {}
        self._current: Message | None = None
        self._ahead: Message | None = None
        self._inflight: tuple[BucketMsg, dist.Work | None, torch.Tensor] | None = None
        self._group_bytes = 0

    @property
    def peer(self) -> str:
        return f"trainer rank 0 of {self._group.peer}"

    @property
    def _what(self) -> str:
        msg = self._current
        return f"bucket {msg.index}" if isinstance(msg, BucketMsg) else type(msg).__name__

    def next_message(self, timeout_s: float) -> Message:
        msg, self._ahead = self._ahead, None
        self._current = msg if msg is not None else self._receive_header(timeout_s)
        return self._current

    def _receive_header(self, timeout_s: float) -> Message:
        msg = decode_message(self._group.broadcast_bytes(None, "the next message", timeout_s))
        if isinstance(msg, BucketMsg):
            self._inflight = post_payload(self._group, self._buffers, msg)
        return msg

    def precheck(self, problem: RefitError | None, timeout_s: float) -> None:
        msg = self._current
        if isinstance(msg, BucketMsg):
            if problem is None:
                return  # the verdict comes with the bucket's answer
            self.payload(msg, timeout_s)  # the sender broadcast it regardless
        self._settle(problem, timeout_s)

    def answer(self, problem: RefitError | None, timeout_s: float) -> None:
        self._settle(problem, timeout_s)

    def _settle(self, problem: RefitError | None, timeout_s: float) -> None:
        if problem is not None and self._group.broken:
            raise problem  # the group failed under us (a lost peer): no one to tell
        failures = self._group.round(problem, timeout_s, self._what)
        if problem is not None:
            raise problem
        if failures:
            raise failure_error(failures, self._what)

    def acknowledge_abort(self, timeout_s: float) -> None:
        return None

    def answer_begin(
        self,
        problem: RefitError | None,
        targets: Mapping[str, torch.Tensor] | None,
        timeout_s: float,
    ) -> bool:
        begin = self._current
        assert isinstance(begin, Begin)
        assert begin.direct is not None
        if problem is not None and self._group.broken:
            raise problem
        failures, agreed = self._group.vote(problem, targets is not None, timeout_s, "Begin")
        if problem is not None:
            raise problem
        if failures:
            raise failure_error(failures, "Begin")
        if agreed:
            self._ahead = DirectMsg(begin.refit_id, begin.direct)
            self._group_bytes = begin.group_bytes
        return agreed

    def fill_direct(
        self, msg: DirectMsg, targets: Mapping[str, torch.Tensor], timeout_s: float
    ) -> str:
        specs = [spec_of(ref) for ref in msg.tensors]
        buffers = [targets.get(s.name) for s in specs]
        problem = self._group.receive_direct(
            buffers, [s.nbytes for s in specs], timeout_s, self._group_bytes
        )
        if problem is not None:
            raise problem
        return "direct-receive"

    def payload(self, msg: BucketMsg, timeout_s: float) -> torch.Tensor:
        inflight, self._inflight = self._inflight, None
        if inflight is None or inflight[0] is not msg:
            raise RefitError(f"bucket {msg.index}'s payload was never posted (a protocol bug)")
        _, work, view = inflight
        if work is not None:
            self._group.wait(work, f"the payload of bucket {msg.index}", timeout_s)
        self._ahead = self._receive_header(timeout_s)
        return view

    def release(self) -> None:
        # A failed refit can leave the next message read ahead and its payload posted:
        # drop the one, let the other land, so the next refit starts in step.
        self._ahead = self._current = None
        inflight, self._inflight = self._inflight, None
        if inflight is not None and inflight[1] is not None and not self._group.broken:
            with contextlib.suppress(RefitError):
                self._group.wait(inflight[1], "a dropped payload", 10.0)
        # Host buffers stay for the next refit (fresh pages cost a fault each); device
        # memory goes back to the caching allocator, which hands it out again cheaply.
        if self._group.device.type != "cpu":
            self._buffers.clear()


def post_payload(
    group: CollectiveGroup, buffers: dict[int, torch.Tensor], msg: BucketMsg
) -> tuple[BucketMsg, dist.Work | None, torch.Tensor]:
    """Post the receive of a bucket's bytes into one of two alternating buffers."""
    buffer = buffers.get(msg.buffer)
    if buffer is None or buffer.numel() < msg.used_bytes:
        buffer = torch.empty(msg.used_bytes, dtype=torch.uint8, device=group.device)
        buffers[msg.buffer] = buffer
    view = buffer[: msg.used_bytes]
    work = group.broadcast_async(view) if msg.used_bytes else None
    return msg, work, view


class CollectiveSender:
    """A trainer rank's end of the group: rank 0 broadcasts, other trainer ranks join.

    Every trainer rank calls :meth:`send` with the same tensors (an FSDP trainer gathers
    them collectively anyway); rank 0's data is what the engines receive. Construction
    blocks until every rank of the group joined (start the engines' ``init_collective``
    concurrently). ``group_bytes``: a direct refit's broadcasts go in NCCL group calls of
    at most this many bytes (0: one call per tensor; gloo always calls per tensor).
    """

    def __init__(
        self,
        ip: str,
        port: int,
        world_size: int,
        *,
        rank: int = 0,
        train_world_size: int = 1,
        device: torch.device | str = "cpu",
        manifest: Manifest | object | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
        checksum: bool = False,
        direct: bool = True,
        group_bytes: int = DEFAULT_GROUP_BYTES,
    ) -> None:
        if timeout_s <= 0:
            raise BadConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        if isinstance(group_bytes, bool) or not isinstance(group_bytes, int) or group_bytes < 0:
            raise BadConfigError(f"group_bytes must be an int >= 0, got {group_bytes!r}")
        self.direct = direct
        self._listing = ListingMemo()
        self.group_bytes = group_bytes
        self._checksum = checksum
        self._manifest = as_manifest(manifest)
        self._budget = checked_budget(bucket_bytes)
        self._timeout = timeout_s
        self._device = torch.device(device)
        self._group = CollectiveGroup(
            ip=ip,
            port=port,
            rank=rank,
            world_size=world_size,
            train_world_size=train_world_size,
            role="trainer",
            device=self._device,
            timeout_s=timeout_s,
        )
        self._root = rank == 0
        self._seq = 0
        self._buffers: dict[int, torch.Tensor] = {}
        self._inflight: dist.Work | None = None  # a payload broadcast not yet waited for
        self._laps = Laps()

    @property
    def group(self) -> CollectiveGroup:
        return self._group

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendReport:
        """Broadcast one refit to every engine rank; raises a typed error on any failure."""
        self._seq += 1
        refit_id = f"c{self._seq}"
        started = time.monotonic()
        digest = self._manifest.digest() if self._manifest is not None else ""
        self._drain()
        items: list[tuple[str, torch.Tensor]] | None = None
        listing = None
        failure: RefitError | None = None
        self._laps = Laps()
        if self.direct:
            items, listing, error = collect_direct(named_tensors, self._listing)
            failure = None if error is None else _local_error(error)
            named_tensors = items
        self._laps.lap("collect")
        group = self.group_bytes if self._group.coalescing else 0
        self._emit(Begin(refit_id, digest, direct=listing, group_bytes=group), None)
        if listing is not None and items is not None:
            failures, agreed = self._group.vote(None, True, self._timeout, "the start of the refit")
            self._laps.lap("begin")
            if failures:
                raise failure_error(failures, "the start of the refit")
            if agreed:
                return self._send_direct(items, group, started)
        else:
            self._round(None, "the start of the refit")
        if failure is not None:
            self._abort(refit_id, failure, None)
        pending: int | None = None  # the bucket whose status round is still due
        tensors = nbytes = buckets = 0
        source = stream_buckets(named_tensors, self._budget)
        while True:
            local: RefitError | None = None
            item = None
            try:
                item = next(source, None)
                if item is not None:
                    bucket, chunk = item
                    buffer = self._staging(bucket.buffer, bucket.used_bytes)
                    # no host sync: the collective's stream waits for this one
                    pack(bucket, chunk, buffer)
            except Exception as e:  # noqa: BLE001 - our own failure; the peers are told
                local = _local_error(e)
            if self._inflight is not None:
                work, self._inflight = self._inflight, None
                self._group.wait(work, f"the payload of bucket {pending}", self._timeout)
            if local is not None:
                self._abort(refit_id, local, pending)
            if item is None:
                break
            checksum = (
                bucket_checksum(buffer[: bucket.used_bytes].cpu().numpy().data)
                if self._checksum
                else None
            )
            self._emit(bucket_to_wire(bucket, refit_id, checksum=checksum), pending)
            if bucket.used_bytes:
                self._inflight = self._group.broadcast_async(buffer[: bucket.used_bytes])
            if pending is not None:
                self._round(None, f"bucket {pending}")
            pending = bucket.index
            tensors += len(bucket.slots)
            nbytes += bucket.payload_bytes
            buckets += 1
        self._emit(Complete(refit_id, buckets, tensors), pending)
        if pending is not None:
            self._round(None, f"bucket {pending}")
        self._round(None, "the end of the refit")
        self._round(None, "post-load processing")
        return SendReport(tensors, nbytes, buckets, time.monotonic() - started)

    def _send_direct(
        self, items: Sequence[tuple[str, torch.Tensor]], group: int, started: float
    ) -> SendReport:
        problem: RefitError | None = None
        buffers: list[torch.Tensor | None] = []
        for _, tensor in items:
            try:
                buffers.append(
                    tensor.to(self._device).contiguous()
                    if self._root
                    else torch.empty(tensor.shape, dtype=tensor.dtype, device=self._device)
                )
            except Exception as e:  # noqa: BLE001 - reported in the last status round
                problem = problem or _local_error(e)
                buffers.append(None)
        sizes = [t.numel() * t.element_size() for _, t in items]
        self._laps.lap("prepare")
        problem = self._group.receive_direct(buffers, sizes, self._timeout, group) or problem
        self._laps.lap("broadcast")
        buffers.clear()
        self._round(problem, "the end of the refit")
        self._laps.lap("round")
        return SendReport(
            len(items),
            sum(sizes),
            0,
            time.monotonic() - started,
            "direct-receive",
            self._laps.seconds,
        )

    def close(self) -> None:
        self._buffers.clear()
        self._group.close()

    def __enter__(self) -> CollectiveSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drain(self) -> None:
        """Let a payload a failed refit left on the wire land before packing over it."""
        work, self._inflight = self._inflight, None
        if work is not None and not self._group.broken:
            with contextlib.suppress(RefitError):
                self._group.wait(work, "a dropped payload", self._timeout)

    def _staging(self, index: int, used_bytes: int) -> torch.Tensor:
        if used_bytes > self._budget:
            return torch.empty(used_bytes, dtype=torch.uint8, device=self._device)
        buffer = self._buffers.get(index)
        if buffer is None:
            buffer = torch.empty(self._budget, dtype=torch.uint8, device=self._device)
            self._buffers[index] = buffer
        return buffer

    def _emit(self, msg: Message, pending: int | None) -> None:
        """Broadcast ``msg`` from rank 0. Another trainer rank receives rank 0's message
        instead; when it differs from its own it reports that and raises (:meth:`_follow`)."""
        data = encode(msg)
        what = type(msg).__name__
        got = self._group.broadcast_bytes(data if self._root else None, what, self._timeout)
        if self._root or got == data:
            return
        theirs = decode_message(got)
        problem = RefitError(
            f"trainer rank {self._group.rank} streams differently from rank 0 "
            f"({what}: {msgspec.structs.asdict(msg)} vs {msgspec.structs.asdict(theirs)})"[:900]
        )
        self._follow(problem, pending, theirs)

    def _follow(self, problem: RefitError, pending: int | None, first: Message | None) -> NoReturn:
        """A non-root trainer rank failed: take part in rank 0's messages up to the next
        status round, report ``problem`` there (every rank then raises) and raise it."""
        scratch: dict[int, torch.Tensor] = {}
        msg = first
        while True:
            if msg is None:
                got = self._group.broadcast_bytes(None, "the next message", self._timeout)
                msg = decode_message(got)
            if isinstance(msg, BucketMsg):
                _, work, _ = post_payload(self._group, scratch, msg)
                if work is not None:
                    self._group.wait(work, f"the payload of bucket {msg.index}", self._timeout)
            if isinstance(msg, Abort):
                if pending is not None:
                    self._round(problem, "the abort")
                raise problem
            if pending is not None or isinstance(msg, Complete):
                self._round(problem, type(msg).__name__)
                raise problem
            if isinstance(msg, BucketMsg):
                pending = msg.index
            elif isinstance(msg, Begin):
                if msg.direct is not None:
                    self._group.vote(problem, False, self._timeout, "the start of the refit")
                else:
                    self._round(problem, "the start of the refit")
                raise problem
            msg = None

    def _round(self, problem: RefitError | None, what: str) -> None:
        failures = self._group.round(problem, self._timeout, what)
        if problem is not None:
            raise problem
        if failures:
            raise failure_error(failures, what)

    def _abort(self, refit_id: str, local: RefitError, pending: int | None) -> NoReturn:
        if not self._root:
            self._follow(local, pending, None)
        data = encode(Abort(refit_id, str(local)))
        self._group.broadcast_bytes(data, "the abort", self._timeout)
        if pending is not None:
            self._round(None, f"bucket {pending}")
        raise local


def _local_error(error: Exception) -> RefitError:
    if isinstance(error, RefitError):
        return error
    wrapped = RefitError(f"the trainer's tensor stream failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped
