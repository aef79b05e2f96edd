"""The argument model's rules that code written for flash-attn relies on: flags are bools, window_size takes any
length-2 sequence of ints, every refusal is one exception class that is a ValueError, a TypeError and a RuntimeError,
and the KV cache / varlen paths refuse what would read or write out of bounds and accept what flash-attn accepts.
"""
import numpy as np
import pytest
import torch

import flashtile
from attn_utils import DEVICE, assert_within_rule
from flashtile.api.errors import ArgumentError
from flashtile.reference.dense import attention_ref

fp16 = torch.float16


def _qkv(b=1, sq=24, sk=24, h=2, hk=2, d=16, dtype=fp16, grad=False):
    return tuple(torch.randn(b, n, nh, d, device=DEVICE, dtype=dtype, requires_grad=grad)
                 for n, nh in ((sq, h), (sk, hk), (sk, hk)))


def _i32(vals):
    return torch.tensor(vals, dtype=torch.int32, device=DEVICE)


# --------------------------------------------------------------------------------------------------------
# One exception class

@pytest.mark.parametrize("caught", [ValueError, TypeError, RuntimeError, ArgumentError])
def test_argument_errors_are_caught_as_flash_attn_users_catch_them(caught):
    q, k, v = _qkv()
    with pytest.raises(caught, match="dropout_p"):
        flashtile.flash_attn_func(q, k, v, dropout_p=1.5)
    with pytest.raises(caught, match="dtype"):
        flashtile.flash_attn_func(q.int(), k, v)


# --------------------------------------------------------------------------------------------------------
# Flags

BAD_FLAGS = ["no", 1, 0, None, 1.0]


@pytest.mark.parametrize("value", BAD_FLAGS, ids=repr)
@pytest.mark.parametrize("name", ["causal", "deterministic", "return_attn_probs"])
def test_dense_flags_must_be_bools(name, value):
    q, k, v = _qkv()
    with pytest.raises(ArgumentError, match=name):
        flashtile.flash_attn_func(q, k, v, **{name: value})


@pytest.mark.parametrize("name", ["causal", "deterministic", "return_attn_probs"])
def test_varlen_flags_follow_the_same_rule(name):
    q, k, v = (torch.randn(10, 2, 16, device=DEVICE, dtype=fp16) for _ in range(3))
    cu = _i32([0, 4, 10])
    with pytest.raises(ArgumentError, match=name):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, **{name: "yes"})
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, **{name: np.bool_(False)})
    assert out.shape == q.shape


def test_kvcache_and_fp8_flags_follow_the_same_rule():
    q = torch.randn(1, 1, 2, 16, device=DEVICE, dtype=fp16)
    kc, vc = (torch.randn(1, 8, 2, 16, device=DEVICE, dtype=fp16) for _ in range(2))
    for name in ("causal", "rotary_interleaved", "return_softmax_lse"):
        with pytest.raises(ArgumentError, match=name):
            flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, **{name: "no"})
    q, k, v = _qkv(sq=32, sk=32)
    with pytest.raises(ArgumentError, match="causal"):
        flashtile.flash_attn_fp8_func(q, k, v, causal="no")


@pytest.mark.parametrize("flag", [True, np.bool_(True), torch.tensor(True)], ids=["bool", "numpy", "tensor"])
def test_bool_scalars_of_numpy_and_torch_are_bools(flag, seed):
    q, k, v = _qkv()
    ref = flashtile.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(flashtile.flash_attn_func(q, k, v, causal=flag), ref, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------------
# window_size

@pytest.mark.parametrize("form", ["tuple", "list", "tensor", "numpy", "numpy-ints"])
def test_window_size_any_length_two_sequence_of_ints(form, seed):
    q, k, v = _qkv(sq=24, sk=40)
    left, right = 7, 3
    window = {"tuple": (left, right), "list": [left, right], "tensor": torch.tensor([left, right]),
              "numpy": np.array([left, right]), "numpy-ints": (np.int64(left), np.int32(right))}[form]
    ref = flashtile.flash_attn_func(q, k, v, window_size=(left, right))
    torch.testing.assert_close(flashtile.flash_attn_func(q, k, v, window_size=window), ref, rtol=0, atol=0)


def test_window_size_as_flash_attn_tests_draw_it(seed):
    """flash-attn's own tests pass torch.randint(0, seqlen_k, (2,)); its values, not its shape, are the window."""
    q, k, v = _qkv(sq=24, sk=40)
    for _ in range(3):
        window = torch.randint(0, 40, (2,))
        ref = flashtile.flash_attn_func(q, k, v, window_size=tuple(window.tolist()))
        torch.testing.assert_close(flashtile.flash_attn_func(q, k, v, window_size=window), ref, rtol=0, atol=0)


@pytest.mark.parametrize("window", [(1, 2, 3), (1.0, 2), "ab", torch.tensor([1.0, 2.0]), 5, (True, 1)],
                         ids=["three", "float", "str", "float-tensor", "int", "bool"])
def test_window_size_other_forms_refused(window):
    q, k, v = _qkv()
    with pytest.raises(ArgumentError, match="window_size"):
        flashtile.flash_attn_func(q, k, v, window_size=window)


# --------------------------------------------------------------------------------------------------------
# KV cache: rotary bound, aliased writes, the paged capacity

def _nan_table(rows, half):
    """A (rows, half) cos / sin table that is a view into a NaN-filled buffer: a read past its last row is NaN."""
    buf = torch.full((rows + 16, half), float("nan"), device=DEVICE)
    buf[:rows] = torch.randn(rows, half, device=DEVICE)
    return buf[:rows]


def _rotary_problem(d=16, cap=16):
    """q of 9 rows, a (1, cap) K/V cache, one new K/V token and a cap-row cos / sin table (_nan_table) for head dim
    d: (q, k_cache, v_cache, k, v, cos, sin)."""
    q = torch.randn(1, 9, 2, d, device=DEVICE, dtype=fp16)
    kc, vc = (torch.randn(1, cap, 2, d, device=DEVICE, dtype=fp16) for _ in range(2))
    k1, v1 = (torch.randn(1, 1, 2, d, device=DEVICE, dtype=fp16) for _ in range(2))
    return q, kc, vc, k1, v1, _nan_table(cap, d // 2), _nan_table(cap, d // 2)


def test_rotary_rows_past_the_table_are_refused():
    """Causal, seqlen_q 9 > one new token: q row i is rotated at cache_seqlens + i, past a 16-row table when
    cache_seqlens = 15 (the issue's repro returned NaN rows and read out of bounds on a GPU)."""
    q, kc, vc, k1, v1, cos, sin = _rotary_problem()
    with pytest.raises(ArgumentError, match="rotary_cos"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, cos, sin, cache_seqlens=_i32([15]), causal=True)
    # positions 3 .. 11 are inside the table: the call runs and every output is finite
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, cos, sin, cache_seqlens=_i32([3]), causal=True)
    assert torch.isfinite(out).all()


def test_rotary_bound_without_value_checks_is_the_worst_case(monkeypatch):
    from flashtile.api import problem
    monkeypatch.setattr(problem, "CHECK_VALUES", False)
    d, cap = 16, 16
    q, kc, vc, k1, v1, cos, sin = _rotary_problem(d, cap)
    with pytest.raises(ArgumentError, match="rotary_cos"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, cos, sin, cache_seqlens=_i32([3]), causal=True)
    long_cos, long_sin = _nan_table(cap + 8, d // 2), _nan_table(cap + 8, d // 2)
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, long_cos, long_sin, cache_seqlens=_i32([3]),
                                            causal=True)
    assert torch.isfinite(out).all()


def test_cache_expanded_over_the_batch_refused_when_appending():
    q = torch.randn(3, 1, 2, 16, device=DEVICE, dtype=fp16)
    kc, vc = (torch.randn(1, 8, 2, 16, device=DEVICE, dtype=fp16).expand(3, 8, 2, 16) for _ in range(2))
    k1, v1 = (torch.randn(3, 1, 2, 16, device=DEVICE, dtype=fp16) for _ in range(2))
    with pytest.raises(ArgumentError, match="k_cache"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=_i32([1, 2, 3]))
    # reading a shared cache is fine
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_i32([1, 2, 3]))
    assert torch.isfinite(out).all()


def test_pages_shared_between_appending_batch_elements_refused():
    page, d = 4, 16
    kc, vc = (torch.randn(6, page, 2, d, device=DEVICE, dtype=fp16) for _ in range(2))
    q = torch.randn(2, 1, 2, d, device=DEVICE, dtype=fp16)
    k1, v1 = (torch.randn(2, 1, 2, d, device=DEVICE, dtype=fp16) for _ in range(2))
    shared = _i32([[0, 1], [0, 2]])        # page 0 holds both elements' first tokens
    with pytest.raises(ArgumentError, match="block_table"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=_i32([2, 3]), block_table=shared)
    # a shared prefix page that neither element writes (both append on their own second page) is fine
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=_i32([5, 6]), block_table=shared)
    assert torch.isfinite(out).all()
    # and reading shared pages without appending is fine
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_i32([3, 3]), block_table=shared)
    assert torch.isfinite(out).all()


def test_duplicate_cache_batch_idx_refused_when_appending():
    kc, vc = (torch.randn(4, 8, 2, 16, device=DEVICE, dtype=fp16) for _ in range(2))
    q = torch.randn(2, 1, 2, 16, device=DEVICE, dtype=fp16)
    k1, v1 = (torch.randn(2, 1, 2, 16, device=DEVICE, dtype=fp16) for _ in range(2))
    with pytest.raises(ArgumentError, match="cache_batch_idx"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=_i32([2, 3]), cache_batch_idx=_i32([1, 1]))
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_i32([2, 3]), cache_batch_idx=_i32([1, 1]))
    assert torch.isfinite(out).all()


def test_paged_lengths_past_the_block_table_name_block_table():
    page, d = 4, 16
    kc, vc = (torch.randn(6, page, 2, d, device=DEVICE, dtype=fp16) for _ in range(2))
    q = torch.randn(1, 1, 2, d, device=DEVICE, dtype=fp16)
    table = _i32([[0, 1]])                  # 8 positions
    with pytest.raises(ArgumentError, match="block_table"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_i32([9]), block_table=table)
    with pytest.raises(ArgumentError, match="block_table"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=9, block_table=table)
    k1, v1 = (torch.randn(1, 1, 2, d, device=DEVICE, dtype=fp16) for _ in range(2))
    with pytest.raises(ArgumentError, match="block_table"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=8, block_table=table)


# --------------------------------------------------------------------------------------------------------
# Varlen: tokens after the last sequence

def test_varlen_rows_after_the_last_sequence_are_zero_with_zero_gradients(seed):
    """flash-attn accepts cu_seqlens[-1] < total (the buffer's tail is padding): those rows of the output are zeros
    and get zero gradients; the sequences themselves are as without the tail."""
    h, d = 2, 16
    total_q, total_k = 13, 17
    cu_q, cu_k = _i32([0, 3, 9]), _i32([0, 5, 12])
    q = torch.randn(total_q, h, d, device=DEVICE, dtype=fp16, requires_grad=True)
    k = torch.randn(total_k, h, d, device=DEVICE, dtype=fp16, requires_grad=True)
    v = torch.randn(total_k, h, d, device=DEVICE, dtype=fp16, requires_grad=True)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 7, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert torch.equal(out[9:], torch.zeros_like(out[9:]))
    assert torch.equal(q.grad[9:], torch.zeros_like(q.grad[9:]))
    assert torch.equal(k.grad[12:], torch.zeros_like(k.grad[12:]))
    assert torch.equal(v.grad[12:], torch.zeros_like(v.grad[12:]))
    for b, (q0, q1, k0, k1) in enumerate(((0, 3, 0, 5), (3, 9, 5, 12))):
        qs, ks, vs = (t.detach()[a:z].unsqueeze(0).double().requires_grad_() for t, a, z in
                      ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        ref, _, _ = attention_ref(qs, ks, vs, causal=True)
        ref.backward(dout[q0:q1].unsqueeze(0).double())
        std_in = [t.detach()[a:z].unsqueeze(0).clone().requires_grad_() for t, a, z in
                  ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
        std, _, _ = attention_ref(*std_in, causal=True, upcast=False)
        std.backward(dout[q0:q1].unsqueeze(0))
        assert_within_rule("out", out[q0:q1].unsqueeze(0), ref, std, fp16, f"sequence {b}")
        for name, g, r, s, a, z in (("dq", q.grad, qs.grad, std_in[0].grad, q0, q1),
                                    ("dk", k.grad, ks.grad, std_in[1].grad, k0, k1),
                                    ("dv", v.grad, vs.grad, std_in[2].grad, k0, k1)):
            assert_within_rule(name, g[a:z].unsqueeze(0), r, s, fp16, f"sequence {b}")


def test_varlen_tail_without_value_checks_is_zero_too(monkeypatch, seed):
    from flashtile.api import problem
    monkeypatch.setattr(problem, "CHECK_VALUES", False)
    q, k, v = (torch.randn(11, 2, 16, device=DEVICE, dtype=fp16, requires_grad=True) for _ in range(3))
    cu = _i32([0, 4, 8])
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4)
    out.sum().backward()
    assert torch.equal(out[8:], torch.zeros_like(out[8:])) and torch.isfinite(out).all()
    for g in (q.grad, k.grad, v.grad):
        assert torch.equal(g[8:], torch.zeros_like(g[8:])) and torch.isfinite(g).all()


# --------------------------------------------------------------------------------------------------------
# The argument model itself

def test_problem_packs_and_unpacks_for_the_custom_ops():
    from flashtile.api import problem as P
    q, k, v = _qkv(b=2, sq=24, sk=40, h=4, hk=2)
    p = P.dense(q, k, v, 0.1, 0.3, True, (8, -1), 5.0, None, True, False)
    assert p.params.window_right == 0 and p.params.window_left == 8 and p.params.is_local
    assert not p.params.is_causal and p.group == 2
    ints, floats = p.pack()
    assert all(type(i) is int for i in ints) and all(type(f) is float for f in floats)
    assert P.Problem.unpack(q, k, ints, floats, batch=2) == p


def test_causal_and_windows_are_derived_once():
    from flashtile.kernels.params import AttnParams
    assert AttnParams(1.0, -1, 0).is_causal and not AttnParams(1.0, -1, 0).is_local
    assert AttnParams(1.0, 4, 0).is_local and AttnParams(1.0, 4, 0).lower_triangular
    assert AttnParams(1.0, -1, 3).is_local and not AttnParams(1.0, -1, 3).lower_triangular
    assert not AttnParams(1.0).is_causal and not AttnParams(1.0).is_local


def test_window_edges_that_mask_nothing_are_normalised_away():
    """A left edge >= seqlen_k masks nothing (flash-attn drops it too), so such a call takes the unwindowed path."""
    from flashtile.api import problem as P
    q, k, v = _qkv(sq=24, sk=40)
    assert P.dense(q, k, v, 0.0, None, True, (40, -1), 0.0, None, False, False).params.is_causal
    assert P.dense(q, k, v, 0.0, None, False, (39, -1), 0.0, None, False, False).params.window_left == 39
    assert P.dense(q, k, v, 0.0, None, False, (-1, 40), 0.0, None, False, False).params.window_right == -1


def test_cu_seqlens_values_read_once_per_tensor_version(monkeypatch, seed):
    """The layers of a model pass one cu_seqlens tensor to every call of a step: its values are read (a device to
    host copy) once, and again only once it is modified in place or another tensor comes."""
    from flashtile.api import problem
    reads = []
    real = problem._cu_seqlens_values
    monkeypatch.setattr(problem, "_cu_seqlens_values", lambda *a: reads.append(a[0]) or real(*a))
    q, k, v = (torch.randn(10, 2, 16, device=DEVICE, dtype=fp16) for _ in range(3))
    cu = _i32([0, 4, 10])
    for _ in range(3):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6)
    assert reads == ["cu_seqlens_q"]              # (the same tensor for keys: its check holds for them too)
    cu[1] = 7                                     # in place: checked again, and a bad value still refused
    flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7)
    assert len(reads) == 2
    cu[1] = 11
    with pytest.raises(ArgumentError, match="cu_seqlens_q"):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11)
    flashtile.flash_attn_varlen_func(q, k, v, _i32([0, 4, 10]), cu.new_tensor([0, 4, 10]), 6, 6)   # new tensors
    assert len(reads) == 5


def test_a_replaced_problem_has_a_cache_of_its_own():
    """dispatch keeps plans and launch templates in Problem.cache: a problem derived with dataclasses.replace (ring
    attention's per-block lengths and windows, a call's features, varlen padding rows) must not share them, or a
    plan made for one geometry would launch over another's tensors."""
    import dataclasses
    from flashtile.api import problem as P
    q, k, v = _qkv(sq=24, sk=40)
    p = P.dense(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False)
    p.cache["fwd"] = "a plan"
    for other in (dataclasses.replace(p, seqlen_q=12), dataclasses.replace(p, bias=True),
                  P.Problem.unpack(q, k, *p.pack(), batch=1)):
        assert other.cache == {} and other.cache is not p.cache


def test_featured_problems_are_kept_per_feature_values(monkeypatch):
    """Problem.with_features: a masked / biased call's problem is one object per feature values (its plans kept
    across the calls of a loop), another object for other values; flash_attn_func with an attn_mask hands the
    dispatcher the same problem call after call."""
    from flashtile.api import problem as P
    from flashtile.kernels import dispatch
    q, k, v = (torch.randn(2, 8, 2, 16, device=DEVICE) for _ in range(3))
    p = P.dense(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False)
    a = p.with_features(mask=True, bias=False)
    assert a is p.with_features(mask=True, bias=False) and a.mask and not p.mask and a.cache is not p.cache
    assert p.with_features(mask=False, bias=True) is not a
    seen = []
    real = dispatch.forward
    mask = torch.rand(2, 1, 8, 8, device=DEVICE) > 0.3
    monkeypatch.setattr(dispatch, "forward", lambda pr, *a, **kw: seen.append(pr) or real(pr, *a, **kw))
    for _ in range(2):
        flashtile.flash_attn_func(q, k, v, attn_mask=mask)
    assert len(seen) == 2 and seen[0] is seen[1] and seen[0].mask


def test_padded_problems_are_kept_per_padding(monkeypatch):
    """Problem.with_padding: the same object for the same (pad_q, pad_k), so a loop over padded packed batches keeps
    its plans; a problem of its own (cache included) per padding; the problem itself without padding to add; at
    most MEMO_MAX of them."""
    from flashtile.api import problem as P
    q, k, v = (torch.randn(30, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 10, 25], dtype=torch.int32)
    p = P.varlen(q, k, v, cu, cu, 15, 15, 0.0, None, True, (-1, -1), 0.0, None, False, False)
    a = p.with_padding(25, 25)
    assert a is p.with_padding(25, 25) and (a.pad_q, a.pad_k) == (25, 25) and a.padded_q and not p.padded_q
    assert a.cache is not p.cache and p.with_padding(P.NO_PAD, P.NO_PAD) is p
    assert p.with_padding(20, 25) is not a
    monkeypatch.setattr(P, "MEMO_MAX", 4)
    for pad in range(10):
        p.with_padding(pad, pad)
    assert len(p.cache["padding"]) <= 4
