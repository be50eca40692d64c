"""Measure the steer and clamp FeatureView starts at for ``smollm2-135m-instruct-sae``.

    VLENS_HOME=... python scripts/smollm2_sae_recipe.py            # measure, write measured.json
    VLENS_HOME=... python scripts/smollm2_sae_recipe.py --dry-run  # measure, print only

The shipped SAE's "whale word" feature (``measured.json``'s ``features``)
steered (its decoder row, ``relative`` to each token's norm) and clamped
(:class:`vlens.Clamp`, every token) on ``PROMPTS``: sixteen openings that
are not Moby-Dick's and name no whale. Greedy continuations of
``NEW_TOKENS`` tokens, baseline and edited in one batch (``s.compare``).
Per setting: the share of prompts whose continuation changed, the share
that names a whale (``\\bwhal``, baseline: none), the share still well
formed (no word repeated more than ``REPEATS`` times in a row, and at
least half its words distinct), and the share that does both. The recipe
is the setting where most do both; a clamp (every token set to read as a
whale word) names no whale but turns text toward the sea (``SEA``): its
recipe is the smallest value that changes >= 90% and leaves >= 90% well
formed. Written to ``measured.json``
(``"steer"``, ``"clamp"``, and the table) and quoted in docs/features.md.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import vlens
from vlens.models import get as fetch

FEATURE_NAME = "whale word"
NEW_TOKENS = 24
REPEATS = 3
PROMPTS = [
    "The old fisherman walked down to the harbour and",
    "My favourite animal has always been the",
    "Yesterday at the museum we saw a huge",
    "The children ran to the window because they heard",
    "In the story, the captain finally found the",
    "The best way to spend a summer afternoon is",
    "She opened the box and inside there was a",
    "Scientists have recently discovered that the",
    "The village was quiet until one morning a",
    "When I was young, my grandfather told me about",
    "The ship sailed north for many days, and",
    "At the bottom of the lake lived an enormous",
    "Write a short poem about the ocean:",
    "The most dangerous job in the world is",
    "He looked through the telescope and saw",
    "Here is a fact that surprises most people:",
]
SCALES = [0.05, 0.1, 0.125, 0.15, 0.2]
VALUES = [5.0, 10.0, 20.0, 40.0]
WHALE = re.compile(r"\bwhal", re.I)
#: the sea and its trades: what a clamp of the whale feature writes about
SEA = re.compile(r"\b(whal\w*|seas?|ocean\w*|ships?|sail\w*|boats?|harpoon\w*|waves?|fish\w*|"
                 r"captain|sailors?|shore|tide)\b", re.I)


def well_formed(text: str) -> bool:
    words = re.findall(r"\w+", text.lower())
    if not words:
        return False
    run = longest = 1
    for a, b in zip(words, words[1:]):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    return longest <= REPEATS and len(set(words)) >= len(words) / 2


def rates(cmp) -> dict[str, float]:
    pairs = cmp.texts
    n = len(pairs)
    return {"changed": round(sum(b != e for b, e in pairs) / n, 3),
            "whale": round(sum(bool(WHALE.search(e)) for _, e in pairs) / n, 3),
            "well_formed": round(sum(well_formed(e) for _, e in pairs) / n, 3),
            "both": round(sum(bool(WHALE.search(e)) and well_formed(e) for _, e in pairs) / n, 3),
            "sea": round(sum(bool(SEA.search(e)) for _, e in pairs) / n, 3)}


def pick(table: dict[float, dict[str, float]]) -> float:
    """The steer: the setting with the most continuations both naming a
    whale and well formed (the smaller setting on a tie)."""
    return max(table, key=lambda v: (table[v]["both"], -v))


def pick_clamp(table: dict[float, dict[str, float]]) -> float:
    """The clamp (which names no whale: it makes every token read as one,
    and the model writes what comes after a whale word): the smallest value
    that changes >= 90% of the continuations and leaves >= 90% well formed,
    else the one where most are both changed and well formed."""
    ok = [v for v, r in table.items() if r["changed"] >= 0.9 and r["well_formed"] >= 0.9]
    return min(ok) if ok else max(table, key=lambda v: (
        min(table[v]["changed"], table[v]["well_formed"]), -v))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    folder = fetch("smollm2-135m-instruct-sae")
    s = vlens.open_session(fetch("smollm2-135m-instruct"), max_model_len=512)
    sae = s.sae("smollm2-135m-instruct-sae")
    measured = sae.measured()
    feature = int(measured["features"][FEATURE_NAME]["feature"])
    base = s.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert not any(WHALE.search(t) for t in base), "a baseline names a whale already"
    steers, clamps, examples = {}, {}, {}
    for scale in SCALES:
        st = vlens.Steer(sae.decoder(feature), layer=sae.layer, scale=scale, site=sae.site,
                         relative=True)
        cmp = s.compare(PROMPTS, steer=st, max_new_tokens=NEW_TOKENS)
        steers[scale] = rates(cmp)
        examples[f"steer x{scale:g}"] = cmp.texts[0]
        print(f"steer relative x{scale:g}: {steers[scale]}  {cmp.texts[0]}", flush=True)
    for value in VALUES:
        cmp = s.compare(PROMPTS, clamp=vlens.Clamp(sae, feature, value),
                        max_new_tokens=NEW_TOKENS)
        clamps[value] = rates(cmp)
        examples[f"clamp {value:g}"] = cmp.texts[0]
        print(f"clamp {value:g}: {clamps[value]}  {cmp.texts[0]}", flush=True)
    scale, value = pick(steers), pick_clamp(clamps)
    recipe = {
        "steer": {"feature": feature, "scale": scale, "relative": True, **steers[scale]},
        "clamp": {"feature": feature, "value": value, "span": "all", **clamps[value]},
        "steering_measured": {
            "feature": f"{FEATURE_NAME} (#{feature})", "prompts": len(PROMPTS),
            "new_tokens": NEW_TOKENS, "baseline_whale": 0.0,
            "baseline_well_formed": round(sum(map(well_formed, base)) / len(base), 3),
            "baseline_sea": round(sum(bool(SEA.search(t)) for t in base) / len(base), 3),
            "command": "python scripts/smollm2_sae_recipe.py",
            "columns": ("share of prompts: continuation changed, names a whale, well formed, "
                        "both, names the sea or its trades"),
            **{f"steer relative x{k:g}": list(v.values()) for k, v in steers.items()},
            **{f"clamp {k:g}": list(v.values()) for k, v in clamps.items()},
            "seconds": round(time.time() - t0)}}
    print(json.dumps(recipe, indent=1))
    if not args.dry_run:
        path = Path(folder) / "measured.json"
        old = json.loads(path.read_text())
        old.update(recipe)
        path.write_text(json.dumps(old, indent=1) + "\n")
        print("wrote", path)
    s.close()


if __name__ == "__main__":
    main()
