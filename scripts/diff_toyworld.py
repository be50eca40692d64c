"""Diff the bundled story model and the chat model tuned from it, and
measure what the difference says (docs/methods.md, "Diffing two models").

    python scripts/diff_toyworld.py [--prompts 32] [--layer 3]

Prints: the mean KL(chat || story) on plain story openings (teacher-forced
on the opening, and on each model's own continuation); the
activation-difference lens at every layer (the mean difference over the
first 5 tokens, through each model's final norm and unembedding); whether
the story model reads the chat model's requests at all; and, with the mean
difference at a layer added to the story model at several scales, how
often its greedy continuation matches the chat model's (whole continuation
and first token), how far they agree on average, and how many
continuations are stuck repeating one token.
"""

from __future__ import annotations

import argparse
import time

import vlens
from vlens.models import chat_world as cw, toychat_path, world
from vlens.tokens import first_divergence


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--layers", default="0,1,3,5", help="layers the difference is added at")
    ap.add_argument("--new", type=int, default=24, help="tokens generated per continuation")
    ap.add_argument("--scales", default="0,1,4,8,16")
    args = ap.parse_args()
    n = args.prompts // 2
    stories = world.steering_prompts("happy", n) + world.steering_prompts("sad", n)
    base = vlens.Session(kv_cache_memory_bytes=256 * 2**20)
    chat = vlens.Session(toychat_path(), kv_cache_memory_bytes=256 * 2**20)
    t0 = time.perf_counter()
    d = vlens.diff(base, chat, stories, max_new_tokens=args.new)
    took = time.perf_counter() - t0
    print(f"diff of {len(stories)} openings, {args.new} new tokens: {took:.1f} s")
    for which in ("prompt", "base", "tuned"):
        kl = [float(d.kl(i, which)[d.text(i, which).n_prompt - 1:].mean()) if which != "prompt"
              else float(d.kl(i).mean()) for i in range(len(d))]
        print(f"mean KL(chat || story) over {which} tokens: {sum(kl) / len(kl):.4f}")
    same = sum(a == b for a, b in d.continuations)
    print(f"identical greedy continuations: {same}/{len(d)}")
    for layer in d.layers:
        for through in ("base", "tuned"):
            top = d.lens(layer, first=5, k=8, through=through)["token"].tolist()
            print(f"lens L{layer} through {through:5}: {' '.join(top)}")
    try:
        vlens.diff(base, chat, [cw.conversation(cw.chat_requests(False, 1)[0])])
    except vlens.VlensError as exc:
        print(f"requests refused: {str(exc)[:160]}")
    ref = chat.trace(stories, max_new_tokens=args.new)
    print("chat's first words:", sorted({t.output_tokens[0] for t in ref}))
    for layer in [int(x) for x in args.layers.split(",")]:
        vec = d.direction(layer, "prompt")
        print(f"layer {layer}: |mean difference| {float(vec.norm()):.0f}")
        for scale in [float(x) for x in args.scales.split(",")]:
            kw = {"steer": vlens.Steer(vec, layer=layer, scale=scale)} if scale else {}
            run = base.trace(stories, max_new_tokens=args.new, **kw)
            match = sum(a.output_token_ids == b.output_token_ids for a, b in zip(run, ref))
            first = sum(a.output_token_ids[:1] == b.output_token_ids[:1]
                        for a, b in zip(run, ref))
            agree = [first_divergence(a.output_token_ids, b.output_token_ids)
                     for a, b in zip(run, ref)]
            agree = [args.new if x is None else x for x in agree]
            stuck = sum(_stuck(t.output_token_ids) for t in run)
            words = sorted({t.output_tokens[0] for t in run if t.output_tokens})[:4]
            print(f"  scale {scale:4}: continuation = chat's {match}/{len(run)}, first token "
                  f"{first}/{len(run)}, tokens agreed {sum(agree) / len(agree):.1f}/{args.new}, "
                  f"stuck {stuck}/{len(run)}, first words {words}")
    base.close()
    chat.close()


def _stuck(ids: list[int]) -> bool:
    """A continuation stuck on one token: it is half of the tokens or more."""
    return bool(ids) and max(ids.count(x) for x in set(ids)) * 2 >= len(ids)


if __name__ == "__main__":
    main()
