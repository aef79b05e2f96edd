"""Merging partial attention results: flash-decoding's combine step (the per-split partial results of decode.py
into O and LSE), and the ring's merge of one block's result into the running one (merge_into).

Split s of a query row produced O_s (normalised over its keys) and lse2_s = log2 sum_j exp2(S_j) over its keys.
Over all splits, lse2 = log2 sum_s exp2(lse2_s) and O = sum_s exp2(lse2_s - lse2) O_s: FA2's inner loop once
more, with the splits as the keys: split s is a key whose score is lse2_s and whose value row is O_s (its
weight exp2(lse2_s) is its row sum, since O_s is normalised). So the kernel runs mods.online_softmax_step over
chunks of splits, the very update the forward applies to score tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import params, relaunch
from ..runtime import next_pow2
from .mods import online_softmax_step, to_dtype


LN2 = tl.constexpr(params.LN2)


@triton.jit
def merge_splits(lse_rows, o_rows, row_ok, stride_lps, stride_ps, num_splits, head_dim,
                 RG: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    """The merge of RG query rows' split partials: lse_rows / o_rows (RG,) point at split 0's lse2 and O row of
    each row (split s at + s * stride_lps / stride_ps); rows with row_ok False are not read. CHUNK splits per
    step, all their loads in flight at once (a decode step's latency is what a combine adds, so the splits are
    not visited one by one); loads bypass L1 (.cg), since the partials may have been written by other programs
    of the same launch (decode.py's fused combine). Returns O (RG, BLOCK_D) fp32 and the natural-log LSE (RG,);
    rows no split saw a key for: O = 0, LSE = -inf."""
    offs_s = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full([RG], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([RG], dtype=tl.float32)
    acc = tl.zeros([RG, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        sp = (s0 + offs_s).to(tl.int64)
        ok = row_ok[:, None] & (sp < num_splits)[None, :]
        lse2 = tl.load(lse_rows[:, None] + sp[None, :] * stride_lps, mask=ok, other=float("-inf"),
                       cache_modifier=".cg")
        o_s = tl.load(o_rows[:, None, None] + sp[None, :, None] * stride_ps + offs_d[None, None, :],
                      mask=ok[:, :, None] & (offs_d[None, None, :] < head_dim), other=0.0, cache_modifier=".cg")
        # FA2 Alg. 1 lines 9-10 with the splits as keys: scores lse2_s, values O_s
        m_i, p, alpha, l_i = online_softmax_step(m_i, l_i, lse2, True)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * o_s, 1)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    return out, lse


@triton.jit
def store_rows(O, LSE, out, lse, b, q_rows, h, row_ok, offs_d, head_dim,
               stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h):
    """Alg. 1 lines 14-15: rows (query q_rows of head h, batch element b) of O (out, cast) and LSE (natural log),
    as the decode kernel (one split, or its fused merge) and the combine kernel write them."""
    o_rows = tl.cast(b, tl.int64) * stride_ob + q_rows.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
    tl.store(O + o_rows[:, None] + offs_d[None, :], to_dtype(out, O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < head_dim))
    tl.store(LSE + tl.cast(b, tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h + q_rows.to(tl.int64), lse,
             mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def combine_kernel(O_PART, LSE_PART, O, LSE,
                   stride_ps, stride_pm, stride_ph, stride_lps, stride_lpm,
                   stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h,
                   seqlen_rows, head_dim, num_splits,
                   CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (packed query row, head). Packed row g is query g % seqlen_rows of batch element
    g // seqlen_rows (dense layout; varlen passes seqlen_rows = total_q and batch strides 0)."""
    g = tl.cast(tl.program_id(0), tl.int64) + tl.zeros([1], dtype=tl.int64)   # this program's one row, as (1,)
    h = tl.program_id(1).to(tl.int64)
    row_ok = g >= 0
    out, lse = merge_splits(LSE_PART + g * stride_lpm + h, O_PART + g * stride_pm + h * stride_ph, row_ok,
                            stride_lps, stride_ps, num_splits, head_dim, 1, CHUNK, BLOCK_D)
    store_rows(O, LSE, out, lse, g // seqlen_rows, g % seqlen_rows, h, row_ok, tl.arange(0, BLOCK_D), head_dim,
               stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h)


# fp32 partial values one merge step loads per program: 64 registers per thread at 4 warps
CHUNK_ELEMS = 8192


def combine_chunk(num_splits: int, block_d: int) -> int:
    """Splits merged per step: all of them where CHUNK_ELEMS allows (up to 64 at d128, 32 at d256: one step
    for the split counts num_splits_heuristic picks), else that many per step."""
    return min(max(2, next_pow2(num_splits)), max(2, CHUNK_ELEMS // block_d))


def combine_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   seqlen_rows: int, chunk: int = 0) -> None:
    """o_part (splits, rows, nheads, d) float32, lse_part (splits, rows, nheads) float32 log2 units ->
    out (batch, seqlen_q, nheads, d) or (total_q, nheads, d); lse (batch, nheads, seqlen_q) or (nheads, total_q)
    natural log. seqlen_rows: seqlen_q (dense) or total_q (packed). chunk > 0: splits per merge step (a power of
    two; else combine_chunk's)."""
    num_splits, rows, nheads, head_dim = o_part.shape
    if out.dim() == 4:
        ob, om, oh = out.stride(0), out.stride(1), out.stride(2)
        lb, lh = lse.stride(0), lse.stride(1)
    else:
        ob, om, oh = 0, out.stride(0), out.stride(1)
        lb, lh = 0, lse.stride(0)
    block_d = max(16, next_pow2(head_dim))
    chunk = chunk or combine_chunk(num_splits, block_d)
    relaunch.launch(combine_kernel, (rows, nheads), (
        o_part, lse_part, out, lse,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        ob, om, oh, lb, lh, seqlen_rows, head_dim, num_splits), dict(
        CHUNK=chunk, BLOCK_D=block_d, num_warps=4))


LOG2E = tl.constexpr(params.LOG2E)


@triton.jit
def merge_into_kernel(ACC, ACC_LSE, O, LSE, acc_strides, acc_lse_strides, o_strides, lse_strides, nheads, seqlen,
                      head_dim, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (cdiv(seqlen, ROWS), batch * nheads): ROWS rows of one (batch, head). (ACC, ACC_LSE) and (O, LSE) are
    attention over two disjoint key sets (LSE natural log, -inf where a set is empty); ACC, ACC_LSE are overwritten
    with attention over their union, the online-softmax rescale of FA2 Alg. 1 line 10 applied once:
        lse = log(e^lse_a + e^lse_b),  out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
    A row empty in both gets 0 and LSE -inf; a row the block has no key for is otherwise left as it is, and the
    rows of a side without keys are not read (they may hold anything). *_strides: (batch, row, head) of ACC / O, (batch,
    head) of the LSEs (rows contiguous)."""
    bh = tl.program_id(1)
    b = tl.cast(bh // nheads, tl.int64)
    h = tl.cast(bh % nheads, tl.int64)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen
    r64 = rows.to(tl.int64)
    sab, sah = acc_lse_strides
    slb, slh = lse_strides
    lse_a = tl.load(ACC_LSE + b * sab + h * sah + r64, mask=row_ok, other=float("-inf"))
    lse_b = tl.load(LSE + b * slb + h * slh + r64, mask=row_ok, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)   # both empty: weights exp(-inf) = 0, not NaN
    w_a = tl.math.exp2((lse_a - m) * LOG2E)
    w_b = tl.math.exp2((lse_b - m) * LOG2E)
    total = w_a + w_b
    lse = tl.where(total == 0.0, float("-inf"), m + tl.log(tl.where(total == 0.0, 1.0, total)))
    inv = 1.0 / tl.where(total == 0.0, 1.0, total)
    sb, sm, sh = acc_strides
    ob, om, oh = o_strides
    # a row is read only where its weight is not 0, and written only where it changes: where the block has keys,
    # or where the running row is empty (then 0 / -inf, the rule's value for a row empty in both). A ring step whose
    # calls cover some of the rows moves only those.
    empty_a = row_ok & (lse_a == float("-inf"))
    live_b = row_ok & (lse_b != float("-inf"))
    col_ok = (offs_d < head_dim)[None, :]
    acc_ptrs = ACC + b * sb + h * sh + r64[:, None] * sm + offs_d[None, :]
    o = tl.load(O + b * ob + h * oh + r64[:, None] * om + offs_d[None, :], mask=live_b[:, None] & col_ok, other=0.0)
    acc = tl.load(acc_ptrs, mask=(live_b & ~empty_a)[:, None] & col_ok, other=0.0)
    out = acc * (w_a * inv)[:, None] + to_dtype(o, tl.float32) * (w_b * inv)[:, None]
    tl.store(acc_ptrs, out, mask=(live_b | empty_a)[:, None] & col_ok)
    tl.store(ACC_LSE + b * sab + h * sah + r64, lse, mask=live_b | empty_a)


def merge_into(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """(acc, acc_lse) <- the merge of attention (acc, acc_lse) with attention (out, lse) over a disjoint key set,
    in place, one pass over each tensor. acc: (batch, seqlen, nheads, d) float32, out: the same shape in any float
    dtype (views with a contiguous last dim); acc_lse, lse: (batch, nheads, seqlen) float32 natural log with
    contiguous rows."""
    b, s, h, d = acc.shape
    if b * s * h == 0:
        return
    rows = 32
    relaunch.launch(merge_into_kernel, (triton.cdiv(s, rows), b * h), (
        acc, acc_lse, out, lse, acc.stride()[:3], acc_lse.stride()[:2], out.stride()[:3], lse.stride()[:2], h, s,
        d), dict(ROWS=rows, BLOCK_D=max(16, next_pow2(d)), num_warps=4))
