"""A Hugging Face twin of the engine's model, for what vLLM cannot do:
gradients.

vLLM runs without autograd, so attribution patching and saliency
(:mod:`vlens.methods.gradients`) run on a ``transformers`` model built from
the same folder, in float32, with the engine's named sites as hooks on the
modules of the architecture's ``hf`` row (:mod:`vlens.protocol.architectures`).
Before a twin serves anything it is checked: a few prompts run through the
engine (``s.trace``, full reads at every site and layer both offer) and
through the twin, and a twin whose reads differ from the engine's by more
than :data:`TOLERANCE` is refused with the measured difference per site.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from vlens.errors import VlensError
from vlens.protocol.architectures import ARCHITECTURES, Layout

__all__ = ["SITES", "TOLERANCE", "Twin", "held", "model_folder", "site_module"]

#: the sites a twin reads (and takes gradients at)
SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z")

#: the largest difference a twin may show against the engine, per site read,
#: by the engine's dtype: absolute + relative x the site's largest |value|.
#: The absolute 1e-4 is tests/test_models.py's bound (every architecture
#: against Hugging Face in float32, docs/models.md), measured on tiny random
#: models whose values are about 1; float32 rounding grows with the values,
#: and a trained model's residual stream reaches thousands (the bundled
#: model's 6e3, with differences of 2e-3: 3e-7 of it), hence the relative
#: term. The 16-bit rows allow the engine's own rounding against a float32
#: twin (bfloat16 keeps about 3 significant digits).
TOLERANCE = {"float32": (1e-4, 1e-4), "bfloat16": (1e-3, 3e-2), "float16": (1e-4, 5e-3)}

#: the check's prompts: (length, seed) of random token sequences
CHECK_PROMPTS = ((9, 0), (17, 1))


def _get(root: Any, path: str | None) -> Any:
    """``root``'s attribute at a dotted ``path`` (None when absent)."""
    if not path:
        return None
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def site_module(layer: Any, hf: Layout, site: str) -> tuple[Any, bool]:
    """``(module, pre)`` of ``site`` in one Hugging Face decoder layer: the
    site is the module's first input (``pre``) or its output. ``z`` is the
    input of the attention's output projection (``hf.out_proj``)."""
    if site == "resid_pre":
        return layer, True
    if site == "resid_post":
        return layer, False
    if site == "resid_mid":
        return _get(layer, hf.mid), True
    if site == "z":
        return _get(_get(layer, hf.attn), hf.out_proj), True
    if site in ("attn_out", "mlp_out"):
        return _get(layer, hf.attn if site == "attn_out" else hf.mlp), False
    raise VlensError(f"the twin has no site {site!r}: it has {', '.join(SITES)}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[1, T, H]`` (or ``[T, H]``: OPT flattens before its MLP) -> ``[T, H]``."""
    return x[0] if x.dim() == 3 else x


class Twin:
    """The engine's model in Hugging Face ``transformers`` (float32, on
    ``device``), with the engine's sites as hooks. Made by ``s.twin()``,
    which checks it against the engine first (``differences``: the largest
    difference measured per site; ``tolerance``: what was allowed).

    ``model`` is the ``AutoModelForCausalLM``; ``capture`` the hooks
    that gradients use; ``reads`` the sites' values like a trace's."""

    def __init__(self, path: str, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.path, self.device = str(path), torch.device(device)
        # one user of the model's hooks and forward at a time (a widget's
        # background AtP and a cell's saliency would record each other's)
        self.lock = threading.RLock()
        try:
            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - said with the likely cause
            raise VlensError(
                f"the Hugging Face twin of {self.path} could not be built ({exc}). In a "
                "process where vLLM's Transformers backend (model_impl='transformers') has "
                "started, Hugging Face models of its architecture cannot be built: use a "
                "native-route Session, or a fresh process") from exc
        self.model = model.to(self.device).eval().requires_grad_(False)
        name = (model.config.architectures or [type(model).__name__])[0]
        if name not in ARCHITECTURES:
            raise VlensError(f"the twin's architecture {name} is not one vlens knows")
        self.architecture = name
        self.layout = ARCHITECTURES[name].hf
        self.layers = list(_get(self.model, self.layout.layers))
        self.n_heads = int(model.config.num_attention_heads)
        absent = ARCHITECTURES[name].absent_sites(model.config.to_dict())
        self.sites = tuple(s for s in SITES if s not in absent)
        self.differences: dict[str, float] = {}
        self.tolerance: tuple[float, float] = TOLERANCE["float32"]

    @property
    def param_bytes(self) -> int:
        """What the twin's parameters and buffers take, in bytes."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def ids(self, ids: Sequence[int]) -> torch.Tensor:
        """Token ids as the model's ``[1, T]`` input."""
        return torch.tensor([list(ids)], device=self.device)

    def logits(self, ids: Sequence[int], grad: bool = False) -> torch.Tensor:
        """One forward: the logits ``[T, vocab]``. With ``grad`` the token
        embeddings are the autograd graph's leaf (the weights stay frozen),
        so every site's tensor is in the graph."""
        x = self.model.get_input_embeddings()(self.ids(ids))
        if grad:
            x = x.detach().requires_grad_(True)
        return self.model(inputs_embeds=x).logits[0]

    @contextmanager
    def capture(self, sites: Sequence[str], layers: Sequence[int]
                ) -> Iterator[dict[str, dict[int, torch.Tensor]]]:
        """Hooks that keep each (site, layer)'s tensor of the next forward,
        as the model holds it (in the autograd graph when it is built):
        ``got[site][layer]``, ``[1, T, width]`` (``[T, width]`` where the
        model flattens). :meth:`rows` gives ``[T, width]``."""
        got: dict[str, dict[int, torch.Tensor]] = {s: {} for s in sites}
        handles = []
        self.lock.acquire()

        def keeper(site: str, layer: int, pre: bool):
            if pre:
                def hook(mod, args, kwargs):
                    got[site][layer] = args[0] if args else kwargs["hidden_states"]
            else:
                def hook(mod, args, kwargs, out):
                    got[site][layer] = out[0] if isinstance(out, (tuple, list)) else out
            return hook

        try:
            for layer in layers:
                for site in sites:
                    mod, pre = site_module(self.layers[layer], self.layout, site)
                    reg = mod.register_forward_pre_hook if pre else mod.register_forward_hook
                    handles.append(reg(keeper(site, layer, pre), with_kwargs=True))
            yield got
        finally:
            for h in handles:
                h.remove()
            self.lock.release()

    def rows(self, site: str, x: torch.Tensor) -> torch.Tensor:
        """A captured tensor as ``[T, width]`` (``z``: ``[T, heads, head_dim]``)."""
        x = _rows(x)
        return x.reshape(x.shape[0], self.n_heads, -1) if site == "z" else x

    def reads(self, ids: Sequence[int], sites: Sequence[str] | None = None,
              layers: Sequence[int] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One forward without gradients: the logits ``[T, vocab]`` and each
        site's ``[layers, T, width]`` (``z``: ``[layers, T, heads, head_dim]``),
        as ``t.activations(site)`` of a trace holds them."""
        sites = list(self.sites if sites is None else sites)
        layers = list(range(len(self.layers)) if layers is None else layers)
        with torch.no_grad(), self.capture(sites, layers) as got:
            logits = self.model(self.ids(ids)).logits[0].float()
        return logits.cpu(), {s: torch.stack([self.rows(s, got[s][i]).float().cpu()
                                              for i in layers]) for s in sites}

    def check(self, session: Any) -> dict[str, float]:
        """Run :data:`CHECK_PROMPTS` through the engine and the twin and keep
        the largest difference per site (``differences``); refuse (VlensError
        naming each site's difference) beyond :data:`TOLERANCE`."""
        facts = session.facts
        if len(self.layers) != facts.n_layers:
            raise VlensError(f"the twin ({self.path}) has {len(self.layers)} layers and the "
                             f"engine's model {facts.n_layers}: they are different models")
        sites = [s for s in self.sites if s in facts.sites]
        vocab = min(facts.vocab_size, len(session.tokenizer))
        prompts = [torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed))
                   .tolist() for n, seed in CHECK_PROMPTS]
        run = session.trace([{"prompt_token_ids": p} for p in prompts], sites=sites,
                            max_new_tokens=1, logprobs=False)
        self.tolerance = TOLERANCE.get(facts.dtype, TOLERANCE["bfloat16"])
        atol, rtol = self.tolerance
        worst: dict[str, float] = {s: 0.0 for s in sites}
        bad: dict[str, float] = {}
        for ids, trace in zip(prompts, run):
            _, mine = self.reads(ids, sites)
            for s in sites:
                theirs = trace.activations(s)
                if theirs.shape != mine[s].shape:
                    raise VlensError(f"the twin's {s} is {tuple(mine[s].shape)} and the "
                                     f"engine's {tuple(theirs.shape)}: different models")
                diff = float((theirs - mine[s]).abs().max())
                worst[s] = max(worst[s], diff)
                if diff > atol + rtol * float(theirs.abs().max()):
                    bad[s] = max(bad.get(s, 0.0), diff)
        self.differences = worst
        if bad:
            said = ", ".join(f"{s} {d:.3g}" for s, d in worst.items())
            raise VlensError(
                f"the Hugging Face twin ({self.path}) does not match the engine: the largest "
                f"difference per site is {said} (allowed: {_allowed(atol, rtol)}, the engine "
                f"runs in {facts.dtype}); it serves no gradients. Is it the same model folder "
                "and weights as the engine's?")
        return worst

    def release(self) -> None:
        """Drop the model (its memory goes back when nothing else holds it),
        once no one is using it."""
        with self.lock:
            self.model = None
            self.layers = []

    def __repr__(self) -> str:
        if self.model is None:
            return f"Twin({self.path!r}, released)"
        worst = max(self.differences.values(), default=float("nan"))
        return (f"Twin({self.architecture} on {self.device}, float32, "
                f"{self.param_bytes / 2**20:.1f} MiB of parameters; checked against the "
                f"engine: largest difference {worst:.2g}, allowed "
                f"{_allowed(*self.tolerance)})")


def _allowed(atol: float, rtol: float) -> str:
    return f"{atol:g} + {rtol:g} x the site's largest value"


def model_folder(session: Any) -> str:
    """Where the session's model's weights are on this machine: its folder,
    or on a connected session the bundled copy of the server's model
    (``RemoteEngine.local_copy``; any other server model's name comes back
    as it is, and whatever reads it says so)."""
    local_copy = getattr(session.engine, "local_copy", None)
    if local_copy is not None:
        try:
            return os.fspath(local_copy())
        except VlensError:
            pass
    return str(session.model)


def _folder(session: Any, path: Any) -> str:
    """The model folder the twin loads: ``path``, or the engine's."""
    where = model_folder(session) if path is None else path
    if not isinstance(where, (str, os.PathLike)) or not os.path.isfile(
            os.path.join(where, "config.json")):
        raise VlensError(
            f"the twin loads the model from a folder on this machine, and {where!r} is not "
            "one (no config.json there). On a connected session, pass the folder with the "
            "server's weights: s.twin(path=...)")
    return os.fspath(where)


def held(session: Any, current: Twin | None, device: Any = None, path: Any = None) -> Twin:
    """The Session's twin: ``current`` when it matches ``device`` and
    ``path`` (None: ``current``'s, else "cpu" and the engine's folder), else
    a new one, checked against the engine; ``current`` is released once the
    new one has passed, and kept when it fails."""
    live = current if current is not None and current.model is not None else None
    if device is None:
        device = live.device if live is not None else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise VlensError(f"device must be a string such as 'cpu' or 'cuda', got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise VlensError(f"device {device!r} is not one torch knows ({exc})") from exc
    folder = live.path if path is None and live is not None else _folder(session, path)
    if live is not None and live.path == folder and live.device == dev:
        return live
    twin = Twin(folder, dev)
    twin.check(session)
    if live is not None:
        live.release()
    return twin
