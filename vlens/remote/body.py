"""The ``vlens`` object of an OpenAI-style request body, checked.

``{"steer": [...], "ablate": [...], "clamp": [...]}``: each entry the wire
form of a :class:`~vlens.Steer`, :class:`~vlens.Ablate` or
:class:`~vlens.Clamp`, with vectors and SAEs named (``"vector": "mood"``,
``"sae": "toy"``) instead of sent::

    {"steer":  [{"vector": NAME, "layer": 3, "scale": 4.0, "site": "resid_post",
                 "span": "all", "relative": false},
                {"sae": NAME, "feature": 12, "scale": 8.0}],
     "ablate": [{"site": "z", "layer": 1, "heads": [0, 2], "kind": "zero",
                 "span": "prompt"},
                {"site": "mlp_out", "layer": 2, "kind": "mean", "mean": NAME},
                {"site": "resid_post", "layer": "all", "direction": NAME}],
     "clamp":  [{"sae": NAME, "feature": 12, "value": 6.0, "span": "assistant"}]}

:func:`parse_body` makes the edits, with the objects' own checks and the
model's (layers, sites, widths, heads, write sizes); a span that must land
on the prompt is checked once the prompt's length is known, with the plan
(:func:`vlens.checks.plans.check_plan`). Every refusal is a
:class:`BodyError` naming the field (``vlens.steer[0].layer``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlens.checks import check_steer_fits
from vlens.checks.facts import ModelFacts, check_set_values, check_write_site, is_int
from vlens.checks.plans import PLAN_MAX
from vlens.edits import Ablate, Steer, parse_span
from vlens.methods.sae import Clamp
from vlens.errors import VlensError

__all__ = ["BODY_KEYS", "BodyEdits", "BodyError", "NAME", "parse_body"]

#: a vector's or an SAE's name (on the command line, in a body)
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

BODY_KEYS = ("steer", "ablate", "clamp")
_STEER = {"vector", "sae", "feature", "layer", "scale", "site", "span", "relative"}
_ABLATE = {"site", "layer", "kind", "heads", "span", "mean", "direction"}
_CLAMP = {"sae", "feature", "value", "span"}


class BodyError(VlensError):
    """A ``vlens`` body refused: ``field`` names where (``vlens.steer[0].layer``)."""

    def __init__(self, field_: str, message: str) -> None:
        super().__init__(f"{field_}: {message}")
        self.field = field_


@dataclass
class BodyEdits:
    """The edits of one body: ``steers`` (Clamps among them) and ``ablates``."""

    steers: list[Any] = field(default_factory=list)
    ablates: list[Any] = field(default_factory=list)
    #: each edit's field (``vlens.clamp[1]``), for the errors of later checks
    steer_fields: list[str] = field(default_factory=list)
    ablate_fields: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.steers or self.ablates)


def _keys(entry: Any, allowed: set[str], where: str, need: tuple[str, ...]) -> dict:
    if not isinstance(entry, dict):
        raise BodyError(where, f"must be an object with keys from {sorted(allowed)}, "
                               f"got {type(entry).__name__}")
    odd = [k for k in entry if k not in allowed]
    if odd:
        raise BodyError(f"{where}.{odd[0]}" if isinstance(odd[0], str) else where,
                        f"unknown key; {where.split('[')[0]} entries take {sorted(allowed)}")
    for k in need:
        if k not in entry:
            raise BodyError(f"{where}.{k}", "missing")
    return entry


def _number(entry: dict, key: str, where: str, default: float) -> float:
    x = entry.get(key, default)
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or abs(x) == float("inf"):
        raise BodyError(f"{where}.{key}", f"must be a finite number, got {x!r:.40}")
    return float(x)


def _int(entry: dict, key: str, where: str) -> int:
    x = entry[key]
    if not is_int(x):
        raise BodyError(f"{where}.{key}", f"must be a whole number, got {x!r:.40}")
    return x


def _name(entry: dict, key: str, where: str, known: Callable[[str], Any], kind: str) -> Any:
    x = entry[key]
    if not isinstance(x, str) or not NAME.fullmatch(x):
        raise BodyError(f"{where}.{key}", f"must be the name of a {kind} (1-64 of "
                                          f"A-Z a-z 0-9 _ . -), got {x!r:.40}")
    got = known(x)
    if got is None:
        raise BodyError(f"{where}.{key}", f"unknown {kind} {x!r}: the server's are listed by "
                                          "GET /v1/info; register your own with "
                                          "s.register_vector(name, tensor)" if kind == "vector"
                        else f"unknown {kind} {x!r}: the server's are listed by GET /v1/info "
                             "(vlens serve --sae NAME=PATH)")
    return got


def _vector(entry: dict, key: str, where: str, known: Callable[[str], Any], site: str,
            facts: ModelFacts) -> Any:
    """A named vector that must be as wide as ``site``'s rows."""
    vec = _name(entry, key, where, known, "vector")
    if vec.shape[0] != facts.width(site):
        raise BodyError(f"{where}.{key}", f"{entry[key]!r} has {vec.shape[0]} values; "
                                          f"{site} takes {facts.width(site)}")
    return vec


def _span(entry: dict, where: str) -> Any:
    span = entry.get("span", "all")
    try:
        return parse_span(tuple(span) if isinstance(span, list) else span, "")
    except VlensError as exc:
        raise BodyError(f"{where}.span", str(exc).strip()) from None


def _made(where: str, make: Callable[[], Any]) -> Any:
    """An edit's own constructor checks, the field named."""
    try:
        return make()
    except VlensError as exc:
        raise BodyError(where, str(exc)) from None


def _steer(entry: Any, where: str, facts: ModelFacts, vector: Callable, sae: Callable) -> Any:
    entry = _keys(entry, _STEER, where, ())
    if ("vector" in entry) == ("sae" in entry):
        raise BodyError(f"{where}.vector", "give a vector name, or an sae name and a feature "
                                           "(one of them)")
    scale = _number(entry, "scale", where, 1.0)
    span = _span(entry, where)
    if "sae" in entry:
        for k in ("layer", "site", "relative"):
            if k in entry:
                raise BodyError(f"{where}.{k}", "an SAE feature steers at the SAE's own layer "
                                                "and site (leave it out)")
        if "feature" not in entry:
            raise BodyError(f"{where}.feature", "missing (the SAE feature to steer with)")
        model = _name(entry, "sae", where, sae, "SAE")
        i = _feature(entry, where, model)
        st = _made(where, lambda: model.steer(i, scale=scale, span=span))
    else:
        if "feature" in entry:
            raise BodyError(f"{where}.feature", "a feature goes with an sae name, not a vector")
        if "layer" not in entry:
            raise BodyError(f"{where}.layer", "missing")
        layer = _int(entry, "layer", where)
        site = entry.get("site", "resid_post")
        relative = entry.get("relative", False)
        if not isinstance(relative, bool):
            raise BodyError(f"{where}.relative", f"must be true or false, got {relative!r:.20}")
        _site(site, layer, where, facts, "Steer")
        vec = _vector(entry, "vector", where, vector, site, facts)
        st = _made(where, lambda: Steer(vec, layer, scale, site, span, relative))
    try:
        check_steer_fits(st, facts)
    except VlensError as exc:
        raise BodyError(f"{where}.scale", str(exc)) from None
    return st


def _site(site: Any, layer: int, where: str, facts: ModelFacts, what: str) -> None:
    if not isinstance(site, str):
        raise BodyError(f"{where}.site", f"must be a site name, got {site!r:.40}")
    if site not in facts.sites:
        raise BodyError(f"{where}.site", str(facts.no_such_site(site, f"{what} site")))
    try:
        check_write_site(what, site, layer, facts)
    except VlensError as exc:
        raise BodyError(f"{where}.layer" if "layer" in str(exc) and "does not exist" in str(exc)
                        else f"{where}.site", str(exc)) from None


def _feature(entry: dict, where: str, model: Any) -> int:
    i = _int(entry, "feature", where)
    if not 0 <= i < model.d_sae:
        raise BodyError(f"{where}.feature", f"must be from 0 to {model.d_sae - 1}, got {i}")
    return i


def _clamp(entry: Any, where: str, facts: ModelFacts, sae: Callable) -> Any:
    entry = _keys(entry, _CLAMP, where, ("sae", "feature", "value"))
    value = _number(entry, "value", where, 0.0)
    span = _span(entry, where)
    model = _name(entry, "sae", where, sae, "SAE")
    i = _feature(entry, where, model)
    c = _made(f"{where}.value", lambda: Clamp(model, i, value, span))
    try:
        check_steer_fits(c, facts)
    except VlensError as exc:
        raise BodyError(f"{where}.value", str(exc)) from None
    return c


def _ablate(entry: Any, where: str, facts: ModelFacts, vector: Callable) -> Any:
    entry = _keys(entry, _ABLATE, where, ("site", "layer"))
    site = entry["site"]
    if "direction" in entry:  # a directional ablation: at one layer, a list or "all"
        layer = entry["layer"]
        layers = range(facts.n_layers) if layer == "all" else (
            layer if isinstance(layer, list) else [layer])
        if not layers or not all(is_int(x) for x in layers):
            raise BodyError(f"{where}.layer", f"must be a layer number, a list of them or 'all', "
                                              f"got {layer!r:.40}")
        for x in layers:
            _site(site, x, where, facts, "Ablate")
        r = _vector(entry, "direction", where, vector, site, facts)
        span = _span(entry, where)
        return _made(where, lambda: Ablate(site, layer, entry.get("kind", "zero"),
                                           entry.get("heads"), span, entry.get("mean"), r))
    layer = _int(entry, "layer", where)
    _site(site, layer, where, facts, "Ablate")
    kind = entry.get("kind", "zero")
    if kind not in ("zero", "mean"):
        raise BodyError(f"{where}.kind", f"must be 'zero' or 'mean', got {kind!r:.40}")
    mean = None
    if kind == "mean":
        if "mean" not in entry:
            raise BodyError(f"{where}.mean", "kind 'mean' needs the name of the mean vector "
                                             "(the server does not run the extra pass)")
        mean = _vector(entry, "mean", where, vector, site, facts)
        try:
            check_set_values(where, float(mean.abs().max()), facts)
        except VlensError as exc:
            raise BodyError(f"{where}.mean", str(exc)) from None
    elif "mean" in entry:
        raise BodyError(f"{where}.mean", "only with kind 'mean'")
    heads = entry.get("heads")
    if heads is not None:
        if site != "z":
            raise BodyError(f"{where}.heads", "heads are for site 'z' only")
        if not (isinstance(heads, list) and heads and len(set(map(repr, heads))) == len(heads)
                and all(is_int(h) and 0 <= h < facts.n_heads for h in heads)):
            raise BodyError(f"{where}.heads", f"must be a non-empty list of distinct heads from 0 to "
                                              f"{facts.n_heads - 1}, got {heads!r:.60}")
    span = _span(entry, where)
    return _made(where, lambda: Ablate(site, layer, kind, heads, span, mean))


def parse_body(raw: Any, facts: ModelFacts, vector: Callable[[str], Any],
               sae: Callable[[str], Any]) -> BodyEdits:
    """The ``vlens`` object of a request -> its checked edits. ``vector``
    and ``sae``: name -> the tensor / :class:`~vlens.SAE` (None: unknown)."""
    if raw is None:
        return BodyEdits()
    if not isinstance(raw, dict):
        raise BodyError("vlens", f"must be an object with keys from {list(BODY_KEYS)}, got "
                                 f"{type(raw).__name__}")
    for k in raw:
        if k not in BODY_KEYS:
            raise BodyError(f"vlens.{k}" if isinstance(k, str) else "vlens",
                            f"unknown key; vlens takes {list(BODY_KEYS)}")
    out = BodyEdits()
    for key in BODY_KEYS:
        entries = raw.get(key, [])
        if isinstance(entries, dict):
            entries = [entries]
        limit = PLAN_MAX["sets" if key == "ablate" else "adds"] // 4
        if not isinstance(entries, list) or len(entries) > limit:
            raise BodyError(f"vlens.{key}", f"must be a list of at most {limit} entries")
        for i, entry in enumerate(entries):
            where = f"vlens.{key}[{i}]"
            if key == "steer":
                out.steers.append(_steer(entry, where, facts, vector, sae))
            elif key == "clamp":
                out.steers.append(_clamp(entry, where, facts, sae))
            else:
                out.ablates.append(_ablate(entry, where, facts, vector))
            (out.ablate_fields if key == "ablate" else out.steer_fields).append(where)
    return out
