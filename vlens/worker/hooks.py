"""The hook state of one vLLM worker: what vlens keeps between steps.

:class:`WorkerHooks` installs the hooks (once), plans every step with
:func:`vlens.worker.planner.plan_step` (from the runner's arrays, with the
batch's grouping reused while the batch holds), runs each (site, layer)'s
part of the plan (``site_ops``), keeps each step's reads once for all its
requests in a :class:`~vlens.worker.records.StepLog` (journaled, ``journal.py``),
and builds one :class:`~vlens.worker.records.RequestRecord` per traced request
when the client collects. Its parts are composed, each with its own
declared state: the per-request state (plans, records, journal, edit
functions: :class:`~vlens.worker.collect.RequestBook`, ``collect.py``),
the head sites' work (:class:`~vlens.worker.head_sites.HeadSites`) and
the step counters (:class:`~vlens.worker.collect.Counters`); the RPC surface the client calls
is ``extension.py``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from vlens.protocol.sites import HEAD_SITES, ModelSites, resolve_sites
from vlens.protocol.tensors import decode_tensor
from vlens.worker.attention import head_refusals
from vlens.worker.collect import Counters, RequestBook
from vlens.worker.finite import WrittenRows
from vlens.worker.head_sites import HeadSites
from vlens.worker.journal import StepArrays, kept, rows_of
from vlens.worker.layout import token_axis
from vlens.worker.planner import StepPlan, plan_step
from vlens.worker.records import to_host
from vlens.worker.steplog import StepLog
from vlens.worker.site_ops import apply_adds, apply_sets, reduce_rows, run_edit
from vlens.worker.vectors import VectorStore
from vlens.worker.features import FeatureStore
from vlens.worker.gemm import packed_matmul

__all__ = ["WorkerHooks"]


class WorkerHooks:
    """The hook state of one worker: installed once, removed on teardown."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.runner = worker.model_runner
        self.model = self.runner.model
        self.sites: ModelSites = resolve_sites(self.model)
        self.reader = int(getattr(worker, "rank", 0)) == 0
        try:  # ranks sharing the attention heads (each holds heads / tp of them)
            self.tp = int(worker.vllm_config.parallel_config.tensor_parallel_size)
        except AttributeError:  # pragma: no cover - another worker layout
            self.tp = 1
        cfg = self.runner.model_config.hf_config
        self.hidden = int(getattr(cfg, "get_text_config", lambda: cfg)().hidden_size)
        self.handles: list[Any] = []
        self.step: StepPlan | None = None
        self._last_step: StepPlan | None = None  # the last planned step (reused in decode)
        self.log: StepLog | None = None  # the current step's reads, for every request
        self.vectors = VectorStore(self.hidden, next(self.model.parameters()).device)
        # SAEs for feature reads, each encoder packed for the engine's CPU kernel
        self.features = FeatureStore(self.vectors.device, pack=packed_matmul)
        #: plans, records, journal, edit functions: per request, between steps
        self.book = RequestBook(self.runner, self.vectors)
        self.heads = HeadSites(self.sites, self.vectors, self.tp, self.reader,
                               self.book.records)
        self.counters = Counters()
        self.compiled = False
        self._codes: list[tuple[Any, int]] = []  # compiled mode: code -> (spec, layer)
        self._code_of: dict[tuple[str, int], int] = {}  # (site, layer) -> code
        self._step_codes: frozenset[int] = frozenset()  # codes the current step wants
        self._code_base: int | None = None
        #: sites this engine leaves unhooked, and why (head sites in
        #: compiled mode and under tensor parallelism)
        self.unhooked: dict[str, str] = {}
        #: this step's writes, checked for non-finite rows when it ends
        self.written = WrittenRows(self.book, self.counters)
        # the current step's marks of the counters (None: not a decode step)
        self._decode_mark: tuple[int, int, int] | None = None

    # -- installation -------------------------------------------------------
    def install(self, compiled: bool = False) -> None:
        """Register the step hooks on the whole model and one hook per
        (site, layer). ``compiled``: the per-site hooks only call vlens's
        operators (see ``ops.py``); this must happen before vLLM
        traces the model."""
        if self.handles:
            return
        self.compiled = compiled
        self.handles.append(
            self.model.register_forward_pre_hook(self._begin_step, with_kwargs=True)
        )
        self.handles.append(self.model.register_forward_hook(self._end_step))
        if compiled:  # (the operators are registered with torch only then)
            from vlens.worker import ops

            self._code_base = ops.register(self)
        total_kv = int(self.runner.model_config.get_total_num_kv_heads()) if self.tp > 1 else 0
        self.unhooked = head_refusals(self.sites, self.tp, total_kv)
        if self.sites.impl == "transformers":  # the head taps need vLLM's attention function
            from vlens.worker.tf_attention import route_heads

            self.unhooked.update(route_heads(self.sites))
        for layer_idx, layer in enumerate(self.sites.layers):
            for spec in self.sites.specs.values():
                if spec.name in self.unhooked:
                    continue
                module = spec.module_of(layer)
                if compiled:
                    if spec.target is not None and spec.addend is None and (
                            spec.extract is not spec.target):
                        # the graph would hand over a value made before any
                        # change to the target: reads after a write would miss it
                        raise ValueError(
                            f"site {spec.name}: its value is not its target and its SiteSpec "
                            "gives no addend; compiled mode needs one (vlens/protocol/sites.py)")
                    code = self._code_base + len(self._codes)
                    self._code_of[(spec.name, layer_idx)] = len(self._codes)
                    self._codes.append((spec, layer_idx))
                    hook = ops.compiled_hook(spec, code, spec.pre)
                else:
                    hook = self._make_hook(spec, layer_idx)
                if spec.pre:
                    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
                else:
                    handle = module.register_forward_hook(hook, with_kwargs=True)
                self.handles.append(handle)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.step = self._last_step = None
        if self._code_base is not None:  # the compiled graph still calls the ops
            from vlens.worker import ops

            ops.unregister(self._code_base)
            self._code_base = None

    def put_vectors(self, payloads: dict[str, dict[str, Any]]) -> int:
        for key, payload in payloads.items():
            if key not in self.vectors:
                self.vectors.put(key, decode_tensor(payload))
        return len(self.vectors)

    # -- per step -----------------------------------------------------------
    # -- the RPCs' part: what the client collects, drops, and sees ---------
    def collect(self, tags: list[str], tensors: bool = False) -> dict[str, list[dict[str, Any]]]:
        return self.book.collect(tags, tensors)

    def drop(self, tags: list[str] | None) -> int:
        return self.book.drop(tags)

    def status(self) -> dict[str, Any]:
        return {
            "hooks": len(self.handles),
            **self.book.counts(),
            "vectors": len(self.vectors),
            "vector_bytes": self.vectors.nbytes,
            "saes": len(self.features),
            **self.counters.as_dict(),
        }

    def _begin_step(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Plan the step. Never raises: a failure is recorded on every
        traced request of the step, and the step runs unhooked."""
        self.step = None
        self.written.clear()  # a forward that failed before its end leaves none behind
        self.counters.steps_seen += 1
        req_ids: list[str] = []
        try:
            batch = self.runner.input_batch
            n = batch.num_reqs
            if n == 0:
                return
            req_ids = list(batch.req_ids[:n])
            self._plan_step(req_ids, args, kwargs)
        except Exception as exc:
            self.step = self._last_step = None
            self.counters.hook_errors += 1
            if self.reader:
                for r in req_ids:
                    plan = self.book.plans.get(r)
                    if plan is not None:
                        self.book.record(r, plan).error(
                            f"planning an engine step failed: {type(exc).__name__}: {exc}"
                        )

    def _plan_step(self, req_ids: list[str], args: tuple, kwargs: dict) -> None:
        plans, eager, lazy, groups = self.book.batch_plans(req_ids, self.reader)
        if not groups.planned.size:
            return
        t0 = time.perf_counter_ns()
        self.counters.steps_planned += 1
        n = len(req_ids)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        qsl = self.runner.query_start_loc.np[: n + 1].copy()
        first = self.runner.input_batch.num_computed_tokens_cpu[:n].copy()
        step = plan_step(
            req_ids,
            plans,
            qsl,
            first,
            num_padded=int(input_ids.shape[-1]) if input_ids is not None else int(qsl[-1]),
            vector_rows=self.vectors.rows,
            reader=self.reader,
            device=self.vectors.matrix.device,
            groups=groups,
            previous=self._last_step,
            vector_version=self.vectors.version,
        )
        self._last_step = step
        if step is not None and self.compiled:
            # the operators' codes this step wants: one set lookup per call
            # (kept with the plan, so a reused plan reuses it)
            codes = step.scratch.get("codes")
            if codes is None:
                codes = step.scratch["codes"] = frozenset(
                    self._code_of[k] for part in (step.reads, step.adds, step.sets, step.edits)
                    for k in part if k in self._code_of)
            self._step_codes = codes
        log = self.log = StepLog()
        if step is not None and (self.reader or self.tp > 1):
            rows = int(qsl[-1])
            ids = rows_of(input_ids, rows, flat=True)
            pos = rows_of(positions, rows, flat=False)
            if lazy:  # one entry for the step; records are built when collected
                self.book.journal.add(log, StepArrays(
                    req_ids, qsl, first, kept(ids), kept(pos), lazy))
            if eager:
                self._begin_eager(step, eager, req_ids, ids, pos, log)
            for req_id, msgs in step.problems.items():
                rec = self.book.rec(req_id)
                for msg in msgs if rec is not None else ():
                    rec.error(msg)
        self.step = step
        took = time.perf_counter_ns() - t0
        self.counters.layout_ns += took
        # a decode step: one row per request (set every planned step, so a
        # forward that failed before _end_step leaves no stale mark behind)
        decode = step is not None and int(qsl[-1]) == n
        c = self.counters
        self._decode_mark = (took, c.hook_ns, c.reduce_ns) if decode else None

    def _begin_eager(self, step: StepPlan, eager: list[int], req_ids: list[str],
                     ids: torch.Tensor | None, pos: torch.Tensor | None, log: StepLog) -> None:
        """Records kept in the forward: this step's rows of those requests."""
        ids_l = ids.tolist() if ids is not None else None
        pos_l = pos.tolist() if pos is not None else None
        for i in eager:
            entry = step.requests.get(req_ids[i])
            if entry is None:  # no rows in this step
                continue
            plan, span = entry
            self.book.record(span.key, plan).begin_step(
                span.first_position, span.length,
                ids_l[span.start : span.stop] if ids_l is not None else None,
                pos_l[span.start : span.stop] if pos_l is not None else None,
                log,
            )

    def _end_step(self, module: Any, args: tuple, output: Any) -> None:
        # Nothing may keep a reference into this step's buffers past here.
        self.written.check(self._fail)
        step, self.step = self.step, None
        log, self.log = self.log, None
        mark, self._decode_mark = self._decode_mark, None
        if mark is not None and step is not None:
            c = self.counters
            c.decode["steps"] += 1
            c.decode["layout_ns"] += mark[0]
            c.decode["hook_ns"] += c.hook_ns - mark[1]
            c.decode["reduce_ns"] += c.reduce_ns - mark[2]
        if step is not None and self.reader and self.vectors.matrix.device.type != "cpu":
            try:
                if log is not None:
                    log.to_host()
                if any(site == "attn_pattern" for site, _ in step.reads):  # kept per request
                    records = self.book.records
                    to_host([records[r] for r in step.requests if r in records])
            except Exception as exc:
                self._fail(list(step.requests), ("(copy to host)", -1), exc)

    def _make_hook(self, spec: Any, layer: int):
        key = (spec.name, layer)

        def visit(args, kwargs, output):
            step = self.step
            if step is not None and step.wants(key):
                target = spec.target
                self._visit(
                    step, key, spec,
                    lambda: spec.extract(args, kwargs, output),
                    None if target is None else (lambda: target(args, kwargs, output)),
                )

        if spec.pre:
            return lambda module, args, kwargs: visit(args, kwargs, None)
        return lambda module, args, kwargs, output: visit(args, kwargs, output)

    def visit_compiled(self, index: int, target, value) -> None:
        """Called by vlens's operators in compiled mode, every step, with the
        site's target and, at a summed site, the addend (None: the value is
        the target); at a read-only site ``value`` is the value."""
        step = self.step
        if step is None or index not in self._step_codes:  # most calls
            return
        spec, layer = self._codes[index]
        key = (spec.name, layer)
        if target is not None and spec.addend is not None:
            # summed when asked, after whatever changed the target: reads and
            # edits see the steered value, as in eager mode
            get_value = (lambda: target) if value is None else (lambda: value + target)  # noqa: E731
        else:
            # a writable site here is its own target (checked at install)
            value = target if value is None else value
            get_value = lambda: value  # noqa: E731
        self._visit(step, key, spec, get_value, None if target is None else (lambda: target))

    def _fail(self, req_ids, key, exc: BaseException) -> None:
        self.counters.hook_errors += 1
        site, layer = key
        msg = f"site {site}, layer {layer}: {type(exc).__name__}: {exc}"
        for r in req_ids:
            rec = self.book.rec(r)
            if rec is not None:
                rec.error(msg)

    def _visit(self, step: StepPlan, key, spec, get_value, get_target) -> None:
        """Run this step's adds, edits and reads at one (site, layer).
        ``get_value()`` is the site's canonical value, ``get_target()`` the
        tensor changes are added to (None: a read-only site)."""
        t0 = time.perf_counter_ns()
        site, layer = key
        label = f"{site}[{layer}]"
        if key in step.sets:
            self._apply_sets(step, key, get_value, get_target, label)
        batch = step.adds.get(key)
        sharded = self.tp > 1 and site in HEAD_SITES  # this rank holds only its heads
        if batch is not None:
            try:
                matrix = self.heads.add_matrix(site, layer, batch)
                ok, rows = apply_adds(matrix, batch, step.layout, get_value, get_target, label,
                                      self.features)
                self.written.add((ok, rows, key, "a steering add", step.layout))
            except Exception as exc:  # the requests concerned get the error
                self._fail(batch.req_ids, key, exc)
        for call in step.edits.get(key, ()):
            try:
                if sharded:
                    raise ValueError(
                        "edit= functions at the head sites would see one tensor-parallel "
                        "rank's heads only: use a Steer at z, or tensor_parallel_size=1")
                fn = self.book.edit_fns.get(call.edit.fn)
                if fn is None:
                    raise LookupError(f"edit function {call.edit.fn} never reached this worker")
                copied, ok = run_edit(fn, step.layout, spec.name, get_value, get_target, call,
                                      label)
                if ok is not None:
                    self.written.add((ok, None, key, ("its edit= function", call.req_id),
                                          step.layout))
                rec = self.book.rec(call.req_id) if copied else None
                if rec is not None:
                    rec.copied_bytes += copied
            except Exception as exc:
                self._fail([call.req_id], key, exc)
        groups = step.reads.get(key)
        if groups:
            try:
                if site == "attn_pattern":
                    self.heads.read_pattern(step, get_value(), groups, layer, label)
                else:
                    t1 = time.perf_counter_ns()  # a summed site's sum: the read's own arithmetic
                    value = get_value()
                    self.counters.reduce_ns += time.perf_counter_ns() - t1
                    self._read(step, spec, value, groups, layer, label)
            except Exception as exc:  # reported to the client, never swallowed
                self._fail([r for g in groups for r in g.req_ids], key, exc)
        self.counters.hook_ns += time.perf_counter_ns() - t0

    def _apply_sets(self, step: StepPlan, key, get_value, get_target, label: str) -> None:
        """Ablations and patched cells at one (site, layer): before the adds,
        so a steer on an ablated site adds to what the ablation left."""
        batch = step.sets.get(key)
        if batch is None:
            return
        try:
            if get_target is None:
                raise ValueError(f"site {key[0]} is read-only: it cannot be ablated or patched")
            if self.tp > 1 and key[0] in HEAD_SITES:
                raise ValueError(
                    f"ablating or patching {key[0]} under tensor parallelism ({self.tp} ranks, "
                    "each holding its own heads) is not supported yet: use "
                    "tensor_parallel_size=1, or a residual site")
            ok, rows = apply_sets(self.vectors.matrix_of, batch, step.layout, get_value,
                                  get_target, label)
            self.written.add((ok, rows, key, "an ablation or patched cell", step.layout))
        except Exception as exc:  # the requests concerned get the error
            self._fail(batch.req_ids, key, exc)

    def _read(self, step, spec, value, groups, layer, label) -> None:
        axis = token_axis(value, step.layout, site=label)
        heads = None
        if spec.name in HEAD_SITES:
            m = self.sites.attention[layer]
            heads = int(m.num_kv_heads if spec.name in ("k", "v") else m.num_heads)
        elif spec.name != "positions" and value.shape[-1] != self.hidden:
            raise ValueError(
                f"its value has width {value.shape[-1]}, not the hidden size "
                f"{self.hidden}: it is sharded across tensor-parallel ranks, "
                "and vlens does not return one rank's shard"
            )
        flat = value[0] if axis == 1 else value
        if axis == 1 and value.shape[0] != 1:
            raise ValueError(f"site {label}: expected [1, T, ...], got {list(value.shape)}")
        for g in groups:
            try:
                self._read_group(g, flat, heads, layer)
            except Exception as exc:  # this group's requests only: never the step's others
                self._fail(g.req_ids, (spec.name, layer), exc)

    def _read_group(self, g, flat: torch.Tensor, heads: int | None, layer: int) -> None:
        """One group's read: one gather and one reduction for every request in
        the group; the rows are kept once for the group (cut per request after
        the run)."""
        log = self.log
        # rows the planner built from the step's offsets: inside the step
        view = g.bounds is not None and g.read.reduce in ("norm", "dla")  # a new tensor: a view
        if view:
            rows = flat[g.bounds[0] : g.bounds[1]]
        else:
            rows = flat.index_select(0, g.index_on(flat.device))
        if heads is not None:  # [n, heads * head_dim] -> [n, heads, head_dim]
            rows = self.heads.gather_heads(rows, -1)
            rows = rows.reshape(rows.shape[0], heads * self.tp, -1)
        t0 = time.perf_counter_ns()
        parts = reduce_rows(self.model, rows, g.read, self.features, layer, copied=not view)
        self.counters.reduce_ns += time.perf_counter_ns() - t0
        if not self.reader or log is None:  # a non-reading rank joined a collective
            return
        for part, t in parts.items():
            if t.dim() == 0 or t.shape[0] != rows.shape[0]:
                # one row per gathered row, or the log could not be cut per request
                raise ValueError(f"read {g.read.key} gave {list(t.shape)} for "
                                 f"{rows.shape[0]} rows")
            log.put((g.read.key, part, layer), t, g)
