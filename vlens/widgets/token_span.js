// Front end of vlens.widgets.TokenSpanPicker: tokens as chips.
// click = select one token; shift-click = extend from the last clicked
// token (the anchor) to this one. The selection is written back as
// [start, stop) to the synced trait "selection"; the chip under the pointer
// to "hovered". "shade" (0..1 per chip) tints the chips. Text goes in
// through textContent only, so a token can never be read as markup.

// when a vlens module last started (figure.js holds long work back meanwhile)
globalThis.__vlensLastStart = performance.now();

// anywidget calls this when it starts a model: figure.js's long work no
// longer waits for it (vlens/widgets/_page.py)
function initialize({ model }) {
  (globalThis.__vlensStarted ||= new Set()).add(model.get("_start_key"));
}

// whitespace drawn as vlens.tokens.visible draws it in every other view
function chipText(token) {
  if (token === "") return "\u2205"; // empty set: an empty token
  return token.replace(/ /g, "\u00b7").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
}

const ROLE_CLASSES = ["system", "user", "assistant", "generated"];

function roleClass(role) {
  if (!role) return null;
  return "role-" + (ROLE_CLASSES.includes(role) ? role : "other");
}

// what each chip colour means, as TokenSpanPicker.legend says it in Python:
// one entry per kind of chip present, in this order
const LEGEND = [
  ["role-system", "system"], ["role-user", "user"], ["role-assistant", "assistant"],
  ["role-other", "other role"], ["role-none", "template (no role)"],
  ["role-generated", "generated"],
];

function legendEntries(roles) {
  if (!roles.length) return [];
  const present = new Set(roles.map((r) => roleClass(r) ?? "role-none"));
  return LEGEND.filter(([cls]) => present.has(cls));
}

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "vlens-token-span";
  const chips = document.createElement("div");
  chips.className = "vlens-chips";
  const status = document.createElement("div");
  status.className = "vlens-span-status";
  const legend = document.createElement("div");
  legend.className = "vlens-role-legend";
  root.append(legend, chips, status);
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

  function onHover(event) {
    const chip = event.target.closest(".vlens-chip");
    if (!chip) return;
    const i = Number(chip.dataset.index);
    if (model.get("hovered") === i) return;
    model.set("hovered", i);
    model.save_changes();
  }

  function drawShade() {
    const shade = model.get("shade") || [];
    for (const chip of chips.children) {
      const w = shade[Number(chip.dataset.index)];
      // a tint, under the selected/hovered styles of the stylesheet
      chip.style.backgroundColor = shade.length && w !== undefined
        ? `rgba(214, 39, 40, ${Math.max(0, Math.min(1, w)).toFixed(3)})` : "";
      chip.classList.toggle("shaded", shade.length > 0);
    }
  }

  function drawSelection() {
    const [start, stop] = model.get("selection");
    const hovered = model.get("hovered");
    for (const chip of chips.children) {
      const i = Number(chip.dataset.index);
      chip.classList.toggle("selected", i >= start && i < stop);
      chip.classList.toggle("hovered", i === hovered);
    }
    const tokens = model.get("tokens");
    status.textContent = stop > start
      ? `span [${start}, ${stop}): ${tokens.slice(start, stop).join(" ")}`
      : "click a token; shift-click to extend";
  }

  function drawLegend(roles) {
    legend.replaceChildren(
      ...legendEntries(roles).map(([cls, label]) => {
        const key = document.createElement("span");
        key.className = `vlens-legend-key ${cls}`;
        key.textContent = label;
        return key;
      }),
    );
    if (legend.children.length) legend.prepend("chips by role: ");
  }

  function draw() {
    const tokens = model.get("tokens");
    const nPrompt = model.get("n_prompt");
    const roles = model.get("roles") || [];
    anchor = null;
    drawLegend(roles);
    chips.replaceChildren(
      ...tokens.map((token, i) => {
        const chip = document.createElement("button");
        chip.type = "button";
        chip.className = "vlens-chip";
        if (nPrompt >= 0 && i >= nPrompt) chip.classList.add("generated");
        const role = roles[i];
        const cls = roleClass(role);
        if (cls) chip.classList.add(cls);
        chip.dataset.index = String(i);
        chip.title = `token ${i}: ${JSON.stringify(token)}` + (role ? ` (${role})` : "");
        chip.textContent = chipText(token);
        return chip;
      }),
    );
    drawSelection();
    drawShade();
  }

  chips.addEventListener("click", onClick);
  chips.addEventListener("mouseover", onHover);
  // shift-click would otherwise select page text
  chips.addEventListener("mousedown", (e) => { if (e.shiftKey) e.preventDefault(); });
  model.on("change:tokens", draw);
  model.on("change:n_prompt", draw);
  model.on("change:roles", draw);
  model.on("change:selection", drawSelection);
  model.on("change:hovered", drawSelection);
  model.on("change:shade", drawShade);
  draw();

  return () => {
    model.off("change:tokens", draw);
    model.off("change:n_prompt", draw);
    model.off("change:roles", draw);
    model.off("change:selection", drawSelection);
    model.off("change:hovered", drawSelection);
    model.off("change:shade", drawShade);
  };
}

export default { initialize, render };
