"""Widget runs on the real engine: progress, a disabled run button, and the
latest settings win (vlens/widgets/_runs.py); ``progress=`` on the Session
calls that stream and on ``patch``.

A button or a control starts a panel's run in the background (in a kernel
the comm handler returns at once); a control moved while a run is under
way replaces it. The tiny Llama (random weights) never stops early, so
``max_new_tokens`` sets how long a run takes: 300 tokens of baseline and
steered take seconds on the CPU build.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import vlens
from vlens.widgets import SteeringPanel

engine = pytest.mark.engine

PROMPT = "w1 w2 w3 w4"
POSITIVE, NEGATIVE = ["w5 w6 w7", "w8 w9 w10"], ["w11 w12 w13", "w14 w15 w16"]
TOKENS = 300  # over a second on the CPU build (its engine steps take milliseconds)
SHORTER = 120


def _until(test, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not test():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _engine_is_clean(s) -> None:
    status = s.status()
    assert (status["records"], status["plans"], status["edit_fns"]) == (0, 0, 0), status
    assert s.engine.unfinished() == 0


@engine
def test_a_long_run_shows_progress_and_the_latest_settings_win(llama_session):
    s = llama_session
    panel = SteeringPanel(s, PROMPT, positive=POSITIVE, negative=NEGATIVE, layer=1, scale=4.0,
                          max_new_tokens=TOKENS)
    scales: list[float] = []  # the scale of every comparison that started on the engine
    real = panel.controller.stream_compare

    def spy(prompt, steer):
        scales.append(steer.scale)
        return real(prompt, steer)

    panel.controller.stream_compare = spy

    # -- a click: the run goes on in the background, with progress and the buttons off
    seen: list[tuple[str, bool, bool, str]] = []
    t0 = time.monotonic()
    panel._run_button.click()
    assert panel.busy and panel._run_button.disabled and panel._sweep_button.disabled
    while panel.busy:
        seen.append((panel._progress_label.value, panel._run_button.disabled,
                     panel._sweep_button.disabled, panel._progress_row.layout.display))
        time.sleep(0.01)
    assert panel.wait(60)
    elapsed = time.monotonic() - t0
    assert panel.error == "" and elapsed > 1.0, (panel.error, elapsed)
    counted = [x for x in seen if re.search(rf"\d+/{2 * TOKENS} tokens$", x[0])]
    assert len({x[0] for x in counted}) >= 3, seen[-5:]  # "steering at scale 4… 12/300 tokens"
    assert all(x[1:] == (True, True, "") for x in counted)  # row shown, buttons off meanwhile
    assert not panel._run_button.disabled and not panel._sweep_button.disabled
    assert panel._progress_row.layout.display == "none"
    assert scales == [4.0] and panel.comparison is not None
    _engine_is_clean(s)

    # -- three quick moves of the slider: one result, the last scale's (shorter runs
    # from here: a stopped run still has ~100 steps to go when the next move comes)
    panel.controller.max_new_tokens = SHORTER
    results: list = []
    panel.observe(lambda c: results.append(c["new"]), names="comparison")
    states: list[int] = []
    panel.observe(lambda c: states.append(c["new"]), names="streamed_states")
    panel._scale.value = 1.0  # the slider, released (auto_run: a comparison is on show)
    _until(lambda: 0 in states and states[-1] >= 3)  # that run is streaming
    panel._scale.value = 2.0
    panel._scale.value = 3.0
    assert panel._run_button.disabled
    assert panel.wait(300)
    assert panel.error == ""
    assert len(results) == 1 and results[0] is panel.comparison
    # the one at 1.0 was stopped mid-stream; the one at 2.0 was replaced before it began
    # (or, on a very busy machine, just after)
    stopped = states[states.index(0) + 1:]
    assert 0 in stopped and max(stopped[:stopped.index(0)]) < SHORTER, states
    assert scales[:2] == [4.0, 1.0] and scales[-1] == 3.0 and len(scales) <= 4, scales
    assert panel.comparison_figure.layout.title.text.startswith("scale 3 at layer 1")
    ref = s.compare(PROMPT, steer=panel.steer(), max_new_tokens=SHORTER)
    assert ref.steered[0].output_token_ids == panel.comparison.steered[0].output_token_ids
    assert torch.allclose(ref.kl[0], panel.comparison.kl[0], atol=1e-5)
    other = s.compare(PROMPT, steer=panel.steer(scale=1.0), max_new_tokens=SHORTER)
    assert not torch.allclose(other.kl[0], panel.comparison.kl[0], atol=1e-5)
    _engine_is_clean(s)

    # -- a Python call while a background run is under way: it replaces it and returns
    states.clear()
    panel._scale.value = 2.0
    _until(lambda: 0 in states and states[-1] >= 1)
    cmp = panel.run_comparison()  # at 2.0 too, run again from the start
    assert results[1:] == [cmp] and panel.comparison is cmp and not panel.busy
    assert scales[-2:] == [2.0, 2.0]
    _engine_is_clean(s)


@engine
def test_a_failing_background_run_is_shown_and_the_next_one_works(llama_session):
    panel = SteeringPanel(llama_session, PROMPT, positive=POSITIVE, negative=NEGATIVE,
                          layer=1, max_new_tokens=4)
    panel.source = "vector"  # and none set
    panel._run_button.click()
    assert panel.wait(60) and "no saved vector" in panel.error
    assert not panel.busy and not panel._run_button.disabled
    panel.source = "prompts"
    panel._run_button.click()
    assert panel.wait(120) and panel.error == "" and panel.comparison is not None


@engine
def test_patch_and_the_streams_take_progress(llama_session):
    s = llama_session
    steer = vlens.Steer(torch.ones(s.hidden_size), layer=1, scale=2.0)

    def recorder():
        seen: list[tuple[int, int]] = []
        return seen, lambda done, total: seen.append((done, total))

    seen, fn = recorder()
    *_, run = s.stream([PROMPT, "w9 w8"], max_new_tokens=3, progress=fn)
    assert seen[-1] == (2, 2) and len(run) == 2
    seen, fn = recorder()
    *_, cmp = s.stream_compare(PROMPT, steer=steer, max_new_tokens=3, progress=fn)
    assert seen[-1] == (2, 2) and cmp.steered.texts
    # patch: the read pass (2 requests), then 2 layers x 4 positions + clean and corrupt
    clean, corrupt = "w1 w2 w3", "w1 w7 w3"
    answer = (s.tokenize("w5")[-1], s.tokenize("w6")[-1])
    kw = dict(layers=[0, 1], answer=answer)
    seen, fn = recorder()
    p = s.patch(clean, corrupt, progress=fn, **kw)
    total = 2 + p.grid.numel() + 2
    assert {t for _, t in seen} == {total} and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    seen, fn = recorder()
    *_, q = s.stream_patch(clean, corrupt, progress=fn, **kw)
    assert seen[-1] == (total, total) and torch.allclose(q.grid, p.grid, atol=1e-5)
    # a bad value is refused at the call, before anything runs
    before = s.engine.generate_calls
    with pytest.raises(vlens.VlensError, match="progress must be"):
        s.stream(PROMPT, progress="yes")
    with pytest.raises(vlens.VlensError, match="progress must be"):
        s.patch(clean, corrupt, progress=3, **kw)
    assert s.engine.generate_calls == before

    # raising in progress stops a stream between steps; the engine keeps nothing
    class Stop(Exception):
        pass

    def stop(done, total):
        raise Stop

    with pytest.raises(Stop):
        list(s.stream([PROMPT, "w9"], max_new_tokens=40, progress=stop,
                      edit=lambda rows, ctx: None, edit_at=[("mlp_out", 1)]))
    _engine_is_clean(s)
