"""What a Session can ask of a ``vlens serve`` server by name: its SAEs
(``s.sae(name)``) and this participant's own vectors
(``s.register_vector(name, tensor)``) and presets
(``s.register_preset(name, body)``), which OpenAI-style calls made with
the same token can then name (``docs/openai.md``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vlens.errors import VlensError
from vlens.methods.sae import SAE
from vlens.models import registry, toyworld_sae_path

__all__ = ["local_sae", "server"]


def server(engine: Any, what: str) -> Any:
    """``engine`` when it is a ``vlens serve`` server, else a clear error."""
    if not getattr(engine, "remote", False):
        raise VlensError(f"{what} is for a session on a vlens serve server "
                         "(vlens.connect); here, use the object itself")
    return engine


def local_sae(name: Any, model: str) -> Any:
    """The SAE ``name`` of a local session: a path to an SAE folder or file
    (SAELens's layout or vlens's ``.npz``), ``"toyworld-sae"`` (the bundled
    one, as ``vlens path`` names it), an SAE's name in vlens's registry
    (``"smollm2-135m-instruct-sae"``: ``vlens models list``), or the name of
    an SAE kept with the session's model (a folder ``saes/NAME`` beside its
    weights). A local path of the same name wins over a registry name."""
    if not isinstance(name, (str, os.PathLike)):
        raise VlensError(f"s.sae takes an SAE's name or path, got {type(name).__name__}")
    path = toyworld_sae_path() if name == "toyworld-sae" else Path(name)
    entry = registry.REGISTRY.get(name) if isinstance(name, str) else None
    if isinstance(entry, registry.Bundled) and not path.exists():
        path = registry.get(name)
    bundled = Path(model) / "saes" / str(name)
    if not path.exists() and bundled.exists():
        path = bundled
    if not path.exists():
        have = sorted(p.name for p in (Path(model) / "saes").glob("*")) if (
            Path(model) / "saes").is_dir() else []
        raise VlensError(f"no SAE {str(name)!r}: give a path to an SAE (vlens path "
                         f"toyworld-sae for the bundled one)"
                         + (f", or one of this model's: {have}" if have else ""))
    return SAE.load(path)
