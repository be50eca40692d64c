"""The bundled model's sentiment recipe (``vlens.models.RECIPE``), through
vlens on the real engine: a difference-of-means direction added relative to
each token's norm flips held-out stories' sentiment and keeps them whole, and
vLLM's steered and unsteered greedy continuations equal transformers'."""

from __future__ import annotations

import pytest

import vlens
from vlens.models import RECIPE, world

pytestmark = pytest.mark.engine

LAYER, SCALE, N = RECIPE["layer"], RECIPE["scale"], 100  # N prompts per direction


def test_relative_steering_flips_sentiment_through_vlens(toy_session):
    happy, sad = world.sentiment_prompts()
    d = toy_session.direction(happy, sad, layer=LAYER, span="last")
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


def test_vllm_greedy_equals_transformers_steered_and_not(toy_session):
    """scripts/eval_toyworld.py's check, on a few evaluation prompts."""
    import importlib.util
    import sys
    from pathlib import Path

    from vlens.models import toyworld_path

    path = Path(__file__).resolve().parent.parent / "scripts" / "eval_toyworld.py"
    spec = importlib.util.spec_from_file_location("eval_toyworld", path)
    ev = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ev
    spec.loader.exec_module(ev)
    model, tok = ev.load(toyworld_path())
    prompts = world.steering_prompts(world.SAD, 4) + world.steering_prompts(world.HAPPY, 4)
    prompts += [p.prompt for p in world.probe_prompts("animal", 4)]
    res = ev.vllm_parity(model, tok, toy_session, prompts, LAYER, SCALE)
    n = len(prompts)
    assert (res["unsteered"], res["towards_happy"], res["towards_sad"]) == (n, n, n), res
