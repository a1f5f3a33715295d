"""The RL demo's pure parts: the reward, GRPO's group baseline, sparklines, the chart, the
summary. No engine here (``test_demo_rl.py`` runs the loop)."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from matplotlib.colors import to_rgb
from PIL import Image

from genworker.demo.chart import (
    BLUE,
    GRAY,
    ORANGE,
    Panel,
    Series,
    chart_figure,
    render_chart,
    sparkline,
)
from genworker.demo.report import gap_ok, reward_rise, summary_lines, write_outputs
from genworker.demo.rl import GAP_BOUND, RlConfig, RlRun, Sample, StepRecord
from genworker.demo.task import (
    generated_span,
    group_advantages,
    is_number_token,
    number_rewards,
    number_token_mask,
)

# -- the reward ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "number"),
    [("7", True), (" 13", True), ("0", True), (" 1 ", True), ("x", False), (" ", False),
     ("", False), ("1.5", False), ("-3", False), ("٣", False), (" 1a", False)],
)  # fmt: skip
def test_a_number_token_is_decimal_digits_with_spaces_around(text: str, number: bool) -> None:
    assert is_number_token(text) is number


def test_the_tiny_tokenizer_has_30_number_tokens(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    def decode(i: int) -> str:
        return str(tokenizer.decode([i]))

    mask = number_token_mask(range(len(tokenizer)), decode, len(tokenizer))
    numbers = [decode(i) for i in torch.nonzero(mask).flatten().tolist()]
    assert len(numbers) == 30  # 0..9 alone, " 0".." 19" with a space: the baseline 30/512
    assert {n.strip() for n in numbers} == {str(k) for k in range(20)}


@st.composite
def rollouts(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    rows = draw(st.integers(1, 6))
    max_new = draw(st.integers(1, 8))
    lengths = [draw(st.integers(1, 5)) for _ in range(rows)]
    generated = [draw(st.integers(0, max_new)) for _ in range(rows)]
    width = max(a + b for a, b in zip(lengths, generated, strict=True)) + draw(st.integers(0, 3))
    ids = torch.tensor([[draw(st.integers(0, 9)) for _ in range(width)] for _ in range(rows)])
    return ids, torch.tensor(lengths), torch.tensor(generated), max_new


NUMBERS = torch.tensor([i % 3 == 0 for i in range(10)])  # ids 0, 3, 6, 9 are "numbers"


@given(rollouts())
def test_the_reward_counts_the_numbers_in_the_generated_span_only(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
) -> None:
    ids, lengths, generated, max_new = case
    rewards = number_rewards(ids, lengths, generated, NUMBERS, max_new)
    for i in range(ids.shape[0]):
        span = ids[i, int(lengths[i]) : int(lengths[i] + generated[i])].tolist()
        assert rewards[i].item() == pytest.approx(sum(t % 3 == 0 for t in span) / max_new)
        assert 0.0 <= rewards[i].item() <= 1.0
    assert rewards.dtype == torch.float32


def test_prompt_and_pad_tokens_earn_nothing_and_stopping_early_costs() -> None:
    ids = torch.tensor([[0, 3, 1, 6, 9, 0], [1, 3, 3, 0, 0, 0]])  # prompt, generated, pad
    rewards = number_rewards(ids, torch.tensor([2, 1]), torch.tensor([3, 2]), NUMBERS, 4)
    assert rewards.tolist() == [0.5, 0.5]  # 2 of row 0's 3 tokens, 2 of row 1's 2: over 4
    with pytest.raises(ValueError, match="max_new_tokens"):
        number_rewards(ids, torch.tensor([2, 1]), torch.tensor([3, 2]), NUMBERS, 0)


def test_the_generated_span_starts_after_the_prompt() -> None:
    span = generated_span(5, torch.tensor([1, 3]), torch.tensor([2, 0]))
    assert span.tolist() == [[False, True, True, False, False], [False] * 5]


# -- GRPO's group baseline ----------------------------------------------------------------

# Rewards as the demo makes them: a count of tokens over max_new_tokens.
shares = st.integers(0, 16).map(lambda k: k / 16)
groups = st.integers(2, 6).flatmap(
    lambda size: st.tuples(
        st.just(size),
        st.lists(
            st.lists(shares, min_size=size, max_size=size),
            min_size=1,
            max_size=4,
        ),
    )
)


@given(groups)
def test_advantages_are_centred_per_group_and_keep_the_order_of_rewards(
    case: tuple[int, list[list[float]]],
) -> None:
    size, rows = case
    rewards = torch.tensor([r for row in rows for r in row])
    advantages = group_advantages(rewards, size).view(-1, size)
    for g, row in enumerate(rows):
        assert advantages[g].sum().item() == pytest.approx(0.0, abs=1e-3)
        for a in range(size):
            for b in range(size):
                if row[a] > row[b]:
                    assert advantages[g, a] > advantages[g, b]
                if row[a] == row[b]:
                    assert advantages[g, a] == advantages[g, b]


@given(groups, st.floats(-5, 5, width=32))
def test_a_constant_added_to_a_group_changes_no_advantage(
    case: tuple[int, list[list[float]]], shift: float
) -> None:
    size, rows = case
    rewards = torch.tensor([r for row in rows for r in row], dtype=torch.float64)
    assert torch.allclose(
        group_advantages(rewards + shift, size), group_advantages(rewards, size), atol=1e-4
    )


def test_a_group_that_scored_alike_carries_no_signal() -> None:
    advantages = group_advantages(torch.tensor([0.5, 0.5, 0.5, 0.0, 1.0, 0.5]), 3)
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0]
    assert advantages[3] < 0 < advantages[4]


@pytest.mark.parametrize(("shape", "size"), [((6,), 4), ((6,), 1), ((2, 3), 3)])
def test_advantages_refuse_rewards_not_in_whole_groups(shape: tuple[int, ...], size: int) -> None:
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(torch.zeros(shape), size)


# -- sparklines ---------------------------------------------------------------------------

finite = st.floats(-1e6, 1e6, allow_nan=False)


@given(st.lists(finite, max_size=40))
def test_a_sparkline_has_one_bar_per_value_from_lowest_to_highest(values: list[float]) -> None:
    line = sparkline(values)
    assert len(line) == len(values)
    assert set(line) <= set("▁▂▃▄▅▆▇█")
    if values and max(values) > min(values):
        assert line[values.index(min(values))] == "▁"
        assert line[values.index(max(values))] == "█"
    for a, b in zip(values, line, strict=True):
        for c, d in zip(values, line, strict=True):
            if a < c:
                assert b <= d  # the bars are in code-point order


def test_a_sparkline_clamps_to_its_range_and_draws_a_flat_series_low() -> None:
    assert sparkline([-1.0, 0.0, 0.5, 1.0, 2.0], 0.0, 1.0) == "▁▁▅██"
    assert sparkline([3.0, 3.0]) == "▁▁"
    assert sparkline([]) == ""


# -- the chart ----------------------------------------------------------------------------


def decode_png(data: bytes) -> Image.Image:
    """The PNG, decoded (Pillow checks the chunks' CRCs and the image data as it loads)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(data), formats=["PNG"])
    image.load()
    return image.convert("RGB")


def count_near(image: Image.Image, color: str, box: tuple[int, int, int, int]) -> int:
    """Pixels inside ``box`` (left, top, right, bottom) within 12 of ``color`` per channel."""
    target = np.array([round(255 * c) for c in to_rgb(color)])
    region = np.asarray(image.crop(box), dtype=np.int64)
    return int((np.abs(region - target) <= 12).all(axis=-1).sum())


def floats(values: object) -> list[float]:
    """A line's x or y data as plain floats."""
    return [float(v) for v in np.asarray(values, dtype=np.float64)]


TWO_PANELS = [
    Panel("reward", [Series("reward", [0.1, 0.5, 0.9], BLUE)], y_range=(0.0, 1.0)),
    Panel("gap", [Series("a", [1e-7] * 3, ORANGE), Series("b", [0, 2, 4], GRAY)]),
]


def test_a_chart_plots_every_series_as_given() -> None:
    figure = chart_figure(TWO_PANELS, width=300, panel_height=150)
    assert tuple(figure.get_size_inches() * figure.dpi) == (300, 300)
    top, bottom = figure.axes
    assert top.get_ylim() == (0.0, 1.0)
    assert top.get_title(loc="left") == "reward"
    plotted = [
        (ax.get_title(loc="left"), str(line.get_label()), to_rgb(str(line.get_color())),
         floats(line.get_xdata()), floats(line.get_ydata()))
        for ax in figure.axes
        for line in ax.get_lines()
    ]  # fmt: skip
    assert plotted == [
        ("reward", "reward", to_rgb(BLUE), [0, 1, 2], [0.1, 0.5, 0.9]),
        ("gap", "a", to_rgb(ORANGE), [0, 1, 2], [1e-7] * 3),
        ("gap", "b", to_rgb(GRAY), [0, 1, 2], [0.0, 2.0, 4.0]),
    ]
    legend = bottom.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b"]


def test_a_chart_is_a_png_of_the_asked_size_with_each_series_in_its_panel() -> None:
    image = decode_png(render_chart(TWO_PANELS, width=300, panel_height=150))
    assert image.size == (300, 300)
    top, bottom = (0, 0, 300, 150), (0, 150, 300, 300)
    assert count_near(image, BLUE, top) > 50
    assert count_near(image, BLUE, bottom) == 0  # the reward is in the top panel only
    assert count_near(image, ORANGE, bottom) > 50
    assert count_near(image, ORANGE, top) == 0
    assert count_near(image, GRAY, bottom) > 50  # (anti-aliased black text is gray too)


def test_a_chart_leaves_gaps_for_values_it_cannot_draw() -> None:
    figure = chart_figure(
        [Panel("p", [Series("nan", [math.nan, 1.0, math.inf, 1.0], BLUE)]),
         Panel("log", [Series("x", [0.0, 1e-7, -1.0, 2.0], ORANGE)], log=True),
         Panel("one", [Series("x", [2.0], ORANGE)])],
        width=200,
        panel_height=120,
    )  # fmt: skip
    linear, log, one = (floats(ax.get_lines()[0].get_ydata()) for ax in figure.axes)
    assert [math.isnan(v) for v in linear] == [True, False, True, False]
    assert [math.isnan(v) for v in log] == [True, False, True, False]
    assert figure.axes[1].get_yscale() == "log"
    assert one == [2.0]
    assert decode_png(render_chart([Panel("p", [Series("s", [math.nan], BLUE)])])).size == (
        760,
        250,
    )


def test_without_matplotlib_the_chart_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails, as if absent
    with pytest.raises(ModuleNotFoundError, match=r"genworker\[demo\]"):
        chart_figure(TWO_PANELS)


def test_a_chart_refuses_no_panels_or_a_size_too_small_to_read() -> None:
    with pytest.raises(ValueError, match="at least one panel"):
        render_chart([])
    with pytest.raises(ValueError, match="too small"):
        render_chart([Panel("p", [])], width=100)
    with pytest.raises(ValueError, match="too small"):
        chart_figure([Panel("p", [])], panel_height=119)


# -- the summary and the files ------------------------------------------------------------


def a_run(rewards: list[float], gaps: list[float], final_gap: float = 1e-7) -> RlRun:
    steps = tuple(
        StepRecord(
            step=i, mean_reward=r, tokens=100, generate_s=0.1, train_s=0.2, refit_s=0.03,
            gap=g, gap_max=2 * g, stale_gap=0.1 * i,
        )
        for i, (r, g) in enumerate(zip(rewards, gaps, strict=True))
    )  # fmt: skip
    return RlRun(
        config=RlConfig(model=Path("m"), steps=len(steps)),
        steps=steps,
        before=(Sample("Numbers:", "abc", 0.0),),
        after=(Sample("Numbers:", " 1 2", 1.0),),
        final_gap=final_gap,
        parameters=460_000,
        engine_start_s=5.0,
        total_s=20.0,
    )


def test_the_reward_rise_compares_the_first_and_last_steps() -> None:
    run = a_run([0.0, 0.1, 0.2, 0.6, 0.8, 1.0, 0.9], [1e-7] * 7)
    assert reward_rise(run.steps) == pytest.approx((0.1, 0.9))
    assert reward_rise(run.steps[:3]) == pytest.approx((0.0, 0.2))  # 1 each for 3 steps
    with pytest.raises(ValueError, match="without steps"):
        reward_rise(())


def test_the_gap_check_fails_on_any_step_or_the_last_refit() -> None:
    assert gap_ok(a_run([0.1, 0.2], [1e-7, 2e-7]))
    assert not gap_ok(a_run([0.1, 0.2], [1e-7, 10 * GAP_BOUND]))
    assert not gap_ok(a_run([0.1, 0.2], [1e-7, 1e-7], final_gap=math.nan))
    assert not gap_ok(a_run([0.1, 0.2], [1e-7, 1e-7], final_gap=1.0))


def test_the_outputs_hold_every_figure_and_the_summary_names_them(tmp_path: Path) -> None:
    run = a_run([0.05, 0.1, 0.4, 0.9], [1e-7, 2e-7, 1e-7, 3e-7])
    versions = {"vllm": "0.0", "torch": "1.0"}
    png, record = write_outputs(run, tmp_path / "out", versions)
    assert decode_png(png.read_bytes()).size == (760, 500)
    saved = json.loads(record.read_text())
    assert [s["mean_reward"] for s in saved["steps"]] == [0.05, 0.1, 0.4, 0.9]
    assert saved["where"]["vllm"] == "0.0"
    assert saved["gap_bound"] == GAP_BOUND
    assert saved["after"][0]["completion"] == " 1 2"
    text = "\n".join(summary_lines(run, png, record, versions, command_s=31.0))
    assert "0.075 -> 0.650" in text  # 2 steps each end
    assert "max 3.0e-07 (the checkpoint, then after each of 4 refits)" in text
    assert ": ok;" in text
    assert str(png) in text
    assert str(record) in text
    assert "vllm 0.0" in text
    assert "' 1 2'" in text
    assert "engine start 5.0 s, 4 steps 1.3 s, the loop 20.0 s, the whole command 31.0 s" in text
    bad = a_run([0.05, 0.1], [1e-7, 1.0])
    assert "EXCEEDED" in "\n".join(summary_lines(bad, png, record, versions))
