"""What one request has been seen to compute, kept as one clean pass.

A worker keeps one :class:`RequestRecord` per traced engine request: the
token ids and positions of the rows the hooks saw, and what each read
kept, step by step. vLLM does not always run a request's rows once, in
order:

* **preemption**: when the KV cache runs out, vLLM drops a running request's
  cache and later recomputes it from position 0 (or from the end of a
  prefix it still holds in its cache), so rows the record already holds
  reach the hooks again;
* **the prefix cache**: a request that does not skip it (vlens lets
  steer-only requests share KV computed under the same edits) starts at the
  end of the cached prefix; the hooks never see the cached rows.

So a step's rows for a request start at ``first`` (the number of tokens
vLLM has already computed for it). When ``first`` is a position the record
already holds, the record is cut back to it and refilled (``restarts``
counts this); when the record is empty, ``first`` is where it starts
(``start``: rows before it came from the prefix cache). What ``pack``
hands the client therefore always describes one pass over positions
``[start, end)``. Pure torch: no vLLM import.

A :class:`~vlens.worker.steplog.StepLog` (``steplog.py``) holds one step's
reads for all its requests at once (one tensor per read, site and layer); a
record's step points into it and takes its own rows only when packed, after
the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlens.protocol.tensors import encode_tensor
from vlens.protocol.plan import Plan
from vlens.worker.steplog import ReadKey, StepLog, host_copies

__all__ = ["RequestRecord"]


@dataclass
class _StepRows:
    """The rows of one request in one engine step."""

    first: int  # sequence position of the first row
    n: int
    token_ids: list[int]
    positions: list[int]
    # (read key, part, layer) -> [n, ...] kept rows
    reads: dict[ReadKey, torch.Tensor] = field(default_factory=dict)
    # the step's shared reads, and whose rows to take from them
    log: StepLog | None = None
    req_id: Any = None

    def head(self, n: int) -> _StepRows:
        """The first ``n`` rows only."""
        return _StepRows(
            self.first, n, self.token_ids[:n], self.positions[:n],
            {k: v[:n] for k, v in self.reads.items()}, self.log, self.req_id,
        )

    def summary(self) -> tuple[dict[str, set[str]], int]:
        """Each read key's parts among this step's rows and the bytes of
        those in the log, as :meth:`kept` says them: from the log's layouts
        without cutting a row, unless a recompute cut this step."""
        parts: dict[str, set[str]] = {}
        if self.log is not None:
            m, logged, nbytes, reach = self.log.summary(self.req_id)
            end = self.first + self.n
            if logged and (self.first + m > end or reach > end):  # cut by a recompute
                rows, nbytes = self.kept()
                for key, part, _ in rows:
                    parts.setdefault(key, set()).add(part)
                return parts, nbytes
            for key, got in logged.items():
                parts.setdefault(key, set()).update(got)
        else:
            nbytes = 0
        for key, part, _ in self.reads:
            parts.setdefault(key, set()).add(part)
        return parts, nbytes

    def kept(self) -> tuple[dict[ReadKey, torch.Tensor], int]:
        """Every read of this step's rows (kept here, or in the step's log),
        and the bytes of those in the log. Logged rows at or past
        ``first + n`` (the step was cut back by a recompute) are left out."""
        if self.log is None:
            return self.reads, 0
        m, logged, nbytes = self.log.of(self.req_id)
        if not logged:
            return self.reads, 0
        end = self.first + self.n
        starts, reach = self.log.starts(self.req_id)
        if self.first + m > end or reach > end:  # some rows are past a recompute's cut
            cut, nbytes = {}, 0
            for k, t in logged.items():
                p0 = starts.get(k, self.first)
                if p0 + t.shape[0] > end:  # cut back by a recompute
                    t = t[: max(0, end - p0)]
                cut[k] = t
                nbytes += t.numel() * t.element_size()
            logged = cut
        if not self.reads:
            return logged, nbytes
        out = dict(logged)
        out.update(self.reads)
        return out, nbytes


class RequestRecord:
    """Everything read for one engine request (one sample of a prompt)."""

    def __init__(self, plan: Plan, req_id: str) -> None:
        self.plan = plan
        self.req_id = req_id
        self.steps: list[_StepRows] = []
        self.errors: list[str] = []
        self.restarts = 0  # how often vLLM went back over rows already seen
        self.copied_bytes = 0
        # layer -> [(first position, keys [n, kv_heads, head_dim])]: the
        # request's keys so far, kept only where it reads attn_pattern
        self.keys: dict[int, list[tuple[int, torch.Tensor]]] = {}

    @property
    def start(self) -> int:
        """Position of the first row seen (rows before it: prefix cache)."""
        return self.steps[0].first if self.steps else 0

    @property
    def end(self) -> int:
        """One past the position of the last row seen."""
        return self.steps[-1].first + self.steps[-1].n if self.steps else 0

    def error(self, msg: str) -> None:
        if msg not in self.errors:
            self.errors.append(msg)

    def begin_step(self, first: int, n: int, token_ids: list[int] | None = None,
                   positions: list[int] | None = None, log: StepLog | None = None) -> None:
        """This step runs the request's rows at positions ``[first, first + n)``;
        ``log``: where the step's hooks keep the reads of all its requests."""
        if self.steps and first < self.end:
            self.cut(first)
            self.restarts += 1
        elif self.steps and first > self.end:
            self.error(
                f"positions {self.end} to {first - 1} never reached the hooks "
                "(the engine skipped them)"
            )
        self.steps.append(_StepRows(first, n, list(token_ids or []), list(positions or []),
                                    log=log, req_id=self.req_id))

    def cut(self, position: int) -> None:
        """Forget every row at ``position`` or later."""
        kept = []
        for s in self.steps:
            if s.first >= position:
                continue
            kept.append(s if s.first + s.n <= position else s.head(position - s.first))
        self.steps = kept
        for layer, chunks in self.keys.items():
            self.keys[layer] = [(p, k if p + k.shape[0] <= position else k[: position - p])
                                for p, k in chunks if p < position]

    def add_keys(self, layer: int, first: int, keys: torch.Tensor) -> torch.Tensor:
        """Keep this step's keys of ``layer`` (``[n, kv_heads, head_dim]``,
        positions ``first ..``; copied) and return every key of the request
        so far, ``[first + n, kv_heads, head_dim]``. A ``first`` before the
        keys held (a recompute) cuts them back to it first."""
        chunks = [(p, k if p + k.shape[0] <= first else k[: first - p])
                  for p, k in self.keys.get(layer, ()) if p < first]
        chunks.append((first, keys.clone()))
        self.keys[layer] = chunks
        have = sum(k.shape[0] for _, k in chunks)
        if have != first + keys.shape[0]:
            raise ValueError(f"the keys of positions 0 to {first - 1} never reached the hooks")
        return torch.cat([k for _, k in chunks]) if len(chunks) > 1 else chunks[0][1]

    def keep(self, key: str, part: str, layer: int, rows: torch.Tensor) -> None:
        """Keep this step's read rows (``[n, ...]``, a copy) of ``key``."""
        self.steps[-1].reads[(key, part, layer)] = rows
        self.copied_bytes += rows.numel() * rows.element_size()

    # -- what the client receives -------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.steps for t in s.token_ids]

    @property
    def positions(self) -> list[int]:
        return [p for s in self.steps for p in s.positions]

    def steered_rows(self) -> int:
        """Rows seen that fell inside a steering span of the plan."""
        return sum(add.rows_in(self.start, self.end) for add in self.plan.adds)

    def _stacked(self, key: str, part: str, layers: tuple[int, ...],
                 kept: list[dict[ReadKey, torch.Tensor]], at: int | None = None
                 ) -> torch.Tensor | None:
        """``kept``: each step's reads (``_StepRows.kept``); ``at``: the one
        position the read keeps (None: every row), whose row only the step
        that ran it holds."""
        if at is not None and not self.start <= at < self.end:
            self.error(f"read {key}: position {at} never reached the hooks (rows "
                       f"{self.start} to {self.end - 1} did)")
            return None
        per_layer = []
        for layer in layers:
            chunks = [k.get((key, part, layer)) for s, k in zip(self.steps, kept)
                      if at is None or s.first <= at < s.first + s.n]
            if not chunks or any(c is None for c in chunks):
                self.error(f"read {key}, layer {layer}: the hook never saw some of this "
                           "request's rows")
                return None
            if key == "attn_pattern":
                # each step's rows reach only the keys so far: pad them to all
                width = self.end
                chunks = [torch.nn.functional.pad(c, (0, width - c.shape[-1])) for c in chunks]
            per_layer.append(chunks[0] if len(chunks) == 1 else torch.cat(chunks, 0))
        n = self.end - self.start if at is None else 1
        lengths = {t.shape[0] for t in per_layer}
        if lengths != {n}:
            self.error(f"read {key}: layers read {sorted(lengths)} rows but the request "
                       f"processed {n} tokens")
            return None
        if key == "attn_pattern":  # [layers, queries, heads, keys] -> [layers, heads, q, k]
            return torch.stack(per_layer).transpose(1, 2).contiguous()
        return torch.stack(per_layer)

    def _from_log(self, key: str, part: str, layers: tuple[int, ...],
                  at: int | None) -> torch.Tensor | None:
        """What :meth:`_stacked` gives, taken at once from the one step that
        holds the read's rows (the only step of the record, or the step
        that ran position ``at``) where its log stacks them for the whole
        group; None where it does not (more steps, rows kept in the
        forward, a recompute's cut): then layer by layer."""
        if at is None:
            steps = self.steps if len(self.steps) == 1 else ()
        else:
            steps = [s for s in self.steps if s.first <= at < s.first + s.n]
        if len(steps) != 1 or steps[0].log is None or steps[0].reads:
            return None
        s = steps[0]
        got = s.log.stacked(self.req_id, key, part, layers)
        if got is None:
            return None
        rows, p0 = got
        if at is None:  # every row the step ran for the request, from its first
            ok = rows.shape[1] == s.n and p0 in (None, s.first)
        else:
            ok = rows.shape[1] == 1 and p0 == at
        return rows if ok else None

    def pack(self, tensors: bool = False) -> dict[str, Any]:
        """Plain data for the client: token ids, positions and reads of the
        one clean pass over ``[start, end)``, and what went wrong. Reads are
        bytes (``encode_tensor``), or with ``tensors`` (a client in this
        process) host tensors owning their memory, as decoding would give."""
        reads: dict[str, dict[str, Any]] = {}
        # each step's read keys, parts and bytes (from the logs' layouts
        # without cutting a row, where no recompute cut the step)
        said = [s.summary() for s in self.steps]
        logged = sum(nbytes for _, nbytes in said)
        parts_of: dict[str, set[str]] = {}
        for parts, _ in said:
            for key, got in parts.items():
                parts_of.setdefault(key, set()).update(got)
        kept: list[dict[ReadKey, torch.Tensor]] | None = None
        for read in self.plan.reads:
            parts = sorted(parts_of.get(read.key, ()))
            out: dict[str, Any] = {"layers": list(read.layers), "site": read.site,
                                   "reduce": read.reduce}
            at = read.at(self.plan.prompt_len)
            if at is not None:  # [layers, 1, ...]: the row at this position alone
                out["position"] = at
            for part in parts or ["value"]:
                stacked = self._from_log(read.key, part, read.layers, at)
                if stacked is None:
                    if kept is None:  # cut from the logs only now, for the layer-by-layer way
                        kept = [k for k, _ in (s.kept() for s in self.steps)]
                    stacked = self._stacked(read.key, part, read.layers, kept, at)
                if stacked is None:
                    break
                out[part] = (stacked.clone(memory_format=torch.contiguous_format)
                             if tensors and stacked.device.type == "cpu"
                             else encode_tensor(stacked))
            else:
                reads[read.key] = out
        return {
            "req_id": self.req_id,
            "token_ids": self.token_ids,
            "positions": self.positions,
            "start": self.start,
            "restarts": self.restarts,
            "reads": reads,
            "errors": list(self.errors),
            "copied_bytes": self.copied_bytes + logged,
            "steered_rows": self.steered_rows(),
            "step_rows": [s.n for s in self.steps],
        }


def to_host(records: list[RequestRecord]) -> None:
    """Move what these records kept in the current step to the host, with
    one device-to-host copy per dtype (into pinned memory, not blocking the
    device) instead of one per read. Called once at the end of a step."""
    kept = [(s.reads, k, t) for r in records if r.steps for s in (r.steps[-1],)
            for k, t in s.reads.items() if t.device.type != "cpu"]
    for (reads, key, _), host in zip(kept, host_copies([t for _, _, t in kept])):
        reads[key] = host
