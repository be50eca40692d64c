"""One Session call, as the runner takes it, and the trace parameters.

Every Session method (``trace``, ``stream``, ``compare``, ``sweep``,
``patch``, ``generate`` …) checks its arguments, then builds ONE
:class:`Call`: the requests of one engine batch, how to assemble the
result from vLLM's outputs and the records the workers collected, what a
streamed call yields after each step, and the ``edit=`` functions the
workers hold while it runs. The runner's ``run`` and ``stream`` take it.
:class:`TraceParams` are ``trace``'s and ``stream``'s keywords, once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Call", "TraceParams"]


@dataclass
class Call:
    """``requests`` (the runner's ``Request`` objects, one engine batch);
    ``assemble(outputs, records by tag)`` makes the result; ``partial(latest
    outputs)`` what a streamed call yields after each engine step (None: the
    call does not stream); ``edit_fns`` ``{id: fn}``, shipped to the workers
    for the call and forgotten after it."""

    requests: list[Any]
    assemble: Callable[[list, dict], Any]
    partial: Callable[[list], Any] | None = None
    edit_fns: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TraceParams:
    """What to read and write in a trace (``Session.trace`` and
    ``Session.stream`` take the same keywords; see ``Session.trace``).
    ``sampling``: the other keywords, for vLLM's ``SamplingParams``."""

    layers: int | Sequence[int] | None = None
    sites: str | Sequence[str] = ("resid_post",)
    max_new_tokens: int = 16
    logprobs: bool = True
    background: Sequence[str] = ()
    steer: Any = None
    ablate: Any = None
    edit: Any = None
    edit_at: Sequence[tuple[str, int]] | None = None
    reduce: str = "full"
    logit_lens: int = 0
    heads: int | Sequence[int] | None = None
    saes: Any = None
    features_top_k: int = 0
    clamp: Any = None
    sampling: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, **options: Any) -> TraceParams:
        """The keywords of a trace: those named above, the rest sampling."""
        known = {f.name for f in fields(cls)} - {"sampling"}
        return cls(**{k: v for k, v in options.items() if k in known},
                   sampling={k: v for k, v in options.items() if k not in known})
