"""Split-KV attention over a KV cache (flash-decoding): contiguous, batch-indexed, left-padded or paged K/V.

Grid (m_blocks, batch * nheads_k, num_splits). A program owns one K/V head hk of one batch element, one
tile of BLOCK_M query rows, and one split (a contiguous range of key blocks). The tile packs the GQA group's
query heads and the seqlen_q query rows into the M dimension,

    row r of the tile -> query i = r // group, head h = hk * group + r % group,

so each K/V tile is read from memory once per K/V head (not once per query head): with nheads 32 / nheads_k 8
that is 4x less traffic than a per-query-head decode, and decode is bound by exactly that traffic.

Each program runs the FA2 inner loop (Alg. 1 lines 6-10, the update itself is mods.online_softmax_step) over
its split's keys. With one split it writes the final O and LSE; with several it writes a normalised partial
O_s and its log2-sum-exp lse2_s, which combine.merge_splits merges (the same online-softmax update) into O and LSE:
in the same launch, by the last split of each tile to finish (FUSED_COMBINE: a ticket counter per tile), up to
FUSED_MAX_SPLITS splits (more in small eager calls: fuse_combine), or else by combine.py's separate kernel (one
program per query row and head). Splits let a decode step with few (batch x K/V heads) tiles still fill every
multiprocessor (num_splits_heuristic).

Keys are addressed through the cache: key j (0-based, after left padding) of batch element b sits at cache
position pos = leftpad[b] + j, which is row pos of cache batch row cache_batch_idx[b] (contiguous), or slot
(pos % page_size) of page block_table[b, pos // page_size] (paged). Every key tile starts at a multiple of
BLOCK_N after the left padding (key_range's bounds and the split boundaries are multiples of BLOCK_N), so a
paged tile is addressed one of two ways:

- one page per tile (PAGE_TILES): when BLOCK_N divides page_size and the tile's first position
  leftpad + start_n is a multiple of BLOCK_N, the whole tile lies in one page: ONE block-table entry is loaded
  per tile (a scalar, one tile ahead; or, with PAGE_VEC, all of a short split's entries before its key loop) and
  the tile is BLOCK_N consecutive rows of that page, addressed (and, with USE_TMA,
  copied) exactly like a contiguous cache's tile. The host turns this on when page_size % BLOCK_N == 0; with
  cache_leftpad the kernel checks leftpad[b] % BLOCK_N per batch element and falls back to the gather for
  the elements where it is not 0.
- per-row gather (the general case): one block-table entry per key row, so a page may be any size (smaller
  or larger than BLOCK_N) and a tile may straddle pages.

Both ways read the same rows and do the same arithmetic in the same order: the output is bitwise the same.
USE_TMA loads the K/V tiles through host-made TMA descriptors over the cache's 2-D view
(rows = pages * page_size or batch_cache * capacity, nheads_k * headdim) instead of pointer loads (contiguous
caches and one-page-per-tile paged caches only; rows past the keys are zeroed like the masked pointer loads).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import relaunch
from ..params import Features
from ..runtime import _capturing, _device_props, multiprocessors, tickets, workspace_views  # noqa: F401
from . import combine as _combine
from . import configs
from .launch import (AttnParams, DescriptorType, _dot_precision, cdiv, descriptor_fields, interpreting, lse_strides,
                     next_pow2, pair_args, row_descriptor, row_strides)
from .mods import (bias_mask_log2, key_range, load_rows, mma, online_softmax_step, present, query_head, scores_log2,
                   seq_bounds, to_dtype, visible)

try:  # host-side TMA descriptors (triton >= 3.4; the interpreter emulates them)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None


@triton.jit
def _page_entry(BT_ROW, pos, page_size, last_page):
    """Block-table entry of the page holding cache position pos (clamped to the last visible key's page, so a
    read one tile ahead never leaves the row)."""
    return tl.load(BT_ROW + tl.minimum(pos // page_size, last_page))


@triton.jit
def _tile_rows(BT_ROW, cb, page, pos0, offs_n, valid, page_size, stride_kp, stride_kn, stride_vp, stride_vn,
               MASKED: tl.constexpr, PAGED: tl.constexpr, PAGE_TILES: tl.constexpr):
    """Where the key tile at cache positions pos0 + offs_n lives: (row, k_rows, v_rows). page: the tile's
    block-table entry, loaded one tile ahead by the caller (PAGE_TILES only).

    k_rows / v_rows (BLOCK_N,) int64: element offsets of each row from K_head / V_head (pointer loads).
    row: the tile's first row in the 2-D (dim0 * page_size, nheads_k * d) view the TMA descriptors cover
    (paged one-page-per-tile: page * page_size + slot; contiguous: cb * capacity + pos0; page_size is
    k_cache.shape[1] either way). Unused outputs are dead code."""
    if PAGED:
        if PAGE_TILES:
            # the whole tile lies in one page: one block-table entry, BLOCK_N consecutive slots
            slot0 = pos0 % page_size
            row = page * page_size + slot0
            base = page.to(tl.int64) * stride_kp
            vbase = page.to(tl.int64) * stride_vp
            slot = (slot0 + offs_n).to(tl.int64)
            k_rows = base + slot * stride_kn
            v_rows = vbase + slot * stride_vn
        else:
            # general gather: one block-table entry per row (rows past the keys read entry 0, never used)
            pos = pos0 + offs_n
            if MASKED:
                page = tl.load(BT_ROW + pos // page_size, mask=valid, other=0).to(tl.int64)
            else:
                page = tl.load(BT_ROW + pos // page_size).to(tl.int64)
            slot = (pos % page_size).to(tl.int64)
            row = pos0
            k_rows = page * stride_kp + slot * stride_kn
            v_rows = page * stride_vp + slot * stride_vn
    else:
        row = cb * page_size + pos0
        slot = (pos0 + offs_n).to(tl.int64)
        k_rows = slot * stride_kn
        v_rows = slot * stride_vn
    return row, k_rows, v_rows


@triton.jit
def _load_kv(desc, HEAD, rows, row, head_col, valid, offs_d, head_dim,
             MASKED: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    """A (BLOCK_N, BLOCK_D) K or V tile; rows past the keys (masked tiles only) and columns past the head dim
    read as 0. USE_TMA: one bulk copy of BLOCK_N rows at (row, head_col) of the descriptor's 2-D view."""
    if USE_TMA:
        t = desc.load([row, head_col])
        if MASKED:
            t = tl.where(valid[:, None], t, 0.0)
    else:
        t = load_rows(HEAD + rows[:, None] + offs_d[None, :], valid, offs_d, head_dim, MASKED, EVEN_D)
    return t


@triton.jit
def _decode_tile(acc, l_i, m_i, page, start_n, row, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
                 PAGED: tl.constexpr, PAGE_TILES: tl.constexpr, USE_TMA: tl.constexpr, FEATURES: tl.constexpr,
                 DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_VEC: tl.constexpr, HAS_MASK: tl.constexpr):
    """One step j of the inner loop (FA2 Alg. 1 lines 7-10) for the key block starting at start_n. row: what
    every step of the program reads, as decode_kernel packs it. page: this tile's block-table entry (paged
    one-page-per-tile); the next tile's is requested here and returned, so that its latency overlaps this
    tile's work instead of stalling the next tile's copy. PAGE_VEC > 0: the split's entries were loaded before
    the loop (row's pages_vec, PAGE_VEC of them from the split's first page on) and this tile's is picked out of
    them, so no step waits on a read made by the step before. HAS_MASK: attn_mask applies to every tile (row's
    mask_rows: each tile row's (batch, head) row of the mask, moved past the left padding), so every step's
    softmax update is the one safe for rows without a visible key yet."""
    (q, K_head, V_head, desc_k, desc_v, BT_ROW, cb, head_col, offs_n, offs_d, qi, leftpad, seqlen_q, seqlen_k,
     stride_kp, stride_kn, stride_vp, stride_vn, page_size, head_dim, scale, slope2, window_left,
     window_right, last_page, pages_vec, first_page, mask_rows, stride_mask_m, stride_mask_n) = row
    cols = start_n + offs_n                      # key index within the sequence (after left padding)
    valid = cols < seqlen_k
    next_page = page
    if PAGED and PAGE_TILES:
        if PAGE_VEC > 0:
            i = (leftpad + start_n) // page_size - first_page
            page = tl.sum(tl.where(tl.arange(0, PAGE_VEC) == i, pages_vec, 0), axis=0)
        else:
            next_page = _page_entry(BT_ROW, leftpad + start_n + BLOCK_N, page_size, last_page)
    tile_row, k_rows, v_rows = _tile_rows(BT_ROW, cb, page, leftpad + start_n, offs_n, valid, page_size, stride_kp,
                                          stride_kn, stride_vp, stride_vn, MASKED, PAGED, PAGE_TILES)
    k = _load_kv(desc_k, K_head, k_rows, tile_row, head_col, valid, offs_d, head_dim, MASKED, EVEN_D, USE_TMA)
    # Alg. 1 line 8: S = Q K_j^T, scaled / soft-capped / ALiBi-biased, in log2 units
    qk = mma(q, tl.trans(k), None, DOT_PREC)
    s, _ = scores_log2(qk, qi[:, None], cols[None, :], seqlen_q, seqlen_k, scale, slope2, FEATURES.SOFTCAP,
                       FEATURES.ALIBI)
    if HAS_MASK:
        s = bias_mask_log2(s, qi[:, None], cols[None, :], seqlen_q, seqlen_k, 0, 0, 0, mask_rows[:, None],
                           stride_mask_m, stride_mask_n, False, True)
    if MASKED:
        s = tl.where(visible(qi[:, None], cols[None, :], seqlen_q, seqlen_k, window_left, window_right,
                             FEATURES.HAS_LEFT, FEATURES.HAS_RIGHT), s, float("-inf"))
    # Alg. 1 line 9: running max m_i, P~ = exp2(S - m_i), running sum l_i
    SAFE: tl.constexpr = MASKED or HAS_MASK
    m_i, p, alpha, l_i = online_softmax_step(m_i, l_i, s, SAFE)
    v = _load_kv(desc_v, V_head, v_rows, tile_row, head_col, valid, offs_d, head_dim, MASKED, EVEN_D, USE_TMA)
    # Alg. 1 line 10: O~ = diag(alpha) O~ + P~ V_j
    acc = acc * alpha[:, None]
    acc = mma(to_dtype(p, v.dtype), v, acc, DOT_PREC)
    return acc, l_i, m_i, next_page


@triton.jit
def _attend_split(acc, l_i, m_i, page, row, s_lo, f_lo, f_hi, s_hi, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
                  PAGED: tl.constexpr, PAGE_TILES: tl.constexpr, USE_TMA: tl.constexpr, FEATURES: tl.constexpr,
                  DOT_PREC: tl.constexpr, PAGE_VEC: tl.constexpr, HAS_MASK: tl.constexpr):
    """Alg. 1 line 6: the split's key blocks, [s_lo, f_lo) masked | [f_lo, f_hi) unmasked | [f_hi, s_hi) masked.
    The three ranges are consecutive, so the block-table entry each step prefetches is the next step's; page:
    the first tile's entry (paged one-page-per-tile without PAGE_VEC; with it the steps read row's pages_vec)."""
    for start_n in range(s_lo, f_lo, BLOCK_N):
        acc, l_i, m_i, page = _decode_tile(acc, l_i, m_i, page, start_n, row, True, EVEN_D, PAGED, PAGE_TILES,
                                           USE_TMA, FEATURES, DOT_PREC, BLOCK_N, PAGE_VEC, HAS_MASK)
    for start_n in range(f_lo, f_hi, BLOCK_N):
        acc, l_i, m_i, page = _decode_tile(acc, l_i, m_i, page, start_n, row, False, EVEN_D, PAGED, PAGE_TILES,
                                           USE_TMA, FEATURES, DOT_PREC, BLOCK_N, PAGE_VEC, HAS_MASK)
    for start_n in range(f_hi, s_hi, BLOCK_N):
        acc, l_i, m_i, page = _decode_tile(acc, l_i, m_i, page, start_n, row, True, EVEN_D, PAGED, PAGE_TILES,
                                           USE_TMA, FEATURES, DOT_PREC, BLOCK_N, PAGE_VEC, HAS_MASK)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_splits", "seqlen_k_static"])
def decode_kernel(
    Q, K, V, O, LSE, O_PART, LSE_PART, SEM, desc_k, desc_v,
    CU_SEQLENS_Q, SEQLENS_K, CACHE_BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI_SLOPES, MASK,
    q_strides, k_strides, v_strides, o_strides, lse_strides, part_strides, lse_part_strides, stride_bt_b,
    stride_alibi_b, mask_strides, heads, seqlen_q_static, seqlen_k_static, head_dim, page_size, scale, window,
    num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    FEATURES: tl.constexpr, PAGED: tl.constexpr, PAGE_TILES: tl.constexpr, USE_TMA: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, SPLIT: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, COMBINE_RG: tl.constexpr, COMBINE_CHUNK: tl.constexpr,
    DOT_PREC: tl.constexpr, PAGE_VEC: tl.constexpr = 0, HAS_MASK: tl.constexpr = False,
):
    """One program per tile of BLOCK_M packed (query, head of the group) rows of one (batch, K/V head), per split of
    the keys; grid (row tiles, batch * nheads_k, num_splits). The tensors (each step's own; a launch template binds
    the rest): Q, O, LSE as flash_decode's q, out, lse; K, V the caches; O_PART, LSE_PART the split partials
    (SPLIT) and SEM the fused combine's ticket counters (FUSED_COMBINE); desc_k, desc_v TMA descriptors over the
    caches (USE_TMA); CU_SEQLENS_Q, SEQLENS_K, CACHE_BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI_SLOPES, MASK under their
    flags (FEATURES.VARLEN: varlen queries, HAS_SEQLENS, HAS_BATCH_IDX, HAS_LEFTPAD, PAGED, FEATURES.ALIBI,
    HAS_MASK: a bool attn_mask, read as uint8, broadcastable to (batch, nheads, seqlen_q, cache positions));
    FEATURES (params.Features) as attn_fwd_kernel's but dropout. The rest:
    - q_strides, o_strides: (batch, row, head) strides; k_strides, v_strides: (cache row or page, position, head);
      lse_strides: (batch, head); part_strides: O_PART's (split, packed row, head), lse_part_strides: LSE_PART's
      (split, packed row); stride_bt_b: BLOCK_TABLE's row stride; stride_alibi_b; mask_strides: MASK's (batch,
      head, query, cache position) strides (runtime.pair_args: 0 where it broadcasts);
    - heads: (nheads_k, query heads per K/V head); seqlen_q_static: the (longest) query length; seqlen_k_static:
      added to SEQLENS_K, or every sequence's end without it; head_dim; page_size (PAGED);
    - scale: (score_scale, softcap_log2) (mods.scores_log2); window: (window_left, window_right); num_splits."""
    stride_qb, stride_qm, stride_qh = q_strides
    stride_kp, stride_kn, stride_kh = k_strides
    stride_vp, stride_vn, stride_vh = v_strides
    stride_ob, stride_om, stride_oh = o_strides
    stride_lse_b, stride_lse_h = lse_strides
    stride_ps, stride_pm, stride_ph = part_strides
    stride_lps, stride_lpm = lse_part_strides
    nheads_k, group_size = heads
    window_left, window_right = window
    pid_m = tl.program_id(0)
    bhk = tl.program_id(1)
    split = tl.program_id(2)
    b, hk, _ = query_head(bhk, nheads_k, 1)
    q_start, seqlen_q = seq_bounds(b, CU_SEQLENS_Q, seqlen_q_static, FEATURES.VARLEN)
    start_r = pid_m * BLOCK_M
    if start_r >= seqlen_q * group_size:
        return
    leftpad = 0
    if HAS_LEFTPAD:
        leftpad = tl.load(LEFTPAD + b)
    # visible keys: cache positions [leftpad, seqlens_k[b] + seqlen_k_static) (the tokens just appended counted in
    # the launch, not by a kernel adding them to the tensor), or [leftpad, seqlen_k_static) for every b
    if HAS_SEQLENS:
        seqlen_k = tl.load(SEQLENS_K + b) + seqlen_k_static - leftpad
    else:
        seqlen_k = seqlen_k_static - leftpad
    cb = b
    if PAGED:
        kv_off = tl.cast(hk, tl.int64) * stride_kh
        vv_off = tl.cast(hk, tl.int64) * stride_vh
    else:
        if HAS_BATCH_IDX:
            cb = tl.load(CACHE_BATCH_IDX + b)
        kv_off = tl.cast(cb, tl.int64) * stride_kp + tl.cast(hk, tl.int64) * stride_kh
        vv_off = tl.cast(cb, tl.int64) * stride_vp + tl.cast(hk, tl.int64) * stride_vh
    K_head = K + kv_off
    V_head = V + vv_off
    BT_ROW = BLOCK_TABLE + tl.cast(b, tl.int64) * stride_bt_b
    # the block-table entry of the last visible key: prefetches one tile ahead never read past it
    last_page = tl.maximum(leftpad + seqlen_k - 1, 0) // page_size
    head_col = hk * BLOCK_D   # column of this K/V head in the TMA descriptors' 2-D view (BLOCK_D == head_dim)

    # GQA packing: tile row r is query qi = r // group of head h = hk * group + r % group
    offs_r = start_r + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    qi = offs_r // group_size
    h = hk * group_size + offs_r % group_size
    row_ok = qi < seqlen_q
    q_rows = (tl.cast(b, tl.int64) * stride_qb + (q_start + qi).to(tl.int64) * stride_qm
              + h.to(tl.int64) * stride_qh)
    # Alg. 1 line 4: load Q_i (padding rows are 0 and never stored)
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < head_dim),
                other=0.0)
    mask_rows = 0
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n = mask_strides
    if HAS_MASK:   # each tile row's (batch, head) row of attn_mask, at cache position leftpad (key 0)
        mask_rows = (MASK + tl.cast(b, tl.int64) * stride_mask_b + h.to(tl.int64) * stride_mask_h
                     + tl.cast(leftpad, tl.int64) * stride_mask_n)
    slope2 = 0.0
    if FEATURES.ALIBI:
        slope2 = (tl.load(ALIBI_SLOPES + b * stride_alibi_b + h, mask=row_ok, other=0.0).to(tl.float32)
                  * 1.4426950408889634)[:, None]

    # Keys this tile's rows may see: the union over its first and last query row (mods.key_range of a
    # single row each), split into [lo, full_lo) masked | [full_lo, full_hi) unmasked | [full_hi, hi) masked.
    i_lo = start_r // group_size
    i_hi = tl.minimum((start_r + BLOCK_M - 1) // group_size, seqlen_q - 1)
    lo, _, full_hi, _ = key_range(i_lo, seqlen_q, seqlen_k, window_left, window_right, 1, BLOCK_N,
                                  FEATURES.HAS_LEFT, FEATURES.HAS_RIGHT)
    _, full_lo, _, hi = key_range(i_hi, seqlen_q, seqlen_k, window_left, window_right, 1, BLOCK_N,
                                  FEATURES.HAS_LEFT, FEATURES.HAS_RIGHT)
    hi = tl.maximum(hi, lo)
    # this split's share of the visible key blocks (flash-decoding). Every tile the loops below visit starts
    # at a multiple of BLOCK_N (lo, full_lo, full_hi and the split bounds are; a bound clamped to hi only ever
    # ends a loop), which is what lets a paged tile lie in one page.
    blocks_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits)
    s_lo = tl.minimum(lo + split * blocks_per_split * BLOCK_N, hi)
    s_hi = tl.minimum(s_lo + blocks_per_split * BLOCK_N, hi)
    f_lo = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    f_hi = tl.maximum(tl.minimum(full_hi, s_hi), f_lo)

    # Alg. 1 line 5: O~ = 0, l = 0, m = -inf
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # what every tile step reads (one tuple: each call names only the key range and the tile's flags)
    page = 0
    pages_vec = 0
    first_page = 0
    if PAGED and PAGE_TILES:
        if PAGE_VEC > 0:
            first_page = (leftpad + s_lo) // page_size
            # the split's block-table entries at once (the host sized PAGE_VEC to its pages): every tile's
            # entry is known before the loop, as a contiguous cache's tile positions are
            pages_vec = tl.load(BT_ROW + tl.minimum(first_page + tl.arange(0, PAGE_VEC), last_page))
        else:
            page = _page_entry(BT_ROW, leftpad + s_lo, page_size, last_page)
    row = (q, K_head, V_head, present(desc_k), present(desc_v), BT_ROW, cb, head_col, offs_n, offs_d, qi, leftpad,
           seqlen_q, seqlen_k, stride_kp, stride_kn, stride_vp, stride_vn, page_size, head_dim, scale, slope2,
           window_left, window_right, last_page, pages_vec, first_page, mask_rows, stride_mask_m, stride_mask_n)
    if PAGE_TILES and HAS_LEFTPAD:
        # a tile starts at cache position leftpad + (multiple of BLOCK_N): in one page iff leftpad is aligned
        if leftpad % BLOCK_N == 0:
            acc, l_i, m_i = _attend_split(acc, l_i, m_i, page, row, s_lo, f_lo, f_hi, s_hi, BLOCK_N, EVEN_D, PAGED,
                                          True, USE_TMA, FEATURES, DOT_PREC, PAGE_VEC, HAS_MASK)
        else:
            acc, l_i, m_i = _attend_split(acc, l_i, m_i, page, row, s_lo, f_lo, f_hi, s_hi, BLOCK_N, EVEN_D, PAGED,
                                          False, False, FEATURES, DOT_PREC, 0, HAS_MASK)
    else:
        acc, l_i, m_i = _attend_split(acc, l_i, m_i, page, row, s_lo, f_lo, f_hi, s_hi, BLOCK_N, EVEN_D, PAGED,
                                      PAGE_TILES, USE_TMA, FEATURES, DOT_PREC, PAGE_VEC, HAS_MASK)

    # Alg. 1 lines 12-13: O = O~ / l, lse2 = m + log2 l; a row that saw no key: O = 0, lse = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    if SPLIT:
        # partial of this split (fp32, log2 units), indexed by the packed query row
        row_p = _part_row(b, q_start, qi, seqlen_q_static, FEATURES.VARLEN)
        part = tl.cast(split, tl.int64) * stride_ps + row_p * stride_pm + h.to(tl.int64) * stride_ph
        tl.store(O_PART + part[:, None] + offs_d[None, :], out, mask=row_ok[:, None] & (offs_d[None, :] < head_dim))
        tl.store(LSE_PART + tl.cast(split, tl.int64) * stride_lps + row_p * stride_lpm + h, lse2, mask=row_ok)
        if FUSED_COMBINE:
            # Flash-decoding's combine, by whichever split of this tile finishes last (no second kernel): every
            # split takes a ticket after its partial is stored (the barrier orders all its threads' stores before
            # the ticket, acq_rel publishes them at GPU scope); the last one merges every split's partial of the
            # tile's rows and resets the ticket counter for the next launch on this stream
            tl.debug_barrier()
            tile = bhk * tl.num_programs(0) + pid_m
            ticket = tl.atomic_add(SEM + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                rows_end = tl.minimum(start_r + BLOCK_M, seqlen_q * group_size)
                for r0 in range(start_r, rows_end, COMBINE_RG):
                    rr = r0 + tl.arange(0, COMBINE_RG)
                    ok = rr < rows_end
                    qc = rr // group_size
                    hc = (hk * group_size + rr % group_size).to(tl.int64)
                    row_c = _part_row(b, q_start, qc, seqlen_q_static, FEATURES.VARLEN)
                    out_c, lse_c = _combine.merge_splits(
                        LSE_PART + row_c * stride_lpm + hc, O_PART + row_c * stride_pm + hc * stride_ph, ok,
                        stride_lps, stride_ps, num_splits, head_dim, COMBINE_RG, COMBINE_CHUNK, BLOCK_D)
                    _combine.store_rows(O, LSE, out_c, lse_c, b, q_start + qc, hc, ok, offs_d, head_dim,
                                        stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h)
                tl.store(SEM + tile, 0)
    else:
        _combine.store_rows(O, LSE, out, lse2 * _combine.LN2, b, q_start + qi, h, row_ok, offs_d, head_dim,
                            stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h)


@triton.jit
def _part_row(b, q_start, qi, seqlen_q_static, IS_VARLEN_Q: tl.constexpr):
    """The row of the split partials (and their LSE) that query qi of batch element b owns (int64)."""
    if IS_VARLEN_Q:
        return (q_start + qi).to(tl.int64)
    else:
        return tl.cast(b, tl.int64) * seqlen_q_static + qi


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    use_tma: bool = False   # K/V tiles by TMA where the layout allows it (else pointer loads)


# Benchmarks and tuning sweeps pin the decode launch here; empty in normal use. Keys:
#   "decode": a full DecodeConfig (replaces the default, BLOCK_M included);
#   "BLOCK_M" / "BLOCK_N" / "num_warps" / "num_stages" / "use_tma": replace that field of the default (or of
#       "decode"), e.g. {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2};
#   "num_splits": an int used wherever the caller leaves the choice to num_splits_heuristic (num_splits=0);
#   "page_tiles": False disables the one-page-per-tile paged path (every paged tile then uses the row gather);
#   "fused_combine": True / False merges the splits in the decode launch / in combine.py's separate kernel
#       whatever the split count (default: fuse_combine decides);
#   "combine_chunk": splits per merge step of the separate combine kernel (a power of two).
CONFIG_OVERRIDE: dict = {}
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeConfig))

MAX_SPLITS = 128
# The most splits the fused combine merges: the last split of a tile merges all its rows' partials alone, step after
# step, where combine.py's kernel spreads them over a program per row and head but costs a launch (same-run A/Bs on
# an H200: `git log -S FUSED_MAX_SPLITS`)
FUSED_MAX_SPLITS = 16
# ... except in eager calls (no CUDA graph being captured) reading at most EAGER_FUSED_BYTES of K/V: they are bound by
# host time, which a second launch adds to (same-run A/Bs on an H200: `git log -S EAGER_FUSED_BYTES`)
EAGER_FUSED_BYTES = 256 << 20
# num_splits_heuristic's knobs (see its docstring)
TARGET_WAVES = 2.0            # aim for >= this many programs per multiprocessor ...
WAVE_SLACK = 0.9              # ... give or take this factor
MIN_BLOCKS_PER_SPLIT = 4      # never fewer key blocks per split than this
# ... except where every program still fits in one wave: then splits of ONE_WAVE_MIN_BLOCKS blocks (rule 5 of
# num_splits_heuristic; same-run A/Bs on an H200: `git log -S ONE_WAVE_MIN_BLOCKS`)
ONE_WAVE_MIN_BLOCKS = 2
# Problems of few tiles (batch x K/V heads x row blocks at most an eighth of the SMs: batch 1-2 of a GQA model):
# one wave of longer splits (FEW_TILES_WAVES instead of TARGET_WAVES) on (BLOCK_N, num_warps, num_stages) =
# FEW_TILES_CONFIG tiles through TMA (same-run A/Bs on an H200: `git log -S FEW_TILES_CONFIG`)
FEW_TILES_WAVES = 1.0
FEW_TILES_CONFIG = (128, 4, 3)
# Paged caches whose pages hold fewer keys than the 128-key tile (pages of 16 / 32 / 64): pages below
# SMALL_PAGE_TILES keys keep the 128-key tile and gather its rows (one block-table entry per row) where each split
# has at least GATHER_MIN_TILES such tiles; other small pages (and short splits) shrink the tile to one page. Either
# way with SMALL_PAGE_STAGES stages and splits for TARGET_WAVES waves, also where few tiles would take one wave:
# both tiles are latency-bound (a dependent block-table read per tile or row, or a short copy) and run best with
# two waves of programs in flight (same-run A/Bs on an H200: `git log -S SMALL_PAGE_STAGES`)
SMALL_PAGE_TILES = 32
GATHER_MIN_TILES = 8
SMALL_PAGE_STAGES = 3
# One-page-per-tile splits of tiles of at least PAGE_VEC_MIN_BLOCK_N keys reading at most PAGE_VEC_MAX block-table
# entries load them all before the key loop (decode_kernel's PAGE_VEC) instead of each tile's one tile ahead (0:
# off); with more entries, picking one out of the vector costs each tile more (same-run A/Bs on an H200:
# `git log -S PAGE_VEC_MAX`)
PAGE_VEC_MAX = 32
PAGE_VEC_MIN_BLOCK_N = 64


def _block_m(rows: int) -> int:
    return min(64, max(16, next_pow2(rows)))


def default_decode_config(rows: int, head_dim: int, dtype: torch.dtype, few_tiles: bool = False) -> DecodeConfig:
    """rows = seqlen_q * group (the packed M extent). tl.dot needs M >= 16; beyond 64 rows the tile is
    split over several programs. few_tiles: batch x K/V heads x row blocks at most an eighth of the SMs
    (batch 1-2 of a GQA model): every program then owns only a few key tiles of its split and shorter,
    deeper-pipelined tiles pay (FEW_TILES_CONFIG). Interpreter: small tiles so that the CPU tests cross many tile
    edges."""
    block_m = _block_m(rows)
    if interpreting():
        return DecodeConfig(min(block_m, 16), 16, 4, 1)
    bd = configs.block_d(head_dim)
    if bd <= 128 and dtype != torch.float32:
        # 128-key tiles through TMA, 2 stages: the best of benchmarks/sweep_decode.py's tile grid over its
        # points; problems of few tiles take FEW_TILES_CONFIG (with FEW_TILES_WAVES in the split rule)
        if few_tiles:
            return DecodeConfig(block_m, *FEW_TILES_CONFIG, use_tma=True)
        return DecodeConfig(block_m, 128, 4, 2, use_tma=True)
    if bd <= 128:
        return DecodeConfig(block_m, 32, 4, 3)
    return DecodeConfig(block_m, 32, 4, 2)


def decode_config(rows: int, head_dim: int, dtype: torch.dtype, few_tiles: bool = False) -> DecodeConfig:
    """The launch config: default_decode_config, then CONFIG_OVERRIDE ("decode", then single fields)."""
    cfg = CONFIG_OVERRIDE.get("decode") or default_decode_config(rows, head_dim, dtype, few_tiles)
    fields = {k: CONFIG_OVERRIDE[k] for k in _CONFIG_FIELDS if k in CONFIG_OVERRIDE}
    return dataclasses.replace(cfg, **fields) if fields else cfg


def num_splits_heuristic(tiles: int, max_seqlen_k: int, block_n: int, device: torch.device,
                         sms: Optional[int] = None, waves: Optional[float] = None) -> int:
    """Number of key splits for `tiles` = m_blocks * batch * nheads_k programs per split over up to
    max_seqlen_k keys in blocks of block_n, on a GPU with `sms` multiprocessors (default: the device's).

    Decode is bound by reading K/V, and a multiprocessor reads at full speed only with several programs'
    loads in flight, so the rule is:

    1. Target: at least `waves` (default TARGET_WAVES = 2; plan_decode passes FEW_TILES_WAVES = 1 for problems
       of few tiles) waves, i.e. tiles * splits >= waves * SMs programs (WAVE_SLACK 0.9: 1.8 of 2 waves count as
       reached). Problems whose tiles reach it alone are not split (1).
    2. Each split keeps >= MIN_BLOCKS_PER_SPLIT (4) key blocks (shorter splits cost more in per-program
       set-up, partial-output writes and combine work than they gain), and at most MAX_SPLITS.
    3. Only split counts that the kernel's division really produces are candidates: blocks_per_split =
       cdiv(n_blocks, s) must give exactly s non-empty splits (s = 33 over 512 blocks gives 32 splits of 16
       and an empty 33rd program, so 33 is not a candidate).
    4. If no candidate reaches the target, the largest candidate (as many programs as rule 2 allows).
       Otherwise, among the candidates from the smallest s0 that reaches the target up to 1.5 * s0, the one
       whose last wave is fullest (wave efficiency waves / ceil(waves), waves = tiles * s / SMs), the
       smallest s among those within 0.02 of the best.
    5. Where the programs of that choice do not fill one wave (tiles * s < SMs), the largest candidate of splits of
       >= ONE_WAVE_MIN_BLOCKS (2) blocks whose programs still fit in one (tiles * s <= SMs), if larger: while every
       program runs at once, shorter splits finish sooner; past one wave the programs of a second, partial wave
       cost more than the shorter splits save.

    H200 (132 SMs), nheads_k 8, BLOCK_N 64, seqlen_q 1, two waves: batch 1 -> 16 / 32 / 33 splits at 4k / 32k /
    128k keys, batch 8 -> 4, batch >= 32 -> 1. What plan_decode takes at batch 1 (BLOCK_N 128, one wave): 16 / 16 /
    16 (12 at 4352 keys); at batch 2: 8.
    """
    if sms is None:
        sms = multiprocessors(device)
    return _num_splits(tiles, max_seqlen_k, block_n, sms, TARGET_WAVES if waves is None else waves)


@functools.lru_cache(maxsize=4096)
def _num_splits(tiles: int, max_seqlen_k: int, block_n: int, sms: int, waves: float) -> int:
    """num_splits_heuristic's rule, memoised: up to MAX_SPLITS candidates are tried, on every decode call."""
    if tiles <= 0:
        return 1
    n_blocks = cdiv(max(max_seqlen_k, 1), block_n)
    s = _target_splits(tiles, n_blocks, sms, waves)
    if tiles * s < sms:   # rule 5
        wider = [c for c in _candidates(n_blocks, ONE_WAVE_MIN_BLOCKS) if c > s and tiles * c <= sms]
        if wider:
            return wider[-1]
    return s


def _candidates(n_blocks: int, min_blocks: int) -> list:
    """Split counts >= 2 of splits of >= min_blocks of n_blocks key blocks, at most MAX_SPLITS, that the kernel's
    division really produces (rules 2 and 3)."""
    limit = min(MAX_SPLITS, n_blocks // min_blocks)
    return [s for s in range(2, limit + 1) if cdiv(n_blocks, cdiv(n_blocks, s)) == s]


def _target_splits(tiles: int, n_blocks: int, sms: int, waves: float) -> int:
    """Rules 1-4 of num_splits_heuristic."""
    need = WAVE_SLACK * waves * sms
    cands = _candidates(n_blocks, MIN_BLOCKS_PER_SPLIT)
    if tiles >= need or not cands:
        return 1
    reach = [s for s in cands if tiles * s >= need]
    if not reach:
        return cands[-1]
    window = [s for s in reach if s <= 1.5 * reach[0]]

    def wave_efficiency(s):
        waves = tiles * s / sms
        return waves / math.ceil(waves)
    best = max(wave_efficiency(s) for s in window)
    return min(s for s in window if wave_efficiency(s) >= best - 0.02)


def page_tiles_ok(page_size: int, block_n: int) -> bool:
    """Whether a paged cache can take the one-page-per-tile path: BLOCK_N divides the page size (then every
    tile that starts at a BLOCK_N-aligned position lies in one page)."""
    return page_size > 0 and page_size % block_n == 0 and CONFIG_OVERRIDE.get("page_tiles", True) is not False


@dataclass(frozen=True)
class DecodePlan:
    """What flash_decode launches for a problem (also for sweeps and reports)."""
    cfg: DecodeConfig
    m_blocks: int
    num_splits: int
    page_tiles: bool     # paged cache through the one-page-per-tile path (else the per-row gather)
    page_vec: int = 0    # one-page-per-tile splits: block-table entries loaded before the key loop (0: one ahead)


def plan_decode(seqlen_q: int, nheads: int, nheads_k: int, head_dim: int, dtype: torch.dtype, batch: int,
                max_seqlen_k: int, device: torch.device, *, page_size: int = 0, num_splits: int = 0) -> DecodePlan:
    """The config, split count (num_splits <= 0: CONFIG_OVERRIDE["num_splits"] or num_splits_heuristic) and
    paged path flash_decode uses. page_size 0: contiguous cache. Memoised per problem while CONFIG_OVERRIDE is
    empty (planning costs host time on every decode call) and the device names its index (a bare "cuda" means whichever device is current: its SM count is read per call)."""
    args = (seqlen_q, nheads, nheads_k, head_dim, dtype, batch, max_seqlen_k, device, page_size, num_splits)
    if CONFIG_OVERRIDE or (device.type == "cuda" and device.index is None):
        return _plan(*args)
    return _plan_memo(*args)


def _plan(seqlen_q: int, nheads: int, nheads_k: int, head_dim: int, dtype: torch.dtype, batch: int,
          max_seqlen_k: int, device: torch.device, page_size: int, num_splits: int) -> DecodePlan:
    group = nheads // nheads_k
    tiles = cdiv(max(seqlen_q * group, 1), _block_m(seqlen_q * group)) * batch * nheads_k
    few_tiles = 8 * tiles <= multiprocessors(device)
    cfg = decode_config(seqlen_q * group, head_dim, dtype, few_tiles=few_tiles)
    m_blocks = cdiv(max(seqlen_q * group, 1), cfg.BLOCK_M)

    def splits(cfg, waves):
        n = num_splits if num_splits > 0 else int(CONFIG_OVERRIDE.get("num_splits", 0))
        if n <= 0:
            n = num_splits_heuristic(m_blocks * batch * nheads_k, max_seqlen_k, cfg.BLOCK_N, device, waves=waves)
        return max(1, min(int(n), MAX_SPLITS, cdiv(max(max_seqlen_k, 1), cfg.BLOCK_N)))

    waves = FEW_TILES_WAVES if few_tiles else TARGET_WAVES
    if (page_size and "BLOCK_N" not in CONFIG_OVERRIDE and "decode" not in CONFIG_OVERRIDE
            and not page_tiles_ok(page_size, cfg.BLOCK_N) and page_size >= 16 and page_size & (page_size - 1) == 0):
        if cfg.BLOCK_N >= 128:
            # pages smaller than the 128-key tile (SMALL_PAGE_TILES and the constants above): SMALL_PAGE_STAGES
            # stages and two waves of splits, gathering 128-key tiles from pages below SMALL_PAGE_TILES keys ...
            cfg, waves = dataclasses.replace(cfg, num_stages=SMALL_PAGE_STAGES), TARGET_WAVES
            if page_size < SMALL_PAGE_TILES:
                n = splits(cfg, waves)
                if _tiles_per_split(max_seqlen_k, cfg.BLOCK_N, n) >= GATHER_MIN_TILES:
                    return DecodePlan(cfg, m_blocks, n, False)
        # ... else (other small power-of-two pages, short splits) the key tile shrinks to one page so each tile stays
        # inside a page (one block-table read, contiguous rows) rather than gathering rows one by one
        cfg = dataclasses.replace(cfg, BLOCK_N=min(cfg.BLOCK_N, page_size))
    n = splits(cfg, waves)
    page_tiles = page_tiles_ok(page_size, cfg.BLOCK_N)
    return DecodePlan(cfg, m_blocks, n, page_tiles, _page_vec(page_size, cfg.BLOCK_N, max_seqlen_k, n, page_tiles))


def _tiles_per_split(max_seqlen_k: int, block_n: int, num_splits: int) -> int:
    """The most key tiles one of num_splits splits visits (the kernel's blocks_per_split at max_seqlen_k keys)."""
    return cdiv(cdiv(max(max_seqlen_k, 1), block_n), num_splits)


def _page_vec(page_size: int, block_n: int, max_seqlen_k: int, num_splits: int, page_tiles: bool) -> int:
    """PAGE_VEC of a launch: for the one-page-per-tile path, a power of two >= the block-table entries a split's
    tiles read (its first tile may start inside a page); 0 (each tile's entry loaded one tile ahead) beyond
    PAGE_VEC_MAX, below PAGE_VEC_MIN_BLOCK_N keys per tile, and off that path."""
    if not page_tiles or block_n < PAGE_VEC_MIN_BLOCK_N:
        return 0
    need = next_pow2(max(2, cdiv(_tiles_per_split(max_seqlen_k, block_n, num_splits) * block_n, page_size) + 1))
    return need if need <= PAGE_VEC_MAX else 0


_plan_memo = functools.lru_cache(maxsize=4096)(_plan)


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device, dtype: torch.dtype, dims: int) -> torch.Tensor:
    """A one-element tensor of `dims` dimensions passed where the kernel takes a pointer it never reads (its flag
    is off): made once per device, not allocated on every call."""
    return torch.empty((1,) * dims, device=device, dtype=dtype)


def prepare(device: torch.device) -> None:
    """Make the decode launches' persistent device buffers (the placeholders, the ticket pool) now, in an eager call:
    made first inside a CUDA-graph memory pool (torch.compile's mode="reduce-overhead" runs a compiled step's first
    calls there), they would outlive the graph in its pool, which cudagraph trees refuse."""
    if device.type == "cuda" and not _capturing(device):
        for dtype, dims in ((torch.int32, 1), (torch.float32, 3), (torch.float32, 4)):
            _placeholder(device, dtype, dims)
        tickets(device, 1)


def fuse_combine(num_splits: int, kv_bytes: int, device: torch.device) -> bool:
    """Whether a launch of num_splits > 1 splits reading kv_bytes of K/V merges them itself (FUSED_COMBINE) rather
    than by combine.py's kernel: CONFIG_OVERRIDE["fused_combine"] if set, else up to FUSED_MAX_SPLITS splits, and
    beyond in eager calls reading at most EAGER_FUSED_BYTES."""
    if "fused_combine" in CONFIG_OVERRIDE:
        return bool(CONFIG_OVERRIDE["fused_combine"])
    return num_splits <= FUSED_MAX_SPLITS or (kv_bytes <= EAGER_FUSED_BYTES and not _capturing(device))


def _combine_shape(rows: int, num_splits: int, block_d: int):
    """(COMBINE_RG, COMBINE_CHUNK) of the fused combine: the separate kernel's splits per step, and as many of the
    tile's `rows` per step as combine.CHUNK_ELEMS allows."""
    chunk = _combine.combine_chunk(num_splits, block_d)
    return max(1, min(next_pow2(max(rows, 1)), _combine.CHUNK_ELEMS // (chunk * block_d))), chunk


def _cache_descriptor(t: torch.Tensor, block_n: int, block_d: int):
    """A TMA descriptor over the 2-D view (t.shape[0] * t.shape[1], nheads_k * headdim) of a cache
    (batch_cache, capacity, nheads_k, d) or (num_pages, page_size, nheads_k, d), for tiles of (block_n rows,
    one head). None where the kernel must use pointer loads: not a Hopper-or-newer GPU, headdim not a power of
    two >= 16 (the tile would read the next head's columns), not such a view (launch.tma_row_view: strides / base
    16-byte aligned), or more rows than int32 coordinates reach."""
    if TensorDescriptor is None or t.numel() == 0:
        return None
    if t.device.type == "cuda":
        if _device_props(t.device.index if t.device.index is not None else torch.cuda.current_device())[1] < 9:
            return None
    elif not interpreting():
        return None
    if block_d != t.shape[-1] or t.shape[0] * t.shape[1] + block_n >= 2 ** 31:
        return None
    return row_descriptor(TensorDescriptor, t, (block_n, block_d))


# decode_kernel's first _TEMPLATE_LIVE parameters are the tensors (and TMA descriptors) a decode step changes; the
# rest (ints, floats, groups of them, constexprs) are fixed by the problem
_TEMPLATE_LIVE = 17
# (caller's signature, plan, fused combine) -> _Template of a launch flash_decode made before
_TEMPLATES: dict = {}


# (caller's signature, CUDA graph capture under way) -> (key of the template that served the signature, split
# count): a decode step repeating a signature skips the plan and the key
_FAST: dict = {}


def _remember_fast(sig, device, key, num_splits: int) -> None:
    if sig is not None:
        relaunch.remember(_FAST, (sig, _capturing(device)), (key, num_splits))


def relaunch_decode(sig, q, k_cache, v_cache, out, lse, seqlens_k, cu_seqlens_q=None, cache_batch_idx=None,
                    leftpad=None, block_table=None, alibi=None, mask=None) -> int:
    """The split count of a launch through the template that served signature sig before (flash_decode's
    arguments); 0 (nothing launched) where none did, CONFIG_OVERRIDE pins a launch, or the template does not take
    these tensors."""
    served = None if CONFIG_OVERRIDE else template_for(sig, q.device)
    if served is not None and served[0].launch(q, k_cache, v_cache, out, lse, seqlens_k, cu_seqlens_q,
                                               cache_batch_idx, leftpad, block_table, alibi, mask):
        return served[1]
    return 0


def template_for(sig, device: torch.device):
    """(the _Template that served signature sig in the current capture state, its split count), or None; a
    caller may keep it and launch it directly (_Template.launch) while its own signature holds."""
    fast = _FAST.get((sig, _capturing(device))) if sig is not None else None
    tpl = _TEMPLATES.get(fast[0]) if fast is not None else None
    return None if tpl is None else (tpl, fast[1])


@dataclass(frozen=True)
class _Template:
    """How flash_decode launched a problem (its caller's signature) before: the compiled kernel bound to every
    argument but the tensors (relaunch.Bound), the grid, and how to make the per-call tensors. A decode step of a
    loop repeats one signature; the template spares it the launch's argument list, its key and the plan's
    derivations (host time)."""
    bound: relaunch.Bound
    grid: tuple
    part_shape: Optional[tuple]   # o_part's shape of a split launch (lse_part's is its first three), else None
    parts: Optional[tuple]        # (o_part, lse_part) placeholders of an unsplit launch
    n_counters: int               # ticket counters of the fused combine (0: none)
    tma_types: Optional[tuple]    # k / v cache TMA descriptors' types (runtime.DescriptorType); None: pointers
    placeholder_i32: torch.Tensor
    # [(workspace, o_part, lse_part)] of a split launch: runtime.workspace_views' kept views
    kept: list = dataclasses.field(default_factory=lambda: [None], compare=False)

    def _parts(self, device) -> tuple:
        """(o_part, lse_part) of a split launch: views of the stream's workspace (runtime.workspace_views: the
        launch writes them before it reads them, and launches on one stream run in order); else allocated (a CUDA
        graph being captured, partials above the workspace's size)."""
        shape = self.part_shape
        views = workspace_views(device, (shape, shape[:3]), self.kept)
        if views is None:
            return (torch.empty(shape, device=device, dtype=torch.float32),
                    torch.empty(shape[:3], device=device, dtype=torch.float32))
        return views

    def launch(self, q, k_cache, v_cache, out, lse, seqlens_k, cu_seqlens_q, cache_batch_idx, leftpad, block_table,
               alibi, mask) -> bool:
        """The launch flash_decode's slow path makes for these tensors; False (nothing launched) where the bound
        kernel does not take them (another alignment, device, a launch hook: relaunch.Bound)."""
        device = q.device
        dummy = seqlens_k if seqlens_k is not None else self.placeholder_i32
        counters = tickets(device, self.n_counters) if self.n_counters else dummy
        o_part, lse_part = self._parts(device) if self.part_shape is not None else self.parts
        desc_k = desc_v = None
        if self.tma_types is not None:   # (the caches have the first call's geometry: the signature says so)
            desc_k, desc_v = self.tma_types[0](k_cache), self.tma_types[1](v_cache)
            if desc_k is None or desc_v is None:
                return False
        return self.bound(self.grid, (
            q, k_cache, v_cache, out, lse, o_part, lse_part, counters, desc_k, desc_v,
            dummy if cu_seqlens_q is None else cu_seqlens_q, dummy,
            dummy if cache_batch_idx is None else cache_batch_idx, dummy if leftpad is None else leftpad,
            dummy if block_table is None else block_table, alibi, None if mask is None else mask.view(torch.uint8)),
            _CHECKED)


# the positions of a template's live arguments that a launch checks (relaunch.Bound): the caller's q, caches and
# index tensors; not out and lse (the callers' allocations: kvcache's and the dense decode step's), the parts and
# counters (the template's) nor the cache descriptors (of the template's types)
_CHECKED = (0, 1, 2, 10, 11, 12, 13, 14, 15, 16)


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, seqlens_k: Optional[torch.Tensor], params: AttnParams, *,
                 cu_seqlens_q: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                 cache_batch_idx: Optional[torch.Tensor] = None, leftpad: Optional[torch.Tensor] = None,
                 block_table: Optional[torch.Tensor] = None, alibi: Optional[torch.Tensor] = None,
                 num_splits: int = 0, max_seqlen_k: Optional[int] = None,
                 seqlen_k_static: Optional[int] = None, seqlens_add: int = 0, mask: Optional[torch.Tensor] = None,
                 sig=None) -> int:
    """out[...] = attention of q over the cache; lse[...] its natural-log LSE (-inf for rows with no key).

    q / out: (batch, seqlen_q, nheads, d), or packed (total_q, nheads, d) with cu_seqlens_q / max_seqlen_q.
    lse: (batch, nheads, seqlen_q) or (nheads, total_q) float32.
    k_cache / v_cache: (batch_cache, capacity, nheads_k, d), or (num_blocks, page_size, nheads_k, d) with
    block_table (batch, max_blocks) int32. seqlens_k (batch,) int32: batch element b sees cache positions
    [leftpad[b], seqlens_k[b] + seqlens_add); or seqlens_k None and seqlen_k_static: the same end position for
    every batch element (no tensor, no kernel to fill one). cache_batch_idx (batch,) int32: cache row of each batch element.
    mask: a bool attn_mask broadcastable to (batch, nheads, seqlen_q, capacity) (dense q, contiguous cache; True =
    may attend), applied with the mask rule of the attention kernels (elementwise.bias_mask_log2).
    sig: the caller's signature of this launch (everything but the tensors' data: shapes, strides, the mask's
    strides, the scalars): a signature launched before takes its template. Inputs are already validated. Returns
    the number of splits used.
    """
    # a signature launched before goes straight to the template that served it
    n = relaunch_decode(sig, q, k_cache, v_cache, out, lse, seqlens_k, cu_seqlens_q, cache_batch_idx, leftpad,
                        block_table, alibi, mask)
    if n:
        return n
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    sq = int(max_seqlen_q) if varlen else q.shape[1]
    total_rows = q.shape[0] if varlen else batch * sq
    nheads, head_dim = q.shape[-2], q.shape[-1]
    nheads_k = k_cache.shape[-2]
    group = nheads // nheads_k
    paged = block_table is not None
    has_seqlens = seqlens_k is not None
    if not has_seqlens and seqlen_k_static is None:
        raise ValueError("flash_decode: seqlens_k or seqlen_k_static is required")
    page_size = k_cache.shape[1] if paged else 0
    if max_seqlen_k is None:
        max_seqlen_k = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    kv_bytes = 2 * batch * max_seqlen_k * nheads_k * head_dim * k_cache.element_size()   # (the most K / V read)
    plan = plan_decode(sq, nheads, nheads_k, head_dim, q.dtype, batch, max_seqlen_k, q.device,
                       page_size=page_size, num_splits=num_splits)
    cfg, num_splits = plan.cfg, plan.num_splits
    if batch == 0 or total_rows == 0:
        return num_splits
    split = num_splits > 1
    fused = split and fuse_combine(num_splits, kv_bytes, q.device)
    key = (sig, plan, fused) if sig is not None and not CONFIG_OVERRIDE else None
    tpl = _TEMPLATES.get(key) if key is not None else None
    if tpl is not None and tpl.launch(q, k_cache, v_cache, out, lse, seqlens_k, cu_seqlens_q, cache_batch_idx,
                                      leftpad, block_table, alibi, mask):
        _remember_fast(sig, q.device, key, num_splits)
        return num_splits
    block_d = configs.block_d(head_dim)
    desc_k = desc_v = None
    if cfg.use_tma and (not paged or plan.page_tiles):
        desc_k = _cache_descriptor(k_cache, cfg.BLOCK_N, block_d)
        desc_v = _cache_descriptor(v_cache, cfg.BLOCK_N, block_d) if desc_k is not None else None
        if desc_v is None:
            desc_k = None
    use_tma = desc_k is not None
    # stands in for absent int32 pointers (never dereferenced: their flags are off)
    dummy_i32 = seqlens_k if has_seqlens else _placeholder(q.device, torch.int32, 1)
    counters = tickets(q.device, plan.m_blocks * batch * nheads_k) if fused else dummy_i32
    # (unused without the fused combine: fixed there, so that split counts share one compiled kernel)
    combine_rg, combine_chunk = _combine_shape(min(cfg.BLOCK_M, sq * group), num_splits, block_d) if fused else (1, 2)
    if split:
        o_part = torch.empty(num_splits, total_rows, nheads, head_dim, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(num_splits, total_rows, nheads, device=q.device, dtype=torch.float32)
    else:  # never touched: SPLIT=False compiles the partial stores away
        o_part, lse_part = _placeholder(q.device, torch.float32, 4), _placeholder(q.device, torch.float32, 3)
    grid = (plan.m_blocks, batch * nheads_k, num_splits)
    mask_view, *mask_strides = pair_args(mask, batch, nheads, sq, k_cache.shape[1])
    args = (
        q, k_cache, v_cache, out, lse, o_part, lse_part, counters, desc_k, desc_v,
        cu_seqlens_q if varlen else dummy_i32, dummy_i32,
        cache_batch_idx if cache_batch_idx is not None else dummy_i32,
        leftpad if leftpad is not None else dummy_i32,
        block_table if paged else dummy_i32, alibi, mask_view,
        row_strides(q), k_cache.stride()[:3], v_cache.stride()[:3], row_strides(out), lse_strides(lse),
        o_part.stride()[:3],
        lse_part.stride()[:2], block_table.stride(0) if paged else 0,
        0 if alibi is None or alibi.dim() == 1 else alibi.stride(0), tuple(mask_strides),
        (nheads_k, group), sq, int(seqlens_add) if has_seqlens else int(seqlen_k_static), head_dim, k_cache.shape[1],
        params.score_args(), (params.window_left, params.window_right), num_splits)
    kwargs = dict(
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=block_d, EVEN_D=block_d == head_dim,
        FEATURES=Features(VARLEN=varlen, HAS_LEFT=params.has_left, HAS_RIGHT=params.has_right,
                          SOFTCAP=params.softcap > 0, ALIBI=alibi is not None),
        PAGED=paged, PAGE_TILES=paged and plan.page_tiles, USE_TMA=use_tma, HAS_SEQLENS=has_seqlens,
        HAS_BATCH_IDX=cache_batch_idx is not None, HAS_LEFTPAD=leftpad is not None, SPLIT=split, FUSED_COMBINE=fused,
        COMBINE_RG=combine_rg, COMBINE_CHUNK=combine_chunk, DOT_PREC=_dot_precision(q.dtype), PAGE_VEC=plan.page_vec,
        HAS_MASK=mask is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    launched = relaunch.launch(decode_kernel, grid, args, kwargs)
    if key is not None and (not split or fused):   # (a separate combine launch is not templated)
        bound = relaunch.bind(decode_kernel, args, kwargs, _TEMPLATE_LIVE, launched)
        if bound is not None:
            _remember_fast(sig, q.device, key, num_splits)   # (the signature's next call launches it)
            relaunch.remember(_TEMPLATES, key, _Template(
                bound, grid, tuple(o_part.shape) if split else None, None if split else (o_part, lse_part),
                plan.m_blocks * batch * nheads_k if fused else 0,
                tuple(DescriptorType(TensorDescriptor, descriptor_fields(d)) for d in (desc_k, desc_v))
                if use_tma else None,
                _placeholder(q.device, torch.int32, 1)))
    if split and not fused:
        _combine.combine_splits(o_part, lse_part, out, lse, seqlen_rows=total_rows if varlen else sq,
                                chunk=int(CONFIG_OVERRIDE.get("combine_chunk", 0)))
    return num_splits
