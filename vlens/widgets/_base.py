"""What every vlens widget shares: an error area, a progress row, in-place
figure updates, and (for views) the shared :class:`Selection`.

Callbacks run inside the kernel's comm handler, where an exception would
only reach a log nobody reads. :meth:`Panel._guard` catches it, shows the
message (and the traceback, folded) in the widget, and keeps the widget
working; the next successful callback clears it.
"""

from __future__ import annotations

import html
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
import traitlets

from vlens.results import Run
from vlens.widgets.selection import Selection, token_sites

__all__ = [
    "Panel", "View", "figure_widget", "full_sites", "layers_spanned", "lines_of", "show_figure",
    "texts_html",
]


def figure_widget(height: int | None = None) -> go.FigureWidget:
    """An empty plotly FigureWidget to be filled by :func:`show_figure`."""
    fw = go.FigureWidget()
    if height:
        fw.layout.height = height
    return fw


def show_figure(target: go.FigureWidget, fig: go.Figure) -> None:
    """Replace ``target``'s traces and layout with ``fig``'s, in one message
    to the browser (the widget object, and so its place on the page, stays)."""
    with target.batch_update():
        target.data = []
        target.add_traces(list(fig.data))
        target.layout = fig.layout


class Panel(widgets.VBox):
    """A VBox with an error line, a folded traceback and a progress row.

    Subclasses build their controls, then call ``super().__init__(children)``.
    ``error`` holds the message of the last failed callback ("" when the last
    one succeeded); ``busy`` is true while the engine runs.
    """

    error = traitlets.Unicode("", help="message of the last failed callback")
    busy = traitlets.Bool(False, help="true while an engine call runs")

    def __init__(self, children: list[widgets.Widget]) -> None:
        self._error_label = widgets.Label(style={"text_color": "#b00020"})
        self._traceback = widgets.Output()
        self._details = widgets.Accordion(
            children=[self._traceback], titles=("traceback",), selected_index=None
        )
        self._progress = widgets.IntProgress(
            value=0, min=0, max=1, bar_style="info", layout={"width": "160px"}
        )
        self._progress_label = widgets.Label()
        self._progress_row = widgets.HBox(
            [self._progress, self._progress_label], layout={"display": "none"}
        )
        self._details.layout.display = "none"
        super().__init__(
            children=[*children, self._progress_row, self._error_label, self._details]
        )

    def snapshot(self, path: Any, *, title: str | None = None) -> Any:
        """Save what this widget shows now to one self-contained HTML file
        (figures with plotly.js inline, text as static HTML; opens with no
        kernel). Returns the path. See :func:`vlens.widgets.save_snapshot`."""
        from vlens.widgets.snapshot import save_snapshot

        return save_snapshot(self, path, title=title)

    # -- errors ----------------------------------------------------------------
    def _guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` wrapped for use as a callback: errors are shown, not raised."""

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 -- shown in the widget, which keeps working
                self._show_error(exc)
                return None
            self._clear_error()
            return result

        guarded.__name__ = getattr(fn, "__name__", "callback")
        guarded.__doc__ = fn.__doc__
        return guarded

    def _show_error(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        self._error_label.value = self.error
        self._traceback.outputs = ()
        self._traceback.append_stderr("".join(traceback.format_exception(exc)))
        self._details.layout.display = ""

    def _clear_error(self) -> None:
        if self.error:
            self.error = ""
            self._error_label.value = ""
            self._traceback.outputs = ()
            self._details.layout.display = "none"

    # -- progress --------------------------------------------------------------
    @contextmanager
    def _working(self, what: str) -> Iterator[Callable[[int, int], None]]:
        """Show a progress row saying ``what`` while the engine runs.

        Yields ``report(done, total)``, to pass as the Session's
        ``progress=``: the bar moves as requests finish (each update is sent
        to the browser at once, while the kernel is still busy)."""
        self.busy = True
        self._progress.max = 1
        self._progress.value = 0
        self._progress_label.value = what
        self._progress_row.layout.display = ""

        def report(done: int, total: int) -> None:
            self._progress.max = max(1, int(total))
            self._progress.value = min(int(done), self._progress.max)
            self._progress_label.value = f"{what} {done}/{total}"

        try:
            yield report
        finally:
            self._progress_row.layout.display = "none"
            self._progress_label.value = ""
            self.busy = False


def full_sites(run: Run) -> list[str]:
    """The sites ``run`` read in full (``"resid_post"``, not ``"resid_post:norm"``)
    with one vector per token (not ``attn_pattern`` or the per-head sites)."""
    return token_sites([key for key in run[0].read_keys if ":" not in key])


def layers_spanned(run: Run) -> int:
    """How many layers a picker over ``run`` offers: up to its highest read layer."""
    return 1 + max((max(v) for v in run[0].layers.values() if v), default=0)


def _selected(name: str) -> property:
    def get(self: View) -> Any:
        return getattr(self.selection, name)

    def set_(self: View, value: Any) -> None:
        setattr(self.selection, name, value)

    return property(get, set_, doc=f"the selection's {name} (shared with every view of it)")


class View(Panel):
    """A Panel over ``selection`` (a :class:`Selection`, shared when views
    are composed): ``layer``, ``span`` and ``site`` read and write it."""

    selection: Selection
    layer = _selected("layer")
    span = _selected("span")
    site = _selected("site")


def texts_html(baseline: str, other: str, name: str = "steered") -> str:
    """Two texts side by side (baseline and steered/ablated), escaped."""
    cell = '<div style="flex:1;white-space:pre-wrap"><b>{}</b><br>{}</div>'
    return ('<div class="vlens-stream" style="display:flex;gap:1.5em">'
            + cell.format("baseline", html.escape(baseline))
            + cell.format(name, html.escape(other)) + "</div>")


def lines_of(text: str) -> list[str]:
    """The non-blank lines of a text box, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip()]
