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

Runs come in two kinds. A *setting* (a slider, a menu, a click that
picks what to show) is latest-wins as above. An *action* that adds
something (grow a branch, add a prompt) is queued instead: it is never
cancelled by a newer run, and the panel's actions run one after another,
in the order they were asked for. Settings of one panel never overlap (a
setting starts once the one before it has ended), and an action may run
beside a setting: the engine's driver (``vlens/engine/driver.py``) batches
a widget's run, a cell's call and an open stream into the same steps.

:meth:`Runs.call` runs a function in the caller's thread as the newest run
(what a panel's Python methods do, so ``panel.run_comparison()`` returns
after its run, with its result or its exception); :meth:`Runs.wait` waits
until no run is pending.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Job", "RunReplaced", "Runs"]


class RunReplaced(Exception):
    """A widget's run was replaced by a newer one before it finished."""


_SERIAL = itertools.count(1)


class Job:
    """One run: ``key`` names what it does (``"compare"``, ``"sweep"`` …);
    ``label`` is what a view shows of it (``"compare #3"``)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.label = f"{key} #{next(_SERIAL)}"
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
        self._latest: Job | None = None  # the newest setting
        self._actions: list[Job] = []  # queued actions, oldest first, until they end
        self._local = threading.local()
        self._on_busy = on_busy

    # -- what runs now ------------------------------------------------------------
    @property
    def current(self) -> Job | None:
        """The job this thread is running (None outside a run)."""
        return getattr(self._local, "job", None)

    def under_way(self) -> str | None:
        """The key of the newest setting while it is pending, else of the
        oldest queued action, else None."""
        job = self._latest
        if job is not None and not job.done.is_set():
            return job.key
        return self._actions[0].key if self._actions else None

    def _add(self, key: str, queue: bool = False) -> tuple[Job, Job | None]:
        """A new job and the one it runs after (under the lock): a setting
        becomes the newest and cancels the setting before it; an action
        (``queue``) goes behind the last queued action."""
        idle = self.under_way() is None
        job = Job(key)
        if queue:
            previous = self._actions[-1] if self._actions else None
            self._actions.append(job)
        else:
            previous, self._latest = self._latest, job
            if previous is not None:
                previous.cancelled.set()
        if idle:
            self._on_busy(True)
        return job, previous

    def _end(self, job: Job) -> None:
        with self._lock:
            job.done.set()
            if job in self._actions:
                self._actions.remove(job)
            if self.under_way() is None:
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
              on_success: Callable[[], None], *, queue: bool = False) -> Job:
        """Run ``fn()`` in a thread of its own, as the newest run, once the
        run before it has ended; a failure goes to ``on_error``, a
        replaced run to neither. ``queue``: an action (see the module's
        text), run after the actions asked for before it and never replaced."""
        with self._lock:
            job, previous = self._add(key, queue)
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
            job, previous = self._add(key)
        try:
            if previous is not None:
                previous.done.wait()
            job.check()
            with self._as(job):
                return fn()
        finally:
            self._end(job)

    @contextmanager
    def publishing(self) -> Iterator[Job | None]:
        """Around showing a run's result: raises :class:`RunReplaced` if
        the run was replaced, and no newer run can start meanwhile; gives
        the run (None outside one)."""
        with self._lock:
            job = self.current
            if job is not None:
                job.check()
            yield job

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no run is pending (a run started meanwhile too); False
        if ``timeout`` seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [j for j in (self._latest, *self._actions)
                           if j is not None and not j.done.is_set()]
            if not pending:
                return True
            for job in pending:
                left = None if end is None else max(0.0, end - time.monotonic())
                if not job.done.wait(left):
                    return False
