"""Steering by URL: named ``vlens`` bodies served under ``/presets/NAME/v1``.

A client that lets its user set only a base URL and a key (an evaluation
harness's loglikelihood requests, a chat UI, an agent framework) cannot
put a ``vlens`` object in its bodies. A preset is such an object with a
name: ``vlens serve --preset happy=happy.json`` for everyone, or
``s.register_preset("happy", body)`` on a connected session for that
participant's token only (a participant's own name shadows the server's).
``base_url=http://HOST:8765/presets/happy/v1`` then steers every
completion and chat request of that client. A request that carries a
``vlens`` object of its own adds its entries after the preset's.

Presets are kept as the JSON the user wrote and parsed with every request
(the same checks as a body's), so the vectors they name are looked up when
the request runs.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from vlens.edit_schema import NAME
from vlens.remote.schema import BODY_KEYS
from vlens.errors import VlensError

__all__ = ["Presets", "load_presets", "merge"]

#: presets one participant may hold
MAX_OWN = 16
#: bytes of one preset's JSON
MAX_BYTES = 64 * 1024


def _checked(name: Any, body: Any, check: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise VlensError(f"a preset name is 1-64 of A-Z a-z 0-9 _ . -, got {name!r:.70}")
    if not isinstance(body, dict) or not body:
        raise VlensError(f"preset {name!r} must be a vlens object with keys from "
                         f"{list(BODY_KEYS)}, e.g. {{\"steer\": [...]}}")
    if len(json.dumps(body)) > MAX_BYTES:
        raise VlensError(f"preset {name!r} is over {MAX_BYTES} bytes of JSON")
    check(body)  # the checks every body passes (raises naming the field)
    return body


def load_presets(pairs: dict[str, str], check: Callable[[dict[str, Any]], Any]
                 ) -> dict[str, dict[str, Any]]:
    """``--preset NAME=FILE``: each file a JSON ``vlens`` object (or a body
    ``{"vlens": {...}}``), checked against the served model now."""
    out = {}
    for name, path in pairs.items():
        try:
            body = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise VlensError(f"--preset {name}={path}: not a readable JSON file ({exc})") from None
        if isinstance(body, dict) and set(body) == {"vlens"}:
            body = body["vlens"]
        out[name] = _checked(name, body, check)
    return out


def merge(preset: dict[str, Any], own: Any) -> Any:
    """A preset's entries, then the request's own (``own``: its ``vlens``
    object or None; anything malformed is passed on for the checks to name)."""
    if own is None:
        return preset
    if not isinstance(own, dict):
        return own
    out = {k: list(v) if isinstance(v, list) else [v] for k, v in preset.items()}
    for k, v in own.items():
        if k in out and isinstance(v, (list, dict)):
            out[k] = out[k] + (v if isinstance(v, list) else [v])
        else:
            out[k] = v
    return out


class Presets:
    """The server's presets and each participant's own."""

    def __init__(self, served: dict[str, dict[str, Any]] | None = None) -> None:
        self.served = dict(served or {})
        self.own: dict[str, OrderedDict[str, dict[str, Any]]] = {}

    def register(self, client: str, name: Any, body: Any,
                 check: Callable[[dict[str, Any]], Any]) -> int:
        """Keep ``body`` as ``name`` for ``client``; returns how many it holds."""
        mine = self.own.setdefault(client, OrderedDict())
        if name not in mine and len(mine) >= MAX_OWN:
            raise VlensError(f"a participant holds at most {MAX_OWN} presets; this one holds "
                             f"{sorted(mine)}")
        mine[name] = _checked(name, body, check)
        return len(mine)

    def get(self, client: str, name: str) -> dict[str, Any] | None:
        return self.own.get(client, {}).get(name, self.served.get(name))

    def names(self, client: str) -> list[str]:
        return sorted(set(self.served) | set(self.own.get(client, {})))
