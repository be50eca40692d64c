"""``vlens serve``'s command line: vLLM's engine flags plus vlens's own,
the engine started through the same start-up as a Session's
(``engine/startup.py``), then the HTTP app (``server.py``) served by
uvicorn.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from vlens.checks import ModelFacts
from vlens.errors import VlensError
from vlens.models.recipes import is_toyworld
from vlens.remote.schema import parse_body
from vlens.remote.guard import Limits
from vlens.remote.heads import http_protocol
from vlens.remote.names import ServerNames, parse_named
from vlens.remote.openai_routes import OpenAIRoutes
from vlens.remote.presets import Presets, load_presets
from vlens.remote.routes import install_docs
from vlens.remote.server import Server, make_app
from vlens.remote.tokens import load_tokens

__all__ = ["KEEP_ALIVE", "main", "is_loopback"]

#: seconds an idle connection is kept open between calls. A client reuses an
#: idle connection until its own expiry (httpx and the openai client, which
#: vlens.connect and most tools use: 5 s; aiohttp 15 s; reverse proxies 60 s
#: to 2 min). A server that closes first can close a connection while the
#: client's next request is on its way, and that request is lost
#: ("Server disconnected without sending a response"). Holding longer than
#: the clients do leaves the close to them. An idle connection costs one
#: socket.
KEEP_ALIVE = 150.0


def _positive_seconds(text: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def _parser():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(prog="vlens serve", description=(
        "Serve one model to many notebooks (vlens.connect). Every vLLM engine flag "
        "(--max-model-len, --tensor-parallel-size, ...) is accepted as well."))
    p.add_argument("model_tag", nargs="?", default=None,
                   help="a local model folder (default: the bundled toy-world model)")
    g = p.add_argument_group("vlens serve")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8765)
    g.add_argument("--token-file", required=True,
                   help="one client a line: 'NAME TOKEN' or 'TOKEN'")
    g.add_argument("--max-read-mb", type=float, default=256,
                   help="activations one call of a client may read (MiB)")
    g.add_argument("--max-concurrent", type=int, default=4, help="calls in flight per client")
    g.add_argument("--max-queued", type=int, default=64,
                   help="calls of one client waiting for a slot, in order (more: HTTP 429 "
                        "with Retry-After)")
    g.add_argument("--queue-timeout", type=float, default=600.0,
                   help="seconds a call may wait for a slot (then HTTP 429)")
    g.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="tokens per prompt (default: the model's max length)")
    g.add_argument("--max-requests", type=int, default=256, help="engine requests per call")
    g.add_argument("--max-body-mb", type=float, default=64, help="request body size (MiB)")
    g.add_argument("--max-calls", type=int, default=256, help="calls in flight, all clients")
    g.add_argument("--body-timeout", type=_positive_seconds, default=30.0,
                   help="seconds a client may take to send one request's head (its line "
                        "and headers), and as long again for its body")
    g.add_argument("--stall-timeout", type=float, default=30.0,
                   help="seconds a client may stop reading a call's answer before the call "
                        "is ended")
    g.add_argument("--vector", action="append", metavar="NAME=FILE", default=[],
                   help="a steering vector everyone may name (safetensors holding one "
                        "tensor, .pt or .npy); repeat for more")
    g.add_argument("--sae", action="append", metavar="NAME=PATH", default=[],
                   help="an SAE (as vlens.SAE.load reads it) everyone may name; repeat for more")
    g.add_argument("--preset", action="append", metavar="NAME=FILE", default=[],
                   help="a JSON vlens object served under /presets/NAME/v1 (every call "
                        "there is steered by it); repeat for more")
    g.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without a token")
    g.add_argument("--chat-template", default=None,
                   help="the chat template of the OpenAI chat route (a file or a Jinja "
                        "string; default: the tokenizer's)")
    g.add_argument("--timeout-keep-alive", type=_positive_seconds, default=KEEP_ALIVE,
                   help="seconds an idle connection stays open between calls: longer than "
                        "clients keep theirs (httpx and openai 5 s, proxies up to 2 min), so "
                        "the client ends it and no call is sent on a closing connection")
    return AsyncEngineArgs.add_cli_args(p)


def _compiled(args: Any, argv: list[str]) -> bool:
    """Compiled unless --enforce-eager: vlens's worker class (its hooks go in
    before the model is traced) and, on a GPU, its operators cut out of the
    CUDA graphs (engine.compiled_settings)."""
    from vlens.engine.engine import compiled_settings

    if args.enforce_eager:
        return False
    out = compiled_settings(None)
    args.worker_cls = out["worker_cls"]
    if "compilation_config" in out:
        if any(a.startswith(("--compilation-config", "-O")) for a in argv):
            raise VlensError("a compilation config of your own cannot be combined with "
                             "vlens's compiled mode (it sets splitting_ops and the CUDA graph "
                             "mode): leave it out, or pass --enforce-eager")
        from vllm.config import CompilationConfig

        args.compilation_config = CompilationConfig(**out["compilation_config"])
    return True


async def _serve(args: Any, argv: list[str]) -> None:
    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from vlens.engine.env import apply_env_defaults, has_gpu, serve_threads
    from vlens.engine.startup import EXTENSION, Checkpoint, engine_info, resolve_model

    if any(a.startswith("--worker-extension-cls") or a.startswith("--worker-cls")
           for a in argv):
        raise VlensError("--worker-extension-cls / --worker-cls cannot be passed: "
                         "vlens sets its own")
    tokens = load_tokens(args.token_file)
    explicit = args.model_tag or (args.model if any(a.startswith("--model") for a in argv)
                                  else None)
    args.model = resolve_model(explicit)
    checkpoint = Checkpoint.check(args.model, args.model_impl)
    if not any(a.startswith("--dtype") for a in argv) and checkpoint.default_dtype is not None:
        args.dtype = checkpoint.default_dtype
    args.worker_extension_cls = EXTENSION
    compiled = _compiled(args, argv)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    apply_env_defaults({"kv_cache_memory_bytes": engine_args.kv_cache_memory_bytes})
    threads = serve_threads()
    llm = AsyncLLM.from_engine_args(engine_args)
    try:
        setup = (await llm.collective_rpc("vlens_setup"))[0]
        info = engine_info(setup, llm.model_config, llm.vllm_config, compiled=compiled,
                           checkpoint=checkpoint)
        info["toyworld"] = is_toyworld(args.model)  # the widgets' tested recipe applies
        limits = Limits(
            read_bytes=int(args.max_read_mb * 2**20), concurrent=args.max_concurrent,
            queued=args.max_queued, queue_seconds=args.queue_timeout,
            prompt_tokens=args.max_prompt_tokens or info["max_model_len"],
            requests=args.max_requests, body_bytes=int(args.max_body_mb * 2**20),
            body_seconds=args.body_timeout, stall_seconds=args.stall_timeout)
        facts = ModelFacts.from_info(info)
        names = ServerNames.load(parse_named(args.vector, "--vector"),
                                 parse_named(args.sae, "--sae"), facts, limits.vectors)
        if names.saes:  # in the workers for good: plans name them by id
            await llm.collective_rpc("vlens_put_saes", args=(
                {s.id: s.payload() for s in names.saes.values()},))
        presets = Presets(load_presets(parse_named(args.preset, "--preset"), lambda b: (
            parse_body(b, facts, lambda n: names.vector("", n), names.saes.get))))
        server = Server(llm, info, tokens, limits, args.model, args.max_calls, args.token_file,
                        names, presets)
        app = make_app(server, args.metrics_public)
        named = args.served_model_name
        served = (named[0] if isinstance(named, list) and named else named) or args.model
        routes = OpenAIRoutes(server, served, args.chat_template)
        routes.install(app)
        install_docs(app, routes.bodies, server)
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level="warning", timeout_graceful_shutdown=5,
                                timeout_keep_alive=args.timeout_keep_alive,
                                http=http_protocol(args.body_timeout))
        mode = ("compiled (CUDA graphs)" if compiled and has_gpu() else "compiled (torch.compile)"
                if compiled else "eager (--enforce-eager)")
        if threads is not None:
            mode += f", {threads} engine thread{'s' if threads > 1 else ''} (OMP_NUM_THREADS)"
        print(f"vlens serve: {Path(args.model).name} on http://{args.host}:{args.port} "
              f"for {len(tokens)} client(s), {mode}; OpenAI routes at /v1 as model {served!r}"
              + (f"; vectors {sorted(names.vectors)}" if names.vectors else "")
              + (f"; SAEs {sorted(names.saes)}" if names.saes else "")
              + (f"; presets {sorted(presets.served)}" if presets.served else ""), flush=True)
        if not is_loopback(args.host):
            print(f"vlens serve: warning: {args.host} is reachable from other machines and "
                  "this server speaks plain HTTP: tokens and results cross the network "
                  "unencrypted. Put TLS in front of it (a reverse proxy such as caddy or "
                  "nginx; docs/workshop.md), or serve on 127.0.0.1 over an SSH tunnel",
                  file=sys.stderr, flush=True)
        await uvicorn.Server(config).serve()
    finally:
        llm.shutdown()


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        asyncio.run(_serve(args, argv))
    except VlensError as exc:
        print(f"vlens serve: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (or SIGINT) after the engine shut down: a normal stop
        print("vlens serve: stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
