"""Token text a person can read.

A model's vocabulary stores tokens in its own spelling: byte-level BPE
(GPT-2, Llama-3, Qwen) writes each byte as a printable stand-in (``Ġ`` for
a space, ``Ċ`` for a newline), SentencePiece-style vocabularies (Llama-2,
Gemma) write ``▁`` for a space and keep bytes they cannot spell as
``<0xE2>`` pieces. :class:`TokenReader` turns every id back into the bytes
it stands for and those into text: a token holding part of a character
shows the bytes it holds (``<0xE2>``), never a replacement character, and
special tokens read as their own text. Over whole characters the tokens of
a prompt join back to the prompt. Tokenizers of neither kind fall back to
decoding the id alone.

Plain code over a Hugging Face tokenizer: nothing here touches the engine.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["VISIBLE", "TokenReader", "byte_level_table", "first_divergence", "show_bytes",
           "visible"]

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _bytes_as_hex(err: UnicodeDecodeError) -> tuple[str, int]:
    bad = err.object[err.start:err.end]
    return "".join(f"<0x{b:02X}>" for b in bad), err.end


codecs.register_error("vlens-bytes", _bytes_as_hex)


def show_bytes(data: bytes) -> str:
    """UTF-8 text of ``data``; bytes that do not make a whole character
    read as ``<0xE2>`` pieces."""
    return data.decode("utf-8", errors="vlens-bytes")


@functools.lru_cache(maxsize=1)
def byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins -> the byte each stands for:
    printable Latin-1 bytes stand for themselves, the other 68 bytes are
    written as the code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The decoder types a fast tokenizer's pipeline names."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        spec = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - an odd backend: fall back to decode()
        return set()
    kinds: set[str] = set()
    todo = [spec]
    while todo:
        part = todo.pop()
        if isinstance(part, dict):
            kinds.add(str(part.get("type")))
            if part.get("type") == "Replace" and "▁" in json.dumps(part.get("pattern"),
                                                                ensure_ascii=False):
                kinds.add("Metaspace")
            todo.extend(part.get("decoders") or [])
    return kinds


class TokenReader:
    """Readable text of token ids for one tokenizer (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        kinds = _decoder_kinds(tokenizer)
        self.kind = ("byte_level" if "ByteLevel" in kinds
                     else "metaspace" if "Metaspace" in kinds else "other")
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._special = {int(i): str(t) for i, t in added.items()}
        self._cache: dict[int, str] = {}

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for (None: a special token, or a
        tokenizer of neither known kind)."""
        if token_id in self._special or self.kind == "other":
            return None
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return None
        if self.kind == "byte_level":
            table = byte_level_table()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode("utf-8")
        match = _BYTE_PIECE.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("▁", " ").encode("utf-8")

    def text(self, token_id: int) -> str:
        """One token as it reads."""
        token_id = int(token_id)
        out = self._cache.get(token_id)
        if out is None:
            if token_id in self._special:
                out = self._special[token_id]
            else:
                data = self.token_bytes(token_id)
                out = (self.tokenizer.decode([token_id]) if data is None
                       else show_bytes(data))
            self._cache[token_id] = out
        return out

    def texts(self, ids: Any) -> list[str]:
        return [self.text(i) for i in ids]


#: how whitespace is drawn in every view (the chip strip's token_span.js
#: draws the same): a space, a newline, a tab, an empty token
VISIBLE = {" ": "\u00b7", "\n": "\u21b5", "\t": "\u21e5"}


def visible(token: str) -> str:
    """``token`` with its whitespace drawn: ``·`` a space, ``↵`` a newline,
    ``⇥`` a tab, ``∅`` an empty token (the token axes of every plot, the
    chips and the patching grid's columns use this one spelling)."""
    if token == "":
        return "\u2205"
    return "".join(VISIBLE.get(ch, ch) for ch in token)


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (ids or texts);
    the shorter one's length when one is the other's start; None: equal.
    (Here, with no vlens imports, so results and plots can both use it.)"""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
