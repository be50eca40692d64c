"""Steering workflows of the Session: directions, compare, sweep.

A mixin over the Session's running machinery (``trace``, ``_execute``,
``_build_run``): each workflow builds its requests' plans and runs all of
them in ONE engine batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlens.errors import VlensError
from vlens.plan import Read
from vlens.results import Run, Trace
from vlens.steering import Comparison, Steer, Sweep, kl_per_position

__all__ = ["SteeringMethods"]


class SteeringMethods:
    """Mixed into :class:`vlens.Session`."""

    def direction(
        self,
        positive: Sequence[str],
        negative: Sequence[str],
        *,
        layer: int,
        site: str = "resid_post",
        position: str = "last",
        progress: Any = None,
    ) -> torch.Tensor:
        """Difference of means: ``mean(positive) - mean(negative)`` of ``site``
        at ``layer``, ``[hidden]`` float32. ``position="last"`` takes each
        prompt's last token, ``"mean"`` the mean over its tokens (the BOS row,
        the same for every prompt, left out)."""
        if position not in ("last", "mean"):
            raise VlensError(f"position must be 'last' or 'mean', got {position!r}")
        for name, group in (("positive", positive), ("negative", negative)):
            if isinstance(group, str) or not isinstance(group, (list, tuple)) or not group:
                raise VlensError(f"{name} must be a non-empty list of prompt strings")
        layer = self._check_layers([layer])[0]
        self._check_sites([site])
        run = self.trace(list(positive) + list(negative), layers=[layer], sites=[site],
                         max_new_tokens=1, logprobs=False, progress=progress)
        bos = self.tokenizer.bos_token_id
        means = []
        for t in run:
            rows = t.activations(site)[0]  # [prompt tokens, hidden]
            if position == "last":
                means.append(rows[-1])
            else:
                skip = 1 if bos is not None and t.token_ids[0] == bos and len(rows) > 1 else 0
                means.append(rows[skip:].mean(0))
        stacked = torch.stack(means)
        k = len(positive)
        return stacked[:k].mean(0) - stacked[k:].mean(0)

    def compare(
        self,
        prompts: str | Sequence[str],
        *,
        steer: Any,
        max_new_tokens: int = 16,
        progress: Any = None,
        **sampling: Any,
    ) -> Comparison:
        """Baseline and steered generations of the same prompts in ONE engine
        batch: both texts, per-token logprobs, KL per position, first
        divergence."""
        prompts, prompt_ids = self._check_prompts(prompts)
        per_prompt = self._steers_per_prompt(steer, len(prompts))
        if not any(per_prompt):
            raise VlensError("compare needs a steer= (nothing would differ)")
        for ids, steers in zip(prompt_ids, per_prompt):
            for st in steers:
                self._check_steer(st, len(ids), max_new_tokens)
        self._ship_vectors(st for steers in per_prompt for st in steers)
        last = self.n_layers - 1
        reads = [Read("resid_post", (last,), "logprobs")]
        call = f"{self._name}-{next(self._calls)}"
        items = [
            self._request(f"{call}-{arm}{i}", i, ids, reads, steers, [],
                          max_new_tokens, True, sampling)
            for arm, steers_list in (("b", [[] for _ in prompts]), ("s", per_prompt))
            for i, (ids, steers) in enumerate(zip(prompt_ids, steers_list))
        ]
        outputs, collected = self._execute(items, progress)
        n = len(prompts)
        plans = [it[1] for it in items]
        base = self._build_run(prompts, prompt_ids, plans[:n], outputs[:n], collected, True)
        steered = self._build_run(prompts, prompt_ids, plans[n:], outputs[n:], collected, True)
        kl = [self._generated_kl(b, s_) for b, s_ in zip(base, steered)]
        return Comparison(base, steered, kl)

    @staticmethod
    def _generated_kl(base: Trace, steered: Trace) -> torch.Tensor:
        """KL at each generated position: the distributions that chose each
        generated token (rows prompt_len - 1 onwards)."""
        start = len(base.prompt_token_ids) - 1
        b = base.vocab_logprobs()[0, start:]
        s_ = steered.vocab_logprobs()[0, start:]
        return kl_per_position(b, s_)

    def sweep(
        self,
        prompt: str,
        *,
        steer: Steer,
        scales: Sequence[float],
        max_new_tokens: int = 16,
        progress: Any = None,
        **sampling: Any,
    ) -> Sweep:
        """``steer`` at each of ``scales`` on one prompt, all in ONE batch
        (plus an unsteered baseline when 0 is not among the scales)."""
        if not isinstance(prompt, str):
            raise VlensError("sweep takes one prompt string")
        if not isinstance(steer, Steer):
            raise VlensError("sweep takes one vlens.Steer as steer=")
        if not isinstance(scales, (list, tuple)) or not scales:
            raise VlensError("scales must be a non-empty list of numbers")
        bad = [x for x in scales if isinstance(x, bool) or not isinstance(x, (int, float))]
        if bad:
            raise VlensError(f"scales must be numbers; {bad[0]!r} is not")
        variants = [steer.with_scale(float(x)) for x in scales]  # validates each
        _, (ids,) = self._check_prompts([prompt])
        self._check_steer(steer, len(ids), max_new_tokens)
        self._ship_vectors([steer])
        last = self.n_layers - 1
        reads = [Read("resid_post", (last,), "logprobs")]
        call = f"{self._name}-{next(self._calls)}"
        has_zero = any(float(x) == 0.0 for x in scales)
        arms = [(str(j), [] if st.scale == 0 else [st]) for j, st in enumerate(variants)]
        if not has_zero:
            arms.append(("base", []))
        items = [
            self._request(f"{call}-{name}", 0, ids, reads, steers, [],
                          max_new_tokens, True, sampling)
            for name, steers in arms
        ]
        outputs, collected = self._execute(items, progress)
        plans = [it[1] for it in items]
        run = self._build_run([prompt] * len(items), [ids] * len(items), plans, outputs,
                              collected, True)
        traces = list(run)
        baseline = traces[[float(x) for x in scales].index(0.0)] if has_zero else traces[-1]
        steered = Run(traces[: len(scales)], prompts=[prompt] * len(scales))
        kl = [self._generated_kl(baseline, t) for t in steered]
        return Sweep(prompt, [float(x) for x in scales], steered, baseline, kl)

