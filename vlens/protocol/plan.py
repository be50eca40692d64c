"""The small, serialisable plan that rides on each request.

A plan travels from the client to every worker inside
``SamplingParams.extra_args["vlens"]``, so it holds only plain data (str,
int, float, bool, lists, dicts): vLLM serialises it with msgspec when the
engine runs in other processes, and tensors cannot cross that way. Steering
vectors travel once per engine (``vlens_put_vectors``) and plans name them by
id (a hash of their bytes).

    {"v": 4, "tag": "s0-3-1", "clone": false, "prompt_len": 9,
     "reads":  [{"site": "resid_post", "layers": [0, 2], "reduce": "full", "k": 0}],
     "adds":   [{"site": "resid_post", "layer": 2, "vec": "<id>", "scale": 4.0,
                 "start": 0, "stop": -1, "relative": false}],
     "sets":   [{"site": "z", "layer": 1, "vec": "", "lo": 16, "hi": 32,
                 "start": 0, "stop": -1},
                {"site": "resid_post", "layer": 3, "vec": "<id>", "lo": 0, "hi": -1,
                 "start": 0, "stop": -1, "project": true}],
     "edits":  [{"site": "resid_post", "layer": 2, "fn": "<id>"}]}

``tag`` names the client-side request: vLLM's internal request ids carry a
random suffix and ``n > 1`` fans one prompt into several child requests that
share the tag. ``start``/``stop`` are token positions in the request's own
sequence (``stop == -1``: to the end).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

__all__ = [
    "PLAN_KEY",
    "PLAN_VERSION",
    "Add",
    "EditContext",
    "Plan",
    "Read",
    "Set",
    "Edit",
    "read_key",
    "parse_plan",
]

PLAN_KEY = "vlens"
PLAN_VERSION = 4


@dataclass(frozen=True)
class Read:
    """Read ``site`` at ``layers`` for every row of the request.

    ``reduce`` says what the worker hands back per row: ``"full"`` (the
    activation, ``[n, hidden]``), ``"norm"`` (its L2 norm, ``[n]``),
    ``"logit_lens"`` (top-``k`` ids and probabilities of the model's own
    final norm + unembedding, ``[n, k]`` each) or ``"vocab_logprobs"`` (the logit
    lens over the whole vocabulary, ``[n, vocab]``) or ``"dla"`` (direct
    logit attribution toward ``target``, see :mod:`vlens.worker.attribution`).
    ``heads``: for ``attn_pattern``, the query heads to compute (empty: all)."""

    site: str
    layers: tuple[int, ...]
    reduce: str = "full"
    k: int = 0
    heads: tuple[int, ...] = ()
    #: a feature read: the id of the SAE whose encoder the worker applies
    #: (``reduce`` "sae": every feature, ``k`` = d_sae; "sae_top": each
    #: row's ``k`` largest, as ids and values)
    sae: str = ""
    #: a ``"dla"`` read: ``(answer id, wrong id or -1)``, the logit difference
    #: (or the answer's logit alone) the components are projected onto; part
    #: of the key (``"attn_out:dla:17:-1"``), so reads of two targets never mix
    target: tuple[int, ...] = ()
    #: a read of one prompt position only (negative: from the prompt's end,
    #: -1 its last token; None: every row): the worker picks that row out of
    #: the step before it reduces, and ships ``[1, ...]`` per layer. Not part
    #: of the key: requests reading one position and every row share a group
    position: int | None = None

    def at(self, prompt_len: int) -> int | None:
        """The sequence position this read keeps (None: every row), for a
        request whose prompt has ``prompt_len`` tokens."""
        if self.position is None:
            return None
        return self.position + prompt_len if self.position < 0 else self.position

    @cached_property
    def key(self) -> str:
        return (read_key(self.site, self.reduce) + (f":{self.sae}" if self.sae else "")
                + "".join(f":{x}" for x in self.target))


@dataclass(frozen=True)
class Add:
    """Add ``scale * vector[vec]`` to ``site`` of ``layer`` at positions
    ``[start, stop)`` (a steering edit; ``relative``: times each row's norm)."""

    site: str
    layer: int
    vec: str
    scale: float
    start: int = 0
    stop: int = -1  # -1: to the end of the sequence
    relative: bool = False  # scale by each token's activation norm
    #: a clamp (``vlens.Clamp``): ``vec`` is the decoder row of ``feature``
    #: of SAE ``sae`` and ``scale`` the value it is set to; each row gets
    #: ``(scale - f(row)) * vector``
    sae: str = ""
    feature: int = -1

    def rows_in(self, lo: int, hi: int) -> int:
        """How many of positions ``[lo, hi)`` this add's span covers."""
        stop = hi if self.stop < 0 else min(self.stop, hi)
        return max(0, stop - max(self.start, lo))


@dataclass(frozen=True)
class Set:
    """Replace dims ``[lo, hi)`` of ``site`` at ``layer`` (``hi == -1``: to
    the row's end) with the same dims of ``vector[vec]`` (``vec == ""``:
    zeros), at positions ``[start, stop)``: an ablation, or one cell of a
    patching grid (the clean run's row written into the corrupt run).

    ``project``: instead, take the component along ``vector[vec]`` out of
    each whole row, ``x - (x . v^) v^`` with ``v^ = v / |v|`` (a
    directional ablation; ``lo`` 0 and ``hi`` -1)."""

    site: str
    layer: int
    vec: str = ""  # "": zeros
    lo: int = 0
    hi: int = -1  # -1: to the end of the row
    start: int = 0
    stop: int = -1  # -1: to the end of the sequence
    project: bool = False


@dataclass(frozen=True)
class Edit:
    site: str
    layer: int
    fn: str


@dataclass(frozen=True)
class Plan:
    tag: str
    reads: tuple[Read, ...] = ()
    adds: tuple[Add, ...] = ()
    sets: tuple[Set, ...] = ()
    edits: tuple[Edit, ...] = ()
    clone: bool = False
    prompt_len: int = 0
    index: int = 0

    @cached_property
    def read_slots(self) -> tuple[tuple[tuple[str, int], tuple[str, int], Read], ...]:
        """Every (site, layer) this plan reads, with how it reads there:
        ``((site, layer), (read key, k), read)``; worked out once per plan,
        used by the step planner every step."""
        return tuple(((r.site, layer), (r.key, r.k, r.heads), r)
                     for r in self.reads for layer in r.layers)

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": PLAN_VERSION,
            "tag": self.tag,
            "index": self.index,
            "clone": self.clone,
            "prompt_len": self.prompt_len,
            "reads": [
                {"site": r.site, "layers": list(r.layers), "reduce": r.reduce, "k": r.k,
                 **({"heads": list(r.heads)} if r.heads else {}),
                 **({"sae": r.sae} if r.sae else {}),
                 **({"target": list(r.target)} if r.target else {}),
                 **({"position": r.position} if r.position is not None else {})}
                for r in self.reads
            ],
            "adds": [
                {"site": w.site, "layer": w.layer, "vec": w.vec, "scale": float(w.scale),
                 "start": w.start, "stop": w.stop, "relative": w.relative,
                 **({"sae": w.sae, "feature": w.feature} if w.sae else {})}
                for w in self.adds
            ],
            "sets": [
                {"site": w.site, "layer": w.layer, "vec": w.vec, "lo": w.lo, "hi": w.hi,
                 "start": w.start, "stop": w.stop, **({"project": True} if w.project else {})}
                for w in self.sets
            ],
            "edits": [{"site": e.site, "layer": e.layer, "fn": e.fn} for e in self.edits],
        }


def read_key(site: str, reduce: str) -> str:
    """How a read is named in results: ``"resid_post"`` for the full value,
    ``"resid_post:norm"`` for a reduction."""
    return site if reduce == "full" else f"{site}:{reduce}"


# equal reads / adds tuples of parsed plans, shared: the step planner groups
# requests by these objects (one call's requests all read the same way)
_SHARED: dict[tuple, tuple] = {}


def _shared(parts: tuple) -> tuple:
    if not parts:
        return ()
    if len(_SHARED) > 4096:
        _SHARED.clear()
    return _SHARED.setdefault(parts, parts)


def parse_plan(raw: Any) -> Plan:
    """Wire form -> :class:`Plan`. Raises ValueError on a malformed plan."""
    if not isinstance(raw, dict) or raw.get("v") != PLAN_VERSION:
        raise ValueError(f"not a vlens plan (version {PLAN_VERSION}): {raw!r:.200}")
    prompt_len = int(raw.get("prompt_len", 0))
    reads = tuple(
        Read(str(r["site"]), tuple(int(x) for x in r["layers"]), str(r.get("reduce", "full")),
             int(r.get("k", 0)), tuple(int(h) for h in r.get("heads") or ()),
             str(r.get("sae", "")), tuple(int(x) for x in r.get("target") or ()),
             None if r.get("position") is None else int(r["position"]))
        for r in raw.get("reads") or ()
    )
    for r in reads:
        if r.position is None:
            continue
        if r.site == "attn_pattern":
            raise ValueError("an attn_pattern read covers every row (its keys): it takes no "
                             "position")
        if not -prompt_len <= r.position < prompt_len:
            raise ValueError(f"read {r.key}: position {r.position} is outside the prompt "
                             f"({prompt_len} tokens)")
    return Plan(
        tag=str(raw["tag"]),
        index=int(raw.get("index", 0)),
        clone=bool(raw.get("clone", False)),
        prompt_len=prompt_len,
        reads=_shared(reads),
        adds=_shared(tuple(
            Add(str(w["site"]), int(w["layer"]), str(w["vec"]), float(w["scale"]),
                  int(w.get("start", 0)), int(w.get("stop", -1)),
                  bool(w.get("relative", False)), str(w.get("sae", "")),
                  int(w.get("feature", -1)))
            for w in raw.get("adds") or ()
        )),
        sets=_shared(tuple(
            Set(str(w["site"]), int(w["layer"]), str(w.get("vec", "")), int(w.get("lo", 0)),
                int(w.get("hi", -1)), int(w.get("start", 0)), int(w.get("stop", -1)),
                bool(w.get("project", False)))
            for w in raw.get("sets") or ()
        )),
        edits=tuple(
            Edit(str(e["site"]), int(e["layer"]), str(e["fn"])) for e in raw.get("edits") or ()
        ),
    )


@dataclass(frozen=True)
class EditContext:
    """What an ``edit=`` function learns about the rows it is given.

    ``prompt`` is the prompt's index in the call, ``positions`` the token
    positions of the rows (``[n]``), ``clone`` whether the rows are a copy
    (clone reads on) or a view of engine memory for this step only.
    """

    prompt: int
    tag: str
    site: str
    layer: int
    positions: tuple[int, ...]
    prompt_len: int
    clone: bool
