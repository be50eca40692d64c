"""Hugging Face reference values of direct logit attribution.

Run as a script in a fresh process (``python tests/_hf_attribution.py
spec.json out.pt``): vLLM patches Hugging Face model classes in a process
where it has built a Transformers-backend engine. ``spec`` is ``{"path":
model folder, "jobs": [{"ids", "answer", "wrong" (or -1), "position"}]}``;
the output is one dict per job with ``embed``, ``attn`` ``[layers]``,
``mlp`` ``[layers]``, ``heads`` ``[layers, heads]``, ``head_bias``
``[layers]``, ``bias``, ``scale`` and ``logit_diff`` (pre-softcap).

Written apart from the worker's maths: forward hooks record each block's
output as it joins the residual stream (through the layer's own post norm
where there is one), each head's slice of the output projection's input,
and the final norm's input; each component is then put through the final
norm with its scale frozen at the final residual's (centring included for
LayerNorm, Gemma's ``1 + w``) and dotted with ``W_U[answer] - W_U[wrong]``.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from vlens.protocol.architectures import ARCHITECTURES


def _get(root, path):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _norm(m):
    """(kind, weight as applied, bias, eps) of a Hugging Face norm."""
    if isinstance(m, nn.LayerNorm):
        return "layer", m.weight.float(), m.bias.float(), m.eps
    eps = getattr(m, "variance_epsilon", None)
    eps = m.eps if eps is None else eps
    w = m.weight.float()
    return "rms", (1.0 + w) if "Gemma" in type(m).__name__ else w, None, eps


def _frozen(m, full: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``part`` ``[T, width]`` through norm ``m`` with the scale of each
    row of ``full`` (no bias)."""
    kind, w, _, eps = _norm(m)
    if kind == "layer":
        s = (full.var(-1, unbiased=False) + eps).sqrt()
        part = part - part.mean(-1, keepdim=True)
    else:
        s = (full.pow(2).mean(-1) + eps).sqrt()
    return part * w / s[:, None]


def _head_weight(proj) -> torch.Tensor:
    """The output projection as ``[heads * head_dim, hidden]`` (GPT-2's
    Conv1D keeps it that way; nn.Linear transposed)."""
    return proj.weight.float().t() if isinstance(proj, nn.Linear) else proj.weight.float()


def attribution(model, ids: list[int], answer: int, wrong: int, position: int) -> dict:
    arch = ARCHITECTURES[model.config.architectures[0]]
    hf = arch.hf
    layers = _get(model, hf.layers)
    final = _get(model, hf.norm)
    got: dict[str, list] = {"attn": [], "mlp": [], "z": []}
    handles = []
    for layer in layers:
        attn = _get(layer, hf.attn)
        handles.append(attn.register_forward_hook(
            lambda m, a, out: got["attn"].append(out[0] if isinstance(out, tuple) else out)))
        handles.append(_get(layer, hf.mlp).register_forward_hook(
            lambda m, a, out: got["mlp"].append(out)))
        handles.append(_get(attn, hf.out_proj).register_forward_pre_hook(
            lambda m, a: got["z"].append(a[0])))
    handles.append(final.register_forward_pre_hook(
        lambda m, a, kw: got.__setitem__("x", (a[0] if a else kw["hidden_states"])),
        with_kwargs=True))
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        for h in handles:
            h.remove()
        x = got["x"][0].float()
        head = model.get_output_embeddings()
        d = head.weight[answer].float() - (head.weight[wrong].float() if wrong >= 0 else 0.0)
        b_head = getattr(head, "bias", None)
        _, _, fb, _ = _norm(final)
        bias = (0.0 if fb is None else float(fb @ d)) + (
            0.0 if b_head is None else float(b_head[answer] - (b_head[wrong] if wrong >= 0
                                                               else 0.0)))

        def through(part: torch.Tensor) -> float:  # [T, hidden] -> its share at position
            return float(_frozen(final, x, part)[position] @ d)

        res = {"embed": through(out.hidden_states[0][0].float()), "attn": [], "mlp": [],
               "heads": [], "head_bias": []}
        for i, layer in enumerate(layers):
            a_out, m_out = got["attn"][i][0].float(), got["mlp"][i][0].float()
            a_post = _get(layer, hf.attn_post) if hf.attn_post else None
            m_post = _get(layer, hf.mlp_post) if hf.mlp_post else None
            res["attn"].append(through(a_post(a_out).float() if a_post else a_out))
            res["mlp"].append(through(m_post(m_out).float() if m_post else m_out))
            proj = _get(_get(layer, hf.attn), hf.out_proj)
            w_o = _head_weight(proj)
            z = got["z"][i][0].float()  # [T, heads * head_dim]
            n_heads = model.config.num_attention_heads
            hd = z.shape[-1] // n_heads
            b_o = proj.bias.float() if getattr(proj, "bias", None) is not None else None
            row = []
            for h in range(n_heads):
                o_h = z[:, h * hd:(h + 1) * hd] @ w_o[h * hd:(h + 1) * hd]
                row.append(through(_frozen(a_post, a_out, o_h) if a_post else o_h))
            res["heads"].append(row)
            b_vec = torch.zeros_like(a_out) if b_o is None else b_o.expand_as(a_out)
            if a_post is not None:
                post_bias = getattr(a_post, "bias", None)
                b_vec = _frozen(a_post, a_out, b_vec) + (0.0 if post_bias is None
                                                         else post_bias.float())
            res["head_bias"].append(through(b_vec))
        kind, w, b, eps = _norm(final)
        if kind == "layer":
            scale = (x.var(-1, unbiased=False) + eps).sqrt()
        else:
            scale = (x.pow(2).mean(-1) + eps).sqrt()
        normed = final(got["x"]).float()[0]
        logits = normed @ head.weight.float().t() + (0.0 if b_head is None else b_head.float())
        res["logit_diff"] = float(logits[position, answer]
                                  - (logits[position, wrong] if wrong >= 0 else 0.0))
        res["bias"], res["scale"] = bias, float(scale[position])
    return {k: torch.tensor(v) if isinstance(v, list) else v for k, v in res.items()}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    model = AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    out = [attribution(model, j["ids"], j["answer"], j["wrong"], j["position"])
           for j in spec["jobs"]]
    torch.save(out, sys.argv[2])


if __name__ == "__main__":
    main()
