"""Gradient methods on the Session's Hugging Face twin
(:mod:`vlens.methods.twin`): attribution patching and saliency.

**Attribution patching** (AtP; Nanda 2023, Kramár et al. 2024) estimates a
whole activation-patching grid from one clean forward, one corrupt forward
and one backward pass on the corrupt run. Patching a cell moves the metric
by about its gradient times the activation change:

    m(patched) - m(corrupt)  ~  grad m(corrupt) . (clean - corrupt)   at that cell

and the cell is normalised as ``s.patch`` normalises it,
``(m(patched) - m(corrupt)) / (m(clean) - m(corrupt))``: 1 = the clean
answer restored, 0 = the corrupt run's. The metric is ``s.patch``'s logit
difference of the two answers at the last position, or any function of the
last position's logits.

**Saliency**: gradient x input (the target logit's gradient at each token's
embedding, dotted with it) by autograd, and integrated gradients along the
straight path from a baseline (by default the end-of-sequence token's
embedding at every position) by Captum (``captum.attr.IntegratedGradients``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vlens import checks
from vlens.errors import VlensError
from vlens.methods.answers import answer_pair, one_token
from vlens.methods.patching import span_positions
from vlens.results.patching import Dist, Patching
from vlens.results.saliency import Saliency

__all__ = ["attribution_patch", "saliency", "TOP_K"]

#: how many next tokens the clean and corrupt runs list (as s.patch's)
TOP_K = 10


def _one_prompt(session: Any, prompt: Any, what: str) -> list[int]:
    plist = session.prompts(prompt)
    if len(plist) != 1:
        raise VlensError(f"{what} takes one prompt (a string, a conversation or "
                         f"{{'prompt_token_ids': [...]}}), got {len(plist)}")
    return list(plist[0].ids)






def _metric(session: Any, metric: Any, answer: Any, logits: list[torch.Tensor]
            ) -> tuple[Callable, tuple[int, int], tuple[str, str]]:
    """``(fn(last logits [vocab]) -> scalar, answer ids, answer texts)``."""
    if callable(metric):
        if answer is not None:
            raise VlensError("answer= goes with metric='logit_diff'; a metric function "
                             "reads the logits itself")
        name = getattr(metric, "__name__", "metric")
        return metric, (-1, -1), (name, name)
    if metric != "logit_diff":
        raise VlensError(f"metric must be 'logit_diff' or a function of the last position's "
                         f"logits [vocab] returning a scalar, got {metric!r}")
    if answer is None:  # each run's top next token, as s.patch picks them
        answer = (int(logits[0].argmax()), int(logits[1].argmax()))
        if answer[0] == answer[1]:
            text = session.token_strings([answer[0]])[0]
            raise VlensError(
                f"the clean and corrupt prompts both predict {text!r} next, so there is no "
                "difference to attribute; pass answer=(clean_token, corrupt_token)")
    else:
        answer = answer_pair(session, answer)
    a, b = answer
    return (lambda x: x[a] - x[b]), answer, tuple(session.token_strings(list(answer)))


def _top(session: Any, logits: torch.Tensor) -> Dist:
    lp = logits.double().log_softmax(-1)
    vals, ids = lp.topk(min(TOP_K, lp.shape[-1]))
    return session.token_strings(ids.tolist()), vals.tolist()


def _check(session: Any, twin: Any, site: Any, heads: Any) -> list[int] | None:
    if not isinstance(site, str) or site not in twin.sites or site not in session.facts.sites:
        offered = [s for s in twin.sites if s in session.facts.sites]
        raise VlensError(f"attribution_patch site {site!r}: the twin takes gradients at "
                         f"{', '.join(offered)}")
    return checks.check_head_cells(heads, site, session.facts, "attribution_patch")


def _attribution_patch(session: Any, twin: Any, clean: Any, corrupt: Any,
                      site: str = "resid_post", layers: Any = None, span: Any = None,
                      heads: Any = None, answer: Any = None,
                      metric: Any = "logit_diff") -> Patching:
    """AtP on ``twin``: a :class:`Patching` shaped as ``s.patch`` makes it
    (``grid`` ``[layers, positions]``, or ``[layers, heads]`` with
    ``heads=`` (``"all"`` or a list) at ``z``, each head's cell summed over ``span``);
    ``diffs`` the estimated metric of each patched run."""
    heads = _check(session, twin, site, heads)
    ids = [_one_prompt(session, p, "attribution_patch's " + w)
           for p, w in ((clean, "clean"), (corrupt, "corrupt"))]
    if len(ids[0]) != len(ids[1]):
        raise VlensError(
            f"clean and corrupt prompts tokenize to {len(ids[0])} and {len(ids[1])} tokens; "
            "attribution patching compares them position by position, so they must have "
            "the same length: change the corrupt prompt word for word")
    layers = checks.check_layers(layers, session.facts)
    positions = span_positions(span, session.prompts(clean)[0], len(ids[0]),
                               "attribution_patch")
    with torch.no_grad(), twin.capture([site], layers) as got:
        clean_logits = twin.logits(ids[0])[-1].float()
        clean_acts = {i: twin.rows(site, got[site][i]).detach() for i in layers}
    with torch.enable_grad(), twin.capture([site], layers) as got:
        corrupt_logits = twin.logits(ids[1], grad=True)[-1].float()
        fn, chosen, texts = _metric(session, metric, answer,
                                    [clean_logits, corrupt_logits.detach()])
        m_corrupt = fn(corrupt_logits)
        if not isinstance(m_corrupt, torch.Tensor) or m_corrupt.numel() != 1:
            raise VlensError("the metric must return a scalar tensor of the logits")
        kept = [got[site][i] for i in layers]
        grads = torch.autograd.grad(m_corrupt.reshape(()), kept, allow_unused=True)
    m_clean, m_corr = float(fn(clean_logits)), float(m_corrupt.detach())
    cells = []
    for i, layer, x, g in zip(range(len(layers)), layers, kept, grads):
        delta = clean_acts[layer] - twin.rows(site, x).detach()
        g = torch.zeros_like(delta) if g is None else twin.rows(site, g)
        prod = (g * delta)[positions].float().cpu()  # [P, width] or [P, heads, head_dim]
        cells.append(prod.sum(-1).sum(0)[heads] if heads is not None
                     else prod.reshape(len(positions), -1).sum(-1))
    diffs = torch.stack(cells)
    span_ = m_clean - m_corr
    if abs(span_) < 1e-6:
        raise VlensError(f"the clean and corrupt runs give the same metric ({m_clean:.4g}): "
                         "there is nothing to restore; pick answers the prompts disagree on")
    tokens = session.token_strings([ids[0][p] for p in positions])
    return Patching(
        site, layers, positions, heads, tokens,
        chosen, texts, (diffs / span_).float(), (m_corr + diffs).float(), m_clean, m_corr,
        [], _top(session, clean_logits), _top(session, corrupt_logits.detach()))


def attribution_patch(session: Any, twin: Any, *args: Any, **kwargs: Any) -> Patching:
    """AtP on ``twin`` (see ``_attribution_patch``), under the twin's lock:
    a background run and a cell's call never record each other's forward."""
    with twin.lock:
        return _attribution_patch(session, twin, *args, **kwargs)


def saliency(session: Any, twin: Any, *args: Any, **kwargs: Any) -> Saliency:
    """Saliency on ``twin`` (see ``_saliency``), under the twin's lock."""
    with twin.lock:
        return _saliency(session, twin, *args, **kwargs)


def _baseline(session: Any, baseline: Any) -> int | None:
    """The baseline token's id (None: the all-zero embedding)."""
    if isinstance(baseline, str) and baseline == "zeros":
        return None
    if baseline is not None:
        return one_token(session, baseline, "baseline")
    tok = session.tokenizer
    for tid in (tok.eos_token_id, tok.bos_token_id, 0):
        if tid is not None:
            return int(tid)
    return 0


def _saliency(session: Any, twin: Any, prompt: Any, target: Any = None, steps: int = 64,
             baseline: Any = None) -> Saliency:
    """Gradient x input and Captum's integrated gradients (``steps``
    Gauss-Legendre points, from ``baseline``: a token whose embedding fills
    every position, default the end-of-sequence token, or ``"zeros"``) of
    the ``target`` logit at the last position, per prompt token."""
    from captum.attr import IntegratedGradients

    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise VlensError(f"steps must be an int of at least 2, got {steps!r}")
    ids = _one_prompt(session, prompt, "saliency")
    bid = _baseline(session, baseline)
    embed = twin.model.get_input_embeddings()
    with torch.no_grad():
        x = embed(twin.ids(ids)).float()  # [1, T, hidden]
        base = torch.zeros_like(x) if bid is None else embed(twin.ids([bid] * len(ids))).float()
        logits = twin.model(inputs_embeds=x).logits[0, -1]
    tid = int(logits.argmax()) if target is None else one_token(session, target, "target")

    def logit(e: torch.Tensor) -> torch.Tensor:  # [n, T, hidden] -> [n]
        return twin.model(inputs_embeds=e).logits[:, -1, tid].float()

    with torch.enable_grad():
        xg = x.clone().requires_grad_(True)
        value = logit(xg)
        (grad,) = torch.autograd.grad(value.sum(), xg)
        ig, delta = IntegratedGradients(logit).attribute(
            x, baselines=base, n_steps=steps, return_convergence_delta=True)
    with torch.no_grad():
        base_logit = float(logit(base))
    return Saliency(
        tokens=session.token_strings(ids), ids=ids, target=tid,
        target_text=session.token_strings([tid])[0],
        grad_x_input=(grad * x)[0].sum(-1).detach().float().cpu(),
        integrated=ig[0].sum(-1).detach().float().cpu(), logit=float(value.detach()),
        baseline_logit=base_logit, delta=float(delta.reshape(-1)[0]), steps=steps,
        baseline="zeros" if bid is None else session.token_strings([bid])[0],
    )
