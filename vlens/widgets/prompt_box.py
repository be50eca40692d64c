"""A prompt in a text box: a plain string, or a conversation as JSON.

The widgets' prompt boxes are one-line text fields. A string prompt is its
text; a conversation (``[{"role": "user", "content": "..."}]``) or token
ids (``{"prompt_token_ids": [...]}``) are shown, and typed, as JSON.
:func:`box_text` writes a prompt into a box, :func:`box_prompt` reads one
back (text that parses as a JSON list or object is that prompt).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["box_prompt", "box_text"]


def box_text(prompt: Any) -> str:
    """What a prompt box shows for ``prompt``."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, ensure_ascii=False)


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
    return text
