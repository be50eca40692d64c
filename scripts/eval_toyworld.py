#!/usr/bin/env python
"""Evaluate the bundled toyworld model the way a new user would meet it.

Four checks, all on held-out (animal, colour, sentiment) combinations:

* **steering grid** -- two sentiment directions (the documented recipe,
  :func:`world.sentiment_prompts`, and the natural contrast a user types into
  the steering panel, :func:`world.mood_contrast_prompts`: whole first
  sentences that differ only in the mood word), each a difference of means at
  the last token of decoder layer L, added with ``relative=True`` at every
  layer and every scale of a range; sad openings are pushed towards happy and
  happy openings towards sad. A story is *flipped* when its continuation has
  more words of the target sentiment than of the other, *well-formed* when it
  reaches "the end." (:func:`world.is_well_formed`).
* **probes** -- next-word probes (the model's top-1 word after a cut before a
  concept word) and linear probes (logistic regression on the residual stream
  at the cut, trained on training combinations, tested on held-out ones) at
  every layer.
* **attention** -- the head that copies the animal: attention from the
  position that names the animal again (after a visitor) to the first animal.
* **vLLM = Hugging Face** -- greedy continuations through ``vlens.Session``
  on vLLM equal transformers' on every evaluation prompt, unsteered and with
  the recipe's steer.

Usage::

    python scripts/eval_toyworld.py                 # full: prints, writes JSON and the docs' tables
    python scripts/eval_toyworld.py --small         # a few minutes (make test runs tests/test_toyworld_eval.py)
    python scripts/eval_toyworld.py --no-vllm --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vlens.models import RECIPE, toyworld_path, world
from vlens.testing import hf_steering_hook

SCALES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
SMALL_SCALES = (0.25, 0.75, 1.25)
CLEAN = 0.9  # a scale is clean when both ways flip >= 90% and keep >= 90% well-formed
KINDS = ("recipe", "natural")
MAX_NEW_TOKENS = 60
BEGIN, END = "<!-- eval_toyworld:begin -->", "<!-- eval_toyworld:end -->"
CHAT_BEGIN, CHAT_END = "<!-- eval_toyworld:chat:begin -->", "<!-- eval_toyworld:chat:end -->"
CHAT_NEW_TOKENS = 84  # "sure." and the longest story, 74 tokens with its </s>
CHAT_ADD_SCALES = (1.0, 1.5, 2.0)  # times the raw difference of means


# ---------------------------------------------------------------------------
# Hugging Face helpers
# ---------------------------------------------------------------------------


def load(path: Path) -> tuple[Any, Any]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model, tok


def last_states(model: Any, tok: Any, prompts: Sequence[str], layer: int) -> torch.Tensor:
    """Output of decoder layer ``layer`` (residual stream, a forward hook) at
    each prompt's last token: ``[len(prompts), hidden]``."""
    return last_states_at(model, tok, prompts, [layer])[layer]


@torch.no_grad()
def last_states_at(model: Any, tok: Any, prompts: Sequence[str], layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """:func:`last_states` for several layers from one forward pass."""
    seen: dict[int, torch.Tensor] = {}

    def keep(layer: int) -> Any:
        return lambda m, a, out: seen.__setitem__(layer, out[0] if isinstance(out, tuple) else out)

    hooks = [model.model.layers[i].register_forward_hook(keep(i)) for i in layers]
    tok.padding_side = "right"
    try:
        enc = tok(list(prompts), padding=True, return_tensors="pt")
        model(**enc)
    finally:
        for h in hooks:
            h.remove()
    last = enc.attention_mask.sum(1) - 1
    return {i: seen[i][torch.arange(len(last)), last] for i in layers}


def contrast(kind: str, n: int = 64) -> tuple[list[str], list[str]]:
    """(happy, sad) prompts of a direction kind."""
    if kind == "recipe":
        return world.sentiment_prompts(n)
    return world.mood_contrast_prompts(n)


def unit_direction(model: Any, tok: Any, kind: str, layer: int) -> torch.Tensor:
    happy, sad = contrast(kind)
    d = last_states(model, tok, happy, layer).mean(0) - last_states(model, tok, sad, layer).mean(0)
    return d / d.norm()


@torch.no_grad()
def greedy(
    model: Any,
    tok: Any,
    prompts: Sequence[str],
    steer: tuple[int, torch.Tensor, float] | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
    batched: bool = True,
) -> list[list[int]]:
    """Greedy continuation ids; ``steer=(layer, unit vector, scale)`` adds
    ``scale * |h_t| * u`` to every position's output of that layer."""
    hook = None
    if steer is not None:
        layer, u, scale = steer

        hook = hf_steering_hook(model.model.layers[layer],
                                lambda h: h + scale * h.norm(dim=-1, keepdim=True) * u)
    tok.padding_side = "left"
    out_ids: list[list[int]] = []
    try:
        groups = [list(prompts)] if batched else [[p] for p in prompts]
        for group in groups:
            enc = tok(group, padding=True, return_tensors="pt")
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
            for row in out[:, enc.input_ids.shape[1] :].tolist():
                while row and row[-1] == tok.pad_token_id:
                    row.pop()
                out_ids.append(row)
    finally:
        tok.padding_side = "right"
        if hook is not None:
            hook.remove()
    return out_ids


def story_rates(tok: Any, ids: list[list[int]], target: str) -> tuple[float, float]:
    texts = tok.batch_decode(ids, skip_special_tokens=True)
    n = len(texts)
    return (
        sum(world.sentiment_of(t) == target for t in texts) / n,
        sum(world.is_well_formed(t) for t in texts) / n,
    )


# ---------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------


def steering_grid(model: Any, tok: Any, n: int, layers: Sequence[int], scales: Sequence[float], log: Any) -> dict[str, Any]:
    prompts = {s: world.steering_prompts(s, n) for s in world.SENTIMENTS}
    base = {
        s: story_rates(tok, greedy(model, tok, prompts[s]), world.SAD if s == world.HAPPY else world.HAPPY)
        for s in world.SENTIMENTS
    }
    rows = []
    for kind in KINDS:
        for layer in layers:
            u = unit_direction(model, tok, kind, layer)
            for scale in scales:
                row: dict[str, Any] = {"direction": kind, "layer": layer, "scale": scale}
                for source, target, sign in ((world.SAD, world.HAPPY, 1.0), (world.HAPPY, world.SAD, -1.0)):
                    ids = greedy(model, tok, prompts[source], (layer, sign * u, scale))
                    flip, formed = story_rates(tok, ids, target)
                    row[f"{source}_flip"], row[f"{source}_formed"] = flip, formed
                rows.append(row)
                log(f"  {kind:8s} layer {layer} x{scale}: sad->happy {row['sad_flip']:.0%}/{row['sad_formed']:.0%}"
                    f"  happy->sad {row['happy_flip']:.0%}/{row['happy_formed']:.0%}")
    return {
        "prompts_per_sentiment": n,
        "max_new_tokens": MAX_NEW_TOKENS,
        "baseline": {f"{s}_flip": base[s][0] for s in base} | {f"{s}_formed": base[s][1] for s in base},
        "rows": rows,
    }


def window(rows: Sequence[dict[str, Any]], kind: str, layer: int) -> tuple[float, float] | None:
    """The widest run of consecutive grid scales (by ratio of its ends) at
    which ``kind`` at ``layer`` is clean both ways (see :data:`CLEAN`), as
    (lowest, highest) scale; None when no scale is clean."""
    mine = sorted((r for r in rows if (r["direction"], r["layer"]) == (kind, layer)), key=lambda r: r["scale"])
    best: tuple[float, float] | None = None
    start = None
    for i, r in enumerate(mine):
        clean = all(r[f"{s}_{k}"] >= CLEAN for s in world.SENTIMENTS for k in ("flip", "formed"))
        if clean and start is None:
            start = i
        if clean and (best is None or r["scale"] / mine[start]["scale"] > best[1] / best[0]):
            best = (mine[start]["scale"], r["scale"])
        if not clean:
            start = None
    return best


def _training_cuts(concept: str, n: int, seed: int = 4321) -> list[world.Probe]:
    """Probe-like cuts of *training* combinations (to fit linear probes)."""
    slots = {"sentiment": ("adverb", "sky", "wind", "verb1", "feeling"), "colour": ("thing1", "thing2"),
             "animal": ("animal1", "animal2", "animal3")}[concept]
    out = []
    for i, story in zip(range(n), world.story_stream(seed)):
        slot = slots[i % len(slots)]
        value = {"sentiment": story.sentiment, "colour": story.colour, "animal": story.animal}[concept]
        out.append(world.Probe(story.prefix(slot), concept, value, slot, world.concept_words(concept, value)))
    return out


def probes(model: Any, tok: Any, n: int, layers: Sequence[int]) -> dict[str, Any]:
    """Next-word top-1 accuracy and linear-probe accuracy per layer."""
    res: dict[str, Any] = {"next_word": {}, "linear": {}, "prompts": n}
    for concept in ("sentiment", "colour", "animal"):
        test = world.probe_prompts(concept, n)
        tok.padding_side = "right"
        with torch.no_grad():
            enc = tok([p.prompt for p in test], padding=True, return_tensors="pt")
            logits = model(**enc).logits
        last = enc.attention_mask.sum(1) - 1
        top = tok.convert_ids_to_tokens(logits[torch.arange(len(last)), last].argmax(-1).tolist())
        res["next_word"][concept] = sum(t in p.allowed for t, p in zip(top, test)) / len(test)
        train = _training_cuts(concept, 4 * n)
        classes = sorted({p.value for p in train})
        y_train = torch.tensor([classes.index(p.value) for p in train])
        y_test = torch.tensor([classes.index(p.value) for p in test])
        res["linear"][concept] = {}
        all_train = last_states_at(model, tok, [p.prompt for p in train], layers)
        all_test = last_states_at(model, tok, [p.prompt for p in test], layers)
        for layer in layers:
            x_train, x_test = all_train[layer], all_test[layer]
            mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
            res["linear"][concept][layer] = _logistic(
                (x_train - mu) / sd, y_train, (x_test - mu) / sd, y_test, len(classes)
            )
    return res


def _logistic(x: torch.Tensor, y: torch.Tensor, xt: torch.Tensor, yt: torch.Tensor, k: int) -> float:
    torch.manual_seed(0)
    lin = torch.nn.Linear(x.shape[1], k)
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lin(x), y) + 1e-3 * lin.weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        return float((lin(xt).argmax(-1) == yt).float().mean())


@torch.no_grad()
def attention(model: Any, tok: Any, n: int) -> dict[str, Any]:
    """Mean attention, per (layer, head), from the position that predicts the
    animal's second mention (the "the" after the visitor's sentence) to the
    first mention of the animal, over held-out stories whose visitor is
    another kind of animal."""
    import random

    rng = random.Random(2024)
    held = sorted(world.HELD_OUT)
    stories = []
    while len(stories) < n:
        a, c, s = held[len(stories) % len(held)]
        st = world.generate_story(rng, animal=a, colour=c, sentiment=s, visitor=True)
        if st.words[st.slots["visitor"]] != a:
            stories.append(st)
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    total = torch.zeros(n_layers, n_heads)
    to_visitor = torch.zeros(n_layers, n_heads)
    for st in stories:  # one at a time: positions are exact, no padding
        ids = tok(st.text, return_tensors="pt").input_ids  # <s> first: word i is token i + 1
        att = model(input_ids=ids, output_attentions=True).attentions
        q = st.slots["animal1"]  # token index of the word before animal1 (+1 for <s>, -1)
        k0, kv = st.slots["animal0"] + 1, st.slots["visitor"] + 1
        for layer, a in enumerate(att):
            total[layer] += a[0, :, q, k0]
            to_visitor[layer] += a[0, :, q, kv]
    total /= n
    to_visitor /= n
    layer, head = divmod(int(total.argmax()), n_heads)
    return {
        "stories": n,
        "query": "the token just before the animal's second mention (it predicts the animal)",
        "best": {"layer": layer, "head": head, "to_first_animal": float(total[layer, head]),
                 "to_visitor": float(to_visitor[layer, head])},
        "to_first_animal": total.tolist(),
    }


def vllm_parity(model: Any, tok: Any, session: Any, prompts: list[str], steer_layer: int,
                steer_scale: float) -> dict[str, Any]:
    """Greedy ids through ``session`` (a ``vlens.Session`` on vLLM) against
    transformers (one prompt at a time, unpadded), unsteered and with the
    recipe's steer both ways. Counts identical continuations; ``mismatches``
    lists the first few that differ."""
    import vlens

    res: dict[str, Any] = {"prompts": len(prompts), "mismatches": []}
    happy, sad = world.sentiment_prompts()
    d = session.direction(happy, sad, layer=steer_layer, span="last")
    u = d / d.norm()
    for name, sign in (("unsteered", 0.0), ("towards_happy", 1.0), ("towards_sad", -1.0)):
        st = None if sign == 0 else vlens.Steer(sign * d, layer=steer_layer, scale=steer_scale, relative=True)
        run = session.trace(prompts, sites=[], logprobs=False, steer=st, max_new_tokens=MAX_NEW_TOKENS)
        got = [[i for i in t.output_token_ids if i != tok.eos_token_id] for t in run]
        want = greedy(model, tok, prompts, None if sign == 0 else (steer_layer, sign * u, steer_scale),
                      batched=False)
        want = [[i for i in w if i != tok.eos_token_id] for w in want]
        res[name] = sum(g == w for g, w in zip(got, want))
        res["mismatches"] += [(name, p) for p, g, w in zip(prompts, got, want) if g != w][:3]
    return res


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def markdown(ev: dict[str, Any]) -> str:
    g = ev["grid"]
    scales = sorted({r["scale"] for r in g["rows"]})
    b = g["baseline"]
    lines = [
        f"Held-out openings, {g['prompts_per_sentiment']} sad and {g['prompts_per_sentiment']} happy, greedy, "
        f"{g['max_new_tokens']} new tokens, `Steer(d, layer=L, scale=x, relative=True)` with `+d` on sad "
        "openings and `-d` on happy ones. Each cell: **flipped / well-formed**, sad→happy then happy→sad; "
        "the clean window is the widest run of scales where all four are at least 90%. "
        f"Unsteered: {_pct(b['sad_flip'])} / {_pct(b['sad_formed'])}, {_pct(b['happy_flip'])} / {_pct(b['happy_formed'])}.",
        "",
        "| direction | layer | " + " | ".join(f"×{s:g}" for s in scales) + " | clean window |",
        "|---|---|" + "---|" * len(scales) + "---|",
    ]
    for kind in KINDS:
        for layer in sorted({r["layer"] for r in g["rows"]}):
            cells = []
            for s in scales:
                r = next(r for r in g["rows"] if (r["direction"], r["layer"], r["scale"]) == (kind, layer, s))
                cells.append(f"{_pct(r['sad_flip'])}/{_pct(r['sad_formed'])}, {_pct(r['happy_flip'])}/{_pct(r['happy_formed'])}")
            mark = " (the recipe)" if (kind, layer) == ("recipe", ev["recipe"]["layer"]) else ""
            w = window(g["rows"], kind, layer)
            span = "none" if w is None else f"×{w[0]:g}–×{w[1]:g} ({w[1] / w[0]:.1f}× wide)"
            lines.append(f"| {kind} | {layer}{mark} | " + " | ".join(cells) + f" | {span} |")
    p = ev["probes"]
    layers = sorted(next(iter(p["linear"].values())))
    lines += [
        "",
        f"Probes on {p['prompts']} held-out cuts per concept: the model's next word, and a linear probe "
        "(logistic regression on the residual stream at the cut, fitted on training combinations) per layer.",
        "",
        "| concept | next word | " + " | ".join(f"layer {l}" for l in layers) + " |",
        "|---|---|" + "---|" * len(layers),
    ]
    for c in ("sentiment", "colour", "animal"):
        lines.append(f"| {c} | {100 * p['next_word'][c]:.1f}% | "
                     + " | ".join(f"{100 * p['linear'][c][l]:.1f}%" for l in layers) + " |")
    a = ev["attention"]["best"]
    lines += [
        "",
        f"Copying head: layer {a['layer']}, head {a['head']} puts {_pct(a['to_first_animal'])} of its attention "
        f"from the token before the animal's second mention to the first mention (and {_pct(a['to_visitor'])} "
        f"to the visitor), averaged over {ev['attention']['stories']} held-out stories whose visitor is another animal.",
    ]
    if "vllm" in ev:
        v = ev["vllm"]
        lines += ["", f"vLLM (through `vlens.Session`) against transformers, greedy, {v['prompts']} prompts: "
                  f"{v['unsteered']} identical unsteered, {v['towards_happy']} and {v['towards_sad']} identical "
                  "with the recipe's steer towards happy and towards sad."]
    return "\n".join(lines) + "\n"


def write_block(path: Path, block: str, begin: str = BEGIN, end: str = END) -> None:
    text = path.read_text()
    if begin not in text:
        raise SystemExit(f"{path} has no {begin} marker")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(f"{head}{begin}\n{block}{end}{tail}")


# ---------------------------------------------------------------------------
# --chat: the bundled chat model's refusals and the refusal direction
# ---------------------------------------------------------------------------


def chat_eval(s: Any, n: int, layers: Sequence[int], log: Any) -> dict[str, Any]:
    """Refusal rates on held-out requests through the ``vlens.Session`` ``s``
    (of the bundled chat model):
    unsteered; with the refusal direction of each layer projected out of
    every layer's ``resid_post`` (forbidden requests); with it added at its
    own layer (allowed requests); and the mood recipe on plain stories."""
    import vlens
    from vlens.models import CHAT_RECIPE, chat_world as cw

    forbidden, allowed = cw.chat_requests(True, n), cw.chat_requests(False, n)
    conv_f = [cw.conversation(r) for r in forbidden]
    conv_a = [cw.conversation(r) for r in allowed]
    pos, neg = cw.refusal_contrast(CHAT_RECIPE["pairs"])
    ev: dict[str, Any] = {"requests_per_class": n, "max_new_tokens": CHAT_NEW_TOKENS,
                          "recipe": dict(CHAT_RECIPE)}

    def texts(convs: Any, **edits: Any) -> list[str]:
        return [t.text for t in s.trace(convs, max_new_tokens=CHAT_NEW_TOKENS, **edits)]

    plain_f, plain_a = texts(conv_f), texts(conv_a)
    ev["unsteered"] = {"forbidden": cw.reply_rates(forbidden, plain_f), "allowed": cw.reply_rates(allowed, plain_a)}
    ev["examples"] = {"forbidden": [forbidden[0].text, plain_f[0]], "allowed": [allowed[0].text, plain_a[0]]}
    log(json.dumps(ev["unsteered"]))
    rows = []
    for layer in layers:
        d = s.direction(pos, neg, layer=layer)
        ablate = vlens.Ablate("resid_post", "all", direction=d)
        rows.append({"layer": layer, "direction_norm": float(d.norm()),
                     "ablated_forbidden": cw.reply_rates(forbidden, texts(conv_f, ablate=ablate)),
                     "added_allowed": {f"{x:g}": cw.reply_rates(allowed, texts(conv_a, steer=vlens.Steer(
                         d, layer=layer, scale=x, span=CHAT_RECIPE["add_span"])))
                                       for x in sorted({*CHAT_ADD_SCALES, CHAT_RECIPE["add_scale"]})},
                     # as Arditi et al. add it: at every token, generated ones too
                     "added_every_token": cw.reply_rates(allowed, texts(conv_a, steer=vlens.Steer(
                         d, layer=layer, scale=1.0)))})
        log(json.dumps(rows[-1]))
    ev["direction"] = rows
    # the mood recipe on plain stories (no conversation), as on toyworld
    d = s.direction(*world.sentiment_prompts(), layer=RECIPE["layer"])
    mood = {}
    for source, target, sign in ((world.SAD, world.HAPPY, 1.0), (world.HAPPY, world.SAD, -1.0)):
        prompts = world.steering_prompts(source, n)
        st = vlens.Steer(sign * d, layer=RECIPE["layer"], scale=RECIPE["scale"], relative=True)
        out = texts(prompts, steer=st)
        mood[f"{source}_flip"] = sum(world.sentiment_of(t) == target for t in out) / len(out)
        mood[f"{source}_formed"] = sum(world.is_well_formed(t) for t in out) / len(out)
    ev["mood_recipe"] = mood
    log(json.dumps(mood))
    return ev


def chat_markdown(ev: dict[str, Any]) -> str:
    u, r = ev["unsteered"], ev["recipe"]
    lines = [
        f"Held-out requests, {ev['requests_per_class']} forbidden and {ev['requests_per_class']} allowed, "
        f"greedy, {ev['max_new_tokens']} new tokens, through `vlens.Session`. The direction of layer L is "
        f"`s.direction(*chat_world.refusal_contrast({r['pairs']}), layer=L)` (forbidden minus allowed, "
        "`resid_post`, the last prompt token). *Ablated*: `Ablate(\"resid_post\", \"all\", direction=d)` on "
        "forbidden requests, each cell **answered with a story / well-formed**; *added ×x*: "
        f"`Steer(d, layer=L, scale=x, span=\"{r['add_span']}\")` on allowed ones (the direction added at "
        "the prompt's tokens; the reply is generated unsteered), each cell **refused / well-formed**; "
        "*every token ×1*: `Steer(d, layer=L, scale=1)`, added at the generated tokens too, as Arditi et al. do. "
        "A story counts when it follows the grammar and ends properly (the toy world's well-formed); "
        "well-formed is a refusal or such a story. *Keeps the request*: a story about the requested animal "
        "by the requested place, in the requested colour and mood when named.",
        "",
        f"Unsteered: forbidden requests {_pct(u['forbidden']['refused'])} refused, "
        f"{_pct(u['forbidden']['well_formed'])} well-formed; allowed requests {_pct(u['allowed']['refused'])} "
        f"refused, {_pct(u['allowed']['story'])} answered with a story, {_pct(u['allowed']['well_formed'])} well-formed, "
        f"{_pct(u['allowed']['keeps_request'])} keep the request.",
        "",
    ]
    scales = list(ev["direction"][0]["added_allowed"])
    lines += ["| layer | ablated everywhere (forbidden) | keeps the request | "
              + " | ".join(f"added ×{x} (allowed)" for x in scales) + " | every token ×1 (allowed) |",
              "|---|---|---|" + "---|" * (len(scales) + 1)]
    for row in ev["direction"]:
        a = row["ablated_forbidden"]
        mark = " (the recipe)" if row["layer"] == r["layer"] else ""
        cells = [f"{_pct(b['refused'])} / {_pct(b['well_formed'])}"
                 for b in [*row["added_allowed"].values(), row["added_every_token"]]]
        lines.append(f"| {row['layer']}{mark} | {_pct(a['story'])} / {_pct(a['well_formed'])} | "
                     f"{_pct(a['keeps_request'])} | " + " | ".join(cells) + " |")
    m = ev["mood_recipe"]
    lines += ["", f"The mood recipe on plain stories of this model (layer {RECIPE['layer']}, ×{RECIPE['scale']:g}): "
              f"sad→happy {_pct(m['sad_flip'])} flipped / {_pct(m['sad_formed'])} well-formed, "
              f"happy→sad {_pct(m['happy_flip'])} / {_pct(m['happy_formed'])}."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the bundled one)")
    p.add_argument("--small", action="store_true", help="a few prompts, layers and scales; writes only to --json")
    p.add_argument("--prompts", type=int, default=None, help="openings per sentiment (default 100; small 12)")
    p.add_argument("--layers", default=None, help="comma-separated layers for the grid (default: all)")
    p.add_argument("--scales", default=None, help="comma-separated relative scales (default: %s)" % ",".join(map(str, SCALES)))
    p.add_argument("--only-grid", action="store_true", help="just the steering grid")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM comparison")
    p.add_argument("--no-write", action="store_true", help="do not write JSON or the docs' tables")
    p.add_argument("--json", type=Path, default=None, help="where to write the results")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest on a busy machine)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--chat", action="store_true",
                   help="the bundled chat model instead: refusals and the refusal direction")
    args = p.parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, log)
    finally:
        torch.set_num_threads(threads)  # leave the process as it was (tests call main())


def _run_chat(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from vlens.models import toychat_path

    path = args.model or toychat_path()
    t0 = time.perf_counter()
    n = args.prompts or (12 if args.small else 100)
    if args.layers:
        layers = [int(x) for x in args.layers.split(",")]
    elif args.small:
        layers = [RECIPE["layer"]]
    else:
        layers = list(range(json.loads((path / "config.json").read_text())["num_hidden_layers"]))
    import vlens

    with vlens.Session(path) as s:
        ev = chat_eval(s, n, layers, log)
    ev["seconds"] = round(time.perf_counter() - t0, 1)
    md = chat_markdown(ev)
    log(md)
    _write(args, ev, md, path / "chat_eval.json", [ROOT / "docs" / "toyworld.md"], CHAT_BEGIN, CHAT_END)
    return ev


def _write(args: argparse.Namespace, ev: dict[str, Any], md: str, shipped: Path, docs: Sequence[Path],
           begin: str = BEGIN, end: str = END) -> None:
    """Results to ``--json``, or for a full run to ``shipped`` and, on the
    bundled model, the tables into ``docs``. A small run never overwrites
    the shipped results; it writes only to ``--json``."""
    out = args.json or (None if args.small else shipped)
    if args.no_write or out is None:
        return
    out.write_text(json.dumps(ev, indent=1) + "\n")
    if args.model is None and not args.small:
        for doc in docs:
            write_block(doc, md, begin, end)


def _run(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    if args.chat:
        return _run_chat(args, log)
    path = args.model or toyworld_path()
    model, tok = load(path)
    n_layers = model.config.num_hidden_layers
    recipe_layer, recipe_scale = RECIPE["layer"], RECIPE["scale"]
    if args.small:
        n = args.prompts or 12
        layers, scales = sorted({0, recipe_layer, n_layers - 1}), SMALL_SCALES
    else:
        n = args.prompts or 100
        layers, scales = list(range(n_layers)), SCALES
    if args.layers:
        layers = [int(x) for x in args.layers.split(",")]
    if args.scales:
        scales = [float(x) for x in args.scales.split(",")]
    t0 = time.perf_counter()
    shown = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
    ev: dict[str, Any] = {"model": str(shown), "recipe": dict(RECIPE)}
    log("steering grid")
    ev["grid"] = steering_grid(model, tok, n, layers, scales, log)
    if args.only_grid:
        return ev
    log("probes")
    ev["probes"] = probes(model, tok, 60 if args.small else 240, list(range(n_layers)))
    log(json.dumps(ev["probes"]))
    ev["attention"] = attention(model, tok, 20 if args.small else 100)
    log(json.dumps(ev["attention"]["best"]))
    if not args.no_vllm:
        log("vLLM against transformers")
        prompts = [q for s in world.SENTIMENTS for q in world.steering_prompts(s, n)]
        prompts += [q.prompt for c in ("sentiment", "colour", "animal") for q in world.probe_prompts(c, 12 if args.small else 60)]
        import vlens

        with vlens.Session(path) as session:
            ev["vllm"] = vllm_parity(model, tok, session, prompts, recipe_layer, recipe_scale)
        log(json.dumps(ev["vllm"]))
    ev["seconds"] = round(time.perf_counter() - t0, 1)
    md = markdown(ev)
    log(md)
    _write(args, ev, md, path / "steering_eval.json", [ROOT / "docs" / "toyworld.md", path / "README.md"])
    return ev


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
