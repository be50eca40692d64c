"""Session.patch on the real engine: equal to a Hugging Face patching loop
run cell by cell, a 4-layer x 40-position grid in one engine batch, per-head
patching of z, streaming, a loaded engine, and bad input refused."""

from __future__ import annotations

import math

import pytest
import torch

import vlens
from vlens.errors import VlensError

from test_ablation import hf_jobs

# one xdist group: patch_session (a module fixture) starts once, not in both test processes
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("patching")]

WORDS = [f"w{(5 + 13 * i) % 240}" for i in range(39)]
CLEAN = " ".join(WORDS)  # 40 tokens with BOS
CORRUPT = " ".join(WORDS[:20] + ["w239"] + WORDS[21:])  # one word swapped
SWAPPED = 21  # its position (after BOS)


@pytest.fixture(scope="module")
def tiny_llama4(models_dir):
    from vlens.tiny import make_tiny_model

    return make_tiny_model(models_dir / "llama4-patch", "llama", layers=4, seed=6)


@pytest.fixture(scope="module")
def patch_session(tiny_llama4, engine_options):
    # prefill chunks of 64 tokens: the 162-request batch spans many steps
    s = vlens.Session(tiny_llama4, reuse=False, max_num_batched_tokens=64, max_model_len=256,
                      **engine_options)
    yield s
    s.close()


@pytest.fixture(scope="module")
def grid(patch_session):
    s = patch_session
    before = s.engine.generate_calls
    p = s.patch(CLEAN, CORRUPT)
    calls = s.engine.generate_calls - before
    return p, calls


def _hf_patch(path, s, p, tmp_path, heads=False):
    job = {"kind": "patch", "clean": s.tokenize(CLEAN), "corrupt": s.tokenize(CORRUPT),
           "site": p.site, "layers": p.layers, "positions": p.positions,
           "answer": list(p.answer), "heads": heads, "head_dim": s.info["head_dim"],
           "n_heads": s.info["n_heads"]}
    return hf_jobs(path, [job], tmp_path)[0]


def test_a_4_layer_40_position_grid_is_one_engine_batch_and_equals_hugging_face(
        grid, patch_session, tiny_llama4, tmp_path):
    p, calls = grid
    assert len(patch_session.tokenize(CLEAN)) == 40
    assert p.grid.shape == (4, 40) and p.grid.dtype == torch.float32
    # one call reads clean and corrupt, ONE call runs all 160 cells
    assert calls == 2
    assert not p.grid.isnan().any()
    ref = _hf_patch(tiny_llama4, patch_session, p, tmp_path)
    assert abs(p.clean_diff - ref["clean_diff"]) <= 1e-4
    assert abs(p.corrupt_diff - ref["corrupt_diff"]) <= 1e-4
    err = (p.grid.double() - ref["grid"]).abs().max()
    assert err <= 1e-4, f"patching grid differs from the Hugging Face loop by {err}"
    # the shape of the answer: before the swapped word nothing changes; the
    # last layer restores everything only at the last position
    assert p.grid[:, :SWAPPED].abs().max() <= 1e-4
    assert abs(float(p.grid[-1, -1]) - 1.0) <= 1e-4
    assert float(p.grid[0, SWAPPED].abs()) > 0.05  # the swapped token itself matters


def test_patching_result_parts(grid, patch_session):
    p, _ = grid
    s = patch_session
    # answer=None: the clean and corrupt runs' own top next tokens
    clean_top = s.trace(CLEAN, sites=[], max_new_tokens=1)[0].output_token_ids[0]
    corrupt_top = s.trace(CORRUPT, sites=[], max_new_tokens=1)[0].output_token_ids[0]
    assert p.answer == (clean_top, corrupt_top)
    assert p.answer_text == tuple(s.token_strings(p.answer))
    assert p.layers == [0, 1, 2, 3] and p.positions == list(range(40)) and p.heads is None
    assert p.tokens == s.token_strings(s.tokenize(CLEAN))
    assert p.clean_diff > p.corrupt_diff
    toks, lps = p.cell_logprobs[3][39]
    assert lps == sorted(lps, reverse=True) and p.answer_text[0] in toks
    assert p.clean_logprobs[0][0] == p.answer_text[0]  # the clean run's top token
    assert p.corrupt_logprobs[0][0] == p.answer_text[1]
    frame = p.to_frame()
    assert len(frame) == 160 and list(frame.columns[:4]) == ["layer", "position", "head", "token"]
    assert frame.value.tolist() == pytest.approx(p.grid.flatten().tolist())
    fig = p.figure()
    assert fig.data[0].type == "heatmap" and len(fig.data[0].z) == 4


def test_patch_with_given_answers_layers_and_span(grid, patch_session):
    p, _ = grid
    s = patch_session
    sub = s.patch(CLEAN, CORRUPT, layers=[1, 3], span=[SWAPPED - 1, SWAPPED, -1],
                  answer=p.answer_text)
    assert sub.grid.shape == (2, 3) and sub.positions == [SWAPPED - 1, SWAPPED, 39]
    assert torch.allclose(sub.grid, p.grid[[1, 3]][:, [SWAPPED - 1, SWAPPED, 39]], atol=1e-5)
    swapped = s.patch(CLEAN, CORRUPT, layers=[1], span=[SWAPPED],
                      answer=(p.answer[1], p.answer[0]))
    # the other way round the metric is the same fraction
    assert float(swapped.grid[0, 0]) == pytest.approx(float(p.grid[1, SWAPPED]), abs=1e-4)


def test_per_head_patching_of_z_equals_hugging_face(patch_session, tiny_llama4, tmp_path):
    s = patch_session
    p = s.patch(CLEAN, CORRUPT, site="z", heads="all", span=list(range(SWAPPED - 2, 40)))
    assert p.grid.shape == (4, s.info["n_heads"]) and p.heads == [0, 1, 2, 3]
    ref = _hf_patch(tiny_llama4, s, p, tmp_path, heads=True)
    assert (p.grid.double() - ref["grid"]).abs().max() <= 1e-4
    frame = p.to_frame()
    assert frame["head"].tolist()[:4] == [0, 1, 2, 3] and frame["position"].isna().all()


def test_stream_patch_fills_in_and_ends_with_the_result(grid, patch_session):
    p, _ = grid
    s = patch_session
    before = s.engine.generate_calls
    items = list(s.stream_patch(CLEAN, CORRUPT))
    assert s.engine.generate_calls - before == 2
    done = [x.done for x in items]
    assert done == sorted(done) and done[-1] == 160
    assert any(0 < d < 160 for d in done), "cells should finish over several steps"
    partial = next(x for x in items if 0 < x.done < 160)
    assert partial.grid.isnan().any()
    filled = ~partial.grid.isnan()
    assert torch.allclose(partial.grid[filled], p.grid[filled], atol=1e-5)
    assert torch.allclose(items[-1].grid, p.grid, atol=1e-5)
    assert s.status()["records"] == 0


def test_a_loaded_engine_patches_the_same(grid, tiny_llama4, engine_options):
    """Prefill chunks of 16 tokens and a KV cache of 3 blocks: the cells
    queue and run a few at a time; the grid is the same."""
    p, _ = grid
    with vlens.Session(tiny_llama4, reuse=False, max_model_len=256, max_num_batched_tokens=16,
                       enable_prefix_caching=True, num_gpu_blocks_override=3,
                       **engine_options) as s:
        loaded = s.patch(CLEAN, CORRUPT)
        assert torch.allclose(loaded.grid, p.grid, atol=1e-4)
        assert s.status()["records"] == 0 and s.status()["plans"] == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(corrupt="w1 w2"), r"tokenize to 40 and 3 tokens.*same length"),
    (dict(corrupt=CLEAN), r"both predict .* pass answer=\(clean_token, corrupt_token\)"),
    (dict(site="nope"), r"unknown patch site 'nope'"),
    (dict(site="attn_pattern"), r"'attn_pattern' cannot be written"),
    (dict(heads="all"), r"heads= gives one cell per head.*use site='z'"),
    (dict(site="z", heads=True), r"heads='all'"),
    (dict(site="z", heads=[0, 9]), r"head 9 does not exist"),
    (dict(layers=[7]), r"layer 7 does not exist"),
    (dict(span=[40]), r"position 40 is outside the prompt"),
    (dict(answer=("w3", "w3")), r"same token twice"),
    (dict(answer=("w3 w4", "w5")), r"'w3 w4' tokenises to 2 tokens"),
    (dict(answer=(999, 3)), r"answer id 999 is outside the vocabulary"),
])
def test_bad_patching_is_refused_and_the_engine_serves(patch_session, kwargs, match):
    args = {"clean": CLEAN, "corrupt": CORRUPT, **kwargs}
    before = patch_session.engine.generate_calls
    with pytest.raises(VlensError, match=match):
        patch_session.patch(args.pop("clean"), args.pop("corrupt"), layers=args.pop("layers", [0]),
                            span=args.pop("span", [SWAPPED]), **args)
    # refused before anything runs; equal top tokens are known after the read
    assert patch_session.engine.generate_calls - before == (1 if "both predict" in match else 0)
    p = patch_session.patch(CLEAN, CORRUPT, layers=[0], span=[SWAPPED])
    assert not math.isnan(float(p.grid[0, 0]))
    assert patch_session.status()["records"] == 0
