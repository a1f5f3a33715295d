"""NeMo-RL's IPC refit wire with real CUDA IPC handles: a trainer process sends its pickled
bucket, genworker's allowlisted unpickler reads it, and the bytes map onto this GPU."""

from __future__ import annotations

import torch
from gpu.gpu_fixtures import CHILD_TIMEOUT_S, GPU_MARKS, Trainer
from gpu.nemo_rl_wire_sender import ALIGN, expected_tensors, sender_main

from genworker.shell.nemo_rl_wire import IpcBucket, loads, read_message

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS


def test_a_nemo_rl_cuda_ipc_bucket_loads_and_maps_onto_this_gpu() -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    trainer = Trainer(sender_main, {})
    try:
        data = trainer.expect("message", CHILD_TIMEOUT_S)
        assert isinstance(data, bytes)
        bucket = read_message(loads(data))
        assert isinstance(bucket, IpcBucket)
        assert bucket.handle.dtype is torch.uint8
        args = bucket.handle.rebuild_args(torch.cuda.current_device())
        buffer = rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]
        expected = expected_tensors("cuda")
        assert bucket.names == tuple(expected)
        offset = 0
        for name, tensor in expected.items():
            got = buffer[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            assert torch.equal(got, tensor), name
            offset += (tensor.nbytes + ALIGN - 1) // ALIGN * ALIGN
        assert offset == bucket.used_bytes
        del buffer, got
        torch.cuda.synchronize()
    finally:
        trainer.stop()
