"""vLLM's recompute paths on the real engine: preemption, the prefix cache,
edits that alias engine memory, and the engine arguments a user passes.

The chaos engine (conftest's ``loaded_session``) has a KV cache far too
small for its batch (vLLM preempts and later recomputes requests), chunked
prefill of 32 tokens and prefix caching on. Every request of a loaded batch must come out as if
it had run alone.
"""

from __future__ import annotations

import random

import pytest
import torch

import vlens
from vlens.errors import VlensError

KV_BYTES = 64 * 2**20  # as tests/conftest.py gives every engine

WORDS = [f"w{i}" for i in range(240)]
# n > 1 needs sampling in vLLM; top_k=1 keeps it deterministic (each sample
# takes the argmax), so a batch can be compared with requests run alone
TWO_GREEDY = dict(n=2, temperature=1.0, top_k=1)


def _total_rows(t) -> int:
    """Rows the request ran: its prompt and every generated token fed back."""
    return len(t.prompt_token_ids) + len(t.output_token_ids) - 1


def _prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture
def chaos_session(loaded_session):
    """conftest's ``loaded_session`` (prefill chunks of 32 tokens, prefix
    caching on, a KV cache of six blocks): the ablation and SAE batch tests
    share its engine, so the run starts it once."""
    assert loaded_session.status()["records"] == 0
    return loaded_session


def _shrink(rows, ctx):
    return rows * 0.75


def _steers(direction, prompt_lens):
    """One steer per prompt, cycling through every span kind (and none)."""
    kinds = ["all", "prompt", "generated", "range", None]
    out = []
    for i, n in enumerate(prompt_lens):
        kind = kinds[i % len(kinds)]
        if kind is None:
            out.append(None)
            continue
        span = (max(0, n - 5), n + 3) if kind == "range" else kind
        layer = i % 3
        out.append(vlens.Steer(direction, layer=layer, scale=2.0 + i % 3, span=span,
                               site="resid_post" if i % 2 else "mlp_out"))
    return out


def _expected_steered(st, total_rows, prompt_len):
    if st is None:
        return 0
    start, stop = st.positions(prompt_len)
    stop = total_rows if stop < 0 else min(stop, total_rows)
    return max(0, stop - start)


def test_a_loaded_engine_gives_every_request_what_it_gets_alone(chaos_session):
    """48 requests: reads at two sites, steering with every span kind, an
    edit, n=2, repeated prompts, untraced background traffic; chunked
    prefill, prefix caching, and a KV cache that forces preemption."""
    s = chaos_session
    rng = random.Random(7)
    direction = torch.randn(s.hidden_size) / 4
    base = [_prompt(rng, rng.randint(20, 150)) for _ in range(20)]
    prompts = base + base[:4]  # repeated prompts
    lens = [len(s.tokenize(p)) for p in prompts]
    steers = _steers(direction, lens)
    kw = dict(layers=[0, 2], sites=["resid_post", "mlp_out"], max_new_tokens=12,
              edit=_shrink, edit_at=[("attn_out", 1)], **TWO_GREEDY)
    run = s.trace(prompts, steer=vlens.PerPrompt(steers),
                  background=[base[0], base[5], _prompt(rng, 140)], **kw)
    assert len(run) == 2 * len(prompts)  # 48 traced requests
    assert any(t.restarts > 0 for t in run), "the KV cache was meant to force preemption"
    for i, prompt in enumerate(prompts):
        alone = s.trace([prompt], steer=steers[i], **kw)
        for got, ref in zip([t for t in run if t.index == i], alone):
            assert got.output_token_ids == ref.output_token_ids, f"prompt {i}"
            assert got.token_ids == ref.token_ids and got.positions == ref.positions
            for site in ("resid_post", "mlp_out"):
                assert torch.allclose(got.activations(site), ref.activations(site), atol=1e-5)
            lp_got = torch.tensor([x for x in got.logprobs if x is not None])
            lp_ref = torch.tensor([x for x in ref.logprobs if x is not None])
            assert torch.allclose(lp_got, lp_ref, atol=1e-5)
            assert got.steered_rows == _expected_steered(steers[i], _total_rows(got), lens[i])
            assert got.cached_tokens == 0  # reads always recompute the prompt
    assert s.status()["records"] == 0 and s.status()["plans"] == 0


def test_steer_only_requests_under_preemption_and_the_prefix_cache(chaos_session):
    """No reads, no logprobs: these requests may reuse KV from the prefix
    cache (blocks of 128 tokens here) and are preempted too."""
    s = chaos_session
    rng = random.Random(11)
    direction = torch.randn(s.hidden_size) / 4
    long_prompts = [_prompt(rng, rng.randint(140, 200)) for _ in range(6)]
    prompts = long_prompts + long_prompts  # every prompt twice in one batch
    st = vlens.Steer(direction, layer=1, scale=3.0)
    kw = dict(sites=[], logprobs=False, max_new_tokens=10, steer=st, **TWO_GREEDY)
    run = s.trace(prompts, **kw)
    again = s.trace(prompts, **kw)  # a warm prefix cache
    assert any(t.cached_tokens > 0 for t in list(run) + list(again))
    for i, prompt in enumerate(long_prompts):
        cold = s.trace([prompt], **kw)  # once: both copies of the prompt must match it
        copies = (i, i + len(long_prompts))
        got = [x for r in (run, again) for x in r if x.index in copies]
        assert len(got) == 8  # two copies, two samples each, in both calls
        for t in got:
            assert t.output_token_ids == cold[0].output_token_ids
            assert t.steered_rows == _total_rows(t) == _total_rows(cold[0])


def test_steer_only_traces_on_a_warm_prefix_cache_match_a_cold_run(tiny_llama, engine_options):
    rng = random.Random(3)
    with vlens.Session(tiny_llama, reuse=False, max_model_len=512,
                       enable_prefix_caching=True, **engine_options) as s:
        prompt = _prompt(rng, 300)  # two full 128-token blocks and a rest
        st = vlens.Steer(torch.randn(s.hidden_size) / 4, layer=1, scale=2.0)
        kw = dict(sites=[], logprobs=False, max_new_tokens=8)
        cold = s.trace([prompt], steer=st, **kw)[0]
        assert cold.cached_tokens == 0
        s.generate([prompt], max_new_tokens=2)  # unsteered: must not be reused
        warm = s.trace([prompt], steer=st, **kw)[0]  # the same steer again
        assert warm.cached_tokens == 256
        assert warm.output_token_ids == cold.output_token_ids
        assert warm.steered_rows == cold.steered_rows == _total_rows(cold)
        pair = s.trace([prompt], steer=st, **TWO_GREEDY, **kw)
        assert [t.output_token_ids for t in pair] == [cold.output_token_ids] * 2
        plain = s.trace([prompt], **kw)[0]  # no steer: the steered KV stays apart
        assert plain.output_token_ids != cold.output_token_ids
        assert s.status()["records"] == 0


# -- edits that alias engine memory ------------------------------------------

def _in_place_half(rows, ctx):
    rows.mul_(0.5)
    return rows


def _view_of_in_place_half(rows, ctx):
    rows.mul_(0.5)
    return rows[:]


def _new_half(rows, ctx):
    return rows * 0.5


@pytest.mark.parametrize("clone", [False, True])
@pytest.mark.parametrize("session", ["llama_session", "llama_tf_session"],
                         ids=["native", "transformers"])
def test_in_place_edit_lands_once_at_every_writable_site(session, clone, request):
    s = request.getfixturevalue(session)
    prompt = "w3 w9 w27 w81 w4 w12"
    s.clone_reads = clone
    try:
        for site in ("resid_pre", "resid_post", "attn_out", "mlp_out"):
            for layer in (0, 1):
                kw = dict(layers=[layer], sites=[site], max_new_tokens=1, logprobs=False)
                base = s.trace([prompt], **kw)[0].activations(site)
                for fn in (_in_place_half, _view_of_in_place_half, _new_half):
                    got = s.trace([prompt], edit=fn, edit_at=[(site, layer)], **kw)[0]
                    assert torch.allclose(got.activations(site), 0.5 * base, atol=1e-5), (
                        site, layer, fn.__name__)
    finally:
        s.clone_reads = False
    assert s.status()["edit_fns"] == 0


# -- the step pre-hook ---------------------------------------------------------

def test_a_malformed_plan_is_reported_on_its_request_and_the_engine_serves(llama_session):
    from vllm import SamplingParams

    s = llama_session
    engine = s.engine
    bad = SamplingParams(max_tokens=3, temperature=0.0,
                         extra_args={"vlens": {"v": 4, "tag": "broken-1", "reads": [{"site": 1}]}})
    with engine.lock:
        outs = engine.generate([{"prompt_token_ids": s.tokenize("w1 w2 w3")}], [bad])
        got = engine.rpc("vlens_collect", ["broken-1"])[0]["broken-1"]
    assert len(outs[0].outputs[0].token_ids) == 3  # the step ran to the end
    assert got and "its plan was refused" in got[0]["errors"][0]
    run = s.trace(["w1 w2 w3"], layers=[0], max_new_tokens=2)
    assert run[0].activations().shape[1] == run[0].n_tokens
    assert s.status()["records"] == 0 and s.status()["plans"] == 0


# -- the user's engine arguments win ------------------------------------------

def test_kv_cache_memory_bytes_takes_effect_and_enforce_eager_is_accepted(tiny_llama):
    blocks = {}
    for mib in (32, 64):
        with vlens.Session(tiny_llama, reuse=False, max_model_len=256,
                           kv_cache_memory_bytes=mib << 20, enforce_eager=True) as s:
            blocks[mib] = s.info["kv_cache_blocks"]
            assert s.trace(["w1 w2"], max_new_tokens=2)[0].n_tokens == 4  # <s> w1 w2 + 1
    assert blocks[64] >= 2 * blocks[32] - 1 and blocks[32] > 0, blocks


def test_enforce_eager_must_be_a_bool(tiny_llama):
    with pytest.raises(VlensError, match="enforce_eager must be True or False"):
        vlens.Session(tiny_llama, reuse=False, enforce_eager="yes")


def test_env_and_argument_both_set_is_refused(tiny_llama, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    with pytest.raises(VlensError, match="VLLM_CPU_KVCACHE_SPACE"):
        vlens.Session(tiny_llama, reuse=False, kv_cache_memory_bytes=KV_BYTES)
