"""The small, serialisable plan that rides on each request.

A plan travels from the client to every worker inside
``SamplingParams.extra_args["vlens"]``, so it holds only plain data (str,
int, bool, lists, dicts): vLLM serialises it with msgspec when the engine
runs in other processes, and tensors cannot cross that way.

    {"v": 1, "tag": "<session>-<call>-<prompt>", "reads": {"resid_post": [0, 2]}}

``tag`` names the client-side request: vLLM's internal request ids carry a
random suffix and ``n > 1`` fans one prompt into several child requests that
share the tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PLAN_KEY", "PLAN_VERSION", "Plan", "make_plan", "parse_plan"]

PLAN_KEY = "vlens"
PLAN_VERSION = 1


@dataclass(frozen=True)
class Plan:
    tag: str
    reads: dict[str, tuple[int, ...]]
    clone: bool = False


def make_plan(tag: str, reads: dict[str, list[int]], *, clone: bool = False) -> dict[str, Any]:
    """The wire form of a plan (plain dict)."""
    return {
        "v": PLAN_VERSION,
        "tag": str(tag),
        "reads": {str(site): [int(x) for x in layers] for site, layers in reads.items()},
        "clone": bool(clone),
    }


def parse_plan(raw: Any) -> Plan:
    """Wire form -> :class:`Plan`. Raises ValueError on a malformed plan."""
    if not isinstance(raw, dict) or raw.get("v") != PLAN_VERSION:
        raise ValueError(f"not a vlens plan (version {PLAN_VERSION}): {raw!r:.200}")
    reads = {
        str(site): tuple(int(x) for x in layers)
        for site, layers in (raw.get("reads") or {}).items()
    }
    return Plan(tag=str(raw["tag"]), reads=reads, clone=bool(raw.get("clone", False)))
