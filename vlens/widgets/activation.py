"""Layer / site / quantity pickers over a layer x token heatmap.

One trace of the prompt reads every site at every layer; after that,
changing the layer, site, quantity or span only re-plots from the cached
trace (no engine call). The token strip below the heatmap shows the chosen
layer's value per token.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.plots import QUANTITIES, activation_heatmap, activation_values, token_strip
from vlens.widgets._base import Panel, figure_widget, show_figure
from vlens.widgets.pickers import LayerPicker, SitePicker

__all__ = ["ActivationView"]


class ActivationView(Panel):
    """Heatmap of a per-token quantity, layer x token, for one prompt.

    ``ActivationView(session, "the cat")`` traces the prompt (every site and
    layer); ``ActivationView(session, run=run)`` shows a run you already
    have (it must hold the sites you pick). Traits: ``layer``, ``site``,
    ``quantity`` (norm / projection / cosine / neuron), ``neuron``,
    ``span`` ``(start, stop)``; ``direction`` (a ``[hidden]`` tensor) feeds
    projection and cosine. ``heatmap`` and ``strip`` are the FigureWidgets.
    """

    layer = traitlets.Int(0)
    site = traitlets.Unicode("resid_post")
    quantity = traitlets.Enum(QUANTITIES, default_value="norm")
    neuron = traitlets.Int(0)
    span = traitlets.Tuple(traitlets.Int(), traitlets.Int(), default_value=(0, 0))
    direction = traitlets.Any(None, allow_none=True)
    run = traitlets.Any(None, allow_none=True, help="the Run on show")

    def __init__(
        self,
        session: Any,
        prompt: str | None = None,
        *,
        run: Any = None,
        layer: int | None = None,
        site: str = "resid_post",
        quantity: str = "norm",
        neuron: int = 0,
        direction: Any = None,
        max_new_tokens: int = 16,
        show_prompt: bool = True,
    ) -> None:
        self.session = session
        self.max_new_tokens = max_new_tokens
        n_layers = session.n_layers
        self.layer_picker = LayerPicker(n_layers, value=n_layers // 2 if layer is None else layer)
        self.site_picker = SitePicker(session.sites, value=site)
        self._quantity = widgets.Dropdown(options=QUANTITIES, value=quantity,
                                          description="quantity")
        self._neuron = widgets.BoundedIntText(
            value=neuron, min=0, max=session.hidden_size - 1, description="neuron",
            layout={"width": "180px"},
        )
        self._prompt = widgets.Text(value=prompt or "", description="prompt",
                                    layout={"width": "60%"})
        self._trace_button = widgets.Button(description="trace", icon="play")
        self.heatmap = figure_widget()
        self.strip = figure_widget()
        prompt_row = widgets.HBox([self._prompt, self._trace_button])
        prompt_row.layout.display = "" if show_prompt else "none"
        controls = widgets.HBox(
            [self.layer_picker, self.site_picker, self._quantity, self._neuron],
            layout={"flex_flow": "row wrap"},
        )
        super().__init__([prompt_row, controls, self.heatmap, self.strip])

        self.set_trait("layer", self.layer_picker.value)
        self.site = site
        self.quantity = quantity
        self.neuron = neuron
        self.direction = direction
        widgets.link((self.layer_picker, "value"), (self, "layer"))
        widgets.link((self.site_picker, "value"), (self, "site"))
        widgets.link((self._quantity, "value"), (self, "quantity"))
        widgets.link((self._neuron, "value"), (self, "neuron"))
        self._sync_neuron_box()
        self.observe(
            self._guard(self._on_change),
            names=["layer", "site", "quantity", "neuron", "span", "direction"],
        )
        self._trace_button.on_click(self._guard(lambda _b: self.trace(self._prompt.value)))
        if run is not None:
            self.set_run(run)
        elif prompt:
            self._guard(self.trace)(prompt)

    # -- engine ----------------------------------------------------------------
    def trace(self, prompt: str) -> Any:
        """Trace ``prompt`` (every site, every layer) and show it."""
        self._prompt.value = prompt
        with self._working(f"tracing {self.max_new_tokens} new tokens…") as report:
            run = self.session.trace(
                [prompt], layers=None, sites=self.session.sites,
                max_new_tokens=self.max_new_tokens, progress=report,
            )
        self.set_run(run)
        return run

    def set_run(self, run: Any) -> None:
        """Show the first trace of ``run`` (no engine call)."""
        self.run = run
        if self.span[1] > run[0].n_tokens:
            self.span = (0, 0)  # the observer re-plots
        else:
            self.replot()

    # -- plotting --------------------------------------------------------------
    def _on_change(self, change) -> None:
        if change["name"] == "quantity":
            self._sync_neuron_box()
        if self.run is not None:
            self.replot()

    def _sync_neuron_box(self) -> None:
        self._neuron.layout.display = "" if self.quantity == "neuron" else "none"

    def values(self):
        """``([n_layers_read, n_tokens] values, layers read)`` of the shown
        trace for the current site and quantity."""
        t = self.run[0]
        acts = t.activations(self.site)
        return (
            activation_values(acts, self.quantity, direction=self.direction,
                              neuron=self.neuron),
            list(t.layers[self.site]),
        )

    def replot(self) -> None:
        """Redraw both figures from the cached run."""
        if self.run is None:
            return
        t = self.run[0]
        values, layers = self.values()
        n_prompt = len(t.prompt_token_ids)
        label = f"{self.quantity}" + (f" {self.neuron}" if self.quantity == "neuron" else "")
        show_figure(
            self.heatmap,
            activation_heatmap(
                values, t.tokens, layers, quantity=label, layer=self.layer,
                span=self.span, n_prompt=n_prompt,
                title=f"{self.site}: {label} by layer and token",
            ),
        )
        if self.layer in layers:
            row = values[layers.index(self.layer)]
            show_figure(
                self.strip,
                token_strip(row, t.tokens, n_prompt=n_prompt, quantity=label, width=12,
                            span=self.span,
                            title=f"{self.site} layer {self.layer}: {label} per token"),
            )
        else:
            raise ValueError(
                f"layer {self.layer} of {self.site!r} was not read in this run "
                f"(read: {layers})"
            )
