"""Build and own one ``vllm.LLM`` with vlens's worker extension.

This is the only module that imports vLLM, and only when an Engine is made.
It chooses settings that make a notebook engine work on the first try (see
``env.py``), refuses settings under which hooks would silently not fire, and
speaks to the workers only through ``collective_rpc`` so the same code runs
in-process and out of process.
"""

from __future__ import annotations

import json
import threading
import weakref
from pathlib import Path
from typing import Any

from vlens.engine.env import apply_env_defaults
from vlens.errors import ClosedError, VlensError

__all__ = ["Engine", "EXTENSION"]

EXTENSION = "vlens.engine.worker.VlensWorkerExtension"

_REFUSED = {
    "worker_extension_cls": "vlens sets its own worker extension",
}


def _saved_config(model: str) -> dict[str, Any] | None:
    """A local checkpoint's config.json, if it has a readable one."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _saved_dtype(model: str) -> str | None:
    """The dtype a local checkpoint's config.json declares, if any."""
    cfg = _saved_config(model)
    if cfg is None:
        return None
    text = cfg.get("text_config") or {}
    return cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")


class Engine:
    """One live vLLM engine with vlens's hooks installed in every worker.

    ``info`` describes the model (``n_layers``, ``hidden_size``, ``impl``
    "native" or "transformers", ``sites``). ``lock`` serialises runs: vLLM's
    offline ``LLM`` is not safe to drive from two threads at once.
    """

    def __init__(self, model: str | Path, **llm_kwargs: Any) -> None:
        if llm_kwargs.get("enforce_eager", True) is not True:
            raise VlensError(
                "enforce_eager=False is not supported: in compiled mode vLLM runs "
                "a captured graph and vlens's hooks would silently never fire. "
                "Leave enforce_eager out (vlens sets it to True)."
            )
        for key, why in _REFUSED.items():
            if key in llm_kwargs:
                raise VlensError(f"{key}= cannot be passed: {why}")
        compilation = llm_kwargs.get("compilation_config")
        if compilation not in (None, 0) and not (
            isinstance(compilation, dict) and compilation.get("mode", 0) in (0, None)
        ):
            raise VlensError(
                f"compilation_config={compilation!r} would compile the model and "
                "vlens's hooks would not fire; leave it out"
            )
        self.model = str(model)
        self.llm_kwargs = dict(llm_kwargs)
        # An architecture vlens cannot hook is refused before vLLM starts
        # (nothing to shut down); vlens.architectures says which it knows.
        config = _saved_config(self.model)
        arch = None
        if config is not None:
            from vlens.architectures import check_model_config

            arch = check_model_config(config, self.llm_kwargs.get("model_impl"))
        if "dtype" not in self.llm_kwargs and _saved_dtype(self.model) == "float32":
            # vLLM downcasts float32 checkpoints to 16 bits by default; for
            # looking inside a model the saved precision is the faithful one.
            self.llm_kwargs["dtype"] = "float32"
        self.env = apply_env_defaults()
        self.lock = threading.RLock()
        self._closed = False
        self.generate_calls = 0  # how many engine batches this engine has run
        self.vector_ids: set[str] = set()  # steering vectors the workers hold

        from vllm import LLM  # heavy: only now

        self.llm = LLM(
            model=self.model,
            enforce_eager=True,
            worker_extension_cls=EXTENSION,
            **self.llm_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        try:
            self.info: dict[str, Any] = self.rpc("vlens_setup")[0]
        except BaseException:
            # a model the workers cannot hook leaves no engine behind
            self._closed = True
            client = getattr(self.llm.llm_engine, "engine_core", None)
            self.llm = None
            if client is not None:
                _shutdown(client, last=not any(e.in_process for e in _OPEN))
            raise
        cfg = self.llm.llm_engine.model_config
        self.info["max_model_len"] = int(cfg.max_model_len)
        self.info["vocab_size"] = int(cfg.get_vocab_size())
        self.info["device"] = str(self.llm.llm_engine.vllm_config.device_config.device_type)
        # sites this architecture lacks, and why (for the Session's errors)
        self.info["absent_sites"] = arch.absent_sites(config) if arch is not None else {}
        _OPEN.add(self)

    # -- state --------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError(
                "this engine has been closed; start a new vlens.Session() to run again"
            )

    # -- calls into the workers ---------------------------------------------
    def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every worker; one result per worker, rank 0 first."""
        self.check_open()
        return self.llm.collective_rpc(method, args=args)

    def generate(self, prompts: list[Any], params: list[Any], progress: Any = None) -> list[Any]:
        """Run one engine batch. ``progress``: a :class:`Progress` (or None).

        If anything interrupts the run (the notebook's stop button raises
        KeyboardInterrupt between steps), every request still in the engine
        is aborted before the exception goes on, so the next call starts
        from an empty engine instead of finishing this call's leftovers."""
        self.check_open()
        self.generate_calls += 1
        try:
            return self.llm.generate(prompts, params, use_tqdm=progress or False)
        except BaseException:
            self.abort_all()
            raise

    def unfinished(self) -> int:
        """Requests still in the engine (0 between calls)."""
        return int(self.llm.llm_engine.get_num_unfinished_requests())

    def abort_all(self) -> int:
        """Abort every request still in the engine; returns how many."""
        engine = self.llm.llm_engine
        ids = list(engine.output_processor.request_states)
        if ids:
            engine.abort_request(ids, internal=True)
        # let the engine core retire them (bounded: never spin forever)
        for _ in range(1000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        return len(ids)

    def close(self) -> None:
        """Remove the hooks and shut the engine down. Safe to call twice."""
        if self._closed:
            return
        try:
            self.rpc("vlens_teardown")
        finally:
            self._closed = True
            _OPEN.discard(self)
            llm, self.llm = self.llm, None
            client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if client is not None:
                _shutdown(client, last=not any(e.in_process for e in _OPEN))
            del llm, client
            import gc

            gc.collect()

    @property
    def in_process(self) -> bool:
        return self.env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


# Engines open in this process. vLLM's in-process shutdown also tears down
# the process-wide torch.distributed state, which other in-process engines
# still use; only the last one may do that.
_OPEN: weakref.WeakSet[Engine] = weakref.WeakSet()


def _shutdown(client: Any, *, last: bool) -> None:
    core = getattr(client, "engine_core", None)  # in-process: the EngineCore itself
    finalizer = getattr(client, "_finalizer", None)
    if last or core is None or finalizer is None or not hasattr(core, "scheduler"):
        client.shutdown()
        return
    if finalizer.detach() is None:  # already shut down
        return
    # EngineCore.shutdown minus cleanup_dist_env_and_memory()
    manager = getattr(core, "structured_output_manager", None)
    if manager is not None:
        manager.clear_backend()
    if core.model_executor:
        core.model_executor.shutdown()
    if core.scheduler:
        core.scheduler.shutdown()
    import gc

    gc.unfreeze()
