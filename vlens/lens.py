"""The offline logit lens: the lens on activations a Run already holds.

The logit lens of vlens is the worker's (``Session.trace(logit_lens=k)``:
:func:`vlens.protocol.sites.lens_logits` runs the served model's own final
norm and unembedding, for every architecture). This class is its offline
fallback, for a Run that read ``resid_post`` in full and no lens: the
final norm and unembedding come straight from the checkpoint
(safetensors), in float32, with no engine call, for Llama-family models
(RMSNorm, ``lm_head`` or tied embeddings); the top-k is the worker's own
(:func:`~vlens.protocol.sites.lens_top`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from vlens.protocol.sites import lens_top
from vlens.remote.client import connected_copy

__all__ = ["LogitLens"]


@dataclass
class LogitLens:
    norm_weight: torch.Tensor  # [hidden]
    unembed: torch.Tensor  # [vocab, hidden]
    eps: float

    @classmethod
    def from_pretrained(cls, path: str | Path) -> LogitLens:
        from safetensors import safe_open

        if str(path).startswith(("http://", "https://")):  # a connected session's model
            path = connected_copy(str(path))
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        found: dict[str, torch.Tensor] = {}
        wanted = {"model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"}
        for f in files:
            with safe_open(str(f), "pt") as st:
                for key in wanted & set(st.keys()):
                    found[key] = st.get_tensor(key).float()
        unembed = found.get("lm_head.weight", found.get("model.embed_tokens.weight"))
        if unembed is None or "model.norm.weight" not in found:
            raise ValueError(
                f"{path} has no model.norm.weight / lm_head.weight: the logit lens "
                "supports Llama-family checkpoints"
            )
        return cls(found["model.norm.weight"], unembed, float(cfg.get("rms_norm_eps", 1e-6)))

    def logits(self, resid: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` residual stream -> ``[..., vocab]`` logits."""
        x = resid.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return x @ self.unembed.T

    def top(self, resid: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k token ids and their probabilities, each ``[..., k]``."""
        return lens_top(self.logits(resid), k)
