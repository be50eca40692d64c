"""What one hook does at one (site, layer) in one step, as functions.

The worker's hooks call these with the step's plan and the site's tensors:
the batched steering add, one request's ``edit=`` function, and the
reduction of gathered read rows, and the batched sets (ablations,
patched cells). ``get_value()`` returns the site's
canonical value and ``get_target()`` the tensor changes are added to (for a
native ``resid_post``, the residual half of ``(hidden, residual)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vlens.worker.attribution import dla_part, dla_rows
from vlens.worker.layout import StepLayout, add_rows, narrow, token_axis, widen
from vlens.protocol.plan import EditContext, Read
from vlens.worker.planner import EditCall
from vlens.worker.writes import AddBatch, SetBatch
from vlens.protocol.sites import lens_logits, lens_top

__all__ = ["apply_adds", "apply_sets", "keep_finite", "reduce_rows", "run_edit"]

Getter = Callable[[], torch.Tensor]
#: what a write touched: an int64 index of step rows, or ``(lo, hi)``
Written = torch.Tensor | tuple[int, int]


def keep_finite(flat: torch.Tensor, rows: torch.Tensor | None,
                before: torch.Tensor) -> torch.Tensor:
    """After a write: every written row of ``flat`` (``rows``, an index of
    its first axis; None: all of ``flat``, a view of the written rows) that
    holds a non-finite value gets ``before`` (its value before the write)
    back, so nothing non-finite that vlens wrote reaches the next kernel or
    the KV cache. One reduction over the written rows (a row's float32 sum
    is finite exactly when the row is, short of an overflow of the sum,
    which marks a row too large to keep anyway), one select and one copy;
    never reads back to the host. Returns ``ok`` ``[m]`` bool (False: the
    row was restored)."""
    after = flat if rows is None else flat.index_select(0, rows)
    ok = after.reshape(after.shape[0], -1).sum(-1, dtype=torch.float32).isfinite()
    fixed = torch.where(ok.view(-1, *([1] * (after.dim() - 1))), after, before)
    if rows is None:
        flat.copy_(fixed)
    else:
        flat.index_copy_(0, rows, fixed)
    return ok


def _token_rows(t: torch.Tensor, layout: StepLayout, label: str) -> torch.Tensor:
    """``t`` with the step's tokens on its first axis (``[1, T, ...]`` -> ``[T, ...]``, a view)."""
    return t[0] if token_axis(t, layout, site=label) == 1 else t


def apply_adds(matrix: torch.Tensor, batch: AddBatch, layout: StepLayout, get_value: Getter,
               get_target: Getter, label: str, features: Any = None
               ) -> tuple[torch.Tensor, Written]:
    """Every request's steering add at this (site, layer), in one
    ``index_add_``; relative adds scale by each row's norm before the add.
    Rows the add made non-finite are restored (:func:`keep_finite`).
    Returns ``(ok per written row, the rows written)``. Never reads a
    tensor back to the host."""
    target = get_target()
    flat = _token_rows(target, layout, label)
    if batch.uniform is not None:  # one vector on a run of rows: a slice add
        lo, hi, vec, scale = batch.uniform
        delta = batch.cache.get("delta")
        if delta is None or delta.dtype != flat.dtype:
            # scale is a float32 value: the same product the indexed path adds;
            # made once while decode steps reuse this batch
            delta = batch.cache["delta"] = (matrix[vec] * scale).to(flat.dtype)
        seg = flat[lo:hi]
        before = seg.clone()
        seg.add_(delta)
        return keep_finite(seg, None, before), (lo, hi)
    delta = matrix.index_select(0, batch.vectors) * batch.scales[:, None]
    if batch.relative is not None:
        value = _token_rows(get_value(), layout, label)
        norms = value.index_select(0, batch.rows).float().norm(dim=-1)
        delta = delta * torch.where(batch.relative, norms, 1.0)[:, None]
    if batch.clamps:  # (value - f_i(row)) * W_dec[i]: the feature set to the value
        value = _token_rows(get_value(), layout, label)
        for sid, sel, feats in batch.clamps:
            rows = value.index_select(0, batch.rows.index_select(0, sel))
            now = features.activations(rows, sid).gather(1, feats[:, None])
            dec = matrix.index_select(0, batch.vectors.index_select(0, sel))
            # times the SAE's normalisation undone (1 for an SAE without one)
            want = batch.scales.index_select(0, sel)[:, None] - now
            delta.index_copy_(0, sel, ((want * features.output_scale(rows, sid)) * dec).to(delta.dtype))
    before = flat.index_select(0, batch.rows)
    add_rows(target, layout, batch.rows, delta, site=label, check=False)
    return keep_finite(flat, batch.rows, before), batch.rows


def apply_sets(matrix_of: Callable[[int], torch.Tensor], batch: SetBatch, layout: StepLayout,
               get_value: Getter, get_target: Getter, label: str
               ) -> tuple[torch.Tensor, Written]:
    """Every request's sets at this (site, layer) in one go: gather the rows'
    current values, replace the masked dims (``[lo, hi)`` of each row) with
    the vector's (or zeros), and add the difference to the target in one
    ``index_add_`` -- the canonical value may be a sum (a native
    ``resid_post`` is ``hidden + residual``), so writing the difference into
    the target is what makes the value equal the replacement. Rows of other
    requests are never touched. Projecting rows (``batch.project``) lose
    their component along the vector instead, ``x - (x . v^) v^``, in the
    same gather and ``index_add_``. ``matrix_of(width)``: the worker's vectors of
    the site's width. Rows made non-finite are restored, as for adds; returns
    ``(ok per written row, the rows written)``. Never reads a tensor back to
    the host."""
    flat = _token_rows(get_value(), layout, label)
    current = flat.index_select(0, batch.rows).float()  # [m, width]
    width = current.shape[-1]
    if batch.any_vector:
        mat = matrix_of(width)
        replace = mat.index_select(0, batch.vectors.clamp_min(0))
        replace = torch.where((batch.vectors >= 0)[:, None], replace, 0.0)
    else:
        replace = torch.zeros_like(current)
    dims = torch.arange(width, device=current.device)
    mask = (dims >= batch.lo[:, None]) & (dims < batch.hi[:, None])
    delta = torch.where(mask, replace - current, 0.0)
    if batch.project is not None:  # directional ablations: x - (x . v^) v^
        unit = replace.float()
        # unit already (the Session sends v^); normalised again for a hand-made plan
        unit = unit / unit.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        along = (current * unit).sum(-1, keepdim=True) * unit
        delta = torch.where(batch.project[:, None], -along, delta)
    target = get_target()
    t_flat = _token_rows(target, layout, label)
    before = t_flat.index_select(0, batch.rows)
    add_rows(target, layout, batch.rows, delta, site=label, check=False)
    return keep_finite(t_flat, batch.rows, before), batch.rows


def run_edit(fn: Callable, layout: StepLayout, site: str, get_value: Getter,
             get_target: Getter | None, call: EditCall, label: str
             ) -> tuple[int, torch.Tensor | None]:
    """Call one request's edit function on its rows and write back the
    change it returns, exactly once: whether the function returned a new
    tensor, the tensor it was given changed in place, or a view of it.
    Returns the bytes copied for it (clone reads), and ok per row written
    (None: nothing written; rows made non-finite are restored)."""
    plan, span = call.plan, call.span
    value = get_value()
    axis = token_axis(value, layout, site=label)
    rows = narrow(value, layout, span, axis=axis, clone=plan.clone, site=label)
    copied = rows.numel() * rows.element_size() if plan.clone else 0
    before = rows.clone()
    ctx = EditContext(plan.index, plan.tag, site, call.edit.layer,
                      call.positions, plan.prompt_len, plan.clone)
    result = fn(rows, ctx)
    if isinstance(result, torch.Tensor):
        result = result.detach().clone()  # our own copy, whatever it aliases
    changed = not torch.equal(rows, before)
    if changed and not plan.clone:
        # the function wrote into engine memory through its view: undo
        # that, so the write-back below is the one change that lands
        rows.copy_(before)
    if result is None:
        if changed:
            raise ValueError(
                "the edit function changed the tensor it was given in place and "
                "returned None; vlens writes edits back only from what the "
                "function returns: return the edited tensor"
            )
        return copied, None
    if get_target is None:
        raise ValueError(
            f"site {site} is read-only: an edit function there may look "
            "(return None) but not return a new value"
        )
    if not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(before.shape):
        raise ValueError(
            f"the edit function returned {type(result).__name__}"
            f"{list(getattr(result, 'shape', []))}; return a tensor of the shape it was "
            f"given, {list(before.shape)}"
        )
    target = get_target()
    t_rows = narrow(target, layout, span, axis=axis, site=label)
    # the canonical value may be a sum (native resid_post): add the change
    change = result.to(t_rows.dtype) - before.to(t_rows.dtype)
    old = t_rows.clone()
    widen(target, layout, span, t_rows + change, axis=axis, site=label)
    if axis == 1:  # [1, n, ...] -> [n, ...]
        t_rows, old = t_rows[0], old[0]
    return copied, keep_finite(t_rows, None, old)


def reduce_rows(model: Any, rows: torch.Tensor, read: Read,
                features: Any = None, layer: int = 0, copied: bool = False
                ) -> dict[str, torch.Tensor]:
    """``rows`` is a gathered copy ([n, ...]), or a view where the
    reduction makes a new tensor; kept values never alias engine buffers
    that later kernels or steps overwrite. They stay on the model's device
    until the step ends (the worker copies them to the host in one go).
    ``layer``: the layer the rows are of (direct logit attribution's heads
    and post norms); ``copied``: ``rows`` is a gathered copy, which a DLA
    read on a CPU may reduce after the step (``attribution.dla_part``)."""
    if read.reduce == "full":
        return {"value": rows.float()}
    if read.sae:  # feature activations of an SAE the worker holds (``features``)
        return features.reduce(rows, read.sae, read.k if read.reduce == "sae_top" else 0)
    if read.reduce == "dla":  # direct logit attribution (worker/attribution.py)
        if copied:
            return {"value": dla_part(model, rows, read, layer)}
        return {"value": dla_rows(model, rows, read, layer)}
    if read.reduce == "norm":
        if rows.dtype == torch.float32:  # no dtype argument: a shorter path in torch
            return {"value": torch.linalg.vector_norm(rows, dim=-1)}
        return {"value": torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float32)}
    logits = lens_logits(model, rows)
    if logits is None:  # a non-driver tensor-parallel rank
        return {}
    if read.reduce == "vocab_logprobs":
        return {"value": logits.log_softmax(-1)}
    if read.reduce == "logit_lens":
        ids, probs = lens_top(logits, read.k)
        return {"ids": ids, "probs": probs}
    raise ValueError(f"unknown reduction {read.reduce!r}")
