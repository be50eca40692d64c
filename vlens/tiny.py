"""Random-weight models made on the spot, for tests and benchmarks.

No model can be downloaded where vlens runs its tests (there is no hub), so
every model besides the bundled toy-world one is built here: a Hugging Face
config with random weights, saved with ``save_pretrained`` beside a small
word-level tokenizer. The weights mean nothing; what matters is that vLLM and
transformers load the same numbers, so their activations can be compared.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["make_tiny_model", "tiny_vocabulary"]

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
    """Write a random-weight causal LM (``arch`` "llama" or "qwen2") to ``path``.

    float32 weights, head dim ``hidden // heads`` (keep it 32, 64, 128…:
    sizes vLLM's CPU attention supports). Returns the folder. Idempotent: a
    folder that already holds a model is left as it is.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    words = tiny_vocabulary(vocab - len(_SPECIAL))
    common = dict(
        vocab_size=len(_SPECIAL) + len(words),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
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
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    else:
        raise ValueError(f"unknown arch {arch!r}: use 'llama' or 'qwen2'")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init with std 0.02 gives near-identical layers; widen the norms'
    # weights a little so every layer's output differs visibly from its input.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, words)
    return path
