"""What the widgets show and who calls the engine.

* :class:`Selection` -- one layer, one token span, one site. Every view of
  an explorer holds the same Selection: a picker in any view writes it, and
  every view redraws from it. A view made alone makes its own.
* :class:`Controller` -- the one widget object that calls the Session. It
  traces the prompt (every site, every layer, the logit lens's top 5),
  keeps that Run, and runs the steering calls; views are handed Runs and
  only draw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import closing
from typing import Any

import traitlets

from vlens.edits import PerPrompt
from vlens.protocol.sites import HEAD_SITES
from vlens.results import Comparison, Run

__all__ = ["Controller", "Selection"]

Progress = Callable[[int, int], None]

#: how many logit-lens predictions a trace keeps per layer and token (the hover's list)
TOP_K = 5

#: the sites read per head (``[layers, T, heads, head_dim]``): no view shows
#: them, so the explorer's trace leaves them out (it reads the pattern)
PER_HEAD_SITES = tuple(x for x in HEAD_SITES if x != "attn_pattern")


def token_sites(sites: Sequence[str]) -> list[str]:
    """The sites of ``sites`` that hold one ``[hidden]`` vector per token
    (not the per-head sites nor ``attn_pattern``): what the activation view
    draws and where a steering direction lives."""
    return [x for x in sites if x not in HEAD_SITES]


def _edit_keyword(edit: Any) -> dict[str, Any]:
    """The keyword ``compare`` takes ``edit`` under: ``clamp=`` for a
    :class:`vlens.Clamp` (it has an SAE), ``steer=`` for anything else."""
    return {"clamp" if getattr(edit, "sae", None) is not None else "steer": edit}


class Selection(traitlets.HasTraits):
    """``layer`` (int), ``span`` ``(start, stop)`` of token positions (stop
    exclusive; ``(0, 0)`` selects nothing) and ``site``."""

    layer = traitlets.Int(0)
    span = traitlets.Tuple(traitlets.Int(), traitlets.Int(), default_value=(0, 0))
    site = traitlets.Unicode("resid_post")

    @traitlets.validate("layer")
    def _check_layer(self, proposal):
        if proposal["value"] < 0:
            raise traitlets.TraitError(f"layer must be >= 0, got {proposal['value']}")
        return proposal["value"]

    @traitlets.validate("span")
    def _check_span(self, proposal):
        start, stop = (int(x) for x in proposal["value"])
        if not 0 <= start <= stop:
            raise traitlets.TraitError(
                f"span ({start}, {stop}) is not a token span: need 0 <= start <= stop"
            )
        return (start, stop)


class Controller(traitlets.HasTraits):
    """Calls the Session for the widgets; ``run`` is the traced prompt's Run.

    ``trace(prompt)`` reads every site at every layer (the attention
    pattern too, not the per-head ``q``/``k``/``v``/``z``) and the logit
    lens's top 5 tokens (one engine batch) and sets ``run``. ``direction`` is computed
    once per (prompt lists, layer, site) and reused. ``compare`` and
    ``sweep`` return the Session's Comparison and Sweep. Every call
    generates ``max_new_tokens`` tokens and passes ``progress`` on.
    """

    run = traitlets.Instance(Run, allow_none=True, help="the Run of the traced prompt")

    def __init__(self, session: Any, *, max_new_tokens: int = 16) -> None:
        super().__init__()
        self.session = session
        self.max_new_tokens = max_new_tokens
        self._directions: dict[tuple, Any] = {}

    def trace(self, prompt: Any, *, progress: Progress | None = None, keep: bool = True) -> Run:
        """Trace ``prompt`` for every view and set ``run`` (unless ``keep`` is False)."""
        s = self.session
        # per-head sites would double the read for nothing the views show
        sites = [x for x in s.sites if x not in PER_HEAD_SITES]
        run = s.trace([prompt], layers=None, sites=sites, logit_lens=TOP_K,
                      max_new_tokens=self.max_new_tokens, progress=progress)
        if keep:
            self.run = run
        return run

    def prompt_tokens(self, prompt: Any) -> list[str]:
        """The tokens of ``prompt`` (a string or a conversation) as text (no
        engine call; ``[]`` for blank)."""
        s = self.session
        if isinstance(prompt, str):
            return s.token_strings(s.tokenize(prompt)) if prompt.strip() else []
        return s.token_strings(s.prompts([prompt])[0].ids)

    def has_direction(self, positive: Sequence[str], negative: Sequence[str], *,
                      layer: int, site: str) -> bool:
        return (tuple(positive), tuple(negative), layer, site) in self._directions

    def direction(self, positive: Sequence[str], negative: Sequence[str], *, layer: int,
                  site: str, progress: Progress | None = None) -> Any:
        """``session.direction(positive, negative, layer=, site=)``, cached."""
        key = (tuple(positive), tuple(negative), layer, site)
        if key not in self._directions:
            self._directions[key] = self.session.direction(
                positive=list(positive), negative=list(negative), layer=layer, site=site,
                progress=progress)
        return self._directions[key]

    def compare(self, prompt: str, steer: Any, *, progress: Progress | None = None) -> Any:
        """Baseline vs ``steer`` (a Steer, or a Clamp: sent as ``clamp=``)
        on ``prompt``, one engine batch."""
        return self.session.compare([prompt], **_edit_keyword(steer), progress=progress,
                                    max_new_tokens=self.max_new_tokens)

    def stream_compare(self, prompt: str, steer: Any) -> Any:
        """``compare``, token by token: partial ``(baseline, steered)`` Runs
        after every engine step, the finished Comparison last."""
        return self.session.stream_compare([prompt], **_edit_keyword(steer),
                                           max_new_tokens=self.max_new_tokens)

    def stream_ablation(self, prompt: str, ablate: Any) -> Any:
        """Like :meth:`stream_compare`, with ``ablate`` (a
        :class:`vlens.Ablate` or a list) in place of a steer: the prompt
        runs twice in ONE engine batch, plain and ablated
        (``session.stream(..., ablate=PerPrompt([None, ablate]))``); partial
        ``(baseline, ablated)`` Runs after every step, then a Comparison of
        the two (its ``steered`` is the ablated run; no KL is computed)."""
        s = self.session
        last = None
        # the smallest read a run can make: one layer's norms
        states = s.stream([prompt, prompt], ablate=PerPrompt([None, ablate]),
                          layers=[s.n_layers - 1], reduce="norm",
                          max_new_tokens=self.max_new_tokens)
        with closing(states):  # closed early (a replaced run): the engine aborts, in this thread
            for state in states:
                last = state
                if len(state) < 2:  # a server's first frames can hold one arm only
                    continue
                yield Run([state[0]], prompts=[prompt]), Run([state[1]], prompts=[prompt])
        yield Comparison(baseline=Run([last[0]], prompts=[prompt]),
                         steered=Run([last[1]], prompts=[prompt]), label="ablated")

    def sweep(self, prompt: str, steer: Any, scales: Sequence[float], *,
              progress: Progress | None = None) -> Any:
        """``steer`` at each of ``scales`` on ``prompt``, one engine batch."""
        return self.session.sweep(prompt, steer=steer, scales=list(scales),
                                  max_new_tokens=self.max_new_tokens, progress=progress)
