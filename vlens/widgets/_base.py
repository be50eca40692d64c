"""What every vlens widget shares: an error area, a progress row, a save
button, in-place figure updates, and (for views) the shared :class:`Selection`.

Callbacks run inside the kernel's comm handler, where an exception would
only reach a log nobody reads. :meth:`Panel._guard` catches it, shows the
message (and the traceback, folded) in the widget, and keeps the widget
working; the next successful callback clears it.
"""

from __future__ import annotations

import html
import re
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
import traitlets

from vlens.results import Run
from vlens.widgets.figure import FigureView
from vlens.widgets._runs import Runs
from vlens.widgets.selection import Selection, token_sites

__all__ = [
    "Panel", "View", "figure_widget", "full_sites", "layers_spanned", "lines_of", "show_figure",
    "texts_html",
]


def figure_widget(height: int | None = None) -> FigureView:
    """An empty figure view (:class:`~vlens.widgets.figure.FigureView`) to be
    filled by :func:`show_figure`."""
    return FigureView(height=height)


def show_figure(target: FigureView, fig: go.Figure) -> None:
    """Replace ``target``'s traces and layout with ``fig``'s, in one message
    to the browser (the widget object, and so its place on the page, stays)."""
    target.show(fig)


class _SaveRow(widgets.HBox):
    """The save button and where the last file went (left out of the
    snapshot it makes)."""

    def _snapshot_html(self, render: Callable[[Any], str]) -> str:
        return ""


def _file_name(widget: Any) -> str:
    """``steering-panel-20260101-120000.html`` for a SteeringPanel, now."""
    words = re.sub(r"(?<!^)(?=[A-Z])", "-", type(widget).__name__).lower()
    return f"{words}-{time.strftime('%Y%m%d-%H%M%S')}.html"


class Panel(widgets.VBox):
    """A VBox with an error line, a folded traceback, a progress row and a
    **save** button (:meth:`save`: what it shows, as one HTML file).

    Subclasses build their controls, then call ``super().__init__(children)``.
    ``error`` holds the message of the last failed callback ("" when the last
    one succeeded); ``busy`` is true while a run is pending, and the panel's
    run buttons (``_run_button``, ``_sweep_button``, ``_trace_button``) are
    disabled meanwhile.

    Engine runs (:mod:`vlens.widgets._runs`): a callback starts one with
    :meth:`_start` (in the background, the latest wins); a Python method
    runs one with :meth:`_call` (in the caller's thread, returning its
    result). :meth:`wait` waits for the panel's pending runs.
    """

    error = traitlets.Unicode("", help="message of the last failed callback")
    busy = traitlets.Bool(False, help="true while a run is pending (started, not ended)")
    shows = traitlets.Unicode("", help="the run whose result is on show, e.g. 'grow #4'")

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
        self._save_button = widgets.Button(
            description="save", icon="download",
            tooltip="save what this shows as one HTML file (opens with no kernel)")
        self._save_label = widgets.HTML()
        self._save_row = _SaveRow([self._save_button, self._save_label])
        self._save_button.on_click(self._guard(lambda _b: self.save()))
        self.saved_path: Path | None = None
        self._depth = 0  # nested _working blocks: the outermost shows and hides the row
        self._runs = Runs(self._set_running)
        super().__init__(
            children=[*children, self._progress_row, self._error_label, self._details,
                      self._save_row]
        )
        # one save button per page: a panel inside this one is saved with it
        for inner in self._inner_panels():
            inner.hide_save_button()

    def snapshot(self, path: Any, *, title: str | None = None) -> Any:
        """Save what this widget shows now to one self-contained HTML file
        (figures with plotly.js inline, text as static HTML; opens with no
        kernel). Returns the path. See :func:`vlens.widgets.save_snapshot`."""
        from vlens.widgets.snapshot import save_snapshot

        return save_snapshot(self, path, title=title)

    def save(self, path: Any = None) -> Path:
        """The save button: :meth:`snapshot` to ``path`` (default: a new
        file named after the view and the time, in the working directory,
        the notebook's folder), then say in the panel where it went.
        Returns the absolute path (also ``saved_path``)."""
        target = Path(path if path is not None else _file_name(self)).resolve()
        self.snapshot(target)
        self.saved_path = target
        self._save_label.value = (
            f"<small>saved to <code>{html.escape(str(target))}</code> "
            "(opens in any browser, no kernel)</small>")
        return target

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

    # -- runs ------------------------------------------------------------------
    def _start(self, key: str, fn: Callable[..., Any], *args: Any) -> None:
        """Start ``fn(*args)`` as this panel's newest run, in a thread of its
        own (for callbacks: the kernel stays free); the setting run under
        way, if any, is cancelled. An exception is shown in the widget."""
        self._runs.start(key, lambda: fn(*args), self._show_error, self._clear_error)

    def _queue(self, key: str, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)``, an action that adds something (grow a
        branch, add a prompt), in a thread of its own: it runs after the
        actions queued before it and no newer run cancels it."""
        self._runs.start(key, lambda: fn(*args), self._show_error, self._clear_error,
                         queue=True)

    def _call(self, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` as this panel's newest run, in this thread (for
        Python methods: it returns the result, or raises)."""
        return self._runs.call(key, lambda: fn(*args))

    @contextmanager
    def _publishing(self) -> Iterator[None]:
        """``with self._publishing():`` around showing a run's result: a run
        replaced meanwhile stops there (and shows nothing); ``shows`` then
        names the run whose result is on show."""
        with self._runs.publishing() as job:
            yield
            if job is not None:
                self.shows = job.label

    def _check_run(self) -> None:
        """Stop here if a newer run replaced this one (a stream's step)."""
        job = self._runs.current
        if job is not None:
            job.check()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the runs this panel (and every panel inside it) started
        have ended; False if ``timeout`` seconds passed first. A run started
        by a control or a button runs in the background: call this before
        reading its result from Python."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            panels = [self, *self._inner_panels()]
            for panel in panels:
                left = None if end is None else max(0.0, end - time.monotonic())
                if not panel.wait_own(left):
                    return False
            if not any(p.under_way() for p in panels):
                return True

    def wait_own(self, timeout: float | None = None) -> bool:
        """Like :meth:`wait`, for this panel's own runs only (not its inner panels')."""
        return self._runs.wait(timeout)

    def under_way(self) -> bool:
        """Whether a run this panel started (not an inner panel's) is under way."""
        return self._runs.under_way()

    def hide_save_button(self) -> None:
        """Hide this panel's save button: the panel it sits in saves it with itself."""
        self._save_row.layout.display = "none"

    def _inner_panels(self) -> list[Panel]:
        found, todo = [], list(self.children)
        while todo:
            w = todo.pop()
            if isinstance(w, Panel):
                found.append(w)
            todo.extend(getattr(w, "children", ()) or ())
        return found

    def _set_running(self, running: bool) -> None:
        self.busy = running
        for name in ("_run_button", "_sweep_button", "_trace_button"):
            button = getattr(self, name, None)
            if button is not None:
                button.disabled = running

    # -- progress --------------------------------------------------------------
    @contextmanager
    def _working(self, what: str, unit: str = "requests"
                 ) -> Iterator[Callable[[int, int], None]]:
        """Show a progress row saying ``what`` while the engine runs.

        Yields ``report(done, total)``, to pass as the Session's
        ``progress=`` (or to call at each step of a stream): the bar moves
        and the label says ``done/total unit`` (each update is sent to the
        browser at once). Inside a run, ``report`` raises
        :class:`~vlens.widgets._runs.RunReplaced` when a newer run replaced
        this one, which stops the engine call cleanly."""
        self._depth += 1
        self._progress.max = 1
        self._progress.value = 0
        self._progress_label.value = what
        self._progress_row.layout.display = ""

        def report(done: int, total: int) -> None:
            self._check_run()
            self._progress.max = max(1, int(total))
            self._progress.value = min(int(done), self._progress.max)
            self._progress_label.value = f"{what} {done}/{total} {unit}"

        try:
            yield report
        finally:
            self._depth -= 1
            if not self._depth:
                self._progress_row.layout.display = "none"
                self._progress_label.value = ""


def full_sites(run: Run) -> list[str]:
    """The sites ``run`` read in full (``"resid_post"``, not ``"resid_post:norm"``)
    with one vector per token (not ``attn_pattern`` or the per-head sites)."""
    return token_sites([key for key in run[0].read_keys if ":" not in key])


def layers_spanned(run: Run) -> int:
    """How many layers a picker over ``run`` offers: up to its highest read layer."""
    t = run[0]
    return 1 + max((max(t.layers_read(k)) for k in t.read_keys if t.layers_read(k)),
                   default=0)


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
