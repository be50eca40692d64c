"""Plot builders: data in, ``plotly.graph_objects.Figure`` out.

Pure functions: no engine, no display, no session. Widgets, notebooks and
the demo report call them; tests assert on the returned figure's data.
Tokens are shown as ``"position:token"`` category labels because plotly
merges identical categories (two ``"the"`` tokens would share a column).
Every figure that lays tokens along an axis is readable from the back of a
room: 14 px text, the page's width, cell text black or white against each
cell's colour (``_cells``), and token sequences as rows of cells that wrap
like text (``_token_rows``).

A few small reductions live here too (:func:`activation_values`,
:func:`pca_2d`, :func:`token_set_metric`): they
turn what a run holds into the arrays a builder takes, and are pure in the
same way.
"""

from __future__ import annotations

from vlens.plots._activations import (
    activation_heatmap,
    activation_pca,
    colour_values,
    layer_profile,
    token_strip,
)
from vlens.plots._attention import (
    attention_heads,
    attention_heatmap,
    attention_of_token,
    pool_pattern,
    thumbnail_at,
    thumbnail_outline,
)
from vlens.plots._branches import branch_rows
from vlens.plots._common import plain_text, token_labels
from vlens.plots._diff import diff_figure, diff_texts
from vlens.plots._features import (
    feature_contexts,
    feature_histogram,
    feature_logits,
    promoted_tokens,
    top_features,
)
from vlens.plots._lens import lens_row_marks, lens_token_values, logit_lens_grid, logit_lens_track
from vlens.plots._reductions import (
    QUANTITIES,
    activation_values,
    pca_2d,
    token_set_metric,
)
from vlens.plots._patching import next_token_bars, patching_heatmap
from vlens.plots._steering import baseline_vs_steered, dose_response

__all__ = [
    "QUANTITIES",
    "activation_heatmap",
    "activation_pca",
    "activation_values",
    "attention_heads",
    "attention_heatmap",
    "attention_of_token",
    "thumbnail_at",
    "thumbnail_outline",
    "baseline_vs_steered",
    "branch_rows",
    "colour_values",
    "diff_figure",
    "diff_texts",
    "dose_response",
    "feature_contexts",
    "feature_histogram",
    "feature_logits",
    "layer_profile",
    "lens_row_marks",
    "lens_token_values",
    "logit_lens_grid",
    "logit_lens_track",
    "next_token_bars",
    "patching_heatmap",
    "pca_2d",
    "plain_text",
    "pool_pattern",
    "promoted_tokens",
    "token_labels",
    "token_set_metric",
    "token_strip",
    "top_features",
]
