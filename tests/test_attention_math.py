"""The attention-pattern arithmetic and the per-request key store, with
plain tensors (no engine): what tests/test_attention.py checks end to end
against Hugging Face, here case by case against a direct loop."""

from __future__ import annotations

import math

import pytest
import torch

from vlens.worker.attention import AttentionShape, attention_probs
from vlens.protocol.plan import Plan, Read
from vlens.worker.records import RequestRecord


def _loop(q, keys, first, shape, heads):
    """One score at a time, as the definition reads."""
    n = q.shape[0]
    qh = q.reshape(n, shape.heads, shape.head_dim)
    out = torch.zeros(n, len(heads), keys.shape[0])
    group = shape.heads // shape.kv_heads
    for i in range(n):
        pos = first + i
        for hi, h in enumerate(heads):
            scores = []
            for j in range(keys.shape[0]):
                visible = j <= pos and (shape.window is None or j > pos - shape.window)
                s = float(qh[i, h] @ keys[j, h // group]) * shape.scale
                if shape.softcap:
                    s = shape.softcap * math.tanh(s / shape.softcap)
                scores.append(s if visible else -math.inf)
            out[i, hi] = torch.tensor(scores).softmax(-1)
    return out


@pytest.mark.parametrize("softcap,window,heads", [
    (0.0, None, None), (2.0, None, [3, 0]), (0.0, 4, None), (1.5, 3, [1, 2]),
])
def test_probabilities_equal_the_definition(softcap, window, heads):
    g = torch.Generator().manual_seed(0)
    shape = AttentionShape(heads=4, kv_heads=2, head_dim=8, scale=8 ** -0.5,
                           softcap=softcap, window=window)
    first, n = 5, 3  # a later prefill chunk: rows at positions 5, 6, 7
    q = torch.randn(n, 4 * 8, generator=g) * 3
    keys = torch.randn(first + n, 2, 8, generator=g)
    got = attention_probs(q, keys, first, shape, heads)
    want = _loop(q, keys, first, shape, heads or [0, 1, 2, 3])
    assert got.shape == (n, len(heads or range(4)), first + n)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.ones(got.shape[:2]))


def test_the_key_store_follows_a_request_through_a_restart():
    rec = RequestRecord(Plan("t", reads=(Read("attn_pattern", (0,)),)), "r0")
    k = torch.arange(10.0).reshape(10, 1, 1)
    rec.begin_step(0, 6)
    assert torch.equal(rec.add_keys(0, 0, k[:6]), k[:6])
    rec.begin_step(6, 4)
    assert torch.equal(rec.add_keys(0, 6, k[6:]), k)
    # preempted and recomputed from position 3: keys after it are dropped
    rec.begin_step(3, 2)
    assert rec.restarts == 1
    assert torch.equal(rec.add_keys(0, 3, k[3:5] + 100), torch.cat([k[:3], k[3:5] + 100]))
    with pytest.raises(ValueError, match="never reached the hooks"):
        rec.add_keys(0, 9, k[9:])  # a gap: positions 5 to 8 were never seen
