"""One engine for many notebooks: ``vlens serve`` (server.py) and
``vlens.connect`` (client.py). Nothing here imports vLLM on the client
side until a call builds its sampling settings."""

from vlens.remote.client import connect

__all__ = ["connect"]
