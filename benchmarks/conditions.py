"""The registry of benchmark conditions: each has a readable name, the tag
docs/performance.md shows it under, the engine it runs on, what it needs set
up, and its measure (``measure(bench, session) -> (tokens, extra)``).

Engines (benchmarks/tools.py): ``plain`` a ``vllm.LLM`` at its defaults,
``eager`` a vlens Session with prefix caching on (``plain_vllm`` is it with
vlens's hooks removed in place), ``compiled`` the same compiled, ``cache_off``
eager with prefix caching off; ``none``: no vLLM engine (HF, nnsight, the
lens's arithmetic floor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

K_SITES = ["resid_pre", "resid_post", "attn_out", "mlp_out"]


@dataclass(frozen=True)
class Condition:
    name: str
    tag: str  # as the report's tables show it: c, c*, "c, off", "p: c", "k, wide"
    label: str
    engine: str  # plain | eager | compiled | cache_off | none
    measure: Callable[[Any, Any], tuple[int, dict]]
    needs: str = ""  # its setup beyond the engine: hf | nnsight | sae | sae_hf | floor | preamble
    plain: bool = False  # nothing of vlens runs (no worker counters)
    few: bool = False  # slow or second-table: only the first ``slow_reps`` repetitions
    refs: tuple[str, ...] = ()  # paired ratios beyond plain_vllm and plain_vllm_compiled
    goal: tuple[str, float] | None = None  # (reference, the largest time ratio aimed at)
    sites: Callable[[int], int] = lambda n_layers: 0  # hooked sites per step (of n layers)


# -- the measures (``b`` is benchmarks.runner.Bench: the live engines and inputs) --
def noop_edit(rows, ctx) -> None:
    """The edit function of the clone-read conditions: looks, changes nothing."""


def edit(b, s):
    tokens, extra = b.trace(s, sites=[], edit=noop_edit, edit_at=[("resid_post", b.layer)])
    extra["clone_bytes"] = extra["rows"] * s.hidden_size * b.elem_size(s)  # each call's rows once
    return tokens, extra


def clone(on: bool, fn):
    def measure(b, s):
        before, s.clone_reads = s.clone_reads, on
        try:
            return fn(b, s)
        finally:
            s.clone_reads = before
    return measure


def step_cost(b, s, wide: bool):
    ps, n = b.prompts, b.args.wide if wide else b.n_prompts
    return b.trace(s, prompts=[ps[i % len(ps)] for i in range(n)], tokens=b.args.k_tokens,
                   layers=b.k_layers, sites=K_SITES, reduce="norm")


M = {  # workload -> measure
    "plain": lambda b, s: b.generate(s), "plain_long": lambda b, s: b.generate(s, long=True),
    "steer": lambda b, s, long=False: b.trace(s, long, sites=[], steer=b.shared),
    "read": lambda b, s, long=False: b.trace(s, long, layers=[b.layer], sites=["resid_post"]),
    "norms": lambda b, s: b.trace(s, layers=None, sites=["resid_post"], reduce="norm"),
    "lens": lambda b, s: b.trace(s, layers=None, sites=[], logit_lens=5),
    "steer_all": lambda b, s: b.trace(s, sites=[], steer=b.per_prompt([b.every_layer] * b.n_prompts)),
    "steer_distinct": lambda b, s: b.trace(s, sites=[], steer=b.per_prompt(b.distinct[: b.n_prompts])),
    "sae": lambda b, s: b.trace(s, sites=[], saes=[b.sae], features_top_k=32),
    "k32": lambda b, s: step_cost(b, s, False), "kwide": lambda b, s: step_cost(b, s, True),
    **{t: lambda b, s, t=t: getattr(b, t).run(warmup=b.small) for t in ("floor", "hf", "nns", "hf_sae")}}
M.update(steer_long=lambda b, s: M["steer"](b, s, True), read_long=lambda b, s: M["read"](b, s, True),
         read_clone=clone(True, M["read"]), edit=clone(False, edit), edit_clone=clone(True, edit))
SITES = {"1": lambda n: 1, "L": lambda n: n,
         "k": lambda n: len(K_SITES) * len({n // 4, (3 * n) // 4}), "": lambda n: 0}
A, A_STAR, PRE, PRE_OFF = "plain_vllm", "plain_vllm_compiled", "preamble_plain", "preamble_plain_cache_off"
# name, tag, engine, workload, hooked sites per step ("1", "L" every layer, "k"), options; label
ROWS = [
    ("plain_vllm", "a", "eager", "plain", "", {"plain": 1}, "plain vLLM, eager (vlens hooks removed)"),
    (A_STAR, "a*", "plain", "plain", "", {"plain": 1}, "plain vLLM at its defaults (compiled), no vlens"),
    ("hooks_idle", "b", "eager", "plain", "", {"goal": (A, 1.02)}, "vlens hooks installed, no plan"),
    ("steer_one_layer", "c", "eager", "steer", "1", {"goal": (A, 1.03)}, "steer 1 layer, every request"),
    ("steer_every_layer", "d", "eager", "steer_all", "L", {"goal": (A, 1.10)},
     "steer every layer, every request"),
    ("steer_distinct_vectors", "e", "eager", "steer_distinct", "1",
     {"refs": ("steer_one_layer",), "goal": ("steer_one_layer", 1.05)}, "steer 1 layer, 32 distinct vectors"),
    ("read_one_layer", "f", "eager", "read", "1", {"goal": (A, 1.10)}, "read resid_post of 1 layer (full)"),
    ("norms_every_layer", "g", "eager", "norms", "L", {"goal": (A, 1.05)},
     "read resid_post of every layer, norms"),
    ("logit_lens_every_layer", "h", "eager", "lens", "L", {"goal": (A, 1.10)},
     "logit lens top-5 at every layer"),
    ("logit_lens_floor", "h, floor", "none", "floor", "", {"needs": "floor", "plain": 1},
     "the lens's unembedding products alone"),
    ("read_one_layer_clone", "i", "eager", "read_clone", "1", {"refs": ("read_one_layer",)},
     "(f) with clone reads on"),
    ("noop_edit", "i", "eager", "edit", "1", {}, "no-op edit= at 1 site, clone reads off"),
    ("noop_edit_clone", "i", "eager", "edit_clone", "1", {"refs": ("noop_edit",)},
     "no-op edit= at 1 site, clone reads on"),
    ("hf_steer", "j", "none", "hf", "", {"needs": "hf", "plain": 1, "few": 1, "refs": ("steer_one_layer",)},
     "HF transformers generate + steering hook"),
    ("nnsight_steer", "m", "none", "nns", "", {"needs": "nnsight", "plain": 1, "few": 1,
                                               "refs": ("steer_one_layer", "hf_steer")},
     "nnsight (transformers backend) steering"),
    ("hooks_idle_compiled", "b*", "compiled", "plain", "", {}, "compiled vlens, hooks in the graph, no plan"),
    ("steer_one_layer_compiled", "c*", "compiled", "steer", "1", {"goal": (A_STAR, 1.03)},
     "compiled vlens, steer 1 layer"),
    ("read_one_layer_compiled", "f*", "compiled", "read", "1", {"goal": (A_STAR, 1.05)},
     "compiled vlens, read 1 layer (full)"),
    ("norms_every_layer_compiled", "g*", "compiled", "norms", "L", {"goal": (A_STAR, 1.10)},
     "compiled vlens, norms of every layer"),
    ("logit_lens_every_layer_compiled", "h*", "compiled", "lens", "L", {"goal": ("floor_compiled", 1.10)},
     "compiled vlens, logit lens at every layer"),
    ("plain_vllm_cache_off", "a, off", "cache_off", "plain", "", {"plain": 1, "few": 1},
     "plain vLLM, eager, prefix caching off"),
    ("steer_one_layer_cache_off", "c, off", "cache_off", "steer", "1",
     {"few": 1, "refs": ("plain_vllm_cache_off",)}, "steer 1 layer, prefix caching off"),
    ("read_one_layer_cache_off", "f, off", "cache_off", "read", "1",
     {"few": 1, "refs": ("plain_vllm_cache_off",)}, "read 1 layer, prefix caching off"),
    (PRE, "p: a", "eager", "plain_long", "", {"plain": 1},
     "shared preamble: plain vLLM (eager, hooks removed)"),
    ("preamble_steer", "p: c", "eager", "steer_long", "1", {"refs": (PRE,)},
     "shared preamble: steer 1 layer"),
    ("preamble_read", "p: f", "eager", "read_long", "1", {"refs": (PRE,)}, "shared preamble: read 1 layer"),
    (PRE_OFF, "p: a, off", "cache_off", "plain_long", "", {"plain": 1, "refs": (PRE,)},
     "shared preamble: plain vLLM, caching off"),
    ("preamble_steer_cache_off", "p: c, off", "cache_off", "steer_long", "1",
     {"refs": (PRE_OFF, PRE, "preamble_steer")}, "shared preamble: steer 1 layer, caching off"),
    ("preamble_read_cache_off", "p: f, off", "cache_off", "read_long", "1",
     {"refs": (PRE_OFF, PRE, "preamble_read")}, "shared preamble: read 1 layer, caching off"),
    ("step_cost_32", "k, 32", "eager", "k32", "k", {"few": 1},
     "4 sites x 2 layers, norms, the main batch (eager)"),
    ("step_cost_wide", "k, wide", "eager", "kwide", "k", {"few": 1},
     "4 sites x 2 layers, norms, wide batch (eager)"),
    ("step_cost_32_compiled", "k, 32, compiled", "compiled", "k32", "k", {"few": 1},
     "4 sites x 2 layers, norms, the main batch (compiled)"),
    ("step_cost_wide_compiled", "k, wide, compiled", "compiled", "kwide", "k", {"few": 1},
     "4 sites x 2 layers, norms, wide batch (compiled)"),
    ("sae_features", "sae", "eager", "sae", "1", {"needs": "sae"},
     "top 32 features of a 4096-wide SAE at 1 layer"),
    ("sae_features_compiled", "sae*", "compiled", "sae", "1", {"needs": "sae", "goal": (A_STAR, 1.10)},
     "compiled vlens, top 32 features of a 4096-wide SAE"),
    ("sae_hf", "sae_hf", "none", "hf_sae", "", {"needs": "sae_hf", "plain": 1, "few": 1, "refs": (
        "sae_features", "sae_features_compiled", "hf_steer")},
     "HF transformers generate + the SAE's encode, top 32"),
]
REGISTRY: dict[str, Condition] = {
    name: Condition(name, tag, label, engine, M[work], sites=SITES[sites],
                    needs=opt.get("needs", "preamble" if work.endswith("_long") else ""),
                    plain=bool(opt.get("plain")), few=bool(opt.get("few") or work.endswith("_long")),
                    refs=opt.get("refs", ()), goal=opt.get("goal"))
    for name, tag, engine, work, sites, opt, label in ROWS}
NAMES = list(REGISTRY)
COMPILED = [n for n, c in REGISTRY.items() if c.engine in ("plain", "compiled")]
CACHE_OFF = [n for n, c in REGISTRY.items() if c.engine == "cache_off"]
PREAMBLE = [n for n, c in REGISTRY.items() if c.needs == "preamble"]
# per step at the wide batch, compiled: layout and per-site µs, and their growth from 32
STEP_GOALS = {"layout_us": 150.0, "site_us": 40.0, "growth": 1.5}


def with_references(names: list[str]) -> list[str]:
    """``names`` plus the conditions their ratios are paired with, in registry order."""
    want = set(names) | {"plain_vllm"}
    if want & set(COMPILED):
        want.add("plain_vllm_compiled")
    if want & {"logit_lens_every_layer", "logit_lens_every_layer_compiled"}:
        want.add("logit_lens_floor")
    if want & set(CACHE_OFF):
        want.add("plain_vllm_cache_off")
    if want & set(PREAMBLE):
        want.add("preamble_plain")
        if want & set(CACHE_OFF):
            want.add("preamble_plain_cache_off")
    for pair in (("step_cost_32", "step_cost_wide"),
                 ("step_cost_32_compiled", "step_cost_wide_compiled")):
        if want & set(pair):
            want |= set(pair)
    if "sae_hf" in want:
        want.add("sae_features")
    return [n for n in NAMES if n in want]
