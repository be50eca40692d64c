"""How ``steer=`` is spelled and what a call leaves behind: one entry per
prompt only through ``vlens.PerPrompt``, ambiguous and doubled lists
refused, generated-token spans that cannot land refused while ones that
happen to cover nothing warn, and no call leaves edit functions, records or
unbounded vectors in the workers, whichever way it ends."""

from __future__ import annotations

import pytest
import torch

import vlens
from vlens.errors import EngineError, VlensError, VlensWarning

pytestmark = pytest.mark.engine

P = ["w1 w2 w3", "w4 w5 w6 w7", "w8 w9"]


@pytest.fixture(scope="module")
def steers(llama_session):
    g = torch.Generator().manual_seed(0)
    h = llama_session.hidden_size
    a = vlens.Steer(torch.randn(h, generator=g), layer=1, scale=4.0)
    b = vlens.Steer(torch.randn(h, generator=g), layer=2, scale=4.0)
    return a, b


def _clean(s) -> None:
    st = s.status()
    assert (st["records"], st["plans"], st["edit_fns"]) == (0, 0, 0), st
    assert s.engine.unfinished() == 0


def _refused(s, match: str, **kw) -> VlensError:
    before = s.engine.generate_calls
    with pytest.raises(VlensError, match=match) as err:
        s.trace(kw.pop("prompts", P[:2]), max_new_tokens=kw.pop("max_new_tokens", 3), **kw)
    assert s.engine.generate_calls == before  # refused before anything ran
    _clean(s)
    return err.value


# -- spelling -----------------------------------------------------------------
def test_per_prompt_steers_each_prompt_by_its_own_entry(llama_session, steers):
    a, b = steers
    run = llama_session.trace(P, sites=[], max_new_tokens=3,
                              steer=vlens.PerPrompt([a, None, [a, b]]))
    assert [t.steered_rows for t in run] == [run[0].n_tokens, 0, 2 * run[2].n_tokens]
    every = llama_session.trace(P[:2], sites=[], max_new_tokens=3,
                                steer=vlens.PerPrompt([[a, b]] * 2))
    assert [t.steered_rows for t in every] == [2 * t.n_tokens for t in every]
    # a plain list whose length is not the number of prompts: all on every prompt
    plain = llama_session.trace(P, sites=[], max_new_tokens=3, steer=[a, b])
    assert [t.steered_rows for t in plain] == [2 * t.n_tokens for t in plain]
    one = llama_session.trace(P[0], sites=[], max_new_tokens=3, steer=[a, b])
    assert one[0].steered_rows == 2 * one[0].n_tokens
    _clean(llama_session)


def test_a_list_as_long_as_the_prompts_is_ambiguous(llama_session, steers):
    a, b = steers
    err = _refused(llama_session, "ambiguous", steer=[a, b])
    assert "vlens.PerPrompt([s1, s2" in str(err) and "vlens.PerPrompt([[s1, s2" in str(err)


@pytest.mark.parametrize("make,match", [
    (lambda a, b: [a, None], r"list holding None or lists: .*vlens\.PerPrompt"),
    (lambda a, b: [[a], b], r"list holding None or lists"),
    (lambda a, b: [a, a, b], r"same Steer twice .*use scale=2x"),
    (lambda a, b: [a] * 3, r"same Steer twice"),
    (lambda a, b: vlens.PerPrompt([[a, a], None]), r"PerPrompt entry 0 holds the same Steer twice"),
    (lambda a, b: vlens.PerPrompt([a, b, None]), r"3 per-prompt entries for 2 prompts"),
    (lambda a, b: [a, "x"], r"must be vlens\.Steer objects, got str"),
])
def test_unclear_steering_lists_are_refused(llama_session, steers, make, match):
    _refused(llama_session, match, steer=make(*steers))


def test_the_same_vector_at_another_scale_or_layer_is_not_a_duplicate(llama_session, steers):
    a, _ = steers
    run = llama_session.trace(P[0], sites=[], max_new_tokens=2, steer=[a, a.with_scale(-4.0)])
    assert run[0].steered_rows == 2 * run[0].n_tokens


def test_per_prompt_entries_are_checked_when_made():
    with pytest.raises(VlensError, match="PerPrompt entry 1 is 3"):
        vlens.PerPrompt([None, 3])
    with pytest.raises(VlensError, match="one entry per prompt"):
        vlens.PerPrompt(None)


def test_compare_takes_per_prompt_steers(llama_session, steers):
    a, _ = steers
    cmp = llama_session.compare(P[:2], steer=vlens.PerPrompt([None, a]), max_new_tokens=3)
    assert [t.steered_rows for t in cmp.steered] == [0, cmp.steered[1].n_tokens]
    assert float(cmp.kl[0].abs().max()) < 1e-5 < float(cmp.kl[1][0])
    with pytest.raises(VlensError, match="ambiguous"):
        llama_session.compare(P[:2], steer=[a, a.with_scale(2.0)], max_new_tokens=3)


# -- generated-token spans ----------------------------------------------------
def test_a_generated_span_that_can_never_land_is_an_error(llama_session, steers):
    a, _ = steers
    gen = vlens.Steer(a.vector, layer=1, span="generated")
    _refused(llama_session, r"'generated' can never land with max_new_tokens=1",
             steer=gen, max_new_tokens=1)
    n = len(llama_session.tokenize(P[0]))
    late = vlens.Steer(a.vector, layer=1, span=(n + 2, n + 3))  # 4 new tokens: rows 0 … n+2
    t = llama_session.trace(P[0], sites=[], steer=late, max_new_tokens=4, ignore_eos=True)[0]
    assert t.steered_rows == 1
    _refused(llama_session, "reaches past the sequence", prompts=P[0],
             steer=late, max_new_tokens=3)


@pytest.mark.parametrize("span", ["generated", "tail"])
def test_a_generated_span_the_request_stopped_before_warns(llama_session, steers, span):
    a, _ = steers
    first = llama_session.trace(P[1], sites=[], max_new_tokens=4)[0].output_token_ids[0]
    n = len(llama_session.tokenize(P[1]))
    st = vlens.Steer(a.vector, layer=1, span="generated" if span == "generated" else (n, n + 2))
    with pytest.warns(VlensWarning, match=r"covered no token in prompt\(s\) \[1\]"):
        run = llama_session.trace(P[:2], steer=vlens.PerPrompt([None, st]), max_new_tokens=4,
                                  stop_token_ids=[first])
    t = run[1]
    assert t.output_token_ids == [first] and t.finish_reason == "stop"
    assert t.steered_rows == 0 and t.n_tokens == n
    _clean(llama_session)


# -- nothing left behind --------------------------------------------------------
def _halve(rows, ctx):
    return rows * 0.5


EDIT = dict(edit=_halve, edit_at=[("mlp_out", 1)])


def test_bad_sampling_with_an_edit_leaves_no_function_behind(llama_session):
    for _ in range(3):  # each retry used to add one
        _refused(llama_session, "bad sampling settings", top_p=5.0, **EDIT)
    _refused(llama_session, "max_tokens= is set by vlens", max_tokens=3, **EDIT)
    _refused(llama_session, "progress must be", progress="yes", **EDIT)
    budget = llama_session.read_budget
    llama_session.read_budget = 1
    try:
        _refused(llama_session, "read budget", **EDIT)
    finally:
        llama_session.read_budget = budget


def test_interrupt_with_an_edit_leaves_nothing_behind(llama_session):
    def stop(done, total):
        raise KeyboardInterrupt

    long = " ".join(f"w{(7 * i) % 240}" for i in range(200))
    with pytest.raises(KeyboardInterrupt):
        llama_session.trace([P[0], long], max_new_tokens=8, progress=stop, **EDIT)
    _clean(llama_session)


def test_a_failure_while_assembling_results_leaves_nothing_behind(llama_session, steers):
    a, _ = steers
    first = llama_session.trace(P[0], sites=[], max_new_tokens=3)[0].output_token_ids[0]
    gen = vlens.Steer(a.vector, layer=1, span="generated")
    # the warning is an error in this test run: it is raised while the
    # results are assembled, after the workers handed their records back
    with pytest.raises(VlensWarning):
        llama_session.trace(P[0], steer=gen, max_new_tokens=3, stop_token_ids=[first], **EDIT)
    _clean(llama_session)

    def boom(rows, ctx):
        raise RuntimeError("kaboom")

    with pytest.raises(EngineError, match="kaboom"):
        llama_session.trace(P[:2], edit=boom, edit_at=[("attn_out", 2)], max_new_tokens=2)
    _clean(llama_session)
    assert llama_session.trace(P[0], layers=[0], max_new_tokens=2)[0].n_tokens > 0


def test_vectors_held_by_the_workers_stay_bounded(llama_session):
    engine = llama_session.engine
    cap, hidden = engine.vector_cache, llama_session.hidden_size
    g = torch.Generator().manual_seed(1)
    prompts = [f"w{i % 240} w{(i * 7) % 240}" for i in range(100)]
    most, held_bytes = 0, []
    for call in range(10):  # 1,000 distinct vectors in all
        steer = vlens.PerPrompt([vlens.Steer(torch.randn(hidden, generator=g), layer=1)
                                 for _ in prompts])
        run = llama_session.trace(prompts, sites=[], max_new_tokens=1, steer=steer)
        assert all(t.steered_rows == t.n_tokens for t in run)
        st = llama_session.status()
        most = max(most, st["vectors"])
        assert st["vectors"] <= cap, (call, st)
        assert len(engine.vector_ids) == st["vectors"]
        held_bytes.append(st["vector_bytes"])
    assert most == min(cap, 1000)  # vectors stayed cached up to the cap
    # the workers' matrix grows by doubling to fit one call's vectors beside
    # the cached ones, then stops growing
    assert max(held_bytes) <= 2 * (cap + len(prompts)) * hidden * 4, held_bytes
    assert held_bytes[-1] == held_bytes[-4], held_bytes
    _clean(llama_session)


def _record(token_ids, start=0, steered_rows=0, restarts=0):
    """A record as the workers hand it back (``vlens_collect``'s wire form)."""
    positions = list(range(start, start + len(token_ids)))
    return {"req_id": "r", "token_ids": list(token_ids), "positions": positions, "reads": {},
            "errors": [], "copied_bytes": 0, "steered_rows": steered_rows,
            "step_rows": [len(token_ids)], "start": start, "restarts": restarts}


def test_records_that_start_after_cached_rows_are_matched_and_checked():
    from vllm.outputs import CompletionOutput

    from vlens.rows import match_record
    from vlens.calls import RequestSpec
    from vlens.protocol.plan import Add, Plan, Read

    comp = CompletionOutput(index=0, text="", token_ids=[7, 8, 9], cumulative_logprob=None,
                            logprobs=None)
    prompt = [1, 2, 3, 4]  # fed rows: 1 2 3 4 7 8
    steer_only = RequestSpec(prompt, Plan("t", adds=(Add("resid_post", 1, "v", 1.0),)), 3)
    older = _record([9, 9])
    rec = _record([3, 4, 7, 8], start=2, restarts=1)
    records = [older, rec]
    assert match_record(0, "p", steer_only, comp, records) is rec and records == [older]
    reading = RequestSpec(prompt, Plan("t", reads=(Read("resid_post", (0,)),)), 3)
    with pytest.raises(EngineError, match="rows 0 to 1 came from the prefix cache"):
        match_record(0, "p", reading, comp, [_record([3, 4, 7, 8], start=2)])
    with pytest.raises(EngineError, match="do not match the tokens vLLM processed"):
        match_record(0, "p", steer_only, comp, [_record([2, 4, 7, 8], start=1)])


def test_cached_rows_count_as_steered_within_each_span():
    from vlens.rows import cached_adds
    from vlens.protocol.plan import Add

    adds = [Add("resid_post", 1, "v", 1.0, 0, -1), Add("resid_post", 1, "v", 1.0, 5, 9),
            Add("resid_post", 1, "v", 1.0, 12, -1)]
    assert cached_adds(adds, 0) == 0
    assert cached_adds(adds, 8) == 8 + 3 + 0
    assert cached_adds(adds, 16) == 16 + 4 + 4
