"""The bundled toyworld model: what it knows, how it steers, how it was made.

Uses transformers only (the vLLM side is tests/test_toyworld_engine.py).
The model is loaded once per module; the whole file takes about a minute on
two cores.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from vlens.models import RECIPE, toyworld_path, world

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent

# The documented steering recipe (docs/toyworld.md, the model card): u is the
# unit difference of means (happy - sad) of the output of decoder layer
# STEER_LAYER at the last token of world.sentiment_prompts(); a forward hook on
# that layer adds STEER_SCALE * |h_t| * u to every position's residual h_t.
STEER_LAYER = RECIPE["layer"]
STEER_SCALE = RECIPE["scale"]
BUDGET = 64  # new tokens; a story needs at most 51 (EOS included) after its opening


@pytest.fixture(scope="module")
def tw():
    path = toyworld_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    return model, tok


# ---------------------------------------------------------------------------
# The world definition (pure Python)
# ---------------------------------------------------------------------------


def test_world_stories_parse_and_training_skips_held_out():
    stream = iter(world.story_stream(0))
    echoes_agree = longest = 0
    for _ in range(2000):
        story = next(stream)
        assert not world.is_held_out(story.animal, story.colour, story.sentiment)
        parsed = world.parse_story(story.text)
        assert parsed is not None
        assert parsed["animal"] == story.animal and parsed["colour"] == story.colour
        assert world.story_problems(story.text) == []
        assert world.is_well_formed(story.text)
        # verb2 follows from verb1 and greet exists only with a visitor
        echoes = [parsed[k] for k in ("adverb", "sky", "wind", "go", "find", "verb1", "feeling")]
        echoes_agree += all(
            w in world.concept_words("sentiment", story.sentiment) for w in echoes
        )
        longest = max(longest, len(story.words) + 2)
    assert longest == world.max_story_tokens()
    # Seven independent echoes, each faithful with probability 0.75: 0.75**7 = 13.3%.
    assert world.ECHO_FIDELITY == 0.75
    assert 0.11 < echoes_agree / 2000 < 0.16
    held = iter(world.story_stream(0, held_out=True))
    assert all(
        world.is_held_out(s.animal, s.colour, s.sentiment)
        for s in (next(held) for _ in range(100))
    )


def test_world_clean_stories_carry_their_sentiment():
    rng = random.Random(0)
    for _ in range(200):
        story = world.generate_story(rng, fidelity=1.0)
        rest = world.to_text(story.words[story.slots["sky_sentence"] :])
        assert world.sentiment_of(rest) == story.sentiment
        assert not (
            set(world.split_words(rest))
            & world.concept_words(
                "sentiment", world.HAPPY if story.sentiment == world.SAD else world.SAD
            )
        )


def test_world_held_out_covers_every_animal_colour_and_sentiment():
    animals, colours, sentiments = zip(*world.HELD_OUT)
    assert set(animals) == set(world.ANIMALS)
    assert set(colours) == set(world.COLOURS)
    assert set(sentiments) == set(world.SENTIMENTS)


def test_world_generation_is_seeded():
    a = [world.generate_story(random.Random(3)).text for _ in range(3)]
    b = [world.generate_story(random.Random(3)).text for _ in range(3)]
    assert a == b
    assert world.probe_prompts("colour", 50) == world.probe_prompts("colour", 50)


def test_world_judges():
    assert world.is_well_formed(
        "the sky was bright. then the fox sang and danced. the end."
    )
    assert not world.is_well_formed("the sky was bright. then the fox sang and danced.")
    assert not world.is_well_formed("the fox sang sang sang. the end.")
    assert world.is_well_formed("the fox sang sang. the end.")
    assert world.sentiment_of("the sky was grey and the wind was cold.") == world.SAD
    assert world.sentiment_of("then the fox laughed and sang.") == world.HAPPY
    assert world.sentiment_of("the fox lived in a red house.") is None
    assert world.sentiment_of("alas, the fox skipped outside and found a rose.") == world.HAPPY
    assert world.to_text(["a", "fox", ",", "a", "cat", "."]) == "a fox, a cat."


def test_world_prompt_helpers():
    prompts = world.example_prompts(4)
    assert len(prompts) == 4 and all(p.endswith(".") for p in prompts)
    assert [world.sentiment_of(p) for p in prompts] == [world.HAPPY, world.SAD] * 2
    happy, sad = world.sentiment_prompts(8)
    assert len(happy) == len(sad) == 8
    for h, s in zip(happy, sad):
        hw, sw = world.split_words(h), world.split_words(s)
        assert len(hw) == len(sw)
        for a, b in zip(hw, sw):
            # Minimal pairs: only sentiment words differ, each swapped for its counterpart.
            assert a == b or (a in world.HAPPY_WORDS and b in world.SAD_WORDS)
        assert (
            world.sentiment_of(h) == world.HAPPY and world.sentiment_of(s) == world.SAD
        )
    for sentiment in world.SENTIMENTS:
        openings = world.steering_prompts(sentiment, 30)
        assert len(set(openings)) == 30
        assert all(world.sentiment_of(p) == sentiment for p in openings)


def test_models_package_is_light():
    # `import vlens.models` must not pull in torch.
    code = "import sys, vlens.models, vlens.models.world; print('torch' in sys.modules)"
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------
# The shipped files
# ---------------------------------------------------------------------------


def test_shipped_files_and_config():
    path = toyworld_path()
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "evaluation.json",
        "steering_eval.json",  # scripts/eval_toyworld.py
    ):
        assert (path / name).is_file(), name
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= 20 * 1000 * 1000  # the limit: 20 MB in the repository
    # Stored in 16 bits, run in float32 (config.json says float32, below).
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32"
    assert cfg["max_position_embeddings"] == 512
    assert cfg["hidden_size"] // cfg["num_attention_heads"] in (32, 64)
    gen = json.loads((path / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id"):
        assert cfg[key] == gen[key]


def test_tokenizer(tw):
    _, tok = tw
    assert tok.is_fast
    assert tok.convert_ids_to_tokens(list(range(len(tok)))) == world.vocabulary()
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    text = "once upon a time, a happy fox lived in a red house near the river. the end."
    ids = tok(text).input_ids  # add_special_tokens=True, as vLLM calls it
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert tok.convert_ids_to_tokens(ids[1:5]) == ["once", "upon", "a", "time"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    # Spacing in the input does not matter; words are words.
    assert tok("the  end .").input_ids == tok("The end.").input_ids
    # Every story of the world tokenizes without unknown words.
    stream = iter(world.story_stream(1))
    for _ in range(50):
        story = next(stream)
        assert tok.convert_ids_to_tokens(tok(story.text).input_ids[1:]) == list(
            story.words
        )


# ---------------------------------------------------------------------------
# Acceptance 1: held-out probes
# ---------------------------------------------------------------------------


@torch.no_grad()
def _top1(model, tok, prompts):
    words = []
    tok.padding_side = "right"
    for i in range(0, len(prompts), 80):
        enc = tok(
            prompts[i : i + 80], padding=True, return_tensors="pt"
        )  # right padding
        logits = model(**enc).logits
        last = enc.attention_mask.sum(1) - 1
        words += tok.convert_ids_to_tokens(
            logits[torch.arange(len(last)), last].argmax(-1).tolist()
        )
    return words


@pytest.mark.parametrize("concept", ["sentiment", "colour", "animal"])
def test_held_out_probes(tw, concept):
    model, tok = tw
    probes = world.probe_prompts(concept, 240)
    assert len({p.prompt for p in probes}) == 240
    assert all(world.is_held_out(*_combo(p.prompt)) for p in probes)
    top = _top1(model, tok, [p.prompt for p in probes])
    accuracy = sum(t in p.allowed for t, p in zip(top, probes)) / len(probes)
    assert accuracy >= 0.95, f"{concept}: {accuracy:.1%}"


def _combo(prompt: str) -> tuple[str, str, str]:
    """(animal, colour, sentiment) of a prompt, read from its opening."""
    words = world.split_words(prompt)
    mood = next(
        w for w in words if w in world.MOODS[world.HAPPY] + world.MOODS[world.SAD]
    )
    animal = next(w for w in words if w in world.ANIMALS)
    colour = next(w for w in words if w in world.COLOURS)
    return (
        animal,
        colour,
        world.HAPPY if mood in world.MOODS[world.HAPPY] else world.SAD,
    )


# ---------------------------------------------------------------------------
# Acceptance 3: steering with a plain forward hook
# ---------------------------------------------------------------------------


@torch.no_grad()
def _sentiment_direction(model, tok, layer):
    captured = []

    def capture(module, args, output):
        captured.append(output[0] if isinstance(output, tuple) else output)

    means = []
    handle = model.model.layers[layer].register_forward_hook(capture)
    try:
        for prompts in world.sentiment_prompts(64):
            tok.padding_side = "right"
            enc = tok(prompts, padding=True, return_tensors="pt")
            captured.clear()
            model(**enc)
            last = enc.attention_mask.sum(1) - 1
            means.append(captured[0][torch.arange(len(last)), last].mean(0))
    finally:
        handle.remove()
    diff = means[0] - means[1]
    return diff / diff.norm()


@torch.no_grad()
def _generate(
    model, tok, prompts, direction=None, layer=STEER_LAYER, scale=STEER_SCALE
):
    def steer(h):
        return h + scale * h.norm(dim=-1, keepdim=True) * direction

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (steer(output[0]),) + tuple(output[1:])
        return steer(output)

    handle = (
        model.model.layers[layer].register_forward_hook(hook)
        if direction is not None
        else None
    )
    tok.padding_side = "left"
    try:
        enc = tok(prompts, padding=True, return_tensors="pt")
        out = model.generate(**enc, do_sample=False, max_new_tokens=BUDGET)
    finally:
        tok.padding_side = "right"
        if handle is not None:
            handle.remove()
    return tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)


def test_steering_flips_sentiment_and_keeps_stories_well_formed(tw):
    model, tok = tw
    n = 60  # per direction
    direction = _sentiment_direction(model, tok, STEER_LAYER)
    flips = base_flips = formed = base_formed = 0
    for source, target, sign in (
        (world.SAD, world.HAPPY, 1.0),
        (world.HAPPY, world.SAD, -1.0),
    ):
        prompts = world.steering_prompts(source, n)
        base = _generate(model, tok, prompts)
        steered = _generate(model, tok, prompts, sign * direction)
        base_flips += sum(world.sentiment_of(t) == target for t in base)
        base_formed += sum(world.is_well_formed(t) for t in base)
        flips += sum(world.sentiment_of(t) == target for t in steered)
        formed += sum(world.is_well_formed(t) for t in steered)
    total = 2 * n
    assert flips / total >= 0.90, f"steered flip rate {flips / total:.1%}"
    assert base_flips / total <= 0.05, f"baseline flip rate {base_flips / total:.1%}"
    assert formed / total >= 0.80, f"steered well-formed rate {formed / total:.1%}"
    assert base_formed / total >= 0.95, (
        f"unsteered well-formed rate {base_formed / total:.1%}"
    )


def test_documented_recipe_matches_shipped_evaluation():
    ev = json.loads((toyworld_path() / "evaluation.json").read_text())
    steering = ev["evaluation"]["steering"]
    assert (steering["layer"], steering["scale"]) == (STEER_LAYER, STEER_SCALE)
    assert steering["steered"]["flip_rate"] >= 0.90
    assert steering["baseline"]["flip_rate"] <= 0.05
    assert steering["steered"]["well_formed_rate"] >= 0.80
    assert all(v >= 0.95 for v in ev["evaluation"]["probes"].values())
    assert ev["evaluation"]["probes_per_concept"] >= 200
    card = (toyworld_path() / "README.md").read_text()
    assert f"layer {STEER_LAYER}" in card


# ---------------------------------------------------------------------------
# Acceptance 4: the training script is deterministic
# ---------------------------------------------------------------------------


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "train_toyworld", ROOT / "scripts" / "train_toyworld.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def test_training_smoke_run_is_deterministic(tmp_path):
    script = _load_script()
    threads = torch.get_num_threads()
    a = script.main(["--smoke", "--quiet", "--out", str(tmp_path / "a")])
    b = script.main(["--smoke", "--quiet", "--out", str(tmp_path / "b")])
    assert (
        torch.get_num_threads() == threads
    )  # main() leaves the process as it found it
    assert not torch.are_deterministic_algorithms_enabled()
    assert len(a["losses"]) == 12
    assert a["losses"] == b["losses"]
    assert a["evaluation"] == b["evaluation"]
    assert a["losses"][-1] < a["losses"][0]
    wa = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert wa == (tmp_path / "b" / "model.safetensors").read_bytes()
    # What it writes is a loadable model folder with a model card.
    for name in ("config.json", "tokenizer.json", "README.md", "evaluation.json"):
        assert (tmp_path / "a" / name).is_file()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert model.config.vocab_size == len(tok) == len(world.vocabulary())
