"""A real browser drives the explorer in JupyterLab.

Starts JupyterLab on loopback (a free port, a random token; one server for
the module, each test's notebook in a workspace of its own and its kernels
shut down after it) over a copy of ``notebooks/01_tour.ipynb``, opens it
in Debian's Chromium through Python Playwright, runs every cell, moves the explorer's layer slider and
shift-clicks two token chips, then checks in the page (the heatmap's marks)
and in the kernel (``ex.layer``, ``ex.span``) that both took effect. The
tour's logit-lens view of a whole story (50+ tokens) is checked for legibility (no
two token labels overlap), and a snapshot of the explorer is opened from
its file, with no kernel and no network, and compared with the live figure.
A second test opens a small notebook of the attention and patching views:
it clicks a head's thumbnail, hovers a token chip and clicks a cell of the
patching grid, then checks the views' state in the kernel (``layer``,
``head``, ``token``, ``cell``) and what the page drew from it.
A third opens the feature view of the bundled SAE: it picks a prompt, clicks
a token, clicks one of its features (the contexts, histogram and promoted
tokens follow) and steers with it (baseline and steered text stream side by
side). Every view must draw the first time: no test makes a view again
(tests/test_run_all.py runs every notebook with Run All on a busy machine).
Screenshots go to ``test-artifacts/``.

Needs ``scripts/setup_browser.sh`` (apt's chromium, pip's playwright);
skipped, visibly, without them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from _helpers import notebook_model, set_parameters

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
RUN_ALL_TIMEOUT_MS = 300_000  # engine start + every cell, on a busy machine

# one xdist group with test_install: under `make test TEST_WORKERS=2` the
# browser tests run one after another in one process, never beside the
# install test's pip and compile (a view's figures have stayed empty there)
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("ui")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The attention and patching views on one short story (the browser test of
# issue 13): a trace that read every layer's pattern, and a patching grid.
_VIEWS_CELLS = [
    "MODEL = None",
    "import vlens\n"
    "from vlens.widgets import AttentionView, PatchingView\n"
    "s = vlens.Session(MODEL)\n"
    "CLEAN = ('once upon a time, a sad duck lived in a green house near the farm. '\n"
    "         'the sky was grey and the wind was cold. the')\n"
    "CORRUPT = CLEAN.replace('sad duck', 'sad cat')",
    "run = s.trace(CLEAN, sites=['attn_pattern'], layers=None, max_new_tokens=1)\n"
    "att = AttentionView(run, layer=0, head=0)\n"
    "display(att)\n"
    "print('attention view:', repr(att.error))",
    "pv = PatchingView(s.patch(CLEAN, CORRUPT, layers=[0, 1]))\n"
    "display(pv)\n"
    "print('patching view:', repr(pv.error))",
]


# A conversation in the explorer (issue 25): a tiny model with a byte-level
# BPE tokenizer and a Llama-3-shaped chat template, made in the kernel.
_CHAT_CELLS = [
    "import tempfile\n"
    "import vlens\n"
    "from vlens.tiny_chat import make_chat_model\n"
    "from vlens.widgets import explore\n"
    "path = make_chat_model(tempfile.mkdtemp() + '/chat', 'byte_level', 'llama3', layers=2)\n"
    "s = vlens.Session(path, max_model_len=512, kv_cache_memory_bytes=64 * 2**20)",
    "CONV = [{'role': 'system', 'content': 'You are a helpful assistant.'},\n"
    "        {'role': 'user', 'content': 'Where is the station?\\nTell me a story.'}]\n"
    "ex = explore(s, CONV, max_new_tokens=4)\n"
    "display(ex)\n"
    "print('chat explorer:', repr(ex.error), ex.span_picker.roles.count('user'))",
]


# The feature view (issue 26) on the bundled model and its SAE, over eight
# held-out stories; the steering row steers a sad opening.
_FEATURE_CELLS = [
    "import itertools, json\n"
    "import vlens\n"
    "from vlens.models import world, toyworld_sae_path\n"
    "s = vlens.Session()\n"
    "sae = vlens.SAE.load(toyworld_sae_path())\n"
    "measured = json.loads((toyworld_sae_path() / 'measured.json').read_text())\n"
    "found = measured['features']\n"
    "labels = {v['feature']: k for k, v in found.items()}\n"
    "HAPPY = found['mood=happy']['feature']\n"
    "stories = [x.text for x in itertools.islice(world.story_stream(5, held_out=True), 8)]",
    "fv = vlens.FeatureView(s, sae, stories, labels=labels, max_new_tokens=24,\n"
    "                       prompt=world.steering_prompts(world.SAD, 1)[0])\n"
    "fv.scale = measured['steer']['scale']  # the scale that flips held-out sad stories\n"
    "display(fv)\n"
    "acts = fv.activations(HAPPY)\n"
    "AT = max(range(len(acts)), key=lambda p: float(acts[p].max()))\n"
    "print('feature view:', AT, int(acts[AT].argmax()), repr(fv.error))",
]


def _open_page(p, height: int, console: list[str]):
    """Chromium (Debian's) and a page 1400 px wide, its console and page
    errors appended to ``console``."""
    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
    page = browser.new_page(viewport={"width": 1400, "height": height})
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    return browser, page


def _notebook_of(cells: list[str]):
    from nbformat.v4 import new_code_cell, new_notebook

    return new_notebook(cells=[new_code_cell(c) for c in cells],
                        metadata={"kernelspec": {"display_name": "Python 3",
                                                 "language": "python", "name": "python3"}})


def _views_notebook(model: str | None):
    from nbformat.v4 import new_code_cell, new_notebook

    book = new_notebook(cells=[new_code_cell(c) for c in _VIEWS_CELLS],
                        metadata={"kernelspec": {"display_name": "Python 3",
                                                 "language": "python", "name": "python3"}})
    book.cells[0].metadata["tags"] = ["parameters"]
    set_parameters(book, model)
    return book


def _prepare(tmp: Path) -> Path:
    """A copy of the tour and the views notebook with their parameters set,
    and lab settings that keep JupyterLab quiet (no news, no update checks:
    no network)."""
    import nbformat

    model = notebook_model()  # skips when there is no model to run on
    book = nbformat.read(ROOT / "notebooks" / "01_tour.ipynb", as_version=4)
    set_parameters(book, model)
    work = tmp / "work"
    work.mkdir()
    nbformat.write(book, work / "01_tour.ipynb")
    nbformat.write(_views_notebook(model), work / "views.ipynb")
    nbformat.write(_notebook_of(_CHAT_CELLS), work / "chat.ipynb")
    nbformat.write(_notebook_of(_FEATURE_CELLS), work / "features.ipynb")
    _quiet_lab_settings(tmp)
    return work


def _browser_ready() -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: run scripts/setup_browser.sh")
    pytest.importorskip("playwright.sync_api", reason="run scripts/setup_browser.sh")
    pytest.importorskip("jupyterlab")


def _quiet_lab_settings(tmp: Path) -> None:
    """Lab settings that keep JupyterLab quiet (no news, no update checks: no
    network)."""
    settings = tmp / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )


@contextmanager
def _lab_server(work: Path, tmp: Path, env_extra: dict[str, str] | None = None):
    """(url, token) of a JupyterLab server on 127.0.0.1 over ``work``, stopped
    afterwards (its log copied to test-artifacts/); ``env_extra``: variables
    its kernels see besides this process's."""
    ARTIFACTS.mkdir(exist_ok=True)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    env.update(env_extra or {})
    env.update(
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "lab-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "lab-workspaces"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
    )
    url = f"http://127.0.0.1:{port}"
    with open(tmp / "jupyter.log", "w") as log:
        server = subprocess.Popen(
            [
                sys.executable, "-m", "jupyter", "lab", "--no-browser",
                "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
                "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={work}",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--LabApp.extension_manager=readonly",  # no extension index look-ups
                *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),
            ],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 90
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                        break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        log.flush()
                        pytest.fail("JupyterLab did not start:\n"
                                    + (tmp / "jupyter.log").read_text()[-3000:])
                    time.sleep(0.5)
            yield url, token
        finally:
            server.terminate()  # the server shuts its kernels (and their engines) down
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    shutil.copy(tmp / "jupyter.log", ARTIFACTS / "jupyter.log")


@pytest.fixture(scope="module")
def _lab_of_module(tmp_path_factory):
    """One JupyterLab server for this module's tests (a start is ~7 s of the
    busy machine's time); each test opens its notebook in a workspace of its
    own and shuts its kernels at the end (``lab``)."""
    _browser_ready()
    tmp = tmp_path_factory.mktemp("lab")
    work = _prepare(tmp)
    with _lab_server(work, tmp) as (url, token):
        yield url, token, work


@pytest.fixture
def lab(_lab_of_module):
    """(url, token, work) of the JupyterLab server over the test notebooks
    (``work``: its folder); the test's kernels (and their engines) are shut
    down after it."""
    url, token, work = _lab_of_module
    try:
        yield url, token, work
    finally:
        _shut_kernels(url, token)


def _shut_kernels(url: str, token: str) -> None:
    """Shut every kernel of the server down (each holds an engine)."""
    with urllib.request.urlopen(f"{url}/api/kernels?token={token}", timeout=10) as r:
        kernels = json.load(r)
    for k in kernels:
        req = urllib.request.Request(f"{url}/api/kernels/{k['id']}?token={token}",
                                     method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()


def _run_cell_and_read(page, code: str, marker: str) -> str:
    """Append a cell at the end of the notebook, run it, return its output."""
    last = page.locator(".jp-Notebook .jp-Cell").last
    last.click(position={"x": 5, "y": 5})  # select the cell (its prompt area)
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # new cell below, in command mode
    page.keyboard.press("Enter")  # edit it
    page.keyboard.type(code)
    page.keyboard.press("Shift+Enter")
    out = page.locator(".jp-RenderedText", has_text=re.compile(re.escape(marker))).last
    out.wait_for(timeout=60_000)
    return out.inner_text()


# keeps the text of every state the steering texts are drawn in, in order
# (a MutationObserver sees each redraw, however fast the messages come)
_WATCH_TEXTS = """(box) => {
    window.__vlensTexts = [];
    window.__vlensWatch = new MutationObserver((records) => {
        for (const r of records) for (const node of r.addedNodes) {
            if (node.nodeType === 1 && node.classList.contains("vlens-stream")) {
                const cells = node.querySelectorAll(":scope > div");
                window.__vlensTexts.push(Array.from(cells, (c) => c.textContent));
            }
        }
    });
    window.__vlensWatch.observe(box, {childList: true, subtree: true});
}"""


def _shape_count(figure) -> int:
    return figure.locator(".shapelayer path").count()


# Bounding boxes of a figure's rendered text: the cell labels of a heatmap
# and the token labels of its y axis; how many pairs overlap (by > 0.5 px).
_LABEL_BOXES = """el => {
  const boxes = sel => Array.from(el.querySelectorAll(sel))
    .map(t => t.getBoundingClientRect()).filter(r => r.width > 0 && r.height > 0);
  const overlaps = rs => {
    let n = 0;
    for (let i = 0; i < rs.length; i++) for (let j = i + 1; j < rs.length; j++) {
      const a = rs[i], b = rs[j];
      if (a.left < b.right - 0.5 && b.left < a.right - 0.5 &&
          a.top < b.bottom - 0.5 && b.top < a.bottom - 0.5) n++;
    }
    return n;
  };
  const cells = boxes('.heatmap-label text'), ticks = boxes('.ytick text');
  return {cells: cells.length, ticks: ticks.length, cell_overlaps: overlaps(cells),
          tick_overlaps: overlaps(ticks),
          min_height: Math.min(...cells.map(r => r.height), ...ticks.map(r => r.height))};
}"""


def _wait_plotted(page, figure, timeout: int = 60_000) -> None:
    """Wait until plotly.js has drawn ``figure`` with at least one trace."""
    figure.wait_for(timeout=timeout)
    page.wait_for_function("el => (el.data || []).length > 0",
                           arg=figure.element_handle(), timeout=timeout)


def _figure_data(figure) -> str:
    """The first trace's x and z as plotly.js holds them in the page."""
    return figure.evaluate("el => JSON.stringify([el.data[0].x, el.data[0].z])")


def test_explorer_in_a_real_browser(lab):
    from playwright.sync_api import sync_playwright

    url, token, work = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        console: list[str] = []
        browser, page = _open_page(p, 1000, console)
        try:
            _open_and_run_all(page, url, token, "01_tour.ipynb")

            # the explorer's chips appear once the engine started and every cell ran
            page.locator(".jp-OutputArea-output", has_text="layer:").last.wait_for(
                timeout=RUN_ALL_TIMEOUT_MS)

            def drawn(scope):  # the chips, and the heatmap with its data
                chips = scope.locator(".vlens-chip:visible")
                chips.first.wait_for(timeout=60_000)
                # (``has`` is matched inside each output: a locator from the page)
                explorer = scope.locator(".jp-OutputArea-output",
                                         has=page.locator(".vlens-chip:visible")).last
                explorer.scroll_into_view_if_needed()
                heatmap = explorer.locator(".js-plotly-plot").first
                _wait_plotted(page, heatmap)
                return chips, explorer, heatmap

            chips, explorer, heatmap = drawn(page)  # drawn the first time: no retry
            time.sleep(1)
            page.screenshot(path=str(ARTIFACTS / "01-explorer.png"), full_page=False)
            explorer.screenshot(path=str(ARTIFACTS / "01-explorer-widget.png"))
            shapes_before = _shape_count(heatmap)

            # -- move the layer slider of the activation view (keyboard on its handle)
            slider = explorer.locator(".widget-slider:visible").first
            readout = slider.locator(".widget-readout")
            before = readout.inner_text()
            handle = slider.locator(".noUi-handle")
            handle.focus()
            page.keyboard.press("ArrowLeft")
            page.wait_for_function(
                "([el, v]) => el.innerText !== v",
                arg=[readout.element_handle(), before], timeout=30_000,
            )
            layer_after = int(readout.inner_text())

            # -- click a token, shift-click another: a span
            n_chips = chips.count()
            assert n_chips >= 4
            chips.nth(1).click()
            chips.nth(3).click(modifiers=["Shift"])
            selected = explorer.locator(".vlens-chip.selected")
            page.wait_for_function("n => document.querySelectorAll("
                                   "'.vlens-chip.selected').length === n", arg=3,
                                   timeout=30_000)
            assert selected.count() == 3
            # the heatmap redraws with the span outlined (one more shape)
            page.wait_for_function(
                "([el, n]) => el.querySelectorAll('.shapelayer path').length > n",
                arg=[heatmap.element_handle(), shapes_before], timeout=30_000,
            )
            time.sleep(1)
            explorer.screenshot(path=str(ARTIFACTS / "02-layer-and-span.png"))

            # -- the kernel saw both: traits and the figure's data
            text = _run_cell_and_read(
                page,
                "print('VLENS-CHECK:', ex.layer, tuple(ex.span), ex.activation_view.span, "
                "[s.name for s in ex.activation_view.heatmap.layout.shapes], repr(ex.error))",
                "VLENS-CHECK:",
            )
            page.screenshot(path=str(ARTIFACTS / "03-kernel-check.png"))

            # -- the other tabs render too: the logit lens, and a steering run
            explorer.scroll_into_view_if_needed()
            explorer.locator(".lm-TabBar-tab", has_text="logit lens").click()
            explorer.locator(".js-plotly-plot:visible").first.wait_for(timeout=30_000)
            time.sleep(1)
            explorer.screenshot(path=str(ARTIFACTS / "04-logit-lens.png"))
            explorer.locator(".lm-TabBar-tab", has_text="steering").click()
            # watch the texts while the run streams: every state the page shows
            explorer.locator(".vlens-texts").first.evaluate(_WATCH_TEXTS)
            explorer.locator(".widget-button:visible", has_text="run").first.click()
            # the comparison figure's title names the scale once the run is back
            explorer.locator(".js-plotly-plot:visible .gtitle", has_text="scale").first.wait_for(
                timeout=120_000)
            time.sleep(1)
            shown = page.evaluate("() => { window.__vlensWatch.disconnect(); "
                                  "return window.__vlensTexts; }")
            explorer.screenshot(path=str(ARTIFACTS / "05-steering.png"))
            streamed = _run_cell_and_read(
                page,
                "p = ex.steering_panel; ref = s.compare([p.prompt], steer=p.steer(), "
                "max_new_tokens=p.controller.max_new_tokens); "
                "print('VLENS-STREAM:', p.streamed_states, p.comparison.texts == ref.texts, "
                "repr(' '.join(p.live_texts)))",
                "VLENS-STREAM:",
            )

            # -- the DLA tab: opening it attributes the traced prompt's first
            # generated token; click a cell of its layer x head heatmap
            explorer.scroll_into_view_if_needed()
            explorer.locator(".lm-TabBar-tab", has_text="DLA").click()
            dla_fig = explorer.locator(".js-plotly-plot:visible").first
            _wait_plotted(page, dla_fig, timeout=120_000)
            axis = _run_cell_and_read(
                page, "ex.attribution_view.wait(); print('VLENS-AXIS:', next(t.xaxis + t.yaxis "
                      "for t in ex.attribution_view.figure.data if t.type == 'heatmap'))",
                "VLENS-AXIS:").split()[-1]
            explorer.scroll_into_view_if_needed()
            drag = dla_fig.locator(f".nsewdrag[data-subplot='{axis}']")
            drag.scroll_into_view_if_needed()
            _click_at(page, drag.bounding_box(), 0.5, 0.5)
            explorer.locator("b", has_text="directly to the logit difference").first.wait_for(
                timeout=30_000)
            time.sleep(1)
            explorer.screenshot(path=str(ARTIFACTS / "05b-dla-head.png"))
            dla_state = _run_cell_and_read(
                page, "v = ex.attribution_view; print('VLENS-DLA:', v.head, "
                      "v.attribution.answer_text[0], repr(v.head_text()), repr(v.error))",
                "VLENS-DLA:")

            # -- the tour's logit-lens view of a whole story: every label legible
            lens_out = page.locator(".jp-OutputArea-output", has_text="track a token").first
            lens_out.scroll_into_view_if_needed()
            lens_fig = lens_out.locator(".js-plotly-plot").first
            lens_fig.locator(".heatmap-label text").first.wait_for(timeout=30_000)
            labels = lens_fig.evaluate(_LABEL_BOXES)
            page.set_viewport_size({"width": 1400, "height": 2400})  # the whole grid
            lens_out.scroll_into_view_if_needed()
            time.sleep(1)
            lens_out.screenshot(path=str(ARTIFACTS / "06-logit-lens-story.png"))
            page.set_viewport_size({"width": 1400, "height": 1000})

            # -- a snapshot of the explorer, opened from its file: no kernel
            explorer.locator(".lm-TabBar-tab", has_text="activations").click()
            live = explorer.locator(".js-plotly-plot:visible").first
            live_shapes, live_data = _shape_count(live), _figure_data(live)
            saved = _run_cell_and_read(
                page, "print('VLENS-SNAP:', ex.snapshot('explorer-snapshot.html'), "
                      "repr(ex.error))", "VLENS-SNAP:")
            snap = browser.new_page(viewport={"width": 1400, "height": 1000})
            fetched: list[str] = []
            snap.on("request", lambda r: fetched.append(r.url))
            snap.goto((work / "explorer-snapshot.html").as_uri())
            snap_plots = snap.locator(".js-plotly-plot")
            snap_plots.first.locator(".xtick").first.wait_for(timeout=30_000)
            snap_count = snap_plots.count()
            snap_heat = snap_plots.first
            snap_shapes, snap_data = _shape_count(snap_heat), _figure_data(snap_heat)
            snap_chips = snap.locator(".vl-chip.selected").count()
            time.sleep(1)
            snap.screenshot(path=str(ARTIFACTS / "07-snapshot.png"), full_page=True)
            snap.close()
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "failure.png"))
            (ARTIFACTS / "console.log").write_text("\n".join(console))
            raise
        finally:
            (ARTIFACTS / "console.log").write_text("\n".join(console))
            browser.close()

    fields = text.split("VLENS-CHECK:", 1)[1].split()
    assert int(fields[0]) == layer_after, text
    assert "(1, 4) (1, 4)" in text, text  # explorer and view: tokens 1, 2, 3
    assert "'span'" in text and "'layer'" in text, text
    assert text.rstrip().endswith("''"), text  # no widget error

    # the DLA tab attributed the traced prompt, and the clicked head cell was picked
    dla_fields = dla_state.split("VLENS-DLA:", 1)[1]
    assert "(-1, -1)" not in dla_fields and "head" in dla_fields, dla_state
    assert "directly to the logit difference" in dla_fields, dla_state
    assert dla_state.rstrip().endswith("''"), dla_state  # no widget error

    # the logit lens over a whole story (a bundled-model story is 50-60 tokens with
    # its opening): one label per token and per cell, none overlapping
    assert labels["ticks"] >= 50, labels
    assert labels["cells"] >= labels["ticks"] * 4, labels  # every layer across (4 or more)
    assert labels["cell_overlaps"] == 0 and labels["tick_overlaps"] == 0, labels
    assert labels["min_height"] >= 10, labels  # text a reader can read

    # the snapshot: the same heatmap (token axis and marks), every figure, the chips
    # the steering run streamed: the page showed the texts growing before the end
    states = [(b.removeprefix("baseline"), s.removeprefix("steered")) for b, s in shown]
    assert len(set(states)) >= 4, shown  # at least three partial states, then the last
    fields = streamed.split("VLENS-STREAM:", 1)[1].split(maxsplit=2)
    assert int(fields[0]) >= 3 and fields[1] == "True", streamed  # final == s.compare's
    assert " ".join(states[-1]) in streamed, (states[-1], streamed)  # the page shows it
    assert "explorer-snapshot.html" in saved and saved.rstrip().endswith("''"), saved
    assert snap_data == live_data and len(snap_data) > 100, (snap_data[:300], live_data[:300])
    assert snap_shapes == live_shapes, (snap_shapes, live_shapes)
    assert snap_count >= 4, snap_count  # heatmap, strip, lens, steering comparison
    assert snap_chips == 3  # the span selected in the live page
    assert all(u.startswith(("file:", "data:", "blob:")) for u in fetched), fetched


def _open_and_run_all(page, url: str, token: str, name: str) -> None:
    """Open notebook ``name`` in the lab and run every cell, in a workspace
    of its own (named after it): no notebook an earlier page opened on the
    same server is restored beside it."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(f"{url}/lab/workspaces/{Path(name).stem}/tree/{name}?token={token}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)
    accept = page.locator(".jp-Dialog .jp-mod-accept")  # which kernel: the notebook's own
    try:
        accept.wait_for(timeout=10_000)
        accept.click()
    except PlaywrightTimeout:
        pass
    page.locator(".jp-StatusBar-TextItem", has_text="Idle").first.wait_for(timeout=120_000)
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()


def _click_at(page, box: dict, fx: float, fy: float) -> None:
    """A real mouse click at the fraction (fx, fy) of ``box`` (plotly listens
    to the pointer on its drag layer, not to clicks on elements)."""
    page.mouse.move(box["x"] + fx * box["width"], box["y"] + fy * box["height"])
    page.wait_for_timeout(300)  # plotly finds the point under the pointer on hover
    page.mouse.down()
    page.mouse.up()


def test_attention_and_patching_views_in_a_real_browser(lab):
    from playwright.sync_api import sync_playwright

    url, token, work = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        # tall enough that a whole view fits on screen for its screenshot
        console: list[str] = []
        browser, page = _open_page(p, 2000, console)
        try:
            _open_and_run_all(page, url, token, "views.ipynb")
            # (stdout only: a traceback shows the cell's source, marker included)
            page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']",
                         has_text="patching view:").last.wait_for(timeout=RUN_ALL_TIMEOUT_MS)
            cell = page.locator(".jp-CodeCell", has_text="att = AttentionView").first

            def drawn(cell) -> None:  # the chips, and the heatmap with its data
                cell.locator(".vlens-chip").first.wait_for(timeout=60_000)
                cell.scroll_into_view_if_needed()
                cell.locator(".js-plotly-plot").nth(1).locator(
                    ".gtitle", has_text="layer 0, head 0").wait_for(timeout=60_000)

            drawn(cell)  # drawn the first time: no retry
            chips = cell.locator(".vlens-chip")
            cell.scroll_into_view_if_needed()
            plots = cell.locator(".js-plotly-plot")
            thumbs, heat = plots.nth(0), plots.nth(1)
            time.sleep(1)
            cell.screenshot(path=str(ARTIFACTS / "08-attention-view.png"))

            # -- pick a head: click the thumbnail of layer 1, head 2 (the grid is one
            # heatmap of tiles `step` cells apart), low and left in the tile, where a
            # causal pattern has cells
            tile, step, n_heads, n_layers = (int(v) for v in _run_cell_and_read(
                page, "m = att.thumbnails.data[0].meta; print('VLENS-HEADS:', m['tile'], "
                      "m['step'], len(m['heads']), len(m['layers']))", "VLENS-HEADS:")
                .split("VLENS-HEADS:")[-1].split()[:4])
            width, height = n_heads * step - (step - tile), n_layers * step - (step - tile)
            drag = thumbs.locator(".nsewdrag[data-subplot='xy']")
            drag.scroll_into_view_if_needed()
            _click_at(page, drag.bounding_box(), (2 * step + 0.2 * tile) / width,
                      (1 * step + 0.8 * tile) / height)
            heat.locator(".gtitle", has_text="layer 1, head 2").wait_for(timeout=60_000)

            # -- hover a token: chip 8 (the animal); its row and column are drawn
            chips.nth(8).hover()
            page.wait_for_function(
                "el => el.classList.contains('hovered')", arg=chips.nth(8).element_handle(),
                timeout=30_000)
            token_fig = plots.nth(2)
            token_fig.locator(".gtitle", has_text="8:").wait_for(timeout=60_000)
            tinted = cell.locator(".vlens-chip.shaded").count()
            time.sleep(1)
            cell.screenshot(path=str(ARTIFACTS / "09-attention-head-and-token.png"))
            att_state = _run_cell_and_read(
                page, "print('VLENS-ATT:', att.layer, att.head, att.token, "
                      "[s.name for s in att.heatmap.layout.shapes], repr(att.error))",
                "VLENS-ATT:")

            # -- the patching grid: click the cell of layer 1 (row 1 of 2), position 8
            pcell = page.locator(".jp-CodeCell", has_text="pv = PatchingView").first
            pcell.scroll_into_view_if_needed()
            grid_fig = pcell.locator(".js-plotly-plot").nth(0)
            n_cols = int(_run_cell_and_read(
                page, "print('VLENS-COLS:', pv.patching.grid.shape[1])",
                "VLENS-COLS:").split()[-1])
            pcell.scroll_into_view_if_needed()
            time.sleep(1)
            pcell.screenshot(path=str(ARTIFACTS / "12-patching-view.png"))
            drag = grid_fig.locator(".nsewdrag[data-subplot='xy']")
            _click_at(page, drag.bounding_box(), (8 + 0.5) / n_cols, 0.75)
            bars = pcell.locator(".js-plotly-plot").nth(1)
            bars.locator(".gtitle", has_text="layer 1").wait_for(timeout=60_000)
            n_bars = bars.locator(".legendtext").count()
            time.sleep(1)
            pcell.screenshot(path=str(ARTIFACTS / "13-patching-cell.png"))
            pv_state = _run_cell_and_read(
                page, "print('VLENS-PV:', pv.cell, list(pv.distributions()), "
                      "[s.name for s in pv.heatmap.layout.shapes], repr(pv.error))",
                "VLENS-PV:")
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "views-failure.png"))
            raise
        finally:
            (ARTIFACTS / "views-console.log").write_text("\n".join(console))
            browser.close()

    # the kernel saw the clicked head and the hovered token, and drew them
    fields = att_state.split("VLENS-ATT:", 1)[1].split(maxsplit=3)
    assert fields[:3] == ["1", "2", "8"], att_state
    assert "'query'" in fields[3] and "'key'" in fields[3], att_state
    assert att_state.rstrip().endswith("''"), att_state  # no widget error
    assert tinted >= 9, tinted  # the chips tinted by where token 8 attends
    # the clicked cell: its run beside clean and corrupt, outlined in the grid
    assert "(1, 8)" in pv_state and "'cell'" in pv_state, pv_state
    assert "'clean', 'corrupt', 'layer 1, 8:" in pv_state, pv_state
    assert n_bars == 3, n_bars
    assert pv_state.rstrip().endswith("''"), pv_state


def test_explorer_on_a_connected_session(lab, tmp_path):
    """The explorer on ``vlens.connect`` (a ``vlens serve`` on loopback):
    the chips and heatmap render, the layer slider moves the layer, and a steering
    run streams back from the server."""
    import nbformat
    from playwright.sync_api import sync_playwright
    from test_serve import _Server

    url, token, work = lab
    (tmp_path / "serve").mkdir(exist_ok=True)
    server = _Server(tmp_path / "serve")
    server.start()
    explore = ("ex = vlens.explore(s, 'one day, a happy bear lived in a blue cabin near the "
               "meadow.', positive=['a happy day', 'a merry cat'], negative=['a sad day', "
               "'a gloomy cat'], max_new_tokens=6)")
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_code_cell(
        f"import vlens\ns = vlens.connect({server.url!r}, token={server.tokens['c0']!r})\n"
        f"{explore}\nex")]
    nbformat.write(book, work / "connected.ipynb")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                        headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            _open_and_run_all(page, url, token, "connected.ipynb")
            def drawn(scope):  # the chips, and the heatmap
                chips = scope.locator(".vlens-chip:visible")
                chips.first.wait_for(timeout=60_000)
                # (``has`` is matched inside each output: a locator from the page)
                explorer = scope.locator(".jp-OutputArea-output",
                                         has=page.locator(".vlens-chip:visible")).last
                explorer.locator(".js-plotly-plot").first.wait_for(timeout=60_000)
                return chips, explorer

            page.locator(".vlens-chip:visible").first.wait_for(timeout=RUN_ALL_TIMEOUT_MS)
            chips, explorer = drawn(page)  # drawn the first time: no retry
            assert chips.count() >= 4
            slider = explorer.locator(".widget-slider:visible").first
            readout = slider.locator(".widget-readout")
            before = readout.inner_text()
            slider.locator(".noUi-handle").focus()
            page.keyboard.press("ArrowLeft")
            page.wait_for_function("([el, v]) => el.innerText !== v",
                                   arg=[readout.element_handle(), before], timeout=30_000)
            explorer.screenshot(path=str(ARTIFACTS / "10-connected-explorer.png"))
            explorer.locator(".lm-TabBar-tab", has_text="steering").click()
            explorer.locator(".widget-button:visible", has_text="run").first.click()
            explorer.locator(".js-plotly-plot:visible .gtitle", has_text="scale").first.wait_for(
                timeout=120_000)
            explorer.screenshot(path=str(ARTIFACTS / "11-connected-steering.png"))
            text = _run_cell_and_read(
                page, "print('VLENS-REMOTE:', s.engine.remote, ex.layer, repr(ex.error), "
                      "s.status()['calls_done'])", "VLENS-REMOTE:")
            browser.close()
    finally:
        server.stop()
    _, remote, layer, error, calls = text.split()[:5]
    assert remote == "True" and error == "''" and int(layer) == int(before) - 1
    assert int(calls) >= 2  # the first trace and the steering run, at least


def test_a_conversation_in_the_explorer_shows_roles_and_whitespace(lab):
    """The chips of a conversation are coloured by role, and its spaces and
    newlines are drawn (· and ↵); the logit lens's token axis draws them the
    same way."""
    from playwright.sync_api import sync_playwright

    url, token, work = lab
    with sync_playwright() as p:
        console: list[str] = []
        browser, page = _open_page(p, 1600, console)
        try:
            _open_and_run_all(page, url, token, "chat.ipynb")
            page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']",
                         has_text="chat explorer:").last.wait_for(timeout=RUN_ALL_TIMEOUT_MS)
            cell = page.locator(".jp-CodeCell", has_text="ex = explore").first

            def drawn(cell) -> None:  # the chips, and the first figure
                cell.locator(".vlens-chip").first.wait_for(timeout=60_000)
                cell.scroll_into_view_if_needed()
                cell.locator(".js-plotly-plot").first.wait_for(timeout=60_000)

            drawn(cell)  # drawn the first time: no retry
            chips = cell.locator(".vlens-chip")
            time.sleep(1)
            cell.screenshot(path=str(ARTIFACTS / "14-chat-explorer.png"))
            counts = {role: cell.locator(f".vlens-chip.role-{role}").count()
                      for role in ("system", "user", "assistant", "generated")}
            texts = chips.all_inner_texts()
            colours = {role: cell.locator(f".vlens-chip.role-{role}").first.evaluate(
                "el => getComputedStyle(el).backgroundColor")
                for role in ("system", "user")}
            plain = chips.nth(0).evaluate("el => getComputedStyle(el).backgroundColor")
            # the logit lens's token axis (its figure in the kernel) draws them the same way
            ticks = _run_cell_and_read(
                page, "print('VLENS-LENS:', ''.join(map(str, ex.logit_lens_view.figure.data[0].y)))",
                "VLENS-LENS:")
            state = _run_cell_and_read(
                page, "print('VLENS-CHAT:', ex.span_picker.roles.count('user'), "
                      "ex.span_picker.roles.count('system'), repr(ex.error))", "VLENS-CHAT:")
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "chat-failure.png"))
            raise
        finally:
            (ARTIFACTS / "chat-console.log").write_text("\n".join(console))
            browser.close()
    users, systems = (int(x) for x in state.split("VLENS-CHAT:", 1)[1].split()[:2])
    assert counts["user"] == users >= 5 and counts["system"] == systems >= 5, (counts, state)
    assert len({colours["system"], colours["user"], plain}) == 3, colours  # told apart
    assert any(t.startswith("\u00b7") for t in texts), texts  # a leading space, drawn
    assert "\u21b5" in "".join(texts), texts  # a newline, drawn
    assert not any(ch in "".join(texts) for ch in "\u0120\u2581\ufffd"), texts
    assert "\u00b7" in ticks and "\u21b5" in ticks and "\u0120" not in ticks, ticks
    assert state.rstrip().endswith("''"), state  # no widget error


def test_feature_view_in_a_real_browser(lab):
    """Pick a story, click the token where the happy-mood feature peaks,
    click that feature among the token's top features, then steer a sad
    opening with it: the kernel saw each click, the page drew the feature
    and streamed both texts."""
    from playwright.sync_api import sync_playwright

    url, token, work = lab
    with sync_playwright() as p:
        console: list[str] = []
        browser, page = _open_page(p, 2000, console)
        try:
            _open_and_run_all(page, url, token, "features.ipynb")
            out = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']",
                               has_text="feature view:").last
            out.wait_for(timeout=RUN_ALL_TIMEOUT_MS)
            at, position = (int(x) for x in out.inner_text().split()[2:4])
            cell = page.locator(".jp-CodeCell", has_text="fv = vlens.FeatureView").first
            chips = cell.locator(".vlens-chip")
            chips.first.wait_for(timeout=60_000)  # drawn the first time: no retry
            cell.scroll_into_view_if_needed()
            time.sleep(1)
            cell.screenshot(path=str(ARTIFACTS / "15-feature-view.png"))

            # -- the story where the feature peaks, then its token
            cell.locator("select").first.select_option(index=at)
            # the kernel has the story (and has sent its chips) once this prints
            shown_in_kernel = _run_cell_and_read(page, "print('VLENS-SHOWN:', fv.shown)",
                                                 "VLENS-SHOWN:")
            cell.scroll_into_view_if_needed()
            chips.nth(position).click()
            buttons = cell.locator(".vlens-feature-buttons button")
            happy = buttons.filter(has_text="mood=happy")
            happy.wait_for(timeout=60_000)
            n_buttons = buttons.count()
            happy.click()
            cell.locator(".vlens-context").first.wait_for(timeout=60_000)
            cell.locator(".js-plotly-plot .gtitle", has_text="fires on").first.wait_for(
                timeout=60_000)
            cell.locator(".js-plotly-plot .gtitle", has_text="unembedding").first.wait_for(
                timeout=60_000)
            n_contexts = cell.locator(".vlens-context").count()
            tinted = cell.locator(".vlens-chip.shaded").count()
            time.sleep(1)
            cell.screenshot(path=str(ARTIFACTS / "16-feature-view-feature.png"))
            picked = _run_cell_and_read(
                page, "print('VLENS-PICKED:', fv.shown, fv.token, fv.feature == HAPPY, "
                      "len(fv.contexts()), fv.histogram.layout.title.text.split(':')[0] == f'feature {HAPPY}', "
                      "repr(fv.error))", "VLENS-PICKED:")

            # -- steer with it: both texts grow side by side
            cell.scroll_into_view_if_needed()
            cell.locator(".vlens-texts").first.evaluate(_WATCH_TEXTS)
            cell.locator(".widget-button", has_text="run").first.click()
            cell.locator(".widget-label", has_text="divergence").first.wait_for(timeout=120_000)
            time.sleep(1)
            shown = page.evaluate("() => { window.__vlensWatch.disconnect(); "
                                  "return window.__vlensTexts; }")
            cell.screenshot(path=str(ARTIFACTS / "17-feature-view-steered.png"))
            steered = _run_cell_and_read(
                page,
                "ref = s.compare([fv._prompt.value], steer=fv.steer(), max_new_tokens=24); "
                "print('VLENS-STEER:', fv.streamed_states, fv.comparison.texts == ref.texts, "
                "world.sentiment_of(fv.live_texts[1]), repr(fv.error), "
                "repr(' '.join(fv.live_texts)))",
                "VLENS-STEER:")
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "features-failure.png"))
            console.append("plots: " + json.dumps(page.evaluate(
                "() => Array.from(document.querySelectorAll('.js-plotly-plot'), "
                "el => [(el.data || []).length, el.layout && el.layout.title && "
                "el.layout.title.text])")))
            raise
        finally:
            (ARTIFACTS / "features-console.log").write_text("\n".join(console))
            browser.close()

    # the clicks reached the kernel: the story, the token, the feature
    assert shown_in_kernel.split()[-1] == str(at), shown_in_kernel  # the story picked
    fields = picked.split("VLENS-PICKED:", 1)[1].split()
    assert fields[:3] == [str(at), str(position), "True"], picked  # token and feature clicked
    assert int(fields[3]) == n_contexts >= 1, (picked, n_contexts)  # its contexts, drawn
    assert fields[4] == "True", picked  # the histogram is the feature's
    assert fields[5] == "''", picked  # no widget error
    assert n_buttons >= 2, n_buttons  # the token's top features, one button each
    assert tinted >= 1, tinted  # the chips tinted by the feature
    # the steering run streamed: several states on the page, the last what compare gives
    states = [(b.removeprefix("baseline"), x.removeprefix("steered")) for b, x in shown]
    assert len(set(states)) >= 4, shown
    fields = steered.split("VLENS-STEER:", 1)[1].split(maxsplit=4)
    assert int(fields[0]) >= 3 and fields[1] == "True", steered
    assert fields[2] == "happy", steered  # the sad opening steered happy
    assert fields[3] == "''", steered
    assert " ".join(states[-1]) in steered, (states[-1], steered)


# BranchView (issue 42) on the bundled model: a short opening, 12 tokens.
_BRANCH_CELLS = [
    "import json\n"
    "import vlens\n"
    "from vlens.widgets import BranchView\n"
    "s = vlens.Session()\n"
    "bv = BranchView(s, 'once upon a time, a sad duck', k=3, max_new_tokens=12)\n"
    "display(bv)\n"
    "print('branch view:', repr(bv.error))",
]


def test_branch_view_in_a_real_browser(lab):
    """Click a generated token, then one of its alternatives: the branch's
    text appears and equals what ``s.continue_from`` gives."""
    import nbformat
    from playwright.sync_api import sync_playwright

    url, token, work = lab
    nbformat.write(_notebook_of(_BRANCH_CELLS), work / "branches.ipynb")
    with sync_playwright() as p:
        console: list[str] = []
        browser, page = _open_page(p, 1400, console)
        try:
            _open_and_run_all(page, url, token, "branches.ipynb")
            page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']",
                         has_text="branch view:").last.wait_for(timeout=RUN_ALL_TIMEOUT_MS)
            cell = page.locator(".jp-CodeCell", has_text="bv = BranchView").first
            chips = cell.locator(".vlens-branch-chip")
            chips.first.wait_for(timeout=60_000)  # drawn the first time: no retry
            cell.scroll_into_view_if_needed()
            n_chips = chips.count()
            hover = chips.nth(2).get_attribute("title")
            chips.nth(2).click()
            buttons = cell.locator(".vlens-branch-alternatives button")
            buttons.first.wait_for(timeout=60_000)
            n_buttons = buttons.count()
            buttons.first.click()
            text = cell.locator(".vlens-branch-text", has_text="@2")
            text.wait_for(timeout=120_000)
            time.sleep(1)
            cell.screenshot(path=str(ARTIFACTS / "18-branch-view.png"))
            shown = text.inner_text()
            state = _run_cell_and_read(
                page,
                "ref = s.continue_from(bv.traces[0], 2, bv.traces[1].forced, max_new_tokens=12); "
                "print('VLENS-BRANCH:', len(bv.traces), bv.traces[1].branch_point, "
                "ref.output_token_ids == bv.traces[1].output_token_ids, "
                "ref.text == bv.traces[1].text, repr(bv.error), json.dumps(ref.text))",
                "VLENS-BRANCH:")
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "branches-failure.png"))
            raise
        finally:
            (ARTIFACTS / "branches-console.log").write_text("\n".join(console))
            browser.close()
    assert n_chips == 12, n_chips
    assert re.search(r", p [01]\.\d{3}$", hover or ""), hover  # its probability on hover
    assert n_buttons == 3, n_buttons  # the token's top-3 alternatives
    fields = state.split("VLENS-BRANCH:", 1)[1].split(maxsplit=5)
    assert fields[:5] == ["2", "2", "True", "True", "''"], state  # grown at token 2, no error
    ref = json.loads(fields[5].strip())
    # the page shows the branch's label, then its text: the text continue_from gives
    assert ref.strip() and " ".join(ref.split()) in " ".join(shown.split()), (shown, ref)
