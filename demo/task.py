"""The demo's RL task: say numbers. A reward anyone can read, and GRPO's group baseline.

The policy is a tiny Llama with random weights: it starts out spreading its probability
almost evenly over the 512 tokens of its vocabulary, so any task that needs grammar or
arithmetic would show nothing in two minutes on two cores. What it *can* learn that fast
is which tokens to prefer, so the reward is per token and dense:

    reward = (generated tokens that are numbers) / max_new_tokens

A *number token* is one whose text, stripped of spaces, is all decimal digits (``"7"``,
``" 13"``): 30 of the 512 tokens, so a random policy scores about 0.06 and a policy that
has learned the task 1.0. Dividing by ``max_new_tokens`` rather than the generated length
means stopping early (the end-of-sequence token) earns nothing.

The advantage of each sample is its reward minus the mean reward of all the samples of
its prompt, over their standard deviation (GRPO's group baseline, Shao et al. 2024,
eq. 3 in its outcome-supervision form): no value model, and a group whose samples all
scored alike carries no signal (advantage 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = [
    "generated_span",
    "group_advantages",
    "is_number_token",
    "number_rewards",
    "number_token_mask",
]


def is_number_token(text: str) -> bool:
    """Whether a token's text is a number: decimal digits, with spaces around at most."""
    digits = text.strip(" ")
    return digits.isascii() and digits.isdigit()


def number_token_mask(
    vocab: Iterable[int], decode: Callable[[int], str], size: int
) -> torch.Tensor:
    """A bool tensor of ``size`` entries, True at the ids in ``vocab`` that decode to a number."""
    mask = torch.zeros(size, dtype=torch.bool)
    for token_id in vocab:
        if is_number_token(decode(token_id)):
            mask[token_id] = True
    return mask


def number_rewards(
    output_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    generation_lengths: torch.Tensor,
    numbers: torch.Tensor,
    max_new_tokens: int,
) -> torch.Tensor:
    """Each row's reward: its generated number tokens over ``max_new_tokens`` (float32).

    ``output_ids`` is the worker's padded output (prompt, then generation, then pad);
    only the generated span ``[input_length, input_length + generation_length)`` counts.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    span = generated_span(output_ids.shape[1], input_lengths, generation_lengths)
    hits = numbers[output_ids] & span
    return hits.sum(dim=1).to(torch.float32) / max_new_tokens


def generated_span(
    width: int, input_lengths: torch.Tensor, generation_lengths: torch.Tensor
) -> torch.Tensor:
    """``[rows, width]`` bool: True where a row holds a generated token."""
    positions = torch.arange(width)[None, :]
    start = input_lengths[:, None]
    return (positions >= start) & (positions < start + generation_lengths[:, None])


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: rows come in consecutive groups of ``group_size`` samples of one
    prompt; each row's reward minus its group's mean, over the group's std (+ ``eps``)."""
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D in whole groups of at least 2 samples: "
            f"{tuple(rewards.shape)} with group_size={group_size}"
        )
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    return (centred / (groups.std(dim=1, keepdim=True) + eps)).view(-1)
