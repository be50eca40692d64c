"""The steering panel's controls, the line that says what a run will use,
and the way back to the recipe.

Kept apart from :mod:`vlens.widgets.steering` (which runs things) so that
each file has one job: this one builds and describes the controls. A
panel's settings are its own: a recipe (or what the panel was given) sets
them, the panel's controls change them, and nothing outside the panel does,
except the shared selection's span, and only while the panel's span is
``"selection"``.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets

from vlens.widgets._base import figure_widget
from vlens.widgets.defaults import SteeringDefaults
from vlens.widgets.pickers import HeadPicker, LayerPicker, SitePicker
from vlens.widgets.prompt_box import prompt_box
from vlens.widgets.selection import token_sites
from vlens.widgets.token_span import TokenSpanPicker

__all__ = ["SPAN_MODES", "SteeringControls"]

SPAN_MODES = ("all", "prompt", "generated", "selection")

#: the settings :meth:`SteeringControls.reset` puts back, in the order the line names them
RECIPE_KEYS = ("layer", "site", "span_mode", "scale", "relative", "source", "vector",
               "positive", "negative")


class SteeringControls:
    """Mixed into :class:`~vlens.widgets.SteeringPanel`: its widgets, the
    settings line (``settings_text``) and :meth:`reset`."""

    # set by the panel
    _recipe: dict[str, Any]
    _recipe_name: str
    scales: list[float]

    def _make_controls(self, s: Any, start: SteeringDefaults, positive: Sequence[str],
                       negative: Sequence[str], vector: Any, prompt: Any, scale: float,
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
        self.layer_picker = LayerPicker(s.n_layers, value=self.layer)
        # the [hidden]-wide sites: a steering direction is one vector per token
        self.site_picker = SitePicker(token_sites(s.sites), value=self.site)
        self._prompt = prompt_box(prompt)
        self.span_picker = TokenSpanPicker() if span_picker else None
        self._span_mode = widgets.Dropdown(options=SPAN_MODES, description="span")
        self._scale = widgets.FloatSlider(
            value=scale, min=-reach, max=reach, step=0.25 if reach <= 4 else 0.5,
            description="scale", continuous_update=False,
        )
        self._relative = widgets.Checkbox(value=start.relative if relative is None else relative,
                                          description="relative to |x|", indent=False,
                                          layout={"width": "140px"})
        self._token_set = widgets.Text(token_set, description="token set",
                                       placeholder="words, space separated")
        self._run_button = widgets.Button(description="run", icon="play",
                                          button_style="primary")
        self._reset_button = widgets.Button(
            description=f"reset to {self._recipe_name}", icon="undo",
            tooltip=f"put every setting back to the {self._recipe_name} (the prompt stays)")
        self._sweep_button = widgets.Button(description=f"sweep {len(self.scales)} scales", icon="line-chart")
        n_heads = int(s.info.get("n_heads", 0) or 0)
        self._mode = widgets.ToggleButtons(
            options=[("steer", "steer"), ("ablate heads", "ablate")], description="mode")
        self.head_picker = HeadPicker(max(n_heads, 1), description="knock out heads")
        self._kind = widgets.Dropdown(options=["zero", "mean"], description="replace with",
                                      layout={"width": "200px"})
        self._ablate_row = widgets.HBox([self.head_picker, self._kind],
                                        layout={"flex_flow": "row wrap"})
        self._mode.layout.display = "" if "z" in s.sites and n_heads else "none"
        # what the run button will run with, always on show
        self._settings = widgets.HTML()
        self._settings.add_class("vlens-settings")
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

    def _layout(self) -> list[widgets.Widget]:
        """The panel's rows, top to bottom."""
        return [
            self._mode, self._note, self._source, self._lists, self._vector_row,
            widgets.HBox([self._prompt]), *([self.span_picker] if self.span_picker else []),
            widgets.HBox([self.layer_picker, self.site_picker, self._span_mode],
                         layout={"flex_flow": "row wrap"}),
            self._ablate_row, self._scale_row, self._settings,
            widgets.HBox([self._run_button, self._reset_button]),
            self._texts, self.comparison_figure, self._sweep_box,
        ]

    # -- the settings a run will use -------------------------------------------
    def _changed(self, key: str) -> bool:
        now, then = getattr(self, key), self._recipe[key]
        if key == "vector":
            return now is not then
        if key in ("positive", "negative"):
            return list(now) != list(then)
        return now != then

    def _span_words(self) -> str:
        if self.span_mode != "selection":
            return self.span_mode
        start, stop = self.span
        if stop <= start:
            return "selection (none picked: click the prompt's tokens)"
        return f"selection [{start}, {stop})"

    def _direction_words(self) -> str:
        if self.source == "vector":
            v = self.vector
            return "saved vector (none yet)" if v is None else \
                f"saved vector, norm {float(v.norm()):.3g}"
        return (f"mean of {len(self.positive)} positive minus "
                f"{len(self.negative)} negative prompts")

    def _setting_parts(self) -> list[tuple[str, str, str | None]]:
        """``(name, value in words, recipe key or None)`` per setting shown."""
        where = [("layer", str(self.layer), "layer"), ("site", self.site, "site"),
                 ("span", self._span_words(), "span_mode")]
        if self.mode == "ablate":
            heads = ", ".join(map(str, self.ablate_heads)) or "none picked"
            return [("knock out heads", heads, None), *where,
                    ("replace with", self.ablation_kind, None)]
        scale = f"{self.scale:g}" + (" relative to |x|" if self.relative else " absolute")
        direction = ("direction", self._direction_words(), "source")
        return [*where, ("scale", scale, "scale"), direction]

    @property
    def settings_text(self) -> str:
        """What the run button will run with, in words (the line the panel
        shows): each setting, and ``(recipe: ...)`` beside one changed from
        the recipe (or from what the panel was given)."""
        parts = []
        for name, words, key in self._setting_parts():
            moved = key is not None and (
                self._changed(key) or (key == "scale" and self._changed("relative"))
                or (key == "source" and any(self._changed(k) for k in
                                            ("vector", "positive", "negative"))))
            was = ""
            if moved:
                was = " (changed; " + self._recipe_name + ": " + self._recipe_words(key) + ")"
            parts.append(f"{name} {words}{was}")
        return "runs with: " + " · ".join(parts)

    def _recipe_words(self, key: str) -> str:
        r = self._recipe
        if key == "scale":
            return f"{r['scale']:g}" + (" relative" if r["relative"] else " absolute")
        if key == "source":
            return ("saved vector" if r["source"] == "vector" else
                    f"{len(r['positive'])} + {len(r['negative'])} prompts")
        return str(r[key])

    def _show_settings(self, _change: Any = None) -> None:
        text = self.settings_text
        head, _, rest = text.partition(": ")
        self._settings.value = (f"<small><b>{html.escape(head)}:</b> "
                                f"{html.escape(rest)}</small>")

    def reset(self) -> None:
        """Put every setting back where the panel started: the recipe's
        layer, site, span, scale, direction and prompt lists (or what the
        panel was given). The prompt and the head picks stay."""
        r = self._recipe
        self.mode = "steer"
        self._positive.value = "\n".join(r["positive"])
        self._negative.value = "\n".join(r["negative"])
        for key in ("layer", "site", "span_mode", "relative", "vector", "source", "scale"):
            setattr(self, key, r[key])

    # -- what is shown ---------------------------------------------------------
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

    def _what_ran(self) -> str:
        if self.mode == "ablate":
            return (f"heads {', '.join(map(str, self.ablate_heads))} of layer {self.layer} "
                    f"knocked out ({self.ablation_kind})")
        return f"scale {self.scale:g} at layer {self.layer}"
