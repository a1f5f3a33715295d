"""What a finished RL demo run shows: the summary lines, the PNG and the run's JSON record."""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from genworker.demo.chart import BLUE, GRAY, ORANGE, Panel, Series, render_chart, sparkline
from genworker.demo.rl import GAP_BOUND, RlRun, StepRecord

__all__ = ["EDGE_STEPS", "gap_ok", "reward_rise", "summary_lines", "write_outputs"]

#: the reward rise compares the mean of this many first steps with that of as many last
EDGE_STEPS = 3


def reward_rise(steps: Sequence[StepRecord], edge: int = EDGE_STEPS) -> tuple[float, float]:
    """The mean reward of the first ``edge`` steps and of the last ``edge`` steps (fewer
    when the run is shorter than ``2 * edge``)."""
    if not steps:
        raise ValueError("a run without steps has no reward curve")
    n = max(1, min(edge, len(steps) // 2))
    first = sum(s.mean_reward for s in steps[:n]) / n
    last = sum(s.mean_reward for s in steps[-n:]) / n
    return first, last


def write_outputs(run: RlRun, out_dir: Path, versions: Mapping[str, str]) -> tuple[Path, Path]:
    """``rl.png`` (reward and gap per step) and ``rl-run.json`` (every figure of the run,
    its settings and where it ran) in ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = run.steps
    picture = render_chart(
        [
            Panel(
                "mean reward (share of the completion that is numbers)",
                [Series("reward", [s.mean_reward for s in steps], BLUE)],
                y_range=(0.0, 1.0),
            ),
            Panel(
                "logprob gap per sampled token (nats, log scale)",
                [
                    Series(
                        f"engine vs trainer after each refit (max {_worst_gap(run):.1e})",
                        [s.gap for s in steps],
                        ORANGE,
                    ),
                    Series("trainer vs its start (no refits)", [s.stale_gap for s in steps], GRAY),
                ],
                log=True,
            ),
        ]
    )
    png = out_dir / "rl.png"
    png.write_bytes(picture)
    record = {
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in attrs.asdict(run.config).items()
        },
        "where": _where(run, versions),
        "steps": [attrs.asdict(s) for s in steps],
        "before": [attrs.asdict(s) for s in run.before],
        "after": [attrs.asdict(s) for s in run.after],
        "final_gap": run.final_gap,
        "gap_bound": GAP_BOUND,
        "engine_start_s": run.engine_start_s,
        "total_s": run.total_s,
    }
    record_path = out_dir / "rl-run.json"
    record_path.write_text(json.dumps(record, indent=1, allow_nan=True) + "\n", encoding="utf-8")
    return png, record_path


def _where(run: RlRun, versions: Mapping[str, str]) -> dict[str, object]:
    return {
        "machine": f"{platform.machine()} cpu",
        "python": platform.python_version(),
        **{name: version for name, version in versions.items()},
        "model": str(run.config.model),
        "parameters": run.parameters,
    }


def _worst_gap(run: RlRun) -> float:
    return max([s.gap for s in run.steps] + [run.final_gap])


def gap_ok(run: RlRun) -> bool:
    """Every step's gap, and the last refit's, under :data:`GAP_BOUND`."""
    gaps = [s.gap for s in run.steps] + [run.final_gap]
    return all(math.isfinite(g) and g <= GAP_BOUND for g in gaps)


def summary_lines(
    run: RlRun,
    png: Path,
    record: Path,
    versions: Mapping[str, str],
    *,
    command_s: float | None = None,
) -> list[str]:
    """The lines printed after the last step (``command_s``: the whole command's seconds,
    imports included)."""
    steps = run.steps
    first, last = reward_rise(steps)
    n = max(1, min(EDGE_STEPS, len(steps) // 2))
    worst = _worst_gap(run)
    stale = max(s.stale_gap for s in steps)
    lines = [
        "",
        f"reward  {sparkline([s.mean_reward for s in steps], 0.0, 1.0)}  "
        f"{first:.3f} -> {last:.3f} (mean of the first {n} steps -> the last {n})",
        f"gap     {sparkline([s.gap for s in steps], 0.0, stale)}  "
        f"max {worst:.1e} (the checkpoint, then after each of {len(steps)} refits), "
        f"bound {GAP_BOUND:.0e}: "
        f"{'ok' if gap_ok(run) else 'EXCEEDED'}; without refits it would reach {stale:.3f}",
        f"picture {png}   every figure: {record}",
        "",
        "one sampled completion each, before -> after training (reward = share of the "
        f"{run.config.max_new_tokens} new tokens that are numbers):",
    ]
    for b, a in zip(run.before, run.after, strict=True):
        lines.append(f"  {b.prompt!r}")
        lines.append(f"    before {b.reward:.2f} {_show(b.completion)}")
        lines.append(f"    after  {a.reward:.2f} {_show(a.completion)}")
    c = run.config
    version_text = ", ".join(f"{k} {v}" for k, v in versions.items())
    lines += [
        "",
        f"figures: measured in this run on this machine ({platform.machine()} cpu; "
        f"{version_text}); policy {c.model} (tiny Llama, random init, "
        f"{run.parameters / 1e6:.2f} M parameters, float32, built locally), trained in "
        f"this process with transformers; rollouts by VllmGenerationWorker; "
        f"{len(c.prompts)} prompts x {c.samples_per_prompt} samples x {c.max_new_tokens} "
        f"new tokens per step, Adam lr {c.learning_rate:g}, seed {c.seed}",
        f"time: engine start {run.engine_start_s:.1f} s, {len(steps)} steps "
        f"{sum(s.generate_s + s.train_s + s.refit_s for s in steps):.1f} s, "
        f"the loop {run.total_s:.1f} s"
        + ("" if command_s is None else f", the whole command {command_s:.1f} s"),
    ]
    return lines


def _show(text: str, width: int = 64) -> str:
    shown = "".join(ch if ch.isprintable() else "·" for ch in text)
    return repr(shown if len(shown) <= width else shown[: width - 1] + "…")
