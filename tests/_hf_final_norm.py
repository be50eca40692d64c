"""Hugging Face's logits of given residual rows through a model's own final
norm, output head and final softcapping (tests/test_final_norm.py).

Run as a script in a fresh process (``python tests/_hf_final_norm.py in.pt
out.pt``; ``in.pt`` maps model folders to ``[..., hidden]`` rows): vLLM
patches Hugging Face classes in processes where it has run.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM


def logits(path: str, resid: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.get_output_embeddings()(model.model.norm(resid.float()))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(out / cap) * cap if cap else out


def main() -> None:
    jobs = torch.load(sys.argv[1])
    torch.save({path: logits(path, resid) for path, resid in jobs.items()}, sys.argv[2])


if __name__ == "__main__":
    main()
