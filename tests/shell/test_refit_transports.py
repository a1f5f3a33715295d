"""Refit transports end to end, without an engine: IPC (shared memory + ZMQ) and gloo.

Most tests run the receiver and the sender in two threads of this process (fast); the
ones about processes (a round trip across processes, a peer killed mid-refit) spawn the
peer from ``refit_helpers``. Every wait in the code under test is bounded by a short
refit timeout, and every test has a pytest-timeout deadline besides.
"""

from __future__ import annotations

import functools
import os
import random
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Generic, NoReturn, TypeVar

import msgspec
import numpy as np
import pytest
import torch
import zmq
from refit_helpers import (
    FailingSink,
    Outcome,
    next_item,
    random_state_dict,
    run_collective_sender,
    run_dying_engine,
    run_ipc_receiver,
    run_ipc_sender,
    scripted_stream,
    spawn,
    zeros_like_all,
)

from genworker.core import refit_protocol as p
from genworker.core.refit_wire import CpuHandle, CudaHandle, Reply, encode
from genworker.shell.errors import (
    BadConfigError,
    RefitError,
    RefitManifestError,
    RefitTimeoutError,
    RefitTransportError,
)
from genworker.shell.refit import (
    CollectiveReceiver,
    IpcReceiver,
    RefitReport,
    RefitSender,
    fake,
    manifest_of,
    receive,
)
from genworker.shell.refit.engine import EngineContext, nonfinite
from genworker.shell.refit.ipc import SEND_PREFIX, IpcSenderPort
from genworker.shell.refit.memory import (
    Exporter,
    StagingBuffer,
    copy_into,
    open_handle,
    private_directory,
    reclaim_dead,
)
from genworker.shell.refit.receiver import ParameterSink

T = TypeVar("T")
SEED = 7
QUICK = 3.0  # a refit timeout for tests where the peer should answer at once
PROMPT = 2.5  # how fast a side must raise after its peer reported a failure
SMALL = 4096  # a staging budget that makes several chunks and oversized tensors

pytestmark = pytest.mark.timeout(90)


class Peer(threading.Thread, Generic[T]):
    """Runs one side of a refit in a thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], T]) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self.result: T | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test by outcome()
            self.error = e

    def outcome(self, timeout: float = 30.0) -> T:
        self.join(timeout)
        assert not self.is_alive(), "HUNG: the peer did not finish"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def expected() -> dict[str, torch.Tensor]:
    return random_state_dict(SEED)


def assert_received(params: Mapping[str, torch.Tensor]) -> None:
    for name, tensor in expected().items():
        assert torch.equal(params[name], tensor), name


def receiving(
    receiver: IpcReceiver | CollectiveReceiver,
    params: dict[str, torch.Tensor],
    *,
    sink: ParameterSink | None = None,
    loader: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None,
    direct: set[str] | None = None,
    timeout_s: float = QUICK,
) -> Peer[RefitReport]:
    """One refit of ``expected()``'s layout into ``params``, in a thread."""
    chosen = sink or ParameterSink(
        {n: t for n, t in params.items() if direct is None or n in direct}
    )

    def run() -> RefitReport:
        manifest = manifest_of(expected())
        return receive(
            receiver, manifest, chosen, routes=chosen.routes, timeout_s=timeout_s, loader=loader
        )

    return Peer(run)


def ipc_sender(receiver: IpcReceiver, **kwargs: object) -> RefitSender:
    options: dict[str, object] = {"staging_bytes": SMALL, "timeout_s": QUICK}
    return RefitSender.ipc(receiver.address, **{**options, **kwargs})  # type: ignore[arg-type]


@pytest.fixture
def receiver() -> Iterator[IpcReceiver]:
    r = IpcReceiver(torch.device("cpu"))
    yield r
    r.close()


# -- IPC, in threads ------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, 1, (4 << 20) - 1, 4 << 20, (4 << 20) + 3, 9 << 20])
def test_copy_into_copies_every_byte_on_either_side_of_the_split(nbytes: int) -> None:
    """A CPU copy from 4 MiB goes half on the copier thread: every byte arrives, odd sizes
    and the boundary included, and the source is untouched."""
    g = torch.Generator().manual_seed(nbytes)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    before = src.clone()
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    copy_into(dst, src)
    assert torch.equal(dst, src)
    assert torch.equal(src, before)


def test_copy_into_in_a_forked_child_after_the_parent_used_its_copier() -> None:
    """A fork keeps no thread but the caller's: the child gets a copier of its own (the
    parent's would never run its half, and the copy would wait forever)."""
    src = torch.arange(5 << 20, dtype=torch.uint8)  # wraps: every value occurs
    copy_into(torch.empty_like(src), src)  # the parent's copier thread now exists
    pid = os.fork()
    if pid == 0:  # the child (numpy only: torch's OpenMP pool does not survive a fork)
        dst = torch.from_numpy(np.zeros(src.numel(), dtype=np.uint8))
        copy_into(dst, src)
        os._exit(0 if np.array_equal(dst.numpy(), src.numpy()) else 1)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's copy_into hung")


def test_ipc_packs_first_then_sends_and_keeps_the_same_storages(receiver: IpcReceiver) -> None:
    """The first refit packs (the sender has not seen the tensors); the next ones send
    the tensors' own storages (all but the strided and the empty one, however small),
    which the receiver maps once and keeps; a refit of other storages lets them go at its
    end."""
    tensors = expected()
    params = zeros_like_all(tensors)
    with ipc_sender(receiver, manifest=manifest_of(tensors)) as sender:
        reports = []
        for _ in range(3):
            peer = receiving(receiver, params)
            sent = sender.send(tensors.items())
            reports.append((sent, peer.outcome()))
            assert_received(params)
            for t in params.values():
                t.zero_()
        (first, got1), (second, got2), (third, got3) = reports
        assert (first.direct, first.loaded) == (0, len(tensors))
        own = 6  # all but layer.0.proj (strided) and layer.0.empty
        assert second.direct == third.direct == own
        assert got1.direct == got1.tensors == len(tensors)
        assert got1.loaded == 0
        assert got2.mapped >= own  # the trainer's storages, mapped once
        assert got3.mapped == got2.mapped - own  # ... and kept (only temporaries again)
        kept = len(receiver.mappings)
        fresh = {n: t.clone() for n, t in tensors.items()}
        peer = receiving(receiver, params)
        packed = sender.send(fresh.items())
        assert packed.direct == 0  # new storages: packed
        peer.outcome()
        staging = min(2, packed.chunks)  # the two alternating buffers it packed into
        assert kept > own
        assert len(receiver.mappings) == staging  # the old storages were let go
        assert receiver.mappings.settle(failed=True) == staging  # release_refit_buffers
        assert len(receiver.mappings) == 0


def test_ipc_tensors_the_loader_takes_reach_it_in_order_as_copies_of_staging(
    receiver: IpcReceiver,
) -> None:
    params = zeros_like_all(expected())
    got: list[tuple[str, torch.Tensor]] = []
    loaded = {"layer.0.proj", "head.weight", "layer.0.norm"}
    peer = receiving(receiver, params, direct=set(expected()) - loaded, loader=got.extend)
    with ipc_sender(receiver) as sender:
        sender.send(expected().items())
    report = peer.outcome()
    assert [n for n, _ in got] == [n for n in expected() if n in loaded]
    for name, tensor in got:  # the staging buffers were packed again after each chunk
        assert torch.equal(tensor, expected()[name]), name
    assert (report.loaded, report.direct) == (3, len(expected()) - 3)


def test_ipc_loader_failure_reaches_the_sender(receiver: IpcReceiver) -> None:
    def loader(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, _ in weights:
            raise KeyError(f"no such parameter {name}")

    params = zeros_like_all(expected())
    peer = receiving(receiver, params, direct=set(expected()) - {"head.weight"}, loader=loader)
    with (
        ipc_sender(receiver) as sender,
        pytest.raises(RefitError, match=r"no such parameter head\.weight"),
    ):
        sender.send(expected().items())
    with pytest.raises(RefitError, match="loading the received weights failed"):
        peer.outcome()


@pytest.mark.parametrize(
    ("mutate", "named", "attr"),
    [
        ("missing", "head.weight", "missing"),
        ("extra", "surprise.weight", "unexpected"),
        ("shape", "embed.weight", "mismatched"),
        ("dtype", "embed.weight", "mismatched"),
    ],
)
def test_ipc_stream_that_breaks_the_manifest_is_named_on_both_sides(
    receiver: IpcReceiver, mutate: str, named: str, attr: str
) -> None:
    peer = receiving(receiver, zeros_like_all(expected()), timeout_s=30.0)
    with ipc_sender(receiver, timeout_s=30.0) as sender:
        started = time.monotonic()
        with pytest.raises(RefitManifestError, match=named.replace(".", r"\.")) as sent:
            sender.send(scripted_stream(expected(), mutate=mutate))
        assert time.monotonic() - started < PROMPT
    with pytest.raises(RefitManifestError) as received:
        peer.outcome()
    assert receiver.address in str(sent.value)
    detail = received.value.detail
    assert detail is not None
    assert named in getattr(detail, attr)


def test_ipc_refuses_a_sender_with_another_manifest(receiver: IpcReceiver) -> None:
    peer = receiving(receiver, zeros_like_all(expected()))
    other = manifest_of(random_state_dict(SEED, scale=2))
    with (
        ipc_sender(receiver, manifest=other) as sender,
        pytest.raises(RefitError, match="different manifest"),
    ):
        sender.send(expected().items())
    with pytest.raises(RefitError, match="different manifest"):
        peer.outcome()


def test_ipc_receiver_failure_makes_the_sender_raise_promptly(receiver: IpcReceiver) -> None:
    params = zeros_like_all(expected())
    peer = receiving(receiver, params, sink=FailingSink(params, 2), timeout_s=30.0)
    with ipc_sender(receiver, timeout_s=30.0) as sender:
        started = time.monotonic()
        with pytest.raises(RefitError, match="broke while storing"):
            sender.send(expected().items())
        assert time.monotonic() - started < PROMPT
    with pytest.raises(RefitError, match="broke while storing"):
        peer.outcome()


def test_ipc_trainer_stream_failure_aborts_both_sides(receiver: IpcReceiver) -> None:
    peer = receiving(receiver, zeros_like_all(expected()))
    with (
        ipc_sender(receiver) as sender,
        pytest.raises(RefitError, match="stream broke at tensor 3") as sent,
    ):
        sender.send(scripted_stream(expected(), raise_after=3))
    assert isinstance(sent.value.__cause__, ValueError)
    with pytest.raises(RefitError, match="aborted the refit"):
        peer.outcome()


def test_ipc_silent_receiver_times_out_naming_the_wait_then_a_fresh_socket_works(
    receiver: IpcReceiver,
) -> None:
    params = zeros_like_all(expected())
    with ipc_sender(receiver, timeout_s=1.0) as sender:
        started = time.monotonic()
        with pytest.raises(
            RefitTimeoutError, match=r"did not answer the start of the refit within 1s"
        ) as timed:
            sender.send(expected().items())
        assert 0.9 < time.monotonic() - started < 1.0 + PROMPT
        assert receiver.address in str(timed.value)
        # The receiver starts late and first sees the abandoned Begin, then the new one;
        # the second refit runs over a new REQ socket (a reused one would be in EFSM).
        peer = receiving(receiver, params)
        sender.send(expected().items())
        peer.outcome()
    assert_received(params)


def test_ipc_receiver_waiting_for_nobody_times_out_naming_the_wait(receiver: IpcReceiver) -> None:
    started = time.monotonic()
    with pytest.raises(RefitTimeoutError, match=r"within 0\.5s: waited for the start of a refit"):
        receiving(receiver, {}, timeout_s=0.5).outcome()
    assert time.monotonic() - started < 0.5 + PROMPT


def test_ipc_timeout_with_no_trainer_connected_says_none_connected(
    receiver: IpcReceiver,
) -> None:
    """Issue 44 item 7: nobody ever connected, and the message says so."""
    with pytest.raises(RefitTimeoutError) as timed:
        receiving(receiver, {}, timeout_s=0.5).outcome()
    assert f"no trainer connected to {receiver.address} within 0.5s" in str(timed.value)
    assert "sent nothing" not in str(timed.value)
    # One that connected and then went quiet is "the trainer connected to ... sent nothing".
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.connect(receiver.address)
    try:
        with pytest.raises(RefitTimeoutError, match=r"the trainer connected to .* sent nothing"):
            receiving(receiver, {}, timeout_s=1.0).outcome()
    finally:
        sock.close(linger=0)
        ctx.term()
    with pytest.raises(RefitTimeoutError, match=r"no trainer connected .*went away"):
        receiving(receiver, {}, timeout_s=1.0).outcome()


def _dead_pid() -> int:
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(target=int)
    process.start()
    process.join(30)
    assert process.pid is not None
    assert process.exitcode == 0
    return process.pid


def test_a_dead_senders_staging_folder_is_reclaimed_at_the_next_sender_start(
    receiver: IpcReceiver, tmp_path: Path
) -> None:
    """Issue 44 item 8: a killed sender's ``genworker-refit-send-<pid>-*`` folder (its pid
    gone) goes at the next sender's start; a live sender's stays."""
    dead = tmp_path / f"{SEND_PREFIX}{_dead_pid()}-abc"
    live = tmp_path / f"{SEND_PREFIX}{os.getpid()}-live"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "buffer-0").write_bytes(b"x" * 4096)
    params = zeros_like_all(expected())
    peer = receiving(receiver, params)
    with ipc_sender(receiver, staging_dir=str(tmp_path)) as sender:
        sender.send(expected().items())
        peer.outcome()
        assert not dead.exists()
        assert live.exists()
        mine = [f for f in tmp_path.iterdir() if f.name.startswith(f"{SEND_PREFIX}{os.getpid()}-")]
        assert len(mine) == 2  # the live one, and this sender's own, named by its pid
    assert_received(params)
    assert reclaim_dead(SEND_PREFIX, tmp_path) == []  # nothing dead is left


def test_a_chunk_holding_nan_or_inf_is_refused_before_the_loader_sees_it(
    receiver: IpcReceiver,
) -> None:
    """Issue 44 item 1 at the port: the engine's check (EngineContext.check_finite) on
    every chunk; the sender hears the refusal naming the tensor."""
    tensors = expected()
    name = sorted(tensors)[1]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    engine = EngineContext(object())
    loaded: list[str] = []
    params = zeros_like_all(expected())

    def run() -> RefitReport:
        manifest = manifest_of(expected())
        sink = ParameterSink({})
        return receive(
            receiver, manifest, sink, routes=sink.routes, timeout_s=QUICK,
            loader=lambda ws: loaded.extend(n for n, _ in ws), check=engine.check_finite,
        )  # fmt: skip

    peer = Peer(run)
    with ipc_sender(receiver) as sender, pytest.raises(RefitError, match="non-finite"):
        sender.send(tensors.items())
    with pytest.raises(RefitError, match=f"non-finite values .* in {name!r}"):
        peer.outcome()
    assert name not in loaded
    engine.finite_check = False  # the switch: the same chunk passes
    peer = receiving(receiver, params, timeout_s=QUICK)
    with ipc_sender(receiver) as sender:
        sender.send(expected().items())
    peer.outcome()
    assert nonfinite([("a", torch.tensor([1.0, float("inf")])), ("b", torch.ones(2))]) == ["a"]
    assert nonfinite([("i", torch.tensor([1, 2])), ("e", torch.empty(0))]) == []
    huge = torch.full((10,), 3e38)  # finite, but its norm overflows: told apart exactly
    assert nonfinite([("huge", huge), ("b", torch.tensor([float("-inf")]).bfloat16())]) == ["b"]


def test_ipc_paced_stream_slower_than_the_bound_succeeds_chunk_by_chunk(
    receiver: IpcReceiver,
) -> None:
    """A trainer whose stream takes longer than the per-wait bound in total (each tensor
    a third of it) still refits: the sender sends what it has every half bound."""
    params = zeros_like_all(expected())
    peer = receiving(receiver, params, timeout_s=0.6)
    with ipc_sender(receiver, timeout_s=0.6, staging_bytes=1 << 20) as sender:
        started = time.monotonic()
        sent = sender.send(scripted_stream(expected(), delay_s=0.2))
        assert time.monotonic() - started > 1.5 * 0.6
    peer.outcome()
    assert_received(params)
    assert sent.chunks >= 3


def raw_request(address: str, *frames: bytes, wait_s: float = 5.0) -> Reply | None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(list(frames))
        if not sock.poll(int(wait_s * 1000)):
            return None
        return msgspec.msgpack.decode(sock.recv(), type=Reply)
    finally:
        sock.close()
        ctx.term()


def test_ipc_every_request_gets_an_answer_and_strays_never_block_a_refit(
    receiver: IpcReceiver,
) -> None:
    params = zeros_like_all(expected())
    peer = receiving(receiver, params)
    stray = encode(p.End("old", 3, 7))
    reply = raw_request(receiver.address, stray)
    assert reply is not None
    assert not reply.ok
    assert "no refit is in progress" in reply.message
    with ipc_sender(receiver) as sender:  # the receiver kept waiting: a refit goes through
        sender.send(expected().items())
    peer.outcome()
    assert_received(params)
    for frames, says in [
        ((b"\x93not a refit message",), "malformed refit message"),
        ((stray, stray), "one frame, got 2"),
        ((encode(p.Begin("r", "", 1)),), "protocol 1"),
    ]:
        peer = receiving(receiver, params)
        reply = raw_request(receiver.address, *frames)
        assert reply is not None
        assert not reply.ok
        assert says in reply.message
        with pytest.raises(RefitError, match=says):
            peer.outcome()


def test_ipc_messages_beyond_the_manifests_cap_are_dropped_unread(receiver: IpcReceiver) -> None:
    receiver.limit(p.max_message_bytes(manifest_of(expected())))
    params = zeros_like_all(expected())
    peer = receiving(receiver, params)
    assert raw_request(receiver.address, b"\0" * (1 << 20), wait_s=0.5) is None
    with ipc_sender(receiver) as sender:
        sender.send(expected().items())
    peer.outcome()
    assert_received(params)


def test_ipc_refuses_a_storage_it_cannot_trust(receiver: IpcReceiver, tmp_path: Path) -> None:
    peer = receiving(receiver, zeros_like_all(expected()))
    reply = raw_request(receiver.address, encode(p.Begin("r1", "")))
    assert reply is not None
    assert reply.ok
    spec = manifest_of(expected()).specs[0]
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    (open_dir / "buf").write_bytes(bytes(spec.nbytes))
    ref = p.TensorRef(spec.name, spec.shape, spec.dtype, 0, 0)
    chunk = p.Chunk("r1", 0, (ref,), (spec.nbytes,), (p.StorageKind.OWN,))
    handle = CpuHandle(str(open_dir / "buf"), spec.nbytes, 0, f"cpu@{socket.gethostname()}")
    reply = raw_request(receiver.address, encode(chunk, [handle]))
    assert reply is not None
    assert not reply.ok
    assert "open to other users" in reply.message
    with pytest.raises(RefitError, match="open to other users"):
        peer.outcome()


def test_open_handle_checks() -> None:
    host = f"cpu@{socket.gethostname()}"
    private = private_directory("genworker-test-")
    try:
        buffer = StagingBuffer(1024, torch.device("cpu"), private)
        handle = buffer.handle
        assert isinstance(handle, CpuHandle)
        mapped = open_handle(handle, torch.device("cpu"))
        buffer.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert mapped[:4].tolist() == [1, 2, 3, 4]  # both sides see the same memory
        for bad, says in [
            (CpuHandle(handle.path, 1024, handle.inode, "cpu@elsewhere"), "lives on cpu@elsewhere"),
            (CpuHandle(handle.path, 4096, handle.inode, host), "fewer than the 4096 declared"),
            (CpuHandle(handle.path, 1024, handle.inode + 1, host), "another file"),
            (CpuHandle(str(private / "absent"), 1024, 0, host), "could not open"),
        ]:
            with pytest.raises(RefitError, match=says):
                open_handle(bad, torch.device("cpu"))
        link = private / "link"
        link.symlink_to(handle.path)
        with pytest.raises(RefitError, match="could not open"):
            open_handle(CpuHandle(str(link), 1024, handle.inode, host), torch.device("cpu"))
        assert not (private / "absent").exists()  # never created by the receiver
        buffer.close()
    finally:
        import shutil

        shutil.rmtree(private)


def test_the_sender_recognises_a_storage_only_when_the_same_one_comes_back() -> None:
    exporter = Exporter()
    kept = torch.zeros(1 << 16)
    ref, seen = exporter.recognised(kept)
    assert not seen  # never seen before
    exporter.settle(set())
    ref, seen = exporter.recognised(kept[1:])  # a view of the same storage
    assert seen
    handle = exporter.handle(ref, kept)
    assert exporter.handle(ref, kept) is handle  # exported once
    exporter.settle({ref})
    del kept, ref
    fresh = torch.zeros(1 << 16)  # whatever its address, another storage
    assert not exporter.recognised(fresh)[1]


def test_ipc_sockets_and_buffers_live_in_private_directories(receiver: IpcReceiver) -> None:
    sock_dir = Path(receiver.address.removeprefix("ipc://")).parent
    assert stat.S_IMODE(sock_dir.stat().st_mode) == 0o700
    assert sock_dir.name.startswith("genworker-refit-")
    peer = receiving(receiver, zeros_like_all(expected()))
    sender = ipc_sender(receiver)
    sender.send(expected().items())
    peer.outcome()
    port = sender._port
    assert isinstance(port, IpcSenderPort)
    paths = [Path(b.handle.path) for b in port._buffers.values() if isinstance(b.handle, CpuHandle)]
    (staging,) = {path.parent for path in paths}
    assert stat.S_IMODE(staging.stat().st_mode) == 0o700
    for path in paths:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    sender.close()
    receiver.close()
    assert not staging.exists()
    assert not sock_dir.exists()


def test_ipc_tcp_binds_loopback_only_unless_asked() -> None:
    with pytest.raises(BadConfigError, match="not a loopback address"):
        IpcReceiver(torch.device("cpu"), tcp_host="0.0.0.0")
    receiver = IpcReceiver(torch.device("cpu"), tcp_host="127.0.0.1")
    params = zeros_like_all(expected())
    try:
        assert receiver.address.startswith("tcp://127.0.0.1:")
        peer = receiving(receiver, params)
        with ipc_sender(receiver) as sender:
            sender.send(expected().items())
        peer.outcome()
    finally:
        receiver.close()
    assert_received(params)


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf"), "5"])
def test_sender_arguments_are_checked(timeout_s: object) -> None:
    with pytest.raises(BadConfigError, match="ipc://"):
        RefitSender.ipc("/tmp/x.sock")
    with pytest.raises(BadConfigError, match="multiple of 512"):
        RefitSender.ipc("ipc:///tmp/x.sock", staging_bytes=1000)
    with pytest.raises(BadConfigError, match="timeout_s"):
        RefitSender.ipc("ipc:///tmp/x.sock", timeout_s=timeout_s)  # type: ignore[arg-type]
    with pytest.raises(BadConfigError, match="invalid refit manifest"):
        RefitSender.ipc("ipc:///tmp/x.sock", manifest={"w": ([-1], "float32")})
    with pytest.raises(BadConfigError, match="timeout_s"):
        RefitSender.collective("127.0.0.1", free_port(), 2, timeout_s=timeout_s)  # type: ignore[arg-type]


def test_an_interrupted_sender_raises_the_interrupt_and_refits_again(receiver: IpcReceiver) -> None:
    def interrupted() -> Iterator[tuple[str, torch.Tensor]]:
        items = iter(expected().items())
        yield next(items)
        raise KeyboardInterrupt

    params = zeros_like_all(expected())
    with ipc_sender(receiver, timeout_s=1.0) as sender:
        peer = receiving(receiver, params, timeout_s=1.0)
        with pytest.raises(KeyboardInterrupt):
            sender.send(interrupted())
        with pytest.raises(RefitError):  # a timeout, or its staging gone under it
            peer.outcome()
        peer = receiving(receiver, params)
        sender.send(expected().items())
        peer.outcome()
    assert_received(params)


# -- collective (gloo), in threads ------------------------------------------------------


def engine_side(
    port: int,
    *,
    params: dict[str, torch.Tensor] | None = None,
    sink: ParameterSink | None = None,
    refits: int = 1,
    timeout_s: float = QUICK,
    world_size: int = 2,
    train_world_size: int = 1,
    claimed_train_world_size: int | None = None,
) -> Peer[list[RefitReport | BaseException]]:
    def run() -> list[RefitReport | BaseException]:
        group = fake.engine_group(
            port,
            timeout_s=timeout_s,
            rank=train_world_size,
            world_size=world_size,
            train_world_size=claimed_train_world_size or train_world_size,
        )
        out: list[RefitReport | BaseException] = []
        try:
            port_ = CollectiveReceiver(group)
            chosen = sink or ParameterSink(params if params is not None else {})
            for _ in range(refits):
                try:
                    out.append(
                        receive(
                            port_,
                            manifest_of(expected()),
                            chosen,
                            routes=chosen.routes,
                            timeout_s=timeout_s,
                        )
                    )
                except RefitError as e:
                    out.append(e)
            return out
        finally:
            group.close()

    return Peer(run)


def collective_sender(port: int, **kwargs: object) -> RefitSender:
    options: dict[str, object] = {"timeout_s": QUICK, "chunk_bytes": SMALL}
    return RefitSender.collective("127.0.0.1", port, 2, **{**options, **kwargs})  # type: ignore[arg-type]


def test_collective_round_trip_twice_on_one_group() -> None:
    port = free_port()
    params = zeros_like_all(expected())
    peer = engine_side(port, params=params, refits=2)
    with collective_sender(port, manifest=manifest_of(expected())) as sender:
        sent = [sender.send(expected().items()) for _ in range(2)]
    got = peer.outcome()
    assert_received(params)
    for report, s in zip(got, sent, strict=True):
        assert isinstance(report, RefitReport)
        assert (report.tensors, report.nbytes, report.chunks) == (s.tensors, s.nbytes, s.chunks)
    assert sent[0].chunks >= 3


@pytest.mark.parametrize(
    ("mutate", "named"),
    [("missing", "head.weight"), ("extra", "surprise.weight"), ("shape", "embed.weight")],
)
def test_collective_stream_that_breaks_the_manifest_is_named_on_both_sides(
    mutate: str, named: str
) -> None:
    port = free_port()
    peer = engine_side(port, params=zeros_like_all(expected()))
    with (
        collective_sender(port) as sender,
        pytest.raises(RefitManifestError, match=named.replace(".", r"\.")),
    ):
        sender.send(scripted_stream(expected(), mutate=mutate))
    (error,) = peer.outcome()
    assert isinstance(error, RefitManifestError)
    assert named in str(error)


def test_collective_receiver_failure_fails_the_sender_and_the_group_refits_again() -> None:
    port = free_port()
    params = zeros_like_all(expected())
    failing = FailingSink(params, 1)
    peer = engine_side(port, sink=failing, refits=2)
    with collective_sender(port) as sender:
        with pytest.raises(RefitError, match="broke while storing"):
            sender.send(expected().items())
        sender.send(expected().items())  # the sink fails once: this one lands
    first, second = peer.outcome()
    assert isinstance(first, RefitError)
    assert isinstance(second, RefitReport)
    assert_received(params)


def test_collective_trainer_stream_failure_aborts_both_sides() -> None:
    port = free_port()
    peer = engine_side(port, params=zeros_like_all(expected()))
    with (
        collective_sender(port) as sender,
        pytest.raises(RefitError, match="stream broke at tensor 3"),
    ):
        sender.send(scripted_stream(expected(), raise_after=3))
    (error,) = peer.outcome()
    assert isinstance(error, RefitError)
    assert "aborted the refit" in str(error)


def test_collective_handshake_names_the_mismatch() -> None:
    port = free_port()
    # the engine believes the group has 3 ranks; the trainer knows it has 2
    peer = engine_side(port, world_size=3, train_world_size=1)
    started = time.monotonic()
    with pytest.raises(RefitError, match=r"rank 1 has world_size=3, expected 2"):
        RefitSender.collective("127.0.0.1", port, 2, timeout_s=QUICK)
    assert time.monotonic() - started < PROMPT
    with pytest.raises(RefitError, match=r"inconsistent: rank 1 has world_size=3"):
        peer.outcome()


@pytest.mark.parametrize("second", [None, "missing", "raise"])
def test_collective_two_trainer_ranks_feed_one_engine(second: str | None) -> None:
    port = free_port()
    params = zeros_like_all(expected())
    peer = engine_side(port, params=params, world_size=3, train_world_size=2)
    senders: list[RefitSender] = []

    def rank(r: int, faults: dict[str, object]) -> RefitReport:
        sender = RefitSender.collective(
            "127.0.0.1", port, 3, rank=r, train_world_size=2, timeout_s=QUICK, chunk_bytes=SMALL
        )
        senders.append(sender)  # closed once every rank is done (gloo needs its peers)
        return sender.send(scripted_stream(expected(), **faults))  # type: ignore[arg-type]

    faults: dict[str, object] = {}
    if second is not None:
        faults = {"mutate": "missing"} if second == "missing" else {"raise_after": 2}
    other = Peer(lambda: rank(1, faults))
    try:
        if second is None:
            assert rank(0, {}).tensors == len(expected())
            assert other.outcome().tensors == len(expected())
            (report,) = peer.outcome()
            assert isinstance(report, RefitReport)
            assert_received(params)
            return
        says = "not in the manifest" if second == "missing" else "rank 1's tensor stream failed"
        with pytest.raises(RefitError, match="rank 1") as raised:
            rank(0, {})
        assert says in str(raised.value)
        with pytest.raises(RefitError, match=says):
            other.outcome()
        (error,) = peer.outcome()
        assert isinstance(error, RefitError)
        assert says in str(error)
    finally:
        for sender in senders:
            sender.close()


def test_collective_topology_is_checked_before_any_socket() -> None:
    with pytest.raises(BadConfigError, match="rank 2 is outside"):
        RefitSender.collective("127.0.0.1", free_port(), 2, rank=2)
    with pytest.raises(BadConfigError, match="leaves no one"):
        RefitSender.collective("127.0.0.1", free_port(), 1)
    with pytest.raises(BadConfigError, match="engine rank, but this process is the trainer"):
        RefitSender.collective("127.0.0.1", free_port(), 3, rank=1, train_world_size=1)


def test_collective_missing_engine_times_out_naming_it() -> None:
    started = time.monotonic()
    with pytest.raises(RefitTimeoutError, match=r"ranks \[1\] never joined"):
        RefitSender.collective("127.0.0.1", free_port(), 2, timeout_s=1.0)
    assert time.monotonic() - started < 1.0 + PROMPT


def test_an_engine_without_a_trainer_times_out_reaching_the_store() -> None:
    started = time.monotonic()
    with pytest.raises(RefitTimeoutError, match="reaching the weight-update store"):
        fake.engine_group(free_port(), timeout_s=1.0)
    assert time.monotonic() - started < 1.0 + PROMPT


# -- across processes -----------------------------------------------------------------


def outcome(queue: object) -> Outcome:
    kind, value = next_item(queue)
    if kind == "ready":
        kind, value = next_item(queue)
    assert kind == "outcome"
    assert isinstance(value, Outcome)
    return value


def test_ipc_round_trips_across_processes_keep_the_trainers_storages_mapped(
    receiver: IpcReceiver,
) -> None:
    params = zeros_like_all(expected())
    process, queue = spawn(run_ipc_sender, receiver.address, SEED, timeout_s=60.0, refits=3)
    reports = []
    for _ in range(3):
        reports.append(fake.receive_into(receiver, params, timeout_s=60.0))
        assert outcome(queue).ok
        assert_received(params)
    process.join(30)
    assert reports[2].mapped < reports[1].mapped  # the trainer's storages stayed mapped


def test_ipc_sender_killed_mid_refit_receiver_times_out_naming_the_wait(
    receiver: IpcReceiver, tmp_path: Path
) -> None:
    # the killed sender cannot remove its staging directory: keep it in tmp_path
    process, queue = spawn(
        run_ipc_sender,
        receiver.address,
        SEED,
        timeout_s=60.0,
        die_after=4,
        staging_dir=str(tmp_path),
    )
    assert next_item(queue)[0] == "ready"  # torch imported; the refit starts now
    started = time.monotonic()
    with pytest.raises(RefitTimeoutError) as timed:
        fake.receive_into(receiver, zeros_like_all(expected()), timeout_s=3.0)
    assert time.monotonic() - started < 3.0 + PROMPT
    process.join(30)
    assert process.exitcode == 17
    assert "no trainer connected to ipc://" in str(timed.value)  # it died: none now
    assert "within 3s: waited for chunk" in str(timed.value)
    assert "one connected earlier and went away" in str(timed.value)


def test_ipc_receiver_killed_mid_refit_sender_times_out_naming_the_wait(tmp_path: Path) -> None:
    process, queue = spawn(
        run_ipc_receiver, SEED, timeout_s=60.0, die_at=1, directory=str(tmp_path)
    )
    kind, address = next_item(queue)
    assert kind == "address"
    with RefitSender.ipc(str(address), staging_bytes=SMALL, timeout_s=3.0) as sender:
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError, match=r"did not answer chunk \d+ within 3s"):
            sender.send(expected().items())
        assert time.monotonic() - started < 3.0 + PROMPT
    process.join(30)
    assert process.exitcode == 17


def test_collective_round_trip_across_processes() -> None:
    port = free_port()
    params = zeros_like_all(expected())
    process, queue = spawn(run_collective_sender, port, SEED, timeout_s=60.0)
    group = fake.engine_group(port, timeout_s=60.0)
    try:
        fake.receive_into(CollectiveReceiver(group), params, timeout_s=60.0)
    finally:
        group.close()
    assert outcome(queue).ok
    process.join(30)
    assert_received(params)


def test_a_killed_collective_sender_is_a_transport_error_naming_the_wait() -> None:
    """gloo sees the peer's socket close: the receiver says so at once, never calling it
    a timeout; the group is then unusable until init_collective runs again."""
    port = free_port()
    process, _ = spawn(run_collective_sender, port, SEED, timeout_s=60.0, die_after=4)
    group = fake.engine_group(port, timeout_s=60.0)
    try:
        started = time.monotonic()
        with pytest.raises(RefitTransportError, match="broadcasting") as failed:
            fake.receive_into(CollectiveReceiver(group), zeros_like_all(expected()), timeout_s=10.0)
        assert time.monotonic() - started < 10.0
        assert not isinstance(failed.value, RefitTimeoutError)
        with pytest.raises(RefitError, match="unusable after a failed collective"):
            group.settle(None, "a later refit", 1.0)
    finally:
        group.close()
    process.join(30)
    assert process.exitcode == 17


def test_a_killed_collective_receiver_is_a_transport_error_for_the_sender() -> None:
    port = free_port()
    process, _ = spawn(run_dying_engine, port)
    with RefitSender.collective("127.0.0.1", port, 2, timeout_s=60.0, chunk_bytes=SMALL) as sender:
        started = time.monotonic()
        with pytest.raises(RefitTransportError, match="broadcasting") as failed:
            sender.send(expected().items())
        assert time.monotonic() - started < 30.0
    assert not isinstance(failed.value, RefitTimeoutError)
    process.join(30)
    assert process.exitcode == 17


# -- the replay: the last refit's tensors again ----------------------------------------


def count_flushes(
    sender: RefitSender, monkeypatch: pytest.MonkeyPatch
) -> tuple[IpcSenderPort, list[int]]:
    """The IPC ``sender``'s port, and a list that grows by one for each chunk it flushes."""
    port = sender._port
    assert isinstance(port, IpcSenderPort)
    flush = port.flush
    built: list[int] = []

    def counted() -> None:
        built.append(1)
        flush()

    monkeypatch.setattr(port, "flush", counted)
    return port, built


def test_ipc_a_refit_of_the_last_ones_tensors_resends_its_chunks_and_any_change_misses(
    receiver: IpcReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a refit went all by handle, the next one with the same names, specs,
    storages and offsets in the same order sends that refit's chunk listings again (no
    chunk is built) and the engine decides from its memo; new bytes in the same memory
    still arrive; another storage, offset, order or name builds chunks again."""
    n = 16 << 10
    big = torch.zeros(3 * n)
    tensors = {f"w.{i}": torch.full((n,), float(i)) for i in range(3)}
    tensors["w.3"] = big[n : 2 * n]
    params = zeros_like_all(tensors)
    manifest = manifest_of(tensors)
    sink = ParameterSink(params)
    with ipc_sender(receiver, manifest=manifest, staging_bytes=1 << 20) as sender:  # 1 chunk
        port, built = count_flushes(sender, monkeypatch)

        def refit(sent: dict[str, torch.Tensor]) -> tuple[RefitReport, int]:
            built.clear()
            peer = Peer(
                lambda: receive(receiver, manifest, sink, routes=sink.routes, timeout_s=QUICK)
            )
            report = sender.send(sent.items())
            got = peer.outcome()
            assert (got.tensors, got.nbytes, got.direct) == (4, report.nbytes, 4)
            for name, tensor in sent.items():
                assert torch.equal(params[name], tensor), name
                params[name].zero_()
            return report, len(built)

        assert refit(tensors)[1] > 0  # packed
        assert refit(tensors)[1] == 1  # by handle: recorded
        replay = port.replay
        assert replay is not None
        memo = receiver.memo
        tensors["w.1"].fill_(7.0)  # new bytes, same memory
        report, chunks = refit(tensors)
        assert (chunks, report.direct, report.chunks) == (0, 4, 1)
        assert port.replay is replay
        assert receiver.memo.chunks[0][1].writes is memo.chunks[0][1].writes
        changes: list[dict[str, torch.Tensor]] = [
            {**tensors, "w.2": tensors["w.2"].clone()},  # another storage
            {**tensors, "w.3": big[2 * n :]},  # another offset in the same storage
            dict(reversed(tensors.items())),  # another order
        ]
        for changed in changes:
            refit(tensors)
            assert refit(changed)[1] > 0
        refit(tensors)
        assert refit(tensors)[1] == 0  # recorded again
        peer = Peer(lambda: receive(receiver, manifest, sink, routes=sink.routes, timeout_s=QUICK))
        with pytest.raises(RefitError, match=r"w\.x"):  # another name: checked, refused
            sender.send([("w.x" if k == "w.0" else k, t) for k, t in tensors.items()])
        with pytest.raises(RefitError, match=r"w\.x"):
            peer.outcome()
        assert port.replay is None


def test_ipc_a_refit_by_handle_goes_in_chunks_that_double_and_its_replay_sends_them_all(
    receiver: IpcReceiver,
) -> None:
    """Eight tensors of one budget each, by handle: chunks of 1, 2, 4 and 1 tensors (chunk
    ``i`` holds up to ``budget * 2**i``), the same four replayed, the bytes all arriving."""
    tensors = {f"w.{i}": torch.full((SMALL // 4,), float(i)) for i in range(8)}
    params = zeros_like_all(tensors)
    manifest = manifest_of(tensors)
    sink = ParameterSink(params)
    with ipc_sender(receiver, manifest=manifest) as sender:
        for step in range(4):  # packed, by handle (recorded), replayed twice
            for tensor in tensors.values():
                tensor.add_(1.0)
            peer = Peer(
                lambda: receive(receiver, manifest, sink, routes=sink.routes, timeout_s=QUICK)
            )
            report = sender.send(tensors.items())
            got = peer.outcome()
            assert all(torch.equal(params[n], t) for n, t in tensors.items())
            if step:
                assert (report.direct, report.chunks, got.chunks) == (8, 4, 4)


def test_ipc_the_replay_packs_tensors_of_known_storages_that_pack_for_good_again(
    receiver: IpcReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trainer tensors in separate allocations, some not contiguous (packed every refit)
    and some tiny (by handle like the large ones, once recognised): once recorded, a
    refit of the same tensors builds no chunk, packs the strided ones into the same
    staging buffers at the same offsets (their new bytes arrive) and sends the others by
    handle; over several staged chunks (a small staging budget), a change midway builds
    the rest anew, and every byte still arrives."""
    n = 16 << 10
    tensors = {f"big.{i}": torch.full((n,), float(i)) for i in range(3)}
    tensors["tiny"] = torch.full((3,), 5.0)  # 12 B: by handle all the same
    for i in range(8):  # 1200 B each, strided
        tensors[f"small.{i}"] = torch.full((300, 2), float(i))[:, 0]
    params = zeros_like_all(tensors)
    manifest = manifest_of(tensors)
    sink = ParameterSink(params)
    with ipc_sender(receiver, manifest=manifest, staging_bytes=SMALL) as sender:
        port, built = count_flushes(sender, monkeypatch)

        def refit(sent: dict[str, torch.Tensor]) -> tuple[RefitReport, int]:
            built.clear()
            peer = Peer(
                lambda: receive(receiver, manifest, sink, routes=sink.routes, timeout_s=QUICK)
            )
            report = sender.send(sent.items())
            got = peer.outcome()
            assert (got.tensors, got.nbytes) == (len(sent), report.nbytes)
            for name, tensor in sent.items():
                assert torch.equal(params[name], tensor), name
                params[name].zero_()
            return report, len(built)

        refit(tensors)  # packed: the sender has not seen the storages
        report, chunks = refit(tensors)  # recorded
        assert (chunks > 1, report.direct) == (True, 4)
        assert port.replay is not None
        for i, t in enumerate(tensors.values()):
            t.fill_(10.0 + i)  # new bytes, same memory
        report, chunks = refit(tensors)
        assert (chunks, report.direct, report.loaded) == (0, 4, 8)
        assert port.replay is not None
        changed = {**tensors, "small.6": tensors["small.6"].clone()}  # a late chunk differs
        assert refit(changed)[1] > 0  # partly replayed: not recorded
        assert refit(changed)[1] > 0  # built whole: recorded
        assert refit(changed)[1] == 0


# -- a runtime without CUDA IPC (R8), and threads sharing a sender (R10) -------------------

_CUDA_TAIL = "\nCUDA kernel errors might be asynchronously reported at some other API call.\n"


@pytest.mark.parametrize(
    ("raised", "advice"),
    [
        ("CUDA error: invalid resource handle" + _CUDA_TAIL, "refused the trainer's handle"),
        ("pidfd_getfd: Operation not permitted", "expandable segments"),
        ("CUDA error: out of memory" + _CUDA_TAIL, None),
    ],
)
def test_opening_a_cuda_handle_says_when_the_runtime_has_no_cuda_ipc(
    monkeypatch: pytest.MonkeyPatch, raised: str, advice: str | None
) -> None:
    """The one place the engine maps a trainer's CUDA storage: torch's own error, chained
    and quoted, then (only for a runtime without CUDA IPC) the cause and what to change.
    This CPU build has no CUDA: torch's rebuild is faked, the rest is the real code."""
    calls: list[tuple[object, ...]] = []

    def rebuild(*args: object) -> NoReturn:
        calls.append(args)
        raise RuntimeError(raised)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", rebuild)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    host = f"cpu@{socket.gethostname()}"  # the engine's own device: the check passes
    handle = CudaHandle(host, b"ipc-handle", 4096, 512, b"ref-counter", 64, b"", True)
    with pytest.raises(RefitError) as failed:
        open_handle(handle, torch.device("cpu"))
    # _share_cuda_()'s fields in _new_shared_cuda's order, on the engine's device index
    assert calls == [(0, b"ipc-handle", 4096, 512, b"ref-counter", 64, None, True)]
    message = str(failed.value)
    quoted = raised.strip()  # torch's text ends in a newline
    assert message.startswith(f"could not open a CUDA IPC refit storage on {host}: {quoted}")
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert str(failed.value.__cause__) == raised
    if advice is None:
        assert "CUDA IPC is unavailable" not in message
        return
    assert advice in message
    for fix in ("CUDA IPC is unavailable in this runtime", "--ipc=host", "CAP_SYS_PTRACE",
                "pidfd_open and pidfd_getfd", "drop expandable_segments", "WSL2",
                "RefitSender.collective"):  # fmt: skip
        assert fix in message, fix


def test_ipc_a_runtime_without_cuda_ipc_fails_both_sides_naming_the_fix_then_refits_again(
    receiver: IpcReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R8 end to end: the trainer's second refit sends its own storages by handle, here as
    CUDA IPC handles that the engine's torch cannot open (a container without --ipc=host:
    "invalid resource handle"). The trainer gets a typed RefitError with torch's text, the
    cause and the fix; the engine raises the same, chained to torch's error, and keeps
    nothing mapped; the next refit lands.

    No CUDA here: the trainer's export (``Exporter.handle``) makes the CUDA handles and
    torch's ``_new_shared_cuda`` raises as it would; the wire, the receiver, the engine's
    ``open_handle``, the answer and the sender's error are the real ones."""
    tensors = expected()
    params = zeros_like_all(tensors)
    host = f"cpu@{socket.gethostname()}"
    opened: list[bytes] = []

    def export(self: Exporter, ref: object, tensor: torch.Tensor) -> CudaHandle:
        storage = tensor.untyped_storage()
        name = b"ipc-%d" % storage.data_ptr()
        return CudaHandle(host, name, storage.nbytes(), 0, b"ref-counter", 0, b"", False)

    def rebuild(index: int, handle: bytes, *rest: object) -> NoReturn:
        opened.append(handle)
        raise RuntimeError("CUDA error: invalid resource handle" + _CUDA_TAIL)

    with ipc_sender(receiver, manifest=manifest_of(tensors)) as sender:
        peer = receiving(receiver, params)
        assert sender.send(tensors.items()).direct == 0  # the first refit packs
        peer.outcome()
        with monkeypatch.context() as patched:
            patched.setattr(Exporter, "handle", export)
            patched.setattr(torch.UntypedStorage, "_new_shared_cuda", rebuild)
            patched.setattr(torch.cuda, "current_device", lambda: 0)
            for t in params.values():
                t.zero_()
            peer = receiving(receiver, params)
            started = time.monotonic()
            with pytest.raises(RefitError) as sent:
                sender.send(tensors.items())
            assert time.monotonic() - started < PROMPT
            with pytest.raises(RefitError) as received:
                peer.outcome()
        assert len(opened) == 1  # the first storage by handle: the refit ends there
        assert isinstance(received.value.__cause__, RuntimeError)
        for error in (sent.value, received.value):
            message = str(error)
            assert "could not open a CUDA IPC refit storage" in message
            assert "CUDA error: invalid resource handle" in message  # torch's words
            assert "CUDA IPC is unavailable in this runtime" in message
            assert "refused the trainer's handle" in message
            assert "--ipc=host" in message
            assert "RefitSender.collective" in message
        assert receiver.address in str(sent.value)
        assert not any(isinstance(h, CudaHandle) for h in receiver.mappings._maps)
        peer = receiving(receiver, params)  # real handles again: the worker refits
        report = sender.send(tensors.items())
        peer.outcome()
    assert report.direct > 0
    assert_received(params)


def held_stream(
    tensors: Mapping[str, torch.Tensor], inside: threading.Event, gate: threading.Event
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors``, pausing after the third until ``gate`` opens (``inside`` says so)."""
    for i, item in enumerate(tensors.items()):
        if i == 3:
            inside.set()
            assert gate.wait(30), "the gate never opened"
        yield item


@pytest.mark.parametrize("transport", ["ipc", "collective"])
def test_a_send_or_close_while_another_thread_sends_fails_at_once_and_that_send_lands(
    receiver: IpcReceiver, transport: str
) -> None:
    """R10: a second caller never waits and never touches the socket or group in use;
    the refit in flight lands whole, and the sender serves the next one."""
    params = zeros_like_all(expected())
    engine: Callable[[], list[RefitReport] | list[RefitReport | BaseException]]
    if transport == "ipc":
        engine = Peer(
            lambda: [fake.receive_into(receiver, params, timeout_s=30.0) for _ in range(2)]
        ).outcome
        sender = ipc_sender(receiver, timeout_s=30.0)
    else:
        port = free_port()
        engine = engine_side(port, params=params, refits=2, timeout_s=30.0).outcome
        sender = collective_sender(port, timeout_s=30.0)
    inside, gate = threading.Event(), threading.Event()
    refusals: list[tuple[Callable[[], object], str]] = [
        (lambda: sender.send(expected().items()), "cannot send a refit"),
        (sender.close, "cannot close the sender"),
    ]
    try:
        first = Peer(lambda: sender.send(held_stream(expected(), inside, gate)))
        assert inside.wait(30)
        for attempt, says in refusals:
            started = time.monotonic()
            with pytest.raises(RefitError, match=says) as refused:
                attempt()
            assert time.monotonic() - started < 0.5  # at once: nothing waited
            assert "another thread is sending a refit on this sender" in str(refused.value)
        gate.set()
        assert first.outcome().tensors == len(expected())
        assert sender.send(expected().items()).tensors == len(expected())  # still serves
        reports = engine()
    finally:
        gate.set()
        sender.close()
    assert len(reports) == 2  # the refit in flight and the next: whole, nothing else
    assert all(isinstance(r, RefitReport) and r.tensors == len(expected()) for r in reports)
    assert_received(params)


def test_many_threads_sending_on_one_sender_exactly_the_accepted_refits_land(
    receiver: IpcReceiver,
) -> None:
    """A stress of R10: threads released together, each sending several refits on one
    sender against a real engine end. Every send either lands whole or is refused at once,
    typed; the engine received exactly the accepted ones, every one complete, and ends
    consistent: a last refit of other values lands."""
    threads, attempts = 8, 6
    tensors = expected()
    params = zeros_like_all(tensors)
    manifest = manifest_of(tensors)
    sink = ParameterSink(params)
    other = random_state_dict(SEED + 1)  # the last refit's values: the engine stops there

    def engine() -> list[RefitReport]:
        reports = []
        while not all(torch.equal(params[n], t) for n, t in other.items()):
            try:
                reports.append(
                    receive(receiver, manifest, sink, routes=sink.routes, timeout_s=QUICK)
                )
            except RefitTimeoutError as e:  # idle between sends: any other failure counts
                if "waited for the start of a refit" not in str(e):
                    raise
        return reports

    landed: list[RefitReport] = []
    refused: list[tuple[RefitError, float]] = []
    barrier = threading.Barrier(threads)

    def trainer_thread(sender: RefitSender, seed: int) -> int:
        pause = random.Random(seed)
        barrier.wait(30)
        for _ in range(attempts):
            time.sleep(pause.uniform(0.0, 0.03))  # some sends overlap, some do not
            started = time.monotonic()
            try:
                landed.append(sender.send(scripted_stream(tensors, delay_s=0.002)))
            except RefitError as e:
                refused.append((e, time.monotonic() - started))
        return attempts

    engine_peer = Peer(engine)
    with ipc_sender(receiver, manifest=manifest) as sender:
        workers = [Peer(functools.partial(trainer_thread, sender, i)) for i in range(threads)]
        assert sum(w.outcome(60.0) for w in workers) == threads * attempts
        assert len(landed) + len(refused) == threads * attempts
        assert landed, "no send landed"
        assert refused, "no two sends overlapped: the stress did not stress"
        for error, seconds in refused:
            assert "another thread is sending a refit on this sender" in str(error)
            assert seconds < 0.5
        assert all(r.tensors == len(tensors) for r in landed)
        sender.send(other.items())
    got = engine_peer.outcome(60.0)
    assert len(got) == len(landed) + 1  # exactly the accepted sends, and the last one
    assert all(r.tensors == len(tensors) for r in got)
    for name, tensor in other.items():
        assert torch.equal(params[name], tensor), name
