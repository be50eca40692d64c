"""Condition (j): Hugging Face transformers ``generate`` on the same weights
and prompts, steered the way vlens's (c) steers: a forward hook on decoder
layer ``layer`` adds ``scale * vector`` to its output (the residual stream
leaving the layer, vlens's ``resid_post``) at every position of every step.
One batch of all prompts, left padding, greedy, exactly ``tokens`` new
tokens each (``min_new_tokens`` keeps EOS from ending a row early).

Load it before any engine that runs vLLM's Transformers backend starts in
this process (that backend patches Hugging Face's model classes); the
native engines the benchmark uses leave them alone.
"""

from __future__ import annotations

from typing import Any

import torch


class HFSteer:
    def __init__(self, path: str, prompt_ids: list[list[int]], vector: torch.Tensor, *,
                 layer: int, scale: float, tokens: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        tok = AutoTokenizer.from_pretrained(path)
        pad = tok.pad_token_id
        if pad is None:
            pad = tok.eos_token_id if tok.eos_token_id is not None else 0
        self.pad = int(pad)
        self.tokens = tokens
        self.device = device
        self.inputs = self._batch(prompt_ids)
        self.delta = (vector.float() * scale).to(device=device, dtype=dtype)
        self.handle = self.model.model.layers[layer].register_forward_hook(self._steer)
        self.threads = torch.get_num_threads()

    def _batch(self, prompt_ids: list[list[int]]) -> dict[str, torch.Tensor]:
        width = max(len(p) for p in prompt_ids)
        ids = [[self.pad] * (width - len(p)) + list(p) for p in prompt_ids]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids]
        return {
            "input_ids": torch.tensor(ids, device=self.device),
            "attention_mask": torch.tensor(mask, device=self.device),
        }

    def _steer(self, module: Any, args: Any, output: Any) -> Any:
        # transformers 5 decoder layers return the hidden states; older ones a tuple
        if isinstance(output, tuple):
            return (output[0] + self.delta,) + tuple(output[1:])
        return output + self.delta

    def run(self, warmup: bool = False) -> tuple[int, dict]:
        inputs = self.inputs
        n = self.tokens
        if warmup:
            inputs = {k: v[:4] for k, v in inputs.items()}
            n = 4
        width = inputs["input_ids"].shape[1]
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=self.pad)
        if self.device != "cpu":
            torch.cuda.synchronize()
        new = out[:, width:]
        return int(new.numel()), {"token_ids": new.tolist()}

    def close(self) -> None:
        self.handle.remove()
        del self.model
