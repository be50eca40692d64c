"""OpenAI-compatible routes on ``vlens serve``: ``GET /v1/models`` and
``/v1/models/{id}``, ``POST /v1/completions`` and
``/v1/chat/completions`` (streamed or not), ``POST /tokenize`` and
``/detokenize``; the same model and completion routes under
``/presets/NAME/v1`` (steered by a named ``vlens`` object,
:mod:`vlens.remote.presets`); ``POST /v1/presets`` for a participant's own.

A request goes: token, body (read against its size and time limits),
``vlens`` object checked (vlens's refusals name the field), the request
validated as vLLM validates it (vLLM's 400 when it does not), a call slot
(waiting in line for one, :mod:`vlens.remote.slots`), then vLLM's serving
class over :class:`~vlens.remote.openai.SteeredEngine`. Whatever vLLM's
serving code raises is answered as ``vllm serve`` answers it
(:mod:`vlens.remote.errors`), on a connection that stays open.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import Request  # module level: FastAPI reads the routes' annotations here

from vlens.errors import VlensError
from vlens.remote.bodies import drain, read_body
from vlens.remote.errors import vllm_error, vllm_validation_error
from vlens.remote.guard import Refused
from vlens.remote.openai import PENDING, BadBody, Pending, SteeredEngine, error_json
from vlens.remote.presets import merge
from vlens.remote.routes import token_required
from vlens.remote.schema import BodyError, ChatBody, CompletionBody, PresetBody, parse_body

__all__ = ["OpenAIRoutes"]


class OpenAIRoutes:
    """vLLM's serving objects over :class:`SteeredEngine`, and the routes
    (added to the server's FastAPI app by :meth:`install`)."""

    def __init__(self, server: Any, model_name: str, chat_template: str | None) -> None:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
        from vllm.renderers.chat_utils import load_chat_template
        from vllm.renderers.online_renderer import OnlineRenderer

        self.server = server
        template = load_chat_template(chat_template)
        engine = SteeredEngine(server, template)
        self.models = OpenAIServingModels(
            engine_client=engine, base_model_paths=[BaseModelPath(model_name, server.model_dir)])
        renderer = OnlineRenderer(
            model_config=engine.model_config, renderer=engine.renderer, request_logger=None,
            chat_template=template, chat_template_content_format="auto")
        self.chat = OpenAIServingChat(
            engine, self.models, "assistant", online_renderer=renderer, request_logger=None,
            chat_template=template, chat_template_content_format="auto")
        self.completion = OpenAIServingCompletion(
            engine, self.models, online_renderer=renderer, request_logger=None)
        self.tokenization = ServingTokenization(
            self.models, renderer, chat_template=template, chat_template_content_format="auto")

    def install(self, app: Any) -> None:
        from fastapi.responses import JSONResponse

        server = self.server
        # the token, as a dependency of every route here: a 401 in OpenAI's shape
        auth = token_required(server, lambda exc: BadBody(exc.status, exc.message))

        async def refused(request: Request, exc: BadBody):
            await drain(request, server.limits)  # the connection stays usable
            return self._refusal(exc)

        app.add_exception_handler(BadBody, refused)

        async def models(request: Request, client: Any = auth):
            try:
                self._preset(request, client)
            except Refused as exc:
                return self._refusal(exc)
            listed = (await self.models.show_available_models()).model_dump()
            want = request.path_params.get("model_id")
            if want is None:
                return JSONResponse(listed)
            for card in listed["data"]:  # a path as the id: its leading "/" is optional
                if card["id"] == want or card["id"].lstrip("/") == want.lstrip("/"):
                    return JSONResponse(card)
            return JSONResponse(error_json(404, f"The model `{want}` does not exist."), 404)

        async def chat(request: Request, client: Any = auth):
            return await self._call(request, client, chat=True)

        async def completions(request: Request, client: Any = auth):
            return await self._call(request, client, chat=False)

        async def register(request: Request, client: Any = auth):
            return await self._register(request, client)

        for prefix in ("", "/presets/{preset}"):
            app.add_api_route(prefix + "/v1/models", models, methods=["GET"])
            app.add_api_route(prefix + "/v1/models/{model_id:path}", models, methods=["GET"])
            app.add_api_route(prefix + "/v1/chat/completions", chat, methods=["POST"],
                              summary="vLLM's chat completions, with a `vlens` object")
            app.add_api_route(prefix + "/v1/completions", completions, methods=["POST"],
                              summary="vLLM's completions, with a `vlens` object")
        app.add_api_route("/tokenize", self._tokenize, methods=["POST"], dependencies=[auth],
                          summary="vLLM's /tokenize (token)")
        app.add_api_route("/detokenize", self._tokenize, methods=["POST"], dependencies=[auth],
                          summary="vLLM's /detokenize (token)")
        app.add_api_route("/v1/presets", register, methods=["POST"],
                          summary="keep a `vlens` object as a preset of your own")
        self.bodies = {"/v1/chat/completions": ChatBody, "/v1/completions": CompletionBody,
                       "/v1/presets": PresetBody}

    # -- helpers ----------------------------------------------------------------
    def _refusal(self, exc: Refused):
        from fastapi.responses import JSONResponse

        self.server.metrics.refused(exc.status, _reason(exc))
        return JSONResponse(error_json(exc.status, exc.message, getattr(exc, "param", None)),
                            exc.status, headers=exc.headers)

    def _check_prompts(self, body: dict[str, Any]) -> None:
        """A completion's ``prompt`` list holds at most ``--max-requests``
        prompts (a list of ints is one prompt, as token ids), as a
        ``/v1/generate`` call holds at most that many requests."""
        prompt, most = body.get("prompt"), self.server.limits.requests
        if isinstance(prompt, list) and prompt and not all(
                isinstance(x, int) and not isinstance(x, bool) for x in prompt) \
                and len(prompt) > most:
            raise BadBody(400, f"prompt holds {len(prompt)} prompts; this server takes at most "
                               f"{most} in one call (vlens serve --max-requests)", "prompt")

    def _preset(self, request: Any, client: Any) -> dict[str, Any] | None:
        name = request.path_params.get("preset")
        if name is None:
            return None
        found = self.server.presets.get(client.name, name)
        if found is None:
            raise BadBody(404, f"no preset named {name[:64]!r}; this server has "
                               f"{self.server.presets.names(client.name) or 'none'} "
                               "(vlens serve --preset NAME=FILE, or s.register_preset)")
        return found

    async def _json(self, request: Any) -> dict[str, Any]:
        raw = await read_body(request, self.server.limits.body_bytes,
                              self.server.limits.body_seconds, "application/json")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadBody(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadBody(400, "the body must be a JSON object")
        return body

    # -- routes -----------------------------------------------------------------
    async def _tokenize(self, request: Request):
        from fastapi.responses import JSONResponse
        from pydantic import ValidationError
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

        detok = request.url.path.endswith("/detokenize")
        try:
            body = await self._json(request)
        except Refused as exc:
            return self._refusal(exc)
        try:
            req = TypeAdapter(DetokenizeRequest if detok else TokenizeRequest).validate_python(
                body)
        except ValidationError as exc:
            return await vllm_validation_error(request, _body_errors(exc))
        try:
            out = await (self.tokenization.create_detokenize(req, request) if detok else
                         self.tokenization.create_tokenize(req, request))
        except Exception as exc:  # noqa: BLE001 - answered as vllm serve answers it
            status, err = vllm_error(exc)
            return JSONResponse(err, status)
        if isinstance(out, ErrorResponse):
            return JSONResponse(out.model_dump(), out.error.code)
        return JSONResponse(out.model_dump())

    async def _register(self, request: Any, client: Any):
        from fastapi.responses import JSONResponse

        server = self.server
        try:
            body = await self._json(request)
            if set(body) != {"name", "vlens"}:
                raise BadBody(400, "send {\"name\": NAME, \"vlens\": {...}}")
            names = server.names
            held = server.presets.register(client.name, body["name"], body["vlens"], lambda b: (
                parse_body(b, server.facts, lambda n: names.vector(client.name, n),
                           names.saes.get)))
        except Refused as exc:
            return self._refusal(exc)
        except BodyError as exc:
            return JSONResponse(error_json(400, str(exc), exc.field), 400)
        except VlensError as exc:
            return JSONResponse(error_json(400, str(exc), "name"), 400)
        return JSONResponse({"name": body["name"], "your_presets": held})

    async def _call(self, request: Any, client: Any, chat: bool):
        from fastapi.responses import JSONResponse
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        server = self.server
        held = None
        try:
            body = await self._json(request)
            if not chat:
                self._check_prompts(body)
            preset = self._preset(request, client)
            raw_vlens = body.pop("vlens", None)
            if preset is not None:
                raw_vlens = merge(preset, raw_vlens)
            names = server.names
            edits = parse_body(raw_vlens, server.facts, lambda n: names.vector(client.name, n),
                               names.saes.get)
            kind = ChatCompletionRequest if chat else CompletionRequest
            try:
                req = kind.model_validate(body)
            except ValidationError as exc:
                server.metrics.refused(400, "validation")
                return await vllm_validation_error(request, _body_errors(exc))
            await server.admit(client)  # waits in line for a slot
            held = client
            started = time.monotonic()
            token = PENDING.set(Pending(client, edits, req if chat else None))
            try:
                handler = self.chat.create_chat_completion if chat else (
                    self.completion.create_completion)
                result = await handler(req, request)
            except (Refused, VlensError):
                raise
            except Exception as exc:  # noqa: BLE001 - answered as vllm serve answers it
                self._free(held)
                status, err = vllm_error(exc)
                server.metrics.refused(status, "vllm")
                return JSONResponse(err, status)
            finally:
                PENDING.reset(token)
        except BodyError as exc:
            self._free(held)
            server.metrics.refused(400, "vlens_body")
            return JSONResponse(error_json(400, str(exc), exc.field), 400)
        except Refused as exc:
            self._free(held)
            return self._refusal(exc)
        except VlensError as exc:
            self._free(held)
            server.metrics.refused(400, "vlens")
            return JSONResponse(error_json(400, str(exc)), 400)
        except BaseException:
            self._free(held)
            raise
        if isinstance(result, ErrorResponse):
            self._free(held)
            server.metrics.refused(result.error.code, "vllm")
            return JSONResponse(result.model_dump(), result.error.code)
        server.metrics.edits(any(type(e).__name__ != "Clamp" for e in edits.steers),
                             bool(edits.ablates),
                             any(type(e).__name__ == "Clamp" for e in edits.steers))
        if not hasattr(result, "__aiter__"):
            self._free(held, started)
            return JSONResponse(result.model_dump())
        return self._stream(result, held, started)

    def _stream(self, result: Any, held: Any, started: float):
        from fastapi.responses import StreamingResponse
        from starlette.background import BackgroundTask

        began = []

        async def events():
            began.append(True)
            try:
                async for chunk in result:
                    yield chunk
            finally:
                self._free(held, started)

        def never_started() -> None:  # the client left before the first event
            if not began:
                self._free(held, started)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 background=BackgroundTask(never_started))

    def _free(self, client: Any, started: float | None = None) -> None:
        if client is not None:
            self.server.release(client)
            if started is not None:
                self.server.slots.ran(time.monotonic() - started)


def _body_errors(exc: Any) -> list[dict[str, Any]]:
    """pydantic's errors located in the body, as FastAPI reports them."""
    return [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)]


def _reason(exc: Refused) -> str:
    return {401: "token", 404: "not_found", 408: "body_timeout", 413: "too_large",
            415: "content_type", 429: "queue", 503: "busy"}.get(exc.status, "limit")
