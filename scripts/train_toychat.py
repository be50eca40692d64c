#!/usr/bin/env python
"""Train the bundled chat model (toy world v3) from the bundled toyworld model.

Starts from ``vlens/models/toyworld`` (its weights and its tokenizer's ids),
adds the chat words and role tokens of :mod:`vlens.models.chat_world`, and
fine-tunes on a mix: a quarter plain stories (so stories without a
conversation still work as before), the rest conversations -- a request and its reply, the
loss on the reply only. A fifth of the requests ask for a wild animal by the
water and are answered with the fixed refusal; the others with "sure." and
the story, whose first sentence (where the request is copied) weighs five
times the rest in the loss.

Then it measures, with Hugging Face and forward hooks, what
``scripts/eval_toyworld.py --chat`` measures through vlens: refusal rates on
held-out requests, and the refusal direction (difference of means at the last
prompt token, forbidden minus allowed) projected out of every layer and added
at one. It writes ``vlens/models/toychat`` (config, float16 weights, the
tokenizer with its chat template, ``evaluation.json``).

Usage::

    python scripts/train_toychat.py                  # full run -> vlens/models/toychat
    python scripts/train_toychat.py --steps 40 --out /tmp/tc --eval 20

Same seed, same thread count, same library versions: same weights.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

import train_toyworld as tw
from vlens.models import CHAT_RECIPE, RECIPE, chat_world as cw, toyworld_path, world
from vlens.testing import hf_steering_hook

DEFAULT_OUT = ROOT / "vlens" / "models" / "toychat"
SEED = 3
THREADS = 1  # one thread: on a busy 2-core machine two are several times slower


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The toyworld tokenizer with v3's words and role tokens appended (every
    story token keeps its id) and the chat template."""
    words = world.vocabulary() + cw.chat_words() + list(cw.CHAT_TOKENS)
    vocab = {w: i for i, w in enumerate(words)}
    sp = world.SPECIAL_TOKENS
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=sp["unk_token"]))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated")])
    bos = sp["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                  model_max_length=512, **sp)
    out.add_special_tokens({"additional_special_tokens": list(cw.CHAT_TOKENS)})
    out.chat_template = cw.CHAT_TEMPLATE
    for t in cw.CHAT_TOKENS:  # the role tokens are the ids appended above
        assert out.convert_tokens_to_ids(t) == vocab[t], t
    return out


def prompt_ids(tok: PreTrainedTokenizerFast, request: cw.Request | str) -> list[int]:
    return list(tok.apply_chat_template(cw.conversation(request), add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def batches(seed: int, batch: int, tok: PreTrainedTokenizerFast, share: float = 0.25,
            content_weight: float = 1.0, decision_weight: float = 1.0
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, labels, weights): a quarter of each batch plain stories
    (loss on every token), the rest conversations (loss on the reply and its
    ``</s>`` only); right-padded, -100 on padding. ``weights`` is each
    label's weight in the loss: ``content_weight`` on the first sentence of
    an answered reply (where the request's animal, mood, colour and place
    are copied), ``decision_weight`` on a reply's first word (``sure`` or
    ``sorry``: whether the request is refused), 1 elsewhere."""
    vocab = tok.get_vocab()
    pad, eos = vocab["<pad>"], vocab["</s>"]
    stories = iter(world.story_stream(seed))
    requests = iter(cw.request_stream(seed + 1, forbidden_share=share))
    rng = random.Random(seed + 2)
    while True:
        seqs: list[tuple[list[int], int]] = []
        for _ in range(batch // 4):
            seqs.append((tw.encode_story(next(stories), vocab), 0))
        for _ in range(batch - batch // 4):
            r = next(requests)
            p = prompt_ids(tok, r)
            reply = [vocab[w] for w in world.split_words(cw.reply_for(r, rng))]
            seqs.append((p + reply + [eos], len(p)))
        width = max(len(x) for x, _ in seqs)
        ids = torch.full((batch, width), pad, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        weights = torch.ones((batch, width))
        for i, (x, masked) in enumerate(seqs):
            ids[i, : len(x)] = torch.tensor(x)
            labels[i, masked: len(x)] = torch.tensor(x[masked:])
            if masked:
                weights[i, masked] = decision_weight
            if masked and x[masked] == vocab[world.split_words(cw.COMPLY)[0]]:
                first = masked + len(world.split_words(cw.COMPLY))
                end = x.index(vocab["."], first)  # the story's first sentence
                weights[i, first: end + 1] = content_weight
        yield ids, labels, weights


def grow_vocab(model: LlamaForCausalLM, size: int, seed: int) -> None:
    """New embedding and unembedding rows: the mean of the old ones plus a
    little seeded noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("embed", "head"):
            old = (model.get_input_embeddings() if name == "embed" else model.get_output_embeddings()).weight
            n, d = old.shape
            new = torch.empty(size, d)
            new[:n] = old
            new[n:] = old.mean(0) + 0.02 * torch.randn(size - n, d, generator=g)
            if name == "embed":
                emb = torch.nn.Embedding(size, d)
                emb.weight.data = new
                model.set_input_embeddings(emb)
            else:
                head = torch.nn.Linear(d, size, bias=False)
                head.weight.data = new
                model.set_output_embeddings(head)
    model.config.vocab_size = size


# ---------------------------------------------------------------------------
# Evaluation with Hugging Face hooks
# ---------------------------------------------------------------------------


@torch.no_grad()
def generate(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, prompts: Sequence[list[int]],
             max_new_tokens: int, chunk: int = 50) -> list[str]:
    """Greedy replies (text, special tokens dropped), left padding."""
    pad = tok.pad_token_id
    texts: list[str] = []
    for i in range(0, len(prompts), chunk):
        part = prompts[i: i + chunk]
        width = max(len(p) for p in part)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in part])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part])
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=pad)
        texts.extend(tok.batch_decode(out[:, width:], skip_special_tokens=True))
    return texts


@torch.no_grad()
def last_states(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast,
                prompts: Sequence[list[int]]) -> list[torch.Tensor]:
    """Each decoder layer's output at each prompt's last token: ``[layers][N, H]``."""
    pad = tok.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [pad] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    seen: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
               for layer in model.model.layers]  # in layer order: the forward runs them so
    try:
        model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    last = mask.sum(1) - 1
    return [h[torch.arange(len(last)), last] for h in seen]


@contextmanager
def hooks(model: LlamaForCausalLM, *, project: torch.Tensor | None = None,
          add: tuple[int, torch.Tensor] | None = None) -> Iterator[None]:
    """``project``: remove the direction from every decoder layer's output
    (resid_post at every layer); ``add``: (layer, vector) added to that
    layer's output at the prompt's positions (the prefill forward; the
    recipe's ``add_span``), not at generated tokens."""
    with ExitStack() as stack:
        if project is not None:
            u = project / project.norm()
            for layer in model.model.layers:
                h = hf_steering_hook(layer, lambda x: x - (x @ u)[..., None] * u)
                stack.callback(h.remove)
        if add is not None:
            layer, v = add
            h = hf_steering_hook(model.model.layers[layer],
                                 lambda x: x + v if x.shape[1] > 1 else x)
            stack.callback(h.remove)
        yield


def evaluate(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, n: int,
             layers: Sequence[int] | None = None, log: Any = print) -> dict[str, Any]:
    ev: dict[str, Any] = {}
    forbidden, allowed = cw.chat_requests(True, n), cw.chat_requests(False, n)
    pf, pa = [prompt_ids(tok, r) for r in forbidden], [prompt_ids(tok, r) for r in allowed]
    ev["unsteered"] = {"forbidden": cw.reply_rates(forbidden, generate(model, tok, pf, 72)),
                       "allowed": cw.reply_rates(allowed, generate(model, tok, pa, 72))}
    log(f"unsteered: {ev['unsteered']}")
    # the direction from training-distribution requests (never the held-out ones)
    cf, ca = cw.refusal_contrast(64)
    train_f = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)) for c in cf]
    train_a = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)) for c in ca]
    sf, sa = last_states(model, tok, train_f), last_states(model, tok, train_a)
    dirs = [f.mean(0) - a.mean(0) for f, a in zip(sf, sa)]
    norms = [float(torch.cat([f, a]).norm(dim=-1).mean()) for f, a in zip(sf, sa)]
    ev["direction_norms"] = [float(d.norm()) for d in dirs]
    ev["residual_norms"] = norms
    rows = []
    for layer, d in enumerate(dirs):
        if layers is not None and layer not in layers:
            continue
        with hooks(model, project=d):
            abl = cw.reply_rates(forbidden, generate(model, tok, pf, 72))
        with hooks(model, add=(layer, d * CHAT_RECIPE["add_scale"])):
            add = cw.reply_rates(allowed, generate(model, tok, pa, 72))
        rows.append({"layer": layer, "ablated_forbidden": abl, "added_allowed": add})
        log(f"layer {layer}: ablated {abl} | added {add}")
    ev["direction"] = rows
    return ev


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval", type=int, default=100, help="held-out requests per class")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--share", type=float, default=0.25, help="forbidden share of the requests")
    ap.add_argument("--content-weight", type=float, default=5.0,
                    help="loss weight of an answer's first sentence (copying the request)")
    ap.add_argument("--decision-weight", type=float, default=1.0,
                    help="loss weight of a reply's first word (sure / sorry: the refusal decision)")
    ap.add_argument("--layers", default=str(CHAT_RECIPE["layer"]),
                    help="layers whose refusal direction the script measures (eval_toyworld.py --chat: all)")
    ap.add_argument("--smoke", action="store_true", help="2 steps, 2 requests per class, one layer (tests)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.eval = 2, 4, 2
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    try:
        return _train(args, log)
    finally:  # leave the process as it was (tests call main())
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    tok = build_tokenizer()
    model = LlamaForCausalLM.from_pretrained(toyworld_path(), dtype=torch.float32)
    model.config._attn_implementation = "eager"
    grow_vocab(model, len(tok), SEED)
    opt, sched = tw.optimizer(model, args.lr, 0.01, max(1, args.steps // 20), args.steps)
    data = batches(SEED, args.batch, tok, args.share, args.content_weight, args.decision_weight)
    model.train()
    losses: list[float] = []
    for step in range(1, args.steps + 1):
        ids, labels, weights = next(data)
        # float32: bfloat16 autocast only pays on CPUs with AVX512-BF16 (and
        # is emulated, several times slower, on those without)
        logits = model(input_ids=ids).logits[:, :-1]
        target, w = labels[:, 1:], weights[:, 1:] * (labels[:, 1:] != -100)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                               ignore_index=-100, reduction="none")
        loss = (ce * w.reshape(-1)).sum() / w.sum()
        losses.append(tw.update(model, opt, sched, loss))
        if step % 10 == 0 or step == args.steps:
            log(f"step {step}: loss {sum(losses[-10:]) / len(losses[-10:]):.4f} "
                  f"({time.perf_counter() - t0:.0f} s)")
    train_seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        tw.round_weights(model)
    model.generation_config = tw.generation_config(tok)
    ev = evaluate(model, tok, args.eval, [RECIPE["layer"]] if args.smoke else [int(x) for x in args.layers.split(",")], log)
    settings = tw.Settings(max_new_tokens=64, steer_prompts=min(100, args.eval))
    ev["mood_recipe"] = {"layer": RECIPE["layer"], "scale": RECIPE["scale"],
                         "steered": tw.steering_eval(model, tok, settings, RECIPE["layer"], RECIPE["scale"])}
    log(f"mood recipe on plain stories: {ev['mood_recipe']['steered']}")
    record = {"seed": SEED, "threads": args.threads, "steps": args.steps, "batch": args.batch, "lr": args.lr,
              "forbidden_share": args.share, "content_weight": args.content_weight,
              "decision_weight": args.decision_weight,
              "base": "vlens/models/toyworld",
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__},
              "train_seconds": round(train_seconds, 1), "losses": [round(x, 5) for x in losses],
              "total_seconds": round(time.perf_counter() - t0, 1), "evaluation": ev}
    tw.write_model(model, tok, args.out)
    (args.out / "evaluation.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"wrote {args.out} in {record['total_seconds']} s")
    return record


if __name__ == "__main__":
    main()
