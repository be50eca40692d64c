"""Real vlens results from plain tensors: for tests, examples and offline work.

A widget, a plot or an analysis that takes a Run can be tried without an
engine. These builders make the same :class:`~vlens.results.Trace`,
:class:`~vlens.results.Run`, :class:`~vlens.results.Comparison` and
:class:`~vlens.results.Sweep` objects a Session returns, filled with the
tensors you give. Each builder checks the shapes a Session would have
produced, so code tried on them meets what a real run hands it::

    from vlens.testing import make_run, make_trace

    t = make_trace([0, 5, 6], [7, 8], reads={"resid_post": torch.randn(4, 3, 16)})
    run = make_run([t])
    run[0].activations("resid_post")     # [4 layers, 3 tokens, 16]
    run[0]["resid_post", 2]              # layer 2: [3 tokens, 16]

:func:`hf_steering_hook` is the one Hugging Face steering hook the tests'
reference, the benchmarks and the training scripts share.

Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Union

import torch

from vlens.results import Comparison, Run, Sweep, Trace, generated_kl

__all__ = ["hf_steering_hook", "make_comparison", "make_run", "make_sweep", "make_trace"]

#: a full or reduced read ``[layers, tokens, ...]``, or the logit lens's
#: ``(ids, probs)``, each ``[layers, tokens, k]``
ReadValue = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def _ids_as_text(ids: Sequence[int]) -> list[str]:
    return [f"<{int(i)}>" for i in ids]


def make_trace(
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    *,
    reads: Mapping[str, ReadValue] | None = None,
    layers: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    token_strings: Callable[[Sequence[int]], list[str]] = _ids_as_text,
    logprobs: Sequence[float | None] | None = None,
    prompt: str = "",
    index: int = 0,
    sample: int = 0,
    copied_bytes: int = 0,
    steered_rows: int = 0,
) -> Trace:
    """One request that processed ``prompt_token_ids`` and generated
    ``output_token_ids``, with ``reads`` as if the workers had read them.

    ``reads`` maps read keys (:func:`vlens.protocol.plan.read_key`) to tensors whose
    first two dimensions are ``[n_layers_read, n_tokens]`` (``n_tokens`` is
    the prompt plus every generated token but the last): ``"resid_post"``
    ``[L, T, hidden]``, ``"resid_post:norm"`` ``[L, T]``,
    ``"resid_post:vocab_logprobs"`` ``[L, T, vocab]`` (log-probabilities), and
    ``"resid_post:logit_lens"`` an ``(ids, probs)`` pair of ``[L, T, k]``,
    ``"attn_pattern"`` ``[L, heads, T, T]``.
    ``layers`` names the layers read: one list for every read, a mapping per
    key, or ``None`` for ``0 … L-1``. ``token_strings`` turns ids into the
    token texts (a Session's ``s.token_strings`` gives the real ones).
    ``logprobs`` has one entry per prompt and output token (``None`` first),
    or is left out as with ``trace(logprobs=False)``.
    """
    prompt_ids, out_ids = [int(i) for i in prompt_token_ids], [int(i) for i in output_token_ids]
    if not prompt_ids:
        raise ValueError("a trace needs at least one prompt token")
    token_ids = prompt_ids + out_ids[:-1]  # the last token is sampled, never fed back
    n = len(token_ids)
    logprobs = list(logprobs) if logprobs is not None else []
    if logprobs and len(logprobs) != len(prompt_ids) + len(out_ids):
        raise ValueError(
            f"logprobs has {len(logprobs)} entries; expected one per prompt and output "
            f"token ({len(prompt_ids) + len(out_ids)})"
        )
    stored: dict[str, dict[str, torch.Tensor]] = {}
    read_layers: dict[str, list[int]] = {}
    for key, value in (reads or {}).items():
        parts = dict(zip(("ids", "probs"), value)) if isinstance(value, tuple) else {"value": value}
        pattern = key == "attn_pattern"  # [layers, heads, T, T]
        for part, tensor in parts.items():
            if pattern and (tensor.dim() != 4 or tensor.shape[2:] != (n, n)):
                raise ValueError(f"read 'attn_pattern' has shape {list(tensor.shape)}; "
                                 f"expected [n_layers_read, heads, {n}, {n}]")
            if not pattern and (tensor.dim() < 2 or tensor.shape[1] != n):
                raise ValueError(
                    f"read {key!r} ({part}) has shape {list(tensor.shape)}; expected "
                    f"[n_layers_read, {n} tokens, ...]"
                )
        first = next(iter(parts.values()))
        wanted = layers.get(key) if isinstance(layers, Mapping) else layers
        read_layers[key] = list(range(first.shape[0])) if wanted is None else list(wanted)
        if len(read_layers[key]) != first.shape[0]:
            raise ValueError(
                f"read {key!r} holds {first.shape[0]} layers but layers names "
                f"{read_layers[key]}"
            )
        stored[key] = parts
    output_tokens = token_strings(out_ids)
    return Trace(
        index=index,
        prompt=prompt,
        sample=sample,
        prompt_token_ids=prompt_ids,
        output_token_ids=out_ids,
        text="".join(output_tokens),
        token_ids=token_ids,
        tokens=token_strings(token_ids),
        output_tokens=output_tokens,
        positions=list(range(n)),
        logprobs=logprobs,
        finish_reason="length",
        _layers=read_layers,
        _reads=stored,
        copied_bytes=copied_bytes,
        steered_rows=steered_rows,
    )


def make_run(traces: Sequence[Trace], *, prompts: Sequence[str] | None = None) -> Run:
    """A Run of ``traces`` (in order). ``prompts`` defaults to the prompt of
    each first sample."""
    traces = list(traces)
    if prompts is None:
        prompts = [t.prompt for t in traces if t.sample == 0]
    return Run(traces, prompts=list(prompts))


def make_comparison(baseline: Run, steered: Run) -> Comparison:
    """A Comparison of two runs of the same prompts. Each trace must hold the
    ``"resid_post:vocab_logprobs"`` read at the last layer, as a Session's does: the
    KL per generated position is computed from it."""
    if len(baseline) != len(steered):
        raise ValueError(f"{len(baseline)} baseline traces but {len(steered)} steered ones")
    return Comparison(baseline, steered, [generated_kl(b, s) for b, s in zip(baseline, steered)])


def make_sweep(
    prompts: str | Sequence[str],
    scales: Sequence[float],
    traces: Sequence[Trace] | Sequence[Sequence[Trace]],
    *,
    baseline: Trace | Sequence[Trace] | None = None,
    label: str = "",
) -> Sweep:
    """A Sweep of ``prompts`` (one prompt: a string) at ``scales``:
    ``traces[j]`` ran at ``scales[j]`` -- a list with one trace per prompt
    (a single trace when there is one prompt). ``baseline`` (the unsteered
    traces, one per prompt) defaults to the traces at scale 0. Traces hold
    the ``"resid_post:vocab_logprobs"`` read, as in :func:`make_comparison`."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    scales = [float(x) for x in scales]
    if len(scales) != len(traces):
        raise ValueError(f"{len(scales)} scales but {len(traces)} traces")
    per_scale = [[t] if isinstance(t, Trace) else list(t) for t in traces]
    if any(len(ts) != len(prompts) for ts in per_scale):
        raise ValueError(f"each scale needs one trace per prompt ({len(prompts)})")
    if baseline is None:
        if 0.0 not in scales:
            raise ValueError("no scale is 0: pass baseline= (the unsteered traces)")
        base = per_scale[scales.index(0.0)]
    else:
        base = [baseline] if isinstance(baseline, Trace) else list(baseline)
    runs = [Run(ts, prompts=list(prompts)) for ts in per_scale]
    return Sweep(prompts, scales, runs, Run(base, prompts=list(prompts)), label=label)


def hf_steering_hook(module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *,
                     pre: bool = False) -> torch.utils.hooks.RemovableHandle:
    """Steer a Hugging Face module: a forward hook that replaces the module's
    output (``pre=True``: its input) ``x`` by ``fn(x)``, in place.

    The output's first element when it is a tuple (decoder layers of older
    transformers), the ``hidden_states`` argument when the input is passed
    by keyword. ``fn`` gets a copy and returns the new rows; for a decoder
    layer this is vlens's ``resid_post`` (``pre=True``: ``resid_pre``), so
    ``hf_steering_hook(model.model.layers[L], lambda x: x + scale * v)`` is
    what ``vlens.Steer(v, layer=L, scale=scale)`` does. Returns the handle
    (``.remove()`` takes the hook off)::

        handle = hf_steering_hook(model.model.layers[3], lambda x: x + 4.0 * v)
        try:
            model.generate(...)
        finally:
            handle.remove()
    """
    def _change(x: torch.Tensor) -> None:
        x.copy_(fn(x.clone()))

    if pre:
        def hook(mod, args, kwargs):  # noqa: ANN001, ANN202
            _change(args[0] if args else kwargs["hidden_states"])

        return module.register_forward_pre_hook(hook, with_kwargs=True)

    def post(mod, args, kwargs, out):  # noqa: ANN001, ANN202
        _change(out[0] if isinstance(out, (tuple, list)) else out)

    return module.register_forward_hook(post, with_kwargs=True)
