"""Switch the session's clone reads and show what the last run copied.

``session.clone_reads = True`` makes the workers hand back copies of what
they read instead of views into engine memory (notebook 04 shows why that
matters and what it costs). The switch takes effect on the next run; the
label reports ``run.copied_bytes`` of the last run this widget was shown.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import traitlets

__all__ = ["CloneReadsToggle", "format_bytes"]


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class CloneReadsToggle(widgets.HBox):
    """A toggle bound to ``session.clone_reads`` and a copied-bytes label.

    ``value`` mirrors the session's setting; ``copied_bytes`` is what the last
    run shown with :meth:`show_run` copied (``-1`` before any run).
    """

    value = traitlets.Bool(False)
    copied_bytes = traitlets.Int(-1)

    def __init__(self, session: Any) -> None:
        self.session = session
        self._ran_with = False
        self._button = widgets.ToggleButton(
            description="clone reads",
            icon="copy",
            tooltip="hand back copies of engine memory instead of views (next run)",
        )
        self._label = widgets.Label("no run yet")
        super().__init__(children=[self._button, self._label])
        self.value = session.clone_reads
        self._button.value = self.value
        self._button.observe(self._from_button, names="value")
        self.observe(self._apply, names="value")

    def _from_button(self, change) -> None:
        self.value = change["new"]

    def _apply(self, change) -> None:
        self.session.clone_reads = bool(change["new"])
        self._button.value = change["new"]
        self._describe()

    def show_run(self, run: Any) -> None:
        """Show what ``run`` (a Run) copied."""
        self._ran_with = self.session.clone_reads
        self.copied_bytes = run.copied_bytes
        self._describe()

    def _describe(self) -> None:
        if self.copied_bytes < 0:
            self._label.value = "no run yet"
            return

        def word(flag: bool) -> str:
            return "on" if flag else "off"

        text = (
            f"last run copied {format_bytes(self.copied_bytes)} "
            f"(clone reads {word(self._ran_with)})"
        )
        if self.value != self._ran_with:
            text += f"; next run: clone reads {word(self.value)}"
        self._label.value = text
