"""Split-KV attention over a KV cache (flash-decoding): contiguous, batch-indexed, left-padded or paged K/V.

Grid (m_blocks, batch * nheads_k, num_splits). A program owns one K/V head hk of one batch element, one
tile of BLOCK_M query rows, and one split (a contiguous range of key blocks). The tile packs the GQA group's
query heads and the seqlen_q query rows into the M dimension,

    row r of the tile -> query i = r // group, head h = hk * group + r % group,

so each K/V tile is read from memory once per K/V head (not once per query head): with nheads 32 / nheads_k 8
that is 4x less traffic than a per-query-head decode, and decode is bound by exactly that traffic.

Each program runs the FA2 inner loop (Alg. 1 lines 6-10, the update itself is mods.online_softmax_step) over
its split's keys. With one split it writes the final O and LSE; with several it writes a normalised partial
O_s and its log2-sum-exp lse2_s, which combine.py merges (mods.merge_partial) into O and LSE. Splits let a
decode step with few (batch x K/V heads) tiles still fill every multiprocessor.

Keys are addressed through the cache: key j (0-based, after left padding) of batch element b sits at cache
position leftpad[b] + j, which is row (leftpad[b] + j) of cache batch row cache_batch_idx[b] (contiguous), or
slot (pos % page_size) of page block_table[b, pos // page_size] (paged). Rows are gathered one by one, so a
page may be any size (smaller or larger than BLOCK_N).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from . import combine as _combine
from .launch import AttnParams, _block_d, _dot_precision, interpreting
from .mods import key_range, load_rows, online_softmax_step, scores_log2, seq_bounds, visible


@triton.jit
def _cache_slots(BT_ROW, pos, valid, page_size, PAGED: tl.constexpr, MASKED: tl.constexpr):
    """(page, slot) int64 of cache positions pos (BLOCK_N,): contiguous caches have one 'page' (0)."""
    if PAGED:
        if MASKED:
            page = tl.load(BT_ROW + pos // page_size, mask=valid, other=0)
        else:
            page = tl.load(BT_ROW + pos // page_size)
        return page.to(tl.int64), (pos % page_size).to(tl.int64)
    else:
        return tl.zeros_like(pos).to(tl.int64), pos.to(tl.int64)


@triton.jit
def _decode_tile(acc, l_i, m_i, q, K_head, V_head, BT_ROW, start_n, offs_n, offs_d, qi, leftpad,
                 seqlen_q, seqlen_k, stride_kp, stride_kn, stride_vp, stride_vn, page_size, head_dim,
                 score_scale, softcap_log2, slope2, window_left, window_right,
                 MASKED: tl.constexpr, EVEN_D: tl.constexpr, PAGED: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DOT_PREC: tl.constexpr):
    """One step j of the inner loop (FA2 Alg. 1 lines 7-10) for the key block starting at start_n."""
    cols = start_n + offs_n                      # key index within the sequence (after left padding)
    valid = cols < seqlen_k
    page, slot = _cache_slots(BT_ROW, leftpad + cols, valid, page_size, PAGED, MASKED)
    k = load_rows(K_head + (page * stride_kp + slot * stride_kn)[:, None] + offs_d[None, :], valid, offs_d,
                   head_dim, MASKED, EVEN_D)
    # Alg. 1 line 8: S = Q K_j^T, scaled / soft-capped / ALiBi-biased, in log2 units
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    s, _ = scores_log2(qk, qi[:, None], cols[None, :], seqlen_q, seqlen_k, score_scale, softcap_log2, slope2,
                       SOFTCAP, ALIBI)
    if MASKED:
        s = tl.where(visible(qi[:, None], cols[None, :], seqlen_q, seqlen_k, window_left, window_right,
                             HAS_LEFT, HAS_RIGHT), s, float("-inf"))
    # Alg. 1 line 9: running max m_i, P~ = exp2(S - m_i), running sum l_i
    m_i, p, alpha, l_i = online_softmax_step(m_i, l_i, s, MASKED)
    v = load_rows(V_head + (page * stride_vp + slot * stride_vn)[:, None] + offs_d[None, :], valid, offs_d,
                   head_dim, MASKED, EVEN_D)
    # Alg. 1 line 10: O~ = diag(alpha) O~ + P~ V_j
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def decode_kernel(
    Q, K, V, O, LSE, O_PART, LSE_PART,
    CU_SEQLENS_Q, SEQLENS_K, CACHE_BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI_SLOPES,
    stride_qb, stride_qm, stride_qh, stride_kp, stride_kn, stride_kh, stride_vp, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh, stride_lse_b, stride_lse_h,
    stride_ps, stride_pm, stride_ph, stride_lps, stride_lpm,
    stride_bt_b, stride_alibi_b,
    nheads_k, group_size, seqlen_q_static, head_dim, page_size,
    score_scale, softcap_log2, window_left, window_right, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    IS_VARLEN_Q: tl.constexpr, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bhk = tl.program_id(1)
    split = tl.program_id(2)
    b = bhk // nheads_k
    hk = bhk % nheads_k
    q_start, seqlen_q = seq_bounds(b, CU_SEQLENS_Q, seqlen_q_static, IS_VARLEN_Q)
    start_r = pid_m * BLOCK_M
    if start_r >= seqlen_q * group_size:
        return
    leftpad = 0
    if HAS_LEFTPAD:
        leftpad = tl.load(LEFTPAD + b)
    seqlen_k = tl.load(SEQLENS_K + b) - leftpad   # visible keys: cache positions [leftpad, seqlens_k[b])
    if PAGED:
        kv_off = tl.cast(hk, tl.int64) * stride_kh
        vv_off = tl.cast(hk, tl.int64) * stride_vh
    else:
        cb = b
        if HAS_BATCH_IDX:
            cb = tl.load(CACHE_BATCH_IDX + b)
        kv_off = tl.cast(cb, tl.int64) * stride_kp + tl.cast(hk, tl.int64) * stride_kh
        vv_off = tl.cast(cb, tl.int64) * stride_vp + tl.cast(hk, tl.int64) * stride_vh
    K_head = K + kv_off
    V_head = V + vv_off
    BT_ROW = BLOCK_TABLE + tl.cast(b, tl.int64) * stride_bt_b

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
    slope2 = 0.0
    if ALIBI:
        slope2 = (tl.load(ALIBI_SLOPES + b * stride_alibi_b + h, mask=row_ok, other=0.0).to(tl.float32)
                  * 1.4426950408889634)[:, None]

    # Keys this tile's rows may see: the union over its first and last query row (mods.key_range of a
    # single row each), split into [lo, full_lo) masked | [full_lo, full_hi) unmasked | [full_hi, hi) masked.
    i_lo = start_r // group_size
    i_hi = tl.minimum((start_r + BLOCK_M - 1) // group_size, seqlen_q - 1)
    lo, _, full_hi, _ = key_range(i_lo, seqlen_q, seqlen_k, window_left, window_right, 1, BLOCK_N,
                                  HAS_LEFT, HAS_RIGHT)
    _, full_lo, _, hi = key_range(i_hi, seqlen_q, seqlen_k, window_left, window_right, 1, BLOCK_N,
                                  HAS_LEFT, HAS_RIGHT)
    hi = tl.maximum(hi, lo)
    # this split's share of the visible key blocks (flash-decoding)
    blocks_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits)
    s_lo = tl.minimum(lo + split * blocks_per_split * BLOCK_N, hi)
    s_hi = tl.minimum(s_lo + blocks_per_split * BLOCK_N, hi)
    f_lo = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    f_hi = tl.maximum(tl.minimum(full_hi, s_hi), f_lo)

    # Alg. 1 line 5: O~ = 0, l = 0, m = -inf
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Alg. 1 line 6: for each key block of the split
    for start_n in range(s_lo, f_lo, BLOCK_N):
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, K_head, V_head, BT_ROW, start_n, offs_n, offs_d, qi, leftpad,
                                     seqlen_q, seqlen_k, stride_kp, stride_kn, stride_vp, stride_vn, page_size,
                                     head_dim, score_scale, softcap_log2, slope2, window_left, window_right,
                                     True, EVEN_D, PAGED, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DOT_PREC)
    for start_n in range(f_lo, f_hi, BLOCK_N):
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, K_head, V_head, BT_ROW, start_n, offs_n, offs_d, qi, leftpad,
                                     seqlen_q, seqlen_k, stride_kp, stride_kn, stride_vp, stride_vn, page_size,
                                     head_dim, score_scale, softcap_log2, slope2, window_left, window_right,
                                     False, EVEN_D, PAGED, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DOT_PREC)
    for start_n in range(f_hi, s_hi, BLOCK_N):
        acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, K_head, V_head, BT_ROW, start_n, offs_n, offs_d, qi, leftpad,
                                     seqlen_q, seqlen_k, stride_kp, stride_kn, stride_vp, stride_vn, page_size,
                                     head_dim, score_scale, softcap_log2, slope2, window_left, window_right,
                                     True, EVEN_D, PAGED, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, DOT_PREC)

    # Alg. 1 lines 12-13: O = O~ / l, lse2 = m + log2 l; a row that saw no key: O = 0, lse = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    o_mask = row_ok[:, None] & (offs_d[None, :] < head_dim)
    if SPLIT:
        # partial of this split (fp32, log2 units), indexed by the packed query row
        if IS_VARLEN_Q:
            row_g = (q_start + qi).to(tl.int64)
        else:
            row_g = tl.cast(b, tl.int64) * seqlen_q_static + qi
        part = tl.cast(split, tl.int64) * stride_ps + row_g * stride_pm + h.to(tl.int64) * stride_ph
        tl.store(O_PART + part[:, None] + offs_d[None, :], out, mask=o_mask)
        tl.store(LSE_PART + tl.cast(split, tl.int64) * stride_lps + row_g * stride_lpm + h, lse2, mask=row_ok)
    else:
        o_rows = (tl.cast(b, tl.int64) * stride_ob + (q_start + qi).to(tl.int64) * stride_om
                  + h.to(tl.int64) * stride_oh)
        tl.store(O + o_rows[:, None] + offs_d[None, :], out.to(O.dtype.element_ty), mask=o_mask)
        lse_ptrs = (LSE + tl.cast(b, tl.int64) * stride_lse_b + h.to(tl.int64) * stride_lse_h
                    + (q_start + qi).to(tl.int64))
        tl.store(lse_ptrs, lse2 * 0.6931471805599453, mask=row_ok)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


# Benchmarks and tuning sweeps pin a config here (a DecodeConfig under "decode"); empty in normal use.
CONFIG_OVERRIDE: dict = {}
MAX_SPLITS = 128


def decode_config(rows: int, head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """rows = seqlen_q * group (the packed M extent). tl.dot needs M >= 16; beyond 64 rows the tile is
    split over several programs. Interpreter: small tiles so that the CPU tests cross many tile edges."""
    if "decode" in CONFIG_OVERRIDE:
        return CONFIG_OVERRIDE["decode"]
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    if interpreting():
        return DecodeConfig(min(block_m, 16), 16, 4, 1)
    bd = _block_d(head_dim)
    if bd <= 128:
        return DecodeConfig(block_m, 64 if dtype != torch.float32 else 32, 4, 3)
    return DecodeConfig(block_m, 32, 4, 2)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits_heuristic(tiles: int, max_seqlen_k: int, block_n: int, device: torch.device) -> int:
    """How many splits of the keys so that tiles * splits programs fill the GPU (about two programs per
    multiprocessor), while each split keeps at least 4 key blocks (a shorter split costs more in launch,
    partial writes and combine than it gains). On the CPU a small count, so the tests exercise the combine."""
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 8
    if tiles >= 0.8 * sms:
        return 1
    n_blocks = triton.cdiv(max(max_seqlen_k, 1), block_n)
    return max(1, min(triton.cdiv(2 * sms, tiles), n_blocks // 4, MAX_SPLITS))


def _rows3(t: torch.Tensor):
    """(stride_batch, stride_row, stride_head) of a dense 4-D or a packed 3-D tensor."""
    if t.dim() == 4:
        return t.stride(0), t.stride(1), t.stride(2)
    return 0, t.stride(0), t.stride(1)


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, seqlens_k: torch.Tensor, params: AttnParams, *,
                 cu_seqlens_q: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                 cache_batch_idx: Optional[torch.Tensor] = None, leftpad: Optional[torch.Tensor] = None,
                 block_table: Optional[torch.Tensor] = None, alibi: Optional[torch.Tensor] = None,
                 num_splits: int = 0, max_seqlen_k: Optional[int] = None) -> int:
    """out[...] = attention of q over the cache; lse[...] its natural-log LSE (-inf for rows with no key).

    q / out: (batch, seqlen_q, nheads, d), or packed (total_q, nheads, d) with cu_seqlens_q / max_seqlen_q.
    lse: (batch, nheads, seqlen_q) or (nheads, total_q) float32.
    k_cache / v_cache: (batch_cache, capacity, nheads_k, d), or (num_blocks, page_size, nheads_k, d) with
    block_table (batch, max_blocks) int32. seqlens_k (batch,) int32: batch element b sees cache positions
    [leftpad[b], seqlens_k[b]). cache_batch_idx (batch,) int32: cache row of each batch element.
    Inputs are already validated. Returns the number of splits used.
    """
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    sq = int(max_seqlen_q) if varlen else q.shape[1]
    total_rows = q.shape[0] if varlen else batch * sq
    nheads, head_dim = q.shape[-2], q.shape[-1]
    nheads_k = k_cache.shape[-2]
    group = nheads // nheads_k
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 1
    if max_seqlen_k is None:
        max_seqlen_k = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    cfg = decode_config(sq * group, head_dim, q.dtype)
    m_blocks = triton.cdiv(max(sq * group, 1), cfg.BLOCK_M)
    if num_splits <= 0:
        num_splits = num_splits_heuristic(m_blocks * batch * nheads_k, max_seqlen_k, cfg.BLOCK_N, q.device)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS, triton.cdiv(max(max_seqlen_k, 1), cfg.BLOCK_N)))
    if batch == 0 or total_rows == 0:
        return num_splits
    split = num_splits > 1
    score_scale, softcap_log2 = params.score_args()
    block_d = _block_d(head_dim)
    if split:
        o_part = torch.empty(num_splits, total_rows, nheads, head_dim, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(num_splits, total_rows, nheads, device=q.device, dtype=torch.float32)
    else:  # never touched: SPLIT=False compiles the partial stores away
        o_part = torch.empty(1, 1, 1, 1, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(1, 1, 1, device=q.device, dtype=torch.float32)
    lse_sb, lse_sh = (lse.stride(0), lse.stride(1)) if lse.dim() == 3 else (0, lse.stride(0))
    dummy_i32 = seqlens_k  # stands in for absent int32 pointers (never dereferenced: flags are off)
    grid = (m_blocks, batch * nheads_k, num_splits)
    decode_kernel[grid](
        q, k_cache, v_cache, out, lse, o_part, lse_part,
        cu_seqlens_q if varlen else dummy_i32, seqlens_k,
        cache_batch_idx if cache_batch_idx is not None else dummy_i32,
        leftpad if leftpad is not None else dummy_i32,
        block_table if paged else dummy_i32, alibi,
        *_rows3(q), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *_rows3(out), lse_sb, lse_sh,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        block_table.stride(0) if paged else 0,
        0 if alibi is None or alibi.dim() == 1 else alibi.stride(0),
        nheads_k, group, sq, head_dim, page_size,
        score_scale, softcap_log2, params.window_left, params.window_right, num_splits,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=block_d, EVEN_D=block_d == head_dim,
        IS_VARLEN_Q=varlen, PAGED=paged, HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_LEFTPAD=leftpad is not None, HAS_LEFT=params.window_left >= 0, HAS_RIGHT=params.window_right >= 0,
        SOFTCAP=params.softcap > 0, ALIBI=alibi is not None, SPLIT=split, DOT_PREC=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        _combine.combine_splits(o_part, lse_part, out, lse, seqlen_rows=total_rows if varlen else sq)
    return num_splits
