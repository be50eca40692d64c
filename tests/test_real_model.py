"""The methods on a real pretrained model (issue 48): SmolLM2-135M-Instruct
(``vlens models get smollm2-135m-instruct``: 30 layers, its 4-bit release
dequantised to float32), one engine for the whole file, each method against
a Hugging Face float32 reference of the same folder built here with plain
torch hooks (the helpers of tests/_hf_reference.py, _hf_heads.py and
_hf_methods.py, called in this process as tests/test_twin.py and
tests/test_registry.py do: the engine is vLLM's native Llama, which patches
no Hugging Face class; the reference model is loaded before the engine).

Tolerances: the applicability map's float32 row (``TOLERANCE["float32"]``
in vlens/methods/twin.py: 1e-4 absolute + 1e-4 x the reference's largest
|value|), the form the twin's own check uses; on this model the residual
stream reaches about 2e4, so the relative term carries the residual sites.
The figures measured are printed (``-s``) and quoted in docs/models.md.
"""

from __future__ import annotations

import pytest
import torch

import vlens
from vlens.methods.twin import TOLERANCE
from vlens.protocol.architectures import ARCHITECTURES

from conftest import _session

pytestmark = pytest.mark.engine

ATOL, RTOL = TOLERANCE["float32"]
ARCH = ARCHITECTURES["LlamaForCausalLM"]
RESID_SITES = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"]
HEAD_SITES = ["q", "k", "v", "z", "attn_pattern"]
LAYERS = [0, 1, 14, 28, 29]
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
LONG = ("The old lighthouse keeper climbed the narrow stairs every evening to light the lamp. "
        "Ships passing the rocky coast relied on its beam, and in forty years he had never "
        "once missed a single night, not even in the worst of the winter storms")
PROMPTS = [CLEAN, LONG]


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, atol: float = ATOL,
           rtol: float = RTOL) -> float:
    """Assert ``|got - ref| <= atol + rtol * max|ref|``; return the difference."""
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    diff, top = float((got - ref).abs().max()), float(ref.abs().max())
    print(f"smollm2 {name}: largest difference {diff:.2g} (largest value {top:.3g})")
    assert diff <= atol + rtol * top, f"{name} differs by {diff:.3g} (largest value {top:.3g})"
    return diff


@pytest.fixture(scope="module")
def hf(smollm2_folder):
    """Hugging Face's float32 model of the folder, eager attention (the
    patterns are its ``output_attentions``), loaded before the engine."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    yield model
    del model


@pytest.fixture(scope="module")
def s(hf, smollm2_folder):
    session = _session(str(smollm2_folder), max_model_len=512)
    yield session
    session.close()


def _hf_run(hf, ids, change=None):
    """Every residual site at every layer (``{site: [L, T, H]}``) and the
    logits ``[T, vocab]``; ``change = (site, layer, fn)`` as in
    tests/_hf_reference.py."""
    from _hf_reference import _hooks

    handles, got = _hooks(hf, ARCH, RESID_SITES, change)
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return {k: torch.stack(v) for k, v in got.items()}, logits


@pytest.fixture(scope="module")
def reads(s, hf):
    run = s.trace(PROMPTS, sites=RESID_SITES + HEAD_SITES, layers=LAYERS, max_new_tokens=1,
                  logprobs=False, logit_lens=5)
    from _hf_heads import head_values

    refs = []
    for t in run:
        vals, _ = _hf_run(hf, t.prompt_token_ids)
        refs.append((vals, head_values(hf, t.prompt_token_ids)))
    return run, refs


def test_the_prompts_tokenize_as_hugging_face_does(s, smollm2_folder, reads):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    run, _ = reads
    for prompt, t in zip(PROMPTS, run):
        assert list(t.prompt_token_ids) == tok(prompt)["input_ids"]
    assert len(run[1].prompt_token_ids) >= 40
    assert s.n_layers == 30 and s.facts.dtype == "float32"


@pytest.mark.parametrize("site", RESID_SITES + HEAD_SITES)
def test_reads_equal_hugging_face(reads, site):
    run, refs = reads
    for i, (t, (vals, heads)) in enumerate(zip(run, refs)):
        ref = heads[site] if site in heads else vals[site]
        ref = ref[LAYERS]
        got = t.activations(site)
        if site != "attn_pattern":
            got, ref = got.reshape(ref.shape[:2] + (-1,)), ref.reshape(ref.shape[:2] + (-1,))
        _close(f"{site} (prompt {i}, layers {LAYERS})", got, ref)


def test_the_logit_lens_equals_hugging_faces_final_norm_and_head(reads, hf):
    run, refs = reads
    for i, (t, (vals, _)) in enumerate(zip(run, refs)):
        with torch.no_grad():
            probs = hf.lm_head(hf.model.norm(vals["resid_post"][LAYERS])).softmax(-1)
        top_p, top_ids = probs.topk(5, dim=-1)
        ids, p = t.logit_lens()
        # ids may swap only where two probabilities tie within the tolerance
        same = ids == top_ids
        tied = (top_p[..., :-1] - top_p[..., 1:]).abs() <= ATOL + RTOL
        assert same[..., 0].all() or tied[..., 0][~same[..., 0]].all(), f"prompt {i} top-1"
        assert (same | torch.nn.functional.pad(tied, (0, 1)) | torch.nn.functional.pad(
            tied, (1, 0))).all(), f"prompt {i}"
        _close(f"logit lens top-5 probabilities (prompt {i})", p, probs.gather(-1, ids))


def test_a_steer_equals_a_hugging_face_hook_adding_the_vector(s, hf, reads):
    run, refs = reads
    layer = 14
    vector = torch.randn(576, generator=torch.Generator().manual_seed(0))
    # a push of half the layer's typical residual norm: it moves the answer
    vector *= 0.5 * float(refs[0][0]["resid_post"][layer].norm(dim=-1).median()) / vector.norm()
    steered = s.trace(PROMPTS, sites=["resid_post"], layers=[29], max_new_tokens=1,
                      steer=vlens.Steer(vector, layer=layer, site="resid_post"))
    moved = 0.0
    for i, t in enumerate(steered):
        ids = list(t.prompt_token_ids)
        _, logits = _hf_run(hf, ids, ("resid_post", layer, lambda x: x + vector))
        lp = logits.log_softmax(-1)
        _, clean_logits = _hf_run(hf, ids)
        moved = max(moved, float((lp[-1] - clean_logits.log_softmax(-1)[-1]).abs().max()))
        assert t.output_token_ids[0] == int(lp[-1].argmax())
        n = len(ids)
        # vLLM's own logprobs: each prompt token after the first, then the next token
        got = torch.tensor(t.logprobs[1:n + 1])
        ref = torch.cat([lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0],
                         lp[-1, t.output_token_ids[0]].reshape(1)])
        _close(f"steered logprobs (prompt {i})", got, ref)
    assert moved > 0.5, moved  # the steer changed the distribution


def test_patching_equals_a_hugging_face_patching_loop(s, hf):
    from _hf_methods import patch

    clean, corrupt = s.tokenize(CLEAN), s.tokenize(CORRUPT)
    assert len(clean) == len(corrupt)
    swapped = [i for i, (a, b) in enumerate(zip(clean, corrupt)) if a != b]
    assert len(swapped) == 1
    positions = [swapped[0], len(clean) - 1]
    p = s.patch(CLEAN, CORRUPT, layers=[0, 14, 29], span=positions, answer=(" Mary", " John"))
    ref = patch(hf, ARCH, {"clean": clean, "corrupt": corrupt, "site": "resid_post",
                           "layers": p.layers, "positions": p.positions,
                           "answer": list(p.answer), "heads": False})
    assert p.positions == positions
    assert ref["clean_diff"] > 0 > ref["corrupt_diff"]  # the model does IOI
    top = max(abs(ref["clean_diff"]), abs(ref["corrupt_diff"]))
    _close("patching clean/corrupt logit differences",
           torch.tensor([p.clean_diff, p.corrupt_diff]),
           torch.tensor([ref["clean_diff"], ref["corrupt_diff"]]))
    _close("patching cells' logit differences", p.diffs, ref["diffs"])
    # the normalised grid: a cell's tolerance (three differences' worth) over
    # the range it is divided by
    span = ref["clean_diff"] - ref["corrupt_diff"]
    _close("patching grid", p.grid, ref["grid"], atol=3 * (ATOL + RTOL * top) / span, rtol=0)
    assert float(p.grid[-1, -1]) == pytest.approx(1.0, abs=1e-4)  # the last cell restores


def test_dla_sums_to_the_logit_difference_and_equals_hugging_face(s, hf):
    a = s.logit_attribution(CLEAN, answer=" Mary", wrong=" John")
    rel = float((a.total - a.logit_diff).abs().max()) / float(a.logit_diff.abs().max())
    print(f"smollm2 DLA: total vs logit_diff relative {rel:.2g}")
    assert rel <= 1e-4
    ids = s.tokenize(CLEAN)
    _, logits = _hf_run(hf, ids)
    ref = logits[-1, a.answer[0]] - logits[-1, a.wrong[0]]
    _close("DLA logit difference", a.logit_diff, ref.reshape(1))
    assert float(ref) > 0  # " Mary" wins


def test_the_twin_builds_and_passes_its_check(s):
    twin = s.twin()
    print(f"smollm2 {twin!r}; per site {twin.differences}")
    assert "largest difference" in repr(twin)
    assert set(twin.differences) == {"resid_pre", "resid_mid", "resid_post", "attn_out",
                                     "mlp_out", "z"}
