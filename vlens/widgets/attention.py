"""Attention patterns of a run: every head at a glance, one head up close,
one token's row and column.

The view draws the ``attn_pattern`` read of a Run it is given
(``view.run = s.trace(prompt, sites=["attn_pattern"], layers=None)``), or
patterns handed to it as a tensor (:meth:`AttentionView.show`); it never
calls the engine. Three figures and a chip strip follow one state:

* ``thumbnails`` -- a grid of every read layer's heads; click one to pick
  that ``(layer, head)``;
* ``heatmap`` -- the picked head, token x token; click a cell to pick its
  query token;
* the chips -- the tokens, tinted by where the picked token attends;
  hovering a chip picks it;
* ``token_figure`` -- the picked token's row (where it attends) and column
  (what attends to it).

State lives in the kernel: ``layer`` (the shared selection's), ``head``
and ``token`` (-1: none). Setting them from Python redraws the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import ipywidgets as widgets
import torch
import traitlets

from vlens.plots import (attention_heads, attention_heatmap, attention_of_token, thumbnail_at,
                         thumbnail_outline)
from vlens.results import Run
from vlens.results.run import stack_index
from vlens.widgets._base import View, figure_widget, show_figure
from vlens.widgets.pickers import LayerPicker
from vlens.widgets.selection import Selection
from vlens.widgets.token_span import TokenSpanPicker

__all__ = ["AttentionView", "PATTERN_SITE"]

PATTERN_SITE = "attn_pattern"


class AttentionView(View):
    """Head thumbnails, one head's token x token pattern, one token's row
    and column, for a run's first trace.

    ``AttentionView(run)`` shows a Run that read ``attn_pattern`` (at the
    layers it read; a run read with ``heads=[...]`` needs the same
    ``heads=`` here, since a trace does not say which heads it holds);
    ``view.show(patterns, tokens)`` shows a tensor ``[layers, heads, T, T]``
    instead. Traits: ``head``, ``token`` (the
    picked query token, -1 for none; the chips' hover sets it), ``run``;
    ``layer`` is the :class:`Selection`'s (shared in an explorer).
    ``thumbnails``, ``heatmap`` and ``token_figure`` are the
    figure views (:class:`FigureView`), ``chips`` the token strip.
    """

    head = traitlets.Int(0)
    token = traitlets.Int(-1, help="the picked query token (-1: none)")
    run = traitlets.Instance(Run, allow_none=True, help="the Run on show")

    def __init__(
        self,
        run: Run | None = None,
        *,
        selection: Selection | None = None,
        n_layers: int | None = None,
        layer: int | None = None,
        head: int = 0,
        heads: Sequence[int] | None = None,
    ) -> None:
        if run is None and n_layers is None:
            raise ValueError("give a run to show, or n_layers= for one to come")
        self._patterns: torch.Tensor | None = None  # [layers read, heads, T, T]
        self._layers: list[int] = []
        self._heads: list[int] = []
        self._run_heads = None if heads is None else [int(h) for h in heads]
        self._tokens: list[str] = []
        self._n_prompt: int | None = None
        self._grid_of: torch.Tensor | None = None  # the patterns the thumbnails show
        self._holding = False  # several traits change as one pick: draw once, after
        if n_layers is None:
            t = run[0]
            n_layers = 1 + max(t.layers_read(PATTERN_SITE) if PATTERN_SITE in t.read_keys
                               else [0])
        self.selection = Selection(layer=0) if selection is None else selection
        if layer is not None:
            self.selection.layer = layer
        self.layer_picker = LayerPicker(n_layers, value=min(self.selection.layer, n_layers - 1))
        self._head = widgets.BoundedIntText(value=head, min=0, max=2**31 - 1,
                                            description="head", layout={"width": "150px"})
        self._note = widgets.HTML()
        self.thumbnails = figure_widget()
        self.heatmap = figure_widget()
        self.chips = TokenSpanPicker()
        self.token_figure = figure_widget()
        super().__init__([
            widgets.HBox([self.layer_picker, self._head, self._note],
                         layout={"flex_flow": "row wrap"}),
            widgets.HBox([self.thumbnails, self.heatmap], layout={"flex_flow": "row wrap"}),
            self.chips, self.token_figure,
        ])
        self.head = head
        widgets.link((self.layer_picker, "value"), (self.selection, "layer"))
        widgets.link((self._head, "value"), (self, "head"))
        self.chips.observe(self._guard(self._on_chip), names=["hovered", "selection"])
        self.selection.observe(self._guard(self._redraw), names=["layer"])
        self.observe(self._guard(self._redraw), names=["head"])
        self.observe(self._guard(self._on_token), names=["token"])
        self.observe(self._guard(self._on_run), names=["run"])
        self.run = run

    # -- data ------------------------------------------------------------------
    def show(
        self,
        patterns: Any,
        tokens: Sequence[str],
        *,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        n_prompt: int | None = None,
    ) -> None:
        """Show ``patterns`` ``[n_layers, n_heads, T, T]`` (attention
        probabilities, rows over keys) of ``tokens``; ``layers`` names the
        rows (default ``0..n_layers-1``), ``heads`` the heads (default
        ``0..n_heads-1``), ``n_prompt`` marks where generation starts."""
        p = torch.as_tensor(patterns, dtype=torch.float32)
        if p.dim() != 4 or p.shape[-2:] != (len(tokens), len(tokens)):
            raise ValueError(f"patterns has shape {list(p.shape)}; expected "
                             f"[layers, heads, {len(tokens)}, {len(tokens)}] "
                             f"for {len(tokens)} tokens")
        layers = list(range(p.shape[0])) if layers is None else [int(x) for x in layers]
        if len(layers) != p.shape[0]:
            raise ValueError(f"{len(layers)} layer names for {p.shape[0]} layers of patterns")
        heads = list(range(p.shape[1])) if heads is None else [int(h) for h in heads]
        if len(heads) != p.shape[1]:
            raise ValueError(f"{len(heads)} head names for {p.shape[1]} heads of patterns")
        self._patterns, self._layers, self._heads = p, layers, heads
        self._grid_of = None  # new patterns or names: the grid is built again
        self._tokens, self._n_prompt = [str(t) for t in tokens], n_prompt
        self._head.max = max(heads)
        with self._one_draw():
            if self.head not in heads:
                self.head = heads[0]
            if self.token >= len(tokens):
                self.token = -1
            if self.layer not in layers:
                self.layer = layers[0] if self.layer < layers[0] else layers[-1]
            self.chips.tokens = self._tokens
            self.chips.n_prompt = -1 if n_prompt is None else n_prompt

    def pattern(self) -> torch.Tensor:
        """The picked head's pattern ``[T, T]`` (queries, keys)."""
        if self._patterns is None:
            raise ValueError("nothing to show yet: set run= or call show()")
        if self.layer not in self._layers:
            raise ValueError(f"layer {self.layer} has no attention pattern in this run "
                             f"(read: {self._layers})")
        if self.head not in self._heads:
            raise ValueError(f"head {self.head} has no attention pattern in this run "
                             f"(read: {self._heads})")
        return self._patterns[stack_index(self._layers, self.layer), self._heads.index(self.head)]

    @property
    def layers(self) -> list[int]:
        """The layers whose patterns are on show."""
        return list(self._layers)

    @property
    def heads(self) -> list[int]:
        """The heads whose patterns are on show."""
        return list(self._heads)

    @property
    def tokens(self) -> list[str]:
        return list(self._tokens)

    # -- reactions -------------------------------------------------------------
    def _on_run(self, change) -> None:
        run = change["new"]
        if run is None:
            return
        t = run[0]
        if PATTERN_SITE not in t.read_keys:
            raise ValueError("this run did not read attention patterns: trace with "
                             "sites=['attn_pattern'] (layers=None for every layer)")
        self.show(t.activations(PATTERN_SITE), t.tokens, layers=t.layers_read(PATTERN_SITE),
                  heads=self._run_heads, n_prompt=len(t.prompt_token_ids))

    def _on_chip(self, change) -> None:
        if change["name"] == "hovered" and change["new"] >= 0:
            self.token = change["new"]
        elif change["name"] == "selection" and change["new"][1] > change["new"][0]:
            self.token = change["new"][0]

    def _on_token(self, change) -> None:
        if self._patterns is not None and not self._holding:
            self._draw_token()

    def _redraw(self, change) -> None:
        if not self._holding:
            self.replot()

    @contextmanager
    def _one_draw(self):
        """Traits set inside draw nothing; one :meth:`replot` after them."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        self.replot()

    def _on_thumbnail(self, trace, points, state) -> None:
        """A click on a thumbnail picks its (layer, head); one between
        thumbnails picks nothing."""
        if not points.point_inds:
            return
        picked = thumbnail_at(trace.meta, *points.point_inds[0])  # heatmap points are [row, col]
        if picked is None:
            return
        layer, head = picked
        with self._one_draw():
            self.head = head
            self.layer = layer

    def _on_cell(self, trace, points, state) -> None:
        """A click on a cell of the heatmap picks its query token."""
        if points.point_inds:
            self.token = int(points.point_inds[0][0])  # heatmap points are [row, col]

    # -- drawing ---------------------------------------------------------------
    def replot(self) -> None:
        """Redraw every figure from the patterns on show. The thumbnail grid
        is built once per set of patterns; a new pick moves its outline."""
        if self._patterns is None:
            return
        picked = (self.layer, self.head)
        if self._grid_of is not self._patterns:
            show_figure(self.thumbnails, attention_heads(
                self._patterns, self._layers, heads=self._heads, selected=picked))
            for trace in self.thumbnails.data:
                trace.on_click(self._guard(self._on_thumbnail))
            self._grid_of = self._patterns
        else:
            self.thumbnails.update_layout(shapes=thumbnail_outline(
                self._layers, self._heads, picked, tile=self.thumbnails.data[0].meta["tile"]))
        self._draw_token()
        self._note.value = (f"<small>layer {self.layer}, head {self.head}: click a thumbnail "
                            "to pick a head; hover a token to see where it attends</small>")

    def _draw_token(self) -> None:
        p = self.pattern()
        token = self.token if 0 <= self.token < len(self._tokens) else None
        show_figure(self.heatmap, attention_heatmap(
            p, self._tokens, token=token, n_prompt=self._n_prompt,
            title=f"layer {self.layer}, head {self.head}"))
        if self.heatmap.data:
            self.heatmap.data[0].on_click(self._guard(self._on_cell))
        if token is None:
            self.chips.shade = []
            show_figure(self.token_figure, attention_of_token(
                p, self._tokens, len(self._tokens) - 1,
                title="the last token (hover a token to pick another)"))
            return
        self.chips.shade = [float(v) if j <= token else 0.0
                            for j, v in enumerate(p[token].tolist())]
        show_figure(self.token_figure, attention_of_token(p, self._tokens, token))
