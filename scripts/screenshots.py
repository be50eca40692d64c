"""Screenshots of the notebooks' views, as a class sees them, for the docs.

Each notebook named (default: 01, 02, 05, 06, 07 and 08) is copied, its
parameters set, opened in JupyterLab in Debian's Chromium at 1600 x 1000
(the way tests/test_run_all.py opens them: the same server, page and Run
All), run with *Run All Cells* once, and every output that shows a view
(a plotly figure or a widget) is saved as ``<out>/<notebook>-<n>.png``,
``n`` counting from 1 in the notebook's order. The notebooks themselves
are left as they are.

    .venv/bin/python scripts/screenshots.py            # all six, into docs/img
    .venv/bin/python scripts/screenshots.py 01 --out /tmp/shots

Needs scripts/setup_browser.sh (apt's chromium, pip's playwright) and the
bundled model (or ``--model``); each notebook starts its own engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the browser tests' helpers

from _helpers import set_parameters  # noqa: E402
from test_browser import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_ARGS,
    _lab_server,
    _open_and_run_all,
    _quiet_lab_settings,
)
from test_run_all import RUN_ALL_S, VIEWPORT, _shut_kernels, _wait_run_all  # noqa: E402

DEFAULT = ("01", "02", "05", "06", "07", "08")

# mark every top-level output that shows a view (a figure or a widget) with
# its number, in the notebook's order; returns how many
_MARK_VIEWS = """() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const outs = Array.from(panel.querySelectorAll('.jp-OutputArea-output')).filter(el =>
      !el.parentElement.closest('.jp-OutputArea-output') &&
      el.querySelector('.js-plotly-plot, .vlens-figure, .vlens-token-span, .jupyter-widgets'));
  outs.forEach((el, i) => el.setAttribute('data-vlens-shot', String(i + 1)));
  return outs.length;
}"""

# every figure Python filled has been drawn (the last cell's may still be on its way)
_DRAWN = ("() => Array.from(document.querySelectorAll('.vlens-figure'))"
          ".every(el => Number(el.dataset.traces || 0) === 0 || (el.data || []).length > 0)")


def _notebooks(names: list[str]) -> list[Path]:
    """The notebooks whose file names start with each of ``names``."""
    found = []
    for name in names:
        hits = sorted((ROOT / "notebooks").glob(f"{name}*.ipynb"))
        if len(hits) != 1:
            raise SystemExit(f"{name!r} names {len(hits)} notebooks: {[h.name for h in hits]}")
        found.append(hits[0])
    return found


def _windowing_off(tmp: Path) -> None:
    """Lab settings that render every cell (no windowing: an output far
    down the notebook is in the page to be photographed)."""
    settings = tmp / "lab-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))


def shoot(book: str, browser, url: str, token: str, n_cells: int, out: Path) -> list[Path]:
    """Run All on notebook ``book`` in a fresh page, then save each view."""
    page = browser.new_page(viewport=VIEWPORT)
    try:
        t0 = time.monotonic()
        _open_and_run_all(page, url, token, book, workspace=Path(book).stem)
        _wait_run_all(page, n_cells, t0 + RUN_ALL_S)
        try:
            page.wait_for_function(_DRAWN, timeout=30_000)
        except Exception:  # noqa: BLE001 -- photograph what is there; the tests judge it
            print(f"{book}: some figures had not drawn after 30 s", file=sys.stderr)
        page.wait_for_timeout(1_000)  # the last figures' layout settles
        saved = []
        for i in range(1, page.evaluate(_MARK_VIEWS) + 1):
            view = page.locator(f"[data-vlens-shot='{i}']")
            # a page tall enough that the whole view shows in the notebook's
            # scrolling area (the width, and so every figure's layout, stays)
            height = view.evaluate("el => el.getBoundingClientRect().height")
            page.set_viewport_size({"width": VIEWPORT["width"],
                                    "height": max(VIEWPORT["height"], int(height) + 260)})
            view.evaluate("el => el.scrollIntoView({block: 'center'})")
            page.wait_for_timeout(500)
            path = out / f"{Path(book).stem}-{i}.png"
            view.screenshot(path=str(path))
            saved.append(path)
        print(f"{book}: Run All {time.monotonic() - t0:.0f} s, {len(saved)} views")
        return saved
    finally:
        page.close()


def main(argv: list[str] | None = None) -> int:
    import nbformat
    from playwright.sync_api import sync_playwright

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", default=list(DEFAULT),
                    help="notebook name prefixes (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ap.add_argument("--model", default=None, help="a local model folder (default: bundled)")
    args = ap.parse_args(argv)
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"{CHROMIUM} is missing: run scripts/setup_browser.sh")
    books = _notebooks(args.notebooks)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vlens-shots-") as tmp_name:
        tmp = Path(tmp_name)
        work = tmp / "work"
        work.mkdir()
        cells = {}
        for path in books:
            book = nbformat.read(path, as_version=4)
            set_parameters(book, args.model)
            nbformat.write(book, work / path.name)
            cells[path.name] = sum(c.cell_type == "code" for c in book.cells)
        _quiet_lab_settings(tmp)
        _windowing_off(tmp)
        with _lab_server(work, tmp) as (url, token), sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                        headless=True)
            try:
                for path in books:
                    try:
                        shoot(path.name, browser, url, token, cells[path.name], args.out)
                    finally:
                        _shut_kernels(url, token)  # each kernel holds an engine
            finally:
                browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
