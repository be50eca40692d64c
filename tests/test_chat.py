"""Conversations as prompts, roles as spans, tokens a person can read (#25).

Two tiny models with tokenizers trained here (vlens.tiny_chat): byte-level
BPE (the GPT-2 / Llama-3 kind) and Metaspace with byte fallback (the
SentencePiece kind of Llama-2 and Gemma); each runs the three chat template
shapes (Llama-3, Gemma, ChatML) through ``Session.chat_template``. One
engine per tokenizer kind. Hugging Face values come from a fresh process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vlens
from vlens.errors import VlensError
from vlens.prompts import content_spans, normalise
from vlens.tiny_chat import CHAT_TEMPLATES, TOKENIZER_KINDS, make_chat_model, make_chat_tokenizer
from _hf_forks import run_code

SYSTEM = "You are a helpful assistant."
CONV = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Where is the station?"},
    {"role": "assistant", "content": "It is near the river."},
    {"role": "user", "content": "Tell me a story about a fox."},
]
UNICODE = [
    {"role": "user", "content": "Naïve résumé at the café: déjà vu 🙂 日本語 ok"},
]

_HF = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
path, batches, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
with torch.no_grad():
    hs = [torch.stack(model(torch.tensor([ids]), output_hidden_states=True).hidden_states[:-1])[:, 0]
          for ids in batches]
torch.save(hs, out)
"""


def _hf_resid_pre(path, id_lists, tmp_path):
    out = tmp_path / "hf.pt"
    proc = run_code(_HF, path, json.dumps(id_lists), out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def _ids(tok, conv, template):
    ids = tok.apply_chat_template(conv, chat_template=template, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module", params=TOKENIZER_KINDS)
def chat(request, models_dir):
    """(kind, model folder, Session) for one tokenizer kind."""
    from tests.conftest import _session

    path = make_chat_model(models_dir / f"chat-{request.param}", request.param, "llama3",
                           layers=2, seed=5)
    s = _session(path, max_model_len=512)
    yield request.param, path, s
    s.close()


# -- without an engine: the forms and their errors ------------------------------

@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_forms_and_batches_are_told_apart(kind):
    tok = make_chat_tokenizer(kind, "chatml")
    one = normalise(CONV, tok, 1000)
    assert len(one) == 1 and one[0].ids == _ids(tok, CONV, None)
    batch = normalise([CONV, "plain words", {"prompt_token_ids": one[0].ids}], tok, 1000)
    assert [p.kind for p in batch] == ["chat", "text", "ids"]
    assert batch[2].ids == batch[0].ids and batch[2].text == batch[0].text
    assert batch[1].ids == tok("plain words")["input_ids"] and set(batch[1].roles) == {None}
    opts = normalise({"messages": CONV, "chat_template": CHAT_TEMPLATES["gemma"]}, tok, 1000)
    assert opts[0].ids == _ids(tok, CONV, CHAT_TEMPLATES["gemma"])


@pytest.mark.parametrize("value,match", [
    ([CONV[0], "text"], r"mixes messages"),
    ([1, 2, 3], r"prompt_token_ids"),
    ([[{"role": "user"}]], r"message 0: each message needs a string 'role' and a string"),
    ({"prompt_token_ids": [10**6]}, r"outside the vocabulary"),
    ({"prompt_token_ids": []}, r"non-empty list of ints"),
    ({"messages": CONV, "temperature": 1}, r"unknown keys \['temperature'\]"),
    ([3.5], r"prompt 0 is a float, not a string, a conversation or token ids"),
    ([], r"prompts is empty"),
])
def test_bad_prompts_are_clear_errors(value, match):
    tok = make_chat_tokenizer("byte_level", "chatml")
    with pytest.raises(VlensError, match=match):
        normalise(value, tok, 1000)


def test_a_conversation_without_a_template_says_so():
    tok = make_chat_tokenizer("byte_level", "chatml")
    tok.chat_template = None
    with pytest.raises(VlensError, match="no chat template"):
        normalise(CONV, tok, 1000)


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_readable_tokens_without_an_engine(kind):
    from vlens.tokens import TokenReader

    tok = make_chat_tokenizer(kind, "gemma")
    reader = TokenReader(tok)
    assert reader.kind == kind
    text = "Where is the café?\n  Tell me 🙂 日本"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    shown = reader.texts(ids)
    assert "".join(shown).replace("<0xF0><0x9F><0x99><0x82>", "🙂") \
        .replace("<0xE6><0x97><0xA5><0xE6><0x9C><0xAC>", "日本") == text
    assert reader.text(tok.convert_tokens_to_ids("<start_of_turn>")) == "<start_of_turn>"


def test_whitespace_is_drawn_one_way_everywhere():
    from vlens.plots import token_labels
    from vlens.tokens import visible

    assert visible(" the\n\t") == "\u00b7the\u21b5\u21e5" and visible("") == "\u2205"
    assert token_labels([" a", "\n", "<s>"]) == ["0:\u00b7a", "1:\u21b5", "2:&lt;s&gt;"]
    js = (Path(vlens.__file__).parent / "widgets" / "token_span.js").read_text()
    for ch, mark in [(" ", "\\u00b7"), ("\\n", "\\u21b5"), ("\\t", "\\u21e5")]:
        assert f"/{ch}/g, \"{mark}\"" in js, (ch, mark)  # the chips draw the same marks


# -- acceptance 1 to 3, on each tokenizer kind ------------------------------------

def test_ids_and_reads_equal_hugging_face_for_every_template(chat, tmp_path):
    kind, path, s = chat
    tok = s.tokenizer
    runs = []
    for name, template in CHAT_TEMPLATES.items():
        s.chat_template = template
        try:
            t = s.trace(CONV, sites=["resid_pre"], max_new_tokens=1)[0]
        finally:
            s.chat_template = None
        assert t.prompt_token_ids == _ids(tok, CONV, template), (kind, name)
        assert t.prompt_text == tok.apply_chat_template(CONV, chat_template=template,
                                                        add_generation_prompt=True,
                                                        tokenize=False)
        runs.append(t)
    ref = _hf_resid_pre(path, [t.prompt_token_ids for t in runs], tmp_path)
    for t, expected in zip(runs, ref):
        diff = (t.activations("resid_pre") - expected).abs().max().item()
        assert diff <= 1e-5, f"{kind}: resid_pre differs from transformers by {diff}"
    assert (ref[0][0] - ref[0][-1]).abs().max() > 1e-2  # the layers differ


def _expected_roles(tok, text):
    """Each token's role from the template's character offsets."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = content_spans(text, CONV)
    assert [r for r, *_ in spans] == [m["role"] for m in CONV]  # every message found
    return [next((r for r, a, b in spans if e > s and s < b and e > a), None)
            for s, e in enc["offset_mapping"]]


def test_roles_mark_exactly_the_content_tokens(chat):
    kind, _, s = chat
    for name, template in CHAT_TEMPLATES.items():
        s.chat_template = template
        try:
            t = s.trace(CONV, layers=[0], max_new_tokens=3)[0]
        finally:
            s.chat_template = None
        n = len(t.prompt_token_ids)
        assert len(t.roles) == len(t.tokens) == t.n_tokens
        # the reply being written is the assistant's (#40)
        assert t.roles[n:] == ["assistant"] * (t.n_tokens - n)
        assert t.roles[:n] == _expected_roles(s.tokenizer, t.prompt_text), (kind, name)
        # the tokens of each role read back as that role's messages
        for role in ("system", "user", "assistant"):
            got = "".join(tok for tok, r in zip(t.tokens[:n], t.roles[:n]) if r == role)
            want = "".join(m["content"] for m in CONV if m["role"] == role)
            assert got.replace(" ", "") == want.replace(" ", ""), (kind, name, role)
        assert None in t.roles[:n]  # the template's own tokens


def test_steer_over_the_user_span_changes_exactly_those_rows(chat):
    kind, _, s = chat
    torch.manual_seed(0)
    v = torch.randn(s.hidden_size)
    base = s.trace(CONV, layers=[1], sites=["resid_pre"], max_new_tokens=1)[0]
    st = vlens.Steer(v, layer=0, span="user")
    steered = s.trace(CONV, layers=[1], sites=["resid_pre"], max_new_tokens=1, steer=st)[0]
    user = torch.tensor([r == "user" for r in base.roles])
    assert user.sum() >= 8 and steered.steered_rows == int(user.sum())
    diff = steered.activations("resid_pre")[0] - base.activations("resid_pre")[0]
    assert (diff[user] - v).abs().max() <= 1e-4, kind
    assert diff[~user].abs().max() == 0.0, kind
    ablated = s.trace(CONV, layers=[1], sites=["resid_pre"], max_new_tokens=1,
                      ablate=vlens.Ablate("resid_post", 0, span="assistant"))[0]
    assistant = torch.tensor([r == "assistant" for r in base.roles])
    rows = ablated.activations("resid_pre")[0]
    assert rows[assistant].abs().max() <= 1e-6 and rows[~assistant].abs().max(-1).values.min() > 1e-3
    # the reply being written is the assistant's: "assistant" covers it too (#40)
    reply = s.trace(CONV, layers=[1], sites=["resid_pre"], max_new_tokens=4,
                    steer=vlens.Steer(v, layer=0, span="assistant"))[0]
    n = len(reply.prompt_token_ids)
    mine = [r == "assistant" for r in reply.roles]
    assert len(mine) > n and all(mine[n:]) and sum(mine[:n]) >= 3
    assert reply.steered_rows == sum(mine), (reply.steered_rows, sum(mine))
    with pytest.raises(VlensError, match="plain string with no roles"):
        s.trace("Where is the station?", steer=st, max_new_tokens=1)
    with pytest.raises(VlensError, match="has no system message content"):
        s.trace(CONV[1:], steer=vlens.Steer(v, layer=0, span="system"), max_new_tokens=1)


def test_tokens_read_as_text_and_join_back(chat):
    kind, _, s = chat
    t = s.trace(UNICODE, layers=[0], max_new_tokens=2)[0]
    shown = "".join(t.tokens)
    for bad in ("\ufffd", "Ġ", "▁", "Ċ"):
        assert bad not in shown, (kind, bad)
    assert "<0xF0>" in shown  # the emoji, split into byte tokens, shows its bytes
    assert len(t.offsets) == len(t.prompt_token_ids)
    a = s.trace(CONV, layers=[0], max_new_tokens=1)[0]
    assert "".join(a.tokens) == a.prompt_text  # ASCII: the tokens join back exactly
    assert all(a.prompt_text[x:y] == tok for (x, y), tok in zip(a.offsets, a.tokens)
               if y > x and tok.strip())
    assert "\n" in a.tokens and " the" in a.tokens  # whitespace kept, not a marker


# -- acceptance 5: the workflows take conversations ------------------------------

def _asking(word):
    return [{"role": "user", "content": f"Tell me a story about a {word}."}]


def test_workflows_take_conversations(chat):
    kind, _, s = chat
    torch.manual_seed(1)
    d = s.direction([_asking("fox"), _asking("crow")], [_asking("station"), CONV], layer=0)
    assert d.shape == (s.hidden_size,) and d.abs().max() > 0
    st = vlens.Steer(d, layer=0, scale=8.0, span="user")
    cmp = s.compare([CONV, _asking("fox")], steer=st, max_new_tokens=3)
    assert cmp.steered[0].prompt_token_ids == cmp.baseline[0].prompt_token_ids
    assert cmp.steered[0].steered_rows == sum(r == "user" for r in cmp.baseline[0].roles)
    sw = s.sweep(CONV, steer=st, scales=[0.0, 4.0], max_new_tokens=2)
    assert sw.runs[1][0].steered_rows > 0 and sw.runs[0][0].steered_rows == 0
    # a random model may predict the same next token for both: name two answers
    p = s.patch(_asking("fox"), _asking("crow"), layers=[0, 1], span="user",
                answer=(5, 6))
    users = [k for k, r in enumerate(s.prompts(_asking("fox"))[0].roles) if r == "user"]
    assert p.grid.shape == (2, len(users)) and list(p.positions) == users
    with pytest.raises(VlensError, match="one conversation alone is wrapped in a list"):
        s.direction(CONV, [CONV], layer=0)
