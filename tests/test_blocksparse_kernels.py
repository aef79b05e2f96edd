"""Block-sparse attention (flashtile.blocksparse): equal to dense attention with the expanded mask, tiles the
block mask marks empty never touched, and the tile classification itself."""
import pytest
import torch

from attn_utils import DEVICE, assert_within_rule, inputs
from flex_utils import random_tile_mask
from flashtile import flash_attn_func
from flashtile.blocksparse import BlockMask, blocksparse_attn_func, create_block_mask
from flashtile.reference.dense import attention_ref

fp16, fp32, bf16 = torch.float16, torch.float32, torch.bfloat16


def _check(q, k, v, dout, bm, dtype, ctx, causal=False, ref_kv=None):
    """Rule-check out, lse, dq, dk, dv of blocksparse_attn_func against the reference with the dense mask
    (computed from ref_kv = (k, v) instead when given)."""
    out, lse, _ = blocksparse_attn_func(q, k, v, bm, causal=causal, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    dense = bm.to_dense().expand(q.shape[0], q.shape[2], -1, -1)
    ref = {}
    for upcast in (True, False):
        cast = (lambda t: t.detach().double()) if upcast else (lambda t: t.detach().clone())
        leaves = [cast(t).requires_grad_() for t in (q, *(ref_kv or (k, v)))]
        r_out, r_lse, _ = attention_ref(*leaves, attn_mask=dense, causal=causal, upcast=upcast)
        ref[upcast] = (r_out, r_lse, *torch.autograd.grad(r_out, leaves, dout.to(r_out.dtype)))
    for name, ours, r64, std in zip(("out", "softmax_lse", "dq", "dk", "dv"), (out, lse, *grads), ref[True],
                                    ref[False]):
        assert_within_rule(name, ours, r64, std, dtype, ctx)
    return out, grads


@pytest.mark.parametrize("dtype", [fp16, bf16, fp32], ids=["fp16", "bf16", "fp32"])
def test_document_mask_equals_dense(dtype, seed):
    s = 100                                       # ragged last block; documents not aligned to blocks
    doc = torch.tensor([0] * 30 + [1] * 45 + [2] * 25, device=DEVICE)
    bm = create_block_mask(lambda b, h, qi, ki: doc[qi] == doc[ki], None, None, s, s, BLOCK_SIZE=32, device=DEVICE)
    assert bm.density() < 1.0
    q, k, v, dout = inputs(2, s, s, 4, 2, 32, dtype)
    _check(q, k, v, dout, bm, dtype, "[document]")


def test_causal_via_mask_fn_equals_causal_flag(seed):
    s = 96
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s, BLOCK_SIZE=32, device=DEVICE)
    # causal at block granularity: lower triangle full, diagonal partial, upper empty
    assert bm.full_kv_num_blocks.flatten().tolist() == [0, 1, 2]
    assert bm.kv_num_blocks.flatten().tolist() == [1, 1, 1]
    q, k, v, dout = inputs(1, s, s, 2, 2, 32, fp32)
    out, grads = _check(q, k, v, dout, bm, fp32, "[causal mask_fn]")
    out_c = flash_attn_func(q, k, v, causal=True)
    g_c = torch.autograd.grad(out_c, (q, k, v), dout)
    torch.testing.assert_close(out, out_c, rtol=1e-5, atol=1e-5)
    for a, b_ in zip(grads, g_c):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-4)


def test_random_block_pattern_per_head_gqa_with_causal_flag(seed):
    """Per-(batch, head) random tile pattern (empty / full / element-wise random), GQA, plus causal=True."""
    b, h, sq, sk, bs = 2, 4, 80, 112, 16
    bm = create_block_mask(random_tile_mask(b, h, sq, sk, bs), b, h, sq, sk, BLOCK_SIZE=bs, device=DEVICE)
    q, k, v, dout = inputs(b, sq, sk, h, 2, 32, fp16)
    _check(q, k, v, dout, bm, fp16, "[random blocks, causal]", causal=True)


def test_empty_tiles_are_never_read(seed):
    """K/V rows that only empty tiles reference are NaN: the block-sparse result stays finite and exact, and
    their dK/dV are 0. The same poison reaches the dense masked kernel's output (P V with P = 0 and V = NaN),
    which shows the poison would be seen if the tiles were visited."""
    s_q, s_k, bs = 64, 96, 32
    bm = create_block_mask(lambda b, h, qi, ki: (ki < 64) & (qi + 32 >= ki), None, None, s_q, s_k,
                           BLOCK_SIZE=bs, device=DEVICE)
    assert bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum() == 4 and bm.q_num_blocks[0, 0, 2] == 0
    q, k, v, dout = inputs(1, s_q, s_k, 2, 1, 32, fp32)
    clean = (k.detach().clone(), v.detach().clone())   # the reference must not multiply 0 by NaN
    with torch.no_grad():
        k[:, 64:] = float("nan")
        v[:, 64:] = float("nan")
    out, grads = _check(q, k, v, dout, bm, fp32, "[poisoned empty tiles]", ref_kv=clean)
    assert torch.all(grads[1][:, 64:] == 0) and torch.all(grads[2][:, 64:] == 0)
    dense = flash_attn_func(q.detach(), k.detach(), v.detach(), attn_mask=bm.to_dense())
    assert torch.isnan(dense).any(), "the poison must be visible to a kernel that visits every tile"


def test_block_classification_matches_dense_mask(seed):
    b, h, s, bs = 2, 3, 70, 16
    m = torch.rand(b, h, s, s, device=DEVICE) > 0.97
    m[..., :bs, :bs] = True                          # a full tile
    bm = create_block_mask(lambda bi, hi, qi, ki: m[bi, hi, qi, ki], b, h, s, s, BLOCK_SIZE=bs, device=DEVICE)
    n = -(-s // bs)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                tile_row = m[bi, hi, i * bs:(i + 1) * bs]
                part, full = [], []
                for j in range(n):
                    t = tile_row[:, j * bs:(j + 1) * bs]
                    (full if t.all() else part if t.any() else []).append(j)
                assert bm.kv_indices[bi, hi, i, :bm.kv_num_blocks[bi, hi, i]].tolist() == part
                assert bm.full_kv_indices[bi, hi, i, :bm.full_kv_num_blocks[bi, hi, i]].tolist() == full
                for j in part:
                    assert i in bm.q_indices[bi, hi, j, :bm.q_num_blocks[bi, hi, j]].tolist()
                for j in full:
                    assert i in bm.full_q_indices[bi, hi, j, :bm.full_q_num_blocks[bi, hi, j]].tolist()
    assert bm.full_kv_num_blocks[0, 0, 0] >= 1


def test_bias_gradient_through_block_sparse(seed):
    s = 64
    bm = create_block_mask(lambda b, h, qi, ki: (qi // 32) >= (ki // 32), None, None, s, s, BLOCK_SIZE=32,
                           device=DEVICE)
    q, k, v, _ = inputs(1, s, s, 2, 2, 32, fp32)
    bias = torch.randn(1, 1, s, s, device=DEVICE, requires_grad=True)
    out = blocksparse_attn_func(q, k, v, bm, attn_bias=bias)
    dbias = torch.autograd.grad(out.sum(), bias)[0]
    qd, kd, vd = (t.detach().double() for t in (q, k, v))
    bd = bias.detach().double().requires_grad_()
    ref, _, _ = attention_ref(qd, kd, vd, attn_bias=bd, attn_mask=bm.to_dense())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dbias.double(), torch.autograd.grad(ref.sum(), bd)[0], rtol=1e-4, atol=1e-4)


def test_bad_block_mask_arguments():
    q, k, v, _ = inputs(2, 64, 64, 2, 2, 32, fp32)
    causal = lambda b, h, qi, ki: qi >= ki  # noqa: E731
    with pytest.raises(ValueError, match=r"block_mask\.shape\[2:\]"):
        blocksparse_attn_func(q, k, v, create_block_mask(causal, None, None, 64, 32, BLOCK_SIZE=32, device=DEVICE))
    with pytest.raises(ValueError, match=r"block_mask\.shape\[0\]"):
        blocksparse_attn_func(q, k, v, create_block_mask(causal, 3, None, 64, 64, BLOCK_SIZE=32, device=DEVICE))
    with pytest.raises(ValueError, match=r"block_mask\.shape\[1\]"):
        blocksparse_attn_func(q, k, v, create_block_mask(causal, None, 3, 64, 64, BLOCK_SIZE=32, device=DEVICE))
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        create_block_mask(causal, None, None, 64, 64, BLOCK_SIZE=48, device=DEVICE)
    with pytest.raises(ValueError, match=r"mask_fn\(\.\.\.\)"):
        create_block_mask(lambda b, h, qi, ki: (qi - ki).float(), None, None, 64, 64, BLOCK_SIZE=32, device=DEVICE)
    with pytest.raises(TypeError, match="block_mask"):
        blocksparse_attn_func(q, k, v, torch.ones(64, 64, dtype=torch.bool))
    bm = create_block_mask(causal, None, None, 64, 64, BLOCK_SIZE=32, device=DEVICE)
    assert isinstance(bm, BlockMask)
    with pytest.raises(ValueError, match="attn_mask"):
        from flashtile.interface import dense_attention
        dense_attention(q, k, v, attn_mask=torch.ones(64, 64, dtype=torch.bool), block_mask=bm)
