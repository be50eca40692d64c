"""Models that ship inside vlens.

``toyworld`` is a 9M-parameter Llama trained by ``scripts/train_toyworld.py``
on the synthetic stories of :mod:`vlens.models.world`; ``toychat`` is it
fine-tuned into a chat model that refuses one class of request
(:mod:`vlens.models.chat_world`, ``scripts/train_toychat.py``). Importing this package
is cheap: nothing here imports torch or transformers.

Models that do not ship inside vlens but can be fetched and prepared offline
are in :mod:`vlens.models.registry`: ``get(name)`` (fetch once, then the
folder), ``available()`` (what there is, and whether it is here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlens.models.registry import available, get, is_here, resolve

__all__ = ["CHAT_RECIPE", "COPY_HEAD", "RECIPE", "available", "get", "is_here", "resolve",
           "toychat_path", "toyworld_path", "toyworld_sae_path"]

#: The bundled model's sentiment-steering recipe, as data, for the docs, the
#: notebooks, the demo and the steering widget's defaults (docs/toyworld.md).
#: The direction is ``session.direction(*world.sentiment_prompts(),
#: layer=RECIPE["layer"], span=RECIPE["direction_span"])`` (happy minus sad); to
#: steer, ``vlens.Steer(d, layer=RECIPE["layer"], scale=RECIPE["scale"],
#: site=RECIPE["site"], relative=RECIPE["relative"])`` (``-d`` turns happy
#: stories sad). ``window`` is the range of scales over which this direction
#: flips >= 90% of held-out stories and keeps >= 90% well-formed, both ways
#: (measured by scripts/eval_toyworld.py, which also measures every other
#: layer and the natural contrast ``world.mood_contrast_prompts()``).
RECIPE: dict[str, Any] = {
    "layer": 3,
    "scale": 0.75,
    "relative": True,
    "site": "resid_post",
    "direction_span": "last",
    "prompts": "world.sentiment_prompts",
    "window": (0.5, 1.25),
}

#: (layer, head) of the bundled model's animal-copying head: from the token
#: before the animal's second mention it attends to the first mention
#: (scripts/eval_toyworld.py, docs/toyworld.md).
COPY_HEAD: tuple[int, int] = (0, 5)

#: The bundled chat model's refusal direction (docs/toyworld.md, "Chat"):
#: ``d = s.direction(*chat_world.refusal_contrast(CHAT_RECIPE["pairs"]),
#: layer=CHAT_RECIPE["layer"])`` (forbidden minus allowed requests,
#: ``resid_post`` at the last prompt token). ``vlens.Ablate("resid_post",
#: "all", direction=d)`` makes the model tell forbidden stories; ``vlens.Steer(d,
#: layer=CHAT_RECIPE["layer"], scale=CHAT_RECIPE["add_scale"],
#: span=CHAT_RECIPE["add_span"])`` (added at the prompt's tokens) makes it
#: refuse allowed ones (measured by ``scripts/eval_toyworld.py --chat``).
CHAT_RECIPE: dict[str, Any] = {
    "layer": 3,
    "site": "resid_post",
    "direction_span": "last",
    "pairs": 64,
    "add_scale": 1.5,
    "add_span": "prompt",
    "ablate_layers": "all",
}

_TOYWORLD = Path(__file__).resolve().parent / "toyworld"
_TOYCHAT = Path(__file__).resolve().parent / "toychat"


def toyworld_path() -> Path:
    """The folder holding the bundled toyworld model (config, weights, tokenizer).

    Pass it to ``vllm.LLM(model=...)`` or ``AutoModelForCausalLM.from_pretrained``.
    """
    if not (_TOYWORLD / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled toyworld model is missing from {_TOYWORLD}; "
            "rebuild it with `python scripts/train_toyworld.py`"
        )
    return _TOYWORLD


def toychat_path() -> Path:
    """The bundled chat model (toy world v3): the toyworld model fine-tuned by
    ``scripts/train_toychat.py`` to answer requests with stories, and to
    refuse a story about a wild animal by the water
    (:mod:`vlens.models.chat_world`). Its tokenizer carries the chat template."""
    if not (_TOYCHAT / "config.json").is_file():
        raise FileNotFoundError(f"the bundled chat model is missing from {_TOYCHAT}; "
                                "rebuild it with `python scripts/train_toychat.py`")
    return _TOYCHAT


def toyworld_sae_path() -> Path:
    """The bundled model's sparse autoencoder (``resid_post`` of the recipe's
    layer, SAELens's format; ``vlens.SAE.load(toyworld_sae_path())``), trained
    by ``scripts/train_sae.py`` (docs/features.md)."""
    path = Path(__file__).resolve().parent / "toyworld_sae"
    if not (path / "cfg.json").is_file():
        raise FileNotFoundError(f"the bundled SAE is missing from {path}; "
                                "rebuild it with `python scripts/train_sae.py`")
    return path
