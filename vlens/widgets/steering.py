"""Steer one prompt from a notebook: pick a direction, a layer, a span and a
scale; see baseline vs steered and how a metric responds to the scale. In
its ablation mode, pick attention heads of the layer to knock out instead
(``vlens.Ablate("z", layer, heads=[...])``) and see the continuation change.

The panel asks its :class:`~vlens.widgets.Controller` for everything that
runs: the direction (difference of means of two prompt lists, computed once
per lists, layer and site), the comparison and the sweep. Moving the scale
slider therefore costs one compare. Where the panel starts (layer, scale,
relative, the sweep's scales) is :func:`steering_defaults`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing
from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.plots import dose_response, token_set_metric
from vlens.edits import Steer
from vlens.widgets.prompt_box import box_prompt, box_text
from vlens.widgets._base import View, figure_widget, lines_of, show_figure, texts_html
from vlens.widgets._figures import comparison_figure
from vlens.widgets.defaults import SteeringDefaults, steering_defaults
from vlens.widgets.pickers import HeadPicker, LayerPicker, SitePicker
from vlens.widgets.selection import Controller, Selection, token_sites
from vlens.widgets.token_span import TokenSpanPicker

__all__ = ["SteeringDefaults", "SteeringPanel", "steering_defaults"]

SPAN_MODES = ("all", "prompt", "generated", "selection")
MODES = ("steer", "ablate")


def _text_of(run: Any) -> str:
    """The text so far of a one-prompt partial Run ('' before its first token)."""
    return run[0].text if len(run) else ""


class SteeringPanel(View):
    """Direction source, layer, span, scale, run: baseline vs steered and a
    dose-response plot.

    ``SteeringPanel(session, prompt, positive=[...], negative=[...])``, or
    a :class:`Controller` in place of the session (an explorer shares its
    own). Direction: ``source="prompts"`` uses the difference of means of
    the two lists at the selection's layer and site; ``source="vector"``
    uses ``vector`` (a ``[hidden]`` tensor set from Python, or a
    ``torch.save``'d file named in the path box). ``span_mode`` is
    ``"all"``, ``"prompt"``, ``"generated"`` or ``"selection"`` (the
    selection's ``span``, picked on the prompt's chips unless
    ``span_picker=False``). ``relative`` scales the push by each token's
    norm (see :class:`vlens.Steer`).

    After :meth:`run_comparison` (or the run button) ``comparison`` holds
    the Comparison; after :meth:`sweep`, ``sweep_result`` the Sweep. With
    ``auto_run`` a released scale slider re-runs the comparison. Buttons and
    controls start runs in the background, the latest wins: a setting
    changed while a run is under way replaces it (``panel.wait()`` waits).

    Where it starts is :func:`steering_defaults`: on the bundled model, a
    panel given no prompt lists, vector or prompt starts from the model's
    sentiment recipe and a sad example, so the first run shows the flip.

    ``mode="ablate"`` (a toggle at the top; on models with a ``z`` site)
    knocks out the heads ``ablate_heads`` of the selection's layer instead,
    ``ablation_kind`` ``"zero"`` or ``"mean"``, over the same span as a
    steer: the run button compares the prompt's continuation with and
    without them (:meth:`ablation` gives the :class:`vlens.Ablate`).
    """

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
        prompt: str | None = None,
        *,
        positive: Sequence[str] = (),
        negative: Sequence[str] = (),
        vector: Any = None,
        layer: int | None = None,
        site: str | None = None,
        scale: float | None = None,
        relative: bool | None = None,
        scales: Sequence[float] | None = None,
        span: str | tuple[int, int] = "all",
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
        s = self.controller.session
        if not positive and not negative and vector is None and start.from_recipe:
            positive, negative = start.positive, start.negative
        if prompt is None:
            prompt = start.prompt
        self.selection = Selection(layer=start.layer, site=start.site) \
            if selection is None else selection
        if layer is not None:
            self.selection.layer = layer
        if site is not None:
            self.selection.site = site
        scale = start.scale if scale is None else float(scale)
        self.scales = [float(x) for x in (start.scales if scales is None else scales)]
        self.auto_run = auto_run
        self._sweep_frame = None
        reach = max([abs(x) for x in self.scales] + [abs(scale), 1.0])
        self._make_controls(s, start, positive, negative, vector, prompt, scale, reach,
                            relative, token_set, metric, span_picker)
        super().__init__([
            self._mode, self._note, self._source, self._lists, self._vector_row,
            widgets.HBox([self._prompt]), *([self.span_picker] if span_picker else []),
            widgets.HBox([self.layer_picker, self.site_picker, self._span_mode],
                         layout={"flex_flow": "row wrap"}),
            self._ablate_row, self._scale_row, self._run_button,
            self._texts, self.comparison_figure, self._sweep_box,
        ])

        self._connect(scale, metric, vector, span)

    def _make_controls(self, s: Any, start: SteeringDefaults, positive: Sequence[str],
                       negative: Sequence[str], vector: Any, prompt: str | None, scale: float,
                       reach: float, relative: bool | None, token_set: str, metric: str,
                       span_picker: bool) -> None:
        """The panel's controls and figures (``s``: the session)."""
        self._source = widgets.ToggleButtons(
            options=[("two prompt lists", "prompts"), ("saved vector", "vector")],
            value="vector" if vector is not None and not positive else "prompts",
            description="direction",
        )
        self._positive, self._negative = (
            widgets.Textarea("\n".join(lines), description=name,
                             placeholder="one prompt per line",
                             layout={"width": "48%", "height": "90px"})
            for name, lines in (("positive", positive), ("negative", negative))
        )
        self._lists = widgets.HBox([self._positive, self._negative])
        self._note = widgets.HTML(f"<small>{start.note}</small>")
        self._path = widgets.Text(description="vector file",
                                  placeholder="a tensor saved with torch.save")
        self._load = widgets.Button(description="load", icon="folder-open")
        self._vector_label = widgets.Label()
        self._vector_row = widgets.HBox([self._path, self._load, self._vector_label])
        self.layer_picker = LayerPicker(s.n_layers, value=self.selection.layer)
        # the [hidden]-wide sites: a steering direction is one vector per token
        self.site_picker = SitePicker(token_sites(s.sites), value=self.selection.site)
        self._prompt = widgets.Text(box_text(prompt or ""), description="prompt",
                                    layout={"width": "60%"})
        self.span_picker = TokenSpanPicker() if span_picker else None
        self._span_mode = widgets.Dropdown(options=SPAN_MODES, description="span")
        self._scale = widgets.FloatSlider(
            value=scale, min=-reach, max=reach, step=0.25 if reach <= 4 else 0.5,
            description="scale",
            continuous_update=False,
        )
        self._relative = widgets.Checkbox(value=start.relative if relative is None else relative,
                                          description="relative to |x|", indent=False,
                                          layout={"width": "140px"})
        self._token_set = widgets.Text(token_set, description="token set",
                                       placeholder="words, space separated")
        self._run_button = widgets.Button(description="run", icon="play",
                                          button_style="primary")
        self._sweep_button = widgets.Button(description=f"sweep {len(self.scales)} scales",
                                            icon="line-chart")
        n_heads = int(s.info.get("n_heads", 0) or 0)
        self._mode = widgets.ToggleButtons(
            options=[("steer", "steer"), ("ablate heads", "ablate")], description="mode")
        self.head_picker = HeadPicker(max(n_heads, 1), description="knock out heads")
        self._kind = widgets.Dropdown(options=["zero", "mean"], description="replace with",
                                      layout={"width": "200px"})
        self._ablate_row = widgets.HBox([self.head_picker, self._kind],
                                        layout={"flex_flow": "row wrap"})
        self._mode.layout.display = "" if "z" in s.sites and n_heads else "none"
        # baseline and steered side by side, growing as the run streams
        self._texts = widgets.HTML(layout={"width": "95%"})
        self._texts.add_class("vlens-texts")
        self._metric = widgets.Dropdown(options=[metric], value=metric, description="metric")
        self.comparison_figure = figure_widget()
        self.dose_figure = figure_widget()
        self._scale_row = widgets.HBox([self._scale, self._relative, self._sweep_button])
        # a box around the dose figure: a FigureWidget's layout is plotly's
        self._sweep_box = widgets.VBox(
            [widgets.HBox([self._metric, self._token_set]), self.dose_figure])

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
                     (self.head_picker, "ablate_heads"), (self._kind, "ablation_kind")):
            widgets.link((a, "value"), (self, b))
        widgets.link((self.layer_picker, "value"), (self.selection, "layer"))
        widgets.link((self.site_picker, "value"), (self.selection, "site"))
        if self.span_picker is not None:
            widgets.link((self.span_picker, "selection"), (self.selection, "span"))
            self._show_prompt_tokens()
        if not isinstance(span, str):
            self.span = tuple(span)
        self._show_source()
        self._describe_vector()
        self.observe(self._guard(lambda _c: self._show_source()), names=["mode"])

        self.selection.observe(self._guard(self._on_span), names=["span"])
        self.observe(self._on_setting, names=["scale", "relative", "span_mode", "mode", "vector",
                                              "ablate_heads", "ablation_kind", "source"])
        self.selection.observe(self._on_setting, names=["layer", "site", "span"])
        self.observe(self._guard(lambda _c: self._show_source()), names=["source"])
        self.observe(self._guard(lambda _c: self._describe_vector()), names=["vector"])
        self.observe(self._guard(self._on_metric), names=["metric"])
        self._prompt.observe(self._guard(lambda _c: self._show_prompt_tokens()), names="value")
        self._load.on_click(self._guard(lambda _b: self.load_vector(self._path.value)))
        self._run_button.on_click(lambda _b: self._start("compare", self._compare_run))
        self._sweep_button.on_click(lambda _b: self._start("sweep", self._sweep_run))

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
        of ``z`` at the selection's layer, over :meth:`steer_span`."""
        import vlens

        if not self.ablate_heads:
            raise ValueError("pick at least one head to knock out")
        return vlens.Ablate("z", layer=self.layer, kind=self.ablation_kind,
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

    def _on_span(self, change) -> None:
        start, stop = change["new"]
        if stop > start:
            self.span_mode = "selection"
        elif self.span_mode == "selection":
            self.span_mode = "all"

    def _on_metric(self, change) -> None:
        if self._sweep_frame is not None and change["new"] in self._sweep_frame:
            self._show_sweep()

    def _show_source(self) -> None:
        steering, prompts = self.mode == "steer", self.source == "prompts"
        shown = [(self._note, steering), (self._source, steering),
                 (self._lists, steering and prompts),
                 (self._vector_row, steering and not prompts), (self._scale_row, steering),
                 (self._sweep_box, steering), (self.site_picker, steering),
                 (self._ablate_row, not steering)]
        for part, show in shown:
            part.layout.display = "" if show else "none"
        self._run_button.description = "run" if steering else "compare"

    def _describe_vector(self) -> None:
        v = self.vector
        self._vector_label.value = (
            "no vector" if v is None else f"vector {list(v.shape)}, norm {float(v.norm()):.3g}"
        )

    # -- drawing ---------------------------------------------------------------
    def _show_comparison(self, what: str) -> None:
        """Draw ``comparison``; ``what``: the settings it ran with, in words."""
        self.live_texts = self.comparison.texts[0]
        show_figure(self.comparison_figure, comparison_figure(self.comparison, what))

    def _what_ran(self) -> str:
        if self.mode == "ablate":
            return (f"heads {', '.join(map(str, self.ablate_heads))} of layer {self.layer} "
                    f"knocked out ({self.ablation_kind})")
        return f"scale {self.scale:g} at layer {self.layer}"

    def _show_sweep(self) -> None:
        show_figure(
            self.dose_figure,
            dose_response(self._sweep_frame, self.metric,
                          title=f"{self.metric} against scale (layer {self.layer})"),
        )
