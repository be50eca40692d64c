"""Prompts of every form, normalised once: ids, roles, formatted text.

A prompt is one of

* a string (tokenized as the engine does, with BOS if the tokenizer adds one);
* a **conversation**: a list of ``{"role": ..., "content": ...}`` dicts,
  formatted with the tokenizer's chat template (``add_generation_prompt=True``),
  giving the ids ``tokenizer.apply_chat_template(conv, add_generation_prompt=True)``
  gives; or ``{"messages": conv, "chat_template": ..., "chat_template_kwargs":
  {...}, "add_generation_prompt": ..., "continue_final_message": ...}`` for
  the options vLLM's ``LLM.chat`` takes;
* **token ids**: ``{"prompt_token_ids": [...]}``, vLLM's own form.

A list of these is a batch. :func:`normalise` makes a :class:`Prompt` of
each: its ids, the formatted text, each token's character span in it and
each token's role (the role of the message whose content it holds, None
for the template's own tokens). :func:`resolve_spans` turns the role spans
of Steers and Ablates (``span="user"``) into token positions, so the
workers only ever see positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vlens import spans
from vlens.edits import ROLE_SPANS
from vlens.errors import VlensError
from vlens.tokens import TokenReader

__all__ = ["Prompt", "content_spans", "is_conversation", "normalise",
           "resolve_spans", "role_ranges"]


_FORMS = ("a string, a conversation (a list of {'role': ..., 'content': ...} dicts), "
          "{'prompt_token_ids': [...]} or {'messages': conversation, ...}")
_CHAT_KEYS = {"messages", "chat_template", "chat_template_kwargs", "add_generation_prompt",
              "continue_final_message", "tools"}


@dataclass
class Prompt:
    """One prompt, normalised: ``ids`` (what the engine runs), ``text``
    (the formatted prompt), ``offsets`` (each token's character span in
    ``text``), ``roles`` (each token's role or None), ``label`` (what a
    Trace's ``prompt`` shows) and ``source`` (the prompt as given)."""

    ids: list[int]
    text: str
    offsets: list[tuple[int, int]]
    roles: list[str | None]
    label: str
    source: Any = None
    kind: str = "text"  # "text", "chat" or "ids"
    chat: dict[str, Any] = field(default_factory=dict)


def is_conversation(value: Any) -> bool:
    """A non-empty list of dicts that all have a "role"."""
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(m, dict) and "role" in m for m in value))


def _batch(value: Any) -> list[Any]:
    """The prompts of ``value``, one or a batch (refusing ambiguous lists)."""
    if isinstance(value, (str, dict)) or is_conversation(value):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise VlensError(f"prompts must be {_FORMS}, or a list of these; got "
                         f"{type(value).__name__}")
    if not value:
        raise VlensError("prompts is empty: pass at least one prompt")
    if any(isinstance(m, dict) and "role" in m for m in value):
        raise VlensError(
            "this list mixes messages ({'role': ...} dicts) with other prompts: a "
            "conversation is a list of messages only; a batch of conversations is a list "
            "of such lists")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise VlensError("a list of ints is not a prompt: pass token ids as "
                         "{'prompt_token_ids': [...]}")
    return list(value)


def normalise(value: Any, tokenizer: Any, max_len: int, *, reader: TokenReader | None = None,
              chat_template: str | None = None,
              chat_template_kwargs: dict[str, Any] | None = None) -> list[Prompt]:
    """Every prompt of ``value`` (one or a batch) as a :class:`Prompt`,
    checked: non-empty, shorter than ``max_len`` tokens. ``chat_template``
    and ``chat_template_kwargs``: the defaults for conversations."""
    reader = reader or TokenReader(tokenizer)
    batch = _batch(value)
    encoded = _encode_texts(tokenizer, [p for p in batch if isinstance(p, str) and p.strip()])
    out = []
    for i, p in enumerate(batch):
        if isinstance(p, str):
            if not p.strip():
                raise VlensError(f"prompt {i} is empty: give it at least one word")
            prompt = _text_prompt(p, tokenizer, reader, encoded.get(p))
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            prompt = _ids_prompt(i, p, tokenizer, reader)
        elif is_conversation(p) or (isinstance(p, dict) and "messages" in p):
            opts = {"chat_template": chat_template,
                    "chat_template_kwargs": dict(chat_template_kwargs or {})}
            if isinstance(p, dict):
                odd = set(p) - _CHAT_KEYS
                if odd:
                    raise VlensError(f"prompt {i}: unknown keys {sorted(odd)}; a chat prompt "
                                     f"takes {sorted(_CHAT_KEYS)}")
                opts.update({k: v for k, v in p.items() if k != "messages"})
            prompt = _chat_prompt(i, p["messages"] if isinstance(p, dict) else p, tokenizer,
                                  reader, opts)
        else:
            raise VlensError(f"prompt {i} is a {type(p).__name__}, not a string, a "
                             f"conversation or token ids: each prompt must be {_FORMS}")
        prompt.source = p if not isinstance(p, str) else prompt.source
        if len(prompt.ids) >= max_len:
            raise VlensError(
                f"prompt {i} is {len(prompt.ids)} tokens long but the engine's max_model_len "
                f"is {max_len}: shorten it to under {max_len} tokens, or start the Session "
                "with a larger max_model_len=")
        out.append(prompt)
    return out


def _encode(tokenizer: Any, text: str, specials: bool) -> tuple[list[int], list | None]:
    try:
        enc = tokenizer(text, add_special_tokens=specials, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(map(int, o)) for o in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer: no offsets
        return list(tokenizer(text, add_special_tokens=specials)["input_ids"]), None


def _encode_texts(tokenizer: Any, texts: list[str]) -> dict[str, tuple[list[int], list]]:
    """Each of ``texts`` as :func:`_encode` gives it, from one call of a
    fast tokenizer for them all (its batch runs in Rust: a third of the
    time of one call per prompt for 32 short prompts); empty where there
    are fewer than two or the tokenizer cannot batch with offsets (then
    each prompt is encoded alone)."""
    texts = list(dict.fromkeys(texts))
    if len(texts) < 2:
        return {}
    try:
        enc = tokenizer(texts, add_special_tokens=True, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
    except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer: no offsets
        return {}
    if len(ids) != len(texts) or len(offsets) != len(texts):
        return {}
    return {t: (list(i), [tuple(map(int, o)) for o in off])
            for t, i, off in zip(texts, ids, offsets)}


def _joined_offsets(pieces: list[str]) -> tuple[str, list[tuple[int, int]]]:
    offsets, at = [], 0
    for piece in pieces:
        offsets.append((at, at + len(piece)))
        at += len(piece)
    return "".join(pieces), offsets


def _text_prompt(text: str, tokenizer: Any, reader: TokenReader,
                 encoded: tuple[list[int], list] | None = None) -> Prompt:
    ids, offsets = encoded if encoded is not None else _encode(tokenizer, text, True)
    if offsets is None:  # a slow tokenizer: spans of the readable tokens, joined
        offsets = _joined_offsets(reader.texts(ids))[1]
    return Prompt(ids, text, offsets, [None] * len(ids), text, source=text)


def _ids_prompt(i: int, p: dict, tokenizer: Any, reader: TokenReader) -> Prompt:
    ids = p["prompt_token_ids"]
    odd = set(p) - {"prompt_token_ids"}
    if odd:
        raise VlensError(f"prompt {i}: a token-id prompt holds only 'prompt_token_ids', not "
                         f"{sorted(odd)}")
    vocab = len(tokenizer)
    if (not isinstance(ids, (list, tuple)) or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise VlensError(f"prompt {i}: prompt_token_ids must be a non-empty list of ints")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise VlensError(f"prompt {i}: token id {bad[0]} is outside the vocabulary "
                         f"(0 to {vocab - 1})")
    text, offsets = _joined_offsets(reader.texts(ids))
    return Prompt(list(ids), text, offsets, [None] * len(ids), text, source=p, kind="ids")


def _chat_prompt(i: int, conv: Any, tokenizer: Any, reader: TokenReader,
                 opts: dict[str, Any]) -> Prompt:
    if not is_conversation(conv):
        raise VlensError(f"prompt {i}: a conversation is a non-empty list of "
                         "{'role': ..., 'content': ...} dicts")
    for j, m in enumerate(conv):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise VlensError(f"prompt {i}, message {j}: each message needs a string 'role' "
                             f"and a string 'content', got {m!r:.80}")
    template = opts.get("chat_template")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise VlensError(
            "this model's tokenizer has no chat template, so a conversation cannot be "
            "formatted: pass chat_template= (a Jinja template string; in the prompt as "
            "{'messages': conv, 'chat_template': ...} or on the Session as "
            "s.chat_template = ...), or pass the prompt as a string")
    kwargs = dict(opts.get("chat_template_kwargs") or {})
    chat = {"add_generation_prompt": opts.get("add_generation_prompt", True),
            "continue_final_message": opts.get("continue_final_message", False)}
    if opts.get("tools") is not None:
        chat["tools"] = opts["tools"]
    try:
        text = tokenizer.apply_chat_template(
            list(conv), tokenize=False, chat_template=template, **chat, **kwargs)
    except Exception as exc:  # noqa: BLE001 - Jinja's own errors vary
        raise VlensError(f"prompt {i}: the chat template failed: {exc}") from None
    ids, offsets = _encode(tokenizer, text, False)
    if offsets is None:
        text, offsets = _joined_offsets(reader.texts(ids))
    roles = _token_roles(text, offsets, conv)
    return Prompt(ids, text, offsets, roles, text, source=list(conv), kind="chat",
                  chat=dict(chat, chat_template=template, **kwargs))


def content_spans(text: str, conv: Sequence[dict]) -> list[tuple[str, int, int]]:
    """Each message's content as ``(role, start, stop)`` characters of the
    formatted ``text``, found in order (a message the template drops or
    rewrites is left out)."""
    spans, at = [], 0
    for m in conv:
        content = m["content"]
        for want in (content, content.strip()):
            if not want:
                break
            k = text.find(want, at)
            if k >= 0:
                spans.append((m["role"], k, k + len(want)))
                at = k + len(want)
                break
    return spans


def _token_roles(text: str, offsets: list[tuple[int, int]], conv: Sequence[dict]
                 ) -> list[str | None]:
    """A token takes the role of the content span its characters overlap."""
    spans = content_spans(text, conv)
    roles: list[str | None] = []
    for s, e in offsets:
        role = None
        if e > s:
            for r, a, b in spans:
                if s < b and e > a:
                    role = r
                    break
        roles.append(role)
    return roles


def role_ranges(roles: Sequence[str | None], role: str) -> list[tuple[int, int]]:
    """The runs of consecutive tokens of ``role``, as ``(start, stop)``."""
    out: list[tuple[int, int]] = []
    for k, r in enumerate(roles):
        if r == role:
            if out and out[-1][1] == k:
                out[-1] = (out[-1][0], k + 1)
            else:
                out.append((k, k + 1))
    return out


def resolve_spans(edits: Sequence[Any], prompt: Prompt, i: int,
                  max_new_tokens: int | None = None) -> list[Any]:
    """Steers or Ablates of prompt ``i`` whose span is a run of rows only the
    prompt can say -- a role (``span="user"``), ``"last"`` or explicit
    positions -- as copies over ``(start, stop)`` ranges, one per run of
    consecutive rows; ``"assistant"`` also covers the reply being generated
    (the rows fed back: none when ``max_new_tokens`` is 1 or less, as for
    patching's prompt positions). Names and ranges pass as they are."""
    out = []
    n = len(prompt.ids)
    for ed in edits:
        span = ed.span
        what = getattr(ed, "what", type(ed).__name__)
        # a Clamp is made from its SAE, not from its fields: it says how to move it
        move = getattr(ed, "with_span", None) or (lambda r, ed=ed: dataclasses.replace(ed, span=r))
        if span == "last" or isinstance(span, spans.Positions):
            total = n + max(0, (max_new_tokens or 1) - 1)
            out.extend(move(r) for r in spans.runs(spans.rows(span, n, total, None, what)))
            continue
        if not (isinstance(span, str) and span in ROLE_SPANS):
            out.append(ed)
            continue
        if prompt.kind != "chat":
            raise VlensError(
                f"{what} span {span!r} names a role, but prompt {i} is "
                f"{'token ids' if prompt.kind == 'ids' else 'a plain string'} with no roles: "
                "pass the prompt as a conversation, or use span='all'/'prompt'/(start, stop)")
        ranges: list[Any] = role_ranges(prompt.roles, span)
        if span == "assistant" and (max_new_tokens is None or max_new_tokens > 1):
            ranges.append("generated")  # the reply being written is the assistant's
        if not ranges:
            found = sorted({r for r in prompt.roles if r})
            raise VlensError(f"{what} span {span!r}: prompt {i} has no {span} message "
                             f"content (its roles: {found})")
        out.extend(move(r) for r in ranges)
    return out


def prompt_parts(p: Prompt | None, n: int, fed: Sequence[int], start: int) -> dict[str, Any]:
    """A Trace's ``roles``, ``prompt_text`` and ``offsets`` from its request's
    normalised prompt ``p`` of ``n`` ids (rows from ``start`` on; past the
    prompt "generated")."""
    roles = list(p.roles) if p is not None else [None] * n
    # in a conversation the tokens generated are the assistant's reply
    tail = "assistant" if p is not None and p.kind == "chat" else "generated"
    roles = (roles + [tail] * max(0, len(fed) + start - n))[start:start + len(fed)]
    if p is None:
        return {"roles": roles}
    return {"roles": roles, "prompt_text": p.text, "offsets": list(p.offsets)}
