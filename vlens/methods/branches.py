"""Branching a generation: what the model would have said had one token
gone the other way.

``Session.branches`` is one call in two stages. The first runs the prompt
as it goes (greedy unless sampling settings say otherwise), asking vLLM for
the top ``k + 1`` logprobs at every generated position (``logprobs=k+1``:
the alternatives, other than the token taken, at each one), as far as the
last branch point only (and one token past it: vLLM checks a stop token
after the length limit, so the first stage's own last token is one whose
stop check it would skip; that token is made again). Its ``assemble``
makes the second stage: the original's continuation from there (its
prompt the prompt and the tokens up to the last branch point, the same
steers, the top ``k + 1`` logprobs) and one request per branch, whose
prompt is the prompt's ids, the generated tokens before the branch point
and the forced token, generating the rest of ``max_new_tokens``; all of
them (and any ``background`` traffic) in ONE engine batch, so the
original's second half and the branches share their decode steps. These
requests read nothing and ask for no prompt logprobs, so vLLM serves the
prefix they share with the first run from the prefix cache (their
``cached_tokens``: every full KV block of that prefix, when prefix
caching is on). Sampling settings whose outcome depends on the output
so far (stop strings, penalties, ``min_tokens``, a temperature above 0)
keep the original whole in the first stage: a continuation would not
make the same tokens.

The original's continuation decodes in a batch with the branches: its
tokens are the ones it would make alone, its logprobs equal within the
last bits (vLLM's CPU build decodes a batch of several requests with other
kernels than one request alone), as the branches' own are.

Steering (``steer=``): ``steer_from="start"`` steers every run the whole
way (spans mean what they mean on the original prompt: ``"generated"`` is
the same rows in a branch as in the original); ``"branch"`` leaves the
first run unsteered and steers each branch's rows from its forced token on.
A steered request's KV is salted apart in the prefix cache, so steered
branches share KV only with requests of the same steers.

``Session.continue_from(trace, position, token)`` is the second stage for
one branch of any trace, beside a one-token probe of the prefix that asks
for the forced token's logprob (``logprob_token_ids``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vlens import calls, checks
from vlens.calls import Call
from vlens.edits import Steer
from vlens.errors import VlensError
from vlens.methods.answers import one_token
from vlens.methods.traces import steers_each
from vlens.prompts import Prompt, prompt_parts
from vlens.results.branches import Branches, alternatives_of
from vlens.results.run import Trace

__all__ = ["Branches", "K_MAX", "STEER_FROM", "branch_call", "continue_call"]

#: where steering starts: every run from the start, or each branch at its branch point
STEER_FROM = ("start", "branch")
#: the most alternatives per position (vLLM returns at most 20 logprobs: k + the one taken)
K_MAX = 19


@dataclass(frozen=True)
class _Fork:
    """What a branching call shares: the prompt, the total generation, the
    checked steers (spans as positions of the original's sequence), where
    they start, the sampling settings and the session's tokenizer."""

    prompt: Prompt
    max_new_tokens: int
    steers: tuple[Steer, ...]
    steer_from: str
    sampling: dict[str, Any]
    tokenizer: Any
    #: token ids -> their texts (``Session.token_strings``)
    names: Callable[[Sequence[int]], list[str]]

    @property
    def n0(self) -> int:
        return len(self.prompt.ids)

    @property
    def end(self) -> int:
        """Rows any request of the call runs: the prompt and every generated token fed back."""
        return self.n0 + self.max_new_tokens - 1

    def steers_at(self, rows: int, branch_row: int | None) -> list[Steer]:
        """The steers of a request that runs ``rows`` rows: all of them
        (``"start"``; those that reach its rows), or each from
        ``branch_row`` on (``"branch"``; None: the unsteered first run)."""
        if self.steer_from == "start":
            return [st for st in self.steers if _span(st, self.end)[0] < rows]
        if branch_row is None:
            return []
        out = []
        for st in self.steers:
            lo, hi = _span(st, self.end)
            lo = max(lo, branch_row)
            if lo >= hi:
                raise VlensError(
                    f"Steer span {st.span} ends before the branch point (row {branch_row}): "
                    "steer_from='branch' steers only from the forced token on; give the "
                    "Steer a span that reaches past it (span='all' or 'generated')")
            out.append(_with_span(st, (lo, hi)))
        return out


def _span(st: Steer, end: int) -> tuple[int, int]:
    if st.span == "all":
        return 0, end
    start, stop = st.span  # a range (names and runs are resolved per prompt first)
    return start, end if stop is None else stop


def _with_span(st: Steer, span: Any) -> Steer:
    """``st`` over ``span`` (a copy: its vector, already checked, stays bit for bit)."""
    new = copy.copy(st)
    object.__setattr__(new, "span", span)
    return new


def _fork(session: Any, prompt: Prompt, max_new_tokens: Any, steer: Any, steer_from: Any,
          sampling: dict[str, Any]) -> _Fork:
    facts = session.facts
    checks.check_generation(max_new_tokens, sampling, facts)
    if sampling.get("n", 1) not in (1, None):
        raise VlensError(f"branches follow one generation: n must be 1, got n={sampling['n']!r}")
    if steer_from not in STEER_FROM:
        raise VlensError(f"steer_from must be one of {STEER_FROM}, got {steer_from!r}")
    n0, m = len(prompt.ids), max_new_tokens
    each = steers_each(steer, None, [prompt], m, facts)[0]
    named = {"prompt": (0, n0), "generated": (n0, n0 + m - 1)}
    steers = tuple(_with_span(st, named[st.span]) if st.span in named else st for st in each)
    return _Fork(prompt, m, steers, steer_from, dict(sampling), session.tokenizer,
                 session.token_strings)


def _positions(at: Any, max_new_tokens: int) -> list[int]:
    if checks.is_int(at):
        at = [at]
    if isinstance(at, range):
        at = list(at)
    if not isinstance(at, (list, tuple)) or not all(checks.is_int(a) for a in at):
        raise VlensError(f"at must be a generated position (an int, 0 = the first generated "
                         f"token) or a list of them, got {at!r:.60}")
    bad = [a for a in at if not 0 <= a < max_new_tokens]
    if bad:
        raise VlensError(f"at={bad[0]} is outside the generation: max_new_tokens="
                         f"{max_new_tokens} gives positions 0 to {max_new_tokens - 1}")
    if len(set(at)) != len(at):
        raise VlensError(f"at={list(at)} names a position twice")
    return list(at)


def _top_k(k: Any) -> int:
    if not checks.is_int(k) or not 1 <= k <= K_MAX:
        raise VlensError(f"k must be an int from 1 to {K_MAX} (alternatives per position), "
                         f"got {k!r}")
    return k




def _text(tokenizer: Any, prompt: list[int], out: list[int]) -> str:
    """The generated text as vLLM writes it: decoded after the prompt."""
    head = tokenizer.decode(prompt, skip_special_tokens=True)
    whole = tokenizer.decode(prompt + out, skip_special_tokens=True)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(
        out, skip_special_tokens=True)


# -- the branch batch ---------------------------------------------------------------

def _branch_stage(fork: _Fork, base: Trace, forks: Sequence[tuple[int, int, float | None]],
                  background: Sequence[list[int]], finish: Callable[..., Any],
                  extra: Sequence[calls.RequestSpec] = (),
                  forced_lp: Callable[[list], list[float | None]] | None = None) -> Any:
    """One request per fork ``(position, token id, its logprob)`` of
    ``base``'s generation that has tokens left to make (with ``extra``
    requests first and ``background`` last), and an ``assemble`` that hands
    ``finish(branch traces, outputs, collected, runs)`` the branch traces
    (and the stage's all, for the ``extra`` requests' own).
    ``forced_lp(outputs)``: the forced tokens' logprobs from the outputs
    (when the forks do not bring them)."""
    n0, m = fork.n0, fork.max_new_tokens
    tag = calls.new_tag()
    requests: list[calls.RequestSpec] = list(extra)
    slots: list[int | None] = []
    for i, (a, tok, _) in enumerate(forks):
        if m - a - 1 < 1:  # the forced token is the last one: nothing to generate
            slots.append(None)
            continue
        ids = list(fork.prompt.ids) + base.output_token_ids[:a] + [tok]
        slots.append(len(requests))
        requests.append(calls.request(
            f"{tag}-{i}", i, ids, max_new_tokens=m - a - 1, logprobs=True, clone=False,
            steers=fork.steers_at(fork.end, n0 + a), sampling=fork.sampling,
            score={"prompt_logprobs": None}, source=fork.prompt))
    traced = len(requests)
    requests += [calls.background(ids, m, fork.sampling) for ids in background]

    def assemble(outputs: list, collected: dict, runs: calls.Assembler) -> Any:
        lps = forced_lp(outputs) if forced_lp else [f[2] for f in forks]
        own = [r for r in requests[len(extra):traced]]
        raw = runs.build_run([base.prompt] * len(own), own, outputs[len(extra):traced],
                             collected, True) if own else []
        made = [_branch_trace(fork, base, a, tok, lp, None if s is None else
                              raw[s - len(extra)])
                for (a, tok, _), lp, s in zip(forks, lps, slots)]
        return finish(made, outputs, collected, runs)

    if not requests:  # every branch ends at its forced token
        return assemble([], {}, None)  # type: ignore[arg-type]
    return Call(requests, assemble)


def _branch_trace(fork: _Fork, base: Trace, a: int, tok: int, lp: float | None,
                  raw: Trace | None) -> Trace:
    """A branch as one whole generation: ``base``'s tokens before ``a``, the
    forced ``tok`` (logprob ``lp``), then ``raw``'s continuation (None:
    nothing was left to generate)."""
    n0 = fork.n0
    prompt = list(fork.prompt.ids)
    cont = raw.output_token_ids if raw is not None else []
    out = base.output_token_ids[:a] + [tok] + list(cont)
    before = base.logprobs[:n0 + a] if base.logprobs else [None] * (n0 + a)
    after = raw.logprobs[len(raw.prompt_token_ids):] if raw is not None else []
    if raw is not None:
        rows = dict(token_ids=raw.token_ids, tokens=raw.tokens, positions=raw.positions,
                    finish_reason=raw.finish_reason, steered_rows=raw.steered_rows,
                    step_rows=raw.step_rows, cached_tokens=raw.cached_tokens,
                    restarts=raw.restarts)
    else:
        fed = prompt + out[:-1]
        rows = dict(token_ids=fed, tokens=fork.names(fed),
                    positions=list(range(len(fed))), finish_reason="length")
    start = rows.get("cached_tokens", 0)
    return Trace(index=0, prompt=base.prompt, sample=0, prompt_token_ids=prompt,
                 output_token_ids=out, text=_text(fork.tokenizer, prompt, out),
                 output_tokens=fork.names(out), logprobs=[*before, lp, *after],
                 branch_point=a, forced=tok, **rows,
                 **prompt_parts(fork.prompt, n0, rows["token_ids"], start))


# -- the calls ------------------------------------------------------------------------

def branch_call(session: Any, prompt: Any, at: Any, *, k: Any = 3, max_new_tokens: Any = 16,
                steer: Any = None, steer_from: Any = "start", background: Sequence[Any] = (),
                sampling: dict[str, Any] | None = None) -> Call:
    """``Session.branches`` as one call in two stages (see the module doc)."""
    plist = session.prompts(prompt)
    if len(plist) != 1:
        raise VlensError(f"branches takes one prompt, got {len(plist)}: call it once per prompt")
    k = _top_k(k)
    fork = _fork(session, plist[0], max_new_tokens, steer, steer_from, dict(sampling or {}))
    positions = _positions(at, fork.max_new_tokens)
    for a in positions:  # a steer that cannot start at a branch point: refused now
        fork.steers_at(fork.end, fork.n0 + a)
    bg = [p.ids for p in session.prompts(list(background))] if background else []
    m = fork.max_new_tokens
    # the first stage's tokens: up to the last branch point and one more (the
    # stop check of the last branch point's token), unless that is all of them
    split = max(positions, default=m) + 2
    if split >= m or not _continues(fork.sampling):
        split = m
    steers = fork.steers_at(fork.end, None)
    first = calls.request(f"{calls.new_tag()}-0", 0, fork.prompt.ids,
                          max_new_tokens=split, logprobs=True, clone=False,
                          steers=steers, sampling=fork.sampling,
                          score={"logprobs": k + 1}, source=fork.prompt)

    def assemble(outputs: list, collected: dict, runs: calls.Assembler) -> Any:
        head = runs.build_run([fork.prompt.label], [first], outputs, collected, True)[0]
        top = _top(outputs[0].outputs[0])
        made = len(head.output_token_ids)
        late = [a for a in positions if a >= made]
        if late:
            raise VlensError(f"at={late[0]}: the run stopped after {made} generated tokens "
                             f"(positions 0 to {made - 1}), so there is nothing to branch there")
        extra: list[calls.RequestSpec] = []
        if split < m and made == split:  # not stopped: the rest runs beside the branches
            kept = head.output_token_ids[:split - 1]
            extra.append(calls.request(
                f"{calls.new_tag()}-0", 0, list(fork.prompt.ids) + kept,
                max_new_tokens=m - len(kept), logprobs=True, clone=False, steers=steers,
                sampling=fork.sampling, score={"logprobs": k + 1, "prompt_logprobs": None},
                source=fork.prompt))

        def finish(branches: list[Trace], outs: list, got: dict, runs2: Any) -> Branches:
            original, tops = head, top
            if extra:
                rest = runs2.build_run([fork.prompt.label], extra, outs[:1], got, True)[0]
                original = _joined(fork, head, rest, split - 1, first.plan.adds)
                tops = top[:split - 1] + _top(outs[0].outputs[0])
            alts = alternatives_of(tops, original.output_token_ids, k, runs.token_strings)
            return Branches([original, *branches], positions, alts, k)

        alts = alternatives_of(top, head.output_token_ids, k, runs.token_strings)
        forks = [(a, alt.id, alt.logprob) for a in positions for alt in alts[a]]
        return _branch_stage(fork, head, forks, bg, finish, extra=extra)

    return Call([first], assemble)


#: sampling settings under which a run continued from its own tokens makes
#: what the whole run makes (greedy or not, nothing that looks back at the
#: output so far); any other setting keeps the original whole
_CONTINUABLE = frozenset({"n", "temperature", "top_p", "top_k", "min_p", "ignore_eos",
                          "stop_token_ids", "logit_bias", "allowed_token_ids",
                          "skip_special_tokens", "spaces_between_special_tokens"})


def _continues(sampling: dict[str, Any]) -> bool:
    """Whether the original's tail may run as a continuation of its head:
    greedy, and no setting that looks at the output so far."""
    return (set(sampling) <= _CONTINUABLE
            and float(sampling.get("temperature", 0.0) or 0.0) == 0.0)


def _top(comp: Any) -> list[dict[int, float]]:
    """Each generated position's top logprobs, ``{token id: logprob}``."""
    return [{int(i): float(x.logprob) for i, x in entry.items()}
            for entry in (comp.logprobs or [])]


def _joined(fork: _Fork, head: Trace, rest: Trace, cut: int, adds: Sequence[Any]) -> Trace:
    """The original as one generation: ``head``'s first ``cut`` generated
    tokens (and the prompt's logprobs), then ``rest``'s continuation of
    them. ``adds``: the original's steering adds (its steered rows)."""
    n0 = fork.n0
    out = head.output_token_ids[:cut] + list(rest.output_token_ids)
    fed = list(fork.prompt.ids) + out[:-1]
    logprobs = head.logprobs[:n0 + cut] + rest.logprobs[n0 + cut:]
    return Trace(index=head.index, prompt=head.prompt, sample=head.sample,
                 prompt_token_ids=list(fork.prompt.ids), output_token_ids=out,
                 text=_text(fork.tokenizer, list(fork.prompt.ids), out), token_ids=fed,
                 tokens=fork.names(fed), output_tokens=fork.names(out),
                 positions=list(range(len(fed))), logprobs=logprobs,
                 finish_reason=rest.finish_reason,
                 steered_rows=sum(a.rows_in(0, len(fed)) for a in adds),
                 step_rows=head.step_rows + rest.step_rows, cached_tokens=head.cached_tokens,
                 restarts=head.restarts + rest.restarts,
                 **prompt_parts(fork.prompt, n0, fed, head.cached_tokens))


def continue_call(session: Any, trace: Any, position: Any, token: Any, *,
                  max_new_tokens: Any = 16, steer: Any = None, steer_from: Any = "start",
                  sampling: dict[str, Any] | None = None) -> Call:
    """``Session.continue_from``: ``trace``'s generation up to ``position``,
    then ``token``, continued to ``max_new_tokens`` in all; a one-token
    probe of the prefix beside it gives the forced token's logprob."""
    if not isinstance(trace, Trace):
        raise VlensError(f"continue_from takes a Trace (a run's or a branch's), got "
                         f"{type(trace).__name__}")
    made = len(trace.output_token_ids)
    if not checks.is_int(position) or not 0 <= position < made:
        raise VlensError(f"position must be a generated position of the trace, 0 to {made - 1}, "
                         f"got {position!r}")
    tok = one_token(session, token, "token")
    prompt = _prompt_of(trace)
    fork = _fork(session, prompt, max_new_tokens, steer, steer_from, dict(sampling or {}))
    if position >= fork.max_new_tokens:
        raise VlensError(f"position {position} is past max_new_tokens={fork.max_new_tokens}: "
                         "ask for more tokens in all")
    ids = list(prompt.ids) + trace.output_token_ids[:position]
    probe = calls.request(f"{calls.new_tag()}-probe", 0, ids, max_new_tokens=1, logprobs=False,
                          clone=False, steers=fork.steers_at(len(ids), None),
                          sampling={k: v for k, v in fork.sampling.items() if k != "n"},
                          score={"logprob_token_ids": [tok]}, source=prompt)

    def forced_lp(outputs: list) -> list[float | None]:
        entry = (outputs[0].outputs[0].logprobs or [{}])[0]
        return [float(entry[tok].logprob) if tok in entry else None]

    return _branch_stage(fork, trace, [(position, tok, None)], [], lambda made, *_: made[0],
                         extra=[probe], forced_lp=forced_lp)


def _prompt_of(trace: Trace) -> Prompt:
    """``trace``'s prompt as a normalised Prompt (its roles when the trace
    holds them all)."""
    n0 = len(trace.prompt_token_ids)
    roles = list(trace.roles[:n0]) if trace.cached_tokens == 0 and len(trace.roles) >= n0 \
        else [None] * n0
    offsets = list(trace.offsets) if len(trace.offsets) == n0 else [(0, 0)] * n0
    return Prompt(list(trace.prompt_token_ids), trace.prompt_text or trace.prompt, offsets, roles,
                  trace.prompt, kind="chat" if any(roles) else "ids")
