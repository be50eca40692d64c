"""Save what a widget shows as one self-contained HTML file.

A snapshot opens in any browser with no kernel and no network: plotly.js is
inlined once, every figure is embedded with its data (hover and zoom still
work), and text, token chips and control settings are static HTML. For
slides and handouts::

    ex.snapshot("explorer.html")                 # any vlens view or panel
    vlens.widgets.save_snapshot(widget, "x.html")  # any ipywidget tree

How a tree is drawn: boxes stay boxes (``HBox`` a wrapping row, ``VBox`` a
column), every tab of a ``Tab`` becomes a titled section (the tab on screen
says so), hidden parts (``layout.display == "none"``) and empty figures are
left out, buttons and progress bars are dropped, and a control shows its
description and value. A widget class can draw itself instead by defining
``_snapshot_html(render)``, where ``render(child)`` draws a child widget:
that is how a future view with a front end of its own plugs in.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from vlens.widgets.figure import FigureView
from vlens.widgets.token_span import TokenSpanPicker, role_class

__all__ = ["save_snapshot", "snapshot_html"]

_STYLE = """
body { font-family: system-ui, sans-serif; font-size: 14px; margin: 16px; color: #1f2328; }
.vl-row { display: flex; flex-flow: row wrap; gap: 4px 16px; align-items: flex-start; }
.vl-col { display: flex; flex-direction: column; gap: 6px; }
.vl-control { color: #57606a; font-size: 13px; }
.vl-control b { color: #1f2328; font-weight: 600; }
.vl-text { white-space: pre-wrap; font-family: monospace; font-size: 13px;
           background: #f6f8fa; padding: 6px; margin: 0; }
.vl-error { color: #b00020; }
.vl-tab { border-top: 2px solid #d0d7de; padding-top: 4px; margin-top: 8px; }
.vl-tab > h3 { margin: 4px 0; font-size: 15px; }
.vl-figure { width: 100%; }
.vl-chips { display: flex; flex-wrap: wrap; gap: 3px; font-family: monospace; font-size: 13px; }
.vl-chip { border: 1px solid #b0b7c3; border-radius: 4px; background: #f4f6f9;
           padding: 1px 6px; white-space: pre; }
.vl-chip.generated, .vl-chip.role-generated { font-style: italic; background: #fff8e6; }
.vl-chip.role-system { background: #efe6fa; border-color: #9c7fd1; }
.vl-chip.role-user { background: #e2effc; border-color: #5b9bd5; }
.vl-chip.role-assistant { background: #e4f4e4; border-color: #5fae5f; }
.vl-chip.role-other { background: #f6efe0; border-color: #c9a35a; }
.vl-legend { color: #57606a; font-size: 12px; }
.vl-chip.selected { background: #4b77be; border-color: #2d4f87; color: white; }
footer { margin-top: 24px; color: #57606a; font-size: 12px; }
"""

_SKIPPED = (widgets.Button, widgets.IntProgress, widgets.FloatProgress, widgets.Output)


def _hidden(w: Any) -> bool:
    layout = getattr(w, "layout", None)
    return layout is not None and getattr(layout, "display", None) == "none"


def _control(desc: str, value: Any) -> str:
    desc = html.escape(str(desc or ""))
    shown = html.escape(str(value))
    return f"<span class='vl-control'>{desc + ': ' if desc else ''}<b>{shown}</b></span>"


def _figure(fig: go.FigureWidget | go.Figure) -> str:
    if not fig.data:
        return ""
    body = go.Figure(fig).to_html(full_html=False, include_plotlyjs=False,
                                  default_width="100%", config={"displaylogo": False})
    return f"<div class='vl-figure'>{body}</div>"


def _chips(picker: TokenSpanPicker) -> str:
    start, stop = picker.selection
    chips = []
    roles = picker.roles if len(picker.roles) == len(picker.tokens) else []
    for i, tok in enumerate(picker.tokens):
        cls = ["vl-chip"]
        if 0 <= picker.n_prompt <= i:
            cls.append("generated")
        if roles:
            cls.append(role_class(roles[i]))
        if start <= i < stop:
            cls.append("selected")
        # a tint as the live chips draw it (token_span.js)
        tint = (f" style='background:rgba(214,39,40,{max(0.0, min(1.0, picker.shade[i])):.3f})'"
                if len(picker.shade) == len(picker.tokens) and "selected" not in cls else "")
        chips.append(f"<span class='{' '.join(cls)}' title='token {i}'{tint}>"
                     f"{html.escape(tok)}</span>")
    if not chips:
        return ""
    keys = "".join(f"<span class='vl-chip {cls}'>{html.escape(words)}</span>"
                   for cls, words in (picker.legend if roles else []))
    legend = f"<div class='vl-chips vl-legend'>chips by role: {keys}</div>" if keys else ""
    return f"{legend}<div class='vl-chips'>{''.join(chips)}</div>"


def render(w: Any) -> str:
    """The static HTML of widget ``w`` and its children, as shown now."""
    if w is None or _hidden(w) or isinstance(w, _SKIPPED):
        return ""
    own = getattr(w, "_snapshot_html", None)
    if callable(own):
        return own(render)
    if isinstance(w, FigureView):
        return _figure(w.figure)
    if isinstance(w, (go.FigureWidget, go.Figure)):
        return _figure(w)
    if isinstance(w, TokenSpanPicker):
        return _chips(w)
    if isinstance(w, widgets.Tab):
        titles = list(w.titles)
        parts = []
        for i, child in enumerate(w.children):
            body = render(child)
            if body:
                title = html.escape(titles[i] if i < len(titles) and titles[i] else f"tab {i}")
                mark = " <small>(the tab on screen)</small>" if w.selected_index == i else ""
                parts.append(f"<section class='vl-tab'><h3>{title}{mark}</h3>{body}</section>")
        return "".join(parts)
    if isinstance(w, widgets.Box):
        parts = [p for p in (render(c) for c in w.children) if p]
        if not parts:
            return ""
        cls = "vl-row" if isinstance(w, widgets.HBox) else "vl-col"
        return f"<div class='{cls}'>{''.join(parts)}</div>"
    if isinstance(w, widgets.HTML):  # vlens's own markup (notes)
        return f"<div>{w.value}</div>" if w.value else ""
    if isinstance(w, widgets.Label):
        if not w.value:
            return ""
        red = (w.style.text_color or "") == "#b00020"
        return f"<div class='{'vl-error' if red else 'vl-control'}'>{html.escape(w.value)}</div>"
    if isinstance(w, widgets.Textarea):
        if not w.value:
            return ""
        name = (f"<div class='vl-control'>{html.escape(w.description)}</div>"
                if w.description else "")
        return f"<div class='vl-col'>{name}<pre class='vl-text'>{html.escape(w.value)}</pre></div>"
    if isinstance(w, widgets.Checkbox):
        return _control(w.description, "on" if w.value else "off")
    if isinstance(w, (widgets.ToggleButtons, widgets.Dropdown, widgets.Select)):
        label = w.label if w.label is not None else w.value
        return _control(w.description, label)
    if isinstance(w, (widgets.IntRangeSlider, widgets.FloatRangeSlider)):
        lo, hi = w.value
        return _control(w.description, f"{lo} … {hi}")
    if hasattr(w, "value") and hasattr(w, "description"):  # sliders, text boxes
        return _control(w.description, w.value) if w.value not in ("", None) else ""
    return ""  # a widget with nothing to say on paper


def snapshot_html(widget: Any, *, title: str | None = None) -> str:
    """One self-contained HTML page of what ``widget`` shows (see module doc)."""
    from plotly.offline import get_plotlyjs

    name = title or f"vlens: {type(widget).__name__}"
    body = render(widget)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(name)}</title><style>{_STYLE}</style>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head>"
        f"<body><h2>{html.escape(name)}</h2>{body}"
        "<footer>a vlens snapshot: saved from a live widget, no kernel needed</footer>"
        "</body></html>"
    )


def save_snapshot(widget: Any, path: str | Path, *, title: str | None = None) -> Path:
    """Write :func:`snapshot_html` of ``widget`` to ``path``; return the path."""
    path = Path(path)
    path.write_text(snapshot_html(widget, title=title), encoding="utf-8")
    return path

