"""Clamps in the step, with plain tensors: the plan's wire form, the batched
add whose delta depends on each row (``(v - f_i(x)) * W_dec[i]``), equal to
a row-by-row loop, and rows of other requests untouched."""

from __future__ import annotations

import torch

from vlens.protocol.features import FeatureSpec, encode
from vlens.protocol.plan import Add, Plan, Read, parse_plan
from vlens.protocol.tensors import encode_tensor
from vlens.worker.features import FeatureStore
from vlens.worker.planner import plan_step
from vlens.worker.site_ops import apply_adds, reduce_rows
from vlens.worker.vectors import VectorStore


def _sae(width: int, d_sae: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = {"W_enc": torch.randn(width, d_sae, generator=g), "b_enc": torch.randn(d_sae, generator=g),
         "b_dec": torch.randn(width, generator=g) * 0.1,
         "W_dec": torch.randn(d_sae, width, generator=g)}
    return w


def test_feature_reads_and_clamps_round_trip_through_the_wire_form():
    plan = Plan(tag="t", reads=(Read("resid_post", (1,), "sae_top", 8, sae="sae-1"),),
                adds=(Add("resid_post", 1, "v1", 3.0, 2, 9, sae="sae-1", feature=4),
                      Add("resid_post", 1, "v2", 1.0)))
    back = parse_plan(plan.to_wire())
    assert back.reads == plan.reads and back.adds == plan.adds
    assert back.reads[0].key == "resid_post:sae_top:sae-1"
    assert "sae" not in plan.to_wire()["adds"][1]  # a plain steer's wire form is unchanged


def test_batched_clamps_equal_a_row_by_row_loop():
    width, d_sae = 8, 12
    w = _sae(width, d_sae, 0)
    spec = FeatureSpec("standard")
    features = FeatureStore()
    features.put({"sae-a": {"spec": spec.to_wire(),
                            **{k: encode_tensor(w[k]) for k in ("W_enc", "b_enc", "b_dec")}}})
    store = VectorStore(width)
    for i in (2, 5):
        store.put(f"dec{i}", w["W_dec"][i])
    store.put("plain", torch.ones(width))
    plans = [
        Plan(tag="a", adds=(Add("resid_post", 1, "dec2", 1.5, 3, 7, sae="sae-a", feature=2),)),
        None,  # untraced traffic
        Plan(tag="c", adds=(Add("resid_post", 1, "dec5", 0.0, 0, -1, sae="sae-a", feature=5),
                            Add("resid_post", 1, "plain", 2.0))),
        Plan(tag="d"),
    ]
    lengths, computed = [6, 3, 4, 2], [2, 0, 0, 0]
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    step = plan_step([f"r{i}" for i in range(4)], plans, qsl, computed, vector_rows=store.rows)
    batch = step.adds[("resid_post", 1)]
    assert batch.uniform is None and [c[0] for c in batch.clamps] == ["sae-a"]
    T = qsl[-1]
    x = torch.randn(T, width)
    before = x.clone()
    apply_adds(store.matrix, batch, step.layout, lambda: x, lambda: x, "resid_post[1]", features)
    expect = before.clone()
    acts = encode(before, w, spec)
    for pos in range(3, 7):  # request a: positions 2..7, clamped on 3..6 -> rows 1..4
        r = pos - 2
        expect[r] += (1.5 - acts[r, 2]) * w["W_dec"][2]
    for r in range(9, 13):  # request c: every row, feature 5 set to 0, plus the plain steer
        expect[r] += (0.0 - acts[r, 5]) * w["W_dec"][5] + 2.0
    torch.testing.assert_close(x, expect, atol=1e-5, rtol=1e-5)
    untouched = [0, 5, 6, 7, 8, 13, 14]
    assert torch.equal(x[untouched], before[untouched])
    # after the clamp, feature 2 of a clamped row is what its encoder reads of the new row
    top = reduce_rows(None, x[1:5], Read("resid_post", (1,), "sae_top", 3, sae="sae-a"), features)
    assert top["ids"].shape == (4, 3) and top["values"].shape == (4, 3)


def test_the_worker_encodes_on_the_engines_packed_kernel():
    """On a CPU the worker packs each encoder for vLLM's oneDNN kernel (what
    the model's own linear layers run on); it must equal ``torch.addmm``
    for every batch size a step brings, none included."""
    import pytest
    from vllm import _custom_ops as ops

    from vlens.worker.gemm import packed_matmul

    if not getattr(ops, "_supports_onednn", False):
        pytest.skip("this vLLM build has no oneDNN kernel (a GPU build): "
                    "the encoder stays on torch.addmm")
    width, d_sae = 48, 300
    w = _sae(width, d_sae, 1)
    matmul = packed_matmul(w["W_enc"])
    assert matmul is not None, "vLLM's oneDNN kernel is there but the encoder was not packed"
    assert packed_matmul(w["W_enc"].double()) is None  # float32 only: the rest stay on addmm
    g = torch.Generator().manual_seed(2)
    for n in (0, 1, 7, 33):
        x = torch.randn(n, width, generator=g)
        torch.testing.assert_close(matmul(x, w["b_enc"]), torch.addmm(w["b_enc"], x, w["W_enc"]),
                                   atol=1e-4, rtol=1e-5)
    x = torch.randn(64, width, generator=g)[::2]  # a strided view, as a gather may give
    payload = {"spec": FeatureSpec("jumprelu").to_wire(), "threshold": encode_tensor(
        torch.full((d_sae,), 0.3)), **{k: encode_tensor(w[k]) for k in ("W_enc", "b_enc", "b_dec")}}
    packed, plain = FeatureStore(pack=packed_matmul), FeatureStore()
    packed.put({"s": payload})
    plain.put({"s": payload})
    assert "s" in packed._matmul and packed._matmul["s"] is not None
    assert packed.nbytes == plain.nbytes + w["W_enc"].nbytes  # the packed copy counts
    torch.testing.assert_close(packed.activations(x, "s"), plain.activations(x, "s"),
                               atol=1e-4, rtol=1e-5)
    packed.drop(["s"])
    assert "s" not in packed._matmul


def _dense(ids: torch.Tensor, values: torch.Tensor, d_sae: int) -> torch.Tensor:
    return torch.zeros(ids.shape[0], d_sae).scatter_(-1, ids.long(), values)


def test_a_cpu_worker_encodes_a_few_rows_later_with_other_steps_rows():
    """Reads of fewer than DEFER_ROWS rows wait and are encoded in one
    product: each read's values are its own rows' (as encoding them alone),
    DEFER_ROWS waiting rows are encoded in the step, dropping the SAE keeps
    its reads' values, and a failed product is an error naming the cause."""
    import pytest

    from vlens.protocol.features import top_features
    from vlens.worker.features import DEFER_ROWS, LazyPart
    from vlens.worker.steplog import StepLog

    width, d_sae, k = 16, 40, 4
    w = _sae(width, d_sae, 3)
    spec = FeatureSpec("standard")
    payload = {"spec": spec.to_wire(), **{n: encode_tensor(w[n]) for n in ("W_enc", "b_enc", "b_dec")}}
    store = FeatureStore()
    store.put({"s": payload})
    g = torch.Generator().manual_seed(4)
    steps = [torch.randn(n, width, generator=g) for n in (3, 1, 5)]
    parts = [store.reduce(x, "s", k) for x in steps]
    dense = store.reduce(steps[0], "s", 0)  # a full read waits too, beside the top-k ones
    for p, x in zip(parts, steps):
        assert isinstance(p["ids"], LazyPart) and p["ids"].shape == (x.shape[0], k)
        assert p["values"].dtype == torch.float32 and p["ids"].dtype == torch.int32
    waiting = store._waiting[("s", k)]
    assert waiting.rows == 9 and all(p["ids"].read.rows is not None for p in parts)
    parts[1]["values"].tensor()  # the first asked for encodes all three in one product
    assert waiting.rows == 0 and all(p["ids"].read.rows is None for p in parts)
    for p, x in zip(parts, steps):
        alone = encode(x, w, spec)
        ids, values = p["ids"].tensor(), p["values"].tensor()
        assert ids.shape == (x.shape[0], k)
        torch.testing.assert_close(_dense(ids, values, d_sae),
                                   _dense(*top_features(alone, k), d_sae), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense["value"].tensor(), encode(steps[0], w, spec),
                               atol=1e-5, rtol=1e-5)

    # a step's log is cut per request with the deferred parts in place
    class _Span:
        def __init__(self, key, start, stop):
            self.key, self.start, self.stop = key, start, stop

    class _Group:
        spans = [_Span("a", 0, 2), _Span("b", 2, 5)]

    rows = torch.randn(5, width, generator=g)
    log = StepLog()
    for name, t in store.reduce(rows, "s", k).items():
        log.put(("f", name, 1), t, _Group())
    m, got, nbytes = log.of("b")
    ids, values = top_features(encode(rows, w, spec), k)
    assert m == 3 and nbytes == 3 * k * 8
    torch.testing.assert_close(_dense(got[("f", "ids", 1)], got[("f", "values", 1)], d_sae),
                               _dense(ids[2:], values[2:], d_sae), atol=1e-5, rtol=1e-5)

    # DEFER_ROWS waiting: encoded in the step that brings them
    first = store.reduce(torch.randn(DEFER_ROWS - 2, width, generator=g), "s", k)
    last = store.reduce(torch.randn(3, width, generator=g), "s", k)
    assert waiting.rows == 0 and first["ids"].read.parts and last["ids"].read.parts
    now = store.reduce(torch.randn(DEFER_ROWS, width, generator=g), "s", k)
    assert isinstance(now["ids"], torch.Tensor)  # enough rows to encode at once
    with pytest.raises(ValueError, match="encodes width 16, the site's rows are 8 wide"):
        store.reduce(torch.randn(2, 8), "s", k)  # checked in the step, not later

    # a failed product: each of its reads raises when its rows are asked for
    bad = store.reduce(steps[0], "s", k)

    def broken(x):
        raise MemoryError("no room")

    store._waiting[("s", k)].encode_rows = broken
    with pytest.raises(RuntimeError, match="after their steps failed: MemoryError: no room"):
        bad["ids"].tensor()
    with pytest.raises(RuntimeError, match="no room"):
        bad["values"].tensor()

    # dropping the SAE encodes what waits for it first
    kept = store.reduce(steps[2], "s", k)
    store._waiting[("s", k)].encode_rows = lambda x: store._reduce_now(x, "s", k)
    store.drop(["s"])
    assert not store._waiting and "s" not in store
    torch.testing.assert_close(_dense(kept["ids"].tensor(), kept["values"].tensor(), d_sae),
                               _dense(*top_features(encode(steps[2], w, spec), k), d_sae),
                               atol=1e-5, rtol=1e-5)
