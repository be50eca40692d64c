"""The token file of ``vlens serve``: one client a line, each a name and a
bearer token. It must be private to the user who runs the server, and a
changed file is taken up without a restart (:class:`TokenFile`).
"""

from __future__ import annotations

import os
import re
import stat
import sys
import time
from pathlib import Path

from vlens.errors import VlensError

__all__ = ["TokenFile", "load_tokens"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")


def load_tokens(path: str | Path) -> dict[str, str]:
    """A token file -> ``{token: client name}``. One client a line:
    ``NAME TOKEN`` or just ``TOKEN`` (named ``client<line>``); blank lines
    and ``#`` comments are skipped. Tokens must be at least 16 characters."""
    tokens: dict[str, str] = {}
    try:
        mode = os.stat(path).st_mode
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise VlensError(f"cannot read the token file {path}: {exc.strerror}") from None
    if mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_IROTH):
        raise VlensError(f"the token file {path} can be read or changed by other users "
                         f"(mode {stat.filemode(mode)}): chmod 600 {path}")
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark is not part of the first token
    except UnicodeDecodeError as exc:
        raise VlensError(f"the token file {path} is not UTF-8 text (byte {exc.start}): one "
                         "client a line, 'NAME TOKEN' or 'TOKEN'") from None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        name, token = (parts[0], parts[1]) if len(parts) == 2 else (f"client{n}", parts[0])
        if len(parts) > 2 or not _NAME.match(name):
            raise VlensError(f"{path}:{n}: expected 'NAME TOKEN' or 'TOKEN' "
                             "(NAME: 1-32 of A-Z a-z 0-9 _ . -)")
        if len(token) < 16:
            raise VlensError(f"{path}:{n}: tokens must be at least 16 characters "
                             "(python -c 'import secrets; print(secrets.token_urlsafe())')")
        if token in tokens or name in tokens.values():
            raise VlensError(f"{path}:{n}: a name or token appears twice")
        tokens[token] = name
    if not tokens:
        raise VlensError(f"{path} holds no tokens")
    return tokens


class TokenFile:
    """The tokens the server accepts, ``pairs``: ``[(token bytes, client
    name)]``, reloaded from ``path`` when the file changes."""

    def __init__(self, tokens: dict[str, str], path: str | None) -> None:
        self.pairs = [(t.encode(), name) for t, name in tokens.items()]
        self.path = path
        self._stamp_seen = self._stamp()
        self._checked = time.monotonic()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path) if self.path else None
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size) if st else None

    def reload(self) -> list[str]:
        """Take up a changed token file (checked at most every 2 s): new
        tokens work and removed ones stop working without a restart. A file
        that does not load keeps the tokens as they were (and says why).
        Returns the client names of a reloaded file (else nothing)."""
        now = time.monotonic()
        if self.path is None or now - self._checked < 2.0:
            return []
        self._checked = now
        stamp = self._stamp()
        if stamp == self._stamp_seen:
            return []
        self._stamp_seen = stamp
        try:
            tokens = load_tokens(self.path)
        except VlensError as exc:
            print(f"vlens serve: the token file changed but did not load, keeping the old "
                  f"tokens: {exc}", file=sys.stderr, flush=True)
            return []
        self.pairs = [(t.encode(), name) for t, name in tokens.items()]
        return list(tokens.values())
