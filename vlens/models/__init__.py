"""Models that ship inside vlens.

``toyworld`` is a ~1M-parameter Llama trained by ``scripts/train_toyworld.py``
on the synthetic stories of :mod:`vlens.models.world`. Importing this package
is cheap: nothing here imports torch or transformers.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["toyworld_path"]

_TOYWORLD = Path(__file__).resolve().parent / "toyworld"


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
