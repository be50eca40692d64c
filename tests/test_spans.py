"""One span grammar (#50): every form of ``span=`` selects the same rows in
``Steer``, ``Ablate``, ``s.patch``, ``s.direction``, ``Diff.direction`` and
the OpenAI body's ``vlens`` object, and a spelling whose meaning changed
is refused with an error naming the new one.

The rows each caller selects are read from what it hands the engine: a
Steer's and an Ablate's plan entries (``calls.request``, ``to_sets``), the
body's edits made into the same entries, a patch grid's positions and a
direction's mean over one-hot rows; then on the real engine (the bundled
model): the rows a Steer adds to, the positions a patch grid has, and a
direction equal to the mean of exactly those traced rows.
"""

from __future__ import annotations

import json

import pytest
import torch

import vlens
from vlens import calls, spans
from vlens.checks import ModelFacts
from vlens.remote.schema import BodyError, parse_body
from vlens.errors import VlensError
from vlens.methods import ablation, patching
from vlens.prompts import Prompt, resolve_spans
from vlens.results.run import span_mean

N, M = 8, 3  # prompt tokens; max_new_tokens (so N + M - 1 = 10 rows run)
T = N + M - 1
FACTS = ModelFacts(n_layers=2, hidden_size=4, sites=("resid_post",), writable=("resid_post",),
                   max_model_len=64, vocab_size=50)
PROMPT = Prompt(ids=list(range(1, N + 1)), text="", offsets=[], roles=[None] * N, label="",
                kind="ids")
ALL, PROMPT_ROWS = list(range(T)), list(range(N))

#: (name, the Python form, its JSON form, rows of an edit, rows of a prompt-only call;
#: None: refused there)
FORMS = [
    ("all", "all", "all", ALL, PROMPT_ROWS),
    ("prompt", "prompt", "prompt", PROMPT_ROWS, PROMPT_ROWS),
    ("generated", "generated", "generated", list(range(N, T)), None),
    ("last", "last", "last", [N - 1], [N - 1]),
    ("slice", slice(2, 5), [2, 5], [2, 3, 4], [2, 3, 4]),
    ("range", range(2, 5), [2, 5], [2, 3, 4], [2, 3, 4]),
    ("slice to the end", slice(6, None), [6, None], list(range(6, T)), [6, 7]),
    ("slice from 1 (no BOS)", slice(1, None), [1, None], list(range(1, T)), PROMPT_ROWS[1:]),
    ("negative slice", slice(-3, None), [-3, None], list(range(N - 3, T)), [5, 6, 7]),
    ("negative stop", slice(0, -2), [0, -2], list(range(N - 2)), list(range(N - 2))),
    ("positions", [1, 4, 5], {"positions": [1, 4, 5]}, [1, 4, 5], [1, 4, 5]),
    ("one position", 3, 3, [3], [3]),
    ("negative position", -1, -1, [N - 1], [N - 1]),
    ("tuple", (2, 5), [2, 5], [2, 3, 4], None),
]
IDS = [f[0] for f in FORMS]


def _plan_rows(steers=(), ablates=()) -> tuple[list[int], list[int]]:
    """The rows the plan entries of these (resolved) edits write."""
    req = calls.request("t", 0, PROMPT.ids, max_new_tokens=M, logprobs=False, clone=False,
                        steers=list(steers))
    sets, _ = ablation.to_sets(list(ablates), N, 1)

    def rows(entries):
        out = set()
        for e in entries:
            out |= set(range(e.start, T if e.stop == -1 else e.stop))
        return sorted(out)
    return rows(req.plan.adds), rows(sets)


def _edit_rows(span):
    steer = vlens.Steer(torch.ones(4), layer=0, span=span)
    ablate = vlens.Ablate("resid_post", 0, span=span)
    steers = resolve_spans([steer], PROMPT, 0, M)
    ablates = resolve_spans([ablate], PROMPT, 0, M)
    return _plan_rows(steers, ablates)


def _body_rows(wire):
    body = {"steer": [{"vector": "v", "layer": 0, "span": wire}],
            "ablate": [{"site": "resid_post", "layer": 1, "span": wire}]}
    body = json.loads(json.dumps(body))  # as it crosses the wire
    steers, ablates = parse_body(body, FACTS, {"v": torch.ones(4)}.get,
                                 lambda name: None).fit(FACTS, N, M)
    return _plan_rows(steers, ablates)


@pytest.mark.parametrize("name, form, wire, edit, prompt_only", FORMS, ids=IDS)
def test_every_span_form_selects_the_same_rows_everywhere(name, form, wire, edit, prompt_only):
    assert _edit_rows(form) == (edit, edit)  # Steer, Ablate
    assert _body_rows(wire) == (edit, edit)  # the OpenAI body
    assert spans.rows(spans.from_wire(wire), N, T) == edit
    eye = torch.eye(N)
    if prompt_only is None:
        with pytest.raises(VlensError):
            patching.span_positions(form, PROMPT, N)
        with pytest.raises(VlensError):
            span_mean(eye, form)
        return
    assert patching.span_positions(form, PROMPT, N) == prompt_only  # s.patch's grid
    picked = span_mean(eye, form)  # s.direction's mean of one-hot rows
    assert torch.nonzero(picked).flatten().tolist() == prompt_only
    assert torch.allclose(picked[prompt_only], torch.full((len(prompt_only),),
                                                          1 / len(prompt_only)))
    diff = span_mean(eye, form, call="Diff.direction")
    assert torch.equal(diff, picked)


def test_a_tuple_where_it_meant_positions_names_both_new_spellings():
    """Before 0.5 s.patch, s.direction, Diff.direction and
    s.attribution_patch read (3, 5) as the positions 3 and 5; a tuple is a
    range everywhere now, so there it is refused, not silently re-read."""
    want = r"meant the positions 3 and 5 .* write \[3, 5\] .* or slice\(3, 5\)"
    for call in (lambda: patching.span_positions((3, 5), PROMPT, N),
                 lambda: patching.span_positions((3, 5), PROMPT, N, "attribution_patch"),
                 lambda: span_mean(torch.eye(N), (3, 5)),
                 lambda: span_mean(torch.eye(N), (3, 5), call="Diff.direction")):
        with pytest.raises(VlensError, match=want):
            call()
    # the new spellings of both meanings
    assert patching.span_positions([3, 5], PROMPT, N) == [3, 5]
    assert patching.span_positions(slice(3, 5), PROMPT, N) == [3, 4]


@pytest.mark.parametrize("make, match", [
    (lambda: spans.parse((1, 2, 3)), r"a tuple is a range \(start, stop\); for positions pass "
                                     r"a list \[1, 2, 3\]"),
    (lambda: spans.parse((5, 2)), r"empty"),
    (lambda: spans.parse(slice(0, 6, 2)), r"has a step"),
    (lambda: spans.parse([1, 1]), r"names a position twice"),
    (lambda: spans.parse([]), r"at least one"),
    (lambda: spans.parse(True), r"must be a name"),
    (lambda: spans.parse("middle"), r"'middle' is unknown"),
    (lambda: spans.from_wire([1, 2, 3]), r"for positions send \{\"positions\""),
    (lambda: spans.from_wire({"rows": [1]}), r"\{\"positions\": \[p, ...\]\}"),
    (lambda: spans.from_wire(2.0), r"whole number"),
    (lambda: spans.rows(spans.parse([9]), N), r"position 9 is outside the prompt"),
    (lambda: spans.rows("user", N), r"needs a conversation"),
])
def test_malformed_spans_name_what_would_be_right(make, match):
    with pytest.raises(VlensError, match=match):
        make()


def test_one_word_for_heads_and_the_old_ones_name_it(llama_session):
    """``heads=`` in Ablate, trace, patch, attribution_patch and the body;
    query_heads= and per_head= (0.4's names) are TypeErrors naming it, and
    heads=True (0.4's attribution flag) a VlensError saying heads='all'."""
    s = llama_session
    assert vlens.Ablate("z", 0, heads=[1, 0]).heads == (0, 1)
    with pytest.raises(TypeError, match=r"takes heads= now \(query_heads="):
        vlens.Ablate("z", 0, query_heads=[0])
    with pytest.raises(TypeError, match=r"takes heads= now \(query_heads="):
        s.trace("w1 w2", sites=["attn_pattern"], query_heads=[0])
    with pytest.raises(TypeError, match=r"takes heads='all' \(per_head=True\)"):
        s.patch("w1 w2 w3", "w1 w4 w3", site="z", per_head=True)
    with pytest.raises(VlensError, match=r"heads=True: .* write heads='all'"):
        s.patch("w1 w2 w3", "w1 w4 w3", site="z", heads=True)
    with pytest.raises(VlensError, match=r"only site 'z' holds apart"):
        s.patch("w1 w2 w3", "w1 w4 w3", heads="all")
    p = s.patch("w1 w2 w3", "w1 w4 w3", site="z", heads=[2, 0], layers=[0],
                answer=("w5", "w6"))
    assert p.heads == [2, 0] and p.grid.shape == (1, 2) and p.columns == ["head 2", "head 0"]
    assert s.trace("w1 w2", max_new_tokens=1, layers=[0])[0].n_tokens > 0  # still serving


@pytest.mark.parametrize("name", ["all", "last", "slice", "negative slice", "positions",
                                  "one position", "negative position", "slice from 1 (no BOS)"])
def test_on_the_engine_a_span_is_the_same_rows_in_steer_patch_and_direction(toy_session, name):
    """The bundled model: a Steer over the span adds to those rows (the
    count the worker reports), a patch grid's columns are those positions,
    and a direction over it is the mean of exactly those traced rows."""
    _, form, _wire, edit, prompt_only = next(f for f in FORMS if f[0] == name)
    s = toy_session
    ids = s.tokenize("the fox was happy and the dog was sad")[:N]
    assert len(ids) == N
    clean, corrupt = {"prompt_token_ids": ids}, {"prompt_token_ids": ids[:-2] + ids[-1:] * 2}
    run = s.trace(clean, steer=vlens.Steer(torch.ones(s.hidden_size) * 1e-3, layer=1,
                                           span=form), max_new_tokens=M, layers=[1])[0]
    assert run.steered_rows == len(edit)
    p = s.patch(clean, corrupt, layers=[0], span=form, answer=(ids[1], ids[2]))
    assert p.positions == prompt_only
    d = s.direction([clean], [corrupt], layer=1, span=form)
    rows = [t.activations("resid_post", layer=1) for t in
            s.trace([clean, corrupt], layers=[1], max_new_tokens=1)]
    want = rows[0][prompt_only].mean(0) - rows[1][prompt_only].mean(0)
    assert torch.allclose(d, want, atol=1e-5)
