"""Steer one prompt from a notebook: pick a direction, a layer, a span and a
scale; see baseline vs steered and how a metric responds to the scale.

The panel calls only the Session API: ``session.direction`` (difference of
means of two prompt lists), ``vlens.Steer``, ``session.compare`` and
``session.sweep``. A direction is computed once per (prompt lists, layer,
site) and reused, so moving the scale slider costs one compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.plots import baseline_vs_steered, dose_response, first_divergence
from vlens.widgets._base import Panel, figure_widget, show_figure
from vlens.widgets.pickers import LayerPicker, SitePicker
from vlens.widgets.token_span import TokenSpanPicker

__all__ = ["SteeringPanel", "token_set_metric"]

SPAN_MODES = ("all", "prompt", "generated", "selection")


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _sweep_traces(sweep: Any) -> list[Any]:
    # Sweep.runs holds one trace per scale; accept one Run per scale too.
    return [r[0] if isinstance(r, Sequence) else r for r in sweep.runs]


def token_set_metric(
    sweep: Any,
    token_ids: Sequence[int],
    *,
    lens: Any = None,
    last_layer: int | None = None,
    site: str = "resid_post",
) -> tuple[str, list[float]]:
    """One number per scale: how much the model says the tokens ``token_ids``.

    ``p_token_set``: the mean over generated positions of P(next token in
    the set), from the output distribution the sweep read at the last layer
    (``trace.vocab_logprobs()``), or from ``lens`` applied to ``site`` at
    ``last_layer`` (the lens of the last layer is the model's own output).
    ``share_token_set``, when neither is there: the share of generated tokens
    that fall in the set. Returns ``(column name, [n_scales] values)``.
    """
    ids = sorted({int(i) for i in token_ids})
    traces = _sweep_traces(sweep)

    def generated_probs(t: Any) -> Any:
        start = len(t.prompt_token_ids) - 1  # the row that chose the first new token
        try:
            logp = t.vocab_logprobs()  # [1, tokens, vocab]
            return logp[-1, start:].exp()
        except (KeyError, AttributeError):
            pass
        if lens is None or last_layer is None or last_layer not in t.layers.get(site, ()):
            return None
        return lens.logits(t.layer(site, last_layer)[start:]).softmax(-1)

    probs = [generated_probs(t) for t in traces]
    if all(p is not None for p in probs):
        return "p_token_set", [float(p[:, ids].sum(-1).mean()) for p in probs]
    wanted = set(ids)
    return "share_token_set", [
        sum(i in wanted for i in t.output_token_ids) / max(1, len(t.output_token_ids))
        for t in traces
    ]


class SteeringPanel(Panel):
    """Direction source, layer, span, scale, run: baseline vs steered and a
    dose-response plot.

    Direction: ``source="prompts"`` uses ``session.direction(positive,
    negative, layer=, site=)``; ``source="vector"`` uses ``vector`` (a
    ``[hidden]`` tensor set from Python, or a ``torch.save``'d file named in
    the path box). ``span`` is ``"all"``, ``"prompt"``, ``"generated"`` or a
    ``(start, stop)`` token span (picked on the prompt's chips).

    After :meth:`run` (or the run button) ``comparison`` holds the
    Comparison; after :meth:`sweep`, ``sweep_result`` the Sweep. With
    ``auto_run`` a released scale slider re-runs the comparison.
    """

    source = traitlets.Enum(("prompts", "vector"), default_value="prompts")
    layer = traitlets.Int(0)
    site = traitlets.Unicode("resid_post")
    span = traitlets.Tuple(traitlets.Int(), traitlets.Int(), default_value=(0, 0))
    span_mode = traitlets.Enum(SPAN_MODES, default_value="all")
    scale = traitlets.Float(4.0)
    metric = traitlets.Unicode("kl_mean")
    vector = traitlets.Any(None, allow_none=True)
    comparison = traitlets.Any(None, allow_none=True)
    sweep_result = traitlets.Any(None, allow_none=True)
    run = traitlets.Any(None, allow_none=True, help="the last steered Run")

    def __init__(
        self,
        session: Any,
        prompt: str | None = None,
        *,
        positive: Sequence[str] = (),
        negative: Sequence[str] = (),
        vector: Any = None,
        layer: int | None = None,
        site: str = "resid_post",
        scale: float = 4.0,
        scales: Sequence[float] = (-8, -4, 0, 4, 8),
        span: str | tuple[int, int] = "all",
        token_set: str = "",
        metric: str = "kl_mean",
        max_new_tokens: int = 16,
        auto_run: bool = True,
        show_tokens: bool = True,
    ) -> None:
        self.session = session
        self.scales = [float(x) for x in scales]
        self.max_new_tokens = max_new_tokens
        self.auto_run = auto_run
        self._directions: dict[tuple, Any] = {}
        self._sweep_frame = None
        reach = max([abs(x) for x in self.scales] + [abs(scale), 1.0])

        self._source = widgets.ToggleButtons(
            options=[("two prompt lists", "prompts"), ("saved vector", "vector")],
            value="vector" if vector is not None and not positive else "prompts",
            description="direction",
        )
        self._positive = widgets.Textarea("\n".join(positive), description="positive",
                                          placeholder="one prompt per line",
                                          layout={"width": "48%", "height": "90px"})
        self._negative = widgets.Textarea("\n".join(negative), description="negative",
                                          placeholder="one prompt per line",
                                          layout={"width": "48%", "height": "90px"})
        self._lists = widgets.HBox([self._positive, self._negative])
        self._path = widgets.Text(description="vector file",
                                  placeholder="a tensor saved with torch.save")
        self._load = widgets.Button(description="load", icon="folder-open")
        self._vector_label = widgets.Label()
        self._vector_row = widgets.HBox([self._path, self._load, self._vector_label])
        self.layer_picker = LayerPicker(
            session.n_layers, value=session.n_layers // 2 if layer is None else layer)
        self.site_picker = SitePicker(session.sites, value=site)
        self._prompt = widgets.Text(prompt or "", description="prompt",
                                    layout={"width": "60%"})
        self.tokens = TokenSpanPicker()
        self._span_mode = widgets.Dropdown(options=SPAN_MODES, description="span")
        self._scale = widgets.FloatSlider(
            value=scale, min=-reach, max=reach, step=0.5, description="scale",
            continuous_update=False,
        )
        self._token_set = widgets.Text(token_set, description="token set",
                                       placeholder="words, space separated")
        self._run_button = widgets.Button(description="run", icon="play",
                                          button_style="primary")
        self._sweep_button = widgets.Button(description=f"sweep {len(self.scales)} scales",
                                            icon="line-chart")
        self._texts = widgets.Textarea(disabled=True, layout={"width": "95%", "height": "60px"})
        self._metric = widgets.Dropdown(options=[metric], value=metric, description="metric")
        self.comparison_figure = figure_widget()
        self.dose_figure = figure_widget()
        self.tokens.layout.display = "" if show_tokens else "none"

        super().__init__([
            self._source, self._lists, self._vector_row,
            widgets.HBox([self._prompt]), self.tokens,
            widgets.HBox([self.layer_picker, self.site_picker, self._span_mode],
                         layout={"flex_flow": "row wrap"}),
            widgets.HBox([self._scale, self._run_button, self._sweep_button]),
            self._texts, self.comparison_figure,
            widgets.HBox([self._metric, self._token_set]), self.dose_figure,
        ])

        self.source = self._source.value
        self.layer = self.layer_picker.value
        self.site = site
        self.scale = float(scale)
        self.metric = metric
        self.vector = vector
        if isinstance(span, str):
            self.span_mode = span
        else:
            self.span_mode = "selection"
        for a, b in ((self._source, "source"), (self.layer_picker, "layer"),
                     (self.site_picker, "site"), (self._span_mode, "span_mode"),
                     (self._scale, "scale"), (self._metric, "metric")):
            widgets.link((a, "value"), (self, b))
        if show_tokens:
            # in an explorer the span comes from the explorer's own chips
            widgets.link((self.tokens, "selection"), (self, "span"))
        self.set_prompt(prompt or "")
        if not isinstance(span, str):
            self.span = tuple(span)
        self._show_source()
        self._describe_vector()

        self.observe(self._guard(self._on_scale), names=["scale"])
        self.observe(self._guard(self._on_span), names=["span"])
        self.observe(self._guard(self._on_source), names=["source"])
        self.observe(self._guard(self._on_vector), names=["vector"])
        self.observe(self._guard(self._on_metric), names=["metric"])
        self._prompt.observe(self._guard(lambda c: self.set_prompt(c["new"])), names="value")
        self._load.on_click(self._guard(lambda _b: self.load_vector(self._path.value)))
        self._run_button.on_click(self._guard(lambda _b: self.run_comparison()))
        self._sweep_button.on_click(self._guard(lambda _b: self.sweep()))

    # -- inputs ----------------------------------------------------------------
    @property
    def prompt(self) -> str:
        return self._prompt.value

    @property
    def positive(self) -> list[str]:
        return _lines(self._positive.value)

    @property
    def negative(self) -> list[str]:
        return _lines(self._negative.value)

    def set_prompt(self, prompt: str) -> None:
        """Use ``prompt``; its tokens become the chips a span is picked on."""
        if self._prompt.value != prompt:
            self._prompt.value = prompt  # the observer calls back here
            return
        ids = self.session.tokenize(prompt) if prompt.strip() else []
        self.tokens.selection = (0, 0)
        self.tokens.tokens = self.session.token_strings(ids)
        self.tokens.n_prompt = -1

    def set_prompt_sets(self, positive: Sequence[str], negative: Sequence[str]) -> None:
        self._positive.value = "\n".join(positive)
        self._negative.value = "\n".join(negative)
        self.source = "prompts"

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
        key = (tuple(pos), tuple(neg), self.layer, self.site)
        if key not in self._directions:
            with self._working(f"direction from {len(pos)} + {len(neg)} prompts…") as report:
                self._directions[key] = self.session.direction(
                    positive=pos, negative=neg, layer=self.layer, site=self.site,
                    progress=report)
        return self._directions[key]

    def steer(self, scale: float | None = None) -> Any:
        """The ``vlens.Steer`` for the current settings."""
        import vlens

        return vlens.Steer(self.direction(), layer=self.layer,
                           scale=self.scale if scale is None else float(scale),
                           site=self.site, span=self.steer_span())

    def _need_prompt(self) -> str:
        if not self.prompt.strip():
            raise ValueError("type a prompt to steer first")
        return self.prompt

    # -- engine ----------------------------------------------------------------
    def run_comparison(self) -> Any:
        """Baseline vs steered for the prompt at the current scale."""
        prompt = self._need_prompt()
        st = self.steer()
        with self._working(f"steering at scale {self.scale:g}…") as report:
            cmp = self.session.compare([prompt], steer=st, progress=report,
                                       max_new_tokens=self.max_new_tokens)
        self.comparison = cmp
        self.run = cmp.steered
        self._show_comparison()
        return cmp

    def sweep(self) -> Any:
        """Run the prompt at every scale of ``scales`` and plot the metric."""
        prompt = self._need_prompt()
        st = self.steer()
        with self._working(f"sweeping {len(self.scales)} scales…") as report:
            sw = self.session.sweep(prompt, steer=st, scales=list(self.scales),
                                    max_new_tokens=self.max_new_tokens, progress=report)
        self.sweep_result = sw
        self._sweep_frame = self._frame(sw)
        numeric = [c for c in self._sweep_frame.columns
                   if c != "scale" and self._sweep_frame[c].dtype.kind in "fiu"]
        if not numeric:
            raise ValueError(f"the sweep's frame has no numeric metric: {list(self._sweep_frame)}")
        keep = self.metric if self.metric in numeric else numeric[0]
        with self.hold_trait_notifications():
            self._metric.options = numeric
            self._metric.value = keep
        self._show_sweep()
        return sw

    def _frame(self, sw: Any):
        frame = sw.to_frame().copy()
        words = self._token_set.value.split()
        if words:
            ids = [i for w in words for i in self.session.tokenize(w)[-1:]]
            name, values = token_set_metric(sw, ids)
            if len(values) == len(frame):
                frame[name] = values
        return frame

    # -- reactions -------------------------------------------------------------
    def _on_scale(self, change) -> None:
        if self.auto_run and self.comparison is not None:
            self.run_comparison()

    def _on_span(self, change) -> None:
        start, stop = change["new"]
        if stop > start:
            self.span_mode = "selection"
        elif self.span_mode == "selection":
            self.span_mode = "all"

    def _on_source(self, change) -> None:
        self._show_source()

    def _on_vector(self, change) -> None:
        self._describe_vector()

    def _on_metric(self, change) -> None:
        if self._sweep_frame is not None and change["new"] in self._sweep_frame:
            self._show_sweep()

    def _show_source(self) -> None:
        prompts = self.source == "prompts"
        self._lists.layout.display = "" if prompts else "none"
        self._vector_row.layout.display = "none" if prompts else ""

    def _describe_vector(self) -> None:
        v = self.vector
        if v is None:
            self._vector_label.value = "no vector"
        else:
            shape = list(getattr(v, "shape", [len(v)]))
            norm = float(getattr(v, "norm", lambda: 0.0)())
            self._vector_label.value = f"vector {shape}, norm {norm:.3g}"

    # -- drawing ---------------------------------------------------------------
    def _show_comparison(self) -> None:
        cmp = self.comparison
        frame = cmp.to_frame()
        if "prompt" in frame.columns and frame["prompt"].nunique() > 1:
            frame = frame[frame["prompt"] == frame["prompt"].iloc[0]]
        base, steered = cmp.baseline[0], cmp.steered[0]
        tb = [x if isinstance(x, str) else "" for x in frame["token_base"]]
        ts = [x if isinstance(x, str) else "" for x in frame["token_steered"]]
        i = first_divergence(tb, ts)
        positions = frame["position"].tolist()
        self._texts.value = f"baseline: {base.text}\nsteered:  {steered.text}"
        show_figure(
            self.comparison_figure,
            baseline_vs_steered(
                tb, ts, frame["logprob_base"].tolist(), frame["logprob_steered"].tolist(),
                positions=positions,
                divergence=None if i is None else positions[i],
                n_prompt=len(base.prompt_token_ids),
                title=(f"scale {self.scale:g} at layer {self.layer}: "
                       + ("no divergence" if i is None
                          else f"first divergence at position {positions[i]}")),
            ),
        )

    def _show_sweep(self) -> None:
        if not self.metric:
            return
        show_figure(
            self.dose_figure,
            dose_response(self._sweep_frame, self.metric,
                          title=f"{self.metric} against scale (layer {self.layer})"),
        )
