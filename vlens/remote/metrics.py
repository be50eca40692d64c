"""``GET /metrics`` of ``vlens serve``: Prometheus text, vLLM's engine
metrics (its registry, as ``vllm serve`` exposes them) followed by
vlens's own: requests by edit kind, refusals by reason, calls running and
waiting, the hook time of the workers' steps, and how often each input
rule ran."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from vlens.checks import rules

__all__ = ["Metrics"]


class Metrics:
    """vlens's own counters, in a registry of their own (one per server,
    so two servers in one process never share them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "vlens_requests", "Engine requests served, by what the request did to the model "
            "(plain, steered, ablated, clamped; a request may count in several)",
            ["edit"], registry=self.registry)
        self.refusals = Counter(
            "vlens_refusals", "Requests refused, by HTTP status and reason",
            ["status", "reason"], registry=self.registry)
        self.running = Gauge("vlens_calls_running", "Calls running, all clients",
                             registry=self.registry)
        self.waiting = Gauge("vlens_calls_waiting", "Calls waiting for a slot, all clients",
                             registry=self.registry)
        self.steps = Gauge("vlens_engine_steps", "Engine steps the hooks saw",
                           registry=self.registry)
        self.steps_planned = Gauge("vlens_engine_steps_planned",
                                   "Engine steps with vlens work in them",
                                   registry=self.registry)
        self.hook_seconds = Gauge("vlens_hook_seconds", "Seconds spent in vlens's hooks, "
                                  "all steps", registry=self.registry)
        self.rule_calls = Gauge("vlens_rule_calls", "Times each input rule ran in this "
                                "process (vlens.checks.rules: one run per edit per call)",
                                ["rule"], registry=self.registry)
        self.hook_per_step = Gauge("vlens_hook_seconds_per_step",
                                   "vlens's hook time per planned step (mean)",
                                   registry=self.registry)

    def edits(self, steer: bool, ablate: bool, clamp: bool) -> None:
        """Count one request by its edits."""
        kinds = [k for k, on in (("steered", steer), ("ablated", ablate),
                                 ("clamped", clamp)) if on]
        for kind in kinds or ["plain"]:
            self.requests.labels(kind).inc()

    def refused(self, status: int, reason: str) -> None:
        self.refusals.labels(str(status), reason).inc()

    def text(self, worker: dict[str, Any], calls: int, queued: int) -> bytes:
        """The page: vLLM's metrics, then these (``worker``: the workers'
        status, ``vlens_status``)."""
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        self.running.set(calls)
        self.waiting.set(queued)
        self.steps.set(worker.get("steps_seen", 0))
        planned = worker.get("steps_planned", 0)
        self.steps_planned.set(planned)
        seconds = worker.get("hook_ns", 0) / 1e9
        self.hook_seconds.set(seconds)
        self.hook_per_step.set(seconds / planned if planned else 0.0)
        for rule, n in rules.CALLS.items():
            self.rule_calls.labels(rule).set(n)
        return generate_latest(get_prometheus_registry()) + generate_latest(self.registry)
