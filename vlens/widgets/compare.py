"""Two Runs of the same prompts, side by side.

Any two: plain and ablated, baseline and steered, two models' answers.
For each prompt the view shows the prompt (a conversation as its
messages) and the two generated texts in two columns, with the first
generated token where they differ marked in both, and says in words where
that is. A Comparison's two runs: ``CompareView(cmp.baseline, cmp.steered)``.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets
import traitlets

from vlens.results import Run
from vlens.tokens import first_divergence
from vlens.widgets._base import Panel
from vlens.widgets.prompt_box import box_text

__all__ = ["CompareView", "asked", "compare_html"]

_CELL = ('<div style="flex:1;min-width:0;white-space:pre-wrap">'
         '<b>{label}</b><br>{body}</div>')
_MARK = '<mark style="background:#ffd5cc" title="first generated token that differs">'


def _marked(tokens: Sequence[str], at: int | None) -> str:
    """The generated tokens as text, the part from token ``at`` on marked."""
    if at is None or at >= len(tokens):
        return html.escape("".join(tokens))
    return (html.escape("".join(tokens[:at])) + _MARK
            + html.escape("".join(tokens[at:])) + "</mark>")


def compare_html(a: Sequence[str], b: Sequence[str], labels: Sequence[str],
                 at: int | None) -> str:
    """Two generated texts (``a``, ``b``: their tokens) side by side, each
    marked from ``at`` (the first differing token; None: they agree)."""
    cells = [_CELL.format(label=html.escape(label), body=_marked(tokens, at))
             for label, tokens in zip(labels, (a, b))]
    return '<div class="vlens-compare" style="display:flex;gap:1.5em">' + "".join(cells) + \
        "</div>"


def divergence_words(a: Sequence[str], b: Sequence[str], labels: Sequence[str],
                     at: int | None) -> str:
    """Where two generations part, in words."""
    if at is None:
        return f"the two replies are the same ({len(a)} tokens)"
    def token(tokens: Sequence[str]) -> str:
        return repr(tokens[at]) if at < len(tokens) else "the end"
    return (f"they part at generated token {at}: {labels[0]} {token(a)}, "
            f"{labels[1]} {token(b)}")


def asked(trace: Any) -> Any:
    """What ``trace``'s prompt asked: its text, or for a conversation its
    messages, rebuilt from the roles of its tokens (``Trace.roles``: runs
    of one role's content tokens, cut from ``prompt_text``)."""
    n = len(trace.prompt_token_ids)
    roles, spans = trace.roles[:n], trace.offsets[:n]
    if not any(roles) or len(spans) != n:
        return trace.prompt
    messages: list[dict[str, str]] = []
    last = None
    for i, role in enumerate(roles):
        if role is None:
            last = None
            continue
        if role != last:
            messages.append({"role": role, "start": spans[i][0]})
        messages[-1]["stop"] = spans[i][1]
        last = role
    text = trace.prompt_text
    return [{"role": m["role"], "content": text[m["start"]:m["stop"]].strip()}
            for m in messages]


class CompareView(Panel):
    """``CompareView(run_a, run_b, labels=("plain", "ablated"))``: the two
    runs' replies to each prompt side by side, the first divergence marked.

    ``index`` picks the prompt (a slider when there are several);
    ``divergence`` is where the shown pair parts (the index of the first
    generated token that differs, None when they agree). Both runs need the
    same number of prompts.
    """

    index = traitlets.Int(0, help="which prompt is shown")
    divergence = traitlets.Any(None, allow_none=True,
                               help="first generated token where the shown pair differs")

    def __init__(self, run_a: Run, run_b: Run, *,
                 labels: Sequence[str] = ("first", "second")) -> None:
        if len(run_a) != len(run_b):
            raise ValueError(f"the runs have {len(run_a)} and {len(run_b)} prompts: "
                             "compare runs of the same prompts")
        if len(labels) != 2:
            raise ValueError(f"labels= names the two runs, got {list(labels)!r}")
        self.runs = (run_a, run_b)
        self.labels = tuple(str(x) for x in labels)
        n = len(run_a)
        self._picker = widgets.IntSlider(0, min=0, max=max(n - 1, 0), description="prompt",
                                         continuous_update=False)
        self._picker.layout.display = "" if n > 1 else "none"
        self._prompt = widgets.Textarea(description="prompt", disabled=True,
                                        layout={"width": "90%"})
        self._where = widgets.Label()
        self._texts = widgets.HTML(layout={"width": "95%"})
        super().__init__([self._picker, self._prompt, self._texts, self._where])
        widgets.link((self._picker, "value"), (self, "index"))
        self.observe(self._guard(lambda _c: self._show()), names=["index"])
        self._show()

    @property
    def texts(self) -> tuple[str, str]:
        """The shown prompt's two generated texts."""
        return tuple(run[self.index].text for run in self.runs)

    def _show(self) -> None:
        a, b = (run[self.index] for run in self.runs)
        at = first_divergence(a.output_token_ids, b.output_token_ids)
        self.divergence = at
        self._prompt.value = box_text(asked(a))
        self._prompt.rows = min(8, self._prompt.value.count("\n") + 1)
        self._texts.value = compare_html(a.output_tokens, b.output_tokens, self.labels, at)
        self._where.value = divergence_words(a.output_tokens, b.output_tokens, self.labels, at)
