"""What works on the bundled model, as data: the one place that says it.

The steering panel's defaults, notebook 02, the demo and the tests read the
recipe from here, so retraining the bundled model (and finding that another
layer or scale now works best) means changing this file and nothing else.
The numbers come from the sweep in ``docs/toyworld.md`` ("Steering").

Pure Python, like :mod:`vlens.models.world`: importing it loads neither
torch nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import vlens
from vlens.models import RECIPE, toyworld_path, world

__all__ = ["SteeringRecipe", "is_toyworld", "steering_recipe", "toyworld_recipe"]


@dataclass(frozen=True)
class SteeringRecipe:
    """A steering setting known to work on one model.

    Turn it into a steer with ``d = s.direction(recipe.positive,
    recipe.negative, layer=recipe.layer, site=recipe.site,
    span=recipe.direction_span)`` and ``vlens.Steer(d, layer=recipe.layer,
    scale=recipe.scale, site=recipe.site, span=recipe.span,
    relative=recipe.relative)`` (:meth:`steer` does both).

    * ``positive`` / ``negative`` -- the two prompt sets (minimal pairs);
      the direction is ``mean(positive) - mean(negative)``;
    * ``example`` -- a prompt the steer visibly changes, ``example_from``
      -> ``example_to`` (as :func:`vlens.models.world.sentiment_of` judges
      the continuation);
    * ``held_out(sentiment, n)`` -- prompts never used to find the
      direction, to count flips on;
    * ``scales`` -- a sweep around ``scale`` that shows the whole window
      (too weak, working, too strong);
    * ``max_new_tokens`` -- enough new tokens for the effect to show.
    """

    name: str
    layer: int
    scale: float
    relative: bool
    site: str
    span: str
    #: the tokens the direction's means are taken over (``direction(span=)``)
    direction_span: str
    positive: tuple[str, ...]
    negative: tuple[str, ...]
    example: str
    example_from: str
    example_to: str
    scales: tuple[float, ...]
    max_new_tokens: int
    note: str

    def held_out(self, sentiment: str, n: int = 100) -> list[str]:
        """``n`` held-out openings of ``sentiment`` (``"happy"`` / ``"sad"``)."""
        return world.steering_prompts(sentiment, n)

    def steer(self, session: Any, scale: float | None = None) -> Any:
        """The recipe's :class:`vlens.Steer` on ``session`` (one direction call)."""
        d = session.direction(list(self.positive), list(self.negative), layer=self.layer,
                              site=self.site, span=self.direction_span)
        return vlens.Steer(d, layer=self.layer, scale=self.scale if scale is None else scale,
                           site=self.site, span=self.span, relative=self.relative)


def toyworld_recipe() -> SteeringRecipe:
    """Sentiment steering on the bundled toyworld model: the difference of
    means of :func:`~vlens.models.world.sentiment_prompts` at a middle
    layer, added relative to each token's norm (docs/toyworld.md)."""
    # RECIPE: the measured values (scripts/eval_toyworld.py)
    happy, sad = world.sentiment_prompts(64)
    return SteeringRecipe(
        name="toyworld sentiment",
        layer=RECIPE["layer"],
        scale=RECIPE["scale"],
        relative=RECIPE["relative"],
        site=RECIPE["site"],
        span="all",
        direction_span=RECIPE["direction_span"],
        positive=tuple(happy),
        negative=tuple(sad),
        example=world.steering_prompts(world.SAD, 1)[0],
        example_from=world.SAD,
        example_to=world.HAPPY,
        # too weak (0.25), inside the window (0.75, 1.25), too strong (2)
        scales=(-2.0, -1.25, -0.75, -0.25, 0.0, 0.25, 0.75, 1.25, 2.0),
        max_new_tokens=56,  # a story needs at most 51 tokens after its opening
        note=(f"the bundled model's sentiment recipe: happy minus sad at layer "
              f"{RECIPE['layer']}, relative scale {RECIPE['scale']:g} (docs/toyworld.md)"),
    )


def is_toyworld(model: str | Path | None) -> bool:
    """True when ``model`` (a Session's ``model`` path) is the bundled model."""
    if model is None:
        return True
    try:
        return Path(model).resolve() == toyworld_path().resolve()
    except (OSError, FileNotFoundError):
        return False


def steering_recipe(session: Any) -> SteeringRecipe | None:
    """The recipe for ``session``'s model, or None when none is known (a
    connected session's server says whether it serves the bundled model)."""
    bundled = is_toyworld(getattr(session, "model", ""))
    if not bundled:
        try:
            bundled = bool((session.info or {}).get("toyworld"))
        except Exception:  # noqa: BLE001 - no info (a closed session, a stand-in): no recipe
            bundled = False
    return toyworld_recipe() if bundled else None
