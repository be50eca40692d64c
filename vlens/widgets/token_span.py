"""The prompt as clickable token chips; the selection is a token span.

Click a chip to select that token; shift-click another to extend the
selection to the span between them. The selection is the synced trait
``selection = (start, stop)`` (stop exclusive; ``(0, 0)`` is "nothing"),
so Python sees every click and can set the selection too. ``hovered`` is
the last chip the pointer went over (views that follow the pointer, such
as the attention view, observe it), and ``shade`` (one value in 0..1 per
token, or empty) tints the chips, e.g. by where a token attends; ``roles``
(one per token, as ``Trace.roles``) colours them by the message they
belong to, with a key to the colours above the chips (:attr:`legend`).
Whitespace is drawn visibly (``·`` a space, ``↵`` a newline),
as every other view draws it (:func:`vlens.tokens.visible`). The front
end is ``token_span.js`` beside this file; Python never builds HTML.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import traitlets

from vlens.widgets._page import StartingWidget

__all__ = ["TokenSpanPicker"]

_HERE = Path(__file__).parent

#: the chip colours' key, in the order it is drawn: (css class, words).
#: token_span.js holds the same list.
LEGEND = (("role-system", "system"), ("role-user", "user"),
          ("role-assistant", "assistant"), ("role-other", "other role"),
          ("role-none", "template (no role)"), ("role-generated", "generated"))
_KNOWN = ("system", "user", "assistant", "generated")


def role_class(role: str | None) -> str:
    """The css class a chip of ``role`` gets (``role-none``: a template token)."""
    if not role:
        return "role-none"
    return f"role-{role if role in _KNOWN else 'other'}"


class TokenSpanPicker(StartingWidget):
    """Clickable tokens; ``selection`` is ``(start, stop)``.

    ``n_prompt`` marks where generation starts (chips from there on are
    drawn as generated); ``-1`` means every token is prompt.
    """

    _esm = _HERE / "token_span.js"
    _css = _HERE / "token_span.css"

    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    selection = traitlets.Tuple(
        traitlets.Int(), traitlets.Int(), default_value=(0, 0)
    ).tag(sync=True)
    n_prompt = traitlets.Int(-1).tag(sync=True)
    #: the last chip the pointer went over (-1: none yet)
    hovered = traitlets.Int(-1).tag(sync=True)
    #: a tint per chip, 0..1 (empty: no tint)
    shade = traitlets.List(traitlets.Float()).tag(sync=True)
    #: each chip's role (Trace.roles: "system", "user", "assistant",
    #: "generated" or None), drawn as the chip's colour (empty: none)
    roles = traitlets.List(traitlets.Unicode(allow_none=True)).tag(sync=True)

    def __init__(
        self,
        tokens: Sequence[str] = (),
        *,
        selection: tuple[int, int] = (0, 0),
        n_prompt: int = -1,
    ) -> None:
        super().__init__(tokens=[str(t) for t in tokens], n_prompt=int(n_prompt))
        self.selection = tuple(selection)

    @traitlets.validate("selection")
    def _check_selection(self, proposal):
        start, stop = (int(x) for x in proposal["value"])
        n = len(self.tokens)
        if not 0 <= start <= stop <= n:
            raise traitlets.TraitError(
                f"selection ({start}, {stop}) does not fit {n} tokens: "
                f"need 0 <= start <= stop <= {n}"
            )
        return (start, stop)

    @traitlets.observe("tokens")
    def _tokens_changed(self, change) -> None:
        # A new token list invalidates a selection that no longer fits.
        if self.selection[1] > len(change["new"]):
            self.selection = (0, 0)
        if self.hovered >= len(change["new"]):
            self.hovered = -1
        if self.shade and len(self.shade) != len(change["new"]):
            self.shade = []
        if self.roles and len(self.roles) != len(change["new"]):
            self.roles = []

    def select(self, start: int, stop: int | None = None) -> None:
        """Select token ``start`` (or ``[start, stop)``) from Python."""
        self.selection = (start, start + 1 if stop is None else stop)

    def clear(self) -> None:
        self.selection = (0, 0)

    @property
    def legend(self) -> list[tuple[str, str]]:
        """The key shown above the chips: ``(css class, words)`` for each
        kind of chip present (empty when the chips have no roles)."""
        present = {role_class(r) for r in self.roles}
        return [(cls, words) for cls, words in LEGEND if cls in present]

    @property
    def selected_tokens(self) -> list[str]:
        start, stop = self.selection
        return list(self.tokens[start:stop])
