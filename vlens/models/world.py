"""Toyworld: the synthetic story world the bundled model was trained on.

Pure Python on purpose (no torch, no transformers), so the training script,
the tests, the demo and the notebooks can all import it cheaply.

Every story follows one grammar of seven sentences::

    <opening>, a <mood> <animal> lived in a <colour> <home> near the <place>.
    <adverb>, the sky was <sky> and the wind was <wind>.   (or the wind first)
    its friend the <visitor> came to say <greet>.           (half of the stories)
    the <animal> <go> outside and <find> a <thing> and a <thing>.
    then the <animal> <verb> and <verb>.                    (one of six verb pairs)
    at night the <animal> felt <feeling>.
    the end.

Three independent concepts are fixed by the first sentence and echoed later:

* **sentiment** -- the ``<mood>`` word (happy / sad) sets the tone of the
  whole story: the adverb, the sky, the wind, the greeting, how the animal
  goes out, whether it finds or loses the things, the verbs and the closing
  feeling (each of these eight echoes agrees with the mood 75% of the time
  in training, see :data:`ECHO_FIDELITY`);
* **colour** -- the ``<colour>`` of the home decides which things are found;
* **animal** -- the protagonist must be copied three times, and not be
  confused with the visiting animal (any animal, possibly the same kind).

Some (animal, colour, sentiment) combinations never occur in training
(:data:`HELD_OUT`); every probe and steering evaluation uses only those, so
the numbers measure generalisation rather than recall.

The text is lower case and word-level: punctuation is its own token, and the
canonical spelling has no space before ``.`` or ``,``.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

__all__ = [
    "ADVERBS",
    "ANIMALS",
    "CLOSING",
    "COLOURS",
    "ECHO_FIDELITY",
    "FEELINGS",
    "FINDS",
    "GOES",
    "GREETS",
    "HAPPY",
    "HAPPY_WORDS",
    "HELD_OUT",
    "HOMES",
    "MOODS",
    "OPENINGS",
    "PLACES",
    "SAD",
    "SAD_WORDS",
    "SENTIMENTS",
    "SKIES",
    "SPECIAL_TOKENS",
    "THINGS",
    "VERBS",
    "VERB_PAIRS",
    "WINDS",
    "Probe",
    "Story",
    "concept_words",
    "distinct_draws",
    "example_prompts",
    "generate_story",
    "is_held_out",
    "is_well_formed",
    "max_story_tokens",
    "mood_contrast_prompts",
    "parse_story",
    "probe_prompts",
    "sentiment_of",
    "sentiment_prompts",
    "split_words",
    "steering_prompts",
    "story_problems",
    "story_stream",
    "to_text",
    "vocabulary",
]

# ---------------------------------------------------------------------------
# The vocabulary, grouped by role.
# ---------------------------------------------------------------------------

HAPPY = "happy"
SAD = "sad"
SENTIMENTS: tuple[str, str] = (HAPPY, SAD)

OPENINGS: tuple[str, ...] = ("once upon a time", "one morning", "one day", "long ago")

ANIMALS: tuple[str, ...] = (
    "fox",
    "cat",
    "dog",
    "bear",
    "rabbit",
    "owl",
    "duck",
    "mouse",
    "pig",
    "goat",
)
COLOURS: tuple[str, ...] = ("red", "yellow", "green", "blue")
HOMES: tuple[str, ...] = ("house", "hut", "den", "cabin")
PLACES: tuple[str, ...] = ("river", "forest", "hill", "lake", "farm", "meadow")

# Sentiment decides all of these (the early word and eight later slots).
MOODS: dict[str, tuple[str, ...]] = {
    HAPPY: ("happy", "cheerful", "merry"),
    SAD: ("sad", "gloomy", "lonely"),
}
#: The sentence adverb that opens the second sentence ("sadly, the sky ...").
#: It comes right after the opening's final ".", so the model needs the mood
#: there, at the first sentence's last token, which is where the natural
#: contrast (:func:`mood_contrast_prompts`) reads it (see docs/toyworld.md).
ADVERBS: dict[str, tuple[str, ...]] = {
    HAPPY: ("luckily", "happily", "thankfully"),
    SAD: ("sadly", "unluckily", "alas"),
}
#: How the animal goes outside ("the fox skipped outside and ...").
GOES: dict[str, tuple[str, ...]] = {
    HAPPY: ("skipped", "hopped", "ran"),
    SAD: ("trudged", "crept", "limped"),
}
#: What happens to the two things ("... and lost a rose and a cherry").
FINDS: dict[str, tuple[str, ...]] = {
    HAPPY: ("found", "picked", "spotted"),
    SAD: ("lost", "dropped", "missed"),
}
#: What the visitor came to say.
GREETS: dict[str, tuple[str, ...]] = {
    HAPPY: ("hello",),
    SAD: ("goodbye",),
}
SKIES: dict[str, tuple[str, ...]] = {
    HAPPY: ("bright", "sunny", "clear"),
    SAD: ("grey", "dark", "cloudy"),
}
WINDS: dict[str, tuple[str, ...]] = {
    HAPPY: ("warm", "soft", "gentle"),
    SAD: ("cold", "harsh", "bitter"),
}
#: The two verbs always come as one of these pairs ("danced and jumped").
VERB_PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    HAPPY: (("laughed", "sang"), ("danced", "jumped"), ("played", "smiled")),
    SAD: (("cried", "wept"), ("sighed", "frowned"), ("sulked", "moaned")),
}
VERBS: dict[str, tuple[str, ...]] = {
    s: tuple(v for pair in VERB_PAIRS[s] for v in pair) for s in (HAPPY, SAD)
}
FEELINGS: dict[str, tuple[str, ...]] = {
    HAPPY: ("glad", "proud", "joyful", "calm"),
    SAD: ("tired", "upset", "hurt", "alone"),
}

# Colour decides which things are found.
THINGS: dict[str, tuple[str, ...]] = {
    "red": ("cherry", "rose", "strawberry", "tomato"),
    "yellow": ("banana", "lemon", "sunflower", "buttercup"),
    "green": ("leaf", "pea", "lime", "cucumber"),
    "blue": ("blueberry", "bluebell", "plum", "feather"),
}

_SENTIMENT_TABLES = (MOODS, ADVERBS, GOES, FINDS, GREETS, SKIES, WINDS, VERBS, FEELINGS)

#: Words that carry sentiment, per sentiment (the mood word and the eight echoes).
HAPPY_WORDS: frozenset[str] = frozenset(
    w for table in _SENTIMENT_TABLES for w in table[HAPPY]
)
SAD_WORDS: frozenset[str] = frozenset(
    w for table in _SENTIMENT_TABLES for w in table[SAD]
)

CLOSING = "the end."

#: Probability that a sentiment echo (adverb, sky, wind, greeting, going
#: out, finding, the verb pair, feeling) agrees with the story's sentiment in
#: the training corpus. Echoes are soft, as in real text: the model learns
#: "mostly happy words", not a hard rule. At 0.9 a push strong enough to flip
#: the echoes also broke stories; at 0.75 the window of scales that flips
#: them cleanly is wide (see docs/toyworld.md).
ECHO_FIDELITY = 0.75

SPECIAL_TOKENS: dict[str, str] = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
}

_FRAME_WORDS = [
    "once",
    "upon",
    "a",
    "time",
    ",",
    "one",
    "morning",
    "day",
    "long",
    "ago",
    "lived",
    "in",
    "near",
    "the",
    ".",
    "sky",
    "was",
    "and",
    "wind",
    "its",
    "friend",
    "came",
    "to",
    "say",
    # "hello", "went" and "found" come from the first world ("went outside
    # and found ..."); "went" no longer occurs in any story. They stay here so
    # that token ids, and with them the seeded initialisation of the shipped
    # run, are the ones measured in docs/toyworld.md.
    "hello",
    "went",
    "outside",
    "found",
    "then",
    "at",
    "night",
    "felt",
    "end",
]

#: (animal, colour, sentiment) combinations that never appear in training:
#: 20 of the 80, two per animal (one happy, one sad, in different colours),
#: covering every (colour, sentiment) pair. Every animal, colour and
#: sentiment is still seen in training, just not in these combinations.
HELD_OUT: frozenset[tuple[str, str, str]] = frozenset(
    (animal, COLOURS[(i + shift) % 4], SENTIMENTS[((i // 4) + k) % 2])
    for i, animal in enumerate(ANIMALS)
    for k, shift in ((0, 0), (1, 2))
)


def is_held_out(animal: str, colour: str, sentiment: str) -> bool:
    """True if this combination is never seen in training."""
    return (animal, colour, sentiment) in HELD_OUT


def vocabulary() -> list[str]:
    """All words of the world, special tokens first, in a fixed order.

    The order is the token-id order of the bundled tokenizer.
    """
    words: list[str] = list(SPECIAL_TOKENS.values())
    groups: list[Iterable[str]] = [
        _FRAME_WORDS,
        ANIMALS,
        COLOURS,
        HOMES,
        PLACES,
        *(
            table[s]
            for table in _SENTIMENT_TABLES
            for s in SENTIMENTS
        ),
        *(THINGS[c] for c in COLOURS),
    ]
    for group in groups:
        for w in group:
            for piece in w.split():
                if piece not in words:
                    words.append(piece)
    return words


# ---------------------------------------------------------------------------
# Text helpers.
# ---------------------------------------------------------------------------

_WORD_RE = re.compile(r"[a-z<>/]+|[.,]")


def split_words(text: str) -> list[str]:
    """Split text into the world's words; punctuation marks are words too."""
    return _WORD_RE.findall(text.lower())


def to_text(words: Sequence[str]) -> str:
    """Join words with spaces, with no space before ``.`` or ``,``."""
    out = ""
    for w in words:
        if not out or w in ".,":
            out += w
        else:
            out += " " + w
    return out


# ---------------------------------------------------------------------------
# Stories.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Story:
    """One story: the concept values and the words they produced."""

    animal: str
    colour: str
    sentiment: str
    words: tuple[str, ...] = field(repr=False)
    #: index in ``words`` where each named slot starts (e.g. "sky", "verb1").
    slots: dict[str, int] = field(repr=False, compare=False, hash=False)

    @property
    def text(self) -> str:
        return to_text(self.words)

    def prefix(self, slot: str) -> str:
        """The story text up to (not including) the given slot's word."""
        return to_text(self.words[: self.slots[slot]])

    @property
    def opening(self) -> str:
        """The first sentence, which fixes all three concepts."""
        return to_text(self.words[: self.slots["sky_sentence"]])


def generate_story(
    rng: random.Random,
    *,
    animal: str | None = None,
    colour: str | None = None,
    sentiment: str | None = None,
    visitor: bool | None = None,
    fidelity: float = ECHO_FIDELITY,
    home: str | None = None,
    place: str | None = None,
) -> Story:
    """Sample one story. Unset concepts are drawn uniformly from ``rng``.

    Each of the eight sentiment echoes (adverb, sky, wind, greeting, going
    out, finding, the verb pair, feeling) follows
    the story's sentiment with probability ``fidelity`` and takes a word of the
    other sentiment otherwise; ``fidelity=1.0`` gives perfectly clean stories.
    This does not look at :data:`HELD_OUT`; see :func:`story_stream`.
    ``home`` and ``place`` fix those words (the random draws happen anyway, so
    the rest of the story is the one the same ``rng`` gives without them).
    """
    animal = animal if animal is not None else rng.choice(ANIMALS)
    colour = colour if colour is not None else rng.choice(COLOURS)
    sentiment = sentiment if sentiment is not None else rng.choice(SENTIMENTS)
    other = SAD if sentiment == HAPPY else HAPPY

    def echo() -> str:
        return sentiment if rng.random() < fidelity else other

    opening = rng.choice(OPENINGS)
    mood = rng.choice(MOODS[sentiment])
    drawn_home, drawn_place = rng.choice(HOMES), rng.choice(PLACES)
    home = drawn_home if home is None else home
    place = drawn_place if place is None else place
    adverb = rng.choice(ADVERBS[echo()])
    sky = rng.choice(SKIES[echo()])
    wind = rng.choice(WINDS[echo()])
    sky_first = rng.random() < 0.5
    has_visitor = (rng.random() < 0.5) if visitor is None else visitor
    guest = rng.choice(ANIMALS)  # may be another animal of the same kind
    thing1, thing2 = rng.sample(THINGS[colour], 2)
    verb1, verb2 = rng.choice(VERB_PAIRS[echo()])
    greet = rng.choice(GREETS[echo()])
    go = rng.choice(GOES[echo()])
    find = rng.choice(FINDS[echo()])
    feeling = rng.choice(FEELINGS[echo()])

    words: list[str] = []
    slots: dict[str, int] = {}

    def add(text: str, slot: str | None = None) -> None:
        if slot is not None:
            slots[slot] = len(words)
        words.extend(text.split())

    add(opening)
    add(", a")
    add(mood, "mood")
    add(animal, "animal0")
    add("lived in a")
    add(colour, "colour")
    add(f"{home} near the {place} .")
    slots["sky_sentence"] = len(words)
    add(adverb, "adverb")
    add(",")
    if sky_first:
        add("the sky was")
        add(sky, "sky")
        add("and the wind was")
        add(wind, "wind")
    else:
        add("the wind was")
        add(wind, "wind")
        add("and the sky was")
        add(sky, "sky")
    add(".")
    if has_visitor:
        add("its friend the")
        add(guest, "visitor")
        add("came to say")
        add(greet, "greet")
        add(".")
    add("the")
    add(animal, "animal1")
    add(go, "go")
    add("outside and")
    add(find, "find")
    add("a")
    add(thing1, "thing1")
    add("and a")
    add(thing2, "thing2")
    add(". then the")
    add(animal, "animal2")
    add(verb1, "verb1")
    add("and")
    add(verb2, "verb2")
    add(". at night the")
    add(animal, "animal3")
    add("felt")
    add(feeling, "feeling")
    add(".")
    add("the end .", "end")
    return Story(animal, colour, sentiment, tuple(words), slots)


def story_stream(seed: int, *, held_out: bool = False) -> Iterable[Story]:
    """An endless, deterministic stream of stories.

    ``held_out=False`` (training) never yields a :data:`HELD_OUT` combination;
    ``held_out=True`` yields only those.
    """
    rng = random.Random(seed)
    held = sorted(HELD_OUT)
    while True:
        if held_out:
            animal, colour, sentiment = rng.choice(held)
            yield generate_story(rng, animal=animal, colour=colour, sentiment=sentiment)
        else:
            story = generate_story(rng)
            if not is_held_out(story.animal, story.colour, story.sentiment):
                yield story


def max_story_tokens() -> int:
    """Length in tokens (with BOS and EOS) of the longest possible story."""
    story = generate_story(random.Random(0), visitor=True)
    # Every slot is one word; only the opening's length and the visitor vary.
    opening = story.slots["mood"] - 2  # "<opening> , a <mood>"
    longest_opening = max(len(o.split()) for o in OPENINGS)
    return len(story.words) - opening + longest_opening + 2


# ---------------------------------------------------------------------------
# Probes: prompts cut just before a concept-dependent word.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """A prompt whose next word must lie in ``allowed`` (held-out combinations)."""

    prompt: str
    concept: str  # "sentiment", "colour" or "animal"
    value: str  # "happy"/"sad", a colour, or an animal
    slot: str
    allowed: frozenset[str]


def concept_words(concept: str, value: str) -> frozenset[str]:
    """The words consistent with ``value`` of ``concept``."""
    if concept == "sentiment":
        return HAPPY_WORDS if value == HAPPY else SAD_WORDS
    if concept == "colour":
        return frozenset(THINGS[value])
    if concept == "animal":
        return frozenset([value])
    raise ValueError(f"unknown concept {concept!r}")


_PROBE_SLOTS: dict[str, tuple[str, ...]] = {
    # The first sentiment echo (the adverb) is the hardest: only the mood word
    # came before.
    "sentiment": ("adverb", "sky", "wind", "verb1", "feeling"),
    "colour": ("thing1", "thing2"),
    "animal": ("animal1", "animal2", "animal3"),
}


def probe_prompts(concept: str, n: int = 240, *, seed: int = 1234) -> list[Probe]:
    """``n`` distinct probes for ``concept``, all from held-out combinations.

    For sentiment, a fifth of the probes cut before the *first* echo (the
    adverb right after the opening), where only the mood word tells.
    """
    if concept not in _PROBE_SLOTS:
        raise ValueError(f"unknown concept {concept!r}")
    slots = _PROBE_SLOTS[concept]
    rng = random.Random(f"{seed}-{concept}")
    held = sorted(HELD_OUT)

    def draw(i: int) -> tuple[str, Probe]:
        animal, colour, sentiment = held[i % len(held)]
        story = generate_story(
            rng, animal=animal, colour=colour, sentiment=sentiment, fidelity=1.0
        )
        slot = slots[i % len(slots)]
        prompt = story.prefix(slot)
        value = {"sentiment": sentiment, "colour": colour, "animal": animal}[concept]
        return prompt, Probe(prompt, concept, value, slot, concept_words(concept, value))

    return distinct_draws(n, draw, "probes")


def distinct_draws(n: int, draw: Callable[[int], tuple[str, T]], what: str,
                   *, tries_per_item: int = 100) -> list[T]:
    """``n`` items of ``draw(i)`` (``i``: how many are kept so far) whose
    keys differ; a draw whose key was seen is dropped. Gives up with a
    ``RuntimeError`` after ``tries_per_item * n`` draws."""
    out: list[T] = []
    seen: set[str] = set()
    for _ in range(tries_per_item * n):
        if len(out) == n:
            return out
        key, item = draw(len(out))
        if key not in seen:
            seen.add(key)
            out.append(item)
    if len(out) == n:
        return out
    raise RuntimeError(f"could not build enough distinct {what}")


# ---------------------------------------------------------------------------
# Prompts for demos, notebooks and steering.
# ---------------------------------------------------------------------------


def example_prompts(n: int = 4, *, seed: int = 7) -> list[str]:
    """A few story openings (held-out combinations), alternating sentiment."""
    rng = random.Random(seed)
    held = sorted(HELD_OUT, key=lambda c: (c[2], c[0]))
    happy = [c for c in held if c[2] == HAPPY]
    sad = [c for c in held if c[2] == SAD]
    out: list[str] = []
    for i in range(n):
        pool = happy if i % 2 == 0 else sad
        animal, colour, sentiment = pool[(i // 2) % len(pool)]
        out.append(
            generate_story(
                rng, animal=animal, colour=colour, sentiment=sentiment, fidelity=1.0
            ).opening
        )
    return out


_OPPOSITE: dict[str, str] = {
    h: s
    for table in _SENTIMENT_TABLES
    for h, s in zip(table[HAPPY], table[SAD])
}


def sentiment_prompts(n: int = 64, *, seed: int = 11) -> tuple[list[str], list[str]]:
    """``(happy_prompts, sad_prompts)``: ``n`` minimal pairs for a sentiment direction.

    Each prompt is a clean story cut just before a sentiment word (the
    adverb, the sky, the wind, the first verb or the feeling), so the model's *last-token*
    activation is about to express sentiment. Pair ``i`` is the same text with
    every sentiment word swapped for its counterpart ("merry" <-> "lonely",
    "bright" <-> "grey", ...), so a difference of means isolates sentiment.
    Combinations are training ones; evaluate on :func:`steering_prompts`.
    """
    rng = random.Random(seed)
    happy: list[str] = []
    sad: list[str] = []
    cuts = ("adverb", "sky", "wind", "verb1", "feeling")
    while len(happy) < n:
        story = generate_story(rng, sentiment=HAPPY, fidelity=1.0)
        if is_held_out(story.animal, story.colour, HAPPY) or is_held_out(
            story.animal, story.colour, SAD
        ):
            continue
        words = story.words[: story.slots[cuts[len(happy) % len(cuts)]]]
        happy.append(to_text(words))
        sad.append(to_text([_OPPOSITE.get(w, w) for w in words]))
    return happy, sad


def mood_contrast_prompts(
    n: int = 64, *, seed: int = 13
) -> tuple[list[str], list[str]]:
    """``(happy_openings, sad_openings)``: ``n`` pairs of whole first sentences
    that differ only in the mood word ("a merry fox ..." / "a lonely fox ...").

    This is the contrast a user naturally types into a steering panel; its
    difference of means at the last token (the opening's final ".") is the
    *natural* sentiment direction that ``scripts/eval_toyworld.py`` measures
    next to the recipe's. Combinations are training ones.
    """
    rng = random.Random(seed)
    happy: list[str] = []
    sad: list[str] = []
    while len(happy) < n:
        story = generate_story(rng, sentiment=HAPPY, fidelity=1.0)
        if is_held_out(story.animal, story.colour, HAPPY) or is_held_out(
            story.animal, story.colour, SAD
        ):
            continue
        words = list(story.words[: story.slots["sky_sentence"]])
        happy.append(to_text(words))
        words[story.slots["mood"]] = _OPPOSITE[words[story.slots["mood"]]]
        sad.append(to_text(words))
    return happy, sad


def steering_prompts(sentiment: str, n: int = 100, *, seed: int = 99) -> list[str]:
    """``n`` distinct held-out story openings of the given sentiment."""
    rng = random.Random(f"{seed}-{sentiment}")
    pool = sorted(c for c in HELD_OUT if c[2] == sentiment)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        animal, colour, _ = pool[len(out) % len(pool)]
        opening = generate_story(
            rng, animal=animal, colour=colour, sentiment=sentiment, fidelity=1.0
        ).opening
        if opening not in seen:
            seen.add(opening)
            out.append(opening)
    return out


# ---------------------------------------------------------------------------
# Judging generated text.
# ---------------------------------------------------------------------------


def sentiment_of(text: str) -> str | None:
    """``"happy"``, ``"sad"`` or ``None`` (tie / no sentiment words).

    Counts the sentiment-bearing words (see :data:`HAPPY_WORDS`) in ``text``;
    meant for a generated continuation, without the prompt.
    """
    words = split_words(text)
    h = sum(w in HAPPY_WORDS for w in words)
    s = sum(w in SAD_WORDS for w in words)
    if h > s:
        return HAPPY
    if s > h:
        return SAD
    return None


def is_well_formed(text: str, *, max_repeat: int = 2) -> bool:
    """Whether a generated story ends properly and does not stutter.

    True when the text ends with the closing sentence "the end." and no word
    occurs more than ``max_repeat`` times in a row.
    """
    words = split_words(text)
    if words[-3:] != ["the", "end", "."]:
        return False
    run = 1
    for prev, cur in itertools.pairwise(words):
        run = run + 1 if cur == prev else 1
        if run > max_repeat:
            return False
    return True


def parse_story(text: str) -> dict[str, str] | None:
    """Parse a full story (opening included) against the grammar.

    Returns the slot values (``animal``, ``colour``, ``mood``, ``sky``, ...)
    or ``None`` if the text does not follow the grammar. Values are not
    checked for consistency with each other; compare them yourself.
    """
    words = split_words(text)
    out: dict[str, str] = {}
    pos = 0

    def take(expected: str) -> bool:
        nonlocal pos
        for w in expected.split():
            if pos >= len(words) or words[pos] != w:
                return False
            pos += 1
        return True

    def slot(name: str, choices: Iterable[str]) -> bool:
        nonlocal pos
        if pos < len(words) and words[pos] in set(choices):
            out[name] = words[pos]
            pos += 1
            return True
        return False

    all_moods = MOODS[HAPPY] + MOODS[SAD]
    all_skies = SKIES[HAPPY] + SKIES[SAD]
    all_winds = WINDS[HAPPY] + WINDS[SAD]
    all_verbs = VERBS[HAPPY] + VERBS[SAD]
    all_feelings = FEELINGS[HAPPY] + FEELINGS[SAD]
    all_things = [t for c in COLOURS for t in THINGS[c]]

    if not any(take(o) for o in OPENINGS if words[: len(o.split())] == o.split()):
        return None
    ok = (
        take(", a")
        and slot("mood", all_moods)
        and slot("animal", ANIMALS)
        and take("lived in a")
        and slot("colour", COLOURS)
        and slot("home", HOMES)
        and take("near the")
        and slot("place", PLACES)
        and take(".")
        and slot("adverb", ADVERBS[HAPPY] + ADVERBS[SAD])
        and take(", the")
    )
    if not ok:
        return None
    if take("sky was"):
        ok = (
            slot("sky", all_skies)
            and take("and the wind was")
            and slot("wind", all_winds)
        )
    else:
        ok = (
            take("wind was")
            and slot("wind", all_winds)
            and take("and the sky was")
            and slot("sky", all_skies)
        )
    if not (ok and take(".")):
        return None
    if take("its friend the") and not (
        slot("visitor", ANIMALS)
        and take("came to say")
        and slot("greet", GREETS[HAPPY] + GREETS[SAD])
        and take(".")
    ):
        return None
    ok = (
        take("the")
        and slot("animal1", ANIMALS)
        and slot("go", GOES[HAPPY] + GOES[SAD])
        and take("outside and")
        and slot("find", FINDS[HAPPY] + FINDS[SAD])
        and take("a")
        and slot("thing1", all_things)
        and take("and a")
        and slot("thing2", all_things)
        and take(". then the")
        and slot("animal2", ANIMALS)
        and slot("verb1", all_verbs)
        and take("and")
        and slot("verb2", all_verbs)
        and take(". at night the")
        and slot("animal3", ANIMALS)
        and take("felt")
        and slot("feeling", all_feelings)
        and take(". the end .")
    )
    if not ok or pos != len(words):
        return None
    return out


def story_problems(text: str) -> list[str]:
    """What is wrong with a full story (opening included), as readable strings.

    Empty when the story follows the grammar and every hard rule of the world:
    the animal is copied faithfully, the two things found match the colour and
    differ, and the two verbs are one of :data:`VERB_PAIRS`. Sentiment
    echoes are soft in this world, so mixed sentiment is not a problem here;
    use :func:`sentiment_of` for that.
    """
    parsed = parse_story(text)
    if parsed is None:
        return ["does not follow the grammar"]
    problems: list[str] = []
    animal, colour = parsed["animal"], parsed["colour"]
    for key in ("animal1", "animal2", "animal3"):
        if parsed[key] != animal:
            problems.append(f"{key} is {parsed[key]!r}, not the protagonist {animal!r}")
    for key in ("thing1", "thing2"):
        if parsed[key] not in THINGS[colour]:
            problems.append(f"{key} {parsed[key]!r} is not a {colour} thing")
    if parsed["thing1"] == parsed["thing2"]:
        problems.append("the same thing is found twice")
    if not any((parsed["verb1"], parsed["verb2"]) in VERB_PAIRS[s] for s in SENTIMENTS):
        problems.append(
            f"{parsed['verb1']!r} and {parsed['verb2']!r} are not a verb pair"
        )
    return problems
