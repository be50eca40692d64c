"""The SAE that ships for the real model (``smollm2-135m-instruct-sae``:
a TopK SAE of SmolLM2-135M-Instruct's layer-15 ``resid_post``, trained with
SAELens by scripts/train_smollm2_sae.py), measured on Moby-Dick text it was
not trained on, in the engine: its features read in the worker equal
SAELens's encode (tests/_sae_reference.py) of the rows read in the same
trace; the fraction of variance unexplained, mean L0 and the share of
features that fire stay within the issue's goals; the next-token loss with
every row (but each text's first, the attention sink) replaced by the
SAE's reconstruction in the engine rises by at most 0.3 nats; the features
paired with a checkable rule (measured.json) keep their precision and
recall.

The figures are printed (``-s``); docs/features.md quotes the script's,
which measures every held-out paragraph.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import vlens
from vlens.models import corpus

from _sae_reference import reference_encode
from conftest import _session

# one xdist group: its SmolLM2 engine (a module fixture) starts once, not in both test processes
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("real-sae")]

NAME = "smollm2-135m-instruct-sae"
# the script that trained and measured it: its split, rules and measurements
_spec = importlib.util.spec_from_file_location(
    "train_smollm2_sae", Path(__file__).resolve().parents[1] / "scripts" / "train_smollm2_sae.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)
RULES, SPLIT, measure, measure_features = (script.RULES, script.SPLIT, script.measure,
                                           script.measure_features)

#: the held-out paragraphs measured here (7,700 tokens)
N_TEXTS = 100


@pytest.fixture(scope="module")
def s(smollm2_folder):
    session = _session(str(smollm2_folder), max_model_len=1024)
    yield session
    session.close()


@pytest.fixture(scope="module")
def held_out(moby_dick_folder) -> list[str]:
    return corpus.paragraphs(moby_dick_folder)[SPLIT:][:N_TEXTS]


def test_the_sae_is_in_the_registry_and_loads_by_name(s):
    folder = vlens.models.get(NAME)
    assert folder == Path(vlens.__file__).parent / "models" / "smollm2_sae"
    assert vlens.models.is_here(NAME)
    (row,) = [r for r in vlens.models.available() if r["name"] == NAME]
    assert row["kind"] == "sae" and row["here"] and row["path"] == str(folder)
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 12 * 2**20
    sae = s.sae(NAME)
    cfg = json.loads((folder / "cfg.json").read_text())
    assert (sae.site, sae.layer, sae.d_in) == ("resid_post", 15, 576)
    assert sae.spec.architecture == "topk" and sae.spec.k == cfg["k"]
    assert sae.d_sae == cfg["d_sae"] and sae.path == folder
    with pytest.raises(vlens.VlensError, match="is an SAE in vlens's registry, not a model"):
        vlens.models.resolve(NAME)


def test_features_read_in_the_worker_equal_saelens_encode(s, held_out):
    sae = s.sae(NAME)
    folder = vlens.models.get(NAME)
    run = s.trace(held_out[:8], sites=["resid_post"], layers=[sae.layer], saes=[sae],
                  max_new_tokens=1)
    w = {n: t.double() for n, t in sae.weights.items()}
    clear_rows = []
    for t in run:
        x = t.activations("resid_post", layer=sae.layer)
        got, want = t.features(sae), reference_encode(x, folder)
        assert got.shape == (t.n_tokens, sae.d_sae) and (want > 0).any()
        # rows whose k-th and (k+1)-th pre-activations are closer than float32's
        # rounding of them may pick another feature in float32 than in
        # float64: compare the others
        pre = (x.double() - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
        pre32 = (x - sae.weights["b_dec"]) @ sae.weights["W_enc"] + sae.weights["b_enc"]
        rounding = float((pre32.double() - pre).abs().max())
        top = pre.topk(sae.spec.k + 1, dim=-1).values
        clear = (top[:, -2] - top[:, -1]) > 2 * rounding
        clear_rows.append(clear)
        torch.testing.assert_close(got[clear], want[clear], atol=2e-3, rtol=1e-3)
        # a near tie swaps the k-th feature at most; the others agree
        g, r = got[~clear], want[~clear]
        assert ((g > 0) != (r > 0)).sum(-1).le(2).all()
        both = (g > 0) & (r > 0)
        torch.testing.assert_close(g[both], r[both], atol=2e-3, rtol=1e-3)
    clear = torch.cat(clear_rows)
    # with 4096 features and k = 48 the 48th and 49th pre-activations are
    # often close: about one row in twenty is within float32's rounding
    print(f"{int(clear.sum())} of {len(clear)} rows without a near tie at the k-th feature")
    assert clear.float().mean() > 0.9


def test_held_out_statistics_meet_the_goals(s, held_out):
    sae = s.sae(NAME)
    stats = measure(s, sae, held_out)
    print(f"{NAME} on {stats['tokens']} held-out tokens: {stats}")
    assert stats["tokens"] > 7000
    assert stats["fvu"] <= 0.25
    assert stats["mean_l0"] <= 64 and stats["mean_l0"] == pytest.approx(sae.spec.k, abs=0.5)
    assert stats["dead_fraction"] <= 0.10
    assert 0 <= stats["loss_increase"] <= 0.3
    assert 2.0 < stats["loss"] < 5.0  # the model itself reads Melville at all
    recorded = sae.measured()["held_out"]
    assert recorded["tokens"] > 25000 and recorded["dead_fraction"] <= 0.10


def test_the_rule_features_hold_on_held_out_text(s, held_out):
    """The features measured.json pairs with a rule (a regex on the token's
    text) at >= 0.85 precision and >= 0.8 recall over every held-out
    paragraph: on this slice (a quarter of it), read in the worker,
    precision and recall >= 0.75 for each with at least 20 tokens of its
    rule here (five or more; he/him/his, 0.86 precision over all of it, is
    0.80 here)."""
    sae = s.sae(NAME)
    features = sae.measured()["features"]
    assert set(features) == set(RULES)
    claimed = {name: f for name, f in features.items()
               if f["held_out_precision"] >= 0.85 and f["held_out_recall"] >= 0.8}
    tok = s.tokenizer
    got = measure_features(s, sae, held_out, claimed, lambda i: tok.decode([i]))
    checked = 0
    for name, g in got.items():
        print(f"{name}: feature {g['feature']} precision {g['held_out_precision']} recall "
              f"{g['held_out_recall']} ({g['positives']} tokens)")
        if g["positives"] >= 20:
            checked += 1
            assert g["held_out_precision"] >= 0.75 and g["held_out_recall"] >= 0.75, name
    assert checked >= 5


def test_feature_view_starts_at_a_recipe_that_does_something_visible(s):
    """measured.json's steer and clamp (scripts/smollm2_sae_recipe.py, the
    "whale word" feature on 16 openings that name no whale) are where
    FeatureView starts, and they still do what the file says: the steer
    turns most continuations to whales (measured: all 16, 10 well formed),
    the clamp changes nearly all of them and leaves them well formed
    (16 and 15)."""
    spec = importlib.util.spec_from_file_location(
        "smollm2_sae_recipe",
        Path(__file__).resolve().parents[1] / "scripts" / "smollm2_sae_recipe.py")
    recipe_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe_script)
    sae = s.sae(NAME)
    measured = sae.measured()
    steer, clamp = measured["steer"], measured["clamp"]
    fv = vlens.FeatureView(s, sae, recipe_script.PROMPTS[:2])
    assert (fv.scale, fv.relative, fv.span) == (steer["scale"], True, clamp["span"])
    fv.reset_to_recipe()
    assert fv.feature == steer["feature"] and fv.value == clamp["value"]

    prompts, n = recipe_script.PROMPTS, recipe_script.NEW_TOKENS
    steered = recipe_script.rates(s.compare(prompts, steer=fv.steer(), max_new_tokens=n))
    fv.mode = "clamp"
    clamped = recipe_script.rates(s.compare(prompts, clamp=fv.steer(), max_new_tokens=n))
    print("steer", steered, "| clamp", clamped)
    assert steered["whale"] >= 0.75 and steered["well_formed"] >= 0.5
    assert clamped["changed"] >= 0.9 and clamped["well_formed"] >= 0.85
