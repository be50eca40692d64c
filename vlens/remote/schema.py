"""The ``vlens`` object of an OpenAI body as Pydantic models, for
``/openapi.json`` and ``/docs``: what a client may send, field by field.

These describe the body; the checks themselves are
:func:`vlens.remote.body.parse_body` (ranges against the served model,
names, spans, bounds on every write), which every request passes and whose
refusals name the field (``vlens.steer[0].layer``). A test checks that the
two agree on the documented examples and on the keys each entry takes.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

__all__ = ["VlensBody", "SteerEntry", "AblateEntry", "ClampEntry", "ChatBody",
           "CompletionBody", "PresetBody"]

Span = Union[Literal["all", "prompt", "generated", "system", "user", "assistant",
                     "developer", "tool"], tuple[int, int]]
_SPAN = ("which tokens: 'all', 'prompt', 'generated', [start, stop], or a role "
         "(chat only; 'assistant' covers earlier assistant messages and the reply)")


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SteerEntry(_Entry):
    """Add ``scale`` x a named vector (or an SAE feature's decoder row)."""

    vector: str | None = Field(None, description="a name: --vector, or your register_vector")
    sae: str | None = Field(None, description="an SAE's name (--sae), with feature")
    feature: int | None = Field(None, ge=0, description="the SAE feature to steer with")
    layer: int | None = Field(None, ge=0, description="required with vector")
    scale: float = 1.0
    site: str = "resid_post"
    span: Span = Field("all", description=_SPAN)
    relative: bool = Field(False, description="scale in units of each row's norm")


class AblateEntry(_Entry):
    """Zero a site (or heads of z), put its named mean there, or project a
    named direction out."""

    site: str
    layer: int | list[int] | Literal["all"]
    kind: Literal["zero", "mean"] = "zero"
    heads: list[int] | None = Field(None, description="z only: which heads")
    mean: str | None = Field(None, description="kind 'mean': the mean vector's name")
    direction: str | None = Field(None, description="a vector's name: project it out")
    span: Span = Field("all", description=_SPAN)


class ClampEntry(_Entry):
    """Hold an SAE feature at ``value``."""

    sae: str
    feature: int = Field(ge=0)
    value: float = Field(le=1e4, ge=-1e4)
    span: Span = Field("all", description=_SPAN)


class VlensBody(_Entry):
    """Edits of this request only (at most 16 steers and clamps, 64 ablations)."""

    steer: list[SteerEntry] = Field(default_factory=list)
    ablate: list[AblateEntry] = Field(default_factory=list)
    clamp: list[ClampEntry] = Field(default_factory=list)


class ChatBody(ChatCompletionRequest):
    """vLLM's chat completion request, with vlens's ``vlens`` object."""

    vlens: VlensBody | None = None


class CompletionBody(CompletionRequest):
    """vLLM's completion request, with vlens's ``vlens`` object."""

    vlens: VlensBody | None = None


class PresetBody(_Entry):
    """A participant's preset: ``/presets/NAME/v1/...`` steers every call."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    vlens: VlensBody
