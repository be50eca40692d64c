"""vlens.Ablate on the real engine: equal to a Hugging Face hook doing the
same (zero, mean, spans, per prompt; Llama and GPT-2), other requests of
the batch bit-identical, a loaded engine (chunked prefill, preemption) the
same as requests run alone, and bad input refused with the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import vlens
from vlens.errors import VlensError
from _hf_forks import run_script

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]


def _prompt(n_words: int, offset: int) -> str:
    return " ".join(f"w{(offset + 7 * i) % 240}" for i in range(n_words))


# with max_num_batched_tokens=64 the long ones are split over steps
PROMPTS = [_prompt(n, k) for k, n in enumerate([12, 90, 5, 30])]


def hf_jobs(path, jobs, tmp_path):
    """Run tests/_hf_methods.py in a fresh process (see its docstring)."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"path": str(path), "jobs": jobs}))
    proc = run_script(ROOT / "tests" / "_hf_methods.py", spec, tmp_path / "out.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


@pytest.fixture(scope="module")
def tiny_gpt2(models_dir):
    from vlens.tiny import make_tiny_model

    return make_tiny_model(models_dir / "gpt2-ablate", "gpt2", layers=3, seed=4)


@pytest.fixture(scope="module")
def gpt2_session(tiny_gpt2, engine_options):
    s = vlens.Session(tiny_gpt2, reuse=False, max_num_batched_tokens=64, max_model_len=512,
                      **engine_options)
    yield s
    s.close()


def _job(t, ab, prompt_len, head_dim, mean_over=None):
    start, stop = ab.positions(prompt_len)
    dims = None
    if ab.heads is not None:  # the cases' heads are adjacent: one dim range
        dims = [ab.heads[0] * head_dim, (ab.heads[-1] + 1) * head_dim]
    return {"kind": "ablate", "ids": t.token_ids, "site": ab.site, "layer": ab.layer,
            "span": [start, None if stop < 0 else stop], "dims": dims,
            "value": ab.kind, "mean_over": mean_over or []}


# (site, layer, kind, span) for each case; the mean ones take mean=None
# (zeroing a whole residual stream leaves every later logit 0, a tie, so
# whole-row residual cases take a span)
CASES = [
    ("resid_post", 1, "zero", (2, 8), None),
    ("mlp_out", 0, "mean", "prompt", None),
    ("attn_out", 2, "zero", "all", None),
    ("resid_pre", 2, "mean", "generated", None),
    ("resid_mid", 1, "zero", (0, 4), None),
    # single heads: each head's output before the output projection
    ("z", 1, "zero", "all", [1, 2]),
    ("z", 2, "mean", (1, 7), [0]),
    ("z", 0, "zero", "generated", None),
]


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_ablate_equals_a_hugging_face_hook(request, which, tmp_path):
    s = request.getfixturevalue("llama_session" if which == "llama" else "gpt2_session")
    path = request.getfixturevalue("tiny_llama" if which == "llama" else "tiny_gpt2")
    cases = [c for c in CASES if c[0] in s.sites]
    assert len(cases) >= 7
    prompts = PROMPTS[:2]
    lens = [len(s.tokenize(p)) for p in prompts]
    runs, jobs = [], []
    for site, layer, kind, span, heads in cases:
        ab = vlens.Ablate(site, layer, kind=kind, span=span, heads=heads)
        run = s.trace(prompts, layers=None, sites=["resid_post"], max_new_tokens=5, ablate=ab)
        runs.append(run)
        mean_over = [s.tokenize(p) for p in prompts] if kind == "mean" else None
        jobs += [_job(t, ab, n, s.info["head_dim"], mean_over) for t, n in zip(run, lens)]
    refs = iter(hf_jobs(path, jobs, tmp_path))
    for case, run in zip(cases, runs):
        for t, n in zip(run, lens):
            ref = next(refs)
            got = t.activations("resid_post")
            assert got.shape == ref["resid_post"].shape
            err = (got - ref["resid_post"]).abs().max()
            assert err <= 1e-5, f"{which} {case}: resid_post differs by {err}"
            # the last generated token's logprob (float noise of a log-softmax)
            last = t.output_token_ids[-1]
            assert abs(t.logprobs[-1] - float(ref["logprobs"][last])) <= 1e-4, case
    # and the ablation did something: the first case's layer is zero where ablated
    rows = runs[0][0].activations("resid_post")[1]
    assert float(rows[2:8].abs().max()) <= 1e-5 < float(rows[8:].norm(dim=-1).min())


def test_other_requests_in_the_batch_stay_bit_identical(llama_session):
    s = llama_session
    base = s.trace(PROMPTS, layers=[0, 2], max_new_tokens=6)
    per = vlens.PerPrompt([None, vlens.Ablate("resid_post", 1), None,
                           [vlens.Ablate("mlp_out", 0, kind="mean"),
                            vlens.Ablate("attn_out", 1, span="generated")]])
    run = s.trace(PROMPTS, layers=[0, 2], max_new_tokens=6, ablate=per)
    if os.environ.get("VLENS_TEST_ENGINE", "inproc") == "inproc":
        assert all(a.step_rows == b.step_rows for a, b in zip(base, run))
    _only_the_ablated_moved(base, run)


def _only_the_ablated_moved(base, run) -> None:
    """Prompts 0 and 2 (no Ablate) exactly as alone; 1 and 3 changed."""
    for i in (0, 2):
        assert run[i].output_token_ids == base[i].output_token_ids
        assert run[i].logprobs == base[i].logprobs
        assert torch.equal(run[i].activations(), base[i].activations())
    for i in (1, 3):
        assert not torch.equal(run[i].activations()[1], base[i].activations()[1])


def test_ablated_kv_is_salted_apart_and_repeats_exactly(llama_session):
    s = llama_session
    prompt = _prompt(300, 5)  # two full 128-token prefix-cache blocks
    ab = vlens.Ablate("resid_post", 0, kind="zero")
    plain = s.trace(prompt, sites=[], logprobs=False, max_new_tokens=6)[0]
    one = s.trace(prompt, sites=[], logprobs=False, max_new_tokens=6, ablate=ab)[0]
    two = s.trace(prompt, sites=[], logprobs=False, max_new_tokens=6, ablate=ab)[0]
    after = s.trace(prompt, sites=[], logprobs=False, max_new_tokens=6)[0]
    assert one.output_token_ids == two.output_token_ids != plain.output_token_ids
    assert after.output_token_ids == plain.output_token_ids


def test_given_mean_and_stream_agree_with_trace(llama_session):
    s = llama_session
    mean = torch.randn(s.hidden_size)
    ab = vlens.Ablate("resid_post", 1, kind="mean", mean=mean, span=(2, 6))
    run = s.trace(PROMPTS[:2], layers=[1], max_new_tokens=4, ablate=ab)
    rows = run[0].activations()[0]
    assert torch.allclose(rows[2:6], mean.expand(4, -1), atol=1e-5)
    assert not torch.allclose(rows[1], mean, atol=1e-3)
    last = list(s.stream(PROMPTS[:2], layers=[1], max_new_tokens=4, ablate=ab))[-1]
    for a, b in zip(run, last):
        assert a.output_token_ids == b.output_token_ids
        assert torch.allclose(a.activations(), b.activations(), atol=1e-6)


@pytest.mark.parametrize("make,match", [
    (lambda: vlens.Ablate("nope", 1), r"unknown Ablate site 'nope'"),
    (lambda: vlens.Ablate("resid_post", 99), r"layer 99 does not exist: this model has 3"),
    (lambda: vlens.Ablate("resid_post", 1, heads=[0]), r"heads= is for site 'z'"),
    (lambda: vlens.Ablate("z", 1, heads=[1, 9]), r"this model has 4 heads, numbered 0 to 3"),
    (lambda: vlens.Ablate("attn_pattern", 1), r"'attn_pattern' cannot be written"),
    (lambda: vlens.Ablate("resid_post", 1, kind="mean", mean=torch.zeros(7)),
     r"mean has 7 elements; site 'resid_post' rows have"),
    (lambda: [vlens.Ablate("mlp_out", 1), vlens.Ablate("mlp_out", 1, span="prompt")],
     r"two Ablates write site 'mlp_out' at layer 1"),
    (lambda: vlens.Ablate("resid_post", 1, span=(0, 500)), r"reaches past the sequence"),
])
def test_bad_ablations_are_refused_and_the_engine_serves(llama_session, make, match):
    before = llama_session.engine.generate_calls
    with pytest.raises(VlensError, match=match):
        llama_session.trace(PROMPTS[:1], max_new_tokens=2, ablate=make())
    assert llama_session.engine.generate_calls == before
    assert llama_session.trace(PROMPTS[0], layers=[0], max_new_tokens=2)[0].n_tokens > 0


@pytest.mark.parametrize("make,match", [
    (lambda: vlens.Ablate("resid_post", 1, kind="max"), r"kind must be one of"),
    (lambda: vlens.Ablate("z", 1, heads=[]), r"non-empty list of head indices"),
    (lambda: vlens.Ablate("resid_post", 1, mean=torch.zeros(4)), r"only used with kind='mean'"),
    (lambda: vlens.Ablate("resid_post", 1, span=(4, 2)), r"is empty: give \(start, stop\) with start < stop"),
    (lambda: vlens.PerPrompt([vlens.Ablate("resid_post", 1), 3]), r"PerPrompt entry 1 is 3"),
])
def test_malformed_ablate_is_refused_where_it_is_made(make, match):
    with pytest.raises(VlensError, match=match):
        make()


def test_ablate_forms_are_refused_when_ambiguous(llama_session):
    a, b = vlens.Ablate("resid_post", 0), vlens.Ablate("resid_post", 1)
    with pytest.raises(VlensError, match=r"ambiguous.*PerPrompt"):
        llama_session.trace(PROMPTS[:2], ablate=[a, b], max_new_tokens=2)
    with pytest.raises(VlensError, match=r"steer= takes Steers"):
        llama_session.trace(PROMPTS[:2], steer=vlens.PerPrompt([a, None]), max_new_tokens=2)


# -- a loaded engine -------------------------------------------------------------

def test_a_loaded_engine_ablates_each_request_as_it_would_alone(loaded_session):
    """Chunked prefill of 32 tokens and a KV cache too small for the batch
    (vLLM preempts and recomputes requests): every request as if alone."""
    s = loaded_session
    # 118-125 prompt tokens: decoding crosses the 128-token block boundary,
    # so running requests need blocks the 6-block cache no longer has
    prompts = [_prompt(n, k) for k, n in enumerate([120, 122, 125, 118, 124, 121, 119, 123])]
    kinds = [vlens.Ablate("resid_post", 1, span=(5, 40)), vlens.Ablate("mlp_out", 2, kind="mean"),
             None, vlens.Ablate("attn_out", 0, span="generated"),
             [vlens.Ablate("resid_pre", 1, span=(10, 50)), vlens.Ablate("mlp_out", 0)]]
    per = [kinds[i % len(kinds)] for i in range(len(prompts))]
    kw = dict(layers=[0, 2], max_new_tokens=12)
    run = s.trace(prompts, ablate=vlens.PerPrompt(per), **kw)
    assert any(t.restarts > 0 for t in run), "the KV cache was meant to force preemption"
    for i, prompt in enumerate(prompts):
        # a mean ablation alone would average only its own prompt: pass the batch's mean
        entry = per[i]
        if isinstance(entry, vlens.Ablate) and entry.kind == "mean":
            mean = torch.cat([t.activations("mlp_out")[0] for t in s.trace(
                prompts, layers=[2], sites=["mlp_out"], max_new_tokens=1, logprobs=False)]).mean(0)
            entry = entry.with_mean(mean)
        alone = s.trace([prompt], ablate=entry, **kw)[0]
        assert run[i].output_token_ids == alone.output_token_ids, f"prompt {i}"
        assert torch.allclose(run[i].activations(), alone.activations(), atol=1e-5)
    assert s.status()["records"] == 0 and s.status()["plans"] == 0


# -- directional ablation ---------------------------------------------------------

def _unit(width: int, seed: int) -> torch.Tensor:
    r = torch.randn(width, generator=torch.Generator().manual_seed(seed))
    return r / r.norm()


def _direction_job(t, ab, prompt_len, n_layers):
    start, stop = ab.positions(prompt_len)
    return {"kind": "ablate", "ids": t.token_ids, "site": ab.site, "value": "direction",
            "layers": list(ab.layers(n_layers)), "direction": ab.direction.tolist(),
            "span": [start, None if stop < 0 else stop]}


def _against_hf(s, path, run, per, lens, tmp_path, which):
    """Each traced prompt of ``run`` whose ``per`` entry is a directional
    Ablate against a Hugging Face hook doing the same: every layer's
    resid_post within 1e-5, relative to the activations' scale where that
    is over 1 (the bundled model's residual stream reaches ~1000, where a
    float32 step is 6e-5: there the unedited engine and Hugging Face differ
    by ~2e-3 already). Returns the largest (absolute, relative) difference."""
    pick = [i for i, ab in enumerate(per) if ab is not None]
    refs = hf_jobs(path, [_direction_job(run[i], per[i], lens[i], s.n_layers) for i in pick],
                   tmp_path)
    worst = (0.0, 0.0)
    for i, ref in zip(pick, refs):
        got = run[i].activations("resid_post")
        assert got.shape == ref["resid_post"].shape
        err = float((got - ref["resid_post"]).abs().max())
        rel = err / max(1.0, float(ref["resid_post"].abs().max()))
        assert rel <= 1e-5, f"{which} prompt {i} ({per[i].site}): resid_post differs by {err}"
        last = run[i].output_token_ids[-1]
        assert abs(run[i].logprobs[-1] - float(ref["logprobs"][last])) <= 1e-4
        worst = (max(worst[0], err), max(worst[1], rel))
    print(f"directional ablation vs HF, {which}: max |diff| {worst[0]:.2e} "
          f"(relative {worst[1]:.2e})")
    return worst


def test_directional_ablation_equals_a_hugging_face_hook_under_chunked_prefill(
        loaded_session, tiny_llama, tmp_path):
    """The tiny Llama in 32-token prefill chunks: one direction out of every
    layer, out of two listed layers, out of z's generated rows; batched."""
    s = loaded_session
    hidden, z = s.hidden_size, s.info["n_heads"] * s.info["head_dim"]
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0], PROMPTS[1]]
    lens = [len(s.tokenize(p)) for p in prompts]
    per = [vlens.Ablate("resid_post", "all", direction=torch.randn(hidden) * 7),
           vlens.Ablate("mlp_out", [0, 2], direction=_unit(hidden, 3), span=(3, 25)),
           vlens.Ablate("z", 1, direction=_unit(z, 4), span="generated"),
           None]
    run = s.trace(prompts, layers=None, sites=["resid_post"], max_new_tokens=5,
                  ablate=vlens.PerPrompt(per))
    assert run[0].step_rows[0] < lens[0], "the long prompt was meant to be split in chunks"
    assert _against_hf(s, tiny_llama, run, per, lens, tmp_path, "tiny llama")[0] <= 1e-5
    # it did something: every layer's resid_post has no component along r left
    rows, r = run[0].activations("resid_post"), per[0].direction
    assert float((rows @ r).abs().max()) <= 1e-4
    assert float((run[3].activations("resid_post") @ r).abs().max()) > 1e-2


@pytest.fixture(scope="module")
def toy_chunked(engine_options):
    """The bundled model in 64-token prefill chunks (the shared toy_session
    takes 4096 a step, more than its KV cache holds: it never splits one)."""
    s = vlens.Session(None, reuse=False, max_num_batched_tokens=64, max_model_len=512,
                      **engine_options)
    yield s
    s.close()


def test_directional_ablation_on_the_bundled_model_equals_a_hugging_face_hook(
        toy_chunked, tmp_path):
    """The mood direction out of every layer of the bundled model, and a
    random one out of two attention outputs, batched, in prefill chunks."""
    s = toy_chunked
    words = sorted(w for w in s.tokenizer.get_vocab() if w.isalpha())
    prompts = [" ".join(words[(7 * i + k) % len(words)] for i in range(n))
               for k, n in enumerate([150, 120, 90])]
    lens = [len(s.tokenize(p)) for p in prompts]
    mood = s.direction(["the fox was happy", "a happy owl"], ["the fox was sad", "a sad owl"],
                       layer=3)
    per = [vlens.Ablate("resid_post", "all", direction=mood),
           vlens.Ablate("attn_out", [1, 3], direction=_unit(s.hidden_size, 5), span=(0, 100)),
           None]
    run = s.trace(prompts, layers=None, sites=["resid_post"], max_new_tokens=4,
                  ablate=vlens.PerPrompt(per))
    assert run[0].step_rows[0] < lens[0] and run[1].step_rows[0] < lens[1], \
        "the prompts were meant to be prefilled in chunks"
    _against_hf(s, s.model, run, per, lens, tmp_path, "toy world")
    rows = run[0].activations("resid_post")
    assert float((rows @ per[0].direction).abs().max()) <= 1e-4
    assert float((run[2].activations("resid_post") @ per[0].direction).abs().max()) > 1e-2


def test_directional_ablation_leaves_the_batch_alone_and_salts_its_kv(llama_session):
    s = llama_session
    r = _unit(s.hidden_size, 6)
    base = s.trace(PROMPTS, layers=[0, 2], max_new_tokens=6)
    per = vlens.PerPrompt([None, vlens.Ablate("resid_post", "all", direction=r), None,
                           vlens.Ablate("resid_mid", [1], direction=r, span="prompt")])
    run = s.trace(PROMPTS, layers=[0, 2], max_new_tokens=6, ablate=per)
    _only_the_ablated_moved(base, run)
    # the same direction twice repeats exactly; the plain prompt's KV is not served ablated
    ab = vlens.Ablate("resid_post", 0, direction=r * 30)
    prompt = _prompt(300, 5)
    one, two = (s.trace(prompt, sites=[], max_new_tokens=6, ablate=ab)[0] for _ in range(2))
    plain = s.trace(prompt, sites=[], max_new_tokens=6)[0]
    assert one.output_token_ids == two.output_token_ids and one.logprobs == two.logprobs
    assert plain.logprobs != one.logprobs
    assert plain.logprobs == s.trace(prompt, sites=[], max_new_tokens=6)[0].logprobs


@pytest.mark.parametrize("make,match", [
    (lambda h: vlens.Ablate("resid_post", 1, direction=torch.ones(h + 1)),
     r"direction has \d+ values; site 'resid_post' rows have \d+"),
    (lambda h: vlens.Ablate("resid_post", 7, direction=torch.ones(h)),
     r"layer 7 does not exist: this model has 3 layers"),
    (lambda h: vlens.Ablate("resid_post", [0, 3], direction=torch.ones(h)),
     r"layer list \[0, 3\]: layer 3 does not exist; this model has 3 layers, numbered 0 to 2"),
    (lambda h: [vlens.Ablate("mlp_out", "all", direction=torch.ones(h)),
                vlens.Ablate("mlp_out", 2)], r"two Ablates write site 'mlp_out' at layer 2"),
])
def test_bad_directional_ablations_are_refused_before_the_engine(llama_session, make, match):
    s = llama_session
    before = s.engine.generate_calls
    with pytest.raises(VlensError, match=match):
        s.trace(PROMPTS[:1], max_new_tokens=2, ablate=make(s.hidden_size))
    assert s.engine.generate_calls == before


@pytest.mark.parametrize("make,match", [
    (lambda: vlens.Ablate("resid_post", 1, direction=torch.zeros(8)), r"all zeros.*non-zero"),
    (lambda: vlens.Ablate("resid_post", 1, direction=torch.tensor([1.0, float("inf")])),
     r"direction holds NaN or inf"),
    (lambda: vlens.Ablate("resid_post", 1, direction=torch.ones(2, 4)), r"shape \[width\]"),
    (lambda: vlens.Ablate("z", 1, direction=torch.ones(8), heads=[0]),
     r"direction= cannot go with heads="),
    (lambda: vlens.Ablate("z", 1, kind="mean", direction=torch.ones(8), mean=torch.ones(8)),
     r"cannot go with kind='mean', mean="),
    (lambda: vlens.Ablate("resid_post", "al", direction=torch.ones(8)),
     r"layer 'al' is unknown: give a layer number, 'all' \(every layer\) or a list"),
    (lambda: vlens.Ablate("resid_post", "all"), r"only a directional Ablate, direction=, takes"),
    (lambda: vlens.Ablate("resid_post", [0, 0], direction=torch.ones(8)), r"names a layer twice"),
    (lambda: vlens.Ablate("resid_post", 1, kind="direction"), r"needs direction="),
])
def test_malformed_directional_ablate_is_refused_where_it_is_made(make, match):
    with pytest.raises(VlensError, match=match):
        make()


def test_projecting_sets_are_checked_on_the_wire_and_in_bodies():
    """What ``vlens serve`` re-checks: a hand-made plan's projecting set, and
    the OpenAI body's ``"direction": NAME``."""
    from vlens.checks import ModelFacts, check_plan
    from vlens.remote.schema import BodyError, parse_body
    from vlens.protocol.plan import Plan, Set, parse_plan

    facts = ModelFacts(n_layers=3, hidden_size=8, sites=("resid_post",),
                       writable=("resid_post",), max_model_len=32, vocab_size=50)
    ok = Set("resid_post", 1, "r", 0, -1, 0, -1, project=True)
    plan = parse_plan(Plan("t", sets=(ok,), prompt_len=4).to_wire())
    assert plan.sets == (ok,)
    check_plan(plan, facts, {"r": (8, 0.5)}, 4)
    for bad, sizes, match in [
            (ok, {"r": (8, 0.0)}, r"direction 'r' is zero"),
            (ok, {"r": (7, 0.5)}, r"has 7 values; resid_post takes 8"),
            (Set("resid_post", 1, "r", 2, 5, 0, -1, project=True), {"r": (8, 0.5)},
             r"writes whole rows \(lo 0, hi -1\)"),
            (Set("resid_post", 1, "", 0, -1, 0, -1, project=True), {}, r"names its direction")]:
        with pytest.raises(VlensError, match=match):
            check_plan(Plan("t", sets=(bad,), prompt_len=4), facts, sizes, 4)
    vectors = {"r": torch.ones(8), "short": torch.ones(5)}
    body = parse_body({"ablate": [{"site": "resid_post", "layer": "all", "direction": "r"}]},
                      facts, vectors.get, lambda name: None)
    (ab,) = body.ablates
    assert ab.kind == "direction" and ab.layers(3) == (0, 1, 2)
    assert torch.allclose(ab.direction, torch.ones(8) / 8 ** 0.5)
    for entry, field_, match in [
            ({"layer": [0, 5], "direction": "r"}, "layer", r"layer 5 does not exist"),
            ({"layer": "al", "direction": "r"}, "layer", r"'all' \(every layer\) or a list"),
            ({"layer": 1, "direction": "short"}, "direction",
             r"direction has 5 values; site 'resid_post' rows have 8"),
            ({"layer": 1, "direction": "r", "kind": "mean"}, "", r"cannot go with kind='mean'"),
            ({"layer": 1, "direction": "nope"}, "direction", r"unknown vector 'nope'")]:
        with pytest.raises(BodyError, match=match) as got:  # the body, then on a prompt
            parse_body({"ablate": [dict(entry, site="resid_post")]}, facts, vectors.get,
                       lambda name: None).fit(facts, 4, 2)
        assert got.value.field == "vlens.ablate[0]" + (f".{field_}" if field_ else "")
