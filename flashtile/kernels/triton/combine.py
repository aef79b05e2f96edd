"""Flash-decoding's combine step: merge the per-split partial results of decode.py into O and LSE.

Split s of a query row produced O_s (normalised over its keys) and lse2_s = log2 sum_j exp2(S_j) over its keys.
Over all splits, lse2 = log2 sum_s exp2(lse2_s) and O = sum_s exp2(lse2_s - lse2) O_s: exactly the online-softmax
rule with each split as one block whose row max is lse2_s and row sum 1, folded in one at a time by
mods.merge_partial (the same update the forward's inner loop performs on score tiles).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mods import merge_partial


@triton.jit(do_not_specialize=["num_splits"])
def combine_kernel(O_PART, LSE_PART, O, LSE,
                   stride_ps, stride_pm, stride_ph, stride_lps, stride_lpm,
                   stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h,
                   nheads, seqlen_rows, head_dim, num_splits,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (packed query row, block of BLOCK_H heads). Packed row g is query g % seqlen_rows of
    batch element g // seqlen_rows (dense layout; varlen passes seqlen_rows = total_q and batch strides 0)."""
    g = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = heads < nheads
    tile_mask = h_ok[:, None] & (offs_d[None, :] < head_dim)
    g64 = tl.cast(g, tl.int64)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s in range(0, num_splits):
        s64 = tl.cast(s, tl.int64)
        lse2_s = tl.load(LSE_PART + s64 * stride_lps + g64 * stride_lpm + heads, mask=h_ok, other=float("-inf"))
        o_s = tl.load(O_PART + s64 * stride_ps + g64 * stride_pm + heads.to(tl.int64)[:, None] * stride_ph
                      + offs_d[None, :], mask=tile_mask, other=0.0)
        m_i, l_i, acc = merge_partial(m_i, l_i, acc, lse2_s, o_s)
    # rows no split saw a key for: O = 0, LSE = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    b = g64 // seqlen_rows
    i = g64 % seqlen_rows
    o_rows = b * stride_ob + i * stride_om + heads.to(tl.int64) * stride_oh
    tl.store(O + o_rows[:, None] + offs_d[None, :], out.to(O.dtype.element_ty), mask=tile_mask)
    tl.store(LSE + b * stride_lse_b + heads.to(tl.int64) * stride_lse_h + i, lse, mask=h_ok)


def combine_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   seqlen_rows: int) -> None:
    """o_part (splits, rows, nheads, d) float32, lse_part (splits, rows, nheads) float32 log2 units ->
    out (batch, seqlen_q, nheads, d) or (total_q, nheads, d); lse (batch, nheads, seqlen_q) or (nheads, total_q)
    natural log. seqlen_rows: seqlen_q (dense) or total_q (packed)."""
    num_splits, rows, nheads, head_dim = o_part.shape
    if out.dim() == 4:
        ob, om, oh = out.stride(0), out.stride(1), out.stride(2)
        lb, lh = lse.stride(0), lse.stride(1)
    else:
        ob, om, oh = 0, out.stride(0), out.stride(1)
        lb, lh = 0, lse.stride(0)
    block_h = min(16, triton.next_power_of_2(nheads))
    combine_kernel[(rows, triton.cdiv(nheads, block_h))](
        o_part, lse_part, out, lse,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        ob, om, oh, lb, lh, nheads, seqlen_rows, head_dim, num_splits,
        BLOCK_H=block_h, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=4)
