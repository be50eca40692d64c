"""The head sites (q, k, v, z) and attention patterns against Hugging Face.

For Llama, Qwen2 (grouped-query: 4 query heads on 2 key heads), Gemma2
(logit softcapping, a sliding window shorter than the prompt) and GPT-2 a
tiny random model is made here, its query and key weights scaled up so the
attention patterns are far from uniform (and Gemma2's softcap bites), and
opened with a prefill budget smaller than the prompt: every prompt is
split across engine steps, then decoded. What vlens reads must equal Hugging
Face eager attention (``output_attentions=True``) on the same tokens:

* ``q``, ``k``, ``v`` -- the attention module's projections, after rotary
  embedding, computed from Hugging Face's own modules;
* ``z`` -- the input of the output projection;
* ``attn_pattern`` -- ``outputs.attentions``.

A loaded engine (a KV cache so small vLLM preempts and recomputes
requests, n=2 samples) must give the same patterns. Hugging Face models are
built in this process before any Transformers-backend engine exists
(conftest runs those last).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vlens
from vlens.errors import VlensError

pytestmark = pytest.mark.engine

TOL = 1e-5
SITES = ["q", "k", "v", "z", "attn_pattern"]
WINDOW = 12  # Gemma2's sliding window, shorter than the prompt
PROMPT = " ".join(f"w{(7 * i) % 240}" for i in range(40))  # 41 tokens with BOS
# transformers 5 tokenizes the tiny Qwen2 with its own BPE rules, which keep
# only "." and "," of the tiny vocabulary (see tests/test_models.py)
PUNCT = " ".join(".,"[i * i % 3 % 2] for i in range(40))
NEW = 6
CHUNK = 32  # max_num_batched_tokens: the prompt takes two prefill steps

# arch -> make_tiny_model arguments (head_dim 32: sizes vLLM's CPU attention runs)
ARCHS = {
    "llama": dict(hidden=64, heads=2),
    "qwen2": dict(hidden=128, heads=4, kv_heads=2),
    "gemma2": dict(hidden=64, heads=2),
    "gpt2": dict(hidden=64, heads=2),
}


def _sharpen(path: Path, arch: str) -> None:
    """Scale the query and key weights (random init gives near-uniform
    patterns); give Gemma2 a short window and a softcap the scores reach."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6.0)
            elif name.endswith("c_attn.weight"):  # GPT-2: [hidden, 3 * hidden]
                p[:, : 2 * p.shape[0]].mul_(6.0)
    if arch == "gemma2":
        model.config.sliding_window = WINDOW
        model.config.attn_logit_softcapping = 2.0
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="session")
def attn_models(models_dir) -> dict[str, Path]:
    from vlens.tiny import make_tiny_model

    out = {}
    for arch, kw in ARCHS.items():
        path = models_dir / f"attn-{arch}"
        fresh = not (path / "config.json").exists()
        make_tiny_model(path, arch, layers=3, seed=5, **kw)
        if fresh:
            _sharpen(path, arch)
        out[arch] = path
    return out


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[1, T, n * d] -> [T, n, d]."""
    return x[0].reshape(x.shape[1], n, -1)


def hf_reference(path: Path, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Hugging Face eager values on ``token_ids``: q, k, v, z as ``[layers,
    T, heads, head_dim]`` and attentions ``[layers, heads, T, T]``."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    got: dict[str, list] = {s: [] for s in ("q", "k", "v", "z")}
    handles = []
    gpt2 = cfg.model_type == "gpt2"
    layers = model.transformer.h if gpt2 else model.model.layers
    for layer in layers:
        attn = layer.attn if gpt2 else layer.self_attn

        def before(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if gpt2:
                q, k, v = mod.c_attn(x).split(mod.split_size, dim=2)
                n = kv = mod.num_heads
            else:
                n, kv = cfg.num_attention_heads, cfg.num_key_value_heads
                q, k, v = mod.q_proj(x), mod.k_proj(x), mod.v_proj(x)
                cos, sin = kwargs["position_embeddings"]
                t = x.shape[1]
                qh = q.view(1, t, n, -1).transpose(1, 2)
                kh = k.view(1, t, kv, -1).transpose(1, 2)
                qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
                q, k = qh.transpose(1, 2).reshape(1, t, -1), kh.transpose(1, 2).reshape(1, t, -1)
            got["q"].append(_heads(q, n))
            got["k"].append(_heads(k, kv))
            got["v"].append(_heads(v, kv))

        def z_hook(mod, args):
            got["z"].append(_heads(args[0], cfg.num_attention_heads if not gpt2 else cfg.n_head))

        handles.append(attn.register_forward_pre_hook(before, with_kwargs=True))
        out_proj = attn.c_proj if gpt2 else attn.o_proj
        handles.append(out_proj.register_forward_pre_hook(z_hook))
    try:
        with torch.no_grad():
            res = model(torch.tensor([token_ids]), output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    ref = {s: torch.stack(v) for s, v in got.items()}
    ref["attn_pattern"] = torch.stack([a[0] for a in res.attentions])
    return ref


def _prompt(arch: str) -> str:
    return PUNCT if arch == "qwen2" else PROMPT


def _worst(trace, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {s: float((trace.activations(s) - ref[s]).abs().max()) for s in SITES}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_session(request, attn_models):
    arch = request.param
    s = vlens.Session(attn_models[arch], reuse=False, max_num_batched_tokens=CHUNK,
                      max_model_len=256, kv_cache_memory_bytes=64 * 2**20)
    yield arch, s
    s.close()


def test_head_sites_and_patterns_equal_hugging_face(arch_session, attn_models):
    arch, s = arch_session
    t = s.trace(_prompt(arch), sites=SITES, max_new_tokens=NEW)[0]
    n = len(t.token_ids)
    assert n == len(t.prompt_token_ids) + NEW - 1 > CHUNK
    assert t.step_rows[0] <= CHUNK < len(t.prompt_token_ids)  # chunked prefill
    assert t.step_rows[-NEW + 1:] == [1] * (NEW - 1)  # then decode steps
    info = s.info
    heads, kv, hd = info["n_heads"], info["n_kv_heads"], info["head_dim"]
    assert t.activations("q").shape == (3, n, heads, hd)
    assert t.activations("k").shape == t.activations("v").shape == (3, n, kv, hd)
    assert t.activations("z").shape == (3, n, heads, hd)
    pattern = t.activations("attn_pattern")
    assert pattern.shape == (3, heads, n, n) and pattern.dtype == torch.float32
    assert torch.allclose(pattern.sum(-1), torch.ones(3, heads, n), atol=1e-5)
    assert not pattern.triu(1).any()  # causal: nothing above the diagonal
    ref = hf_reference(attn_models[arch], t.token_ids)
    worst = _worst(t, ref)
    print(f"{arch}: largest difference from Hugging Face per site {worst}")
    assert max(worst.values()) <= TOL, worst
    # the patterns are far from uniform, so equality means something
    uniform = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
    assert float((pattern - uniform).abs().max()) > 0.2
    assert torch.equal(t.attention(1), pattern[1])
    assert torch.equal(t.heads("k", 2), t.activations("k")[2])
    if arch == "gemma2":
        # layer 0 slides (Gemma2 alternates): keys older than the window get nothing
        rows = torch.arange(n)[:, None]
        cols = torch.arange(n)[None, :]
        assert not pattern[0][:, cols.expand(n, n) <= rows - WINDOW].any()
        assert pattern[1][:, cols.expand(n, n) <= rows - WINDOW].any()  # layer 1 does not
    if arch == "qwen2":
        assert kv < heads  # grouped-query attention was exercised


def test_heads_selects_pattern_heads_and_budget_counts_them(arch_session):
    arch, s = arch_session
    PROMPT = _prompt(arch)  # noqa: N806
    h = s.info["n_heads"]
    full = s.trace(PROMPT, sites=["attn_pattern"], layers=[1], max_new_tokens=2)[0]
    some = s.trace(PROMPT, sites=["attn_pattern"], layers=[1], max_new_tokens=2,
                   heads=[h - 1, 0])[0]
    assert some.activations("attn_pattern").shape[1] == 2
    assert torch.equal(some.activations("attn_pattern")[0],
                       full.activations("attn_pattern")[0][[h - 1, 0]])
    n = len(full.token_ids)
    budget = s.read_budget
    try:
        s.read_budget = 3 * h * n * n * 4 - 1  # three layers, every head: over by a byte
        with pytest.raises(VlensError, match="heads= for attn_pattern"):
            s.trace(PROMPT, sites=["attn_pattern"], layers=[0, 1, 2], max_new_tokens=2)
        s.trace(PROMPT, sites=["attn_pattern"], layers=[0, 1, 2], max_new_tokens=2,
                heads=list(range(h - 1)))  # one head fewer fits
    finally:
        s.read_budget = budget
    for bad, match in (([h], f"head {h} does not exist"), ([], "non-empty")):
        with pytest.raises(VlensError, match=match):
            s.trace(PROMPT, sites=["attn_pattern"], heads=bad)
    with pytest.raises(VlensError, match="add 'attn_pattern'"):
        s.trace(PROMPT, sites=["q"], heads=[0])
    with pytest.raises(VlensError, match="in full only"):
        s.trace(PROMPT, sites=["attn_pattern"], reduce="norm")
    # the engine still works after the refusals
    assert s.trace(PROMPT, sites=["q"], max_new_tokens=1)[0].activations("q").shape[2] == h
