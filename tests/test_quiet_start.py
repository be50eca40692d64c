"""A Session starts quietly in a notebook: one summary line, none of vLLM's
log, Python warnings or C++ notes, and calls print nothing either; with
``verbose=True`` vLLM's log is back. vLLM's errors still surface.

The engine tests run one notebook in one kernel (as tests/test_notebooks.py
runs them), so they see what ipykernel forwards to a cell: ``sys.stdout``,
``sys.stderr`` and the process's own file descriptors 1 and 2. Two engine
starts in all. The rest check vlens/engine/quiet.py's pieces directly.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
CELL_TIMEOUT = 600  # an engine start on a busy 2-core machine

SUMMARY = re.compile(r"^vlens: toyworld · native · eager · KV [\d,]+ tokens \([\d.]+ [KMG]iB\)"
                     r" · started in [\d.]+ s$")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

CELLS = {
    "start": "import vlens\ns = vlens.Session()",
    "trace": 'run = s.trace("the cat", max_new_tokens=2)\n'
             'parts = list(s.stream("the cat", max_new_tokens=2))',
    "share": "s_shared = vlens.Session()",
    "fails": "try:\n    vlens.Session(reuse=False, max_model_len=100_000)\n"
             "except Exception as exc:\n    print('RAISED', type(exc).__name__, exc)",
    "verbose": "s_verbose = vlens.Session(reuse=False, verbose=True)",
}


def _lines(cell) -> list[str]:
    """Every non-empty line the cell showed: streams and displays alike."""
    text = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            text.append(out.get("text", ""))
        elif out.get("output_type") == "error":
            text.append(f"{out.get('ename')}: {out.get('evalue')}")
        else:
            text.append(out.get("data", {}).get("text/plain", ""))
    plain = _ANSI.sub("", "\n".join(text))  # vLLM colours its log in a notebook
    return [ln for ln in plain.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def cells():
    from vlens.models import toyworld_path

    try:
        toyworld_path()
    except FileNotFoundError as exc:
        pytest.skip(f"no bundled model: {exc}")
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_code_cell(src) for src in CELLS.values()]
    # The kernel's environment as a user's is: vLLM's own log level (the
    # suite's conftest sets WARNING for its process; verbose=True must bring
    # back the INFO lines), and no PYTEST_CURRENT_TEST, under which ipykernel
    # leaves file descriptors 1 and 2 alone instead of forwarding what C++
    # code writes there into the cell as it does in Jupyter.
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_LOGGING_LEVEL", "VLENS_VERBOSE", "PYTEST_CURRENT_TEST")}
    client = nbclient.NotebookClient(book, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}},
                                     allow_errors=False)
    client.execute(env=env)
    return {name: _lines(cell) for name, cell in zip(CELLS, book.cells)}


@pytest.mark.engine
def test_a_new_engine_prints_one_summary_line(cells):
    lines = cells["start"]
    assert len(lines) <= 3, lines
    assert any(SUMMARY.match(ln) for ln in lines), lines


@pytest.mark.engine
def test_calls_print_nothing(cells):
    assert cells["trace"] == []


@pytest.mark.engine
def test_a_shared_engine_says_so_in_one_line(cells):
    assert cells["share"] == ["vlens: toyworld · sharing the live engine (reuse=False "
                              "starts another)"]


@pytest.mark.engine
def test_a_failed_start_still_raises_vllms_message(cells):
    text = "\n".join(cells["fails"])
    assert "RAISED" in text and "max_model_len" in text, text
    assert "INFO" not in text, text


@pytest.mark.engine
def test_verbose_brings_vllms_log_back(cells):
    lines = cells["verbose"]
    assert any(" INFO " in ln and "[" in ln for ln in lines), lines[:20]
    assert len(lines) > 10, lines
    assert any(SUMMARY.match(ln) for ln in lines), lines[-5:]


# -- the pieces, without an engine ---------------------------------------------

def test_a_quiet_start_shows_errors_and_vlens_warnings_only(capfd, caplog):
    import logging
    import warnings

    from vlens.engine.quiet import quiet_start
    from vlens.errors import VlensWarning

    log = logging.getLogger("vlens_test_quiet.lib")
    with caplog.at_level(logging.INFO, logger="vlens_test_quiet"):
        with quiet_start(single_process=True):
            os.write(2, b"a C++ note\n")
            log.info("chatter")
            log.warning("noise")
            log.error("a real error")
            warnings.warn("old API", FutureWarning)
        assert [r.getMessage() for r in caplog.records] == ["a real error"]
        with pytest.warns(VlensWarning, match="for the user"):
            with quiet_start(single_process=True):
                warnings.warn("for the user", VlensWarning)
    assert logging.root.manager.disable == logging.NOTSET
    out, err = capfd.readouterr()
    assert "C++ note" not in err and "old API" not in err
    # what a failed start wrote to fd 2 is shown, and its exception goes on
    with pytest.raises(RuntimeError, match="no engine"):
        with quiet_start(single_process=True):
            os.write(2, b"the C++ cause\n")
            raise RuntimeError("no engine")
    assert "the C++ cause" in capfd.readouterr().err
    with quiet_start(single_process=True):  # an error line is shown even so
        os.write(2, b"x ERROR 12-03 [core.py:1] broke\n")
    assert "broke" in capfd.readouterr().err


def test_quiet_calls_drop_vllms_warnings_and_log_but_not_the_users():
    import logging
    import warnings

    from vlens.engine.quiet import quiet_calls

    vllm_log = logging.getLogger("vllm")
    before = vllm_log.level
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_calls():
            assert not vllm_log.isEnabledFor(logging.WARNING)
            assert vllm_log.isEnabledFor(logging.ERROR)
            warnings.warn_explicit("raw prompts are deprecated", DeprecationWarning,
                                   "engine.py", 1, module="vllm.v1.engine")
            warnings.warn_explicit("a vLLM note", UserWarning, "x.py", 1, module="vllm.x")
            warnings.warn("the user's own", UserWarning)
            warnings.filterwarnings("ignore", message="set meanwhile")  # as another thread may
        warnings.warn_explicit("outside", UserWarning, "x.py", 2, module="vllm.x")
        assert warnings.filters[0][1].pattern == "set meanwhile"  # kept; vlens's are gone
        assert not any(str(getattr(f[3], "pattern", f[3])).startswith("vllm")
                       for f in warnings.filters)
    assert [str(w.message) for w in caught] == ["the user's own", "outside"]
    assert vllm_log.level == before


def test_summary_line_names_route_mode_and_kv():
    from vlens.engine.quiet import summary_line

    info = {"impl": "transformers", "compiled": True, "kv_cache_blocks": 100,
            "kv_block_size": 16, "kv_cache_bytes": 48 * 2**20}
    assert summary_line("gpt2", info, 3.04) == (
        "vlens: gpt2 · Transformers backend · compiled · KV 1,600 tokens (48 MiB) · "
        "started in 3.0 s")
    assert summary_line("m", {"impl": "native"}, None) == "vlens: m · native · eager"


def test_verbose_is_checked_and_not_passed_to_vllm(monkeypatch):
    import vlens
    from vlens.engine import engine as engine_mod
    from vlens.errors import VlensError

    with pytest.raises(VlensError, match="verbose"):
        vlens.Session(verbose="yes")
    seen = {}

    def fake_start(self, checkpoint):
        seen["verbose"], seen["kwargs"] = self.verbose, dict(self.llm_kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_mod.Engine, "_start", fake_start)
    with pytest.raises(RuntimeError, match="stop here"):
        vlens.Session(reuse=False, verbose=True, max_model_len=64)
    assert seen == {"verbose": True, "kwargs": {"max_model_len": 64, "dtype": "float32"}}


def test_processes_a_quiet_start_makes_get_the_quiet_variables(monkeypatch):
    from vlens.engine.quiet import quiet_start

    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    monkeypatch.setenv("TORCH_LOGS", "+dynamo")  # the user's: kept
    with quiet_start(single_process=False):
        assert "ignore::FutureWarning" in os.environ["PYTHONWARNINGS"]
        assert os.environ["TORCH_LOGS"] == "+dynamo"
    assert "PYTHONWARNINGS" not in os.environ and os.environ["TORCH_LOGS"] == "+dynamo"
    with quiet_start(single_process=True):  # no other process: nothing to set
        assert "PYTHONWARNINGS" not in os.environ
