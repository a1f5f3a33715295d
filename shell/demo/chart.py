"""Line charts as PNG bytes and one-line text sparklines, with no plotting library.

The demo's pictures are a few line series over training steps; drawing them needs lines,
rectangles and short labels, so this module rasterizes them itself (a 5x7 bitmap font,
Bresenham lines) and encodes the pixels as an 8-bit RGB PNG with ``zlib`` (PNG spec,
ISO/IEC 15948: signature, IHDR, one IDAT of filter-0 scanlines, IEND). Everything here is
a pure function of its arguments: values in, bytes or text out.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Iterable, Sequence

import attrs

__all__ = ["Panel", "Series", "render_chart", "sparkline"]

Color = tuple[int, int, int]

BLUE: Color = (31, 119, 180)
ORANGE: Color = (255, 127, 14)
GRAY: Color = (150, 150, 150)
_INK: Color = (40, 40, 40)
_GRID: Color = (225, 225, 225)
_WHITE: Color = (255, 255, 255)

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
    """One line: a legend label, a value per step, an RGB colour."""

    label: str
    values: tuple[float, ...] = attrs.field(converter=_floats)
    color: Color = BLUE


@attrs.frozen
class Panel:
    """One plot: a title and its series, sharing an x axis (the step) and a y range
    (``y_range``, or the series' own extent with 0 included)."""

    title: str
    series: tuple[Series, ...] = attrs.field(converter=_series)
    y_range: tuple[float, float] | None = None


def render_chart(
    panels: Sequence[Panel], *, x_label: str = "step", width: int = 760, panel_height: int = 250
) -> bytes:
    """The panels stacked top to bottom, as PNG bytes."""
    if not panels:
        raise ValueError("render_chart needs at least one panel")
    if width < 200 or panel_height < 120:
        raise ValueError(f"a chart of {width}x{panel_height} per panel is too small to read")
    canvas = _Canvas(width, panel_height * len(panels))
    for i, panel in enumerate(panels):
        _draw_panel(canvas, panel, top=i * panel_height, height=panel_height, x_label=x_label)
    return canvas.png()


# -- drawing ----------------------------------------------------------------------------

_LEFT, _RIGHT, _TITLE, _BOTTOM = 78, 18, 48, 40


def _draw_panel(canvas: _Canvas, panel: Panel, *, top: int, height: int, x_label: str) -> None:
    x0, x1 = _LEFT, canvas.width - _RIGHT
    y0, y1 = top + _TITLE, top + height - _BOTTOM
    canvas.text(x0, top + 8, panel.title, _INK, scale=2)
    lo, hi = panel.y_range or _extent(panel.series)
    steps = max((len(s.values) for s in panel.series), default=0)
    last = max(steps - 1, 1)

    def px(step: float) -> int:
        return round(x0 + (x1 - x0) * step / last)

    def py(value: float) -> int:
        clamped = min(max(value, lo), hi)
        return round(y1 - (y1 - y0) * (clamped - lo) / (hi - lo))

    for k in range(5):  # y grid and tick labels
        value = lo + (hi - lo) * k / 4
        y = py(value)
        canvas.line(x0, y, x1, y, _GRID)
        label = _number(value)
        canvas.text(x0 - 6 - _text_width(label), y - 3, label, _INK)
    for step in sorted({0, last // 2, last} if steps > 1 else {0}):  # x ticks
        canvas.line(px(step), y1, px(step), y1 + 4, _INK)
        label = str(step)
        canvas.text(px(step) - _text_width(label) // 2, y1 + 8, label, _INK)
    canvas.text((x0 + x1 - _text_width(x_label)) // 2, y1 + 22, x_label, _INK)
    canvas.frame(x0, y0, x1, y1, _INK)
    legend_x = x0
    for series in panel.series:  # the legend, a row under the title
        canvas.fill(legend_x, top + 30, legend_x + 14, top + 33, series.color)
        canvas.text(legend_x + 20, top + 28, series.label, _INK)
        legend_x += 20 + _text_width(series.label) + 24
    for series in panel.series:
        points = [(px(i), py(v)) for i, v in enumerate(series.values) if math.isfinite(v)]
        for (ax, ay), (bx, by) in itertools.pairwise(points):
            canvas.line(ax, ay, bx, by, series.color, thick=True)
        for x, y in points:
            canvas.fill(x - 2, y - 2, x + 2, y + 2, series.color)


def _extent(series: Sequence[Series]) -> tuple[float, float]:
    finite = [v for s in series for v in s.values if math.isfinite(v)]
    lo, hi = min([0.0, *finite]), max([0.0, *finite])
    if hi - lo <= 0:
        return lo, lo + 1.0
    return lo, hi + (hi - lo) * 0.05


def _number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) < 1e-2 or abs(value) >= 1e4:
        return f"{value:.1e}"
    return f"{value:.3g}"


class _Canvas:
    """An RGB raster, white to begin with; drawing outside it is clipped."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(_WHITE * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def fill(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(y0, 0), min(y1, self.height - 1) + 1):
            for x in range(max(x0, 0), min(x1, self.width - 1) + 1):
                self.set(x, y, color)

    def frame(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for a, b, c, d in ((x0, y0, x1, y0), (x0, y1, x1, y1), (x0, y0, x0, y1), (x1, y0, x1, y1)):
            self.line(a, b, c, d, color)

    def line(
        self, x0: int, y0: int, x1: int, y1: int, color: Color, *, thick: bool = False
    ) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.set(x0, y0, color)
            if thick:
                self.set(x0 + 1, y0, color)
                self.set(x0, y0 + 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color, *, scale: int = 1) -> None:
        for ch in text:
            rows = _FONT.get(ch.upper(), _FONT["?"])
            for r, row in enumerate(rows):
                for c, bit in enumerate(row):
                    if bit == "#":
                        self.fill(
                            x + c * scale,
                            y + r * scale,
                            x + c * scale + scale - 1,
                            y + r * scale + scale - 1,
                            color,
                        )
            x += _ADVANCE * scale

    def png(self) -> bytes:
        stride = 3 * self.width
        scanlines = b"".join(
            b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height)
        )
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(scanlines, 9))
            + _chunk(b"IEND", b"")
        )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _text_width(text: str) -> int:
    return _ADVANCE * len(text)


_ADVANCE = 6

# A 5x7 bitmap font: the characters labels and numbers need (lower case draws as upper).
_GLYPHS = """
A .###. #...# #...# ##### #...# #...# #...#
B ####. #...# #...# ####. #...# #...# ####.
C .###. #...# #.... #.... #.... #...# .###.
D ####. #...# #...# #...# #...# #...# ####.
E ##### #.... #.... ####. #.... #.... #####
F ##### #.... #.... ####. #.... #.... #....
G .###. #...# #.... #.### #...# #...# .####
H #...# #...# #...# ##### #...# #...# #...#
I .###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.
J ..### ...#. ...#. ...#. ...#. #..#. .##..
K #...# #..#. #.#.. ##... #.#.. #..#. #...#
L #.... #.... #.... #.... #.... #.... #####
M #...# ##.## #.#.# #.#.# #...# #...# #...#
N #...# #...# ##..# #.#.# #..## #...# #...#
O .###. #...# #...# #...# #...# #...# .###.
P ####. #...# #...# ####. #.... #.... #....
Q .###. #...# #...# #...# #.#.# #..#. .##.#
R ####. #...# #...# ####. #.#.. #..#. #...#
S .#### #.... #.... .###. ....# ....# ####.
T ##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
U #...# #...# #...# #...# #...# #...# .###.
V #...# #...# #...# #...# #...# .#.#. ..#..
W #...# #...# #...# #.#.# #.#.# #.#.# .#.#.
X #...# #...# .#.#. ..#.. .#.#. #...# #...#
Y #...# #...# .#.#. ..#.. ..#.. ..#.. ..#..
Z ##### ....# ...#. ..#.. .#... #.... #####
0 .###. #...# #..## #.#.# ##..# #...# .###.
1 ..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.
2 .###. #...# ....# ...#. ..#.. .#... #####
3 ####. ....# ....# .###. ....# ....# ####.
4 ...#. ..##. .#.#. #..#. ##### ...#. ...#.
5 ##### #.... ####. ....# ....# #...# .###.
6 .###. #.... #.... ####. #...# #...# .###.
7 ##### ....# ...#. ..#.. .#... .#... .#...
8 .###. #...# #...# .###. #...# #...# .###.
9 .###. #...# #...# .#### ....# ....# .###.
. ..... ..... ..... ..... ..... .##.. .##..
, ..... ..... ..... ..... .##.. ..#.. .#...
- ..... ..... ..... .###. ..... ..... .....
+ ..... ..#.. ..#.. ##### ..#.. ..#.. .....
: ..... .##.. .##.. ..... .##.. .##.. .....
( ...#. ..#.. .#... .#... .#... ..#.. ...#.
) .#... ..#.. ...#. ...#. ...#. ..#.. .#...
/ ....# ....# ...#. ..#.. .#... #.... #....
| ..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
= ..... ..... ##### ..... ##### ..... .....
< ...#. ..#.. .#... #.... .#... ..#.. ...#.
> .#... ..#.. ...#. ....# ...#. ..#.. .#...
% ##..# ##..# ...#. ..#.. .#... #..## #..##
_ ..... ..... ..... ..... ..... ..... #####
' ..#.. ..#.. ..... ..... ..... ..... .....
? .###. #...# ....# ...#. ..#.. ..... ..#..
"""
_FONT: dict[str, tuple[str, ...]] = {
    line[0]: tuple(line[2:].split()) for line in _GLYPHS.strip("\n").splitlines()
}
_FONT[" "] = (".....",) * 7
