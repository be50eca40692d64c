"""What the conditions run on besides vlens Sessions: the models, the prompts,
plain vLLM at its defaults, the logit lens's arithmetic floor, a random SAE, and
Hugging Face ``generate`` with the one steering hook (vlens.testing)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from vlens.testing import hf_steering_hook

HERE = Path(__file__).resolve().parent
MODELS_DIR = HERE / ".models"
SHAPES = {  # random-weight models made on first use (vlens.tiny)
    "llama-h512-l8": {"arch": "llama", "hidden": 512, "layers": 8, "heads": 8,
                      "intermediate": 1376, "vocab": 4096},
    "toyworld-standin": {"arch": "llama", "hidden": 384, "layers": 6, "heads": 12,
                         "intermediate": 768, "vocab": 133},
    "qwen2-0.5b": {"arch": "qwen2", "hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2,
                   "intermediate": 4864, "vocab": 151936},
}
D_SAE, TOP_K = 4096, 32


def make_model(name: str) -> Path:
    from vlens.tiny import make_tiny_model

    shape = dict(SHAPES[name])
    return make_tiny_model(MODELS_DIR / name, shape.pop("arch"), **shape)


def bundled() -> tuple[str, dict]:
    """The bundled toy-world model, or a random stand-in of its shape: (path, how to name it)."""
    try:
        from vlens.models import toyworld_path

        return str(toyworld_path()), {"name": "bundled toy-world"}
    except FileNotFoundError:
        return str(make_model("toyworld-standin")), {
            "name": "toy-world shape (stand-in)",
            "note": "the bundled toy-world model was not in this checkout; a random-weight "
                    "model of its shape (hidden 384, 6 layers, 12 heads, MLP 768) stood in"}


def model_config(path: Path) -> dict:
    cfg = json.loads((Path(path) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    out = {k: text.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "intermediate_size", "vocab_size")}
    out["architectures"] = cfg.get("architectures")
    out["dtype"] = text.get("dtype") or text.get("torch_dtype")
    from safetensors import safe_open

    out["parameters"] = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            out["parameters"] += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return out


def make_prompts(tokenizer: Any, n: int) -> list[str]:
    """``n`` prompts of 7 to 33 words cycling through ordinary vocabulary entries."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    words = []
    for i in range(8, min(len(tokenizer), 400)):
        w = str(tokenizer.convert_ids_to_tokens(i)).replace("Ġ", "").replace("▁", "").strip()
        if i not in special and w and w.isprintable() and " " not in w:
            words.append(w)
        if len(words) >= 96:
            break
    return [" ".join(words[((i * 13) % len(words) + j) % len(words)]
                     for j in range(7 + (i * 5) % 27)) for i in range(n)]


def long_prompts(tokenizer: Any, prompts: list[str], block: int = 128) -> tuple[list, list]:
    """One shared preamble filling at least one whole KV block, then each prompt."""
    words, preamble, i = make_prompts(tokenizer, 40), "", 0
    while len(tokenizer(preamble)["input_ids"]) < block + 2:
        preamble = (preamble + " " + words[i % len(words)]).strip()
        i += 1
    texts = [preamble + " " + p for p in prompts]
    return texts, [list(tokenizer(x)["input_ids"]) for x in texts]


def unit_vectors(n: int, hidden: int, seed: int = 0) -> torch.Tensor:
    v = torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))
    return v / v.norm(dim=-1, keepdim=True)


class Plain:
    """A plain ``vllm.LLM`` at its defaults, with vlens's process environment
    (so the comparison is about the engine, not the environment)."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        from vllm import LLM

        from vlens.engine.env import apply_env_defaults

        self.kwargs = dict(kwargs)
        self.env = apply_env_defaults(self.kwargs)
        t0 = time.perf_counter()
        self.llm = LLM(model=path, **self.kwargs)
        self.start_s = round(time.perf_counter() - t0, 1)
        self.compiled = not self.llm.llm_engine.vllm_config.model_config.enforce_eager

    def generate(self, prompts: list, params: Any) -> list:
        return self.llm.generate(prompts, params, use_tqdm=False)

    def close(self) -> None:
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None


def kv_bytes_for(cfg: dict, requests: int, tokens_each: int, dtype: torch.dtype,
                 block: int = 128) -> int:
    """KV-cache bytes for ``requests`` sequences of ``tokens_each`` tokens (+6 %)."""
    heads = cfg["num_attention_heads"]
    kv, head_dim = cfg.get("num_key_value_heads") or heads, cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * kv * head_dim * torch.empty(0, dtype=dtype).element_size()
    return int(requests * math.ceil(tokens_each / block) * 1.06 + 8) * block * per_token


class LensFloor:
    """The unembedding products the logit lens must do on one run, shaped as
    the engine's steps (one prefill of every prompt token, then one decode
    step per new token), at every layer; random weights stand in."""

    def __init__(self, cfg: dict, prompt_tokens: int, requests: int, tokens: int,
                 dtype: torch.dtype, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(0)
        h, v = cfg["hidden_size"], cfg["vocab_size"]
        self.layers, self.device, self.steps = cfg["num_hidden_layers"], device, max(0, tokens - 1)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        self.w, self.prefill, self.decode = rand(h, v), rand(prompt_tokens, h), rand(requests, h)
        self.macs = self.layers * (prompt_tokens + requests * self.steps) * h * v

    def run(self, warmup: bool = False) -> tuple[int, dict]:
        for _ in range(self.layers):
            torch.matmul(self.prefill, self.w)
            for _ in range(self.steps):
                torch.matmul(self.decode, self.w)
        if self.device != "cpu":
            torch.cuda.synchronize()
        return 0, {"macs": self.macs}



class HFGenerate:
    """HF ``generate`` with the one steering hook on decoder layer ``layer`` (``change`` on its
    output, vlens's ``resid_post``, at every step); one left-padded batch, greedy, exactly
    ``tokens`` new tokens. Made before any engine (vLLM's Transformers backend patches HF)."""

    def __init__(self, path: str, prompt_ids: list[list[int]], change, *, layer: int, tokens: int,
                 device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        tok = AutoTokenizer.from_pretrained(path)
        self.pad = int((tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id) or 0)
        self.tokens, self.device, self.change = tokens, device, change
        w = max(len(p) for p in prompt_ids)
        self.inputs = {"input_ids": [[self.pad] * (w - len(p)) + list(p) for p in prompt_ids],
                       "attention_mask": [[0] * (w - len(p)) + [1] * len(p) for p in prompt_ids]}
        self.inputs = {k: torch.tensor(v, device=device) for k, v in self.inputs.items()}
        self.handle = hf_steering_hook(self.model.model.layers[layer], change)

    def run(self, warmup: bool = False) -> tuple[int, dict]:
        inputs, n = self.inputs, self.tokens
        if warmup:
            inputs, n = {k: v[:4] for k, v in inputs.items()}, 4
        self.change.rows = 0  # rows the change saw (the SAE's encoded rows)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      pad_token_id=self.pad)
        if self.device != "cpu":
            torch.cuda.synchronize()
        new = out[:, inputs["input_ids"].shape[1]:]
        extra = {"encoded_rows": self.change.rows} if isinstance(self.change, SaeEncode) else {}
        return int(new.numel()), {"token_ids": new.tolist(), **extra}

    def close(self) -> None:
        self.handle.remove()
        del self.model


def make_sae(folder: Path, hidden: int, layer: int, seed: int = 0) -> Path:
    """A random standard SAE of ``D_SAE`` features on ``resid_post`` of ``layer``, saved
    as SAELens saves one; ``b_enc`` negative so that a fraction of the features fire."""
    from safetensors.torch import save_file

    if not (folder / "cfg.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        w_dec = torch.randn(D_SAE, hidden, generator=torch.Generator().manual_seed(seed))
        w_dec /= w_dec.norm(dim=-1, keepdim=True)
        save_file({"W_enc": w_dec.t().contiguous(), "W_dec": w_dec, "b_enc": torch.full((D_SAE,), -0.5),
                   "b_dec": torch.zeros(hidden)}, str(folder / "sae_weights.safetensors"))
        (folder / "cfg.json").write_text(json.dumps({
            "architecture": "standard", "d_in": hidden, "d_sae": D_SAE, "dtype": "float32", "device": "cpu",
            "apply_b_dec_to_input": True, "normalize_activations": "none",
            "metadata": {"hook_name": f"blocks.{layer}.hook_resid_post", "model_name": "benchmark",
                         "made_by": "benchmarks/tools.py"}}, indent=1))
    return folder


class SaeEncode:
    """The SAELens way without vlens, as the hook's change: encode every row with
    SAELens's standard ``encode`` (``relu((x - b_dec) @ W_enc + b_enc)``), keep each
    token's top 32 features, and leave the rows as they were."""

    def __init__(self, sae_path: Path, device: str) -> None:
        from safetensors.torch import load_file

        w = load_file(str(Path(sae_path) / "sae_weights.safetensors"))
        self.w = {k: w[k].to(device=device, dtype=torch.float32) for k in ("W_enc", "b_enc", "b_dec")}
        self.rows = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        self.kept = torch.relu((rows - self.w["b_dec"]) @ self.w["W_enc"] + self.w["b_enc"]).topk(TOP_K)
        self.rows += rows.shape[0]
        return x
