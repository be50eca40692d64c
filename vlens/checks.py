"""Input checks: every bad input becomes a VlensError that says what was
wrong and what would be right, before anything is shipped to the workers.

Pure functions over :class:`ModelFacts` (what the live model is) and plain
arguments, so they can be read and tested without an engine; the Session
calls them before it builds a single request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlens.errors import VlensError
from vlens.protocol.plan import Plan, Read
from vlens.edits import Steer, per_prompt

__all__ = [
    "ModelFacts",
    "check_budget",
    "check_edit",
    "check_generation",
    "check_heads",
    "check_layers",
    "check_plan",
    "check_read",
    "check_write_size",
    "check_prompts",
    "check_reads",
    "check_sites",
    "check_steer",
    "check_steers",
    "write_bound",
]

#: the largest ``|scale|`` of a relative Steer: it adds ``scale`` times each
#: row's own norm, so 100 already drowns the row a hundred times over
RELATIVE_MAX = 100.0
#: the most reads, steering adds and sets (ablations, patched cells) one
#: request's plan may carry: a call's work in the engine grows with them
PLAN_MAX = {"reads": 64, "adds": 64, "sets": 256}
#: the reductions a read may ask for, and where: the logit lens and the full
#: log-probabilities unembed the residual stream after the last norm
REDUCES = ("full", "norm", "logit_lens", "logprobs")
LENS_SITES = ("resid_post",)
#: the most top-k of a logit-lens read
LENS_K_MAX = 1000
_FMAX = {"float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38,
         "float16": 65504.0}

# Sampling settings vlens manages itself: the user sets them another way.
MANAGED = {
    "max_tokens": "use max_new_tokens=",
    "extra_args": "vlens uses extra_args to carry its plan",
    "logprobs": "use logprobs=True/False",
    "prompt_logprobs": "use logprobs=True/False",
    "skip_reading_prefix_cache": "traced requests always recompute their prompt",
}


@dataclass(frozen=True)
class ModelFacts:
    """What the checks need to know about the live model."""

    n_layers: int
    hidden_size: int
    sites: tuple[str, ...]
    writable: tuple[str, ...]  # sites a Steer or edit may change
    max_model_len: int
    vocab_size: int
    device: str = "cpu"
    #: sites this architecture has no value for -> why (a parallel block's resid_mid)
    absent: tuple[tuple[str, str], ...] = ()
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    #: the model's dtype ("float32", "bfloat16", "float16"): bounds the writes
    dtype: str = "float32"

    def width(self, site: str) -> int:
        """Floats per token of a full read (or of a vector written) at ``site``;
        for ``attn_pattern`` per key."""
        if site in ("q", "z", "attn_pattern"):
            return self.n_heads * (1 if site == "attn_pattern" else self.head_dim)
        if site in ("k", "v"):
            return self.n_kv_heads * self.head_dim
        return 1 if site == "positions" else self.hidden_size

    def no_such_site(self, site: Any, what: str = "site") -> VlensError:
        """The error for a site this model lacks: why, where the architecture
        has no such value, else which sites exist."""
        why = dict(self.absent).get(site)
        if why:
            return VlensError(f"{what} {site!r} does not exist in this model: {why}")
        return VlensError(f"unknown {what} {site!r}: this model has {', '.join(self.sites)}")

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> ModelFacts:
        """From ``Engine.info``."""
        from vlens.protocol.sites import HEAD_WRITABLE, WRITABLE

        sites = tuple(info["sites"])
        return cls(
            n_layers=int(info["n_layers"]),
            hidden_size=int(info["hidden_size"]),
            sites=sites,
            writable=tuple(x for x in WRITABLE + HEAD_WRITABLE if x in sites),
            n_heads=int(info.get("n_heads", 0)),
            n_kv_heads=int(info.get("n_kv_heads", 0)),
            head_dim=int(info.get("head_dim", 0)),
            max_model_len=int(info["max_model_len"]),
            vocab_size=int(info["vocab_size"]),
            device=str(info.get("device", "cpu")),
            absent=tuple(sorted((info.get("absent_sites") or {}).items())),
            dtype=str(info.get("dtype", "float32")).removeprefix("torch."),
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_prompts(
    prompts: Any, facts: ModelFacts, tokenize: Callable[[str], list[int]]
) -> tuple[list[str], list[list[int]]]:
    """A prompt string or a list of them -> ``(prompts, token ids of each)``."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise VlensError(
            f"prompts must be a string or a list of strings, got {type(prompts).__name__}"
        )
    if not prompts:
        raise VlensError("prompts is empty: pass at least one prompt string")
    ids = []
    limit = facts.max_model_len
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise VlensError(f"prompt {i} is a {type(p).__name__}, not a string: pass text")
        if not p.strip():
            raise VlensError(f"prompt {i} is empty: give it at least one word")
        toks = tokenize(p)
        if len(toks) >= limit:
            raise VlensError(
                f"prompt {i} is {len(toks)} tokens long but the engine's max_model_len is "
                f"{limit}: shorten it to under {limit} tokens, or start the Session with a "
                "larger max_model_len="
            )
        ids.append(toks)
    return list(prompts), ids


def check_layers(layers: Any, facts: ModelFacts) -> list[int]:
    """None (all), an int, a range or a list of ints -> distinct layer numbers."""
    n = facts.n_layers
    if layers is None:
        return list(range(n))
    if _is_int(layers):
        layers = [layers]
    if isinstance(layers, range):
        layers = list(layers)
    if not isinstance(layers, (list, tuple)) or not all(_is_int(x) for x in layers):
        raise VlensError(f"layers must be None (all), an int or a list of ints, got {layers!r}")
    if not layers:
        raise VlensError(f"layers is empty: pick from 0 to {n - 1}, or None for all")
    bad = [x for x in layers if not 0 <= x < n]
    if bad:
        raise VlensError(
            f"layer {bad[0]} does not exist: this model has {n} layers, numbered 0 to {n - 1}"
        )
    return list(dict.fromkeys(layers))


def check_sites(sites: Any, facts: ModelFacts) -> list[str]:
    """A site name or a list of them -> distinct site names."""
    if isinstance(sites, str):
        sites = [sites]
    if not isinstance(sites, (list, tuple)):
        raise VlensError(f"sites must be a site name or a list of them, got {sites!r}")
    for s in sites:
        if s not in facts.sites:
            raise facts.no_such_site(s)
    return list(dict.fromkeys(sites))


def check_generation(max_new_tokens: Any, sampling: dict[str, Any], facts: ModelFacts) -> None:
    """``max_new_tokens`` and the sampling settings: refuses settings vlens
    manages and settings that would break the engine. (vLLM's own
    validation runs when the runner builds SamplingParams, still before
    anything is shipped.)"""
    for key, how in MANAGED.items():
        if key in sampling:
            raise VlensError(f"{key}= is set by vlens: {how}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise VlensError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if sampling.get("seed") is not None and facts.device == "cpu":
        raise VlensError(
            "seed= is refused on vLLM's CPU build: when a seeded request's prompt is "
            "split across engine steps (chunked prefill) its worker calls "
            "Generator.set_offset, which CPU generators lack, and the engine dies. "
            "Sample without a seed, or run on a GPU."
        )


def check_heads(heads: Any, sites: list[str], facts: ModelFacts) -> tuple[int, ...]:
    """``heads=`` of a trace: None (every head) or query head numbers; it
    selects the heads of ``attn_pattern`` only."""
    if heads is None:
        return ()
    if "attn_pattern" not in sites:
        raise VlensError("heads= selects heads of the attn_pattern read: add 'attn_pattern' "
                         "to sites=, or leave heads out")
    if _is_int(heads):
        heads = [heads]
    if isinstance(heads, range):
        heads = list(heads)
    if not isinstance(heads, (list, tuple)) or not heads or not all(_is_int(h) for h in heads):
        raise VlensError(f"heads must be None (all), an int or a non-empty list of ints, "
                         f"got {heads!r}")
    bad = [h for h in heads if not 0 <= h < facts.n_heads]
    if bad:
        raise VlensError(f"head {bad[0]} does not exist: this model has {facts.n_heads} "
                         f"attention heads, numbered 0 to {facts.n_heads - 1}")
    return tuple(dict.fromkeys(heads))


def check_reads(sites: list[str], layers: list[int], reduce: str, k: Any,
                facts: ModelFacts, heads: tuple[int, ...] = ()) -> list[Read]:
    """The reads of a ``trace`` call: ``sites`` at ``layers`` reduced by
    ``reduce``, plus the logit lens top-``k`` of ``resid_post`` when k > 0.
    ``heads``: the query heads of an ``attn_pattern`` read (empty: all)."""
    if reduce not in ("full", "norm"):
        raise VlensError(f"reduce must be 'full' or 'norm', got {reduce!r}")
    if not _is_int(k) or k < 0:
        raise VlensError(f"logit_lens must be a non-negative int (top-k), got {k!r}")
    if reduce != "full" and "attn_pattern" in sites:
        raise VlensError("attn_pattern is read in full only (probabilities have no useful "
                         "norm): read it in its own trace with reduce='full', and shrink it "
                         "with heads= or layers=")
    reads = [Read(site, tuple(layers), reduce, 0, heads if site == "attn_pattern" else ())
             for site in sites]
    if k:
        if k > facts.vocab_size:
            raise VlensError(
                f"logit_lens={k} is more than the vocabulary ({facts.vocab_size} tokens)"
            )
        reads.append(Read("resid_post", tuple(layers), "logit_lens", k))
    return reads


def check_set_values(what: str, peak: float, facts: ModelFacts) -> None:
    """The values a set writes (an Ablate's mean, a patched cell), whose
    largest ``|value|`` is ``peak``, under :func:`write_bound`."""
    bound = write_bound(facts)
    if not math.isfinite(peak) or peak > bound:
        raise VlensError(
            f"{what}: its largest value {peak:.3g} would overflow this {facts.dtype} model: a "
            f"write may put at most {bound:.3g} into a value. Compute the mean from the "
            "model's own activations (mean=None does)")


def check_read(read: Read, facts: ModelFacts) -> None:
    """One read of a plan, as the workers would run it: the site exists, the
    reduction suits it (``attn_pattern`` and ``positions`` in full only; the
    logit lens and the log-probabilities at ``resid_post`` only), the layers
    and heads exist, ``k`` suits the reduction."""
    if read.site not in facts.sites:
        raise facts.no_such_site(read.site, "read site")
    if read.reduce not in REDUCES:
        raise VlensError(f"read reduce {read.reduce!r:.40} is not one of {list(REDUCES)}")
    if read.site in ("attn_pattern", "positions") and read.reduce != "full":
        raise VlensError(f"{read.site} is read in full only, not with reduce={read.reduce!r}")
    if read.reduce in ("logit_lens", "logprobs") and read.site not in LENS_SITES:
        raise VlensError(f"the {read.reduce} reduction reads {', '.join(LENS_SITES)} only, "
                         f"not {read.site!r}")
    layers = read.layers
    if (not isinstance(layers, tuple) or not layers or len(layers) > facts.n_layers
            or not all(_is_int(x) and 0 <= x < facts.n_layers for x in layers)
            or len(set(layers)) != len(layers)):
        raise VlensError(f"read layers must be 1 to {facts.n_layers} distinct layers, numbered "
                         f"0 to {facts.n_layers - 1}; got {list(layers)!r:.80}")
    hi = min(facts.vocab_size, LENS_K_MAX) if read.reduce == "logit_lens" else 0
    if not _is_int(read.k) or not (1 if hi else 0) <= read.k <= hi:
        raise VlensError(f"read k for {read.reduce} must be " + (
            f"a top-k from 1 to {hi}" if hi else "0") + f", got {read.k!r:.20}")
    if read.heads:
        if read.site != "attn_pattern":
            raise VlensError("read heads select heads of attn_pattern only")
        if (len(set(read.heads)) != len(read.heads)
                or not all(_is_int(h) and 0 <= h < facts.n_heads for h in read.heads)):
            raise VlensError(f"read heads must be distinct heads from 0 to {facts.n_heads - 1}")


def _span_ok(what: str, start: Any, stop: Any, total: int) -> None:
    """A plan entry's positions ``[start, stop)`` (stop -1: to the end) land
    on the ``total`` rows the request runs."""
    if not _is_int(start) or not _is_int(stop) or start < 0 or (stop != -1 and stop <= start):
        raise VlensError(f"{what}: positions [{start!r:.20}, {stop!r:.20}) are not a span "
                         "(0 <= start < stop, or stop -1 for the end)")
    if start >= total or stop > total:
        raise VlensError(f"{what}: positions [{start}, {stop}) reach past the {total} rows this "
                         "request runs (prompt + max_tokens - 1)")


def check_plan(plan: Plan, facts: ModelFacts, vectors: Mapping[str, tuple[int, float]],
               max_tokens: int) -> None:
    """Every read and write of one request's plan, before it is shipped:
    the same checks on a Session's own plans and, in the server's guard, on
    a plan a client made by hand. ``vectors``: the vectors the call sends,
    ``{id: (width, largest |value|)}``; ``max_tokens``: the request's."""
    for part, limit in PLAN_MAX.items():
        n = len(getattr(plan, part))
        if n > limit:
            raise VlensError(f"a plan holds at most {limit} {part}, this one {n}: split the "
                             "call, or read fewer sites")
    total = plan.prompt_len + max_tokens - 1
    for read in plan.reads:
        check_read(read, facts)
    for a in plan.adds:
        what = f"steering add (layer {a.layer!r:.10}, {a.site!r:.40})"
        if not _is_int(a.layer):
            raise VlensError(f"{what}: the layer must be an int")
        check_write_site("Steer", a.site, a.layer, facts)
        _span_ok(what, a.start, a.stop, total)
        width, peak = _vector_of(what, a.vec, a.site, vectors, facts)
        if isinstance(a.scale, bool) or not isinstance(a.scale, (int, float)):
            raise VlensError(f"{what}: the scale must be a number")
        check_write_size(what, peak, float(a.scale), bool(a.relative), facts)
    for w in plan.sets:
        what = f"ablation/patching set (layer {w.layer!r:.10}, {w.site!r:.40})"
        if not _is_int(w.layer):
            raise VlensError(f"{what}: the layer must be an int")
        check_write_site("Ablate", w.site, w.layer, facts)
        _span_ok(what, w.start, w.stop, total)
        width = facts.width(w.site)
        if not (_is_int(w.lo) and _is_int(w.hi) and 0 <= w.lo < width
                and (w.hi == -1 or w.lo < w.hi <= width)):
            raise VlensError(f"{what}: dims [{w.lo!r:.10}, {w.hi!r:.10}) are not inside the "
                             f"row's {width} (0 <= lo < hi <= {width}, or hi -1)")
        if w.vec:
            _, peak = _vector_of(what, w.vec, w.site, vectors, facts)
            check_set_values(what, peak, facts)
    for e in plan.edits:
        if not _is_int(e.layer) or not 0 <= e.layer < facts.n_layers or e.site not in facts.sites:
            raise VlensError(f"edit at ({e.site!r:.40}, {e.layer!r:.10}): no such site/layer")


def _vector_of(what: str, vid: str, site: str, vectors: Mapping[str, tuple[int, float]],
               facts: ModelFacts) -> tuple[int, float]:
    got = vectors.get(vid)
    if got is None:
        raise VlensError(f"{what}: vector {vid!r:.60} was not sent with this call")
    if got[0] != facts.width(site):
        raise VlensError(f"{what}: vector {vid!r:.60} has {got[0]} values; {site} takes "
                         f"{facts.width(site)}")
    return got


def check_write_site(what: str, site: str, layer: int, facts: ModelFacts) -> None:
    """A Steer's or an Ablate's (site, layer): the layer exists and the site
    is one this model has and can write."""
    n = facts.n_layers
    if not 0 <= layer < n:
        raise VlensError(
            f"{what} layer {layer} does not exist: this model has {n} layers, "
            f"numbered 0 to {n - 1}"
        )
    if site not in facts.sites:
        raise facts.no_such_site(site, f"{what} site")
    if site not in facts.writable:
        raise VlensError(
            f"{what} site {site!r} cannot be written: use one of {', '.join(facts.writable)}"
        )


def check_steer(st: Any, facts: ModelFacts, prompt_len: int, max_new_tokens: int) -> Steer:
    """A Steer that fits this model and can land on the request
    (``prompt_len`` prompt tokens, ``max_new_tokens`` generated)."""
    if not isinstance(st, Steer):
        raise VlensError(f"steer entries must be vlens.Steer objects, got {type(st).__name__}")
    check_write_site("Steer", st.site, st.layer, facts)
    width = facts.width(st.site)
    if st.vector.shape[0] != width:
        if st.site == "z":
            raise VlensError(
                f"a Steer at z needs a vector of heads * head_dim = {facts.n_heads} * "
                f"{facts.head_dim} = {width} elements (one slice per head), got "
                f"{st.vector.shape[0]}"
            )
        raise VlensError(
            f"Steer vector has {st.vector.shape[0]} elements but this model's hidden size "
            f"is {facts.hidden_size}: compute it on this model (s.direction)"
        )
    check_span_fits("Steer", st.span, prompt_len, max_new_tokens)
    check_write_size(f"Steer (layer {st.layer}, {st.site})", float(st.vector.abs().max()),
                     float(st.scale), st.relative, facts)
    return st


def write_bound(facts: ModelFacts) -> float:
    """The largest magnitude one write may put into an element of the
    residual stream (or a head's output): far enough under the dtype's
    largest value that adding it to the row cannot overflow, and small
    enough that the row's sum of squares (a norm, computed in float32)
    stays finite."""
    fmax = _FMAX.get(facts.dtype, _FMAX["float16"])
    return min(fmax / 64, math.sqrt(_FMAX["float32"] / max(1, facts.hidden_size)) / 4)


def check_write_size(what: str, peak: float, scale: float, relative: bool,
                     facts: ModelFacts) -> None:
    """A write that cannot overflow the model's dtype: a fixed add's largest
    value ``|scale| * peak`` (``peak``: the vector's largest ``|value|``; a
    set passes scale 1) under :func:`write_bound`, a relative add's
    ``|scale|`` at most :data:`RELATIVE_MAX`."""
    if not math.isfinite(scale) or not math.isfinite(peak):
        raise VlensError(f"{what}: scale and vector must be finite numbers")
    if relative:
        if abs(scale) > RELATIVE_MAX:
            raise VlensError(
                f"{what}: a relative scale of {scale:g} is out of range: it adds scale x each "
                f"token's own norm, so |scale| must be at most {RELATIVE_MAX:g} (1 already "
                "doubles the row)")
        return
    bound = write_bound(facts)
    if abs(scale) * peak > bound:
        raise VlensError(
            f"{what}: |scale| x the vector's largest value = {abs(scale) * peak:.3g} would "
            f"overflow this {facts.dtype} model: a write may put at most {bound:.3g} into a "
            f"value. Use a smaller scale (at most {bound / max(peak, 1e-30):.3g} for this "
            "vector), or relative=True for a fraction of the row's own norm")


def check_span_fits(what: str, span: Any, prompt_len: int, max_new_tokens: int) -> None:
    """A Steer's or an Ablate's span lands on rows the request runs: the last
    generated token is sampled, never fed back, so a request runs
    ``prompt_len + max_new_tokens - 1`` rows at most."""
    total = prompt_len + max_new_tokens - 1
    if span == "generated" and max_new_tokens == 1:
        raise VlensError(
            f"{what} span 'generated' can never land with max_new_tokens=1: the one "
            "generated token is sampled, never fed back. Ask for max_new_tokens >= 2, "
            "or span='all'/'prompt'"
        )
    if isinstance(span, tuple) and span[1] > total:
        raise VlensError(
            f"{what} span {span} reaches past the sequence: this request runs {total} "
            f"tokens ({prompt_len} prompt + {max_new_tokens - 1} fed back), positions 0 "
            f"to {total - 1}"
        )


def check_steers(steer: Any, prompt_lens: Sequence[int], max_new_tokens: int,
                 facts: ModelFacts) -> list[list[Steer]]:
    """``steer=`` as the checked Steers of each prompt (see
    :func:`vlens.edits.per_prompt`); ``prompt_lens``: each prompt's length."""
    steers_each = per_prompt(steer, len(prompt_lens), Steer)
    for n, steers in zip(prompt_lens, steers_each):
        for st in steers:
            check_steer(st, facts, n, max_new_tokens)
    return steers_each


REMOTE_EDIT = (
    "edit= functions cannot run on a connected session (vlens.connect): they are Python "
    "code, and code does not cross the wire to a shared server. Use a vlens.Steer "
    "(steer=), vlens.Ablate or activation patching instead, which travel as data"
)


def check_edit(edit: Any, edit_at: Any, facts: ModelFacts, *,
               can_ship: bool, remote: bool = False) -> list[tuple[str, int]]:
    """``edit=`` / ``edit_at=`` -> the (site, layer) pairs to call it at
    (empty when there is no edit). ``can_ship``: whether a Python function
    can reach this engine's workers; ``remote``: the engine is a server."""
    if edit is None:
        if edit_at is not None:
            raise VlensError("edit_at= given without edit=: pass the function too")
        return []
    if remote:
        raise VlensError(REMOTE_EDIT)
    if not callable(edit):
        raise VlensError(f"edit must be a function fn(rows, ctx), got {type(edit).__name__}")
    if not can_ship:
        raise VlensError(
            "edit= functions run inside the workers and this engine runs in other "
            "processes: use an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "
            "default), or set VLLM_ALLOW_INSECURE_SERIALIZATION=1 before starting it and "
            "pass a picklable function; a Steer needs neither"
        )
    if not edit_at:
        raise VlensError("edit= needs edit_at=[(site, layer), ...]: where to call it")
    pairs = []
    for pair in edit_at:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise VlensError(f"edit_at entries are (site, layer) pairs, got {pair!r}")
        site, layer = pair
        if site not in facts.sites:
            raise facts.no_such_site(site, "edit site")
        if site == "attn_pattern":
            raise VlensError("attn_pattern is computed by vlens, not by the model: an edit "
                             "cannot change it. Edit 'q', 'k' (look only) or 'z' instead")
        check_layers([layer], facts)
        pairs.append((site, int(layer)))
    return pairs


def check_budget(requests: Sequence[tuple[int, Sequence[Read], int, int]],
                 facts: ModelFacts, budget: int) -> None:
    """Refuse a call whose reads would exceed ``budget`` bytes, with the
    estimate and how to shrink it. ``requests``: per request
    ``(prompt length, reads, max_new_tokens, n samples)``."""
    width = {"norm": 1, "logprobs": facts.vocab_size}
    total = 0
    biggest = ""
    for prompt_len, reads, max_new_tokens, n in requests:
        tokens = prompt_len + max_new_tokens - 1
        rows = tokens * max(1, n)
        for read in reads:
            if read.reduce == "full":
                w = facts.width(read.site)
                if read.site == "attn_pattern":  # [heads, T, T]: every key of every row
                    w = (len(read.heads) or facts.n_heads) * tokens
            elif read.reduce == "norm" and read.site in ("q", "k", "v", "z"):
                w = facts.n_heads  # one norm per head
            else:
                w = width.get(read.reduce, 3 * read.k)
            size = rows * len(read.layers) * w * 4
            total += size
            if read.reduce == "full" and size * 2 > total:
                biggest = read.site
    if total > budget:
        raise VlensError(
            f"this call would read about {total / 2**30:.2f} GiB of activations, over the "
            f"session's read budget of {budget / 2**30:.2f} GiB. Reduce it: reduce='norm' "
            "(the worker ships one number per token), fewer layers=, fewer sites=, fewer "
            "or shorter prompts, smaller max_new_tokens=, heads= for attn_pattern (it "
            "grows with the square of the tokens); or raise s.read_budget (bytes)"
            + (f" (most of it is the full {biggest} reads)" if biggest else "")
        )
