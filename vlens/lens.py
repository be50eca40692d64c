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

from dataclasses import dataclass
from pathlib import Path

import torch

from vlens.checkpoint import final_norm_and_unembed, rms_lens_logits
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
        if str(path).startswith(("http://", "https://")):  # a connected session's model
            path = connected_copy(str(path))
        path = Path(path)
        if not any(path.glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        norm, unembed, eps = final_norm_and_unembed(path)
        if unembed is None or norm is None:
            raise ValueError(
                f"{path} has no model.norm.weight / lm_head.weight: the logit lens "
                "supports Llama-family checkpoints"
            )
        return cls(norm, unembed, eps)

    def logits(self, resid: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` residual stream -> ``[..., vocab]`` logits."""
        return rms_lens_logits(resid, self.norm_weight, self.unembed, self.eps)

    def top(self, resid: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k token ids and their probabilities, each ``[..., k]``."""
        return lens_top(self.logits(resid), k)
