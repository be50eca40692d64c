"""The rules of an edit, each written once, for every way an edit arrives.

A steering write is the same thing whether a notebook made a
:class:`~vlens.Steer`, a client sent a plan's ``Add`` to ``vlens serve``, or
an OpenAI body named a vector (``{"vlens": {"steer": [...]}}``): a writable
(site, layer) of this model, a vector as wide as the site's rows, a finite
scale, and a write that stays inside the model's number range. The
Session's checks (:mod:`vlens.checks`), the plan checks the server's guard
runs (:mod:`vlens.checks.plans`) and the OpenAI body parser
(:mod:`vlens.edit_schema`) all call :func:`steer`; an ablation meets
:func:`ablate` once, on the Session's side (``methods.ablation.check_ablate``)
and on an OpenAI body (``BodyEdits.fit``) alike. An edit's form (types,
finite values, its span's shape) is its typed model's
(:mod:`vlens.edit_schema`), which the edit objects and the body share.

``CALLS`` counts each rule's calls in this process (a test holds the
checking to once per edit; ``vlens serve`` shows its counts on
``/metrics``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vlens.checks.facts import (ModelFacts, check_set_values, check_write_site,
                                check_write_size, is_int)
from vlens.errors import FieldError, VlensError

__all__ = ["CALLS", "RuleError", "ablate", "steer"]

#: how many times each rule ran in this process, by rule name
CALLS: Counter = Counter()


class RuleError(FieldError):
    """A rule refused an edit; ``field`` names the edit's field it is about
    (``layer``, ``site``, ``vector``, ``scale``, ``heads``, ``mean``,
    ``direction``), so a body's error can name ``vlens.steer[0].layer``."""


def _site_at(what: str, site: Any, layer: Any, facts: ModelFacts) -> None:
    try:
        check_write_site(what, site, layer, facts)
    except VlensError as exc:
        field = "layer" if f"layer {layer} does not exist" in str(exc) else "site"
        raise RuleError(field, str(exc)) from None


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
        raise RuleError("layer", f"{what}: the layer must be an int, got {layer!r:.20}")
    _site_at("Steer", site, layer, facts)
    expected = facts.width(site)
    if width != expected:
        if site == "z":
            raise RuleError("vector",
                f"{what}: a Steer at z needs a vector of heads * head_dim = {facts.n_heads} * "
                f"{facts.head_dim} = {expected} elements (one slice per head), got {width}")
        raise RuleError(
            "vector",
            f"{what}: the vector has {width} elements but {site} rows of this model have "
            f"{expected} (its hidden size is {facts.hidden_size}): compute it on this model "
            "(s.direction)")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise RuleError("scale", f"{what}: the scale must be a number, got {scale!r:.20}")
    try:
        check_write_size(what, peak, float(scale), bool(relative), facts)
    except VlensError as exc:
        raise RuleError("scale", str(exc)) from None
    if feature is not None and (relative or not is_int(feature) or feature < 0):
        raise RuleError("feature", f"{what}: a clamp names a feature (an int >= 0) and is not "
                                   "relative")


def ablate(what: str, site: Any, layer: Any, heads: Any, mean: tuple[int, float] | None,
           direction: int | None, facts: ModelFacts) -> None:
    """An ablation that fits this model: ``site`` at ``layer`` takes writes;
    ``heads`` (query heads, or None: the whole row) only at ``z`` and each
    one of the model's; a replacement ``mean`` (``(width, largest |value|)``)
    as wide as the site's rows and inside the model's range; a ``direction``
    (its width) as wide as the rows. ``what`` names the edit in errors."""
    CALLS["ablate"] += 1
    _site_at("Ablate", site, layer, facts)
    if heads is not None:
        if site != "z":
            raise RuleError(
                "heads",
                f"{what}: heads= is for site 'z' (each head's output before o_proj); site "
                f"{site!r} mixes the heads: use site='z', or drop heads= to ablate the row")
        if max(heads) >= facts.n_heads:
            raise RuleError("heads", f"{what}: heads {list(heads)}: this model has "
                                     f"{facts.n_heads} heads, numbered 0 to {facts.n_heads - 1}")
    width = facts.width(site)  # z: heads * head_dim; the others: hidden
    if mean is not None:
        if mean[0] != width:
            raise RuleError("mean", f"{what}: the mean has {mean[0]} elements; site {site!r} "
                                    f"rows have {width}")
        try:
            check_set_values(f"{what} mean", mean[1], facts)
        except VlensError as exc:
            raise RuleError("mean", str(exc)) from None
    if direction is not None and direction != width:
        raise RuleError("direction", f"{what}: the direction has {direction} values; site "
                                     f"{site!r} rows have {width}: take the direction at the "
                                     "site it is ablated from")
