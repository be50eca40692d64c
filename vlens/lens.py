"""The offline logit lens: the lens on activations a Run already holds.

The logit lens of vlens is the worker's (``Session.trace(logit_lens=k)``:
:func:`vlens.protocol.sites.lens_logits` runs the served model's own final
norm and unembedding, for every architecture). This class is its offline
fallback, for a Run that read ``resid_post`` in full and no lens: the
final norm's facts (RMSNorm or LayerNorm, Gemma's ``1 + w``, Gemma 2's
final softcapping), any projection and the unembedding come straight from
the checkpoint (config.json and safetensors, :mod:`vlens.checkpoint`), in
float32, with no engine call, and go through the engine's own function
(:func:`vlens.protocol.final_norm.final_logits`); the top-k is the
worker's own (:func:`~vlens.protocol.sites.lens_top`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vlens.checkpoint import Checkpoint, read_checkpoint
from vlens.protocol.final_norm import FinalNorm
from vlens.protocol.sites import lens_top
from vlens.remote.client import connected_copy

__all__ = ["LogitLens"]


@dataclass
class LogitLens:
    """``norm_weight``: the final norm's effective gain ``[hidden]``
    (Gemma's ``1 + w``; what a feature's logits are scaled by);
    ``unembed`` ``[vocab, hidden]``; ``eps``. Made by hand from these three
    it is an RMSNorm lens; :meth:`from_pretrained` also gives it the
    checkpoint's every fact (``checkpoint``)."""

    norm_weight: torch.Tensor  # [hidden]
    unembed: torch.Tensor  # [vocab, hidden]
    eps: float
    checkpoint: Checkpoint | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> LogitLens:
        if str(path).startswith(("http://", "https://")):  # a connected session's model
            path = connected_copy(str(path))
        path = Path(path)
        if not any(path.glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        got = read_checkpoint(path)
        if got is None:
            raise ValueError(
                f"{path} has no final norm weight or unembedding vlens can find "
                "(lm_head.weight or a tied embedding) for the logit lens"
            )
        gain = got.norm.gain
        if gain is None:
            gain = torch.ones(got.unembed.shape[-1])
        return cls(gain, got.unembed, got.norm.eps, got)

    def logits(self, resid: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` residual stream -> ``[..., vocab]`` logits."""
        if self.checkpoint is not None:
            return self.checkpoint.logits(resid)
        return Checkpoint(FinalNorm("rms", self.norm_weight, eps=self.eps),
                          self.unembed).logits(resid)

    def top(self, resid: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k token ids and their probabilities, each ``[..., k]``."""
        return lens_top(self.logits(resid), k)
