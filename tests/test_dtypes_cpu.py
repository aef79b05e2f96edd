"""Every public entry point in float32, float16 and bfloat16 on the CPU (Triton interpreter): forward and, where
there is a backward, gradients, against the float64 oracle under the flash-attn tolerance rule (attn_utils).

The interpreter gets bf16 wrong: tl.dot multiplies the operands' raw 16-bit patterns (numpy has no bfloat16), and
fp32 -> bf16 conversions drop the low bits instead of rounding to nearest. The kernels route every product through
mods.mma and every conversion between fp32 and a 16-bit float through mods.to_dtype, which work around both under
the interpreter only; this file pins that each entry point then gets bf16 right, with fp32 and fp16 checked the
same way beside it. One small problem per entry point and dtype (the interpreter is slow); the feature matrices
live in the per-feature files, whose harnesses are reused here (kvcache_utils.run_case, test_varlen.check_varlen,
flex_utils.run_and_check). bf16 elsewhere on the CPU: ring attention (tests/test_ring.py), the benchmark runner's
check (tests/bench/test_bench.py), a bf16 training run against eager (tests/test_examples.py).
"""
import pytest
import torch

import flashtile
import flashtile.fp8 as fp8_mod
from attn_utils import (DEVICE, Case, assert_within_rule, case_inputs, check_against_reference, flash_kwargs,
                        keep_mask_from_s_dmask, rand_tensor)
from flashtile.blocksparse import blocksparse_attn_func, create_block_mask
from flashtile.flex import MaskMod, ScoreMod, alibi_score, causal_mask
from flashtile.fp8 import flash_attn_fp8_func, fp8_config, quantize_fp8
from flashtile.reference import fp8_emulation as E
from flashtile.reference.dense import attention_ref
from flashtile.varlen import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                              flash_attn_varlen_qkvpacked_func)
from flex_utils import (keep_period_mask, run_and_check, sig_key_bias, sig_key_bias_dcaptured, sig_key_bias_grad,
                        t_alibi, t_causal, t_keep_period, t_sig_key_bias)
from kvcache_utils import KCase, run_case
from test_varlen import VCase, check_varlen, cu, packed_inputs, paged_from_packed, varlen_reference

fp16, fp32, bf16 = torch.float16, torch.float32, torch.bfloat16
DTYPES = pytest.mark.parametrize("dtype", [fp32, fp16, bf16], ids=["fp32", "fp16", "bf16"])


# ---------------------------------------------------------------------------------------------------------
# flash_attn_func and its packed variants

DENSE = [
    # causal, MQA, softcap, per-(batch, head) ALiBi, s_q < s_k
    dict(b=1, sq=40, sk=56, h=2, hk=1, d=32, causal=True, softcap=5.0, alibi="bh"),
    # two-sided window, dropout, GQA, odd head dim, deterministic backward
    dict(b=1, sq=33, sk=47, h=4, hk=2, d=40, window=(8, 3), dropout_p=0.17, deterministic=True),
]


@DTYPES
@pytest.mark.parametrize("kw", DENSE, ids=["causal-mqa-softcap-alibi", "window-dropout-gqa"])
def test_flash_attn_func(dtype, kw, seed):
    c = Case(dtype=dtype, **kw)
    q, k, v, dout, alibi = case_inputs(c)
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, **flash_kwargs(c, alibi, return_attn_probs=True))
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = keep_mask_from_s_dmask(s_dmask) if c.dropout_p > 0 else None
    check_against_reference(c, q, k, v, dout, alibi, out, lse, s_dmask, grads, dropout_mask=keep)


@DTYPES
def test_qkvpacked(dtype, seed):
    c = Case(1, 40, 40, 2, 2, 32, dtype, causal=True)
    qkv = torch.randn(c.b, c.sq, 3, c.h, c.d, dtype=dtype, device=DEVICE, requires_grad=True)
    dout = torch.randn(c.b, c.sq, c.h, c.d, dtype=dtype, device=DEVICE)
    out, lse, _ = flashtile.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    q, k, v = (qkv[:, :, i].detach() for i in range(3))
    check_against_reference(c, q, k, v, dout, None, out, lse, None, tuple(dqkv.unbind(2)))


@DTYPES
def test_kvpacked(dtype, seed):
    c = Case(1, 24, 40, 4, 2, 32, dtype, window=(6, 2))
    q = rand_tensor((c.b, c.sq, c.h, c.d), dtype, requires_grad=True)
    kv = torch.randn(c.b, c.sk, 2, c.hk, c.d, dtype=dtype, device=DEVICE, requires_grad=True)
    dout = torch.randn(c.b, c.sq, c.h, c.d, dtype=dtype, device=DEVICE)
    out, lse, _ = flashtile.flash_attn_kvpacked_func(q, kv, window_size=c.window, return_attn_probs=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    check_against_reference(c, q, kv[:, :, 0].detach(), kv[:, :, 1].detach(), dout, None, out, lse, None,
                            (dq, dkv[:, :, 0], dkv[:, :, 1]))


# ---------------------------------------------------------------------------------------------------------
# Variable-length batches: varlen, its packed variants, the paged (block_table) forward

@DTYPES
def test_varlen(dtype, seed):
    c = VCase((5, 0, 33), (12, 0, 33), 2, 1, 32, dtype, causal=True, alibi="h")
    q, k, v, dout, alibi = packed_inputs(c)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu(c.lens_q), cu(c.lens_k), 33, 33, causal=True,
                                         alibi_slopes=alibi, return_attn_probs=True)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_varlen(c, q, k, v, dout, alibi, out, lse, grads)


@DTYPES
def test_varlen_packed_variants(dtype, seed):
    c = VCase((9, 20), (9, 20), 2, 2, 16, dtype, causal=True)
    qkv = torch.randn(sum(c.lens_q), 3, c.h, c.d, dtype=dtype, device=DEVICE, requires_grad=True)
    dout = torch.randn(sum(c.lens_q), c.h, c.d, dtype=dtype, device=DEVICE)
    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu(c.lens_q), 20, causal=True, return_attn_probs=True)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    check_varlen(c, *(qkv[:, i].detach() for i in range(3)), dout, None, out, lse, tuple(dqkv.unbind(1)))

    c = VCase((7, 16), (21, 12), 2, 1, 24, dtype, window=(6, 6))
    q = torch.randn(sum(c.lens_q), c.h, c.d, dtype=dtype, device=DEVICE, requires_grad=True)
    kv = torch.randn(sum(c.lens_k), 2, c.hk, c.d, dtype=dtype, device=DEVICE, requires_grad=True)
    dout = torch.randn(sum(c.lens_q), c.h, c.d, dtype=dtype, device=DEVICE)
    out, lse, _ = flash_attn_varlen_kvpacked_func(q, kv, cu(c.lens_q), cu(c.lens_k), 16, 21, window_size=(6, 6),
                                                  return_attn_probs=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    check_varlen(c, q, kv[:, 0].detach(), kv[:, 1].detach(), dout, None, out, lse, (dq, dkv[:, 0], dkv[:, 1]))


@DTYPES
def test_varlen_paged_forward(dtype, seed):
    c = VCase((3, 12), (40, 45), 4, 2, 32, dtype, causal=True, softcap=4.0)
    q, k, v, dout, _ = packed_inputs(c)
    k_cache, table = paged_from_packed(k.detach(), c.lens_k, 16, 8, torch.Generator().manual_seed(seed))
    v_cache, _ = paged_from_packed(v.detach(), c.lens_k, 16, 8, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k_cache, v_cache, cu(c.lens_q), cu(c.lens_k), 12, 45, causal=True,
                                     softcap=4.0, block_table=table)
    ref = varlen_reference(c, q, k, v, dout, None, True)
    std = varlen_reference(c, q, k, v, dout, None, False)
    assert_within_rule("out", out, ref[0], std[0], dtype, f"[{c.id} page=16]")


# ---------------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: append + rotary + split-KV on a contiguous cache, and a paged cache

KV = [
    dict(b=2, sq=2, h=4, hk=2, d=32, capacity=70, seqlen_new=2, causal=True, rotary_dim=16, num_splits=3),
    dict(b=2, sq=1, h=4, hk=2, d=32, capacity=80, seqlen_new=1, rotary_dim=32, interleaved=False, page=16,
         num_splits=2),
]


@DTYPES
@pytest.mark.parametrize("kw", KV, ids=["append-rotary-splits", "paged-rotary-splits"])
def test_kvcache(dtype, kw, seed):
    out, _ = run_case(KCase(dtype=dtype, **kw), seed)
    assert out.dtype == dtype


# ---------------------------------------------------------------------------------------------------------
# flashtile.flex: user mods, captured-tensor gradients

@DTYPES
def test_flex_custom_mods_with_captured_grad(dtype, seed):
    b, sq, sk, h, hk = 1, 24, 40, 2, 1
    q, k, v, dout = (torch.randn(b, s, n, 32, dtype=dtype, device=DEVICE, requires_grad=g)
                     for s, n, g in ((sq, h, True), (sk, hk, True), (sk, hk, True), (sq, h, False)))
    keep = (torch.rand(b, sk, device=DEVICE) > 0.25).to(torch.int32)
    keep[:, 0] = 1
    kb = torch.randn(h, sk, device=DEVICE, requires_grad=True)
    score = ScoreMod(sig_key_bias, grad_fn=sig_key_bias_grad, captured_grad_fn=sig_key_bias_dcaptured,
                     captured=(kb, sk, 0.75))
    run_and_check(q, k, v, dout, dtype, "[custom mask + custom score]", score_mod=score,
                  mask_mod=MaskMod(keep_period_mask, captured=(keep, sk, 3)), score_fn=t_sig_key_bias(0.75),
                  mask_fn=t_keep_period(keep, 3), captured=(kb,))


@DTYPES
def test_flex_alibi_slope_grads_with_causal_mask(dtype, seed):
    q, k, v, dout = (torch.randn(1, 32, n, 32, dtype=dtype, device=DEVICE, requires_grad=g)
                     for n, g in ((4, True), (2, True), (2, True), (4, False)))
    slopes = (torch.rand(4, device=DEVICE) * 0.5 + 2.0 ** -8).requires_grad_()
    run_and_check(q, k, v, dout, dtype, "[alibi_score, causal_mask]", score_mod=alibi_score(slopes),
                  mask_mod=causal_mask(), score_fn=t_alibi, mask_fn=t_causal(), captured=(slopes,))


# ---------------------------------------------------------------------------------------------------------
# attn_bias (with its gradient) and attn_mask; block-sparse attention

def _dense_mask_check(q, k, v, dout, dtype, ctx, run, bias=None, mask=None, **ref_kw):
    """run() -> (out, lse, grads of (q, k, v[, bias])) against attention_ref with the same bias / mask."""
    out, lse, grads = run()
    leaves = [q, k, v] + ([bias] if bias is not None and bias.requires_grad else [])
    res = {}
    for upcast in (True, False):
        cast = (lambda t: t.detach().double()) if upcast else (lambda t: t.detach().clone())
        r_leaves = [cast(t).requires_grad_() for t in leaves]
        r_bias = r_leaves[3] if len(r_leaves) > 3 else bias
        r_out, r_lse, _ = attention_ref(*r_leaves[:3], attn_bias=r_bias, attn_mask=mask, upcast=upcast, **ref_kw)
        res[upcast] = (r_out, r_lse, *torch.autograd.grad(r_out, r_leaves, dout.to(r_out.dtype)))
    for name, ours, r64, std in zip(("out", "softmax_lse", "dq", "dk", "dv", "dbias"), (out, lse, *grads), res[True],
                                    res[False]):
        assert_within_rule(name, ours, r64, std, dtype, ctx)


@DTYPES
def test_attn_bias_and_mask(dtype, seed):
    b, sq, sk, h, hk = 2, 24, 40, 2, 1
    q, k, v, dout = (torch.randn(b, s, n, 32, dtype=dtype, device=DEVICE, requires_grad=g)
                     for s, n, g in ((sq, h, True), (sk, hk, True), (sk, hk, True), (sq, h, False)))
    bias = torch.randn(1, h, sq, sk, dtype=dtype, device=DEVICE, requires_grad=True)   # dbias summed over batch
    mask = torch.rand(b, 1, sq, sk, device=DEVICE) > 0.3
    mask[:, :, 5] = False                                                               # a row that sees nothing

    def run():
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, attn_bias=bias, attn_mask=mask,
                                                return_attn_probs=True)
        return out, lse, torch.autograd.grad(out, (q, k, v, bias), dout)
    _dense_mask_check(q, k, v, dout, dtype, "[bias + mask, causal]", run, bias=bias, mask=mask, causal=True)


@DTYPES
def test_blocksparse(dtype, seed):
    s = 44                                    # ragged last block; documents not aligned to blocks
    doc = torch.tensor([0] * 13 + [1] * 19 + [2] * 12, device=DEVICE)
    bm = create_block_mask(lambda b, h, qi, ki: doc[qi] == doc[ki], None, None, s, s, BLOCK_SIZE=16, device=DEVICE)
    assert bm.density() < 1.0
    q, k, v, dout = (torch.randn(1, s, n, 32, dtype=dtype, device=DEVICE, requires_grad=g)
                     for n, g in ((2, True), (1, True), (1, True), (2, False)))

    def run():
        out, lse, _ = blocksparse_attn_func(q, k, v, bm, causal=True, return_attn_probs=True)
        return out, lse, torch.autograd.grad(out, (q, k, v), dout)
    _dense_mask_check(q, k, v, dout, dtype, "[document block mask, causal]", run, mask=bm.to_dense(), causal=True)


# ---------------------------------------------------------------------------------------------------------
# FP8 (forward only): the quantizer with H on the tensor cores, and the whole path from fp16 / bf16 inputs

@pytest.mark.parametrize("dtype", [fp16, bf16], ids=["fp16", "bf16"])
def test_fp8_quantizer_rotation_by_product(dtype, seed, monkeypatch):
    """The quantizer's incoherent rotation as one product with the +-1 matrix, from the input dtype: the same
    e4m3 values as the emulation up to the fp32 summation order (one e4m3 step, rarely)."""
    monkeypatch.setattr(fp8_mod, "FWHT_MMA", True)
    q, k, v = (E.outlier_inputs((1, 45, 2, 32)).to(dtype) for _ in range(3))
    t = quantize_fp8(q, k, v, block_quant=True, incoherent=True, hadamard_seed=seed % 1000)
    want = E.quantize(E.incoherent_transform(q, E.hadamard_signs(32, seed % 1000)), fp8_config(32).BLOCK_M)
    got = t.q.float()
    assert torch.allclose(t.q_scale, want.descale, rtol=2 ** -22, atol=0)
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(got.abs(), want.x8.abs()).clamp_min(2 ** -6))) - 3)
    assert torch.all((got - want.x8).abs() <= step)
    assert (got != want.x8).float().mean() <= 0.01


@DTYPES
def test_fp8_attention(dtype, seed):
    """Output in the input dtype, against the emulation (same quantized operands) and the float64 oracle. fp32
    inputs are refused by name: FP8 takes 16-bit inputs (or e4m3 with descales)."""
    q, k, v = (torch.randn(1, n, hh, 32).to(dtype) for n, hh in ((40, 4), (51, 2), (51, 2)))
    if dtype == fp32:
        with pytest.raises(TypeError, match="q.dtype"):
            flash_attn_fp8_func(q, k, v)
        return
    out, lse = flash_attn_fp8_func(q, k, v, causal=True, hadamard_seed=3, return_lse=True)
    assert out.dtype == dtype
    cfg = fp8_config(32, True)
    eo, el = E.flash_attn_fp8_emulated(q, k, v, causal=True, hadamard_seed=3, block_m=cfg.BLOCK_M,
                                       block_n=cfg.BLOCK_N)
    # same quantized operands: fp32 summation order, a rare P rounding tie and the output's own rounding differ
    ulp = torch.finfo(dtype).eps * eo.abs().clamp_min(1.0)
    assert torch.all((out.float() - eo).abs() <= 2e-2 + ulp)
    assert torch.allclose(lse, el, atol=1e-4, rtol=1e-5)
    ref = attention_ref(q, k, v, causal=True)[0]
    assert (out.double() - ref).pow(2).mean().sqrt() < 0.03
