"""The engine layer: a vLLM ``LLM`` plus vlens's worker extension.

Importing this package does not import vLLM; :class:`Engine` does, when made.
"""

from vlens.engine.engine import EXTENSION, Engine

__all__ = ["Engine", "EXTENSION"]
