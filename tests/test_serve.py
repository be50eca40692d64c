"""``vlens serve`` with many connected Sessions (the bundled model).

One server subprocess on loopback serves every test here; a local
in-process Session of the same model is the reference each connected
client's results must equal. The tests also show that clients' requests
share engine steps, that tokens, other clients' ids and hand-made plans get
nowhere, that a client killed mid-call leaves nothing behind, and that a
server restart is a clear error followed by a working reconnect.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import vlens
from vlens import calls
from vlens.checks import rules
from vlens.keywords import SAMPLING
from vlens.remote.wire import (FRAME_TYPE, OFF_WIRE_DEFAULTS, PARAM_FIELDS, FrameReader, pack,
                               params_to_wire)

# one xdist group: its server subprocess (a module fixture) starts once, not in both test processes
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("serve")]

ROOT = Path(__file__).resolve().parents[1]
N_CLIENTS = 8
KV = str(64 * 2**20)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _PortTaken(Exception):
    """Another process bound the server's port first."""


class _Server:
    """A ``vlens serve`` subprocess and the tokens of its clients."""

    def __init__(self, folder: Path, extra: tuple[str, ...] = ()) -> None:
        self.extra = list(extra)
        self.tokens = {f"c{i}": f"token-{i}-" + os.urandom(12).hex() for i in range(12)}
        self.token_file = folder / "tokens"
        self.token_file.write_text("".join(f"{n} {t}\n" for n, t in self.tokens.items()))
        self.token_file.chmod(0o600)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # the port is picked free, but the server binds it only after its
        # engine has started (a minute on a busy machine), and any process
        # may take it meanwhile (an outgoing connection, vLLM's own ports):
        # then the test's set-up, not the server, picks another
        for _ in range(3):
            try:
                return self._start()
            except _PortTaken:
                self.port = _free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        raise RuntimeError(f"vlens serve found no free port: {self.log.read_text()[-3000:]}")

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        begin = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlens.cli", "serve", "--port", str(self.port),
             "--token-file", str(self.token_file), "--kv-cache-memory-bytes", KV,
             "--max-body-mb", "1", "--max-concurrent", "2", "--max-queued", "8",
             "--max-read-mb", "64",
             "--body-timeout", "3", "--stall-timeout", "3", *self.extra],
            env=env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600  # a start beside the suite's other engines
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log.read_bytes()[begin:].decode(errors="replace")
                if f"address ('127.0.0.1', {self.port}): address already in use" in log:
                    raise _PortTaken
                raise RuntimeError(f"vlens serve exited: {log[-3000:]}")
            try:
                if self.get("/v1/info", "c0").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"vlens serve did not start: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def headers(self, client: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[client]}"} if client else {}

    def get(self, path: str, client: str | None) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(client), timeout=60)

    def post(self, body: bytes, client: str | None, *, content_type: str = FRAME_TYPE,
             path: str = "/v1/generate") -> httpx.Response:
        return httpx.post(self.url + path, content=body, timeout=60,
                          headers={**self.headers(client), "Content-Type": content_type})

    def status(self) -> dict:
        return self.get("/v1/status", "c11").json()

    def connect(self, client: str):
        return vlens.connect(self.url, token=self.tokens[client])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """vlens serve in this run's engine mode (eager, or compiled with
    VLENS_TEST_ENGINE=compiled), as the local reference Session runs;
    test_openai.py's server runs the default, compiled."""
    from conftest import mode_options

    compiled = mode_options().get("enforce_eager") is False
    srv = _Server(tmp_path_factory.mktemp("serve"), () if compiled else ("--enforce-eager",))
    srv.start()
    assert ("compiled (" if compiled else "eager (") in srv.log.read_text()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def direction(toy_session):
    return toy_session.direction(["the wind was happy", "a happy fox"],
                                 ["the wind was sad", "a sad fox"], layer=1)


def _prompts(i: int) -> list[str]:
    from vlens.models.world import example_prompts

    return example_prompts(2, seed=100 + i)


def _workload(s, i: int, direction: torch.Tensor) -> dict:
    """Reads, steering and a sweep, as one participant would run them."""
    prompts = _prompts(i)
    run = s.trace(prompts, layers=[0, 2], sites=["resid_post", "attn_out"], max_new_tokens=6)
    steer = vlens.Steer(direction, layer=1, scale=3.0 + i)
    steered = s.trace(prompts[0], layers=[3], steer=steer, max_new_tokens=6)
    sweep = s.sweep(prompts[1], steer=vlens.Steer(direction, layer=2, scale=1.0),
                    scales=[0.0, 2.0, 5.0], max_new_tokens=5)
    return {
        "texts": [t.text for t in run] + [steered[0].text] + [r[0].text for r in sweep.runs],
        "acts": [t.activations(site) for t in run for site in ("resid_post", "attn_out")]
        + [steered[0].activations()],
        "logprobs": [t.logprobs for t in run] + [steered[0].logprobs],
        "kl": [k[0] for k in sweep.kl],
        "steered_rows": steered[0].steered_rows,
    }


def _same(got: dict, want: dict) -> None:
    assert got["texts"] == want["texts"]
    assert got["steered_rows"] == want["steered_rows"] > 0
    for a, b in zip(got["acts"], want["acts"], strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(got["kl"], want["kl"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        assert [x is None for x in a] == [x is None for x in b]
        assert max(abs(x - y) for x, y in zip(a, b) if x is not None) < 1e-5


def _in_threads(fn, n: int) -> list:
    out: list = [None] * n
    errors: list = []
    barrier = threading.Barrier(n)

    def work(i: int) -> None:
        try:
            out[i] = fn(i, barrier)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return out


def _served_rule_calls(server, rule: str) -> float:
    """How often the server's process ran ``rule`` (its /metrics)."""
    text = server.get("/metrics", "c3").text
    line = next((x for x in text.splitlines()
                 if x.startswith(f'vlens_rule_calls{{rule="{rule}"}}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_a_steer_meets_its_rule_once_per_call_on_each_side(server, toy_session, direction):
    """A trace with one Steer on 8 prompts runs the Steer rule
    (vlens.checks.rules.steer) once on the notebook side, and a connected
    session's call once more on the server: not once per prompt, and not
    again for each plan that names it."""
    steer = vlens.Steer(direction, layer=1, scale=2.0)
    prompts = (_prompts(0) * 4)[:8]
    assert len(prompts) == 8
    before = rules.CALLS["steer"]
    local = toy_session.trace(prompts, steer=steer, max_new_tokens=2)
    assert rules.CALLS["steer"] - before == 1
    assert all(t.steered_rows > 0 for t in local)
    s = server.connect("c3")
    before, served = rules.CALLS["steer"], _served_rule_calls(server, "steer")
    remote = s.trace(prompts, steer=steer, max_new_tokens=2)
    assert rules.CALLS["steer"] - before == 1
    assert _served_rule_calls(server, "steer") - served == 1
    assert [t.text for t in remote] == [t.text for t in local]
    # two different Steers: two checks on each side
    before, served = rules.CALLS["steer"], _served_rule_calls(server, "steer")
    s.trace(prompts, steer=[steer, vlens.Steer(direction, layer=2, scale=1.0)], max_new_tokens=2)
    assert rules.CALLS["steer"] - before == 2
    assert _served_rule_calls(server, "steer") - served == 2


def test_eight_clients_equal_a_local_session_and_share_steps(server, toy_session, direction):
    want = [_workload(toy_session, i, direction) for i in range(N_CLIENTS)]

    def client(i, barrier):
        with server.connect(f"c{i}") as s:
            assert s.n_layers == toy_session.n_layers and s.sites == toy_session.sites
            barrier.wait()
            return _workload(s, i, direction)

    got = _in_threads(client, N_CLIENTS)
    for g, w in zip(got, want):
        _same(g, w)

    # engine steps: one client's call alone, then every client's at once
    prompt = _prompts(0)[0]
    with server.connect("c0") as s:
        before = s.status()["steps_planned"]
        alone = s.trace(prompt, max_new_tokens=24, layers=[1])
        one_call = s.status()["steps_planned"] - before
    assert one_call >= 24

    def same_call(i, barrier):
        with server.connect(f"c{i}") as s:
            barrier.wait()
            return s.trace(prompt, max_new_tokens=24, layers=[1])

    before = server.status()["steps_planned"]
    runs = _in_threads(same_call, N_CLIENTS)
    together = server.status()["steps_planned"] - before
    # eight calls alone would take 8 * one_call steps; shared steps run several
    # clients' requests at once
    assert together < N_CLIENTS * one_call / 2, (together, one_call)
    for run in runs:
        assert run[0].text == alone[0].text
        torch.testing.assert_close(run[0].activations(), alone[0].activations(),
                                   atol=1e-5, rtol=0)


def test_head_sites_ablation_and_patching_match_a_local_session(server, toy_session, direction):
    """The methods that travel as data (head reads, Ablate, directional
    Ablate, patch) work remotely."""
    prompts = _prompts(3)
    ablate = vlens.PerPrompt([[vlens.Ablate("z", 1, heads=[0]),
                               vlens.Ablate("resid_post", "all", direction=direction)],
                              vlens.Ablate("mlp_out", 2, kind="mean")])
    story = "one day, a {} bear lived in a blue cabin near the meadow. the sky was"
    clean, corrupt = story.format("happy"), story.format("lonely")
    with server.connect("c7") as s:
        results = [
            s.trace(prompts, layers=[1, 2], sites=["z", "attn_pattern"], heads=[0, 2],
                    max_new_tokens=4),
            s.trace(prompts, layers=[3], ablate=ablate, max_new_tokens=5),
        ]
        grid = s.patch(clean, corrupt, layers=[0, 2], span=[5, -1])
    want = [
        toy_session.trace(prompts, layers=[1, 2], sites=["z", "attn_pattern"], heads=[0, 2],
                          max_new_tokens=4),
        toy_session.trace(prompts, layers=[3], ablate=ablate, max_new_tokens=5),
    ]
    for got_run, want_run in zip(results, want):
        for g, w in zip(got_run, want_run, strict=True):
            assert g.text == w.text
            for site in w.read_keys:
                torch.testing.assert_close(g.activations(site), w.activations(site),
                                           atol=1e-5, rtol=0)
    local = toy_session.patch(clean, corrupt, layers=[0, 2], span=[5, -1])
    assert grid.answer == local.answer
    torch.testing.assert_close(grid.grid, local.grid, atol=1e-4, rtol=0)


# a chat template in the toy world's own words: each message's content in turn
_TOY_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"


def test_conversations_over_connect_equal_a_local_session(server, toy_session, direction):
    """compare, sweep, direction and patch take conversations on a connected
    session (the prompt is normalised on the client, roles included)."""
    p = _prompts(5)
    conv = [{"role": "user", "content": p[0]}, {"role": "assistant", "content": p[1]}]
    other = [{"role": "user", "content": p[1]}, {"role": "assistant", "content": p[0]}]
    story = "one day, a {} bear lived in a blue cabin near the meadow. the sky was"
    clean, corrupt = ([{"role": "user", "content": story.format(w)}] for w in ("happy", "lonely"))
    st = vlens.Steer(direction, layer=1, scale=4.0, span="assistant")

    def workload(s):
        s.chat_template = _TOY_TEMPLATE
        try:
            return (s.compare([conv, other], steer=st, max_new_tokens=5),
                    s.sweep(conv, steer=st, scales=[0.0, 3.0], max_new_tokens=4),
                    s.direction([conv], [other], layer=1),
                    s.patch(clean, corrupt, layers=[0, 2], span="user"))
        finally:
            s.chat_template = None

    with server.connect("c8") as s:
        got = workload(s)
    want = workload(toy_session)
    n_assistant = sum(r == "assistant" for r in want[0].baseline[0].roles)
    assert n_assistant >= 5 and want[0].steered[0].steered_rows == n_assistant
    for g, w in zip(got[0].steered, want[0].steered, strict=True):
        assert g.text == w.text and g.roles == w.roles and g.steered_rows == w.steered_rows
    assert [r[0].text for r in got[1].runs] == [r[0].text for r in want[1].runs]
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=0)
    assert got[3].positions == want[3].positions and len(want[3].positions) >= 8
    torch.testing.assert_close(got[3].grid, want[3].grid, atol=1e-4, rtol=0)


_NO_VLLM = """
import json, sys, vlens
s = vlens.connect(sys.argv[1], token=sys.argv[2])
t = s.trace("the wind was", layers=[0], max_new_tokens=6, stop=" a", stop_token_ids=(5,),
            repetition_penalty=1.3, min_tokens=2, detokenize=True)
print(json.dumps({"text": t[0].text, "shape": list(t[0].activations("resid_post").shape),
                  "vllm": sorted(m for m in sys.modules if m.split(".")[0] == "vllm")}))
"""


def test_sampling_settings_cross_without_vllm_and_off_wire_ones_are_refused(server, toy_session):
    """A connected session sends its sampling settings as the wire's dict,
    made without vLLM (a connected kernel may have none): the server checks
    them and makes the SamplingParams. The results equal a local session's;
    a setting that does not cross is refused on the client, a bad value by
    the server, and the session serves on."""
    from vllm import SamplingParams

    default = SamplingParams()
    assert {k: getattr(default, k) for k in OFF_WIRE_DEFAULTS} == OFF_WIRE_DEFAULTS
    assert set(SAMPLING) <= set(PARAM_FIELDS) | set(OFF_WIRE_DEFAULTS)  # each has a rule
    settings = dict(stop=" a", stop_token_ids=(5,), repetition_penalty=1.3, min_tokens=2,
                    detokenize=True)
    want = toy_session.trace("the wind was", layers=[0], max_new_tokens=6, **settings)
    proc = subprocess.run([sys.executable, "-c", _NO_VLLM, server.url, server.tokens["c0"]],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["vllm"] == []  # the call made no vLLM import in the client
    want = want[0]
    plain = toy_session.trace("the wind was", layers=[0], max_new_tokens=6)[0]
    assert plain.text != want.text  # the settings change the run
    assert got["text"] == want.text and got["shape"] == list(want.activations("resid_post").shape)
    with server.connect("c0") as s:
        for bad, match in (({"logit_bias": {3: 1.0}}, "logit_bias= cannot be used on a connected"),
                           ({"bad_words": ["sad"]}, "bad_words= cannot be used on a connected"),
                           ({"temperature": -1.0}, "temperature must be non-negative")):
            with pytest.raises(vlens.VlensError, match=match):
                s.trace("the wind was", max_new_tokens=2, **bad)
        assert s.generate("the wind was", max_new_tokens=4) == toy_session.generate(
            "the wind was", max_new_tokens=4)


def test_limits_are_clear_errors_and_closing_a_stream_aborts_it(server):
    # read bytes per call (the server runs with --max-read-mb 64)
    with server.connect("c10") as s:
        long = " ".join(["the wind was cold and the sky was grey."] * 40)
        with pytest.raises(vlens.VlensError, match="read limit per call"):
            s.trace([long] * 16, layers=None, sites=s.sites, max_new_tokens=4)
        with pytest.raises(vlens.VlensError, match="prompt tokens|max_model_len"):
            s.trace(" ".join([long] * 3), max_new_tokens=2)
    # calls at once per client (--max-concurrent 2): a third waits in line
    # and runs when a slot frees
    sessions = [server.connect("c9") for _ in range(3)]
    streams = [s.stream("the wind was", max_new_tokens=400, ignore_eos=True)
               for s in sessions[:2]]
    for it in streams:
        next(it)  # the call is running on the server
    assert server.status()["calls"] == 2
    third: list = []
    waiter = threading.Thread(target=lambda: third.append(
        sessions[2].trace("the wind was", max_new_tokens=2)[0].text))
    waiter.start()
    deadline = time.monotonic() + 60
    while server.status()["queued"] != 1:
        assert time.monotonic() < deadline, server.status()
        time.sleep(0.1)
    assert third == [] and server.status()["calls"] == 2  # waiting, not refused
    for it in streams:
        it.close()  # a closed stream closes its connection: the server aborts the call
    waiter.join(120)
    assert third and third[0]
    deadline = time.monotonic() + 60
    while (st := server.status())["calls"] or st["unfinished"] or st["records"]:
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    for s in sessions:
        s.close()


def _call_body(server, ids: list[int], *, tag: str = "t-0", reads=None, adds=(),
               vectors=None, **params) -> dict:
    """A /v1/generate body made by hand (as a hostile client would)."""
    from vllm import SamplingParams

    from vlens.protocol.plan import parse_plan

    plan = {"v": 4, "tag": tag, "index": 0, "clone": False, "prompt_len": len(ids),
            "reads": reads if reads is not None else
            [{"site": "resid_post", "layers": [0], "reduce": "full", "k": 0}],
            "adds": list(adds), "edits": []}
    plan = parse_plan(plan).to_wire()  # the canonical form, as a Session writes it
    sp = SamplingParams(max_tokens=params.pop("max_tokens", 3), temperature=0.0,
                        skip_reading_prefix_cache=True, extra_args={"vlens": plan}, **params)
    return {"requests": [{"ids": ids, "params": params_to_wire(sp)}],
            "vectors": vectors or {}, "stream": False}


def _frames(resp: httpx.Response) -> list[dict]:
    return FrameReader().feed(resp.content)


def test_tokens_ids_and_edit_functions_are_refused(server, toy_session, monkeypatch):
    ids = toy_session.tokenize("the wind was")
    body = pack(_call_body(server, ids))
    steps = server.status()["steps_seen"]
    for client, headers in ((None, {}), ("c0", {"Authorization": "Bearer not-a-token-at-all"}),
                            ("c0", {"Authorization": "Basic " + server.tokens["c0"]})):
        resp = httpx.post(server.url + "/v1/generate", content=body,
                          headers={**headers, "Content-Type": FRAME_TYPE}, timeout=60)
        assert resp.status_code == 401, resp.text
    assert server.get("/v1/info", None).status_code == 401
    assert server.status()["steps_seen"] == steps  # nothing ran
    with pytest.raises(vlens.VlensError, match="refused the token"):
        vlens.connect(server.url, token="wrong-token-wrong-token")
    with pytest.raises(vlens.VlensError, match="token"):
        vlens.connect(server.url, token="")

    # client c1 runs a call; c2 reuses c1's tag and asks for its records
    made: list[str] = []  # the tag prefix of c1's call, as vlens.calls makes it
    monkeypatch.setattr(calls, "new_tag", lambda real=calls.new_tag: made.append(real()) or made[-1])
    with server.connect("c1") as s:
        s.trace("the wind was", max_new_tokens=3, layers=[0])
        tag = f"{made[0]}-0"
    resp = server.post(pack(_call_body(server, ids, tag=tag)), "c2")
    done = _frames(resp)[-1]
    assert done["kind"] == "done"
    assert list(done["records"]) == [tag] and len(done["records"][tag]) == 1  # its own only
    for path in ("/v1/collect", "/v1/records", "/v1/drop"):
        assert server.post(pack({"tags": [tag]}), "c2", path=path).status_code == 404
    assert server.status()["records"] == 0

    # a vector another client holds cannot be named without sending it
    vec = toy_session.direction(["happy"], ["sad"], layer=0)
    with server.connect("c1") as s:
        st = vlens.Steer(vec, layer=0, scale=2.0)
        s.trace("the wind was", steer=st, max_new_tokens=2)
    add = {"site": "resid_post", "layer": 0, "vec": st.id, "scale": 1.0, "start": 0,
           "stop": -1, "relative": False}
    resp = server.post(pack(_call_body(server, ids, adds=[add])), "c2")
    assert resp.status_code == 400 and "not sent with this call" in resp.json()["error"]

    # edit= functions: refused on the client, and a hand-made plan with edits too
    with server.connect("c3") as s:
        with pytest.raises(vlens.VlensError, match="code does not cross the wire"):
            s.trace("the wind was", edit=lambda rows, ctx: None, edit_at=[("resid_post", 0)])
        s.trace("the wind was", max_new_tokens=2)  # still usable
    raw = _call_body(server, ids)
    raw["requests"][0]["params"]["extra_args"]["vlens"]["edits"] = [
        {"site": "resid_post", "layer": 0, "fn": "fn-1"}]
    resp = server.post(pack(raw), "c3")
    assert resp.status_code == 400 and "code does not cross the wire" in resp.json()["error"]


_VICTIM = """
import sys, vlens
s = vlens.connect(sys.argv[1], token=sys.argv[2])
print("connected", flush=True)
s.trace("the wind was", layers=[0, 1, 2, 3], sites=["resid_post", "attn_out"],
        max_new_tokens=400, ignore_eos=True)
print("finished", flush=True)
"""


def test_a_client_killed_mid_call_leaves_nothing(server, toy_session, tmp_path):
    script = tmp_path / "victim.py"
    script.write_text(_VICTIM)
    want = _workload(toy_session, 5, toy_session.direction(["happy"], ["sad"], layer=1))
    direction = toy_session.direction(["happy"], ["sad"], layer=1)
    victim = subprocess.Popen([sys.executable, str(script), server.url, server.tokens["c8"]],
                              env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while server.status()["unfinished"] == 0:
            assert victim.poll() is None, victim.stdout.read()
            assert time.monotonic() < deadline, "the victim's call never started"
            time.sleep(0.05)
        # another client works while the victim runs and when it dies
        got: dict = {}
        worker = threading.Thread(target=lambda: got.update(
            result=_workload(server.connect("c5"), 5, direction)))
        worker.start()
        time.sleep(0.3)
        assert server.status()["unfinished"] >= 1  # the victim is mid-call
        victim.kill()
        victim.wait()
        worker.join(300)
    finally:
        if victim.poll() is None:
            victim.kill()
    _same(got["result"], want)
    deadline = time.monotonic() + 60
    while True:
        st = server.status()
        if st["unfinished"] == 0 and st["records"] == 0 and st["plans"] == 0 and st["calls"] == 0:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    assert "finished" not in victim.stdout.read()


def _malformed(server, ids: list[int], vocab: int, hidden: int,
               n_layers: int) -> list[tuple[str, dict]]:
    """Over 200 bad requests: (what, httpx.request kwargs)."""
    rng = random.Random(0)
    good = _call_body(server, ids)
    bad: list[tuple[str, dict]] = []

    def send(what, body, **kw):
        kw.setdefault("headers", {"Content-Type": FRAME_TYPE})
        bad.append((what, {"content": body if isinstance(body, bytes) else pack(body), **kw}))

    def plan_with(**changes):
        raw = json.loads(json.dumps(good))
        raw["requests"][0]["params"]["extra_args"]["vlens"].update(changes)
        return raw

    def params_with(**changes):
        raw = json.loads(json.dumps(good))
        raw["requests"][0]["params"].update(changes)
        return raw

    read = {"site": "resid_post", "layers": [0], "reduce": "full", "k": 0}
    for value in (-1, n_layers, 99, "0", None, 1.5, [0]):  # n_layers: one past the last
        send(f"read layer {value!r}", plan_with(reads=[{**read, "layers": [value]}]))
    for site in ("nope", "", None, 3, "resid_post\x00"):
        send(f"read site {site!r}", plan_with(reads=[{**read, "site": site}]))
    for reduce, k in (("max", 0), ("logit_lens", 0), ("logit_lens", -3), ("full", 5),
                      ("logit_lens", 10**9), (None, 0)):
        send(f"reduce {reduce} k {k}", plan_with(reads=[{**read, "reduce": reduce, "k": k}]))
    send("no layers", plan_with(reads=[{**read, "layers": []}]))
    send("read not a dict", plan_with(reads=["resid_post"]))
    add = {"site": "resid_post", "layer": 0, "vec": "v1", "scale": 1.0, "start": 0,
           "stop": -1, "relative": False}
    for change in ({"vec": "v1"}, {"vec": "../x"}, {"site": "positions"}, {"layer": 9},
                   {"scale": float("nan")}, {"scale": float("inf")}, {"start": -2},
                   {"stop": 0}, {"layer": "0"}, {"scale": "big"}):
        send(f"add {change}", plan_with(adds=[{**add, **change}]))
    one_set = {"site": "z", "layer": 1, "vec": "", "lo": 0, "hi": 32, "start": 0, "stop": -1}
    for change in ({"site": "attn_pattern"}, {"site": "nope"}, {"lo": -1}, {"hi": 0},
                   {"hi": 10**6}, {"lo": 200}, {"vec": "unsent"}, {"stop": 0}, {"layer": -1},
                   {"start": "0"}):
        send(f"set {change}", plan_with(sets=[{**one_set, **change}]))
    for heads in ([99], [-1], ["0"]):
        send(f"heads {heads}", plan_with(reads=[{**read, "site": "attn_pattern",
                                                  "heads": heads}]))
    send("heads on resid_post", plan_with(reads=[{**read, "heads": [0]}]))
    for change in ({"v": 2}, {"v": None}, {"tag": ""}, {"tag": "a/b"}, {"tag": "x" * 300},
                   {"tag": 5}, {"prompt_len": 0}, {"prompt_len": 999}, {"index": -1},
                   {"edits": [{"site": "resid_post", "layer": 0, "fn": "f"}]}):
        send(f"plan {change}", plan_with(**change))
    for change in ({"n": 0}, {"n": 1000}, {"n": "2"}, {"max_tokens": 0},
                   {"max_tokens": 10**9}, {"logprobs": 100}, {"prompt_logprobs": -1},
                   {"temperature": "hot"}, {"temperature": -1.0}, {"top_p": 7.0},
                   {"stop": "x"}, {"stop": [1, 2]}, {"stop": ["x"] * 100},
                   {"stop_token_ids": [-1]}, {"stop_token_ids": list(range(200))},
                   {"logits_processors": ["evil"]}, {"logit_bias": {"1": 5}},
                   {"extra_args": {"other": 1}}, {"extra_args": "vlens"},
                   {"seed": "x"}, {"top_k": "all"}, {"logprob_token_ids": [10**6]},
                   {"logprob_token_ids": list(range(300))}, {"logprob_token_ids": "1"}):
        send(f"params {change}", params_with(**change))
    for ids_bad in ([], [-1], [vocab], ["a"], [1.5], "the wind", None, [1] * 600):
        raw = json.loads(json.dumps(good))
        raw["requests"][0]["ids"] = ids_bad
        send(f"ids {str(ids_bad)[:20]}", raw)
    vec_ok = {"data": b"\0" * 4 * hidden, "shape": [hidden], "dtype": "float32"}
    nan = torch.full((hidden,), float("nan")).numpy().tobytes()
    for vid, payload in (("v", {**vec_ok, "shape": [hidden + 1]}), ("v", {**vec_ok, "dtype": "int64"}),
                         ("v", {**vec_ok, "dtype": "object"}), ("v", {**vec_ok, "data": b"\0"}),
                         ("v", {**vec_ok, "data": nan}), ("v", {**vec_ok, "data": "text"}),
                         ("bad id!", vec_ok), ("", vec_ok), ("v", {"data": b""}), ("v", [1, 2])):
        raw = json.loads(json.dumps(good))
        send(f"vector {vid!r}", {**raw, "vectors": {vid: payload}})
    for body in ([], {}, {"requests": []}, {"requests": "x"}, {"requests": [{}]},
                 {"requests": [{"ids": ids}]}, {**good, "extra": 1},
                 {"requests": [good["requests"][0]] * 300}):
        send(f"body {str(body)[:30]}", body)
    send("not a frame: json", json.dumps(good).encode())
    send("wrong content type", pack(good), headers={"Content-Type": "application/json"})
    send("no content type", pack(good), headers={})
    send("huge body", pack({**good, "pad": b"\0" * (2 * 2**20)}))
    send("huge content-length", b"x", headers={"Content-Type": FRAME_TYPE,
                                              "Content-Length": str(2**40)})
    frame = pack(good)
    for cut in range(60):  # truncated, grown, corrupted frames
        k = rng.randrange(len(frame))
        choice = cut % 3
        if choice == 0:
            body = frame[:k]
        elif choice == 1:
            body = frame + os.urandom(rng.randrange(1, 50))
        else:
            body = bytearray(frame)
            for _ in range(8):
                body[rng.randrange(0, min(len(body), 24))] = rng.randrange(256)
            body = bytes(body)
        send(f"mangled frame {cut}", body)
    for n in range(50):
        send(f"random bytes {n}", os.urandom(rng.randrange(0, 400)))
    return bad


def test_malformed_requests_get_4xx_and_the_server_serves_on(server, toy_session):
    ids = toy_session.tokenize("the wind was")
    with server.connect("c4") as s:
        before = s.trace("the wind was", layers=[0, 3], max_new_tokens=4)
        steps = s.status()["steps_seen"]
        bad = _malformed(server, ids, toy_session.info["vocab_size"], toy_session.hidden_size,
                         toy_session.n_layers)
        assert len(bad) >= 200
        for what, kw in bad:
            headers = {**server.headers("c4"), **kw.pop("headers")}
            if "Content-Length" in headers:  # a lying length: the raw socket says it
                resp = _raw_post(server, headers, kw["content"])
            else:
                resp = httpx.post(server.url + "/v1/generate", headers=headers, timeout=60, **kw)
            assert 400 <= resp.status_code < 500, (what, resp.status_code, resp.text[:300])
        for method, path in (("GET", "/v1/generate"), ("POST", "/v1/info"),
                             ("GET", "/v1/nope"), ("DELETE", "/v1/status")):
            resp = httpx.request(method, server.url + path, headers=server.headers("c4"))
            assert 400 <= resp.status_code < 500, (method, path)
        st = s.status()
        assert st["steps_seen"] == steps  # none of it reached the engine
        assert st["records"] == 0 and st["unfinished"] == 0 and st["calls"] == 0
        after = s.trace("the wind was", layers=[0, 3], max_new_tokens=4)
    assert after[0].text == before[0].text
    assert torch.equal(after[0].activations(), before[0].activations())


def _raw_post(server, headers: dict, body: bytes) -> httpx.Response:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/generate HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
        reply = sock.recv(65536).decode(errors="replace")
    code = int(reply.split(" ", 2)[1])
    return httpx.Response(code, text=reply)


def test_a_server_restart_is_a_clear_error_then_reconnect_works(server, toy_session):
    want = toy_session.trace("the wind was", layers=[2], max_new_tokens=4)
    s = server.connect("c6")
    server.stop()
    with pytest.raises(vlens.VlensError, match="not answering"):
        s.trace("the wind was", layers=[2], max_new_tokens=4)
    server.start()
    with server.connect("c6") as again:
        got = again.trace("the wind was", layers=[2], max_new_tokens=4)
    # the server keeps nothing between calls: the old session works again too
    old = s.trace("the wind was", layers=[2], max_new_tokens=4)
    s.close()
    for run in (got, old):
        assert run[0].text == want[0].text
        torch.testing.assert_close(run[0].activations(), want[0].activations(),
                                   atol=1e-5, rtol=0)


def _plan_body(ids: list[int], plan: dict, vectors: dict | None = None,
               max_tokens: int = 3, stream: bool = False, **params) -> dict:
    """A /v1/generate body around a hand-made plan (made canonical, as a
    Session writes plans, so that only its content is on trial)."""
    from vllm import SamplingParams

    from vlens.protocol.plan import parse_plan

    plan = {"v": 4, "tag": "h-0", "index": 0, "clone": False, "prompt_len": len(ids),
            "reads": [], "adds": [], "sets": [], "edits": [], **plan}
    sp = SamplingParams(max_tokens=max_tokens, skip_reading_prefix_cache=True,
                        extra_args={"vlens": parse_plan(plan).to_wire()},
                        **{"temperature": 0.0, **params})
    return {"requests": [{"ids": ids, "params": params_to_wire(sp)}],
            "vectors": vectors or {}, "stream": stream}


def _generated_plans(ids: list[int], sites, n_layers: int, vid: str, seed: int = 0) -> list:
    """Hand-made plans: every site x reduction x span kind, with steering
    adds and sets on the same site, and counts at and past the plan limits."""
    from vlens.checks import PLAN_MAX, REDUCES

    rng = random.Random(seed)
    plen, total = len(ids), len(ids) + 2  # max_tokens 3: two tokens fed back
    spans = {"all": (0, -1), "prompt": (0, plen), "generated": (plen, -1), "tuple": (1, 3),
             "past the end": (0, total + 4)}
    plans = []
    for site in sites:
        for reduce in (*REDUCES, "max"):
            for kind, (start, stop) in spans.items():
                layers = sorted(rng.sample(range(n_layers), rng.randint(1, n_layers)))
                k = rng.choice([1, 5, 1001]) if reduce == "logit_lens" else rng.choice([0, 0, 3])
                plan = {"reads": [{"site": site, "layers": layers, "reduce": reduce, "k": k}]}
                if rng.random() < 0.5:
                    plan["adds"] = [{"site": site, "layer": rng.randrange(n_layers), "vec": vid,
                                     "scale": rng.choice([1.0, -2.0, 50.0, 1e30]),
                                     "start": start, "stop": stop,
                                     "relative": rng.random() < 0.5}]
                else:
                    plan["sets"] = [{"site": site, "layer": rng.randrange(n_layers),
                                     "vec": rng.choice(["", vid]), "lo": 0, "hi": -1,
                                     "start": start, "stop": stop}]
                plans.append((f"{site} {reduce} {kind}", plan))
    read = {"site": "resid_post", "layers": [0], "reduce": "norm", "k": 0}
    add = {"site": "resid_post", "layer": 1, "vec": vid, "scale": 0.5, "start": 0, "stop": -1,
           "relative": False}
    one_set = {"site": "mlp_out", "layer": 2, "vec": "", "lo": 0, "hi": 8, "start": 0,
               "stop": -1}
    for part, entry in (("reads", read), ("adds", add), ("sets", one_set)):
        for n in (PLAN_MAX[part], PLAN_MAX[part] + 1, 20 * PLAN_MAX[part]):
            plans.append((f"{n} {part}", {part: [entry] * n}))
    return plans


def test_generated_plans_get_4xx_or_run_and_never_touch_another_client(server, toy_session):
    ids = toy_session.tokenize("the wind was")
    hidden, n_layers = toy_session.hidden_size, toy_session.n_layers
    from vlens.edits import vector_id

    vec = torch.randn(hidden, generator=torch.Generator().manual_seed(3))
    vid = vector_id(vec)
    vec_wire = {"data": vec.numpy().tobytes(), "shape": [hidden], "dtype": "float32"}
    plans = _generated_plans(ids, toy_session.sites, n_layers, vid)
    assert len(plans) >= 200
    with server.connect("c5") as victim:
        alone = victim.trace(["the wind", "a fox"], layers=[0, 3], max_new_tokens=4)
        stop = threading.Event()
        seen: list = []

        def victim_calls() -> None:
            deadline = time.monotonic() + 300
            while not stop.is_set() and len(seen) < 300 and time.monotonic() < deadline:
                seen.append(victim.trace(["the wind", "a fox"], layers=[0, 3],
                                         max_new_tokens=4))

        worker = threading.Thread(target=victim_calls)
        worker.start()
        outcomes = {"4xx": 0, "ran": 0}
        try:
            for what, plan in plans:
                body = _plan_body(ids, plan, {vid: vec_wire})
                resp = server.post(pack(body), "c3")
                if 400 <= resp.status_code < 500:
                    outcomes["4xx"] += 1
                    continue
                assert resp.status_code == 200, (what, resp.status_code, resp.text[:300])
                done = _frames(resp)[-1]
                assert done["kind"] == "done", (what, done)
                [rec] = done["records"]["h-0"]
                assert rec["errors"] == [], (what, rec["errors"])
                assert bool(rec["reads"]) == bool(plan.get("reads")), what
                outcomes["ran"] += 1
        finally:
            stop.set()
            worker.join(300)
    assert outcomes["4xx"] >= 50 and outcomes["ran"] >= 30, outcomes
    assert len(seen) >= 3
    for run in seen:
        for got, want in zip(run, alone, strict=True):
            assert got.output_token_ids == want.output_token_ids
            torch.testing.assert_close(got.activations(), want.activations(), atol=1e-5, rtol=0)
    st = server.status()
    assert st["records"] == 0 and st["calls"] == 0 and st["unfinished"] == 0


def test_an_overflowing_steer_on_the_server_spoils_no_other_client(server, toy_session):
    short = ["the wind", "a happy fox was", "the sky"]
    d = toy_session.direction(["a happy fox"], ["a sad fox"], layer=1)
    sites = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
    steers = [vlens.Steer(d, layer=layer, scale=100.0, relative=True, site=site)
              for layer in range(toy_session.n_layers) for site in sites]
    with server.connect("c6") as other, server.connect("c2") as wild:
        clean = other.trace(short, layers=[0, 3], max_new_tokens=4)
        with pytest.raises(vlens.VlensError, match="would overflow this float32 model"):
            wild.trace("the wind was", steer=vlens.Steer(d, layer=1, scale=1e37))
        with pytest.raises(vlens.EngineError, match="turned this request's values non-finite"):
            wild.trace(["the wind was happy and"] * 2, steer=steers, max_new_tokens=8)
        ids = toy_session.tokenize("the wind was")
        from vlens.edits import vector_id

        vec = {"data": d.numpy().tobytes(), "shape": [d.numel()], "dtype": "float32"}
        add = {"site": "resid_post", "layer": 1, "vec": vector_id(d), "scale": 1e37,
               "start": 0, "stop": -1, "relative": False}
        resp = server.post(pack(_plan_body(ids, {"adds": [add]}, {vector_id(d): vec})), "c2")
        assert resp.status_code == 400 and "a write may put at most" in resp.json()["error"]
        with pytest.raises(vlens.VlensError, match=r"Ablate \(layer 1, resid_post\) mean: .* would overflow"):
            wild.trace("the wind was", ablate=vlens.Ablate(
                "resid_post", 1, kind="mean", mean=torch.full((d.numel(),), 1e30)))
        huge = torch.full((d.numel(),), 1e30)
        one_set = {"site": "resid_post", "layer": 1, "vec": vector_id(huge), "lo": 0, "hi": -1,
                   "start": 0, "stop": -1}
        wire = {vector_id(huge): {"data": huge.numpy().tobytes(), "shape": [huge.numel()],
                                  "dtype": "float32"}}
        resp = server.post(pack(_plan_body(ids, {"sets": [one_set]}, wire)), "c2")
        assert resp.status_code == 400 and "a write may put at most" in resp.json()["error"]
        after = other.trace(short, layers=[0, 3], max_new_tokens=4)
    for a, b in zip(after, clean, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert torch.equal(a.activations(), b.activations())
    assert server.status()["nonfinite_writes"] > 0


def _settled(server, timeout: float = 60) -> dict:
    """The server's status once it holds no call, request or record."""
    deadline = time.monotonic() + timeout
    while (st := server.status())["calls"] or st["unfinished"] or st["records"]:
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    return st


def _partial_post(server, client: str, length: int, sent: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = (f"POST /v1/generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            f"{server.tokens[client]}\r\nContent-Type: {FRAME_TYPE}\r\n"
            f"Content-Length: {length}\r\n\r\n")
    sock.sendall(head.encode() + sent)
    return sock


def test_slow_bodies_count_as_calls_and_end_at_their_deadline(server):
    """A body that trickles in holds one of its client's call slots (so a
    client cannot park bodies outside the limits) until --body-timeout; a
    call behind it waits in line, then runs."""
    socks = [_partial_post(server, "c9", 500_000, b"\0" * 1000) for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        while server.status()["calls"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with server.connect("c9") as s:
            got: list = []
            waiter = threading.Thread(target=lambda: got.append(
                s.trace("the wind was", max_new_tokens=2)[0].text))
            waiter.start()  # waits in line behind the two bodies
            while server.status()["queued"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            for sock in socks:  # --body-timeout 3
                reply = sock.recv(65536).decode(errors="replace")
                assert reply.startswith("HTTP/1.1 408"), reply[:200]
            waiter.join(60)
            assert got and got[0]  # then ran
            _settled(server)
    finally:
        for sock in socks:
            sock.close()


def test_a_reader_that_stops_reading_ends_its_call(server, toy_session):
    ids = toy_session.tokenize("the wind was")
    layers = list(range(toy_session.n_layers))
    reads = [{"site": site, "layers": layers, "reduce": "full", "k": 0}
             for site in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")]
    # about 18 MB of reads: more than the socket buffers on both sides hold
    body = pack(_plan_body(ids, {"reads": reads}, max_tokens=400, stream=True,
                           ignore_eos=True))
    before = server.status()["stalled"]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    try:
        head = (f"POST /v1/generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                f"{server.tokens['c8']}\r\nContent-Type: {FRAME_TYPE}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        sock.sendall(head.encode() + body)  # then never reads the answer
        deadline = time.monotonic() + 120
        while server.status()["stalled"] == before:
            assert time.monotonic() < deadline, server.status()
            time.sleep(0.3)
        st = _settled(server)
        assert st["plans"] == 0 and st["your_calls"] == 0
    finally:
        sock.close()


def test_an_idle_connection_outlives_the_clients_keep_alive(server):
    """A client reuses an idle connection until its own expiry (httpx, the
    openai client and vlens.connect: 5 s). The server must not close it
    first: a request sent as the server closes is lost ("Server disconnected
    without sending a response"). One raw connection, idle past 5 s, serves
    its next request."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        for pause in (0.0, 6.0):  # uvicorn's default keep-alive is 5 s
            time.sleep(pause)
            conn.request("GET", "/v1/status", headers=server.headers("c11"))
            resp = conn.getresponse()
            assert resp.status == 200, resp.status
            assert json.loads(resp.read())["calls"] >= 0
            assert conn.sock is not None  # still the same connection
            assert (resp.getheader("connection") or "").lower() != "close"
    finally:
        conn.close()


def test_a_head_that_does_not_arrive_gets_408_and_a_closed_connection(server):
    """uvicorn alone holds a silent connection, or one that stops inside its
    request line or headers, for good (a socket each, no token needed).
    Every head must arrive within --body-timeout (3 s here): on a new
    connection, in mid-header, and for the second request of a reused one."""
    import http.client

    head = f"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.tokens['c11']}"
    silent = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    partial = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    reused = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        partial.sendall(head.encode())  # no blank line: the headers never end
        reused.request("GET", "/v1/status", headers=server.headers("c11"))
        first = reused.getresponse()  # read whole, to its content-length
        assert first.status == 200 and json.loads(first.read())["calls"] >= 0
        reused.sock.sendall(b"GET /v1/sta")  # the next request stops in its line
        start = time.monotonic()
        for sock in (silent, partial, reused.sock):
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert b"head took over 3 s" in reply, reply
        # 3 s, give or take a busy machine; uvicorn alone waited for ever
        assert time.monotonic() - start < 25
        assert server.status()["calls"] == 0  # and the server serves on
    finally:
        silent.close()
        partial.close()
        reused.close()


def test_calls_past_the_queue_get_429_with_retry_after_on_live_connections(server):
    """--max-concurrent 2, --max-queued 8: of 14 calls at once, 10 run (2,
    then the 8 in line, in turn) and 4 are refused with Retry-After; every
    client's connection serves its next request (no refusal drops one)."""
    auth = server.headers("c6")
    model = httpx.get(server.url + "/v1/models", headers=auth).json()["data"][0]["id"]
    body = {"model": model, "prompt": "the wind was", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0.0}
    clients = [httpx.Client(timeout=120) for _ in range(14)]
    got: list = [None] * 14
    barrier = threading.Barrier(14)

    def call(i: int) -> None:
        barrier.wait()
        got[i] = clients[i].post(server.url + "/v1/completions", json=body, headers=auth)

    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(14)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        codes = sorted(r.status_code for r in got)
        assert codes == [200] * 10 + [429] * 4, codes
        texts = {r.json()["choices"][0]["text"] for r in got if r.status_code == 200}
        assert len(texts) == 1  # the same answer, waited for or not
        for r in got:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert err["code"] == 429 and "queues 8 more" in err["message"], err
        again = [c.post(server.url + "/v1/completions", json={**body, "max_tokens": 2},
                        headers=auth) for c in clients]
        assert [r.status_code for r in again] == [200] * 14
    finally:
        for c in clients:
            c.close()
    st = _settled(server)
    assert st["queued"] == 0


def test_work_per_call_is_bounded(server, toy_session):
    ids = toy_session.tokenize("the wind was")
    one = _plan_body(ids, {}, max_tokens=2, n=16, temperature=1.0)
    body = {**one, "requests": one["requests"] * 20}  # 20 prompts x n=16 = 320 sequences
    resp = server.post(pack(body), "c7")
    assert resp.status_code == 413 and "320 sequences" in resp.json()["error"]
    from vllm import SamplingParams

    long_ids = [ids[i % len(ids)] for i in range(500)]
    sp = params_to_wire(SamplingParams(max_tokens=1, prompt_logprobs=0))
    body = {"requests": [{"ids": long_ids, "params": sp}] * 256, "vectors": {},
            "stream": False}
    resp = server.post(pack(body), "c7")
    assert resp.status_code == 413 and "log-probabilities" in resp.json()["error"]
    read = {"site": "resid_post", "layers": [0], "reduce": "logit_lens", "k": 5}
    resp = server.post(pack(_plan_body(ids, {"reads": [read] * 2000})), "c7")
    assert resp.status_code == 400 and "at most 64 reads" in resp.json()["error"]
    _settled(server)


def test_vector_ids_are_hashes_and_tags_are_per_call(server, toy_session):
    """What a peer sharing one token could do: replace a vector under its
    id, or collect another call's records under the same tag."""
    from vlens.edits import vector_id

    ids = toy_session.tokenize("the wind was")
    a = torch.randn(toy_session.hidden_size, generator=torch.Generator().manual_seed(5))
    b = -a
    add = {"site": "resid_post", "layer": 1, "vec": vector_id(a), "scale": 1.0, "start": 0,
           "stop": -1, "relative": False}
    forged = {vector_id(a): {"data": b.numpy().tobytes(), "shape": [a.numel()],
                             "dtype": "float32"}}
    resp = server.post(pack(_plan_body(ids, {"adds": [add]}, forged)), "c1")
    assert resp.status_code == 400 and "not the hash of its data" in resp.json()["error"]
    # two calls at once under one token and one tag: each gets its own records
    prompts = [ids, toy_session.tokenize("a happy fox was")]
    got: list = [None, None]

    def call(i: int, barrier) -> None:
        body = pack(_plan_body(prompts[i], {}, max_tokens=40, ignore_eos=True))
        barrier.wait()
        got[i] = _frames(server.post(body, "c1"))[-1]

    _in_threads(call, 2)
    for i, done in enumerate(got):
        [rec] = done["records"]["h-0"]
        assert rec["token_ids"][:len(prompts[i])] == prompts[i]
    _settled(server)


def test_the_token_file_is_taken_up_without_a_restart(server):
    original = server.token_file.read_text()
    new = "new-token-" + os.urandom(12).hex()
    try:
        server.token_file.write_text(original + f"late {new}\n")
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/v1/info", headers={"Authorization": f"Bearer {new}"},
                        timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the new token never worked"
            time.sleep(0.5)
        with vlens.connect(server.url, token=new + "\n") as s:  # a newline read with it
            assert s.trace("the wind was", max_new_tokens=2)[0].text
        # a file that does not load (world-readable) keeps the tokens as they were
        server.token_file.chmod(0o644)
        server.token_file.write_text(original)
        time.sleep(2.5)
        assert server.get("/v1/info", "c0").status_code == 200
        assert httpx.get(server.url + "/v1/info", headers={"Authorization": f"Bearer {new}"},
                         timeout=30).status_code == 200
    finally:
        server.token_file.write_text(original)
        server.token_file.chmod(0o600)
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/v1/info", headers={"Authorization": f"Bearer {new}"},
                    timeout=30).status_code != 401:
        assert time.monotonic() < deadline, "the removed token still works"
        time.sleep(0.5)


def test_a_stream_of_deltas_rebuilds_each_partial_run(server, toy_session):
    """The server streams each step's new tokens only; every partial Run the
    client yields still holds everything so far, and grows by prefix."""
    with server.connect("c4") as s:
        parts = list(s.stream(["the wind was", "a fox"], max_new_tokens=10, ignore_eos=True))
        want = s.trace(["the wind was", "a fox"], max_new_tokens=10, ignore_eos=True)
    *partial, final = parts
    partial = [p for p in partial if len(p) == 2]  # both prompts under way
    assert len(partial) >= 3
    for i in range(2):
        seen = [p[i].output_token_ids for p in partial]
        for a, b in zip(seen, seen[1:]):
            assert b[:len(a)] == a  # each step extends the last
        assert seen[-1] == final[i].output_token_ids[:len(seen[-1])]
        assert final[i].output_token_ids == want[i].output_token_ids
        assert final[i].text == want[i].text


def test_a_connected_harvest_equals_a_local_one(server, toy_session, tmp_path):
    """s.harvest over vlens.connect (issue 52): the same shards' worth of
    rows as a local Session's harvest of the same texts, in text order."""
    from vlens.models.world import example_prompts

    texts = example_prompts(12, seed=7)
    kw = {"layers": [0, 3], "sites": ["resid_post", "z"], "shard_tokens": 40}
    local = toy_session.harvest(texts, out=tmp_path / "local", **kw)
    with server.connect("c11") as s:
        remote = s.harvest(texts, out=tmp_path / "remote", **kw)
    assert remote.complete and len(remote) == len(local) > 40
    assert [sh["texts"] for sh in remote.shards] == [sh["texts"] for sh in local.shards]
    assert len(remote.shards) > 1
    assert torch.equal(remote.token_ids, local.token_ids)
    for site in kw["sites"]:
        for layer in kw["layers"]:
            torch.testing.assert_close(remote.read(site, layer), local.read(site, layer),
                                       atol=1e-5, rtol=0)
