"""attn_bias (additive, with gradients) and attn_mask (bool, SDPA convention) through flash_attn_func.

Every numeric check is the flash-attn tolerance rule against the float64 reference (attn_utils), the bias
gradient included: dBias of a broadcast bias is the gradient summed over its broadcast dimensions, exactly
what autograd of the float64 reference gives for the same (unexpanded) bias tensor.
"""
import pytest
import torch

import flashtile
from attn_utils import (DEVICE, assert_within_rule, given, inputs, rand_alibi, st, stored_output_bias_bound,
                        stored_output_bounds, sweep)
from flashtile.interface import dense_attention
from flashtile.reference.dense import attention_ref

fp16, fp32, bf16 = torch.float16, torch.float32, torch.bfloat16


def _run_and_check(q, k, v, dout, dtype, *, bias=None, mask=None, ctx="", probs=True, **kw):
    """ours vs ref64 vs std for out, lse, dq, dk, dv and (when bias requires grad) dbias. Returns ours. probs=False:
    the call without return_attn_probs (interface.dense_attention, which returns the LSE without it)."""
    leaves = [q, k, v] + ([bias] if bias is not None and bias.requires_grad else [])
    if probs:
        out, lse, _ = flashtile.flash_attn_func(q, k, v, attn_bias=bias, attn_mask=mask, return_attn_probs=True,
                                                **kw)
    else:
        out, lse, _ = dense_attention(q, k, v, attn_bias=bias, attn_mask=mask, **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_kw = {key: kw[key] for key in ("causal", "softcap", "alibi_slopes", "window_size", "softmax_scale")
              if key in kw}
    results = {}
    for upcast in (True, False):
        cast = (lambda t: t.detach().double()) if upcast else (lambda t: t.detach().clone())
        r_leaves = [cast(t).requires_grad_() for t in leaves]
        r_out, r_lse, r_probs = attention_ref(*r_leaves[:3], attn_bias=r_leaves[3] if len(r_leaves) > 3 else bias,
                                              attn_mask=mask, upcast=upcast, **ref_kw)
        r_grads = torch.autograd.grad(r_out, r_leaves, dout.to(r_out.dtype))
        results[upcast] = (r_out, r_lse, *r_grads)
        if upcast:   # (the error FA2's backward adds by taking D from the stored output: attn_utils)
            out64, probs64 = r_out, r_probs.detach()
    extras = [None, None, *stored_output_bounds(q, k, dout, out64, probs64, dtype, kw.get("softmax_scale")), None]
    if len(leaves) > 3:
        extras.append(stored_output_bias_bound(dout, out64, probs64, dtype, bias.shape))
    names = ["out", "softmax_lse", "dq", "dk", "dv", "dbias"]
    for name, ours, ref, std, extra in zip(names, (out, lse, *grads), results[True], results[False], extras):
        assert_within_rule(name, ours, ref, std, dtype, ctx, extra=extra)
    return out, lse, grads


B, SQ, SK, H, HK, D = 2, 40, 56, 4, 2, 32
BIAS_SHAPES = {
    "1-1-sq-sk": (1, 1, SQ, SK),
    "b-1-1-sk": (B, 1, 1, SK),
    "b-h-sq-sk": (B, H, SQ, SK),
    "1-h-sq-sk": (1, H, SQ, SK),
    "sq-sk (3 leading dims broadcast)": (SQ, SK),
}


@pytest.mark.parametrize("dtype", [fp16, fp32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape_id", list(BIAS_SHAPES))
def test_bias_each_broadcast_shape_and_reduced_dbias(shape_id, dtype, seed):
    q, k, v, dout = inputs(B, SQ, SK, H, HK, D, dtype)
    bias = torch.randn(BIAS_SHAPES[shape_id], dtype=dtype, device=DEVICE, requires_grad=True)
    _, _, grads = _run_and_check(q, k, v, dout, dtype, bias=bias, ctx=f"[bias {shape_id}]")
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype


def test_bf16_bias_with_causal_gqa_softcap_alibi(seed):
    dtype = bf16
    q, k, v, dout = inputs(B, 48, 33, 6, 2, 40, dtype)   # ragged tiles, headdim not a power of two
    bias = (3.0 * torch.randn(B, 1, 48, 33, dtype=dtype, device=DEVICE)).requires_grad_()
    alibi = rand_alibi("bh", B, 6)
    _run_and_check(q, k, v, dout, dtype, bias=bias, causal=True, softcap=4.0, alibi_slopes=alibi,
                   ctx="[bias causal gqa softcap alibi]")


def test_fp32_bias_with_fp16_inputs_and_window(seed):
    q, k, v, dout = inputs(1, 37, 37, 2, 1, 32, fp16)
    bias = torch.randn(1, 2, 37, 37, dtype=fp32, device=DEVICE, requires_grad=True)
    _, _, grads = _run_and_check(q, k, v, dout, fp16, bias=bias, window_size=(8, 3), ctx="[fp32 bias window]")
    assert grads[3].dtype == fp32


if given is not None:
    @sweep(8)
    @given(b=st.integers(1, 2), sq=st.integers(1, 48), sk=st.integers(1, 48), hk=st.integers(1, 2),
           group=st.sampled_from([1, 2]), d=st.sampled_from([16, 24, 32]), dtype=st.sampled_from([fp16, bf16, fp32]),
           bias_dims=st.one_of(st.none(), st.tuples(*[st.booleans()] * 4)), bias_f32=st.booleans(),
           bias_grad=st.booleans(), mask_dims=st.one_of(st.none(), st.tuples(*[st.booleans()] * 4)),
           causal=st.booleans(), left=st.integers(-1, 30), right=st.integers(-1, 30),
           softcap=st.sampled_from([0.0, 4.0]), alibi=st.sampled_from([None, "h"]),
           data_seed=st.integers(0, 2 ** 31 - 1))
    def test_bias_and_mask_random_configs(b, sq, sk, hk, group, d, dtype, bias_dims, bias_f32, bias_grad, mask_dims,
                                          causal, left, right, softcap, alibi, data_seed):
        """Random attn_bias (each of batch, heads, rows, columns full or broadcast; q's dtype or float32; with or
        without a gradient) and bool attn_mask (likewise broadcast; rows may see no key) combined with causal,
        windows, softcap, ALiBi and GQA: out, lse and every gradient, dBias included, against float64."""
        torch.manual_seed(data_seed)
        h = hk * group
        q, k, v, dout = inputs(b, sq, sk, h, hk, d, dtype)
        full = (b, h, sq, sk)
        bias = mask = None
        if bias_dims is not None:
            shape = tuple(n if keep else 1 for n, keep in zip(full, bias_dims))
            bias = torch.randn(shape, dtype=fp32 if bias_f32 else dtype, device=DEVICE, requires_grad=bias_grad)
        if mask_dims is not None:
            mask = torch.rand(tuple(n if keep else 1 for n, keep in zip(full, mask_dims)), device=DEVICE) < 0.7
        _run_and_check(q, k, v, dout, dtype, bias=bias, mask=mask, causal=causal, window_size=(left, right),
                       softcap=softcap, alibi_slopes=rand_alibi(alibi, b, h), probs=False)


def test_bias_without_grad_gets_none_and_same_dq(seed):
    q, k, v, dout = inputs(1, 32, 48, 2, 2, 32, fp32)
    bias = torch.randn(1, 1, 32, 48, device=DEVICE)            # requires_grad=False: dBias never computed
    _run_and_check(q, k, v, dout, fp32, bias=bias, ctx="[bias no grad]")
    out = flashtile.flash_attn_func(q, k, v, attn_bias=bias)
    out.backward(dout)
    assert bias.grad is None


def test_minus_inf_bias_acts_as_mask(seed):
    """An additive -inf bias (a common way to mask) gives the masked result, with finite gradients."""
    q, k, v, dout = inputs(2, 32, 40, 2, 1, 32, fp32)
    keep = torch.rand(2, 1, 32, 40, device=DEVICE) > 0.4
    keep[:, :, 5] = False                                        # one row fully masked
    bias = torch.zeros(2, 1, 32, 40, device=DEVICE).masked_fill(~keep, float("-inf"))
    out_b = flashtile.flash_attn_func(q, k, v, attn_bias=bias)
    out_m, _, _ = _run_and_check(q, k, v, dout, fp32, mask=keep, ctx="[bool mask]")
    torch.testing.assert_close(out_b, out_m, rtol=1e-5, atol=1e-5)
    assert torch.all(out_b[:, 5] == 0)


@pytest.mark.parametrize("dtype", [fp16, fp32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("mask_shape", [(B, 1, SQ, SK), (1, H, SQ, SK), (SQ, SK), (B, H, 1, SK)])
def test_bool_mask_with_causal_and_empty_rows(mask_shape, dtype, seed):
    q, k, v, dout = inputs(B, SQ, SK, H, HK, D, dtype)
    mask = torch.rand(mask_shape, device=DEVICE) > 0.3
    if mask.shape[-2] > 1:
        mask[..., 7, :] = False                                   # a fully masked row
    out, lse, grads = _run_and_check(q, k, v, dout, dtype, mask=mask, causal=True, ctx=f"[mask {mask_shape}]")
    if mask.shape[-2] > 1:
        assert torch.all(out[:, 7] == 0), "a fully masked row must output zeros"
        assert torch.all(lse[:, :, 7] == float("-inf")), "a fully masked row has lse = -inf"
    for g in grads:
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("dtype,mask_shape,causal", [(fp16, (B, 1, 1, SK), True), (bf16, (1, H, 1, SK), False),
                                                     (fp32, (B, H, 1, SK), True)], ids=["fp16", "bf16", "fp32"])
def test_masked_decode_step_runs_the_decode_kernel(dtype, mask_shape, causal, seed, monkeypatch):
    """One query per row under an attn_mask (a static cache's decode step: transformers' mask over the cache's slots)
    takes the split-KV decode kernel with the mask applied per element (dispatch._decode_step), GQA rows included;
    a (batch, head) row that sees no key outputs zeros with lse = -inf; out, lse and the gradients (the backward
    reading the decode kernel's lse) within the float64 rule."""
    from flashtile.kernels import dispatch
    calls = []
    real = dispatch.flash_decode
    monkeypatch.setattr(dispatch, "flash_decode",
                        lambda *a, **kw: calls.append(kw["mask"] is not None) or real(*a, **kw))
    q, k, v, dout = inputs(B, 1, SK, H, HK, D, dtype)
    mask = torch.rand(mask_shape, device=DEVICE) > 0.4
    mask[0, 0] = False                                        # batch 0 (or every batch), head 0 (or all): no key
    out, lse, _ = _run_and_check(q, k, v, dout, dtype, mask=mask, causal=causal, ctx=f"[mask {mask_shape}]",
                                 probs=False)
    assert calls == [True]
    empty = mask.expand(B, H, 1, SK).any(-1).logical_not()[:, :, 0]   # (batch, head) rows without keys
    assert empty.any()
    assert torch.all(out.transpose(1, 2)[:, :, 0][empty] == 0)
    assert torch.all(lse[:, :, 0][empty] == float("-inf"))


def test_mask_and_bias_together_packed_entry_point(seed):
    qkv = torch.randn(1, 40, 3, 2, 32, device=DEVICE, requires_grad=True)
    bias = torch.randn(1, 2, 40, 40, device=DEVICE, requires_grad=True)
    mask = torch.rand(1, 1, 40, 40, device=DEVICE) > 0.5
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True, attn_bias=bias, attn_mask=mask)
    dqkv, dbias = torch.autograd.grad(out.sum(), (qkv, bias))
    qd, kd, vd = (qkv[:, :, i].detach().double().requires_grad_() for i in range(3))
    bd = bias.detach().double().requires_grad_()
    ref, _, _ = attention_ref(qd, kd, vd, causal=True, attn_bias=bd, attn_mask=mask)
    gq, gk, gv, gb = torch.autograd.grad(ref.sum(), (qd, kd, vd, bd))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dqkv.double(), torch.stack([gq, gk, gv], 2), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dbias.double(), gb, rtol=1e-4, atol=1e-4)


def test_compiled_bias_and_mask_fullgraph(seed):
    torch._dynamo.reset()
    q, k, v, dout = inputs(1, 32, 32, 2, 1, 24, fp32)
    bias = torch.randn(1, 2, 32, 32, device=DEVICE, requires_grad=True)
    mask = torch.rand(1, 1, 32, 32, device=DEVICE) > 0.3

    def fn(q, k, v, bias, mask):
        return flashtile.flash_attn_func(q, k, v, causal=True, attn_bias=bias, attn_mask=mask) * 2.0

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out_c = compiled(q, k, v, bias, mask)
    g_c = torch.autograd.grad(out_c, (q, k, v, bias), dout)
    out_e = fn(q, k, v, bias, mask)
    g_e = torch.autograd.grad(out_e, (q, k, v, bias), dout)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    for a, b_ in zip(g_c, g_e):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("kwargs, exc, needle", [
    (dict(attn_bias=torch.zeros(2, 4, 40, 55)), ValueError, "attn_bias.shape"),
    (dict(attn_bias=torch.zeros(3, 1, 1, 56)), ValueError, "attn_bias.shape"),
    (dict(attn_bias=torch.zeros(1, 1, 1, 2, 40, 56)), ValueError, "attn_bias.shape"),
    (dict(attn_bias=torch.zeros(40, 56, dtype=torch.int32)), TypeError, "attn_bias.dtype"),
    (dict(attn_bias=[[0.0]]), TypeError, "attn_bias"),
    (dict(attn_mask=torch.zeros(40, 56)), TypeError, "attn_mask.dtype"),
    (dict(attn_mask=torch.zeros(2, 3, 40, 56, dtype=torch.bool)), ValueError, "attn_mask.shape"),
])
def test_bad_bias_or_mask_is_refused(kwargs, exc, needle):
    q, k, v, _ = inputs(2, 40, 56, 4, 2, 32, fp32)
    with pytest.raises(exc, match=needle.replace(".", r"\.")):
        flashtile.flash_attn_func(q, k, v, **kwargs)
