"""Throughput of connected clients (``vlens serve`` + ``vlens.connect``)
against the same calls on an in-process Session.

    python benchmarks/serve.py [--model PATH] [--clients 1,4,16] [--calls 3] [--json FILE]

Starts ``vlens serve`` on loopback (a subprocess) and a local Session of the
same model in this process. For each client count N, N threads each make
``--calls`` calls (a trace of 2 prompts reading one layer, 16 new tokens),
once through N connections to the server and once on the local Session
(whose calls run one after another: one Session runs one batch at a time).
Prints one line per N and, with --json, writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(url: str, token: str, proc: subprocess.Popen, log: Path, limit: float = 300) -> None:
    import httpx

    end = time.monotonic() + limit
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"vlens serve exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/v1/info", headers={"Authorization": f"Bearer {token}"}).is_success:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("vlens serve did not start")


def _rounds(sessions: list, calls: int, prompts: list[str], new_tokens: int) -> tuple[float, int]:
    """Every session's calls in its own thread; (seconds, tokens generated)."""
    counts = [0] * len(sessions)
    barrier = threading.Barrier(len(sessions) + 1)

    def work(i: int) -> None:
        s = sessions[i]
        barrier.wait()
        for c in range(calls):
            k = (i + c) % (len(prompts) - 1)
            run = s.trace(prompts[k:k + 2], layers=[1], max_new_tokens=new_tokens,
                          logprobs=False)
            counts[i] += sum(len(t.output_token_ids) for t in run)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(counts)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local model folder (default: bundled)")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--calls", type=int, default=8, help="calls per client")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per prompt")
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.clients.split(",")]
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vlens
    from vlens.models.world import example_prompts

    prompts = example_prompts(8)
    kv = args.kv_cache_mb * 2**20
    folder = Path(tempfile.mkdtemp(prefix="vlens-serve-bench-"))
    tokens = [secrets.token_urlsafe(18) for _ in range(max(counts))]
    (folder / "tokens").write_text("".join(f"b{i} {t}\n" for i, t in enumerate(tokens)))
    port = _port()
    url = f"http://127.0.0.1:{port}"
    log = folder / "server.log"
    cmd = [sys.executable, "-m", "vlens.cli", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--token-file", str(folder / "tokens"),
           "--kv-cache-memory-bytes", str(kv)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    out: dict = {"model": Path(args.model).name if args.model else "bundled toy-world", "calls_per_client": args.calls,
                 "call": f"trace of 2 prompts, one layer read, {args.tokens} new tokens",
                 "rows": []}
    try:
        _wait(url, tokens[0], proc, log)
        local = vlens.Session(args.model, kv_cache_memory_bytes=kv)
        remote = [vlens.connect(url, token=t) for t in tokens[:max(counts)]]
        _rounds(remote[:1], 1, prompts, args.tokens)  # warm both
        _rounds([local], 1, prompts, args.tokens)
        for n in counts:
            r_s, r_tok = _rounds(remote[:n], args.calls, prompts, args.tokens)
            l_s, l_tok = _rounds([local] * n, args.calls, prompts, args.tokens)
            row = {"clients": n, "remote_tok_s": round(r_tok / r_s, 1),
                   "local_tok_s": round(l_tok / l_s, 1), "remote_s": round(r_s, 2),
                   "local_s": round(l_s, 2), "ratio": round((r_tok / r_s) / (l_tok / l_s), 2)}
            out["rows"].append(row)
            print(f"{n:>3} clients: connected {row['remote_tok_s']:>7.1f} tok/s, in-process "
                  f"{row['local_tok_s']:>7.1f} tok/s (x{row['ratio']})", flush=True)
        for s in remote:
            s.close()
        local.close()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
