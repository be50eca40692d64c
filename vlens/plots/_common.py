"""What every builder shares: literal token labels and the marks (span
outline, prompt|generated line) drawn over token axes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from vlens.tokens import visible

SPAN_LINE = {"color": "#d62728", "width": 2}


def plain_text(text: str) -> str:
    """``text`` as plotly shows it literally: plotly reads ``<b>``, ``<s>``,
    ``<br>`` … in labels as markup, so a ``<s>`` token would vanish."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def token_text(token: str) -> str:
    """A token as every view draws it: whitespace visible
    (:func:`vlens.tokens.visible`), markup-escaped (:func:`plain_text`)."""
    return plain_text(visible(str(token)))


def token_labels(tokens: Sequence[str]) -> list[str]:
    """``["0:the", "1:·cat", …]``: unique category labels for tokens (plotly
    merges identical categories), whitespace visible and markup-escaped
    (:func:`token_text`)."""
    return [f"{i}:{token_text(t)}" for i, t in enumerate(tokens)]


def as_float(values: Any) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32)


def nan_list(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def span_shape(span: tuple[int, int] | None, n: int) -> list[dict]:
    """An outline of token columns ``[start, stop)`` (none for an empty span)."""
    if span is None or span[1] <= span[0]:
        return []
    start, stop = max(0, span[0]), min(n, span[1])
    return [
        {
            "type": "rect",
            "xref": "x",
            "yref": "paper",
            "x0": start - 0.5,
            "x1": stop - 0.5,
            "y0": 0,
            "y1": 1,
            "line": SPAN_LINE,
            "name": "span",
        }
    ]


def prompt_boundary(n_prompt: int | None, n: int) -> list[dict]:
    """A dotted line where generation starts (none when it does not show)."""
    if n_prompt is None or not 0 < n_prompt < n:
        return []
    return [
        {
            "type": "line",
            "xref": "x",
            "yref": "paper",
            "x0": n_prompt - 0.5,
            "x1": n_prompt - 0.5,
            "y0": 0,
            "y1": 1,
            "line": {"color": "white", "width": 2, "dash": "dot"},
            "name": "prompt|generated",
        }
    ]

