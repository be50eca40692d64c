"""The engines one benchmark run measures, and the arithmetic floor of the
logit lens.

Per model, up to four engines live in one process (interleaved timing needs
them all at once):

    plain   (a*)  a plain ``vllm.LLM`` at its defaults: compiled, prefix
                  caching on; nothing of vlens in it
    eager         ``vlens.Session(enforce_eager=True)``, prefix caching on;
                  (a) is this engine with vlens's hooks removed in place
    comp          ``vlens.Session(enforce_eager=False)``: vlens compiled
    off           ``vlens.Session(enforce_eager=True, enable_prefix_caching=False)``:
                  the setting earlier benchmarks used, kept as a second table

All of them get the same dtype, KV cache and ``max_model_len``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch


def engine_of(session: Any) -> Any:
    """vlens's Engine behind a Session (``Session.engine``). Every access of
    the benchmark goes through here."""
    return session.engine


class Plain:
    """(a*): plain vLLM as a user runs it, with vlens's process environment
    (in-process engine core, thread settings) so the comparison is about the
    engine, not the environment."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        from vllm import LLM

        from vlens.engine.env import apply_env_defaults

        self.kwargs = dict(kwargs)
        self.env = apply_env_defaults(self.kwargs)
        t0 = time.perf_counter()
        self.llm = LLM(model=path, **self.kwargs)
        self.start_s = round(time.perf_counter() - t0, 1)
        cfg = self.llm.llm_engine.vllm_config
        self.compiled = not cfg.model_config.enforce_eager
        self.block_size = cfg.cache_config.block_size

    def generate(self, prompts: list[Any], params: Any) -> list[Any]:
        return self.llm.generate(prompts, params, use_tqdm=False)

    def close(self) -> None:
        try:
            engine = self.llm.llm_engine
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        except Exception:
            pass
        self.llm = None


def kv_bytes_for(cfg: dict, requests: int, tokens_each: int, dtype: torch.dtype,
                 block: int = 128) -> int:
    """KV-cache bytes that hold ``requests`` sequences of ``tokens_each``
    tokens at once (whole blocks of ``block`` tokens, plus 6 % spare)."""
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * kv * head_dim * torch.empty(0, dtype=dtype).element_size()
    blocks = requests * math.ceil(tokens_each / block)
    return int(blocks * 1.06 + 8) * block * per_token


class LensFloor:
    """The unembedding products the logit lens must do on one run: for every
    layer, the rows of each engine step times the unembedding matrix
    ([rows, hidden] @ [hidden, vocab]), shaped as the engine's steps are (one
    prefill of every prompt token, then one decode step of every request per
    new token). Timed in this process with the engine's dtype and threads;
    the weights' values do not change the arithmetic, so random ones stand in."""

    def __init__(self, cfg: dict, prompt_tokens: int, requests: int, tokens: int,
                 dtype: torch.dtype, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(0)
        h, v = cfg["hidden_size"], cfg["vocab_size"]
        self.layers = cfg["num_hidden_layers"]
        self.w = torch.randn(h, v, generator=gen).to(device=device, dtype=dtype)
        self.prefill = torch.randn(prompt_tokens, h, generator=gen).to(device=device, dtype=dtype)
        self.decode = torch.randn(requests, h, generator=gen).to(device=device, dtype=dtype)
        self.decode_steps = max(0, tokens - 1)
        self.device = device
        self.macs = self.layers * (prompt_tokens + requests * self.decode_steps) * h * v

    def run(self) -> tuple[int, dict]:
        for _ in range(self.layers):
            torch.matmul(self.prefill, self.w)
            for _ in range(self.decode_steps):
                torch.matmul(self.decode, self.w)
        if self.device != "cpu":
            torch.cuda.synchronize()
        return 0, {"macs": self.macs}
