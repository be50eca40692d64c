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

    def _checkpoint(self) -> Checkpoint:
        if self.checkpoint is not None:
            return self.checkpoint
        return Checkpoint(FinalNorm("rms", self.norm_weight, eps=self.eps), self.unembed)

    def logits(self, resid: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` residual stream -> ``[..., vocab]`` logits."""
        return self._checkpoint().logits(resid)

    def token_logits(self, resid: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``ids``' logits only (``[..., k]``, each row its own ids), as
        :meth:`logits` gives them."""
        return self._checkpoint().token_logits(resid, ids)

    def logsumexp_from_top(self, resid: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
                           tol: float = 1e-3) -> torch.Tensor | None:
        """Each row's log-sum-exp of the logits (``[...]``), from a top-k of
        the same rows (``ids`` and ``probs`` ``[..., k]``, k >= 2: the
        worker's ``logit_lens`` read) and k rows of the unembedding: each
        of the k gives ``logit - log p``. None when the k disagree by more
        than ``tol`` anywhere (the top-k was not of this lens: another model,
        dtype or logit scale), or k < 2 (nothing to check it by). With it a
        token's probability anywhere is ``exp(token_logits - lse)``, without
        the whole vocabulary's logits."""
        if ids.shape[-1] < 2 or ids.shape != probs.shape or ids.shape[:-1] != resid.shape[:-1]:
            return None
        each = self.token_logits(resid, ids) - probs.float().log()
        usable = probs > 1e-30  # a k-th probability that underflowed says nothing
        spread = torch.where(usable, each - each[..., :1], 0.0).abs().amax()
        if not bool(usable[..., 0].all()) or not float(spread) <= tol:
            return None
        return each[..., 0]

    def top(self, resid: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k token ids and their probabilities, each ``[..., k]``."""
        return lens_top(self.logits(resid), k)
