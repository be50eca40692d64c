"""The residual stream -> logits through a model's final norm, written once.

Every lens of vlens goes through :func:`final_logits`: the worker's logit
lens (:func:`vlens.protocol.sites.lens_logits`), its direct logit
attribution (:mod:`vlens.worker.attribution`), the offline
:class:`vlens.lens.LogitLens` and the diff lens
(:meth:`vlens.results.diff.Diff.lens`). What differs between them is only
where the facts of the norm come from (:class:`FinalNorm`): the loaded
module in the worker (:func:`norm_of`), the checkpoint's config and
weights offline (:mod:`vlens.checkpoint`).

The facts cover the norms of the supported families: RMSNorm (Llama and
relatives), Gemma's RMSNorm that scales by ``1 + w``, LayerNorm with its
bias (GPT-2, GPT-NeoX, OPT), Gemma 2's final logit softcapping, and a
projection after the norm (OPT's ``project_out``). Pure torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

__all__ = ["FinalNorm", "final_logits", "norm_of", "softcap"]

#: a linear map given as its weight ``[out, in]`` (float32 maths) or as a
#: callable (a model's own module, run in the model's dtype)
Linear = Union[torch.Tensor, Callable[[torch.Tensor], Any]]


@dataclass(frozen=True, eq=False)
class FinalNorm:
    """The facts of a final norm: ``kind`` ``"rms"``, ``"layer"`` (centred
    first) or ``"none"`` (no norm); ``weight`` as stored (None: ones) and
    ``offset`` added to it (Gemma's RMSNorm scales by ``1 + w``:
    ``offset=1``); ``bias`` (LayerNorm); ``eps``; ``softcap``, the final
    logit softcapping (``cap * tanh(logits / cap)``, Gemma 2), None for
    none."""

    kind: str = "rms"
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    eps: float = 1e-6
    offset: float = 0.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("rms", "layer", "none"):
            raise ValueError(f"a final norm is 'rms', 'layer' or 'none', not {self.kind!r}")

    @property
    def gain(self) -> torch.Tensor | None:
        """The effective weight, float32 (``offset + weight``; None: ones)."""
        if self.weight is None:
            return None
        return self.weight.float() + self.offset if self.offset else self.weight.float()

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """``[...]``: the norm's divisor of each row of ``x`` ``[..., width]``
        (float32; ones for ``"none"``)."""
        x = x.float()
        if self.kind == "layer":
            return (x.var(-1, unbiased=False) + self.eps).sqrt()
        if self.kind == "rms":
            return (x.pow(2).mean(-1) + self.eps).sqrt()
        return torch.ones(x.shape[:-1], device=x.device)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., width]`` -> the normed rows, float32."""
        x = x.float()
        if self.kind == "none":
            return x
        if self.kind == "layer":
            x = x - x.mean(-1, keepdim=True)
        x = x / self.scale(x)[..., None]
        gain = self.gain
        if gain is not None:
            x = x * gain.to(x.device)
        if self.bias is not None:
            x = x + self.bias.float().to(x.device)
        return x

    def direction(self, d: torch.Tensor) -> torch.Tensor:
        """What a row is dotted with so that ``row . result / scale`` is the
        normed row's dot with ``d`` (the bias aside): direct logit
        attribution's frozen-scale maths."""
        gain = self.gain
        out = d if gain is None else gain.to(d.device) * d
        return out - out.mean() if self.kind == "layer" else out

    def bias_term(self, d: torch.Tensor) -> float:
        """The bias's share of the normed row's dot with ``d``."""
        return 0.0 if self.bias is None else float(self.bias.float().to(d.device) @ d)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (unchanged for None or 0)."""
    return torch.tanh(logits / cap) * cap if cap else logits


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) else x


def _apply(x: torch.Tensor, linear: Linear, dtype: torch.dtype) -> torch.Tensor | None:
    if isinstance(linear, torch.Tensor):
        return x @ linear.float().to(x.device).T
    out = _first(linear(x.to(dtype)))
    return None if out is None else out.float()


def final_logits(resid: torch.Tensor, norm: FinalNorm, unembed: Linear, *,
                 project: Linear | None = None) -> torch.Tensor | None:
    """``[..., hidden]`` residual stream -> ``[..., vocab]`` float32 logits:
    ``norm`` (in float32), then ``project`` if given (OPT's
    ``project_out``), then ``unembed``, then ``norm.softcap``.

    ``project`` and ``unembed`` are each a weight ``[out, in]`` or a
    callable given the rows in ``resid``'s dtype (the engine's own
    modules: ``compute_logits`` gathers the vocabulary across ranks, and
    returns None on ranks that receive nothing, as this does then). A
    callable that applies the softcap itself comes with a norm whose
    ``softcap`` is None."""
    x = norm.normalize(resid)
    if project is not None:
        x = _apply(x, project, resid.dtype)
    logits = _apply(x, unembed, resid.dtype)
    if logits is None:
        return None
    return softcap(logits, norm.softcap)


# module -> its facts; a served model's weights do not change
_FACTS: weakref.WeakKeyDictionary[nn.Module, FinalNorm] = weakref.WeakKeyDictionary()


def norm_of(m: nn.Module | None, softcap: float | None = None) -> FinalNorm:
    """The facts of a loaded norm module (vLLM's or Hugging Face's): RMSNorm
    (Gemma's scales by ``1 + w``) or LayerNorm, weight, bias and epsilon,
    float32 copies (cached per module); ``None`` is ``kind="none"``.
    ``softcap``: the logit softcapping to record with it. A norm of another
    kind is a ValueError naming it."""
    if m is None:
        return FinalNorm("none", softcap=softcap)
    got = _FACTS.get(m)
    if got is None:
        got = _read(m)
        _FACTS[m] = got
    if softcap == got.softcap:
        return got
    return FinalNorm(got.kind, got.weight, got.bias, got.eps, got.offset, softcap)


def _read(m: nn.Module) -> FinalNorm:
    name = type(m).__name__
    if isinstance(m, nn.LayerNorm) or name == "LayerNorm":
        kind = "layer"
    elif "RMSNorm" in name:
        kind = "rms"
    else:
        raise ValueError(f"vlens knows RMSNorm and LayerNorm final norms, not {name}: this "
                         "model's norm needs its own rule in vlens/protocol/final_norm.py")
    eps = next((getattr(m, a) for a in ("variance_epsilon", "eps")
                if getattr(m, a, None) is not None), None)
    if eps is None:
        raise ValueError(f"found no epsilon on the norm {name}")
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    w = None if not isinstance(w, torch.Tensor) else w.detach().float()
    b = None if not isinstance(b, torch.Tensor) else b.detach().float()
    offset = 1.0 if "Gemma" in name else 0.0  # Gemma's RMSNorm scales by (1 + w)
    return FinalNorm(kind, w, b, float(eps), offset if w is not None else 0.0)
