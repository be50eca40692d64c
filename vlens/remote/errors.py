"""Errors on ``vlens serve`` as ``vllm serve`` gives them, and never a bare 500.

vLLM's serving classes raise their validation errors (a ``max_tokens``
past the model's length, ``temperature=-1``, ``top_logprobs=50``, a prompt
too long) for the app's exception handlers to answer: ``vllm serve``
registers handlers that turn them into a JSON 400 naming the parameter.
:func:`install` registers the same handlers (vLLM's own functions) on
vlens's app, and :class:`NoBareErrors` catches whatever still escapes a
route: an exception that reached uvicorn would be answered as a plain-text
500 and its connection closed, which breaks the next request of a client
that keeps connections alive (the ``openai`` SDK does).
"""

from __future__ import annotations

import json
import logging
import uuid
from types import SimpleNamespace
from typing import Any

__all__ = ["NoBareErrors", "guarded_route", "install", "internal_error", "vllm_error",
           "vllm_validation_error"]

_log = logging.getLogger("vlens.serve")


def vllm_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI error body vLLM gives for ``exc``."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    err = create_error_response(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
    return int(err.error.code), err.model_dump()


async def vllm_validation_error(request: Any, errors: list[dict[str, Any]]) -> Any:
    """vLLM's answer to a request body that does not validate (``errors``:
    pydantic's, with ``loc`` starting at the body, as FastAPI gives them)."""
    from fastapi.exceptions import RequestValidationError
    from vllm.entrypoints.serve.exception_handling.handlers.validation import (
        validation_exception_handler)

    return await validation_exception_handler(request, RequestValidationError(errors))


def install(app: Any) -> None:
    """vLLM's exception handlers on ``app`` (all but its catch-all, which
    :class:`NoBareErrors` replaces), and the middleware."""
    from fastapi import HTTPException
    from fastapi.exceptions import RequestValidationError
    from vllm.entrypoints.serve.exception_handling.handlers.exception import exception_handler
    from vllm.entrypoints.serve.exception_handling.handlers.http import (
        http_exception_handler)
    from vllm.entrypoints.serve.exception_handling.handlers.validation import (
        validation_exception_handler)
    from vllm.exceptions import VLLMError

    # the handlers read these of vllm serve's arguments
    app.state.args = SimpleNamespace(log_error_stack=False, sse_keep_alive_interval=0)
    app.exception_handler(HTTPException)(http_exception_handler)
    app.exception_handler(RequestValidationError)(validation_exception_handler)
    for kind in (VLLMError, ValueError, TypeError, OverflowError, NotImplementedError):
        app.exception_handler(kind)(exception_handler)
    app.add_middleware(NoBareErrors)


class NoBareErrors:
    """ASGI middleware: an exception that escapes a route becomes vLLM's
    JSON error (500 unless vLLM maps it to another status) on a connection
    that stays open. One raised after the answer began (a stream) ends the
    answer cleanly instead of cutting the connection."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "ended": False}

        async def tracked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - answered, never passed to uvicorn
            _log.warning("vlens serve: %s %s failed: %s: %s", scope.get("method"),
                         scope.get("path"), type(exc).__name__, exc)
            if state["ended"]:
                return
            if state["started"]:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            status, body = vllm_error(exc)
            data = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data, "more_body": False})


def internal_error(request: Any, exc: BaseException) -> Any:
    """A 500 for an exception no check meant (a fault of the server, not of
    the client's request), with an id that the log line also carries."""
    from fastapi.responses import JSONResponse

    error_id = uuid.uuid4().hex[:12]
    _log.error("vlens serve: %s %s failed (error id %s): %s: %s", request.method,
               request.url.path, error_id, type(exc).__name__, exc, exc_info=exc)
    message = (f"the server failed on this request (error id {error_id}: its log has the "
               "details); this is not a fault of the request")
    return JSONResponse({"error": {"message": message, "type": "InternalServerError",
                                   "param": None, "code": 500, "id": error_id}}, 500)


def guarded_route(client_errors: tuple[type[BaseException], ...]) -> type:
    """FastAPI's route class with one rule: an exception a route raises is
    answered by the app's handlers (a 400 naming the field, a 401 …) when it
    is one of ``client_errors`` (vlens's checks, FastAPI's validation and
    HTTP errors), and is otherwise a 500 with an id (:func:`internal_error`),
    never a 400 blaming the client. vLLM's own serving code is called inside
    the routes that answer its errors as ``vllm serve`` does."""
    from fastapi import HTTPException
    from fastapi.exceptions import RequestValidationError
    from fastapi.routing import APIRoute

    passed = (*client_errors, HTTPException, RequestValidationError)

    class GuardedRoute(APIRoute):
        def get_route_handler(self) -> Any:
            handler = super().get_route_handler()

            async def run(request: Any) -> Any:
                try:
                    return await handler(request)
                except passed:
                    raise
                except Exception as exc:  # noqa: BLE001 - a fault of the server: a 500
                    return internal_error(request, exc)

            return run

    return GuardedRoute
