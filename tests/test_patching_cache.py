"""Patching on the prefix cache (vlens/engine/prefix_cache.py): on an
in-process engine every cell of a grid reads the corrupt run's cached KV
blocks before its first patched position and computes only the rest, and
registers no block a later plain request could take.

A 256-token prompt, 32-token KV blocks (the CPU build's default is 128;
vLLM on a GPU uses 16), a 4-layer random Llama. The grid on the cache
equals the grid of an engine without prefix caching (measured: identical
logit differences; asserted within 1e-5), computes at most 0.6 x its
prompt rows, and afterwards plain calls that read the cache equal a fresh
engine's bit for bit. Chunked prefill and preemption (a small KV cache
and a long generation beside the grid) give the same grid."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch

import vlens
from vlens import calls
from vlens.calls import Call
from vlens.engine.driver import STEP
from vlens.engine.prefix_cache import marked_prefix, registered_blocks

pytestmark = pytest.mark.engine

WORDS = [f"w{(5 + 13 * i) % 240}" for i in range(255)]
CLEAN = " ".join(WORDS)  # 256 tokens with BOS
CORRUPT = " ".join(WORDS[:200] + ["w239"] + WORDS[201:])  # position 201 swapped
# its first 160 tokens are CORRUPT's (five 32-token blocks), then its own
SHARED = " ".join(WORDS[:159] + [f"w{(7 * i) % 240}" for i in range(60)])
ANSWER = ("w237", "w3")
N = 256
BLOCK = 32
BASE = dict(reuse=False, max_model_len=320, block_size=BLOCK)


@pytest.fixture(scope="module")
def model(models_dir):
    from vlens.tiny import make_tiny_model

    return make_tiny_model(models_dir / "llama4-patch-cache", "llama", layers=4, seed=6)


@pytest.fixture(scope="module")
def cached(model, engine_options):
    s = vlens.Session(model, **BASE, **engine_options)
    yield s
    s.close()


@pytest.fixture(scope="module")
def uncached(model, engine_options):
    s = vlens.Session(model, enable_prefix_caching=False, **BASE, **engine_options)
    yield s
    s.close()


@pytest.fixture(scope="module")
def uncached_grid(uncached):
    return uncached.patch(CLEAN, CORRUPT, site="resid_pre", answer=ANSWER)


def _plain(s, texts):
    """Plain requests (no plan, no prompt logprobs: they read the prefix
    cache): per prompt (rows read from the cache, token ids, the top-5
    log-probabilities of each of 4 generated tokens)."""
    reqs = [calls.background(s.tokenize(t), 4, {"logprobs": 5}) for t in texts]
    outs = s.run_call(Call(reqs, lambda o, _, __: o))
    return [(o.num_cached_tokens, list(o.outputs[0].token_ids),
             [{k: v.logprob for k, v in e.items()} for e in o.outputs[0].logprobs])
            for o in outs]


def _fresh_cache(s):
    """Empty the engine's prefix cache, then cache the clean and corrupt
    prompts' blocks with plain runs: what the cache holds before a patch."""
    with STEP:  # between two steps of the idle engine
        assert s.engine.llm.reset_prefix_cache()
    _plain(s, [CLEAN, CORRUPT])
    return _registered(s)


def _registered(s):
    return registered_blocks(s.engine.llm.llm_engine)


def _nothing_registered_by_cells(before, after, *, new_hashes=False):
    """No hash in the cache after a patch that was not there before it
    (``new_hashes``: other traffic ran beside it), and under the clean and
    corrupt prompts' hashes at most the blocks of the patch's own unedited
    requests (the read stage's clean and corrupt runs compute their 8
    blocks again, the unpatched pair beside the cells its last). A cell
    registering its blocks would add hundreds, under the plain prompt's
    hashes."""
    if not new_hashes:
        assert set(after) <= set(before), "a block hash no plain request made"
    gained = sum(max(0, after.get(key, 0) - n) for key, n in before.items())
    assert gained <= 2 * (N // BLOCK) + 2, f"{gained} blocks registered by the patch"


@contextmanager
def _registrations(s):
    """Watch vLLM's own registration of full blocks (``BlockPool.
    cache_full_blocks``, below vlens's wrapper): yields a list that gets,
    for each registration of a marked request (a cell), its mark and the
    end of the last block it registers, in tokens."""
    pool = s.engine.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    seen: list[tuple[int, int]] = []
    register = pool.cache_full_blocks

    def watched(*, request, num_full_blocks, block_size, **kw):
        mark = marked_prefix(request)
        if mark is not None:
            seen.append((mark, num_full_blocks * block_size))
        return register(request=request, num_full_blocks=num_full_blocks,
                        block_size=block_size, **kw)

    pool.cache_full_blocks = watched
    try:
        yield seen
    finally:
        del pool.cache_full_blocks


def test_a_resid_pre_grid_on_the_prefix_cache_equals_the_uncached_grid(
        cached, uncached, uncached_grid, model, engine_options):
    s, q = cached, uncached_grid
    assert s.engine.prefix_marks and not uncached.engine.prefix_marks
    assert len(s.tokenize(CLEAN)) == N and s.tokenize(SHARED)[:160] == s.tokenize(CORRUPT)[:160]
    before = _fresh_cache(s)
    with _registrations(s) as seen:
        p = s.patch(CLEAN, CORRUPT, site="resid_pre", answer=ANSWER)
    assert p.grid.shape == (4, N) and not p.grid.isnan().any()
    assert abs(p.clean_diff - q.clean_diff) <= 1e-5
    assert abs(p.corrupt_diff - q.corrupt_diff) <= 1e-5
    err = (p.diffs - q.diffs).abs().max()
    assert err <= 1e-5, f"the cached grid's logit differences are off by {err}"
    assert (p.grid - q.grid).abs().max() <= 1e-4
    # what it cost: the uncached grid computes every row of its 2 + 2 + 1024 requests
    assert q.rows_cached == 0 and q.rows_computed == (2 + 2 + 4 * N) * N
    # each cell reads the whole blocks before its position; the unpatched clean and
    # corrupt runs beside the cells read all but the last block
    assert p.rows_cached == 4 * sum(pos // BLOCK * BLOCK for pos in range(N)) + 2 * (N - BLOCK)
    assert p.rows_computed + p.rows_cached == q.rows_computed
    assert p.rows_computed <= 0.6 * q.rows_computed, (p.rows_computed, q.rows_computed)
    _nothing_registered_by_cells(before, _registered(s))
    assert all(end <= mark for mark, end in seen), seen
    # plain calls after the grid read the cache (the corrupt prompt's blocks, and
    # the 5 blocks the other prompt shares with it) and equal a fresh engine's
    after = _plain(s, [CORRUPT, SHARED])
    assert [a[0] for a in after] == [N - BLOCK, 160]
    with vlens.Session(model, **BASE, **engine_options) as fresh:
        ref = _plain(fresh, [CORRUPT, SHARED])
    assert after == [(a[0],) + r[1:] for a, r in zip(after, ref)]


def test_z_per_head_on_the_prefix_cache_equals_the_uncached_grid(cached, uncached):
    s = cached
    span = list(range(200, N))  # every head's cell writes positions 200..255
    before = _fresh_cache(s)
    with _registrations(s) as seen:
        p = s.patch(CLEAN, CORRUPT, site="z", heads="all", span=span, answer=ANSWER)
    q = uncached.patch(CLEAN, CORRUPT, site="z", heads="all", span=span, answer=ANSWER)
    heads = s.info["n_heads"]
    assert p.grid.shape == (4, heads) and not p.grid.isnan().any()
    err = (p.diffs - q.diffs).abs().max()
    assert err <= 1e-5, f"the cached per-head grid's logit differences are off by {err}"
    # each cell reads the 6 blocks before position 200
    assert p.rows_cached == 4 * heads * 192 + 2 * (N - BLOCK)
    assert p.rows_computed + p.rows_cached == q.rows_computed == (4 + 4 * heads) * N
    assert p.rows_computed <= 0.6 * q.rows_computed
    _nothing_registered_by_cells(before, _registered(s))
    assert all(end <= mark for mark, end in seen), seen


def test_chunked_prefill_and_preemption_patch_the_same(model, uncached_grid, engine_options):
    """Prefill chunks of 64 tokens and a KV cache of 20 blocks, with a long
    generation beside the grid: vLLM preempts and recomputes requests (a
    preempted cell looks the cache up again, capped at its position). The
    grid is the uncached one, and plain calls afterwards equal a fresh
    engine's of the same settings."""
    loaded = dict(BASE, max_num_batched_tokens=64, num_gpu_blocks_override=20)
    layers, span = [0, 2], list(range(0, N, 8))
    background = [" ".join(WORDS[i:i + 40]) for i in range(0, 160, 20)]
    with vlens.Session(model, **loaded) as fresh:
        ref = [_plain(fresh, [t])[0] for t in (CORRUPT, SHARED)]
    with vlens.Session(model, **loaded) as s:
        assert s.engine.prefix_marks
        before = _fresh_cache(s)
        scheduler = s.engine.llm.llm_engine.engine_core.engine_core.scheduler
        preempted = []
        preempt = scheduler._preempt_request

        def counted(request, *args, **kw):  # vLLM's own preemption, counted
            preempted.append(request.request_id)
            return preempt(request, *args, **kw)

        scheduler._preempt_request = counted
        try:
            with _registrations(s) as seen:
                side = threading.Thread(target=s.generate, args=(background,),
                                        kwargs=dict(max_new_tokens=120, ignore_eos=True))
                side.start()
                p = s.patch(CLEAN, CORRUPT, site="resid_pre", layers=layers, span=span,
                            answer=ANSWER)
                side.join()
        finally:
            del scheduler._preempt_request
        assert preempted, "the small KV cache was meant to force preemption"
        # a cell registers only blocks before its position (those it computed
        # itself when the corrupt run's were evicted), never one after
        assert all(end <= mark for mark, end in seen), seen
        q = uncached_grid
        assert (p.diffs - q.diffs[layers][:, span]).abs().max() <= 1e-5
        assert p.rows_cached > 0 and p.rows_computed + p.rows_cached == (4 + 2 * len(span)) * N
        _nothing_registered_by_cells(before, _registered(s), new_hashes=True)
        after = [_plain(s, [t])[0] for t in (CORRUPT, SHARED)]
        assert [a[0] for a in after] == [N - BLOCK, 160]
        for got, want in zip(after, ref):
            assert got[1] == want[1]
            err = max(abs(got[2][i][k] - want[2][i][k]) for i in range(4) for k in want[2][i])
            assert err <= 1e-5
        assert s.status()["records"] == 0 and s.status()["plans"] == 0

