"""The RL demo's pure parts: the reward, GRPO's group baseline, sparklines, the chart, the
summary, the LoRA mode's arguments and adapter. No engine here (``test_demo_rl.py`` runs
the loop)."""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from matplotlib.colors import to_rgb
from PIL import Image
from returns.result import Success

from genworker.core.lora import EngineLora, check_adapter
from genworker.core.refit_plan import Manifest
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
from genworker.demo.commands import LORA_LEARNING_RATE, check_demo_args
from genworker.demo.lora import LoraSpec, adapter_state, add_adapter, tensor_bytes
from genworker.demo.report import (
    gap_ok,
    output_paths,
    reward_rise,
    summary_lines,
    write_outputs,
)
from genworker.demo.rl import GAP_BOUND, RlConfig, RlRun, Sample, StepRecord
from genworker.demo.task import (
    generated_span,
    group_advantages,
    is_number_token,
    number_rewards,
    number_token_mask,
)
from genworker.demo.tiny_model import build_tiny_model

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


def test_a_scaled_tiny_model_has_the_size_asked_and_a_bad_size_is_refused(
    tmp_path: Path,
) -> None:
    out = build_tiny_model(tmp_path / "m", hidden=192, layers=3)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (192, 3)
    assert (config["num_attention_heads"], config["intermediate_size"]) == (3, 384)
    for hidden, layers in ((100, 2), (0, 2), (128, 0)):
        with pytest.raises(ValueError, match="hidden must be a multiple of 64"):
            build_tiny_model(tmp_path / "bad", hidden=hidden, layers=layers)
    assert not (tmp_path / "bad").exists()


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


def a_run(
    rewards: list[float], gaps: list[float], final_gap: float = 1e-7, lora: LoraSpec | None = None
) -> RlRun:
    steps = tuple(
        StepRecord(
            step=i, mean_reward=r, tokens=100, generate_s=0.1, train_s=0.2,
            refit_s=0.03 if lora is None else 0.002 + 0.001 * i,
            gap=g, gap_max=2 * g, stale_gap=0.1 * i,
        )
        for i, (r, g) in enumerate(zip(rewards, gaps, strict=True))
    )  # fmt: skip
    trained = 460_000 if lora is None else 13_312
    return RlRun(
        config=RlConfig(model=Path("m"), steps=len(steps), lora=lora),
        steps=steps,
        before=(Sample("Numbers:", "abc", 0.0),),
        after=(Sample("Numbers:", " 1 2", 1.0),),
        final_gap=final_gap,
        parameters=460_000,
        trained=trained,
        model_bytes=1_840_000,
        refit_bytes=4 * trained,
        weight_version=len(steps) + (lora is not None),
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
    assert "refits  4, each the whole model (1.84 MB, 460,000 parameters): median 30.0 ms" in text
    assert "LoRA" not in text
    assert (png.name, record.name) == ("rl.png", "rl-run.json")
    bad = a_run([0.05, 0.1], [1e-7, 1.0])
    assert "EXCEEDED" in "\n".join(summary_lines(bad, png, record, versions))


def test_a_lora_run_says_so_with_the_adapters_size_and_refit_times(tmp_path: Path) -> None:
    spec = LoraSpec()
    run = a_run([0.05, 0.1, 0.4, 0.9], [1e-7, 2e-7, 1e-7, 3e-7], lora=spec)
    full_png, _ = write_outputs(a_run([0.05, 0.1], [1e-7, 1e-7]), tmp_path, {})
    png, record = write_outputs(run, tmp_path, {"vllm": "0.0"})
    assert (png, record) == output_paths(run, tmp_path)
    assert (png.name, record.name) == ("rl-lora.png", "rl-lora-run.json")
    assert full_png.is_file()  # a LoRA run leaves a full run's files alone
    assert decode_png(png.read_bytes()).size == (760, 750)  # reward, gap, refit times
    saved = json.loads(record.read_text())
    assert saved["mode"] == "lora"
    assert saved["config"]["lora"] == {
        "rank": 8, "alpha": 16.0, "targets": ["q_proj", "v_proj", "lm_head"]
    }  # fmt: skip
    assert (saved["refit_bytes"], saved["model_bytes"]) == (53_248, 1_840_000)
    assert saved["weight_version"] == 5
    assert [s["refit_s"] for s in saved["steps"]] == pytest.approx([0.002, 0.003, 0.004, 0.005])
    text = "\n".join(summary_lines(run, png, record, {"vllm": "0.0"}))
    assert "LoRA mode" in text
    assert (
        "4 adapter refits (LoRA rank 8, alpha 16 on q_proj, v_proj, lm_head), each only the "
        "adapter: 53.2 kB, 13,312 parameters, 2.9% of the model's 1.84 MB (460,000): "
        "median 3.5 ms (2.0..5.0); weight version 5"
    ) in text
    assert "the starting adapter, then after each of 4 refits" in text
    assert "frozen, its LoRA adapter trained" in text


def test_the_chart_of_a_lora_run_names_the_mode_and_plots_the_refit_times() -> None:
    from genworker.demo.report import chart_panels

    run = a_run([0.05, 0.1, 0.4], [1e-7] * 3, lora=LoraSpec())
    reward, _, refit = chart_panels(run)
    assert reward.title.startswith("LoRA mode, rank 8 on q_proj, v_proj, lm_head")
    assert "53.2 kB of the model's 1.84 MB" in refit.title
    assert refit.series[0].values == pytest.approx((2.0, 3.0, 4.0))


# -- the LoRA mode's arguments ------------------------------------------------------------


class Refused(Exception):
    """What the parser's ``error`` raised, with its message."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise Refused(message)


def demo_args(**given: object) -> argparse.Namespace:
    """The demo command's arguments as the CLI parses them, nothing given but ``given``."""
    args = {
        "steps": None, "samples": None, "learning_rate": None, "seed": None, "out": None,
        "batch": None, "temperature": None, "greedy": False, "chunk": None,
        "table": False, "image": False, "shards": 1, "lora": False,
    }  # fmt: skip
    return argparse.Namespace(**{**args, **given})


@pytest.mark.parametrize(
    ("given", "other"),
    [({"image": True}, "--image"), ({"table": True}, "--table"), ({"shards": 2}, "--shards"),
     ({"table": True, "shards": 2}, "--table")],
)  # fmt: skip
def test_lora_is_refused_by_name_with_a_mode_that_trains_nothing(
    given: dict[str, object], other: str
) -> None:
    with pytest.raises(Refused, match=f"--lora trains the RL loop .*: not with {other} "):
        check_demo_args(demo_args(lora=True, **given), Parser())


def test_lora_fills_its_own_learning_rate_unless_one_is_given() -> None:
    args = demo_args(lora=True)
    check_demo_args(args, Parser())
    assert (args.lora, args.learning_rate, args.steps) == (True, LORA_LEARNING_RATE, 24)
    given = demo_args(lora=True, learning_rate=0.1)
    check_demo_args(given, Parser())
    assert given.learning_rate == 0.1
    full = demo_args()
    check_demo_args(full, Parser())
    assert (full.lora, full.learning_rate) == (False, 5e-3)


# -- the trainer's adapter ----------------------------------------------------------------

#: the tiny Llama's modules an engine started with enable_lora adapts, by path, as the
#: worker's ``prepare_lora`` checks them (``shell/refit/lora.py:holds``, vLLM 0.32: every
#: linear layer, the packed qkv_proj and gate_up_proj by their parts, and lm_head)
TINY_LLAMA_LORA = EngineLora(
    max_rank=8,
    modules=frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj", "embed_tokens", "lm_head"}),
    paths=frozenset(
        {"lm_head"}
        | {f"model.layers.{i}.self_attn.{m}" for i in range(2)
           for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
        | {f"model.layers.{i}.mlp.{m}" for i in range(2)
           for m in ("gate_proj", "up_proj", "down_proj")}
    ),
)  # fmt: skip


@pytest.fixture
def policy(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model: torch.nn.Module = LlamaForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32
    )
    return model


def test_the_adapter_has_peft_names_and_shapes_that_the_worker_accepts(
    policy: torch.nn.Module,
) -> None:
    spec = LoraSpec()
    state = adapter_state(add_adapter(policy, spec))
    modules = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")]
    assert sorted(state) == sorted(
        f"base_model.model.{m}.lora_{half}.weight" for m in [*modules, "lm_head"] for half in "AB"
    )
    assert state["base_model.model.lm_head.lora_A.weight"].shape == (8, 128)
    assert state["base_model.model.lm_head.lora_B.weight"].shape == (512, 8)
    assert state["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (
        128,
        8,
    )
    manifest = Manifest.from_info({n: (t.shape, t.dtype) for n, t in state.items()}).unwrap()
    checked = check_adapter(manifest, spec.peft_config(), TINY_LLAMA_LORA)
    assert isinstance(checked, Success), checked
    assert tensor_bytes(state.values()) == 4 * 8 * (2 * 2 * (128 + 128) + 128 + 512)


def test_only_the_adapter_trains_and_it_starts_as_the_base_model(
    policy: torch.nn.Module,
) -> None:
    ids = torch.tensor([[5, 17, 99, 240, 7]])
    base = policy(input_ids=ids).logits.detach()
    adapted = add_adapter(policy, LoraSpec())
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable == {f"{path}.lora_{half}" for path in adapted for half in "AB"}
    assert torch.equal(policy(input_ids=ids).logits.detach(), base)  # B = 0


def test_the_adapted_policy_computes_what_peft_merges(policy: torch.nn.Module) -> None:
    """The trainer's forward with the adapter equals the base weights plus
    ``alpha / r * B @ A`` (PEFT's merge, which the engine's LoRA layers match:
    ``test_worker_lora_engine.py``)."""
    from transformers import LlamaForCausalLM

    merged = LlamaForCausalLM(policy.config)  # type: ignore[no-untyped-call]
    merged.load_state_dict(policy.state_dict())
    spec = LoraSpec(alpha=32.0)
    adapted = add_adapter(policy, spec)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in adapted.values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.3)
        state = adapter_state(adapted)
        for path in adapted:
            a = state[f"base_model.model.{path}.lora_A.weight"]
            b = state[f"base_model.model.{path}.lora_B.weight"]
            weight = merged.get_submodule(path).weight
            assert isinstance(weight, torch.Tensor)
            weight += spec.alpha / spec.rank * b @ a
    ids = torch.tensor([[5, 17, 99, 240, 7], [300, 12, 8, 41, 77]])
    torch.testing.assert_close(
        policy(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=0
    )


def test_a_spec_refuses_a_rank_vllm_does_not_serve_and_a_model_without_its_targets(
    policy: torch.nn.Module,
) -> None:
    with pytest.raises(ValueError, match="one of vLLM's"):
        LoraSpec(rank=4)
    with pytest.raises(ValueError, match="alpha must be positive"):
        LoraSpec(alpha=0)
    with pytest.raises(ValueError, match=r"no linear layer named \['w_q'\]"):
        add_adapter(policy, LoraSpec(targets=("q_proj", "w_q")))
