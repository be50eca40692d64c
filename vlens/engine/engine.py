"""Build and own one ``vllm.LLM`` with vlens's worker extension.

The client side imports vLLM here only, when an Engine is made (the worker
extension, ``vlens/worker/``, runs inside vLLM's workers and imports it there).
It chooses settings that make a notebook engine work on the first try (see
``env.py``), refuses settings under which hooks would silently not fire, and
speaks to the workers only through ``collective_rpc`` so the same code runs
in-process and out of process. It starts quietly unless asked
(``verbose=``, see ``quiet.py``): vLLM's log stays out of the notebook.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from vlens.engine import prefix_cache
from vlens.engine.doctor import require_startable
from vlens.engine.driver import STEP, Driver
from vlens.engine.env import apply_env_defaults
from vlens.engine.quiet import quiet_calls, quiet_engine_args, quiet_start, verbose_default
from vlens.engine.startup import EXTENSION, Checkpoint, engine_info, frozen_heap
from vlens.errors import ClosedError, VlensError
from vlens.protocol.tensors import encode_tensor

__all__ = ["Engine", "EXTENSION", "start_options"]

# verbose= for the Engines made inside start_options() (a Session's Runner
# makes its Engine from the vLLM arguments alone)
_VERBOSE: ContextVar[bool | None] = ContextVar("vlens_engine_verbose", default=None)


@contextmanager
def start_options(*, verbose: bool | None) -> Iterator[None]:
    """Engines made in this block start with ``verbose`` (None: the
    ``VLENS_VERBOSE`` default) unless given their own."""
    token = _VERBOSE.set(verbose)
    try:
        yield
    finally:
        _VERBOSE.reset(token)

_REFUSED = {
    "worker_extension_cls": "vlens sets its own worker extension",
    "worker_cls": "vlens picks the worker class (compiled mode needs its own)",
}


class Engine:
    """One live vLLM engine with vlens's hooks installed in every worker.

    ``info`` describes the model (``n_layers``, ``hidden_size``, ``impl``
    "native" or "transformers", ``sites``). ``driver`` steps the engine for
    every caller (``driver.py``); ``lock`` guards vlens's own bookkeeping of
    what the workers hold (vectors, SAEs) and the close.

    ``verbose``: show vLLM's log (its start and its calls) as vLLM prints
    it; by default (``VLENS_VERBOSE`` unset) the engine starts and runs
    quietly, errors only (``quiet.py``). Never passed on to vLLM.
    ``started_in``: seconds the start took, vLLM's import included.

    Implements :class:`vlens.backend.EngineAPI`, the interface the runner uses.
    """

    remote = False  # vLLM in this process's reach, not a ``vlens serve`` server
    info: dict[str, Any]
    tokenizer: Any
    lock: Any
    model: str
    compiled: bool
    generate_calls: int
    #: whether requests marked with ``prefix_cache.PREFIX_KEY`` read and
    #: register prefix-cache blocks up to their mark only (an in-process core
    #: with prefix caching on): patching's cells then go without a cache salt
    prefix_marks: bool = False

    def __init__(self, model: str | Path, *, verbose: bool | None = None,
                 **llm_kwargs: Any) -> None:
        t0 = time.perf_counter()
        if verbose is None:
            verbose = _VERBOSE.get()
        self.verbose = verbose_default() if verbose is None else bool(verbose)
        eager = llm_kwargs.pop("enforce_eager", True)
        if not isinstance(eager, bool):
            raise VlensError(f"enforce_eager must be True or False, got {eager!r}")
        for key, why in _REFUSED.items():
            if key in llm_kwargs:
                raise VlensError(f"{key}= cannot be passed: {why}")
        compilation = llm_kwargs.get("compilation_config")
        if eager and compilation not in (None, 0) and not (
            isinstance(compilation, dict) and compilation.get("mode", 0) in (0, None)
        ):
            raise VlensError(
                f"compilation_config={compilation!r} compiles the model, but the "
                "engine runs eager: pass enforce_eager=False for compiled mode"
            )
        self.compiled = not eager
        require_startable()  # a known-broken environment: one line, not vLLM's trace
        self.model = str(model)
        self.llm_kwargs = dict(llm_kwargs)
        # An architecture vlens cannot hook is refused before vLLM starts
        # (nothing to shut down); vlens.protocol.architectures says which it knows.
        checkpoint = Checkpoint.check(self.model, self.llm_kwargs.get("model_impl"))
        if "dtype" not in self.llm_kwargs and checkpoint.default_dtype is not None:
            self.llm_kwargs["dtype"] = checkpoint.default_dtype
        self.env = apply_env_defaults(self.llm_kwargs)
        self.lock = threading.RLock()
        self._closed = False
        self.generate_calls = 0  # how many engine batches this engine has run
        # steering vectors the workers hold: id -> calls using it now, least
        # recently used first; unpinned ones past the cap are dropped
        self._vectors: OrderedDict[str, int] = OrderedDict()
        # SAEs the workers hold -> who holds them (ids of Session runners)
        self._saes: dict[str, set[int]] = {}
        self.vector_cache = int(os.environ.get("VLENS_VECTOR_CACHE", "256"))
        with (nullcontext() if self.verbose
              else quiet_start(single_process=self._starts_alone())):
            self._start(checkpoint)
        self.started_in = time.perf_counter() - t0
        _OPEN.add(self)

    def _starts_alone(self) -> bool:
        """Whether this engine starts without other processes (its core in
        this process, one worker): only then may a quiet start capture fd 2,
        which processes started meanwhile would keep writing to."""
        sizes = (self.llm_kwargs.get(k) or 1 for k in (
            "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
        return (self.in_process and all(size == 1 for size in sizes)
                and self.llm_kwargs.get("distributed_executor_backend") in (None, "uni"))

    def _start(self, checkpoint: Checkpoint) -> None:
        """Start vLLM and set up the hooks; sets ``llm``, ``tokenizer``, ``info``."""
        from vllm import LLM  # heavy: only now

        extra: dict[str, Any] = {}
        if self.compiled:
            extra = compiled_settings(self.llm_kwargs.pop("compilation_config", None))
        if not self.verbose:
            extra.update(quiet_engine_args(self.llm_kwargs))
        # vLLM runs the model while it starts (profiling, warm-up): never
        # beside another in-process engine's step
        starting = STEP if self.in_process else nullcontext()
        try:
            with starting, frozen_heap(self.in_process):
                self.llm = LLM(
                    model=self.model,
                    enforce_eager=not self.compiled,
                    worker_extension_cls=EXTENSION,
                    **extra,
                    **self.llm_kwargs,
                )
        except AssertionError as exc:
            if "expert parallel group is not initialized" not in str(exc):
                raise
            # vLLM makes its expert-parallel group once per process, and only
            # when the process's first engine is a mixture-of-experts model
            raise VlensError(
                f"{Path(self.model).name}: this mixture-of-experts model cannot start in a "
                "process whose first vLLM engine was a dense model (vLLM sets up its "
                "expert-parallel group only for the first engine). Close the other "
                "Sessions first (s.close()) or restart the kernel, or run this one out "
                "of process (VLLM_ENABLE_V1_MULTIPROCESSING=1 before the first Session)"
            ) from None
        self.tokenizer = self.llm.get_tokenizer()
        # one step at a time per process for in-process engines (vLLM's
        # forward context is a module global); an engine core of its own
        # process only needs its client driven by one thread at a time
        self.driver = Driver(self.llm.llm_engine, self._quiet,
                             STEP if self.in_process else threading.RLock())
        try:
            setups = self.rpc("vlens_setup")
        except BaseException:
            # a model the workers cannot hook leaves no engine behind
            self._closed = True
            client = getattr(self.llm.llm_engine, "engine_core", None)
            self.llm = None
            if client is not None:
                _shutdown(client, last=not any(e.in_process for e in _OPEN))
            raise
        setup = dict(setups[0])
        if all(s.get("kv_cache_bytes") for s in setups):  # every rank's share
            setup["kv_cache_bytes"] = sum(s["kv_cache_bytes"] for s in setups)
        engine = self.llm.llm_engine
        # requests marked with prefix_cache.PREFIX_KEY (patching's cells) share the
        # prefix cache up to their mark only; out of process they stay salted
        self.prefix_marks = self.in_process and prefix_cache.install(engine)
        self.info: dict[str, Any] = engine_info(
            setup, engine.model_config, engine.vllm_config, compiled=self.compiled,
            checkpoint=checkpoint)

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
    def _quiet(self):
        """Around a call into vLLM: a quiet engine's call shows none of
        vLLM's log below ERROR, nor its Python warnings (``quiet.py``)."""
        return nullcontext() if self.verbose else quiet_calls()

    def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every worker (between two engine steps); one
        result per worker, rank 0 first."""
        self.check_open()
        return self.driver.call(lambda: self.llm.collective_rpc(method, args=args))

    @property
    def vector_ids(self) -> set[str]:
        """Ids of the steering vectors the workers hold now."""
        return set(self._vectors)

    @contextmanager
    def hold_vectors(self, vectors: Mapping[str, Any]) -> Iterator[None]:
        """Make sure the workers hold ``vectors`` (``{id: tensor [hidden]}``)
        for the duration of the block, shipping only the missing ones.

        Vectors stay cached after the block (a widget re-running the same
        steer ships nothing), but at most ``vector_cache`` of them: past
        that, the least recently used ones no running call holds are
        dropped from the workers, so memory stays bounded however many
        distinct vectors a session makes."""
        with self.lock:
            new = {vid: encode_tensor(v) for vid, v in vectors.items() if vid not in self._vectors}
            if new:
                self.rpc("vlens_put_vectors", new)
            for vid in vectors:
                self._vectors[vid] = self._vectors.get(vid, 0) + 1
                self._vectors.move_to_end(vid)
        try:
            yield
        finally:
            with self.lock:
                for vid in vectors:
                    if vid in self._vectors:
                        self._vectors[vid] -= 1
                if not self._closed:
                    self._evict_vectors()

    def hold_saes(self, payloads: Mapping[str, dict[str, Any]], *, owner: Any = None) -> None:
        """Make sure the workers hold these SAEs' encoders (``{id: payload}``,
        ``methods/sae.py``) for ``owner`` (a Session's runner), shipping only
        the missing ones; they stay until every owner has released them."""
        with self.lock:
            new = {sid: p for sid, p in payloads.items() if sid not in self._saes}
            if new:
                self.rpc("vlens_put_saes", new)
            for sid in payloads:
                self._saes.setdefault(sid, set()).add(id(owner))

    def release_saes(self, ids: Iterable[str], *, owner: Any = None) -> None:
        """``owner`` no longer needs the SAEs ``ids``; those no other owner
        holds are dropped from the workers (a later :meth:`hold_saes` ships
        them again)."""
        with self.lock:
            gone = []
            for sid in dict.fromkeys(ids):
                holders = self._saes.get(sid)
                if holders is None:
                    continue
                holders.discard(id(owner))
                if not holders:
                    gone.append(sid)
                    del self._saes[sid]
            if gone and not self._closed:
                self.rpc("vlens_drop_saes", gone)

    @property
    def sae_ids(self) -> set[str]:
        """Ids of the SAEs the workers hold now."""
        return set(self._saes)

    def _evict_vectors(self) -> None:
        excess = len(self._vectors) - self.vector_cache
        if excess <= 0:
            return
        gone = [vid for vid, pins in self._vectors.items() if pins <= 0][:excess]
        if gone:
            self.rpc("vlens_drop_vectors", gone)
            for vid in gone:
                del self._vectors[vid]

    def request_params(self, settings: Mapping[str, Any]) -> Any:
        """vLLM's ``SamplingParams`` for one request: taken without a deep
        copy (``skip_clone``), and ``extra_args`` (vlens's plan, which only
        vlens sets) put in after vLLM's checks, which walk all of it for
        integers past 64 bits: vlens checked every one already."""
        from vllm import SamplingParams

        settings = dict(settings)
        extra = settings.pop("extra_args", None)
        sp = SamplingParams(**settings, skip_clone=True)
        sp.extra_args = extra
        return sp

    def generate(self, prompts: list[Any], params: list[Any], progress: Any = None, *,
                 owner: Any = None) -> list[Any]:
        """Run one batch of requests and return their final outputs, in
        order. ``progress``: a tqdm-like factory (or None). The requests
        share engine steps with every other caller's (the driver,
        ``driver.py``); ``owner``: whose they are (:meth:`cancel` aborts an
        owner's requests). If anything interrupts the wait (the notebook's
        stop button), this batch's requests are aborted, no one else's."""
        self.check_open()
        self.generate_calls += 1
        return self.driver.submit(prompts, params, owner=owner).result(progress)

    def stream(self, prompts: list[Any], params: list[Any], *,
               owner: Any = None) -> Iterator[list[Any]]:
        """Run one batch of requests step by step: after every engine step
        that moved them, yield each request's latest output (vLLM
        ``RequestOutput``s in prompt order, None for a request with no token
        yet; with ``n > 1`` the samples seen so far, by index). The last item
        holds every request finished, as :meth:`generate` would return them.
        Closing the generator early (a widget closed, a cell interrupted)
        aborts this batch's requests."""
        self.check_open()
        self.generate_calls += 1
        batch = self.driver.submit(prompts, params, stream=True, owner=owner)
        yield from batch.frames()

    def cancel(self, owner: Any, error: BaseException) -> int:
        """Abort every batch ``owner`` has in the engine; each waiting caller
        gets ``error``. Returns how many batches."""
        return len(self.driver.cancel_owner(owner, error))

    def unfinished(self) -> int:
        """Requests still in the engine (0 between calls)."""
        return self.driver.unfinished()

    def abort_all(self) -> int:
        """Abort every request still in the engine; returns how many."""
        return self.driver.abort_all()

    def close(self) -> None:
        """Cancel every call still running (each gets a :class:`ClosedError`),
        remove the hooks and shut the engine down. Safe to call twice, and
        from any thread."""
        with self.lock:
            if self._closed:
                return
            self.driver.close()
            try:
                self.rpc("vlens_teardown")
            finally:
                self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        _OPEN.discard(self)
        llm, self.llm = self.llm, None
        client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if client is not None:
            with self.driver.lock, self._quiet():  # never beside another engine's step
                _shutdown(client, last=not any(e.in_process for e in _OPEN))
        del llm, client
        import gc

        gc.collect()

    @property
    def in_process(self) -> bool:
        return self.env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def compiled_settings(compilation: Any) -> dict[str, Any]:
    """vLLM arguments for compiled mode: vlens's worker class (its hooks go
    in before the model is traced) and, on a GPU, piecewise CUDA graphs cut
    at vlens's operators so those run every step (see worker/ops.py)."""
    from vlens.worker.extension import worker_qualname
    from vlens.worker.ops import SPLITTING_OPS
    from vlens.engine.env import has_gpu

    gpu = has_gpu()
    out: dict[str, Any] = {"worker_cls": worker_qualname(gpu)}
    if compilation is not None and not isinstance(compilation, dict):
        raise VlensError(
            f"compilation_config={compilation!r}: vlens's compiled mode takes a dict "
            "(it adds its operators to splitting_ops)"
        )
    config = dict(compilation or {})
    if gpu:
        ops = config.get("splitting_ops")
        if ops is None:  # vLLM's own default, which naming any splitting ops replaces
            ops = default_splitting_ops(config)
        config["splitting_ops"] = list(ops) + [op for op in SPLITTING_OPS if op not in ops]
        mode = str(config.setdefault("cudagraph_mode", "PIECEWISE")).upper()
        if mode not in ("PIECEWISE", "NONE"):
            raise VlensError(
                f"cudagraph_mode={mode}: full CUDA graphs would replay vlens's steps "
                "without running its operators; use PIECEWISE (the default vlens sets)"
            )
    if config:
        out["compilation_config"] = config
    return out


def default_splitting_ops(config: dict[str, Any]) -> list[str]:
    """The splitting ops vLLM picks when none are named
    (``CompilationConfig.set_splitting_ops_for_v1``): its attention ops and,
    unless Inductor partitions the graph, its KV-cache-update ops, which it
    keeps out of the compiled pieces. Naming splitting ops (as vlens must,
    to add its own) stops vLLM from adding the latter itself."""
    from vllm.config import CompilationConfig

    ops = list(CompilationConfig._attention_ops)
    if not config.get("use_inductor_graph_partition"):
        ops += ["vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update"]
    return ops


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
