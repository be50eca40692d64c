"""Steered chat throughput through the ``openai`` client: ``vlens serve``
against plain ``vllm serve`` on the same model and settings (#27,
acceptance 4; goal: vlens steered <= 1.10x plain vLLM's time).

Both servers run side by side on loopback (compiled, vLLM's default, unless
``--eager``); at each concurrency ``C`` (1, 8, 32) ``C`` threads each send
``--calls`` streamed chat completions of ``--tokens`` tokens
(``ignore_eos``, greedy; at least ``--min-calls`` in all, so a lone
client's run is long enough to time) to one server at a time, taking turns within each
repeat -- plain vLLM, vlens steering every call with a named vector
(``--vector mood=...``, layer 1), vlens unsteered -- so a busy machine slows
every side alike. The medians of generated tokens per second over
``--repeats`` and the time ratios are printed.

Both servers get the dtype ``vlens serve`` picks and the environment
``vlens serve`` runs its engine with (vlens's defaults: ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and, on a CPU,
``OMP_NUM_THREADS`` one less than the CPUs), printed with the results, so
the ratio is vlens's own cost; ``--vllm-defaults`` starts plain vLLM with
its own instead (automatic thread binding).

    .venv/bin/python benchmarks/openai_throughput.py            # the toy model
    .venv/bin/python benchmarks/openai_throughput.py --model DIR --repeats 5
"""

from __future__ import annotations

import argparse
import os
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


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], url: str, key: str, log: Path, env: dict[str, str]) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**env, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
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


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _load(url: str, key: str, conc: int, calls: int, tokens: int, steer: dict | None,
          prompts: list[str]) -> float:
    """Generated tokens per second of ``conc`` clients, ``calls`` chats each."""
    import openai

    model = openai.OpenAI(base_url=url + "/v1", api_key=key).models.list().data[0].id
    done = [0] * conc
    barrier = threading.Barrier(conc + 1)

    def client(i: int) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        barrier.wait()
        for j in range(calls):
            extra = {"ignore_eos": True, **({"vlens": steer} if steer else {})}
            out = c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompts[(i + j) % len(prompts)]}],
                max_tokens=tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body=extra)
            for chunk in out:
                if chunk.usage is not None:
                    done[i] += chunk.usage.completion_tokens

    threads = [threading.Thread(target=client, args=(i,)) for i in range(conc)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: the toy world's)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--calls", type=int, default=2, help="chats per client per run")
    p.add_argument("--min-calls", type=int, default=16,
                   help="chats in all per run, at least (a lone client's run is otherwise too "
                        "short to time)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="both servers with --enforce-eager")
    p.add_argument("--vllm-defaults", action="store_true",
                   help="plain vLLM with its own environment defaults, not vlens serve's")
    args = p.parse_args()

    import torch
    from safetensors.torch import save_file

    from vlens.engine.startup import resolve_model
    from vlens.models.world import example_prompts

    model = resolve_model(args.model)
    from vlens.engine.env import apply_env_defaults, serve_threads

    before = dict(os.environ)
    shown = ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_USE_V2_MODEL_RUNNER")
    apply_env_defaults({"kv_cache_memory_bytes": 256 * 2**20})  # what vlens serve sets
    serve_threads()
    env_vlens = dict(os.environ)
    env_vllm = before if args.vllm_defaults else env_vlens
    tmp = Path(tempfile.mkdtemp(prefix="vlens-oai-bench-"))
    key = "bench-token-" + os.urandom(8).hex()
    (tmp / "tokens").write_text(f"bench {key}\n")
    (tmp / "tokens").chmod(0o600)
    (tmp / "template.jinja").write_text(TEMPLATE)
    import json

    hidden = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
    save_file({"v": torch.randn(hidden, generator=torch.Generator().manual_seed(0))},
              str(tmp / "mood.safetensors"))
    from vlens.engine.startup import Checkpoint

    # the dtype vlens serve picks (a float32 checkpoint stays float32; vLLM
    # alone would downcast it to bfloat16), given to both sides
    dtype = Checkpoint.check(model, "auto").default_dtype or "auto"
    common = ["--kv-cache-memory-bytes", str(256 * 2**20), "--chat-template",
              str(tmp / "template.jinja"), "--dtype", dtype] + (
                  ["--enforce-eager"] if args.eager else [])
    steer = {"steer": [{"vector": "mood", "layer": 1, "scale": 2.0}]}
    prompts = example_prompts(16, seed=7)
    conc = [int(c) for c in args.concurrency.split(",")]
    sides = {
        # vLLM's OpenAI server (what `vllm serve` runs; the CLI itself looks up
        # the "vllm" package's version, which vllm-cpu's metadata lacks)
        "vllm": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                 "--api-key", key],
        "vlens": [sys.executable, "-m", "vlens.cli", "serve", model, "--token-file",
                  str(tmp / "tokens"), "--vector", f"mood={tmp / 'mood.safetensors'}",
                  "--max-concurrent", str(max(conc) + 1)],
    }
    rates: dict[tuple[str, int], list[float]] = {}
    urls: dict[str, str] = {}
    procs: list[subprocess.Popen] = []
    try:
        for name, cmd in sides.items():
            port = _port()
            urls[name] = f"http://127.0.0.1:{port}"
            t0 = time.monotonic()
            procs.append(_start(cmd + ["--port", str(port)] + common, urls[name], key,
                                tmp / f"{name}.log", env_vllm if name == "vllm" else env_vlens))
            print(f"{name}: started in {time.monotonic() - t0:.0f} s", flush=True)
        runs = [("vllm", "vllm", None), ("vlens", "vlens", steer), ("vlens plain", "vlens", None)]
        for _, side, st in runs:
            _load(urls[side], key, 1, 1, 4, st, prompts)  # warm
        for c in conc:
            for _ in range(args.repeats):
                for label, side, st in runs:  # taking turns: noise hits every side alike
                    rates.setdefault((label, c), []).append(
                        _load(urls[side], key, c, max(args.calls, -(-args.min_calls // c)),
                              args.tokens, st, prompts))
    finally:
        for proc in procs:
            _stop(proc)
    print(f"\nsteered chat via openai, {args.tokens} tokens, {args.calls} chats per client "
          f"(at least {args.min_calls} in all), "
          f"median of {args.repeats}, {'eager' if args.eager else 'compiled'}, dtype {dtype}")
    for side, env in (("vllm", env_vllm), ("vlens", env_vlens)):
        print(f"  {side} environment: " + ", ".join(f"{k}={env.get(k, '(unset)')}" for k in shown))
    print(f"{'clients':>8} {'vllm tok/s':>11} {'vlens steered':>14} {'vlens plain':>12} "
          f"{'steered/vllm time':>18} {'plain/vllm time':>16}")
    for c in conc:
        a, b, u = (statistics.median(rates[(k, c)]) for k in ("vllm", "vlens", "vlens plain"))
        print(f"{c:>8} {a:>11.1f} {b:>14.1f} {u:>12.1f} {a / b:>17.2f}x {a / u:>15.2f}x")


if __name__ == "__main__":
    main()
