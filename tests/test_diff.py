"""vlens.diff on two live engines: per-token KL, logprobs and activation
differences equal a Hugging Face computation on both models; tokenizers that
disagree are refused before anything runs; two Sessions on different models
work side by side, and closing one leaves the other serving."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import vlens
from vlens.errors import VlensError

from conftest import _session

pytestmark = pytest.mark.engine

PROMPTS = ["w5 w17 w3 w99 w42", "w200 w7 w7 w150 w8 w61 w9 w30"]


@pytest.fixture(scope="module")
def tuned_llama(models_dir):
    """A second tiny Llama on the same tokenizer as ``tiny_llama`` (other weights)."""
    from vlens.tiny import make_tiny_model

    return make_tiny_model(models_dir / "llama-tuned", "llama", layers=3, seed=11)


@pytest.fixture(scope="module")
def swapped_llama(models_dir, tiny_llama):
    """``tiny_llama`` with two of its tokenizer's ids swapped: w5 <-> w6."""
    path = models_dir / "llama-swapped"
    if not path.exists():
        shutil.copytree(tiny_llama, path)
        spec = json.loads((path / "tokenizer.json").read_text())
        vocab = spec["model"]["vocab"]
        vocab["w5"], vocab["w6"] = vocab["w6"], vocab["w5"]
        (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


@pytest.fixture(scope="module")
def stopping_llama(models_dir, tuned_llama, llama_session):
    """``tuned_llama`` (the same weights) whose generation config also stops
    at the third token it writes greedily after ``PROMPTS[1]``: that
    continuation ends early, on a token that is never fed back."""
    path = models_dir / "llama-tuned-stopping"
    if not path.exists():
        shutil.copytree(tuned_llama, path)
        ids = list(llama_session.prompts(PROMPTS[1])[0].ids)
        for _ in range(3):
            ids.append(int(_hf(tuned_llama, ids)[0][-1].argmax()))
        config = path / "generation_config.json"
        spec = json.loads(config.read_text()) if config.exists() else {}
        spec["eos_token_id"] = [2, ids[-1]]
        config.write_text(json.dumps(spec))
    return path


def _hf(path, ids):
    """Hugging Face: the log-probabilities after each token ``[T, vocab]``
    and every layer's residual output ``[layers, T, hidden]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = []
    hooks = [layer.register_forward_hook(
        lambda _m, _a, out: got.append((out[0] if isinstance(out, tuple) else out)[0].clone()))
        for layer in model.model.layers]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    for h in hooks:
        h.remove()
    return logits.float().log_softmax(-1), torch.stack(got)


def test_diff_equals_hugging_face(llama_session, tiny_llama, tuned_llama, stopping_llama):
    # each model reads its own text as it writes it; the tuned model stops
    # early after prompt 1 (its last token never fed back), so that text is
    # read teacher-forced afterwards: both ways are checked against HF
    tuned = _session(stopping_llama, reuse=False, max_model_len=512)
    try:
        d = vlens.diff(llama_session, tuned, PROMPTS, max_new_tokens=6)
    finally:
        tuned.close()
    assert len(d) == 2 and d.layers == [0, 1, 2] and d.sites == ["resid_post"]
    stopped = d.text(1, "tuned")
    assert 1 <= len(stopped.ids) - stopped.n_prompt <= 3, stopped.ids
    frame = d.to_frame()
    assert set(frame.columns) >= {"prompt", "position", "token", "kl", "logprob_base",
                                  "logprob_tuned"}
    cache = {}
    for i in range(len(d)):
        for which in ("prompt", "base", "tuned"):
            t = d.text(i, which)
            lb, ab = cache.setdefault(("b", *t.ids), _hf(tiny_llama, t.ids))
            lt, at = cache.setdefault(("t", *t.ids), _hf(tuned_llama, t.ids))
            kl = (lt.exp() * (lt - lb)).sum(-1)
            torch.testing.assert_close(t.kl, kl, atol=1e-4, rtol=0)
            nxt = torch.tensor(t.ids[1:])[:, None]
            torch.testing.assert_close(t.logprob_base[1:], lb[:-1].gather(1, nxt)[:, 0],
                                       atol=1e-4, rtol=0)
            torch.testing.assert_close(t.logprob_tuned[1:], lt[:-1].gather(1, nxt)[:, 0],
                                       atol=1e-4, rtol=0)
            assert torch.isnan(t.logprob_base[0])
            torch.testing.assert_close(t.norm(), (at - ab).norm(dim=-1), atol=1e-4, rtol=1e-5)
            cos = torch.nn.functional.cosine_similarity(at, ab, dim=-1)
            torch.testing.assert_close(t.cosine["resid_post"], cos, atol=1e-4, rtol=0)
            if which != "prompt":  # each model's own continuation is its greedy one
                own = lb if which == "base" else lt
                n = t.n_prompt
                assert t.ids[n:] == own[n - 1:-1].argmax(-1).tolist()
        assert torch.equal(d.kl(i), d.text(i, "prompt").kl)
        assert len(d.kl(i)) == len(d.text(i, "prompt").ids)
    # the direction: the mean of each prompt's mean difference over its tokens ("prompt":
    # every token, BOS included, as in every call; slice(1, None) leaves the BOS out)
    rows = [d.text(i).delta["resid_post"][1] for i in range(2)]
    torch.testing.assert_close(d.direction(1), torch.stack([r.mean(0) for r in rows]).mean(0))
    torch.testing.assert_close(d.direction(1, slice(1, None)),
                               torch.stack([r[1:].mean(0) for r in rows]).mean(0))
    with pytest.raises(vlens.VlensError, match=r"write \[0, 2\] for those positions"):
        d.direction(1, (0, 2))
    assert d.direction(1, "last").shape == (llama_session.hidden_size,)
    lens = d.lens(2, first=3, k=5)
    assert list(lens["rank"]) == [1, 2, 3, 4, 5] and lens["prob"].is_monotonic_decreasing
    fig = d.figure(1)
    assert len(fig.data[-1].z) == 3  # the heatmap: one row per layer
    with pytest.raises(VlensError, match="layer 7 was not read"):
        d.direction(7)
    with pytest.raises(VlensError, match="span"):
        d.direction(1, span="middle")


def test_mismatched_tokenizer_refused_before_anything_runs(llama_session, swapped_llama):
    other = _session(swapped_llama, reuse=False, max_model_len=256)
    try:
        steps = [s.status()["steps_seen"] for s in (llama_session, other)]
        with pytest.raises(VlensError, match="tokenizers of .*differ: 'w5'") as err:
            vlens.diff(llama_session, other, PROMPTS)
        assert str(llama_session.model) in str(err.value) and str(other.model) in str(err.value)
        assert [s.status()["steps_seen"] for s in (llama_session, other)] == steps
    finally:
        other.close()
    with pytest.raises(VlensError, match="closed"):
        vlens.diff(llama_session, other, PROMPTS)


def test_two_models_side_by_side_and_one_closed(llama_session, tuned_llama):
    def read(s):
        t = s.trace(PROMPTS, max_new_tokens=5, layers=[0, 2])
        return [(x.token_ids, x.logprobs, x["resid_post"]) for x in t]

    def same(a, b):
        for (ia, la, ra), (ib, lb, rb) in zip(a, b):
            assert ia == ib and la == lb and torch.equal(ra, rb)

    alone = read(llama_session)  # before the second model's engine exists
    tuned = _session(tuned_llama, reuse=False, max_model_len=512)
    try:
        tuned_first = read(tuned)
        d = vlens.diff(llama_session, tuned, PROMPTS[:1], max_new_tokens=3, layers=[1])
        assert d.layers == [1] and float(d.kl(0).max()) > 0
        same(read(llama_session), alone)
        same(read(tuned), tuned_first)
    finally:
        tuned.close()
    assert tuned.closed
    same(read(llama_session), alone)  # the other still serves, unchanged


def test_bad_input(llama_session, tmp_path):
    with pytest.raises(VlensError, match="tuned must be a vlens Session"):
        vlens.diff(llama_session, "model", PROMPTS)
    with pytest.raises(VlensError, match="max_new_tokens"):
        vlens.diff(llama_session, llama_session, PROMPTS, max_new_tokens=-1)
    with pytest.raises(VlensError, match="attn_pattern"):
        vlens.diff(llama_session, llama_session, PROMPTS, sites=["attn_pattern"])
    d = vlens.diff(llama_session, llama_session, PROMPTS, max_new_tokens=0, layers=[0])
    assert float(d.kl(1).max()) < 1e-6  # a model against itself
    with pytest.raises(VlensError, match="max_new_tokens=0"):
        d.text(0, "tuned")
    from vlens.widgets import DiffView

    view = DiffView(d)
    assert view.divergence is None and not view.error
    assert len(view.heatmap.data) >= 2  # the KL row's text and the heatmap
    saved = view.snapshot(tmp_path / "diff.html")
    assert "plotly" in saved.read_text()
    view.index = 1
    assert not view.error
    with pytest.raises(TypeError, match="vlens Diff"):
        DiffView("not a diff")


def test_bundled_pair_shares_the_story_words(toy_session):
    """The chat model's vocabulary extends the story model's: stories diff
    (KL over the shared ids), requests are refused naming the chat-only token."""
    from vlens.models import chat_world as cw, toychat_path, world

    chat = _session(toychat_path(), reuse=False)
    n_chat = len(chat.tokenizer)
    try:
        with pytest.raises(VlensError, match=r"holds '<user>' \(id \d+\), which .*toychat"):
            vlens.diff(toy_session, chat, [cw.conversation(cw.chat_requests(True, 1)[0])])
        d = vlens.diff(toy_session, chat, world.steering_prompts("sad", 2), max_new_tokens=6,
                       layers=[0, 5])
    finally:
        chat.close()
    assert d.shared_vocab == len(toy_session.tokenizer)
    for i in range(2):
        t = d.text(i, "tuned")
        assert torch.isfinite(t.kl).all() and float(t.kl.max()) > 0
        assert float(t.outside_base.abs().max()) < 1e-6  # the story model has no other ids
        assert max(t.ids) < d.shared_vocab
    lens = d.lens(0, through="tuned", k=20)
    assert lens["token_id"].max() < n_chat


def test_diff_figures_are_pure():
    from vlens.plots import diff_figure, diff_texts

    fig = diff_figure(["<s>", "a", "b"], [0.0, 0.5, 1.0], [[1, 2, 3], [4, 5, 6]], [0, 3],
                      n_prompt=2)
    heat = fig.data[-1]
    assert list(heat.y) == ["L0", "L3"] and [list(r) for r in heat.z] == [[1, 2, 3], [4, 5, 6]]
    cells = [s for s in fig.layout.shapes if s.name == "token cell"]
    assert len(cells) == 3 and cells[0].fillcolor != cells[2].fillcolor  # KL 0 vs the largest
    with pytest.raises(ValueError, match="3 tokens"):
        diff_figure(["a", "b", "c"], [0.0], [[1, 2, 3]], [0])
    two = diff_texts([["a", "b"], ["a", "c", "d"]], [[0.1, 0.2], [0.1, 0.3, 0.0]],
                     ["story", "chat"], n_prompt=1, divergence=1)
    assert len([s for s in two.layout.shapes if s.name == "token cell"]) == 5
    assert [s for s in two.layout.shapes if s.name == "first divergence"]
