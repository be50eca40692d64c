"""Named vectors and SAEs on ``vlens serve``.

``--vector NAME=FILE`` (safetensors holding one tensor, ``.pt``, ``.npy``)
and ``--sae NAME=PATH`` (what :meth:`vlens.SAE.load` reads) are loaded at
start, checked against the served model, and named in OpenAI-style bodies
(``{"vlens": {"steer": [{"vector": NAME, ...}]}}``) by everyone. A
participant's own vectors (``s.register_vector(name, tensor)`` on a
connected session) are kept per participant and seen by that participant's
calls only. Connected sessions fetch a served SAE by name
(``s.sae(NAME)``) and use it as a local one; the server accepts plans that
name the SAEs it loaded, and no other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlens.edits import vector_id
from vlens.errors import VlensError
from vlens.methods.sae import CLAMP_MAX, SAE
from vlens.protocol.tensors import encode_tensor
from vlens.edit_schema import NAME

__all__ = ["ServerNames", "load_vector", "parse_named"]


def parse_named(values: list[str] | None, flag: str) -> dict[str, str]:
    """``["a=path", ...]`` -> ``{name: path}``, names checked."""
    out: dict[str, str] = {}
    for v in values or ():
        name, sep, path = v.partition("=")
        if not sep or not NAME.fullmatch(name) or not path:
            raise VlensError(f"{flag} {v!r}: expected NAME=PATH (NAME: 1-64 of A-Z a-z 0-9 _ . -)")
        if name in out:
            raise VlensError(f"{flag}: the name {name!r} is given twice")
        out[name] = path
    return out


def load_vector(path: str | Path) -> torch.Tensor:
    """One vector from a file: safetensors holding exactly one tensor, a
    torch ``.pt`` holding a tensor (loaded with ``weights_only``), or a
    numpy ``.npy`` (no pickle). Returns it 1-D float32."""
    path = Path(path)
    if not path.is_file():
        raise VlensError(f"{path}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
            if len(tensors) != 1:
                raise VlensError(f"{path} holds {len(tensors)} tensors ({sorted(tensors)[:5]}); "
                                 "a vector file holds exactly one")
            t = next(iter(tensors.values()))
        elif suffix == ".pt":
            t = torch.load(path, map_location="cpu", weights_only=True)
        elif suffix == ".npy":
            import numpy as np

            t = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            raise VlensError(f"{path}: a vector file is .safetensors, .pt or .npy")
    except VlensError:
        raise
    except Exception as exc:  # noqa: BLE001 - each format fails its own way
        raise VlensError(f"{path} could not be read as a vector: {exc}") from None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 1:
        raise VlensError(f"{path} must hold one 1-D floating-point tensor [width], got "
                         f"{getattr(t, 'shape', type(t).__name__)}")
    t = t.detach().to(torch.float32).contiguous()
    if not bool(torch.isfinite(t).all()):
        raise VlensError(f"{path} holds NaN or inf")
    return t


class ServerNames:
    """The server's named vectors and SAEs, and each participant's own."""

    def __init__(self, vectors: dict[str, torch.Tensor], saes: dict[str, Any],
                 per_client: int = 64) -> None:
        self.vectors = vectors
        self.saes = saes
        self.sae_ids = {s.id: s for s in saes.values()}
        self.per_client = per_client
        self.own: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def load(cls, vector_files: dict[str, str], sae_paths: dict[str, str], facts: Any,
             per_client: int = 64) -> ServerNames:
        """Load and check every ``--vector`` and ``--sae`` against the model."""
        widths = {facts.width(site) for site in facts.writable}
        vectors = {}
        for name, path in vector_files.items():
            v = load_vector(path)
            if v.shape[0] not in widths:
                raise VlensError(f"--vector {name}={path}: {v.shape[0]} values, but this model's "
                                 f"writable sites take {sorted(widths)} (hidden size "
                                 f"{facts.hidden_size})")
            vectors[name] = v
        saes = {}
        for name, path in sae_paths.items():
            try:
                sae = SAE.load(path)
                sae.check(facts)
            except VlensError as exc:
                raise VlensError(f"--sae {name}={path}: {exc}") from None
            sae.name = name
            saes[name] = sae
        return cls(vectors, saes, per_client)

    def public(self) -> dict[str, Any]:
        return {"vectors": {n: int(v.shape[0]) for n, v in self.vectors.items()},
                "saes": {n: {"id": s.id, "site": s.site, "layer": s.layer, "d_in": s.d_in,
                             "d_sae": s.d_sae, "architecture": s.spec.architecture}
                         for n, s in self.saes.items()}}

    def vector(self, client: str, name: str) -> torch.Tensor | None:
        """A participant's own vector of that name, else the server's."""
        own = self.own.get(client, {})
        return own[name] if name in own else self.vectors.get(name)

    def register(self, client: str, name: Any, vector: torch.Tensor, facts: Any) -> int:
        """Keep ``vector`` as ``name`` for ``client``'s calls; returns how
        many that client holds. A name again replaces its vector."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise VlensError(f"vector name {name!r:.40} is not a name (1-64 of A-Z a-z 0-9 _ . -)")
        widths = {facts.width(site) for site in facts.writable}
        if vector.dim() != 1 or vector.shape[0] not in widths:
            raise VlensError(f"vector {name!r}: shape {list(vector.shape)}; this model's "
                             f"writable sites take [{' or '.join(map(str, sorted(widths)))}]")
        if not bool(torch.isfinite(vector).all()):
            raise VlensError(f"vector {name!r} holds NaN or inf")
        own = self.own.setdefault(client, {})
        if name not in own and len(own) >= self.per_client:
            raise VlensError(f"you hold {len(own)} vectors, this server's limit: register "
                             "under a name you used before to replace it")
        own[name] = vector.detach().to(torch.float32).contiguous()
        return len(own)

    def sae_payload(self, name: str) -> dict[str, Any] | None:
        """What a connected session rebuilds a served SAE from."""
        sae = self.saes.get(name)
        if sae is None:
            return None
        return {"name": name, "site": sae.site, "layer": sae.layer,
                "spec": sae.spec.to_wire(),
                "weights": {k: encode_tensor(w) for k, w in sae.weights.items()}}

    def _loaded(self, sae_id: str, what: str) -> Any:
        sae = self.sae_ids.get(sae_id)
        if sae is None:
            raise VlensError(f"{what} names SAE {sae_id!r:.40}, which this server has not "
                             "loaded: use s.sae(name) for the server's SAEs")
        return sae

    def check_plan_saes(self, plan: Any) -> None:
        """Every SAE a plan names is one this server loaded, read or written
        where it was trained, with a feature it has and its own decoder row."""
        for r in plan.reads:
            if not r.sae:
                continue
            sae = self._loaded(r.sae, "read")
            if r.site != sae.site or tuple(r.layers) != (sae.layer,):
                raise VlensError(f"a feature read of SAE {sae.name!r} reads {sae.site} at layer "
                                 f"{sae.layer}, not {r.site!r:.20} at {list(r.layers)!r:.40}")
            if (r.reduce == "sae" and r.k != sae.d_sae) or not 1 <= r.k <= sae.d_sae:
                raise VlensError(f"a feature read of SAE {sae.name!r}: k must be "
                                 f"{'its width ' if r.reduce == 'sae' else '1 to '}{sae.d_sae}")
        for a in plan.adds:
            if not a.sae:
                continue
            sae = self._loaded(a.sae, "clamp")
            if a.site != sae.site or a.layer != sae.layer or not 0 <= a.feature < sae.d_sae:
                raise VlensError(f"a clamp of SAE {sae.name!r} writes {sae.site} at layer "
                                 f"{sae.layer}, a feature from 0 to {sae.d_sae - 1}")
            if a.vec.rsplit("/", 1)[-1] != vector_id(sae.weights["W_dec"][a.feature]):
                raise VlensError(f"a clamp of SAE {sae.name!r} writes its feature's own "
                                 "decoder row")
            if not abs(float(a.scale)) <= CLAMP_MAX:
                raise VlensError(f"a clamp's value must be at most {CLAMP_MAX:g} in size")
