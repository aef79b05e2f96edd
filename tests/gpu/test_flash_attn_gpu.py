"""FlashAttention-2 (Triton) on a CUDA GPU at realistic sizes: the CPU feature matrix, scaled up, plus bf16.

Run with ``pytest tests/gpu`` on an H100/H200 (skipped without CUDA). Sizes go up to seqlen 8k, head dims
64/128/256 and the odd ones (40, 80, 96, 112, 160, 192, 224), GQA 8:1. The float64 oracle materialises the
(b, h, s_q, s_k) score matrix, so each case keeps b * h * s_q * s_k <= ~2^28 (a few GiB in float64).
Budget: a few minutes of GPU time, most of it Triton compilation.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA-only tests", allow_module_level=True)

import flashtile  # noqa: E402
from flashtile.kernels.triton import configs  # noqa: E402
from attn_utils import (Case, binomial_5sigma, case_inputs, check_against_reference, empty_rows,  # noqa: E402
                        flash_kwargs, keep_mask_from_s_dmask, visible)

fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32


GPU_MATRIX = [
    # the common head dims, both half dtypes
    Case(2, 1024, 1024, 8, 8, 64, bf16),
    Case(2, 1024, 1024, 8, 8, 128, fp16, causal=True),
    Case(1, 2048, 2048, 4, 4, 256, bf16, causal=True),
    Case(1, 2048, 2048, 4, 4, 256, fp16, window=(300, 40)),
    # long sequence
    Case(1, 8192, 8192, 2, 2, 128, bf16, causal=True),
    Case(1, 8192, 8192, 2, 1, 64, fp16, window=(1024, 0)),
    # decode against a long cache, GQA 8:1
    Case(2, 1, 8192, 16, 2, 128, bf16),
    Case(2, 1, 8192, 16, 2, 128, fp16, causal=True, alibi="h"),
    # GQA 8:1 prefill
    Case(1, 2048, 2048, 16, 2, 128, bf16, causal=True),
    Case(1, 2048, 2048, 16, 2, 128, fp16, causal=True, softcap=15.0, dropout_p=0.17, deterministic=True),
    # s_q > s_k causal (empty rows), s_q < s_k, MQA, odd lengths and head dims
    Case(1, 4096, 1000, 4, 4, 64, fp16, causal=True),
    Case(2, 1000, 1523, 8, 1, 80, bf16, deterministic=True),
    Case(2, 777, 1024, 4, 4, 40, fp16, window=(128, 64)),
    Case(1, 1024, 777, 4, 2, 96, bf16, causal=True, softcap=30.0),
    Case(2, 1500, 1500, 4, 4, 112, fp16, alibi="bh", layout="transposed"),
    Case(1, 2048, 2048, 4, 1, 160, bf16, window=(256, 0), alibi="h", layout="padded"),
    Case(1, 1024, 2048, 4, 2, 192, fp16, causal=True, dropout_p=0.17),
    Case(1, 999, 999, 2, 2, 224, bf16, softcap=20.0, dropout_p=0.17, layout="sliced"),
    Case(1, 4096, 4096, 8, 1, 128, bf16, window=(512, 512), dropout_p=0.17),
    # float32 inputs (full-precision dot products expected, not TF32)
    Case(2, 1024, 1024, 4, 4, 64, fp32, causal=True, layout="transposed"),
    Case(1, 1000, 1300, 4, 2, 128, fp32, softcap=10.0, alibi="bh", dropout_p=0.17),
    # many batches and heads
    Case(8, 512, 512, 16, 4, 64, bf16, causal=True),
    # d256's backward tiles (bwd_config: the dV launch on 128-key tiles, the dQ pass on 32-key blocks in full
    # attention): lengths that end mid-tile, GQA
    Case(2, 1000, 1500, 8, 2, 256, bf16),
    Case(1, 1999, 1999, 4, 1, 256, fp16, causal=True),
]


ATOMIC_MATRIX = [
    # ragged lengths: a query tile reaches into the next batch element's rows of the 2-D TMA view
    (Case(2, 1000, 1000, 8, 2, 128, bf16, causal=True), configs.Config(64, 128, 8, 2, atomic_dq=True)),
    (Case(2, 1024, 1500, 8, 8, 64, fp16, softcap=20.0, dropout_p=0.17), configs.Config(32, 128, 8, 2, atomic_dq=True)),
    (Case(1, 1999, 1999, 4, 4, 256, bf16, window=(300, 0), alibi="h"),
     configs.Config(64, 64, 4, 2, atomic_dq=True, split_dkdv=True)),
]


@pytest.mark.parametrize("c,cfg", ATOMIC_MATRIX, ids=lambda x: getattr(x, "id", ""))
def test_atomic_dq_tma_reduce_matches_reference_gpu(c: Case, cfg, seed):
    """dQ added by TMA bulk reduce-adds (the atomic-dQ backward on the GPU; the interpreter has no such op, so the
    CPU tests reach only the scalar-atomic branch)."""
    q, k, v, dout, alibi = case_inputs(c, "cuda")
    configs.CONFIG_OVERRIDE["bwd"] = cfg
    try:
        out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, **flash_kwargs(c, alibi, return_attn_probs=True))
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        configs.CONFIG_OVERRIDE.clear()
    keep = keep_mask_from_s_dmask(s_dmask) if c.dropout_p > 0 else None
    check_against_reference(c, q, k, v, dout, alibi, out, lse, None, (dq, dk, dv), dropout_mask=keep)


@pytest.mark.parametrize("c", GPU_MATRIX, ids=lambda c: c.id)
def test_fwd_bwd_matches_reference_gpu(c: Case, seed):
    q, k, v, dout, alibi = case_inputs(c, "cuda")
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, **flash_kwargs(c, alibi, return_attn_probs=True))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (c.b, c.h, c.sq) and lse.dtype == torch.float32
    assert s_dmask.shape == (c.b, c.h, c.sq, c.sk) and s_dmask.dtype == torch.float32
    vis = visible(c, "cuda")
    assert (s_dmask[..., ~vis] == 0).all(), f"S_dmask nonzero on masked entries [{c.id}]"
    keep = keep_mask_from_s_dmask(s_dmask) if c.dropout_p > 0 else None
    # the probability check is only affordable (float64, b*h*sq*sk) when the matrix is small enough
    small = c.b * c.h * c.sq * c.sk <= 2 ** 26
    check_against_reference(c, q, k, v, dout, alibi, out, lse, s_dmask if small else None, (dq, dk, dv),
                            dropout_mask=keep)
    empty = empty_rows(c, "cuda")
    if empty.any():
        assert (out[:, empty] == 0).all() and torch.isneginf(lse[:, :, empty]).all()
        assert (dq[:, empty] == 0).all()


def test_qkvpacked_gpu(seed):
    c = Case(2, 2048, 2048, 8, 8, 128, bf16, causal=True, dropout_p=0.17)
    qkv = torch.randn(c.b, c.sq, 3, c.h, c.d, dtype=c.dtype, device="cuda", requires_grad=True)
    dout = torch.randn(c.b, c.sq, c.h, c.d, dtype=c.dtype, device="cuda")
    out, lse, s_dmask = flashtile.flash_attn_qkvpacked_func(qkv, dropout_p=0.17, causal=True, return_attn_probs=True)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    q, k, v = (qkv[:, :, i].detach() for i in range(3))
    check_against_reference(c, q, k, v, dout, None, out, lse, None, tuple(dqkv.unbind(2)),
                            dropout_mask=keep_mask_from_s_dmask(s_dmask))


def test_kvpacked_gpu(seed):
    c = Case(2, 1024, 3000, 16, 2, 64, fp16, causal=True)
    q = torch.randn(c.b, c.sq, c.h, c.d, dtype=c.dtype, device="cuda", requires_grad=True)
    kv = torch.randn(c.b, c.sk, 2, c.hk, c.d, dtype=c.dtype, device="cuda", requires_grad=True)
    dout = torch.randn_like(q)
    out, lse, _ = flashtile.flash_attn_kvpacked_func(q, kv, causal=True, return_attn_probs=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    check_against_reference(c, q, kv[:, :, 0].detach(), kv[:, :, 1].detach(), dout, None, out, lse, None,
                            (dq, dkv[:, :, 0], dkv[:, :, 1]))


@pytest.mark.parametrize("dtype", [bf16, fp16])
def test_deterministic_backward_bitwise_gpu(dtype, seed):
    """deterministic=True: bitwise identical dq/dk/dv across runs, with GQA 8:1 (dK/dV reduced over 8 heads)
    and long sequences (many key blocks contributing to each dQ row)."""
    c = Case(2, 4096, 4096, 16, 2, 128, dtype, causal=True, dropout_p=0.17)
    q, k, v, dout, _ = case_inputs(c, "cuda")
    grads = []
    for _ in range(3):
        torch.manual_seed(seed)
        out = flashtile.flash_attn_func(q, k, v, dropout_p=0.17, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for run in grads[1:]:
        for name, a, b_ in zip(("dq", "dk", "dv"), grads[0], run):
            assert torch.equal(a, b_), f"{name} not bitwise reproducible: max diff {(a - b_).abs().max()}"


def test_dropout_keep_rate_gpu(seed):
    p = 0.17
    q = torch.randn(4, 1024, 8, 64, dtype=bf16, device="cuda")
    k, v = torch.randn_like(q), torch.randn_like(q)
    with torch.no_grad():
        _, _, s_dmask = flashtile.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    n = s_dmask.numel()
    assert (s_dmask == 0).sum().item() == 0
    kept = (s_dmask > 0).sum().item()
    expected, bound = n * (1 - p), binomial_5sigma(n, 1 - p)
    assert abs(kept - expected) <= bound, f"kept {kept}/{n}, expected {expected:.0f} +- {bound:.0f}"
    # per (batch, head) too: a stream reused across heads would still pass the global count
    per_bh = (s_dmask > 0).float().mean(dim=(2, 3))
    n_bh = 1024 * 1024
    assert ((per_bh - (1 - p)).abs() <= binomial_5sigma(n_bh, 1 - p) / n_bh).all(), per_bh
    keep = s_dmask > 0
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    torch.manual_seed(seed)
    _, _, m1 = flashtile.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    torch.manual_seed(seed)
    _, _, m2 = flashtile.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    assert torch.equal(m1 >= 0, m2 >= 0)


def test_no_nan_on_huge_scores_gpu(seed):
    """Scores of magnitude ~1e4 (no scaling down) must not overflow the online softmax."""
    c = Case(1, 1024, 1024, 4, 4, 128, bf16, causal=True, softmax_scale=1.0)
    q, k, v, dout, _ = case_inputs(c, "cuda")
    with torch.no_grad():
        q.mul_(8.0)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, softmax_scale=1.0, return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for t in (out, lse, dq, dk, dv):
        assert torch.isfinite(t).all()
    check_against_reference(c, q, k, v, dout, None, out, lse, None, (dq, dk, dv))


def test_compiled_transposed_inputs_take_the_hopper_kernels_gpu(seed, monkeypatch):
    """Under torch.compile the custom ops copy (batch, heads, seqlen, d) memory seen transposed for the Hopper
    kernels when the graph runs (dispatch.kernel_inputs; its work threshold lowered to this size), forward and
    backward: no Triton launch, and the float64 reference."""
    from flashtile.kernels import dispatch
    from flashtile.kernels.gluon import fa3
    from flashtile.kernels.triton import launch
    if not fa3.supports(*(torch.empty(1, 128, 2, 128, device="cuda", dtype=bf16) for _ in range(3)),
                        launch.AttnParams(softmax_scale=0.1)):
        pytest.skip("the Hopper kernels do not run here")
    torch._dynamo.reset()
    monkeypatch.setattr(dispatch, "COPY_MIN_WORK", 0)
    triton_calls = []
    for name in ("flash_fwd", "flash_bwd"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _n=name, _f=real, **kw: triton_calls.append(_n) or _f(*a, **kw))
    c = Case(2, 1024, 1024, 8, 2, 128, bf16, causal=True, layout="transposed")
    q, k, v, dout, _ = case_inputs(c, "cuda")
    compiled = torch.compile(lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True), fullgraph=True)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(c, q, k, v, dout, None, out, None, None, grads)
    assert triton_calls == []
    torch._dynamo.reset()


def test_compiled_inductor_gpu(seed):
    torch._dynamo.reset()
    c = Case(2, 2048, 2048, 8, 2, 128, bf16, causal=True)
    q, k, v, dout, _ = case_inputs(c, "cuda")

    def fn(q, k, v):
        return flashtile.flash_attn_func(q.mul(1.0), k, v, causal=True, deterministic=True) * 2.0

    out_e = fn(q, k, v)
    g_e = torch.autograd.grad(out_e, (q, k, v), dout)
    compiled = torch.compile(fn, fullgraph=True)
    out_c = compiled(q, k, v)
    g_c = torch.autograd.grad(out_c, (q, k, v), dout)
    torch.testing.assert_close(out_c, out_e)
    for a, b_ in zip(g_c, g_e):
        torch.testing.assert_close(a, b_)
    torch._dynamo.reset()
