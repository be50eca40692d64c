"""Token rows: sequences of the same positions drawn one above the other,
each token its own cell, wrapped into lines like text.

A cell is as wide as its token's text (the widest of the rows at that
position, so the rows stay aligned), the text keeps its whitespace visible
(:func:`vlens.tokens.visible`) and is black or white against the cell's
colour (:func:`vlens.plots._cells.text_colour`). A long run wraps into
several lines (at most ``per_line`` tokens or ``line_chars`` characters
each) instead of shrinking the cells, so the text stays one size however
long the generation.

The cells are layout shapes named ``"token cell"`` (their ``fillcolor`` is
the colour) and the text one scatter trace of ``mode="text"`` (its
``textfont.color`` has one colour per cell); both stay plain SVG in the
page, where a test can read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from vlens.plots._cells import FONT_PX, colour_at, text_colour
from vlens.plots._common import SPAN_LINE, plain_text
from vlens.tokens import visible

__all__ = ["ROW_PX", "TokenRow", "add_token_rows", "cell_lines", "line_breaks", "named_scale"]

ROW_PX = 36  # one row of cells
GAP_PX = 26  # between lines: room for the line's first position
GAP = GAP_PX / ROW_PX  # the same in row units
PER_LINE = 24
LINE_CHARS = 90
CELL_FONT = {"family": "DejaVu Sans Mono, Menlo, Consolas, monospace", "size": FONT_PX + 1}


@dataclass
class TokenRow:
    """One labelled sequence: ``tokens`` ``[n]`` (None: no token there, a
    blank) and ``values`` ``[n]`` (the cell colours; None: no value),
    ``hover`` ``[n]`` optional text for each cell's hover."""

    label: str
    tokens: Sequence[str | None]
    values: Sequence[float | None]
    hover: Sequence[str] | None = None


def named_scale(name: str) -> list[tuple[float, str]]:
    """A plotly colour scale's stops ``[(position, colour)]`` by its name."""
    return [(float(p), str(c)) for p, c in go.Heatmap(colorscale=name).colorscale]


def _width(tokens: Sequence[str | None]) -> int:
    """Characters of the widest token at one position (+1 of padding, 3 at least)."""
    return max([3] + [len(visible(t)) + 1 for t in tokens if t is not None])


def cell_lines(columns: Sequence[Sequence[str | None]], per_line: int = PER_LINE,
               line_chars: int = LINE_CHARS) -> tuple[list[int], list[tuple[int, int]]]:
    """``(widths, lines)`` of token rows: ``columns`` ``[n][rows]`` (the
    tokens at each position), each position's width in characters and the
    ``(start, stop)`` of each line (:func:`line_breaks`)."""
    widths = [_width(col) for col in columns]
    return widths, line_breaks(widths, per_line, line_chars)


def line_breaks(widths: Sequence[int], per_line: int = PER_LINE,
                line_chars: int = LINE_CHARS) -> list[tuple[int, int]]:
    """``[(start, stop)]`` index ranges of each line: a line ends after
    ``per_line`` cells or before its width would pass ``line_chars``
    (a line always takes at least one cell)."""
    lines, start, used = [], 0, 0
    for i, w in enumerate(widths):
        if i > start and (i - start >= per_line or used + w > line_chars):
            lines.append((start, i))
            start, used = i, 0
        used += w
    if widths:
        lines.append((start, len(widths)))
    return lines


def _outline(x0: float, x1: float, y0: float, y1: float, axes: tuple[str, str],
             name: str, line: dict) -> dict:
    return {"type": "rect", "xref": axes[0], "yref": axes[1], "x0": x0, "x1": x1,
            "y0": y0, "y1": y1, "line": line, "name": name, "layer": "above"}


def add_token_rows(
    fig: go.Figure,
    rows: Sequence[TokenRow],
    positions: Sequence[int],
    *,
    colorscale: Sequence[Sequence[Any]],
    zmin: float,
    zmax: float,
    value_name: str,
    axes: tuple[str, str] = ("x", "y"),
    subplot: dict | None = None,
    mark: int | None = None,
    n_prompt: int | None = None,
    per_line: int = PER_LINE,
    line_chars: int = LINE_CHARS,
) -> int:
    """Draw ``rows`` (each ``[n]`` over ``positions`` ``[n]``) as cells on
    the axes ``axes`` (``("x2", "y2")`` …; ``subplot`` the ``row=, col=``
    of :meth:`go.Figure.add_trace` when the figure has subplots). Colours:
    ``colorscale`` stops over ``zmin … zmax``. ``mark`` (a position) is
    outlined across the rows (a shape named ``"first divergence"``),
    ``n_prompt`` draws a dotted line where generation starts. The hover
    says the row, the position, the token and ``value_name``. Returns the
    number of lines; the figure needs ``ROW_PX`` per row and ``GAP_PX`` per
    line of height."""
    n, r_n = len(positions), len(rows)
    widths, lines = cell_lines(
        [[row.tokens[i] if i < len(row.tokens) else None for row in rows] for i in range(n)],
        per_line, line_chars)
    xs, ys, texts, colours, hover = [], [], [], [], []
    shapes, ticks, labels, notes = [], [], [], []
    for k, (start, stop) in enumerate(lines):
        top = k * (r_n + GAP)
        notes.append({"x": 0, "y": top - 0.5, "xref": axes[0], "yref": axes[1],
                      "text": f"position {positions[start]}", "showarrow": False,
                      "xanchor": "left", "yanchor": "bottom", "font": {"size": FONT_PX},
                      "name": "line start"})
        left = 0.0
        for i in range(start, stop):
            right = left + widths[i]
            for r, row in enumerate(rows):
                y = top + r
                tok = row.tokens[i] if i < len(row.tokens) else None
                if tok is None:
                    continue
                value = row.values[i] if i < len(row.values) else None
                fill = colour_at(colorscale, value, zmin, zmax)
                shapes.append({"type": "rect", "xref": axes[0], "yref": axes[1],
                               "x0": left + 0.08, "x1": right - 0.08, "y0": y - 0.45,
                               "y1": y + 0.45, "fillcolor": fill, "line": {"width": 0},
                               "layer": "below", "name": "token cell"})
                xs.append((left + right) / 2)
                ys.append(y)
                texts.append(plain_text(visible(tok)))
                colours.append(text_colour(fill))
                extra = row.hover[i] if row.hover is not None and i < len(row.hover) else (
                    "" if value is None else f"{value_name} {value:.3f}")
                hover.append([row.label, positions[i], plain_text(visible(tok)), extra])
            if mark is not None and positions[i] == mark:
                shapes.append(_outline(left, right, top - 0.5, top + r_n - 0.5, axes,
                                       "first divergence", SPAN_LINE))
            if n_prompt is not None and positions[i] == n_prompt and i > start:
                shapes.append({**_outline(left, left, top - 0.5, top + r_n - 0.5, axes,
                                          "prompt|generated",
                                          {"color": "grey", "width": 2, "dash": "dot"}),
                               "type": "line"})
            left = right
        ticks += [top + r for r in range(r_n)]
        labels += [plain_text(row.label) for row in rows]
    fig.add_trace(go.Scatter(
        x=xs, y=ys, text=texts, mode="text", textfont={**CELL_FONT, "color": colours},
        customdata=hover, name="tokens", showlegend=False,
        hovertemplate="%{customdata[0]}, position %{customdata[1]}: %{customdata[2]}"
                      "<br>%{customdata[3]}<extra></extra>",
    ), **(subplot or {}))
    widest = max([line_chars] + [sum(widths[a:b]) for a, b in lines])
    bottom = (len(lines) - 1) * (r_n + GAP) + r_n - 0.5
    axis_x = {"range": [0, widest], "visible": False, "fixedrange": True}
    axis_y = {"range": [bottom + 0.05, -0.5 - GAP], "tickmode": "array", "tickvals": ticks,
              "ticktext": labels, "showgrid": False, "zeroline": False, "fixedrange": True,
              # a little room between a row's name and its first cell
              "ticks": "outside", "ticklen": 6, "tickcolor": "rgba(0,0,0,0)"}
    fig.update_layout({_axis_name(axes[0]): axis_x, _axis_name(axes[1]): axis_y})
    fig.update_layout(shapes=list(fig.layout.shapes) + shapes,
                      annotations=list(fig.layout.annotations) + notes)
    return len(lines)


def _axis_name(ref: str) -> str:
    """``"x2"`` -> ``"xaxis2"``."""
    return ref[0] + "axis" + ref[1:]
