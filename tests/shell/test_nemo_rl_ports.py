"""The receiver of NeMo-RL's packed broadcasts, alone (no engine): a trainer thread plays
NeMo-RL's ``packed_broadcast_producer`` over the gloo stand-in, the port feeds
``receive`` into preallocated tensors; a failure keeps the receiver in step with the
trainer, which broadcasts every group whatever happened."""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Mapping
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from refit_helpers import FailingSink, free_port, random_state_dict, zeros_like_all
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from genworker.core.joins import GroupJoin
from genworker.core.nemo_rl_refit import packed_groups
from genworker.shell.errors import BadConfigError, RefitError
from genworker.shell.refit import IpcReceiver, ParameterSink, manifest_of, receive
from genworker.shell.refit.nemo_rl import NemoRlCollectivePort, NemoRlGroup, packed_target_bytes

TIMEOUT_S = 30.0


class NemoRlTrainerThread:
    """Trainer rank 0: the store master, the gloo group, the warm-up, then per refit the
    tensors as packed groups (closing once over ``target`` bytes)."""

    def __init__(self, port: int) -> None:
        self.errors: list[BaseException] = []
        self._port = port
        self._ready = threading.Event()
        self.pg: Any = None
        threading.Thread(target=self._join, daemon=True).start()

    def _join(self) -> None:
        timeout = dt.timedelta(seconds=TIMEOUT_S)
        try:
            self.store = TCPStore("127.0.0.1", self._port, 2, True, timeout=timeout)
            self.pg = ProcessGroupGloo(PrefixStore("nemo-rl-gloo/", self.store), 0, 2, timeout)
            self._broadcast(torch.ones(1))
        except BaseException as e:  # noqa: BLE001 - checked by the test
            self.errors.append(e)
        self._ready.set()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        assert self.pg is not None
        self.pg.broadcast([tensor], options).wait()

    def send(self, tensors: Mapping[str, torch.Tensor], target: int) -> threading.Thread:
        def run() -> None:
            self._ready.wait(TIMEOUT_S)
            try:
                group: list[torch.Tensor] = []
                size = 0
                for tensor in tensors.values():
                    group.append(tensor.contiguous().reshape(-1).view(torch.uint8))
                    size += group[-1].numel()
                    if size > target:
                        self._broadcast(torch.cat(group))
                        group, size = [], 0
                if group:
                    self._broadcast(torch.cat(group))
            except BaseException as e:  # noqa: BLE001 - checked by the test
                self.errors.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def _refit(
    group: NemoRlGroup,
    tensors: Mapping[str, torch.Tensor],
    sink: ParameterSink,
    target: int,
    n: int,
) -> int:
    manifest = manifest_of(tensors)
    groups = packed_groups(manifest, target)
    port = NemoRlCollectivePort(group, manifest, groups, f"nemo-rl-collective-{n}")
    report = receive(
        cast(IpcReceiver, port), manifest, sink, routes=sink.routes, timeout_s=TIMEOUT_S
    )
    return report.tensors


@pytest.mark.parametrize("target", [0, 700, 1 << 20])
def test_packed_broadcasts_land_in_every_tensor_and_a_failure_stays_in_step(target: int) -> None:
    tensors = random_state_dict(3)
    port = free_port()
    trainer = NemoRlTrainerThread(port)
    group = NemoRlGroup(GroupJoin(0, "127.0.0.1", port, 2, 1, TIMEOUT_S), 1, torch.device("cpu"))
    try:
        groups = packed_groups(manifest_of(tensors), target)
        assert (len(groups) == 1) is (target > 1000)
        # a refit whose sink breaks at its third tensor: raised typed, the rest still taken
        sent = trainer.send(tensors, target)
        failing = FailingSink(zeros_like_all(tensors), fail_at=2)
        with pytest.raises(RefitError, match="broke while storing"):
            _refit(group, tensors, failing, target, 1)
        sent.join(TIMEOUT_S)
        assert not sent.is_alive()
        assert trainer.errors == []
        # the next refit is whole
        params = zeros_like_all(tensors)
        sent = trainer.send(tensors, target)
        assert _refit(group, tensors, ParameterSink(params), target, 2) == len(tensors)
        sent.join(TIMEOUT_S)
        assert trainer.errors == []
        for name, tensor in tensors.items():
            assert torch.equal(params[name], tensor), name
    finally:
        group.close()


def test_a_group_nemo_rl_could_not_form_is_refused_before_any_socket() -> None:
    with pytest.raises(BadConfigError, match="rank 0 would be a trainer rank"):
        NemoRlGroup(GroupJoin(0, "127.0.0.1", free_port(), 2, 1, 1.0), 0, torch.device("cpu"))
    with pytest.raises(BadConfigError, match="port 0"):
        NemoRlGroup(GroupJoin(0, "127.0.0.1", 0, 2, 1, 1.0), 1, torch.device("cpu"))


def test_the_packing_target_is_nemo_rls_rule() -> None:
    cpu = torch.device("cpu")
    default = packed_target_bytes(cpu, {})
    assert 0 < default <= 5 << 30
    assert packed_target_bytes(cpu, {"NRL_REFIT_BUFFER_MEMORY_RATIO": "1e-9"}) < default
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default == min(int(total * 0.02), 5 << 30)
    assert packed_target_bytes(cpu, {"NRL_REFIT_BUFFER_MEMORY_RATIO": "1"}) == min(total, 5 << 30)
    for bad in ("x", "0", "-1", "2"):
        with pytest.raises(BadConfigError, match="NRL_REFIT_BUFFER_MEMORY_RATIO"):
            packed_target_bytes(cpu, {"NRL_REFIT_BUFFER_MEMORY_RATIO": bad})
