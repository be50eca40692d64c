"""A prompt in a text box: a plain string, or a conversation as messages.

A string prompt is its text. A conversation
(``[{"role": "user", "content": "..."}]``) is shown one message per line,
``role: content``, the way people write a dialogue down::

    system: You are a storyteller.
    user: Tell me a story about a fox.

A line that does not start with a role continues the message above it (a
message of several lines). Token ids (``{"prompt_token_ids": [...]}``) are
shown as JSON, and JSON typed in a box is read as JSON (a list of messages
too). :func:`box_text` writes a prompt into a box, :func:`box_prompt` reads
one back, and :func:`prompt_box` makes the box: a text area as tall as
its text.
"""

from __future__ import annotations

import json
import re
from typing import Any

import ipywidgets as widgets

__all__ = ["ROLES", "box_prompt", "box_text", "prompt_box"]

#: the roles a line may start with (``role: content``)
ROLES = ("system", "user", "assistant", "tool", "developer")

_ROLE_LINE = re.compile(r"^(%s):[ \t]?(.*)$" % "|".join(ROLES))


def _is_conversation(prompt: Any) -> bool:
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(m, dict) and set(m) == {"role", "content"}
                    and m["role"] in ROLES and isinstance(m["content"], str) for m in prompt))


def box_text(prompt: Any) -> str:
    """What a prompt box shows for ``prompt``: the text, a conversation as
    ``role: content`` lines, anything else as JSON."""
    if isinstance(prompt, str):
        return prompt
    if _is_conversation(prompt):
        return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
    return json.dumps(prompt, ensure_ascii=False)


def _messages(text: str) -> list[dict[str, str]] | None:
    """The conversation ``text`` writes as ``role: content`` lines (None:
    its first line names no role, so it is a plain prompt)."""
    lines = text.strip("\n").split("\n")
    if not _ROLE_LINE.match(lines[0]):
        return None
    messages: list[dict[str, str]] = []
    for line in lines:
        m = _ROLE_LINE.match(line)
        if m:
            messages.append({"role": m.group(1), "content": m.group(2)})
        else:
            messages[-1]["content"] += "\n" + line
    return messages


def box_prompt(text: str) -> Any:
    """The prompt a box's ``text`` holds."""
    stripped = text.strip()
    if stripped[:1] in ("[", "{"):
        try:
            value = json.loads(stripped)
        except ValueError:
            return text
        if isinstance(value, (list, dict)):
            return value
    return _messages(text) or text


def prompt_box(prompt: Any, description: str = "prompt", width: str = "60%") -> widgets.Textarea:
    """A box holding ``prompt``, as tall as its lines (see :func:`box_text`)."""
    box = widgets.Textarea(box_text(prompt or ""), description=description,
                           layout={"width": width})

    def fit(_change: Any = None) -> None:
        box.rows = min(8, max(1, box.value.count("\n") + 1))

    fit()
    box.observe(fit, names="value")
    return box
