"""What a run hands back: per request, its tokens, logprobs and activations.

``Run`` is a list of ``Trace`` objects, one per engine request (a prompt
sampled ``n`` times gives ``n`` traces). Activations arrive from the workers
as raw float32 bytes and are turned into tensors here. Nothing in this
module touches the engine, so results outlive the Session that made them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Run", "Trace", "decode_tensor"]


def decode_tensor(payload: dict[str, Any]) -> torch.Tensor:
    """Rebuild a tensor sent by a worker as ``{"data": bytes, "shape", "dtype"}``."""
    dtype = getattr(torch, payload["dtype"])
    data = bytearray(payload["data"])
    if not data:
        return torch.empty(payload["shape"], dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(payload["shape"])


@dataclass
class Trace:
    """One request: the tokens the model processed and what was read.

    * ``token_ids`` -- one id per row read: the prompt, then every generated
      token except the last (the last is sampled, never fed back);
    * ``prompt_token_ids`` / ``output_token_ids`` -- as vLLM reports them;
    * ``logprobs`` -- for ``prompt_token_ids + output_token_ids``, the
      logprob of each token under the model (``None`` for the first prompt
      token, which nothing predicts); empty when logprobs were not asked for;
    * ``activations(site)`` -- ``[n_layers_read, n_tokens, hidden]`` float32.
    """

    index: int
    prompt: str
    sample: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    token_ids: list[int]
    tokens: list[str]
    positions: list[int]
    logprobs: list[float | None]
    finish_reason: str | None
    layers: dict[str, list[int]] = field(default_factory=dict)
    _acts: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    copied_bytes: int = 0

    @property
    def sites(self) -> list[str]:
        return list(self._acts)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def activations(self, site: str = "resid_post") -> torch.Tensor:
        """``[n_layers_read, n_tokens, hidden]`` for ``site`` (float32, CPU)."""
        try:
            return self._acts[site]
        except KeyError:
            raise KeyError(
                f"site {site!r} was not read in this run; it has {sorted(self._acts)}. "
                f"Pass sites=[{site!r}] to trace()."
            ) from None

    def layer(self, site: str, layer: int) -> torch.Tensor:
        """``[n_tokens, hidden]`` of one layer."""
        layers = self.layers[site]
        if layer not in layers:
            raise KeyError(f"layer {layer} of {site!r} was not read; read layers: {layers}")
        return self._acts[site][layers.index(layer)]


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
        return f"Run({len(self)} traces, sites={self[0].sites if self._traces else []})"

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
            for k in (
                "request", "sample", "site", "layer", "position", "token_id", "token", "norm"
            )
        }
        for t in self._traces:
            for site, layers in t.layers.items():
                norms = t._acts[site].norm(dim=-1)  # [layers, tokens]
                for li, layer in enumerate(layers):
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
