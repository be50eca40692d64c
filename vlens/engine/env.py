"""Environment defaults that make a notebook engine fast on the first try.

vLLM reads these variables when the engine starts. vlens sets each one only
when the user has not: an explicit setting always wins. Called by
:class:`~vlens.engine.Engine` just before vLLM is imported, never at
``import vlens``.

Why each default (measurements in docs/concepts.md and docs/scale-out.md):

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` -- keep the engine core in the
  kernel's own process: starts in seconds, and a notebook needs no
  ``__main__`` guard. Set it to 1 for an out-of-process engine.
* ``VLLM_CPU_OMP_THREADS_BIND=nobind`` -- vLLM's automatic OpenMP binding
  made generation many times slower on small shared machines; without
  binding, torch's own thread settings apply.
* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) -- otherwise the CPU backend reserves a
  fraction of the whole machine's memory for the KV cache. Not set when the
  engine is given ``kv_cache_memory_bytes=`` (on the CPU platform the
  variable would override the argument), and removed again if vlens set it
  for an earlier engine in this process or in the process that started
  this one.
* ``VLLM_USE_V2_MODEL_RUNNER=0`` -- vlens reads the batch layout from the
  V1 model runner (the one vLLM uses on CPU).
* ``VLLM_USE_AOT_COMPILE=0`` (CPU) -- compiled mode: vLLM 0.32's CPU build
  saves an ahead-of-time compiled model it cannot load again ("'function'
  object has no attribute 'finalize_loading'"), so every compiled start
  compiled from scratch and saved it again; without it the toy model's
  compiled start took 27.5 s of CPU instead of 35.8 the first time and
  20.4 instead of 31.2 on a warm cache.
* ``OMP_NUM_THREADS`` for ``vlens serve`` on a CPU (:func:`serve_threads`):
  one less than the CPUs this process may use (at least 1), so the engine
  core's process leaves a CPU to the HTTP server beside it, as vLLM's own
  automatic binding does. Unbound, torch took every CPU and a decode step
  of the toy model took ~1.6x as long through the server (docs/openai.md).

What vlens set is also written to ``VLENS_SET_DEFAULTS`` (``KEY=value;...``),
so a process started from this one (a JupyterLab server, ``vlens serve``,
a script) inherits the values as vlens's defaults, not as the user's
choices: without it, a child passing ``kv_cache_memory_bytes=`` was refused
for a ``VLLM_CPU_KVCACHE_SPACE`` its parent's vlens had set.
"""

from __future__ import annotations

import os

from vlens.errors import VlensError

__all__ = ["CPU_DEFAULTS", "COMMON_DEFAULTS", "apply_env_defaults", "has_gpu", "serve_threads"]

COMMON_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}
CPU_DEFAULTS = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_USE_AOT_COMPILE": "0",
}


def has_gpu() -> bool:
    """True when torch sees a CUDA device (without initialising vLLM)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - broken CUDA install
        return False


#: the variables whose value in os.environ vlens put there (not the user),
#: ``KEY=value;KEY=value``: in os.environ itself, so child processes inherit it
MARK = "VLENS_SET_DEFAULTS"

# engine arguments that a variable would silently override -> that variable
_OVERRIDDEN_BY = {"kv_cache_memory_bytes": "VLLM_CPU_KVCACHE_SPACE"}


def _marked_except(key: str) -> list[str]:
    return [e for e in os.environ.get(MARK, "").split(";") if e and not e.startswith(f"{key}=")]


def _remember(key: str, value: str) -> None:
    os.environ[key] = value
    os.environ[MARK] = ";".join([*_marked_except(key), f"{key}={value}"])


def _forget(key: str) -> None:
    os.environ.pop(key, None)
    rest = _marked_except(key)
    if rest:
        os.environ[MARK] = ";".join(rest)
    else:
        os.environ.pop(MARK, None)


def _user_set(key: str) -> bool:
    """The variable is set, to a value vlens did not write (in this process
    or in the one that started it)."""
    value = os.environ.get(key)
    return value is not None and f"{key}={value}" not in os.environ.get(MARK, "").split(";")


def apply_env_defaults(engine_kwargs: dict | None = None) -> dict[str, str]:
    """Set vlens's defaults for variables the user left unset; return the
    values in force afterwards for every variable vlens has an opinion on.

    The user's explicit choices win: a variable they set is left alone, and
    a default that would override an engine argument they passed
    (``kv_cache_memory_bytes=``) is not applied. A variable set to the empty
    string (which vLLM cannot parse) counts as unset. Raises
    :class:`~vlens.VlensError` when the user set both a variable and the
    engine argument it would override."""
    engine_kwargs = engine_kwargs or {}
    defaults = dict(COMMON_DEFAULTS)
    if not has_gpu():
        defaults.update(CPU_DEFAULTS)
    for key in defaults:
        if os.environ.get(key, None) == "":
            del os.environ[key]
    v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0").strip().lower()
    if v2 not in ("0", "false", "no", "off"):
        raise VlensError(
            f"VLLM_USE_V2_MODEL_RUNNER={os.environ['VLLM_USE_V2_MODEL_RUNNER']!r} asks for "
            "vLLM's Model Runner V2, whose batch vlens cannot read yet: set "
            "VLLM_USE_V2_MODEL_RUNNER=0 (or leave it unset: vlens sets it) before the "
            "Session starts")
    for arg, key in _OVERRIDDEN_BY.items():
        if engine_kwargs.get(arg) is None:
            continue
        if _user_set(key):
            raise VlensError(
                f"{arg}= was passed but the environment sets {key}="
                f"{os.environ[key]!r}, which vLLM's CPU build applies instead: "
                f"unset {key} (del os.environ[{key!r}]) or leave {arg}= out"
            )
        defaults.pop(key, None)
        if key in os.environ:  # set by vlens for an earlier engine, here or in a parent
            _forget(key)
    for key, value in defaults.items():
        if key not in os.environ:
            _remember(key, value)
    return {key: os.environ[key] for key in defaults}


def serve_threads() -> int | None:
    """For ``vlens serve`` on a CPU with threads unbound: set
    ``OMP_NUM_THREADS`` (read by the engine core's process when vLLM starts
    it) to one less than this process's CPUs, unless the user set it or
    chose a binding; returns the engine's thread count when vlens set it."""
    if has_gpu() or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") != "nobind":
        return None
    if os.environ.get("OMP_NUM_THREADS") and _user_set("OMP_NUM_THREADS"):  # "" counts as unset
        return None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    value = str(max(1, cpus - 1))
    _remember("OMP_NUM_THREADS", value)
    return int(value)
