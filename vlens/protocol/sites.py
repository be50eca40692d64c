"""Named places in a decoder stack where vlens reads and writes.

A site name is what a user types (``resid_post``); it has one meaning in
every architecture, equal to the matching Hugging Face value (see
:data:`SITES`). Resolving it means knowing, for the model and backend vLLM
loaded, which module to hook, whether before or after its forward, and how
to turn the hook's arguments into that value. Where the modules are comes
from the architecture's row in :mod:`vlens.protocol.architectures`; how a layer
carries the residual stream comes in three kinds:

* ``pair`` -- vLLM-native Llama relatives: ``layer(positions, hidden [T, H],
  residual [T, H] | None) -> (hidden, residual)``; the stream is their sum;
* ``stream`` -- vLLM-native GPT-2, GPT-J, OPT: the layer takes and returns
  the whole stream ``[T, H]``;
* ``hf`` -- vLLM's Transformers backend runs the Hugging Face layer on
  ``[1, T, H]`` and returns the whole stream.

No vLLM import here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vlens.protocol.architectures import (Architecture, Layout, check_model_config,
                                          find_architecture)
from vlens.errors import VlensError
from vlens.protocol.final_norm import FinalNorm, final_logits, norm_of
from vlens.protocol.head_tap import attach_taps
from vlens.protocol.site_names import HEAD_SITES, HEAD_WRITABLE, SITES, WRITABLE

__all__ = [
    "SITES",
    "WRITABLE",
    "HEAD_SITES",
    "HEAD_WRITABLE",
    "SiteSpec",
    "ModelSites",
    "resolve_sites",
    "lens_logits",
    "lens_top",
]


Extractor = Callable[[tuple, dict, Any], torch.Tensor]


@dataclass(frozen=True)
class SiteSpec:
    """How to read one site: hook ``module_of(layer)`` before (``pre``) or
    after its forward, and pull the value out with ``extract(args, kwargs,
    output)``.

    ``target(args, kwargs, output)`` is the tensor to add to, in place, so
    that the canonical value changes by the same amount (for a native
    ``resid_post`` that is the residual half of ``(hidden, residual)``);
    ``None`` for read-only sites."""

    name: str
    module_of: Callable[[nn.Module], nn.Module]
    pre: bool
    extract: Extractor
    target: Extractor | None = None
    #: where the value is a sum made for the read (a native residual site:
    #: ``hidden + residual``), the part added to the target (None when there
    #: is no sum this time, e.g. layer 0's ``resid_pre``): compiled mode hands
    #: its operator the two parts, and the worker sums them only when a read,
    #: an edit or a relative add needs the value (in the same order as
    #: ``extract``, so the sum is the same to the bit)
    addend: Extractor | None = None


@dataclass(frozen=True)
class ModelSites:
    """The sites of one loaded model. ``absent``: sites this model does not
    have, with the reason (asking for one is a VlensError that says it)."""

    impl: str  # "native" | "transformers"
    architecture: str
    layers: tuple[nn.Module, ...]
    specs: dict[str, SiteSpec]
    absent: dict[str, str] = field(default_factory=dict)
    arch: Architecture | None = None
    final_norm: nn.Module | None = None
    project: nn.Module | None = None  # applied after the final norm, if any
    #: each layer's vLLM attention module (the one called as attn(q, k, v));
    #: empty where the head sites are absent
    attention: tuple[nn.Module, ...] = ()

    @property
    def n_layers(self) -> int:
        return len(self.layers)


# -- pulling values out of hook arguments ------------------------------------


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _output_value(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    return _first(output)


def _first_input(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    """The first input of a module: a norm's ``x``, an MLP's ``hidden_states``."""
    if args:
        return args[0]
    return next(iter(kwargs.values()))


def _pair_value(h_at: int, h_name: str, r_at: int, r_name: str):
    """The stream carried as ``(hidden, residual)`` arguments: their sum
    (``hidden`` alone where the residual is still None, at layer 0)."""

    def value(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
        hidden = _arg(args, kwargs, h_at, h_name)
        residual = _arg(args, kwargs, r_at, r_name)
        return hidden if residual is None else hidden + residual

    return value


def _pair_addend(h_at: int, h_name: str, r_at: int, r_name: str):
    """What is added to that target to make the sum (None: no sum)."""

    def addend(args: tuple, kwargs: dict, output: Any) -> torch.Tensor | None:
        residual = _arg(args, kwargs, r_at, r_name)
        return None if residual is None else _arg(args, kwargs, h_at, h_name)

    return addend


def _pair_target(h_at: int, h_name: str, r_at: int, r_name: str):
    """Where to add a change to that sum: the residual (or ``hidden``)."""

    def target(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
        residual = _arg(args, kwargs, r_at, r_name)
        return _arg(args, kwargs, h_at, h_name) if residual is None else residual

    return target


# a fused add-and-norm's inputs (x, residual); a decoder layer's
# (positions, hidden_states, residual)
_pair_sum = _pair_value(0, "x", 1, "residual")
_pair_residual = _pair_target(0, "x", 1, "residual")
_pair_x = _pair_addend(0, "x", 1, "residual")
_pair_resid_pre = _pair_value(1, "hidden_states", 2, "residual")
_pair_resid_pre_target = _pair_target(1, "hidden_states", 2, "residual")
_pair_resid_pre_addend = _pair_addend(1, "hidden_states", 2, "residual")


def _check_pair(output: Any) -> None:
    if not (isinstance(output, (tuple, list)) and len(output) == 2):
        raise TypeError(
            "expected the native decoder layer to return (hidden, residual), got "
            f"{type(output).__name__}"
        )


def _pair_resid_post(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    _check_pair(output)
    return output[0] + output[1]


def _pair_resid_post_target(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    _check_pair(output)
    return output[1]


def _pair_resid_post_addend(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    _check_pair(output)
    return output[0]


def _hf_positions(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    return kwargs["position_ids"]


def _model_positions(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    """vLLM calls every model as ``model(input_ids, positions, ...)``."""
    return _arg(args, kwargs, 1, "positions")


def _nth_arg(index: int, name: str) -> Extractor:
    def pick(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
        return _arg(args, kwargs, index, name)

    return pick


# -- finding modules -----------------------------------------------------------


def _get(root: nn.Module, path: str | None) -> Any:
    """Follow a dotted attribute path; None where any step is missing."""
    if path is None:
        return None
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _child(path: str) -> Callable[[nn.Module], nn.Module]:
    def module_of(layer: nn.Module) -> nn.Module:
        return _get(layer, path)

    module_of.__name__ = f"layer.{path}"
    return module_of


def _self(m: nn.Module) -> nn.Module:
    return m


def _specs(layout: Layout, model: nn.Module) -> dict[str, SiteSpec]:
    """The site specs of one layout (``resid_mid`` included where it has a module)."""
    attn, mlp = _child(layout.attn), _child(layout.mlp)
    specs = {
        "attn_out": SiteSpec("attn_out", attn, False, _output_value, _output_value),
        "mlp_out": SiteSpec("mlp_out", mlp, False, _output_value, _output_value),
    }
    mid = _child(layout.mid) if layout.mid else None
    if layout.block == "pair":
        specs["resid_pre"] = SiteSpec("resid_pre", _self, True, _pair_resid_pre,
                                      _pair_resid_pre_target, _pair_resid_pre_addend)
        specs["resid_post"] = SiteSpec("resid_post", _self, False, _pair_resid_post,
                                       _pair_resid_post_target, _pair_resid_post_addend)
        if mid:
            specs["resid_mid"] = SiteSpec("resid_mid", mid, True, _pair_sum, _pair_residual,
                                          _pair_x)
        specs["positions"] = SiteSpec("positions", _self, True, _nth_arg(0, "positions"))
    elif layout.block in ("stream", "hf"):
        hidden = _nth_arg(layout.hidden_arg, "hidden_states")
        specs["resid_pre"] = SiteSpec("resid_pre", _self, True, hidden, hidden)
        specs["resid_post"] = SiteSpec("resid_post", _self, False, _output_value,
                                       _output_value)
        if mid:
            # the module's input tensor is also the residual the block adds
            # to, so an in-place write changes both
            specs["resid_mid"] = SiteSpec("resid_mid", mid, True, _first_input, _first_input)
        if layout.block == "hf":
            specs["positions"] = SiteSpec("positions", _self, True, _hf_positions)
        elif layout.positions_arg is not None:
            specs["positions"] = SiteSpec(
                "positions", _self, True, _nth_arg(layout.positions_arg, "position_ids"))
        else:  # the layer is not given positions: read the model's own argument
            specs["positions"] = SiteSpec("positions", lambda _layer: model, True,
                                          _model_positions)
    else:  # pragma: no cover - a table row with a typo
        raise ValueError(f"unknown layer kind {layout.block!r}")
    return {name: specs[name] for name in SITES if name in specs}


def _attention_module(layer: nn.Module) -> nn.Module | None:
    """The vLLM attention layer inside a decoder layer (the module native
    models call as ``self.attn(q, k, v)``), found by what it has rather than
    by path: every native family names its wrapper differently."""
    for m in layer.modules():
        if all(hasattr(m, a) for a in ("impl", "num_heads", "num_kv_heads", "head_size",
                                       "layer_name")):
            return m
    return None


def _pattern_inputs(args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")


def _head_specs(find: Callable[[nn.Module], nn.Module]) -> dict[str, SiteSpec]:
    """q, k, v before the attention layer runs; z (its output) after."""
    return {
        "q": SiteSpec("q", find, True, _nth_arg(0, "query")),
        "k": SiteSpec("k", find, True, _nth_arg(1, "key")),
        "v": SiteSpec("v", find, True, _nth_arg(2, "value")),
        "z": SiteSpec("z", find, False, _output_value, _output_value),
        "attn_pattern": SiteSpec("attn_pattern", find, True, _pattern_inputs),
    }


def _find_heads(impl: str, layers: Any) -> tuple[tuple, dict[str, str]]:
    """Each layer's vLLM attention module, or why the head sites are absent.

    On the Transformers backend that module is called past its hooks (the
    attention function vLLM registers calls its ``forward``), so the head
    sites sit on a :class:`~vlens.protocol.head_tap.HeadTap` beside it instead; see
    :func:`vlens.protocol.head_tap.attach_taps`."""
    found = tuple(_attention_module(layer) for layer in layers)
    if any(m is None for m in found):
        return (), dict.fromkeys(HEAD_SITES, "vlens found no vLLM attention layer in some "
                                 f"decoder layer of this model ({impl} route)")
    absent = {}
    for m in found:
        impl_ = m.impl
        if getattr(impl_, "alibi_slopes", None) is not None or getattr(impl_, "sinks", None) \
                is not None:
            absent["attn_pattern"] = ("this model's attention adds ALiBi biases or sink "
                                      "logits, which vlens does not recompute")
    return found, absent


_RESOLVED: weakref.WeakKeyDictionary[nn.Module, ModelSites] = weakref.WeakKeyDictionary()


def _architectures_of(model: nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    names = list(getattr(config, "architectures", None) or [])
    return names + [type(model).__name__]


def resolve_sites(model: nn.Module) -> ModelSites:
    """Find the layers of a vLLM model and the way to read each site. On
    the Transformers backend this gives each Hugging Face attention module
    its head tap (once; :func:`~vlens.protocol.head_tap.attach_taps`)."""
    cached = _RESOLVED.get(model)
    if cached is not None:
        return cached
    impl = "transformers" if type(model).__name__.startswith("Transformers") else "native"
    names = _architectures_of(model)
    arch = find_architecture(names)
    if arch is None or impl not in arch.routes:
        # raises the same VlensError the client gives before starting an engine
        check_model_config({"architectures": names[:1]}, "vllm" if impl == "native" else impl)
        raise VlensError(f"vlens does not support {names[0]} with vLLM's {impl} backend")
    layout = arch.layout(impl)
    layers = _get(model, layout.layers)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise VlensError(
            f"vlens expected the decoder layers of {names[0]} at model.{layout.layers}, "
            f"but {type(model).__name__} has none there: this vLLM version lays the model "
            "out differently from the row in vlens/protocol/architectures.py"
        )
    absent = arch.absent_sites(getattr(model, "config", None))
    attention, no_heads = _find_heads(impl, layers)
    absent = {**absent, **no_heads}
    specs = _specs(layout, model)
    if attention:
        index = {id(layer): i for i, layer in enumerate(layers)}
        # native: the attention module itself; Transformers backend: its tap
        at = attention if impl == "native" else attach_taps(layers, attention)
        specs.update(_head_specs(lambda layer: at[index[id(layer)]]))
    specs = {k: v for k, v in specs.items() if k not in absent}
    for i, layer in enumerate(layers):
        for spec in specs.values():
            if spec.module_of(layer) is None:
                raise VlensError(
                    f"layer {i} of {names[0]} ({type(layer).__name__}) has no module for "
                    f"site {spec.name}: this vLLM version lays the model out differently "
                    "from the row in vlens/protocol/architectures.py"
                )
    sites = ModelSites(
        impl=impl,
        architecture=names[0],
        layers=tuple(layers),
        specs=specs,
        absent=absent,
        arch=arch,
        final_norm=_get(model, layout.norm),
        project=_get(model, layout.project),
        attention=attention,
    )
    _RESOLVED[model] = sites
    return sites


def lens_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logit lens's top ``k`` token ids and their probabilities, each
    ``[..., k]``, from ``[..., vocab]`` logits (no softmax of the whole
    vocabulary: ``exp(top - logsumexp(logits))``). The worker's
    ``logit_lens`` read and the offline :class:`vlens.lens.LogitLens` both
    use it."""
    top, ids = logits.topk(max(1, k), dim=-1)
    probs = (top - logits.logsumexp(-1, keepdim=True)).exp()
    return ids, probs


def lens_logits(model: nn.Module, resid: torch.Tensor) -> torch.Tensor | None:
    """Logit lens through the model's own final norm: its facts read off the
    module (RMS or layer norm, Gemma's ``1 + w``, a bias) and applied by
    :func:`vlens.protocol.final_norm.final_logits`, as every lens of vlens
    is, then any projection after it and the unembedding (the model's own
    modules: ``compute_logits``, tied or separate head, Gemma's final
    softcapping). ``resid`` is ``[n, hidden]``; returns ``[n, vocab]``
    float32 (None on ranks that do not receive the gathered logits). On
    tensor-parallel engines every rank must call this together (the
    unembedding gathers across ranks)."""
    sites = resolve_sites(model)
    try:
        norm = norm_of(sites.final_norm)
    except ValueError:  # a norm of a kind the facts do not cover: the module itself
        norm = FinalNorm("none")
        resid = _first(sites.final_norm(resid))
    return final_logits(resid, norm, model.compute_logits, project=sites.project)
