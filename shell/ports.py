"""Ports: what the shell needs from the outside world, as Protocols.

Each port has one adapter per runtime (``vllm_engine.VllmEngine`` for vLLM) and a fake
beside it (``fake_engine.FakeEngine``) that tests and users' own tests use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from genworker.core.assembly import FlatGenerations
from genworker.core.counters import MetricSample
from genworker.core.sampling import SamplingSpec

__all__ = ["EngineCapabilities", "EngineFactory", "EnginePort"]


@attrs.frozen
class EngineCapabilities:
    """What the running engine can do, found by capability checks, never by version."""

    sleep_mode: bool
    flat_logprobs: bool
    vocab_size: int | None
    max_model_len: int
    device: str
    sampling_args: frozenset[str] | None = None


class EnginePort(Protocol):
    """A generation engine: token-id and text generation, sleep/wake, metrics, RPC."""

    @property
    def capabilities(self) -> EngineCapabilities: ...

    def generate(
        self, prompts: Sequence[Sequence[int]], specs: Sequence[SamplingSpec]
    ) -> FlatGenerations:
        """The batch's generations as flat arrays, rows in prompt order; ``specs[i]``
        applies to prompt i."""
        ...

    def generate_text(self, prompts: Sequence[str], specs: Sequence[SamplingSpec]) -> list[str]:
        """One completion text per prompt, in prompt order; every spec has
        ``detokenize=True`` (``sampling_spec(text=True)``)."""
        ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: Sequence[str] | None) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def metrics(self) -> list[MetricSample]: ...

    def collective_rpc(
        self,
        method: str,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
        timeout: float | None = None,
    ) -> list[object]:
        """Call ``method`` of the worker extension on every engine worker; one result each."""
        ...

    def device_ids(self) -> list[str]: ...

    def start_profile(self) -> None: ...

    def stop_profile(self) -> None: ...

    def shutdown(self) -> None: ...


class EngineFactory(Protocol):
    """Starts engines: what the worker needs to plan and build one."""

    def arg_names(self) -> frozenset[str] | None:
        """The installed engine's argument names (None: accept every planned argument)."""
        ...

    def gpu_capability(self) -> tuple[int, int] | None:
        """The local GPU's compute capability, None without a GPU."""
        ...

    def start(self, kwargs: Mapping[str, object]) -> EnginePort: ...
