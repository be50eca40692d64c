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
    assert args.keys == ["a", "c", "h", "h_floor"]  # every ratio needs its references
    assert args.doc is None  # a custom model leaves the doc alone
    comp = run.parse_args(["--only", "c_comp,p_f_off,k256"])
    assert comp.keys == ["a", "a_star", "c_comp", "a_off", "p_a", "p_a_off", "p_f_off",
                         "k32", "k256"]
    assert not comp.no_compiled and not comp.no_cache_off and comp.long_prompts
    off = run.parse_args(["--no-compiled", "--no-cache-off", "--no-long"])
    assert not set(off.keys) & set(run.COMPILED_KEYS) and "c_off" not in off.keys
    assert not any(k.startswith("p_") for k in off.keys) and "i_edit_off" in off.keys
    gpu = run.parse_args(["--device-check"])
    assert gpu.reps == 3 and gpu.json.name == "results-gpu.json"
    with pytest.raises(SystemExit):
        run.parse_args(["--only", "c,zz"])


def test_report_says_what_is_pending(bench):
    _, report = bench
    text = report.render(None, None)
    assert "## GPU figures" in text and "--device-check" in text
    assert "Pending" in text


# every condition of one run without the compiled engines (each compiles for
# ~30 s; `make bench` measures them)
SMOKE_KEYS = set(VLENS_KEYS) | {"j", "h_floor", "a_off", "c_off", "f_off", "p_a", "p_c", "p_f",
                                "p_a_off", "p_c_off", "p_f_off", "k32", "k256", "sae", "sae_hf"}
# a steer-only trace on a warm prefix cache still fails in vlens (issue 10,
# finding 3); the benchmark reports it as "did not run" instead of stopping
MAY_FAIL = {"p_c"}


@pytest.mark.engine
def test_small_run_produces_every_figure(bench, tiny_llama, tmp_path):
    run, _ = bench
    out, doc = tmp_path / "results.json", tmp_path / "performance.md"
    results = run.main([
        "--model", str(tiny_llama), "--prompts", "4", "--tokens", "4", "--reps", "1",
        "--slow-reps", "1", "--no-nnsight", "--no-widgets", "--no-serve", "--kv-cache-mb", "64",
        "--max-model-len", "256", "--no-compiled", "--wide", "12", "--k-tokens", "3",
        "--long-tokens", "3", "--json", str(out), "--doc", str(doc),
    ])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (model,) = results["models"]
    conds, errors = model["conditions"], model["errors"]
    assert set(errors) <= MAY_FAIL, errors
    assert all(e.startswith("EngineError") for e in errors.values()), errors
    assert set(conds) | set(errors) == SMOKE_KEYS, model.get("errors")
    assert results["complete"], "a run produced fewer tokens than asked"
    assert results["serve"] == {"status": "skipped", "why": "--no-serve"}
    for key, entry in conds.items():
        assert entry["reps"] == 1, key
        if key == "h_floor":
            assert entry["macs"] > 0 and entry["ratio_to_a"]["median"] >= 1
            continue
        assert entry["tokens"] == {"k256": 12 * 3, "k32": 4 * 3}.get(
            key, 4 * 3 if key.startswith("p_") else 4 * 4), key
        assert entry["tok_s"]["median"] > 0, key
        if key != "a":
            assert entry["ratio_to_a"]["median"] > 0, key
    for key in ("c", "d", "e", "f", "g", "h", "c_off", "f_off", "p_f", "k32", "k256"):
        w = conds[key]["worker"]
        assert w["planned_steps_per_run"] > 0 and w["sites_per_step"] > 0, key
    assert conds["b"]["worker"]["planned_steps_per_run"] == 0  # idle: no plan
    assert conds["f"]["copied_bytes"] > 0 and conds["i_read"]["copied_bytes"] > 0
    assert conds["i_edit_on"]["clone_bytes"] > 0
    assert conds["e"]["ratio_to_c"] and conds["j"]["ratio_to_c"]
    assert conds["h"]["ratio_to_floor"]["median"] > 0
    assert conds["c_off"]["ratio_to_a_off"] and conds["p_f_off"]["ratio_to_p_a"]
    steps = model["step_costs"]["eager"]
    assert steps["sites_per_step"] == 8 and steps["wide"]["layout_us"] > 0
    decode = steps["decode"]  # the decode steps alone: fewer, each cheaper than a prefill's
    assert 0 < decode["wide"]["steps"] < steps["wide"]["steps"]
    wide = decode["wide"]
    assert 0 < wide["site_us"] and 0 <= wide["reduce_us"] < wide["site_us"]
    # features: vlens's top-32 read in the worker and the SAELens way (HF + encode)
    assert conds["sae"]["worker"]["planned_steps_per_run"] > 0
    assert conds["sae"]["copied_bytes"] > 0 and conds["sae_hf"]["encoded_rows"] > 0
    assert conds["sae_hf"]["ratio_to_sae"]["median"] > 0
    assert model["agreement"]["c_vs_j"]["of"] == 4
    text = doc.read_text()
    for row in ("| (a) |", "| (h) |", "| (i) |", "| (j) |", "| (c, off) |", "| (p: f) |",
                "| eager | every planned step | 8 |", "| eager | decode steps | 8 |",
                "| (h, floor) |", "| (sae) |", "| (sae_hf) |"):
        assert row in text, row
    assert "Inside the worker (k)" in text and "## GPU figures" in text
    assert "## Compiled mode" in text and "prefix cache" in text
