"""The performance benchmark (benchmarks/run.py), made small enough for the
test suite so that it cannot rot: every condition runs and produces figures,
and the report renders. How fast anything was is not asserted here; that is
what docs/performance.md is for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

VLENS_KEYS = ["a", "b", "c", "d", "e", "f", "g", "h", "i_read", "i_edit_off", "i_edit_on"]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import report
        import run

        yield run, report
    finally:
        sys.path.remove(str(BENCH))


def test_options_name_the_conditions(bench):
    run, _ = bench
    args = run.parse_args(["--model", "somewhere", "--only", "c,h"])
    assert args.keys == ["a", "c", "h"]  # every ratio needs (a)
    assert args.doc is None  # a custom model leaves the doc alone
    gpu = run.parse_args(["--device-check"])
    assert gpu.reps == 3 and gpu.json.name == "results-gpu.json"
    with pytest.raises(SystemExit):
        run.parse_args(["--only", "c,zz"])


def test_report_says_what_is_pending(bench):
    _, report = bench
    text = report.render(None, None)
    assert "## GPU figures" in text and "--device-check" in text
    assert "Pending" in text


@pytest.mark.engine
def test_small_run_produces_every_figure(bench, tiny_llama, tmp_path):
    run, _ = bench
    out, doc = tmp_path / "results.json", tmp_path / "performance.md"
    results = run.main([
        "--model", str(tiny_llama), "--prompts", "4", "--tokens", "4", "--reps", "1",
        "--slow-reps", "1", "--no-nnsight", "--no-widgets", "--kv-cache-mb", "64",
        "--max-model-len", "128", "--json", str(out), "--doc", str(doc),
    ])
    assert results["complete"], "a run produced fewer tokens than asked"
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (model,) = results["models"]
    conds = model["conditions"]
    assert set(conds) == set(VLENS_KEYS) | {"j"}, model.get("errors")
    for key, entry in conds.items():
        assert entry["reps"] == 1 and entry["tokens"] == 4 * 4, key
        assert entry["tok_s"]["median"] > 0, key
        if key != "a":
            assert entry["ratio_to_a"]["median"] > 0, key
    for key in ("c", "d", "e", "f", "g", "h"):
        w = conds[key]["worker"]
        assert w["planned_steps_per_run"] > 0 and w["sites_per_step"] > 0, key
    assert conds["b"]["worker"]["planned_steps_per_run"] == 0  # idle: no plan
    assert conds["f"]["copied_bytes"] > 0 and conds["i_read"]["copied_bytes"] > 0
    assert conds["i_edit_on"]["clone_bytes"] > 0
    assert conds["e"]["ratio_to_c"] and conds["j"]["ratio_to_c"]
    assert model["agreement"]["c_vs_j"]["of"] == 4
    text = doc.read_text()
    for row in ("| (a) |", "| (h) |", "| (i) |", "| (j) |"):
        assert row in text
    assert "Inside the worker (k)" in text and "## GPU figures" in text
