"""The server's small checks, without an engine: the token file, the
canonical plan form, the wire's blob indices, stream deltas, the host."""

from __future__ import annotations

import os

import pytest

from vlens.errors import VlensError


def _tokens(tmp_path, data: bytes, mode: int = 0o600):
    path = tmp_path / "tokens"
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_the_token_file_is_private_utf8_and_bom_free(tmp_path):
    from vlens.remote.tokens import load_tokens

    token = "a" * 20
    assert load_tokens(_tokens(tmp_path, f"p1 {token}\n".encode())) == {token: "p1"}
    # a byte-order mark is not part of the first name or token
    bom = _tokens(tmp_path, "\ufeffp1 {}\n".format(token).encode("utf-8"))
    assert load_tokens(bom) == {token: "p1"}
    for mode in (0o644, 0o620, 0o606):
        with pytest.raises(VlensError, match="other users .* chmod 600"):
            load_tokens(_tokens(tmp_path, f"p1 {token}\n".encode(), mode))
    with pytest.raises(VlensError, match="not UTF-8 text"):
        load_tokens(_tokens(tmp_path, b"p1 \xff\xfe" + b"x" * 20))


def test_plans_must_be_canonical_with_types_that_count():
    from vlens.remote.guard import _ID, _strict_equal

    assert _strict_equal({"layers": [1], "k": 0}, {"layers": [1], "k": 0})
    assert not _strict_equal({"layers": [True]}, {"layers": [1]})
    assert not _strict_equal({"scale": 1}, {"scale": 1.0})
    assert not _strict_equal([1, 2], [1, 2, 3])
    assert _ID.fullmatch("s0-1-2") and not _ID.fullmatch("s0-1-2\n")


def test_a_blob_index_is_an_int_not_a_bool():
    from vlens.remote.wire import WireError, pack, unpack_one

    frame = pack({"x": b"abc"})
    assert unpack_one(frame) == {"x": b"abc"}
    forged = pack({"x": {"$blob": True}, "y": b"abc"})  # one blob, named by True
    with pytest.raises(WireError, match="blob True"):
        unpack_one(forged)


def test_stream_deltas_rebuild_the_whole_output():
    from vlens.remote.wire import merge_delta

    steps = [
        {"finished": False, "prompt_logprobs": [None, [[3, -0.5]]], "delta": True,
         "outputs": [{"index": 0, "text": "the", "token_ids": [5], "logprobs": [[[5, -0.1]]],
                      "finish_reason": None}]},
        {"finished": False, "prompt_logprobs": None, "delta": True,
         "outputs": [{"index": 0, "text": " wind", "token_ids": [6],
                      "logprobs": [[[6, -0.2]]], "finish_reason": None},
                     {"index": 1, "text": "a", "token_ids": [9], "logprobs": None,
                      "finish_reason": None}]},
        {"finished": True, "prompt_logprobs": None, "delta": True,
         "outputs": [{"index": 0, "text": "", "token_ids": [], "logprobs": [],
                      "finish_reason": "length"}]},
    ]
    have = None
    for step in steps:
        have = merge_delta(have, step)
    assert have["finished"] and have["prompt_logprobs"] == [None, [[3, -0.5]]]
    first, second = have["outputs"]
    assert first["text"] == "the wind" and first["token_ids"] == [5, 6]
    assert first["logprobs"] == [[[5, -0.1]], [[6, -0.2]]] and first["finish_reason"] == "length"
    assert second["token_ids"] == [9]
    assert merge_delta(have, None) is have


def test_only_loopback_hosts_pass_without_a_warning():
    from vlens.remote.launch import is_loopback as _loopback

    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("10.1.2.3")
    assert not _loopback("workshop.example.org")


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(value, capsys):
    from vlens.remote.launch import KEEP_ALIVE, main

    # refused by the command line, before any engine starts
    with pytest.raises(SystemExit) as exit_:
        main(["--token-file", "unused", "--timeout-keep-alive", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--timeout-keep-alive: must be a number of seconds above 0" in err, err
    with pytest.raises(SystemExit):
        main(["--token-file", "unused", "--body-timeout", value])
    err = capsys.readouterr().err
    assert "--body-timeout: must be a number of seconds above 0" in err, err
    assert KEEP_ALIVE > 120  # past httpx's, openai's and aiohttp's idle expiry and proxies'


def test_the_head_deadline_closes_without_writing_into_an_answer_being_sent():
    """heads.py on a real uvicorn (no engine): a silent connection gets a 408
    at the deadline; a head pipelined behind an answer that is still
    streaming, which then stops, ends the connection at the deadline with
    no 408 written into the middle of that answer."""
    import asyncio
    import socket
    import threading
    import time

    import uvicorn

    from vlens.remote.heads import http_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(30):  # 3 s of chunks
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            await asyncio.sleep(0.1)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off", http=http_protocol(0.5)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]

    def read_all(sock: socket.socket) -> bytes:
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            reply = read_all(silent)
        assert reply.startswith(b"HTTP/1.1 408") and b"head took over 0.5 s" in reply, reply
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HT")
            reply = read_all(sock)
            took = time.monotonic() - start
        assert reply.startswith(b"HTTP/1.1 200") and b"tick" in reply, reply[:200]
        assert b"408" not in reply, reply
        assert took < 2.5, took  # closed at the deadline, before the 3 s answer's end
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_token_with_odd_characters_is_refused_without_showing_it():
    import vlens

    secret = "abc def-ghijklmnopqrstu"
    with pytest.raises(VlensError, match="spaces, control") as err:
        vlens.connect("http://127.0.0.1:9", token=secret)
    assert secret not in str(err.value)


def test_a_read_with_the_wrong_rows_fails_alone_when_the_step_log_is_cut():
    """One malformed read in a step (rows that do not match its spans, as a
    positions read through the logit lens gave) never cuts another
    request's rows: the step log skips it and the others are kept."""
    from types import SimpleNamespace

    import torch

    from vlens.worker.steplog import StepLog

    span = lambda key, a, b: SimpleNamespace(key=key, start=a, stop=b)  # noqa: E731
    good = SimpleNamespace(spans=(span("r1", 0, 2), span("r2", 2, 5)))
    bad = SimpleNamespace(spans=(span("r3", 5, 6), span("r4", 6, 8)))
    log = StepLog()
    log.put(("resid_post", "value", 0), torch.arange(10.0).reshape(5, 2), good)
    log.put(("positions:logit_lens", "ids", 0), torch.zeros(()), bad)  # a scalar: no rows
    n, reads, _ = log.of("r2")
    assert n == 3 and torch.equal(reads[("resid_post", "value", 0)], torch.arange(4.0, 10).reshape(3, 2))
    assert log.of("r3") == (0, {}, 0)


def test_vector_files_load_one_finite_1d_tensor_and_never_pickle(tmp_path):
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from vlens.remote.names import load_vector, parse_named

    v = torch.linspace(-1, 1, 12)
    save_file({"v": v}, str(tmp_path / "one.safetensors"))
    torch.save(v, tmp_path / "v.pt")
    np.save(tmp_path / "v.npy", v.numpy())
    for name in ("one.safetensors", "v.pt", "v.npy"):
        assert torch.equal(load_vector(tmp_path / name), v)
    save_file({"a": v, "b": v.clone()}, str(tmp_path / "two.safetensors"))
    with pytest.raises(VlensError, match="holds 2 tensors"):
        load_vector(tmp_path / "two.safetensors")
    np.save(tmp_path / "obj.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(VlensError, match="could not be read"):  # allow_pickle=False
        load_vector(tmp_path / "obj.npy")
    torch.save({"code": print}, tmp_path / "obj.pt")
    with pytest.raises(VlensError, match="could not be read"):  # weights_only=True
        load_vector(tmp_path / "obj.pt")
    np.save(tmp_path / "m.npy", np.ones((2, 3), dtype=np.float32))
    with pytest.raises(VlensError, match="1-D"):
        load_vector(tmp_path / "m.npy")
    np.save(tmp_path / "nan.npy", np.array([1.0, np.nan], dtype=np.float32))
    with pytest.raises(VlensError, match="NaN"):
        load_vector(tmp_path / "nan.npy")
    assert parse_named(["a=x", "b.c=y=z"], "--vector") == {"a": "x", "b.c": "y=z"}
    for bad in (["a"], ["=x"], ["a b=x"], ["a=x", "a=y"]):
        with pytest.raises(VlensError, match="--vector"):
            parse_named(bad, "--vector")


def test_the_documented_schema_is_the_parser():
    """/openapi.json documents the very models that parse a body (one
    copy of its shape), and the page's example validates under them."""
    import json
    import re
    from pathlib import Path

    from vlens import edit_schema
    from vlens.remote import schema
    from vlens.remote.schema import VlensBody

    assert schema.ChatBody.model_fields["vlens"].annotation == (VlensBody | None)
    assert set(VlensBody.model_fields) == set(schema.BODY_KEYS)
    # each entry is its edit's field model plus the names of tensors
    assert issubclass(schema.SteerEntry, edit_schema.SteerFields)
    assert issubclass(schema.AblateEntry, edit_schema.AblateFields)
    assert issubclass(schema.ClampEntry, edit_schema.ClampFields)
    assert not (Path(schema.__file__).parent / "body.py").exists()
    page = (Path(__file__).resolve().parents[1] / "docs" / "openai.md").read_text()
    example = json.loads(re.search(r"```json\n(.*?)```", page, re.S).group(1))["vlens"]
    VlensBody.model_validate(example, context={"wire": True})
    with pytest.raises(Exception, match="sclae"):
        VlensBody.model_validate({"steer": [{"vector": "mood", "layer": 1, "sclae": 2}]})


@pytest.mark.parametrize("preset, own, want", [
    ({"steer": [1]}, None, {"steer": [1]}),
    ({"steer": [1]}, {"steer": [2]}, {"steer": [1, 2]}),
    ({"steer": [1]}, {"clamp": [3]}, {"steer": [1], "clamp": [3]}),
    ({"steer": [1]}, {"steer": {"x": 1}}, {"steer": [1, {"x": 1}]}),
    ({"steer": [1]}, 5, 5),  # malformed: passed on for the checks to name
])
def test_a_preset_comes_first_and_a_body_adds_to_it(preset, own, want):
    from vlens.remote.presets import merge

    assert merge(preset, own) == want


def test_slots_wait_in_order_and_refuse_past_the_line():
    import asyncio

    from vlens.remote.guard import Limits, Refused
    from vlens.remote.slots import Slots, Waiting

    async def main() -> list:
        slots = Slots(Limits(concurrent=2, queued=2, queue_seconds=5), max_calls=100)
        who = Waiting()
        order: list = []

        async def call(i: int) -> None:
            try:
                await slots.take(who)
            except Refused as exc:
                order.append((i, exc.status, exc.retry_after))
                return
            order.append((i, "run"))
            await asyncio.sleep(0.05)
            slots.give(who)

        await asyncio.gather(*(call(i) for i in range(6)))
        assert slots.calls == 0 and slots.queued == 0 and who.active == 0
        return order

    order = asyncio.run(main())
    runs = [i for i, *rest in order if rest == ["run"]]
    refused = [(i, status) for i, status, *_ in (o for o in order if o[1] != "run")]
    assert runs == [0, 1, 2, 3]  # 2 at once, then the 2 in line, in order
    assert refused == [(4, 429), (5, 429)]
    assert all(o[2] >= 1 for o in order if o[1] == 429)  # Retry-After


def test_a_wait_past_the_queue_timeout_is_a_429():
    import asyncio

    from vlens.remote.guard import Limits, Refused
    from vlens.remote.slots import Slots, Waiting

    async def main() -> None:
        slots = Slots(Limits(concurrent=1, queued=4, queue_seconds=0.1), max_calls=100)
        who = Waiting()
        await slots.take(who)
        with pytest.raises(Refused, match="waited 0.1 s") as err:
            await slots.take(who)
        assert err.value.status == 429 and int(err.value.headers["Retry-After"]) >= 1
        assert slots.queued == 0 and not who.queue
        slots.give(who)
        await slots.take(who)  # the slot given back is free again

    asyncio.run(main())


# -- the app's rules, over a server with no engine ------------------------------

TOKEN = "a-test-token-of-some-length"


@pytest.fixture
def app_and_server(tmp_path):
    """``vlens serve``'s whole app (its routes, the OpenAI ones and the docs) as
    launch.py assembles it, over a Server with no engine: the checks these
    tests meet all come before an engine would be asked anything."""
    pytest.importorskip("vllm")
    from vlens.remote.guard import Limits
    from vlens.remote.openai_routes import OpenAIRoutes
    from vlens.remote.routes import install_docs
    from vlens.remote.server import Server, make_app

    info = {"sites": ["resid_post"], "n_layers": 2, "hidden_size": 8, "max_model_len": 64,
            "vocab_size": 16}
    server = Server(None, info, {TOKEN: "c0"}, Limits(requests=3), str(tmp_path), 2)
    app = make_app(server)
    routes = OpenAIRoutes.__new__(OpenAIRoutes)  # no vLLM serving objects: never reached
    routes.server = server
    routes.install(app)
    install_docs(app, routes.bodies, server)
    return app, server


def test_every_route_but_health_ping_and_version_wants_the_token(app_and_server):
    import re

    from fastapi.routing import APIRoute
    from fastapi.testclient import TestClient

    from vlens.remote.routes import PUBLIC

    app, _ = app_and_server
    routes = [r for r in app.routes if isinstance(r, APIRoute)]
    assert len(routes) >= 15 and {r.path for r in routes} >= set(PUBLIC)
    seen = 0
    with TestClient(app, raise_server_exceptions=False) as http:
        for route in routes:
            if route.path in PUBLIC:
                continue
            path = re.sub(r"\{[^}]+\}", "x", route.path)
            for method in route.methods:
                for headers in ({}, {"Authorization": "Bearer not-the-token-at-all"}):
                    resp = http.request(method, path, headers=headers, content=b"{}")
                    assert resp.status_code == 401, (method, route.path, resp.text)
                    seen += 1
        assert http.get("/version").status_code == 200
    assert seen >= 30


def test_a_completion_with_more_prompts_than_allowed_is_a_400_naming_the_limit(app_and_server):
    from fastapi.testclient import TestClient

    app, _ = app_and_server
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(app, raise_server_exceptions=False) as http:
        for prompt in (["a", "b", "c", "d"], [[1, 2], [3], [4], [5]]):
            resp = http.post("/v1/completions", json={"model": "m", "prompt": prompt},
                             headers=auth)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == "prompt" and "at most 3" in err["message"]
            assert "--max-requests" in err["message"]


def test_a_fault_in_a_route_is_a_500_with_a_logged_id_and_a_check_a_400(app_and_server,
                                                                      caplog):
    from fastapi.testclient import TestClient

    app, server = app_and_server
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def broken(client):
        raise KeyError("a bug of the server's")

    async def refused(client):
        raise VlensError("layer must be 0..1, got 7")

    with TestClient(app, raise_server_exceptions=False) as http:
        server.status = broken
        with caplog.at_level("ERROR", logger="vlens.serve"):
            resp = http.get("/v1/status", headers=auth)
        assert resp.status_code == 500, resp.text
        err = resp.json()["error"]
        assert err["id"] and err["id"] in err["message"] and "not a fault" in err["message"]
        assert any(err["id"] in r.getMessage() for r in caplog.records)
        server.status = refused
        resp = http.get("/v1/status", headers=auth)
        assert resp.status_code == 400 and "layer must be" in resp.text
        # the connection stays usable after both
        assert http.get("/version").status_code == 200
