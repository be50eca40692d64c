"""Requests that share vLLM's prefix cache up to a position, and no further.

A cell of a patching grid writes the clean run's row at position ``p`` of
the corrupt prompt. Rows before ``p`` are the corrupt prompt's own (a write
cannot reach back), so the cell may read the corrupt run's cached KV blocks
that end at or before ``p``; and it must never register a block that holds
a row at or after ``p``: that KV is patched, and a later plain request of
the same tokens would find it under the plain prompt's block hashes.

vLLM 0.32 has no per-request setting for this. ``cache_salt`` enters block
0's hash (``kv_cache_utils.generate_block_hash_extra_keys``) and every later
hash chains from it, so a salted request shares nothing;
``skip_reading_prefix_cache`` stops reads only. So vlens wraps the two
places where the scheduler's KV cache manager meets the cache, on an engine
whose core runs in this process:

* ``KVCacheManager.get_computed_blocks(request)``: the cache lookup of a
  waiting request (new, or preempted and about to be recomputed). For a
  marked request whose hit would reach past its mark, vLLM's own
  ``coordinator.find_longest_cache_hit`` runs again with the hit capped
  at the mark.
* ``KVCacheCoordinator.cache_blocks(request, num_tokens)``: every
  registration of a request's blocks goes through it (``allocate_slots``
  each step, chunked prefill included; ``KVCacheManager.cache_blocks`` after
  a KV transfer and under async scheduling). For a marked request the count
  is capped at the mark: blocks from the mark on are used by the request
  and freed unregistered, never hashed into the pool.

A request is marked by ``SamplingParams.extra_args[PREFIX_KEY] = p``: its
first ``p`` prompt tokens are the unedited prompt's (the first position its
plan writes). The block size is the scheduler's business: the lookup hits
and the registered blocks are whole blocks, so a cell reads
``p // block_size`` blocks. An engine whose core runs in another process
(``vlens serve``, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``), or one with a KV
connector, gets no wrapper: its edited requests keep their cache salt.

Nothing here imports vLLM; :func:`install` is handed the engine.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

__all__ = ["PREFIX_KEY", "install", "marked_prefix", "registered_blocks"]

#: ``SamplingParams.extra_args`` key: how many leading prompt tokens of the
#: request are the unedited prompt's
PREFIX_KEY = "vlens_prefix"

# the KV cache managers wrapped so far (each engine's once)
_WRAPPED: weakref.WeakSet[Any] = weakref.WeakSet()


def marked_prefix(request: Any) -> int | None:
    """A vLLM ``Request``'s mark (None: unmarked, the usual rules)."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    n = extra.get(PREFIX_KEY) if isinstance(extra, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def _kv_cache_manager(llm_engine: Any) -> Any:
    """The scheduler's KV cache manager of an in-process ``LLMEngine`` (None:
    the core runs in another process, or a layout this vLLM does not have)."""
    client = getattr(llm_engine, "engine_core", None)  # InprocClient in process
    core = getattr(client, "engine_core", None)  # its EngineCore
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None or getattr(scheduler, "connector", None) is not None:
        return None  # a KV connector looks up through its own path
    return getattr(scheduler, "kv_cache_manager", None)


def install(llm_engine: Any) -> bool:
    """Make the in-process engine honour :data:`PREFIX_KEY` marks. True when
    it does; False (nothing changed) when its core runs in another process,
    prefix caching is off, or it has a KV connector. Installed once: the
    wrappers live on the scheduler's objects and go with the engine."""
    manager = _kv_cache_manager(llm_engine)
    if manager is None or not getattr(manager, "enable_caching", False):
        return False
    if manager in _WRAPPED:
        return True
    coordinator = manager.coordinator
    lookup = manager.get_computed_blocks
    register = coordinator.cache_blocks

    def get_computed_blocks(request: Any) -> Any:
        found = lookup(request)
        mark = marked_prefix(request)
        if mark is None or found[1] <= mark:
            return found
        # the hit reaches rows the request writes: vLLM's lookup, capped
        blocks, hit, uncached = coordinator.find_longest_cache_hit(
            request.block_hashes, min(mark, request.num_tokens - 1))
        return manager.create_kv_cache_blocks(blocks), hit, (hit + uncached if uncached else 0)

    def cache_blocks(request: Any, num_computed_tokens: int) -> None:
        mark = marked_prefix(request)
        if mark is not None:
            num_computed_tokens = min(num_computed_tokens, mark)
        register(request, num_computed_tokens)

    manager.get_computed_blocks = get_computed_blocks
    coordinator.cache_blocks = cache_blocks
    _WRAPPED.add(manager)
    return True


def registered_blocks(llm_engine: Any) -> dict[Any, int]:
    """How many KV blocks the in-process engine's prefix cache holds under
    each block hash (with its KV cache group) now: what a later request
    could be handed. Empty when the core runs in another process."""
    manager = _kv_cache_manager(llm_engine)
    if manager is None:
        return {}
    pool = manager.block_pool
    held = Counter(b.block_hash for b in pool.blocks if b.block_hash is not None)
    held.update(h for more in pool.cached_block_hashes_by_block.values() for h in more)
    return dict(held)
