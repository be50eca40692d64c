"""Random-weight models made on the spot, for tests and benchmarks.

No model can be downloaded where vlens runs its tests (there is no hub), so
every model besides the bundled toy-world one is built here: a Hugging Face
config with random weights, saved with ``save_pretrained`` beside a small
word-level tokenizer. The weights mean nothing; what matters is that vLLM and
transformers load the same numbers, so their activations can be compared.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from pathlib import Path

__all__ = ["TINY_ARCHS", "make_tiny_model", "tiny_vocabulary"]

#: the families make_tiny_model can write
TINY_ARCHS = (
    "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "mixtral", "gemma", "gemma2",
    "gemma3", "phi3", "olmo2", "gpt2", "gptj", "gpt_neox", "opt",
)

_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def tiny_vocabulary(size: int = 250) -> list[str]:
    """Plain words ``w0 … w{size-1}`` plus ``.`` and ``,``: prompts of any
    length can be written as ``" ".join(words)``."""
    return [f"w{i}" for i in range(size - 2)] + [".", ","]


def _write_tokenizer(path: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(path)


def _configs(common: dict, hidden: int, layers: int, heads: int, kv: int, inter: int,
             max_positions: int) -> dict:
    """arch -> (config class name, keyword arguments). Every config keeps
    head dim ``hidden // heads`` and float32; GPT-style configs spell the
    sizes their own way."""
    head_dim = hidden // heads
    gpt_ids = dict(vocab_size=common["vocab_size"], bos_token_id=1, eos_token_id=2,
                   pad_token_id=3, dtype="float32")
    moe = dict(num_experts_per_tok=2)
    return {
        "llama": ("LlamaConfig", dict(common)),
        "mistral": ("MistralConfig", dict(common, sliding_window=None)),
        "qwen2": ("Qwen2Config", dict(common, use_sliding_window=False)),
        "qwen3": ("Qwen3Config", dict(common, head_dim=head_dim, use_sliding_window=False)),
        "qwen2_moe": ("Qwen2MoeConfig", dict(
            common, num_experts=4, moe_intermediate_size=inter // 2,
            shared_expert_intermediate_size=inter, decoder_sparse_step=1,
            mlp_only_layers=[], use_sliding_window=False, **moe)),
        "mixtral": ("MixtralConfig", dict(common, num_local_experts=4, sliding_window=None, **moe)),
        # vLLM's Gemma models always tie the head to the embedding
        "gemma": ("GemmaConfig", dict(common, head_dim=head_dim, tie_word_embeddings=True)),
        "gemma2": ("Gemma2Config", dict(
            common, head_dim=head_dim, query_pre_attn_scalar=head_dim,
            sliding_window=max_positions, final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0, tie_word_embeddings=True)),
        "gemma3": ("Gemma3TextConfig", dict(
            common, head_dim=head_dim, query_pre_attn_scalar=head_dim,
            sliding_window=max_positions, final_logit_softcapping=30.0,
            tie_word_embeddings=True)),
        "phi3": ("Phi3Config", dict(common)),
        "olmo2": ("Olmo2Config", dict(common)),
        "gpt2": ("GPT2Config", dict(
            gpt_ids, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=inter,
            n_positions=max_positions, tie_word_embeddings=True)),
        "gptj": ("GPTJConfig", dict(
            gpt_ids, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=inter,
            n_positions=max_positions, rotary_dim=head_dim // 2, tie_word_embeddings=False)),
        "gpt_neox": ("GPTNeoXConfig", dict(
            gpt_ids, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=inter, max_position_embeddings=max_positions,
            rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)),
        "opt": ("OPTConfig", dict(
            gpt_ids, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            ffn_dim=inter, word_embed_proj_dim=hidden, max_position_embeddings=max_positions,
            do_layer_norm_before=True, tie_word_embeddings=True)),
    }


@contextmanager
def hf_buildable():
    """Let Hugging Face model classes be built in a process where vLLM's
    Transformers backend has run.

    That backend decorates the Hugging Face class it serves (``LlamaModel``,
    ``GPTNeoXModel`` …) in place for torch.compile: the class gains a base
    and an ``__init__`` that asks for vLLM's current config, so building the
    class afterwards outside an engine fails ("Current vLLM config is not
    set"). Inside this block a config with compilation off is current, so the
    decorated class builds and runs as plain eager PyTorch. Without vLLM
    imported it does nothing.
    """
    if "vllm.config" not in sys.modules:
        yield
        return
    from types import SimpleNamespace

    from transformers import PretrainedConfig
    from vllm.config import CompilationConfig, CompilationMode, set_current_vllm_config

    # the decorated __init__ reads only these two: the compilation mode (off,
    # so the class runs its own forward) and the model's config, which its
    # enable_if inspects for a rope scaling torch.compile cannot take
    stand_in = SimpleNamespace(
        compilation_config=CompilationConfig(mode=CompilationMode.NONE),
        model_config=SimpleNamespace(hf_config=PretrainedConfig()),
    )
    with set_current_vllm_config(stand_in):
        yield


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int = 250,
    max_positions: int = 1024,
    seed: int = 0,
) -> Path:
    """Write a random-weight causal LM of family ``arch`` (one of
    :data:`TINY_ARCHS`: "llama", "gpt2", "gpt_neox", "mixtral" …) to ``path``.

    float32 weights, head dim ``hidden // heads`` (keep it 32, 64, 128…:
    sizes vLLM's CPU attention supports). Returns the folder. Idempotent: a
    folder that already holds a model is left as it is.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    words = tiny_vocabulary(vocab - len(_SPECIAL))
    inter = intermediate or 2 * hidden
    common = dict(
        vocab_size=len(_SPECIAL) + len(words),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        dtype="float32",
    )
    table = _configs(common, hidden, layers, heads, kv_heads or heads, inter, max_positions)
    if arch not in table:
        raise ValueError(f"unknown arch {arch!r}: use one of {', '.join(table)}")
    cls_name, kwargs = table[arch]
    config = getattr(transformers, cls_name)(**kwargs)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with hf_buildable():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init with std 0.02 gives near-identical layers and zero biases;
    # widen the norms' weights and give every bias a value, so each layer's
    # output differs visibly from its input and bias handling is exercised.
    with torch.no_grad():
        norms = [m for m in model.modules() if "norm" in type(m).__name__.lower()]
        for m in norms:
            if isinstance(getattr(m, "weight", None), torch.nn.Parameter):
                m.weight.uniform_(0.5, 1.5)
        for m in norms:
            if isinstance(getattr(m, "bias", None), torch.nn.Parameter):
                m.bias.uniform_(-0.2, 0.2)
        normed = {id(m.bias) for m in norms if getattr(m, "bias", None) is not None}
        for name, p in model.named_parameters():
            if name.endswith(".bias") and id(p) not in normed:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, words)
    return path
