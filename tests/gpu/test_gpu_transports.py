"""The refit transports on CUDA without an engine: CUDA IPC between two processes on one
GPU (buckets, oversized tensors, a sender dying mid-refit) and NCCL across two GPUs."""

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

from genworker.shell.errors import RefitTimeoutError
from genworker.shell.refit.ipc import IpcReceiver
from genworker.shell.refit.packing import DEFAULT_BUCKET_BYTES
from genworker.shell.refit.session import ParameterSink, manifest_of, receive_refit

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS


def _receive(receiver: IpcReceiver, timeout_s: float) -> tuple[dict[str, torch.Tensor], int]:
    expected = fake_state_dict("cuda")
    params = zeros_like(expected)
    report = receive_refit(
        receiver, manifest_of(expected), ParameterSink(params), timeout_s=timeout_s
    )
    for name, tensor in expected.items():
        assert torch.equal(params[name], tensor), name
    return params, report.tensors


# 4 KiB buckets: many buckets, both staging buffers, oversized tensors in their own buffer;
# direct: the trainer writes into the receiver's tensors through their CUDA IPC handles.
@pytest.mark.parametrize(
    ("bucket_bytes", "direct", "mode"),
    [
        (4096, False, "buckets"),
        (DEFAULT_BUCKET_BYTES, False, "buckets"),
        (DEFAULT_BUCKET_BYTES, True, "engine-handles"),
    ],
)
def test_cuda_ipc_round_trip_between_processes_on_one_gpu(
    bucket_bytes: int, direct: bool, mode: str
) -> None:
    receiver = IpcReceiver(torch.device("cuda", 0))
    try:
        sender = Child(
            ipc_fake_sender_main,
            address=receiver.address,
            bucket_bytes=bucket_bytes,
            direct=direct,
        )
        _, tensors = _receive(receiver, timeout_s=120.0)
        sent = sender.result()
    finally:
        receiver.close()
    assert isinstance(sent, dict)
    assert sent["tensors"] == tensors == len(fake_state_dict("cpu"))
    assert sent["mode"] == mode


def test_cuda_ipc_sender_dying_mid_refit_times_out_and_the_next_refit_works() -> None:
    receiver = IpcReceiver(torch.device("cuda", 0))
    ready = mp.get_context("spawn").Event()
    try:
        dying = Child(
            ipc_fake_sender_main,
            address=receiver.address,
            bucket_bytes=4096,
            die_after=4,
            ready=ready,
            direct=False,
        )
        assert ready.wait(CHILD_TIMEOUT_S), "the sender never got ready"
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError, match=r"within 5\.0s"):
            _receive(receiver, timeout_s=5.0)
        assert time.monotonic() - started < 10.0
        with pytest.raises(RuntimeError, match="exit code 17"):
            dying.result()
        receiver.reset()
        sender = Child(ipc_fake_sender_main, address=receiver.address, bucket_bytes=4096)
        _, tensors = _receive(receiver, timeout_s=120.0)
        assert sender.result() is not None
    finally:
        receiver.close()
    assert tensors == len(fake_state_dict("cpu"))


@requires_two_gpus
@pytest.mark.parametrize(
    ("bucket_bytes", "direct"), [(4096, False), (DEFAULT_BUCKET_BYTES, False), (4096, True)]
)
def test_nccl_round_trip_between_two_gpus(bucket_bytes: int, direct: bool) -> None:
    port = free_port()
    receiver = Child(collective_fake_receiver_main, gpu=1, port=port)
    sender = Child(
        collective_fake_sender_main, gpu=0, port=port, bucket_bytes=bucket_bytes, direct=direct
    )
    sent = sender.result()
    assert receiver.result() is True
    assert sent == sum(t.numel() * t.element_size() for t in fake_state_dict("cpu").values())
