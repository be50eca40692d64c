"""OpenAI-compatible routes on ``vlens serve`` (the bundled model), driven
with the official ``openai`` package, and the server's named vectors and
SAEs over ``vlens.connect``.

One server, in vLLM's default compiled mode (test_serve.py's runs eager
unless VLENS_TEST_ENGINE=compiled), loads a steering vector
(``--vector mood=FILE``), the bundled SAE (``--sae toy=...``) and a chat
template; a local in-process Session of the same model is the reference
every answer must equal.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

import vlens

from test_serve import _TOY_TEMPLATE, _prompts, _Server  # noqa: I001 - the shared server

openai = pytest.importorskip("openai")

# with the other tests of OpenAI clients (tests/test_openai_clients.py,
# docs/openai.md's blocks): its server (compiled, ~1 min to start on a busy
# machine) then starts in one test process, not in both
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("openai-clients")]

TOKENS = 8


@pytest.fixture(scope="module")
def direction(toy_session):
    return toy_session.direction(["the wind was happy", "a happy fox"],
                                 ["the wind was sad", "a sad fox"], layer=1)


@pytest.fixture(scope="module")
def oai(tmp_path_factory, direction):
    from pathlib import Path

    from safetensors.torch import save_file

    import vlens.models

    folder = tmp_path_factory.mktemp("openai")
    save_file({"mood": direction.contiguous()}, str(folder / "mood.safetensors"))
    (folder / "template.jinja").write_text(_TOY_TEMPLATE)
    sae = Path(vlens.models.__file__).parent / "toyworld_sae"
    srv = _Server(folder, ("--vector", f"mood={folder / 'mood.safetensors'}",
                           "--sae", f"toy={sae}", "--chat-template",
                           str(folder / "template.jinja")))
    srv.start()
    assert "compiled (" in srv.log.read_text()  # the default
    srv.sae_dir = sae
    yield srv
    srv.stop()


def _client(srv, name: str = "c0"):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.tokens[name], max_retries=0)


def _model(srv) -> str:
    return _client(srv).models.list().data[0].id


def _complete(srv, prompt, vl=None, *, stream=False, name="c0", chat=False) -> str:
    c = _client(srv, name)
    kw = dict(model=_model(srv), temperature=0.0, max_tokens=TOKENS,
              extra_body={"vlens": vl} if vl else None)
    if chat:
        out = c.chat.completions.create(messages=prompt, stream=stream, **kw)
        if stream:
            return "".join(ch.choices[0].delta.content or "" for ch in out if ch.choices)
        return out.choices[0].message.content
    out = c.completions.create(prompt=prompt, stream=stream, **kw)
    if stream:
        return "".join(ch.choices[0].text for ch in out if ch.choices)
    return out.choices[0].text


@pytest.fixture
def chat_session(toy_session):
    toy_session.chat_template = _TOY_TEMPLATE
    yield toy_session
    toy_session.chat_template = None


def test_completions_and_chat_equal_a_local_session(oai, chat_session, direction):
    s = chat_session
    prompt = _prompts(0)[0]
    st = vlens.Steer(direction, layer=1, scale=4.0)
    cmp = s.compare(prompt, steer=st, max_new_tokens=TOKENS)
    assert cmp.baseline[0].text != cmp.steered[0].text  # the steer changes the answer
    body = {"steer": [{"vector": "mood", "layer": 1, "scale": 4.0}]}
    for stream in (False, True):
        assert _complete(oai, prompt, stream=stream) == cmp.baseline[0].text
        assert _complete(oai, prompt, body, stream=stream) == cmp.steered[0].text

    p = _prompts(1)
    conv = [{"role": "user", "content": p[0]}, {"role": "assistant", "content": p[1]},
            {"role": "user", "content": prompt}]
    st = vlens.Steer(direction, layer=1, scale=6.0, span="assistant")
    cmp = s.compare([conv], steer=st, max_new_tokens=TOKENS)
    n_assistant = sum(r == "assistant" for r in cmp.baseline[0].roles)
    assert n_assistant >= 5 and cmp.steered[0].steered_rows == n_assistant
    assert cmp.baseline[0].text != cmp.steered[0].text
    body = {"steer": [{"vector": "mood", "layer": 1, "scale": 6.0, "span": "assistant"}]}
    for stream in (False, True):
        assert _complete(oai, conv, stream=stream, chat=True) == cmp.baseline[0].text
        assert _complete(oai, conv, body, stream=stream, chat=True) == cmp.steered[0].text

    # an SAE by name: a feature's steer and a clamp, as the local SAE does them
    sae = vlens.SAE.load(oai.sae_dir)
    for entry, edit in (({"sae": "toy", "feature": 3, "scale": 8.0}, sae.steer(3, scale=8.0)),
                        ({"sae": "toy", "feature": 5, "value": 6.0},
                         vlens.Clamp(sae, feature=5, value=6.0))):
        key = "clamp" if "value" in entry else "steer"
        want = s.compare(prompt, **{key: edit}, max_new_tokens=TOKENS).steered[0].text
        assert _complete(oai, prompt, {key: [entry]}) == want
    # usage counts as vllm serve gives them
    out = _client(oai).completions.create(model=_model(oai), prompt=prompt, max_tokens=TOKENS,
                                          temperature=0.0)
    local = s.trace(prompt, max_new_tokens=TOKENS)[0]
    assert out.usage.prompt_tokens == len(local.prompt_token_ids)
    assert out.usage.completion_tokens == len(local.output_token_ids)


def test_saes_by_name_over_connect_equal_a_local_session(oai, toy_session):
    """#26: the server's SAEs, fetched by name: reads, steering and clamping
    as with the local SAE; an SAE the server did not load is refused."""
    local = vlens.SAE.load(oai.sae_dir)
    prompts = _prompts(2)
    with oai.connect("c1") as s:
        sae = s.sae("toy")
        assert sae.id == local.id and s.engine.saes["toy"]["d_sae"] == local.d_sae
        got = s.trace(prompts, saes=[sae], max_new_tokens=4)
        top = s.trace(prompts[0], saes=[sae], features_top_k=4, max_new_tokens=2)
        clamp = vlens.Clamp(sae, feature=5, value=6.0)
        cmp = s.compare(prompts[0], clamp=clamp, max_new_tokens=6)
        steered = s.trace(prompts[1], steer=sae.steer(3, scale=8.0), max_new_tokens=6)
        other = vlens.SAE(dict(local.weights), local.spec, local.site, local.layer)
        other.weights["b_enc"] = other.weights["b_enc"] + 1.0
        other = vlens.SAE(other.weights, local.spec, local.site, local.layer)
        with pytest.raises(vlens.VlensError, match="not one the server loaded"):
            s.trace(prompts[0], saes=[other], max_new_tokens=1)
        with pytest.raises(vlens.VlensError, match="no SAE named"):
            s.sae("nope")
    want = toy_session.trace(prompts, saes=[local], max_new_tokens=4)
    for g, w in zip(got, want, strict=True):
        # the server runs compiled, the reference eager: kernels differ in the last bits
        torch.testing.assert_close(g.features(sae), w.features(local), atol=1e-4, rtol=1e-5)
        assert g.features(sae).abs().sum() > 0
    want_top = toy_session.trace(prompts[0], saes=[local], features_top_k=4, max_new_tokens=2)
    torch.testing.assert_close(top[0].features(sae), want_top[0].features(local), atol=1e-4,
                               rtol=1e-5)
    want_cmp = toy_session.compare(prompts[0], clamp=vlens.Clamp(local, feature=5, value=6.0),
                                   max_new_tokens=6)
    assert cmp.steered[0].text == want_cmp.steered[0].text
    assert steered[0].text == toy_session.trace(
        prompts[1], steer=local.steer(3, scale=8.0), max_new_tokens=6)[0].text


def _bad_bodies() -> list[tuple[dict, str]]:
    """Malformed ``vlens`` bodies, each with the field its refusal must name."""
    steer = {"vector": "mood", "layer": 1, "scale": 2.0}
    feat = {"sae": "toy", "feature": 3, "scale": 2.0}
    clamp = {"sae": "toy", "feature": 3, "value": 2.0}
    ablate = {"site": "z", "layer": 1, "heads": [0]}
    bad = {
        "steer": (steer, {"vector": [None, 3, "nope", "", "a b", "mood!", "MOOD", "x" * 65,
                                     ["mood"], {"a": 1}],
                          "layer": [None, -1, 99, 1.5, "1", True, 3.0, 10**12, [1]],
                          "scale": [None, "big", [], 1e30, True, "1", {}, -1e30],
                          "site": [None, "nowhere", 3, "attn_pattern", "", "resid_post ",
                                   ["resid_post"]],
                          "span": ["everywhere", [5, 2], [1], 700, "user", [0, 500], "", [0],
                                   [-1, 3], ["a", "b"], {"a": 1}],
                          "relative": ["yes", 1, None], "bogus": [1], "feature": [2]}),
        "feat": (feat, {"sae": ["nope", 5, None], "feature": [-1, 1024, "3", None, 2.5, 10**9, [], True],
                        "layer": [3], "site": ["resid_post"], "scale": ["x", 1e30]}),
        "clamp": (clamp, {"sae": ["nope", 7], "feature": [-1, 5000, None, "1"],
                          "value": [1e5, "x", None, True, -1e9, 1e4 + 1, [], "6"], "span": ["bad", [3, 1]],
                          "extra": [1]}),
        "ablate": (ablate, {"site": ["nowhere", 5, "", "resid"],
                            "layer": [-2, 50, "0", None, 1.0, True],
                            "kind": ["half", 3], "heads": [[99], "0", [], [0, 0], [-1], [0.5], [1, 1, 2], 3,
                                      [True]],
                            "mean": ["mood"], "span": ["sideways"], "x": [0]}),
    }
    required = {"steer": {"vector", "layer"}, "feat": {"feature"},
                "clamp": {"sae", "feature", "value"}, "ablate": {"site", "layer"}}
    out = []
    for label, (good, keys) in bad.items():
        kind = {"feat": "steer"}.get(label, label)
        for key, values in keys.items():
            for v in values:
                if v is None and key not in required[label]:
                    continue  # None: the key left out, which only a required key refuses
                entry = {**good, key: v} if v is not None else {
                    k: x for k, x in good.items() if k != key}
                where = f"vlens.{kind}[0]"
                out.append(({kind: [entry]}, f"{where}.{key}"))
    for v in (5, "str", [], True, 0.5):
        out.append((v, "vlens"))
    out += [({"bogus": []}, "vlens.bogus"), ({"steer": 5}, "vlens.steer"),
            ({"steer": [1]}, "vlens.steer[0]"), ({"steer": [{}]}, "vlens.steer[0].vector"),
            ({"steer": [steer] * 100}, "vlens.steer"), ({"clamp": [{}]}, "vlens.clamp[0].sae"),
            ({"ablate": [{"site": "z"}]}, "vlens.ablate[0].layer"),
            ({"steer": [steer, {**steer, "layer": 77}]}, "vlens.steer[1].layer"),
            ({"ablate": [{**ablate, "kind": "mean"}]}, "vlens.ablate[0].mean")]
    return out


def test_wrong_keys_and_malformed_bodies_are_refused_naming_the_field(oai, direction):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=oai.url + "/v1", api_key="wrong-" * 4,
                      max_retries=0).models.list()
    model = _model(oai)
    prompt = _prompts(3)[0]
    url = oai.url + "/v1/completions"
    headers = oai.headers("c2")
    assert httpx.post(url, json={"model": model, "prompt": prompt, "max_tokens": 4},
                      headers={"Authorization": "Bearer nope-nope-nope-nope"}).status_code == 401
    valid = {"steer": [{"vector": "mood", "layer": 1, "scale": 3.0}]}
    first = _complete(oai, prompt, valid, name="c2")
    bodies = _bad_bodies()
    assert len(bodies) >= 100
    with httpx.Client(timeout=60) as http:
        for vl, field in bodies:
            resp = http.post(url, headers=headers, json={
                "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                "vlens": vl})
            assert resp.status_code == 400, (vl, field, resp.text)
            err = resp.json()["error"]
            assert err["param"] == field and field in err["message"], (vl, field, err)
        # a hand-made plan through vLLM's own extra-args field gets nowhere
        resp = http.post(url, headers=headers, json={
            "model": model, "prompt": prompt, "max_tokens": 4,
            "vllm_xargs": {"vlens_plan": "x"}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "vllm_xargs"
    assert _complete(oai, prompt, valid, name="c2") == first
    status = oai.status()
    assert status["hook_errors"] == 0 and status["calls"] == 0

    # a participant's own vector: its calls see it, another's do not
    with oai.connect("c3") as s:
        assert s.register_vector("mine", direction * 2) == 1
        with pytest.raises(vlens.VlensError, match="1-64"):
            s.register_vector("no good", direction)
    mine = {"steer": [{"vector": "mine", "layer": 1, "scale": 1.5}]}
    assert _complete(oai, prompt, mine, name="c3") == _complete(
        oai, prompt, valid, name="c2")  # 2 x 1.5 = 3
    with pytest.raises(openai.BadRequestError) as err:
        _complete(oai, prompt, mine, name="c4")
    assert "unknown vector 'mine'" in str(err.value)
    assert err.value.body["param"] == "vlens.steer[0].vector"


def test_sixteen_streamed_chats_half_steered_equal_their_runs_alone(oai, direction):
    prompts = _prompts(4) + _prompts(5) + _prompts(6) + _prompts(7)
    gen = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(16):
        conv = [{"role": "user", "content": prompts[i % len(prompts)]}]
        name = f"c{i // 2}"  # two streams per participant: its limit
        vl = None
        if i % 2:
            vec = direction + 0.3 * direction.norm() * torch.randn(
                direction.shape, generator=gen) / direction.shape[0] ** 0.5
            with oai.connect(name) as s:
                s.register_vector("own", vec)
            vl = {"steer": [{"vector": "own", "layer": 1, "scale": 2.0 + i / 4}]}
        jobs.append((conv, vl, name))
    alone = [_complete(oai, conv, vl, stream=True, name=name, chat=True)
             for conv, vl, name in jobs]
    before = oai.status()["steps_seen"]
    got: list[str | None] = [None] * 16
    barrier = threading.Barrier(16)

    def run(i: int) -> None:
        conv, vl, name = jobs[i]
        barrier.wait()
        got[i] = _complete(oai, conv, vl, stream=True, name=name, chat=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    together = oai.status()["steps_seen"] - before
    assert got == alone
    assert len({a for a, (_, vl, _) in zip(alone, jobs) if vl}) >= 4  # different steers
    # 16 calls of TOKENS tokens each, one after another, take >= 16 * TOKENS steps
    assert together < 16 * TOKENS / 2, together


# -- one parser: the Session's and the server's answers to any body (#50) ------------

def _body_strategy():
    """``vlens`` bodies, right and wrong: every field drawn from values that
    pass and values that do not, keys left out at random."""
    from hypothesis import strategies as st

    span = st.one_of(
        st.sampled_from(["all", "prompt", "generated", "last", "user", "bogus", ""]),
        st.integers(-14, 14),
        st.lists(st.one_of(st.integers(-14, 14), st.none()), min_size=2, max_size=2),
        st.builds(lambda p: {"positions": p}, st.lists(st.integers(-14, 14), max_size=4)),
        st.sampled_from([[1], [1, 2, 3], 2.5, {"rows": [1]}, None]))

    def entry(**fields):
        drawn = st.fixed_dictionaries({}, optional={k: v for k, v in fields.items()})
        return drawn.map(lambda d: {k: v for k, v in d.items() if v is not None})

    steer = entry(vector=st.sampled_from(["mood", "nope", 3]),
                  sae=st.sampled_from(["toy", None, None, None]),
                  feature=st.sampled_from([None, None, 3, -1, 5000]),
                  layer=st.sampled_from([0, 1, 3, 99, -1, 1.5, "1", True]),
                  scale=st.sampled_from([0.5, 2.0, -3.0, 1e30, "x", True]),
                  site=st.sampled_from(["resid_post", "mlp_out", "nowhere", "attn_pattern"]),
                  span=span, relative=st.sampled_from([False, True, 1]),
                  bogus=st.sampled_from([None, None, None, None, 1]))
    ablate = entry(site=st.sampled_from(["resid_post", "z", "mlp_out", "nowhere"]),
                   layer=st.sampled_from([0, 1, 99, "all", [0, 1], "0"]),
                   kind=st.sampled_from(["zero", "mean", "half"]),
                   heads=st.sampled_from([None, [0], [0, 0], [9], "0"]),
                   mean=st.sampled_from([None, None, "mood", "nope"]),
                   direction=st.sampled_from([None, None, None, "mood"]), span=span)
    clamp = entry(sae=st.sampled_from(["toy", "toy", "nope"]),
                  feature=st.sampled_from([3, 12, -1, 5000, "1"]),
                  value=st.sampled_from([1.0, 6.0, -2.0, 1e5, "x"]), span=span)
    return st.fixed_dictionaries({}, optional={
        "steer": st.lists(steer, max_size=2), "ablate": st.lists(ablate, max_size=2),
        "clamp": st.lists(clamp, max_size=2), "bogus": st.just([])})


def _served_rules(srv) -> dict[str, float]:
    text = srv.get("/metrics", "c3").text
    out = {}
    for line in text.splitlines():
        if line.startswith("vlens_rule_calls{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


def test_the_session_and_the_server_accept_and_refuse_the_same_bodies(oai, direction,
                                                                       toy_session):
    """A property test over ``vlens`` bodies: the Session's path (the body's
    typed models, then its edits fitted to the prompt, in this process) and
    ``vlens serve``'s (a real /v1/completions call) accept the same bodies
    and refuse the same ones naming the same field; on an accepted body
    each side runs the Steer rule once per steer and clamp and the Ablate
    rule once per ablation layer (vlens.checks.rules.CALLS, and the
    server's /metrics)."""
    from hypothesis import HealthCheck, example, given, settings

    from vlens.checks import rules
    from vlens.remote.schema import BodyError, parse_body

    facts = toy_session.facts
    vectors = {"mood": direction}
    saes = {"toy": vlens.SAE.load(oai.sae_dir)}
    ids = toy_session.tokenize(_prompts(2)[0])
    max_tokens = 3
    url, headers, model = oai.url + "/v1/completions", oai.headers("c3"), _model(oai)
    seen = {"accepted": 0, "refused": 0}

    # a fixed seed (the same bodies every run) and, beside the drawn ones, a few
    # bodies that must pass, so both sides' acceptance is always exercised
    @settings(max_examples=80, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=_body_strategy())
    @example(body={"steer": [{"vector": "mood", "layer": 1, "scale": 2.0, "span": [1, None]}]})
    @example(body={"ablate": [{"site": "z", "layer": 1, "heads": [0], "span": "last"}]})
    @example(body={"clamp": [{"sae": "toy", "feature": 3, "value": 6.0,
                              "span": {"positions": [0, -1]}}]})
    @example(body={"steer": [{"sae": "toy", "feature": 12, "scale": 2.0, "span": -2}],
                   "ablate": [{"site": "resid_post", "layer": "all", "direction": "mood"}]})
    @example(body={"ablate": [{"site": "mlp_out", "layer": 0, "kind": "mean", "mean": "mood",
                               "span": "prompt"}]})
    def check(body):
        before = dict(rules.CALLS)
        try:
            edits = parse_body(json.loads(json.dumps(body)), facts, vectors.get, saes.get)
            steers, _ = edits.fit(facts, len(ids), max_tokens)
            local = None
        except BodyError as exc:
            local = exc.field
        ran = {k: rules.CALLS[k] - before.get(k, 0) for k in ("steer", "ablate")}
        served_before = _served_rules(oai)
        resp = httpx.post(url, headers=headers, timeout=60, json={
            "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "vlens": body})
        if local is None:
            assert resp.status_code == 200, (body, resp.text)
            seen["accepted"] += 1
            n_steer = len(edits.steers)
            n_layers = sum(len(ab.layers(facts.n_layers)) for ab in edits.ablates)
            assert ran == {"steer": n_steer, "ablate": n_layers}, (body, ran)
            served = _served_rules(oai)
            assert {k: served.get(k, 0) - served_before.get(k, 0) for k in ran} == ran, body
        else:
            assert resp.status_code == 400, (body, local, resp.text)
            assert resp.json()["error"]["param"] == local, (body, local, resp.json())
            seen["refused"] += 1

    check()
    assert seen["accepted"] >= 5 and seen["refused"] >= 20, seen  # both sides exercised
    assert oai.status()["hook_errors"] == 0
