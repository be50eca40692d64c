"""The SAE conditions' pieces: a random 4096-wide SAE made on the spot in
SAELens's format, and (sae_hf) the same encoding done the SAELens way.

(sae) and (sae*) read each token's top 32 features of that SAE in vlens's
worker, eager and compiled (``s.trace(saes=[sae], features_top_k=32)``).
(sae_hf) is how one encodes with SAELens without vlens: a Hugging Face
forward (``generate``, as (j)) with a hook on the SAE's layer that encodes
the rows with the SAE and keeps each token's 32 largest features, every
step. SAELens itself is not installed in the benchmark's environment (it
pins its own torch), so the encode is SAELens's standard-architecture
``encode`` written out in torch: ``relu((x - b_dec) @ W_enc + b_enc)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from hf_steer import HFSteer

D_SAE, TOP_K = 4096, 32


def make_sae(folder: Path, hidden: int, layer: int, seed: int = 0) -> Path:
    """A random standard SAE of ``D_SAE`` features on ``resid_post`` of
    ``layer``, saved as SAELens saves one (cfg.json + sae_weights.safetensors).
    Its values do not change the arithmetic; ``b_enc`` is negative so that a
    fraction of the features fire, as in a trained one."""
    from safetensors.torch import save_file

    if (folder / "cfg.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    w_dec = torch.randn(D_SAE, hidden, generator=g)
    w_dec /= w_dec.norm(dim=-1, keepdim=True)
    save_file({"W_enc": w_dec.t().contiguous(), "W_dec": w_dec,
               "b_enc": torch.full((D_SAE,), -0.5), "b_dec": torch.zeros(hidden)},
              str(folder / "sae_weights.safetensors"))
    cfg = {"architecture": "standard", "d_in": hidden, "d_sae": D_SAE, "dtype": "float32",
           "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
           "metadata": {"hook_name": f"blocks.{layer}.hook_resid_post",
                        "model_name": "benchmark", "made_by": "benchmarks/hf_sae.py"}}
    (folder / "cfg.json").write_text(json.dumps(cfg, indent=1))
    return folder


class HFSae(HFSteer):
    """(sae_hf): ``generate`` with a hook on decoder layer ``layer`` (its
    output is ``resid_post``) that encodes every new row with the SAE and
    keeps each token's ``TOP_K`` largest features (ids and values)."""

    def __init__(self, path: str, prompt_ids: list[list[int]], sae_path: Path, *, layer: int,
                 tokens: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        from safetensors.torch import load_file

        # the steering vector is unused: this hook encodes instead of adding
        super().__init__(path, prompt_ids, torch.zeros(1), layer=layer, scale=0.0,
                         tokens=tokens, device=device, dtype=dtype)
        w = load_file(str(Path(sae_path) / "sae_weights.safetensors"))
        self.w = {k: w[k].to(device=device, dtype=torch.float32) for k in ("W_enc", "b_enc", "b_dec")}
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """SAELens's standard ``encode`` (``apply_b_dec_to_input``, no normalisation)."""
        return torch.relu((x.float() - self.w["b_dec"]) @ self.w["W_enc"] + self.w["b_enc"])

    def _steer(self, module: Any, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        acts = self.encode(hidden.reshape(-1, hidden.shape[-1]))
        top = acts.topk(TOP_K, dim=-1)
        self.kept.append((top.indices, top.values))
        return output

    def run(self, warmup: bool = False) -> tuple[int, dict]:
        self.kept = []
        tokens, extra = super().run(warmup=warmup)
        extra["encoded_rows"] = sum(int(i.shape[0]) for i, _ in self.kept)
        self.kept = []
        return tokens, extra
