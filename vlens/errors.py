"""The exceptions vlens raises on purpose.

Every error vlens raises for bad input or a step it could not place is a
:class:`VlensError` (a ``ValueError``), so a notebook can catch one class.
Messages say what was wrong and what would be right.
"""

from __future__ import annotations

__all__ = ["VlensError", "FieldError", "TokenAxisError", "EngineError", "ClosedError",
           "VlensWarning"]


class VlensError(ValueError):
    """Bad input or an unusable request, caught before or after a run."""


class FieldError(VlensError):
    """Bad input about one field of an edit: ``field`` names it (``layer``,
    ``span``, ``heads`` ...), so a body's error can say ``vlens.steer[0].layer``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class EngineError(RuntimeError):
    """Something went wrong inside the engine's workers while serving a run."""


class ClosedError(VlensError):
    """The session (or its engine) has been closed."""


class TokenAxisError(VlensError):
    """A tensor's token axis could not be found, or a span does not fit it
    (raised by the row layout, ``vlens.worker.layout``; a ValueError like
    every input error)."""


class VlensWarning(UserWarning):
    """Something vlens could not do exactly as asked, and said so: for
    example a steer on generated tokens that covered none because the
    request stopped first (the run is kept; its ``steered_rows`` is 0)."""
