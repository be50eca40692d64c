"""Train and measure the SAE that ships as ``smollm2-135m-instruct-sae``.

    python scripts/train_smollm2_sae.py --work /tmp/smollm2-sae    # harvest, train, measure
    python scripts/train_smollm2_sae.py --work /tmp/smollm2-sae --measure-only

1. harvests ``resid_post`` of layer ``LAYER`` of smollm2-135m-instruct over
   Moby-Dick (``vlens models get moby-dick``): paragraphs ``[:SPLIT]`` for
   training, ``[SPLIT:]`` (the last chapters) held out; the harvests are
   kept in ``--work`` and resumed;
2. trains with ``vlens.train_sae`` (SAELens's trainer) into ``--out``
   (default the package's ``vlens/models/smollm2_sae``), bfloat16;
3. measures on the held-out paragraphs, in the engine: each token's
   features read in the worker (``trace(saes=[sae])``), FVU against the
   rows read in the same trace, mean L0, features that never fire, and the
   next-token loss with every row but each text's first (the attention
   sink, left out of training) replaced by the SAE's reconstruction in the
   engine (an ``edit=`` at the SAE's site) against without; writes them
   to ``measured.json`` beside the SAE (``"held_out"``);
4. (``--features``) for each rule of ``RULES`` (a regex on a token's text),
   picks the feature that best matches it on the training harvest (F1 of
   "fires" against "the rule holds", each text's first token aside), then
   measures that feature's precision and recall against the rule on the
   held-out paragraphs, its features read in the worker; writes them to
   ``measured.json`` (``"features"``: rule name -> feature, rule, figures).

The numbers are quoted in docs/features.md; tests/test_real_sae.py checks
them again on part of the held-out text.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

import vlens
from vlens.models import corpus

LAYER = 15
#: paragraphs [SPLIT:] (from the fifth paragraph of chapter 125, "The Log and
#: Line", to the epilogue: 28,303 tokens) are held out
SPLIT = 2118
OUT = Path(__file__).resolve().parents[1] / "vlens" / "models" / "smollm2_sae"


#: rules a reader can check, on the text of the token itself (no digit rule:
#: the held-out chapters hold no digits)
RULES = {
    "quotation mark": r"[\"“”]",
    "question mark": r"\?",
    "exclamation mark": r"!",
    "semicolon": r";",
    "em dash": r"—",
    "comma": r",",
    "the": r"^\s?[Tt]he$",
    "whale word": r"^\s?[Ww]hal",
    "he/him/his": r"^\s?([Hh]e|[Hh]im|[Hh]is)$",
    "capitalised word": r"^\s?[A-Z][a-z]",
}


def rule_labels(token_texts: list[str], rules=None) -> torch.Tensor:
    """``[tokens, rules]`` bool: which rules (default ``RULES``) each token's
    text satisfies."""
    rules = [re.compile(r) for r in (RULES.values() if rules is None else rules)]
    return torch.tensor([[bool(r.search(t)) for r in rules] for t in token_texts])


def _f1(on: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """F1 of each column of ``on`` ``[n, c]`` against ``labels`` ``[n]``."""
    both = (on & labels[:, None]).sum(0).float()
    return 2 * both / (on.sum(0) + labels.sum()).clamp(min=1)


def find_features(sae, h, token_text, candidates: int = 5) -> dict:
    """Per rule, on harvest ``h`` (each text's first token aside): the five
    features whose firing best matches it (F1), then the one and the
    activation threshold (``fires_above``: 0, or a quantile of its
    activations) with the best F1."""
    x = h.read("resid_post", LAYER)
    ids = h.token_ids
    keep = torch.ones(len(x), dtype=torch.bool)
    keep[[a for a, _ in h.spans]] = False
    x, ids = x[keep], ids[keep]
    labels = rule_labels([token_text(int(i)) for i in ids])
    both = torch.zeros(len(RULES), sae.d_sae)
    fires = torch.zeros(sae.d_sae)
    for i in range(0, len(x), 16384):
        f = (sae.encode(x[i:i + 16384]) > 0).float()
        both += labels[i:i + 16384].float().T @ f
        fires += f.sum(0)
    f1 = 2 * both / (fires[None, :] + labels.sum(0)[:, None]).clamp(min=1)
    top = f1.topk(candidates, dim=1).indices  # [rules, candidates]
    feats = top.flatten().unique()
    acts = torch.cat([sae.encode(x[i:i + 16384])[:, feats] for i in range(0, len(x), 16384)])
    out = {}
    for j, (name, rule) in enumerate(RULES.items()):
        best = (-1.0, 0, 0.0)
        for f in top[j].tolist():
            a = acts[:, (feats == f).nonzero()[0, 0]]
            grid = torch.cat([torch.zeros(1), a[a > 0].quantile(torch.linspace(0, 0.9, 19))])
            scores = _f1(a[:, None] > grid[None, :], labels[:, j])
            g = int(scores.argmax())
            if float(scores[g]) > best[0]:
                best = (float(scores[g]), f, float(grid[g]))
        out[name] = {"feature": best[1], "rule": rule, "fires_above": round(best[2], 3),
                     "train_f1": round(best[0], 3)}
    return out


def measure_features(s, sae, texts, chosen: dict, token_text, batch: int = 16) -> dict:
    """Each chosen feature's precision and recall against its rule on
    ``texts`` (a token counts as firing above the feature's ``fires_above``),
    its activations read in the worker (``features_top_k=k``)."""
    feats = torch.tensor([c["feature"] for c in chosen.values()])
    above = torch.tensor([c["fires_above"] for c in chosen.values()])
    tp = torch.zeros(len(feats))
    fired = torch.zeros(len(feats))
    pos = torch.zeros(len(feats))
    for i in range(0, len(texts), batch):
        run = s.trace(texts[i:i + batch], sites=[], saes=[sae], features_top_k=sae.spec.k,
                      max_new_tokens=1, logprobs=False)
        for t in run:
            T = len(t.prompt_token_ids)
            on = t.features(sae)[1:T][:, feats] > above
            lab = rule_labels([token_text(i) for i in t.prompt_token_ids[1:T]],
                              [c["rule"] for c in chosen.values()])
            tp += (on & lab).sum(0)
            fired += on.sum(0)
            pos += lab.sum(0)
    out = {}
    for j, (name, c) in enumerate(chosen.items()):
        out[name] = {**c, "held_out_precision": round(float(tp[j] / fired[j].clamp(min=1)), 3),
                     "held_out_recall": round(float(tp[j] / pos[j].clamp(min=1)), 3),
                     "positives": int(pos[j]), "fires_on": int(fired[j])}
    return out


def harvest(s, texts, folder: Path):
    t0 = time.perf_counter()
    h = s.harvest(texts, layers=[LAYER], out=folder, shard_tokens=32768, progress=True)
    print(f"harvest {folder.name}: {len(h):,} tokens, {time.perf_counter() - t0:.0f} s")
    return h


def splice(sae):
    """An ``edit=`` replacing each row after the first by the SAE's reconstruction."""
    def fn(rows, ctx):
        keep = torch.tensor(ctx.positions) == 0
        out = sae.decode(sae.encode(rows.float())).to(rows.dtype)
        out[keep] = rows[keep]
        return out
    return fn


def measure(s, sae, texts, batch: int = 16) -> dict:
    """FVU, L0, dead features and the loss with and without the splice, over
    ``texts`` (each text's first token left out of every figure)."""
    sq_err = 0.0
    n = 0
    total = torch.zeros(sae.d_in, dtype=torch.float64)
    total_sq = 0.0
    l0 = 0.0
    fired = torch.zeros(sae.d_sae, dtype=torch.bool)
    loss = loss_spliced = 0.0
    n_pred = 0
    for i in range(0, len(texts), batch):
        part = texts[i:i + batch]
        run = s.trace(part, sites=["resid_post"], layers=[sae.layer], saes=[sae],
                      max_new_tokens=1)
        spliced = s.trace(part, sites=[], max_new_tokens=1, edit=splice(sae),
                          edit_at=[(sae.site, sae.layer)])
        for t, u in zip(run, spliced):
            T = len(t.prompt_token_ids)
            x = t.activations("resid_post", layer=sae.layer)[1:T].double()
            f = t.features(sae)[1:T]
            r = sae.decode(f).double()
            sq_err += float(((x - r) ** 2).sum())
            total += x.sum(0)
            total_sq += float((x ** 2).sum())
            n += x.shape[0]
            l0 += float((f > 0).sum())
            fired |= (f > 0).any(0)
            # logprobs[j]: of token j given the tokens before it; j >= 2 are
            # predicted from rows that include a spliced one
            lp = torch.tensor(t.logprobs[2:T], dtype=torch.float64)
            lq = torch.tensor(u.logprobs[2:T], dtype=torch.float64)
            loss -= float(lp.sum())
            loss_spliced -= float(lq.sum())
            n_pred += lp.numel()
        print(f"  measured {min(i + batch, len(texts))}/{len(texts)} texts", flush=True)
    variance = total_sq - float((total ** 2).sum()) / n
    return {"texts": len(texts), "tokens": n, "fvu": round(sq_err / variance, 4),
            "mean_l0": round(l0 / n, 2),
            "dead_fraction": round(1 - float(fired.float().mean()), 4),
            "loss": round(loss / n_pred, 4), "loss_spliced": round(loss_spliced / n_pred, 4),
            "loss_increase": round((loss_spliced - loss) / n_pred, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="where the harvests go")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--k", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=150 * 4096, help="training samples")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--measure-only", action="store_true")
    ap.add_argument("--features", action="store_true",
                    help="also find and measure the features of RULES")
    ap.add_argument("--features-only", action="store_true",
                    help="only find and measure the features (keep the held-out statistics)")
    ap.add_argument("--measure-texts", type=int, default=None,
                    help="measure on the first N held-out paragraphs (default all)")
    args = ap.parse_args()

    texts = corpus.paragraphs(vlens.models.get("moby-dick"))
    model = str(vlens.models.get("smollm2-135m-instruct"))
    with vlens.Session(model, max_model_len=1024) as s:
        if not (args.measure_only or args.features_only):
            h = harvest(s, texts[:SPLIT], args.work / "train")
            harvest(s, texts[SPLIT:], args.work / "held-out")
            vlens.train_sae(h, layer=LAYER, width=args.width, k=args.k, out=args.out,
                            tokens=args.tokens, lr=args.lr, dtype="bfloat16")
        sae = vlens.SAE.load(args.out)
        held_out = texts[SPLIT:][:args.measure_texts]
        stats = None
        if not args.features_only:
            stats = measure(s, sae, held_out)
            print(json.dumps(stats, indent=1))
        features = None
        if args.features or args.features_only:
            tok = s.tokenizer
            chosen = find_features(sae, vlens.Harvest.open(args.work / "train"),
                                   lambda i: tok.decode([i]))
            features = measure_features(s, sae, held_out, chosen, lambda i: tok.decode([i]))
            print(json.dumps(features, indent=1))
    path = args.out / "measured.json"
    measured = json.loads(path.read_text()) if path.is_file() else {}
    if stats is not None:
        measured["held_out"] = {"paragraphs": f"moby-dick paragraphs [{SPLIT}:]", **stats}
    if features is not None:
        measured.pop("fires_above", None)  # each feature has its own
        measured["features"] = features
    path.write_text(json.dumps(measured, indent=1) + "\n")


if __name__ == "__main__":
    main()
