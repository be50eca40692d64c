"""Every notebook, run top to bottom against ``vlens serve`` (a workshop).

docs/workshop.md tells a class to point the notebooks at one server: the
parameters ``SERVER`` and ``TOKEN`` (or ``$VLENS_SERVER``/``$VLENS_TOKEN``).
Here each notebook runs in a fresh kernel (nbclient) with those two set in a
cell put after its parameters cell, as papermill does. Three servers answer:
the bundled model with its SAE (``--sae toyworld=...``, for 08_features),
the bundled chat model (07_chat) and SmolLM2-135M-Instruct by its registry
name with its shipped SAE (11_real_model, whose kernel reads the same
fetched weights for its lens and twin, and 12_real_features); the last two
start only when a notebook needs them. A
notebook passes when every cell ran without an error, no Session in its
kernel started an engine of its own or imported vLLM (a participant's
laptop may have none), and the server finished calls for it.
Notebooks whose parameters size their work run smaller here (``SMALLER``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from test_serve import _Server  # noqa: I001 - the suite's server subprocess

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 600
# a participant's limits, not test_serve.py's tight ones (later flags win)
ROOMY = ("--enforce-eager", "--max-body-mb", "64", "--max-read-mb", "256",
         "--max-concurrent", "4", "--body-timeout", "30", "--stall-timeout", "30")


# put in after the parameters cell: what a workshop participant sets, and a
# tripwire on the one way a notebook could start an engine of its own
_CONNECT = """\
SERVER = {url!r}
TOKEN = {token!r}
import vlens.session as _vs
_LOCAL_STARTS = []
_start_here = _vs.Session.__init__
def _counted_start(self, *args, **kwargs):
    _LOCAL_STARTS.append(args)
    _start_here(self, *args, **kwargs)
_vs.Session.__init__ = _counted_start
"""

# what a connected run checks is the wire (every call a notebook makes, over
# the server, within its limits), not the lesson's statistics: the notebooks
# whose parameters size their work run it smaller here (Run All, in
# tests/test_run_all.py, runs them as shipped). 06's head sweep is still
# 288 requests, over the server's 256 a call.
SMALLER = {
    "02_steering": "N_HELD_OUT = 10",
    "06_attention": "N_PROBES = 4",
    "08_features": "N_HELD_OUT = 8",
    "11_real_model": "N_HELD_OUT = 2",
    "12_real_features": "HARVEST_TOKENS = 1200\nCLAMP_TOKENS = 300",
}

# put in last: the kernel's sessions were all connected
_CHECK = """\
from vlens.session import Session as _Session
_sessions = [v for v in list(globals().values()) if isinstance(v, _Session)]
assert _sessions, "no Session in the notebook"
assert not _LOCAL_STARTS, f"a local engine started: {_LOCAL_STARTS}"
assert all(v._runner._shared.engine.remote for v in _sessions)
import sys as _sys
_vllm = sorted(m for m in _sys.modules if m.split(".")[0] == "vllm")
assert not _vllm, f"the connected kernel imported vLLM: {_vllm[:5]}"
print("connected sessions:", len(_sessions))
"""


def _started(srv: _Server, tokens_of: _Server | None = None) -> _Server:
    """``srv`` running, on the token file of ``tokens_of`` (one file for all
    of a workshop's servers)."""
    if tokens_of is not None:
        srv.tokens = tokens_of.tokens
        srv.token_file.write_text(tokens_of.token_file.read_text())
    try:
        srv.start()
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def world_server(tmp_path_factory):
    """The bundled model, serving its SAE as ``toyworld`` (08_features)."""
    from vlens.models import toyworld_sae_path

    srv = _started(_Server(tmp_path_factory.mktemp("world"),
                           ROOMY + ("--sae", f"toyworld={toyworld_sae_path()}")))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory, world_server):
    """The bundled chat model (07_chat), started only when 07 runs, on the
    toy world's token file."""
    from vlens.models import toychat_path

    srv = _started(_Server(tmp_path_factory.mktemp("chat"), (str(toychat_path()), *ROOMY)),
                   world_server)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory, world_server, smollm2_folder, vlens_home):
    """SmolLM2-135M-Instruct served by its registry name with the SAE vlens
    ships for it, as docs/workshop.md says for 11_real_model and
    12_real_features (``vlens serve smollm2-135m-instruct --sae
    smollm2-135m-instruct-sae=PATH``, fetched into ``vlens_home``), started
    only when one of them runs, on the toy world's token file; a KV cache for
    the notebooks' batches (later flags win)."""
    from vlens.models import registry

    sae = registry.get("smollm2-135m-instruct-sae")  # shipped in the package: no fetch
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLENS_HOME", str(vlens_home))
        srv = _started(_Server(tmp_path_factory.mktemp("smollm2"), (
            "smollm2-135m-instruct", *ROOMY, "--max-model-len", "512",
            "--kv-cache-memory-bytes", str(512 * 2**20),
            "--sae", f"smollm2-135m-instruct-sae={sae}")), world_server)
    yield srv
    srv.stop()


def _with_server(book, url: str, token: str, extra: str = "") -> None:
    """Papermill's way: a cell after the parameters cell overrides them."""
    import nbformat

    at = next(i for i, c in enumerate(book.cells)
              if "parameters" in c.get("metadata", {}).get("tags", []))
    book.cells.insert(at + 1, nbformat.v4.new_code_cell(
        extra + _CONNECT.format(url=url, token=token)))
    book.cells.append(nbformat.v4.new_code_cell(_CHECK))


def test_open_session_connects_when_a_server_is_named(monkeypatch):
    """A named server (argument or $VLENS_SERVER) means connect, never a
    local engine: an unreachable one is the connection's error at once."""
    import vlens
    from vlens._open import server_from_env

    monkeypatch.setenv("VLENS_SERVER", " http://127.0.0.1:9 ")
    assert server_from_env() == "http://127.0.0.1:9"
    assert server_from_env("http://other:1") == "http://other:1"
    monkeypatch.setenv("VLENS_SERVER", "  ")
    assert server_from_env() is None
    monkeypatch.delenv("VLENS_TOKEN", raising=False)
    with pytest.raises(vlens.VlensError, match="needs token"):
        vlens.open_session(server="http://127.0.0.1:9")
    with pytest.raises(vlens.VlensError, match="not answering"):
        # a model that is not there: a local start would fail on it instead
        vlens.open_session("/no/such/model", server="http://127.0.0.1:9", token="t")


def test_a_call_over_the_servers_limits_goes_as_several():
    """A patching grid or a head sweep can hold more requests or vectors
    than one call may: the connection cuts it in order, each part with the
    vectors its requests name. Requests come as the runner makes them for a
    connected session: the wire's dicts of sampling settings."""
    from vlens.remote.client import RemoteEngine

    engine = RemoteEngine.__new__(RemoteEngine)  # its slicing only: no server
    engine.limits = {"requests": 3, "vectors": 2}
    engine._held = {"a": "A", "b": "B", "c": "C"}

    def naming(*ids):
        return engine.request_params({"extra_args": {"plan": {"adds": [{"vec": v} for v in ids]}}})

    params = [naming("a"), naming("b"), naming("c"), naming(), naming(), naming(), naming("a")]
    got = engine._slices([{}] * len(params), params)
    assert [(start, stop) for start, stop, _ in got] == [(0, 2), (2, 5), (5, 7)]
    assert [sorted(v) for _, _, v in got] == [["a", "b"], ["c"], ["a"]]
    engine.limits = {"requests": 256, "vectors": 64}  # within the limits: one call, as before
    assert engine._slices([{}] * len(params), params) == [(0, 7, engine._held)]
    # log-probabilities count against the read limit as the server counts them:
    # 4 bytes x the vocabulary for every row that asks (a real model's sweep)
    engine.info = {"vocab_size": 1000}
    engine.limits = {"requests": 256, "vectors": 64, "read_bytes": 4 * 1000 * 10}  # 10 rows
    prompts = [{"prompt_token_ids": [1, 2, 3]}] * 5
    generated = [{"max_tokens": 4, "logprobs": 0} for _ in prompts]  # 4 rows each
    assert [(a, b) for a, b, _ in engine._slices(prompts, generated)] == [(0, 2), (2, 4), (4, 5)]
    with_prompt = [{"max_tokens": 2, "logprobs": 0, "prompt_logprobs": 0}] * 3  # 3 + 2
    assert [(a, b) for a, b, _ in engine._slices(prompts[:3], with_prompt)] == [(0, 2), (2, 3)]
    sampled = [{"max_tokens": 2, "n": 3, "logprobs": 0}] * 2  # n samples: 6 rows each
    assert [(a, b) for a, b, _ in engine._slices(prompts[:2], sampled)] == [(0, 1), (1, 2)]
    plain = [{"max_tokens": 4} for _ in prompts]  # no log-probabilities asked
    assert [(a, b) for a, b, _ in engine._slices(prompts, plain)] == [(0, 5)]
    from vlens.remote.guard import Limits
    assert "read_bytes" in Limits().public()  # the name the server gives it


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
# with tests/test_run_all.py: the notebooks run one after another in one
# process while the other test process takes the rest of the suite
@pytest.mark.engine
@pytest.mark.xdist_group("run-all")
def test_notebook_runs_connected(world_server, request, path, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    srv = request.getfixturevalue("chat_server") if path.stem == "07_chat" else world_server
    if path.stem in ("11_real_model", "12_real_features"):
        srv = request.getfixturevalue("smollm2_server")
        # its kernel reads the weights too (11: the exact logit lens, the twin;
        # 12: the corpus, the SAE's measured.json): the same cache
        monkeypatch.setenv("VLENS_HOME", str(request.getfixturevalue("vlens_home")))
        if path.stem == "12_real_features":
            request.getfixturevalue("moby_dick_folder")
    before = srv.status()["calls_done"]
    book = nbformat.read(path, as_version=4)
    # 10_what_if diffs two models: the chat model's server beside the story's
    extra = (f"CHAT_SERVER = {request.getfixturevalue('chat_server').url!r}\n"
             if path.stem == "10_what_if" else "")
    smaller = SMALLER.get(path.stem, "")
    # each name SMALLER sets is one of the notebook's parameters (a renamed one
    # would otherwise leave the run at full size, unnoticed)
    params = next(c.source for c in book.cells
                  if "parameters" in c.get("metadata", {}).get("tags", []))
    names = [line.split("=")[0].strip() for line in smaller.splitlines()]
    unknown = [n for n in names if not re.search(rf"^{n} = ", params, re.MULTILINE)]
    assert not unknown, f"SMALLER sets what {path.name}'s parameters lack: {unknown}"
    _with_server(book, srv.url, srv.tokens["c1"], extra + smaller + "\n")
    t0 = time.monotonic()
    NotebookClient(book, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    took = time.monotonic() - t0
    print(f"{path.name}: {took:.0f} s connected")

    errors = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    unrun = [c.source[:40] for c in book.cells
             if c.cell_type == "code" and not c.get("execution_count")]
    assert not unrun, unrun
    last = "".join(o.get("text", "") for o in book.cells[-1].outputs)
    assert "connected sessions:" in last, last
    assert srv.status()["calls_done"] > before  # the server did the notebook's work
