"""Where a steering panel starts, per model: the bundled model's tested
recipe (read from :mod:`vlens.models.recipes`, the one place it is written
down), or, on any other model, plain defaults and a note saying what to set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlens.models.recipes import steering_recipe

__all__ = ["SteeringDefaults", "steering_defaults"]


@dataclass(frozen=True)
class SteeringDefaults:
    """Where a steering panel starts. ``positive`` / ``negative`` / ``prompt``
    are filled (and used when the panel is given none) only where a tested
    recipe exists; ``note`` is shown in the panel either way."""

    layer: int
    scale: float
    relative: bool
    scales: tuple[float, ...]
    site: str = "resid_post"
    #: the steer's span: "all", "prompt" or "generated"
    span: str = "all"
    positive: tuple[str, ...] = ()
    negative: tuple[str, ...] = ()
    prompt: str | None = None
    max_new_tokens: int = 16
    note: str = ""
    from_recipe: bool = False


_NO_RECIPE = (
    "No tested recipe for this model. To find one: type two prompt lists that differ "
    "only in the concept (one prompt per line, each cut where the concept shows next), "
    "start at a late layer with <i>relative to |x|</i> on and scale about 1, then "
    "sweep the scale and look for where the text changes before it falls apart."
)


def steering_defaults(session: Any) -> SteeringDefaults:
    """Where a panel (and an explorer's layer) starts on ``session``'s model.

    On the bundled model: its documented sentiment recipe, read from
    :func:`vlens.models.recipes.steering_recipe` (layer, scale, relative,
    span, the two prompt sets, a sad example that flips). Elsewhere: the middle
    layer, scale 4, an absolute push, and a note saying what to set."""
    r = steering_recipe(session)
    if r is None:
        return SteeringDefaults(layer=session.n_layers // 2, scale=4.0, relative=False,
                                scales=(-8.0, -4.0, 0.0, 4.0, 8.0), note=_NO_RECIPE)
    return SteeringDefaults(
        layer=r.layer, scale=r.scale, relative=r.relative, scales=r.scales, site=r.site,
        span=r.span, positive=r.positive, negative=r.negative, prompt=r.example,
        max_new_tokens=r.max_new_tokens, from_recipe=True,
        note=(f"Starts from {r.note}. Press <b>run</b> on a {r.example_from} story: "
              f"it should turn {r.example_to} (a negative scale goes the other way)."),
    )
