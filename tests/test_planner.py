"""The step planner, the records and the steering add, with plain tensors.

Each engine step is drawn at random (mixed prefill chunks and decode rows,
requests with and without plans, padding, both layouts); the planner's
output is checked against a row-by-row brute force. A second group drives
whole requests through many steps with chunking, preemption restarts and
prefix-cache starts, and checks that what a record hands back is one clean
pass over the request's positions.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlens.worker.layout import StepLayout, add_rows, narrow
from vlens.worker.vectors import VectorStore
from vlens.errors import TokenAxisError
from vlens.protocol.plan import Add, Edit, Plan, Read
from vlens.worker.planner import COLLECTIVE, plan_step
from vlens.worker.records import RequestRecord

SITES = ["resid_pre", "resid_post", "mlp_out"]
VECS = {"va": 0, "vb": 3, "vc": 1}  # vector id -> matrix row ("vmissing" is absent)


@st.composite
def add_entries(draw, prompt_len: int):
    kind = draw(st.sampled_from(["all", "prompt", "generated", "range"]))
    start, stop = {
        "all": (0, -1),
        "prompt": (0, prompt_len),
        "generated": (prompt_len, -1),
        "range": (draw(st.integers(0, 60)), -2),
    }[kind]
    if stop == -2:
        stop = start + draw(st.integers(1, 60))
    return Add(
        draw(st.sampled_from(SITES)), draw(st.integers(0, 2)),
        draw(st.sampled_from(["va", "vb", "vc", "va", "vmissing"])),
        draw(st.sampled_from([0.5, -2.0, 3.0])), start, stop, draw(st.booleans()),
    )


@st.composite
def plans(draw, tag: str):
    prompt_len = draw(st.integers(1, 50))
    reads = tuple(
        Read(draw(st.sampled_from(SITES)),
             tuple(sorted(draw(st.sets(st.integers(0, 2), min_size=1)))),
             reduce, k)
        for reduce, k in draw(st.lists(st.sampled_from(
            [("full", 0), ("norm", 0), ("logit_lens", 2), ("logit_lens", 3), ("vocab_logprobs", 0)]),
            max_size=3, unique=True))
    )
    if draw(st.booleans()):  # a read of one prompt position (from the end, when negative)
        reads += (Read("mlp_out", (1,), "dla", target=(3, -1),
                       position=draw(st.integers(-prompt_len, prompt_len - 1))),)
    return Plan(
        tag=tag, reads=reads,
        adds=tuple(draw(st.lists(add_entries(prompt_len), max_size=3))),
        edits=tuple(Edit(draw(st.sampled_from(SITES)), draw(st.integers(0, 2)), "fn")
                    for _ in range(draw(st.integers(0, 2)))),
        prompt_len=prompt_len,
    )


@st.composite
def steps(draw):
    n = draw(st.integers(1, 7))
    ids, counts, first, plan_list = [], [], [], []
    for i in range(n):
        kind = draw(st.sampled_from(["prefill", "chunk", "decode"]))
        counts.append(1 if kind == "decode" else draw(st.integers(1, 30)))
        first.append(0 if kind == "prefill" else draw(st.integers(1, 80)))
        ids.append(f"r{i}")
        plan_list.append(draw(plans(f"t{i}")) if draw(st.booleans()) else None)
    qsl = [0]
    for c in counts:
        qsl.append(qsl[-1] + c)
    pad = draw(st.sampled_from([0, 0, 3]))
    return ids, plan_list, qsl, first, qsl[-1] + pad


def _owner(layout: StepLayout, row: int):
    return next(s for s in layout.spans if s.start <= row < s.stop)


@given(steps())
@settings(max_examples=300, deadline=None)
def test_adds_cover_exactly_the_positions_each_plan_asks_for(step):
    ids, plan_list, qsl, first, padded = step
    sp = plan_step(ids, plan_list, qsl, first, num_padded=padded, vector_rows=VECS)
    if all(p is None for p in plan_list):
        assert sp is None
        return
    plan_of = dict(zip(ids, plan_list))
    expected, missing = [], set()
    for row in range(qsl[-1]):
        span = _owner(sp.layout, row)
        plan = plan_of[span.key]
        if plan is None:
            continue
        pos = span.first_position + row - span.start
        for a in plan.adds:
            if a.start <= pos and (a.stop < 0 or pos < a.stop):
                if a.vec in VECS:
                    expected.append(((a.site, a.layer), row, VECS[a.vec], a.scale, a.relative))
                else:
                    missing.add(span.key)
    got = []
    for key, b in sp.adds.items():
        rel = b.relative.tolist() if b.relative is not None else [False] * len(b.rows)
        for r, v, s, rl in zip(b.rows.tolist(), b.vectors.tolist(), b.scales.tolist(), rel):
            got.append((key, r, v, s, rl))
            assert _owner(sp.layout, r).key in b.req_ids
    assert sorted(got) == sorted(expected)
    assert set(sp.problems) == missing
    for req_id in missing:
        assert all("never reached this worker" in m for m in sp.problems[req_id])


@given(steps(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_read_groups_and_edits_belong_to_their_requests(step, reader):
    ids, plan_list, qsl, first, padded = step
    sp = plan_step(ids, plan_list, qsl, first, num_padded=padded, vector_rows=VECS,
                   reader=reader)
    if sp is None:
        return
    plan_of = dict(zip(ids, plan_list))
    want = set()
    for span in sp.layout.spans:
        plan = plan_of[span.key]
        if plan is None or span.length == 0:
            continue
        assert sp.requests[span.key] == (plan, span)
        for read in plan.reads:
            if not (reader or read.reduce in COLLECTIVE):
                continue
            at = read.at(plan.prompt_len)
            if at is None:
                want |= {(read.site, layer, read.key, read.k, *span) for layer in read.layers}
            elif span.first_position <= at < span.first_position + span.length:
                # one position: its row alone, where this step holds it
                row = span.start + at - span.first_position
                want |= {(read.site, layer, read.key, read.k, span.key, row, row + 1, at)
                         for layer in read.layers}
    got = set()
    for (site, layer), groups in sp.reads.items():
        assert len({(g.read.key, g.read.k) for g in groups}) == len(groups)
        for g in groups:
            assert g.rows().tolist() == [r for sp_ in g.spans for r in range(sp_.start, sp_.stop)]
            for span in g.spans:
                got.add((site, layer, g.read.key, g.read.k, *span))
    assert got == want
    for calls in sp.edits.values():
        for call in calls:
            span = sp.layout.spans[ids.index(call.req_id)]
            assert call.span == span and call.plan is plan_of[call.req_id]
            assert call.positions == tuple(range(span.first_position, span.first_position + span.length))


@given(steps(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_one_batched_add_equals_row_by_row_adds(step, batched):
    """Applying a step's AddBatch with add_rows changes exactly the planned
    rows, by the planned amounts, in either layout; padding untouched."""
    ids, plan_list, qsl, first, padded = step
    sp = plan_step(ids, plan_list, qsl, first, num_padded=padded, vector_rows=VECS)
    if sp is None:
        return
    hidden = 4
    matrix = torch.arange(4 * hidden, dtype=torch.float32).reshape(4, hidden) + 1
    for key, b in sp.adds.items():
        x = torch.randn(padded, hidden)
        ref = x.clone()
        for r, v, s in zip(b.rows.tolist(), b.vectors.tolist(), b.scales.tolist()):
            ref[r] += s * matrix[v]
        t = x.unsqueeze(0) if batched else x
        add_rows(t, sp.layout, b.rows, matrix[b.vectors] * b.scales[:, None])
        assert torch.allclose(t.reshape(padded, hidden), ref, atol=1e-5), key


def test_no_plan_means_no_step():
    assert plan_step(["a", "b"], [None, None], [0, 3, 4], [0, 7]) is None


# -- add_rows -------------------------------------------------------------

def test_add_rows_accumulates_duplicates_and_leaves_other_rows():
    layout = StepLayout.from_counts(["a", "b"], [3, 2], num_padded=7)
    x = torch.zeros(7, 2)
    rows = torch.tensor([1, 1, 4])
    add_rows(x, layout, rows, torch.tensor([[1.0, 2.0], [10.0, 20.0], [5.0, 5.0]]))
    assert x[1].tolist() == [11.0, 22.0] and x[4].tolist() == [5.0, 5.0]
    assert x[[0, 2, 3, 5, 6]].abs().sum() == 0


def test_add_rows_on_the_transformers_layout_and_in_low_precision():
    layout = StepLayout.from_counts(["a"], [3])
    x = torch.zeros(1, 3, 4, dtype=torch.bfloat16)
    add_rows(x, layout, torch.tensor([2]), torch.ones(1, 4))  # float32 delta
    assert x.dtype == torch.bfloat16 and x[0, 2].tolist() == [1.0] * 4
    assert x[0, :2].abs().sum() == 0


@pytest.mark.parametrize("bad", [[-1], [3], [5]])
def test_add_rows_refuses_rows_outside_the_real_rows(bad):
    layout = StepLayout.from_counts(["a"], [3], num_padded=6)
    x = torch.zeros(6, 2)
    with pytest.raises(TokenAxisError, match="outside"):
        add_rows(x, layout, torch.tensor(bad), torch.ones(1, 2))
    assert x.abs().sum() == 0


def test_add_rows_refuses_a_tensor_without_the_token_axis():
    layout = StepLayout.from_counts(["a"], [3])
    with pytest.raises(TokenAxisError):
        add_rows(torch.zeros(5, 2), layout, torch.tensor([0]), torch.ones(1, 2))


# -- whole requests through many steps ---------------------------------------

@st.composite
def schedules(draw):
    """Requests of random length, each run in random chunks, some restarted
    (preemption: recomputed from 0 or from a cached prefix), some starting
    after a prefix-cache hit."""
    n = draw(st.integers(1, 4))
    reqs = []
    for i in range(n):
        prompt_len = draw(st.integers(1, 40))
        length = prompt_len + draw(st.integers(0, 20))
        start = draw(st.sampled_from([0, 0, min(16, prompt_len - 1)])) if prompt_len > 1 else 0
        pieces, at = [], start
        restarted = False
        while at < length:
            n_rows = 1 if at >= prompt_len else draw(st.integers(1, 16))
            n_rows = min(n_rows, length - at)
            pieces.append((at, n_rows))
            at += n_rows
            if not restarted and at < length and draw(st.integers(0, 5)) == 0:
                restarted = True
                at = draw(st.integers(0, at - 1)) if at > 1 else 0
        adds = tuple(draw(st.lists(add_entries(prompt_len), max_size=2)))
        reqs.append((f"r{i}", prompt_len, length, start, pieces, adds))
    return reqs


@given(schedules())
@settings(max_examples=150, deadline=None)
def test_records_describe_one_clean_pass_through_restarts(reqs):
    """Steps interleave the requests' pieces; a row's value is its request
    number * 1000 + its position, so a read shows exactly which rows landed."""
    records: dict[str, RequestRecord] = {}
    plans_of = {}
    for rid, prompt_len, _, _, _, adds_ in reqs:
        plans_of[rid] = Plan(tag=rid, reads=(Read("resid_post", (0, 2)),), adds=adds_,
                             prompt_len=prompt_len)
    queues = {r[0]: list(r[4]) for r in reqs}
    number = {r[0]: i for i, r in enumerate(reqs)}
    while any(queues.values()):
        batch = [(rid, q.pop(0)) for rid, q in queues.items() if q]
        ids = [rid for rid, _ in batch] + ["other"]
        counts = [n for _, (_, n) in batch] + [2]
        first = [p for _, (p, _) in batch] + [0]
        qsl = [0]
        for c in counts:
            qsl.append(qsl[-1] + c)
        sp = plan_step(ids, [plans_of[r] for r, _ in batch] + [None], qsl, first,
                       vector_rows=VECS)
        values = torch.full((qsl[-1], 3), -1.0)
        for span in sp.layout.spans:
            if span.key in number:
                pos = torch.arange(span.first_position, span.first_position + span.length)
                values[span.start : span.stop] = (number[span.key] * 1000 + pos)[:, None].float()
        for rid, (plan, span) in sp.requests.items():
            rec = records.setdefault(rid, RequestRecord(plan, rid))
            pos = list(range(span.first_position, span.first_position + span.length))
            rec.begin_step(span.first_position, span.length, [p + 7 for p in pos], pos)
        for (site, layer), groups in sp.reads.items():
            for g in groups:
                rows = torch.cat([narrow(values, sp.layout, s) for s in g.spans])
                for rid, chunk in zip(g.req_ids, rows.split(g.lengths)):
                    records[rid].keep(g.read.key, "value", layer, chunk)
    for rid, prompt_len, length, start, pieces, adds_ in reqs:
        packed = records[rid].pack()
        assert packed["errors"] == []
        first_seen = min(p for p, _ in pieces)
        assert packed["start"] == first_seen
        assert packed["positions"] == list(range(first_seen, length))
        assert packed["token_ids"] == [p + 7 for p in range(first_seen, length)]
        assert sum(packed["step_rows"]) == length - first_seen
        restarts = sum(1 for (a, _), (b, m) in zip(pieces[1:], pieces) if a < b + m)
        assert packed["restarts"] == restarts
        got = decode_tensor(packed["reads"]["resid_post"]["value"])  # [2 layers, T, 3]
        want = (number[rid] * 1000 + torch.arange(first_seen, length)).float()
        assert torch.equal(got[:, :, 0], want.expand(2, -1))
        steered = sum(max(0, (length if a.stop < 0 else min(a.stop, length))
                          - max(a.start, first_seen)) for a in adds_)
        assert packed["steered_rows"] == steered


from vlens.protocol.tensors import decode_tensor  # noqa: E402


@given(schedules(), st.data())
@settings(max_examples=150, deadline=None)
def test_a_one_position_read_keeps_that_row_through_chunks_and_restarts(reqs, data):
    """Journaled records (the step log, as the hooks keep them): a read of
    one prompt position gets the row of that position alone, from whichever
    chunk ran it, whatever recompute came after; a full read beside it in
    the same group keeps every row; a position served from the prefix
    cache is an error, never another row."""
    from vlens.worker.steplog import StepLog

    records: dict[str, RequestRecord] = {}
    plans_of, at_of = {}, {}
    for rid, prompt_len, _, _, _, _ in reqs:
        position = data.draw(st.integers(-prompt_len, prompt_len - 1))
        full = data.draw(st.booleans())
        reads = (Read("mlp_out", (0, 2), "dla", target=(3, -1), position=position),
                 *((Read("resid_post", (1,), "norm"),) if full else ()))
        plans_of[rid] = Plan(tag=rid, reads=reads, prompt_len=prompt_len)
        at_of[rid] = position % prompt_len
    queues = {r[0]: list(r[4]) for r in reqs}
    number = {r[0]: i for i, r in enumerate(reqs)}
    while any(queues.values()):
        batch = [(rid, q.pop(0)) for rid, q in queues.items() if q]
        ids = ["other"] + [rid for rid, _ in batch]
        counts = [3] + [n for _, (_, n) in batch]
        first = [0] + [p for _, (p, _) in batch]
        qsl = [0]
        for c in counts:
            qsl.append(qsl[-1] + c)
        sp = plan_step(ids, [None] + [plans_of[r] for r, _ in batch], qsl, first)
        values = torch.full((qsl[-1], 3), -1.0)
        for span in sp.layout.spans:
            if span.key in number:
                pos = torch.arange(span.first_position, span.first_position + span.length)
                values[span.start : span.stop] = (number[span.key] * 1000 + pos)[:, None].float()
        log = StepLog()
        for rid, (plan, span) in sp.requests.items():
            pos = list(range(span.first_position, span.first_position + span.length))
            records.setdefault(rid, RequestRecord(plan, rid)).begin_step(
                span.first_position, span.length, [p + 7 for p in pos], pos, log)
        for (site, layer), groups in sp.reads.items():
            for g in groups:  # what the hooks do: one gather for the group, kept in the log
                log.put((g.read.key, "value", layer), values.index_select(0, g.index_on("cpu")), g)
    for rid, prompt_len, length, start, pieces, _ in reqs:
        packed = records[rid].pack()
        first_seen = min(p for p, _ in pieces)
        at = at_of[rid]
        key = plans_of[rid].reads[0].key
        if at < first_seen:  # from the prefix cache: said, not filled with another row
            assert any(f"position {at} never reached the hooks" in e for e in packed["errors"])
            assert key not in packed["reads"]
            continue
        assert packed["errors"] == []
        assert packed["reads"][key]["position"] == at
        got = decode_tensor(packed["reads"][key]["value"])  # [2 layers, 1, 3]
        assert torch.equal(got, torch.full((2, 1, 3), number[rid] * 1000.0 + at))
        if len(plans_of[rid].reads) > 1:
            got = decode_tensor(packed["reads"]["resid_post:norm"]["value"])
            want = (number[rid] * 1000 + torch.arange(first_seen, length)).float()
            assert torch.equal(got[0, :, 0], want)


def test_two_groups_reading_one_key_differently_each_keep_their_own_rows():
    """Calls running at once may read one key two ways in one step (a logit
    lens's top 3 beside its top 5: the key is the same, the groups are
    two). The step log keeps each group's rows and each request packs its
    own group's; the second group's rows used to replace the first's, and
    the first call failed with "the hook never saw some of this request's
    rows". A group alone in its step takes the stacked way, with the same
    values."""
    from vlens.worker.steplog import StepLog

    def ids(rows, k, layer):  # what a group's hook keeps: [rows, k], telling rows apart
        return torch.as_tensor(rows)[:, None].expand(-1, k) * 10 + layer

    reads = {"a": Read("resid_post", (0, 1), "logit_lens", k=3),
             "b": Read("resid_post", (0, 1), "logit_lens", k=5),
             "c": Read("resid_post", (0, 1), "logit_lens", k=5, position=-1)}
    for batch in (["a", "b"], ["a", "c"], ["b"], ["c"]):
        lens = {"a": 2, "b": 3, "c": 4}
        plans = [Plan(tag=r, reads=(reads[r],), prompt_len=lens[r]) for r in batch]
        qsl = [0]
        for r in batch:
            qsl.append(qsl[-1] + lens[r])
        sp = plan_step(batch, plans, qsl, [0] * len(batch))
        log, records = StepLog(), {}
        for rid, (plan, span) in sp.requests.items():
            pos = list(range(span.first_position, span.first_position + span.length))
            records[rid] = RequestRecord(plan, rid)
            records[rid].begin_step(span.first_position, span.length, pos, pos, log)
        for (_, layer), groups in sp.reads.items():
            assert len(groups) == len(batch)  # one key, read as many ways as there are calls
            for g in groups:
                log.put((g.read.key, "ids", layer), ids(g.rows(), g.read.k, layer), g)
        for i, rid in enumerate(batch):
            packed = records[rid].pack()
            assert packed["errors"] == [], (batch, rid)
            got = decode_tensor(packed["reads"]["resid_post:logit_lens"]["ids"])
            rows = list(range(qsl[i], qsl[i + 1]))[-1:] if rid == "c" else range(qsl[i], qsl[i + 1])
            want = torch.stack([ids(list(rows), reads[rid].k, layer) for layer in (0, 1)])
            assert torch.equal(got, want), (batch, rid)
            assert packed["copied_bytes"] == want.numel() * want.element_size()
            # for a client in the worker's process: the same rows as a tensor
            # owning its memory (not a view of the group's stacked rows)
            raw = records[rid].pack(tensors=True)["reads"]["resid_post:logit_lens"]["ids"]
            assert isinstance(raw, torch.Tensor) and torch.equal(raw, want)
            assert raw.is_contiguous() and raw.untyped_storage().nbytes() == raw.nbytes
            # one stack per group where the group is the key's only one this step
            stacked = log.stacked(rid, "resid_post:logit_lens", "ids", (0, 1))
            assert (stacked is None) == (len(batch) > 1), (batch, rid)
            if stacked is not None:
                assert torch.equal(stacked[0], want)


def test_a_gap_in_the_rows_is_reported_not_hidden():
    rec = RequestRecord(Plan(tag="t"), "r")
    rec.begin_step(0, 4)
    rec.begin_step(6, 1)
    assert "positions 4 to 5 never reached the hooks" in rec.pack()["errors"][0]


# -- the worker's vector store ------------------------------------------------

def test_vector_store_reuses_rows_and_keeps_values_when_it_grows():
    store = VectorStore(3, capacity=2)
    for i in range(5):
        store.put(f"v{i}", torch.full((3,), float(i)))
    assert store.matrix.shape[0] == 8
    for i in range(5):
        assert store.matrix[store.get(f"v{i}")].tolist() == [float(i)] * 3
    row = store.get("v1")
    assert store.drop("v1") and "v1" not in store
    assert store.put("new", torch.ones(3)) == row  # the freed row, no growth
    assert store.matrix.shape[0] == 8 and len(store) == 5
    with pytest.raises(ValueError, match=r"expected \[width\] \(steering: \[3\]\)"):
        store.put("bad", torch.ones(2, 3))
    # a vector of another width (a z site's) gets a matrix of its own
    wide = store.put("wide", torch.full((5,), 7.0))
    assert store.matrix_of(5)[wide].tolist() == [7.0] * 5
    assert store.matrix.shape == (8, 3) and len(store) == 6


def test_vector_store_memory_is_bounded_by_what_it_holds():
    store = VectorStore(16, capacity=4)
    for i in range(1000):
        store.put(f"v{i}", torch.randn(16))
        if i >= 8:
            store.drop(f"v{i - 8}")
    assert len(store) == 8 and store.matrix.shape[0] <= 16


@st.composite
def decode_runs(draw):
    """A batch of requests decoding together for several steps: one row per
    request, every request one position further each step, some with
    plans (no edits: their calls carry positions, so those steps are
    always planned afresh)."""
    n = draw(st.integers(1, 6))
    plan_list = []
    for i in range(n):
        p = draw(plans(f"t{i}")) if draw(st.booleans()) else None
        plan_list.append(None if p is None else Plan(
            tag=p.tag, reads=p.reads, adds=p.adds, prompt_len=p.prompt_len))
    start = [draw(st.integers(1, 70)) for _ in range(n)]
    return [f"r{i}" for i in range(n)], plan_list, start, draw(st.integers(2, 12))


def _plan_content(sp):
    """What a step plan tells the hooks, as plain data."""
    adds = {k: (b.rows.tolist(), b.vectors.tolist(), b.scales.tolist(),
                None if b.relative is None else b.relative.tolist(), b.req_ids, b.uniform)
            for k, b in sp.adds.items()}
    reads = {k: [(g.read, g.rows().tolist(), g.bounds, [tuple(s) for s in g.spans]) for g in gs]
             for k, gs in sp.reads.items()}
    requests = {r: (p.tag, tuple(s)) for r, (p, s) in sp.requests.items()}
    return adds, reads, requests, sp.problems, list(sp.layout.spans), sp.layout.num_padded


@given(decode_runs())
@settings(max_examples=200, deadline=None)
def test_a_decode_step_reusing_the_last_plan_plans_what_a_fresh_one_would(run):
    from vlens.worker.groups import BatchGroups

    ids, plan_list, start, n_steps = run
    groups = BatchGroups.of(plan_list)
    qsl = list(range(len(ids) + 1))
    last, reused = None, 0
    for step in range(n_steps):
        first = [p + step for p in start]
        fresh = plan_step(ids, plan_list, qsl, first, vector_rows=VECS, groups=groups)
        again = plan_step(ids, plan_list, qsl, first, vector_rows=VECS, groups=groups,
                          previous=last)
        assert (fresh is None) == (again is None)
        if fresh is None:
            break
        assert _plan_content(again) == _plan_content(fresh)
        if last is not None and again.adds and all(
                again.adds[k] is last.adds.get(k) for k in again.adds):
            reused += 1
        last = again
    # a plan is reused unless a request stands on the edge of one of its spans
    if last is not None and last.adds and not last.problems:
        edges = {x for p in plan_list if p is not None for a in p.adds
                 for x in (a.start, a.stop) if x > 0}
        crossings = {s for s in range(1, n_steps) for p in start if p + s in edges}
        # a one-position read's row is in one step only: the steps at it and after it
        crossings |= {s for s in range(1, n_steps) for p, plan in zip(start, plan_list)
                      if plan is not None for r in plan.reads if r.position is not None
                      and r.at(plan.prompt_len) in (p + s, p + s - 1)}
        if not crossings:
            assert reused == n_steps - 1


def test_a_reused_plan_is_dropped_when_a_vector_leaves_or_the_rows_change():
    from vlens.worker.groups import BatchGroups

    plan = Plan(tag="t", adds=(Add("resid_post", 1, "va", 2.0, 0, -1, False),), prompt_len=3)
    groups = BatchGroups.of([plan, None])
    first = plan_step(["a", "b"], [plan, None], [0, 1, 2], [5, 9], vector_rows=VECS,
                      groups=groups, vector_version=1)
    assert first.adds[("resid_post", 1)].uniform == (0, 1, 0, 2.0)
    same = plan_step(["a", "b"], [plan, None], [0, 1, 2], [6, 10], vector_rows=VECS,
                     groups=groups, previous=first, vector_version=1)
    assert same.adds[("resid_post", 1)] is first.adds[("resid_post", 1)]
    assert same.layout.spans[0].first_position == 6
    moved = plan_step(["a", "b"], [plan, None], [0, 1, 2], [7, 11], vector_rows=VECS,
                      groups=groups, previous=same, vector_version=2)
    assert moved.adds[("resid_post", 1)] is not same.adds[("resid_post", 1)]
    chunk = plan_step(["a", "b"], [plan, None], [0, 2, 3], [7, 11], vector_rows=VECS,
                      groups=groups, previous=moved, vector_version=2)
    assert chunk.adds[("resid_post", 1)].rows.tolist() == [0, 1]
