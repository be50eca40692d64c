"""``Session.trace`` and ``Session.stream`` as one call: the trace's
arguments as a frozen :class:`TraceSpec`, checked once, then the
:class:`~vlens.calls.Call` that runs it.

A trace with mean ablations that bring no mean (``Ablate(kind="mean")``)
is one call in two stages: the first reads the sites' means over the
call's prompts from the unedited model, and its ``assemble`` returns the
second stage, the trace itself with those means filled in.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vlens import calls, checks
from vlens.calls import Call
from vlens.edits import Ablate, Steer, per_prompt
from vlens.errors import VlensError
from vlens.methods import ablation, sae
from vlens.prompts import Prompt, resolve_spans
from vlens.protocol.plan import Edit, Read

__all__ = ["TraceSpec", "steers_each", "trace_call"]


@dataclass(frozen=True)
class TraceSpec:
    """What one trace runs, from ``Session.trace``'s keywords (see there)
    and the session's state when it was called."""

    prompts: tuple[Prompt, ...]
    facts: checks.ModelFacts
    layers: Any = None
    sites: Any = ("resid_post",)
    max_new_tokens: int = 16
    logprobs: bool = True
    background: tuple[Prompt, ...] = ()
    steer: Any = None
    ablate: Any = None
    edit: Any = None
    edit_at: Any = None
    reduce: str = "full"
    logit_lens: int = 0
    heads: Any = None
    saes: Any = None
    features_top_k: int = 0
    clamp: Any = None
    sampling: dict[str, Any] = field(default_factory=dict)
    clone: bool = False
    #: whether an edit= function can reach the workers; whether the engine is a server
    can_ship: bool = True
    remote: bool = False


def steers_each(steer: Any, clamp: Any, plist: Sequence[Prompt], max_new_tokens: int,
                facts: checks.ModelFacts) -> list[list[Steer]]:
    """``steer=`` and ``clamp=`` as each prompt's checked Steers (Clamps
    last), role spans resolved: each Steer object meets the model's rule
    once, its span each prompt it lands on."""
    lens = [len(p.ids) for p in plist]
    out = [[] for _ in plist]
    for value, is_clamp in ((steer, False), (clamp, True)):
        each = per_prompt(value, len(plist), Steer)
        if is_clamp:
            for entries in each:
                for c in entries:
                    if not isinstance(c, sae.Clamp):
                        raise VlensError(
                            f"clamp= takes vlens.Clamp entries, got {type(c).__name__}: "
                            "pass a Steer as steer=")
        seen: set[int] = set()
        for entries in each:
            for st in entries:
                if id(st) not in seen:
                    checks.check_steer_fits(st, facts)
                    seen.add(id(st))
        each = [resolve_spans(e, p, i, max_new_tokens) for i, (e, p) in enumerate(zip(each, plist))]
        for n, entries in zip(lens, each):
            for st in entries:
                checks.check_span_fits("Steer", st.span, n, max_new_tokens)
        out = [a + b for a, b in zip(out, each)]
    return out


def ablates_each(ablate: Any, plist: Sequence[Prompt], max_new_tokens: int,
                 facts: checks.ModelFacts) -> list[list[Ablate]]:
    """``ablate=`` as each prompt's checked Ablates (one layer each)."""
    each = per_prompt(ablate, len(plist), Ablate)
    return ablation.check_ablates(each, facts, [len(p.ids) for p in plist], max_new_tokens)


def trace_call(spec: TraceSpec) -> Call:
    """Check a trace's arguments once and build its call (which streams
    too); with means to read first, the call's first stage reads them."""
    facts, m, plist = spec.facts, spec.max_new_tokens, spec.prompts
    layers = checks.check_layers(spec.layers, facts)
    sites = checks.check_sites(spec.sites, facts)
    reads = checks.check_reads(sites, layers, spec.reduce, spec.logit_lens, facts,
                               checks.check_heads(spec.heads, sites, facts))
    feature_reads, saes = sae.feature_reads(spec.saes, spec.features_top_k, facts)
    reads += feature_reads
    checks.check_generation(m, spec.sampling, facts)
    steers = steers_each(spec.steer, spec.clamp, plist, m, facts)
    ablates = ablates_each(spec.ablate, plist, m, facts)
    pairs = checks.check_edit(spec.edit, spec.edit_at, facts, can_ship=spec.can_ship,
                              remote=spec.remote)

    def build(ablates: list[list[Ablate]]) -> Call:
        ablates = [resolve_spans(a, p, i, m) for i, (a, p) in enumerate(zip(ablates, plist))]
        return _trace_stage(spec, reads, saes, steers, ablates, pairs)

    return ablation.means_first(plist, ablates, build)


def _trace_stage(spec: TraceSpec, reads: list[Read], saes: list[Any],
                 steers: list[list[Steer]], ablates: list[list[Ablate]],
                 pairs: list[tuple[str, int]]) -> Call:
    facts, m, plist = spec.facts, spec.max_new_tokens, spec.prompts
    fid = f"fn-{uuid.uuid4().hex[:12]}"
    edits = [Edit(site, layer, fid) for site, layer in pairs]
    tag = calls.new_tag()
    requests = [
        calls.request(f"{tag}-{i}", i, p.ids, reads=reads, steers=st, edits=edits,
                      max_new_tokens=m, logprobs=spec.logprobs, sampling=spec.sampling,
                      clone=spec.clone, source=p, saes=saes,
                      **ablation.plan_parts(abl, len(p.ids), facts.head_dim))
        for i, (p, st, abl) in enumerate(zip(plist, steers, ablates))
    ]
    requests += [calls.background(p.ids, m, spec.sampling) for p in spec.background]
    n = len(plist)
    labels = [p.label for p in plist]

    def assemble(outputs: list, collected: dict, runs: calls.Assembler) -> Any:
        run = runs.build_run(labels, requests[:n], outputs[:n], collected, spec.logprobs)
        run.background_texts = [o.outputs[0].text for o in outputs[n:]]
        return run

    return Call(requests, assemble,
                partial=lambda outs, runs: runs.partial_run(labels, requests[:n], outs[:n]),
                edit_fns={fid: spec.edit} if edits else {})
