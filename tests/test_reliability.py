"""A notebook is a hostile place: interrupts, concurrent callbacks, closed
sessions, engines started and stopped. Nothing lost, nothing left behind."""

from __future__ import annotations

import threading

import pytest
import torch

import vlens
from vlens.errors import VlensError

pytestmark = pytest.mark.engine

SHORT = "w1 w2 w3"
LONG = " ".join(f"w{(3 * i) % 240}" for i in range(280))  # chunked: in flight for long


def _clean(session) -> None:
    st = session.status()
    assert st["records"] == 0, st
    assert st["plans"] == 0, st
    assert st["edit_fns"] == 0, st
    assert session.engine.unfinished() == 0


def test_interrupt_mid_generation_leaves_nothing_behind(llama_session):
    prompts = [SHORT, LONG, "w9 w8"]
    calls = []

    def stop(done, total):
        calls.append((done, total))
        raise KeyboardInterrupt  # the notebook's stop button, between steps

    with pytest.raises(KeyboardInterrupt):
        llama_session.trace(prompts, layers=[0, 2], max_new_tokens=12, progress=stop)
    assert calls and calls[0][0] < calls[0][1]  # stopped with requests in flight
    _clean(llama_session)
    again = llama_session.trace(prompts, layers=[0, 2], max_new_tokens=12)
    fresh = llama_session.trace(prompts, layers=[0, 2], max_new_tokens=12)
    for a, b in zip(again, fresh):
        assert a.output_token_ids == b.output_token_ids
        assert torch.equal(a.activations(), b.activations())
    _clean(llama_session)


def test_interrupted_sweep_leaves_nothing_behind(llama_session):
    d = torch.ones(llama_session.hidden_size) / llama_session.hidden_size**0.5
    st = vlens.Steer(d, layer=1)
    with pytest.raises(KeyboardInterrupt):
        llama_session.sweep(LONG, steer=st, scales=[0, 1, 2], max_new_tokens=8,
                            progress=lambda done, total: (_ for _ in ()).throw(KeyboardInterrupt))
    _clean(llama_session)
    sw = llama_session.sweep(SHORT, steer=st, scales=[0, 2], max_new_tokens=4)
    assert len(sw.to_frame()) == 2


def test_progress_reports_every_request(llama_session):
    seen = []
    llama_session.trace([SHORT, "w4 w5", "w6"], layers=[0], max_new_tokens=3,
                        progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (3, 3)
    with pytest.raises(VlensError, match="progress must be"):
        llama_session.trace(SHORT, progress="yes")


def test_concurrent_calls_share_steps_and_each_gets_its_own(llama_session):
    prompts = {0: [SHORT, LONG], 1: ["w7 w8 w9", "w10 w11"]}
    expected = {k: llama_session.trace(v, layers=[1], max_new_tokens=6) for k, v in prompts.items()}
    got, errors = {}, []

    def work(k):
        try:
            got[k] = llama_session.trace(prompts[k], layers=[1], max_new_tokens=6)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    for k in prompts:
        for a, b in zip(got[k], expected[k]):
            assert a.prompt == b.prompt
            assert a.output_token_ids == b.output_token_ids
            assert (a.activations() - b.activations()).abs().max() <= 1e-4
    _clean(llama_session)


def test_read_budget_refuses_huge_plans_with_the_estimate(llama_session):
    before = llama_session.engine.generate_calls
    budget = llama_session.read_budget
    llama_session.read_budget = 2**20  # 1 MiB
    try:
        with pytest.raises(VlensError, match=r"would read about 0\.\d+ GiB .* reduce='norm'"):
            llama_session.trace([LONG] * 4, sites=["resid_pre", "resid_post"], max_new_tokens=8)
        # the same call reduced in the worker fits
        run = llama_session.trace([LONG] * 4, sites=["resid_post"], reduce="norm", max_new_tokens=8)
        assert run[0].norms().shape == (3, run[0].n_tokens)
    finally:
        llama_session.read_budget = budget
    assert llama_session.engine.generate_calls == before + 1


def test_norm_reduction_matches_full_reads(llama_session):
    full = llama_session.trace([SHORT, LONG], max_new_tokens=4)
    red = llama_session.trace([SHORT, LONG], reduce="norm", max_new_tokens=4)
    for a, b in zip(full, red):
        assert "resid_post" not in b.read_keys
        assert torch.allclose(a.activations().norm(dim=-1), b.norms(), atol=1e-4)
    assert red.copied_bytes * 50 < full.copied_bytes


#: the measurement of test_engine_memory_is_returned_on_close, run in a
#: process of its own: what it prints is the resident memory (bytes) before
#: the engine (after a small one came and went), with it open and after it
#: closed, and what a closed session says
_MEMORY_ON_CLOSE = """
import ctypes, gc, json, sys
import psutil
import vlens
proc = psutil.Process()
# a small engine first, opened and closed: the code every engine loads
# (torch, vLLM, the model's modules) is then resident before the measurement
with vlens.Session(sys.argv[1], reuse=False, kv_cache_memory_bytes=32 * 2**20) as warm:
    warm.trace(sys.argv[2], max_new_tokens=2)
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = proc.memory_info().rss
s = vlens.Session(sys.argv[1], reuse=False, kv_cache_memory_bytes=512 * 2**20)
s.trace(sys.argv[2], max_new_tokens=2)
opened = proc.memory_info().rss
frozen_open = gc.get_freeze_count()  # the heap vLLM sets aside while it serves
s.close()
s.close()  # harmless
closed = proc.memory_info().rss
frozen_closed = gc.get_freeze_count()
try:
    s.trace(sys.argv[2])
    after = ""
except vlens.VlensError as exc:
    after = str(exc)
print("MEMORY", json.dumps([before, opened, closed, after, frozen_open, frozen_closed]))
"""


def test_engine_memory_is_returned_on_close(tiny_llama):
    """In a fresh process: in a test process, memory that earlier tests
    freed but glibc kept is reused by this engine (its growth then reads as
    little: 306 MiB for a 512 MiB KV cache, seen once under two test
    processes), and memory they free while it starts offsets it."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_", "VLENS_TEST", "PYTEST_XDIST", "LOCAL_WORLD_SIZE"))}
    out = subprocess.run([sys.executable, "-c", _MEMORY_ON_CLOSE, str(tiny_llama), SHORT],
                         env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("MEMORY ")), None)
    assert out.returncode == 0 and line, (out.stdout + out.stderr)[-4000:]
    before, opened, closed, after, frozen_open, frozen_closed = json.loads(line.split(" ", 1)[1])
    grew = opened - before
    assert grew > 400 * 2**20  # the KV cache alone is 512 MiB
    assert closed - before < 0.5 * grew, (before, opened, closed)
    assert "closed" in after, after
    # set aside from the garbage collector while the engine served (vLLM's
    # freeze, and vlens's from before the start), handed back on close
    assert frozen_open > 0 and frozen_closed == 0, (frozen_open, frozen_closed)


_FROZEN_HEAP = """
import gc, json
from vlens.engine.startup import frozen_heap
seen = {}
with frozen_heap(False):  # an engine core in another process: nothing here
    seen["out_of_process"] = gc.get_freeze_count()
try:
    with frozen_heap(True):
        seen["starting"] = gc.get_freeze_count()
        raise RuntimeError("the start failed")
except RuntimeError:
    seen["after_a_failed_start"] = gc.get_freeze_count()
with frozen_heap(True):
    pass
seen["after_a_start"] = gc.get_freeze_count()
print(json.dumps(seen))
"""


def test_a_start_sets_the_heap_aside_and_a_failed_one_gives_it_back():
    """In a fresh process (an engine in this one may hold the heap frozen):
    vLLM's collections while it starts walk only what the engine makes; a
    start that fails leaves the collector as it found it."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FROZEN_HEAP], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["out_of_process"] == 0 and seen["starting"] > 1000, seen
    assert seen["after_a_failed_start"] == 0, seen
    assert seen["after_a_start"] > 1000, seen  # as vLLM leaves it: its shutdown unfreezes
