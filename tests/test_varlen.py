"""Variable-length (packed) batches: flash_attn_varlen_func and its packed variants, the padding helpers, the
paged (block_table) varlen forward, and refusal of malformed cu_seqlens before any kernel runs.

Every numeric check is the flash-attn tolerance rule (tests/attn_utils.py) against the float64 oracle, applied
sequence by sequence (each sequence pair is one dense attention problem with its own bottom-right alignment),
or against padded dense attention with padding masks (test_unpad_varlen_pad_matches_padded_dense). fp16, bf16
and fp32 all run on the CPU (tests/test_dtypes_cpu.py adds every entry point in each).
"""
import dataclasses
import re
from typing import Sequence, Tuple

import pytest
import torch

import flashtile  # noqa: F401  (sets TRITON_INTERPRET on CPU-only machines)
from attn_utils import (DEVICE, Features, assert_within_rule, given, rand_alibi, reference_fwd_bwd, st,
                        stored_output_bounds, sweep)
from flashtile.padding import index_first_axis, index_put_first_axis, pad_input, unpad_input
from flashtile.reference.dense import attention_ref
from flashtile.varlen import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                              flash_attn_varlen_qkvpacked_func)

fp16, fp32, bf16 = torch.float16, torch.float32, torch.bfloat16
ERRORS = (ValueError, TypeError)


def cu(lens: Sequence[int]) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


@dataclasses.dataclass(frozen=True)
class VCase(Features):
    """One packed batch of the varlen feature matrix: the sequences' query and key lengths."""
    lens_q: Tuple[int, ...]
    lens_k: Tuple[int, ...]
    h: int
    hk: int
    d: int
    dtype: torch.dtype

    @property
    def id(self):
        dt = {fp16: "fp16", fp32: "fp32", bf16: "bf16"}[self.dtype]
        parts = ["q" + "_".join(map(str, self.lens_q)), "k" + "_".join(map(str, self.lens_k)),
                 f"h{self.h}", f"hk{self.hk}", f"d{self.d}", dt]
        return "-".join(parts + self.feature_tags())


def packed_inputs(c: VCase):
    tq, tk = sum(c.lens_q), sum(c.lens_k)
    q = torch.randn(tq, c.h, c.d, dtype=c.dtype, device=DEVICE, requires_grad=True)
    k = torch.randn(tk, c.hk, c.d, dtype=c.dtype, device=DEVICE, requires_grad=True)
    v = torch.randn(tk, c.hk, c.d, dtype=c.dtype, device=DEVICE, requires_grad=True)
    dout = torch.randn(tq, c.h, c.d, dtype=c.dtype, device=DEVICE)
    alibi = rand_alibi(c.alibi, len(c.lens_q), c.h)
    return q, k, v, dout, alibi


def varlen_reference(c: VCase, q, k, v, dout, alibi, upcast: bool, s_dmask=None):
    """Per-sequence attention_ref (+ backward): (out (total_q, h, d), lse (h, total_q), dq, dk, dv, and dq's and
    dk's stored_output_bounds) packed. s_dmask (batch, h, max_sq, max_sk): its sign gives the dropout keep mask of
    each sequence."""
    cq, ck = cu(c.lens_q).tolist(), cu(c.lens_k).tolist()
    acc = torch.float64 if upcast else c.dtype
    out = torch.zeros(q.shape, dtype=acc, device=DEVICE)
    lse = torch.full((c.h, q.shape[0]), float("-inf"), dtype=torch.float64, device=DEVICE)
    dq = torch.zeros(q.shape, dtype=acc, device=DEVICE)
    dk = torch.zeros(k.shape, dtype=acc, device=DEVICE)
    dv = torch.zeros(v.shape, dtype=acc, device=DEVICE)
    xq = torch.zeros(q.shape, dtype=torch.float64, device=DEVICE)
    xk = torch.zeros(k.shape, dtype=torch.float64, device=DEVICE)
    for b, (sq, sk) in enumerate(zip(c.lens_q, c.lens_k)):
        if sq == 0:
            continue
        qs, ks, vs = (t[None, a:e].detach() for t, a, e in ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]),
                                                             (v, ck[b], ck[b + 1])))
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b:b + 1])
        keep = None
        if c.dropout_p > 0:
            keep = (s_dmask[b:b + 1, :, :sq, :sk] >= 0)
        o, l_, probs, gq, gk, gv = reference_fwd_bwd(
            qs, ks, vs, dout[None, cq[b]:cq[b + 1]], upcast=upcast, dropout_p=c.dropout_p, dropout_mask=keep,
            causal=c.causal, window_size=c.window, softcap=c.softcap, alibi_slopes=slopes)
        out[cq[b]:cq[b + 1]] = o[0]
        lse[:, cq[b]:cq[b + 1]] = l_[0].double()
        dq[cq[b]:cq[b + 1]] = gq[0]
        dk[ck[b]:ck[b + 1]] = gk[0]
        dv[ck[b]:ck[b + 1]] = gv[0]
        bq, bk = stored_output_bounds(qs, ks, dout[None, cq[b]:cq[b + 1]], o, probs, c.dtype)
        xq[cq[b]:cq[b + 1]], xk[ck[b]:ck[b + 1]] = bq[0], bk[0]
    return out, lse, dq, dk, dv, xq, xk


def check_varlen(c: VCase, q, k, v, dout, alibi, out, lse, grads, s_dmask=None):
    ref = varlen_reference(c, q, k, v, dout, alibi, True, s_dmask)
    std = varlen_reference(c, q, k, v, dout, alibi, False, s_dmask)
    ctx = f"[{c.id}]"
    assert_within_rule("out", out, ref[0], std[0], c.dtype, ctx)
    if lse is not None:
        assert_within_rule("softmax_lse", lse, ref[1], std[1], c.dtype, ctx)
    if grads is not None:
        for name, g, gr, gs, x in zip(("dq", "dk", "dv"), grads, ref[2:5], std[2:5], (ref[5], ref[6], None)):
            assert_within_rule(name, g, gr, gs, c.dtype, ctx, extra=x)


# ---------------------------------------------------------------------------------------------------------
# flash_attn_varlen_func: forward + backward against the per-sequence oracle

VARLEN_CASES = [
    # GQA, a zero-length sequence in the middle, lengths across block edges
    VCase((5, 0, 33, 17), (5, 0, 33, 17), 4, 2, 40, fp16),
    # causal with s_q != s_k per sequence (both ways: rows that see nothing), MQA, zero-length keys only
    VCase((9, 40, 3, 6), (30, 7, 0, 6), 4, 1, 24, fp32, causal=True),
    # sliding window + softcap + per-(batch, head) ALiBi, bf16
    VCase((20, 37), (45, 37), 2, 2, 64, bf16, window=(8, 4), softcap=5.0, alibi="bh"),
    # dropout with causal and GQA (keep mask read off S_dmask)
    VCase((24, 11, 1), (24, 30, 16), 4, 2, 32, fp32, causal=True, dropout_p=0.17),
    # deterministic backward, left-only window, per-head ALiBi
    VCase((1, 50), (70, 50), 2, 1, 40, fp16, window=(16, -1), alibi="h", deterministic=True),
]


if given is not None:
    @sweep(8)
    @given(lens=st.lists(st.tuples(st.integers(0, 45), st.integers(0, 45)), min_size=1, max_size=3),
           hk=st.integers(1, 2), group=st.sampled_from([1, 2]), d=st.sampled_from([8, 24, 40, 64]),
           dtype=st.sampled_from([fp16, bf16, fp32]), causal=st.booleans(), left=st.integers(-1, 30),
           right=st.integers(-1, 30), softcap=st.sampled_from([0.0, 3.0]), alibi=st.sampled_from([None, "h", "bh"]),
           data_seed=st.integers(0, 2 ** 31 - 1))
    def test_varlen_random_configs(lens, hk, group, d, dtype, causal, left, right, softcap, alibi, data_seed):
        """Random packed batches (zero-length sequences included) with random features: forward and gradients
        against the per-sequence float64 oracle (no dropout: test_gradients_random_configs says why)."""
        if not any(a for a, _ in lens) or not any(b for _, b in lens):
            lens = lens + [(3, 4)]   # (a batch of no query or no key at all: its own tests)
        torch.manual_seed(data_seed)
        c = VCase(tuple(a for a, _ in lens), tuple(b for _, b in lens), hk * group, hk, d, dtype, causal=causal,
                  window=(left, right), softcap=softcap, alibi=alibi)
        q, k, v, dout, alibi_t = packed_inputs(c)
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu(c.lens_q), cu(c.lens_k), max(c.lens_q), max(c.lens_k),
                                             causal=causal, window_size=c.window, softcap=softcap,
                                             alibi_slopes=alibi_t, return_attn_probs=True)
        check_varlen(c, q, k, v, dout, alibi_t, out, lse, torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("c", VARLEN_CASES, ids=lambda c: c.id)
def test_varlen_fwd_bwd_matches_per_sequence_reference(c: VCase, seed):
    q, k, v, dout, alibi = packed_inputs(c)
    batch = len(c.lens_q)
    out, lse, s_dmask = flash_attn_varlen_func(
        q, k, v, cu(c.lens_q), cu(c.lens_k), max(c.lens_q), max(c.lens_k), dropout_p=c.dropout_p,
        causal=c.causal, window_size=c.window, softcap=c.softcap, alibi_slopes=alibi,
        deterministic=c.deterministic, return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (c.h, q.shape[0]) and lse.dtype == torch.float32
    assert s_dmask.shape == (batch, c.h, max(c.lens_q), max(c.lens_k))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_varlen(c, q, k, v, dout, alibi, out, lse, grads, s_dmask if c.dropout_p > 0 else None)
    # rows with no visible key (s_k = 0, or causal with s_q > s_k): exact zeros / -inf / zero dq
    start = 0
    for sq, sk in zip(c.lens_q, c.lens_k):
        for i in range(sq):
            diag = i + sk - sq
            lo = 0 if c.window[0] < 0 else diag - c.window[0]
            hi = sk - 1 if (c.window[1] < 0 and not c.causal) else min(sk - 1, diag + (0 if c.causal else c.window[1]))
            if max(lo, 0) > hi:
                assert (out[start + i] == 0).all() and torch.isneginf(lse[:, start + i]).all()
                assert (grads[0][start + i] == 0).all()
        start += sq


SEQUSED_CASES = [
    # (slot lengths q, k), (used q, k): unused rows at a slot's end, a slot used whole, an empty one, GQA
    (VCase((7, 0, 12), (9, 5, 12), 4, 2, 32, fp16, causal=True), (5, 0, 12), (9, 3, 4)),
    # keys only (seqused_k), window + softcap + per-(batch, head) ALiBi, bf16
    (VCase((10, 16), (20, 16), 2, 2, 40, bf16, window=(6, 2), softcap=4.0, alibi="bh"), None, (13, 1)),
    # queries only (seqused_q), MQA, fp32
    (VCase((18, 5), (18, 9), 4, 1, 24, fp32), (18, 2), None),
]


@pytest.mark.parametrize("c,used_q,used_k", SEQUSED_CASES, ids=[c.id for c, _, _ in SEQUSED_CASES])
def test_varlen_seqused_is_the_used_rows_alone(c: VCase, used_q, used_k, seed):
    check_seqused(c, used_q, used_k)


def check_seqused(c: VCase, used_q, used_k):
    """seqused_q / seqused_k (FlashAttention-3's): each slot counts only its first seqused rows. Against the
    per-sequence float64 oracle on the used rows alone (the sequences' lengths, masks and alignment those of the
    used rows); the unused query rows output zeros (lse -inf), and no gradient reaches an unused row."""
    q, k, v, dout, alibi = packed_inputs(c)
    uq, uk = used_q or c.lens_q, used_k or c.lens_k
    out, lse, s_dmask = flash_attn_varlen_func(
        q, k, v, cu(c.lens_q), cu(c.lens_k), max(c.lens_q), max(c.lens_k), causal=c.causal, window_size=c.window,
        softcap=c.softcap, alibi_slopes=alibi, return_attn_probs=True,
        seqused_q=None if used_q is None else _i32(used_q), seqused_k=None if used_k is None else _i32(used_k))
    assert s_dmask.shape == (len(c.lens_q), c.h, max(c.lens_q), max(c.lens_k))
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def rows(lens, used):
        return torch.cat([torch.arange(a, a + n) for a, n in zip(cu(lens)[:-1].tolist(), used)]).to(DEVICE)
    rq, rk = rows(c.lens_q, uq), rows(c.lens_k, uk)
    used = dataclasses.replace(c, lens_q=tuple(uq), lens_k=tuple(uk))
    compact = [t.detach()[r] for t, r in ((q, rq), (k, rk), (v, rk), (dout, rq))]
    check_varlen(used, *compact, alibi, out[rq], lse[:, rq], (grads[0][rq], grads[1][rk], grads[2][rk]))
    unused_q = torch.ones(q.shape[0], dtype=torch.bool, device=DEVICE)
    unused_q[rq] = False
    unused_k = torch.ones(k.shape[0], dtype=torch.bool, device=DEVICE)
    unused_k[rk] = False
    assert (out[unused_q] == 0).all() and torch.isneginf(lse[:, unused_q]).all()
    assert (grads[0][unused_q] == 0).all() and (grads[1][unused_k] == 0).all() and (grads[2][unused_k] == 0).all()


def test_varlen_without_probs_returns_tensor_equal_to_probs_path(seed):
    c = VCase((13, 29), (31, 8), 4, 2, 24, fp16, causal=True, softcap=3.0)
    q, k, v, dout, _ = packed_inputs(c)
    args = (q, k, v, cu(c.lens_q), cu(c.lens_k), 29, 31)
    out = flash_attn_varlen_func(*args, causal=True, softcap=3.0)
    assert isinstance(out, torch.Tensor)
    out2, lse, _ = flash_attn_varlen_func(*args, causal=True, softcap=3.0, return_attn_probs=True)
    assert torch.equal(out, out2)
    check_varlen(c, q, k, v, dout, None, out, lse, None)


def test_varlen_larger_max_seqlen_is_harmless(seed):
    """max_seqlen_* only bounds the grid: an over-estimate gives the same result."""
    c = VCase((10, 21), (15, 21), 2, 2, 32, fp32, causal=True)
    q, k, v, _, _ = packed_inputs(c)
    with torch.no_grad():
        a = flash_attn_varlen_func(q, k, v, cu(c.lens_q), cu(c.lens_k), 21, 21, causal=True)
        b = flash_attn_varlen_func(q, k, v, cu(c.lens_q), cu(c.lens_k), 64, 100, causal=True)
    assert torch.equal(a, b)


def test_varlen_qkvpacked_grads_reach_packed_tensor(seed):
    c = VCase((19, 0, 40), (19, 0, 40), 2, 2, 40, fp16, causal=True)
    qkv = torch.randn(sum(c.lens_q), 3, c.h, c.d, dtype=c.dtype, device=DEVICE, requires_grad=True)
    dout = torch.randn(sum(c.lens_q), c.h, c.d, dtype=c.dtype, device=DEVICE)
    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu(c.lens_q), 40, causal=True, return_attn_probs=True)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    assert dqkv.shape == qkv.shape
    q, k, v = (qkv[:, i].detach() for i in range(3))
    check_varlen(c, q, k, v, dout, None, out, lse, tuple(dqkv.unbind(1)))


def test_varlen_kvpacked_grads_reach_packed_tensor(seed):
    c = VCase((7, 26), (33, 12), 4, 1, 24, fp32, window=(6, 6))
    q = torch.randn(sum(c.lens_q), c.h, c.d, dtype=c.dtype, device=DEVICE, requires_grad=True)
    kv = torch.randn(sum(c.lens_k), 2, c.hk, c.d, dtype=c.dtype, device=DEVICE, requires_grad=True)
    dout = torch.randn(sum(c.lens_q), c.h, c.d, dtype=c.dtype, device=DEVICE)
    out, lse, _ = flash_attn_varlen_kvpacked_func(q, kv, cu(c.lens_q), cu(c.lens_k), 26, 33, window_size=(6, 6),
                                                  return_attn_probs=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    check_varlen(c, q, kv[:, 0].detach(), kv[:, 1].detach(), dout, None, out, lse, (dq, dkv[:, 0], dkv[:, 1]))


# ---------------------------------------------------------------------------------------------------------
# Padding helpers (flash-attn bert_padding semantics) and the padded-dense reference

def test_unpad_input_outputs_and_pad_input_inverse(seed):
    b, s, h = 3, 7, 5
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool,
                        device=DEVICE)
    x = torch.randn(b, s, h, device=DEVICE, requires_grad=True)
    x_unpad, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask)
    assert x_unpad.shape == (10, h)
    assert indices.tolist() == [0, 1, 2] + list(range(14, 21))
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 3, 10]
    assert max_seqlen == 7 and used.tolist() == [3, 0, 7]
    assert torch.equal(x_unpad, x.reshape(-1, h)[mask.flatten()])
    x_pad = pad_input(x_unpad, indices, b, s)
    assert torch.equal(x_pad, torch.where(mask[..., None], x, torch.zeros_like(x)))
    # gradients: d/dx of sum(w * pad(unpad(x))) is w on real tokens, 0 on padding
    w = torch.randn(b, s, h, device=DEVICE)
    (g,) = torch.autograd.grad((x_pad * w).sum(), (x,))
    assert torch.equal(g, torch.where(mask[..., None], w, torch.zeros_like(w)))


def test_unpad_input_unused_mask_counts_tokens_but_not_used_seqlens(seed):
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], device=DEVICE)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 1]], device=DEVICE)
    x = torch.randn(2, 4, 3, device=DEVICE)
    x_unpad, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask, unused)
    assert cu_seqlens.tolist() == [0, 3, 7] and used.tolist() == [2, 1] and max_seqlen == 4
    assert indices.tolist() == [0, 1, 2, 4, 5, 6, 7]


def test_index_first_axis_and_index_put_grads(seed):
    x = torch.randn(6, 2, 3, device=DEVICE, requires_grad=True)
    idx = torch.tensor([4, 0, 5], device=DEVICE)
    y = index_first_axis(x, idx)
    assert torch.equal(y, x[idx])
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, (x,), g)
    expect = torch.zeros_like(x)
    expect[idx] = g
    assert torch.equal(gx, expect)
    vals = torch.randn(3, 2, 3, device=DEVICE, requires_grad=True)
    z = index_put_first_axis(vals, idx, 6)
    assert torch.equal(z[idx], vals) and (z[[1, 2, 3]] == 0).all()
    (gv,) = torch.autograd.grad(z, (vals,), torch.arange(36.0, device=DEVICE).view(6, 2, 3))
    assert torch.equal(gv, torch.arange(36.0, device=DEVICE).view(6, 2, 3)[idx])


def test_padding_helpers_reject_bad_arguments():
    x = torch.randn(2, 4, 3, device=DEVICE)
    with pytest.raises(ERRORS, match="attention_mask"):
        unpad_input(x, torch.ones(2, 5, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ERRORS, match="attention_mask"):
        unpad_input(x, torch.ones(2, 4, device=DEVICE))  # float mask
    with pytest.raises(ERRORS, match="indices"):
        pad_input(x.view(8, 3), torch.arange(7, device=DEVICE), 2, 4)
    with pytest.raises(ERRORS, match="seqlen"):
        pad_input(x.view(8, 3), torch.arange(8, device=DEVICE), 2, -1)


def test_pad_input_takes_any_integer_sizes():
    """flash-attn's pad_input only multiplies batch * seqlen: numpy ints and 0-d integer tensors work there too."""
    import numpy as np
    x = torch.randn(8, 3, device=DEVICE)
    idx = torch.arange(8, device=DEVICE)
    want = x.view(2, 4, 3)
    assert torch.equal(pad_input(x, idx, np.int64(2), np.int32(4)), want)
    assert torch.equal(pad_input(x, idx, torch.tensor(2), torch.tensor(4)), want)
    with pytest.raises(ERRORS, match="batch"):
        pad_input(x, idx, True, 8)
    with pytest.raises(ERRORS, match="seqlen"):
        pad_input(x, idx, 2, 4.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_unpad_varlen_pad_matches_padded_dense(causal, seed):
    """The usual training recipe: right-padded batch -> unpad -> varlen -> pad, against dense attention on the
    padded batch with key/query padding masks (equal q/k lengths per sequence, so causal alignment agrees)."""
    b, s, h, d, dtype = 3, 40, 2, 32, fp16
    lens = [40, 9, 23]
    mask = torch.arange(s, device=DEVICE)[None, :] < torch.tensor(lens, device=DEVICE)[:, None]
    q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device=DEVICE, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, dtype=dtype, device=DEVICE)
    q_u, idx, cu_seqlens, max_s, _ = unpad_input(q, mask)
    k_u, v_u = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu_seqlens, cu_seqlens, max_s, max_s, causal=causal)
    out = pad_input(out_u, idx, b, s)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def dense(upcast):
        qs, ks, vs = ((t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v))
        o, _, _ = attention_ref(qs, ks, vs, causal=causal, key_padding_mask=mask, query_padding_mask=mask,
                                upcast=upcast)
        o.backward(dout.to(o.dtype))
        return o.detach(), qs.grad, ks.grad, vs.grad

    ref, std = dense(True), dense(False)
    m4 = mask[:, :, None, None]
    for name, ours, r, st in zip(("out", "dq", "dk", "dv"), (out, *grads), ref, std):
        # padding rows: exactly 0 in ours (pad_input / the scatter of the gradient)
        assert (ours.masked_select(~m4.expand_as(ours)) == 0).all(), f"{name} nonzero at padding"
        assert_within_rule(name, ours, r.masked_fill(~m4, 0), st.masked_fill(~m4, 0), dtype, f"[causal={causal}]")


# ---------------------------------------------------------------------------------------------------------
# Paged K/V for varlen (block_table): forward only

def paged_from_packed(k_packed, lens_k, page, num_blocks, gen):
    """Scatter packed keys into a shuffled paged cache: (cache (num_blocks, page, hk, d), block_table)."""
    max_blocks = max(-(-n // page) for n in lens_k) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.randn(num_blocks, page, *k_packed.shape[1:], dtype=k_packed.dtype, device=DEVICE)
    table = torch.full((len(lens_k), max_blocks), -1, dtype=torch.int32)  # unused entries: invalid on purpose
    start, nxt = 0, 0
    for b, n in enumerate(lens_k):
        for j in range(-(-n // page)):
            table[b, j] = perm[nxt]
            rows = k_packed[start + j * page: start + min(n, (j + 1) * page)]
            cache[perm[nxt], :rows.shape[0]] = rows
            nxt += 1
        start += n
    return cache, table.to(DEVICE)


@pytest.mark.parametrize("page, dtype", [(16, fp16), (64, bf16)], ids=["page16-fp16", "page64-bf16"])
def test_varlen_paged_forward_matches_reference(page, dtype, seed):
    c = VCase((3, 1, 12), (40, 0, 75), 4, 2, 32, dtype, causal=True, softcap=4.0, alibi="h")
    q, k, v, dout, alibi = packed_inputs(c)
    gen = torch.Generator().manual_seed(seed)
    k_cache, table = paged_from_packed(k.detach(), c.lens_k, page, 12, gen)
    v_cache, _ = paged_from_packed(v.detach(), c.lens_k, page, 12, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k_cache, v_cache, cu(c.lens_q), cu(c.lens_k), 12, 75, causal=True,
                                     softcap=4.0, alibi_slopes=alibi, block_table=table)
    ref = varlen_reference(c, q, k, v, dout, alibi, True)
    std = varlen_reference(c, q, k, v, dout, alibi, False)
    assert_within_rule("out", out, ref[0], std[0], c.dtype, f"[{c.id} page={page}]")


def test_varlen_paged_backward_raises_clear_error(seed):
    lens = (5, 9)
    q = torch.randn(14, 2, 16, dtype=fp16, device=DEVICE, requires_grad=True)
    k_cache = torch.randn(4, 16, 2, 16, dtype=fp16, device=DEVICE)
    table = torch.tensor([[0], [2]], dtype=torch.int32, device=DEVICE)
    out = flash_attn_varlen_func(q, k_cache, k_cache.clone(), cu(lens), cu(lens), 9, 9, block_table=table)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="forward-only"):
        out.sum().backward()
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_varlen_func(q, k_cache, k_cache, cu(lens), cu(lens), 9, 9,
                               block_table=torch.tensor([[0], [4]], dtype=torch.int32, device=DEVICE))


# ---------------------------------------------------------------------------------------------------------
# Malformed cu_seqlens / max_seqlen: refused before any kernel runs, naming the argument

def _word(name):
    return rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])"


def _i32(vals):
    return torch.tensor(vals, dtype=torch.int32, device=DEVICE)


BAD_CU = [
    ("int64", dict(cu_seqlens_q=torch.tensor([0, 3, 8], device=DEVICE)), "cu_seqlens_q.dtype"),
    ("list", dict(cu_seqlens_k=[0, 3, 8]), "cu_seqlens_k"),
    ("2-D", dict(cu_seqlens_q=_i32([[0, 3, 8]])), "cu_seqlens_q.dim()"),
    ("decreasing", dict(cu_seqlens_k=_i32([0, 9, 8])), "cu_seqlens_k"),
    ("length-vs-batch", dict(cu_seqlens_k=_i32([0, 3, 5, 8])), "cu_seqlens_k.shape"),
    ("last-past-total", dict(cu_seqlens_q=_i32([0, 3, 9])), "cu_seqlens_q[-1]"),
    ("not-starting-at-0", dict(cu_seqlens_q=_i32([1, 3, 8])), "cu_seqlens_q[0]"),
    ("only-one-entry", dict(cu_seqlens_q=_i32([0])), "cu_seqlens_q.shape"),
    ("max-too-small", dict(max_seqlen_q=4), "max_seqlen_q"),
    ("max-not-int", dict(max_seqlen_k=5.0), "max_seqlen_k"),
    ("q-4d", dict(q=torch.randn(1, 8, 2, 16, dtype=fp16, device=DEVICE)), "q.dim()"),
    ("seqused-int64", dict(seqused_q=torch.tensor([1, 2], device=DEVICE)), "seqused_q.dtype"),
    ("seqused-shape", dict(seqused_k=_i32([1, 2, 3])), "seqused_k.shape"),
    ("seqused-past-slot", dict(seqused_q=_i32([4, 2])), "seqused_q[0]"),
    ("seqused-negative", dict(seqused_k=_i32([1, -1])), "seqused_k[1]"),
    ("seqused-list", dict(seqused_k=[1, 2]), "seqused_k"),
]


@pytest.mark.parametrize("what,override,name", BAD_CU, ids=[b[0] for b in BAD_CU])
def test_malformed_cu_seqlens_raise_naming_argument(what, override, name, monkeypatch):
    # any kernel launch would be a failure of this test: validation must come first
    from flashtile.kernels.triton import launch
    monkeypatch.setattr(launch, "flash_fwd", lambda *a, **k: pytest.fail("kernel ran on malformed input"))
    args = dict(q=torch.randn(8, 2, 16, dtype=fp16, device=DEVICE), k=torch.randn(8, 2, 16, dtype=fp16, device=DEVICE),
                v=torch.randn(8, 2, 16, dtype=fp16, device=DEVICE), cu_seqlens_q=_i32([0, 3, 8]),
                cu_seqlens_k=_i32([0, 3, 8]), max_seqlen_q=5, max_seqlen_k=5)
    args.update(override)
    with pytest.raises(ERRORS, match=_word(name) if not name.endswith((")", "]")) else re.escape(name)):
        flash_attn_varlen_func(**args)


def test_seqused_modified_in_place_is_checked_again():
    """seqused values are read once per tensor (and cu_seqlens) while unmodified; an in-place change is read again."""
    q = torch.randn(8, 2, 16, dtype=fp16, device=DEVICE)
    cu_, used = _i32([0, 3, 8]), _i32([2, 5])
    flash_attn_varlen_func(q, q, q, cu_, cu_, 5, 5, seqused_q=used)
    used[0] = 4
    with pytest.raises(ValueError, match=re.escape("seqused_q[0]")):
        flash_attn_varlen_func(q, q, q, cu_, cu_, 5, 5, seqused_q=used)


def test_seqused_sequences_derived_once_per_tensors(monkeypatch, seed):
    """The three-per-slot sequences of seqused are derived once for the same tensors (a model's layers), again after
    an in-place change, and the result follows the change: the used rows' output, zeros past them."""
    import flashtile.varlen as fv
    derived = []
    real = fv._used_bounds
    monkeypatch.setattr(fv, "_used_bounds", lambda *a: derived.append(1) or real(*a))
    q = torch.randn(8, 2, 16, dtype=fp16, device=DEVICE)
    cu_, used = _i32([0, 3, 8]), _i32([2, 5])
    for _ in range(3):
        flash_attn_varlen_func(q, q, q, cu_, cu_, 5, 5, seqused_q=used, seqused_k=used)
    assert len(derived) == 2              # (q's and k's bounds, once)
    used[1] = 3
    out = flash_attn_varlen_func(q, q, q, cu_, cu_, 5, 5, seqused_q=used, seqused_k=used)
    assert len(derived) == 4
    assert (out[6:] == 0).all() and (out[3:6] != 0).any()
    alone = flash_attn_varlen_func(q[3:6], q[3:6], q[3:6], _i32([0, 3]), _i32([0, 3]), 3, 3)
    assert torch.equal(out[3:6], alone)


def test_cu_seqlens_on_wrong_device_raises(monkeypatch):
    q = torch.randn(8, 2, 16, dtype=fp16, device=DEVICE)
    other = torch.device("meta")
    bad = torch.empty(3, dtype=torch.int32, device=other)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_k.device")):
        flash_attn_varlen_func(q, q, q, _i32([0, 3, 8]), bad, 5, 5)


def test_varlen_paged_with_probabilities_and_dropout_as_flash_attn_takes_them(seed):
    """flash-attn's paged varlen forward takes dropout and return_attn_probs; flashtile gathers the pages the
    sequences use and runs the varlen kernels on them: the same output and probabilities as the contiguous
    layout (with dropout the same mask, drawn from torch's generator), forward only."""
    c = VCase((3, 1, 12), (40, 0, 75), 4, 2, 32, fp16, causal=True)
    q, k, v, dout, alibi = packed_inputs(c)
    gen = torch.Generator().manual_seed(seed)
    k_cache, table = paged_from_packed(k.detach(), c.lens_k, 16, 12, gen)
    v_cache, _ = paged_from_packed(v.detach(), c.lens_k, 16, 12, torch.Generator().manual_seed(seed))
    args = (cu(c.lens_q), cu(c.lens_k), 12, 75)
    for dropout_p in (0.0, 0.2):
        torch.manual_seed(seed)
        paged = flash_attn_varlen_func(q, k_cache, v_cache, *args, dropout_p=dropout_p, causal=True,
                                       return_attn_probs=True, block_table=table)
        torch.manual_seed(seed)
        with torch.no_grad():
            dense = flash_attn_varlen_func(q, k, v, *args, dropout_p=dropout_p, causal=True, return_attn_probs=True)
        for a, b in zip(paged, dense):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="forward-only"):
        paged[0].float().sum().backward()
