"""Direct logit attribution as a widget: which layers and heads write the
answer.

``AttributionView(session, prompt, answer, wrong)`` runs
``session.logit_attribution`` on one prompt and shows the result's figure
(per layer, the attention and MLP parts as bars; the layer x head
heatmap); click a head cell to read what that head writes, beside its
layer's attention total. ``AttributionView(attribution)`` shows a finished
:class:`vlens.Attribution`. The explorer's *DLA* tab is one of these, on
the traced prompt with its first generated token as the answer.

Kernel-side state: ``attribution`` (the result on show) and ``head``
``(layer, head)`` (``(-1, -1)``: none picked).
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.widgets._base import Panel, figure_widget, show_figure
from vlens.widgets.prompt_box import box_prompt, box_text, prompt_box

__all__ = ["AttributionView", "token_box"]


def token_box(value: Any, description: str) -> widgets.Text:
    """A box for an answer token: its text as typed (an id shows as digits)."""
    return widgets.Text("" if value is None else str(value), description=description,
                        layout={"width": "30%"})


def _token(text: str) -> Any:
    """A typed answer: digits are a token id, anything else the token's text
    (as typed, spaces kept: ``" cat"`` is not ``"cat"``); empty is None."""
    if not text.strip():
        return None
    return int(text) if text.strip().isdigit() else text


class AttributionView(Panel):
    """The direct logit attribution of one prompt's answer, by layer and head.

    ``AttributionView(session, prompt, answer, wrong=None, position=-1)``
    runs ``session.logit_attribution`` (the attribute button runs it again
    with the boxes' values); ``AttributionView(attribution)`` shows a result.
    Traits: ``attribution``, ``head`` ``(layer, head)`` (``(-1, -1)``: none);
    ``figure`` is the figure view (:class:`FigureView`).
    """

    attribution = traitlets.Any(None, allow_none=True, help="the Attribution on show")
    head = traitlets.Tuple(traitlets.Int(), traitlets.Int(), default_value=(-1, -1))

    def __init__(self, session: Any, prompt: Any = None, answer: Any = None,
                 wrong: Any = None, *, position: int = -1, auto_run: bool = True) -> None:
        result = None
        self.session = None
        if hasattr(session, "logit_attribution"):
            self.session = session
        else:
            result = session
        self.position = position
        self._prompt = prompt_box(prompt, "prompt", "90%")
        self._answer = token_box(answer, "answer")
        self._wrong = token_box(wrong, "wrong")
        self._run_button = widgets.Button(description="attribute", icon="play",
                                          button_style="primary")
        self._summary = widgets.HTML()
        self._picked = widgets.HTML()
        self.figure = figure_widget(height=640)
        inputs = ([self._prompt, widgets.HBox([self._answer, self._wrong, self._run_button])]
                  if self.session is not None else [])
        super().__init__([*inputs, self._summary, self.figure, self._picked])
        self._run_button.on_click(lambda _b: self.start())
        self.observe(self._guard(lambda _c: self.replot()), names=["attribution"])
        self.observe(self._guard(lambda _c: self._show_head()), names=["head"])
        if result is not None:
            self.attribution = result
        elif self.session is not None and auto_run and prompt and answer is not None:
            self._guard(self.run)()

    def set_prompt(self, prompt: Any, answer: Any = None, wrong: Any = None) -> None:
        """Use ``prompt`` (and ``answer``, ``wrong`` when given) for the next run."""
        self._prompt.value = box_text(prompt)
        if answer is not None:
            self._answer.value = str(answer)
        if wrong is not None:
            self._wrong.value = str(wrong)

    # -- engine ----------------------------------------------------------------
    def run(self, prompt: Any = None, answer: Any = None, wrong: Any = None) -> Any:
        """Attribute ``answer`` (against ``wrong``) on ``prompt`` (default:
        the boxes) and show it. Returns the Attribution. (The attribute
        button does it in the background: ``view.wait()``.)"""
        return self._call("attribute", self._attribute, prompt, answer, wrong)

    def start(self) -> None:
        """What the attribute button does: run with the boxes' values, in the
        background (the latest run wins; ``view.wait()`` waits for it)."""
        self._start("attribute", self._attribute)

    def _attribute(self, prompt: Any = None, answer: Any = None, wrong: Any = None) -> Any:
        if self.session is None:
            raise ValueError("this view was given a result, not a session: "
                             "AttributionView(session, prompt, answer) runs it")
        if prompt is not None or answer is not None or wrong is not None:
            self.set_prompt(prompt if prompt is not None else box_prompt(self._prompt.value),
                            answer, wrong)
        answer = _token(self._answer.value)
        if not self._prompt.value.strip() or answer is None:
            raise ValueError("type a prompt and an answer token first (the wrong token "
                             "is optional)")
        with self._working("attributing…"):
            a = self.session.logit_attribution(box_prompt(self._prompt.value), answer=answer,
                                               wrong=_token(self._wrong.value),
                                               position=self.position)
        with self._publishing():
            self.head = (-1, -1)
            self.attribution = a
        return a

    # -- what a head writes ------------------------------------------------------
    def head_values(self) -> Any:
        """The shown prompt's head components, ``[layers, heads]`` (a frame's
        pivot: rows are layers, columns heads)."""
        frame = self.attribution.to_frame()
        heads = frame[(frame["prompt"] == 0) & (frame["component"] == "head")]
        return heads.pivot(index="layer", columns="head", values="value")

    def head_text(self) -> str:
        """What the picked head writes, in words (empty when none is picked)."""
        layer, head = self.head
        if layer < 0:
            return ""
        frame = self.attribution.to_frame()
        mine = frame[(frame["prompt"] == 0) & (frame["layer"] == layer)]
        value = float(mine[(mine["component"] == "head") & (mine["head"] == head)]["value"].iloc[0])
        attn = float(mine[mine["component"] == "attn"]["value"].iloc[0])
        total = float(self.attribution.total[0])
        return (f"layer {layer}, head {head} writes {value:+.4f} directly to the logit "
                f"difference (its layer's attention: {attn:+.4f}; every component: "
                f"{total:+.4f})")

    # -- drawing ---------------------------------------------------------------
    def replot(self) -> None:
        a = self.attribution
        if a is None:
            return
        show_figure(self.figure, a.figure(0))
        for trace in self.figure.data:
            if trace.type == "heatmap":
                trace.on_click(self._guard(self._on_click))
        frame = a.to_frame()
        parts = frame[(frame["prompt"] == 0) & (frame["component"] != "head")]
        top = parts.reindex(parts["value"].abs().sort_values(ascending=False).index)[:3]
        named = ", ".join(
            f"{c}{'' if c in ('embed', 'bias') else ' ' + str(int(layer))} {v:+.3f}"
            for c, layer, v in zip(top["component"], top["layer"], top["value"]))
        self._summary.value = (
            f"<small>{html.escape(repr(a))}<br>largest direct writers: "
            f"{html.escape(named)}. Click a head cell to read it.</small>")
        self._show_head()

    def _on_click(self, trace, points, state) -> None:
        if points.point_inds:
            row, col = points.point_inds[0]  # heatmap points are [row, col]
            layers = list(self.head_values().index)
            self.head = (int(layers[int(row)]), int(col))

    def _show_head(self) -> None:
        self._picked.value = f"<b>{html.escape(self.head_text())}</b>" if self.attribution \
            is not None else ""
