"""The Session's contract: prefix cache, bad input, lifecycle."""

from __future__ import annotations

import pytest

import vlens
from vlens.errors import ClosedError, VlensError

pytestmark = pytest.mark.engine

LONG = " ".join(f"w{(5 * i) % 240}" for i in range(300))  # 301 tokens with BOS


def test_prefix_cache_never_hides_prompt_rows(llama_session):
    first = llama_session.generate(LONG, max_new_tokens=2)  # fills the cache
    assert first
    a = llama_session.trace(LONG, layers=[0], max_new_tokens=2)[0]
    b = llama_session.trace(LONG, layers=[0], max_new_tokens=2)[0]
    n_prompt = len(llama_session.tokenize(LONG))
    assert n_prompt > 256
    for t in (a, b):
        assert t.n_tokens == n_prompt + 1
        assert t.positions[0] == 0
    assert (a.activations() - b.activations()).abs().max() <= 1e-5


def _valid_call_works(session):
    run = session.trace("w1 w2 w3", layers=[0], max_new_tokens=2)
    assert run[0].n_tokens == 5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompts=["w1"], layers=[7]), r"layer 7 does not exist: this model has 3 layers, numbered 0 to 2"),
        (dict(prompts=["w1"], layers=[-1]), r"layer -1 does not exist"),
        (dict(prompts=["w1"], layers=[]), r"layers is empty"),
        (dict(prompts=["w1"], sites=["resid_middle"]), r"unknown site 'resid_middle': this model has .*resid_post"),
        (dict(prompts=[]), r"prompts is empty"),
        (dict(prompts=[""]), r"prompt 0 is empty"),
        (dict(prompts=["w1", 3]), r"prompt 1 is a int, not a string"),
        (dict(prompts=[" ".join(["w1"] * 600)]), r"prompt 0 is 601 tokens long but the engine's max_model_len is 512"),
        (dict(prompts=["w1"], max_new_tokens=0), r"max_new_tokens must be a positive int"),
        (dict(prompts=["w1"], logprobs=5, max_tokens=3), r"max_tokens= is set by vlens"),
        (dict(prompts=["w1"], temperature=-1.0), r"bad sampling settings"),
        (dict(prompts=["w1"], temperature=1.0, seed=3), r"seed= is refused on vLLM's CPU build"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_engine_still_serves(llama_session, kwargs, match):
    prompts = kwargs.pop("prompts")
    with pytest.raises(VlensError, match=match):
        llama_session.trace(prompts, **kwargs)
    _valid_call_works(llama_session)


def test_old_and_misspelt_keywords_are_a_type_error_naming_the_real_one(llama_session):
    """#39: each meaning has one name. An old keyword (or a misspelt one,
    a sampling setting included) is a TypeError naming the keyword meant,
    raised before anything runs."""
    s = llama_session
    clean, corrupt = "w1 w2 w3", "w1 w4 w3"
    cases = [
        (lambda: s.trace(clean, sites=["attn_pattern"], query_heads=[0]), "heads="),
        (lambda: s.patch(clean, corrupt, positions=[0]), "span"),
        (lambda: s.patch(clean, corrupt, site="z", per_head=True), "heads='all'"),
        (lambda: list(s.stream_patch(clean, corrupt, positions=[0])), "span"),
        (lambda: s.direction(["w1 w2"], ["w3 w4"], layer=0, position="last"), "span"),
        (lambda: s.trace(clean, layer=3), "layers"),
        (lambda: s.trace(clean, temprature=0.5), "temperature"),
    ]
    before = s.engine.generate_calls
    for call, new in cases:
        with pytest.raises(TypeError, match=new):
            call()
    assert s.engine.generate_calls == before
    _valid_call_works(s)


def test_missing_model_folder_is_refused():
    with pytest.raises(VlensError, match="not a folder on this machine"):
        vlens.Session("/nonexistent/model")


def test_second_session_reuses_the_live_engine_and_close_is_safe(tiny_llama, llama_session):
    from vlens.session import live_engines

    before = live_engines()
    again = vlens.Session(tiny_llama, max_num_batched_tokens=64, max_model_len=512,
                          kv_cache_memory_bytes=llama_session.engine.llm_kwargs["kv_cache_memory_bytes"])
    assert again.reused and again.engine is llama_session.engine
    assert live_engines() == before
    again.close()
    again.close()  # harmless
    with pytest.raises(ClosedError, match="closed"):
        again.trace("w1")
    _valid_call_works(llama_session)  # the shared engine lives on
