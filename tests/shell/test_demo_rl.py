"""The RL demo's loop, shortened, on the real CPU engine: the reward rises and every refit
leaves the engine on the trainer's weights (the train-vs-rollout logprob gap stays under
``GAP_BOUND``).

The run here: 4 prompts x 8 samples x 8 new tokens, 10 steps at Adam lr 2e-2. Measured on
the CI machine's kind (2 cores, shared): the mean reward goes 0.052 -> 0.974 (first 3 steps
-> last 3; the test asks for +0.5), the gap stays at 1.4e-7..5.8e-7 while the policy moves
5.7 nats per token from where it started; the run takes 10-45 s, nearly all of it the
engine's start, the 10 steps 1-3 s.

The LoRA mode, the same run through a rank-8 adapter on q_proj, v_proj and lm_head (only
the adapter trains and is refit; every generate names it) at Adam lr 5e-2: measured here
for seeds 0, 1, 2, the mean reward went 0.051 -> 0.992, 0.051 -> 1.000, 0.057 -> 0.928,
the gap stayed under 1e-6, each adapter refit took 2-20 ms; the run takes 10-30 s.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest

from genworker.demo.lora import LoraSpec
from genworker.demo.report import reward_rise
from genworker.demo.rl import GAP_BOUND, RL_PROMPTS, RlConfig, RlRun, StepRecord, run_rl

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

STEPS = 10
#: the mean reward of the last 3 steps must beat that of the first 3 by this much
MARGIN = 0.5


@attrs.frozen
class Ran:
    run: RlRun
    lines: list[str]


def short_run(model: Path, learning_rate: float, lora: LoraSpec | None = None) -> Ran:
    config = RlConfig(
        model=model,
        steps=STEPS,
        prompts=RL_PROMPTS[:4],
        samples_per_prompt=8,
        max_new_tokens=8,
        learning_rate=learning_rate,
        show=2,
        lora=lora,
    )
    lines: list[str] = []
    return Ran(run_rl(config, emit=lines.append), lines)


@pytest.fixture(scope="module")
def ran(tiny_model_dir: Path) -> Ran:
    return short_run(tiny_model_dir, 2e-2)


@pytest.fixture(scope="module")
def ran_lora(ran: Ran, tiny_model_dir: Path) -> Ran:
    """After the full run (one engine at a time)."""
    return short_run(tiny_model_dir, 5e-2, LoraSpec())


def test_the_reward_rises_by_the_margin(ran: Ran) -> None:
    first, last = reward_rise(ran.run.steps, 3)
    assert last >= first + MARGIN, [s.mean_reward for s in ran.run.steps]
    assert sum(a.reward for a in ran.run.after) > sum(b.reward for b in ran.run.before)


def test_every_refit_leaves_the_engine_on_the_trainers_weights(ran: Ran) -> None:
    """Step k's rollouts come from the weights refit after step k-1 (step 0's from the
    checkpoint both sides loaded); the last refit is checked on the after-samples."""
    for s in ran.run.steps:
        assert s.gap <= GAP_BOUND, s
        assert s.gap_max <= 10 * GAP_BOUND, s
    assert ran.run.final_gap <= GAP_BOUND


def test_the_gap_would_show_a_refit_that_did_nothing(ran: Ran) -> None:
    """The policy moves far from its start, so an engine left on the starting weights
    would show a gap of that order: the bound is thousands of times smaller."""
    steps = ran.run.steps
    assert steps[0].stale_gap == 0.0  # nothing trained yet: the same weights
    assert steps[-1].stale_gap > 1000 * GAP_BOUND
    assert [a.completion for a in ran.run.after] != [b.completion for b in ran.run.before]


def test_each_step_prints_one_line_with_its_figures(ran: Ran) -> None:
    assert ran.lines[0] == StepRecord.HEADER
    assert ran.lines[1:] == [s.line() for s in ran.run.steps]
    assert [s.step for s in ran.run.steps] == list(range(STEPS))
    for s in ran.run.steps:
        assert 0 < s.tokens <= 4 * 8 * 8
        assert min(s.generate_s, s.train_s, s.refit_s) > 0
        fields = s.line().split()
        assert int(fields[0]) == s.step
        assert float(fields[1]) == pytest.approx(s.mean_reward, abs=5e-4)
        assert int(fields[2]) == s.tokens


def test_the_full_run_refits_the_whole_model_once_per_step(ran: Ran) -> None:
    run = ran.run
    assert run.mode == "full"
    assert run.weight_version == STEPS
    assert run.trained == run.parameters
    assert run.refit_bytes == run.model_bytes == 4 * run.parameters


def test_lora_the_reward_rises_through_the_adapter_alone(ran_lora: Ran) -> None:
    run = ran_lora.run
    rewards = [s.mean_reward for s in run.steps]
    assert all(math.isfinite(r) and 0 <= r <= 1 for r in rewards), rewards
    first, last = reward_rise(run.steps, 3)
    assert last >= first + MARGIN, rewards
    assert sum(a.reward for a in run.after) > sum(b.reward for b in run.before)


def test_lora_every_step_refits_only_the_adapter_and_generates_under_it(ran_lora: Ran) -> None:
    """The weight version counts the starting adapter and one adapter refit per step; the
    gap (the engine's logprobs under the adapter against the trainer's base + LoRA) stays
    at rounding noise, so every rollout ran under the adapter the trainer had then."""
    run = ran_lora.run
    assert run.mode == "lora"
    assert run.weight_version == STEPS + 1
    # rank 8 on 2 layers' q_proj and v_proj (128 -> 128) and lm_head (128 -> 512), float32
    assert run.trained == 8 * (4 * (128 + 128) + 128 + 512) == 13_312
    assert run.refit_bytes == 4 * run.trained
    assert run.refit_bytes < run.model_bytes / 30
    for s in run.steps:
        assert s.gap <= GAP_BOUND, s
        assert s.gap_max <= 10 * GAP_BOUND, s
        assert s.refit_s > 0
    assert run.final_gap <= GAP_BOUND
    assert run.steps[0].stale_gap == 0.0  # the starting adapter is the base model
    assert run.steps[-1].stale_gap > 1000 * GAP_BOUND
    assert ran_lora.lines[1:] == [s.line() for s in run.steps]
