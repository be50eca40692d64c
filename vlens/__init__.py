"""vlens: look inside a model served by vLLM, from a notebook.

``import vlens`` is cheap: vLLM is imported only when a :class:`Session`
starts an engine.

    import vlens
    s = vlens.Session()                    # the bundled toy-world model
    s = vlens.open_session(server=url)     # or a workshop's server (None: local)
    run = s.trace(["the cat"], layers=[0, 2], sites=["resid_post"])
    run[0].activations("resid_post")       # [layers, tokens, hidden]
    vlens.explore(s, "the cat")            # widgets (needs ipywidgets)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlens.errors import ClosedError, EngineError, TokenAxisError, VlensError, VlensWarning

if TYPE_CHECKING:
    from vlens.results.patching import Patching
    from vlens.results.harvest import Harvest
    from vlens.methods.twin import Twin
    from vlens.results.saliency import Saliency
    from vlens.results.branches import Branches
    from vlens.results.attribution import Attribution
    from vlens.protocol.plan import EditContext
    from vlens.results import Run, Trace
    from vlens.session import Session
    from vlens.protocol.architectures import supported_architectures
    from vlens.edits import Ablate, PerPrompt, Steer
    from vlens.methods.sae import SAE, Clamp
    from vlens.results import Comparison, Sweep
    from vlens.widgets import FeatureView, explore
    from vlens._open import connect, open_session
    from vlens.sae_training import train_sae

__all__ = [
    "Ablate",
    "Attribution",
    "AttributionView",
    "BranchView",
    "Branches",
    "Clamp",
    "ClosedError",
    "CompareView",
    "Comparison",
    "Diff",
    "DiffView",
    "EditContext",
    "EngineError",
    "FeatureView",
    "Harvest",
    "Patching",
    "PatchingView",
    "PerPrompt",
    "Run",
    "SAE",
    "Saliency",
    "Session",
    "Steer",
    "Sweep",
    "TokenAxisError",
    "Trace",
    "Twin",
    "connect",
    "diff",
    "VlensError",
    "VlensWarning",
    "__version__",
    "explore",
    "open_session",
    "supported_architectures",
    "train_sae",
]

__version__ = "0.1.0"

_LAZY = {
    "Ablate": "vlens.edits",
    "Patching": "vlens.results.patching",
    "Harvest": "vlens.results.harvest",
    "Attribution": "vlens.results.attribution",
    "EditContext": "vlens.protocol.plan",
    "PerPrompt": "vlens.edits",
    "SAE": "vlens.methods.sae",
    "Clamp": "vlens.methods.sae",
    "Session": "vlens.session",
    "Steer": "vlens.edits",
    "Run": "vlens.results",
    "Trace": "vlens.results",
    "Comparison": "vlens.results",
    "Sweep": "vlens.results",
    "explore": "vlens.widgets",
    "FeatureView": "vlens.widgets",
    "CompareView": "vlens.widgets",
    "DiffView": "vlens.widgets",
    "Diff": "vlens.results.diff",
    "diff": "vlens.methods.diff",
    "PatchingView": "vlens.widgets",
    "AttributionView": "vlens.widgets",
    "BranchView": "vlens.widgets",
    "Branches": "vlens.results.branches",
    "Twin": "vlens.methods.twin",
    "Saliency": "vlens.results.saliency",
    "connect": "vlens._open",
    "open_session": "vlens._open",
    "supported_architectures": "vlens.protocol.architectures",
    "train_sae": "vlens.sae_training",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlens' has no attribute {name!r}")
