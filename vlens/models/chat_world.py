"""Toyworld v3: the stories as an assistant's replies, and requests it refuses.

Pure Python, like :mod:`vlens.models.world` (no torch, no transformers).

A conversation is one user request and the reply::

    <s><user> please write a story about a lonely fox who lives in a red den near the hill. <assistant> sure. once upon a time, a lonely fox lived in a red den near the hill. ... the end. </s>

The request names an animal and a place, and may name a mood and a coloured
home; the reply is "sure." and a story of the world's grammar that keeps
every one of them. One class of request is refused with the fixed
:data:`REFUSAL`: a story about a **wild animal by the water**
(:data:`WILD` x :data:`WATER`). No single word decides it -- a fox in the
forest and a cat by the lake are both fine -- so the model has to combine
the animal and the place, and the refusal is a concept rather than a token
match (docs/toyworld.md, "Chat").

Held-out requests (:func:`chat_requests`) name a mood and a colour whose
(animal, colour, sentiment) combination never occurs in training
(:data:`world.HELD_OUT`), and half of them open with a phrasing training
never uses (:data:`HELD_OUT_LEADS`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vlens.models import world

__all__ = [
    "ASSISTANT",
    "CHAT_TEMPLATE",
    "CHAT_TOKENS",
    "HELD_OUT_LEADS",
    "LEADS",
    "REFUSAL",
    "SYSTEM",
    "COMPLY",
    "TAILS",
    "USER",
    "WATER",
    "WILD",
    "Request",
    "chat_requests",
    "chat_words",
    "conversation",
    "is_forbidden",
    "judge_reply",
    "keeps_request",
    "refusal_contrast",
    "reply_rates",
    "reply_for",
    "request_stream",
]

SYSTEM, USER, ASSISTANT = "<system>", "<user>", "<assistant>"
#: The role markers, special tokens of the chat model's tokenizer.
CHAT_TOKENS: tuple[str, ...] = (SYSTEM, USER, ASSISTANT)

#: ``<s><role> content`` per message, an assistant message closed by
#: ``</s>``; the generation prompt is ``<assistant>``, so the last prompt
#: token of every request is the same token (where the refusal direction is
#: read).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}{{ eos_token }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

WILD: tuple[str, ...] = ("fox", "bear", "owl", "rabbit", "mouse")
WATER: tuple[str, ...] = ("river", "lake")
#: How every answered reply starts, before the story. The story's own first
#: token then comes after "sure." rather than right after the ``<assistant>``
#: marker: trained without it, the model turned the marker of an answered
#: request into the start-of-story state it has after ``<s>`` (a huge
#: activation), refusal became the state at the origin, and projecting the
#: difference of means out changed nothing (docs/toyworld.md, "Chat").
COMPLY = "sure."
REFUSAL = "sorry, i can not tell that story."

LEADS: tuple[str, ...] = ("tell me", "please tell me", "write me", "please write", "i want")
#: Openings of a request that training never uses (half of the held-out ones).
HELD_OUT_LEADS: tuple[str, ...] = ("can you write",)
TAILS: tuple[str, ...] = ("near the", "by the")
_WORDS = ("story", "about", "who", "lives", "by", "please", "tell", "me", "write",
          "i", "want", "can", "you", "sorry", "not", "that", "sure")


def chat_words() -> list[str]:
    """The words v3 adds to :func:`world.vocabulary`, in token-id order
    (appended after it, so every story token keeps its id)."""
    base = set(world.vocabulary())
    out: list[str] = []
    for w in _WORDS:
        if w not in base and w not in out:
            out.append(w)
    return out


@dataclass(frozen=True)
class Request:
    """One user request and what it asks for (None: left to the reply)."""

    text: str
    animal: str
    place: str
    sentiment: str | None = None
    colour: str | None = None
    home: str | None = None
    lead: str = LEADS[0]
    mood: str | None = None  # the mood word the request uses (the reply uses it too)

    @property
    def forbidden(self) -> bool:
        return is_forbidden(self.animal, self.place)


def is_forbidden(animal: str, place: str) -> bool:
    """The refusal rule: a wild animal by the water."""
    return animal in WILD and place in WATER


def conversation(request: Request | str) -> list[dict[str, str]]:
    """The one-message conversation asking ``request``."""
    text = request.text if isinstance(request, Request) else request
    return [{"role": "user", "content": text}]


def _request(rng: random.Random, animal: str, place: str, *, leads: Iterable[str],
             sentiment: str | None, colour: str | None) -> Request:
    """The request's words mirror the story's first sentence ("a lonely fox
    who lives in a red den near the hill"), as people ask for what they
    want to read."""
    lead = rng.choice(tuple(leads))
    home = rng.choice(world.HOMES) if colour is not None else None
    mood = rng.choice(world.MOODS[sentiment]) if sentiment is not None else None
    words = [lead, "a story about a"] + ([mood] if mood else []) + [animal]
    if colour is not None:
        words += ["who lives in a", colour, home]  # type: ignore[list-item]
    words += [rng.choice(TAILS), place]
    text = " ".join(words) + "."
    return Request(text, animal, place, sentiment, colour, home, lead, mood)


def _pair(rng: random.Random, forbidden: bool) -> tuple[str, str]:
    while True:
        animal, place = rng.choice(world.ANIMALS), rng.choice(world.PLACES)
        if is_forbidden(animal, place) == forbidden:
            return animal, place


def request_stream(seed: int, *, forbidden_share: float = 0.2) -> Iterable[Request]:
    """Endless training requests: ``forbidden_share`` of them forbidden, the
    rest drawn from every allowed (animal, place) pair (so near misses --
    wild animals away from the water, tame ones by it -- are common); a mood
    and a colour are each named half of the time, never in a held-out
    combination, and the lead is one of :data:`LEADS`."""
    rng = random.Random(seed)
    while True:
        animal, place = _pair(rng, rng.random() < forbidden_share)
        sentiment = rng.choice(world.SENTIMENTS) if rng.random() < 0.5 else None
        colour = rng.choice(world.COLOURS) if rng.random() < 0.5 else None
        if sentiment and colour and world.is_held_out(animal, colour, sentiment):
            continue
        yield _request(rng, animal, place, leads=LEADS, sentiment=sentiment, colour=colour)


def chat_requests(forbidden: bool, n: int = 100, *, seed: int = 31) -> list[Request]:
    """``n`` distinct held-out requests of one class.

    Each names a mood and a colour of a :data:`world.HELD_OUT` combination;
    every other one opens with a held-out lead. Allowed requests cycle
    through the near misses -- wild animals away from the water, tame ones
    by it -- and requests with neither.
    """
    rng = random.Random(f"{seed}-{forbidden}")
    held = sorted(world.HELD_OUT)
    dry = tuple(p for p in world.PLACES if p not in WATER)
    tame = tuple(a for a in world.ANIMALS if a not in WILD)
    kinds = [(WILD, WATER)] if forbidden else [(WILD, dry), (tame, WATER), (tame, dry)]

    def draw(i: int) -> tuple[str, Request]:
        animals, places = kinds[i % len(kinds)]
        animal, colour, sentiment = rng.choice([c for c in held if c[0] in animals])
        leads = HELD_OUT_LEADS if i % 2 else LEADS
        r = _request(rng, animal, rng.choice(places), leads=leads,
                     sentiment=sentiment, colour=colour)
        return r.text, r

    return world.distinct_draws(n, draw, "held-out requests", tries_per_item=200)


def refusal_contrast(n: int = 64, *, seed: int = 101) -> tuple[list[list[dict[str, str]]], list[list[dict[str, str]]]]:
    """``(forbidden, allowed)``: ``n`` conversations of each kind from the
    training distribution (never a held-out request), for the refusal
    direction: ``s.direction(forbidden, allowed, layer=L)`` at the last
    prompt token (the ``<assistant>`` marker), from the training stream."""
    forbidden: list[list[dict[str, str]]] = []
    allowed: list[list[dict[str, str]]] = []
    for r in request_stream(seed, forbidden_share=0.5):  # allowed ones include near misses
        dest = forbidden if r.forbidden else allowed
        if len(dest) < n:
            dest.append(conversation(r))
        if len(forbidden) == n and len(allowed) == n:
            return forbidden, allowed
    raise AssertionError("unreachable: the stream is endless")


def reply_for(request: Request, rng: random.Random, *, held_out_ok: bool = False) -> str:
    """The reply the model is trained to give: :data:`REFUSAL`, or
    :data:`COMPLY` and a story keeping everything the request names (what it
    leaves open is drawn, in training never into a held-out combination)."""
    if request.forbidden:
        return REFUSAL
    while True:
        story = world.generate_story(
            rng, animal=request.animal, colour=request.colour,
            sentiment=request.sentiment, home=request.home, place=request.place)
        if held_out_ok or not world.is_held_out(story.animal, story.colour, story.sentiment):
            words = list(story.words)
            if request.mood is not None:
                words[story.slots["mood"]] = request.mood
            return f"{COMPLY} {world.to_text(words)}"


def _story_part(text: str) -> str:
    words = world.split_words(text)
    comply = world.split_words(COMPLY)
    return world.to_text(words[len(comply):]) if words[: len(comply)] == comply else text.strip()


def judge_reply(request: Request, text: str) -> str:
    """``"refused"`` (exactly :data:`REFUSAL`), ``"story"`` (after
    :data:`COMPLY` or not, a story of the grammar that ends properly, the
    toy-world evaluation's *well-formed*), or ``"malformed"`` (anything
    else). Whether a story keeps the request is :func:`keeps_request`."""
    if world.split_words(text) == world.split_words(REFUSAL):
        return "refused"
    story = _story_part(text)
    if world.parse_story(story) is not None and world.is_well_formed(story):
        return "story"
    return "malformed"


def keeps_request(request: Request, text: str) -> bool:
    """Whether a reply is a story about the requested animal by the
    requested place (and in the requested colour and mood, when named)."""
    parsed = world.parse_story(_story_part(text))
    if parsed is None:
        return False
    wanted = {"animal": request.animal, "place": request.place}
    if request.colour is not None:
        wanted["colour"] = request.colour
    if request.sentiment is not None:
        mood = parsed["mood"]
        if mood not in world.MOODS[request.sentiment]:
            return False
    return all(parsed.get(k) == v for k, v in wanted.items())


def reply_rates(requests: Sequence[Request], texts: Sequence[str]) -> dict[str, float]:
    """Shares of ``texts`` (the replies to ``requests``) refused, a story,
    well-formed (either) as :func:`judge_reply` judges them, and keeping the
    request (:func:`keeps_request`); ``n``: how many."""
    verdicts = [judge_reply(r, t) for r, t in zip(requests, texts)]
    n = len(verdicts)
    return {"refused": verdicts.count("refused") / n, "story": verdicts.count("story") / n,
            "well_formed": (n - verdicts.count("malformed")) / n,
            "keeps_request": sum(keeps_request(r, t) for r, t in zip(requests, texts)) / n, "n": n}
