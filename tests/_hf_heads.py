"""Hugging Face reference values of the head sites, for any architecture.

Run as a script in a fresh process (``python tests/_hf_heads.py spec.json
out.pt``): vLLM patches Hugging Face model classes in any process where it
has built a Transformers-backend engine. ``spec`` is ``{"path": model
folder, "ids": [[token ids], ...], "jobs": [...]}``; the output is
``{"heads": one dict per sequence with q, k, v, z as [layers, T, heads,
head_dim] and attn_pattern [layers, heads, T, T], "jobs": the results of
tests/_hf_methods.py's ablation and patching jobs}``, from one process.

The model runs with eager attention (``attn_implementation="eager"``).
q, k and v are what Hugging Face's eager attention function receives (q and
k after rotary, whatever rotary the family uses: partial in GPT-NeoX, after
OLMo2's q/k norms), recorded by wrapping the modeling file's own
``eager_attention_forward`` (GPT-J's own ``_attn`` method), with q taken
as vLLM's kernel receives it (OPT scales q before the function; that scale
is divided back out); z is the input of the attention's output
projection; the patterns are ``outputs.attentions``.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from _hf_methods import ablate, patch
from _hf_reference import _get, site_module
from vlens.protocol.architectures import ARCHITECTURES


def _per_token(x: torch.Tensor) -> torch.Tensor:
    """``[1, heads, T, d]`` -> ``[T, heads, d]``."""
    return x[0].transpose(0, 1).clone()


def head_values(model, ids: list[int]) -> dict[str, torch.Tensor]:
    arch = ARCHITECTURES[model.config.architectures[0]]
    layers = _get(model, arch.hf.layers)
    got: dict[str, list] = {s: [] for s in ("q", "k", "v", "z")}
    handles, patched = [], {}
    attn_modules = {id(_get(layer, arch.hf.attn)) for layer in layers}

    def record(query, key, value):
        got["q"].append(_per_token(query))
        got["k"].append(_per_token(key))
        got["v"].append(_per_token(value))

    own = []  # modules with their own attention method (GPT-J's ``_attn``)
    for layer in layers:
        attn = _get(layer, arch.hf.attn)
        if hasattr(attn, "_attn"):
            inner = attn._attn

            def recording_method(query, key, value, *args, _inner=inner, **kwargs):
                record(query, key, value)
                return _inner(query, key, value, *args, **kwargs)

            attn._attn = recording_method
            own.append(attn)
            continue
        module = sys.modules[type(attn).__module__]
        if module.__name__ in patched:
            continue
        eager = module.eager_attention_forward

        def recording(mod, query, key, value, *args, _eager=eager, **kwargs):
            if id(mod) in attn_modules:
                # OPT multiplies q by its scaling before the attention function
                # and passes scaling=1.0; vLLM's kernel receives q unscaled and
                # applies the scale itself: take the scale back out
                passed, own = kwargs.get("scaling"), getattr(mod, "scaling", None)
                pre = passed is not None and own is not None and passed != own
                record(query * (passed / own) if pre else query, key, value)
            return _eager(mod, query, key, value, *args, **kwargs)

        patched[module.__name__] = (module, eager)
        module.eager_attention_forward = recording
    n_heads = model.config.num_attention_heads
    for layer in layers:
        proj, _ = site_module(layer, arch.hf, "z")
        handles.append(proj.register_forward_pre_hook(
            lambda m, args: got["z"].append(args[0][0].reshape(args[0].shape[1], n_heads, -1)
                                            .clone())))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        for h in handles:
            h.remove()
        for module, eager in patched.values():
            module.eager_attention_forward = eager
        for attn in own:
            del attn._attn  # the class's method again
    ref = {s: torch.stack(v) for s, v in got.items()}
    ref["attn_pattern"] = torch.stack([a[0] for a in out.attentions])
    return ref


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    model = AutoModelForCausalLM.from_pretrained(
        spec["path"], dtype=torch.float32, attn_implementation="eager").eval()
    arch = ARCHITECTURES[model.config.architectures[0]]
    jobs = [ablate(model, arch, job) if job["kind"] == "ablate" else patch(model, arch, job)
            for job in spec.get("jobs", [])]
    torch.save({"heads": [head_values(model, ids) for ids in spec.get("ids", [])],
                "jobs": jobs}, sys.argv[2])


if __name__ == "__main__":
    main()
