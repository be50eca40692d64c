"""SAEs written as SAELens saves them, and SAELens's encode from its
documented formulas (written here independently of vlens's code): shared by
tests/test_sae.py and its Hugging Face reference, tests/_hf_clamp.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN = 128  # tests/conftest.py's tiny Llama


def _weights(d_in: int, d_sae: int, seed: int, threshold: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"W_enc": torch.randn(d_in, d_sae, generator=g) / d_in ** 0.5,
         "W_dec": torch.randn(d_sae, d_in, generator=g) / d_sae ** 0.5,
         "b_enc": torch.randn(d_sae, generator=g) * 0.1,
         "b_dec": torch.randn(d_in, generator=g) * 0.1}
    if threshold:
        w["threshold"] = torch.rand(d_sae, generator=g) * 0.2
    return w


def save_saelens(folder: Path, arch: str, hook: str, d_in: int = HIDDEN, d_sae: int = 96,
                 seed: int = 0, **cfg) -> Path:
    """An SAE folder laid out as SAELens's ``save_model`` writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    w = _weights(d_in, d_sae, seed, threshold=arch == "jumprelu")
    save_file(w, str(folder / "sae_weights.safetensors"))
    full = {"architecture": arch, "d_in": d_in, "d_sae": d_sae, "dtype": "float32",
            "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
            "metadata": {"hook_name": hook, "model_name": "tiny"}, **cfg}
    (folder / "cfg.json").write_text(json.dumps(full))
    return folder


def reference_encode(x: torch.Tensor, folder: Path) -> torch.Tensor:
    """SAELens's encode, from its documented formulas (SAE.encode for the
    standard, JumpReLU and TopK architectures)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "cfg.json").read_text())
    w = {k: v.double() for k, v in load_file(str(folder / "sae_weights.safetensors")).items()}
    x = x.double()
    norm = cfg.get("normalize_activations", "none")
    if norm == "constant_norm_rescale":
        x = x * (cfg["d_in"] ** 0.5) / x.norm(dim=-1, keepdim=True)
    elif norm == "layer_norm":
        mu = x.mean(-1, keepdim=True)
        x = x - mu
        x = x / (x.std(-1, keepdim=True) + 1e-5)
    if cfg.get("apply_b_dec_to_input", True):
        x = x - w["b_dec"]
    pre = x @ w["W_enc"] + w["b_enc"]
    arch = cfg["architecture"]
    if arch == "jumprelu":
        out = torch.relu(pre) * (pre > w["threshold"]).double()
    elif arch == "topk":
        vals, idx = pre.topk(cfg["k"], dim=-1)
        out = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
    else:
        out = torch.relu(pre)
    return out.float()
