"""Hugging Face reference values for tests/test_models.py.

Run as a script in a fresh process (``python tests/_hf_reference.py
spec.json out.pt``): vLLM patches Hugging Face model classes in any process
where it has built a Transformers-backend engine, so the reference must not
share a process with an engine.

For each model: every site at every layer read by hooks on the Hugging Face
modules named in the architecture's row (``resid_pre`` / ``resid_post`` also
from ``hidden_states``, independently of the row), the logit lens of every
layer through the model's own final norm, head and softcapping, and the same
again with each writable site of one layer steered (``+ vector``) or edited
(``* 0.5``), and the head sites q, k, v, z, attn_pattern of the clean run
(``tests/_hf_heads.py``). Modifications are made in place, as vlens's are, so a module's
input that is also the block's residual changes in both roles.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vlens.protocol.architectures import ARCHITECTURES
from vlens.testing import hf_steering_hook  # the one HF steering hook


def _get(root, path):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _rows(x):
    """[1, T, H] or [T, H] (OPT flattens the batch before its MLP) -> [T, H]."""
    return x[0] if x.dim() == 3 else x


def _input(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def site_module(layer, hf, site):
    """(module, pre-hook?) of ``site`` in one Hugging Face decoder layer;
    ``z`` is the input of the attention's output projection."""
    if site == "resid_pre":
        return layer, True
    if site == "resid_post":
        return layer, False
    if site == "resid_mid":
        return _get(layer, hf.mid), True
    if site == "z":
        attn = _get(layer, hf.attn)
        proj = getattr(attn, "o_proj", None) or getattr(attn, "c_proj", None) \
            or getattr(attn, "out_proj", None) or getattr(attn, "dense", None)
        return proj, True
    return _get(layer, hf.attn if site == "attn_out" else hf.mlp), False


def _hooks(model, arch, sites, change):
    """Install read hooks (and ``change = (site, layer, fn)`` before them);
    returns (handles, got) with got[site] a list per layer."""
    hf = arch.hf
    layers = _get(model, hf.layers)
    got = {s: [None] * len(layers) for s in sites}
    handles = []

    def where(site, layer):
        return site_module(layer, hf, site)

    def reader(site, i, pre):
        if pre:
            def hook(mod, args, kwargs):
                got[site][i] = _rows(_input(args, kwargs)).clone()
        else:
            def hook(mod, args, kwargs, out):
                got[site][i] = _rows(_first(out)).clone()
        return hook

    for i, layer in enumerate(layers):
        for site in sites:
            mod, pre = where(site, layer)
            if change is not None and change[0] == site and change[1] == i:
                handles.append(hf_steering_hook(mod, change[2], pre=pre))
            reg = mod.register_forward_pre_hook if pre else mod.register_forward_hook
            handles.append(reg(reader(site, i, pre), with_kwargs=True))
    return handles, got


def _lens(model, arch, resid):
    """[L, T, H] -> [L, T, vocab] probabilities through the final norm, any
    projection after it, the output head and the final softcapping."""
    x = resid
    norm = _get(model, arch.hf.norm)
    if norm is not None:
        x = norm(x)
    project = _get(model, arch.hf.project) if arch.hf.project else None
    if project is not None:
        x = project(x)
    logits = model.get_output_embeddings()(x)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.float().softmax(-1)


def reference(path, arch, prompt, sites, vector, write_layer):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]
    inputs = torch.tensor([ids])
    out = {"ids": ids}

    def run(change):
        handles, got = _hooks(model, arch, sites, change)
        try:
            with torch.no_grad():
                res = model(inputs, output_hidden_states=True)
                vals = {s: torch.stack(v) for s, v in got.items()}
                vals["lens"] = _lens(model, arch, vals["resid_post"])
                vals["final_probs"] = res.logits[0].float().softmax(-1)
        finally:
            for h in handles:
                h.remove()
        return vals, res

    clean, res = run(None)
    hs = [h[0] for h in res.hidden_states]  # L + 1 entries, the last after the final norm
    clean["hs_resid_pre"] = torch.stack(hs[:-1])
    clean["hs_resid_post"] = torch.stack(hs[1:-1])  # all but the last layer
    out["clean"] = clean
    for site in sites:
        out[f"steer:{site}"] = run((site, write_layer, lambda x: x + vector))[0]
        out[f"edit:{site}"] = run((site, write_layer, lambda x: x * 0.5))[0]
    from _hf_heads import head_values  # the head sites, from eager attention

    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    out["heads"] = head_values(eager, ids)
    return out


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    results = {}
    for item in spec["models"]:
        arch = ARCHITECTURES[item["arch"]]
        vector = torch.tensor(item["vector"], dtype=torch.float32)
        results[item["arch"]] = reference(item["path"], arch, spec["prompt"], item["sites"],
                                          vector, spec["write_layer"])
    torch.save(results, sys.argv[2])


if __name__ == "__main__":
    main()
