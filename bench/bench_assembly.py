"""Output assembly: NeMo-RL's per-token loop against ``genworker.core.assembly``.

The baseline re-implements, operation for operation, the output loop of NeMo-RL's
``VllmGenerationWorker.generate`` (``nemo_rl/models/generation/vllm/vllm_worker.py``, after
PR #3297): per row a ``torch.full`` of the whole width with the pad id, the input prefix
copied, the generated tokens written as one ``torch.tensor``, then per generated token a
lookup of the sampled id in that position's ``{token_id: Logprob}`` dict (as vLLM returns
them with ``logprobs=0``) and a scalar write at ``input_lengths[i] + idx`` (a 0-d tensor
index, as there); finally ``torch.stack``. Its per-token dicts are built before timing.

Ours gets :class:`~genworker.core.assembly.Generation` values holding numpy arrays, as the
engine adapter builds them from vLLM's flat logprobs, also before timing. Both run on the
same inputs, interleaved, and the medians are compared.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from genworker.core.assembly import Generation, assemble_outputs

__all__ = [
    "BenchInputs",
    "Completion",
    "Logprob",
    "RequestOutput",
    "baseline_assemble",
    "make_inputs",
    "measure",
    "ours_assemble",
]

BATCH = 512
PADDED_INPUT = 256
MAX_GENERATION = 1024
VOCAB = 151_936
PAD = 151_643
REPEATS = 5


@dataclass(frozen=True)
class Logprob:
    """The fields of ``vllm.logprobs.Logprob`` the loop touches."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class Completion:
    """The fields of ``vllm.outputs.CompletionOutput`` the loop touches."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str


@dataclass(frozen=True)
class RequestOutput:
    """``vllm.outputs.RequestOutput`` with one completion."""

    outputs: list[Completion]


@dataclass(frozen=True)
class BenchInputs:
    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    outputs: list[RequestOutput]
    generations: list[Generation]


def make_inputs(
    batch: int = BATCH,
    width: int = PADDED_INPUT,
    max_generation: int = MAX_GENERATION,
    *,
    seed: int = 0,
    pad_token_id: int = PAD,
) -> BenchInputs:
    """A right-padded batch and the same generations in vLLM's shape and in ours."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, size=batch)
    ids = rng.integers(0, VOCAB, size=(batch, width))
    ids[np.arange(width)[None, :] >= lengths[:, None]] = pad_token_id
    gen_lengths = rng.integers(0, max_generation + 1, size=batch)
    reasons = ("stop", "length", "abort")
    outputs: list[RequestOutput] = []
    generations: list[Generation] = []
    for i, g in enumerate(gen_lengths.tolist()):
        tokens = rng.integers(0, VOCAB, size=g, dtype=np.int64)
        logprobs = (-rng.exponential(2.0, size=g)).astype(np.float32)
        reason = reasons[i % 3]
        token_list: list[int] = tokens.tolist()
        dicts = [
            {t: Logprob(logprob=lp, rank=1)}
            for t, lp in zip(token_list, logprobs.tolist(), strict=True)
        ]
        outputs.append(RequestOutput([Completion(token_list, dicts, reason)]))
        generations.append(Generation(tokens, logprobs, reason))
    return BenchInputs(
        input_ids=torch.from_numpy(ids),
        input_lengths=torch.from_numpy(lengths),
        outputs=outputs,
        generations=generations,
    )


def baseline_assemble(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    outputs: Sequence[RequestOutput],
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """NeMo-RL's per-sample, per-token assembly loop (see the module docstring)."""
    padded_input_length = input_ids.size(1)
    max_length = max((len(o.outputs[0].token_ids) for o in outputs), default=0)
    total_length = padded_input_length + max_length
    output_rows: list[torch.Tensor] = []
    logprob_rows: list[torch.Tensor] = []
    generation_lengths: list[int] = []
    unpadded_lengths: list[torch.Tensor] = []
    truncated: list[bool] = []
    for i, output in enumerate(outputs):
        sequence_length = input_lengths[i]
        generation = output.outputs[0]
        generated = list(generation.token_ids)
        row = torch.full((total_length,), pad_token_id, dtype=input_ids.dtype)
        row[:sequence_length] = input_ids[i][:sequence_length]
        row[sequence_length : sequence_length + len(generated)] = torch.tensor(generated)
        output_rows.append(row)
        row_logprobs = torch.zeros(total_length, dtype=torch.float32)
        if generation.logprobs:
            for idx, (token_id, logprob_dict) in enumerate(
                zip(generated, generation.logprobs, strict=False)
            ):
                if logprob_dict:
                    sampled = logprob_dict.get(token_id)
                    if sampled is not None:
                        row_logprobs[sequence_length + idx] = sampled.logprob
        logprob_rows.append(row_logprobs)
        generation_lengths.append(len(generated))
        unpadded_lengths.append(sequence_length + len(generated))
        truncated.append(generation.finish_reason == "length")
    return {
        "output_ids": torch.stack(output_rows),
        "logprobs": torch.stack(logprob_rows),
        "generation_lengths": torch.tensor(generation_lengths, dtype=torch.long),
        "unpadded_sequence_lengths": torch.tensor(unpadded_lengths, dtype=torch.long),
        "truncated": torch.tensor(truncated, dtype=torch.bool),
    }


def ours_assemble(inputs: BenchInputs, pad_token_id: int = PAD) -> dict[str, torch.Tensor]:
    return assemble_outputs(
        inputs.input_ids, inputs.input_lengths, inputs.generations, pad_token_id
    ).as_dict()


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(repeats: int = REPEATS) -> list[tuple[str, float]]:
    """``assembly_speedup`` (baseline median / ours median) and both medians in ms."""
    inputs = make_inputs()

    def baseline() -> dict[str, torch.Tensor]:
        return baseline_assemble(inputs.input_ids, inputs.input_lengths, inputs.outputs, PAD)

    def ours() -> dict[str, torch.Tensor]:
        return ours_assemble(inputs)

    expected, got = baseline(), ours()
    for key, tensor in expected.items():
        if not (tensor.dtype == got[key].dtype and torch.equal(tensor, got[key])):
            raise AssertionError(f"assembly differs from the baseline in {key!r}")
    baseline_times: list[float] = []
    ours_times: list[float] = []
    for _ in range(repeats):
        baseline_times.append(_seconds(baseline))
        ours_times.append(_seconds(ours))
    base_ms = statistics.median(baseline_times) * 1e3
    ours_ms = statistics.median(ours_times) * 1e3
    return [
        ("assembly_speedup", base_ms / ours_ms),
        ("assembly_baseline_ms", base_ms),
        ("assembly_ours_ms", ours_ms),
    ]


if __name__ == "__main__":
    for name, value in measure():
        print(f"{name}: {value:.2f}")
