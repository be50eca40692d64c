"""The names of vlens's sites and what each is, in words: plain data that
both processes and the architecture table use (``sites.py`` resolves them
to modules; this module imports nothing, so anything may import it)."""

from __future__ import annotations

#: site name -> what it is, in words (shown in errors, widgets and docs)
SITES: dict[str, str] = {
    "resid_pre": "residual stream entering the layer (HF hidden_states[layer])",
    "resid_mid": "residual stream between attention and MLP: resid_pre + the attention "
    "block's contribution (the input of HF's pre-MLP norm); absent where attention and "
    "MLP run in parallel",
    "resid_post": "residual stream leaving the layer (HF hidden_states[layer + 1], "
    "before the final norm)",
    "attn_out": "the attention module's output (after its output projection), before "
    "any post-attention norm and before it joins the residual",
    "mlp_out": "the MLP module's output (for MoE models the whole sparse block: shared "
    "and routed experts), before any post-MLP norm and before it joins the residual",
    "positions": "the token positions the model is given (read-only; an engine buffer "
    "that is rewritten every step, used to show what clone reads protect)",
    "q": "each head's query after rotary embedding, as the attention kernel receives it "
    "([T, heads, head_dim] per layer; read-only)",
    "k": "each key head's key after rotary embedding ([T, kv_heads, head_dim]; read-only)",
    "v": "each key head's value ([T, kv_heads, head_dim]; read-only)",
    "z": "each head's output before the output projection (the o_proj input, "
    "[T, heads, head_dim]); writable, flat as heads * head_dim",
    "attn_pattern": "each head's attention probabilities over the request's tokens, "
    "recomputed from q and k ([heads, T, T] per layer; read-only)",
}

#: residual-width sites that can be written (steered / edited)
WRITABLE = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")

#: sites of the attention computation, one value per head (on vLLM's attention
#: layer natively, on a HeadTap beside it on the Transformers backend)
HEAD_SITES = ("q", "k", "v", "z", "attn_pattern")

#: head sites that can be written: the vector is flat, heads * head_dim wide
HEAD_WRITABLE = ("z",)
