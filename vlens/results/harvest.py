"""A harvest of activations on disk (``Session.harvest``), read back.

A harvest folder holds safetensors shards, ``shard-00000.safetensors`` …,
each with one ``[tokens, width]`` float32 tensor per (site, layer) named
``"{site}.{layer}"`` (head sites flat: ``heads * head_dim``) and the
``token_ids`` of its rows, and ``manifest.json``: the model, sites, layers,
dtype and widths, every text's token count and offset, and every finished
shard (its texts, its token range, its sha256). A shard holds whole texts,
in order; one is finished once the manifest lists it (it is written under a
temporary name and renamed first, and never rewritten).

:class:`Harvest` reads one back (``Harvest.open(folder)``); the writing is
:mod:`vlens.methods.harvest`. Nothing here touches an engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vlens.errors import VlensError
from vlens.models.registry import file_sha256

__all__ = ["FORMAT", "MANIFEST", "Harvest", "shard_name", "tensor_name", "write_manifest"]

MANIFEST = "manifest.json"
#: the manifest's format (a reader refuses another)
FORMAT = "vlens-harvest/1"


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def tensor_name(site: str, layer: int) -> str:
    """The name of a (site, layer)'s tensor in a shard: ``"resid_post.3"``."""
    return f"{site}.{layer}"


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically (a temporary file, then a rename)."""
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of ``folder`` (None when there is none)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise VlensError(f"{path} is not a readable harvest manifest ({exc}): delete the "
                         "folder and harvest again") from None
    if manifest.get("format") != FORMAT:
        raise VlensError(f"{path} is not a vlens harvest of this version (format "
                         f"{manifest.get('format')!r}, this vlens reads {FORMAT!r})")
    return manifest


class Harvest:
    """Every token's activations of some texts, on disk (see the module).

    * ``len(h)``: the tokens harvested so far (every text, once complete);
    * ``h.read(site, layer)``: their rows ``[len(h), width]`` float32, in
      text order; ``h.token_ids``: their ids (int64 ``[len(h)]``);
    * ``h.spans``: each text's ``(start, stop)`` rows; ``h.text_rows(i, site,
      layer)`` the rows of text ``i`` alone;
    * ``h.sites``, ``h.layers``, ``h.model``, ``h.widths``, ``h.shards``,
      ``h.complete`` (every text harvested), ``h.manifest`` (all of it);
    * ``h.verify()``: each shard's sha256 against the manifest.
    """

    def __init__(self, folder: str | os.PathLike, manifest: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self.manifest = manifest

    @classmethod
    def open(cls, folder: str | os.PathLike) -> Harvest:
        """The harvest in ``folder`` (finished or not)."""
        manifest = read_manifest(Path(folder))
        if manifest is None:
            raise VlensError(f"{folder} holds no {MANIFEST}: it is not a harvest folder "
                             "(make one with s.harvest(texts, layers=..., out=folder))")
        return cls(folder, manifest)

    # -- what it is ------------------------------------------------------------
    model = property(lambda self: self.manifest["model"], doc="the model harvested")
    sites = property(lambda self: list(self.manifest["sites"]), doc="the sites read")
    layers = property(lambda self: list(self.manifest["layers"]), doc="the layers read")
    widths = property(lambda self: dict(self.manifest["widths"]), doc="site -> row width")
    shards = property(lambda self: list(self.manifest["shards"]), doc="the finished shards")

    @property
    def complete(self) -> bool:
        """Whether every text has been harvested."""
        return self.texts_done == len(self.manifest["texts"])

    @property
    def texts_done(self) -> int:
        shards = self.manifest["shards"]
        return shards[-1]["texts"][1] if shards else 0

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Each text's ``(start, stop)`` rows (texts not harvested yet included)."""
        return [(t["offset"], t["offset"] + t["tokens"]) for t in self.manifest["texts"]]

    def __len__(self) -> int:
        shards = self.manifest["shards"]
        return shards[-1]["tokens"][1] if shards else 0

    def __repr__(self) -> str:
        n = len(self.manifest["texts"])
        state = "complete" if self.complete else f"{self.texts_done} of {n} texts done"
        return (f"Harvest({str(self.folder)!r}, {len(self):,} tokens of {n} texts, "
                f"sites={self.sites}, layers={self.layers}, {len(self.shards)} shards, "
                f"{state})")

    # -- reading ---------------------------------------------------------------
    def tensor_of(self, site: str, layer: int) -> str:
        """The shards' tensor name of ``site`` at ``layer``; a pair this
        harvest did not read is an error naming what it read."""
        if site not in self.manifest["sites"]:
            raise VlensError(f"site {site!r} was not harvested: this harvest read "
                             f"{self.sites}")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer not in self.layers:
            raise VlensError(f"layer {layer!r} was not harvested: this harvest read layers "
                             f"{self.layers}")
        return tensor_name(site, layer)

    def shard_tensor(self, shard: dict[str, Any], name: str) -> torch.Tensor:
        """Tensor ``name`` of one finished shard (an entry of ``h.shards``)."""
        with safe_open(str(self.folder / shard["file"]), framework="pt") as f:
            return f.get_tensor(name)

    def read(self, site: str = "resid_post", layer: int | None = None) -> torch.Tensor:
        """Every harvested token's rows of ``site`` at ``layer`` (a layer
        number; None when one layer was read), ``[len(h), width]`` float32,
        in text order, one shard at a time into one tensor."""
        if layer is None and len(self.layers) == 1:
            layer = self.layers[0]
        name = self.tensor_of(site, layer)
        parts = [self.shard_tensor(shard, name) for shard in self.manifest["shards"]]
        if not parts:
            return torch.zeros(0, self.widths[site], dtype=torch.float32)
        return torch.cat(parts)

    @property
    def token_ids(self) -> torch.Tensor:
        """The ids of every harvested token (int64 ``[len(h)]``), in text order."""
        parts = [self.shard_tensor(shard, "token_ids") for shard in self.manifest["shards"]]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def text_rows(self, i: int, site: str = "resid_post", layer: int | None = None
                  ) -> torch.Tensor:
        """Text ``i``'s rows of ``site`` at ``layer`` (read from its shard alone)."""
        if not 0 <= i < self.texts_done:
            raise VlensError(f"text {i} is not harvested: texts 0 to {self.texts_done - 1} "
                             "are")
        if layer is None and len(self.layers) == 1:
            layer = self.layers[0]
        name = self.tensor_of(site, layer)
        shard = next(s for s in self.manifest["shards"] if s["texts"][0] <= i < s["texts"][1])
        start, stop = self.spans[i]
        return self.shard_tensor(shard, name)[start - shard["tokens"][0]:stop - shard["tokens"][0]]

    def verify(self) -> None:
        """Check every finished shard against its sha256 (a VlensError naming
        the first that differs)."""
        for shard in self.manifest["shards"]:
            path = self.folder / shard["file"]
            if not path.is_file() or file_sha256(path) != shard["sha256"]:
                raise VlensError(f"{path} is missing or differs from its sha256 in the "
                                 "manifest: delete the folder and harvest again")
