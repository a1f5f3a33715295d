"""Refit peers for tests and benchmarks, in place of an engine: the engine end of a local
weight-update group, and a receiver that writes every tensor into a dict of tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from genworker.core.refit_protocol import RefitReport
from genworker.shell.refit.collective import CollectiveGroup
from genworker.shell.refit.receiver import Check, Loader, ParameterSink, manifest_of, receive

if TYPE_CHECKING:
    from genworker.shell.ports import RefitPort

__all__ = ["engine_group", "receive_into"]


def engine_group(
    port: int,
    *,
    timeout_s: float,
    device: torch.device | None = None,
    rank: int = 1,
    world_size: int = 2,
    train_world_size: int = 1,
) -> CollectiveGroup:
    """An engine's end of a weight-update group on this host's ``port`` (default: rank 1
    of 2, after one trainer rank; on the CPU, over gloo)."""
    device = device or torch.device("cpu")
    return CollectiveGroup(
        "127.0.0.1", port, rank, world_size, train_world_size, "engine", device, timeout_s
    )


def receive_into(
    port: RefitPort,
    params: Mapping[str, torch.Tensor],
    *,
    timeout_s: float,
    direct: Mapping[str, torch.Tensor] | None = None,
    loader: Loader | None = None,
    check: Check | None = None,
) -> RefitReport:
    """Receive one refit of ``params``' names, shapes and dtypes straight into ``params``
    (only those in ``direct`` when given; the others go to ``loader``); ``check``: each
    chunk's tensors, as the engine's non-finite check does."""
    sink = ParameterSink(params if direct is None else direct)
    manifest, routes = manifest_of(params), sink.routes
    return receive(
        port, manifest, sink, routes=routes, timeout_s=timeout_s, loader=loader, check=check
    )
