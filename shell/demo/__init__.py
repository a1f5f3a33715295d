"""``make demo``: a small RL loop around the worker (generate, score, train, refit), the
task it learns, and the pictures it leaves (``genworker demo``; see ``rl``)."""

from genworker.shell.demo.chart import Panel, Series, render_chart, sparkline
from genworker.shell.demo.rl import GAP_BOUND, RlConfig, RlRun, Sample, StepRecord, run_rl
from genworker.shell.demo.task import group_advantages, is_number_token, number_rewards

__all__ = [
    "GAP_BOUND",
    "Panel",
    "RlConfig",
    "RlRun",
    "Sample",
    "Series",
    "StepRecord",
    "group_advantages",
    "is_number_token",
    "number_rewards",
    "render_chart",
    "run_rl",
    "sparkline",
]
