"""Input checks for the Session: every bad input becomes a VlensError that
says what was wrong and what would be right, before anything runs.

A mixin so the checks can use the live engine's facts (layers, hidden size,
max_model_len, tokenizer) while living apart from the running code.
"""

from __future__ import annotations

from typing import Any

from vlens.errors import VlensError
from vlens.steering import Steer

__all__ = ["InputChecks"]


class InputChecks:
    """Mixed into :class:`vlens.Session`; needs ``n_layers``, ``hidden_size``,
    ``sites``, ``max_model_len`` and ``tokenize``."""

    def _check_prompts(self, prompts: Any) -> tuple[list[str], list[list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise VlensError(
                f"prompts must be a string or a list of strings, got {type(prompts).__name__}"
            )
        if not prompts:
            raise VlensError("prompts is empty: pass at least one prompt string")
        ids = []
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise VlensError(
                    f"prompt {i} is a {type(p).__name__}, not a string: pass text"
                )
            if not p.strip():
                raise VlensError(f"prompt {i} is empty: give it at least one word")
            toks = self.tokenize(p)
            if len(toks) >= self.max_model_len:
                raise VlensError(
                    f"prompt {i} is {len(toks)} tokens long but the engine's "
                    f"max_model_len is {self.max_model_len}: shorten it to under "
                    f"{self.max_model_len} tokens, or start the Session with a larger "
                    "max_model_len="
                )
            ids.append(toks)
        return list(prompts), ids

    def _check_layers(self, layers: Any) -> list[int]:
        n = self.n_layers
        if layers is None:
            return list(range(n))
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if isinstance(layers, range):
            layers = list(layers)
        if not isinstance(layers, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in layers
        ):
            raise VlensError(
                f"layers must be None (all), an int or a list of ints, got {layers!r}"
            )
        if not layers:
            raise VlensError(f"layers is empty: pick from 0 to {n - 1}, or None for all")
        bad = [x for x in layers if not 0 <= x < n]
        if bad:
            raise VlensError(
                f"layer {bad[0]} does not exist: this model has {n} layers, "
                f"numbered 0 to {n - 1}"
            )
        return list(dict.fromkeys(layers))

    def _check_sites(self, sites: Any) -> list[str]:
        if isinstance(sites, str):
            sites = [sites]
        if not isinstance(sites, (list, tuple)):
            raise VlensError(f"sites must be a site name or a list of them, got {sites!r}")
        known = self.sites
        for s in sites:
            if s not in known:
                raise self._no_such_site(s, known)
        return list(dict.fromkeys(sites))

    def _no_such_site(self, site: Any, known: list[str]) -> VlensError:
        """The error for a site this model lacks: why, where the architecture
        has no such value (a parallel block's resid_mid), else what exists."""
        why = self._engine.info.get("absent_sites", {}).get(site)
        if why:
            return VlensError(f"site {site!r} does not exist in this model: {why}")
        return VlensError(f"unknown site {site!r}: this model has {', '.join(known)}")

    def _check_steer(self, st: Any, prompt_len: int, max_new_tokens: int) -> Steer:
        if not isinstance(st, Steer):
            raise VlensError(f"steer entries must be vlens.Steer objects, got {type(st).__name__}")
        n = self.n_layers
        if not 0 <= st.layer < n:
            raise VlensError(
                f"Steer layer {st.layer} does not exist: this model has {n} layers, "
                f"numbered 0 to {n - 1}"
            )
        if st.site not in self.sites:
            raise self._no_such_site(st.site, self.sites)
        if st.site not in self._writable():
            raise VlensError(
                f"Steer site {st.site!r} cannot be written: use one of {', '.join(self._writable())}"
            )
        if st.vector.shape[0] != self.hidden_size:
            raise VlensError(
                f"Steer vector has {st.vector.shape[0]} elements but this model's hidden "
                f"size is {self.hidden_size}: compute it on this model (s.direction)"
            )
        if isinstance(st.span, tuple):
            total = prompt_len + max_new_tokens - 1  # rows the request will run
            if st.span[1] > total:
                raise VlensError(
                    f"Steer span {st.span} reaches past the sequence: this request runs "
                    f"{total} tokens ({prompt_len} prompt + {max_new_tokens - 1} fed back), "
                    f"positions 0 to {total - 1}"
                )
        return st

    def _writable(self) -> list[str]:
        from vlens.sites import WRITABLE

        return [x for x in WRITABLE if x in self.sites]

    def _steers_per_prompt(self, steer: Any, n_prompts: int) -> list[list[Steer]]:
        """One Steer, a list of Steers (all applied to every prompt), or one
        entry per prompt (a Steer, a list of Steers, or None)."""
        if steer is None:
            return [[] for _ in range(n_prompts)]
        if isinstance(steer, Steer):
            return [[steer] for _ in range(n_prompts)]
        if isinstance(steer, (list, tuple)):
            if all(isinstance(x, Steer) for x in steer):
                return [list(steer) for _ in range(n_prompts)]
            if len(steer) != n_prompts:
                raise VlensError(
                    f"steer has {len(steer)} per-prompt entries for {n_prompts} prompts: "
                    "give one entry (a Steer, a list of Steers, or None) per prompt, "
                    "or one Steer / a list of Steers for all"
                )
            out = []
            for i, x in enumerate(steer):
                if x is None:
                    out.append([])
                elif isinstance(x, Steer):
                    out.append([x])
                elif isinstance(x, (list, tuple)) and all(isinstance(y, Steer) for y in x):
                    out.append(list(x))
                else:
                    raise VlensError(f"steer entry {i} is {x!r}: use a Steer, a list of Steers, or None")
            return out
        raise VlensError(f"steer must be a vlens.Steer, a list of them, or None; got {type(steer).__name__}")


    def _check_budget(self, items: list) -> None:
        """Refuse a call whose reads would exceed ``self.read_budget`` bytes,
        before it runs, with the estimate and how to shrink it."""
        width = {"full": self.hidden_size, "norm": 1, "logprobs": self._engine.info["vocab_size"]}
        total = 0
        biggest = ""
        for ids, plan, params in items:
            if plan is None or not plan.reads:
                continue
            rows = (len(ids) + params.max_tokens - 1) * max(1, params.n)
            for read in plan.reads:
                w = 1 if read.site == "positions" else width.get(read.reduce, 3 * read.k)
                size = rows * len(read.layers) * w * 4
                total += size
                if read.reduce == "full" and size * 2 > total:
                    biggest = read.site
        if total > self.read_budget:
            gib = total / 2**30
            raise VlensError(
                f"this call would read about {gib:.2f} GiB of activations, over the "
                f"session's read budget of {self.read_budget / 2**30:.2f} GiB. "
                "Reduce it: reduce='norm' (the worker ships one number per token), "
                "fewer layers=, fewer sites=, fewer or shorter prompts, smaller "
                "max_new_tokens=; or raise s.read_budget (bytes)"
                + (f" (most of it is the full {biggest} reads)" if biggest else "")
            )
