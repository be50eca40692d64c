"""Sets (ablations, patched cells) in the step planner and the worker's
batched write, with plain tensors: each request's rows in its span get the
masked dims replaced, everyone else's rows stay bit-identical, and a value
that is a sum (native resid_post: hidden + residual) comes out right."""

from __future__ import annotations

import pytest
import torch

from vlens.worker.site_ops import apply_sets
from vlens.worker.vectors import VectorStore
from vlens.protocol.plan import Plan, Set, parse_plan
from vlens.worker.planner import plan_step


def _step(lengths):
    """``query_start_loc`` of requests with these row counts, and their ids."""
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    return qsl, [f"r{i}" for i in range(len(lengths))]


def test_sets_round_trip_through_the_wire_form():
    plan = Plan(tag="t", sets=(Set("z", 1, "", 16, 32, 0, -1), Set("resid_post", 2, "v1", 0, -1, 5, 6)))
    back = parse_plan(plan.to_wire())
    assert back.sets == plan.sets


@pytest.mark.parametrize("layout_3d", [False, True])
def test_one_batched_set_equals_row_by_row_replacement(layout_3d):
    torch.manual_seed(0)
    width = 8
    store = VectorStore(width)
    store.put("mean", torch.arange(width, dtype=torch.float32))
    plans = [
        Plan(tag="a", sets=(Set("resid_post", 1, "", 2, 5, 3, 7),)),         # zeros, dims 2-4
        None,                                                                   # untraced traffic
        Plan(tag="c", sets=(Set("resid_post", 1, "mean", 0, -1, 0, -1),)),    # whole row, a vector
        Plan(tag="d"),                                                          # traced, no sets
        Plan(tag="e", sets=(Set("resid_post", 1, "mean", 6, 8, 10, 12),)),    # not in this step
    ]
    lengths, computed = [6, 3, 4, 2, 5], [2, 0, 7, 0, 0]  # request a: positions 2..7
    qsl, ids = _step(lengths)
    step = plan_step(ids, plans, qsl, computed, vector_rows=store.rows)
    key = ("resid_post", 1)
    assert set(step.sets) == {key}
    batch = step.sets[key]
    assert set(batch.req_ids) == {"r0", "r2"}
    T = qsl[-1]
    hidden, residual = torch.randn(T, width), torch.randn(T, width)
    if layout_3d:
        hidden, residual = hidden[None], residual[None]
    before = (hidden + residual).clone()
    apply_sets(store.matrix_of, batch, step.layout, lambda: hidden + residual,
               lambda: residual, "resid_post[1]")
    after = (hidden + residual).reshape(T, width)
    expect = before.reshape(T, width).clone()
    for pos in range(3, 7):  # request a's rows 1..4 are positions 3..6
        expect[pos - 2, 2:5] = 0.0
    expect[9:13] = torch.arange(width, dtype=torch.float32)  # request c, all 4 rows
    assert torch.allclose(after, expect, atol=1e-6)
    untouched = [i for i in range(T) if not (1 <= i <= 4 or 9 <= i <= 12)]
    assert torch.equal(after[untouched], before.reshape(T, width)[untouched])


def test_a_missing_vector_is_a_problem_of_its_request():
    plans = [Plan(tag="a", sets=(Set("mlp_out", 0, "gone", 0, -1, 0, -1),)),
             Plan(tag="b", sets=(Set("mlp_out", 0, "", 0, -1, 0, -1),))]
    step = plan_step(["r0", "r1"], plans, [0, 3, 5], [0, 0], vector_rows={})
    assert "vector gone never reached" in step.problems["r0"][0]
    assert "r1" not in step.problems and step.sets[("mlp_out", 0)].req_ids == ("r1",)
    assert not step.sets[("mlp_out", 0)].any_vector


def test_projecting_sets_take_the_direction_out_beside_plain_sets():
    """A directional ablation (a projecting set) and a zero set on different
    requests of one step: each projected row loses exactly its component
    along the (unit) vector, the zero set's dims are zero, other rows stay
    bit-identical, and the value is a sum (hidden + residual)."""
    torch.manual_seed(1)
    width = 6
    store = VectorStore(width)
    r = torch.randn(width)
    store.put("r", r / r.norm())
    plans = [Plan(tag="a", sets=(Set("resid_post", 0, "r", 0, -1, 1, 4, project=True),)),
             Plan(tag="b"),
             Plan(tag="c", sets=(Set("resid_post", 0, "", 0, 2, 0, -1),)),
             Plan(tag="d", sets=(Set("resid_post", 0, "r", 0, -1, 0, -1, project=True),))]
    lengths = [5, 2, 3, 1]
    qsl, ids = _step(lengths)
    step = plan_step(ids, plans, qsl, [0, 0, 0, 9], vector_rows=store.rows)
    batch = step.sets[("resid_post", 0)]
    assert batch.project is not None and int(batch.project.sum()) == 4
    T = qsl[-1]
    hidden, residual = torch.randn(T, width) * 50, torch.randn(T, width)
    before = hidden + residual
    apply_sets(store.matrix_of, batch, step.layout, lambda: hidden + residual,
               lambda: residual, "resid_post[0]")
    after = hidden + residual
    u = r / r.norm()
    projected = [1, 2, 3, 10]  # a's positions 1..3, d's one row
    for row in range(T):
        if row in projected:
            want = before[row] - (before[row] @ u) * u
            assert torch.allclose(after[row], want, atol=1e-4)
            assert abs(float(after[row] @ u)) < 1e-4 < abs(float(before[row] @ u))
        elif 7 <= row < 10:  # c: dims 0-1 zeroed
            assert float(after[row, :2].abs().max()) < 1e-5
            assert torch.equal(after[row, 2:], before[row, 2:])
        else:
            assert torch.equal(after[row], before[row]), row
