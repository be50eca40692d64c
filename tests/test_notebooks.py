"""Every notebook in notebooks/ runs top to bottom on the bundled model.

Each notebook runs in its own kernel started from this Python (the venv), so
it starts one engine and shares it across its cells. A cell that raises, an
error output, or a widget that reports an error fails the test.

``VLENS_NOTEBOOK_MODEL=/path/to/model`` runs them on another local model
(injected into each notebook's ``parameters`` cell), for example a tiny
random one while the bundled model is rebuilt.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from _helpers import notebook_model, set_parameters

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds; an engine start on a busy 2-core machine is the slow cell

pytestmark = pytest.mark.engine


def _text(output) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    data = output.get("data", {})
    return data.get("text/plain", "")


def run_notebook(path: Path, model: str | None):
    book = nbformat.read(path, as_version=4)
    set_parameters(book, model)
    client = nbclient.NotebookClient(
        book,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        allow_errors=False,
    )
    client.execute()
    return book


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_tour.ipynb", "02_steering.ipynb", "03_token_axis.ipynb",
                     "04_clone_reads.ipynb", "05_patching.ipynb", "06_attention.ipynb",
                     "07_chat.ipynb", "08_features.ipynb"]
    for p in NOTEBOOKS:  # stored clean: outputs are made by running them
        book = nbformat.read(p, as_version=4)
        assert all(not c.get("outputs") for c in book.cells if c.cell_type == "code"), p.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    model = notebook_model()
    if "steering" in path.name or "clone" in path.name:
        import vlens

        if not hasattr(vlens, "Steer"):
            pytest.skip("the steering API (vlens.Steer) has not landed")
    if "patching" in path.name or "attention" in path.name:
        import vlens

        if not hasattr(vlens, "Ablate") or not hasattr(vlens.Session, "patch"):
            pytest.skip("the ablation and patching API (vlens.Ablate, Session.patch) "
                        "has not landed")
    assert sys.executable  # the kernel is this interpreter's ipykernel
    t0 = time.perf_counter()
    book = run_notebook(path, model)
    took = time.perf_counter() - t0
    outputs = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors
    text = "\n".join(_text(o) for o in outputs)
    assert "Traceback" not in text
    # the notebooks print each widget's error trait: it must be empty
    for found in re.findall(r"error: (.*)", text):
        assert found.split(" |")[0].strip() == "''", found
    print(f"{path.name}: {took:.1f} s")
