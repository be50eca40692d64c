"""vlens inside every vLLM worker: the RPC surface the client calls.

The hook state behind it is :class:`~vlens.worker.hooks.WorkerHooks`
(``hooks.py``, a thin shell around the pure step planner); what each hook
does at one (site, layer) is in ``site_ops.py``.

``VlensWorkerExtension`` is handed to ``vllm.LLM(worker_extension_cls=...)``;
vLLM mixes it into its worker class, so ``self`` is the worker and
``self.model_runner.model`` the torch model. The client talks to it only
through ``collective_rpc("vlens_<method>", args=...)`` with plain
dicts/lists/strings/bytes, so the same code serves an engine in the
notebook's own process and one in other processes.

Per forward step:

1. a pre-hook on the whole model reads the runner's arrays (request order,
   ``query_start_loc``, computed-token counts, the padded row count) and
   each request's plan from ``SamplingParams.extra_args["vlens"]``, and
   calls :func:`vlens.worker.planner.plan_step`; every traced request's
   :class:`~vlens.worker.records.RequestRecord` then learns which positions this
   step runs (it cuts itself back when vLLM recomputes rows);
2. one hook per (site, layer), installed once, executes its part of the
   plan: the batched steering add, then ``edit=`` functions, then reads
   (gathered and reduced once per group, copied out of engine memory);
3. ``vlens_collect`` hands each record back as plain data and forgets it.

Every rank runs the same hooks (writes must land on every tensor-parallel
rank); only rank 0 keeps what it reads. Nothing raised inside a hook, the
step pre-hook included, leaves the forward: errors are recorded on the
requests concerned and raised by the client when it collects them.
"""

from __future__ import annotations

from typing import Any

import torch

from vlens.worker.attention import head_info
from vlens.worker.hooks import WorkerHooks

__all__ = ["VlensWorkerExtension", "worker_qualname"]


def _plain_count_greater_equal(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return (x >= values).sum(-1)


def _avoid_logprob_compile() -> None:
    """On CPU, vLLM compiles one tiny logprob-ranking kernel with
    torch.compile the first time any request asks for logprobs (10-15 s).
    The eager expression computes the same ranks; use it there. Called when
    the extension is set up, never at import."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        import vllm.v1.sample.sampler as sampler

        if hasattr(sampler, "batched_count_greater_than"):
            sampler.batched_count_greater_than = _plain_count_greater_equal
    except ImportError:  # pragma: no cover - layout of vLLM changed
        pass


def _kv_cache_bytes(worker: Any) -> int | None:
    """Bytes of the KV-cache tensors this worker's model runner holds (each
    storage counted once: layers may share one); None when not found."""
    todo = [getattr(getattr(worker, "model_runner", None), "kv_caches", None)]
    storages: dict[int, int] = {}
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
    return sum(storages.values()) or None


class VlensWorkerExtension:
    """Mixed into vLLM's worker by ``worker_extension_cls``; call its methods
    with ``llm.collective_rpc("vlens_setup")`` and so on. Arguments and
    results are plain data (dicts, lists, str, bytes), except ``edit=``
    functions, which cross as Python objects."""

    def _vlens(self) -> WorkerHooks:
        hooks = getattr(self, "_vlens_hooks", None)
        if hooks is None:
            hooks = WorkerHooks(self)
            self._vlens_hooks = hooks
        return hooks

    def vlens_setup(self) -> dict[str, Any]:
        """Install the hooks (once) and describe the model."""
        _avoid_logprob_compile()
        runner = getattr(self, "model_runner", None)
        if runner is not None and not hasattr(runner, "input_batch"):
            # vLLM's Model Runner V2 (its CUDA default) keeps no per-request
            # batch of the kind the step planner reads
            raise RuntimeError(
                f"vlens needs vLLM's V1 model runner, and this engine runs "
                f"{type(runner).__name__} (Model Runner V2, forced by a setting such as "
                "watermarking): start it with VLLM_USE_V2_MODEL_RUNNER=0 and without "
                "the settings that force V2")
        hooks = self._vlens()
        hooks.install()
        return {
            "impl": hooks.sites.impl,
            "architecture": hooks.sites.architecture,
            "n_layers": hooks.sites.n_layers,
            "hidden_size": hooks.hidden,
            # bounds what a write may add (vlens.checks.write_bound)
            "dtype": str(next(hooks.model.parameters()).dtype).removeprefix("torch."),
            "sites": sorted(set(hooks.sites.specs) - set(hooks.unhooked)),
            "rank": int(getattr(self, "rank", 0)),
            "hooks": len(hooks.handles),
            # sites this engine lacks, and why, as the worker sees them
            "worker_absent": {**{k: v for k, v in hooks.sites.absent.items()},
                              **hooks.unhooked},
            **head_info(hooks.sites, hooks.tp),
            # this worker's KV cache (the Session's start line shows the total)
            "kv_cache_bytes": _kv_cache_bytes(self),
        }

    def vlens_put_vectors(self, payloads: dict[str, dict[str, Any]]) -> int:
        """Store steering vectors (``{id: encoded tensor}``); returns how many
        this worker holds."""
        return self._vlens().put_vectors(payloads)

    def vlens_drop_vectors(self, ids: list[str]) -> int:
        """Forget these steering vectors; returns how many this worker holds."""
        store = self._vlens().vectors
        for i in ids:
            store.drop(i)
        return len(store)

    def vlens_put_saes(self, payloads: dict[str, dict[str, Any]]) -> int:
        """Store sparse autoencoders for feature reads (``{id: payload}``,
        see ``worker/features.py``); returns how many this worker holds."""
        return self._vlens().features.put(payloads)

    def vlens_drop_saes(self, ids: list[str]) -> int:
        """Forget these SAEs (``Engine.release_saes``); returns how many this worker holds."""
        return self._vlens().features.drop(ids)

    def vlens_put_edits(self, fns: dict[str, Any]) -> int:
        book = self._vlens().book
        book.edit_fns.update(fns)
        return len(book.edit_fns)

    def vlens_drop_edits(self, ids: list[str]) -> int:
        book = self._vlens().book
        for i in ids:
            book.edit_fns.pop(i, None)
        return len(book.edit_fns)

    def vlens_collect(self, tags: list[str], tensors: bool = False
                      ) -> dict[str, list[dict[str, Any]]]:
        """Hand back (and forget) what was read for requests with these tags
        (``tensors``: reads on the host as tensors of their own, for a caller
        in this process; else as bytes, which cross any process)."""
        return self._vlens().collect(list(tags), bool(tensors))

    def vlens_drop(self, tags: list[str] | None = None) -> int:
        """Forget what was read for these tags (all when None)."""
        return self._vlens().drop(None if tags is None else list(tags))

    def vlens_status(self) -> dict[str, Any]:
        return self._vlens().status()

    def vlens_teardown(self) -> int:
        """Remove every vlens hook; returns how many records were dropped."""
        hooks = self._vlens()
        hooks.remove()
        return hooks.drop(None)


# -- compiled mode: vLLM's worker classes with the hooks in before the trace --
def worker_qualname(gpu: bool) -> str:
    return f"{__name__}.{'CompiledGPUWorker' if gpu else 'CompiledCPUWorker'}"


def _with_hooks_before_compile(name: str, base: type) -> type:
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        base.load_model(self, *args, **kwargs)
        self._vlens().install(compiled=True)  # from VlensWorkerExtension

    # the extension among the bases already: vLLM then leaves the class as
    # it is (it would refuse to add it again to a subclass of a worker class
    # an eager engine in this process has already extended)
    return type(name, (base, VlensWorkerExtension), {
        "load_model": load_model,
        "__module__": __name__,
        "__doc__": f"vLLM's {base.__name__}, with vlens's hooks installed before compilation.",
    })


def __getattr__(name: str) -> type:
    # made on first use, so importing this module never imports a worker
    # class the platform lacks
    if name == "CompiledCPUWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker as base
    elif name == "CompiledGPUWorker":
        from vllm.v1.worker.gpu_worker import Worker as base
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = _with_hooks_before_compile(name, base)
    globals()[name] = cls
    return cls
