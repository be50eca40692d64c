"""Stock-control pickers: a layer (or a range of layers), a site, a set of heads."""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as widgets
import traitlets

__all__ = ["HeadPicker", "LayerPicker", "SitePicker"]


class LayerPicker(widgets.VBox):
    """One layer (``value=3``) or an inclusive range (``value=(1, 4)``).

    The mode follows the initial value and stays: ``value`` is an int for a
    one-layer picker and a ``(low, high)`` tuple for a range picker.
    ``layers`` lists the selected layer numbers either way.
    """

    value = traitlets.Any(help="an int, or (low, high) for a range picker")

    def __init__(
        self,
        n_layers: int,
        *,
        value: int | tuple[int, int] | None = None,
        description: str = "layer",
    ) -> None:
        if not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
        self.n_layers = n_layers
        self.is_range = isinstance(value, (tuple, list))
        if value is None:
            value = n_layers // 2
        if self.is_range:
            lo, hi = (int(v) for v in value)
            self._slider = widgets.IntRangeSlider(
                value=(lo, hi), min=0, max=n_layers - 1, description=description,
                continuous_update=False,
            )
        else:
            self._slider = widgets.IntSlider(
                value=int(value), min=0, max=n_layers - 1, description=description,
                continuous_update=False,
            )
        super().__init__(children=[self._slider])
        self.value = tuple(value) if self.is_range else int(value)
        self._slider.observe(self._from_slider, names="value")
        self.observe(self._to_slider, names="value")

    @traitlets.validate("value")
    def _check(self, proposal):
        v = proposal["value"]
        top = self.n_layers - 1
        if self.is_range:
            if not isinstance(v, (tuple, list)) or len(v) != 2:
                raise traitlets.TraitError(f"a range picker's value is (low, high), got {v!r}")
            lo, hi = int(v[0]), int(v[1])
            if not 0 <= lo <= hi <= top:
                raise traitlets.TraitError(f"layers ({lo}, {hi}) outside 0..{top}")
            return (lo, hi)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
            raise traitlets.TraitError(f"layer must be an int in 0..{top}, got {v!r}")
        return v

    @property
    def layers(self) -> list[int]:
        if self.is_range:
            return list(range(self.value[0], self.value[1] + 1))
        return [self.value]

    def _from_slider(self, change) -> None:
        self.value = tuple(change["new"]) if self.is_range else change["new"]

    def _to_slider(self, change) -> None:
        self._slider.value = change["new"]


class SitePicker(widgets.Dropdown):
    """A dropdown of sites (``session.sites``, or the sites a run read)."""

    def __init__(self, sites: Sequence[str], *, value: str | None = None,
                 description: str = "site") -> None:
        sites = list(sites)
        if not sites:
            raise ValueError("no sites to pick from")
        if value is None:
            value = _default_site(sites)
        if value not in sites:
            raise ValueError(f"site {value!r} is not one of {', '.join(sites)}")
        super().__init__(options=sites, value=value, description=description)

    def set_sites(self, sites: Sequence[str]) -> None:
        """Offer ``sites``, keeping the current site when it is one of them."""
        sites = list(sites)
        if not sites:
            raise ValueError("no sites to pick from")
        if sites != list(self.options):
            keep = self.value if self.value in sites else _default_site(sites)
            self.options = sites  # resets the value to the first option
            self.value = keep


def _default_site(sites: list[str]) -> str:
    return "resid_post" if "resid_post" in sites else sites[0]


class HeadPicker(widgets.HBox):
    """A toggle button per attention head; ``value`` is the sorted list of
    the heads switched on (e.g. the heads to knock out)."""

    value = traitlets.List(traitlets.Int(), help="the heads switched on, sorted")

    def __init__(self, n_heads: int, *, value: Sequence[int] = (),
                 description: str = "heads") -> None:
        if not isinstance(n_heads, int) or n_heads < 1:
            raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
        self.n_heads = n_heads
        self._buttons = [
            widgets.ToggleButton(description=str(h), tooltip=f"head {h}",
                                 layout={"width": "42px"})
            for h in range(n_heads)
        ]
        super().__init__(children=[widgets.Label(description), *self._buttons],
                         layout={"flex_flow": "row wrap"})
        self.value = list(value)
        for button in self._buttons:
            button.observe(self._from_buttons, names="value")
        self.observe(self._to_buttons, names="value")
        self._to_buttons(None)

    @traitlets.validate("value")
    def _check(self, proposal):
        heads = sorted({int(h) for h in proposal["value"]})
        bad = [h for h in heads if not 0 <= h < self.n_heads]
        if bad:
            raise traitlets.TraitError(f"head {bad[0]} outside 0..{self.n_heads - 1}")
        return heads

    def _from_buttons(self, change) -> None:
        self.value = [h for h, b in enumerate(self._buttons) if b.value]

    def _to_buttons(self, change) -> None:
        on = set(self.value)
        for h, button in enumerate(self._buttons):
            button.value = h in on
            button.button_style = "danger" if h in on else ""
