"""Naive, safe and online softmax (Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018):
values, memory accesses per element, the merge operator."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashtile.reference.io_counters import HBM
from flashtile.reference.softmax import (merge, naive_softmax, online_normalizer, online_softmax,
                                         parallel_online_softmax, safe_softmax)

SOFTMAXES = {
    "naive": naive_softmax,
    "safe": safe_softmax,
    "online": online_softmax,
    "parallel-3": lambda x, hbm=None: parallel_online_softmax(x, 3, hbm),
}


@pytest.mark.parametrize("name", SOFTMAXES)
def test_softmax_matches_torch_softmax_float64(name, seed):
    x = torch.randn(5, 37, dtype=torch.float64) * 3
    torch.testing.assert_close(SOFTMAXES[name](x), torch.softmax(x, -1), rtol=0, atol=1e-14)


@pytest.mark.parametrize("name, loads, stores", [("naive", 2, 1), ("safe", 3, 1), ("online", 2, 1),
                                                 ("parallel-3", 2, 1)])
def test_memory_accesses_per_element_naive_3_safe_4_online_3(name, loads, stores, seed):
    x = torch.randn(4, 29)
    hbm = HBM()
    SOFTMAXES[name](x, hbm)
    assert (hbm.reads, hbm.writes) == (loads * x.numel(), stores * x.numel())
    assert hbm.total / x.numel() == loads + stores


def test_online_softmax_saves_one_access_per_element_over_safe(seed):
    x = torch.randn(3, 50)
    safe, online = HBM(), HBM()
    safe_softmax(x, safe)
    online_softmax(x, online)
    assert (safe.total, online.total) == (4 * x.numel(), 3 * x.numel())


def test_online_normalizer_on_a_worked_example():
    # x = {3, 4, 2, 5} gives m_4 = 5 and d_4 = (e^3 + e^4 + e^2 + e^5) / e^5
    m, d = online_normalizer(torch.tensor([3.0, 4.0, 2.0, 5.0], dtype=torch.float64))
    assert m.item() == 5.0
    assert d.item() == pytest.approx((math.e**3 + math.e**4 + math.e**2 + math.e**5) / math.e**5, rel=1e-15)


def test_naive_softmax_overflows_where_safe_and_online_do_not():
    x = torch.tensor([[1000.0, 999.0, 998.0]], dtype=torch.float64)
    assert torch.isnan(naive_softmax(x)).all()  # e^1000 = inf, inf / inf = NaN: why the max is subtracted
    expected = torch.softmax(x, -1)
    for f in (safe_softmax, online_softmax):
        torch.testing.assert_close(f(x), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", ["safe", "online", "parallel-3"])
def test_all_minus_inf_row_gives_zeros_not_nan(name, seed):
    x = torch.randn(3, 8, dtype=torch.float64)
    x[1] = float("-inf")  # a fully masked attention row
    y = SOFTMAXES[name](x)
    assert torch.equal(y[1], torch.zeros(8, dtype=torch.float64))
    torch.testing.assert_close(y[[0, 2]], torch.softmax(x[[0, 2]], -1), rtol=0, atol=1e-14)


# --- the merge operator ⊕ -----------------------------------------------------------------------------
finite = st.floats(-50, 50, allow_nan=False)
partial = st.tuples(st.one_of(finite, st.just(float("-inf"))), st.floats(0, 1e3, allow_nan=False)).map(
    lambda md: (md[0], 0.0 if md[0] == float("-inf") else md[1]))  # m = -inf only with d = 0 (empty)


def _t(md):
    return torch.tensor(md[0], dtype=torch.float64), torch.tensor(md[1], dtype=torch.float64)


def _close(a, b):
    return a[0].item() == b[0].item() and math.isclose(a[1].item(), b[1].item(), rel_tol=1e-12, abs_tol=1e-300)


@settings(max_examples=200, deadline=None)
@given(partial, partial, partial)
def test_merge_is_associative_and_commutative_with_identity(a, b, c):
    a, b, c = _t(a), _t(b), _t(c)
    assert _close(merge(merge(a, b), c), merge(a, merge(b, c)))
    assert _close(merge(a, b), merge(b, a))
    assert _close(merge(a, _t((float("-inf"), 0.0))), a)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=1, max_size=40), st.integers(1, 45))
def test_parallel_online_softmax_is_independent_of_the_split(values, chunks):
    x = torch.tensor([values], dtype=torch.float64)
    torch.testing.assert_close(parallel_online_softmax(x, chunks), torch.softmax(x, -1), rtol=0, atol=1e-14)


def test_softmax_rejects_bad_input():
    with pytest.raises(ValueError, match="x: expected a float tensor"):
        safe_softmax(torch.arange(4))
    with pytest.raises(ValueError, match="chunks=0"):
        parallel_online_softmax(torch.randn(4), 0)
