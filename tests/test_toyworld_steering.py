"""The bundled model's sentiment recipe, through vlens on the real engine:
a difference-of-means direction at layer 3, added relative to each token's
norm (scale 1.5), flips held-out stories' sentiment and keeps them whole."""

from __future__ import annotations

import pytest

import vlens
from vlens.models import world

pytestmark = pytest.mark.engine

LAYER, SCALE, N = 3, 1.5, 100  # N prompts per direction


def test_relative_steering_flips_sentiment_through_vlens(toy_session):
    happy, sad = world.sentiment_prompts()
    d = toy_session.direction(happy, sad, layer=LAYER, position="last")
    rates = {}
    for source, target, sign in ((world.SAD, world.HAPPY, 1.0), (world.HAPPY, world.SAD, -1.0)):
        prompts = world.steering_prompts(source, N)
        st = vlens.Steer(sign * d, layer=LAYER, scale=SCALE, relative=True)
        base = toy_session.trace(prompts, sites=[], logprobs=False, max_new_tokens=64)
        steered = toy_session.trace(prompts, sites=[], steer=st, logprobs=False, max_new_tokens=64)
        rates[source] = (
            sum(world.sentiment_of(t.text) == target for t in steered) / N,
            sum(world.sentiment_of(t.text) == target for t in base) / N,
            sum(world.is_well_formed(t.text) for t in steered) / N,
        )
    flips = sum(r[0] for r in rates.values()) / 2
    base_flips = sum(r[1] for r in rates.values()) / 2
    formed = sum(r[2] for r in rates.values()) / 2
    assert flips >= 0.90, rates
    assert base_flips <= 0.05, rates
    assert formed >= 0.80, rates


def test_relative_steer_is_a_unit_direction_scaled_per_token(toy_session):
    import torch

    d = torch.zeros(toy_session.hidden_size)
    d[0] = 3.0
    st = vlens.Steer(d, layer=1, scale=0.5, relative=True)
    assert torch.equal(st.vector, d / 3.0)
    prompt = world.example_prompts(1)[0]
    base = toy_session.trace(prompt, layers=[1], max_new_tokens=1)[0]
    got = toy_session.trace(prompt, layers=[1], steer=st, max_new_tokens=1)[0]
    delta = got.activations()[0] - base.activations()[0]
    expected = 0.5 * base.activations()[0].norm(dim=-1)
    assert torch.allclose(delta[:, 0], expected, rtol=1e-4, atol=1e-3)
    assert delta[:, 1:].abs().max() < 1e-3
    with pytest.raises(vlens.VlensError, match="non-zero"):
        vlens.Steer(torch.zeros(toy_session.hidden_size), layer=1, relative=True)
