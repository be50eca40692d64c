"""Call slots on ``vlens serve``: each participant runs at most
``--max-concurrent`` calls at once; the next ``--max-queued`` wait, in the
order they came, for a slot to free (at most ``--queue-timeout`` seconds);
only a call past the queue is refused, with 429 and ``Retry-After``.
``--max-calls`` bounds the calls running for everyone together (503).

A slot freed by a call goes straight to the participant's first waiting
call, so a call that arrives later never overtakes one that waits.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

from vlens.remote.guard import Limits, Refused

__all__ = ["Slots", "Waiting"]


@dataclass
class Waiting:
    """One participant's calls: running, and waiting for a slot."""

    active: int = 0
    queue: deque = field(default_factory=deque)  # futures, first come first


class Slots:
    """The slots of every participant and the server's total."""

    def __init__(self, limits: Limits, max_calls: int) -> None:
        self.limits = limits
        self.max_calls = max_calls
        self.calls = 0  # running, all participants
        self.queued = 0  # waiting, all participants
        self._seconds = 1.0  # a call's running time, averaged (for Retry-After)

    def _retry_after(self, ahead: int) -> int:
        """Seconds until a slot is likely free with ``ahead`` calls before it."""
        rounds = (ahead + 1) / max(self.limits.concurrent, 1)
        return max(1, min(60, math.ceil(self._seconds * rounds)))

    async def take(self, who: Waiting) -> None:
        """A slot for one call of ``who``, waiting in line for it if all of
        the participant's slots are taken; raises :class:`Refused` when the
        line is full or the wait runs out."""
        if self.calls >= self.max_calls:
            raise Refused(503, f"the server is running its limit of {self.max_calls} calls; "
                               "try again in a moment", self._retry_after(0))
        if who.active < self.limits.concurrent and not who.queue:
            self._grant(who)
            return
        if len(who.queue) >= self.limits.queued:
            raise Refused(429, f"{who.active} calls of this client are running and "
                               f"{len(who.queue)} waiting; this server runs at most "
                               f"{self.limits.concurrent} at once and queues "
                               f"{self.limits.queued} more",
                          self._retry_after(len(who.queue)))
        ready = asyncio.get_running_loop().create_future()
        who.queue.append(ready)
        self.queued += 1
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.limits.queue_seconds)
        except asyncio.TimeoutError:
            if not ready.done():
                ready.cancel()
                raise Refused(429, f"this call waited {self.limits.queue_seconds:g} s for "
                                   f"one of this client's {self.limits.concurrent} slots",
                              self._retry_after(len(who.queue))) from None
        except BaseException:  # the client went away while waiting
            if ready.done() and not ready.cancelled():
                self.give(who)  # granted meanwhile: pass it on
            else:
                ready.cancel()
            raise
        finally:
            self.queued -= 1
            if ready in who.queue:
                who.queue.remove(ready)

    def _grant(self, who: Waiting) -> None:
        who.active += 1
        self.calls += 1

    def give(self, who: Waiting) -> None:
        """Give a slot back: to the participant's first waiting call if any."""
        who.active -= 1
        self.calls -= 1
        while who.queue and who.active < self.limits.concurrent:
            ready = who.queue.popleft()
            if not ready.done():
                self._grant(who)
                ready.set_result(True)

    def ran(self, seconds: float) -> None:
        """A call ran this long: its time joins the running average."""
        self._seconds = 0.8 * self._seconds + 0.2 * seconds
