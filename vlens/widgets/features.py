"""One SAE's features over a set of prompts, as Neuronpedia shows them, on
the live engine.

``FeatureView(session, sae, prompts)`` traces the prompts once with the SAE
read in the worker (``s.trace(prompts, saes=[sae])``) and keeps the Run.
Click a token chip: its top features are listed as buttons. Click one (or
type a feature number): the feature's top-activating contexts over the
prompts (tokens tinted by its activation), its activation histogram, and
the tokens its decoder direction promotes and suppresses through the
unembedding. The steering row steers with the feature's decoder row, or
clamps the feature (:class:`vlens.Clamp`), on a prompt: baseline and
steered text side by side, growing as the engine steps. An SAE folder
holding ``measured.json`` (the bundled toy-world SAE's, written by
``scripts/train_sae.py``; the SmolLM2 SAE's, by
``scripts/train_smollm2_sae.py`` and ``scripts/smollm2_sae_recipe.py``)
names its features and gives the steer and clamp the view starts at, the
measured recipe (*reset to recipe* puts them back). With ``harvest=`` the
contexts and histogram come from a :class:`vlens.Harvest`'s texts (encoded
in the kernel) instead of the prompts. The frames and
figures come from :mod:`vlens.plots` (``top_features``,
``feature_contexts``, ``feature_logits``, ``feature_histogram``,
``promoted_tokens``).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from contextlib import closing
from typing import Any

import ipywidgets as widgets
import torch
import traitlets

from vlens.edits import Steer
from vlens.errors import VlensError
from vlens.lens import LogitLens
from vlens.methods.sae import SAE, Clamp
from vlens.plots import (
    feature_contexts,
    feature_histogram,
    feature_logits,
    promoted_tokens,
    top_features,
)
from vlens.results import Run
from vlens.results.harvest import Harvest
from vlens.tokens import visible
from vlens.widgets._base import Panel, figure_widget, show_figure, texts_html
from vlens.widgets._feature_parts import clamp_start, contexts_html, harvest_features
from vlens.widgets.selection import Controller
from vlens.widgets.token_span import TokenSpanPicker

__all__ = ["FeatureView", "contexts_html"]

MODES = ("steer", "clamp")
SPANS = ("all", "prompt", "generated")
#: the sites whose width is the residual stream's: their directions meet the unembedding
RESIDUAL_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
#: the steer's scale without a measured recipe (the toy world's residual recipe)
SCALE_START = 0.75


class FeatureView(Panel):
    """The features of ``sae`` over ``prompts``: per token its top
    features, per feature its contexts, histogram and promoted tokens, and
    a steering row.

    ``FeatureView(session, sae, prompts)`` traces ``prompts`` (a string or
    a list) with ``saes=[sae]`` (``top_k=k``: each token's k largest only,
    ``features_top_k``; default every feature) and keeps it as ``run``.
    ``labels`` names features (``{919: "mood=happy"}``; default: the
    concept names of ``measured.json`` beside the SAE); ``prompt`` is the
    prompt the steering row runs (default the first of ``prompts``); ``k``
    how many features a token lists (default: a topk SAE's k, else 8);
    ``max_new_tokens`` how far a steering run generates; ``measured`` what
    ``measured.json`` says (default: the one beside the SAE, ``sae.measured()``;
    pass it for an SAE fetched from a server); ``harvest`` a
    :class:`vlens.Harvest` (or its folder) holding the SAE's site and layer:
    the contexts, the histogram and the header's count come from its texts
    (encoded here, each text's first token left out) instead of the prompts.

    Traits: ``shown`` (which prompt the chips show), ``token`` (the clicked
    token, ``-1`` none), ``feature`` (``-1`` none), ``mode`` (``"steer"``:
    add ``scale`` x the decoder row, ``relative`` to each token's norm;
    ``"clamp"``: set the feature to ``value``), ``span`` (``"all"``,
    ``"prompt"``, ``"generated"``). With a ``measured.json`` beside the SAE
    (``recipe``) the steer starts at its ``steer`` (scale, relative), a
    shown feature's clamp at its ``clamp`` (value, span), and
    :meth:`reset_to_recipe` (the *reset to recipe* button) puts them and
    the recipe's feature back; without one the steer starts at 0.75,
    relative, and a shown feature's clamp ``value`` where the write is 0.6
    x the mean norm of the SAE's site over the prompts (``mean_norm``;
    ``clamp_start``). After a run ``comparison`` (the
    Comparison), ``streamed_states`` and ``live_texts``. Frames on show:
    ``.token_features()``, ``.contexts()``, ``.logits()``; figures
    ``histogram``, ``logit_figure``.
    """

    shown = traitlets.Int(0, help="the prompt the chips show")
    token = traitlets.Int(-1, help="the clicked token of the shown prompt (-1: none)")
    feature = traitlets.Int(-1, help="the feature on show (-1: none)")
    mode = traitlets.Enum(MODES, default_value="steer")
    scale = traitlets.Float(SCALE_START)
    relative = traitlets.Bool(True)
    value = traitlets.Float(0.0, help="what a clamp sets the feature to")
    span = traitlets.Enum(SPANS, default_value="all")
    comparison = traitlets.Any(None, allow_none=True)
    streamed_states = traitlets.Int(0)
    live_texts = traitlets.Tuple(("", ""))

    def __init__(self, session: Any, sae: Any, prompts: str | Sequence[str], *,
                 feature: int | None = None, labels: Mapping[int, str] | None = None,
                 prompt: str | None = None, top_k: int = 0, k: int | None = None, n_contexts: int = 8,
                 max_new_tokens: int = 40, unembed: Any = None,
                 measured: Mapping[str, Any] | None = None, harvest: Any = None) -> None:
        if not isinstance(sae, SAE):
            raise VlensError(f"FeatureView needs a vlens.SAE (vlens.SAE.load(path)), "
                             f"got {type(sae).__name__}")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
            raise VlensError("FeatureView needs prompts: a non-empty string or a list of them")
        # a token's features listed: a topk SAE's k (each token has that many), else 8
        k = (sae.spec.k if sae.spec.architecture == "topk" else 8) if k is None else int(k)
        measured = sae.measured() if measured is None else dict(measured)
        if labels is None:
            labels = {int(v["feature"]): name for name, v in measured.get("features", {}).items()}
        self.sae, self.labels, self.k, self.n_contexts = sae, dict(labels), k, n_contexts
        #: the measured steer and clamp this view starts at ({} without measured.json)
        self.recipe = {key: measured[key] for key in ("steer", "clamp") if key in measured}
        self.scale = float(self.recipe.get("steer", {}).get("scale", SCALE_START))
        self.relative = bool(self.recipe.get("steer", {}).get("relative", True))
        self.span = self.recipe.get("clamp", {}).get("span", "all")
        self.controller = Controller(session, max_new_tokens=max_new_tokens)
        self._unembed = unembed
        # the features, and the norms of the rows they encode (a clamp's scale)
        self.run: Run = session.trace(prompts, saes=[sae], sites=[sae.site], layers=[sae.layer],
                                      reduce="norm", features_top_k=top_k, max_new_tokens=1,
                                      logprobs=False)
        self._acts = [t.features(sae) for t in self.run]  # [T_p, d_sae] each
        #: the harvest the contexts and histogram come from (None: the prompts)
        self.harvest = None if harvest is None else self._read_harvest(harvest, session)
        self.mean_norm = float(torch.cat([t.norms(sae.site).flatten()
                                          for t in self.run]).mean())
        self._make_controls(prompts, prompt or prompts[0])
        super().__init__([
            self._shown, self.chips, self._token_label, self.feature_buttons,
            widgets.HBox([self._feature_box, self._header]), self._contexts,
            widgets.HBox([self.histogram, self.logit_figure], layout={"flex_flow": "row wrap"}),
            self._steer_row, widgets.HBox([self._prompt, self._run_button]), self._texts, self._ran,
        ])
        self._connect()
        if feature is not None:
            self.feature = feature

    def _make_controls(self, prompts: list[str], prompt: str) -> None:
        short = [p if len(p) <= 60 else p[:57] + "..." for p in prompts]
        self._shown = widgets.Dropdown(options=[(f"{i}: {p}", i) for i, p in enumerate(short)],
                                       value=0, description="prompt", layout={"width": "70%"})
        self.chips = TokenSpanPicker()
        self._token_label = widgets.Label("click a token: its top features")
        self.feature_buttons = widgets.ToggleButtons(options=[], value=None,
                                                     style={"button_width": "auto"})
        self.feature_buttons.add_class("vlens-feature-buttons")
        self._feature_box = widgets.BoundedIntText(value=0, min=0, max=self.sae.d_sae - 1,
                                                   description="feature",
                                                   layout={"width": "180px"})
        self._header = widgets.HTML()
        self._contexts = widgets.HTML(layout={"width": "98%"})
        self.histogram = figure_widget()
        self.logit_figure = figure_widget()
        self._mode = widgets.ToggleButtons(options=MODES, tooltips=[
            "add scale x the feature's decoder row", "set the feature to a value"])
        self._scale = widgets.FloatSlider(value=self.scale, min=-2.0, max=2.0, step=0.05,
                                          description="scale", continuous_update=False)
        self._relative = widgets.Checkbox(value=self.relative, description="relative to |x|",
                                          indent=False, layout={"width": "140px"})
        self._value = widgets.FloatText(value=self.value, description="value",
                                        layout={"width": "200px"})
        self._span = widgets.Dropdown(options=SPANS, value=self.span, description="span",
                                      layout={"width": "200px"})
        self._reset = widgets.Button(description="reset to recipe", icon="undo",
                                     tooltip="the feature, steer and clamp measured.json records")
        self._reset.layout.display = "" if self.recipe else "none"
        self._steer_row = widgets.HBox(
            [self._mode, self._scale, self._relative, self._value, self._span, self._reset],
            layout={"flex_flow": "row wrap"})
        self._prompt = widgets.Text(prompt, description="steer", layout={"width": "70%"})
        self._run_button = widgets.Button(description="run", icon="play", button_style="primary")
        self._texts = widgets.HTML(layout={"width": "95%"})
        self._texts.add_class("vlens-texts")
        self._ran = widgets.Label()

    def _connect(self) -> None:
        for a, b in ((self._shown, "shown"), (self._mode, "mode"), (self._scale, "scale"),
                     (self._relative, "relative"), (self._value, "value"), (self._span, "span")):
            widgets.link((a, "value"), (self, b))
        self.observe(lambda c: setattr(self._texts, "value", texts_html(*c["new"], self.mode + "ed")),
                     names="live_texts")
        self.observe(self._guard(lambda _c: self._show_prompt()), names="shown")
        self.chips.observe(self._guard(self._on_chips), names="selection")
        self.observe(self._guard(lambda _c: self._show_token()), names="token")
        self.feature_buttons.observe(self._guard(self._on_button), names="value")
        self._feature_box.observe(self._guard(lambda c: setattr(self, "feature", c["new"])),
                                  names="value")
        self.observe(self._guard(lambda _c: self._show_feature()), names="feature")
        self.observe(self._guard(lambda _c: self._show_mode()), names="mode")
        self._run_button.on_click(lambda _b: self._start("compare", self._compare_run))
        self._reset.on_click(self._guard(lambda _b: self.reset_to_recipe()))
        # a setting changed while a run is under way: that run starts again with it
        self.observe(lambda _c: self._runs.under_way() and self._start(
            "compare", self._compare_run), names=["mode", "scale", "relative", "value", "span",
                                                  "feature"])
        self._show_prompt()
        self._show_mode()

    @traitlets.validate("feature")
    def _check_feature(self, proposal):
        f = proposal["value"]
        if not -1 <= f < self.sae.d_sae:
            raise VlensError(f"feature must be in [0, {self.sae.d_sae}) (or -1 for none), got {f}")
        return f

    @traitlets.validate("shown")
    def _check_shown(self, proposal):
        if not 0 <= proposal["value"] < len(self.run):
            raise VlensError(f"shown must be a prompt index in [0, {len(self.run)}), "
                             f"got {proposal['value']}")
        return proposal["value"]

    # -- frames ----------------------------------------------------------------
    def name(self, feature: int) -> str:
        """``"#919 mood=happy"``, or ``"#919"`` for a feature with no label."""
        label = self.labels.get(feature)
        return f"#{feature} {label}" if label else f"#{feature}"

    def reset_to_recipe(self) -> None:
        """The recipe's feature, steer (scale, relative) and clamp (value,
        span) back, as ``measured.json`` records them (the *reset to
        recipe* button)."""
        if not self.recipe:
            raise VlensError("this SAE has no measured.json beside it: no recipe to reset to")
        steer, clamp = self.recipe.get("steer", {}), self.recipe.get("clamp", {})
        with self.hold_trait_notifications():
            self.feature = int(steer.get("feature", clamp.get("feature", self.feature)))
            self.scale = float(steer.get("scale", self.scale))
            self.relative = bool(steer.get("relative", self.relative))
            self.span = clamp.get("span", self.span)
        self.value = self._value_start(self.feature)

    def _value_start(self, feature: int) -> float:
        """Where a shown feature's clamp starts: the recipe's value, else
        :func:`clamp_start`."""
        if "value" in self.recipe.get("clamp", {}):
            return float(self.recipe["clamp"]["value"])
        return clamp_start(self.sae, feature, self.mean_norm)

    def token_features(self) -> Any:
        """The clicked token's top ``k`` features (a frame: ``feature``,
        ``activation``); empty when no token is clicked."""
        if self.token < 0:
            return top_features(self._acts[self.shown][0] * 0, self.k)
        return top_features(self._acts[self.shown][self.token], self.k)

    def activations(self, feature: int | None = None) -> list[Any]:
        """The feature's ``[T_p]`` activations on each prompt."""
        f = self.feature if feature is None else feature
        return [a[:, f] for a in self._acts]

    def _read_harvest(self, harvest: Any, session: Any) -> Harvest:
        """The harvest's texts encoded here (:func:`harvest_features`)."""
        h, self._h_ids, self._h_vals, self._h_spans, self._h_tokens = harvest_features(
            harvest, self.sae, session, self.k)
        return h

    def harvest_activations(self, feature: int | None = None) -> list[Any]:
        """The feature's ``[T_t]`` activations on each harvested text."""
        f = self.feature if feature is None else feature
        col = (self._h_vals * (self._h_ids == f)).sum(-1)  # [N]
        return [col[a:b] for a, b in self._h_spans]

    def contexts(self) -> Any:
        """The feature's top-activating contexts over the harvest's texts
        when the view has one, else over the prompts (a frame,
        :func:`vlens.plots.feature_contexts`)."""
        if self.harvest is not None:
            return feature_contexts(self.harvest_activations(), self._h_tokens,
                                    n=self.n_contexts)
        return feature_contexts(self.activations(), [list(t.tokens) for t in self.run],
                                n=self.n_contexts)

    def logits(self) -> Any:
        """What the feature's decoder row promotes and suppresses through the
        model's final norm and unembedding (a frame,
        :func:`vlens.plots.feature_logits`)."""
        lens = self._lens()
        s = self.controller.session
        return feature_logits(self.sae.decoder(self.feature), lens.unembed, k=10,
                              norm_weight=lens.norm_weight, token_strings=s.token_strings)

    def _lens(self) -> Any:
        if self.sae.site not in RESIDUAL_SITES:
            raise VlensError(f"the SAE reads {self.sae.site!r}, which reaches the unembedding "
                             "only through later weights: no promoted tokens to show")
        if self._unembed is None:
            self._unembed = LogitLens.from_pretrained(self.controller.session.model)
        return self._unembed

    def steer(self) -> Any:
        """The edit the run button makes: a :class:`vlens.Steer` of the
        feature's decoder row, or a :class:`vlens.Clamp` of the feature."""
        if self.feature < 0:
            raise VlensError("pick a feature first: click a token, then one of its features")
        if self.mode == "clamp":
            return Clamp(self.sae, self.feature, self.value, span=self.span)
        return Steer(self.sae.decoder(self.feature), self.sae.layer, self.scale, self.sae.site,
                     self.span, relative=self.relative)

    # -- engine ----------------------------------------------------------------
    def run_comparison(self) -> Any:
        """Baseline vs steered (or clamped) on the steering prompt, streamed:
        both texts grow side by side as the engine steps. (The run button
        does it in the background, the latest click wins: ``fv.wait()``.)"""
        return self._call("compare", self._compare_run)

    def _compare_run(self) -> Any:
        prompt = self._prompt.value
        if not prompt.strip():
            raise VlensError("type a prompt to steer first")
        edit = self.steer()
        what = (f"clamping feature {self.feature} to {self.value:g}…" if self.mode == "clamp"
                else f"steering with feature {self.feature} at scale {self.scale:g}…")
        total = 2 * self.controller.max_new_tokens
        self.streamed_states = 0
        self._ran.value = ""
        cmp = None
        states = self.controller.stream_compare(prompt, edit)
        with self._working(what, "tokens") as report, closing(states):
            for state in states:
                if not isinstance(state, tuple):
                    cmp = state
                    break
                report(sum(len(t.output_token_ids) for r in state for t in r), total)
                self.live_texts = tuple(r[0].text if len(r) else "" for r in state)
                self.streamed_states += 1
        with self._publishing():
            self.comparison = cmp
            self.live_texts = (cmp.baseline[0].text, cmp.steered[0].text)
            i = cmp.first_divergence[0]
            self._ran.value = (f"{what[:-1]}: " + ("no divergence" if i is None
                                                  else f"first divergence at new token {i}"))
        return cmp

    # -- reactions -------------------------------------------------------------
    def _on_chips(self, change) -> None:
        start, stop = change["new"]
        self.token = start if stop > start else -1

    def _on_button(self, change) -> None:
        if change["new"] is not None:
            self.feature = change["new"]

    def _show_prompt(self) -> None:
        t = self.run[self.shown]
        self.token = -1
        self.chips.selection = (0, 0)
        self.chips.tokens = list(t.tokens)
        self.chips.n_prompt = len(t.prompt_token_ids)
        self._shade()
        self._show_token()

    def _shade(self) -> None:
        if self.feature < 0:
            self.chips.shade = []
            return
        v = self._acts[self.shown][:, self.feature]
        top = float(max(a[:, self.feature].max() for a in self._acts))
        self.chips.shade = (v / top).clamp(0, 1).tolist() if top > 0 else [0.0] * len(v)

    def _show_token(self) -> None:
        frame = self.token_features()
        with self.feature_buttons.hold_trait_notifications():
            self.feature_buttons.options = [(f"{self.name(f)} · {a:.3g}", f)
                                            for f, a in zip(frame["feature"], frame["activation"])]
            self.feature_buttons.value = self.feature if self.feature in frame["feature"].values \
                else None
        if self.token < 0:
            self._token_label.value = "click a token: its top features"
        else:
            tok = visible(self.chips.tokens[self.token])
            self._token_label.value = (f"token {self.token} {tok!r}: top features" if len(frame)
                                       else f"token {self.token} {tok!r}: no feature fires")
        if self.feature >= 0:
            self._show_histogram()

    def _show_feature(self) -> None:
        f = self.feature
        if f < 0:
            return
        self._feature_box.value = f
        values = [o[1] for o in self.feature_buttons.options]
        self.feature_buttons.value = f if f in values else None
        self.value = self._value_start(f)
        frame = self.contexts()
        unit = "prompt" if self.harvest is None else "text"
        all_v = self.activations() if self.harvest is None else self.harvest_activations()
        n_on = sum(int((v > 0).sum()) for v in all_v)
        n_all = sum(v.numel() for v in all_v)
        self._header.value = (f"<b>feature {html.escape(self.name(f))}</b>: fires on {n_on} of "
                              f"{n_all} tokens of {len(all_v)} {unit}s")
        top = float(frame["activation"].max()) if len(frame) else 0.0
        self._contexts.value = contexts_html(frame, top, f"feature {self.name(f)}", unit)
        self._shade()
        self._show_histogram()
        logits = self.logits()
        show_figure(self.logit_figure, promoted_tokens(
            logits, title=f"feature {self.name(f)} through the unembedding"))

    def _show_histogram(self) -> None:
        mark = (float(self._acts[self.shown][self.token, self.feature]) if self.token >= 0
                else None)
        values = self.activations() if self.harvest is None else self.harvest_activations()
        show_figure(self.histogram, feature_histogram(
            torch.cat(values), feature=self.feature, mark=mark))

    def _show_mode(self) -> None:
        steering = self.mode == "steer"
        self._scale.layout.display = "" if steering else "none"
        self._relative.layout.display = "" if steering else "none"
        self._value.layout.display = "none" if steering else ""
