"""Direct logit attribution (``s.logit_attribution``) on the real engine.

Every component equals a Hugging Face reference built with forward hooks
(``tests/_hf_attribution.py``, the same frozen-scale rule written apart
from the worker's), on tiny random Llama (RMSNorm, untied), Qwen2, Gemma2
(Gemma's norms, post-block norms, tied, final softcap) and GPT-2
(LayerNorm, tied, biases everywhere) and on the bundled model; the
components sum to the engine's own logit difference; a loaded engine
(chunked prefill, prefix caching, preemption) leaves the batch's other
requests bit-identical; bad input is refused and the engine serves on.
Also the result's frame and figure, and the plan's wire form and rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vlens
from vlens import calls
from vlens.checks import ModelFacts, check_read
from vlens.methods import attribution, traces
from vlens.protocol.plan import Plan, Read, parse_plan
from vlens.results.attribution import Attribution
from _hf_forks import run_script

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4


def _prompt(n_words: int, offset: int) -> str:
    return " ".join(f"w{(offset + 7 * i) % 240}" for i in range(n_words))


def hf_reference(path, jobs, tmp_path) -> list[dict]:
    """Run tests/_hf_attribution.py in a fresh process (see its docstring)."""
    spec = tmp_path / "dla-spec.json"
    spec.write_text(json.dumps({"path": str(path), "jobs": jobs}))
    out = tmp_path / "dla-out.pt"
    proc = run_script(ROOT / "tests" / "_hf_attribution.py", spec, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def _close(got, want, what: str) -> None:
    got, want = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    # 1e-4, relative above 1: the final norm's scale is the residual's RMS
    # (about 38 on the bundled model), where float32 rounding alone moves it
    # by ~1e-4 between a prefix-cached and a fresh prefill
    err = float((got - want).abs().max())
    tol = TOL * max(1.0, float(want.abs().max()))
    assert err <= tol, f"{what}: off by {err:.3g} (got {got}, want {want})"


def check_against_hf(s, path, prompts, answer, wrong, position, tmp_path) -> Attribution:
    a = s.logit_attribution(prompts, answer=answer, wrong=wrong, position=position)
    jobs = [{"ids": s.prompts(p)[0].ids, "answer": a.answer[i],
             "wrong": -1 if a.wrong[i] is None else a.wrong[i], "position": a.positions[i]}
            for i, p in enumerate(prompts)]
    for i, ref in enumerate(hf_reference(path, jobs, tmp_path)):
        for key in ("embed", "attn", "mlp", "heads", "head_bias", "bias", "scale",
                    "logit_diff"):
            _close(getattr(a, key)[i], ref[key], f"prompt {i} {key}")
        # the parts sum to the whole: heads + their bias term = attn, all = the logit diff
        _close(a.heads[i].sum(-1) + a.head_bias[i], a.attn[i], f"prompt {i} heads vs attn")
        rel = float((a.total[i] - a.logit_diff[i]).abs()) / max(1.0, float(a.logit_diff[i].abs()))
        assert rel <= TOL, f"prompt {i}: total {a.total[i]} vs logit_diff {a.logit_diff[i]}"
    assert float(a.heads.abs().max()) > 100 * TOL, "values this small would prove nothing"
    check_heads_sum_to_attn_out(s, prompts, a)
    return a


def check_heads_sum_to_attn_out(s, prompts, a: Attribution) -> None:
    """The session reads ``z`` and takes each layer's attn part as the row's
    sum (the heads and the projection's bias term): the worker's own
    ``attn_out`` read of the same rows, asked for beside it, equals it."""
    tag, layers = calls.new_tag(), tuple(range(s.facts.n_layers))
    requests = []
    for i, p in enumerate(s.prompts(prompts)):
        at = dict(target=(a.answer[i], -1 if a.wrong[i] is None else a.wrong[i]),
                  position=a.positions[i])
        reads = [Read("attn_out", layers, "dla", **at), Read("z", layers, "dla", **at)]
        requests.append(calls.request(f"{tag}-{i}", i, p.ids, reads=reads, max_new_tokens=1,
                                      logprobs=False, clone=False, source=p))

    def assemble(outputs, collected, runs):
        return runs.build_run([str(i) for i in range(len(requests))], requests, outputs,
                              collected, False)

    run = s._runner.run(calls.Call(requests, assemble), budget=s.read_budget)
    for i, (t, req) in enumerate(zip(run, requests)):
        attn_key, z_key = (r.key for r in req.plan.reads)
        direct = t.activations(attn_key)[:, 0, 0]
        _close(t.activations(z_key)[:, 0].sum(-1), direct, f"prompt {i} z rows vs attn_out")
        _close(direct / a.scale[i], a.attn[i], f"prompt {i} attn_out read vs the session's attn")


# -- the families ------------------------------------------------------------

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def family_session(models_dir, engine_options):
    """One small engine per family, made when first asked, all closed at the
    end of the module."""
    from vlens.tiny import make_tiny_model

    made: dict[str, tuple] = {}

    def get(family: str):
        if family not in made:
            path = make_tiny_model(models_dir / f"{family}-dla", family, layers=2, seed=7)
            made[family] = (vlens.Session(path, reuse=False, max_model_len=256,
                                          max_num_batched_tokens=64, **engine_options), path)
        return made[family]

    yield get
    for s, _ in made.values():
        s.close()


@pytest.mark.parametrize("family", ["gemma2", "gpt2"])
def test_gemma2_and_gpt2_equal_hugging_face(family, family_session, tmp_path):
    s, path = family_session(family)
    prompts = [_prompt(9, 1), _prompt(70, 3)]  # the long one in two prefill chunks
    check_against_hf(s, path, prompts, "w5", "w9", -1, tmp_path)
    # the answer's logit alone, one token per prompt as ids, an inner position
    check_against_hf(s, path, prompts, [17, 40], None, 4, tmp_path)


def test_llama_and_qwen2_equal_hugging_face(llama_session, tiny_llama, qwen2_session,
                                            tiny_qwen2, tmp_path):
    prompts = [_prompt(12, 0), _prompt(90, 2), _prompt(5, 4)]
    a = check_against_hf(llama_session, tiny_llama, prompts, ["w3", "w4", "w5"], "w8", -1,
                         tmp_path)
    assert a.heads.shape == (3, 3, 4) and a.attn.shape == (3, 3)
    # (the tiny Qwen2's tokenizer loads as transformers' slow Qwen2Tokenizer, which knows
    # none of the words: ids)
    ids = [{"prompt_token_ids": llama_session.tokenize(p)} for p in prompts[:2]]
    check_against_hf(qwen2_session, tiny_qwen2, ids, 15, 6, -2, tmp_path)


def test_the_bundled_model_equals_hugging_face(toy_session, tmp_path):
    s = toy_session
    prompts = ["the fox saw a cat . the fox", "the wind was happy . the wind"]
    check_against_hf(s, s.model, prompts, " cat", " fox", -1, tmp_path)


# -- a loaded engine ------------------------------------------------------------

def _together(*parts: calls.Call) -> calls.Call:
    """Several calls' requests in ONE engine batch; assembles each's result."""
    requests = [r for c in parts for r in c.requests]

    def assemble(outputs, collected, runs):
        got, k = [], 0
        for c in parts:
            got.append(c.assemble(outputs[k:k + len(c.requests)], collected, runs))
            k += len(c.requests)
        return got

    return calls.Call(requests, assemble)


def test_a_loaded_engine_attributes_and_leaves_the_batch_bit_identical(loaded_session,
                                                                       tiny_llama, tmp_path):
    """Prefill chunks of 32 tokens, prefix caching on, a KV cache that forces
    preemption: DLA requests beside traced and untraced ones. The others'
    tokens, logprobs and reads equal a batch without DLA, bit for bit; the
    attribution equals the same call alone and Hugging Face."""
    s = loaded_session
    long = [_prompt(n, k) for k, n in enumerate([120, 122, 125, 118, 124, 121])]
    dla_prompts = [long[0], _prompt(60, 9), long[3]]  # two share a traced prompt's prefix
    kw = dict(layers=[0, 2], max_new_tokens=12)

    def trace_call():
        return traces.trace_call(traces.TraceSpec(prompts=tuple(s.prompts(long)), facts=s.facts,
                                                  **kw))

    def dla_call():
        return attribution.logit_attribution_call(s, dla_prompts, ["w3", "w5", 9], "w8", -1)

    background = [calls.background(p.ids, 8, {"temperature": 0.0})
                  for p in s.prompts(long[:3])]
    untraced = calls.Call(background, lambda outs, _, __: [o.outputs[0].token_ids for o in outs])
    run_with, a_with, bg_with = s._runner.run(_together(trace_call(), dla_call(), untraced),
                                              budget=s.read_budget)
    run_without, bg_without = s._runner.run(_together(trace_call(), untraced),
                                            budget=s.read_budget)
    assert any(t.restarts > 0 for t in run_with), "the KV cache was meant to force preemption"
    assert any(len(t.step_rows) > 1 and t.step_rows[0] <= 32 for t in run_with)
    assert [list(x) for x in bg_with] == [list(x) for x in bg_without]
    for t, u in zip(run_with, run_without):
        assert t.output_token_ids == u.output_token_ids and t.logprobs == u.logprobs
        assert torch.equal(t.activations(), u.activations())
    alone = s.logit_attribution(dla_prompts, answer=["w3", "w5", 9], wrong="w8")
    for key in ("embed", "attn", "mlp", "heads", "bias", "logit_diff"):
        _close(getattr(a_with, key), getattr(alone, key), f"{key} in the batch vs alone")
    check_against_hf(s, tiny_llama, dla_prompts, ["w3", "w5", 9], "w8", -1, tmp_path)
    assert s.status()["records"] == 0 and s.status()["plans"] == 0


def test_the_attributed_row_is_the_position_in_whichever_prefill_chunk_holds_it(
        loaded_session, tiny_llama, tmp_path):
    """The worker picks each prompt's row at ``position`` out of the step
    before it reduces: with prefill chunks of 32 tokens, a position in the
    first, a middle and the last chunk of prompts that share their steps
    (so a position is never its step row) equals Hugging Face at that
    position, and positions one apart differ (a neighbouring row, another
    chunk's or another prompt's, would not pass); a chunk without the
    position reads nothing."""
    s = loaded_session
    prompts = [_prompt(100, 1), _prompt(70, 5), _prompt(90, 8)]
    got, jobs = [], []
    for position in (0, 40, 41, -30, -1):
        a = s.logit_attribution(prompts, answer="w3", wrong="w8", position=position)
        got.append(a)
        jobs += [{"ids": s.prompts(p)[0].ids, "answer": a.answer[i], "wrong": a.wrong[i],
                  "position": a.positions[i]} for i, p in enumerate(prompts)]
    assert [a.positions[0] for a in got] == [0, 40, 41, 71, 100]  # 101 tokens
    refs = iter(hf_reference(tiny_llama, jobs, tmp_path))
    for a in got:
        for i in range(len(prompts)):
            ref = next(refs)
            for key in ("embed", "attn", "mlp", "heads", "scale", "logit_diff"):
                _close(getattr(a, key)[i], ref[key], f"position {a.position}, prompt {i} {key}")
    assert not torch.allclose(got[1].heads, got[2].heads, atol=1e-3)  # 40 and 41 differ
    assert s.status()["records"] == 0 and s.status()["plans"] == 0


# -- bad input ----------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(answer="w3 w4"), r"tokenises to 2 tokens \('w3', 'w4'"),
    (dict(answer=10**6), "outside the vocabulary"),
    (dict(answer="w3", wrong=-5), "outside the vocabulary"),
    (dict(answer=["w3", "w4", "w5"]), "3 entries for 2 prompts"),
    (dict(answer="w3", position=13), "position 13 is outside prompt 0, which has 13"),
    (dict(answer="w3", position=-14), "outside prompt 0"),
    (dict(answer="w3", position=1.5), "position must be an int"),
    (dict(answer="w3", wrong="w3"), "the same token"),
    (dict(answer=None), "answer= is needed"),
    (dict(answer=[3.5, 4]), "one-token string or a token id"),
])
def test_bad_input_is_refused_and_the_engine_serves(llama_session, kw, match):
    s = llama_session
    with pytest.raises(vlens.VlensError, match=match):
        s.logit_attribution([_prompt(12, 0), _prompt(40, 1)], **kw)
    with pytest.raises(TypeError, match="answer"):
        s.logit_attribution(_prompt(5, 0), answr="w3")
    a = s.logit_attribution(_prompt(12, 0), answer="w3")
    assert a.wrong == [None] and torch.isfinite(a.total).all()
    assert s.status()["records"] == 0 and s.status()["plans"] == 0


# -- the plan, its rules, the result (no engine) --------------------------------------

FACTS = ModelFacts(n_layers=3, hidden_size=128, sites=("resid_pre", "attn_out", "mlp_out", "z",
                                                       "resid_post"),
                   writable=(), max_model_len=512, vocab_size=250, n_heads=4, head_dim=32)


def test_a_dla_read_crosses_the_wire_and_meets_its_rules():
    read = Read("z", (0, 1, 2), "dla", target=(5, -1))
    plan = Plan("t-0", reads=(read,), prompt_len=4)
    wire = plan.to_wire()
    assert wire["reads"][0]["target"] == [5, -1] and parse_plan(wire) == plan
    assert "position" not in wire["reads"][0]
    # one prompt position (negative: from the prompt's end), on the wire and back
    at = Plan("t-0", reads=(Read("z", (0,), "dla", target=(5, -1), position=-1),), prompt_len=4)
    assert at.to_wire()["reads"][0]["position"] == -1 and parse_plan(at.to_wire()) == at
    assert at.reads[0].at(4) == 3 and read.at(4) is None
    for bad in (4, -5):
        with pytest.raises(ValueError, match="outside the prompt"):
            parse_plan(Plan("t-0", reads=(Read("z", (0,), "dla", target=(5, -1), position=bad),),
                            prompt_len=4).to_wire())
    assert read.key == "z:dla:5:-1" and Read("z", (0,), "dla", target=(5, 6)).key != read.key
    check_read(read, FACTS)
    for bad, match in [
        (Read("z", (0,), "dla"), "names its target"),
        (Read("z", (0,), "norm", target=(1, 2)), "names its target"),
        (Read("z", (0,), "dla", target=(1, 250)), "two different ids"),
        (Read("z", (0,), "dla", target=(3, 3)), "two different ids"),
        (Read("z", (0,), "dla", target=(3,)), "two different ids"),
        (Read("resid_pre", (1,), "dla", target=(3, 4)), "layer 0 only"),
        (Read("resid_post", (0,), "dla", target=(3, 4)), "last layer"),
        (Read("z", (0,), "dla", 2, target=(3, 4)), "must be 0"),
    ]:
        with pytest.raises(vlens.VlensError, match=match):
            check_read(bad, FACTS)


def test_the_servers_guard_takes_a_sessions_dla_plan_and_refuses_bad_targets():
    """What ``vlens.connect`` sends: the guard re-checks each plan with the
    same rules (a hand-made target outside the vocabulary is refused)."""
    from vlens.remote import guard

    ids = [1, 5, 6, 7]
    reads = (Read("resid_pre", (0,), "dla", target=(5, 9)),
             Read("z", (0, 1, 2), "dla", target=(5, 9)),
             Read("resid_post", (2,), "dla", target=(5, 9)))
    raw = Plan("t-0", reads=reads, prompt_len=len(ids)).to_wire()
    plan = guard.check_plan(raw, ids, FACTS, {}, "c0", 1)
    assert plan.reads == reads and plan.tag == "c0/t-0"
    # what logit_attribution sends: each read at one prompt position
    at = tuple(Read(r.site, r.layers, r.reduce, target=r.target, position=-1) for r in reads)
    plan = guard.check_plan(Plan("t-0", reads=at, prompt_len=len(ids)).to_wire(), ids, FACTS,
                            {}, "c0", 1)
    assert plan.reads == at
    for target in ([5, 250], [5, 5], [5], ["5", 9]):
        bad = {**raw, "reads": [{**raw["reads"][0], "target": target}]}
        with pytest.raises(guard.Refused):
            guard.check_plan(bad, ids, FACTS, {}, "c0", 1)
    guard.check_budget([(len(ids), reads, 1, 1)], FACTS, 4 * len(ids) * (1 + 3 * 5 + 4))
    with pytest.raises(vlens.VlensError, match="read budget"):
        guard.check_budget([(len(ids), reads, 1, 1)], FACTS, 4 * len(ids) * (1 + 3 * 5 + 4) - 1)


def _attribution(heads: bool = True) -> Attribution:
    g = torch.Generator().manual_seed(0)
    attn, mlp = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    h = torch.randn(2, 3, 4, generator=g)
    return Attribution(
        prompts=["a b c", "d e"], tokens=[["a", " b", " c"], ["d", " e"]], position=-1,
        positions=[2, 1], answer=[5, 6], wrong=[7, None], answer_text=[" x", " y"],
        wrong_text=[" z", None], embed=torch.tensor([0.5, -0.25]), attn=attn, mlp=mlp,
        heads=h if heads else None, head_bias=attn - h.sum(-1), bias=torch.tensor([0.1, 0.2]),
        scale=torch.tensor([2.0, 3.0]), logit_diff=torch.zeros(2))


def test_the_frame_the_total_and_the_figure():
    a = _attribution()
    df = a.to_frame()
    assert list(df.columns) == ["prompt", "component", "layer", "head", "value"]
    assert len(df) == 2 * (1 + 3 * (1 + 4 + 1) + 1)
    assert set(df.component) == {"embed", "attn", "head", "mlp", "bias"}
    no_heads = df[df.component != "head"].groupby("prompt").value.sum()
    assert torch.allclose(torch.tensor(no_heads.values, dtype=torch.float32), a.total, atol=1e-6)
    heads = df[df.component == "head"]
    assert (heads["head"] >= 0).all() and (df[df.component != "head"]["head"] == -1).all()
    assert (df[df.component.isin(["embed", "bias"])].layer == -1).all()
    assert float(df[(df.component == "head") & (df.layer == 1) & (df["head"] == 2)
                    & (df.prompt == 1)].value.iloc[0]) == pytest.approx(float(a.heads[1, 1, 2]))
    fig = a.figure(1)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["attn", "mlp"]
    assert list(bars[0].y) == pytest.approx(a.attn[1].tolist())
    heat = next(t for t in fig.data if t.type == "heatmap" and t.name == "heads")
    assert torch.allclose(torch.tensor(heat.z, dtype=torch.float32), a.heads[1])
    assert "logit(' y')" in fig.layout.title.text
    assert not any(t.type == "heatmap" for t in _attribution(heads=False).figure().data)
    assert len(_attribution(heads=False).to_frame()) == 2 * (1 + 3 * 2 + 1)
    with pytest.raises(vlens.VlensError, match="prompt index"):
        a.figure(2)
    assert "2 prompts" in repr(a) and vlens.Attribution is Attribution


def test_a_linear_weight_is_read_live_or_probed_the_same():
    """On a GPU the output projection's weight is read in place; vLLM's CPU
    build packs it and leaves ``weight`` empty, and the worker runs the
    layer on the identity instead: both give the same ``[in, out]``."""
    from vlens.protocol.final_norm import norm_of
    from vlens.worker.attribution import _linear_t

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 5)
    w_t, bias, copy = _linear_t(lin)
    assert not copy and w_t.data_ptr() == lin.weight.data_ptr()  # a view: nothing kept
    assert torch.equal(w_t, lin.weight.t()) and torch.equal(bias, lin.bias)

    class Packed(torch.nn.Module):  # what vLLM's CPU build leaves
        def __init__(self):
            super().__init__()
            self.input_size, self.packed = 8, lin.weight.detach().clone()
            self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            self.bias = lin.bias

        def forward(self, x):
            return torch.nn.functional.linear(x, self.packed, self.bias), None

    w_p, bias_p, copy = _linear_t(Packed())
    assert copy and torch.allclose(w_p, w_t, atol=1e-7) and torch.equal(bias_p, bias)
    # the norms' frozen-scale rules: RMS with Gemma's (1 + w), LayerNorm centred
    x = torch.randn(3, 8)
    ln = torch.nn.LayerNorm(8)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.2, 0.2)
    n, d = norm_of(ln), torch.randn(8)
    assert torch.allclose(x @ n.direction(d) / n.scale(x) + n.bias_term(d), ln(x).detach() @ d,
                          atol=1e-5)
    with pytest.raises(ValueError, match="knows RMSNorm and LayerNorm"):
        norm_of(torch.nn.GroupNorm(1, 8))


def test_cycling_answers_keeps_the_probed_projections(llama_session, monkeypatch):
    """A client cycling answer tokens: the per-answer directions are bounded
    and cleared, but each layer's probed output projection (vLLM's CPU build
    empties linear weights; the worker runs the layer on the identity) is
    kept for the engine's life: 300 calls over 240 pairs (each pair caches
    one entry per layer and one more, so the cache of 256 is cleared again
    and again) probe each layer once. (Counted, not timed: the calls' times
    only followed the other test process's load.)"""
    from vlens.worker import attribution as worker

    probes = []
    real = worker._linear_t

    def counted(m):
        got = real(m)
        probes.append(got[2])
        return got

    monkeypatch.setattr(worker, "_linear_t", counted)  # seen where the worker is in-process
    # earlier tests on this engine probed its layers already (kept for the
    # engine's life): start from empty caches, as a fresh engine would
    worker._CACHE.clear()
    worker._PROBED.clear()
    s = llama_session
    prompt = _prompt(6, 5)
    for i in range(300):
        s.logit_attribution(prompt, answer=4 + i % 240, wrong=4 + (i * 7 + 1) % 240)
    assert 240 * (1 + s.n_layers) > worker._CACHE_MAX
    # the worker runs in this process (the suite's engines are in-process):
    # every layer's projection was looked at, and probed (a copy) at most once
    assert len(probes) >= s.n_layers, f"the worker looked at {len(probes)} projections"
    assert sum(probes) <= s.n_layers, f"{sum(probes)} probes for {s.n_layers} layers"
    assert all(len(c) <= worker._CACHE_MAX + 1 for c in worker._CACHE.values())
