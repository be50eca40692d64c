"""The model families vlens knows, as data: one row per architecture.

A row says where a model's parts live (the decoder layers, each layer's
attention and MLP modules, the module whose *input* is the residual stream
between them, the final norm) for Hugging Face's implementation and, where
vLLM has one, for vLLM's own. Site resolution (:mod:`vlens.protocol.sites`) reads
these rows; it has no per-architecture branches. Adding an architecture
means adding a row here and its entry in ``tests/test_models.py``.

This module is plain data (no torch, no vLLM), so the client can check a
model's ``config.json`` before any engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlens.errors import VlensError
from vlens.protocol.site_names import SITES

__all__ = [
    "Architecture",
    "Layout",
    "ARCHITECTURES",
    "supported_architectures",
    "find_architecture",
    "check_model_config",
]


@dataclass(frozen=True)
class Layout:
    """Where the parts of one layer stack live, as dotted attribute paths.

    ``layers`` and ``norm`` start at the causal-LM module (the one vLLM or
    ``AutoModelForCausalLM`` returns); ``attn``, ``mlp`` and ``mid`` start at
    one layer. ``mid`` is the module whose first input is ``resid_mid``
    (None where there is no such value). ``block`` says how a vLLM-native
    layer carries the residual stream:

    * ``"pair"``: ``layer(positions, hidden, residual) -> (hidden, residual)``,
      the stream is their sum (Llama and its relatives);
    * ``"stream"``: the layer takes and returns the whole stream (GPT-2,
      GPT-J, OPT); ``hidden_arg`` is where ``hidden_states`` sits in its
      arguments and ``positions_arg`` where the positions do (None: the
      layer is not given them, read the model's own argument);
    * ``"hf"``: a Hugging Face layer (also what vLLM's Transformers backend
      runs), ``[1, T, H]`` in and out.
    """

    layers: str
    attn: str
    mlp: str
    mid: str | None
    norm: str | None
    block: str = "hf"
    hidden_arg: int = 0
    positions_arg: int | None = 0
    project: str | None = None  # applied after the final norm (OPT's project_out)
    #: inside the attention module: the output projection (its input is ``z``)
    out_proj: str = "o_proj"
    #: inside a layer: norms applied to the attention and MLP outputs before
    #: they join the residual stream (Gemma2/3, OLMo2); None where there are none
    attn_post: str | None = None
    mlp_post: str | None = None


@dataclass(frozen=True)
class Architecture:
    """One supported architecture (``config.json``'s ``architectures[0]``).

    ``hf`` is Hugging Face's layout, the reference every site is checked
    against; ``native`` is vLLM's own implementation (None where vLLM runs
    the family through its Transformers backend). ``transformers``: vlens
    supports ``model_impl="transformers"`` for it. ``no_mid`` gives the
    reason ``resid_mid`` is absent when ``hf.mid`` is None;
    ``no_mid_if = (config attribute, its default, value, reason)`` removes it
    for configs where the attribute has that value."""

    name: str
    family: str
    tiny: str  # the make_tiny_model family the tests build
    hf: Layout
    native: Layout | None
    transformers: bool = False
    no_mid: str | None = None
    no_mid_if: tuple[str, Any, Any, str] | None = None

    @property
    def routes(self) -> tuple[str, ...]:
        """The backends vlens supports, vLLM's default first."""
        out = ("native",) if self.native is not None else ()
        return out + (("transformers",) if self.transformers else ())

    def layout(self, impl: str) -> Layout:
        """The layout inside a vLLM model of backend ``impl``."""
        if impl == "native" and self.native is not None:
            return self.native
        # vLLM's Transformers backend keeps the Hugging Face base model at
        # ``.model``: re-root the HF paths there
        hf = self.hf

        def reroot(path: str | None) -> str | None:
            return None if path is None else "model." + path.split(".", 1)[1]

        return Layout(reroot(hf.layers), hf.attn, hf.mlp, hf.mid, reroot(hf.norm),
                      "hf", project=reroot(hf.project), out_proj=hf.out_proj,
                      attn_post=hf.attn_post, mlp_post=hf.mlp_post)

    def absent_sites(self, config: Any) -> dict[str, str]:
        """Sites this architecture does not have, with the reason, for a
        config (a Hugging Face config object or a config.json dict)."""
        if self.hf.mid is None:
            return {"resid_mid": self.no_mid or f"{self.family} has no such value"}
        if self.no_mid_if is not None:
            attr, default, value, why = self.no_mid_if
            got = config.get(attr, default) if isinstance(config, dict) else getattr(
                config, attr, default)
            if got == value:
                return {"resid_mid": why}
        return {}


_PARALLEL = (
    "{} runs attention and MLP in parallel on the same input "
    "(resid_post = resid_pre + attn_out + mlp_out): no residual stream exists "
    "between them. Read resid_pre, attn_out and mlp_out instead."
)


def _llama_like(name: str, family: str, tiny: str, *, mlp: str = "mlp",
                mid: str = "post_attention_layernorm",
                transformers: bool = False, post_norms: bool = False) -> Architecture:
    post = ("post_attention_layernorm", "post_feedforward_layernorm") if post_norms else (
        None, None)
    return Architecture(
        name, family, tiny,
        hf=Layout("model.layers", "self_attn", "mlp", mid, "model.norm",
                  attn_post=post[0], mlp_post=post[1]),
        native=Layout("model.layers", "self_attn", mlp, mid, "model.norm", "pair",
                      attn_post=post[0], mlp_post=post[1]),
        transformers=transformers,
    )


#: every architecture vlens supports, by Hugging Face architecture name
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    _llama_like("LlamaForCausalLM", "Llama", "llama", transformers=True),
    _llama_like("MistralForCausalLM", "Mistral", "mistral"),
    _llama_like("MixtralForCausalLM", "Mixtral (MoE)", "mixtral", mlp="block_sparse_moe"),
    _llama_like("Qwen2ForCausalLM", "Qwen2", "qwen2"),
    _llama_like("Qwen2MoeForCausalLM", "Qwen2-MoE", "qwen2_moe"),
    _llama_like("Qwen3ForCausalLM", "Qwen3", "qwen3"),
    _llama_like("GemmaForCausalLM", "Gemma", "gemma"),
    _llama_like("Gemma2ForCausalLM", "Gemma2", "gemma2", mid="pre_feedforward_layernorm",
               post_norms=True),
    _llama_like("Gemma3ForCausalLM", "Gemma3", "gemma3", mid="pre_feedforward_layernorm",
                post_norms=True),
    _llama_like("Phi3ForCausalLM", "Phi3", "phi3"),
    Architecture(
        # vLLM runs OLMo2 through its Transformers backend; its MLP takes
        # the residual stream un-normed (the norms come after each block)
        "Olmo2ForCausalLM", "OLMo2", "olmo2",
        hf=Layout("model.layers", "self_attn", "mlp", "mlp", "model.norm",
                  attn_post="post_attention_layernorm", mlp_post="post_feedforward_layernorm"),
        native=None, transformers=True,
    ),
    Architecture(
        "GPT2LMHeadModel", "GPT-2", "gpt2",
        hf=Layout("transformer.h", "attn", "mlp", "ln_2", "transformer.ln_f",
                  out_proj="c_proj"),
        native=Layout("transformer.h", "attn", "mlp", "ln_2", "transformer.ln_f", "stream",
                      hidden_arg=0, positions_arg=None, out_proj="c_proj"),
    ),
    Architecture(
        "GPTJForCausalLM", "GPT-J", "gptj",
        hf=Layout("transformer.h", "attn", "mlp", None, "transformer.ln_f",
                  out_proj="out_proj"),
        native=Layout("transformer.h", "attn", "mlp", None, "transformer.ln_f", "stream",
                      hidden_arg=1, positions_arg=0, out_proj="out_proj"),
        no_mid=_PARALLEL.format("GPT-J"),
    ),
    Architecture(
        # vLLM runs GPT-NeoX through its Transformers backend
        "GPTNeoXForCausalLM", "GPT-NeoX (Pythia)", "gpt_neox",
        hf=Layout("gpt_neox.layers", "attention", "mlp", "post_attention_layernorm",
                  "gpt_neox.final_layer_norm", out_proj="dense"),
        native=None, transformers=True,
        no_mid_if=("use_parallel_residual", True, True,
                   _PARALLEL.format("This GPT-NeoX (use_parallel_residual=True, as in Pythia)")),
    ),
    Architecture(
        "OPTForCausalLM", "OPT", "opt",
        hf=Layout("model.decoder.layers", "self_attn", "fc2", "final_layer_norm",
                  "model.decoder.final_layer_norm", project="model.decoder.project_out",
                  out_proj="out_proj"),
        native=Layout("model.decoder.layers", "self_attn", "fc2", "final_layer_norm",
                      "model.decoder.final_layer_norm", "stream", hidden_arg=0,
                      positions_arg=None, project="model.decoder.project_out",
                      out_proj="out_proj"),
        no_mid_if=("do_layer_norm_before", True, False,
                   "this OPT normalises after each block (do_layer_norm_before=False): "
                   "the stream between attention and MLP passes through a norm, so no "
                   "un-normed residual exists there"),
    ),
)}


def supported_architectures(sites: bool = False) -> dict[str, Any]:
    """The architectures vlens opens: ``{Hugging Face architecture name:
    family}``, as in a model's ``config.json``. The measured errors of each
    are in docs/models.md.

    ``sites=True``: ``{name: {"family": family, "routes": {route: [site
    names]}}}`` instead, the sites each route vLLM can take offers (route
    ``"native"``: vLLM's own implementation; ``"transformers"``: its
    Transformers backend, the only route for GPT-NeoX and OLMo2, or
    ``model_impl="transformers"``), for the family's default config (a
    config can remove a site: a GPT-NeoX without parallel residual has
    ``resid_mid``). The head sites (q, k, v, z, attn_pattern) are offered on
    every route."""
    if not isinstance(sites, bool):
        raise VlensError(f"sites must be True or False, got {sites!r}")
    if not sites:
        return {name: a.family for name, a in ARCHITECTURES.items()}
    out: dict[str, Any] = {}
    for name, a in ARCHITECTURES.items():
        absent = a.absent_sites({})
        offered = [s for s in SITES if s not in absent]
        out[name] = {"family": a.family, "routes": {r: list(offered) for r in a.routes}}
    return out


def find_architecture(names: list[str] | tuple[str, ...] | None) -> Architecture | None:
    for name in names or ():
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    return None


def _unknown(names: list[str]) -> VlensError:
    known = ", ".join(f"{n} ({a.family})" for n, a in ARCHITECTURES.items())
    return VlensError(
        f"vlens does not support the architecture {', '.join(names) or '(none given)'}: "
        f"it knows {known}. vLLM itself can still run this model (vllm.LLM), without "
        "vlens's sites. To add it, give it a row in vlens/protocol/architectures.py (where its "
        "layers, attention, MLP and final norm live) and a test in tests/test_models.py; "
        "see docs/models.md."
    )


def check_model_config(config: dict[str, Any], model_impl: str | None = None) -> Architecture:
    """The row for a model's config.json (as a dict), or a VlensError saying
    what is unsupported and what to do. ``model_impl`` is what the user
    passed to vLLM (None, "auto", "vllm" or "transformers")."""
    names = list(config.get("architectures") or [])
    arch = find_architecture(names)
    if arch is None:
        raise _unknown(names)
    impl = model_impl or "auto"
    if impl == "transformers" and not arch.transformers:
        raise VlensError(
            f"{arch.family} through vLLM's Transformers backend (model_impl="
            "'transformers') is not supported by vlens"
            + (" (vLLM cannot load its weights that way)" if arch.name == "GPT2LMHeadModel" else "")
            + f": leave model_impl out; vLLM runs {arch.family} natively and vlens supports that."
        )
    if impl == "vllm" and arch.native is None:
        raise VlensError(
            f"vLLM has no native implementation of {arch.family}: leave model_impl out "
            "(vLLM runs it through its Transformers backend, which vlens supports)"
        )
    if impl not in ("auto", "vllm", "transformers"):
        raise VlensError(
            f"model_impl={model_impl!r} is not one vlens supports: leave it out, or use "
            "'vllm' or 'transformers'"
        )
    return arch
