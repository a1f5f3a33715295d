"""Refit transports end to end, without an engine: IPC (shared memory + ZMQ) and gloo.

Most tests run the receiver and the sender in two threads of this process (fast); the
ones about processes (a round trip across processes, a peer killed mid-refit) spawn the
peer from ``genworker.shell.refit.fake``. Every wait in the code under test is bounded
by a short refit timeout, and every test has a pytest-timeout deadline besides.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Generic, TypeVar

import pytest
import torch
import zmq

from genworker.core.refit_plan import Manifest, Slot, TensorSpec, align_up, plan_buckets
from genworker.shell.errors import (
    BadConfigError,
    RefitError,
    RefitManifestError,
    RefitTimeoutError,
)
from genworker.shell.refit import fake
from genworker.shell.refit.buffers import StagingBuffer, open_handle, private_directory
from genworker.shell.refit.collective import CollectiveReceiver, CollectiveSender
from genworker.shell.refit.ipc import IpcReceiver, IpcSender
from genworker.shell.refit.packing import SendReport
from genworker.shell.refit.session import (
    ParameterSink,
    RefitReport,
    manifest_of,
    receive_refit,
)
from genworker.shell.refit.wire import (
    Begin,
    BucketMsg,
    CpuHandle,
    DirectMsg,
    Reply,
    TensorRef,
    WireSlot,
    bucket_to_wire,
    encode,
)

T = TypeVar("T")
SEED = 7
QUICK = 3.0  # a refit timeout for tests where the peer should answer at once
PROMPT = 2.5  # how fast a side must raise after its peer reported a failure

pytestmark = pytest.mark.timeout(90)


class Peer(threading.Thread, Generic[T]):
    """Runs one side of a refit in a thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], T]) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self.result: T | None = None
        self.error: BaseException | None = None
        self.finished_at = 0.0
        self.start()

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test by outcome()
            self.error = e
        self.finished_at = time.monotonic()

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
    return fake.random_state_dict(SEED)


def assert_received(params: Mapping[str, torch.Tensor]) -> None:
    for name, tensor in expected().items():
        assert torch.equal(params[name], tensor), name


class DeferringSink(ParameterSink):
    """Direct copies for some names; owned copies of the rest go to a loader."""

    def __init__(self, params: dict[str, torch.Tensor], deferred: set[str]) -> None:
        super().__init__(params)
        self._deferred = deferred

    def store(self, items: Sequence[tuple[Slot, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        direct = [(s, v) for s, v in items if s.name not in self._deferred]
        super().store(direct)
        return [(s.name, v.clone()) for s, v in items if s.name in self._deferred]

    def direct_targets(self, manifest: Manifest) -> Mapping[str, torch.Tensor] | None:
        return None  # a loader takes some tensors: buckets


# -- IPC, in threads ------------------------------------------------------------------


def ipc_pair(
    *, sink: ParameterSink | None = None, loader: object = None, timeout_s: float = QUICK
) -> tuple[IpcReceiver, dict[str, torch.Tensor], Peer[RefitReport]]:
    receiver = IpcReceiver(torch.device("cpu"))
    params = fake.zeros_like_all(expected())
    chosen = sink or ParameterSink(params)

    def receive() -> RefitReport:
        return receive_refit(
            receiver,
            manifest_of(expected()),
            chosen,
            timeout_s=timeout_s,
            loader=loader,  # type: ignore[arg-type]
        )

    return receiver, params, Peer(receive)


@pytest.mark.parametrize("checksum", [False, True])
def test_ipc_round_trip_with_oversized_tensor(checksum: bool) -> None:
    receiver, params, peer = ipc_pair()
    try:
        with IpcSender(
            receiver.address,
            direct=False,
            manifest=manifest_of(expected()),
            bucket_bytes=4096,  # embed.weight (12 KiB) travels alone
            timeout_s=QUICK,
            checksum=checksum,
        ) as sender:
            sent = sender.send(expected().items())
        report = peer.outcome()
    finally:
        receiver.close()
    assert_received(params)
    assert (report.tensors, report.nbytes, report.buckets) == (
        sent.tensors,
        sent.nbytes,
        sent.buckets,
    )
    assert sent.tensors == len(expected())
    assert sent.buckets >= 3
    assert report.direct == report.tensors
    assert report.loaded == 0


def test_ipc_tensors_a_sink_defers_reach_the_loader_in_order() -> None:
    deferred = {"layer.0.proj", "head.weight"}
    params = fake.zeros_like_all(expected())
    got: list[tuple[str, torch.Tensor]] = []
    receiver, _, peer = ipc_pair(sink=DeferringSink(params, deferred), loader=got.extend)
    try:
        with IpcSender(
            receiver.address, direct=False, bucket_bytes=4096, timeout_s=QUICK
        ) as sender:
            sender.send(expected().items())
        report = peer.outcome()
    finally:
        receiver.close()
    assert [n for n, _ in got] == [n for n in expected() if n in deferred]
    for name, tensor in got:
        assert torch.equal(tensor, expected()[name])
    assert (report.loaded, report.direct) == (2, len(expected()) - 2)


def test_ipc_loader_failure_reaches_the_sender() -> None:
    def loader(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, _ in weights:
            raise KeyError(f"no such parameter {name}")

    params = fake.zeros_like_all(expected())
    receiver, _, peer = ipc_pair(sink=DeferringSink(params, {"head.weight"}), loader=loader)
    try:
        with (
            IpcSender(receiver.address, direct=False, bucket_bytes=4096, timeout_s=QUICK) as sender,
            pytest.raises(RefitError, match=r"no such parameter head\.weight"),
        ):
            sender.send(expected().items())
        with pytest.raises(RefitError, match="loading the received weights failed"):
            peer.outcome()
    finally:
        receiver.close()


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
    mutate: str, named: str, attr: str
) -> None:
    receiver, _, peer = ipc_pair(timeout_s=30.0)
    try:
        with IpcSender(receiver.address, direct=False, bucket_bytes=4096, timeout_s=30.0) as sender:
            started = time.monotonic()
            with pytest.raises(RefitManifestError, match=named.replace(".", r"\.")) as sent:
                sender.send(fake.scripted_stream(expected(), mutate=mutate))
            assert time.monotonic() - started < PROMPT
        with pytest.raises(RefitManifestError) as received:
            peer.outcome()
    finally:
        receiver.close()
    assert receiver.address in str(sent.value)
    detail = received.value.detail
    assert detail is not None
    assert named in getattr(detail, attr)


def test_ipc_refuses_a_sender_with_another_manifest() -> None:
    receiver, _, peer = ipc_pair()
    other = manifest_of(fake.random_state_dict(SEED, scale=2))
    try:
        with (
            IpcSender(receiver.address, direct=False, manifest=other, timeout_s=QUICK) as sender,
            pytest.raises(RefitManifestError, match="different manifest"),
        ):
            sender.send(expected().items())
        with pytest.raises(RefitManifestError, match="different manifest"):
            peer.outcome()
    finally:
        receiver.close()


@pytest.mark.parametrize(
    ("direct", "bucket", "engine_says"),
    [(False, 1, "bucket 1 could not be stored"), (True, 0, "direct refit could not be stored")],
    ids=["buckets", "direct"],
)
def test_ipc_receiver_failure_makes_the_sender_raise_promptly(
    direct: bool, bucket: int, engine_says: str
) -> None:
    params = fake.zeros_like_all(expected())
    receiver, _, peer = ipc_pair(sink=fake.FailingSink(params, bucket), timeout_s=30.0)
    try:
        with IpcSender(
            receiver.address, direct=direct, bucket_bytes=4096, timeout_s=30.0
        ) as sender:
            started = time.monotonic()
            with pytest.raises(RefitError, match=f"broke while storing bucket {bucket}"):
                sender.send(expected().items())
            assert time.monotonic() - started < PROMPT
        with pytest.raises(RefitError, match=engine_says):
            peer.outcome()
    finally:
        receiver.close()


def test_ipc_trainer_stream_failure_aborts_both_sides() -> None:
    receiver, _, peer = ipc_pair()
    try:
        with (
            IpcSender(receiver.address, direct=False, bucket_bytes=4096, timeout_s=QUICK) as sender,
            pytest.raises(RefitError, match="stream broke at tensor 3") as sent,
        ):
            sender.send(fake.scripted_stream(expected(), raise_after=3))
        assert isinstance(sent.value.__cause__, ValueError)
        with pytest.raises(RefitError, match="aborted the refit"):
            peer.outcome()
    finally:
        receiver.close()


def test_ipc_silent_receiver_times_out_then_a_fresh_socket_works() -> None:
    receiver = IpcReceiver(torch.device("cpu"))
    params = fake.zeros_like_all(expected())
    try:
        with IpcSender(receiver.address, direct=False, bucket_bytes=4096, timeout_s=1.0) as sender:
            started = time.monotonic()
            with pytest.raises(RefitTimeoutError, match="did not answer the start") as timed:
                sender.send(expected().items())
            assert 0.9 < time.monotonic() - started < 1.0 + PROMPT
            assert receiver.address in str(timed.value)
            # The receiver starts late and first sees the abandoned Begin; the second
            # refit runs over a new REQ socket (a reused one would be stuck in EFSM).
            peer = Peer(
                lambda: receive_refit(
                    receiver, manifest_of(expected()), ParameterSink(params), timeout_s=QUICK
                )
            )
            sender.send(expected().items())
            peer.outcome()
    finally:
        receiver.close()
    assert_received(params)


def test_ipc_receiver_waiting_for_nobody_times_out_naming_the_peer() -> None:
    receiver = IpcReceiver(torch.device("cpu"))
    try:
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError, match=r"no refit message from .* within 0\.5s"):
            receive_refit(receiver, manifest_of(expected()), ParameterSink({}), timeout_s=0.5)
        assert time.monotonic() - started < 0.5 + PROMPT
    finally:
        receiver.close()


def raw_request(address: str, payload: bytes) -> Reply:
    import msgspec

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(payload)
        assert sock.poll(5000), "no answer"
        return msgspec.msgpack.decode(sock.recv(), type=Reply)
    finally:
        sock.close()
        ctx.term()


def test_ipc_stray_and_malformed_requests_are_answered_with_errors() -> None:
    receiver, params, peer = ipc_pair()
    try:
        stray = BucketMsg(refit_id="old", index=3, buffer=1, used_bytes=0, slots=[])
        reply = raw_request(receiver.address, encode(stray))
        assert not reply.ok
        assert "no refit is in progress" in reply.message
        # the receiver kept waiting: a real refit still goes through
        with IpcSender(receiver.address, direct=False, timeout_s=QUICK) as sender:
            sender.send(expected().items())
        peer.outcome()
        assert_received(params)
        peer = Peer(
            lambda: receive_refit(
                receiver, manifest_of(expected()), ParameterSink(params), timeout_s=QUICK
            )
        )
        reply = raw_request(receiver.address, b"\x93not a refit message")
        assert not reply.ok
        assert reply.kind == "error"
        assert "malformed" in reply.message
        with pytest.raises(RefitError, match="malformed refit message"):
            peer.outcome()
    finally:
        receiver.close()


def test_ipc_refuses_a_buffer_it_cannot_trust(tmp_path: Path) -> None:
    receiver, _, peer = ipc_pair()
    try:
        reply = raw_request(receiver.address, encode(Begin("r1", "")))
        assert reply.ok
        spec = manifest_of(expected()).specs[0]
        open_dir = tmp_path / "open"
        open_dir.mkdir(mode=0o755)
        open_dir.chmod(0o755)
        used = align_up(spec.nbytes)
        (open_dir / "buf").write_bytes(bytes(used))
        bucket = BucketMsg(
            refit_id="r1",
            index=0,
            buffer=0,
            used_bytes=used,
            slots=[WireSlot(spec.name, 0, spec.nbytes, list(spec.shape), spec.dtype)],
            handle=CpuHandle(str(open_dir / "buf"), used, f"cpu@{socket.gethostname()}"),
        )
        reply = raw_request(receiver.address, encode(bucket))
        assert not reply.ok
        assert "open to other users" in reply.message
        with pytest.raises(RefitError, match="open to other users"):
            peer.outcome()
    finally:
        receiver.close()


def test_open_handle_checks(tmp_path: Path) -> None:
    host = f"cpu@{socket.gethostname()}"
    private = private_directory("genworker-test-")
    try:
        buffer = StagingBuffer(1024, torch.device("cpu"), private)
        assert isinstance(buffer.handle, CpuHandle)
        mapped = open_handle(buffer.handle, torch.device("cpu"))
        buffer.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert mapped[:4].tolist() == [1, 2, 3, 4]  # both sides see the same memory
        with pytest.raises(RefitError, match="lives on cpu@elsewhere"):
            open_handle(CpuHandle(buffer.handle.path, 1024, "cpu@elsewhere"), torch.device("cpu"))
        with pytest.raises(RefitError, match="fewer than the 4096 declared"):
            open_handle(CpuHandle(buffer.handle.path, 4096, host), torch.device("cpu"))
        link = private / "link"
        link.symlink_to(buffer.handle.path)
        with pytest.raises(RefitError, match="could not open"):
            open_handle(CpuHandle(str(link), 1024, host), torch.device("cpu"))
        with pytest.raises(RefitError, match="could not open"):
            open_handle(CpuHandle(str(private / "absent"), 1024, host), torch.device("cpu"))
        assert not (private / "absent").exists()  # never created by the receiver
        buffer.close()
    finally:
        import shutil

        shutil.rmtree(private)


def test_ipc_sockets_and_buffers_live_in_private_directories() -> None:
    receiver, _, peer = ipc_pair()
    sock_dir = Path(receiver.address.removeprefix("ipc://")).parent
    assert stat.S_IMODE(sock_dir.stat().st_mode) == 0o700
    assert sock_dir.name.startswith("genworker-refit-")
    assert len(sock_dir.name) > len("genworker-refit-") + 6
    sender = IpcSender(receiver.address, direct=False, bucket_bytes=4096, timeout_s=QUICK)
    sender.send(expected().items())
    peer.outcome()
    (staging,) = {Path(b.handle.path).parent for b in sender._buffers.values()}  # type: ignore[union-attr]
    assert stat.S_IMODE(staging.stat().st_mode) == 0o700
    for buffer in sender._buffers.values():
        assert stat.S_IMODE(os.stat(buffer.handle.path).st_mode) == 0o600  # type: ignore[union-attr]
    sender.close()
    receiver.close()
    assert not staging.exists()
    assert not sock_dir.exists()


def test_ipc_tcp_binds_loopback_only_unless_asked() -> None:
    with pytest.raises(BadConfigError, match="not a loopback address"):
        IpcReceiver(torch.device("cpu"), tcp_host="0.0.0.0")
    receiver = IpcReceiver(torch.device("cpu"), tcp_host="127.0.0.1")
    params = fake.zeros_like_all(expected())
    try:
        assert receiver.address.startswith("tcp://127.0.0.1:")
        peer = Peer(
            lambda: receive_refit(
                receiver, manifest_of(expected()), ParameterSink(params), timeout_s=QUICK
            )
        )
        with IpcSender(receiver.address, direct=False, timeout_s=QUICK) as sender:
            sender.send(expected().items())
        peer.outcome()
    finally:
        receiver.close()
    assert_received(params)


def test_sender_arguments_are_checked() -> None:
    with pytest.raises(BadConfigError, match="ipc://"):
        IpcSender("/tmp/x.sock")
    with pytest.raises(BadConfigError, match="multiple of 512"):
        IpcSender("ipc:///tmp/x.sock", bucket_bytes=1000)
    with pytest.raises(BadConfigError, match="timeout_s"):
        IpcSender("ipc:///tmp/x.sock", timeout_s=0)
    with pytest.raises(BadConfigError, match="invalid refit manifest"):
        IpcSender("ipc:///tmp/x.sock", manifest={"w": ([-1], "float32")})
    for bad in (-1, 1.5, True):
        with pytest.raises(BadConfigError, match="group_bytes"):
            CollectiveSender("127.0.0.1", free_port(), 2, group_bytes=bad)  # type: ignore[arg-type]


class ScriptedTransport:
    """An in-memory transport: a fixed list of messages, one buffer, recorded verdicts."""

    peer = "the scripted trainer"

    def __init__(self, messages: Sequence[object], buffer: torch.Tensor) -> None:
        self._messages = list(messages)
        self._buffer = buffer
        self.verdicts: list[str] = []

    def next_message(self, timeout_s: float) -> object:
        return self._messages.pop(0)

    def precheck(self, problem: RefitError | None, timeout_s: float) -> None:
        if problem is not None:
            self.verdicts.append(f"refused: {problem}")
            raise problem

    def answer(self, problem: RefitError | None, timeout_s: float) -> None:
        self.verdicts.append("ok" if problem is None else f"refused: {problem}")
        if problem is not None:
            raise problem

    def acknowledge_abort(self, timeout_s: float) -> None:
        self.verdicts.append("abort")

    def answer_begin(
        self,
        problem: RefitError | None,
        targets: Mapping[str, torch.Tensor] | None,
        timeout_s: float,
    ) -> bool:
        self.answer(problem, timeout_s)
        return targets is not None

    def fill_direct(
        self, msg: DirectMsg, targets: Mapping[str, torch.Tensor], timeout_s: float
    ) -> str:
        for ref in msg.tensors:
            targets[ref.name].copy_(self._buffer[: targets[ref.name].numel()])
        return "scripted"

    def payload(self, msg: BucketMsg, timeout_s: float) -> torch.Tensor:
        return self._buffer

    def release(self) -> None:
        self.verdicts.append("released")


@pytest.mark.parametrize(
    ("checksum", "buffer_bytes", "error"),
    [
        (1, 4096, "bucket 0 failed its checksum"),
        (None, 100, "declares 512 bytes but its buffer holds 100"),
    ],
)
def test_session_refuses_a_corrupt_or_short_payload(
    checksum: int | None, buffer_bytes: int, error: str
) -> None:
    spec = TensorSpec("w", (128,), "float32")
    (bucket,) = plan_buckets([spec], 4096)
    messages = [Begin("r", ""), bucket_to_wire(bucket, "r", checksum=checksum)]
    transport = ScriptedTransport(messages, torch.zeros(buffer_bytes, dtype=torch.uint8))
    params = {"w": torch.ones(128)}
    with pytest.raises(RefitError, match=error):
        receive_refit(
            transport,  # type: ignore[arg-type]
            manifest_of(params),
            ParameterSink(params),
            timeout_s=1.0,
        )
    assert transport.verdicts[0] == "ok"
    assert error in transport.verdicts[1]
    assert transport.verdicts[-1] == "released"
    assert torch.equal(params["w"], torch.ones(128))  # nothing was stored


# -- collective (gloo), in threads ------------------------------------------------------


def engine_side(
    port: int,
    *,
    sink: ParameterSink | None = None,
    params: dict[str, torch.Tensor] | None = None,
    timeout_s: float = QUICK,
    world_size: int = 2,
    train_world_size: int = 1,
    claimed_train_world_size: int | None = None,
) -> Peer[RefitReport]:
    def receive() -> RefitReport:
        group = fake.engine_group(
            port,
            timeout_s=timeout_s,
            rank=train_world_size,
            world_size=world_size,
            train_world_size=claimed_train_world_size or train_world_size,
        )
        try:
            chosen = sink or ParameterSink(params if params is not None else {})
            return receive_refit(
                CollectiveReceiver(group), manifest_of(expected()), chosen, timeout_s=timeout_s
            )
        finally:
            group.close()

    return Peer(receive)


@pytest.mark.parametrize("checksum", [False, True])
def test_collective_round_trip_with_oversized_tensor(checksum: bool) -> None:
    port = free_port()
    params = fake.zeros_like_all(expected())
    peer = engine_side(port, params=params)
    with CollectiveSender(
        "127.0.0.1",
        port,
        2,
        manifest=manifest_of(expected()),
        bucket_bytes=4096,
        timeout_s=QUICK,
        checksum=checksum,
        direct=False,
    ) as sender:
        sent = sender.send(expected().items())
        assert sender.group.backend == "gloo"
    report = peer.outcome()
    assert_received(params)
    assert (report.tensors, report.buckets) == (sent.tensors, sent.buckets) == (8, sent.buckets)


@pytest.mark.parametrize(
    ("mutate", "named"),
    [
        ("missing", "head.weight"),
        ("extra", "surprise.weight"),
        ("shape", "embed.weight"),
        ("dtype", "embed.weight"),
    ],
)
def test_collective_stream_that_breaks_the_manifest_is_named_on_both_sides(
    mutate: str, named: str
) -> None:
    port = free_port()
    peer = engine_side(port, params=fake.zeros_like_all(expected()), timeout_s=30.0)
    with CollectiveSender(
        "127.0.0.1", port, 2, direct=False, bucket_bytes=4096, timeout_s=30.0
    ) as sender:
        started = time.monotonic()
        with pytest.raises(RefitManifestError, match=named.replace(".", r"\.")) as sent:
            sender.send(fake.scripted_stream(expected(), mutate=mutate))
        assert time.monotonic() - started < PROMPT
    assert "rank 1" in str(sent.value)
    with pytest.raises(RefitManifestError, match=named.replace(".", r"\.")):
        peer.outcome()


@pytest.mark.parametrize(
    ("direct", "bucket", "engine_says"),
    [(False, 2, "bucket 2 could not be stored"), (True, 0, "direct refit could not be stored")],
    ids=["buckets", "direct"],
)
def test_collective_receiver_failure_makes_the_sender_raise_promptly(
    direct: bool, bucket: int, engine_says: str
) -> None:
    port = free_port()
    params = fake.zeros_like_all(expected())
    peer = engine_side(port, sink=fake.FailingSink(params, bucket), timeout_s=30.0)
    with CollectiveSender(
        "127.0.0.1", port, 2, direct=direct, bucket_bytes=4096, timeout_s=30.0
    ) as sender:
        started = time.monotonic()
        with pytest.raises(RefitError, match=rf"rank 1: .*broke while storing bucket {bucket}"):
            sender.send(expected().items())
        assert time.monotonic() - started < PROMPT
    with pytest.raises(RefitError, match=engine_says):
        peer.outcome()


def test_collective_refit_after_a_failed_one_on_the_same_group_succeeds() -> None:
    port = free_port()
    params = fake.zeros_like_all(expected())

    def engine() -> RefitReport:
        group = fake.engine_group(port, timeout_s=QUICK)
        transport = CollectiveReceiver(group)  # one per group, as the extension keeps it
        try:
            with pytest.raises(RefitError, match="broke while storing bucket 1"):
                receive_refit(
                    transport, manifest_of(expected()), fake.FailingSink(params, 1), timeout_s=QUICK
                )
            return receive_refit(
                transport, manifest_of(expected()), ParameterSink(params), timeout_s=QUICK
            )
        finally:
            group.close()

    peer = Peer(engine)
    with CollectiveSender(
        "127.0.0.1", port, 2, direct=False, bucket_bytes=4096, timeout_s=QUICK
    ) as sender:
        with pytest.raises(RefitError, match="broke while storing bucket 1"):
            sender.send(expected().items())
        sender.send(expected().items())
    assert peer.outcome().tensors == len(expected())
    assert_received(params)


def test_collective_trainer_stream_failure_aborts_both_sides() -> None:
    port = free_port()
    peer = engine_side(port, params=fake.zeros_like_all(expected()))
    with (
        CollectiveSender(
            "127.0.0.1", port, 2, direct=False, bucket_bytes=4096, timeout_s=QUICK
        ) as sender,
        pytest.raises(RefitError, match="stream broke at tensor 4"),
    ):
        sender.send(fake.scripted_stream(expected(), raise_after=4))
    with pytest.raises(RefitError, match="aborted the refit"):
        peer.outcome()


def test_collective_handshake_names_the_mismatch() -> None:
    port = free_port()
    # the engine believes the group has 3 ranks; the trainer knows it has 2
    peer = engine_side(port, world_size=3, train_world_size=1)
    started = time.monotonic()
    with pytest.raises(RefitError, match=r"rank 1 has world_size=3, expected 2"):
        CollectiveSender("127.0.0.1", port, 2, direct=False, timeout_s=QUICK)
    assert time.monotonic() - started < PROMPT
    with pytest.raises(RefitError, match=r"inconsistent: rank 1 has world_size=3"):
        peer.outcome()


def test_collective_two_trainer_ranks_feed_one_engine() -> None:
    port = free_port()
    params = fake.zeros_like_all(expected())
    peer = engine_side(port, params=params, world_size=3, train_world_size=2)

    def trainer(rank: int) -> object:
        with CollectiveSender(
            "127.0.0.1", port, 3, rank=rank, train_world_size=2, bucket_bytes=4096, timeout_s=QUICK
        ) as sender:
            return sender.send(expected().items())

    other = Peer(lambda: trainer(1))
    sent = trainer(0)
    other.outcome()
    report = peer.outcome()
    assert_received(params)
    assert isinstance(sent, SendReport)
    assert sent.mode == report.mode == "direct-receive"


@pytest.mark.parametrize(
    ("faults", "match"),
    [
        ({"mutate": "missing"}, "streams differently from rank 0"),
        ({"raise_after": 3}, "stream broke at tensor 3"),
        ({"raise_after": 0}, "stream broke at tensor 0"),
    ],
)
def test_collective_a_failing_second_trainer_rank_fails_every_rank(
    faults: dict[str, object], match: str
) -> None:
    port = free_port()
    peer = engine_side(
        port, params=fake.zeros_like_all(expected()), world_size=3, train_world_size=2
    )

    def trainer(rank: int, stream: Iterable[tuple[str, torch.Tensor]]) -> object:
        with CollectiveSender(
            "127.0.0.1",
            port,
            3,
            rank=rank,
            train_world_size=2,
            bucket_bytes=4096,
            timeout_s=30.0,
            direct=False,
        ) as sender:
            return sender.send(stream)

    other = Peer(lambda: trainer(1, fake.scripted_stream(expected(), **faults)))  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(RefitError, match=match):
        trainer(0, expected().items())
    assert time.monotonic() - started < PROMPT
    with pytest.raises(RefitError, match=match):
        other.outcome()
    with pytest.raises(RefitError, match=match):
        peer.outcome()


def test_collective_topology_is_checked_before_any_socket() -> None:
    with pytest.raises(BadConfigError, match="rank 2 is outside"):
        CollectiveSender("127.0.0.1", free_port(), 2, rank=2)
    with pytest.raises(BadConfigError, match="leaves no one"):
        CollectiveSender("127.0.0.1", free_port(), 1)
    with pytest.raises(BadConfigError, match="engine rank, but this process is the trainer"):
        CollectiveSender("127.0.0.1", free_port(), 3, rank=1, train_world_size=1)


def test_collective_missing_engine_times_out_naming_it() -> None:
    started = time.monotonic()
    with pytest.raises(RefitTimeoutError, match=r"ranks \[1\] never joined"):
        CollectiveSender("127.0.0.1", free_port(), 2, timeout_s=1.0)
    assert time.monotonic() - started < 1.0 + PROMPT


# -- across processes -----------------------------------------------------------------


def spawn(
    target: Callable[..., None], *args: object, **kwargs: object
) -> tuple[BaseProcess, object]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(queue, *args), kwargs=kwargs, daemon=True)
    process.start()
    return process, queue


def next_item(queue: object, timeout: float = 60.0) -> tuple[str, object]:
    item = queue.get(timeout=timeout)  # type: ignore[attr-defined]
    assert isinstance(item, tuple)
    return item


def test_ipc_round_trip_across_processes() -> None:
    receiver = IpcReceiver(torch.device("cpu"))
    params = fake.zeros_like_all(expected())
    try:
        process, queue = spawn(
            fake.run_ipc_sender, receiver.address, SEED, timeout_s=60.0, direct=False
        )
        report = receive_refit(
            receiver, manifest_of(expected()), ParameterSink(params), timeout_s=60.0
        )
        kind, outcome = next_item(queue)
        if kind == "ready":
            kind, outcome = next_item(queue)
        process.join(30)
    finally:
        receiver.close()
    assert kind == "outcome"
    assert isinstance(outcome, fake.Outcome)
    assert outcome.ok, outcome
    assert_received(params)
    assert report.tensors == outcome.detail["tensors"] == len(expected())


def test_ipc_sender_killed_mid_refit_receiver_times_out_within_its_bound(tmp_path: Path) -> None:
    receiver = IpcReceiver(torch.device("cpu"))
    params = fake.zeros_like_all(expected())
    try:
        # the killed sender cannot remove its staging directory: keep it in tmp_path
        process, queue = spawn(
            fake.run_ipc_sender,
            receiver.address,
            SEED,
            timeout_s=60.0,
            direct=False,
            die_after=4,
            staging_dir=str(tmp_path),
        )
        assert next_item(queue)[0] == "ready"  # torch imported; the refit starts now
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError) as timed:
            receive_refit(receiver, manifest_of(expected()), ParameterSink(params), timeout_s=3.0)
        assert time.monotonic() - started < 3.0 + PROMPT
        process.join(30)
        assert process.exitcode == 17
    finally:
        receiver.close()
    assert "the trainer connected to ipc://" in str(timed.value)
    assert "within 3.0s" in str(timed.value)


def test_ipc_receiver_killed_mid_refit_sender_times_out_within_its_bound(tmp_path: Path) -> None:
    process, queue = spawn(
        fake.run_ipc_receiver, SEED, timeout_s=60.0, die_at=1, directory=str(tmp_path)
    )
    kind, address = next_item(queue)
    assert kind == "address"
    assert isinstance(address, str)
    with IpcSender(address, direct=False, bucket_bytes=4096, timeout_s=3.0) as sender:
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError, match=r"did not answer bucket 1 within 3\.0s"):
            sender.send(expected().items())
        assert time.monotonic() - started < 3.0 + PROMPT
    process.join(30)
    assert process.exitcode == 17


def test_collective_round_trip_across_processes() -> None:
    port = free_port()
    params = fake.zeros_like_all(expected())
    process, queue = spawn(fake.run_collective_sender, port, SEED, timeout_s=60.0, direct=False)
    group = fake.engine_group(port, timeout_s=60.0)
    try:
        receive_refit(
            CollectiveReceiver(group),
            manifest_of(expected()),
            ParameterSink(params),
            timeout_s=60.0,
        )
    finally:
        group.close()
    _, outcome = next_item(queue)
    process.join(30)
    assert isinstance(outcome, fake.Outcome)
    assert outcome.ok, outcome
    assert_received(params)


@pytest.mark.parametrize(
    ("dies", "match"),
    [
        ({"direct": False, "die_after": 4}, "weight-update group"),
        ({"die_direct": True}, "direct broadcast 1 of"),
    ],
    ids=["buckets", "direct"],
)
def test_collective_sender_killed_mid_refit_receiver_raises_a_typed_timeout(
    dies: dict[str, object], match: str
) -> None:
    port = free_port()
    process, _ = spawn(fake.run_collective_sender, port, SEED, timeout_s=60.0, **dies)
    group = fake.engine_group(port, timeout_s=60.0)
    params = fake.zeros_like_all(expected())
    try:
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError, match=match):
            receive_refit(
                CollectiveReceiver(group),
                manifest_of(expected()),
                ParameterSink(params),
                timeout_s=3.0,
            )
        assert time.monotonic() - started < 3.0 + PROMPT
        with pytest.raises(RefitError, match="unusable after a failed collective"):
            group.round(None, 1.0, "a later refit")
    finally:
        group.close()
    process.join(30)
    assert process.exitcode == 17


# -- direct refits: straight into the receiver's tensors --------------------------------


def assert_untouched(params: Mapping[str, torch.Tensor]) -> None:
    for name, tensor in params.items():
        assert not tensor.any(), f"{name} was written"


@pytest.mark.parametrize(("direct", "mode"), [(True, "engine-handles"), (False, "buckets")])
def test_ipc_engine_handles_give_the_same_weights_as_buckets(direct: bool, mode: str) -> None:
    receiver, params, peer = ipc_pair()
    try:
        with IpcSender(
            receiver.address,
            manifest=manifest_of(expected()),
            bucket_bytes=4096,
            timeout_s=QUICK,
            direct=direct,
        ) as sender:
            sent = sender.send(expected().items())
            report = peer.outcome()
            assert_received(params)
            for tensor in params.values():
                tensor.zero_()
            # A second refit reuses the mapped handles of the first.
            manifest = manifest_of(expected())
            second = Peer(
                lambda: receive_refit(receiver, manifest, ParameterSink(params), timeout_s=QUICK)
            )
            again = sender.send(expected().items())
            second.outcome()
    finally:
        receiver.close()
    assert_received(params)
    assert sent.mode == report.mode == again.mode == mode
    assert (report.tensors, report.nbytes) == (sent.tensors, sent.nbytes)
    assert (sent.buckets == 0) == direct
    assert report.as_dict()["mode"] == mode


def test_ipc_direct_falls_back_to_buckets_when_a_tensor_needs_the_loader() -> None:
    params = fake.zeros_like_all(expected())
    got: list[tuple[str, torch.Tensor]] = []
    sink = DeferringSink(params, {"head.weight"})
    receiver, _, peer = ipc_pair(sink=sink, loader=got.extend)
    try:
        with IpcSender(receiver.address, bucket_bytes=4096, timeout_s=QUICK) as sender:
            sent = sender.send(expected().items())
        report = peer.outcome()
    finally:
        receiver.close()
    assert sent.mode == report.mode == "buckets"
    assert [n for n, _ in got] == ["head.weight"]


@pytest.mark.parametrize(
    ("mutate", "named"),
    [("shape", "embed.weight"), ("dtype", "embed.weight"), ("extra", "surprise.weight")],
)
def test_ipc_direct_refuses_a_mismatch_before_any_write(mutate: str, named: str) -> None:
    receiver, params, peer = ipc_pair(timeout_s=30.0)
    try:
        with IpcSender(receiver.address, timeout_s=30.0) as sender:
            started = time.monotonic()
            with pytest.raises(RefitManifestError, match=named.replace(".", r"\.")):
                sender.send(fake.scripted_stream(expected(), mutate=mutate))
            assert time.monotonic() - started < PROMPT
        with pytest.raises(RefitManifestError, match=named.replace(".", r"\.")):
            peer.outcome()
    finally:
        receiver.close()
    assert_untouched(params)


def test_ipc_direct_refuses_a_direct_message_it_did_not_agree_to() -> None:
    spec = TensorSpec("w", (4,), "float32")
    refs = [TensorRef("w", [4], "float32")]
    transport = ScriptedTransport([Begin("r", ""), DirectMsg("r", refs)], torch.zeros(16))
    params = {"w": torch.ones(4)}
    with pytest.raises(RefitError, match="did not agree to"):
        receive_refit(
            transport,  # type: ignore[arg-type]
            Manifest.from_specs([spec]).unwrap(),
            ParameterSink(params),
            timeout_s=1.0,
        )
    assert torch.equal(params["w"], torch.ones(4))


def test_ipc_direct_sender_killed_mid_refit_receiver_times_out_within_its_bound() -> None:
    receiver = IpcReceiver(torch.device("cpu"))
    params = fake.zeros_like_all(expected())
    try:
        process, queue = spawn(
            fake.run_ipc_sender, receiver.address, SEED, timeout_s=60.0, die_direct=True
        )
        assert next_item(queue)[0] == "ready"
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError, match=r"within 3\.0s"):
            receive_refit(receiver, manifest_of(expected()), ParameterSink(params), timeout_s=3.0)
        assert time.monotonic() - started < 3.0 + PROMPT
        process.join(30)
        assert process.exitcode == 17
    finally:
        receiver.close()


@pytest.mark.parametrize(("direct", "mode"), [(True, "direct-receive"), (False, "buckets")])
def test_collective_direct_receive_gives_the_same_weights_as_buckets(
    direct: bool, mode: str
) -> None:
    port = free_port()
    params = fake.zeros_like_all(expected())
    peer = engine_side(port, params=params)
    with CollectiveSender(
        "127.0.0.1",
        port,
        2,
        manifest=manifest_of(expected()),
        bucket_bytes=4096,
        timeout_s=QUICK,
        direct=direct,
    ) as sender:
        sent = sender.send(expected().items())
    report = peer.outcome()
    assert_received(params)
    assert sent.mode == report.mode == mode
    assert (report.tensors, report.nbytes) == (sent.tensors, sent.nbytes) == (8, sent.nbytes)


@pytest.mark.parametrize(
    ("mutate", "named"),
    [("shape", "embed.weight"), ("missing", "head.weight"), ("extra", "surprise.weight")],
)
def test_collective_direct_refuses_a_mismatch_before_any_write(mutate: str, named: str) -> None:
    port = free_port()
    params = fake.zeros_like_all(expected())
    peer = engine_side(port, params=params, timeout_s=30.0)
    with CollectiveSender("127.0.0.1", port, 2, timeout_s=30.0) as sender:
        started = time.monotonic()
        with pytest.raises(RefitManifestError, match=named.replace(".", r"\.")):
            sender.send(fake.scripted_stream(expected(), mutate=mutate))
        assert time.monotonic() - started < PROMPT
    with pytest.raises(RefitManifestError, match=named.replace(".", r"\.")):
        peer.outcome()
    assert_untouched(params)
