"""Widgets for looking inside a vlens Session from Jupyter.

Every widget calls only the Session API and draws with the builders of
:mod:`vlens.plots`. Import this package explicitly (``import vlens`` does not
load ipywidgets or plotly's widget layer)::

    from vlens.widgets import explore
    explore(session, "once upon a time")

Each widget works alone; :func:`explore` composes them around one shared
layer and token span.
"""

from __future__ import annotations

from vlens.widgets.activation import ActivationView
from vlens.widgets.clone_reads import CloneReadsToggle
from vlens.widgets.explorer import Explorer, explore
from vlens.widgets.logit_lens import LogitLensView
from vlens.widgets.pickers import LayerPicker, SitePicker
from vlens.widgets.steering import SteeringPanel
from vlens.widgets.token_span import TokenSpanPicker

__all__ = [
    "ActivationView",
    "CloneReadsToggle",
    "Explorer",
    "LayerPicker",
    "LogitLensView",
    "SitePicker",
    "SteeringPanel",
    "TokenSpanPicker",
    "explore",
]
