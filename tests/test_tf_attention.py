"""The head tap on vLLM's Transformers backend, with plain tensors (no
engine): the wrapper around the registered attention function hands the tap
q, k, v as ``[T, heads * head_dim]``, vLLM's function gets the same values
in Hugging Face's layout, a change to z lands, modules without a tap pass
straight through, and a backend that stopped dispatching through the
registry is refused with the reason."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from vlens.protocol.head_tap import TAP, HeadTap, attach_taps
from vlens.worker.tf_attention import VLLM_NAME, route_heads, tapped

T, HEADS, KV, D = 5, 4, 2, 8


def _inputs():
    gen = torch.Generator().manual_seed(0)
    # Hugging Face's layout: [1, heads, T, d], made the way its modules make it
    q = torch.randn(1, T, HEADS, D, generator=gen).transpose(1, 2)
    k = torch.randn(1, T, KV, D, generator=gen).transpose(1, 2)
    v = torch.randn(1, T, KV, D, generator=gen).transpose(1, 2)
    return q, k, v


def _vllm_like(seen: list):
    """What vLLM's function does with its inputs: flatten, attend, [T, heads * d]."""

    def inner(module, query, key, value, attention_mask, **kwargs):
        seen.append((query, key, value, kwargs))
        flat = [x.transpose(1, 2).reshape(query.shape[-2], -1) for x in (query, key, value)]
        return flat[0] * 2.0, None  # a stand-in for attention: z = 2 q

    return inner


def test_the_tap_sees_flat_heads_and_a_change_to_z_lands():
    q, k, v = _inputs()
    seen: list = []
    fn = tapped(_vllm_like(seen))
    module = nn.Module()
    module.add_module(TAP, HeadTap())
    got = {}
    tap = getattr(module, TAP)
    tap.register_forward_pre_hook(lambda m, args: got.update(q=args[0], k=args[1], v=args[2]))

    def add_one(m, args, out):
        out.add_(1.0)  # an in-place write at z, as vlens's sets and adds do

    tap.register_forward_hook(add_one)
    z, weights = fn(module, q, k, v, None, scaling=0.5)
    assert weights is None
    assert got["q"].shape == (T, HEADS * D) and got["k"].shape == (T, KV * D)
    assert torch.equal(got["q"], q.transpose(1, 2).reshape(T, -1))  # token rows first
    assert torch.equal(got["v"], v.transpose(1, 2).reshape(T, -1))
    # vLLM's function got the same values in Hugging Face's layout and kwargs
    query, key, value, kwargs = seen[0]
    assert query.shape == q.shape and torch.equal(query, q) and torch.equal(value, v)
    assert kwargs == {"scaling": 0.5}
    assert z.shape == (T, HEADS * D)
    assert torch.equal(z, q.transpose(1, 2).reshape(T, -1) * 2.0 + 1.0)


def test_modules_without_a_tap_go_straight_to_vllms_function():
    q, k, v = _inputs()
    seen: list = []
    inner = _vllm_like(seen)
    out, _ = tapped(inner)(nn.Module(), q, k, v, None)
    assert len(seen) == 1 and seen[0][0] is q  # untouched, not even reshaped
    assert torch.equal(out, inner(nn.Module(), q, k, v, None)[0])


def test_taps_go_beside_each_attention_layer_once():
    class Attn(nn.Module):  # a Hugging Face attention module holding vLLM's layer
        def __init__(self):
            super().__init__()
            self.attn = nn.Identity()

    layers = [nn.ModuleDict({"self_attn": Attn()}) for _ in range(2)]
    found = [layer["self_attn"].attn for layer in layers]
    taps = attach_taps(layers, found)
    assert [getattr(layer["self_attn"], TAP) for layer in layers] == list(taps)
    assert attach_taps(layers, found) == taps  # resolved again: the same taps
    assert not any(p.numel() for t in taps for p in t.parameters())


def test_a_backend_that_left_the_registry_is_refused_with_the_reason():
    attn = nn.Module()
    attn.config = SimpleNamespace(_attn_implementation="sdpa")
    attn.add_module(TAP, HeadTap())
    layer = nn.ModuleDict({"self_attn": attn})
    sites = SimpleNamespace(layers=[layer], specs=dict.fromkeys(["q", "k", "z", "resid_pre"]))
    refused = route_heads(sites)
    assert set(refused) == {"q", "k", "z"}
    why = refused["q"]
    assert f"registry entry {VLLM_NAME!r}" in why and "['sdpa']" in why
    assert "open a model vLLM runs natively" in why
