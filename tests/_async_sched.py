"""vLLM's CUDA default, async scheduling, forced on the CPU build.

vLLM turns async scheduling on by default on CUDA; its CPU platform turns
it off ("not required on CPU"). Wrapping ``CpuPlatform.check_and_update_config``
so that it leaves ``scheduler_config.async_scheduling = True`` after the
original has run (and asking for it with ``async_scheduling=True``) makes
the CPU build schedule one step ahead as a GPU does: a request that stops
is scheduled once more before its stop is seen. Plain vLLM generates
correctly so; vlens must too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def forced_async_scheduling() -> Iterator[dict[str, Any]]:
    """Inside the block, engines started with the returned arguments run
    with async scheduling on (an in-process engine: the patch is in this
    process)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]
    seen: list[Any] = []

    def forced(cls, vllm_config):
        original.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True
        seen.append(vllm_config)

    CpuPlatform.check_and_update_config = classmethod(forced)
    try:
        yield {"async_scheduling": True}
    finally:
        CpuPlatform.check_and_update_config = original


def is_async(session: Any) -> bool:
    """Whether ``session``'s engine really schedules asynchronously."""
    engine = session.engine.llm.llm_engine
    return bool(engine.vllm_config.scheduler_config.async_scheduling)
