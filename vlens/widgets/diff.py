"""A model diff, prompt by prompt: what each model wrote and where they part.

``DiffView(d)`` for a :class:`~vlens.results.diff.Diff`: the base's and the
tuned model's texts of one prompt as token rows, each token coloured by
KL(tuned || base) after it (both models reading that text), the first
token where the continuations part outlined; below, one text's layer x
token heatmap of the activation difference (its norm, or the cosine of
the two activations) at a site. Nothing here runs an engine.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.plots import diff_texts
from vlens.results.diff import Diff
from vlens.tokens import first_divergence
from vlens.widgets._base import Panel, figure_widget, show_figure

__all__ = ["DiffView"]


class DiffView(Panel):
    """``DiffView(d)``: prompt ``index`` (a slider when there are several),
    both texts coloured by KL, and ``text``'s heatmap of the activation
    difference at ``site`` (``what``: ``"norm"`` or ``"cosine"``).
    ``divergence``: the first generated token where the shown pair parts
    (None: they agree, or the diff generated nothing)."""

    index = traitlets.Int(0, help="which prompt is shown")
    text = traitlets.Unicode("tuned", help="the text whose heatmap is shown")
    site = traitlets.Unicode("resid_post", help="the site of the heatmap")
    what = traitlets.Unicode("norm", help="'norm' of tuned - base, or 'cosine'")
    divergence = traitlets.Any(None, allow_none=True,
                               help="first generated token where the shown texts differ")

    def __init__(self, d: Diff, *, labels: tuple[str, str] = ("base", "tuned")) -> None:
        if not isinstance(d, Diff):
            raise TypeError(f"DiffView shows a vlens Diff (vlens.diff(...)), got "
                            f"{type(d).__name__}")
        self.diff = d
        self.labels = tuple(str(x) for x in labels)
        kinds = [k for k in ("tuned", "base", "prompt") if k in d.texts[0]]
        n = len(d)
        self._picker = widgets.IntSlider(0, min=0, max=max(n - 1, 0), description="prompt",
                                         continuous_update=False)
        self._picker.layout.display = "" if n > 1 else "none"
        self._text = widgets.Dropdown(options=kinds, value=kinds[0], description="heatmap of")
        self._site = widgets.Dropdown(options=list(d.sites), value=d.sites[0],
                                      description="site")
        self._what = widgets.ToggleButtons(options=["norm", "cosine"], value="norm")
        self._where = widgets.Label()
        self.texts_figure = figure_widget()
        self.heatmap = figure_widget()
        super().__init__([self._picker, self.texts_figure, self._where,
                          widgets.HBox([self._text, self._site, self._what]), self.heatmap])
        self.text, self.site = kinds[0], d.sites[0]
        widgets.link((self._picker, "value"), (self, "index"))
        widgets.link((self._text, "value"), (self, "text"))
        widgets.link((self._site, "value"), (self, "site"))
        widgets.link((self._what, "value"), (self, "what"))
        self.observe(self._guard(lambda _c: self._show()), names=["index"])
        self.observe(self._guard(lambda _c: self._show_heatmap()),
                     names=["text", "site", "what"])
        self._show()

    def _show(self) -> None:
        d, i = self.diff, self.index
        held = d.texts[i]
        if "base" in held:
            a, b = held["base"], held["tuned"]
            n = a.n_prompt
            at = first_divergence(a.ids[n:], b.ids[n:])
            self.divergence = at
            show_figure(self.texts_figure, diff_texts(
                [a.tokens, b.tokens], [a.kl.tolist(), b.kl.tolist()],
                [f"{self.labels[0]}'s text", f"{self.labels[1]}'s text"], n_prompt=n,
                divergence=None if at is None else n + at,
                title=f"prompt {i}: each model's continuation, coloured by KL(tuned ‖ base)"))
            self._where.value = _where(a.tokens[n:], b.tokens[n:], self.labels, at)
        else:
            t = held["prompt"]
            self.divergence = None
            show_figure(self.texts_figure, diff_texts(
                [t.tokens], [t.kl.tolist()], ["prompt"],
                title=f"prompt {i}, coloured by KL(tuned ‖ base) after each token"))
            self._where.value = (f"largest KL {float(t.kl.max()):.3f} after token "
                                 f"{int(t.kl.argmax())} ({t.tokens[int(t.kl.argmax())]!r})")
        self._show_heatmap()

    def _show_heatmap(self) -> None:
        show_figure(self.heatmap, self.diff.figure(self.index, text=self.text, site=self.site,
                                                   what=self.what))


def _where(a: Any, b: Any, labels: tuple[str, ...], at: int | None) -> str:
    """Where two continuations part, in words."""
    if at is None:
        return f"the two continuations are the same ({len(a)} tokens)"

    def token(tokens: Any) -> str:
        return repr(tokens[at]) if at < len(tokens) else "the end"
    return (f"they part at generated token {at}: {labels[0]} {token(a)}, "
            f"{labels[1]} {token(b)}")
