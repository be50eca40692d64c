"""Invariant 4: vlens's canonical values equal Hugging Face transformers'
for the same weights and prompt (float32)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from _hf_forks import run_code

pytestmark = pytest.mark.engine

PROMPT = "w3 w14 w15 w92 w65 w35 w89 w79 w32 w38 , w46 w26 ."


_HF_SCRIPT = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

path, ids, out_file = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
layers = model.model.layers
got = {"attn_out": [], "mlp_out": [], "last_pre_norm": []}
for layer in layers:
    layer.self_attn.register_forward_hook(lambda m, a, out: got["attn_out"].append(out[0][0]))
    layer.mlp.register_forward_hook(lambda m, a, out: got["mlp_out"].append(out[0]))
layers[-1].register_forward_hook(
    lambda m, a, out: got["last_pre_norm"].append((out[0] if isinstance(out, tuple) else out)[0])
)
with torch.no_grad():
    out = model(torch.tensor([ids]), output_hidden_states=True)
hs = [h[0] for h in out.hidden_states]  # L + 1 entries, the last after the final norm
torch.save(
    {
        "resid_pre": torch.stack(hs[:-1]),
        "resid_post": torch.stack(hs[1:-1] + got["last_pre_norm"]),
        "attn_out": torch.stack(got["attn_out"]),
        "mlp_out": torch.stack(got["mlp_out"]),
    },
    out_file,
)
"""


def _hf_values(path, prompt_ids, tmp_path):
    """Hugging Face's values, computed in a fresh process: an in-process
    Transformers-backend engine patches HF's model classes (see conftest).

    Kept per run under the bytes of the weights, config and prompt
    (VLENS_HF_REFERENCE_DIR, which conftest sets and test_scale_out.py's
    child runs inherit): the native and Transformers-backend engines of the
    same weights, and every engine mode, are compared with one HF run."""
    key = hashlib.sha256(json.dumps(prompt_ids).encode())
    for name in ("config.json", "model.safetensors"):
        key.update((Path(path) / name).read_bytes())
    cached = Path(os.environ["VLENS_HF_REFERENCE_DIR"]) / f"{key.hexdigest()}.pt"
    if not cached.exists():
        out_file = tmp_path / "hf.pt"
        proc = run_code(_HF_SCRIPT, path, json.dumps(prompt_ids), out_file)
        assert proc.returncode == 0, proc.stderr[-3000:]
        os.replace(out_file, cached)
    return torch.load(cached)


@pytest.mark.parametrize(
    "session_name,model_name",
    [
        ("llama_session", "tiny_llama"),
        ("qwen2_session", "tiny_qwen2"),
        ("llama_tf_session", "tiny_llama"),
    ],
)
def test_sites_match_transformers(request, session_name, model_name, tmp_path):
    session = request.getfixturevalue(session_name)
    path = request.getfixturevalue(model_name)
    trace = session.trace(
        PROMPT, sites=["resid_pre", "resid_post", "attn_out", "mlp_out"], max_new_tokens=1
    )[0]
    n_prompt = len(trace.prompt_token_ids)
    assert trace.n_tokens == n_prompt  # one generated token is never fed back
    ref = _hf_values(path, trace.prompt_token_ids, tmp_path)
    for site, expected in ref.items():
        got = trace.activations(site)
        assert got.shape == expected.shape, site
        diff = (got - expected).abs().max().item()
        assert diff <= 1e-4, f"{site} differs from transformers by {diff}"
    # and the layers differ from each other, so the comparison means something
    rp = trace.activations("resid_post")
    assert (rp[0] - rp[-1]).abs().max() > 1e-2
