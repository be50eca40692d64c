"""The ``vlens`` object of an OpenAI body: its typed models, its one parser,
and the request bodies of ``vlens serve``'s OpenAI routes.

``{"steer": [...], "ablate": [...], "clamp": [...]}``: each entry is the
wire form of a :class:`~vlens.Steer`, :class:`~vlens.Ablate` or
:class:`~vlens.Clamp` -- their field models (:mod:`vlens.edit_schema`) plus
the names that stand for tensors (``"vector": "mood"``, ``"sae": "toy"``).
:func:`parse_body` validates a body with :class:`VlensBody` (spans as JSON),
resolves the names, makes the edit objects (so their own checks run) and
runs the Steer rule (:mod:`vlens.checks.rules`) on each steer and clamp;
:meth:`BodyEdits.fit` puts the edits on one prompt (spans resolved, the
Ablate rule, every span checked). The server calls both, a notebook may
call both; ``/openapi.json`` documents these very models (``ChatBody``,
``CompletionBody``: vLLM's request models with the ``vlens`` object).
Every refusal is a :class:`BodyError` naming the field
(``vlens.steer[0].layer``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, model_validator
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from vlens import spans
from vlens.checks import check_span_fits, check_steer_fits
from vlens.edit_schema import (NAME, AblateFields, ClampFields, CrossFieldError, Name,
                               SteerFields, StrictModel, Whole, message_of, one_of)
from vlens.edits import Ablate, Steer
from vlens.errors import FieldError, VlensError
from vlens.methods.ablation import check_ablate, check_overlap, per_layer
from vlens.methods.sae import Clamp
from vlens.prompts import Prompt, resolve_spans

__all__ = ["AblateEntry", "BODY_KEYS", "BODY_MAX", "BodyEdits", "BodyError", "ChatBody",
           "ClampEntry", "CompletionBody", "PresetBody", "SteerEntry", "VlensBody", "parse_body"]

BODY_KEYS = ("steer", "ablate", "clamp")
#: entries per key of one body (a plan holds at most 64 adds and 256 sets)
BODY_MAX = {"steer": 16, "clamp": 16, "ablate": 64}


class BodyError(VlensError):
    """A ``vlens`` body refused: ``field`` names where (``vlens.steer[0].layer``)."""

    def __init__(self, field_: str, message: str) -> None:
        super().__init__(f"{field_}: {message}")
        self.field = field_


class SteerEntry(SteerFields):
    """Add ``scale`` x a named vector (or an SAE feature's decoder row)."""

    vector: Name | None = Field(None, description="a name: --vector, or your register_vector")
    sae: Name | None = Field(None, description="an SAE's name (--sae), with feature")
    feature: Whole | None = Field(None, description="the SAE feature to steer with")
    layer: Whole | None = Field(None, description="required with vector")

    @model_validator(mode="after")
    def _one_source(self) -> SteerEntry:
        if (self.vector is None) == (self.sae is None):
            raise CrossFieldError("vector", "give a vector name, or an sae name and a feature "
                                        "(one of them)")
        if self.sae is not None:
            for k in ("layer", "site", "relative"):
                if k in self.model_fields_set:
                    raise CrossFieldError(k, "an SAE feature steers at the SAE's own layer and "
                                         "site (leave it out)")
            if self.feature is None:
                raise CrossFieldError("feature", "missing (the SAE feature to steer with)")
        else:
            if self.feature is not None:
                raise CrossFieldError("feature", "a feature goes with an sae name, not a vector")
            if self.layer is None:
                raise CrossFieldError("layer", "missing")
        return self


class AblateEntry(AblateFields):
    """Zero a site (or heads of z), put its named mean there, or project a
    named direction out."""

    kind: Annotated[Literal["zero", "mean"], BeforeValidator(one_of("zero", "mean"))] = "zero"
    mean: Name | None = Field(None, description="kind 'mean': the mean vector's name")
    direction: Name | None = Field(None, description="a vector's name: project it out")


class ClampEntry(ClampFields):
    """Hold an SAE feature at ``value``."""

    sae: Name

    @model_validator(mode="before")
    @classmethod
    def _sae_first(cls, data: Any) -> Any:
        if isinstance(data, dict) and "sae" not in data:  # named before its feature
            raise CrossFieldError("sae", "missing (the SAE whose feature to clamp)")
        return data


#: a key of the body takes one entry (an object) or a list of them
_ONE_OR_LIST = BeforeValidator(lambda x: [x] if isinstance(x, dict) else x)


class VlensBody(StrictModel):
    """Edits of this request only (at most 16 steers and clamps, 64 ablations)."""

    steer: Annotated[list[SteerEntry], _ONE_OR_LIST] = Field(
        default_factory=list, max_length=BODY_MAX["steer"])
    ablate: Annotated[list[AblateEntry], _ONE_OR_LIST] = Field(
        default_factory=list, max_length=BODY_MAX["ablate"])
    clamp: Annotated[list[ClampEntry], _ONE_OR_LIST] = Field(
        default_factory=list, max_length=BODY_MAX["clamp"])


@dataclass
class BodyEdits:
    """The edits of one body: ``steers`` (Clamps among them) and ``ablates``,
    each with its field (``vlens.clamp[1]``) for the errors of later checks."""

    steers: list[Any] = field(default_factory=list)
    ablates: list[Any] = field(default_factory=list)
    steer_fields: list[str] = field(default_factory=list)
    ablate_fields: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.steers or self.ablates)

    def fit(self, facts: Any, prompt_len: int, max_tokens: int,
            roles: Callable[[str], Any] | None = None) -> tuple[list[Any], list[Any]]:
        """The edits on one request of ``prompt_len`` tokens and
        ``max_tokens``: spans resolved to ranges (``roles(field)``: the
        request's normalised conversation, for role spans), the Ablate rule
        run on each ablation, every span checked. Returns ``(steers,
        ablates)``, ablates one layer each."""
        plain = Prompt(ids=[0] * prompt_len, text="", offsets=[], roles=[None] * prompt_len,
                       label="", kind="ids")
        out: tuple[list[Any], list[Any]] = ([], [])
        one_layer: list[Any] = []  # each Ablate at each of its layers, before its runs
        for group, fields, into in ((self.steers, self.steer_fields, out[0]),
                                    (self.ablates, self.ablate_fields, out[1])):
            for ed, where in zip(group, fields):
                try:
                    layers = [ed]
                    if into is out[1]:
                        layers = per_layer(ed, facts)
                        for ab in layers:
                            check_ablate(ab, facts, prompt_len, max_tokens, span=False)
                        one_layer.extend(layers)
                except FieldError as exc:
                    raise BodyError(f"{where}.{exc.field}", str(exc)) from None
                except VlensError as exc:
                    raise BodyError(f"{where}.layer", str(exc)) from None
                for one in layers:
                    try:
                        span = one.span
                        prompt = (roles(where) if isinstance(span, str) and span in spans.ROLES
                                  and roles is not None else plain)
                        for x in resolve_spans([one], prompt, 0, max_tokens):
                            check_span_fits(type(x).__name__, x.span, prompt_len, max_tokens)
                            into.append(x)
                    except VlensError as exc:
                        raise BodyError(f"{where}.span", str(exc)) from None
        try:
            check_overlap(one_layer, 0)
        except VlensError as exc:
            raise BodyError("vlens.ablate", str(exc)) from None
        return out


def _field_of(err: dict, prefix: str) -> str:
    loc = [x for x in err["loc"] if x not in ("function-after", "function-before")]
    parts = [prefix]
    for x in loc:
        parts.append(f"[{x}]" if isinstance(x, int) else f".{x}")
    return "".join(parts)


def parse_body(raw: Any, facts: Any, vector: Callable[[str], Any],
               sae: Callable[[str], Any]) -> BodyEdits:
    """The ``vlens`` object of a request -> its edits: the body validated
    by :class:`VlensBody` (as JSON: ``context={"wire": True}``), the names
    resolved (``vector``, ``sae``: name -> the tensor / :class:`~vlens.SAE`,
    None: unknown), the edit objects made, and the Steer rule run on each
    steer and clamp. Refusals are :class:`BodyError` naming the field."""
    if raw is None:
        return BodyEdits()
    if not isinstance(raw, dict):
        raise BodyError("vlens", f"must be an object with keys from {list(BODY_KEYS)}, got "
                                 f"{type(raw).__name__}")
    try:
        body = VlensBody.model_validate(raw, context={"wire": True})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = _field_of(err, "vlens")
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, CrossFieldError):
            where = f"{where}.{cause.name}"
        if err["type"] == "extra_forbidden":
            key = where.split("[")[0].removeprefix("vlens.") or "vlens"
            takes = (list(BODY_KEYS) if "." not in where.removeprefix("vlens.")
                     else sorted(_ENTRY[key].model_fields))
            raise BodyError(where, f"unknown key; {key} takes {takes}") from None
        if err["type"] == "too_long":
            limit = BODY_MAX[where.removeprefix("vlens.")]
            raise BodyError(where, f"must be a list of at most {limit} entries") from None
        raise BodyError(where, message_of(err)) from None
    out = BodyEdits()
    for key in BODY_KEYS:
        for i, entry in enumerate(getattr(body, key)):
            where = f"vlens.{key}[{i}]"
            made = _make(key, entry, where, vector, sae)
            if key == "ablate":
                out.ablates.append(made)
                out.ablate_fields.append(where)
                continue
            try:
                check_steer_fits(made, facts)  # the Steer rule, once per steer or clamp
            except VlensError as exc:
                name = getattr(exc, "field", None) or "scale"
                if key == "clamp" or getattr(made, "sae", None) is not None:
                    name = {"scale": "value" if key == "clamp" else "scale"}.get(name, "sae")
                raise BodyError(f"{where}.{name}", str(exc)) from None
            out.steers.append(made)
            out.steer_fields.append(where)
    return out


_ENTRY = {"steer": SteerEntry, "ablate": AblateEntry, "clamp": ClampEntry}


def _named(kind: str, name: str, where: str, known: Callable[[str], Any]) -> Any:
    got = known(name)
    if got is None:
        if kind == "vector":
            raise BodyError(where, f"unknown vector {name!r}: the server's are listed by GET "
                                   "/v1/info; register your own with s.register_vector(name, "
                                   "tensor)")
        raise BodyError(where, f"unknown SAE {name!r}: the server's are listed by GET /v1/info "
                               "(vlens serve --sae NAME=PATH)")
    return got


def _made(where: str, make: Callable[[], Any]) -> Any:
    """An edit's own constructor checks, the field named."""
    try:
        return make()
    except FieldError as exc:
        raise BodyError(f"{where}.{exc.field}", str(exc)) from None
    except VlensError as exc:
        raise BodyError(where, str(exc)) from None


def _feature_of(e: Any, where: str, sae: Callable[[str], Any]) -> Any:
    """The SAE an entry names, its ``feature`` one of that SAE's."""
    model = _named("SAE", e.sae, f"{where}.sae", sae)
    if not 0 <= e.feature < model.d_sae:
        raise BodyError(f"{where}.feature", f"must be from 0 to {model.d_sae - 1}, got "
                                            f"{e.feature}")
    return model


def _make(key: str, e: Any, where: str, vector: Callable[[str], Any],
          sae: Callable[[str], Any]) -> Any:
    if key == "clamp":
        model = _feature_of(e, where, sae)
        return _made(f"{where}.value", lambda: Clamp(model, e.feature, e.value, e.span))
    if key == "steer":
        if e.sae is not None:
            model = _feature_of(e, where, sae)
            return _made(where, lambda: model.steer(e.feature, scale=e.scale, span=e.span))
        vec = _named("vector", e.vector, f"{where}.vector", vector)  # its width: the rule
        return _made(where, lambda: Steer(vec, e.layer, e.scale, e.site, e.span, e.relative))
    mean = direction = None
    if e.direction is not None:  # its constructor says what may not go with it
        direction = _named("vector", e.direction, f"{where}.direction", vector)
    elif e.mean is not None:
        if e.kind != "mean":
            raise BodyError(f"{where}.mean", "only with kind 'mean'")
        mean = _named("vector", e.mean, f"{where}.mean", vector)
    elif e.kind == "mean":
        raise BodyError(f"{where}.mean", "kind 'mean' needs the name of the mean vector (the "
                                         "server does not run the extra pass)")
    layer = list(e.layer) if isinstance(e.layer, tuple) else e.layer
    return _made(where, lambda: Ablate(e.site, layer, e.kind, e.heads, e.span, mean, direction))


class ChatBody(ChatCompletionRequest):
    """vLLM's chat completion request, with vlens's ``vlens`` object."""

    vlens: VlensBody | None = None


class CompletionBody(CompletionRequest):
    """vLLM's completion request, with vlens's ``vlens`` object."""

    vlens: VlensBody | None = None


class PresetBody(StrictModel):
    """A participant's preset: ``/presets/NAME/v1/...`` steers every call."""

    name: str = Field(pattern=f"^{NAME.pattern}$")
    vlens: VlensBody
