"""Environment defaults that make a notebook engine fast on the first try.

vLLM reads these variables when the engine starts. vlens sets each one only
when the user has not: an explicit setting always wins. Called by
:class:`~vlens.engine.Engine` just before vLLM is imported, never at
``import vlens``.

Why each default (figures in docs/concepts.md and the project notes):

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` -- keep the engine core in the
  kernel's own process: starts in seconds, and a notebook needs no
  ``__main__`` guard. Set it to 1 for an out-of-process engine.
* ``VLLM_CPU_OMP_THREADS_BIND=nobind`` -- vLLM's automatic OpenMP binding
  made generation many times slower on small shared machines; without
  binding, torch's own thread settings apply.
* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) -- otherwise the CPU backend reserves a
  fraction of the whole machine's memory for the KV cache.
* ``VLLM_USE_V2_MODEL_RUNNER=0`` -- vlens reads the batch layout from the
  V1 model runner (the one vLLM uses on CPU).
"""

from __future__ import annotations

import os

__all__ = ["CPU_DEFAULTS", "COMMON_DEFAULTS", "apply_env_defaults", "has_gpu"]

COMMON_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}
CPU_DEFAULTS = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def has_gpu() -> bool:
    """True when torch sees a CUDA device (without initialising vLLM)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - broken CUDA install
        return False


def apply_env_defaults() -> dict[str, str]:
    """Set vlens's defaults for variables the user left unset; return the
    values in force afterwards for every variable vlens has an opinion on."""
    defaults = dict(COMMON_DEFAULTS)
    if not has_gpu():
        defaults.update(CPU_DEFAULTS)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in defaults}
