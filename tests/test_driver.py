"""One driver per engine: every caller at once, and vLLM's GPU defaults.

A cell's call, an open stream, a widget's background run and a second
Session on the same engine all submit requests to the engine's driver
(``vlens/engine/driver.py``); overlapping callers share engine steps and
each gets exactly what it gets alone. Two in-process engines never step at
once. Async scheduling (vLLM's CUDA default) is forced on the CPU build by
``tests/_async_sched.py``: a request that stops is scheduled once more
before its stop is seen, and vlens drops that row instead of failing.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

import vlens
from vlens.errors import ClosedError
from vlens.widgets._runs import Runs

from _async_sched import forced_async_scheduling, is_async
from _sae_reference import save_saelens

pytestmark = pytest.mark.engine

PROMPTS = ["w1 w2 w3", "w7 w8 w9 w10 w11", "w4 w5"]
WORDS = [f"w{i}" for i in range(240)]
KW = dict(layers=[0, 2], sites=["resid_post"], max_new_tokens=8)


def _same(got, ref, atol=1e-5) -> None:
    """Two runs of the same prompts: identical tokens and logprobs, reads
    within ``atol`` (the batch tolerance: a row's reduction order may
    change with its neighbours)."""
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert a.output_token_ids == b.output_token_ids
        assert a.token_ids == b.token_ids
        lp_a = torch.tensor([x for x in a.logprobs if x is not None])
        lp_b = torch.tensor([x for x in b.logprobs if x is not None])
        assert torch.allclose(lp_a, lp_b, atol=atol)
        for site in a.read_keys:
            assert torch.allclose(a.activations(site), b.activations(site), atol=atol), site


def _clean(s) -> None:
    status = s.status()
    assert status["records"] == 0 and status["plans"] == 0 and status["edit_fns"] == 0
    assert s.engine.unfinished() == 0


# -- every caller at once ------------------------------------------------------

def test_a_call_while_a_stream_is_open_gives_both_what_they_get_alone(llama_session):
    s = llama_session
    alone_stream = s.trace(PROMPTS, **KW)
    alone_trace = s.trace(["w20 w21 w22 w23"], layers=[1], max_new_tokens=5)
    it = s.stream(PROMPTS, **KW)
    first = next(it)
    assert len(first) <= len(PROMPTS)
    mid = s.trace(["w20 w21 w22 w23"], layers=[1], max_new_tokens=5)  # the stream is open
    frames = list(it)
    _same(mid, alone_trace)
    _same(frames[-1], alone_stream)
    _clean(s)


def test_calls_at_once_reading_one_site_two_ways_each_get_their_own(llama_session):
    """A stream's logit lens of top 3 and a cell's of top 5 share steps: the
    same read key, read two ways in one step. Each gets what it gets alone
    (the cell's call used to fail with "the hook never saw some of this
    request's rows": the step kept one group's rows per key)."""
    s = llama_session
    kw_stream = dict(layers=[0, 2], logit_lens=3, max_new_tokens=40, ignore_eos=True)
    kw_cell = dict(layers=[0, 2], logit_lens=5, max_new_tokens=4)
    alone_stream = s.trace(PROMPTS, **kw_stream)
    alone_cell = s.trace(["w20 w21 w22 w23"], **kw_cell)
    it = s.stream(PROMPTS, **kw_stream)
    next(it)  # 39 of the stream's steps are still to come
    mid = s.trace(["w20 w21 w22 w23"], **kw_cell)
    frames = list(it)
    assert all(len(t.output_token_ids) == 40 for t in frames[-1])
    for got, ref, k in ((mid, alone_cell, 5), (frames[-1], alone_stream, 3)):
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert a.output_token_ids == b.output_token_ids
            assert torch.allclose(a.activations("resid_post"), b.activations("resid_post"),
                                  atol=1e-5)
            ids_a, p_a = a.logit_lens()
            ids_b, p_b = b.logit_lens()
            assert ids_a.shape == ids_b.shape == (2, len(a.token_ids), k)
            assert torch.equal(ids_a, ids_b) and torch.allclose(p_a, p_b, atol=1e-5)
    _clean(s)


def test_a_stream_whose_body_calls_the_session(llama_session):
    s = llama_session
    ref = s.trace(PROMPTS, **KW)
    inner_ref = s.trace(["w30 w31"], layers=[0], max_new_tokens=3)
    inner = []
    for run in s.stream(PROMPTS, **KW):
        if len(inner) < 3:
            inner.append(s.trace(["w30 w31"], layers=[0], max_new_tokens=3))
    _same(run, ref)
    for got in inner:
        _same(got, inner_ref)
    _clean(s)


def test_a_widget_run_three_cells_and_a_stream_at_once(llama_session):
    s = llama_session
    rng = random.Random(5)
    cells = [[" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))]
             for _ in range(3)]
    widget_prompts = ["w100 w101 w102", "w5 w6 w7 w8"]
    steer = vlens.Steer(torch.randn(s.hidden_size, generator=torch.Generator().manual_seed(2)),
                        layer=1, scale=2.0)
    refs = [s.trace(c, **KW) for c in cells]
    widget_ref = s.trace(widget_prompts, steer=steer, **KW)
    stream_ref = s.trace(PROMPTS, **KW)

    runs = Runs(lambda busy: None)
    got: dict[str, object] = {}
    errors: list[BaseException] = []
    it = s.stream(PROMPTS, **KW)
    next(it)  # the stream is open for all that follows
    job = runs.start("widget", lambda: got.__setitem__(
        "widget", s.trace(widget_prompts, steer=steer, **KW)), errors.append, lambda: None)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, s.trace(cells[i], **KW)))
               for i in range(3)]
    for t in threads:
        t.start()
    frames = list(it)
    for t in threads:
        t.join(120)
    assert runs.wait(120) and job.done.is_set() and not errors
    for i in range(3):
        _same(got[i], refs[i])
    _same(got["widget"], widget_ref)
    _same(frames[-1], stream_ref)
    _clean(s)


def test_cancelling_one_caller_aborts_its_requests_only(llama_session):
    s = llama_session
    ref = s.trace(PROMPTS, **KW)
    out: dict[str, object] = {}
    long = threading.Thread(target=lambda: out.__setitem__(
        "long", s.trace(PROMPTS, **KW)))
    it = s.stream(["w1 w2"], max_new_tokens=64, layers=[0])
    next(it)
    long.start()
    it.close()  # the stream's requests are aborted; the other call goes on
    long.join(120)
    _same(out["long"], ref)
    _clean(s)


# -- two models in one kernel ----------------------------------------------------

def test_two_models_each_called_from_its_own_thread(llama_session, qwen2_session):
    pairs = [(llama_session, ["w1 w2 w3 w4", "w9"]), (qwen2_session, ["w3 w5 w7", "w2 w2"])]
    alone = [s.trace(p, **KW) for s, p in pairs]
    errors: list[BaseException] = []
    mismatches: list[str] = []

    def hammer(k: int) -> None:
        s, prompts = pairs[k]
        try:
            for i in range(50):
                got = s.trace(prompts, **KW)
                try:
                    _same(got, alone[k])
                except AssertionError:
                    mismatches.append(f"model {k}, call {i}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert not mismatches, mismatches
    for s, _ in pairs:
        _clean(s)


# -- close while a run is under way ---------------------------------------------

def test_close_during_a_background_run(llama_session, tiny_llama, tmp_path):
    from conftest import KV_BYTES

    other = vlens.Session(tiny_llama, max_num_batched_tokens=64, max_model_len=512,
                          kv_cache_memory_bytes=KV_BYTES)  # shares llama_session's engine
    assert other.engine is llama_session.engine
    sae = vlens.SAE.load(save_saelens(tmp_path / "sae", "standard", "blocks.1.hook_resid_post"))
    # the shared engine's driver thread starts with its first call and lives as
    # long as the engine: run once first, so only the closed Session's count
    ref = llama_session.trace(PROMPTS, **KW)
    before_threads = {t.ident for t in threading.enumerate()}
    ended: list[BaseException] = []

    def background() -> None:
        try:
            other.trace(["w1 w2 w3"] * 4, saes=[sae], max_new_tokens=400, layers=[0])
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            ended.append(exc)

    t = threading.Thread(target=background)
    t.start()
    deadline = time.monotonic() + 60
    while sae.id not in llama_session.engine.sae_ids and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # a few steps in
    other.close()
    t.join(30)
    assert not t.is_alive()
    assert ended and isinstance(ended[0], ClosedError), ended
    assert "closed" in str(ended[0])
    assert sae.id not in llama_session.engine.sae_ids
    assert llama_session.status()["saes"] == 0
    assert {th.ident for th in threading.enumerate()} <= before_threads | {None}
    _same(llama_session.trace(PROMPTS, **KW), ref)  # the other Session keeps answering
    _clean(llama_session)


# -- async scheduling, vLLM's CUDA default ----------------------------------------

@pytest.fixture(scope="module")
def async_loaded_session(tiny_llama):
    """conftest's ``loaded_session`` (prefill chunks of 32 tokens, prefix
    caching, a KV cache of six blocks) with async scheduling forced on."""
    from conftest import _session

    with forced_async_scheduling() as kw:
        s = _session(tiny_llama, reuse=False, max_model_len=512, max_num_batched_tokens=32,
                     enable_prefix_caching=True, num_gpu_blocks_override=6, **kw)
    assert is_async(s)
    yield s
    s.close()


def _prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def sync_loaded_session(loaded_session, tiny_llama):
    """``loaded_session`` with async scheduling off (on a GPU, where vLLM
    turns it on by default, an engine of its own with it off)."""
    if not is_async(loaded_session):
        yield loaded_session
        return
    from conftest import _session

    s = _session(tiny_llama, reuse=False, max_model_len=512, max_num_batched_tokens=32,
                 enable_prefix_caching=True, num_gpu_blocks_override=6,
                 async_scheduling=False)
    yield s
    s.close()


def test_async_scheduling_gives_the_synchronous_engines_results(sync_loaded_session,
                                                                async_loaded_session):
    """Stop strings, a stop token (vLLM's EOS path), n > 1, preemption, the
    prefix cache, chunked prefill and requests finishing early: tokens
    identical and reads within 1e-6 of the synchronous engine's."""
    sync, asy = sync_loaded_session, async_loaded_session
    assert not is_async(sync)
    rng = random.Random(13)
    base = [_prompt(rng, rng.randint(10, 150)) for _ in range(10)]
    prompts = base + base[:3]
    kw = dict(layers=[0, 2], sites=["resid_post", "mlp_out"], max_new_tokens=14,
              n=2, temperature=1.0, top_k=1)
    d = torch.randn(sync.hidden_size, generator=torch.Generator().manual_seed(3)) / 4
    steer = vlens.Steer(d, layer=1, scale=2.0)
    restarted = False
    for edits in ({}, dict(steer=steer, background=[base[1]])):
        plain = sync.trace(prompts, **kw, **edits)
        # stop on a token requests generate mid-way (vLLM's EOS path) and on
        # the text of another (a stop string, seen by vLLM's frontend)
        stop_ids = sorted({t.output_token_ids[3] for t in plain})[:4]
        stops = sorted({t.output_tokens[5].strip() for t in plain
                        if t.output_tokens[5].strip()})[:3]
        for stop in ({}, dict(stop_token_ids=stop_ids), dict(stop=stops)):
            want = plain if not stop else sync.trace(prompts, **kw, **edits, **stop)
            got = asy.trace(prompts, **kw, **edits, **stop)
            if stop:
                assert any(t.finish_reason == "stop" for t in want), stop
                assert any(len(t.output_token_ids) < 14 for t in want)  # some stopped early
            _same(got, want, atol=1e-6)
            restarted = restarted or any(t.restarts > 0 for t in got)
    assert restarted, "the KV cache was meant to force preemption"
    # steer-only requests may reuse the prefix cache
    long = [_prompt(rng, 160) for _ in range(3)]
    kw2 = dict(sites=[], logprobs=False, max_new_tokens=6, steer=steer, stop=stops)
    for _ in range(2):
        want, got = sync.trace(long, **kw2), asy.trace(long, **kw2)
        assert [t.output_token_ids for t in got] == [t.output_token_ids for t in want]
    assert any(t.cached_tokens > 0 for t in got)
    # a stream under async scheduling ends with the same trace
    frames = list(asy.stream(prompts[:4], **kw, stop=stops))
    _same(frames[-1], sync.trace(prompts[:4], **kw, stop=stops), atol=1e-6)
    time.sleep(0.1)
    _clean(asy)


# -- widget runs by kind ----------------------------------------------------------

def test_actions_queue_and_settings_are_latest_wins():
    runs = Runs(lambda busy: None)
    order: list[str] = []
    gate = threading.Event()

    def action(name: str):
        def fn():
            gate.wait(10)
            runs.current.check()  # where a run stops if it was replaced
            order.append(name)
        return fn

    a1 = runs.start("grow", action("a1"), order.append, lambda: None, queue=True)
    a2 = runs.start("grow", action("a2"), order.append, lambda: None, queue=True)
    s1 = runs.start("alternatives", action("s1"), order.append, lambda: None)
    s2 = runs.start("alternatives", action("s2"), order.append, lambda: None)
    assert runs.under_way() is not None
    gate.set()
    assert runs.wait(10)
    assert order.index("a1") < order.index("a2")  # in the order asked for
    assert "s1" not in order and "s2" in order  # the older setting was replaced
    assert not a1.cancelled.is_set() and not a2.cancelled.is_set() and s1.cancelled.is_set()
    assert s2.done.is_set() and runs.under_way() is None


def test_branch_view_keeps_both_branches_grown_while_a_chip_is_clicked(llama_session):
    s = llama_session
    view = vlens.BranchView(s, "w1 w2 w3", k=2, max_new_tokens=6)
    first, second = view.alternatives(1, 0)[0], view.alternatives(2, 0)[0]
    view._queue("grow", view._grow, 0, 1, first.id)  # two alternative buttons clicked
    view._queue("grow", view._grow, 0, 2, second.id)
    view.token = 3  # a chip clicked while they grow: a setting run
    assert view.wait(120)
    assert not view.error, view.error
    assert len(view.traces) == 3
    assert {(t.branch_point, t.forced) for t in view.traces[1:]} == {
        (1, first.id), (2, second.id)}
    assert view.shows.split(" #")[0] in ("grow", "alternatives")  # the view names its run


# -- vLLM's GPU defaults, at start ---------------------------------------------------

def test_model_runner_v2_is_refused_before_the_engine_starts(tiny_llama, monkeypatch):
    from vlens.errors import VlensError

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(VlensError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        vlens.Session(tiny_llama, reuse=False)


def test_compiled_mode_keeps_vllms_own_splitting_ops():
    """Naming splitting ops (vlens adds its own) stops vLLM from adding its
    KV-cache-update ops itself: vlens's list starts from vLLM's default."""
    from vllm.config import CompilationConfig

    from vlens.engine.engine import default_splitting_ops

    ops = default_splitting_ops({})
    assert set(CompilationConfig._attention_ops) <= set(ops)
    assert "vllm::unified_kv_cache_update" in ops
    assert "vllm::unified_kv_cache_update" not in default_splitting_ops(
        {"use_inductor_graph_partition": True})
