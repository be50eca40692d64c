"""The Hugging Face twin (``s.twin``) and the gradient methods on it
(``s.attribution_patch``, ``s.saliency``), each against a reference built
here with plain torch hooks on an independently loaded Hugging Face model.

Only native-route engines: a Hugging Face model of an architecture cannot
be built in a process where vLLM's Transformers backend has started
(conftest's ordering note)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from vlens.errors import VlensError
from vlens.methods.twin import SITES, TOLERANCE

pytestmark = pytest.mark.engine

# long enough that llama_session (prefill chunks of 64) splits it
LONG = " ".join(f"w{(7 * i) % 97}" for i in range(80))
CLEAN = "w3 w14 w15 w92 w65 w35 w89 w79 w32 w38 , w46 w26 ."
CORRUPT = "w3 w14 w15 w92 w11 w35 w89 w79 w32 w38 , w46 w26 ."
# the bundled model's notebook pair (notebooks/05_patching.ipynb)
ANIMAL = ("once upon a time, a sad duck lived in a green house near the farm. sadly, the sky was "
          "grey and the wind was cold. its friend the fox came to say goodbye. the")
ANIMAL_CORRUPT = ANIMAL.replace("sad duck", "sad cat")


def _hf(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


# -- the twin and its check ----------------------------------------------------------

def _twin_matches_engine(s, prompts):
    twin = s.twin()
    assert s.twin() is twin  # held once
    sites = [x for x in SITES if x in s.sites]
    assert set(sites) == set(SITES)  # Llama has all six
    atol, rtol = TOLERANCE["float32"]
    assert set(twin.differences) == set(sites)
    run = s.trace(prompts, sites=sites, max_new_tokens=1, logprobs=False)
    for trace in run:
        _, mine = twin.reads(trace.prompt_token_ids)
        for site in sites:
            theirs = trace.activations(site)
            assert theirs.shape == mine[site].shape, site
            diff, top = float((theirs - mine[site]).abs().max()), float(theirs.abs().max())
            assert diff <= atol + rtol * top, site
            print(f"{s.model}: {site} differs by {diff:.2g} (largest value {top:.3g})")
        assert float(mine["resid_post"][0].abs().max()) > 1e-2  # something was compared
    assert "MiB of parameters" in repr(twin)
    return twin


def test_twin_reads_equal_the_engines(llama_session):
    """Acceptance 2 on the tiny Llama: every site, every layer, a prompt the
    engine prefills in chunks beside a short one in the same batch."""
    twin = _twin_matches_engine(llama_session, [LONG, CLEAN])
    mib = sum(p.numel() * 4 for p in twin.model.parameters()) / 2**20
    assert f"{mib:.1f} MiB" in repr(twin)


def test_twin_of_the_bundled_model(toy_session):
    _twin_matches_engine(toy_session, [ANIMAL])


def test_a_twin_of_other_weights_is_refused(llama_session, tmp_path):
    from vlens.tiny import make_tiny_model

    held = llama_session.twin()
    other = make_tiny_model(tmp_path / "other", "llama", layers=3, seed=7)
    with pytest.raises(VlensError, match=r"does not match the engine.*resid_post \d") as err:
        llama_session.twin(path=other)
    # the message names every site with its measured difference
    for site in SITES:
        assert f"{site} " in str(err.value)
    assert llama_session.twin() is held and held.model is not None  # the good one stays
    with pytest.raises(VlensError, match="not one"):
        llama_session.twin(path=tmp_path / "nowhere")
    with pytest.raises(VlensError, match="device"):
        llama_session.twin(device=3)


def test_close_releases_the_twin(llama_session, tiny_llama):
    import vlens

    from conftest import KV_BYTES

    s = vlens.Session(tiny_llama, max_num_batched_tokens=64, max_model_len=512,
                      kv_cache_memory_bytes=KV_BYTES)  # shares llama_session's engine
    assert s.reused
    twin = s.twin()
    assert twin is not llama_session.twin()  # one per Session
    s.close()
    assert twin.model is None and "released" in repr(twin)
    assert llama_session.twin().model is not None  # the other session's is untouched


# -- attribution patching ----------------------------------------------------------------

def _reference_atp(path, clean, corrupt, site, answer):
    """grad_corrupt(logit diff) . (clean - corrupt) per layer, ``[L, T, width]``
    before the sum over width, with retain_grad hooks on a fresh model."""
    model = _hf(path)
    layers = model.model.layers

    def run(ids, keep_grad):
        got = []

        def keep(x):
            if keep_grad:
                x.retain_grad()
            got.append(x)

        if site == "z":
            hooks = [la.self_attn.o_proj.register_forward_pre_hook(lambda m, a: keep(a[0]))
                     for la in layers]
        else:
            hooks = [la.register_forward_hook(
                lambda m, a, out: keep(out[0] if isinstance(out, tuple) else out)) for la in layers]
        try:
            logits = model(torch.tensor([ids])).logits[0, -1]
        finally:
            for h in hooks:
                h.remove()
        return logits, got

    with torch.no_grad():
        clean_logits, clean_acts = run(clean, False)
    corrupt_logits, corrupt_acts = run(corrupt, True)
    metric = corrupt_logits[answer[0]] - corrupt_logits[answer[1]]
    metric.backward()
    prods = torch.stack([(c.grad * (a - c)).detach()[0] for a, c in zip(clean_acts, corrupt_acts)])
    diff_clean = float(clean_logits[answer[0]] - clean_logits[answer[1]])
    return prods, diff_clean, float(metric.detach())


def test_attribution_patch_equals_hf_autograd(llama_session, tiny_llama):
    """Acceptance 3: every cell equals grad x (clean - corrupt) from plain
    torch autograd within 1e-4, at resid_post per position and at z per head."""
    s = llama_session
    ids = [s.tokenize(CLEAN), s.tokenize(CORRUPT)]
    answer = (ids[0][1], ids[0][2])  # random weights: both runs may predict the same token
    p = s.attribution_patch(CLEAN, CORRUPT, answer=answer)
    assert p.answer == answer and p.grid.shape == (s.n_layers, len(ids[0])) and p.heads is None
    assert p.positions == list(range(len(ids[0]))) and p.layers == list(range(s.n_layers))
    prods, clean_diff, corrupt_diff = _reference_atp(tiny_llama, *ids, "resid_post", p.answer)
    cells = prods.sum(-1)  # [L, T]
    assert abs(p.clean_diff - clean_diff) <= 1e-4 and abs(p.corrupt_diff - corrupt_diff) <= 1e-4
    assert torch.allclose(p.diffs - p.corrupt_diff, cells, atol=1e-4, rtol=0)
    assert torch.allclose(p.grid, cells / (clean_diff - corrupt_diff), atol=1e-4, rtol=0)
    assert float(cells.abs().max()) > 1e-3  # the cells are not all zero

    h = s.attribution_patch(CLEAN, CORRUPT, site="z", heads="all", answer=p.answer)
    n_heads = s.facts.n_heads
    assert h.grid.shape == (s.n_layers, n_heads) and h.heads == list(range(n_heads))
    zprods, _, _ = _reference_atp(tiny_llama, *ids, "z", p.answer)  # [L, T, heads * hd]
    per_head = zprods.reshape(*zprods.shape[:2], n_heads, -1).sum(-1).sum(1)
    assert torch.allclose(h.diffs - h.corrupt_diff, per_head, atol=1e-4, rtol=0)
    assert float(per_head.abs().max()) > 1e-3
    # z per position sums, over the heads, to z per head over positions
    zpos = s.attribution_patch(CLEAN, CORRUPT, site="z", answer=p.answer)
    assert torch.allclose(zpos.diffs.sum(1) - zpos.corrupt_diff * zpos.grid.shape[1],
                          (h.diffs - h.corrupt_diff).sum(1), atol=1e-4)


def test_attribution_patch_arguments(llama_session):
    s = llama_session
    ids = s.tokenize(CLEAN)
    p = s.attribution_patch(CLEAN, CORRUPT, site="attn_out", layers=[2, 0], span=[-1, 4],
                            answer=(ids[1], ids[2]))
    assert p.grid.shape == (2, 2) and p.layers == [2, 0] and p.positions == [len(
        s.tokenize(CLEAN)) - 1, 4]
    a, b = p.answer
    own = s.attribution_patch(CLEAN, CORRUPT, site="attn_out", layers=[2, 0], span=[-1, 4],
                              metric=lambda x: x[a] - x[b])  # the same metric, as a function
    assert torch.allclose(own.grid, p.grid, atol=1e-6)
    for kwargs, match in [
        ({"site": "q"}, "takes gradients at"),
        ({"heads": "all"}, "only site 'z'"),
        ({"heads": True}, "write heads='all'"),
        ({"heads": "some"}, "'all' or a non-empty list of query heads"),
        ({"answer": ("w3", "w3")}, "same token twice"),
        ({"answer": "w3"}, "clean_token, corrupt_token"),
        ({"metric": "kl"}, "logit_diff"),
        ({"metric": lambda x: x, "answer": None}, "scalar"),
        ({"metric": lambda x: x[0], "answer": (1, 2)}, "answer= goes with"),
        ({"layers": [9]}, "does not exist"),
        ({"span": [99]}, "outside the prompt"),
    ]:
        with pytest.raises(VlensError, match=match):
            s.attribution_patch(CLEAN, CORRUPT, **{"answer": (ids[1], ids[2]), **kwargs})
    with pytest.raises(VlensError, match="both predict"):  # nothing to restore
        s.attribution_patch(CLEAN, CLEAN)
    with pytest.raises(VlensError, match="same metric"):
        s.attribution_patch(CLEAN, CLEAN, answer=(ids[1], ids[2]))
    with pytest.raises(VlensError, match="same length"):
        s.attribution_patch(CLEAN, "w3 w14")
    with pytest.raises(TypeError, match="heads='all'"):  # the old name of heads=
        s.attribution_patch(CLEAN, CORRUPT, per_head=True)
    with pytest.raises(VlensError, match="heads='all'"):  # the old flag: what it is now
        s.attribution_patch(CLEAN, CORRUPT, site="z", heads=True)
    assert s.trace(CLEAN, max_new_tokens=1, layers=[0])[0].n_tokens > 0  # still serving


def test_atp_beside_activation_patching_on_the_bundled_pair(toy_session):
    """The notebook's duck/cat pair: AtP and s.patch on the same grids, their
    correlation measured and printed (no threshold: AtP is an estimate)."""
    s = toy_session
    for kw in ({"site": "resid_pre"}, {"site": "resid_post"}):
        atp = s.attribution_patch(ANIMAL, ANIMAL_CORRUPT, **kw)
        act = s.patch(ANIMAL, ANIMAL_CORRUPT, **kw)
        assert atp.grid.shape == act.grid.shape and atp.answer == act.answer
        assert abs(atp.clean_diff - act.clean_diff) <= 1e-3
        assert abs(atp.corrupt_diff - act.corrupt_diff) <= 1e-3
        print(f"bundled model, {kw['site']} grid {tuple(act.grid.shape)}: AtP vs activation "
              f"patching r = {_corr(atp.grid, act.grid):.3f}")
    atp = s.attribution_patch(ANIMAL, ANIMAL_CORRUPT, site="z", heads="all")
    act = s.patch(ANIMAL, ANIMAL_CORRUPT, site="z", heads="all")
    assert atp.grid.shape == act.grid.shape
    print(f"bundled model, z per head {tuple(act.grid.shape)}: AtP vs activation patching "
          f"r = {_corr(atp.grid, act.grid):.3f}")


# -- saliency ------------------------------------------------------------------------------

def test_saliency_against_autograd_and_completeness(llama_session, tiny_llama):
    s = llama_session
    sal = s.saliency(CLEAN)
    ids = s.tokenize(CLEAN)
    model = _hf(tiny_llama)
    emb = model.get_input_embeddings()(torch.tensor([ids])).detach().requires_grad_(True)
    logits = model(inputs_embeds=emb).logits[0, -1]
    assert sal.target == int(logits.argmax())  # default: the top next token
    logits[sal.target].backward()
    ref = (emb.grad * emb)[0].sum(-1).detach()
    assert torch.allclose(sal.grad_x_input, ref, atol=1e-5)
    assert abs(sal.logit - float(logits[sal.target])) <= 1e-4
    # integrated gradients add up to f(x) - f(baseline): the end-of-sequence
    # token's embedding at every position, by default
    eos = s.tokenizer.eos_token_id
    assert sal.baseline == s.token_strings([eos])[0]
    base = model.get_input_embeddings()(torch.tensor([[eos] * len(ids)]))
    assert abs(sal.baseline_logit - float(model(inputs_embeds=base).logits[0, -1, sal.target])) \
        <= 1e-4
    gap = sal.logit - sal.baseline_logit
    assert abs(gap) > 1e-2
    assert abs(float(sal.integrated.sum()) - gap) <= 1e-3 * abs(gap)  # the stated tolerance
    assert abs(float(sal.integrated.sum()) - gap - sal.delta) <= 1e-5  # Captum's delta says it
    zeros = s.saliency(CLEAN, baseline="zeros", steps=8)
    assert zeros.baseline == "zeros" and zeros.steps == 8
    assert torch.allclose(zeros.grad_x_input, sal.grad_x_input)  # the baseline is IG's only
    frame = sal.to_frame()
    assert list(frame.columns) == ["position", "token", "id", "grad_x_input",
                                   "integrated_gradients"]
    assert len(frame) == len(ids) and frame["id"].tolist() == ids
    fig = sal.figure()
    cells = [sh for sh in fig.layout.shapes if sh.name == "token cell"]
    assert len(cells) == 2 * len(ids)  # one row per method
    assert list(fig.layout.yaxis.ticktext)[:2] == ["grad × input", "integrated gradients"]

    other = s.saliency(CLEAN, target="w3")
    assert other.target == s.tokenize("w3")[-1] and other.target_text.strip() == "w3"
    for kwargs, match in [({"target": "w3 w14"}, "2 tokens"), ({"target": 10**6}, "outside"),
                          ({"steps": 1}, "at least 2"), ({"baseline": "w3 w14"}, "2 tokens")]:
        with pytest.raises(VlensError, match=match):
            s.saliency(CLEAN, **kwargs)
    with pytest.raises(VlensError, match="one prompt"):
        s.saliency([CLEAN, CLEAN])


def test_patching_view_shows_atp_beside(toy_session):
    from vlens.widgets import PatchingView

    view = PatchingView(toy_session, auto_run=False, site="resid_pre", layers=[0, 1], atp=True)
    view.run(ANIMAL, ANIMAL_CORRUPT)
    assert view.error == "" and view.attribution is not None
    act, atp = view.patching, view.attribution
    assert atp.grid.shape == act.grid.shape and atp.positions == act.positions
    r = _corr(atp.grid, act.grid)
    assert f"r = {r:.2f}" in view._summary.value
    z = torch.tensor([list(row) for row in view.atp_heatmap.data[0].z])
    assert torch.allclose(z, atp.grid, atol=1e-6)
    assert view._atp_box.layout.display == "" and "AtP beside" in view.settings_text

    shown = PatchingView(act, attribution=atp)  # results only
    assert f"r = {r:.2f}" in shown._summary.value
    plain = PatchingView(act)
    assert plain.attribution is None and "r =" not in plain._summary.value
    assert plain._atp_box.layout.display == "none"
    with pytest.raises(TypeError, match="atp"):
        PatchingView(act, atp=True)
