"""Record SAELens's own encode as test data (tests/data/saelens/).

Run with a Python that has ``sae-lens`` installed (it pulls its own torch, so
not in vlens's environment): ``python scripts/record_saelens.py``. For each
architecture it builds an SAE with SAELens's classes and fixed random
weights, saves it with ``save_model`` (cfg.json + sae_weights.safetensors,
exactly as SAELens writes them) and records ``encode`` of fixed inputs in
``encodes.safetensors`` (``{name}.x``, ``{name}.acts``). tests/test_sae.py
checks vlens's loader and encode against these files, and the reference
encode its engine tests use against the same numbers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from sae_lens import (JumpReLUSAE, JumpReLUSAEConfig, StandardSAE, StandardSAEConfig, TopKSAE,
                      TopKSAEConfig)
from sae_lens.saes.sae import SAEMetadata

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "saelens"
D_IN, D_SAE = 128, 64  # tests/conftest.py's tiny Llama: hidden 128

CASES = {
    "standard": (StandardSAE, StandardSAEConfig, "blocks.1.hook_resid_post", {}),
    "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig, "blocks.2.hook_mlp_out",
                 {"normalize_activations": "constant_norm_rescale"}),
    "topk": (TopKSAE, TopKSAEConfig, "blocks.1.attn.hook_z", {"k": 8}),
    "layer_norm": (StandardSAE, StandardSAEConfig, "blocks.0.hook_resid_pre",
                   {"normalize_activations": "layer_norm", "apply_b_dec_to_input": False}),
}


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    g = torch.Generator().manual_seed(26)
    record = {}
    for name, (cls, cfg_cls, hook, extra) in CASES.items():
        cfg = cfg_cls(d_in=D_IN, d_sae=D_SAE, dtype="float32", device="cpu",
                      metadata=SAEMetadata(hook_name=hook), **extra)
        sae = cls(cfg)
        with torch.no_grad():
            for pname, p in sae.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[0] ** 0.5 if p.dim() == 2 else 10))
                if pname == "threshold":
                    p.copy_(torch.rand(p.shape, generator=g) * 0.3)
        sae.save_model(OUT / name)
        x = torch.randn(24, D_IN, generator=g) * 2.0
        with torch.no_grad():
            acts = sae.encode(x)
        record[f"{name}.x"] = x.contiguous()
        record[f"{name}.acts"] = acts.float().contiguous()
        print(name, json.loads((OUT / name / "cfg.json").read_text()).get("architecture"),
              f"{float((acts > 0).float().mean()):.2f} active")
    save_file(record, str(OUT / "encodes.safetensors"))


if __name__ == "__main__":
    main()
