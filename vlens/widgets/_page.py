"""What the page is told about vlens's anywidgets while they start.

anywidget gives each widget model 2 s, from the moment the model reaches
the page, to import its module; one that misses it is failed for good
("[anywidget] Failed to initialize model"). The page has one thread, so a
figure's long work (evaluating plotly.js, a large draw) that runs while a
model is importing its module can push that model past its window. The page
cannot see a model coming before its module has started, but the kernel
knows the moment it makes one.

So every vlens anywidget (:class:`StartingWidget`) carries a key of its
own, and the kernel's one :class:`PageRegistry` (a plain widget model, which
has no such window) lists the keys of the live ones, updated as each is
made (just before the model is sent) and closed. Each module marks its key
started when anywidget starts it (its ``initialize``); ``figure.js`` runs
long work only when every key it has seen in the registry has started or is
past its window. Messages reach the page in the order sent and wait while a
long piece runs, so a piece that starts with nothing starting cannot eat
into any model's window.
"""

from __future__ import annotations

import uuid
from typing import Any

import anywidget
import ipywidgets as widgets
import traitlets

__all__ = ["PageRegistry", "StartingWidget", "page_registry"]


class PageRegistry(widgets.Widget):
    """The keys of the kernel's live vlens anywidgets, in the order made.
    (Not ``keys``: that name is ipywidgets' own, the list of synced traits.)"""

    live = traitlets.List(traitlets.Unicode()).tag(sync=True)


_REGISTRY: PageRegistry | None = None


def page_registry() -> PageRegistry:
    """The kernel's one :class:`PageRegistry` (made again if closed)."""
    global _REGISTRY
    if _REGISTRY is None or _REGISTRY.comm is None:
        _REGISTRY = PageRegistry()
    return _REGISTRY


class StartingWidget(anywidget.AnyWidget):
    """An anywidget whose start the page can wait for: its ``_start_key`` is
    listed in the registry that ``_page`` names ("anywidget:<id>") from the
    moment it is made until it is closed."""

    _start_key = traitlets.Unicode("").tag(sync=True)
    _page = traitlets.Unicode("").tag(sync=True)

    def __init__(self, **kwargs: Any) -> None:
        registry = page_registry()
        key = uuid.uuid4().hex
        # listed before the model is sent: the page learns of it first, so
        # no long work can begin between the model's arrival and its listing
        registry.live = [*registry.live, key]
        try:
            super().__init__(_start_key=key, _page=f"anywidget:{registry.model_id}", **kwargs)
        except BaseException:
            registry.live = [k for k in registry.live if k != key]
            raise

    def close(self) -> None:
        registry = _REGISTRY
        if registry is not None and registry.comm is not None and self._start_key in registry.live:
            registry.live = [k for k in registry.live if k != self._start_key]
        super().close()
