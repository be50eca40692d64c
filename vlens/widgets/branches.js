// Front end of vlens.widgets.branches.BranchTokens: a generation as chips.
// Each chip's title (its hover) gives the token's probability; a click writes
// the chip's index to the synced trait "clicked". Chips before "start" (the
// prefix a branch shares with the run it left) are drawn faded, the chip at
// "start" (the forced token) outlined. Text goes in through textContent only.

// when a vlens module last started (figure.js holds long work back meanwhile)
globalThis.__vlensLastStart = performance.now();

// anywidget calls this when it starts a model: figure.js's long work no
// longer waits for it (vlens/widgets/_page.py)
function initialize({ model }) {
  (globalThis.__vlensStarted ||= new Set()).add(model.get("_start_key"));
}

function chipText(token) {
  if (token === "") return "\u2205";
  return token.replace(/ /g, "\u00b7").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
}

function render({ model, el }) {
  const chips = document.createElement("div");
  chips.className = "vlens-branch-tokens";
  chips.style.cssText = "display:flex;flex-wrap:wrap;gap:3px;padding:4px 0;" +
    "font-family:var(--jp-code-font-family, monospace);font-size:13px";
  el.appendChild(chips);

  function draw() {
    const tokens = model.get("tokens");
    const probs = model.get("probs") || [];
    const start = model.get("start");
    const clicked = model.get("clicked");
    chips.replaceChildren(...tokens.map((token, i) => {
      const chip = document.createElement("button");
      chip.type = "button";
      chip.className = "vlens-branch-chip";
      chip.dataset.index = String(i);
      const p = probs[i];
      const shade = p === undefined || p === null ? 0 : Math.max(0, Math.min(1, p));
      chip.style.cssText = "border:1px solid #b0b7c3;border-radius:4px;padding:1px 6px;" +
        "cursor:pointer;font:inherit;white-space:pre;color:" +
        (shade > 0.6 ? "white" : "#1f2328") + ";background:rgba(33,102,172," +
        shade.toFixed(3) + ")";
      if (i < start) chip.style.opacity = "0.55";
      if (i === start && start > 0) chip.style.outline = "2px solid #d62728";
      if (i === clicked) chip.style.borderColor = "#000";
      chip.title = `generated token ${i}: ${JSON.stringify(token)}` +
        (p === undefined || p === null ? "" : `, p ${p.toFixed(3)}`);
      chip.textContent = chipText(token);
      return chip;
    }));
  }

  chips.addEventListener("click", (event) => {
    const chip = event.target.closest(".vlens-branch-chip");
    if (!chip) return;
    model.set("clicked", Number(chip.dataset.index));
    model.save_changes();
  });
  for (const name of ["tokens", "probs", "start", "clicked"]) model.on(`change:${name}`, draw);
  draw();
}

export default { initialize, render };
