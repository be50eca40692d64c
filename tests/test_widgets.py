"""Widgets driven from Python, against a fake session.

Widgets call only the Session API, so a small stand-in that records its
calls and returns deterministic results is enough to check the contract:
set a trait -> the session was (or was not) called as expected -> the
figure's data changed. The real engine drives the same widgets in
tests/test_notebooks.py and tests/test_browser.py.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pandas as pd
import pytest
import torch

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import vlens
from vlens.lens import LogitLens
from vlens.plots import activation_values
from vlens.widgets import (
    ActivationView,
    CloneReadsToggle,
    LayerPicker,
    LogitLensView,
    SitePicker,
    SteeringPanel,
    TokenSpanPicker,
    explore,
)

N_LAYERS, HIDDEN, VOCAB = 4, 8, 12
SITES = ["attn_out", "mlp_out", "resid_post", "resid_pre"]


# -- the stand-in -------------------------------------------------------------


@dataclass
class FakeTrace:
    prompt: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    tokens: list[str]
    output_tokens: list[str]
    logprobs: list[float | None]
    layers: dict[str, list[int]]
    acts: dict[str, torch.Tensor]
    copied_bytes: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids[:-1]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def text(self) -> str:
        return " " + " ".join(self.output_tokens)

    def activations(self, site: str = "resid_post") -> torch.Tensor:
        return self.acts[site]

    def layer(self, site: str, layer: int) -> torch.Tensor:
        return self.acts[site][self.layers[site].index(layer)]


class FakeRun(list):
    @property
    def copied_bytes(self) -> int:
        return sum(t.copied_bytes for t in self)

    @property
    def texts(self) -> list[str]:
        return [t.text for t in self]


@dataclass
class FakeSteer:
    vector: torch.Tensor
    layer: int
    scale: float = 1.0
    site: str = "resid_post"
    span: object = "all"


@dataclass
class FakeComparison:
    baseline: FakeRun
    steered: FakeRun

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for i, (b, s) in enumerate(zip(self.baseline, self.steered)):
            n = len(b.prompt_token_ids)
            for j, (tb, ts) in enumerate(zip(b.output_tokens, s.output_tokens)):
                rows.append({"prompt": i, "position": n + j, "token_base": tb,
                             "token_steered": ts, "logprob_base": b.logprobs[n + j],
                             "logprob_steered": s.logprobs[n + j], "kl": 0.1})
        return pd.DataFrame(rows)


@dataclass
class FakeSweep:
    scales: list[float]
    runs: FakeRun

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame({
            "scale": self.scales,
            "text": [t.text for t in self.runs],
            "mean_logprob": [-1.0 - abs(x) / 10 for x in self.scales],
            "kl_mean": [abs(x) / 4 for x in self.scales],
        })


@dataclass
class FakeSession:
    """Stands in for vlens.Session: records every engine call."""

    n_layers: int = N_LAYERS
    hidden_size: int = HIDDEN
    sites: list[str] = field(default_factory=lambda: list(SITES))
    model: str = "/nonexistent/fake-model"
    clone_reads: bool = False
    calls: list[tuple[str, dict]] = field(default_factory=list)
    fail_next: Exception | None = None

    def calls_of(self, name: str) -> list[dict]:
        return [kw for n, kw in self.calls if n == name]

    def _record(self, name: str, **kw) -> None:
        self.calls.append((name, kw))
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc

    def tokenize(self, text: str) -> list[int]:
        return [1] + [4 + sum(map(ord, w)) % (VOCAB - 4) for w in text.split()]

    def token_strings(self, ids) -> list[str]:
        return [f"t{int(i)}" for i in ids]

    def _trace(self, prompt, sites, layers, max_new_tokens, shift=0.0, seed=0) -> FakeTrace:
        ids = self.tokenize(prompt)
        out = [(4 + (i * 3 + len(ids) + int(shift)) % (VOCAB - 4)) for i in range(max_new_tokens)]
        n = len(ids) + max_new_tokens - 1
        g = torch.Generator().manual_seed(len(prompt) + seed)
        layers = list(range(self.n_layers)) if layers is None else list(layers)
        acts = {s: torch.randn(len(layers), n, self.hidden_size, generator=g) + shift
                for s in sites}
        nbytes = sum(a.numel() * 4 for a in acts.values())
        return FakeTrace(
            prompt=prompt, prompt_token_ids=ids, output_token_ids=out,
            tokens=self.token_strings(ids + out[:-1]), output_tokens=self.token_strings(out),
            logprobs=[None] + [-0.5 - 0.1 * i - 0.05 * shift for i in range(n)],
            layers={s: layers for s in sites}, acts=acts,
            copied_bytes=nbytes if self.clone_reads else nbytes // 2,
        )

    @staticmethod
    def _progress(progress, total: int) -> None:
        # what the engine does as requests finish
        if progress is not None:
            for done in range(1, total + 1):
                progress(done, total)

    def trace(self, prompts, *, layers=None, sites=("resid_post",), max_new_tokens=16,
              progress=None, **kw):
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self._record("trace", prompts=prompts, layers=layers, sites=list(sites),
                     max_new_tokens=max_new_tokens, progress=progress, **kw)
        self._progress(progress, len(prompts))
        return FakeRun(self._trace(p, sites, layers, max_new_tokens) for p in prompts)

    def direction(self, positive, negative, *, layer, site="resid_post", position="last",
                  progress=None):
        self._record("direction", positive=list(positive), negative=list(negative),
                     layer=layer, site=site)
        self._progress(progress, len(positive) + len(negative))
        return torch.ones(self.hidden_size)

    def compare(self, prompts, *, steer, max_new_tokens=16, progress=None):
        self._record("compare", prompts=list(prompts), steer=steer,
                     max_new_tokens=max_new_tokens)
        self._progress(progress, 2 * len(prompts))
        base = FakeRun(self._trace(p, ["resid_post"], [self.n_layers - 1], max_new_tokens)
                       for p in prompts)
        steered = FakeRun(self._trace(p, ["resid_post"], [self.n_layers - 1], max_new_tokens,
                                      shift=steer.scale) for p in prompts)
        return FakeComparison(base, steered)

    def sweep(self, prompt, *, steer, scales, max_new_tokens=16, progress=None):
        self._record("sweep", prompt=prompt, steer=steer, scales=list(scales),
                     max_new_tokens=max_new_tokens)
        self._progress(progress, len(scales))
        runs = FakeRun(self._trace(prompt, ["resid_post"], [self.n_layers - 1],
                                   max_new_tokens, shift=x) for x in scales)
        return FakeSweep(list(scales), runs)


@pytest.fixture
def session() -> FakeSession:
    return FakeSession()


@pytest.fixture
def steer_class(monkeypatch):
    """vlens.Steer, or a stand-in while the steering module is absent."""
    if not hasattr(vlens, "Steer"):
        monkeypatch.setattr(vlens, "Steer", FakeSteer, raising=False)
    return vlens.Steer


@pytest.fixture
def lens() -> LogitLens:
    g = torch.Generator().manual_seed(0)
    return LogitLens(torch.ones(HIDDEN), torch.randn(VOCAB, HIDDEN, generator=g), 1e-6)


PROMPT = "the cat sat on"


def _z(fig) -> list:
    return [list(row) for row in fig.data[0].z]


def _shape(fig, name: str):
    return next(s for s in fig.layout.shapes if s.name == name)


# -- pickers ------------------------------------------------------------------


def test_layer_picker_one_layer_and_range():
    one = LayerPicker(4, value=2)
    assert one.value == 2 and one.layers == [2]
    one._slider.value = 3  # as a drag in the browser would
    assert one.value == 3
    one.value = 1
    assert one._slider.value == 1
    rng = LayerPicker(6, value=(1, 3))
    assert rng.is_range and rng.layers == [1, 2, 3]
    rng._slider.value = (0, 5)
    assert rng.value == (0, 5)


def test_layer_picker_refuses_layers_that_do_not_exist():
    picker = LayerPicker(4, value=0)
    with pytest.raises(Exception, match="0..3"):
        picker.value = 4
    with pytest.raises(TypeError):
        LayerPicker(4, valu=1)


def test_site_picker():
    picker = SitePicker(SITES)
    assert picker.value == "resid_post" and list(picker.options) == SITES
    with pytest.raises(ValueError, match="mlp_in"):
        SitePicker(SITES, value="mlp_in")


def test_token_span_picker_selection_is_a_checked_span():
    picker = TokenSpanPicker(["a", "b", "c", "d"], n_prompt=3)
    assert picker.selection == (0, 0)
    picker.select(1)
    assert picker.selection == (1, 2)
    picker.select(1, 4)
    assert picker.selected_tokens == ["b", "c", "d"]
    with pytest.raises(Exception, match="does not fit"):
        picker.selection = (2, 5)
    picker.selection = [0, 2]  # what the browser sends: a list
    assert picker.selection == (0, 2)
    picker.tokens = ["x"]  # a shorter prompt drops a selection that no longer fits
    assert picker.selection == (0, 0)
    with pytest.raises(TypeError):
        TokenSpanPicker(["a"], selected=(0, 1))


def test_token_span_picker_front_end_is_an_es_module_file():
    from pathlib import Path

    import vlens.widgets.token_span as module

    picker = TokenSpanPicker(["a"])
    js = Path(module.__file__).with_name("token_span.js")
    source = js.read_text()
    assert str(TokenSpanPicker._esm) == source  # anywidget loads the file beside it
    assert "export default" in source and "shiftKey" in source
    assert "innerHTML" not in source  # tokens go in as text, never markup
    assert "export default" in picker._esm  # synced to the browser as the module text


def test_clone_reads_toggle_switches_the_session_and_shows_bytes(session):
    toggle = CloneReadsToggle(session)
    assert toggle.value is False and "no run" in toggle._label.value
    toggle._button.value = True  # a click
    assert session.clone_reads is True and toggle.value is True
    run = session.trace(PROMPT, max_new_tokens=4)
    toggle.show_run(run)
    assert toggle.copied_bytes == run.copied_bytes > 0
    assert "KiB" in toggle._label.value or " B " in toggle._label.value
    toggle.value = False
    assert session.clone_reads is False
    assert "next run: clone reads off" in toggle._label.value


# -- activation view ----------------------------------------------------------


def test_activation_view_traces_once_and_replots_from_the_cache(session):
    view = ActivationView(session, PROMPT, layer=1, max_new_tokens=5)
    assert len(session.calls_of("trace")) == 1
    call = session.calls_of("trace")[0]
    assert call["sites"] == SITES and call["layers"] is None and call["max_new_tokens"] == 5
    t = view.run[0]
    heat = view.heatmap.data[0]
    assert list(heat.x) == [f"{i}:{tok}" for i, tok in enumerate(t.tokens)]
    assert list(heat.y) == [f"layer {x}" for x in range(N_LAYERS)]
    assert torch.allclose(torch.tensor(_z(view.heatmap)),
                          t.activations("resid_post").norm(dim=-1))
    assert _shape(view.heatmap, "layer").y0 == 0.5  # row 1 outlined
    strip_before = view.strip.data[0].z

    view.layer = 3
    assert _shape(view.heatmap, "layer").y0 == 2.5
    assert view.strip.data[0].z != strip_before
    assert view.layer_picker.value == 3  # picker follows the trait …
    view.layer_picker.value = 2  # … and the trait follows the picker
    assert view.layer == 2

    before = _z(view.heatmap)
    view.site = "mlp_out"
    assert _z(view.heatmap) != before
    assert torch.allclose(torch.tensor(_z(view.heatmap)),
                          t.activations("mlp_out").norm(dim=-1))
    view.quantity = "neuron"
    view.neuron = 5
    assert torch.allclose(torch.tensor(_z(view.heatmap)), t.activations("mlp_out")[..., 5])
    view.span = (1, 3)
    span = _shape(view.heatmap, "span")
    assert (span.x0, span.x1) == (0.5, 2.5)
    assert len(session.calls_of("trace")) == 1  # never re-ran the engine
    assert view.error == ""


def test_activation_view_shows_a_callback_error_and_keeps_working(session):
    view = ActivationView(session, PROMPT, max_new_tokens=3)
    z_norm = _z(view.heatmap)
    view.quantity = "cosine"  # no direction yet: shown, not raised
    assert "direction" in view.error and view._error_label.value == view.error
    assert view._details.layout.display == ""
    assert _z(view.heatmap) == z_norm  # the last good figure stays
    d = torch.randn(HIDDEN)
    view.direction = d
    assert view.error == "" and view._details.layout.display == "none"
    expected = activation_values(view.run[0].activations("resid_post"), "cosine", direction=d)
    assert torch.allclose(torch.tensor(_z(view.heatmap)), expected, atol=1e-6)


def test_activation_view_engine_error_is_shown(session):
    session.fail_next = vlens.VlensError("prompt 0 is empty")
    view = ActivationView(session, PROMPT)
    assert "prompt 0 is empty" in view.error and view.run is None
    view._trace_button.click()  # the button works after the failure
    assert view.error == "" and view.run is not None
    assert view.busy is False and view._progress_row.layout.display == "none"


def test_activation_view_with_a_run_does_not_trace(session):
    run = session.trace(PROMPT, sites=["resid_post"], layers=[0, 2], max_new_tokens=2)
    view = ActivationView(session, run=run, layer=2)
    assert len(session.calls_of("trace")) == 1
    assert list(view.heatmap.data[0].y) == ["layer 0", "layer 2"]
    view.layer = 1  # not read: an error in the widget, not an exception
    assert "was not read" in view.error


def test_widgets_refuse_misspelled_keywords(session):
    for make in (
        lambda: ActivationView(session, PROMPT, layers=2),
        lambda: LogitLensView(session, PROMPT, layer=1),
        lambda: SteeringPanel(session, PROMPT, scal=2.0),
        lambda: CloneReadsToggle(session, value=True),
        lambda: explore(session, PROMPT, max_tokens=3),
    ):
        with pytest.raises(TypeError):
            make()
    assert session.calls == []


# -- logit lens ---------------------------------------------------------------


def test_logit_lens_view_grid_and_layer_range(session, lens):
    run = session.trace(PROMPT, sites=["resid_post"], max_new_tokens=3)
    view = LogitLensView(session, run=run, lens=lens)
    t = run[0]
    ids, probs = lens.top(t.activations("resid_post"), k=1)
    heat = view.figure.data[0]
    assert list(heat.y) == [f"layer {x}" for x in range(N_LAYERS)]
    assert [list(r) for r in heat.text] == [
        session.token_strings(row) for row in ids[..., 0].tolist()
    ]
    assert torch.allclose(torch.tensor(_z(view.figure)), probs[..., 0])
    view.layers = (1, 2)
    assert list(view.figure.data[0].y) == ["layer 1", "layer 2"]
    assert len(session.calls_of("trace")) == 1
    view.span = (0, 2)
    assert _shape(view.figure, "span").x1 == 1.5


def test_logit_lens_view_traces_with_the_worker_lens(session, lens):
    LogitLensView(session, PROMPT, lens=lens, max_new_tokens=2)
    (call,) = session.calls_of("trace")
    assert call["logit_lens"] == 1 and call["sites"] == ["resid_post"]


# -- steering panel -----------------------------------------------------------


def _panel(session, **kw) -> SteeringPanel:
    kw.setdefault("positive", ["happy a", "happy b"])
    kw.setdefault("negative", ["sad a", "sad b"])
    return SteeringPanel(session, PROMPT, layer=2, max_new_tokens=6, **kw)


def test_steering_panel_run_calls_direction_then_compare(session, steer_class):
    panel = _panel(session)
    assert session.calls == []  # nothing runs until asked
    panel._run_button.click()
    assert panel.error == ""
    (d,) = session.calls_of("direction")
    assert d == {"positive": ["happy a", "happy b"], "negative": ["sad a", "sad b"],
                 "layer": 2, "site": "resid_post"}
    (c,) = session.calls_of("compare")
    st = c["steer"]
    assert isinstance(st, steer_class)
    assert (st.layer, st.scale, st.site, st.span) == (2, 4.0, "resid_post", "all")
    assert c["prompts"] == [PROMPT] and c["max_new_tokens"] == 6
    bars = panel.comparison_figure.data[0]
    frame = panel.comparison.to_frame()
    assert list(bars.x) == frame["position"].tolist()
    expected = (frame["logprob_steered"] - frame["logprob_base"]).tolist()
    assert list(bars.y) == pytest.approx(expected)
    assert "baseline:" in panel._texts.value and "steered:" in panel._texts.value


def test_steering_panel_scale_reruns_with_a_cached_direction(session, steer_class):
    panel = _panel(session)
    panel.run_comparison()
    bars_before = list(panel.comparison_figure.data[0].y)
    panel._scale.value = -6.0  # the slider, released
    assert panel.scale == -6.0
    compares = session.calls_of("compare")
    assert [c["steer"].scale for c in compares] == [4.0, -6.0]
    assert len(session.calls_of("direction")) == 1  # reused
    assert list(panel.comparison_figure.data[0].y) != bars_before
    panel.layer = 1  # a new layer needs a new direction
    panel.run_comparison()
    assert [c["layer"] for c in session.calls_of("direction")] == [2, 1]


def test_steering_panel_span_from_token_chips(session, steer_class):
    panel = _panel(session)
    assert panel.tokens.tokens == session.token_strings(session.tokenize(PROMPT))
    panel.tokens.selection = (1, 3)  # a click and a shift-click
    assert panel.span == (1, 3) and panel.span_mode == "selection"
    panel.run_comparison()
    assert session.calls_of("compare")[-1]["steer"].span == (1, 3)
    panel.tokens.clear()
    assert panel.span_mode == "all"
    panel.span_mode = "generated"
    panel.run_comparison()
    assert session.calls_of("compare")[-1]["steer"].span == "generated"


def test_steering_panel_sweep_and_metric(session, steer_class):
    panel = _panel(session, scales=(-4, 0, 4, 8), token_set="a b")
    panel._sweep_button.click()
    assert panel.error == ""
    (sw,) = session.calls_of("sweep")
    assert sw["scales"] == [-4, 0, 4, 8] and sw["prompt"] == PROMPT
    line = panel.dose_figure.data[0]
    assert list(line.x) == [-4, 0, 4, 8]
    assert list(line.y) == [1.0, 0.0, 1.0, 2.0]  # kl_mean
    assert "share_token_set" in panel._metric.options  # the fake has no vocab logprobs
    panel.metric = "mean_logprob"
    assert list(panel.dose_figure.data[0].y) == pytest.approx([-1.4, -1.0, -1.4, -1.8])
    assert panel.dose_figure.layout.yaxis.title.text == "mean_logprob"
    assert len(session.calls_of("sweep")) == 1  # a metric change re-plots only


def test_steering_panel_errors_are_shown(session, steer_class):
    panel = SteeringPanel(session, PROMPT)
    panel._run_button.click()
    assert "positive" in panel.error  # no prompt lists yet
    panel.source = "vector"
    panel._run_button.click()
    assert "vector" in panel.error
    panel.vector = torch.ones(HIDDEN) * 2
    assert "norm 5.66" in panel._vector_label.value
    panel._run_button.click()
    assert panel.error == ""
    assert torch.equal(session.calls_of("compare")[-1]["steer"].vector, panel.vector)
    session.fail_next = vlens.VlensError("steer layer 9 does not exist")
    panel._sweep_button.click()
    assert "layer 9" in panel.error and not panel.busy


def test_engine_runs_show_progress(session, steer_class):
    panel = _panel(session, scales=(0, 2, 4))
    seen = []
    panel._progress.observe(lambda c: seen.append((c["new"], panel._progress.max)),
                            names="value")
    shown = []
    panel._progress_row.layout.observe(lambda c: shown.append(c["new"]), names="display")
    panel.sweep()
    assert (3, 3) in seen  # the bar reached the end of the sweep's 3 requests
    assert shown[0] == "" and shown[-1] == "none"  # shown while running, hidden after
    assert session.calls_of("trace") == []
    ActivationView(session, PROMPT)
    assert callable(session.calls_of("trace")[0]["progress"])


def test_steering_panel_loads_a_saved_vector(session, steer_class, tmp_path):
    path = tmp_path / "v.pt"
    torch.save(torch.arange(HIDDEN, dtype=torch.float32), path)
    panel = SteeringPanel(session, PROMPT)
    panel._path.value = str(path)
    panel._load.click()
    assert panel.source == "vector" and torch.equal(panel.vector, torch.arange(8.0))
    assert panel._lists.layout.display == "none"


# -- explorer -----------------------------------------------------------------


def test_explore_shares_one_layer_and_span(session, steer_class, lens):
    ex = explore(session, PROMPT, max_new_tokens=4, lens=lens,
                 positive=["good"], negative=["bad"])
    assert len(session.calls_of("trace")) == 1  # one trace feeds every view
    assert ex.error == "" and ex.activations.error == "" and ex.logit_lens.error == ""
    t = ex.run[0]
    assert ex.tokens.tokens == t.tokens and ex.tokens.n_prompt == len(t.prompt_token_ids)
    assert ex.activations.run is ex.run and ex.logit_lens.run is ex.run

    ex.activations.layer_picker.value = 3  # one picker moves them all
    assert ex.layer == 3 and ex.steering.layer == 3
    assert _shape(ex.activations.heatmap, "layer").y0 == 2.5

    ex.tokens.selection = (2, 5)  # clicks on the explorer's chips
    for view in (ex.activations, ex.logit_lens, ex.steering):
        assert view.span == (2, 5)
    assert _shape(ex.activations.heatmap, "span").x0 == 1.5
    assert _shape(ex.logit_lens.figure, "span").x1 == 4.5

    ex.steering.run_comparison()
    assert session.calls_of("compare")[-1]["steer"].span == (2, 5)
    assert session.calls_of("compare")[-1]["steer"].layer == 3
    assert ex.clone_reads.copied_bytes == ex.steering.run.copied_bytes
    assert len(session.calls_of("trace")) == 1


def test_explorer_trace_button_retraces(session, lens):
    ex = explore(session, PROMPT, max_new_tokens=3, lens=lens)
    ex.tokens.selection = (0, 2)
    ex._prompt.value = "a longer prompt with more words"
    ex._trace_button.click()
    assert [c["prompts"] for c in session.calls_of("trace")] == [
        [PROMPT], ["a longer prompt with more words"]]
    assert ex.span == (0, 0)
    assert len(ex.tokens.tokens) == ex.run[0].n_tokens


def test_import_vlens_does_not_load_widget_libraries():
    code = (
        "import sys, vlens\n"
        "heavy = [m for m in ('ipywidgets', 'anywidget', 'plotly', 'vlens.widgets', 'vllm')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
