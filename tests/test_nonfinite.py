"""No non-finite value enters the engine from vlens (the bundled model).

A write that could overflow the model's dtype is refused before it runs;
one that turns non-finite in the step anyway (relative adds compounding
layer after layer, an ``edit=`` function) has its rows put back, fails its
own request with an error naming the write, and leaves nothing behind in
the KV cache: other users' short prompts afterwards (a partly filled
block, whose stale tail vLLM's CPU attention reads) equal their clean runs
bit for bit. The server's side of it is in test_serve.py.
"""

from __future__ import annotations

import pytest
import torch

import vlens
from vlens.errors import EngineError, VlensError

pytestmark = pytest.mark.engine

SHORT = ["the wind", "a happy fox was", "the sky", "one day, a bear"]
SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


def _plain(s) -> list:
    return s.trace(SHORT, layers=[0, s.n_layers - 1], max_new_tokens=4)


def _same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_token_ids == y.output_token_ids
        assert torch.equal(x.activations(), y.activations())


@pytest.fixture(scope="module")
def direction(toy_session):
    return toy_session.direction(["a happy fox"], ["a sad fox"], layer=1)


def test_writes_that_would_overflow_are_refused_naming_the_bound(toy_session, direction):
    s = toy_session
    with pytest.raises(VlensError, match=r"would overflow this float32 model: a write may put "
                                         r"at most .* Use a smaller scale"):
        s.trace("the wind was", steer=vlens.Steer(direction, layer=1, scale=1e37))
    with pytest.raises(VlensError, match="relative scale of 3e\\+38 is out of range.*at most 100"):
        s.trace("the wind was", steer=vlens.Steer(direction, layer=1, scale=3e38, relative=True))
    huge = torch.full((s.hidden_size,), 1e30)
    with pytest.raises(VlensError, match="Ablate.*would overflow"):
        s.trace("the wind was", ablate=vlens.Ablate("resid_post", 1, kind="mean", mean=huge))
    assert s.status()["steps_seen"] >= 0 and s.trace("the wind", max_new_tokens=2)[0].text


def test_a_write_gone_non_finite_fails_alone_and_spoils_no_later_call(toy_session, direction):
    s = toy_session
    clean = _plain(s)
    before = s.status()
    # each relative add multiplies the row's norm by ~100: within every bound
    # alone, past float32's range after a few layers
    steers = [vlens.Steer(direction, layer=layer, scale=100.0, relative=True, site=site)
              for layer in range(s.n_layers) for site in SITES]
    with pytest.raises(EngineError, match="a steering add turned this request's values "
                                          "non-finite.*put back the values"):
        s.trace(["the wind was happy and"] * 2, steer=steers, max_new_tokens=8)
    _same(_plain(s), clean)  # short prompts: partly filled KV blocks reused
    with pytest.raises(EngineError, match="its edit= function turned .* non-finite"):
        s.trace(["the wind"], edit=lambda rows, ctx: rows * float("inf"),
                edit_at=[("resid_post", 2)], max_new_tokens=4)
    _same(_plain(s), clean)
    # a mean just inside the bound is a legal (if wild) ablation
    from vlens.checks import write_bound

    big = torch.full((s.hidden_size,), write_bound(s._runner.facts) * 0.99)
    s.trace("the wind was", ablate=vlens.Ablate("resid_post", 1, kind="mean", mean=big),
            max_new_tokens=4)
    _same(_plain(s), clean)
    after = s.status()
    assert after["nonfinite_writes"] > before["nonfinite_writes"]
    assert after["hook_errors"] == before["hook_errors"]
    assert after["records"] == 0 and after["plans"] == 0


def test_a_huge_clamp_is_refused_and_the_largest_allowed_leaves_others_clean(toy_session):
    from vlens.methods.sae import CLAMP_MAX
    from vlens.models import toyworld_sae_path

    s = toy_session
    sae = vlens.SAE.load(toyworld_sae_path())
    for value in (1e30, float("inf"), float("nan")):
        with pytest.raises(VlensError, match=r"Clamp value must be a finite number with "
                                             r"\|value\| <= 10000"):
            vlens.Clamp(sae, feature=0, value=value)
    clean = _plain(s)
    run = s.trace("the wind was", clamp=vlens.Clamp(sae, feature=0, value=CLAMP_MAX),
                  layers=[s.n_layers - 1], max_new_tokens=4)
    assert torch.isfinite(run[0].activations()).all()
    _same(_plain(s), clean)
    assert s.status()["records"] == 0
