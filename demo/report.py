"""What a finished RL demo run shows: the summary lines, the PNG and the run's JSON record.

A LoRA run (``RlConfig.lora``) says so in its chart's titles and its summary, draws a third
panel (each adapter refit's time) and writes ``rl-lora.png`` and ``rl-lora-run.json``, so
it leaves a full run's files beside it alone."""

from __future__ import annotations

import json
import math
import platform
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from genworker.demo.chart import BLUE, GRAY, ORANGE, Panel, Series, render_chart, sparkline
from genworker.demo.rl import GAP_BOUND, RlRun, StepRecord

__all__ = [
    "EDGE_STEPS",
    "chart_panels",
    "gap_ok",
    "output_paths",
    "refit_line",
    "reward_rise",
    "summary_lines",
    "write_outputs",
]

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


def output_paths(run: RlRun, out_dir: Path) -> tuple[Path, Path]:
    """Where :func:`write_outputs` writes: ``rl.png`` and ``rl-run.json``, with ``-lora``
    after ``rl`` for a LoRA run."""
    stem = "rl" if run.config.lora is None else "rl-lora"
    return out_dir / f"{stem}.png", out_dir / f"{stem}-run.json"


def chart_panels(run: RlRun) -> list[Panel]:
    """The chart's panels: the reward, the gap, and a LoRA run's adapter refit times."""
    steps = run.steps
    lora = run.config.lora
    title = (
        "mean reward (share of the completion that is numbers)"
        if lora is None
        else f"LoRA mode, rank {lora.rank} on {', '.join(lora.targets)}: "
        "mean reward (share that is numbers)"
    )
    panels = [
        Panel(
            title,
            [Series("reward", [s.mean_reward for s in steps], BLUE)],
            y_range=(0.0, 1.0),
        ),
        Panel(
            "logprob gap per sampled token (nats, log scale)",
            [
                Series(
                    f"engine vs trainer after each {'adapter ' if lora else ''}refit "
                    f"(max {_worst_gap(run):.1e})",
                    [s.gap for s in steps],
                    ORANGE,
                ),
                Series("trainer vs its start (no refits)", [s.stale_gap for s in steps], GRAY),
            ],
            log=True,
        ),
    ]
    if lora is not None:
        panels.append(
            Panel(
                f"adapter refit per step (ms): the adapter is {_size(run.refit_bytes)} "
                f"of the model's {_size(run.model_bytes)}",
                [Series("each adapter refit, both ends", [s.refit_s * 1e3 for s in steps], BLUE)],
            )
        )
    return panels


def write_outputs(run: RlRun, out_dir: Path, versions: Mapping[str, str]) -> tuple[Path, Path]:
    """The chart (reward and gap per step; a LoRA run's adapter refit times too) and the
    run's record (every figure of the run, its settings and where it ran) in ``out_dir``
    (:func:`output_paths`); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png, record_path = output_paths(run, out_dir)
    png.write_bytes(render_chart(chart_panels(run)))
    steps = run.steps
    record = {
        "mode": run.mode,
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in attrs.asdict(run.config).items()
        },
        "where": _where(run, versions),
        "steps": [attrs.asdict(s) for s in steps],
        "before": [attrs.asdict(s) for s in run.before],
        "after": [attrs.asdict(s) for s in run.after],
        "final_gap": run.final_gap,
        "gap_bound": GAP_BOUND,
        "trained_parameters": run.trained,
        "model_bytes": run.model_bytes,
        "refit_bytes": run.refit_bytes,
        "weight_version": run.weight_version,
        "engine_start_s": run.engine_start_s,
        "total_s": run.total_s,
    }
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


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.2f} MB" if n_bytes >= 1e6 else f"{n_bytes / 1e3:.1f} kB"


def refit_line(run: RlRun) -> str:
    """What each refit moved and how long it took (both ends, until the engine answered)."""
    times = [s.refit_s * 1e3 for s in run.steps]
    took = f"median {statistics.median(times):.1f} ms ({min(times):.1f}..{max(times):.1f})"
    lora = run.config.lora
    if lora is None:
        return (
            f"refits  {len(times)}, each the whole model ({_size(run.refit_bytes)}, "
            f"{run.trained:,} parameters): {took}; weight version {run.weight_version}"
        )
    return (
        f"refits  {len(times)} adapter refits (LoRA rank {lora.rank}, alpha {lora.alpha:g} "
        f"on {', '.join(lora.targets)}), each only the adapter: {_size(run.refit_bytes)}, "
        f"{run.trained:,} parameters, {run.refit_bytes / run.model_bytes:.1%} of the model's "
        f"{_size(run.model_bytes)} ({run.parameters:,}): {took}; weight version "
        f"{run.weight_version} (the starting adapter, then one per step)"
    )


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
    start = "the checkpoint" if run.config.lora is None else "the starting adapter"
    lines = [
        "",
        *([] if run.config.lora is None else ["LoRA mode: the policy trained through an adapter"]),
        f"reward  {sparkline([s.mean_reward for s in steps], 0.0, 1.0)}  "
        f"{first:.3f} -> {last:.3f} (mean of the first {n} steps -> the last {n})",
        f"gap     {sparkline([s.gap for s in steps], 0.0, stale)}  "
        f"max {worst:.1e} ({start}, then after each of {len(steps)} refits), "
        f"bound {GAP_BOUND:.0e}: "
        f"{'ok' if gap_ok(run) else 'EXCEEDED'}; without refits it would reach {stale:.3f}",
        refit_line(run),
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
    trained, under = ("", "") if c.lora is None else ("frozen, its LoRA adapter ", " under it")
    lines += [
        "",
        f"figures: measured in this run on this machine ({platform.machine()} cpu; "
        f"{version_text}); policy {c.model} (tiny Llama, random init, "
        f"{run.parameters / 1e6:.2f} M parameters, float32, built locally), {trained}"
        f"trained in this process with transformers; rollouts by VllmGenerationWorker{under}; "
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
