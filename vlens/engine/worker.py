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
   :class:`~vlens.batcher.StepLayout`. Steps where no request carries a plan
   cost one list scan;
2. one hook per (site, layer), installed once, narrows each planned
   request's rows through the batcher and stores a float32 CPU copy;
3. ``vlens_collect`` hands the stored rows back as bytes and forgets them.

Errors inside a hook (a tensor whose token axis cannot be found, an
unexpected layer output) are recorded on the requests concerned and raised
by the client when it collects them; they never abort the engine's step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from vlens.batcher import StepLayout, narrow, token_axis
from vlens.plan import PLAN_KEY, parse_plan
from vlens.sites import ModelSites, resolve_sites

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

    tag: str
    req_id: str
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    chunks: dict[tuple[str, int], list[torch.Tensor]] = field(
        default_factory=lambda: defaultdict(list)
    )
    errors: list[str] = field(default_factory=list)
    copied_bytes: int = 0

    def pack(self, plan_reads: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        reads = {}
        for site, layers in plan_reads.items():
            per_layer = []
            for layer in layers:
                parts = self.chunks.get((site, layer), [])
                if not parts:
                    per_layer = None
                    self.errors.append(
                        f"site {site}, layer {layer}: the hook never saw this request"
                    )
                    break
                per_layer.append(torch.cat(parts, 0))
            if per_layer is None:
                continue
            lengths = {t.shape[0] for t in per_layer}
            if len(lengths) != 1 or lengths != {len(self.token_ids)}:
                self.errors.append(
                    f"site {site}: layers read {sorted(lengths)} rows but the "
                    f"request processed {len(self.token_ids)} tokens"
                )
                continue
            value = torch.stack(per_layer).contiguous()
            reads[site] = {
                "layers": list(layers),
                "shape": list(value.shape),
                "dtype": "float32",
                "data": value.numpy().tobytes(),
            }
        return {
            "req_id": self.req_id,
            "token_ids": self.token_ids,
            "positions": self.positions,
            "reads": reads,
            "errors": self.errors,
            "copied_bytes": self.copied_bytes,
        }


@dataclass
class _Step:
    layout: StepLayout
    # (site, layer) -> [(record, span)]
    targets: dict[tuple[str, int], list]


class _Hooks:
    """The hook state of one worker: installed once, removed on teardown."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.runner = worker.model_runner
        self.model = self.runner.model
        self.sites: ModelSites = resolve_sites(self.model)
        self.reader = int(getattr(worker, "rank", 0)) == 0
        self.handles: list[Any] = []
        self.plans: dict[str, Any] = {}  # req_id -> parsed plan or None
        self.records: dict[str, _Record] = {}
        self.step: _Step | None = None
        self.hook_errors = 0
        self.steps_seen = 0
        self.steps_planned = 0
        self.layout_ns = 0

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

    # -- per step -----------------------------------------------------------
    def _plan_for(self, req_id: str) -> Any:
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
        if not self.reader:
            return
        batch = self.runner.input_batch
        n = batch.num_reqs
        if n == 0:
            return
        req_ids = batch.req_ids[:n]
        plans = [self._plan_for(r) for r in req_ids]
        if not any(p is not None and p.reads for p in plans):
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
        targets: dict[tuple[str, int], list] = defaultdict(list)
        ids_list = input_ids.tolist() if input_ids is not None else None
        pos_list = positions.reshape(-1, positions.shape[-1])[0].tolist() if positions is not None else None
        for req_id, plan, span in zip(req_ids, plans, layout.spans):
            if plan is None or not plan.reads:
                continue
            rec = self.records.get(req_id)
            if rec is None:
                rec = self.records[req_id] = _Record(plan.tag, req_id)
            if ids_list is not None:
                rec.token_ids.extend(ids_list[span.start : span.stop])
            if pos_list is not None:
                rec.positions.extend(pos_list[span.start : span.stop])
            for site, layers in plan.reads.items():
                for layer in layers:
                    targets[(site, layer)].append((rec, span))
        self.step = _Step(layout, dict(targets))
        self.layout_ns += time.perf_counter_ns() - t0

    def _end_step(self, module: Any, args: tuple, output: Any) -> None:
        # Nothing may keep a reference into this step's buffers past here.
        self.step = None

    def _make_hook(self, spec: Any, layer: int):
        key = (spec.name, layer)
        extract = spec.extract

        if spec.pre:

            def hook(module, args, kwargs):
                step = self.step
                if step is not None and key in step.targets:
                    self._read(step, key, extract, args, kwargs, None)

        else:

            def hook(module, args, kwargs, output):
                step = self.step
                if step is not None and key in step.targets:
                    self._read(step, key, extract, args, kwargs, output)

        return hook

    def _read(self, step: _Step, key, extract, args, kwargs, output) -> None:
        site, layer = key
        targets = step.targets[key]
        try:
            value = extract(args, kwargs, output)
            axis = token_axis(value, step.layout, site=f"{site}[{layer}]")
            for rec, span in targets:
                rows = narrow(value, step.layout, span, axis=axis, site=site)
                if axis == 1:
                    rows = rows.squeeze(0)
                # Kept across steps, so always a copy: a view would be
                # overwritten by the engine's next use of the buffer.
                kept = rows.to(device="cpu", dtype=torch.float32, copy=True)
                rec.chunks[key].append(kept)
                rec.copied_bytes += kept.numel() * kept.element_size()
        except Exception as exc:  # reported to the client, never swallowed
            self.hook_errors += 1
            msg = f"site {site}, layer {layer}: {type(exc).__name__}: {exc}"
            for rec, _ in targets:
                if msg not in rec.errors:
                    rec.errors.append(msg)

    # -- client-facing ------------------------------------------------------
    def collect(self, tags: list[str]) -> dict[str, list[dict[str, Any]]]:
        wanted = set(tags)
        out: dict[str, list[dict[str, Any]]] = {t: [] for t in tags}
        for req_id in [r for r, rec in self.records.items() if rec.tag in wanted]:
            rec = self.records.pop(req_id)
            plan = self.plans.pop(req_id, None)
            out[rec.tag].append(rec.pack(plan.reads if plan else {}))
        return out

    def drop(self, tags: list[str] | None) -> int:
        if tags is None:
            n = len(self.records)
            self.records.clear()
            self.plans.clear()
            return n
        wanted = set(tags)
        gone = [r for r, rec in self.records.items() if rec.tag in wanted]
        for r in gone:
            del self.records[r]
            self.plans.pop(r, None)
        return len(gone)

    def status(self) -> dict[str, Any]:
        return {
            "hooks": len(self.handles),
            "records": len(self.records),
            "plans_cached": len(self.plans),
            "hook_errors": self.hook_errors,
            "steps_seen": self.steps_seen,
            "steps_planned": self.steps_planned,
            "layout_ns": self.layout_ns,
        }


class VlensWorkerExtension:
    """Mixed into vLLM's worker by ``worker_extension_cls``; call its methods
    with ``llm.collective_rpc("vlens_setup")`` and so on. Every argument and
    result is plain data (dicts, lists, str, bytes)."""

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
        cfg = self.model_runner.model_config.hf_config
        text_cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        return {
            "impl": hooks.sites.impl,
            "architecture": hooks.sites.architecture,
            "n_layers": hooks.sites.n_layers,
            "hidden_size": int(text_cfg.hidden_size),
            "sites": sorted(hooks.sites.specs),
            "rank": int(getattr(self, "rank", 0)),
            "hooks": len(hooks.handles),
        }

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
