"""The logit lens as a widget: top next token per layer and position.

The lens (final norm + unembedding, from the checkpoint) runs client-side on
the residual stream a run already holds, so choosing layers or a span never
calls the engine. The top-1 tokens of every layer are computed once per run.
"""

from __future__ import annotations

from typing import Any

import traitlets

from vlens.plan import read_key
from vlens.plots import logit_lens_grid
from vlens.widgets._base import Panel, figure_widget, show_figure
from vlens.widgets.pickers import LayerPicker

__all__ = ["LogitLensView"]


class LogitLensView(Panel):
    """Layer x position grid of the top next token and its probability.

    ``LogitLensView(session, "the cat")`` traces the prompt with the lens
    computed in the worker (``trace(logit_lens=1)``: only the top token and its
    probability cross back); ``run=`` shows a run that read the lens or the
    full ``resid_post`` at the layers to show (lensed here, client-side). ``layers`` is an inclusive ``(low, high)`` range;
    ``span`` outlines token columns. ``lens`` defaults to
    ``LogitLens.from_pretrained(session.model)``.
    """

    layers = traitlets.Tuple(traitlets.Int(), traitlets.Int())
    span = traitlets.Tuple(traitlets.Int(), traitlets.Int(), default_value=(0, 0))
    run = traitlets.Any(None, allow_none=True, help="the Run on show")

    def __init__(
        self,
        session: Any,
        prompt: str | None = None,
        *,
        run: Any = None,
        lens: Any = None,
        layers: tuple[int, int] | None = None,
        site: str = "resid_post",
        max_new_tokens: int = 16,
    ) -> None:
        self.session = session
        self.site = site
        self.max_new_tokens = max_new_tokens
        self._lens = lens
        self._top: tuple[list[int], list[list[str]], Any] | None = None
        top = session.n_layers - 1
        self.layer_picker = LayerPicker(
            session.n_layers, value=tuple(layers) if layers else (0, top),
            description="layers",
        )
        self.figure = figure_widget()
        super().__init__([self.layer_picker, self.figure])
        self.layers = self.layer_picker.value
        traitlets.link((self.layer_picker, "value"), (self, "layers"))
        self.observe(self._guard(self._on_change), names=["layers", "span"])
        if run is not None:
            self._guard(self.set_run)(run)
        elif prompt:
            self._guard(self.trace)(prompt)

    @property
    def lens(self):
        if self._lens is None:
            from vlens.lens import LogitLens

            self._lens = LogitLens.from_pretrained(self.session.model)
        return self._lens

    def trace(self, prompt: str) -> Any:
        """Trace ``prompt``'s residual stream at every layer and show it."""
        with self._working("tracing for the logit lens…") as report:
            run = self.session.trace([prompt], layers=None, sites=[self.site],
                                     reduce="norm", logit_lens=1, progress=report,
                                     max_new_tokens=self.max_new_tokens)
        self.set_run(run)
        return run

    def set_run(self, run: Any) -> None:
        """Show the first trace of ``run`` (no engine call)."""
        t = run[0]
        try:  # read with trace(lens=k): computed in the worker
            ids, probs = t.logit_lens(self.site)  # [L, T, k] each
            read = list(t.layers[read_key(self.site, "logit_lens")])
        except (KeyError, AttributeError):  # full activations: lens them here
            ids, probs = self.lens.top(t.activations(self.site), k=1)
            read = list(t.layers[self.site])
        n_layers, n_tok = ids.shape[0], ids.shape[1]
        flat = [int(i) for i in ids[..., 0].reshape(-1)]
        words = self.session.token_strings(flat)
        grid = [words[r * n_tok:(r + 1) * n_tok] for r in range(n_layers)]
        self.run = run
        self._top = (read, grid, probs[..., 0])
        self.replot()

    def _on_change(self, change) -> None:
        if self._top is not None:
            self.replot()

    def replot(self) -> None:
        if self._top is None:
            return
        read, grid, probs = self._top
        lo, hi = self.layers
        rows = [i for i, layer in enumerate(read) if lo <= layer <= hi]
        if not rows:
            raise ValueError(f"no layer in {lo}..{hi} was read in this run (read: {read})")
        t = self.run[0]
        show_figure(
            self.figure,
            logit_lens_grid(
                [grid[i] for i in rows], probs[rows], t.tokens, [read[i] for i in rows],
                span=self.span,
            ),
        )
