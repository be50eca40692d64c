"""vlens: look inside a model served by vLLM, from a notebook.

``import vlens`` is cheap: vLLM is imported only when a :class:`Session`
starts an engine.

    import vlens
    s = vlens.Session()                    # the bundled toy-world model
    run = s.trace(["the cat"], layers=[0, 2], sites=["resid_post"])
    run[0].activations("resid_post")       # [layers, tokens, hidden]
    vlens.explore(s, "the cat")            # widgets (needs ipywidgets)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlens.errors import ClosedError, EngineError, TokenAxisError, VlensError

if TYPE_CHECKING:
    from vlens.ablation import Ablate
    from vlens.methods.patching import Patching
    from vlens.protocol.plan import EditContext
    from vlens.results import Run, Trace
    from vlens.session import Session
    from vlens.protocol.architectures import supported_architectures
    from vlens.steering import PerPrompt, Steer
    from vlens.widgets import explore
    from vlens.remote.client import connect

__all__ = [
    "Ablate",
    "ClosedError",
    "EditContext",
    "EngineError",
    "Patching",
    "PerPrompt",
    "Run",
    "Session",
    "Steer",
    "TokenAxisError",
    "Trace",
    "connect",
    "VlensError",
    "__version__",
    "explore",
    "supported_architectures",
]

__version__ = "0.1.0"

_LAZY = {
    "Ablate": "vlens.ablation",
    "Patching": "vlens.methods.patching",
    "EditContext": "vlens.protocol.plan",
    "PerPrompt": "vlens.steering",
    "Session": "vlens.session",
    "Steer": "vlens.steering",
    "Run": "vlens.results",
    "Trace": "vlens.results",
    "explore": "vlens.widgets",
    "connect": "vlens.remote.client",
    "supported_architectures": "vlens.protocol.architectures",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlens' has no attribute {name!r}")
