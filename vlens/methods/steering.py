"""``Session.compare`` and ``Session.sweep`` (and their streams) as calls.

Both run every arm -- a baseline and edited runs of the same prompts -- in
ONE engine batch, each request reading the last layer's log-probabilities
over the vocabulary (for the KL between arms). ``compare`` has two arms:
the baseline and the run with every edit given (``steer=``, ``ablate=``,
``clamp=``). ``sweep`` varies one Steer's scale (or one Clamp's value) over
``scales``; its ``ablate=`` and ``clamp=`` hold on every arm, the baseline
included, so the sweep shows what the scale alone changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vlens import calls, checks
from vlens.calls import Call
from vlens.edits import Ablate, Steer
from vlens.errors import VlensError
from vlens.methods import ablation
from vlens.methods.traces import ablates_each, steers_each
from vlens.prompts import Prompt, resolve_spans
from vlens.protocol.plan import Read
from vlens.results import Comparison, Run, Sweep, generated_kl, run_label

__all__ = ["compare_call", "sweep_call"]

#: an arm: its name, and each prompt's steers and ablates
Arm = tuple[str, list[list[Steer]], list[list[Ablate]]]


def compare_call(plist: Sequence[Prompt], facts: checks.ModelFacts, *, steer: Any, ablate: Any,
                 clamp: Any, max_new_tokens: int, sampling: dict[str, Any], clone: bool
                 ) -> Call:
    """Baseline and edited arms; assembles (and streams) a Comparison, or
    partial ``(baseline, edited)`` Runs."""
    checks.check_generation(max_new_tokens, sampling, facts)
    steers = steers_each(steer, clamp, plist, max_new_tokens, facts)
    ablates = ablates_each(ablate, plist, max_new_tokens, facts)
    if not any(steers) and not any(ablates):
        raise VlensError("compare needs steer=, ablate= or clamp= (nothing would differ)")
    label = run_label([x for x in (steer, ablate, clamp) if x is not None])
    none = [[] for _ in plist]

    def build(ablates: list[list[Ablate]]) -> Call:
        ablates = [resolve_spans(a, p, i, max_new_tokens)
                   for i, (a, p) in enumerate(zip(ablates, plist))]
        call = _arms_call(plist, [("b", none, none), ("s", steers, ablates)], facts,
                          max_new_tokens, sampling, clone)
        runs_of = call.assemble

        def assemble(outputs: list, collected: dict, runs: calls.Assembler) -> Comparison:
            base, edited = runs_of(outputs, collected, runs)
            kl = [generated_kl(b, s) for b, s in zip(base, edited)]
            return Comparison(base, edited, kl, label=label)

        call.assemble = assemble
        return call

    return ablation.means_first(plist, ablates, build)


def sweep_call(plist: Sequence[Prompt], facts: checks.ModelFacts, *, steer: Any,
               scales: Any, ablate: Any, clamp: Any, max_new_tokens: int,
               sampling: dict[str, Any], clone: bool) -> Call:
    """``steer`` at each of ``scales`` on every prompt, plus an unedited
    baseline arm when 0 is not among the scales (or ``steer`` is a Clamp,
    which writes at value 0); assembles a Sweep."""
    if not isinstance(steer, Steer):
        raise VlensError("sweep takes one vlens.Steer (or vlens.Clamp) as steer=, the edit "
                         "whose scale it varies")
    if not isinstance(scales, (list, tuple)) or not scales:
        raise VlensError("scales must be a non-empty list of numbers")
    bad = [x for x in scales if isinstance(x, bool) or not isinstance(x, (int, float))]
    if bad:
        raise VlensError(f"scales must be numbers; {bad[0]!r} is not")
    scales = [float(x) for x in scales]
    variants = [steer.with_scale(x) for x in scales]  # each checked by its own constructor
    checks.check_generation(max_new_tokens, sampling, facts)
    fixed = steers_each(None, clamp, plist, max_new_tokens, facts)
    ablates = ablates_each(ablate, plist, max_new_tokens, facts)
    arms_steers = [steers_each(v, None, plist, max_new_tokens, facts) for v in variants]
    plain = getattr(steer, "sae", None) is None  # a Clamp to 0 writes: not the baseline
    label = run_label([x for x in (steer, ablate, clamp) if x is not None])

    def build(ablates: list[list[Ablate]]) -> Call:
        ablates = [resolve_spans(a, p, i, max_new_tokens)
                   for i, (a, p) in enumerate(zip(ablates, plist))]
        arms: list[Arm] = []
        for j, (x, each) in enumerate(zip(scales, arms_steers)):
            each = [[] if plain and x == 0 else e for e in each]
            arms.append((str(j), [e + f for e, f in zip(each, fixed)], ablates))
        base = plain and 0.0 in scales
        if not base:
            arms.append(("base", fixed, ablates))
        call = _arms_call(plist, arms, facts, max_new_tokens, sampling, clone)
        runs_of = call.assemble

        def assemble(outputs: list, collected: dict, runs: calls.Assembler) -> Sweep:
            got = runs_of(outputs, collected, runs)
            baseline = got[scales.index(0.0)] if base else got[-1]
            return Sweep([p.label for p in plist], scales, got[: len(scales)], baseline,
                         label=label)

        call.assemble = assemble
        return call

    return ablation.means_first(plist, ablates, build)


def _arms_call(plist: Sequence[Prompt], arms: list[Arm], facts: checks.ModelFacts,
               max_new_tokens: int, sampling: dict[str, Any], clone: bool) -> Call:
    """Every arm over ``plist`` in ONE batch, each request reading the last
    layer's vocabulary log-probabilities: ``assemble`` makes one Run per
    arm, ``partial`` one partial Run per arm."""
    reads = [Read("resid_post", (facts.n_layers - 1,), "vocab_logprobs")]
    labels = [p.label for p in plist]
    tag = calls.new_tag()
    requests = [
        calls.request(f"{tag}-{arm}{i}", i, p.ids, reads=reads, steers=steers,
                      max_new_tokens=max_new_tokens, logprobs=True, sampling=sampling,
                      clone=clone, source=p,
                      **ablation.plan_parts(abl, len(p.ids), facts.head_dim))
        for arm, arm_steers, arm_ablates in arms
        for i, (p, steers, abl) in enumerate(zip(plist, arm_steers, arm_ablates))
    ]
    n = len(plist)

    def assemble(outputs: list, collected: dict, runs: calls.Assembler) -> list[Run]:
        return [runs.build_run(labels, requests[k:k + n], outputs[k:k + n], collected, True)
                for k in range(0, len(requests), n)]

    def partial(outputs: list, runs: calls.Assembler) -> tuple[Run, ...]:
        return tuple(runs.partial_run(labels, requests[k:k + n], outputs[k:k + n])
                     for k in range(0, len(requests), n))

    return Call(requests, assemble, partial=partial)
