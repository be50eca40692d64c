// Front end of vlens.widgets.FigureView: one plotly figure drawn from the
// widget's own state. The figure arrives as JSON in the synced trait
// "figure_json"; plotly.js arrives once per page, as the text of one shared
// library model ("library" names it), and is evaluated the first time a
// figure needs it. Nothing here waits for a reply from the kernel, which may
// be busy running later cells: this module is small, so anywidget's start
// (which it abandons after 2 s) never waits on plotly.js, and a figure draws
// as soon as its state and the library are in the page.
// A click on a point is sent to Python as {event: "click", ...}.

const LIBRARY = "__vlensPlotly";

// plotly.js, evaluated once per page (a promise shared by every figure)
function plotly(host, ref) {
  if (!globalThis[LIBRARY]) {
    globalThis[LIBRARY] = host.getModel(ref).then((lib) => {
      const module = { exports: {} };
      // plotly.min.js is a UMD bundle: given a `module`, it exports itself there
      new Function("module", "exports", "define", lib.get("source"))(
        module, module.exports, undefined);
      return module.exports;
    });
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
  const div = document.createElement("div");
  div.className = "vlens-figure";
  div.dataset.traces = String(parse(model.get("figure_json")).data.length);
  el.appendChild(div);
  let alive = true;
  let Plotly = null;
  let drawn = 0; // how many states have been drawn (a test reads data-drawn)
  let listening = false; // whether plotly_click reaches onClick

  async function draw() {
    const fig = parse(model.get("figure_json"));
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

  const onChange = () => { draw(); };
  model.on("change:figure_json", onChange);

  // a figure given a width of 0 (drawn in a hidden tab) is resized when seen
  const resize = new ResizeObserver(() => {
    if (Plotly && div.data && div.offsetWidth > 0) Plotly.Plots.resize(div);
  });
  resize.observe(div);

  // not awaited: anywidget's start does not wait on plotly.js
  plotly(host, model.get("library")).then((lib) => {
    Plotly = lib;
    return draw();
  }).catch((err) => {
    div.textContent = "vlens: the figure could not be drawn: " + err;
    div.style.color = "#b00020";
  });

  return () => {
    alive = false;
    model.off("change:figure_json", onChange);
    resize.disconnect();
    if (Plotly) Plotly.purge(div);
  };
}

export default { render };
