"""Branch a generation by clicking: what if this token had gone the other way?

``BranchView(s, prompt)`` runs the prompt (``s.branches(prompt, at=[])``:
the run as it went and the top-k alternatives at every generated position)
and shows its tokens as chips, each token's probability on hover. Click a
token: its alternatives appear as buttons (for a branch's own tokens, one
small engine call finds them). Click one: the branch grows
(``s.continue_from``, in the background) and joins the tree of branches;
any two runs sit side by side with their first difference marked. With a
``steer=``, a toggle steers each new branch from its branch point on.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.results.branches import Alternative, Branches, branch_label
from vlens.results.run import Trace
from vlens.tokens import first_divergence, visible
from vlens.widgets._base import Panel
from vlens.widgets._page import StartingWidget
from vlens.widgets.compare import compare_html, divergence_words

__all__ = ["BranchTokens", "BranchView"]


class BranchTokens(StartingWidget):
    """A generation's tokens as chips (``branches.js``): ``probs`` on hover,
    ``start`` the first token a branch made (drawn outlined), ``clicked`` the
    last chip clicked (-1: none)."""

    _esm = Path(__file__).parent / "branches.js"

    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    probs = traitlets.List(traitlets.Float(allow_none=True)).tag(sync=True)
    start = traitlets.Int(0).tag(sync=True)
    clicked = traitlets.Int(-1).tag(sync=True)

    def _snapshot_html(self, render: Any) -> str:
        chips = "".join(
            f"<span class='vl-chip' title='p {p:.3f}'>{html.escape(visible(t))}</span>"
            if p is not None else f"<span class='vl-chip'>{html.escape(visible(t))}</span>"
            for t, p in zip(self.tokens, self.probs))
        return f"<div class='vl-chips'>{chips}</div>" if chips else ""


def _pieces(tokenizer: Any, trace: Trace) -> list[str]:
    """Each generated token's text as it reads in the whole text (a word
    tokenizer's tokens carry no spaces; its decoded text does)."""
    ids, n0 = trace.prompt_token_ids + trace.output_token_ids, len(trace.prompt_token_ids)
    texts = [tokenizer.decode(ids[:i], skip_special_tokens=True)
             for i in range(n0, len(ids) + 1)]
    return [b[len(a):] if b.startswith(a) else tok
            for a, b, tok in zip(texts, texts[1:], trace.output_tokens)]


def _probs(trace: Trace) -> list[float | None]:
    n0 = len(trace.prompt_token_ids)
    lps = trace.logprobs[n0:] if trace.logprobs else [None] * len(trace.output_token_ids)
    return [None if lp is None else math.exp(lp) for lp in lps]


class BranchView(Panel):
    """``BranchView(s, prompt, k=3, max_new_tokens=16, steer=None, **sampling)``.

    ``traces``: the run as it went, then every branch grown, in order;
    ``shown`` the one whose tokens are the chips, ``token`` the clicked
    position (-1: none), ``pair`` the two runs side by side and
    ``divergence`` where they part. :meth:`grow` grows a branch from Python
    (what clicking an alternative does)."""

    shown = traitlets.Int(0, help="index in traces of the run whose tokens are shown")
    token = traitlets.Int(-1, help="the clicked generated position (-1: none)")
    pair = traitlets.Tuple(traitlets.Int(), traitlets.Int(), default_value=(0, 0))
    divergence = traitlets.Any(None, allow_none=True)

    def __init__(self, session: Any, prompt: Any, *, k: int = 3, max_new_tokens: int = 16,
                 steer: Any = None, **sampling: Any) -> None:
        self.session, self.k, self.max_new_tokens = session, k, max_new_tokens
        self.steer, self.sampling = steer, dict(sampling)
        self.result: Branches = session.branches(prompt, [], k=k, max_new_tokens=max_new_tokens,
                                                 **sampling)
        self.traces: list[Trace] = [self.result.original]
        self._parent: list[int | None] = [None]
        self._alts: dict[tuple[int, int], list[Alternative]] = {
            (0, p): alts for p, alts in enumerate(self.result.alternatives)}
        self.chips = BranchTokens()
        self._tree = widgets.Select(description="branches", rows=6, layout={"width": "70%"})
        self._text = widgets.HTML(layout={"width": "95%"})
        self._text.add_class("vlens-branch-text")
        self._token_label = widgets.Label("click a token: the tokens the model could have taken")
        self.alternative_buttons = widgets.HBox(layout={"flex_flow": "row wrap"})
        self.alternative_buttons.add_class("vlens-branch-alternatives")
        self._steer_box = widgets.Checkbox(value=False, description="steer from the branch point",
                                           indent=False, disabled=steer is None)
        self._a = widgets.Dropdown(description="left")
        self._b = widgets.Dropdown(description="right")
        self._side = widgets.HTML(layout={"width": "95%"})
        self._where = widgets.Label()
        super().__init__([self._tree, self.chips, self._text, self._token_label,
                          self.alternative_buttons, self._steer_box,
                          widgets.HBox([self._a, self._b]), self._side, self._where])
        self._tree.observe(self._guard(lambda c: c["new"] is None or setattr(
            self, "shown", c["new"])), names="value")
        self.observe(self._guard(lambda _c: self._show()), names="shown")
        self.chips.observe(self._guard(lambda c: setattr(self, "token", c["new"])),
                           names="clicked")
        self.observe(self._guard(lambda c: c["new"] < 0 or self._start(
            "alternatives", self._show_token)), names="token")
        for box in (self._a, self._b):
            box.observe(self._guard(lambda _c: self._pick_pair()), names="value")
        self.observe(self._guard(lambda _c: self._show_pair()), names="pair")
        self._refresh()
        self._pick_pair()
        self._show_pair()

    @property
    def steered(self) -> bool:
        """Whether new branches are steered from their branch point."""
        return self._steer_box.value

    @steered.setter
    def steered(self, value: bool) -> None:
        self._steer_box.value = bool(value)

    # -- growing ------------------------------------------------------------------
    def alternatives(self, position: int, trace: int | None = None) -> list[Alternative]:
        """The top-k tokens other than the one taken at generated ``position``
        of trace ``trace`` (None: the shown one); a branch's own tokens cost
        one small engine call (the first time)."""
        return self._call("alternatives", self._alternatives, self.shown if trace is None
                          else trace, position)

    def grow(self, position: int, token: Any, trace: int | None = None) -> Trace:
        """Grow a branch of trace ``trace`` (None: the shown one) at generated
        ``position`` with ``token`` (text or id), show it, and return it."""
        return self._call("grow", self._grow, self.shown if trace is None else trace,
                          position, token)

    def _alternatives(self, ti: int, position: int) -> list[Alternative]:
        trace = self.traces[ti]
        if not 0 <= position < len(trace.output_token_ids):
            raise ValueError(f"position {position} is not a generated position of this run "
                             f"(0 to {len(trace.output_token_ids) - 1})")
        key = (ti, position)
        parent = self._parent[ti]
        if key not in self._alts and parent is not None and position < trace.branch_point:
            self._alts[key] = self._alternatives(parent, position)  # the shared prefix
        if key not in self._alts:
            ids = trace.prompt_token_ids + trace.output_token_ids[:position]
            probe = self.session.branches({"prompt_token_ids": ids}, [], k=self.k + 1,
                                          max_new_tokens=1, **self.sampling)
            taken = trace.output_token_ids[position]
            self._alts[key] = [a for a in probe.alternatives[0] if a.id != taken][:self.k]
        return self._alts[key]

    def _grow(self, ti: int, position: int, token: Any) -> Trace:
        steer = self.steer if self.steered else None
        made = self.session.continue_from(self.traces[ti], position, token,
                                          max_new_tokens=self.max_new_tokens, steer=steer,
                                          steer_from="branch", **self.sampling)
        with self._publishing():
            self.traces.append(made)
            self._parent.append(ti)
            self._refresh()
            self.shown = len(self.traces) - 1
            self._a.value, self._b.value = ti, len(self.traces) - 1
        return made

    # -- drawing ------------------------------------------------------------------
    def _order(self) -> list[tuple[int, int]]:
        """(trace index, depth) in tree order: each branch under the run it left."""
        out: list[tuple[int, int]] = []

        def walk(i: int, depth: int) -> None:
            out.append((i, depth))
            for j, parent in enumerate(self._parent):
                if parent == i:
                    walk(j, depth + 1)

        walk(0, 0)
        return out

    def label(self, i: int) -> str:
        t = self.traces[i]
        if t.branch_point is None:
            return "as it went"
        lp = t.logprobs[len(t.prompt_token_ids) + t.branch_point] if t.logprobs else None
        p = "" if lp is None else f" (p {math.exp(lp):.3f})"
        steered = " steered" if t.steered_rows else ""
        return f"{branch_label(t)}{p}{steered}"

    def _refresh(self) -> None:
        options = [("\u2003" * d + ("\u2514 " if d else "") + self.label(i), i)
                   for i, d in self._order()]
        self._tree.options = options
        self._tree.value = self.shown
        flat = [(self.label(i), i) for i in range(len(self.traces))]
        for box in (self._a, self._b):
            value = box.value
            box.options = flat
            box.value = value if value is not None and value < len(flat) else 0
        self._show()

    def _show(self) -> None:
        t = self.traces[self.shown]
        if self._tree.value != self.shown:
            self._tree.value = self.shown
        self.chips.tokens = list(t.output_tokens)
        self.chips.probs = _probs(t)
        self.chips.start = t.branch_point or 0
        self.chips.clicked = -1
        self._text.value = ('<div style="white-space:pre-wrap">'
                            f"<b>{html.escape(self.label(self.shown))}</b><br>"
                            f"{html.escape(t.text)}</div>")
        self.alternative_buttons.children = ()
        self._token_label.value = "click a token: the tokens the model could have taken"

    def _show_token(self) -> None:
        position = self.token
        if position < 0:
            return
        alts = self._alternatives(self.shown, position)
        ti = self.shown
        with self._publishing():
            taken = self.traces[ti].output_tokens[position]
            self._token_label.value = (f"generated token {position} {visible(taken)!r}: "
                                       "click another to grow a branch")
            buttons = []
            for alt in alts:
                b = widgets.Button(description=f"{visible(alt.token)!r} {alt.probability:.3f}",
                                   tooltip=f"grow a branch with token {alt.id}",
                                   layout={"width": "auto"})
                b.on_click(lambda _b, a=alt.id, p=position, i=ti: self._queue(
                    "grow", self._grow, i, p, a))
                buttons.append(b)
            self.alternative_buttons.children = tuple(buttons)

    def _pick_pair(self) -> None:
        if self._a.value is not None and self._b.value is not None:
            self.pair = (self._a.value, self._b.value)

    def _show_pair(self) -> None:
        a, b = (self.traces[i] for i in self.pair)
        at = first_divergence(a.output_token_ids, b.output_token_ids)
        self.divergence = at
        labels = [self.label(i) for i in self.pair]
        tok = self.session.tokenizer
        self._side.value = compare_html(_pieces(tok, a), _pieces(tok, b), labels, at)
        self._where.value = divergence_words(a.output_tokens, b.output_tokens, labels, at)

    @property
    def texts(self) -> Sequence[str]:
        """Every run's text, in ``traces`` order."""
        return [t.text for t in self.traces]
