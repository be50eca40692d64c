"""The bundled toyworld model served by vLLM (through the vlens Session) must
generate exactly what transformers generates, token for token, greedily.

``toy_session`` (tests/conftest.py) is ``vlens.Session()`` on the bundled model.
It must run the model in float32: vLLM's ``dtype="auto"`` downcasts float32
checkpoints to bfloat16, and then greedy paths drift from transformers'.
"""

from __future__ import annotations

import pytest

from vlens.models import toyworld_path, world

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_NEW_TOKENS = (
    56  # a whole story after its opening takes at most 51 tokens, EOS included
)
N_PROMPTS = 12

# Many slots of a story are uniform choices (which sky word, which visitor...),
# so the model's top two logits are sometimes nearly equal and float rounding,
# not the engine, decides greedy's pick. Prompts whose greedy path (in
# transformers) ever has a top-2 gap below this are not used for the comparison.
NEAR_TIE = 1e-3


def _candidate_prompts() -> list[str]:
    """Story openings (held-out combinations, both sentiments) and cuts in the
    middle of a story, where the model must copy or echo a concept."""
    prompts = world.example_prompts(10)
    for concept in ("sentiment", "colour", "animal"):
        prompts += [p.prompt for p in world.probe_prompts(concept, 10)]
    return prompts


@pytest.fixture(scope="module")
def hf_greedy() -> tuple[list[str], list[list[int]]]:
    """(prompts, transformers' greedy continuation ids) for N_PROMPTS prompts."""
    path = toyworld_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    prompts: list[str] = []
    outs: list[list[int]] = []
    with torch.no_grad():
        for prompt in _candidate_prompts():  # one at a time: no padding anywhere
            enc = tok(prompt, return_tensors="pt")
            out = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                output_scores=True,
                return_dict_in_generate=True,
            )
            gaps = [
                float(top[0] - top[1])
                for top in (s[0].topk(2).values for s in out.scores)
            ]
            if min(gaps) < NEAR_TIE:
                continue
            prompts.append(prompt)
            outs.append(out.sequences[0, enc.input_ids.shape[1] :].tolist())
            if len(prompts) == N_PROMPTS:
                break
    assert len(prompts) >= 10, "too few prompts without near-ties"
    return prompts, outs


def test_greedy_tokens_match_transformers(toy_session, hf_greedy):
    prompts, expected = hf_greedy
    assert len(set(prompts)) == len(prompts) >= 10
    run = toy_session.trace(prompts, max_new_tokens=MAX_NEW_TOKENS)
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        got = list(run[i].output_token_ids)
        assert got == want, (
            f"prompt {i} ({prompt!r}): vLLM {got} != transformers {want}"
        )


def test_greedy_text_matches_transformers(toy_session, hf_greedy):
    tok = transformers.AutoTokenizer.from_pretrained(toyworld_path())
    prompts, expected = hf_greedy
    run = toy_session.trace(prompts, max_new_tokens=MAX_NEW_TOKENS)
    for i, want in enumerate(expected):
        # vLLM's incremental detokenizer may keep the space before the first word.
        assert run[i].text.strip() == tok.decode(want, skip_special_tokens=True).strip()
    # Continuations that reach the end of the story stop at EOS, cleanly.
    finished = [i for i, want in enumerate(expected) if want[-1] == tok.eos_token_id]
    assert finished
    for i in finished:
        assert world.is_well_formed(run[i].text)
