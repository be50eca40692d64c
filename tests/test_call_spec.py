"""One way in: every Session method's keywords checked by name before
anything runs (typos name the closest keyword, old names their new one,
sampling settings matched against vLLM's SamplingParams), real signatures
on the streams. Pure: the checks run before a method touches its Session,
so the real methods are called on no Session at all."""

from __future__ import annotations

import inspect

import pytest
import torch

import vlens
from vlens.checks import ModelFacts, check_read
from vlens.errors import VlensError
from vlens.keywords import SAMPLING
from vlens.protocol.plan import Read
from vlens.session import Session

FACTS = ModelFacts(n_layers=4, hidden_size=8, sites=("resid_post", "z"),
                   writable=("resid_post", "z"), n_heads=2, head_dim=4, vocab_size=50,
                   max_model_len=64)


def test_sampling_names_are_vllms():
    from vllm import SamplingParams

    fields = set(SamplingParams.__struct_fields__)
    assert set(SAMPLING) <= fields, sorted(set(SAMPLING) - fields)


@pytest.mark.parametrize("method, kwargs, named", [
    ("trace", {"layer": 3}, "layers="),
    ("trace", {"temprature": 0.5}, "temperature="),
    ("trace", {"query_heads": [0]}, "heads="),
    ("stream", {"site": "z"}, "sites="),
    ("stream", {"query_heads": [0]}, "heads="),
    ("compare", {"stear": None}, "steer="),
    ("stream_compare", {"max_tokens_new": 3}, "max_new_tokens="),
    ("sweep", {"scale": [1.0]}, "scales="),
    ("stream_sweep", {"abalte": None}, "ablate="),
    ("patch", {"positions": [0]}, "span="),
    ("patch", {"per_head": True}, "heads='all'"),
    ("stream_patch", {"per_head": True}, "heads='all'"),
    ("stream_patch", {"layer": 1}, "layers="),
    ("direction", {"position": "last"}, "span="),
    ("generate", {"max_new_token": 3}, "max_new_tokens="),
])
def test_a_wrong_keyword_names_the_right_one(method, kwargs, named):
    fn = getattr(Session, method)
    with pytest.raises(TypeError, match=rf"{method}\(\).*{named}"):
        fn(None, "a prompt", **kwargs)


def test_sampling_settings_pass_the_name_check():
    # a real sampling name reaches the method (which then needs a Session)
    with pytest.raises(AttributeError):
        Session.trace(None, "a prompt", temperature=0.5, top_p=0.9)


def test_the_streams_have_their_calls_signatures():
    for call, stream in (("trace", "stream"), ("compare", "stream_compare"),
                         ("sweep", "stream_sweep"), ("patch", "stream_patch")):
        a = inspect.signature(getattr(Session, call)).parameters
        b = inspect.signature(getattr(Session, stream)).parameters
        assert list(a) == list(b), (call, stream)
        assert all(a[k].default == b[k].default for k in a if k != "self")
        assert not any(p.kind == p.VAR_KEYWORD and p.name == "options" for p in b.values())


def test_session_has_no_base_class_but_object():
    assert Session.__bases__ == (object,)


def test_old_edit_and_read_names_say_the_new_ones():
    with pytest.raises(TypeError, match="heads="):
        vlens.Ablate("z", 0, query_heads=[0])
    assert vlens.Ablate("z", 0, heads=[1, 0]).heads == (0, 1)
    with pytest.raises(TypeError, match="did you mean scale="):
        vlens.Steer(torch.ones(8), layer=0, scael=2.0)
    with pytest.raises(TypeError, match=r"Clamp\(\) takes value="):
        vlens.Clamp(None, 0, scale=2.0)
    with pytest.raises(VlensError, match="vocab_logprobs"):
        check_read(Read("resid_post", (3,), "logprobs"), FACTS)
    check_read(Read("resid_post", (3,), "vocab_logprobs"), FACTS)
