"""``vlens train-sae`` / ``vlens.train_sae``: a TopK SAE trained on a harvest
with SAELens's trainer (a small one, on the tiny Llama: seconds), saved in
SAELens's format, loaded by ``s.sae``, its features read in the worker equal
to SAELens's encode of the same rows; it reconstructs its training rows
better than their mean does; bad arguments are clear errors.
"""

from __future__ import annotations

import json

import pytest
import torch

import vlens
from vlens import cli

from _sae_reference import reference_encode

pytestmark = pytest.mark.engine


def _text(n_words: int, offset: int) -> str:
    return " ".join(f"w{(offset + 5 * i) % 200}" for i in range(n_words))


TEXTS = [_text(40 + (7 * k) % 50, k) for k in range(40)]


@pytest.fixture(scope="module")
def harvest(llama_session, tmp_path_factory):
    out = tmp_path_factory.mktemp("train-sae") / "h"
    return llama_session.harvest(TEXTS, layers=[1], out=out, shard_tokens=400)


def test_train_sae_on_the_command_line_loads_with_s_sae(llama_session, harvest, tmp_path,
                                                        capsys):
    s = llama_session
    out = tmp_path / "sae"
    assert cli.main(["train-sae", str(harvest.folder), "--layer", "1", "--width", "64",
                     "--k", "4", "--out", str(out), "--tokens", str(256 * 60),
                     "--batch-size", "256", "--lr", "3e-3"]) == 0
    assert f"vlens train-sae: {out} (60 steps of 256 rows" in capsys.readouterr().out
    cfg = json.loads((out / "cfg.json").read_text())
    assert cfg["architecture"] == "topk" and cfg["k"] == 4 and cfg["d_sae"] == 64
    assert cfg["metadata"]["hook_name"] == "blocks.1.hook_resid_post"
    assert cfg["normalize_activations"] == "none"  # SAELens folded the scale in
    info = json.loads((out / "training.json").read_text())
    assert info["trainer"].startswith("sae_lens.SAETrainer") and info["steps"] == 60

    sae = s.sae(str(out))
    assert (sae.site, sae.layer, sae.d_sae, sae.spec.k) == ("resid_post", 1, 64, 4)
    run = s.trace(TEXTS[:3], layers=[1], saes=[sae], max_new_tokens=1)
    for t in run:
        x = t.activations("resid_post", layer=1)
        torch.testing.assert_close(t.features(sae), reference_encode(x, out),
                                   atol=1e-4, rtol=1e-4)

    # it learned something: its training rows (first tokens aside) are
    # reconstructed far better than by their mean
    x = harvest.read("resid_post", 1)
    keep = torch.ones(len(x), dtype=torch.bool)
    keep[[a for a, _ in harvest.spans]] = False
    x = x[keep]
    r = sae.decode(sae.encode(x))
    fvu = float(((x - r) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
    assert fvu < 0.5, fvu


def test_bfloat16_weights_progress_and_bad_arguments(harvest, tmp_path):
    seen = []
    out = vlens.train_sae(harvest, width=32, k=2, out=tmp_path / "bf16", tokens=768,
                          batch_size=256, dtype="bfloat16",
                          progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    sae = vlens.SAE.load(out)
    assert sae.weights["W_enc"].dtype == torch.float32 and sae.d_sae == 32
    with pytest.raises(vlens.VlensError, match="k \\(9\\) cannot exceed width \\(8\\)"):
        vlens.train_sae(harvest, width=8, k=9, out=tmp_path / "x")
    with pytest.raises(vlens.VlensError, match="layer 0 was not harvested"):
        vlens.train_sae(harvest, layer=0, width=8, k=2, out=tmp_path / "x")
    with pytest.raises(vlens.VlensError, match="at least one batch"):
        vlens.train_sae(harvest, width=8, k=2, out=tmp_path / "x", tokens=10)
    assert not (tmp_path / "x").exists()
    assert cli.main(["train-sae", str(tmp_path), "--width", "8", "--k", "2",
                     "--out", str(tmp_path / "x")]) == 1
