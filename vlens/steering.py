"""Steering: add a direction to the residual stream of some requests.

``Steer`` says what to add where: a vector ``[hidden]``, a layer, a site, a
scale and a token span. The Session checks it against the model, ships the
vector to the workers once (named by a hash of its bytes), and puts a small
add entry in each request's plan; the workers apply every request's
adds at a site in one batched ``index_add_``. ``PerPrompt`` gives each
prompt of a call its own steers.

``Comparison`` and ``Sweep`` hold the results of ``Session.compare`` and
``Session.sweep`` and turn them into tidy frames. Nothing here touches the
engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlens.errors import VlensError
from vlens.results import Run

__all__ = [
    "Steer",
    "PerPrompt",
    "Comparison",
    "Sweep",
    "vector_id",
    "edit_salt",
    "kl_per_position",
]

SPANS = ("all", "prompt", "generated")


def parse_span(span: Any, what: str) -> str | tuple[int, int]:
    """A Steer's or an Ablate's span, checked: one of :data:`SPANS` or
    ``(start, stop)`` token positions with ``0 <= start < stop``."""
    if isinstance(span, str):
        if span not in SPANS:
            raise VlensError(f"{what} span {span!r} is unknown: use one of {SPANS} or (start, stop)")
        return span
    if (isinstance(span, (tuple, list)) and len(span) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in span)):
        if not 0 <= span[0] < span[1]:
            raise VlensError(
                f"{what} span {tuple(span)} is empty or negative: give (start, stop) "
                "token positions with 0 <= start < stop"
            )
        return int(span[0]), int(span[1])
    raise VlensError(f"{what} span must be one of {SPANS} or (start, stop), got {span!r}")


def span_positions(span: str | tuple[int, int], prompt_len: int) -> tuple[int, int]:
    """A parsed span as token positions ``[start, stop)``; stop -1 = the end."""
    if span == "all":
        return 0, -1
    if span == "prompt":
        return 0, prompt_len
    if span == "generated":
        return prompt_len, -1
    return span  # type: ignore[return-value]


def vector_id(vector: torch.Tensor) -> str:
    """A stable id for a vector: the hash of its float32 bytes."""
    data = vector.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return "v" + hashlib.sha1(data).hexdigest()[:16]


@dataclass(frozen=True)
class Steer:
    """Add ``scale * vector`` at ``site`` of ``layer``, over ``span``.

    ``span``: ``"all"`` (every token), ``"prompt"`` (the prompt's tokens),
    ``"generated"`` (tokens the model generated, as they are fed back), or
    ``(start, stop)`` token positions (``stop`` exclusive).

    ``relative=True`` scales the push by each token's own activation norm:
    at token t it adds ``scale * |x_t| * vector / |vector|``, so ``scale``
    reads as "this fraction of the residual stream" whatever the layer
    (the bundled toy-world model's sentiment recipe: layer 3, scale 0.75).
    """

    vector: torch.Tensor
    layer: int
    scale: float = 1.0
    site: str = "resid_post"
    span: str | tuple[int, int] = "all"
    relative: bool = False

    def __post_init__(self) -> None:
        v = self.vector
        if not isinstance(v, torch.Tensor):
            raise VlensError(
                f"Steer vector must be a torch.Tensor of shape [hidden], got {type(v).__name__}"
            )
        if v.dim() != 1:
            raise VlensError(f"Steer vector must have shape [hidden], got {list(v.shape)}")
        if v.device.type == "meta":
            raise VlensError("Steer vector is on the meta device (it holds no data): pass real values")
        if not v.is_floating_point():
            raise VlensError(f"Steer vector must be floating point, got {v.dtype}")
        if not bool(torch.isfinite(v).all()):
            raise VlensError("Steer vector holds NaN or inf: compute it again from finite data")
        if not isinstance(self.layer, int) or isinstance(self.layer, bool):
            raise VlensError(f"Steer layer must be an int, got {self.layer!r}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)):
            raise VlensError(f"Steer scale must be a number, got {self.scale!r}")
        if not torch.isfinite(torch.tensor(float(self.scale))):
            raise VlensError(f"Steer scale must be finite, got {self.scale!r}")
        object.__setattr__(self, "span", parse_span(self.span, "Steer"))
        if not isinstance(self.relative, bool):
            raise VlensError(f"Steer relative must be True or False, got {self.relative!r}")
        v = v.detach().to("cpu", torch.float32).contiguous()
        if self.relative:
            norm = float(v.norm())
            if norm == 0.0:
                raise VlensError("a relative Steer needs a non-zero vector (its direction is used)")
            v = v / norm
        object.__setattr__(self, "vector", v)

    def with_scale(self, scale: float) -> Steer:
        return Steer(self.vector, self.layer, scale, self.site, self.span, self.relative)

    @property
    def id(self) -> str:
        return vector_id(self.vector)

    def positions(self, prompt_len: int) -> tuple[int, int]:
        """The span as token positions ``[start, stop)``; stop -1 = the end."""
        return span_positions(self.span, prompt_len)


class PerPrompt(Sequence):
    """``steer=`` (or ``ablate=``) with one entry per prompt, in prompt
    order: each entry a :class:`Steer` (:class:`~vlens.Ablate`), a list of
    them (all on that prompt), or None (that prompt runs unchanged)::

        s.trace([a, b, c], steer=vlens.PerPrompt([st, None, [st, st2]]))

    A plain Steer or list of Steers means "all of these on every prompt";
    this is the only spelling for "one each"."""

    def __init__(self, entries: Sequence[Any]) -> None:
        from vlens.ablation import Ablate

        kinds = (Steer, Ablate)
        if isinstance(entries, (str, *kinds)) or not isinstance(entries, (list, tuple)):
            raise VlensError(
                "PerPrompt takes a list with one entry per prompt (a Steer or Ablate, a list "
                f"of them, or None), got {type(entries).__name__}"
            )
        out: list[tuple[Any, ...]] = []
        for i, entry in enumerate(entries):
            if entry is None:
                out.append(())
            elif isinstance(entry, kinds):
                out.append((entry,))
            elif isinstance(entry, (list, tuple)) and all(isinstance(x, kinds) for x in entry):
                out.append(tuple(entry))
            else:
                raise VlensError(
                    f"PerPrompt entry {i} is {entry!r:.80}: use a Steer (or Ablate), a list of "
                    "them, or None"
                )
        self._entries = tuple(out)

    def __getitem__(self, i):  # type: ignore[override]
        return self._entries[i]

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"PerPrompt({[len(e) for e in self._entries]} steers per prompt)"


def edit_salt(writes: list[dict[str, Any]], edits: list[dict[str, Any]]) -> str | None:
    """The prefix-cache salt of a request with these edits (None: no edits).

    Same edits -> same salt, so identical steered requests still share KV
    blocks; anything else keeps its steered KV apart from everyone else's."""
    if not writes and not edits:
        return None
    canon = json.dumps({"w": writes, "e": edits}, sort_keys=True)
    return "vlens-" + hashlib.sha1(canon.encode()).hexdigest()[:20]


def kl_per_position(base_lp: torch.Tensor, steer_lp: torch.Tensor) -> torch.Tensor:
    """KL(base || steered) of two ``[n, vocab]`` log-probability tables,
    position by position: ``[n]``."""
    n = min(base_lp.shape[0], steer_lp.shape[0])
    p = base_lp[:n]
    return (p.exp() * (p - steer_lp[:n])).sum(-1).clamp_min(0)


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Comparison:
    """Baseline and steered runs of the same prompts, made in one batch.

    ``kl[i]`` is KL(baseline || steered) of the next-token distributions at
    each generated position of prompt ``i`` (each run on its own prefix, so
    after the first divergence it also reflects the different text).
    ``first_divergence[i]``: index of the first generated token that differs
    (None when the texts are identical).
    """

    baseline: Run
    steered: Run
    kl: list[torch.Tensor] = field(default_factory=list)

    @property
    def first_divergence(self) -> list[int | None]:
        return [
            _first_divergence(b.output_token_ids, s.output_token_ids)
            for b, s in zip(self.baseline, self.steered)
        ]

    @property
    def texts(self) -> list[tuple[str, str]]:
        return [(b.text, s.text) for b, s in zip(self.baseline, self.steered)]

    def to_frame(self):
        """One row per (prompt, generated position): both tokens, both
        logprobs, the KL at that position."""
        import pandas as pd

        rows = []
        for i, (b, s) in enumerate(zip(self.baseline, self.steered)):
            nb, ns = len(b.prompt_token_ids), len(s.prompt_token_ids)
            n = max(len(b.output_token_ids), len(s.output_token_ids))
            kl = self.kl[i] if i < len(self.kl) else torch.empty(0)
            for j in range(n):
                tb = b.output_token_ids[j] if j < len(b.output_token_ids) else None
                ts = s.output_token_ids[j] if j < len(s.output_token_ids) else None
                rows.append({
                    "prompt": i,
                    "position": nb + j,
                    "token_base": None if tb is None else b.output_tokens[j],
                    "token_steered": None if ts is None else s.output_tokens[j],
                    "logprob_base": b.logprobs[nb + j] if tb is not None and b.logprobs else None,
                    "logprob_steered": s.logprobs[ns + j] if ts is not None and s.logprobs else None,
                    "kl": float(kl[j]) if j < len(kl) else None,
                })
        return pd.DataFrame(rows)


@dataclass
class Sweep:
    """One prompt steered at several scales, all in one batch."""

    prompt: str
    scales: list[float]
    runs: Run  # one trace per scale, in ``scales`` order
    baseline: Any  # the Trace at scale 0 (run alongside when 0 is not a scale)
    kl: list[torch.Tensor] = field(default_factory=list)

    def to_frame(self):
        """Tidy: one row per scale with the text, the mean logprob of the
        generated tokens, mean and first-position KL from the baseline, and
        the first generated position that differs from it."""
        import pandas as pd

        rows = []
        for scale, t, kl in zip(self.scales, self.runs, self.kl):
            n = len(t.prompt_token_ids)
            gen = [x for x in t.logprobs[n:] if x is not None]
            rows.append({
                "scale": scale,
                "text": t.text,
                "n_generated": len(t.output_token_ids),
                "mean_logprob": sum(gen) / len(gen) if gen else float("nan"),
                "kl_first": float(kl[0]) if len(kl) else float("nan"),
                "kl_mean": float(kl.mean()) if len(kl) else float("nan"),
                "first_divergence": _first_divergence(
                    self.baseline.output_token_ids, t.output_token_ids
                ),
            })
        return pd.DataFrame(rows)
