"""A GGUF Llama → a Hugging Face folder (config, safetensors, tokenizer with
its chat template), for :mod:`vlens.models.registry`.

Run as a child process, ``python -m vlens.models.convert GGUF OUT --dtype
float32``, so the GGUF reader and the model never load in a notebook's
kernel (which may start vLLM afterwards). Transformers dequantises the GGUF
(``load_gguf_checkpoint``: its own tensor names, Llama's q/k permutation
undone); a plain ``LlamaForCausalLM`` built from the config (no
``quantization_config``: transformers will not save a GGUF-loaded model)
takes the tensors, ties its embeddings and is saved. Needs ``gguf``.

Transformers opens the GGUF three times (its metadata, its tensors, its
tokenizer), each time with a new ``gguf.GGUFReader`` that parses the whole
header again, and rebuilds gguf's tensor-name table for every submodule it
maps (about 400 times for a 30-layer Llama). In this process both are made
once (:func:`_parse_once`): SmolLM2's conversion went from 64 s to about
half that on 2 cores.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["convert", "main"]

#: the GGUF config keys a saved config.json does not keep
_DROPPED = ("model_type", "_model_name_or_path")


@contextmanager
def _parse_once() -> Iterator[None]:
    """While it is open, ``gguf.GGUFReader(path)`` gives one reader per file
    (read-only: transformers only reads its fields and tensors) and
    ``gguf.get_tensor_name_map`` one table per (architecture, layers).
    Transformers imports both from ``gguf`` when it calls them, so the
    stand-ins are what it gets; both are put back on the way out."""
    import gguf

    plain_reader, plain_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, object] = {}  # resolved path -> its read-only reader

    def reader(path, mode="r"):
        if mode != "r":  # a writable map is not shared
            return plain_reader(path, mode)
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = plain_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(plain_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = plain_reader, plain_map


def _llama(meta: dict):
    from transformers import LlamaConfig

    cfg = dict(meta["config"])
    kind = cfg.get("model_type")
    if kind != "llama":
        raise SystemExit(f"vlens converts GGUF Llamas only; this file is {kind!r}")
    for key in _DROPPED:
        cfg.pop(key, None)
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    return config


def _weights(gguf: Path, config, dtype):
    """The model with the GGUF's tensors, dequantised, its embeddings tied."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only for the tensor names
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.float32)["tensors"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    expected_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) != expected_missing or unexpected:
        raise SystemExit(f"the GGUF's tensors do not fit the model: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    if config.tie_word_embeddings and not torch.equal(model.lm_head.weight,
                                                      model.model.embed_tokens.weight):
        raise SystemExit("the output embedding did not tie to the input embedding")
    model.config.dtype = str(dtype).removeprefix("torch.")
    return model.to(dtype).eval()


def convert(gguf: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the Hugging Face folder ``out`` from the GGUF Llama ``gguf``."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf, out = Path(gguf), Path(out)
    with _parse_once():
        meta = load_gguf_checkpoint(str(gguf))  # metadata only
        config = _llama(meta)
        model = _weights(gguf, config, getattr(torch, dtype))
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id)
    model.save_pretrained(out)  # safetensors
    if not tok.chat_template:
        tok.chat_template = meta.get("tokenizer_config", {}).get("chat_template")
    tok.save_pretrained(out)
    again = AutoTokenizer.from_pretrained(str(out))
    if tok.chat_template and again.chat_template != tok.chat_template:
        raise SystemExit("the saved tokenizer lost its chat template")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlens.models.convert", description=__doc__)
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("out", help="the folder to write (must not hold a model yet)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader)
    except ImportError:
        print("the Python package `gguf` is missing (transformers reads GGUF files with it): "
              f"install it with `{sys.executable} -m pip install gguf`", file=sys.stderr)
        return 3
    convert(args.gguf, args.out, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
