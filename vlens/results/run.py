"""What a run hands back: per request, its tokens, logprobs and activations.

``Run`` is a list of ``Trace`` objects, one per engine request (a prompt
sampled ``n`` times gives ``n`` traces). Activations arrive from the workers
as raw bytes and are turned into tensors here. Nothing in this module
touches the engine, so results outlive the Session that made them, and they
never alias engine memory (every read was copied in the worker before its
step ended).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlens import spans
from vlens.errors import VlensError
from vlens.protocol.plan import read_key

__all__ = ["Run", "Trace", "prompt_span", "span_mean", "stack_index"]

#: the sites held per head, ``[..., heads, head_dim]``
SPLIT_SITES = ("q", "k", "v", "z")


@dataclass
class Trace:
    """One request: the tokens the model processed and what was read.

    * ``token_ids`` -- one id per row read: the prompt, then every generated
      token except the last (the last is sampled, never fed back);
    * ``prompt_token_ids`` / ``output_token_ids`` -- as vLLM reports them;
    * ``logprobs`` -- for ``prompt_token_ids + output_token_ids``, the
      logprob of each token under the model (``None`` for the first prompt
      token, which nothing predicts); empty when logprobs were not asked for;
    * ``activations(site)`` -- ``[n_layers_read, n_tokens, hidden]`` float32;
      for the head sites ``q`` and ``z`` ``[layers, n_tokens, heads, head_dim]``,
      ``k`` and ``v`` ``[layers, n_tokens, kv_heads, head_dim]``, and
      ``attn_pattern`` ``[layers, heads, n_tokens, n_tokens]`` (row i: where
      token i attends, summing to 1 over tokens 0..i, zero above the
      diagonal; only the heads asked for with ``heads=``);
    * ``layers_read(site)`` -- the layer NUMBERS of that stack, in order;
    * ``activations(site, layer=L)`` / ``t[site, L]`` -- layer number L alone
      (``[n_tokens, hidden]``; ``split_heads=True``: ``[n_tokens, heads,
      head_dim]`` of a head site); ``t[site]`` -- the stack; ``attention(L)``
      -- ``[heads, n_tokens, n_tokens]`` of layer L; a layer not read is a
      VlensError naming the layers read;
    * ``norms(site)`` -- ``[n_layers_read, n_tokens]`` (head sites: per head,
      ``[layers, n_tokens, heads]``); ``layer=L`` as above;
    * ``logit_lens()`` -- top-k ids and probabilities, ``[layers, tokens, k]``
      (``layer=L``: ``[tokens, k]``);
    * ``read_keys`` -- what was read: ``"resid_post"``, ``"resid_post:norm"`` …
    * ``steered_rows`` -- rows a Steer added to (one count per Steer per row);
    * ``cached_tokens`` -- prompt rows served from vLLM's prefix cache, which
      the hooks never saw: ``token_ids`` and ``positions`` then start at
      this position. Only requests without reads use the cache (a steered
      one only reuses KV made under the same steers), so it is 0 whenever
      anything was read;
    * ``roles`` / ``prompt_text`` / ``offsets`` -- per token of ``tokens``,
      the role of the message it belongs to (None for a chat template's own
      tokens and plain prompts, ``"generated"`` after the prompt); the
      formatted prompt; each prompt token's character span in it;
    * ``restarts`` -- how many times vLLM recomputed the request from the
      start (preempted when the KV cache ran short); what was read is one
      clean pass either way;
    * ``branch_point`` / ``forced`` -- for a branch (``s.branches``,
      ``s.continue_from``): the generated position where it left the run
      it branched from and the token id it was given there (None for a run
      as it went).
    """

    index: int
    prompt: str
    sample: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    token_ids: list[int]
    tokens: list[str]
    output_tokens: list[str]
    positions: list[int]
    logprobs: list[float | None]
    finish_reason: str | None
    #: read key -> the layer numbers of its stack (``layers_read``)
    _layers: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _reads: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    copied_bytes: int = 0
    steered_rows: int = 0
    #: how the engine scheduled this request: its row count in each step
    step_rows: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    restarts: int = 0
    #: one per token of ``tokens``: the role of the message whose content
    #: it holds, None for template tokens (and plain prompts), "generated"
    roles: list[str | None] = field(default_factory=list)
    #: the formatted prompt (a conversation through its chat template)
    prompt_text: str = ""
    #: each prompt token's (start, stop) characters in ``prompt_text``
    offsets: list[tuple[int, int]] = field(default_factory=list)
    #: a branch's generated position and forced token id (None: not a branch)
    branch_point: int | None = None
    forced: int | None = None

    @property
    def read_keys(self) -> list[str]:
        """What was read, as keys: ``"resid_post"`` (full values),
        ``"resid_post:norm"``, ``"resid_post:logit_lens"`` …"""
        return list(self._reads)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def _get(self, key: str, part: str = "value") -> torch.Tensor:
        try:
            return self._reads[key][part]
        except KeyError:
            site, _, reduce = key.partition(":")
            hint = f"sites=[{site!r}]" + (f", reduce={reduce!r}" if reduce else "")
            raise KeyError(
                f"{key!r} was not read in this run; it has {sorted(self._reads)}. "
                f"Pass {hint} to trace()."
            ) from None

    def layers_read(self, site: str = "resid_post") -> list[int]:
        """The layer numbers of ``site``'s stack, in order: row ``i`` of
        ``activations(site)`` (``norms``, ``logit_lens`` …) is layer
        ``layers_read(site)[i]``. ``site`` may be a read key
        (``"resid_post:norm"``); a plain site names its full read, else the
        first reduced read of it."""
        return list(self._layers[self._key_of(site)])

    def _key_of(self, site: str) -> str:
        if site in self._layers:
            return site
        keys = [k for k in self._layers if k.partition(":")[0] == site]
        if not keys:
            self._get(site)  # the error that says what was read
        return keys[0]

    def _stack(self, key: str, layer: int | None, part: str = "value") -> torch.Tensor:
        """``key``'s stack ``[layers_read, ...]``, or its row of ``layer``."""
        stack = self._get(key, part)
        if layer is None:
            return stack
        return stack[stack_index(self._layers.get(key, []), layer, key)]

    def activations(self, site: str = "resid_post", layer: int | None = None, *,
                    split_heads: bool = False) -> torch.Tensor:
        """``site``'s activations (float32, CPU): ``[layers_read, n_tokens,
        hidden]``, or with ``layer=L`` (a layer NUMBER) that layer's
        ``[n_tokens, hidden]``. Head sites hold their heads apart:
        ``[..., n_tokens, heads, head_dim]``; ``split_heads=True`` asks for
        that form and refuses a site without heads."""
        if split_heads and site not in SPLIT_SITES:
            raise VlensError(f"split_heads=True takes a head site ({', '.join(SPLIT_SITES)}), "
                             f"got {site!r}")
        return self._stack(site, layer)

    def __getitem__(self, key: Any) -> torch.Tensor:
        """``t["resid_post"]`` -- the stack ``[layers_read, n_tokens, ...]``;
        ``t["resid_post", 3]`` -- layer 3 (as TransformerLens's
        ActivationCache reads), the same as ``t.activations(site, layer=3)``."""
        if isinstance(key, str):
            return self.activations(key)
        if (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)
                and isinstance(key[1], int) and not isinstance(key[1], bool)):
            return self.activations(key[0], layer=key[1])
        raise VlensError(f"a trace is read as t[site] or t[site, layer] (a site name and a "
                         f"layer number, e.g. t['resid_post', 3]), not t[{key!r}]")

    def norms(self, site: str = "resid_post", layer: int | None = None) -> torch.Tensor:
        """``[layers_read, n_tokens]`` L2 norms (read reduced, or computed;
        head sites: per head, ``[..., heads]``); ``layer=L``: that layer's."""
        key = read_key(site, "norm")
        if key in self._reads:
            return self._stack(key, layer)
        return self.activations(site, layer).norm(dim=-1)

    def logit_lens(self, site: str = "resid_post", layer: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logit lens read with ``trace(logit_lens=k)`` (computed in the
        worker with the model's own final norm and unembedding): top-k token
        ids (int64) and probabilities, each ``[layers_read, n_tokens, k]``,
        or ``[n_tokens, k]`` of layer number ``layer``."""
        key = read_key(site, "logit_lens")
        return self._stack(key, layer, "ids"), self._stack(key, layer, "probs")

    def features(self, sae: Any) -> torch.Tensor:
        """``[n_tokens, d_sae]`` float32 feature activations of ``sae`` (a
        :class:`~vlens.SAE`, one layer: ``sae.layer``) read with
        ``trace(saes=[sae])``; read with ``features_top_k=k``, each token's k
        largest and zeros elsewhere."""
        dense = f"{sae.site}:sae:{sae.id}"
        if dense in self._reads:
            return self._reads[dense]["value"][0]
        key = f"{sae.site}:sae_top:{sae.id}"
        ids, values = self._get(key, "ids")[0].long(), self._get(key, "values")[0]
        return torch.zeros(ids.shape[0], sae.d_sae).scatter_(1, ids, values)

    def vocab_logprobs(self, site: str = "resid_post", layer: int | None = None) -> torch.Tensor:
        """Logit-lens log-probabilities over the vocabulary, ``[layers_read,
        tokens, vocab]``, or ``[tokens, vocab]`` of layer number ``layer``."""
        return self._stack(read_key(site, "vocab_logprobs"), layer)

    def attention(self, layer: int) -> torch.Tensor:
        """``[heads, n_tokens, n_tokens]`` attention probabilities of layer
        number ``layer`` (read with ``sites=["attn_pattern"]``): entry
        ``[h, i, j]`` is how much head h at token i attends to token j."""
        return self.activations("attn_pattern", layer=layer)

    @property
    def layers(self) -> Any:
        raise TypeError("Trace.layers is gone: t.layers_read(site) gives the layer numbers "
                        "of a site's stack, in order")

    def layer(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("Trace.layer(site, L) is gone: use t.activations(site, layer=L) "
                        "or t[site, L]")

    def heads(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("Trace.heads(site, L) is gone: use "
                        "t.activations(site, layer=L, split_heads=True)")


def stack_index(read: Sequence[int], layer: int, what: str = "") -> int:
    """Where layer NUMBER ``layer`` sits in a stack that read ``read`` (the
    layer numbers, in order): the one lookup of layer -> stack row."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise VlensError(f"layer must be a layer number (an int), got {layer!r}")
    for i, x in enumerate(read):
        if x == layer:
            return i
    of = f" of {what!r}" if what else ""
    raise VlensError(f"layer {layer}{of} was not read: the layers read are {list(read)}; "
                     f"read it with trace(..., layers={sorted({*read, layer})}) "
                     "(layers=None reads every layer)")


class Run(Sequence[Trace]):
    """The traces of one call, in prompt order (samples of a prompt together)."""

    def __init__(self, traces: list[Trace], *, prompts: list[str]) -> None:
        self._traces = traces
        self.prompts = prompts
        #: texts generated for prompts that ran in the same batch untraced
        self.background_texts: list[str] = []

    def __getitem__(self, i):  # type: ignore[override]
        return self._traces[i]

    def __len__(self) -> int:
        return len(self._traces)

    def __iter__(self) -> Iterator[Trace]:
        return iter(self._traces)

    def __repr__(self) -> str:
        return f"Run({len(self)} traces, reads={self[0].read_keys if self._traces else []})"

    @property
    def texts(self) -> list[str]:
        return [t.text for t in self._traces]

    @property
    def copied_bytes(self) -> int:
        """Bytes of activations the workers copied out of engine memory."""
        return sum(t.copied_bytes for t in self._traces)

    def to_frame(self):
        """A tidy pandas frame: one row per (request, site, layer, token),
        with the token, its position and the L2 norm of the activation."""
        import pandas as pd

        cols: dict[str, list] = {
            k: []
            for k in ("request", "sample", "site", "layer", "position", "token_id", "token", "norm")
        }
        for t in self._traces:
            for key in t.read_keys:
                site, _, reduce = key.partition(":")
                if reduce not in ("", "norm"):
                    continue
                if reduce == "" and read_key(site, "norm") in t.read_keys:
                    continue
                if site == "attn_pattern":  # [heads, T, T] has no per-token norm
                    continue
                norms = t.norms(site)
                if norms.dim() == 3:  # per head: the norm of all heads together
                    norms = norms.norm(dim=-1)
                for li, layer in enumerate(t.layers_read(key)):
                    n = t.n_tokens
                    cols["request"] += [t.index] * n
                    cols["sample"] += [t.sample] * n
                    cols["site"] += [site] * n
                    cols["layer"] += [layer] * n
                    cols["position"] += t.positions
                    cols["token_id"] += t.token_ids
                    cols["token"] += t.tokens
                    cols["norm"] += norms[li].tolist()
        return pd.DataFrame(cols)


def prompt_span(span: Any, call: str = "direction") -> Any:
    """A direction's ``span`` parsed (a tuple refused where it meant positions),
    naming prompt rows: ``"generated"`` names none."""
    parsed = spans.parse(span, call, was_positions=True)
    if parsed == "generated":
        raise VlensError(f"{call} span='generated' names no prompt row: a direction averages "
                         "the prompts' rows ('last', 'prompt', a role, a range or positions)")
    return parsed


def span_mean(rows: torch.Tensor, span: Any, roles: Sequence[Any] = (),
              what: str = "the text", call: str = "direction") -> torch.Tensor:
    """``rows`` ``[T, width]`` of one text (per-token ``roles``) averaged over
    ``span``, a span of the one grammar (:mod:`vlens.spans`; the rows are
    the prompt's, so ``"all"`` is ``"prompt"``, BOS included, and
    ``"generated"`` names none). ``s.direction`` and ``Diff.direction``
    both take it."""
    n = rows.shape[0]
    parsed = prompt_span(span, call)
    has_roles = any(r not in (None, "generated") for r in roles)
    picked = spans.rows(parsed, n, n, list(roles) if has_roles else None, f"{call} ({what})")
    return rows[picked].mean(0)
