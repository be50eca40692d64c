"""What ``vlens.diff`` returns: two models' readings of the same token ids.

A :class:`Diff` holds, per prompt, up to three texts (``"prompt"``: the
prompt alone; ``"base"`` / ``"tuned"``: the prompt and that model's own
greedy continuation), each read by both models (the model that wrote a
continuation as it wrote it, the other teacher-forced). Per token:
KL(tuned || base) of the next-token distributions after it, each model's
log-probability of it, and per site and layer the activation difference
(tuned - base), its norm and the cosine of the two activations. From the
differences: :meth:`Diff.direction` (a vector for ``Steer``) and
:meth:`Diff.lens` (the activation-difference lens). Nothing here touches
an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlens.checkpoint import Checkpoint, read_checkpoint
from vlens.errors import VlensError
from vlens.plots import diff_figure
from vlens.protocol.sites import lens_top
from vlens.results.run import span_mean
from vlens.tokens import TokenReader

__all__ = ["Diff", "DiffText"]

TEXTS = ("prompt", "base", "tuned")


@dataclass
class DiffText:
    """One text (``ids`` ``[T]``, the first ``n_prompt`` the prompt) as both
    models read it. Per token j: ``kl[j]`` KL(tuned || base) of the two
    next-token distributions after token j (over the shared ids);
    ``logprob_base[j]`` / ``logprob_tuned[j]`` each model's log-probability
    of token j (NaN at j = 0); ``outside_*[j]`` the probability each model
    put on ids the other lacks. ``delta[site]`` ``[layers, T, width]``
    tuned - base, ``cosine[site]`` ``[layers, T]`` of the two activations,
    ``layers`` the layer numbers of those stacks."""

    kind: str
    ids: list[int]
    tokens: list[str]
    n_prompt: int
    kl: torch.Tensor
    logprob_base: torch.Tensor
    logprob_tuned: torch.Tensor
    outside_base: torch.Tensor
    outside_tuned: torch.Tensor
    delta: dict[str, torch.Tensor] = field(repr=False)
    cosine: dict[str, torch.Tensor] = field(repr=False)
    layers: list[int] = field(default_factory=list)

    def head(self, n: int) -> DiffText:
        """The first ``n`` tokens (a causal model reads them the same alone)."""
        cut = {k: getattr(self, k)[:n] for k in ("ids", "tokens", "kl", "logprob_base",
                                                  "logprob_tuned", "outside_base",
                                                  "outside_tuned")}
        return DiffText(kind="prompt", n_prompt=min(n, self.n_prompt), layers=self.layers,
                        delta={s: d[:, :n] for s, d in self.delta.items()},
                        cosine={s: c[:, :n] for s, c in self.cosine.items()}, **cut)

    def norm(self, site: str = "resid_post") -> torch.Tensor:
        """``[layers, T]``: the norm of the activation difference."""
        return self.delta[site].norm(dim=-1)


@dataclass
class Diff:
    """Two models read the same prompts (``vlens.diff(base, tuned, prompts)``).

    * ``kl(i, text="prompt")`` -- ``[tokens]``: entry j is KL(tuned || base)
      of the two models' next-token distributions after token j,
      teacher-forced on the same ids, prompt first (``text="base"`` /
      ``"tuned"``: the prompt and that model's own continuation);
    * ``text(i, which)`` -- the :class:`DiffText` (logprobs, norms, cosines);
      ``continuations`` -- each prompt's (base, tuned) generated texts;
    * ``to_frame()`` -- one row per prompt, text and token;
    * ``direction(layer)`` -- the mean difference (tuned - base), ``[hidden]``;
    * ``lens(layer, first=5)`` -- the logit lens of the mean difference over
      each prompt's first tokens;
    * ``figure(i)`` -- the tokens coloured by KL over a layer x token heatmap.
    """

    prompts: list[str]
    texts: list[dict[str, DiffText]]
    layers: list[int]
    sites: list[str]
    base_model: str
    tuned_model: str
    shared_vocab: int
    tokenizer: Any = field(default=None, repr=False)
    tuned_tokenizer: Any = field(default=None, repr=False)
    max_new_tokens: int = 0
    _lenses: dict[str, Any] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.texts)

    def text(self, i: int, which: str = "prompt") -> DiffText:
        """Prompt ``i``'s ``which`` text: ``"prompt"``, ``"base"`` or ``"tuned"``
        (the last two when the diff generated: ``max_new_tokens > 0``)."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.texts):
            raise VlensError(f"prompt must be 0..{len(self.texts) - 1}, got {i!r}")
        held = self.texts[i]
        if which not in held:
            raise VlensError(f"text must be one of {sorted(held)}, got {which!r}"
                             + ("" if self.max_new_tokens else
                                " (the diff generated nothing: max_new_tokens=0)"))
        return held[which]

    def kl(self, i: int, text: str = "prompt") -> torch.Tensor:
        """``[tokens]`` KL(tuned || base) after each token of prompt ``i``'s ``text``."""
        return self.text(i, text).kl

    @property
    def continuations(self) -> list[tuple[str, str]]:
        """Each prompt's (base, tuned) continuation as text ("" when none)."""
        def words(t: DiffText) -> str:
            if self.tokenizer is not None:
                return self.tokenizer.decode(t.ids[t.n_prompt:])
            return "".join(t.tokens[t.n_prompt:])
        return [(words(h["base"]), words(h["tuned"])) if "base" in h else ("", "")
                for h in self.texts]

    def to_frame(self):
        """One row per (prompt, text, token): ``prompt``, ``text``,
        ``position``, ``token_id``, ``token``, ``kl`` (after the token),
        ``logprob_base``, ``logprob_tuned`` (of the token)."""
        import pandas as pd

        rows = []
        for i, held in enumerate(self.texts):
            for which in TEXTS:
                if which not in held:
                    continue
                t = held[which]
                for j, (tid, tok) in enumerate(zip(t.ids, t.tokens)):
                    rows.append({"prompt": i, "text": which, "position": j, "token_id": tid,
                                 "token": tok, "kl": float(t.kl[j]),
                                 "logprob_base": _num(t.logprob_base[j]),
                                 "logprob_tuned": _num(t.logprob_tuned[j])})
        return pd.DataFrame(rows)

    def _rows(self, site: str, layer: int, text: str) -> list[tuple[torch.Tensor, DiffText]]:
        if site not in self.sites:
            raise VlensError(f"site {site!r} was not read: the diff read {self.sites}")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer not in self.layers:
            raise VlensError(f"layer {layer!r} was not read: the diff read {self.layers}")
        k = self.layers.index(layer)
        return [(self.text(i, text).delta[site][k], self.text(i, text))
                for i in range(len(self.texts))]

    def direction(self, layer: int, span: Any = "prompt", *, site: str = "resid_post",
                  text: str = "prompt") -> torch.Tensor:
        """The mean activation difference (tuned - base) at ``layer``,
        ``[hidden]``: each prompt's rows of ``span`` averaged, then the
        prompts. ``span``: a span of the one grammar (:mod:`vlens.spans`)
        over ``text``'s tokens: ``"last"``, ``"prompt"`` (every token, BOS
        included: ``slice(1, None)`` leaves it out), a range or positions."""
        means = [span_mean(rows, span, (), "the text", "Diff.direction") for rows, _t in
                 self._rows(site, layer, text)]
        return torch.stack(means).mean(0)

    def lens(self, layer: int, first: int = 5, *, k: int = 10, site: str = "resid_post",
             through: str = "base", lens: Any = None):
        """The activation-difference lens: the mean difference at ``layer``
        over the first ``first`` tokens of every prompt (BOS left out),
        through ``through``'s final norm and unembedding (the base model's,
        or ``"tuned"``; read from its folder, as the engine's lens computes it) or
        through ``lens`` (anything with ``logits([n, hidden]) -> [n,
        vocab]``, e.g. :class:`vlens.lens.LogitLens` of a connected model);
        its top ``k`` tokens as a frame (``rank``, ``token_id``, ``token``,
        ``prob``, ``logit``)."""
        import pandas as pd

        if isinstance(first, bool) or not isinstance(first, int) or first < 1:
            raise VlensError(f"first must be an int >= 1, got {first!r}")
        if through not in ("base", "tuned"):
            raise VlensError(f"through must be 'base' or 'tuned', got {through!r}")
        bos = self._bos()
        means = []
        for rows, t in self._rows(site, layer, "prompt"):
            skip = 1 if bos is not None and t.ids[0] == bos and len(t.ids) > 1 else 0
            means.append(rows[skip:skip + first].mean(0))
        vec = torch.stack(means).mean(0)
        logits = (lens or self._lens(through)).logits(vec[None].float())[0]
        ids, probs = lens_top(logits[None], min(k, logits.shape[-1]))
        ids, probs = ids[0].tolist(), probs[0].tolist()
        tok = self.tokenizer if through == "base" else self.tuned_tokenizer
        names = TokenReader(tok).texts(ids) if tok is not None else [str(x) for x in ids]
        return pd.DataFrame({"rank": range(1, len(ids) + 1), "token_id": ids, "token": names,
                             "prob": probs, "logit": [float(logits[x]) for x in ids]})

    def _lens(self, through: str) -> Any:
        if through not in self._lenses:
            path = self.base_model if through == "base" else self.tuned_model
            self._lenses[through] = _final_lens(path)
        return self._lenses[through]

    def _bos(self) -> int | None:
        return getattr(self.tokenizer, "bos_token_id", None)

    def figure(self, i: int = 0, *, text: str | None = None, site: str = "resid_post",
               what: str = "norm"):
        """Prompt ``i``'s ``text`` (default: the tuned model's continuation
        when there is one, else the prompt): its tokens coloured by KL over
        a layer x token heatmap of the activation difference (``what``:
        ``"norm"`` of tuned - base, or ``"cosine"`` of the two)."""
        if text is None:
            text = "tuned" if "tuned" in self.texts[i] else "prompt"
        t = self.text(i, text)
        if site not in self.sites:
            raise VlensError(f"site {site!r} was not read: the diff read {self.sites}")
        if what not in ("norm", "cosine"):
            raise VlensError(f"what must be 'norm' or 'cosine', got {what!r}")
        grid = t.norm(site) if what == "norm" else t.cosine[site]
        return diff_figure(t.tokens, t.kl.tolist(), grid.tolist(), t.layers,
                           n_prompt=t.n_prompt, value=what, site=site,
                           title=f"prompt {i}, {text} text: KL(tuned ‖ base) and the "
                                 f"activation difference ({what})")


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if v != v else v


def _final_lens(path: str) -> Checkpoint:
    """A model's final norm, projection and unembedding, read from its folder
    (:func:`vlens.checkpoint.read_checkpoint`, as :class:`vlens.lens.LogitLens`
    reads them; that module reaches the remote client, which results may
    not import); its ``logits`` is the engine's final-norm function."""
    if not (Path(path) / "config.json").is_file():
        raise VlensError(f"the lens reads the final norm and unembedding from the model's "
                         f"folder, and {path} is none (a connected model?): pass "
                         "lens=vlens.lens.LogitLens.from_pretrained(...)")
    got = read_checkpoint(path)
    if got is None:
        raise VlensError(f"{path} has no final norm weight or unembedding vlens can find; "
                         "pass lens= (anything with logits([n, hidden]) -> [n, vocab])")
    return got
