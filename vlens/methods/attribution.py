"""``Session.logit_attribution``: direct logit attribution as one call.

One request per prompt (one generated token, so the prompt runs once),
each reading with the worker's ``"dla"`` reduction the embeddings (layer
0's ``resid_pre``), every layer's ``z`` (per head, and the output
projection's bias term: their sum is the layer's ``attn_out`` part; models
without head sites read ``attn_out`` instead) and ``mlp_out``, and the last
layer's ``resid_post`` (the final norm's scale, the bias term and the
engine's own logit difference), at ``position`` only
(``Read.position``: the worker picks each request's row at it out of the
step, in whichever prefill chunk holds it, before it reduces). The worker
ships one float per component (:mod:`vlens.worker.attribution`); here
each is divided by the frozen scale.
"""

from __future__ import annotations

from typing import Any

import torch

from vlens import calls
from vlens.calls import Call
from vlens.checks.facts import is_int
from vlens.errors import VlensError
from vlens.methods.answers import one_token
from vlens.protocol.architectures import ARCHITECTURES
from vlens.protocol.plan import Read
from vlens.results.attribution import Attribution

__all__ = ["logit_attribution_call"]




def _per_prompt(session: Any, x: Any, n: int, which: str, optional: bool
                ) -> list[int | None]:
    """One token (or None, if ``optional``) for every prompt, or a list of
    one per prompt."""
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            raise VlensError(f"{which} has {len(x)} entries for {n} prompts: give one token "
                             "for all, or a list of one per prompt")
        return [_per_prompt(session, v, 1, which, optional)[0] for v in x]
    if x is None:
        if not optional:
            raise VlensError(f"{which}= is needed: the token (text or id) whose logit to "
                             "attribute")
        return [None] * n
    return [one_token(session, x, which)] * n


def _refusal(facts: Any) -> str | None:
    """The models whose stream is renormalised after each block (OPT with
    do_layer_norm_before=False): the final residual is no sum of parts."""
    why = ARCHITECTURES["OPTForCausalLM"].no_mid_if[3]
    if dict(facts.absent).get("resid_mid") == why:
        return ("direct logit attribution needs a residual stream that is the sum of the "
                "blocks' outputs; " + why)
    return None


def logit_attribution_call(session: Any, prompts: Any, answer: Any, wrong: Any,
                           position: Any) -> Call:
    """Check the arguments and build the one call (assembles an
    :class:`~vlens.results.attribution.Attribution`)."""
    facts = session.facts
    why = _refusal(facts)
    if why:
        raise VlensError(why)
    plist = session.prompts(prompts)
    n = len(plist)
    answers = _per_prompt(session, answer, n, "answer", optional=False)
    wrongs = _per_prompt(session, wrong, n, "wrong", optional=True)
    same = [i for i, (a, w) in enumerate(zip(answers, wrongs)) if a == w]
    if same:
        raise VlensError(f"answer and wrong are the same token for prompt {same[0]}: give two "
                         "different tokens (or wrong=None for the answer's logit alone)")
    if not is_int(position):
        raise VlensError(f"position must be an int (a prompt position; -1: the last), got "
                         f"{position!r:.40}")
    positions = []
    for i, p in enumerate(plist):
        k = len(p.ids)
        if not -k <= position < k:
            raise VlensError(f"position {position} is outside prompt {i}, which has {k} tokens "
                             f"(positions 0 to {k - 1}, or -{k} to -1)")
        positions.append(position % k)
    all_layers = tuple(range(facts.n_layers))
    with_heads = "z" in facts.sites
    tag = calls.new_tag()
    requests = []
    for i, (p, a, w) in enumerate(zip(plist, answers, wrongs)):
        target = (a, -1 if w is None else w)
        # position as given (-1: each prompt's last token): prompts of one
        # call share one plan group in the worker when their reads are equal
        at = dict(target=target, position=int(position))
        # with the heads read, each layer's attention part is their row's
        # sum (the projection's bias term is its last column): attn_out is
        # read only where no z is (a third fewer hook visits per step)
        reads = [Read("resid_pre", (0,), "dla", **at),
                 Read("z", all_layers, "dla", **at) if with_heads
                 else Read("attn_out", all_layers, "dla", **at),
                 Read("mlp_out", all_layers, "dla", **at),
                 Read("resid_post", (facts.n_layers - 1,), "dla", **at)]
        requests.append(calls.request(f"{tag}-{i}", i, p.ids, reads=reads, max_new_tokens=1,
                                      logprobs=False, clone=False, source=p))

    def assemble(outputs: list, collected: dict, runs: calls.Assembler) -> Attribution:
        run = runs.build_run([p.label for p in plist], requests, outputs, collected, False)
        # each read holds the one row at the prompt's position: [layers, 1, ...]
        parts = _parts(run, 0, [{r.site: r.key for r in req.plan.reads} for req in requests])
        texts = [session.token_strings([a])[0] for a in answers]
        return Attribution(
            prompts=[p.label for p in plist],
            tokens=[session.token_strings(p.ids) for p in plist],
            position=int(position), positions=positions,
            answer=[int(a) for a in answers], wrong=list(wrongs), answer_text=texts,
            wrong_text=[None if w is None else session.token_strings([w])[0] for w in wrongs],
            **parts,
        )

    return Call(requests, assemble)


def _parts(run: Any, k: int, keys: list[dict[str, str]]) -> dict[str, Any]:
    """Every trace's components at row ``k`` of its reads, divided by the
    frozen scale, stacked over the prompts (``keys``: each trace's read key
    of each site; a prompt's answer is part of its keys, and the prompts of
    one call read the same sites)."""
    def read(site: str) -> torch.Tensor:  # [prompts, layers, w]
        return torch.stack([t.activations(key[site])[:, k] for t, key in zip(run, keys)])

    _, scale, bias, logit = read("resid_post")[:, 0].unbind(-1)  # [prompts] each
    per = scale[:, None]
    heads = read("z") / per[..., None] if "z" in keys[0] else None
    # the heads and the projection's bias term sum to the layer's attn_out part
    attn = heads.sum(-1) if heads is not None else read("attn_out")[..., 0] / per
    return {
        "embed": read("resid_pre")[:, 0, 0] / scale,
        "attn": attn,
        "mlp": read("mlp_out")[..., 0] / per,
        "heads": None if heads is None else heads[..., :-1],
        "head_bias": heads[..., -1] if heads is not None else torch.zeros_like(attn),
        "bias": bias, "scale": scale, "logit_diff": logit,
    }
