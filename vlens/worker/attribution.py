"""Direct logit attribution (DLA) as a worker-side reduction.

Once the final norm's scale ``s`` is frozen at its value on the actual
final residual, the logit difference is linear in the residual stream:

    logit(a) - logit(w) = W_U[a] - W_U[w] . P(norm(x)) (+ biases)
    norm(x)             = centre(x) * g / s + b      (centre: LayerNorm only)

so with ``d0 = (W_U[a] - W_U[w]) * scale`` (the logits processor's scale;
through ``P^T`` where a projection follows the norm) and ``d = g * d0``
(Gemma's ``(1 + w) * d0``; centred for LayerNorm), every component ``c``
of the final residual contributes ``(c . d) / s``, and the constant rest
(``b . d0``, the unembedding's bias) is the bias term. The worker ships
``c . d`` per row (one float per component) and, at the last layer's
``resid_post``, ``s``, the bias term and the engine's own logit difference;
the notebook side divides. Gemma2's final softcap is left out: DLA is of
the pre-softcap logits.

Per site (``Read.reduce == "dla"``, ``Read.target == (a, w or -1)``):

* ``resid_pre`` (layer 0: the embeddings), ``attn_out``, ``mlp_out``:
  ``[n, 1]``, ``c . d``; where a layer passes a block's output through a
  norm before the residual add (Gemma2/3, OLMo2), ``c`` is that norm's
  output (the layer's own module);
* ``z``: ``[n, heads + 1]``, each head through its slice of the attention
  output projection (``z_h . W_O[:, h]^T d``), and last the projection's
  bias term, so the row sums to the ``attn_out`` value; under a post norm
  its scale is frozen at its value on the row's whole projection output;
* ``resid_post`` (last layer): ``[n, 4]``: ``x . d``, ``s``, the bias
  term, and the logit difference through the model's own final-norm module,
  projection and unembedding rows (pre-softcap, times the scale).

Imports ``protocol/``, torch, the step log's stand-in (``steplog.Later``) and
(for the tensor-parallel size) vLLM.
Tensor parallelism is refused: each rank holds part of the unembedding
and of each output projection.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vlens.protocol.final_norm import FinalNorm, final_logits, norm_of
from vlens.protocol.plan import Read
from vlens.protocol.sites import ModelSites, resolve_sites
from vlens.worker.steplog import Later

__all__ = ["DLA_SITES", "dla_part", "dla_rows"]

#: the sites a "dla" read may name
DLA_SITES = ("resid_pre", "attn_out", "mlp_out", "z", "resid_post")

# model -> {key: cached directions}: per (answer, wrong) pair, bounded
# (cleared whole past _CACHE_MAX entries); weights do not change under an engine
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
_CACHE_MAX = 256
# model -> {layer (or "project"): a probed linear layer's (weight^T, bias)}:
# bounded by the model (one per layer), never cleared with the pairs above,
# so a client cycling answer tokens does not re-probe every layer
_PROBED: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


@dataclass(frozen=True)
class Target:
    """One (answer, wrong) pair's directions: ``d`` ``[hidden]`` for the
    residual's components, the final norm's facts, ``d0`` (after any
    projection's transpose), ``rows`` ``[2, width]`` the unembedding rows
    (times the scale), and the bias term."""

    d: torch.Tensor
    d0: torch.Tensor
    rows: torch.Tensor
    row_bias: torch.Tensor
    bias: float
    final: FinalNorm | None


def _unembedding(model: nn.Module) -> nn.Module:
    """The module whose ``weight`` rows are the unembedding: the LM head,
    or, where a family keeps only the tied input embedding (Gemma), that."""
    head = getattr(model, "lm_head", None)
    if getattr(head, "weight", None) is not None:
        return head
    for m in model.modules():
        if type(m).__name__ == "VocabParallelEmbedding":
            return m
    raise ValueError("found no unembedding (lm_head or a vocabulary embedding) in this model")


def _linear_t(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """A linear layer's weight transposed, ``[in, out]``, its bias (float32)
    and whether the weight is a copy (worth keeping) rather than a view of
    the live weight (in the model's dtype; never copied to keep). On a CPU
    vLLM packs linear weights for its kernel and leaves ``weight`` empty:
    the layer is then run on the identity (exact: each output is one weight
    times 1) less its output on zeros."""
    bias = getattr(m, "bias", None)
    bias = None if bias is None else bias.detach().float()
    w = getattr(m, "weight", None)
    if w is not None and w.dim() == 2 and w.numel():
        return w.detach().t(), bias, False
    size = int(getattr(m, "input_size", 0) or getattr(m, "in_features", 0))
    if not size:
        raise ValueError(f"cannot read the weight of {type(m).__name__}")
    dtype = next((p.dtype for p in m.parameters() if p.is_floating_point()), torch.float32)
    device = next(m.parameters()).device
    probe = torch.cat([torch.eye(size, dtype=dtype, device=device),
                       torch.zeros(1, size, dtype=dtype, device=device)])
    out = _first(m(probe)).float()
    return out[:-1] - out[-1], bias, True


def refusal(model: nn.Module, sites: ModelSites) -> str | None:
    """Why this engine cannot attribute, or None."""
    config = getattr(model, "config", None)
    if getattr(config, "do_layer_norm_before", True) is False:
        return ("this OPT normalises after each block (do_layer_norm_before=False), so the "
                "final residual is no sum of the blocks' outputs: direct logit attribution "
                "does not apply")
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        tp = get_tensor_model_parallel_world_size()
    except Exception:  # pragma: no cover - no distributed state (a plain module)
        tp = 1
    if tp > 1:
        return ("direct logit attribution under tensor parallelism is not supported yet (each "
                "rank holds part of the unembedding and of each output projection): open the "
                "model with tensor_parallel_size=1")
    if sites.final_norm is None:
        return "this model has no final norm vlens can find"
    return None


def _target(model: nn.Module, sites: ModelSites, target: tuple[int, ...]) -> Target:
    cache = _CACHE.setdefault(model, {})
    got = cache.get(("target", target))
    if got is not None:
        return got
    why = refusal(model, sites)
    if why:
        raise ValueError(why)
    a, w = int(target[0]), int(target[1])
    head = _unembedding(model)
    weight = head.weight.detach()
    scale = float(getattr(getattr(model, "logits_processor", None), "scale", 1.0) or 1.0)
    ids = [a] if w < 0 else [a, w]
    rows = weight[ids].float() * scale  # [1 or 2, width]
    sign = torch.tensor([1.0, -1.0][: len(ids)], device=rows.device)
    bias = getattr(head, "bias", None)
    row_bias = (torch.zeros(len(ids), device=rows.device) if bias is None
                else bias.detach()[ids].float() * scale)
    d0 = sign @ rows  # [width]
    const = float(sign @ row_bias)
    if sites.project is not None:  # logits = W_U . P(norm(x)): d0 -> P^T d0
        p_t, p_bias = _weight_t(model, "project", sites.project)
        if p_bias is not None:
            const += float(p_bias @ d0)
        d0 = p_t.float() @ d0
    final = norm_of(sites.final_norm)  # no softcap: DLA is of the pre-softcap logits
    got = Target(final.direction(d0), d0, rows, row_bias, const + final.bias_term(d0), final)
    if len(cache) > _CACHE_MAX:
        cache.clear()
    cache[("target", target)] = got
    return got


def _weight_t(model: nn.Module, key: Any, m: nn.Module
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_linear_t`` of ``m`` (the model's layer ``key``), a probed copy
    kept in ``_PROBED`` for the engine's life (one per layer)."""
    probed = _PROBED.setdefault(model, {})
    got = probed.get(key)
    if got is None:
        w_t, bias, copy = _linear_t(m)
        got = (w_t, bias)
        if copy:  # a probed weight: probe once per layer
            probed[key] = got
    return got


def _module(root: Any, path: str | None) -> Any:
    """Follow a dotted path from ``root``; None where there is none."""
    if not path:
        return None
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def _heads(model: nn.Module, sites: ModelSites, layer: int, t: Target, key: tuple
           ) -> tuple[torch.Tensor, torch.Tensor, float, FinalNorm | None, torch.Tensor | None]:
    """Layer ``layer``'s per-head directions ``u`` ``[heads * head_dim]``
    (``W_O^T d'``; head h's slice is its), the output projection's weight
    transposed, ``[heads * head_dim, hidden]``, its bias term ``b_O . d'``,
    the post norm (None: none) and the projection's bias (None: none);
    ``d'`` is ``d`` through the post norm's weight."""
    cache = _CACHE.setdefault(model, {})
    got = cache.get(("heads", layer, key))
    if got is not None:
        return got
    lay = sites.arch.layout(sites.impl)
    attn = _module(sites.layers[layer], lay.attn)
    proj = _module(attn, lay.out_proj)
    if proj is None:
        raise ValueError(f"found no attention output projection at layer {layer} "
                         f"({lay.attn}.{lay.out_proj})")
    post_m = _module(sites.layers[layer], lay.attn_post)
    post = norm_of(post_m) if post_m is not None else None
    d = post.direction(t.d) if post is not None else t.d
    w_t, b_o = _weight_t(model, layer, proj)
    u = w_t.float() @ d
    b_term = 0.0 if b_o is None else float(b_o @ d)
    got = (u, w_t, b_term, post, b_o)
    if len(cache) > _CACHE_MAX:
        cache.clear()
    cache[("heads", layer, key)] = got
    return got


#: what each site's DLA read ships per row (``z``: a column per head and one
#: for the projection's bias term)
_WIDTH = {"resid_pre": 1, "attn_out": 1, "mlp_out": 1, "resid_post": 4}


def dla_part(model: nn.Module, rows: torch.Tensor, read: Read, layer: int
             ) -> torch.Tensor | Later:
    """:func:`dla_rows` of ``rows`` (a gathered copy, never a view of engine
    memory), on a CPU reduced after the step: inside a compiled step each
    small torch operation costs 3 to 8 times what it costs outside it, and
    a DLA read is a few of them per (site, layer), ~0.1 ms a visit on a
    2-core CPU. The directions are looked up in the step (once per target,
    site and layer), so a read that cannot be attributed fails its requests
    there, as before. Reads on an accelerator are reduced at once."""
    if rows.device.type != "cpu" or (read.site not in _WIDTH and read.site != "z"):
        return dla_rows(model, rows, read, layer)
    cache = _CACHE.setdefault(model, {})
    key = ("checked", read.site, read.target, layer)
    if key not in cache:
        sites = resolve_sites(model)
        t = _target(model, sites, read.target)
        if read.site == "z":
            _heads(model, sites, layer, t, read.target)
        cache[key] = True
    width = rows.shape[1] + 1 if read.site == "z" else _WIDTH[read.site]
    return Later(lambda: dla_rows(model, rows, read, layer), (rows.shape[0], width),
                 torch.float32)


def dla_rows(model: nn.Module, rows: torch.Tensor, read: Read, layer: int) -> torch.Tensor:
    """The ``"dla"`` reduction of one site's gathered ``rows`` (``[n,
    hidden]``; at ``z`` ``[n, heads, head_dim]``): see the module's
    docstring for what each site ships."""
    sites = resolve_sites(model)
    t = _target(model, sites, read.target)
    site = read.site
    if site in ("attn_out", "mlp_out"):
        lay = sites.arch.layout(sites.impl)
        post = _module(sites.layers[layer], lay.attn_post if site == "attn_out" else lay.mlp_post)
        c = _first(post(rows)) if post is not None else rows
        return (c.float() @ t.d)[:, None]
    if site == "resid_pre":
        return (rows.float() @ t.d)[:, None]
    if site == "z":
        u, w_t, b_term, post, b_o = _heads(model, sites, layer, t, read.target)
        z = rows.float()
        # a product and a sum: half the cost of einsum's route inside the
        # engine's step (158 against 305 us a visit, SmolLM2, 32 rows)
        per_head = (z * u.reshape(z.shape[1], -1)).sum(-1)
        bias = torch.full((z.shape[0], 1), b_term, device=z.device)
        if post is not None:  # freeze the post norm's scale at the row's whole output
            out = (z.reshape(z.shape[0], -1).to(w_t.dtype) @ w_t).float()
            if b_o is not None:
                out = out + b_o
            s = post.scale(out)[:, None]
            per_head, bias = per_head / s, bias / s + post.bias_term(t.d)
        return torch.cat([per_head, bias], dim=1)
    if site == "resid_post":
        x = rows.float()
        # through the one final-norm function (pre-softcap: t.final has none)
        logits = final_logits(rows, t.final, t.rows, project=sites.project) + t.row_bias
        logit = logits[:, 0] - (logits[:, 1] if logits.shape[1] > 1 else 0.0)
        scale = t.final.scale(x)
        bias = torch.full_like(scale, t.bias)
        return torch.stack([x @ t.d, scale, bias, logit], dim=1)
    raise ValueError(f"direct logit attribution reads {', '.join(DLA_SITES)}, not {site!r}")
