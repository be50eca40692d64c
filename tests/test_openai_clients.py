"""``vlens serve`` as real clients meet it (#40): vLLM's errors as ``vllm
serve`` gives them on connections that survive, the routes orchestrators
call, a queue instead of 429 storms, and presets that steer a client that
can set only its base URL (lm-evaluation-harness's loglikelihood requests).

Two servers on the bundled model, started together: ``vlens serve`` with
its default limits (a vector and a preset loaded) and plain vLLM's OpenAI
server (``python -m vllm.entrypoints.openai.api_server``, what ``vllm
serve`` runs) with the same dtype, template and eager mode, the reference
for every error body and every /tokenize answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import vlens
from test_serve import _TOY_TEMPLATE, KV, _free_port, _prompts, _Server  # noqa: I001

openai = pytest.importorskip("openai")

# one process: the servers are shared by every test here, in this order
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("openai-clients")]

ROOT = Path(__file__).resolve().parents[1]
LAYER, SCALE = 3, 6.0


@pytest.fixture(scope="module")
def mood(toy_session):
    return toy_session.direction(["the wind was happy", "a happy fox"],
                                 ["the wind was sad", "a sad fox"], layer=LAYER)


class _Vllm:
    """Plain vLLM's OpenAI server on the same model, template and dtype."""

    def __init__(self, folder: Path, key: str) -> None:
        from vlens.engine.startup import Checkpoint, resolve_model

        self.model = resolve_model(None)
        dtype = Checkpoint.check(self.model, "auto").default_dtype or "auto"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        self.log = folder / "vllm.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
             "--port", str(self.port), "--api-key", key, "--enforce-eager", "--dtype", dtype,
             "--kv-cache-memory-bytes", KV, "--chat-template", str(folder / "template.jinja")],
            env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT)

    def wait(self) -> None:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM's server did not start: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, mood):
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("clients")
    save_file({"mood": mood.contiguous()}, str(folder / "mood.safetensors"))
    (folder / "template.jinja").write_text(_TOY_TEMPLATE)
    (folder / "happy.json").write_text(json.dumps(
        {"steer": [{"vector": "mood", "layer": LAYER, "scale": SCALE}]}))
    srv = _Server(folder, ("--enforce-eager", "--max-concurrent", "4", "--max-queued", "64",
                           "--vector", f"mood={folder / 'mood.safetensors'}",
                           "--preset", f"happy={folder / 'happy.json'}",
                           "--chat-template", str(folder / "template.jinja")))
    ref = _Vllm(folder, srv.tokens["c0"])
    try:
        srv.start()
        ref.wait()
        yield srv, ref
    finally:
        srv.stop()
        ref.stop()


def _client(url: str, key: str):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _rejected(model: str) -> list[tuple[str, dict]]:
    """Requests vLLM's server rejects, each (route, body)."""
    long = " ".join(["the wind was cold and the sky was grey."] * 60)  # > 512 tokens
    chat = [{"role": "user", "content": "the wind was"}]
    return [
        ("completions", {"model": model, "prompt": "the wind was", "max_tokens": 100000}),
        ("completions", {"model": model, "prompt": "the wind was", "temperature": -1}),
        ("completions", {"model": model, "prompt": "the wind was", "logprobs": 50}),
        ("completions", {"model": model, "prompt": long, "max_tokens": 4}),
        ("completions", {"model": model, "prompt": "the wind was", "top_p": 2}),
        ("completions", {"model": model, "prompt": "the wind was", "n": 0}),
        ("completions", {"model": "no-such-model", "prompt": "the wind was"}),
        ("completions", {"model": model}),  # no prompt: pydantic's validation error
        ("chat/completions", {"model": model, "messages": chat, "logprobs": True,
                              "top_logprobs": 50}),
        ("chat/completions", {"model": model, "messages": chat, "max_tokens": 100000}),
        ("chat/completions", {"model": model, "messages": "not a list"}),
        ("chat/completions", {"model": model, "messages": chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}),
    ]


def test_vllm_rejections_are_answered_as_vllm_serve_does_on_live_connections(servers):
    srv, ref = servers
    key = srv.tokens["c0"]
    model = _client(ref.url, key).models.list().data[0].id
    bad = _rejected(model)
    assert len(bad) >= 8
    with httpx.Client(timeout=120) as a, httpx.Client(timeout=120) as b:
        for route, body in bad:
            got = a.post(f"{srv.url}/v1/{route}", json=body,
                         headers={"Authorization": f"Bearer {key}"})
            want = b.post(f"{ref.url}/v1/{route}", json=body,
                          headers={"Authorization": f"Bearer {key}"})
            assert want.status_code >= 400, (route, body)  # vLLM does reject it
            assert got.status_code == want.status_code, (body, got.text, want.text)
            assert got.headers["content-type"].startswith("application/json"), got.text
            assert got.json() == want.json(), (body, got.text, want.text)

    # 20 rounds of bad-then-good on one client that keeps its connection
    plain = _client(srv.url, key)
    good = dict(model=model, prompt=_prompts(0)[0], max_tokens=6, temperature=0.0)
    first = plain.completions.create(**good).choices[0].text
    errors = []
    for i in range(20):
        route, body = bad[i % 6]  # the completions route's rejections
        try:
            plain.completions.create(**{**good, **body, "model": body.get("model", model)})
        except openai.APIConnectionError as exc:  # the bug this guards against
            errors.append(exc)
        except openai.APIStatusError as exc:
            assert exc.status_code in (400, 404), exc
        try:
            assert plain.completions.create(**good).choices[0].text == first
        except openai.APIConnectionError as exc:
            errors.append(exc)
    assert errors == []
    assert srv.status()["calls"] == 0


def test_the_routes_orchestrators_call(servers):
    from prometheus_client.parser import text_string_to_metric_families

    srv, ref = servers
    key = srv.tokens["c1"]
    auth = {"Authorization": f"Bearer {key}"}
    for path in ("/health", "/ping"):  # no token
        assert httpx.get(srv.url + path).status_code == 200
    assert httpx.post(srv.url + "/ping").status_code == 200
    version = httpx.get(srv.url + "/version").json()
    import vllm

    assert version == {"version": vllm.__version__, "vlens": vlens.__version__}

    model = _client(srv.url, key).models.list().data[0].id
    card = httpx.get(f"{srv.url}/v1/models/{model.lstrip('/')}", headers=auth)
    assert card.status_code == 200 and card.json()["id"] == model
    missing = httpx.get(f"{srv.url}/v1/models/nope", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(f"{srv.url}/v1/models/{model.lstrip('/')}").status_code == 401

    # /tokenize and /detokenize: vLLM's shapes and answers
    ref_auth = {"Authorization": f"Bearer {ref.key}"}
    for path, body in (("/tokenize", {"model": model, "prompt": "the wind was cold"}),
                       ("/tokenize", {"model": model, "prompt": "the wind", "return_token_strs":
                                      True}),
                       ("/tokenize", {"model": model, "messages": [
                           {"role": "user", "content": "hello there"}]}),
                       ("/detokenize", {"model": model, "tokens": [5, 17, 22, 20]}),
                       ("/tokenize", {"model": model}),  # refused alike
                       ("/detokenize", {"model": model, "tokens": "x"})):
        got = httpx.post(srv.url + path, json=body, headers=auth)
        want = httpx.post(ref.url + path, json=body, headers=ref_auth)
        assert (got.status_code, got.json()) == (want.status_code, want.json()), (path, body)
    assert httpx.post(srv.url + "/tokenize", json={"model": model, "prompt": "x"}
                      ).status_code == 401

    # /metrics: behind the token; vLLM's engine metrics, then vlens's
    assert httpx.get(srv.url + "/metrics").status_code == 401
    _client(srv.url, key).completions.create(
        model=model, prompt="the wind was", max_tokens=3,
        extra_body={"vlens": {"steer": [{"vector": "mood", "layer": LAYER, "scale": 2.0}]}})
    page = httpx.get(srv.url + "/metrics", headers=auth)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(page.text)}
    assert any(name.startswith("vllm:") for name in families), sorted(families)[:20]
    steered = [s.value for s in families["vlens_requests"].samples
               if s.name == "vlens_requests_total" and s.labels["edit"] == "steered"]
    assert steered and steered[0] >= 1
    refusals = [s for s in families["vlens_refusals"].samples if s.name.endswith("_total")]
    assert sum(s.value for s in refusals) >= 1  # the test above's
    per_step = families["vlens_hook_seconds_per_step"].samples[0].value
    assert per_step > 0

    # /docs and /openapi.json document the vlens object (behind the token, as every
    # route but /health, /ping and /version)
    assert httpx.get(srv.url + "/openapi.json").status_code == 401
    assert "swagger" in httpx.get(srv.url + "/docs", headers=auth).text.lower()
    spec = httpx.get(srv.url + "/openapi.json", headers=auth).json()
    schemas = spec["components"]["schemas"]
    assert {"VlensBody", "SteerEntry", "AblateEntry", "ClampEntry"} <= set(schemas)
    assert "vlens" in schemas["ChatBody"]["properties"]
    for path in ("/v1/chat/completions", "/presets/{preset}/v1/completions", "/health",
                 "/tokenize", "/metrics"):
        assert path in spec["paths"], path


def test_thirty_two_streamed_chats_wait_in_line_and_equal_their_runs_alone(servers):
    srv, _ = servers
    prompts = [p for i in range(16) for p in _prompts(i)]
    client = _client(srv.url, srv.tokens["c2"])
    model = client.models.list().data[0].id

    def chat(i: int) -> str:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompts[i]}], max_tokens=12,
            temperature=0.0, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in out if ch.choices)

    alone = [chat(i) for i in range(0, 32, 4)]
    got: list = [None] * 32
    barrier = threading.Barrier(32)

    def run(i: int) -> None:
        barrier.wait()
        try:
            got[i] = chat(i)
        except Exception as exc:  # noqa: BLE001 - reported below
            got[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    failed = [g for g in got if not isinstance(g, str)]
    assert failed == []  # no 429, no dropped connection
    assert got[0::4] == alone
    assert srv.status()["queued"] == 0


def _lm_eval(srv, tmp: Path, base: str, concurrent: int) -> dict:
    """lm-eval's local-completions on a local multiple-choice task."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from vlens.engine.startup import resolve_model

    data = tmp / "mood.jsonl"
    if not data.exists():
        rows = []
        for i, p in enumerate(_prompts(0) + _prompts(1) + _prompts(2)):
            rows.append({"context": p, "choices": [" happy", " sad", " cold"],
                         "label": i % 3})
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp / "toy_mood.yaml").write_text(
            "task: toy_mood\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
            "doc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
            "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n")
    model = resolve_model(None)
    os.environ["OPENAI_API_KEY"] = srv.tokens["c3"]
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": model, "base_url": f"{base}/completions", "tokenizer": model,
                    "tokenizer_backend": "huggingface", "num_concurrent": concurrent,
                    "max_retries": 1, "add_bos_token": True},
        tasks=["toy_mood"], task_manager=TaskManager(include_path=str(tmp)),
        log_samples=True)
    return out


def test_lm_eval_concurrent_and_a_preset_steer_its_loglikelihoods(servers, toy_session,
                                                                   tmp_path, mood):
    srv, _ = servers
    one = _lm_eval(srv, tmp_path, srv.url + "/v1", 1)
    eight = _lm_eval(srv, tmp_path, srv.url + "/v1", 8)  # default limits: 4 run, the rest wait
    assert eight["results"]["toy_mood"]["acc,none"] == one["results"]["toy_mood"]["acc,none"]

    def lls(out: dict) -> list[float]:
        return [r[0][0] for s in out["samples"]["toy_mood"] for r in s["resps"]]

    torch.testing.assert_close(torch.tensor(lls(eight)), torch.tensor(lls(one)),
                               atol=1e-5, rtol=0)
    steered = _lm_eval(srv, tmp_path, srv.url + "/presets/happy/v1", 4)
    plain, moved = lls(one), lls(steered)
    assert max(abs(a - b) for a, b in zip(plain, moved)) > 0.05  # the preset steers

    # each equals a local trace's logprobs of the continuation, steered alike
    st = vlens.Steer(mood, layer=LAYER, scale=SCALE)
    samples = steered["samples"]["toy_mood"]
    for doc in samples[:3]:
        for k, choice in enumerate(doc["doc"]["choices"]):
            ctx = toy_session.tokenize(doc["doc"]["context"])
            full = toy_session.tokenize(doc["doc"]["context"] + choice)
            assert full[:len(ctx)] == ctx
            t = toy_session.trace([{"prompt_token_ids": full}], steer=st, max_new_tokens=1)[0]
            want = sum(t.logprobs[len(ctx):len(full)])
            assert abs(doc["resps"][k][0][0] - want) < 1e-3, (doc["doc"], choice)


def test_health_is_503_once_the_engine_is_gone(servers):
    """Last here: it stops the server's engine. /health and /ping answer
    503 (no token needed), and other routes answer errors, not hangs."""
    import psutil

    srv, _ = servers
    assert httpx.get(srv.url + "/health").status_code == 200
    engine = [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
              if "python" in p.name().lower() or "EngineCore" in " ".join(p.cmdline())]
    assert engine, "the server runs its engine core in a process of its own"
    for p in engine:
        p.kill()
    deadline = time.monotonic() + 60
    while httpx.get(srv.url + "/health", timeout=30).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert httpx.get(srv.url + "/ping", timeout=30).status_code == 503
    assert httpx.get(srv.url + "/version").status_code == 200  # the server itself answers
