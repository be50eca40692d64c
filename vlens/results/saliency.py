"""What ``Session.saliency`` returns: each prompt token's attribution to
one logit (the call runs in :mod:`vlens.methods.gradients`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlens.plots._saliency import saliency_strip
from vlens.tokens import visible

__all__ = ["Saliency"]


@dataclass
class Saliency:
    """The ``target`` logit at the prompt's last position, attributed to
    each prompt token (``[n_tokens]`` float32 each):

    * ``grad_x_input``: the logit's gradient at the token's embedding,
      dotted with the embedding (autograd on the twin);
    * ``integrated``: integrated gradients from the ``baseline`` (a
      token's embedding at every position, or ``"zeros"``), in ``steps``
      points (Captum's ``IntegratedGradients``), summed over the embedding.
      They add up to ``logit - baseline_logit`` up to ``delta`` (Captum's
      convergence delta: more ``steps`` shrink it).
    """

    tokens: list[str]
    ids: list[int]
    target: int
    target_text: str
    grad_x_input: torch.Tensor
    integrated: torch.Tensor
    logit: float
    baseline_logit: float
    delta: float
    steps: int
    baseline: str = "zeros"

    def to_frame(self):
        """One row per token: ``position``, ``token``, ``id``,
        ``grad_x_input``, ``integrated_gradients``."""
        import pandas as pd

        return pd.DataFrame({
            "position": range(len(self.tokens)), "token": self.tokens, "id": self.ids,
            "grad_x_input": self.grad_x_input.tolist(),
            "integrated_gradients": self.integrated.tolist(),
        })

    def figure(self):
        """The prompt as a token strip, one row per method (each scaled to
        its largest magnitude; blue toward the target, red against it)."""
        return saliency_strip(
            self.tokens,
            {"grad × input": self.grad_x_input.tolist(),
             "integrated gradients": self.integrated.tolist()},
            title=f"saliency toward {visible(self.target_text)!r}: logit {self.logit:.3f} "
                  f"(baseline {visible(self.baseline)!r}: {self.baseline_logit:.3f})")

    def __repr__(self) -> str:
        return (f"Saliency({len(self.tokens)} tokens -> {self.target_text!r}, logit "
                f"{self.logit:.3f}, IG delta {self.delta:.2g})")
