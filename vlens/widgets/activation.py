"""A layer x token heatmap of a run, with layer / site / quantity pickers.

The view draws a Run it is given (``view.run = run``); it never calls the
engine. Changing the layer, site, quantity or span re-plots from that run.
The token strip below the heatmap shows the chosen layer's value per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.plots import QUANTITIES, activation_heatmap, activation_values, token_strip
from vlens.results import Run
from vlens.results.run import stack_index
from vlens.widgets._base import View, figure_widget, full_sites, layers_spanned, show_figure
from vlens.widgets.pickers import LayerPicker, SitePicker
from vlens.widgets.selection import Selection

__all__ = ["ActivationView"]


class ActivationView(View):
    """Heatmap of a per-token quantity, layer x token, of a run's first trace.

    ``ActivationView(run)`` shows ``run`` (one that read full activations,
    e.g. ``s.trace(prompts, layers=None, sites=s.sites)``); set ``run`` to
    show another. ``selection`` (a :class:`Selection`, shared in an
    explorer) holds ``layer``, ``site`` and ``span``; ``n_layers`` and
    ``sites`` size the pickers (default: what ``run`` read). Own traits:
    ``quantity`` (norm / projection / cosine / neuron), ``neuron``,
    ``direction`` (a ``[hidden]`` tensor, for projection and cosine),
    ``per_layer`` (each layer its own colour range, default on) and
    ``log`` (log colours; default: on for norms). ``heatmap`` and
    ``strip`` are the figure views (:class:`FigureView`).
    """

    quantity = traitlets.Enum(QUANTITIES, default_value="norm")
    neuron = traitlets.Int(0)
    direction = traitlets.Any(None, allow_none=True)
    per_layer = traitlets.Bool(True, help="each layer on its own colour range")
    log = traitlets.Bool(True, help="log colours (signed values: sign * log10(1 + |v|))")
    run = traitlets.Instance(Run, allow_none=True, help="the Run on show")

    def __init__(
        self,
        run: Run | None = None,
        *,
        selection: Selection | None = None,
        n_layers: int | None = None,
        sites: Sequence[str] | None = None,
        layer: int | None = None,
        site: str | None = None,
        quantity: str = "norm",
        neuron: int = 0,
        direction: Any = None,
        per_layer: bool = True,
        log: bool | None = None,
    ) -> None:
        if run is None and (n_layers is None or sites is None):
            raise ValueError("give a run to show, or n_layers= and sites= for one to come")
        n_layers = layers_spanned(run) if n_layers is None else n_layers
        sites = full_sites(run) if sites is None else list(sites)
        self.selection = Selection(layer=n_layers // 2) if selection is None else selection
        if layer is not None:
            self.selection.layer = layer
        if site is not None:
            self.selection.site = site
        self.layer_picker = LayerPicker(n_layers, value=self.selection.layer)
        self.site_picker = SitePicker(sites, value=self.selection.site)
        self._quantity = widgets.Dropdown(options=QUANTITIES, value=quantity,
                                          description="quantity")
        # unbounded until a run says the hidden size
        self._neuron = widgets.BoundedIntText(value=neuron, min=0, max=2**31 - 1,
                                              description="neuron", layout={"width": "180px"})
        log = quantity == "norm" if log is None else log  # norms span decades; signs do not
        self._per_layer = widgets.Checkbox(value=per_layer,
                                           description="each layer its own colours",
                                           indent=False, layout={"width": "210px"})
        self._log = widgets.Checkbox(value=log, description="log colours", indent=False,
                                     layout={"width": "110px"})
        self.heatmap = figure_widget()
        self.strip = figure_widget()
        controls = widgets.HBox(
            [self.layer_picker, self.site_picker, self._quantity, self._neuron,
             self._per_layer, self._log],
            layout={"flex_flow": "row wrap"},
        )
        super().__init__([controls, self.heatmap, self.strip])

        self.quantity = quantity
        self.neuron = neuron
        self.direction = direction
        self.per_layer = per_layer
        self.log = log
        widgets.link((self._per_layer, "value"), (self, "per_layer"))
        widgets.link((self._log, "value"), (self, "log"))
        widgets.link((self.layer_picker, "value"), (self.selection, "layer"))
        widgets.link((self.site_picker, "value"), (self.selection, "site"))
        widgets.link((self._quantity, "value"), (self, "quantity"))
        widgets.link((self._neuron, "value"), (self, "neuron"))
        self._sync_neuron_box()
        self.selection.observe(self._guard(self._redraw), names=["layer", "site", "span"])
        self.observe(self._guard(self._on_change),
                     names=["quantity", "neuron", "direction", "run", "per_layer", "log"])
        self.run = run

    # -- reactions -------------------------------------------------------------
    def _on_change(self, change) -> None:
        if change["name"] == "quantity":
            self._sync_neuron_box()
        if change["name"] == "run" and self.run is not None:
            t = self.run[0]
            self.site_picker.set_sites(full_sites(self.run))
            self._neuron.max = t.activations(self.site).shape[-1] - 1
            if self.span[1] > t.n_tokens:
                self.span = (0, 0)  # the selection's observer re-plots
                return
        self.replot()

    def _redraw(self, change) -> None:
        self.replot()

    def _sync_neuron_box(self) -> None:
        self._neuron.layout.display = "" if self.quantity == "neuron" else "none"

    # -- drawing ---------------------------------------------------------------
    def values(self):
        """``([n_layers_read, n_tokens] values, layers read)`` of the shown
        trace for the current site and quantity."""
        t = self.run[0]
        acts = t.activations(self.site)
        return (
            activation_values(acts, self.quantity, direction=self.direction,
                              neuron=self.neuron),
            t.layers_read(self.site),
        )

    def replot(self) -> None:
        """Redraw both figures from the run on show."""
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
                span=self.span, n_prompt=n_prompt, per_layer=self.per_layer, log=self.log,
                title=f"{self.site}: {label} by layer and token",
            ),
        )
        row = values[stack_index(layers, self.layer, self.site)]  # not read: it says so
        show_figure(
            self.strip,
            token_strip(row, t.tokens, n_prompt=n_prompt, quantity=label, width=12,
                        span=self.span,
                        title=f"{self.site} layer {self.layer}: {label} per token"),
        )
