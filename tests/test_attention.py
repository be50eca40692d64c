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

import functools
import os
import subprocess
import sys
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


@functools.cache
def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_reference(path: Path, token_ids: list[int],
                 add_z: tuple[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face eager values on ``token_ids``: q, k, v, z as ``[layers,
    T, heads, head_dim]`` and attentions ``[layers, heads, T, T]``.
    ``add_z = (layer, vector)`` adds ``vector`` to that layer's output
    projection input (z) on every token, as a Steer at z does."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = _hf_model(path)
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

        def z_hook(mod, args, at=len(handles) // 2):
            x = args[0]
            if add_z is not None and add_z[0] == at:
                x = x + add_z[1]
            got["z"].append(_heads(x, cfg.num_attention_heads if not gpt2 else cfg.n_head))
            return (x,)

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
    assert torch.equal(t.activations("k", layer=2, split_heads=True), t.activations("k")[2])
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


def test_a_steer_at_z_equals_hugging_face_adding_to_the_o_proj_input(arch_session,
                                                                      attn_models):
    """z is writable: a Steer there (a vector of heads * head_dim) lands on
    the output projection's input, and everything after it follows."""
    arch, s = arch_session
    width = s.info["n_heads"] * s.info["head_dim"]
    vector = torch.randn(width, generator=torch.Generator().manual_seed(3))
    steer = vlens.Steer(vector, layer=1, site="z", scale=0.5)
    t = s.trace(_prompt(arch), sites=SITES, max_new_tokens=NEW, steer=steer)[0]
    assert t.steered_rows == len(t.token_ids)
    ref = hf_reference(attn_models[arch], t.token_ids, add_z=(1, 0.5 * vector))
    worst = _worst(t, ref)
    assert max(worst.values()) <= TOL, worst
    clean = hf_reference(attn_models[arch], t.token_ids)
    # the steer changed layer 2's pattern (through the residual), not layer 1's
    assert float((clean["attn_pattern"][2] - ref["attn_pattern"][2]).abs().max()) > 1e-3
    assert torch.equal(clean["attn_pattern"][1], ref["attn_pattern"][1])
    # a direction at z comes flat, ready for a Steer there
    d = s.direction([_prompt(arch)], ["w1 w2 , ."], layer=1, site="z")
    assert d.shape == (width,)
    assert s.trace(_prompt(arch), steer=vlens.Steer(d, layer=1, site="z"),
                   max_new_tokens=2)[0].steered_rows > 0
    frame = s.trace(_prompt(arch), sites=["z", "attn_pattern"], layers=[0],
                    max_new_tokens=2).to_frame()
    assert set(frame["site"]) == {"z"} and len(frame) == len(t.token_ids) - NEW + 2
    with pytest.raises(VlensError, match="heads \\* head_dim"):
        vlens_steer = vlens.Steer(torch.ones(width + 1), layer=0, site="z")
        s.trace(_prompt(arch), steer=vlens_steer)


# n > 1 needs sampling in vLLM; top_k=1 keeps every sample on the argmax
TWO_GREEDY = dict(n=2, temperature=1.0, top_k=1)


@pytest.fixture(scope="module")
def crowded_session(attn_models):
    """A KV cache of three 128-token blocks for six 140-token requests:
    vLLM preempts requests as they grow and recomputes them from the start."""
    s = vlens.Session(attn_models["llama"], reuse=False, max_num_batched_tokens=CHUNK,
                      max_model_len=256, num_gpu_blocks_override=3,
                      kv_cache_memory_bytes=64 * 2**20)
    yield s
    s.close()


def test_patterns_survive_preemption_and_samples(crowded_session, attn_models):
    s = crowded_session
    prompts = [" ".join(f"w{(i * 13 + j * 5) % 240}" for j in range(100)) for i in range(3)]
    run = s.trace(prompts, sites=["attn_pattern", "k"], layers=[0, 2], max_new_tokens=40,
                  logprobs=False, **TWO_GREEDY)
    assert len(run) == 6
    assert any(t.restarts > 0 for t in run), [t.restarts for t in run]
    for t in run:
        n = len(t.token_ids)
        assert n == 101 + 40 - 1
        ref = hf_reference(attn_models["llama"], t.token_ids)
        for site in ("attn_pattern", "k"):
            got = t.activations(site)
            diff = float((got - ref[site][[0, 2]]).abs().max())
            assert diff <= TOL, (site, t.index, t.sample, t.restarts, diff)


def test_the_transformers_backend_reads_and_steers_heads_as_native(llama_tf_session,
                                                                    llama_session):
    """The same Llama weights through vLLM's Transformers backend give the
    native route's head sites, and a Steer at z lands the same way
    (tests/test_tf_heads.py: GPT-NeoX, OLMo2, preemption, ablation, patching)."""
    assert llama_tf_session.info["impl"] == "transformers"
    assert set(SITES) <= set(llama_tf_session.sites)
    width = llama_session.info["n_heads"] * llama_session.info["head_dim"]
    steer = vlens.Steer(torch.linspace(-1, 1, width), layer=1, site="z", scale=0.5)
    prompts = ["w1 w2 w3", PROMPT]
    for kw in ({}, {"steer": steer}):
        native, tf = (s.trace(prompts, sites=SITES, max_new_tokens=4, **kw)
                      for s in (llama_session, llama_tf_session))
        for a, b in zip(native, tf):
            assert a.token_ids == b.token_ids and a.steered_rows == b.steered_rows
            for site in SITES:
                diff = float((a.activations(site) - b.activations(site)).abs().max())
                assert diff <= TOL, (kw, site, diff)
    assert native[1].steered_rows > 0


_TP2_SCRIPT = r"""
import os, sys, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # ships the edit function below
import vlens
from tp2_edit import same  # importable by the worker processes too

def main():
    model, prompt, out = sys.argv[1], sys.argv[2], sys.argv[3]
    s = vlens.Session(model, tensor_parallel_size=2, max_num_batched_tokens=32,
                      max_model_len=256, kv_cache_memory_bytes=64 * 2**20)
    sites = ["q", "k", "v", "z", "attn_pattern"]
    vec = torch.linspace(-1, 1, s.info["n_heads"] * s.info["head_dim"])
    plain = s.trace(prompt, sites=sites, max_new_tokens=6)[0]
    steered = s.trace(prompt, sites=sites, max_new_tokens=6,
                      steer=vlens.Steer(vec, layer=1, site="z", scale=0.5))[0]
    some = s.trace(prompt, sites=["attn_pattern"], max_new_tokens=3, heads=[3, 0])[0]
    try:
        s.trace(prompt, sites=["z"], edit=same, edit_at=[("z", 0)])
        edit_error = ""
    except Exception as exc:
        edit_error = str(exc)
    torch.save({
        "plain": {k: plain.activations(k) for k in sites} | {"ids": plain.token_ids},
        "steered": {k: steered.activations(k) for k in sites} | {"ids": steered.token_ids},
        "some": some.activations("attn_pattern"), "some_ids": some.token_ids,
        "vec": vec, "info": s.info, "edit_error": edit_error,
    }, out)
    s.close()

if __name__ == "__main__":
    main()
"""


def test_tensor_parallel_heads_are_gathered_not_one_ranks_shard(attn_models, tmp_path):
    """TP=2 on the grouped-query Qwen2 (each rank: 2 query heads, 1 key
    head): every head site equals Hugging Face, z steers on both ranks."""
    script = tmp_path / "tp2_heads.py"
    script.write_text(_TP2_SCRIPT)
    (tmp_path / "tp2_edit.py").write_text("def same(rows, ctx):\n    return rows\n")
    out = tmp_path / "tp2.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VLENS_TEST"))}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                         str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), str(attn_models["qwen2"]), PUNCT,
                           str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    assert (got["info"]["n_heads"], got["info"]["n_kv_heads"]) == (4, 2)
    path = attn_models["qwen2"]
    for name, add in (("plain", None), ("steered", (1, 0.5 * got["vec"]))):
        ref = hf_reference(path, got[name]["ids"], add_z=add)
        worst = {s: float((got[name][s] - ref[s]).abs().max()) for s in SITES}
        assert max(worst.values()) <= TOL, (name, worst)
    ref = hf_reference(path, got["some_ids"])
    assert float((got["some"] - ref["attn_pattern"][:, [3, 0]]).abs().max()) <= TOL
    assert "one tensor-parallel rank's heads" in got["edit_error"]
