"""The batcher with plain tensors: every layout vLLM can hand a hook."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlens.worker.layout import RowSpan, StepLayout, narrow, token_axis, widen
from vlens.errors import TokenAxisError


@st.composite
def steps(draw):
    """A random step: requests in engine order, each a prefill chunk or a
    decode row, some without a plan, optional padding, either layout."""
    n = draw(st.integers(1, 8))
    counts, first, planned = [], [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["prefill", "chunk", "decode"]))
        if kind == "decode":
            counts.append(1)
            first.append(draw(st.integers(1, 300)))
        elif kind == "chunk":  # a later piece of a chunked prefill
            counts.append(draw(st.integers(1, 40)))
            first.append(draw(st.integers(1, 300)))
        else:
            counts.append(draw(st.integers(1, 40)))
            first.append(0)
        planned.append(draw(st.booleans()))
    if not any(planned):
        planned[draw(st.integers(0, n - 1))] = True
    actual = sum(counts)
    pad = draw(st.sampled_from([0, 0, 1, 7]))
    keys = [f"req-{i}" for i in range(n)]
    layout = StepLayout.from_counts(
        keys, counts, first_positions=first, num_padded=actual + pad
    )
    hidden = draw(st.sampled_from([4, 8, actual, actual + pad]))  # incl. H == T
    batched = draw(st.booleans())  # [1, T, H] (Transformers backend)
    return layout, hidden, batched, planned


def _step_tensor(layout: StepLayout, hidden: int, batched: bool) -> torch.Tensor:
    """Row r holds the value r + 1 everywhere (padding rows hold -1)."""
    rows = torch.full((layout.num_padded, hidden), -1.0)
    rows[: layout.num_actual] = torch.arange(1, layout.num_actual + 1, dtype=torch.float32)[:, None]
    return rows.unsqueeze(0) if batched else rows


@given(steps())
@settings(max_examples=300, deadline=None)
def test_reads_hold_only_the_requests_rows(step):
    layout, hidden, batched, planned = step
    x = _step_tensor(layout, hidden, batched)
    axis = token_axis(x, layout)
    assert axis == (1 if batched else 0)
    for span, has_plan in zip(layout.spans, planned):
        if not has_plan:
            continue
        got = narrow(x, layout, span)
        got2d = got.squeeze(0) if batched else got
        assert got2d.shape == (span.length, hidden)
        expected = torch.arange(span.start + 1, span.stop + 1, dtype=torch.float32)
        assert torch.equal(got2d[:, 0], expected)
        assert (got2d >= 1).all()  # never a padding row


@given(steps())
@settings(max_examples=300, deadline=None)
def test_writes_touch_only_the_requests_rows(step):
    layout, hidden, batched, planned = step
    x = _step_tensor(layout, hidden, batched)
    before = x.clone()
    changed = torch.zeros(layout.num_padded, dtype=torch.bool)
    for span, has_plan in zip(layout.spans, planned):
        if not has_plan:
            continue
        rows = narrow(x, layout, span, clone=True)
        widen(x, layout, span, rows * 0 + 1000.0)
        changed[span.start : span.stop] = True
    x2, b2 = (x[0], before[0]) if batched else (x, before)
    assert (x2[changed] == 1000.0).all()
    assert torch.equal(x2[~changed], b2[~changed])  # others and padding untouched


@given(steps())
@settings(max_examples=100, deadline=None)
def test_clone_reads_do_not_alias_and_views_do(step):
    layout, hidden, batched, planned = step
    x = _step_tensor(layout, hidden, batched)
    span = layout.spans[planned.index(True)]
    view = narrow(x, layout, span)
    copy = narrow(x, layout, span, clone=True)
    x.zero_()  # the engine reuses its buffer
    assert (view == 0).all()
    assert (copy != 0).all()


def _dim0_only_narrow(t: torch.Tensor, total: int, start: int, n: int) -> torch.Tensor:
    """The rule the seed fixed: narrow dim 0 when shape[0] == total, else
    treat the tensor as unbatched and pass it through whole."""
    if t.shape[0] == total:
        return t[start : start + n]
    return t


def test_seed_regression_dim0_rule_leaks_every_request_on_transformers_layout():
    layout = StepLayout.from_counts(["a", "b", "c"], [5, 1, 2])
    x = _step_tensor(layout, 16, batched=True)  # [1, 8, 16]
    b = layout.span("b")
    leaked = _dim0_only_narrow(x, layout.num_actual, b.start, b.length)
    assert leaked.shape == (1, 8, 16)  # the old rule: all 8 tokens of 3 requests
    ours = narrow(x, layout, b)
    assert ours.shape == (1, 1, 16)
    assert torch.equal(ours[0, :, 0], torch.tensor([6.0]))  # request b's row only
    # and a write through the old rule would land on a copy nobody reads;
    # ours lands on b's row and nowhere else
    widen(x, layout, b, torch.zeros(1, 1, 16))
    assert (x[0, 5] == 0).all() and (x[0, 4] == 5).all() and (x[0, 6] == 7).all()


@pytest.mark.parametrize(
    "shape,expected",
    [
        ((6, 6), 0),  # native, hidden == T
        ((1, 6, 6), 1),  # transformers backend, hidden == T
        ((6, 4, 32), 0),  # per-head values [T, heads, dim]
        ((1, 6), 1),  # [1, T] positions of the Transformers backend
        ((9, 4), 0),  # padded rows count too
        ((1, 9, 4), 1),
    ],
)
def test_token_axis_cases(shape, expected):
    layout = StepLayout.from_counts(["a", "b"], [4, 2], num_padded=9)
    assert token_axis(torch.zeros(shape), layout) == expected


@pytest.mark.parametrize("shape", [(5, 4), (2, 6, 4), (4,), (1, 5, 6), ()])
def test_token_axis_not_found_is_an_error_naming_the_site(shape):
    layout = StepLayout.from_counts(["a", "b"], [4, 2])
    with pytest.raises(TokenAxisError, match=r"site layers\.3\.qkv"):
        token_axis(torch.zeros(shape), layout, site="layers.3.qkv")


def test_single_token_step_is_unambiguous():
    layout = StepLayout.from_counts(["a"], [1])
    x = torch.arange(4.0).reshape(1, 4)  # native [1, H] decode step
    assert token_axis(x, layout) == 0
    assert torch.equal(narrow(x, layout, layout.spans[0]), x)
    y = torch.arange(4.0).reshape(1, 1, 4)
    assert torch.equal(narrow(y, layout, layout.spans[0]), y)


def test_widen_refuses_rows_of_the_wrong_shape():
    layout = StepLayout.from_counts(["a", "b"], [3, 2])
    x = torch.zeros(5, 4)
    with pytest.raises(TokenAxisError, match="shape"):
        widen(x, layout, layout.span("b"), torch.ones(3, 4))
    assert (x == 0).all()


def test_layout_rejects_inconsistent_input():
    with pytest.raises(ValueError):
        StepLayout((RowSpan("a", 0, 2), RowSpan("b", 3, 4)), 4, 4)
    with pytest.raises(ValueError):
        StepLayout.from_counts(["a"], [3], num_padded=2)
    with pytest.raises(ValueError):
        StepLayout.from_query_start_loc(["a", "b"], [0, 3])
    lay = StepLayout.from_query_start_loc(["a", "b"], [0, 3, 4], first_positions=[0, 9])
    assert lay.span("b") == RowSpan("b", 3, 4, 9)
    assert lay.row_index(["b", "a"]).tolist() == [0, 1, 2, 3]
    with pytest.raises(KeyError):
        lay.span("zz")


def test_span_outside_the_step_is_refused():
    layout = StepLayout.from_counts(["a"], [3], num_padded=5)
    with pytest.raises(TokenAxisError, match="outside"):
        narrow(torch.zeros(5, 2), layout, RowSpan("x", 2, 5))


@given(steps())
@settings(max_examples=200, deadline=None)
def test_gather_equals_narrow_per_request_and_copies(step):
    from vlens.worker.layout import gather

    layout, hidden, batched, planned = step
    x = _step_tensor(layout, hidden, batched)
    spans = [s for s, p in zip(layout.spans, planned) if p]
    got = gather(x, layout, spans)
    parts = got.split([s.length for s in spans])
    for span, part in zip(spans, parts):
        expected = narrow(x, layout, span)
        assert torch.equal(part, expected.squeeze(0) if batched else expected)
    x.zero_()
    assert (got >= 1).all()  # a copy: the engine reusing its buffer changes nothing
