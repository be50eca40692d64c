"""The checks of one request's plan, as the workers would run it: the same
function on a Session's own plans and, in the server's guard, on a plan a
client made by hand (one set of rules on both sides).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlens.checks import rules
from vlens.checks.facts import ModelFacts, check_set_values, check_write_site, is_int
from vlens.errors import VlensError
from vlens.protocol.plan import Plan, Read

#: the most reads, steering adds and sets (ablations, patched cells) one
#: request's plan may carry: a call's work in the engine grows with them
PLAN_MAX = {"reads": 64, "adds": 64, "sets": 256}


#: a projecting set's direction must have a value at least this large (a
#: unit vector of any width this kit meets has, and the worker's r / |r|
#: stays finite in float32)
DIRECTION_MIN = 1e-3

#: the reductions a read may ask for, and where: the logit lens and the full
#: log-probabilities unembed the residual stream after the last norm
REDUCES = ("full", "norm", "logit_lens", "vocab_logprobs", "dla")

#: direct logit attribution's sites: the embeddings (resid_pre of layer 0),
#: every block's outputs and heads, and the final residual (the last layer's
#: resid_post, which brings the final norm's scale)
DLA_SITES = ("resid_pre", "attn_out", "mlp_out", "z", "resid_post")

#: the reductions of a feature read (an SAE's encoder, named by ``read.sae``):
#: every feature (``k``: the SAE's width) or each row's ``k`` largest
FEATURE_REDUCES = ("sae", "sae_top")
FEATURE_K_MAX = 1 << 20


LENS_SITES = ("resid_post",)


#: the most top-k of a logit-lens read
LENS_K_MAX = 1000


def check_read(read: Read, facts: ModelFacts) -> None:
    """One read of a plan, as the workers would run it: the site exists, the
    reduction suits it (``attn_pattern`` and ``positions`` in full only; the
    logit lens and the log-probabilities at ``resid_post`` only), the layers
    and heads exist, ``k`` suits the reduction."""
    if read.site not in facts.sites:
        raise facts.no_such_site(read.site, "read site")
    if read.reduce == "logprobs":
        raise VlensError("read reduce 'logprobs' is now 'vocab_logprobs' (the log-probabilities "
                         "over the vocabulary; a trace's logprobs=True are the tokens' own)")
    if read.reduce not in REDUCES + FEATURE_REDUCES:
        raise VlensError(f"read reduce {read.reduce!r:.40} is not one of "
                         f"{list(REDUCES + FEATURE_REDUCES)}")
    if read.site in ("attn_pattern", "positions") and read.reduce != "full":
        raise VlensError(f"{read.site} is read in full only, not with reduce={read.reduce!r}")
    if read.reduce in ("logit_lens", "vocab_logprobs") and read.site not in LENS_SITES:
        raise VlensError(f"the {read.reduce} reduction reads {', '.join(LENS_SITES)} only, "
                         f"not {read.site!r}")
    layers = read.layers
    if (not isinstance(layers, tuple) or not layers or len(layers) > facts.n_layers
            or not all(is_int(x) and 0 <= x < facts.n_layers for x in layers)
            or len(set(layers)) != len(layers)):
        raise VlensError(f"read layers must be 1 to {facts.n_layers} distinct layers, numbered "
                         f"0 to {facts.n_layers - 1}; got {list(layers)!r:.80}")
    if (read.reduce == "dla") != bool(read.target):
        raise VlensError("a dla read names its target (answer id, wrong id or -1), and only "
                         f"a dla read does; got reduce={read.reduce!r:.40}")
    if read.target:
        check_dla_read(read, facts)
    if (read.reduce in FEATURE_REDUCES) != bool(read.sae):
        raise VlensError(f"a feature read ({', '.join(FEATURE_REDUCES)}) names its SAE, and "
                         f"only a feature read does; got reduce={read.reduce!r:.40}")
    if read.sae:
        if not is_int(read.k) or not 1 <= read.k <= FEATURE_K_MAX:
            raise VlensError(f"read k for {read.reduce} must be from 1 to {FEATURE_K_MAX}, "
                             f"got {read.k!r:.20}")
        return
    hi = min(facts.vocab_size, LENS_K_MAX) if read.reduce == "logit_lens" else 0
    if not is_int(read.k) or not (1 if hi else 0) <= read.k <= hi:
        raise VlensError(f"read k for {read.reduce} must be " + (
            f"a top-k from 1 to {hi}" if hi else "0") + f", got {read.k!r:.20}")
    if read.heads:
        if read.site != "attn_pattern":
            raise VlensError("read heads select heads of attn_pattern only")
        if (len(set(read.heads)) != len(read.heads)
                or not all(is_int(h) and 0 <= h < facts.n_heads for h in read.heads)):
            raise VlensError(f"read heads must be distinct heads from 0 to {facts.n_heads - 1}")


def check_dla_read(read: Read, facts: ModelFacts) -> None:
    """A direct-logit-attribution read: one of :data:`DLA_SITES` (the
    embeddings at layer 0 only, the final residual at the last layer only)
    and a target of two ids in the vocabulary (the wrong one -1: none)."""
    if read.site not in DLA_SITES:
        raise VlensError(f"a dla read reads {', '.join(DLA_SITES)}, not {read.site!r:.40}")
    last = facts.n_layers - 1
    if read.site == "resid_pre" and read.layers != (0,):
        raise VlensError("a dla read of resid_pre reads layer 0 only (the embeddings)")
    if read.site == "resid_post" and read.layers != (last,):
        raise VlensError(f"a dla read of resid_post reads the last layer ({last}) only")
    t, vocab = read.target, facts.vocab_size
    if (not isinstance(t, tuple) or len(t) != 2 or not all(is_int(x) for x in t)
            or not 0 <= t[0] < vocab or not (t[1] == -1 or 0 <= t[1] < vocab) or t[0] == t[1]):
        raise VlensError(f"a dla target is (answer id, wrong id or -1), two different ids "
                         f"from 0 to {vocab - 1}; got {t!r:.60}")


def _span_ok(what: str, start: Any, stop: Any, total: int) -> None:
    """A plan entry's positions ``[start, stop)`` (stop -1: to the end) land
    on the ``total`` rows the request runs."""
    if not is_int(start) or not is_int(stop) or start < 0 or (stop != -1 and stop <= start):
        raise VlensError(f"{what}: positions [{start!r:.20}, {stop!r:.20}) are not a span "
                         "(0 <= start < stop, or stop -1 for the end)")
    if start >= total or stop > total:
        raise VlensError(f"{what}: positions [{start}, {stop}) reach past the {total} rows this "
                         "request runs (prompt + max_tokens - 1)")


def _write_at(kind: str, label: str, entry: Any, facts: ModelFacts, total: int) -> str:
    """An add's or a set's layer, site and positions: it lands on rows the
    request runs, at a (site, layer) this model can write. Returns the
    entry's name for the errors that follow."""
    what = f"{label} (layer {entry.layer!r:.10}, {entry.site!r:.40})"
    if not is_int(entry.layer):
        raise VlensError(f"{what}: the layer must be an int")
    check_write_site(kind, entry.site, entry.layer, facts)
    _span_ok(what, entry.start, entry.stop, total)
    return what


def check_plan_size(plan: Plan) -> None:
    """At most ``PLAN_MAX`` reads, adds and sets in one request's plan."""
    for part, limit in PLAN_MAX.items():
        n = len(getattr(plan, part))
        if n > limit:
            raise VlensError(f"a plan holds at most {limit} {part}, this one {n}: split the "
                             "call, or read fewer sites")


def check_plan(plan: Plan, facts: ModelFacts, vectors: Mapping[str, tuple[int, float]],
               max_tokens: int, seen: set | None = None) -> None:
    """Every read and write of one request's plan, before it is shipped:
    the same checks on a Session's own plans and, in the server's guard, on
    a plan a client made by hand. ``vectors``: the vectors the call sends,
    ``{id: (width, largest |value|)}``; ``max_tokens``: the request's;
    ``seen``: the steering writes already checked in this call (the plans
    of one call share it: each distinct write meets the Steer rule once)."""
    check_plan_size(plan)
    total = plan.prompt_len + max_tokens - 1
    for read in plan.reads:
        check_read(read, facts)
    seen = set() if seen is None else seen
    for a in plan.adds:
        what = f"steering add (layer {a.layer!r:.10}, {a.site!r:.40})"
        key = (a.site, a.layer, a.vec, a.scale, a.relative, a.sae, a.feature)
        if key not in seen:
            got = vectors.get(a.vec)
            if got is None:
                raise VlensError(f"{what}: vector {a.vec!r:.60} was not sent with this call")
            rules.steer(what, a.site, a.layer, got[0], got[1], a.scale, bool(a.relative), facts,
                        feature=a.feature if a.sae else None)
            seen.add(key)
        _span_ok(what, a.start, a.stop, total)
    for w in plan.sets:
        what = _write_at("Ablate", "ablation/patching set", w, facts, total)
        width = facts.width(w.site)
        if not (is_int(w.lo) and is_int(w.hi) and 0 <= w.lo < width
                and (w.hi == -1 or w.lo < w.hi <= width)):
            raise VlensError(f"{what}: dims [{w.lo!r:.10}, {w.hi!r:.10}) are not inside the "
                             f"row's {width} (0 <= lo < hi <= {width}, or hi -1)")
        if w.project is not False and (w.project is not True or not w.vec or w.lo != 0
                                       or w.hi != -1):
            raise VlensError(f"{what}: a projecting set (directional ablation) names its "
                             "direction (vec) and writes whole rows (lo 0, hi -1)")
        if w.vec:
            _, peak = _vector_of(what, w.vec, w.site, vectors, facts)
            check_set_values(what, peak, facts)
            if w.project and not peak >= DIRECTION_MIN:
                raise VlensError(f"{what}: direction {w.vec!r:.60} is zero (largest value "
                                 f"{peak:.3g}): send a unit vector, r / |r|")
    for e in plan.edits:
        if not is_int(e.layer) or not 0 <= e.layer < facts.n_layers or e.site not in facts.sites:
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
