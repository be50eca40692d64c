"""vlens inside every vLLM worker.

``VlensWorkerExtension`` is handed to ``vllm.LLM(worker_extension_cls=...)``;
vLLM mixes it into its worker class, so ``self`` is the worker and
``self.model_runner.model`` the torch model. The client talks to it only
through ``collective_rpc("vlens_<method>", args=...)`` with plain
dicts/lists/strings/bytes, so the same code serves an engine in the
notebook's own process and one in other processes.

Per forward step:

1. a pre-hook on the whole model reads the runner's batch (request order,
   each request's row count, the padded row count) and each request's plan
   from ``SamplingParams.extra_args["vlens"]`` and builds a
   :class:`~vlens.batcher.StepLayout` plus, per (site, layer), the rows to
   read and one batched write (row index, vector index, scale). Steps where
   no request carries a plan cost one list scan;
2. one hook per (site, layer), installed once: first the batched steering
   add (``add_rows``: one ``index_add_`` for all requests), then ``edit=``
   functions per request (written back through ``widen``), then reads
   (``narrow``, reduced if asked, copied to float32 CPU);
3. ``vlens_collect`` hands the stored rows back as bytes and forgets them.

Every rank runs the same hooks (writes must land on every tensor-parallel
rank); only rank 0 keeps what it reads. Errors inside a hook are recorded on
the requests concerned and raised by the client when it collects them; they
never abort the engine's step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from vlens._wire import decode_tensor, encode_tensor
from vlens.engine.vectors import VectorStore
from vlens.batcher import StepLayout, add_rows, gather, narrow, token_axis, widen
from vlens.plan import PLAN_KEY, EditContext, Plan, parse_plan
from vlens.sites import ModelSites, lens_logits, resolve_sites

__all__ = ["VlensWorkerExtension"]


def _plain_count_greater_equal(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return (x >= values).sum(-1)


def _avoid_logprob_compile() -> None:
    """On CPU, vLLM compiles one tiny logprob-ranking kernel with
    torch.compile the first time any request asks for logprobs (10-15 s).
    The eager expression computes the same ranks; use it there."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        import vllm.v1.sample.sampler as sampler

        if hasattr(sampler, "batched_count_greater_than"):
            sampler.batched_count_greater_than = _plain_count_greater_equal
    except ImportError:  # pragma: no cover - layout of vLLM changed
        pass


_avoid_logprob_compile()


@dataclass
class _Record:
    """Everything read for one engine request (one sample)."""

    plan: Plan
    req_id: str
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    # (read key, part, layer) -> row chunks in step order
    chunks: dict[tuple[str, str, int], list[torch.Tensor]] = field(
        default_factory=lambda: defaultdict(list)
    )
    errors: list[str] = field(default_factory=list)
    copied_bytes: int = 0
    steered_rows: int = 0
    step_rows: list[int] = field(default_factory=list)  # rows per engine step

    def error(self, msg: str) -> None:
        if msg not in self.errors:
            self.errors.append(msg)

    def pack(self) -> dict[str, Any]:
        reads: dict[str, dict[str, Any]] = {}
        for read in self.plan.reads:
            parts = sorted({p for (k, p, _) in self.chunks if k == read.key}) or ["value"]
            out: dict[str, Any] = {"layers": list(read.layers), "site": read.site,
                                   "reduce": read.reduce}
            ok = True
            for part in parts:
                per_layer = []
                for layer in read.layers:
                    got = self.chunks.get((read.key, part, layer))
                    if not got:
                        self.error(f"site {read.site}, layer {layer}: the hook never saw this request")
                        ok = False
                        break
                    per_layer.append(torch.cat(got, 0))
                if not ok:
                    break
                lengths = {t.shape[0] for t in per_layer}
                if lengths != {len(self.token_ids)}:
                    self.error(
                        f"site {read.site}: layers read {sorted(lengths)} rows but the "
                        f"request processed {len(self.token_ids)} tokens"
                    )
                    ok = False
                    break
                out[part] = encode_tensor(torch.stack(per_layer))
            if ok:
                reads[read.key] = out
        return {
            "req_id": self.req_id,
            "token_ids": self.token_ids,
            "positions": self.positions,
            "reads": reads,
            "errors": self.errors,
            "copied_bytes": self.copied_bytes,
            "steered_rows": self.steered_rows,
            "step_rows": self.step_rows,
        }


@dataclass
class _Write:
    """One batched write at a (site, layer) in one step."""

    rows: torch.Tensor  # [n] int64 row numbers
    vec_index: torch.Tensor  # [n] int64 rows of the vector matrix
    scale: torch.Tensor  # [n] float32
    records: list  # the requests concerned (None on non-reading ranks)
    relative: torch.Tensor | None = None  # [n] bool: scale by the row's norm


@dataclass
class _ReadGroup:
    """Requests reading one (site, layer) the same way in one step: their
    rows are gathered and reduced together, then split per request."""

    read: Any  # a representative Read (same key and k for the whole group)
    spans: list
    records: list  # None on ranks that only join a collective reduction

    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.spans]


@dataclass
class _Step:
    layout: StepLayout
    # (site, layer) -> read groups
    reads: dict[tuple[str, int], list[_ReadGroup]]
    writes: dict[tuple[str, int], _Write]
    # (site, layer) -> [(record or None, span, edit, positions)]
    edits: dict[tuple[str, int], list]

    def wants(self, key: tuple[str, int]) -> bool:
        return key in self.reads or key in self.writes or key in self.edits


class _Hooks:
    """The hook state of one worker: installed once, removed on teardown."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.runner = worker.model_runner
        self.model = self.runner.model
        self.sites: ModelSites = resolve_sites(self.model)
        self.reader = int(getattr(worker, "rank", 0)) == 0
        cfg = self.runner.model_config.hf_config
        self.hidden = int(getattr(cfg, "get_text_config", lambda: cfg)().hidden_size)
        self.handles: list[Any] = []
        self.plans: dict[str, Plan | None] = {}  # req_id -> parsed plan (cache)
        self.records: dict[str, _Record] = {}
        self.step: _Step | None = None
        # steering vectors: rows of one matrix on the model's device
        self.vectors = VectorStore(self.hidden, next(self.model.parameters()).device)
        self.edit_fns: dict[str, Any] = {}
        self.hook_errors = 0
        self.steps_seen = 0
        self.steps_planned = 0
        self.layout_ns = 0
        self.hook_ns = 0

    # -- installation -------------------------------------------------------
    def install(self) -> None:
        if self.handles:
            return
        self.handles.append(
            self.model.register_forward_pre_hook(self._begin_step, with_kwargs=True)
        )
        self.handles.append(self.model.register_forward_hook(self._end_step))
        for layer_idx, layer in enumerate(self.sites.layers):
            for spec in self.sites.specs.values():
                module = spec.module_of(layer)
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
        self.step = None

    # -- vectors and edit functions ------------------------------------------
    def put_vectors(self, payloads: dict[str, dict[str, Any]]) -> int:
        for key, payload in payloads.items():
            if key not in self.vectors:
                self.vectors.put(key, decode_tensor(payload))
        return len(self.vectors)

    # -- per step -----------------------------------------------------------
    def _plan_for(self, req_id: str) -> Plan | None:
        try:
            return self.plans[req_id]
        except KeyError:
            pass
        plan = None
        state = self.runner.requests.get(req_id)
        extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
        if extra and PLAN_KEY in extra:
            plan = parse_plan(extra[PLAN_KEY])
        if len(self.plans) > 8192:  # forget requests that left long ago
            live = set(self.runner.input_batch.req_ids)
            self.plans = {k: v for k, v in self.plans.items() if k in live}
        self.plans[req_id] = plan
        return plan

    def _begin_step(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.step = None
        self.steps_seen += 1
        batch = self.runner.input_batch
        n = batch.num_reqs
        if n == 0:
            return
        req_ids = batch.req_ids[:n]
        plans = [self._plan_for(r) for r in req_ids]
        if not any(plans):
            return
        t0 = time.perf_counter_ns()
        self.steps_planned += 1
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        qsl = self.runner.query_start_loc.np[: n + 1].tolist()
        num_padded = int(input_ids.shape[-1]) if input_ids is not None else qsl[-1]
        layout = StepLayout.from_query_start_loc(
            req_ids,
            qsl,
            first_positions=batch.num_computed_tokens_cpu[:n].tolist(),
            num_padded=num_padded,
        )
        reads: dict[tuple[str, int], list] = defaultdict(list)
        edits: dict[tuple[str, int], list] = defaultdict(list)
        w_rows: dict[tuple[str, int], list] = defaultdict(list)
        ids_list = input_ids.tolist() if input_ids is not None and self.reader else None
        pos_list = (
            positions.reshape(-1, positions.shape[-1])[0].tolist()
            if positions is not None and self.reader
            else None
        )
        for req_id, plan, span in zip(req_ids, plans, layout.spans):
            if plan is None or span.length == 0:
                continue
            rec = None
            if self.reader:
                rec = self.records.get(req_id)
                if rec is None:
                    rec = self.records[req_id] = _Record(plan, req_id)
                rec.step_rows.append(span.length)
                if ids_list is not None:
                    rec.token_ids.extend(ids_list[span.start : span.stop])
                if pos_list is not None:
                    rec.positions.extend(pos_list[span.start : span.stop])
            for read in plan.reads:
                # other ranks keep nothing, but must join reductions that
                # gather across tensor-parallel ranks (the unembedding)
                if self.reader or read.reduce in ("logit_lens", "logprobs"):
                    for layer in read.layers:
                        reads[(read.site, layer)].append((rec, span, read))
            p0 = span.first_position
            for w in plan.adds:
                stop = p0 + span.length if w.stop < 0 else min(w.stop, p0 + span.length)
                start = max(w.start, p0)
                if start >= stop:
                    continue
                vec = self.vectors.get(w.vec)
                if vec is None:
                    if rec is not None:
                        rec.error(f"site {w.site}, layer {w.layer}: steering vector {w.vec} "
                                  "never reached this worker")
                    continue
                first = span.start + (start - p0)
                w_rows[(w.site, w.layer)].append((first, stop - start, vec, w.scale, rec,
                                                  w.relative))
                if rec is not None:
                    rec.steered_rows += stop - start
            for e in plan.edits:
                positions_here = tuple(range(p0, p0 + span.length))
                edits[(e.site, e.layer)].append((rec, span, e, plan, positions_here))
        writes = {}
        for key, parts in w_rows.items():
            rows: list[int] = []
            vec_index: list[int] = []
            scale: list[float] = []
            relative: list[bool] = []
            for first, m, vec, sc, _, rel in parts:
                rows.extend(range(first, first + m))
                vec_index.extend([vec] * m)
                scale.extend([sc] * m)
                relative.extend([rel] * m)
            dev = self.vectors.matrix.device
            writes[key] = _Write(
                torch.tensor(rows, dtype=torch.long, device=dev),
                torch.tensor(vec_index, dtype=torch.long, device=dev),
                torch.tensor(scale, dtype=torch.float32, device=dev),
                [p[4] for p in parts],
                torch.tensor(relative, dtype=torch.bool, device=dev) if any(relative) else None,
            )
        groups: dict[tuple[str, int], list[_ReadGroup]] = {}
        for key, members in reads.items():
            by_kind: dict[tuple[str, int], _ReadGroup] = {}
            for rec, span, read in members:
                g = by_kind.get((read.key, read.k))
                if g is None:
                    g = by_kind[(read.key, read.k)] = _ReadGroup(read, [], [])
                g.spans.append(span)
                g.records.append(rec)
            groups[key] = list(by_kind.values())
        self.step = _Step(layout, groups, writes, dict(edits))
        self.layout_ns += time.perf_counter_ns() - t0

    def _end_step(self, module: Any, args: tuple, output: Any) -> None:
        # Nothing may keep a reference into this step's buffers past here.
        self.step = None

    def _make_hook(self, spec: Any, layer: int):
        key = (spec.name, layer)

        if spec.pre:

            def hook(module, args, kwargs):
                step = self.step
                if step is not None and step.wants(key):
                    self._visit(step, key, spec, args, kwargs, None)

        else:

            def hook(module, args, kwargs, output):
                step = self.step
                if step is not None and step.wants(key):
                    self._visit(step, key, spec, args, kwargs, output)

        return hook

    def _fail(self, records, key, exc: BaseException) -> None:
        self.hook_errors += 1
        site, layer = key
        msg = f"site {site}, layer {layer}: {type(exc).__name__}: {exc}"
        for rec in records:
            if rec is not None:
                rec.error(msg)

    def _visit(self, step: _Step, key, spec, args, kwargs, output) -> None:
        t0 = time.perf_counter_ns()
        site, layer = key
        label = f"{site}[{layer}]"
        write = step.writes.get(key)
        if write is not None:
            try:
                target = spec.target(args, kwargs, output)
                delta = self.vectors.matrix.index_select(0, write.vec_index) * write.scale[:, None]
                if write.relative is not None:
                    # scale by each row's own norm (of the value before the write)
                    value = spec.extract(args, kwargs, output)
                    flat = value[0] if token_axis(value, step.layout, site=label) == 1 else value
                    norms = flat.index_select(0, write.rows).float().norm(dim=-1)
                    delta = delta * torch.where(write.relative, norms, 1.0)[:, None]
                add_rows(target, step.layout, write.rows, delta, site=label)
            except Exception as exc:  # the requests concerned get the error
                self._fail(write.records, key, exc)
        for rec, span, edit, plan, positions in step.edits.get(key, []):
            try:
                self._run_edit(step, spec, args, kwargs, output, rec, span, edit, plan,
                               positions, label)
            except Exception as exc:
                self._fail([rec], key, exc)
        groups = step.reads.get(key)
        if groups:
            try:
                value = spec.extract(args, kwargs, output)
                axis = token_axis(value, step.layout, site=label)
                if spec.name != "positions" and value.shape[-1] != self.hidden:
                    raise ValueError(
                        f"its value has width {value.shape[-1]}, not the hidden size "
                        f"{self.hidden}: it is sharded across tensor-parallel ranks, "
                        "and vlens does not return one rank's shard"
                    )
                for g in groups:
                    # one gather and one reduction for every request in the step
                    rows = gather(value, step.layout, g.spans, axis=axis, site=label)
                    parts = self._reduce(rows, g.read)
                    split = {part: t.split(g.lengths) for part, t in parts.items()}
                    for i, rec in enumerate(g.records):
                        if rec is None:  # a non-reading rank joined a collective
                            continue
                        for part, chunks in split.items():
                            kept = chunks[i]
                            rec.chunks[(g.read.key, part, layer)].append(kept)
                            rec.copied_bytes += kept.numel() * kept.element_size()
            except Exception as exc:  # reported to the client, never swallowed
                self._fail([r for g in groups for r in g.records], key, exc)
        self.hook_ns += time.perf_counter_ns() - t0

    def _reduce(self, rows: torch.Tensor, read) -> dict[str, torch.Tensor]:
        """``rows`` is a gathered copy ([n, ...]); kept values never alias
        engine buffers that later kernels or steps overwrite."""
        if read.reduce == "full":
            return {"value": rows.to(device="cpu", dtype=torch.float32)}
        if read.reduce == "norm":
            return {"value": rows.float().norm(dim=-1).cpu()}
        logits = lens_logits(self.model, rows)
        if logits is None:  # a non-driver tensor-parallel rank
            return {}
        if read.reduce == "logprobs":
            return {"value": logits.log_softmax(-1).cpu()}
        if read.reduce == "logit_lens":
            top, ids = logits.topk(max(1, read.k), dim=-1)
            probs = (top - logits.logsumexp(-1, keepdim=True)).exp()
            return {"ids": ids.cpu(), "probs": probs.cpu()}
        raise ValueError(f"unknown reduction {read.reduce!r}")

    def _run_edit(self, step, spec, args, kwargs, output, rec, span, edit, plan, positions, label):
        fn = self.edit_fns.get(edit.fn)
        if fn is None:
            raise LookupError(f"edit function {edit.fn} never reached this worker")
        value = spec.extract(args, kwargs, output)
        axis = token_axis(value, step.layout, site=label)
        rows = narrow(value, step.layout, span, axis=axis, clone=plan.clone, site=label)
        if plan.clone and rec is not None:
            rec.copied_bytes += rows.numel() * rows.element_size()
        before = rows.clone()
        ctx = EditContext(plan.index, plan.tag, spec.name, edit.layer,
                          positions, plan.prompt_len, plan.clone)
        result = fn(rows, ctx)
        if result is None:
            if not torch.equal(rows, before):
                raise ValueError(
                    "the edit function changed the tensor it was given in place and "
                    "returned None; vlens writes edits back only from what the "
                    "function returns: return the edited tensor"
                )
            return
        if spec.target is None:
            raise ValueError(
                f"site {spec.name} is read-only: an edit function there may look "
                "(return None) but not return a new value"
            )
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(before.shape):
            raise ValueError(
                f"the edit function returned {type(result).__name__}"
                f"{list(getattr(result, 'shape', []))}; return a tensor of the shape it was "
                f"given, {list(before.shape)}"
            )
        target = spec.target(args, kwargs, output)
        t_rows = narrow(target, step.layout, span, axis=axis, site=label)
        # the canonical value may be a sum (native resid_post): add the change
        widen(target, step.layout, span, t_rows + (result.to(t_rows.dtype) - before.to(t_rows.dtype)),
              axis=axis, site=label)

    # -- client-facing ------------------------------------------------------
    def _forget_plans(self, wanted: set[str]) -> None:
        """Drop cached plans of these tags, and no-plan entries of requests
        that have left the runner."""
        live = self.runner.requests
        self.plans = {
            r: p for r, p in self.plans.items()
            if (p is not None and p.tag not in wanted) or (p is None and r in live)
        }

    def collect(self, tags: list[str]) -> dict[str, list[dict[str, Any]]]:
        wanted = set(tags)
        out: dict[str, list[dict[str, Any]]] = {t: [] for t in tags}
        for req_id in [r for r, rec in self.records.items() if rec.plan.tag in wanted]:
            rec = self.records.pop(req_id)
            out[rec.plan.tag].append(rec.pack())
        self._forget_plans(wanted)
        return out

    def drop(self, tags: list[str] | None) -> int:
        if tags is None:
            n = len(self.records)
            self.records.clear()
            self.plans.clear()
            self.edit_fns.clear()
            return n
        wanted = set(tags)
        gone = [r for r, rec in self.records.items() if rec.plan.tag in wanted]
        for r in gone:
            del self.records[r]
        self._forget_plans(wanted)
        return len(gone)

    def status(self) -> dict[str, Any]:
        return {
            "hooks": len(self.handles),
            "records": len(self.records),
            "plans": sum(p is not None for p in self.plans.values()),
            "vectors": len(self.vectors),
            "vector_bytes": self.vectors.nbytes,
            "edit_fns": len(self.edit_fns),
            "hook_errors": self.hook_errors,
            "steps_seen": self.steps_seen,
            "steps_planned": self.steps_planned,
            "layout_ns": self.layout_ns,
            "hook_ns": self.hook_ns,
        }


class VlensWorkerExtension:
    """Mixed into vLLM's worker by ``worker_extension_cls``; call its methods
    with ``llm.collective_rpc("vlens_setup")`` and so on. Arguments and
    results are plain data (dicts, lists, str, bytes), except ``edit=``
    functions, which cross as Python objects."""

    def _vlens(self) -> _Hooks:
        hooks = getattr(self, "_vlens_hooks", None)
        if hooks is None:
            hooks = _Hooks(self)
            self._vlens_hooks = hooks
        return hooks

    def vlens_setup(self) -> dict[str, Any]:
        """Install the hooks (once) and describe the model."""
        hooks = self._vlens()
        hooks.install()
        return {
            "impl": hooks.sites.impl,
            "architecture": hooks.sites.architecture,
            "n_layers": hooks.sites.n_layers,
            "hidden_size": hooks.hidden,
            "sites": sorted(hooks.sites.specs),
            "rank": int(getattr(self, "rank", 0)),
            "hooks": len(hooks.handles),
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

    def vlens_put_edits(self, fns: dict[str, Any]) -> int:
        self._vlens().edit_fns.update(fns)
        return len(self._vlens().edit_fns)

    def vlens_drop_edits(self, ids: list[str]) -> int:
        hooks = self._vlens()
        for i in ids:
            hooks.edit_fns.pop(i, None)
        return len(hooks.edit_fns)

    def vlens_collect(self, tags: list[str]) -> dict[str, list[dict[str, Any]]]:
        """Hand back (and forget) what was read for requests with these tags."""
        return self._vlens().collect(list(tags))

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
