"""Input checks: every bad input becomes a VlensError that says what was
wrong and what would be right, before anything is shipped to the workers.

Pure functions over :class:`ModelFacts` (what the live model is) and plain
arguments, so they can be read and tested without an engine; the Session
calls them before it builds a single request. The model's facts and the
bounds on writes live in :mod:`vlens.checks.facts`, the rules for a whole
plan (shared with the server's guard) in :mod:`vlens.checks.plans`; both are
re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vlens.checks.facts import (
    MANAGED,
    RELATIVE_MAX,
    ModelFacts,
    check_set_values,
    check_span_fits,
    check_write_site,
    check_write_size,
    is_int,
    write_bound,
)
from vlens.checks import rules
from vlens.checks.plans import (
    LENS_K_MAX,
    LENS_SITES,
    PLAN_MAX,
    REDUCES,
    check_plan,
    check_plan_size,
    check_read,
)
from vlens.edits import Steer
from vlens.errors import VlensError
from vlens.protocol.plan import Read

__all__ = [
    "ModelFacts",
    "check_budget",
    "check_edit",
    "check_generation",
    "check_heads",
    "check_layers",
    "check_plan",
    "check_plan_size",
    "check_steer_fits",
    "check_read",
    "check_write_size",
    "check_reads",
    "check_sites",
    "check_steer",
    "write_bound",
    "check_set_values",
    "check_span_fits",
    "check_write_site",
    "MANAGED",
    "RELATIVE_MAX",
    "PLAN_MAX",
    "REDUCES",
    "LENS_SITES",
    "LENS_K_MAX",
    "REMOTE_EDIT",
]


def check_layers(layers: Any, facts: ModelFacts) -> list[int]:
    """None (all), an int, a range or a list of ints -> distinct layer numbers."""
    n = facts.n_layers
    if layers is None:
        return list(range(n))
    if is_int(layers):
        layers = [layers]
    if isinstance(layers, range):
        layers = list(layers)
    if not isinstance(layers, (list, tuple)) or not all(is_int(x) for x in layers):
        raise VlensError(f"layers must be None (all), an int or a list of ints, got {layers!r}")
    if not layers:
        raise VlensError(f"layers is empty: pick from 0 to {n - 1}, or None for all")
    bad = [x for x in layers if not 0 <= x < n]
    if bad:
        raise VlensError(
            f"layer {bad[0]} does not exist: this model has {n} layers, numbered 0 to {n - 1}"
        )
    return list(dict.fromkeys(layers))


def check_sites(sites: Any, facts: ModelFacts) -> list[str]:
    """A site name or a list of them -> distinct site names."""
    if isinstance(sites, str):
        sites = [sites]
    if not isinstance(sites, (list, tuple)):
        raise VlensError(f"sites must be a site name or a list of them, got {sites!r}")
    for s in sites:
        if s not in facts.sites:
            raise facts.no_such_site(s)
    return list(dict.fromkeys(sites))


def check_generation(max_new_tokens: Any, sampling: dict[str, Any], facts: ModelFacts) -> None:
    """``max_new_tokens`` and the sampling settings: refuses settings vlens
    manages and settings that would break the engine. (vLLM's own
    validation runs when the runner builds SamplingParams, still before
    anything is shipped.)"""
    for key, how in MANAGED.items():
        if key in sampling:
            raise VlensError(f"{key}= is set by vlens: {how}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise VlensError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if sampling.get("seed") is not None and facts.device == "cpu":
        raise VlensError(
            "seed= is refused on vLLM's CPU build: when a seeded request's prompt is "
            "split across engine steps (chunked prefill) its worker calls "
            "Generator.set_offset, which CPU generators lack, and the engine dies. "
            "Sample without a seed, or run on a GPU."
        )


def _head_numbers(heads: Any, facts: ModelFacts, what: str) -> list[int]:
    """Query head numbers of this model, as a list (an int is one head)."""
    if is_int(heads):
        heads = [heads]
    if (isinstance(heads, (str, bytes)) or not isinstance(heads, (list, tuple, range))
            or not heads or not all(is_int(h) for h in heads)):
        raise VlensError(f"{what} heads= must be {'None (all), ' if 'trace' in what else ''}"
                         f"'all' or a non-empty list of query heads, got {heads!r:.60}")
    bad = [h for h in heads if not 0 <= h < facts.n_heads]
    if bad:
        raise VlensError(f"head {bad[0]} does not exist: this model has {facts.n_heads} "
                         f"attention heads, numbered 0 to {facts.n_heads - 1}")
    return [int(h) for h in heads]


def check_heads(heads: Any, sites: list[str], facts: ModelFacts) -> tuple[int, ...]:
    """``heads=`` of a trace: None (every head) or query head numbers; it
    selects the heads of ``attn_pattern`` only."""
    if heads is None:
        return ()
    if "attn_pattern" not in sites:
        raise VlensError("heads= selects heads of the attn_pattern read: add "
                         "'attn_pattern' to sites=, or leave heads out")
    if heads == "all":
        return tuple(range(facts.n_heads))
    return tuple(dict.fromkeys(_head_numbers(heads, facts, "trace")))


def check_head_cells(heads: Any, site: Any, facts: ModelFacts, what: str) -> list[int] | None:
    """``heads=`` of a grid method (``patch``, ``attribution_patch``): None
    (one cell per position), ``"all"`` or a list of query heads (one cell per
    head, at site ``z``, which holds each head's output apart)."""
    if heads is None:
        return None
    if isinstance(heads, bool):
        raise VlensError(
            f"{what} heads={heads!r}: heads= takes 'all' (one cell per head) or a list of heads "
            "now; for one cell per head write heads='all' (it was per_head=True / heads=True), "
            "for one per position leave heads= out")
    heads = list(range(facts.n_heads)) if heads == "all" else _head_numbers(heads, facts, what)
    if len(set(heads)) != len(heads):
        raise VlensError(f"{what} heads= {heads} names a head twice")
    if site != "z":
        raise VlensError(
            f"{what} heads= gives one cell per head, which only site 'z' holds apart (each "
            f"head's output before o_proj); use site='z', or leave heads= out at {site!r}")
    return heads


def check_reads(sites: list[str], layers: list[int], reduce: str, k: Any,
                facts: ModelFacts, heads: tuple[int, ...] = ()) -> list[Read]:
    """The reads of a ``trace`` call: ``sites`` at ``layers`` reduced by
    ``reduce``, plus the logit lens top-``k`` of ``resid_post`` when k > 0.
    ``heads``: the query heads of an ``attn_pattern`` read (empty: all)."""
    if reduce not in ("full", "norm"):
        raise VlensError(f"reduce must be 'full' or 'norm', got {reduce!r}")
    if not is_int(k) or k < 0:
        raise VlensError(f"logit_lens must be a non-negative int (top-k), got {k!r}")
    if reduce != "full" and "attn_pattern" in sites:
        raise VlensError("attn_pattern is read in full only (probabilities have no useful "
                         "norm): read it in its own trace with reduce='full', and shrink it "
                         "with heads= or layers=")
    reads = [Read(site, tuple(layers), reduce, 0, heads if site == "attn_pattern" else ())
             for site in sites]
    if k:
        if k > facts.vocab_size:
            raise VlensError(
                f"logit_lens={k} is more than the vocabulary ({facts.vocab_size} tokens)"
            )
        reads.append(Read("resid_post", tuple(layers), "logit_lens", k))
    return reads


def check_steer(st: Any, facts: ModelFacts, prompt_len: int, max_new_tokens: int) -> Steer:
    """A Steer that fits this model (:func:`vlens.checks.rules.steer`) and
    can land on the request (``prompt_len`` prompt tokens,
    ``max_new_tokens`` generated)."""
    check_steer_fits(st, facts)
    check_span_fits("Steer", st.span, prompt_len, max_new_tokens)
    return st


def check_steer_fits(st: Any, facts: ModelFacts) -> None:
    """One Steer (a Clamp among them) against the model, by the one rule."""
    if not isinstance(st, Steer):
        raise VlensError(f"steer entries must be vlens.Steer objects, got {type(st).__name__}")
    feature = st.feature if getattr(st, "sae", None) is not None else None
    rules.steer(f"Steer (layer {st.layer}, {st.site})", st.site, st.layer,
                int(st.vector.shape[0]), float(st.vector.abs().max()), st.scale, st.relative,
                facts, feature=feature)


REMOTE_EDIT = (
    "edit= functions cannot run on a connected session (vlens.connect): they are Python "
    "code, and code does not cross the wire to a shared server. Use a vlens.Steer "
    "(steer=), vlens.Ablate or activation patching instead, which travel as data"
)


def check_edit(edit: Any, edit_at: Any, facts: ModelFacts, *,
               can_ship: bool, remote: bool = False) -> list[tuple[str, int]]:
    """``edit=`` / ``edit_at=`` -> the (site, layer) pairs to call it at
    (empty when there is no edit). ``can_ship``: whether a Python function
    can reach this engine's workers; ``remote``: the engine is a server."""
    if edit is None:
        if edit_at is not None:
            raise VlensError("edit_at= given without edit=: pass the function too")
        return []
    if remote:
        raise VlensError(REMOTE_EDIT)
    if not callable(edit):
        raise VlensError(f"edit must be a function fn(rows, ctx), got {type(edit).__name__}")
    if not can_ship:
        raise VlensError(
            "edit= functions run inside the workers and this engine runs in other "
            "processes: use an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "
            "default), or set VLLM_ALLOW_INSECURE_SERIALIZATION=1 before starting it and "
            "pass a picklable function; a Steer needs neither"
        )
    if not edit_at:
        raise VlensError("edit= needs edit_at=[(site, layer), ...]: where to call it")
    pairs = []
    for pair in edit_at:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise VlensError(f"edit_at entries are (site, layer) pairs, got {pair!r}")
        site, layer = pair
        if site not in facts.sites:
            raise facts.no_such_site(site, "edit site")
        if site == "attn_pattern":
            raise VlensError("attn_pattern is computed by vlens, not by the model: an edit "
                             "cannot change it. Edit 'q', 'k' (look only) or 'z' instead")
        check_layers([layer], facts)
        pairs.append((site, int(layer)))
    return pairs


def check_budget(requests: Sequence[tuple[int, Sequence[Read], int, int]],
                 facts: ModelFacts, budget: int) -> None:
    """Refuse a call whose reads would exceed ``budget`` bytes, with the
    estimate and how to shrink it. ``requests``: per request
    ``(prompt length, reads, max_new_tokens, n samples)``."""
    width = {"norm": 1, "vocab_logprobs": facts.vocab_size}
    total = 0
    biggest = ""
    for prompt_len, reads, max_new_tokens, n in requests:
        tokens = prompt_len + max_new_tokens - 1
        rows = tokens * max(1, n)
        for read in reads:
            if read.reduce == "full":
                w = facts.width(read.site)
                if read.site == "attn_pattern":  # [heads, T, T]: every key of every row
                    w = (len(read.heads) or facts.n_heads) * tokens
            elif read.reduce == "sae":  # every feature of an SAE (k: its width)
                w = read.k
            elif read.reduce == "norm" and read.site in ("q", "k", "v", "z"):
                w = facts.n_heads  # one norm per head
            elif read.reduce == "dla":  # z: per head and the bias; resid_post: 4
                w = {"z": facts.n_heads + 1, "resid_post": 4}.get(read.site, 1)
            else:
                w = width.get(read.reduce, 3 * read.k)
            size = rows * len(read.layers) * w * 4
            total += size
            if read.reduce == "full" and size * 2 > total:
                biggest = read.site
    if total > budget:
        raise VlensError(
            f"this call would read about {total / 2**30:.2f} GiB of activations, over the "
            f"session's read budget of {budget / 2**30:.2f} GiB. Reduce it: reduce='norm' "
            "(the worker ships one number per token), fewer layers=, fewer sites=, fewer "
            "or shorter prompts, smaller max_new_tokens=, heads= for attn_pattern (it "
            "grows with the square of the tokens); or raise s.read_budget (bytes)"
            + (f" (most of it is the full {biggest} reads)" if biggest else "")
        )
