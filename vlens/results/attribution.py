"""What ``Session.logit_attribution`` returns: per prompt, each component's
direct contribution to the answer's logit difference (the call is built in
:mod:`vlens.methods.attribution`, the worker's reduction is
:mod:`vlens.worker.attribution`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlens.errors import VlensError
from vlens.plots._attribution import attribution_figure
from vlens.tokens import visible

__all__ = ["Attribution", "COMPONENTS"]

#: the components of a frame's ``component`` column, in the order rows list them
COMPONENTS = ("embed", "attn", "head", "mlp", "bias")


@dataclass
class Attribution:
    """Direct logit attribution of ``prompts`` (one row per prompt).

    Each value is a component's direct contribution to ``logit(answer) -
    logit(wrong)`` (``logit(answer)`` where ``wrong`` is None) at position
    ``positions[i]``, through the final norm with its scale frozen at its
    value on the actual final residual (``scale``):

    * ``embed`` ``[prompts]``: the embeddings (layer 0's ``resid_pre``);
    * ``attn``, ``mlp`` ``[prompts, layers]``: each layer's ``attn_out``
      and ``mlp_out`` (through the post-block norm where the model has one);
    * ``heads`` ``[prompts, layers, heads]`` (None where the model's head
      sites are absent): each head through its slice of the attention
      output projection, and ``head_bias`` ``[prompts, layers]`` that
      projection's bias term: ``heads.sum(-1) + head_bias == attn``;
    * ``bias`` ``[prompts]``: the final norm's bias and the unembedding's.

    ``total`` (embed + every attn + every mlp + bias; heads are a breakdown
    of attn, not added again) equals ``logit_diff``, the engine's own
    difference read in the same pass, up to float error. For models with a
    final logit softcap (Gemma2) both are of the logits before the softcap.
    ``tokens[i]``: prompt i's token strings; ``answer`` / ``wrong`` ids and
    ``answer_text`` / ``wrong_text`` per prompt; ``position`` as asked.
    """

    prompts: list[str]
    tokens: list[list[str]]
    position: int
    positions: list[int]
    answer: list[int]
    wrong: list[int | None]
    answer_text: list[str]
    wrong_text: list[str | None]
    embed: torch.Tensor
    attn: torch.Tensor
    mlp: torch.Tensor
    heads: torch.Tensor | None
    head_bias: torch.Tensor
    bias: torch.Tensor
    scale: torch.Tensor
    logit_diff: torch.Tensor

    @property
    def total(self) -> torch.Tensor:
        """``[prompts]``: embed + every layer's attn and mlp + bias."""
        return self.embed + self.attn.sum(-1) + self.mlp.sum(-1) + self.bias

    @property
    def n_layers(self) -> int:
        return int(self.attn.shape[-1])

    def _prompt(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not -len(self.prompts) <= i < len(
                self.prompts):
            raise VlensError(f"prompt index must be an int from 0 to {len(self.prompts) - 1}, "
                             f"got {i!r}")
        return i % len(self.prompts)

    def to_frame(self):
        """Tidy pandas frame, one row per prompt and component: ``prompt``
        (its index), ``component`` (``embed``, ``attn``, ``head``, ``mlp``,
        ``bias``), ``layer`` and ``head`` (-1 where they do not apply: embed
        and bias have no layer, only a head row has a head), ``value``.
        Head rows break their layer's attn row down (the heads plus the
        output projection's bias term, ``head_bias``, sum to it): summing
        ``value`` over every row counts attention twice; sum the rows other
        than ``head`` to get ``total``."""
        import pandas as pd

        rows: list[tuple] = []
        for i in range(len(self.prompts)):
            rows.append((i, "embed", -1, -1, float(self.embed[i])))
            for layer in range(self.n_layers):
                rows.append((i, "attn", layer, -1, float(self.attn[i, layer])))
                if self.heads is not None:
                    rows += [(i, "head", layer, h, float(v))
                             for h, v in enumerate(self.heads[i, layer].tolist())]
                rows.append((i, "mlp", layer, -1, float(self.mlp[i, layer])))
            rows.append((i, "bias", -1, -1, float(self.bias[i])))
        return pd.DataFrame(rows, columns=["prompt", "component", "layer", "head", "value"])

    def figure(self, i: int = 0):
        """Prompt ``i``'s attribution: attn and MLP per layer, and the layer
        x head grid (plotly)."""
        i = self._prompt(i)
        what = (f"logit({self.answer_text[i]!r})" if self.wrong[i] is None else
                f"logit({self.answer_text[i]!r}) - logit({self.wrong_text[i]!r})")
        tok = visible(self.tokens[i][self.positions[i]])
        title = (f"direct logit attribution: {what} after position {self.positions[i]} "
                 f"({tok}), total {float(self.total[i]):.3f}")
        return attribution_figure(self.attn[i], self.mlp[i],
                                  None if self.heads is None else self.heads[i], title=title,
                                  metric="logit" if self.wrong[i] is None else "logit diff")

    def __repr__(self) -> str:
        heads = "" if self.heads is None else f" x {self.heads.shape[-1]} heads"
        return (f"Attribution({len(self.prompts)} prompts, {self.n_layers} layers{heads}, "
                f"total {[round(float(x), 4) for x in self.total[:4]]}, logit_diff "
                f"{[round(float(x), 4) for x in self.logit_diff[:4]]})")
