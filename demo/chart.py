"""The demo's pictures: line charts drawn with matplotlib (Agg, PNG) and one-line text
sparklines for the terminal.

:func:`chart_figure` builds the figure (one panel per :class:`Panel`, stacked, sharing the
step axis) so tests can read back what was plotted; :func:`render_chart` saves it as PNG
bytes. matplotlib is the ``demo`` extra (``pip install 'genworker[demo]'``) and is
imported only when a chart is drawn.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["BLUE", "GRAY", "ORANGE", "Panel", "Series", "chart_figure", "render_chart", "sparkline"]

BLUE = "tab:blue"
ORANGE = "tab:orange"
GRAY = "tab:gray"

#: pixels per inch of the saved PNG (the figure's size is given in pixels)
DPI = 100

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], lo: float | None = None, hi: float | None = None) -> str:
    """One block character per value, scaled between ``lo`` and ``hi`` (default: the
    values' own minimum and maximum); a flat or empty series draws the lowest bar."""
    if not values:
        return ""
    bottom = min(values) if lo is None else lo
    top = max(values) if hi is None else hi
    span = top - bottom
    top_bar = len(_BARS) - 1
    if not span > 0 or not math.isfinite(span):
        return _BARS[0] * len(values)
    return "".join(
        _BARS[min(top_bar, max(0, round((v - bottom) / span * top_bar)))] for v in values
    )


def _floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _series(values: Iterable[Series]) -> tuple[Series, ...]:
    return tuple(values)


@attrs.frozen
class Series:
    """One line: a legend label, a value per step (step 0, 1, ...), a matplotlib colour."""

    label: str
    values: tuple[float, ...] = attrs.field(converter=_floats)
    color: str = BLUE


@attrs.frozen
class Panel:
    """One plot: a title and its series over the step. ``y_range`` fixes the y axis;
    ``log`` draws it on a log scale (values <= 0 are left out, as non-finite ones are)."""

    title: str
    series: tuple[Series, ...] = attrs.field(converter=_series)
    y_range: tuple[float, float] | None = None
    log: bool = False


def chart_figure(
    panels: Sequence[Panel], *, x_label: str = "step", width: int = 760, panel_height: int = 250
) -> Figure:
    """The panels stacked top to bottom, ``width`` x ``panel_height * len(panels)`` pixels.

    Each series is one line (markers at the points); a value that is not finite, or not
    positive on a log panel, is a gap in its line.
    """
    if not panels:
        raise ValueError("a chart needs at least one panel")
    if width < 200 or panel_height < 120:
        raise ValueError(f"a chart of {width}x{panel_height} pixels per panel is too small to read")
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "the demo's chart needs matplotlib: pip install 'genworker[demo]'", name=e.name
        ) from e

    figure = Figure(figsize=(width / DPI, panel_height * len(panels) / DPI), dpi=DPI)
    axes = figure.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels, strict=True):
        ax.set_title(panel.title, fontsize=10, loc="left")
        for series in panel.series:
            shown = [_shown(v, panel.log) for v in series.values]
            ax.plot(range(len(shown)), shown, marker="o", markersize=3, color=series.color,
                    label=series.label)  # fmt: skip
        if panel.log:
            ax.set_yscale("log")
        if panel.y_range is not None:
            ax.set_ylim(*panel.y_range)
        ax.set_xlabel(x_label)
        ax.grid(True, color="0.9")
        if panel.series:
            ax.legend(fontsize=8, loc="best")
    figure.tight_layout()
    return figure


def render_chart(
    panels: Sequence[Panel], *, x_label: str = "step", width: int = 760, panel_height: int = 250
) -> bytes:
    """:func:`chart_figure`, saved as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = chart_figure(panels, x_label=x_label, width=width, panel_height=panel_height)
    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _shown(value: float, log: bool) -> float:
    return value if math.isfinite(value) and (value > 0 or not log) else math.nan
