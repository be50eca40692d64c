"""Steering and clone reads on the real engine: edits land on their request
only, whatever clone reads say; kept values never change; steered KV never
leaks into unsteered requests."""

from __future__ import annotations

import os

import pytest
import torch

import vlens
from vlens.errors import EngineError, VlensError

pytestmark = pytest.mark.engine


def _prompt(n_words: int, offset: int) -> str:
    return " ".join(f"w{(offset + 11 * i) % 240}" for i in range(n_words))


# mixed lengths; with max_num_batched_tokens=64 the long ones are chunked
PROMPTS = [_prompt(n, k) for k, n in enumerate([3, 40, 150, 8, 90, 1, 20])]


@pytest.fixture(scope="module")
def direction(llama_session):
    d = llama_session.direction(
        [_prompt(6, 1), _prompt(5, 2), _prompt(7, 3)],
        [_prompt(6, 101), _prompt(5, 102), _prompt(7, 103)],
        layer=1,
    )
    assert d.shape == (llama_session.hidden_size,)
    return d / d.norm()


@pytest.fixture(params=["native", "transformers"])
def session(request):
    return request.getfixturevalue(
        "llama_session" if request.param == "native" else "llama_tf_session"
    )


def _same(a, b) -> bool:
    """Bit-identical tokens and logprobs (same batch composition)."""
    return a.output_token_ids == b.output_token_ids and a.logprobs == b.logprobs


def _same_schedule(run_a, run_b) -> bool:
    """Both calls split every request over engine steps the same way."""
    return all(a.step_rows == b.step_rows for a, b in zip(run_a, run_b))


def _close(a, b, tol=1e-4) -> bool:
    """Same tokens, logprobs within float noise: for runs made in batches of
    different composition (other chunking, other matmul shapes)."""
    if a.output_token_ids != b.output_token_ids or len(a.logprobs) != len(b.logprobs):
        return False
    return all(
        (x is None and y is None) or abs(x - y) <= tol for x, y in zip(a.logprobs, b.logprobs)
    )


def test_steering_one_request_changes_only_that_request(session, direction):
    st = vlens.Steer(direction * 8, layer=1, scale=1.0)
    base = session.trace(PROMPTS, layers=[2], max_new_tokens=8)
    for k in (0, 2, 5):
        per_prompt = vlens.PerPrompt([st if i == k else None for i in range(len(PROMPTS))])
        run = session.trace(PROMPTS, layers=[2], steer=per_prompt, max_new_tokens=8)
        if os.environ.get("VLENS_TEST_ENGINE", "inproc") == "inproc":
            assert _same_schedule(base, run)  # so the exact comparison below runs
        for i, (b, r) in enumerate(zip(base, run)):
            if i == k:
                assert r.steered_rows == r.n_tokens
                assert not torch.equal(b.activations(), r.activations())
                assert b.logprobs != r.logprobs
            else:
                assert r.steered_rows == 0
                if _same_schedule(base, run):
                    assert _same(b, r), f"request {i} changed when only {k} was steered"
                    assert torch.equal(b.activations(), r.activations())
                else:
                    # An out-of-process engine core may split the batch into
                    # steps differently between two calls (requests arrive over
                    # IPC while it already steps), which changes float rounding.
                    # A leaked steer would still change tokens and logprobs.
                    assert _close(b, r), f"request {i} changed when only {k} was steered"
                    assert (b.activations() - r.activations()).abs().max() <= 1e-4


def test_steering_is_the_same_with_clone_reads_on_and_off(llama_session, direction):
    st = vlens.Steer(direction * 8, layer=1, site="resid_post", span="generated")
    assert llama_session.clone_reads is False
    off = llama_session.trace(PROMPTS[:4], steer=st, max_new_tokens=8)
    llama_session.clone_reads = True
    try:
        on = llama_session.trace(PROMPTS[:4], steer=st, max_new_tokens=8)
    finally:
        llama_session.clone_reads = False
    base = llama_session.trace(PROMPTS[:4], max_new_tokens=8)
    for a, b, c in zip(off, on, base):
        assert _same(a, b)
        assert torch.equal(a.activations(), b.activations())
        assert not _same(a, c)  # and the steer did something


def test_span_limits_the_rows_steered(llama_session, direction):
    prompt = PROMPTS[1]
    n_prompt = len(llama_session.tokenize(prompt))
    base = llama_session.trace(prompt, layers=[1], max_new_tokens=6)[0]
    for span, rows in (("prompt", range(0, n_prompt)),
                       ("generated", range(n_prompt, n_prompt + 5)),
                       ((3, 9), range(3, 9))):
        st = vlens.Steer(direction, layer=1, scale=5.0, span=span)
        t = llama_session.trace(prompt, layers=[1], steer=st, max_new_tokens=6)[0]
        assert t.steered_rows == len(rows)
        delta = (t.activations()[0] - base.activations()[0])[: n_prompt]
        # before the span starts nothing changed (causal model)
        assert torch.equal(delta[: rows.start], torch.zeros_like(delta[: rows.start]))
        if rows.start < n_prompt:
            assert delta[rows.start].norm() > 1.0


@pytest.mark.parametrize("bad,match", [
    (lambda d: vlens.Steer(torch.ones(7), layer=1), r"hidden size is 128"),
    (lambda d: vlens.Steer(torch.ones(128, dtype=torch.int64), layer=1), r"floating point"),
    (lambda d: vlens.Steer(torch.full((128,), float("nan")), layer=1), r"NaN or inf"),
    (lambda d: vlens.Steer(d, layer=3), r"Steer layer 3 does not exist"),
    (lambda d: vlens.Steer(d, layer=1, span=(2, 900)), r"reaches past the sequence"),
    (lambda d: vlens.Steer(d, layer=1, span=(5, 5)), r"is empty: give \(start, stop\) with start < stop"),
    (lambda d: vlens.Steer(d, layer=1, span="middle"), r"span 'middle' is unknown"),
    (lambda d: vlens.Steer(d, layer=1, site="positions"), r"cannot be written"),
    (lambda d: vlens.PerPrompt([vlens.Steer(d, layer=1), None]), r"2 per-prompt entries for 1 prompts"),
])
def test_bad_steering_is_refused_before_anything_runs(llama_session, direction, bad, match):
    before = llama_session.engine.generate_calls
    with pytest.raises(VlensError, match=match):
        llama_session.trace(PROMPTS[0], steer=bad(direction), max_new_tokens=4)
    assert llama_session.engine.generate_calls == before
    assert llama_session.trace(PROMPTS[0], layers=[0], max_new_tokens=2)[0].n_tokens > 0


def test_clone_reads_protect_values_kept_past_their_step(llama_session):
    """The positions input of a decoder layer is a buffer vLLM rewrites every
    step. An edit function that keeps what it was given keeps a copy with
    clone reads on, and a view of that buffer with them off."""
    prompt = PROMPTS[1]
    n_prompt = len(llama_session.tokenize(prompt))
    for clone in (True, False):
        kept = []
        llama_session.clone_reads = clone
        try:
            run = llama_session.trace(prompt, sites=["positions"], layers=[0],
                                      edit=lambda rows, ctx: kept.append((rows, ctx.positions)),
                                      edit_at=[("positions", 0)], max_new_tokens=5)
        finally:
            llama_session.clone_reads = False
        # what vlens itself kept is right in both modes
        assert run[0].activations("positions")[0].tolist() == list(range(n_prompt + 4))
        assert len(kept) >= 5
        if clone:
            for rows, positions in kept:  # every step's value distinct and correct
                assert rows.tolist() == list(positions)
        else:
            # pinned: views of the engine's buffer; by now they hold later steps'
            # positions, so the prefill view no longer reads 0, 1, 2 …
            stale = [rows.tolist() != list(positions) for rows, positions in kept]
            assert any(stale)
            assert kept[0][0].tolist()[0] != 0


def test_in_place_edit_that_is_not_returned_is_an_error(llama_session):
    def bad(rows, ctx):
        rows.mul_(0)  # forgets to return

    llama_session.clone_reads = True
    try:
        with pytest.raises(EngineError, match="return the edited tensor"):
            llama_session.trace(PROMPTS[0], edit=bad, edit_at=[("resid_post", 1)], max_new_tokens=2)
    finally:
        llama_session.clone_reads = False
    assert llama_session.status()["edit_fns"] == 0
    assert llama_session.trace(PROMPTS[0], layers=[0], max_new_tokens=2)[0].n_tokens > 0


def test_returned_edit_lands_with_clone_reads_on_and_off(llama_session):
    runs = []
    for clone in (False, True):
        llama_session.clone_reads = clone
        try:
            runs.append(llama_session.trace(
                PROMPTS[:3], layers=[1], edit=lambda rows, ctx: rows * 0.5,
                edit_at=[("mlp_out", 1)], max_new_tokens=5))
        finally:
            llama_session.clone_reads = False
    base = llama_session.trace(PROMPTS[:3], layers=[1], max_new_tokens=5)
    for a, b, c in zip(*runs, base):
        assert _same(a, b)
        assert not torch.equal(a.activations(), c.activations())


def test_error_in_edit_function_names_site_and_layer_and_engine_serves(llama_session):
    def boom(rows, ctx):
        raise RuntimeError("kaboom")

    with pytest.raises(EngineError, match=r"site attn_out, layer 2: RuntimeError: kaboom"):
        llama_session.trace(PROMPTS[:2], edit=boom, edit_at=[("attn_out", 2)], max_new_tokens=2)
    assert llama_session.trace(PROMPTS[0], layers=[0], max_new_tokens=2)[0].n_tokens > 0


def test_steered_kv_never_leaks_into_unsteered_requests(llama_session, direction):
    from vllm import SamplingParams

    engine = llama_session.engine
    prompt = _prompt(300, 77)  # > 256 tokens: two full 128-token cache blocks
    ids = llama_session.tokenize(prompt)
    assert len(ids) > 256
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)

    def plain():
        out = engine.generate([{"prompt_token_ids": ids}], params)[0]
        c = out.outputs[0]
        return c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], out.num_cached_tokens

    fresh = plain()  # this prompt was never run: nothing cached yet
    assert fresh[2] == 0
    st = vlens.Steer(direction * 8, layer=1)
    s1 = llama_session.trace(prompt, sites=[], steer=st, max_new_tokens=8)[0]
    after = plain()
    assert after[2] >= 256  # the unsteered run did read the prefix cache …
    assert after[:2] == fresh[:2]  # … its own blocks, not the steered ones
    s2 = llama_session.trace(prompt, sites=[], steer=st, max_new_tokens=8)[0]
    assert _same(s1, s2)
    assert s1.output_token_ids != list(fresh[0])


def test_compare_and_sweep_each_run_one_batch(llama_session, direction):
    engine = llama_session.engine
    st = vlens.Steer(direction * 8, layer=1)
    before = engine.generate_calls
    cmp = llama_session.compare(PROMPTS[:3], steer=st, max_new_tokens=6)
    assert engine.generate_calls == before + 1
    base = llama_session.trace(PROMPTS[:3], max_new_tokens=6)
    steered = llama_session.trace(PROMPTS[:3], steer=st, max_new_tokens=6)
    for i in range(3):
        assert _close(cmp.baseline[i], base[i])
        assert _close(cmp.steered[i], steered[i])
        assert cmp.kl[i].shape == (6,)
        assert float(cmp.kl[i][0]) > 0
    df = cmp.to_frame()
    assert len(df) == 18 and set(df.columns) >= {"token_base", "token_steered", "kl"}
    assert cmp.first_divergence[0] == next(
        (j for j, (a, b) in enumerate(zip(base[0].output_token_ids, steered[0].output_token_ids)) if a != b),
        None)

    before = engine.generate_calls
    sw = llama_session.sweep(PROMPTS[1], steer=st, scales=[-2, 0, 2, 4], max_new_tokens=6)
    assert engine.generate_calls == before + 1
    zero = sw.runs[1][0]
    assert _close(zero, base[1])  # scale 0 is the baseline
    frame = sw.to_frame()
    assert frame.scale.tolist() == [-2, 0, 2, 4]
    assert frame.kl_mean[1] == pytest.approx(0, abs=1e-6)
    assert (frame.kl_first[[0, 2, 3]] > 0).all()
