"""Tiny conversation models with real-model tokenizers, made on the spot.

:func:`make_chat_model` writes a random-weight model (as
:func:`vlens.tiny.make_tiny_model` does) beside a tokenizer trained here,
with the ``tokenizers`` library, from the text below:

* ``"byte_level"``: byte-level BPE, the GPT-2 / Llama-3 / Qwen kind (every
  byte has a printable stand-in: ``Ġ`` a space, ``Ċ`` a newline; a
  character outside the training text splits into byte tokens);
* ``"metaspace"``: ``▁`` for a space and byte fallback (``<0xE2>`` pieces
  for characters it has no token for), the SentencePiece kind of Llama-2
  and Gemma.

and one of three chat templates written for vlens's tests in the shapes
of Llama-3 (``"llama3"``), Gemma (``"gemma"``, the assistant's turns named
``model``) and ChatML (``"chatml"``, Qwen's). No download: nothing here
comes from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlens.tiny import make_tiny_model

__all__ = ["CHAT_TEMPLATES", "TOKENIZER_KINDS", "make_chat_model", "make_chat_tokenizer"]

TOKENIZER_KINDS = ("byte_level", "metaspace")

#: chat templates in the shapes of three model families
CHAT_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% for m in messages %}"
        "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}

_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"]

_TEXT = """\
You are a helpful assistant. Answer the user's question in one short sentence.
The user asked how to bake bread, and the assistant said: mix flour, water, salt and yeast.
A system message sets the rules; the model answers; the user writes again.
Where is the café? It is next to the old station, near the river.
Please tell me a story about a fox, a crow and a piece of cheese.
Summer evenings are long and warm; winter mornings are short and cold.
She counted one, two, three, four, five, six, seven, eight, nine, ten.
How do I say thank you in French? You say merci. In Spanish, gracias.
The recipe needs 200 grams of sugar, 3 eggs and a pinch of salt.
Naïve résumé: an élève wrote déjà vu on the board.
"""


def make_chat_tokenizer(kind: str = "byte_level", template: str = "llama3",
                        vocab_size: int = 600):
    """A ``PreTrainedTokenizerFast`` of ``kind`` with ``template``'s chat
    template, trained on the text above (at most ``vocab_size`` tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}: use one of {TOKENIZER_KINDS}")
    if template not in CHAT_TEMPLATES:
        raise ValueError(f"unknown template {template!r}: use one of {list(CHAT_TEMPLATES)}")
    lines = _TEXT.splitlines() * 4
    if kind == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(lines, trainer)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=_SPECIAL)
        tok.train_from_iterator(lines, trainer)
        tok = _with_byte_fallback(tok)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", chat_template=CHAT_TEMPLATES[template])


def _with_byte_fallback(tok):
    """``tok`` (a trained BPE) with the 256 ``<0xNN>`` byte pieces added to
    its vocabulary and byte fallback on."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["unk_token"] = None
    return Tokenizer.from_str(json.dumps(spec))


def make_chat_model(path: str | Path, kind: str = "byte_level", template: str = "llama3", *,
                    arch: str = "llama", **model_kwargs) -> Path:
    """A random-weight model of ``arch`` (see :func:`vlens.tiny.make_tiny_model`)
    whose tokenizer is :func:`make_chat_tokenizer` ``(kind, template)``.
    Idempotent like ``make_tiny_model``."""
    path = Path(path)
    done = (path / "tokenizer.json").exists() and (path / "vlens_chat.json").exists()
    tok = None if done else make_chat_tokenizer(kind, template)
    # the model's vocabulary is the tokenizer's: a sampled id past it would
    # have no text for vLLM's detokenizer
    make_tiny_model(path, arch, vocab=len(tok) if tok is not None else 0, **model_kwargs)
    if tok is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (path / name).unlink(missing_ok=True)
        tok.save_pretrained(path)
        (path / "vlens_chat.json").write_text(json.dumps({"kind": kind, "template": template}))
    return path
