"""Head sites on vLLM's Transformers backend (GPT-NeoX as in Pythia, OLMo2,
and Llama through ``model_impl="transformers"``).

vLLM runs GPT-NeoX and OLMo2 only through its Transformers backend, where
vlens reaches q, k, v (after rotary) and z through the attention function
vLLM registers in transformers' registry (``vlens/worker/tf_attention.py``).
For each, a tiny random model is made here (query/key scales raised so the
attention patterns are far from uniform; GPT-NeoX with parallel residual
and a rotary over a quarter of each head, as Pythia), opened with prefill
chunks smaller than the prompt and a KV cache of three 128-token blocks, so
long requests are preempted and recomputed (GPT-NeoX also in vLLM's
compiled mode, where the tap's hooks are vlens's operators in the graph).
What vlens gives must equal
Hugging Face eager attention on the same tokens (``tests/_hf_heads.py``, in
a fresh process): the head sites, a head ablation and per-head patching.

Llama through the Transformers backend must give what the native route
gives (``llama_session``, the same weights) under the same load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vlens
from _hf_forks import run_script

pytestmark = [pytest.mark.engine, pytest.mark.tf_backend]

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
HEADS = ["q", "k", "v", "z", "attn_pattern"]
PROMPT = " ".join(f"w{(7 * i) % 240}" for i in range(40))  # 41 tokens with BOS
NEW = 6
CHUNK = 32  # max_num_batched_tokens: the prompt takes two prefill steps
LONG = [" ".join(f"w{(i * 13 + j * 5) % 240}" for j in range(100)) for i in range(3)]
TWO_GREEDY = dict(n=2, temperature=1.0, top_k=1)  # n > 1 needs sampling in vLLM
WORDS = [f"w{(5 + 13 * i) % 240}" for i in range(39)]
CLEAN = " ".join(WORDS)
CORRUPT = " ".join(WORDS[:20] + ["w239"] + WORDS[21:])  # one word swapped, at position 21
ABLATE = dict(site="z", layer=1, heads=[1])  # head 1's dims of layer 1's z


def _sharpen(path: Path) -> None:
    """Raise the query/key scales (random init gives near-uniform patterns).
    OLMo2 is left as it is: its q/k norms undo a projection's scale, and its
    widened norm weights already give patterns far from uniform."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    weights = load_file(file)
    heads = json.loads((path / "config.json").read_text())["num_attention_heads"]
    for name, w in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w.mul_(6.0)
        elif name.endswith("query_key_value.weight"):  # GPT-NeoX: [heads, (q, k, v), d] rows
            w.view(heads, 3, -1, w.shape[-1])[:, :2].mul_(4.0)
    save_file(weights, file, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def tf_models(models_dir) -> dict[str, Path]:
    from vlens.tiny import make_tiny_model

    out = {}
    for arch in ("gpt_neox", "olmo2"):
        path = models_dir / f"tf-heads-{arch}"
        fresh = not (path / "config.json").exists()
        make_tiny_model(path, arch, hidden=64, heads=2, layers=3, seed=7)
        if fresh:
            _sharpen(path)
        out[arch] = path
    return out


def _crowded(path, **kw):
    """Prefill chunks of 32 tokens, a KV cache of three 128-token blocks."""
    return vlens.Session(path, reuse=False, max_num_batched_tokens=CHUNK, max_model_len=256,
                         num_gpu_blocks_override=3, kv_cache_memory_bytes=64 << 20, **kw)


def _hf(path: Path, ids: list[list[int]], jobs: list[dict], tmp: Path) -> dict:
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"path": str(path), "ids": ids, "jobs": jobs}))
    proc = run_script(ROOT / "tests" / "_hf_heads.py", spec, tmp / "ref.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / "ref.pt")


def _ablate_job(t, ab: vlens.Ablate, head_dim: int) -> dict:
    return {"kind": "ablate", "ids": t.token_ids, "site": ab.site, "layer": ab.layer,
            "span": [0, None],
            "dims": [ab.heads[0] * head_dim, (ab.heads[-1] + 1) * head_dim],
            "value": "zero", "mean_over": []}


def _exercise(s) -> dict:
    """What every route is checked on: the head sites of one chunked
    request, the same under preemption (three long prompts, two samples
    each), a head ablation under preemption, and per-head patching."""
    one = s.trace(PROMPT, sites=HEADS, max_new_tokens=NEW)[0]
    crowded = s.trace(LONG, sites=["attn_pattern", "q", "k", "z", "resid_post"], layers=[0, 2],
                      max_new_tokens=40, logprobs=False, **TWO_GREEDY)
    ab = vlens.Ablate(**ABLATE)
    ablated = s.trace(LONG, layers=None, sites=["resid_post"], max_new_tokens=40, ablate=ab,
                      **TWO_GREEDY)
    # the clean run's next token against the swapped-in word (random weights
    # may predict the same top token for both prompts)
    top = s.trace(CLEAN, max_new_tokens=1)[0].output_token_ids[0]
    other = next(w for w in ("w239", "w6") if s.tokenize(w)[-1] != top)
    patched = s.patch(CLEAN, CORRUPT, site="z", heads="all", span=list(range(19, 40)),
                      answer=(top, other))
    return {"one": one, "crowded": crowded, "ablate": ab, "ablated": ablated,
            "patched": patched}


def _check_shapes(s, got: dict, sharp: bool = True) -> None:
    t = got["one"]
    n = len(t.token_ids)
    assert n == len(t.prompt_token_ids) + NEW - 1
    assert t.step_rows[0] <= CHUNK < len(t.prompt_token_ids)  # chunked prefill
    layers, heads, kv, hd = (s.info["n_layers"], s.info["n_heads"], s.info["n_kv_heads"],
                             s.info["head_dim"])
    assert t.activations("q").shape == t.activations("z").shape == (layers, n, heads, hd)
    assert t.activations("k").shape == t.activations("v").shape == (layers, n, kv, hd)
    pattern = t.activations("attn_pattern")
    assert pattern.shape == (layers, heads, n, n)
    assert torch.allclose(pattern.sum(-1), torch.ones(layers, heads, n), atol=1e-5)
    assert not pattern.triu(1).any()
    if sharp:  # the models made here; conftest's tiny Llama is near uniform
        uniform = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
        assert float((pattern - uniform).abs().max()) > 0.2  # far from uniform
    assert any(x.restarts > 0 for x in got["crowded"]), "no request was preempted"
    assert any(x.restarts > 0 for x in got["ablated"]), "no ablated request was preempted"


def _one_process(arch: str, compiled: bool):
    """A fixture parameter whose tests share one xdist group: under two
    test processes its engine (a module fixture) is built in one of them."""
    return pytest.param((arch, compiled), marks=pytest.mark.xdist_group(
        f"tf-heads-{arch}{'-compiled' if compiled else ''}"))


@pytest.fixture(scope="module", params=[_one_process("gpt_neox", False),
                                        _one_process("olmo2", False),
                                        _one_process("gpt_neox", True)],
                ids=["gpt_neox-transformers", "olmo2-transformers",
                     "gpt_neox-transformers-compiled"])
def measured(request, tf_models, tmp_path_factory):
    """One engine per family (and GPT-NeoX in vLLM's compiled mode too):
    what vlens gave, and Hugging Face's values."""
    arch, compiled = request.param
    path = tf_models[arch]
    s = _crowded(path, enforce_eager=not compiled)
    try:
        assert s.info["impl"] == "transformers" and s.info["compiled"] == compiled
        assert set(HEADS) <= set(s.sites)
        got = _exercise(s)
        info = dict(s.info)
        clean_ids, corrupt_ids = s.tokenize(CLEAN), s.tokenize(CORRUPT)
        _check_shapes(s, got)
    finally:
        s.close()
    p = got["patched"]
    jobs = [_ablate_job(t, got["ablate"], info["head_dim"]) for t in got["ablated"]]
    jobs.append({"kind": "patch", "clean": clean_ids, "corrupt": corrupt_ids, "site": "z",
                 "layers": p.layers, "positions": p.positions, "answer": list(p.answer),
                 "heads": True, "head_dim": info["head_dim"], "n_heads": info["n_heads"]})
    ids = [got["one"].token_ids] + [t.token_ids for t in got["crowded"]]
    ref = _hf(path, ids, jobs, tmp_path_factory.mktemp(f"hf-{arch}"))
    if compiled:
        arch += " (compiled)"
    return arch, got, ref


def test_head_sites_equal_hugging_face(measured):
    arch, got, ref = measured
    t, r = got["one"], ref["heads"][0]
    worst = {s: float((t.activations(s) - r[s]).abs().max()) for s in HEADS}
    print(f"{arch}: largest difference from Hugging Face per head site {worst}")
    assert max(worst.values()) <= TOL, worst


def test_head_sites_equal_hugging_face_under_preemption(measured):
    arch, got, ref = measured
    assert len(got["crowded"]) == 6
    for t, r in zip(got["crowded"], ref["heads"][1:]):
        assert len(t.token_ids) == 101 + 40 - 1
        for site in ("attn_pattern", "q", "k", "z"):
            diff = float((t.activations(site) - r[site][[0, 2]]).abs().max())
            assert diff <= TOL, (arch, site, t.index, t.sample, t.restarts, diff)


def test_head_ablation_equals_a_hugging_face_hook(measured):
    arch, got, ref = measured
    for t, r in zip(got["ablated"], ref["jobs"]):
        err = float((t.activations("resid_post") - r["resid_post"]).abs().max())
        assert err <= TOL, (arch, t.index, t.sample, t.restarts, err)
        assert abs(t.logprobs[-1] - float(r["logprobs"][t.output_token_ids[-1]])) <= 1e-4
    # the ablation changed the run: the last layer's prompt rows moved
    clean, ablated = got["crowded"][0], got["ablated"][0]
    moved = clean.activations("resid_post")[1][:101] - ablated.activations("resid_post")[2][:101]
    assert float(moved.abs().max()) > 1e-3


def test_per_head_patching_equals_hugging_face(measured):
    arch, got, ref = measured
    p, r = got["patched"], ref["jobs"][-1]
    assert p.grid.shape == (3, 2) and p.heads == [0, 1]
    assert (p.grid.double() - r["grid"]).abs().max() <= 1e-4, (p.grid, r["grid"])
    assert float(p.grid.abs().max()) > 1e-3  # patching a head moved the answer


@pytest.fixture(scope="module")
def llama_routes(tiny_llama, llama_session):
    """The same work on the Llama weights through the Transformers backend
    (crowded: chunked, preempting) and natively (``llama_session``)."""
    s = _crowded(tiny_llama, model_impl="transformers")
    try:
        assert s.info["impl"] == "transformers"
        tf = _exercise(s)
        _check_shapes(s, tf, sharp=False)
    finally:
        s.close()
    native = _exercise(llama_session)
    return tf, native


@pytest.mark.xdist_group("tf-heads-llama")  # llama_routes is built once
def test_llama_transformers_backend_equals_native_heads(llama_routes):
    tf, native = llama_routes
    assert tf["one"].token_ids == native["one"].token_ids
    worst = {s: float((tf["one"].activations(s) - native["one"].activations(s)).abs().max())
             for s in HEADS}
    assert max(worst.values()) <= TOL, worst
    for a, b in zip(tf["crowded"], native["crowded"]):
        assert a.token_ids == b.token_ids
        for site in ("attn_pattern", "q", "k", "z"):
            diff = float((a.activations(site) - b.activations(site)).abs().max())
            assert diff <= TOL, (site, a.index, a.sample, a.restarts, diff)


@pytest.mark.xdist_group("tf-heads-llama")
def test_llama_transformers_backend_ablates_and_patches_heads_as_native(llama_routes):
    tf, native = llama_routes
    for a, b in zip(tf["ablated"], native["ablated"]):
        assert a.token_ids == b.token_ids
        err = float((a.activations("resid_post") - b.activations("resid_post")).abs().max())
        assert err <= TOL, (a.index, a.sample, a.restarts, err)
    assert (tf["patched"].grid - native["patched"].grid).abs().max() <= 1e-4
    assert float(native["patched"].grid.abs().max()) > 1e-3


def test_hugging_face_models_still_build_beside_the_transformers_backend(llama_tf_session,
                                                                          tmp_path):
    """vLLM's Transformers backend decorates Hugging Face's LlamaModel in this
    process; ``make_tiny_model`` (and anything under ``hf_buildable``) must
    still build the same model, and it must run as Hugging Face's own."""
    import transformers
    from safetensors.torch import load_file

    from vlens.tiny import hf_buildable, make_tiny_model

    assert llama_tf_session.info["impl"] == "transformers"
    made = make_tiny_model(tmp_path / "here", "llama", hidden=64, heads=2, layers=2, seed=3)
    with pytest.raises(AssertionError, match="vLLM config is not set"):
        transformers.AutoModelForCausalLM.from_pretrained(made)  # the decorated class
    code = ("import sys; from vlens.tiny import make_tiny_model; "
            "make_tiny_model(sys.argv[1], 'llama', hidden=64, heads=2, layers=2, seed=3)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "fresh")], check=True,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    ours, fresh = (load_file(p / "model.safetensors") for p in (made, tmp_path / "fresh"))
    assert ours.keys() == fresh.keys()
    assert all(torch.equal(ours[k], fresh[k]) for k in ours)
    with hf_buildable():
        model = transformers.AutoModelForCausalLM.from_pretrained(made)
    ids = torch.tensor([[1, 5, 9, 12]])
    code = ("import sys, torch, transformers; "
            "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
            "torch.save(m(torch.tensor([[1, 5, 9, 12]])).logits, sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, str(made), str(tmp_path / "ref.pt")], check=True)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, torch.load(tmp_path / "ref.pt"))
