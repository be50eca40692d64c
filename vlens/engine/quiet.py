"""A quiet engine start: one summary line in a notebook instead of vLLM's log.

vLLM reports every step of an engine start (some 70 lines at INFO and
WARNING, several hundred characters each), its libraries add Python
warnings, torch's logger and its C++ code add more, and a second engine
prints it all again. In Jupyter all of it lands in the cell's output:
ipykernel forwards the process's file descriptors 1 and 2 as well as
``sys.stdout``. None of it is something a notebook's user can act on, so a
Session starts its engine quietly unless asked (``verbose=True`` or
``VLENS_VERBOSE=1``). Each kind of noise is stopped where it is made:

* vLLM's own log: the engine is started with ``log_level="ERROR"``
  (unless the caller passed ``log_level=`` or ``logging_config=``). vLLM
  applies that with its own logging config, in this process and in an
  engine-core process alike, so its log stays at ERROR after the start.
  ``use_tqdm_on_load=False`` (unless passed) drops its weight-loading bar.
* every logger below ERROR during the start (``logging.disable``): torch's
  "Triton not available" and what vLLM logs before its config is applied.
  Errors still show, and an engine that fails to start still raises vLLM's
  exception.
* Python warnings raised during the start are recorded, not shown; vlens's
  own :class:`~vlens.errors.VlensWarning` are shown after it (and warning
  filters the libraries imported meanwhile set are kept).
* the process's stderr (fd 2) during an in-process start, where C++ code
  writes directly (vLLM's "NUMA binding" note through c10's warning
  handler). What was written there is shown after all when the start fails
  or when it holds an error line. Not done when the start makes other
  processes (they would keep writing to the capture for good).
* otherwise the processes the start makes (an engine core out of process,
  its workers) start with ``PYTHONWARNINGS`` dropping deprecation warnings
  and ``TORCH_LOGS=-all`` (torch's log at ERROR), unless the user set
  those; the variables are back as they were after the start. What their
  C++ code writes to stderr still shows.

Calls on a quiet engine (:func:`quiet_calls`) keep the ``vllm`` logger at
ERROR and drop Python warnings from vLLM (and deprecations vLLM's API
blames on vlens's call), for the duration of the call only: the user's own
code keeps its warnings.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from vlens.errors import VlensWarning

__all__ = ["QUIET_LEVEL", "quiet_calls", "quiet_engine_args", "quiet_start", "start_line",
           "summary_line", "verbose_default"]

#: the lowest level of vLLM's log a quiet engine shows
QUIET_LEVEL = logging.ERROR

# lines of captured stderr worth showing even after a successful start
_ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")

_FALSY = {"", "0", "false", "no", "off"}


def verbose_default() -> bool:
    """``VLENS_VERBOSE``: set (not "", 0, false, no, off) to start every
    engine with vLLM's log shown, as ``Session(verbose=True)`` does."""
    return os.environ.get("VLENS_VERBOSE", "").strip().lower() not in _FALSY


def quiet_engine_args(llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The vLLM engine arguments a quiet start adds to the caller's (never
    one the caller passed): vLLM's log at ERROR, no weight-loading bar."""
    extra: dict[str, Any] = {}
    if "log_level" not in llm_kwargs and "logging_config" not in llm_kwargs:
        extra["log_level"] = logging.getLevelName(QUIET_LEVEL)
    if "use_tqdm_on_load" not in llm_kwargs:
        extra["use_tqdm_on_load"] = False
    return extra


class _StderrCapture:
    """Point file descriptor 2 at a temporary file for the block; ``text``
    is what was written there. A no-op when not ``enabled`` or when fd 2
    cannot be redirected."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.text = ""
        self._saved: int | None = None
        self._file: Any = None

    def __enter__(self) -> _StderrCapture:
        if not self.enabled:
            return self
        _flush(sys.stderr)
        try:
            self._file = tempfile.TemporaryFile()
            self._saved = os.dup(2)
            os.dup2(self._file.fileno(), 2)
        except (OSError, ValueError):
            if self._saved is not None:
                os.close(self._saved)
            self._saved = None
            if self._file is not None:
                self._file.close()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is None:
            return
        _flush(sys.stderr)
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._saved = None
        self._file.seek(0)
        self.text = self._file.read().decode("utf-8", errors="replace")
        self._file.close()


def _flush(stream: Any) -> None:
    try:
        stream.flush()
    except Exception:  # noqa: BLE001 - a closed or odd stream: nothing to flush
        pass


# for the processes a quiet start makes (read when each one starts)
_CHILD_ENV = {
    "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning",
    "TORCH_LOGS": "-all",
}


@contextmanager
def _child_env() -> Iterator[None]:
    """:data:`_CHILD_ENV` in ``os.environ`` for the block, where the user set
    none of its own (this process has read both already)."""
    added = [key for key in _CHILD_ENV if key not in os.environ]
    for key in added:
        os.environ[key] = _CHILD_ENV[key]
    try:
        yield
    finally:
        for key in added:
            if os.environ.get(key) == _CHILD_ENV[key]:
                del os.environ[key]


@contextmanager
def quiet_start(*, single_process: bool) -> Iterator[None]:
    """Around one engine start: loggers below ERROR off, Python warnings
    recorded (vlens's own shown after). ``single_process`` (the start makes
    no other process): fd 2 captured (shown after all if the start fails or
    it holds an error); else the quiet variables for the processes it makes."""
    previous = logging.root.manager.disable
    stderr = _StderrCapture(single_process)
    failed = False
    outer = list(warnings.filters)
    added: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        logging.disable(max(previous, QUIET_LEVEL - 1))
        try:
            with stderr, (nullcontext() if single_process else _child_env()):
                yield
        except BaseException:
            failed = True
            raise
        finally:
            logging.disable(previous)
            # filters the libraries imported meanwhile set (urllib3, sympy, ...)
            added = [f for f in warnings.filters if f not in outer]
            if stderr.text and (failed or _ERROR_LINE.search(stderr.text)):
                sys.stderr.write(stderr.text)
                _flush(sys.stderr)
    for action, message, category, module, lineno in reversed(added):
        warnings.filterwarnings(action, getattr(message, "pattern", message) or "", category,
                                getattr(module, "pattern", module) or "", lineno)
    for w in caught:
        if issubclass(w.category, VlensWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                                   source=w.source)


# where Python warnings a quiet call drops come from: vLLM itself (every
# category), and deprecations raised in torch or transformers under it or
# blamed by vLLM's API on vlens's call into it
_QUIET_MODULES = r"vllm(\.|$)"
_QUIET_DEPRECATIONS = r"(torch|transformers|vlens\.engine)(\.|$)"
_DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)

# Quiet calls in flight (threads and nested calls share one set-up: a
# widget runs its calls in a thread of its own while a cell may run), the
# ``vllm`` logger's level before the first, and the filters they added.
_CALLS_LOCK = threading.Lock()
_calls_in_flight = 0
_level_saved = logging.NOTSET
_filters_added: list[Any] = []


def _enter_quiet_calls() -> None:
    global _calls_in_flight, _level_saved
    with _CALLS_LOCK:
        _calls_in_flight += 1
        if _calls_in_flight > 1:
            return
        logger = logging.getLogger("vllm")
        _level_saved = logger.level
        if logger.getEffectiveLevel() < QUIET_LEVEL:
            logger.setLevel(QUIET_LEVEL)
        # added (and later removed) one by one, not by swapping the whole
        # list as warnings.catch_warnings does: a filter the user sets in
        # another thread meanwhile stays
        before = list(warnings.filters)
        warnings.filterwarnings("ignore", module=_QUIET_MODULES)
        for category in _DEPRECATIONS:
            warnings.filterwarnings("ignore", category=category, module=_QUIET_DEPRECATIONS)
        _filters_added[:] = [f for f in warnings.filters if f not in before]


def _leave_quiet_calls() -> None:
    global _calls_in_flight
    with _CALLS_LOCK:
        _calls_in_flight -= 1
        if _calls_in_flight > 0:
            return
        logger = logging.getLogger("vllm")
        if logger.level != _level_saved:
            logger.setLevel(_level_saved)
        for item in _filters_added:
            try:
                warnings.filters.remove(item)
            except ValueError:  # removed meanwhile (warnings.resetwarnings)
                pass
        _filters_added.clear()
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:  # the registries' "already shown" marks are stale now
            mutated()


@contextmanager
def quiet_calls() -> Iterator[None]:
    """Around one call into a quiet engine (a batch, an engine step, an RPC):
    vLLM's log at ERROR and Python warnings from vLLM dropped."""
    _enter_quiet_calls()
    try:
        yield
    finally:
        _leave_quiet_calls()


def _size(n: int) -> str:
    """Bytes as one short figure: 512 bytes, 48 MiB, 1.0 GiB."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1000 or unit == "TiB":
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def start_line(model: str, engine: Any, reused: bool) -> str:
    """What a new Session prints: the engine it started
    (:func:`summary_line`), or that it shares a live one."""
    name = os.path.basename(os.path.normpath(model))
    if reused:
        return f"vlens: {name} · sharing the live engine (reuse=False starts another)"
    return summary_line(name, engine.info, getattr(engine, "started_in", None))


def summary_line(name: str, info: dict[str, Any], seconds: float | None) -> str:
    """The one line a Session prints when its engine has started, e.g.
    ``vlens: toyworld · native · eager · KV 58,240 tokens (1.0 GiB) ·
    started in 23.1 s``."""
    route = {"native": "native", "transformers": "Transformers backend"}.get(
        info.get("impl"), str(info.get("impl", "?")))
    parts = [f"vlens: {name}", route, "compiled" if info.get("compiled") else "eager"]
    blocks, block = info.get("kv_cache_blocks"), info.get("kv_block_size")
    if blocks and block:
        kv = f"KV {int(blocks) * int(block):,} tokens"
        if info.get("kv_cache_bytes"):
            kv += f" ({_size(info['kv_cache_bytes'])})"
        parts.append(kv)
    if seconds is not None:
        parts.append(f"started in {seconds:.1f} s")
    return " · ".join(parts)
