"""What the offline lenses read of a model folder: the final norm's facts
(:class:`~vlens.protocol.final_norm.FinalNorm`, from config.json and the
weights: RMSNorm or LayerNorm, Gemma's ``1 + w``, Gemma 2's final logit
softcapping), any projection after it, and the unembedding (``lm_head`` or
the tied embedding). The lens through them is
:func:`vlens.protocol.final_norm.final_logits`, the engine's own.
Pure (torch and safetensors): :class:`vlens.lens.LogitLens` and the diff
lens (:mod:`vlens.results.diff`) both use it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlens.protocol.architectures import find_architecture
from vlens.protocol.final_norm import FinalNorm, final_logits, softcap

__all__ = ["Checkpoint", "read_checkpoint"]

# a multimodal checkpoint keeps its language model under one of these
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("language_model.", ""))
# where the unembedding lives when there is no separate head: the embedding
_HEADS = ("lm_head", "embed_out")
_EMBEDDINGS = ("model.embed_tokens", "transformer.wte", "model.decoder.embed_tokens",
               "gpt_neox.embed_in")


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A model folder's final norm, projection (``[out, in]``; None: none)
    and unembedding (``[vocab, hidden]``), float32."""

    norm: FinalNorm
    unembed: torch.Tensor
    project: torch.Tensor | None = None
    unembed_bias: torch.Tensor | None = None  # GPT-J's head has one

    def logits(self, resid: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` residual stream -> ``[..., vocab]`` logits."""
        if self.unembed_bias is None:
            return final_logits(resid, self.norm, self.unembed, project=self.project)
        plain = FinalNorm(self.norm.kind, self.norm.weight, self.norm.bias, self.norm.eps,
                          self.norm.offset)  # the bias goes in before the softcap
        logits = final_logits(resid, plain, self.unembed, project=self.project)
        return softcap(logits + self.unembed_bias, self.norm.softcap)

    def token_logits(self, resid: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The logits :meth:`logits` gives, of ``ids`` only: ``[..., hidden]``
        rows and ``[..., k]`` token ids (each row its own) -> ``[..., k]``.
        Reads k rows of the unembedding per row, not the whole vocabulary."""
        x = self.norm.normalize(resid)
        if self.project is not None:
            x = x @ self.project.float().to(x.device).T
        weight = self.unembed.float().to(x.device)
        out = torch.stack([(x * weight[ids[..., j]]).sum(-1) for j in range(ids.shape[-1])], -1)
        if self.unembed_bias is not None:
            out = out + self.unembed_bias.float().to(x.device)[ids]
        return softcap(out, self.norm.softcap)


def _config(folder: Path) -> dict[str, Any]:
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.get("text_config")
    if isinstance(text, dict):  # Gemma 3's multimodal config: the text model's
        cfg = {**text, "architectures": cfg.get("architectures") or text.get("architectures"),
               "tie_word_embeddings": text.get("tie_word_embeddings",
                                               cfg.get("tie_word_embeddings"))}
    return cfg


def _canonical(key: str) -> str:
    for old, new in _PREFIXES:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _paths(cfg: dict[str, Any]) -> tuple[str, str | None]:
    """The final norm's and the projection's paths in the checkpoint."""
    arch = find_architecture(cfg.get("architectures") or [])
    if arch is None:
        return "model.norm", None
    return arch.hf.norm or "model.norm", arch.hf.project


def _tensors(folder: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                name = _canonical(key)
                if name in wanted:
                    found[name] = st.get_tensor(key).float()
    return found


def _eps(cfg: dict[str, Any]) -> float:
    for key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        if cfg.get(key) is not None:
            return float(cfg[key])
    return 1e-6


def read_checkpoint(folder: str | Path) -> Checkpoint | None:
    """The final norm's facts, projection and unembedding of ``folder``
    (config.json and its safetensors files), or None where it has no
    unembedding or no final norm vlens can find."""
    folder = Path(folder)
    cfg = _config(folder)
    norm_at, project_at = _paths(cfg)
    wanted = {f"{norm_at}.weight", f"{norm_at}.bias"} | {f"{h}.weight" for h in _HEADS} \
        | {f"{e}.weight" for e in _EMBEDDINGS} | {"lm_head.bias"}
    if project_at:
        wanted.add(f"{project_at}.weight")
    found = _tensors(folder, wanted)
    unembed = next((found[f"{h}.weight"] for h in _HEADS if f"{h}.weight" in found), None)
    if unembed is None:  # tied: the input embedding is the unembedding
        unembed = next((found[f"{e}.weight"] for e in _EMBEDDINGS if f"{e}.weight" in found),
                       None)
    weight = found.get(f"{norm_at}.weight")
    if unembed is None or weight is None:
        return None
    bias = found.get(f"{norm_at}.bias")
    model_type = str(cfg.get("model_type", ""))
    layer = bias is not None or (cfg.get("rms_norm_eps") is None and any(
        cfg.get(k) is not None for k in ("layer_norm_eps", "layer_norm_epsilon")))
    norm = FinalNorm(
        kind="layer" if layer else "rms", weight=weight, bias=bias, eps=_eps(cfg),
        offset=1.0 if model_type.startswith("gemma") else 0.0,  # Gemma scales by (1 + w)
        softcap=cfg.get("final_logit_softcapping") or None,
    )
    project = found.get(f"{project_at}.weight") if project_at else None
    head_bias = found.get("lm_head.bias") if "lm_head.weight" in found else None
    return Checkpoint(norm, unembed, project, head_bias)

