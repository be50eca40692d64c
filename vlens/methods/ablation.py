"""Ablation: knock a site's rows (or single heads of ``z``) out of a run.

:class:`~vlens.edits.Ablate` says what to knock out where: a site, a layer,
zeros or a mean, optionally a few heads of ``z``, over a token span. The
Session checks it (``check_ablates``)
against the model and turns it into ``Set`` entries of the request's plan
(:class:`vlens.protocol.plan.Set`): the workers apply every request's sets at a
(site, layer) in one batched masked write per step, like the steering adds,
and the request's prefix-cache salt includes them, so ablated KV is never
served to anyone else.

A directional Ablate (``direction=r``) becomes one projecting Set per layer
it names (``layer="all"``: every layer), all naming the one unit vector
``r^``: each row of the span loses its component along ``r^``.

``kind="mean"`` with ``mean=None`` replaces the rows with the site's mean
over every prompt token of the call's own prompts (all prompts pooled, BOS
included), read from the unedited model in one extra engine call first.
Nothing here touches the engine: :func:`means_first` makes that pass the
first stage of the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from vlens import calls
from vlens.calls import Call
from vlens.checks import check_span_fits, rules
from vlens.edits import Ablate, vector_id
from vlens.errors import VlensError
from vlens.protocol.plan import Read, Set

__all__ = ["check_ablate", "check_ablates", "check_overlap", "means_first", "per_layer",
           "plan_parts", "to_sets"]


def per_layer(ab: Ablate, facts: Any) -> list[Ablate]:
    """An Ablate as one Ablate per layer it writes (a directional one may
    name ``"all"`` or a list); its layers checked against the model."""
    if isinstance(ab.layer, int):
        return [ab]
    n = facts.n_layers
    layers = ab.layers(n)
    bad = [x for x in layers if not 0 <= x < n]
    if bad:
        raise VlensError(
            f"Ablate layer list {list(layers)}: layer {bad[0]} does not exist; this model has "
            f"{n} layers, numbered 0 to {n - 1} (layer='all' names every one)")
    return [replace(ab, layer=x) for x in layers]


def check_ablate(ab: Ablate, facts: Any, prompt_len: int, max_new_tokens: int, *,
                 span: bool = True) -> None:
    """An Ablate (one layer) that fits this model, by the one Ablate rule
    (:func:`vlens.checks.rules.ablate`), and (``span``) can land on the
    request."""
    rules.ablate(f"Ablate (layer {ab.layer}, {ab.site})", ab.site, ab.layer, ab.heads,
                 None if ab.mean is None else (ab.mean.numel(), float(ab.mean.abs().max())),
                 None if ab.direction is None else ab.direction.numel(), facts)
    if span:
        check_span_fits("Ablate", ab.span, prompt_len, max_new_tokens)


def check_overlap(ablates: Sequence[Ablate], i: int) -> None:
    """Two Ablates of prompt ``i`` may not write the same dims of one (site,
    layer) (the second would undo the first's difference)."""
    seen: dict[tuple[str, int], set] = {}
    for ab in ablates:
        heads = set(ab.heads) if ab.heads is not None else {"all"}
        taken = seen.setdefault((ab.site, ab.layer), set())
        if taken & heads or (taken and "all" in heads | taken):
            raise VlensError(
                f"prompt {i}: two Ablates write site {ab.site!r} at layer {ab.layer} over "
                "the same dims; give each (site, layer) once (list several heads in one "
                "Ablate's heads=)"
            )
        taken |= heads


def check_ablates(per_prompt: list[list[Ablate]], facts: Any, prompt_lens: Sequence[int],
                  max_new_tokens: int) -> list[list[Ablate]]:
    """Every prompt's Ablates, each checked once (one Ablate object on many
    prompts meets the rule once; its span on each prompt), none two over
    the same dims. Returns them with one layer each (:func:`per_layer`)."""
    out = []
    ruled: set[int] = set()
    for i, (ablates, n) in enumerate(zip(per_prompt, prompt_lens)):
        each = []
        for ab in ablates:
            layers = per_layer(ab, facts)
            for x in layers:
                if id(ab) in ruled:  # met the rule on an earlier prompt: its span here
                    check_span_fits("Ablate", x.span, n, max_new_tokens)
                else:
                    check_ablate(x, facts, n, max_new_tokens)
            ruled.add(id(ab))
            each.extend(layers)
        check_overlap(each, i)
        out.append(each)
    return out


def means_first(plist: Sequence[Any], per_prompt: list[list[Ablate]],
                build: Callable[[list[list[Ablate]]], Call]) -> Call:
    """The call that runs ``build(ablates)``; when Ablates with
    ``kind="mean"`` bring no mean, a stage before it reads each such (site,
    layer)'s mean over every prompt token of ``plist`` (the unedited model,
    all prompts pooled, BOS included) and fills them in."""
    wanted = sorted({(ab.site, ab.layer) for abs_ in per_prompt for ab in abs_
                     if ab.kind == "mean" and ab.mean is None})
    if not wanted:
        return build(per_prompt)
    sites = sorted({s for s, _ in wanted})
    layers = tuple(sorted({layer for _, layer in wanted}))
    tag = calls.new_tag()
    requests = [calls.request(f"{tag}-mean{i}", i, p.ids, reads=[Read(s, layers, "full")
                                                                 for s in sites],
                              max_new_tokens=1, logprobs=False, clone=False, source=p)
                for i, p in enumerate(plist)]

    def assemble(outputs: list, collected: dict, runs: Any) -> Call:
        run = runs.build_run([p.label for p in plist], requests, outputs, collected, False)
        means = {}
        for site, layer in wanted:
            rows = [t.activations(site, layer=layer) for t in run]  # each [T, ...]
            flat = torch.cat([r.reshape(r.shape[0], -1) for r in rows])  # [all tokens, width]
            means[(site, layer)] = flat.mean(0)
        return build([[ab.with_mean(means[(ab.site, ab.layer)])
                       if ab.kind == "mean" and ab.mean is None else ab for ab in abs_]
                      for abs_ in per_prompt])

    return Call(requests, assemble, progress=False)


def to_sets(ablates: Sequence[Ablate], prompt_len: int, head_dim: int
            ) -> tuple[list[Set], dict[str, torch.Tensor]]:
    """A prompt's checked Ablates (one layer each) as plan entries and the
    vectors they name: one Set per Ablate, or per run of adjacent heads for
    ``z`` heads; a directional Ablate's Set projects."""
    sets: list[Set] = []
    vectors: dict[str, torch.Tensor] = {}
    for ab in ablates:
        vid = ""
        if ab.direction is not None:
            vid = vector_id(ab.direction)
            vectors[vid] = ab.direction
            sets.append(Set(ab.site, ab.layer, vid, 0, -1, *ab.positions(prompt_len),
                            project=True))
            continue
        if ab.kind == "mean":
            vid = vector_id(ab.mean)
            vectors[vid] = ab.mean
        start, stop = ab.positions(prompt_len)
        for lo, hi in _dim_ranges(ab.heads, head_dim):
            sets.append(Set(ab.site, ab.layer, vid, lo, hi, start, stop))
    return sets, vectors


def _dim_ranges(heads: Sequence[int] | None, hd: int) -> list[tuple[int, int]]:
    """Head indices -> ``[lo, hi)`` dim ranges of the flat z row (adjacent
    heads merged); None -> the whole row."""
    if heads is None:
        return [(0, -1)]
    ranges: list[list[int]] = []
    for h in heads:  # sorted
        if ranges and ranges[-1][1] == h * hd:
            ranges[-1][1] = (h + 1) * hd
        else:
            ranges.append([h * hd, (h + 1) * hd])
    return [(lo, hi) for lo, hi in ranges]


def plan_parts(ablates: Sequence[Ablate], prompt_len: int, head_dim: int) -> dict[str, Any]:
    """``calls.request`` keywords for a prompt's Ablates."""
    if not ablates:
        return {}
    sets, vectors = to_sets(ablates, prompt_len, head_dim)
    return {"sets": sets, "vectors": vectors}
