"""FigureView, the figure every vlens view draws in, from Python (no browser).

What the page gets: the figure as strict JSON (no NaN), a small front-end
module (not plotly.js), and a name for the one shared plotly.js model. What
Python gets back: a click on a point reaches the trace's ``on_click``
callbacks as plotly's ``Points``. The browser half is tests/test_run_all.py
and tests/test_browser.py.
"""

from __future__ import annotations

import json
import math

import plotly.graph_objects as go
import pytest

pytest.importorskip("anywidget")

from vlens.widgets import FigureView  # noqa: E402
from vlens.widgets.figure import PlotlyLibrary, plotly_library  # noqa: E402
from vlens.widgets.snapshot import render  # noqa: E402


def _heat() -> go.Figure:
    fig = go.Figure(go.Heatmap(z=[[1.0, math.nan], [3.0, 4.0]], x=["a", "b"], y=["r0", "r1"]))
    fig.update_layout(title="grid")
    return fig


def test_a_figure_view_sends_its_figure_not_plotly_js():
    view = FigureView(height=320)
    state = view.get_state()
    assert json.loads(state["figure_json"]).get("data", []) == []
    # the front end is the small figure.js, not the 5 MB plotly.js bundle
    assert len(state["_esm"]) < 20_000 and "Plotly.react" in state["_esm"]
    view.show(_heat())
    sent = json.loads(view.get_state()["figure_json"])  # strict JSON: NaN is null
    assert sent["data"][0]["z"] == [[1.0, None], [3.0, 4.0]]
    assert sent["layout"]["title"]["text"] == "grid" and sent["layout"]["height"] == 320
    assert view.layout.title.text == "grid" and len(view.data) == 1
    assert view.figure.data[0].type == "heatmap"


def test_every_figure_view_names_one_shared_plotly_library():
    a, b = FigureView(), FigureView()
    lib = plotly_library()
    assert isinstance(lib, PlotlyLibrary)
    assert a.library == b.library == f"anywidget:{lib.model_id}"
    assert lib.source.startswith("/**\n* plotly.js") and len(lib.source) > 1_000_000
    lib.close()  # a closed library (a restarted front end) is made again
    c = FigureView()
    assert c.library != a.library and plotly_library().comm is not None


def test_a_click_in_the_page_reaches_the_traces_callbacks():
    view = FigureView(_heat())
    got = []
    view.data[0].on_click(lambda trace, points, state: got.append(
        (trace.type, points.point_inds, points.xs, points.trace_index)))
    view._on_message(view, {"event": "click",
                            "points": [{"trace": 0, "index": [1, 0], "x": "a", "y": "r1"}]}, [])
    assert got == [("heatmap", [[1, 0]], ["a"], 0)]
    # anything else the page might send is ignored, not raised
    view._on_message(view, {"event": "click", "points": [{"trace": 7, "index": 0}]}, [])
    view._on_message(view, {"event": "other"}, [])
    view._on_message(view, "not a dict", [])
    assert len(got) == 1


def test_show_replaces_the_figure_in_place_and_keeps_the_height():
    view = FigureView(height=300)
    view.show(_heat())
    view.show(go.Figure(go.Bar(x=["x"], y=[2])))
    assert [t.type for t in view.data] == ["bar"] and view.layout.height == 300
    assert view.layout.title.text is None


def test_a_figure_view_is_saved_in_snapshots_and_an_empty_one_is_not():
    assert render(FigureView()) == ""
    html = render(FigureView(_heat()))
    assert "vl-figure" in html and '"heatmap"' in html


def test_every_vlens_anywidget_is_listed_in_the_page_registry_while_it_lives():
    """The page's long work waits for the models the kernel lists
    (vlens/widgets/_page.py): each vlens anywidget is listed from the moment
    it is made (its key in its own first state) until it is closed, in the
    kernel's one registry, which every one of them names."""
    from vlens.widgets._page import PageRegistry, page_registry
    from vlens.widgets.branches import BranchTokens
    from vlens.widgets.token_span import TokenSpanPicker

    made = [FigureView(_heat()), TokenSpanPicker(["a", "b"]), BranchTokens(tokens=["x"])]
    registry = page_registry()
    assert isinstance(registry, PageRegistry)
    keys = [m.get_state()["_start_key"] for m in made]
    assert len(set(keys)) == 3 and all(len(k) == 32 for k in keys)
    assert {m.get_state()["_page"] for m in made} == {f"anywidget:{registry.model_id}"}
    assert registry.live[-3:] == keys  # in the order made
    sent = registry.get_state()  # a whole widget state (ipywidgets' own traits kept)
    assert sent["_model_name"] == "WidgetModel" and sent["live"] == registry.live
    made[1].close()
    assert keys[1] not in registry.live and keys[0] in registry.live and keys[2] in registry.live
    for m in (made[0], made[2]):
        m.close()
    assert not set(keys) & set(registry.live)
    # the front ends mark their key started when anywidget starts them
    for m in made:
        assert "initialize" in m._esm and "_start_key" in m._esm
