"""Activation patching: which (layer, position) carries what the clean
prompt knows and the corrupt one does not.

For each cell of the grid, the clean run's activation at that (layer,
position) replaces the corrupt run's, and the metric asks how much of the
clean answer comes back:

    ld(run)  = log p(clean answer) - log p(corrupt answer)   (last position)
    cell     = (ld(patched) - ld(corrupt)) / (ld(clean) - ld(corrupt))

1 = the clean run's logit difference fully restored, 0 = the corrupt run's.
(A difference of log-probabilities of one distribution is the difference of
the logits.)

The cost is two engine calls whatever the grid's size: one batch of two
requests reads the clean and corrupt activations (and each run's top next
tokens); then every cell is its own request -- one ``Set`` in its plan
writes the clean row at its (layer, position) -- and all cells, with an
unpatched clean and corrupt run beside them, go to the engine in ONE batch,
each asking vLLM for the log-probabilities of the answer tokens
(``logprob_token_ids``) of its one generated token.

On the prefix cache: a patch at position ``p`` cannot change a row before
``p``, so on an engine that honours prefix marks (an in-process core,
:mod:`vlens.engine.prefix_cache`) each cell goes without a cache salt,
reads the corrupt run's cached KV blocks that end at or before its first
written position (the read stage computed and cached them) and computes
only the rest; the scheduler registers none of its blocks from that
position on, so no later request can take patched KV for the plain
prompt's. Elsewhere (``vlens serve``, an engine core in another process)
patched KV is salted apart like any edit's and every cell computes its
whole prompt. ``Patching.rows_computed`` / ``rows_cached`` say which it was.

``cell_logprobs`` covers a candidate set, not the whole vocabulary: the two
answers, the clean and corrupt runs' top ``TOP_K`` tokens and the cell's own
top token (vLLM returns the sampled token with the asked ones); a token
outside that set that a cell would rank high is not listed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlens import calls, checks
from vlens._progress import Stages
from vlens.calls import Call
from vlens.errors import EngineError, VlensError
from vlens.protocol.plan import Read, Set
from vlens import spans
from vlens.edits import vector_id
from vlens.methods.answers import answer_pair
from vlens.results.patching import Dist, Patching

__all__ = ["Patching", "patch_call", "TOP_K"]

#: how many of the clean and corrupt runs' top next tokens every cell scores
TOP_K = 10

# -- building the call ---------------------------------------------------------

def _check_args(session: Any, clean: Any, corrupt: Any, site: Any, layers: Any,
                span: Any, heads: Any) -> tuple[list[list[int]], list[int], list[int],
                                                 list[int] | None]:
    facts = session.facts
    if not isinstance(site, str) or site not in facts.sites:
        raise facts.no_such_site(site, "patch site")
    if site not in facts.writable:
        raise VlensError(
            f"patch site {site!r} cannot be written: use one of {', '.join(facts.writable)}"
        )
    heads = checks.check_head_cells(heads, site, facts, "patch")
    pair = [session.prompts(p) for p in (clean, corrupt)]
    if any(len(p) != 1 for p in pair):
        raise VlensError("patch takes two prompts (each a string, a conversation or "
                         "{'prompt_token_ids': [...]}): s.patch(clean, corrupt, ...)")
    ids = [p[0].ids for p in pair]
    if len(ids[0]) != len(ids[1]):
        raise VlensError(
            f"clean and corrupt prompts tokenize to {len(ids[0])} and {len(ids[1])} tokens; "
            "patching swaps rows position by position, so they must have the same length: "
            "change the corrupt prompt word for word (s.tokenize shows the tokens)"
        )
    layers = checks.check_layers(layers, facts)
    return ids, layers, span_positions(span, pair[0][0], len(ids[0])), heads


def span_positions(span: Any, clean: Any, n: int, what: str = "patch") -> list[int]:
    """``span=`` of a patch (or an attribution patch) as the clean prompt's
    positions, by the one span grammar (:mod:`vlens.spans`); None: every
    position. Only prompt rows are written, so ``"all"`` is the prompt and
    ``"generated"`` names nothing."""
    if span is None:
        return list(range(n))
    span = spans.parse(span, what, was_positions=True)
    if span == "generated":
        raise VlensError(f"{what} span='generated' names no prompt token: patching writes the "
                         "prompt's rows (span=None, 'prompt', a role, a range or positions)")
    roles = clean.roles if getattr(clean, "kind", None) == "chat" else None
    return spans.rows(span, n, n, roles, what)


def _top(comp: Any) -> dict[int, float]:
    """The first generated position's returned log-probabilities by id."""
    entry = comp.logprobs[0] if comp.logprobs else {}
    return {int(t): float(lp.logprob) for t, lp in entry.items()}


def _check_records(requests: Sequence[Any], collected: dict[str, list[dict]]) -> None:
    for req in requests:
        for rec in collected.get(req.plan.tag, []):
            if rec["errors"]:
                raise EngineError(f"patching request {req.plan.tag}: " + "; ".join(rec["errors"]))


def prefill_rows(outputs: Sequence[Any]) -> tuple[int, int]:
    """``(computed, cached)``: the prompt rows vLLM computed and read from
    the prefix cache over these outputs (None: not counted); a preempted
    request's recomputed rows are not counted again. A connected session's
    outputs do not say what was cached: all its rows count as computed."""
    computed = cached = 0
    for out in outputs:
        if out is None:
            continue
        hit = int(getattr(out, "num_cached_tokens", 0) or 0)
        cached += hit
        computed += len(out.prompt_token_ids or ()) - hit
    return computed, cached


def _read_stage(ids: list[list[int]], site: str, layers: list[int], then: Any,
                progress: Any) -> Call:
    """Clean and corrupt in one batch: ``then(activations, tops, rows)``
    with their activations ``[layers, T, width]``, their first next-token
    top-``TOP_K`` log-probabilities and their :func:`prefill_rows` gives
    the next stage. They are unedited: their KV blocks go to the prefix
    cache, where the cells find the corrupt run's."""
    tag = calls.new_tag()
    reads = [Read(site, tuple(layers), "full")]
    requests = [calls.request(f"{tag}-{name}", i, row, reads=reads, max_new_tokens=1,
                              logprobs=False, clone=False, score={"logprobs": TOP_K})
                for i, (name, row) in enumerate(zip(("clean", "corrupt"), ids))]

    def assemble(outputs: list, collected: dict, runs: calls.Assembler) -> Call:
        run = runs.build_run(["clean", "corrupt"], requests, outputs, collected, False)
        acts = [t.activations(site) for t in run]
        acts = [a.reshape(a.shape[0], a.shape[1], -1) for a in acts]  # z: [L, T, heads*hd]
        return then(acts, [_top(o.outputs[0]) for o in outputs], prefill_rows(outputs))

    return Call(requests, assemble, progress=progress)


@dataclass
class _Cells:
    """The cell batch of one patch call and how to read its outputs."""

    requests: list[Any]
    cells: list[tuple[int, int]]  # (row, column) of the grid, in request order after 2
    empty: Patching
    read_rows: tuple[int, int] = (0, 0)  # the read stage's prefill_rows

    def result(self, outputs: Sequence[Any], runs: calls.Assembler) -> Patching:
        """The Patching of these vLLM outputs (None or unfinished: NaN)."""
        p = self.empty
        clean_id, corrupt_id = p.answer

        def read(out) -> tuple[float, Dist] | None:
            if out is None or not out.finished:
                return None
            lps = _top(out.outputs[0])
            order = sorted(lps, key=lambda t: -lps[t])
            return lps[clean_id] - lps[corrupt_id], (runs.token_strings(order),
                                                     [lps[t] for t in order])

        grid = torch.full_like(p.grid, math.nan)
        diffs = torch.full_like(p.grid, math.nan)
        cell_lp: list[list[Dist | None]] = [[None] * grid.shape[1] for _ in range(grid.shape[0])]
        base = [read(o) for o in outputs[:2]]
        for (i, j), out in zip(self.cells, outputs[2:]):
            got = read(out)
            if got is not None:
                diffs[i, j] = got[0]
                cell_lp[i][j] = got[1]
        clean_diff = base[0][0] if base[0] else math.nan
        corrupt_diff = base[1][0] if base[1] else math.nan
        if base[0] and base[1]:
            span = clean_diff - corrupt_diff
            if abs(span) < 1e-6:
                raise VlensError(
                    f"the clean and corrupt runs give the same logit difference "
                    f"({clean_diff:.4g}) for answers {p.answer_text!r}: there is nothing to "
                    "restore; pick answers the two prompts disagree on (answer=(clean, corrupt))"
                )
            grid = (diffs - corrupt_diff) / span
        computed, cached = (a + b for a, b in zip(self.read_rows, prefill_rows(outputs)))
        return Patching(
            p.site, p.layers, p.positions, p.heads, p.tokens, p.answer, p.answer_text,
            grid.float(), diffs.float(), clean_diff, corrupt_diff, cell_lp,
            base[0][1] if base[0] else None, base[1][1] if base[1] else None,
            computed, cached,
        )

    def assemble(self, outputs: list, collected: dict, runs: calls.Assembler) -> Patching:
        _check_records(self.requests, collected)
        return self.result(outputs, runs)


def patch_call(session: Any, clean: str, corrupt: str, site: str = "resid_post",
               layers: Any = None, span: Any = None, answer: Any = None,
               heads: Any = None, progress: Any = None) -> Call:
    """Check the arguments, and make the patch as one call in two stages:
    the clean and corrupt runs read, then every cell's request (streamed:
    NaN where a cell has not finished). ``progress`` counts the requests of
    both stages."""
    ids, layers, positions, heads = _check_args(session, clean, corrupt, site, layers, span,
                                                heads)
    answer = answer_pair(session, answer)  # checked before anything runs
    # one progress over both stages (made after the checks above; closed when the call
    # ends, whichever way: no bar is left behind)
    n_cells = len(layers) * (len(heads) if heads is not None else len(positions))
    stages = Stages(progress, 2 + n_cells + 2)

    def cells(acts: list[torch.Tensor], tops: list[dict[int, float]],
              rows: tuple[int, int]) -> Call:
        chosen = answer
        if chosen is None:
            chosen = (max(tops[0], key=tops[0].get), max(tops[1], key=tops[1].get))
            if chosen[0] == chosen[1]:
                text = session.token_strings([chosen[0]])[0]
                raise VlensError(
                    f"the clean and corrupt prompts both predict {text!r} next, so there is "
                    "no difference to patch; pass answer=(clean_token, corrupt_token) with "
                    "the two tokens whose logit difference to measure"
                )
        pc = _cell_batch(session, ids, site, layers, positions, heads, chosen, acts, tops)
        pc.read_rows = rows
        return Call(pc.requests, pc.assemble, partial=pc.result, progress=stages.at(2))

    first = _read_stage(ids, site, layers, cells, stages.at(0))
    first.closing = stages.close
    return first


def _cell_batch(session: Any, ids: list[list[int]], site: str, layers: list[int],
                positions: list[int], heads: list[int] | None, answer: tuple[int, int],
                acts: list[torch.Tensor], tops: list[dict[int, float]]) -> _Cells:
    """Every cell's request beside an unpatched clean and corrupt run.
    On an engine with prefix marks a cell is marked with its first written
    position (module docstring); elsewhere it is salted."""
    facts = session.facts
    marks = bool(getattr(session.engine, "prefix_marks", False))
    cands = list(dict.fromkeys([*answer, *(sorted(tops[0], key=lambda t: -tops[0][t])),
                                *(sorted(tops[1], key=lambda t: -tops[1][t]))]))
    score = {"logprob_token_ids": cands}
    tag = calls.new_tag()
    corrupt_ids = ids[1]
    requests = [calls.request(f"{tag}-{name}", i, row, max_new_tokens=1, logprobs=False,
                              clone=False, score=score)
                for i, (name, row) in enumerate(zip(("clean", "corrupt"), ids))]
    cells: list[tuple[int, int]] = []
    vecs = {}  # (layer row, position) -> (vector id, clean row)
    for i, layer in enumerate(layers):
        for p in positions:
            row = acts[0][i, p]
            vecs[(i, p)] = (vector_id(row), row)
    columns: list[Any] = positions if heads is None else heads
    hd = facts.head_dim
    for i, layer in enumerate(layers):
        for j, col in enumerate(columns):
            if heads is not None:
                sets = [Set(site, layer, vecs[(i, p)][0], col * hd, (col + 1) * hd, p, p + 1)
                        for p in positions]
                used = {vecs[(i, p)][0]: vecs[(i, p)][1] for p in positions}
            else:
                vid, row = vecs[(i, col)]
                sets, used = [Set(site, layer, vid, 0, -1, col, col + 1)], {vid: row}
            requests.append(calls.request(
                f"{tag}-{i}.{j}", len(requests), corrupt_ids, max_new_tokens=1, logprobs=False,
                clone=False, sets=sets, vectors=used, score=score,
                prefix=min(st.start for st in sets) if marks else None))
            cells.append((i, j))
    shape = (len(layers), len(columns))
    toks = session.token_strings([ids[0][p] for p in positions])
    empty = Patching(
        site, layers, positions, heads, toks, answer,
        tuple(session.token_strings(list(answer))), torch.full(shape, math.nan),
        torch.full(shape, math.nan),
    )
    return _Cells(requests, cells, empty)
