"""Merging partial attention results: flash-decoding's combine step (the per-split partial results of decode.py
into O and LSE), and the ring's merge of its blocks' results (merge_parts).

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
def merge_parts_kernel(O, LSE, out_strides, lse_strides, PO, PL, part_strides, part_rows, nheads, seqlen, head_dim,
                       N: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (cdiv(seqlen, ROWS), batch * nheads): ROWS rows of one (batch, head). Part i (PO[i], PL[i]) is
    attention over its own key set for rows part_rows[i] = (r0, r1) of the output (its row j is output row r0 + j),
    the key sets disjoint; rows outside a part have no key of it. The merge is FA2's inner loop once more with the
    parts as the keys (as merge_splits does for decode's splits): part i is a key whose score is lse_i and whose
    value row is O_i, Alg. 1 lines 9-10 one part at a time, then lines 12-13. A part's row is read only where it
    has keys (lse_i > -inf: its O row may hold anything else); rows no part has a key for get O = 0, LSE = -inf.
    out_strides: (batch, row, head) of O; lse_strides: (batch, head) of LSE (rows contiguous); part_strides[i]:
    (batch, row, head) of PO[i] then (batch, head) of PL[i]."""
    bh = tl.program_id(1)
    b = tl.cast(bh // nheads, tl.int64)
    h = tl.cast(bh % nheads, tl.int64)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen
    col_ok = (offs_d < head_dim)[None, :]
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(N):
        r0, r1 = part_rows[i]
        sb, sm, sh, slb, slh = part_strides[i]
        inside = row_ok & (rows >= r0) & (rows < r1)
        j = (rows - r0).to(tl.int64)
        lse_i = tl.load(PL[i] + b * slb + h * slh + j, mask=inside, other=float("-inf"))
        live = lse_i != float("-inf")
        o_i = tl.load(PO[i] + b * sb + h * sh + j[:, None] * sm + offs_d[None, :], mask=live[:, None] & col_ok,
                      other=0.0)
        # Alg. 1 lines 9-10 with part i as the one key of each row: score lse_i (log2 units), value O_i
        m_i, p, alpha, l_i = online_softmax_step(m_i, l_i, (lse_i * LOG2E)[:, None], True)
        acc = acc * alpha[:, None] + p * to_dtype(o_i, tl.float32)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    ob, om, oh = out_strides
    lb, lh = lse_strides
    store_rows(O, LSE, acc / l_safe[:, None], lse, b, rows, h, row_ok, offs_d, head_dim, ob, om, oh, lb, lh)


# parts one launch merges at most (the ring's forward merges up to five at once)
MAX_PARTS = 8


def merge_parts(parts, out: torch.Tensor, lse: torch.Tensor) -> None:
    """out, lse <- attention over the union of the parts' disjoint key sets, one pass: each part's rows read once
    where they have keys, out and lse written once (every row). parts: up to MAX_PARTS tuples (r0, o, o_lse): o
    (batch, r1 - r0, nheads, d) in any float dtype with a contiguous last dim, o_lse (batch, nheads, r1 - r0)
    float32 natural log (-inf where the part has no key; its o row is then not read) with contiguous rows, for
    output rows [r0, r1). out: (batch, seqlen, nheads, d), any float dtype (the merge runs in float32 and rounds
    once); lse: (batch, nheads, seqlen) float32 with contiguous rows."""
    b, s, h, d = out.shape
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"merge_parts: {len(parts)} parts (expected 1..{MAX_PARTS})")
    if b * s * h == 0:
        return
    rows = 32
    relaunch.launch(merge_parts_kernel, (triton.cdiv(s, rows), b * h), (
        out, lse, out.stride()[:3], lse.stride()[:2], tuple(o for _, o, _ in parts), tuple(l for _, _, l in parts),
        tuple((*o.stride()[:3], *l.stride()[:2]) for _, o, l in parts),
        tuple((r0, r0 + o.shape[1]) for r0, o, _ in parts), h, s, d), dict(
        N=len(parts), ROWS=rows, BLOCK_D=max(16, next_pow2(d)), num_warps=4))
