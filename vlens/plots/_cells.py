"""Readable cells: text colour picked against each cell's colour, and the
sizes every token figure shares.

A heatmap's own text colour (plotly's "auto") switches between dark grey
and white at a brightness threshold, which leaves mid-tone cells below the
WCAG contrast ratio of 4.5. Here the colour of each cell is worked out
from the trace's colour scale and the text is black or white, whichever
contrasts more: one of the two always reaches 4.58 (the square root of 21),
so every cell passes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

__all__ = ["CHAR_PX", "FONT_PX", "PLOT_PX", "cell_text_traces", "colour_at", "contrast_ratio",
           "labels_fit", "readable", "text_colour", "wrap_title"]

#: every figure's text (axes, ticks, hovers, cell labels): readable from the back row
FONT_PX = 14
#: the width of one character of cell text at FONT_PX, roughly (px)
CHAR_PX = 8
#: the width a figure that fills the page is assumed to get: a notebook's (px)
PLOT_PX = 900
TITLE_PX = 17
BLACK, WHITE = "#000000", "#ffffff"
#: what a cell with no value shows (the figures set their plot background to it)
EMPTY = "#ffffff"

_NAMED = {"white": (255, 255, 255), "black": (0, 0, 0), "grey": (128, 128, 128),
          "gray": (128, 128, 128)}


def rgb(colour: str) -> tuple[float, float, float]:
    """``(r, g, b)`` 0-255 of ``"#rrggbb"``, ``"#rgb"``, ``"rgb(…)"``,
    ``"rgba(…)"`` (alpha ignored) or a few names."""
    c = str(colour).strip().lower()
    if c in _NAMED:
        return tuple(float(v) for v in _NAMED[c])  # type: ignore[return-value]
    if c.startswith("#"):
        h = c[1:]
        if len(h) == 3:
            h = "".join(ch * 2 for ch in h)
        return tuple(float(int(h[i:i + 2], 16)) for i in (0, 2, 4))  # type: ignore[return-value]
    nums = re.findall(r"[-\d.]+", c)
    if c.startswith("rgb") and len(nums) >= 3:
        return tuple(float(v) for v in nums[:3])  # type: ignore[return-value]
    raise ValueError(f"not a colour this module reads: {colour!r}")


def _hex(r: float, g: float, b: float) -> str:
    return "#" + "".join(f"{max(0, min(255, round(v))):02x}" for v in (r, g, b))


def _channel(v: float) -> float:
    v /= 255
    return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4


def _luminance_of(r: float, g: float, b: float) -> float:
    return 0.2126 * _channel(r) + 0.7152 * _channel(g) + 0.0722 * _channel(b)


def luminance(colour: str) -> float:
    """WCAG relative luminance (0 black … 1 white)."""
    return _luminance_of(*rgb(colour))


def _contrast(la: float, lb: float) -> float:
    la, lb = sorted((la, lb), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def contrast_ratio(a: str, b: str) -> float:
    """WCAG contrast ratio of two colours (1 … 21; text wants >= 4.5)."""
    return _contrast(luminance(a), luminance(b))


_LUM_BLACK, _LUM_WHITE = luminance(BLACK), luminance(WHITE)


def _text_for(lum: float) -> str:
    """Black or white text on a cell of luminance ``lum``."""
    return BLACK if _contrast(_LUM_BLACK, lum) >= _contrast(_LUM_WHITE, lum) else WHITE


def text_colour(cell: str) -> str:
    """Black or white: whichever contrasts more with ``cell`` (>= 4.58 always)."""
    return _text_for(luminance(cell))


def colour_at(colorscale: Sequence[Sequence[Any]], value: float | None, zmin: float,
              zmax: float, *, reverse: bool = False) -> str:
    """The colour plotly paints ``value`` with: ``colorscale`` is a list of
    ``(position 0…1, colour)`` stops (a trace's validated ``colorscale``),
    ``value`` is placed linearly between ``zmin`` and ``zmax`` (clamped) and
    the stops are blended in RGB, as plotly.js does. ``None`` / NaN: the
    empty cell's colour."""
    got = _painted(_stops(colorscale), value, zmin, zmax, reverse)
    return EMPTY if got is None else _hex(*got)


def _stops(colorscale: Sequence[Sequence[Any]]) -> list[tuple[float, tuple[float, ...]]]:
    return [(float(p), rgb(c)) for p, c in colorscale]


def _painted(stops: list[tuple[float, tuple[float, ...]]], value: float | None, zmin: float,
             zmax: float, reverse: bool) -> tuple[float, ...] | None:
    """:func:`colour_at`'s colour as 0-255 channels, rounded as its hex is
    (None: an empty cell), from stops parsed once."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    t = 0.5 if zmax == zmin else (float(value) - zmin) / (zmax - zmin)
    t = min(1.0, max(0.0, t))
    if reverse:
        t = 1.0 - t
    mixed = stops[-1][1]
    for (p0, c0), (p1, c1) in zip(stops, stops[1:]):
        if t <= p1:
            f = 0.0 if p1 == p0 else (t - p0) / (p1 - p0)
            mixed = tuple(a + f * (b - a) for a, b in zip(c0, c1))
            break
    return tuple(float(max(0, min(255, round(v)))) for v in mixed)


def cell_text_traces(heat: go.Heatmap, text: Sequence[Sequence[str]],
                     size: int = FONT_PX) -> list[go.Heatmap]:
    """Two heatmaps that draw ``text`` (``[rows][cols]``, like ``heat.z``)
    over ``heat``: one in black over the light cells, one in white over the
    dark ones. Each repaints only its own cells (the same colour scale and
    range as ``heat``, which must have ``zmin``/``zmax``) and takes no hover,
    so ``heat`` keeps its hover, colour bar and data. Empty cells (``None``)
    show the plot background: black text."""
    scale = heat.colorscale
    reverse = bool(heat.reversescale)
    zmin, zmax = heat.zmin, heat.zmax
    z = [list(row) for row in heat.z]
    stops = _stops(scale)  # parsed once, not per cell
    empty = _text_for(luminance(EMPTY))
    decided = [[empty if c is None else _text_for(_luminance_of(*c))
                for c in (_painted(stops, v, zmin, zmax, reverse) for v in zrow)] for zrow in z]
    out = []
    for colour in (BLACK, WHITE):
        zz, tt = [], []
        for zrow, trow, drow in zip(z, text, decided):
            keep = [d == colour for d in drow]
            zz.append([v if k else None for v, k in zip(zrow, keep)])
            tt.append([t if k else "" for t, k in zip(trow, keep)])
        out.append(go.Heatmap(
            z=zz, x=heat.x, y=heat.y, text=tt, texttemplate="%{text}",
            textfont={"size": size, "color": colour}, colorscale=scale, reversescale=reverse,
            zmin=heat.zmin, zmax=heat.zmax, xgap=heat.xgap, ygap=heat.ygap, showscale=False,
            hoverinfo="skip", name="cell text", xaxis=heat.xaxis, yaxis=heat.yaxis,
        ))
    return out


def labels_fit(text: Sequence[Sequence[str]], cell_px: float) -> bool:
    """Whether every label of ``text`` (``[rows][cols]``) fits in a cell
    ``cell_px`` wide, with a few pixels either side. A figure that writes
    values in its cells writes them only then: in narrower cells the labels
    run into each other ("0.000.000.00") and the hover has the value."""
    longest = max((len(t) for row in text for t in row), default=0)
    return longest * CHAR_PX + 6 <= cell_px


def wrap_title(text: str, chars: int = 90) -> str:
    """``text`` broken into lines (``<br>``) so a long title wraps instead of
    running off a narrow figure: first after a ``": "`` (a title's
    settings, then what they did), then at spaces past ``chars`` characters.
    A number stays with the words before it."""
    text = str(text)
    head, sep, tail = text.partition(": ")
    if sep and len(text) > 60 and "<br>" not in text:
        return wrap_title(head + ":", chars) + "<br>" + wrap_title(tail, chars)
    lines: list[str] = []
    for word in text.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= chars:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "<br>".join(lines)


def readable(fig: go.Figure, title: str, *, height: int | None = None, top: int = 60,
             cells: bool = True) -> go.Figure:
    """The layout every token figure shares: ``FONT_PX`` text, a wrapped
    ``TITLE_PX`` title with room above the plot for its lines, and the
    width left to the page (autosize; no fixed width). ``height``: px.
    ``cells``: the plot background is ``EMPTY``, the colour an empty cell's
    text was picked against (charts without cells keep the template's)."""
    wrapped = wrap_title(title)
    lines = wrapped.count("<br>") + 1
    fig.update_layout(
        title={"text": wrapped, "font": {"size": TITLE_PX}},
        font={"size": FONT_PX},
        hoverlabel={"font": {"size": FONT_PX}},
        autosize=True,
        margin={"t": top + 22 * (lines - 1)},
    )
    if cells:
        fig.update_layout(plot_bgcolor=EMPTY)
    if height is not None:
        fig.update_layout(height=height + 22 * (lines - 1))
    for ann in fig.layout.annotations:
        if ann.font.size is None or ann.font.size < FONT_PX:
            ann.font.size = FONT_PX
    return fig
