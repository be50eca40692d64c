"""Edits as typed models: the fields of a ``Steer``, an ``Ablate`` and a
``Clamp`` written once, as Pydantic models, for every way an edit arrives.

``vlens.Steer(...)``, ``vlens.Ablate(...)`` and ``vlens.Clamp(...)`` check
their plain fields (layer, scale, site, span, heads, kind, value) through
:class:`SteerFields`, :class:`AblateFields` and :class:`ClampFields` (their
tensors they check themselves); the OpenAI body's entries
(:mod:`vlens.remote.schema`) are these models plus the names that stand for
tensors on the wire, so a body and an edit object share every field's rule
and message. A span field reads the one span grammar (:mod:`vlens.spans`):
as Python (a tuple is a range, a list positions) or, validated with
``context={"wire": True}``, as JSON.

The model's rules (which layer and site, how wide, how large a write) are
:mod:`vlens.checks.rules`, not here: this module knows nothing of a model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      ValidationInfo, WithJsonSchema)

from vlens import spans
from vlens.errors import FieldError, VlensError

__all__ = ["AblateFields", "CLAMP_MAX", "ClampFields", "CrossFieldError", "NAME", "Name",
           "StrictModel", "SteerFields", "checked", "message_of", "one_of"]

#: a vector's or an SAE's name (on the command line, in a body)
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: the largest ``|value|`` a Clamp may set a feature to: the write is
#: ``(value - f(x)) * W_dec[i]``, and it must stay finite in any dtype
CLAMP_MAX = 1e4


# -- one validator per kind of field -------------------------------------------

def _whole(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"must be an int, got {x!r:.40}")
    return int(x)


def _finite(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"must be a finite number, got {x!r:.40}")
    return float(x)


def _clamp_value(x: Any) -> float:
    if (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
            or abs(x) > CLAMP_MAX):
        raise ValueError(f"must be a finite number with |value| <= {CLAMP_MAX:g} (the bound on "
                         f"a clamp's write), got {x!r:.40}")
    return float(x)


def one_of(*allowed: str) -> Callable[[Any], str]:
    def kind(x: Any) -> str:
        if x not in allowed or not isinstance(x, str):
            raise ValueError(f"must be one of {allowed}, got {x!r:.40}")
        return x
    return kind


def _flag(x: Any) -> bool:
    if not isinstance(x, bool):
        raise ValueError(f"must be True or False, got {x!r:.20}")
    return x


def _site(x: Any) -> str:
    if not isinstance(x, str):
        raise ValueError(f"must be a site name (str), got {x!r:.40}")
    return x


def _span(x: Any, info: ValidationInfo) -> Any:
    wire = bool(info.context and info.context.get("wire"))
    try:
        return spans.from_wire(x) if wire else spans.parse(x)
    except VlensError as exc:
        raise ValueError(str(exc).removeprefix("span ").removeprefix(": ")) from None


def _heads(x: Any) -> Any:
    if x is None:
        return None
    if (isinstance(x, (str, bytes)) or not isinstance(x, (list, tuple, range)) or not x
            or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in x)):
        raise ValueError(f"must be a non-empty list of head indices (ints >= 0), got {x!r:.60}")
    if len(set(x)) != len(x):
        raise ValueError(f"{list(x)} names a head twice")
    return tuple(sorted(int(h) for h in x))


def _layers(x: Any) -> Any:
    """An Ablate's layer: an int, a list of ints or "all" (the edit says
    which of them its kind takes)."""
    if isinstance(x, bool):
        raise ValueError(f"must be an int, got {x!r}")
    if isinstance(x, (int, str)):
        return x
    if isinstance(x, (list, tuple, range)):
        return tuple(x) if all(isinstance(v, int) and not isinstance(v, bool) for v in x) else x
    raise ValueError(f"must be an int (or, with direction=, 'all' or a list), got {x!r:.40}")


_SPAN_SCHEMA = {"description": (
    "which rows: 'all', 'prompt', 'generated', 'last', a role (chat only), [start, stop] "
    "(a range; stop null: to the end), one position, or {\"positions\": [...]}"),
    "anyOf": [{"type": "string"}, {"type": "integer"},
              {"type": "array", "items": {"type": ["integer", "null"]}, "minItems": 2,
               "maxItems": 2},
              {"type": "object", "properties": {"positions": {"type": "array",
                                                              "items": {"type": "integer"}}}}]}
Whole = Annotated[int, BeforeValidator(_whole)]
Finite = Annotated[float, BeforeValidator(_finite)]
Flag = Annotated[bool, BeforeValidator(_flag)]
Site = Annotated[str, BeforeValidator(_site)]
Span = Annotated[Any, BeforeValidator(_span), WithJsonSchema(_SPAN_SCHEMA)]
Heads = Annotated[Any, BeforeValidator(_heads),
                  WithJsonSchema({"type": ["array", "null"], "items": {"type": "integer"},
                                  "description": "site z only: which query heads"})]
Layers = Annotated[Any, BeforeValidator(_layers),
                   WithJsonSchema({"anyOf": [{"type": "integer"},
                                             {"type": "array", "items": {"type": "integer"}},
                                             {"const": "all"}]})]
Name = Annotated[str, Field(pattern=NAME.pattern)]


class StrictModel(BaseModel):
    """No unknown keys, frozen: the base of every edit model."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# -- the edits' fields ---------------------------------------------------------

class SteerFields(StrictModel):
    """A Steer's plain fields (its vector is a tensor, or a name on the wire)."""

    layer: Whole
    scale: Finite = 1.0
    site: Site = "resid_post"
    span: Span = "all"
    relative: Flag = False


class AblateFields(StrictModel):
    """An Ablate's plain fields (its mean and direction are tensors, or names)."""

    site: Site
    layer: Layers
    kind: Annotated[str, BeforeValidator(one_of("zero", "mean", "direction"))] = "zero"
    heads: Heads = None
    span: Span = "all"


class ClampFields(StrictModel):
    """A Clamp's plain fields (its SAE is an object, or a name)."""

    feature: Whole
    value: Annotated[float, BeforeValidator(_clamp_value)]
    span: Span = "all"


def checked(model: type[StrictModel], what: str, **values: Any) -> Any:
    """``values`` through ``model``: the model instance, or a VlensError
    naming ``what`` and the field (``Steer layer must be an int, got 1.5``)."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise FieldError(where, f"{what} {where} {message_of(err)}") from None


def message_of(err: dict) -> str:
    msg = str(err.get("ctx", {}).get("error", "")) or err["msg"]
    return msg.removeprefix("Value error, ")


class CrossFieldError(ValueError):
    """A cross-field refusal of an entry, naming the field it is about."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
