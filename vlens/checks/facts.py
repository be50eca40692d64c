"""What the checks know of the live model (:class:`ModelFacts`) and the
bounds on what a write may put into it: the part of the checks that the
argument checks (``vlens.checks``) and the plan checks
(``vlens.checks.plans``) share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vlens import spans
from vlens.errors import VlensError
from vlens.protocol.site_names import HEAD_WRITABLE, WRITABLE

#: the largest finite value of each dtype a model may run in
DTYPE_MAX = {"float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38,
             "float16": 65504.0}

#: the largest ``|scale|`` of a relative Steer: it adds ``scale`` times each
#: row's own norm, so 100 already drowns the row a hundred times over
RELATIVE_MAX = 100.0

# Sampling settings vlens manages itself: the user sets them another way.
MANAGED = {
    "max_tokens": "use max_new_tokens=",
    "extra_args": "vlens uses extra_args to carry its plan",
    "logprobs": "use logprobs=True/False",
    "prompt_logprobs": "use logprobs=True/False",
    "skip_reading_prefix_cache": "traced requests always recompute their prompt",
}


@dataclass(frozen=True)
class ModelFacts:
    """What the checks need to know about the live model."""

    n_layers: int
    hidden_size: int
    sites: tuple[str, ...]
    writable: tuple[str, ...]  # sites a Steer or edit may change
    max_model_len: int
    vocab_size: int
    device: str = "cpu"
    #: sites this architecture has no value for -> why (a parallel block's resid_mid)
    absent: tuple[tuple[str, str], ...] = ()
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    #: the model's dtype ("float32", "bfloat16", "float16"): bounds the writes
    dtype: str = "float32"

    def width(self, site: str) -> int:
        """Floats per token of a full read (or of a vector written) at ``site``;
        for ``attn_pattern`` per key."""
        if site in ("q", "z", "attn_pattern"):
            return self.n_heads * (1 if site == "attn_pattern" else self.head_dim)
        if site in ("k", "v"):
            return self.n_kv_heads * self.head_dim
        return 1 if site == "positions" else self.hidden_size

    def no_such_site(self, site: Any, what: str = "site") -> VlensError:
        """The error for a site this model lacks: why, where the architecture
        has no such value, else which sites exist."""
        why = dict(self.absent).get(site)
        if why:
            return VlensError(f"{what} {site!r} does not exist in this model: {why}")
        return VlensError(f"unknown {what} {site!r}: this model has {', '.join(self.sites)}")

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> ModelFacts:
        """From ``Engine.info``."""
        sites = tuple(info["sites"])
        return cls(
            n_layers=int(info["n_layers"]),
            hidden_size=int(info["hidden_size"]),
            sites=sites,
            writable=tuple(x for x in WRITABLE + HEAD_WRITABLE if x in sites),
            n_heads=int(info.get("n_heads", 0)),
            n_kv_heads=int(info.get("n_kv_heads", 0)),
            head_dim=int(info.get("head_dim", 0)),
            max_model_len=int(info["max_model_len"]),
            vocab_size=int(info["vocab_size"]),
            device=str(info.get("device", "cpu")),
            absent=tuple(sorted((info.get("absent_sites") or {}).items())),
            dtype=str(info.get("dtype", "float32")).removeprefix("torch."),
        )


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def write_bound(facts: ModelFacts) -> float:
    """The largest magnitude one write may put into an element of the
    residual stream (or a head's output): far enough under the dtype's
    largest value that adding it to the row cannot overflow, and small
    enough that the row's sum of squares (a norm, computed in float32)
    stays finite."""
    fmax = DTYPE_MAX.get(facts.dtype, DTYPE_MAX["float16"])
    return min(fmax / 64, math.sqrt(DTYPE_MAX["float32"] / max(1, facts.hidden_size)) / 4)


def check_write_size(what: str, peak: float, scale: float, relative: bool,
                     facts: ModelFacts) -> None:
    """A write that cannot overflow the model's dtype: a fixed add's largest
    value ``|scale| * peak`` (``peak``: the vector's largest ``|value|``; a
    set passes scale 1) under :func:`write_bound`, a relative add's
    ``|scale|`` at most :data:`RELATIVE_MAX`."""
    if not math.isfinite(scale) or not math.isfinite(peak):
        raise VlensError(f"{what}: scale and vector must be finite numbers")
    if relative:
        if abs(scale) > RELATIVE_MAX:
            raise VlensError(
                f"{what}: a relative scale of {scale:g} is out of range: it adds scale x each "
                f"token's own norm, so |scale| must be at most {RELATIVE_MAX:g} (1 already "
                "doubles the row)")
        return
    bound = write_bound(facts)
    if abs(scale) * peak > bound:
        raise VlensError(
            f"{what}: |scale| x the vector's largest value = {abs(scale) * peak:.3g} would "
            f"overflow this {facts.dtype} model: a write may put at most {bound:.3g} into a "
            f"value. Use a smaller scale (at most {bound / max(peak, 1e-30):.3g} for this "
            "vector), or relative=True for a fraction of the row's own norm")


def check_set_values(what: str, peak: float, facts: ModelFacts) -> None:
    """The values a set writes (an Ablate's mean, a patched cell), whose
    largest ``|value|`` is ``peak``, under :func:`write_bound`."""
    bound = write_bound(facts)
    if not math.isfinite(peak) or peak > bound:
        raise VlensError(
            f"{what}: its largest value {peak:.3g} would overflow this {facts.dtype} model: a "
            f"write may put at most {bound:.3g} into a value. Compute the mean from the "
            "model's own activations (mean=None does)")


def check_write_site(what: str, site: str, layer: int, facts: ModelFacts) -> None:
    """A Steer's or an Ablate's (site, layer): the layer exists and the site
    is one this model has and can write."""
    n = facts.n_layers
    if not 0 <= layer < n:
        raise VlensError(
            f"{what} layer {layer} does not exist: this model has {n} layers, "
            f"numbered 0 to {n - 1}"
        )
    if site not in facts.sites:
        raise facts.no_such_site(site, f"{what} site")
    if site not in facts.writable:
        raise VlensError(
            f"{what} site {site!r} cannot be written: use one of {', '.join(facts.writable)}"
        )


def check_span_fits(what: str, span: Any, prompt_len: int, max_new_tokens: int) -> None:
    """A Steer's or an Ablate's span lands on rows the request runs: the last
    generated token is sampled, never fed back, so a request runs
    ``prompt_len + max_new_tokens - 1`` rows at most."""
    total = prompt_len + max_new_tokens - 1
    if span == "generated" and max_new_tokens == 1:
        raise VlensError(
            f"{what} span 'generated' can never land with max_new_tokens=1: the one "
            "generated token is sampled, never fed back. Ask for max_new_tokens >= 2, "
            "or span='all'/'prompt'"
        )
    if isinstance(span, spans.Positions):
        spans.rows(span, prompt_len, total, None, what)  # each row must run
    elif isinstance(span, tuple):
        start, stop = span
        a = start + prompt_len if start < 0 else start
        b = total if stop is None else (stop + prompt_len if stop < 0 else stop)
        if b > total or not 0 <= a < b:
            raise VlensError(
                f"{what} span {span} reaches past the sequence or selects no row: this "
                f"request runs {total} tokens ({prompt_len} prompt + {max_new_tokens - 1} fed "
                f"back), positions 0 to {total - 1} (negative ones count back from the "
                "prompt's end)"
            )
