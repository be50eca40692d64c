"""A plotly figure as a small anywidget that draws from its own state.

Why not plotly's ``go.FigureWidget``: since plotly 6 it is an anywidget
whose front-end module is the whole plotly.js bundle (~5 MB). Every
FigureWidget sends that module again and the page evaluates it once per
figure, while anywidget gives a widget's module about 2 s to load before it
marks the model failed ("[anywidget] Failed to initialize model") and drops
every later update. On a busy machine a notebook of eight figures misses
that window, and the views stay blank for good (docs/widgets.md has the
measurements).

:class:`FigureView` sends only the figure (as JSON) and a reference to one
shared :class:`PlotlyLibrary` model that carries plotly.js once per kernel;
its front end (``figure.js``) is a few kB, so it starts at once. Its long
work (evaluating plotly.js, at most once per page and shared with
jupyterlab-plotly's plain figures, and each draw) waits until the other
vlens widgets of the moment have started (``vlens/widgets/_page.py``), so
it never holds their start past anywidget's window. Updates from
Python (``view.show(fig)``) redraw the same figure in place
(``Plotly.react``). Clicks come back to the traces' ``on_click`` callbacks
as they did with a FigureWidget: ``view.data[i].on_click(fn)`` with
``fn(trace, points, state)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
import plotly.io as pio
import traitlets
from plotly.callbacks import Points
from plotly.offline import get_plotlyjs, get_plotlyjs_version

from vlens.widgets._page import StartingWidget

__all__ = ["FigureView", "PlotlyLibrary"]

_HERE = Path(__file__).parent


class PlotlyLibrary(widgets.Widget):
    """plotly.js as the state of one plain widget model, sent to the page
    once per kernel and shared by every :class:`FigureView`."""

    source = traitlets.Unicode("").tag(sync=True)
    #: its version: a plotly.js of this version already in the page is used instead
    version = traitlets.Unicode("").tag(sync=True)


_LIBRARY: PlotlyLibrary | None = None


def plotly_library() -> PlotlyLibrary:
    """The kernel's one :class:`PlotlyLibrary` (made again if closed)."""
    global _LIBRARY
    if _LIBRARY is None or _LIBRARY.comm is None:
        _LIBRARY = PlotlyLibrary(source=get_plotlyjs(), version=get_plotlyjs_version())
    return _LIBRARY


class FigureView(StartingWidget):
    """One plotly figure on the page. ``view.figure`` is the ``go.Figure``
    shown (``view.data`` and ``view.layout`` are its traces and layout);
    ``view.show(fig)`` replaces it in place."""

    _esm = _HERE / "figure.js"

    #: the figure as plotly JSON (what the page draws)
    figure_json = traitlets.Unicode("{}").tag(sync=True)
    #: the shared plotly.js model, as anywidget names a widget ("anywidget:<id>")
    library = traitlets.Unicode("").tag(sync=True)

    def __init__(self, figure: go.Figure | None = None, *, height: int | None = None) -> None:
        super().__init__(library=f"anywidget:{plotly_library().model_id}")
        self._figure = go.Figure()
        self._data_json: str | None = "[]"
        if height:
            self._figure.layout.height = height
        self.on_msg(self._on_message)
        if figure is not None:
            self.show(figure)

    @property
    def figure(self) -> go.Figure:
        return self._figure

    @property
    def data(self) -> tuple:
        return self._figure.data

    @property
    def layout(self) -> go.Layout:
        return self._figure.layout

    def show(self, fig: go.Figure) -> None:
        """Show ``fig`` (its traces and layout) in place of what is shown."""
        height = self._figure.layout.height
        self._figure = go.Figure(fig)
        if self._figure.layout.height is None and height is not None:
            self._figure.layout.height = height
        whole = self._figure.to_plotly_json()
        # the traces' JSON, kept: a layout change reuses it (update_layout)
        self._data_json = None if self._figure.frames else pio.json.to_json_plotly(whole["data"])
        self.figure_json = self._joined(whole["layout"])

    def update_layout(self, **layout: Any) -> None:
        """Replace layout properties of the figure shown (``shapes=[...]``, a
        title: each given property is replaced whole, not merged), its
        traces as they are. The traces are not built or serialised again,
        so moving an outline on a grid of hundreds of heatmaps costs what
        the layout does."""
        self._figure.update_layout(overwrite=True, **layout)
        self.figure_json = self._joined(self._figure.layout.to_plotly_json())

    def _joined(self, layout: dict) -> str:
        """The figure's JSON from the kept traces' JSON and ``layout``."""
        if self._data_json is None:  # a figure with frames: serialised whole
            return pio.to_json(self._figure, validate=False)
        return f'{{"data":{self._data_json},"layout":{pio.json.to_json_plotly(layout)}}}'

    def _on_message(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if not isinstance(content, dict) or content.get("event") != "click":
            return
        by_trace: dict[int, list[dict]] = {}
        for p in content.get("points") or []:
            if isinstance(p, dict) and isinstance(p.get("trace"), int):
                by_trace.setdefault(p["trace"], []).append(p)
        for index, points in by_trace.items():
            if not 0 <= index < len(self._figure.data):
                continue
            trace = self._figure.data[index]
            trace._dispatch_on_click(Points(
                point_inds=[p.get("index") for p in points],
                xs=[p.get("x") for p in points], ys=[p.get("y") for p in points],
                trace_name=trace.name, trace_index=index), None)
