"""What every engine vlens starts does before and after vLLM starts, shared
by :class:`~vlens.engine.Engine` (a notebook's ``vllm.LLM``) and ``vlens
serve`` (vLLM's ``AsyncLLM``).

Before: the model is a local folder (:func:`resolve_model`); its saved
``config.json`` names an architecture vlens can hook, refused before vLLM
starts otherwise (:class:`Checkpoint`); a float32 checkpoint runs in
float32 (vLLM would downcast it). After: the model facts the Session checks
every call against (:func:`engine_info`, from the workers' ``vlens_setup``
and vLLM's config).
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlens.errors import VlensError
from vlens.models import resolve as registry_folder, toyworld_path
from vlens.protocol.architectures import check_model_config

__all__ = ["EXTENSION", "Checkpoint", "engine_info", "resolve_model"]

#: the worker extension every vlens engine asks vLLM for (``worker_extension_cls``)
EXTENSION = "vlens.worker.extension.VlensWorkerExtension"


def resolve_model(model: str | os.PathLike | None) -> str:
    """The model folder, absolute (None: the bundled toy-world model).
    vlens loads local models only: anything else is refused."""
    if model is None:
        return str(toyworld_path())
    model = registry_folder(model)  # a registry name → its fetched folder (vlens/models/registry.py)
    path = Path(model).expanduser()
    if path.exists():
        return str(path.resolve())
    raise VlensError(
        f"model {str(model)!r} is not a folder on this machine. vlens loads local "
        "models only (no downloads): pass the folder that holds config.json and "
        "the weights, or leave model out for the bundled toy-world model."
    )


def saved_config(model: str) -> dict[str, Any] | None:
    """A local checkpoint's config.json, if it has a readable one."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


@dataclass
class Checkpoint:
    """A local checkpoint as vlens sees it before vLLM starts: its saved
    config (None: none readable) and the architecture row it matches (None
    when there is no config to check)."""

    model: str
    config: dict[str, Any] | None
    arch: Any = None

    @classmethod
    def check(cls, model: str, model_impl: str | None = None) -> Checkpoint:
        """Read the checkpoint's config and refuse an architecture vlens
        cannot hook (nothing to shut down yet)."""
        config = saved_config(model)
        arch = None
        if config is not None:
            arch = check_model_config(config, model_impl)
        return cls(model, config, arch)

    @property
    def saved_dtype(self) -> str | None:
        """The dtype the checkpoint's config.json declares, if any."""
        cfg = self.config
        if cfg is None:
            return None
        text = cfg.get("text_config") or {}
        return (cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype")
                or text.get("torch_dtype"))

    @property
    def default_dtype(self) -> str | None:
        """The dtype to ask vLLM for when the user gave none: vLLM downcasts
        float32 checkpoints to 16 bits by default; for looking inside a model
        the saved precision is the faithful one (None: vLLM's default)."""
        return "float32" if self.saved_dtype == "float32" else None

    def absent_sites(self) -> dict[str, str]:
        """Sites this architecture lacks, and why."""
        return self.arch.absent_sites(self.config) if self.arch is not None else {}


def engine_info(setup: dict[str, Any], model_config: Any, vllm_config: Any, *,
                compiled: bool, checkpoint: Checkpoint) -> dict[str, Any]:
    """The model facts a Session checks against: the workers' ``vlens_setup``
    answer (rank 0) completed from vLLM's model and engine config."""
    info = dict(setup)
    info["max_model_len"] = int(model_config.max_model_len)
    info["vocab_size"] = int(model_config.get_vocab_size())
    info["compiled"] = compiled
    info["device"] = str(vllm_config.device_config.device_type)
    # KV-cache blocks the engine got (how many tokens it can hold at once)
    info["kv_cache_blocks"] = vllm_config.cache_config.num_gpu_blocks
    info["kv_block_size"] = vllm_config.cache_config.block_size
    # sites this architecture lacks, and why (for the Session's errors)
    info["absent_sites"] = {**info.pop("worker_absent", {}), **checkpoint.absent_sites()}
    return info


@contextmanager
def frozen_heap(in_process: bool) -> Iterator[None]:
    """The process's objects set aside from the garbage collector while an
    in-process vLLM engine starts. vLLM runs several full collections while
    it starts (memory profiling, then ``gc.freeze()`` of the whole heap once
    warm), each walking every object the process holds: about 0.4 s each in
    a fresh kernel, over 0.6 s in one holding a few million objects. One
    collection here, then a freeze, and theirs walk only what the engine
    made. The end state is vLLM's own (the heap frozen while the engine
    serves; its shutdown unfreezes); a failed start unfreezes what was
    frozen here. An engine core in another process freezes only its own."""
    if not in_process:
        yield
        return
    was_frozen = gc.get_freeze_count() > 0
    gc.collect()  # what vLLM's first collection would free, freed first
    gc.freeze()
    try:
        yield
    except BaseException:
        if not was_frozen:
            gc.unfreeze()
        raise

