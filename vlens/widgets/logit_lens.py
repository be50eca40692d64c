"""The logit lens as a widget: top next token per layer and position.

The view draws a Run it is given. The lens itself comes from the run: read
in the worker with ``trace(..., logit_lens=1)`` (the model's own final norm
and unembedding; only the top token and its probability cross back), or,
for a run that read the full ``resid_post`` instead, computed here by an
offline :class:`~vlens.lens.LogitLens` you pass. The top-1 tokens of every
layer are taken once per run; choosing layers or a span only re-plots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import traitlets

from vlens.plan import read_key
from vlens.plots import logit_lens_grid
from vlens.results import Run, Trace
from vlens.widgets._base import View, figure_widget, layers_spanned, show_figure
from vlens.widgets.pickers import LayerPicker
from vlens.widgets.selection import Selection

__all__ = ["LogitLensView"]

_LENS_KEY = read_key("resid_post", "logit_lens")


class LogitLensView(View):
    """Layer x position grid of the top next token and its probability.

    ``LogitLensView(run, token_strings=s.token_strings)`` shows ``run``'s
    first trace; ``token_strings`` turns the predicted ids into text.
    ``offline_lens`` (a :class:`~vlens.lens.LogitLens`) is needed only for
    runs that read ``resid_post`` in full but not the logit lens.
    ``layer_range`` is an inclusive ``(low, high)`` of the layers shown;
    the selection's ``span`` outlines token columns. ``figure`` is the
    FigureWidget.
    """

    layer_range = traitlets.Tuple(traitlets.Int(), traitlets.Int())
    run = traitlets.Instance(Run, allow_none=True, help="the Run on show")

    def __init__(
        self,
        run: Run | None = None,
        *,
        token_strings: Callable[[Sequence[int]], list[str]],
        selection: Selection | None = None,
        offline_lens: Any = None,
        n_layers: int | None = None,
        layer_range: tuple[int, int] | None = None,
    ) -> None:
        if run is None and n_layers is None:
            raise ValueError("give a run to show, or n_layers= for one to come")
        n_layers = layers_spanned(run) if n_layers is None else n_layers
        self.selection = Selection() if selection is None else selection
        self.token_strings = token_strings
        self.offline_lens = offline_lens
        self._top: tuple[list[int], list[list[str]], Any] | None = None
        self.layer_picker = LayerPicker(
            n_layers, value=tuple(layer_range) if layer_range else (0, n_layers - 1),
            description="layers",
        )
        self.figure = figure_widget()
        super().__init__([self.layer_picker, self.figure])
        self.layer_range = self.layer_picker.value
        traitlets.link((self.layer_picker, "value"), (self, "layer_range"))
        self.selection.observe(self._guard(self._redraw), names=["span"])
        self.observe(self._guard(self._redraw), names=["layer_range"])
        self.observe(self._guard(self._on_run), names=["run"])
        self.run = run

    def top_tokens(self, t: Trace) -> tuple[list[int], Any, Any]:
        """``(layers read, top ids [L, T], their probabilities [L, T])`` of ``t``."""
        if _LENS_KEY in t.read_keys:
            ids, probs = t.logit_lens("resid_post")  # [L, T, k] each
            return list(t.layers[_LENS_KEY]), ids[..., 0], probs[..., 0]
        if self.offline_lens is not None and "resid_post" in t.read_keys:
            ids, probs = self.offline_lens.top(t.activations("resid_post"), k=1)
            return list(t.layers["resid_post"]), ids[..., 0], probs[..., 0]
        raise ValueError(
            "this run has no logit lens to show: trace with logit_lens=1, or read "
            "resid_post in full and pass offline_lens=LogitLens.from_pretrained(model)"
        )

    def _on_run(self, change) -> None:
        self._top = None
        if self.run is None:
            return
        read, ids, probs = self.top_tokens(self.run[0])
        n_tok = ids.shape[1]
        words = self.token_strings([int(i) for i in ids.reshape(-1)])
        grid = [words[r * n_tok:(r + 1) * n_tok] for r in range(len(read))]
        self._top = (read, grid, probs)
        self.replot()

    def _redraw(self, change) -> None:
        self.replot()

    def replot(self) -> None:
        if self._top is None:
            return
        read, grid, probs = self._top
        lo, hi = self.layer_range
        rows = [i for i, layer in enumerate(read) if lo <= layer <= hi]
        if not rows:
            raise ValueError(f"no layer in {lo}..{hi} was read in this run (read: {read})")
        show_figure(
            self.figure,
            logit_lens_grid(
                [grid[i] for i in rows], probs[rows], self.run[0].tokens,
                [read[i] for i in rows], span=self.span,
            ),
        )
