"""Activation patching as a widget: the grid fills in as cells finish;
click a cell to see that run's next-token distribution beside the clean
and corrupt runs'.

``PatchingView(patching)`` shows a finished :class:`vlens.Patching`;
``PatchingView(session, clean=..., corrupt=...)`` (or :meth:`run` later)
streams ``session.stream_patch`` and redraws the grid at every partial
result. The view never builds requests itself: everything it shows comes
from the Patching object (``grid``, ``layers``, ``positions`` or heads,
``tokens``, ``answer_text``, the per-cell top-k).

With ``atp=True`` (a session) or ``attribution=`` (a result) a second
heatmap shows attribution patching's estimate of the same grid
(``session.attribution_patch``, on the Hugging Face twin) and the summary
gives the Pearson correlation of the two grids.

Kernel-side state: ``patching`` (the result on show, partial while a run
streams), ``cell`` ``(row, col)`` into its grid (``(-1, -1)``: none
picked) and ``cells_done``.
"""

from __future__ import annotations

import html

import math
from contextlib import closing
from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.plots import next_token_bars, patching_heatmap
from vlens.widgets.prompt_box import box_prompt, box_text, prompt_box
from vlens.widgets._base import Panel, figure_widget, show_figure

__all__ = ["PatchingView"]

#: how many next tokens the distribution bars show
TOP = 8


def _columns(p: Any) -> tuple[list[str], str]:
    """Column labels of ``p.grid`` and what they are (``"position"``/``"head"``)."""
    return list(p.columns), "position" if p.heads is None else "head"


class PatchingView(Panel):
    """The layer x position (or layer x head) grid of a :class:`vlens.Patching`
    and the next-token distributions of a clicked cell, clean and corrupt.

    ``PatchingView(patching)`` shows a result; ``PatchingView(session,
    clean=..., corrupt=..., **options)`` runs ``session.stream_patch(clean,
    corrupt, **options)`` (``site=``, ``layers=``, ``span=``,
    ``answer=``, ``heads=``) and fills the grid in as cells finish; the
    run button runs it again. Traits: ``patching``, ``cell`` ``(row,
    col)`` (``(-1, -1)`` for none), ``cells_done``, ``streamed_states``
    (how many partial grids the last run showed). ``heatmap`` and
    ``bars`` are the figure views (:class:`FigureView`).

    ``atp=True`` (with a session) runs ``session.attribution_patch`` on the
    same grid after each run; ``attribution=`` (a Patching from it) shows
    one. Trait ``attribution``; ``atp_heatmap`` draws it below the grid and
    the summary gives the correlation of the two grids (:func:`correlation`).
    """

    patching = traitlets.Any(None, allow_none=True, help="the Patching on show")
    cell = traitlets.Tuple(traitlets.Int(), traitlets.Int(), default_value=(-1, -1))
    cells_done = traitlets.Int(0)
    streamed_states = traitlets.Int(0)
    attribution = traitlets.Any(None, allow_none=True, help="the AtP Patching beside it")

    def __init__(
        self,
        patching: Any = None,
        *,
        clean: Any = None,
        corrupt: Any = None,
        auto_run: bool = True,
        atp: bool = False,
        attribution: Any = None,
        **options: Any,
    ) -> None:
        self.session = None
        if patching is not None and hasattr(patching, "stream_patch"):
            self.session, patching = patching, None
        elif options or atp:
            named = sorted(options) + (["atp"] if atp else [])
            raise TypeError(f"{', '.join(named)}: patching options go with a session, "
                            "PatchingView(session, clean=..., corrupt=..., ...)")
        if not isinstance(atp, bool):
            raise TypeError(f"atp must be True or False, got {atp!r}")
        #: also run attribution patching (on the twin) after each patch run
        self.atp = atp
        self.options = dict(options)
        self._clean = prompt_box(clean, "clean", "90%")
        self._corrupt = prompt_box(corrupt, "corrupt", "90%")
        self._run_button = widgets.Button(description="patch", icon="play",
                                          button_style="primary")
        self._summary = widgets.HTML()
        self.heatmap = figure_widget()
        self.bars = figure_widget()
        self.atp_heatmap = figure_widget()
        self._atp_box = widgets.VBox([self.atp_heatmap])  # shown once there is an attribution
        self._atp_box.layout.display = "none"
        # what the patch button will run with, always on show
        self._settings = widgets.HTML(f"<small>{html.escape(self.settings_text)}</small>")
        inputs = ([self._clean, self._corrupt, self._settings, self._run_button]
                  if self.session else [])
        super().__init__([*inputs, self._summary, self.heatmap, self._atp_box, self.bars])
        self._run_button.on_click(lambda _b: self._start("patch", self._patch_run))
        self.observe(self._guard(self._on_patching), names=["patching"])
        self.observe(self._guard(self._on_cell), names=["cell", "attribution"])
        self.attribution = attribution
        if patching is not None:
            self.patching = patching
        elif self.session is not None and auto_run and clean and corrupt:
            self._guard(self.run)()

    @property
    def settings_text(self) -> str:
        """What the patch button runs with, in words (the line the view
        shows): ``session.stream_patch``'s options, its defaults where unset."""
        o = self.options
        answer = o.get("answer")
        return "runs with: " + " · ".join([
            f"site {o.get('site', 'resid_post')}",
            f"layers {'every' if o.get('layers') is None else o['layers']}",
            f"span {'all' if o.get('span') is None else o['span']}",
            "per position" if o.get("heads") is None else f"heads {o['heads']}",
            "answer: each run's top next token" if answer is None else f"answer {answer!r}",
        ] + (["AtP beside"] if self.atp else []))

    def set_clean(self, prompt: str) -> None:
        """Use ``prompt`` as the clean run of the next :meth:`run`."""
        self._clean.value = box_text(prompt)

    # -- engine ----------------------------------------------------------------
    def run(self, clean: str | None = None, corrupt: str | None = None) -> Any:
        """Patch ``clean`` into ``corrupt`` (default: the text boxes),
        streaming: the grid redraws as cells finish. Returns the Patching.
        (The patch button does it in the background: ``view.wait()``.)"""
        return self._call("patch", self._patch_run, clean, corrupt)

    def _patch_run(self, clean: str | None = None, corrupt: str | None = None) -> Any:
        if self.session is None:
            raise ValueError("this view was given a result, not a session: "
                             "PatchingView(session, clean=..., corrupt=...) runs patching")
        if clean is not None:
            self._clean.value = box_text(clean)
        if corrupt is not None:
            self._corrupt.value = box_text(corrupt)
        if not self._clean.value.strip() or not self._corrupt.value.strip():
            raise ValueError("type a clean prompt and a corrupt prompt first")
        self.streamed_states = 0
        self.cell = (-1, -1)
        self.attribution = None
        last = None
        with self._working("patching…", "cells") as report, closing(self.session.stream_patch(
                box_prompt(self._clean.value), box_prompt(self._corrupt.value),
                **self.options)) as states:
            for state in states:
                report(state.done, int(state.grid.numel()))  # a replaced run stops here
                with self._publishing():
                    if state is self.patching:  # the same object, filled further: no event
                        self._on_patching({"new": state})
                    else:
                        self.patching = state
                last = state
                self.streamed_states += 1
        if self.atp and last is not None:
            with self._working("attribution patching on the twin…", "grids"):
                atp = self.session.attribution_patch(
                    box_prompt(self._clean.value), box_prompt(self._corrupt.value),
                    site=last.site, layers=last.layers, span=last.positions,
                    heads=last.heads, answer=last.answer)
            with self._publishing():
                self.attribution = atp
        return last

    # -- reactions -------------------------------------------------------------
    def _on_patching(self, change) -> None:
        p = change["new"]
        if p is None:
            return
        self.cells_done = p.done
        self.replot()

    def _on_cell(self, change) -> None:
        if self.patching is not None:
            self.replot()

    def _on_click(self, trace, points, state) -> None:
        """A click on a cell picks it: its run's distribution is shown."""
        if points.point_inds:
            row, col = points.point_inds[0]  # heatmap points are [row, col]
            self.cell = (int(row), int(col))

    # -- what a cell holds ---------------------------------------------------------
    def cell_name(self, cell: tuple[int, int] | None = None) -> str:
        """``"layer 2, 5:fox"`` for ``cell`` (default: the picked one)."""
        row, col = self.cell if cell is None else cell
        columns, _ = _columns(self.patching)
        return f"layer {self.patching.layers[row]}, {columns[col]}"

    def distributions(self) -> dict[str, tuple[list[str], list[float]]]:
        """``{run name: (top tokens, probabilities)}`` for clean, corrupt and
        the picked cell (when it has finished)."""
        p = self.patching
        out = {name: _top(dist) for name, dist in
               (("clean", p.clean_logprobs), ("corrupt", p.corrupt_logprobs)) if dist}
        row, col = self.cell
        if row >= 0 and p.cell_logprobs and p.cell_logprobs[row][col] is not None:
            out[self.cell_name()] = _top(p.cell_logprobs[row][col])
        return out

    # -- drawing ---------------------------------------------------------------
    def replot(self) -> None:
        p = self.patching
        columns, what = _columns(p)
        cell = self.cell if self.cell[0] >= 0 else None
        show_figure(self.heatmap, patching_heatmap(
            p.grid, p.layers, columns, cell=cell, column_title=what,
            title=f"{p.site}: clean restored, {self.cells_done} of {p.grid.numel()} cells"))
        if self.heatmap.data:
            self.heatmap.data[0].on_click(self._guard(self._on_click))
        clean_text, corrupt_text = p.answer_text
        self._summary.value = (
            f"<small>answer: clean <b>{_esc(clean_text)}</b> vs corrupt "
            f"<b>{_esc(corrupt_text)}</b>; logit difference clean {p.clean_diff:.3f}, "
            f"corrupt {p.corrupt_diff:.3f}. Click a cell to see its run."
            + self._replot_atp(cell, what) + "</small>")
        show_figure(self.bars, next_token_bars(
            self.distributions(), top=TOP, marks=[clean_text, corrupt_text],
            title="next token: clean, corrupt" + (
                f" and {self.cell_name()}" if cell is not None else "")))


    def _replot_atp(self, cell: Any, what: str) -> str:
        """Draw the attribution beside the grid; the summary's words on it."""
        a, p = self.attribution, self.patching
        if a is None or a.grid.shape != p.grid.shape:
            self._atp_box.layout.display = "none"
            return ""
        self._atp_box.layout.display = ""
        show_figure(self.atp_heatmap, patching_heatmap(
            a.grid, a.layers, _columns(a)[0], cell=cell, column_title=what,
            title=f"{a.site}: attribution patching (AtP) on the Hugging Face twin"))
        r = correlation(p.grid, a.grid)
        said = "n/a" if r is None else f"{r:.2f}"
        return f" AtP beside it (below): corr r = {said} with activation patching."


def correlation(a: Any, b: Any) -> float | None:
    """Pearson r of two grids over the cells both have (None: too few or flat)."""
    import torch

    a, b = a.flatten().double(), b.flatten().double()
    keep = ~(a.isnan() | b.isnan())
    a, b = a[keep], b[keep]
    if a.numel() < 2 or float(a.std()) == 0 or float(b.std()) == 0:
        return None
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def _esc(text: str) -> str:
    import html

    return html.escape(str(text))


def _top(dist: Any) -> tuple[list[str], list[float]]:
    """``(tokens, probabilities)`` of a ``(tokens, log-probabilities)`` top-k."""
    tokens, logprobs = dist
    return [str(t) for t in tokens], [math.exp(float(v)) for v in logprobs]
