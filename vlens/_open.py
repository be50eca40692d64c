"""``vlens.open_session``: one call that gives a notebook its Session, either
an engine of its own or a connection to a workshop's ``vlens serve``.

Notebooks end with the same code either way; only their parameters (or the
environment a JupyterHub hands them) say which. Nothing here imports the
engine: a connected notebook never loads vLLM's engine code.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["open_session", "server_from_env"]


def server_from_env(server: str | None = None) -> str | None:
    """``server``, else ``$VLENS_SERVER``; None (or blank) means a local engine."""
    if server is None:
        server = os.environ.get("VLENS_SERVER")
    server = (server or "").strip()
    return server or None


def open_session(model: Any = None, *, server: str | None = None, token: str | None = None,
                 **engine_options: Any):
    """A :class:`~vlens.Session`: connected to ``server`` when one is named
    (``server=`` or ``$VLENS_SERVER``, with ``token=`` or ``$VLENS_TOKEN``),
    else one that starts ``model`` here with ``engine_options`` (as
    ``vlens.Session(model, **engine_options)``).

    Connected, the server's model answers: ``model`` and ``engine_options``
    say what a local run would start and are not used (the server was
    started with its own; ``s.model`` names it)."""
    url = server_from_env(server)
    if url is not None:
        from vlens.remote.client import connect

        return connect(url, token)
    from vlens.session import Session

    return Session(model, **engine_options)
