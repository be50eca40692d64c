"""One driver per engine: the only code that steps vLLM's engine loop.

Every caller -- a cell's call, a stream, a widget's background run, a
second Session sharing the engine -- submits its requests as a
:class:`Batch` and gets its own outputs back. A thread of the driver steps
the engine while any batch has requests left, so callers that overlap share
engine steps (their rows sit side by side on the token axis, which the
worker's planner already keeps apart). A stream is a consumer of its batch,
not a loop of its own; cancelling a batch (an interrupt, a closed stream, a
closed Session) aborts its requests only.

vLLM keeps the forward step's context in one module global, so one process
never steps two in-process engines at once: every in-process driver takes
:data:`STEP` around a step, and every other call into such an engine (an RPC
to its workers, adding or aborting requests) takes it too. An engine whose
core runs in another process takes a lock of its own (its client is not
safe to drive from two threads), so two such engines really run side by
side.

Why a thread over the in-process engine rather than vLLM's ``AsyncLLM``
(which ``vlens serve`` drives): ``AsyncLLM`` always puts the engine core in
another process, so every read would cross a process boundary and
``edit=`` functions could not reach the workers; docs/architecture.md has
the measured costs.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from vlens.errors import ClosedError, EngineError

__all__ = ["Batch", "Driver", "STEP"]

#: held around every step of, and every call into, an in-process engine
STEP = threading.RLock()

_IDS = itertools.count()

# how often a waiting caller wakes to let an interrupt (KeyboardInterrupt,
# which Python delivers to the main thread between bytecodes) reach it
_POLL_S = 0.05


class Batch:
    """One caller's requests in the engine.

    ``result()`` waits for every request and returns their final
    ``RequestOutput``s in submission order; ``frames()`` (a streamed batch)
    yields, after every engine step that moved one of them, each request's
    latest output (None before its first token), the last frame holding
    every request finished. ``cancel()`` aborts what is left."""

    def __init__(self, driver: Driver, ids: list[str], samples: list[int],
                 stream: bool, owner: Any) -> None:
        self.driver = driver
        self.ids = ids
        self.owner = owner
        self.stream = stream
        self._n = dict(zip(ids, samples))
        self._cond = threading.Condition()
        self._latest: dict[str, Any] = {}
        self._samples: dict[str, dict[int, Any]] = {rid: {} for rid in ids}
        self._done: set[str] = set()
        self._frames: deque[list[Any]] = deque()
        self._error: BaseException | None = None
        self.finished = False  # every request done, or the batch ended

    # -- the driver's side (its thread) -------------------------------------
    def take(self, out: Any) -> None:
        """Keep output ``out`` of one of this batch's requests."""
        rid = out.request_id
        if self.stream:
            out = self._merged(rid, out)
        with self._cond:
            self._latest[rid] = out
            if out.finished:
                self._done.add(rid)

    def _merged(self, rid: str, out: Any) -> Any:
        """A snapshot of a streamed request's output: vLLM keeps growing the
        same objects, and with ``n > 1`` each sample comes on its own."""
        kept = self._samples[rid]
        for comp in out.outputs:
            snap = copy.copy(comp)
            snap.token_ids = list(comp.token_ids)
            if comp.logprobs is not None:
                snap.logprobs = list(comp.logprobs)
            kept[comp.index] = snap
        merged = copy.copy(out)
        merged.outputs = [kept[k] for k in sorted(kept)]
        merged.finished = len(merged.outputs) == self._n[rid] and all(
            c.finish_reason is not None for c in merged.outputs)
        previous = self._latest.get(rid)
        if previous is not None and merged.prompt_logprobs is None:
            merged.prompt_logprobs = previous.prompt_logprobs
        return merged

    def stepped(self) -> None:
        """After a step that moved this batch: a frame, and wake the caller."""
        with self._cond:
            if self.stream:
                self._frames.append([self._latest.get(rid) for rid in self.ids])
            if len(self._done) == len(self.ids):
                self.finished = True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if not self.finished:
                self._error = error
                self.finished = True
            self._cond.notify_all()

    def is_done(self, rid: str) -> bool:
        with self._cond:
            return rid in self._done

    # -- the caller's side ---------------------------------------------------
    @property
    def done(self) -> int:
        """How many of the batch's requests have finished."""
        with self._cond:
            return len(self._done)

    def result(self, progress: Callable[..., Any] | None = None) -> list[Any]:
        """Every request's final output, in submission order. ``progress``:
        a tqdm-like factory (``factory(total=...)``), updated with the
        samples finished. If anything interrupts the wait (an interrupt, a
        progress callback that raises), the batch is cancelled first."""
        bar = progress(total=sum(self._n.values())) if progress else None
        shown = 0
        try:
            while True:
                with self._cond:
                    if not self.finished:
                        self._cond.wait(_POLL_S)
                    finished = self.finished
                    samples = sum(self._n[r] for r in self._done)
                if bar is not None and samples > shown:
                    bar.update(samples - shown)
                    shown = samples
                if finished:
                    break
            self._raise()
            return [self._latest[rid] for rid in self.ids]
        except BaseException:
            self.cancel()
            raise
        finally:
            if bar is not None:
                bar.close()

    def frames(self) -> Iterator[list[Any]]:
        """After every step that moved this batch, each request's latest
        output (None before its first); closing the iterator early cancels
        the batch."""
        try:
            while True:
                with self._cond:
                    while not self._frames and not self.finished:
                        self._cond.wait(_POLL_S)
                    frame = self._frames.popleft() if self._frames else None
                    last = self.finished and not self._frames
                if frame is not None:
                    yield frame
                if last:
                    self._raise()
                    return
        except BaseException:
            self.cancel()
            raise

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error
        missing = [rid for rid in self.ids if rid not in self._latest]
        if missing:
            raise EngineError(f"vLLM finished without returning requests {missing}")

    def cancel(self, error: BaseException | None = None) -> None:
        """Abort what is left of the batch; a caller still waiting gets
        ``error`` (by default: the batch was cancelled)."""
        if self.finished and error is None:
            return
        self.driver.cancel_batch(self)
        self.fail(error or EngineError("the call was cancelled"))


class Driver:
    """Steps one vLLM ``LLMEngine`` for every caller (see the module's text).

    ``engine``: vLLM's ``LLMEngine``; ``quiet``: a context manager factory
    put around every call into it (``Engine._quiet``); ``lock``: what is
    held around each of those calls (:data:`STEP` for an in-process engine)."""

    def __init__(self, engine: Any, quiet: Callable[[], Any], lock: Any) -> None:
        self.engine = engine
        self.quiet = quiet
        self.lock = lock
        self._owners: dict[str, Batch] = {}  # request id -> its batch
        self._live: list[Batch] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # engine steps taken

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` between two steps (an RPC, a status read)."""
        with self.lock, self.quiet():
            return fn(*args)

    def submit(self, prompts: list[Any], params: list[Any], *, stream: bool = False,
               owner: Any = None) -> Batch:
        """Add one caller's requests to the engine; they run from the next step."""
        from vllm.sampling_params import RequestOutputKind

        if not isinstance(params, (list, tuple)):  # one for all, as LLM.generate takes
            params = [params] * len(prompts)
        if self._closed:
            raise ClosedError("this engine has been closed; start a new vlens.Session() to run again")
        call = next(_IDS)
        ids = [f"vlens-{call}-{i}" for i in range(len(prompts))]
        batch = Batch(self, ids, [getattr(sp, "n", 1) or 1 for sp in params], stream, owner)
        kind = RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
        with self.lock:
            added: list[str] = []
            try:
                with self.quiet():
                    for rid, prompt, sp in zip(ids, prompts, params):
                        sp = copy.copy(sp)
                        sp.output_kind = kind
                        self._owners[rid] = batch
                        self.engine.add_request(rid, prompt, sp)
                        added.append(rid)
            except BaseException:
                for rid in ids:
                    self._owners.pop(rid, None)
                if added:
                    with self.quiet():
                        self.engine.abort_request(added, internal=False)
                raise
            with self._wake:
                self._live.append(batch)
                self._wake.notify_all()
        if not ids:
            batch.stepped()
        self._start()
        return batch

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="vlens-driver", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._live and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            try:
                with self.lock:
                    if not self._live:
                        continue
                    with self.quiet():
                        outs = self.engine.step() if self.engine.has_unfinished_requests() else None
                    self.steps += 1
            except BaseException as exc:  # noqa: BLE001 - every caller in the step learns it
                self._fail_all(exc)
                continue
            moved: dict[int, Batch] = {}
            for out in outs or ():
                batch = self._owners.get(out.request_id)
                if batch is None:  # cancelled meanwhile
                    continue
                batch.take(out)
                moved[id(batch)] = batch
                if batch.is_done(out.request_id):
                    self._owners.pop(out.request_id, None)
            if outs is None:  # nothing left in the engine, yet callers wait
                for batch in list(self._live):
                    if not batch.finished:
                        batch.fail(EngineError(
                            "vLLM has no requests left but never finished these: "
                            f"{[r for r in batch.ids if not batch.is_done(r)]}"))
            for batch in moved.values():
                batch.stepped()
            with self._wake:
                self._live = [b for b in self._live if not b.finished]

    def cancel_batch(self, batch: Batch) -> None:
        """Abort ``batch``'s unfinished requests (between two steps)."""
        with self.lock:
            left = [rid for rid in batch.ids if self._owners.pop(rid, None) is not None]
            if left and not self._closed:
                with self.quiet():
                    self.engine.abort_request(left, internal=False)
            with self._wake:
                if batch in self._live:
                    self._live.remove(batch)

    def _fail_all(self, exc: BaseException) -> None:
        """A step failed: every waiting caller gets the error and the engine
        is emptied, so the next call starts from a clean engine."""
        with self._wake:
            live, self._live = self._live, []
        for batch in live:
            batch.fail(exc)
        self._owners.clear()
        self.abort_all()

    def cancel_owner(self, owner: Any, error: BaseException) -> list[Batch]:
        """Cancel every batch ``owner`` submitted; returns them."""
        with self._wake:
            mine = [b for b in self._live if b.owner is owner]
        for batch in mine:
            batch.cancel(error)
        return mine

    def abort_all(self) -> int:
        """Abort every request in the engine and let the core retire them."""
        with self.lock, self.quiet():
            engine = self.engine
            ids = list(engine.output_processor.request_states)
            if ids:
                engine.abort_request(ids, internal=True)
            for _ in range(1000):  # bounded: never spin forever
                if not engine.has_unfinished_requests():
                    break
                engine.step()
        return len(ids)

    def unfinished(self) -> int:
        with self.lock:
            return int(self.engine.get_num_unfinished_requests())

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every batch, stop the thread (waiting at most ``timeout``)."""
        with self._wake:
            live = list(self._live)
        for batch in live:
            batch.cancel(ClosedError("the engine was closed while this call ran"))
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
