"""The engine side of a refit, for both transports: events into the core machine, its
decisions into memory.

:func:`receive` takes each event from a port (one wait, bounded by the per-wait bound),
feeds it to :class:`~genworker.core.refit_protocol.Receiver` and executes the decision: a
chunk's tensors go straight into their parameters (the :class:`Sink`'s targets) or to the
weight loader, the port answering each message once its bytes are out of the sender's
storages; after End the sink runs post-load processing and the port answers last. A
failure is told to the peer by the port (``fail``: the pending message's answer, or the
collective's last status round) and raised typed, so the peer always learns the outcome
(failure-modes R1/C1). The loader pulls from a generator that never raises into it: a
failure ends the stream, so vLLM's layerwise reload (``model_loader/reload``, 0.32)
restores its layers before :func:`receive` raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

import attrs
import torch
from returns.result import Failure

from genworker.core import refit_protocol as p
from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.shell.errors import RefitError, RefitManifestError, RefitTimeoutError

if TYPE_CHECKING:
    from genworker.shell.ports import RefitPort

__all__ = ["Laps", "ParameterSink", "Sink", "Wait", "manifest_of", "receive", "typed_error"]

Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], object]
#: A chunk's received tensors checked before the weight loader sees them (raises typed).
Check = Callable[[list[tuple[str, torch.Tensor]], str], None]


class Laps:
    """Where a refit's time goes: ``lap(name)`` adds the time since the previous lap."""

    def __init__(self) -> None:
        self._last, self.seconds = time.monotonic(), dict[str, float]()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


@attrs.frozen
class Wait:
    """One bounded wait: for what, its bound, and when it expires (``time.monotonic``)."""

    what: str
    bound_s: float
    deadline: float

    @classmethod
    def of(cls, what: str, bound_s: float) -> Wait:
        return cls(what, bound_s, time.monotonic() + bound_s)

    def expired(self, peer: str) -> RefitTimeoutError:
        return RefitTimeoutError(
            f"{peer} sent nothing within {self.bound_s:g}s: waited for {self.what}"
        )

    def unconnected(self, address: str, *, gone: bool) -> RefitTimeoutError:
        """No trainer is connected to ``address`` (said so, not "sent nothing");
        ``gone``: one was, and went away."""
        why = "one connected earlier and went away" if gone else "is the trainer sending here?"
        return RefitTimeoutError(
            f"no trainer connected to {address} within {self.bound_s:g}s: waited for "
            f"{self.what} ({why})"
        )


class Sink(Protocol):
    """Where direct tensors go: each one's contiguous memory, and post-load processing."""

    @property
    def device(self) -> torch.device: ...

    def target(self, name: str) -> torch.Tensor: ...

    def finish(self, names: Iterable[str]) -> None: ...


def manifest_of(tensors: Mapping[str, torch.Tensor]) -> Manifest:
    return Manifest.from_specs(TensorSpec.of(n, t) for n, t in tensors.items()).unwrap()


class ParameterSink:
    """Every tensor straight into a preallocated tensor of the same name (tests, bench)."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params, self.routes = params, p.Routes(frozenset(params))
        self.device = next(iter(params.values())).device if params else torch.device("cpu")

    def target(self, name: str) -> torch.Tensor:
        return self.params[name]

    def finish(self, names: Iterable[str]) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def typed_error(error: BaseException, context: str) -> RefitError:
    """``error`` as a :class:`RefitError`: itself when it is one, else one saying
    ``context``, its type and its text (caused by it)."""
    if isinstance(error, RefitError):
        return error
    wrapped = RefitError(f"{context}: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


class _Session:
    def __init__(
        self,
        port: RefitPort,
        manifest: Manifest,
        routes: p.Routes,
        sink: Sink,
        timeout_s: float,
        check: Check | None = None,
    ) -> None:
        self.port, self.sink, self.timeout_s, self.check = port, sink, timeout_s, check
        self.machine = p.Receiver(manifest, routes, memo=port.memo)
        self.laps, self.started = Laps(), time.monotonic()
        self.error: RefitError | None = None
        self.finished = False
        self.direct: list[str] = []
        self.loaded = self.nbytes = 0

    def wait(self) -> Wait:
        return Wait.of(self.machine.awaiting, self.timeout_s)

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            yield from self._run()
        except RefitError as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - a bug on our side still ends the refit typed
            self.error = typed_error(e, f"receiving the refit from {self.port.peer} failed")

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        wait = self.wait()
        while True:
            event, handles = self.port.next(wait)
            self.laps.lap("wait")
            result = self.machine.handle(event)
            if isinstance(result, Failure):
                refusal = result.failure()
                typed = RefitManifestError if refusal.detail else RefitError
                error = typed(str(refusal), detail=refusal.detail)
                if refusal.fatal:
                    raise error
                self.port.answer(event, error)  # a stray before Begin: answered, ignored
                continue
            self.machine, decision = result.unwrap().receiver, result.unwrap().decision
            if isinstance(decision, p.Aborted):
                raise RefitError(
                    f"the trainer at {self.port.peer} aborted the refit: {decision.reason}"
                )
            if isinstance(decision, p.Finished):
                self.finished, self.port.memo = True, self.machine.remembered()
                return
            loader: list[tuple[str, torch.Tensor]] = []
            if isinstance(decision, p.Writes):
                loader = self.port.write(decision, handles, self.sink)
                if self.check is not None:  # before the loader sees any of the chunk
                    direct = [(n, self.sink.target(n)) for n in decision.direct]
                    self.check([*direct, *loader], f"chunk {decision.chunk.index}")
                self.direct += decision.direct
                self.loaded, self.nbytes = self.loaded + len(loader), self.nbytes + decision.nbytes
                self.laps.lap("write")
            self.port.answer(event, None)
            wait = self.wait()
            yield from loader
            self.laps.lap("load")

    def conclude(self, loader_error: BaseException | None) -> p.RefitReport:
        failed = True
        try:
            if self.error is not None:
                self.port.fail(self.error, late=None)
            if loader_error is not None:
                error = typed_error(loader_error, "loading the received weights failed")
                self.port.fail(error, late=self.wait())
            if not self.finished:
                error = RefitError("the weight loader stopped before the refit ended")
                self.port.fail(error, late=self.wait())
            problem = None
            try:
                self.sink.finish(self.direct)
            except Exception as e:  # noqa: BLE001 - answered to the peer as a typed error
                problem = typed_error(e, "post-load processing failed")
            self.laps.lap("finalize")
            self.port.finish(problem)
            self.laps.lap("answer")
            failed = False
        finally:
            mapped = self.port.release(failed=failed)
        counts = (len(self.machine.received), self.nbytes, self.machine.chunks)
        elapsed, loaded = time.monotonic() - self.started, (len(self.direct), self.loaded)
        return p.RefitReport(*counts, elapsed, *loaded, mapped, dict(self.laps.seconds))


def _no_loader(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    for name, _ in weights:
        raise RefitError(f"tensor {name!r} needs a weight loader, and none was given")


def receive(
    port: RefitPort,
    manifest: Manifest,
    sink: Sink,
    *,
    routes: p.Routes,
    timeout_s: float,
    loader: Loader | None = None,
    check: Check | None = None,
) -> p.RefitReport:
    """Receive one refit; every wait bounded by ``timeout_s``; ``check`` each chunk's
    tensors once written (the engine's non-finite check), before the loader takes them."""
    session = _Session(port, manifest, routes, sink, timeout_s, check)
    loader_error: BaseException | None = None
    try:
        (loader or _no_loader)(session.stream())
    except Exception as e:  # noqa: BLE001 - reported to the peer, raised by conclude()
        loader_error = e
    return session.conclude(loader_error)
