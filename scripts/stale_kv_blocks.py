"""Do stale values in reused KV blocks reach other requests? (issue #28)

Runs the bundled model in this process and measures two things, printing
what it sees (the figures in docs/steering.md come from this script):

1. every KV block filled with NaN, then short prompts (a partly filled
   128-token block each): does the CPU attention read the stale tail?
2. a steering write that overflows part-way (30 relative adds at scale 100),
   then the same short prompts unsteered: equal to their clean runs? With
   ``--unchecked`` vlens's in-step finiteness check is switched off, to see
   what it prevents.

    python scripts/stale_kv_blocks.py [--unchecked]
"""

from __future__ import annotations

import sys

import torch

SHORT = ["the wind", "a happy fox was", "the sky", "one day, a bear"]
SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


def _runner(s):
    return s.engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner


def _same(a, b) -> list[bool]:
    return [x.output_token_ids == y.output_token_ids and torch.equal(x.activations(),
                                                                     y.activations())
            for x, y in zip(a, b)]


def main() -> None:
    import vlens
    import vlens.worker.site_ops as site_ops

    s = vlens.Session(kv_cache_memory_bytes=64 * 2**20)
    plain = lambda: s.trace(SHORT, layers=[0, s.n_layers - 1], max_new_tokens=4)  # noqa: E731
    clean = plain()
    kv = _runner(s).kv_caches
    print(f"{len(kv)} KV tensors of {list(kv[0].shape)}, block size "
          f"{s.engine.info['kv_block_size']}")
    with torch.no_grad():
        for t in kv:
            t.fill_(float("nan"))
    s.engine.llm.reset_prefix_cache()
    poisoned = plain()
    for p, run in zip(SHORT, poisoned):
        print(f"  NaN-filled blocks, {p!r} ({len(run.token_ids)} tokens): NaN reads "
              f"{bool(run.activations().isnan().any())}, tokens {run.output_token_ids}")
    with torch.no_grad():
        for t in kv:
            t.zero_()
    print(f"  blocks zeroed again: equal to the clean runs {_same(plain(), clean)}")

    if "--unchecked" in sys.argv:
        site_ops.keep_finite = lambda flat, rows, before: torch.ones(
            before.shape[0], dtype=torch.bool)
    d = s.direction(["a happy fox"], ["a sad fox"], layer=1)
    wild = [vlens.Steer(d, layer=layer, scale=100.0, relative=True, site=site)
            for layer in range(s.n_layers) for site in SITES]
    try:
        run = s.trace(["the wind was happy and"] * 2, steer=wild, max_new_tokens=8)
        print(f"overflowing steer: no error; NaN reads {bool(run[0].activations().isnan().any())}")
    except vlens.VlensError as exc:
        print(f"overflowing steer: {type(exc).__name__}: {str(exc)[:160]}...")
    print(f"  then the short prompts: equal to their clean runs {_same(plain(), clean)}")
    s.close()


if __name__ == "__main__":
    main()
