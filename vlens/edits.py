"""The edits a user asks for: what to write into a run, and where.

``Steer`` adds a direction: a vector ``[hidden]``, a layer, a site, a scale
and a token span. The Session checks it against the model, ships the vector
to the workers once (named by :func:`vector_id`, a hash of its bytes), and
puts a small add entry in each request's plan; the workers apply every
request's adds at a site in one batched ``index_add_``. ``Ablate`` replaces
a site's rows (or some heads of ``z``) with zeros or a mean, or projects a
direction out of them (``direction=``, at one layer or many): ``Set``
entries of the plan (``vlens.methods.ablation``). ``PerPrompt`` gives each
prompt of a call its own edits, and :func:`per_prompt` reads every spelling
of ``steer=`` / ``ablate=`` as one list per prompt. A request with edits
gets a prefix-cache salt (:func:`edit_salt`) so its KV stays apart.

Plain values: nothing here touches the engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlens import spans
from vlens.edit_schema import AblateFields, SteerFields, checked
from vlens.errors import FieldError, VlensError
from vlens.keywords import keywords

__all__ = [
    "Ablate",
    "PerPrompt",
    "ROLE_SPANS",
    "SPANS",
    "Steer",
    "edit_salt",
    "engine_prompt",
    "per_prompt",
    "span_positions",
    "vector_id",
]

#: the named token spans (vlens.spans has the one grammar)
SPANS = spans.NAMES
#: role spans: the content tokens of every message of that role (a
#: conversation prompt only; resolved to positions by vlens.prompts)
ROLE_SPANS = spans.ROLES


def span_positions(span: Any, prompt_len: int) -> tuple[int, int]:
    """A span that is a name or a range as token positions ``[start, stop)``;
    stop -1 = the end. Explicit positions, ``"last"`` and roles are runs of
    rows, made ranges per prompt first (:func:`vlens.prompts.resolve_spans`)."""
    if span == "all":
        return 0, -1
    if span == "prompt":
        return 0, prompt_len
    if span == "generated":
        return prompt_len, -1
    if isinstance(span, str) or isinstance(span, spans.Positions):
        raise VlensError(f"span {span!r} is resolved per prompt (vlens.prompts.resolve_spans)")
    start, stop = span
    start = start + prompt_len if start < 0 else start
    if stop is None:
        return start, -1
    return start, stop + prompt_len if stop < 0 else stop


def vector_id(vector: torch.Tensor) -> str:
    """A stable id for a vector: the hash of its float32 bytes."""
    data = vector.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return "v" + hashlib.sha1(data).hexdigest()[:16]


@dataclass(frozen=True)
class Steer:
    """Add ``scale * vector`` at ``site`` of ``layer``, over ``span``.

    ``span``: the rows to write, in the one span grammar
    (:mod:`vlens.spans`, docs/concepts.md): ``"all"`` (every token),
    ``"prompt"``, ``"generated"`` (tokens the model generated, as they are
    fed back), ``"last"``, a role (``"user"``, ``"assistant"`` …, for a
    conversation prompt), a range ``(start, stop)`` / ``slice(start,
    stop)`` (``stop`` exclusive, None: to the end), or positions (a list,
    or one int). The BOS is a row like any other.

    ``relative=True`` scales the push by each token's own activation norm:
    at token t it adds ``scale * |x_t| * vector / |vector|``, so ``scale``
    reads as "this fraction of the residual stream" whatever the layer
    (the bundled toy-world model's sentiment recipe: layer 3, scale 0.75).
    """

    vector: torch.Tensor
    layer: int
    scale: float = 1.0
    site: str = "resid_post"
    span: str | tuple[int, int] = "all"
    relative: bool = False

    def __post_init__(self) -> None:
        v = self.vector
        if not isinstance(v, torch.Tensor):
            raise VlensError(
                f"Steer vector must be a torch.Tensor of shape [hidden], got {type(v).__name__}"
            )
        if v.dim() != 1:
            raise VlensError(f"Steer vector must have shape [hidden], got {list(v.shape)}")
        if v.device.type == "meta":
            raise VlensError("Steer vector is on the meta device (it holds no data): pass real values")
        if not v.is_floating_point():
            raise VlensError(f"Steer vector must be floating point, got {v.dtype}")
        if not bool(torch.isfinite(v).all()):
            raise VlensError("Steer vector holds NaN or inf: compute it again from finite data")
        f = checked(SteerFields, type(self).__name__, layer=self.layer, scale=self.scale,
                    site=self.site, span=self.span, relative=self.relative)
        object.__setattr__(self, "span", f.span)
        v = v.detach().to("cpu", torch.float32).contiguous()
        if self.relative:
            norm = float(v.norm())
            if norm == 0.0:
                raise VlensError("a relative Steer needs a non-zero vector (its direction is used)")
            v = v / norm
        object.__setattr__(self, "vector", v)

    def with_scale(self, scale: float) -> Steer:
        return Steer(self.vector, self.layer, scale, self.site, self.span, self.relative)

    @property
    def id(self) -> str:
        return vector_id(self.vector)

    def positions(self, prompt_len: int) -> tuple[int, int]:
        """The span as token positions ``[start, stop)``; stop -1 = the end."""
        return span_positions(self.span, prompt_len)


@dataclass(frozen=True)
class Ablate:
    """Replace ``site`` at ``layer`` with zeros (``kind="zero"``) or a mean
    (``kind="mean"``) over ``span``, or project a direction out of it.

    * ``heads``: for ``site="z"`` only, the query heads to knock out
      (the other heads' dims are left alone); None: the whole row;
    * ``span``: the rows, in the one span grammar, as for :class:`~vlens.Steer`;
    * ``mean``: with ``kind="mean"``, the replacement ``[width]`` (``z``:
      ``[heads * head_dim]`` or ``[heads, head_dim]``); None: the site's
      mean over every prompt token of the call (one extra read pass);
    * ``direction``: a vector ``r`` ``[width]``: each row ``x`` of the span
      becomes ``x - (x . r^) r^`` (``r^ = r / |r|``; ``kind`` becomes
      ``"direction"``). With it ``layer`` may also be ``"all"`` or a list of
      layers: the direction is projected out at each of them, in one plan
      (Arditi et al. 2024's directional ablation).
    """

    site: str
    layer: int | str | tuple[int, ...]
    kind: str = "zero"
    heads: Sequence[int] | None = None
    span: str | tuple[int, int] = "all"
    mean: torch.Tensor | None = None
    direction: torch.Tensor | None = None

    def __post_init__(self) -> None:
        f = checked(AblateFields, "Ablate", site=self.site, layer=self.layer, kind=self.kind,
                    heads=self.heads, span=self.span)
        object.__setattr__(self, "heads", f.heads)
        object.__setattr__(self, "span", f.span)
        if self.direction is not None:
            _check_direction(self)
        elif self.kind == "direction":
            raise VlensError("Ablate kind='direction' needs direction= (the vector to project out)")
        _check_layer(self)
        mean = self.mean
        if mean is not None:
            if self.kind != "mean":
                raise VlensError("Ablate mean= is only used with kind='mean'")
            if (not isinstance(mean, torch.Tensor) or not mean.is_floating_point()
                    or mean.dim() not in (1, 2) or mean.device.type == "meta"):
                raise VlensError(
                    "Ablate mean must be a floating-point torch.Tensor of shape [width] "
                    f"(z: [heads, head_dim] also), got {getattr(mean, 'shape', type(mean))}"
                )
            if not bool(torch.isfinite(mean).all()):
                raise VlensError("Ablate mean holds NaN or inf: compute it again from finite data")
            object.__setattr__(self, "mean", mean.detach().to("cpu", torch.float32).reshape(-1))

    def positions(self, prompt_len: int) -> tuple[int, int]:
        """The span as token positions ``[start, stop)``; stop -1 = the end."""
        return span_positions(self.span, prompt_len)

    def with_mean(self, mean: torch.Tensor) -> Ablate:
        return Ablate(self.site, self.layer, "mean", self.heads, self.span, mean)

    def layers(self, n_layers: int) -> tuple[int, ...]:
        """The layers this Ablate writes, in a model of ``n_layers``."""
        if self.layer == "all":
            return tuple(range(n_layers))
        return self.layer if isinstance(self.layer, tuple) else (self.layer,)  # type: ignore[return-value]


# an old keyword (query_heads=) is a TypeError naming its new name (heads=)
Ablate.__init__ = keywords(Ablate.__init__)  # type: ignore[method-assign]
Steer.__init__ = keywords(Steer.__init__)  # type: ignore[method-assign]


def _check_layer(ab: Ablate) -> None:
    """An Ablate's layer: an int; with a direction also "all" or a list of
    distinct layers (kept as a tuple)."""
    layer, many = ab.layer, ab.direction is not None
    if isinstance(layer, int) and not isinstance(layer, bool):
        return
    if isinstance(layer, str):
        if layer == "all" and many:
            return
        raise FieldError(
            "layer", f"Ablate layer {layer!r:.40} is unknown: give a layer number" + (
                ", 'all' (every layer) or a list of layers" if many
                else " (only a directional Ablate, direction=, takes 'all' or a list)"))
    if isinstance(layer, (list, tuple, range)) and many:
        if (not layer or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                 for x in layer)):
            raise FieldError("layer", f"Ablate layer list must hold layer numbers (ints >= 0), got "
                             f"{list(layer)!r:.80}")
        if len(set(layer)) != len(layer):
            raise FieldError("layer", f"Ablate layer list {list(layer)} names a layer twice")
        object.__setattr__(ab, "layer", tuple(int(x) for x in layer))
        return
    want = "an int, 'all' or a list of ints" if many else "an int"
    raise FieldError("layer", f"Ablate layer must be {want}, got {layer!r:.40}"
                     + ("" if many else " (a list of layers needs direction=)"))


def _check_direction(ab: Ablate) -> None:
    """A directional Ablate's vector, kept as a float32 unit vector."""
    r = ab.direction
    extra = [name for name, bad in (("kind=" + repr(ab.kind), ab.kind not in ("zero", "direction")),
                                    ("mean=", ab.mean is not None),
                                    ("heads=", ab.heads is not None)) if bad]
    if extra:
        raise VlensError(
            f"Ablate direction= cannot go with {', '.join(extra)}: it projects one direction "
            "out of whole rows. Give zero/mean or head ablations their own Ablate")
    if (not isinstance(r, torch.Tensor) or r.dim() != 1 or not r.is_floating_point()
            or r.device.type == "meta"):
        raise VlensError(
            "Ablate direction must be a floating-point torch.Tensor of shape [width] (the "
            f"site's row width; hidden size for the residual sites), got "
            f"{getattr(r, 'shape', type(r).__name__)}")
    r = r.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise VlensError("Ablate direction holds NaN or inf: compute it again from finite data")
    norm = float(r.norm())
    if not norm > 0.0:
        raise VlensError("Ablate direction is all zeros: it names no direction; pass a non-zero "
                         "vector (s.direction(...) gives one)")
    object.__setattr__(ab, "kind", "direction")
    object.__setattr__(ab, "direction", (r / norm).to(torch.float32).contiguous())



class PerPrompt(Sequence):
    """``steer=`` (or ``ablate=``) with one entry per prompt, in prompt
    order: each entry a :class:`Steer` (:class:`~vlens.Ablate`), a list of
    them (all on that prompt), or None (that prompt runs unchanged)::

        s.trace([a, b, c], steer=vlens.PerPrompt([st, None, [st, st2]]))

    A plain Steer or list of Steers means "all of these on every prompt";
    this is the only spelling for "one each"."""

    def __init__(self, entries: Sequence[Any]) -> None:
        kinds = (Steer, Ablate)
        if isinstance(entries, (str, *kinds)) or not isinstance(entries, (list, tuple)):
            raise VlensError(
                "PerPrompt takes a list with one entry per prompt (a Steer or Ablate, a list "
                f"of them, or None), got {type(entries).__name__}"
            )
        out: list[tuple[Any, ...]] = []
        for i, entry in enumerate(entries):
            if entry is None:
                out.append(())
            elif isinstance(entry, kinds):
                out.append((entry,))
            elif isinstance(entry, (list, tuple)) and all(isinstance(x, kinds) for x in entry):
                out.append(tuple(entry))
            else:
                raise VlensError(
                    f"PerPrompt entry {i} is {entry!r:.80}: use a Steer (or Ablate), a list of "
                    "them, or None"
                )
        self._entries = tuple(out)

    def __getitem__(self, i):  # type: ignore[override]
        return self._entries[i]

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"PerPrompt({[len(e) for e in self._entries]} steers per prompt)"


def edit_salt(writes: list[dict[str, Any]], edits: list[dict[str, Any]]) -> str | None:
    """The prefix-cache salt of a request with these edits (None: no edits).

    Same edits -> same salt, so identical steered requests still share KV
    blocks; anything else keeps its steered KV apart from everyone else's."""
    if not writes and not edits:
        return None
    canon = json.dumps({"w": writes, "e": edits}, sort_keys=True)
    return "vlens-" + hashlib.sha1(canon.encode()).hexdigest()[:20]


def engine_prompt(ids: list[int], plan: Any, prefix: int | None = None) -> dict[str, Any]:
    """vLLM's prompt for a request: its token ids, and the prefix-cache salt
    of its plan's edits (steered, ablated or patched KV is kept apart from
    everyone else's). ``plan``: a :class:`vlens.protocol.plan.Plan` or None.
    ``prefix``: the request's first ``prefix`` tokens are unedited and the
    engine keeps its blocks from there on out of the prefix cache
    (:mod:`vlens.engine.prefix_cache`), so it goes unsalted."""
    p: dict[str, Any] = {"prompt_token_ids": ids}
    if plan is not None and prefix is None:
        salt = edit_salt([a.__dict__ for a in plan.adds]
                         + [dict(w.__dict__, set=True) for w in plan.sets],
                         [e.__dict__ for e in plan.edits])
        if salt:
            p["cache_salt"] = salt
    return p


def _steer_key(st: Steer) -> tuple:
    return (st.id, st.layer, st.site, float(st.scale), st.span, st.relative)


def _no_twice(steers: list[Steer], where: str) -> list[Steer]:
    """The same Steer twice on one prompt would add it twice: refused (an
    Ablate twice is refused by its checks, which compare the dims written)."""
    seen = set()
    for st in steers:
        key = _steer_key(st)
        if key in seen:
            raise VlensError(
                f"{where} holds the same Steer twice (layer {st.layer}, {st.site}, scale "
                f"{st.scale}, span {st.span!r}): it would add it twice: use scale=2x "
                f"({st.scale * 2:g}) instead"
            )
        seen.add(key)
    return steers


def per_prompt(value: Any, n_prompts: int, kind: type = Steer) -> list[list[Any]]:
    """``steer=`` (``kind=Steer``) or ``ablate=`` (``kind=Ablate``) as one
    list of edits per prompt.

    One edit or a list of them: all of them on every prompt. A list as long
    as the prompts (two or more) is ambiguous and refused; so is a list
    holding None or lists. :class:`PerPrompt` gives one entry per prompt."""
    name = kind.__name__  # "Steer" / "Ablate"
    kw = name.lower()  # the keyword: steer= / ablate=
    if value is None:
        return [[] for _ in range(n_prompts)]
    if isinstance(value, kind):
        return [[value] for _ in range(n_prompts)]
    if isinstance(value, PerPrompt):
        if len(value) != n_prompts:
            raise VlensError(
                f"PerPrompt has {len(value)} per-prompt entries for {n_prompts} prompts: "
                f"give one entry (a{'n' if name[0] in 'AEIOU' else ''} {name}, a list of "
                f"{name}s, or None) per prompt"
            )
        other = "Ablates as ablate=" if kind is Steer else "Steers as steer="
        for i, e in enumerate(value):
            for x in e:
                if not isinstance(x, kind):
                    raise VlensError(
                        f"{kw}= PerPrompt entry {i} holds a {type(x).__name__}: {kw}= takes "
                        f"{name}s (pass {other})"
                    )
        out = [list(e) for e in value]
        if kind is Steer:
            out = [_no_twice(e, f"PerPrompt entry {i}") for i, e in enumerate(out)]
        return out
    if isinstance(value, (list, tuple)):
        if any(x is None or isinstance(x, (list, tuple)) for x in value):
            raise VlensError(
                f"{kw}= is a list holding None or lists: for one entry per prompt write "
                f"vlens.PerPrompt([...]) (each entry a{'n' if name[0] in 'AEIOU' else ''} "
                f"{name}, a list of {name}s, or None)"
            )
        for x in value:
            if not isinstance(x, kind):
                raise VlensError(
                    f"{kw} entries must be vlens.{name} objects, got {type(x).__name__}"
                )
        if len(value) == n_prompts >= 2:
            a = kw[0]
            raise VlensError(
                f"{kw}= lists {n_prompts} {name}s for {n_prompts} prompts, which is "
                f"ambiguous. One each: {kw}=vlens.PerPrompt([{a}1, {a}2, ...]); all of them "
                f"on every prompt: {kw}=vlens.PerPrompt([[{a}1, {a}2, ...]] * {n_prompts})"
            )
        edits = list(value)
        if kind is Steer:
            edits = _no_twice(edits, "steer=")
        return [list(edits) for _ in range(n_prompts)]
    raise VlensError(
        f"{kw} must be a vlens.{name}, a list of them, vlens.PerPrompt([...]) or None; "
        f"got {type(value).__name__}"
    )
