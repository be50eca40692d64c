"""Helpers shared by the tests that run the notebooks (tests/test_run_all.py
and tests/test_browser.py); imported as ``_helpers`` (pytest puts tests/ on
the path)."""

from __future__ import annotations

import os
import re

import pytest


def notebook_model() -> str | None:
    """The model the notebooks run on: ``VLENS_NOTEBOOK_MODEL``, or None for
    the bundled one (skips when neither is there)."""
    model = os.environ.get("VLENS_NOTEBOOK_MODEL")
    if model:
        return model
    from vlens.models import toyworld_path

    try:
        toyworld_path()
    except FileNotFoundError as exc:
        pytest.skip(f"no bundled model to run the notebooks on: {exc}")
    return None


def set_parameters(book, model: str | None) -> None:
    """Point the notebook's one ``parameters`` cell at ``model`` (None: leave it)."""
    cells = [c for c in book.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, "each notebook has one cell tagged 'parameters'"
    if model is not None:
        cells[0].source = re.sub(r"^MODEL = .*$", f"MODEL = {model!r}", cells[0].source,
                                 flags=re.MULTILINE)


def wcag_contrast(a: str, b: str) -> float:
    """The WCAG contrast ratio of two CSS colours (``#rrggbb`` or
    ``rgb(r, g, b)``), written out here apart from vlens's own, as the
    tests' reference."""
    def luminance(colour: str) -> float:
        if colour.startswith("rgb"):
            vals = [float(v) for v in re.findall(r"[\d.]+", colour)[:3]]
        else:
            c = colour.lstrip("#")
            vals = [int(c[i:i + 2], 16) for i in (0, 2, 4)]
        lin = [(v / 255) / 12.92 if v / 255 <= 0.04045 else ((v / 255 + 0.055) / 1.055) ** 2.4
               for v in vals]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)
