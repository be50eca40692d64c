"""Sparse autoencoders (SAEs) on the live engine: load, check, read.

``SAE.load`` reads an SAE as SAELens saves it (a folder with ``cfg.json``
and ``sae_weights.safetensors``) or Gemma Scope's ``params.npz``; the site
and layer come from the TransformerLens hook name in the config
(``blocks.3.hook_resid_post`` -> ``resid_post`` at layer 3) or from the
arguments. ``s.trace(prompts, saes=[sae])`` encodes the SAE's site in the
worker (``protocol/features.py``, the same math as ``sae.encode`` here);
``t.features(sae)`` gives ``[T, d_sae]``. ``sae.steer(i)`` is the Steer of
decoder row ``i``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch

from vlens.edit_schema import CLAMP_MAX, ClampFields, checked
from vlens.edits import Steer
from vlens.errors import VlensError
from vlens.keywords import keywords
from vlens.protocol.features import ARCHITECTURES, FeatureSpec, encode
from vlens.protocol.plan import Read
from vlens.protocol.tensors import encode_tensor

__all__ = ["CLAMP_MAX", "Clamp", "SAE", "feature_reads", "hook_site"]


#: TransformerLens hook names -> vlens sites
HOOKS = {"hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid",
         "hook_resid_post": "resid_post", "hook_attn_out": "attn_out",
         "hook_mlp_out": "mlp_out", "attn.hook_z": "z"}
_HOOK = re.compile(r"^blocks\.(\d+)\.(" + "|".join(re.escape(h) for h in HOOKS) + r")$")


def hook_site(hook_name: str) -> tuple[str, int]:
    """``"blocks.3.hook_resid_post"`` -> ``("resid_post", 3)``."""
    m = _HOOK.match(str(hook_name))
    if m is None:
        raise VlensError(
            f"SAE hook {hook_name!r} is not one vlens reads; it reads "
            f"blocks.{{L}}.{{{', '.join(HOOKS)}}}: pass site= and layer= to SAE.load")
    return HOOKS[m.group(2)], int(m.group(1))


class SAE:
    """One sparse autoencoder: ``site``, ``layer``, ``d_in``, ``d_sae``,
    its weights (float32, CPU: ``W_enc`` ``[d_in, d_sae]``, ``W_dec``
    ``[d_sae, d_in]``, ``b_enc``, ``b_dec``, ``threshold`` for jumprelu) and
    how it encodes (``spec``)."""

    def __init__(self, weights: dict[str, torch.Tensor], spec: FeatureSpec, site: str,
                 layer: int, name: str = "") -> None:
        if spec.architecture not in ARCHITECTURES:
            raise VlensError(f"SAE architecture {spec.architecture!r} is not supported; "
                             f"vlens encodes {', '.join(ARCHITECTURES)}")
        need = ("W_enc", "W_dec", "b_enc", "b_dec") + (
            ("threshold",) if spec.architecture == "jumprelu" else ())
        missing = [n for n in need if n not in weights]
        if missing:
            raise VlensError(f"SAE {name or ''} lacks weights {missing} (a {spec.architecture} "
                             f"SAE has {', '.join(need)})")
        w = {n: torch.as_tensor(weights[n]).detach().to("cpu", torch.float32).contiguous()
             for n in need}
        d_in, d_sae = w["W_enc"].shape if w["W_enc"].dim() == 2 else (0, 0)
        shapes = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_in), "b_enc": (d_sae,),
                  "b_dec": (d_in,), "threshold": (d_sae,)}
        for n, t in w.items():
            if tuple(t.shape) != shapes[n] or not d_in:
                raise VlensError(f"SAE {n} has shape {list(t.shape)}; with W_enc "
                                 f"{list(w['W_enc'].shape)} it must be {list(shapes[n])}")
            if not bool(torch.isfinite(t).all()):
                raise VlensError(f"SAE {n} holds NaN or inf")
        if spec.architecture == "topk" and not 0 < spec.k <= d_sae:
            raise VlensError(f"a topk SAE needs 0 < k <= d_sae ({d_sae}), got k={spec.k}")
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise VlensError(f"SAE layer must be a non-negative int, got {layer!r}")
        self.weights, self.spec, self.site, self.layer = w, spec, str(site), layer
        self.d_in, self.d_sae = int(d_in), int(d_sae)
        self.name = name
        #: the folder it was loaded from (None: built in memory); a
        #: ``measured.json`` there names features and holds a steering recipe
        self.path: Path | None = None
        digest = hashlib.sha256(json.dumps(spec.to_wire(), sort_keys=True).encode())
        for n in need:
            digest.update(w[n].numpy().tobytes())
        self.id = "sae-" + digest.hexdigest()[:16]

    def __repr__(self) -> str:
        return (f"SAE({self.spec.architecture}, {self.site} layer {self.layer}, "
                f"{self.d_in} -> {self.d_sae})")

    # -- loading ---------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, site: str | None = None, layer: int | None = None) -> SAE:
        """An SAE folder as SAELens saves it, or Gemma Scope's ``params.npz``
        (a file, or a folder holding one; give ``site`` and ``layer``, else
        ``layer_N`` in the path and resid_post)."""
        path = Path(path)
        if path.is_dir() and (path / "params.npz").exists() and not (path / "cfg.json").exists():
            path = path / "params.npz"
        if path.suffix == ".npz":
            return cls._load_npz(path, site, layer)
        if not (path / "cfg.json").exists() or not (path / "sae_weights.safetensors").exists():
            raise VlensError(f"{path} is not an SAE folder: SAELens saves cfg.json and "
                             "sae_weights.safetensors; Gemma Scope ships params.npz")
        from safetensors.torch import load_file

        cfg = json.loads((path / "cfg.json").read_text())
        weights = load_file(str(path / "sae_weights.safetensors"))
        if "threshold" not in weights and "log_threshold" in weights:
            weights["threshold"] = weights["log_threshold"].exp()
        hook = cfg.get("hook_name") or (cfg.get("metadata") or {}).get("hook_name")
        if site is None or layer is None:
            if not hook:
                raise VlensError(f"{path}/cfg.json names no hook_name: pass site= and layer=")
            hook_s, hook_l = hook_site(hook)
            site = hook_s if site is None else site
            layer = hook_l if layer is None else layer
        sae = cls(weights, _spec_of(cfg, path), site, layer, name=path.name)
        sae.path = path
        for key, got in (("d_in", sae.d_in), ("d_sae", sae.d_sae)):
            if key in cfg and int(cfg[key]) != got:
                raise VlensError(f"{path}/cfg.json says {key}={cfg[key]} but the weights are {got}")
        return sae

    @classmethod
    def _load_npz(cls, path: Path, site: str | None, layer: int | None) -> SAE:
        import numpy as np

        if layer is None:
            m = re.search(r"layer_(\d+)", str(path))
            if m is None:
                raise VlensError(f"{path}: pass layer= (no layer_N in the path)")
            layer = int(m.group(1))
        if site is None:
            if not re.search(r"(^|[-_/])res([-_/]|$)", str(path)):
                raise VlensError(f"{path}: pass site= (Gemma Scope's res SAEs read resid_post)")
            site = "resid_post"
        with np.load(path) as data:
            weights = {k: torch.from_numpy(np.array(data[k])) for k in data.files}
        # Gemma Scope: JumpReLU, b_dec not subtracted from the input
        return cls(weights, FeatureSpec("jumprelu", b_dec_in=False), site, layer,
                   name=path.parent.name)

    # -- on the client ---------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations of ``x`` ``[n, d_in]`` (or ``[d_in]``, or a
        head site's ``[n, heads, head_dim]``): ``[n, d_sae]`` float32."""
        x = torch.as_tensor(x)
        one = x.dim() == 1
        x = x.reshape(1 if one else x.shape[0], -1)
        if x.shape[1] != self.d_in:
            raise VlensError(f"this SAE encodes [n, {self.d_in}]; got {list(x.shape)}")
        acts = encode(x.to("cpu", torch.float32), self.weights, self.spec)
        return acts[0] if one else acts

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """``acts @ W_dec + b_dec``: ``[n, d_in]`` (in the normalised space)."""
        return torch.as_tensor(acts).float() @ self.weights["W_dec"] + self.weights["b_dec"]

    def decoder(self, i: int) -> torch.Tensor:
        """Decoder row ``i``, ``[d_in]`` float32: the direction feature ``i`` writes."""
        return self.weights["W_dec"][self._feature(i)].clone()

    def steer(self, i: int, scale: float = 1.0, span: str | tuple[int, int] = "all") -> Steer:
        """The :class:`~vlens.Steer` adding ``scale * W_dec[i]`` at this SAE's site and layer."""
        return Steer(self.decoder(i), self.layer, scale, self.site, span)

    def measured(self) -> dict[str, Any]:
        """What ``measured.json`` in the SAE's folder says ({} when there is
        none): ``features`` (concept name -> ``{"feature": i, "precision":
        ..., ...}``), ``steer`` (``feature``, ``scale``, ``relative``) and
        ``clamp`` (``feature``, ``value``, ``span``), as
        ``scripts/train_sae.py`` writes them for the bundled SAE."""
        if self.path is None or not (self.path / "measured.json").is_file():
            return {}
        return json.loads((self.path / "measured.json").read_text())

    def _feature(self, i: Any) -> int:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.d_sae:
            raise VlensError(f"feature must be an int in [0, {self.d_sae}), got {i!r}")
        return i

    # -- for the engine ----------------------------------------------------------
    def check(self, facts: Any) -> None:
        """Refuse an SAE that does not fit the session's model."""
        if self.site not in facts.sites:
            raise facts.no_such_site(self.site, "SAE site")
        if self.site in ("q", "k", "v", "attn_pattern", "positions"):
            raise VlensError(f"an SAE reads a residual site or z, not {self.site!r}")
        if self.layer >= facts.n_layers:
            raise VlensError(f"this SAE reads layer {self.layer}; the model has layers "
                             f"0..{facts.n_layers - 1}")
        if facts.width(self.site) != self.d_in:
            raise VlensError(
                f"this SAE encodes {self.d_in}-wide rows but {self.site} of this model is "
                f"{facts.width(self.site)} wide: it was trained on another model")

    def payload(self) -> dict[str, Any]:
        """What the workers keep (the encoder; see ``worker/features.py``)."""
        names = ("W_enc", "b_enc", "b_dec") + (
            ("threshold",) if "threshold" in self.weights else ())
        return {"spec": self.spec.to_wire(), **{n: encode_tensor(self.weights[n]) for n in names}}


def _spec_of(cfg: dict[str, Any], path: Path) -> FeatureSpec:
    arch = str(cfg.get("architecture") or "standard")
    kwargs = cfg.get("activation_fn_kwargs") or {}
    if arch == "standard" and str(cfg.get("activation_fn_str", "relu")) == "topk":
        arch = "topk"  # older SAELens: a standard SAE with a topk activation
    if arch not in ARCHITECTURES:
        raise VlensError(f"{path}: SAE architecture {arch!r} is not supported; vlens encodes "
                         f"{', '.join(ARCHITECTURES)}")
    if cfg.get("rescale_acts_by_decoder_norm"):
        raise VlensError(f"{path}: rescale_acts_by_decoder_norm=true is not supported; fold the "
                         "decoder norms into W_enc and W_dec")
    norm = str(cfg.get("normalize_activations") or "none")
    scale = 1.0
    if norm == "expected_average_only_in":
        if "norm_scaling_factor" not in cfg:
            raise VlensError(f"{path}: normalize_activations='expected_average_only_in' needs "
                             "the scaling factor; fold it into the weights (SAELens's "
                             "fold_activation_norm_scaling_factor) or add norm_scaling_factor")
        norm, scale = "scale", float(cfg["norm_scaling_factor"])
    elif norm not in ("none", "constant_norm_rescale", "layer_norm"):
        raise VlensError(f"{path}: normalize_activations={norm!r} is not supported")
    return FeatureSpec(arch, int(cfg.get("k") or kwargs.get("k") or 0), norm, scale,
                       bool(cfg.get("apply_b_dec_to_input", True)))


def feature_reads(saes: Any, top_k: Any, facts: Any) -> tuple[list[Read], list[SAE]]:
    """The reads of ``trace(saes=..., features_top_k=k)``, checked, and the
    SAEs they name (the runner ships their encoders to the workers)."""
    if saes is None or (isinstance(saes, (list, tuple)) and not saes):
        return [], []
    if isinstance(saes, SAE):
        saes = [saes]
    if not isinstance(saes, (list, tuple)) or not all(isinstance(x, SAE) for x in saes):
        raise VlensError("saes must be a vlens.SAE or a list of them (vlens.SAE.load(path))")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise VlensError(f"features_top_k must be a non-negative int, got {top_k!r}")
    reads = {}
    for sae in saes:
        sae.check(facts)
        if top_k:
            reads[sae.id] = Read(sae.site, (sae.layer,), "sae_top", min(top_k, sae.d_sae), sae=sae.id)
        else:
            reads[sae.id] = Read(sae.site, (sae.layer,), "sae", sae.d_sae, sae=sae.id)
    return list(reads.values()), list(saes)


class Clamp(Steer):
    """Set feature ``feature`` of ``sae`` to ``value`` at each token of
    ``span``: the row ``x`` becomes ``x + (value - f(x)) * W_dec[feature]``
    (``f(x)``: the feature's activation of that row, encoded in the worker;
    for an SAE that normalises its input, times the normalisation undone,
    ``|x| / sqrt(d_in)`` or the row's std, as SAELens's decode does).
    Pass it as ``s.trace(..., clamp=...)`` (one, a list, or ``PerPrompt``),
    or as ``steer=`` to ``compare`` and ``sweep`` (over values)."""

    @keywords
    def __init__(self, sae: SAE, feature: int, value: float, span: str | tuple[int, int] = "all"
                 ) -> None:
        if not isinstance(sae, SAE):
            raise VlensError(f"Clamp needs a vlens.SAE, got {type(sae).__name__}")
        f = checked(ClampFields, "Clamp", feature=feature, value=value, span=span)
        super().__init__(sae.decoder(f.feature), sae.layer, f.value, sae.site, f.span)
        object.__setattr__(self, "sae", sae)
        object.__setattr__(self, "feature", feature)

    @property
    def value(self) -> float:
        return self.scale

    def __repr__(self) -> str:
        return f"Clamp({self.sae!r}, feature={self.feature}, value={self.scale:g}, span={self.span!r})"

    def with_scale(self, scale: float) -> Clamp:
        """The same clamp to another value (what ``sweep`` varies)."""
        return Clamp(self.sae, self.feature, scale, self.span)

    def with_span(self, span: str | tuple[int, int]) -> Clamp:
        """The same clamp over other positions (a role span, resolved)."""
        return Clamp(self.sae, self.feature, self.scale, span)
