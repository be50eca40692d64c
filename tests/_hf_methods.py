"""Hugging Face references for ablation and patching (tests/test_ablation.py,
tests/test_patching.py).

Run as a script in a fresh process (``python tests/_hf_methods.py spec.json
out.pt``; vLLM patches Hugging Face model classes in any process where it
has built a Transformers-backend engine). ``spec`` holds the model folder
and a list of jobs:

* ``{"kind": "ablate", "ids": [...], "site", "layer", "span": [start, stop],
  "dims": [lo, hi] | null, "value": "zero" | "mean", "mean_over": [[ids],
  ...]}``: one forward over ``ids`` with a hook that writes zeros (or the
  site's mean over every token of the ``mean_over`` prompts, from unhooked
  forwards) into dims ``[lo, hi)`` of rows ``[start, stop)``; returns every
  layer's ``resid_post`` ``[L, T, hidden]`` and the log-softmax of the last
  row's logits. ``"value": "direction"`` with ``"direction": [floats]``
  and ``"layers": [...]``: instead, a hook at each of those layers takes
  the direction's component out of rows ``[start, stop)``, ``x - (x . r^) r^``;
* ``{"kind": "patch", "clean": [...], "corrupt": [...], "site", "layers",
  "positions", "answer": [a, b], "head_dim": int | null, "heads": bool}``:
  the patching metric cell by cell, one forward per cell, the clean row
  written into the corrupt run's at (layer, position) (or head h's dims at
  every position); returns the grid, the clean and corrupt logit
  differences.

Changes are made in place in the hooked tensor, as vlens's are.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from _hf_reference import _first, _get, _input, _rows, site_module
from vlens.protocol.architectures import ARCHITECTURES


def _where(model, arch, site, layer_idx):
    """(module, pre-hook?) of ``site`` at one layer."""
    return site_module(_get(model, arch.hf.layers)[layer_idx], arch.hf, site)


def _hook(model, arch, site, layer, fn):
    """Call ``fn(rows [T, width])`` on the site's tensor (in place)."""
    mod, pre = _where(model, arch, site, layer)
    if pre:
        return mod.register_forward_pre_hook(
            lambda m, args, kwargs: fn(_rows(_input(args, kwargs))), with_kwargs=True)
    return mod.register_forward_hook(
        lambda m, args, kwargs, out: fn(_rows(_first(out))), with_kwargs=True)


def _forward(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out


def _resid_post(model, arch, ids, hooks=()):
    """Every layer's output ``[L, T, hidden]`` and the last row's logprobs."""
    got = []
    handles = list(hooks)
    for layer in _get(model, arch.hf.layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, out: got.append(_first(out)[0].clone())))
    try:
        out = _forward(model, ids)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(got), out.logits[0, -1].float().log_softmax(-1)


def _site_rows(model, arch, ids, site, layer):
    box = []
    h = _hook(model, arch, site, layer, lambda r: box.append(r.clone()))
    try:
        out = _forward(model, ids)
    finally:
        h.remove()
    return box[0], out.logits[0, -1].float().log_softmax(-1)


def project(model, arch, job):
    r = torch.tensor(job["direction"], dtype=torch.float32)
    r = r / r.norm()
    start, stop = job["span"]

    def write(rows):
        part = rows[start:stop]
        part.sub_((part @ r)[:, None] * r)

    hooks = [_hook(model, arch, job["site"], layer, write) for layer in job["layers"]]
    resid, lp = _resid_post(model, arch, job["ids"], hooks)
    return {"resid_post": resid, "logprobs": lp}


def ablate(model, arch, job):
    if job["value"] == "direction":
        return project(model, arch, job)
    site, layer = job["site"], job["layer"]
    start, stop = job["span"]
    lo, hi = job["dims"] or (0, None)
    value = None
    if job["value"] == "mean":
        value = torch.cat([_site_rows(model, arch, ids, site, layer)[0]
                           for ids in job["mean_over"]]).mean(0)

    def write(rows):
        part = rows[start:stop, lo:hi]
        part.copy_(torch.zeros_like(part) if value is None else value[lo:hi].expand_as(part))

    resid, lp = _resid_post(model, arch, job["ids"], [_hook(model, arch, site, layer, write)])
    return {"resid_post": resid, "logprobs": lp}


def patch(model, arch, job):
    site, a, b = job["site"], *job["answer"]
    clean = {layer: _site_rows(model, arch, job["clean"], site, layer)[0]
             for layer in job["layers"]}

    def diff(hook=None):
        handles = [hook] if hook is not None else []
        try:
            lp = _forward(model, job["corrupt"]).logits[0, -1].float().log_softmax(-1)
        finally:
            for h in handles:
                h.remove()
        return float(lp[a] - lp[b])

    lp_clean = _forward(model, job["clean"]).logits[0, -1].float().log_softmax(-1)
    clean_diff, corrupt_diff = float(lp_clean[a] - lp_clean[b]), diff()
    hd = job.get("head_dim")
    grid = []
    for layer in job["layers"]:
        row = []
        cols = range(job["n_heads"]) if job["heads"] else job["positions"]
        for col in cols:
            def write(rows, layer=layer, col=col):
                if job["heads"]:
                    for p in job["positions"]:
                        rows[p, col * hd:(col + 1) * hd] = clean[layer][p, col * hd:(col + 1) * hd]
                else:
                    rows[col] = clean[layer][col]
            row.append(diff(_hook(model, arch, site, layer, write)))
        grid.append(row)
    diffs = torch.tensor(grid, dtype=torch.float64)
    return {"grid": (diffs - corrupt_diff) / (clean_diff - corrupt_diff), "diffs": diffs,
            "clean_diff": clean_diff, "corrupt_diff": corrupt_diff}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    model = AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32).eval()
    arch = ARCHITECTURES[model.config.architectures[0]]
    out = [ablate(model, arch, job) if job["kind"] == "ablate" else patch(model, arch, job)
           for job in spec["jobs"]]
    torch.save(out, sys.argv[2])


if __name__ == "__main__":
    main()
