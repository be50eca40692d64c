"""``vlens.diff``: two models on the same token ids, side by side.

A base model and a model tuned from it (two Sessions, local or connected)
read the same prompts. The call runs in two phases, each model's share
of a phase one engine batch, the two models at once where they can be:

1. **generate and read** (``max_new_tokens > 0``): each model continues each
   prompt greedily and reads its own text as it goes -- ``sites`` at
   ``layers`` and the last layer's log-probabilities over the vocabulary,
   on the prompt and on every kept token (it asks for one token more than
   it keeps, so the last kept token is fed and read too). A continuation is
   cut before the first token the other model's vocabulary lacks;
2. **score the other's**: each model reads the other's text teacher-forced
   (the prompt plus that continuation), the same reads. A text its own
   model did not read to the end (it stopped at its end-of-text token,
   which is never fed back, or the model's length ran out) is scored here
   too. With ``max_new_tokens=0`` this is the only phase: the prompts alone.

So every number in the :class:`~vlens.results.diff.Diff` comes from the two
models reading identical ids, and no text is prefilled twice by the model
that wrote it. Each phase runs on both engines from two threads: two
engines in this process take turns step by step (their drivers never step
at once, ``vlens/engine/driver.py``); a connected or multiprocess engine
runs beside the other.

Tokenizers: one vocabulary must extend the other (every token of the
smaller one has the same id in the larger: the bundled chat model adds 20
words and its role markers to the story model's) and every prompt must be
the same ids under both; anything else is refused before anything runs.
KL is taken over the shared ids (each distribution renormalised there;
``outside`` says how much probability a model put beyond them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlens import calls, checks
from vlens.calls import Call
from vlens.errors import VlensError
from vlens.methods.twin import model_folder
from vlens.protocol.plan import Read
from vlens.results.diff import Diff, DiffText

__all__ = ["diff", "shared_vocabulary"]

#: sites a diff cannot take: no single row per token
_NO_ROWS = ("attn_pattern",)


def diff(base: Any, tuned: Any, prompts: Any, *, layers: Any = None,
         sites: Any = ("resid_post",), max_new_tokens: int = 16,
         progress: Any = None) -> Diff:
    """``vlens.diff(base, tuned, prompts)``: see :class:`~vlens.results.diff.Diff`."""
    for name, s in (("base", base), ("tuned", tuned)):
        if not hasattr(s, "run_call") or not hasattr(s, "facts"):
            raise VlensError(f"{name} must be a vlens Session, got {type(s).__name__}")
        if s.closed:
            raise VlensError(f"the {name} session ({s.model}) is closed: open it again")
    shared = shared_vocabulary(base, tuned)
    layers, sites = _check_shapes(base, tuned, layers, sites)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise VlensError(f"max_new_tokens must be an int >= 0 (0: the prompts alone), got "
                         f"{max_new_tokens!r}")
    if max_new_tokens:
        checks.check_generation(max_new_tokens, {}, base.facts)
        checks.check_generation(max_new_tokens, {}, tuned.facts)
    plist = _same_ids(base, tuned, prompts, shared)
    prompt_ids = [list(p.ids) for p in plist]
    labels = [p.label for p in plist]
    if max_new_tokens:
        held = _generated(base, tuned, prompt_ids, labels, shared, layers, sites,
                          max_new_tokens, progress)
    else:
        runs = _both(base, tuned, lambda _, s: s.run_call(
            _read_call(prompt_ids, labels, layers, sites, s.facts), progress=progress))
        held = [{"prompt": _text("prompt", *(_rows(r[i], len(ids), sites) for r in runs),
                                 len(ids), shared, layers)}
                for i, ids in enumerate(prompt_ids)]
    return Diff(prompts=labels, texts=held, layers=layers, sites=sites,
                base_model=model_folder(base), tuned_model=model_folder(tuned),
                shared_vocab=shared, tokenizer=base.tokenizer, tuned_tokenizer=tuned.tokenizer,
                max_new_tokens=max_new_tokens)


def shared_vocabulary(base: Any, tuned: Any) -> int:
    """How many ids the two tokenizers share: the smaller vocabulary, when
    the larger one holds each of its tokens at the same id (else a
    VlensError naming both models and the first token that differs)."""
    va, vb = base.tokenizer.get_vocab(), tuned.tokenizer.get_vocab()
    small, large = (va, vb) if len(va) <= len(vb) else (vb, va)
    for token, i in sorted(small.items(), key=lambda kv: kv[1]):
        if large.get(token) != i:
            raise VlensError(
                f"the tokenizers of {base.model} (base, {len(va)} tokens) and {tuned.model} "
                f"(tuned, {len(vb)} tokens) differ: {token!r} is id {va.get(token)} in the "
                f"base and {vb.get(token)} in the tuned model. A diff needs the same ids for "
                "the same tokens (one vocabulary may only extend the other)")
    ids = sorted(small.values())
    if ids != list(range(len(ids))):
        raise VlensError(f"the vocabulary of {base.model if small is va else tuned.model} "
                         "has gaps in its ids: a diff needs ids 0..n-1")
    return min(len(small), base.facts.vocab_size, tuned.facts.vocab_size)


def _check_shapes(base: Any, tuned: Any, layers: Any, sites: Any) -> tuple[list[int], list[str]]:
    """The layers and sites to read, checked on both models (which must
    have the same number of layers and the same width)."""
    fb, ft = base.facts, tuned.facts
    if (fb.n_layers, fb.hidden_size) != (ft.n_layers, ft.hidden_size):
        raise VlensError(f"{base.model} has {fb.n_layers} layers of width {fb.hidden_size} and "
                         f"{tuned.model} {ft.n_layers} of width {ft.hidden_size}: a diff of "
                         "activations needs two models of the same shape (a model and its "
                         "fine-tune)")
    out = checks.check_layers(layers, fb)
    checks.check_layers(out, ft)
    names = checks.check_sites(sites, fb)
    checks.check_sites(names, ft)
    bad = [x for x in names if x in _NO_ROWS]
    if bad:
        raise VlensError(f"a diff reads one row per token; {bad[0]!r} has one per token pair: "
                         "use a residual site or 'z'")
    return out, names


def _same_ids(base: Any, tuned: Any, prompts: Any, shared: int) -> list[Any]:
    """Each prompt as both sessions tokenise it (the same ids, all shared).
    A prompt only one side can format (a conversation, and a chat template
    only one tokenizer has) is that side's ids for both."""
    got, failed = {}, {}
    for name, s in (("base", base), ("tuned", tuned)):
        try:
            got[name] = s.prompts(prompts)
        except VlensError as exc:
            failed[name] = exc
    if len(failed) == 2:
        raise VlensError(f"neither {base.model} (base) nor {tuned.model} (tuned) can read the "
                         f"prompts: {failed['tuned']}")
    sides = {"base": base, "tuned": tuned}
    for name, exc in failed.items():
        good = "tuned" if name == "base" else "base"
        ids = [list(p.ids) for p in got[good]]
        _shared_only(ids, shared, base, tuned, good)
        got[name] = sides[name].prompts([{"prompt_token_ids": x} for x in ids])
    for i, (a, b) in enumerate(zip(got["base"], got["tuned"])):
        if list(a.ids) != list(b.ids):
            at = next((k for k, (x, y) in enumerate(zip(a.ids, b.ids)) if x != y),
                      min(len(a.ids), len(b.ids)))
            raise VlensError(
                f"prompt {i} is different ids for the two tokenizers: {base.model} (base) "
                f"reads {base.token_strings(a.ids[at:at + 3])} at token {at}, {tuned.model} "
                f"(tuned) {tuned.token_strings(b.ids[at:at + 3])}. A diff runs both models "
                "on the same ids: use words both vocabularies hold")
    _shared_only([list(p.ids) for p in got["tuned"]], shared, base, tuned, "tuned")
    return got["tuned"]


def _shared_only(ids: list[list[int]], shared: int, base: Any, tuned: Any, side: str) -> None:
    """Every id below ``shared`` (both vocabularies hold it), or a VlensError
    naming the token and both models."""
    for i, row in enumerate(ids):
        outside = [t for t in row if t >= shared]
        if outside:
            s = tuned if side == "tuned" else base
            other = base if side == "tuned" else tuned
            word = s.token_strings(outside[:1])[0]
            raise VlensError(
                f"prompt {i} holds {word!r} (id {outside[0]}), which {s.model} ({side}) has "
                f"and {other.model} does not (the first {shared} ids are shared). A diff runs "
                "both models on the same ids: use words both vocabularies hold")


def _generated(base: Any, tuned: Any, prompt_ids: list[list[int]], labels: list[str],
               shared: int, layers: list[int], sites: list[str], max_new_tokens: int,
               progress: Any) -> list[dict[str, DiffText]]:
    """The two phases with continuations: each model writes and reads its
    own text, then reads the other's (and any of its own it did not read to
    the end). ``held[i]``: prompt i's ``"base"``, ``"tuned"`` and
    ``"prompt"`` texts."""
    own = _both(base, tuned, lambda _, s: s.run_call(
        _read_call(prompt_ids, labels, layers, sites, s.facts, max_new_tokens),
        progress=progress))
    # texts[k][i]: prompt i and model k's continuation, cut to the shared ids
    texts = [[ids + _cut(t.output_token_ids[:max_new_tokens], shared)
              for ids, t in zip(prompt_ids, run)] for run in own]
    # what model m still reads teacher-forced: (k, i) for text k of prompt i
    todo = [[(k, i) for k in (0, 1) for i in range(len(prompt_ids))
             if k != m or own[m][i].n_tokens < len(texts[k][i])] for m in (0, 1)]

    def score(m: int, s: Any) -> Any:
        if not todo[m]:
            return []
        return s.run_call(_read_call([texts[k][i] for k, i in todo[m]],
                                      [labels[i] for _, i in todo[m]], layers, sites, s.facts),
                          progress=progress)

    scored = _both(base, tuned, score)
    rows: list[dict[tuple[int, int], _Rows]] = [{}, {}]
    for m in (0, 1):
        for (k, i), t in zip(todo[m], scored[m]):
            rows[m][k, i] = _rows(t, len(texts[k][i]), sites)
        for i, t in enumerate(own[m]):
            rows[m].setdefault((m, i), _rows(t, len(texts[m][i]), sites))
    held = []
    for i, ids in enumerate(prompt_ids):
        texts_i = {kind: _text(kind, rows[0][k, i], rows[1][k, i], len(ids), shared,
                                 layers)
                   for k, kind in enumerate(("base", "tuned"))}
        texts_i["prompt"] = texts_i["base"].head(len(ids))  # the start of either text
        held.append(texts_i)
    return held


def _both(base: Any, tuned: Any, fn: Any) -> list[Any]:
    """``[fn(0, base), fn(1, tuned)]`` in two threads (one engine: one after
    the other). An error in either is raised once both have ended."""
    if base.engine is tuned.engine:
        return [fn(0, base), fn(1, tuned)]
    out: list[Any] = [None, None]
    errors: list[BaseException] = []

    def work(k: int, s: Any) -> None:
        try:
            out[k] = fn(k, s)
        except BaseException as exc:  # noqa: BLE001 -- raised in the caller's thread
            errors.append(exc)

    worker = threading.Thread(target=work, args=(1, tuned), daemon=True)
    worker.start()
    work(0, base)
    worker.join()
    if errors:
        raise errors[0]
    return out


def _cut(ids: Sequence[int], shared: int) -> list[int]:
    """A continuation up to (not including) its first id past the shared ones."""
    out = []
    for t in ids:
        if t >= shared:
            break
        out.append(int(t))
    return out


def _read_call(texts: list[list[int]], labels: list[str], layers: list[int], sites: list[str],
               facts: checks.ModelFacts, new_tokens: int = 0) -> Call:
    """Each text read -- ``sites`` at ``layers`` in full, and the last
    layer's vocabulary log-probabilities -- as the model continues it
    greedily: ``new_tokens`` tokens and one more (where the model's length
    allows), so that every kept token is fed back and read; with 0, the
    text alone, teacher-forced (one token generated, not kept)."""
    reads = [Read(site, tuple(layers), "full") for site in sites]
    reads.append(Read("resid_post", (facts.n_layers - 1,), "vocab_logprobs"))
    tag = calls.new_tag()
    requests = [calls.request(f"{tag}-{i}", i, ids, reads=reads, logprobs=False, clone=False,
                              max_new_tokens=min(new_tokens + 1,
                                                 max(1, facts.max_model_len - len(ids))))
                for i, ids in enumerate(texts)]
    return Call(requests, lambda outs, got, runs: runs.build_run(labels, requests, outs, got,
                                                                 False))


@dataclass
class _Rows:
    """The first rows of one trace: ids, token strings, the last layer's
    vocabulary log-probabilities ``[T, vocab]``, ``{site: [layers, T, ...]}``."""

    ids: list[int]
    tokens: list[str]
    logprobs: torch.Tensor
    acts: dict[str, torch.Tensor]


def _rows(t: Any, n: int, sites: list[str]) -> _Rows:
    """Trace ``t``'s first ``n`` rows (a causal model read them the same
    whatever came after)."""
    return _Rows(list(t.token_ids[:n]), list(t.tokens[:n]), t.vocab_logprobs()[-1][:n],
                 {site: t.activations(site)[:, :n] for site in sites})


def _text(kind: str, rb: _Rows, rt: _Rows, n_prompt: int, shared: int, layers: list[int]
          ) -> DiffText:
    """One text as both models read it: KL, each model's logprobs, the
    activation differences (tuned - base) at each site."""
    ids = rb.ids
    if ids != rt.ids:
        raise VlensError(f"the two models read different ids for one {kind} text "
                         "(an engine served part of it from a cache?)")
    lb, lt = rb.logprobs, rt.logprobs  # [T, vocab of each model]
    sb, st = lb[:, :shared], lt[:, :shared]
    kl = _kl(st.log_softmax(-1), sb.log_softmax(-1))
    delta, cos = {}, {}
    for site, a in rb.acts.items():
        b = rt.acts[site]
        delta[site] = (b - a).reshape(b.shape[0], b.shape[1], -1)
        cos[site] = torch.nn.functional.cosine_similarity(
            b.reshape(delta[site].shape), a.reshape(delta[site].shape), dim=-1)
    return DiffText(
        kind=kind, ids=ids, tokens=rb.tokens, n_prompt=n_prompt, kl=kl,
        logprob_base=_actual(lb, ids), logprob_tuned=_actual(lt, ids),
        outside_base=1 - sb.logsumexp(-1).exp(), outside_tuned=1 - st.logsumexp(-1).exp(),
        delta=delta, cosine=cos, layers=list(layers))


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) of two ``[T, vocab]`` log-probability tables, row by row."""
    return (p_log.exp() * (p_log - q_log)).sum(-1).clamp_min(0)


def _actual(lp: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """``[T]``: the log-probability of token j given the tokens before it
    (NaN for the first, which nothing predicts)."""
    out = torch.full((len(ids),), float("nan"))
    if len(ids) > 1:
        nxt = torch.tensor(ids[1:])
        out[1:] = lp[:-1].gather(1, nxt[:, None])[:, 0]
    return out
