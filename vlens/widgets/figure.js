// Front end of vlens.widgets.FigureView: one plotly figure drawn from the
// widget's own state. The figure arrives as JSON in the synced trait
// "figure_json"; plotly.js arrives once per page, as the text of one shared
// library model ("library" names it), and is evaluated the first time a
// figure needs it. Nothing here waits for a reply from the kernel, which may
// be busy running later cells.
//
// anywidget gives each widget model 2 s, from the moment it reaches the page,
// to import its module; a model that misses it is marked failed ("[anywidget]
// Failed to initialize model") and drops every later update. The page has one
// thread: while it evaluates plotly.js (about 0.9 s on an idle laptop, 2 s on
// a busy one) or draws a large figure, no other module can finish importing.
// So the long work here waits its turn: it runs one piece at a time, only
// after no vlens module has started for QUIET_MS (the other models of the
// same burst, made by the same cell, have started by then), and plotly.js is
// evaluated at most once per page: a plotly.js of the same version that is
// already there (jupyterlab-plotly's, which draws plain plotly outputs) is
// used as it is, and one evaluated here is handed to jupyterlab-plotly's
// renderer when it has not loaded its own yet (otherwise the first plain
// figure evaluates a second copy, another second or more of one task).
// "No vlens module has started for QUIET_MS" is not enough on its own: a
// model can reach the page while long work runs, before its module starts.
// The kernel lists every live vlens anywidget's key in one registry model
// (vlens/widgets/_page.py); each module marks its key started, and long work
// also waits until every key seen listed has started or is past its window.
// A click on a point is sent to Python as {event: "click", ...}.

const LIBRARY = "__vlensPlotly";
const LAST_START = "__vlensLastStart"; // when a vlens module last started
const LONG_WORK = "__vlensLongWork"; // the queue of long work, shared by every figure
const STARTED = "__vlensStarted"; // the keys of the vlens models started here
const SEEN = "__vlensSeen"; // key -> when a registry first listed it
const PAGES = "__vlensPages"; // the registries watched
const QUIET_MS = 400;
// anywidget's 2 s run from a model's arrival, which the page sees listed a
// little before it arrives: a margin for that
const WINDOW_MS = 4000;
const POLL_MS = 100;
const MOST_MS = 5000; // never hold a draw back longer than this

globalThis[LAST_START] = performance.now();

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// anywidget calls this when it starts a model: this model is past its window
function initialize({ model }) {
  (globalThis[STARTED] ||= new Set()).add(model.get("_start_key"));
}

// follow the kernel's registry of vlens models (`ref` names it); resolves
// once it is followed, or after MOST_MS whatever happens to it
function watchPage(host, ref) {
  if (!ref) return Promise.resolve();
  const follow = host.getModel(ref).then((page) => {
    const seen = (globalThis[SEEN] ||= new Map());
    const note = () => {
      const now = performance.now();
      const live = page.get("live") || [];
      for (const key of live) if (!seen.has(key)) seen.set(key, now);
      globalThis.__vlensListed = live; // the last list (a test reads it)
    };
    const pages = (globalThis[PAGES] ||= new WeakSet());
    if (!pages.has(page)) {
      pages.add(page);
      page.on("change:live", note);
    }
    note();
  }).catch(() => {}); // no registry: the quiet time alone decides
  return Promise.race([follow, sleep(MOST_MS)]);
}

// how many vlens models listed are still starting (inside their window)
function starting() {
  const started = globalThis[STARTED] || new Set();
  const now = performance.now();
  let n = 0;
  for (const [key, since] of globalThis[SEEN] || []) {
    if (!started.has(key) && now - since < WINDOW_MS) n += 1;
  }
  return n;
}

// run `work` after the long work queued before it, once no vlens module has
// started for QUIET_MS and no vlens model is starting (or MOST_MS have
// passed); its result as a promise
function inTurn(work) {
  const run = async () => {
    const asked = performance.now();
    let wait = Math.max(0, QUIET_MS - (asked - globalThis[LAST_START]));
    for (;;) {
      // always through a new task: work queued behind other work would
      // otherwise run in the same task as it (promise callbacks do), and
      // the page would not get its thread back between them
      await sleep(wait);
      const now = performance.now();
      const quiet = now - globalThis[LAST_START];
      if ((quiet >= QUIET_MS && !starting()) || now - asked >= MOST_MS) break;
      wait = quiet < QUIET_MS ? QUIET_MS - quiet : POLL_MS;
    }
    return work();
  };
  const next = (globalThis[LONG_WORK] || Promise.resolve()).then(run);
  globalThis[LONG_WORK] = next.catch(() => {});
  return next;
}

// hand `Plotly` to jupyterlab-plotly's renderer of plain figures when it has
// not loaded its own plotly.js yet (it loads one on its first figure); any
// surprise in its shape leaves it to load its own, as before
async function shareWithJupyterLab(Plotly) {
  try {
    const container = (globalThis._JUPYTERLAB || {})["jupyterlab-plotly"];
    if (!container || typeof container.get !== "function") return;
    const Rendered = (await container.get("./mimeExtension"))().RenderedPlotly;
    if (Rendered && Rendered.Plotly === null && typeof Rendered._resolveLoadingPlotly === "function") {
      Rendered.Plotly = Plotly;
      Rendered._resolveLoadingPlotly();
    }
  } catch (err) {
    console.debug("vlens: plotly.js not shared with jupyterlab-plotly:", err);
  }
}

// plotly.js, evaluated once per page (a promise shared by every figure)
function plotly(host, ref, watched) {
  if (!globalThis[LIBRARY]) {
    globalThis[LIBRARY] = Promise.all([host.getModel(ref), watched]).then(([lib]) => inTurn(() => {
      const there = globalThis.Plotly;
      if (there && there.react && there.version === lib.get("version")) return there;
      globalThis.__vlensPlotlyEvaluations = (globalThis.__vlensPlotlyEvaluations || 0) + 1;
      const module = { exports: {} };
      // plotly.min.js is a UMD bundle: given a `module`, it exports itself there
      new Function("module", "exports", "define", lib.get("source"))(
        module, module.exports, undefined);
      shareWithJupyterLab(module.exports);
      return module.exports;
    }));
    // a failed load may be retried by the next figure
    globalThis[LIBRARY].catch(() => { globalThis[LIBRARY] = null; });
  }
  return globalThis[LIBRARY];
}

function parse(text) {
  const fig = text ? JSON.parse(text) : {};
  const layout = fig.layout || {};
  // take the width the notebook gives (responsive), unless the figure fixes one
  if (layout.width === undefined) layout.autosize = true;
  return { data: fig.data || [], layout, frames: fig.frames || [] };
}

function pointIndex(p) {
  // heatmaps give [row, col]; other traces one number
  return Array.isArray(p.pointNumber) ? p.pointNumber : p.pointNumber ?? p.pointIndex;
}

async function render({ model, el, host }) {
  const watched = watchPage(host, model.get("_page"));
  const div = document.createElement("div");
  div.className = "vlens-figure";
  // the figure's state, parsed once per text (the trace count and the draw
  // that follows a change read the same parse)
  let parsed = { text: null, fig: null };
  function current() {
    const text = model.get("figure_json");
    if (text !== parsed.text) parsed = { text, fig: parse(text) };
    return parsed.fig;
  }
  div.dataset.traces = String(current().data.length);
  el.appendChild(div);
  let alive = true;
  let Plotly = null;
  let drawn = 0; // how many states have been drawn (a test reads data-drawn)
  let listening = false; // whether plotly_click reaches onClick

  async function draw() {
    const fig = current();
    // how many traces Python sent (a test compares it with what plotly drew)
    div.dataset.traces = String(fig.data.length);
    if (!alive || !Plotly) return;
    if (!fig.data.length) {
      // nothing to show yet (a figure filled by a later click or run): no
      // empty axes on the page
      div.style.display = "none";
      Plotly.purge(div); // (drops its listeners too)
      listening = false;
    } else {
      div.style.display = "";
      await Plotly.react(div, fig.data, fig.layout, {
        responsive: true, displaylogo: false,
      });
      if (!listening) { // plotly gives a div `on` once it has drawn there
        div.on("plotly_click", onClick);
        listening = true;
      }
    }
    drawn += 1;
    div.dataset.drawn = String(drawn);
  }

  function onClick(event) {
    const points = (event.points || []).map((p) => ({
      trace: p.curveNumber,
      index: pointIndex(p),
      x: p.x ?? null,
      y: p.y ?? null,
    }));
    if (points.length) model.send({ event: "click", points });
  }

  // a draw waits its turn (inTurn); changes that arrive meanwhile are drawn
  // by that one draw, which reads the state when it runs
  let waiting = false;
  function drawInTurn() {
    if (waiting) return;
    waiting = true;
    inTurn(() => { waiting = false; return draw(); }).catch(failed);
  }
  function failed(err) {
    div.style.display = "";
    div.textContent = "vlens: the figure could not be drawn: " + err;
    div.style.color = "#b00020";
  }
  const onChange = () => {
    div.dataset.traces = String(current().data.length);
    if (Plotly) drawInTurn();
  };
  model.on("change:figure_json", onChange);

  // a figure given a width of 0 (drawn in a hidden tab) is resized when seen
  const resize = new ResizeObserver(() => {
    if (Plotly && div.data && div.offsetWidth > 0) Plotly.Plots.resize(div);
  });
  resize.observe(div);

  // not awaited: anywidget's start does not wait on plotly.js
  plotly(host, model.get("library"), watched).then((lib) => {
    Plotly = lib;
    drawInTurn();
  }).catch(failed);

  return () => {
    alive = false;
    model.off("change:figure_json", onChange);
    resize.disconnect();
    if (Plotly) Plotly.purge(div);
  };
}

export default { initialize, render };
