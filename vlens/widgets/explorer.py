"""One prompt, every view: the explorer composes the widgets around one
shared selection of layer and token span.

Tracing the prompt once (every site, every layer) feeds the activation view
and the logit lens; the steering panel steers the same prompt at the shared
layer and span. Move any layer picker, or click tokens in the strip at the
top, and every view follows.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.widgets._base import Panel
from vlens.widgets.activation import ActivationView
from vlens.widgets.clone_reads import CloneReadsToggle
from vlens.widgets.logit_lens import LogitLensView
from vlens.widgets.steering import SteeringPanel
from vlens.widgets.token_span import TokenSpanPicker

__all__ = ["Explorer", "explore"]


class Explorer(Panel):
    """Activation view, logit lens and steering panel on one prompt.

    ``layer`` and ``span`` ``(start, stop)`` are shared by every view (each
    view's own trait is linked to these). ``tokens`` is the chip strip of the
    traced prompt and generation; ``activations``, ``logit_lens``,
    ``steering`` and ``clone_reads`` are the composed widgets.
    """

    layer = traitlets.Int(0)
    span = traitlets.Tuple(traitlets.Int(), traitlets.Int(), default_value=(0, 0))
    run = traitlets.Any(None, allow_none=True, help="the traced Run on show")

    def __init__(
        self,
        session: Any,
        prompt: str,
        *,
        layer: int | None = None,
        max_new_tokens: int = 16,
        positive: Any = (),
        negative: Any = (),
        vector: Any = None,
        lens: Any = None,
    ) -> None:
        self.session = session
        self.max_new_tokens = max_new_tokens
        layer = session.n_layers // 2 if layer is None else layer
        self._prompt = widgets.Text(prompt, description="prompt", layout={"width": "60%"})
        self._trace_button = widgets.Button(description="trace", icon="play")
        self.clone_reads = CloneReadsToggle(session)
        self.tokens = TokenSpanPicker()
        self.activations = ActivationView(session, layer=layer, show_prompt=False,
                                          max_new_tokens=max_new_tokens)
        self.logit_lens = LogitLensView(session, lens=lens, max_new_tokens=max_new_tokens)
        self.steering = SteeringPanel(
            session, prompt, layer=layer, positive=positive, negative=negative,
            vector=vector, max_new_tokens=max_new_tokens, show_tokens=False,
        )
        self.tabs = widgets.Tab(
            children=[self.activations, self.logit_lens, self.steering],
            titles=("activations", "logit lens", "steering"),
        )
        super().__init__([
            widgets.HBox([self._prompt, self._trace_button]),
            self.clone_reads,
            self.tokens,
            self.tabs,
        ])
        self.layer = layer
        for view in (self.activations, self.steering):
            traitlets.link((self, "layer"), (view, "layer"))
        traitlets.link((self.tokens, "selection"), (self, "span"))
        for view in (self.activations, self.logit_lens, self.steering):
            traitlets.link((self, "span"), (view, "span"))
        self.steering.observe(self._guard(self._show_copied), names=["run"])
        self._trace_button.on_click(self._guard(lambda _b: self.trace(self._prompt.value)))
        self._guard(self.trace)(prompt)

    def trace(self, prompt: str) -> Any:
        """Trace ``prompt`` (every site, every layer) and show it everywhere."""
        self._prompt.value = prompt
        with self._working(f"tracing {self.max_new_tokens} new tokens…") as report:
            run = self.session.trace([prompt], layers=None, sites=self.session.sites,
                                     max_new_tokens=self.max_new_tokens, progress=report)
        t = run[0]
        self.run = run
        self.tokens.selection = (0, 0)
        self.tokens.tokens = list(t.tokens)
        self.tokens.n_prompt = len(t.prompt_token_ids)
        self.activations.set_run(run)
        self.logit_lens.set_run(run)
        self.steering.set_prompt(prompt)
        self.clone_reads.show_run(run)
        return run

    def _show_copied(self, change) -> None:
        if change["new"] is not None:
            self.clone_reads.show_run(change["new"])


def explore(session: Any, prompt: str, **kwargs: Any) -> Explorer:
    """An :class:`Explorer` on ``prompt``: trace it once and look around.

    ``kwargs`` go to :class:`Explorer` (``layer=``, ``max_new_tokens=``,
    ``positive=`` / ``negative=`` prompt lists or ``vector=`` for steering).
    """
    return Explorer(session, prompt, **kwargs)
