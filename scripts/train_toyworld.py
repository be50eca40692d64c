#!/usr/bin/env python
"""Train the bundled toyworld model from scratch and evaluate it.

Generates the synthetic stories of ``vlens.models.world`` on the fly, trains a
small Llama on them (CPU, seeded, deterministic), then measures what the
model knows on held-out concept combinations and writes the model folder:

* ``config.json``, ``generation_config.json``, ``model.safetensors``
* ``tokenizer.json``, ``tokenizer_config.json`` (a word-level fast tokenizer)
* ``evaluation.json`` -- every number below, plus the steering recipe
* ``README.md`` -- the model card, quoting those numbers

Usage::

    python scripts/train_toyworld.py                       # full run -> vlens/models/toyworld
    python scripts/train_toyworld.py --steps 300 --out /tmp/tw
    python scripts/train_toyworld.py --smoke --out /tmp/smoke   # tiny, < 1 minute

Same seed, same thread count, same library versions: same weights, same numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from vlens.models import RECIPE, world
from vlens.testing import hf_steering_hook

DEFAULT_OUT = ROOT / "vlens" / "models" / "toyworld"


# ---------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    steps: int = 1000
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    hidden: int = 384
    layers: int = 6
    heads: int = 12
    intermediate: int = 768
    # Training runs the forward pass under bfloat16 autocast (about 3x faster
    # on a CPU with AVX512-BF16; the master weights stay float32).
    bf16_autocast: bool = True
    # The weights are stored rounded to float16 (half the size) and evaluated
    # as stored, i.e. rounded and run in float32 (see round_weights).
    store_float16: bool = True
    eval_every: int = 25  # learning-curve probes every this many steps ...
    eval_dense_until: int = 500  # ... up to here, then every 250
    curve_probes: int = 60  # per concept, for the learning curve
    probes: int = 240  # per concept, final evaluation (all held-out)
    steer_prompts: int = 100  # per sentiment, final evaluation (all held-out)
    direction_pairs: int = 64  # minimal pairs for the difference of means
    max_new_tokens: int = 64
    # The steering recipe (see AddToLayer): decoder layer, relative scale.
    steer_layer: int = RECIPE["layer"]
    steer_scale: float = RECIPE["scale"]
    sweep: bool = False  # also evaluate a grid of layers and scales (eval_toyworld.py has the full one)


FULL = Settings()
SMOKE = Settings(
    steps=12,
    batch=8,
    warmup=2,
    hidden=32,
    layers=2,
    heads=2,
    intermediate=64,
    eval_every=6,
    eval_dense_until=12,
    curve_probes=8,
    probes=16,
    steer_prompts=4,
    direction_pairs=8,
    max_new_tokens=16,
    steer_layer=1,
    sweep=False,
)

SWEEP_SCALES = (
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
)  # relative: x each token's residual norm
SWEEP_FIXED_SCALES = (1.0, 1.25, 1.5, 2.0)  # fixed: x the raw difference of means


# ---------------------------------------------------------------------------
# Tokenizer and model
# ---------------------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level fast tokenizer over :func:`world.vocabulary`.

    Lower-cases, splits on spaces and around punctuation, prepends ``<s>``
    when special tokens are added, and decodes with spaces between words but
    none before ``.`` or ``,``.
    """
    words = world.vocabulary()
    vocab = {w: i for i, w in enumerate(words)}
    sp = world.SPECIAL_TOKENS
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=sp["unk_token"]))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation("isolated")]
    )
    bos = sp["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, vocab[bos])],
    )
    # WordPiece's decoder joins words with spaces; ``cleanup`` removes the
    # space before punctuation. No "##" pieces exist in this vocabulary.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
        **sp,
    )


def build_config(s: Settings, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads,
        head_dim=s.hidden // s.heads,
        hidden_act="silu",
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


def encode_story(story: world.Story, vocab: dict[str, int]) -> list[int]:
    return [vocab["<s>"]] + [vocab[w] for w in story.words] + [vocab["</s>"]]


def batches(
    seed: int, batch: int, vocab: dict[str, int]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input_ids, labels) batches, right-padded; labels -100 on padding."""
    pad = vocab["<pad>"]
    stream = iter(world.story_stream(seed))
    while True:
        seqs = [encode_story(next(stream), vocab) for _ in range(batch)]
        width = max(len(x) for x in seqs)
        ids = torch.full((batch, width), pad, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, : len(x)] = torch.tensor(x)
            labels[i, : len(x)] = torch.tensor(x)
        yield ids, labels


def entropy_floor(samples: int = 2000, seed: int = 5) -> float:
    """Best possible loss (nats per predicted token) on the training corpus.

    Each random choice in a story costs its entropy; the expected sum is
    divided by the mean number of predicted tokens (the words plus EOS).
    """
    p = world.ECHO_FIDELITY
    hb = -(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0 < p < 1 else 0.0
    n_combos = 2 * len(world.ANIMALS) * len(world.COLOURS) - len(world.HELD_OUT)
    def echo(table: dict[str, Sequence[Any]]) -> float:
        # which sentiment the echo takes, then which word of that sentiment
        return hb + math.log(len(table[world.HAPPY]))

    per_story = (
        math.log(n_combos)  # (sentiment, animal, colour), uniform over training combos
        + math.log(len(world.OPENINGS))
        + math.log(len(world.MOODS[world.HAPPY]))
        + math.log(len(world.HOMES))
        + math.log(len(world.PLACES))
        + echo(world.ADVERBS)
        + echo(world.SKIES)
        + echo(world.WINDS)
        + math.log(2)  # sky or wind first
        + math.log(2)  # visitor or not ...
        + 0.5 * (math.log(len(world.ANIMALS)) + echo(world.GREETS))  # ... which, and what it says
        + echo(world.GOES)
        + echo(world.FINDS)
        + math.log(4 * 3)  # two distinct things
        + echo(world.VERB_PAIRS)
        + echo(world.FEELINGS)
    )
    stream = iter(world.story_stream(seed))
    mean_tokens = sum(len(next(stream).words) + 1 for _ in range(samples)) / samples
    return per_story / mean_tokens


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------


@torch.no_grad()
def next_token_top1(
    model: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    chunk: int = 64,
) -> list[str]:
    """Greedy next word after each prompt (right padding, read at the last real position)."""
    out: list[str] = []
    tok.padding_side = "right"
    for i in range(0, len(prompts), chunk):
        enc = tok(list(prompts[i : i + chunk]), padding=True, return_tensors="pt")
        logits = model(
            input_ids=enc.input_ids, attention_mask=enc.attention_mask
        ).logits
        last = enc.attention_mask.sum(1) - 1
        ids = logits[torch.arange(len(last)), last].argmax(-1).tolist()
        out.extend(tok.convert_ids_to_tokens(ids))
    return out


def probe_accuracy(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, n: int
) -> dict[str, float]:
    acc: dict[str, float] = {}
    for concept in ("sentiment", "colour", "animal"):
        probes = world.probe_prompts(concept, n)
        top = next_token_top1(model, tok, [p.prompt for p in probes])
        acc[concept] = sum(t in p.allowed for t, p in zip(top, probes)) / len(probes)
    return acc


@torch.no_grad()
def last_token_states(
    model: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    layer: int,
) -> torch.Tensor:
    """Output of decoder layer ``layer`` (the residual stream, captured with a
    forward hook: for the last layer this is *before* the final norm, unlike
    ``hidden_states[-1]``) at each prompt's last token."""
    captured: list[torch.Tensor] = []

    def hook(module: Any, args: Any, output: Any) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output)

    tok.padding_side = "right"
    enc = tok(list(prompts), padding=True, return_tensors="pt")
    handle = model.model.layers[layer].register_forward_hook(hook)
    try:
        model(**enc)
    finally:
        handle.remove()
    last = enc.attention_mask.sum(1) - 1
    return captured[0][torch.arange(len(last)), last]


def sentiment_direction(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, layer: int, pairs: int
) -> tuple[torch.Tensor, float, float]:
    """Difference of means (happy - sad) of the last-token output of decoder
    layer ``layer`` over :func:`world.sentiment_prompts` (minimal pairs cut
    just before a sentiment word).

    Returns (difference, its norm, mean residual norm of those tokens).
    """
    happy, sad = world.sentiment_prompts(pairs)
    h = last_token_states(model, tok, happy, layer)
    s = last_token_states(model, tok, sad, layer)
    diff = h.mean(0) - s.mean(0)
    return diff, float(diff.norm()), float(torch.cat([h, s]).norm(dim=-1).mean())


class AddToLayer:
    """Context manager: a forward hook on decoder layer ``layer`` that steers
    its output at every position.

    ``relative=True`` (the recipe): add ``scale * |h_t| * direction`` to each
    token's residual ``h_t``, i.e. turn every token by the same angle, however
    large its residual is. ``relative=False``: add the fixed ``scale * direction``.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        layer: int,
        direction: torch.Tensor,
        scale: float,
        relative: bool = True,
    ):
        self.module = model.model.layers[layer]
        self.direction = direction
        self.scale = scale
        self.relative = relative
        self.handle: Any = None

    def steer(self, h: torch.Tensor) -> torch.Tensor:
        if self.relative:
            return h + self.scale * h.norm(dim=-1, keepdim=True) * self.direction
        return h + self.scale * self.direction

    def __enter__(self) -> Self:
        self.handle = hf_steering_hook(self.module, self.steer)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


@torch.no_grad()
def greedy(
    model: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    max_new_tokens: int,
    chunk: int = 50,
) -> list[str]:
    """Greedy continuations (text of the new tokens only), batched with left padding."""
    texts: list[str] = []
    tok.padding_side = "left"
    try:
        for i in range(0, len(prompts), chunk):
            enc = tok(list(prompts[i : i + chunk]), padding=True, return_tensors="pt")
            out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
            new = out[:, enc.input_ids.shape[1] :]
            texts.extend(tok.batch_decode(new, skip_special_tokens=True))
    finally:
        tok.padding_side = "right"
    return texts


def story_rates(
    prompts: Sequence[str], texts: Sequence[str], target: str | None = None
) -> dict[str, int]:
    """Counts over greedy continuations ``texts`` of ``prompts``."""
    return {
        "flipped": sum(
            target is not None and world.sentiment_of(t) == target for t in texts
        ),
        "well_formed": sum(world.is_well_formed(t) for t in texts),
        "grammatical": sum(
            world.parse_story(p + " " + t) is not None for p, t in zip(prompts, texts)
        ),
        "faithful": sum(
            not world.story_problems(p + " " + t) for p, t in zip(prompts, texts)
        ),
    }


def steering_eval(
    model: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    s: Settings,
    layer: int,
    scale: float | None,
    relative: bool = True,
) -> dict[str, float]:
    """Greedy stories from held-out openings, steered or not.

    Sad openings are steered towards happy (+v) and happy openings towards sad
    (-v); ``scale=None`` is the unsteered baseline. With ``relative=False`` the
    fixed vector is ``scale`` times the raw difference of means (not the unit
    direction). Rates over all prompts:
    ``flip_rate`` (the continuation's sentiment words are mostly the opposite
    of the opening's), ``well_formed_rate`` (:func:`world.is_well_formed`),
    ``grammatical_rate`` (:func:`world.parse_story` accepts the whole story)
    and ``faithful_rate`` (no :func:`world.story_problems`: animal copied,
    things match the colour, ...).
    """
    counts = {"flipped": 0, "well_formed": 0, "grammatical": 0, "faithful": 0}
    total = 0
    examples: list[str] = []
    for source, target, sign in (
        (world.SAD, world.HAPPY, 1.0),
        (world.HAPPY, world.SAD, -1.0),
    ):
        prompts = world.steering_prompts(source, s.steer_prompts)
        if scale is None:
            texts = greedy(model, tok, prompts, s.max_new_tokens)
        else:
            diff, raw, _ = sentiment_direction(model, tok, layer, s.direction_pairs)
            amount = sign * scale * (1.0 if relative else raw)
            with AddToLayer(model, layer, diff / raw, amount, relative):
                texts = greedy(model, tok, prompts, s.max_new_tokens)
        for k, v in story_rates(prompts, texts, target).items():
            counts[k] += v
        total += len(texts)
        examples.append(f"{prompts[0]} {texts[0]}")
    return {
        "flip_rate": counts["flipped"] / total,
        "well_formed_rate": counts["well_formed"] / total,
        "grammatical_rate": counts["grammatical"] / total,
        "faithful_rate": counts["faithful"] / total,
        "prompts": total,
        "examples": examples,
    }


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def optimizer(model: LlamaForCausalLM, lr: float, weight_decay: float, warmup: int,
              steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no decay on norms and biases) and its schedule: linear warm-up
    over ``warmup`` steps, then cosine down to a tenth at ``steps``."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def update(model: LlamaForCausalLM, opt: torch.optim.Optimizer,
           sched: torch.optim.lr_scheduler.LambdaLR, loss: torch.Tensor) -> float:
    """One training step from ``loss`` (gradients clipped to norm 1); the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def train(
    s: Settings, seed: int, threads: int, log: Any = print
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast, dict[str, Any]]:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    tok = build_tokenizer()
    vocab = tok.get_vocab()
    config = build_config(s, tok)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    model.generation_config = generation_config(tok)
    params = sum(p.numel() for p in model.parameters())
    opt, sched = optimizer(model, s.lr, s.weight_decay, s.warmup, s.steps)
    data = batches(seed, s.batch, vocab)
    losses: list[float] = []
    curve: list[dict[str, Any]] = []
    start = time.perf_counter()
    model.train()
    for step in range(1, s.steps + 1):
        ids, labels = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16_autocast):
            loss = model(input_ids=ids, labels=labels).loss
        losses.append(update(model, opt, sched, loss))
        dense = step <= s.eval_dense_until
        if step % (s.eval_every if dense else 250) == 0 or step == s.steps:
            model.eval()
            acc = probe_accuracy(model, tok, s.curve_probes)
            model.train()
            window = losses[-(s.eval_every if dense else 250) :]
            point = {"step": step, "loss": sum(window) / len(window), **acc}
            curve.append(point)
            log(
                f"step {step:5d}  loss {point['loss']:.4f}  "
                f"probes sentiment {acc['sentiment']:.2f} colour {acc['colour']:.2f} "
                f"animal {acc['animal']:.2f}  {time.perf_counter() - start:6.1f}s"
            )
    model.eval()
    if s.store_float16:
        round_weights(model)
    seconds = time.perf_counter() - start
    tail = losses[-min(100, len(losses)) :]
    info = {
        "parameters": params,
        "train_seconds": round(seconds, 1),
        "final_loss": sum(tail) / len(tail),
        "losses": losses,
        "curve": curve,
    }
    return model, tok, info


#: The slots that echo the story's sentiment ("greet" only with a visitor).
_ECHO_SLOTS = ("adverb", "sky", "wind", "greet", "go", "find", "verb1", "verb2", "feeling")


@torch.no_grad()
def round_weights(model: LlamaForCausalLM) -> None:
    """Round every weight to float16 and back, in place: the model then is
    exactly what ``write_model`` stores (float16 tensors, loaded as float32),
    so the evaluation measures the shipped weights."""
    for p in model.parameters():
        p.copy_(p.to(torch.float16).to(torch.float32))


def evaluate(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, s: Settings, log: Any = print
) -> dict[str, Any]:
    ev: dict[str, Any] = {}
    ev["probes"] = probe_accuracy(model, tok, s.probes)
    ev["probes_per_concept"] = s.probes
    log(f"held-out probes: {ev['probes']}")
    _, raw, mean_norm = sentiment_direction(
        model, tok, s.steer_layer, s.direction_pairs
    )
    ev["steering"] = {
        "layer": s.steer_layer,
        "scale": s.steer_scale,
        "normalisation": "relative: h_t += scale * |h_t| * unit(mean happy - mean sad), at every position",
        "difference_norm": raw,
        "mean_residual_norm": mean_norm,
        "max_new_tokens": s.max_new_tokens,
        "direction_pairs": s.direction_pairs,
        "baseline": steering_eval(model, tok, s, s.steer_layer, None),
        "steered": steering_eval(model, tok, s, s.steer_layer, s.steer_scale),
    }
    log(f"steering: baseline {ev['steering']['baseline']}")
    log(f"steering: steered {ev['steering']['steered']}")
    if s.sweep:
        sweep = []
        grid = [
            (layer, scale, True) for layer in range(s.layers) for scale in SWEEP_SCALES
        ]
        grid += [(s.layers - 1, scale, False) for scale in SWEEP_FIXED_SCALES]
        for layer, scale, relative in grid:
            r = steering_eval(model, tok, s, layer, scale, relative)
            r.pop("examples")
            row = {
                "layer": layer,
                "scale": scale,
                "mode": "relative" if relative else "fixed",
                **r,
            }
            sweep.append(row)
            log(f"  sweep {row}")
        ev["sweep"] = sweep
    # Unsteered stories from held-out openings (ev["steering"]["baseline"]
    # has the rates); also: does every echo agree with the opening?
    prompts = world.steering_prompts(
        world.HAPPY, s.steer_prompts
    ) + world.steering_prompts(world.SAD, s.steer_prompts)
    texts = greedy(model, tok, prompts, s.max_new_tokens)
    agree = 0
    for p, t in zip(prompts, texts):
        parsed = world.parse_story(p + " " + t)
        if parsed is None:
            continue
        sent = world.HAPPY if parsed["mood"] in world.MOODS[world.HAPPY] else world.SAD
        agree += all(
            parsed[k] in world.concept_words("sentiment", sent)
            for k in _ECHO_SLOTS
            if k in parsed
        )
    ev["unsteered_stories"] = {
        **{
            f"{k}_rate": v / len(texts)
            for k, v in story_rates(prompts, texts).items()
            if k != "flipped"
        },
        "all_echoes_agree_rate": agree / len(texts),
        "prompts": len(texts),
        "examples": [
            p + " " + t
            for p, t in list(zip(prompts, texts))[:: max(1, len(texts) // 4)][:4]
        ],
    }
    log(f"unsteered stories: {ev['unsteered_stories']}")
    return ev


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def write_model(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()
    model.config._attn_implementation = None  # don't save the training choice
    tok.padding_side = "right"
    tok.backend_tokenizer.no_padding()  # don't save the last call's padding
    tok.backend_tokenizer.no_truncation()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if all(
        torch.equal(p, p.to(torch.float16).to(torch.float32))
        for p in model.parameters()
    ):
        # Rounded weights (Settings.store_float16): store them in 16 bits,
        # losslessly. config.json keeps dtype float32, so transformers and
        # vLLM (told dtype="float32") both load them as float32.
        weights = {k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items()}
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def model_card(
    s: Settings,
    seed: int,
    threads: int,
    info: dict[str, Any],
    ev: dict[str, Any],
    command: str,
) -> str:
    st = ev["steering"]
    un = ev["unsteered_stories"]
    curve_rows = "\n".join(
        f"| {p['step']} | {p['loss']:.3f} | {p['sentiment']:.0%} | {p['colour']:.0%} | {p['animal']:.0%} |"
        for p in info["curve"]
        if p["step"] <= 250 or p["step"] % 250 == 0 or p["step"] == s.steps
    )
    sweep = ""
    if "sweep" in ev:
        rows = "\n".join(
            f"| {r['layer']} | {r['mode']} | {r['scale']} | {_pct(r['flip_rate'])} | {_pct(r['well_formed_rate'])} "
            f"| {_pct(r['grammatical_rate'])} | {_pct(r['faithful_rate'])} |"
            for r in ev["sweep"]
        )
        sweep = (
            "\nSweep (same prompts, same budget). *relative*: scale x each token's residual norm x unit\n"
            "direction; *fixed*: scale x the raw difference of means, the same vector at every position.\n\n"
            "| layer | mode | scale | flip | well-formed | grammatical | faithful |\n|---|---|---|---|---|---|---|\n"
            + rows
            + "\n"
        )
    held = ", ".join(f"{a}/{c}/{m}" for a, c, m in sorted(world.HELD_OUT))
    examples = "\n".join(f"- {e}" for e in un["examples"])

    def row(name: str, r: dict[str, float]) -> str:
        return (
            f"| {name} | {_pct(r['flip_rate'])} | {_pct(r['well_formed_rate'])} "
            f"| {_pct(r['grammatical_rate'])} | {_pct(r['faithful_rate'])} |"
        )

    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [vlens, toy-model, interpretability, synthetic-data]
---

# toyworld

A {info["parameters"]:,}-parameter Llama trained from scratch by `scripts/train_toyworld.py`
on synthetic stories (grammar and concepts: `docs/toyworld.md` in the vlens repository,
`vlens/models/world.py`). It ships inside vlens so every notebook, demo and test
has a model whose internals mean something, without any download.

Each story fixes three independent concepts in its first sentence and echoes
them later: **sentiment** (happy/sad sets the tone of the whole story: the adverb, sky,
wind, greeting, how the animal goes out, whether it finds or loses things, the verbs and
the closing feeling; each echo agrees with it {world.ECHO_FIDELITY:.0%} of the time), **colour**
(decides which things are found) and the **animal** (copied three times, past a
distracting visitor). {len(world.HELD_OUT)} held-out animal/colour/sentiment combinations never
occur in training, and every number below is measured on them: {held}.

## Config

Llama, {s.layers} layers, hidden {s.hidden}, {s.heads} heads of dim {s.hidden // s.heads},
MLP {s.intermediate}, vocabulary {len(world.vocabulary())} words, untied embeddings,
{"stored in float16 and run in float32 (`config.json` says float32)" if s.store_float16 else "float32"},
`max_position_embeddings` 512. Word-level tokenizer: `<s>` is prepended, stories end with `</s>`.

## Training

`{command}`: seed {seed}, {threads} thread(s), {s.steps} steps x batch {s.batch} stories,
AdamW lr {s.lr} (warmup {s.warmup}, cosine to 10%), weight decay {s.weight_decay}, eager attention{
", forward pass under bfloat16 autocast (float32 master weights)" if s.bf16_autocast else ""}.
Training took {info["train_seconds"]:.0f} s of wall time ({info["total_seconds"]:.0f} s with the evaluation) on a {os.cpu_count()}-core CPU.
Final loss {info["final_loss"]:.4f} nats/token (mean of the last 100 steps); the best
possible on this corpus is {info["entropy_floor"]:.4f}.

Learning curve (top-1 accuracy on {s.curve_probes} held-out probes per concept; loss averaged over the
{s.eval_every} or 250 steps before; every row is in `evaluation.json`):

| step | loss | sentiment | colour | animal |
|---|---|---|---|---|
{curve_rows}

## Evaluation

Held-out probes: the prompt is cut just before a concept word; the top-1 next word
must lie in the concept-consistent set. {ev["probes_per_concept"]} prompts per concept.

| concept | accuracy |
|---|---|
| sentiment | {_pct(ev["probes"]["sentiment"])} |
| colour | {_pct(ev["probes"]["colour"])} |
| animal | {_pct(ev["probes"]["animal"])} |

Greedy stories from {un["prompts"]} held-out openings: {_pct(un["well_formed_rate"])} well-formed,
{_pct(un["grammatical_rate"])} grammatical, {_pct(un["faithful_rate"])} faithful to the hard rules,
{_pct(un["all_echoes_agree_rate"])} with every sentiment echo agreeing with the opening. For example:

{examples}

## Steering

Direction: the difference of means (happy - sad) of the output of decoder layer {st["layer"]}
(0-based; {"the last layer: " if st["layer"] == s.layers - 1 else ""}the residual stream{" before the final norm" if st["layer"] == s.layers - 1 else ""}, captured with a forward hook)
at the last token of {st["direction_pairs"]} minimal pairs of prompts cut just before a sentiment word
(`world.sentiment_prompts()`), normalised to unit length `u`. Its raw norm is
{st["difference_norm"]:.1f}; those tokens' residual norm is {st["mean_residual_norm"]:.1f} on average.

Normalisation: a forward hook on that layer adds `{st["scale"]} * |h_t| * u` to every
position's residual `h_t` (sad openings get `+u`, happy ones `-u`), so each token is
turned by the same angle whatever its norm. Greedy, {st["max_new_tokens"]} new tokens.

| | flip | well-formed | grammatical | faithful |
|---|---|---|---|---|
{row("unsteered", st["baseline"])}
{row(f"layer {st['layer']}, relative scale {st['scale']}", st["steered"])}

Steered towards happy, then towards sad:

- {st["steered"]["examples"][0]}
- {st["steered"]["examples"][1]}
{sweep}
Flip: most sentiment words of the continuation belong to the other sentiment.
Well-formed: ends with "the end." within the budget, no word three times in a row.
Grammatical: the whole story parses. Faithful: grammatical, and the animal is copied,
the things match the colour and the verbs form a pair (`world.story_problems()`). All figures are also in `evaluation.json`.

## Steering at every layer

`scripts/eval_toyworld.py` (`make eval-toyworld`) measures what a new user
meets: two sentiment directions, each a difference of means at the last token
of decoder layer L, steered with `relative=True` at every layer over a range of
scales. *recipe* is the documented one (`world.sentiment_prompts()`, prompts
cut just before a sentiment word); *natural* is the contrast one types into the
steering panel, whole first sentences that differ only in the mood word
(`world.mood_contrast_prompts()`). It also fits linear probes at every layer,
finds the head that copies the animal, and checks that vLLM's greedy
continuations equal transformers' on every evaluation prompt. The tables
below are written by that script.

<!-- eval_toyworld:begin -->
(run `python scripts/eval_toyworld.py` to fill this in)
<!-- eval_toyworld:end -->
"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps (default 1500; smoke 12)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help=f"output folder (default {DEFAULT_OUT})"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1 is fastest on a busy 2-core machine)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny model, few steps, for tests"
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the steering sweep")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    s = SMOKE if args.smoke else FULL
    if args.steps is not None:
        s = Settings(**{**s.__dict__, "steps": args.steps})
    if args.no_sweep:
        s = Settings(**{**s.__dict__, "sweep": False})
    out = args.out
    if out is None:
        if args.smoke:
            raise SystemExit(
                "--smoke needs --out (it must not overwrite the bundled model)"
            )
        out = DEFAULT_OUT
    log = (
        (lambda *a, **k: None)
        if args.quiet
        else (lambda *a, **k: print(*a, **k, flush=True))
    )
    command = (
        "python scripts/train_toyworld.py"
        + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    )
    wall = time.perf_counter()
    # train() sets these process-wide; put them back for callers (the tests).
    threads, deterministic = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
    )
    try:
        model, tok, info = train(s, args.seed, args.threads, log)
        info["entropy_floor"] = entropy_floor()
        ev = evaluate(model, tok, s, log)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    info["total_seconds"] = round(time.perf_counter() - wall, 1)
    write_model(model, tok, out)
    result = {
        "seed": args.seed,
        "threads": args.threads,
        "settings": s.__dict__,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        **{k: v for k, v in info.items() if k != "losses"},
        "evaluation": ev,
    }
    (out / "evaluation.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "README.md").write_text(
        model_card(s, args.seed, args.threads, info, ev, command)
    )
    log(f"wrote {out} in {result['total_seconds']:.0f} s")
    return {**result, "losses": info["losses"]}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
