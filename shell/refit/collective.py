"""Refit over a standalone collective group: NCCL on CUDA, gloo on CPU, one code path.

Rendezvous: trainer rank 0 hosts a fresh ``TCPStore`` at ``ip:port``; engine workers join
(``WorkerExtension.init_collective``) as ranks ``train_world_size + rank_prefix + worker
rank`` (NeMo-RL's layout), in a bare group apart from vLLM's. Each rank writes its
:class:`~genworker.core.refit_protocol.GroupClaim` into the store first and rank 0
publishes a verdict, so a mismatch fails at once naming the ranks, never hangs (C3).

A refit: rank 0 broadcasts each event (length, then bytes); a chunk's tensors follow, one
broadcast each in listing order (one group call on NCCL), straight into their destination
on every rank: a parameter, a fresh tensor for the loader, or scratch (other trainer
ranks, which check their own stream; a rank that failed, to stay in step). Status rounds
after Begin and after End: an all-reduce of one error code per rank, then, when one
failed, an all-gather of the messages, so every rank raises naming who failed and why
(C1). Foreign errors are mapped in one place (:func:`foreign_errors`, NeMo-RL's and vLLM's
groups' too): a wait past its bound is a :class:`RefitTimeoutError` naming it; anything
else (gloo's "Connection reset by peer", an NCCL error) a :class:`RefitTransportError`
with its text. Either breaks the group (aborted where the backend can) until
``init_collective`` runs again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NoReturn, Protocol, runtime_checkable

import msgspec
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from genworker.core import refit_protocol as p
from genworker.core import refit_transport as rt
from genworker.core.joins import GroupJoinWire, group_join
from genworker.core.refit_plan import DTYPE_ITEMSIZE, Manifest, TensorSpec
from genworker.core.refit_wire import Handle, Reply, encode
from genworker.shell.errors import (
    BadArgumentError,
    BadConfigError,
    EngineStateError,
    GenworkerError,
    RefitError,
    RefitTimeoutError,
    RefitTransportError,
    unwrap,
)
from genworker.shell.refit.door import Holding
from genworker.shell.refit.engine import EngineContext
from genworker.shell.refit.receiver import Sink, Wait, receive
from genworker.shell.refit.wire import KINDS, decode, error_of, kind_of

__all__ = ["CollectiveBackend", "CollectiveGroup", "CollectiveReceiver", "CollectiveSenderPort"]


@runtime_checkable
class C10dBackend(Protocol):
    """What the refit calls on torch's gloo and NCCL backends (``ProcessGroupGloo``,
    ``ProcessGroupNCCL``): torch's stubs (2.13) leave the collectives of their base
    ``Backend`` out, which its pybind class has."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def allgather(self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor]) -> dist.Work: ...

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...

    def _start_coalescing(self) -> None: ...

    def _end_coalescing(self) -> dist.Work: ...

    def abort(self) -> None: ...

    def shutdown(self) -> None: ...


def c10d_backend(backend: object) -> C10dBackend:
    """``backend`` (torch's gloo or NCCL backend) as the refit calls it."""
    if not isinstance(backend, C10dBackend):
        raise RefitTransportError(f"torch's {type(backend).__name__} lacks a collective used here")
    return backend


@contextlib.contextmanager
def foreign_errors(
    what: str, peer: str, bound_s: float, broken: Callable[[], None]
) -> Iterator[None]:
    """The one place where a foreign error (torch's, NCCL's, gloo's) raised while ``what``
    ran on ``peer`` becomes ours: a timeout when it is one or came at the bound ``bound_s``,
    else a transport failure with its text. Every failure runs ``broken`` first."""
    started = time.monotonic()
    try:
        yield
    except Exception as e:
        broken()
        if isinstance(e, GenworkerError):
            raise
        elapsed, error = time.monotonic() - started, (type(e).__name__, str(e))
        ours = rt.foreign_failure(
            what, peer, bound_s, elapsed, error, timeout=isinstance(e, TimeoutError)
        )
        raise (RefitTimeoutError if ours.timed_out else RefitTransportError)(ours.message) from e


def spin_until(done: Callable[[], bool], deadline: float, what: str) -> None:
    """Poll ``done`` until it holds; :class:`TimeoutError` past ``deadline``. NCCL has no
    timeout, and its blocking waits sleep in coarse steps."""
    spins = 0
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete in time")
        spins += 1
        time.sleep(0 if spins < 2000 else 1e-4)


def gloo_wait(work: dist.Work, deadline: float) -> None:
    """Wait for a gloo ``work`` until ``deadline`` (gloo's own wait takes a timeout)."""
    work.wait(dt.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))


def _await_listener(ip: str, port: int, bound_s: float) -> None:
    """Return once something listens at ``ip:port``; :class:`TimeoutError` past ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((ip, port), timeout=max(left, 0.01)).close()
            return
        except OSError as e:
            if left <= 0.05:
                raise TimeoutError(f"nothing listens at {ip}:{port}") from e
            time.sleep(0.05)


class CollectiveGroup:
    """A weight-update group on its own TCPStore; every wait bounded, failures typed."""

    def __init__(
        self,
        ip: str,
        port: int,
        rank: int,
        world_size: int,
        train_world_size: int,
        role: str,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        claim = rt.group_claim(ip, port, rank, (world_size, train_world_size), role, device.type)
        self.claim = unwrap(claim, BadConfigError, "invalid weight-update group")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend = backend = self.claim.backend
        self.where, self.broken = f"{ip}:{port}", False
        self._pg: C10dBackend | None = None
        self.peer = f"the weight-update group at {ip}:{port} (rank {rank} of {world_size})"
        self._timeout = dt.timedelta(seconds=timeout_s)
        what = f"{'reaching' if rank else 'hosting'} the weight-update store"
        with self._foreign(what, timeout_s):
            if rank:  # torch's client retries past its timeout (a random back-off of seconds)
                _await_listener(ip, port, timeout_s)
            self._store = TCPStore(
                ip, port, None, rank == 0, timeout=self._timeout, wait_for_workers=False
            )
            verdict = self._handshake(timeout_s)
        if not verdict.ok:
            message = f"the weight-update group at {self.where} is inconsistent: {verdict.message}"
            raise error_of(verdict.kind, message)
        store = PrefixStore("genworker-refit/pg/", self._store)
        if backend == "gloo":
            self._pg = c10d_backend(ProcessGroupGloo(store, rank, world_size, self._timeout))
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            self._pg = c10d_backend(dist.ProcessGroupNCCL(store, rank, world_size, options))
        self.settle(None, "the group's first status round", timeout_s)

    def _foreign(self, what: str, bound_s: float) -> contextlib.AbstractContextManager[None]:
        return foreign_errors(what, self.peer, bound_s, self._break)

    def _handshake(self, timeout_s: float) -> Reply:
        store = self._store
        if store.add(f"claim/{self.rank}/taken", 1) > 1:
            raise RefitError(
                f"rank {self.rank} of the weight-update group at {self.where} is already "
                "taken: two processes computed the same rank (check rank_prefix)"
            )
        store.set(f"claim/{self.rank}", encode(self.claim))  # type: ignore[arg-type]
        if self.rank:
            store.wait(["verdict"], self._timeout)
            verdict = msgspec.msgpack.decode(store.get("verdict"), type=Reply)
            store.add("verdict/read", 1)
            return verdict
        keys = [f"claim/{r}" for r in range(self.world_size)]
        try:
            store.wait(keys, self._timeout)
        except Exception as e:
            absent = [r for r, k in enumerate(keys) if not store.check([k])]
            verdict = Reply(False, "timeout", f"ranks {absent} never joined within {timeout_s:g}s")
            self._publish(verdict, self.world_size - 1 - len(absent), timeout_s)
            raise RefitTimeoutError(
                f"the weight-update group at {self.where}: {verdict.message}"
            ) from e
        claims = [msgspec.msgpack.decode(store.get(k), type=p.GroupClaim) for k in keys]
        problems = p.claim_problems(self.claim, claims)
        verdict = Reply(not problems, "refit", "; ".join(problems))
        self._publish(verdict, self.world_size - 1, timeout_s)
        return verdict

    def _publish(self, verdict: Reply, readers: int, timeout_s: float) -> None:
        """Set the verdict; a refusal keeps the store up until the others read it."""
        self._store.set("verdict", encode(verdict))  # type: ignore[arg-type]
        if verdict.ok:
            return
        deadline = time.monotonic() + min(timeout_s, 5.0)
        while self._store.add("verdict/read", 0) < readers and time.monotonic() < deadline:
            time.sleep(0.01)

    def _group(self) -> C10dBackend:
        if self.broken or self._pg is None:
            raise RefitError(
                f"{self.peer} is unusable after a failed collective; call init_collective again"
            )
        return self._pg

    def transfer(self, tensors: Sequence[torch.Tensor], what: str, bound_s: float) -> None:
        """Broadcast rank 0's ``tensors`` into every other rank's (flat uint8): one group
        call on NCCL, one broadcast each on gloo; each work bounded."""
        if not tensors:
            return
        pg, options = self._group(), dist.BroadcastOptions()
        options.rootRank = 0
        with self._foreign(f"broadcasting {what}", bound_s):
            if self.backend == "nccl" and len(tensors) > 1:
                pg._start_coalescing()
                for tensor in tensors:
                    pg.broadcast([tensor], options)
                works = [pg._end_coalescing()]
            else:
                works = [pg.broadcast([tensor], options) for tensor in tensors]
            for work in works:
                self._wait(work, time.monotonic() + bound_s)

    def _wait(self, work: dist.Work, deadline: float) -> None:
        if self.backend == "gloo":
            gloo_wait(work, deadline)
            return
        spin_until(work.is_completed, deadline, "the collective")
        work.wait()

    def message(self, data: bytes | None, what: str, bound_s: float) -> bytes:
        """Rank 0's ``data`` on every rank (others pass ``None``): its length, then it."""
        length = torch.tensor([len(data or b"")], dtype=torch.int64).to(self.device)
        self.transfer([length], what, bound_s)
        if data is None:
            body = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        else:
            body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        self.transfer([body], what, bound_s)
        return _bytes(body) if data is None else data

    def settle(self, problem: RefitError | None, what: str, bound_s: float) -> None:
        """A status round: every rank reports ok or its error; raises ``problem`` (ours)
        or the other ranks' failures, naming them."""
        if problem is not None and self.broken:
            raise problem  # the group failed under us: no one to tell
        pg, n = self._group(), self.world_size
        codes = torch.zeros(n, dtype=torch.int32, device=self.device)
        codes[self.rank] = rt.status_code(None if problem is None else kind_of(problem), KINDS)
        with self._foreign(f"the status round after {what}", bound_s):
            self._wait(pg.allreduce([codes]), time.monotonic() + bound_s)
            failed = rt.status_failures(codes.cpu().tolist(), KINDS)
            if failed:
                raw = rt.status_frame(str(problem) if problem else "")
                mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
                outs = [torch.empty_like(mine) for _ in range(n)]
                self._wait(pg.allgather([outs], [mine]), time.monotonic() + bound_s)
        if problem is not None:
            raise problem
        if failed:
            raise error_of(*rt.group_failure(what, failed, [_bytes(out) for out in outs]))

    def _break(self) -> None:
        self.broken = True
        with contextlib.suppress(RuntimeError, AttributeError):
            if self._pg is not None:
                self._pg.abort()

    def close(self) -> None:
        """Tear the group down without waiting for the peers (NCCL's graceful shutdown
        would block until every rank shut down too). A gloo group joins its worker threads
        when it is freed, and a thread still in an operation (the receive of a refit that
        timed out) leaves only at the group's timeout: such a group is freed on a daemon
        thread."""
        pending, self.broken = self.broken, True
        held, self._pg = [self._pg], None  # the list holds the group's last reference
        with contextlib.suppress(RuntimeError, AttributeError):
            getattr(held[0], "shutdown" if self.backend == "gloo" else "abort")()
        if pending and self.backend == "gloo":
            threading.Thread(target=held.clear, name="gloo-group-free", daemon=True).start()


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.cpu().numpy().tobytes()


def _scratch(refs: Iterable[p.TensorRef], device: torch.device) -> list[torch.Tensor]:
    sizes = (math.prod(r.shape) * DTYPE_ITEMSIZE.get(r.dtype, 1) for r in refs)
    return [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes if n]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1).view(torch.uint8)


def _empty(spec: p.TensorRef | TensorSpec, device: torch.device) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)


class CollectiveReceiver:
    """An engine worker's end of the group (a port of ``receiver.receive``)."""

    def __init__(self, group: CollectiveGroup) -> None:
        self.group, self.peer, self._bound = group, f"trainer rank 0 of {group.peer}", 1.0
        self._begun = self._over = self._settled = False
        self._due: p.Chunk | None = None  # a chunk whose tensors are still on the wire
        self.memo = p.Memo()

    def next(self, wait: Wait) -> tuple[p.Event, list[Handle] | None]:
        self._bound = wait.bound_s
        try:
            event, _ = decode(self.group.message(None, wait.what, wait.bound_s), {})
        except RefitError:
            self.group.broken = True  # rank 0 sent what no one can size: out of step
            raise
        self._over = isinstance(event, p.End | p.Abort)
        self._due = event if isinstance(event, p.Chunk) else None
        return event, None

    def answer(self, event: p.Event, problem: RefitError | None) -> None:
        if isinstance(event, p.Begin):
            self._settle(problem, "the start of the refit")

    def _settle(self, problem: RefitError | None, what: str) -> None:
        """A status round; one that raised ended the refit for every rank."""
        self._begun = True
        try:
            self.group.settle(problem, what, self._bound)
        except RefitError:
            self._settled = True
            raise

    def write(
        self, writes: p.Writes, handles: list[Handle] | None, sink: Sink
    ) -> list[tuple[str, torch.Tensor]]:
        problem: RefitError | None = None
        loader, buffers = [], []
        for ref, route in ((w.ref, w.route) for w in writes.writes):
            try:
                if route is p.Route.DIRECT:
                    dest = sink.target(ref.name)
                else:
                    dest = _empty(ref, self.group.device)
                    loader.append((ref.name, dest))
                buffers += [_flat(dest)] if dest.numel() else []
            except Exception as e:  # noqa: BLE001 - received into scratch, reported at the end
                problem = problem or RefitError(f"no destination for {ref.name!r}: {e}")
                buffers += _scratch([ref], self.group.device)
        self._due = None
        self.group.transfer(buffers, f"chunk {writes.chunk.index}'s tensors", self._bound)
        if problem is not None:
            raise problem
        return loader

    def fail(self, problem: RefitError, *, late: Wait | None) -> NoReturn:
        if not self._settled and not self.group.broken and not self._begun:
            self._settle(problem, "the start of the refit")
        while not self._settled and not self.group.broken:
            if self._due is not None:
                due, self._due = self._due, None
                self.group.transfer(
                    _scratch(due.tensors, self.group.device), "a failed chunk", self._bound
                )
            if self._over:
                self._settle(problem, "the end of the refit")
            self.next(Wait.of("the rest of a failed refit", self._bound))
        raise problem

    def finish(self, problem: RefitError | None) -> None:
        self._settle(problem, "the end of the refit (post-load processing)")

    def release(self, *, failed: bool) -> int:
        self._begun = self._over = self._settled = False
        self._due = None
        return 0

    def close(self) -> None:
        self.group.close()


class _Scratch:
    """Another trainer rank's sink: every tensor into scratch."""

    def __init__(self, manifest: Manifest, device: torch.device) -> None:
        self.manifest, self.device = manifest, device

    def target(self, name: str) -> torch.Tensor:
        spec = self.manifest.get(name)
        assert spec is not None
        return _empty(spec, self.device)

    def finish(self, names: Iterable[str]) -> None:
        return None


class CollectiveSenderPort:
    """A trainer rank's end, driven by ``RefitSender``: rank 0 broadcasts; the other
    trainer ranks follow it (:meth:`follow`)."""

    def __init__(self, group: CollectiveGroup, *, timeout_s: float, chunk_bytes: int) -> None:
        self.group, self.budget, self.peer = group, chunk_bytes, group.peer
        self._timeout = timeout_s
        self._chunk: list[tuple[TensorSpec, torch.Tensor]] = []
        self._chunks, self.refit_id = 0, ""

    def _emit(self, event: p.Event, what: str) -> None:
        self.group.message(encode(event), what, self._timeout)

    def begin(self, event: p.Begin) -> None:
        self.refit_id, self._chunks = event.refit_id, 0
        self._emit(event, "the start of the refit")
        self.group.settle(None, "the start of the refit", self._timeout)

    def route(self, tensor: torch.Tensor) -> tuple[p.SendRoute, object]:
        return p.SendRoute.PACK, None

    def put(
        self, tensor: torch.Tensor, spec: TensorSpec, route: object, placed: p.Placement
    ) -> None:
        self._chunk.append((spec, tensor))

    def flush(self) -> None:
        chunk, self._chunk = self._chunk, []
        index, self._chunks = self._chunks, self._chunks + 1
        sources = [_flat(t.to(self.group.device).contiguous()) for s, t in chunk if s.nbytes]
        refs = tuple(p.TensorRef(s.name, s.shape, s.dtype) for s, _ in chunk)
        self._emit(p.Chunk(self.refit_id, index, refs), f"chunk {index}")
        self.group.transfer(sources, f"chunk {index}'s tensors", self._timeout)

    def end(self, event: p.End) -> None:
        self._emit(event, "the end of the refit")
        self.group.settle(None, "the end of the refit", self._timeout)

    def abort(self, event: p.Abort) -> None:
        self._chunk = []
        if not self.group.broken:
            self._emit(event, "the abort")
            with contextlib.suppress(RefitError):
                self.group.settle(RefitError(event.reason), "the abort", self._timeout)

    def drop(self) -> None:
        self.group.broken = True  # interrupted between two collectives: out of step

    def close(self) -> None:
        self.group.close()

    def follow(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Another trainer rank: receive rank 0's refit into scratch, checked against
        this rank's own stream (its manifest); the tensors received."""
        port, rank = CollectiveReceiver(self.group), self.group.rank
        try:
            manifest = Manifest.from_specs(TensorSpec.of(n, t) for n, t in named_tensors).unwrap()
        except Exception as e:  # noqa: BLE001 - this rank's own stream failed: told to all
            port.next(Wait.of("rank 0's start of the refit", self._timeout))
            port.fail(
                RefitError(f"trainer rank {rank}'s tensor stream failed: {type(e).__name__}: {e}"),
                late=None,
            )
        sink, routes = _Scratch(manifest, self.group.device), p.Routes(frozenset(manifest.names))
        return receive(port, manifest, sink, routes=routes, timeout_s=self._timeout).tensors


class CollectiveBackend(Holding[CollectiveReceiver]):
    """The ``collective`` refit backend: this engine worker's place in the trainer's
    weight-update group (rank ``train_world_size + rank_prefix + worker rank``), offered
    to the other backends as ``EngineContext.group_port`` while joined."""

    def __init__(self, engine: EngineContext) -> None:
        self.engine = engine

    def init(self, join: GroupJoinWire) -> dict[str, object]:
        """Join the group (leaving any earlier one) as ``join`` (``GroupJoin.to_wire``)
        says, every rendezvous wait bounded."""
        where = unwrap(group_join(**join), BadArgumentError, "init_collective")
        self.close()
        rank, sizes = where.rank(self.engine.rank), (where.world_size, where.train_world_size)
        group = CollectiveGroup(
            where.ip, where.port, rank, *sizes, "engine", self.engine.device, where.timeout_s
        )
        self.held = self.engine.group_port = CollectiveReceiver(group)
        return {"rank": rank}

    def receive(self, timeout_s: float | None = None) -> dict[str, object]:
        """Receive one refit over the group into the engine."""
        if self.held is None:
            raise EngineStateError("update_weights_from_collective before init_collective")
        return self.engine.receive(self.held, timeout_s, sharded_ok=False)

    def status(self) -> dict[str, object]:
        return {"joined": self.held is not None}

    def close(self) -> int:
        if self.held is not None:
            self.engine.group_port = None
        return super().close()
