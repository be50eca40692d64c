"""What the offline lenses read of a model folder: a Llama-family
checkpoint's final RMSNorm weight, its unembedding and epsilon, and the
lens through them. Pure (torch and safetensors): :class:`vlens.lens.LogitLens`
and the diff lens (:mod:`vlens.results.diff`) both use it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["final_norm_and_unembed", "rms_lens_logits"]

_WANTED = {"model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"}


def final_norm_and_unembed(folder: str | Path
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """``(norm weight, unembedding, eps)`` float32 from ``folder``'s
    config.json and safetensors files; a part the checkpoint lacks is None
    (the caller says what that means). The unembedding is ``lm_head`` or,
    for tied models, the embedding."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in _WANTED & set(st.keys()):
                found[key] = st.get_tensor(key).float()
    unembed = found.get("lm_head.weight", found.get("model.embed_tokens.weight"))
    return found.get("model.norm.weight"), unembed, float(cfg.get("rms_norm_eps", 1e-6))


def rms_lens_logits(resid: torch.Tensor, norm: torch.Tensor, unembed: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """``[..., hidden]`` residual stream -> ``[..., vocab]`` logits through an
    RMSNorm of weight ``norm`` and the unembedding."""
    x = resid.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm
    return x @ unembed.T
