"""Figures as SVG text, drawn by hand: the few shapes nanohlat's figures, run reports
and pages need (line charts, stacked bars, Gantt rows, grids of cells).

Why not a plotting library: an SVG is text. A figure is then a string that diffs in a
review, ships inside a page that works without a network, and is tested by the numbers
it was drawn from; nothing in training needs matplotlib (it stays the `plot` extra).

Every function takes plain numbers and labels and returns one `<svg>` element as a
string; the caller says what the numbers are. Coordinates are in pixels, y down.
"""

from __future__ import annotations

import math
from html import escape

# One palette for every figure: the same colour means the same kind of thing
# across a page (forward, backward, weights, a collective, ...), chosen to stay
# distinguishable for the common colour-vision deficiencies (Okabe and Ito's set).
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999")


def colour(i: int) -> str:
    """The i-th colour of PALETTE, cycling."""
    return PALETTE[i % len(PALETTE)]


def _num(v: float) -> str:
    """A coordinate as short text: two decimals at most, no trailing zeros."""
    return f"{v:.2f}".rstrip("0").rstrip(".")


class Svg:
    """An SVG document built element by element; str() of it is the text."""

    def __init__(self, width: float, height: float, title: str = ""):
        self.width, self.height, self.parts = width, height, []
        if title:   # read by screen readers and shown as a tooltip
            self.parts.append(f"<title>{escape(title)}</title>")

    def rect(self, x, y, w, h, fill, tip: str = "", stroke: str = "none", **data) -> None:
        """A filled rectangle; `tip` shows on hover; `data` become data-* attributes."""
        attrs = "".join(f' data-{k.replace("_", "-")}="{escape(str(v))}"' for k, v in data.items())
        inner = f"<title>{escape(tip)}</title>" if tip else ""
        self.parts.append(f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(max(w, 0))}" '
                          f'height="{_num(max(h, 0))}" fill="{fill}" stroke="{stroke}"{attrs}>{inner}</rect>')

    def line(self, x1, y1, x2, y2, stroke: str = "#444", width: float = 1, dash: str = "") -> None:
        """A straight line; `dash` is an SVG dash pattern such as "4 3"."""
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(f'<line x1="{_num(x1)}" y1="{_num(y1)}" x2="{_num(x2)}" y2="{_num(y2)}" '
                          f'stroke="{stroke}" stroke-width="{_num(width)}"{d}/>')

    def polyline(self, points, stroke: str, width: float = 1.5) -> None:
        """Points joined by straight lines (a curve of a line chart)."""
        pts = " ".join(f"{_num(x)},{_num(y)}" for x, y in points)
        self.parts.append(f'<polyline points="{pts}" fill="none" stroke="{stroke}" '
                          f'stroke-width="{_num(width)}"/>')

    def text(self, x, y, s, size: float = 11, anchor: str = "start", fill: str = "#222",
             bold: bool = False, rotate: float = 0) -> None:
        """A line of text whose baseline starts (or is centred, or ends: `anchor`) at (x, y)."""
        extra = ' font-weight="bold"' if bold else ""
        if rotate:
            extra += f' transform="rotate({_num(rotate)} {_num(x)} {_num(y)})"'
        self.parts.append(f'<text x="{_num(x)}" y="{_num(y)}" font-size="{_num(size)}" '
                          f'text-anchor="{anchor}" fill="{fill}"{extra}>{escape(str(s))}</text>')

    def __str__(self) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_num(self.width)}" '
                f'height="{_num(self.height)}" viewBox="0 0 {_num(self.width)} {_num(self.height)}" '
                f'font-family="sans-serif">' + "".join(self.parts) + "</svg>")


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round numbers (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(n, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def short(v: float) -> str:
    """A tick label: 3 significant digits, with k/M/G for large magnitudes."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.3g}"


def tick_labels(ts: list[float]) -> list[str]:
    """Labels for ticks(): short() for a lone tick, else as many decimals as the ticks' step
    needs, so that neighbouring ticks never read the same (6.240, 6.245, 6.250; 500k, 1.0M)."""
    if len(ts) < 2:
        return [short(t) for t in ts]
    step, out = ts[1] - ts[0], []
    for t in ts:
        scale, suffix = next(((sc, sf) for sc, sf in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if abs(t) >= sc), (1, ""))
        decimals = max(0, -math.floor(math.log10(step / scale) + 1e-9))
        out.append("0" if t == 0 else f"{t / scale:.{decimals}f}{suffix}")
    return out


def line_chart(series: dict[str, list[tuple[float, float]]], x_label: str, y_label: str,
               width: float = 560, height: float = 260, title: str = "") -> str:
    """One curve per series (name -> [(x, y), ...]) on shared axes, with a legend.
    Non-finite y values are left out of the curve (a skipped step leaves a gap)."""
    left, right, top, bottom = 58, 12, 24 if title else 10, 40
    svg = Svg(width, height, title)
    pts = [(x, y) for s in series.values() for x, y in s if math.isfinite(y)]
    if not pts:
        svg.text(width / 2, height / 2, "no data", anchor="middle")
        return str(svg)
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + abs(y0) * 0.1 + 1e-9)
    pw, ph = width - left - right, height - top - bottom
    sx = lambda x: left + (x - x0) / (x1 - x0) * pw          # noqa: E731 (a coordinate map)
    sy = lambda y: top + ph - (y - y0) / (y1 - y0) * ph      # noqa: E731
    if title:
        svg.text(width / 2, 15, title, size=12, anchor="middle", bold=True)
    ts = ticks(y0, y1)
    for t, label in zip(ts, tick_labels(ts)):
        svg.line(left, sy(t), left + pw, sy(t), stroke="#ddd")
        svg.text(left - 4, sy(t) + 4, label, size=10, anchor="end")
    ts = ticks(x0, x1)
    for t, label in zip(ts, tick_labels(ts)):
        svg.line(sx(t), top + ph, sx(t), top + ph + 4)
        svg.text(sx(t), top + ph + 15, label, size=10, anchor="middle")
    svg.line(left, top + ph, left + pw, top + ph)
    svg.line(left, top, left, top + ph)
    svg.text(left + pw / 2, height - 6, x_label, anchor="middle")
    svg.text(12, top + ph / 2, y_label, anchor="middle", rotate=-90)
    for i, (name, s) in enumerate(series.items()):
        run: list = []   # consecutive finite points form one polyline
        for x, y in s + [(None, math.nan)]:
            if math.isfinite(y):
                run.append((sx(x), sy(y)))
            elif run:
                svg.polyline(run, colour(i)) if len(run) > 1 else svg.rect(run[0][0] - 1.5, run[0][1] - 1.5,
                                                                           3, 3, colour(i))
                run = []
        svg.rect(left + pw - 150, top + 4 + 14 * i, 10, 10, colour(i))
        svg.text(left + pw - 136, top + 13 + 14 * i, name, size=10)
    return str(svg)


def stacked_bars(bars: list[tuple[str, list[tuple[str, float]]]], unit: str, limit: float | None = None,
                 limit_label: str = "", width: float = 560, title: str = "") -> str:
    """Horizontal bars, one per (label, [(segment name, value), ...]), each bar the segments
    end to end in order; the same segment name has the same colour in every bar. `limit`
    draws a dashed line (a device's memory) that the bars are measured against."""
    names = list(dict.fromkeys(n for _, segs in bars for n, _ in segs))
    left, right, top, row = 110, 16, 24 if title else 8, 22
    height = top + row * len(bars) + 34 + 14 * ((len(names) + 2) // 3)
    svg = Svg(width, height, title)
    if title:
        svg.text(width / 2, 15, title, size=12, anchor="middle", bold=True)
    most = max([sum(v for _, v in segs) for _, segs in bars] + [limit or 0, 1e-30])
    pw = width - left - right
    sx = lambda v: v / most * pw                            # noqa: E731
    for i, (label, segs) in enumerate(bars):
        y, x = top + row * i, left
        svg.text(left - 6, y + 14, label, size=10, anchor="end")
        for name, v in segs:
            svg.rect(x, y + 3, sx(v), row - 6, colour(names.index(name)), tip=f"{name}: {short(v)} {unit}")
            x += sx(v)
    base = top + row * len(bars)
    _value_axis(svg, left, pw, base, most)
    if limit is not None:
        svg.line(left + sx(limit), top, left + sx(limit), base, stroke="#c00", width=1.5, dash="5 3")
        svg.text(left + sx(limit) - 3, top + 10, limit_label, size=10, anchor="end", fill="#c00")
    _unit_and_legend(svg, left, pw, base, unit, names)
    return str(svg)


def _value_axis(svg: Svg, left: float, pw: float, base: float, most: float) -> None:
    """The horizontal axis of a bar chart, 0 to `most` over `pw` pixels from `left`, at y `base`."""
    ts = ticks(0, most)
    for t, label in zip(ts, tick_labels(ts)):
        svg.line(left + t / most * pw, base, left + t / most * pw, base + 4)
        svg.text(left + t / most * pw, base + 15, label, size=10, anchor="middle")
    svg.line(left, base, left + pw, base)


def _unit_and_legend(svg: Svg, left: float, pw: float, base: float, unit: str, names: list[str]) -> None:
    """Under a bar chart's axis: its unit, then a swatch per series name in three columns."""
    svg.text(left + pw / 2, base + 28, unit, size=10, anchor="middle")
    for i, name in enumerate(names):
        x, y = left + (i % 3) * pw / 3, base + 40 + 14 * (i // 3)
        svg.rect(x, y - 9, 10, 10, colour(i))
        svg.text(x + 14, y, name, size=10)


def gantt(rows: list[tuple[str, list[tuple[float, float, str, int]]]], x_label: str,
          width: float = 640, title: str = "") -> str:
    """One row per (label, [(start, end, text, kind), ...]): each box spans start to end on
    a shared axis, filled with colour(kind) and labelled with its text when it fits (a
    pipeline's timetable: a row per stage, a box per forward or backward of a microbatch)."""
    left, right, top, row = 70, 12, 24 if title else 8, 22
    height = top + row * len(rows) + 34
    svg = Svg(width, height, title)
    if title:
        svg.text(width / 2, 15, title, size=12, anchor="middle", bold=True)
    end = max([e for _, boxes in rows for _, e, _, _ in boxes] + [1e-30])
    pw = width - left - right
    sx = lambda t: left + t / end * pw                       # noqa: E731
    for i, (label, boxes) in enumerate(rows):
        y = top + row * i
        svg.text(left - 6, y + 15, label, size=10, anchor="end")
        for s, e, text, kind in boxes:
            svg.rect(sx(s), y + 2, sx(e) - sx(s), row - 4, colour(kind), stroke="#fff", tip=text)
            if text and (sx(e) - sx(s)) >= 7 * len(text) + 2:
                svg.text((sx(s) + sx(e)) / 2, y + 15, text, size=10, anchor="middle", fill="#fff")
    base = top + row * len(rows)
    svg.line(left, base, left + pw, base)
    ts = ticks(0, end)
    for t, label in zip(ts, tick_labels(ts)):
        svg.line(sx(t), base, sx(t), base + 4)
        svg.text(sx(t), base + 15, label, size=10, anchor="middle")
    svg.text(left + pw / 2, base + 30, x_label, size=10, anchor="middle")
    return str(svg)


def grid(cells: list[list[tuple[str, int | None]]], row_labels: list[str], col_labels: list[str],
         cell: float = 34, title: str = "") -> str:
    """A table of coloured cells, each (text, kind): kind None leaves the cell white (a
    mesh's ranks by coordinates, the (query chunk, key chunk) pairs a cp rank computes)."""
    left, top = 70, (40 if title else 22)
    width = left + cell * max((len(r) for r in cells), default=0) + 10
    height = top + cell * len(cells) + 10
    svg = Svg(width, height, title)
    if title:
        svg.text(width / 2, 15, title, size=12, anchor="middle", bold=True)
    for j, label in enumerate(col_labels):
        svg.text(left + cell * (j + 0.5), top - 6, label, size=10, anchor="middle")
    for i, r in enumerate(cells):
        svg.text(left - 6, top + cell * (i + 0.5) + 4, row_labels[i] if i < len(row_labels) else "",
                 size=10, anchor="end")
        for j, (text, kind) in enumerate(r):
            fill = "#fff" if kind is None else colour(kind)
            svg.rect(left + cell * j, top + cell * i, cell, cell, fill, stroke="#888", tip=text)
            svg.text(left + cell * (j + 0.5), top + cell * (i + 0.5) + 4, text, size=10, anchor="middle",
                     fill="#222" if kind is None else "#fff")
    return str(svg)


def grouped_bars(groups: list[tuple[str, list[tuple[str, float]]]], unit: str, width: float = 560,
                 title: str = "") -> str:
    """Horizontal bars side by side in groups, one group per (label, [(series, value), ...]): each
    series a thin bar of its own colour, all measured from 0 on one axis (counts of two kinds
    beside each other, a plan's figure beside a measured one), each bar's value written after it."""
    names = list(dict.fromkeys(n for _, bars in groups for n, _ in bars))
    left, right, top, bar, gap = 150, 50, 24 if title else 8, 12, 8
    rows = sum(len(bars) for _, bars in groups)
    base = top + rows * bar + gap * len(groups)
    height = base + 34 + 14 * ((len(names) + 2) // 3)
    svg = Svg(width, height, title)
    if title:
        svg.text(width / 2, 15, title, size=12, anchor="middle", bold=True)
    most = max([v for _, bars in groups for _, v in bars] + [1e-30])
    pw = width - left - right
    sx = lambda v: v / most * pw                            # noqa: E731
    y = top
    for label, bars in groups:
        svg.text(left - 6, y + bar * len(bars) / 2 + 4, label, size=10, anchor="end")
        for name, v in bars:
            svg.rect(left, y + 1, sx(v), bar - 2, colour(names.index(name)), tip=f"{name}: {short(v)} {unit}")
            svg.text(left + sx(v) + 3, y + bar - 2, short(v), size=9)
            y += bar
        y += gap
    _value_axis(svg, left, pw, base, most)
    svg.line(left, top, left, base)
    _unit_and_legend(svg, left, pw, base, unit, names)
    return str(svg)


def _size(text: str) -> tuple[float, float]:
    """(width, height) of an <svg> element made by this module."""
    head = text[:text.index(">")]
    return tuple(float(head.split(f' {k}="')[1].split('"')[0]) for k in ("width", "height"))


def panels(parts: list[str], columns: int = 1, title: str = "", gap: float = 10) -> str:
    """Several figures of this module as one: each `<svg>` placed in a grid of `columns`, row by
    row (a nested <svg> keeps its own coordinates), under an optional title."""
    sizes = [_size(p) for p in parts]
    col_w = [max([w for k, (w, _) in enumerate(sizes) if k % columns == c] + [0]) for c in range(columns)]
    row_h = [max(h for _, h in sizes[r:r + columns]) for r in range(0, len(parts), columns)]
    top = 22 if title else 0
    svg = Svg(sum(col_w) + gap * (columns - 1), top + sum(row_h) + gap * max(len(row_h) - 1, 0), title)
    if title:
        svg.text(svg.width / 2, 15, title, size=13, anchor="middle", bold=True)
    for k, part in enumerate(parts):
        r, c = divmod(k, columns)
        x, y = sum(col_w[:c]) + gap * c, top + sum(row_h[:r]) + gap * r
        svg.parts.append(f'<svg x="{_num(x)}" y="{_num(y)}"' + part[len("<svg"):])
    return str(svg)
