"""Progress of an engine run, as vLLM's offline loop reports it.

``LLM.generate(use_tqdm=factory)`` calls ``factory(total=..., ...)`` and then
``update(n)`` each time requests finish. :class:`Progress` is such an object:
it can drive a ``tqdm.auto`` bar (a widget bar in notebooks) and/or call a
user callback ``fn(done, total)``. A callback that raises (KeyboardInterrupt
included) stops the run between engine steps; the engine then aborts what
is left (see ``Engine.generate``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vlens.errors import VlensError

__all__ = ["Progress", "Stages", "progress_factory"]


class Progress:
    def __init__(self, total: int, callback: Callable[[int, int], Any] | None = None,
                 bar: bool = False, desc: str = "vlens") -> None:
        self.n = 0
        self.total = int(total)
        self.postfix = ""
        self._t0 = time.perf_counter()
        self._callback = callback
        self._bar = None
        if bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, desc=desc, leave=False)

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(time.perf_counter() - self._t0, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        if self._callback is not None:
            self._callback(self.n, self.total)

    def refresh(self) -> None:
        if self._bar is not None:
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _checked(progress: Any) -> bool:
    """Whether ``progress`` asks for any reporting (raises if it is no valid value)."""
    if progress is None or progress is False:
        return False
    if progress is True or callable(progress):
        return True
    raise VlensError(
        f"progress must be True, False/None, or a function fn(done, total); got {progress!r}"
    )


def progress_factory(progress: Any, desc: str = "vlens"):
    """``progress``: None/False (quiet), True (a tqdm.auto bar), or a
    callable ``fn(done, total)``. Returns what vLLM's ``use_tqdm`` takes
    (and ``Runner.stream`` calls with ``total=`` only).

    vLLM also wraps plain iterables with it (while it renders prompts);
    those pass through unreported."""
    if _checked(progress):
        def factory(iterable: Any = None, *, total: int | None = None, **_: Any):
            if total is None:
                return iterable
            if progress is True:
                return Progress(total, bar=True, desc=desc)
            return Progress(total, callback=progress)

        return factory
    return None


class Stages:
    """One ``progress=`` over consecutive engine calls (``patch``: the read
    pass, then the cell batch) with one known ``total``: :meth:`at` gives
    each call its own ``fn(done, total)``, counting on from ``offset``."""

    def __init__(self, progress: Any, total: int, desc: str = "vlens") -> None:
        self._progress = None
        if _checked(progress):
            self._progress = Progress(total, bar=progress is True, desc=desc,
                                      callback=None if progress is True else progress)

    def at(self, offset: int) -> Callable[[int, int], None] | None:
        """The ``progress=`` of the call whose requests come after ``offset``."""
        p = self._progress
        if p is None:
            return None

        def report(done: int, _total: int) -> None:
            if offset + done > p.n:
                p.update(offset + done - p.n)

        return report

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
