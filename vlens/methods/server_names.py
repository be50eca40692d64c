"""What a Session can ask of a ``vlens serve`` server by name: its SAEs
(``s.sae(name)``) and this participant's own vectors
(``s.register_vector(name, tensor)``) and presets
(``s.register_preset(name, body)``), which OpenAI-style calls made with
the same token can then name (``docs/openai.md``)."""

from __future__ import annotations

from typing import Any

from vlens.errors import VlensError

__all__ = ["ServerNamed"]


class ServerNamed:
    """Methods of :class:`vlens.Session` for a connected session."""

    def _server(self, what: str) -> Any:
        engine = self.engine  # type: ignore[attr-defined]
        if not getattr(engine, "remote", False):
            raise VlensError(f"{what} is for a session on a vlens serve server "
                             "(vlens.connect); here, use the object itself")
        return engine

    def sae(self, name: str) -> Any:
        """The server's SAE ``name`` (``vlens serve --sae NAME=PATH``) as a
        :class:`~vlens.SAE`: read its features (``saes=``), steer
        (``sae.steer(i)``) and clamp (``vlens.Clamp``) with it as with a
        local one. ``s.engine.saes`` lists them."""
        return self._server("s.sae(name)").sae(name)

    def register_vector(self, name: str, vector: Any) -> int:
        """Keep ``vector`` ``[width]`` on the server as ``name``, for calls
        made with this session's token only (OpenAI-style bodies name it:
        ``{"vlens": {"steer": [{"vector": name, ...}]}}``). Registering a
        name again replaces its vector. Returns how many you hold."""
        return self._server("s.register_vector").register_vector(name, vector)

    def register_preset(self, name: str, body: dict[str, Any]) -> str:
        """Keep ``body``, a ``vlens`` object (``{"steer": [...]}``, as in an
        OpenAI body), as preset ``name`` for this session's token, and return
        the base URL that applies it to every OpenAI call: give it to a client
        that can set only ``base_url`` and a key (``lm_eval``, a chat UI).
        Vectors it names are looked up when each call runs."""
        engine = self._server("s.register_preset")
        engine.register_preset(name, body)
        return f"{engine.url}/presets/{name}/v1"
