"""One Session call as data: its keywords checked, its requests, its stages.

Every Session method (``trace``, ``stream``, ``compare``, ``sweep``,
``patch``, ``direction``, ``generate`` …) first has its keywords checked
(:func:`vlens.keywords.keywords`: an unknown one is a ``TypeError`` naming
the closest real one, a renamed one names its replacement, sampling
settings are matched by name against vLLM's ``SamplingParams``), then
checks its values once (:mod:`vlens.checks`) and describes the call as ONE
:class:`Call`:

* ``requests``: frozen :class:`RequestSpec` objects (prompt ids, the plan,
  the sampling settings, the vectors and SAEs the plan names), built by the
  pure :func:`request` -- the runner makes vLLM's ``SamplingParams`` of
  each, all before the first byte is shipped;
* ``assemble(outputs, records, runs)``: the result from vLLM's outputs and
  the records the workers collected (``runs``: the runner's
  :class:`Assembler`, which turns them into Runs); a call whose result needs
  a second engine batch (mean ablation's means, patching's read pass)
  returns that next :class:`Call` from its ``assemble``, and the runner
  runs it too: one call object, run in stages;
* ``partial(outputs, runs)``: what a streamed call yields after each step.

Nothing here touches an engine or imports vLLM.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vlens.edits import Steer
from vlens.engine.prefix_cache import PREFIX_KEY
from vlens.protocol.plan import PLAN_KEY, Add, Edit, Plan, Read, Set

__all__ = ["Assembler", "Call", "RequestSpec", "background", "new_tag", "request"]

_calls = itertools.count()
_PREFIX = f"c{uuid.uuid4().hex[:6]}"


def new_tag() -> str:
    """A tag prefix no other call in this process uses."""
    return f"{_PREFIX}-{next(_calls)}"


@dataclass(frozen=True, eq=False)
class RequestSpec:
    """One engine request, as data: prompt ids, its plan (None: untraced
    background traffic), how many tokens to generate, the sampling
    settings, vlens's own log-probability settings (``score``), the vectors
    (``{id: tensor}``) and SAEs (``{id: SAE}``) the plan names, and the
    normalised prompt (:class:`vlens.prompts.Prompt`) whose roles its Trace
    shows.

    ``prefix``: how many leading prompt tokens are the unedited prompt's
    (the first position the plan writes), set only for an engine with
    ``prefix_marks`` (:mod:`vlens.engine.prefix_cache`): the request then
    goes without its edits' cache salt, reads cached blocks before that
    position and registers none after it. None: the usual salt."""

    ids: list[int]
    plan: Plan | None
    max_new_tokens: int
    logprobs: bool = False
    sampling: Mapping[str, Any] = field(default_factory=dict)
    score: Mapping[str, Any] | None = None
    vectors: Mapping[str, Any] = field(default_factory=dict)
    saes: Mapping[str, Any] = field(default_factory=dict)
    prompt: Any = None
    prefix: int | None = None

    @property
    def samples(self) -> int:
        return int(self.sampling.get("n", 1) or 1)

    def extra_args(self) -> dict[str, Any] | None:
        """vLLM's ``SamplingParams.extra_args``: the plan for the workers,
        and the prefix mark for the scheduler (None: no plan)."""
        if self.plan is None:
            return None
        extra: dict[str, Any] = {PLAN_KEY: self.plan.to_wire()}
        if self.prefix is not None:
            extra[PREFIX_KEY] = self.prefix
        return extra


def request(tag: str, index: int, ids: list[int], *, max_new_tokens: int, logprobs: bool,
            clone: bool, reads: Sequence[Read] = (), steers: Sequence[Steer] = (),
            edits: Sequence[Edit] = (), sets: Sequence[Set] = (),
            vectors: Mapping[str, Any] | None = None, sampling: Mapping[str, Any] | None = None,
            score: Mapping[str, Any] | None = None, source: Any = None,
            saes: Sequence[Any] = (), prefix: int | None = None) -> RequestSpec:
    """One traced request of checked parts. Every traced request carries a
    plan, even one that reads and writes nothing, so its processed tokens
    are recorded. ``sets`` (ablations, patched cells) name their vectors in
    ``vectors`` (``{id: tensor [width]}``); ``saes``: the SAEs its reads
    name (a Clamp among ``steers`` brings its own); ``prefix``: see
    :class:`RequestSpec`."""
    adds = tuple(
        Add(st.site, st.layer, st.id, float(st.scale), *st.positions(len(ids)),
            relative=st.relative, **_clamp_of(st))
        for st in steers
    )
    plan = Plan(tag=tag, reads=tuple(reads), adds=adds, sets=tuple(sets), edits=tuple(edits),
                clone=clone, prompt_len=len(ids), index=index)
    used = {s.id: s for s in saes}
    used.update({st.sae.id: st.sae for st in steers if getattr(st, "sae", None) is not None})
    return RequestSpec(list(ids), plan, max_new_tokens, logprobs, dict(sampling or {}),
                       dict(score) if score else None,
                       {**{st.id: st.vector for st in steers}, **(vectors or {})}, used,
                       source, prefix)


def _clamp_of(st: Steer) -> dict[str, Any]:
    """A Clamp's plan fields; nothing for a plain Steer."""
    sae = getattr(st, "sae", None)
    return {} if sae is None else {"sae": sae.id, "feature": st.feature}


def background(ids: list[int], max_new_tokens: int, sampling: Mapping[str, Any]
               ) -> RequestSpec:
    """An untraced request, as other users' traffic would be."""
    return RequestSpec(list(ids), None, max_new_tokens, False, dict(sampling))


class Assembler(Protocol):
    """What ``assemble`` and ``partial`` are handed: Runs from outputs."""

    def build_run(self, prompts: Sequence[str], requests: Sequence[RequestSpec],
                  outputs: Sequence, collected: dict, logprobs: bool) -> Any: ...

    def partial_run(self, prompts: Sequence[str], requests: Sequence[RequestSpec],
                    outputs: Sequence) -> Any: ...

    def token_strings(self, ids: Sequence[int]) -> list[str]: ...


@dataclass
class Call:
    """``requests`` (one engine batch); ``assemble(outputs, records by tag,
    runs)`` makes the result, or the next stage's Call; ``partial(latest
    outputs, runs)`` what a streamed call yields after each engine step
    (None: this stage does not stream); ``edit_fns`` ``{id: fn}``, shipped to
    the workers for the stage and forgotten after it; ``progress``: this
    stage's own ``progress=`` (None: the call's); ``closing``: run once
    when the whole call ends, whichever way."""

    requests: list[RequestSpec]
    assemble: Callable[[list, dict, Assembler], Any]
    partial: Callable[[list, Assembler], Any] | None = None
    edit_fns: dict[str, Any] = field(default_factory=dict)
    progress: Any = None
    closing: Callable[[], None] | None = None
