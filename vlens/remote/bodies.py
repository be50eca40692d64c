"""Request bodies on ``vlens serve``: read against their size and time
limits, and drained when a request is refused."""

from __future__ import annotations

import asyncio
from typing import Any

from vlens.remote.guard import Limits, Refused
from vlens.remote.wire import FRAME_TYPE

__all__ = ["drain", "read_body"]


async def read_body(request: Any, limit: int, seconds: float, kind: str = FRAME_TYPE) -> bytes:
    """A request's body, at most ``limit`` bytes within ``seconds``, of
    content type ``kind``."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise Refused(413, f"request body over this server's limit of {limit} bytes")
    if (request.headers.get("content-type") or "").split(";")[0].strip() != kind:
        raise Refused(415, f"send {'a vlens frame' if kind == FRAME_TYPE else 'JSON'} "
                           f"(Content-Type: {kind})")
    from starlette.requests import ClientDisconnect

    buf = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            buf.extend(chunk)
            if len(buf) > limit:
                raise Refused(413, f"request body over this server's limit of {limit} bytes")

    try:
        await asyncio.wait_for(read(), seconds)
    except asyncio.TimeoutError:
        raise Refused(408, f"the request body took over {seconds:g} s to arrive") from None
    except ClientDisconnect:
        raise Refused(400, "the client went away while sending its body") from None
    return bytes(buf)


async def drain(request: Any, limits: Limits) -> None:
    """Read and drop what is left of a refused request's body (up to the
    body limits), so the answer does not leave it half-sent and the client's
    connection stays usable."""
    async def read() -> None:
        got = 0
        async for chunk in request.stream():
            got += len(chunk)
            if got > limits.body_bytes:
                return

    try:
        await asyncio.wait_for(read(), min(limits.body_seconds, 10.0))
    except Exception:  # noqa: BLE001 - consumed already, gone, or too slow: nothing to keep
        pass
