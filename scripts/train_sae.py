"""Train the bundled toy-world SAE with concept features, measure them.

    python scripts/train_sae.py [--stories 1500] [--out vlens/models/toyworld_sae]

Reads ``resid_post`` at the steering recipe's layer for training stories
through vlens itself (``s.trace``), trains a TopK sparse autoencoder on the
rows (each rescaled to norm sqrt(d), SAELens's ``constant_norm_rescale``;
fixed seeds, one thread: the same run gives the same weights), saves it in
SAELens's format (cfg.json + sae_weights.safetensors), then loads it back
with ``vlens.SAE.load`` and measures, with feature reads in the engine
(``s.trace(saes=[sae])``) on held-out stories, each concept feature's
precision and recall per token, and how often steering with (and clamping)
the happy-mood feature flips held-out sad stories, judged as the toy-world
evaluation judges (``world.sentiment_of``, ``world.is_well_formed``). Prints
a JSON summary (docs/features.md) and keeps it beside the SAE
(``measured.json``: the names, the measured steer and clamp).

Why anchored. An SAE trained on reconstruction alone finds features of
this layer's rows that are about position and the next word, not about the
story's concepts: the old bundled SAE's "mood" feature fired on the mood
word only (3 tokens of 509), and no feature fired on a happy story's echo
words. What this layer does hold, linearly: the story's mood at every token
after the mood word, and the animal where the model is about to copy it
(the animal's own word is not linearly readable here: the best linear
read of "cat" scores F1 0.62, of the token before its later mentions 1.0). So the first ``len(CONCEPTS)`` latents are *anchored*: beside the
reconstruction loss, a squared hinge on each one's pre-activation asks it
to be >= MARGIN on the tokens its concept labels (``concept_labels``) and
<= -0.5 elsewhere. Their decoder rows are learned by reconstruction like
every other latent's; the other latents are plain TopK.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import vlens
from vlens.models import RECIPE, world

ROOT = Path(__file__).resolve().parents[1]
D_SAE, K = 1024, 16
#: the anchored latents, in order: feature i is CONCEPTS[i]
CONCEPTS = ([f"mood={s}" for s in world.SENTIMENTS] + [f"animal={a}" for a in world.ANIMALS]
            + [f"colour={c}" for c in world.COLOURS])
#: an anchored latent's pre-activation target on its concept's tokens
MARGIN = 4.0
#: held-out precision and recall: a feature "fires" on a token when its
#: activation (read in the engine) is above this
FIRES = 0.0
DEFINITIONS = {
    "mood": "every token of a story of that mood from its mood word on (the mood word, "
            "its eight echoes and the words between them)",
    "animal": "the token just before each later mention of a protagonist of that kind "
              "(the 'the' where the model must say the animal again)",
    "colour": "the colour's word (the home's colour)",
}
#: the slots whose word the model must copy from the first mention
MENTIONS = ("animal1", "animal2", "animal3")


def concept_labels(story: world.Story) -> torch.Tensor:
    """``[words, len(CONCEPTS)]`` bool: which concepts each word of the
    story is positive for (:data:`DEFINITIONS`)."""
    out = torch.zeros(len(story.words), len(CONCEPTS), dtype=torch.bool)
    before = {story.slots[m] - 1 for m in MENTIONS}
    for i, w in enumerate(story.words):
        for j, name in enumerate(CONCEPTS):
            kind, value = name.split("=")
            if kind == "mood":
                out[i, j] = story.sentiment == value and i >= story.slots["mood"]
            elif kind == "animal":
                out[i, j] = story.animal == value and i in before
            else:
                out[i, j] = w == value
    return out


def rows_of(s, stories: list[world.Story], layer: int) -> torch.Tensor:
    """``[words, d]``: the rows of every story's words (BOS left out)."""
    run = s.trace([st.text for st in stories], layers=[layer], sites=["resid_post"],
                  max_new_tokens=1, logprobs=False)
    out = []
    for st, t in zip(stories, run):
        assert list(t.tokens[1:1 + len(st.words)]) == list(st.words), "one token per word"
        out.append(t.activations("resid_post")[0][1:1 + len(st.words)])
    return torch.cat(out)


def rescale(x: torch.Tensor) -> torch.Tensor:
    """SAELens's ``constant_norm_rescale``: each row to norm sqrt(d_in)."""
    return x * (x.shape[1] ** 0.5 / x.norm(dim=-1, keepdim=True))


def anchor_loss(pre: torch.Tensor, y: torch.Tensor, rivals: torch.Tensor) -> torch.Tensor:
    """Squared hinge on the anchored latents' pre-activations ``[n, C]``:
    where ``y``, >= MARGIN and 0.5 above ``rivals`` (``[n, 1]``: each row's
    third largest free latent, so that a concept is among its tokens' top
    features, not only on); <= -0.5 elsewhere. Each concept's sum over the
    batch over its positives' count (a negative weighs as much as a positive)."""
    y = y.float()
    want = (rivals.detach() + 0.5).clamp_min(MARGIN)
    miss = y * (want - pre).relu().pow(2) + (1 - y) * (pre + 0.5).relu().pow(2)
    return (miss.sum(0) / (y.sum(0) + 1)).mean()


def train(x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int = 0,
          anchor: float = 4.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    x = rescale(x)
    d_in, c = x.shape[1], y.shape[1]
    w_dec = torch.randn(D_SAE, d_in)
    w_dec = w_dec / w_dec.norm(dim=1, keepdim=True)
    params = {"W_enc": w_dec.t().clone().requires_grad_(), "W_dec": w_dec.requires_grad_(),
              "b_enc": torch.zeros(D_SAE, requires_grad=True),
              "b_dec": x.mean(0).clone().requires_grad_()}
    opt = torch.optim.Adam(params.values(), lr=2e-3)
    g = torch.Generator().manual_seed(seed)
    var = float((x - x.mean(0)).pow(2).sum(-1).mean())
    for epoch in range(epochs):
        order = torch.randperm(x.shape[0], generator=g)
        total = hinge = 0.0
        for i in range(0, x.shape[0], 1024):
            idx = order[i:i + 1024]
            xb = x[idx]
            pre = (xb - params["b_dec"]) @ params["W_enc"] + params["b_enc"]
            top = pre.topk(K, dim=-1)
            acts = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
            recon = acts @ params["W_dec"] + params["b_dec"]
            mse = (recon - xb).pow(2).sum(-1).mean()
            miss = anchor_loss(pre[:, :c], y[idx], pre[:, c:].topk(3, dim=-1).values[:, -1:])
            opt.zero_grad()
            (mse + anchor * miss).backward()
            opt.step()
            with torch.no_grad():
                params["W_dec"] /= params["W_dec"].norm(dim=1, keepdim=True)
            total += float(mse.detach()) * xb.shape[0]
            hinge += float(miss.detach()) * xb.shape[0]
        print(f"epoch {epoch}: fraction of variance unexplained {total / x.shape[0] / var:.3f}, "
              f"anchor loss {hinge / x.shape[0]:.3f}", flush=True)
    return {k: v.detach().contiguous() for k, v in params.items()}


def save(weights: dict[str, torch.Tensor], out: Path, layer: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "sae_weights.safetensors"))
    cfg = {"architecture": "topk", "d_in": int(weights["W_enc"].shape[0]), "d_sae": D_SAE,
           "k": K, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
           "normalize_activations": "constant_norm_rescale", "reshape_activations": "none",
           "rescale_acts_by_decoder_norm": False,
           "metadata": {"hook_name": f"blocks.{layer}.hook_resid_post",
                        "model_name": "vlens toyworld", "trained_by": "scripts/train_sae.py",
                        "concepts": CONCEPTS}}
    (out / "cfg.json").write_text(json.dumps(cfg, indent=1) + "\n")


def measure_concepts(s, sae, stories: list[world.Story]) -> tuple[dict, float]:
    """Each concept feature's precision and recall per token on ``stories``
    (features read in the engine), and the share of the happy stories'
    happy echo words (not the mood word) whose top 5 features hold mood=happy."""
    run = s.trace([st.text for st in stories], saes=[sae], sites=[], max_new_tokens=1,
                  logprobs=False)
    acts = torch.cat([t.features(sae)[1:1 + len(st.words)] for st, t in zip(stories, run)])
    y = torch.cat([concept_labels(st) for st in stories])
    found = {}
    for j, name in enumerate(CONCEPTS):
        on, pos = acts[:, j] > FIRES, y[:, j]
        tp = int((on & pos).sum())
        found[name] = {"feature": j, "held_out_precision": round(tp / max(1, int(on.sum())), 3),
                       "held_out_recall": round(tp / max(1, int(pos.sum())), 3),
                       "positives": int(pos.sum()), "fires_on": int(on.sum()),
                       "typical": round(float(acts[pos, j].median()), 3)}
    echo = torch.tensor([st.sentiment == world.HAPPY and w in world.HAPPY_WORDS
                         and i != st.slots["mood"] for st in stories for i, w in enumerate(st.words)])
    in_top5 = (acts[echo].topk(5, dim=-1).indices == CONCEPTS.index("mood=happy")).any(-1)
    return found, round(float(in_top5.float().mean()), 3)


def flips(s, prompts, **edit) -> tuple[float, float]:
    run = s.trace(prompts, sites=[], max_new_tokens=56, logprobs=False, **edit)
    texts = [t.text for t in run]
    return (sum(world.sentiment_of(t) == world.HAPPY for t in texts) / len(texts),
            sum(world.is_well_formed(t) for t in texts) / len(texts))


def middle(rates: dict) -> tuple[float, list[float] | None]:
    """The middle of the settings whose flip and well-formed rates are both
    >= 90%, and those settings' (lowest, highest); else the setting whose worse
    rate is best, and None."""
    ok = sorted(v for v, r in rates.items() if min(r) >= 0.9)
    if ok:
        return ok[(len(ok) - 1) // 2], [ok[0], ok[-1]]
    return max(rates, key=lambda v: (min(rates[v]), -v)), None


def measure_steering(s, sae, scales, values) -> dict:
    """Steer with (and clamp) the happy-mood feature on 100 held-out sad
    openings: every setting's (flipped, well-formed), and the middle of each
    window where both are >= 90%."""
    happy, layer = CONCEPTS.index("mood=happy"), sae.layer
    sad_prompts = world.steering_prompts(world.SAD, 100)
    table = {"baseline": flips(s, sad_prompts)}
    steers, clamps = {}, {}
    for scale in scales:
        st = vlens.Steer(sae.decoder(happy), layer=layer, scale=scale, site=sae.site,
                         relative=True)
        steers[scale] = table[f"steer relative x{scale:g}"] = flips(s, sad_prompts, steer=st)
    for value in values:  # in the SAE's units: rows rescaled to norm sqrt(d_in)
        c = vlens.Clamp(sae, feature=happy, value=value)
        clamps[value] = table[f"clamp {value:g}"] = flips(s, sad_prompts, clamp=c)
    scale, win_s = middle(steers)
    value, win_c = middle(clamps)
    return {"steer": {"feature": happy, "scale": scale, "relative": True, "window": win_s,
                      "flipped": steers[scale][0], "well_formed": steers[scale][1]},
            "clamp": {"feature": happy, "value": value, "span": "all", "window": win_c,
                      "flipped": clamps[value][0], "well_formed": clamps[value][1]},
            "sad->happy (flipped, well-formed)": table}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stories", type=int, default=1500)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "vlens" / "models" / "toyworld_sae")
    ap.add_argument("--scales", type=float, nargs="+", default=[0.75, 1.0, 1.25, 1.5, 1.75, 2.0])
    ap.add_argument("--clamp-values", type=float, nargs="+",
                    default=[12.0, 18.0, 21.0, 24.0, 27.0, 30.0, 33.0, 36.0])
    ap.add_argument("--eval-only", action="store_true",
                    help="keep the saved SAE; only measure its features")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    layer = RECIPE["layer"]
    s = vlens.Session()
    if not args.eval_only:
        stories = list(itertools.islice(world.story_stream(2626), args.stories))
        x = rows_of(s, stories, layer)
        y = torch.cat([concept_labels(st) for st in stories])
        print(f"{x.shape[0]} rows read in {time.time() - t0:.0f}s", flush=True)
        save(train(x, y, args.epochs), args.out, layer)
    sae = vlens.SAE.load(args.out)
    held_out = list(itertools.islice(world.story_stream(2727, held_out=True), 400))
    found, echo_top5 = measure_concepts(s, sae, held_out)
    summary = {"trained_on_stories": args.stories, "epochs": args.epochs,
               "fires_above": FIRES, "positive_tokens": DEFINITIONS, "features": found,
               "happy_echo_words_with_mood_happy_in_top5": echo_top5,
               **measure_steering(s, sae, args.scales, args.clamp_values),
               "seconds": round(time.time() - t0)}
    print(json.dumps(summary, indent=1))
    (args.out / "measured.json").write_text(json.dumps(summary, indent=1) + "\n")
    s.close()


if __name__ == "__main__":
    main()
