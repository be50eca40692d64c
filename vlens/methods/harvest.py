"""``Session.harvest``: every token's activations of many texts, to disk.

Built on the Session's public surface only (``s.prompts``, ``s.facts``,
``s.read_budget``, ``s.trace``), so a connected session harvests the same
way. Texts are tokenized once; then, shard by shard, the next whole texts
that make up at least ``shard_tokens`` tokens are traced (``max_new_tokens=1``:
each row read is a prompt token, nothing generated is fed back; in trace
calls that fit the read budget, batched as any trace) and written as one
safetensors shard (a temporary name, then a rename), after which the
manifest lists it. Memory holds one shard at a time.

Run again on the same folder with the same arguments, a harvest resumes
after the last finished shard: the texts in finished shards are skipped and
the shards still to come are the ones an uninterrupted run writes (a shard
holds whole texts, so where shards end depends only on the token counts).
The folder's layout and :class:`~vlens.results.harvest.Harvest` are in
:mod:`vlens.results.harvest`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import vlens
from vlens import checks
from vlens._progress import Progress
from vlens.errors import VlensError
from vlens.models.registry import file_sha256
from vlens.results.harvest import (FORMAT, MANIFEST, Harvest, read_manifest, shard_name,
                                   tensor_name, write_manifest)

__all__ = ["harvest"]

#: what must match for a folder's harvest to be resumed
SAME = ("model", "sites", "layers", "dtype", "widths", "shard_tokens", "texts_sha256")


def harvest(session: Any, texts: Sequence[Any], *, layers: Any, sites: Any, out: Any,
            shard_tokens: int, progress: Any = None) -> Harvest:
    """``Session.harvest`` (see there and the module)."""
    facts = session.facts
    if not checks.is_int(shard_tokens) or shard_tokens < 1:
        raise VlensError(f"shard_tokens must be a positive int (the tokens a shard gathers "
                         f"before it is written, e.g. 65536), got {shard_tokens!r}")
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
        raise VlensError("texts must be a non-empty list of texts (one string alone: "
                         "pass [text])")
    layers = checks.check_layers(layers, facts)
    sites = checks.check_sites(sites, facts)
    if "attn_pattern" in sites:
        raise VlensError("attn_pattern has a row per token pair, not per token: harvest "
                         "'z' or a residual site instead")
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise VlensError(f"progress must be True, False/None, or a function fn(tokens done, "
                         f"tokens in all), got {progress!r}")
    if out is None or not isinstance(out, (str, os.PathLike)):
        raise VlensError(f"out= must be a folder path (it is made if missing), got {out!r}")
    ids = [list(p.ids) for p in session.prompts(list(texts))]
    empty = [k for k, each in enumerate(ids) if not each]
    if empty:
        raise VlensError(f"text {empty[0]} has no tokens: drop the empty texts")
    manifest = _manifest(session, ids, layers, sites, shard_tokens)
    folder = Path(out).expanduser()
    manifest = _resume(folder, manifest)
    total = manifest["texts"][-1]["offset"] + manifest["texts"][-1]["tokens"]
    bar = None
    if progress is not None and progress is not False:
        bar = Progress(total, callback=None if progress is True else progress,
                       bar=progress is True, desc="harvest")
        bar.n = len(Harvest(folder, manifest))
    try:
        _run(session, folder, manifest, ids, bar)
    finally:
        if bar is not None:
            bar.close()
    return Harvest(folder, manifest)


def _manifest(session: Any, ids: list[list[int]], layers: list[int], sites: list[str],
              shard_tokens: int) -> dict[str, Any]:
    """The manifest of a harvest not started yet."""
    texts, offset = [], 0
    for each in ids:
        texts.append({"tokens": len(each), "offset": offset})
        offset += len(each)
    digest = hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()
    width = session.facts.width
    return {
        "format": FORMAT, "vlens": vlens.__version__, "model": str(session.model),
        "sites": sites, "layers": layers, "dtype": "float32",
        "widths": {site: width(site) for site in sites}, "shard_tokens": shard_tokens,
        "texts_sha256": digest, "texts": texts, "shards": [],
    }


def _resume(folder: Path, fresh: dict[str, Any]) -> dict[str, Any]:
    """``fresh``, or the folder's manifest when it holds the same harvest
    begun (its shards checked to be there); a folder holding anything else
    is refused."""
    old = read_manifest(folder) if folder.is_dir() else None
    if old is None:
        if folder.is_dir() and any(p for p in folder.iterdir() if not p.name.startswith(".")):
            raise VlensError(f"out={str(folder)!r} holds files but no {MANIFEST}: give "
                             "harvest an empty or new folder")
        folder.mkdir(parents=True, exist_ok=True)
        write_manifest(folder, fresh)
        return fresh
    differ = [key for key in SAME if old.get(key) != fresh[key]]
    if differ:
        raise VlensError(
            f"out={str(folder)!r} holds another harvest (its {', '.join(differ)} differ "
            "from this call's): pass the same texts and arguments to resume it, or another "
            "folder (or delete this one) to start anew")
    for shard in old["shards"]:
        if not (folder / shard["file"]).is_file():
            raise VlensError(f"{folder / shard['file']} is listed as finished but missing: "
                             "delete the folder and harvest again")
    for tmp in folder.glob(".shard-*.tmp"):  # a shard an interrupt left half-written
        tmp.unlink()
    return old


def _run(session: Any, folder: Path, manifest: dict[str, Any], ids: list[list[int]],
         bar: Progress | None) -> None:
    """Every shard still to write, in order."""
    shard_tokens = manifest["shard_tokens"]
    per_token = 4 * sum(manifest["widths"].values()) * len(manifest["layers"])
    # a connected session's server refuses a call reading past its own limit
    # (``s.engine.limits``; a connection cuts calls by requests, not reads)
    server = int((getattr(session.engine, "limits", None) or {}).get("read_bytes") or 0)
    budget = min(session.read_budget, server) if server else session.read_budget
    per_call = max(1, budget // max(per_token, 1) // 2)
    start = manifest["shards"][-1]["texts"][1] if manifest["shards"] else 0
    while start < len(ids):
        stop, gathered = start, 0
        while stop < len(ids) and gathered < shard_tokens:
            gathered += len(ids[stop])
            stop += 1
        tensors = _read(session, manifest, ids, start, stop, per_call)
        _write(folder, manifest, tensors, start, stop)
        if bar is not None:
            bar.update(gathered)
        start = stop


def _read(session: Any, manifest: dict[str, Any], ids: list[list[int]], start: int,
          stop: int, per_call: int) -> dict[str, torch.Tensor]:
    """Texts ``start:stop``'s rows, by tensor name, in trace calls of at most
    ``per_call`` tokens (one text at least)."""
    sites, layers = manifest["sites"], manifest["layers"]
    parts: dict[str, list[torch.Tensor]] = {tensor_name(s, L): [] for s in sites for L in layers}
    parts["token_ids"] = []
    i = start
    while i < stop:
        j, tokens = i, 0
        while j < stop and (j == i or tokens + len(ids[j]) <= per_call):
            tokens += len(ids[j])
            j += 1
        run = session.trace([{"prompt_token_ids": each} for each in ids[i:j]], layers=layers,
                            sites=sites, max_new_tokens=1, logprobs=False)
        for k, t in zip(range(i, j), run):
            if list(t.token_ids) != ids[k]:
                raise VlensError(f"text {k}: the engine read {t.n_tokens} rows for its "
                                 f"{len(ids[k])} tokens; harvest needs one per token")
            for site in sites:
                for layer in layers:
                    rows = t.activations(site, layer=layer)
                    parts[tensor_name(site, layer)].append(rows.reshape(rows.shape[0], -1))
            parts["token_ids"].append(torch.tensor(ids[k], dtype=torch.int64))
        i = j
    return {name: torch.cat(each).to(torch.float32 if name != "token_ids" else torch.int64)
            .contiguous() for name, each in parts.items()}


def _write(folder: Path, manifest: dict[str, Any], tensors: dict[str, torch.Tensor],
           start: int, stop: int) -> None:
    """One shard: written under a temporary name, renamed, then listed."""
    shards = manifest["shards"]
    name = shard_name(len(shards))
    first = manifest["texts"][start]["offset"]
    last = manifest["texts"][stop - 1]["offset"] + manifest["texts"][stop - 1]["tokens"]
    tmp = folder / f".{name}.tmp"
    # one metadata key: safetensors writes several in no fixed order (and the
    # file's sha256 must not depend on it)
    about = json.dumps({"format": FORMAT, "texts": [start, stop], "tokens": [first, last]})
    save_file(tensors, str(tmp), metadata={"vlens-harvest": about})
    os.replace(tmp, folder / name)
    shards.append({"file": name, "texts": [start, stop], "tokens": [first, last],
                   "sha256": file_sha256(folder / name)})
    write_manifest(folder, manifest)
