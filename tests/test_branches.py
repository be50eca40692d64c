"""Branching a generation on the real engine (``s.branches``,
``s.continue_from``): every branch equals a fresh trace of the prompt and
its forced prefix, on a loaded engine (prefill chunks of 32 tokens, prefix
caching, a six-block KV cache that preempts a branch), sharing the prefix
cache; steering from the branch point; bad input refused."""

from __future__ import annotations

import html
import random

import pytest
import torch

import vlens
from vlens.errors import VlensError
from vlens.tokens import visible

pytestmark = pytest.mark.engine

KW = dict(ignore_eos=True)  # every run makes all its tokens: the positions are fixed


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(10, 250) for _ in range(n - 1)]


def _prompt(n: int, seed: int) -> dict:
    return {"prompt_token_ids": _ids(n, seed)}


def _fresh(s, branch, **kw):
    """A fresh trace of the branch's prompt and forced prefix (reads every
    layer: it recomputes every row, the prefix cache unused)."""
    n0, a = len(branch.prompt_token_ids), branch.branch_point
    ids = branch.prompt_token_ids + branch.output_token_ids[:a + 1]
    m = len(branch.output_token_ids) - a - 1
    return s.trace({"prompt_token_ids": ids}, max_new_tokens=m, **KW, **kw)[0], n0 + a + 1


def _same_as_fresh(s, b, exact: bool, **kw) -> None:
    """Each branch's continuation is the fresh trace's: tokens bit for bit;
    logprobs bit for bit when the branch decoded alone (``exact``), else
    within 1e-5 (vLLM's CPU build decodes a batch of several requests with
    other kernels than one request alone: the last bits differ; a branch of
    ``s.branches`` always decodes beside the original's continuation)."""
    for t in b.branches:
        fresh, cut = _fresh(s, t, **kw)
        assert t.output_token_ids[t.branch_point + 1:] == fresh.output_token_ids
        if exact:
            assert t.logprobs[cut:] == fresh.logprobs[cut:]  # bit for bit
        else:
            assert t.logprobs[cut:] == pytest.approx(fresh.logprobs[cut:], abs=1e-5)
        # the forced token's logprob: the original run's, as a fresh prefill scores it
        assert t.logprobs[cut - 1] == pytest.approx(fresh.logprobs[cut - 1], abs=1e-5)


def _same_original(original, plain, n0: int, last: int) -> None:
    """The original as the whole run makes it alone: tokens bit for bit;
    logprobs bit for bit up to the token after the last branch point
    ``last`` (the first stage's), then within 1e-5 (the continuation
    decodes in one batch with the branches)."""
    assert original.output_token_ids == plain.output_token_ids
    assert original.token_ids == plain.token_ids and original.text == plain.text
    assert original.finish_reason == plain.finish_reason
    cut = n0 + last + 1
    assert original.logprobs[:cut] == plain.logprobs[:cut]  # bit for bit
    assert original.logprobs[cut:] == pytest.approx(plain.logprobs[cut:], abs=1e-5)


def test_every_branch_equals_a_fresh_trace_on_a_loaded_engine(loaded_session):
    """250 prompt tokens, a branch at generated position 3: each branch's
    prompt (254 tokens) shares one full 128-token block with the first run,
    and decoding past 256 tokens needs a third block, which six blocks
    cannot give three branches at once: vLLM preempts one."""
    s = loaded_session
    block = s.info["kv_block_size"]
    b = s.branches(_prompt(250, 1), at=3, k=3, max_new_tokens=16, **KW)
    assert len(b.traces) == 4 and b.original.branch_point is None and b.original.forced is None
    plain = s.trace(_prompt(250, 1), max_new_tokens=16, **KW)[0]
    _same_original(b.original, plain, 250, 3)
    taken = b.original.output_token_ids[3]
    alts = b.alternatives[3]
    assert [x.id for x in alts] == [t.forced for t in b.branches]
    assert taken not in [x.id for x in alts] and len({x.id for x in alts}) == 3
    assert [x.logprob for x in alts] == sorted((x.logprob for x in alts), reverse=True)
    assert any(t.restarts > 0 for t in b.branches), "the KV cache was meant to preempt a branch"
    shared = (250 + 3) // block * block
    assert shared >= block
    for t, alt in zip(b.branches, alts):
        assert t.branch_point == 3 and t.forced == alt.id
        assert t.output_token_ids[:3] == b.original.output_token_ids[:3]
        assert t.output_token_ids[3] == alt.id and len(t.output_token_ids) == 16
        assert t.logprobs[:250 + 3] == b.original.logprobs[:250 + 3]
        assert t.logprobs[253] == alt.logprob
        assert t.cached_tokens >= shared, (t.cached_tokens, shared)
        assert t.text == s.tokenizer.decode(t.prompt_token_ids + t.output_token_ids,
                                            skip_special_tokens=True)[len(
            s.tokenizer.decode(t.prompt_token_ids, skip_special_tokens=True)):]
    _same_as_fresh(s, b, exact=False)
    # one branch: its prefix from the cache; it decodes beside the original's
    # continuation (the second stage runs both in one batch), so within 1e-5
    one = s.branches(_prompt(250, 1), at=3, k=1, max_new_tokens=16, **KW)
    assert one.branches[0].cached_tokens >= shared
    _same_original(one.original, plain, 250, 3)
    _same_as_fresh(s, one, exact=False)
    assert s.status()["records"] == 0 and s.status()["plans"] == 0


def test_branch_points_as_a_list_and_continue_from(loaded_session):
    s = loaded_session
    # beside background traffic (untraced, as other users' would be)
    b = s.branches(_prompt(40, 2), at=[1, 5], k=2, max_new_tokens=10,
                   background=[_prompt(300, 9)], **KW)
    assert [t.branch_point for t in b.traces] == [None, 1, 1, 5, 5]
    assert b.at == [1, 5] and len(b.alternatives) == 10
    assert [t.forced for t in b.branches_at(5)] == [x.id for x in b.alternatives[5]]
    _same_as_fresh(s, b, exact=False)
    # continue_from a branch's token: the same trace, the forced token by text or id
    t = b.branches_at(5)[1]
    again = s.continue_from(b.original, 5, t.forced, max_new_tokens=10, **KW)
    assert again.output_token_ids == t.output_token_ids
    assert again.logprobs[:-10] == t.logprobs[:-10]
    assert again.logprobs[-9:] == pytest.approx(t.logprobs[-9:], abs=1e-5)
    assert again.logprobs[-10] == pytest.approx(t.logprobs[-10], abs=1e-5)
    assert (again.branch_point, again.forced, again.text) == (5, t.forced, t.text)
    by_text = s.continue_from(b.original, 5, s.tokenizer.decode([t.forced]),
                              max_new_tokens=10, **KW) \
        if len(s.tokenizer(s.tokenizer.decode([t.forced]), add_special_tokens=False)[
            "input_ids"]) == 1 else again
    assert by_text.output_token_ids == t.output_token_ids
    # a branch at the last position: the forced token ends it
    last = s.branches(_prompt(40, 2), at=9, k=2, max_new_tokens=10, **KW)
    assert [len(x.output_token_ids) for x in last] == [10, 10, 10]
    assert [x.finish_reason for x in last.branches] == ["length", "length"]
    # and continuing a branch further
    deeper = s.continue_from(t, 7, b.alternatives[0][0].id, max_new_tokens=10, **KW)
    assert deeper.output_token_ids[:7] == t.output_token_ids[:7]
    assert deeper.branch_point == 7 and len(deeper.output_token_ids) == 10


def test_steering_from_the_branch_point_or_from_the_start(loaded_session):
    s = loaded_session
    st = vlens.Steer(torch.randn(s.hidden_size, generator=torch.Generator().manual_seed(0)),
                     layer=1, scale=6.0)
    prompt, n0, m, a = _prompt(30, 3), 30, 10, 2
    b = s.branches(prompt, at=a, k=2, max_new_tokens=m, steer=st, steer_from="branch", **KW)
    plain = s.trace(prompt, max_new_tokens=m, **KW)[0]
    assert b.original.output_token_ids == plain.output_token_ids  # the first run unsteered
    for t in b.branches:
        # only the rows from the forced token on are steered
        assert t.steered_rows == (n0 + m - 1) - (n0 + a)
        at_branch = vlens.Steer(st.vector, layer=1, scale=6.0, span=(n0 + a, n0 + m - 1))
        fresh, cut = _fresh(s, t, steer=at_branch)
        assert t.output_token_ids[a + 1:] == fresh.output_token_ids
        assert t.logprobs[cut:] == pytest.approx(fresh.logprobs[cut:], abs=1e-5)
        unsteered, _ = _fresh(s, t)
        assert unsteered.output_token_ids != fresh.output_token_ids  # the steer acts
        # a fresh trace with the same steer reads the prefix rows unchanged
        rows = fresh.activations("resid_post", layer=2)
        ref = unsteered.activations("resid_post", layer=2)
        assert torch.equal(rows[:n0 + a], ref[:n0 + a])
        assert not torch.equal(rows[n0 + a], ref[n0 + a])
    again = s.continue_from(b.original, a, b.branches[0].forced, max_new_tokens=m, steer=st,
                            steer_from="branch", **KW)
    assert again.output_token_ids == b.branches[0].output_token_ids
    # from the start: every run steered, spans as on the original prompt
    gen = vlens.Steer(st.vector, layer=1, scale=6.0, span="generated")
    whole = s.branches(prompt, at=a, k=2, max_new_tokens=m, steer=[st, gen], **KW)
    ref = s.trace(prompt, max_new_tokens=m, steer=[st, gen], **KW)[0]
    _same_original(whole.original, ref, n0, a)
    assert whole.original.steered_rows == ref.steered_rows
    for t in whole.branches:
        fresh, cut = _fresh(s, t, steer=[st, vlens.Steer(st.vector, layer=1, scale=6.0,
                                                         span=(n0, n0 + m - 1))])
        assert t.output_token_ids[a + 1:] == fresh.output_token_ids
        assert t.logprobs[cut:] == pytest.approx(fresh.logprobs[cut:], abs=1e-5)
        assert t.steered_rows == 2 * (n0 + m - 1) - n0


def test_bad_input_is_refused_and_the_engine_stays_usable(loaded_session):
    s = loaded_session
    p = _prompt(20, 4)
    for kw, match in [
        (dict(at=-1), "outside the generation"),
        (dict(at=8), "outside the generation"),
        (dict(at=[1, 1]), "twice"),
        (dict(at="1"), "generated position"),
        (dict(at=1, k=0), "k must be"),
        (dict(at=1, k=40), "k must be"),
        (dict(at=1, steer_from="middle"), "steer_from"),
        (dict(at=1, n=2, temperature=1.0), "n must be 1"),
        (dict(at=1, max_new_tokens=0), "max_new_tokens"),
        (dict(at=1, steer=vlens.Steer(torch.ones(s.hidden_size), layer=9)), "layer"),
        (dict(at=1, steer=vlens.Steer(torch.ones(s.hidden_size), layer=0, span="prompt"),
              steer_from="branch"), "before the branch point"),
    ]:
        with pytest.raises(VlensError, match=match):
            s.branches(p, **{"max_new_tokens": 8, **kw})
    with pytest.raises(VlensError, match="one prompt"):
        s.branches(["a b", "c d"], at=0)
    with pytest.raises(TypeError, match="steer_from"):
        s.branches(p, at=0, steer_form="branch")
    # a run that stops early: a branch point past its end
    with pytest.raises(VlensError, match="stopped after"):
        s.branches(p, at=5, max_new_tokens=8, stop_token_ids=[s.trace(
            p, max_new_tokens=3, sites=[], **KW)[0].output_token_ids[2]])
    t = s.trace(p, max_new_tokens=6, sites=[], **KW)[0]
    for args, match in [((t, 6, 5), "generated position"), ((t, -1, 5), "generated position"),
                        ((t, 1, s.facts.vocab_size), "outside the vocabulary"),
                        ((t, 1, "w1 w2 w3"), "tokens"), (("text", 1, 5), "takes a Trace")]:
        with pytest.raises(VlensError, match=match):
            s.continue_from(*args, max_new_tokens=6)
    with pytest.raises(VlensError, match="past max_new_tokens"):
        s.continue_from(t, 4, 5, max_new_tokens=3)
    assert s.status()["records"] == 0 and s.status()["plans"] == 0
    assert len(s.branches(p, at=0, k=1, max_new_tokens=3).traces) == 2


def test_results_frame_figure_and_repr(loaded_session):
    s = loaded_session
    b = s.branches(_prompt(20, 5), at=[0, 2], k=2, max_new_tokens=5, **KW)
    frame = b.to_frame()
    assert list(frame["branch_point"].fillna(-1)) == [-1, 0, 0, 2, 2]
    assert frame["probability"].iloc[1:].between(0, 1).all()
    assert frame["divergence"].tolist()[1:] == [0, 0, 2, 2]
    assert frame["divergence"].isna().iloc[0]
    fig = b.figure()
    tokens = fig.data[0]
    assert len(tokens.text) == 5 + 2 * 5 + 2 * 3  # each branch from its branch point on
    assert "4 branches" in fig.layout.title.text
    assert "Branches(at=[0, 2], k=2" in repr(b) and "as it went" in repr(b)
    none = s.branches(_prompt(20, 5), at=[], k=2, max_new_tokens=5, **KW)
    assert len(none.traces) == 1 and len(none.alternatives) == 5
    assert none.original.output_token_ids == b.original.output_token_ids


# -- the view (Python side, on the real engine) -----------------------------------------

def test_branch_view_grows_branches_by_clicks(loaded_session, tmp_path):
    from vlens.widgets import BranchView

    s = loaded_session
    prompt = _prompt(24, 6)
    st = vlens.Steer(torch.randn(s.hidden_size, generator=torch.Generator().manual_seed(1)),
                     layer=1, scale=6.0)
    bv = BranchView(s, prompt, k=2, max_new_tokens=8, steer=st, **KW)
    first = bv.traces[0]
    assert bv.chips.tokens == first.output_tokens and len(bv.chips.probs) == 8
    assert bv.chips.probs[0] == pytest.approx(torch.tensor(first.logprobs[24]).exp().item())
    # click a token: its alternatives as buttons
    bv.chips.clicked = 3
    assert bv.wait(60) and bv.token == 3 and bv.error == ""
    buttons = bv.alternative_buttons.children
    alts = bv.result.alternatives[3]
    assert len(buttons) == 2 and repr(visible(alts[0].token)) in buttons[0].description
    # click an alternative: the branch grows, is shown, and sits beside the original
    buttons[1].click()
    assert bv.wait(120) and bv.error == ""
    grown = bv.traces[1]
    ref = s.continue_from(first, 3, alts[1].id, max_new_tokens=8, **KW)
    assert grown.output_token_ids == ref.output_token_ids and grown.text == ref.text
    assert bv.shown == 1 and bv.pair == (0, 1) and bv.divergence == 3
    assert bv.chips.start == 3 and "<mark" in bv._side.value
    assert html.escape(grown.text) in bv._text.value
    # a branch of the branch, past its branch point (its alternatives: one engine call)
    later = bv.alternatives(5)
    assert grown.output_token_ids[5] not in [a.id for a in later] and len(later) == 2
    deeper = bv.grow(5, later[0].id)
    assert deeper.output_token_ids[:5] == grown.output_token_ids[:5]
    assert [i for i, _ in bv._order()] == [0, 1, 2] and bv._tree.value == 2
    # the steer toggle: the next branch is steered from its branch point
    bv.steered = True
    steered = bv.grow(2, bv.alternatives(2, trace=0)[0].id, trace=0)
    ref = s.continue_from(first, 2, steered.forced, max_new_tokens=8, steer=st,
                          steer_from="branch", **KW)
    assert steered.output_token_ids == ref.output_token_ids and steered.steered_rows == 8 - 1 - 2
    assert "steered" in bv.label(3)
    # a bad click is an error in the view, which keeps working
    with pytest.raises(ValueError, match="not a generated position"):
        bv.alternatives(99)
    with pytest.raises(VlensError):
        bv.grow(1, s.facts.vocab_size)
    assert len(bv.traces) == 4
    path = bv.snapshot(tmp_path / "branches.html")
    page = path.read_text()
    assert "as it went" in page and html.escape(visible(first.output_tokens[0])) in page
    assert s.status()["records"] == 0
