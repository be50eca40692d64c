"""A widget's engine runs: one at a time, off the kernel's comm handler,
and the latest wins.

In a Jupyter kernel, widget callbacks run one at a time in the comm
handler. A callback that ran an engine call itself would hold the kernel
for the whole run, and every slider move made meanwhile would queue and
then run in turn, stale settings included. So a callback only *starts* a
run (:meth:`Runs.start`): the run goes to a thread of its own, the
callback returns, and the kernel takes the next message at once. Starting
a run cancels the one under way and any not yet begun: only the newest
runs to its end.

Cancelling is cooperative. A run checks :meth:`Job.check` where it can
stop cleanly -- at every progress report (vLLM's ``use_tqdm`` callback) and
after every step of a stream -- and :class:`RunReplaced` raised there ends
it: a raising progress callback stops ``Session`` calls between engine
steps, and a stream closed early aborts its requests, so the engine keeps
no leftovers. A replaced run publishes nothing (it checks once more before
showing its result).

The engine itself runs one call at a time (the engine's lock, taken by
every Session call): a notebook cell's own call waits for a widget's run
instead of colliding with it. Runs of one panel never overlap: a run
starts only once the one before it has ended.

:meth:`Runs.call` runs a function in the caller's thread as the newest run
(what a panel's Python methods do, so ``panel.run_comparison()`` returns
after its run, with its result or its exception); :meth:`Runs.wait` waits
until no run is pending.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Job", "RunReplaced", "Runs"]


class RunReplaced(Exception):
    """A widget's run was replaced by a newer one before it finished."""


class Job:
    """One run: ``key`` names what it does (``"compare"``, ``"sweep"`` …)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.cancelled = threading.Event()
        self.done = threading.Event()

    def check(self) -> None:
        """Raise :class:`RunReplaced` if a newer run replaced this one."""
        if self.cancelled.is_set():
            raise RunReplaced(f"this {self.key} run was replaced by a newer one")


class Runs:
    """One panel's runs. ``on_busy(flag)`` is called (under the lock) when
    the panel starts having a run pending and when it stops."""

    def __init__(self, on_busy: Callable[[bool], None]) -> None:
        self._lock = threading.RLock()
        self._latest: Job | None = None
        self._local = threading.local()
        self._on_busy = on_busy

    # -- what runs now ------------------------------------------------------------
    @property
    def current(self) -> Job | None:
        """The job this thread is running (None outside a run)."""
        return getattr(self._local, "job", None)

    def under_way(self) -> str | None:
        """The key of the newest run while it is pending, else None."""
        job = self._latest
        return job.key if job is not None and not job.done.is_set() else None

    def _replace(self, key: str) -> tuple[Job, Job | None]:
        """A new newest job; the previous one is cancelled (under the lock)."""
        job = Job(key)
        previous, self._latest = self._latest, job
        if previous is not None:
            previous.cancelled.set()
        if previous is None or previous.done.is_set():
            self._on_busy(True)
        return job, previous

    def _end(self, job: Job) -> None:
        with self._lock:
            job.done.set()
            if self._latest is job:
                self._on_busy(False)

    @contextmanager
    def _as(self, job: Job) -> Iterator[None]:
        outer, self._local.job = self.current, job
        try:
            yield
        finally:
            self._local.job = outer

    # -- starting runs ------------------------------------------------------------
    def start(self, key: str, fn: Callable[[], Any],
              on_error: Callable[[BaseException], None],
              on_success: Callable[[], None]) -> Job:
        """Run ``fn()`` in a thread of its own, as the newest run, once the
        run before it has ended; a failure goes to ``on_error``, a
        replaced run to neither."""
        with self._lock:
            job, previous = self._replace(key)
            thread = threading.Thread(target=self._body, args=(job, previous, fn, on_error,
                                                                on_success),
                                      name=f"vlens-{key}", daemon=True)
            thread.start()
        return job

    def _body(self, job: Job, previous: Job | None, fn: Callable[[], Any],
              on_error: Callable[[BaseException], None], on_success: Callable[[], None]) -> None:
        try:
            if previous is not None:
                previous.done.wait()
            job.check()
            with self._as(job):
                fn()
            job.check()
        except RunReplaced:
            pass
        except Exception as exc:  # noqa: BLE001 -- shown in the widget, which keeps working
            on_error(exc)
        else:
            on_success()
        finally:
            self._end(job)

    def call(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` in this thread as the newest run: the run under way is
        cancelled and waited for first. Inside a run, ``fn()`` is part of it."""
        if self.current is not None:
            return fn()
        with self._lock:
            job, previous = self._replace(key)
        try:
            if previous is not None:
                previous.done.wait()
            job.check()
            with self._as(job):
                return fn()
        finally:
            self._end(job)

    @contextmanager
    def publishing(self) -> Iterator[None]:
        """Around showing a run's result: raises :class:`RunReplaced` if
        the run was replaced, and no newer run can start meanwhile."""
        with self._lock:
            job = self.current
            if job is not None:
                job.check()
            yield

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no run is pending (a run started meanwhile too); False
        if ``timeout`` seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self._latest
            if job is None:
                return True
            left = None if end is None else max(0.0, end - time.monotonic())
            if not job.done.wait(left):
                return False
            if self._latest is job:
                return True
