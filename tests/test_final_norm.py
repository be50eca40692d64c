"""The residual stream -> logits through the final norm, written once
(``vlens/protocol/final_norm.py``) and the same wherever it is used.

The offline lenses (``LogitLens.from_pretrained``, ``Diff.lens``), which read
the norm's facts from the checkpoint, equal the engine's logit lens (facts
read off the loaded module) and a Hugging Face reference within 1e-4 on
tiny random Llama (RMSNorm, untied), Gemma (``1 + w``, tied), Gemma 2
(``1 + w``, a final softcap that bites) and Gemma 3 models; the pure parts
(the facts of a module, LayerNorm, a projection, a multimodal Gemma 3
folder) are checked without an engine.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from vlens.lens import LogitLens
from vlens.protocol.final_norm import FinalNorm, final_logits, norm_of
from vlens.results.diff import Diff, DiffText
from _hf_forks import run_script

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "w3 w14 , w15 . w92 w65 , w35 . w89 w79 ."
TOL = 1e-4
FAMILIES = ["llama", "gemma", "gemma2", "gemma3"]
CAP = 4.0  # Gemma 2's final softcap, small enough to change the random model's logits


def _tiny(models_dir: Path, family: str) -> Path:
    from vlens.tiny import make_tiny_model

    path = make_tiny_model(models_dir / f"final-norm-{family}", family, hidden=64, heads=2,
                           layers=2, seed=13)
    if family == "gemma2":
        cfg = json.loads((path / "config.json").read_text())
        cfg["final_logit_softcapping"] = CAP
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def tiny_models(models_dir, tiny_llama) -> dict[str, Path]:
    return {f: tiny_llama if f == "llama" else _tiny(models_dir, f) for f in FAMILIES}


def hf_logits(jobs: dict[Path, torch.Tensor], tmp_path: Path) -> dict[str, torch.Tensor]:
    """Hugging Face's logits of each folder's rows, from a fresh process."""
    spec, out = tmp_path / "final-norm-in.pt", tmp_path / "final-norm-out.pt"
    torch.save({str(p): r for p, r in jobs.items()}, spec)
    proc = run_script(ROOT / "tests" / "_hf_final_norm.py", spec, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = float((got.detach().float() - want.detach().float()).abs().max())
    assert err <= TOL, f"{what}: off by {err:.3g}"


def _diff_lens(path: Path, resid: torch.Tensor, layer: int, k: int):
    """``Diff.lens`` of the one row ``resid[layer]`` (a Diff made by hand
    whose only difference is that row), through ``path``'s folder."""
    n_layers = resid.shape[0]
    text = DiffText(kind="prompt", ids=[0], tokens=["x"], n_prompt=1, kl=torch.zeros(1),
                    logprob_base=torch.zeros(1), logprob_tuned=torch.zeros(1),
                    outside_base=torch.zeros(1), outside_tuned=torch.zeros(1),
                    delta={"resid_post": resid[:, None]},
                    cosine={"resid_post": torch.ones(n_layers, 1)},
                    layers=list(range(n_layers)))
    d = Diff(prompts=[PROMPT], texts=[{"prompt": text}], layers=list(range(n_layers)),
             sites=["resid_post"], base_model=str(path), tuned_model=str(path),
             shared_vocab=0)
    return d.lens(layer, first=1, k=k)


# -- pure ---------------------------------------------------------------------


def test_the_facts_of_a_module_give_what_the_module_computes():
    torch.manual_seed(0)
    x, unembed = torch.randn(5, 8) * 3, torch.randn(11, 8)
    ln = torch.nn.LayerNorm(8)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.2, 0.2)
    facts = norm_of(ln)
    assert facts.kind == "layer" and norm_of(ln) is facts  # read once per module
    _close(final_logits(x, facts, unembed), ln(x).detach() @ unembed.T, "LayerNorm")

    class GemmaRMSNorm(torch.nn.Module):  # Gemma's: scales by (1 + w)
        def __init__(self):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.randn(8) * 0.3), 1e-6

        def forward(self, h):
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return h * (1.0 + self.weight)

    g = GemmaRMSNorm()
    facts = norm_of(g, softcap=2.0)
    assert facts.offset == 1.0 and facts.softcap == 2.0
    want = torch.tanh(g(x).detach() @ unembed.T / 2.0) * 2.0
    _close(final_logits(x, facts, unembed), want, "Gemma RMSNorm, softcapped")
    # a projection after the norm, as a weight or as the module; the unembedding as a callable
    proj = torch.nn.Linear(8, 6, bias=False)
    head = torch.randn(11, 6)
    want = proj(ln(x)).detach() @ head.T
    _close(final_logits(x, norm_of(ln), head, project=proj.weight.detach()), want, "project")
    _close(final_logits(x, norm_of(ln), lambda h: h @ head.T, project=proj), want, "modules")
    assert norm_of(None).kind == "none"
    with pytest.raises(ValueError, match="knows RMSNorm and LayerNorm"):
        norm_of(torch.nn.GroupNorm(1, 8))
    with pytest.raises(ValueError, match="'rms', 'layer' or 'none'"):
        FinalNorm("batch")


def test_offline_lenses_equal_hugging_face_on_every_family(tiny_models, tmp_path):
    torch.manual_seed(1)
    rows = {p: torch.randn(2, 3, json.loads((p / "config.json").read_text())["hidden_size"]) * 4
            for p in tiny_models.values()}
    want = hf_logits(rows, tmp_path)
    for family, path in tiny_models.items():
        lens = LogitLens.from_pretrained(path)
        got = lens.logits(rows[path])
        _close(got, want[str(path)], f"{family}: LogitLens")
        frame = _diff_lens(path, rows[path][:, 1], 1, k=5)
        ids = list(frame["token_id"])
        _close(torch.tensor(list(frame["logit"])), want[str(path)][1, 1, ids],
               f"{family}: Diff.lens")
        if family == "gemma2":  # the softcap bites: without it the logits differ
            assert lens.checkpoint.norm.softcap == CAP
            plain = dataclasses.replace(lens.checkpoint.norm, softcap=None)
            uncapped = final_logits(rows[path], plain, lens.unembed)
            assert float((uncapped - want[str(path)]).abs().max()) > 100 * TOL
        if family.startswith("gemma"):  # the gain a feature's logits are scaled by
            assert lens.checkpoint.norm.offset == 1.0
            torch.testing.assert_close(lens.norm_weight, lens.checkpoint.norm.weight + 1)


def test_a_multimodal_gemma3_folder_reads_as_its_text_model(tiny_models, tmp_path):
    """Gemma 3's multimodal checkpoints keep the text model's config under
    ``text_config`` and its weights under ``model.language_model.``."""
    from safetensors.torch import load_file, save_file

    src = tiny_models["gemma3"]
    cfg = json.loads((src / "config.json").read_text())
    folder = tmp_path / "gemma3-mm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": cfg}))
    weights = load_file(str(src / "model.safetensors"))
    save_file({k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()},
              str(folder / "model.safetensors"))
    x = torch.randn(4, 64) * 4
    _close(LogitLens.from_pretrained(folder).logits(x),
           LogitLens.from_pretrained(src).logits(x), "multimodal Gemma 3")


# -- against the engine -------------------------------------------------------


@pytest.fixture(scope="module")
def family_session(tiny_models, engine_options, request):
    """One engine per Gemma family, made when first asked and closed at the
    end of the module; Llama shares the session-wide engine."""
    import vlens

    made: dict[str, object] = {}

    def get(family: str):
        if family == "llama":
            return request.getfixturevalue("llama_session")
        if family not in made:
            made[family] = vlens.Session(tiny_models[family], reuse=False, max_model_len=256,
                                         max_num_batched_tokens=64, **engine_options)
        return made[family]

    yield get
    for s in made.values():
        s.close()


@pytest.mark.engine
@pytest.mark.parametrize("family", FAMILIES)
def test_offline_lenses_equal_the_engines_lens(family, family_session, tiny_models, tmp_path):
    s, path = family_session(family), tiny_models[family]
    t = s.trace(PROMPT, max_new_tokens=1, logit_lens=s.facts.vocab_size)[0]
    resid = t.activations("resid_post")  # [L, T, H]
    ids, probs = t.logit_lens()  # the engine's lens: every token, [L, T, vocab]
    engine = torch.zeros_like(probs).scatter_(-1, ids, probs).log()  # its log-probabilities
    want = hf_logits({path: resid}, tmp_path)[str(path)]
    lens = LogitLens.from_pretrained(path)
    got = lens.logits(resid)
    _close(got, want, f"{family}: LogitLens vs Hugging Face")
    _close(got.log_softmax(-1), engine, f"{family}: LogitLens vs the engine's lens")
    _close(want.log_softmax(-1), engine, f"{family}: Hugging Face vs the engine's lens")
    last, j = resid.shape[0] - 1, 4
    for layer in (0, last):
        frame = _diff_lens(path, resid[:, j], layer, k=5)
        ids = list(frame["token_id"])
        _close(torch.tensor(list(frame["prob"])), engine[layer, j, ids].exp(),
               f"{family}: Diff.lens vs the engine's lens, layer {layer}")
        _close(torch.tensor(list(frame["logit"])), want[layer, j, ids],
               f"{family}: Diff.lens vs Hugging Face, layer {layer}")
