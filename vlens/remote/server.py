"""``vlens serve``: one vLLM engine with vlens's hooks, shared over HTTP by
many notebooks (``vlens.connect``).

One process holds one vLLM ``AsyncLLM`` (vLLM's own engine arguments pass
through as its command-line flags) and a small FastAPI app served by
uvicorn. Every call carries a bearer token; each token is one client, whose
plans are re-checked (``guard.py``) and whose tags and vector ids are
prefixed with its name before anything reaches the engine. A call runs its
requests in the shared engine (continuous batching mixes them with other
clients' requests step by step), collects its records at the end and sends
everything back as frames (``wire.py``); when the call ends, however it
ends (finished, failed, client gone), its requests are aborted and its
records dropped, so the server holds nothing of a client between calls but
a bounded cache of its steering vectors.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request  # module level: FastAPI reads the routes' annotations here

import vlens
from vlens.checks import ModelFacts
from vlens.edits import engine_prompt
from vlens.errors import VlensError
from vlens.protocol.plan import PLAN_KEY, parse_plan
from vlens.protocol.tensors import decode_tensor
from vlens.remote.bodies import drain, read_body
from vlens.remote.schema import BodyError
from vlens.remote.errors import guarded_route, install as install_errors
from vlens.remote.guard import Checked, Limits, Refused, check_call, check_vector
from vlens.remote.metrics import Metrics
from vlens.remote.names import ServerNames
from vlens.remote.presets import Presets
from vlens.remote.routes import install_routes, token_required
from vlens.remote.slots import Slots, Waiting
from vlens.remote.tokens import TokenFile
from vlens.remote.wire import FRAME_TYPE, WireError, logprobs_to_wire, pack, unpack_one

__all__ = ["Server", "make_app"]

# files a client needs to rebuild the tokenizer locally
_TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|"
    r"config\.json|generation_config\.json|chat_template.*|.*\.tiktoken)$")


@dataclass
class _Client:
    name: str
    slot: Waiting = field(default_factory=Waiting)  # calls running and waiting
    vectors: OrderedDict[str, int] = field(default_factory=OrderedDict)  # id -> pins

    @property
    def active(self) -> int:
        return self.slot.active


class Server:
    """The engine, the clients and the limits behind the HTTP routes."""

    def __init__(self, llm: Any, info: dict[str, Any], tokens: dict[str, str], limits: Limits,
                 model_dir: str, max_calls: int, token_file: str | None = None,
                 names: Any = None, presets: Presets | None = None) -> None:
        self.llm = llm
        self.info = info
        self.facts = ModelFacts.from_info(info)
        self.limits = limits
        self.model_dir = model_dir
        self.instance = uuid.uuid4().hex[:12]
        self.tokens = TokenFile(tokens, token_file)
        self.clients = {name: _Client(name) for name in tokens.values()}
        self.slots = Slots(limits, max_calls)
        self.calls_done = 0
        self.metrics = Metrics()
        #: named vlens objects served under /presets/NAME/v1 (--preset, s.register_preset)
        self.presets = presets if presets is not None else Presets()
        self._vector_lock = asyncio.Lock()
        self._status_task: asyncio.Future | None = None  # the status call under way
        self._tokenizer: bytes | None = None  # the packed files, read once
        self.stalled = 0  # streams aborted because their reader stopped reading
        #: the named vectors and SAEs (--vector, --sae, s.register_vector)
        self.names = names if names is not None else ServerNames({}, {}, limits.vectors)

    def authenticate(self, header: str | None) -> _Client:
        for name in self.tokens.reload():  # a changed token file: new names are clients
            self.clients.setdefault(name, _Client(name))
        if not header or not header.startswith("Bearer "):
            raise Refused(401, "no token: pass vlens.connect(url, token=...) "
                               "(or set VLENS_TOKEN)")
        given = header[len("Bearer "):].encode()
        found = None
        for token, name in self.tokens.pairs:  # every token compared, in constant time
            if hmac.compare_digest(given, token):
                found = name
        if found is None:
            raise Refused(401, "this token is not accepted by the server: check it "
                               "with whoever runs the workshop")
        return self.clients[found]

    # -- steering vectors, cached per client -------------------------------------
    async def hold_vectors(self, client: _Client, vectors: dict[str, Any]) -> None:
        """Make sure the workers hold ``vectors`` for the client's call (pinned)."""
        async with self._vector_lock:
            missing = {k: v for k, v in vectors.items() if k not in client.vectors}
            if missing:
                await self.llm.collective_rpc("vlens_put_vectors", args=(missing,))
            for k in vectors:
                client.vectors[k] = client.vectors.get(k, 0) + 1
                client.vectors.move_to_end(k)

    async def release_vectors(self, client: _Client, vectors: dict[str, Any]) -> None:
        """Unpin a call's vectors; past the client's cap, drop its unpinned ones."""
        async with self._vector_lock:
            for k in vectors:
                if k in client.vectors:
                    client.vectors[k] -= 1
            excess = len(client.vectors) - self.limits.vectors
            gone = [k for k, pins in client.vectors.items() if pins <= 0][:max(excess, 0)]
            if gone:
                await self.llm.collective_rpc("vlens_drop_vectors", args=(gone,))
                for k in gone:
                    del client.vectors[k]

    def tokenizer_frame(self) -> bytes:
        """The model folder's tokenizer files, packed (read once: the folder
        does not change)."""
        if self._tokenizer is None:
            folder = Path(self.model_dir)
            files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())
                     if p.is_file() and _TOKENIZER_FILES.match(p.name)
                     and p.stat().st_size < 64 * 2**20} if folder.is_dir() else {}
            self._tokenizer = pack({"files": files})
        return self._tokenizer

    # -- one call ---------------------------------------------------------------
    @property
    def calls(self) -> int:
        """Calls running, all clients."""
        return self.slots.calls

    async def admit(self, client: _Client) -> None:
        """One of the client's call slots, waiting in line for it if all are
        taken (:mod:`vlens.remote.slots`); :class:`Refused` past the line."""
        await self.slots.take(client.slot)

    def release(self, client: _Client) -> None:
        """Give back a slot :meth:`admit` took (to the client's next waiting call)."""
        self.slots.give(client.slot)

    async def run(self, client: _Client, call: Checked, stream: bool):
        """The frames of one admitted call (an async iterator of bytes)."""
        n = len(call.ids)
        rids = [f"{client.name}-{uuid.uuid4().hex[:12]}-{i}" for i in range(n)]
        tags = sorted({t for t in call.tags if t is not None})
        queue: asyncio.Queue = asyncio.Queue()
        samples: list[dict[int, Any]] = [{} for _ in range(n)]
        prompt_lps: list[Any] = [None] * n
        finished = [False] * n
        tasks: list[asyncio.Task] = []

        async def pump(i: int) -> None:
            sp = call.params[i]
            plan = parse_plan(sp.extra_args[PLAN_KEY]) if sp.extra_args else None
            prompt = engine_prompt(call.ids[i], plan)
            try:
                async for out in self.llm.generate(prompt, sp, rids[i]):
                    queue.put_nowait((i, out))
            except Exception as exc:  # noqa: BLE001 - reported to the client
                queue.put_nowait((i, exc))
            queue.put_nowait((i, None))

        sent: list[dict[int, tuple[int, int]]] = [{} for _ in range(n)]  # tokens, chars
        sent_prompt = [False] * n

        def wire(i: int, delta: bool = False) -> dict[str, Any] | None:
            """Request i's outputs so far; ``delta``: only what the last
            frame did not carry (the client adds it to what it has)."""
            if not samples[i]:
                return None
            comps = [samples[i][k] for k in sorted(samples[i])]
            outs = []
            for c in comps:
                t0, c0 = sent[i].get(c.index, (0, 0)) if delta else (0, 0)
                ids = c.token_ids
                outs.append({"index": int(c.index), "text": c.text[c0:],
                             "token_ids": [int(t) for t in ids[t0:]],
                             "logprobs": logprobs_to_wire(c.logprobs[t0:]
                                                          if c.logprobs is not None else None),
                             "finish_reason": c.finish_reason})
                if delta:
                    sent[i][c.index] = (len(ids), len(c.text))
            lps = prompt_lps[i]
            if delta:
                lps, sent_prompt[i] = (None if sent_prompt[i] else lps), sent_prompt[i] or (
                    lps is not None)
            return {"finished": finished[i], "prompt_logprobs": logprobs_to_wire(lps),
                    "outputs": outs, **({"delta": True} if delta else {})}

        try:
            await self.hold_vectors(client, call.vectors)
            tasks = [asyncio.create_task(pump(i)) for i in range(n)]
            live = n
            while live:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                for i, out in batch:
                    if out is None:
                        live -= 1
                    elif isinstance(out, Exception):
                        raise out
                    else:
                        for c in out.outputs:
                            samples[i][c.index] = c
                        if out.prompt_logprobs is not None:
                            prompt_lps[i] = out.prompt_logprobs
                        want = call.params[i].n or 1
                        finished[i] = len(samples[i]) == want and all(
                            c.finish_reason is not None for c in samples[i].values())
                if stream and live:
                    yield pack({"kind": "step", "outputs": [wire(i, True) for i in range(n)]})
            records = {}
            if tags:
                got = (await self.llm.collective_rpc("vlens_collect", args=(tags,)))[0]
                records = {t.rsplit("/", 1)[1]: recs for t, recs in got.items()}
            self.calls_done += 1
            yield pack({"kind": "done", "outputs": [wire(i) for i in range(n)],
                        "records": records})
        except Exception as exc:  # noqa: BLE001 - the engine failed this call
            yield pack({"kind": "error", "message": f"{type(exc).__name__}: {exc}"})
        finally:
            import anyio

            # runs when the client went away too: shielded, or the
            # cancellation that ended the call would also end the clean-up
            with anyio.CancelScope(shield=True):
                for t in tasks:
                    t.cancel()
                try:
                    await self.llm.abort(rids)
                    if tags:
                        await self.llm.collective_rpc("vlens_drop", args=(tags,))
                    await self.release_vectors(client, call.vectors)
                finally:
                    self.release(client)

    async def worker_status(self) -> dict[str, Any]:
        """The workers' status. One engine call at a time, whoever asks:
        a request arriving while one is under way shares its answer, so a
        flood of status polls cannot queue engine calls (and an answer is
        never older than the call that was running when it was asked for)."""
        task = self._status_task
        if task is None or task.done():
            task = self._status_task = asyncio.ensure_future(
                self.llm.collective_rpc("vlens_status"))
        return (await asyncio.shield(task))[0]

    async def status(self, client: _Client) -> dict[str, Any]:
        worker = await self.worker_status()
        return {
            **{k: worker[k] for k in ("records", "plans", "vectors", "vector_bytes",
                                      "hook_errors", "nonfinite_writes", "steps_seen", "steps_planned", "hooks",
                                      "edit_fns")},
            "unfinished": int(self.llm.output_processor.get_num_unfinished_requests()),
            "calls": self.calls,
            "queued": self.slots.queued,
            "calls_done": self.calls_done,
            "stalled": self.stalled,
            "your_calls": client.active,
            "your_vectors": len(client.vectors),
            "server": self.instance,
        }


def _stream_class():
    from starlette.responses import StreamingResponse

    class TimedStream(StreamingResponse):
        """One call's frames, each of which must leave within ``stall``
        seconds: a reader that stopped reading ends the call (its generator
        is closed: requests aborted, records dropped, slot given back).
        Starlette's own part stays: a client that goes away cancels it."""

        def __init__(self, frames: Any, server: Server, client: _Client, stall: float) -> None:
            super().__init__(frames, media_type=FRAME_TYPE)
            self.frames = frames
            self.server = server
            self.client = client
            self.stall = stall

        async def stream_response(self, send: Any) -> None:
            entered = False  # run() began: its own clean-up gives the slot back
            try:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                entered = True  # awaiting the first frame runs run() into its try
                async for frame in self.frames:
                    await asyncio.wait_for(send({"type": "http.response.body", "body": frame,
                                                 "more_body": True}), self.stall)
                await asyncio.wait_for(send({"type": "http.response.body", "body": b"",
                                             "more_body": False}), self.stall)
            except asyncio.TimeoutError:
                self.server.stalled += 1  # the connection closes unfinished
            finally:
                if not entered:
                    # never started (the client left first): run() never took
                    # over the slot, so give it back here
                    self.server.release(self.client)
                await self.frames.aclose()

    return TimedStream


def _named_routes(app: Any, server: Server, who: Any) -> None:
    """A served SAE's weights, and a participant's own named vectors."""
    from fastapi.responses import Response

    @app.get("/v1/saes/{name}", dependencies=[who])
    async def sae(name: str, request: Request):
        payload = server.names.sae_payload(name)
        if payload is None:
            raise Refused(404, f"this server has no SAE {name[:64]!r}; it has "
                               f"{sorted(server.names.saes) or 'none'}")
        return Response(pack(payload), media_type=FRAME_TYPE)

    @app.post("/v1/vectors")
    async def register(request: Request, client: Any = who):
        raw = await read_body(request, server.limits.body_bytes, server.limits.body_seconds)
        try:
            body = unpack_one(raw, max_containers=16)
            if not isinstance(body, dict) or set(body) != {"name", "vector"}:
                raise Refused(400, "send {name, vector}")
            vid = body["vector"].get("id") if isinstance(body["vector"], dict) else None
            payload = {k: v for k, v in body["vector"].items() if k != "id"} if vid else None
            widths = {server.facts.width(site) for site in server.facts.writable}
            check_vector(vid, payload, widths)
            held = server.names.register(client.name, body["name"], decode_tensor(payload),
                                         server.facts)
        except Refused:
            raise
        except WireError as exc:
            raise Refused(400, f"unreadable frame: {exc}") from None
        except VlensError as exc:
            raise Refused(400, str(exc)) from None
        return {"name": body["name"], "your_vectors": held}


def make_app(server: Server, metrics_public: bool = False):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    from pydantic import ValidationError

    app = FastAPI(title="vlens serve", docs_url=None, redoc_url=None, openapi_url=None)
    from vllm.exceptions import VLLMError

    # an exception a route raises: a client's error (vlens's checks, validation)
    # answered as such, vLLM's own errors as vllm serve answers them (its
    # client errors 4xx, its server errors 5xx), anything else a 500 with an
    # id in the log
    app.router.route_class = guarded_route((Refused, VlensError, BodyError, WireError,
                                            ValidationError, VLLMError))
    install_errors(app)
    install_routes(app, server, metrics_public)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused):
        await drain(request, server.limits)
        server.metrics.refused(exc.status, "vlens")
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)

    who = token_required(server)  # every route but /health, /ping and /version

    @app.get("/v1/info", dependencies=[who])
    async def info(request: Request):
        return {"model": server.info, "model_name": Path(server.model_dir).name,
                "limits": server.limits.public(), "server": server.instance,
                **server.names.public(),
                "vlens": getattr(vlens, "__version__", "0")}

    @app.get("/v1/tokenizer", dependencies=[who])
    async def tokenizer(request: Request):
        return Response(server.tokenizer_frame(), media_type=FRAME_TYPE)

    @app.get("/v1/status")
    async def status(request: Request, client: Any = who):
        return await server.status(client)

    def parse(raw: bytes, client: _Client) -> tuple[Any, Checked]:
        try:
            # a call's header: per request its ids, params and plan (at most ~550
            # lists and objects at the plan limits)
            body = unpack_one(raw, max_containers=600 * server.limits.requests + 4096)
            return body, check_call(body, server.facts, server.limits, client.name,
                                    uuid.uuid4().hex[:12], server.names.check_plan_saes)
        except Refused:
            raise
        except WireError as exc:
            raise Refused(400, f"unreadable frame: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - anything odd a client sends is its error
            raise Refused(400, f"malformed call: {type(exc).__name__}: {exc}") from None

    _named_routes(app, server, who)

    @app.post("/v1/generate")
    async def generate(request: Request, client: Any = who):
        # the slot is taken before the body is read: a client's bodies in
        # flight count against its calls at once, and each has a deadline
        await server.admit(client)
        try:
            raw = await read_body(request, server.limits.body_bytes,
                                   server.limits.body_seconds)
            # parsed and checked off the event loop: other clients' frames flow
            body, call = await asyncio.to_thread(parse, raw, client)
        except BaseException:
            server.release(client)
            raise
        return _stream_class()(server.run(client, call, bool(body.get("stream"))), server,
                               client, server.limits.stall_seconds)

    return app
