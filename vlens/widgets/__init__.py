"""Widgets for looking inside a vlens Session from Jupyter.

Import this package explicitly (``import vlens`` does not load ipywidgets or
plotly's widget layer), or use ``vlens.explore``::

    from vlens.widgets import explore
    explore(session, "once upon a time")

How they fit: a :class:`Controller` is the one object that calls the
Session (trace, direction, compare, sweep) and holds the traced Run. Views
(:class:`ActivationView`, :class:`LogitLensView`, :class:`AttentionView`)
are handed a Run and only draw, following one :class:`Selection` (layer,
token span, site); the
:class:`SteeringPanel` asks the controller to steer (or, in its ablation
mode, to knock out heads). :class:`PatchingView` streams
``session.stream_patch`` and shows the grid filling in. :func:`explore`
composes them around one selection and one controller. :class:`FeatureView`
shows one SAE's features over a set of prompts and steers or clamps with
one. :class:`AttributionView` shows which layers and heads write an answer
(direct logit attribution). :class:`CompareView` puts any two Runs of the same prompts side by side
(plain and ablated, say), the first divergence marked. :class:`BranchView` branches a
generation by clicking a token and one of its alternatives. :class:`DiffView`
shows a model diff (``vlens.diff``): both models' texts coloured by KL and
the activation difference per layer. Figures come from
the builders of :mod:`vlens.plots`. Every view and panel saves what it
shows to one HTML file that needs no kernel: its **save** button, or
``view.snapshot(path)`` / :func:`save_snapshot` from Python.
"""

from __future__ import annotations

from vlens.widgets.activation import ActivationView
from vlens.widgets.attention import AttentionView
from vlens.widgets.branches import BranchView
from vlens.widgets.attribution import AttributionView
from vlens.widgets.clone_reads import CloneReadsToggle
from vlens.widgets.compare import CompareView
from vlens.widgets.diff import DiffView
from vlens.widgets.explorer import Explorer, explore
from vlens.widgets.features import FeatureView
from vlens.widgets.figure import FigureView
from vlens.widgets.logit_lens import LogitLensView
from vlens.widgets.patching import PatchingView
from vlens.widgets.pickers import LayerPicker, SitePicker
from vlens.widgets.selection import Controller, Selection
from vlens.widgets.snapshot import save_snapshot, snapshot_html
from vlens.widgets.steering import SteeringDefaults, SteeringPanel, steering_defaults
from vlens.widgets.token_span import TokenSpanPicker

__all__ = [
    "ActivationView",
    "AttentionView",
    "BranchView",
    "AttributionView",
    "CloneReadsToggle",
    "CompareView",
    "Controller",
    "DiffView",
    "Explorer",
    "FeatureView",
    "FigureView",
    "LayerPicker",
    "LogitLensView",
    "PatchingView",
    "Selection",
    "SitePicker",
    "SteeringDefaults",
    "SteeringPanel",
    "TokenSpanPicker",
    "explore",
    "save_snapshot",
    "snapshot_html",
    "steering_defaults",
]
