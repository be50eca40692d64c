"""What ``Session.compare`` and ``Session.sweep`` return.

``Comparison`` holds baseline and steered runs of the same prompts,
``Sweep`` prompts at several scales; both turn into tidy frames. The
KL between two log-probability tables (``kl_per_position``) is the one the
Session and :mod:`vlens.testing` both use. Nothing here touches the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlens.errors import VlensError
from vlens.plots import baseline_vs_steered, dose_response
from vlens.results.run import Run
from vlens.tokens import first_divergence

__all__ = ["Comparison", "Sweep", "generated_kl", "kl_per_position", "run_label"]

#: what a run's edits made of it, as its row in a figure is labelled
_LABELS = (("Clamp", "clamped"), ("Ablate", "ablated"), ("Steer", "steered"))


def run_label(edits: Any) -> str:
    """What ``edits`` made of a run, in one word: ``"steered"`` (Steer),
    ``"ablated"`` (Ablate), ``"clamped"`` (an SAE Clamp); ``"edited"`` for
    a mix. ``edits``: one edit, a list, a PerPrompt or nested lists of them
    (None entries are skipped); none at all reads ``"steered"``."""
    kinds: set[str] = set()
    todo = [edits]
    while todo:
        e = todo.pop()
        if e is None or isinstance(e, (str, bytes)):
            continue
        if isinstance(e, Sequence):
            todo.extend(e)
            continue
        names = {c.__name__ for c in type(e).__mro__}
        kinds.update(next(([word] for name, word in _LABELS if name in names), []))
    if len(kinds) > 1:
        return "edited"
    return kinds.pop() if kinds else "steered"


def kl_per_position(base_lp: torch.Tensor, steer_lp: torch.Tensor) -> torch.Tensor:
    """KL(base || steered) of two ``[n, vocab]`` log-probability tables,
    position by position: ``[n]``."""
    n = min(base_lp.shape[0], steer_lp.shape[0])
    p = base_lp[:n]
    return (p.exp() * (p - steer_lp[:n])).sum(-1).clamp_min(0)


def generated_kl(base: Any, other: Any) -> torch.Tensor:
    """KL(base || other) at each generated position of two traces of one
    prompt: the last read layer's output distributions that chose each
    generated token (rows ``prompt_len - 1`` onwards), ``[generated]``."""
    start = len(base.prompt_token_ids) - 1
    return kl_per_position(base.vocab_logprobs()[-1, start:], other.vocab_logprobs()[-1, start:])


@dataclass
class Comparison:
    """Baseline and steered runs of the same prompts, made in one batch.

    ``kl[i]`` is KL(baseline || steered) of the next-token distributions at
    each generated position of prompt ``i`` (each run on its own prefix, so
    after the first divergence it also reflects the different text).
    ``first_divergence[i]``: index of the first generated token that differs
    (None when the texts are identical). ``label``: what was done to the
    second run, as its figure row and hover name it (``"steered"``,
    ``"ablated"``, ``"clamped"``: :func:`run_label` of the edits); the
    attribute stays ``steered`` whatever the edit.
    """

    baseline: Run
    steered: Run
    kl: list[torch.Tensor] = field(default_factory=list)
    label: str = "steered"

    @property
    def first_divergence(self) -> list[int | None]:
        return [
            first_divergence(b.output_token_ids, s.output_token_ids)
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

    def figure(self, prompt: int = 0, *, what: str | None = None):
        """Baseline vs the edited run of prompt ``prompt``, as
        :func:`vlens.plots.baseline_vs_steered` draws it: the logprob delta
        per generated position, and both token rows (``"baseline"`` and
        :attr:`label`), wrapped, with the first divergence outlined. The
        title gives that position (or says there is none), after ``what``
        (the settings, in words) when given."""
        if not 0 <= prompt < len(self.baseline):
            raise IndexError(f"prompt {prompt} of a comparison of {len(self.baseline)}")
        frame = self.to_frame()
        if frame.empty:
            raise ValueError("nothing was generated: no tokens to show")
        frame = frame[frame["prompt"] == prompt]
        positions = [int(p) for p in frame["position"]]
        i = self.first_divergence[prompt]
        at = None if i is None or i >= len(positions) else positions[i]
        where = "no divergence" if at is None else f"first divergence at position {at}"

        def column(name):
            return [None if v is None or v != v else v for v in frame[name].tolist()]

        return baseline_vs_steered(
            column("token_base"), column("token_steered"),
            column("logprob_base"), column("logprob_steered"),
            positions=positions, divergence=at, label=self.label,
            n_prompt=len(self.baseline[prompt].prompt_token_ids),
            title=f"{what}: {where}" if what else f"baseline vs {self.label}: {where}",
        )


@dataclass
class Sweep:
    """Prompts steered at several scales, all in one batch.

    ``runs[j]`` is the Run at ``scales[j]`` (its trace ``i``: prompt ``i``);
    ``baseline`` the unsteered Run (one trace per prompt), as on
    :class:`Comparison`. ``kl[j][i]``: KL(baseline || steered) at each
    generated position of prompt ``i`` at scale ``j`` (computed here, with
    :func:`generated_kl`). ``label``: what the scales scale, in words (the
    figure's title starts with it when given).
    """

    prompts: list[str]
    scales: list[float]
    runs: list[Run]
    baseline: Run
    label: str = ""
    kl: list[list[torch.Tensor]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if len(self.runs) != len(self.scales):
            raise VlensError(f"{len(self.scales)} scales but {len(self.runs)} runs")
        if len(self.baseline) != n or any(len(r) != n for r in self.runs):
            raise VlensError(f"the baseline and each run need one trace per prompt ({n})")
        self.kl = [[generated_kl(b, t) for b, t in zip(self.baseline, run)] for run in self.runs]

    def to_frame(self):
        """Tidy: one row per (prompt, scale) -- ``prompt`` (its index),
        ``scale``, the text, the mean logprob of the generated tokens, mean
        and first-position KL from the baseline, and the first generated
        position that differs from it. Rows go prompt by prompt, scales in
        order within each."""
        import pandas as pd

        rows = []
        for i, base in enumerate(self.baseline):
            for j, scale in enumerate(self.scales):
                t, kl = self.runs[j][i], self.kl[j][i]
                n = len(t.prompt_token_ids)
                gen = [x for x in t.logprobs[n:] if x is not None]
                rows.append({
                    "prompt": i,
                    "scale": scale,
                    "text": t.text,
                    "n_generated": len(t.output_token_ids),
                    "mean_logprob": sum(gen) / len(gen) if gen else float("nan"),
                    "kl_first": float(kl[0]) if len(kl) else float("nan"),
                    "kl_mean": float(kl.mean()) if len(kl) else float("nan"),
                    "first_divergence": first_divergence(base.output_token_ids,
                                                         t.output_token_ids),
                })
        return pd.DataFrame(rows)

    def figure(self, metric: str = "kl_mean", prompt: int | None = None):
        """``metric`` (a column of :meth:`to_frame`: ``kl_mean``,
        ``kl_first``, ``mean_logprob`` …) against scale, as
        :func:`vlens.plots.dose_response` draws it: one line per prompt
        (``prompt=None``) or the line of prompt index ``prompt``; the hover
        has each scale's text."""
        frame = self.to_frame()
        n = len(self.prompts)
        what = f"{self.label}: " if self.label else ""
        if prompt is not None:
            if isinstance(prompt, bool) or not isinstance(prompt, int) or not 0 <= prompt < n:
                raise VlensError(f"prompt= is a prompt index, 0 to {n - 1}, got {prompt!r}")
            frame = frame[frame["prompt"] == prompt]
        title = f"{what}{metric} against scale ({len(self.scales)} scales"
        if prompt is None and n > 1:
            return dose_response(frame, metric, by="prompt", title=f"{title}, {n} prompts)")
        return dose_response(frame, metric,
                             title=title + (f", prompt {prompt})" if n > 1 else ")"))
