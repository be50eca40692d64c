"""Steer one prompt from a notebook: pick a direction, a layer, a span and a
scale; see baseline vs steered and how a metric responds to the scale. In
its ablation mode, pick attention heads of the layer to knock out instead
(``vlens.Ablate("z", layer, heads=[...])``) and see the continuation change.

The panel asks its :class:`~vlens.widgets.Controller` for everything that
runs: the direction (difference of means of two prompt lists, computed once
per lists, layer and site), the comparison and the sweep. Moving the scale
slider therefore costs one compare. Where the panel starts (layer, scale,
relative, span, the sweep's scales) is :func:`steering_defaults`: on the
bundled model, the recipe the notebooks promise. The panel's settings are
its own (its controls are in :mod:`vlens.widgets._steering_controls`): an
explorer's layer slider moves the other views, not this one, and the
shared token selection is used only when the panel's span is
``"selection"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing
from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.edits import Ablate, Steer
from vlens.plots import dose_response, token_set_metric
from vlens.widgets._base import View, lines_of, show_figure, texts_html
from vlens.widgets._figures import comparison_figure
from vlens.widgets._steering_controls import SPAN_MODES, SteeringControls
from vlens.widgets.defaults import SteeringDefaults, steering_defaults
from vlens.widgets.prompt_box import box_prompt, box_text
from vlens.widgets.selection import Controller, Selection

__all__ = ["SteeringDefaults", "SteeringPanel", "steering_defaults"]

MODES = ("steer", "ablate")


def _text_of(run: Any) -> str:
    """The text so far of a one-prompt partial Run ('' before its first token)."""
    return run[0].text if len(run) else ""


class SteeringPanel(SteeringControls, View):
    """Direction source, layer, span, scale, run: baseline vs steered and a
    dose-response plot.

    ``SteeringPanel(session, prompt, positive=[...], negative=[...])``, or
    a :class:`Controller` in place of the session (an explorer shares its
    own). Direction: ``source="prompts"`` uses the difference of means of
    the two lists at the panel's ``layer`` and ``site``; ``source="vector"``
    uses ``vector`` (a ``[hidden]`` tensor set from Python, or a
    ``torch.save``'d file named in the path box). ``span_mode`` is
    ``"all"``, ``"prompt"``, ``"generated"`` or ``"selection"`` (the
    selection's ``span``: the panel's own chips, which switch the span to
    ``"selection"`` when clicked, or an explorer's, which do not).
    ``relative`` scales the push by each token's norm (see
    :class:`vlens.Steer`).

    The panel always shows what the run button will use (``settings_text``,
    each setting changed from the recipe marked so); **reset to recipe**
    (:meth:`reset`) puts the settings back. ``layer`` and ``site`` are the
    panel's own, not the shared selection's.

    After :meth:`run_comparison` (or the run button) ``comparison`` holds
    the Comparison; after :meth:`sweep`, ``sweep_result`` the Sweep. With
    ``auto_run`` a released scale slider re-runs the comparison. Buttons and
    controls start runs in the background, the latest wins: a setting
    changed while a run is under way replaces it (``panel.wait()`` waits).

    Where it starts is :func:`steering_defaults`: on the bundled model, a
    panel given no prompt lists, vector or prompt starts from the model's
    sentiment recipe and a sad example, so the first run shows the flip.

    ``mode="ablate"`` (a toggle at the top; on models with a ``z`` site)
    knocks out the heads ``ablate_heads`` of the panel's layer instead,
    ``ablation_kind`` ``"zero"`` or ``"mean"``, over the same span as a
    steer: the run button compares the prompt's continuation with and
    without them (:meth:`ablation` gives the :class:`vlens.Ablate`).
    """

    layer = traitlets.Int(0, help="the layer steered (the panel's own)")
    site = traitlets.Unicode("resid_post", help="the site steered (the panel's own)")
    source = traitlets.Enum(("prompts", "vector"), default_value="prompts")
    span_mode = traitlets.Enum(SPAN_MODES, default_value="all")
    scale = traitlets.Float(4.0)
    relative = traitlets.Bool(False)
    metric = traitlets.Unicode("kl_mean")
    vector = traitlets.Any(None, allow_none=True)
    comparison = traitlets.Any(None, allow_none=True)
    sweep_result = traitlets.Any(None, allow_none=True)
    #: how many partial states the last run showed before it finished
    streamed_states = traitlets.Int(0)
    #: (baseline, steered) text as shown now: it grows while a run streams
    live_texts = traitlets.Tuple(("", ""))
    mode = traitlets.Enum(MODES, default_value="steer")
    ablate_heads = traitlets.List(traitlets.Int())
    ablation_kind = traitlets.Enum(("zero", "mean"), default_value="zero")

    def __init__(
        self,
        session: Any,
        prompt: Any = None,
        *,
        positive: Sequence[str] = (),
        negative: Sequence[str] = (),
        vector: Any = None,
        layer: int | None = None,
        site: str | None = None,
        scale: float | None = None,
        relative: bool | None = None,
        scales: Sequence[float] | None = None,
        span: str | tuple[int, int] | None = None,
        token_set: str = "",
        metric: str = "kl_mean",
        max_new_tokens: int | None = None,
        auto_run: bool = True,
        selection: Selection | None = None,
        span_picker: bool = True,
    ) -> None:
        if isinstance(session, Controller):
            if max_new_tokens is not None:
                raise ValueError("max_new_tokens= is the Controller's: set it there")
            self.controller = session
            start = steering_defaults(session.session)
        else:
            start = steering_defaults(session)
            self.controller = Controller(
                session,
                max_new_tokens=start.max_new_tokens if max_new_tokens is None else max_new_tokens)
        if not positive and not negative and vector is None and start.from_recipe:
            positive, negative = start.positive, start.negative
        if prompt is None:
            prompt = start.prompt
        span = start.span if span is None else span
        self.selection = Selection(layer=start.layer, site=start.site) \
            if selection is None else selection
        self.layer = start.layer if layer is None else int(layer)
        self.site = start.site if site is None else site
        scale = start.scale if scale is None else float(scale)
        self.scales = [float(x) for x in (start.scales if scales is None else scales)]
        self.auto_run = auto_run
        self._sweep_frame = None
        reach = max([abs(x) for x in self.scales] + [abs(scale), 1.0])
        self._recipe_name = "recipe" if start.from_recipe else "start"
        self._make_controls(self.controller.session, start, positive, negative, vector, prompt,
                            scale, reach, relative, token_set, metric, span_picker)
        super().__init__(self._layout())
        self._connect(scale, metric, vector, span)
        # where it started, for the settings line and the reset button
        self._recipe = {"layer": self.layer, "site": self.site, "span_mode": self.span_mode,
                        "scale": self.scale, "relative": self.relative, "source": self.source,
                        "vector": self.vector, "positive": self.positive,
                        "negative": self.negative}
        self._show_settings()

    def _connect(self, scale: float, metric: str, vector: Any,
                 span: str | tuple[int, int]) -> None:
        """The traits' first values, links and observers."""
        self.source = self._source.value
        self.observe(lambda change: setattr(self._texts, "value", texts_html(
            *change["new"], "steered" if self.mode == "steer" else "ablated")),
            names="live_texts")
        self.scale = scale
        self.relative = self._relative.value
        self.metric = metric
        self.vector = vector
        self.span_mode = span if isinstance(span, str) else "selection"
        for a, b in ((self._source, "source"), (self._span_mode, "span_mode"),
                     (self._scale, "scale"), (self._relative, "relative"),
                     (self._metric, "metric"), (self._mode, "mode"),
                     (self.head_picker, "ablate_heads"), (self._kind, "ablation_kind"),
                     (self.layer_picker, "layer"), (self.site_picker, "site")):
            widgets.link((a, "value"), (self, b))
        if self.span_picker is not None:
            widgets.link((self.span_picker, "selection"), (self.selection, "span"))
            self._show_prompt_tokens()
            # a click on the panel's own chips picks the span here
            self.span_picker.observe(self._guard(self._on_own_chips), names=["selection"])
        if not isinstance(span, str):
            self.span = tuple(span)
        self._show_source()
        self._describe_vector()
        self.observe(self._guard(lambda _c: self._show_source()), names=["mode"])
        settings = ["layer", "site", "scale", "relative", "span_mode", "mode", "vector",
                    "ablate_heads", "ablation_kind", "source"]
        self.observe(self._on_setting, names=settings)
        self.observe(self._guard(self._show_settings), names=settings)
        self.selection.observe(self._guard(self._on_shared_span), names=["span"])
        for box in (self._positive, self._negative):
            box.observe(self._guard(self._show_settings), names="value")
        self.observe(self._guard(lambda _c: self._show_source()), names=["source"])
        self.observe(self._guard(lambda _c: self._describe_vector()), names=["vector"])
        self.observe(self._guard(self._on_metric), names=["metric"])
        self._prompt.observe(self._guard(lambda _c: self._show_prompt_tokens()), names="value")
        self._load.on_click(self._guard(lambda _b: self.load_vector(self._path.value)))
        self._run_button.on_click(lambda _b: self._start("compare", self._compare_run))
        self._sweep_button.on_click(lambda _b: self._start("sweep", self._sweep_run))
        self._reset_button.on_click(self._guard(lambda _b: self.reset()))

    # -- inputs ----------------------------------------------------------------
    @property
    def prompt(self) -> Any:
        """The prompt to steer: the box's text, or the conversation its JSON holds."""
        return box_prompt(self._prompt.value)

    @property
    def positive(self) -> list[str]:
        return lines_of(self._positive.value)

    @property
    def negative(self) -> list[str]:
        return lines_of(self._negative.value)

    def set_prompt(self, prompt: Any) -> None:
        """Steer ``prompt`` (a string or a conversation); its tokens become
        the chips a span is picked on."""
        self._prompt.value = box_text(prompt)

    def _show_prompt_tokens(self) -> None:
        if self.span_picker is not None:
            self.span_picker.selection = (0, 0)
            self.span_picker.tokens = self.controller.prompt_tokens(self.prompt)
            self.span_picker.n_prompt = -1

    def load_vector(self, path: str) -> Any:
        """Load a ``[hidden]`` tensor saved with ``torch.save`` and use it."""
        import torch

        if not path.strip():
            raise ValueError("type the path of a saved vector first")
        vec = torch.load(path.strip(), map_location="cpu", weights_only=True)
        self.vector = vec
        self.source = "vector"
        return vec

    def steer_span(self) -> str | tuple[int, int]:
        """The span the Steer gets: a mode name or ``(start, stop)``."""
        if self.span_mode != "selection":
            return self.span_mode
        if self.span[1] <= self.span[0]:
            raise ValueError("span is 'selection' but no tokens are selected: "
                             "click a token (shift-click to extend)")
        return self.span

    def direction(self) -> Any:
        """The steering direction ``[hidden]`` for the current settings."""
        if self.source == "vector":
            if self.vector is None:
                raise ValueError("no saved vector: set panel.vector = tensor, or load a file")
            return self.vector
        pos, neg = self.positive, self.negative
        if not pos or not neg:
            raise ValueError("type at least one positive and one negative prompt "
                             "(one per line)")
        where = {"layer": self.layer, "site": self.site}
        if self.controller.has_direction(pos, neg, **where):
            return self.controller.direction(pos, neg, **where)
        with self._working(f"direction from {len(pos)} + {len(neg)} prompts…") as report:
            return self.controller.direction(pos, neg, progress=report, **where)

    def steer(self, scale: float | None = None) -> Steer:
        """The :class:`vlens.Steer` for the current settings."""
        return Steer(self.direction(), layer=self.layer,
                     scale=self.scale if scale is None else float(scale),
                     site=self.site, span=self.steer_span(), relative=self.relative)

    def ablation(self) -> Any:
        """The :class:`vlens.Ablate` of the ablation mode: the picked heads
        of ``z`` at the panel's layer, over :meth:`steer_span`."""
        if not self.ablate_heads:
            raise ValueError("pick at least one head to knock out")
        return Ablate("z", layer=self.layer, kind=self.ablation_kind,
                      heads=list(self.ablate_heads), span=self.steer_span())

    def _need_prompt(self) -> str:
        if not self._prompt.value.strip():
            raise ValueError("type a prompt to steer first")
        return self.prompt

    # -- engine ----------------------------------------------------------------
    def run_comparison(self) -> Any:
        """Baseline vs steered for the prompt at the current scale, streamed:
        both texts grow side by side as the engine steps, the progress bar
        counts tokens, and the figures follow when the run is done."""
        return self._call("compare", self._compare_run)

    def _compare_run(self) -> Any:
        prompt, ran = self._need_prompt(), self._what_ran()
        if self.mode == "ablate":
            states = self.controller.stream_ablation(prompt, self.ablation())
            what = f"knocking out heads {self.ablate_heads} of layer {self.layer}…"
        else:
            states = self.controller.stream_compare(prompt, self.steer())
            what = f"steering at scale {self.scale:g}…"
        total = 2 * self.controller.max_new_tokens
        self.streamed_states = 0
        cmp = None
        with self._working(what, "tokens") as report, closing(states):
            for state in states:
                if not isinstance(state, tuple):
                    cmp = state
                    break
                report(sum(len(t.output_token_ids) for r in state for t in r), total)
                self.live_texts = tuple(_text_of(run) for run in state)
                self.streamed_states += 1
        with self._publishing():
            self.comparison = cmp
            self._show_comparison(ran)
        return cmp

    def sweep(self) -> Any:
        """Run the prompt at every scale of ``scales`` and plot the metric."""
        return self._call("sweep", self._sweep_run)

    def _sweep_run(self) -> Any:
        prompt, st = self._need_prompt(), self.steer()
        with self._working(f"sweeping {len(self.scales)} scales…") as report:
            sw = self.controller.sweep(prompt, st, self.scales, progress=report)
        with self._publishing():  # the figure follows: no newer run starts before it
            self.sweep_result = sw
        frame = sw.to_frame()
        words = self._token_set.value.split()
        if words:
            s = self.controller.session
            frame["p_token_set"] = token_set_metric(sw, [s.tokenize(w)[-1] for w in words])
        self._sweep_frame = frame
        numeric = [c for c in frame.columns if c != "scale" and frame[c].dtype.kind in "fiu"]
        keep = self.metric if self.metric in numeric else numeric[0]
        with self.hold_trait_notifications():
            self._metric.options = numeric  # resets the dropdown's value
            self._metric.value = keep
        self._show_sweep()
        return sw

    # -- reactions -------------------------------------------------------------
    def _on_setting(self, change) -> None:
        """A setting changed: the run under way starts again with it (the
        latest wins; a sweep ignores the scale), and with ``auto_run`` a new
        scale re-runs a comparison on show."""
        under_way, scale = self._runs.under_way(), change["name"] == "scale"
        if under_way == "sweep":
            if not scale:
                self._start("sweep", self._sweep_run)
        elif under_way == "compare" or (scale and self.auto_run and self.comparison is not None):
            self._start("compare", self._compare_run)

    def _on_own_chips(self, change) -> None:
        """The panel's chips, clicked: their span is used; cleared: back to
        the span the panel started with."""
        start, stop = change["new"]
        if stop > start:
            self.span_mode = "selection"
        elif self.span_mode == "selection":
            first = self._recipe["span_mode"] if hasattr(self, "_recipe") else "all"
            self.span_mode = first if first != "selection" else "all"

    def _on_shared_span(self, change) -> None:
        """The selection's span moved: it matters only to a "selection" span."""
        self._show_settings()
        if self.span_mode == "selection":
            self._on_setting(change)

    def _on_metric(self, change) -> None:
        if self._sweep_frame is not None and change["new"] in self._sweep_frame:
            self._show_sweep()

    # -- drawing ---------------------------------------------------------------
    def _show_comparison(self, what: str) -> None:
        """Draw ``comparison``; ``what``: the settings it ran with, in words."""
        self.live_texts = self.comparison.texts[0]
        show_figure(self.comparison_figure, comparison_figure(self.comparison, what))

    def _show_sweep(self) -> None:
        show_figure(
            self.dose_figure,
            dose_response(self._sweep_frame, self.metric,
                          title=f"{self.metric} against scale (layer {self.layer})"),
        )
