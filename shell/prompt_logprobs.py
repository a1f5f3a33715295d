"""vLLM's ``prompt_logprobs`` as :class:`~genworker.core.scoring.ScoredRow` values: the
request both engine adapters send to score a sequence, and the reading of its answer.

vLLM 0.32 (vllm/v1/worker/gpu_model_runner.py ``_get_prompt_logprobs_dict``,
vllm/logprobs.py): ``RequestOutput.prompt_logprobs`` holds one entry per prompt position,
``None`` at position 0, else a mapping ``token id -> Logprob`` with the top
``prompt_logprobs`` tokens (``Logprob.rank`` 1..k) and the prompt's own token at that
position (its own rank, which may be above k). The logprobs are the model's raw
log-softmax (no temperature, no processors). ``max_tokens=1`` and greedy: the one sampled
token is read by nobody.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from genworker.core.scoring import ScoredRow
from genworker.shell.errors import EngineContractError

__all__ = ["scored_row", "scoring_params"]


def scoring_params(top_k: int, kind: RequestOutputKind | None = None) -> SamplingParams:
    """One forward pass over the sequence: ``prompt_logprobs=top_k``, one greedy token,
    nothing detokenized (``kind``: the async engine's output kind)."""
    if kind is None:
        return SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False
        )
    return SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False, output_kind=kind
    )


def scored_row(
    sequence: Sequence[int],
    prompt_length: int,
    prompt_logprobs: Sequence[Mapping[int, object] | None] | None,
    top_k: int,
) -> ScoredRow:
    """The given tokens' logprobs from ``prompt_length`` on, and the top ``top_k`` (rank
    order) at each of those positions; an engine contract error names what is missing."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(sequence):
        got = None if prompt_logprobs is None else len(prompt_logprobs)
        raise EngineContractError(
            f"compute_logprobs: {got} prompt logprob positions for {len(sequence)} tokens"
        )
    logprobs: list[float] = []
    top_ids: list[tuple[int, ...]] = []
    top_logprobs: list[tuple[float, ...]] = []
    for position in range(prompt_length, len(sequence)):
        entries = prompt_logprobs[position]
        token = sequence[position]
        if entries is None or token not in entries:
            raise EngineContractError(
                f"compute_logprobs: no logprob for token {token} at position {position}"
            )
        logprobs.append(float(entries[token].logprob))  # type: ignore[attr-defined]
        if top_k:
            ranked = sorted(
                entries.items(),
                key=lambda item: (item[1].rank, -item[1].logprob),  # type: ignore[attr-defined]
            )[:top_k]
            if len(ranked) != top_k:
                raise EngineContractError(
                    f"compute_logprobs: {len(ranked)} top logprobs at position {position}, "
                    f"asked for {top_k}"
                )
            top_ids.append(tuple(int(t) for t, _ in ranked))
            top_logprobs.append(tuple(float(lp.logprob) for _, lp in ranked))  # type: ignore[attr-defined]
    return ScoredRow(tuple(logprobs), tuple(top_ids), tuple(top_logprobs))
