"""Hugging Face reference for vlens.Clamp (tests/test_sae.py), run as a
script in a fresh process like tests/_hf_methods.py: ``python
tests/_hf_clamp.py spec.json out.pt``. ``spec``: the model folder and jobs
``{"ids", "sae": folder, "site", "layer", "feature", "value", "span":
[start, stop]}``; each is one forward over ``ids`` with a hook that writes
``x + (value - f(x)) * W_dec[feature]`` into rows ``[start, stop)`` of the
site (``f``: SAELens's encode, tests/_sae_reference.py); returns every
layer's ``resid_post`` ``[L, T, hidden]`` and every row's log-softmax."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from _hf_methods import _get, _hook
from _sae_reference import reference_encode
from vlens.protocol.architectures import ARCHITECTURES


def clamp(model, arch, job):
    folder = Path(job["sae"])
    w_dec = load_file(str(folder / "sae_weights.safetensors"))["W_dec"].float()
    start, stop = job["span"]
    i, value = job["feature"], job["value"]

    norm = json.loads((folder / "cfg.json").read_text()).get("normalize_activations", "none")

    def write(rows):
        part = rows[start:stop]
        f = reference_encode(part.float(), folder)[:, i : i + 1]
        # SAELens's decode undoes the input's normalisation: decode(edited)
        # - decode(clean) is the feature's change times that factor
        x = part.float()
        if norm == "constant_norm_rescale":
            undo = x.norm(dim=-1, keepdim=True) / x.shape[-1] ** 0.5
        elif norm == "layer_norm":
            undo = x.std(dim=-1, keepdim=True)
        else:
            undo = 1.0
        part.add_(((value - f) * undo * w_dec[i]).to(part.dtype))

    got = []
    handles = [_hook(model, arch, job["site"], job["layer"], write)]
    for layer in _get(model, arch.hf.layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, out: got.append((out[0] if isinstance(out, tuple) else out)[0].clone())))
    try:
        with torch.no_grad():
            out = model(torch.tensor([job["ids"]]))
    finally:
        for h in handles:
            h.remove()
    return {"resid_post": torch.stack(got), "logprobs": out.logits[0].float().log_softmax(-1)}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    model = AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).eval()
    arch = ARCHITECTURES[model.config.architectures[0]]
    torch.save([clamp(model, arch, job) for job in spec["jobs"]], sys.argv[2])


if __name__ == "__main__":
    main()
