"""The notebooks in notebooks/ are the ones the docs name, stored clean.

That every notebook runs top to bottom is tests/test_run_all.py's job: it
runs each with Run All in JupyterLab, as a class does, and fails on a cell
that raises, an error output, a widget that reports an error, or a view
that did not draw (``VLENS_NOTEBOOK_MODEL=/path/to/model`` runs them on
another local model there).
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_tour.ipynb", "02_steering.ipynb", "03_token_axis.ipynb",
                     "04_clone_reads.ipynb", "05_patching.ipynb", "06_attention.ipynb",
                     "07_chat.ipynb", "08_features.ipynb", "09_circuits.ipynb",
                     "10_what_if.ipynb", "11_real_model.ipynb", "12_real_features.ipynb"]
    for p in NOTEBOOKS:  # stored clean: outputs are made by running them
        book = nbformat.read(p, as_version=4)
        assert all(not c.get("outputs") for c in book.cells if c.cell_type == "code"), p.name
