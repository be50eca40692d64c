"""The tokens a method is asked about (an answer, a wrong token, a forced
token, a target): each one token, as its text or its id, checked once here
for every method that takes one."""

from __future__ import annotations

from typing import Any

from vlens.checks.facts import is_int
from vlens.errors import VlensError

__all__ = ["one_token", "answer_pair"]


def one_token(session: Any, x: Any, what: str) -> int:
    """``x`` as a token id: a text that is exactly one token, or an id in the
    vocabulary; anything else is a VlensError naming ``what`` and how ``x``
    tokenises."""
    vocab = session.facts.vocab_size
    if is_int(x):
        if not 0 <= x < vocab:
            raise VlensError(f"{what} id {x} is outside the vocabulary (0 to {vocab - 1})")
        return int(x)
    if isinstance(x, str):
        ids = list(session.tokenizer(x, add_special_tokens=False)["input_ids"])
        if len(ids) != 1:
            shown = ", ".join(repr(t) for t in session.token_strings(ids)) or "no tokens"
            raise VlensError(f"{what} {x!r} tokenises to {len(ids)} tokens ({shown}, ids "
                             f"{ids}): give exactly one token, as its text or its id")
        return int(ids[0])
    raise VlensError(f"{what} must be a one-token string or a token id, got {x!r:.60}")


def answer_pair(session: Any, answer: Any) -> tuple[int, int] | None:
    """A patching method's ``answer=``: None, or ``(clean, corrupt)``, two
    different tokens."""
    if answer is None:
        return None
    if not isinstance(answer, (list, tuple)) or len(answer) != 2:
        raise VlensError(f"answer must be (clean_token, corrupt_token), got {answer!r:.60}")
    pair = (one_token(session, answer[0], "clean answer"),
            one_token(session, answer[1], "corrupt answer"))
    if pair[0] == pair[1]:
        raise VlensError("answer names the same token twice: give two different tokens")
    return pair
