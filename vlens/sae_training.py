"""Train a TopK sparse autoencoder on a harvest, with SAELens's trainer.

``vlens.train_sae(harvest, layer=15, width=4096, k=32, out=folder)`` (and
``vlens train-sae HARVEST --layer L --width W --k K --out DIR``) feeds the
rows of one (site, layer) of a :class:`~vlens.Harvest` to SAELens's
``SAETrainer`` as its data provider (an iterator of ``[batch, d_in]``
batches) and saves the result with SAELens's ``save_inference_model``: a
folder ``s.sae(folder)`` loads (cfg.json + sae_weights.safetensors). The
training loop, the optimiser, the auxiliary loss that revives dead latents
and the folding of the activation scale into the weights are SAELens's;
this module only reads shards and writes what it was asked.

Why SAELens (docs/features.md): ``sae-lens`` installs beside vLLM's pinned
torch and transformers (``pip install --dry-run`` changes neither), saves
the format vlens already reads and checks against, and its trainer takes
any iterator of activations. The PyPI package named ``sparsify`` is not
EleutherAI's.

Rows are read a few shards at a time (memory holds ``buffer_shards``
shards), shuffled within that buffer, every pass in a new order; each
text's first token is left out by default: it is the attention sink, with
a norm far above the others' on many models (2.3e4 against about 170 at
SmolLM2-135M's layer 15), which an SAE should not spend features on.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vlens._progress import Progress
from vlens.errors import VlensError
from vlens.models import registry
from vlens.results.harvest import Harvest

__all__ = ["train_sae", "training_rows"]

#: vlens sites -> the TransformerLens hook the SAE's cfg.json names
HOOK_NAMES = {"resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid",
              "resid_post": "hook_resid_post", "attn_out": "hook_attn_out",
              "mlp_out": "hook_mlp_out", "z": "attn.hook_z"}


def _rows_of_shard(h: Harvest, shard: dict[str, Any], name: str,
                   drop_first_token: bool) -> torch.Tensor:
    rows = h.shard_tensor(shard, name)
    if not drop_first_token:
        return rows
    keep = torch.ones(rows.shape[0], dtype=torch.bool)
    base = shard["tokens"][0]
    for start, _ in h.spans[shard["texts"][0]:shard["texts"][1]]:
        keep[start - base] = False
    return rows[keep]


def training_rows(h: Harvest, site: str, layer: int, batch_size: int, *, seed: int = 0,
                  buffer_shards: int = 4, drop_first_token: bool = True
                  ) -> Iterator[torch.Tensor]:
    """Endless ``[batch_size, width]`` float32 batches of ``h``'s rows of
    ``site`` at ``layer``: each pass visits the shards in a new order,
    ``buffer_shards`` at a time, rows shuffled within the buffer (a batch
    may straddle two buffers)."""
    name = h.tensor_of(site, layer)
    shards = h.shards
    if not shards:
        raise VlensError(f"{h.folder} holds no finished shard yet: harvest first")
    g = torch.Generator().manual_seed(seed)
    carry = torch.zeros(0, h.widths[site])
    while True:
        order = torch.randperm(len(shards), generator=g).tolist()
        for i in range(0, len(order), buffer_shards):
            part = [_rows_of_shard(h, shards[j], name, drop_first_token)
                    for j in order[i:i + buffer_shards]]
            buf = torch.cat([carry, *part])
            buf = buf[torch.randperm(buf.shape[0], generator=g)]
            n = buf.shape[0] // batch_size * batch_size
            for b in range(0, n, batch_size):
                yield buf[b:b + batch_size]
            carry = buf[n:]


def train_sae(harvest: Harvest | str | os.PathLike, *, layer: int | None = None, width: int,
              k: int, out: str | os.PathLike, site: str = "resid_post",
              tokens: int | None = None, batch_size: int = 4096, lr: float = 1e-3,
              seed: int = 0, drop_first_token: bool = True, dtype: str = "float32",
              aux_loss_coefficient: float = 1.0 / 32, dead_window: int | None = None,
              progress: Any = None) -> Path:
    """Train a TopK SAE (``width`` features, ``k`` active per token) on the
    harvest's rows of ``site`` at ``layer`` with SAELens's ``SAETrainer``,
    and save it to ``out`` in SAELens's format (``s.sae(out)`` loads it).

    * ``tokens``: training samples in all (default: one pass over the
      harvest); ``batch_size`` rows a step, Adam at ``lr`` (constant, then
      SAELens's linear decay over the last fifth), activations scaled to
      norm ``sqrt(d_in)`` while training (folded into the saved weights);
    * ``dead_window``: steps a latent may go without firing before the
      auxiliary loss (weight ``aux_loss_coefficient``) trains it on the
      residual (default: a tenth of the steps, at least 10);
    * ``dtype``: of the saved weights (``"bfloat16"`` halves the file);
    * ``drop_first_token``: leave out each text's first row (see the module);
    * ``progress``: True for a bar of the steps, or ``fn(done, total)``
      (SAELens's own bar moves every 100 steps).

    Writes ``training.json`` beside the SAE: these settings, the harvest,
    the time taken and SAELens's last-window L0 and dead count. Returns the
    folder."""
    try:
        with warnings.catch_warnings():  # SAELens imports TransformerLens's deprecated utils
            warnings.simplefilter("ignore", DeprecationWarning)
            from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
            from sae_lens.config import SAETrainerConfig
            from sae_lens.saes.sae import SAEMetadata
            from sae_lens.training.sae_trainer import SAETrainer
    except ImportError as exc:
        raise VlensError(f"training an SAE needs SAELens ({exc}): pip install "
                         "'vlens[train]' (or sae-lens>=6.54,<7)") from None

    h = harvest if isinstance(harvest, Harvest) else Harvest.open(harvest)
    if layer is None and len(h.layers) == 1:
        layer = h.layers[0]
    rows = _check(h, site, layer, width, k, batch_size, dtype, drop_first_token)
    tokens = rows if tokens is None else int(tokens)
    if tokens < batch_size:
        raise VlensError(f"tokens ({tokens}) must be at least one batch ({batch_size})")
    steps = tokens // batch_size
    dead_window = max(10, steps // 10) if dead_window is None else int(dead_window)
    d_in = h.widths[site]
    hook = f"blocks.{layer}.{HOOK_NAMES[site]}"

    torch.manual_seed(seed)
    cfg = TopKTrainingSAEConfig(
        d_in=d_in, d_sae=width, k=k, dtype="float32", device="cpu",
        apply_b_dec_to_input=True, normalize_activations="expected_average_only_in",
        aux_loss_coefficient=aux_loss_coefficient,
        metadata=SAEMetadata(model_name=_model_name(h.model), hook_name=hook))
    sae = TopKTrainingSAE(cfg)
    trainer_cfg = SAETrainerConfig(
        total_training_samples=steps * batch_size, train_batch_size_samples=batch_size,
        lr=lr, lr_decay_steps=steps // 5, lr_end=lr / 10, device="cpu",
        dead_feature_window=dead_window, feature_sampling_window=max(dead_window, steps // 4))
    provider = training_rows(h, site, layer, batch_size, seed=seed,
                             drop_first_token=drop_first_token)
    bar = _bar(progress, steps)
    if bar is not None:
        provider = _ticking(provider, bar)
    t0 = time.perf_counter()
    trainer = SAETrainer(cfg=trainer_cfg, sae=sae, data_provider=provider)
    _start_at_mean(trainer, sae, h, site, layer, batch_size, seed, drop_first_token)
    try:
        trained = trainer.fit()
        if bar is not None:
            bar.update(bar.total - bar.n)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0

    out = Path(out)
    trained.save_inference_model(out)
    _finish(out, dtype)
    meta = trained.cfg.metadata
    (out / "training.json").write_text(json.dumps({
        "trainer": "sae_lens.SAETrainer (TopKTrainingSAE)",
        "harvest": str(h.folder), "model": _model_name(h.model), "site": site, "layer": layer,
        "harvest_tokens": len(h), "training_rows": rows, "tokens": steps * batch_size,
        "steps": steps, "batch_size": batch_size, "width": width, "k": k, "lr": lr,
        "aux_loss_coefficient": aux_loss_coefficient, "dead_window": dead_window,
        "seed": seed, "drop_first_token": drop_first_token, "dtype": dtype,
        "seconds": round(seconds, 1), "last_window_l0": meta.l0,
        "last_window_dead": meta.num_dead_features,
    }, indent=1) + "\n")
    return out


def _check(h: Harvest, site: str, layer: Any, width: Any, k: Any, batch_size: Any,
           dtype: Any, drop_first_token: bool) -> int:
    """``train_sae``'s arguments against the harvest; the rows it can train on."""
    h.tensor_of(site, layer)
    if site not in HOOK_NAMES:
        raise VlensError(f"an SAE reads one of {', '.join(HOOK_NAMES)}, not {site!r}")
    for key, value in (("width", width), ("k", k), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise VlensError(f"{key} must be a positive int, got {value!r}")
    if k > width:
        raise VlensError(f"k ({k}) cannot exceed width ({width})")
    if dtype not in ("float32", "bfloat16"):
        raise VlensError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    return len(h) - (h.texts_done if drop_first_token else 0)


def _bar(progress: Any, steps: int) -> Progress | None:
    """``progress=`` as a bar (or callback) over ``steps``; None: none."""
    if progress is None or progress is False:
        return None
    if progress is not True and not callable(progress):
        raise VlensError(f"progress must be True, False/None, or a function fn(done, "
                         f"total); got {progress!r}")
    return Progress(steps, callback=None if progress is True else progress,
                    bar=progress is True, desc="train-sae")


def _ticking(batches: Iterator[torch.Tensor], bar: Progress) -> Iterator[torch.Tensor]:
    """``batches``, counting a step done each time the trainer asks for the
    next batch (the last one is counted when ``fit`` returns)."""
    for i, batch in enumerate(batches):
        if i:
            bar.update(1)
        yield batch


def _start_at_mean(trainer: Any, sae: Any, h: Harvest, site: str, layer: int,
                   batch_size: int, seed: int, drop_first_token: bool) -> None:
    """Set SAELens's activation scale (``sqrt(d_in) / mean |x|``, its own
    estimate) and start ``b_dec`` at the rows' mean, both from up to 50
    batches: a residual stream's mean is most of its norm (126 of 170 at
    SmolLM2's layer 15), and from SAELens's zero ``b_dec`` a run of a few
    hundred steps spends most of itself learning it."""
    n = max(1, min(50, (len(h) - h.texts_done) // batch_size))
    rows = training_rows(h, site, layer, batch_size, seed=seed + 1,
                         drop_first_token=drop_first_token)
    total, norms, count = 0.0, 0.0, 0
    for _ in range(n):
        x = next(rows)
        total = total + x.sum(0)
        norms += float(x.norm(dim=-1).sum())
        count += x.shape[0]
    scale = h.widths[site] ** 0.5 / (norms / count)
    trainer.activation_scaler.scaling_factor = scale
    with torch.no_grad():
        sae.b_dec.copy_(total / count * scale)


def _model_name(model: str) -> str:
    """A registry model's name for its fetched folder; else the path as it was."""
    name = Path(model).name
    entry = registry.REGISTRY.get(name)
    if isinstance(entry, registry.Entry) and registry.folder(name) == Path(model):
        return name
    return model


def _finish(out: Path, dtype: str) -> None:
    """SAELens's inference cfg keeps the training cfg's
    ``rescale_acts_by_decoder_norm`` though ``save_inference_model`` has
    folded the decoder norms into the weights: record that they are folded
    (what the weights now encode), and store the weights in ``dtype``."""
    from safetensors.torch import load_file, save_file

    cfg_path = out / "cfg.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rescale_acts_by_decoder_norm"] = False
    cfg["dtype"] = dtype
    cfg_path.write_text(json.dumps(cfg))
    if dtype != "float32":
        weights = load_file(str(out / "sae_weights.safetensors"))
        save_file({n: t.to(getattr(torch, dtype)).contiguous() for n, t in weights.items()},
                  str(out / "sae_weights.safetensors"))
    for path in (cfg_path, out / "sae_weights.safetensors"):
        path.chmod(0o644)  # safetensors writes its files private
