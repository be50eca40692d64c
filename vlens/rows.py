"""Which record of the workers is which completion, and its rows.

The workers record the rows each traced request fed through the model;
vLLM reports each completion's tokens. :func:`match_record` pairs them by
position (the prompt and every output token but the last), and
:func:`cut_rows` drops rows a record holds past them: vLLM's async
scheduling (its default on CUDA) runs one step ahead, so a request that
stops is scheduled once more before its stop is seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlens.calls import RequestSpec
from vlens.errors import EngineError
from vlens.protocol.plan import Add
from vlens.protocol.tensors import decode_tensor

__all__ = ["cached_adds", "cut_rows", "match_record", "token_logprobs"]


def match_record(i: int, prompt: str, req: RequestSpec, comp: Any,
                 records: list[dict[str, Any]]) -> dict[str, Any]:
    """The record of completion ``comp`` of prompt ``i`` (removed from
    ``records``): the rows it fed through the model, from the first one the
    hooks saw (``start``; earlier rows came from the prefix cache).

    Rows are matched by position against what vLLM reports (the prompt and
    every output token but the last): a record may hold rows past them,
    which vLLM scheduled before it saw the request stop (async scheduling,
    its default on CUDA, runs one step ahead), and those are dropped."""
    expected = list(req.ids) + list(comp.token_ids[:-1])

    def fits(r: dict[str, Any]) -> bool:
        start = r.get("start", 0)
        return r["token_ids"][: len(expected) - start] == expected[start:]

    rec = next((r for r in records if fits(r)), None)
    if rec is None:
        seen = [(r.get("start", 0), len(r["token_ids"])) for r in records]
        raise EngineError(
            f"prompt {i}, sample {comp.index}: the rows vlens read do not match the tokens "
            f"vLLM processed ({len(expected)} expected, records of (start, rows) {seen}). "
            "This is a vlens bug; please report it."
        )
    records.remove(rec)
    start = rec.get("start", 0)
    if start and req.plan.reads:
        raise EngineError(
            f"prompt {i}, sample {comp.index}: rows 0 to {start - 1} came from the prefix "
            "cache and the hooks never saw them, so its reads miss them. This is a vlens "
            "bug; please report it."
        )
    if rec["errors"]:
        raise EngineError(f"prompt {i} ({prompt[:40]!r}): " + "; ".join(rec["errors"]))
    extra = start + len(rec["token_ids"]) - len(expected)
    return cut_rows(rec, len(expected) - start, req.plan.adds) if extra > 0 else rec


def cut_rows(rec: dict[str, Any], n: int, adds: Sequence[Add]) -> dict[str, Any]:
    """``rec`` with only its first ``n`` rows (positions ``start`` to
    ``start + n``): token ids, positions, per-step row counts, steered rows
    and every read (rows on dim 1 of ``[layers, rows, ...]``; an attention
    pattern ``[layers, heads, queries, keys]`` on its queries and keys)."""
    start = rec.get("start", 0)
    reads = {}
    for key, parts in rec["reads"].items():
        if parts.get("position", n) < start + n:  # one prompt position's row: kept whole
            reads[key] = parts
            continue
        cut = dict(parts)
        for part, value in parts.items():
            if isinstance(value, (dict, torch.Tensor)):  # bytes, or a tensor (in process)
                t = value if isinstance(value, torch.Tensor) else decode_tensor(value)
                t = t[:, :, :n, : start + n] if key == "attn_pattern" else t[:, :n]
                cut[part] = t.contiguous()
            reads[key] = cut
    steps, left = [], n
    for rows in rec["step_rows"]:
        if left <= 0:
            break
        steps.append(min(rows, left))
        left -= rows
    return {**rec, "token_ids": rec["token_ids"][:n], "positions": rec["positions"][:n],
            "reads": reads, "step_rows": steps,
            "steered_rows": sum(a.rows_in(start, start + n) for a in adds)}


def cached_adds(adds: Sequence[Add], start: int) -> int:
    """Rows before ``start`` (served from the prefix cache) inside each Add's
    span: they were computed under the same steers (the cache_salt is made
    from them), so they count as steered."""
    return sum(a.rows_in(0, start) for a in adds)


def token_logprobs(out: Any, comp: Any, prompt_ids: list[int]) -> list[float | None]:
    """Logprob of each prompt and generated token (None for the first)."""
    values: list[float | None] = [None]
    prompt_lp = out.prompt_logprobs or []
    for pos in range(1, len(prompt_ids)):
        entry = prompt_lp[pos] if pos < len(prompt_lp) else None
        values.append(None if entry is None else float(entry[prompt_ids[pos]].logprob))
    for step, tok in enumerate(comp.token_ids):
        entry = comp.logprobs[step] if comp.logprobs and step < len(comp.logprobs) else None
        values.append(None if entry is None else float(entry[tok].logprob))
    return values
