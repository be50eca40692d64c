"""Parts of :class:`vlens.widgets.FeatureView` that need no widget: a
feature's contexts as tinted HTML, where a clamp starts without a measured
recipe, and a harvest's texts encoded by an SAE in the kernel."""

from __future__ import annotations

import html
from typing import Any

import torch

from vlens.results.harvest import Harvest
from vlens.tokens import visible

__all__ = ["CLAMP_START", "clamp_start", "contexts_html", "harvest_features"]

#: where a clamp starts without a measured recipe: a write of this fraction
#: of the site's mean row norm over the prompts
CLAMP_START = 0.6


def contexts_html(frame: Any, top: float, label: str = "", unit: str = "prompt") -> str:
    """:func:`vlens.plots.feature_contexts`'s rows as lines of tokens, each
    tinted by the feature's activation (``top``: full colour), the strongest
    outlined; escaped, with the activation in each token's tooltip
    (``unit``: what a row's ``prompt`` counts, "prompt" or "text")."""
    if not len(frame):
        return (f"<div class='vlens-contexts'><i>{html.escape(label)} fires on none of the "
                f"{unit}s</i></div>")
    # a vocabulary whose tokens carry their own spaces (a byte-level BPE's
    # " whale") reads as text when its tokens sit side by side with those
    # spaces; a word-level one's tokens hold none: each gets a gap after it
    spaced = any(tok[:1].isspace() for row in frame.itertuples() for tok in row.tokens)
    gap = "0" if spaced else "0.4em"
    lines = []
    for row in frame.itertuples():
        cells = []
        for j, (tok, v) in enumerate(zip(row.tokens, row.values)):
            alpha = 0.0 if top <= 0 else max(0.0, min(1.0, v / top))
            edge = ("outline:2px solid #1f2328;" if row.start + j == row.position else "")
            shown = tok.replace("\n", "\u21b5") if spaced and tok.strip() else visible(tok)
            cells.append(
                f"<span title='{html.escape(f'token {row.start + j}: {v:.4g}', quote=True)}' "
                f"style='background:rgba(255,127,14,{alpha:.3f});{edge}"
                f"padding:0 1px;margin-right:{gap};border-radius:2px'>"
                f"{html.escape(shown)}</span>")
        lines.append(
            f"<div class='vlens-context' style='font-family:monospace;white-space:pre;"
            f"margin:2px 0'><span style='color:#57606a'>{unit} {row.prompt}, "
            f"token {row.position}: <b>{row.activation:.4g}</b></span>  {''.join(cells)}</div>")
    return f"<div class='vlens-contexts'>{''.join(lines)}</div>"


def clamp_start(sae, feature: int, mean_norm: float) -> float:
    """The clamp value whose write, ``(v - f) * W_dec[i]`` times what the
    SAE's normalisation undoes (``protocol.features.output_scale``), is
    CLAMP_START x the site's mean row norm: a ``constant_norm_rescale`` SAE
    scales the write by each row's norm over sqrt(d), a ``layer_norm`` one
    by its std (about the same); other SAEs write it as it is."""
    unit = float(sae.decoder(feature).norm())
    if sae.spec.norm in ("constant_norm_rescale", "layer_norm"):
        return round(CLAMP_START * sae.d_in ** 0.5 / unit, 1)
    return round(CLAMP_START * mean_norm / unit, 1)


def harvest_features(harvest: Any, sae: Any, session: Any, k: int) -> tuple:
    """Encode a harvest's rows of the SAE's site and layer here, in chunks,
    keeping each token's ``max(k, 64)`` largest features (a topk SAE's are
    all it has). Each text's first row (the attention sink, with a norm far
    above the rest; the trainer leaves it out) counts as 0. Returns the
    :class:`~vlens.Harvest`, ``[N, m]`` feature ids and values, each text's
    ``(start, stop)`` and its tokens' strings."""
    h = harvest if isinstance(harvest, Harvest) else Harvest.open(harvest)
    rows = h.read(sae.site, sae.layer)  # [N, d_in]
    m = min(sae.d_sae, max(k, 64))
    ids, vals = [], []
    with torch.no_grad():
        for chunk in rows.split(4096):
            got = sae.encode(chunk.float()).topk(m, dim=-1)
            ids.append(got.indices.to(torch.int32))
            vals.append(got.values.clamp_min(0).to(torch.float32))
    ids_, vals_ = torch.cat(ids), torch.cat(vals)
    spans = h.spans[:h.texts_done]
    for start, stop in spans:
        if stop > start:
            vals_[start] = 0
    strings = session.token_strings(h.token_ids.tolist())
    return h, ids_, vals_, spans, [strings[a:b] for a, b in spans]
