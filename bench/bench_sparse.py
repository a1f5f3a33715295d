"""Sparse-delta refit on CPU: one AdamW step at lr 1e-6 on a ~100M-parameter bf16 model.

The model is a GPT-2-small-like shape list (vocab 20000, hidden 768, 12 layers with
fused qkv, mlp 3072): 100.4M parameters, 200.8 MB in bf16. Its fp32 master weights are
drawn from N(0, 0.02) and trained by ``torch.optim.AdamW(lr=1e-6, weight_decay=0.01)``
on random N(0, 1) gradients: two warm-up steps (so Adam's moments are not at their
first-step values), then the measured step. The refit carries the bf16 cast of the
master weights before and after it.

- ``sparse_wire_fraction``: bytes the sender put on the wire for the delta step (frame
  headers and zstd payloads) over the model's bf16 bytes;
- ``sparse_changed_fraction``: elements whose bf16 bits changed in the step;
- ``sparse_encode_gbps`` / ``sparse_apply_gbps``: model bytes covered per second by one
  thread encoding (diff and wire form, zstd, per-tensor hash) and applying (zstd, decode,
  write, hash) the step, best of ``REPEATS``, with the functions the relay runs
  (``shell.delta_kernels``: its compiled loops, loaded before the clock starts, as the
  sender and the receivers load them when they start);
- ``sparse_speedup_1gbit``: the refit time of a full step over that of the delta step,
  both through the same sender and receiver (a separate process) with the sender's
  writes throttled to 1 Gbit/s by a token bucket (``LinkThrottle``), same run. The full
  step is the sparse sender's own full refit (``RAW`` chunks, zstd-compressed, so its
  wire bytes are below the checkpoint's); ``sparse_full_s`` and ``sparse_delta_s`` are
  the two times, ``sparse_full_link_s`` the checkpoint's bytes at the link's rate;
- ``sparse_speedup_vs_link``: ``sparse_full_link_s / sparse_delta_s``, the stricter
  ratio: as if a full refit cost nothing but the raw checkpoint's time on the link.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.queues import Queue

import numpy as np
import torch
import zstandard

from genworker.core.delta import bit_pattern, plan_frames
from genworker.core.refit_plan import Manifest, TensorSpec
from genworker.shell.delta_kernels import apply_wire_into, encode_wire, piece_hash, warm_up
from genworker.shell.refit.sparse import DictTarget, LinkThrottle, SparseReceiver, SparseSender

__all__ = ["measure"]

LINK_BITS_PER_S = 1e9
REPEATS = 2
HOP_S = 60.0


def shapes() -> dict[str, tuple[int, ...]]:
    hidden, mlp, vocab = 768, 3072, 20000
    out: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, hidden)}
    for i in range(12):
        p = f"layers.{i}."
        out[p + "attn.qkv.weight"] = (3 * hidden, hidden)
        out[p + "attn.o.weight"] = (hidden, hidden)
        out[p + "mlp.up.weight"] = (mlp, hidden)
        out[p + "mlp.down.weight"] = (hidden, mlp)
        out[p + "norm1.weight"] = (hidden,)
        out[p + "norm2.weight"] = (hidden,)
    out["norm.weight"] = (hidden,)
    return out


def adamw_step_pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 weights before and after one AdamW step at lr 1e-6 (after two warm-up steps)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes().values()]
    optimizer = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01)

    def step() -> None:
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()

    step()
    step()
    names = list(shapes())
    before = {n: p.detach().to(torch.bfloat16) for n, p in zip(names, params, strict=True)}
    step()
    after = {n: p.detach().to(torch.bfloat16) for n, p in zip(names, params, strict=True)}
    return before, after


def _receiver(results: Queue[object], commands: Queue[object]) -> None:
    torch.set_num_threads(1)
    receiver = SparseReceiver(DictTarget(), max_frame_bytes=16 << 20).start()
    results.put(receiver.address)
    commands.get()
    receiver.close()


def _best(fn: object, repeats: int = REPEATS) -> float:
    assert callable(fn)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure() -> list[tuple[str, float]]:
    before, after = adamw_step_pair()
    manifest = Manifest.from_specs(
        TensorSpec(n, tuple(t.shape), "bfloat16") for n, t in before.items()
    ).unwrap()
    model_bytes = manifest.total_bytes
    old = {n: bit_pattern(t) for n, t in before.items()}
    new = {n: bit_pattern(t) for n, t in after.items()}
    changed = sum(int(np.count_nonzero(old[n] != new[n])) for n in old)

    zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    payloads: dict[str, tuple[bytes, int]] = {}

    def encode() -> None:
        for name in old:
            data = encode_wire(old[name], new[name])
            payloads[name] = (zc.compress(data), piece_hash(new[name]))

    scratch = {n: b.copy() for n, b in old.items()}

    def apply() -> None:
        for name in payloads:
            scratch[name][:] = old[name]  # back to the baseline (not counted below)
        started = time.perf_counter()
        for name, (payload, checksum) in payloads.items():
            apply_wire_into(scratch[name], zd.decompress(payload)).unwrap()
            if piece_hash(scratch[name]) != checksum:
                raise AssertionError(f"apply gave wrong bits for {name}")
        apply_times.append(time.perf_counter() - started)

    warm_up({2})
    encode_s = _best(encode)
    apply_times: list[float] = []
    for _ in range(REPEATS):
        apply()
    apply_s = min(apply_times)

    ctx = multiprocessing.get_context("spawn")
    results: Queue[object] = ctx.Queue()
    commands: Queue[object] = ctx.Queue()
    process = ctx.Process(target=_receiver, args=(results, commands), daemon=True)
    process.start()
    try:
        address = results.get(timeout=120)
        assert isinstance(address, str)
        throttle = LinkThrottle(LINK_BITS_PER_S)
        with SparseSender([address], manifest, hop_s=HOP_S, throttle=throttle) as sender:
            sender.send(before)  # the way every sparse refit starts: full
            fulls, deltas, wire = [], [], 0
            for _ in range(REPEATS):
                sender.synced_step = None  # force a full step of the same weights
                full = sender.send(before)
                assert full.full
                fulls.append(full.seconds)
                delta = sender.send(after)
                assert not delta.full
                deltas.append(delta.seconds)
                wire = delta.wire_bytes
    finally:
        commands.put("stop")
        process.join(30)
        if process.is_alive():
            process.kill()
    full_s, delta_s = min(fulls), min(deltas)
    frames = len(plan_frames(manifest.specs, 8 << 20))
    return [
        ("sparse_wire_fraction", wire / model_bytes),
        ("sparse_changed_fraction", changed / (model_bytes / 2)),
        ("sparse_encode_gbps", model_bytes / encode_s / 1e9),
        ("sparse_apply_gbps", model_bytes / apply_s / 1e9),
        ("sparse_speedup_1gbit", full_s / delta_s),
        ("sparse_full_s", full_s),
        ("sparse_delta_s", delta_s),
        ("sparse_full_link_s", model_bytes * 8 / LINK_BITS_PER_S),
        ("sparse_speedup_vs_link", model_bytes * 8 / LINK_BITS_PER_S / delta_s),
        ("sparse_model_params_m", model_bytes / 2 / 1e6),
        ("sparse_frames", float(frames)),
    ]


if __name__ == "__main__":
    started = time.perf_counter()
    for key, value in measure():
        print(f"{key}={value:.4g}", flush=True)
    print(f"# bench_sparse took {time.perf_counter() - started:.1f} s")
