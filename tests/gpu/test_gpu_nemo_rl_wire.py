"""NeMo-RL's IPC refit wire with real CUDA IPC handles: a trainer process sends its pickled
bucket, genworker's allowlisted unpickler reads it, and the bytes map onto this GPU; then
NeMo-RL's whole IPC stream (``stream_weights_via_ipc_zmq_impl`` re-implemented on CUDA)
refits the session engine through the NeMo-RL-facing worker."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from gpu.gpu_fixtures import (
    CHILD_TIMEOUT_S,
    GPU_MARKS,
    PROMPTS,
    REFIT_TIMEOUT_S,
    Checkpoints,
    Child,
    GpuSession,
    Trainer,
    batch,
    free_port,
    generated,
    gpu_config,
    load_checkpoint,
    manifest,
    requires_two_gpus,
    session_engine,
)
from gpu.nemo_rl_wire_sender import (
    ALIGN,
    expected_tensors,
    nemo_rl_collective_engine_main,
    nemo_rl_collective_trainer_main,
    nemo_rl_trainer_main,
    sender_main,
)

from genworker.core.nemo_rl_wire import NEMO_RL_IPC_GLOBALS, IpcBucket
from genworker.shell.errors import EngineStateError, RefitError
from genworker.shell.nemo_rl import NemoRlGenerationWorker
from genworker.shell.refit.nemo_rl import CudaIpcCodec, read_frame
from genworker.shell.worker import ExistingEngine

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS


def test_a_nemo_rl_cuda_ipc_bucket_loads_and_maps_onto_this_gpu() -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    trainer = Trainer(sender_main, {})
    try:
        data = trainer.expect("message", CHILD_TIMEOUT_S)
        assert isinstance(data, bytes)
        bucket = read_frame(data, NEMO_RL_IPC_GLOBALS, CudaIpcCodec().read)
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


def test_nemo_rl_s_ipc_stream_refits_the_gpu_engine_through_the_nemo_rl_worker(
    gpu_session: GpuSession, reference_b: list[list[int]]
) -> None:
    ckpt = gpu_session.checkpoints
    socket_dir = tempfile.mkdtemp(prefix="nrl-")
    nemo = NemoRlGenerationWorker(
        gpu_config(ckpt.a, ckpt.pad),
        [0],
        engine_factory=ExistingEngine(session_engine(gpu_session)),
        ipc_socket_dir=socket_dir,
    )
    assert nemo._worker is not None
    (address,) = nemo._worker.call_engine_workers("nemo_rl_ipc_socket_dir", socket_dir)
    assert isinstance(address, str)
    assert address.startswith(f"ipc://{socket_dir}/GPU-")  # NeMo-RL's <GPU UUID>.sock
    data = batch(PROMPTS, ckpt.pad)
    trainer = Trainer(nemo_rl_trainer_main, {"address": address})
    try:
        for path, evil, expected in (
            (ckpt.b, None, reference_b),
            (ckpt.a, "os.system", None),
            (ckpt.a, None, gpu_session.baseline_a),
        ):
            assert nemo.prepare_refit_info(manifest(path)) is None
            trainer.send("send", (str(path), evil))
            ok = nemo.update_weights_via_ipc_zmq(refit_timeout_s=REFIT_TIMEOUT_S)
            sent = trainer.expect("sent")
            assert isinstance(sent, dict)
            assert sent["answer"] == "ack"  # the trainer's stream ended, every message answered
            if expected is None:
                assert ok is False
                assert isinstance(nemo.last_refit_error, RefitError)
                assert "posix.system" in str(nemo.last_refit_error)
                with pytest.raises(EngineStateError, match="refit"):
                    nemo.generate(data, greedy=True)
                continue
            assert ok is True, nemo.last_refit_error
            assert sent["groups"] >= 1
            assert generated(nemo.generate(data, greedy=True), data) == expected
    finally:
        trainer.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)


@requires_two_gpus
def test_nemo_rl_s_packed_broadcasts_refit_an_engine_on_gpu1_from_a_trainer_on_gpu0(
    gpu_session: GpuSession, checkpoints: Checkpoints, reference_b: list[list[int]]
) -> None:
    port = free_port()
    config = gpu_config(checkpoints.a, checkpoints.pad)
    engine = Child(
        nemo_rl_collective_engine_main,
        gpu=1,
        config=config,
        checkpoint=str(checkpoints.b),
        pad=checkpoints.pad,
        port=port,
    )
    trainer = Child(
        nemo_rl_collective_trainer_main, checkpoint=str(checkpoints.b), port=port, gpu=0
    )
    sent = trainer.result()
    got = engine.result()
    assert sent == sum(
        t.numel() * t.element_size() for t in load_checkpoint(checkpoints.b, "cpu").values()
    )
    assert isinstance(got, dict)
    assert got["before"] == gpu_session.baseline_a
    assert got["after"] == reference_b
