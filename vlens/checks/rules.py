"""The rules of an edit, each written once, for every way an edit arrives.

A steering write is the same thing whether a notebook made a
:class:`~vlens.Steer`, a client sent a plan's ``Add`` to ``vlens serve``, or
an OpenAI body named a vector (``{"vlens": {"steer": [...]}}``): a writable
(site, layer) of this model, a vector as wide as the site's rows, a finite
scale, and a write that stays inside the model's number range. The
Session's checks (:mod:`vlens.checks`), the plan checks the server's guard
runs (:mod:`vlens.checks.plans`) and the OpenAI body parser
(:mod:`vlens.remote.body`) all call :func:`steer`; an edit's form (types,
finite values, its span's shape) is the object's own (``Steer.__post_init__``).

``CALLS`` counts each rule's calls in this process (a test holds the
checking to once per edit; ``vlens serve`` shows its counts on
``/metrics``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vlens.checks.facts import ModelFacts, check_write_site, check_write_size, is_int
from vlens.errors import VlensError

__all__ = ["CALLS", "steer"]

#: how many times each rule ran in this process, by rule name
CALLS: Counter = Counter()


def steer(what: str, site: Any, layer: Any, width: int, peak: float, scale: Any,
          relative: bool, facts: ModelFacts, *, feature: Any = None) -> None:
    """A steering write that fits this model: ``site`` at ``layer`` takes
    writes, the vector (``width`` values, the largest ``peak`` in size)
    is as wide as the site's rows, the scale is a number, and ``vector *
    scale`` (or, ``relative``, that fraction of each row's norm) stays
    inside the model's range. A clamp (``feature``: an SAE feature) is not
    relative and names a feature >= 0. ``what`` names the edit in errors."""
    CALLS["steer"] += 1
    if not is_int(layer):
        raise VlensError(f"{what}: the layer must be an int, got {layer!r:.20}")
    check_write_site("Steer", site, layer, facts)
    expected = facts.width(site)
    if width != expected:
        if site == "z":
            raise VlensError(
                f"{what}: a Steer at z needs a vector of heads * head_dim = {facts.n_heads} * "
                f"{facts.head_dim} = {expected} elements (one slice per head), got {width}")
        raise VlensError(
            f"{what}: the vector has {width} elements but {site} rows of this model have "
            f"{expected} (its hidden size is {facts.hidden_size}): compute it on this model "
            "(s.direction)")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise VlensError(f"{what}: the scale must be a number, got {scale!r:.20}")
    check_write_size(what, peak, float(scale), bool(relative), facts)
    if feature is not None and (relative or not is_int(feature) or feature < 0):
        raise VlensError(f"{what}: a clamp names a feature (an int >= 0) and is not relative")
