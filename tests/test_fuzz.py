"""Generated bad input thrown at trace / Steer / direction / compare / sweep.

Every case must end in a ``vlens.VlensError`` (the one documented class for
bad input) before anything reaches the engine, never a crash, a hang or a
silently wrong result; nothing of the call stays in the workers (records,
plans, edit functions), and afterwards the engine still serves a valid
request. Each test counts its own cases, so it passes run alone.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vlens
from vlens.errors import VlensError

pytestmark = pytest.mark.engine

N_LAYERS, HIDDEN = 3, 128  # the tiny Llama of conftest
# which kinds of bad vector / Steer the strategies drew (reported, not asserted)
KINDS: Counter = Counter()
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

bad_prompt = st.one_of(
    st.just(""), st.text(alphabet=" \t\n", max_size=5), st.none(), st.integers(),
    st.floats(allow_nan=True), st.binary(max_size=4), st.just([]),
    st.lists(st.one_of(st.integers(), st.none(), st.just(""), st.lists(st.text(max_size=3))),
             min_size=1, max_size=3),
    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
    st.integers(520, 900).map(lambda n: " ".join(["w1"] * n)),  # longer than max_model_len
)
bad_layers = st.one_of(
    st.integers(N_LAYERS, 10_000), st.integers(-10_000, -1), st.just([]),
    st.builds(lambda a, b: range(max(a, b), min(a, b)), st.integers(0, 2), st.integers(0, 2)),
    st.text(min_size=1, max_size=3), st.floats(), st.booleans(),
    st.lists(st.integers(N_LAYERS, 99), min_size=1, max_size=3),
    st.lists(st.one_of(st.text(max_size=2), st.floats()), min_size=1, max_size=3),
)
bad_site = st.one_of(
    st.text(max_size=12).filter(lambda s: s not in ("resid_pre", "resid_post", "attn_out", "mlp_out", "positions")),
    st.integers(), st.none(),
)
bad_tokens = st.one_of(st.integers(-5, 0), st.floats(), st.text(max_size=3), st.booleans())


@st.composite
def bad_vectors(draw):
    kind = draw(st.sampled_from(["size", "int", "nan", "inf", "2d", "list", "meta", "empty"]))
    KINDS[f"vector:{kind}"] += 1
    if kind == "size":
        return torch.randn(draw(st.integers(1, 400).filter(lambda n: n != HIDDEN)))
    if kind == "int":
        return torch.ones(HIDDEN, dtype=draw(st.sampled_from([torch.int64, torch.int32, torch.bool])))
    if kind in ("nan", "inf"):
        v = torch.randn(HIDDEN)
        v[draw(st.integers(0, HIDDEN - 1))] = math.nan if kind == "nan" else -math.inf
        return v
    if kind == "2d":
        return torch.randn(draw(st.integers(1, 3)), HIDDEN)
    if kind == "list":
        return [0.0] * HIDDEN
    if kind == "meta":
        return torch.empty(HIDDEN, device="meta")
    return torch.empty(0)


@st.composite
def bad_steers(draw):
    """A callable that builds a bad Steer (Steer itself may raise)."""
    good = torch.randn(HIDDEN)
    kind = draw(st.sampled_from(["vector", "layer", "span", "scale", "site", "type"]))
    KINDS[f"steer:{kind}"] += 1
    if kind == "vector":
        v = draw(bad_vectors())
        return lambda: vlens.Steer(v, layer=1)
    if kind == "layer":
        layer = draw(st.one_of(st.integers(N_LAYERS, 500), st.integers(-500, -1), st.floats(), st.booleans()))
        return lambda: vlens.Steer(good, layer=layer)
    if kind == "span":
        span = draw(st.one_of(
            st.tuples(st.integers(0, 50), st.integers(0, 50)).filter(lambda t: t[0] >= t[1]),
            st.tuples(st.integers(-50, -1), st.integers(0, 50)),
            st.tuples(st.integers(0, 5), st.integers(400, 10_000)),  # past the sequence
            st.text(max_size=8).filter(lambda s: s not in ("all", "prompt", "generated")),
            st.lists(st.integers(), min_size=3, max_size=4),
        ))
        return lambda: vlens.Steer(good, layer=1, span=span)
    if kind == "scale":
        scale = draw(st.one_of(st.just(math.nan), st.just(math.inf), st.booleans(), st.text(max_size=2)))
        return lambda: vlens.Steer(good, layer=1, scale=scale)
    if kind == "site":
        site = draw(st.sampled_from(["positions", "logits", "qkv", "", "resid"]))
        return lambda: vlens.Steer(good, layer=1, site=site)
    obj = draw(st.one_of(st.integers(), st.text(max_size=3), st.just(good)))
    return lambda: obj


def _refused(session, call, category: str, seen: Counter) -> None:
    seen[category] += 1
    before = session.engine.generate_calls
    with pytest.raises((VlensError, TypeError)):  # TypeError: a misspelt keyword
        call()
    assert session.engine.generate_calls == before, f"{category}: the engine ran"
    _nothing_left(session, category)


def _nothing_left(session, what: str = "") -> None:
    st = session.status()
    assert (st["records"], st["plans"], st["edit_fns"]) == (0, 0, 0), (what, st)


def _serves(session, seen: Counter, at_least: int) -> None:
    """Enough cases ran, and the engine then serves a normal call."""
    print(f"\nfuzz: {sum(seen.values())} bad inputs refused: {dict(seen)}")
    assert sum(seen.values()) >= at_least, seen
    run = session.trace(["w1 w2 w3", "w4"], layers=[0, 2], max_new_tokens=3)
    assert [t.n_tokens for t in run] == [6, 4]
    _nothing_left(session)


def test_bad_prompts(llama_session):
    seen: Counter = Counter()

    @FUZZ
    @given(prompt=bad_prompt)
    def case(prompt):
        _refused(llama_session, lambda: llama_session.trace(prompt, max_new_tokens=2), "prompt", seen)

    case()
    _serves(llama_session, seen, 40)


def test_bad_layers_sites_and_lengths(llama_session):
    seen: Counter = Counter()

    @FUZZ
    @given(layers=bad_layers, site=bad_site, tokens=bad_tokens)
    def case(layers, site, tokens):
        s = llama_session
        _refused(s, lambda: s.trace("w1 w2", layers=layers), "layers", seen)
        _refused(s, lambda: s.trace("w1 w2", sites=[site]), "site", seen)
        _refused(s, lambda: s.trace("w1 w2", max_new_tokens=tokens), "max_new_tokens", seen)

    case()
    _serves(llama_session, seen, 120)


def test_bad_steers(llama_session):
    seen: Counter = Counter()

    @FUZZ
    @given(make=bad_steers(), how=st.sampled_from(["trace", "compare", "sweep", "edit"]))
    def case(make, how):
        s = llama_session

        def call():
            steer = make()
            if how == "trace":
                return s.trace("w1 w2 w3", steer=steer, max_new_tokens=3)
            if how == "edit":  # an edit function rides along: it must not stay behind
                return s.trace("w1 w2 w3", steer=steer, max_new_tokens=3,
                               edit=lambda rows, ctx: None, edit_at=[("resid_post", 1)])
            if how == "compare":
                return s.compare("w1 w2 w3", steer=steer, max_new_tokens=3)
            return s.sweep("w1 w2 w3", steer=steer, scales=[0, 1], max_new_tokens=3)

        _refused(s, call, f"steer via {how}", seen)

    KINDS.clear()
    case()
    print(f"\nfuzz: bad Steers by kind: {dict(KINDS)}")
    _serves(llama_session, seen, 40)


def test_bad_direction_sweep_and_sampling(llama_session):
    seen: Counter = Counter()

    @FUZZ
    @given(
        which=st.sampled_from(["positive", "negative", "layer", "site", "span", "scales",
                               "sampling", "edit+sampling"]),
        junk=st.one_of(st.none(), st.integers(), st.text(max_size=4), st.just([]), st.just(""),
                       st.floats(allow_nan=True)),
    )
    def case(which, junk):
        s = llama_session
        ok = ["w1 w2", "w3 w4"]
        if which in ("positive", "negative"):
            kw = {"positive": ok, "negative": ok, "layer": 1, which: junk if junk != "w1" else None}
            call = lambda: s.direction(**kw)  # noqa: E731
        elif which == "layer":
            call = lambda: s.direction(ok, ok, layer=junk if junk not in (0, 1, 2) else 99)  # noqa: E731
        elif which == "site":
            call = lambda: s.direction(ok, ok, layer=1, site=str(junk) + "?")  # noqa: E731
        elif which == "span":
            call = lambda: s.direction(ok, ok, layer=1, span=f"{junk}!")  # noqa: E731
        elif which == "scales":
            st_ = vlens.Steer(torch.randn(HIDDEN), layer=1)
            scales = junk if not isinstance(junk, (int, float)) or isinstance(junk, bool) else [junk, "x"]
            call = lambda: s.sweep("w1", steer=st_, scales=scales)  # noqa: E731
        else:
            key = {None: "max_tokens", "": "temprature"}.get(junk if junk in (None, "") else None, "top_p")
            kw = {key: 3.5 if key == "top_p" else 1}
            if which == "edit+sampling":  # vLLM refuses these only when SamplingParams is built
                kw.update(edit=lambda rows, ctx: rows, edit_at=[("mlp_out", 0)])
            call = lambda: s.trace("w1", **kw)  # noqa: E731
        _refused(s, call, which, seen)

    case()
    _serves(llama_session, seen, 40)
