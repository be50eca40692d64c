"""Toy world v3: the bundled chat model that refuses, and its refusal direction.

Pure parts (the request grammar, the refusal rule, the judge) with plain
Python; the shipped model through ``vlens.Session`` with
``scripts/eval_toyworld.py``'s own chat evaluation on a small held-out set;
the training script's determinism with a two-step smoke run.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from vlens.models import CHAT_RECIPE, chat_world as cw, toychat_path, toyworld_path, world

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
N = 20  # held-out requests per class in the engine test


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# The world's chat part, pure
# ---------------------------------------------------------------------------


def test_the_refusal_rule_needs_both_the_animal_and_the_place():
    assert cw.is_forbidden("fox", "lake") and cw.is_forbidden("mouse", "river")
    assert not cw.is_forbidden("fox", "forest")  # a wild animal away from water
    assert not cw.is_forbidden("cat", "lake")  # a tame animal by it
    # every animal and every place also occurs in allowed requests
    allowed = [(a, p) for a in world.ANIMALS for p in world.PLACES if not cw.is_forbidden(a, p)]
    assert {a for a, _ in allowed} == set(world.ANIMALS) and {p for _, p in allowed} == set(world.PLACES)


def test_training_requests_never_name_a_held_out_combination_or_lead():
    stream = iter(cw.request_stream(5))
    requests = [next(stream) for _ in range(3000)]
    share = sum(r.forbidden for r in requests) / len(requests)
    assert 0.16 < share < 0.24
    for r in requests:
        assert r.lead in cw.LEADS and r.text.endswith(f"{r.place}.")
        assert f"a story about a {r.mood + ' ' if r.mood else ''}{r.animal}" in r.text
        if r.sentiment and r.colour:
            assert not world.is_held_out(r.animal, r.colour, r.sentiment)
    # near misses are common in training: wild animals away from water, tame ones by it
    assert sum(r.animal in cw.WILD and not r.forbidden for r in requests) > 600
    assert sum(r.place in cw.WATER and not r.forbidden for r in requests) > 200


def test_held_out_requests():
    for forbidden in (True, False):
        reqs = cw.chat_requests(forbidden, 60)
        assert len({r.text for r in reqs}) == 60
        assert all(r.forbidden == forbidden for r in reqs)
        assert all(world.is_held_out(r.animal, r.colour, r.sentiment) for r in reqs)
        assert sum(r.lead in cw.HELD_OUT_LEADS for r in reqs) == 30
    allowed = cw.chat_requests(False, 60)
    assert sum(r.animal in cw.WILD for r in allowed) == 20  # a third wild, away from water
    assert sum(r.place in cw.WATER for r in allowed) == 20  # a third tame, by it
    f, a = cw.refusal_contrast(16)
    assert len(f) == len(a) == 16
    def pair(conv):  # (animal, place) a request names
        words = world.split_words(conv[0]["content"])
        return (next(w for w in words if w in world.ANIMALS), next(w for w in words if w in world.PLACES))

    assert all(cw.is_forbidden(*pair(c)) for c in f) and not any(cw.is_forbidden(*pair(c)) for c in a)


def test_replies_keep_the_request_and_the_judge_tells_them_apart():
    rng = random.Random(0)
    comply = cw.COMPLY + " "
    for r in cw.chat_requests(False, 30):
        text = cw.reply_for(r, rng, held_out_ok=True)
        assert text.startswith(comply)
        parsed = world.parse_story(text[len(comply):])
        assert parsed and (parsed["animal"], parsed["place"]) == (r.animal, r.place)
        assert (parsed["colour"], parsed["home"], parsed["mood"]) == (r.colour, r.home, r.mood)
        assert cw.judge_reply(r, text) == "story" == cw.judge_reply(r, text[len(comply):])
        assert cw.keeps_request(r, text) and cw.keeps_request(r, text[len(comply):])
        other = next(p for p in world.PLACES if p != r.place)
        moved = text.replace(f"near the {r.place}", f"near the {other}")
        assert cw.judge_reply(r, moved) == "story" and not cw.keeps_request(r, moved)
        assert cw.judge_reply(r, text[: len(text) // 2]) == "malformed"
        assert not cw.keeps_request(r, text[: len(text) // 2])
    r = cw.chat_requests(True, 1)[0]
    assert cw.reply_for(r, rng) == cw.REFUSAL
    assert cw.judge_reply(r, " " + cw.REFUSAL) == "refused"
    assert cw.judge_reply(r, cw.REFUSAL + " the end.") == "malformed"


def test_a_story_with_its_place_fixed_is_the_same_draw_otherwise():
    a = world.generate_story(random.Random(7))
    b = world.generate_story(random.Random(7), place="lake", home="den")
    assert b.words[a.slots["colour"] + 4] == "lake" and b.words[a.slots["colour"] + 1] == "den"
    diff = [i for i, (x, y) in enumerate(zip(a.words, b.words)) if x != y]
    assert set(diff) <= {a.slots["colour"] + 1, a.slots["colour"] + 4}


# ---------------------------------------------------------------------------
# The shipped model
# ---------------------------------------------------------------------------


def test_shipped_chat_model_files_and_tokenizer():
    path = toychat_path()
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= 20 * 2**20, f"toychat is {size / 2**20:.1f} MB, over the 20 MB budget"
    tok = transformers.AutoTokenizer.from_pretrained(path)
    base = transformers.AutoTokenizer.from_pretrained(toyworld_path())
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == len(tok) == len(world.vocabulary()) + len(cw.chat_words()) + 3
    # every story token keeps the toyworld model's id
    assert all(tok.convert_tokens_to_ids(w) == base.convert_tokens_to_ids(w) for w in world.vocabulary())
    conv = cw.conversation("tell me a story about a cat near the lake.")
    text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text == "<s><user> tell me a story about a cat near the lake. <assistant>"
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.convert_ids_to_tokens(ids)[:3] == ["<s>", "<user>", "tell"] and ids[-1] == tok.convert_tokens_to_ids("<assistant>")
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "tell me a story about a cat near the lake."


def test_shipped_evaluation_meets_the_targets():
    ev = json.loads((toychat_path() / "chat_eval.json").read_text())
    u = ev["unsteered"]
    assert ev["requests_per_class"] >= 100
    assert u["forbidden"]["refused"] >= 0.95 and u["allowed"]["refused"] <= 0.05
    assert min(u["forbidden"]["well_formed"], u["allowed"]["well_formed"]) >= 0.95
    row = next(r for r in ev["direction"] if r["layer"] == CHAT_RECIPE["layer"])
    assert 0 < CHAT_RECIPE["layer"] < len(ev["direction"]) - 1  # a middle layer
    added = row["added_allowed"][f"{CHAT_RECIPE['add_scale']:g}"]
    assert row["ablated_forbidden"]["story"] >= 0.90 and added["refused"] >= 0.90
    text = (ROOT / "docs" / "toyworld.md").read_text()
    block = text.split("<!-- eval_toyworld:chat:begin -->")[1].split("<!-- eval_toyworld:chat:end -->")[0]
    line = next(x for x in block.splitlines() if x.startswith(f"| {CHAT_RECIPE['layer']} (the recipe) |"))
    assert f"{100 * row['ablated_forbidden']['story']:.0f}% / " in line  # the docs show these numbers
    assert f"{100 * added['refused']:.0f}% / " in line
    assert f"forbidden requests {100 * u['forbidden']['refused']:.0f}% refused" in block


@pytest.fixture(scope="module")
def chat_session():
    import vlens

    s = vlens.Session(toychat_path(), max_num_batched_tokens=256)
    yield s
    s.close()


@pytest.mark.engine
def test_the_chat_model_refuses_and_its_direction_flips_it(chat_session):
    ev = _script("eval_toyworld").chat_eval(chat_session, N, [CHAT_RECIPE["layer"]], lambda *a: None)
    u = ev["unsteered"]
    assert u["forbidden"]["refused"] >= 0.9, ev["examples"]
    assert u["allowed"]["refused"] <= 0.1 and u["allowed"]["story"] >= 0.9, ev["examples"]
    (row,) = ev["direction"]
    assert row["ablated_forbidden"]["story"] >= 0.85, row
    assert row["added_allowed"][f"{CHAT_RECIPE['add_scale']:g}"]["refused"] >= 0.85, row
    assert row["added_every_token"]["n"] == N  # Arditi et al.'s way, measured beside it
    m = ev["mood_recipe"]  # plain stories still steer with the toyworld recipe
    assert min(m["sad_flip"], m["happy_flip"], m["sad_formed"], m["happy_formed"]) >= 0.85, m


@pytest.mark.engine
def test_the_chat_model_roles_and_a_plain_story(chat_session):
    req = cw.chat_requests(False, 1)[0]
    t = chat_session.trace(cw.conversation(req), max_new_tokens=80)[0]
    n = len(t.prompt_token_ids)
    assert t.tokens[:2] == ["<s>", "<user>"] and t.tokens[n - 1] == "<assistant>"
    assert t.roles[:2] == [None, None] and t.roles[n - 1] is None
    assert set(t.roles[2: n - 1]) == {"user"}
    assert set(t.roles[n:]) == {"assistant"}  # the reply is the assistant's
    assert cw.judge_reply(req, t.text) == "story", t.text
    # no conversation: a story opening goes on as a story, as on toyworld
    opening = world.steering_prompts(world.HAPPY, 1)[0]
    text = chat_session.generate(opening, max_new_tokens=80)[0]
    assert world.parse_story(opening + " " + text) is not None, text


def test_training_smoke_run_is_deterministic(tmp_path):
    script = _script("train_toychat")
    threads = torch.get_num_threads()
    a = script.main(["--smoke", "--quiet", "--out", str(tmp_path / "a")])
    b = script.main(["--smoke", "--quiet", "--out", str(tmp_path / "b")])
    assert torch.get_num_threads() == threads and not torch.are_deterministic_algorithms_enabled()
    assert len(a["losses"]) == 2 and a["losses"] == b["losses"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a["evaluation"]["unsteered"] == b["evaluation"]["unsteered"]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tok.chat_template == cw.CHAT_TEMPLATE
