"""The logit lens as a widget: tokens down, layers across.

Two modes:

* ``"top"`` -- each cell the top next token at that layer, coloured by its
  probability, the top-k in the hover;
* ``"track"`` -- one chosen token's probability (or rank) at every layer
  and position: when does the model "know" it? Click a cell in ``"top"``
  mode to track its token, or type one.

The view draws a Run it is given. The top-k comes from the run (read in the
worker with ``trace(..., logit_lens=k)``) or, for a run that read the full
``resid_post`` instead, from an offline :class:`~vlens.lens.LogitLens`.
Tracking a token needs its probability everywhere, which a top-k read does
not have: with an offline lens and a full ``resid_post`` the view computes
it exactly (the final norm and unembedding applied here); without, it shows
the probability where the token is in the top-k and marks the other cells
"not in the top k" (a note says which). Where the run has both, the
worker's top-k gives each row's log-sum-exp, so an exact probability needs
only the tracked token's row of the unembedding; the rank still needs the
whole vocabulary's logits, computed when it is shown. Lens values are
computed once per run (and per tracked token); choosing layers or a span
only re-plots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets
import torch
import traitlets

from vlens.protocol.plan import read_key
from vlens.plots import lens_row_marks, lens_token_values, logit_lens_grid, logit_lens_track
from vlens.results import Run, Trace
from vlens.widgets._base import View, figure_widget, layers_spanned, show_figure
from vlens.widgets.pickers import LayerPicker
from vlens.widgets.selection import TOP_K, Selection

__all__ = ["LogitLensView"]

_LENS_KEY = read_key("resid_post", "logit_lens")



class LogitLensView(View):
    """Token x layer grid of the logit lens of a run's first trace.

    ``LogitLensView(run, token_strings=s.token_strings)``; ``tokenize``
    (``s.tokenize``) lets a typed word be tracked even when it appears
    nowhere in the run. ``offline_lens`` (a :class:`~vlens.lens.LogitLens`,
    or a function returning one, called at first need) lenses runs that
    read ``resid_post`` in full, and makes tracking exact.

    Traits: ``mode`` (``"top"`` / ``"track"``), ``track`` (the tracked
    token id, -1 for none), ``track_quantity`` (``"probability"`` /
    ``"rank"``), ``layer_range`` (inclusive ``(low, high)``), ``run``;
    the selection's ``span`` outlines token rows. ``figure`` is the
    figure view (:class:`FigureView`); ``track_source`` says where tracked values come from.
    """

    layer_range = traitlets.Tuple(traitlets.Int(), traitlets.Int())
    run = traitlets.Instance(Run, allow_none=True, help="the Run on show")
    mode = traitlets.Enum(("top", "track"), default_value="top")
    track = traitlets.Int(-1, help="the tracked token id (-1: none yet)")
    track_quantity = traitlets.Enum(("probability", "rank"), default_value="probability")
    track_source = traitlets.Unicode("", help="exact, or top-k only")

    def __init__(
        self,
        run: Run | None = None,
        *,
        token_strings: Callable[[Sequence[int]], list[str]],
        tokenize: Callable[[str], list[int]] | None = None,
        selection: Selection | None = None,
        offline_lens: Any = None,
        n_layers: int | None = None,
        layer_range: tuple[int, int] | None = None,
        mode: str = "top",
    ) -> None:
        if run is None and n_layers is None:
            raise ValueError("give a run to show, or n_layers= for one to come")
        n_layers = layers_spanned(run) if n_layers is None else n_layers
        self.selection = Selection() if selection is None else selection
        self.token_strings = token_strings
        self.tokenize = tokenize
        self._offline = offline_lens
        self._top: tuple[list[int], Any, Any, list] | None = None  # layers, ids, probs, words
        self._tracked: dict[tuple[int, str], tuple] = {}
        self._lse: tuple | None = None  # (the run's [L, T] log-sum-exp or None,) once known
        self.layer_picker = LayerPicker(
            n_layers, value=tuple(layer_range) if layer_range else (0, n_layers - 1),
            description="layers",
        )
        self._mode = widgets.ToggleButtons(
            options=[("top token", "top"), ("track a token", "track")], value=mode,
            style={"button_width": "110px"})
        self._word = widgets.Text(description="token", placeholder="a word, then Enter",
                                  continuous_update=False, layout={"width": "220px"})
        self._quantity = widgets.Dropdown(options=["probability", "rank"], description="show",
                                          layout={"width": "200px"})
        self._note = widgets.HTML()
        self._track_row = widgets.HBox([self._word, self._quantity])
        self.figure = figure_widget()
        super().__init__([
            widgets.HBox([self.layer_picker, self._mode], layout={"flex_flow": "row wrap"}),
            self._track_row, self._note, self.figure,
        ])
        self.layer_range = self.layer_picker.value
        self.mode = mode
        traitlets.link((self.layer_picker, "value"), (self, "layer_range"))
        traitlets.link((self._mode, "value"), (self, "mode"))
        traitlets.link((self._quantity, "value"), (self, "track_quantity"))
        self._word.observe(self._guard(lambda c: self.track_word(c["new"])), names="value")
        self.selection.observe(self._guard(self._on_span), names=["span"])
        self.observe(self._guard(self._redraw),
                     names=["layer_range", "mode", "track", "track_quantity"])
        self.observe(self._guard(self._on_run), names=["run"])
        self.run = run

    # -- data ------------------------------------------------------------------
    @property
    def offline_lens(self) -> Any:
        """The offline LogitLens (loaded at first use when given as a function)."""
        if callable(self._offline) and not hasattr(self._offline, "top"):
            try:
                self._offline = self._offline()
            except Exception:  # noqa: BLE001 -- no offline lens: top-k only, said in the note
                self._offline = None
        return self._offline

    @offline_lens.setter
    def offline_lens(self, lens: Any) -> None:
        self._offline = lens
        self._tracked.clear()
        self._lse = None

    def top_tokens(self, t: Trace) -> tuple[list[int], Any, Any]:
        """``(layers read, top ids [L, T, k], their probabilities [L, T, k])`` of ``t``."""
        if _LENS_KEY in t.read_keys:
            ids, probs = t.logit_lens("resid_post")
            return t.layers_read(_LENS_KEY), ids, probs
        if "resid_post" in t.read_keys and self.offline_lens is not None:
            ids, probs = self.offline_lens.top(t.activations("resid_post"), k=TOP_K)
            return t.layers_read("resid_post"), ids, probs
        raise ValueError(
            "this run has no logit lens to show: trace with logit_lens=5, or read "
            "resid_post in full and pass offline_lens=LogitLens.from_pretrained(model)"
        )

    def tracked_values(self, token_id: int, rank: bool = True
                       ) -> tuple[list[int], Any, Any, Any, str]:
        """``(layers, p [L, T], rank [L, T], floor [L, T] or None, source)`` of
        ``token_id`` in the shown run: exact from the offline lens where the
        run read ``resid_post`` in full, else from the top-k (NaN where the
        token is not among the k). ``rank=False`` may leave the exact rank
        None: it needs every row's whole-vocabulary logits, which the exact
        probability does not where the run also has the worker's top-k
        (each row's log-sum-exp follows from it, :meth:`LogitLens.logsumexp_from_top`)."""
        t = self.run[0]
        lens = self.offline_lens if "resid_post" in t.read_keys else None
        key = (int(token_id), "exact" if lens is not None else "top-k")
        if key not in self._tracked:
            if lens is not None:
                self._tracked[key] = self._exact(t, lens, int(token_id), rank)
            else:
                layers, ids, probs, _ = self._top
                p, ranks, floor = lens_token_values(ids, probs, token_id)
                self._tracked[key] = (layers, p, ranks, floor, f"top-{ids.shape[-1]}")
        elif rank and self._tracked[key][2] is None:
            self._tracked[key] = self._exact(t, lens, int(token_id), rank)
        return self._tracked[key]

    def _exact(self, t: Trace, lens: Any, token_id: int, rank: bool) -> tuple:
        layers = t.layers_read("resid_post")
        lse = None if rank else self._logsumexp(t, lens)
        if lse is not None:  # the token's own logit at every row, against the row's lse
            acts = t.activations("resid_post")
            mine = lens.token_logits(acts, torch.full((*acts.shape[:-1], 1), token_id))
            return layers, (mine[..., 0] - lse).exp(), None, None, "exact"
        p, ranks = [], []
        for acts in t.activations("resid_post"):  # one layer at a time: [T, vocab]
            probs = lens.logits(acts).softmax(-1)
            mine = probs[:, token_id]
            p.append(mine)
            ranks.append((probs > mine[:, None]).sum(-1).float() + 1)
        return layers, torch.stack(p), torch.stack(ranks), None, "exact"

    def _logsumexp(self, t: Trace, lens: Any) -> Any:
        """``[L, T]`` log-sum-exp of the offline lens's logits at every row
        the run read, from the run's own top-k where it has one that agrees
        (computed once per run); None otherwise."""
        if self._lse is None:
            self._lse = (None,)
            if (_LENS_KEY in t.read_keys
                    and t.layers_read(_LENS_KEY) == t.layers_read("resid_post")):
                ids, probs = t.logit_lens("resid_post")
                self._lse = (lens.logsumexp_from_top(t.activations("resid_post"), ids, probs),)
        return self._lse[0]

    def track_word(self, word: str) -> int:
        """Track ``word``: an id whose text is ``word`` among the run's tokens
        and predictions, else ``tokenize(word)``'s last id."""
        word = word.strip()
        if not word:
            return self.track
        known = {}
        if self._top is not None:
            ids = sorted({int(i) for i in self._top[1].reshape(-1).tolist()}
                         | {int(i) for i in self.run[0].token_ids})
            known = {s.strip(): i for i, s in zip(ids, self.token_strings(ids))}
        if word in known:
            token_id = known[word]
        elif self.tokenize is not None:
            token_id = int(self.tokenize(word)[-1])
        else:
            raise ValueError(f"{word!r} is not a token of this run or its predictions; "
                             "pass tokenize=s.tokenize to track any word")
        self.track = token_id
        self.mode = "track"
        return token_id

    def _on_run(self, change) -> None:
        self._top = None
        self._tracked.clear()
        self._lse = None
        if self.run is None:
            return
        t = self.run[0]
        read, ids, probs = self.top_tokens(t)
        flat = self.token_strings([int(i) for i in ids.reshape(-1)])
        n_tok, k = ids.shape[1], ids.shape[2]
        words = [[[flat[(r * n_tok + c) * k + j] for j in range(k)] for c in range(n_tok)]
                 for r in range(len(read))]
        self._top = (read, ids, probs, words)
        if self.track < 0:  # start with what the last layer says after the prompt
            self.track = int(ids[-1, len(t.prompt_token_ids) - 1, 0])
        self.replot()

    def _redraw(self, change) -> None:
        if change["name"] in ("track", "track_quantity") and self.mode != "track":
            return  # the top-token grid shows neither: a click sets track, then mode
        self.replot()

    def _on_span(self, change) -> None:
        """A new span moves the figure's outline; the grid stays as drawn."""
        if self._top is None or not self.figure.data:
            return
        t = self.run[0]
        self.figure.update_layout(
            shapes=lens_row_marks(self.span, len(t.prompt_token_ids), len(t.tokens)))

    def _on_click(self, trace, points, state) -> None:
        """A click on a cell of the top-token grid tracks that cell's token."""
        if self.mode != "top" or not points.point_inds or self._top is None:
            return
        row, col = points.point_inds[0]  # heatmap: (token row, layer column)
        layers = self._shown_rows()
        self.track = int(self._top[1][layers[col], row, 0])
        self.mode = "track"

    # -- drawing ---------------------------------------------------------------
    def _shown_rows(self) -> list[int]:
        read = self._top[0]
        lo, hi = self.layer_range
        rows = [i for i, layer in enumerate(read) if lo <= layer <= hi]
        if not rows:
            raise ValueError(f"no layer in {lo}..{hi} was read in this run (read: {read})")
        return rows

    def figure_now(self) -> Any:
        """The figure for the current settings (a ``go.Figure``)."""
        t = self.run[0]
        read, ids, probs, words = self._top
        rows = self._shown_rows()
        marks = {"span": self.span, "n_prompt": len(t.prompt_token_ids)}
        tracking = self.mode == "track" and self.track >= 0
        self._track_row.layout.display = "" if self.mode == "track" else "none"
        if not tracking:
            self.track_source = ""
            self._note.value = ("<small>click a cell to track its token across layers"
                                "</small>")
            return logit_lens_grid([words[i] for i in rows], probs[rows], t.tokens,
                                   [read[i] for i in rows], **marks)
        layers, p, rank, floor, source = self.tracked_values(
            self.track, rank=self.track_quantity == "rank")
        keep = [i for i, layer in enumerate(layers) if layer in {read[r] for r in rows}]
        word = self.token_strings([self.track])[0].strip()
        self.track_source = source
        self._note.value = (
            f"<small>tracking <b>{word}</b>: exact, from the full resid_post</small>"
            if source == "exact" else
            f"<small>tracking <b>{word}</b> from the {source} read only: cells marked – "
            "do not have it in their top k (trace with sites=['resid_post'] and pass "
            "offline_lens= for exact values)</small>")
        values = (p if self.track_quantity == "probability" else rank)[keep]
        return logit_lens_track(values, t.tokens, [layers[i] for i in keep], token=word,
                                quantity=self.track_quantity,
                                floor=None if floor is None else floor[keep],
                                k=int(ids.shape[-1]), **marks)

    def replot(self) -> None:
        if self._top is None:
            return
        show_figure(self.figure, self.figure_now())
        if self.figure.data:
            self.figure.data[0].on_click(self._guard(self._on_click))
