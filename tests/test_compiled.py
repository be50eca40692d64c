"""vlens inside vLLM's compiled mode, and the write path without host syncs.

A compiled engine (``enforce_eager=False``) traces the model once with
torch.compile; vlens's hooks are in the graph as opaque operators (see
vlens/worker/ops.py). Everything a user can do must give what the eager
engine gives. tests/test_scale_out.py re-runs the isolation, parity,
steering and recompute tests on a compiled engine too.
"""

from __future__ import annotations

import pytest
import torch

import vlens

KV_BYTES = 64 * 2**20
SITES = ["resid_pre", "resid_post", "attn_out", "mlp_out"]
PROMPTS = ["w1 w2 w3 w4", " ".join(f"w{i}" for i in range(90)), "w9 w8"]


@pytest.fixture(scope="module")
def compiled_session(tiny_llama):
    s = vlens.Session(tiny_llama, reuse=False, enforce_eager=False, max_model_len=512,
                      max_num_batched_tokens=64, kv_cache_memory_bytes=KV_BYTES)
    yield s
    s.close()


def _halve(rows, ctx):
    rows.mul_(0.5)
    return rows


def _everything(s):
    d = torch.randn(s.hidden_size, generator=torch.Generator().manual_seed(0))
    steers = [vlens.Steer(d, layer=1, scale=2.0),
              vlens.Steer(d, layer=0, scale=0.5, site="mlp_out", relative=True, span="generated")]
    # and a directional ablation at every layer (a projecting set)
    return s.trace(PROMPTS, layers=[0, 1, 2], sites=SITES, max_new_tokens=6, logit_lens=3,
                   steer=steers, edit=_halve, edit_at=[("attn_out", 2), ("resid_pre", 0)],
                   ablate=vlens.Ablate("resid_mid", "all", direction=d.flip(0)))


def test_compiled_mode_gives_what_eager_gives(compiled_session, llama_session):
    assert compiled_session.info["compiled"] and not llama_session.info["compiled"]
    eager, compiled = _everything(llama_session), _everything(compiled_session)
    for a, b in zip(eager, compiled):
        assert a.output_token_ids == b.output_token_ids
        assert a.token_ids == b.token_ids and a.steered_rows == b.steered_rows > 0
        for site in SITES:
            assert torch.allclose(a.activations(site), b.activations(site), atol=1e-5), site
        assert torch.equal(a.logit_lens()[0], b.logit_lens()[0])
        la = torch.tensor([x for x in a.logprobs if x is not None])
        lb = torch.tensor([x for x in b.logprobs if x is not None])
        assert torch.allclose(la, lb, atol=1e-5)
    assert compiled_session.status()["hooks"] > 0


def test_compiled_attribution_gives_what_eager_gives(compiled_session, llama_session):
    """DLA at every layer and head on the compiled engine (its reads reduced
    after the step, on a CPU) equals the eager engine's, with the 90-token
    prompt in two prefill chunks, and its parts sum to the logit
    difference the engine computed."""
    got = {}
    for name, s in (("eager", llama_session), ("compiled", compiled_session)):
        got[name] = s.logit_attribution(PROMPTS, answer=" w5", wrong=" w6", position=-2)
    a, b = got["eager"], got["compiled"]
    assert a.heads is not None and a.heads.shape == b.heads.shape
    for part in ("embed", "attn", "mlp", "heads", "head_bias", "bias", "scale", "logit_diff"):
        assert torch.allclose(getattr(a, part), getattr(b, part), atol=1e-4), part
    assert torch.allclose(b.total, b.logit_diff, atol=1e-3)


def test_compiled_steering_changes_only_the_steered_request(compiled_session):
    s = compiled_session
    d = torch.randn(s.hidden_size, generator=torch.Generator().manual_seed(1))
    plain = s.trace(PROMPTS, layers=[2], max_new_tokens=5)
    st = vlens.Steer(d, layer=1, scale=4.0)
    steer = vlens.PerPrompt([None, st, None])  # only the middle prompt
    mixed = s.trace(PROMPTS, layers=[2], max_new_tokens=5, steer=steer)
    for i in (0, 2):
        assert mixed[i].output_token_ids == plain[i].output_token_ids
        assert torch.equal(mixed[i].activations(), plain[i].activations())
    assert not torch.allclose(mixed[1].activations(), plain[1].activations())


class _NoHostSync:
    """Make every way of reading a tensor back to the host raise while a
    vlens hook runs its step plan."""

    NAMES = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu")

    def __init__(self, monkeypatch):
        from vlens.worker import hooks

        self.inside = False
        self.calls: list[str] = []
        visit = hooks.WorkerHooks._visit

        def guarded_visit(hooks, *args, **kwargs):
            self.inside = True
            try:
                return visit(hooks, *args, **kwargs)
            finally:
                self.inside = False

        monkeypatch.setattr(hooks.WorkerHooks, "_visit", guarded_visit)
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def method(t, *args, **kwargs):
            if self.inside:
                self.calls.append(name)
                raise RuntimeError(f"host sync inside a vlens hook: Tensor.{name}")
            return original(t, *args, **kwargs)

        return method


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_the_write_path_never_reads_back_to_the_host(mode, request, monkeypatch):
    s = request.getfixturevalue("llama_session" if mode == "eager" else "compiled_session")
    d = torch.randn(s.hidden_size, generator=torch.Generator().manual_seed(2))
    steers = [vlens.Steer(d, layer=0, scale=1.0),
              vlens.Steer(d, layer=2, scale=0.3, relative=True, span=(1, 5)),
              vlens.Steer(d, layer=1, scale=0.5, site="mlp_out", span="generated")]
    steers = vlens.PerPrompt([steers] * len(PROMPTS))  # all three on every prompt
    ablate = vlens.Ablate("attn_out", [0, 2], direction=d, span=(0, 6))
    before = s.trace(PROMPTS, sites=[], logprobs=False, max_new_tokens=4, steer=steers,
                     ablate=ablate)
    guard = _NoHostSync(monkeypatch)
    run = s.trace(PROMPTS, sites=[], logprobs=False, max_new_tokens=4, steer=steers,
                  ablate=ablate)
    monkeypatch.undo()
    assert guard.calls == []
    assert [t.output_token_ids for t in run] == [t.output_token_ids for t in before]
    assert all(t.steered_rows > 0 for t in run)


def test_compiled_mode_refuses_full_cuda_graphs_and_foreign_workers(tiny_llama):
    from vlens.errors import VlensError

    with pytest.raises(VlensError, match="worker_cls"):
        vlens.Session(tiny_llama, reuse=False, worker_cls="my.Worker")
    with pytest.raises(VlensError, match="enforce_eager=False for compiled mode"):
        vlens.Session(tiny_llama, reuse=False, compilation_config={"mode": 3})


def test_compiled_mode_reads_heads_and_patterns_as_eager_does(compiled_session, llama_session):
    sites = ["q", "k", "v", "z", "attn_pattern"]
    d = torch.randn(compiled_session.hidden_size, generator=torch.Generator().manual_seed(2))
    steer = vlens.Steer(d, layer=1, site="z", scale=0.5)
    eager, compiled = (s.trace(PROMPTS, sites=sites, max_new_tokens=4, steer=steer)
                       for s in (llama_session, compiled_session))
    for a, b in zip(eager, compiled):
        assert a.token_ids == b.token_ids and a.steered_rows == b.steered_rows > 0
        for site in sites:
            assert torch.allclose(a.activations(site), b.activations(site), atol=1e-5), site


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_the_step_counters_split_decode_steps_from_prefill(mode, request):
    """``s.status()``'s decode_* figures count the decode steps alone (one
    new row per request), inside the all-steps figures."""
    s = request.getfixturevalue("llama_session" if mode == "eager" else "compiled_session")
    keys = ("steps_planned", "hook_ns", "reduce_ns", "layout_ns", "decode_steps",
            "decode_hook_ns", "decode_reduce_ns", "decode_layout_ns")
    a = s.status()
    # short prompts, all prefilled in one step; then 5 decode steps together
    s.trace(["w1 w2 w3", "w4 w5", "w6"], layers=[0, 1], sites=SITES, reduce="norm",
            max_new_tokens=6, logprobs=False, ignore_eos=True)
    b = s.status()
    d = {k: b[k] - a[k] for k in keys}
    assert d["steps_planned"] == 6 and d["decode_steps"] == 5, d
    for part in ("hook_ns", "reduce_ns", "layout_ns"):
        assert 0 < d[f"decode_{part}"] < d[part], (part, d)
    assert d["decode_reduce_ns"] < d["decode_hook_ns"]
    # an untraced run plans nothing and counts nothing
    s.generate(["w1 w2"], max_new_tokens=3)
    c = s.status()
    assert all(c[k] == b[k] for k in keys if k.startswith(("decode_", "steps_")))
