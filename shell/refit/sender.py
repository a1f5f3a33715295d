"""The trainer's one sender: ``RefitSender.ipc(address)`` for an engine on this host,
``RefitSender.collective(ip, port, world_size)`` for a weight-update group; then
``send(named_tensors)`` per refit, the stream walked once, lazily, chunk by chunk
(``core.refit_protocol``: ``send_route`` and ``ChunkPlan`` decide, the port moves the
bytes). A failure of the trainer's own stream aborts the refit on every peer before it
is raised; a peer's or the transport's is raised typed, naming the wait.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from genworker.core import refit_protocol as p
from genworker.core.refit_plan import Manifest, TensorSpec, bucket_budget
from genworker.core.refit_transport import sender_digest
from genworker.shell.errors import BadConfigError, RefitError, unwrap
from genworker.shell.refit.collective import CollectiveGroup, CollectiveSenderPort
from genworker.shell.refit.ipc import IpcSenderPort
from genworker.shell.refit.receiver import Laps, typed_error

__all__ = ["RefitSender"]

Info = Manifest | Mapping[str, object] | None


def _spec(memo: dict[object, TensorSpec], name: str, tensor: torch.Tensor) -> TensorSpec:
    """The tensor's spec (remembered: a refit usually sends what the last one sent)."""
    key = (name, tensor.shape, tensor.dtype)
    spec = memo.get(key)
    if spec is None:
        try:
            spec = memo[key] = TensorSpec.of(name, tensor)
        except (ValueError, AttributeError, TypeError) as e:
            raise ValueError(f"tensor {name!r} cannot travel in a refit: {e}") from e
    return spec


class RefitSender:
    """Sends refits to one engine worker (IPC) or a weight-update group.

    ``manifest`` (a :class:`Manifest` or the ``{name: (shape, dtype)}`` given to
    ``prepare_refit_info``) lets the engine refuse a refit meant for another one before
    anything moves; ``timeout_s`` bounds every wait (``None``: the protocol's default).
    ``close()`` frees the sender's staging buffers, handles and socket or group; the
    engine lets go of its mappings of this trainer's memory at the first refit that does
    not send them, or at once on ``worker.release_refit_buffers()``.
    """

    def __init__(
        self, port: IpcSenderPort | CollectiveSenderPort, manifest: Info, timeout_s: float
    ):
        self._port, self._timeout, self._specs = port, timeout_s, dict[object, TensorSpec]()
        self._busy = threading.Lock()
        self._digest = unwrap(sender_digest(manifest), BadConfigError, "invalid refit manifest")

    @classmethod
    def ipc(
        cls,
        address: str,
        *,
        manifest: Info = None,
        timeout_s: float | None = None,
        staging_bytes: int = p.DEFAULT_STAGING_BYTES,
        device: torch.device | str | None = None,
        staging_dir: str | Path | None = None,
    ) -> RefitSender:
        """To the engine worker at ``address`` (``worker.refit_address()``). Packed tensors
        go through two staging buffers of ``staging_bytes`` on ``device`` (default: that
        of the first tensor), in a private directory in ``staging_dir`` (/dev/shm) on CPU."""
        bound = unwrap(p.wait_bound(timeout_s), BadConfigError, "RefitSender")
        budget = unwrap(bucket_budget(staging_bytes), BadConfigError, "staging_bytes")
        where = torch.device(device) if device is not None else None
        port = IpcSenderPort(
            address, timeout_s=bound, staging_bytes=budget, device=where, staging_dir=staging_dir
        )
        return cls(port, manifest, bound)

    @classmethod
    def collective(
        cls,
        ip: str,
        port: int,
        world_size: int,
        *,
        rank: int = 0,
        train_world_size: int = 1,
        device: torch.device | str = "cpu",
        manifest: Info = None,
        timeout_s: float | None = None,
        chunk_bytes: int = 1 << 30,
    ) -> RefitSender:
        """Trainer rank ``rank`` of the group at ``ip:port`` (rank 0 hosts its store; this
        blocks until every rank joined: start the engines' ``init_collective`` alongside).
        Every trainer rank sends the same stream; rank 0's is what the engines receive. A
        chunk's broadcasts (up to ``chunk_bytes``) are one NCCL group call."""
        bound = unwrap(p.wait_bound(timeout_s), BadConfigError, "RefitSender")
        budget = unwrap(bucket_budget(chunk_bytes), BadConfigError, "chunk_bytes")
        where = (ip, port, rank, world_size, train_world_size)
        group = CollectiveGroup(*where, "trainer", torch.device(device), bound)
        sender = CollectiveSenderPort(group, timeout_s=bound, chunk_bytes=budget)
        return cls(sender, manifest, bound)

    @property
    def group(self) -> CollectiveGroup | None:
        """The weight-update group of a collective sender."""
        return self._port.group if isinstance(self._port, CollectiveSenderPort) else None

    @contextlib.contextmanager
    def _alone(self, verb: str) -> Iterator[None]:
        """One refit at a time: a call while one is being sent (from another thread, or
        from its own tensor stream) fails at once and leaves that refit be; it never waits,
        since two threads sharing a sender is the trainer's bug (failure-modes R10)."""
        if not self._busy.acquire(blocking=False):
            raise RefitError(
                f"cannot {verb}: another thread is sending a refit on this sender (to "
                f"{self._port.peer}); a RefitSender sends one refit at a time"
            )
        try:
            yield
        finally:
            self._busy.release()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> p.RefitReport:
        """Send one refit; a typed :class:`RefitError` on any failure, and at once while
        another thread sends one on this sender."""
        with self._alone("send a refit"):
            return self._send(named_tensors)

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> p.RefitReport:
        started, laps, port = time.monotonic(), Laps(), self._port
        if isinstance(port, CollectiveSenderPort) and port.group.rank:
            return p.RefitReport(port.follow(named_tensors), 0, 0, time.monotonic() - started)
        refit_id = secrets.token_hex(8)
        try:
            port.begin(p.Begin(refit_id, self._digest))
            laps.lap("begin")
            plan = p.ChunkPlan(port.budget, self._timeout / 2, time.monotonic())
            tensors = nbytes = handles = 0
            stream: Iterator[tuple[str, torch.Tensor]] = iter(named_tensors)
            ipc = port if isinstance(port, IpcSenderPort) else None
            while True:
                try:
                    item = next(stream, None)
                    if ipc is not None:  # the last refit's tensors again: its chunks again
                        late = time.monotonic() - plan.opened_at >= plan.flush_after_s
                        sent = ipc.take(None if late else item)
                        if sent is not None:
                            n, size, by_handle = sent
                            tensors, nbytes = tensors + n, nbytes + size
                            handles += by_handle
                            plan = plan.flushed(time.monotonic()) if n else plan
                            continue
                        stream = itertools.chain(ipc.held, [item] if item else [], stream)
                        ipc = None
                        continue
                    if item is None:
                        break
                    spec = _spec(self._specs, *item)
                    route = port.route(item[1])
                    placed = plan.place(route[0], spec.nbytes, time.monotonic())
                    if placed.flush:
                        port.flush()
                    port.put(item[1], spec, route, placed)
                except RefitError:
                    raise
                except Exception as e:  # our own failure: the peers are told, then it is raised
                    local = typed_error(e, "the trainer's tensor stream failed")
                    port.abort(p.Abort(refit_id, str(local)))
                    raise local from e
                plan, tensors, nbytes = placed.plan, tensors + 1, nbytes + spec.nbytes
                handles += route[0] is p.SendRoute.HANDLE
                if placed.alone:
                    port.flush()
                    plan = plan.flushed(time.monotonic())
            if plan.tensors:
                port.flush()
                plan = plan.flushed(time.monotonic())
            laps.lap("chunks")
            port.end(p.End(refit_id, plan.index, tensors))
            laps.lap("end")
        except RefitError:
            raise  # the port is in step with its peers (or knows it is broken)
        except BaseException:
            port.drop()  # an interrupt
            raise
        elapsed = time.monotonic() - started
        return p.RefitReport(
            tensors, nbytes, plan.index, elapsed, handles, tensors - handles, 0, laps.seconds
        )

    def close(self) -> None:
        """Free the staging buffers, the handles and the socket or group (a
        :class:`RefitError` at once while another thread sends a refit on this sender)."""
        with self._alone("close the sender"):
            self._port.close()

    def __enter__(self) -> RefitSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
