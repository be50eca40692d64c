"""Clients of servers on loopback. ``serve``: N threads, each with its own
``vlens.connect`` to one ``vlens serve``, against the same calls on one
in-process Session. ``openai`` (``make bench-openai``): streamed steered chats
through the openai client, ``vlens serve`` against vLLM's own OpenAI server
(same model, dtype and environment), the sides taking turns within each repeat
so a busy machine slows every side alike (goal: steered <= 1.10x vLLM's time)."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"


def start(cmd: list[str], url: str, key: str, log: Path, env: dict, limit: float = 900) -> subprocess.Popen:
    """Start a server and wait until ``url`` answers with ``key``."""
    import httpx

    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**env, "PYTHONPATH": str(ROOT)})
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[:4]} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"{cmd[:4]} did not start:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def url_port() -> tuple[str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return f"http://127.0.0.1:{port}", port


def threads(n: int, work) -> float:
    """``work(i)`` in ``n`` threads started together; the seconds they took."""
    barrier = threading.Barrier(n + 1)

    def run(i: int) -> None:
        barrier.wait()
        work(i)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def serve(args) -> dict:
    import vlens
    from vlens.models.world import example_prompts

    counts = [int(x) for x in args.clients.split(",")]
    prompts, kv = example_prompts(8), args.kv_cache_mb * 2**20
    folder = Path(tempfile.mkdtemp(prefix="vlens-serve-bench-"))
    tokens = [secrets.token_urlsafe(18) for _ in range(max(counts))]
    (folder / "tokens").write_text("".join(f"b{i} {t}\n" for i, t in enumerate(tokens)))
    (folder / "tokens").chmod(0o600)  # vlens serve refuses a token file others can read
    url, port = url_port()
    proc = start([sys.executable, "-m", "vlens.cli", "serve", *([args.model] if args.model else []),
                  "--port", port, "--token-file", str(folder / "tokens"),
                  "--kv-cache-memory-bytes", str(kv)], url, tokens[0], folder / "server.log",
                 dict(os.environ))
    out: dict = {"model": Path(args.model).name if args.model else "bundled toy-world",
                 "calls_per_client": args.calls,
                 "call": f"trace of 2 prompts, one layer read, {args.tokens} new tokens", "rows": []}

    def rounds(sessions: list, calls: int) -> tuple[float, int]:
        done = [0] * len(sessions)

        def work(i: int) -> None:
            for c in range(calls):
                k = (i + c) % (len(prompts) - 1)
                run = sessions[i].trace(prompts[k:k + 2], layers=[1], max_new_tokens=args.tokens,
                                        logprobs=False)
                done[i] += sum(len(t.output_token_ids) for t in run)
        return threads(len(sessions), work), sum(done)

    try:
        local = vlens.Session(args.model, kv_cache_memory_bytes=kv)
        remote = [vlens.connect(url, token=t) for t in tokens]
        rounds(remote[:1], 1), rounds([local], 1)  # warm both
        for n in counts:
            r_s, r_tok = rounds(remote[:n], args.calls)
            l_s, l_tok = rounds([local] * n, args.calls)
            row = {"clients": n, "remote_tok_s": round(r_tok / r_s, 1),
                   "local_tok_s": round(l_tok / l_s, 1), "remote_s": round(r_s, 2),
                   "local_s": round(l_s, 2), "ratio": round((r_tok / r_s) / (l_tok / l_s), 2)}
            out["rows"].append(row)
            print(f"{n:>3} clients: connected {row['remote_tok_s']:>7.1f} tok/s, in-process "
                  f"{row['local_tok_s']:>7.1f} tok/s (x{row['ratio']})", flush=True)
        for s in [*remote, local]:
            s.close()
    finally:
        stop(proc)
    return out


def openai_throughput(args) -> dict:
    import json

    import openai
    import torch
    from safetensors.torch import save_file

    from vlens.engine.env import apply_env_defaults, serve_threads
    from vlens.engine.startup import Checkpoint, resolve_model
    from vlens.models.world import example_prompts

    model, before = resolve_model(args.model), dict(os.environ)
    apply_env_defaults({"kv_cache_memory_bytes": 256 * 2**20})  # what vlens serve sets
    serve_threads()
    env = {"vlens": dict(os.environ), "vllm": before if args.vllm_defaults else dict(os.environ)}
    tmp = Path(tempfile.mkdtemp(prefix="vlens-oai-bench-"))
    key = "bench-token-" + os.urandom(8).hex()
    (tmp / "tokens").write_text(f"bench {key}\n")
    (tmp / "tokens").chmod(0o600)
    (tmp / "template.jinja").write_text(TEMPLATE)
    hidden = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
    save_file({"v": torch.randn(hidden, generator=torch.Generator().manual_seed(0))},
              str(tmp / "mood.safetensors"))
    # the dtype vlens serve picks (float32 stays float32; vLLM alone would downcast)
    dtype = Checkpoint.check(model, "auto").default_dtype or "auto"
    common = ["--kv-cache-memory-bytes", str(256 * 2**20), "--chat-template",
              str(tmp / "template.jinja"), "--dtype", dtype] + (["--enforce-eager"] if args.eager else [])
    steer = {"steer": [{"vector": "mood", "layer": 1, "scale": 2.0}]}
    prompts, conc = example_prompts(16, seed=7), [int(c) for c in args.concurrency.split(",")]
    sides = {  # vLLM's OpenAI server is what `vllm serve` runs
        "vllm": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                 "--api-key", key],
        "vlens": [sys.executable, "-m", "vlens.cli", "serve", model, "--token-file",
                  str(tmp / "tokens"), "--vector", f"mood={tmp / 'mood.safetensors'}",
                  "--max-concurrent", str(max(conc) + 1)]}

    def load(url: str, n: int, calls: int, tokens: int, st: dict | None) -> float:
        name = openai.OpenAI(base_url=url + "/v1", api_key=key).models.list().data[0].id
        done = [0] * n

        def work(i: int) -> None:
            c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            for j in range(calls):
                for chunk in c.chat.completions.create(
                        model=name, messages=[{"role": "user", "content": prompts[(i + j) % len(prompts)]}],
                        max_tokens=tokens, temperature=0.0, stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True, **({"vlens": st} if st else {})}):
                    if chunk.usage is not None:
                        done[i] += chunk.usage.completion_tokens
        seconds = threads(n, work)  # runs the clients; done is filled in by then
        return sum(done) / seconds

    rates: dict[tuple[str, int], list[float]] = {}
    urls, procs = {}, []
    try:
        for name, cmd in sides.items():
            urls[name], port = url_port()
            t0 = time.monotonic()
            procs.append(start(cmd + ["--port", port] + common, urls[name], key, tmp / f"{name}.log",
                               env[name]))
            print(f"{name}: started in {time.monotonic() - t0:.0f} s", flush=True)
        runs = [("vllm", "vllm", None), ("vlens", "vlens", steer), ("vlens plain", "vlens", None)]
        for _, side, st in runs:
            load(urls[side], 1, 1, 4, st)  # warm
        for c in conc:
            for _ in range(args.repeats):
                for label, side, st in runs:  # taking turns: noise hits every side alike
                    rates.setdefault((label, c), []).append(load(
                        urls[side], c, max(args.calls, -(-args.min_calls // c)), args.tokens, st))
    finally:
        for proc in procs:
            stop(proc)
    print(f"\nsteered chat via openai, {args.tokens} tokens, {args.calls} chats per client "
          f"(at least {args.min_calls} in all), median of {args.repeats}, "
          f"{'eager' if args.eager else 'compiled'}, dtype {dtype}")
    for side in ("vllm", "vlens"):
        print(f"  {side} environment: " + ", ".join(
            f"{k}={env[side].get(k, '(unset)')}"
            for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_USE_V2_MODEL_RUNNER")))
    print(f"{'clients':>8} {'vllm tok/s':>11} {'vlens steered':>14} {'vlens plain':>12} "
          f"{'steered/vllm time':>18} {'plain/vllm time':>16}")
    out = {"rows": []}
    for c in conc:
        a, b, u = (statistics.median(rates[(k, c)]) for k in ("vllm", "vlens", "vlens plain"))
        print(f"{c:>8} {a:>11.1f} {b:>14.1f} {u:>12.1f} {a / (b or float('nan')):>17.2f}x "
              f"{a / (u or float('nan')):>15.2f}x")
        out["rows"].append({"clients": c, "vllm_tok_s": a, "vlens_steered_tok_s": b,
                            "vlens_plain_tok_s": u})
    return out
