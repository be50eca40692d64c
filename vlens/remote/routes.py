"""The routes orchestrators and tools call on ``vlens serve``, as ``vllm
serve`` answers them: ``/health`` and ``/ping`` (no token: 200 when the
engine answers, 503 when it does not), ``/version``, ``/metrics``
(Prometheus text; behind the token unless ``--metrics-public``), and
``/docs`` with ``/openapi.json``, whose OpenAI request bodies document the
``vlens`` object (:mod:`vlens.remote.schema`)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Depends, Request  # module level: FastAPI reads the routes' annotations here

import vlens
from vlens.remote.guard import Refused

__all__ = ["install_routes", "install_docs", "token_required", "PUBLIC"]

#: the only routes answered without a token
PUBLIC = ("/health", "/ping", "/version")

#: seconds /health waits for the engine to answer
HEALTH_SECONDS = 10.0


def token_required(server: Any, refusal: Any = None) -> Any:
    """The FastAPI dependency every route but :data:`PUBLIC` has: the
    client the request's bearer token names (``Depends``: a route takes it
    as an argument, or lists it in ``dependencies``). Without a known token
    it raises the server's 401 :class:`~vlens.remote.guard.Refused`, or
    ``refusal(exc)`` (the OpenAI routes' error shape)."""

    async def client(request: Request) -> Any:
        try:
            return server.authenticate(request.headers.get("authorization"))
        except Refused as exc:
            if refusal is None:
                raise
            raise refusal(exc) from None

    return Depends(client)


def install_routes(app: Any, server: Any, metrics_public: bool) -> None:
    from fastapi.responses import JSONResponse, Response

    async def health(request: Request):
        try:
            if getattr(server.llm, "errored", False):
                raise RuntimeError("the engine has stopped")
            await asyncio.wait_for(server.llm.check_health(), HEALTH_SECONDS)
        except Exception:  # noqa: BLE001 - any failure: not healthy
            return Response(status_code=503)
        return Response(status_code=200)

    async def version(request: Request):
        import vllm

        return JSONResponse({"version": vllm.__version__, "vlens": vlens.__version__})

    async def metrics(request: Request):
        from prometheus_client import CONTENT_TYPE_LATEST

        worker = await server.worker_status()
        page = server.metrics.text(worker, server.slots.calls, server.slots.queued)
        return Response(page, media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/health", health, methods=["GET"], response_class=Response,
                      summary="200 when the engine answers, 503 when not (no token)")
    app.add_api_route("/ping", health, methods=["GET", "POST"], response_class=Response,
                      summary="as /health")
    app.add_api_route("/version", version, methods=["GET"], summary="vLLM's and vlens's versions")
    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=Response,
                      dependencies=[] if metrics_public else [token_required(server)],
                      summary="Prometheus text: vLLM's engine metrics, then vlens's"
                      + ("" if metrics_public else " (token)"))


def install_docs(app: Any, bodies: dict[str, Any], server: Any) -> None:
    """``/openapi.json`` with ``bodies`` (``{path: pydantic model}``) as
    the request bodies of those POST routes, and ``/docs`` (Swagger UI),
    both behind the token."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import JSONResponse

    cached: dict[str, Any] = {}

    def schema() -> dict[str, Any]:
        if cached:
            return cached
        spec = get_openapi(title="vlens serve", version=_version(), routes=app.routes,
                           description="vLLM's OpenAI routes with a `vlens` object per "
                                       "request, and vlens's own protocol")
        components = spec.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            for prefix in ("", "/presets/{preset}"):
                op = spec["paths"].get(prefix + path, {}).get("post")
                if op is not None:
                    op["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        cached.update(spec)
        return cached

    async def openapi(request: Request):
        return JSONResponse(schema())

    async def docs(request: Request):
        return get_swagger_ui_html(openapi_url="/openapi.json", title="vlens serve")

    token = [token_required(server)]
    app.add_api_route("/openapi.json", openapi, methods=["GET"], include_in_schema=False,
                      dependencies=token)
    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False,
                      dependencies=token)


def _version() -> str:
    return getattr(vlens, "__version__", "0")

