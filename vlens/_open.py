"""``vlens.open_session``: one call that gives a notebook its Session, either
an engine of its own or a connection to a workshop's ``vlens serve``
(``vlens.connect``).

Notebooks end with the same code either way; only their parameters (or the
environment a JupyterHub hands them) say which. Nothing here imports the
engine: a connected notebook never loads vLLM's engine code.
"""

from __future__ import annotations

import os
from typing import Any

from vlens.errors import VlensError
from vlens.remote.client import RemoteEngine
from vlens.session import Session

__all__ = ["connect", "open_session", "server_from_env"]


def server_from_env(server: str | None = None) -> str | None:
    """``server``, else ``$VLENS_SERVER``; None (or blank) means a local engine."""
    if server is None:
        server = os.environ.get("VLENS_SERVER")
    server = (server or "").strip()
    return server or None


def connect(url: str = "http://127.0.0.1:8765", token: str | None = None, *,
            timeout: float = 30.0):
    """A :class:`~vlens.Session` on a ``vlens serve`` server: the same API,
    with the server's model. ``token``: yours (default: ``$VLENS_TOKEN``).

    Differences from a local Session: ``edit=`` functions are refused (code
    does not cross the wire: use ``Steer``, ``Ablate`` or patching), and the
    server's limits (read bytes per call, calls at once, prompt length)
    apply; ``s.engine.limits`` shows them."""
    token = token if token is not None else os.environ.get("VLENS_TOKEN")
    if not token:
        raise VlensError("vlens.connect needs token=... (or $VLENS_TOKEN): "
                         "the server's operator gives each participant one")
    token = token.strip()  # a token pasted or read from a file with its newline
    if not token or not token.isascii() or not token.isprintable() or " " in token:
        raise VlensError("the token holds spaces, control or non-ASCII characters: copy it "
                         "again exactly as the workshop's operator gave it (it is not shown "
                         "here)")
    return Session.on_engine(RemoteEngine(url, token, timeout=timeout))


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
        return connect(url, token)
    return Session(model, **engine_options)
