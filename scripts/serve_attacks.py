"""What one hostile participant costs a well-behaved one on ``vlens serve``.

Starts a server on loopback (the bundled model unless a model folder is
given), measures a well-behaved client's call (a short traced generation)
on the idle server, then again while each attack runs beside it, and prints
that client's median latency as a ratio to its idle value (the goal: at
most 2x). Each attack is what issue #28 saw stall or spoil the server:

    python scripts/serve_attacks.py [MODEL] [--seconds 6]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, model: str | None, folder: Path) -> None:
        self.tokens = {f"p{i}": f"bench-token-{i}-" + os.urandom(8).hex() for i in range(4)}
        path = folder / "tokens"
        path.write_text("".join(f"{n} {t}\n" for n, t in self.tokens.items()))
        path.chmod(0o600)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "vlens.cli", "serve", *([model] if model else []),
                "--port", str(self.port), "--token-file", str(path),
                "--kv-cache-memory-bytes", str(256 * 2**20), "--max-body-mb", "16",
                "--body-timeout", "5", "--stall-timeout", "5"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(args, env=env, stdout=(folder / "log").open("wb"),
                                     stderr=subprocess.STDOUT)
        import httpx

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (folder / "log").read_text()[-2000:]
            try:
                if httpx.get(self.url + "/v1/info", headers=self.auth("p0")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise RuntimeError("the server did not start")

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Endpoint:
    """What an attacker process needs of the server (picklable)."""

    def __init__(self, server: Server) -> None:
        self.url, self.port, self.tokens = server.url, server.port, server.tokens

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}


def _post(server: Endpoint, body: bytes, who: str = "p1", timeout: float = 60):
    import httpx

    from vlens.remote.wire import FRAME_TYPE

    return httpx.post(server.url + "/v1/generate", content=body, timeout=timeout,
                      headers={**server.auth(who), "Content-Type": FRAME_TYPE})


def _plan_body(ids: list[int], plan: dict, n_requests: int = 1, stream: bool = False,
               **params) -> bytes:
    from vllm import SamplingParams

    from vlens.protocol.plan import parse_plan
    from vlens.remote.wire import pack, params_to_wire

    plan = {"v": 4, "tag": "a-0", "index": 0, "clone": False, "prompt_len": len(ids),
            "reads": [], "adds": [], "sets": [], "edits": [], **plan}
    sp = SamplingParams(skip_reading_prefix_cache=True,
                        extra_args={"vlens": parse_plan(plan).to_wire()},
                        **{"max_tokens": 3, "temperature": 0.0, **params})
    return pack({"requests": [{"ids": ids, "params": params_to_wire(sp)}] * n_requests,
                 "vectors": {}, "stream": stream})


def attacks(server: Endpoint) -> dict:
    """name -> a function run over and over while the victim measures (in
    a process of its own: the attacker's own Python work must not slow the
    victim's client)."""
    import vlens
    from vlens.remote.wire import FRAME_TYPE

    attacker = vlens.connect(server.url, token=server.tokens["p2"])
    s = attacker
    ids = s.tokenize("the wind was")
    layers = list(range(s.n_layers))
    head = b"[" + b"[]," * (5 * 2**20) + b"[]]"  # 5 million empty lists
    frame = (len(head)).to_bytes(4, "little") + (0).to_bytes(4, "little") + head
    nested_body = len(frame).to_bytes(8, "little") + frame
    d = s.direction(["a happy fox"], ["a sad fox"], layer=1)
    wild = [vlens.Steer(d, layer=layer, scale=100.0, relative=True, site=site)
            for layer in range(s.n_layers)
            for site in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")]

    def nested_lists():
        _post(server, nested_body)

    def many_reads():
        read = {"site": "resid_post", "layers": [0], "reduce": "logit_lens", "k": 5}
        _post(server, _plan_body(ids, {"reads": [read] * 20_000}))

    def many_samples():
        _post(server, _plan_body(ids, {}, n_requests=64, n=16, max_tokens=64,
                                 temperature=1.0))

    def slow_bodies():
        socks = []
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall((f"POST /v1/generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                          f"{server.tokens['p1']}\r\nContent-Type: {FRAME_TYPE}\r\n"
                          f"Content-Length: {40 * 2**20}\r\n\r\n").encode() + b"\0" * 2**20)
            socks.append(sock)
        time.sleep(6)
        for sock in socks:
            sock.close()

    def stalled_stream():
        reads = [{"site": site, "layers": layers, "reduce": "full", "k": 0}
                 for site in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")]
        body = _plan_body(ids, {"reads": reads}, stream=True, max_tokens=400, ignore_eos=True)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall((f"POST /v1/generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{server.tokens['p1']}\r\nContent-Type: {FRAME_TYPE}\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        time.sleep(8)
        sock.close()

    def status_flood():
        import httpx

        for _ in range(50):
            httpx.get(server.url + "/v1/status", headers=server.auth("p1"))
            httpx.get(server.url + "/v1/tokenizer", headers=server.auth("p1"))

    def overflowing_steer():
        try:
            attacker.trace(["the wind was happy and"] * 2, steer=wild, max_new_tokens=8)
        except vlens.VlensError:
            pass

    def largest_allowed_call():  # not an attack: what the limits still let through
        attacker.trace(["the wind was cold and the sky was grey."] * 16, layers=None,
                       sites=["resid_post", "attn_out", "mlp_out"], max_new_tokens=32)

    return {"nested empty lists (16 MiB body)": nested_lists,
            "20,000 logit-lens reads in one plan": many_reads,
            "64 prompts x n=16": many_samples,
            "4 bodies trickling in (40 MiB each)": slow_bodies,
            "a stream nobody reads (large reads)": stalled_stream,
            "/v1/status and /v1/tokenizer flood": status_flood,
            "overflowing steer (30 relative adds)": overflowing_steer,
            "largest call within the limits": largest_allowed_call}


NAMES = ["nested empty lists (16 MiB body)", "20,000 logit-lens reads in one plan",
         "64 prompts x n=16", "4 bodies trickling in (40 MiB each)",
         "a stream nobody reads (large reads)", "/v1/status and /v1/tokenizer flood",
         "overflowing steer (30 relative adds)", "largest call within the limits"]


def _attack_loop(name: str, server: Endpoint, ready, stop) -> None:
    fn = attacks(server)[name]
    ready.set()
    while not stop.is_set():
        try:
            fn()
        except Exception:  # noqa: BLE001 - refused attacks raise; go on
            time.sleep(0.05)


def victim_latency(s, seconds: float) -> list[float]:
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(out) < 200:
        t0 = time.perf_counter()
        s.trace("the wind was", layers=[0], max_new_tokens=8)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    import vlens

    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--seconds", type=float, default=6.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="vlens-attacks-") as tmp:
        server = Server(args.model, Path(tmp))
        try:
            s = vlens.connect(server.url, token=server.tokens["p0"])
            victim_latency(s, 2)  # warm
            idle = statistics.median(victim_latency(s, args.seconds))
            print(f"idle: {idle * 1000:.0f} ms per call (median)")
            print(f"{'attack':42} {'idle':>8} {'median':>8} {'worst':>8} {'ratio':>6}")
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            for name in NAMES:
                # the idle figure again right before each attack: on a shared
                # machine the load drifts, and the ratio is to the nearest idle
                idle = statistics.median(victim_latency(s, args.seconds / 2))
                ready, stop = ctx.Event(), ctx.Event()
                proc = ctx.Process(target=_attack_loop, args=(name, Endpoint(server), ready, stop))
                proc.start()
                ready.wait(120)
                time.sleep(0.5)
                lat = victim_latency(s, args.seconds)
                stop.set()
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
                med = statistics.median(lat)
                print(f"{name:42} {idle * 1000:6.0f}ms {med * 1000:6.0f}ms "
                      f"{max(lat) * 1000:6.0f}ms {med / idle:5.2f}x", flush=True)
                time.sleep(1)
            st = s.status()
            print(f"after: calls {st['calls']}, records {st['records']}, unfinished "
                  f"{st['unfinished']}, stalled streams ended {st['stalled']}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
