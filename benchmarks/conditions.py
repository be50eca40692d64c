"""What each benchmark condition runs (the letters of the performance issues).

A condition key names a workload and the engine it runs on (see
engines.py): ``c`` is (c) on the eager vlens engine with prefix caching on,
``c_comp`` the same on the compiled vlens engine, ``c_off`` on the eager
engine with prefix caching off.

Main table (eager engine, prefix caching on, as users run vLLM):
    a  plain vLLM: the same engine with vlens's hooks removed in place
    a_star  (a*) plain ``vllm.LLM`` at its defaults: compiled, no vlens
    b  hooks installed, no plan (idle cost)
    c  steer one layer, every request, one shared vector
    d  steer every layer
    e  steer one layer, each request its own vector
    f  read resid_post of one layer, every token, returned to the client
    g  read resid_post of every layer, reduced to norms in the worker
    h  logit lens top-5 at every layer, in the worker
    h_floor  the unembedding products (h) must do, alone (engines.LensFloor)
    i  clone reads on vs off: (f) with clone reads on; and a no-op edit=
       function at one site with clone reads off / on
    j  Hugging Face transformers generate with a steering forward hook
    m  nnsight (transformers backend) steering the same way
Compiled vlens (against (a*)): b_comp c_comp f_comp g_comp h_comp
Prefix caching off (the old setting): a_off c_off f_off
A shared 128-token preamble, where the prefix cache can hit:
    p_a p_c p_f (caching on), p_a_off p_c_off p_f_off (off)
Per-step cost at two batch sizes (4 sites x 2 layers read, norms):
    k32 k256 (eager), k32_comp k256_comp (compiled)
Features (issue 26): each token's top 32 features of a random 4096-wide SAE
(hf_sae.py) at the steering layer:
    sae (eager), sae_comp (compiled, against (a*)), sae_hf (the SAELens way:
    Hugging Face generate with a hook that encodes every row)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from engines import engine_of

LABELS: dict[str, str] = {
    "a": "plain vLLM, eager (vlens hooks removed)",
    "a_star": "plain vLLM at its defaults (compiled), no vlens",
    "b": "vlens hooks installed, no plan",
    "c": "steer 1 layer, every request",
    "d": "steer every layer, every request",
    "e": "steer 1 layer, 32 distinct vectors",
    "f": "read resid_post of 1 layer (full)",
    "g": "read resid_post of every layer, norms",
    "h": "logit lens top-5 at every layer",
    "h_floor": "the lens's unembedding products alone",
    "i_read": "(f) with clone reads on",
    "i_edit_off": "no-op edit= at 1 site, clone reads off",
    "i_edit_on": "no-op edit= at 1 site, clone reads on",
    "j": "HF transformers generate + steering hook",
    "m": "nnsight (transformers backend) steering",
    "b_comp": "compiled vlens, hooks in the graph, no plan",
    "c_comp": "compiled vlens, steer 1 layer",
    "f_comp": "compiled vlens, read 1 layer (full)",
    "g_comp": "compiled vlens, norms of every layer",
    "h_comp": "compiled vlens, logit lens at every layer",
    "a_off": "plain vLLM, eager, prefix caching off",
    "c_off": "steer 1 layer, prefix caching off",
    "f_off": "read 1 layer, prefix caching off",
    "p_a": "shared preamble: plain vLLM (eager, hooks removed)",
    "p_c": "shared preamble: steer 1 layer",
    "p_f": "shared preamble: read 1 layer",
    "p_a_off": "shared preamble: plain vLLM, caching off",
    "p_c_off": "shared preamble: steer 1 layer, caching off",
    "p_f_off": "shared preamble: read 1 layer, caching off",
    "k32": "4 sites x 2 layers, norms, the main batch (eager)",
    "k256": "4 sites x 2 layers, norms, wide batch (eager)",
    "k32_comp": "4 sites x 2 layers, norms, the main batch (compiled)",
    "k256_comp": "4 sites x 2 layers, norms, wide batch (compiled)",
    "sae": "top 32 features of a 4096-wide SAE at 1 layer",
    "sae_comp": "compiled vlens, top 32 features of a 4096-wide SAE",
    "sae_hf": "HF transformers generate + the SAE's encode, top 32",
}

# which engine each condition runs on
ENGINE: dict[str, str] = {
    "a_star": "plain", "h_floor": "none", "j": "none", "m": "none", "sae_hf": "none",
    **{k: "comp" for k in LABELS if k.endswith("_comp")},
    **{k: "off" for k in LABELS if k.endswith("_off") and k not in ("i_edit_off",)},
}
# the conditions that are vLLM with nothing of vlens in it (no worker counters)
PLAIN = ("a", "a_star", "a_off", "p_a", "p_a_off", "h_floor", "j", "m", "sae_hf")
# slow, or second tables: run in the first ``slow_reps`` repetitions only, so
# that the main and compiled tables get the most repetitions in the budget
FEW = ("j", "m", "sae_hf", "k32", "k256", "k32_comp", "k256_comp", "a_off", "c_off", "f_off",
       "p_a", "p_f", "p_c", "p_a_off", "p_c_off", "p_f_off")
K_SITES = ["resid_pre", "resid_post", "attn_out", "mlp_out"]


def _per_prompt(steers: list) -> Any:
    """One entry (a Steer or a list of them) per prompt."""
    import vlens

    return vlens.PerPrompt(steers)


def engine_for(key: str) -> str:
    return ENGINE.get(key, "eager")


def noop_edit(rows: torch.Tensor, ctx: Any) -> None:
    """The edit function of (i): looks, changes nothing."""


@dataclass
class Setup:
    """What every condition of one model shares."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    tokens: int  # new tokens per prompt
    layer: int  # the one layer of (c), (e), (f), (i), (j), (m)
    scale: float
    vectors: torch.Tensor  # [n_prompts, hidden]; row 0 is the shared vector
    # the shared-preamble prompts of (p) and their token ids
    long_prompts: list[str] | None = None
    long_ids: list[list[int]] | None = None
    long_tokens: int = 16
    # the wide batch of (k256) (prompts cycled) and the new tokens of (k)
    wide: int = 256
    k_tokens: int = 32
    # the SAE of (sae) (hf_sae.make_sae), None: no SAE conditions
    sae_path: Any = None


class Conditions:
    """The runnable conditions of one model. ``sessions`` maps an engine
    role (engines.py) to a live vlens Session; ``plain`` is (a*) or None.
    Each ``run_<base key>`` returns ``(tokens generated, extra figures)``."""

    def __init__(self, sessions: dict[str, Any], setup: Setup, *, plain: Any = None,
                 floor: Any = None, hf: Any = None, nns: Any = None, hf_sae: Any = None) -> None:
        import vlens
        from vllm import SamplingParams

        self.sessions = sessions
        self.s = sessions["eager"]
        self.setup, self.plain, self.floor, self.hf, self.nns = setup, plain, floor, hf, nns
        self.hf_sae = hf_sae
        self.sae = vlens.SAE.load(setup.sae_path) if setup.sae_path else None
        n_layers = self.s.n_layers
        L, sc, vecs = setup.layer, setup.scale, setup.vectors
        self.shared = vlens.Steer(vecs[0], layer=L, scale=sc)
        self.every_layer = [vlens.Steer(vecs[0], layer=i, scale=sc) for i in range(n_layers)]
        self.distinct = [vlens.Steer(v, layer=L, scale=sc) for v in vecs]
        self.params = SamplingParams(temperature=0.0, max_tokens=setup.tokens, ignore_eos=True)
        self.engine_prompts = [{"prompt_token_ids": ids} for ids in setup.prompt_ids]
        self.k_layers = sorted({n_layers // 4, (3 * n_layers) // 4})
        # hooked (site, layer) pairs each condition touches per step
        base = {"c": 1, "d": n_layers, "e": 1, "f": 1, "g": n_layers, "h": n_layers,
                "i_read": 1, "i_edit_off": 1, "i_edit_on": 1, "p_c": 1, "p_f": 1, "sae": 1,
                "k32": len(K_SITES) * len(self.k_layers)}
        base["k256"] = base["k32"]
        self.sites_touched = {k: base.get(self.base(k), 0) for k in LABELS}

    @staticmethod
    def base(key: str) -> str:
        """The workload of a key without its engine suffix (c_comp -> c)."""
        for suffix in ("_comp", "_off"):
            if key.endswith(suffix) and key != "i_edit_off":
                return key[: -len(suffix)]
        return key

    def expected_tokens(self, key: str) -> int:
        """The tokens a full run of ``key`` generates."""
        st, base = self.setup, self.base(key)
        n = len(st.prompts)
        if key == "h_floor":
            return 0
        if base.startswith("p_"):
            return len(st.long_ids or []) * st.long_tokens
        if base in ("k32", "k256"):
            return (n if base == "k32" else st.wide) * st.k_tokens
        return n * st.tokens

    def session(self, key: str) -> Any:
        return self.sessions.get(engine_for(key))

    def available(self) -> list[str]:
        out = []
        for key in LABELS:
            role = engine_for(key)
            if role in ("eager", "comp", "off") and role not in self.sessions:
                continue
            if key.startswith("p_") and self.setup.long_ids is None:
                continue
            if (key == "a_star" and self.plain is None) or (key == "h_floor" and self.floor is None):
                continue
            if (key == "j" and self.hf is None) or (key == "m" and self.nns is None):
                continue
            if key.startswith("sae") and (self.sae is None or (key == "sae_hf" and self.hf_sae is None)):
                continue
            out.append(key)
        return out

    def run(self, key: str, **kw) -> tuple[int, dict]:
        s = self.session(key)
        fn = getattr(self, f"run_{self.base(key)}")
        return fn(s, **kw) if s is not None else fn(**kw)

    # -- engines without vlens ---------------------------------------------
    def _plain(self, s, prompts=None, params=None, engine=None) -> tuple[int, dict]:
        engine = engine or engine_of(s)
        outs = engine.generate(prompts or self.engine_prompts, params or self.params)
        return sum(len(o.outputs[0].token_ids) for o in outs), {
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]
        }

    def run_a(self, s, **kw):
        return self._plain(s, **kw)

    def run_b(self, s, **kw):
        return self._plain(s, **kw)

    def run_a_star(self, **kw):
        return self._plain(None, engine=self.plain, **kw)

    def run_h_floor(self, **kw):
        return self.floor.run()

    def run_p_a(self, s, prompts=None, params=None, **kw):
        from vllm import SamplingParams

        if params is None:
            params = SamplingParams(temperature=0.0, max_tokens=self.setup.long_tokens,
                                    ignore_eos=True)
        prompts = prompts or [{"prompt_token_ids": ids} for ids in self.setup.long_ids]
        return self._plain(s, prompts=prompts, params=params)

    # -- vlens ----------------------------------------------------------------
    def _trace(self, s, prompts=None, tokens=None, **kw) -> tuple[int, dict]:
        run = s.trace(prompts or self.setup.prompts, max_new_tokens=tokens or self.setup.tokens,
                      logprobs=False, ignore_eos=True, **kw)
        extra = {
            "copied_bytes": run.copied_bytes,
            "steered_rows": sum(t.steered_rows for t in run),
            "rows": sum(t.n_tokens for t in run),
            "token_ids": [list(t.output_token_ids) for t in run],
        }
        cached = [getattr(t, "cached_tokens", None) for t in run]
        if all(c is not None for c in cached):
            extra["cached_tokens"] = int(sum(cached))
        return sum(len(t.output_token_ids) for t in run), extra

    def run_c(self, s, **kw):
        return self._trace(s, sites=[], steer=self.shared, **kw)

    def run_d(self, s, prompts=None, **kw):
        every = _per_prompt([self.every_layer] * len(prompts or self.setup.prompts))
        return self._trace(s, prompts=prompts, sites=[], steer=every, **kw)

    def run_e(self, s, prompts=None, **kw):
        steer = _per_prompt(self.distinct[: len(prompts or self.setup.prompts)])
        return self._trace(s, prompts=prompts, sites=[], steer=steer, **kw)

    def run_f(self, s, **kw):
        return self._trace(s, layers=[self.setup.layer], sites=["resid_post"], **kw)

    def run_g(self, s, **kw):
        return self._trace(s, layers=None, sites=["resid_post"], reduce="norm", **kw)

    def run_h(self, s, **kw):
        return self._trace(s, layers=None, sites=[], logit_lens=5, **kw)

    def run_sae(self, s, **kw):
        return self._trace(s, sites=[], saes=[self.sae], features_top_k=32, **kw)

    def run_p_c(self, s, prompts=None, tokens=None, **kw):
        return self.run_c(s, prompts=prompts or self.setup.long_prompts,
                          tokens=tokens or self.setup.long_tokens, **kw)

    def run_p_f(self, s, prompts=None, tokens=None, **kw):
        return self.run_f(s, prompts=prompts or self.setup.long_prompts,
                          tokens=tokens or self.setup.long_tokens, **kw)

    def _k(self, s, n, prompts=None, tokens=None, **kw):
        ps = self.setup.prompts
        prompts = prompts or [ps[i % len(ps)] for i in range(n)]
        return self._trace(s, prompts=prompts, tokens=tokens or self.setup.k_tokens,
                           layers=self.k_layers, sites=K_SITES, reduce="norm", **kw)

    def run_k32(self, s, **kw):
        return self._k(s, len(self.setup.prompts), **kw)

    def run_k256(self, s, **kw):
        return self._k(s, self.setup.wide, **kw)

    def _with_clone(self, s, on: bool, fn: Callable, **kw):
        before = s.clone_reads
        s.clone_reads = on
        try:
            return fn(s, **kw)
        finally:
            s.clone_reads = before

    def run_i_read(self, s, **kw):
        return self._with_clone(s, True, self.run_f, **kw)

    def _edit(self, s, **kw):
        tokens, extra = self._trace(s, sites=[], edit=noop_edit,
                                    edit_at=[("resid_post", self.setup.layer)], **kw)
        # what clone reads copy for the edit function: each call's rows once,
        # [rows, hidden] in the engine's dtype (not counted in copied_bytes)
        extra["clone_bytes"] = extra["rows"] * s.hidden_size * self._elem_size(s)
        return tokens, extra

    def _elem_size(self, s) -> int:
        dtype = str(engine_of(s).llm.llm_engine.model_config.dtype).removeprefix("torch.")
        return torch.empty(0, dtype=getattr(torch, dtype)).element_size()

    def run_i_edit_off(self, s, **kw):
        return self._with_clone(s, False, self._edit, **kw)

    def run_i_edit_on(self, s, **kw):
        return self._with_clone(s, True, self._edit, **kw)

    # -- other tools ----------------------------------------------------------
    def run_j(self, **kw):
        return self.hf.run(**kw)

    def run_m(self, **kw):
        return self.nns.run(**kw)

    def run_sae_hf(self, **kw):
        return self.hf_sae.run(**kw)
