"""One prompt, every view: the explorer composes views around one
:class:`Selection` and one :class:`Controller`.

The controller traces the prompt once (every site, every layer, the logit
lens's top 5, and the attention patterns where the model has them) and the
explorer hands that Run to every view. The views
share the selection: move any layer picker, or click tokens in the chip
strip at the top, and every view redraws from it. The steering panel steers
the same prompt through the same controller, with settings of its own (the
recipe's layer and span until changed in the panel): the shared chips are
its span only when "selection" is picked in it. The patching tab starts
with the prompt as the clean run: type a corrupt one and patch. The *DLA*
tab (direct logit attribution) attributes the first generated token, by
layer and head, when it is opened. The *save*
button (or ``ex.snapshot("file.html")``) saves every tab as shown, for
reading without a kernel.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from vlens.lens import LogitLens
from vlens.results import Run
from vlens.widgets.prompt_box import box_prompt, box_text, prompt_box
from vlens.widgets._base import View
from vlens.widgets.activation import ActivationView
from vlens.widgets.attribution import AttributionView
from vlens.widgets.attention import PATTERN_SITE, AttentionView
from vlens.widgets.clone_reads import CloneReadsToggle
from vlens.widgets.logit_lens import LogitLensView
from vlens.widgets.patching import PatchingView
from vlens.widgets.selection import Controller, Selection, token_sites
from vlens.widgets.steering import SteeringPanel, steering_defaults
from vlens.widgets.token_span import TokenSpanPicker

__all__ = ["Explorer", "explore"]


class Explorer(View):
    """Activation, logit lens, attention and patching views and the
    steering panel on one prompt.

    ``selection`` (layer, span, site) is shared by every view; ``layer``
    and ``span`` read and write it. ``controller`` runs the engine and
    holds ``run``, the traced prompt. ``span_picker`` is the chip strip of
    the prompt and its generation; ``activation_view``,
    ``logit_lens_view``, ``attention_view`` (``None`` where the session
    has no ``attn_pattern`` site), ``patching_view`` (``None`` without
    ``Session.stream_patch``), ``attribution_view`` (the DLA tab: run when
    opened, on the traced prompt's first generated token), ``steering_panel`` and
    ``clone_reads_toggle`` are the composed widgets.
    """

    def __init__(
        self,
        session: Any,
        prompt: Any,
        *,
        layer: int | None = None,
        max_new_tokens: int = 16,
        positive: Any = (),
        negative: Any = (),
        vector: Any = None,
    ) -> None:
        self.controller = Controller(session, max_new_tokens=max_new_tokens)
        self.selection = Selection(
            layer=steering_defaults(session).layer if layer is None else layer)
        self._prompt = prompt_box(prompt)
        self._trace_button = widgets.Button(description="trace", icon="play")
        self.clone_reads_toggle = CloneReadsToggle(session)
        self.span_picker = TokenSpanPicker()
        shared = {"selection": self.selection, "n_layers": session.n_layers}
        self.activation_view = ActivationView(sites=token_sites(session.sites), **shared)
        self.logit_lens_view = LogitLensView(
            token_strings=session.token_strings, tokenize=session.tokenize,
            # the trace reads resid_post in full: tracking a token is exact
            # with the checkpoint's own norm and unembedding, loaded at first use
            offline_lens=lambda: LogitLens.from_pretrained(session.model), **shared)
        self.steering_panel = SteeringPanel(
            self.controller, prompt, selection=self.selection, positive=positive,
            negative=negative, vector=vector, span_picker=False,
        )
        tabs = [(self.activation_view, "activations"), (self.logit_lens_view, "logit lens")]
        self.attention_view = None
        if PATTERN_SITE in session.sites:
            self.attention_view = AttentionView(**shared)
            tabs.append((self.attention_view, "attention"))
        tabs.append((self.steering_panel, "steering"))
        self.patching_view = None
        if hasattr(session, "stream_patch"):
            self.patching_view = PatchingView(session, clean=prompt, auto_run=False)
            tabs.append((self.patching_view, "patching"))
        self.attribution_view = None
        if hasattr(session, "logit_attribution"):
            self.attribution_view = AttributionView(session, prompt, auto_run=False)
            tabs.append((self.attribution_view, "DLA"))
        self._dla_stale = True
        self.tabs = widgets.Tab(children=[w for w, _ in tabs],
                                titles=tuple(name for _, name in tabs))
        super().__init__([
            widgets.HBox([self._prompt, self._trace_button]),
            self.clone_reads_toggle,
            self.span_picker,
            self.tabs,
        ])
        # the chips are the span control of every view
        widgets.link((self.span_picker, "selection"), (self.selection, "span"))
        self.controller.observe(self._guard(self._show_run), names=["run"])
        self.tabs.observe(self._guard(self._on_tab), names=["selected_index"])
        self.steering_panel.observe(self._guard(self._show_copied), names=["comparison"])
        self._trace_button.on_click(lambda _b: self._start(
            "trace", lambda: self._trace_run(box_prompt(self._prompt.value))))
        self._guard(self.trace)(prompt)

    @property
    def run(self) -> Run | None:
        """The traced prompt's Run (``None`` until a trace succeeded)."""
        return self.controller.run

    def trace(self, prompt: Any) -> Run:
        """Trace ``prompt`` (a string or a conversation: a list of
        ``{"role", "content"}`` dicts, shown in the box one message a line,
        ``role: content``) and show it
        in every view; the chips are coloured by role. (The trace button
        does it in the background: ``ex.wait()`` waits for it.)"""
        return self._call("trace", self._trace_run, prompt)

    def _trace_run(self, prompt: Any) -> Run:
        self._prompt.value = box_text(prompt)
        with self._working(f"tracing {self.controller.max_new_tokens} new tokens…") as report:
            run = self.controller.trace(prompt, progress=report, keep=False)
        with self._publishing():
            self.controller.run = run
        return run

    def _show_run(self, change) -> None:
        run = change["new"]
        t = run[0]
        self.span = (0, 0)  # a span of the last prompt means nothing here
        self.span_picker.tokens = list(t.tokens)
        self.span_picker.n_prompt = len(t.prompt_token_ids)
        self.span_picker.roles = list(t.roles) if any(t.roles) else []
        self.activation_view.run = run
        self.logit_lens_view.run = run
        if self.attention_view is not None:
            self.attention_view.run = run
        if self.patching_view is not None:
            self.patching_view.set_clean(box_prompt(self._prompt.value))
        self.steering_panel.set_prompt(box_prompt(self._prompt.value))
        self.clone_reads_toggle.show_run(run)
        if self.attribution_view is not None and t.output_token_ids:
            self.attribution_view.set_prompt(box_prompt(self._prompt.value),
                                             answer=t.output_token_ids[0])
            self._dla_stale = True
            self._on_tab()

    def _on_tab(self, change: Any = None) -> None:
        """The DLA tab attributes the traced prompt when it is on show."""
        view = self.attribution_view
        if view is None or not self._dla_stale or self.tabs.selected_index is None:
            return
        if self.tabs.children[self.tabs.selected_index] is view:
            self._dla_stale = False
            view.start()

    def _show_copied(self, change) -> None:
        if change["new"] is not None:
            self.clone_reads_toggle.show_run(change["new"].steered)


def explore(session: Any, prompt: Any, **kwargs: Any) -> Explorer:
    """An :class:`Explorer` on ``prompt``: trace it once and look around.

    ``kwargs`` go to :class:`Explorer` (``layer=``, ``max_new_tokens=``,
    ``positive=`` / ``negative=`` prompt lists or ``vector=`` for steering).
    """
    return Explorer(session, prompt, **kwargs)
