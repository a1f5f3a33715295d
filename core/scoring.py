"""Scoring given sequences: the logprob of each given token, and optionally the top-k
logprobs with their token ids, as padded tensors like ``generate``'s.

Theory of operation
-------------------
Reference-model, teacher and on-policy-distillation passes need the logprobs of tokens
they already have (TRL's ``/get_sequence_logprobs/``, verl's teacher loop). The engine
computes them with vLLM's ``prompt_logprobs`` on a request of the whole sequence with
``max_tokens=1``: one forward pass, nothing sampled that anyone reads
(``SamplingParams.prompt_logprobs``, vllm/sampling_params.py, 0.32). vLLM gives, for each
position ``t >= 1``, the logprob of token ``t`` given tokens ``< t`` and the top-k at that
position (ranked; position 0 has none). A request with ``prompt_logprobs`` does not read
the prefix cache (``Request.get_skip_reading_prefix_cache``, vllm/v1/request.py), so
every position is computed by this pass.

The caller gives right-padded ``input_ids`` (B, W), ``input_lengths`` (B,) and
``prompt_lengths`` (B,): row ``i``'s scored tokens are positions ``[p_i, l_i)``.
:func:`plan_scores` checks them (a bad row is refused by row, :class:`ScoreRefusal`
naming each with its reason: an empty sequence, a prompt length outside ``[1, l_i)``, a
sequence with no room for the one token the pass needs under ``max_model_len``, a token
outside the vocabulary) and ``top_k`` against the engine's ``max_logprobs``.
:func:`read_scored_row` reads one row of vLLM's answer (vllm/v1/worker/gpu_model_runner.py
``_get_prompt_logprobs_dict``, vllm/logprobs.py, 0.32): ``RequestOutput.prompt_logprobs``
holds one entry per prompt position, ``None`` at position 0, else a mapping ``token id ->
Logprob`` with the top ``prompt_logprobs`` tokens (``Logprob.rank`` 1..k) and the prompt's
own token at that position (its own rank, which may be above k). The logprobs are the
model's raw log-softmax (no temperature, no processors). :func:`assemble_scores` lays the
engine's answers out:

- ``logprobs`` (B, W) float32: the given token's logprob at ``[p_i, l_i)``, 0 elsewhere
  (``generate``'s layout: 0 outside the scored span);
- with ``top_k`` = k > 0, ``top_logprobs`` (B, W, k) float32 and ``top_ids`` (B, W, k)
  int64, rank order, at the same positions; 0 and ``pad_token_id`` elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs
import numpy as np
import torch
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "ScoreArgumentError",
    "ScorePlan",
    "ScoreRefusal",
    "ScoredRow",
    "UnreadScores",
    "assemble_scores",
    "plan_scores",
    "read_scored_row",
    "scoring_kwargs",
]


@attrs.frozen
class ScoreArgumentError(CoreError):
    """A call the plan refuses whole: ``field`` names the input."""

    field: str


@attrs.frozen
class ScoreRefusal(CoreError):
    """Rows that cannot be scored, each with its reason (``reasons`` parallel to ``rows``)."""

    rows: tuple[int, ...]
    reasons: tuple[str, ...]


@attrs.frozen
class ScorePlan:
    """A checked scoring call: each row's whole sequence and prompt length, ``top_k`` and
    the batch's shape."""

    sequences: tuple[tuple[int, ...], ...]
    prompt_lengths: tuple[int, ...]
    top_k: int
    width: int


@attrs.frozen
class ScoredRow:
    """The engine's answer for one row: ``logprobs[j]`` of token ``p + j``; ``top_ids`` and
    ``top_logprobs`` the top-k at that position, ranked (empty without ``top_k``)."""

    logprobs: tuple[float, ...]
    top_ids: tuple[tuple[int, ...], ...] = ()
    top_logprobs: tuple[tuple[float, ...], ...] = ()


@attrs.frozen
class UnreadScores(CoreError):
    """vLLM's prompt logprobs for a sequence lack what the engine owes: ``position`` names
    the position (None: the count of positions is wrong)."""

    position: int | None = None


class RankedLogprob(Protocol):
    """What is read of vLLM's ``Logprob``."""

    @property
    def logprob(self) -> float: ...

    @property
    def rank(self) -> int | None: ...


def scoring_kwargs(top_k: int) -> dict[str, object]:
    """vLLM ``SamplingParams`` keyword arguments of the request that scores a sequence (the
    module docstring): one forward pass with ``prompt_logprobs=top_k``, one greedy token
    read by nobody, nothing detokenized."""
    return {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k, "detokenize": False}


def read_scored_row(
    sequence: Sequence[int],
    prompt_length: int,
    prompt_logprobs: Sequence[Mapping[int, RankedLogprob] | None] | None,
    top_k: int,
) -> Result[ScoredRow, UnreadScores]:
    """The given tokens' logprobs from ``prompt_length`` on, and the top ``top_k`` (rank
    order; a rank vLLM did not give sorts last) at each of those positions, from vLLM's
    ``prompt_logprobs`` of ``sequence`` (see the module docstring)."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(sequence):
        got = None if prompt_logprobs is None else len(prompt_logprobs)
        return Failure(
            UnreadScores(
                f"compute_logprobs: {got} prompt logprob positions for {len(sequence)} tokens"
            )
        )
    logprobs: list[float] = []
    top_ids: list[tuple[int, ...]] = []
    top_logprobs: list[tuple[float, ...]] = []
    for position in range(prompt_length, len(sequence)):
        entries = prompt_logprobs[position]
        token = sequence[position]
        if entries is None or token not in entries:
            return Failure(
                UnreadScores(
                    f"compute_logprobs: no logprob for token {token} at position {position}",
                    position=position,
                )
            )
        logprobs.append(float(entries[token].logprob))
        if top_k:
            ranked = sorted(entries.items(), key=_rank_order)[:top_k]
            if len(ranked) != top_k:
                return Failure(
                    UnreadScores(
                        f"compute_logprobs: {len(ranked)} top logprobs at position "
                        f"{position}, asked for {top_k}",
                        position=position,
                    )
                )
            top_ids.append(tuple(int(t) for t, _ in ranked))
            top_logprobs.append(tuple(float(lp.logprob) for _, lp in ranked))
    return Success(ScoredRow(tuple(logprobs), tuple(top_ids), tuple(top_logprobs)))


def _rank_order(item: tuple[int, RankedLogprob]) -> tuple[float, float]:
    rank = item[1].rank
    return (math.inf if rank is None else rank, -item[1].logprob)


def _vector(value: object, name: str, batch: int) -> list[int] | ScoreArgumentError:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype.is_floating_point:
        return ScoreArgumentError(f"{name} must be a 1-D integer tensor", field=name)
    if int(value.shape[0]) != batch:
        return ScoreArgumentError(
            f"{name} has {int(value.shape[0])} rows but input_ids has {batch}", field=name
        )
    return [int(v) for v in value.tolist()]


def plan_scores(
    input_ids: object,
    input_lengths: object,
    prompt_lengths: object,
    top_k: object,
    *,
    max_logprobs: int,
    max_model_len: int,
    vocab_size: int | None,
) -> Result[tuple[ScorePlan, ScoreRefusal | None], ScoreArgumentError]:
    """The plan of the rows that can be scored and the refusal of those that cannot
    (None: every row can); a malformed call (shapes, dtypes, ``top_k``) is refused whole."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        return Failure(
            ScoreArgumentError(f"top_k must be an int >= 0, got {top_k!r}", field="top_k")
        )
    if top_k > max_logprobs:
        return Failure(
            ScoreArgumentError(
                f"top_k={top_k} is above the engine's max_logprobs={max_logprobs} (start the "
                "engine with a larger vllm_kwargs.max_logprobs)",
                field="top_k",
            )
        )
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.dtype.is_floating_point
    ):
        return Failure(
            ScoreArgumentError("input_ids must be a 2-D integer tensor", field="input_ids")
        )
    batch, width = int(input_ids.shape[0]), int(input_ids.shape[1])
    lengths = _vector(input_lengths, "input_lengths", batch)
    if isinstance(lengths, ScoreArgumentError):
        return Failure(lengths)
    prompts = _vector(prompt_lengths, "prompt_lengths", batch)
    if isinstance(prompts, ScoreArgumentError):
        return Failure(prompts)
    ids = input_ids.tolist()
    sequences: list[tuple[int, ...]] = []
    bad: list[tuple[int, str]] = []
    for row, (length, prompt) in enumerate(zip(lengths, prompts, strict=True)):
        reason = _row_problem(ids[row], length, prompt, width, max_model_len, vocab_size)
        if reason is not None:
            bad.append((row, reason))
        sequences.append(tuple(ids[row][: max(0, min(length, width))]))
    refusal = None
    if bad:
        listed = "; ".join(f"row {row}: {reason}" for row, reason in bad)
        refusal = ScoreRefusal(
            f"compute_logprobs refused rows {[r for r, _ in bad]}: {listed}",
            rows=tuple(r for r, _ in bad),
            reasons=tuple(reason for _, reason in bad),
        )
    return Success((ScorePlan(tuple(sequences), tuple(prompts), top_k, width), refusal))


def _row_problem(
    ids: Sequence[int],
    length: int,
    prompt: int,
    width: int,
    max_model_len: int,
    vocab_size: int | None,
) -> str | None:
    if length < 1:
        return f"empty sequence (input_length={length})"
    if length > width:
        return f"input_length={length} is wider than input_ids ({width})"
    if not 1 <= prompt < length:
        return (
            f"prompt_length={prompt} is out of range [1, {length - 1}] (at least the first "
            "token is context and at least one token is scored)"
        )
    if length >= max_model_len:
        return (
            f"{length} tokens leave no room under max_model_len={max_model_len} for the one "
            "token the scoring pass needs"
        )
    out = [t for t in ids[:length] if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if out:
        return f"token ids {out[:4]} are outside the vocabulary of {vocab_size}"
    return None


def assemble_scores(
    plan: ScorePlan, rows: Sequence[ScoredRow], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """The padded tensors of the module docstring from the engine's rows (one per row of
    ``plan``, each with ``l_i - p_i`` positions and ``top_k`` entries at each)."""
    if len(rows) != len(plan.sequences):
        raise ValueError(f"{len(rows)} scored rows for {len(plan.sequences)} sequences")
    batch, k = len(rows), plan.top_k
    logprobs = np.zeros((batch, plan.width), dtype=np.float32)
    top_ids = np.full((batch, plan.width, k), pad_token_id, dtype=np.int64)
    top_logprobs = np.zeros((batch, plan.width, k), dtype=np.float32)
    for i, (scored, sequence, start) in enumerate(
        zip(rows, plan.sequences, plan.prompt_lengths, strict=True)
    ):
        span = len(sequence) - start
        if len(scored.logprobs) != span:
            raise ValueError(f"row {i}: {len(scored.logprobs)} logprobs for {span} tokens")
        logprobs[i, start : len(sequence)] = scored.logprobs
        if k:
            if len(scored.top_ids) != span or any(len(ids) != k for ids in scored.top_ids):
                raise ValueError(f"row {i}: the top-{k} entries do not cover {span} positions")
            top_ids[i, start : len(sequence)] = scored.top_ids
            top_logprobs[i, start : len(sequence)] = scored.top_logprobs
    out = {"logprobs": torch.from_numpy(logprobs)}
    if k:
        out["top_ids"] = torch.from_numpy(top_ids)
        out["top_logprobs"] = torch.from_numpy(top_logprobs)
    return out
