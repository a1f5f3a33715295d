"""The refit transports on CUDA without an engine: CUDA IPC between two processes on one
GPU (staging, oversized tensors, kept handles, a sender dying mid-refit) and NCCL across two GPUs."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch
from gpu.gpu_fixtures import (
    CHILD_TIMEOUT_S,
    GPU_MARKS,
    Child,
    collective_fake_receiver_main,
    collective_fake_sender_main,
    fake_state_dict,
    free_port,
    ipc_fake_sender_main,
    requires_two_gpus,
    zeros_like,
)

from genworker.core.refit_protocol import DEFAULT_STAGING_BYTES
from genworker.shell.errors import RefitTimeoutError
from genworker.shell.refit import IpcReceiver, fake

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS


def _receive(receiver: IpcReceiver, timeout_s: float) -> int:
    expected = fake_state_dict("cuda")
    params = zeros_like(expected)
    report = fake.receive_into(receiver, params, timeout_s=timeout_s)
    for name, tensor in expected.items():
        assert torch.equal(params[name], tensor), name
    return report.tensors


# 4 KiB staging: many chunks, both staging buffers, oversized tensors in temporary copies;
# the second and third refits send six tensors by the handles of their storages (all but
# the strided and the empty one, small ones too).
@pytest.mark.parametrize("staging_bytes", [4096, DEFAULT_STAGING_BYTES])
def test_cuda_ipc_round_trips_between_processes_on_one_gpu(staging_bytes: int) -> None:
    receiver = IpcReceiver(torch.device("cuda", 0))
    try:
        sender = Child(
            ipc_fake_sender_main, address=receiver.address, staging_bytes=staging_bytes, refits=3
        )
        tensors = [_receive(receiver, timeout_s=120.0) for _ in range(3)]
        sent = sender.result()
    finally:
        receiver.close()
    assert isinstance(sent, list)
    assert [s["tensors"] for s in sent] == tensors == [len(fake_state_dict("cpu"))] * 3
    assert [s["handles"] for s in sent] == [0, 6, 6]


def test_cuda_ipc_sender_dying_mid_refit_times_out_and_the_next_refit_works() -> None:
    receiver = IpcReceiver(torch.device("cuda", 0))
    ready = mp.get_context("spawn").Event()
    try:
        dying = Child(
            ipc_fake_sender_main,
            address=receiver.address,
            staging_bytes=4096,
            die_after=4,
            ready=ready,
        )
        assert ready.wait(CHILD_TIMEOUT_S), "the sender never got ready"
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError, match=r"within 5s"):
            _receive(receiver, timeout_s=5.0)
        assert time.monotonic() - started < 10.0
        with pytest.raises(RuntimeError, match="exit code 17"):
            dying.result()
        sender = Child(ipc_fake_sender_main, address=receiver.address, staging_bytes=4096)
        tensors = _receive(receiver, timeout_s=120.0)
        assert sender.result() is not None
    finally:
        receiver.close()
    assert tensors == len(fake_state_dict("cpu"))


@requires_two_gpus
@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 30])
def test_nccl_round_trip_between_two_gpus(chunk_bytes: int) -> None:
    port = free_port()
    receiver = Child(collective_fake_receiver_main, gpu=1, port=port)
    sender = Child(collective_fake_sender_main, gpu=0, port=port, chunk_bytes=chunk_bytes)
    sent = sender.result()
    assert receiver.result() is True
    assert sent == sum(t.numel() * t.element_size() for t in fake_state_dict("cpu").values())
