// Front end of vlens.widgets.TokenSpanPicker: tokens as chips.
// click = select one token; shift-click = extend from the last clicked
// token (the anchor) to this one. The selection is written back as
// [start, stop) to the synced trait "selection". Text goes in through
// textContent only, so a token can never be read as markup.

function chipText(token) {
  if (token === "") return "\u2205"; // empty set: an empty token
  return token.replace(/ /g, "\u00b7").replace(/\n/g, "\u21b5");
}

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "vlens-token-span";
  const chips = document.createElement("div");
  chips.className = "vlens-chips";
  const status = document.createElement("div");
  status.className = "vlens-span-status";
  root.append(chips, status);
  el.appendChild(root);

  let anchor = null;

  function select(start, stop) {
    model.set("selection", [start, stop]);
    model.save_changes();
  }

  function onClick(event) {
    const chip = event.target.closest(".vlens-chip");
    if (!chip) return;
    const i = Number(chip.dataset.index);
    const [start, stop] = model.get("selection");
    if (event.shiftKey) {
      const from = anchor ?? (stop > start ? start : i);
      select(Math.min(from, i), Math.max(from, i) + 1);
    } else {
      anchor = i;
      select(i, i + 1);
    }
  }

  function drawSelection() {
    const [start, stop] = model.get("selection");
    for (const chip of chips.children) {
      const i = Number(chip.dataset.index);
      chip.classList.toggle("selected", i >= start && i < stop);
    }
    const tokens = model.get("tokens");
    status.textContent = stop > start
      ? `span [${start}, ${stop}): ${tokens.slice(start, stop).join(" ")}`
      : "click a token; shift-click to extend";
  }

  function draw() {
    const tokens = model.get("tokens");
    const nPrompt = model.get("n_prompt");
    anchor = null;
    chips.replaceChildren(
      ...tokens.map((token, i) => {
        const chip = document.createElement("button");
        chip.type = "button";
        chip.className = "vlens-chip";
        if (nPrompt >= 0 && i >= nPrompt) chip.classList.add("generated");
        chip.dataset.index = String(i);
        chip.title = `token ${i}: ${JSON.stringify(token)}`;
        chip.textContent = chipText(token);
        return chip;
      }),
    );
    drawSelection();
  }

  chips.addEventListener("click", onClick);
  // shift-click would otherwise select page text
  chips.addEventListener("mousedown", (e) => { if (e.shiftKey) e.preventDefault(); });
  model.on("change:tokens", draw);
  model.on("change:n_prompt", draw);
  model.on("change:selection", drawSelection);
  draw();

  return () => {
    model.off("change:tokens", draw);
    model.off("change:n_prompt", draw);
    model.off("change:selection", drawSelection);
  };
}

export default { render };
