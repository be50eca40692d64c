"""`import vlens` is cheap and side-effect free; the pure leaves load alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _modules_after(code: str) -> dict:
    probe = code + "\nimport json, os, sys\nprint(json.dumps({'mods': sorted(sys.modules), 'env': dict(os.environ)}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_vlens_imports_neither_vllm_nor_torch_nor_changes_env():
    before = dict(os.environ)
    got = _modules_after("import vlens; vlens.VlensError; vlens.__version__")
    mods = set(got["mods"])
    assert "vllm" not in mods
    assert "torch" not in mods
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"):
        assert got["env"].get(key) == before.get(key)


def test_pure_modules_load_without_vllm():
    got = _modules_after(
        "import vlens.worker.layout, vlens.plots, vlens.results, vlens.edits, vlens.lens, vlens.protocol.plan"
    )
    assert "vllm" not in set(got["mods"])


def test_a_connected_session_loads_no_vllm():
    """``vlens.connect`` / ``open_session(server=...)`` and the Session they
    make load no vLLM (a connected notebook may have none)."""
    got = _modules_after(
        "import vlens; vlens.connect, vlens.open_session, vlens.Session; "
        "import vlens.remote.client, vlens.backend")
    assert "vllm" not in set(got["mods"])


def test_session_and_steer_are_reachable_lazily():
    import vlens

    assert vlens.Session.__name__ == "Session"
    assert vlens.Steer.__name__ == "Steer"
    assert set(vlens.__all__) >= {"Session", "Steer", "Run", "Trace", "VlensError"}
    try:
        vlens.Nonexistent  # noqa: B018
    except AttributeError as exc:
        assert "Nonexistent" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("unknown attribute did not raise")


def test_serve_threads_leave_a_cpu_to_the_http_server_unless_the_user_chose(monkeypatch):
    from vlens.engine import env

    monkeypatch.setattr(env, "has_gpu", lambda: False)
    monkeypatch.setattr(env.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setenv(env.MARK, "")  # none set by vlens (put back after the test)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert env.serve_threads() == 3 and os.environ["OMP_NUM_THREADS"] == "3"
    monkeypatch.setattr(env.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert env.serve_threads() == 1  # vlens's own earlier value is not a user's choice
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's
    assert env.serve_threads() is None and os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # a binding: vLLM sets the threads
    assert env.serve_threads() is None and "OMP_NUM_THREADS" not in os.environ


CHILD = """
import json, os
from vlens import VlensError
from vlens.engine import env
try:
    env.apply_env_defaults({"kv_cache_memory_bytes": 2**26})
    print(json.dumps({"error": None, "space": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}))
except VlensError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def test_a_child_process_takes_its_parents_vlens_defaults_for_defaults(monkeypatch):
    """A default vlens set here (VLLM_CPU_KVCACHE_SPACE) is inherited by a
    process started from this one; passing ``kv_cache_memory_bytes=`` there
    removes it instead of refusing it as the user's setting. The user's own
    value (not the one vlens wrote down) is still refused."""
    from vlens.engine import env

    monkeypatch.setattr(env, "has_gpu", lambda: False)
    for key in (env.MARK, *env.CPU_DEFAULTS, *env.COMMON_DEFAULTS):
        monkeypatch.setenv(key, "")  # so that each is put back as it was after the test
        monkeypatch.delenv(key)
    env.apply_env_defaults({})
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"  # its artifacts do not load again on CPU
    assert "VLLM_CPU_KVCACHE_SPACE=1" in os.environ[env.MARK].split(";")

    def child(**extra: str) -> dict:
        out = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **extra},
                             capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert child() == {"error": None, "space": None}
    refused = child(VLLM_CPU_KVCACHE_SPACE="2")  # the user's, in the child
    assert refused["error"] and "VLLM_CPU_KVCACHE_SPACE='2'" in refused["error"], refused
    # and in this process: the argument takes the variable back out, and its mark
    env.apply_env_defaults({"kv_cache_memory_bytes": 2**26})
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    assert "VLLM_CPU_KVCACHE_SPACE=1" not in os.environ.get(env.MARK, "").split(";")
