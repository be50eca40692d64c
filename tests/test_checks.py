"""The input checks on their own: pure functions of the model's facts and
the arguments, so every rule is tested here without an engine (the engine
tests check that the Session calls them before anything runs)."""

from __future__ import annotations

import pytest
import torch

import vlens
from vlens import checks
from vlens.edits import Steer, per_prompt
from vlens.errors import VlensError
from vlens.protocol.plan import Read

FACTS = checks.ModelFacts(n_layers=3, hidden_size=8, sites=("attn_out", "positions", "resid_post"),
                          writable=("attn_out", "resid_post"), max_model_len=32, vocab_size=50)


def _steer(seed: int = 0, **kw) -> vlens.Steer:
    return vlens.Steer(torch.randn(8, generator=torch.Generator().manual_seed(seed)),
                       layer=kw.pop("layer", 1), **kw)


def test_layers_and_sites():
    # (prompts are checked where they are normalised: vlens/prompts.py, tests/test_chat.py
    # and the too-long case in tests/test_session.py)
    assert checks.check_layers(None, FACTS) == [0, 1, 2]
    assert checks.check_layers([2, 0, 2], FACTS) == [2, 0]
    with pytest.raises(VlensError, match="layer 3 does not exist: this model has 3 layers"):
        checks.check_layers(range(4), FACTS)
    with pytest.raises(VlensError, match="unknown site 'mlp_out': this model has attn_out"):
        checks.check_sites("mlp_out", FACTS)


def test_reads_and_budget():
    reads = checks.check_reads(["resid_post"], [0, 1], "full", 5, FACTS)
    assert [r.key for r in reads] == ["resid_post", "resid_post:logit_lens"]
    with pytest.raises(VlensError, match="more than the vocabulary"):
        checks.check_reads(["resid_post"], [0], "full", 51, FACTS)
    full = [Read("resid_post", (0, 1, 2), "full")]
    # 10 rows x 3 layers x 8 floats x 4 bytes = 960 bytes
    checks.check_budget([(8, full, 3, 1)], FACTS, 960)
    with pytest.raises(VlensError, match=r"read budget .*\(most of it is the full resid_post reads\)"):
        checks.check_budget([(8, full, 3, 1)], FACTS, 959)


def test_steer_must_fit_the_model_and_be_able_to_land():
    assert checks.check_steer(_steer(), FACTS, 5, 4) is not None
    with pytest.raises(VlensError, match="cannot be written: use one of attn_out, resid_post"):
        checks.check_steer(_steer(site="positions"), FACTS, 5, 4)
    with pytest.raises(VlensError, match="'generated' can never land with max_new_tokens=1"):
        checks.check_steer(_steer(span="generated"), FACTS, 5, 1)
    checks.check_steer(_steer(span="generated"), FACTS, 5, 2)
    checks.check_steer(_steer(span=(7, 8)), FACTS, 5, 4)  # rows 0 … 7
    with pytest.raises(VlensError, match="reaches past the sequence or selects no row: this request runs 8 tokens"):
        checks.check_steer(_steer(span=(8, 9)), FACTS, 5, 4)


def test_steer_forms():
    a, b, c = _steer(0), _steer(1), _steer(2)
    assert per_prompt(None, 2, Steer) == [[], []]
    assert per_prompt(a, 2, Steer) == [[a], [a]]
    assert per_prompt([a, b], 1, Steer) == [[a, b]]
    assert per_prompt([a, b], 3, Steer) == [[a, b]] * 3
    assert per_prompt(vlens.PerPrompt([a, None, [b, c]]), 3, Steer) == [[a], [], [b, c]]
    with pytest.raises(VlensError, match="ambiguous"):
        per_prompt([a, b, c], 3, Steer)
    with pytest.raises(VlensError, match="PerPrompt"):
        per_prompt([a, None], 2, Steer)
    with pytest.raises(VlensError, match="would add it twice"):
        per_prompt([a, _steer(0)], 1, Steer)  # equal vector, made again
    # the same vector elsewhere is a different edit
    assert len(per_prompt([a, _steer(0, layer=2), a.with_scale(2.0)], 1, Steer)[0]) == 3


def test_edit_needs_a_place_and_an_engine_that_can_take_it():
    fn = lambda rows, ctx: rows  # noqa: E731
    assert checks.check_edit(None, None, FACTS, can_ship=False) == []
    assert checks.check_edit(fn, [("attn_out", 2)], FACTS, can_ship=True) == [("attn_out", 2)]
    with pytest.raises(VlensError, match="edit_at= given without edit="):
        checks.check_edit(None, [("attn_out", 2)], FACTS, can_ship=True)
    with pytest.raises(VlensError, match="runs in other processes"):
        checks.check_edit(fn, [("attn_out", 2)], FACTS, can_ship=False)
    with pytest.raises(VlensError, match="layer 3 does not exist"):
        checks.check_edit(fn, [("attn_out", 3)], FACTS, can_ship=True)


def test_sampling_settings_vlens_manages():
    checks.check_generation(4, {"temperature": 0.5}, FACTS)
    with pytest.raises(VlensError, match="logprobs= is set by vlens"):
        checks.check_generation(4, {"logprobs": 3}, FACTS)
    with pytest.raises(VlensError, match="seed= is refused on vLLM's CPU build"):
        checks.check_generation(4, {"seed": 1}, FACTS)
    with pytest.raises(VlensError, match="max_new_tokens must be a positive int"):
        checks.check_generation(True, {}, FACTS)


def test_the_old_reduce_name_logprobs_names_vocab_logprobs():
    """#39: the full-vocabulary read is ``"vocab_logprobs"``; a plan still
    asking for ``"logprobs"`` is refused with the new name in the message."""
    from vlens.protocol.plan import Plan

    ok = Plan(tag="t", reads=(Read("resid_post", (2,), "vocab_logprobs"),), prompt_len=3)
    checks.check_plan(ok, FACTS, {}, 4)
    old = Plan(tag="t", reads=(Read("resid_post", (2,), "logprobs"),), prompt_len=3)
    with pytest.raises(VlensError, match="vocab_logprobs"):
        checks.check_plan(old, FACTS, {}, 4)


def test_old_ablate_keyword_query_heads_names_heads():
    """#50: one word for heads: an Ablate's query heads are ``heads=``, as
    in a trace, a patch and the OpenAI body; ``query_heads=`` (0.4's name)
    is a TypeError naming it."""
    assert list(vlens.Ablate("z", 0, heads=[0]).heads) == [0]
    with pytest.raises(TypeError, match=r"takes heads= now \(query_heads="):
        vlens.Ablate("z", 0, query_heads=[0])


def test_a_batch_of_text_prompts_is_tokenized_at_once_as_one_by_one(tiny_llama):
    """normalise() encodes a batch's text prompts in one tokenizer call:
    each prompt's ids and character offsets are those it gets alone
    (bundled and tiny-model tokenizers; repeats, odd spacing and Unicode),
    beside token-id prompts in the same batch."""
    from transformers import AutoTokenizer

    from vlens.models import toyworld_path
    from vlens.prompts import normalise

    for path in (toyworld_path(), tiny_llama):
        tok = AutoTokenizer.from_pretrained(str(path))
        texts = ["once upon a time, a happy dog", "  two  spaces  ", "ünïcode 🙂 here",
                 "a\nnewline\tand a tab", "once upon a time, a happy dog", "the"]
        batch = texts[:3] + [{"prompt_token_ids": [3, 4, 5]}] + texts[3:]
        together = normalise(batch, tok, 512)
        alone = [normalise(p, tok, 512)[0] for p in batch]
        assert len(together) == len(alone) == 7
        for a, b in zip(together, alone):
            assert a.ids == b.ids and a.offsets == b.offsets and a.text == b.text
        assert together[0].ids == together[5].ids and len(together[0].ids) > 3  # the repeat
